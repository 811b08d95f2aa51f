// Host-side pieces shared by the sm90 launchers: device facts queried once per device and the TMA
// tensor maps every instance uses (the launchers' assertion: common/assert.h).
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "common/assert.h"
#include "fusemoe/error.h"

namespace fusemoe::sm90 {

// bf16 elements of one TMA box row: one 128-byte swizzle row, which is what the wgmma
// shared-memory descriptors expect.
constexpr int kTensorMapBoxInner = 64;
// Bytes of one box row of every tensor map here (the 128-byte swizzle span).
constexpr uint32_t kSwizzleBytes = 128;

struct DeviceInfo {
  int device;
  int num_sms;
  int max_smem_optin;
};

// Facts of the current device (checked to be compute capability 9.0), queried once per
// device: launchers run on every call and these never change.
DeviceInfo device_info();

// Raises `kernel`'s dynamic shared-memory limit to `limit_bytes` on `device`, once: `configured`
// is the caller's static per-kernel set of devices already done (bit d; devices >= 64 are set
// on every call). A limit, not an allocation: each launch still asks for what its E needs, so
// one limit sized for the largest E serves every call, and threads running layers of
// different E never race on the attribute.
void raise_smem_limit_once(const void* kernel, size_t limit_bytes, int device,
                           std::atomic<uint64_t>* configured);

// Row-major bf16 matrix [outer, inner] read in boxes of [box_outer, kTensorMapBoxInner] with
// the 128-byte swizzle; out-of-range elements read as zero. `name` goes into errors.
CUtensorMap make_tensor_map_bf16(const void* base, uint64_t inner, uint64_t outer,
                                 uint32_t box_outer, const char* name);

// The same over columns [0, inner) of rows row_stride elements apart (a column slice of a wider
// matrix: base 16-byte aligned, row_stride * 2 a multiple of 16).
CUtensorMap make_tensor_map_bf16_rows(const void* base, uint64_t inner, uint64_t outer, uint64_t row_stride,
                                      uint32_t box_outer, const char* name);

// Row-major fp32 or bf16 matrix [outer, inner] stored in boxes of [box_outer, 128 bytes] with
// the 128-byte swizzle (32 fp32 or 64 bf16 per box row); elements outside the matrix are not
// written. The weight-gradient epilogue's output map.
CUtensorMap make_store_tensor_map(const void* base, bool fp32, uint64_t inner, uint64_t outer,
                                  uint32_t box_outer, const char* name);

// Row-major E4M3 matrix [outer, inner] (bytes) read in boxes of [box_outer, 128] with the 128-byte
// swizzle (one FP8 K-block per box row); out-of-range elements read as zero.
CUtensorMap make_tensor_map_fp8(const void* base, uint64_t inner, uint64_t outer, uint32_t box_outer,
                                const char* name);

}  // namespace fusemoe::sm90

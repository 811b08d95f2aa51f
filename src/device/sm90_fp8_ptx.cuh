// PTX wrappers of the blockwise FP8 path (Precision::kFp8Blockwise) on sm_90a, beside
// sm90_ptx.cuh's: wgmma with E4M3 operands, the E4M3 conversion, 4-byte cp.async (per-row scales
// gathered into shared memory) and the cp.async arrive that adds its own pending arrival.
//
// FP8 wgmma reads both operands K-major from shared memory (no transpose bits exist for 8-bit
// types). One 128-byte swizzle row holds 128 E4M3 values, one 1 x 128 scale block along K, so an
// FP8 K-block is 128 wide and its tiles have the same bytes and descriptors as a BF16 K-block of
// 64: four k32 instructions step the descriptor by 32 bytes each, as four bf16 k16 do.
#pragma once

#include <cstdint>

#include "device/sm90_ptx.cuh"

namespace fusemoe::sm90 {

// ------------------------------------------------------------------------------------ wgmma

// wgmma.mma_async m64 x kN x k32, E4M3 x E4M3, fp32 accumulators d[0, kN/2) with the fragment
// layout of sm90_ptx.cuh. scale_d = 0 overwrites the accumulators, 1 accumulates.
template <int kN>
struct WgmmaE4m3;

template <>
struct WgmmaE4m3<128> {
  static constexpr int kAccRegs = 64;
  static constexpr int kK = 32;
  __device__ __forceinline__ static void mma(float (&d)[kAccRegs], uint64_t desc_a, uint64_t desc_b,
                                             uint32_t scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" FUSEMOE_ACC_REGS_0_63
                 "}, %64, %65, p, 1, 1;\n}\n"
                 : FUSEMOE_ACC32(0), FUSEMOE_ACC32(32)
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};

// ------------------------------------------------------------------------------ conversion

// Two fp32 to two E4M3 (round to nearest even, saturated to +-448, NaN kept): lo in bits [0, 8),
// hi in bits [8, 16). Matches host::float_to_e4m3_bits (reference/fp8_host.h).
__device__ __forceinline__ uint32_t cvt_e4m3x2(float lo, float hi) {
  uint16_t packed;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  return packed;
}

// Four fp32 to four E4M3 bytes, v[0] lowest.
__device__ __forceinline__ uint32_t cvt_e4m3x4(float v0, float v1, float v2, float v3) {
  return cvt_e4m3x2(v0, v1) | (cvt_e4m3x2(v2, v3) << 16);
}

// -------------------------------------------------------------------------------- cp.async

// 4-byte global -> shared copy (per-row scales); .ca is the only cache mode for sizes below 16.
__device__ __forceinline__ void cp_async_4(uint32_t smem_dst, const void* global_src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_dst), "l"(global_src) : "memory");
}

// ------------------------------------------------------------------------------ shared loads

// ld.shared of one fp32 at a 32-bit shared address (a generic load of a pointer whose address
// space the compiler cannot see costs a 64-bit address and a generic access).
__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

}  // namespace fusemoe::sm90

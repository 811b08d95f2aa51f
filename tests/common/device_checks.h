// Device-side helpers of the checks in tests and benchmarks: random fills, an elementwise
// comparison against an fp32 or bf16 reference, the poison check (rows a kernel must not
// write still hold 0xFF bytes) and bitwise equality.
//
// compare() judges each element x = out[dest] against y = ref[r, c] * scale + addend[dest]:
// bad when !(|x - y| <= rtol |y| + atol), so NaN fails. dest = out_row[r] (or r) * out_stride
// + c. Error figures (max |x - y|, relative L2, DeepGEMM's calc_diff) are summed in fp64 over
// the pairs where both are finite; non-finite values are counted apart.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace fusemoe::harness {

enum class DType { kBf16, kFp32 };

struct DeviceTensor {
  const void* ptr = nullptr;
  DType dtype = DType::kBf16;
};
inline DeviceTensor bf16_tensor(const void* ptr) { return {ptr, DType::kBf16}; }
inline DeviceTensor fp32_tensor(const void* ptr) { return {ptr, DType::kFp32}; }

// out[i] = scale * N(0, 1) for i < n, from a counter-based hash of (seed, i): the same values
// for the same seed on any grid.
void fill_normal_bf16(void* out, int64_t n, uint64_t seed, float scale, cudaStream_t stream = nullptr);
void fill_normal_fp32(float* out, int64_t n, uint64_t seed, float scale, cudaStream_t stream = nullptr);

struct CompareOptions {
  const int32_t* out_row = nullptr;  // [rows] device; null: row r of out is row r
  int64_t out_stride = -1;           // elements per out row; -1: cols
  const float* row_scale = nullptr;  // indexed by the out row; null: 1
  DeviceTensor addend;               // same layout as out; null: 0
  double rtol = 0.0;
  double atol = 0.0;                 // absolute
  double atol_of_rms = 0.0;          // added to atol: this times rms(y), from a first pass
};

struct CompareResult {
  uint64_t num_bad = 0;       // elements failing the tolerance, NaN included
  int64_t first_bad = -1;     // smallest flat index r * cols + c of a bad element
  uint64_t nonfinite_out = 0, nonfinite_ref = 0;
  double max_abs_err = 0.0;   // over finite pairs
  double rel_l2 = 0.0;        // ||x - y|| / ||y||; absolute where ||y|| = 0
  double calc_diff = 0.0;     // 1 - 2<x, y> / (|x|^2 + |y|^2)
  double rms_ref = 0.0;
  double atol = 0.0;          // the absolute tolerance applied
  int64_t count = 0;          // rows * cols
  // "bad 0 / 4096, max_abs_err ..., first bad (row r, col c)".
  std::string describe(int64_t cols) const;
};

// Waits for all work on the device first (so the inputs may come from any stream).
CompareResult compare(DeviceTensor out, DeviceTensor ref, int64_t rows, int64_t cols, const CompareOptions& options);

// The counts below wait for all work on the device first, as compare() does.
// Bytes other than `value` in the rows r < rows with keep[r] != 0 of a [rows, row_bytes] buffer.
uint64_t count_bytes_other_than(const void* buffer, int64_t rows, int64_t row_bytes, const uint8_t* keep_device,
                                uint8_t value);
// Bytes that no longer hold the poison (0xFF) in the rows with keep[r] != 0.
inline uint64_t count_unpoisoned(const void* buffer, int64_t rows, int64_t row_bytes, const uint8_t* keep_device) {
  return count_bytes_other_than(buffer, rows, row_bytes, keep_device, 0xFF);
}

// Bytes that differ between two device buffers.
uint64_t count_different_bytes(const void* a, const void* b, size_t bytes);
// The same over the rows r with keep[r] != 0 of two [rows, row_bytes] buffers.
uint64_t count_different_bytes_in_rows(const void* a, const void* b, int64_t rows, int64_t row_bytes,
                                       const uint8_t* keep_device);

}  // namespace fusemoe::harness

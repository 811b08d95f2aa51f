// Standalone quantization kernels of the blockwise FP8 path (Precision::kFp8Blockwise); the
// recipe (scale = amax / 448, E4M3 round-to-nearest-even, saturated) is in
// src/device/fp8_quantize.cuh and, bit for bit, reference/fp8_host.h.
//
//   activations  1 x 128 blocks along the row (H): x once per token in the forward; the
//                backward's x and dy pool rows, with their bf16 copies in the same pass
//   weights      128 x 128 blocks of each expert's [R, C] matrix, plus the transposed [C, R] copy
//                (same blocks, same scales) that Hopper's K-major-only FP8 wgmma needs where the
//                BF16 path reads the weight N-major
// Shape legend: T tokens, H hidden (multiple of 128), R rows, E experts.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fusemoe {

// Where the scale of row r, block b goes: scales[r * row_stride + b * block_stride].
// Row-major [rows, H/128]: (H/128, 1); block-major [H/128, rows_pad]: (1, rows_pad).
struct Fp8ScaleLayout {
  int64_t row_stride = 0;
  int64_t block_stride = 0;
};

// A second bf16 [*, H] source that a row quantization also copies, plain, to the same destination
// rows in the same pass (the FP8 backward's x pool beside its dy quantization); src null: none.
struct Fp8RowsPlainCopy {
  const void* src_bf16 = nullptr;
  void* dst_bf16_RH = nullptr;
};

// Quantizes x [T, H] (bf16) once per token in 1 x 128 blocks: fp8_TH [T, H] E4M3 and scales
// row-major [T, H/128].
void launch_quantize_token_rows_fp8(const void* x_bf16, int64_t num_tokens, int64_t hidden, void* fp8_TH,
                                    float* scales, cudaStream_t stream);

// Quantizes the num_src_rows rows of a bf16 [*, H] matrix in 1 x 128 blocks, each once, and stores
// source row t to each of its valid slots' pool rows slot_row[t * top_k + j] >= 0 (the backward's
// pools, token-major: every token read once). Writes fp8_RH [rows, H] E4M3, the scales (layout
// above) and, when dst_bf16_RH is not null, the plain bf16 copy of each row (the BF16 weight
// gradients' pools); `also` is copied the same way. Rows no slot maps to stay untouched.
void launch_quantize_pool_rows_fp8(const void* src_bf16, const int32_t* slot_row, int64_t num_src_rows,
                                   int64_t top_k, int64_t hidden, void* dst_bf16_RH, void* fp8_RH, float* scales,
                                   Fp8ScaleLayout layout, cudaStream_t stream, const Fp8RowsPlainCopy& also = {});

// Quantizes E matrices [rows, cols] (bf16, both multiples of 128) in 128 x 128 blocks:
// q [E, rows, cols] E4M3, q_t [E, cols, rows] (the transpose; skipped when null) and
// scales [E, rows/128, cols/128] fp32 (block (i, j) of the transpose is block (j, i) here).
// w_up_bf16 null: w_bf16 is [E, rows, cols]. Set: matrix e is w_bf16's [rows/2, cols] matrix e over
// w_up_bf16's (separate gate and up weights w1, w3 as w13; rows/2 a multiple of 128), the same bytes.
void launch_quantize_weights_fp8(const void* w_bf16, const void* w_up_bf16, int64_t num_experts, int64_t rows,
                                 int64_t cols, void* q, void* q_t, float* scales, cudaStream_t stream);

}  // namespace fusemoe

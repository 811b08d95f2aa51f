// Standalone quantization kernels of the blockwise FP8 path (Precision::kFp8Blockwise); the
// recipe (scale = amax / 448, E4M3 round-to-nearest-even, saturated) is in
// src/device/fp8_quantize.cuh and, bit for bit, reference/fp8_host.h.
//
//   activations  1 x 128 blocks along the row (H), once per token: x in the forward (and in the
//                backward that recomputes z); dy in the backward, with the bf16 x and dy pools
//                scattered in the same pass
//   weights      128 x 128 blocks of each expert's [R, C] matrix, plus the transposed [C, R] copy
//                (same blocks, same scales) that Hopper's K-major-only FP8 wgmma needs where the
//                BF16 path reads the weight N-major
// Shape legend: T tokens, H hidden (multiple of 128), R rows, E experts.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fusemoe {

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

// The same for rows whose count only the device knows (the expert-parallel owner's pulled token
// rows): rows [0, *num_rows_device) of x [max_rows, H], the grid sized for max_rows, no host
// synchronisation; each row's bytes are those launch_quantize_token_rows_fp8 writes for it.
void launch_quantize_token_rows_fp8_device_count(const void* x_bf16, const int32_t* num_rows_device, int64_t max_rows,
                                                 int64_t hidden, void* fp8_TH, float* scales, cudaStream_t stream);

// The FP8 backward's dy: quantizes the num_src_rows rows of a bf16 [*, H] matrix in 1 x 128
// blocks, each once, as launch_quantize_token_rows_fp8 does (fp8_TH [rows, H] E4M3, scales
// row-major [rows, H/128]; the GEMM that reads them gathers token rows), and in the same pass
// stores source row t's plain bf16 copy to each valid slot's pool row slot_row[t * top_k + j] >= 0
// of dst_bf16_RH (the BF16 weight gradients' pools, token-major: every token read once; null:
// none); `also` is copied the same way (x's pool beside dy's). Pool rows no slot maps to stay
// untouched.
void launch_quantize_pool_rows_fp8(const void* src_bf16, const int32_t* slot_row, int64_t num_src_rows,
                                   int64_t top_k, int64_t hidden, void* dst_bf16_RH, void* fp8_TH, float* scales,
                                   cudaStream_t stream, const Fp8RowsPlainCopy& also = {});

// Quantizes E matrices [rows, cols] (bf16, both multiples of 128) in 128 x 128 blocks:
// q [E, rows, cols] E4M3, q_t [E, cols, rows] (the transpose; skipped when null) and
// scales [E, rows/128, cols/128] fp32 (block (i, j) of the transpose is block (j, i) here).
// w_up_bf16 null: w_bf16 is [E, rows, cols]. Set: matrix e is w_bf16's [rows/2, cols] matrix e over
// w_up_bf16's (separate gate and up weights w1, w3 as w13; rows/2 a multiple of 128), the same bytes.
void launch_quantize_weights_fp8(const void* w_bf16, const void* w_up_bf16, int64_t num_experts, int64_t rows,
                                 int64_t cols, void* q, void* q_t, float* scales, cudaStream_t stream);

// ---- Token-blocked pools (LayerConfig::fp8_weight_grads; src/kernels/fp8_token_blocked.cu)
// A weight gradient reduces over an expert's rows, and Hopper's E4M3 wgmma reads K-major operands
// only, so its operands are transposed, token-contiguous, in blocks of 128 positions: q [P/128]
// [C features][128 positions] (position p of feature c at ((p / 128) * C + c) * 128 + p % 128), so
// a quantizer CTA's 128 features x 128 positions are 16 contiguous KB and a GEMM K-block of 128
// features one TMA box. Expert e's pool rows [off[e], off[e+1]) sit at positions [pad[e], pad[e] +
// count_e), pad[e] a multiple of 128 (sum of the previous experts' counts rounded up to 128);
// positions up to pad[e+1] hold zeros, so a 128-position block is one expert's and its padding adds
// nothing. Positions >= pad[E] are never written (nor read by the GEMM).
enum class Fp8TokenScales {
  kPer128Tokens,  // a scale per feature and 128-position block: scales [P/128, C]
  kPer128x128,    // a scale per 128 features x 128 positions: scales [P/128, C/128]
};

// Positions of a pool of max_rows rows over num_experts experts (the worst case of the padding).
int64_t fp8_token_blocked_positions(int64_t max_rows, int64_t num_experts);

// pad[0..E] from expert_offsets, and block_expert[b] (b < p_max/128): the expert of position block
// b, or -1 for a block at or past pad[E]. One small launch; no host synchronisation.
void launch_token_block_offsets(const int32_t* expert_offsets, int64_t num_experts, int64_t p_max,
                                int32_t* padded_offsets, int32_t* block_expert, cudaStream_t stream);

struct Fp8TokenBlockedParams {
  const void* src = nullptr;                // bf16 rows, ld elements apart; columns [0, cols) are read
  int64_t ld = 0;
  int64_t cols = 0;                         // C, a multiple of 128
  const int32_t* row_slot = nullptr;        // null: pool row r is source row r; set: source row row_slot[r] / top_k
  int64_t top_k = 1;
  const int32_t* expert_offsets = nullptr;  // [E+1] device
  const int32_t* padded_offsets = nullptr;  // [E+1] device (launch_token_block_offsets)
  const int32_t* block_expert = nullptr;    // [p_max/128] device (launch_token_block_offsets)
  int64_t p_max = 0;                        // positions per q row, fp8_token_blocked_positions(R_max, E)
  void* q = nullptr;                        // [p_max/128, C, 128] E4M3
  float* scales = nullptr;                  // per mode
  Fp8TokenScales mode = Fp8TokenScales::kPer128Tokens;
  cudaStream_t stream = nullptr;
};

// The recipe of fp8_quantize.cuh over each block of the token-blocked layout (amax over the block's
// 128 positions of one feature, or of 128 features; padding counts as zero).
void launch_quantize_token_blocked_fp8(const Fp8TokenBlockedParams& p);

}  // namespace fusemoe

// Host launchers of the block-scaled FP8 instances of the sm90 grouped GEMM
// (src/device/sm90_block_scaled.cuh; docs/design.md#blockwise-fp8-issue-16-precisionkfp8blockwise).
// Same rows problem and conventions as sm90_grouped_gemm.h; every FP8 tile is 256 accumulator
// columns wide (gate/up: 128 columns of h) and every K a multiple of 128 (H % 128 == 0 and I % 128 == 0, checked by src/api).
//
//   gate/up + SwiGLU  z_r = dq(x_fp8[s / K]) dq(W13_e)^T, h_r = bf16(silu(g) u) -> h_fp8 + scales
//                     (1 x 128 along I); optionally bf16 z (before the clamp)
//   down + weight     ys[s] = bf16(w * dq(h_fp8_r) dq(W2_e)^T)
//   recompute z       z_r = bf16(dq(x_fp8[s / K]) dq(W13_e)^T)
//   dgrad + SwiGLU    a = dq(dy_fp8[s / K]) dq(W2_e) (read as W2_e^T, K-major); as the BF16 dgrad
//                     epilogue, plus dz_fp8 + scales (1 x 128 along 2I, from the bf16 dz)
//   dgrad of x        dx_slots[s] = bf16(dq(dz_fp8_r) dq(W13_e)) (read as W13_e^T)
//   weight gradients  grad_e = dq(a) dq(b)^T over expert e's positions of token-blocked pools
// dq: E4M3 code times its block's scale; products accumulate in fp32 per 128-wide K-block and are
// promoted with scale_a * scale_b. Activation scale pools are block-major [K/128, rows_pad]
// (rows_pad = sm90_fp8_rows_pad(R_max)); those of the token rows the gate/up, the z recompute and
// dgrad + SwiGLU gather (x, dy) are token-major [T, H/128].
#pragma once

#include <cstdint>

#include "fusemoe/fusemoe.h"
#include "launchers/sm90_grouped_gemm.h"

namespace fusemoe {

// Row stride of the block-major scale pools: R_max rounded up to 4 (each K-block's scales
// start 16-byte aligned).
inline int64_t sm90_fp8_rows_pad(int64_t max_rows) { return (max_rows + 3) / 4 * 4; }

struct Sm90Fp8GateUpParams {
  Sm90Rows rows;
  const void* x_fp8 = nullptr;         // [T, H] E4M3
  const float* x_scales = nullptr;     // [T, H/128]
  const int32_t* row_slot = nullptr;   // [R_max]
  int64_t top_k = 0;
  Fp8Weights weights;                  // w13, w13_scales
  void* h_fp8 = nullptr;               // [R_max, I] E4M3 (output)
  float* h_scales = nullptr;           // [I/128, rows_pad] (output)
  void* z = nullptr;                   // optional [R_max, 2I] bf16 (output)
  bool use_swiglu_clamp = false;
  float swiglu_clamp = 0.0f;
};

struct Sm90Fp8DownParams {
  Sm90Rows rows;
  const void* h_fp8 = nullptr;          // [R_max, I]
  const float* h_scales = nullptr;      // [I/128, rows_pad]
  Fp8Weights weights;                   // w2, w2_scales
  const int32_t* row_slot = nullptr;
  const float* topk_weights = nullptr;  // [S]
  void* ys = nullptr;                   // [S, H] bf16 (output)
  // Set: rows go to other ranks instead (row_slot, topk_weights and ys unused), as Sm90DownParams.
  const Sm90PeerRows* to_peers = nullptr;
};

struct Sm90Fp8RecomputeZParams {
  Sm90Rows rows;
  const void* x_fp8 = nullptr;        // [T, H] E4M3
  const float* x_scales = nullptr;    // [T, H/128]
  const int32_t* row_slot = nullptr;  // [R_max]
  int64_t top_k = 0;
  Fp8Weights weights;                 // w13, w13_scales
  void* z = nullptr;                  // [R_max, 2I] bf16 (output)
};

// Output tile width over I of the FP8 dgrad-SwiGLU: router_partials has ceil(I / it) per row.
constexpr int kSm90Fp8DgradBlockN = 256;

struct Sm90Fp8DgradSwigluParams {
  Sm90Rows rows;
  const void* dy_fp8 = nullptr;         // [T, H] E4M3
  const float* dy_scales = nullptr;     // [T, H/128]
  Fp8Weights weights;                   // w2_t, w2_scales
  const void* z = nullptr;              // [R_max, 2I] bf16
  const int32_t* row_slot = nullptr;    // [R_max]: the gathered token and the routing weight's slot
  int64_t top_k = 0;
  const float* topk_weights = nullptr;
  // Set: row r's routing weight is topk_weights[weight_index[r]] instead of topk_weights[row_slot[r]]
  // (the expert-parallel owner gathers pool rows with top_k 1 and keeps its weights by row).
  const int32_t* weight_index = nullptr;
  void* dz = nullptr;                   // [R_max, 2I] bf16 (output)
  void* wh = nullptr;                   // [R_max, I] bf16 (output)
  float* router_partials = nullptr;     // [R_max, ceil(I / kSm90Fp8DgradBlockN)] fp32 (output)
  void* dz_fp8 = nullptr;               // [R_max, 2I] E4M3 (output)
  float* dz_scales = nullptr;           // [2I/128, rows_pad] (output)
  bool use_swiglu_clamp = false;
  float swiglu_clamp = 0.0f;
};

struct Sm90Fp8DgradScatterParams {
  Sm90Rows rows;
  const void* dz_fp8 = nullptr;       // [R_max, 2I]
  const float* dz_scales = nullptr;   // [2I/128, rows_pad]
  Fp8Weights weights;                 // w13_t, w13_scales
  const int32_t* row_slot = nullptr;
  void* dx_slots = nullptr;           // [S, H] bf16 (output)
  // Set: rows go to other ranks instead (row_slot and dx_slots unused), as Sm90DgradScatterParams.
  const Sm90PeerRows* to_peers = nullptr;
};

// A weight gradient from token-blocked pools (launch_quantize_token_blocked_fp8):
//   grad_e[m, n] (+)= sum over expert e's positions p of dq(a[row0 + m, p]) dq(b[n, p])
// a's scales 1 x 128 along the positions, b's 128 x 128; expert e's positions are
// [padded_offsets[e], padded_offsets[e+1]) (multiples of 128; zeros after its rows). Experts
// without rows: grad_e zeroed, or left as it is when accumulating.
struct Sm90Fp8WeightGradParams {
  Sm90Rows rows;                   // expert_offsets: the PADDED offsets; max_rows: P; hidden and intermediate unused
  const void* a = nullptr;         // [P/128, a_rows, 128] E4M3 (dy^T for dW2, dz^T for dW13)
  const float* a_scales = nullptr; // [P/128, a_rows]
  int64_t a_rows = 0;              // a multiple of 128
  int64_t a_row0 = 0;              // the a row of grad's row 0 (a multiple of 128; I for dW3)
  const void* b = nullptr;         // [P/128, n, 128] E4M3 (wh^T for dW2, x^T for dW13)
  const float* b_scales = nullptr; // [P/128, n/128]
  void* grad = nullptr;            // [E, m, n] fp32 or bf16 (output)
  int64_t m = 0;                   // multiple of 128, a_row0 + m <= a_rows
  int64_t n = 0;                   // multiple of 128
  bool bf16_grad = false;
  bool accumulate = false;
};

void launch_sm90_fp8_gate_up_swiglu(const Sm90Fp8GateUpParams& params);
void launch_sm90_fp8_down_weighted(const Sm90Fp8DownParams& params);
void launch_sm90_fp8_recompute_z(const Sm90Fp8RecomputeZParams& params);
void launch_sm90_fp8_dgrad_swiglu(const Sm90Fp8DgradSwigluParams& params);
void launch_sm90_fp8_dgrad_scatter(const Sm90Fp8DgradScatterParams& params);
void launch_sm90_fp8_weight_grad(const Sm90Fp8WeightGradParams& params);

}  // namespace fusemoe

// Host launchers of the grouped GEMMs of the fused MoE backward on sm_90a (TMA + wgmma,
// persistent, warp-specialised), over the expert-sorted row pool of routing.h. Per pool row r
// of expert e (rows [expert_offsets[e], expert_offsets[e+1])), slot s = row_slot[r],
// w = topk_weights[s]:
//
//   recompute z     z_r  = xs_r W13_e^T                                    [R, 2I] bf16
//   dgrad + SwiGLU  a_r  = dys_r W2_e  (W2_e [H, I] read N-major, fp32 in registers), then
//                   g, u = z_r[:I], z_r[I:] (clamped when set), h = bf16(silu(g) u),
//                   dz_r = [w a u silu'(g) | w a silu(g)] (clamp masks),  wh_r = w h,
//                   router_partials[r, n] = <h, a> over output tile n of I
//   router reduce   d_topk_w[s] = sum_n router_partials[slot_row[s], n] (n in order; 0 for
//                   slots without a row)
//   dgrad scatter   dx_slots[s] = dz_r W13_e  (W13_e [2I, H] read N-major)        [S, H] bf16
//   weight grad     grad_e = sum_{r in e} act_m_r^T act_n_r   [M, N]: dW2 (act_m = dys, act_n =
//                   wh) and dW13 (act_m = dz, act_n = xs); one CTA per output tile reduces over
//                   all of the expert's rows (deterministic), fp32 or bf16, optionally added.
//
// Shapes: R_max = max_rows (pool capacity; the rows in use, expert_offsets[E], live on the
// device only), S = num_slots = T*K. Rows >= expert_offsets[E] are never written; every output
// row that belongs to no expert (and every unused slot row of dx_slots) keeps its contents.
// All launchers are asynchronous on `stream` and never synchronise (graph capturable).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fusemoe {

struct Sm90RecomputeZParams {
  const void* xs = nullptr;                 // [R_max, H] bf16, rows in expert order
  const void* w13 = nullptr;                // [E, 2I, H] bf16
  void* z = nullptr;                        // [R_max, 2I] bf16 (output)
  const int32_t* expert_offsets = nullptr;  // [E+1] device
  int64_t max_rows = 0;                     // R_max
  int64_t hidden = 0;                       // H, multiple of 128
  int64_t intermediate = 0;                 // I, multiple of 64
  int64_t num_experts = 0;                  // E, 1..1024
  int num_sms = 0;                          // persistent grid size; 0 = the device's SM count
  cudaStream_t stream = nullptr;
};

struct Sm90DgradSwigluParams {
  const void* dys = nullptr;                // [R_max, H] bf16, dy rows in expert order
  const void* w2 = nullptr;                 // [E, H, I] bf16
  const void* z = nullptr;                  // [R_max, 2I] bf16 (recomputed)
  const int32_t* expert_offsets = nullptr;  // [E+1] device
  const int32_t* row_slot = nullptr;        // [R_max] device
  const float* topk_weights = nullptr;      // [S] device
  void* dz = nullptr;                       // [R_max, 2I] bf16 (output)
  void* wh = nullptr;                       // [R_max, I] bf16 (output)
  float* router_partials = nullptr;         // [R_max, num_n_tiles(I, the block_n used)] fp32
  int64_t max_rows = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t num_experts = 0;
  int64_t num_slots = 0;                    // S
  bool use_swiglu_clamp = false;            // g <- min(g, c), u <- clamp(u, -c, c)
  float swiglu_clamp = 0.0f;
  int num_sms = 0;
  // Output tile width over I: 0 = by shape (sm90_dgrad_swiglu_block_n), or 128 / 256.
  int block_n = 0;
  cudaStream_t stream = nullptr;
};

struct Sm90DgradScatterParams {
  const void* dz = nullptr;                 // [R_max, 2I] bf16
  const void* w13 = nullptr;                // [E, 2I, H] bf16
  void* dx_slots = nullptr;                 // [S, H] bf16 (output): row s = dz_r W13_e
  const int32_t* expert_offsets = nullptr;  // [E+1] device
  const int32_t* row_slot = nullptr;        // [R_max] device
  int64_t max_rows = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t num_experts = 0;
  int64_t num_slots = 0;
  int num_sms = 0;
  cudaStream_t stream = nullptr;
};

struct Sm90WeightGradParams {
  const void* act_m = nullptr;              // [R_max, M] bf16 (dys for dW2, dz for dW13)
  const void* act_n = nullptr;              // [R_max, N] bf16 (wh for dW2, xs for dW13)
  void* grad = nullptr;                     // [E, M, N] fp32 or bf16 (output)
  const int32_t* expert_offsets = nullptr;  // [E+1] device
  int64_t max_rows = 0;
  int64_t m = 0;                            // M, multiple of 128
  int64_t n = 0;                            // N, multiple of 64
  int64_t num_experts = 0;
  bool bf16_grad = false;                   // false: fp32 grad
  // false: grad_e is overwritten (experts with no rows get zeros); true: grad_e += result
  // (experts with no rows untouched).
  bool accumulate = false;
  int num_sms = 0;
  cudaStream_t stream = nullptr;
};

// The output tile width over I the dgrad + SwiGLU kernel uses for Sm90DgradSwigluParams::block_n
// (128 or 256 returned as given; 0 = by shape: 256 when hidden >= 4096, else 128). Measured on
// the H200 (tests/gpu/test_sm90_moe_backward_gemm.cu timing, ms at 256 / 128), with z loaded
// ahead of the epilogue and the approximate reciprocal (2026-11-29, fourth session): Qwen3-30B
// (H=2048, I=768) R=131072 1.058 / 0.977, R=32768 0.293 / 0.254; Qwen3-235B (H=4096, I=1536)
// R=131072 3.142 / 3.549, R=32768 0.854 / 0.911. The longer main loop (K = H) amortises the
// wider tile's epilogue. (Same-run differences below ~8% have flipped between runs.)
int sm90_dgrad_swiglu_block_n(int64_t hidden, int block_n = 0);

// Number of output tiles over I for a resolved block_n (128 or 256): the second dimension of
// router_partials. 128 gives the most: buffers sized with it serve either width.
int64_t sm90_dgrad_swiglu_num_n_tiles(int64_t intermediate, int block_n);

// validate -> configure -> launch. Throw fusemoe::Error naming the argument on bad input.
// max_rows == 0 launches nothing (the weight-gradient launcher then zeroes grad unless
// accumulate: every expert is empty).
void launch_sm90_recompute_z(const Sm90RecomputeZParams& params);
void launch_sm90_dgrad_swiglu(const Sm90DgradSwigluParams& params);
void launch_sm90_dgrad_scatter(const Sm90DgradScatterParams& params);
void launch_sm90_weight_grad(const Sm90WeightGradParams& params);

// d_topk_w[s] = sum_{n < num_n_tiles} router_partials[slot_row[s] * num_n_tiles + n], n in
// increasing order (deterministic); 0 where slot_row[s] < 0 (masked or invalid slot).
void launch_router_grad_reduce(const float* router_partials, int64_t num_n_tiles,
                               const int32_t* slot_row, int64_t num_slots, float* d_topk_w,
                               cudaStream_t stream);

}  // namespace fusemoe

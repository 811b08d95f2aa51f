// Host launchers of the sm90 grouped GEMM instances (src/kernels/sm90_grouped_gemm.cuh) that
// the fused pipelines run, over the expert-sorted rows of routing.h. Per row r of expert e
// (rows [expert_offsets[e], expert_offsets[e+1])), slot s = row_slot[r], w = topk_weights[s]:
//
//   gate/up + SwiGLU  z_r = x[s / K] W13_e^T, h_r = silu(g) * u (g = z[:I], u = z[I:], clamped
//                     when set); optionally z_r itself (before the clamp) into z
//   down + weight     ys[s] = w * (h_r W2_e^T)
//   recompute z       z_r = xs_r W13_e^T
//   dgrad + SwiGLU    a = dys_r W2_e; dz_r = [w a u silu'(g) | w a silu(g)] (clamp masks),
//                     wh_r = w h, router_partials[r, n] = <h, a> over output tile n of I
//   dgrad of x        dx_slots[s] = dz_r W13_e
//   weight gradient   grad_e = sum_{r in e} act_m_r^T act_n_r  (dW2: dys, wh; dW13: dz, xs),
//                     fp32 or bf16, overwritten or added to; one CTA per output tile
//
// W13_e is the expert's [2I, H] gate rows then up rows: one tensor w13 [E, 2I, H], or (w3 set)
// w13 holds w1 [E, I, H] (gate) and w3 [E, I, H] the up rows; both give the same tiles.
// Shapes: R_max = rows.max_rows (the rows in use, expert_offsets[E], live on the device only),
// S = T*K slots. Only rows of an expert are written; other output rows keep their contents.
// The arguments are checked by src/api before any launch: these functions only assert, and
// launch asynchronously on rows.stream without synchronising (CUDA-graph capturable).
// rows.max_rows == 0 launches nothing (the weight gradient is then zeroed unless accumulated).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "fusemoe/expert_parallel.h"

namespace fusemoe {

// The expert-sorted rows every GEMM of one layer call works on.
struct Sm90Rows {
  const int32_t* expert_offsets = nullptr;  // [E+1] device
  int64_t max_rows = 0;                     // R_max
  int64_t hidden = 0;                       // H, multiple of 128
  int64_t intermediate = 0;                 // I, multiple of 64
  int64_t num_experts = 0;                  // E, 1..1024
  // Persistent grid size: 0 = every SM of the device; fewer leave SMs to kernels that run
  // beside this one (co-resident ranks of an expert-parallel layer on one GPU).
  int num_sms = 0;
  cudaStream_t stream = nullptr;
  // [2] zeroed before the first launch (RoutingPlan::tile_counter): gate/up and down then take
  // their tiles in the dynamic order and leave it at zero. Null: the static order t = CTA + i *
  // grid. The other GEMMs take the static order either way.
  int32_t* tile_counter = nullptr;
};

// Whether the forward's gate/up and down take the dynamic tile order. Measured on the H200
// (docs/experiments.md#dynamic-tile-order): with E = 512 (qwen3-next T=16384) the static order's
// CTAs drift apart over many short experts and re-read their weight slices from HBM, and the
// dynamic order makes the forward 7% faster; with E = 256 (deepseek-v3 dims, T = 2048 and 4096)
// 3% and 16%; with E = 128 (30B, 235B, deepseek-v3 dims) it gains nothing (0.996-1.011x).
inline bool sm90_forward_dynamic_tile_order(int64_t num_experts) { return num_experts >= 256; }

// Output rows that go to other ranks' slot buffers (expert parallelism, pipelines/ep_layer.cu):
// row r is written to row row_slot[r] of rank row_src[r]'s buffer, over NVLink.
struct Sm90PeerRows {
  const int32_t* row_src = nullptr;    // [R_max] destination rank
  const int32_t* row_slot = nullptr;   // [R_max] slot on that rank
  const float* row_weight = nullptr;   // [R_max] routing weight (down only)
  void* slot_buffers[kMaxRanks] = {};  // each rank's [S, H] bf16 buffer as mapped in this process
};

// The rows problem of a layer call: experts and their offsets, capacity, the layer's H and I.
inline Sm90Rows make_sm90_rows(const int32_t* expert_offsets, int64_t max_rows, int64_t num_experts,
                               int64_t hidden, int64_t intermediate, int num_sms, cudaStream_t stream,
                               int32_t* tile_counter) {
  Sm90Rows rows;
  rows.tile_counter = tile_counter;
  rows.expert_offsets = expert_offsets;
  rows.max_rows = max_rows;
  rows.hidden = hidden;
  rows.intermediate = intermediate;
  rows.num_experts = num_experts;
  rows.num_sms = num_sms;
  rows.stream = stream;
  return rows;
}

struct Sm90GateUpParams {
  Sm90Rows rows;
  const void* x = nullptr;             // [T, H] bf16 token rows, gathered by the kernel
  const int32_t* row_slot = nullptr;   // [R_max]
  int64_t top_k = 0;                   // K
  const void* w13 = nullptr;           // [E, 2I, H] bf16, or w1 [E, I, H] when w3 is set
  void* h = nullptr;                   // [R_max, I] bf16 (output)
  void* z = nullptr;                   // optional [R_max, 2I] bf16 (output): [g | u] before the clamp
  bool use_swiglu_clamp = false;
  float swiglu_clamp = 0.0f;
  const void* w3 = nullptr;            // null, or the up weights [E, I, H] bf16
};

struct Sm90DownParams {
  Sm90Rows rows;
  const void* h = nullptr;              // [R_max, I] bf16
  const void* w2 = nullptr;             // [E, H, I] bf16
  const int32_t* row_slot = nullptr;    // [R_max]
  const float* topk_weights = nullptr;  // [S]
  void* ys = nullptr;                   // [S, H] bf16 (output)
  // Set: rows go to other ranks instead (row_slot, topk_weights and ys unused).
  const Sm90PeerRows* to_peers = nullptr;
};

struct Sm90RecomputeZParams {
  Sm90Rows rows;
  const void* xs = nullptr;   // [R_max, H] bf16
  const void* w13 = nullptr;  // [E, 2I, H] bf16, or w1 [E, I, H] when w3 is set
  void* z = nullptr;          // [R_max, 2I] bf16 (output)
  const void* w3 = nullptr;   // null, or the up weights [E, I, H] bf16
};

struct Sm90DgradSwigluParams {
  Sm90Rows rows;
  const void* dys = nullptr;            // [R_max, H] bf16
  const void* w2 = nullptr;             // [E, H, I] bf16
  const void* z = nullptr;              // [R_max, 2I] bf16
  const int32_t* row_slot = nullptr;    // [R_max]
  const float* topk_weights = nullptr;  // [S]
  void* dz = nullptr;                   // [R_max, 2I] bf16 (output)
  void* wh = nullptr;                   // [R_max, I] bf16 (output)
  float* router_partials = nullptr;     // [R_max, sm90_dgrad_num_n_tiles(I, block_n)] fp32 (output)
  int block_n = 0;                      // sm90_dgrad_block_n(H): the output tile width over I
  bool use_swiglu_clamp = false;
  float swiglu_clamp = 0.0f;
};

struct Sm90DgradScatterParams {
  Sm90Rows rows;
  const void* dz = nullptr;           // [R_max, 2I] bf16
  const void* w13 = nullptr;          // [E, 2I, H] bf16, or w1 [E, I, H] when w3 is set
  const int32_t* row_slot = nullptr;  // [R_max]
  void* dx_slots = nullptr;           // [S, H] bf16 (output)
  // Set: rows go to other ranks instead (row_slot and dx_slots unused).
  const Sm90PeerRows* to_peers = nullptr;
  const void* w3 = nullptr;           // null, or the up weights [E, I, H] bf16
};

struct Sm90WeightGradParams {
  Sm90Rows rows;                // hidden and intermediate unused: m and n give the shape
  const void* act_m = nullptr;  // [R_max, M] bf16 (dys for dW2, dz for dW13; dz's gate or up half for dW1, dW3)
  const void* act_n = nullptr;  // [R_max, N] bf16 (wh for dW2, xs for dW13)
  void* grad = nullptr;         // [E, M, N] fp32 or bf16 (output)
  int64_t m = 0;                // M, multiple of 128
  int64_t n = 0;                // N, multiple of 64
  bool bf16_grad = false;       // false: fp32
  // false: grad_e is overwritten (experts with no rows get zeros); true: grad_e += result
  // (experts with no rows untouched).
  bool accumulate = false;
  int64_t act_m_row_stride = 0;  // elements between act_m rows: 0 = M (dense); 2I for a half of dz
};

// The output tile width over I of the dgrad + SwiGLU GEMM the layer takes: 256 at every hidden
// (docs/experiments.md#dgrad-1-main-loop-and-held-epilogue); 128 remains a launch option.
int sm90_dgrad_block_n(int64_t hidden);
// Output tiles over I at that width: the second dimension of router_partials.
int64_t sm90_dgrad_num_n_tiles(int64_t intermediate, int block_n);
// Router partials per pool row at the narrowest width: a buffer sized with it serves every shape.
int64_t sm90_router_partials_per_row(int64_t intermediate);

void launch_sm90_gate_up_swiglu(const Sm90GateUpParams& params);
void launch_sm90_down_weighted(const Sm90DownParams& params);
void launch_sm90_recompute_z(const Sm90RecomputeZParams& params);
void launch_sm90_dgrad_swiglu(const Sm90DgradSwigluParams& params);
void launch_sm90_dgrad_scatter(const Sm90DgradScatterParams& params);
void launch_sm90_weight_grad(const Sm90WeightGradParams& params);

}  // namespace fusemoe

// Host launchers of the two grouped GEMMs of the fused MoE forward on sm_90a (TMA + wgmma,
// persistent, warp-specialised), over the expert-sorted row order built by routing (routing.h).
//
//   gate/up + SwiGLU : z = a_r W13_e^T,  h_r = silu(g) * u    (g = z[:I], u = z[I:], fp32)
//   down + weight    : ys[row_slot[r]] = topk_w[row_slot[r]] * (h_r W2_e^T)
//                      (+ optionally the combine y_t = sum_j ys[t*K + j], fused)
// for every sorted row r in [expert_offsets[e], expert_offsets[e+1]). The gate/up input row
// a_r is either token row_slot[r] / K of x, read straight from x (direct dispatch: the kernel
// gathers the rows, no pool), or row r of a pool xs that holds the rows in expert order.
// Shapes (R_max = max_rows, the capacity; the rows in use are [0, expert_offsets[E]) and live
// on the device only):
//   x [num_tokens, H] bf16  or  xs [R_max, H] bf16      w13 [E, 2I, H] bf16
//   h [R_max, I] bf16   w2 [E, H, I] bf16   ys [num_slots, H] bf16 (row stride ys_row_stride)
//   expert_offsets [E+1] int32, row_slot [R_max] int32, topk_weights [num_slots] fp32
// Only rows that belong to an expert are written; every other output row keeps its contents.
// Both launchers are asynchronous on `stream` and never synchronise (graph capturable). Device
// facts and the kernels' shared-memory limits are set up on the first call per device; later
// calls only check arguments, encode two tensor maps (host-only) and launch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fusemoe {

// Token buffers the gate/up kernel gathers rows from. One entry on one GPU (the local x); with
// expert parallelism each rank's x becomes one entry and routing records each row's source.
constexpr int kMaxRowSources = 1;
struct Sm90RowSources {
  const void* x[kMaxRowSources] = {};     // [num_rows[i], H] bf16 token rows
  int64_t num_rows[kMaxRowSources] = {};  // T of each source
  int num_sources = 0;                    // 0: read the pool xs instead
};

struct Sm90GateUpParams {
  // A rows: direct dispatch from `sources` (row r reads token row_slot[r] / top_k of source 0),
  // or, with num_sources == 0, the pool xs. Exactly one of the two.
  Sm90RowSources sources;
  const int32_t* row_slot = nullptr;      // [R_max] device: flat slot t*K+j of each sorted row
  int64_t top_k = 0;                      // K (direct dispatch)
  const void* xs = nullptr;               // [R_max, H] bf16, rows in expert order (pool)
  const void* w13 = nullptr;              // [E, 2I, H] bf16, gate rows [0, I), up rows [I, 2I)
  void* h = nullptr;                      // [R_max, I] bf16 (output)
  // Optional output: [R_max, 2I] bf16 pre-activations [g | u] (before the clamp), rows as h,
  // the layout of the backward's z recompute, so the backward can skip it.
  void* z = nullptr;
  const int32_t* expert_offsets = nullptr;  // [E+1] device
  int64_t max_rows = 0;                   // R_max
  int64_t hidden = 0;                     // H, multiple of 128
  int64_t intermediate = 0;               // I, multiple of 64
  int64_t num_experts = 0;                // E, 1..1024
  bool use_swiglu_clamp = false;          // g <- min(g, c), u <- clamp(u, -c, c)
  float swiglu_clamp = 0.0f;
  int num_sms = 0;                        // persistent grid size; 0 = the device's SM count
  cudaStream_t stream = nullptr;
};

struct Sm90DownParams {
  const void* h = nullptr;                // [R_max, I] bf16, rows in expert order
  const void* w2 = nullptr;               // [E, H, I] bf16
  void* ys = nullptr;                     // [num_slots, ys_row_stride] bf16 (output)
  const int32_t* expert_offsets = nullptr;  // [E+1] device
  const int32_t* row_slot = nullptr;      // [R_max] device: flat slot t*K+j of each pool row
  const float* topk_weights = nullptr;    // [num_slots] device
  int64_t max_rows = 0;                   // R_max
  int64_t hidden = 0;                     // H, multiple of 128
  int64_t intermediate = 0;               // I, multiple of 64
  int64_t num_experts = 0;                // E, 1..1024
  int64_t num_slots = 0;                  // T*K
  int64_t ys_row_stride = 0;              // elements between ys rows; 0 = H
  int num_sms = 0;                        // persistent grid size; 0 = the device's SM count
  // Output tile width over H: 0 = default (256), or 128 / 256. Exposed for benchmarking.
  int block_n = 0;
  // Optional fused combine: with y non-null the launch also writes y[t] = sum_j ys[t*K + j]
  // (the slots that have a row, in slot order, fp32 sums rounded to bf16 once: the combine
  // kernel's bits), each token's column tile as soon as its last slot row is stored, from the
  // kernel's idle warps; tokens without any row get y[t] = 0. ys is still written in full.
  // Measured slower than the down launch followed by the combine kernel (H200, same run: 30B
  // T=4096 +27%, 30B T=16384 +13%, 235B T=16384 -1.4%; docs/perf.md), so the forward does not
  // use it.
  void* y = nullptr;                      // [num_slots / top_k, H] bf16 (output)
  const int32_t* slot_row = nullptr;      // [num_slots] device: row of each slot, -1 where none
  int64_t top_k = 0;                      // K, 1..32
  int32_t* combine_pending = nullptr;     // device scratch: sm90_combine_counters(T, H) int32
  cudaStream_t stream = nullptr;
};

// validate -> configure -> launch. Throw fusemoe::Error naming the argument on bad input.
// max_rows == 0 launches nothing.
void launch_sm90_gate_up_swiglu(const Sm90GateUpParams& params);
void launch_sm90_down_weighted(const Sm90DownParams& params);
// int32 counters the fused combine needs for T tokens of width H (any block_n).
int64_t sm90_combine_counters(int64_t num_tokens, int64_t hidden);

// Both GEMMs in one persistent launch: each CTA runs its gate/up tiles, then its down tiles; a
// down tile starts as soon as the gate/up tiles of its 128-row block have stored h (one
// readiness counter per block: h_ready, sm90_forward_row_blocks(max_rows, E) int32 of device
// scratch, zeroed by this launch), not when the whole gate/up GEMM has finished. The two
// params must describe one layer (same shapes, expert_offsets, h, num_sms, stream);
// down.block_n 0 or 256. Deadlock-free because every CTA of the grid is resident (one per SM)
// and every CTA issues all its gate/up tiles before any down tile; a wait longer than 5 s (a
// bug, or a device shared with a kernel that never yields SMs) traps: the launch fails with
// cudaErrorLaunchFailure instead of hanging.
void launch_sm90_forward_gemms(const Sm90GateUpParams& gate_up, const Sm90DownParams& down, int32_t* h_ready);
int64_t sm90_forward_row_blocks(int64_t max_rows, int64_t num_experts);

}  // namespace fusemoe

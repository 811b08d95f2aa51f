// The fused pipelines at Precision::kFp8Blockwise (Impl::kFused): the BF16 pipelines'
// (fused_forward.cu, fused_backward.cu) steps with E4M3 GEMM operands; every step on the device,
// no host synchronisation (CUDA-graph capturable). Stream order:
//   forward   1. routing
//             2. x quantized once per token: x_fp8 [T, H] + x_scales [T, H/128]
//             3. gate/up + SwiGLU (gathers x_fp8 rows), h quantized in the epilogue -> h_fp8 +
//                scales (and bf16 z when saved)
//             4. down + weight -> bf16 slot rows ys      5. combine (fp32, slot order)
//   backward  1. routing
//             2. dy quantized once per token -> dy_fp8 + scales [T, ...]; in the same pass dy
//                and x copied to their routed rows -> dys, xs (bf16, the weight gradients' pools)
//             3. unless z is saved: x quantized once per token as in the forward, then z recomputed
//                (FP8 GEMM gathering x's rows, the forward's operands: bitwise the saved z)
//             4. dgrad + SwiGLU on W2^T gathering dy's rows, dz quantized in the epilogue -> dz
//                (bf16), dz_fp8 + scales, wh, router partials
//             5. dgrad of x on W13^T -> bf16 slot rows
//             6. combine, and the router reduce in the same launch
//             7. weight gradients from the bf16 pools (the BF16 path's kernels); with
//                LayerConfig::fp8_weight_grads instead: dy, w*h, dz and x transposed into
//                token-blocked E4M3 pools (no bf16 xs, dys pools in step 2), then FP8 GEMMs
// The pools' scales (h, dz) are block-major [K/128, rows_pad] with rows_pad = sm90_fp8_rows_pad(T*K)
// of the call (sized for max_tokens*K); those of the token rows the GEMMs gather (x, dy) are
// token-major [T, H/128].
#include "pipelines/fused_fp8.h"

#include <array>
#include <utility>

#include "common/workspace_carver.h"
#include "pipelines/plan_workspace.h"
#include "kernels/fp8_quantize.h"
#include "kernels/moe_elementwise.h"
#include "launchers/sm90_fp8_gemms.h"
#include "launchers/sm90_grouped_gemm.h"
#include "pipelines/backward_gemms.h"

namespace fusemoe {
namespace {

// FP8 weight buffer: the six arrays, each 256-byte aligned.
struct Fp8WeightsLayout {
  Fp8Weights w;
  size_t total_bytes = 0;
  // Each array's start and bytes in use: what follows up to the next array is alignment padding.
  std::array<std::pair<char*, size_t>, 6> arrays{};
  Fp8WeightsLayout(const LayerConfig& c, const void* base) {
    const int64_t E = c.num_experts, H = c.hidden, I = c.intermediate;
    WorkspaceCarver carver(const_cast<void*>(base), 0);
    int next = 0;
    auto take = [&](size_t bytes) {
      void* region = carver.take(bytes);
      arrays[next++] = {static_cast<char*>(region), bytes};
      return region;
    };
    w.w13 = take(E * 2 * I * H);
    w.w13_t = take(E * 2 * I * H);
    w.w13_scales = static_cast<const float*>(take(E * (2 * I / 128) * (H / 128) * sizeof(float)));
    w.w2 = take(E * H * I);
    w.w2_t = take(E * H * I);
    w.w2_scales = static_cast<const float*>(take(E * (H / 128) * (I / 128) * sizeof(float)));
    total_bytes = carver.bytes();
  }
};

struct Fp8ForwardWorkspace {
  RoutingPlan plan;
  void* x_fp8_TH = nullptr;       // E4M3
  float* x_scales = nullptr;      // [T, H/128]
  void* h_fp8_RI = nullptr;       // E4M3
  float* h_scales = nullptr;      // [I/128, rows_pad]
  void* ys_SH = nullptr;          // bf16
  size_t total_bytes = 0;

  Fp8ForwardWorkspace(const LayerConfig& c, void* base) {
    const int64_t rows = c.max_tokens * c.top_k, rows_pad = sm90_fp8_rows_pad(rows);
    WorkspaceCarver carver = carver_after_routing_plan(base, c.max_tokens, c.top_k, c.num_experts, &plan);
    x_fp8_TH = carver.take(c.max_tokens * c.hidden);
    x_scales = carver.take<float>(c.max_tokens * (c.hidden / 128) * sizeof(float));
    h_fp8_RI = carver.take(rows * c.intermediate);
    h_scales = carver.take<float>((c.intermediate / 128) * rows_pad * sizeof(float));
    ys_SH = carver.take(rows * c.hidden * 2);
    total_bytes = carver.bytes();
  }
};

struct Fp8BackwardWorkspace : BackwardPools {
  RoutingPlan plan;
  float* router_partials = nullptr;  // [R, ceil(I / kSm90Fp8DgradBlockN)]
  void* dy_fp8_TH = nullptr;         // E4M3 (dgrad + SwiGLU gathers its rows)
  float* dy_scales = nullptr;        // [T, H/128]
  void* dz_fp8_RF = nullptr;         // E4M3 (dgrad of x)
  float* dz_scales = nullptr;        // [2I/128, rows_pad]
  // LayerConfig::fp8_weight_grads: the token-blocked pools [P/128][features][128] E4M3 of the
  // weight gradients' operands (instead of the bf16 xs and dys pools) and their scales
  // (src/kernels/fp8_quantize.h; P = fp8_token_blocked_positions(R_max, E)).
  int32_t* padded_offsets = nullptr;  // [E + 1]
  int32_t* block_expert = nullptr;    // [P/128]
  void* dyT = nullptr;                // H features, 1 x 128 scales [P/128, H]
  float* dyT_scales = nullptr;
  void* whT = nullptr;                // I features, 128 x 128 scales [P/128, I/128]
  float* whT_scales = nullptr;
  void* dzT = nullptr;                // 2I features, 1 x 128 scales [P/128, 2I]
  float* dzT_scales = nullptr;
  void* xT = nullptr;                 // H features, 128 x 128 scales [P/128, H/128]
  float* xT_scales = nullptr;
  // Only when z is recomputed (last, so a backward given saved z needs less):
  void* z_RF = nullptr;              // bf16
  void* x_fp8_TH = nullptr;          // E4M3 (the recompute gathers its rows)
  float* x_scales = nullptr;         // [T, H/128]
  size_t total_bytes = 0;

  Fp8BackwardWorkspace(const LayerConfig& c, void* base, bool z_saved) {
    const int64_t rows = c.max_tokens * c.top_k, rows_pad = sm90_fp8_rows_pad(rows);
    const int64_t H = c.hidden, I = c.intermediate;
    WorkspaceCarver carver = carver_after_routing_plan(base, c.max_tokens, c.top_k, c.num_experts, &plan);
    carve_pools(carver, rows, H, I, /*bf16_xs_dys=*/!c.fp8_weight_grads);
    if (c.fp8_weight_grads) {
      const int64_t P = fp8_token_blocked_positions(rows, c.num_experts), blocks = P / 128;
      padded_offsets = carver.take<int32_t>((c.num_experts + 1) * sizeof(int32_t));
      block_expert = carver.take<int32_t>(blocks * sizeof(int32_t));
      dyT = carver.take(H * P);
      dyT_scales = carver.take<float>(blocks * H * sizeof(float));
      whT = carver.take(I * P);
      whT_scales = carver.take<float>(blocks * (I / 128) * sizeof(float));
      dzT = carver.take(2 * I * P);
      dzT_scales = carver.take<float>(blocks * 2 * I * sizeof(float));
      xT = carver.take(H * P);
      xT_scales = carver.take<float>(blocks * (H / 128) * sizeof(float));
    }
    router_partials = carver.take<float>(rows * sm90_router_partials_per_row(I) * sizeof(float));
    dy_fp8_TH = carver.take(c.max_tokens * H);
    dy_scales = carver.take<float>(c.max_tokens * (H / 128) * sizeof(float));
    dz_fp8_RF = carver.take(rows * 2 * I);
    dz_scales = carver.take<float>((2 * I / 128) * rows_pad * sizeof(float));
    if (!z_saved) {
      z_RF = carver.take(rows * 2 * I * 2);
      x_fp8_TH = carver.take(c.max_tokens * H);
      x_scales = carver.take<float>(c.max_tokens * (H / 128) * sizeof(float));
    }
    total_bytes = carver.bytes();
  }
};

Sm90Rows rows_problem(const LayerConfig& c, const RoutingPlan& plan, int64_t num_slots, cudaStream_t stream) {
  return make_sm90_rows(plan.expert_offsets, num_slots, c.num_experts, c.hidden, c.intermediate, 0, stream,
                        /*tile_counter=*/nullptr);  // the block-scaled instances take the static order
}

// LayerConfig::fp8_weight_grads: each operand transposed into a token-blocked pool by one pass
// (dy and x gathered from their token rows, dz and w * h from dgrad-1's bf16 rows), then dW2 =
// dy^T (w h) and dW13 = dz^T x (or dW1, dW3 from dz's halves) as FP8 GEMMs. With no rows every
// expert is empty: zeroed, or untouched when accumulating.
void launch_fp8_weight_grads(const LayerConfig& c, const BackwardArgs& args, const Fp8BackwardWorkspace& ws,
                             const Sm90Rows& rows, void* gate_up_grads) {
  if (args.dw2 == nullptr && gate_up_grads == nullptr) return;  // both weights frozen
  const int64_t H = c.hidden, I = c.intermediate, E = c.num_experts;
  cudaStream_t stream = args.stream;
  const int64_t P = fp8_token_blocked_positions(rows.max_rows, E);
  launch_token_block_offsets(ws.plan.expert_offsets, E, P, ws.padded_offsets, ws.block_expert, stream);
  auto quantize = [&](const void* src, int64_t ld, int64_t cols, const int32_t* row_slot, Fp8TokenScales mode,
                      void* q, float* scales) {
    if (rows.max_rows == 0) return;  // T = 0: no rows (and src may be null); the GEMMs see empty experts
    Fp8TokenBlockedParams t;
    t.src = src;
    t.ld = ld;
    t.cols = cols;
    t.row_slot = row_slot;
    t.top_k = c.top_k;
    t.expert_offsets = ws.plan.expert_offsets;
    t.padded_offsets = ws.padded_offsets;
    t.block_expert = ws.block_expert;
    t.q = q;
    t.p_max = P;
    t.scales = scales;
    t.mode = mode;
    t.stream = stream;
    launch_quantize_token_blocked_fp8(t);
  };
  Sm90Fp8WeightGradParams w;
  w.rows = rows;
  w.rows.expert_offsets = ws.padded_offsets;
  w.rows.max_rows = P;
  w.bf16_grad = args.weight_grad_dtype == WeightGradDtype::kBFloat16;
  w.accumulate = args.accumulate_weight_grads;
  if (args.dw2 != nullptr) {
    quantize(args.dy, H, H, ws.plan.row_slot, Fp8TokenScales::kPer128Tokens, ws.dyT, ws.dyT_scales);
    quantize(ws.wh_RI, I, I, nullptr, Fp8TokenScales::kPer128x128, ws.whT, ws.whT_scales);
    w.a = ws.dyT;
    w.a_scales = ws.dyT_scales;
    w.a_rows = H;
    w.b = ws.whT;
    w.b_scales = ws.whT_scales;
    w.grad = args.dw2;
    w.m = H;
    w.n = I;
    launch_sm90_fp8_weight_grad(w);
  }
  if (gate_up_grads == nullptr) return;  // frozen gate/up weights
  quantize(ws.dz_RF, 2 * I, 2 * I, nullptr, Fp8TokenScales::kPer128Tokens, ws.dzT, ws.dzT_scales);
  quantize(args.x, H, H, ws.plan.row_slot, Fp8TokenScales::kPer128x128, ws.xT, ws.xT_scales);
  w.a = ws.dzT;
  w.a_scales = ws.dzT_scales;
  w.a_rows = 2 * I;
  w.b = ws.xT;
  w.b_scales = ws.xT_scales;
  w.grad = gate_up_grads;
  w.n = H;
  if (args.dw3 == nullptr) {
    w.m = 2 * I;
    launch_sm90_fp8_weight_grad(w);
    return;
  }
  // dW1 from dz's gate rows, dW3 from its up rows: the tiles of dW13, the same sums.
  w.m = I;
  launch_sm90_fp8_weight_grad(w);
  w.a_row0 = I;
  w.grad = args.dw3;
  launch_sm90_fp8_weight_grad(w);
}

}  // namespace

size_t fp8_weights_buffer_bytes(const LayerConfig& config) { return Fp8WeightsLayout(config, nullptr).total_bytes; }

Fp8Weights fp8_weights_in(const LayerConfig& config, const void* buffer) { return Fp8WeightsLayout(config, buffer).w; }

void quantize_fp8_weights(const LayerConfig& c, const void* w13, const void* w3, const void* w2, void* buffer,
                          cudaStream_t stream) {
  const Fp8WeightsLayout layout(c, buffer);
  const Fp8Weights& w = layout.w;
  // The padding is zeroed too, so every byte of the buffer follows from the weights: two buffers
  // of the same weights compare equal (the PyTorch weight caches' tests do), and it hashes alike.
  for (const auto& [start, bytes] : layout.arrays) {
    const size_t pad = align_workspace(bytes) - bytes;
    if (pad > 0) FUSEMOE_CUDA_CHECK(cudaMemsetAsync(start + bytes, 0, pad, stream));
  }
  launch_quantize_weights_fp8(w13, w3, c.num_experts, 2 * c.intermediate, c.hidden, const_cast<void*>(w.w13),
                              const_cast<void*>(w.w13_t), const_cast<float*>(w.w13_scales), stream);
  launch_quantize_weights_fp8(w2, nullptr, c.num_experts, c.hidden, c.intermediate, const_cast<void*>(w.w2),
                              const_cast<void*>(w.w2_t), const_cast<float*>(w.w2_scales), stream);
}

size_t fused_fp8_forward_workspace_bytes(const LayerConfig& config) {
  return Fp8ForwardWorkspace(config, nullptr).total_bytes;
}

size_t fused_fp8_backward_workspace_bytes(const LayerConfig& config, bool z_saved) {
  return Fp8BackwardWorkspace(config, nullptr, z_saved).total_bytes;
}

void fused_fp8_forward(const LayerConfig& c, const ForwardArgs& args) {
  const Fp8ForwardWorkspace ws(c, args.workspace);
  const Fp8Weights weights = fp8_weights_in(c, args.fp8_weights);
  const int64_t num_slots = args.num_tokens * c.top_k;  // upper bound of the rows in use
  launch_routing(args.topk_idx, args.num_tokens, c.top_k, c.num_experts, ws.plan, args.expert_id_report,
                 args.stream);
  if (num_slots == 0) return;
  const int64_t H = c.hidden;
  launch_quantize_token_rows_fp8(args.x, args.num_tokens, H, ws.x_fp8_TH, ws.x_scales, args.stream);

  const Sm90Rows rows = rows_problem(c, ws.plan, num_slots, args.stream);
  Sm90Fp8GateUpParams gate_up;
  gate_up.rows = rows;
  gate_up.x_fp8 = ws.x_fp8_TH;
  gate_up.x_scales = ws.x_scales;
  gate_up.row_slot = ws.plan.row_slot;
  gate_up.top_k = c.top_k;
  gate_up.weights = weights;
  gate_up.h_fp8 = ws.h_fp8_RI;
  gate_up.h_scales = ws.h_scales;
  gate_up.z = args.saved_z;  // null: the backward recomputes z
  gate_up.use_swiglu_clamp = c.use_swiglu_clamp;
  gate_up.swiglu_clamp = c.swiglu_clamp;
  launch_sm90_fp8_gate_up_swiglu(gate_up);

  Sm90Fp8DownParams down;
  down.rows = rows;
  down.h_fp8 = ws.h_fp8_RI;
  down.h_scales = ws.h_scales;
  down.weights = weights;
  down.row_slot = ws.plan.row_slot;
  down.topk_weights = args.topk_weights;
  down.ys = ws.ys_SH;
  launch_sm90_fp8_down_weighted(down);

  launch_combine_slots(ws.ys_SH, ws.plan.slot_row, args.num_tokens, c.top_k, H, args.y, args.stream);
}

void fused_fp8_backward(const LayerConfig& c, const BackwardArgs& args) {
  const Fp8BackwardWorkspace ws(c, args.workspace, args.saved_z != nullptr);
  const Fp8Weights weights = fp8_weights_in(c, args.fp8_weights);
  const int64_t H = c.hidden, I = c.intermediate, E = c.num_experts;
  const int64_t num_slots = args.num_tokens * c.top_k;
  cudaStream_t stream = args.stream;
  launch_routing(args.topk_idx, args.num_tokens, c.top_k, E, ws.plan, args.expert_id_report, stream);
  const Sm90Rows rows = rows_problem(c, ws.plan, num_slots, stream);
  // dw1 with dw3 (separate gate and up gradients), else dw13; null: the gate/up weights are frozen.
  void* gate_up_grads = args.dw3 != nullptr ? args.dw1 : args.dw13;

  if (num_slots > 0) {
    // dy once per token for dgrad + SwiGLU; in the same pass the plain pools of dy (dW2's operand)
    // and x (dW13's) for bf16 weight gradients; none of a frozen weight's.
    const bool bf16_pools = !c.fp8_weight_grads;
    launch_quantize_pool_rows_fp8(args.dy, ws.plan.slot_row, args.num_tokens, c.top_k, H,
                                  bf16_pools && args.dw2 != nullptr ? ws.dys_RH : nullptr, ws.dy_fp8_TH, ws.dy_scales,
                                  stream,
                                  bf16_pools && gate_up_grads != nullptr ? Fp8RowsPlainCopy{args.x, ws.xs_RH}
                                                                         : Fp8RowsPlainCopy{});
    const void* z_RF = args.saved_z;
    if (z_RF == nullptr) {
      launch_quantize_token_rows_fp8(args.x, args.num_tokens, H, ws.x_fp8_TH, ws.x_scales, stream);
      Sm90Fp8RecomputeZParams z;
      z.rows = rows;
      z.x_fp8 = ws.x_fp8_TH;
      z.x_scales = ws.x_scales;
      z.row_slot = ws.plan.row_slot;
      z.top_k = c.top_k;
      z.weights = weights;
      z.z = ws.z_RF;
      launch_sm90_fp8_recompute_z(z);
      z_RF = ws.z_RF;
    }

    Sm90Fp8DgradSwigluParams d1;
    d1.rows = rows;
    d1.dy_fp8 = ws.dy_fp8_TH;
    d1.dy_scales = ws.dy_scales;
    d1.weights = weights;
    d1.z = z_RF;
    d1.row_slot = ws.plan.row_slot;
    d1.top_k = c.top_k;
    d1.topk_weights = args.topk_weights;
    d1.dz = ws.dz_RF;
    d1.wh = ws.wh_RI;
    d1.router_partials = ws.router_partials;
    d1.dz_fp8 = ws.dz_fp8_RF;
    d1.dz_scales = ws.dz_scales;
    d1.use_swiglu_clamp = c.use_swiglu_clamp;
    d1.swiglu_clamp = c.swiglu_clamp;
    launch_sm90_fp8_dgrad_swiglu(d1);

    Sm90Fp8DgradScatterParams d2;
    d2.rows = rows;
    d2.dz_fp8 = ws.dz_fp8_RF;
    d2.dz_scales = ws.dz_scales;
    d2.weights = weights;
    d2.row_slot = ws.plan.row_slot;
    d2.dx_slots = ws.dx_slots_SH;
    launch_sm90_fp8_dgrad_scatter(d2);
    // dx, and d_topk_weights from dgrad-1's partials (step 4), in one launch.
    const RouterGradReduce router{ws.router_partials, sm90_dgrad_num_n_tiles(I, kSm90Fp8DgradBlockN),
                                  args.d_topk_weights};
    launch_combine_slots(ws.dx_slots_SH, ws.plan.slot_row, args.num_tokens, c.top_k, H, args.dx, stream, router);
  }

  if (c.fp8_weight_grads) {
    launch_fp8_weight_grads(c, args, ws, rows, gate_up_grads);
    return;
  }
  // Weight gradients from the bf16 pools with the BF16 path's step (no rows: zeroed, or untouched).
  launch_backward_weight_grads(rows, ws.weight_grad_rows(), gate_up_grads, args.dw3, args.dw2, args.weight_grad_dtype,
                               args.accumulate_weight_grads);
}

}  // namespace fusemoe

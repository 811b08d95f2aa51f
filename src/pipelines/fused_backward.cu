// The fused backward (Impl::kFused): every step on the device, no host synchronisation, so the
// call can be captured in a CUDA graph. The forward saved its inputs and, optionally, z
// (BackwardArgs::saved_z). Stream order:
//   1. routing            the forward's stable counting sort, recomputed (kernels/routing.cu)
//   2. dispatch           copy x and dy rows into the expert-sorted pools xs, dys [R, H] (one launch,
//                         token-major: each token row read once, written to its K rows)
//   3. recompute z        z = xs W13_e^T (skipped with saved_z)            -> z [R, 2I] bf16
//   4. dgrad + SwiGLU     a = dys W2_e; dz, w*h, per-tile <h, a>           -> dz, wh, partials
//   5. dgrad scatter      dxs = dz W13_e written to the slot row dx_slots[t*K + j]
//   6. combine            dx_t = sum_j dx_slots[t*K + j] in slot order (deterministic), and in the
//                         same launch d_topk_w[s] = sum of the row's partials (0 for masked slots)
//   7. weight gradients   dW2_e = dys^T wh, dW13_e = dz^T xs, one CTA per output tile; each skipped
//                         when its output is null (frozen weights), and then with saved z and no
//                         dW13 the x pool is not gathered either
// Few launches: at small T the call's host time is mostly launches (docs/perf.md#host-cost-of-the-op).
// W13_e is w13's [2I, H], or w1's and w3's [I, H] each read in place (separate gate and up weights);
// dW13 likewise goes to dw13, or to dw1 and dw3.
// Memory per routed row (bf16): xs, dys, dx_slots [H] each + dz [2I] + wh [I] + z [2I] (only
// when recomputed: with the forward's saved z the workspace ends before it), plus one fp32 per
// row and dgrad tile.
#include "pipelines/fused_backward.h"

#include "kernels/moe_elementwise.h"
#include "launchers/sm90_grouped_gemm.h"
#include "pipelines/backward_gemms.h"
#include "common/workspace_carver.h"
#include "pipelines/plan_workspace.h"

namespace fusemoe {
namespace {

struct FusedBackwardWorkspace : BackwardPools {
  RoutingPlan plan;
  float* router_partials = nullptr;  // [R, num dgrad tiles] fp32
  void* z_RF = nullptr;         // bf16 recomputed [g | u]; last, and absent when z is saved
  size_t total_bytes = 0;

  FusedBackwardWorkspace(const LayerConfig& c, void* base, bool z_saved) {
    const int64_t rows = c.max_tokens * c.top_k;
    const int64_t H = c.hidden, I = c.intermediate;
    WorkspaceCarver carver = carver_after_routing_plan(base, c.max_tokens, c.top_k, c.num_experts, &plan);
    carve_pools(carver, rows, H, I);
    router_partials = carver.take<float>(rows * sm90_router_partials_per_row(I) * sizeof(float));
    if (!z_saved) z_RF = carver.take(rows * 2 * I * 2);
    total_bytes = carver.bytes();
  }
};

}  // namespace

size_t fused_backward_workspace_bytes(const LayerConfig& config, bool z_saved) {
  return FusedBackwardWorkspace(config, nullptr, z_saved).total_bytes;
}

void fused_backward(const LayerConfig& c, const BackwardArgs& args) {
  const FusedBackwardWorkspace ws(c, args.workspace, args.saved_z != nullptr);
  const int64_t H = c.hidden, I = c.intermediate, E = c.num_experts;
  const int64_t num_slots = args.num_tokens * c.top_k;  // upper bound of the rows in use
  cudaStream_t stream = args.stream;
  launch_routing(args.topk_idx, args.num_tokens, c.top_k, E, ws.plan, args.expert_id_report,
                 stream);

  const Sm90Rows rows = make_sm90_rows(ws.plan.expert_offsets, num_slots, E, H, I, 0, stream,
                                       /*tile_counter=*/nullptr);  // static order (docs/experiments.md#dynamic-tile-order)
  BackwardRows b = ws.weight_grad_rows();
  b.saved_z = args.saved_z;  // the forward's (the same routing: the same row order), or null
  b.z_scratch = ws.z_RF;
  b.router_partials = ws.router_partials;
  b.weight_index = ws.plan.row_slot;  // a row's weight is its slot's
  b.weights = args.topk_weights;

  // dw1 with dw3 (separate gate and up gradients), else dw13; null: the gate/up weights are frozen.
  void* gate_up_grads = args.dw3 != nullptr ? args.dw1 : args.dw13;
  if (num_slots > 0) {
    // x rows feed only the z recompute and dW13.
    const bool need_xs = args.saved_z == nullptr || gate_up_grads != nullptr;
    launch_scatter_token_rows(args.dy, ws.dys_RH, need_xs ? args.x : nullptr, need_xs ? ws.xs_RH : nullptr,
                              ws.plan.slot_row, args.num_tokens, c.top_k, H, stream);
    // w1 with w3 (separate gate and up weights), else w13.
    const void* gate_weights = args.w3 != nullptr ? args.w1 : args.w13;
    const int64_t num_n_tiles = launch_backward_dgrad(rows, c, b, gate_weights, args.w3, args.w2);
    Sm90DgradScatterParams d2;
    d2.rows = rows;
    d2.dz = ws.dz_RF;
    d2.w13 = gate_weights;
    d2.w3 = args.w3;
    d2.row_slot = ws.plan.row_slot;
    d2.dx_slots = ws.dx_slots_SH;
    launch_sm90_dgrad_scatter(d2);
    // dx, and d_topk_weights from dgrad-1's partials (step 4), in one launch.
    launch_combine_slots(ws.dx_slots_SH, ws.plan.slot_row, args.num_tokens, c.top_k, H, args.dx, stream,
                         RouterGradReduce{ws.router_partials, num_n_tiles, args.d_topk_weights});
  }
  // No rows: zeroed, or untouched when accumulating.
  launch_backward_weight_grads(rows, b, gate_up_grads, args.dw3, args.dw2, args.weight_grad_dtype,
                               args.accumulate_weight_grads);
}

}  // namespace fusemoe

// The fused backward (Impl::kFused): every step on the device, no host synchronisation, so the
// call can be captured in a CUDA graph. The forward saved its inputs and, optionally, z
// (BackwardArgs::saved_z). Stream order:
//   1. routing            the forward's stable counting sort, recomputed (kernels/routing.cu)
//   2. dispatch           gather x and dy rows into the expert-sorted pools xs, dys [R, H]
//   3. recompute z        z = xs W13_e^T (skipped with saved_z)            -> z [R, 2I] bf16
//   4. dgrad + SwiGLU     a = dys W2_e; dz, w*h, per-tile <h, a>           -> dz, wh, partials
//   5. router reduce      d_topk_w[s] = sum of the row's partials (0 for masked slots)
//   6. dgrad scatter      dxs = dz W13_e written to the slot row dx_slots[t*K + j]
//   7. combine            dx_t = sum_j dx_slots[t*K + j] in slot order (deterministic)
//   8. weight gradients   dW2_e = dys^T wh, dW13_e = dz^T xs, one CTA per output tile
// Memory per routed row (bf16): xs, dys, dx_slots [H] each + dz [2I] + wh [I] + z [2I] (only
// when recomputed: with the forward's saved z the workspace ends before it), plus one fp32 per
// row and dgrad tile.
#include "pipelines/fused_backward.h"

#include "kernels/moe_elementwise.h"
#include "launchers/sm90_grouped_gemm.h"
#include "common/workspace_carver.h"

namespace fusemoe {
namespace {

struct FusedBackwardWorkspace {
  RoutingPlan plan;
  void* xs_RH = nullptr;        // bf16 gathered x
  void* dys_RH = nullptr;       // bf16 gathered dy
  void* dz_RF = nullptr;        // bf16, F = 2I
  void* wh_RI = nullptr;        // bf16 w * h
  void* dx_slots_SH = nullptr;  // bf16 per-slot dx rows (t*K + j)
  float* router_partials = nullptr;  // [R, num dgrad tiles] fp32
  void* z_RF = nullptr;         // bf16 recomputed [g | u]; last, and absent when z is saved
  size_t total_bytes = 0;

  FusedBackwardWorkspace(const LayerConfig& c, void* base, bool z_saved) {
    const int64_t rows = c.max_tokens * c.top_k;
    const int64_t H = c.hidden, I = c.intermediate;
    if (base) carve_routing_plan(static_cast<char*>(base), c.max_tokens, c.top_k, c.num_experts, &plan);
    WorkspaceCarver carver(base, routing_plan_bytes(c.max_tokens, c.top_k, c.num_experts));
    xs_RH = carver.take(rows * H * 2);
    dys_RH = carver.take(rows * H * 2);
    dz_RF = carver.take(rows * 2 * I * 2);
    wh_RI = carver.take(rows * I * 2);
    dx_slots_SH = carver.take(rows * H * 2);
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
  const bool bf16_grads = args.weight_grad_dtype == WeightGradDtype::kBFloat16;
  launch_routing(args.topk_idx, args.num_tokens, c.top_k, E, ws.plan, args.expert_id_report,
                 stream);

  Sm90Rows rows;
  rows.expert_offsets = ws.plan.expert_offsets;
  rows.max_rows = num_slots;
  rows.hidden = H;
  rows.intermediate = I;
  rows.num_experts = E;
  rows.stream = stream;

  if (num_slots > 0) {
    const int32_t* num_rows_device = ws.plan.expert_offsets + E;
    launch_gather_rows_device_count(args.x, ws.plan.row_slot, num_rows_device, num_slots, c.top_k, H,
                                    ws.xs_RH, stream);
    launch_gather_rows_device_count(args.dy, ws.plan.row_slot, num_rows_device, num_slots, c.top_k, H,
                                    ws.dys_RH, stream);

    // z from the forward (BackwardArgs::saved_z: same routing, so the same row order) or
    // recomputed here.
    const void* z_RF = args.saved_z;
    if (z_RF == nullptr) {
      Sm90RecomputeZParams z;
      z.rows = rows;
      z.xs = ws.xs_RH;
      z.w13 = args.w13;
      z.z = ws.z_RF;
      launch_sm90_recompute_z(z);
      z_RF = ws.z_RF;
    }

    Sm90DgradSwigluParams d1;
    d1.rows = rows;
    d1.dys = ws.dys_RH;
    d1.w2 = args.w2;
    d1.z = z_RF;
    d1.row_slot = ws.plan.row_slot;
    d1.topk_weights = args.topk_weights;
    d1.dz = ws.dz_RF;
    d1.wh = ws.wh_RI;
    d1.router_partials = ws.router_partials;
    d1.block_n = sm90_dgrad_block_n(H);
    d1.use_swiglu_clamp = c.use_swiglu_clamp;
    d1.swiglu_clamp = c.swiglu_clamp;
    launch_sm90_dgrad_swiglu(d1);
    launch_router_grad_reduce(ws.router_partials, sm90_dgrad_num_n_tiles(I, d1.block_n), ws.plan.slot_row,
                              num_slots, args.d_topk_weights, stream);

    Sm90DgradScatterParams d2;
    d2.rows = rows;
    d2.dz = ws.dz_RF;
    d2.w13 = args.w13;
    d2.row_slot = ws.plan.row_slot;
    d2.dx_slots = ws.dx_slots_SH;
    launch_sm90_dgrad_scatter(d2);
    launch_combine_slots(ws.dx_slots_SH, ws.plan.slot_row, args.num_tokens, c.top_k, H, args.dx, stream);
  }

  // Weight gradients (no rows: zeroed, or untouched when accumulating).
  Sm90WeightGradParams w2g;
  w2g.rows = rows;
  w2g.act_m = ws.dys_RH;
  w2g.act_n = ws.wh_RI;
  w2g.grad = args.dw2;
  w2g.m = H;
  w2g.n = I;
  w2g.bf16_grad = bf16_grads;
  w2g.accumulate = args.accumulate_weight_grads;
  launch_sm90_weight_grad(w2g);

  Sm90WeightGradParams w13g = w2g;
  w13g.act_m = ws.dz_RF;
  w13g.act_n = ws.xs_RH;
  w13g.grad = args.dw13;
  w13g.m = 2 * I;
  w13g.n = H;
  launch_sm90_weight_grad(w13g);
}

}  // namespace fusemoe

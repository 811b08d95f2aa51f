// The fused forward (Impl::kFused): every step on the device, no host synchronisation, so the
// call can be captured in a CUDA graph. Stream order:
//   1. routing            stable counting sort of the T*K slots (kernels/routing.cu)
//   2. dispatch + gate/up + SwiGLU
//                         sm90 grouped GEMM whose producer gathers the token rows of x straight
//                         into shared memory (row r = token row_slot[r] / K; no pool),
//                         h = silu(g) * u -> h [R, I] (and z = [g | u] when saved)
//   3. down + weight      sm90 grouped GEMM, w * (h W2^T) written to the token's slot row
//                         ys[t*K + j]
//   4. combine            y_t = sum_j ys[t*K + j] in slot order (deterministic)
// Steps 2 and 3 in one launch, and step 4 inside the down kernel, were built and measured slower
// (docs/experiments.md#one-launch-forward, #combine-in-down).
// The gate/up weights are w13, or w1 and w3 read in place (separate gate and up weights).
// Rows past expert_offsets[E] are never read or written; masked and invalid slots own no row.
// The row count R lives on the device only: launches are sized for T*K rows, and the GEMM
// kernels derive their tile lists from expert_offsets.
#include "pipelines/fused_forward.h"

#include "kernels/moe_elementwise.h"
#include "launchers/sm90_grouped_gemm.h"
#include "common/workspace_carver.h"
#include "pipelines/plan_workspace.h"

namespace fusemoe {
namespace {

// Workspace: routing plan, then the pools (sized for max_tokens * K rows / slots).
struct FusedWorkspace {
  RoutingPlan plan;
  void* h_RI = nullptr;   // bf16 SwiGLU output
  void* ys_SH = nullptr;  // bf16 weighted expert output per slot (t*K + j)
  size_t total_bytes = 0;

  FusedWorkspace(const LayerConfig& c, void* base) {
    const int64_t rows = c.max_tokens * c.top_k;
    WorkspaceCarver carver = carver_after_routing_plan(base, c.max_tokens, c.top_k, c.num_experts, &plan);
    h_RI = carver.take(rows * c.intermediate * 2);
    ys_SH = carver.take(rows * c.hidden * 2);
    total_bytes = carver.bytes();
  }
};

}  // namespace

size_t fused_workspace_bytes(const LayerConfig& config) {
  return FusedWorkspace(config, nullptr).total_bytes;
}

RoutingPlan fused_routing_plan(const LayerConfig& config, void* workspace) {
  return FusedWorkspace(config, workspace).plan;
}

void fused_forward(const LayerConfig& c, const ForwardArgs& args) {
  const FusedWorkspace ws(c, args.workspace);
  const int64_t num_slots = args.num_tokens * c.top_k;  // upper bound of the rows in use
  launch_routing(args.topk_idx, args.num_tokens, c.top_k, c.num_experts, ws.plan,
                 args.expert_id_report, args.stream);
  if (num_slots == 0) return;

  const Sm90Rows rows =
      make_sm90_rows(ws.plan.expert_offsets, num_slots, c.num_experts, c.hidden, c.intermediate, 0, args.stream,
                     sm90_forward_dynamic_tile_order(c.num_experts) ? ws.plan.tile_counter : nullptr);

  Sm90GateUpParams gate_up;
  gate_up.rows = rows;
  gate_up.x = args.x;
  gate_up.row_slot = ws.plan.row_slot;
  gate_up.top_k = c.top_k;
  gate_up.w13 = args.w3 != nullptr ? args.w1 : args.w13;  // w1 with w3, the separate gate and up weights
  gate_up.w3 = args.w3;
  gate_up.h = ws.h_RI;
  gate_up.z = args.saved_z;  // null: the backward recomputes z
  gate_up.use_swiglu_clamp = c.use_swiglu_clamp;
  gate_up.swiglu_clamp = c.swiglu_clamp;
  launch_sm90_gate_up_swiglu(gate_up);

  Sm90DownParams down;
  down.rows = rows;
  down.h = ws.h_RI;
  down.w2 = args.w2;
  down.row_slot = ws.plan.row_slot;
  down.topk_weights = args.topk_weights;
  down.ys = ws.ys_SH;
  launch_sm90_down_weighted(down);

  launch_combine_slots(ws.ys_SH, ws.plan.slot_row, args.num_tokens, c.top_k, c.hidden, args.y,
                       args.stream);
}

}  // namespace fusemoe

// The fused forward (Impl::kFused): every step on the device, no host synchronisation, so the
// call can be captured in a CUDA graph. Stream order:
//   1. routing            stable counting sort of the T*K slots (kernels/routing.cu)
//   2. dispatch + gate/up + SwiGLU
//                         persistent TMA + wgmma grouped GEMM whose producer gathers the token
//                         rows of x straight into shared memory (row r = token row_slot[r] / K,
//                         a source table of one entry at EP = 1; no pool), h = silu(g) * u
//                         -> h [R, I]
//   3. down + weight      persistent grouped GEMM, w * (h W2^T) written to the token's slot
//                         row ys[t*K + j]  (a destination table of one entry at EP = 1)
//   4. combine            y_t = sum_j ys[t*K + j] in slot order (deterministic)
// Steps 2 and 3 as one launch with readiness counters (launch_sm90_forward_gemms: down tiles
// of a 128-row block start once its gate/up tiles are done) gave bitwise the same output but
// measured slower than two launches on the H200 (2026-11-29, standalone GEMM test, two
// launches timed before and after): 30B T=16384 2.19 vs 2.03 ms, 235B T=16384 8.06 vs 7.94,
// only 30B T=4096 faster (0.52 vs 0.54). So the forward keeps two launches.
// Step 4 inside the down kernel (Sm90DownParams::y: each token's column tile combined by the
// kernel's idle warps as soon as its last slot row is stored) gives the same bits but measured
// slower than the combine kernel (H200, 2026-11-29, standalone GEMM test, down + combine: 30B
// T=4096 0.32 vs 0.26 ms, 30B T=16384 0.99 vs 0.88, 235B T=16384 2.97 vs 3.01; docs/perf.md).
// So step 4 stays a kernel.
// Rows past expert_offsets[E] are never read or written; masked and invalid slots own no row.
// The row count R lives on the device only: launches are sized for T*K rows, and the GEMM
// kernels derive their tile lists from expert_offsets.
#include "launch/fused_moe.h"

#include "common/workspace_carver.h"
#include "kernels/moe_elementwise.h"
#include "kernels/sm90_moe_gemm.h"

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
    if (base) carve_routing_plan(static_cast<char*>(base), c.max_tokens, c.top_k, c.num_experts, &plan);
    WorkspaceCarver carver(base, routing_plan_bytes(c.max_tokens, c.top_k, c.num_experts));
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

  Sm90GateUpParams gate_up;
  gate_up.sources.x[0] = args.x;
  gate_up.sources.num_rows[0] = args.num_tokens;
  gate_up.sources.num_sources = 1;
  gate_up.row_slot = ws.plan.row_slot;
  gate_up.top_k = c.top_k;
  gate_up.w13 = args.w13;
  gate_up.h = ws.h_RI;
  gate_up.z = args.saved_z;  // null: the backward recomputes z
  gate_up.expert_offsets = ws.plan.expert_offsets;
  gate_up.max_rows = num_slots;
  gate_up.hidden = c.hidden;
  gate_up.intermediate = c.intermediate;
  gate_up.num_experts = c.num_experts;
  gate_up.use_swiglu_clamp = c.use_swiglu_clamp;
  gate_up.swiglu_clamp = c.swiglu_clamp;
  gate_up.stream = args.stream;
  launch_sm90_gate_up_swiglu(gate_up);

  Sm90DownParams down;
  down.h = ws.h_RI;
  down.w2 = args.w2;
  down.ys = ws.ys_SH;
  down.expert_offsets = ws.plan.expert_offsets;
  down.row_slot = ws.plan.row_slot;
  down.topk_weights = args.topk_weights;
  down.max_rows = num_slots;
  down.hidden = c.hidden;
  down.intermediate = c.intermediate;
  down.num_experts = c.num_experts;
  down.num_slots = num_slots;
  down.stream = args.stream;
  launch_sm90_down_weighted(down);

  launch_combine_slots(ws.ys_SH, ws.plan.slot_row, args.num_tokens, c.top_k, c.hidden, args.y,
                       args.stream);
}

}  // namespace fusemoe

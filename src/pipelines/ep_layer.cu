// The expert-parallel layer (include/fusemoe/expert_parallel.h) on one rank. Arguments are
// validated by src/api before this runs. Stream order, forward:
//   source   1. call number + 1; routing of this rank's slots by GLOBAL expert (the single-GPU
//               routing: bad ids reported, rows of owner d contiguous, in (expert, slot) order)
//            2. token routing: the tokens each owner needs, each once (dest_TR sorted)
//            3. publish to every owner: counts per expert, tokens, per-row (token, slot, weight);
//               x into the stage; signal "message ready" to every owner
//   owner    4. wait for every source's message; row plan (local expert, source, slot)
//            5. pull each source's tokens into the pool (once per token and rank)
//            6. gate/up + SwiGLU (gathering pool rows), down + weight pushed into the source's
//               slot buffer; signal "rows ready" to every source
//   source   7. wait for every owner's rows; combine its slots in slot order -> y
// Backward: 1-5 again (x and dy staged, both pulled), the expert-sorted xs/dys pools, z (saved
// or recomputed), dgrad + SwiGLU with per-row weights, router gradients and dgrad-of-x rows
// pushed to the sources, "rows ready", the local weight gradients; the source combines its dx
// slots and takes its router gradients. The owner's rows follow the single GPU's order on the
// concatenated batch, so every output is bitwise the single-GPU fused layer's.
#include "pipelines/ep_layer.h"

#include "kernels/ep_exchange.h"
#include "kernels/moe_elementwise.h"
#include "kernels/routing.h"
#include "launchers/sm90_grouped_gemm.h"
#include "pipelines/backward_gemms.h"
#include "pipelines/ep_workspace.h"

namespace fusemoe {
namespace {

EpPeers peers_of(const EpConfig& c, void* const* peer_symmetric) {
  EpPeers peers{};
  for (int d = 0; d < c.world_size; ++d) peers.base[d] = static_cast<char*>(peer_symmetric[d]);
  peers.own = peers.base[c.rank];
  peers.rank = c.rank;
  peers.world_size = c.world_size;
  return peers;
}

// The rows problem of the owner's GEMMs: its local experts, capacity R * T * K rows. Static tile
// order (no counter): no kernel of the EP pass zeroes one before its GEMMs.
Sm90Rows owner_rows(const EpConfig& c, const EpPrivate& ws, int num_sms, cudaStream_t stream) {
  return make_sm90_rows(ws.owner.expert_offsets, c.world_size * c.layer.max_tokens * c.layer.top_k,
                        c.layer.num_experts / c.world_size, c.layer.hidden, c.layer.intermediate, num_sms, stream,
                        /*tile_counter=*/nullptr);
}

Sm90PeerRows peer_rows(const EpConfig& c, const EpPeers& peers, const EpSymmetric& own, const EpOwnerPlan& plan) {
  Sm90PeerRows to;
  to.row_src = plan.row_src;
  to.row_slot = plan.row_slot;
  to.row_weight = plan.row_weight;
  const int64_t slots_offset = static_cast<const char*>(own.slots) - peers.own;
  for (int d = 0; d < c.world_size; ++d) to.slot_buffers[d] = peers.base[d] + slots_offset;
  return to;
}

// Steps 1-5: this rank's message out, every source's message in, the owner plan and the pulls.
// The backward (with_dy) also stages and pulls dy. (Decided by the direction, never by the
// pointer: a rank with no tokens passes no dy, and as an owner still pulls the others'.)
void exchange(const EpConfig& c, const EpPeers& peers, const EpSymmetric& own, EpPrivate& ws, const EpCall& call,
              bool with_dy, const void* dy) {
  const void* x = call.x;
  const int32_t* topk_idx = call.topk_idx;
  const int64_t num_tokens = call.num_tokens;
  cudaStream_t stream = call.stream;
  const LayerConfig& l = c.layer;
  const int64_t R = c.world_size, El = l.num_experts / R;
  launch_ep_begin_call(own.epoch, stream);
  launch_routing(topk_idx, num_tokens, l.top_k, l.num_experts, ws.plan, call.expert_id_report, stream);
  launch_ep_mark_destinations(topk_idx, num_tokens, l.top_k, l.num_experts, c.world_size, ws.dest_TR, stream);
  launch_routing(ws.dest_TR, num_tokens, R, R, ws.token_plan, nullptr, stream);
  launch_ep_publish(peers, own, ws.plan, ws.token_plan, topk_idx, call.topk_weights, l.max_tokens, l.top_k,
                    l.num_experts, stream);
  const size_t row_bytes = static_cast<size_t>(l.hidden) * 2;  // copies of 0 rows are skipped
  if (num_tokens > 0) {
    FUSEMOE_CUDA_CHECK(cudaMemcpyAsync(own.x_stage, x, num_tokens * row_bytes, cudaMemcpyDeviceToDevice, stream));
  }
  if (with_dy && num_tokens > 0) {
    FUSEMOE_CUDA_CHECK(cudaMemcpyAsync(own.dy_stage, dy, num_tokens * row_bytes, cudaMemcpyDeviceToDevice, stream));
  }
  launch_ep_signal(peers, own, /*to_owners=*/true, stream);

  launch_ep_wait(peers, own, /*from_sources=*/true, stream);
  launch_ep_owner_plan(own, ws.owner, c.world_size, El, l.max_tokens, l.top_k, stream);
  launch_ep_pull_rows(peers, own, ws.owner, /*x=*/true, l.max_tokens, l.hidden, ws.x_pool, stream);
  if (with_dy) launch_ep_pull_rows(peers, own, ws.owner, /*x=*/false, l.max_tokens, l.hidden, ws.dy_pool, stream);
}

}  // namespace

size_t ep_symmetric_layout_bytes(const EpConfig& config) { return EpSymmetric(config, nullptr).total_bytes; }

size_t ep_private_workspace_bytes(const EpConfig& config, WorkspaceUse use) {
  return EpPrivate(config, nullptr, use).total_bytes;
}

RoutingPlan ep_routing_plan(const EpConfig& config, void* workspace) {
  return EpPrivate(config, workspace, WorkspaceUse::kForward).plan;
}

void ep_layer_forward(const EpConfig& c, const EpForwardArgs& a) {
  const LayerConfig& l = c.layer;
  const EpPeers peers = peers_of(c, a.call.peer_symmetric);
  const EpSymmetric own(c, a.call.peer_symmetric[c.rank]);
  EpPrivate ws(c, a.call.workspace, WorkspaceUse::kForward);
  exchange(c, peers, own, ws, a.call, /*with_dy=*/false, nullptr);

  const Sm90Rows rows = owner_rows(c, ws, a.call.num_sms, a.call.stream);
  Sm90GateUpParams gate_up;
  gate_up.rows = rows;
  gate_up.x = ws.x_pool;
  gate_up.row_slot = ws.owner.row_pool;  // token row = row_pool[r] / top_k with top_k 1
  gate_up.top_k = 1;
  gate_up.w13 = a.call.w13;
  gate_up.h = ws.h;
  gate_up.z = a.saved_state;
  gate_up.use_swiglu_clamp = l.use_swiglu_clamp;
  gate_up.swiglu_clamp = l.swiglu_clamp;
  launch_sm90_gate_up_swiglu(gate_up);

  const Sm90PeerRows to_sources = peer_rows(c, peers, own, ws.owner);
  Sm90DownParams down;
  down.rows = rows;
  down.h = ws.h;
  down.w2 = a.call.w2;
  down.to_peers = &to_sources;
  launch_sm90_down_weighted(down);
  launch_ep_signal(peers, own, /*to_owners=*/false, a.call.stream);

  launch_ep_wait(peers, own, /*from_sources=*/false, a.call.stream);
  launch_combine_slots(own.slots, ws.plan.slot_row, a.call.num_tokens, l.top_k, l.hidden, a.y, a.call.stream);
}

void ep_layer_backward(const EpConfig& c, const EpBackwardArgs& a) {
  const LayerConfig& l = c.layer;
  const int64_t H = l.hidden, El = l.num_experts / c.world_size;
  const EpPeers peers = peers_of(c, a.call.peer_symmetric);
  const EpSymmetric own(c, a.call.peer_symmetric[c.rank]);
  EpPrivate ws(c, a.call.workspace, a.saved_state != nullptr ? WorkspaceUse::kBackwardSavedZ : WorkspaceUse::kBackward);
  exchange(c, peers, own, ws, a.call, /*with_dy=*/true, a.dy);

  const Sm90Rows rows = owner_rows(c, ws, a.call.num_sms, a.call.stream);
  const int32_t* num_rows_device = ws.owner.expert_offsets + El;
  // x rows feed only the z recompute and dW13 (a null dw13: frozen gate/up weights).
  const bool need_xs = a.saved_state == nullptr || a.dw13 != nullptr;
  launch_gather_rows_device_count(ws.dy_pool, ws.dys, need_xs ? ws.x_pool : nullptr, need_xs ? ws.xs : nullptr,
                                  ws.owner.row_pool, num_rows_device, rows.max_rows, 1, H, a.call.stream);
  BackwardRows b;
  b.xs = ws.xs;
  b.dys = ws.dys;
  b.saved_z = a.saved_state;  // the forward of the same inputs: the same plan, so the same row order
  b.z_scratch = ws.z;
  b.dz = ws.dz;
  b.wh = ws.wh;
  b.router_partials = ws.partials;
  b.weight_index = ws.owner.row_identity;  // weights by row: row_weight[row_identity[r]]
  b.weights = ws.owner.row_weight;
  const int64_t num_n_tiles = launch_backward_dgrad(rows, l, b, a.call.w13, nullptr, a.call.w2);
  launch_ep_push_router_grads(peers, own, ws.owner, El, ws.partials, num_n_tiles, rows.max_rows, a.call.stream);

  const Sm90PeerRows to_sources = peer_rows(c, peers, own, ws.owner);
  Sm90DgradScatterParams d2;
  d2.rows = rows;
  d2.dz = ws.dz;
  d2.w13 = a.call.w13;
  d2.to_peers = &to_sources;
  launch_sm90_dgrad_scatter(d2);
  launch_ep_signal(peers, own, /*to_owners=*/false, a.call.stream);

  // The weight gradients stay local; they run while the sources combine (each skipped when its
  // output is null).
  launch_backward_weight_grads(rows, b, a.dw13, nullptr, a.dw2, a.weight_grad_dtype, a.accumulate_weight_grads);

  launch_ep_wait(peers, own, /*from_sources=*/false, a.call.stream);
  launch_combine_slots(own.slots, ws.plan.slot_row, a.call.num_tokens, l.top_k, H, a.dx, a.call.stream);
  launch_ep_finish_router_grads(own, ws.plan.slot_row, a.call.num_tokens * l.top_k, a.d_topk_weights,
                                a.call.stream);
}

}  // namespace fusemoe

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
// Precision::kFp8Blockwise: the exchange moves bf16 rows as above; the owner quantizes its pulled
// pool rows per row (1 x 128 along H, the single GPU's per-token recipe: a block lies in one row,
// so the codes and scales are the single GPU's) and runs the FP8 GEMMs of fused_fp8.cu on them,
// gathering pool rows by row_pool (top_k 1); the weight gradients stay the bf16-input ones.
#include "pipelines/ep_layer.h"

#include "common/assert.h"
#include "kernels/ep_exchange.h"
#include "kernels/fp8_quantize.h"
#include "kernels/moe_elementwise.h"
#include "kernels/routing.h"
#include "launchers/sm90_fp8_gemms.h"
#include "launchers/sm90_grouped_gemm.h"
#include "pipelines/backward_gemms.h"
#include "pipelines/ep_workspace.h"
#include "pipelines/fused_fp8.h"

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

// The FP8 weights of this rank's experts: the buffer ep_quantize_weights_fp8 wrote.
Fp8Weights local_fp8_weights(const EpConfig& c, const void* fp8_weights) {
  return fp8_weights_in(ep_owner_layer(c), fp8_weights);
}

// Rows of the owner's pools in use (every source's pulled tokens): pool_base[R], on the device.
const int32_t* pool_rows_in_use(const EpConfig& c, const EpPrivate& ws) { return ws.owner.pool_base + c.world_size; }

// The pools' capacity P = R * T (EpPrivate).
int64_t pool_capacity(const EpConfig& c) { return c.world_size * c.layer.max_tokens; }

// Steps 1-5: this rank's message out, every source's message in, the owner plan and the pulls.
// The backward (with_dy) also stages and pulls dy. (Decided by the direction, never by the
// pointer: a rank with no tokens passes no dy, and as an owner still pulls the others'.) Every
// source stages x; whether an owner pulls it (pull_x) is the owner's own need, so ranks whose
// calls differ in it (frozen weights on one rank only) still agree on what is staged.
void exchange(const EpConfig& c, const EpPeers& peers, const EpSymmetric& own, EpPrivate& ws, const EpCall& call,
              bool with_dy, const void* dy, bool pull_x = true) {
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
  if (pull_x) launch_ep_pull_rows(peers, own, ws.owner, /*x=*/true, l.max_tokens, l.hidden, ws.x_pool, stream);
  if (with_dy) launch_ep_pull_rows(peers, own, ws.owner, /*x=*/false, l.max_tokens, l.hidden, ws.dy_pool, stream);
}

// Forward step 6 at FP8: the x pool quantized per row -> gate/up + SwiGLU (h in E4M3, and bf16 z
// when saved) -> down + weight pushed to the sources' slot buffers.
void owner_forward_fp8(const EpConfig& c, const EpForwardArgs& a, const EpPrivate& ws, const Sm90Rows& rows,
                       const Sm90PeerRows& to_sources) {
  const LayerConfig& l = c.layer;
  const Fp8Weights weights = local_fp8_weights(c, a.call.fp8_weights);
  launch_quantize_token_rows_fp8_device_count(ws.x_pool, pool_rows_in_use(c, ws), pool_capacity(c), l.hidden,
                                              ws.x_pool_fp8, ws.x_pool_scales, a.call.stream);
  Sm90Fp8GateUpParams gate_up;
  gate_up.rows = rows;
  gate_up.x_fp8 = ws.x_pool_fp8;
  gate_up.x_scales = ws.x_pool_scales;
  gate_up.row_slot = ws.owner.row_pool;  // pool row = row_pool[r] / top_k with top_k 1
  gate_up.top_k = 1;
  gate_up.weights = weights;
  gate_up.h_fp8 = ws.h_fp8;
  gate_up.h_scales = ws.h_scales;
  gate_up.z = a.saved_state;
  gate_up.use_swiglu_clamp = l.use_swiglu_clamp;
  gate_up.swiglu_clamp = l.swiglu_clamp;
  launch_sm90_fp8_gate_up_swiglu(gate_up);

  Sm90Fp8DownParams down;
  down.rows = rows;
  down.h_fp8 = ws.h_fp8;
  down.h_scales = ws.h_scales;
  down.weights = weights;
  down.to_peers = &to_sources;  // weighted by row_weight[r]
  launch_sm90_fp8_down_weighted(down);
}

// The owner's backward GEMMs at FP8, after the bf16 xs/dys pools: the dy pool quantized per row,
// z (saved, or recomputed from the x pool quantized per row), dgrad + SwiGLU with per-row weights
// (dz in bf16 for dW13 and in E4M3 for dgrad of x), router gradients pushed at the FP8 dgrad's
// tile width, dgrad of x pushed to the sources' slot buffers.
void owner_backward_fp8(const EpConfig& c, const EpBackwardArgs& a, const EpPrivate& ws, const Sm90Rows& rows,
                        const BackwardRows& b, const EpPeers& peers, const EpSymmetric& own,
                        const Sm90PeerRows& to_sources) {
  const LayerConfig& l = c.layer;
  const int64_t H = l.hidden, I = l.intermediate, El = l.num_experts / c.world_size;
  cudaStream_t stream = a.call.stream;
  const Fp8Weights weights = local_fp8_weights(c, a.call.fp8_weights);
  launch_quantize_token_rows_fp8_device_count(ws.dy_pool, pool_rows_in_use(c, ws), pool_capacity(c), H,
                                              ws.dy_pool_fp8, ws.dy_pool_scales, stream);
  const void* z = b.saved_z;
  if (z == nullptr) {
    launch_quantize_token_rows_fp8_device_count(ws.x_pool, pool_rows_in_use(c, ws), pool_capacity(c), H,
                                                ws.x_pool_fp8, ws.x_pool_scales, stream);
    Sm90Fp8RecomputeZParams rz;
    rz.rows = rows;
    rz.x_fp8 = ws.x_pool_fp8;
    rz.x_scales = ws.x_pool_scales;
    rz.row_slot = ws.owner.row_pool;
    rz.top_k = 1;
    rz.weights = weights;
    rz.z = b.z_scratch;
    launch_sm90_fp8_recompute_z(rz);
    z = b.z_scratch;
  }
  Sm90Fp8DgradSwigluParams d1;
  d1.rows = rows;
  d1.dy_fp8 = ws.dy_pool_fp8;
  d1.dy_scales = ws.dy_pool_scales;
  d1.weights = weights;
  d1.z = z;
  d1.row_slot = ws.owner.row_pool;  // the gathered pool row (top_k 1)
  d1.top_k = 1;
  d1.topk_weights = b.weights;
  d1.weight_index = b.weight_index;  // the routing weight by row, not by the pool row
  d1.dz = b.dz;
  d1.wh = b.wh;
  d1.router_partials = b.router_partials;
  d1.dz_fp8 = ws.dz_fp8;
  d1.dz_scales = ws.dz_scales;
  d1.use_swiglu_clamp = l.use_swiglu_clamp;
  d1.swiglu_clamp = l.swiglu_clamp;
  launch_sm90_fp8_dgrad_swiglu(d1);
  const int64_t num_n_tiles = sm90_dgrad_num_n_tiles(I, kSm90Fp8DgradBlockN);
  FUSEMOE_ASSERT(num_n_tiles <= sm90_router_partials_per_row(I));  // EpPrivate::partials' row width
  launch_ep_push_router_grads(peers, own, ws.owner, El, b.router_partials, num_n_tiles, rows.max_rows, stream);

  Sm90Fp8DgradScatterParams d2;
  d2.rows = rows;
  d2.dz_fp8 = ws.dz_fp8;
  d2.dz_scales = ws.dz_scales;
  d2.weights = weights;
  d2.to_peers = &to_sources;
  launch_sm90_fp8_dgrad_scatter(d2);
}

}  // namespace

LayerConfig ep_owner_layer(const EpConfig& c) {
  LayerConfig owner = c.layer;
  owner.num_experts = c.layer.num_experts / c.world_size;
  owner.max_tokens = c.layer.max_tokens * c.layer.top_k * c.world_size;
  owner.top_k = 1;
  return owner;
}

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
  const Sm90PeerRows to_sources = peer_rows(c, peers, own, ws.owner);
  if (l.precision == Precision::kFp8Blockwise) {
    owner_forward_fp8(c, a, ws, rows, to_sources);
  } else {
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

    Sm90DownParams down;
    down.rows = rows;
    down.h = ws.h;
    down.w2 = a.call.w2;
    down.to_peers = &to_sources;
    launch_sm90_down_weighted(down);
  }
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
  // The pulled x rows feed dW13 and the z recompute only (BF16 and FP8): with z saved and the
  // gate/up weights frozen none is pulled.
  const bool pull_x = a.dw13 != nullptr || a.saved_state == nullptr;
  exchange(c, peers, own, ws, a.call, /*with_dy=*/true, a.dy, pull_x);

  const Sm90Rows rows = owner_rows(c, ws, a.call.num_sms, a.call.stream);
  const int32_t* num_rows_device = ws.owner.expert_offsets + El;
  const bool fp8 = l.precision == Precision::kFp8Blockwise;
  // x rows feed only dW13 (a null dw13: frozen gate/up weights) and, at BF16, the z recompute (the
  // FP8 recompute reads the quantized x pool instead). At FP8 the bf16 dy rows feed only dW2 (the
  // FP8 dgrad reads the quantized dy pool), as in the single-GPU FP8 layer.
  const bool need_xs = a.dw13 != nullptr || (a.saved_state == nullptr && !fp8);
  const bool need_dys = !fp8 || a.dw2 != nullptr;
  if (need_dys || need_xs) {
    const void* src_a = need_dys ? ws.dy_pool : ws.x_pool;
    void* dst_a = need_dys ? ws.dys : ws.xs;
    const bool both = need_dys && need_xs;
    launch_gather_rows_device_count(src_a, dst_a, both ? ws.x_pool : nullptr, both ? ws.xs : nullptr,
                                    ws.owner.row_pool, num_rows_device, rows.max_rows, 1, H, a.call.stream);
  }
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
  const Sm90PeerRows to_sources = peer_rows(c, peers, own, ws.owner);
  if (fp8) {
    owner_backward_fp8(c, a, ws, rows, b, peers, own, to_sources);
  } else {
    const int64_t num_n_tiles = launch_backward_dgrad(rows, l, b, a.call.w13, nullptr, a.call.w2);
    launch_ep_push_router_grads(peers, own, ws.owner, El, ws.partials, num_n_tiles, rows.max_rows, a.call.stream);

    Sm90DgradScatterParams d2;
    d2.rows = rows;
    d2.dz = ws.dz;
    d2.w13 = a.call.w13;
    d2.to_peers = &to_sources;
    launch_sm90_dgrad_scatter(d2);
  }
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

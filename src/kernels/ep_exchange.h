// The cross-rank steps of the expert-parallel layer (src/pipelines/ep_layer.cu): message
// publishing, signals and bounded waits, the owner's row plan, row pulls and pushes. Every
// rank's symmetric workspace has the same layout (pipelines/ep_workspace.h), so a field of rank
// d is d's base plus the field's offset in this rank's own layout (EpPeers::at).
// Signals carry the call number (the epoch, counted by each rank in its own symmetric memory):
// a flag that reaches the current call means "done for this call", so nothing is reset between
// calls. Writes to peers are made visible by a system-scope fence before the release store of
// the flag; readers acquire the flag at system scope.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/device_wait.h"
#include "pipelines/ep_workspace.h"

namespace fusemoe {

// The R ranks' symmetric workspaces as mapped in this process, and this rank's own layout.
struct EpPeers {
  char* base[kMaxRanks];
  char* own;  // base[rank]
  int32_t rank;
  int32_t world_size;
};

// dest_TR[t*R + d] = d if token t has a slot with an expert of rank d, else -1 (for the token
// routing: tokens by destination, each once).
void launch_ep_mark_destinations(const int32_t* topk_idx, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                 int32_t world_size, int32_t* dest_TR, cudaStream_t stream);

// epoch += 1 in this rank's symmetric memory (the number every signal of this call carries).
void launch_ep_begin_call(int32_t* epoch, cudaStream_t stream);

// Writes this rank's message to every owner d (into d's inbox[rank]): the row counts of d's
// experts, the tokens they read (each once), and per row (token index, slot, weight).
void launch_ep_publish(const EpPeers& peers, const EpSymmetric& own, const RoutingPlan& plan,
                       const RoutingPlan& token_plan, const int32_t* topk_idx, const float* topk_weights,
                       int64_t max_tokens, int64_t top_k, int64_t num_experts, cudaStream_t stream);

// After everything before it on the stream: every rank d's flag (message_flag[rank] when
// to_owners, rows_flag[rank] otherwise) = this call's epoch.
void launch_ep_signal(const EpPeers& peers, const EpSymmetric& own, bool to_owners, cudaStream_t stream);

// Waits until this rank's flags from every peer (message_flag when from_sources, else rows_flag)
// reach this call's epoch; bounded by device_wait_timeout().
void launch_ep_wait(const EpPeers& peers, const EpSymmetric& own, bool from_sources, cudaStream_t stream);

// The owner's row plan from its inbox (rows ordered by local expert, then source, then slot).
void launch_ep_owner_plan(const EpSymmetric& own, const EpOwnerPlan& plan, int32_t world_size,
                          int64_t local_experts, int64_t max_tokens, int64_t top_k, cudaStream_t stream);

// pool[pool_base[s] + i] = row tokens_s[i] of rank s's stage (x_stage when x, else dy_stage).
void launch_ep_pull_rows(const EpPeers& peers, const EpSymmetric& own, const EpOwnerPlan& plan, bool x,
                         int64_t max_tokens, int64_t hidden, void* pool, cudaStream_t stream);

// Backward: each owner row's router-weight gradient (the sum of its dgrad partials, in order)
// into d_topk_stage[slot] of its source rank.
void launch_ep_push_router_grads(const EpPeers& peers, const EpSymmetric& own, const EpOwnerPlan& plan,
                                 int64_t local_experts, const float* partials, int64_t num_n_tiles, int64_t max_rows,
                                 cudaStream_t stream);

// Backward, on the source: d_topk_w[s] = d_topk_stage[s] for routed slots, 0 for the others.
void launch_ep_finish_router_grads(const EpSymmetric& own, const int32_t* slot_row, int64_t num_slots,
                                   float* d_topk_w, cudaStream_t stream);

}  // namespace fusemoe

// Device routing: turns topk_idx [T, K] into an expert-sorted row order, on the device, with no
// host synchronisation (CUDA-graph capturable). Shared by every implementation.
//
// A "slot" is (t, j), flat index s = t*K + j. A "row" is a valid slot placed in expert order:
// rows of expert e occupy [expert_offsets[e], expert_offsets[e+1]) and, inside an expert, rows
// are in increasing slot order (a stable counting sort), so every later reduction over an
// expert's rows has a fixed order: results are bitwise deterministic.
// Masked slots (-1) and invalid ids (outside [-1, E)) get no row (slot_row = -1); invalid ids
// are counted in RoutingPlan::bad_id_info so the caller can report them. No id is ever used to
// index memory before it is range-checked.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace fusemoe {

// Pointers into the caller's workspace. Sizes: E counts, E+1 offsets, max_tokens*K for both
// row maps, kRoutingChunk-slot chunk histograms ([num_chunks, E]).
struct RoutingPlan {
  int32_t* expert_counts = nullptr;   // [E]
  int32_t* expert_offsets = nullptr;  // [E + 1]; expert_offsets[E] = number of rows R
  int32_t* row_slot = nullptr;        // [max_tokens * K]; first R entries valid
  int32_t* slot_row = nullptr;        // [max_tokens * K]; -1 for masked / invalid slots
  int32_t* chunk_counts = nullptr;    // [num_chunks(max_tokens*K), E] scratch
  int32_t* chunk_bad = nullptr;       // [num_chunks(max_tokens*K), 2] scratch: invalid ids, first slot
  // [0] number of invalid ids, [1] smallest flat slot holding one, [2] its value.
  int32_t* bad_id_info = nullptr;     // [3]
  // [2] the grouped GEMMs' dynamic tile order: next tile, CTAs done. Zeroed by routing_place, so
  // the GEMMs of the pass after it start at zero; each GEMM launch leaves it at zero.
  int32_t* tile_counter = nullptr;
};

// The counting sort works on chunks of kRoutingChunk consecutive slots, a block per chunk,
// kRoutingThreads threads per block walking the chunk in rounds of kRoutingThreads slots.
// 1024 slots per chunk: each block walks 4 rounds per chunk, and there are enough chunks to
// spread over the GPU at a few thousand tokens (4096-slot chunks left most SMs idle:
// docs/experiments.md#routing-chunk). The per-expert prefix over chunks is one thread per expert
// in each routing_place block, 16 loads in flight.
constexpr int kRoutingThreads = 256;
constexpr int kRoutingChunk = 1024;
static_assert(kRoutingChunk % kRoutingThreads == 0, "a chunk is a whole number of rounds");

inline int64_t routing_num_chunks(int64_t num_slots) {
  return (num_slots + kRoutingChunk - 1) / kRoutingChunk;
}

// Bytes for a RoutingPlan carved by carve_routing_plan (each array 256-byte aligned).
size_t routing_plan_bytes(int64_t max_tokens, int64_t top_k, int64_t num_experts);
// Lays out a plan at `base`; returns the first byte past it (256-byte aligned).
char* carve_routing_plan(char* base, int64_t max_tokens, int64_t top_k, int64_t num_experts,
                         RoutingPlan* plan);

// Throws fusemoe::Error naming the first invalid id if `bad` (RoutingPlan::bad_id_info copied
// to the host) records any.
void check_bad_id_record(const int32_t bad[3], int64_t num_experts, int64_t top_k);

// Launches the routing (routing_count, then routing_place: two ordinary launches, no grid barrier)
// on `stream` for T = num_tokens (0 allowed: counts become 0).
// caller_report: null, or the caller's ExpertIdReport (fusemoe.h) that a call with bad ids
// fills if it is still empty.
void launch_routing(const int32_t* topk_idx, int64_t num_tokens, int64_t top_k,
                    int64_t num_experts, const RoutingPlan& plan, int32_t* caller_report,
                    cudaStream_t stream);

}  // namespace fusemoe

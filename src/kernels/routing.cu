// Device routing (see routing.h): a stable counting sort of the T*K slots by expert id, in two
// launches (it was four: at small T a call's host time is mostly its launches,
// docs/perf.md#host-cost-of-the-op).
//   1. routing_count:  per chunk of kRoutingChunk slots (a block each), per-expert counts (shared
//                      atomics: the counts do not depend on the order of the atomics) and the
//                      chunk's invalid ids (count, smallest slot), so no record needs zeroing first.
//   2. routing_place:  per group of consecutive chunks (a block each, at most one per SM): the
//                      experts' totals and the prefix of the chunks before the group, read from
//                      the counts (every block reads them all: chunks x E loads, no third
//                      launch), the experts' offsets (a block scan), then per slot its rank among
//                      equal ids earlier in the chunk (warp match + per-warp histograms, round by
//                      round): row = offset[e] + prefix[e] + rank, increasing slot order inside
//                      each expert. Block 0 also publishes expert_counts, expert_offsets and the
//                      bad-id record.
// Neither kernel waits for another block (no grid barrier: a cooperative launch deadlocked
// beside a kernel spinning on another stream, docs/experiments.md#one-launch-routing).
#include "kernels/routing.h"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda/functional>

#include <algorithm>
#include <climits>

#include "common/workspace_carver.h"
#include "fusemoe/error.h"
#include "fusemoe/fusemoe.h"  // kMaxExperts
#include "launchers/sm90_launch_common.h"  // device_info: the SM count, queried once per device

namespace fusemoe {
namespace {

constexpr int kWarpsPerBlock = kRoutingThreads / 32;
constexpr int kRoundsPerChunk = kRoutingChunk / kRoutingThreads;
constexpr int kMaxRoutingExperts = static_cast<int>(kMaxExperts);  // one counter per expert in shared memory
constexpr int kExpertsPerThread = kMaxRoutingExperts / kRoutingThreads;  // the offsets' block scan
static_assert(kMaxRoutingExperts % kRoutingThreads == 0, "the offsets' block scan covers every expert");
constexpr int kLoadsInFlight = 16;  // the column sums over chunks are latency-bound otherwise

__global__ void __launch_bounds__(kRoutingThreads)
routing_count_kernel(const int32_t* __restrict__ topk_idx, int64_t num_slots, int num_experts,
                     int32_t* __restrict__ chunk_counts, int32_t* __restrict__ chunk_bad) {
  extern __shared__ int32_t expert_hist[];  // [E]
  __shared__ int32_t bad[2];                // invalid ids in the chunk, smallest such slot
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) expert_hist[e] = 0;
  if (threadIdx.x == 0) {
    bad[0] = 0;
    bad[1] = INT_MAX;
  }
  __syncthreads();
  const int64_t chunk_begin = int64_t(blockIdx.x) * kRoutingChunk;
  for (int round = 0; round < kRoundsPerChunk; ++round) {
    const int64_t slot = chunk_begin + round * kRoutingThreads + threadIdx.x;
    if (slot >= num_slots) break;
    const int32_t id = topk_idx[slot];
    if (id >= 0 && id < num_experts) {
      atomicAdd(&expert_hist[id], 1);
    } else if (id != -1) {
      atomicAdd(&bad[0], 1);
      atomicMin(&bad[1], static_cast<int32_t>(slot));
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    chunk_counts[int64_t(blockIdx.x) * num_experts + e] = expert_hist[e];
  }
  if (threadIdx.x == 0) {
    chunk_bad[2 * blockIdx.x] = bad[0];
    chunk_bad[2 * blockIdx.x + 1] = bad[1];
  }
}

// Block 0 of routing_place: the invalid ids of all chunks into bad_id_info (count, smallest slot,
// its value) and, when the caller gave one and it is still empty, into the caller's report.
__device__ void publish_bad_ids(const int32_t* __restrict__ topk_idx, int64_t num_chunks,
                                const int32_t* __restrict__ chunk_bad, int32_t* __restrict__ bad_id_info,
                                int32_t* caller_report) {
  using Reduce = cub::BlockReduce<int32_t, kRoutingThreads>;
  __shared__ typename Reduce::TempStorage temp;
  int32_t count = 0, first = INT_MAX;
  for (int64_t c = threadIdx.x; c < num_chunks; c += blockDim.x) {
    count += chunk_bad[2 * c];
    first = min(first, chunk_bad[2 * c + 1]);
  }
  const int32_t total = Reduce(temp).Sum(count);
  __syncthreads();  // temp is reused
  const int32_t first_slot = Reduce(temp).Reduce(first, cuda::minimum<int32_t>{});
  if (threadIdx.x == 0) {
    const int32_t first_bad_id = total > 0 ? topk_idx[first_slot] : 0;
    bad_id_info[0] = total;
    bad_id_info[1] = first_slot;
    bad_id_info[2] = first_bad_id;
    // The caller's report may live in host memory that the host reads without a sync: the count
    // goes last, after a system-wide fence, so a non-zero count means a whole record.
    volatile int32_t* report = caller_report;
    if (total > 0 && report != nullptr && report[0] == 0) {
      report[1] = first_slot;
      report[2] = first_bad_id;
      __threadfence_system();
      report[0] = total;
    }
  }
}

// One chunk's slots to their rows. offsets[e] + prefix[e]: the first row of expert e's slots in
// this chunk; prefix advances past the chunk for the group's next one.
__device__ void place_chunk(const int32_t* __restrict__ topk_idx, int64_t num_slots, int num_experts, int64_t chunk,
                            const int32_t* offsets, int32_t* prefix, int32_t* placed, int32_t* warp_hist,
                            int32_t* __restrict__ row_slot, int32_t* __restrict__ slot_row) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < num_experts * (kWarpsPerBlock + 1); i += blockDim.x) placed[i] = 0;
  __syncthreads();
  const int64_t chunk_begin = chunk * kRoutingChunk;
  for (int round = 0; round < kRoundsPerChunk; ++round) {
    if (chunk_begin + round * kRoutingThreads >= num_slots) break;  // uniform across the block
    const int64_t slot = chunk_begin + round * kRoutingThreads + threadIdx.x;
    const int32_t id = (slot < num_slots) ? topk_idx[slot] : -1;
    const bool valid = id >= 0 && id < num_experts;
    const int key = valid ? id : -1;  // all non-routed lanes share one key and are ignored
    const unsigned peers = __match_any_sync(0xffffffffu, key);
    const unsigned lanes_below = (1u << lane) - 1u;
    const int rank_in_warp = __popc(peers & lanes_below);
    const bool leader = (peers & lanes_below) == 0;
    if (valid && leader) warp_hist[warp * num_experts + id] = __popc(peers);
    __syncthreads();
    if (valid) {
      int32_t rank = placed[id] + rank_in_warp;
      for (int w = 0; w < warp; ++w) rank += warp_hist[w * num_experts + id];
      const int32_t row = offsets[id] + prefix[id] + rank;
      row_slot[row] = static_cast<int32_t>(slot);
      slot_row[slot] = row;
    } else if (slot < num_slots) {
      slot_row[slot] = -1;
    }
    __syncthreads();
    if (valid && leader) {
      atomicAdd(&placed[id], __popc(peers));
      warp_hist[warp * num_experts + id] = 0;
    }
    __syncthreads();
  }
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) prefix[e] += placed[e];  // the chunk's counts
  __syncthreads();
}

__global__ void __launch_bounds__(kRoutingThreads)
routing_place_kernel(const int32_t* __restrict__ topk_idx, int64_t num_slots, int num_experts,
                     int64_t chunks_per_block, RoutingPlan plan, int32_t* caller_report) {
  extern __shared__ int32_t smem[];
  int32_t* offsets = smem;                          // [E + 1]
  int32_t* prefix = offsets + num_experts + 1;      // [E]: rows of earlier chunks, per expert
  int32_t* placed = prefix + num_experts;           // [E] rows already placed in this chunk
  int32_t* warp_hist = placed + num_experts;        // [kWarpsPerBlock, E], zero between rounds
  using BlockScan = cub::BlockScan<int32_t, kRoutingThreads>;
  __shared__ typename BlockScan::TempStorage scan_temp;
  const int64_t num_chunks = (num_slots + kRoutingChunk - 1) / kRoutingChunk;  // routing_num_chunks
  const int64_t first_chunk = int64_t(blockIdx.x) * chunks_per_block;
  const int64_t end_chunk = std::min(first_chunk + chunks_per_block, num_chunks);

  // Per expert: the rows of the chunks before this block's and of all chunks, in chunk order.
  // placed[] holds the totals until the chunks are placed.
  const int32_t* counts = plan.chunk_counts;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int32_t before = 0, total = 0;
    for (int64_t c0 = 0; c0 < num_chunks; c0 += kLoadsInFlight) {
      int32_t batch[kLoadsInFlight];
#pragma unroll
      for (int b = 0; b < kLoadsInFlight; ++b) batch[b] = c0 + b < num_chunks ? counts[(c0 + b) * num_experts + e] : 0;
#pragma unroll
      for (int b = 0; b < kLoadsInFlight; ++b) {
        if (c0 + b < first_chunk) before += batch[b];
        total += batch[b];
      }
    }
    prefix[e] = before;
    placed[e] = total;
  }
  __syncthreads();
  // offsets = exclusive prefix of the totals: thread t sums experts [t * kExpertsPerThread, ...)
  // serially, then one block scan.
  int32_t mine[kExpertsPerThread];
  int32_t sum = 0;
#pragma unroll
  for (int i = 0; i < kExpertsPerThread; ++i) {
    const int e = threadIdx.x * kExpertsPerThread + i;
    mine[i] = e < num_experts ? placed[e] : 0;
    sum += mine[i];
  }
  int32_t start = 0, num_rows = 0;
  BlockScan(scan_temp).ExclusiveSum(sum, start, num_rows);
#pragma unroll
  for (int i = 0; i < kExpertsPerThread; ++i) {
    const int e = threadIdx.x * kExpertsPerThread + i;
    if (e < num_experts) offsets[e] = start;
    start += mine[i];
  }
  if (threadIdx.x == 0) offsets[num_experts] = num_rows;  // R
  __syncthreads();
  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e <= num_experts; e += blockDim.x) {
      plan.expert_offsets[e] = offsets[e];
      if (e < num_experts) plan.expert_counts[e] = placed[e];
    }
    publish_bad_ids(topk_idx, num_chunks, plan.chunk_bad, plan.bad_id_info, caller_report);
    if (threadIdx.x < 2) plan.tile_counter[threadIdx.x] = 0;
  }
  __syncthreads();  // placed[] (the totals) is read above before place_chunk clears it
  for (int64_t chunk = first_chunk; chunk < end_chunk; ++chunk) {
    place_chunk(topk_idx, num_slots, num_experts, chunk, offsets, prefix, placed, warp_hist, plan.row_slot,
                plan.slot_row);
  }
}

constexpr size_t place_smem_bytes(int num_experts) {
  return (size_t(num_experts) * (kWarpsPerBlock + 3) + 1) * sizeof(int32_t);
}
// With its static temporaries (1.2 KB: the block scan's and reduction's) the largest E stays under
// the 48 KB a launch may take without opting in.
static_assert(place_smem_bytes(kMaxRoutingExperts) + 2048 <= 48 * 1024, "routing_place's shared memory");

}  // namespace

size_t routing_plan_bytes(int64_t max_tokens, int64_t top_k, int64_t num_experts) {
  const int64_t max_slots = max_tokens * top_k;
  const int64_t num_chunks = routing_num_chunks(max_slots) > 0 ? routing_num_chunks(max_slots) : 1;
  return align_workspace(num_experts * 4) + align_workspace((num_experts + 1) * 4) +
         2 * align_workspace(max_slots * 4) + align_workspace(num_chunks * num_experts * 4) +
         align_workspace(num_chunks * 2 * 4) + align_workspace(3 * 4) + align_workspace(2 * 4);
}

char* carve_routing_plan(char* base, int64_t max_tokens, int64_t top_k, int64_t num_experts,
                         RoutingPlan* plan) {
  const int64_t max_slots = max_tokens * top_k;
  const int64_t num_chunks = routing_num_chunks(max_slots) > 0 ? routing_num_chunks(max_slots) : 1;
  auto take = [&base](size_t bytes) {
    char* p = base;
    base += align_workspace(bytes);
    return reinterpret_cast<int32_t*>(p);
  };
  plan->expert_counts = take(num_experts * 4);
  plan->expert_offsets = take((num_experts + 1) * 4);
  plan->row_slot = take(max_slots * 4);
  plan->slot_row = take(max_slots * 4);
  plan->chunk_counts = take(num_chunks * num_experts * 4);
  plan->chunk_bad = take(num_chunks * 2 * 4);
  plan->bad_id_info = take(3 * 4);
  plan->tile_counter = take(2 * 4);
  return base;
}

void check_bad_id_record(const int32_t bad[3], int64_t num_experts, int64_t top_k) {
  FUSEMOE_CHECK(bad[0] == 0, "topk_idx: " << bad[0] << " expert id(s) outside [-1, " << num_experts
                                          << "); first at token " << bad[1] / top_k << ", slot "
                                          << bad[1] % top_k << ", value " << bad[2]);
}

void launch_routing(const int32_t* topk_idx, int64_t num_tokens, int64_t top_k,
                    int64_t num_experts, const RoutingPlan& plan, int32_t* caller_report,
                    cudaStream_t stream) {
  FUSEMOE_CHECK(num_experts >= 1 && num_experts <= kMaxRoutingExperts,
                "routing supports 1..." << kMaxRoutingExperts << " experts, got " << num_experts);
  const int64_t num_slots = num_tokens * top_k;
  const int64_t num_chunks = routing_num_chunks(num_slots);
  const int experts = static_cast<int>(num_experts);
  if (num_chunks > 0) {
    routing_count_kernel<<<num_chunks, kRoutingThreads, experts * sizeof(int32_t), stream>>>(
        topk_idx, num_slots, experts, plan.chunk_counts, plan.chunk_bad);
    FUSEMOE_CUDA_CHECK(cudaGetLastError());
  }
  // At most one block per SM: every block reads all chunks' counts, so more blocks cost more reads.
  // T = 0: one block, no chunks (it still publishes zero counts and offsets).
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(num_chunks, sm90::device_info().num_sms));
  const int64_t chunks_per_block = std::max<int64_t>(1, (num_chunks + blocks - 1) / blocks);
  const int64_t grid = std::max<int64_t>(1, (num_chunks + chunks_per_block - 1) / chunks_per_block);
  const size_t smem = place_smem_bytes(experts);  // 45 KB at E = 1024, under the 48 KB default
  routing_place_kernel<<<static_cast<unsigned>(grid), kRoutingThreads, smem, stream>>>(
      topk_idx, num_slots, experts, chunks_per_block, plan, caller_report);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace fusemoe

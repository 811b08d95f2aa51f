// Device routing (see routing.h): a stable counting sort of the T*K slots by expert id.
//   1. routing_init:   reset the bad-id record (kernel, so the op stays graph-capturable).
//   2. routing_count:  per chunk of kRoutingChunk slots, per-expert counts (shared atomics:
//                      the counts do not depend on the order of the atomics).
//   3. routing_scan:   per expert, exclusive prefix over chunks; then over experts -> offsets.
//   4. routing_place:  per slot, its rank among equal ids earlier in the chunk (warp match +
//                      per-warp histograms, round by round), so row = offset[e] +
//                      chunk_prefix[c][e] + rank: increasing slot order inside each expert.
#include "kernels/routing.h"

#include <climits>

#include "common/workspace_carver.h"
#include "fusemoe/error.h"

namespace fusemoe {
namespace {

constexpr int kWarpsPerBlock = kRoutingThreads / 32;
constexpr int kRoundsPerChunk = kRoutingChunk / kRoutingThreads;
constexpr int kScanThreads = 1024;  // >= kMaxExperts: one expert per thread in routing_scan


__global__ void routing_init_kernel(int32_t* bad_id_info) {
  bad_id_info[0] = 0;
  bad_id_info[1] = INT_MAX;
  bad_id_info[2] = 0;
}

__global__ void __launch_bounds__(kRoutingThreads)
routing_count_kernel(const int32_t* __restrict__ topk_idx, int64_t num_slots, int num_experts,
                     int32_t* __restrict__ chunk_counts, int32_t* __restrict__ bad_id_info) {
  extern __shared__ int32_t expert_hist[];  // [E]
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) expert_hist[e] = 0;
  __syncthreads();
  const int64_t chunk_begin = int64_t(blockIdx.x) * kRoutingChunk;
  for (int round = 0; round < kRoundsPerChunk; ++round) {
    const int64_t slot = chunk_begin + round * kRoutingThreads + threadIdx.x;
    if (slot >= num_slots) break;
    const int32_t id = topk_idx[slot];
    if (id >= 0 && id < num_experts) {
      atomicAdd(&expert_hist[id], 1);
    } else if (id != -1) {
      atomicAdd(&bad_id_info[0], 1);
      atomicMin(&bad_id_info[1], static_cast<int32_t>(slot));
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    chunk_counts[int64_t(blockIdx.x) * num_experts + e] = expert_hist[e];
  }
}

// One block. Thread e turns column e of chunk_counts into exclusive chunk prefixes and the
// expert's total; the block then scans the totals into expert_offsets.
__global__ void __launch_bounds__(kScanThreads)
routing_scan_kernel(const int32_t* __restrict__ topk_idx, int64_t num_chunks, int num_experts,
                    int32_t* __restrict__ chunk_counts, int32_t* __restrict__ expert_counts,
                    int32_t* __restrict__ expert_offsets, int32_t* __restrict__ bad_id_info,
                    int32_t* caller_report) {
  __shared__ int32_t scan[kScanThreads];
  const int e = threadIdx.x;
  int32_t total = 0;
  if (e < num_experts) {
    // Batches of 16 independent loads: the loop is latency-bound otherwise.
    constexpr int kBatch = 16;
    for (int64_t c0 = 0; c0 < num_chunks; c0 += kBatch) {
      int32_t counts[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        counts[b] = (c0 + b < num_chunks) ? chunk_counts[(c0 + b) * num_experts + e] : 0;
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (c0 + b < num_chunks) chunk_counts[(c0 + b) * num_experts + e] = total;
        total += counts[b];
      }
    }
    expert_counts[e] = total;
  }
  // Inclusive Hillis-Steele scan over the experts' totals.
  scan[e] = total;
  __syncthreads();
  for (int stride = 1; stride < kScanThreads; stride *= 2) {
    const int32_t add = (e >= stride) ? scan[e - stride] : 0;
    __syncthreads();
    scan[e] += add;
    __syncthreads();
  }
  if (e < num_experts) expert_offsets[e + 1] = scan[e];
  if (e == 0) {
    expert_offsets[0] = 0;
    if (bad_id_info[0] > 0) {
      const int32_t first_bad_id = topk_idx[bad_id_info[1]];
      bad_id_info[2] = first_bad_id;
      // The caller's report may live in host memory that the host reads without a sync: the
      // count goes last, after a system-wide fence, so a non-zero count means a whole record.
      volatile int32_t* report = caller_report;
      if (report != nullptr && report[0] == 0) {
        report[1] = bad_id_info[1];
        report[2] = first_bad_id;
        __threadfence_system();
        report[0] = bad_id_info[0];
      }
    }
  }
}

__global__ void __launch_bounds__(kRoutingThreads)
routing_place_kernel(const int32_t* __restrict__ topk_idx, int64_t num_slots, int num_experts,
                     const int32_t* __restrict__ chunk_counts,
                     const int32_t* __restrict__ expert_offsets, int32_t* __restrict__ row_slot,
                     int32_t* __restrict__ slot_row) {
  extern __shared__ int32_t smem[];
  int32_t* placed = smem;                     // [E] rows already placed in this chunk
  int32_t* warp_hist = smem + num_experts;    // [kWarpsPerBlock, E], zero between rounds
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < num_experts * (kWarpsPerBlock + 1); i += blockDim.x) smem[i] = 0;
  __syncthreads();

  const int64_t chunk_begin = int64_t(blockIdx.x) * kRoutingChunk;
  const int32_t* chunk_base = chunk_counts + int64_t(blockIdx.x) * num_experts;
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
      const int32_t row = expert_offsets[id] + chunk_base[id] + rank;
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
}

}  // namespace

size_t routing_plan_bytes(int64_t max_tokens, int64_t top_k, int64_t num_experts) {
  const int64_t max_slots = max_tokens * top_k;
  const int64_t num_chunks = routing_num_chunks(max_slots) > 0 ? routing_num_chunks(max_slots) : 1;
  return align_workspace(num_experts * 4) + align_workspace((num_experts + 1) * 4) +
         2 * align_workspace(max_slots * 4) + align_workspace(num_chunks * num_experts * 4) + align_workspace(3 * 4);
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
  plan->bad_id_info = take(3 * 4);
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
  FUSEMOE_CHECK(num_experts >= 1 && num_experts <= kScanThreads,
                "routing supports 1..." << kScanThreads << " experts, got " << num_experts);
  const int64_t num_slots = num_tokens * top_k;
  const int64_t num_chunks = routing_num_chunks(num_slots);
  const int experts = static_cast<int>(num_experts);
  routing_init_kernel<<<1, 1, 0, stream>>>(plan.bad_id_info);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
  if (num_chunks > 0) {
    routing_count_kernel<<<num_chunks, kRoutingThreads, experts * sizeof(int32_t), stream>>>(
        topk_idx, num_slots, experts, plan.chunk_counts, plan.bad_id_info);
    FUSEMOE_CUDA_CHECK(cudaGetLastError());
  }
  routing_scan_kernel<<<1, kScanThreads, 0, stream>>>(topk_idx, num_chunks, experts,
                                                      plan.chunk_counts, plan.expert_counts,
                                                      plan.expert_offsets, plan.bad_id_info,
                                                      caller_report);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
  if (num_chunks > 0) {
    const size_t smem = size_t(experts) * (kWarpsPerBlock + 1) * sizeof(int32_t);
    if (smem > 48 * 1024) {
      FUSEMOE_CUDA_CHECK(cudaFuncSetAttribute(
          routing_place_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    }
    routing_place_kernel<<<num_chunks, kRoutingThreads, smem, stream>>>(
        topk_idx, num_slots, experts, plan.chunk_counts, plan.expert_offsets, plan.row_slot,
        plan.slot_row);
    FUSEMOE_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace fusemoe

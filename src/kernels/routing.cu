// Device routing (see routing.h): a stable counting sort of the T*K slots by expert id, in one
// cooperative launch whose phases are separated by grid barriers (one launch instead of four: the
// host cost of a call is mostly its launches, docs/perf.md#host-cost-of-the-op).
//   1. count:  per chunk of kRoutingChunk slots, per-expert counts (shared atomics: the counts
//              do not depend on the order of the atomics) and the chunk's invalid ids.
//   2. scan:   per expert, one warp: the exclusive prefix over chunks, in place, and the total.
//   3. place:  every block scans the totals into expert offsets; block 0 publishes them and the
//              bad-id record; per slot, its rank among equal ids earlier in the chunk (warp
//              match + per-warp histograms, round by round), so row = offset[e] +
//              chunk_prefix[c][e] + rank: increasing slot order inside each expert.
// Blocks walk the chunks (and warps the experts) grid-stride, so any T fits a grid of co-resident
// blocks; every block passes both barriers.
#include "kernels/routing.h"

#include <cooperative_groups.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/warp/warp_scan.cuh>
#include <cuda/functional>

#include <algorithm>
#include <atomic>
#include <climits>

#include "common/workspace_carver.h"
#include "fusemoe/error.h"

namespace fusemoe {
namespace {

namespace cg = cooperative_groups;

constexpr int kWarpsPerBlock = kRoutingThreads / 32;
constexpr int kRoundsPerChunk = kRoutingChunk / kRoutingThreads;
constexpr int kMaxRoutingExperts = 1024;
constexpr int kExpertsPerThread = kMaxRoutingExperts / kRoutingThreads;  // phase 3's offset scan

// Dynamic shared memory: expert offsets [E + 1], then the work area (count: [E] histogram;
// place: [E] placed + [kWarpsPerBlock, E] warp histograms).
size_t routing_smem_bytes(int num_experts) {
  return (size_t(num_experts) + 1 + size_t(num_experts) * (kWarpsPerBlock + 1)) * sizeof(int32_t);
}

// Phase 1 for one chunk: its per-expert counts and its invalid ids (count, smallest slot).
__device__ void count_chunk(const int32_t* __restrict__ topk_idx, int64_t num_slots, int num_experts,
                            int64_t chunk, int32_t* hist, int32_t* chunk_bad_smem,
                            int32_t* __restrict__ chunk_counts, int32_t* __restrict__ chunk_bad) {
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) hist[e] = 0;
  if (threadIdx.x == 0) {
    chunk_bad_smem[0] = 0;
    chunk_bad_smem[1] = INT_MAX;
  }
  __syncthreads();
  const int64_t chunk_begin = chunk * kRoutingChunk;
  for (int round = 0; round < kRoundsPerChunk; ++round) {
    const int64_t slot = chunk_begin + round * kRoutingThreads + threadIdx.x;
    if (slot >= num_slots) break;
    const int32_t id = topk_idx[slot];
    if (id >= 0 && id < num_experts) {
      atomicAdd(&hist[id], 1);
    } else if (id != -1) {
      atomicAdd(&chunk_bad_smem[0], 1);
      atomicMin(&chunk_bad_smem[1], static_cast<int32_t>(slot));
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) chunk_counts[chunk * num_experts + e] = hist[e];
  if (threadIdx.x == 0) {
    chunk_bad[2 * chunk] = chunk_bad_smem[0];
    chunk_bad[2 * chunk + 1] = chunk_bad_smem[1];
  }
  __syncthreads();  // hist and chunk_bad_smem are reused by the next chunk
}

// Phase 2 for one expert, by one warp: chunk_counts[:, e] becomes its exclusive prefix.
__device__ void scan_expert_column(int e, int64_t num_chunks, int num_experts, int32_t* __restrict__ chunk_counts,
                                   int32_t* __restrict__ expert_counts,
                                   typename cub::WarpScan<int32_t>::TempStorage& temp) {
  const int lane = threadIdx.x % 32;
  int32_t running = 0;
  for (int64_t c0 = 0; c0 < num_chunks; c0 += 32) {
    const int64_t c = c0 + lane;
    const int32_t count = c < num_chunks ? chunk_counts[c * num_experts + e] : 0;
    int32_t inclusive = 0, total = 0;
    cub::WarpScan<int32_t>(temp).InclusiveSum(count, inclusive, total);
    if (c < num_chunks) chunk_counts[c * num_experts + e] = running + inclusive - count;
    running += total;
    __syncwarp();  // temp is reused by the next step
  }
  if (lane == 0) expert_counts[e] = running;
}

// Phase 3 for one chunk: each valid slot's row (the earlier place kernel, per chunk).
__device__ void place_chunk(const int32_t* __restrict__ topk_idx, int64_t num_slots, int num_experts, int64_t chunk,
                            const int32_t* offsets, const int32_t* __restrict__ chunk_prefix, int32_t* placed,
                            int32_t* warp_hist, int32_t* __restrict__ row_slot, int32_t* __restrict__ slot_row) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < num_experts * (kWarpsPerBlock + 1); i += blockDim.x) placed[i] = 0;
  __syncthreads();
  const int64_t chunk_begin = chunk * kRoutingChunk;
  const int32_t* prefix = chunk_prefix + chunk * num_experts;
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
}

// Block 0, phase 3: the invalid ids of all chunks into bad_id_info (count, smallest slot, its
// value) and, when the caller gave one and it is still empty, into the caller's report.
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
  if (threadIdx.x != 0) return;
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

__global__ void __launch_bounds__(kRoutingThreads)
routing_kernel(const int32_t* __restrict__ topk_idx, int64_t num_slots, int num_experts, RoutingPlan plan,
               int32_t* caller_report) {
  extern __shared__ int32_t smem[];
  int32_t* offsets = smem;                    // [E + 1], phase 3
  int32_t* work = smem + num_experts + 1;     // phase 1: [E] histogram; phase 3: placed, warp_hist
  __shared__ int32_t chunk_bad_smem[2];
  __shared__ typename cub::WarpScan<int32_t>::TempStorage warp_scan_temp[kWarpsPerBlock];
  using BlockScan = cub::BlockScan<int32_t, kRoutingThreads>;
  __shared__ typename BlockScan::TempStorage block_scan_temp;
  const cg::grid_group grid = cg::this_grid();
  const int64_t num_chunks = (num_slots + kRoutingChunk - 1) / kRoutingChunk;  // routing_num_chunks

  for (int64_t chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
    count_chunk(topk_idx, num_slots, num_experts, chunk, work, chunk_bad_smem, plan.chunk_counts, plan.chunk_bad);
  }
  grid.sync();

  const int warp = threadIdx.x / 32;
  for (int e = blockIdx.x * kWarpsPerBlock + warp; e < num_experts; e += gridDim.x * kWarpsPerBlock) {
    scan_expert_column(e, num_chunks, num_experts, plan.chunk_counts, plan.expert_counts, warp_scan_temp[warp]);
  }
  grid.sync();

  // Every block: offsets = exclusive prefix of the expert totals (thread t sums experts
  // [t * kExpertsPerThread, ...) serially, then one block scan).
  int32_t mine[kExpertsPerThread];
  int32_t sum = 0;
#pragma unroll
  for (int i = 0; i < kExpertsPerThread; ++i) {
    const int e = threadIdx.x * kExpertsPerThread + i;
    mine[i] = e < num_experts ? plan.expert_counts[e] : 0;
    sum += mine[i];
  }
  int32_t before = 0, num_rows = 0;
  BlockScan(block_scan_temp).ExclusiveSum(sum, before, num_rows);
#pragma unroll
  for (int i = 0; i < kExpertsPerThread; ++i) {
    const int e = threadIdx.x * kExpertsPerThread + i;
    if (e < num_experts) offsets[e] = before;
    before += mine[i];
  }
  if (threadIdx.x == 0) offsets[num_experts] = num_rows;  // R
  __syncthreads();
  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e <= num_experts; e += blockDim.x) plan.expert_offsets[e] = offsets[e];
    publish_bad_ids(topk_idx, num_chunks, plan.chunk_bad, plan.bad_id_info, caller_report);
  }
  int32_t* placed = work;                       // [E] rows already placed in this chunk
  int32_t* warp_hist = work + num_experts;      // [kWarpsPerBlock, E], zero between rounds
  for (int64_t chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
    place_chunk(topk_idx, num_slots, num_experts, chunk, offsets, plan.chunk_counts, placed, warp_hist,
                plan.row_slot, plan.slot_row);
  }
}

// Blocks of routing_kernel that fit on the device at once at the largest E (the cooperative
// launch's limit), per device, queried once.
int max_coresident_blocks() {
  int device = 0;
  FUSEMOE_CUDA_CHECK(cudaGetDevice(&device));
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[kMaxDevices] = {};
  if (device >= 0 && device < kMaxDevices) {
    if (const int blocks = known[device].load(std::memory_order_relaxed)) return blocks;
  }
  int per_sm = 0, sms = 0;
  FUSEMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, routing_kernel, kRoutingThreads,
                                                                   routing_smem_bytes(kMaxRoutingExperts)));
  FUSEMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int blocks = std::max(1, per_sm * sms);
  if (device >= 0 && device < kMaxDevices) known[device].store(blocks, std::memory_order_relaxed);
  return blocks;
}

}  // namespace

size_t routing_plan_bytes(int64_t max_tokens, int64_t top_k, int64_t num_experts) {
  const int64_t max_slots = max_tokens * top_k;
  const int64_t num_chunks = routing_num_chunks(max_slots) > 0 ? routing_num_chunks(max_slots) : 1;
  return align_workspace(num_experts * 4) + align_workspace((num_experts + 1) * 4) +
         2 * align_workspace(max_slots * 4) + align_workspace(num_chunks * num_experts * 4) +
         align_workspace(num_chunks * 2 * 4) + align_workspace(3 * 4);
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
  int64_t num_slots = num_tokens * top_k;
  int experts = static_cast<int>(num_experts);
  // Enough blocks for every chunk (count, place) and a warp per expert (scan), at most what fits
  // at once: a grid barrier needs every block resident.
  const int64_t wanted = std::max<int64_t>({routing_num_chunks(num_slots),
                                            (num_experts + kWarpsPerBlock - 1) / kWarpsPerBlock, 1});
  const int grid = static_cast<int>(std::min<int64_t>(wanted, max_coresident_blocks()));
  RoutingPlan plan_arg = plan;
  void* args[] = {const_cast<int32_t**>(&topk_idx), &num_slots, &experts, &plan_arg, &caller_report};
  FUSEMOE_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(routing_kernel), dim3(grid),
                                                 dim3(kRoutingThreads), args, routing_smem_bytes(experts), stream));
}

}  // namespace fusemoe

// Kernels of the expert-parallel exchange (ep_exchange.h). Small, memory-bound steps; the GEMMs
// are the sm90 grouped GEMM instances. Peer memory is reached through the symmetric layout: a
// field of rank d = peers.base[d] + (the field's offset in this rank's layout).
#include "kernels/ep_exchange.h"

#include <cub/block/block_scan.cuh>

#include <algorithm>

#include "common/assert.h"
#include "fusemoe/error.h"

namespace fusemoe {
namespace {

constexpr int kThreads = 256;
constexpr int kPlanThreads = 1024;  // the owner plan: one thread per local expert (E/R <= 1024)
constexpr int64_t kMaxBlocks = 4096;

int blocks_for(int64_t items, int threads = kThreads) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kMaxBlocks, (items + threads - 1) / threads)));
}

template <class T>
__device__ __forceinline__ T* peer_field(const EpPeers& peers, int d, int64_t offset) {
  return reinterpret_cast<T*>(peers.base[d] + offset);
}

__device__ __forceinline__ int32_t ld_acquire_sys(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(int32_t* p, int32_t v) {
  asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Offsets (in a rank's symmetric layout) of the inbox a rank writes on its peers: inbox[rank].
struct InboxOffsets {
  int64_t counts, num_tokens, tokens, entry_pos, entry_slot, entry_weight;
};

int64_t offset_of(const EpPeers& peers, const void* field) {
  return static_cast<int64_t>(static_cast<const char*>(field) - peers.own);
}

InboxOffsets inbox_offsets(const EpPeers& peers, const EpSymmetric& own) {
  const EpInbox& in = own.inbox[peers.rank];
  return {offset_of(peers, in.counts),    offset_of(peers, in.num_tokens), offset_of(peers, in.tokens),
          offset_of(peers, in.entry_pos), offset_of(peers, in.entry_slot), offset_of(peers, in.entry_weight)};
}

// The inbox of every source, as this (owner) rank reads it.
struct Inboxes {
  const int32_t* counts[kMaxRanks];
  const int32_t* num_tokens[kMaxRanks];
  const int32_t* tokens[kMaxRanks];
  const int32_t* entry_pos[kMaxRanks];
  const int32_t* entry_slot[kMaxRanks];
  const float* entry_weight[kMaxRanks];
};

Inboxes inboxes_of(const EpSymmetric& own, int world_size) {
  Inboxes in{};
  for (int s = 0; s < world_size; ++s) {
    in.counts[s] = own.inbox[s].counts;
    in.num_tokens[s] = own.inbox[s].num_tokens;
    in.tokens[s] = own.inbox[s].tokens;
    in.entry_pos[s] = own.inbox[s].entry_pos;
    in.entry_slot[s] = own.inbox[s].entry_slot;
    in.entry_weight[s] = own.inbox[s].entry_weight;
  }
  return in;
}

__global__ void ep_mark_destinations_kernel(const int32_t* __restrict__ topk_idx, int64_t num_tokens, int32_t top_k,
                                            int32_t num_experts, int32_t local_experts, int32_t world_size,
                                            int32_t* __restrict__ dest_TR) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < num_tokens; t += int64_t(gridDim.x) * blockDim.x) {
    uint32_t mask = 0;
    for (int32_t j = 0; j < top_k; ++j) {
      const int32_t id = topk_idx[t * top_k + j];
      if (id >= 0 && id < num_experts) mask |= 1u << (id / local_experts);  // invalid ids: masked, reported by routing
    }
    for (int32_t d = 0; d < world_size; ++d) dest_TR[t * world_size + d] = (mask >> d) & 1u ? d : -1;
  }
}

__global__ void ep_begin_call_kernel(int32_t* epoch) { *epoch += 1; }

// Counts, token count and token list of every owner's message.
__global__ void ep_publish_tokens_kernel(EpPeers peers, InboxOffsets io, const int32_t* __restrict__ expert_offsets,
                                         int32_t local_experts, const int32_t* __restrict__ token_offsets,
                                         const int32_t* __restrict__ token_row_slot, int64_t max_token_rows) {
  const int32_t R = peers.world_size;
  if (blockIdx.x == 0) {
    for (int32_t i = threadIdx.x; i < R * local_experts; i += blockDim.x) {
      const int32_t d = i / local_experts, e = i;  // global expert e = d * El + l
      peer_field<int32_t>(peers, d, io.counts)[i - d * local_experts] = expert_offsets[e + 1] - expert_offsets[e];
    }
    if (threadIdx.x < R) {
      const int32_t d = threadIdx.x;
      *peer_field<int32_t>(peers, d, io.num_tokens) = token_offsets[d + 1] - token_offsets[d];
    }
  }
  const int32_t num_rows = token_offsets[R];
  for (int64_t row = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; row < max_token_rows && row < num_rows;
       row += int64_t(gridDim.x) * blockDim.x) {
    const int32_t slot = token_row_slot[row];  // t * R + d
    const int32_t d = slot % R;
    peer_field<int32_t>(peers, d, io.tokens)[row - token_offsets[d]] = slot / R;
  }
}

// Per row of this rank's routing (global expert order): (token index, slot, weight) into the
// owner's inbox, in the same order.
__global__ void ep_publish_entries_kernel(EpPeers peers, InboxOffsets io, const int32_t* __restrict__ expert_offsets,
                                          const int32_t* __restrict__ row_slot, const int32_t* __restrict__ topk_idx,
                                          const float* __restrict__ topk_weights,
                                          const int32_t* __restrict__ token_slot_row,
                                          const int32_t* __restrict__ token_offsets, int32_t top_k,
                                          int32_t local_experts, int64_t max_rows) {
  const int32_t R = peers.world_size;
  const int32_t num_rows = expert_offsets[R * local_experts];
  for (int64_t row = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; row < max_rows && row < num_rows;
       row += int64_t(gridDim.x) * blockDim.x) {
    const int32_t slot = row_slot[row];
    const int32_t d = topk_idx[slot] / local_experts;  // a routed slot's id is valid
    const int32_t i = static_cast<int32_t>(row) - expert_offsets[d * local_experts];
    const int32_t t = slot / top_k;
    peer_field<int32_t>(peers, d, io.entry_pos)[i] = token_slot_row[int64_t(t) * R + d] - token_offsets[d];
    peer_field<int32_t>(peers, d, io.entry_slot)[i] = slot;
    peer_field<float>(peers, d, io.entry_weight)[i] = topk_weights[slot];
  }
}

__global__ void ep_signal_kernel(EpPeers peers, int64_t flag_offset, const int32_t* epoch) {
  // Everything this rank wrote before (earlier kernels and copies on the stream) is ordered
  // before the flag by the system-scope fence and the release store.
  __threadfence_system();
  if (threadIdx.x < peers.world_size) st_release_sys(peer_field<int32_t>(peers, threadIdx.x, flag_offset), *epoch);
}

// One thread per peer. On timeout the first waiter of the device fills the record and traps;
// the others wait until it is complete, then trap too.
__global__ void ep_wait_kernel(const int32_t* flags, const int32_t* epoch, int32_t world_size, WaitBound bound,
                               int32_t object, int32_t rank) {
  const int32_t peer = threadIdx.x;
  if (peer >= world_size) return;
  const int32_t wanted = *epoch;
  int32_t seen = ld_acquire_sys(flags + peer);
  if (seen - wanted >= 0) return;  // wrap-safe "seen >= wanted"
  const uint64_t start = now_ns();
  while ((seen = ld_acquire_sys(flags + peer)) - wanted < 0) {
    __nanosleep(256);
    const uint64_t waited = now_ns() - start;
    if (waited > bound.timeout_ns) {
      DeviceWaitRecord* r = bound.record;
      if (atomicCAS(&r->state, 0, -1) == 0) {
        r->site = wait_site(WaitKernel::kEpExchange, WaitRole::kExchange, static_cast<WaitObject>(object), 0);
        r->expected = 0;
        r->parity = 0;
        r->block = blockIdx.x;
        r->thread = threadIdx.x;
        r->waited_ns = waited;
        r->rank = rank;
        r->peer = peer;
        r->wanted = wanted;
        r->observed = seen;
        __threadfence_system();
        atomicExch(&r->state, 1);
        __threadfence_system();
      } else {
        while (*reinterpret_cast<volatile int32_t*>(&r->state) == -1) {
        }
      }
      __trap();
    }
  }
}

// One block: thread l owns local expert l.
__global__ void __launch_bounds__(kPlanThreads) ep_owner_plan_kernel(Inboxes in, EpOwnerPlan plan, int32_t world_size,
                                                                      int32_t local_experts) {
  using Scan = cub::BlockScan<int32_t, kPlanThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int32_t l = threadIdx.x;
  const bool mine = l < local_experts;
  int32_t rows_of_expert = 0;
  for (int32_t s = 0; s < world_size; ++s) rows_of_expert += mine ? in.counts[s][l] : 0;
  int32_t first_row = 0, total_rows = 0;
  Scan(scan_storage).ExclusiveSum(rows_of_expert, first_row, total_rows);
  if (mine) plan.expert_offsets[l] = first_row;
  if (l == 0) plan.expert_offsets[local_experts] = total_rows;
  int32_t row = first_row;
  for (int32_t s = 0; s < world_size; ++s) {
    const int32_t count = mine ? in.counts[s][l] : 0;
    if (mine) plan.bases[s * local_experts + l] = row;
    row += count;
    __syncthreads();  // scan_storage reuse
    int32_t begin = 0, entries = 0;
    Scan(scan_storage).ExclusiveSum(count, begin, entries);
    if (mine) plan.entry_begin[s * (local_experts + 1) + l] = begin;
    if (l == 0) plan.entry_begin[s * (local_experts + 1) + local_experts] = entries;
  }
  if (l == 0) {
    int32_t pool = 0;
    for (int32_t s = 0; s < world_size; ++s) {
      plan.pool_base[s] = pool;
      pool += *in.num_tokens[s];
    }
    plan.pool_base[world_size] = pool;
  }
}

// Every entry of every source to its row.
__global__ void ep_owner_place_kernel(Inboxes in, EpOwnerPlan plan, int32_t world_size, int32_t local_experts,
                                      int64_t max_slots) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < world_size * max_slots;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t s = static_cast<int32_t>(i / max_slots);
    const int32_t k = static_cast<int32_t>(i - s * max_slots);
    const int32_t* begin = plan.entry_begin + s * (local_experts + 1);
    if (k >= begin[local_experts]) continue;
    // The expert of entry k: the last l with begin[l] <= k.
    int32_t lo = 0, hi = local_experts - 1;
    while (lo < hi) {
      const int32_t mid = (lo + hi + 1) / 2;
      if (begin[mid] <= k) lo = mid; else hi = mid - 1;
    }
    const int32_t row = plan.bases[s * local_experts + lo] + (k - begin[lo]);
    plan.row_pool[row] = plan.pool_base[s] + in.entry_pos[s][k];
    plan.row_src[row] = s;
    plan.row_slot[row] = in.entry_slot[s][k];
    plan.row_weight[row] = in.entry_weight[s][k];
    plan.row_identity[row] = row;
  }
}

// A warp per pool row, 16-byte chunks.
__global__ void ep_pull_rows_kernel(EpPeers peers, Inboxes in, const int32_t* __restrict__ pool_base,
                                    int64_t stage_offset, int64_t max_tokens, int64_t hidden,
                                    __nv_bfloat16* __restrict__ pool) {
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int lane = threadIdx.x % 32;
  const int64_t chunks = hidden / 8;
  for (int64_t w = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; w < peers.world_size * max_tokens;
       w += warps) {
    const int32_t s = static_cast<int32_t>(w / max_tokens);
    const int32_t i = static_cast<int32_t>(w - s * max_tokens);
    if (i >= *in.num_tokens[s]) continue;
    const uint4* src = reinterpret_cast<const uint4*>(peer_field<__nv_bfloat16>(peers, s, stage_offset) +
                                                      int64_t(in.tokens[s][i]) * hidden);
    uint4* dst = reinterpret_cast<uint4*>(pool + int64_t(pool_base[s] + i) * hidden);
    for (int64_t c = lane; c < chunks; c += 32) dst[c] = src[c];
  }
}

__global__ void ep_push_router_grads_kernel(EpPeers peers, int64_t stage_offset, const int32_t* __restrict__ num_rows,
                                            const int32_t* __restrict__ row_src, const int32_t* __restrict__ row_slot,
                                            const float* __restrict__ partials, int32_t num_n_tiles, int64_t max_rows) {
  const int32_t rows = *num_rows;
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < max_rows && r < rows;
       r += int64_t(gridDim.x) * blockDim.x) {
    float sum = 0.0f;
    for (int32_t n = 0; n < num_n_tiles; ++n) sum += partials[r * num_n_tiles + n];  // in order, as on one GPU
    peer_field<float>(peers, row_src[r], stage_offset)[row_slot[r]] = sum;
  }
}

__global__ void ep_finish_router_grads_kernel(const float* __restrict__ stage, const int32_t* __restrict__ slot_row,
                                              int64_t num_slots, float* __restrict__ d_topk_w) {
  for (int64_t s = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; s < num_slots; s += int64_t(gridDim.x) * blockDim.x) {
    d_topk_w[s] = slot_row[s] >= 0 ? stage[s] : 0.0f;
  }
}

}  // namespace

void launch_ep_mark_destinations(const int32_t* topk_idx, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                 int32_t world_size, int32_t* dest_TR, cudaStream_t stream) {
  if (num_tokens == 0) return;
  ep_mark_destinations_kernel<<<blocks_for(num_tokens), kThreads, 0, stream>>>(
      topk_idx, num_tokens, static_cast<int32_t>(top_k), static_cast<int32_t>(num_experts),
      static_cast<int32_t>(num_experts / world_size), world_size, dest_TR);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_ep_begin_call(int32_t* epoch, cudaStream_t stream) {
  ep_begin_call_kernel<<<1, 1, 0, stream>>>(epoch);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_ep_publish(const EpPeers& peers, const EpSymmetric& own, const RoutingPlan& plan,
                       const RoutingPlan& token_plan, const int32_t* topk_idx, const float* topk_weights,
                       int64_t max_tokens, int64_t top_k, int64_t num_experts, cudaStream_t stream) {
  const InboxOffsets io = inbox_offsets(peers, own);
  const int32_t El = static_cast<int32_t>(num_experts / peers.world_size);
  const int64_t max_token_rows = max_tokens * peers.world_size;
  ep_publish_tokens_kernel<<<blocks_for(std::max<int64_t>(max_token_rows, 1)), kThreads, 0, stream>>>(
      peers, io, plan.expert_offsets, El, token_plan.expert_offsets, token_plan.row_slot, max_token_rows);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
  const int64_t max_rows = max_tokens * top_k;
  if (max_rows > 0) {
    ep_publish_entries_kernel<<<blocks_for(max_rows), kThreads, 0, stream>>>(
        peers, io, plan.expert_offsets, plan.row_slot, topk_idx, topk_weights, token_plan.slot_row,
        token_plan.expert_offsets, static_cast<int32_t>(top_k), El, max_rows);
    FUSEMOE_CUDA_CHECK(cudaGetLastError());
  }
}

void launch_ep_signal(const EpPeers& peers, const EpSymmetric& own, bool to_owners, cudaStream_t stream) {
  const int64_t flag_offset = offset_of(peers, (to_owners ? own.message_flag : own.rows_flag) + peers.rank);
  ep_signal_kernel<<<1, 32, 0, stream>>>(peers, flag_offset, own.epoch);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_ep_wait(const EpPeers& peers, const EpSymmetric& own, bool from_sources, cudaStream_t stream) {
  const WaitBound bound = device_wait_bound(WaitKernel::kEpExchange);
  const WaitObject object = from_sources ? WaitObject::kPeerMessage : WaitObject::kPeerRows;
  ep_wait_kernel<<<1, 32, 0, stream>>>(from_sources ? own.message_flag : own.rows_flag, own.epoch, peers.world_size,
                                       bound, static_cast<int32_t>(object), peers.rank);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_ep_owner_plan(const EpSymmetric& own, const EpOwnerPlan& plan, int32_t world_size,
                          int64_t local_experts, int64_t max_tokens, int64_t top_k, cudaStream_t stream) {
  FUSEMOE_ASSERT(local_experts >= 1 && local_experts <= kPlanThreads);
  const Inboxes in = inboxes_of(own, world_size);
  ep_owner_plan_kernel<<<1, kPlanThreads, 0, stream>>>(in, plan, world_size, static_cast<int32_t>(local_experts));
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
  const int64_t max_slots = max_tokens * top_k;
  if (max_slots > 0) {
    ep_owner_place_kernel<<<blocks_for(world_size * max_slots), kThreads, 0, stream>>>(
        in, plan, world_size, static_cast<int32_t>(local_experts), max_slots);
    FUSEMOE_CUDA_CHECK(cudaGetLastError());
  }
}

void launch_ep_pull_rows(const EpPeers& peers, const EpSymmetric& own, const EpOwnerPlan& plan, bool x,
                         int64_t max_tokens, int64_t hidden, void* pool, cudaStream_t stream) {
  if (max_tokens == 0) return;
  const Inboxes in = inboxes_of(own, peers.world_size);
  const int64_t rows = peers.world_size * max_tokens;
  ep_pull_rows_kernel<<<blocks_for(rows * 32), kThreads, 0, stream>>>(
      peers, in, plan.pool_base, offset_of(peers, x ? own.x_stage : own.dy_stage), max_tokens, hidden,
      static_cast<__nv_bfloat16*>(pool));
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_ep_push_router_grads(const EpPeers& peers, const EpSymmetric& own, const EpOwnerPlan& plan,
                                 int64_t local_experts, const float* partials, int64_t num_n_tiles, int64_t max_rows,
                                 cudaStream_t stream) {
  if (max_rows == 0) return;
  ep_push_router_grads_kernel<<<blocks_for(max_rows), kThreads, 0, stream>>>(
      peers, offset_of(peers, own.d_topk_stage), plan.expert_offsets + local_experts, plan.row_src, plan.row_slot,
      partials, static_cast<int32_t>(num_n_tiles), max_rows);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_ep_finish_router_grads(const EpSymmetric& own, const int32_t* slot_row, int64_t num_slots,
                                   float* d_topk_w, cudaStream_t stream) {
  if (num_slots == 0) return;
  ep_finish_router_grads_kernel<<<blocks_for(num_slots), kThreads, 0, stream>>>(own.d_topk_stage, slot_row,
                                                                                  num_slots, d_topk_w);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace fusemoe

// A bounded multi-producer, multi-consumer queue of small work items in shared memory, for
// handing work between the warps of one CTA (the down GEMM's consumer warps hand "these rows
// are stored" to the warps that run the fused combine, see sm90_moe_gemm.cu).
//
// Ticket-ordered cells with sequence numbers (D. Vyukov's bounded queue): a push takes the
// next tail ticket, waits until its cell has been freed for that lap (seq == ticket), writes
// the item and publishes it (seq = ticket + 1, release); a pop takes the next head ticket and
// waits for the item of that ticket (seq == ticket + 1, acquire), then frees the cell for the
// next lap (seq = ticket + capacity). Items come out in ticket order, so an item pushed after
// every other push (an end marker) is popped after all of them. A pop waits for its ticket's
// item to be pushed: every waiting popper must eventually get an item (the users push one end
// marker per popper). The release/acquire pair is CTA scope: an item published here carries
// the pusher's earlier writes (including global stores) to the popper, whose own GPU-scope
// fence then carries them further (fences are cumulative).
//
// Waits are bounded: after kQueueTimeoutNs (far beyond any use) the kernel traps, so a broken
// protocol fails the launch instead of hanging (a printf would make ptxas serialise the
// kernel's wgmmas).
#pragma once

#include <cstdint>

#include "device/sm90_ptx.cuh"

namespace fusemoe::sm90 {

constexpr uint64_t kQueueTimeoutNs = 5ull * 1000 * 1000 * 1000;

__device__ __forceinline__ int32_t ld_acquire_cta_shared(const int32_t* ptr) {
  int32_t value;
  asm volatile("ld.acquire.cta.shared::cta.b32 %0, [%1];" : "=r"(value) : "r"(smem_addr(ptr)) : "memory");
  return value;
}

__device__ __forceinline__ void st_release_cta_shared(int32_t* ptr, int32_t value) {
  asm volatile("st.release.cta.shared::cta.b32 [%0], %1;" ::"r"(smem_addr(ptr)), "r"(value) : "memory");
}

// Shared-memory atomics and item accesses through explicit shared-space PTX: the queue lives at
// a computed offset of dynamic shared memory, so the compiler would otherwise emit generic
// (GPU-scope) atomics and generic stores for it.
__device__ __forceinline__ int32_t atom_add_shared(int32_t* ptr, int32_t value) {
  int32_t old;
  asm volatile("atom.shared::cta.add.u32 %0, [%1], %2;" : "=r"(old) : "r"(smem_addr(ptr)), "r"(value) : "memory");
  return old;
}

__device__ __forceinline__ void st_shared_v2(int2* ptr, int2 value) {
  asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(smem_addr(ptr)), "r"(value.x), "r"(value.y) : "memory");
}

__device__ __forceinline__ int2 ld_shared_v2(const int2* ptr) {
  int2 value;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(value.x), "=r"(value.y) : "r"(smem_addr(ptr)) : "memory");
  return value;
}

__device__ __forceinline__ void fence_acq_rel_cta() { asm volatile("fence.acq_rel.cta;" ::: "memory"); }

// Spins until *seq == expected; the clock is read only after a few hundred polls.
__device__ __forceinline__ void wait_sequence(const int32_t* seq, int32_t expected) {
  if (ld_acquire_cta_shared(seq) == expected) return;
  uint64_t start = 0;
  for (uint32_t polls = 1;; ++polls) {
    __nanosleep(32);
    if (ld_acquire_cta_shared(seq) == expected) return;
    if ((polls & 255) == 0) {
      const uint64_t now = globaltimer_ns();
      if (start == 0) start = now;
      else if (now - start > kQueueTimeoutNs) __trap();
    }
  }
}

// kCapacity cells of one int2 item each; lives in dynamic shared memory. One thread per warp
// calls push / pop (the other lanes must reconverge with it before any warp-collective).
template <int kCapacity>
struct SmemWorkQueue {
  static_assert(kCapacity > 0 && (kCapacity & (kCapacity - 1)) == 0, "capacity must be a power of two");
  int32_t tail;  // next push ticket
  int32_t head;  // next pop ticket
  int32_t done;  // a counter the users may keep beside the queue (finished producers)
  int32_t pad;
  int32_t seq[kCapacity];
  int2 items[kCapacity];

  // Every thread of the CTA may call it; a __syncthreads() must follow before first use.
  __device__ __forceinline__ void init() {
    for (int i = threadIdx.x; i < kCapacity; i += blockDim.x) seq[i] = i;
    if (threadIdx.x == 0) { tail = 0; head = 0; done = 0; }
  }

  __device__ __forceinline__ void push(int2 item) {
    const int32_t ticket = atom_add_shared(&tail, 1);
    const int cell = ticket & (kCapacity - 1);
    wait_sequence(&seq[cell], ticket);  // the cell's previous item has been popped
    st_shared_v2(&items[cell], item);
    st_release_cta_shared(&seq[cell], ticket + 1);
  }

  __device__ __forceinline__ int2 pop() {
    const int32_t ticket = atom_add_shared(&head, 1);
    const int cell = ticket & (kCapacity - 1);
    wait_sequence(&seq[cell], ticket + 1);  // this ticket's item has been published
    const int2 item = ld_shared_v2(&items[cell]);
    st_release_cta_shared(&seq[cell], ticket + kCapacity);
    return item;
  }
};

}  // namespace fusemoe::sm90

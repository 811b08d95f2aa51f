// The stage ring between the producer warpgroup and the two consumer warpgroups of the sm90
// grouped GEMM: kStages shared-memory stages, each with a `full` and an `empty` mbarrier.
//
//   producer: wait empty[s] (parity phase ^ 1), fill stage s, signal full[s]
//   consumer: wait full[s] (parity phase), run the MMAs of stage s, arrive on empty[s]
//
// full[s] expects one arrival (the thread that posts the TMA byte count) plus, when the A
// operand is gathered by cp.async, one arrival per producer thread; empty[s] expects one
// arrival per warp of the consumers that read the stage (both warpgroups, or one in the
// ping-pong schedule, whose consumers skip the other's stages: RingCursor::skip), or one per
// thread where each thread reads the stage itself (the FP8 scales; GroupedGemm::kStageReleases).
// A fresh barrier counts as having completed the phase of parity 1, so the producer's first pass over
// the ring does not wait. Each role walks the ring with its
// own cursor; both see the same (tile, k-block) sequence, so their stages and phases agree.
// Every wait is bounded (WaitBound, common/device_wait.h): past the timeout the waiting thread
// records what it waited for in mapped host memory and traps, so a wrong byte count or a
// missing arrival fails the launch with a description instead of hanging the GPU.
#pragma once

#include <cstdint>

#include "common/device_wait.h"
#include "device/sm90_layout.cuh"
#include "device/sm90_ptx.cuh"

namespace fusemoe::sm90 {

#ifdef FUSEMOE_FAULT_INJECTION
constexpr bool kFaultInjection = true;  // the test build: WaitBound::fault is honoured
#else
constexpr bool kFaultInjection = false;
#endif

// Waits for the phase of `parity` of ring barrier `bar`, bounded by `bound`.
__device__ __forceinline__ void bounded_wait(uint64_t* bar, uint32_t parity, const WaitBound& bound, WaitRole role,
                                             WaitObject object, int stage, uint32_t expected) {
  uint64_t timeout_ns = bound.timeout_ns;
  if constexpr (kFaultInjection) {
    // With a fault injected, only the wait it targets keeps the timeout; the waits it blocks in
    // turn get 20x longer, so the report names the faulty wait, not a consequence of it.
    if (bound.fault != static_cast<int32_t>(WaitFault::kNone) && bound.fault != static_cast<int32_t>(object)) {
      timeout_ns *= 20;
    }
  }
  mbarrier_wait_or_trap(bar, parity, timeout_ns, bound.record,
                        wait_site(static_cast<WaitKernel>(bound.kernel), role, object, stage), expected);
}

// Test build, WaitFault::kStageFull: the producer announces 16 TMA bytes more than it loads, so
// the consumers' full wait times out.
__device__ __forceinline__ uint32_t announced_stage_bytes(uint32_t bytes, const WaitBound& bound) {
  if constexpr (kFaultInjection) {
    if (bound.fault == static_cast<int32_t>(WaitFault::kStageFull)) bytes += 16;
  }
  return bytes;
}

// Test build, WaitFault::kStageEmpty: the consumers never release a stage, so the producer's
// empty wait times out.
__device__ __forceinline__ bool releases_withheld(const WaitBound& bound) {
  return kFaultInjection && bound.fault == static_cast<int32_t>(WaitFault::kStageEmpty);
}

template <int kStages>
struct StageRing {
  uint64_t* full;   // [kStages]
  uint64_t* empty;  // [kStages]

  // One thread, before the CTA's first __syncthreads.
  __device__ __forceinline__ void init(bool all_producer_threads, uint32_t stage_releases) const {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full[s], 1 + (all_producer_threads ? kThreadsPerWarpgroup : 0));
      mbarrier_init(&empty[s], stage_releases);
    }
    fence_barrier_init();
  }
};

// A role's position in the ring.
template <int kStages>
struct RingCursor {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
  // Past n stages another role consumes (n >= 0).
  __device__ __forceinline__ void skip(int32_t n) {
    const int32_t s = stage + n;
    phase ^= static_cast<uint32_t>(s / kStages) & 1u;
    stage = s % kStages;
  }
};

}  // namespace fusemoe::sm90

// Bounded device waits: every spin or barrier wait in a fusemoe kernel gives up after a
// clock-based timeout, writes what it waited for into a record in mapped host memory, and traps.
// The host reads the record without touching the (now failed) CUDA context and raises
// fusemoe::Error naming it. Shared by host and device code.
#pragma once

#include <cstdint>
#include <string>

namespace fusemoe {

// Which kernel waited (the sm90 GEMM instances, BF16 and blockwise FP8, and the expert-parallel
// protocol).
enum class WaitKernel : int32_t {
  kGateUp = 1,
  kDown,
  kRecomputeZ,
  kDgradSwiglu,
  kDgradScatter,
  kWeightGrad,
  kEpExchange,  // expert parallelism: the cross-rank signals of ep_forward / ep_backward
  kFp8GateUp,
  kFp8Down,
  kFp8RecomputeZ,
  kFp8DgradSwiglu,
  kFp8DgradScatter,
  kFp8WeightGrad,
};
// Size of a table indexed by WaitKernel (the values start at 1; entry 0 is unused).
constexpr int kNumWaitKernels = static_cast<int>(WaitKernel::kFp8WeightGrad) + 1;

enum class WaitRole : int32_t { kProducer = 1, kConsumer, kExchange };

// What it waited for.
enum class WaitObject : int32_t {
  kStageFull = 1,  // a ring stage's loads (TMA bytes + gathered-row arrivals)
  kStageEmpty,     // the consumers' release of a ring stage
  kPeerMessage,    // expert parallelism: a source rank's routing message (and staged rows)
  kPeerRows,       // expert parallelism: an owner rank's pushed output rows
  kTileIndexPosted,  // dynamic tile order: producer thread 0's next tile index in a feed slot
  kTileIndexRead,    // dynamic tile order: every reading warp's release of a feed slot
};

// Written once, by the first wait that times out on a device (state 0 -> -1 while written ->
// 1); the host zeroes it again after reporting. Plain fields at fixed offsets: the device writes
// them from PTX (sm90_ptx.cuh, mbarrier_wait_or_trap).
struct DeviceWaitRecord {
  int32_t state;       // offset 0
  uint32_t site;       // 4: wait_site(kernel, role, object, stage)
  uint32_t expected;   // 8: kStageFull: TMA bytes of the stage; kStageEmpty, kTileIndexRead: warp arrivals
  uint32_t parity;     // 12: the phase parity waited for
  int32_t block;       // 16: blockIdx.x
  int32_t thread;      // 20: threadIdx.x
  uint64_t waited_ns;  // 24
  // Cross-rank waits (kPeerMessage, kPeerRows) only:
  int32_t rank;        // 32: the waiting rank
  int32_t peer;        // 36: the rank waited for
  int32_t wanted;      // 40: the call number (epoch) the flag had to reach
  int32_t observed;    // 44: what the flag held when the wait gave up
};
static_assert(sizeof(DeviceWaitRecord) == 48, "the PTX writer uses these offsets");

// The site of a wait, packed into one word: kernel (8 bits), role (4), object (4), stage (16).
constexpr uint32_t wait_site(WaitKernel kernel, WaitRole role, WaitObject object, int stage) {
  return (static_cast<uint32_t>(kernel) << 24) | (static_cast<uint32_t>(role) << 20) |
         (static_cast<uint32_t>(object) << 16) | (static_cast<uint32_t>(stage) & 0xFFFFu);
}

// What a kernel needs to bound its waits (a field of every kernel's parameters).
struct WaitBound {
  uint64_t timeout_ns;
  DeviceWaitRecord* record;  // device-mapped pointer to the current device's record
  int32_t kernel;            // WaitKernel of the launch
  int32_t fault;             // test build only (FUSEMOE_FAULT_INJECTION): a WaitFault to inject
};

// Test build only: which wait a launch makes time out on purpose (the values of the WaitObject
// the fault blocks).
enum class WaitFault : int32_t {
  kNone = 0,
  kStageFull = static_cast<int32_t>(WaitObject::kStageFull),    // 16 more TMA bytes announced than loaded
  kStageEmpty = static_cast<int32_t>(WaitObject::kStageEmpty),  // the consumers never release a stage
  // dynamic tile order: producer thread 0 never posts a tile index
  kTileIndexPosted = static_cast<int32_t>(WaitObject::kTileIndexPosted),
};

// Library-wide wait timeout (default 30 s, or FUSEMOE_WAIT_TIMEOUT_S from the environment at
// first use). Applies to launches made after the call.
void set_device_wait_timeout(double seconds);
double device_wait_timeout();

// The bound for a launch of `kernel` on the current device (allocates the device's record on
// first use).
WaitBound device_wait_bound(WaitKernel kernel);

// "gate/up GEMM block 17 thread 0 (producer) waited 30.0 s for ring stage 2 to be released
// (parity 1, 8 consumer arrivals expected)".
std::string describe_device_wait(const DeviceWaitRecord& record);

#ifdef FUSEMOE_FAULT_INJECTION
// Test build only: the next launches of `kernel` inject `fault` (kNone clears it).
void inject_wait_fault(WaitKernel kernel, WaitFault fault);
#endif

}  // namespace fusemoe

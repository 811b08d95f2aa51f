// Host side of the bounded device waits (device_wait.h): one record per device in pinned host
// memory mapped into the device, the library-wide timeout, and the report.
#include "common/device_wait.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <sstream>

#include "fusemoe/error.h"

namespace fusemoe {
namespace {

constexpr int kMaxDevices = 64;
constexpr double kDefaultTimeoutSeconds = 30.0;

// g_mutex guards g_records (the reports read them). g_alloc_mutex serialises the first-use
// allocations: it is held across CUDA calls whose failure (FUSEMOE_CUDA_CHECK) takes the report,
// which locks g_mutex, so g_mutex itself is never held across a CUDA call. Order: g_alloc_mutex,
// then g_mutex.
std::mutex g_mutex;
std::mutex g_alloc_mutex;
DeviceWaitRecord* g_records[kMaxDevices] = {};  // host addresses (mapped at the same address)
// The device-mapped address of each device's record, published (release) once the record is
// allocated and in g_records: every launch after the first reads it without a lock or CUDA call.
std::atomic<DeviceWaitRecord*> g_mapped[kMaxDevices] = {};

// The device's record, allocated on first use; returns its device-mapped address.
DeviceWaitRecord* allocate_record(int device) {
  std::lock_guard<std::mutex> alloc_lock(g_alloc_mutex);
  if (DeviceWaitRecord* mapped = g_mapped[device].load(std::memory_order_acquire)) {
    return mapped;  // another thread allocated it meanwhile
  }
  void* host = nullptr;
  FUSEMOE_CUDA_CHECK(cudaHostAlloc(&host, sizeof(DeviceWaitRecord), cudaHostAllocMapped | cudaHostAllocPortable));
  *static_cast<DeviceWaitRecord*>(host) = DeviceWaitRecord{};
  void* mapped = nullptr;
  const cudaError_t status = cudaHostGetDevicePointer(&mapped, host, 0);
  if (status != cudaSuccess) cudaFreeHost(host);  // nothing published: the next launch tries again
  FUSEMOE_CUDA_CHECK(status);
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_records[device] = static_cast<DeviceWaitRecord*>(host);
  }
  g_mapped[device].store(static_cast<DeviceWaitRecord*>(mapped), std::memory_order_release);
  return static_cast<DeviceWaitRecord*>(mapped);
}

double timeout_from_environment() {
  const char* text = std::getenv("FUSEMOE_WAIT_TIMEOUT_S");
  if (text == nullptr || *text == '\0') return kDefaultTimeoutSeconds;
  char* end = nullptr;
  const double seconds = std::strtod(text, &end);
  FUSEMOE_CHECK(end != text && *end == '\0' && std::isfinite(seconds) && seconds > 0.0,
                "FUSEMOE_WAIT_TIMEOUT_S must be a positive number of seconds, got '" << text << "'");
  return seconds;
}

std::atomic<uint64_t>& timeout_ns() {
  static std::atomic<uint64_t> ns{static_cast<uint64_t>(timeout_from_environment() * 1e9)};
  return ns;
}

#ifdef FUSEMOE_FAULT_INJECTION
std::atomic<int32_t> g_faults[kNumWaitKernels] = {};  // by WaitKernel
#endif

const char* kernel_name(int32_t kernel) {
  switch (static_cast<WaitKernel>(kernel)) {
    case WaitKernel::kGateUp: return "gate/up GEMM";
    case WaitKernel::kDown: return "down GEMM";
    case WaitKernel::kRecomputeZ: return "z-recompute GEMM";
    case WaitKernel::kDgradSwiglu: return "dgrad + SwiGLU GEMM";
    case WaitKernel::kDgradScatter: return "dgrad-of-x GEMM";
    case WaitKernel::kWeightGrad: return "weight-gradient GEMM";
    case WaitKernel::kEpExchange: return "expert-parallel exchange";
    case WaitKernel::kFp8GateUp: return "FP8 gate/up GEMM";
    case WaitKernel::kFp8Down: return "FP8 down GEMM";
    case WaitKernel::kFp8RecomputeZ: return "FP8 z-recompute GEMM";
    case WaitKernel::kFp8DgradSwiglu: return "FP8 dgrad + SwiGLU GEMM";
    case WaitKernel::kFp8DgradScatter: return "FP8 dgrad-of-x GEMM";
    case WaitKernel::kFp8WeightGrad: return "FP8 weight-gradient GEMM";
  }
  return "unknown kernel";
}

}  // namespace

void set_device_wait_timeout(double seconds) {
  FUSEMOE_CHECK(std::isfinite(seconds) && seconds > 0.0 && seconds < 1e6,
                "seconds must be in (0, 1e6), got " << seconds);
  timeout_ns().store(static_cast<uint64_t>(seconds * 1e9));
}

double device_wait_timeout() { return static_cast<double>(timeout_ns().load()) * 1e-9; }

WaitBound device_wait_bound(WaitKernel kernel) {
  int device = 0;
  FUSEMOE_CUDA_CHECK(cudaGetDevice(&device));
  FUSEMOE_CHECK(device >= 0 && device < kMaxDevices, "device " << device << " is beyond the " << kMaxDevices
                                                                << " devices fusemoe supports");
  DeviceWaitRecord* mapped = g_mapped[device].load(std::memory_order_acquire);
  if (mapped == nullptr) mapped = allocate_record(device);
  WaitBound bound{};
  bound.timeout_ns = timeout_ns().load();
  bound.record = mapped;
  bound.kernel = static_cast<int32_t>(kernel);
#ifdef FUSEMOE_FAULT_INJECTION
  bound.fault = g_faults[static_cast<int32_t>(kernel)].load();
#endif
  return bound;
}

#ifdef FUSEMOE_FAULT_INJECTION
void inject_wait_fault(WaitKernel kernel, WaitFault fault) {
  g_faults[static_cast<int32_t>(kernel)].store(static_cast<int32_t>(fault));
}
#endif

std::string describe_device_wait(const DeviceWaitRecord& r) {
  const int32_t kernel = static_cast<int32_t>(r.site >> 24);
  const int32_t role = static_cast<int32_t>((r.site >> 20) & 0xF);
  const int32_t object = static_cast<int32_t>((r.site >> 16) & 0xF);
  const int32_t stage = static_cast<int32_t>(r.site & 0xFFFF);
  std::ostringstream out;
  out << "device wait timed out: " << kernel_name(kernel) << " block " << r.block << " thread " << r.thread << " ("
      << (role == static_cast<int32_t>(WaitRole::kProducer)   ? "producer"
          : role == static_cast<int32_t>(WaitRole::kConsumer) ? "consumer"
                                                              : "exchange")
      << ") waited "
      << static_cast<double>(r.waited_ns) * 1e-9 << " s for ";
  switch (static_cast<WaitObject>(object)) {
    case WaitObject::kStageFull:
      out << "ring stage " << stage << " to be filled (parity " << r.parity << ", " << r.expected
          << " TMA bytes expected)";
      break;
    case WaitObject::kStageEmpty:
      out << "ring stage " << stage << " to be released (parity " << r.parity << ", " << r.expected
          << " consumer arrivals expected)";
      break;
    case WaitObject::kTileIndexPosted:
      out << "tile-index slot " << stage << " to be posted by producer thread 0 (parity " << r.parity << ")";
      break;
    case WaitObject::kTileIndexRead:
      out << "tile-index slot " << stage << " to be read by every role (parity " << r.parity << ", " << r.expected
          << " reader arrivals expected)";
      break;
    case WaitObject::kPeerMessage:
      out << "the routing message of source rank " << r.peer << " (rank " << r.rank << " waiting; call " << r.wanted
          << ", flag at " << r.observed << ")";
      break;
    case WaitObject::kPeerRows:
      out << "the output rows of owner rank " << r.peer << " (rank " << r.rank << " waiting; call " << r.wanted
          << ", flag at " << r.observed << ")";
      break;
    default:
      out << "object " << object << " (stage " << stage << ")";
  }
  return out.str();
}

namespace detail {

std::string take_device_wait_report() {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (DeviceWaitRecord*& record : g_records) {
    if (record == nullptr) continue;
    volatile DeviceWaitRecord* r = record;
    if (r->state != 1) continue;  // -1: a kernel is still writing it
    const DeviceWaitRecord copy = *const_cast<DeviceWaitRecord*>(record);
    r->state = 0;
    return describe_device_wait(copy);
  }
  return {};
}

}  // namespace detail
}  // namespace fusemoe

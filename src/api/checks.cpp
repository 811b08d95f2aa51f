// Argument checks shared by the public entry points (checks.h).
#include "api/checks.h"

#include <atomic>

#include "fusemoe/error.h"

namespace fusemoe {

void check_fp8_weights_arg(const LayerConfig& config, const void* fp8_weights) {
  // A buffer at bf16 would be ignored: refused, so a caller that meant FP8 learns it is not running.
  FUSEMOE_CHECK(config.precision != Precision::kBf16 || fp8_weights == nullptr,
                "fp8_weights must be null at precision " << precision_name(config.precision)
                                                         << " (only an fp8_blockwise layer reads FP8 weights), got "
                                                         << fp8_weights);
  if (config.precision == Precision::kBf16) return;
  FUSEMOE_CHECK(fp8_weights != nullptr, "fp8_weights must not be null at precision "
                                            << precision_name(config.precision)
                                            << " (the buffer that quantize_weights_fp8 wrote)");
  FUSEMOE_CHECK(aligned(fp8_weights, kWorkspaceAlignment),
                "fp8_weights must be " << kWorkspaceAlignment << "-byte aligned, got " << fp8_weights);
}

void check_tensor(const void* p, const char* name, uintptr_t alignment) {
  FUSEMOE_CHECK(p != nullptr, name << " must not be null");
  FUSEMOE_CHECK(aligned(p, alignment), name << " must be " << alignment
                                           << "-byte aligned, got address " << p);
}

void check_device_pointer(const void* p, const char* name) {
  cudaPointerAttributes attributes{};
  FUSEMOE_CUDA_CHECK(cudaPointerGetAttributes(&attributes, p));
  FUSEMOE_CHECK(attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged,
                name << " must point to device memory (got a host or unregistered pointer)");
  if (attributes.type == cudaMemoryTypeDevice) {
    int current = 0;
    FUSEMOE_CUDA_CHECK(cudaGetDevice(&current));
    FUSEMOE_CHECK(attributes.device == current, name << " is on device " << attributes.device
                                                     << " but the current device is " << current);
  }
}

void check_tensors(const NamedTensor* first, const NamedTensor* last) {
  for (const NamedTensor* t = first; t != last; ++t) check_tensor(t->p, t->name, t->alignment);
}

void check_device_pointers(const NamedTensor* first, const NamedTensor* last) {
  for (const NamedTensor* t = first; t != last; ++t) check_device_pointer(t->p, t->name);
}

void check_expert_id_report_pointer(const int32_t* report) {
  cudaPointerAttributes attributes{};
  FUSEMOE_CUDA_CHECK(cudaPointerGetAttributes(&attributes, report));
  if (attributes.type == cudaMemoryTypeHost) {
    FUSEMOE_CHECK(attributes.devicePointer == report,
                  "expert_id_report: pinned host memory must be mapped into the device at the "
                  "same address (unified addressing); got host "
                      << static_cast<const void*>(report) << ", device "
                      << attributes.devicePointer);
    return;
  }
  check_device_pointer(report, "expert_id_report");
}

void check_device() {
  int device = 0;
  FUSEMOE_CUDA_CHECK(cudaGetDevice(&device));
  // Bit d: device d passed (a device's compute capability never changes). Devices >= 64 are
  // queried on every call; a failure is not cached and fails again the same way.
  static std::atomic<uint64_t> passed{0};
  const uint64_t device_bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (device_bit != 0 && (passed.load(std::memory_order_acquire) & device_bit) != 0) return;
  int major = 0, minor = 0;
  FUSEMOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  FUSEMOE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  FUSEMOE_CHECK(major == 9 && minor == 0, "fusemoe is built for sm_90a (Hopper: H100/H200); device "
                                              << device << " has compute capability " << major
                                              << "." << minor);
  passed.fetch_or(device_bit, std::memory_order_acq_rel);
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  FUSEMOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  return capture != cudaStreamCaptureStatusNone;
}

void check_routing_record(const RoutingPlan& plan, int64_t num_experts, int64_t top_k, cudaStream_t stream) {
  int32_t bad[3] = {0, 0, 0};
  FUSEMOE_CUDA_CHECK(cudaMemcpyAsync(bad, plan.bad_id_info, sizeof(bad), cudaMemcpyDeviceToHost, stream));
  FUSEMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  check_bad_id_record(bad, num_experts, top_k);
}

}  // namespace fusemoe

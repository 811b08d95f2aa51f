// The native ops' expert-id reports (expert_id_reports.h).
#include "torch_binding/expert_id_reports.h"

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "fusemoe/fusemoe_c.h"
#include "torch_binding/errors.h"

namespace fusemoe::torch_binding {
namespace {

constexpr int64_t kReportInts = 3;  // fusemoe::kExpertIdReportInts
constexpr int kMaskDevices = 64;    // fusemoe_torch_report_devices' bits

struct Report {
  int32_t device;
  int64_t num_experts;
  int64_t top_k;
  int32_t* host;  // pinned; the tensor that owns it is never freed (kernels may still write it)
};

std::mutex g_mutex;
// Never destroyed: a report must outlive every kernel that may write it, even at exit.
std::vector<Report>& reports() {
  static auto* all = new std::vector<Report>();
  return *all;
}

bool holds_bad_id(const Report& r) { return *static_cast<volatile const int32_t*>(r.host) != 0; }

// ops.py's _raise_if_reported message; clears the report.
std::string take_message(const Report& r) {
  const int32_t status = fusemoe_c_check_expert_id_report(r.host, r.num_experts, r.top_k);
  std::fill(r.host, r.host + kReportInts, 0);  // reported once; later calls start clean
  return c_status_message(status) +
         " (found by an earlier fusemoe call on this device and reported asynchronously; its "
         "outputs are unspecified)";
}

int32_t* allocate_report(int32_t device) {
  const int64_t size = kReportInts, stride = 1;
  AtenTensorHandle handle = nullptr;
  if (aoti_torch_empty_strided_pinned(1, &size, &stride, aoti_torch_dtype_int32(), aoti_torch_device_type_cpu(),
                                      0, &handle) != AOTI_TORCH_SUCCESS) {
    throw_error(ErrorKind::kOutOfMemory, "fusemoe: cannot allocate the expert-id report (" +
                                             std::to_string(size * 4) + " bytes of pinned host memory) for cuda:" +
                                             std::to_string(device) + "; nothing was launched");
  }
  void* data = nullptr;
  if (aoti_torch_get_data_ptr(handle, &data) != AOTI_TORCH_SUCCESS) {
    throw_error(ErrorKind::kFusemoe, "fusemoe: the expert-id report's tensor has no data pointer");
  }
  auto* host = static_cast<int32_t*>(data);
  std::fill(host, host + kReportInts, 0);
  return host;
}

}  // namespace

int32_t* expert_id_report_for_call(int32_t device, int64_t num_experts, int64_t top_k) {
  std::lock_guard<std::mutex> lock(g_mutex);
  int32_t* mine = nullptr;
  for (const Report& r : reports()) {
    if (r.device != device) continue;
    if (holds_bad_id(r)) throw_error(ErrorKind::kFusemoe, take_message(r));
    if (r.num_experts == num_experts && r.top_k == top_k) mine = r.host;
  }
  if (mine == nullptr) {
    mine = allocate_report(device);
    reports().push_back(Report{device, num_experts, top_k, mine});
  }
  return mine;
}

}  // namespace fusemoe::torch_binding

extern "C" uint64_t fusemoe_torch_report_devices(void) {
  using namespace fusemoe::torch_binding;
  std::lock_guard<std::mutex> lock(g_mutex);
  uint64_t mask = 0;
  for (const Report& r : reports()) {
    if (r.device >= 0 && r.device < kMaskDevices) mask |= uint64_t{1} << r.device;
  }
  return mask;
}

extern "C" const char* fusemoe_torch_take_reported_error(void) {
  using namespace fusemoe::torch_binding;
  thread_local std::string message;
  std::lock_guard<std::mutex> lock(g_mutex);
  for (const Report& r : reports()) {
    if (holds_bad_id(r)) {
      message = take_message(r);
      return message.c_str();
    }
  }
  return nullptr;
}

// The native ops' asynchronous expert-id reports, kept as ops.py keeps them on the ctypes path:
// one report (fusemoe::kExpertIdReportInts int32 of pinned host memory, which the kernels write
// at the same address) per device and layer shape (E, K: a report's flat slot is decoded with
// its own K), passed to every call of that shape. Before each call the device's reports are read
// on the host (no sync): one that a kernel filled raises FusemoeError naming the bad id and is
// cleared. fusemoe.check_expert_ids() reaches them through the C functions below (ctypes).
#pragma once

#include <cstdint>

namespace fusemoe::torch_binding {

// Raises any bad id reported on `device` by an earlier call (then clears that report); returns
// the report for a call of this layer shape, allocated on first use. Call with `device` current.
int32_t* expert_id_report_for_call(int32_t device, int64_t num_experts, int64_t top_k);

}  // namespace fusemoe::torch_binding

extern "C" {
// Bit d set: device d has reports (fusemoe.check_expert_ids synchronises those devices).
__attribute__((visibility("default"))) uint64_t fusemoe_torch_report_devices(void);
// NULL when no report holds a bad id; else the message of the first one (valid until the next
// call on this thread), which is then cleared.
__attribute__((visibility("default"))) const char* fusemoe_torch_take_reported_error(void);
}

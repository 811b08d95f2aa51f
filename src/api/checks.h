// Argument checks shared by the public entry points (api.cpp: the single-GPU layer, ep_api.cpp:
// the expert-parallel layer). Host-only checks (null, alignment) run without a GPU, which the
// CPU tests rely on; the device and pointer checks make CUDA queries.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "fusemoe/fusemoe.h"
#include "kernels/routing.h"

namespace fusemoe {

constexpr uintptr_t kTmaAlignment = 16;  // TMA and 16-byte vector accesses
constexpr uintptr_t kWorkspaceAlignment = 256;

inline bool aligned(const void* p, uintptr_t alignment) { return reinterpret_cast<uintptr_t>(p) % alignment == 0; }

// Null check for tensors that must exist, plus their alignment.
void check_tensor(const void* p, const char* name, uintptr_t alignment);

// p is device memory (or managed memory) of the current device.
void check_device_pointer(const void* p, const char* name);

// An argument tensor by name: the host-side checks (null, alignment) run for every argument
// before the first CUDA query, then the device checks, so a call's cheapest error comes first.
struct NamedTensor {
  const void* p;
  const char* name;
  uintptr_t alignment;
};

void check_tensors(const NamedTensor* first, const NamedTensor* last);
void check_device_pointers(const NamedTensor* first, const NamedTensor* last);

// The fp8_weights buffer of a call (host checks): at Precision::kFp8Blockwise non-null and 256-byte
// aligned; at bf16 null (no layer reads it there: a buffer given is refused, not ignored).
void check_fp8_weights_arg(const LayerConfig& config, const void* fp8_weights);

// The expert-id report may be device memory or pinned host memory that kernels can write at
// the same address (unified addressing), so the host can poll it without a sync. The device
// check only: its host check (null, 4-byte alignment) is check_tensor's, run first.
void check_expert_id_report_pointer(const int32_t* report);

// The current device is the one fusemoe is built for (sm_90a); queried once per device.
void check_device();

// Whether `stream` is being captured into a CUDA graph (a synchronisation is illegal then).
bool stream_is_capturing(cudaStream_t stream);

// Reads the routing record of the last call that used `plan` (synchronising `stream`) and
// throws fusemoe::Error naming the first bad expert id it holds.
void check_routing_record(const RoutingPlan& plan, int64_t num_experts, int64_t top_k, cudaStream_t stream);

}  // namespace fusemoe

// fusemoe_bench's correctness check: every implementation against the library's fp32 GPU
// reference (Impl::kReferenceFp32) on the same inputs, outputs and workspaces NaN-poisoned
// before each call; y, dx, d_topk_weights, dw13, dw2 compared elementwise on the device, each
// implementation held to its own tolerance (BenchImpl::check_tol).
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "bench/report.h"
#include "bench/run.h"

namespace fusemoe::bench {

std::vector<CheckLine> check_case(const LayerConfig& config, const LayerConfig& reference_config,
                                  const std::vector<BenchImpl>& impls, const std::vector<DeviceBuffer>& workspaces,
                                  const DeviceBuffer& reference_workspace, const LayerInputs& in,
                                  const LayerOutputs& out, const LayerOutputs& ref, int64_t num_tokens,
                                  const std::string& label, cudaStream_t stream);

}  // namespace fusemoe::bench

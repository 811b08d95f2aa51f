// What every benchmark report opens with: the GPU (queried), CUDA and cuBLAS versions, the
// commit under test, the date and the L2 flush size; printed and as the JSON "meta" fields.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>

#include "common/device.h"
#include "common/gpu_clocks.h"
#include "common/routing.h"

namespace fusemoe::bench {

using Json = nlohmann::ordered_json;  // fields in the order written

struct RunFacts {
  harness::GpuInfo gpu;
  int cublas_version = 0;     // major * 10000 + minor * 100 + patch
  std::string commit, date;   // commit_id(), UTC ISO 8601
  size_t l2_flush_bytes = 0;  // written before each timed call (harness::l2_flush_bytes)
};

// The commit under test: $FUSEMOE_COMMIT when set, else the one the build recorded from its
// own source checkout (fusemoe_commit.h, cmake/commit_id.cmake), else "unknown".
std::string commit_id();

// Fills `facts`; when there is no sm_90 GPU, says so on stderr ("<tool>: no Hopper ...") and
// returns false.
bool gather_facts(const char* tool, RunFacts* facts);

// "<tool>  commit C  DATE", the GPU line and the versions line.
void print_facts(const char* tool, const RunFacts& facts);

// gpu, compute_capability, sm_count, memory_bytes, l2_bytes, driver_cuda, runtime_cuda,
// cublas_version, commit, date.
Json facts_json(const RunFacts& facts);

// How a case's rows spread over the experts: valid_rows, expert_rows_min, expert_rows_max,
// expert_rows_mean, experts_empty.
Json routing_json(const harness::RoutingStats& stats, int64_t num_experts);

// The GPU's clocks over a timed stretch: samples (0 without NVML, and nothing else then),
// sm_mhz_median, sm_mhz_min, sm_mhz_max, power_capped_fraction.
Json clocks_json(const harness::ClockSummary& s);

}  // namespace fusemoe::bench

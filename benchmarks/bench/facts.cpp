#include "bench/facts.h"

#include <cublas_v2.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>

#include "common/timer.h"
#include "fusemoe_commit.h"  // generated at build time: FUSEMOE_BUILD_COMMIT

namespace fusemoe::bench {
namespace {

int cublas_version() {
  int major = 0, minor = 0, patch = 0;
  if (cublasGetProperty(MAJOR_VERSION, &major) != CUBLAS_STATUS_SUCCESS ||
      cublasGetProperty(MINOR_VERSION, &minor) != CUBLAS_STATUS_SUCCESS ||
      cublasGetProperty(PATCH_LEVEL, &patch) != CUBLAS_STATUS_SUCCESS) {
    return 0;
  }
  return major * 10000 + minor * 100 + patch;
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return text;
}

}  // namespace

std::string commit_id() {
  const char* env = std::getenv("FUSEMOE_COMMIT");
  if (env != nullptr && env[0] != '\0') return env;
  return FUSEMOE_BUILD_COMMIT;
}

bool gather_facts(const char* tool, RunFacts* facts) {
  facts->commit = commit_id();
  facts->date = utc_now();
  std::string reason;
  bool found = false;
  try {
    found = harness::find_sm90(&facts->gpu, &reason);
    if (found) facts->l2_flush_bytes = harness::l2_flush_bytes();
  } catch (const std::exception& error) {
    reason = error.what();
    found = false;
  }
  if (!found) {
    std::fprintf(stderr, "%s: no Hopper (sm_90) GPU found: %s; the benchmark needs an H100/H200\n", tool,
                 reason.c_str());
    return false;
  }
  facts->cublas_version = cublas_version();
  return true;
}

void print_facts(const char* tool, const RunFacts& facts) {
  const harness::GpuInfo& gpu = facts.gpu;
  std::printf("%s  commit %s  %s\n", tool, facts.commit.c_str(), facts.date.c_str());
  std::printf("GPU %d: %s, sm_%d%d, %d SMs, %.1f GiB, L2 %.0f MB\n", gpu.device, gpu.name.c_str(), gpu.cc_major,
              gpu.cc_minor, gpu.sm_count, gpu.memory_bytes / double(1 << 30), gpu.l2_bytes / 1e6);
  std::printf("CUDA driver %s, runtime %s, cuBLAS %d\n", harness::cuda_version_string(gpu.driver_version).c_str(),
              harness::cuda_version_string(gpu.runtime_version).c_str(), facts.cublas_version);
}

Json facts_json(const RunFacts& facts) {
  const harness::GpuInfo& gpu = facts.gpu;
  return {
      {"gpu", gpu.name},
      {"compute_capability", std::to_string(gpu.cc_major) + "." + std::to_string(gpu.cc_minor)},
      {"sm_count", gpu.sm_count},
      {"memory_bytes", static_cast<uint64_t>(gpu.memory_bytes)},
      {"l2_bytes", gpu.l2_bytes},
      {"driver_cuda", harness::cuda_version_string(gpu.driver_version)},
      {"runtime_cuda", harness::cuda_version_string(gpu.runtime_version)},
      {"cublas_version", facts.cublas_version},
      {"commit", facts.commit},
      {"date", facts.date},
  };
}

Json routing_json(const harness::RoutingStats& stats, int64_t num_experts) {
  return {{"valid_rows", stats.valid_rows},
          {"expert_rows_min", stats.min_rows},
          {"expert_rows_max", stats.max_rows},
          {"expert_rows_mean", static_cast<double>(stats.valid_rows) / num_experts},
          {"experts_empty", stats.num_empty_experts}};
}

Json clocks_json(const harness::ClockSummary& s) {
  if (s.samples == 0) return Json{{"samples", 0}};
  return Json{{"samples", s.samples},
              {"sm_mhz_median", s.sm_mhz_median},
              {"sm_mhz_min", s.sm_mhz_min},
              {"sm_mhz_max", s.sm_mhz_max},
              {"power_capped_fraction", s.power_capped_fraction}};
}

}  // namespace fusemoe::bench

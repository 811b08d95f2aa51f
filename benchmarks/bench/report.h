// fusemoe_bench's results and their two forms: the table on stdout and the --json file
// (written with nlohmann::json; scripts/summarize_round.py reads it).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/cublas.h"
#include "bench/facts.h"
#include "bench/kernel_times.h"
#include "bench/memory.h"
#include "bench/options.h"
#include "common/gpu_clocks.h"
#include "common/routing.h"
#include "common/timer.h"

namespace fusemoe::bench {

enum class Pass { kForward, kBackward, kForwardBackward };
const char* pass_name(Pass pass);
// Useful FLOPs per valid routed row in units of H·I: 6 forward (gate/up 4, down 2), 12 backward,
// 18 both.
int flops_per_row_in_hi(Pass pass);

// One output of one implementation against the fp32 reference.
struct CheckLine {
  std::string impl, output, wgrad;  // wgrad "-" for outputs that do not depend on it
  double rel_err = 0, max_abs_err = 0, calc_diff = 0;
  double tol = 0;  // the implementation's rel_err bound (BenchImpl::check_tol)
  uint64_t nonfinite = 0, nonfinite_ref = 0;
  bool pass = false;
};

struct TimingLine {
  std::string impl;
  Pass pass = Pass::kForward;
  std::string wgrad;  // "-" for the forward
  harness::TimingStats stats;
  double flops = 0, tflops = 0, pct_ceiling = 0;
  double speedup_vs_first = 1.0;  // median of impls[0] / this median, same pass and wgrad
};

struct CaseResult {
  int64_t num_tokens = 0;
  harness::RoutingStats routing;
  std::string check_status = "skipped";  // "pass", "FAIL", or "skipped (why)"
  std::vector<CheckLine> checks;
  std::vector<TimingLine> timings;
  harness::ClockSummary clocks;  // the GPU's clocks while the timings ran
  // --timing per-impl: each implementation's clocks while it was timed, in params.impls' order.
  std::vector<harness::ClockSummary> impl_clocks;
  // --kernel-times: "traced", or why not ("not traced: ...", "failed: ..."); empty when not asked.
  std::string kernel_times_status;
  std::vector<PassKernels> kernel_times;  // per implementation: forward, then backward
  std::vector<harness::ClockSummary> traced_clocks;  // each implementation's clocks while traced
};

struct BenchResult {
  RunFacts facts;
  ExpertFit memory;  // the E run (params.preset.num_experts) and the bytes it needs
  Ceiling ceiling;
  std::vector<CaseResult> cases;
  std::string error;  // set when a runtime error stopped the run
};

void print_header(const BenchParams& params, const BenchResult& result);
void print_case(const BenchParams& params, const BenchResult& result, const CaseResult& c);
// Returns false (and says why on stderr) when the file cannot be written.
bool write_json(const std::string& path, const BenchParams& params, const BenchResult& result);

}  // namespace fusemoe::bench

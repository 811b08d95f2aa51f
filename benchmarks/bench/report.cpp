#include "bench/report.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <utility>
#include <vector>
#include <nlohmann/json.hpp>

#include "bench/checks.h"

namespace fusemoe::bench {

// Indexed by Pass.
constexpr const char* kPassNames[] = {"forward", "backward", "forward+backward"};
constexpr int kFlopsPerRowInHi[] = {6, 12, 18};

const char* pass_name(Pass pass) { return kPassNames[static_cast<int>(pass)]; }

int flops_per_row_in_hi(Pass pass) { return kFlopsPerRowInHi[static_cast<int>(pass)]; }

namespace {
// A pass's kernels one line each up to this many, else grouped by name (--kernel-times).
constexpr size_t kMaxKernelLines = 24;

// One clock line per implementation (clocks[i] is params.impls[i]'s), "while <impl> was <when>".
void print_clocks_by_impl(const BenchParams& params, const std::vector<harness::ClockSummary>& clocks,
                          const char* when) {
  for (size_t i = 0; i < clocks.size() && i < params.impls.size(); ++i) {
    std::printf("  clocks while %s was %s: %s\n", params.impls[i].name, when, harness::describe(clocks[i]).c_str());
  }
}

// {impl name: clocks} in params.impls' order.
Json clocks_by_impl_json(const BenchParams& params, const std::vector<harness::ClockSummary>& clocks) {
  Json by_impl = Json::object();
  for (size_t i = 0; i < clocks.size() && i < params.impls.size(); ++i) {
    by_impl[params.impls[i].name] = clocks_json(clocks[i]);
  }
  return by_impl;
}

// ", at least N ms per implementation" (or "of the interleaved rounds": the one timed block) when
// --warmup-ms asks for a minimum warm-up time, else nothing; as scripts/summarize_round.py says it.
std::string warmup_ms_note(const BenchParams& params) {
  if (params.warmup_ms <= 0.0) return "";
  const char* block = params.timing == TimingMode::kInterleaved ? "of the interleaved rounds" : "per implementation";
  return ", at least " + std::to_string(static_cast<long long>(params.warmup_ms)) + " ms " + block;
}
}  // namespace

void print_header(const BenchParams& params, const BenchResult& result) {
  print_facts("fusemoe_bench", result.facts);
  std::string tokens, impls;
  for (int64_t t : params.tokens) tokens += (tokens.empty() ? "" : ",") + std::to_string(t);
  for (const BenchImpl& impl : params.impls) impls += (impls.empty() ? "" : ",") + std::string(impl.name);
  std::printf("layer %s: H=%lld I=%lld E=%lld K=%lld; tokens %s; routing %s; impls %s\n", params.preset.name,
              static_cast<long long>(params.preset.hidden), static_cast<long long>(params.preset.intermediate),
              static_cast<long long>(params.preset.num_experts), static_cast<long long>(params.preset.top_k),
              tokens.c_str(), harness::routing_name(params.routing), impls.c_str());
  const ExpertFit& fit = result.memory;
  std::printf("device memory: %.1f GiB needed, %.1f GiB free\n", fit.bytes / double(size_t(1) << 30),
              fit.free_bytes / double(size_t(1) << 30));
  if (const std::string note = expert_fit_note(fit); !note.empty()) std::printf("%s\n", note.c_str());
  std::printf("timing: median of %d after %d warm-up%s, %s, CUDA events, %zu MiB L2 flush before each call\n",
              params.iters, params.warmup, warmup_ms_note(params).c_str(), timing_mode_name(params.timing),
              result.facts.l2_flush_bytes >> 20);
  std::fflush(stdout);
}

void print_case(const BenchParams& params, const BenchResult& result, const CaseResult& c) {
  const harness::RoutingStats& r = c.routing;
  std::printf("\n== %s T=%lld routing=%s: %lld valid rows; rows/expert min %lld mean %.0f max %lld, %lld empty ==\n",
              params.preset.name, static_cast<long long>(c.num_tokens), harness::routing_name(params.routing),
              static_cast<long long>(r.valid_rows), static_cast<long long>(r.min_rows),
              static_cast<double>(r.valid_rows) / params.preset.num_experts, static_cast<long long>(r.max_rows),
              static_cast<long long>(r.num_empty_experts));
  std::printf("correctness vs fp32 reference (fail: non-finite or rel_err > tol): %s\n", c.check_status.c_str());
  if (!c.checks.empty()) {
    std::printf("  %-17s %-15s %-5s %10s %7s %10s %10s %9s  %s\n", "impl", "output", "wgrad", "rel_err", "tol",
                "max_abs", "calc_diff", "nonfinite", "result");
    for (const CheckLine& line : c.checks) {
      std::printf("  %-17s %-15s %-5s %10.2e %7.0e %10.2e %10.2e %9llu  %s\n", line.impl.c_str(),
                  line.output.c_str(), line.wgrad.c_str(), line.rel_err, line.tol, line.max_abs_err, line.calc_diff,
                  static_cast<unsigned long long>(line.nonfinite + line.nonfinite_ref), line.pass ? "pass" : "FAIL");
    }
  }
  if (c.timings.empty()) return;
  std::printf("timings (median of %d after %d warm-up, L2 flushed; ceiling %.0f TFLOP/s):\n", params.iters,
              params.warmup, result.ceiling.tflops);
  std::printf("  %-17s %-17s %-5s %9s %9s %9s %8s %12s\n", "impl", "pass", "wgrad", "ms", "min ms", "TFLOP/s", "%ceil",
              "vs first");
  for (const TimingLine& line : c.timings) {
    std::printf("  %-17s %-17s %-5s %9.3f %9.3f %9.1f %7.1f%% %11.2fx\n", line.impl.c_str(), pass_name(line.pass),
                line.wgrad.c_str(), line.stats.median_ms, line.stats.min_ms, line.tflops, line.pct_ceiling,
                line.speedup_vs_first);
  }
  std::printf("  clocks while timed: %s\n", harness::describe(c.clocks).c_str());
  print_clocks_by_impl(params, c.impl_clocks, "timed alone");
  if (c.kernel_times_status.empty()) return;
  if (c.kernel_times_status != "traced") {
    std::printf("kernels inside the layer: %s\n", c.kernel_times_status.c_str());
    return;
  }
  std::printf("kernels inside the layer (CUPTI records of %d calls after at least %d untraced and 500 ms, each: "
              "L2 flush, forward, backward with bf16 weight gradients; median us over the calls):\n",
              params.iters, params.warmup);
  print_clocks_by_impl(params, c.traced_clocks, "traced");
  for (const PassKernels& pass : c.kernel_times) {
    std::printf(
        "  %s %s: %zu kernels, their sum %.1f, first start to last end %.1f, events around the pass %.1f; "
        "device time since the kernel before %.1f\n",
        pass.impl.c_str(), pass.pass.c_str(), pass.kernels.size(), pass.kernels_median_us, pass.span_median_us,
        pass.event_median_us, pass.gap_before_median_us);
    if (!pass.note.empty()) std::printf("    (%s)\n", pass.note.c_str());
    if (pass.kernels.size() <= kMaxKernelLines) {
      for (const KernelTime& k : pass.kernels) {
        std::printf("    %-60s %9.1f  (min %.1f, max %.1f)\n", k.short_name.c_str(), k.median_us, k.min_us, k.max_us);
      }
      continue;
    }
    // Hundreds of launches (the unfused path's per-expert GEMMs): each name's sum and count.
    std::vector<std::pair<std::string, std::pair<int, double>>> groups;
    for (const KernelTime& k : pass.kernels) {
      auto group = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == k.short_name; });
      if (group == groups.end()) group = groups.insert(groups.end(), {k.short_name, {0, 0.0}});
      group->second.first += 1;
      group->second.second += k.median_us;
    }
    for (const auto& [name, group] : groups) {
      std::printf("    %-60s %9.1f  (%d launch%s)\n", name.c_str(), group.second, group.first,
                  group.first == 1 ? "" : "es");
    }
  }
}

namespace {

Json case_json(const BenchParams& params, const CaseResult& c) {
  Json checks = Json::array();
  for (const CheckLine& line : c.checks) {
    checks.push_back({{"impl", line.impl},
                      {"output", line.output},
                      {"weight_grad_dtype", line.wgrad},
                      {"rel_err", line.rel_err},
                      {"tol", line.tol},
                      {"max_abs_err", line.max_abs_err},
                      {"calc_diff", line.calc_diff},
                      {"nonfinite", line.nonfinite},
                      {"nonfinite_reference", line.nonfinite_ref},
                      {"pass", line.pass}});
  }
  Json timings = Json::array();
  for (const TimingLine& line : c.timings) {
    timings.push_back({{"impl", line.impl},
                       {"pass", pass_name(line.pass)},
                       {"weight_grad_dtype", line.wgrad},
                       {"ms_median", line.stats.median_ms},
                       {"ms_min", line.stats.min_ms},
                       {"ms_max", line.stats.max_ms},
                       {"flops", line.flops},
                       {"tflops", line.tflops},
                       {"pct_ceiling", line.pct_ceiling},
                       {"speedup_vs_first_impl", line.speedup_vs_first}});
  }
  Json out = {{"tokens", c.num_tokens}};
  out.update(routing_json(c.routing, params.preset.num_experts));
  out.update(Json{{"check_status", c.check_status}, {"checks", checks}, {"timings", timings},
                  {"clocks", clocks_json(c.clocks)}});
  if (!c.kernel_times_status.empty()) {
    Json passes = Json::array();
    for (const PassKernels& pass : c.kernel_times) {
      Json kernels = Json::array();
      for (const KernelTime& k : pass.kernels) {
        kernels.push_back({{"name", k.name},
                           {"short_name", k.short_name},
                           {"per_call", k.count},
                           {"us_median", k.median_us},
                           {"us_min", k.min_us},
                           {"us_max", k.max_us}});
      }
      passes.push_back({{"impl", pass.impl},
                        {"pass", pass.pass},
                        {"weight_grad_dtype", pass.wgrad},
                        {"calls", pass.calls},
                        {"kernels_us_median", pass.kernels_median_us},
                        {"span_us_median", pass.span_median_us},
                        {"event_us_median", pass.event_median_us},
                        {"gap_before_us_median", pass.gap_before_median_us},
                        {"note", pass.note},
                        {"kernels", kernels}});
    }
    out["kernel_times"] = {{"status", c.kernel_times_status},
                           {"passes", passes},
                           {"clocks_by_impl", clocks_by_impl_json(params, c.traced_clocks)}};
  }
  if (!c.impl_clocks.empty()) out["clocks_by_impl"] = clocks_by_impl_json(params, c.impl_clocks);
  return out;
}

}  // namespace

bool write_json(const std::string& path, const BenchParams& params, const BenchResult& result) {
  Json impls = Json::array();
  for (const BenchImpl& impl : params.impls) impls.push_back(impl.name);
  Json meta = facts_json(result.facts);
  meta.update(Json{
      {"preset", params.preset.name},
      {"hidden", params.preset.hidden},
      {"intermediate", params.preset.intermediate},
      {"num_experts", params.preset.num_experts},
      {"top_k", params.preset.top_k},
      {"preset_num_experts", result.memory.preset_experts},
      {"experts_reduced", expert_fit_note(result.memory)},
      {"device_bytes_needed", static_cast<uint64_t>(result.memory.bytes)},
      {"device_bytes_free", static_cast<uint64_t>(result.memory.free_bytes)},
      {"routing", harness::routing_name(params.routing)},
      {"skew_exponent", params.routing == harness::Routing::kSkewed ? harness::kSkewExponent : 0.0},
      {"seed", params.seed},
      {"iters", params.iters},
      {"warmup", params.warmup},
      {"warmup_ms", params.warmup_ms},
      {"timing", timing_mode_name(params.timing)},
      {"l2_flush_bytes", static_cast<uint64_t>(result.facts.l2_flush_bytes)},
      {"rel_err_tol", kRelErrTol},
      {"rel_err_tol_fp8", kFp8RelErrTol},
      {"tokens", params.tokens},
      {"impls", impls},
  });
  Json cases = Json::array();
  for (const CaseResult& c : result.cases) cases.push_back(case_json(params, c));
  const Json json = {
      {"tool", "fusemoe_bench"},
      {"schema", 1},
      {"meta", meta},
      {"ceiling",
       {{"what", result.ceiling.what},
        {"tflops", result.ceiling.tflops},
        {"ms_median", result.ceiling.stats.median_ms}}},
      {"cases", cases},
      {"error", result.error},
  };
  std::ofstream file(path);
  if (!file) {
    std::fprintf(stderr, "fusemoe_bench: cannot write --json %s: %s\n", path.c_str(), std::strerror(errno));
    return false;
  }
  file << json.dump(2) << "\n";
  return static_cast<bool>(file);
}

}  // namespace fusemoe::bench

// fusemoe_kernel_bench: times every sm90 grouped-GEMM instance of the fused layer
// (src/launchers/sm90_grouped_gemm.h) and the pipelines' other steps at the Qwen3 shapes, each
// against the same GEMM in cuBLAS, grouped per expert (cublasGemmGroupedBatchedEx) and dense
// (cublasGemmEx of the same total size), measured in the same run.
//   GEMM        FLOPs (R routed rows)   fusemoe instances
//   x W13^T     2 R H 2I                gate/up + SwiGLU (with and without the z store), recompute z
//   h W2^T      2 R I H                 down + routing weight
//   dys W2      2 R H I                 dgrad + SwiGLU backward at tile width 128 and 256
//   dz W13      2 R 2I H                dgrad of x into the slot rows
//   dys^T wh    2 R H I                 dW2 (fp32, bf16, each also accumulated)
//   dz^T xs     2 R 2I H                dW13 (fp32, bf16, each also accumulated)
// One run: GPU facts → bf16 GEMM ceiling (cuBLAS 8192³) → per preset and T: routing, a
// correctness check of every instance against the fp32 GPU reference (the first T of each
// preset, tests/common/sm90_gemm_problem.h), then per GEMM its fusemoe instances and the cuBLAS
// baselines interleaved call by call (median of --iters after --warmup, CUDA events, L2
// flushed before every call) → table on stdout, figures in --json.
// Exit: 0 ok, 1 a check failed, 2 bad arguments, 3 no Hopper GPU, 4 runtime error.
// Legend: T tokens, K top-k, E experts, H hidden, I intermediate, R routed rows, S = T*K slots.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench/cublas.h"
#include "bench/facts.h"
#include "bench/options.h"
#include "common/device_buffer.h"
#include "common/gpu_clocks.h"
#include "common/routing.h"
#include "common/sm90_gemm_problem.h"
#include "common/timer.h"
#include "kernels/moe_elementwise.h"
#include "kernels/routing.h"
#include "launchers/sm90_grouped_gemm.h"

namespace fusemoe::bench {
namespace {

using harness::DeviceBuffer;
using harness::Sm90GemmProblem;

const char* const kKernelUsage =
    "usage: fusemoe_kernel_bench [--preset NAME[,NAME]] [--tokens N[,N...]] [--routing NAME]\n"
    "                            [--iters N] [--warmup N] [--json PATH] [--seed N] [--no-check]\n"
    "  --preset            fusemoe_bench's presets, comma separated (default\n"
    "                      qwen3-30b-a3b,qwen3-235b-a22b; also qwen3-next, deepseek-v3)\n"
    "  --tokens            token counts, comma separated (default 4096,16384)\n"
    "  --routing           a routing of tests/common/routing.h (default uniform)\n"
    "  --iters, --warmup   timed runs (median reported) and untimed runs before (20, 5)\n"
    "  --json              write all figures and metadata to PATH\n"
    "  --seed              seed of the inputs and the routing (default 1234)\n"
    "  --no-check          skip the correctness check against the fp32 reference\n"
    "exit: 0 ok, 1 correctness failure, 2 bad arguments, 3 no Hopper GPU, 4 runtime error\n";

struct KernelBenchParams : SharedOptions {
  std::vector<Preset> presets = {kPresets[0], kPresets[1]};
};

KernelBenchParams parse_kernel_args(int argc, char** argv) {
  KernelBenchParams params;
  params.tokens = {4096, 16384};
  for_each_flag(argc, argv, [&](const Flag& flag) {
    if (parse_shared_flag(flag, &params)) return;
    if (flag.name == "--preset") {
      params.presets.clear();
      for (const std::string& name : split_commas(flag.value())) params.presets.push_back(find_preset(name));
      if (params.presets.empty()) throw UsageError{"--preset needs at least one name"};
    } else {
      throw UsageError{"unknown argument '" + flag.name + "'"};
    }
  });
  return params;
}

// One op of a GEMM's interleaved measurement.
struct Op {
  std::string impl;
  std::function<void()> run;
};

struct Row {
  std::string gemm, impl;
  double flops = 0;  // 0 for the steps that are not GEMMs
  harness::TimingStats stats;
};

// The non-GEMM steps of the fused pipelines, on their own buffers: routing (topk_idx -> the
// expert-sorted rows), the x gather of the backward, the router-gradient reduce and the k-way
// combine of the slot rows.
struct PipelineSteps {
  DeviceBuffer idx, plan_memory, xs, dys, y;
  RoutingPlan plan;

  PipelineSteps(const harness::MoeShape& s, const std::vector<int32_t>& idx_TK)
      : idx(DeviceBuffer::from(idx_TK)),
        plan_memory(routing_plan_bytes(s.T, s.K, s.E)),
        xs(s.T * s.K * s.H * 2),
        dys(s.T * s.K * s.H * 2),
        y(s.T * s.H * 2) {
    carve_routing_plan(plan_memory.as<char>(), s.T, s.K, s.E, &plan);
  }
};

class KernelBench {
 public:
  KernelBench(const KernelBenchParams& params, cudaStream_t stream)
      : params_(params), stream_(stream), timer_(stream), cublas_(stream) {}

  // Fills *result as it goes, so that an error still leaves what was measured.
  void run(Json* result, bool* all_pass);

 private:
  // Times `ops` interleaved; rows named after `gemm`, FLOPs per call `flops`.
  void time_group(const std::string& gemm, double flops, const std::vector<Op>& ops, std::vector<Row>* rows) {
    std::vector<std::function<void()>> runs;
    for (const Op& op : ops) runs.push_back(op.run);
    const std::vector<harness::TimingStats> stats =
        timer_.run_interleaved(runs, params_.warmup, params_.iters, /*flush_l2=*/true);
    for (size_t i = 0; i < ops.size(); ++i) rows->push_back(Row{gemm, ops[i].impl, flops, stats[i]});
  }

  std::vector<Row> time_case(const Sm90GemmProblem& p, const std::vector<int32_t>& idx_TK);
  Json checks_json(const std::string& label, Sm90GemmProblem& p, bool* pass);

  const KernelBenchParams& params_;
  cudaStream_t stream_;
  harness::EventTimer timer_;
  CublasHandle cublas_;
  Ceiling ceiling_;
};

// Per expert e: rows [offsets[e], offsets[e+1]) of a [R, k] times W_e (or its transpose).
std::vector<GemmOperands> expert_gemms(const harness::ExpertRows& rows, const void* a, const void* w,
                                       bool w_transposed, void* c, int64_t n, int64_t k) {
  std::vector<GemmOperands> gemms;
  for (size_t e = 0; e + 1 < rows.offsets.size(); ++e) {
    const int64_t begin = rows.offsets[e], count = rows.offsets[e + 1] - begin;
    gemms.push_back({static_cast<const char*>(a) + begin * k * 2, false, static_cast<const char*>(w) + e * n * k * 2,
                     w_transposed, static_cast<char*>(c) + begin * n * 2, count, n, k});
  }
  return gemms;
}

// Per expert e: grad_e [m, n] = act_m_e^T act_n_e over the expert's rows.
std::vector<GemmOperands> expert_weight_grads(const harness::ExpertRows& rows, const void* act_m, const void* act_n,
                                              void* grad, int64_t m, int64_t n) {
  std::vector<GemmOperands> gemms;
  for (size_t e = 0; e + 1 < rows.offsets.size(); ++e) {
    const int64_t begin = rows.offsets[e], count = rows.offsets[e + 1] - begin;
    gemms.push_back({static_cast<const char*>(act_m) + begin * m * 2, true,
                     static_cast<const char*>(act_n) + begin * n * 2, false, static_cast<char*>(grad) + e * m * n * 2,
                     m, n, count});
  }
  return gemms;
}

std::vector<Row> KernelBench::time_case(const Sm90GemmProblem& p, const std::vector<int32_t>& idx_TK) {
  const harness::MoeShape& s = p.shape();
  const harness::ExpertRows& er = p.expert_rows();
  const Sm90GemmProblem::Operands o = p.operands();
  const int64_t R = p.num_rows(), H = s.H, I = s.I, E = s.E;
  const double rows = static_cast<double>(R);
  DeviceBuffer scratch(std::max(R * std::max(2 * I, H), E * 2 * I * H) * 2);  // cuBLAS outputs, bf16
  void* c = scratch.get();
  std::vector<Row> out;
  auto cublas_ops = [&](const std::vector<GemmOperands>& grouped_gemms, const GemmOperands& dense) {
    auto grouped = std::make_shared<CublasGrouped>(grouped_gemms);
    return std::vector<Op>{{"cuBLAS grouped", [this, grouped] { grouped->run(cublas_); }},
                           {"cuBLAS dense", [this, dense] { dense_gemm(cublas_, dense); }}};
  };
  auto with = [](std::vector<Op> mine, const std::vector<Op>& baselines) {
    mine.insert(mine.end(), baselines.begin(), baselines.end());
    return mine;
  };

  time_group("x W13^T", 2 * rows * H * 2 * I,
             with({{"gate/up + SwiGLU", [&] { p.launch_gate_up(false, false); }},
                   {"gate/up + SwiGLU + z store", [&] { p.launch_gate_up(false, true); }},
                   {"recompute z", [&] { p.launch_recompute_z(); }}},
                  cublas_ops(expert_gemms(er, o.xs, o.w13, true, c, 2 * I, H),
                             {o.xs, false, o.w13, true, c, R, 2 * I, H})),
             &out);
  time_group("h W2^T", 2 * rows * I * H,
             with({{"down + weight", [&] { p.launch_down(); }}},
                  cublas_ops(expert_gemms(er, o.h_in, o.w2, true, c, H, I), {o.h_in, false, o.w2, true, c, R, H, I})),
             &out);
  time_group("dys W2", 2 * rows * H * I,
             with({{"dgrad + SwiGLU, block_n 128", [&] { p.launch_dgrad_swiglu(128, false); }},
                   {"dgrad + SwiGLU, block_n 256", [&] { p.launch_dgrad_swiglu(256, false); }}},
                  cublas_ops(expert_gemms(er, o.dys, o.w2, false, c, I, H), {o.dys, false, o.w2, false, c, R, I, H})),
             &out);
  time_group("dz W13", 2 * rows * 2 * I * H,
             with({{"dgrad scatter", [&] { p.launch_dgrad_scatter(); }}},
                  cublas_ops(expert_gemms(er, o.dz_in, o.w13, false, c, H, 2 * I),
                             {o.dz_in, false, o.w13, false, c, R, H, 2 * I})),
             &out);
  for (const harness::WeightGrad which : {harness::WeightGrad::kW2, harness::WeightGrad::kW13}) {
    const bool w2 = which == harness::WeightGrad::kW2;
    const int64_t m = w2 ? H : 2 * I, n = w2 ? I : H;
    const void* act_m = w2 ? o.dys : o.dz_in;
    const void* act_n = w2 ? o.wh_in : o.xs;
    time_group(w2 ? "dys^T wh (dW2)" : "dz^T xs (dW13)", 2 * rows * m * n,
               with({{"weight grad fp32", [&p, which] { p.launch_weight_grad(which, false, false); }},
                     {"weight grad bf16", [&p, which] { p.launch_weight_grad(which, true, false); }},
                     {"weight grad fp32 accumulate", [&p, which] { p.launch_weight_grad(which, false, true); }},
                     {"weight grad bf16 accumulate", [&p, which] { p.launch_weight_grad(which, true, true); }}},
                    cublas_ops(expert_weight_grads(er, act_m, act_n, c, m, n),
                               {act_m, true, act_n, false, c, m, n, R})),
               &out);
  }
  PipelineSteps steps(s, idx_TK);
  const int block_n = sm90_dgrad_block_n(H);
  time_group("other steps", 0,
             {{"routing", [&] { launch_routing(steps.idx.as<int32_t>(), s.T, s.K, E, steps.plan, nullptr, stream_); }},
              {"gather x rows",
               [&] {
                 launch_gather_rows_device_count(o.x, steps.xs.get(), nullptr, nullptr, o.row_slot, o.offsets + E,
                                                 s.T * s.K, s.K, H, stream_);
               }},
              // The backward's two pools (y stands in for dy): by pool rows, each token row read
              // K times, against token-major, read once (what the fused backward runs).
              {"x and dy pools by rows",
               [&] {
                 launch_gather_rows_device_count(o.x, steps.xs.get(), steps.y.get(), steps.dys.get(), o.row_slot,
                                                 o.offsets + E, s.T * s.K, s.K, H, stream_);
               }},
              {"x and dy pools by tokens",
               [&] {
                 launch_scatter_token_rows(o.x, steps.xs.get(), steps.y.get(), steps.dys.get(), o.slot_row, s.T,
                                           s.K, H, stream_);
               }},
              {"combine slots", [&] { launch_combine_slots(o.ys, o.slot_row, s.T, s.K, H, steps.y.get(), stream_); }},
              // The backward's combine of dx, which also reduces the router-weight gradient's
              // per-tile partials (no launch of its own since the pipelines fold it in).
              {"combine dx slots + router gradient",
               [&] {
                 launch_combine_slots(o.dx_slots, o.slot_row, s.T, s.K, H, steps.y.get(), stream_,
                                      {o.partials, sm90_dgrad_num_n_tiles(I, block_n), o.d_topk_w});
               }}},
             &out);
  return out;
}

Json KernelBench::checks_json(const std::string& label, Sm90GemmProblem& p, bool* pass) {
  std::vector<harness::Check> checks;
  auto add = [&](std::vector<harness::Check> more) { checks.insert(checks.end(), more.begin(), more.end()); };
  std::fprintf(stderr, "[kernel_bench] %s: checking every instance against the fp32 reference ...\n", label.c_str());
  add(p.check_gate_up(false, true, false));
  add(p.check_down(false));
  add(p.check_recompute_z(false));
  add(p.check_dgrad_swiglu(sm90_dgrad_block_n(p.shape().H), false, false));
  add(p.check_dgrad_scatter(false));
  add(p.check_weight_grad(harness::WeightGrad::kW2, false));
  add(p.check_weight_grad(harness::WeightGrad::kW13, false));
  Json out = Json::array();
  *pass = true;
  for (const harness::Check& c : checks) {
    std::printf("  %s %s: %s\n", c.ok ? "ok  " : "FAIL", c.what.c_str(), c.detail.c_str());
    out.push_back({{"case", label}, {"what", c.what}, {"pass", c.ok}, {"detail", c.detail}});
    *pass = *pass && c.ok;
  }
  return out;
}

void KernelBench::run(Json* result_json, bool* all_pass) {
  Json& result = *result_json;
  const harness::Nvml nvml;  // the current device's clocks, sampled while each case is timed
  ceiling_ = measure_gemm_ceiling(stream_, timer_, params_.seed);
  std::printf("bf16 GEMM ceiling: %.1f TFLOP/s (%s)\n", ceiling_.tflops, ceiling_.what.c_str());
  result["ceiling"] = {{"what", ceiling_.what}, {"tflops", ceiling_.tflops}, {"ms_median", ceiling_.stats.median_ms}};
  *all_pass = true;
  for (const Preset& preset : params_.presets) {
    bool preset_pass = true;
    for (size_t t = 0; t < params_.tokens.size(); ++t) {
      const harness::MoeShape shape{params_.tokens[t], preset.top_k, preset.num_experts, preset.hidden,
                                    preset.intermediate};
      const std::string label = std::string(preset.short_name) + " T=" + std::to_string(shape.T);
      const harness::TopK topk = harness::make_topk(shape.T, shape.E, shape.K, params_.routing, params_.seed);
      const harness::RoutingStats stats = harness::routing_stats(topk.idx_TK, shape.E);
      std::fprintf(stderr, "[kernel_bench] %s: inputs ...\n", label.c_str());
      Sm90GemmProblem problem(shape, topk.idx_TK, topk.w_TK, params_.seed, stream_);
      problem.follow_layer_tile_order();
      std::string check_status = "skipped (--no-check)";
      if (params_.check) {
        check_status = "checked at the first T of the preset";
        if (t == 0) {
          for (Json& line : checks_json(label, problem, &preset_pass)) result["checks"].push_back(std::move(line));
          check_status = preset_pass ? "pass" : "FAIL";
        }
      }
      *all_pass = *all_pass && preset_pass;
      Json case_json = {{"preset", preset.name}, {"hidden", shape.H}, {"intermediate", shape.I},
                        {"num_experts", shape.E}, {"top_k", shape.K},    {"tokens", shape.T}};
      case_json.update(routing_json(stats, shape.E));
      case_json.update(Json{{"dgrad_block_n", sm90_dgrad_block_n(shape.H)},
                            {"check_status", check_status},
                            {"timings", Json::array()}});
      std::printf("\n== %s T=%lld, routing %s: %lld rows, rows/expert %lld..%lld, %lld empty; dgrad block_n %d by "
                  "shape; check %s ==\n",
                  preset.name, static_cast<long long>(shape.T), harness::routing_name(params_.routing),
                  static_cast<long long>(stats.valid_rows), static_cast<long long>(stats.min_rows),
                  static_cast<long long>(stats.max_rows), static_cast<long long>(stats.num_empty_experts),
                  sm90_dgrad_block_n(shape.H), check_status.c_str());
      if (!preset_pass) {
        std::printf("  not timed: the check failed\n");
        result["cases"].push_back(case_json);
        continue;
      }
      std::fprintf(stderr, "[kernel_bench] %s: timing ...\n", label.c_str());
      harness::ClockSampler sampler(nvml);
      const std::vector<Row> rows = time_case(problem, topk.idx_TK);
      const harness::ClockSummary clocks = sampler.stop();
      std::printf("  %-15s %-30s %9s %9s %7s %10s %8s\n", "GEMM", "impl", "ms", "TFLOP/s", "%ceil", "vs grouped",
                  "vs dense");
      for (const Row& row : rows) {
        double grouped_ms = 0, dense_ms = 0;
        for (const Row& other : rows) {
          if (other.gemm != row.gemm) continue;
          if (other.impl == "cuBLAS grouped") grouped_ms = other.stats.median_ms;
          if (other.impl == "cuBLAS dense") dense_ms = other.stats.median_ms;
        }
        const double ms = row.stats.median_ms;
        const double tflops = row.flops / (ms * 1e-3) / 1e12;
        Json line = {{"gemm", row.gemm},          {"impl", row.impl},
                     {"ms_median", ms},           {"ms_min", row.stats.min_ms},
                     {"ms_max", row.stats.max_ms}, {"flops", row.flops}};
        if (row.flops > 0) {
          line["tflops"] = tflops;
          line["pct_ceiling"] = 100.0 * tflops / ceiling_.tflops;
          line["speedup_vs_cublas_grouped"] = grouped_ms / ms;
          line["speedup_vs_cublas_dense"] = dense_ms / ms;
          std::printf("  %-15s %-30s %9.3f %9.1f %6.1f%% %9.2fx %7.2fx\n", row.gemm.c_str(), row.impl.c_str(), ms,
                      tflops, 100.0 * tflops / ceiling_.tflops, grouped_ms / ms, dense_ms / ms);
        } else {
          std::printf("  %-15s %-30s %9.3f\n", row.gemm.c_str(), row.impl.c_str(), ms);
        }
        case_json["timings"].push_back(std::move(line));
      }
      std::printf("  clocks while timed (every kernel above): %s\n", harness::describe(clocks).c_str());
      case_json["clocks"] = clocks_json(clocks);
      std::fflush(stdout);
      result["cases"].push_back(std::move(case_json));
    }
  }
}

}  // namespace
}  // namespace fusemoe::bench

int main(int argc, char** argv) {
  using namespace fusemoe::bench;
  constexpr const char* kTool = "fusemoe_kernel_bench";
  int exit_code = kExitOk;
  KernelBenchParams params;
  if (!parse_command_line(kTool, kKernelUsage, [&] { return parse_kernel_args(argc, argv); }, &params, &exit_code)) {
    return exit_code;
  }
  RunFacts facts;
  if (!gather_facts(kTool, &facts)) return kExitNoHopper;
  print_facts(kTool, facts);
  std::printf("timing: median of %d after %d warm-up, CUDA events, %zu MiB L2 flush before each call\n", params.iters,
              params.warmup, facts.l2_flush_bytes >> 20);
  Json meta = facts_json(facts);
  meta["routing"] = fusemoe::harness::routing_name(params.routing);
  meta["seed"] = params.seed;
  meta["iters"] = params.iters;
  meta["warmup"] = params.warmup;
  meta["l2_flush_bytes"] = facts.l2_flush_bytes;
  Json result = {{"tool", "fusemoe_kernel_bench"}, {"schema", 1},          {"meta", meta},
                 {"ceiling", nullptr},              {"checks", Json::array()}, {"cases", Json::array()},
                 {"error", ""}};
  try {
    cudaStream_t stream = nullptr;
    FUSEMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    bool all_pass = true;
    try {
      KernelBench bench(params, stream);
      bench.run(&result, &all_pass);
    } catch (...) {
      cudaStreamDestroy(stream);
      throw;
    }
    cudaStreamDestroy(stream);
    if (!all_pass) {
      std::printf("\nfusemoe_kernel_bench: CORRECTNESS FAILURE (see the FAIL lines above)\n");
      exit_code = kExitCheckFailed;
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, "fusemoe_kernel_bench: %s\n", error.what());
    result["error"] = error.what();
    exit_code = kExitRuntimeError;
  }
  if (!params.json_path.empty()) {
    std::FILE* file = std::fopen(params.json_path.c_str(), "w");
    if (file == nullptr) {
      std::fprintf(stderr, "fusemoe_kernel_bench: cannot write %s\n", params.json_path.c_str());
      return exit_code == kExitOk ? kExitRuntimeError : exit_code;
    }
    const std::string text = result.dump(2) + "\n";
    std::fwrite(text.data(), 1, text.size(), file);
    std::fclose(file);
  }
  return exit_code;
}

// fusemoe_bench's host side without a GPU: the presets and their command line (bench/options.h),
// and the memory count and expert fit (bench/memory.h), checked against this file's own sum of
// the buffers run.cpp allocates. The fit must keep a preset that fits, halve E (a divisor of the
// preset's, >= K) until the count fits, and say so; where nothing fits it keeps E and warns. Also
// the summary of the GPU clock samples the benchmarks report with their timings.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "bench/facts.h"
#include "bench/memory.h"
#include "bench/options.h"
#include "common/gpu_clocks.h"

namespace fusemoe::bench {
namespace {

constexpr size_t kGiB = size_t(1) << 30;
// What an H200 (143771 MiB) has free once a CUDA context exists, about.
constexpr size_t kH200FreeBytes = size_t(139) * kGiB;
constexpr size_t kFlushBytes = size_t(240) << 20;  // 4x the H200's 60 MB L2

BenchParams parse(std::vector<std::string> args) {
  args.insert(args.begin(), "fusemoe_bench");
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  return parse_args(static_cast<int>(argv.size()), argv.data());
}

// The message of the UsageError that parsing args must throw; fails the test (and returns "") if
// parsing accepts them.
std::string usage_error(std::vector<std::string> args, const char* what) {
  try {
    parse(std::move(args));
  } catch (const UsageError& error) {
    return error.message;
  }
  ADD_FAILURE() << what << " was accepted";
  return "";
}

TEST(BenchPresets, NewShapesAreNamedAndListed) {
  const Preset& next = find_preset("qwen3-next");
  EXPECT_EQ(next.hidden, 2048);
  EXPECT_EQ(next.intermediate, 512);
  EXPECT_EQ(next.num_experts, 512);
  EXPECT_EQ(next.top_k, 10);
  const Preset& dsv3 = find_preset("deepseek-v3");
  EXPECT_EQ(dsv3.hidden, 7168);
  EXPECT_EQ(dsv3.intermediate, 2048);
  EXPECT_EQ(dsv3.num_experts, 256);
  EXPECT_EQ(dsv3.top_k, 8);
  for (const Preset& preset : kPresets) {
    EXPECT_NE(std::strstr(kUsage, preset.name), nullptr) << preset.name << " missing from --help";
    EXPECT_NO_THROW(validate_config(harness::layer_config(preset, 16384))) << preset.name;
  }
  EXPECT_EQ(parse({"--preset", "deepseek-v3", "--tokens", "8192"}).preset.hidden, 7168);
  const std::string preset_error = usage_error({"--preset", "deepseek-v4"}, "an unknown preset");
  EXPECT_NE(preset_error.find("qwen3-next"), std::string::npos) << preset_error;
}

// --timing: per-impl by default, interleaved or per-pass on request, anything else refused by name.
TEST(BenchOptions, TimingMode) {
  EXPECT_EQ(parse({}).timing, TimingMode::kPerImplementation);
  EXPECT_EQ(parse({"--timing", "interleaved"}).timing, TimingMode::kInterleaved);
  EXPECT_EQ(parse({"--timing=per-impl"}).timing, TimingMode::kPerImplementation);
  EXPECT_EQ(parse({"--timing", "per-pass"}).timing, TimingMode::kPerPass);
  EXPECT_STREQ(timing_mode_name(TimingMode::kPerImplementation), "per-impl");
  EXPECT_STREQ(timing_mode_name(TimingMode::kPerPass), "per-pass");
  EXPECT_STREQ(timing_mode_name(TimingMode::kInterleaved), "interleaved");
  EXPECT_NE(std::strstr(kUsage, "--timing"), nullptr);
  const std::string timing_error = usage_error({"--timing", "alone"}, "an unknown timing mode");
  EXPECT_NE(timing_error.find("--timing 'alone'"), std::string::npos) << timing_error;
  EXPECT_NE(timing_error.find("per-impl"), std::string::npos) << timing_error;
  EXPECT_NE(timing_error.find("per-pass"), std::string::npos) << timing_error;
  EXPECT_THROW(parse({"--timing"}), UsageError);  // no value
}

// --warmup-ms: a minimum warm-up time per timed block, none by default; negative refused by name.
TEST(BenchOptions, WarmupMilliseconds) {
  EXPECT_EQ(parse({}).warmup_ms, 0.0);
  EXPECT_EQ(parse({"--warmup-ms", "3000"}).warmup_ms, 3000.0);
  EXPECT_EQ(parse({"--warmup-ms=0"}).warmup_ms, 0.0);
  EXPECT_NE(std::strstr(kUsage, "--warmup-ms"), nullptr);
  const std::string warmup_error = usage_error({"--warmup-ms", "-5"}, "a negative warm-up time");
  EXPECT_NE(warmup_error.find("--warmup-ms"), std::string::npos) << warmup_error;
  EXPECT_THROW(parse({"--warmup-ms", "2s"}), UsageError);
}

// --kernel-times: off by default, a switch without a value.
TEST(BenchOptions, KernelTimes) {
  EXPECT_FALSE(parse({}).kernel_times);
  EXPECT_TRUE(parse({"--kernel-times"}).kernel_times);
  EXPECT_THROW(parse({"--kernel-times=yes"}), UsageError);
  EXPECT_NE(std::strstr(kUsage, "--kernel-times"), nullptr);
}

// This file's own sum of what run_bench holds: inputs, outputs (fp32-sized weight gradients),
// saved z, a workspace per impl, the reference's workspace and outputs at the checked T.
size_t expected_bytes(const BenchParams& p, int64_t max_tokens, int64_t checked_tokens) {
  const size_t t = max_tokens, h = p.preset.hidden, i = p.preset.intermediate, e = p.preset.num_experts,
               k = p.preset.top_k;
  const size_t weights = e * 3 * i * h;  // elements of w13 [E, 2I, H] and w2 [E, H, I]
  size_t bytes = kFlushBytes + 2 * t * h * 2 + t * k * 8 + weights * 2;  // x, dy, routing, weights
  bytes += 2 * t * h * 2 + t * k * 4 + weights * 4;                       // y, dx, d_topk_w, dw
  bool save_z = false;
  for (const BenchImpl& impl : p.impls) {
    bytes += std::max<size_t>(workspace_bytes(harness::layer_config(p.preset, max_tokens), impl.impl), 256);
    save_z = save_z || impl.save_z;
  }
  if (save_z) bytes += t * k * 2 * i * 2;
  if (checked_tokens > 0) {
    const size_t c = checked_tokens;
    bytes += workspace_bytes(harness::layer_config(p.preset, checked_tokens), Impl::kReferenceFp32);
    bytes += 2 * c * h * 2 + c * k * 4 + weights * 4;
  }
  return bytes;
}

TEST(BenchMemory, CountsWhatTheBenchAllocates) {
  BenchParams p = parse({"--preset", "qwen3-30b-a3b", "--tokens", "4096,16384"});
  EXPECT_EQ(reference_max_tokens(p), 16384);
  EXPECT_EQ(bench_device_bytes(p, kFlushBytes), expected_bytes(p, 16384, 16384));

  p = parse({"--preset", "qwen3-next", "--tokens", "4096,16384", "--check-max-tokens", "4096", "--impl",
             "fused_saved_z"});
  EXPECT_EQ(reference_max_tokens(p), 4096);
  EXPECT_EQ(bench_device_bytes(p, kFlushBytes), expected_bytes(p, 16384, 4096));

  p = parse({"--preset", "deepseek-v3", "--tokens", "8192", "--no-check", "--impl", "unfused"});
  EXPECT_EQ(reference_max_tokens(p), 0);
  EXPECT_EQ(bench_device_bytes(p, kFlushBytes), expected_bytes(p, 8192, 0));

  // The FP8 copy of the weights is counted only when an FP8 impl runs.
  BenchParams fp8 = parse({"--tokens", "4096", "--impl", "fused_fp8", "--no-check"});
  BenchParams bf16 = parse({"--tokens", "4096", "--impl", "fused", "--no-check"});
  LayerConfig c = harness::layer_config(fp8.preset, 4096);
  c.precision = Precision::kFp8Blockwise;
  EXPECT_EQ(bench_device_bytes(fp8, 0) - bench_device_bytes(bf16, 0),
            fp8_weights_bytes(c) + bench_workspace_bytes(c, fp8.impls[0]) -
                bench_workspace_bytes(harness::layer_config(bf16.preset, 4096), bf16.impls[0]));
}

// fused_separate_saved_z: by name only; w1 and w3 (one more copy of w13) are counted when it runs,
// and the reference's dw13 split as dw1, dw3 (fp32) when it is also checked.
TEST(BenchMemory, SeparateGateUpCountsItsCopies) {
  const BenchParams defaults = parse({"--tokens", "4096"});
  for (const BenchImpl& impl : defaults.impls) EXPECT_FALSE(impl.separate_gate_up) << impl.name;
  EXPECT_NE(std::strstr(kUsage, "fused_separate_saved_z"), nullptr);
  const BenchParams sep = parse({"--tokens", "4096", "--impl", "fused_separate_saved_z"});
  const BenchParams w13 = parse({"--tokens", "4096", "--impl", "fused_saved_z"});
  ASSERT_EQ(sep.impls.size(), 1u);
  EXPECT_TRUE(sep.impls[0].separate_gate_up);
  EXPECT_TRUE(sep.impls[0].save_z);
  const size_t i = sep.preset.intermediate, h = sep.preset.hidden, e = sep.preset.num_experts;
  EXPECT_EQ(bench_device_bytes(sep, kFlushBytes) - bench_device_bytes(w13, kFlushBytes),
            e * 2 * i * h * 2 + e * 2 * i * h * 4);  // w1 + w3 (bf16), the split reference dw13 (fp32)
  const BenchParams sep_unchecked = parse({"--tokens", "4096", "--impl", "fused_separate_saved_z", "--no-check"});
  const BenchParams w13_unchecked = parse({"--tokens", "4096", "--impl", "fused_saved_z", "--no-check"});
  EXPECT_EQ(bench_device_bytes(sep_unchecked, kFlushBytes) - bench_device_bytes(w13_unchecked, kFlushBytes),
            e * 2 * i * h * 2);
}

TEST(BenchMemory, PresetsThatFitKeepTheirExperts) {
  for (const char* preset : {"qwen3-30b-a3b", "qwen3-235b-a22b", "qwen3-next"}) {
    const BenchParams p = parse({"--preset", preset, "--tokens", "4096,16384"});
    const ExpertFit fit = fit_experts(p, kFlushBytes, kH200FreeBytes);
    EXPECT_TRUE(fit.fits) << preset;
    EXPECT_FALSE(fit.reduced()) << preset;
    EXPECT_EQ(fit.num_experts, p.preset.num_experts);
    EXPECT_EQ(fit.bytes, bench_device_bytes(p, kFlushBytes));
    EXPECT_EQ(expert_fit_note(fit), "") << preset;
  }
}

TEST(BenchMemory, DeepSeekV3HalvesExpertsUntilItFitsAndSaysSo) {
  // The round's run: one impl, checked. The fp32 reference widens the weights and keeps its own
  // fp32 gradients: E=256 needs ~147 GiB.
  const BenchParams p = parse({"--preset", "deepseek-v3", "--tokens", "8192", "--impl", "fused_saved_z"});
  const ExpertFit fit = fit_experts(p, kFlushBytes, kH200FreeBytes);
  std::printf("deepseek-v3 T=8192 fused_saved_z, checked, %zu GiB free: %s\n", kH200FreeBytes / kGiB,
              expert_fit_note(fit).c_str());
  ASSERT_TRUE(fit.fits);
  ASSERT_TRUE(fit.reduced());
  EXPECT_GT(fit.preset_bytes + kHeadroomBytes, kH200FreeBytes);
  EXPECT_LE(fit.bytes + kHeadroomBytes, kH200FreeBytes);
  EXPECT_EQ(256 % fit.num_experts, 0);
  EXPECT_GE(fit.num_experts, p.preset.top_k);
  // The largest E that fits: twice it does not.
  BenchParams doubled = p;
  doubled.preset.num_experts = 2 * fit.num_experts;
  EXPECT_GT(bench_device_bytes(doubled, kFlushBytes) + kHeadroomBytes, kH200FreeBytes);
  const std::string note = expert_fit_note(fit);
  EXPECT_NE(note.find("E reduced 256 -> " + std::to_string(fit.num_experts) + ":"), std::string::npos) << note;
  EXPECT_NE(note.find("GiB free"), std::string::npos) << note;

  // Unchecked, E=256 fits.
  const BenchParams unchecked =
      parse({"--preset", "deepseek-v3", "--tokens", "8192", "--impl", "fused_saved_z", "--no-check"});
  EXPECT_FALSE(fit_experts(unchecked, kFlushBytes, kH200FreeBytes).reduced());
}

TEST(BenchMemory, NothingFitsKeepsThePresetAndWarns) {
  const BenchParams p = parse({"--preset", "qwen3-next", "--tokens", "16384"});
  const ExpertFit fit = fit_experts(p, kFlushBytes, size_t(2) * kGiB);
  EXPECT_FALSE(fit.fits);
  EXPECT_EQ(fit.num_experts, 512);
  EXPECT_NE(expert_fit_note(fit).find("WARNING"), std::string::npos);
  // E halves 96 -> 48 -> 24 -> 12 and stops there: 6 would be below K = 10.
  BenchParams odd = p;
  odd.preset.num_experts = 12;
  const size_t bytes_at_12 = bench_device_bytes(odd, kFlushBytes);
  odd.preset.num_experts = 96;
  EXPECT_EQ(fit_experts(odd, kFlushBytes, bytes_at_12 + kHeadroomBytes).num_experts, 12);
  EXPECT_FALSE(fit_experts(odd, kFlushBytes, bytes_at_12 + kHeadroomBytes - 1).fits);
}

}  // namespace
}  // namespace fusemoe::bench

// The benchmarks' clock summary of NVML samples (median, range, share under the power cap) and its
// JSON, from samples made up here: the H200's own are read only there.
namespace fusemoe::bench {
namespace {

harness::Nvml::Sample clock_sample(unsigned sm_mhz, bool capped, bool ok = true) {
  harness::Nvml::Sample s;
  s.ok = ok;
  s.sm_mhz = sm_mhz;
  s.power_capped = capped;
  return s;
}

TEST(GpuClocks, SummaryOfSamples) {
  const harness::ClockSummary odd = harness::summarize_clocks(
      {clock_sample(1980, false), clock_sample(1400, true), clock_sample(0, false, /*ok=*/false),
       clock_sample(1500, true)});
  EXPECT_EQ(odd.samples, 3);  // the failed read is left out
  EXPECT_EQ(odd.sm_mhz_median, 1500);
  EXPECT_EQ(odd.sm_mhz_min, 1400);
  EXPECT_EQ(odd.sm_mhz_max, 1980);
  EXPECT_DOUBLE_EQ(odd.power_capped_fraction, 2.0 / 3.0);
  EXPECT_EQ(harness::describe(odd), "SM 1500 MHz median (1400-1980), power cap in 67% of 3 samples");
  const Json json = clocks_json(odd);
  EXPECT_EQ(json["samples"], 3);
  EXPECT_EQ(json["sm_mhz_median"], 1500.0);
  EXPECT_DOUBLE_EQ(json["power_capped_fraction"].get<double>(), 2.0 / 3.0);

  const harness::ClockSummary even =
      harness::summarize_clocks({clock_sample(1300, true), clock_sample(1600, true)});
  EXPECT_EQ(even.sm_mhz_median, 1450);
  EXPECT_DOUBLE_EQ(even.power_capped_fraction, 1.0);
}

TEST(GpuClocks, NoSamplesSaySo) {
  const harness::ClockSummary none = harness::summarize_clocks({clock_sample(1500, false, /*ok=*/false)});
  EXPECT_EQ(none.samples, 0);
  EXPECT_EQ(harness::describe(none), "clocks n/a (no NVML samples)");
  EXPECT_EQ(clocks_json(none), Json({{"samples", 0}}));
}

}  // namespace
}  // namespace fusemoe::bench

// fusemoe_bench's command line: the layer presets, the implementations it can time, and the
// parsed parameters of one run.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/layer_config.h"
#include "common/routing.h"
#include "fusemoe/fusemoe.h"

namespace fusemoe::bench {

constexpr int kExitOk = 0;
constexpr int kExitCheckFailed = 1;
constexpr int kExitBadArgs = 2;
constexpr int kExitNoHopper = 3;
constexpr int kExitRuntimeError = 4;

// A named layer shape (hidden, intermediate, num_experts, top_k from harness::LayerShape).
struct Preset : harness::LayerShape {
  const char* name;
  const char* short_name;  // for progress lines
};

// The shapes themselves are tests/common/layer_config.h's, shared with the test suites.
constexpr Preset kPresets[] = {
    {harness::kQwen3_30bA3b, "qwen3-30b-a3b", "30B"},
    {harness::kQwen3_235bA22b, "qwen3-235b-a22b", "235B"},
    {harness::kQwen3Next, "qwen3-next", "Next"},
    // E=256 with everything the bench holds may not fit one GPU: fusemoe_bench then halves E
    // (bench/memory.h) and says so.
    {harness::kDeepSeekV3, "deepseek-v3", "DSv3"},
};

// Relative (Frobenius) error an implementation may have against the fp32 reference. bf16 keeps 8
// significant bits (relative step 2^-8 ≈ 4e-3); a layer's outputs carry a few such roundings, so
// 2e-2 separates "bf16 noise" from "wrong".
constexpr double kRelErrTol = 2e-2;
// Blockwise FP8: E4M3's quantization alone gives ~6% on these inputs; the GPU suite holds FP8 to
// 1.1x its emulation's error (tests/gpu/test_fp8_layer.cpp), this check only catches a broken path.
constexpr double kFp8RelErrTol = 1e-1;

struct BenchImpl {
  const char* name;  // command-line and report name
  Impl impl;
  bool has_backward;  // false: forward only
  bool save_z;        // the forward saves z (ForwardArgs::saved_z), the backward reads it
  Precision precision = Precision::kBf16;
  double check_tol = kRelErrTol;
  // In the default --impl list. FP8 is not until it has passed its GPU suites (docs/design.md,
  // Blockwise FP8, status): a failing or trapping FP8 path would otherwise fail every round.
  bool by_default = true;
  // Gate and up weights as two tensors w1, w3 [E, I, H] (torchtitan's layout) and the gradients
  // as dw1, dw3, instead of w13 / dw13: copies of the same values, so the results should match.
  bool separate_gate_up = false;
  // Precision::kFp8Blockwise: LayerConfig::fp8_weight_grads (the weight gradients' GEMMs in FP8).
  bool fp8_weight_grads = false;
};

// Implementations the benchmark can time (the fp32 reference is the oracle, never timed).
// A new fusemoe::Impl is one line here; the default --impl list is those with by_default.
constexpr BenchImpl kBenchImpls[] = {
    {"unfused", Impl::kUnfused, true, false},
    {"fused", Impl::kFused, true, false},
    // As the PyTorch op runs it when gradients are needed.
    {"fused_saved_z", Impl::kFused, true, true},
    // Blockwise FP8; the weights are quantized once before timing, as a training step does once
    // per optimizer step.
    {"fused_fp8", Impl::kFused, true, false, Precision::kFp8Blockwise, kFp8RelErrTol, false},
    {"fused_fp8_saved_z", Impl::kFused, true, true, Precision::kFp8Blockwise, kFp8RelErrTol, false},
    // The same with FP8 weight gradients.
    {"fused_fp8_fp8wgrad_saved_z", Impl::kFused, true, true, Precision::kFp8Blockwise, kFp8RelErrTol, false, false,
     true},
    // fused_saved_z with separate gate and up weights (w1, w3) and gradients (dw1, dw3).
    {"fused_separate_saved_z", Impl::kFused, true, true, Precision::kBf16, kRelErrTol, false, true},
};
// The fp32 GPU oracle every implementation is checked against.
constexpr BenchImpl kReferenceImpl = {"reference_fp32", Impl::kReferenceFp32, true, false};

// The flags both benchmarks take.
struct SharedOptions {
  std::vector<int64_t> tokens;
  harness::Routing routing = harness::Routing::kUniform;
  int iters = 20;
  int warmup = 5;
  std::string json_path;
  uint64_t seed = 1234;
  bool check = true;
};

// How the implementations share the timed stretch. kPerImplementation (the default):
// implementation after implementation, its passes interleaved, its own warm-up, each at the
// clock it holds alone under the power cap, as a training job running one of them does.
// kInterleaved: one round of every (pass, implementation) per iteration; the cooler
// implementations (unfused) then lend the others clock: fused_saved_z read 10% faster that way at
// 30B T=16384 (docs/perf.md#method).
enum class TimingMode { kInterleaved, kPerImplementation, kPerPass };
const char* timing_mode_name(TimingMode mode);

struct BenchParams : SharedOptions {
  Preset preset = kPresets[0];
  std::vector<BenchImpl> impls;
  TimingMode timing = TimingMode::kPerImplementation;
  // Minimum warm-up time per timed block (EventTimer::run_interleaved's min_warmup_ms).
  double warmup_ms = 0.0;
  // Token counts above this are timed but not checked (the fp32 reference is slow at 235B).
  int64_t check_max_tokens = std::numeric_limits<int64_t>::max();
  // After each case's timings: its calls again under CUPTI, each kernel's time inside the layer
  // (bench/kernel_times.h).
  bool kernel_times = false;
};

// A bad command line; an empty message asks for the usage text (--help).
struct UsageError {
  std::string message;
};

extern const char* const kUsage;

// Command-line pieces the benchmarks share; they throw UsageError.
int64_t parse_int(const std::string& flag, const std::string& text, int64_t min_value);
std::vector<std::string> split_commas(const std::string& text);
const Preset& find_preset(const std::string& name);

// What a flag handler gets: the flag ("--iters"), its value (from "--iters=N" or the next
// argument; throws UsageError when there is none) and whether "=" gave one.
struct Flag {
  std::string name;
  std::function<std::string()> value;
  bool has_inline_value;
};
// Calls handle(flag) for each argument; --help and -h throw UsageError{""}.
void for_each_flag(int argc, char** argv, const std::function<void(const Flag&)>& handle);
// Handles --tokens, --routing, --iters, --warmup, --json, --seed and --no-check; false for any
// other flag.
bool parse_shared_flag(const Flag& flag, SharedOptions* options);

// *params = parse(); on a UsageError prints `usage` (on stdout for --help, else on stderr after
// the message) and returns false with the exit code in *exit_code.
template <typename Params, typename Parse>
bool parse_command_line(const char* tool, const char* usage, Parse&& parse, Params* params, int* exit_code) {
  try {
    *params = parse();
    return true;
  } catch (const UsageError& error) {
    if (error.message.empty()) {
      std::fputs(usage, stdout);
      *exit_code = kExitOk;
    } else {
      std::fprintf(stderr, "%s: %s\n%s", tool, error.message.c_str(), usage);
      *exit_code = kExitBadArgs;
    }
    return false;
  }
}

// Throws UsageError.
BenchParams parse_args(int argc, char** argv);

}  // namespace fusemoe::bench

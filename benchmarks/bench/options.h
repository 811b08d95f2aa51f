// fusemoe_bench's command line: the layer presets, the implementations it can time, and the
// parsed parameters of one run.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/routing.h"
#include "fusemoe/fusemoe.h"

namespace fusemoe::bench {

constexpr int kExitOk = 0;
constexpr int kExitCheckFailed = 1;
constexpr int kExitBadArgs = 2;
constexpr int kExitNoHopper = 3;
constexpr int kExitRuntimeError = 4;

struct Preset {
  const char* name;
  const char* short_name;  // for progress lines
  int64_t hidden, intermediate, num_experts, top_k;
};

constexpr Preset kPresets[] = {
    {"qwen3-30b-a3b", "30B", 2048, 768, 128, 8},
    {"qwen3-235b-a22b", "235B", 4096, 1536, 128, 8},
};

struct BenchImpl {
  const char* name;  // command-line and report name
  Impl impl;
  bool has_backward;  // false: forward only
  bool save_z;        // the forward saves z (ForwardArgs::saved_z), the backward reads it
};

// Implementations the benchmark can time (the fp32 reference is the oracle, never timed).
// A new fusemoe::Impl is one line here; the default --impl list is all of them.
constexpr BenchImpl kBenchImpls[] = {
    {"unfused", Impl::kUnfused, true, false},
    {"fused", Impl::kFused, true, false},
    // As the PyTorch op runs it when gradients are needed.
    {"fused_saved_z", Impl::kFused, true, true},
};
// The fp32 GPU oracle every implementation is checked against.
constexpr BenchImpl kReferenceImpl = {"reference_fp32", Impl::kReferenceFp32, true, false};

struct BenchParams {
  Preset preset = kPresets[0];
  std::vector<int64_t> tokens = {4096};
  harness::Routing routing = harness::Routing::kUniform;
  std::vector<BenchImpl> impls;
  int iters = 20;
  int warmup = 5;
  std::string json_path;
  uint64_t seed = 1234;
  bool check = true;
  // Token counts above this are timed but not checked (the fp32 reference is slow at 235B).
  int64_t check_max_tokens = std::numeric_limits<int64_t>::max();
};

// A bad command line; an empty message asks for the usage text (--help).
struct UsageError {
  std::string message;
};

extern const char* const kUsage;

// Throws UsageError.
BenchParams parse_args(int argc, char** argv);

}  // namespace fusemoe::bench

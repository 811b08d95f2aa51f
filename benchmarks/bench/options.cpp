#include "bench/options.h"

#include <sstream>

namespace fusemoe::bench {

const char* const kUsage =
    "usage: fusemoe_bench [--preset NAME] [--tokens N[,N...]]\n"
    "                     [--routing NAME] [--impl NAME[,NAME...]] [--iters N]\n"
    "                     [--warmup N] [--json PATH] [--seed N] [--no-check]\n"
    "                     [--check-max-tokens N] [--timing MODE] [--warmup-ms MS]\n"
    "                     [--kernel-times]\n"
    "  --preset            layer shape (default qwen3-30b-a3b: H=2048 I=768 E=128 K=8;\n"
    "                      qwen3-235b-a22b: H=4096 I=1536 E=128 K=8;\n"
    "                      qwen3-next: H=2048 I=512 E=512 K=10;\n"
    "                      deepseek-v3: H=7168 I=2048 E=256 K=8). Where the GPU's free memory\n"
    "                      cannot hold all the run allocates, E is halved until it can, and\n"
    "                      the output and --json say so (\"E reduced 256 -> 128: ...\")\n"
    "  --tokens            token counts to run, comma separated (default 4096)\n"
    "  --routing           uniform: K distinct experts uniformly at random per token;\n"
    "                      skewed: Zipf popularity p(e) ~ 1/(rank+1)^1.2 (default uniform);\n"
    "                      also one_expert, all_slots_one, few_experts, masked\n"
    "                      (tests/common/routing.h)\n"
    "  --impl              implementations to time (default: unfused, fused, and fused_saved_z =\n"
    "                      fused with the forward saving z for the backward; also fused_fp8 and\n"
    "                      fused_fp8_saved_z = the same at blockwise FP8, by name only;\n"
    "                      fused_fp8_fp8wgrad_saved_z = the latter with FP8 weight gradients\n"
    "                      (LayerConfig::fp8_weight_grads), by name only; and\n"
    "                      fused_separate_saved_z = fused_saved_z on separate gate and up\n"
    "                      weights w1, w3 and gradients dw1, dw3, by name only)\n"
    "  --iters, --warmup   timed runs (median reported) and untimed runs before (20, 5)\n"
    "  --json              write all figures and metadata to PATH\n"
    "  --seed              seed of the inputs and the routing (default 1234)\n"
    "  --no-check          skip the correctness check against the fp32 reference\n"
    "  --check-max-tokens  check only token counts <= N (others are timed, check 'skipped')\n"
    "  --timing            per-impl: implementation after implementation, each with its own\n"
    "                      warm-up and clock line, at the clock it holds alone under the power\n"
    "                      cap (default); interleaved: every (pass, impl) in one round per\n"
    "                      iteration (the cooler impls then lend the others clock); per-pass:\n"
    "                      every (pass, impl) in a block of its own, with its own warm-up\n"
    "  --warmup-ms         warm-up rounds go on until MS milliseconds have passed, per timed\n"
    "                      block (each impl in per-impl timing), after at least --warmup of\n"
    "                      them (default 0: --warmup rounds only; after a pause the power cap\n"
    "                      allows a short burst, so the first rounds run faster than sustained\n"
    "                      ones); the --kernel-times calls warm up for max(MS, 500)\n"
    "  --kernel-times      after each case's timings, each implementation's fwd+bwd calls (bf16\n"
    "                      weight gradients) again, --iters of them after --warmup and 500 ms\n"
    "                      of untraced ones, with CUPTI's kernel records: each kernel's time\n"
    "                      inside the layer, at the clock the power cap leaves it (libcupti\n"
    "                      loaded at run time; FUSEMOE_CUPTI_LIB)\n"
    "exit: 0 ok, 1 correctness failure, 2 bad arguments, 3 no Hopper GPU, 4 runtime error\n";

const char* timing_mode_name(TimingMode mode) {
  switch (mode) {
    case TimingMode::kInterleaved: return "interleaved";
    case TimingMode::kPerPass: return "per-pass";
    default: return "per-impl";
  }
}

int64_t parse_int(const std::string& flag, const std::string& text, int64_t min_value) {
  size_t used = 0;
  long long value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size()) throw UsageError{flag + " expects an integer, got '" + text + "'"};
  if (value < min_value) throw UsageError{flag + " must be >= " + std::to_string(min_value) + ", got " + text};
  return value;
}

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream stream(text);
  std::string part;
  while (std::getline(stream, part, ',')) parts.push_back(part);
  return parts;
}

const Preset& find_preset(const std::string& name) {
  for (const Preset& preset : kPresets) {
    if (name == preset.name) return preset;
  }
  std::string known;
  for (const Preset& preset : kPresets) known += std::string(" ") + preset.name;
  throw UsageError{"unknown --preset '" + name + "' (known:" + known + ")"};
}

void for_each_flag(int argc, char** argv, const std::function<void(const Flag&)>& handle) {
  for (int i = 1; i < argc; ++i) {
    std::string name = argv[i], value;
    bool has_inline_value = false;
    if (size_t eq = name.find('='); name.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_inline_value = true;
    }
    if (name == "--help" || name == "-h") throw UsageError{""};
    const Flag flag{name,
                    [&]() -> std::string {
                      if (has_inline_value) return value;
                      if (i + 1 >= argc) throw UsageError{name + " needs a value"};
                      return argv[++i];
                    },
                    has_inline_value};
    handle(flag);
  }
}

bool parse_shared_flag(const Flag& flag, SharedOptions* options) {
  if (flag.name == "--tokens") {
    options->tokens.clear();
    for (const std::string& part : split_commas(flag.value())) options->tokens.push_back(parse_int(flag.name, part, 1));
    if (options->tokens.empty()) throw UsageError{"--tokens needs at least one count"};
  } else if (flag.name == "--routing") {
    const std::string name = flag.value();
    if (!harness::parse_routing(name, &options->routing)) {
      std::string known;
      for (harness::Routing r : harness::kAllRoutings) known += std::string(" ") + harness::routing_name(r);
      throw UsageError{"unknown --routing '" + name + "' (known:" + known + ")"};
    }
  } else if (flag.name == "--iters") {
    options->iters = static_cast<int>(parse_int(flag.name, flag.value(), 1));
  } else if (flag.name == "--warmup") {
    options->warmup = static_cast<int>(parse_int(flag.name, flag.value(), 0));
  } else if (flag.name == "--json") {
    options->json_path = flag.value();
    if (options->json_path.empty()) throw UsageError{"--json needs a path"};
  } else if (flag.name == "--seed") {
    options->seed = static_cast<uint64_t>(parse_int(flag.name, flag.value(), 0));
  } else if (flag.name == "--no-check") {
    if (flag.has_inline_value) throw UsageError{"--no-check takes no value"};
    options->check = false;
  } else {
    return false;
  }
  return true;
}

BenchParams parse_args(int argc, char** argv) {
  BenchParams params;
  params.tokens = {4096};
  for (const BenchImpl& impl : kBenchImpls) {
    if (impl.by_default) params.impls.push_back(impl);
  }
  for_each_flag(argc, argv, [&](const Flag& flag) {
    if (parse_shared_flag(flag, &params)) return;
    if (flag.name == "--preset") {
      params.preset = find_preset(flag.value());
    } else if (flag.name == "--impl") {
      params.impls.clear();
      for (const std::string& name : split_commas(flag.value())) {
        const BenchImpl* match = nullptr;
        for (const BenchImpl& impl : kBenchImpls) {
          if (name == impl.name) match = &impl;
        }
        if (match == nullptr) {
          std::string known;
          for (const BenchImpl& impl : kBenchImpls) known += std::string(" ") + impl.name;
          throw UsageError{"unknown --impl '" + name + "' (known:" + known + ")"};
        }
        params.impls.push_back(*match);
      }
      if (params.impls.empty()) throw UsageError{"--impl needs at least one name"};
    } else if (flag.name == "--check-max-tokens") {
      params.check_max_tokens = parse_int(flag.name, flag.value(), 0);
    } else if (flag.name == "--warmup-ms") {
      params.warmup_ms = static_cast<double>(parse_int(flag.name, flag.value(), 0));
    } else if (flag.name == "--kernel-times") {
      if (flag.has_inline_value) throw UsageError{"--kernel-times takes no value"};
      params.kernel_times = true;
    } else if (flag.name == "--timing") {
      const std::string mode = flag.value();
      if (mode == "interleaved") {
        params.timing = TimingMode::kInterleaved;
      } else if (mode == "per-impl") {
        params.timing = TimingMode::kPerImplementation;
      } else if (mode == "per-pass") {
        params.timing = TimingMode::kPerPass;
      } else {
        throw UsageError{"unknown --timing '" + mode + "' (known: interleaved per-impl per-pass)"};
      }
    } else {
      throw UsageError{"unknown argument '" + flag.name + "'"};
    }
  });
  return params;
}

}  // namespace fusemoe::bench

#include "bench/options.h"

#include <sstream>

namespace fusemoe::bench {

const char* const kUsage =
    "usage: fusemoe_bench [--preset qwen3-30b-a3b|qwen3-235b-a22b] [--tokens N[,N...]]\n"
    "                     [--routing NAME] [--impl NAME[,NAME...]] [--iters N]\n"
    "                     [--warmup N] [--json PATH] [--seed N] [--no-check]\n"
    "                     [--check-max-tokens N]\n"
    "  --preset            layer shape (default qwen3-30b-a3b: H=2048 I=768 E=128 K=8;\n"
    "                      qwen3-235b-a22b: H=4096 I=1536 E=128 K=8)\n"
    "  --tokens            token counts to run, comma separated (default 4096)\n"
    "  --routing           uniform: K distinct experts uniformly at random per token;\n"
    "                      skewed: Zipf popularity p(e) ~ 1/(rank+1)^1.2 (default uniform);\n"
    "                      also one_expert, all_slots_one, few_experts, masked\n"
    "                      (tests/common/routing.h)\n"
    "  --impl              implementations to time (default: all of them: unfused, fused, and\n"
    "                      fused_saved_z = fused with the forward saving z for the backward)\n"
    "  --iters, --warmup   timed runs (median reported) and untimed runs before (20, 5)\n"
    "  --json              write all figures and metadata to PATH\n"
    "  --seed              seed of the inputs and the routing (default 1234)\n"
    "  --no-check          skip the correctness check against the fp32 reference\n"
    "  --check-max-tokens  check only token counts <= N (others are timed, check 'skipped')\n"
    "exit: 0 ok, 1 correctness failure, 2 bad arguments, 3 no Hopper GPU, 4 runtime error\n";

namespace {

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

}  // namespace

BenchParams parse_args(int argc, char** argv) {
  BenchParams params;
  for (const BenchImpl& impl : kBenchImpls) params.impls.push_back(impl);
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    std::string value;
    bool has_inline_value = false;
    if (size_t eq = flag.find('='); flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
      has_inline_value = true;
    }
    auto next_value = [&]() -> std::string {
      if (has_inline_value) return value;
      if (i + 1 >= argc) throw UsageError{flag + " needs a value"};
      return argv[++i];
    };
    if (flag == "--help" || flag == "-h") {
      throw UsageError{""};
    } else if (flag == "--preset") {
      const std::string name = next_value();
      bool found = false;
      for (const Preset& preset : kPresets) {
        if (name == preset.name) {
          params.preset = preset;
          found = true;
        }
      }
      if (!found) throw UsageError{"unknown --preset '" + name + "'"};
    } else if (flag == "--tokens") {
      params.tokens.clear();
      for (const std::string& part : split_commas(next_value())) params.tokens.push_back(parse_int(flag, part, 1));
      if (params.tokens.empty()) throw UsageError{"--tokens needs at least one count"};
    } else if (flag == "--routing") {
      const std::string name = next_value();
      if (!harness::parse_routing(name, &params.routing)) {
        std::string known;
        for (harness::Routing r : harness::kAllRoutings) known += std::string(" ") + harness::routing_name(r);
        throw UsageError{"unknown --routing '" + name + "' (known:" + known + ")"};
      }
    } else if (flag == "--impl") {
      params.impls.clear();
      for (const std::string& name : split_commas(next_value())) {
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
    } else if (flag == "--iters") {
      params.iters = static_cast<int>(parse_int(flag, next_value(), 1));
    } else if (flag == "--warmup") {
      params.warmup = static_cast<int>(parse_int(flag, next_value(), 0));
    } else if (flag == "--json") {
      params.json_path = next_value();
      if (params.json_path.empty()) throw UsageError{"--json needs a path"};
    } else if (flag == "--seed") {
      params.seed = static_cast<uint64_t>(parse_int(flag, next_value(), 0));
    } else if (flag == "--no-check") {
      if (has_inline_value) throw UsageError{"--no-check takes no value"};
      params.check = false;
    } else if (flag == "--check-max-tokens") {
      params.check_max_tokens = parse_int(flag, next_value(), 0);
    } else {
      throw UsageError{"unknown argument '" + std::string(argv[i]) + "'"};
    }
  }
  return params;
}

}  // namespace fusemoe::bench

// Sustained run (issue 18): the fused layer's forward + backward (saved z, bf16 weight gradients)
// in a loop for --seconds. Every call's outputs are NaN-poisoned before it (the harness), and every
// --check-every iterations the outputs of that call are compared bitwise with the first call's:
// any differing byte (drift, a race, an unwritten output) fails the run, as does any CUDA error.
// At each check it prints a progress line with the time per iteration of the last window and the
// GPU's SM and memory clocks, power and temperature (NVML, loaded at run time; "n/a" without it),
// and at the end their ranges. The loop does not synchronise between checks, so the GPU stays busy.
// Exit: 0 pass, 1 fail, 2 bad arguments, 77 no sm_90 GPU (skipped).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/device.h"
#include "common/gpu_clocks.h"
#include "common/layer_config.h"
#include "common/layer_device.h"
#include "common/tool_main.h"
#include "common/routing.h"
#include "fusemoe/error.h"
#include "fusemoe/fusemoe.h"

namespace fusemoe::soak {
namespace {

using harness::DeviceArena;
using harness::LayerCall;
using harness::LayerInputs;
using harness::LayerOutputs;

struct Options {
  std::string preset = "qwen3-235b-a22b";
  int64_t tokens = 16384;
  double seconds = 600;
  int64_t check_every = 100;
  uint64_t seed = 1234;
  harness::Routing routing = harness::Routing::kUniform;
};

void usage() {
  std::printf(
      "usage: fusemoe_soak_test [--preset qwen3-235b-a22b|qwen3-30b-a3b] [--tokens T] [--seconds S]\n"
      "                         [--check-every N] [--routing NAME] [--seed S]\n"
      "  runs the fused forward+backward (saved z, bf16 weight gradients) for S seconds (default 600),\n"
      "  comparing every N-th call's outputs bitwise with the first call's (default 100)\n");
}

bool parse(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage();
      std::exit(0);
    }
    if (i + 1 >= argc) {
      std::printf("error: %s needs a value\n", a.c_str());
      return false;
    }
    const std::string v = argv[++i];
    char* end = nullptr;
    if (a == "--preset") {
      o->preset = v;
      continue;
    }
    if (a == "--tokens") {
      o->tokens = std::strtoll(v.c_str(), &end, 10);
    } else if (a == "--seconds") {
      o->seconds = std::strtod(v.c_str(), &end);
    } else if (a == "--check-every") {
      o->check_every = std::strtoll(v.c_str(), &end, 10);
    } else if (a == "--seed") {
      o->seed = std::strtoull(v.c_str(), &end, 0);
    } else if (a == "--routing") {
      if (!harness::parse_routing(v, &o->routing)) {
        std::printf("error: --routing %s is not a routing name\n", v.c_str());
        return false;
      }
      continue;
    } else {
      std::printf("error: unknown option %s\n", a.c_str());
      usage();
      return false;
    }
    if (end == nullptr || *end != '\0') {
      std::printf("error: %s %s is not a number\n", a.c_str(), v.c_str());
      return false;
    }
  }
  if (o->preset != "qwen3-235b-a22b" && o->preset != "qwen3-30b-a3b") {
    std::printf("error: --preset %s: expected qwen3-235b-a22b or qwen3-30b-a3b\n", o->preset.c_str());
    return false;
  }
  if (o->tokens < 1 || o->seconds <= 0 || o->check_every < 1) {
    std::printf("error: --tokens, --seconds and --check-every must be positive\n");
    return false;
  }
  return true;
}

struct Range {
  double lo = 1e300, hi = -1e300;
  void add(double v) {
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
};

int run(const Options& opt) {
  harness::GpuInfo gpu;
  std::string reason;
  if (!harness::find_sm90(&gpu, &reason)) {
    std::printf("SKIPPED: %s; the soak test needs an sm_90 (Hopper) GPU\n", reason.c_str());
    return 77;
  }
  const LayerConfig c = opt.preset == "qwen3-235b-a22b" ? harness::qwen3_235b_config(opt.tokens)
                                                        : harness::qwen3_30b_config(opt.tokens);
  const int64_t T = opt.tokens;
  // Useful FLOPs of forward + backward: 3 GEMM-equivalents of 2·T·K·(2·H·I + H·I) each.
  const double flops = 3.0 * 2.0 * T * c.top_k * 3.0 * c.hidden * c.intermediate;

  const size_t bytes = LayerInputs::footprint(c) + 2 * LayerOutputs::footprint(c, WeightGradDtype::kBFloat16) +
                       DeviceArena::footprint(saved_z_bytes(c)) +
                       DeviceArena::footprint(workspace_bytes(c, Impl::kFused));
  std::printf("GPU: %s, %d SMs; soak: %s T=%lld, fused forward+backward with saved z, bf16 weight gradients, "
              "%s routing, %.0f s, bitwise check every %lld calls; %.1f GiB of buffers\n",
              gpu.name.c_str(), gpu.sm_count, opt.preset.c_str(), static_cast<long long>(T),
              harness::routing_name(opt.routing), opt.seconds, static_cast<long long>(opt.check_every),
              bytes / double(size_t(1) << 30));
  std::fflush(stdout);

  DeviceArena arena(bytes);
  const LayerInputs in = LayerInputs::carve(arena, c);
  const LayerOutputs first = LayerOutputs::carve(arena, c, WeightGradDtype::kBFloat16);
  const LayerOutputs latest = LayerOutputs::carve(arena, c, WeightGradDtype::kBFloat16);
  void* saved_z = arena.take(saved_z_bytes(c));
  void* workspace = arena.take(workspace_bytes(c, Impl::kFused));
  cudaStream_t stream = nullptr;
  FUSEMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const harness::TopK topk = harness::make_topk(T, c.num_experts, c.top_k, opt.routing, opt.seed);
  in.fill_normal(c, T, opt.seed, stream);
  in.upload_routing(topk.idx_TK, topk.w_TK, stream);

  LayerCall call;
  call.impl = Impl::kFused;
  call.saved_z = saved_z;
  call.workspace = workspace;
  call.stream = stream;
  // A synchronising id check per call would leave the GPU idle between calls; the ids are valid.
  call.sync_check_expert_ids = false;
  harness::run_layer_call(c, T, in, first, call);
  FUSEMOE_CUDA_CHECK(cudaStreamSynchronize(stream));

  const harness::Nvml nvml(gpu.device);
  Range sm_mhz, mem_mhz, power_w, temp_c, window_ms;
  std::vector<double> windows_ms;
  int64_t iters = 0, checks = 0, failed_checks = 0;
  const auto start = std::chrono::steady_clock::now();
  auto since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  };
  auto window_start = start;
  while (since(start) < opt.seconds) {
    harness::run_layer_call(c, T, in, latest, call);
    if (++iters % opt.check_every != 0) continue;
    // A sample while the queue still holds work: the clocks and power of a loaded GPU.
    const harness::Nvml::Sample s = nvml.sample();
    const harness::LayerDifferences diff = harness::count_layer_differences(c, T, first, latest);  // waits
    const double ms = 1e3 * since(window_start) / opt.check_every;
    window_start = std::chrono::steady_clock::now();
    uint64_t differing = 0;
    for (uint64_t d : diff) differing += d;
    ++checks;
    if (differing != 0) ++failed_checks;
    windows_ms.push_back(ms);
    window_ms.add(ms);
    std::string gpu_state = "clocks/power n/a (no NVML)";
    if (s.ok) {
      sm_mhz.add(s.sm_mhz);
      mem_mhz.add(s.mem_mhz);
      power_w.add(s.power_mw / 1e3);
      temp_c.add(s.temp_c);
      char text[128];
      std::snprintf(text, sizeof(text), "SM %u MHz, mem %u MHz, %.0f W, %u C", s.sm_mhz, s.mem_mhz, s.power_mw / 1e3,
                    s.temp_c);
      gpu_state = text;
    }
    std::printf("[soak %6.1f s] iter %7lld: %.3f ms/iter (%.0f TFLOP/s incl. poison fills), differing bytes vs "
                "call 1: %llu (y %llu, dx %llu, dtw %llu, dw13 %llu, dw2 %llu)%s; %s\n",
                since(start), static_cast<long long>(iters), ms, flops / (ms * 1e-3) / 1e12,
                static_cast<unsigned long long>(differing), static_cast<unsigned long long>(diff[harness::kY]),
                static_cast<unsigned long long>(diff[harness::kDx]),
                static_cast<unsigned long long>(diff[harness::kDTopkWeights]),
                static_cast<unsigned long long>(diff[harness::kDw13]),
                static_cast<unsigned long long>(diff[harness::kDw2]), differing != 0 ? " FAIL" : "", gpu_state.c_str());
    std::fflush(stdout);
  }
  FUSEMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const double total_s = since(start);
  FUSEMOE_CUDA_CHECK(cudaStreamDestroy(stream));

  // Speed drift: the mean of the first and the last tenth of the windows.
  auto mean = [](std::vector<double>::const_iterator b, std::vector<double>::const_iterator e) {
    double sum = 0;
    for (auto i = b; i != e; ++i) sum += *i;
    return e > b ? sum / double(e - b) : 0.0;
  };
  const size_t tenth = std::max<size_t>(1, windows_ms.size() / 10);
  const double first_ms = mean(windows_ms.begin(), windows_ms.begin() + std::min(tenth, windows_ms.size()));
  const double last_ms = mean(windows_ms.end() - std::min(tenth, windows_ms.size()), windows_ms.end());
  const bool pass = checks > 0 && failed_checks == 0;
  std::printf("soak summary: %lld iterations in %.1f s, %lld bitwise checks, %lld failed; ms/iter %.3f-%.3f "
              "(first tenth %.3f, last tenth %.3f: %+.2f%%)",
              static_cast<long long>(iters), total_s, static_cast<long long>(checks),
              static_cast<long long>(failed_checks), window_ms.lo, window_ms.hi, first_ms, last_ms,
              first_ms > 0 ? 100.0 * (last_ms / first_ms - 1.0) : 0.0);
  if (sm_mhz.hi >= sm_mhz.lo) {
    std::printf("; SM %.0f-%.0f MHz, mem %.0f-%.0f MHz, power %.0f-%.0f W, temperature %.0f-%.0f C", sm_mhz.lo,
                sm_mhz.hi, mem_mhz.lo, mem_mhz.hi, power_w.lo, power_w.hi, temp_c.lo, temp_c.hi);
  } else {
    std::printf("; clocks and power not recorded (no NVML)");
  }
  std::printf("\n%s\n", pass ? "PASS" : (checks == 0 ? "FAIL: no check ran (--seconds too short)" : "FAIL"));
  return pass ? 0 : 1;
}

}  // namespace
}  // namespace fusemoe::soak

int main(int argc, char** argv) {
  return fusemoe::harness::tool_main<fusemoe::soak::Options>(argc, argv, fusemoe::soak::parse, fusemoe::soak::run);
}

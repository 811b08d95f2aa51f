// The expert-parallel layer's protocol cost on one GPU: R co-resident ranks (one stream and
// 1/R of the SMs each, launched together and joined) run a layer over `--tokens` tokens in all
// (T / R per rank, experts spread over the ranks), against the single-GPU fused layer on the
// same tokens and experts, timed interleaved in the same run. On one GPU the "link" is HBM, so
// the ratio prices the pulls, pushes, signals and waits, not NVLink (docs/perf.md has the model
// of real EP). Forward, and forward + backward (saved z, bf16 weight gradients). --precision fp8:
// both layers blockwise FP8 (each rank's weights quantized once, before timing, as a training step
// quantizes them once per update).
//   usage: fusemoe_ep_bench [--preset NAME (fusemoe_bench's)] [--tokens N] [--ranks 2,4]
//                           [--routing uniform|skewed] [--precision bf16|fp8] [--iters N]
//                           [--warmup N] [--json PATH]
// Exit 0 ok, 2 bad arguments, 3 no sm_90 GPU, 4 runtime error.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "bench/options.h"
#include "common/call_inputs.h"
#include "common/device.h"
#include "common/device_buffer.h"
#include "common/device_checks.h"
#include "common/routing.h"
#include "common/timer.h"
#include "fusemoe/expert_parallel.h"
#include "fusemoe/fusemoe.h"

namespace {

using fusemoe::harness::DeviceBuffer;

// fusemoe_bench's preset of that name (bench/options.h), or null.
const fusemoe::bench::Preset* preset_named(const std::string& name) {
  for (const fusemoe::bench::Preset& preset : fusemoe::bench::kPresets) {
    if (name == preset.name) return &preset;
  }
  return nullptr;
}

fusemoe::LayerConfig layer_of(const std::string& preset, int64_t max_tokens, fusemoe::Precision precision) {
  fusemoe::LayerConfig l = fusemoe::harness::layer_config(*preset_named(preset), max_tokens);
  l.precision = precision;
  return l;
}

struct Options {
  std::string preset = fusemoe::bench::kPresets[0].name;
  int64_t tokens = 16384;
  std::vector<int> ranks = {2, 4};
  fusemoe::harness::Routing routing = fusemoe::harness::Routing::kUniform;
  fusemoe::Precision precision = fusemoe::Precision::kBf16;
  int iters = 20, warmup = 5;
  std::string json;
};

[[noreturn]] void usage(const std::string& error) {
  std::fprintf(stderr, "fusemoe_ep_bench: %s\nusage: fusemoe_ep_bench [--preset qwen3-30b-a3b|qwen3-235b-a22b|qwen3-next|deepseek-v3] "
               "[--tokens N] [--ranks 2,4] [--routing uniform|skewed] [--precision bf16|fp8] [--iters N] [--warmup N] "
               "[--json PATH]\n",
               error.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(flag + " needs a value");
      return argv[++i];
    };
    auto integer = [&](const std::string& text) -> int64_t {
      char* end = nullptr;
      const long long v = std::strtoll(text.c_str(), &end, 10);
      if (end == text.c_str() || *end != '\0' || v < 0) usage(flag + " needs a non-negative integer, got " + text);
      return v;
    };
    if (flag == "--preset") {
      o.preset = value();
      if (preset_named(o.preset) == nullptr) usage("unknown --preset " + o.preset);
    } else if (flag == "--tokens") {
      o.tokens = integer(value());
    } else if (flag == "--ranks") {
      o.ranks.clear();
      std::stringstream list(value());
      for (std::string item; std::getline(list, item, ',');) {
        const int r = static_cast<int>(integer(item));
        if (r != 1 && r != 2 && r != 4 && r != 8) usage("--ranks takes 1, 2, 4 or 8, got " + item);
        o.ranks.push_back(r);
      }
    } else if (flag == "--routing") {
      const std::string name = value();
      if (!fusemoe::harness::parse_routing(name, &o.routing)) usage("unknown --routing " + name);
    } else if (flag == "--precision") {
      const std::string name = value();
      if (name == "bf16") {
        o.precision = fusemoe::Precision::kBf16;
      } else if (name == "fp8") {
        o.precision = fusemoe::Precision::kFp8Blockwise;
      } else {
        usage("--precision takes bf16 or fp8, got " + name);
      }
    } else if (flag == "--iters") {
      o.iters = static_cast<int>(integer(value()));
    } else if (flag == "--warmup") {
      o.warmup = static_cast<int>(integer(value()));
    } else if (flag == "--json") {
      o.json = value();
    } else {
      usage("unknown argument " + flag);
    }
  }
  if (o.iters < 1) usage("--iters must be >= 1");
  return o;
}

// The whole batch on the device: x, dy, ids, weights, and every expert's weights.
struct Batch {
  fusemoe::LayerConfig layer;
  DeviceBuffer x, dy, idx, w, w13, w2;
  int64_t valid_rows = 0;
};

// Work of one layer call, forward only or forward + backward, on `stream`.
struct Call {
  std::function<void(cudaStream_t)> forward, forward_backward;
};

// One rank's device state; its inputs are views into the batch.
struct Rank {
  fusemoe::EpConfig config;
  int64_t first_token = 0, num_tokens = 0;
  DeviceBuffer y, dx, dtw, dw13, dw2, ws, saved, symmetric, fp8_weights;
  cudaStream_t stream = nullptr;
};

}  // namespace

int main(int argc, char** argv) {
  // Co-resident ranks wait on each other's kernels: a stream each its own hardware queue, and
  // every kernel loaded before the first launch (a lazy load can synchronise the context).
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  const Options o = parse(argc, argv);
  fusemoe::harness::GpuInfo gpu;
  std::string reason;
  if (!fusemoe::harness::find_sm90(&gpu, &reason)) {
    std::printf("fusemoe_ep_bench: no Hopper (sm_90) GPU: %s\n", reason.c_str());
    return 3;
  }
  try {
    const int64_t T = o.tokens;
    Batch b;
    b.layer = layer_of(o.preset, T, o.precision);
    const fusemoe::LayerConfig& l = b.layer;
    const fusemoe::harness::TopK topk = fusemoe::harness::make_topk(T, l.num_experts, l.top_k, o.routing, 1234);
    b.valid_rows = fusemoe::harness::routing_stats(topk.idx_TK, l.num_experts).valid_rows;
    b.x = DeviceBuffer(T * l.hidden * 2);
    b.dy = DeviceBuffer(T * l.hidden * 2);
    b.w13 = DeviceBuffer(l.num_experts * 2 * l.intermediate * l.hidden * 2);
    b.w2 = DeviceBuffer(l.num_experts * l.hidden * l.intermediate * 2);
    fusemoe::harness::fill_normal_bf16(b.x.get(), T * l.hidden, 1, 1.0f);
    fusemoe::harness::fill_normal_bf16(b.dy.get(), T * l.hidden, 2, 1.0f);
    fusemoe::harness::fill_normal_bf16(b.w13.get(), l.num_experts * 2 * l.intermediate * l.hidden, 3,
                                       1.0f / std::sqrt(static_cast<float>(l.hidden)));
    fusemoe::harness::fill_normal_bf16(b.w2.get(), l.num_experts * l.hidden * l.intermediate, 4,
                                       1.0f / std::sqrt(static_cast<float>(l.intermediate)));
    b.idx = DeviceBuffer::from(topk.idx_TK);
    b.w = DeviceBuffer::from(topk.w_TK);
    const double fwd_flops = 6.0 * l.hidden * l.intermediate * b.valid_rows;
    const double fwd_bwd_flops = 3.0 * fwd_flops;

    cudaStream_t main_stream = nullptr;
    FUSEMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&main_stream, cudaStreamNonBlocking));
    fusemoe::harness::EventTimer timer(main_stream);

    // The single-GPU fused layer on the whole batch.
    DeviceBuffer y(T * l.hidden * 2), dx(T * l.hidden * 2), dtw(T * l.top_k * 4), dw13(b.w13.bytes()),
        dw2(b.w2.bytes()), ws(fusemoe::workspace_bytes(l, fusemoe::Impl::kFused)),
        saved_z(fusemoe::saved_z_bytes(l));
    const bool fp8 = l.precision == fusemoe::Precision::kFp8Blockwise;
    DeviceBuffer fp8_weights(fp8 ? fusemoe::fp8_weights_bytes(l) : 0);
    if (fp8) {
      fusemoe::quantize_weights_fp8(l, b.w13.get(), b.w2.get(), fp8_weights.get(), fp8_weights.bytes(), main_stream);
    }
    // The fields both calls share: the batch's inputs, the one workspace, no id sync.
    auto with_inputs = [&](auto& a, cudaStream_t s) {
      fusemoe::harness::set_layer_inputs(a, b.x.get(), b.idx.as<int32_t>(), b.w.as<float>(), b.w13.get(),
                                         b.w2.get(), T, ws.get(), ws.bytes());
      a.sync_check_expert_ids = false;
      a.stream = s;
      a.fp8_weights = fp8_weights.get();  // null at bf16
    };
    auto single = [&](cudaStream_t s, bool backward) {
      fusemoe::ForwardArgs fa;
      with_inputs(fa, s);
      fa.y = y.get();
      fa.saved_z = backward ? saved_z.get() : nullptr;
      fusemoe::forward(l, fusemoe::Impl::kFused, fa);
      if (!backward) return;
      fusemoe::BackwardArgs ba;
      with_inputs(ba, s);
      ba.dy = b.dy.get();
      ba.dx = dx.get();
      ba.d_topk_weights = static_cast<float*>(dtw.get());
      ba.dw13 = dw13.get();
      ba.dw2 = dw2.get();
      ba.weight_grad_dtype = fusemoe::WeightGradDtype::kBFloat16;
      ba.saved_z = saved_z.get();
      fusemoe::backward(l, fusemoe::Impl::kFused, ba);
    };

    nlohmann::json results = nlohmann::json::array();
    std::printf("fusemoe_ep_bench: %s, %s, %s, %lld tokens in all, %s routing, %d SMs; co-resident ranks on ONE "
                "GPU (prices the protocol, not NVLink)\n",
                gpu.name.c_str(), o.preset.c_str(), fusemoe::precision_name(l.precision), static_cast<long long>(T),
                fusemoe::harness::routing_name(o.routing), gpu.sm_count);
    std::printf("%5s  %-16s %10s %10s %8s %12s\n", "ranks", "pass", "EP ms", "1-GPU ms", "EP/1GPU", "EP TFLOP/s");
    for (int R : o.ranks) {
      if (l.num_experts % R != 0 || T % R != 0) {
        std::printf("%5d  skipped: E and T must be divisible by the rank count\n", R);
        continue;
      }
      std::vector<Rank> ranks(R);
      std::vector<void*> peers(R);
      const int64_t El = l.num_experts / R, per_rank = T / R;
      for (int r = 0; r < R; ++r) {
        Rank& k = ranks[r];
        k.config.layer = layer_of(o.preset, per_rank, o.precision);
        k.config.world_size = R;
        k.config.rank = r;
        k.first_token = r * per_rank;
        k.num_tokens = per_rank;
        k.y = DeviceBuffer(per_rank * l.hidden * 2);
        k.dx = DeviceBuffer(per_rank * l.hidden * 2);
        k.dtw = DeviceBuffer(per_rank * l.top_k * 4);
        k.dw13 = DeviceBuffer(El * 2 * l.intermediate * l.hidden * 2);
        k.dw2 = DeviceBuffer(El * l.hidden * l.intermediate * 2);
        k.ws = DeviceBuffer(fusemoe::ep_workspace_bytes(k.config));
        k.saved = DeviceBuffer(fusemoe::ep_saved_state_bytes(k.config));
        k.symmetric = DeviceBuffer(fusemoe::ep_symmetric_bytes(k.config));
        if (fp8) {  // this rank's experts, quantized once
          k.fp8_weights = DeviceBuffer(fusemoe::ep_fp8_weights_bytes(k.config));
          fusemoe::ep_quantize_weights_fp8(
              k.config, b.w13.as<const uint16_t>() + r * El * 2 * l.intermediate * l.hidden,
              b.w2.as<const uint16_t>() + r * El * l.hidden * l.intermediate, k.fp8_weights.get(),
              k.fp8_weights.bytes(), nullptr);
        }
        FUSEMOE_CUDA_CHECK(cudaMemset(k.symmetric.get(), 0, k.symmetric.bytes()));
        FUSEMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&k.stream, cudaStreamNonBlocking));
        peers[r] = k.symmetric.get();
      }
      FUSEMOE_CUDA_CHECK(cudaDeviceSynchronize());
      // Elements (bf16) of one rank's share of w13 and w2: its El experts.
      const int64_t w13_per_rank = El * 2 * l.intermediate * l.hidden, w2_per_rank = El * l.hidden * l.intermediate;
      auto rank_call = [&](Rank& k, bool backward) {
        const uint16_t* x = b.x.as<const uint16_t>() + k.first_token * l.hidden;
        const int32_t* idx = b.idx.as<const int32_t>() + k.first_token * l.top_k;
        const float* w = b.w.as<const float>() + k.first_token * l.top_k;
        const uint16_t* w13 = b.w13.as<const uint16_t>() + k.config.rank * w13_per_rank;
        const uint16_t* w2 = b.w2.as<const uint16_t>() + k.config.rank * w2_per_rank;
        fusemoe::EpForwardArgs fa;
        fusemoe::EpCall& call = fa.call;
        fusemoe::harness::set_layer_inputs(call, x, idx, w, w13, w2, k.num_tokens, k.ws.get(), k.ws.bytes());
        call.peer_symmetric = peers.data();
        call.sync_check_expert_ids = false;  // one host thread drives every rank
        call.num_sms = gpu.sm_count / R;
        call.stream = k.stream;
        call.fp8_weights = k.fp8_weights.get();  // null at bf16
        fa.y = k.y.get();
        fa.saved_state = backward ? k.saved.get() : nullptr;
        fusemoe::ep_forward(k.config, fa);
        if (!backward) return;
        fusemoe::EpBackwardArgs ba;
        ba.call = call;
        ba.dy = b.dy.as<const uint16_t>() + k.first_token * l.hidden;
        ba.dx = k.dx.get();
        ba.d_topk_weights = static_cast<float*>(k.dtw.get());
        ba.dw13 = k.dw13.get();
        ba.dw2 = k.dw2.get();
        ba.weight_grad_dtype = fusemoe::WeightGradDtype::kBFloat16;
        ba.saved_state = fa.saved_state;
        fusemoe::ep_backward(k.config, ba);
      };
      // Every rank forks from the timer's stream and joins back to it: the time runs from the
      // first rank's start to the last rank's end.
      std::vector<cudaEvent_t> joined(R);
      cudaEvent_t fork;
      FUSEMOE_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
      for (auto& e : joined) FUSEMOE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      auto ep = [&](bool backward) {
        FUSEMOE_CUDA_CHECK(cudaEventRecord(fork, main_stream));
        for (int r = 0; r < R; ++r) {
          FUSEMOE_CUDA_CHECK(cudaStreamWaitEvent(ranks[r].stream, fork, 0));
          rank_call(ranks[r], backward);
          FUSEMOE_CUDA_CHECK(cudaEventRecord(joined[r], ranks[r].stream));
        }
        for (int r = 0; r < R; ++r) FUSEMOE_CUDA_CHECK(cudaStreamWaitEvent(main_stream, joined[r], 0));
      };
      const auto stats = timer.run_interleaved({[&] { ep(false); }, [&] { single(main_stream, false); },
                                                [&] { ep(true); }, [&] { single(main_stream, true); }},
                                               o.warmup, o.iters, /*flush_l2=*/true);
      FUSEMOE_CUDA_CHECK(cudaDeviceSynchronize());
      for (int pass = 0; pass < 2; ++pass) {
        const double ep_ms = stats[2 * pass].median_ms, one_ms = stats[2 * pass + 1].median_ms;
        const double flops = pass == 0 ? fwd_flops : fwd_bwd_flops;
        const char* name = pass == 0 ? "forward" : "forward+backward";
        std::printf("%5d  %-16s %10.3f %10.3f %8.3f %12.1f\n", R, name, ep_ms, one_ms, ep_ms / one_ms,
                    flops / (ep_ms * 1e-3) / 1e12);
        results.push_back({{"ranks", R}, {"pass", name}, {"ep_ms", ep_ms}, {"single_gpu_ms", one_ms},
                           {"ratio", ep_ms / one_ms}, {"ep_tflops", flops / (ep_ms * 1e-3) / 1e12},
                           {"single_gpu_tflops", flops / (one_ms * 1e-3) / 1e12}});
      }
      cudaEventDestroy(fork);
      for (auto& e : joined) cudaEventDestroy(e);
      for (Rank& k : ranks) cudaStreamDestroy(k.stream);
    }
    if (!o.json.empty()) {
      nlohmann::json doc = {{"tool", "fusemoe_ep_bench"}, {"gpu", gpu.name}, {"sm_count", gpu.sm_count},
                            {"preset", o.preset}, {"precision", fusemoe::precision_name(l.precision)},
                            {"tokens", T}, {"routing", fusemoe::harness::routing_name(o.routing)},
                            {"valid_rows", b.valid_rows}, {"iters", o.iters}, {"warmup", o.warmup},
                            {"mode", "co-resident ranks on one GPU"}, {"results", results}};
      std::ofstream(o.json) << doc.dump(2) << "\n";
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fusemoe_ep_bench: %s\n", e.what());
    return 4;
  }
  return 0;
}

#include "bench/run.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <stdexcept>
#include <utility>

#include "bench/checks.h"
#include "bench/kernel_times.h"
#include "common/call_inputs.h"
#include "common/device_checks.h"
#include "common/gpu_clocks.h"
#include "common/routing.h"
#include "common/timer.h"

namespace fusemoe::bench {
namespace {

// Inputs: x, dy ~ N(0, 1); w13 ~ N(0, 1/H) and w2 ~ N(0, 1/I) so that gate/up, h and each
// expert's output are O(1) and the errors compare on a natural scale.
LayerInputs make_inputs(const LayerConfig& c, uint64_t seed, cudaStream_t stream) {
  const LayerBufferBytes bytes = layer_buffer_bytes(c);
  LayerInputs in;
  const int64_t x_elems = c.max_tokens * c.hidden;
  const int64_t w13_elems = c.num_experts * 2 * c.intermediate * c.hidden;
  const int64_t w2_elems = c.num_experts * c.hidden * c.intermediate;
  in.x_TH = DeviceBuffer(bytes.x_TH);
  in.dy_TH = DeviceBuffer(bytes.x_TH);
  in.w13_EFH = DeviceBuffer(bytes.w13_EFH);
  in.w2_EHI = DeviceBuffer(bytes.w2_EHI);
  in.topk_idx_TK = DeviceBuffer(bytes.topk_idx_TK);
  in.topk_w_TK = DeviceBuffer(bytes.topk_w_TK);
  harness::fill_normal_bf16(in.x_TH.get(), x_elems, seed * 4 + 1, 1.0f, stream);
  harness::fill_normal_bf16(in.dy_TH.get(), x_elems, seed * 4 + 2, 1.0f, stream);
  harness::fill_normal_bf16(in.w13_EFH.get(), w13_elems, seed * 4 + 3, 1.0f / std::sqrt(static_cast<float>(c.hidden)),
                            stream);
  harness::fill_normal_bf16(in.w2_EHI.get(), w2_elems, seed * 4 + 4,
                            1.0f / std::sqrt(static_cast<float>(c.intermediate)), stream);
  return in;
}

struct TimingContext {
  const BenchParams& params;
  const LayerConfig& config;
  const LayerInputs& inputs;
  const LayerOutputs& outputs;
  const std::vector<DeviceBuffer>& workspaces;  // one per params.impls entry
  harness::EventTimer& timer;
  double ceiling_tflops;
  cudaStream_t stream;
  const harness::Nvml& nvml;
};

std::vector<TimingLine> time_case(const TimingContext& ctx, int64_t num_tokens, int64_t valid_rows,
                                  const std::string& label, std::vector<harness::ClockSummary>* impl_clocks) {
  struct Measurement {
    Pass pass;
    WeightGradDtype dtype;
  };
  // fp32 weight gradients are the default (what an optimizer keeps); bf16 is what a bf16
  // PyTorch model's autograd produces.
  constexpr Measurement kMeasurements[] = {
      {Pass::kForward, WeightGradDtype::kFloat32},
      {Pass::kBackward, WeightGradDtype::kFloat32},
      {Pass::kForwardBackward, WeightGradDtype::kFloat32},
      {Pass::kBackward, WeightGradDtype::kBFloat16},
      {Pass::kForwardBackward, WeightGradDtype::kBFloat16},
  };
  const double hi = static_cast<double>(ctx.config.hidden) * ctx.config.intermediate;
  // An implementation's passes run interleaved (EventTimer::run_interleaved): one round of all of
  // them per iteration, so no pass is timed on a hotter GPU than another (timed pass after pass,
  // the last-timed read 5-10% slow: docs/experiments.md#interleaved-timing). --timing interleaved
  // mixes the implementations into the same rounds; per-impl (the default) times them in turn;
  // per-pass gives every (pass, implementation) a block of its own, as the PyTorch and Liger
  // baselines time theirs (a block after a pause runs in the power cap's burst: the forward-only
  // block read 7-16% faster at 30B, docs/experiments.md#timed-against-traced).
  std::vector<std::function<void()>> ops;
  std::vector<size_t> op_impl;  // the implementation (index into params.impls) of each op
  std::vector<TimingLine> lines;
  for (const Measurement& m : kMeasurements) {
    for (size_t i = 0; i < ctx.params.impls.size(); ++i) {
      const BenchImpl& impl = ctx.params.impls[i];
      if (m.pass != Pass::kForward && !impl.has_backward) continue;
      TimingLine line;
      line.impl = impl.name;
      line.pass = m.pass;
      line.wgrad = m.pass == Pass::kForward ? "-" : wgrad_name(m.dtype);
      line.flops = flops_per_row_in_hi(m.pass) * hi * static_cast<double>(valid_rows);
      lines.push_back(line);
      op_impl.push_back(i);
      // The ops hold pointers to the context, the implementation and its workspace (alive for
      // the whole measurement), not references to locals of this loop.
      const TimingContext* c = &ctx;
      const BenchImpl* im = &impl;
      const DeviceBuffer* ws = &ctx.workspaces[i];
      auto forward = [c, im, ws, num_tokens]() {
        run_forward(c->config, *im, c->inputs, c->outputs, *ws, num_tokens, c->stream);
      };
      auto backward = [c, im, ws, num_tokens, m]() {
        run_backward(c->config, *im, c->inputs, c->outputs, *ws, num_tokens, m.dtype, c->stream);
      };
      switch (m.pass) {
        case Pass::kForward: ops.push_back(forward); break;
        case Pass::kBackward: ops.push_back(backward); break;
        case Pass::kForwardBackward:
          ops.push_back([forward, backward]() {
            forward();
            backward();
          });
          break;
      }
    }
  }
  std::vector<harness::TimingStats> stats(ops.size());
  if (ctx.params.timing == TimingMode::kInterleaved) {
    std::fprintf(stderr, "[bench] %s: timing %zu (pass, implementation) pairs, interleaved ...\n", label.c_str(),
                 ops.size());
    stats = ctx.timer.run_interleaved(ops, ctx.params.warmup, ctx.params.iters, /*flush_l2=*/true,
                                      ctx.params.warmup_ms);
  } else {
    for (size_t i = 0; i < ctx.params.impls.size(); ++i) {
      std::vector<std::function<void()>> own;
      std::vector<size_t> where;
      for (size_t k = 0; k < ops.size(); ++k) {
        if (op_impl[k] == i) {
          own.push_back(ops[k]);
          where.push_back(k);
        }
      }
      std::fprintf(stderr, "[bench] %s: timing %s alone, its %zu passes interleaved ...\n", label.c_str(),
                   ctx.params.impls[i].name, own.size());
      harness::ClockSampler sampler(ctx.nvml);
      if (ctx.params.timing == TimingMode::kPerPass) {
        for (size_t j = 0; j < where.size(); ++j) {
          stats[where[j]] = ctx.timer.run_interleaved({own[j]}, ctx.params.warmup, ctx.params.iters, /*flush_l2=*/true,
                                                      ctx.params.warmup_ms).front();
        }
      } else {
        const std::vector<harness::TimingStats> own_stats = ctx.timer.run_interleaved(
            own, ctx.params.warmup, ctx.params.iters, /*flush_l2=*/true, ctx.params.warmup_ms);
        for (size_t j = 0; j < where.size(); ++j) stats[where[j]] = own_stats[j];
      }
      impl_clocks->push_back(sampler.stop());
    }
  }
  for (size_t k = 0; k < lines.size(); ++k) {
    TimingLine& line = lines[k];
    line.stats = stats[k];
    line.tflops = line.flops / (line.stats.median_ms * 1e-3) / 1e12;
    line.pct_ceiling = 100.0 * line.tflops / ctx.ceiling_tflops;
  }
  // Listed implementation by implementation.
  auto rank = [&](const std::string& name) {
    for (size_t i = 0; i < ctx.params.impls.size(); ++i) {
      if (name == ctx.params.impls[i].name) return i;
    }
    return ctx.params.impls.size();
  };
  std::stable_sort(lines.begin(), lines.end(),
                   [&](const TimingLine& a, const TimingLine& b) { return rank(a.impl) < rank(b.impl); });
  // Speedups against the first implementation listed, same pass and weight-gradient dtype.
  for (TimingLine& line : lines) {
    for (const TimingLine& base : lines) {
      if (base.impl == ctx.params.impls[0].name && base.pass == line.pass && base.wgrad == line.wgrad) {
        line.speedup_vs_first = base.stats.median_ms / line.stats.median_ms;
      }
    }
  }
  return lines;
}

// Minimum warm-up before the traced calls; the burst after a pause lasted under 100 ms here.
constexpr double kTracedWarmupMs = 500.0;

// --kernel-times: each implementation's calls again as fwd+bwd is timed (L2 flush, forward,
// backward with bf16 weight gradients), `warmup` untraced (and kTracedWarmupMs) then `iters`
// traced, one tag per pass and call; the kernels of each pass from CUPTI's records. After the
// timings, so CUPTI's bookkeeping never touches a timed call.
void trace_kernels(const TimingContext& ctx, int64_t num_tokens, const std::string& label, CaseResult* c) {
  std::string why;
  const std::unique_ptr<KernelTracer> tracer = KernelTracer::start(&why);
  if (!tracer) {
    c->kernel_times_status = "not traced: " + why;
    std::fprintf(stderr, "[bench] %s: kernels not traced: %s\n", label.c_str(), why.c_str());
    return;
  }
  // Events around each traced pass, recorded as the timed loop records them, so the kernels'
  // span and the events of the same calls can be compared (PassKernels::event_median_us).
  struct OwnedEvents {  // destroyed on every way out of this function
    std::vector<cudaEvent_t> all;
    ~OwnedEvents() {
      for (cudaEvent_t e : all) cudaEventDestroy(e);
    }
  } events;
  auto new_event = [&] {
    cudaEvent_t e = nullptr;
    FUSEMOE_CUDA_CHECK(cudaEventCreate(&e));
    events.all.push_back(e);
    return e;
  };
  auto event_median_us = [](const std::vector<std::pair<cudaEvent_t, cudaEvent_t>>& pairs) {
    if (pairs.empty()) return 0.0;
    std::vector<float> ms(pairs.size());
    for (size_t k = 0; k < pairs.size(); ++k) {
      FUSEMOE_CUDA_CHECK(cudaEventElapsedTime(&ms[k], pairs[k].first, pairs[k].second));
    }
    return 1e3 * harness::summarize(std::move(ms)).median_ms;
  };
  try {
    for (size_t i = 0; i < ctx.params.impls.size(); ++i) {
      const BenchImpl& impl = ctx.params.impls[i];
      const DeviceBuffer& workspace = ctx.workspaces[i];
      std::fprintf(stderr, "[bench] %s: tracing the kernels of %s ...\n", label.c_str(), impl.name);
      std::vector<uint64_t> forward_tags, backward_tags;
      std::vector<std::pair<cudaEvent_t, cudaEvent_t>> forward_events, backward_events;
      harness::ClockSampler sampler(ctx.nvml);
      // Untraced calls first: --warmup of them, then more until kTracedWarmupMs (or --warmup-ms,
      // if longer) has passed, so the traced calls run in the state the timed ones held and not
      // in the power cap's short allowance after a pause (CUPTI's start is one): without it they
      // ran 5-15% faster than the timed ones at 30B T=4096 (docs/perf.md#kernels-inside-the-layer).
      const double min_warm_ms = std::max(kTracedWarmupMs, ctx.params.warmup_ms);
      const auto warm_start = std::chrono::steady_clock::now();
      auto warm_ms = [&] {
        FUSEMOE_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
        return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - warm_start).count();
      };
      // One pass of one call; traced, it runs under its CUPTI tag and between its events.
      auto run_pass = [&](bool traced, uint64_t tag, const std::function<void()>& pass, std::vector<uint64_t>& tags,
                          std::vector<std::pair<cudaEvent_t, cudaEvent_t>>& pass_events) {
        if (!traced) {
          pass();
          return;
        }
        tracer->push(tag);
        pass_events.emplace_back(new_event(), new_event());
        FUSEMOE_CUDA_CHECK(cudaEventRecord(pass_events.back().first, ctx.stream));
        pass();
        FUSEMOE_CUDA_CHECK(cudaEventRecord(pass_events.back().second, ctx.stream));
        tracer->pop();
        tags.push_back(tag);
      };
      auto run_call = [&](int call, bool traced) {
        const uint64_t tag = (static_cast<uint64_t>(i) << 32) | (static_cast<uint64_t>(call) << 1);
        ctx.timer.flush_l2(call);
        run_pass(
            traced, tag, [&] { run_forward(ctx.config, impl, ctx.inputs, ctx.outputs, workspace, num_tokens, ctx.stream); },
            forward_tags, forward_events);
        if (!impl.has_backward) return;
        run_pass(
            traced, tag | 1,
            [&] {
              run_backward(ctx.config, impl, ctx.inputs, ctx.outputs, workspace, num_tokens, WeightGradDtype::kBFloat16,
                           ctx.stream);
            },
            backward_tags, backward_events);
      };
      int call = 0;
      for (; call < ctx.params.warmup; ++call) run_call(call, false);
      while (warm_ms() < min_warm_ms) run_call(call++, false);
      for (int traced = 0; traced < ctx.params.iters; ++traced) run_call(call++, true);
      uint64_t dropped = 0, untagged = 0;
      const std::vector<KernelRecord> records = tracer->take(&dropped, &untagged);  // waits for the device
      c->traced_clocks.push_back(sampler.stop());
      if (dropped > 0) throw std::runtime_error("CUPTI dropped " + std::to_string(dropped) + " records");
      // Every traced call launches kernels (T > 0): none tagged means the tags did not reach them.
      if (records.empty() && num_tokens > 0) {
        throw std::runtime_error("no kernel record carried a call's tag (" + std::to_string(untagged) +
                                 " kernel records without one)");
      }
      auto add_pass = [&](const std::vector<uint64_t>& tags, const std::vector<std::pair<cudaEvent_t, cudaEvent_t>>& ev,
                          const char* pass, const char* wgrad) {
        PassKernels kernels = summarize_pass(records, tags);
        kernels.impl = impl.name;
        kernels.pass = pass;
        kernels.wgrad = wgrad;
        kernels.event_median_us = event_median_us(ev);
        c->kernel_times.push_back(kernels);
      };
      add_pass(forward_tags, forward_events, "forward", "-");
      if (impl.has_backward) add_pass(backward_tags, backward_events, "backward", wgrad_name(WeightGradDtype::kBFloat16));
    }
  } catch (const std::exception& e) {
    c->kernel_times_status = std::string("failed: ") + e.what();
    std::fprintf(stderr, "[bench] %s: kernel tracing failed: %s\n", label.c_str(), e.what());
    return;
  }
  c->kernel_times_status = "traced";
}

}  // namespace

LayerOutputs::LayerOutputs(const LayerConfig& c, bool save_z) {
  const LayerBufferBytes bytes = layer_buffer_bytes(c);
  y_TH = DeviceBuffer(bytes.x_TH);
  dx_TH = DeviceBuffer(bytes.x_TH);
  d_topk_w_TK = DeviceBuffer(bytes.topk_w_TK);
  dw13_EFH = DeviceBuffer(bytes.dw13_EFH);
  dw2_EHI = DeviceBuffer(bytes.dw2_EHI);
  saved_z_SF = DeviceBuffer(save_z ? bytes.saved_z : 0);
}

void LayerOutputs::poison(cudaStream_t stream) const {
  for (const DeviceBuffer* buffer : {&y_TH, &dx_TH, &d_topk_w_TK, &dw13_EFH, &dw2_EHI, &saved_z_SF}) {
    buffer->poison(stream);
  }
}

LayerConfig impl_config(const LayerConfig& config, const BenchImpl& impl) {
  LayerConfig c = config;
  c.precision = impl.precision;
  c.fp8_weight_grads = impl.fp8_weight_grads;
  return c;
}

DeviceBuffer allocate_workspace(const LayerConfig& config, const BenchImpl& impl) {
  return DeviceBuffer(bench_workspace_bytes(config, impl));
}

ExpertFit fit_to_device(BenchParams* params, size_t flush_bytes) {
  size_t free_bytes = 0, total_bytes = 0;
  FUSEMOE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const ExpertFit fit = fit_experts(*params, flush_bytes, free_bytes);
  params->preset.num_experts = fit.num_experts;
  return fit;
}

namespace {

// The fields ForwardArgs and BackwardArgs share.
template <typename Args>
Args layer_args(const BenchImpl& impl, const LayerInputs& in, const LayerOutputs& out, const DeviceBuffer& workspace,
                int64_t num_tokens, cudaStream_t stream) {
  Args args;
  harness::set_layer_inputs(args, in.x_TH.get(), in.topk_idx_TK.as<int32_t>(), in.topk_w_TK.as<float>(),
                            in.w13_EFH.get(), in.w2_EHI.get(), num_tokens, workspace.get(), workspace.bytes());
  args.stream = stream;
  // As a training loop runs: no per-call sync; the correctness check calls check_expert_ids().
  args.sync_check_expert_ids = false;
  args.saved_z = out.saved_z(impl);  // the backward's: written by the forward of these inputs just before
  // Null at bf16: the library refuses a buffer it would not read.
  args.fp8_weights = impl.precision == Precision::kFp8Blockwise ? in.fp8_weights.get() : nullptr;
  if (impl.separate_gate_up) {
    args.w13 = nullptr;
    args.w1 = in.w1_EIH.get();
    args.w3 = in.w3_EIH.get();
  }
  return args;
}

}  // namespace

void run_forward(const LayerConfig& config, const BenchImpl& impl, const LayerInputs& in, const LayerOutputs& out,
                 const DeviceBuffer& workspace, int64_t num_tokens, cudaStream_t stream) {
  ForwardArgs args = layer_args<ForwardArgs>(impl, in, out, workspace, num_tokens, stream);
  args.y = out.y_TH.get();
  forward(impl_config(config, impl), impl.impl, args);
}

void run_backward(const LayerConfig& config, const BenchImpl& impl, const LayerInputs& in, const LayerOutputs& out,
                  const DeviceBuffer& workspace, int64_t num_tokens, WeightGradDtype weight_grad_dtype,
                  cudaStream_t stream) {
  BackwardArgs args = layer_args<BackwardArgs>(impl, in, out, workspace, num_tokens, stream);
  args.dy = in.dy_TH.get();
  args.dx = out.dx_TH.get();
  args.d_topk_weights = out.d_topk_w_TK.as<float>();
  args.dw13 = out.dw13_EFH.get();
  if (impl.separate_gate_up) {
    args.dw13 = nullptr;
    // dw1 then dw3 fill dw13's buffer from its start (check_case compares them so).
    const size_t elem_bytes = weight_grad_dtype == WeightGradDtype::kFloat32 ? 4 : 2;
    args.dw1 = out.dw13_EFH.get();
    args.dw3 = static_cast<char*>(out.dw13_EFH.get()) +
               static_cast<size_t>(config.num_experts) * config.intermediate * config.hidden * elem_bytes;
  }
  args.dw2 = out.dw2_EHI.get();
  args.weight_grad_dtype = weight_grad_dtype;
  args.accumulate_weight_grads = false;
  backward(impl_config(config, impl), impl.impl, args);
}

void split_gate_up(const LayerConfig& config, const void* src, void* gate, void* up, size_t elem_bytes,
                   cudaStream_t stream) {
  const size_t half_bytes = static_cast<size_t>(config.intermediate) * config.hidden * elem_bytes;
  const auto* bytes = static_cast<const char*>(src);
  // One 2D copy per half: E rows of I*H elements, 2I*H elements apart in src.
  FUSEMOE_CUDA_CHECK(cudaMemcpy2DAsync(gate, half_bytes, bytes, 2 * half_bytes, half_bytes, config.num_experts,
                                       cudaMemcpyDeviceToDevice, stream));
  FUSEMOE_CUDA_CHECK(cudaMemcpy2DAsync(up, half_bytes, bytes + half_bytes, 2 * half_bytes, half_bytes,
                                       config.num_experts, cudaMemcpyDeviceToDevice, stream));
}

const char* wgrad_name(WeightGradDtype dtype) { return dtype == WeightGradDtype::kFloat32 ? "fp32" : "bf16"; }

bool run_bench(const BenchParams& params, BenchResult& result) {
  cudaStream_t stream = nullptr;
  FUSEMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { cudaStreamDestroy(s); }
  } stream_guard{stream};

  const Preset& preset = params.preset;
  LayerConfig config = harness::layer_config(preset, *std::max_element(params.tokens.begin(), params.tokens.end()));
  validate_config(config);

  harness::EventTimer timer(stream);
  const harness::Nvml nvml;  // the current device's clocks, sampled while each case is timed
  std::fprintf(stderr, "[bench] measuring the bf16 GEMM ceiling ...\n");
  result.ceiling = measure_gemm_ceiling(stream, timer, params.seed);
  std::printf("bf16 GEMM ceiling: %.1f TFLOP/s, %.3f ms median (%s)\n", result.ceiling.tflops,
              result.ceiling.stats.median_ms, result.ceiling.what.c_str());
  std::fflush(stdout);

  std::fprintf(stderr, "[bench] %s: generating inputs for up to T=%lld ...\n", preset.short_name,
               static_cast<long long>(config.max_tokens));
  LayerInputs inputs = make_inputs(config, params.seed, stream);
  if (std::any_of(params.impls.begin(), params.impls.end(),
                  [](const BenchImpl& impl) { return impl.precision == Precision::kFp8Blockwise; })) {
    LayerConfig fp8 = config;
    fp8.precision = Precision::kFp8Blockwise;
    inputs.fp8_weights = DeviceBuffer(fp8_weights_bytes(fp8));
    quantize_weights_fp8(fp8, inputs.w13_EFH.get(), inputs.w2_EHI.get(), inputs.fp8_weights.get(),
                         inputs.fp8_weights.bytes(), stream);
  }
  if (std::any_of(params.impls.begin(), params.impls.end(),
                  [](const BenchImpl& impl) { return impl.separate_gate_up; })) {
    const size_t half_bytes = layer_buffer_bytes(config).w13_EFH / 2;
    inputs.w1_EIH = DeviceBuffer(half_bytes);
    inputs.w3_EIH = DeviceBuffer(half_bytes);
    split_gate_up(config, inputs.w13_EFH.get(), inputs.w1_EIH.get(), inputs.w3_EIH.get(), 2, stream);
  }
  const bool any_saves_z =
      std::any_of(params.impls.begin(), params.impls.end(), [](const BenchImpl& impl) { return impl.save_z; });
  const LayerOutputs outputs(config, any_saves_z);
  std::vector<DeviceBuffer> workspaces;
  for (const BenchImpl& impl : params.impls) workspaces.push_back(allocate_workspace(config, impl));

  // The reference and its outputs exist only while some token count is checked; its config
  // is sized for the largest checked T so a skipped large T does not inflate its workspace.
  LayerConfig reference_config = config;
  reference_config.max_tokens = reference_max_tokens(params);
  DeviceBuffer reference_workspace;
  std::unique_ptr<LayerOutputs> reference_outputs;
  if (reference_config.max_tokens > 0) {
    reference_workspace = allocate_workspace(reference_config, kReferenceImpl);
    reference_outputs = std::make_unique<LayerOutputs>(reference_config, false);
  }

  const TimingContext ctx{params, config, inputs, outputs, workspaces, timer, result.ceiling.tflops, stream, nvml};
  bool all_pass = true;
  for (int64_t num_tokens : params.tokens) {
    const std::string label = std::string(preset.short_name) + " T=" + std::to_string(num_tokens);
    result.cases.emplace_back();
    CaseResult& c = result.cases.back();
    c.num_tokens = num_tokens;
    const harness::TopK topk =
        harness::make_topk(num_tokens, config.num_experts, config.top_k, params.routing, params.seed);
    c.routing = harness::routing_stats(topk.idx_TK, config.num_experts);
    FUSEMOE_CUDA_CHECK(cudaMemcpyAsync(inputs.topk_idx_TK.get(), topk.idx_TK.data(),
                                       topk.idx_TK.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
    FUSEMOE_CUDA_CHECK(cudaMemcpyAsync(inputs.topk_w_TK.get(), topk.w_TK.data(), topk.w_TK.size() * sizeof(float),
                                       cudaMemcpyHostToDevice, stream));
    FUSEMOE_CUDA_CHECK(cudaStreamSynchronize(stream));

    if (!params.check) {
      c.check_status = "skipped (--no-check)";
    } else if (num_tokens > params.check_max_tokens) {
      c.check_status = "skipped (T > --check-max-tokens " + std::to_string(params.check_max_tokens) + ")";
    } else {
      c.checks = check_case(config, reference_config, params.impls, workspaces, reference_workspace, inputs, outputs,
                            *reference_outputs, num_tokens, label, stream);
      const bool pass =
          std::all_of(c.checks.begin(), c.checks.end(), [](const CheckLine& line) { return line.pass; });
      c.check_status = pass ? "pass" : "FAIL";
      all_pass = all_pass && pass;
    }
    {
      harness::ClockSampler sampler(nvml);
      c.timings = time_case(ctx, num_tokens, c.routing.valid_rows, label, &c.impl_clocks);
      c.clocks = sampler.stop();
    }
    if (params.kernel_times) trace_kernels(ctx, num_tokens, label, &c);
    print_case(params, result, c);
    std::fflush(stdout);
  }
  return all_pass;
}

}  // namespace fusemoe::bench

// Shared helpers of the layer-level GPU suites: random bf16 problems with the named routings of
// tests/common/routing.h, a runner that drives one implementation through the public API with
// outputs and workspace poisoned with NaN (0xFF bytes) before every call (tests/common device
// buffers), and error statistics (relative L2, max abs, DeepGEMM calc_diff).
// Shape legend: T tokens, H hidden, I intermediate, E experts, K top-k.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common/call_inputs.h"
#include "common/device_buffer.h"
#include "common/layer_config.h"
#include "common/routing.h"
#include "fusemoe/fusemoe.h"
#include "reference/bf16_host.h"
#include "reference/moe_reference.h"

namespace fusemoe::test {

#define TEST_CUDA(expr) FUSEMOE_CUDA_CHECK(expr)

struct Dims {
  int64_t T = 0, H = 256, I = 128, E = 8, K = 2;
  bool clamp = false;
  float clamp_limit = 0.0f;
};

// The shapes the suites share: "small" (Dims' defaults: H 256, I 128, E 8, K 2), "medium"
// (several 128-row tiles per expert, 16 experts, top-4) and the Qwen3-30B-A3B layer (all 128 experts).
inline Dims small_dims(int64_t tokens) { return Dims{tokens}; }
inline Dims medium_dims(int64_t tokens) { return Dims{tokens, 512, 256, 16, 4}; }
inline Dims qwen3_30b_dims(int64_t tokens) {
  const harness::LayerShape& s = harness::kQwen3_30bA3b;
  return Dims{tokens, s.hidden, s.intermediate, s.num_experts, s.top_k};
}
// Qwen3-Next's layer (H 2048, I 512, 512 experts, top-10): E >= 256, so the forward's gate/up and
// down take the dynamic tile order (sm90_forward_dynamic_tile_order).
inline Dims qwen3_next_dims(int64_t tokens) {
  const harness::LayerShape& s = harness::kQwen3Next;
  return Dims{tokens, s.hidden, s.intermediate, s.num_experts, s.top_k};
}
// Qwen3-235B-A22B's H, I and top-k with num_experts experts: all 128 where the oracle is the fp32
// GPU reference (test_fused_forward), fewer where a host-side fp64 check's copies of the weights
// and their gradients must stay within memory.
inline Dims qwen3_235b_dims(int64_t tokens, int64_t num_experts) {
  const harness::LayerShape& s = harness::kQwen3_235bA22b;
  return Dims{tokens, s.hidden, s.intermediate, num_experts, s.top_k};
}

// The default layer with the SwiGLU clamp at c = 1.25: on z ~ N(0, 1) it is active on ~11% of g
// (g > c) and ~21% of u (|u| > c).
inline Dims clamp_dims(int64_t tokens) {
  Dims d;
  d.T = tokens;
  d.clamp = true;
  d.clamp_limit = 1.25f;
  return d;
}

// The default layer (E = 8) with top_k = k: 1 and 8 (= E) are the edge cases.
inline Dims top_k_dims(int64_t tokens, int64_t k) {
  Dims d;
  d.T = tokens;
  d.K = k;
  return d;
}

using harness::DeviceBuffer;
using harness::kAllRoutings;
using harness::Routing;
using harness::routing_name;

// Test names of (tokens, routing) suites: "T199_masked".
inline std::string token_routing_name(
    const ::testing::TestParamInfo<std::tuple<int64_t, Routing>>& info) {
  return "T" + std::to_string(std::get<0>(info.param)) + "_" + routing_name(std::get<1>(info.param));
}

struct HostProblem {
  Dims d;
  std::vector<uint16_t> x_TH, w13_EFH, w2_EHI, dy_TH;  // bf16 bits
  std::vector<int32_t> idx_TK;
  std::vector<float> w_TK;
};

// N(0, stddev^2) values rounded to bf16. Large tensors (full-size expert weights are ~10^9
// values) are filled by several threads, chunk c from its own generator seeded (base, c), so
// the result depends only on the seed, not on the thread count.
inline std::vector<uint16_t> random_bf16(size_t n, double stddev, std::mt19937_64& rng) {
  constexpr size_t kChunk = size_t(1) << 20;
  const uint64_t base_seed = rng();
  std::vector<uint16_t> out(n);
  const size_t num_chunks = (n + kChunk - 1) / kChunk;
  auto fill_chunks = [&](size_t first, size_t step) {
    for (size_t c = first; c < num_chunks; c += step) {
      std::mt19937_64 chunk_rng(base_seed ^ (0x9E3779B97F4A7C15ull * (c + 1)));
      std::normal_distribution<float> dist(0.0f, static_cast<float>(stddev));
      const size_t end = std::min(n, (c + 1) * kChunk);
      for (size_t i = c * kChunk; i < end; ++i) out[i] = host::float_to_bf16_bits(dist(chunk_rng));
    }
  };
  const size_t num_threads =
      std::min<size_t>(num_chunks, std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> threads;
  for (size_t t = 1; t < num_threads; ++t) threads.emplace_back(fill_chunks, t, num_threads);
  fill_chunks(0, std::max<size_t>(num_threads, 1));
  for (auto& t : threads) t.join();
  return out;
}

inline HostProblem make_problem(const Dims& d, Routing routing, uint64_t seed) {
  std::mt19937_64 rng(seed);
  HostProblem p;
  p.d = d;
  p.x_TH = random_bf16(d.T * d.H, 1.0, rng);
  p.w13_EFH = random_bf16(d.E * 2 * d.I * d.H, 1.0 / std::sqrt(double(d.H)), rng);
  p.w2_EHI = random_bf16(d.E * d.H * d.I, 1.0 / std::sqrt(double(d.I)), rng);
  p.dy_TH = random_bf16(d.T * d.H, 1.0, rng);
  harness::TopK topk = harness::make_topk(d.T, d.E, d.K, routing, rng());
  p.idx_TK = std::move(topk.idx_TK);
  p.w_TK = std::move(topk.w_TK);
  return p;
}

// The (tokens, routing) suites over the small shape: a case's problem (seed seed_base + T), its
// parameters printed first.
class SmallProblemTest : public ::testing::TestWithParam<std::tuple<int64_t, Routing>> {
 protected:
  HostProblem small_problem(uint64_t seed_base) const {
    const auto [tokens, routing] = GetParam();
    std::printf("T=%lld routing=%s\n", static_cast<long long>(tokens), routing_name(routing));
    return make_problem(small_dims(tokens), routing, seed_base + tokens);
  }
};

// The invalid-id problem every implementation's tests use: default dims, T = 33, uniform
// routing, with (token 17, slot 1) = E (one past the end) and (token 20, slot 0) = -7, so the
// report names "token 17, slot 1, value 8" (E = 8) and counts 2 bad ids.
inline HostProblem make_problem_with_bad_ids(uint64_t seed) {
  Dims d;
  d.T = 33;
  HostProblem p = make_problem(d, Routing::kUniform, seed);
  p.idx_TK[17 * d.K + 1] = static_cast<int32_t>(d.E);
  p.idx_TK[20 * d.K + 0] = -7;
  return p;
}

inline std::vector<double> widen(const std::vector<uint16_t>& bits) {
  std::vector<double> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = host::bf16_bits_to_float(bits[i]);
  return out;
}

inline reference::Problem to_reference(const HostProblem& p) {
  reference::Problem r;
  r.num_tokens = p.d.T;
  r.hidden = p.d.H;
  r.intermediate = p.d.I;
  r.num_experts = p.d.E;
  r.top_k = p.d.K;
  r.use_swiglu_clamp = p.d.clamp;
  r.swiglu_clamp = p.d.clamp_limit;
  r.x_TH = widen(p.x_TH);
  r.topk_idx_TK = p.idx_TK;
  r.topk_w_TK.assign(p.w_TK.begin(), p.w_TK.end());
  r.w13_EFH = widen(p.w13_EFH);
  r.w2_EHI = widen(p.w2_EHI);
  return r;
}

// Outputs of one forward + backward, widened to double for comparison.
struct LayerOutputs {
  std::vector<double> y, dx, d_topk_w, dw13, dw2;
};

// Every output of a equals b's (operator== of the widened values: a NaN never equals).
inline bool same_outputs(const LayerOutputs& a, const LayerOutputs& b) {
  return a.y == b.y && a.dx == b.dx && a.d_topk_w == b.d_topk_w && a.dw13 == b.dw13 && a.dw2 == b.dw2;
}

// As same_outputs, one expectation per output, each failure naming the output and `what`.
inline void expect_same_outputs(const LayerOutputs& a, const LayerOutputs& b, const std::string& what) {
  EXPECT_TRUE(a.y == b.y) << what << ": y differs";
  EXPECT_TRUE(a.dx == b.dx) << what << ": dx differs";
  EXPECT_TRUE(a.d_topk_w == b.d_topk_w) << what << ": d_topk_weights differ";
  EXPECT_TRUE(a.dw13 == b.dw13) << what << ": dw13 differs";
  EXPECT_TRUE(a.dw2 == b.dw2) << what << ": dw2 differs";
}

struct RunOptions {
  WeightGradDtype grad_dtype = WeightGradDtype::kFloat32;
  bool accumulate = false;
  const std::vector<float>* dw13_init = nullptr;  // used when accumulate
  const std::vector<float>* dw2_init = nullptr;
  int32_t* expert_id_report = nullptr;  // passed to both calls
  bool save_z = false;  // Impl::kFused: the forward saves z, the backward reads it
  // kFp8Blockwise (Impl::kFused): the weights are quantized through the API first and the calls
  // get the FP8 buffer with null bf16 weights (an FP8 call must not read them).
  Precision precision = Precision::kBf16;
  bool fp8_weight_grads = false;  // LayerConfig::fp8_weight_grads
  // The calls get w1 and w3 [E, I, H] (w13's gate and up rows, copied apart on the host) instead of
  // w13 (FP8: quantized from them), and write dw1 and dw3 instead of dw13. LayerOutputs::dw13 is then
  // rebuilt from dw1 and dw3 on the host, so outputs of either form compare directly.
  bool separate_weights = false;
  bool separate_grads = false;
  // Frozen weights: the backward gets null gate/up gradient outputs (dw13, or dw1 and dw3) or a
  // null dw2. Their buffers stay as poisoned (NaN) unless the call writes them anyway.
  bool frozen_gate_up = false;
  bool frozen_down = false;
};

// Rows [row0, row0 + rows) of each expert's [rows_per_expert, cols] matrix of `all` (any element type).
template <typename T>
std::vector<T> expert_rows(const std::vector<T>& all, int64_t num_experts, int64_t rows_per_expert, int64_t row0,
                           int64_t rows, int64_t cols) {
  std::vector<T> out;
  out.reserve(num_experts * rows * cols);
  for (int64_t e = 0; e < num_experts; ++e) {
    const auto first = all.begin() + (e * rows_per_expert + row0) * cols;
    out.insert(out.end(), first, first + rows * cols);
  }
  return out;
}

// w13's layout [E, 2I, H] from gate [E, I, H] and up [E, I, H].
template <typename T>
std::vector<T> concatenate_gate_up(const std::vector<T>& gate, const std::vector<T>& up, int64_t num_experts,
                                   int64_t intermediate, int64_t hidden) {
  std::vector<T> out;
  out.reserve(gate.size() + up.size());
  const int64_t expert_elems = intermediate * hidden;
  for (int64_t e = 0; e < num_experts; ++e) {
    out.insert(out.end(), gate.begin() + e * expert_elems, gate.begin() + (e + 1) * expert_elems);
    out.insert(out.end(), up.begin() + e * expert_elems, up.begin() + (e + 1) * expert_elems);
  }
  return out;
}

inline LayerConfig config_of(const Dims& d, int64_t max_tokens) {
  LayerConfig c = harness::layer_config(d.H, d.I, d.E, d.K, max_tokens);
  c.use_swiglu_clamp = d.clamp;
  c.swiglu_clamp = d.clamp_limit;
  return c;
}

inline std::vector<double> widen_grad(const DeviceBuffer& b, WeightGradDtype dtype) {
  if (dtype == WeightGradDtype::kBFloat16) return widen(b.to_host<uint16_t>());
  const auto f = b.to_host<float>();
  return std::vector<double>(f.begin(), f.end());
}

// Device copies of a problem's inputs.
struct DeviceInputs {
  DeviceBuffer x, w13, w2, dy, idx, w;

  explicit DeviceInputs(const HostProblem& p)
      : x(DeviceBuffer::from(p.x_TH)),
        w13(DeviceBuffer::from(p.w13_EFH)),
        w2(DeviceBuffer::from(p.w2_EHI)),
        dy(DeviceBuffer::from(p.dy_TH)),
        idx(DeviceBuffer::from(p.idx_TK)),
        w(DeviceBuffer::from(p.w_TK)) {}

  // The fields ForwardArgs and BackwardArgs share (BackwardArgs::dy is set too where it exists).
  template <typename Args>
  Args args(int64_t num_tokens, const DeviceBuffer& workspace) const {
    Args a;
    harness::set_layer_inputs(a, x.get(), idx.as<int32_t>(), w.as<float>(), w13.get(), w2.get(), num_tokens,
                              workspace.get(), workspace.bytes());
    if constexpr (std::is_same_v<Args, BackwardArgs>) a.dy = dy.get();
    return a;
  }
};

// The FP8 weight buffer of w13 and w2 (poisoned first), quantized through the API.
inline DeviceBuffer quantized_weights(const LayerConfig& config, const DeviceBuffer& w13, const DeviceBuffer& w2) {
  DeviceBuffer buffer(fp8_weights_bytes(config));
  buffer.poison();
  quantize_weights_fp8(config, w13.get(), w2.get(), buffer.get(), buffer.bytes(), nullptr);
  return buffer;
}

// The same from separate gate and up weights w1, w3.
inline DeviceBuffer quantized_weights(const LayerConfig& config, const DeviceBuffer& w1, const DeviceBuffer& w3,
                                      const DeviceBuffer& w2) {
  DeviceBuffer buffer(fp8_weights_bytes(config));
  buffer.poison();
  quantize_weights_fp8(config, w1.get(), w3.get(), w2.get(), buffer.get(), buffer.bytes(), nullptr);
  return buffer;
}

// Runs forward then backward of `impl` through the public API with every output and the
// workspace poisoned first. max_tokens may exceed T (the workspace is sized for it).
inline LayerOutputs run_layer(Impl impl, const HostProblem& p, const RunOptions& opt = {},
                              int64_t max_tokens = -1) {
  const Dims& d = p.d;
  LayerConfig config = config_of(d, max_tokens < 0 ? std::max<int64_t>(d.T, 1) : max_tokens);
  config.precision = opt.precision;
  config.fp8_weight_grads = opt.fp8_weight_grads;
  const bool fp8 = opt.precision != Precision::kBf16;
  const DeviceInputs in(p);
  // Separate weights: w13's gate rows and up rows of each expert, as two tensors.
  const DeviceBuffer w1 = opt.separate_weights ? DeviceBuffer::from(expert_rows(p.w13_EFH, d.E, 2 * d.I, 0, d.I, d.H))
                                               : DeviceBuffer();
  const DeviceBuffer w3 = opt.separate_weights
                              ? DeviceBuffer::from(expert_rows(p.w13_EFH, d.E, 2 * d.I, d.I, d.I, d.H))
                              : DeviceBuffer();
  const DeviceBuffer fp8_weights = !fp8                   ? DeviceBuffer()
                                   : opt.separate_weights ? quantized_weights(config, w1, w3, in.w2)
                                                          : quantized_weights(config, in.w13, in.w2);
  DeviceBuffer y(d.T * d.H * 2), dx(d.T * d.H * 2), dtw(d.T * d.K * 4);
  const size_t grad_elem = opt.grad_dtype == WeightGradDtype::kBFloat16 ? 2 : 4;
  // Separate gradients: dw13 holds dw1 [E, I, H] and dw3 the up half.
  DeviceBuffer dw13((opt.separate_grads ? 1 : 2) * d.E * d.I * d.H * grad_elem), dw2(d.E * d.H * d.I * grad_elem);
  DeviceBuffer dw3(opt.separate_grads ? d.E * d.I * d.H * grad_elem : 0);
  // Each call gets exactly the workspace its kind of call needs (WorkspaceUse), so every test
  // here checks that no step reaches past its own need (the backward with saved z has no room
  // for z); the benchmark and the unfused tests use the one size that serves all calls.
  DeviceBuffer workspace(workspace_bytes(config, impl, WorkspaceUse::kForward));
  DeviceBuffer bwd_workspace(
      workspace_bytes(config, impl, opt.save_z ? WorkspaceUse::kBackwardSavedZ : WorkspaceUse::kBackward));
  DeviceBuffer saved_z(opt.save_z ? saved_z_bytes(config) : 0);
  for (DeviceBuffer* b : {&y, &dx, &dtw, &dw13, &dw3, &dw2, &workspace, &bwd_workspace, &saved_z}) b->poison();
  if (opt.accumulate) {
    auto upload = [&](DeviceBuffer& dst, const std::vector<float>& init) {
      if (opt.grad_dtype == WeightGradDtype::kFloat32) {
        TEST_CUDA(cudaMemcpy(dst.get(), init.data(), dst.bytes(), cudaMemcpyHostToDevice));
      } else {
        std::vector<uint16_t> bits(init.size());
        for (size_t i = 0; i < init.size(); ++i) bits[i] = host::float_to_bf16_bits(init[i]);
        TEST_CUDA(cudaMemcpy(dst.get(), bits.data(), dst.bytes(), cudaMemcpyHostToDevice));
      }
    };
    if (opt.separate_grads) {
      upload(dw13, expert_rows(*opt.dw13_init, d.E, 2 * d.I, 0, d.I, d.H));
      upload(dw3, expert_rows(*opt.dw13_init, d.E, 2 * d.I, d.I, d.I, d.H));
    } else {
      upload(dw13, *opt.dw13_init);
    }
    upload(dw2, *opt.dw2_init);
  }
  // What both calls get from opt; an FP8 call gets the FP8 buffer and null bf16 weights.
  auto set_options = [&](auto& a) {
    a.expert_id_report = opt.expert_id_report;
    a.saved_z = opt.save_z ? saved_z.get() : nullptr;
    if (opt.separate_weights) {
      a.w13 = nullptr;
      a.w1 = w1.get();
      a.w3 = w3.get();
    }
    if (fp8) {
      a.w13 = a.w2 = a.w1 = a.w3 = nullptr;
      a.fp8_weights = fp8_weights.get();
    }
  };
  ForwardArgs fa = in.args<ForwardArgs>(d.T, workspace);
  fa.y = y.get();
  set_options(fa);
  forward(config, impl, fa);
  BackwardArgs ba = in.args<BackwardArgs>(d.T, bwd_workspace);
  ba.dx = dx.get();
  ba.d_topk_weights = dtw.as<float>();
  if (opt.frozen_gate_up) {
    ba.dw13 = nullptr;
  } else if (opt.separate_grads) {
    ba.dw1 = dw13.get();
    ba.dw3 = dw3.get();
  } else {
    ba.dw13 = dw13.get();
  }
  ba.dw2 = opt.frozen_down ? nullptr : dw2.get();
  ba.weight_grad_dtype = opt.grad_dtype;
  ba.accumulate_weight_grads = opt.accumulate;
  set_options(ba);
  backward(config, impl, ba);
  TEST_CUDA(cudaDeviceSynchronize());
  LayerOutputs out;
  out.y = widen(y.to_host<uint16_t>());
  out.dx = widen(dx.to_host<uint16_t>());
  const auto dtw_host = dtw.to_host<float>();
  out.d_topk_w.assign(dtw_host.begin(), dtw_host.end());
  out.dw13 = opt.separate_grads ? concatenate_gate_up(widen_grad(dw13, opt.grad_dtype), widen_grad(dw3, opt.grad_dtype),
                                                      d.E, d.I, d.H)
                                 : widen_grad(dw13, opt.grad_dtype);
  out.dw2 = widen_grad(dw2, opt.grad_dtype);
  return out;
}

// Device copies of a problem's inputs, a y and a workspace (not poisoned here: run_forward_only
// poisons them before its call), for forward-only runs.
struct ForwardSetup {
  LayerConfig config;
  DeviceInputs in;
  DeviceBuffer y, workspace;
  ForwardArgs args;

  ForwardSetup(Impl impl, const HostProblem& p, int64_t max_tokens = -1)
      : config(config_of(p.d, max_tokens < 0 ? std::max<int64_t>(p.d.T, 1) : max_tokens)),
        in(p),
        y(p.d.T * p.d.H * 2),
        workspace(workspace_bytes(config, impl)) {
    args = in.args<ForwardArgs>(p.d.T, workspace);
    args.y = y.get();
  }
};

// Forward only, outputs and workspace poisoned first; returns y widened to double.
inline std::vector<double> run_forward_only(Impl impl, const HostProblem& p,
                                            int64_t max_tokens = -1) {
  ForwardSetup s(impl, p, max_tokens);
  s.y.poison();
  s.workspace.poison();
  forward(s.config, impl, s.args);
  TEST_CUDA(cudaDeviceSynchronize());
  return widen(s.y.to_host<uint16_t>());
}

// Random initial weight gradients for accumulate mode, rounded to bf16 so that they are exact
// in both gradient dtypes.
struct WeightGradInit {
  std::vector<float> dw13, dw2;
};

inline WeightGradInit random_weight_grad_init(const Dims& d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 0.1f);
  WeightGradInit init{std::vector<float>(d.E * 2 * d.I * d.H), std::vector<float>(d.E * d.H * d.I)};
  for (auto& v : init.dw13) v = host::round_to_bf16(dist(rng));
  for (auto& v : init.dw2) v = host::round_to_bf16(dist(rng));
  return init;
}

// Calls check once per weight-gradient mode of a layer of dims d: {fp32, bf16} x {overwrite,
// accumulate onto random_weight_grad_init(d, init_seed)}.
template <typename Check>
void for_each_weight_grad_mode(const Dims& d, uint64_t init_seed, Check&& check) {
  const WeightGradInit init = random_weight_grad_init(d, init_seed);
  for (WeightGradDtype dtype : {WeightGradDtype::kFloat32, WeightGradDtype::kBFloat16}) {
    for (bool accumulate : {false, true}) {
      std::printf("grad dtype %s, accumulate %d\n",
                  dtype == WeightGradDtype::kFloat32 ? "fp32" : "bf16", int(accumulate));
      RunOptions opt;
      opt.grad_dtype = dtype;
      opt.accumulate = accumulate;
      opt.dw13_init = &init.dw13;
      opt.dw2_init = &init.dw2;
      check(opt);
    }
  }
}

struct ErrorStats {
  double rel_l2 = 0.0;     // ||got - ref|| / ||ref|| (absolute when ref == 0)
  double max_abs = 0.0;
  double calc_diff = 0.0;  // DeepGEMM: 1 - 2<x,y> / (|x|^2 + |y|^2)
  bool all_finite = true;
};

inline ErrorStats compare(const std::vector<double>& got, const std::vector<double>& ref) {
  ErrorStats s;
  double diff2 = 0, ref2 = 0, got2 = 0, dot = 0;
  for (size_t i = 0; i < got.size() && i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) s.all_finite = false;
    const double d = got[i] - ref[i];
    diff2 += d * d;
    ref2 += ref[i] * ref[i];
    got2 += got[i] * got[i];
    dot += got[i] * ref[i];
    s.max_abs = std::max(s.max_abs, std::fabs(d));
  }
  if (got.size() != ref.size()) s.all_finite = false;  // a size mismatch must fail too
  s.rel_l2 = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  s.calc_diff = (ref2 + got2) > 0 ? 1.0 - 2.0 * dot / (ref2 + got2) : 0.0;
  if (!s.all_finite) s.rel_l2 = s.max_abs = s.calc_diff = NAN;
  return s;
}

// Asserts rel_l2 <= tol (NaN fails) and prints the figures.
inline void expect_close(const std::string& what, const std::vector<double>& got,
                         const std::vector<double>& ref, double tol) {
  const ErrorStats s = compare(got, ref);
  std::printf("  %-28s rel_l2 %.3e  max_abs %.3e  calc_diff %.3e  (tol %.1e, n=%zu)\n",
              what.c_str(), s.rel_l2, s.max_abs, s.calc_diff, tol, got.size());
  EXPECT_TRUE(s.rel_l2 <= tol) << what << ": rel_l2 " << s.rel_l2 << " > " << tol
                               << (s.all_finite ? "" : " (non-finite values or size mismatch)");
}

}  // namespace fusemoe::test

// Precision::kFp8Blockwise at the API, checked without a GPU: config limits, the implementations
// that accept it, per-call workspace sizes, the FP8 weight buffer's layout, argument checks that
// name what is wrong; and the FP8 emulation reference's sanity (its error against the fp64
// reference is that of E4M3 quantization: well above bf16's, well below 1).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>

#include "common/layer_config.h"
#include "expect_error.h"
#include "fusemoe/expert_parallel.h"
#include "fusemoe/fusemoe.h"
#include "plausible_args.h"
#include "reference/bf16_host.h"
#include "reference/fp8_emulation.h"

namespace fusemoe {
namespace {

LayerConfig fp8_config() {
  LayerConfig c = harness::layer_config(256, 128, 8, 2, 64);
  c.precision = Precision::kFp8Blockwise;
  return c;
}

TEST(Fp8Api, ConfigLimits) {
  EXPECT_NO_THROW(validate_config(fp8_config()));
  EXPECT_STREQ(precision_name(Precision::kFp8Blockwise), "fp8_blockwise");
  LayerConfig c = fp8_config();
  c.intermediate = 192;  // fine for bf16, not for FP8's 1 x 128 blocks of h
  expect_error_mentioning([&] { validate_config(c); }, "multiple of 128");
  c.precision = Precision::kBf16;
  EXPECT_NO_THROW(validate_config(c));
  c.precision = static_cast<Precision>(9);
  expect_error_mentioning([&] { validate_config(c); }, "precision");
  // FP8 weight gradients are an option of the FP8 path only.
  LayerConfig wg = fp8_config();
  wg.fp8_weight_grads = true;
  EXPECT_NO_THROW(validate_config(wg));
  wg.precision = Precision::kBf16;
  expect_error_mentioning([&] { validate_config(wg); }, "fp8_weight_grads needs precision fp8_blockwise");
  for (Impl impl : {Impl::kUnfused, Impl::kReferenceFp32}) {
    expect_error_mentioning([&] { (void)workspace_bytes(fp8_config(), impl); }, "Impl::kFused only");
  }
}

// Expert parallelism at FP8: the single-GPU FP8 shape limits, and FP8 weight gradients refused by
// name (the EP backward's weight gradients come from bf16 operands).
TEST(Fp8ExpertParallelApi, ConfigLimits) {
  EpConfig ep;
  ep.layer = fp8_config();
  ep.world_size = 2;
  EXPECT_NO_THROW(validate_ep_config(ep));
  EXPECT_GT(ep_symmetric_bytes(ep), 0u);
  ep.layer.intermediate = 192;  // fine for bf16, not for FP8's 1 x 128 blocks of h
  expect_error_mentioning([&] { validate_ep_config(ep); }, "multiple of 128");
  ep.layer = fp8_config();
  ep.layer.fp8_weight_grads = true;
  expect_error_mentioning([&] { validate_ep_config(ep); }, "layer.fp8_weight_grads must be false");
  expect_error_mentioning([&] { (void)ep_workspace_bytes(ep); }, "layer.fp8_weight_grads must be false");
}

// EpCall::fp8_weights' size through the EP API: the single-GPU buffer of the E / R local experts,
// also when top_k > E / R (fp8_config's K against R = 8), where a local LayerConfig with the
// layer's own top_k is invalid.
TEST(Fp8ExpertParallelApi, LocalWeightsBufferForFewLocalExperts) {
  EpConfig ep;
  ep.layer = fp8_config();
  ep.world_size = 8;
  ASSERT_EQ(ep.layer.num_experts % ep.world_size, 0);
  LayerConfig local = ep.layer;
  local.num_experts /= ep.world_size;
  ASSERT_GT(local.top_k, local.num_experts) << "the case this test is for";
  expect_error_mentioning([&] { (void)fp8_weights_bytes(local); }, "top_k");
  local.top_k = 1;
  EXPECT_EQ(ep_fp8_weights_bytes(ep), fp8_weights_bytes(local));
  ep.layer.fp8_weight_grads = true;
  expect_error_mentioning([&] { (void)ep_fp8_weights_bytes(ep); }, "layer.fp8_weight_grads must be false");
}

// The FP8 regions of an EP rank's private workspace, against the BF16 one of the same shape:
// P = R T pool rows, Q = R T K owner rows (src/pipelines/ep_workspace.h); the symmetric workspace and
// the saved state (bf16 z) are the same at both precisions.
TEST(Fp8ExpertParallelApi, WorkspacePerCall) {
  EpConfig fp8;
  fp8.layer = fp8_config();
  fp8.layer.max_tokens = 1000;
  fp8.world_size = 4;
  EpConfig bf16 = fp8;
  bf16.layer.precision = Precision::kBf16;
  auto a = [](int64_t bytes) { return static_cast<size_t>((bytes + 255) / 256 * 256); };
  const int64_t R = fp8.world_size, T = fp8.layer.max_tokens, K = fp8.layer.top_k, H = fp8.layer.hidden,
                I = fp8.layer.intermediate;
  const int64_t P = R * T, Q = R * T * K, rows_pad = (Q + 3) / 4 * 4;
  auto bytes = [](const EpConfig& c, WorkspaceUse use) { return ep_workspace_bytes(c, use); };
  // Forward: the x pool quantized per row (token-major scales), h in E4M3 with block-major scales
  // instead of bf16.
  EXPECT_EQ(bytes(fp8, WorkspaceUse::kForward) + a(Q * I * 2),
            bytes(bf16, WorkspaceUse::kForward) + a(P * H) + a(P * (H / 128) * 4) + a(Q * I) +
                a((I / 128) * rows_pad * 4));
  // Backward with saved z: the dy pool quantized per row, dz in E4M3 with block-major scales.
  EXPECT_EQ(bytes(fp8, WorkspaceUse::kBackwardSavedZ), bytes(bf16, WorkspaceUse::kBackwardSavedZ) + a(P * H) +
                                                           a(P * (H / 128) * 4) + a(Q * 2 * I) +
                                                           a((2 * I / 128) * rows_pad * 4));
  // Recomputing z also needs z (as at bf16) and the x pool quantized per row.
  EXPECT_EQ(bytes(fp8, WorkspaceUse::kBackward) - bytes(fp8, WorkspaceUse::kBackwardSavedZ),
            a(Q * 2 * I * 2) + a(P * H) + a(P * (H / 128) * 4));
  EXPECT_EQ(ep_workspace_bytes(fp8), bytes(fp8, WorkspaceUse::kBackward));
  EXPECT_EQ(ep_symmetric_bytes(fp8), ep_symmetric_bytes(bf16));
  EXPECT_EQ(ep_saved_state_bytes(fp8), ep_saved_state_bytes(bf16));
}

// BF16 expert-parallel sizes as main computed them before FP8 came to the EP layer (values from
// main's library at 4f9a5ac): the FP8 regions must not move or grow a BF16 workspace.
TEST(Fp8ExpertParallelApi, Bf16SizesUnchanged) {
  struct Sizes {
    int64_t H, I, E, K, T;
    int R;
    size_t forward, backward, backward_saved_z, symmetric, saved_state;
  };
  const Sizes golden[] = {
      {256, 128, 8, 4, 400, 4, 2621696, 16573696, 13296896, 1321984, 3276800},
      {7168, 2048, 256, 8, 4096, 8, 1549443072, 13847142400, 11699658752, 590615296, 2147483648},
      {2048, 768, 128, 8, 1000, 2, 33186304, 271138304, 221986304, 41193984, 49152000},
      {512, 192, 16, 2, 1, 1, 8448, 16896, 15360, 6656, 1536},
  };
  for (const Sizes& g : golden) {
    EpConfig c;
    c.layer = harness::layer_config(g.H, g.I, g.E, g.K, g.T);
    c.world_size = g.R;
    SCOPED_TRACE("H " + std::to_string(g.H) + " I " + std::to_string(g.I) + " E " + std::to_string(g.E) + " K " +
                 std::to_string(g.K) + " T " + std::to_string(g.T) + " R " + std::to_string(g.R));
    EXPECT_EQ(ep_workspace_bytes(c, WorkspaceUse::kForward), g.forward);
    EXPECT_EQ(ep_workspace_bytes(c, WorkspaceUse::kBackward), g.backward);
    EXPECT_EQ(ep_workspace_bytes(c, WorkspaceUse::kBackwardSavedZ), g.backward_saved_z);
    EXPECT_EQ(ep_symmetric_bytes(c), g.symmetric);
    EXPECT_EQ(ep_saved_state_bytes(c), g.saved_state);
  }
}

// An EP call of 8 tokens on rank 0 of 2 at fake aligned addresses: the host checks reject it
// before any pointer is used.
EpForwardArgs plausible_ep_forward_args(const EpConfig& c, void* const* peers) {
  EpForwardArgs a;
  a.call.x = reinterpret_cast<const void*>(0x10000);
  a.call.topk_idx = reinterpret_cast<const int32_t*>(0x20000);
  a.call.topk_weights = reinterpret_cast<const float*>(0x30000);
  a.call.w13 = reinterpret_cast<const void*>(0x40000);
  a.call.w2 = reinterpret_cast<const void*>(0x50000);
  a.call.num_tokens = 8;
  a.call.peer_symmetric = peers;
  a.call.workspace = reinterpret_cast<void*>(0x70000);
  a.call.workspace_bytes = ep_workspace_bytes(c);
  a.y = reinterpret_cast<void*>(0x60000);
  return a;
}

// EpCall::fp8_weights: required at FP8, refused at bf16, each error naming the field; an FP8 call
// may leave out both bf16 weights, not one of them.
TEST(Fp8ExpertParallelApi, Fp8WeightsArgument) {
  EpConfig c;
  c.layer = fp8_config();
  c.world_size = 2;
  void* const peers[2] = {reinterpret_cast<void*>(0x200000), reinterpret_cast<void*>(0x300000)};
  EpForwardArgs fa = plausible_ep_forward_args(c, peers);
  expect_error_mentioning([&] { ep_forward(c, fa); }, "fp8_weights must not be null at precision fp8_blockwise");
  fa.call.fp8_weights = reinterpret_cast<const void*>(kPlausibleFp8Weights + 16);
  expect_error_mentioning([&] { ep_forward(c, fa); }, "fp8_weights must be 256-byte aligned");
  fa.call.fp8_weights = reinterpret_cast<const void*>(kPlausibleFp8Weights);
  fa.call.w2 = nullptr;  // one bf16 weight without the other
  expect_error_mentioning([&] { ep_forward(c, fa); }, "w2");
  EpBackwardArgs ba;
  ba.call = plausible_ep_forward_args(c, peers).call;
  ba.dy = reinterpret_cast<const void*>(0x80000);
  ba.dx = reinterpret_cast<void*>(0x90000);
  ba.d_topk_weights = reinterpret_cast<float*>(0xa0000);
  expect_error_mentioning([&] { ep_backward(c, ba); }, "fp8_weights must not be null at precision fp8_blockwise");
  EpConfig bf16 = c;
  bf16.layer.precision = Precision::kBf16;
  ba.call.workspace_bytes = ep_workspace_bytes(bf16);
  ba.call.fp8_weights = reinterpret_cast<const void*>(kPlausibleFp8Weights);
  expect_error_mentioning([&] { ep_backward(bf16, ba); }, "fp8_weights must be null at precision bf16");
  fa = plausible_ep_forward_args(bf16, peers);
  fa.call.fp8_weights = reinterpret_cast<const void*>(kPlausibleFp8Weights);
  expect_error_mentioning([&] { ep_forward(bf16, fa); }, "fp8_weights must be null at precision bf16");
  // FP8 weight gradients in EP: refused by name at the call too.
  EpConfig wg = c;
  wg.layer.fp8_weight_grads = true;
  expect_error_mentioning([&] { ep_backward(wg, ba); }, "layer.fp8_weight_grads must be false");
}

TEST(Fp8Api, WorkspacePerCall) {
  LayerConfig c = fp8_config();
  c.max_tokens = 1000;
  const FusedWorkspaces w = checked_fused_workspaces(c);
  EXPECT_LT(w.forward, w.backward_saved_z);
  // Differences from the bf16 fused workspaces, region by region (256-byte aligned each).
  auto a = [](int64_t bytes) { return static_cast<size_t>((bytes + 255) / 256 * 256); };
  const int64_t T = c.max_tokens, R = T * c.top_k, P = (R + 3) / 4 * 4, H = c.hidden, I = c.intermediate;
  LayerConfig bf16 = c;
  bf16.precision = Precision::kBf16;
  // Forward: x once per token in E4M3 with token-major scales; h in E4M3 with block-major scales
  // instead of bf16.
  EXPECT_EQ(w.forward + a(R * I * 2), workspace_bytes(bf16, Impl::kFused, WorkspaceUse::kForward) + a(T * H) +
                                    a(T * (H / 128) * 4) + a(R * I) + a((I / 128) * P * 4));
  // Backward with saved z: dy once per token in E4M3 with token-major scales (dgrad-1 gathers its
  // rows), dz per row in E4M3 with block-major scales.
  EXPECT_EQ(w.backward_saved_z, workspace_bytes(bf16, Impl::kFused, WorkspaceUse::kBackwardSavedZ) + a(T * H) +
                                    a(T * (H / 128) * 4) + a(R * 2 * I) + a((2 * I / 128) * P * 4));
  // Recomputing z also needs z and x once per token in E4M3 (the recompute gathers its rows).
  EXPECT_EQ(w.backward - w.backward_saved_z, a(R * 2 * I * 2) + a(T * H) + a(T * (H / 128) * 4));
  // FP8 weight gradients: token-blocked pools of dy, w h, dz and x (each expert's positions from a
  // multiple of 128) and their scales instead of the bf16 x and dy pools.
  LayerConfig wg = c;
  wg.fp8_weight_grads = true;
  const int64_t pos = (R + 127) / 128 * 128 + 128 * c.num_experts, blocks = pos / 128;
  EXPECT_EQ(workspace_bytes(wg, Impl::kFused, WorkspaceUse::kBackwardSavedZ) + 2 * a(R * H * 2),
            w.backward_saved_z + a((c.num_experts + 1) * 4) + a(blocks * 4) + a(H * pos) + a(blocks * H * 4) + a(I * pos) +
                a(blocks * (I / 128) * 4) + a(2 * I * pos) + a(blocks * 2 * I * 4) + a(H * pos) +
                a(blocks * (H / 128) * 4));
}

TEST(Fp8Api, WeightBufferLayout) {
  const LayerConfig c = fp8_config();
  const int64_t E = c.num_experts, H = c.hidden, I = c.intermediate;
  const size_t bytes = fp8_weights_bytes(c);
  // Two E4M3 copies of each weight (2 bytes per bf16 element) plus one fp32 per 128 x 128 block.
  EXPECT_GE(bytes, static_cast<size_t>(2 * (E * 2 * I * H + E * H * I) + 4 * (E * 2 * (I / 128) * (H / 128) * 2)));
  EXPECT_LE(bytes, static_cast<size_t>(2 * (E * 2 * I * H + E * H * I) + 4 * (E * 3 * (I / 128) * (H / 128)) + 6 * 256));
  alignas(256) static uint8_t fake[256];
  const Fp8Weights w = fp8_weights_view(c, fake);
  auto off = [&](const void* p) { return static_cast<const uint8_t*>(p) - fake; };
  EXPECT_EQ(off(w.w13), 0);
  EXPECT_EQ(off(w.w13_t), E * 2 * I * H);
  EXPECT_EQ(off(w.w13_scales), 2 * E * 2 * I * H);
  for (const void* p : {w.w13, w.w13_t, static_cast<const void*>(w.w13_scales), w.w2, w.w2_t,
                        static_cast<const void*>(w.w2_scales)}) {
    EXPECT_EQ(off(p) % 256, 0);
    EXPECT_LT(static_cast<size_t>(off(p)), bytes);
  }
  expect_error_mentioning([&] { (void)fp8_weights_view(c, fake + 16); }, "256-byte aligned");
  LayerConfig odd = c;
  odd.intermediate = 64;
  expect_error_mentioning([&] { (void)fp8_weights_bytes(odd); }, "multiple of 128");
  expect_error_mentioning(
      [&] { quantize_weights_fp8(c, reinterpret_cast<const void*>(0x1000), nullptr, fake, bytes, nullptr); }, "w2");
  expect_error_mentioning([&] {
    quantize_weights_fp8(c, reinterpret_cast<const void*>(0x1000), reinterpret_cast<const void*>(0x2000), fake,
                         bytes - 1, nullptr);
  }, "needed");
}

// An FP8 call reads the weights from the FP8 buffer only: null bf16 weights.
ForwardArgs plausible_fp8_forward_args(const LayerConfig& c) {
  ForwardArgs a = plausible_forward_args(c, Impl::kFused);
  a.w13 = a.w2 = nullptr;
  a.fp8_weights = reinterpret_cast<const void*>(kPlausibleFp8Weights);
  return a;
}

TEST(Fp8Api, ArgumentsNamed) {
  const LayerConfig c = fp8_config();
  ForwardArgs fa = plausible_fp8_forward_args(c);
  fa.fp8_weights = nullptr;
  expect_error_mentioning([&] { forward(c, Impl::kFused, fa); }, "fp8_weights must not be null");
  fa.fp8_weights = reinterpret_cast<const void*>(kPlausibleFp8Weights + 16);
  expect_error_mentioning([&] { forward(c, Impl::kFused, fa); }, "fp8_weights must be 256-byte aligned");
  fa = plausible_fp8_forward_args(c);
  expect_error_mentioning([&] { forward(c, Impl::kUnfused, fa); }, "Impl::kFused only");
  fa.w13 = reinterpret_cast<const void*>(0x40000);  // one bf16 weight without the other
  expect_error_mentioning([&] { forward(c, Impl::kFused, fa); }, "w2 must not be null");
  BackwardArgs ba = plausible_backward_args(c, Impl::kFused);
  ba.w13 = ba.w2 = nullptr;
  expect_error_mentioning([&] { backward(c, Impl::kFused, ba); }, "fp8_weights must not be null");
  ba.fp8_weights = reinterpret_cast<const void*>(kPlausibleFp8Weights);
  ba.workspace_bytes = workspace_bytes(c, Impl::kFused, WorkspaceUse::kBackward) - 1;
  expect_error_mentioning([&] { backward(c, Impl::kFused, ba); }, "needed for impl fused (backward)");
}

// A bf16 layer given an FP8 buffer is refused by name (it would not be read), for every impl and
// both directions, as the expert-parallel layer refuses it (Fp8ExpertParallelApi.Fp8WeightsArgument).
TEST(Fp8Api, Fp8WeightsRefusedAtBf16) {
  LayerConfig c = fp8_config();
  c.precision = Precision::kBf16;
  for (const Impl impl : {Impl::kFused, Impl::kUnfused}) {
    ForwardArgs fa = plausible_forward_args(c, impl);
    fa.fp8_weights = reinterpret_cast<const void*>(kPlausibleFp8Weights);
    expect_error_mentioning([&] { forward(c, impl, fa); }, "fp8_weights must be null at precision bf16");
    BackwardArgs ba = plausible_backward_args(c, impl);
    ba.fp8_weights = reinterpret_cast<const void*>(kPlausibleFp8Weights);
    expect_error_mentioning([&] { backward(c, impl, ba); }, "fp8_weights must be null at precision bf16");
  }
}

// The emulation of a small layer: finite, its error against fp64 that of E4M3 (a few percent), and
// T = 0 gives empty outputs and zero weight gradients.
TEST(Fp8Emulation, ErrorIsThatOfE4m3) {
  reference::Problem p;
  p.num_tokens = 40;
  p.hidden = 256;
  p.intermediate = 128;
  p.num_experts = 4;
  p.top_k = 2;
  std::mt19937_64 rng(7);
  auto fill = [&](std::vector<double>& v, size_t n, double stddev) {
    std::normal_distribution<float> d(0.0f, static_cast<float>(stddev));
    v.resize(n);
    for (auto& x : v) x = host::round_to_bf16(d(rng));
  };
  fill(p.x_TH, p.num_tokens * p.hidden, 1.0);
  fill(p.w13_EFH, p.num_experts * 2 * p.intermediate * p.hidden, 1.0 / 16);
  fill(p.w2_EHI, p.num_experts * p.hidden * p.intermediate, 1.0 / std::sqrt(128.0));
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    p.topk_idx_TK.push_back(static_cast<int32_t>(t % 4));
    p.topk_idx_TK.push_back(t % 5 == 0 ? -1 : static_cast<int32_t>((t + 1) % 4));
    p.topk_w_TK.push_back(0.6);
    p.topk_w_TK.push_back(0.4);
  }
  std::vector<double> dy;
  fill(dy, p.num_tokens * p.hidden, 1.0);
  const reference::Fp8Emulation emu = reference::fp8_emulated_layer(p, dy);
  const std::vector<double> y = reference::forward(p);
  const reference::Gradients g = reference::backward(p, dy);
  auto rel = [](const std::vector<double>& a, const std::vector<double>& b) {
    double d2 = 0, b2 = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      d2 += (a[i] - b[i]) * (a[i] - b[i]);
      b2 += b[i] * b[i];
    }
    return std::sqrt(d2 / b2);
  };
  for (const auto& [name, e] : {std::pair<const char*, double>{"y", rel(emu.y_TH, y)},
                                {"dx", rel(emu.grads.dx_TH, g.dx_TH)},
                                {"d_topk_w", rel(emu.grads.d_topk_w_TK, g.d_topk_w_TK)},
                                {"dw13", rel(emu.grads.dw13_EFH, g.dw13_EFH)},
                                {"dw2", rel(emu.grads.dw2_EHI, g.dw2_EHI)}}) {
    std::printf("  emulation %-9s rel_l2 vs fp64 %.3e\n", name, e);
    EXPECT_TRUE(e >= 3e-3 && e <= 1e-1) << name << ": " << e;
  }
  EXPECT_EQ(emu.grads.d_topk_w_TK[1], 0.0);  // token 0, slot 1 is masked
  // FP8 weight gradients (LayerConfig::fp8_weight_grads): the same forward, dx and router gradient;
  // the weight gradients now quantized too, so further from fp64 than with bf16 inputs, still E4M3's.
  const reference::Fp8Emulation wg = reference::fp8_emulated_layer(p, dy, /*fp8_weight_grads=*/true);
  EXPECT_EQ(wg.y_TH, emu.y_TH);
  EXPECT_EQ(wg.grads.dx_TH, emu.grads.dx_TH);
  EXPECT_EQ(wg.grads.d_topk_w_TK, emu.grads.d_topk_w_TK);
  for (const auto& [name, e_wg, e_bf16] :
       {std::tuple<const char*, double, double>{"dw13", rel(wg.grads.dw13_EFH, g.dw13_EFH), rel(emu.grads.dw13_EFH, g.dw13_EFH)},
        {"dw2", rel(wg.grads.dw2_EHI, g.dw2_EHI), rel(emu.grads.dw2_EHI, g.dw2_EHI)}}) {
    std::printf("  emulation %-9s rel_l2 vs fp64 %.3e with FP8 weight gradients (%.3e with bf16 inputs)\n", name,
                e_wg, e_bf16);
    EXPECT_TRUE(e_wg > e_bf16 && e_wg <= 1e-1) << name << ": " << e_wg << " against " << e_bf16;
  }
  p.num_tokens = 0;
  p.x_TH.clear();
  p.topk_idx_TK.clear();
  p.topk_w_TK.clear();
  const reference::Fp8Emulation empty = reference::fp8_emulated_layer(p, {});
  EXPECT_TRUE(empty.y_TH.empty() && empty.grads.dx_TH.empty());
  EXPECT_TRUE(std::all_of(empty.grads.dw13_EFH.begin(), empty.grads.dw13_EFH.end(), [](double v) { return v == 0; }));
}

}  // namespace
}  // namespace fusemoe

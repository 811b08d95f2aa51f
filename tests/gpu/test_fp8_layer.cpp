// GPU tests of the fused layer at Precision::kFp8Blockwise through the public API (forward and
// backward), against the FP8 emulation reference (reference/fp8_emulation.h: the same quantization
// recipe, fp64 math) and the unquantized reference (fp64 CPU at small shapes, the fp32 GPU oracle
// at Qwen3 shapes). Every output and gradient (y, dx, d_topk_weights, dw13, dw2) must satisfy
//   rel_l2(fp8, emulation) <= 2e-2
//   rel_l2(fp8, reference) <= 1.1 * rel_l2(emulation, reference) + 1e-3
// Also: every token count and routing edge case, odd shapes, clamp, top-k 1 and E, blocks of zeros
// and a single huge value, weight-gradient dtypes and accumulation, outputs and workspaces poisoned
// with NaN, bitwise-equal repeated runs, recomputed z bitwise equal to saved z, the FP8 weight
// buffer bitwise as the host recipe.
#include <cstring>
#include <string>
#include <tuple>

#include "gpu/gpu_test_util.h"
#include "reference/fp8_emulation.h"
#include "reference/fp8_host.h"

namespace fusemoe::test {
namespace {

constexpr double kEmulationTol = 2e-2;
constexpr double kErrorFactor = 1.1;
constexpr double kErrorSlack = 1e-3;

LayerConfig fp8_config(const Dims& d, int64_t max_tokens) {
  LayerConfig c = config_of(d, max_tokens);
  c.precision = Precision::kFp8Blockwise;
  return c;
}

// run_layer (gpu_test_util.h) at FP8: forward then backward with every output, workspace, saved z
// and the FP8 weight buffer poisoned first; the bf16 weights are passed as null (FP8 calls must
// not need them).
LayerOutputs run_fp8_layer(const HostProblem& p, RunOptions opt = {}, int64_t max_tokens = -1) {
  opt.precision = Precision::kFp8Blockwise;
  return run_layer(Impl::kFused, p, opt, max_tokens);
}

struct References {
  LayerOutputs emulation, reference;
};

LayerOutputs from_reference(const std::vector<double>& y, const reference::Gradients& g) {
  return LayerOutputs{y, g.dx_TH, g.d_topk_w_TK, g.dw13_EFH, g.dw2_EHI};
}

// The FP8 emulation and the fp64 reference of a (small) problem, plus accumulate's initial values.
References cpu_references(const HostProblem& p, const RunOptions& opt = {}) {
  const reference::Problem rp = to_reference(p);
  const std::vector<double> dy = widen(p.dy_TH);
  const reference::Fp8Emulation emu = reference::fp8_emulated_layer(rp, dy, opt.fp8_weight_grads);
  References r{from_reference(emu.y_TH, emu.grads), from_reference(reference::forward(rp), reference::backward(rp, dy))};
  if (opt.accumulate) {
    for (LayerOutputs* o : {&r.emulation, &r.reference}) {
      for (size_t i = 0; i < o->dw13.size(); ++i) o->dw13[i] += (*opt.dw13_init)[i];
      for (size_t i = 0; i < o->dw2.size(); ++i) o->dw2[i] += (*opt.dw2_init)[i];
    }
  }
  return r;
}

// The two bounds for every output and gradient.
void expect_fp8_bounds(const LayerOutputs& fp8, const References& refs) {
  struct Item {
    const char* name;
    const std::vector<double>& got;
    const std::vector<double>& emulation;
    const std::vector<double>& reference;
  };
  for (const Item& it : {Item{"y", fp8.y, refs.emulation.y, refs.reference.y},
                         Item{"dx", fp8.dx, refs.emulation.dx, refs.reference.dx},
                         Item{"d_topk_weights", fp8.d_topk_w, refs.emulation.d_topk_w, refs.reference.d_topk_w},
                         Item{"dw13", fp8.dw13, refs.emulation.dw13, refs.reference.dw13},
                         Item{"dw2", fp8.dw2, refs.emulation.dw2, refs.reference.dw2}}) {
    const ErrorStats emu = compare(it.emulation, it.reference);
    std::printf("  emulation %-18s rel_l2 vs reference %.3e\n", it.name, emu.rel_l2);
    expect_close(std::string("fp8 ") + it.name + " vs emulation", it.got, it.emulation, kEmulationTol);
    expect_close(std::string("fp8 ") + it.name + " vs reference", it.got, it.reference,
                 kErrorFactor * emu.rel_l2 + kErrorSlack);
  }
}

// Plants a block of zeros in token 0's x and dy and a single huge value in token 1's (4096 among
// N(0, 1) values: the rest of its block lands at the bottom of E4M3's range).
void plant_edge_blocks(HostProblem& p) {
  if (p.d.T < 2) return;
  const int64_t H = p.d.H;
  for (int64_t c = 0; c < 128; ++c) p.x_TH[c] = p.dy_TH[c] = 0;
  p.x_TH[H + 5] = host::float_to_bf16_bits(4096.0f);
  p.dy_TH[H + 9] = host::float_to_bf16_bits(-4096.0f);
}

class Fp8LayerSmall : public SmallProblemTest {};

TEST_P(Fp8LayerSmall, WithinEmulationBounds) {
  const HostProblem p = small_problem(9000);
  const References refs = cpu_references(p);
  for (bool save_z : {false, true}) {
    std::printf(" z %s\n", save_z ? "saved by the forward" : "recomputed");
    RunOptions opt;
    opt.save_z = save_z;
    expect_fp8_bounds(run_fp8_layer(p, opt), refs);
  }
}

// LayerConfig::fp8_weight_grads: the weight gradients from token-blocked FP8 pools, against the
// emulation of that recipe; both gradient dtypes, overwrite and accumulate, separate gate and up
// gradients (dW1, dW3 from dz's halves), frozen weights (their outputs keep the poison).
TEST_P(Fp8LayerSmall, Fp8WeightGradsWithinEmulationBounds) {
  const HostProblem p = small_problem(9100);
  std::mt19937_64 rng(91);
  std::normal_distribution<float> dist(0.0f, 0.1f);
  std::vector<float> dw13_init(p.d.E * 2 * p.d.I * p.d.H), dw2_init(p.d.E * p.d.H * p.d.I);
  for (float& v : dw13_init) v = dist(rng);
  for (float& v : dw2_init) v = dist(rng);
  for (int variant = 0; variant < 3; ++variant) {
    RunOptions opt;
    opt.fp8_weight_grads = true;
    opt.save_z = variant != 1;
    opt.separate_grads = variant == 2;
    if (variant == 1) {
      opt.accumulate = true;
      opt.dw13_init = &dw13_init;
      opt.dw2_init = &dw2_init;
    }
    std::printf(" fp8 weight gradients, %s\n",
                variant == 0 ? "saved z" : variant == 1 ? "recomputed z, accumulated" : "separate dW1, dW3");
    expect_fp8_bounds(run_fp8_layer(p, opt), cpu_references(p, opt));
  }
}

INSTANTIATE_TEST_SUITE_P(Fp8, Fp8LayerSmall,
                         ::testing::Combine(::testing::Values<int64_t>(0, 1, 7, 199, 1000),
                                            ::testing::ValuesIn(kAllRoutings)),
                         token_routing_name);

TEST(Fp8Layer, ShapesClampTopKAndEdgeBlocks) {
  struct Case {
    const char* name;
    Dims d;
    Routing routing;
    int64_t max_tokens;
    bool edge_blocks;
  };
  Dims odd;  // H and I multiples of 128, not of 256
  odd.H = 384;
  odd.I = 384;
  odd.T = 77;
  Dims edge;
  edge.T = 50;
  for (const Case& c : {Case{"clamp", clamp_dims(199), Routing::kUniform, -1, false},
                        Case{"top_k=1", top_k_dims(64, 1), Routing::kUniform, -1, false},
                        Case{"top_k=E", top_k_dims(64, 8), Routing::kUniform, -1, false},
                        Case{"medium, max_tokens 1000", medium_dims(300), Routing::kSkewed, 1000, false},
                        Case{"H=384 I=384", odd, Routing::kMasked, -1, false},
                        Case{"zero block and a single huge value", edge, Routing::kUniform, -1, true}}) {
    std::printf("%s\n", c.name);
    HostProblem p = make_problem(c.d, c.routing, 9500);
    if (c.edge_blocks) plant_edge_blocks(p);
    const LayerOutputs out = run_fp8_layer(p, {}, c.max_tokens);
    expect_fp8_bounds(out, cpu_references(p));
  }
}

TEST(Fp8Layer, WeightGradientModes) {
  const Dims d = small_dims(150);
  const HostProblem p = make_problem(d, Routing::kSkewed, 9600);
  for_each_weight_grad_mode(d, 9601, [&](const RunOptions& opt) {
    expect_fp8_bounds(run_fp8_layer(p, opt), cpu_references(p, opt));
  });
}

// Repeated calls give the same bits; the backward with the forward's saved z gives the same bits
// as the one that recomputes z (same E4M3 operands, same promotion order: the recomputed z is the
// saved z).
TEST(Fp8Layer, BitwiseDeterministicAndSavedZEqualsRecompute) {
  const HostProblem p = make_problem(medium_dims(700), Routing::kSkewed, 9700);
  RunOptions recompute;
  RunOptions saved;
  saved.save_z = true;
  const LayerOutputs first = run_fp8_layer(p, recompute);
  for (int run = 0; run < 3; ++run) expect_same_outputs(run_fp8_layer(p, recompute), first, "repeated run");
  expect_same_outputs(run_fp8_layer(p, saved), first, "saved z vs recomputed z");
}

// The Qwen3 layer shapes: the emulation on the CPU (all threads) and the fp32 GPU oracle
// (Impl::kReferenceFp32, bf16 precision) as the unquantized reference. 30B with all 128 experts;
// 235B's H and I with 16 experts (the host copies of 128 experts' weights in fp64 would take 19 GB).
TEST(Fp8Layer, QwenShapesWithinEmulationBounds) {
  const Dims d30 = qwen3_30b_dims(128);
  const Dims d235 = qwen3_235b_dims(96, 16);
  for (const auto& [name, d] : {std::pair<const char*, Dims>{"qwen3-30b-a3b", d30}, {"qwen3-235b-a22b", d235}}) {
    std::printf("%s T=%lld\n", name, static_cast<long long>(d.T));
    const HostProblem p = make_problem(d, Routing::kUniform, 9800);
    const reference::Problem rp = to_reference(p);
    const std::vector<double> dy = widen(p.dy_TH);
    const reference::Fp8Emulation emu = reference::fp8_emulated_layer(rp, dy);
    const References refs{from_reference(emu.y_TH, emu.grads), run_layer(Impl::kReferenceFp32, p)};
    RunOptions opt;
    opt.save_z = true;
    expect_fp8_bounds(run_fp8_layer(p, opt), refs);
  }
}

// quantize_weights_fp8 writes, at fp8_weights_view's addresses, the host recipe's codes, scales and
// transposes bit for bit.
TEST(Fp8Layer, WeightBufferMatchesHostRecipe) {
  Dims d;
  d.E = 3;
  d.H = 384;
  d.I = 256;
  const HostProblem p = make_problem(d, Routing::kUniform, 9900);
  const LayerConfig config = fp8_config(d, 1);
  DeviceBuffer w13 = DeviceBuffer::from(p.w13_EFH), w2 = DeviceBuffer::from(p.w2_EHI);
  const DeviceBuffer buffer = quantized_weights(config, w13, w2);
  TEST_CUDA(cudaDeviceSynchronize());
  const Fp8Weights view = fp8_weights_view(config, buffer.get());
  const std::vector<uint8_t> bytes = buffer.to_host<uint8_t>();
  auto at = [&](const void* ptr) {
    return static_cast<size_t>(static_cast<const uint8_t*>(ptr) - buffer.as<const uint8_t>());
  };
  struct Weight {
    const char* name;
    const std::vector<uint16_t>& bits;
    int64_t rows, cols;
    const void* q;
    const void* q_t;
    const float* scales;
  };
  for (const Weight& w : {Weight{"w13", p.w13_EFH, 2 * d.I, d.H, view.w13, view.w13_t, view.w13_scales},
                          Weight{"w2", p.w2_EHI, d.H, d.I, view.w2, view.w2_t, view.w2_scales}}) {
    const int64_t n = w.rows * w.cols, blocks = (w.rows / 128) * (w.cols / 128);
    std::vector<float> m(n), s(blocks);
    std::vector<uint8_t> q(n);
    int64_t bad_q = 0, bad_t = 0, bad_s = 0;
    for (int64_t e = 0; e < d.E; ++e) {
      for (int64_t i = 0; i < n; ++i) m[i] = host::bf16_bits_to_float(w.bits[e * n + i]);
      host::fp8_quantize_matrix(m.data(), w.rows, w.cols, q.data(), s.data());
      for (int64_t r = 0; r < w.rows; ++r) {
        for (int64_t c = 0; c < w.cols; ++c) {
          bad_q += bytes[at(w.q) + e * n + r * w.cols + c] != q[r * w.cols + c];
          bad_t += bytes[at(w.q_t) + e * n + c * w.rows + r] != q[r * w.cols + c];
        }
      }
      for (int64_t b = 0; b < blocks; ++b) {
        float got;
        std::memcpy(&got, &bytes[at(w.scales) + (e * blocks + b) * 4], 4);
        bad_s += std::memcmp(&got, &s[b], 4) != 0;
      }
    }
    EXPECT_EQ(bad_q, 0) << w.name << ": codes differ from the host recipe";
    EXPECT_EQ(bad_t, 0) << w.name << "_t: transposed codes differ";
    EXPECT_EQ(bad_s, 0) << w.name << ": scales differ";
  }
}

}  // namespace
}  // namespace fusemoe::test

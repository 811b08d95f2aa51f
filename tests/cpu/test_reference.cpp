// Tests of the CPU fp64 reference (reference/moe_reference.h): hand-computed tiny layers (with
// and without an active SwiGLU clamp, with a masked slot), central finite differences of every
// gradient through L = <y, dy>, invariants (masked slots, expert relabelling, repeated ids,
// empty inputs) and argument validation. Every comparison is written `ratio <= 1` so NaN fails.
// Random data come from a fixed-seed mt19937_64 and are rounded to bf16 like the GPU inputs.
// Legend: T tokens, H hidden, I intermediate, F = 2I, E experts, K top-k, S = T*K slots.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "reference/bf16_host.h"
#include "reference/moe_reference.h"

namespace {

using fusemoe::reference::backward;
using fusemoe::reference::forward;
using fusemoe::reference::Gradients;
using fusemoe::reference::Problem;

double bf16(double v) { return fusemoe::host::round_to_bf16(static_cast<float>(v)); }
double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// Passes when |actual - expected| <= atol + rtol * |expected| everywhere. A size mismatch or a
// NaN on either side fails (the test is `!(err <= bound)`).
::testing::AssertionResult all_close(const std::vector<double>& actual,
                                     const std::vector<double>& expected, double rtol,
                                     double atol) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << "size " << actual.size() << " != expected size " << expected.size();
  }
  double worst_ratio = 0.0;
  size_t worst = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double err = std::abs(actual[i] - expected[i]);
    const double bound = atol + rtol * std::abs(expected[i]);
    if (!(err <= bound)) {
      const double ratio = bound > 0.0 ? err / bound : std::numeric_limits<double>::infinity();
      if (!(ratio <= worst_ratio)) {  // NaN ratio also lands here and sticks as +inf below
        worst_ratio = std::isnan(ratio) ? std::numeric_limits<double>::infinity() : ratio;
        worst = i;
      }
    }
  }
  if (worst_ratio == 0.0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "element " << worst << ": got " << actual[worst] << ", expected " << expected[worst]
         << " (error/bound = " << worst_ratio << ", rtol " << rtol << ", atol " << atol << ")";
}

double max_abs(const std::vector<double>& v) {
  double m = 0.0;
  for (const double x : v) m = std::max(m, std::abs(x));
  return m;
}

// all_close with atol = rtol * max|expected|: for results equal to the expected ones up to the fp64
// rounding of another summation order, which scales with the largest value, not each element.
::testing::AssertionResult close_at_scale(const std::vector<double>& actual, const std::vector<double>& expected,
                                          double rtol) {
  return all_close(actual, expected, rtol, rtol * max_abs(expected));
}

// Exact equality up to the sign of zero (both outputs come from the same fp64 operations).
::testing::AssertionResult all_equal(const std::vector<double>& a, const std::vector<double>& b) {
  return all_close(a, b, 0.0, 0.0);
}

// make_shape initialises Problem's first five fields by position: keep them in this order.
static_assert(offsetof(Problem, num_tokens) == 0 && offsetof(Problem, hidden) == 8 &&
                  offsetof(Problem, intermediate) == 16 && offsetof(Problem, num_experts) == 24 &&
                  offsetof(Problem, top_k) == 32,
              "Problem: num_tokens, hidden, intermediate, num_experts, top_k first, in this order");

Problem make_shape(int64_t T, int64_t H, int64_t I, int64_t E, int64_t K) {
  Problem p{T, H, I, E, K};
  p.x_TH.assign(T * H, 0.0);
  p.topk_idx_TK.assign(T * K, -1);
  p.topk_w_TK.assign(T * K, 0.0);
  p.w13_EFH.assign(E * 2 * I * H, 0.0);
  p.w2_EHI.assign(E * H * I, 0.0);
  return p;
}

// Random layer: distinct expert ids per token (as a top-k router gives), each slot masked with
// probability mask_probability; z = W1 x has unit scale. Values are bf16 (weights fp32).
Problem random_problem(int64_t T, int64_t H, int64_t I, int64_t E, int64_t K,
                       double mask_probability, std::mt19937_64& rng) {
  Problem p = make_shape(T, H, I, E, K);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (double& v : p.x_TH) v = bf16(normal(rng));
  for (double& v : p.w13_EFH) v = bf16(normal(rng) / std::sqrt(static_cast<double>(H)));
  for (double& v : p.w2_EHI) v = bf16(normal(rng) / std::sqrt(static_cast<double>(I)));
  std::vector<int32_t> experts(E);
  for (int64_t t = 0; t < T; ++t) {
    std::iota(experts.begin(), experts.end(), 0);
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int64_t j = 0; j < K; ++j) {
      p.topk_idx_TK[t * K + j] = uniform(rng) < mask_probability ? -1 : experts[j];
      p.topk_w_TK[t * K + j] = static_cast<float>(0.05 + 0.95 * uniform(rng));
    }
  }
  return p;
}

std::vector<double> random_dy(const Problem& p, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> dy(p.num_tokens * p.hidden);
  for (double& v : dy) v = bf16(normal(rng));
  return dy;
}

// Each gradient field with the input field it differentiates, for the finite-difference loop.
struct GradientField {
  const char* name;
  std::vector<double> Problem::*input;
  std::vector<double> Gradients::*gradient;
};
const GradientField kGradientFields[] = {
    {"dx_TH", &Problem::x_TH, &Gradients::dx_TH},
    {"d_topk_w_TK", &Problem::topk_w_TK, &Gradients::d_topk_w_TK},
    {"dw13_EFH", &Problem::w13_EFH, &Gradients::dw13_EFH},
    {"dw2_EHI", &Problem::w2_EHI, &Gradients::dw2_EHI},
};

double loss(const Problem& p, const std::vector<double>& dy) {
  const std::vector<double> y = forward(p);
  double l = 0.0;
  for (size_t i = 0; i < y.size(); ++i) l += y[i] * dy[i];
  return l;
}

// Central differences of L = <y, dy> against the analytic backward, for every input element.
// Truncation ~ step^2 and cancellation ~ 1e-16 |L| / step are both far below the tolerance; a
// wrong term in a gradient shows up at order 1 relative.
void check_gradients_by_finite_differences(const Problem& p, const std::vector<double>& dy) {
  constexpr double kStep = 1e-5;
  constexpr double kRtol = 1e-6;
  const Gradients analytic = backward(p, dy);
  for (const GradientField& field : kGradientFields) {
    const std::vector<double>& grad = analytic.*field.gradient;
    std::vector<double> numeric(grad.size());
    Problem perturbed = p;
    std::vector<double>& input = perturbed.*field.input;
    for (size_t i = 0; i < input.size(); ++i) {
      const double saved = input[i];
      input[i] = saved + kStep;
      const double plus = loss(perturbed, dy);
      input[i] = saved - kStep;
      const double minus = loss(perturbed, dy);
      input[i] = saved;
      numeric[i] = (plus - minus) / (2.0 * kStep);
    }
    EXPECT_TRUE(max_abs(grad) > 0.0) << field.name << " is all zero: the check would be vacuous";
    EXPECT_TRUE(all_close(grad, numeric, kRtol, kRtol * max_abs(grad))) << field.name;
  }
}

// z = W1_e x_t for one slot, computed independently of the reference.
std::vector<double> gate_up(const Problem& p, int64_t slot) {
  const int64_t H = p.hidden, F = 2 * p.intermediate;
  const int64_t e = p.topk_idx_TK[slot], t = slot / p.top_k;
  std::vector<double> z(F, 0.0);
  for (int64_t f = 0; f < F; ++f) {
    for (int64_t k = 0; k < H; ++k) z[f] += p.w13_EFH[(e * F + f) * H + k] * p.x_TH[t * H + k];
  }
  return z;
}

::testing::AssertionResult throws_naming(const std::function<void()>& call,
                                         const std::string& name) {
  try {
    call();
  } catch (const std::invalid_argument& error) {
    if (std::string(error.what()).find(name) != std::string::npos) {
      return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure()
           << "message does not name " << name << ": " << error.what();
  }
  return ::testing::AssertionFailure()
         << "no std::invalid_argument thrown (expected one naming " << name << ")";
}

constexpr double kExactRtol = 1e-14;  // closed forms: a few fp64 roundings apart

// ---------------------------------------------------------------- closed-form tiny layers

// H = I = E = K = 1, T = 1: g = ln 3 so sigmoid(g) = 3/4 and every value has a short closed form.
Problem single_row_problem() {
  Problem p = make_shape(1, 1, 1, 1, 1);
  const double ln3 = std::log(3.0);
  p.x_TH = {2.0};
  p.w13_EFH = {ln3 / 2.0, 1.0};  // g = ln 3, u = 2
  p.w2_EHI = {3.0};
  p.topk_idx_TK = {0};
  p.topk_w_TK = {0.5};
  return p;
}

TEST(ReferenceClosedForm, SingleRowNoClamp) {
  const Problem p = single_row_problem();
  const std::vector<double> dy = {2.0};
  const double ln3 = std::log(3.0);
  const double h = 0.75 * ln3 * 2.0;                      // silu(g) u
  const double dh = 0.5 * 3.0 * 2.0;                      // w W2^T dy
  const double dg = dh * 2.0 * 0.75 * (1.0 + ln3 / 4.0);  // dh u silu'(g)
  const double du = dh * 0.75 * ln3;                      // dh silu(g)
  EXPECT_TRUE(all_close(forward(p), {0.5 * 3.0 * h}, kExactRtol, 0.0));
  const Gradients grads = backward(p, dy);
  EXPECT_TRUE(all_close(grads.d_topk_w_TK, {3.0 * h * 2.0}, kExactRtol, 0.0));
  EXPECT_TRUE(all_close(grads.dx_TH, {ln3 / 2.0 * dg + du}, kExactRtol, 0.0));
  EXPECT_TRUE(all_close(grads.dw13_EFH, {2.0 * dg, 2.0 * du}, kExactRtol, 0.0));
  EXPECT_TRUE(all_close(grads.dw2_EHI, {0.5 * 2.0 * h}, kExactRtol, 0.0));
}

TEST(ReferenceClosedForm, InactiveClampChangesNothing) {
  const Problem p = single_row_problem();  // g = ln 3 ~ 1.1, u = 2: both inside [-3, 3]
  Problem clamped = p;
  clamped.use_swiglu_clamp = true;
  clamped.swiglu_clamp = 3.0;
  const std::vector<double> dy = {2.0};
  EXPECT_TRUE(all_equal(forward(clamped), forward(p)));
  const Gradients expected = backward(p, dy), got = backward(clamped, dy);
  for (const GradientField& field : kGradientFields) {
    EXPECT_TRUE(all_equal(got.*field.gradient, expected.*field.gradient)) << field.name;
  }
}

// I = 2, c = 1: feature 0 has its gate clamped (g = 2), feature 1 its up clamped (u = -3); the
// other half of each feature is inside the bounds, so exactly dg0 and du1 must vanish.
TEST(ReferenceClosedForm, ActiveClampBlocksOnlyTheClampedGradient) {
  Problem p = make_shape(1, 1, 2, 1, 1);
  p.use_swiglu_clamp = true;
  p.swiglu_clamp = 1.0;
  p.x_TH = {1.0};
  // g = (2, 0.25), u = (0.5, -3); clamped: g = (1, 0.25), u = (0.5, -1).
  p.w13_EFH = {2.0, 0.25, 0.5, -3.0};
  p.w2_EHI = {3.0, -1.0};
  p.topk_idx_TK = {0};
  p.topk_w_TK = {0.5};
  const std::vector<double> dy = {2.0};
  const double s1 = sigmoid(1.0), s25 = sigmoid(0.25);
  const double h0 = s1 * 0.5, h1 = 0.25 * s25 * -1.0;
  const double o = 3.0 * h0 - h1;
  const double dh0 = 3.0, dh1 = -1.0;  // w W2^T dy
  const double dg1 = dh1 * -1.0 * s25 * (1.0 + 0.25 * (1.0 - s25));
  const double du0 = dh0 * s1;
  EXPECT_TRUE(all_close(forward(p), {0.5 * o}, kExactRtol, 0.0));
  const Gradients grads = backward(p, dy);
  EXPECT_TRUE(all_close(grads.d_topk_w_TK, {2.0 * o}, kExactRtol, 0.0));
  EXPECT_TRUE(all_close(grads.dw13_EFH, {0.0, dg1, du0, 0.0}, kExactRtol, 0.0));
  EXPECT_TRUE(all_close(grads.dx_TH, {0.25 * dg1 + 0.5 * du0}, kExactRtol, 0.0));
  EXPECT_TRUE(all_close(grads.dw2_EHI, {h0, h1}, kExactRtol, 0.0));
}

// g = c and u = -c (token 0), u = +c (token 1): the bounds are inclusive, so the gradient passes
// and everything equals the unclamped layer.
TEST(ReferenceClosedForm, ClampBoundaryIsInclusive) {
  Problem p = make_shape(2, 1, 1, 1, 1);
  p.x_TH = {1.0, -1.0};
  p.w13_EFH = {1.0, -1.0};  // token 0: g = 1, u = -1; token 1: g = -1, u = 1
  p.w2_EHI = {3.0};
  p.topk_idx_TK = {0, 0};
  p.topk_w_TK = {0.5, 0.25};
  Problem clamped = p;
  clamped.use_swiglu_clamp = true;
  clamped.swiglu_clamp = 1.0;
  const std::vector<double> dy = {2.0, -1.0};
  EXPECT_TRUE(all_equal(forward(clamped), forward(p)));
  const Gradients expected = backward(p, dy), got = backward(clamped, dy);
  EXPECT_TRUE(std::abs(expected.dx_TH[0]) > 0.0 && std::abs(expected.dx_TH[1]) > 0.0);
  for (const GradientField& field : kGradientFields) {
    EXPECT_TRUE(all_equal(got.*field.gradient, expected.*field.gradient)) << field.name;
  }
}

// T = 1, H = 2, I = 1, E = 2, K = 3, slots (expert 1, masked, expert 0). The masked slot has a
// nonzero weight that must not matter.
TEST(ReferenceClosedForm, TwoExpertsAndAMaskedSlot) {
  Problem p = make_shape(1, 2, 1, 2, 3);
  const double ln3 = std::log(3.0), s1 = sigmoid(1.0);
  p.x_TH = {ln3, 1.0};
  p.w13_EFH = {0.0, 1.0, 1.0, 1.0,   // expert 0: g = 1, u = ln3 + 1
               1.0, 0.0, 0.0, 2.0};  // expert 1: g = ln3, u = 2
  p.w2_EHI = {1.0, 2.0, -1.0, 1.0};
  p.topk_idx_TK = {1, -1, 0};
  p.topk_w_TK = {0.25, 0.7, 0.5};
  const std::vector<double> dy = {1.0, -2.0};

  const double h0 = s1 * (ln3 + 1.0);  // expert 0, slot 2, w = 0.5, W2^T dy = -3
  const double dh0 = 0.5 * -3.0;
  const double dg0 = dh0 * (ln3 + 1.0) * s1 * (2.0 - s1), du0 = dh0 * s1;
  const double h1 = 0.75 * ln3 * 2.0;  // expert 1, slot 0, w = 0.25, W2^T dy = -3
  const double dh1 = 0.25 * -3.0;
  const double dg1 = dh1 * 2.0 * 0.75 * (1.0 + ln3 / 4.0), du1 = dh1 * 0.75 * ln3;

  EXPECT_TRUE(
      all_close(forward(p), {0.25 * -h1 + 0.5 * h0, 0.25 * h1 + 0.5 * 2.0 * h0}, kExactRtol, 0.0));
  const Gradients grads = backward(p, dy);
  EXPECT_TRUE(all_close(grads.d_topk_w_TK, {-3.0 * h1, 0.0, -3.0 * h0}, kExactRtol, 0.0));
  EXPECT_TRUE(all_close(grads.dx_TH, {dg1 + du0, 2.0 * du1 + dg0 + du0}, kExactRtol, 0.0));
  EXPECT_TRUE(all_close(grads.dw13_EFH,
                        {dg0 * ln3, dg0, du0 * ln3, du0, dg1 * ln3, dg1, du1 * ln3, du1},
                        kExactRtol, 0.0));
  EXPECT_TRUE(all_close(grads.dw2_EHI, {0.5 * h0, 0.5 * -2.0 * h0, 0.25 * h1, 0.25 * -2.0 * h1},
                        kExactRtol, 0.0));
}

// y written straight from the layouts in moe_reference.h (w13[e, f, k] at (e*2I + f)*H + k,
// gate f < I, up f >= I; w2[e, k, i] at (e*H + k)*I + i), on shapes where H != I != E so a
// transposed or interleaved layout shows. The finite-difference tests tie the backward to this.
TEST(ReferenceForward, MatchesLayoutFormula) {
  std::mt19937_64 rng(99);
  Problem p = random_problem(/*T=*/5, /*H=*/6, /*I=*/3, /*E=*/4, /*K=*/2, 0.2, rng);
  p.use_swiglu_clamp = true;
  p.swiglu_clamp = 0.75;
  const int64_t T = p.num_tokens, H = p.hidden, I = p.intermediate, K = p.top_k;
  const double c = p.swiglu_clamp;
  std::vector<double> expected(T * H, 0.0);
  int64_t num_clamped = 0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = p.topk_idx_TK[t * K + j];
      if (e < 0) continue;
      for (int64_t k = 0; k < H; ++k) {
        for (int64_t i = 0; i < I; ++i) {
          double g = 0.0, u = 0.0;
          for (int64_t m = 0; m < H; ++m) {
            g += p.w13_EFH[(e * 2 * I + i) * H + m] * p.x_TH[t * H + m];
            u += p.w13_EFH[(e * 2 * I + I + i) * H + m] * p.x_TH[t * H + m];
          }
          num_clamped += (g > c) + (std::abs(u) > c);
          g = std::min(g, c);
          u = std::max(-c, std::min(u, c));
          expected[t * H + k] +=
              p.topk_w_TK[t * K + j] * p.w2_EHI[(e * H + k) * I + i] * g * sigmoid(g) * u;
        }
      }
    }
  }
  ASSERT_TRUE(num_clamped > 0);
  EXPECT_TRUE(close_at_scale(forward(p), expected, 1e-13));
}

// ---------------------------------------------------------------- finite differences

TEST(ReferenceFiniteDifference, AllGradientsWithoutClamp) {
  std::mt19937_64 rng(1234);
  const Problem p = random_problem(/*T=*/6, /*H=*/8, /*I=*/4, /*E=*/4, /*K=*/3, 0.2, rng);
  check_gradients_by_finite_differences(p, random_dy(p, rng));
}

// c is put in the widest gap of the middle of the sorted {g} U {|u|}, so the clamp is active for
// some gates and ups (from above and below) and not for others, and no value sits within the
// finite-difference step of a kink.
TEST(ReferenceFiniteDifference, AllGradientsWithActiveClamp) {
  std::mt19937_64 rng(5678);
  Problem p = random_problem(/*T=*/6, /*H=*/8, /*I=*/4, /*E=*/4, /*K=*/3, 0.2, rng);
  const int64_t I = p.intermediate;
  std::vector<double> candidates;
  for (int64_t s = 0; s < p.num_tokens * p.top_k; ++s) {
    if (p.topk_idx_TK[s] < 0) continue;
    const std::vector<double> z = gate_up(p, s);
    for (int64_t i = 0; i < I; ++i) {
      candidates.push_back(z[i]);
      candidates.push_back(std::abs(z[I + i]));
    }
  }
  std::sort(candidates.begin(), candidates.end());
  const size_t n = candidates.size();
  size_t widest = n / 4;
  for (size_t i = n / 4; i + 1 < 3 * n / 4; ++i) {
    if (candidates[i + 1] - candidates[i] > candidates[widest + 1] - candidates[widest]) widest = i;
  }
  const double c = 0.5 * (candidates[widest] + candidates[widest + 1]);
  const double margin = 0.5 * (candidates[widest + 1] - candidates[widest]);
  ASSERT_TRUE(c > 0.0 && margin > 1e-3)
      << "seed gives no usable gap: c " << c << ", margin " << margin;
  p.use_swiglu_clamp = true;
  p.swiglu_clamp = c;

  int64_t g_above = 0, g_inside = 0, u_above = 0, u_below = 0, u_inside = 0;
  for (int64_t s = 0; s < p.num_tokens * p.top_k; ++s) {
    if (p.topk_idx_TK[s] < 0) continue;
    const std::vector<double> z = gate_up(p, s);
    for (int64_t i = 0; i < I; ++i) {
      (z[i] > c ? g_above : g_inside) += 1;
      (z[I + i] > c ? u_above : z[I + i] < -c ? u_below : u_inside) += 1;
    }
  }
  ASSERT_TRUE(g_above > 0 && g_inside > 0 && u_above > 0 && u_below > 0 && u_inside > 0)
      << "clamp not exercised both ways: g " << g_above << "/" << g_inside << ", u " << u_above
      << "/" << u_below << "/" << u_inside;
  check_gradients_by_finite_differences(p, random_dy(p, rng));
}

// ---------------------------------------------------------------- invariants

TEST(ReferenceInvariants, MaskedSlotEqualsZeroWeightSlot) {
  std::mt19937_64 rng(42);
  const Problem p = random_problem(/*T=*/9, /*H=*/16, /*I=*/8, /*E=*/5, /*K=*/3, 0.3, rng);
  const std::vector<double> dy = random_dy(p, rng);
  // Same layer, but each masked slot routed to a real expert with weight 0. The masked slots'
  // own weights are NaN: a masked slot's weight is never read.
  Problem masked_nan = p, zero_weight = p;
  int64_t num_masked = 0;
  for (int64_t s = 0; s < p.num_tokens * p.top_k; ++s) {
    if (p.topk_idx_TK[s] >= 0) continue;
    ++num_masked;
    masked_nan.topk_w_TK[s] = std::numeric_limits<double>::quiet_NaN();
    zero_weight.topk_idx_TK[s] = static_cast<int32_t>(s % p.num_experts);
    zero_weight.topk_w_TK[s] = 0.0;
  }
  ASSERT_TRUE(num_masked > 0);
  EXPECT_TRUE(all_equal(forward(masked_nan), forward(zero_weight)));
  const Gradients masked = backward(masked_nan, dy), zeroed = backward(zero_weight, dy);
  EXPECT_TRUE(all_equal(masked.dx_TH, zeroed.dx_TH));
  EXPECT_TRUE(all_equal(masked.dw13_EFH, zeroed.dw13_EFH));
  EXPECT_TRUE(all_equal(masked.dw2_EHI, zeroed.dw2_EHI));
  for (int64_t s = 0; s < p.num_tokens * p.top_k; ++s) {
    const double expected = p.topk_idx_TK[s] < 0 ? 0.0 : zeroed.d_topk_w_TK[s];
    EXPECT_TRUE(masked.d_topk_w_TK[s] == expected) << "slot " << s;
  }
}

TEST(ReferenceInvariants, MaskedSlotEqualsRemovedSlot) {
  std::mt19937_64 rng(43);
  Problem p = random_problem(/*T=*/7, /*H=*/16, /*I=*/8, /*E=*/5, /*K=*/3, 0.1, rng);
  const int64_t T = p.num_tokens, K = p.top_k;
  constexpr int64_t kRemoved = 1;
  Problem removed = p;
  removed.top_k = K - 1;
  removed.topk_idx_TK.clear();
  removed.topk_w_TK.clear();
  for (int64_t t = 0; t < T; ++t) {
    p.topk_idx_TK[t * K + kRemoved] = -1;
    for (int64_t j = 0; j < K; ++j) {
      if (j == kRemoved) continue;
      removed.topk_idx_TK.push_back(p.topk_idx_TK[t * K + j]);
      removed.topk_w_TK.push_back(p.topk_w_TK[t * K + j]);
    }
  }
  const std::vector<double> dy = random_dy(p, rng);
  EXPECT_TRUE(all_equal(forward(p), forward(removed)));
  const Gradients full = backward(p, dy), fewer = backward(removed, dy);
  EXPECT_TRUE(all_equal(full.dx_TH, fewer.dx_TH));
  EXPECT_TRUE(all_equal(full.dw13_EFH, fewer.dw13_EFH));
  EXPECT_TRUE(all_equal(full.dw2_EHI, fewer.dw2_EHI));
  std::vector<double> kept;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < K; ++j) {
      if (j == kRemoved) {
        EXPECT_TRUE(full.d_topk_w_TK[t * K + j] == 0.0) << "token " << t;
      } else {
        kept.push_back(full.d_topk_w_TK[t * K + j]);
      }
    }
  }
  EXPECT_TRUE(all_equal(kept, fewer.d_topk_w_TK));
}

// Two layers that must compute the same function: y and, for one dy, dx agree to rtol (at the
// scale of the first's values); returns both gradients for the test's own checks of the rest.
std::pair<Gradients, Gradients> same_y_and_dx(const Problem& first, const Problem& second,
                                              const std::vector<double>& dy, double rtol) {
  EXPECT_TRUE(close_at_scale(forward(second), forward(first), rtol));
  Gradients a = backward(first, dy), b = backward(second, dy);
  EXPECT_TRUE(close_at_scale(b.dx_TH, a.dx_TH, rtol));
  return {std::move(a), std::move(b)};
}

// Expert e renamed perm[e], its weights moved with it: y, dx and d_topk_w are unchanged and the
// weight gradients move with the experts.
TEST(ReferenceInvariants, ExpertRelabellingLeavesOutputsUnchanged) {
  std::mt19937_64 rng(44);
  const Problem p = random_problem(/*T=*/11, /*H=*/16, /*I=*/8, /*E=*/6, /*K=*/2, 0.1, rng);
  const int64_t E = p.num_experts, F_H = 2 * p.intermediate * p.hidden,
                H_I = p.hidden * p.intermediate;
  std::vector<int32_t> perm(E);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  ASSERT_FALSE(std::is_sorted(perm.begin(), perm.end()));
  Problem relabelled = p;
  for (int32_t& id : relabelled.topk_idx_TK) {
    if (id >= 0) id = perm[id];
  }
  for (int64_t e = 0; e < E; ++e) {
    std::copy_n(p.w13_EFH.begin() + e * F_H, F_H, relabelled.w13_EFH.begin() + perm[e] * F_H);
    std::copy_n(p.w2_EHI.begin() + e * H_I, H_I, relabelled.w2_EHI.begin() + perm[e] * H_I);
  }
  const auto [a, b] = same_y_and_dx(p, relabelled, random_dy(p, rng), 1e-14);
  EXPECT_TRUE(close_at_scale(b.d_topk_w_TK, a.d_topk_w_TK, 1e-14));
  std::vector<double> dw13_back(b.dw13_EFH.size()), dw2_back(b.dw2_EHI.size());
  for (int64_t e = 0; e < E; ++e) {
    std::copy_n(b.dw13_EFH.begin() + perm[e] * F_H, F_H, dw13_back.begin() + e * F_H);
    std::copy_n(b.dw2_EHI.begin() + perm[e] * H_I, H_I, dw2_back.begin() + e * H_I);
  }
  EXPECT_TRUE(all_equal(dw13_back, a.dw13_EFH));
  EXPECT_TRUE(all_equal(dw2_back, a.dw2_EHI));
}

// Slots (e, w_a) and (e, w_b) of one token are independent rows: together they equal one slot
// (e, w_a + w_b), and each gets the router gradient of that slot.
TEST(ReferenceInvariants, RepeatedIdsAreIndependentSlots) {
  std::mt19937_64 rng(45);
  Problem twice = random_problem(/*T=*/8, /*H=*/16, /*I=*/8, /*E=*/4, /*K=*/2, 0.0, rng);
  Problem once = twice;
  once.top_k = 1;
  once.topk_idx_TK.assign(twice.num_tokens, 0);
  once.topk_w_TK.assign(twice.num_tokens, 0.0);
  for (int64_t t = 0; t < twice.num_tokens; ++t) {
    twice.topk_idx_TK[2 * t + 1] = twice.topk_idx_TK[2 * t];
    once.topk_idx_TK[t] = twice.topk_idx_TK[2 * t];
    once.topk_w_TK[t] = twice.topk_w_TK[2 * t] + twice.topk_w_TK[2 * t + 1];
  }
  const auto [a, b] = same_y_and_dx(once, twice, random_dy(twice, rng), 1e-13);
  EXPECT_TRUE(close_at_scale(b.dw13_EFH, a.dw13_EFH, 1e-13));
  EXPECT_TRUE(close_at_scale(b.dw2_EHI, a.dw2_EHI, 1e-13));
  std::vector<double> d_w_first, d_w_second;
  for (int64_t t = 0; t < twice.num_tokens; ++t) {
    d_w_first.push_back(b.d_topk_w_TK[2 * t]);
    d_w_second.push_back(b.d_topk_w_TK[2 * t + 1]);
  }
  EXPECT_TRUE(all_equal(d_w_first, a.d_topk_w_TK));
  EXPECT_TRUE(all_equal(d_w_second, a.d_topk_w_TK));
}

TEST(ReferenceInvariants, FullyMaskedTokenHasZeroOutputAndGradient) {
  std::mt19937_64 rng(46);
  Problem p = random_problem(/*T=*/5, /*H=*/16, /*I=*/8, /*E=*/4, /*K=*/2, 0.0, rng);
  constexpr int64_t kToken = 3;
  const int64_t H = p.hidden, K = p.top_k;
  for (int64_t j = 0; j < K; ++j) p.topk_idx_TK[kToken * K + j] = -1;
  const std::vector<double> dy = random_dy(p, rng);
  const std::vector<double> y = forward(p);
  const Gradients grads = backward(p, dy);
  const std::vector<double> zeros_H(H, 0.0), zeros_K(K, 0.0);
  EXPECT_TRUE(all_equal({y.begin() + kToken * H, y.begin() + (kToken + 1) * H}, zeros_H));
  EXPECT_TRUE(all_equal({grads.dx_TH.begin() + kToken * H, grads.dx_TH.begin() + (kToken + 1) * H},
                        zeros_H));
  EXPECT_TRUE(all_equal(
      {grads.d_topk_w_TK.begin() + kToken * K, grads.d_topk_w_TK.begin() + (kToken + 1) * K},
      zeros_K));
  EXPECT_TRUE(max_abs(y) > 0.0 && max_abs(grads.dx_TH) > 0.0);  // other tokens are live
}

TEST(ReferenceInvariants, ExpertWithoutRowsGetsZeroWeightGradients) {
  std::mt19937_64 rng(47);
  Problem p = random_problem(/*T=*/6, /*H=*/16, /*I=*/8, /*E=*/4, /*K=*/2, 0.0, rng);
  for (int32_t& id : p.topk_idx_TK) id = id % 2;  // experts 2 and 3 get no rows
  const Gradients grads = backward(p, random_dy(p, rng));
  const int64_t F_H = 2 * p.intermediate * p.hidden, H_I = p.hidden * p.intermediate;
  EXPECT_TRUE(all_equal({grads.dw13_EFH.begin() + 2 * F_H, grads.dw13_EFH.end()},
                        std::vector<double>(2 * F_H, 0.0)));
  EXPECT_TRUE(all_equal({grads.dw2_EHI.begin() + 2 * H_I, grads.dw2_EHI.end()},
                        std::vector<double>(2 * H_I, 0.0)));
  EXPECT_TRUE(max_abs(grads.dw13_EFH) > 0.0 && max_abs(grads.dw2_EHI) > 0.0);
}

TEST(ReferenceInvariants, ZeroTokens) {
  std::mt19937_64 rng(48);
  const Problem p = random_problem(/*T=*/0, /*H=*/16, /*I=*/8, /*E=*/4, /*K=*/2, 0.0, rng);
  EXPECT_TRUE(forward(p).empty());
  const Gradients grads = backward(p, {});
  EXPECT_TRUE(grads.dx_TH.empty());
  EXPECT_TRUE(grads.d_topk_w_TK.empty());
  EXPECT_TRUE(all_equal(grads.dw13_EFH, std::vector<double>(p.w13_EFH.size(), 0.0)));
  EXPECT_TRUE(all_equal(grads.dw2_EHI, std::vector<double>(p.w2_EHI.size(), 0.0)));
}

// ---------------------------------------------------------------- validation

TEST(ReferenceValidation, ExpertIdOutsideRangeThrows) {
  std::mt19937_64 rng(49);
  const Problem good = random_problem(/*T=*/4, /*H=*/8, /*I=*/4, /*E=*/3, /*K=*/2, 0.0, rng);
  const std::vector<double> dy = random_dy(good, rng);
  for (const int32_t bad_id : {-2, 3, 1000, std::numeric_limits<int32_t>::min()}) {
    Problem p = good;
    p.topk_idx_TK[5] = bad_id;
    EXPECT_TRUE(throws_naming([&] { forward(p); }, "topk_idx_TK[2, 1]")) << "id " << bad_id;
    EXPECT_TRUE(throws_naming([&] { backward(p, dy); }, "topk_idx_TK[2, 1]")) << "id " << bad_id;
  }
}

TEST(ReferenceValidation, InconsistentSizesThrow) {
  std::mt19937_64 rng(50);
  const Problem good = random_problem(/*T=*/4, /*H=*/8, /*I=*/4, /*E=*/3, /*K=*/2, 0.0, rng);
  const std::vector<double> dy = random_dy(good, rng);
  const auto expect_throw = [&](const std::function<void(Problem&)>& spoil, const char* name) {
    Problem p = good;
    spoil(p);
    EXPECT_TRUE(throws_naming([&] { forward(p); }, name));
  };
  expect_throw([](Problem& p) { p.x_TH.pop_back(); }, "x_TH");
  expect_throw([](Problem& p) { p.topk_idx_TK.push_back(0); }, "topk_idx_TK");
  expect_throw([](Problem& p) { p.topk_w_TK.pop_back(); }, "topk_w_TK");
  expect_throw([](Problem& p) { p.w13_EFH.pop_back(); }, "w13_EFH");
  expect_throw([](Problem& p) { p.w2_EHI.push_back(0.0); }, "w2_EHI");
  expect_throw([](Problem& p) { p.num_tokens = -1; }, "num_tokens");
  expect_throw([](Problem& p) { p.hidden = 0; }, "hidden");
  expect_throw([](Problem& p) { p.intermediate = 0; }, "intermediate");
  expect_throw([](Problem& p) { p.num_experts = 0; }, "num_experts");
  expect_throw([](Problem& p) { p.top_k = 0; }, "top_k");
  for (const double bad_clamp : {0.0, -1.0, double(NAN), double(INFINITY)}) {
    Problem p = good;
    p.use_swiglu_clamp = true;
    p.swiglu_clamp = bad_clamp;
    EXPECT_TRUE(throws_naming([&] { forward(p); }, "swiglu_clamp")) << "c = " << bad_clamp;
  }
  std::vector<double> short_dy(dy.begin(), dy.end() - 1);
  EXPECT_TRUE(throws_naming([&] { backward(good, short_dy); }, "dy_TH"));
  EXPECT_NO_THROW(backward(good, dy));
}

}  // namespace

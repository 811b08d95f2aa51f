// What both CPU references use (moe_reference.cpp, fp8_emulation.cpp): the validation of a
// Problem, the SwiGLU clamp and the arithmetic, so their checks, fp64 sums and row order are the
// same by construction. Internal to the two: not part of moe_reference.h.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "reference/moe_reference.h"

namespace fusemoe::reference {

// ---- validation of a Problem (both references; std::invalid_argument naming what is wrong) ----

inline void require(bool condition, const std::string& message) {
  if (!condition) throw std::invalid_argument("fusemoe::reference: " + message);
}

inline int64_t checked_product(int64_t a, int64_t b, const char* what) {
  require(a >= 0 && b >= 0 && (a == 0 || b <= std::numeric_limits<int64_t>::max() / a),
          std::string(what) + " overflows int64");
  return a * b;
}

inline void require_size(size_t actual, int64_t expected, const char* name, const char* shape) {
  const std::string message = std::string(name) + " must have " + shape + " = " +
                              std::to_string(expected) + " elements, got " + std::to_string(actual);
  require(actual == static_cast<size_t>(expected), message);
}

inline void validate(const Problem& p) {
  require(p.num_tokens >= 0, "num_tokens must be >= 0, got " + std::to_string(p.num_tokens));
  require(p.hidden >= 1, "hidden must be >= 1, got " + std::to_string(p.hidden));
  require(p.intermediate >= 1, "intermediate must be >= 1, got " + std::to_string(p.intermediate));
  require(p.num_experts >= 1, "num_experts must be >= 1, got " + std::to_string(p.num_experts));
  require(p.top_k >= 1, "top_k must be >= 1, got " + std::to_string(p.top_k));
  if (p.use_swiglu_clamp) {
    require(std::isfinite(p.swiglu_clamp) && p.swiglu_clamp > 0.0,
            "swiglu_clamp must be finite and > 0 when use_swiglu_clamp, got " +
                std::to_string(p.swiglu_clamp));
  }
  const int64_t num_slots = checked_product(p.num_tokens, p.top_k, "T*K");
  const int64_t ffn = checked_product(2, p.intermediate, "2*I");
  require_size(p.x_TH.size(), checked_product(p.num_tokens, p.hidden, "T*H"), "x_TH", "T*H");
  require_size(p.topk_idx_TK.size(), num_slots, "topk_idx_TK", "T*K");
  require_size(p.topk_w_TK.size(), num_slots, "topk_w_TK", "T*K");
  require_size(p.w13_EFH.size(),
               checked_product(p.num_experts, checked_product(ffn, p.hidden, "2I*H"), "E*2I*H"),
               "w13_EFH", "E*2I*H");
  require_size(
      p.w2_EHI.size(),
      checked_product(p.num_experts, checked_product(p.hidden, p.intermediate, "H*I"), "E*H*I"),
      "w2_EHI", "E*H*I");
  for (int64_t s = 0; s < num_slots; ++s) {
    const int32_t id = p.topk_idx_TK[s];
    if (id >= -1 && id < p.num_experts) continue;
    require(false, "topk_idx_TK[" + std::to_string(s / p.top_k) + ", " +
                       std::to_string(s % p.top_k) + "] = " + std::to_string(id) +
                       " is outside [-1, " + std::to_string(p.num_experts) + ")");
  }
}

// ---- arithmetic ----


// sum_k a[k] b[k] in four interleaved partial sums (a fixed order): the compiler may not
// reorder an fp64 sum itself, and one serial chain of adds made the forward 2.4x slower.
inline double dot(const double* a, const double* b, int64_t n) {
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t k = 0;
  for (; k + 4 <= n; k += 4) {
    for (int lane = 0; lane < 4; ++lane) acc[lane] += a[k + lane] * b[k + lane];
  }
  for (; k < n; ++k) acc[0] += a[k] * b[k];
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

inline double sigmoid(double v) {
  if (v >= 0.0) return 1.0 / (1.0 + std::exp(-v));
  const double e = std::exp(v);  // no overflow for large negative v
  return e / (1.0 + e);
}

// The SwiGLU clamp of one (g, u) when p.use_swiglu_clamp (c = p.swiglu_clamp): g <- min(g, c),
// u <- clamp(u, -c, c); pass_g / pass_u say whether the gradient flows through (g <= c,
// -c <= u <= c, inclusive, as torch.clamp). Comparisons with NaN are false, so NaN passes through
// unchanged, as in torch.clamp. Without the clamp g, u and the pass flags are left as they are.
inline void clamp_swiglu(const Problem& p, double& g, double& u, bool& pass_g, bool& pass_u) {
  if (!p.use_swiglu_clamp) return;
  const double c = p.swiglu_clamp;
  pass_g = !(g > c);
  pass_u = !(u > c) && !(u < -c);
  if (!pass_g) g = c;
  if (!pass_u) u = u > c ? c : -c;
}

// Flat slot indices s = t*K + j of each expert, ascending.
inline std::vector<std::vector<int64_t>> slots_by_expert(const Problem& p) {
  std::vector<std::vector<int64_t>> slots(static_cast<size_t>(p.num_experts));
  for (int64_t s = 0; s < p.num_tokens * p.top_k; ++s) {
    if (p.topk_idx_TK[s] >= 0) slots[p.topk_idx_TK[s]].push_back(s);
  }
  return slots;
}

}  // namespace fusemoe::reference

// CPU fp64 reference of the fusemoe layer, forward and backward, exactly as docs/design.md §1.
// Inputs are the already bf16-rounded values widened to double; every sum and product is fp64,
// nothing is rounded in between. This is the oracle for small shapes and for finite differences.
//   z = W1_e x_t; g = z[:I], u = z[I:]; (clamp: g <- min(g,c), u <- clamp(u,-c,c))
//   h = silu(g) * u;  o = W2_e h;  y_t = sum_j w[t,j] o_(t,j)   (masked slot idx = -1: skipped)
#pragma once

#include <cstdint>
#include <vector>

namespace fusemoe::reference {

struct Problem {
  int64_t num_tokens = 0;    // T
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I
  int64_t num_experts = 0;   // E
  int64_t top_k = 0;         // K
  bool use_swiglu_clamp = false;
  double swiglu_clamp = 0.0;
  std::vector<double> x_TH;         // [T, H]
  std::vector<int32_t> topk_idx_TK; // [T, K], -1 = masked; other ids must be in [0, E)
  std::vector<double> topk_w_TK;    // [T, K]
  std::vector<double> w13_EFH;      // [E, 2I, H]  (F = 2I: gate rows then up rows)
  std::vector<double> w2_EHI;       // [E, H, I]
};

struct Gradients {
  std::vector<double> dx_TH;        // [T, H]
  std::vector<double> d_topk_w_TK;  // [T, K] (0 for masked slots)
  std::vector<double> dw13_EFH;     // [E, 2I, H]
  std::vector<double> dw2_EHI;      // [E, H, I]
};

// Throws std::invalid_argument on inconsistent sizes or ids outside [-1, E).
std::vector<double> forward(const Problem& p);                               // y [T, H]
Gradients backward(const Problem& p, const std::vector<double>& dy_TH);

}  // namespace fusemoe::reference

// The arithmetic both CPU references use (moe_reference.cpp, fp8_emulation.cpp), so their fp64
// sums and their row order are the same by construction. Internal to the two: not part of
// moe_reference.h.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "reference/moe_reference.h"

namespace fusemoe::reference {

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

// Flat slot indices s = t*K + j of each expert, ascending.
inline std::vector<std::vector<int64_t>> slots_by_expert(const Problem& p) {
  std::vector<std::vector<int64_t>> slots(static_cast<size_t>(p.num_experts));
  for (int64_t s = 0; s < p.num_tokens * p.top_k; ++s) {
    if (p.topk_idx_TK[s] >= 0) slots[p.topk_idx_TK[s]].push_back(s);
  }
  return slots;
}

}  // namespace fusemoe::reference

// CPU fp64 reference of the fusemoe layer (docs/design.md §1, conventions in docs/numerics.md).
// Rows are visited expert by expert (ids ascending, then slots t*K+j ascending) so one expert's
// weights and gradients stay in cache; y_t is still combined in slot order j = 0..K-1.
// Masked slots (id -1) are skipped (weight never read), d_topk_w = 0. Repeated ids of a token are
// independent slots: each is its own row, and their contributions add.
// Clamp: g <- min(g, c), u <- clamp(u, -c, c); the gradient passes where g <= c and
// -c <= u <= c (inclusive, as torch.clamp). d_topk_w is computed as <h, W2^T dy> = <o, dy>.
// Backward costs 8·H·I multiply-adds per row (z recomputed); no other factor of T, K or E.
#include "reference/moe_reference.h"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "reference/reference_math.h"

namespace fusemoe::reference {
namespace {

// One row's SwiGLU state after the (optional) clamp; pass_* is true where the gradient flows
// through the clamp.
struct SwigluRow {
  std::vector<double> g_I, u_I, h_I;
  std::vector<bool> pass_g_I, pass_u_I;
};

// z = W1_e x_t, then clamp and h = silu(g) * u.
void swiglu_row(const Problem& p, const double* w13_FH, const double* x_H, SwigluRow& row) {
  const int64_t H = p.hidden, I = p.intermediate;
  for (int64_t i = 0; i < I; ++i) {
    double g = dot(w13_FH + i * H, x_H, H);
    double u = dot(w13_FH + (I + i) * H, x_H, H);
    bool pass_g = true, pass_u = true;
    clamp_swiglu(p, g, u, pass_g, pass_u);
    row.g_I[i] = g;
    row.u_I[i] = u;
    row.h_I[i] = g * sigmoid(g) * u;
    row.pass_g_I[i] = pass_g;
    row.pass_u_I[i] = pass_u;
  }
}

SwigluRow make_row(int64_t I) {
  SwigluRow row;
  for (auto* v : {&row.g_I, &row.u_I, &row.h_I}) v->assign(I, 0.0);
  row.pass_g_I.assign(I, true);
  row.pass_u_I.assign(I, true);
  return row;
}

}  // namespace

std::vector<double> forward(const Problem& p) {
  validate(p);
  const int64_t T = p.num_tokens, H = p.hidden, I = p.intermediate, K = p.top_k;
  const int64_t F = 2 * I;
  std::vector<double> o_SH(static_cast<size_t>(T * K * H), 0.0);  // per-slot expert outputs
  SwigluRow row = make_row(I);
  const auto slots = slots_by_expert(p);
  for (int64_t e = 0; e < p.num_experts; ++e) {
    const double* w13_FH = p.w13_EFH.data() + e * F * H;
    const double* w2_HI = p.w2_EHI.data() + e * H * I;
    for (const int64_t s : slots[e]) {
      swiglu_row(p, w13_FH, p.x_TH.data() + (s / K) * H, row);
      double* o_H = o_SH.data() + s * H;
      for (int64_t k = 0; k < H; ++k) o_H[k] = dot(w2_HI + k * I, row.h_I.data(), I);
    }
  }
  std::vector<double> y_TH(static_cast<size_t>(T * H), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < K; ++j) {
      const int64_t s = t * K + j;
      if (p.topk_idx_TK[s] < 0) continue;
      const double w = p.topk_w_TK[s];
      for (int64_t k = 0; k < H; ++k) y_TH[t * H + k] += w * o_SH[s * H + k];
    }
  }
  return y_TH;
}

Gradients backward(const Problem& p, const std::vector<double>& dy_TH) {
  validate(p);
  const int64_t T = p.num_tokens, H = p.hidden, I = p.intermediate, K = p.top_k;
  const int64_t F = 2 * I;
  require_size(dy_TH.size(), T * H, "dy_TH", "T*H");

  Gradients grads;
  grads.dx_TH.assign(static_cast<size_t>(T * H), 0.0);
  grads.d_topk_w_TK.assign(static_cast<size_t>(T * K), 0.0);
  grads.dw13_EFH.assign(p.w13_EFH.size(), 0.0);
  grads.dw2_EHI.assign(p.w2_EHI.size(), 0.0);

  SwigluRow row = make_row(I);
  std::vector<double> a_I(I), dz_F(F), wdy_H(H);
  const auto slots = slots_by_expert(p);
  for (int64_t e = 0; e < p.num_experts; ++e) {
    const double* w13_FH = p.w13_EFH.data() + e * F * H;
    const double* w2_HI = p.w2_EHI.data() + e * H * I;
    double* dw13_FH = grads.dw13_EFH.data() + e * F * H;
    double* dw2_HI = grads.dw2_EHI.data() + e * H * I;
    for (const int64_t s : slots[e]) {
      const int64_t t = s / K;
      const double w = p.topk_w_TK[s];
      const double* x_H = p.x_TH.data() + t * H;
      const double* dy_H = dy_TH.data() + t * H;
      swiglu_row(p, w13_FH, x_H, row);

      // a = W2_e^T dy_t;  d_topk_w = <h, a>;  dh = w * a.
      for (int64_t i = 0; i < I; ++i) a_I[i] = 0.0;
      for (int64_t k = 0; k < H; ++k) {
        for (int64_t i = 0; i < I; ++i) a_I[i] += w2_HI[k * I + i] * dy_H[k];
      }
      grads.d_topk_w_TK[s] = dot(row.h_I.data(), a_I.data(), I);

      // SwiGLU backward at the clamped (g, u), masked where the clamp bound is active.
      for (int64_t i = 0; i < I; ++i) {
        const double g = row.g_I[i], u = row.u_I[i], dh = w * a_I[i];
        const double sg = sigmoid(g);
        dz_F[i] = row.pass_g_I[i] ? dh * u * sg * (1.0 + g * (1.0 - sg)) : 0.0;
        dz_F[I + i] = row.pass_u_I[i] ? dh * g * sg : 0.0;
      }

      // dx_t += W1_e^T dz;  dW1_e += dz ⊗ x_t.
      double* dx_H = grads.dx_TH.data() + t * H;
      for (int64_t f = 0; f < F; ++f) {
        const double dz = dz_F[f];
        const double* w13_row = w13_FH + f * H;
        double* dw13_row = dw13_FH + f * H;
        for (int64_t k = 0; k < H; ++k) {
          dx_H[k] += w13_row[k] * dz;
          dw13_row[k] += dz * x_H[k];
        }
      }

      // dW2_e += (w dy_t) ⊗ h.
      for (int64_t k = 0; k < H; ++k) wdy_H[k] = w * dy_H[k];
      for (int64_t k = 0; k < H; ++k) {
        for (int64_t i = 0; i < I; ++i) dw2_HI[k * I + i] += wdy_H[k] * row.h_I[i];
      }
    }
  }
  return grads;
}

}  // namespace fusemoe::reference

// FP8 emulation reference (fp8_emulation.h). Per expert, its weights are quantized 128 x 128 and
// dequantized once into fp64 matrices; the expert's rows then run forward and backward in parallel
// (each row's outputs belong to that row alone), and the weight gradients in parallel over output
// rows, each summing the expert's rows in slot order. Activation quantization (x, h, dy, dz) is exactly
// reference/fp8_host.h's, on the bf16 values the kernels quantize.
#include "reference/fp8_emulation.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "reference/bf16_host.h"
#include "reference/fp8_host.h"
#include "reference/reference_math.h"

namespace fusemoe::reference {
namespace {

// Problem as reference::forward / backward take it (validate()), with H and I multiples of the
// 128 blocks.
void validate_fp8(const Problem& p) {
  validate(p);
  require(p.hidden % host::kFp8Block == 0 && p.intermediate % host::kFp8Block == 0,
          "fp8 emulation: hidden and intermediate must be multiples of 128, got " + std::to_string(p.hidden) +
              " and " + std::to_string(p.intermediate));
}

// fn(i) for i in [0, n) on all hardware threads, in contiguous chunks.
template <typename Fn>
void parallel_for(int64_t n, Fn&& fn) {
  const int64_t threads = std::min<int64_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t chunk = (n + threads - 1) / threads;
  for (int64_t c = 0; c < threads; ++c) {
    pool.emplace_back([&, c] {
      for (int64_t i = c * chunk; i < std::min(n, (c + 1) * chunk); ++i) fn(i);
    });
  }
  for (auto& t : pool) t.join();
}

double bf16(double v) { return host::round_to_bf16(static_cast<float>(v)); }

// The dequantized 128 x 128-block quantization of one expert's [rows, cols] weight into out
// (block rows in parallel: each is quantized on its own).
void dequantize_weight(const std::vector<double>& w, int64_t offset, int64_t rows, int64_t cols,
                       std::vector<double>& out) {
  out.resize(static_cast<size_t>(rows * cols));
  const int64_t block_cols = cols / host::kFp8Block;
  parallel_for(rows / host::kFp8Block, [&](int64_t br) {
    const int64_t first = br * host::kFp8Block * cols, n = host::kFp8Block * cols;
    std::vector<float> m(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) m[i] = static_cast<float>(w[offset + first + i]);
    std::vector<uint8_t> q(static_cast<size_t>(n));
    std::vector<float> scales(static_cast<size_t>(block_cols));
    host::fp8_quantize_matrix(m.data(), host::kFp8Block, cols, q.data(), scales.data());
    for (int64_t i = 0; i < n; ++i) {
      out[first + i] = static_cast<double>(host::e4m3_bits_to_float(q[i])) * scales[(i % cols) / host::kFp8Block];
    }
  });
}

// The dequantized 1 x 128-block quantization of a row of n values.
void dequantized_row(const double* row, int64_t n, double* out) {
  std::vector<float> v(row, row + n);
  std::vector<uint8_t> q(static_cast<size_t>(n));
  std::vector<float> scales(static_cast<size_t>(n / host::kFp8Block));
  host::fp8_quantize_row(v.data(), n, q.data(), scales.data());
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<double>(host::e4m3_bits_to_float(q[i])) * scales[i / host::kFp8Block];
  }
}

// fn(e, rows, w13, w2) for each expert with routed rows (slots_by_expert), its weights as the
// FP8 GEMMs read them: 128 x 128-block quantized and dequantized once.
template <typename Fn>
void for_each_routed_expert(const Problem& p, const std::vector<std::vector<int64_t>>& slots, Fn&& fn) {
  const int64_t H = p.hidden, I = p.intermediate, F = 2 * I;
  std::vector<double> w13, w2;  // reused: a fresh 60 MB per expert spent its time faulting pages in
  for (int64_t e = 0; e < p.num_experts; ++e) {
    const std::vector<int64_t>& rows = slots[e];
    if (rows.empty()) continue;
    dequantize_weight(p.w13_EFH, e * F * H, F, H, w13);
    dequantize_weight(p.w2_EHI, e * H * I, H, I, w2);
    fn(e, rows, w13, w2);
  }
}

// Dequantized 1 x 128 rows of a [T, H] tensor (x or dy), per token.
std::vector<double> dequantized_rows(const std::vector<double>& m, int64_t T, int64_t H) {
  std::vector<double> out(m.size());
  parallel_for(T, [&](int64_t t) { dequantized_row(m.data() + t * H, H, out.data() + t * H); });
  return out;
}

// The forward of every routed slot: ys [S, H] (bf16 values) and zb [S, 2I] (bf16 z).
struct ForwardRows {
  std::vector<double> ys_SH, zb_SF;
};

// The forward of one expert's rows (slots), into out's rows of those slots.
void forward_expert_rows(const Problem& p, const std::vector<int64_t>& rows, const std::vector<double>& w13,
                         const std::vector<double>& w2, const std::vector<double>& xdq_TH, ForwardRows& out) {
  const int64_t H = p.hidden, I = p.intermediate, K = p.top_k, F = 2 * I;
  parallel_for(static_cast<int64_t>(rows.size()), [&](int64_t i) {
    const int64_t s = rows[i], t = s / K;
    const double* x = xdq_TH.data() + t * H;
    std::vector<double> z(F), h(I), hdq(I);
    for (int64_t f = 0; f < F; ++f) {
      z[f] = dot(w13.data() + f * H, x, H);
      out.zb_SF[s * F + f] = bf16(z[f]);
    }
    for (int64_t c = 0; c < I; ++c) {
      double g = z[c], u = z[I + c];
      bool pass_g = true, pass_u = true;
      clamp_swiglu(p, g, u, pass_g, pass_u);
      h[c] = bf16(g * sigmoid(g) * u);
    }
    dequantized_row(h.data(), I, hdq.data());
    const double w = p.topk_w_TK[s];
    for (int64_t n = 0; n < H; ++n) out.ys_SH[s * H + n] = bf16(w * dot(w2.data() + n * I, hdq.data(), I));
  });
}

// out_t = bf16(sum over the token's valid slots, j in order) of per-slot rows.
std::vector<double> combine(const Problem& p, const std::vector<double>& rows_SH) {
  const int64_t T = p.num_tokens, H = p.hidden, K = p.top_k;
  std::vector<double> out(static_cast<size_t>(T * H), 0.0);
  parallel_for(T, [&](int64_t t) {
    for (int64_t n = 0; n < H; ++n) {
      double acc = 0.0;
      for (int64_t j = 0; j < K; ++j) {
        if (p.topk_idx_TK[t * K + j] >= 0) acc += rows_SH[(t * K + j) * H + n];
      }
      out[t * H + n] = bf16(acc);
    }
  });
  return out;
}

// The token-blocked quantization of one expert's n rows (LayerConfig::fp8_weight_grads),
// dequantized and transposed: out[c * n + i] for feature c of the expert's i-th row (slot order,
// the pools' order). value(i, c) is the bf16 value the kernels quantize. Blocks of 128 rows from
// the expert's first (the last one padded with zeros), each feature alone (1 x 128 along the
// rows) or 128 features together (128 x 128).
template <typename Value>
std::vector<double> token_blocked(int64_t n, int64_t cols, bool blocks_128x128, Value&& value) {
  std::vector<double> out(static_cast<size_t>(cols * n));
  const int64_t group = blocks_128x128 ? host::kFp8Block : 1;
  parallel_for(cols / group, [&](int64_t g) {
    std::vector<float> v(static_cast<size_t>(group * host::kFp8Block));
    for (int64_t b = 0; b * host::kFp8Block < n; ++b) {
      const int64_t rows = std::min<int64_t>(host::kFp8Block, n - b * host::kFp8Block);
      float amax = 0.0f;
      for (int64_t c = 0; c < group; ++c) {
        for (int64_t i = 0; i < rows; ++i) v[c * host::kFp8Block + i] = static_cast<float>(value(b * host::kFp8Block + i, g * group + c));
        amax = std::fmax(amax, host::fp8_amax(v.data() + c * host::kFp8Block, rows));
      }
      const host::Fp8BlockScale s = host::fp8_block_scale(amax);
      for (int64_t c = 0; c < group; ++c) {
        for (int64_t i = 0; i < rows; ++i) {
          out[(g * group + c) * n + b * host::kFp8Block + i] =
              static_cast<double>(host::e4m3_bits_to_float(host::fp8_quantize(v[c * host::kFp8Block + i], s))) * s.scale;
        }
      }
    }
  });
  return out;
}

}  // namespace

namespace {

// The backward's per-slot buffers (dz, w h, dx rows) beside the gradients.
struct BackwardRows {
  Gradients g;
  std::vector<double> dx_slots_SH, dz_SF, wh_SI;
};

// The backward of one expert's rows (dz, w h, d_topk_w and dx rows of its slots), then its
// weight gradients from the bf16 operands, rows in slot order.
void backward_expert_rows(const Problem& p, int64_t e, const std::vector<int64_t>& rows,
                          const std::vector<double>& w13, const std::vector<double>& w2,
                          const std::vector<double>& dy_TH, const std::vector<double>& dydq_TH,
                          const ForwardRows& fwd, BackwardRows& b, bool fp8_weight_grads) {
  const int64_t H = p.hidden, I = p.intermediate, K = p.top_k, F = 2 * I;
  Gradients& g = b.g;
  parallel_for(static_cast<int64_t>(rows.size()), [&](int64_t r) {
    const int64_t s = rows[r], t = s / K;
    const double w = p.topk_w_TK[s];
    const double* dy = dydq_TH.data() + t * H;
    std::vector<double> a(I, 0.0), dzdq(F);
    for (int64_t n = 0; n < H; ++n) {
      for (int64_t c = 0; c < I; ++c) a[c] += w2[n * I + c] * dy[n];
    }
    double dot = 0.0;
    double* dz = b.dz_SF.data() + s * F;
    for (int64_t c = 0; c < I; ++c) {
      double gv = fwd.zb_SF[s * F + c], uv = fwd.zb_SF[s * F + I + c];
      bool pass_g = true, pass_u = true;
      clamp_swiglu(p, gv, uv, pass_g, pass_u);
      const double sg = sigmoid(gv), si = gv * sg;
      const double hv = bf16(si * uv);
      dot += hv * a[c];
      const double dh = w * a[c];
      dz[c] = bf16(pass_g ? dh * uv * sg * (1.0 + gv * (1.0 - sg)) : 0.0);
      dz[I + c] = bf16(pass_u ? dh * si : 0.0);
      b.wh_SI[s * I + c] = bf16(w * hv);
    }
    g.d_topk_w_TK[s] = dot;
    dequantized_row(dz, F, dzdq.data());
    std::vector<double> dxs(H, 0.0);
    for (int64_t f = 0; f < F; ++f) {
      for (int64_t n = 0; n < H; ++n) dxs[n] += w13[f * H + n] * dzdq[f];
    }
    for (int64_t n = 0; n < H; ++n) b.dx_slots_SH[s * H + n] = bf16(dxs[n]);
  });
  double* dw2 = g.dw2_EHI.data() + e * H * I;
  double* dw13 = g.dw13_EFH.data() + e * F * H;
  if (fp8_weight_grads) {
    // dW2 = dq(dy^T, 1 x 128) dq(wh^T, 128 x 128), dW13 = dq(dz^T, 1 x 128) dq(x^T, 128 x 128)
    // over the expert's rows.
    const int64_t n = static_cast<int64_t>(rows.size());
    const auto dyT = token_blocked(n, H, false, [&](int64_t i, int64_t c) { return dy_TH[(rows[i] / K) * H + c]; });
    const auto whT = token_blocked(n, I, true, [&](int64_t i, int64_t c) { return b.wh_SI[rows[i] * I + c]; });
    const auto dzT = token_blocked(n, F, false, [&](int64_t i, int64_t c) { return b.dz_SF[rows[i] * F + c]; });
    const auto xT = token_blocked(n, H, true, [&](int64_t i, int64_t c) { return p.x_TH[(rows[i] / K) * H + c]; });
    parallel_for(H, [&](int64_t h) {
      for (int64_t c = 0; c < I; ++c) dw2[h * I + c] = dot(dyT.data() + h * n, whT.data() + c * n, n);
    });
    parallel_for(F, [&](int64_t f) {
      for (int64_t h = 0; h < H; ++h) dw13[f * H + h] = dot(dzT.data() + f * n, xT.data() + h * n, n);
    });
    return;
  }
  parallel_for(H, [&](int64_t n) {
    for (const int64_t s : rows) {
      const double dyv = dy_TH[(s / K) * H + n];
      for (int64_t c = 0; c < I; ++c) dw2[n * I + c] += dyv * b.wh_SI[s * I + c];
    }
  });
  parallel_for(F, [&](int64_t f) {
    for (const int64_t s : rows) {
      const double dzv = b.dz_SF[s * F + f];
      const double* x = p.x_TH.data() + (s / K) * H;
      for (int64_t n = 0; n < H; ++n) dw13[f * H + n] += dzv * x[n];
    }
  });
}

}  // namespace

Fp8Emulation fp8_emulated_layer(const Problem& p, const std::vector<double>& dy_TH, bool fp8_weight_grads) {
  validate_fp8(p);
  const int64_t T = p.num_tokens, H = p.hidden, I = p.intermediate, K = p.top_k, F = 2 * I;
  require_size(dy_TH.size(), T * H, "dy_TH", "T*H");
  const auto slots = slots_by_expert(p);
  const std::vector<double> xdq_TH = dequantized_rows(p.x_TH, T, H);
  const std::vector<double> dydq_TH = dequantized_rows(dy_TH, T, H);
  ForwardRows fwd;
  fwd.ys_SH.assign(static_cast<size_t>(T * K * H), 0.0);
  fwd.zb_SF.assign(static_cast<size_t>(T * K * F), 0.0);
  BackwardRows bwd;
  bwd.g.d_topk_w_TK.assign(static_cast<size_t>(T * K), 0.0);
  bwd.g.dw13_EFH.assign(p.w13_EFH.size(), 0.0);
  bwd.g.dw2_EHI.assign(p.w2_EHI.size(), 0.0);
  bwd.dx_slots_SH.assign(static_cast<size_t>(T * K * H), 0.0);
  bwd.dz_SF.assign(static_cast<size_t>(T * K * F), 0.0);
  bwd.wh_SI.assign(static_cast<size_t>(T * K * I), 0.0);
  // The backward of an expert's rows needs only their forward (z), not y: both run while the
  // expert's dequantized weights are at hand, which are made once per expert rather than twice.
  for_each_routed_expert(p, slots, [&](int64_t e, const std::vector<int64_t>& rows, const std::vector<double>& w13,
                                       const std::vector<double>& w2) {
    forward_expert_rows(p, rows, w13, w2, xdq_TH, fwd);
    backward_expert_rows(p, e, rows, w13, w2, dy_TH, dydq_TH, fwd, bwd, fp8_weight_grads);
  });
  bwd.g.dx_TH = combine(p, bwd.dx_slots_SH);
  return {combine(p, fwd.ys_SH), std::move(bwd.g)};
}

}  // namespace fusemoe::reference

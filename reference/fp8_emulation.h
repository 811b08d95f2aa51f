// FP8 emulation reference of Precision::kFp8Blockwise (docs/numerics.md#blockwise-fp8): the same
// quantization recipe at the same points as the fused kernels (reference/fp8_host.h), fp64 math
// in between, and the bf16 roundings where the kernels materialise bf16 values. The fused FP8
// path must stay close to it (a bug shows as a large difference), and its error against the fp64
// reference must not exceed the emulation's own by more than a small factor.
//   forward   xq = Q1x128(x_t); W13q, W2q = Q128x128(W); z = dq(xq) dq(W13q)^T;
//             h = bf16(silu(g) u) (clamped g, u); hq = Q1x128(h); o = dq(hq) dq(W2q)^T;
//             ys = bf16(w o); y_t = bf16(sum_j ys)
//   backward  zb = bf16(z); dyq = Q1x128(dy_t); a = dq(W2q)^T dq(dyq); h = bf16(silu(gb) ub);
//             d_topk_w = <h, a>; dz = bf16(SwiGLU'(w a)); wh = bf16(w h); dzq = Q1x128(dz);
//             dx_t = bf16(sum_j bf16(dq(dzq) dq(W13q))); dW2_e = sum dy_t (x) wh;
//             dW13_e = sum dz (x) x_t (weight gradients from unquantized bf16 operands; with
//             fp8_weight_grads from the token-blocked quantizations: dy and dz 1 x 128 along the
//             expert's rows, w h and x 128 x 128, the blocks from the expert's first row)
// Gradients pass straight through the quantizers. Inputs: a Problem whose x, w13, w2 (and dy)
// hold bf16 values. Rows run on all hardware threads (each output written by one thread).
#pragma once

#include <vector>

#include "reference/moe_reference.h"

namespace fusemoe::reference {

// The forward (y [T, H]) and the backward, sharing one forward pass.
struct Fp8Emulation {
  std::vector<double> y_TH;
  Gradients grads;
};
Fp8Emulation fp8_emulated_layer(const Problem& p, const std::vector<double>& dy_TH, bool fp8_weight_grads = false);

}  // namespace fusemoe::reference

// The backward GEMM steps shared by the fused and the expert-parallel backward (backward_gemms.h).
#include "pipelines/backward_gemms.h"

#include <cuda_bf16.h>

namespace fusemoe {

void BackwardPools::carve_pools(WorkspaceCarver& carver, int64_t rows, int64_t hidden, int64_t intermediate,
                                bool bf16_xs_dys) {
  if (bf16_xs_dys) {
    xs_RH = carver.take(rows * hidden * 2);
    dys_RH = carver.take(rows * hidden * 2);
  }
  dz_RF = carver.take(rows * 2 * intermediate * 2);
  wh_RI = carver.take(rows * intermediate * 2);
  dx_slots_SH = carver.take(rows * hidden * 2);
}

BackwardRows BackwardPools::weight_grad_rows() const {
  BackwardRows b{};
  b.xs = xs_RH;
  b.dys = dys_RH;
  b.dz = dz_RF;
  b.wh = wh_RI;
  return b;
}

int64_t launch_backward_dgrad(const Sm90Rows& rows, const LayerConfig& c, const BackwardRows& b, const void* w13,
                              const void* w3, const void* w2) {
  // z from the forward (the same routing, so the same row order) or recomputed here.
  const void* z = b.saved_z;
  if (z == nullptr) {
    Sm90RecomputeZParams rz;
    rz.rows = rows;
    rz.xs = b.xs;
    rz.w13 = w13;
    rz.w3 = w3;
    rz.z = b.z_scratch;
    launch_sm90_recompute_z(rz);
    z = b.z_scratch;
  }
  Sm90DgradSwigluParams d1;
  d1.rows = rows;
  d1.dys = b.dys;
  d1.w2 = w2;
  d1.z = z;
  d1.row_slot = b.weight_index;
  d1.topk_weights = b.weights;
  d1.dz = b.dz;
  d1.wh = b.wh;
  d1.router_partials = b.router_partials;
  d1.block_n = sm90_dgrad_block_n(rows.hidden);
  d1.use_swiglu_clamp = c.use_swiglu_clamp;
  d1.swiglu_clamp = c.swiglu_clamp;
  launch_sm90_dgrad_swiglu(d1);
  return sm90_dgrad_num_n_tiles(rows.intermediate, d1.block_n);
}

void launch_backward_weight_grads(const Sm90Rows& rows, const BackwardRows& b, void* dw13, void* dw3, void* dw2,
                                  WeightGradDtype dtype, bool accumulate) {
  Sm90WeightGradParams w2g;
  w2g.rows = rows;
  w2g.act_m = b.dys;
  w2g.act_n = b.wh;
  w2g.grad = dw2;
  w2g.m = rows.hidden;
  w2g.n = rows.intermediate;
  w2g.bf16_grad = dtype == WeightGradDtype::kBFloat16;
  w2g.accumulate = accumulate;
  if (dw2 != nullptr) launch_sm90_weight_grad(w2g);
  if (dw13 == nullptr) return;  // frozen gate/up weights
  Sm90WeightGradParams w13g = w2g;
  w13g.act_m = b.dz;
  w13g.act_n = b.xs;
  w13g.grad = dw13;
  w13g.m = 2 * rows.intermediate;
  w13g.n = rows.hidden;
  if (dw3 == nullptr) {
    launch_sm90_weight_grad(w13g);
    return;
  }
  // dz [R, 2I]: its gate columns for dW1, its up columns for dW3, rows 2I apart.
  const int64_t I = rows.intermediate;
  w13g.m = I;
  w13g.act_m_row_stride = 2 * I;
  launch_sm90_weight_grad(w13g);
  w13g.act_m = static_cast<const __nv_bfloat16*>(b.dz) + I;
  w13g.grad = dw3;
  launch_sm90_weight_grad(w13g);
}

}  // namespace fusemoe

// The GEMM steps the fused backward and the expert-parallel backward share, over a layer call's
// expert-sorted rows (rows.max_rows capacity, the count on the device):
//   z (unless saved) -> dgrad + SwiGLU (router partials per row and dgrad tile) -> weight grads
// The callers differ in where routing weights come from, where the dx rows go and how the router
// partials are reduced (the slot's own rank, or a source rank over NVLink).
#pragma once

#include "common/workspace_carver.h"
#include "fusemoe/fusemoe.h"
#include "launchers/sm90_grouped_gemm.h"

namespace fusemoe {

struct BackwardRows {
  const void* xs;                // [R_max, H] bf16 x rows in expert order
  const void* dys;               // [R_max, H] bf16 dy rows
  const void* saved_z;           // [R_max, 2I] the forward's z, or null (recomputed into z_scratch)
  void* z_scratch;               // [R_max, 2I] (unused with saved_z)
  void* dz;                      // [R_max, 2I] (output)
  void* wh;                      // [R_max, I] (output)
  float* router_partials;        // [R_max, sm90_router_partials_per_row(I)] (output)
  const int32_t* weight_index;   // [R_max] the row's index into weights
  const float* weights;          // routing weights
};

// The bf16 pools of a fused backward (BF16 and FP8), carved from its workspace after the routing
// plan; xs, dys, dz and wh are the weight gradients' operands.
struct BackwardPools {
  void* xs_RH = nullptr;        // gathered x
  void* dys_RH = nullptr;       // gathered dy
  void* dz_RF = nullptr;        // F = 2I
  void* wh_RI = nullptr;        // w * h
  void* dx_slots_SH = nullptr;  // per-slot dx rows (t*K + j)

  // bf16_xs_dys false: no xs, dys (the FP8 weight gradients read token-blocked pools instead).
  void carve_pools(WorkspaceCarver& carver, int64_t rows, int64_t hidden, int64_t intermediate,
                   bool bf16_xs_dys = true);
  // The rows of the weight gradients: the four operand pools, every other field null.
  BackwardRows weight_grad_rows() const;
};

// z (recomputed unless saved) and dgrad + SwiGLU; returns the router partials per row. w13 [E, 2I, H],
// or (w3 set) w13 is w1 [E, I, H] and w3 the up weights.
int64_t launch_backward_dgrad(const Sm90Rows& rows, const LayerConfig& config, const BackwardRows& b, const void* w13,
                              const void* w3, const void* w2);

// dW2 = dys^T wh and dW13 = dz^T xs for every expert of rows (zeroed or untouched when empty). dw3
// null: dw13 [E, 2I, H]; set: dW1 = dz[:, :I]^T xs into dw13 (then dw1 [E, I, H]) and dW3 =
// dz[:, I:]^T xs into dw3, two launches whose tiles are those of dW13 (I % 128 == 0, checked at the
// API), so every element is the same sum in the same order. dw2 null skips dW2, dw13 null skips
// dW13 (frozen weights: BackwardArgs).
void launch_backward_weight_grads(const Sm90Rows& rows, const BackwardRows& b, void* dw13, void* dw3, void* dw2,
                                  WeightGradDtype dtype, bool accumulate);

}  // namespace fusemoe

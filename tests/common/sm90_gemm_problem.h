// One problem for the sm90 grouped-GEMM instances (src/launchers/sm90_grouped_gemm.h), shared by
// their test suite and the kernel benchmark: the routed rows on the device, random bf16 inputs
// for every instance, NaN-poisoned outputs, one launch function per instance, and checks against
// the fp32 GPU reference (reference_gemm.h) computed from the same bf16 inputs.
//
// Every instance reads inputs of its own (random, pool rows >= R random too, so a row past its
// expert's end that leaked into a sum would show): the GEMMs are checked one by one.
//   gate/up   x [T, H] -> h [S, I], z [S, 2I]      down      h_in -> ys [S, H]
//   recompute xs -> z                               dgrad     dys, z_in -> dz, wh, d_topk_w
//   scatter   dz_in -> dx_slots [S, H]              weight    dW2 = dys^T wh_in [E, H, I],
//                                                   grads     dW13 = dz_in^T xs [E, 2I, H]
// xs = x gathered by row_slot (the operand the gate/up kernel gathers itself).
// A check passes when every element satisfies |out - ref| <= rtol |ref| + atol (NaN fails),
// rows of no expert keep their poison and, where asked, a second launch is bitwise equal.
// Legend: T tokens, K top-k, E experts, H hidden, I intermediate, S = T*K slots (R_max), R rows.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/device_buffer.h"
#include "common/device_checks.h"
#include "common/reference_gemm.h"
#include "common/routing.h"
#include "launchers/sm90_grouped_gemm.h"

namespace fusemoe::harness {

struct MoeShape {
  int64_t T = 0, K = 0, E = 0, H = 0, I = 0;
};

// One assertion's outcome.
struct Check {
  std::string what;
  bool ok = false;
  std::string detail;
};

enum class WeightGrad { kW2, kW13 };

class Sm90GemmProblem {
 public:
  // idx_TK: [T*K] expert ids (-1 masked); w_TK: routing weights.
  Sm90GemmProblem(const MoeShape& shape, const std::vector<int32_t>& idx_TK, const std::vector<float>& w_TK,
                  uint64_t seed, cudaStream_t stream = nullptr);

  const MoeShape& shape() const { return shape_; }
  const ExpertRows& expert_rows() const { return rows_; }
  int64_t num_rows() const { return rows_.num_rows(); }
  int64_t num_slots() const { return shape_.T * shape_.K; }
  // CTAs of every launch after this: at most n (Sm90Rows::num_sms); 0 = one per SM.
  void set_num_sms(int n) { num_sms_ = n; }

  // The clamp limit the *_clamp launches use: z ~ N(0, 1), so it is active on ~7% of g and
  // ~13% of u.
  static constexpr float kClampLimit = 1.5f;

  // ---- launches (asynchronous, on the problem's stream)
  void launch_gate_up(bool clamp, bool store_z) const;
  void launch_down() const;
  void launch_recompute_z() const;
  void launch_dgrad_swiglu(int block_n, bool clamp) const;
  void launch_router_reduce(int block_n) const;
  void launch_dgrad_scatter() const;
  void launch_weight_grad(WeightGrad which, bool bf16_grad, bool accumulate) const;
  void launch_gather_x() const;  // xs = x gathered by row_slot (library kernel)

  // ---- checks: outputs poisoned, launched, compared; `determinism`: launched again on
  // poisoned outputs with the tiles in the other order, bitwise equal. Each returns its checks
  // in order.
  std::vector<Check> check_gate_up(bool clamp, bool store_z, bool determinism);
  std::vector<Check> check_down(bool determinism);
  std::vector<Check> check_recompute_z(bool determinism);
  std::vector<Check> check_dgrad_swiglu(int block_n, bool clamp, bool determinism);
  std::vector<Check> check_dgrad_scatter(bool determinism);
  // fp32 and bf16 x overwrite and accumulate (onto itself: exactly 2x in fp32; onto random
  // values: ref + init in fp32, init + the bf16 gradient rounded once in bf16; experts without
  // rows untouched); overwritten experts without rows are 0.
  std::vector<Check> check_weight_grad(WeightGrad which, bool determinism);

  // Output buffers, for tests that compare launches with each other.
  const DeviceBuffer& h() const { return h_; }
  const DeviceBuffer& z() const { return z_; }

  // Operands, for baselines that run the same GEMMs (cuBLAS in the kernel benchmark).
  struct Operands {
    const void *x, *xs, *dys, *z_in, *dz_in, *wh_in, *h_in, *w13, *w2;
    void *h, *z, *ys, *dz, *wh, *dx_slots, *dw2, *dw13;
    const int32_t *offsets, *row_slot, *slot_row;
    const float* topk_w;
    float *partials, *d_topk_w;
  };
  Operands operands() const;
  // Gate/up and down take the tile order the layer would for this shape
  // (sm90_forward_dynamic_tile_order) instead of the dynamic one: what the kernel benchmark times.
  void follow_layer_tile_order() { dynamic_order_ = sm90_forward_dynamic_tile_order(shape_.E); }

 private:
  Sm90Rows sm90_rows() const;
  int num_sms_ = 0;
  // The rows r (or slots) with keep[r] still hold 0xFF bytes.
  Check kept_poison(const std::string& what, const DeviceBuffer& buffer, int64_t row_bytes,
                    const DeviceBuffer& keep) const;
  // [S, n] fp32: a [S, k] times the experts' weights w (reference_gemm.h).
  DeviceBuffer rows_reference(const DeviceBuffer& a, const DeviceBuffer& w, WeightLayout layout, int64_t k,
                              int64_t n) const;
  void poison_and_launch(const char* what, const std::vector<const DeviceBuffer*>& outputs,
                         const std::function<void()>& launch) const;
  // One bf16 output of rows (or slots, by options.out_row) against ref [R, n]: poisoned,
  // launched, compared; rows with keep[r] keep their poison; optionally launched again.
  std::vector<Check> check_rows_output(const std::string& what, const std::function<void()>& launch,
                                       const DeviceBuffer& out, const DeviceBuffer& ref, int64_t n,
                                       const CompareOptions& options, const DeviceBuffer& keep,
                                       bool determinism) const;
  // Launches again on poisoned outputs, tiles in the static order: every byte as the launch
  // before (dynamic order); and the dynamic order's counter is back at zero.
  Check rerun_is_bitwise_equal(const std::string& what, const std::vector<const DeviceBuffer*>& outputs,
                               const std::function<void()>& launch) const;

  MoeShape shape_;
  ExpertRows rows_;
  cudaStream_t stream_;
  // Gate/up and down take their tiles in the dynamic order from tile_counter_ ([2], zero between
  // launches), except the determinism reruns, which take the static order (the other GEMMs take
  // the static order either way).
  DeviceBuffer tile_counter_;
  bool dynamic_order_ = true;
  mutable bool static_tile_order_ = false;
  DeviceBuffer offsets_, row_slot_, slot_row_, topk_w_;
  DeviceBuffer row_keep_, slot_keep_;  // [S] uint8: 1 where the row (r >= R) / slot (no row) is never written
  DeviceBuffer x_, xs_, dys_, z_in_, dz_in_, wh_in_, h_in_, w13_, w2_;
  DeviceBuffer h_, z_, ys_, dz_, wh_, partials_, d_topk_w_, dx_slots_, dw2_, dw13_;
};

}  // namespace fusemoe::harness

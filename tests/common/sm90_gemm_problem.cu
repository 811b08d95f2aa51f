#include "common/sm90_gemm_problem.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>

#include "common/device.h"
#include "common/device_checks.h"
#include "common/reference_gemm.h"
#include "fusemoe/error.h"
#include "kernels/moe_elementwise.h"

namespace fusemoe::harness {
namespace {

using bf16 = __nv_bfloat16;

// Tolerances against the fp32 reference (atol as a fraction of rms(ref)): a bf16 output carries
// one rounding (relative 2^-8 = 3.9e-3) plus the fp32 sum-order difference, so 1e-2; fp32
// weight gradients differ only in sum order, 1e-3; the router gradient sums <h, a> over I in
// per-tile fp32 partials, 2e-3.
constexpr double kBf16Rtol = 1e-2, kFp32Rtol = 1e-3, kRouterRtol = 2e-3;
constexpr double kAtolOfRms = 1e-3, kRouterAtolOfRms = 2e-3;

// h_ref[r, c] = silu(g) * u with g = z[r, c], u = z[r, I + c], clamped when clamp > 0.
__global__ void reference_swiglu_forward(const float* z, int64_t rows, int64_t I, float clamp, float* h) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * I; i += stride) {
    const int64_t r = i / I, c = i - r * I;
    float g = z[r * 2 * I + c], u = z[r * 2 * I + I + c];
    if (clamp > 0.0f) {
      g = fminf(g, clamp);
      u = fminf(fmaxf(u, -clamp), clamp);
    }
    h[i] = g / (1.0f + expf(-g)) * u;
  }
}

// The SwiGLU backward from a = dys W2_e (fp32) and the kernel's bf16 z, one warp per row:
// dz [R, 2I], wh [R, I] and dot[r] = <h, a> with h rounded to bf16 as the forward stores it.
__global__ void reference_swiglu_backward(const float* a, const bf16* z, const int32_t* row_slot, const float* topk_w,
                                          int64_t rows, int64_t I, float clamp, float* dz, float* wh, float* dot) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const float w = topk_w[row_slot[r]];
  double sum = 0.0;
  for (int64_t c = lane; c < I; c += 32) {
    float g = __bfloat162float(z[r * 2 * I + c]), u = __bfloat162float(z[r * 2 * I + I + c]);
    float g_pass = 1.0f, u_pass = 1.0f;  // the clamp's gradient masks
    if (clamp > 0.0f) {
      g_pass = g <= clamp ? 1.0f : 0.0f;
      u_pass = (u >= -clamp && u <= clamp) ? 1.0f : 0.0f;
      g = fminf(g, clamp);
      u = fminf(fmaxf(u, -clamp), clamp);
    }
    const float s = 1.0f / (1.0f + expf(-g));
    const float silu = g * s;
    const float h = __bfloat162float(__float2bfloat16(silu * u));
    const float a_rc = a[r * I + c];
    sum += double(h) * a_rc;
    const float dh = w * a_rc;
    dz[r * 2 * I + c] = dh * u * s * (1.0f + g * (1.0f - s)) * g_pass;
    dz[r * 2 * I + I + c] = dh * silu * u_pass;
    wh[r * I + c] = w * h;
  }
  for (int d = 16; d > 0; d /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, d);
  if (lane == 0) dot[r] = static_cast<float>(sum);
}

DeviceBuffer bf16_buffer(int64_t count) { return DeviceBuffer(count * sizeof(bf16)); }
DeviceBuffer fp32_buffer(int64_t count) { return DeviceBuffer(count * sizeof(float)); }

Check compared(const std::string& what, const CompareResult& result, int64_t cols) {
  return Check{what, result.num_bad == 0, result.describe(cols)};
}

Check counted(const std::string& what, uint64_t count, const char* unit) {
  return Check{what, count == 0, std::to_string(count) + " " + unit};
}

CompareOptions bf16_options() {
  CompareOptions options;
  options.rtol = kBf16Rtol;
  options.atol_of_rms = kAtolOfRms;
  return options;
}

}  // namespace

Sm90GemmProblem::Sm90GemmProblem(const MoeShape& shape, const std::vector<int32_t>& idx_TK,
                                 const std::vector<float>& w_TK, uint64_t seed, cudaStream_t stream)
    : shape_(shape), rows_(sort_by_expert(idx_TK, shape.E)), stream_(stream) {
  const int64_t S = num_slots(), R = num_rows(), H = shape.H, I = shape.I, E = shape.E;
  FUSEMOE_CHECK(static_cast<int64_t>(idx_TK.size()) == S && static_cast<int64_t>(w_TK.size()) == S,
                "Sm90GemmProblem: " << idx_TK.size() << " ids for T*K = " << S);
  offsets_ = DeviceBuffer::from(rows_.offsets);
  tile_counter_ = DeviceBuffer::from(std::vector<int32_t>{0, 0});
  // [S] as the routing plan's: entries past R are never read (-1, as in a poisoned workspace).
  std::vector<int32_t> row_slot(S, -1);
  std::copy(rows_.row_slot.begin(), rows_.row_slot.end(), row_slot.begin());
  row_slot_ = DeviceBuffer::from(row_slot);
  slot_row_ = DeviceBuffer::from(rows_.slot_row);
  topk_w_ = DeviceBuffer::from(w_TK);
  std::vector<uint8_t> row_keep(S), slot_keep(S);
  for (int64_t r = 0; r < S; ++r) row_keep[r] = r >= R;
  for (int64_t s = 0; s < S; ++s) slot_keep[s] = rows_.slot_row[s] < 0;
  row_keep_ = DeviceBuffer::from(row_keep);
  slot_keep_ = DeviceBuffer::from(slot_keep);

  x_ = bf16_buffer(shape.T * H);
  xs_ = bf16_buffer(S * H);
  dys_ = bf16_buffer(S * H);
  z_in_ = bf16_buffer(S * 2 * I);
  dz_in_ = bf16_buffer(S * 2 * I);
  wh_in_ = bf16_buffer(S * I);
  h_in_ = bf16_buffer(S * I);
  w13_ = bf16_buffer(E * 2 * I * H);
  w2_ = bf16_buffer(E * H * I);
  // Scales keep every GEMM's output near 1 (z, o, a, dx), so that rounding, not range, sets
  // the error: rows ~ N(0, 1), weights ~ N(0, 1/K) for a sum over K.
  const float inv_sqrt_h = 1.0f / std::sqrt(static_cast<float>(H));
  const float inv_sqrt_i = 1.0f / std::sqrt(static_cast<float>(I));
  uint64_t stream_seed = seed * 16;
  fill_normal_bf16(x_.get(), shape.T * H, ++stream_seed, 1.0f, stream_);
  fill_normal_bf16(xs_.get(), S * H, ++stream_seed, 1.0f, stream_);
  fill_normal_bf16(dys_.get(), S * H, ++stream_seed, 1.0f, stream_);
  fill_normal_bf16(z_in_.get(), S * 2 * I, ++stream_seed, 1.0f, stream_);
  fill_normal_bf16(dz_in_.get(), S * 2 * I, ++stream_seed, 1.0f, stream_);
  fill_normal_bf16(wh_in_.get(), S * I, ++stream_seed, 1.0f, stream_);
  fill_normal_bf16(h_in_.get(), S * I, ++stream_seed, 1.0f, stream_);
  fill_normal_bf16(w13_.get(), E * 2 * I * H, ++stream_seed, inv_sqrt_h, stream_);
  fill_normal_bf16(w2_.get(), E * H * I, ++stream_seed, inv_sqrt_i, stream_);
  launch_gather_x();  // rows < R of xs; the rest stay random

  h_ = bf16_buffer(S * I);
  z_ = bf16_buffer(S * 2 * I);
  ys_ = bf16_buffer(S * H);
  dz_ = bf16_buffer(S * 2 * I);
  wh_ = bf16_buffer(S * I);
  partials_ = fp32_buffer(S * sm90_router_partials_per_row(I));
  d_topk_w_ = fp32_buffer(S);
  dx_slots_ = bf16_buffer(S * H);
  dw2_ = fp32_buffer(E * H * I);  // fp32-sized: a bf16 gradient uses the first half
  dw13_ = fp32_buffer(E * 2 * I * H);
  wait_device("Sm90GemmProblem inputs", stream_);
}

Sm90Rows Sm90GemmProblem::sm90_rows() const {
  Sm90Rows rows;
  rows.expert_offsets = offsets_.as<int32_t>();
  rows.max_rows = num_slots();
  rows.hidden = shape_.H;
  rows.intermediate = shape_.I;
  rows.num_experts = shape_.E;
  rows.stream = stream_;
  rows.num_sms = num_sms_;
  rows.tile_counter = static_tile_order_ || !dynamic_order_ ? nullptr : tile_counter_.as<int32_t>();
  return rows;
}

Sm90GemmProblem::Operands Sm90GemmProblem::operands() const {
  return Operands{x_.get(),  xs_.get(), dys_.get(), z_in_.get(), dz_in_.get(), wh_in_.get(),
                  h_in_.get(), w13_.get(), w2_.get(), h_.get(), z_.get(), ys_.get(),
                  dz_.get(), wh_.get(), dx_slots_.get(), dw2_.get(), dw13_.get(), offsets_.as<int32_t>(),
                  row_slot_.as<int32_t>(), slot_row_.as<int32_t>(), topk_w_.as<float>(), partials_.as<float>(),
                  d_topk_w_.as<float>()};
}

void Sm90GemmProblem::launch_gather_x() const {
  if (num_slots() == 0) return;
  launch_gather_rows_device_count(x_.get(), xs_.get(), nullptr, nullptr, row_slot_.as<int32_t>(),
                                  offsets_.as<int32_t>() + shape_.E, num_slots(), shape_.K, shape_.H, stream_);
}

// The params structs are filled in their declaration order (src/launchers/sm90_grouped_gemm.h).
void Sm90GemmProblem::launch_gate_up(bool clamp, bool store_z) const {
  launch_sm90_gate_up_swiglu({sm90_rows(), x_.get(), row_slot_.as<int32_t>(), shape_.K, w13_.get(), h_.get(),
                              store_z ? z_.get() : nullptr, clamp, clamp ? kClampLimit : 0.0f});
}

void Sm90GemmProblem::launch_down() const {
  launch_sm90_down_weighted(
      {sm90_rows(), h_in_.get(), w2_.get(), row_slot_.as<int32_t>(), topk_w_.as<float>(), ys_.get()});
}

void Sm90GemmProblem::launch_recompute_z() const {
  launch_sm90_recompute_z({sm90_rows(), xs_.get(), w13_.get(), z_.get()});
}

void Sm90GemmProblem::launch_dgrad_swiglu(int block_n, bool clamp) const {
  launch_sm90_dgrad_swiglu({sm90_rows(), dys_.get(), w2_.get(), z_in_.get(), row_slot_.as<int32_t>(),
                            topk_w_.as<float>(), dz_.get(), wh_.get(), partials_.as<float>(), block_n, clamp,
                            clamp ? kClampLimit : 0.0f});
}

void Sm90GemmProblem::launch_router_reduce(int block_n) const {
  launch_router_grad_reduce(partials_.as<float>(), sm90_dgrad_num_n_tiles(shape_.I, block_n),
                            slot_row_.as<int32_t>(), num_slots(), d_topk_w_.as<float>(), stream_);
}

void Sm90GemmProblem::launch_dgrad_scatter() const {
  launch_sm90_dgrad_scatter({sm90_rows(), dz_in_.get(), w13_.get(), row_slot_.as<int32_t>(), dx_slots_.get()});
}

void Sm90GemmProblem::launch_weight_grad(WeightGrad which, bool bf16_grad, bool accumulate) const {
  const bool w2 = which == WeightGrad::kW2;
  launch_sm90_weight_grad({sm90_rows(), w2 ? dys_.get() : dz_in_.get(), w2 ? wh_in_.get() : xs_.get(),
                           w2 ? dw2_.get() : dw13_.get(), w2 ? shape_.H : 2 * shape_.I, w2 ? shape_.I : shape_.H,
                           bf16_grad, accumulate});
}

Check Sm90GemmProblem::kept_poison(const std::string& what, const DeviceBuffer& buffer, int64_t row_bytes,
                                   const DeviceBuffer& keep) const {
  return counted(what + ": rows no expert owns keep their poison",
                 count_unpoisoned(buffer.get(), num_slots(), row_bytes, keep.as<uint8_t>()), "bytes written");
}

// ------------------------------------------------------------------------------------- checks

DeviceBuffer Sm90GemmProblem::rows_reference(const DeviceBuffer& a, const DeviceBuffer& w, WeightLayout layout,
                                             int64_t k, int64_t n) const {
  DeviceBuffer out = fp32_buffer(num_slots() * n);
  reference_rows_gemm(a.get(), w.get(), layout, offsets_.as<int32_t>(), shape_.E, num_slots(), k, n, out.as<float>(),
                      stream_);
  return out;
}

void Sm90GemmProblem::poison_and_launch(const char* what, const std::vector<const DeviceBuffer*>& outputs,
                                        const std::function<void()>& launch) const {
  for (const DeviceBuffer* b : outputs) b->poison();
  launch();
  wait_device(what, stream_);
}

Check Sm90GemmProblem::rerun_is_bitwise_equal(const std::string& what, const std::vector<const DeviceBuffer*>& outputs,
                                              const std::function<void()>& launch) const {
  std::vector<DeviceBuffer> first;
  for (const DeviceBuffer* b : outputs) {
    first.emplace_back(b->bytes());
    first.back().copy_from(*b);
  }
  const std::vector<int32_t> counter = tile_counter_.to_host<int32_t>();
  static_tile_order_ = true;
  poison_and_launch(what.c_str(), outputs, launch);
  static_tile_order_ = false;
  uint64_t differ = 0;
  for (size_t i = 0; i < outputs.size(); ++i) {
    differ += count_different_bytes(outputs[i]->get(), first[i].get(), first[i].bytes());
  }
  Check check = counted(what + ": a second launch, tiles in the static order, is bitwise equal", differ, "bytes differ");
  if (counter[0] != 0 || counter[1] != 0) {
    check.ok = false;
    check.detail += "; the dynamic order's counter was left at {" + std::to_string(counter[0]) + ", " +
                    std::to_string(counter[1]) + "}, not {0, 0}";
  }
  return check;
}

std::vector<Check> Sm90GemmProblem::check_gate_up(bool clamp, bool store_z, bool determinism) {
  const int64_t S = num_slots(), R = num_rows(), I = shape_.I;
  const std::string what = std::string("gate/up (") + (clamp ? "clamp" : "no clamp") + (store_z ? ", z stored)" : ")");
  const auto launch = [&] { launch_gate_up(clamp, store_z); };
  std::vector<Check> checks;
  poison_and_launch("gate/up", {&h_, &z_}, launch);
  const DeviceBuffer z_ref = rows_reference(xs_, w13_, WeightLayout::kNK, shape_.H, 2 * I);
  DeviceBuffer h_ref = fp32_buffer(S * I);
  if (R > 0) {
    reference_swiglu_forward<<<1024, 256, 0, stream_>>>(z_ref.as<float>(), R, I, clamp ? kClampLimit : 0.0f,
                                                        h_ref.as<float>());
    FUSEMOE_CUDA_CHECK(cudaGetLastError());
  }
  const CompareOptions options = bf16_options();
  checks.push_back(compared(what + " h = SwiGLU(x W13^T)",
                            compare(bf16_tensor(h_.get()), fp32_tensor(h_ref.get()), R, I, options), I));
  checks.push_back(kept_poison(what + " h", h_, I * 2, row_keep_));
  if (store_z) {
    checks.push_back(compared(what + " z = x W13^T (before the clamp)",
                              compare(bf16_tensor(z_.get()), fp32_tensor(z_ref.get()), R, 2 * I, options), 2 * I));
    checks.push_back(kept_poison(what + " z", z_, 2 * I * 2, row_keep_));
  }
  if (determinism) checks.push_back(rerun_is_bitwise_equal(what, {&h_, &z_}, launch));
  return checks;
}

std::vector<Check> Sm90GemmProblem::check_rows_output(const std::string& what, const std::function<void()>& launch,
                                                      const DeviceBuffer& out, const DeviceBuffer& ref, int64_t n,
                                                      const CompareOptions& options, const DeviceBuffer& keep,
                                                      bool determinism) const {
  std::vector<Check> checks;
  poison_and_launch(what.c_str(), {&out}, launch);
  checks.push_back(compared(what, compare(bf16_tensor(out.get()), fp32_tensor(ref.get()), num_rows(), n, options), n));
  checks.push_back(kept_poison(what, out, n * 2, keep));
  if (determinism) checks.push_back(rerun_is_bitwise_equal(what, {&out}, launch));
  return checks;
}

std::vector<Check> Sm90GemmProblem::check_down(bool determinism) {
  CompareOptions options = bf16_options();
  options.out_row = row_slot_.as<int32_t>();
  options.row_scale = topk_w_.as<float>();
  return check_rows_output("down ys[slot] = w[slot] (h W2^T)", [&] { launch_down(); }, ys_,
                           rows_reference(h_in_, w2_, WeightLayout::kNK, shape_.I, shape_.H), shape_.H, options,
                           slot_keep_, determinism);
}

std::vector<Check> Sm90GemmProblem::check_recompute_z(bool determinism) {
  return check_rows_output("recompute z = xs W13^T", [&] { launch_recompute_z(); }, z_,
                           rows_reference(xs_, w13_, WeightLayout::kNK, shape_.H, 2 * shape_.I), 2 * shape_.I,
                           bf16_options(), row_keep_, determinism);
}

std::vector<Check> Sm90GemmProblem::check_dgrad_scatter(bool determinism) {
  CompareOptions options = bf16_options();
  options.out_row = row_slot_.as<int32_t>();
  // dx = dz W13_e: W13 [E, 2I, H] is [E, K, N] here.
  return check_rows_output("dgrad scatter dx_slots[slot] = dz W13", [&] { launch_dgrad_scatter(); }, dx_slots_,
                           rows_reference(dz_in_, w13_, WeightLayout::kKN, 2 * shape_.I, shape_.H), shape_.H, options,
                           slot_keep_, determinism);
}

std::vector<Check> Sm90GemmProblem::check_dgrad_swiglu(int block_n, bool clamp, bool determinism) {
  const int64_t S = num_slots(), R = num_rows(), I = shape_.I;
  const std::string what = "dgrad + SwiGLU (block_n " + std::to_string(block_n) + (clamp ? ", clamp)" : ")");
  const int64_t num_n_tiles = sm90_dgrad_num_n_tiles(I, block_n);
  const auto launch = [&] {
    launch_dgrad_swiglu(block_n, clamp);
    launch_router_reduce(block_n);
  };
  const std::vector<const DeviceBuffer*> outputs = {&dz_, &wh_, &partials_, &d_topk_w_};
  std::vector<Check> checks;
  poison_and_launch("dgrad + SwiGLU, router reduce", outputs, launch);
  // a = dys W2_e: W2 [E, H, I] is [E, K, N] here.
  const DeviceBuffer a_ref = rows_reference(dys_, w2_, WeightLayout::kKN, shape_.H, I);
  DeviceBuffer dz_ref = fp32_buffer(S * 2 * I), wh_ref = fp32_buffer(S * I), dot_ref = fp32_buffer(S);
  if (R > 0) {
    reference_swiglu_backward<<<static_cast<unsigned>((R * 32 + 255) / 256), 256, 0, stream_>>>(
        a_ref.as<float>(), z_in_.as<bf16>(), row_slot_.as<int32_t>(), topk_w_.as<float>(), R, I,
        clamp ? kClampLimit : 0.0f, dz_ref.as<float>(), wh_ref.as<float>(), dot_ref.as<float>());
    FUSEMOE_CUDA_CHECK(cudaGetLastError());
  }
  const CompareOptions options = bf16_options();
  checks.push_back(compared(what + " dz = SwiGLU'(z) (dys W2) w",
                            compare(bf16_tensor(dz_.get()), fp32_tensor(dz_ref.get()), R, 2 * I, options), 2 * I));
  checks.push_back(compared(what + " wh = w h",
                            compare(bf16_tensor(wh_.get()), fp32_tensor(wh_ref.get()), R, I, options), I));
  CompareOptions router;
  router.out_row = row_slot_.as<int32_t>();
  router.rtol = kRouterRtol;
  router.atol_of_rms = kRouterAtolOfRms;
  checks.push_back(compared(what + " router gradient d_topk_w[slot] = <h, a>",
                            compare(fp32_tensor(d_topk_w_.get()), fp32_tensor(dot_ref.get()), R, 1, router), 1));
  const std::vector<float> d_topk_w = d_topk_w_.to_host<float>();
  int64_t nonzero = 0;
  for (int64_t s = 0; s < S; ++s) nonzero += rows_.slot_row[s] < 0 && !(d_topk_w[s] == 0.0f);
  checks.push_back(counted(what + " router gradient of slots without a row is 0", nonzero, "slots not 0"));
  checks.push_back(kept_poison(what + " dz", dz_, 2 * I * 2, row_keep_));
  checks.push_back(kept_poison(what + " wh", wh_, I * 2, row_keep_));
  checks.push_back(kept_poison(what + " router partials", partials_, num_n_tiles * 4, row_keep_));
  if (determinism) checks.push_back(rerun_is_bitwise_equal(what, outputs, launch));
  return checks;
}

std::vector<Check> Sm90GemmProblem::check_weight_grad(WeightGrad which, bool determinism) {
  const bool w2 = which == WeightGrad::kW2;
  const int64_t E = shape_.E, M = w2 ? shape_.H : 2 * shape_.I, N = w2 ? shape_.I : shape_.H;
  const int64_t count = E * M * N;
  const std::string name = w2 ? "dW2 = dys^T wh" : "dW13 = dz^T xs";
  const DeviceBuffer& grad = w2 ? dw2_ : dw13_;
  std::vector<Check> checks;
  DeviceBuffer ref = fp32_buffer(count);
  reference_weight_grad(w2 ? dys_.get() : dz_in_.get(), w2 ? wh_in_.get() : xs_.get(), offsets_.as<int32_t>(), E, M, N,
                        ref.as<float>(), stream_);
  std::vector<uint8_t> empty(E);  // experts without rows
  for (int64_t e = 0; e < E; ++e) empty[e] = rows_.counts[e] == 0;
  const DeviceBuffer empty_device = DeviceBuffer::from(empty);

  for (bool bf16_grad : {false, true}) {
    const std::string dtype = bf16_grad ? "bf16" : "fp32";
    const size_t elem = bf16_grad ? 2 : 4;
    const int64_t expert_bytes = M * N * static_cast<int64_t>(elem);
    const DeviceTensor out{grad.get(), bf16_grad ? DType::kBf16 : DType::kFp32};
    CompareOptions options;
    options.rtol = bf16_grad ? kBf16Rtol : kFp32Rtol;
    options.atol_of_rms = kAtolOfRms;

    // Overwrite: experts without rows come out 0.
    const auto overwrite = [&] { launch_weight_grad(which, bf16_grad, /*accumulate=*/false); };
    poison_and_launch("weight gradient", {&grad}, overwrite);
    checks.push_back(compared(name + " " + dtype, compare(out, fp32_tensor(ref.get()), E * M, N, options), N));
    checks.push_back(counted(name + " " + dtype + ": experts without rows are 0",
                             count_bytes_other_than(grad.get(), E, expert_bytes, empty_device.as<uint8_t>(), 0),
                             "bytes not 0"));
    if (determinism) checks.push_back(rerun_is_bitwise_equal(name + " " + dtype, {&grad}, overwrite));
    if (!bf16_grad) {
      // Onto its own result: exactly twice it (x + x is exact in fp32).
      DeviceBuffer first(grad.bytes());
      first.copy_from(grad);
      launch_weight_grad(which, false, /*accumulate=*/true);
      wait_device("weight gradient accumulate", stream_);
      CompareOptions exact;
      exact.addend = fp32_tensor(first.get());
      checks.push_back(compared(name + " fp32 accumulated onto itself is exactly 2x",
                                compare(out, fp32_tensor(first.get()), E * M, N, exact), N));
    }
    // bf16: the gradient this kernel adds is its overwrite result (the same sums, bitwise), so
    // keep it for the check below.
    DeviceBuffer rounded(bf16_grad ? grad.bytes() : 0);
    if (bf16_grad) rounded.copy_from(grad);
    // Onto random values: ref + init; experts without rows keep init bit for bit.
    DeviceBuffer init(count * elem);
    if (bf16_grad) {
      fill_normal_bf16(init.get(), count, 77 + static_cast<int>(which), 1.0f, stream_);
    } else {
      fill_normal_fp32(init.as<float>(), count, 77 + static_cast<int>(which), 1.0f, stream_);
    }
    FUSEMOE_CUDA_CHECK(cudaMemcpyAsync(grad.get(), init.get(), init.bytes(), cudaMemcpyDeviceToDevice, stream_));
    launch_weight_grad(which, bf16_grad, /*accumulate=*/true);
    wait_device("weight gradient accumulate", stream_);
    if (!bf16_grad) {
      CompareOptions accumulate = options;
      accumulate.addend = DeviceTensor{init.get(), out.dtype};
      checks.push_back(compared(name + " fp32 += init",
                                compare(out, fp32_tensor(ref.get()), E * M, N, accumulate), N));
    } else {
      // As autograd adds a bf16 gradient into a bf16 .grad: init plus the bf16-rounded gradient
      // (checked against ref above), rounded once: half an ulp of the sum (rtol 2^-8 leaves a
      // factor 2). Against ref + init directly the two roundings of a near-cancelling sum would
      // exceed any tolerance relative to the sum.
      CompareOptions one_rounding;
      one_rounding.addend = DeviceTensor{init.get(), out.dtype};
      one_rounding.rtol = 1.0 / 256;
      checks.push_back(compared(name + " bf16 += init: init + the bf16 gradient, rounded once",
                                compare(out, bf16_tensor(rounded.get()), E * M, N, one_rounding), N));
    }
    checks.push_back(counted(name + " " + dtype + " accumulate leaves experts without rows untouched",
                             count_different_bytes_in_rows(grad.get(), init.get(), E, expert_bytes,
                                                           empty_device.as<uint8_t>()),
                             "bytes changed"));
  }
  return checks;
}

}  // namespace fusemoe::harness

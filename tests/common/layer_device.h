// The layer on device memory, for tests that run many shapes or very large ones (the pressure test,
// the limits suite): buffers carved from one arena (no cudaMalloc per call), inputs filled on the
// device, outputs (unless told another fill) and workspace NaN-poisoned (0xFF) before every call,
// outputs compared on the
// device (relative L2, non-finite counts) and bitwise. The calls go through the public API.
// Inputs: x, dy ~ N(0, 1); w13 ~ N(0, 1/H), w2 ~ N(0, 1/I), so z, h and y are O(1).
// Legend: T tokens, H hidden, I intermediate, F = 2I, E experts, K top-k.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/device_buffer.h"
#include "common/device_checks.h"
#include "fusemoe/fusemoe.h"

namespace fusemoe::harness {

// Regions of one device allocation, 256-byte aligned (as cudaMalloc's), handed out in order and
// forgotten all at once by reset().
class DeviceArena {
 public:
  explicit DeviceArena(size_t capacity) : buffer_(capacity) {}
  // The bytes a take(bytes) uses up.
  static constexpr size_t footprint(size_t bytes) { return (bytes + 255) & ~size_t(255); }
  // Throws fusemoe::Error when the region does not fit.
  void* take(size_t bytes);
  void reset() { used_ = 0; }
  size_t capacity() const { return buffer_.bytes(); }

 private:
  DeviceBuffer buffer_;
  size_t used_ = 0;
};

inline size_t weight_grad_element_bytes(WeightGradDtype dtype) {
  return dtype == WeightGradDtype::kFloat32 ? 4 : 2;
}

// The largest workspace_bytes(config, impl) over the fp32 reference, the unfused and the fused
// layer: one workspace that serves all three.
size_t max_workspace_bytes(const LayerConfig& config);

struct LayerInputs {
  void *x_TH = nullptr, *dy_TH = nullptr, *w13_EFH = nullptr, *w2_EHI = nullptr;
  int32_t* idx_TK = nullptr;
  float* w_TK = nullptr;

  // Sized for config.max_tokens tokens.
  static size_t footprint(const LayerConfig& config);
  static LayerInputs carve(DeviceArena& arena, const LayerConfig& config);
  // x, dy of the first T tokens and the weights, from `seed` (the same values on any GPU).
  void fill_normal(const LayerConfig& config, int64_t num_tokens, uint64_t seed, cudaStream_t stream) const;
  // The first idx.size() slots; returns once the host vectors may be freed.
  void upload_routing(const std::vector<int32_t>& idx_TK_host, const std::vector<float>& w_TK_host,
                      cudaStream_t stream) const;
};

enum LayerOutput { kY, kDx, kDTopkWeights, kDw13, kDw2, kNumLayerOutputs };
constexpr const char* kLayerOutputNames[kNumLayerOutputs] = {"y", "dx", "d_topk_weights", "dw13", "dw2"};

struct LayerOutputs {
  void *y_TH = nullptr, *dx_TH = nullptr;
  float* d_topk_w_TK = nullptr;
  void *dw13_EFH = nullptr, *dw2_EHI = nullptr;
  WeightGradDtype grad_dtype = WeightGradDtype::kFloat32;

  static size_t footprint(const LayerConfig& config, WeightGradDtype grad_dtype);
  static LayerOutputs carve(DeviceArena& arena, const LayerConfig& config, WeightGradDtype grad_dtype);
  // Device pointer and bytes of one output for a call with T tokens.
  const void* pointer(LayerOutput which) const;
  size_t bytes(LayerOutput which, const LayerConfig& config, int64_t num_tokens) const;
};

// Starting values of accumulated weight gradients: n elements N(0, scale^2) of `dtype` (exact in
// it: drawn in it), from `seed`.
void fill_normal_weight_grads(void* out, int64_t n, WeightGradDtype dtype, uint64_t seed, float scale,
                              cudaStream_t stream);
// On `stream`: copies dw13 and dw2 (full size, out.grad_dtype) into out's weight gradients, the
// values an accumulating call adds onto.
void copy_weight_grads(const LayerConfig& config, const void* dw13, const void* dw2, const LayerOutputs& out,
                       cudaStream_t stream);

// How one call runs: the fields of ForwardArgs / BackwardArgs that are not tensors.
struct LayerCall {
  Impl impl = Impl::kFused;
  bool accumulate = false;  // the weight gradients are added to what the outputs hold
  void* saved_z = nullptr;  // Impl::kFused: saved by the forward, read by the backward
  void* workspace = nullptr;  // workspace_bytes(config, impl) bytes; each call is given its own need
  int32_t* expert_id_report = nullptr;
  bool sync_check_expert_ids = true;
  cudaStream_t stream = nullptr;
  // The byte the call's outputs (not saved_z, not the workspace) are filled with before it: 0xFF,
  // the NaN poison, by default. A byte whose bf16 and fp32 patterns are finite (kFiniteOutputFill)
  // tells an output the call left unwritten from a NaN it computed.
  uint8_t output_fill = 0xFF;
};
// 0x7E7E (bf16) and 0x7E7E7E7E (fp32) are both finite, about 8.4e37: no output of an O(1) layer.
constexpr uint8_t kFiniteOutputFill = 0x7E;

// On call.stream: fills y with call.output_fill, poisons saved_z (if given) and the workspace,
// then forward.
void run_forward_call(const LayerConfig& config, int64_t num_tokens, const LayerInputs& in, const LayerOutputs& out,
                      const LayerCall& call);
// On call.stream: fills dx, d_topk_weights and the weight gradients (unless call.accumulate) with
// call.output_fill, poisons the workspace, then backward.
void run_backward_call(const LayerConfig& config, int64_t num_tokens, const LayerInputs& in, const LayerOutputs& out,
                       const LayerCall& call);
inline void run_layer_call(const LayerConfig& config, int64_t num_tokens, const LayerInputs& in,
                           const LayerOutputs& out, const LayerCall& call) {
  run_forward_call(config, num_tokens, in, out, call);
  run_backward_call(config, num_tokens, in, out, call);
}

// Each output of `got` against `ref` (fp32 weight gradients, overwritten). dw13_init/dw2_init:
// what `got`'s weight gradients were accumulated onto (got's dtype), or null. No element
// tolerance: rel_l2, max_abs_err and the non-finite counts are the figures (waits for the device).
using LayerErrors = std::array<CompareResult, kNumLayerOutputs>;
LayerErrors compare_layer_outputs(const LayerConfig& config, int64_t num_tokens, const LayerOutputs& got,
                                  const LayerOutputs& ref, const void* dw13_init = nullptr,
                                  const void* dw2_init = nullptr);

// Bytes that differ between two calls' outputs, per output (waits for the device).
using LayerDifferences = std::array<uint64_t, kNumLayerOutputs>;
LayerDifferences count_layer_differences(const LayerConfig& config, int64_t num_tokens, const LayerOutputs& a,
                                         const LayerOutputs& b);

// FlashAttention-3's tolerance (docs/numerics.md): an implementation's error against the
// reference passes when err <= fa3_bound(error of the same-precision baseline); write the check
// as !(err <= bound) so that NaN fails.
constexpr double kFa3Atol = 1e-3;
inline double fa3_bound(double baseline_err, double atol = kFa3Atol) { return 2.0 * baseline_err + atol; }

}  // namespace fusemoe::harness

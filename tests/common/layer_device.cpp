#include "common/layer_device.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/call_inputs.h"

namespace fusemoe::harness {
namespace {

size_t x_bytes(const LayerConfig& c, int64_t tokens) { return static_cast<size_t>(tokens) * c.hidden * 2; }
size_t topk_bytes(const LayerConfig& c, int64_t tokens) { return static_cast<size_t>(tokens) * c.top_k * 4; }
size_t w13_elements(const LayerConfig& c) { return static_cast<size_t>(c.num_experts) * 2 * c.intermediate * c.hidden; }
size_t w2_elements(const LayerConfig& c) { return static_cast<size_t>(c.num_experts) * c.hidden * c.intermediate; }

}  // namespace

size_t max_workspace_bytes(const LayerConfig& config) {
  size_t bytes = 0;
  for (Impl impl : {Impl::kReferenceFp32, Impl::kUnfused, Impl::kFused}) {
    bytes = std::max(bytes, workspace_bytes(config, impl));
  }
  return bytes;
}

void* DeviceArena::take(size_t bytes) {
  const size_t size = footprint(bytes);
  FUSEMOE_CHECK(size <= capacity() - used_, "DeviceArena: " << bytes << " bytes asked, " << capacity() - used_
                                                            << " of " << capacity() << " left");
  void* region = static_cast<char*>(buffer_.get()) + used_;
  used_ += size;
  return region;
}

size_t LayerInputs::footprint(const LayerConfig& c) {
  return 2 * DeviceArena::footprint(x_bytes(c, c.max_tokens)) + DeviceArena::footprint(w13_elements(c) * 2) +
         DeviceArena::footprint(w2_elements(c) * 2) + 2 * DeviceArena::footprint(topk_bytes(c, c.max_tokens));
}

LayerInputs LayerInputs::carve(DeviceArena& arena, const LayerConfig& c) {
  LayerInputs in;
  in.x_TH = arena.take(x_bytes(c, c.max_tokens));
  in.dy_TH = arena.take(x_bytes(c, c.max_tokens));
  in.w13_EFH = arena.take(w13_elements(c) * 2);
  in.w2_EHI = arena.take(w2_elements(c) * 2);
  in.idx_TK = static_cast<int32_t*>(arena.take(topk_bytes(c, c.max_tokens)));
  in.w_TK = static_cast<float*>(arena.take(topk_bytes(c, c.max_tokens)));
  return in;
}

void LayerInputs::fill_normal(const LayerConfig& c, int64_t num_tokens, uint64_t seed, cudaStream_t stream) const {
  // Four streams of values from one seed: x, dy, w13, w2.
  fill_normal_bf16(x_TH, num_tokens * c.hidden, seed * 4 + 1, 1.0f, stream);
  fill_normal_bf16(dy_TH, num_tokens * c.hidden, seed * 4 + 2, 1.0f, stream);
  fill_normal_bf16(w13_EFH, static_cast<int64_t>(w13_elements(c)), seed * 4 + 3,
                   1.0f / std::sqrt(static_cast<float>(c.hidden)), stream);
  fill_normal_bf16(w2_EHI, static_cast<int64_t>(w2_elements(c)), seed * 4 + 4,
                   1.0f / std::sqrt(static_cast<float>(c.intermediate)), stream);
}

void LayerInputs::upload_routing(const std::vector<int32_t>& idx_TK_host, const std::vector<float>& w_TK_host,
                                 cudaStream_t stream) const {
  FUSEMOE_CHECK(idx_TK_host.size() == w_TK_host.size(), "upload_routing: " << idx_TK_host.size() << " ids, "
                                                                           << w_TK_host.size() << " weights");
  if (idx_TK_host.empty()) return;
  // Pageable sources: each copy returns once its source has been staged.
  FUSEMOE_CUDA_CHECK(cudaMemcpyAsync(idx_TK, idx_TK_host.data(), idx_TK_host.size() * 4, cudaMemcpyHostToDevice,
                                     stream));
  FUSEMOE_CUDA_CHECK(cudaMemcpyAsync(w_TK, w_TK_host.data(), w_TK_host.size() * 4, cudaMemcpyHostToDevice, stream));
}

size_t LayerOutputs::footprint(const LayerConfig& c, WeightGradDtype grad_dtype) {
  const size_t g = weight_grad_element_bytes(grad_dtype);
  return 2 * DeviceArena::footprint(x_bytes(c, c.max_tokens)) + DeviceArena::footprint(topk_bytes(c, c.max_tokens)) +
         DeviceArena::footprint(w13_elements(c) * g) + DeviceArena::footprint(w2_elements(c) * g);
}

LayerOutputs LayerOutputs::carve(DeviceArena& arena, const LayerConfig& c, WeightGradDtype grad_dtype) {
  const size_t g = weight_grad_element_bytes(grad_dtype);
  LayerOutputs out;
  out.grad_dtype = grad_dtype;
  out.y_TH = arena.take(x_bytes(c, c.max_tokens));
  out.dx_TH = arena.take(x_bytes(c, c.max_tokens));
  out.d_topk_w_TK = static_cast<float*>(arena.take(topk_bytes(c, c.max_tokens)));
  out.dw13_EFH = arena.take(w13_elements(c) * g);
  out.dw2_EHI = arena.take(w2_elements(c) * g);
  return out;
}

const void* LayerOutputs::pointer(LayerOutput which) const {
  switch (which) {
    case kY: return y_TH;
    case kDx: return dx_TH;
    case kDTopkWeights: return d_topk_w_TK;
    case kDw13: return dw13_EFH;
    case kDw2: return dw2_EHI;
    default: break;
  }
  FUSEMOE_CHECK(false, "LayerOutputs: no output " << static_cast<int>(which));
  return nullptr;
}

size_t LayerOutputs::bytes(LayerOutput which, const LayerConfig& c, int64_t num_tokens) const {
  const size_t g = weight_grad_element_bytes(grad_dtype);
  switch (which) {
    case kY:
    case kDx: return x_bytes(c, num_tokens);
    case kDTopkWeights: return topk_bytes(c, num_tokens);
    case kDw13: return w13_elements(c) * g;
    case kDw2: return w2_elements(c) * g;
    default: break;
  }
  FUSEMOE_CHECK(false, "LayerOutputs: no output " << static_cast<int>(which));
  return 0;
}

void fill_normal_weight_grads(void* out, int64_t n, WeightGradDtype dtype, uint64_t seed, float scale,
                              cudaStream_t stream) {
  if (dtype == WeightGradDtype::kFloat32) {
    fill_normal_fp32(static_cast<float*>(out), n, seed, scale, stream);
  } else {
    fill_normal_bf16(out, n, seed, scale, stream);
  }
}

void copy_weight_grads(const LayerConfig& config, const void* dw13, const void* dw2, const LayerOutputs& out,
                       cudaStream_t stream) {
  FUSEMOE_CUDA_CHECK(cudaMemcpyAsync(out.dw13_EFH, dw13, out.bytes(kDw13, config, 0), cudaMemcpyDeviceToDevice,
                                     stream));
  FUSEMOE_CUDA_CHECK(cudaMemcpyAsync(out.dw2_EHI, dw2, out.bytes(kDw2, config, 0), cudaMemcpyDeviceToDevice, stream));
}

namespace {

void fill(void* p, size_t bytes, uint8_t value, cudaStream_t stream) {
  if (bytes > 0) FUSEMOE_CUDA_CHECK(cudaMemsetAsync(p, value, bytes, stream));
}
void poison(void* p, size_t bytes, cudaStream_t stream) { fill(p, bytes, 0xFF, stream); }

// The fields ForwardArgs and BackwardArgs share: the inputs both read and how the call runs.
template <typename Args>
Args call_args(int64_t num_tokens, const LayerInputs& in, const LayerCall& call, size_t workspace_size) {
  Args a;
  set_layer_inputs(a, in.x_TH, in.idx_TK, in.w_TK, in.w13_EFH, in.w2_EHI, num_tokens, call.workspace, workspace_size);
  a.stream = call.stream;
  a.sync_check_expert_ids = call.sync_check_expert_ids;
  a.expert_id_report = call.expert_id_report;
  a.saved_z = call.saved_z;
  return a;
}

}  // namespace

void run_forward_call(const LayerConfig& config, int64_t num_tokens, const LayerInputs& in, const LayerOutputs& out,
                      const LayerCall& call) {
  const size_t workspace = workspace_bytes(config, call.impl, WorkspaceUse::kForward);
  fill(out.y_TH, out.bytes(kY, config, num_tokens), call.output_fill, call.stream);
  if (call.saved_z != nullptr) poison(call.saved_z, saved_z_bytes(config), call.stream);
  poison(call.workspace, workspace, call.stream);
  ForwardArgs a = call_args<ForwardArgs>(num_tokens, in, call, workspace);
  a.y = out.y_TH;
  forward(config, call.impl, a);
}

void run_backward_call(const LayerConfig& config, int64_t num_tokens, const LayerInputs& in, const LayerOutputs& out,
                       const LayerCall& call) {
  const size_t workspace = workspace_bytes(
      config, call.impl, call.saved_z != nullptr ? WorkspaceUse::kBackwardSavedZ : WorkspaceUse::kBackward);
  for (LayerOutput o : {kDx, kDTopkWeights, kDw13, kDw2}) {
    if (call.accumulate && (o == kDw13 || o == kDw2)) continue;
    fill(const_cast<void*>(out.pointer(o)), out.bytes(o, config, num_tokens), call.output_fill, call.stream);
  }
  poison(call.workspace, workspace, call.stream);
  BackwardArgs a = call_args<BackwardArgs>(num_tokens, in, call, workspace);
  a.dy = in.dy_TH;
  a.dx = out.dx_TH;
  a.d_topk_weights = out.d_topk_w_TK;
  a.dw13 = out.dw13_EFH;
  a.dw2 = out.dw2_EHI;
  a.weight_grad_dtype = out.grad_dtype;
  a.accumulate_weight_grads = call.accumulate;
  backward(config, call.impl, a);
}

LayerErrors compare_layer_outputs(const LayerConfig& config, int64_t num_tokens, const LayerOutputs& got,
                                  const LayerOutputs& ref, const void* dw13_init, const void* dw2_init) {
  FUSEMOE_CHECK(ref.grad_dtype == WeightGradDtype::kFloat32, "compare_layer_outputs: the reference's weight "
                                                             "gradients must be fp32");
  const DType grad = got.grad_dtype == WeightGradDtype::kFloat32 ? DType::kFp32 : DType::kBf16;
  const DType types[kNumLayerOutputs] = {DType::kBf16, DType::kBf16, DType::kFp32, grad, grad};
  const int64_t counts[kNumLayerOutputs] = {
      num_tokens * config.hidden, num_tokens * config.hidden, num_tokens * config.top_k,
      static_cast<int64_t>(w13_elements(config)), static_cast<int64_t>(w2_elements(config))};
  LayerErrors errors;
  for (int o = 0; o < kNumLayerOutputs; ++o) {
    CompareOptions options;
    options.atol = std::numeric_limits<double>::infinity();  // figures only: NaN errors still count as bad
    if (o == kDw13 && dw13_init != nullptr) options.addend = {dw13_init, grad};
    if (o == kDw2 && dw2_init != nullptr) options.addend = {dw2_init, grad};
    const DType ref_type = o == kDw13 || o == kDw2 ? DType::kFp32 : types[o];
    errors[o] = compare({got.pointer(static_cast<LayerOutput>(o)), types[o]},
                        {ref.pointer(static_cast<LayerOutput>(o)), ref_type}, 1, counts[o], options);
  }
  return errors;
}

LayerDifferences count_layer_differences(const LayerConfig& config, int64_t num_tokens, const LayerOutputs& a,
                                         const LayerOutputs& b) {
  FUSEMOE_CHECK(a.grad_dtype == b.grad_dtype, "count_layer_differences: weight gradients of two dtypes");
  LayerDifferences differences;
  for (int o = 0; o < kNumLayerOutputs; ++o) {
    const LayerOutput which = static_cast<LayerOutput>(o);
    differences[o] = count_different_bytes(a.pointer(which), b.pointer(which), a.bytes(which, config, num_tokens));
  }
  return differences;
}

}  // namespace fusemoe::harness

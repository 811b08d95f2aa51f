// fusemoe's PyTorch ops registered from C++ through PyTorch's stable ABI (torch/csrc/stable,
// PyTorch >= 2.10, so one build serves later releases): the schemas of torch.ops.fusemoe.* and
// kernels that check the tensors (tensor_checks.h), allocate the outputs and a per-call
// workspace from torch's caching allocator, and call the C ABI (fusemoe_c.h) on torch's current
// stream of x's device: validate -> configure -> launch, with no Python on the way.
// The kernels are registered for CompositeExplicitAutograd (every backend), so tensors on
// another device get ops.py's "must be on a CUDA device" error; a kernel registered for one
// backend from Python (the CPU tests' stand-ins) takes precedence there. The fake kernels and
// the autograd formula are Python's (python/fusemoe/ops.py, fp8.py, separate.py), registered on these ops by
// name. Every tensor's device is checked here, so the C calls skip their per-pointer CUDA
// queries (caller_checked_pointers). Shape legend: T tokens, H hidden, I expert intermediate,
// F = 2I, E experts, K top-k, S = T·K routed rows.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdio>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "fusemoe/fusemoe_c.h"
#include "torch_binding/errors.h"
#include "torch_binding/expert_id_reports.h"
#include "torch_binding/tensor_checks.h"

namespace fusemoe::torch_binding {
namespace {

using OptionalTensor = std::optional<Tensor>;

// ---- configure: the C layer of a call ----

int32_t impl_code(const std::string& impl) {
  int32_t code = 0;
  check_c_status(fusemoe_c_impl_code(impl.c_str(), &code));
  return code;
}

// _capi.layer(H, I, E, K, T, impl, swiglu_clamp, precision, fp8_weight_grads): max_tokens = T, the
// workspace is sized per call.
FusemoeCLayer c_layer(const LayerDims& d, const std::string& impl, std::optional<double> swiglu_clamp,
                      int32_t precision, bool fp8_weight_grads = false) {
  FusemoeCLayer layer{};
  layer.struct_size = sizeof(FusemoeCLayer);
  layer.impl_code = impl_code(impl);
  layer.hidden = d.hidden;
  layer.intermediate = d.intermediate;
  layer.num_experts = d.num_experts;
  layer.top_k = d.top_k;
  layer.max_tokens = d.num_tokens;
  layer.use_swiglu_clamp = swiglu_clamp.has_value() ? 1 : 0;
  layer.swiglu_clamp = swiglu_clamp.has_value() ? static_cast<float>(*swiglu_clamp) : 0.0f;
  layer.precision = precision;
  layer.fp8_weight_grads = fp8_weight_grads ? 1 : 0;
  return layer;
}

// ---- memory from torch's caching allocator ----

std::string gib(uint64_t num_bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f", static_cast<double>(num_bytes) / (1ull << 30));
  return text;
}

// The shim logs torch's own message (with the allocator's figures) when it refuses.
constexpr const char* kTorchSays = "PyTorch: its caching allocator failed (see the message it logged)";

// A contiguous CUDA tensor of `sizes` on `device`; `what` names it if torch cannot allocate it.
Tensor empty_cuda(std::initializer_list<int64_t> sizes, int32_t dtype, int32_t device, const char* what) {
  int64_t strides[3] = {};
  const int64_t ndim = static_cast<int64_t>(sizes.size());
  int64_t numel = 1;  // the row-major strides, then the product of the sizes
  for (int64_t i = ndim - 1; i >= 0; --i) {
    strides[i] = numel;
    numel *= sizes.begin()[i];
  }
  AtenTensorHandle handle = nullptr;
  if (aoti_torch_empty_strided(ndim, sizes.begin(), strides, dtype, aoti_torch_device_type_cuda(), device,
                               &handle) != AOTI_TORCH_SUCCESS) {
    const uint64_t num_bytes = static_cast<uint64_t>(numel) * aoti_torch_dtype_element_size(dtype);
    throw_error(ErrorKind::kOutOfMemory, "fusemoe: cannot allocate " + std::string(what) + " of " +
                                             std::to_string(num_bytes) + " bytes (" + gib(num_bytes) +
                                             " GiB) on cuda:" + std::to_string(device) +
                                             "; nothing was launched. " + kTorchSays);
  }
  return Tensor(handle);
}

Tensor empty_like_cuda(const Tensor& t, int32_t device, const char* what) {
  const auto s = t.sizes();
  const int32_t dtype = dtype_of(t);
  if (s.size() == 1) return empty_cuda({s[0]}, dtype, device, what);
  if (s.size() == 2) return empty_cuda({s[0], s[1]}, dtype, device, what);
  return empty_cuda({s[0], s[1], s[2]}, dtype, device, what);
}

// A workspace of the bytes one kind of call needs (ops._workspace: the caching allocator's
// blocks are 512-byte aligned, the library needs 256).
struct Workspace {
  Tensor buffer;
  uint64_t num_bytes;
};

Workspace workspace_for(const FusemoeCLayer& layer, int32_t use, const char* use_name, int32_t device) {
  uint64_t num_bytes = 0;
  check_c_status(fusemoe_c_workspace_bytes_for(&layer, use, &num_bytes));
  const int64_t size = static_cast<int64_t>(num_bytes > 0 ? num_bytes : 1), stride = 1;
  AtenTensorHandle handle = nullptr;
  if (aoti_torch_empty_strided(1, &size, &stride, aoti_torch_dtype_uint8(), aoti_torch_device_type_cuda(), device,
                               &handle) != AOTI_TORCH_SUCCESS) {
    throw_error(ErrorKind::kOutOfMemory,
                "fusemoe: cannot allocate the " + std::string(use_name) + " workspace of " +
                    std::to_string(num_bytes) + " bytes (" + gib(num_bytes) + " GiB) on cuda:" +
                    std::to_string(device) + " for H=" + std::to_string(layer.hidden) +
                    ", I=" + std::to_string(layer.intermediate) + ", E=" + std::to_string(layer.num_experts) +
                    ", K=" + std::to_string(layer.top_k) + ", T=" + std::to_string(layer.max_tokens) +
                    "; nothing was launched. " + kTorchSays);
  }
  return Workspace{Tensor(handle), num_bytes};
}

void* current_stream(int32_t device) {
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device, &stream));
  return stream;
}

// data_ptr() as the C ABI takes it: null for an empty tensor (T = 0 passes no token tensors).
void* data(const Tensor& t) { return t.data_ptr(); }

// ---- launch ----

// The tensors both directions read. w3_EIH null: w13_EFH is w13 [E, 2I, H]; set: separate gate
// and up weights (fusemoe.separate's ops), w13_EFH holds w1 [E, I, H] and w3_EIH the up weights.
// fp8_weights: the FP8 weight buffer, or null for bf16; fp8_weight_grads (the FP8 ops' option):
// the weight gradients' GEMMs in FP8 too (LayerConfig::fp8_weight_grads).
struct Inputs {
  const Tensor& x_TH;
  const Tensor& topk_idx_TK;
  const Tensor& topk_weights_TK;
  const Tensor& w13_EFH;
  const Tensor& w2_EHI;
  const Tensor* fp8_weights;
  const Tensor* w3_EIH = nullptr;
  bool fp8_weight_grads = false;

  bool separate() const { return w3_EIH != nullptr; }
  const char* api() const { return separate() ? kApiW1W3 : kApi; }  // the entry point messages name
};

// validate: the call's tensors (dy for a backward), then their device.
LayerDims check_call_inputs(const Inputs& in, const Tensor* dy_TH) {
  const LayerDims d =
      in.separate()
          ? check_inputs_w1w3(in.x_TH, in.topk_idx_TK, in.topk_weights_TK, in.w13_EFH, *in.w3_EIH, in.w2_EHI, dy_TH)
          : check_inputs(in.x_TH, in.topk_idx_TK, in.topk_weights_TK, in.w13_EFH, in.w2_EHI, dy_TH);
  check_cuda(in.x_TH, in.api());
  return d;
}

// The call's C layer: precision FP8 when the buffer is given, which is then checked against the
// library's size of it (fusemoe.fp8._check_fp8_weights, fusemoe.separate's for w1, w3).
FusemoeCLayer call_layer(const LayerDims& d, const Inputs& in, const std::string& impl,
                         std::optional<double> swiglu_clamp) {
  const bool fp8 = in.fp8_weights != nullptr;
  const FusemoeCLayer layer = c_layer(d, impl, swiglu_clamp,
                                      fp8 ? FUSEMOE_C_PRECISION_FP8_BLOCKWISE : FUSEMOE_C_PRECISION_BF16,
                                      in.fp8_weight_grads);
  if (fp8) {
    if (in.separate()) {
      check_fp8_dims(d.hidden, d.intermediate, kApiW1W3);
    } else {
      check_fp8_shapes(in.w13_EFH);
    }
    uint64_t expected = 0;
    check_c_status(fusemoe_c_fp8_weights_bytes(&layer, &expected));
    check_fp8_weights(*in.fp8_weights, in.w13_EFH, expected, in.separate() ? kFp8MadeByW1W3 : kFp8MadeBy,
                      in.api());
  }
  return layer;
}

// The fields the forward and backward args share (the C structs name them alike); w1 and w3 go to
// their own fields. An FP8 call gets null bf16 weights: their values are not read. Every tensor's
// device was checked, so the library skips its pointer queries.
template <typename CArgs>
CArgs shared_args(const Inputs& in, const LayerDims& d, const Workspace& workspace, int32_t* report,
                  int32_t device) {
  const bool fp8 = in.fp8_weights != nullptr;
  CArgs a{};
  a.struct_size = sizeof(CArgs);
  a.x = data(in.x_TH);
  a.topk_idx = static_cast<const int32_t*>(data(in.topk_idx_TK));
  a.topk_weights = static_cast<const float*>(data(in.topk_weights_TK));
  const void* w_gate_up = fp8 ? nullptr : data(in.w13_EFH);
  if (in.separate()) {
    a.w1 = w_gate_up;
    a.w3 = fp8 ? nullptr : data(*in.w3_EIH);
  } else {
    a.w13 = w_gate_up;
  }
  a.w2 = fp8 ? nullptr : data(in.w2_EHI);
  a.fp8_weights = fp8 ? data(*in.fp8_weights) : nullptr;
  a.num_tokens = d.num_tokens;
  a.workspace = data(workspace.buffer);
  a.workspace_bytes = workspace.num_bytes;
  a.expert_id_report = report;
  a.stream = current_stream(device);
  a.caller_checked_pointers = 1;
  return a;
}

// The forward ops. Returns (y, z): z [S, 2I] bf16 is the pre-activations the backward reuses
// (an opaque buffer) when save_z, else empty.
std::tuple<Tensor, Tensor> launch_forward(const Inputs& in, const std::string& impl, bool save_z,
                                          std::optional<double> swiglu_clamp) {
  const LayerDims d = check_call_inputs(in, nullptr);
  check_save_z(save_z, impl);
  const FusemoeCLayer layer = call_layer(d, in, impl, swiglu_clamp);
  const int32_t device = in.x_TH.get_device_index();
  Tensor y_TH = empty_like_cuda(in.x_TH, device, "y");
  Tensor z_SF = save_z ? empty_cuda({d.num_tokens * d.top_k, 2 * d.intermediate}, dtype_bfloat16(), device, "z")
                       : empty_cuda({0}, dtype_bfloat16(), device, "z");
  torch::stable::accelerator::DeviceGuard guard(device);
  int32_t* report = expert_id_report_for_call(device, d.num_experts, d.top_k);
  const Workspace workspace = workspace_for(layer, FUSEMOE_C_WORKSPACE_FORWARD, "forward", device);
  auto a = shared_args<FusemoeCForwardArgs>(in, d, workspace, report, device);
  a.y = data(y_TH);
  a.saved_z = z_SF.numel() > 0 ? data(z_SF) : nullptr;
  check_c_status(fusemoe_c_forward(&layer, &a));
  return {y_TH, z_SF};
}

// The weight gradients of a backward, in the weights' form: gate_up is dw13 [E, 2I, H] (dw3
// empty) or dw1 [E, I, H] beside dw3.
struct WeightGrads {
  Tensor gate_up;
  std::optional<Tensor> dw3;
  Tensor dw2_EHI;
};

// What a backward call returns: dx, d_topk_weights, and the weight gradients it wrote.
struct Gradients {
  Tensor dx_TH;
  Tensor d_topk_weights_TK;
  WeightGrads weight_grads;
};

// Which weight gradients a backward op with fresh gradients computes: a frozen weight's is not
// computed (its output is a 0-element tensor and the library gets a null pointer).
struct WantedGrads {
  bool gate_up = true;  // dw13, or dw1 and dw3
  bool down = true;     // dw2
};

// The backward ops: the weight gradients are written into fresh tensors of the weights' dtype
// (given null; only the wanted ones), or written (accumulate false) or added into the given ones.
Gradients launch_backward(const Tensor& dy_TH, const Inputs& in, const WeightGrads* given, bool accumulate,
                          const std::string& impl, const OptionalTensor& saved_z_SF,
                          std::optional<double> swiglu_clamp, WantedGrads wanted = {}) {
  const LayerDims d = check_call_inputs(in, &dy_TH);
  const int32_t device = in.x_TH.get_device_index();
  auto fresh = [&](bool want, const Tensor& weight, const char* name) {
    return want ? empty_like_cuda(weight, device, name) : empty_cuda({0}, dtype_of(weight), device, name);
  };
  const WeightGrads g = given != nullptr    ? *given
                        : in.separate() ? WeightGrads{fresh(wanted.gate_up, in.w13_EFH, "dw1"),
                                                      fresh(wanted.gate_up, *in.w3_EIH, "dw3"),
                                                      fresh(wanted.down, in.w2_EHI, "dw2")}
                                        : WeightGrads{fresh(wanted.gate_up, in.w13_EFH, "dw13"), std::nullopt,
                                                      fresh(wanted.down, in.w2_EHI, "dw2")};
  // A frozen weight stands in for its gradient in the check: the dtype a fresh gradient would
  // have, so the checks (one dtype among the gradients) are those of a call with every gradient.
  const Tensor& gate_up = wanted.gate_up ? g.gate_up : in.w13_EFH;
  const Tensor& down = wanted.down ? g.dw2_EHI : in.w2_EHI;
  const int32_t grad_dtype =
      in.separate() ? check_weight_grads_w1w3(gate_up, wanted.gate_up ? *g.dw3 : *in.w3_EIH, down, in.w13_EFH,
                                              *in.w3_EIH, in.w2_EHI)
                    : check_weight_grads(gate_up, down, in.w13_EFH, in.w2_EHI);
  const Tensor* saved_z = check_saved_z(saved_z_SF, d, in.x_TH, impl);
  const FusemoeCLayer layer = call_layer(d, in, impl, swiglu_clamp);
  Tensor dx_TH = empty_like_cuda(in.x_TH, device, "dx");
  Tensor d_topk_weights_TK = empty_like_cuda(in.topk_weights_TK, device, "d_topk_weights");
  torch::stable::accelerator::DeviceGuard guard(device);
  int32_t* report = expert_id_report_for_call(device, d.num_experts, d.top_k);
  const Workspace workspace =
      saved_z == nullptr
          ? workspace_for(layer, FUSEMOE_C_WORKSPACE_BACKWARD, "backward", device)
          : workspace_for(layer, FUSEMOE_C_WORKSPACE_BACKWARD_SAVED_Z, "backward_saved_z", device);
  auto a = shared_args<FusemoeCBackwardArgs>(in, d, workspace, report, device);
  a.weight_grad_dtype = grad_dtype;
  a.dy = data(dy_TH);
  a.dx = data(dx_TH);
  a.d_topk_weights = static_cast<float*>(data(d_topk_weights_TK));
  if (!wanted.gate_up) {
    // dw13, dw1 and dw3 stay null: dW13 is not computed.
  } else if (in.separate()) {
    a.dw1 = data(g.gate_up);
    a.dw3 = data(*g.dw3);
  } else {
    a.dw13 = data(g.gate_up);
  }
  a.dw2 = wanted.down ? data(g.dw2_EHI) : nullptr;
  a.accumulate_weight_grads = accumulate ? 1 : 0;
  a.saved_z = saved_z != nullptr ? data(*saved_z) : nullptr;
  check_c_status(fusemoe_c_backward(&layer, &a));
  return Gradients{dx_TH, d_topk_weights_TK, g};
}

// ---- the ops (schemas below) ----

std::tuple<Tensor, Tensor> moe_experts_forward(const Tensor& x_TH, const Tensor& topk_idx_TK,
                                               const Tensor& topk_weights_TK, const Tensor& w13_EFH,
                                               const Tensor& w2_EHI, const std::string& impl,
                                               bool /*grad_in_place: autograd's*/, bool save_z,
                                               std::optional<double> swiglu_clamp) {
  return launch_forward({x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, nullptr}, impl, save_z, swiglu_clamp);
}

std::tuple<Tensor, Tensor> moe_experts_fp8_forward(const Tensor& x_TH, const Tensor& topk_idx_TK,
                                                   const Tensor& topk_weights_TK, const Tensor& w13_EFH,
                                                   const Tensor& w2_EHI, const Tensor& fp8_weights,
                                                   const std::string& impl, bool /*grad_in_place*/, bool save_z,
                                                   std::optional<double> swiglu_clamp, bool fp8_weight_grads) {
  return launch_forward({x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, &fp8_weights, nullptr, fp8_weight_grads},
                        impl, save_z, swiglu_clamp);
}

using FourTensors = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using FiveTensors = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

// The backward ops of fresh gradients of w13: (dx, d_topk_weights, dw13, dw2); an unwanted
// gradient (frozen weight) is a 0-element tensor.
FourTensors w13_backward_fresh(const Tensor& dy_TH, const Inputs& in, const std::string& impl,
                               const OptionalTensor& saved_z_SF, std::optional<double> swiglu_clamp,
                               WantedGrads wanted) {
  Gradients g = launch_backward(dy_TH, in, nullptr, false, impl, saved_z_SF, swiglu_clamp, wanted);
  return {g.dx_TH, g.d_topk_weights_TK, g.weight_grads.gate_up, g.weight_grads.dw2_EHI};
}

// The backward ops of fresh gradients of w1, w3: (dx, d_topk_weights, dw1, dw3, dw2), as above.
FiveTensors w1w3_backward_fresh(const Tensor& dy_TH, const Inputs& in, const std::string& impl,
                                const OptionalTensor& saved_z_SF, std::optional<double> swiglu_clamp,
                                WantedGrads wanted) {
  Gradients g = launch_backward(dy_TH, in, nullptr, false, impl, saved_z_SF, swiglu_clamp, wanted);
  return {g.dx_TH, g.d_topk_weights_TK, g.weight_grads.gate_up, *g.weight_grads.dw3, g.weight_grads.dw2_EHI};
}

// The _into ops: (dx, d_topk_weights), the weight gradients written or added into weight_grads.
std::tuple<Tensor, Tensor> backward_into(const Tensor& dy_TH, const Inputs& in, const WeightGrads& weight_grads,
                                         bool accumulate, const std::string& impl, const OptionalTensor& saved_z_SF,
                                         std::optional<double> swiglu_clamp) {
  Gradients g = launch_backward(dy_TH, in, &weight_grads, accumulate, impl, saved_z_SF, swiglu_clamp);
  return {g.dx_TH, g.d_topk_weights_TK};
}

FourTensors moe_experts_backward(const Tensor& dy_TH, const Tensor& x_TH, const Tensor& topk_idx_TK,
                                 const Tensor& topk_weights_TK, const Tensor& w13_EFH, const Tensor& w2_EHI,
                                 const std::string& impl, const OptionalTensor& saved_z_SF,
                                 std::optional<double> swiglu_clamp, bool gate_up_grad, bool down_grad) {
  return w13_backward_fresh(dy_TH, {x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, nullptr}, impl, saved_z_SF,
                            swiglu_clamp, {gate_up_grad, down_grad});
}

FourTensors moe_experts_fp8_backward(const Tensor& dy_TH, const Tensor& x_TH, const Tensor& topk_idx_TK,
                                     const Tensor& topk_weights_TK, const Tensor& w13_EFH, const Tensor& w2_EHI,
                                     const Tensor& fp8_weights, const std::string& impl,
                                     const OptionalTensor& saved_z_SF, std::optional<double> swiglu_clamp,
                                     bool gate_up_grad, bool down_grad, bool fp8_weight_grads) {
  return w13_backward_fresh(
      dy_TH, {x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, &fp8_weights, nullptr, fp8_weight_grads}, impl,
      saved_z_SF, swiglu_clamp, {gate_up_grad, down_grad});
}

std::tuple<Tensor, Tensor> moe_experts_backward_into(const Tensor& dy_TH, const Tensor& x_TH,
                                                     const Tensor& topk_idx_TK, const Tensor& topk_weights_TK,
                                                     const Tensor& w13_EFH, const Tensor& w2_EHI,
                                                     const Tensor& dw13_EFH, const Tensor& dw2_EHI, bool accumulate,
                                                     const std::string& impl, const OptionalTensor& saved_z_SF,
                                                     std::optional<double> swiglu_clamp) {
  return backward_into(dy_TH, {x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, nullptr},
                       {dw13_EFH, std::nullopt, dw2_EHI}, accumulate, impl, saved_z_SF, swiglu_clamp);
}

std::tuple<Tensor, Tensor> moe_experts_fp8_backward_into(
    const Tensor& dy_TH, const Tensor& x_TH, const Tensor& topk_idx_TK, const Tensor& topk_weights_TK,
    const Tensor& w13_EFH, const Tensor& w2_EHI, const Tensor& fp8_weights, const Tensor& dw13_EFH,
    const Tensor& dw2_EHI, bool accumulate, const std::string& impl, const OptionalTensor& saved_z_SF,
    std::optional<double> swiglu_clamp, bool fp8_weight_grads) {
  return backward_into(dy_TH,
                       {x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, &fp8_weights, nullptr, fp8_weight_grads},
                       {dw13_EFH, std::nullopt, dw2_EHI}, accumulate, impl, saved_z_SF, swiglu_clamp);
}

// ---- separate gate and up weights (fusemoe.separate): w1, w3 [E, I, H] read in place ----

std::tuple<Tensor, Tensor> moe_experts_w1w3_forward(const Tensor& x_TH, const Tensor& topk_idx_TK,
                                                    const Tensor& topk_weights_TK, const Tensor& w1_EIH,
                                                    const Tensor& w3_EIH, const Tensor& w2_EHI, const std::string& impl,
                                                    bool /*grad_in_place: autograd's*/, bool save_z,
                                                    std::optional<double> swiglu_clamp) {
  return launch_forward({x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w2_EHI, nullptr, &w3_EIH}, impl, save_z,
                        swiglu_clamp);
}

std::tuple<Tensor, Tensor> moe_experts_w1w3_fp8_forward(const Tensor& x_TH, const Tensor& topk_idx_TK,
                                                        const Tensor& topk_weights_TK, const Tensor& w1_EIH,
                                                        const Tensor& w3_EIH, const Tensor& w2_EHI,
                                                        const Tensor& fp8_weights, const std::string& impl,
                                                        bool /*grad_in_place*/, bool save_z,
                                                        std::optional<double> swiglu_clamp, bool fp8_weight_grads) {
  return launch_forward({x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w2_EHI, &fp8_weights, &w3_EIH, fp8_weight_grads},
                        impl, save_z, swiglu_clamp);
}

FiveTensors moe_experts_w1w3_backward(const Tensor& dy_TH, const Tensor& x_TH, const Tensor& topk_idx_TK,
                                      const Tensor& topk_weights_TK, const Tensor& w1_EIH, const Tensor& w3_EIH,
                                      const Tensor& w2_EHI, const std::string& impl,
                                      const OptionalTensor& saved_z_SF, std::optional<double> swiglu_clamp,
                                      bool gate_up_grad, bool down_grad) {
  return w1w3_backward_fresh(dy_TH, {x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w2_EHI, nullptr, &w3_EIH}, impl,
                             saved_z_SF, swiglu_clamp, {gate_up_grad, down_grad});
}

FiveTensors moe_experts_w1w3_fp8_backward(const Tensor& dy_TH, const Tensor& x_TH, const Tensor& topk_idx_TK,
                                          const Tensor& topk_weights_TK, const Tensor& w1_EIH, const Tensor& w3_EIH,
                                          const Tensor& w2_EHI, const Tensor& fp8_weights, const std::string& impl,
                                          const OptionalTensor& saved_z_SF, std::optional<double> swiglu_clamp,
                                          bool gate_up_grad, bool down_grad, bool fp8_weight_grads) {
  return w1w3_backward_fresh(
      dy_TH, {x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w2_EHI, &fp8_weights, &w3_EIH, fp8_weight_grads}, impl,
      saved_z_SF, swiglu_clamp, {gate_up_grad, down_grad});
}

std::tuple<Tensor, Tensor> moe_experts_w1w3_backward_into(
    const Tensor& dy_TH, const Tensor& x_TH, const Tensor& topk_idx_TK, const Tensor& topk_weights_TK,
    const Tensor& w1_EIH, const Tensor& w3_EIH, const Tensor& w2_EHI, const Tensor& dw1_EIH, const Tensor& dw3_EIH,
    const Tensor& dw2_EHI, bool accumulate, const std::string& impl, const OptionalTensor& saved_z_SF,
    std::optional<double> swiglu_clamp) {
  return backward_into(dy_TH, {x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w2_EHI, nullptr, &w3_EIH},
                       {dw1_EIH, dw3_EIH, dw2_EHI}, accumulate, impl, saved_z_SF, swiglu_clamp);
}

std::tuple<Tensor, Tensor> moe_experts_w1w3_fp8_backward_into(
    const Tensor& dy_TH, const Tensor& x_TH, const Tensor& topk_idx_TK, const Tensor& topk_weights_TK,
    const Tensor& w1_EIH, const Tensor& w3_EIH, const Tensor& w2_EHI, const Tensor& fp8_weights,
    const Tensor& dw1_EIH, const Tensor& dw3_EIH, const Tensor& dw2_EHI, bool accumulate, const std::string& impl,
    const OptionalTensor& saved_z_SF, std::optional<double> swiglu_clamp, bool fp8_weight_grads) {
  return backward_into(dy_TH,
                       {x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w2_EHI, &fp8_weights, &w3_EIH, fp8_weight_grads},
                       {dw1_EIH, dw3_EIH, dw2_EHI}, accumulate, impl, saved_z_SF, swiglu_clamp);
}

// The FP8 weight buffer of bf16 w1, w3 [E, I, H] and w2 [E, H, I]: the bytes of quantize_weights_fp8
// for w13 = [w1; w3] (the library's overload).
// The FP8 weight buffer of checked weights of dims d on device: `a` holds the weights (w13 or
// w1, w3, and w2); the buffer, its size and the stream are filled in here.
Tensor quantize_into_new_buffer(LayerDims d, int32_t device, FusemoeCFp8QuantizeArgs a) {
  d.top_k = 1;  // the buffer depends on the weights' shape only (top_k, max_tokens: any valid values)
  const FusemoeCLayer layer = c_layer(d, "fused", std::nullopt, FUSEMOE_C_PRECISION_FP8_BLOCKWISE);
  uint64_t num_bytes = 0;
  check_c_status(fusemoe_c_fp8_weights_bytes(&layer, &num_bytes));
  Tensor buffer = empty_cuda({static_cast<int64_t>(num_bytes)}, dtype_uint8(), device, "the FP8 weight buffer");
  torch::stable::accelerator::DeviceGuard guard(device);
  a.struct_size = sizeof(FusemoeCFp8QuantizeArgs);
  a.buffer = data(buffer);
  a.buffer_bytes = num_bytes;
  a.stream = current_stream(device);
  check_c_status(fusemoe_c_quantize_weights_fp8(&layer, &a));
  return buffer;
}

Tensor quantize_weights_fp8_w1w3(const Tensor& w1_EIH, const Tensor& w3_EIH, const Tensor& w2_EHI) {
  const LayerDims d = check_quantize_inputs_w1w3(w1_EIH, w3_EIH, w2_EHI);
  check_cuda(w1_EIH, kApiW1W3);
  FusemoeCFp8QuantizeArgs a{};
  a.w1 = data(w1_EIH);
  a.w3 = data(w3_EIH);
  a.w2 = data(w2_EHI);
  return quantize_into_new_buffer(d, w1_EIH.get_device_index(), a);
}

// The FP8 weight buffer of bf16 w13 [E, 2I, H] and w2 [E, H, I] (fusemoe.fp8).
Tensor quantize_weights_fp8(const Tensor& w13_EFH, const Tensor& w2_EHI) {
  check_tensor(w13_EFH, "w13 (gate_up_proj)", 3, dtype_bfloat16());
  check_tensor(w2_EHI, "w2 (down_proj)", 3, dtype_bfloat16());
  check_fp8_shapes(w13_EFH);
  check_w2_matches_w13(w13_EFH, w2_EHI);
  check_cuda(w13_EFH);
  LayerDims d;
  d.num_experts = w13_EFH.size(0);
  d.intermediate = w13_EFH.size(1) / 2;
  d.hidden = w13_EFH.size(2);
  FusemoeCFp8QuantizeArgs a{};
  a.w13 = data(w13_EFH);
  a.w2 = data(w2_EHI);
  return quantize_into_new_buffer(d, w13_EFH.get_device_index(), a);
}

}  // namespace
}  // namespace fusemoe::torch_binding

// The schemas are those torch.library.custom_op infers from ops.py's, fp8.py's and separate.py's
// Python definitions (the ctypes path), so both paths define the same ops; a CPU test compares them.
// A fragment, not the namespace's one definition: fusemoe's Python code may add ops to it.
STABLE_TORCH_LIBRARY_FRAGMENT(fusemoe, m) {
  m.def("moe_experts_forward(Tensor x_TH, Tensor topk_idx_TK, Tensor topk_weights_TK, Tensor w13_EFH, "
        "Tensor w2_EHI, str impl, bool grad_in_place=False, bool save_z=False, float? swiglu_clamp=None) "
        "-> (Tensor, Tensor)");
  m.def("moe_experts_backward(Tensor dy_TH, Tensor x_TH, Tensor topk_idx_TK, Tensor topk_weights_TK, "
        "Tensor w13_EFH, Tensor w2_EHI, str impl, Tensor? saved_z_SF=None, float? swiglu_clamp=None, "
        "bool gate_up_grad=True, bool down_grad=True) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_experts_backward_into(Tensor dy_TH, Tensor x_TH, Tensor topk_idx_TK, Tensor topk_weights_TK, "
        "Tensor w13_EFH, Tensor w2_EHI, Tensor(a6!) dw13_EFH, Tensor(a7!) dw2_EHI, bool accumulate, str impl, "
        "Tensor? saved_z_SF=None, float? swiglu_clamp=None) -> (Tensor, Tensor)");
  m.def("moe_experts_fp8_forward(Tensor x_TH, Tensor topk_idx_TK, Tensor topk_weights_TK, Tensor w13_EFH, "
        "Tensor w2_EHI, Tensor fp8_weights, str impl, bool grad_in_place=False, bool save_z=False, "
        "float? swiglu_clamp=None, bool fp8_weight_grads=False) -> (Tensor, Tensor)");
  m.def("moe_experts_fp8_backward(Tensor dy_TH, Tensor x_TH, Tensor topk_idx_TK, Tensor topk_weights_TK, "
        "Tensor w13_EFH, Tensor w2_EHI, Tensor fp8_weights, str impl, Tensor? saved_z_SF=None, "
        "float? swiglu_clamp=None, bool gate_up_grad=True, bool down_grad=True, bool fp8_weight_grads=False) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_experts_fp8_backward_into(Tensor dy_TH, Tensor x_TH, Tensor topk_idx_TK, Tensor topk_weights_TK, "
        "Tensor w13_EFH, Tensor w2_EHI, Tensor fp8_weights, Tensor(a7!) dw13_EFH, Tensor(a8!) dw2_EHI, "
        "bool accumulate, str impl, Tensor? saved_z_SF=None, float? swiglu_clamp=None, "
        "bool fp8_weight_grads=False) -> (Tensor, Tensor)");
  m.def("quantize_weights_fp8(Tensor w13_EFH, Tensor w2_EHI) -> Tensor");
  m.def("moe_experts_w1w3_forward(Tensor x_TH, Tensor topk_idx_TK, Tensor topk_weights_TK, Tensor w1_EIH, "
        "Tensor w3_EIH, Tensor w2_EHI, str impl, bool grad_in_place=False, bool save_z=False, "
        "float? swiglu_clamp=None) -> (Tensor, Tensor)");
  m.def("moe_experts_w1w3_backward(Tensor dy_TH, Tensor x_TH, Tensor topk_idx_TK, Tensor topk_weights_TK, "
        "Tensor w1_EIH, Tensor w3_EIH, Tensor w2_EHI, str impl, Tensor? saved_z_SF=None, "
        "float? swiglu_clamp=None, bool gate_up_grad=True, bool down_grad=True) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_experts_w1w3_backward_into(Tensor dy_TH, Tensor x_TH, Tensor topk_idx_TK, Tensor topk_weights_TK, "
        "Tensor w1_EIH, Tensor w3_EIH, Tensor w2_EHI, Tensor(a7!) dw1_EIH, Tensor(a8!) dw3_EIH, "
        "Tensor(a9!) dw2_EHI, bool accumulate, str impl, Tensor? saved_z_SF=None, float? swiglu_clamp=None) "
        "-> (Tensor, Tensor)");
  m.def("quantize_weights_fp8_w1w3(Tensor w1_EIH, Tensor w3_EIH, Tensor w2_EHI) -> Tensor");
  m.def("moe_experts_w1w3_fp8_forward(Tensor x_TH, Tensor topk_idx_TK, Tensor topk_weights_TK, Tensor w1_EIH, "
        "Tensor w3_EIH, Tensor w2_EHI, Tensor fp8_weights, str impl, bool grad_in_place=False, "
        "bool save_z=False, float? swiglu_clamp=None, bool fp8_weight_grads=False) -> (Tensor, Tensor)");
  m.def("moe_experts_w1w3_fp8_backward(Tensor dy_TH, Tensor x_TH, Tensor topk_idx_TK, Tensor topk_weights_TK, "
        "Tensor w1_EIH, Tensor w3_EIH, Tensor w2_EHI, Tensor fp8_weights, str impl, Tensor? saved_z_SF=None, "
        "float? swiglu_clamp=None, bool gate_up_grad=True, bool down_grad=True, bool fp8_weight_grads=False) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_experts_w1w3_fp8_backward_into(Tensor dy_TH, Tensor x_TH, Tensor topk_idx_TK, "
        "Tensor topk_weights_TK, Tensor w1_EIH, Tensor w3_EIH, Tensor w2_EHI, Tensor fp8_weights, "
        "Tensor(a8!) dw1_EIH, Tensor(a9!) dw3_EIH, Tensor(a10!) dw2_EHI, bool accumulate, str impl, "
        "Tensor? saved_z_SF=None, float? swiglu_clamp=None, bool fp8_weight_grads=False) -> (Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(fusemoe, CompositeExplicitAutograd, m) {
  using namespace fusemoe::torch_binding;
  m.impl("moe_experts_forward", TORCH_BOX(&moe_experts_forward));
  m.impl("moe_experts_backward", TORCH_BOX(&moe_experts_backward));
  m.impl("moe_experts_backward_into", TORCH_BOX(&moe_experts_backward_into));
  m.impl("moe_experts_fp8_forward", TORCH_BOX(&moe_experts_fp8_forward));
  m.impl("moe_experts_fp8_backward", TORCH_BOX(&moe_experts_fp8_backward));
  m.impl("moe_experts_fp8_backward_into", TORCH_BOX(&moe_experts_fp8_backward_into));
  m.impl("quantize_weights_fp8", TORCH_BOX(&quantize_weights_fp8));
  m.impl("moe_experts_w1w3_forward", TORCH_BOX(&moe_experts_w1w3_forward));
  m.impl("moe_experts_w1w3_backward", TORCH_BOX(&moe_experts_w1w3_backward));
  m.impl("moe_experts_w1w3_backward_into", TORCH_BOX(&moe_experts_w1w3_backward_into));
  m.impl("quantize_weights_fp8_w1w3", TORCH_BOX(&quantize_weights_fp8_w1w3));
  m.impl("moe_experts_w1w3_fp8_forward", TORCH_BOX(&moe_experts_w1w3_fp8_forward));
  m.impl("moe_experts_w1w3_fp8_backward", TORCH_BOX(&moe_experts_w1w3_fp8_backward));
  m.impl("moe_experts_w1w3_fp8_backward_into", TORCH_BOX(&moe_experts_w1w3_fp8_backward_into));
}

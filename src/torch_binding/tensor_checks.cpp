// The ops' tensor checks with ops.py's messages (tensor_checks.h). The happy path builds no
// string: messages are formatted only when a check fails.
#include "torch_binding/tensor_checks.h"

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/headeronly/util/shim_utils.h>

#include <sstream>

#include "fusemoe/fusemoe_c.h"
#include "torch_binding/errors.h"

namespace fusemoe::torch_binding {
namespace {

constexpr int64_t kFp8Block = 128;  // E4M3 scale block: H and I are multiples of it (fusemoe.fp8)

using Ints = torch::headeronly::IntHeaderOnlyArrayRef;

// tuple(t.shape) as Python prints it: (37, 128), (5,), ().
std::string py_tuple(Ints values) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < values.size(); ++i) out << (i ? ", " : "") << values[i];
  out << (values.size() == 1 ? ",)" : ")");
  return out.str();
}

// repr() of a string: 'fused'.
std::string py_repr(const std::string& text) {
  const bool double_quotes = text.find('\'') != std::string::npos && text.find('"') == std::string::npos;
  const char quote = double_quotes ? '"' : '\'';
  std::string out(1, quote);
  for (char c : text) {
    if (c == quote || c == '\\') out += '\\';
    out += c;
  }
  return out + quote;
}

// str(dtype): torch.bfloat16.
std::string dtype_string(int32_t dtype) {
  struct Name {
    int32_t (*code)();
    const char* name;
  };
  static const Name kNames[] = {
      {aoti_torch_dtype_bfloat16, "torch.bfloat16"}, {aoti_torch_dtype_float16, "torch.float16"},
      {aoti_torch_dtype_float32, "torch.float32"},   {aoti_torch_dtype_float64, "torch.float64"},
      {aoti_torch_dtype_uint8, "torch.uint8"},       {aoti_torch_dtype_int8, "torch.int8"},
      {aoti_torch_dtype_int16, "torch.int16"},       {aoti_torch_dtype_int32, "torch.int32"},
      {aoti_torch_dtype_int64, "torch.int64"},       {aoti_torch_dtype_bool, "torch.bool"},
      {aoti_torch_dtype_complex64, "torch.complex64"},
      {aoti_torch_dtype_complex128, "torch.complex128"},
      {aoti_torch_dtype_float8_e4m3fn, "torch.float8_e4m3fn"},
      {aoti_torch_dtype_float8_e5m2, "torch.float8_e5m2"},
  };
  for (const Name& n : kNames) {
    if (n.code() == dtype) return n.name;
  }
  return "dtype code " + std::to_string(dtype);
}

struct DeviceId {
  int32_t type = 0;
  int32_t index = -1;
  bool operator==(const DeviceId& o) const { return type == o.type && index == o.index; }
};

DeviceId device_of(const Tensor& t) {
  DeviceId d;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(t.get(), &d.type));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(t.get(), &d.index));
  return d;
}

std::string shape_string(const Tensor& t) { return py_tuple(t.sizes()); }

bool same_shape(const Tensor& a, const Tensor& b) { return a.sizes().equals(b.sizes()); }

}  // namespace

int32_t dtype_of(const Tensor& t) {
  int32_t dtype = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(t.get(), &dtype));
  return dtype;
}
int32_t dtype_bfloat16() { return aoti_torch_dtype_bfloat16(); }
int32_t dtype_float32() { return aoti_torch_dtype_float32(); }
int32_t dtype_int32() { return aoti_torch_dtype_int32(); }
int32_t dtype_uint8() { return aoti_torch_dtype_uint8(); }

void fail(const std::string& message, const char* api) {
  throw_error(ErrorKind::kArgument, std::string(api) + ": " + message);
}

std::string device_string(const Tensor& t) {
  const DeviceId d = device_of(t);
  std::string type;
  if (d.type == aoti_torch_device_type_cpu()) type = "cpu";
  else if (d.type == aoti_torch_device_type_cuda()) type = "cuda";
  else if (d.type == aoti_torch_device_type_meta()) type = "meta";
  else type = "device type " + std::to_string(d.type);
  return d.index < 0 ? type : type + ":" + std::to_string(d.index);
}

bool same_device(const Tensor& a, const Tensor& b) { return device_of(a) == device_of(b); }

bool is_cuda(const Tensor& t) { return device_of(t).type == aoti_torch_device_type_cuda(); }

void check_tensor(const Tensor& t, const char* name, int64_t ndim, int32_t dtype, const char* api) {
  if (t.dim() != ndim) {
    fail(std::string(name) + " must have " + std::to_string(ndim) + " dimensions, got shape " +
             shape_string(t),
         api);
  }
  if (dtype_of(t) != dtype) {
    fail(std::string(name) + " must be " + dtype_string(dtype) + ", got " + dtype_string(dtype_of(t)), api);
  }
  if (!t.is_contiguous()) {
    fail(std::string(name) + " must be contiguous (call .contiguous()), got strides " +
             py_tuple(t.strides()),
         api);
  }
}


namespace {

struct NamedTensor {
  const char* name;
  const Tensor* t;
};

// ops._check_dtypes: dtype, rank and contiguity of x, topk_idx, topk_weights and the bf16 rank-3
// weights, in that order.
void check_dtypes(const Tensor& x_TH, const Tensor& topk_idx_TK, const Tensor& topk_weights_TK,
                  std::initializer_list<NamedTensor> weights, const char* api) {
  check_tensor(x_TH, "x (hidden_states)", 2, dtype_bfloat16(), api);
  check_tensor(topk_idx_TK, "topk_idx", 2, dtype_int32(), api);
  check_tensor(topk_weights_TK, "topk_weights", 2, dtype_float32(), api);
  for (const NamedTensor& n : weights) check_tensor(*n.t, n.name, 3, dtype_bfloat16(), api);
}

// ops._check_routing: topk_idx, topk_weights and dy against x, and every tensor on x's device
// (weights: the layer's weights by name, in order).
void check_routing(const Tensor& x_TH, const Tensor& topk_idx_TK, const Tensor& topk_weights_TK, const Tensor* dy_TH,
                   std::initializer_list<NamedTensor> weights, LayerDims& d, const char* api) {
  if (topk_idx_TK.size(0) != d.num_tokens) {
    fail("topk_idx must be [T, K] with T = x.shape[0] = " + std::to_string(d.num_tokens) + ", got " +
             shape_string(topk_idx_TK),
         api);
  }
  if (!same_shape(topk_weights_TK, topk_idx_TK)) {
    fail("topk_weights must have the shape of topk_idx " + shape_string(topk_idx_TK) + ", got " +
             shape_string(topk_weights_TK),
         api);
  }
  d.top_k = topk_idx_TK.size(1);
  if (dy_TH != nullptr) {
    check_tensor(*dy_TH, "dy (grad of the output)", 2, dtype_bfloat16(), api);
    if (!same_shape(*dy_TH, x_TH)) {
      fail("dy must have the shape of x " + shape_string(x_TH) + ", got " + shape_string(*dy_TH), api);
    }
  }
  auto check_device = [&](const NamedTensor& n) {
    if (n.t != nullptr && !same_device(*n.t, x_TH)) {
      fail(std::string(n.name) + " is on " + device_string(*n.t) + " but x is on " + device_string(x_TH) +
               ": all tensors must be on one CUDA device",
           api);
    }
  };
  check_device({"topk_idx", &topk_idx_TK});
  check_device({"topk_weights", &topk_weights_TK});
  for (const NamedTensor& n : weights) check_device(n);
  check_device({"dy", dy_TH});
}

// w3 [E, I, H] as w1, and w2 [E, H, I] with w1's E, I and d.hidden (both the layer's and the
// quantize op's checks).
void check_w3_w2_match_w1(const Tensor& w1_EIH, const Tensor& w3_EIH, const Tensor& w2_EHI, const LayerDims& d,
                          const char* api) {
  if (!same_shape(w3_EIH, w1_EIH)) {
    fail("w3 (up) must have the shape of w1 (gate) " + shape_string(w1_EIH) + ", got " + shape_string(w3_EIH), api);
  }
  if (w2_EHI.size(0) != d.num_experts || w2_EHI.size(1) != d.hidden || w2_EHI.size(2) != d.intermediate) {
    fail("w2 (down) must be [E, H, I] = (" + std::to_string(d.num_experts) + ", " + std::to_string(d.hidden) +
             ", " + std::to_string(d.intermediate) + ") to match w1 " + shape_string(w1_EIH) + ", got " +
             shape_string(w2_EHI),
         api);
  }
}

}  // namespace

LayerDims check_inputs_w1w3(const Tensor& x_TH, const Tensor& topk_idx_TK, const Tensor& topk_weights_TK,
                            const Tensor& w1_EIH, const Tensor& w3_EIH, const Tensor& w2_EHI, const Tensor* dy_TH) {
  const char* api = kApiW1W3;
  const std::initializer_list<NamedTensor> weights = {{"w1 (gate)", &w1_EIH}, {"w3 (up)", &w3_EIH},
                                                      {"w2 (down)", &w2_EHI}};
  check_dtypes(x_TH, topk_idx_TK, topk_weights_TK, weights, api);
  LayerDims d;
  d.num_tokens = x_TH.size(0);
  d.hidden = x_TH.size(1);
  d.num_experts = w1_EIH.size(0);
  d.intermediate = w1_EIH.size(1);
  if (w1_EIH.size(2) != d.hidden) {
    fail("w1 (gate) must be [E, I, H] with H = x.shape[1] = " + std::to_string(d.hidden) + ", got " +
             shape_string(w1_EIH),
         api);
  }
  check_w3_w2_match_w1(w1_EIH, w3_EIH, w2_EHI, d, api);
  check_routing(x_TH, topk_idx_TK, topk_weights_TK, dy_TH, weights, d, api);
  return d;
}

LayerDims check_inputs(const Tensor& x_TH, const Tensor& topk_idx_TK, const Tensor& topk_weights_TK,
                       const Tensor& w13_EFH, const Tensor& w2_EHI, const Tensor* dy_TH) {
  const std::initializer_list<NamedTensor> weights = {{"w13 (gate_up_proj)", &w13_EFH},
                                                      {"w2 (down_proj)", &w2_EHI}};
  check_dtypes(x_TH, topk_idx_TK, topk_weights_TK, weights, kApi);
  LayerDims d;
  d.num_tokens = x_TH.size(0);
  d.hidden = x_TH.size(1);
  d.num_experts = w13_EFH.size(0);
  const int64_t two_intermediate = w13_EFH.size(1);
  d.intermediate = two_intermediate / 2;
  if (two_intermediate % 2 != 0 || w13_EFH.size(2) != d.hidden) {
    fail("w13 (gate_up_proj) must be [E, 2I, H] with H = x.shape[1] = " + std::to_string(d.hidden) +
         ", got " + shape_string(w13_EFH));
  }
  check_w2_matches_w13(w13_EFH, w2_EHI);
  check_routing(x_TH, topk_idx_TK, topk_weights_TK, dy_TH, weights, d, kApi);
  return d;
}

void check_w2_matches_w13(const Tensor& w13_EFH, const Tensor& w2_EHI) {
  const int64_t num_experts = w13_EFH.size(0), intermediate = w13_EFH.size(1) / 2, hidden = w13_EFH.size(2);
  if (w2_EHI.size(0) != num_experts || w2_EHI.size(1) != hidden || w2_EHI.size(2) != intermediate) {
    fail("w2 (down_proj) must be [E, H, I] = (" + std::to_string(num_experts) + ", " + std::to_string(hidden) +
         ", " + std::to_string(intermediate) + ") to match w13 " + shape_string(w13_EFH) + ", got " +
         shape_string(w2_EHI));
  }
}

void check_cuda(const Tensor& x_TH, const char* api) {
  if (!is_cuda(x_TH)) fail("tensors must be on a CUDA device, got " + device_string(x_TH), api);
}

void check_save_z(bool save_z, const std::string& impl) {
  if (save_z && impl != "fused") fail("save_z needs impl=\"fused\" (got " + py_repr(impl) + ")");
}

const Tensor* check_saved_z(const std::optional<Tensor>& saved_z_SF, const LayerDims& dims,
                            const Tensor& x_TH, const std::string& impl) {
  if (!saved_z_SF.has_value() || saved_z_SF->numel() == 0) return nullptr;
  check_save_z(true, impl);
  const Tensor& z = *saved_z_SF;
  const int64_t rows = dims.num_tokens * dims.top_k, cols = 2 * dims.intermediate;
  if (z.dim() != 2 || z.size(0) != rows || z.size(1) != cols || dtype_of(z) != dtype_bfloat16() ||
      !z.is_contiguous() || !same_device(z, x_TH)) {
    fail("saved_z must be the forward's z: contiguous bf16 (" + std::to_string(rows) + ", " +
         std::to_string(cols) + ") on " + device_string(x_TH) + ", got " + dtype_string(dtype_of(z)) + " " +
         shape_string(z) + " on " + device_string(z));
  }
  return &z;
}

namespace {

struct GradOfWeight {
  const char* name;
  const Tensor* grad;
  const Tensor* weight;
};

// ops._weight_grad_dtype: float32 or bfloat16, one dtype, the weights' shapes and devices.
int32_t weight_grad_dtype(std::initializer_list<GradOfWeight> named, const char* api) {
  for (const GradOfWeight& p : named) {
    const int32_t dtype = dtype_of(*p.grad);
    if (dtype != dtype_float32() && dtype != dtype_bfloat16()) {
      fail(std::string(p.name) + " must be a float32 or bfloat16 tensor, got " + dtype_string(dtype), api);
    }
    if (!same_shape(*p.grad, *p.weight) || !p.grad->is_contiguous() || !same_device(*p.grad, *p.weight)) {
      fail(std::string(p.name) + " must be contiguous, on " + device_string(*p.weight) + ", of shape " +
               shape_string(*p.weight) + "; got " + shape_string(*p.grad) + " on " + device_string(*p.grad) +
               ", strides " + py_tuple(p.grad->strides()),
           api);
    }
  }
  const int32_t first = dtype_of(*named.begin()->grad);
  bool one_dtype = true;
  for (const GradOfWeight& p : named) one_dtype = one_dtype && dtype_of(*p.grad) == first;
  if (!one_dtype) {
    std::string names, dtypes;
    size_t i = 0;
    for (const GradOfWeight& p : named) {
      const char* separator = i == 0 ? "" : (i + 1 == named.size() ? " and " : ", ");
      names += separator + std::string(p.name);
      dtypes += separator + dtype_string(dtype_of(*p.grad));
      ++i;
    }
    fail(names + " must have one dtype, got " + dtypes, api);
  }
  return first == dtype_float32() ? FUSEMOE_C_WEIGHT_GRAD_FLOAT32 : FUSEMOE_C_WEIGHT_GRAD_BFLOAT16;
}

}  // namespace

int32_t check_weight_grads(const Tensor& dw13_EFH, const Tensor& dw2_EHI, const Tensor& w13_EFH,
                           const Tensor& w2_EHI) {
  return weight_grad_dtype({{"dw13", &dw13_EFH, &w13_EFH}, {"dw2", &dw2_EHI, &w2_EHI}}, kApi);
}

int32_t check_weight_grads_w1w3(const Tensor& dw1_EIH, const Tensor& dw3_EIH, const Tensor& dw2_EHI,
                                const Tensor& w1_EIH, const Tensor& w3_EIH, const Tensor& w2_EHI) {
  return weight_grad_dtype({{"dw1", &dw1_EIH, &w1_EIH}, {"dw3", &dw3_EIH, &w3_EIH}, {"dw2", &dw2_EHI, &w2_EHI}},
                           kApiW1W3);
}

void check_fp8_shapes(const Tensor& w13_EFH) { check_fp8_dims(w13_EFH.size(2), w13_EFH.size(1) / 2); }

void check_fp8_dims(int64_t hidden, int64_t intermediate, const char* api) {
  if (hidden % kFp8Block != 0 || intermediate % kFp8Block != 0) {
    fail("precision=\"fp8\" needs hidden and intermediate to be multiples of " + std::to_string(kFp8Block) +
             ", got H=" + std::to_string(hidden) + ", I=" + std::to_string(intermediate),
         api);
  }
}

LayerDims check_quantize_inputs_w1w3(const Tensor& w1_EIH, const Tensor& w3_EIH, const Tensor& w2_EHI) {
  const char* api = kApiW1W3;
  check_tensor(w1_EIH, "w1 (gate)", 3, dtype_bfloat16(), api);
  check_tensor(w3_EIH, "w3 (up)", 3, dtype_bfloat16(), api);
  check_tensor(w2_EHI, "w2 (down)", 3, dtype_bfloat16(), api);
  LayerDims d;
  d.num_experts = w1_EIH.size(0);
  d.intermediate = w1_EIH.size(1);
  d.hidden = w1_EIH.size(2);
  check_w3_w2_match_w1(w1_EIH, w3_EIH, w2_EHI, d, api);
  check_fp8_dims(d.hidden, d.intermediate, api);
  return d;
}

void check_fp8_weights(const Tensor& fp8_weights, const Tensor& w13_EFH, uint64_t expected_bytes,
                       const char* made_by, const char* api) {
  if (dtype_of(fp8_weights) != dtype_uint8() || fp8_weights.dim() != 1 ||
      static_cast<uint64_t>(fp8_weights.numel()) != expected_bytes || !fp8_weights.is_contiguous() ||
      !same_device(fp8_weights, w13_EFH)) {
    fail("fp8_weights must be the buffer " + std::string(made_by) + " returned: contiguous uint8 [" +
             std::to_string(expected_bytes) + "] on " + device_string(w13_EFH) + ", got " +
             dtype_string(dtype_of(fp8_weights)) + " " + shape_string(fp8_weights),
         api);
  }
}

}  // namespace fusemoe::torch_binding

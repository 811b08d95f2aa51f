// The checks of the PyTorch ops' tensor arguments (dtype, rank, contiguity, shapes, devices) with
// the messages of python/fusemoe/ops.py and fp8.py, which run the same checks on the ctypes path
// and in the fake kernels. A bad argument throws std::invalid_argument (ErrorKind::kArgument,
// errors.h): Python sees ValueError, as from the Python checks, at fusemoe's entry points. Values are spelled in messages as Python prints
// them (torch.bfloat16, cuda:0, (37, 128)), so tests/python checks one set of messages for both
// paths. Shape legend: T tokens, H hidden, I expert intermediate, F = 2I, E experts, K top-k.
#pragma once

#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>
#include <string>

namespace fusemoe::torch_binding {

using torch::stable::Tensor;

// The layer's sizes as the tensors give them; the C layer takes max_tokens = T.
struct LayerDims {
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t num_tokens = 0;
};

// Dtype codes (aoti_torch_dtype_*) and their Python names.
int32_t dtype_of(const Tensor& t);
int32_t dtype_bfloat16();
int32_t dtype_float32();
int32_t dtype_int32();
int32_t dtype_uint8();

// Throws std::invalid_argument("fusemoe.moe_experts: " + message), as ops.py's _fail raises
// ValueError.
// api: the entry point the message names (fusemoe.separate's ops pass kApiW1W3).
constexpr const char* kApi = "fusemoe.moe_experts";
constexpr const char* kApiW1W3 = "fusemoe.moe_experts_w1w3";
[[noreturn]] void fail(const std::string& message, const char* api = kApi);

// str(t.device): "cuda:0", "cpu".
std::string device_string(const Tensor& t);
bool same_device(const Tensor& a, const Tensor& b);
bool is_cuda(const Tensor& t);

// _check_tensor: t has ndim dimensions, dtype and is contiguous.
void check_tensor(const Tensor& t, const char* name, int64_t ndim, int32_t dtype, const char* api = kApi);

// _check_inputs: the five inputs (and dy for a backward, or null) agree on the layer's sizes and
// device. Returns the sizes.
LayerDims check_inputs(const Tensor& x_TH, const Tensor& topk_idx_TK, const Tensor& topk_weights_TK,
                       const Tensor& w13_EFH, const Tensor& w2_EHI, const Tensor* dy_TH);

// fusemoe.separate._check_inputs_w1w3: the same for separate gate and up weights w1, w3 [E, I, H].
LayerDims check_inputs_w1w3(const Tensor& x_TH, const Tensor& topk_idx_TK, const Tensor& topk_weights_TK,
                            const Tensor& w1_EIH, const Tensor& w3_EIH, const Tensor& w2_EHI, const Tensor* dy_TH);

// _check_cuda: the tensors (all on x's device by now) are on a CUDA device.
void check_cuda(const Tensor& x_TH, const char* api = kApi);

// _check_save_z: saving z needs impl "fused".
void check_save_z(bool save_z, const std::string& impl);

// _check_saved_z: a backward's saved_z is absent or empty (returns null) or the z of a "fused"
// forward of these inputs (returns it).
const Tensor* check_saved_z(const std::optional<Tensor>& saved_z_SF, const LayerDims& dims,
                            const Tensor& x_TH, const std::string& impl);

// _check_weight_grads: dw13/dw2 are float32 or bfloat16 (one dtype), contiguous, of the shapes and
// on the device of w13/w2. Returns the C ABI's FUSEMOE_C_WEIGHT_GRAD_* code.
int32_t check_weight_grads(const Tensor& dw13_EFH, const Tensor& dw2_EHI, const Tensor& w13_EFH,
                           const Tensor& w2_EHI);

// _check_fp8_shapes: H and I are multiples of the FP8 scale block (128).
void check_fp8_shapes(const Tensor& w13_EFH);

// fusemoe.fp8._check_fp8_dims: the same for the sizes themselves (fusemoe.separate's w1, w3).
void check_fp8_dims(int64_t hidden, int64_t intermediate, const char* api = kApi);

// fusemoe.separate._check_weight_grads_w1w3: check_weight_grads for dw1, dw3, dw2 ("dw1, dw3 and
// dw2 must have one dtype"), messages naming fusemoe.moe_experts_w1w3.
int32_t check_weight_grads_w1w3(const Tensor& dw1_EIH, const Tensor& dw3_EIH, const Tensor& dw2_EHI,
                                const Tensor& w1_EIH, const Tensor& w3_EIH, const Tensor& w2_EHI);

// fusemoe.separate._check_quantize_inputs: the weights of quantize_weights_fp8_w1w3 (bf16,
// contiguous, w3 and w2 matching w1, FP8 block multiples). Returns E, H, I in the dims.
LayerDims check_quantize_inputs_w1w3(const Tensor& w1_EIH, const Tensor& w3_EIH, const Tensor& w2_EHI);

// w2 is [E, H, I] for w13 [E, 2I, H] (check_inputs' message), for the weight quantization, which
// has no other input to take the sizes from.
void check_w2_matches_w13(const Tensor& w13_EFH, const Tensor& w2_EHI);

// _check_fp8_weights' buffer check: uint8 [expected_bytes], contiguous, on w13's device (for
// fusemoe.separate: w1's, made_by and api its own).
constexpr const char* kFp8MadeBy = "fusemoe.fp8.quantize_weights_fp8(w13, w2)";
constexpr const char* kFp8MadeByW1W3 = "fusemoe.separate.quantize_weights_fp8_w1w3(w1, w3, w2)";
void check_fp8_weights(const Tensor& fp8_weights, const Tensor& w13_EFH, uint64_t expected_bytes,
                       const char* made_by = kFp8MadeBy, const char* api = kApi);

}  // namespace fusemoe::torch_binding

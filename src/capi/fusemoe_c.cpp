// The C ABI (src/capi/fusemoe_c.h) over fusemoe's C++ API. Each entry point builds the C++
// config and argument structs from plain values and calls the C++ function inside guarded(),
// which turns every exception into a status code plus a thread-local message, so nothing
// unwinds through a C or ctypes caller. Validation stays in src/api: this file adds only the
// checks of its own arguments (out-pointers, implementation codes, enum values).
#include "capi/fusemoe_c.h"

#include <exception>
#include <new>
#include <string>

#include "fusemoe/fusemoe.h"

namespace {

using fusemoe::Impl;

// The implementations bindings may select, by their fusemoe::impl_name(). Adding one is adding
// its enum value here.
constexpr Impl kBindableImpls[] = {Impl::kUnfused, Impl::kReferenceFp32, Impl::kFused};

std::string& last_error() {
  thread_local std::string message;
  return message;
}

void set_last_error(const char* message) {
  try {
    last_error() = message;
  } catch (...) {
    // Out of memory while copying the message: keep whatever the string held.
  }
}

template <typename Fn>
int32_t guarded(Fn&& fn) {
  try {
    fn();
    return FUSEMOE_C_OK;
  } catch (const fusemoe::Error& e) {
    set_last_error(e.what());
    return FUSEMOE_C_ERROR;
  } catch (const std::bad_alloc&) {
    set_last_error("fusemoe: host memory allocation failed");
    return FUSEMOE_C_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_last_error(e.what());
    return FUSEMOE_C_INTERNAL;
  } catch (...) {
    set_last_error("fusemoe: unknown exception");
    return FUSEMOE_C_INTERNAL;
  }
}

std::string bindable_impl_names() {
  std::string names;
  for (Impl impl : kBindableImpls) {
    names += names.empty() ? "" : ", ";
    names += fusemoe::impl_name(impl);
  }
  return names;
}

Impl impl_from_code(int32_t code) {
  for (Impl impl : kBindableImpls) {
    if (static_cast<int32_t>(impl) == code) return impl;
  }
  FUSEMOE_CHECK(false, "impl_code: " << code << " is not a code from fusemoe_c_impl_code (known: "
                                     << bindable_impl_names() << ")");
  return Impl::kUnfused;  // not reached
}

fusemoe::LayerConfig make_config(int64_t hidden, int64_t intermediate, int64_t num_experts,
                                 int64_t top_k, int64_t max_tokens) {
  fusemoe::LayerConfig config;
  config.hidden = hidden;
  config.intermediate = intermediate;
  config.num_experts = num_experts;
  config.top_k = top_k;
  config.max_tokens = max_tokens;
  return config;
}

fusemoe::Precision precision_from_code(int32_t code) {
  static_assert(static_cast<int>(fusemoe::Precision::kBf16) == FUSEMOE_C_PRECISION_BF16 &&
                    static_cast<int>(fusemoe::Precision::kFp8Blockwise) == FUSEMOE_C_PRECISION_FP8_BLOCKWISE,
                "C codes of the precisions");
  FUSEMOE_CHECK(code == FUSEMOE_C_PRECISION_BF16 || code == FUSEMOE_C_PRECISION_FP8_BLOCKWISE,
                "precision must be " << FUSEMOE_C_PRECISION_BF16 << " (bf16) or " << FUSEMOE_C_PRECISION_FP8_BLOCKWISE
                                     << " (fp8_blockwise), got " << code);
  return static_cast<fusemoe::Precision>(code);
}

fusemoe::LayerConfig make_fp8_config(int64_t hidden, int64_t intermediate, int64_t num_experts, int64_t top_k,
                                     int64_t max_tokens) {
  fusemoe::LayerConfig config = make_config(hidden, intermediate, num_experts, top_k, max_tokens);
  config.precision = fusemoe::Precision::kFp8Blockwise;
  return config;
}

fusemoe::WeightGradDtype weight_grad_dtype_from_code(int32_t code) {
  FUSEMOE_CHECK(code == FUSEMOE_C_WEIGHT_GRAD_FLOAT32 || code == FUSEMOE_C_WEIGHT_GRAD_BFLOAT16,
                "weight_grad_dtype must be " << FUSEMOE_C_WEIGHT_GRAD_FLOAT32 << " (float32) or "
                                             << FUSEMOE_C_WEIGHT_GRAD_BFLOAT16 << " (bfloat16), got " << code);
  return code == FUSEMOE_C_WEIGHT_GRAD_FLOAT32 ? fusemoe::WeightGradDtype::kFloat32
                                               : fusemoe::WeightGradDtype::kBFloat16;
}

}  // namespace

extern "C" {

int32_t fusemoe_c_abi_version(void) { return FUSEMOE_C_ABI_VERSION; }

const char* fusemoe_c_last_error(void) { return last_error().c_str(); }

int32_t fusemoe_c_impl_code(const char* name, int32_t* impl_code) {
  return guarded([&] {
    FUSEMOE_CHECK(name != nullptr, "impl name must not be null");
    FUSEMOE_CHECK(impl_code != nullptr, "impl_code (output) must not be null");
    for (Impl impl : kBindableImpls) {
      if (std::string(name) == fusemoe::impl_name(impl)) {
        *impl_code = static_cast<int32_t>(impl);
        return;
      }
    }
    FUSEMOE_CHECK(false, "impl: unknown implementation \"" << name << "\" (available: "
                                                          << bindable_impl_names() << ")");
  });
}

int32_t fusemoe_c_workspace_bytes(int64_t hidden, int64_t intermediate, int64_t num_experts,
                                  int64_t top_k, int64_t max_tokens, int32_t impl_code,
                                  uint64_t* bytes) {
  return guarded([&] {
    FUSEMOE_CHECK(bytes != nullptr, "bytes (output) must not be null");
    const auto config = make_config(hidden, intermediate, num_experts, top_k, max_tokens);
    *bytes = fusemoe::workspace_bytes(config, impl_from_code(impl_code));
  });
}

int32_t fusemoe_c_workspace_bytes_for(int64_t hidden, int64_t intermediate, int64_t num_experts,
                                      int64_t top_k, int64_t max_tokens, int32_t impl_code, int32_t use,
                                      uint64_t* bytes) {
  return guarded([&] {
    FUSEMOE_CHECK(bytes != nullptr, "bytes (output) must not be null");
    // The C codes are the enum values; fusemoe::workspace_bytes rejects any other value, naming it.
    static_assert(static_cast<int>(fusemoe::WorkspaceUse::kForward) == FUSEMOE_C_WORKSPACE_FORWARD &&
                      static_cast<int>(fusemoe::WorkspaceUse::kBackward) == FUSEMOE_C_WORKSPACE_BACKWARD &&
                      static_cast<int>(fusemoe::WorkspaceUse::kBackwardSavedZ) == FUSEMOE_C_WORKSPACE_BACKWARD_SAVED_Z,
                  "C codes of the workspace uses");
    const auto config = make_config(hidden, intermediate, num_experts, top_k, max_tokens);
    *bytes = fusemoe::workspace_bytes(config, impl_from_code(impl_code), static_cast<fusemoe::WorkspaceUse>(use));
  });
}

int32_t fusemoe_c_saved_z_bytes(int64_t hidden, int64_t intermediate, int64_t num_experts,
                                int64_t top_k, int64_t max_tokens, uint64_t* bytes) {
  return guarded([&] {
    FUSEMOE_CHECK(bytes != nullptr, "bytes (output) must not be null");
    *bytes = fusemoe::saved_z_bytes(make_config(hidden, intermediate, num_experts, top_k, max_tokens));
  });
}

int32_t fusemoe_c_forward(int64_t hidden, int64_t intermediate, int64_t num_experts, int64_t top_k,
                          int64_t max_tokens, int32_t impl_code, const void* x,
                          const int32_t* topk_idx, const float* topk_weights, const void* w13,
                          const void* w2, void* y, int64_t num_tokens, void* workspace,
                          uint64_t workspace_bytes, int32_t* expert_id_report, void* saved_z,
                          void* stream) {
  return guarded([&] {
    const auto config = make_config(hidden, intermediate, num_experts, top_k, max_tokens);
    const Impl impl = impl_from_code(impl_code);
    fusemoe::ForwardArgs args;
    args.x = x;
    args.topk_idx = topk_idx;
    args.topk_weights = topk_weights;
    args.w13 = w13;
    args.w2 = w2;
    args.y = y;
    args.num_tokens = num_tokens;
    args.workspace = workspace;
    args.workspace_bytes = workspace_bytes;
    args.expert_id_report = expert_id_report;
    args.saved_z = saved_z;
    args.stream = static_cast<cudaStream_t>(stream);
    fusemoe::forward(config, impl, args);
  });
}

int32_t fusemoe_c_backward(int64_t hidden, int64_t intermediate, int64_t num_experts,
                           int64_t top_k, int64_t max_tokens, int32_t impl_code, const void* x,
                           const int32_t* topk_idx, const float* topk_weights, const void* w13,
                           const void* w2, const void* dy, void* dx, float* d_topk_weights,
                           void* dw13, void* dw2, int32_t weight_grad_dtype,
                           int32_t accumulate_weight_grads, int64_t num_tokens, void* workspace,
                           uint64_t workspace_bytes, int32_t* expert_id_report,
                           const void* saved_z, void* stream) {
  return guarded([&] {
    const auto config = make_config(hidden, intermediate, num_experts, top_k, max_tokens);
    const Impl impl = impl_from_code(impl_code);
    FUSEMOE_CHECK(weight_grad_dtype == FUSEMOE_C_WEIGHT_GRAD_FLOAT32 ||
                      weight_grad_dtype == FUSEMOE_C_WEIGHT_GRAD_BFLOAT16,
                  "weight_grad_dtype must be " << FUSEMOE_C_WEIGHT_GRAD_FLOAT32 << " (float32) or "
                                               << FUSEMOE_C_WEIGHT_GRAD_BFLOAT16
                                               << " (bfloat16), got " << weight_grad_dtype);
    fusemoe::BackwardArgs args;
    args.x = x;
    args.topk_idx = topk_idx;
    args.topk_weights = topk_weights;
    args.w13 = w13;
    args.w2 = w2;
    args.dy = dy;
    args.dx = dx;
    args.d_topk_weights = d_topk_weights;
    args.dw13 = dw13;
    args.dw2 = dw2;
    args.weight_grad_dtype = weight_grad_dtype == FUSEMOE_C_WEIGHT_GRAD_FLOAT32
                                 ? fusemoe::WeightGradDtype::kFloat32
                                 : fusemoe::WeightGradDtype::kBFloat16;
    args.accumulate_weight_grads = accumulate_weight_grads != 0;
    args.num_tokens = num_tokens;
    args.workspace = workspace;
    args.workspace_bytes = workspace_bytes;
    args.expert_id_report = expert_id_report;
    args.saved_z = saved_z;
    args.stream = static_cast<cudaStream_t>(stream);
    fusemoe::backward(config, impl, args);
  });
}

int32_t fusemoe_c_workspace_bytes_precision(int64_t hidden, int64_t intermediate, int64_t num_experts,
                                            int64_t top_k, int64_t max_tokens, int32_t impl_code,
                                            int32_t precision, int32_t use, uint64_t* bytes) {
  return guarded([&] {
    FUSEMOE_CHECK(bytes != nullptr, "bytes (output) must not be null");
    auto config = make_config(hidden, intermediate, num_experts, top_k, max_tokens);
    config.precision = precision_from_code(precision);
    *bytes = fusemoe::workspace_bytes(config, impl_from_code(impl_code), static_cast<fusemoe::WorkspaceUse>(use));
  });
}

int32_t fusemoe_c_fp8_weights_bytes(int64_t hidden, int64_t intermediate, int64_t num_experts, int64_t top_k,
                                    int64_t max_tokens, uint64_t* bytes) {
  return guarded([&] {
    FUSEMOE_CHECK(bytes != nullptr, "bytes (output) must not be null");
    *bytes = fusemoe::fp8_weights_bytes(make_fp8_config(hidden, intermediate, num_experts, top_k, max_tokens));
  });
}

int32_t fusemoe_c_quantize_weights_fp8(int64_t hidden, int64_t intermediate, int64_t num_experts, int64_t top_k,
                                       int64_t max_tokens, const void* w13, const void* w2, void* buffer,
                                       uint64_t buffer_bytes, void* stream) {
  return guarded([&] {
    fusemoe::quantize_weights_fp8(make_fp8_config(hidden, intermediate, num_experts, top_k, max_tokens), w13, w2,
                                  buffer, buffer_bytes, static_cast<cudaStream_t>(stream));
  });
}

int32_t fusemoe_c_forward_fp8(int64_t hidden, int64_t intermediate, int64_t num_experts, int64_t top_k,
                              int64_t max_tokens, int32_t impl_code, const void* x, const int32_t* topk_idx,
                              const float* topk_weights, const void* fp8_weights, void* y, int64_t num_tokens,
                              void* workspace, uint64_t workspace_bytes, int32_t* expert_id_report, void* saved_z,
                              void* stream) {
  return guarded([&] {
    const auto config = make_fp8_config(hidden, intermediate, num_experts, top_k, max_tokens);
    fusemoe::ForwardArgs args;
    args.x = x;
    args.topk_idx = topk_idx;
    args.topk_weights = topk_weights;
    args.fp8_weights = fp8_weights;
    args.y = y;
    args.num_tokens = num_tokens;
    args.workspace = workspace;
    args.workspace_bytes = workspace_bytes;
    args.expert_id_report = expert_id_report;
    args.saved_z = saved_z;
    args.stream = static_cast<cudaStream_t>(stream);
    fusemoe::forward(config, impl_from_code(impl_code), args);
  });
}

int32_t fusemoe_c_backward_fp8(int64_t hidden, int64_t intermediate, int64_t num_experts, int64_t top_k,
                               int64_t max_tokens, int32_t impl_code, const void* x, const int32_t* topk_idx,
                               const float* topk_weights, const void* fp8_weights, const void* dy, void* dx,
                               float* d_topk_weights, void* dw13, void* dw2, int32_t weight_grad_dtype,
                               int32_t accumulate_weight_grads, int64_t num_tokens, void* workspace,
                               uint64_t workspace_bytes, int32_t* expert_id_report, const void* saved_z,
                               void* stream) {
  return guarded([&] {
    const auto config = make_fp8_config(hidden, intermediate, num_experts, top_k, max_tokens);
    fusemoe::BackwardArgs args;
    args.x = x;
    args.topk_idx = topk_idx;
    args.topk_weights = topk_weights;
    args.fp8_weights = fp8_weights;
    args.dy = dy;
    args.dx = dx;
    args.d_topk_weights = d_topk_weights;
    args.dw13 = dw13;
    args.dw2 = dw2;
    args.weight_grad_dtype = weight_grad_dtype_from_code(weight_grad_dtype);
    args.accumulate_weight_grads = accumulate_weight_grads != 0;
    args.num_tokens = num_tokens;
    args.workspace = workspace;
    args.workspace_bytes = workspace_bytes;
    args.expert_id_report = expert_id_report;
    args.saved_z = saved_z;
    args.stream = static_cast<cudaStream_t>(stream);
    fusemoe::backward(config, impl_from_code(impl_code), args);
  });
}

int32_t fusemoe_c_check_expert_id_report(const int32_t* report, int64_t num_experts,
                                         int64_t top_k) {
  return guarded([&] { fusemoe::throw_if_expert_id_report(report, num_experts, top_k); });
}

}  // extern "C"

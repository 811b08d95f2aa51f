// The C ABI (include/fusemoe/fusemoe_c.h) over fusemoe's C++ API. Each entry point converts
// its C structs to the C++ config and argument structs field by field and calls the C++
// function inside guarded(), which turns every exception into a status code plus a thread-local
// message, so nothing unwinds through a C or ctypes caller. Validation stays in src/api: this
// file checks only what is its own (struct pointers and struct_size, out-pointers,
// implementation codes). The struct layout tables answer fusemoe_c_struct_layout/_field.
#include "fusemoe/fusemoe_c.h"

#include <cstddef>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "fusemoe/expert_parallel.h"
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

// A struct argument: not null, and declared with this library's layout.
template <typename CStruct>
const CStruct& checked_struct(const CStruct* s, const char* arg, const char* type) {
  FUSEMOE_CHECK(s != nullptr, arg << " (" << type << "*) must not be null");
  FUSEMOE_CHECK(s->struct_size == sizeof(CStruct),
                type << ".struct_size: " << s->struct_size << ", but this library (C ABI "
                     << FUSEMOE_C_ABI_VERSION << ") has sizeof(" << type << ") = "
                     << sizeof(CStruct)
                     << ": the caller was written for another version of fusemoe_c.h");
  return *s;
}

fusemoe::LayerConfig config_of(const FusemoeCLayer& l) {
  fusemoe::LayerConfig config;
  config.hidden = l.hidden;
  config.intermediate = l.intermediate;
  config.num_experts = l.num_experts;
  config.top_k = l.top_k;
  config.max_tokens = l.max_tokens;
  config.use_swiglu_clamp = l.use_swiglu_clamp != 0;
  config.swiglu_clamp = l.swiglu_clamp;
  config.precision = static_cast<fusemoe::Precision>(l.precision);
  // Strictly 0 or 1: the field sits where ABI 8's struct had padding, so a caller built for
  // that version can pass garbage here with a struct_size that matches.
  FUSEMOE_CHECK(l.fp8_weight_grads == 0 || l.fp8_weight_grads == 1,
                "FusemoeCLayer.fp8_weight_grads must be 0 or 1, got " << l.fp8_weight_grads
                                                                      << " (a caller built for C ABI 8?)");
  config.fp8_weight_grads = l.fp8_weight_grads != 0;
  return config;
}

fusemoe::EpConfig ep_config_of(const FusemoeCEpConfig& c) {
  fusemoe::EpConfig config;
  config.layer = config_of(checked_struct(&c.layer, "config.layer", "FusemoeCLayer"));
  config.world_size = c.world_size;
  config.rank = c.rank;
  return config;
}

// The fields every call's C args and C++ args share (they spell them alike): the single-GPU
// forward and backward args, the expert-parallel EpCall.
template <typename Args, typename CArgs>
void copy_call_fields(Args& args, const CArgs& a) {
  args.x = a.x;
  args.topk_idx = a.topk_idx;
  args.topk_weights = a.topk_weights;
  args.w13 = a.w13;
  args.w2 = a.w2;
  args.num_tokens = a.num_tokens;
  args.workspace = a.workspace;
  args.workspace_bytes = a.workspace_bytes;
  args.expert_id_report = a.expert_id_report;
  args.stream = static_cast<cudaStream_t>(a.stream);
}

// dy and the gradient outputs of a backward's C args (single-GPU and expert-parallel alike).
template <typename Args, typename CArgs>
void copy_gradient_fields(Args& b, const CArgs& a) {
  b.dy = a.dy;
  b.dx = a.dx;
  b.d_topk_weights = a.d_topk_weights;
  b.dw13 = a.dw13;
  b.dw2 = a.dw2;
  b.weight_grad_dtype = static_cast<fusemoe::WeightGradDtype>(a.weight_grad_dtype);
  b.accumulate_weight_grads = a.accumulate_weight_grads != 0;
}

// The fields the single-GPU forward and backward args share.
template <typename Args, typename CArgs>
Args call_args_of(const CArgs& a) {
  Args args;
  copy_call_fields(args, a);
  args.w1 = a.w1;
  args.w3 = a.w3;
  args.fp8_weights = a.fp8_weights;
  args.saved_z = a.saved_z;
  args.caller_checked_pointers = a.caller_checked_pointers != 0;
  return args;
}

// A call's entry point: checks the layer and args structs and the implementation code, then
// fn(config, impl, C args, C++ args with the fields both calls share filled).
template <typename Args, typename CArgs, typename Fn>
int32_t layer_call(const FusemoeCLayer* layer, const CArgs* args, const char* args_type, Fn&& fn) {
  return guarded([&] {
    const FusemoeCLayer& l = checked_struct(layer, "layer", "FusemoeCLayer");
    const CArgs& a = checked_struct(args, "args", args_type);
    const Impl impl = impl_from_code(l.impl_code);
    fn(config_of(l), impl, a, call_args_of<Args>(a));
  });
}

// The EpCall of an expert-parallel call's C args (forward and backward spell these alike). A
// call without an expert-id report checks the ids with a stream sync, as the single-GPU calls do.
template <typename CArgs>
fusemoe::EpCall ep_call_of(const CArgs& a) {
  fusemoe::EpCall call;
  copy_call_fields(call, a);
  call.fp8_weights = a.fp8_weights;
  call.peer_symmetric = a.peer_symmetric;
  call.sync_check_expert_ids = a.expert_id_report == nullptr;
  call.num_sms = a.num_sms;
  return call;
}

// An expert-parallel call's entry point: checks the config and args structs, then
// fn(config, C args, the EpCall).
template <typename CArgs, typename Fn>
int32_t ep_call(const FusemoeCEpConfig* config, const CArgs* args, const char* args_type, Fn&& fn) {
  return guarded([&] {
    const fusemoe::EpConfig c = ep_config_of(checked_struct(config, "config", "FusemoeCEpConfig"));
    const CArgs& a = checked_struct(args, "args", args_type);
    fn(c, a, ep_call_of(a));
  });
}

// A size query of an expert-parallel config: *bytes = size(config).
template <typename Size>
int32_t ep_bytes(const FusemoeCEpConfig* config, uint64_t* bytes, Size&& size) {
  return guarded([&] {
    const fusemoe::EpConfig c = ep_config_of(checked_struct(config, "config", "FusemoeCEpConfig"));
    FUSEMOE_CHECK(bytes != nullptr, "bytes (output) must not be null");
    *bytes = size(c);
  });
}

// A size query of a layer: checks the struct and the out-pointer, then *bytes = size(layer).
template <typename Size>
int32_t layer_bytes(const FusemoeCLayer* layer, uint64_t* bytes, Size&& size) {
  return guarded([&] {
    const FusemoeCLayer& l = checked_struct(layer, "layer", "FusemoeCLayer");
    FUSEMOE_CHECK(bytes != nullptr, "bytes (output) must not be null");
    *bytes = size(l);
  });
}

// The C codes are the C++ enum values; the C++ API rejects any other value, naming the field.
static_assert(static_cast<int>(fusemoe::WorkspaceUse::kForward) == FUSEMOE_C_WORKSPACE_FORWARD &&
                  static_cast<int>(fusemoe::WorkspaceUse::kBackward) == FUSEMOE_C_WORKSPACE_BACKWARD &&
                  static_cast<int>(fusemoe::WorkspaceUse::kBackwardSavedZ) ==
                      FUSEMOE_C_WORKSPACE_BACKWARD_SAVED_Z,
              "C codes of the workspace uses");
static_assert(static_cast<int>(fusemoe::WeightGradDtype::kFloat32) == FUSEMOE_C_WEIGHT_GRAD_FLOAT32 &&
                  static_cast<int>(fusemoe::WeightGradDtype::kBFloat16) ==
                      FUSEMOE_C_WEIGHT_GRAD_BFLOAT16,
              "C codes of the weight-gradient dtypes");
static_assert(static_cast<int>(fusemoe::Precision::kBf16) == FUSEMOE_C_PRECISION_BF16 &&
                  static_cast<int>(fusemoe::Precision::kFp8Blockwise) == FUSEMOE_C_PRECISION_FP8_BLOCKWISE,
              "C codes of the precisions");

// ---- struct layout tables (fusemoe_c_struct_layout / fusemoe_c_struct_field) ----

struct FieldLayout {
  const char* name;
  size_t offset;
  size_t size;
};

// Stringizes the field name; the only reason this is a macro.
#define FUSEMOE_C_FIELD(Struct, field) \
  FieldLayout { #field, offsetof(Struct, field), sizeof(Struct::field) }

constexpr FieldLayout kLayerFields[] = {
    FUSEMOE_C_FIELD(FusemoeCLayer, struct_size),  FUSEMOE_C_FIELD(FusemoeCLayer, impl_code),
    FUSEMOE_C_FIELD(FusemoeCLayer, hidden),       FUSEMOE_C_FIELD(FusemoeCLayer, intermediate),
    FUSEMOE_C_FIELD(FusemoeCLayer, num_experts),  FUSEMOE_C_FIELD(FusemoeCLayer, top_k),
    FUSEMOE_C_FIELD(FusemoeCLayer, max_tokens),   FUSEMOE_C_FIELD(FusemoeCLayer, use_swiglu_clamp),
    FUSEMOE_C_FIELD(FusemoeCLayer, swiglu_clamp), FUSEMOE_C_FIELD(FusemoeCLayer, precision),
    FUSEMOE_C_FIELD(FusemoeCLayer, fp8_weight_grads),
};
constexpr FieldLayout kForwardFields[] = {
    FUSEMOE_C_FIELD(FusemoeCForwardArgs, struct_size),
    FUSEMOE_C_FIELD(FusemoeCForwardArgs, x),
    FUSEMOE_C_FIELD(FusemoeCForwardArgs, topk_idx),
    FUSEMOE_C_FIELD(FusemoeCForwardArgs, topk_weights),
    FUSEMOE_C_FIELD(FusemoeCForwardArgs, w13),
    FUSEMOE_C_FIELD(FusemoeCForwardArgs, w2),
    FUSEMOE_C_FIELD(FusemoeCForwardArgs, w1),
    FUSEMOE_C_FIELD(FusemoeCForwardArgs, w3),
    FUSEMOE_C_FIELD(FusemoeCForwardArgs, fp8_weights),
    FUSEMOE_C_FIELD(FusemoeCForwardArgs, y),
    FUSEMOE_C_FIELD(FusemoeCForwardArgs, num_tokens),
    FUSEMOE_C_FIELD(FusemoeCForwardArgs, workspace),
    FUSEMOE_C_FIELD(FusemoeCForwardArgs, workspace_bytes),
    FUSEMOE_C_FIELD(FusemoeCForwardArgs, expert_id_report),
    FUSEMOE_C_FIELD(FusemoeCForwardArgs, saved_z),
    FUSEMOE_C_FIELD(FusemoeCForwardArgs, stream),
    FUSEMOE_C_FIELD(FusemoeCForwardArgs, caller_checked_pointers),
};
constexpr FieldLayout kBackwardFields[] = {
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, struct_size),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, weight_grad_dtype),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, x),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, topk_idx),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, topk_weights),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, w13),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, w2),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, w1),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, w3),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, fp8_weights),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, dy),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, dx),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, d_topk_weights),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, dw13),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, dw2),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, dw1),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, dw3),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, accumulate_weight_grads),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, num_tokens),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, workspace),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, workspace_bytes),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, expert_id_report),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, saved_z),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, stream),
    FUSEMOE_C_FIELD(FusemoeCBackwardArgs, caller_checked_pointers),
};
constexpr FieldLayout kFp8QuantizeFields[] = {
    FUSEMOE_C_FIELD(FusemoeCFp8QuantizeArgs, struct_size),
    FUSEMOE_C_FIELD(FusemoeCFp8QuantizeArgs, w13),
    FUSEMOE_C_FIELD(FusemoeCFp8QuantizeArgs, w2),
    FUSEMOE_C_FIELD(FusemoeCFp8QuantizeArgs, w1),
    FUSEMOE_C_FIELD(FusemoeCFp8QuantizeArgs, w3),
    FUSEMOE_C_FIELD(FusemoeCFp8QuantizeArgs, buffer),
    FUSEMOE_C_FIELD(FusemoeCFp8QuantizeArgs, buffer_bytes),
    FUSEMOE_C_FIELD(FusemoeCFp8QuantizeArgs, stream),
};
constexpr FieldLayout kEpConfigFields[] = {
    FUSEMOE_C_FIELD(FusemoeCEpConfig, struct_size),
    FUSEMOE_C_FIELD(FusemoeCEpConfig, world_size),
    FUSEMOE_C_FIELD(FusemoeCEpConfig, rank),
    FUSEMOE_C_FIELD(FusemoeCEpConfig, layer),
};
constexpr FieldLayout kEpForwardFields[] = {
    FUSEMOE_C_FIELD(FusemoeCEpForwardArgs, struct_size),
    FUSEMOE_C_FIELD(FusemoeCEpForwardArgs, num_sms),
    FUSEMOE_C_FIELD(FusemoeCEpForwardArgs, x),
    FUSEMOE_C_FIELD(FusemoeCEpForwardArgs, topk_idx),
    FUSEMOE_C_FIELD(FusemoeCEpForwardArgs, topk_weights),
    FUSEMOE_C_FIELD(FusemoeCEpForwardArgs, w13),
    FUSEMOE_C_FIELD(FusemoeCEpForwardArgs, w2),
    FUSEMOE_C_FIELD(FusemoeCEpForwardArgs, fp8_weights),
    FUSEMOE_C_FIELD(FusemoeCEpForwardArgs, y),
    FUSEMOE_C_FIELD(FusemoeCEpForwardArgs, num_tokens),
    FUSEMOE_C_FIELD(FusemoeCEpForwardArgs, peer_symmetric),
    FUSEMOE_C_FIELD(FusemoeCEpForwardArgs, workspace),
    FUSEMOE_C_FIELD(FusemoeCEpForwardArgs, workspace_bytes),
    FUSEMOE_C_FIELD(FusemoeCEpForwardArgs, expert_id_report),
    FUSEMOE_C_FIELD(FusemoeCEpForwardArgs, saved_state),
    FUSEMOE_C_FIELD(FusemoeCEpForwardArgs, stream),
};
constexpr FieldLayout kEpBackwardFields[] = {
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, struct_size),
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, weight_grad_dtype),
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, x),
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, topk_idx),
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, topk_weights),
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, w13),
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, w2),
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, fp8_weights),
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, dy),
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, dx),
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, d_topk_weights),
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, dw13),
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, dw2),
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, accumulate_weight_grads),
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, num_sms),
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, num_tokens),
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, peer_symmetric),
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, workspace),
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, workspace_bytes),
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, expert_id_report),
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, saved_state),
    FUSEMOE_C_FIELD(FusemoeCEpBackwardArgs, stream),
};
#undef FUSEMOE_C_FIELD

struct StructLayout {
  const char* name;
  size_t size;
  const FieldLayout* fields;
  int32_t num_fields;
};

template <size_t N>
constexpr StructLayout struct_layout(const char* name, size_t size, const FieldLayout (&fields)[N]) {
  return StructLayout{name, size, fields, static_cast<int32_t>(N)};
}

const StructLayout kStructs[] = {
    struct_layout("FusemoeCLayer", sizeof(FusemoeCLayer), kLayerFields),
    struct_layout("FusemoeCForwardArgs", sizeof(FusemoeCForwardArgs), kForwardFields),
    struct_layout("FusemoeCBackwardArgs", sizeof(FusemoeCBackwardArgs), kBackwardFields),
    struct_layout("FusemoeCFp8QuantizeArgs", sizeof(FusemoeCFp8QuantizeArgs), kFp8QuantizeFields),
    struct_layout("FusemoeCEpConfig", sizeof(FusemoeCEpConfig), kEpConfigFields),
    struct_layout("FusemoeCEpForwardArgs", sizeof(FusemoeCEpForwardArgs), kEpForwardFields),
    struct_layout("FusemoeCEpBackwardArgs", sizeof(FusemoeCEpBackwardArgs), kEpBackwardFields),
};

// "FusemoeCLayer, ..." for the unknown-struct message.
std::string struct_names() {
  std::string names;
  for (const StructLayout& s : kStructs) {
    names += names.empty() ? "" : ", ";
    names += s.name;
  }
  return names;
}

const StructLayout& find_struct(const char* name) {
  FUSEMOE_CHECK(name != nullptr, "struct_name must not be null");
  for (const StructLayout& s : kStructs) {
    if (std::strcmp(s.name, name) == 0) return s;
  }
  FUSEMOE_CHECK(false, "struct_name: unknown struct \"" << name << "\" (" << struct_names() << ")");
  return kStructs[0];  // not reached
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

int32_t fusemoe_c_workspace_bytes(const FusemoeCLayer* layer, uint64_t* bytes) {
  return layer_bytes(layer, bytes, [](const FusemoeCLayer& l) {
    return fusemoe::workspace_bytes(config_of(l), impl_from_code(l.impl_code));
  });
}

int32_t fusemoe_c_workspace_bytes_for(const FusemoeCLayer* layer, int32_t use, uint64_t* bytes) {
  return layer_bytes(layer, bytes, [use](const FusemoeCLayer& l) {
    return fusemoe::workspace_bytes(config_of(l), impl_from_code(l.impl_code),
                                    static_cast<fusemoe::WorkspaceUse>(use));
  });
}

int32_t fusemoe_c_saved_z_bytes(const FusemoeCLayer* layer, uint64_t* bytes) {
  return layer_bytes(layer, bytes, [](const FusemoeCLayer& l) { return fusemoe::saved_z_bytes(config_of(l)); });
}

int32_t fusemoe_c_fp8_weights_bytes(const FusemoeCLayer* layer, uint64_t* bytes) {
  return layer_bytes(layer, bytes,
                     [](const FusemoeCLayer& l) { return fusemoe::fp8_weights_bytes(config_of(l)); });
}

int32_t fusemoe_c_quantize_weights_fp8(const FusemoeCLayer* layer, const FusemoeCFp8QuantizeArgs* args) {
  return guarded([&] {
    const FusemoeCLayer& l = checked_struct(layer, "layer", "FusemoeCLayer");
    const FusemoeCFp8QuantizeArgs& a = checked_struct(args, "args", "FusemoeCFp8QuantizeArgs");
    const cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
    if (a.w13 == nullptr && (a.w1 != nullptr || a.w3 != nullptr)) {
      fusemoe::quantize_weights_fp8(config_of(l), a.w1, a.w3, a.w2, a.buffer, a.buffer_bytes, stream);
    } else {
      FUSEMOE_CHECK(a.w1 == nullptr && a.w3 == nullptr, "pass either w13 or w1 and w3, not both");
      fusemoe::quantize_weights_fp8(config_of(l), a.w13, a.w2, a.buffer, a.buffer_bytes, stream);
    }
  });
}

int32_t fusemoe_c_forward(const FusemoeCLayer* layer, const FusemoeCForwardArgs* args) {
  return layer_call<fusemoe::ForwardArgs>(
      layer, args, "FusemoeCForwardArgs",
      [](const fusemoe::LayerConfig& config, Impl impl, const FusemoeCForwardArgs& a, fusemoe::ForwardArgs f) {
        f.y = a.y;
        fusemoe::forward(config, impl, f);
      });
}

int32_t fusemoe_c_backward(const FusemoeCLayer* layer, const FusemoeCBackwardArgs* args) {
  return layer_call<fusemoe::BackwardArgs>(
      layer, args, "FusemoeCBackwardArgs",
      [](const fusemoe::LayerConfig& config, Impl impl, const FusemoeCBackwardArgs& a, fusemoe::BackwardArgs b) {
        copy_gradient_fields(b, a);
        b.dw1 = a.dw1;
        b.dw3 = a.dw3;
        fusemoe::backward(config, impl, b);
      });
}

int32_t fusemoe_c_ep_symmetric_bytes(const FusemoeCEpConfig* config, uint64_t* bytes) {
  return ep_bytes(config, bytes, [](const fusemoe::EpConfig& c) { return fusemoe::ep_symmetric_bytes(c); });
}

int32_t fusemoe_c_ep_workspace_bytes(const FusemoeCEpConfig* config, uint64_t* bytes) {
  return ep_bytes(config, bytes, [](const fusemoe::EpConfig& c) { return fusemoe::ep_workspace_bytes(c); });
}

int32_t fusemoe_c_ep_workspace_bytes_for(const FusemoeCEpConfig* config, int32_t use, uint64_t* bytes) {
  return ep_bytes(config, bytes, [use](const fusemoe::EpConfig& c) {
    return fusemoe::ep_workspace_bytes(c, static_cast<fusemoe::WorkspaceUse>(use));
  });
}

int32_t fusemoe_c_ep_saved_state_bytes(const FusemoeCEpConfig* config, uint64_t* bytes) {
  return ep_bytes(config, bytes, [](const fusemoe::EpConfig& c) { return fusemoe::ep_saved_state_bytes(c); });
}

int32_t fusemoe_c_ep_fp8_weights_bytes(const FusemoeCEpConfig* config, uint64_t* bytes) {
  return ep_bytes(config, bytes, [](const fusemoe::EpConfig& c) { return fusemoe::ep_fp8_weights_bytes(c); });
}

int32_t fusemoe_c_ep_quantize_weights_fp8(const FusemoeCEpConfig* config, const FusemoeCFp8QuantizeArgs* args) {
  return guarded([&] {
    const fusemoe::EpConfig c = ep_config_of(checked_struct(config, "config", "FusemoeCEpConfig"));
    const FusemoeCFp8QuantizeArgs& a = checked_struct(args, "args", "FusemoeCFp8QuantizeArgs");
    FUSEMOE_CHECK(a.w1 == nullptr && a.w3 == nullptr,
                  "FusemoeCFp8QuantizeArgs.w1 and w3 must be null for expert parallelism (its layer takes w13)");
    fusemoe::ep_quantize_weights_fp8(c, a.w13, a.w2, a.buffer, a.buffer_bytes, static_cast<cudaStream_t>(a.stream));
  });
}

int32_t fusemoe_c_ep_forward(const FusemoeCEpConfig* config, const FusemoeCEpForwardArgs* args) {
  return ep_call(config, args, "FusemoeCEpForwardArgs",
                 [](const fusemoe::EpConfig& c, const FusemoeCEpForwardArgs& a, const fusemoe::EpCall& call) {
                   fusemoe::EpForwardArgs f;
                   f.call = call;
                   f.y = a.y;
                   f.saved_state = a.saved_state;
                   fusemoe::ep_forward(c, f);
                 });
}

int32_t fusemoe_c_ep_backward(const FusemoeCEpConfig* config, const FusemoeCEpBackwardArgs* args) {
  return ep_call(config, args, "FusemoeCEpBackwardArgs",
                 [](const fusemoe::EpConfig& c, const FusemoeCEpBackwardArgs& a, const fusemoe::EpCall& call) {
                   fusemoe::EpBackwardArgs b;
                   b.call = call;
                   copy_gradient_fields(b, a);
                   b.saved_state = a.saved_state;
                   fusemoe::ep_backward(c, b);
                 });
}

int32_t fusemoe_c_check_expert_id_report(const int32_t* report, int64_t num_experts,
                                         int64_t top_k) {
  return guarded([&] { fusemoe::throw_if_expert_id_report(report, num_experts, top_k); });
}

int32_t fusemoe_c_struct_layout(const char* struct_name, uint64_t* struct_size,
                                int32_t* num_fields) {
  return guarded([&] {
    FUSEMOE_CHECK(struct_size != nullptr && num_fields != nullptr,
                  "struct_size and num_fields (outputs) must not be null");
    const StructLayout& s = find_struct(struct_name);
    *struct_size = s.size;
    *num_fields = s.num_fields;
  });
}

int32_t fusemoe_c_struct_field(const char* struct_name, int32_t field_index,
                               const char** field_name, uint64_t* offset, uint64_t* size) {
  return guarded([&] {
    FUSEMOE_CHECK(field_name != nullptr && offset != nullptr && size != nullptr,
                  "field_name, offset and size (outputs) must not be null");
    const StructLayout& s = find_struct(struct_name);
    FUSEMOE_CHECK(field_index >= 0 && field_index < s.num_fields,
                  "field_index: " << field_index << " is outside [0, " << s.num_fields << ") for "
                                  << s.name);
    const FieldLayout& f = s.fields[field_index];
    *field_name = f.name;
    *offset = f.offset;
    *size = f.size;
  });
}

}  // extern "C"

// Public entry points: validate -> dispatch to the selected implementation. Every argument check
// lives here, before any device work, so a bad call fails with a message naming the argument
// and touches no memory. Host-only checks come first (they run without a GPU, which the CPU
// tests rely on); the device and pointer checks follow.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <type_traits>

#include "api/checks.h"
#include "fusemoe/fusemoe.h"
#include "kernels/routing.h"
#include "pipelines/fused_forward.h"
#include "pipelines/fused_backward.h"
#include "pipelines/fused_fp8.h"
#include "pipelines/unfused.h"

namespace fusemoe {
namespace {

void check_impl(Impl impl) {
  FUSEMOE_CHECK(impl == Impl::kUnfused || impl == Impl::kReferenceFp32 || impl == Impl::kFused,
                "impl: unknown implementation " << static_cast<int>(impl));
}

// Precision::kFp8Blockwise runs on the fused kernels only.
void check_impl_precision(const LayerConfig& config, Impl impl) {
  FUSEMOE_CHECK(config.precision == Precision::kBf16 || impl == Impl::kFused,
                "precision " << precision_name(config.precision) << " is supported by Impl::kFused only (got "
                             << impl_name(impl) << ")");
}

// ForwardArgs / BackwardArgs::saved_z (host checks): optional, fused only, 16-byte aligned.
void check_saved_z(Impl impl, const void* saved_z) {
  if (saved_z == nullptr) return;
  FUSEMOE_CHECK(impl == Impl::kFused, "saved_z is supported by Impl::kFused only (got "
                                          << impl_name(impl) << "): pass null");
  FUSEMOE_CHECK(aligned(saved_z, kTmaAlignment),
                "saved_z must be " << kTmaAlignment << "-byte aligned, got " << saved_z);
}

// After a call with sync_check_expert_ids: synchronise and report bad ids, except while the
// stream is being captured (a sync is illegal there; the record stays for check_expert_ids).
void sync_check_unless_capturing(const LayerConfig& config, Impl impl, void* workspace,
                                 cudaStream_t stream) {
  if (!stream_is_capturing(stream)) check_expert_ids(config, impl, workspace, stream);
}

// Device checks of the optional pointers both directions take.
void check_optional_pointers(const int32_t* expert_id_report, const void* saved_z) {
  if (expert_id_report != nullptr) check_expert_id_report_pointer(expert_id_report);
  if (saved_z != nullptr) check_device_pointer(saved_z, "saved_z");
}

// The end of a fused call: the expert-id check the caller chose. A caller's report gets the
// record from the device (no sync); otherwise sync_check_expert_ids syncs and throws here.
void finish_fused_call(const LayerConfig& config, bool sync_check_expert_ids,
                       const int32_t* expert_id_report, void* workspace, cudaStream_t stream) {
  if (sync_check_expert_ids && expert_id_report == nullptr) {
    sync_check_unless_capturing(config, Impl::kFused, workspace, stream);
  }
}

const char* use_name(WorkspaceUse use) {
  switch (use) {
    case WorkspaceUse::kForward: return "forward";
    case WorkspaceUse::kBackward: return "backward";
    case WorkspaceUse::kBackwardSavedZ: return "backward with saved_z";
  }
  return "unknown";
}

// Each call checks its own need (workspace_bytes(config, impl, use)): a buffer of
// workspace_bytes(config, impl) passes every check.
void check_workspace(const LayerConfig& config, Impl impl, WorkspaceUse use, const void* workspace,
                     size_t bytes) {
  const size_t needed = workspace_bytes(config, impl, use);
  FUSEMOE_CHECK(workspace != nullptr, "workspace must not be null (need " << needed << " bytes)");
  FUSEMOE_CHECK(aligned(workspace, kWorkspaceAlignment),
                "workspace must be " << kWorkspaceAlignment << "-byte aligned");
  FUSEMOE_CHECK(bytes >= needed, "workspace_bytes: " << bytes << " bytes given, " << needed
                                                     << " needed for impl " << impl_name(impl) << " ("
                                                     << use_name(use) << ")");
}

void check_num_tokens(const LayerConfig& config, int64_t num_tokens) {
  FUSEMOE_CHECK(num_tokens >= 0 && num_tokens <= config.max_tokens,
                "num_tokens must be in [0, max_tokens=" << config.max_tokens << "], got "
                                                        << num_tokens);
}

}  // namespace

const char* precision_name(Precision precision) {
  switch (precision) {
    case Precision::kBf16: return "bf16";
    case Precision::kFp8Blockwise: return "fp8_blockwise";
  }
  return "unknown";
}

const char* impl_name(Impl impl) {
  switch (impl) {
    case Impl::kUnfused: return "unfused";
    case Impl::kReferenceFp32: return "reference_fp32";
    case Impl::kFused: return "fused";
  }
  return "unknown";
}

void validate_config(const LayerConfig& c) {
  FUSEMOE_CHECK(c.hidden > 0 && c.hidden % 128 == 0,
                "hidden (H) must be a positive multiple of 128, got " << c.hidden);
  FUSEMOE_CHECK(c.intermediate > 0 && c.intermediate % 64 == 0,
                "intermediate (I) must be a positive multiple of 64, got " << c.intermediate);
  FUSEMOE_CHECK(c.hidden <= (1 << 20) && c.intermediate <= (1 << 20),
                "hidden and intermediate must be <= 2^20 (got " << c.hidden << ", "
                                                                << c.intermediate << ")");
  FUSEMOE_CHECK(c.num_experts >= 1 && c.num_experts <= kMaxExperts,
                "num_experts (E) must be in [1, " << kMaxExperts << "], got " << c.num_experts);
  FUSEMOE_CHECK(c.top_k >= 1 && c.top_k <= kMaxTopK && c.top_k <= c.num_experts,
                "top_k (K) must be in [1, min(num_experts, " << kMaxTopK << ")], got " << c.top_k);
  FUSEMOE_CHECK(c.max_tokens >= 0, "max_tokens must be >= 0, got " << c.max_tokens);
  // Divided, not multiplied: the product of two int64 arguments could wrap and pass.
  FUSEMOE_CHECK(c.max_tokens <= std::numeric_limits<int32_t>::max() / c.top_k,
                "max_tokens * top_k must be < 2^31 (rows are int32 indices), got "
                    << c.max_tokens << " * " << c.top_k);
  // TMA tensor maps address the weights as [E * 2I, H] and [E * H, I] rows (32-bit row
  // counts) and x as [T, H] (at most 2^32 16-byte elements).
  FUSEMOE_CHECK(c.num_experts * 2 * c.intermediate < (int64_t(1) << 31) &&
                    c.num_experts * c.hidden < (int64_t(1) << 31),
                "num_experts * 2 * intermediate and num_experts * hidden must be < 2^31, got E="
                    << c.num_experts << ", H=" << c.hidden << ", I=" << c.intermediate);
  FUSEMOE_CHECK(c.max_tokens * c.hidden <= (int64_t(1) << 35),
                "max_tokens * hidden must be <= 2^35 (x as 16-byte TMA elements < 2^32), got "
                    << c.max_tokens << " * " << c.hidden);
  // The fused GEMMs number their tiles in int32: row tiles (R / 128 plus one partial block per
  // expert) times column tiles (I / 128 or H / 256 at most), and the weight gradients' expert
  // output tiles (E x M / 128 x N / 256 for dW13 [2I, H] and dW2 [H, I]).
  const int64_t row_blocks = c.max_tokens * c.top_k / 128 + c.num_experts;
  const int64_t column_tiles = std::max((c.intermediate + 127) / 128, (c.hidden + 255) / 256);
  const int64_t weight_grad_tiles = std::max(c.num_experts * (2 * c.intermediate / 128) * ((c.hidden + 255) / 256),
                                             c.num_experts * (c.hidden / 128) * ((c.intermediate + 255) / 256));
  FUSEMOE_CHECK(row_blocks * column_tiles < (int64_t(1) << 31) && weight_grad_tiles < (int64_t(1) << 31),
                "the layer has too many GEMM tiles for int32 tile indices (max_tokens * top_k / 128 + num_experts = "
                    << row_blocks << " row blocks x " << column_tiles << " column tiles, " << weight_grad_tiles
                    << " weight-gradient tiles; each product must be < 2^31)");
  if (c.use_swiglu_clamp) {
    FUSEMOE_CHECK(std::isfinite(c.swiglu_clamp) && c.swiglu_clamp > 0.0f,
                  "swiglu_clamp must be finite and > 0 when use_swiglu_clamp is set, got "
                      << c.swiglu_clamp);
  }
  FUSEMOE_CHECK(c.precision == Precision::kBf16 || c.precision == Precision::kFp8Blockwise,
                "precision: unknown value " << static_cast<int>(c.precision) << " (0 bf16, 1 fp8_blockwise)");
  FUSEMOE_CHECK(!c.fp8_weight_grads || c.precision == Precision::kFp8Blockwise,
                "fp8_weight_grads needs precision fp8_blockwise (got " << precision_name(c.precision) << ")");
  // FP8: every K and N of the GEMMs a whole number of 128-blocks (1 x 128 scales of h along I).
  FUSEMOE_CHECK(c.precision != Precision::kFp8Blockwise || c.intermediate % 128 == 0,
                "precision fp8_blockwise needs intermediate (I) to be a multiple of 128, got " << c.intermediate);
}

size_t workspace_bytes(const LayerConfig& config, Impl impl, WorkspaceUse use) {
  validate_config(config);
  check_impl(impl);
  FUSEMOE_CHECK(use == WorkspaceUse::kForward || use == WorkspaceUse::kBackward ||
                    use == WorkspaceUse::kBackwardSavedZ,
                "use: unknown WorkspaceUse value " << static_cast<int>(use)
                                                    << " (0 forward, 1 backward, 2 backward with saved_z)");
  check_impl_precision(config, impl);
  if (impl != Impl::kFused) return unfused_workspace_bytes(config, impl);
  // Both directions carve the routing plan at the start of the workspace.
  if (config.precision == Precision::kFp8Blockwise) {
    switch (use) {
      case WorkspaceUse::kForward: return fused_fp8_forward_workspace_bytes(config);
      case WorkspaceUse::kBackward: return fused_fp8_backward_workspace_bytes(config, /*z_saved=*/false);
      case WorkspaceUse::kBackwardSavedZ: return fused_fp8_backward_workspace_bytes(config, /*z_saved=*/true);
    }
  }
  switch (use) {
    case WorkspaceUse::kForward: return fused_workspace_bytes(config);
    case WorkspaceUse::kBackward: return fused_backward_workspace_bytes(config, /*z_saved=*/false);
    case WorkspaceUse::kBackwardSavedZ: return fused_backward_workspace_bytes(config, /*z_saved=*/true);
  }
  return 0;  // not reached: checked above
}

size_t workspace_bytes(const LayerConfig& config, Impl impl) {
  return std::max({workspace_bytes(config, impl, WorkspaceUse::kForward),
                   workspace_bytes(config, impl, WorkspaceUse::kBackward),
                   workspace_bytes(config, impl, WorkspaceUse::kBackwardSavedZ)});
}

void check_expert_ids(const LayerConfig& config, Impl impl, const void* workspace,
                      cudaStream_t stream) {
  validate_config(config);
  check_impl(impl);
  FUSEMOE_CHECK(workspace != nullptr, "workspace must not be null");
  FUSEMOE_CHECK(aligned(workspace, kWorkspaceAlignment),
                "workspace must be " << kWorkspaceAlignment << "-byte aligned");
  check_device_pointer(workspace, "workspace");
  const RoutingPlan plan = impl == Impl::kFused
                               ? fused_routing_plan(config, const_cast<void*>(workspace))
                               : unfused_routing_plan(config, impl, const_cast<void*>(workspace));
  check_routing_record(plan, config.num_experts, config.top_k, stream);
}

size_t saved_z_bytes(const LayerConfig& config) {
  validate_config(config);
  return static_cast<size_t>(config.max_tokens) * config.top_k * 2 * config.intermediate * 2;
}

int64_t max_tokens_that_fit(const LayerConfig& config, Impl impl, size_t free_bytes, bool save_z) {
  check_impl(impl);
  FUSEMOE_CHECK(!save_z || impl == Impl::kFused,
                "save_z: saved z is supported by Impl::kFused only (got " << impl_name(impl) << ")");
  LayerConfig c = config;
  c.max_tokens = 0;
  validate_config(c);  // names a bad field; every later T passes the same field checks
  // Both conditions only get harder as T grows, so the T that fit form a prefix [0, answer].
  auto fits = [&](int64_t tokens) {
    c.max_tokens = tokens;
    try {
      validate_config(c);
    } catch (const Error&) {
      return false;  // past a token limit (rows or elements of 32-bit index arithmetic)
    }
    const WorkspaceUse backward_use = save_z ? WorkspaceUse::kBackwardSavedZ : WorkspaceUse::kBackward;
    const size_t tensors = static_cast<size_t>(tokens) * (4 * c.hidden * 2 + 3 * c.top_k * 4);
    const size_t needed = std::max(workspace_bytes(c, impl, WorkspaceUse::kForward),
                                   workspace_bytes(c, impl, backward_use)) +
                          (save_z ? saved_z_bytes(c) : 0) + tensors;
    return needed <= free_bytes;
  };
  if (!fits(0)) return -1;
  // Doubling ends: validate_config rejects T >= 2^31 / K.
  int64_t fitting = 0, too_many = 1;
  while (fits(too_many)) {
    fitting = too_many;
    too_many *= 2;
  }
  while (too_many - fitting > 1) {
    const int64_t middle = fitting + (too_many - fitting) / 2;
    (fits(middle) ? fitting : too_many) = middle;
  }
  return fitting;
}

void throw_if_expert_id_report(const int32_t report[kExpertIdReportInts], int64_t num_experts,
                               int64_t top_k) {
  FUSEMOE_CHECK(report != nullptr, "expert id report must not be null");
  FUSEMOE_CHECK(num_experts >= 1 && top_k >= 1,
                "num_experts and top_k must be >= 1, got " << num_experts << ", " << top_k);
  check_bad_id_record(report, num_experts, top_k);
}

namespace {

// The gate and up weights (or their gradients) in one of two forms: `both` [E, 2I, H], or `gate`
// and `up` [E, I, H] each. Exactly one form; names say which argument is missing or extra.
// Returns true for the separate form.
bool check_gate_up_form(const void* both, const void* gate, const void* up, const char* both_name,
                        const char* gate_name, const char* up_name) {
  const bool separate = gate != nullptr || up != nullptr;
  FUSEMOE_CHECK(!(both != nullptr && separate), "pass either " << both_name << " or " << gate_name << " and "
                                                               << up_name << ", not both");
  if (!separate) {
    FUSEMOE_CHECK(both != nullptr,
                  both_name << " must not be null (or pass " << gate_name << " and " << up_name << ")");
    check_tensor(both, both_name, kTmaAlignment);
    return false;
  }
  FUSEMOE_CHECK(gate != nullptr, gate_name << " must not be null when " << up_name << " is set (they go together)");
  FUSEMOE_CHECK(up != nullptr, up_name << " must not be null when " << gate_name << " is set (they go together)");
  check_tensor(gate, gate_name, kTmaAlignment);
  check_tensor(up, up_name, kTmaAlignment);
  return true;
}

// The bf16 weights: required for bf16, not read (so optional) for FP8. Returns true when the gate
// and up weights are separate (w1, w3).
bool check_bf16_weights_arg(const LayerConfig& config, const void* w13, const void* w1, const void* w3,
                            const void* w2) {
  if (config.precision != Precision::kBf16 && w13 == nullptr && w1 == nullptr && w3 == nullptr && w2 == nullptr) {
    return false;
  }
  const bool separate = check_gate_up_form(w13, w1, w3, "w13", "w1", "w3");
  check_tensor(w2, "w2", kTmaAlignment);
  return separate;
}

// dw13, or dw1 and dw3, which the kernels write concurrently: they must not overlap. Called when
// one of the three is set (none of them: frozen gate/up weights, which checked_layer_call allows).
bool check_gate_up_grads_arg(const LayerConfig& config, WeightGradDtype dtype, const void* dw13, const void* dw1,
                             const void* dw3) {
  if (!check_gate_up_form(dw13, dw1, dw3, "dw13", "dw1", "dw3")) return false;
  const uintptr_t bytes = static_cast<uintptr_t>(config.num_experts * config.intermediate * config.hidden) *
                          (dtype == WeightGradDtype::kFloat32 ? 4 : 2);
  const uintptr_t gate = reinterpret_cast<uintptr_t>(dw1), up = reinterpret_cast<uintptr_t>(dw3);
  FUSEMOE_CHECK(gate + bytes <= up || up + bytes <= gate,
                "dw1 and dw3 must not overlap (" << bytes << " bytes each at " << dw1 << " and " << dw3 << ")");
  return true;
}

// The fused kernels read w1 and w3 through two tensor maps and write dW1 and dW3 as two launches
// of 128-row weight-gradient tiles (so I % 128 == 0). The cuBLAS pipelines (kUnfused,
// kReferenceFp32) read w13 only: the separate form is refused there, after every host check and
// before any device work.
void check_separate_gate_up_supported(Impl impl, const LayerConfig& config, bool separate_weights,
                                      bool separate_grads) {
  FUSEMOE_CHECK(impl == Impl::kFused || (!separate_weights && !separate_grads),
                (separate_weights ? "w1/w3" : "dw1/dw3")
                    << " (separate gate and up " << (separate_weights ? "weights" : "weight gradients")
                    << ") are not supported yet by impl " << impl_name(impl) << " (Impl::kFused reads them): pass "
                    << (separate_weights ? "w13" : "dw13") << " [E, 2I, H]");
  FUSEMOE_CHECK(!separate_grads || config.intermediate % 128 == 0,
                "dw1/dw3 (separate gate and up weight gradients) need intermediate (I) to be a multiple of 128 "
                "(128-row weight-gradient tiles), got "
                    << config.intermediate << ": pass dw13 [E, 2I, H]");
}

void check_weight_device_pointers(const LayerConfig& config, const void* w13, const void* w1, const void* w3,
                                  const void* w2, const void* fp8_weights) {
  if (w13 != nullptr) check_device_pointer(w13, "w13");
  if (w1 != nullptr) check_device_pointer(w1, "w1");
  if (w3 != nullptr) check_device_pointer(w3, "w3");
  if (w2 != nullptr) check_device_pointer(w2, "w2");
  if (config.precision != Precision::kBf16) check_device_pointer(fp8_weights, "fp8_weights");
}

}  // namespace

// The FP8 weight buffer exists at precision fp8_blockwise only, so the layer's shape is checked
// at that precision (I % 128 == 0 among the rest), whatever config.precision says: the buffer
// does not depend on it.
size_t fp8_weights_bytes(const LayerConfig& config) {
  LayerConfig fp8 = config;
  fp8.precision = Precision::kFp8Blockwise;
  validate_config(fp8);
  return fp8_weights_buffer_bytes(fp8);
}

Fp8Weights fp8_weights_view(const LayerConfig& config, const void* buffer) {
  fp8_weights_bytes(config);  // validates
  FUSEMOE_CHECK(buffer != nullptr, "fp8 weight buffer must not be null");
  FUSEMOE_CHECK(aligned(buffer, kWorkspaceAlignment),
                "fp8 weight buffer must be " << kWorkspaceAlignment << "-byte aligned, got " << buffer);
  return fp8_weights_in(config, buffer);
}

namespace {

// The checks of both quantize_weights_fp8 forms; true for separate gate and up weights.
bool check_quantize_args(const LayerConfig& config, const void* w13, const void* w1, const void* w3, const void* w2,
                         const void* buffer, size_t buffer_bytes) {
  const size_t needed = fp8_weights_bytes(config);
  const bool separate = check_gate_up_form(w13, w1, w3, "w13", "w1", "w3");
  check_tensor(w2, "w2", kTmaAlignment);
  FUSEMOE_CHECK(buffer != nullptr, "fp8 weight buffer must not be null (need " << needed << " bytes)");
  FUSEMOE_CHECK(aligned(buffer, kWorkspaceAlignment),
                "fp8 weight buffer must be " << kWorkspaceAlignment << "-byte aligned, got " << buffer);
  FUSEMOE_CHECK(buffer_bytes >= needed,
                "fp8 weight buffer: " << buffer_bytes << " bytes given, " << needed << " needed");
  return separate;
}

}  // namespace

void quantize_weights_fp8(const LayerConfig& config, const void* w1, const void* w3, const void* w2, void* buffer,
                          size_t buffer_bytes, cudaStream_t stream) {
  FUSEMOE_CHECK(w1 != nullptr || w3 != nullptr, "w1 and w3 must not be null");
  check_quantize_args(config, nullptr, w1, w3, w2, buffer, buffer_bytes);
  check_device();
  check_device_pointer(w1, "w1");
  check_device_pointer(w3, "w3");
  check_device_pointer(w2, "w2");
  check_device_pointer(buffer, "fp8 weight buffer");
  quantize_fp8_weights(config, w1, w3, w2, buffer, stream);
}

void quantize_weights_fp8(const LayerConfig& config, const void* w13, const void* w2, void* buffer,
                          size_t buffer_bytes, cudaStream_t stream) {
  FUSEMOE_CHECK(w13 != nullptr, "w13 must not be null");
  check_quantize_args(config, w13, nullptr, nullptr, w2, buffer, buffer_bytes);
  check_device();
  check_device_pointer(w13, "w13");
  check_device_pointer(w2, "w2");
  check_device_pointer(buffer, "fp8 weight buffer");
  quantize_fp8_weights(config, w13, nullptr, w2, buffer, stream);
}

namespace {

// One checked call of either pass: the checks in order of cost (arguments, then sizes, then CUDA
// queries), then the pipeline of the implementation and precision. token_tensors are the
// per-token arguments, checked when the call has tokens.
template <typename Args>
void checked_layer_call(const LayerConfig& config, Impl impl, const Args& a,
                        std::initializer_list<NamedTensor> token_tensors) {
  constexpr bool kBackward = std::is_same_v<Args, BackwardArgs>;
  validate_config(config);
  check_impl(impl);
  check_impl_precision(config, impl);
  check_num_tokens(config, a.num_tokens);
  WorkspaceUse use = WorkspaceUse::kForward;
  NamedTensor outputs_always[3] = {};  // the weight gradients: written at T = 0 too
  int num_outputs_always = 0;
  if constexpr (kBackward) {
    FUSEMOE_CHECK(a.weight_grad_dtype == WeightGradDtype::kFloat32 ||
                      a.weight_grad_dtype == WeightGradDtype::kBFloat16,
                  "weight_grad_dtype: unknown value " << static_cast<int>(a.weight_grad_dtype));
    use = a.saved_z != nullptr ? WorkspaceUse::kBackwardSavedZ : WorkspaceUse::kBackward;
  }
  const bool separate_weights = check_bf16_weights_arg(config, a.w13, a.w1, a.w3, a.w2);
  bool separate_grads = false;
  if constexpr (kBackward) {
    // No gate/up gradient output (dw13, dw1, dw3 all null) or no dw2: that gradient is not
    // computed (frozen weights).
    if (a.dw13 != nullptr || a.dw1 != nullptr || a.dw3 != nullptr) {
      separate_grads = check_gate_up_grads_arg(config, a.weight_grad_dtype, a.dw13, a.dw1, a.dw3);
      if (separate_grads) {
        outputs_always[num_outputs_always++] = NamedTensor{a.dw1, "dw1", kTmaAlignment};
        outputs_always[num_outputs_always++] = NamedTensor{a.dw3, "dw3", kTmaAlignment};
      } else {
        outputs_always[num_outputs_always++] = NamedTensor{a.dw13, "dw13", kTmaAlignment};
      }
    }
    if (a.dw2 != nullptr) outputs_always[num_outputs_always++] = NamedTensor{a.dw2, "dw2", kTmaAlignment};
  }
  check_fp8_weights_arg(config, a.fp8_weights);
  check_tensors(outputs_always, outputs_always + num_outputs_always);
  if (a.num_tokens > 0) check_tensors(token_tensors.begin(), token_tensors.end());
  check_saved_z(impl, a.saved_z);
  if (a.expert_id_report != nullptr) check_tensor(a.expert_id_report, "expert_id_report", 4);
  check_workspace(config, impl, use, a.workspace, a.workspace_bytes);
  check_separate_gate_up_supported(impl, config, separate_weights, separate_grads);
  check_device();
  if (!a.caller_checked_pointers) {
    check_weight_device_pointers(config, a.w13, a.w1, a.w3, a.w2, a.fp8_weights);
    check_device_pointers(outputs_always, outputs_always + num_outputs_always);
    check_device_pointer(a.workspace, "workspace");
    if (a.num_tokens > 0) check_device_pointers(token_tensors.begin(), token_tensors.end());
    check_optional_pointers(a.expert_id_report, a.saved_z);
  }
  if (impl != Impl::kFused) {
    if constexpr (kBackward) unfused_backward(config, impl, a);
    else unfused_forward(config, impl, a);
    return;
  }
  const bool fp8 = config.precision == Precision::kFp8Blockwise;
  if constexpr (kBackward) fp8 ? fused_fp8_backward(config, a) : fused_backward(config, a);
  else fp8 ? fused_fp8_forward(config, a) : fused_forward(config, a);
  finish_fused_call(config, a.sync_check_expert_ids, a.expert_id_report, a.workspace, a.stream);
}

}  // namespace

void forward(const LayerConfig& config, Impl impl, const ForwardArgs& a) {
  checked_layer_call(config, impl, a,
                     {NamedTensor{a.x, "x", kTmaAlignment}, NamedTensor{a.topk_idx, "topk_idx", 4},
                      NamedTensor{a.topk_weights, "topk_weights", 4}, NamedTensor{a.y, "y", kTmaAlignment}});
}

void backward(const LayerConfig& config, Impl impl, const BackwardArgs& a) {
  checked_layer_call(config, impl, a,
                     {NamedTensor{a.x, "x", kTmaAlignment}, NamedTensor{a.topk_idx, "topk_idx", 4},
                      NamedTensor{a.topk_weights, "topk_weights", 4}, NamedTensor{a.dy, "dy", kTmaAlignment},
                      NamedTensor{a.dx, "dx", kTmaAlignment}, NamedTensor{a.d_topk_weights, "d_topk_weights", 4}});
}

}  // namespace fusemoe

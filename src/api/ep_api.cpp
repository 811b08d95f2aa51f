// Public entry points of the expert-parallel layer (include/fusemoe/expert_parallel.h):
// validate -> dispatch, as api.cpp does for the single-GPU layer. Every check is here; the
// pipeline (src/pipelines/ep_layer.cu) and its launchers only assert.
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <limits>

#include "api/checks.h"
#include "fusemoe/expert_parallel.h"
#include "fusemoe/fusemoe.h"
#include "kernels/routing.h"
#include "pipelines/ep_layer.h"
#include "pipelines/ep_workspace.h"

namespace fusemoe {
namespace {

void check_common(const EpConfig& c, void* const* peer_symmetric, void* workspace, size_t workspace_bytes,
                  WorkspaceUse use, int64_t num_tokens, int num_sms) {
  validate_ep_config(c);
  FUSEMOE_CHECK(num_tokens >= 0 && num_tokens <= c.layer.max_tokens,
                "num_tokens must be in [0, max_tokens=" << c.layer.max_tokens << "], got " << num_tokens);
  FUSEMOE_CHECK(peer_symmetric != nullptr, "peer_symmetric must point to world_size (" << c.world_size
                                                                                        << ") symmetric workspaces");
  for (int d = 0; d < c.world_size; ++d) {
    FUSEMOE_CHECK(peer_symmetric[d] != nullptr && aligned(peer_symmetric[d], kWorkspaceAlignment),
                  "peer_symmetric[" << d << "] must be a non-null " << kWorkspaceAlignment
                                    << "-byte aligned pointer, got " << peer_symmetric[d]);
  }
  const size_t needed = ep_workspace_bytes(c, use);
  FUSEMOE_CHECK(workspace != nullptr && aligned(workspace, kWorkspaceAlignment),
                "workspace must be a non-null " << kWorkspaceAlignment << "-byte aligned pointer (need " << needed
                                                << " bytes)");
  FUSEMOE_CHECK(workspace_bytes >= needed,
                "workspace_bytes: " << workspace_bytes << " bytes given, " << needed << " needed");
  FUSEMOE_CHECK(num_sms >= 0, "num_sms must be >= 0 (0: every SM), got " << num_sms);
}

// The checks every call makes, as api.cpp orders them: host checks first (config, peers,
// workspace, the tensors it always takes and those it takes when it has tokens, the optional
// ones), then the device and this rank's own pointers (not peer_symmetric: other ranks' memory,
// mapped into this process), then the call, then the expert-id check the caller chose.
template <class Run>
void run_checked(const EpConfig& c, const EpCall& a, const void* saved_state, WorkspaceUse use,
                 const NamedTensor* outputs, int num_outputs, std::initializer_list<NamedTensor> with_tokens,
                 Run run) {
  check_common(c, a.peer_symmetric, a.workspace, a.workspace_bytes, use, a.num_tokens, a.num_sms);
  const bool fp8 = c.layer.precision == Precision::kFp8Blockwise;
  const NamedTensor weights[] = {{a.w13, "w13", kTmaAlignment}, {a.w2, "w2", kTmaAlignment}};
  const NamedTensor tokens[] = {
      {a.x, "x", kTmaAlignment}, {a.topk_idx, "topk_idx", 4}, {a.topk_weights, "topk_weights", 4}};
  // The bf16 weights: required at bf16; an FP8 call does not read them (null both, or both checked).
  const bool bf16_weights = !fp8 || a.w13 != nullptr || a.w2 != nullptr;
  if (bf16_weights) check_tensors(std::begin(weights), std::end(weights));
  check_fp8_weights_arg(c.layer, a.fp8_weights);
  check_tensors(outputs, outputs + num_outputs);
  if (a.num_tokens > 0) {
    check_tensors(std::begin(tokens), std::end(tokens));
    check_tensors(with_tokens.begin(), with_tokens.end());
  }
  if (saved_state != nullptr) check_tensor(saved_state, "saved_state", kTmaAlignment);
  if (a.expert_id_report != nullptr) check_tensor(a.expert_id_report, "expert_id_report", 4);
  check_device();
  if (bf16_weights) check_device_pointers(std::begin(weights), std::end(weights));
  if (fp8) check_device_pointer(a.fp8_weights, "fp8_weights");
  check_device_pointers(outputs, outputs + num_outputs);
  check_device_pointer(a.workspace, "workspace");
  if (a.num_tokens > 0) {
    check_device_pointers(std::begin(tokens), std::end(tokens));
    check_device_pointers(with_tokens.begin(), with_tokens.end());
  }
  if (saved_state != nullptr) check_device_pointer(saved_state, "saved_state");
  if (a.expert_id_report != nullptr) check_expert_id_report_pointer(a.expert_id_report);
  run();
  if (a.sync_check_expert_ids && a.expert_id_report == nullptr && !stream_is_capturing(a.stream)) {
    check_routing_record(ep_routing_plan(c, a.workspace), c.layer.num_experts, c.layer.top_k, a.stream);
  }
}

}  // namespace

void validate_ep_config(const EpConfig& c) {
  validate_config(c.layer);  // the FP8 shape limits too (I % 128 == 0)
  // The EP backward's weight gradients come from its bf16 pools; the FP8 ones (token-blocked
  // pools of the owner's rows) are not built for it yet.
  FUSEMOE_CHECK(!c.layer.fp8_weight_grads,
                "layer.fp8_weight_grads must be false for expert parallelism (not supported yet: the weight "
                "gradients come from bf16 operands), got true");
  FUSEMOE_CHECK(c.world_size == 1 || c.world_size == 2 || c.world_size == 4 || c.world_size == 8,
                "world_size must be 1, 2, 4 or 8, got " << c.world_size);
  FUSEMOE_CHECK(c.rank >= 0 && c.rank < c.world_size,
                "rank must be in [0, world_size=" << c.world_size << "), got " << c.rank);
  FUSEMOE_CHECK(c.layer.num_experts % c.world_size == 0,
                "num_experts (" << c.layer.num_experts << ") must be divisible by world_size (" << c.world_size << ")");
  // Unreachable while kMaxExperts <= kEpMaxLocalExperts; checked here so the launchers may assert
  // it after the call has started signalling peers.
  FUSEMOE_CHECK(c.layer.num_experts / c.world_size <= kEpMaxLocalExperts,
                "num_experts / world_size (experts per rank) must be <= " << kEpMaxLocalExperts << ", got "
                                                                           << c.layer.num_experts / c.world_size);
  // An owner may receive every slot of every rank: its rows are world_size * max_tokens * top_k.
  FUSEMOE_CHECK(c.layer.max_tokens < std::numeric_limits<int32_t>::max() / c.layer.top_k / c.world_size,
                "world_size * max_tokens * top_k must be < 2^31 (an owner's rows are int32 indices), got "
                    << c.world_size << " * " << c.layer.max_tokens << " * " << c.layer.top_k);
  validate_config(ep_owner_layer(c));
}

size_t ep_symmetric_bytes(const EpConfig& config) {
  validate_ep_config(config);
  return ep_symmetric_layout_bytes(config);
}

size_t ep_workspace_bytes(const EpConfig& config, WorkspaceUse use) {
  validate_ep_config(config);
  FUSEMOE_CHECK(use == WorkspaceUse::kForward || use == WorkspaceUse::kBackward || use == WorkspaceUse::kBackwardSavedZ,
                "use: unknown WorkspaceUse value " << static_cast<int>(use));
  return ep_private_workspace_bytes(config, use);
}

size_t ep_workspace_bytes(const EpConfig& config) {
  size_t bytes = 0;
  for (WorkspaceUse use : {WorkspaceUse::kForward, WorkspaceUse::kBackward, WorkspaceUse::kBackwardSavedZ}) {
    const size_t b = ep_workspace_bytes(config, use);
    bytes = b > bytes ? b : bytes;
  }
  return bytes;
}

size_t ep_saved_state_bytes(const EpConfig& config) {
  validate_ep_config(config);
  return saved_z_bytes(ep_owner_layer(config));  // z of the owner's R * T * K rows
}

size_t ep_fp8_weights_bytes(const EpConfig& config) {
  validate_ep_config(config);
  return fp8_weights_bytes(ep_owner_layer(config));  // the single-GPU buffer of this rank's E/R experts
}

void ep_quantize_weights_fp8(const EpConfig& config, const void* w13, const void* w2, void* buffer,
                             size_t buffer_bytes, cudaStream_t stream) {
  validate_ep_config(config);
  quantize_weights_fp8(ep_owner_layer(config), w13, w2, buffer, buffer_bytes, stream);
}

void ep_forward(const EpConfig& c, const EpForwardArgs& a) {
  run_checked(c, a.call, a.saved_state, WorkspaceUse::kForward, nullptr, 0, {{a.y, "y", kTmaAlignment}},
              [&] { ep_layer_forward(c, a); });
}

void ep_backward(const EpConfig& c, const EpBackwardArgs& a) {
  FUSEMOE_CHECK(a.weight_grad_dtype == WeightGradDtype::kFloat32 || a.weight_grad_dtype == WeightGradDtype::kBFloat16,
                "weight_grad_dtype: unknown value " << static_cast<int>(a.weight_grad_dtype));
  // A null dw13 or dw2: that weight is frozen and its gradient not computed (BackwardArgs).
  NamedTensor weight_grads[2] = {};
  int num_weight_grads = 0;
  if (a.dw13 != nullptr) weight_grads[num_weight_grads++] = {a.dw13, "dw13", kTmaAlignment};
  if (a.dw2 != nullptr) weight_grads[num_weight_grads++] = {a.dw2, "dw2", kTmaAlignment};
  run_checked(c, a.call, a.saved_state,
              a.saved_state != nullptr ? WorkspaceUse::kBackwardSavedZ : WorkspaceUse::kBackward,
              weight_grads, num_weight_grads,
              {{a.dy, "dy", kTmaAlignment}, {a.dx, "dx", kTmaAlignment}, {a.d_topk_weights, "d_topk_weights", 4}},
              [&] { ep_layer_backward(c, a); });
}

}  // namespace fusemoe

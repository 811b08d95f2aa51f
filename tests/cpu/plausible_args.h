// Call arguments for the CPU suites' API checks: fake but aligned device addresses (the host checks
// reject a call before any pointer is used), so a test changes one field and expects the error
// that names it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include <gtest/gtest.h>

#include "common/call_inputs.h"
#include "fusemoe/fusemoe.h"

namespace fusemoe {

// The fields ForwardArgs and BackwardArgs share: 8 tokens of bf16 inputs and a workspace of
// impl's size (the addresses of the workspace and the outputs are each call's own).
template <typename Args>
Args with_plausible_inputs(const LayerConfig& c, Impl impl) {
  Args a;
  harness::set_layer_inputs(a, reinterpret_cast<const void*>(0x10000), reinterpret_cast<const int32_t*>(0x20000),
                            reinterpret_cast<const float*>(0x30000), reinterpret_cast<const void*>(0x40000),
                            reinterpret_cast<const void*>(0x50000), /*num_tokens=*/8, /*workspace=*/nullptr,
                            workspace_bytes(c, impl));
  return a;
}

inline ForwardArgs plausible_forward_args(const LayerConfig& c, Impl impl) {
  ForwardArgs a = with_plausible_inputs<ForwardArgs>(c, impl);
  a.y = reinterpret_cast<void*>(0x60000);
  a.workspace = reinterpret_cast<void*>(0x70000);
  return a;
}

inline BackwardArgs plausible_backward_args(const LayerConfig& c, Impl impl) {
  BackwardArgs a = with_plausible_inputs<BackwardArgs>(c, impl);
  a.dy = reinterpret_cast<const void*>(0x60000);
  a.dx = reinterpret_cast<void*>(0x70000);
  a.d_topk_weights = reinterpret_cast<float*>(0x80000);
  a.dw13 = reinterpret_cast<void*>(0x90000);
  a.dw2 = reinterpret_cast<void*>(0xa0000);
  a.workspace = reinterpret_cast<void*>(0xb0000);
  return a;
}

// Where the FP8 calls' weight buffer lies: past every address above.
constexpr uintptr_t kPlausibleFp8Weights = 0x100000;

// Impl::kFused's workspace per call at c, expecting workspace_bytes(c, Impl::kFused) (the size
// that serves every call) to be the largest of them.
struct FusedWorkspaces {
  size_t forward, backward, backward_saved_z;
};

inline FusedWorkspaces checked_fused_workspaces(const LayerConfig& c) {
  const FusedWorkspaces w{workspace_bytes(c, Impl::kFused, WorkspaceUse::kForward),
                          workspace_bytes(c, Impl::kFused, WorkspaceUse::kBackward),
                          workspace_bytes(c, Impl::kFused, WorkspaceUse::kBackwardSavedZ)};
  EXPECT_EQ(workspace_bytes(c, Impl::kFused), std::max({w.forward, w.backward, w.backward_saved_z}));
  return w;
}

}  // namespace fusemoe

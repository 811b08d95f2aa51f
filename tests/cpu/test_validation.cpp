// Argument validation of the public API, checked without a GPU: every bad config or argument
// must throw fusemoe::Error whose message names the argument, before any device work.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>

#include "common/layer_config.h"
#include "expect_error.h"
#include "plausible_args.h"
#include "fusemoe/fusemoe.h"

namespace fusemoe {
namespace {

LayerConfig good_config() { return harness::layer_config(256, 128, 8, 2, 64); }

TEST(Validation, GoodConfigPasses) { EXPECT_NO_THROW(validate_config(good_config())); }

TEST(Validation, BadConfigsNameTheField) {
  struct Case {
    std::function<void(LayerConfig&)> mutate;
    const char* needle;
  };
  const Case cases[] = {
      {[](LayerConfig& c) { c.hidden = 0; }, "hidden"},
      {[](LayerConfig& c) { c.hidden = 200; }, "hidden"},
      {[](LayerConfig& c) { c.intermediate = 100; }, "intermediate"},
      {[](LayerConfig& c) { c.num_experts = 0; }, "num_experts"},
      {[](LayerConfig& c) { c.num_experts = kMaxExperts + 1; }, "num_experts"},
      {[](LayerConfig& c) { c.top_k = 0; }, "top_k"},
      {[](LayerConfig& c) { c.top_k = 9; }, "top_k"},  // > num_experts
      {[](LayerConfig& c) { c.max_tokens = -1; }, "max_tokens"},
      {[](LayerConfig& c) { c.max_tokens = int64_t(1) << 30; }, "max_tokens * top_k"},
      // Products that would wrap int64 must not pass the limit.
      {[](LayerConfig& c) { c.max_tokens = int64_t(1) << 62; }, "max_tokens * top_k"},
      {[](LayerConfig& c) { c.max_tokens = (int64_t(1) << 61) + 1000; c.top_k = 8; }, "max_tokens * top_k"},
      {[](LayerConfig& c) { c.max_tokens = std::numeric_limits<int64_t>::max(); }, "max_tokens * top_k"},
      {[](LayerConfig& c) { c.num_experts = 1024; c.intermediate = int64_t(1) << 20; }, "num_experts * 2 * intermediate"},
      {[](LayerConfig& c) { c.hidden = int64_t(1) << 20; c.max_tokens = int64_t(1) << 16; }, "max_tokens * hidden"},
      // 1024 x (2^20 / 128) x (2^20 / 256) weight-gradient tiles exceed int32 tile indices.
      {[](LayerConfig& c) { c.num_experts = 1024; c.intermediate = int64_t(1) << 19; c.hidden = int64_t(1) << 20; },
       "too many GEMM tiles"},
      {[](LayerConfig& c) { c.use_swiglu_clamp = true; c.swiglu_clamp = 0.0f; }, "swiglu_clamp"},
      {[](LayerConfig& c) { c.use_swiglu_clamp = true; c.swiglu_clamp = 1.0f / 0.0f; }, "swiglu_clamp"},
  };
  for (const Case& c : cases) {
    LayerConfig config = good_config();
    c.mutate(config);
    expect_error_mentioning([&] { validate_config(config); }, c.needle);
    expect_error_mentioning([&] { (void)workspace_bytes(config, Impl::kUnfused); }, c.needle);
  }
}

TEST(Validation, WorkspaceGrowsWithMaxTokens) {
  LayerConfig small = good_config(), large = good_config();
  large.max_tokens = 4096;
  EXPECT_LT(workspace_bytes(small, Impl::kUnfused), workspace_bytes(large, Impl::kUnfused));
  // The fp32 reference holds fp32 pools and widened weights: strictly more.
  EXPECT_LT(workspace_bytes(small, Impl::kUnfused), workspace_bytes(small, Impl::kReferenceFp32));
  LayerConfig empty = good_config();
  empty.max_tokens = 0;
  EXPECT_GT(workspace_bytes(empty, Impl::kUnfused), 0u);
  // The fused implementation keeps no weight-sized scratch: smaller than the unfused one.
  EXPECT_GT(workspace_bytes(large, Impl::kFused), workspace_bytes(small, Impl::kFused));
  EXPECT_LT(workspace_bytes(large, Impl::kFused), workspace_bytes(large, Impl::kUnfused));
}

TEST(Validation, CheckExpertIdsNamesItsArguments) {
  expect_error_mentioning(
      [] { check_expert_ids(good_config(), Impl::kFused, nullptr, nullptr); }, "workspace");
  LayerConfig bad = good_config();
  bad.top_k = 0;
  int dummy = 0;
  expect_error_mentioning([&] { check_expert_ids(bad, Impl::kFused, &dummy, nullptr); }, "top_k");
  expect_error_mentioning(
      [&] { check_expert_ids(good_config(), static_cast<Impl>(9), &dummy, nullptr); }, "impl");
}

TEST(Validation, ExpertIdReportIsReadOnTheHost) {
  int32_t report[kExpertIdReportInts] = {0, 0, 0};
  EXPECT_NO_THROW(throw_if_expert_id_report(report, 8, 2));
  report[0] = 1;
  report[1] = 2 * 5 + 1;
  report[2] = -3;
  expect_error_mentioning([&] { throw_if_expert_id_report(report, 8, 2); },
                          "1 expert id(s) outside [-1, 8); first at token 5, slot 1, value -3");
  expect_error_mentioning([] { throw_if_expert_id_report(nullptr, 8, 2); }, "report");
  expect_error_mentioning([&] { throw_if_expert_id_report(report, 0, 2); }, "num_experts");
}

TEST(Validation, ForwardArgumentsNamed) {
  const LayerConfig c = good_config();
  struct Case {
    std::function<void(ForwardArgs&)> mutate;
    const char* needle;
  };
  const Case cases[] = {
      {[](ForwardArgs& a) { a.num_tokens = 65; }, "num_tokens"},
      {[](ForwardArgs& a) { a.num_tokens = -1; }, "num_tokens"},
      {[](ForwardArgs& a) { a.x = nullptr; }, "x must not be null"},
      {[](ForwardArgs& a) { a.x = reinterpret_cast<const void*>(0x10008); }, "x must be 16-byte aligned"},
      {[](ForwardArgs& a) { a.topk_idx = nullptr; }, "topk_idx"},
      {[](ForwardArgs& a) { a.topk_weights = reinterpret_cast<const float*>(0x30002); }, "topk_weights"},
      {[](ForwardArgs& a) { a.w13 = nullptr; }, "w13"},
      {[](ForwardArgs& a) { a.w2 = reinterpret_cast<const void*>(0x50004); }, "w2"},
      {[](ForwardArgs& a) { a.y = nullptr; }, "y must not be null"},
      {[](ForwardArgs& a) { a.workspace = nullptr; }, "workspace"},
      {[](ForwardArgs& a) { a.workspace = reinterpret_cast<void*>(0x70010); }, "workspace must be 256-byte aligned"},
      {[](ForwardArgs& a) { a.workspace_bytes -= 1; }, "workspace_bytes"},
      {[](ForwardArgs& a) { a.saved_z = reinterpret_cast<void*>(0x90000); },
       "saved_z is supported by Impl::kFused only"},
      {[](ForwardArgs& a) { a.expert_id_report = reinterpret_cast<int32_t*>(0xa0002); },
       "expert_id_report must be 4-byte aligned"},
  };
  // The host checks run whether or not the caller vouches for its pointers.
  for (bool caller_checked_pointers : {false, true}) {
    for (const Case& tc : cases) {
      ForwardArgs a = plausible_forward_args(c, Impl::kUnfused);
      a.caller_checked_pointers = caller_checked_pointers;
      tc.mutate(a);
      expect_error_mentioning([&] { forward(c, Impl::kUnfused, a); }, tc.needle);
    }
  }
  ForwardArgs a = plausible_forward_args(c, Impl::kUnfused);
  expect_error_mentioning([&] { forward(c, static_cast<Impl>(42), a); }, "impl");
  a.saved_z = reinterpret_cast<void*>(0x90008);
  expect_error_mentioning([&] { forward(c, Impl::kFused, a); }, "saved_z must be 16-byte aligned");
  // 2 I K bf16 per token.
  EXPECT_EQ(saved_z_bytes(c), static_cast<size_t>(c.max_tokens * c.top_k * 2 * c.intermediate * 2));
}

TEST(Validation, BackwardArgumentsNamed) {
  const LayerConfig c = good_config();
  const BackwardArgs base = plausible_backward_args(c, Impl::kUnfused);
  struct Case {
    std::function<void(BackwardArgs&)> mutate;
    const char* needle;
  };
  const Case cases[] = {
      {[](BackwardArgs& a) { a.dy = nullptr; }, "dy must not be null"},
      {[](BackwardArgs& a) { a.dx = reinterpret_cast<void*>(0x70002); }, "dx must be 16-byte aligned"},
      {[](BackwardArgs& a) { a.d_topk_weights = nullptr; }, "d_topk_weights"},
      {[](BackwardArgs& a) { a.dw13 = reinterpret_cast<void*>(0x90004); }, "dw13 must be 16-byte aligned"},
      {[](BackwardArgs& a) { a.dw2 = reinterpret_cast<void*>(0xa0004); }, "dw2 must be 16-byte aligned"},
      // A null dw13 or dw2 means frozen weights (not computed); the other output is still checked.
      {[](BackwardArgs& a) {
         a.dw13 = nullptr;
         a.dw2 = reinterpret_cast<void*>(0xa0004);
       },
       "dw2 must be 16-byte aligned"},
      {[](BackwardArgs& a) { a.weight_grad_dtype = static_cast<WeightGradDtype>(7); }, "weight_grad_dtype"},
      {[](BackwardArgs& a) { a.num_tokens = 100; }, "num_tokens"},
      {[](BackwardArgs& a) { a.workspace_bytes = 0; }, "workspace_bytes"},
      {[](BackwardArgs& a) { a.saved_z = reinterpret_cast<const void*>(0xc0000); },
       "saved_z is supported by Impl::kFused only"},
  };
  for (bool caller_checked_pointers : {false, true}) {
    for (const Case& tc : cases) {
      BackwardArgs a = base;
      a.caller_checked_pointers = caller_checked_pointers;
      tc.mutate(a);
      expect_error_mentioning([&] { backward(c, Impl::kUnfused, a); }, tc.needle);
    }
  }
}

// Per-call workspace sizes (WorkspaceUse): the fused backward given saved z needs exactly the
// room for z less (to the 256-byte alignment of the carve), every call checks only its own need,
// and workspace_bytes(config, impl) is the largest.
TEST(Validation, WorkspacePerCall) {
  LayerConfig c = good_config();
  c.max_tokens = 1000;
  const FusedWorkspaces w = checked_fused_workspaces(c);
  EXPECT_LT(w.forward, w.backward);
  EXPECT_GE(w.backward - w.backward_saved_z, saved_z_bytes(c));
  EXPECT_LT(w.backward - w.backward_saved_z, saved_z_bytes(c) + 256);
  for (Impl impl : {Impl::kUnfused, Impl::kReferenceFp32}) {
    for (WorkspaceUse use : {WorkspaceUse::kForward, WorkspaceUse::kBackward, WorkspaceUse::kBackwardSavedZ}) {
      EXPECT_EQ(workspace_bytes(c, impl, use), workspace_bytes(c, impl));
    }
  }
  expect_error_mentioning([&] { (void)workspace_bytes(c, Impl::kFused, static_cast<WorkspaceUse>(5)); },
                          "WorkspaceUse");

  // One byte short of a call's own need fails, naming the call.
  ForwardArgs fa = plausible_forward_args(c, Impl::kFused);
  fa.workspace_bytes = w.forward - 1;
  expect_error_mentioning([&] { forward(c, Impl::kFused, fa); }, "needed for impl fused (forward)");
  BackwardArgs ba = plausible_backward_args(c, Impl::kFused);
  ba.saved_z = reinterpret_cast<const void*>(0xc0000);
  ba.workspace_bytes = w.backward_saved_z - 1;
  expect_error_mentioning([&] { backward(c, Impl::kFused, ba); }, "needed for impl fused (backward with saved_z)");
  // Without saved z the backward needs the room for z: the saved-z size is too small.
  ba.saved_z = nullptr;
  ba.workspace_bytes = w.backward_saved_z;
  expect_error_mentioning([&] { backward(c, Impl::kFused, ba); }, "needed for impl fused (backward)");
}

}  // namespace
}  // namespace fusemoe

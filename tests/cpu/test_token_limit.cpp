// max_tokens_that_fit (fusemoe.h), checked without a GPU against this file's own count of what it
// documents: the workspace serving the forward and the backward, saved z, x/y/dy/dx and the
// [T, K] tensors. It must return the boundary exactly (T fits, T + 1 does not or is past the
// token limits), grow with free_bytes, and give the Qwen3 presets' largest T on an H200.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <vector>

#include "common/layer_config.h"
#include "expect_error.h"
#include "fusemoe/fusemoe.h"

namespace fusemoe {
namespace {

constexpr size_t kGiB = size_t(1) << 30;
// An H200's memory as nvidia-smi reports it (the 141 GB part): 143771 MiB.
constexpr size_t kH200Bytes = size_t(143771) << 20;

using harness::layer_config;
using harness::qwen3_235b_config;
using harness::qwen3_30b_config;

bool valid_at(LayerConfig c, int64_t tokens) {
  c.max_tokens = tokens;
  try {
    validate_config(c);
    return true;
  } catch (const Error&) {
    return false;
  }
}

// The bytes max_tokens_that_fit documents, for max_tokens = tokens (which must be valid).
size_t bytes_at(LayerConfig c, Impl impl, bool save_z, int64_t tokens) {
  c.max_tokens = tokens;
  const size_t workspace =
      std::max(workspace_bytes(c, impl, WorkspaceUse::kForward),
               workspace_bytes(c, impl, save_z ? WorkspaceUse::kBackwardSavedZ : WorkspaceUse::kBackward));
  const size_t x_y_dy_dx = 4 * static_cast<size_t>(tokens) * c.hidden * 2;
  const size_t idx_w_dw = 3 * static_cast<size_t>(tokens) * c.top_k * 4;
  return workspace + (save_z ? saved_z_bytes(c) : 0) + x_y_dy_dx + idx_w_dw;
}

// T = max_tokens_that_fit(free) is the boundary: T fits and T + 1 does not (or is invalid).
void expect_boundary(const LayerConfig& c, Impl impl, bool save_z, size_t free_bytes) {
  const int64_t tokens = max_tokens_that_fit(c, impl, free_bytes, save_z);
  SCOPED_TRACE(::testing::Message() << impl_name(impl) << (save_z ? " saved z" : "") << " H=" << c.hidden
                                    << " I=" << c.intermediate << " E=" << c.num_experts << " K=" << c.top_k
                                    << " free " << free_bytes << " -> T " << tokens);
  if (tokens < 0) {
    EXPECT_EQ(tokens, -1);
    EXPECT_GT(bytes_at(c, impl, save_z, 0), free_bytes) << "T = 0 fits, yet -1 was returned";
    return;
  }
  ASSERT_TRUE(valid_at(c, tokens));
  EXPECT_LE(bytes_at(c, impl, save_z, tokens), free_bytes);
  if (valid_at(c, tokens + 1)) EXPECT_GT(bytes_at(c, impl, save_z, tokens + 1), free_bytes);
}

struct Case {
  LayerConfig config;
  Impl impl;
  bool save_z;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const LayerConfig& c : {layer_config(256, 128, 8, 2), layer_config(384, 192, 1000, 32),
                               layer_config(128, 64, 1, 1), qwen3_30b_config(), qwen3_235b_config()}) {
    out.push_back({c, Impl::kFused, false});
    out.push_back({c, Impl::kFused, true});
    out.push_back({c, Impl::kUnfused, false});
    out.push_back({c, Impl::kReferenceFp32, false});
  }
  return out;
}

TEST(TokenLimit, ExactAtTheBoundary) {
  for (const Case& k : cases()) {
    // Exactly the bytes of some T, one byte less and one more, and sizes in between.
    for (int64_t tokens : {0, 1, 7, 199, 4097, 100000, 262144}) {
      const size_t at = bytes_at(k.config, k.impl, k.save_z, tokens);
      EXPECT_EQ(max_tokens_that_fit(k.config, k.impl, at, k.save_z), tokens);
      for (size_t free_bytes : {at - 1, at + 1, at + at / 3}) expect_boundary(k.config, k.impl, k.save_z, free_bytes);
    }
    for (size_t free_bytes : {size_t(0), size_t(1) << 20, 3 * kGiB + 12345, 80 * kGiB, kH200Bytes}) {
      expect_boundary(k.config, k.impl, k.save_z, free_bytes);
    }
  }
}

TEST(TokenLimit, GrowsWithFreeBytes) {
  for (const Case& k : cases()) {
    int64_t previous = -1;
    for (double free_bytes = 1 << 16; free_bytes < 1e13; free_bytes *= 1.37) {
      const int64_t tokens = max_tokens_that_fit(k.config, k.impl, static_cast<size_t>(free_bytes), k.save_z);
      EXPECT_GE(tokens, previous) << impl_name(k.impl) << " at " << free_bytes << " bytes";
      previous = tokens;
    }
  }
}

// Memory holds no more than the token limits allow: the answer is the largest valid T.
TEST(TokenLimit, CappedByTheTokenLimits) {
  const LayerConfig c = layer_config(128, 64, 32, 32);
  const int64_t tokens = max_tokens_that_fit(c, Impl::kFused, std::numeric_limits<size_t>::max(), false);
  EXPECT_EQ(tokens, std::numeric_limits<int32_t>::max() / 32);  // max_tokens * top_k < 2^31
  EXPECT_TRUE(valid_at(c, tokens));
  EXPECT_FALSE(valid_at(c, tokens + 1));
}

TEST(TokenLimit, ArgumentsChecked) {
  EXPECT_EQ(max_tokens_that_fit(qwen3_30b_config(), Impl::kFused, 0, false), -1);
  expect_error_mentioning([] { (void)max_tokens_that_fit(qwen3_30b_config(), Impl::kUnfused, kGiB, true); }, "save_z");
  expect_error_mentioning([] { (void)max_tokens_that_fit(layer_config(100, 128, 8, 2), Impl::kFused, kGiB, false); },
                          "hidden");
  expect_error_mentioning([] { (void)max_tokens_that_fit(qwen3_30b_config(), static_cast<Impl>(7), kGiB, false); },
                          "impl");
}

// On an H200 with the layer's bf16 weights and fp32 weight gradients resident (nothing else):
// the largest T per preset. The GPU suite runs Qwen3-30B-A3B at T = 262144
// (tests/gpu/test_limits.cpp), so that must fit; the figures are quoted in docs/design.md.
TEST(TokenLimit, QwenPresetsOnAnH200) {
  struct Preset {
    const char* name;
    LayerConfig config;
  };
  for (const Preset& p : {Preset{"qwen3-30b-a3b", qwen3_30b_config()}, Preset{"qwen3-235b-a22b", qwen3_235b_config()}}) {
    const LayerConfig& c = p.config;
    const size_t weights = static_cast<size_t>(c.num_experts) * 3 * c.intermediate * c.hidden;  // elements
    const size_t resident = weights * 2 + weights * 4;  // bf16 weights + fp32 gradients
    const size_t free_bytes = kH200Bytes - resident;
    for (const Case& k : {Case{c, Impl::kFused, true}, Case{c, Impl::kFused, false}, Case{c, Impl::kUnfused, false},
                          Case{c, Impl::kReferenceFp32, false}}) {
      const int64_t tokens = max_tokens_that_fit(c, k.impl, free_bytes, k.save_z);
      std::printf("%s, %s%s: T <= %lld (%.2f GiB of %.2f GiB free)\n", p.name, impl_name(k.impl),
                  k.save_z ? " (saved z)" : "", static_cast<long long>(tokens),
                  bytes_at(c, k.impl, k.save_z, tokens) / double(kGiB), free_bytes / double(kGiB));
      expect_boundary(c, k.impl, k.save_z, free_bytes);
    }
  }
  const LayerConfig c = qwen3_30b_config();
  const size_t resident = static_cast<size_t>(c.num_experts) * 3 * c.intermediate * c.hidden * 6;
  EXPECT_GE(max_tokens_that_fit(c, Impl::kFused, kH200Bytes - resident, true), 262144);
  EXPECT_GE(max_tokens_that_fit(c, Impl::kFused, kH200Bytes - resident, false), 262144);
}

}  // namespace
}  // namespace fusemoe

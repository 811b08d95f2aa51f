// The layer shapes the test suites name, as LayerConfigs (bf16, no clamp): one spelling of a
// shape, so a suite's config and the shape it means cannot drift apart.
// Legend: H hidden, I intermediate, E experts, K top-k.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusemoe/fusemoe.h"

namespace fusemoe::harness {

// layer_config() initialises LayerConfig's first five fields by position: keep them in this order.
static_assert(offsetof(LayerConfig, hidden) == 0 && offsetof(LayerConfig, intermediate) == 8 &&
                  offsetof(LayerConfig, num_experts) == 16 && offsetof(LayerConfig, top_k) == 24 &&
                  offsetof(LayerConfig, max_tokens) == 32,
              "LayerConfig: hidden, intermediate, num_experts, top_k, max_tokens first, in this order");

inline LayerConfig layer_config(int64_t hidden, int64_t intermediate, int64_t num_experts, int64_t top_k,
                                int64_t max_tokens = 0) {
  return LayerConfig{hidden, intermediate, num_experts, top_k, max_tokens};
}

// A layer's shape without a token count.
struct LayerShape {
  int64_t hidden, intermediate, num_experts, top_k;
};
inline LayerConfig layer_config(const LayerShape& s, int64_t max_tokens = 0) {
  return layer_config(s.hidden, s.intermediate, s.num_experts, s.top_k, max_tokens);
}

// The model layers, spelled once: the benchmarks' presets (benchmarks/bench/options.h), the
// suites' configs below and their Dims (tests/gpu) use these.
constexpr LayerShape kQwen3_30bA3b{2048, 768, 128, 8};
constexpr LayerShape kQwen3_235bA22b{4096, 1536, 128, 8};
// Qwen3-Next-80B-A3B's routed experts (many small experts, top-10) and DeepSeek-V3's (wide
// hidden); their shared experts are dense MLPs, not part of this layer.
constexpr LayerShape kQwen3Next{2048, 512, 512, 10};
constexpr LayerShape kDeepSeekV3{7168, 2048, 256, 8};
inline LayerConfig qwen3_30b_config(int64_t max_tokens = 0) { return layer_config(kQwen3_30bA3b, max_tokens); }
inline LayerConfig qwen3_235b_config(int64_t max_tokens = 0) { return layer_config(kQwen3_235bA22b, max_tokens); }

}  // namespace fusemoe::harness

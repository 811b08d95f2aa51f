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

// The Qwen3 MoE layers the benchmark presets run (all 128 experts, top-8).
inline LayerConfig qwen3_30b_config(int64_t max_tokens = 0) { return layer_config(2048, 768, 128, 8, max_tokens); }
inline LayerConfig qwen3_235b_config(int64_t max_tokens = 0) { return layer_config(4096, 1536, 128, 8, max_tokens); }

}  // namespace fusemoe::harness

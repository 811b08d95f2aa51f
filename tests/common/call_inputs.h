// The layer inputs of one call, set on any of the API's argument structs (ForwardArgs,
// BackwardArgs, EpCall): the fields all of them name alike, spelled once for the tests and the
// benchmarks.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fusemoe::harness {

template <typename Args>
Args& set_layer_inputs(Args& a, const void* x, const int32_t* topk_idx, const float* topk_weights, const void* w13,
                       const void* w2, int64_t num_tokens, void* workspace, size_t workspace_bytes) {
  a.x = x;
  a.topk_idx = topk_idx;
  a.topk_weights = topk_weights;
  a.w13 = w13;
  a.w2 = w2;
  a.num_tokens = num_tokens;
  a.workspace = workspace;
  a.workspace_bytes = workspace_bytes;
  return a;
}

}  // namespace fusemoe::harness

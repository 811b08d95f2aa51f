// The fused pipelines at Precision::kFp8Blockwise (Impl::kFused) on sm_90a, and the FP8 weight
// buffer they read. Arguments are validated by src/api before any of this runs.
#pragma once

#include <cstddef>

#include "fusemoe/fusemoe.h"
#include "kernels/routing.h"

namespace fusemoe {

size_t fp8_weights_buffer_bytes(const LayerConfig& config);
Fp8Weights fp8_weights_in(const LayerConfig& config, const void* buffer);
// w13 [E, 2I, H], or (w3 set) w13 is w1 [E, I, H] and w3 the up weights: the same buffer.
void quantize_fp8_weights(const LayerConfig& config, const void* w13, const void* w3, const void* w2, void* buffer,
                          cudaStream_t stream);

// Workspaces: the routing plan at the start, as in the BF16 fused workspaces, so
// fused_routing_plan() finds the record of an FP8 call too.
size_t fused_fp8_forward_workspace_bytes(const LayerConfig& config);
size_t fused_fp8_backward_workspace_bytes(const LayerConfig& config, bool z_saved);
void fused_fp8_forward(const LayerConfig& config, const ForwardArgs& args);
void fused_fp8_backward(const LayerConfig& config, const BackwardArgs& args);

}  // namespace fusemoe

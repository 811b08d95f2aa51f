// Running fusemoe_bench: the layer's device inputs and outputs, one forward or backward call of
// an implementation through the public API, and the whole run (ceiling, then per token count:
// routing, check, timings).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "bench/memory.h"
#include "bench/options.h"
#include "bench/report.h"
#include "common/device_buffer.h"

namespace fusemoe::bench {

using harness::DeviceBuffer;

struct LayerInputs {
  DeviceBuffer x_TH, dy_TH;             // [max T, H] bf16; a call with T tokens uses the first T rows
  DeviceBuffer w13_EFH, w2_EHI;         // bf16
  DeviceBuffer topk_idx_TK, topk_w_TK;  // [max T, K]; rewritten per token count
  DeviceBuffer fp8_weights;             // quantize_weights_fp8 of w13, w2 (when an FP8 impl runs)
  DeviceBuffer w1_EIH, w3_EIH;          // w13's gate and up rows apart (when a separate_gate_up impl runs)
};

// Copies the gate rows [0, I) and up rows [I, 2I) of each expert of w13-laid `src` [E, 2I, H]
// into `gate` and `up` [E, I, H] (elem_bytes per element): the separate form of the same values.
void split_gate_up(const LayerConfig& config, const void* src, void* gate, void* up, size_t elem_bytes,
                   cudaStream_t stream);

// Every output of forward and backward (sizes: layer_buffer_bytes); the weight gradients are
// sized for fp32 and hold bf16 in their first half when the weight-gradient dtype is bf16.
struct LayerOutputs {
  DeviceBuffer y_TH, dx_TH, d_topk_w_TK, dw13_EFH, dw2_EHI;
  DeviceBuffer saved_z_SF;  // z of the last forward of an impl with save_z, read by its backward

  LayerOutputs(const LayerConfig& c, bool save_z);
  void* saved_z(const BenchImpl& impl) const { return impl.save_z ? saved_z_SF.get() : nullptr; }
  // All of them, saved z included: a backward that reads saved z must follow its own forward
  // after a poison.
  void poison(cudaStream_t stream) const;
};

// The config an implementation runs with: the layer at the implementation's precision.
LayerConfig impl_config(const LayerConfig& config, const BenchImpl& impl);

DeviceBuffer allocate_workspace(const LayerConfig& config, const BenchImpl& impl);

// fit_experts against what the device has free now; sets params->preset.num_experts to the E
// chosen.
ExpertFit fit_to_device(BenchParams* params, size_t flush_bytes);

// As a training loop calls them: no per-call sync (sync_check_expert_ids off).
void run_forward(const LayerConfig& config, const BenchImpl& impl, const LayerInputs& in, const LayerOutputs& out,
                 const DeviceBuffer& workspace, int64_t num_tokens, cudaStream_t stream);
void run_backward(const LayerConfig& config, const BenchImpl& impl, const LayerInputs& in, const LayerOutputs& out,
                  const DeviceBuffer& workspace, int64_t num_tokens, WeightGradDtype weight_grad_dtype,
                  cudaStream_t stream);

const char* wgrad_name(WeightGradDtype dtype);

// Everything after the GPU is known to be a Hopper; fills `result` as it goes, so that a runtime
// error still leaves the figures gathered so far. Returns false when a check failed.
bool run_bench(const BenchParams& params, BenchResult& result);

}  // namespace fusemoe::bench

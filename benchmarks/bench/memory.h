// The device memory fusemoe_bench holds at once, and the expert count that fits the GPU. The
// bench allocates every buffer from the sizes here (run.cpp), so the count cannot drift from
// what it allocates. Counted for the largest T: x, dy, routing, the bf16 weights (and their FP8
// copy when an FP8 impl runs), the outputs with fp32-sized weight gradients, saved z, one
// workspace per impl, the fp32 reference's workspace and outputs when some T is checked, and
// the L2 flush buffer. Not counted: the ceiling GEMM's operands (freed before the layer's are
// made) and a few small per-check buffers, which kHeadroomBytes covers.
// Legend: T tokens, H hidden, I intermediate, E experts, K top-k.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "bench/options.h"

namespace fusemoe::bench {

// Left free beside the count: cuBLAS's workspaces, lazily loaded kernel modules and
// cudaMalloc's rounding of ~20 buffers to 2 MiB pages.
constexpr size_t kHeadroomBytes = size_t(1) << 30;

// The bytes of each buffer of one layer at config.max_tokens tokens.
struct LayerBufferBytes {
  size_t x_TH;                      // also dy, y and dx: [T, H] bf16
  size_t topk_idx_TK, topk_w_TK;    // also d_topk_weights (fp32)
  size_t w13_EFH, w2_EHI;           // bf16 weights
  size_t dw13_EFH, dw2_EHI;         // weight gradients, sized for fp32
  size_t saved_z;                   // saved_z_bytes(config)
};
LayerBufferBytes layer_buffer_bytes(const LayerConfig& config);

// The workspace the bench allocates for an implementation: at least one aligned block, so a
// zero-byte workspace is still a valid pointer.
size_t bench_workspace_bytes(const LayerConfig& config, const BenchImpl& impl);

// The largest T that is checked against the fp32 reference (its buffers are sized for it); 0
// when no T is.
int64_t reference_max_tokens(const BenchParams& params);

// Everything counted above for params (its preset, tokens, impls and check settings), with an
// L2 flush buffer of flush_bytes.
size_t bench_device_bytes(const BenchParams& params, size_t flush_bytes);

// The expert count a run uses, and why.
struct ExpertFit {
  int64_t preset_experts = 0, num_experts = 0;
  size_t preset_bytes = 0;  // bench_device_bytes at the preset's E
  size_t bytes = 0;         // ... at num_experts
  size_t free_bytes = 0;    // what the device had free (cudaMemGetInfo)
  bool fits = true;         // false: not even the smallest E fits; the preset's E is kept
  bool reduced() const { return num_experts != preset_experts; }
};

// The preset's E when it fits (bench_device_bytes + kHeadroomBytes <= free_bytes), else E halved
// while it stays even and >= K until it fits: E stays a divisor of the preset's (256 -> 128 ->
// 64 ...), and routed rows, hence FLOPs, do not change. Host only.
ExpertFit fit_experts(const BenchParams& params, size_t flush_bytes, size_t free_bytes);

// "E reduced 256 -> 128: 147.1 GiB needed at E=256, 139.3 GiB free (72.4 GiB at E=128)", or
// the warning when nothing fits; empty when the preset's E fits.
std::string expert_fit_note(const ExpertFit& fit);

}  // namespace fusemoe::bench

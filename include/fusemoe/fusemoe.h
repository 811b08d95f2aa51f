// fusemoe public C++ API: one Mixture-of-Experts layer (experts block) for training.
//
//   forward : y_t = sum_j w[t,j] * W2_e (silu(Wg_e x_t) * (Wu_e x_t)),  e = idx[t,j]
//   backward: dx, d_topk_weights, dw13, dw2 from dy (equations in docs/design.md).
//
// Every entry point takes device pointers, sizes and a cudaStream_t; nothing here depends on
// PyTorch. Tensors are dense, row-major, contiguous. Shape legend: T tokens, H hidden,
// I expert intermediate, E experts, K top-k.
//   x        [T, H]      bf16      tokens
//   topk_idx [T, K]      int32     expert ids; -1 = masked slot (contributes nothing)
//   topk_w   [T, K]      fp32      routing weights (used as given; no normalisation here)
//   w13      [E, 2I, H]  bf16      gate rows [0, I), then up rows [I, 2I)  (PyTorch out x in)
//   w2       [E, H, I]   bf16
//   y, dy, dx [T, H]     bf16
//   dw13 [E, 2I, H], dw2 [E, H, I]  fp32 or bf16 (WeightGradDtype)
// The gate and up weights come either concatenated (w13, Hugging Face's gate_up_proj) or as two
// tensors (w1 gate [E, I, H] and w3 up [E, I, H], torchtitan's GroupedExperts layout), read in
// place, never concatenated; the gradients go to dw13, or to dw1 and dw3, whichever the caller
// passes (independently of the weights' form).
//   w1, w3       [E, I, H]  bf16      gate rows, up rows
//   dw1, dw3     [E, I, H]  fp32 or bf16
//
// Errors: every function throws fusemoe::Error (file, line, message naming the argument) on bad
// input or a failed CUDA/cuBLAS call; nothing calls exit().
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "fusemoe/error.h"

namespace fusemoe {

// Which implementation runs the layer. Every implementation computes the same function through
// the same call, so tests and benchmarks compare them one-to-one.
enum class Impl {
  // cuBLAS grouped GEMMs + small CUDA kernels, bf16 intermediates (what a careful unfused
  // implementation does). Reads per-expert row counts on the host: one stream sync per call.
  kUnfused,
  // The same pipeline with every intermediate and the GEMMs in fp32 (weights widened to fp32
  // inside the workspace each call). Slow; the GPU oracle at full size.
  kReferenceFp32,
  // Persistent TMA + wgmma kernels on sm_90a, forward (gate/up + SwiGLU with the row gather,
  // down + routing weight, deterministic combine) and backward (z recompute, dgrad + SwiGLU
  // backward + router gradient, dgrad of x, per-expert weight gradients without atomics);
  // no host synchronisation, CUDA-graph capturable.
  kFused,
};

const char* impl_name(Impl impl);

enum class WeightGradDtype { kFloat32, kBFloat16 };

// Operand precision of the layer's GEMMs (docs/design.md, "Blockwise FP8"; numerics.md).
enum class Precision {
  kBf16,  // bf16 operands, fp32 accumulation (every Impl)
  // Impl::kFused only, intermediate % 128 == 0: E4M3 GEMM operands with DeepSeek-V3's blockwise
  // scales (1 x 128 for x, h, dy and dz, 128 x 128 for the weights), fp32 accumulation promoted
  // per 128-wide K-block; the combines, the router gradient and the weight gradients (from bf16
  // operands) in fp32; outputs and gradients in the dtypes of the bf16 path. Every call takes the
  // FP8 weights from quantize_weights_fp8 (ForwardArgs / BackwardArgs::fp8_weights).
  kFp8Blockwise,
};

const char* precision_name(Precision precision);

// Description of one layer. Limits (checked by validate_config):
//   hidden % 128 == 0, intermediate % 64 == 0 (the fused kernels' tile shapes need them),
//   1 <= num_experts <= kMaxExperts, 1 <= top_k <= min(num_experts, kMaxTopK),
//   max_tokens * top_k < 2^31 (row indices are int32).
struct LayerConfig {
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I
  int64_t num_experts = 0;   // E
  int64_t top_k = 0;         // K
  int64_t max_tokens = 0;    // largest T any call will pass; sizes the workspace
  // SwiGLU clamp (DeepSeek-V4 / gpt-oss style): when enabled, g <- min(g, c) and
  // u <- clamp(u, -c, c) before h = silu(g) * u. Gradients flow where c bounds are not active
  // (inclusive: g <= c, -c <= u <= c), as torch.clamp does.
  bool use_swiglu_clamp = false;
  float swiglu_clamp = 0.0f;  // c > 0, finite, when use_swiglu_clamp
  Precision precision = Precision::kBf16;
  // Precision::kFp8Blockwise only: the weight gradients' GEMMs in FP8 as well (dy and dz in
  // 1 x 128 blocks along each expert's tokens, x and w * h in 128 x 128 blocks of features by
  // tokens: docs/numerics.md). false: from the bf16 operands, as at Precision::kBf16.
  bool fp8_weight_grads = false;
};

constexpr int64_t kMaxExperts = 1024;  // routing keeps one counter per expert in shared memory
constexpr int64_t kMaxTopK = 32;       // a token's slots fit one warp in the combine kernels

// The FP8 copies of the expert weights (Precision::kFp8Blockwise), as arrays inside one buffer of
// fp8_weights_bytes(config) bytes that quantize_weights_fp8 writes; fp8_weights_view() finds them.
// Each 128 x 128 block of a weight has one fp32 scale (amax / 448); a weight's per-expert
// transpose (read K-major by the backward's dgrads, where the bf16 path reads the weight N-major)
// consists of the transposed blocks and shares their scales.
struct Fp8Weights {
  const void* w13 = nullptr;          // [E, 2I, H] E4M3
  const void* w13_t = nullptr;        // [E, H, 2I] E4M3: w13_t[e] = w13[e]^T
  const float* w13_scales = nullptr;  // [E, 2I/128, H/128]
  const void* w2 = nullptr;           // [E, H, I] E4M3
  const void* w2_t = nullptr;         // [E, I, H] E4M3: w2_t[e] = w2[e]^T
  const float* w2_scales = nullptr;   // [E, H/128, I/128]
};

// Bytes of the FP8 weight buffer of a config (2 bytes per bf16 weight element, plus the scales).
// These three functions check the config's shape as at Precision::kFp8Blockwise and do not read
// config.precision (the buffer is the same whatever it says).
size_t fp8_weights_bytes(const LayerConfig& config);
// The arrays inside a buffer of fp8_weights_bytes(config) bytes.
Fp8Weights fp8_weights_view(const LayerConfig& config, const void* buffer);
// Quantizes w13 [E, 2I, H] and w2 [E, H, I] (bf16, device) into `buffer` (device, 256-byte aligned,
// at least fp8_weights_bytes(config) bytes) on `stream`, without synchronising. Deterministic: the
// same weights give the same bytes. Callers run it once per weight update (an optimizer step),
// not once per call.
void quantize_weights_fp8(const LayerConfig& config, const void* w13, const void* w2, void* buffer,
                          size_t buffer_bytes, cudaStream_t stream);
// The same buffer (byte for byte) from separate gate and up weights w1, w3 [E, I, H] (bf16).
void quantize_weights_fp8(const LayerConfig& config, const void* w1, const void* w3, const void* w2, void* buffer,
                          size_t buffer_bytes, cudaStream_t stream);

struct ForwardArgs {
  const void* x = nullptr;              // [T, H] bf16
  const int32_t* topk_idx = nullptr;    // [T, K]
  const float* topk_weights = nullptr;  // [T, K]
  const void* w13 = nullptr;            // [E, 2I, H] bf16 (not read, and may be null, in FP8)
  const void* w2 = nullptr;             // [E, H, I] bf16 (not read, and may be null, in FP8)
  // Separate gate and up weights instead of w13 (w13 null): both or neither, [E, I, H] bf16 each
  // (not read, and may be null, in FP8). They may alias each other (they are only read).
  const void* w1 = nullptr;
  const void* w3 = nullptr;
  void* y = nullptr;                    // [T, H] bf16 (output)
  int64_t num_tokens = 0;               // T, 0 <= T <= max_tokens
  void* workspace = nullptr;            // workspace_bytes(config, impl[, use]) bytes, 256-byte aligned
  size_t workspace_bytes = 0;
  cudaStream_t stream = nullptr;
  // Implementations that never synchronise (kFused) check expert ids without blocking the
  // call only if this is false: then call check_expert_ids() later (after the stream work).
  // true (default): the call synchronises its stream at the end and throws on a bad id,
  // except while the stream is being captured into a CUDA graph (a sync is illegal there).
  bool sync_check_expert_ids = true;
  // Optional ExpertIdReport (see below) that outlives the call. When set, the call never
  // synchronises for the id check (sync_check_expert_ids is ignored): a call that finds bad ids
  // writes its record into the report from the device, and the caller reads it when it likes.
  int32_t* expert_id_report = nullptr;
  // Optional (Impl::kFused only): saved_z_bytes(config) bytes of device memory where the forward
  // also stores the pre-activations z = [g | u] of every routed row, for a backward that then
  // skips recomputing them (BackwardArgs::saved_z).
  void* saved_z = nullptr;
  // Precision::kFp8Blockwise: the quantize_weights_fp8 buffer of w13 and w2 (required); null at
  // bf16 (refused there, as a sign the caller meant FP8).
  const void* fp8_weights = nullptr;
  // true: the caller has already checked that every pointer is device memory of the current
  // device (expert_id_report: memory the device reads at the same address), as a framework whose
  // tensors carry their device does (the PyTorch op). The call then skips its CUDA pointer
  // queries (one cudaPointerGetAttributes per pointer) and keeps every host check (null,
  // alignment, sizes). false (default): the call queries each pointer.
  bool caller_checked_pointers = false;
};

struct BackwardArgs {
  // Inputs of the forward (the forward saves nothing else; the backward recomputes z).
  const void* x = nullptr;
  const int32_t* topk_idx = nullptr;
  const float* topk_weights = nullptr;
  const void* w13 = nullptr;
  const void* w2 = nullptr;
  const void* w1 = nullptr;  // as ForwardArgs::w1, w3: instead of w13
  const void* w3 = nullptr;
  const void* dy = nullptr;  // [T, H] bf16
  // Outputs.
  void* dx = nullptr;                // [T, H] bf16
  float* d_topk_weights = nullptr;   // [T, K] fp32; 0 for masked slots
  void* dw13 = nullptr;              // [E, 2I, H] weight_grad_dtype
  void* dw2 = nullptr;               // [E, H, I]  weight_grad_dtype
  // Separate gate and up gradients instead of dw13 (dw13 null): both or neither, [E, I, H]
  // weight_grad_dtype each, not overlapping each other. The form of the gradients is the
  // caller's choice, independent of the form of the weights (w13 or w1/w3).
  void* dw1 = nullptr;
  void* dw3 = nullptr;
  // Frozen weights: with no gate/up gradient output (dw13, dw1 and dw3 all null) dW13 is not
  // computed, and with dw2 null dW2 is not; dx and d_topk_weights are the same either way. With
  // both null the backward runs its dgrad GEMMs only (about half its FLOPs).
  WeightGradDtype weight_grad_dtype = WeightGradDtype::kFloat32;
  // false: dw13 (or dw1, dw3) and dw2 are overwritten (experts with no rows get zeros).
  // true : the gradients are added to what they hold (gradient accumulation). Impl::kFused:
  //        fp32 adds the fp32 gradient; bf16 adds the bf16-rounded gradient and rounds the sum,
  //        as autograd adds a bf16 gradient into a bf16 .grad. The cuBLAS impls add the fp32
  //        result before their one rounding.
  bool accumulate_weight_grads = false;
  int64_t num_tokens = 0;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  cudaStream_t stream = nullptr;
  // As ForwardArgs::sync_check_expert_ids and ForwardArgs::expert_id_report.
  bool sync_check_expert_ids = true;
  int32_t* expert_id_report = nullptr;
  // Optional (Impl::kFused only): the ForwardArgs::saved_z buffer of the forward of these same
  // inputs (topk_idx, num_tokens, x, w13); null recomputes z (one more grouped GEMM of 4·H·I
  // FLOPs per routed row). Its layout is internal (rows in the routing's expert order): pass it
  // only from a forward to the backward of the same inputs.
  const void* saved_z = nullptr;
  // Precision::kFp8Blockwise: the quantize_weights_fp8 buffer of w13 and w2 (required; w13 and w2
  // themselves are then not read); null at bf16, as in ForwardArgs.
  const void* fp8_weights = nullptr;
  // As ForwardArgs::caller_checked_pointers.
  bool caller_checked_pointers = false;
};

// Throws fusemoe::Error naming the first field that breaks a limit above.
void validate_config(const LayerConfig& config);

// Bytes of device workspace that every call (forward, backward with or without saved_z) for
// this config accepts: the largest of the per-call sizes below, so one buffer serves them all.
size_t workspace_bytes(const LayerConfig& config, Impl impl);

// The call a workspace is for, when a caller allocates one per call (each call checks only its
// own need). Impl::kFused: the forward needs the routing plan, h and the slot outputs; the
// backward given the forward's saved_z needs no room for z (2·I·K·2 bytes per token less: 24 KiB
// for Qwen3-30B-A3B, 48 KiB for Qwen3-235B-A22B). The other impls need the same for every call.
enum class WorkspaceUse {
  kForward,         // forward, with or without saved_z
  kBackward,        // backward that recomputes z (saved_z null)
  kBackwardSavedZ,  // backward given the forward's saved_z
};
size_t workspace_bytes(const LayerConfig& config, Impl impl, WorkspaceUse use);

// Bytes of a ForwardArgs::saved_z buffer: max_tokens * top_k * 2 * intermediate bf16
// (2·I·K·2 bytes per token: 24 KiB for Qwen3-30B-A3B, 48 KiB for Qwen3-235B-A22B).
size_t saved_z_bytes(const LayerConfig& config);

// The largest T (config.max_tokens is ignored) for which one forward + backward of this layer
// needs at most free_bytes of device memory, counting exactly, for max_tokens = T:
//   the workspace: one buffer serving both calls, the larger of workspace_bytes(.., kForward)
//     and workspace_bytes(.., kBackwardSavedZ if save_z else kBackward);
//   saved_z_bytes() when save_z (Impl::kFused only);
//   x, y, dy, dx: 4 x T x H bf16;  topk_idx, topk_weights, d_topk_weights: 3 x T x K x 4 bytes.
// Not counted: the weights and their gradients (they do not grow with T: take them off
// free_bytes), allocator rounding and fragmentation, anything else the caller holds. Never more
// than the largest max_tokens validate_config accepts; -1 when not even T = 0 fits. Host only.
int64_t max_tokens_that_fit(const LayerConfig& config, Impl impl, size_t free_bytes, bool save_z);

// Expert ids outside [-1, E) are never used to index memory: the routing step counts them,
// treats them as masked, and the call then throws fusemoe::Error naming the first bad
// (token, slot, value). The outputs of such a call are unspecified.
void forward(const LayerConfig& config, Impl impl, const ForwardArgs& args);
void backward(const LayerConfig& config, Impl impl, const BackwardArgs& args);

// Synchronises `stream`, reads the routing record that the last forward/backward left in
// `workspace`, and throws fusemoe::Error naming the first expert id outside [-1, E) if there
// was one. For calls made with sync_check_expert_ids = false.
void check_expert_ids(const LayerConfig& config, Impl impl, const void* workspace,
                      cudaStream_t stream);

// Asynchronous expert-id reporting for callers that must not block (training loops):
// kExpertIdReportInts int32 that the caller zeroes once and passes as expert_id_report to many
// calls. Device memory, or pinned host memory mapped at the same address (cudaHostAlloc /
// torch pin_memory under unified addressing), which the host can read without synchronising.
// The first call that finds bad ids writes [1] the flat slot t*K+j of its first bad id,
// [2] that id, then [0] the number of bad ids in that call; later calls leave a non-empty
// report alone. The kernels write it with plain stores: read [0] first, and treat a report as
// complete only after the stream work that wrote it is known to be done (or [0] != 0).
constexpr int kExpertIdReportInts = 3;

// Throws fusemoe::Error naming the first bad id if `report` (a host copy or the pinned report
// itself) holds one; a no-op for an empty report.
void throw_if_expert_id_report(const int32_t report[kExpertIdReportInts], int64_t num_experts,
                               int64_t top_k);

}  // namespace fusemoe

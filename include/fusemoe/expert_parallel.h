// fusemoe expert-parallel layer: the experts of one MoE layer spread over the R ranks (GPUs) of
// one NVLink node. Expert e lives on rank e / (E / R) (contiguous blocks of E / R experts).
// Each rank passes its own tokens and its local experts' weights; tokens travel to the ranks
// that own their experts and come back combined.
//
//   forward : y_t = sum_j w[t,j] * expert_{idx[t,j]}(x_t)  for this rank's tokens t
//   backward: dx, d_topk_weights for this rank's tokens; dw13, dw2 for its local experts
//
// The result is bitwise the single-GPU fused layer (fusemoe::forward/backward with Impl::kFused)
// run on the concatenation of every rank's tokens (rank 0's first) with all experts local: y,
// dx and d_topk_weights of this rank's tokens, dw13/dw2 of its experts.
//
// Precision::kFp8Blockwise (the layer's precision; the EP layer is always the fused pipeline):
// tokens travel in bf16 as at BF16 and the owner quantizes the rows it receives, so the result is
// bitwise the single-GPU FP8 fused layer's on the concatenated batch. Each call takes the FP8
// weights of this rank's experts (EpCall::fp8_weights). Limits: the single-GPU FP8 ones
// (intermediate % 128 == 0), and LayerConfig::fp8_weight_grads is not supported yet (the weight
// gradients come from bf16 operands).
//
// Communication goes through a symmetric workspace: every rank allocates ep_symmetric_bytes()
// bytes, zeroes them ONCE after allocation (cudaMemset; later calls clean up after themselves),
// waits for the zeroing to finish (cudaDeviceSynchronize: a peer's first call may write into the
// buffer, and a memset that lands after its flags wipes them for good), and makes them reachable
// from every other rank. Each call gets the table of the R ranks'
// symmetric workspaces as mapped in the calling process (peer_symmetric[rank] is its own):
// CUDA IPC handles (cudaIpcGetMemHandle / cudaIpcOpenMemHandle), PyTorch symmetric memory, or
// NCCL window registration give such pointers (docs/expert_parallel.md shows each route and
// which are tested). The
// protocol: sources publish (token, slot) metadata to the owners; owners pull each token row
// once per rank (however many of its experts live there), run the gate/up and down GEMMs, and
// push every output row into the source's slot buffer; each source combines its slots in slot
// order. No host synchronisation and no host-visible counts: every buffer is sized for the worst
// case (all tokens of all ranks to one rank), so nothing is ever dropped; CUDA-graph capturable.
//
// Every rank must make the same calls in the same order (forward, backward, ...), with the same
// EpConfig except the rank. Ranks that share one process (tests, one-GPU runs) must keep every
// operation of a rank on its own stream (never the legacy default stream: a blocking call there
// can wait behind another rank's kernel that waits for this rank), give the streams their own
// hardware queues (CUDA_DEVICE_MAX_CONNECTIONS=32) and load kernels eagerly
// (CUDA_MODULE_LOADING=EAGER: a lazy load can synchronise the context the same way). Every
// cross-rank wait is bounded (default 30 s; the environment variable FUSEMOE_WAIT_TIMEOUT_S,
// in seconds, read once at the first launch, sets it): a rank that never arrives makes the
// others fail with an error naming the rank, the peer and what was waited for, instead of
// hanging.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "fusemoe/fusemoe.h"

namespace fusemoe {

constexpr int kMaxRanks = 8;

struct EpConfig {
  // The layer with GLOBAL num_experts E; max_tokens bounds every rank's T.
  LayerConfig layer;
  int world_size = 1;  // R in {1, 2, 4, 8}; E % R == 0
  int rank = 0;        // 0 <= rank < R
};

// Bytes of the symmetric workspace each rank allocates (the same on every rank; zero it once).
size_t ep_symmetric_bytes(const EpConfig& config);
// Bytes of the rank's private workspace for a call (as fusemoe::workspace_bytes); a buffer of
// ep_workspace_bytes(config) serves every call.
size_t ep_workspace_bytes(const EpConfig& config, WorkspaceUse use);
size_t ep_workspace_bytes(const EpConfig& config);
// Bytes of EpForwardArgs::saved_state: what the forward keeps for the backward of the same
// inputs (the pre-activations z of this rank's owner rows, so the backward skips recomputing
// them). Per rank.
size_t ep_saved_state_bytes(const EpConfig& config);
// Precision::kFp8Blockwise: bytes of this rank's FP8 weight buffer (EpCall::fp8_weights), and its
// quantization from the rank's bf16 w13 [E/R, 2I, H] and w2 [E/R, H, I] (device) on `stream`,
// without synchronising: quantize_weights_fp8's buffer for the E/R local experts, byte for byte,
// made once per weight update. (Direct use of quantize_weights_fp8 needs a layer with top_k <= E/R.)
size_t ep_fp8_weights_bytes(const EpConfig& config);
void ep_quantize_weights_fp8(const EpConfig& config, const void* w13, const void* w2, void* buffer,
                             size_t buffer_bytes, cudaStream_t stream);

// What every call of a rank passes, forward and backward alike.
struct EpCall {
  const void* x = nullptr;              // [T, H] bf16, this rank's tokens
  const int32_t* topk_idx = nullptr;    // [T, K] GLOBAL expert ids, -1 masks a slot
  const float* topk_weights = nullptr;  // [T, K]
  const void* w13 = nullptr;            // [E/R, 2I, H] bf16: this rank's experts
  const void* w2 = nullptr;             // [E/R, H, I] bf16
  // Precision::kFp8Blockwise (required then, null at bf16): this rank's FP8 weights, the buffer of
  // ep_fp8_weights_bytes(config) bytes that ep_quantize_weights_fp8 writes from w13 and w2.
  // An FP8 call does not read w13 and w2 (null both, or pass them: they are checked as at bf16).
  const void* fp8_weights = nullptr;
  int64_t num_tokens = 0;               // T of this rank, 0 <= T <= max_tokens (may differ by rank)
  void* const* peer_symmetric = nullptr;  // [R] host array: each rank's symmetric workspace
  void* workspace = nullptr;            // ep_workspace_bytes(config, use), 256-byte aligned
  size_t workspace_bytes = 0;
  // As ForwardArgs (ids checked against the GLOBAL E). A synchronising check waits for this
  // rank's whole call, which needs the other ranks' calls: with one host thread driving several
  // ranks, pass a report (or false) instead.
  bool sync_check_expert_ids = true;
  int32_t* expert_id_report = nullptr;
  // SMs the persistent GEMMs use (0: all). Co-resident ranks (several on one GPU) pass each a
  // share, e.g. the GPU's SM count / R, so that their GEMMs run side by side.
  int num_sms = 0;
  cudaStream_t stream = nullptr;
};

struct EpForwardArgs {
  EpCall call;
  void* y = nullptr;  // [T, H] bf16 (output)
  // Optional: ep_saved_state_bytes(config) bytes the backward of the same inputs reads (saves it
  // the z recompute).
  void* saved_state = nullptr;
};

struct EpBackwardArgs {
  EpCall call;                           // the forward's inputs
  const void* dy = nullptr;              // [T, H] bf16
  void* dx = nullptr;                    // [T, H] bf16 (output)
  float* d_topk_weights = nullptr;       // [T, K] fp32 (output; 0 for masked slots)
  void* dw13 = nullptr;                  // [E/R, 2I, H] weight_grad_dtype (output)
  void* dw2 = nullptr;                   // [E/R, H, I]; a null dw13 or dw2: not computed (frozen)
  WeightGradDtype weight_grad_dtype = WeightGradDtype::kFloat32;
  bool accumulate_weight_grads = false;
  const void* saved_state = nullptr;     // the forward's EpForwardArgs::saved_state, or null
};

// Throws fusemoe::Error naming the first field that breaks a limit.
void validate_ep_config(const EpConfig& config);

void ep_forward(const EpConfig& config, const EpForwardArgs& args);
void ep_backward(const EpConfig& config, const EpBackwardArgs& args);

}  // namespace fusemoe

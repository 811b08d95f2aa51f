/* C ABI of fusemoe: the C++ API (fusemoe/fusemoe.h) behind plain C functions and structs, for
 * bindings that must not compile against a framework's C++ ABI (python/fusemoe fills these
 * structs with ctypes.Structure). Every function returns a FusemoeCStatus and lets no exception
 * cross the boundary; fusemoe_c_last_error() gives the message of the calling thread's last
 * failure. Tensors are device pointers (layouts and dtypes as in fusemoe.h); the stream is a
 * cudaStream_t passed as void* (NULL = the legacy default stream).
 * Each struct starts with struct_size, which the caller sets to sizeof(the struct) as it was
 * compiled: a binding written for another layout fails naming the struct instead of passing
 * shifted fields. The library only converts; validation is the C++ API's (src/api), whose
 * messages name the fields below by the same names. */
#ifndef FUSEMOE_FUSEMOE_C_H_
#define FUSEMOE_FUSEMOE_C_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FUSEMOE_C_API __attribute__((visibility("default")))

/* Raised whenever a function's signature, a struct or a meaning changes; bindings refuse other
 * versions. 5: one struct per call instead of positional arguments, the SwiGLU clamp.
 * 6: blockwise FP8 (FusemoeCLayer.precision, the args' fp8_weights, the FP8 weight buffer).
 * 7: expert parallelism (FusemoeCEpConfig, FusemoeCEpForwardArgs, FusemoeCEpBackwardArgs and the
 * fusemoe_c_ep_* functions); the single-GPU args' caller_checked_pointers.
 * 8: separate gate and up weights and gradients (the single-GPU args' and FusemoeCFp8QuantizeArgs'
 * w1, w3; FusemoeCBackwardArgs' dw1, dw3).
 * 9: FusemoeCLayer.fp8_weight_grads (it fills what was the struct's tail padding, so sizeof stays
 * 64: the library refuses any value but 0 and 1 there, which catches a caller built for 8).
 * 10: blockwise FP8 in expert parallelism (FusemoeCEpForwardArgs' and FusemoeCEpBackwardArgs'
 * fp8_weights, after w2; fusemoe_c_ep_fp8_weights_bytes, fusemoe_c_ep_quantize_weights_fp8). */
#define FUSEMOE_C_ABI_VERSION 10

typedef enum {
  FUSEMOE_C_OK = 0,
  FUSEMOE_C_ERROR = 1,          /* fusemoe::Error: bad argument or failed CUDA / cuBLAS call */
  FUSEMOE_C_OUT_OF_MEMORY = 2,  /* host allocation failed */
  FUSEMOE_C_INTERNAL = 3,       /* any other exception */
} FusemoeCStatus;

/* Values of FusemoeCBackwardArgs.weight_grad_dtype (fusemoe::WeightGradDtype). */
#define FUSEMOE_C_WEIGHT_GRAD_FLOAT32 0
#define FUSEMOE_C_WEIGHT_GRAD_BFLOAT16 1

/* Values of FusemoeCLayer.precision (fusemoe::Precision). FP8_BLOCKWISE: impl "fused" only,
 * intermediate % 128 == 0; every call reads the FP8 weight buffer (fusemoe_c_quantize_weights_fp8)
 * at fp8_weights instead of w13 and w2. */
#define FUSEMOE_C_PRECISION_BF16 0
#define FUSEMOE_C_PRECISION_FP8_BLOCKWISE 1

/* Values of `use` in fusemoe_c_workspace_bytes_for (fusemoe::WorkspaceUse). */
#define FUSEMOE_C_WORKSPACE_FORWARD 0
#define FUSEMOE_C_WORKSPACE_BACKWARD 1           /* backward with saved_z NULL (z recomputed) */
#define FUSEMOE_C_WORKSPACE_BACKWARD_SAVED_Z 2   /* backward given the forward's saved_z */

/* One layer and the implementation that runs it (fusemoe::LayerConfig + fusemoe::Impl). Built
 * once per layer and reused for every call. */
typedef struct FusemoeCLayer {
  uint32_t struct_size;      /* sizeof(FusemoeCLayer) */
  int32_t impl_code;         /* from fusemoe_c_impl_code() */
  int64_t hidden;            /* H */
  int64_t intermediate;      /* I */
  int64_t num_experts;       /* E */
  int64_t top_k;             /* K */
  int64_t max_tokens;        /* largest T a call passes; sizes the workspace */
  int32_t use_swiglu_clamp;  /* != 0: g <- min(g, c), u <- clamp(u, -c, c) before silu(g) * u */
  float swiglu_clamp;        /* c: finite and > 0 when use_swiglu_clamp */
  int32_t precision;         /* FUSEMOE_C_PRECISION_* */
  /* 0 or 1. 1 (FP8_BLOCKWISE only): the weight gradients' GEMMs in FP8 as well
   * (fusemoe::LayerConfig::fp8_weight_grads); 0: from bf16 operands. */
  int32_t fp8_weight_grads;
} FusemoeCLayer;

/* y = MoE(x): fusemoe::ForwardArgs. */
typedef struct FusemoeCForwardArgs {
  uint32_t struct_size;            /* sizeof(FusemoeCForwardArgs) */
  const void* x;                   /* [T, H] bf16 */
  const int32_t* topk_idx;         /* [T, K] */
  const float* topk_weights;       /* [T, K] */
  const void* w13;                 /* [E, 2I, H] bf16 (not read, and may be NULL, at FP8) */
  const void* w2;                  /* [E, H, I] bf16 (not read, and may be NULL, at FP8) */
  /* Instead of w13 (then NULL): separate gate and up weights [E, I, H] bf16 each (torchtitan's
   * layout), read in place; both or neither; they may alias. */
  const void* w1;
  const void* w3;
  const void* fp8_weights;         /* FP8: the quantized weight buffer (required); else NULL */
  void* y;                         /* [T, H] bf16 (output) */
  int64_t num_tokens;              /* T */
  void* workspace;
  uint64_t workspace_bytes;
  /* NULL, or fusemoe::kExpertIdReportInts (3) int32 the caller zeroed once, in device memory or
   * pinned host memory. NULL: a call with bad expert ids fails (after a stream sync, for
   * "fused"). Set: the call never syncs for the check; check the report with
   * fusemoe_c_check_expert_id_report whenever convenient. */
  int32_t* expert_id_report;
  /* NULL, or fusemoe_c_saved_z_bytes() bytes ("fused" only): the forward also stores the
   * pre-activations there for the backward of the same inputs. */
  void* saved_z;
  void* stream;                    /* cudaStream_t */
  /* != 0: the caller has checked that every pointer is device memory of the current device
   * (expert_id_report: memory the device reads at the same address), as a framework's tensors
   * carry their device; the call skips its CUDA pointer queries (fusemoe::ForwardArgs::
   * caller_checked_pointers) and keeps its host checks. 0: each pointer is queried. */
  int32_t caller_checked_pointers;
} FusemoeCForwardArgs;

/* dx, d_topk_weights, dw13, dw2 from dy: fusemoe::BackwardArgs. */
typedef struct FusemoeCBackwardArgs {
  uint32_t struct_size;              /* sizeof(FusemoeCBackwardArgs) */
  int32_t weight_grad_dtype;         /* FUSEMOE_C_WEIGHT_GRAD_* */
  const void* x;
  const int32_t* topk_idx;
  const float* topk_weights;
  const void* w13;
  const void* w2;
  const void* w1;                    /* as in FusemoeCForwardArgs */
  const void* w3;
  const void* fp8_weights;           /* as in FusemoeCForwardArgs */
  const void* dy;                    /* [T, H] bf16 */
  void* dx;                          /* [T, H] bf16 (output) */
  float* d_topk_weights;             /* [T, K] fp32 (output) */
  void* dw13;                        /* [E, 2I, H] weight_grad_dtype (output) */
  void* dw2;                         /* [E, H, I] weight_grad_dtype (output) */
  /* Instead of dw13 (then NULL): [E, I, H] weight_grad_dtype each (outputs), both or neither,
   * not overlapping; independent of the weights' form. Frozen weights: dw13, dw1 and dw3 all
   * NULL skips the gate/up gradient, dw2 NULL the down gradient (BackwardArgs). */
  void* dw1;
  void* dw3;
  int32_t accumulate_weight_grads;   /* != 0: add to the gradients instead of overwriting them */
  int64_t num_tokens;
  void* workspace;
  uint64_t workspace_bytes;
  int32_t* expert_id_report;         /* as in FusemoeCForwardArgs */
  const void* saved_z;               /* NULL, or the forward's saved_z of these same inputs */
  void* stream;
  int32_t caller_checked_pointers;   /* as in FusemoeCForwardArgs */
} FusemoeCBackwardArgs;

/* Blockwise FP8: quantizes the bf16 weights into the FP8 weight buffer (fusemoe::
 * quantize_weights_fp8), once per weight update; asynchronous on stream. */
typedef struct FusemoeCFp8QuantizeArgs {
  uint32_t struct_size;   /* sizeof(FusemoeCFp8QuantizeArgs) */
  const void* w13;        /* [E, 2I, H] bf16 */
  const void* w2;         /* [E, H, I] bf16 */
  const void* w1;         /* instead of w13 (then NULL): [E, I, H] bf16 each, the same buffer results */
  const void* w3;
  void* buffer;           /* fusemoe_c_fp8_weights_bytes() bytes, device, 256-byte aligned (output) */
  uint64_t buffer_bytes;
  void* stream;           /* cudaStream_t */
} FusemoeCFp8QuantizeArgs;

/* ---- Expert parallelism (fusemoe/expert_parallel.h): the experts of one layer over R ranks ----
 * Every rank passes its own tokens and its local experts' weights; expert e lives on rank
 * e / (E / R). The symmetric workspace (fusemoe_c_ep_symmetric_bytes, zeroed once) and the
 * peer table are described in expert_parallel.h and docs/expert_parallel.md. Every rank makes
 * the same calls in the same order with the same config except the rank. */

/* One rank's view of an expert-parallel layer (fusemoe::EpConfig). */
typedef struct FusemoeCEpConfig {
  uint32_t struct_size;  /* sizeof(FusemoeCEpConfig) */
  int32_t world_size;    /* R in {1, 2, 4, 8}; layer.num_experts % R == 0 */
  int32_t rank;          /* 0 <= rank < R */
  /* The layer with GLOBAL num_experts; max_tokens bounds every rank's T. impl_code is not used
   * (the fused kernels run). precision FUSEMOE_C_PRECISION_FP8_BLOCKWISE: every call reads the
   * rank's FP8 weight buffer (fusemoe_c_ep_quantize_weights_fp8) at fp8_weights; fp8_weight_grads
   * must be 0 (not supported in expert parallelism yet). */
  FusemoeCLayer layer;
} FusemoeCEpConfig;

/* y for this rank's tokens: fusemoe::EpForwardArgs. */
typedef struct FusemoeCEpForwardArgs {
  uint32_t struct_size;          /* sizeof(FusemoeCEpForwardArgs) */
  int32_t num_sms;               /* SMs the persistent GEMMs use (0: all; co-resident ranks: a share) */
  const void* x;                 /* [T, H] bf16, this rank's tokens */
  const int32_t* topk_idx;       /* [T, K] GLOBAL expert ids, -1 masks a slot */
  const float* topk_weights;     /* [T, K] */
  const void* w13;               /* [E/R, 2I, H] bf16: this rank's experts (NULL allowed at FP8) */
  const void* w2;                /* [E/R, H, I] bf16 (NULL allowed at FP8) */
  /* FP8: this rank's FP8 weight buffer (fusemoe_c_ep_quantize_weights_fp8), required; else NULL.
   * An FP8 call does not read w13 and w2: NULL both, or both are checked as at bf16. */
  const void* fp8_weights;
  void* y;                       /* [T, H] bf16 (output) */
  int64_t num_tokens;            /* T of this rank, 0 <= T <= layer.max_tokens (may differ by rank) */
  void* const* peer_symmetric;   /* [R] host array: every rank's symmetric workspace, as mapped here */
  void* workspace;               /* fusemoe_c_ep_workspace_bytes_for(FORWARD) bytes, 256-byte aligned */
  uint64_t workspace_bytes;
  /* As FusemoeCForwardArgs.expert_id_report (ids checked against the GLOBAL E). NULL: the call
   * synchronises its stream to check, which waits for the other ranks' calls too. */
  int32_t* expert_id_report;
  /* NULL, or fusemoe_c_ep_saved_state_bytes() bytes the backward of the same inputs reads. */
  void* saved_state;
  void* stream;                  /* cudaStream_t */
} FusemoeCEpForwardArgs;

/* dx, d_topk_weights for this rank's tokens and dw13, dw2 for its experts:
 * fusemoe::EpBackwardArgs. */
typedef struct FusemoeCEpBackwardArgs {
  uint32_t struct_size;              /* sizeof(FusemoeCEpBackwardArgs) */
  int32_t weight_grad_dtype;         /* FUSEMOE_C_WEIGHT_GRAD_* */
  const void* x;                     /* the forward's inputs */
  const int32_t* topk_idx;
  const float* topk_weights;
  const void* w13;
  const void* w2;
  const void* fp8_weights;           /* as in FusemoeCEpForwardArgs */
  const void* dy;                    /* [T, H] bf16 */
  void* dx;                          /* [T, H] bf16 (output) */
  float* d_topk_weights;             /* [T, K] fp32 (output) */
  void* dw13;                        /* [E/R, 2I, H] weight_grad_dtype (output; NULL: frozen) */
  void* dw2;                         /* [E/R, H, I] weight_grad_dtype (output; NULL: frozen) */
  int32_t accumulate_weight_grads;   /* != 0: add to dw13/dw2 instead of overwriting them */
  int32_t num_sms;                   /* as in FusemoeCEpForwardArgs */
  int64_t num_tokens;
  void* const* peer_symmetric;
  void* workspace;                   /* fusemoe_c_ep_workspace_bytes_for(BACKWARD or BACKWARD_SAVED_Z) */
  uint64_t workspace_bytes;
  int32_t* expert_id_report;         /* as in FusemoeCEpForwardArgs */
  const void* saved_state;           /* NULL, or the forward's saved_state of these same inputs */
  void* stream;
} FusemoeCEpBackwardArgs;

FUSEMOE_C_API int32_t fusemoe_c_abi_version(void);

/* Message of the last failed call on this thread ("" if none); valid until the next failure on
 * this thread. */
FUSEMOE_C_API const char* fusemoe_c_last_error(void);

/* "unfused", "reference_fp32", "fused" -> the code FusemoeCLayer.impl_code takes. */
FUSEMOE_C_API int32_t fusemoe_c_impl_code(const char* name, int32_t* impl_code);

/* Bytes of workspace that every forward and backward call of the layer accepts. */
FUSEMOE_C_API int32_t fusemoe_c_workspace_bytes(const FusemoeCLayer* layer, uint64_t* bytes);

/* Bytes of workspace one kind of call (FUSEMOE_C_WORKSPACE_*) needs: each call checks only its
 * own need, for callers that allocate a workspace per call. */
FUSEMOE_C_API int32_t fusemoe_c_workspace_bytes_for(const FusemoeCLayer* layer, int32_t use,
                                                    uint64_t* bytes);

/* Bytes of a saved_z buffer for the layer (impl_code is not used). */
FUSEMOE_C_API int32_t fusemoe_c_saved_z_bytes(const FusemoeCLayer* layer, uint64_t* bytes);

/* Bytes of the FP8 weight buffer of the layer (impl_code and precision are not used). */
FUSEMOE_C_API int32_t fusemoe_c_fp8_weights_bytes(const FusemoeCLayer* layer, uint64_t* bytes);

/* See fusemoe::quantize_weights_fp8 (impl_code and precision are not used). */
FUSEMOE_C_API int32_t fusemoe_c_quantize_weights_fp8(const FusemoeCLayer* layer,
                                                     const FusemoeCFp8QuantizeArgs* args);

/* See fusemoe::forward and fusemoe::backward. */
FUSEMOE_C_API int32_t fusemoe_c_forward(const FusemoeCLayer* layer,
                                        const FusemoeCForwardArgs* args);
FUSEMOE_C_API int32_t fusemoe_c_backward(const FusemoeCLayer* layer,
                                         const FusemoeCBackwardArgs* args);

/* Bytes of the symmetric workspace every rank allocates (the same on every rank; zero it once). */
FUSEMOE_C_API int32_t fusemoe_c_ep_symmetric_bytes(const FusemoeCEpConfig* config, uint64_t* bytes);

/* Bytes of private workspace every call of the rank accepts, and what one kind of call
 * (FUSEMOE_C_WORKSPACE_*) needs. */
FUSEMOE_C_API int32_t fusemoe_c_ep_workspace_bytes(const FusemoeCEpConfig* config, uint64_t* bytes);
FUSEMOE_C_API int32_t fusemoe_c_ep_workspace_bytes_for(const FusemoeCEpConfig* config, int32_t use,
                                                       uint64_t* bytes);

/* Bytes of FusemoeCEpForwardArgs.saved_state (per rank, sized for the worst case: every slot of
 * every rank routed to this rank's experts). */
FUSEMOE_C_API int32_t fusemoe_c_ep_saved_state_bytes(const FusemoeCEpConfig* config, uint64_t* bytes);

/* Bytes of the rank's FP8 weight buffer (fusemoe::ep_fp8_weights_bytes: the single-GPU buffer of
 * its E/R experts), and its quantization from the rank's bf16 w13 [E/R, 2I, H] and w2 [E/R, H, I]
 * (fusemoe::ep_quantize_weights_fp8; args.w1 and args.w3 must be NULL: the expert-parallel layer
 * takes w13), once per weight update; asynchronous on args.stream. precision is not used. */
FUSEMOE_C_API int32_t fusemoe_c_ep_fp8_weights_bytes(const FusemoeCEpConfig* config, uint64_t* bytes);
FUSEMOE_C_API int32_t fusemoe_c_ep_quantize_weights_fp8(const FusemoeCEpConfig* config,
                                                        const FusemoeCFp8QuantizeArgs* args);

/* See fusemoe::ep_forward and fusemoe::ep_backward. */
FUSEMOE_C_API int32_t fusemoe_c_ep_forward(const FusemoeCEpConfig* config,
                                           const FusemoeCEpForwardArgs* args);
FUSEMOE_C_API int32_t fusemoe_c_ep_backward(const FusemoeCEpConfig* config,
                                            const FusemoeCEpBackwardArgs* args);

/* FUSEMOE_C_ERROR with the message naming the first bad id if `report` (host-readable: a host
 * copy or pinned memory) holds one; FUSEMOE_C_OK for an empty report. Reads, never writes. */
FUSEMOE_C_API int32_t fusemoe_c_check_expert_id_report(const int32_t* report, int64_t num_experts,
                                                       int64_t top_k);

/* The layout of the structs above as this library was compiled, so a binding can check its own
 * declarations ("FusemoeCLayer", "FusemoeCForwardArgs", "FusemoeCBackwardArgs",
 * "FusemoeCFp8QuantizeArgs", "FusemoeCEpConfig", "FusemoeCEpForwardArgs",
 * "FusemoeCEpBackwardArgs"):
 * fusemoe_c_struct_layout gives sizeof and the number of fields; fusemoe_c_struct_field gives
 * field `field_index` (declaration order): its name (static storage), offsetof and sizeof. */
FUSEMOE_C_API int32_t fusemoe_c_struct_layout(const char* struct_name, uint64_t* struct_size,
                                              int32_t* num_fields);
FUSEMOE_C_API int32_t fusemoe_c_struct_field(const char* struct_name, int32_t field_index,
                                             const char** field_name, uint64_t* offset,
                                             uint64_t* size);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* FUSEMOE_FUSEMOE_C_H_ */

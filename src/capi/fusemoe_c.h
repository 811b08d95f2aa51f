/* C ABI of fusemoe: the C++ API (include/fusemoe/fusemoe.h) behind plain C functions, for
 * bindings that must not compile against a framework's C++ ABI (python/fusemoe loads it with
 * ctypes). Every function returns a FusemoeCStatus and lets no exception cross the boundary;
 * fusemoe_c_last_error() gives the message of the calling thread's last failure.
 * Tensors are device pointers (layouts and dtypes as in fusemoe.h), sizes are int64, the stream
 * is a cudaStream_t passed as void* (NULL = the legacy default stream). The layer is described
 * by (hidden, intermediate, num_experts, top_k, max_tokens) on every call; an implementation is
 * named by a string and resolved once to an int code by fusemoe_c_impl_code(). */
#ifndef FUSEMOE_C_H_
#define FUSEMOE_C_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FUSEMOE_C_API __attribute__((visibility("default")))

/* Raised whenever a function's signature or meaning changes; bindings refuse other versions. */
#define FUSEMOE_C_ABI_VERSION 5

typedef enum {
  FUSEMOE_C_OK = 0,
  FUSEMOE_C_ERROR = 1,          /* fusemoe::Error: bad argument or failed CUDA / cuBLAS call */
  FUSEMOE_C_OUT_OF_MEMORY = 2,  /* host allocation failed */
  FUSEMOE_C_INTERNAL = 3,       /* any other exception */
} FusemoeCStatus;

/* Values of `weight_grad_dtype` in fusemoe_c_backward. */
#define FUSEMOE_C_WEIGHT_GRAD_FLOAT32 0
#define FUSEMOE_C_WEIGHT_GRAD_BFLOAT16 1

FUSEMOE_C_API int32_t fusemoe_c_abi_version(void);

/* Message of the last failed call on this thread ("" if none); valid until the next failure on
 * this thread. */
FUSEMOE_C_API const char* fusemoe_c_last_error(void);

/* "unfused", "reference_fp32", ... -> the code the other functions take. */
FUSEMOE_C_API int32_t fusemoe_c_impl_code(const char* name, int32_t* impl_code);

/* Bytes of workspace that every forward and backward call of the layer accepts. */
FUSEMOE_C_API int32_t fusemoe_c_workspace_bytes(int64_t hidden, int64_t intermediate,
                                                int64_t num_experts, int64_t top_k,
                                                int64_t max_tokens, int32_t impl_code,
                                                uint64_t* bytes);

/* Values of `use` in fusemoe_c_workspace_bytes_for (fusemoe::WorkspaceUse). */
#define FUSEMOE_C_WORKSPACE_FORWARD 0
#define FUSEMOE_C_WORKSPACE_BACKWARD 1           /* backward with saved_z NULL (z recomputed) */
#define FUSEMOE_C_WORKSPACE_BACKWARD_SAVED_Z 2   /* backward given the forward's saved_z */

/* Bytes of workspace one kind of call needs (each call checks only its own need): for callers
 * that allocate a workspace per call. ABI version 4. */
FUSEMOE_C_API int32_t fusemoe_c_workspace_bytes_for(int64_t hidden, int64_t intermediate,
                                                    int64_t num_experts, int64_t top_k,
                                                    int64_t max_tokens, int32_t impl_code,
                                                    int32_t use, uint64_t* bytes);

/* expert_id_report (forward and backward): NULL, or fusemoe::kExpertIdReportInts (3) int32 the
 * caller zeroed once, in device memory or pinned host memory (see fusemoe::ForwardArgs::
 * expert_id_report). NULL: a call with bad expert ids fails (after a stream sync, for "fused").
 * Set: the call never syncs for the check; the first call with bad ids fills the report and the
 * caller checks it with fusemoe_c_check_expert_id_report whenever it likes. */

/* saved_z (forward: output, backward: input): NULL, or fusemoe_c_saved_z_bytes() bytes of device
 * memory ("fused" only): the forward stores the pre-activations there and the backward of the
 * same inputs reads them instead of recomputing (fusemoe::ForwardArgs::saved_z). */
FUSEMOE_C_API int32_t fusemoe_c_saved_z_bytes(int64_t hidden, int64_t intermediate,
                                              int64_t num_experts, int64_t top_k,
                                              int64_t max_tokens, uint64_t* bytes);

/* y = MoE(x); see fusemoe::forward. */
FUSEMOE_C_API int32_t fusemoe_c_forward(int64_t hidden, int64_t intermediate, int64_t num_experts,
                                        int64_t top_k, int64_t max_tokens, int32_t impl_code,
                                        const void* x, const int32_t* topk_idx,
                                        const float* topk_weights, const void* w13, const void* w2,
                                        void* y, int64_t num_tokens, void* workspace,
                                        uint64_t workspace_bytes, int32_t* expert_id_report,
                                        void* saved_z, void* stream);

/* dx, d_topk_weights, dw13, dw2 from dy; see fusemoe::backward. accumulate_weight_grads != 0
 * adds to dw13/dw2 instead of overwriting them. */
FUSEMOE_C_API int32_t fusemoe_c_backward(int64_t hidden, int64_t intermediate, int64_t num_experts,
                                         int64_t top_k, int64_t max_tokens, int32_t impl_code,
                                         const void* x, const int32_t* topk_idx,
                                         const float* topk_weights, const void* w13,
                                         const void* w2, const void* dy, void* dx,
                                         float* d_topk_weights, void* dw13, void* dw2,
                                         int32_t weight_grad_dtype,
                                         int32_t accumulate_weight_grads, int64_t num_tokens,
                                         void* workspace, uint64_t workspace_bytes,
                                         int32_t* expert_id_report, const void* saved_z,
                                         void* stream);

/* Blockwise FP8 (fusemoe::Precision::kFp8Blockwise, impl "fused" only, intermediate % 128 == 0;
 * ABI version 5). The FP8 weights live in one device buffer of fusemoe_c_fp8_weights_bytes()
 * bytes (256-byte aligned) that fusemoe_c_quantize_weights_fp8 fills from the bf16 w13 and w2; the
 * FP8 calls read it instead of w13 and w2. */
#define FUSEMOE_C_PRECISION_BF16 0
#define FUSEMOE_C_PRECISION_FP8_BLOCKWISE 1

/* As fusemoe_c_workspace_bytes_for, at a precision (FUSEMOE_C_PRECISION_*). */
FUSEMOE_C_API int32_t fusemoe_c_workspace_bytes_precision(int64_t hidden, int64_t intermediate,
                                                          int64_t num_experts, int64_t top_k,
                                                          int64_t max_tokens, int32_t impl_code,
                                                          int32_t precision, int32_t use,
                                                          uint64_t* bytes);

FUSEMOE_C_API int32_t fusemoe_c_fp8_weights_bytes(int64_t hidden, int64_t intermediate,
                                                  int64_t num_experts, int64_t top_k,
                                                  int64_t max_tokens, uint64_t* bytes);

/* Quantizes w13 [E, 2I, H] and w2 [E, H, I] (bf16) into buffer; asynchronous on stream. */
FUSEMOE_C_API int32_t fusemoe_c_quantize_weights_fp8(int64_t hidden, int64_t intermediate,
                                                     int64_t num_experts, int64_t top_k,
                                                     int64_t max_tokens, const void* w13,
                                                     const void* w2, void* buffer,
                                                     uint64_t buffer_bytes, void* stream);

/* fusemoe_c_forward / fusemoe_c_backward at FP8: fp8_weights in place of w13, w2. */
FUSEMOE_C_API int32_t fusemoe_c_forward_fp8(int64_t hidden, int64_t intermediate,
                                            int64_t num_experts, int64_t top_k, int64_t max_tokens,
                                            int32_t impl_code, const void* x,
                                            const int32_t* topk_idx, const float* topk_weights,
                                            const void* fp8_weights, void* y, int64_t num_tokens,
                                            void* workspace, uint64_t workspace_bytes,
                                            int32_t* expert_id_report, void* saved_z, void* stream);

FUSEMOE_C_API int32_t fusemoe_c_backward_fp8(int64_t hidden, int64_t intermediate,
                                             int64_t num_experts, int64_t top_k, int64_t max_tokens,
                                             int32_t impl_code, const void* x,
                                             const int32_t* topk_idx, const float* topk_weights,
                                             const void* fp8_weights, const void* dy, void* dx,
                                             float* d_topk_weights, void* dw13, void* dw2,
                                             int32_t weight_grad_dtype,
                                             int32_t accumulate_weight_grads, int64_t num_tokens,
                                             void* workspace, uint64_t workspace_bytes,
                                             int32_t* expert_id_report, const void* saved_z,
                                             void* stream);

/* FUSEMOE_C_ERROR with the message naming the first bad id if `report` (host-readable: a host
 * copy or pinned memory) holds one; FUSEMOE_C_OK for an empty report. Reads, never writes. */
FUSEMOE_C_API int32_t fusemoe_c_check_expert_id_report(const int32_t* report, int64_t num_experts,
                                                       int64_t top_k);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* FUSEMOE_C_H_ */

// The non-GEMM steps of the pipelines: row gather, SwiGLU forward/backward, the k-way combines,
// the router-gradient reduction, weight widening and gradient finalisation.
// Each is templated on the element types of its pool tensors: bf16 for Impl::kUnfused, float
// for Impl::kReferenceFp32. Explicit instantiations live in moe_elementwise.cu.
// Shape legend: R rows (expert-sorted valid slots), T tokens, H hidden, I intermediate, K top-k.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fusemoe {

struct SwigluClamp {
  bool enabled = false;
  float limit = 0.0f;
};

// dst_RH[r, :] = src_TH[row_slot[r] / K, :] (converted to Dst), for r < num_rows.
template <typename Src, typename Dst>
void launch_gather_rows(const Src* src_TH, const int32_t* row_slot, int64_t num_rows,
                        int64_t top_k, int64_t hidden, Dst* dst_RH, cudaStream_t stream);

// As launch_gather_rows for bf16 rows, but the row count is read on the device
// (*num_rows_device, e.g. expert_offsets[E]) and the grid is sized for max_rows: no host
// synchronisation. The expert-parallel backward's x and dy pools, from the received token rows
// (row_pool: a token row is read once per local expert it routes to; its plan keeps no inverse
// map for a token-major copy): a second source (src_b -> dst_b, or both null) is gathered by the
// same row map in the same launch.
void launch_gather_rows_device_count(const void* src_a_TH, void* dst_a_RH, const void* src_b_TH, void* dst_b_RH,
                                     const int32_t* row_slot, const int32_t* num_rows_device, int64_t max_rows,
                                     int64_t top_k, int64_t hidden, cudaStream_t stream);

// The fused backward's x and dy pools, token-major: dst_a_RH[slot_row[t*K + j]] = src_a_TH[t] for
// every valid slot (slot_row >= 0; masked slots have no row), and the same for a second source
// (src_b -> dst_b, or both null). Each token row is read once and written K times, where the gather
// by pool rows above reads it K times, from DRAM once the sources outgrow the L2.
void launch_scatter_token_rows(const void* src_a_TH, void* dst_a_RH, const void* src_b_TH, void* dst_b_RH,
                               const int32_t* slot_row, int64_t num_tokens, int64_t top_k, int64_t hidden,
                               cudaStream_t stream);

// d_topk_w[s] = sum_{n < num_n_tiles} router_partials[slot_row[s] * num_n_tiles + n], n in
// increasing order (deterministic); 0 where slot_row[s] < 0 (masked or invalid slot). The
// fused backward's router-weight gradient from the dgrad epilogue's per-tile partials.
void launch_router_grad_reduce(const float* router_partials, int64_t num_n_tiles, const int32_t* slot_row,
                               int64_t num_slots, float* d_topk_w, cudaStream_t stream);

// The router-weight gradient's reduction (launch_router_grad_reduce's), done by the backward's
// combine of dx in the same launch: partials null for none.
struct RouterGradReduce {
  const float* partials = nullptr;
  int64_t num_n_tiles = 0;
  float* d_topk_w = nullptr;
};

// y_TH[t] = sum_{j valid} ys_SH[t*K + j] in fp32, j in order (deterministic), bf16 out.
// ys rows hold the already weighted expert outputs, one per slot; masked or invalid slots
// (slot_row < 0) are skipped, so their ys rows are never read. With router.partials, also
// router.d_topk_w as launch_router_grad_reduce computes it (one launch fewer in the backward).
void launch_combine_slots(const void* ys_SH_bf16, const int32_t* slot_row, int64_t num_tokens,
                          int64_t top_k, int64_t hidden, void* y_TH_bf16, cudaStream_t stream,
                          const RouterGradReduce& router = {});

// h_RI = silu(g) * u with z_RF = [g | u] (F = 2I), optional clamp; fp32 math, rounded to Out.
template <typename In, typename Out>
void launch_swiglu_forward(const In* z_RF, int64_t num_rows, int64_t intermediate,
                           SwigluClamp clamp, Out* h_RI, cudaStream_t stream);

// y_TH[t] = sum_{j=0..K-1, slot valid} w[t,j] * o_RH[slot_row[t*K+j]] in fp32, j in order.
template <typename In>
void launch_combine_forward(const In* o_RH, const int32_t* slot_row, const float* topk_w_TK,
                            int64_t num_tokens, int64_t top_k, int64_t hidden, void* y_TH_bf16,
                            cudaStream_t stream);

// Per row r (slot s = row_slot[r], w = topk_w[s]), with a_RI = dy_r . W2_e:
//   h = swiglu(z) rounded to Pool (as the forward stored it); d_topk_w[s] = <h, a>;
//   wh = w * h; dh = w * a; dz = [dh * u * silu'(g) (clamp mask) | dh * silu(g) (clamp mask)].
template <typename Pool>
void launch_swiglu_backward(const Pool* z_RF, const Pool* a_RI, const int32_t* row_slot,
                            const float* topk_w_TK, int64_t num_rows, int64_t intermediate,
                            SwigluClamp clamp, float* d_topk_w_TK, Pool* wh_RI, Pool* dz_RF,
                            cudaStream_t stream);

// dx_TH[t] = sum_j dxs_RH[slot_row[t*K+j]] in fp32 (j in order), bf16 out; also writes
// d_topk_w = 0 for every masked or invalid slot.
template <typename In>
void launch_combine_backward(const In* dxs_RH, const int32_t* slot_row, int64_t num_tokens,
                             int64_t top_k, int64_t hidden, void* dx_TH_bf16,
                             float* d_topk_w_TK, cudaStream_t stream);

// dst[i] = float(src[i]) for bf16 src (weights and dy widened for the fp32 reference).
void launch_widen_bf16(const void* src_bf16, int64_t count, float* dst, cudaStream_t stream);

// For every expert e with expert_counts[e] == 0, zero its slices of dw13 [E,2I,H] and
// dw2 [E,H,I] (element type float or bf16 by `bf16_grads`).
void launch_zero_empty_expert_grads(const int32_t* expert_counts, int64_t num_experts,
                                    int64_t dw13_elems_per_expert, int64_t dw2_elems_per_expert,
                                    bool bf16_grads, void* dw13, void* dw2, cudaStream_t stream);

// out[i] = (accumulate ? out[i] : 0) + grad[i], rounded to out's type (float or bf16);
// grad is float or bf16 scratch.
template <typename In>
void launch_finalize_weight_grad(const In* grad, int64_t count, bool accumulate, bool bf16_out,
                                 void* out, cudaStream_t stream);

}  // namespace fusemoe

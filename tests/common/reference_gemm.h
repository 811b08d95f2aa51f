// The fp32 GPU reference of every grouped GEMM the sm90 kernels run, computed from the same
// bf16 operands (one tiled naive kernel; fp32 accumulation in a fixed k order). Rows are the
// expert-sorted pool rows of expert_offsets [E+1] (device).
//
//   rows GEMM      out[r, n] = sum_k A[r, k] * W_e(r)[n, k]   (kNK: W [E, N, K])
//                  out[r, n] = sum_k A[r, k] * W_e(r)[k, n]   (kKN: W [E, K, N])
//                  for r < R = offsets[E]; out rows >= R are not written.
//   weight grad    out[e, m, n] = sum_{r in e} A[r, m] * B[r, n]; 0 for an expert with no rows.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fusemoe::harness {

enum class WeightLayout { kNK, kKN };

// a_RK: [R_max, K] bf16; w: bf16 in `layout`; out_RN: [R_max, N] fp32.
void reference_rows_gemm(const void* a_RK, const void* w, WeightLayout layout, const int32_t* expert_offsets,
                         int64_t num_experts, int64_t max_rows, int64_t k, int64_t n, float* out_RN,
                         cudaStream_t stream = nullptr);

// act_m_RM: [R_max, M], act_n_RN: [R_max, N] bf16; out_EMN: [E, M, N] fp32.
void reference_weight_grad(const void* act_m_RM, const void* act_n_RN, const int32_t* expert_offsets,
                           int64_t num_experts, int64_t m, int64_t n, float* out_EMN, cudaStream_t stream = nullptr);

}  // namespace fusemoe::harness

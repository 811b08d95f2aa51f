// Element-wise and row-wise kernels of the unfused pipeline (declarations and math in
// moe_elementwise.h). Every thread moves 8 contiguous elements (16 bytes of bf16): H % 128 == 0
// and I % 64 == 0 make every row a whole number of 8-element vectors, and the API checks 16-byte
// alignment of every base pointer.
#include "kernels/moe_elementwise.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <type_traits>

#include "common/assert.h"
#include "fusemoe/error.h"

namespace fusemoe {
namespace {

using bf16 = __nv_bfloat16;
constexpr int kVec = 8;            // elements per thread per access
constexpr int kThreads = 256;      // block size of the element-wise kernels
constexpr int64_t kMaxBlocks = 65535LL * 16;  // grid-stride loops cover the rest

struct Vec8 {
  float v[kVec];
};

__device__ __forceinline__ Vec8 load8(const bf16* p) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const bf16* e = reinterpret_cast<const bf16*>(&raw);
  Vec8 out;
#pragma unroll
  for (int i = 0; i < kVec; ++i) out.v[i] = __bfloat162float(e[i]);
  return out;
}
__device__ __forceinline__ Vec8 load8(const float* p) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  return Vec8{{a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w}};
}
__device__ __forceinline__ void store8(bf16* p, const Vec8& x) {
  uint4 raw;
  bf16* e = reinterpret_cast<bf16*>(&raw);
#pragma unroll
  for (int i = 0; i < kVec; ++i) e[i] = __float2bfloat16(x.v[i]);
  *reinterpret_cast<uint4*>(p) = raw;
}
__device__ __forceinline__ void store8(float* p, const Vec8& x) {
  reinterpret_cast<float4*>(p)[0] = make_float4(x.v[0], x.v[1], x.v[2], x.v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(x.v[4], x.v[5], x.v[6], x.v[7]);
}

__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// fn(row, col) for each 8-element vector of num_rows rows of row_length elements (col: the
// vector's first element), in a grid-stride loop: the thread layout of the vector kernels.
template <typename Fn>
__device__ __forceinline__ void for_each_vec8(int64_t num_rows, int64_t row_length, Fn&& fn) {
  const int64_t vecs_per_row = row_length / kVec;
  const int64_t total = num_rows * vecs_per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    fn(i / vecs_per_row, (i % vecs_per_row) * kVec);
  }
}

int grid_for(int64_t work_items) {
  return static_cast<int>(std::max<int64_t>(1, std::min(kMaxBlocks, (work_items + kThreads - 1) / kThreads)));
}

// Rows in use: *num_rows_device when given (the count lives on the device only), else num_rows.
// src_b / dst_b: an optional second source gathered by the same row map (null: none).
template <typename Src, typename Dst>
__global__ void gather_rows_kernel(const Src* __restrict__ src, const int32_t* __restrict__ row_slot,
                                   const int32_t* __restrict__ num_rows_device, int64_t num_rows,
                                   int64_t top_k, int64_t hidden, Dst* __restrict__ dst,
                                   const Src* __restrict__ src_b, Dst* __restrict__ dst_b) {
  const int64_t rows = num_rows_device ? int64_t(*num_rows_device) : num_rows;
  for_each_vec8(rows, hidden, [&](int64_t row, int64_t col) {
    const int64_t token = row_slot[row] / top_k;
    if constexpr (std::is_same<Src, Dst>::value) {  // a plain 16-byte copy, no conversion
      *reinterpret_cast<uint4*>(dst + row * hidden + col) =
          *reinterpret_cast<const uint4*>(src + token * hidden + col);
      if (src_b != nullptr) {
        *reinterpret_cast<uint4*>(dst_b + row * hidden + col) =
            *reinterpret_cast<const uint4*>(src_b + token * hidden + col);
      }
    } else {
      store8(dst + row * hidden + col, load8(src + token * hidden + col));
      if (src_b != nullptr) store8(dst_b + row * hidden + col, load8(src_b + token * hidden + col));
    }
  });
}

// Thread i copies 16-byte vector i of a token row to each of the token's pool rows.
__global__ void scatter_token_rows_kernel(const bf16* __restrict__ src, const int32_t* __restrict__ slot_row,
                                          int64_t num_tokens, int64_t top_k, int64_t hidden, bf16* __restrict__ dst,
                                          const bf16* __restrict__ src_b, bf16* __restrict__ dst_b) {
  for_each_vec8(num_tokens, hidden, [&](int64_t token, int64_t col) {
    const uint4 a = *reinterpret_cast<const uint4*>(src + token * hidden + col);
    const uint4 b = src_b != nullptr ? *reinterpret_cast<const uint4*>(src_b + token * hidden + col) : uint4{};
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t row = __ldg(slot_row + token * top_k + j);
      if (row < 0) continue;
      *reinterpret_cast<uint4*>(dst + row * hidden + col) = a;
      if (dst_b != nullptr) *reinterpret_cast<uint4*>(dst_b + row * hidden + col) = b;
    }
  });
}

// d_topk_w[s] from the per-tile partials of slot s's row, n in increasing order (0: no row).
__device__ __forceinline__ float router_grad_of_slot(const float* __restrict__ partials, int32_t num_n_tiles,
                                                     int32_t row) {
  float sum = 0.0f;
  if (row >= 0) {
    for (int32_t n = 0; n < num_n_tiles; ++n) sum += partials[int64_t(row) * num_n_tiles + n];
  }
  return sum;
}

__global__ void combine_slots_kernel(const bf16* __restrict__ ys, const int32_t* __restrict__ slot_row,
                                     int64_t num_tokens, int64_t top_k, int64_t hidden,
                                     bf16* __restrict__ y, RouterGradReduce router) {
  if (router.partials != nullptr) {
    for (int64_t s = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; s < num_tokens * top_k;
         s += int64_t(gridDim.x) * blockDim.x) {
      router.d_topk_w[s] = router_grad_of_slot(router.partials, static_cast<int32_t>(router.num_n_tiles), slot_row[s]);
    }
  }
  for_each_vec8(num_tokens, hidden, [&](int64_t token, int64_t col) {
    Vec8 acc{};
    for (int64_t j = 0; j < top_k; ++j) {  // fixed order: deterministic
      const int64_t slot = token * top_k + j;
      if (slot_row[slot] < 0) continue;
      const Vec8 x = load8(ys + slot * hidden + col);
#pragma unroll
      for (int k = 0; k < kVec; ++k) acc.v[k] += x.v[k];
    }
    store8(y + token * hidden + col, acc);
  });
}

template <typename In, typename Out>
__global__ void swiglu_forward_kernel(const In* __restrict__ z, int64_t num_rows,
                                      int64_t intermediate, SwigluClamp clamp,
                                      Out* __restrict__ h) {
  for_each_vec8(num_rows, intermediate, [&](int64_t row, int64_t col) {
    const Vec8 g = load8(z + row * 2 * intermediate + col);
    const Vec8 u = load8(z + row * 2 * intermediate + intermediate + col);
    Vec8 out;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      float gk = g.v[k], uk = u.v[k];
      if (clamp.enabled) {
        gk = fminf(gk, clamp.limit);
        uk = fminf(fmaxf(uk, -clamp.limit), clamp.limit);
      }
      out.v[k] = gk * sigmoid(gk) * uk;
    }
    store8(h + row * intermediate + col, out);
  });
}

template <typename In>
__global__ void combine_forward_kernel(const In* __restrict__ o, const int32_t* __restrict__ slot_row,
                                       const float* __restrict__ topk_w, int64_t num_tokens,
                                       int64_t top_k, int64_t hidden, bf16* __restrict__ y) {
  for_each_vec8(num_tokens, hidden, [&](int64_t token, int64_t col) {
    Vec8 acc{};
    for (int64_t j = 0; j < top_k; ++j) {  // fixed order: deterministic
      const int32_t row = slot_row[token * top_k + j];
      if (row < 0) continue;
      const float w = topk_w[token * top_k + j];
      const Vec8 x = load8(o + int64_t(row) * hidden + col);
#pragma unroll
      for (int k = 0; k < kVec; ++k) acc.v[k] += w * x.v[k];
    }
    store8(y + token * hidden + col, acc);
  });
}

// One block per row (grid-stride): the router gradient is a dot product over the row.
template <typename Pool>
__global__ void __launch_bounds__(kThreads)
swiglu_backward_kernel(const Pool* __restrict__ z, const Pool* __restrict__ a,
                       const int32_t* __restrict__ row_slot, const float* __restrict__ topk_w,
                       int64_t num_rows, int64_t intermediate, SwigluClamp clamp,
                       float* __restrict__ d_topk_w, Pool* __restrict__ wh,
                       Pool* __restrict__ dz) {
  __shared__ float warp_sums[kThreads / 32];
  for (int64_t row = blockIdx.x; row < num_rows; row += gridDim.x) {
    const int32_t slot = row_slot[row];
    const float w = topk_w[slot];
    const Pool* z_row = z + row * 2 * intermediate;
    float dot = 0.0f;
    for (int64_t i = threadIdx.x; i < intermediate; i += blockDim.x) {
      float g = to_float(z_row[i]);
      float u = to_float(z_row[intermediate + i]);
      float g_pass = 1.0f, u_pass = 1.0f;  // clamp masks: gradient flows where not clamped
      if (clamp.enabled) {
        g_pass = (g <= clamp.limit) ? 1.0f : 0.0f;
        u_pass = (u >= -clamp.limit && u <= clamp.limit) ? 1.0f : 0.0f;
        g = fminf(g, clamp.limit);
        u = fminf(fmaxf(u, -clamp.limit), clamp.limit);
      }
      const float s = sigmoid(g);
      const float silu = g * s;
      const float h = to_float(from_float<Pool>(silu * u));  // the h the forward stored
      const float ai = to_float(a[row * intermediate + i]);
      dot += h * ai;
      wh[row * intermediate + i] = from_float<Pool>(w * h);
      const float dh = w * ai;
      dz[row * 2 * intermediate + i] = from_float<Pool>(dh * u * s * (1.0f + g * (1.0f - s)) * g_pass);
      dz[row * 2 * intermediate + intermediate + i] = from_float<Pool>(dh * silu * u_pass);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = dot;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.0f;
      for (int wi = 0; wi < kThreads / 32; ++wi) total += warp_sums[wi];  // fixed order
      d_topk_w[slot] = total;
    }
    __syncthreads();
  }
}

template <typename In>
__global__ void combine_backward_kernel(const In* __restrict__ dxs,
                                        const int32_t* __restrict__ slot_row, int64_t num_tokens,
                                        int64_t top_k, int64_t hidden, bf16* __restrict__ dx,
                                        float* __restrict__ d_topk_w) {
  for_each_vec8(num_tokens, hidden, [&](int64_t token, int64_t col) {
    Vec8 acc{};
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t row = slot_row[token * top_k + j];
      if (row < 0) {
        if (col == 0) d_topk_w[token * top_k + j] = 0.0f;  // masked: no gradient
        continue;
      }
      const Vec8 x = load8(dxs + int64_t(row) * hidden + col);
#pragma unroll
      for (int k = 0; k < kVec; ++k) acc.v[k] += x.v[k];
    }
    store8(dx + token * hidden + col, acc);
  });
}

__global__ void router_grad_reduce_kernel(const float* __restrict__ partials, int32_t num_n_tiles,
                                          const int32_t* __restrict__ slot_row, int64_t num_slots,
                                          float* __restrict__ d_topk_w) {
  for (int64_t s = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; s < num_slots;
       s += int64_t(gridDim.x) * blockDim.x) {
    d_topk_w[s] = router_grad_of_slot(partials, num_n_tiles, slot_row[s]);
  }
}

__global__ void widen_bf16_kernel(const bf16* __restrict__ src, int64_t count, float* __restrict__ dst) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    dst[i] = __bfloat162float(src[i]);
  }
}

template <typename G>
__global__ void zero_empty_expert_grads_kernel(const int32_t* __restrict__ expert_counts,
                                               int64_t dw13_elems, int64_t dw2_elems,
                                               G* __restrict__ dw13, G* __restrict__ dw2) {
  const int64_t expert = blockIdx.y;
  if (expert_counts[expert] != 0) return;
  const G zero = from_float<G>(0.0f);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < dw13_elems;
       i += int64_t(gridDim.x) * blockDim.x) {
    dw13[expert * dw13_elems + i] = zero;
  }
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < dw2_elems;
       i += int64_t(gridDim.x) * blockDim.x) {
    dw2[expert * dw2_elems + i] = zero;
  }
}

template <typename In, typename G>
__global__ void finalize_weight_grad_kernel(const In* __restrict__ grad, int64_t count,
                                            bool accumulate, G* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float base = accumulate ? to_float(out[i]) : 0.0f;
    out[i] = from_float<G>(base + to_float(grad[i]));
  }
}

}  // namespace

template <typename Src, typename Dst>
void launch_gather_rows(const Src* src_TH, const int32_t* row_slot, int64_t num_rows,
                        int64_t top_k, int64_t hidden, Dst* dst_RH, cudaStream_t stream) {
  if (num_rows == 0) return;
  gather_rows_kernel<<<grid_for(num_rows * hidden / kVec), kThreads, 0, stream>>>(
      src_TH, row_slot, nullptr, num_rows, top_k, hidden, dst_RH, static_cast<const Src*>(nullptr),
      static_cast<Dst*>(nullptr));
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_gather_rows_device_count(const void* src_a_TH, void* dst_a_RH, const void* src_b_TH, void* dst_b_RH,
                                     const int32_t* row_slot, const int32_t* num_rows_device, int64_t max_rows,
                                     int64_t top_k, int64_t hidden, cudaStream_t stream) {
  FUSEMOE_ASSERT((src_b_TH == nullptr) == (dst_b_RH == nullptr));
  if (max_rows == 0) return;
  gather_rows_kernel<<<grid_for(max_rows * hidden / kVec), kThreads, 0, stream>>>(
      static_cast<const bf16*>(src_a_TH), row_slot, num_rows_device, max_rows, top_k, hidden,
      static_cast<bf16*>(dst_a_RH), static_cast<const bf16*>(src_b_TH), static_cast<bf16*>(dst_b_RH));
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_scatter_token_rows(const void* src_a_TH, void* dst_a_RH, const void* src_b_TH, void* dst_b_RH,
                               const int32_t* slot_row, int64_t num_tokens, int64_t top_k, int64_t hidden,
                               cudaStream_t stream) {
  FUSEMOE_ASSERT((src_b_TH == nullptr) == (dst_b_RH == nullptr));
  if (num_tokens == 0) return;
  scatter_token_rows_kernel<<<grid_for(num_tokens * hidden / kVec), kThreads, 0, stream>>>(
      static_cast<const bf16*>(src_a_TH), slot_row, num_tokens, top_k, hidden, static_cast<bf16*>(dst_a_RH),
      static_cast<const bf16*>(src_b_TH), static_cast<bf16*>(dst_b_RH));
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_combine_slots(const void* ys_SH_bf16, const int32_t* slot_row, int64_t num_tokens,
                          int64_t top_k, int64_t hidden, void* y_TH_bf16, cudaStream_t stream,
                          const RouterGradReduce& router) {
  if (num_tokens == 0) return;
  FUSEMOE_ASSERT(router.partials == nullptr || (router.d_topk_w != nullptr && router.num_n_tiles > 0));
  combine_slots_kernel<<<grid_for(num_tokens * hidden / kVec), kThreads, 0, stream>>>(
      static_cast<const bf16*>(ys_SH_bf16), slot_row, num_tokens, top_k, hidden,
      static_cast<bf16*>(y_TH_bf16), router);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

template <typename In, typename Out>
void launch_swiglu_forward(const In* z_RF, int64_t num_rows, int64_t intermediate,
                           SwigluClamp clamp, Out* h_RI, cudaStream_t stream) {
  if (num_rows == 0) return;
  swiglu_forward_kernel<<<grid_for(num_rows * intermediate / kVec), kThreads, 0, stream>>>(
      z_RF, num_rows, intermediate, clamp, h_RI);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

template <typename In>
void launch_combine_forward(const In* o_RH, const int32_t* slot_row, const float* topk_w_TK,
                            int64_t num_tokens, int64_t top_k, int64_t hidden, void* y_TH_bf16,
                            cudaStream_t stream) {
  if (num_tokens == 0) return;
  combine_forward_kernel<<<grid_for(num_tokens * hidden / kVec), kThreads, 0, stream>>>(
      o_RH, slot_row, topk_w_TK, num_tokens, top_k, hidden, static_cast<bf16*>(y_TH_bf16));
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

template <typename Pool>
void launch_swiglu_backward(const Pool* z_RF, const Pool* a_RI, const int32_t* row_slot,
                            const float* topk_w_TK, int64_t num_rows, int64_t intermediate,
                            SwigluClamp clamp, float* d_topk_w_TK, Pool* wh_RI, Pool* dz_RF,
                            cudaStream_t stream) {
  if (num_rows == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>(num_rows, kMaxBlocks));
  swiglu_backward_kernel<<<blocks, kThreads, 0, stream>>>(z_RF, a_RI, row_slot, topk_w_TK,
                                                          num_rows, intermediate, clamp,
                                                          d_topk_w_TK, wh_RI, dz_RF);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

template <typename In>
void launch_combine_backward(const In* dxs_RH, const int32_t* slot_row, int64_t num_tokens,
                             int64_t top_k, int64_t hidden, void* dx_TH_bf16,
                             float* d_topk_w_TK, cudaStream_t stream) {
  if (num_tokens == 0) return;
  combine_backward_kernel<<<grid_for(num_tokens * hidden / kVec), kThreads, 0, stream>>>(
      dxs_RH, slot_row, num_tokens, top_k, hidden, static_cast<bf16*>(dx_TH_bf16), d_topk_w_TK);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_router_grad_reduce(const float* router_partials, int64_t num_n_tiles, const int32_t* slot_row,
                               int64_t num_slots, float* d_topk_w, cudaStream_t stream) {
  if (num_slots == 0) return;
  router_grad_reduce_kernel<<<grid_for(num_slots), kThreads, 0, stream>>>(
      router_partials, static_cast<int32_t>(num_n_tiles), slot_row, num_slots, d_topk_w);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_widen_bf16(const void* src_bf16, int64_t count, float* dst, cudaStream_t stream) {
  if (count == 0) return;
  widen_bf16_kernel<<<grid_for(count), kThreads, 0, stream>>>(static_cast<const bf16*>(src_bf16),
                                                              count, dst);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_zero_empty_expert_grads(const int32_t* expert_counts, int64_t num_experts,
                                    int64_t dw13_elems_per_expert, int64_t dw2_elems_per_expert,
                                    bool bf16_grads, void* dw13, void* dw2, cudaStream_t stream) {
  const dim3 grid(64, static_cast<unsigned>(num_experts));  // 64 blocks stream one expert slice
  if (bf16_grads) {
    zero_empty_expert_grads_kernel<<<grid, kThreads, 0, stream>>>(
        expert_counts, dw13_elems_per_expert, dw2_elems_per_expert, static_cast<bf16*>(dw13),
        static_cast<bf16*>(dw2));
  } else {
    zero_empty_expert_grads_kernel<<<grid, kThreads, 0, stream>>>(
        expert_counts, dw13_elems_per_expert, dw2_elems_per_expert, static_cast<float*>(dw13),
        static_cast<float*>(dw2));
  }
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

template <typename In>
void launch_finalize_weight_grad(const In* grad, int64_t count, bool accumulate, bool bf16_out,
                                 void* out, cudaStream_t stream) {
  if (count == 0) return;
  if (bf16_out) {
    finalize_weight_grad_kernel<<<grid_for(count), kThreads, 0, stream>>>(
        grad, count, accumulate, static_cast<bf16*>(out));
  } else {
    finalize_weight_grad_kernel<<<grid_for(count), kThreads, 0, stream>>>(
        grad, count, accumulate, static_cast<float*>(out));
  }
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

// The two pool element types: bf16 (Impl::kUnfused) and float (Impl::kReferenceFp32).
template void launch_gather_rows<bf16, bf16>(const bf16*, const int32_t*, int64_t, int64_t, int64_t, bf16*, cudaStream_t);
template void launch_gather_rows<bf16, float>(const bf16*, const int32_t*, int64_t, int64_t, int64_t, float*, cudaStream_t);
template void launch_swiglu_forward<bf16, bf16>(const bf16*, int64_t, int64_t, SwigluClamp, bf16*, cudaStream_t);
template void launch_swiglu_forward<float, float>(const float*, int64_t, int64_t, SwigluClamp, float*, cudaStream_t);
template void launch_combine_forward<bf16>(const bf16*, const int32_t*, const float*, int64_t, int64_t, int64_t, void*, cudaStream_t);
template void launch_combine_forward<float>(const float*, const int32_t*, const float*, int64_t, int64_t, int64_t, void*, cudaStream_t);
template void launch_swiglu_backward<bf16>(const bf16*, const bf16*, const int32_t*, const float*, int64_t, int64_t, SwigluClamp, float*, bf16*, bf16*, cudaStream_t);
template void launch_swiglu_backward<float>(const float*, const float*, const int32_t*, const float*, int64_t, int64_t, SwigluClamp, float*, float*, float*, cudaStream_t);
template void launch_combine_backward<bf16>(const bf16*, const int32_t*, int64_t, int64_t, int64_t, void*, float*, cudaStream_t);
template void launch_combine_backward<float>(const float*, const int32_t*, int64_t, int64_t, int64_t, void*, float*, cudaStream_t);
template void launch_finalize_weight_grad<bf16>(const bf16*, int64_t, bool, bool, void*, cudaStream_t);
template void launch_finalize_weight_grad<float>(const float*, int64_t, bool, bool, void*, cudaStream_t);

}  // namespace fusemoe

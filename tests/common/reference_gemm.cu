// One kernel for both forms: C(i, j) = sum_k A(i, k) B_e(k, j) with the operands read through
// strides. Rows GEMM: i is a pool row (its expert found per 64-row tile), k runs over K. Weight
// gradient: blockIdx.z is the expert, i runs over M, k over the expert's rows.
#include "common/reference_gemm.h"

#include <cuda_bf16.h>

#include "fusemoe/error.h"

namespace fusemoe::harness {
namespace {

constexpr int kTile = 64;   // output tile [64 i][64 j], 4 x 4 per thread
constexpr int kTileK = 32;  // k per shared-memory step
constexpr int kThreads = 256;

struct Strided {
  const __nv_bfloat16* ptr;
  int64_t stride_expert, stride_k, stride_x;  // element (e, k, x) at e * se + k * sk + x * sx
};

struct RefArgs {
  Strided a, b;  // a: x = i (stride_expert unused); b: x = j
  const int32_t* offsets;
  int32_t num_experts;
  int64_t rows;          // i range: pool rows (rows GEMM) or M (weight gradient)
  int64_t n, k;          // j range; k range of the rows GEMM
  bool reduce_over_rows;
  float* out;
};

__device__ __forceinline__ float load(const Strided& s, int64_t e, int64_t k, int64_t x) {
  return __bfloat162float(s.ptr[e * s.stride_expert + k * s.stride_k + x * s.stride_x]);
}

// acc += A[i0.., k_begin..k_end) * B[k.., j0..] for one expert.
__device__ void accumulate(const RefArgs& p, int e, int64_t i0, int64_t i_end, int64_t j0, int64_t k_begin,
                           int64_t k_end, float (&As)[kTile][kTileK + 1], float (&Bs)[kTile][kTileK + 1],
                           float (&acc)[4][4]) {
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  // Consecutive threads walk the operand's contiguous dimension.
  const bool a_k_fast = p.a.stride_k == 1, b_k_fast = p.b.stride_k == 1;
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kTileK) {
    for (int idx = threadIdx.x; idx < kTile * kTileK; idx += kThreads) {
      int xx = a_k_fast ? idx / kTileK : idx % kTile, kk = a_k_fast ? idx % kTileK : idx / kTile;
      int64_t x = i0 + xx, k = k0 + kk;
      As[xx][kk] = (x < i_end && k < k_end) ? load(p.a, 0, k, x) : 0.0f;
      xx = b_k_fast ? idx / kTileK : idx % kTile;
      kk = b_k_fast ? idx % kTileK : idx / kTile;
      x = j0 + xx;
      k = k0 + kk;
      Bs[xx][kk] = (x < p.n && k < k_end) ? load(p.b, e, k, x) : 0.0f;
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < kTileK; ++kk) {
      float a[4], b[4];
      for (int i = 0; i < 4; ++i) a[i] = As[ty * 4 + i][kk];
      for (int j = 0; j < 4; ++j) b[j] = Bs[tx * 4 + j][kk];
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kThreads) reference_gemm_kernel(const RefArgs p) {
  __shared__ float As[kTile][kTileK + 1];
  __shared__ float Bs[kTile][kTileK + 1];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t i0 = int64_t{blockIdx.y} * kTile, j0 = int64_t{blockIdx.x} * kTile;
  auto store = [&](const float (&acc)[4][4], int64_t out_row0, int64_t i_begin, int64_t i_end) {
    for (int i = 0; i < 4; ++i) {
      const int64_t row = i0 + ty * 4 + i;
      if (row < i_begin || row >= i_end) continue;
      for (int j = 0; j < 4; ++j) {
        const int64_t col = j0 + tx * 4 + j;
        if (col < p.n) p.out[(out_row0 + row) * p.n + col] = acc[i][j];
      }
    }
  };
  if (p.reduce_over_rows) {
    const int e = blockIdx.z;
    float acc[4][4] = {};
    accumulate(p, e, i0, p.rows, j0, p.offsets[e], p.offsets[e + 1], As, Bs, acc);
    store(acc, int64_t{e} * p.rows, 0, p.rows);
    return;
  }
  const int64_t num_rows = p.offsets[p.num_experts];
  if (i0 >= num_rows) return;
  int lo = 0, hi = p.num_experts - 1;  // the last expert e with offsets[e] <= i0
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.offsets[mid] <= i0) lo = mid; else hi = mid - 1;
  }
  const int64_t tile_end = min(i0 + kTile, num_rows);
  // A tile that spans several experts is computed once per expert; each row keeps its own.
  for (int e = lo; e < p.num_experts && p.offsets[e] < tile_end; ++e) {
    const int64_t begin = max(int64_t{p.offsets[e]}, i0), end = min(int64_t{p.offsets[e + 1]}, tile_end);
    if (begin >= end) continue;
    float acc[4][4] = {};
    accumulate(p, e, i0, end, j0, 0, p.k, As, Bs, acc);
    store(acc, 0, begin, end);
  }
}

void launch(const RefArgs& args, int64_t grid_z, cudaStream_t stream) {
  if (args.rows == 0 || args.n == 0 || grid_z == 0) return;
  const dim3 grid(static_cast<unsigned>((args.n + kTile - 1) / kTile),
                  static_cast<unsigned>((args.rows + kTile - 1) / kTile), static_cast<unsigned>(grid_z));
  FUSEMOE_CHECK(grid.y <= 65535 && grid.z <= 65535, "reference GEMM grid too large: rows " << args.rows);
  reference_gemm_kernel<<<grid, kThreads, 0, stream>>>(args);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void reference_rows_gemm(const void* a_RK, const void* w, WeightLayout layout, const int32_t* expert_offsets,
                         int64_t num_experts, int64_t max_rows, int64_t k, int64_t n, float* out_RN,
                         cudaStream_t stream) {
  const auto* w_bf16 = static_cast<const __nv_bfloat16*>(w);
  const Strided b = layout == WeightLayout::kNK ? Strided{w_bf16, n * k, 1, k} : Strided{w_bf16, n * k, n, 1};
  const RefArgs args{Strided{static_cast<const __nv_bfloat16*>(a_RK), 0, 1, k}, b, expert_offsets,
                     static_cast<int32_t>(num_experts), max_rows, n, k, /*reduce_over_rows=*/false, out_RN};
  launch(args, 1, stream);
}

void reference_weight_grad(const void* act_m_RM, const void* act_n_RN, const int32_t* expert_offsets,
                           int64_t num_experts, int64_t m, int64_t n, float* out_EMN, cudaStream_t stream) {
  const RefArgs args{Strided{static_cast<const __nv_bfloat16*>(act_m_RM), 0, m, 1},
                     Strided{static_cast<const __nv_bfloat16*>(act_n_RN), 0, n, 1}, expert_offsets,
                     static_cast<int32_t>(num_experts), m, n, /*k (the rows)=*/0, /*reduce_over_rows=*/true, out_EMN};
  launch(args, num_experts, stream);
}

}  // namespace fusemoe::harness

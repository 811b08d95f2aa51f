// Standalone test + benchmark of the sm_90a backward GEMMs (src/kernels/sm90_moe_backward_gemm.h)
// and of the fused backward launcher (src/launch/fused_moe_backward.h).
//
// Part 1, kernels: host-built routing with chosen per-expert counts (0, 1, 7, 199, one expert
// holding every row, none), random bf16 pools. Each kernel's output is NaN-poisoned (0xFF bytes)
// first and compared with an fp32 GPU reference computed from the kernel's own bf16 inputs
// (naive tiled GEMMs): |out - ref| <= rtol |ref| + atol (atol = 1e-3 rms(ref)), NaN fails;
// rows outside every expert (and unused slot rows) must keep their poison; weight gradients of
// empty experts must be zero (or untouched when accumulating, checked bitwise); a second run
// must be bitwise equal.
// Part 2, launcher: fused_backward against the library's fp32 GPU oracle (Impl::kReferenceFp32)
// and the unfused bf16 baseline (Impl::kUnfused), relative L2 error per gradient; fused error
// <= 2 x unfused error + 1e-3; determinism; accumulate mode doubles fp32 gradients exactly.
// Part 3, timing at the Qwen3 shapes: each kernel (median of 20 after warm-up, L2 flushed) with
// R uniform rows, and the whole fused backward against the unfused backward (uniform random
// top-k routing). TFLOP/s count useful FLOPs: 12 H I per row for the whole backward.
//
// Legend: T tokens, K top-k, E experts, H hidden, I intermediate, R routed rows, S = T*K slots,
// R_max = S pool capacity. Exit 0 pass, 1 fail, 3 hang (watchdog), 77 "skipped: no sm_90 GPU".
// Usage: test_sm90_moe_backward_gemm [--no-timing] [--no-large] [--no-e2e] [--quick]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "fusemoe/fusemoe.h"
#include "kernels/moe_elementwise.h"
#include "kernels/routing.h"
#include "kernels/sm90_moe_backward_gemm.h"
#include "launch/fused_moe_backward.h"
#include "sm90_standalone.h"  // this folder


using bf16 = __nv_bfloat16;

namespace {

// out[r, c] = sum_k A[r, k] * B_e(r)[k, c] in fp32, r < R = offsets[E], c < N. B_e is K-major
// (w[e][c][k], kBKMajor) or N-major (w[e][k][c]). 64 x 64 output tile per block, 4 x 4 per
// thread; a tile spanning several experts is computed once per expert.
constexpr int kRefTile = 64, kRefK = 32;
template <bool kBKMajor>
__global__ void __launch_bounds__(256) ref_rows_gemm(const bf16* A, const bf16* B, const int* offsets, int E,
                                                     int N, int K, float* out) {
  __shared__ float As[kRefTile][kRefK + 1];
  __shared__ float Bs[kRefTile][kRefK + 1];  // Bs[c][k]
  const int R = offsets[E];
  const int r0 = blockIdx.y * kRefTile, c0 = blockIdx.x * kRefTile;
  if (r0 >= R) return;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  int lo = 0, hi = E - 1;  // last e with offsets[e] <= r0
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= r0) lo = mid; else hi = mid - 1;
  }
  const int r_end = min(r0 + kRefTile, R);
  for (int e = lo; e < E && offsets[e] < r_end; ++e) {
    const int e_begin = max(offsets[e], r0), e_end = min(offsets[e + 1], r_end);
    if (e_begin >= e_end) continue;
    float acc[4][4] = {};
    for (int k0 = 0; k0 < K; k0 += kRefK) {
      for (int i = threadIdx.x; i < kRefTile * kRefK; i += 256) {
        const int rr = i / kRefK, kk = i % kRefK;
        const int r = r0 + rr;
        As[rr][kk] = r < R ? __bfloat162float(A[int64_t(r) * K + k0 + kk]) : 0.0f;
        // Bs[cc][ks]: consecutive threads walk the contiguous dimension of B.
        const int cc = kBKMajor ? i / kRefK : i % kRefTile;
        const int ks = kBKMajor ? i % kRefK : i / kRefTile;
        const int c = c0 + cc, k = k0 + ks;
        float v = 0.0f;
        if (c < N) {
          v = kBKMajor ? __bfloat162float(B[(int64_t(e) * N + c) * K + k])
                       : __bfloat162float(B[(int64_t(e) * K + k) * N + c]);
        }
        Bs[cc][ks] = v;
      }
      __syncthreads();
#pragma unroll 8
      for (int kk = 0; kk < kRefK; ++kk) {
        float a[4], b[4];
        for (int i = 0; i < 4; ++i) a[i] = As[ty * 4 + i][kk];
        for (int j = 0; j < 4; ++j) b[j] = Bs[tx * 4 + j][kk];
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
      }
      __syncthreads();
    }
    for (int i = 0; i < 4; ++i) {
      const int r = r0 + ty * 4 + i;
      if (r < e_begin || r >= e_end) continue;
      for (int j = 0; j < 4; ++j) {
        const int c = c0 + tx * 4 + j;
        if (c < N) out[int64_t(r) * N + c] = acc[i][j];
      }
    }
  }
}

// out[e, m, n] = sum_{r in expert e} act_m[r, m] * act_n[r, n] in fp32 (0 for empty experts).
// Grid (N/64, M/64, E); 4 x 4 outputs per thread.
__global__ void __launch_bounds__(256) ref_weight_grad(const bf16* act_m, const bf16* act_n, const int* offsets,
                                                       int M, int N, float* out) {
  __shared__ float Ms[kRefK][kRefTile + 1];
  __shared__ float Ns[kRefK][kRefTile + 1];
  const int e = blockIdx.z, m0 = blockIdx.y * kRefTile, n0 = blockIdx.x * kRefTile;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int begin = offsets[e], end = offsets[e + 1];
  float acc[4][4] = {};
  for (int r0 = begin; r0 < end; r0 += kRefK) {
    for (int i = threadIdx.x; i < kRefK * kRefTile; i += 256) {
      const int rr = i / kRefTile, cc = i % kRefTile;
      const int r = r0 + rr;
      Ms[rr][cc] = (r < end && m0 + cc < M) ? __bfloat162float(act_m[int64_t(r) * M + m0 + cc]) : 0.0f;
      Ns[rr][cc] = (r < end && n0 + cc < N) ? __bfloat162float(act_n[int64_t(r) * N + n0 + cc]) : 0.0f;
    }
    __syncthreads();
    for (int rr = 0; rr < kRefK; ++rr) {
      float a[4], b[4];
      for (int i = 0; i < 4; ++i) a[i] = Ms[rr][ty * 4 + i];
      for (int j = 0; j < 4; ++j) b[j] = Ns[rr][tx * 4 + j];
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i) {
    const int m = m0 + ty * 4 + i;
    if (m >= M) continue;
    for (int j = 0; j < 4; ++j) {
      const int n = n0 + tx * 4 + j;
      if (n < N) out[(int64_t(e) * M + m) * N + n] = acc[i][j];
    }
  }
}

// SwiGLU backward of the reference: from a_ref (fp32) and the kernel's z (bf16). One warp per
// row: dz_ref [R, 2I], wh_ref [R, I], dot_ref [R] = <h, a> (h rounded to bf16, as stored).
__global__ void ref_swiglu_backward(const float* a_ref, const bf16* z, const int* row_slot, const float* topk_w,
                                    int64_t R, int I, int use_clamp, float clamp, float* dz_ref, float* wh_ref,
                                    float* dot_ref) {
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= R) return;
  const int64_t r = warp;
  const float w = topk_w[row_slot[r]];
  double dot = 0.0;
  for (int c = lane; c < I; c += 32) {
    float g = __bfloat162float(z[r * 2 * I + c]), u = __bfloat162float(z[r * 2 * I + I + c]);
    float gp = 1.0f, up = 1.0f;
    if (use_clamp) {
      gp = g <= clamp ? 1.0f : 0.0f;
      up = (u >= -clamp && u <= clamp) ? 1.0f : 0.0f;
      g = fminf(g, clamp);
      u = fminf(fmaxf(u, -clamp), clamp);
    }
    const float s = 1.0f / (1.0f + expf(-g));
    const float silu = g * s;
    const float h = __bfloat162float(__float2bfloat16(silu * u));
    const float a = a_ref[r * I + c];
    dot += double(h) * a;
    const float dh = w * a;
    dz_ref[r * 2 * I + c] = dh * u * s * (1.0f + g * (1.0f - s)) * gp;
    dz_ref[r * 2 * I + I + c] = dh * silu * up;
    wh_ref[r * I + c] = w * h;
  }
  for (int d = 16; d > 0; d /= 2) dot += __shfl_xor_sync(~0u, dot, d);
  if (lane == 0) dot_ref[r] = static_cast<float>(dot);
}

struct CompareStats {
  unsigned long long bad;
  unsigned long long first_bad;
  double sum_xy, sum_xx, sum_yy, sum_dd;
  float max_abs_err;
};

__device__ __forceinline__ float load_as_float(const bf16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load_as_float(const float* p) { return *p; }

// Compares out[dest(r) * out_stride + c] with ref[r * N + c] (+ addend at the out index when
// given), r < R, c < N, dest(r) = row_index ? row_index[r] : r.
template <typename Out>
__global__ void compare_kernel(const Out* out, int64_t out_stride, const int* row_index, const float* ref,
                               const float* addend, int64_t R, int N, float rtol, float atol, CompareStats* stats) {
  unsigned long long bad = 0, first_bad = ~0ull;
  double sxy = 0, sxx = 0, syy = 0, sdd = 0;
  float max_err = 0.0f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < R * N; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / N;
    const int c = static_cast<int>(i % N);
    const int64_t dest = (row_index ? row_index[r] : r) * out_stride + c;
    const float y = ref[i] + (addend ? addend[dest] : 0.0f);
    const float x = load_as_float(out + dest);
    const float err = fabsf(x - y);
    if (!(err <= rtol * fabsf(y) + atol)) {
      ++bad;
      first_bad = min(first_bad, static_cast<unsigned long long>(i));
    }
    if (err > max_err) max_err = err;
    sxy += double(x) * y; sxx += double(x) * x; syy += double(y) * y; sdd += double(x - y) * (x - y);
  }
  for (int d = 16; d > 0; d /= 2) {
    bad += __shfl_xor_sync(~0u, bad, d);
    first_bad = min(first_bad, __shfl_xor_sync(~0u, first_bad, d));
    sxy += __shfl_xor_sync(~0u, sxy, d); sxx += __shfl_xor_sync(~0u, sxx, d);
    syy += __shfl_xor_sync(~0u, syy, d); sdd += __shfl_xor_sync(~0u, sdd, d);
    max_err = fmaxf(max_err, __shfl_xor_sync(~0u, max_err, d));
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(&stats->bad, bad);
    atomicMin(&stats->first_bad, first_bad);
    atomicAdd(&stats->sum_xy, sxy); atomicAdd(&stats->sum_xx, sxx);
    atomicAdd(&stats->sum_yy, syy); atomicAdd(&stats->sum_dd, sdd);
    if (max_err == max_err) atomicMax(reinterpret_cast<int*>(&stats->max_abs_err), __float_as_int(max_err));
  }
}

// Counts elements of rows with keep[r] != 0 that no longer hold the all-ones poison.
template <typename Word>
__global__ void count_overwritten(const Word* buf, int64_t rows, int64_t cols, const uint8_t* keep,
                                  unsigned long long* count) {
  unsigned long long n = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * cols; i += int64_t(gridDim.x) * blockDim.x) {
    if (keep[i / cols] && buf[i] != static_cast<Word>(~Word(0))) ++n;
  }
  if (n) atomicAdd(count, n);
}

__global__ void count_different_words(const uint32_t* a, const uint32_t* b, int64_t n, unsigned long long* count) {
  unsigned long long d = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    d += a[i] != b[i];
  }
  if (d) atomicAdd(count, d);
}

// Counts i with out[i] != 2 * base[i] bitwise (fp32): accumulate onto a copy of itself.
__global__ void count_not_doubled(const float* out, const float* base, int64_t n, unsigned long long* count) {
  unsigned long long d = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    d += __float_as_uint(out[i]) != __float_as_uint(2.0f * base[i]);
  }
  if (d) atomicAdd(count, d);
}

// ---------------------------------------------------------------------------------- host side
constexpr int kGrid = 2048, kBlock = 256;

unsigned long long run_count(const std::function<void(unsigned long long*)>& launch) {
  unsigned long long* count = device_alloc<unsigned long long>(1);
  CHECK_CUDA(cudaMemset(count, 0, sizeof(*count)));
  launch(count);
  CHECK_CUDA(cudaGetLastError());
  unsigned long long host = 0;
  CHECK_CUDA(cudaMemcpy(&host, count, sizeof(host), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(count));
  return host;
}

template <typename Word>
unsigned long long overwritten(const void* buf, int64_t rows, int64_t cols, const uint8_t* keep) {
  return run_count([&](unsigned long long* c) {
    count_overwritten<Word><<<kGrid, kBlock>>>(static_cast<const Word*>(buf), rows, cols, keep, c);
  });
}
unsigned long long different_bytes(const void* a, const void* b, size_t bytes) {
  return run_count([&](unsigned long long* c) {
    count_different_words<<<kGrid, kBlock>>>(static_cast<const uint32_t*>(a), static_cast<const uint32_t*>(b),
                                             int64_t(bytes / 4), c);
  });
}

int g_failures = 0;

bool expect(bool ok, const char* what) {
  if (!ok) {
    std::printf("    FAIL: %s\n", what);
    ++g_failures;
  }
  return ok;
}

// Compares and prints one line; returns pass/fail. rtol as given, atol = atol_rel * rms(ref).
template <typename Out>
bool compare(const char* what, const Out* out, int64_t out_stride, const int* row_index, const float* ref,
             const float* addend, int64_t R, int64_t N, float rtol, float atol_rel) {
  if (R == 0 || N == 0) {
    std::printf("    %-26s no rows\n", what);
    return true;
  }
  CompareStats* stats = device_alloc<CompareStats>(1);
  CompareStats host{};
  auto run = [&](float atol) {
    host = CompareStats{0, ~0ull, 0, 0, 0, 0, 0.0f};
    CHECK_CUDA(cudaMemcpy(stats, &host, sizeof(host), cudaMemcpyHostToDevice));
    compare_kernel<Out><<<kGrid, kBlock>>>(out, out_stride, row_index, ref, addend, R, static_cast<int>(N), rtol,
                                           atol, stats);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaMemcpy(&host, stats, sizeof(host), cudaMemcpyDeviceToHost));
  };
  run(INFINITY);  // first pass: sum of ref^2 for the absolute tolerance
  const double rms = std::sqrt(host.sum_yy / double(R * N));
  run(static_cast<float>(atol_rel * rms));
  CHECK_CUDA(cudaFree(stats));
  const double calc_diff = 1.0 - 2.0 * host.sum_xy / std::max(host.sum_xx + host.sum_yy, 1e-300);
  const double rel_l2 = std::sqrt(host.sum_dd / std::max(host.sum_yy, 1e-300));
  const bool ok = host.bad == 0;
  std::printf("    %-26s %s bad %llu / %lld  max_abs_err %.3e  rms_ref %.3e  rel_l2 %.2e  calc_diff %.2e", what,
              ok ? "ok  " : "FAIL", host.bad, static_cast<long long>(R * N), host.max_abs_err, rms, rel_l2, calc_diff);
  if (!ok) std::printf("  first bad (row %lld, col %lld)", (long long)(host.first_bad / N), (long long)(host.first_bad % N));
  std::printf("\n");
  if (!ok) ++g_failures;
  return ok;
}

// ============================================================================ part 1: kernels
struct Routing {
  std::vector<int> counts, offsets, row_slot, slot_row;
  std::vector<float> topk_w;
  std::vector<uint8_t> slot_unused;
  int64_t R = 0, S = 0;
};

Routing make_routing(const Shape& s, const std::vector<int>& counts, std::mt19937_64& rng) {
  Routing rt;
  rt.S = s.T * s.K;
  rt.counts = counts;
  rt.offsets.assign(s.E + 1, 0);
  for (int64_t e = 0; e < s.E; ++e) rt.offsets[e + 1] = rt.offsets[e] + counts[e];
  rt.R = rt.offsets[s.E];
  if (rt.R > rt.S) { std::printf("bad case: R > T*K\n"); std::exit(1); }
  std::vector<int> slots(rt.S);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  rt.row_slot.assign(slots.begin(), slots.begin() + rt.R);
  for (int64_t e = 0; e < s.E; ++e) std::sort(rt.row_slot.begin() + rt.offsets[e], rt.row_slot.begin() + rt.offsets[e + 1]);
  rt.slot_row.assign(rt.S, -1);
  for (int64_t r = 0; r < rt.R; ++r) rt.slot_row[rt.row_slot[r]] = static_cast<int>(r);
  rt.slot_unused.assign(rt.S, 1);
  for (int slot : rt.row_slot) rt.slot_unused[slot] = 0;
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  rt.topk_w.resize(rt.S);
  for (auto& w : rt.topk_w) w = uni(rng);
  return rt;
}

struct KernelProblem {
  Shape s;
  Routing rt;
  bool clamp = false;
  float clamp_value = 1.5f;
  int64_t num_n_tiles = 0;
  bf16 *xs, *dys, *w13, *w2, *z, *dz, *wh, *dx_slots;
  float *partials, *d_topk_w, *topk_w, *dw2, *dw13;  // dw buffers sized for fp32 (bf16 reuses them)
  int *offsets, *row_slot, *slot_row;
  uint8_t *row_keep, *slot_keep;

  void allocate(uint64_t seed) {
    const int64_t R_max = rt.S, H = s.H, I = s.I, E = s.E;
    num_n_tiles = fusemoe::sm90_dgrad_swiglu_num_n_tiles(I, 128);  // the most tiles of any width
    xs = device_alloc<bf16>(R_max * H);
    dys = device_alloc<bf16>(R_max * H);
    w13 = device_alloc<bf16>(E * 2 * I * H);
    w2 = device_alloc<bf16>(E * H * I);
    z = device_alloc<bf16>(R_max * 2 * I);
    dz = device_alloc<bf16>(R_max * 2 * I);
    wh = device_alloc<bf16>(R_max * I);
    dx_slots = device_alloc<bf16>(rt.S * H);
    partials = device_alloc<float>(R_max * num_n_tiles);
    d_topk_w = device_alloc<float>(rt.S);
    dw2 = device_alloc<float>(E * H * I);
    dw13 = device_alloc<float>(E * 2 * I * H);
    // Scales keep z, a and dx around 1 so that rounding, not range, sets the error. The pool
    // rows past R hold random values too (the kernels must not let them leak into any sum).
    fill_random_bf16<<<kGrid, kBlock>>>(xs, R_max * H, seed + 1, 1.0f);
    fill_random_bf16<<<kGrid, kBlock>>>(dys, R_max * H, seed + 2, 1.0f);
    fill_random_bf16<<<kGrid, kBlock>>>(w13, E * 2 * I * H, seed + 3, 2.0f / std::sqrt(float(H)));
    fill_random_bf16<<<kGrid, kBlock>>>(w2, E * H * I, seed + 4, 2.0f / std::sqrt(float(I)));
    CHECK_CUDA(cudaGetLastError());
    offsets = device_upload(rt.offsets);
    row_slot = device_upload(rt.row_slot);
    slot_row = device_upload(rt.slot_row);
    topk_w = device_upload(rt.topk_w);
    std::vector<uint8_t> keep(R_max);
    for (int64_t r = 0; r < R_max; ++r) keep[r] = r >= rt.R;
    row_keep = device_upload(keep);
    slot_keep = device_upload(rt.slot_unused);
  }
  void release() {
    for (void* p : {(void*)xs, (void*)dys, (void*)w13, (void*)w2, (void*)z, (void*)dz, (void*)wh, (void*)dx_slots,
                    (void*)partials, (void*)d_topk_w, (void*)topk_w, (void*)dw2, (void*)dw13, (void*)offsets,
                    (void*)row_slot, (void*)slot_row, (void*)row_keep, (void*)slot_keep})
      CHECK_CUDA(cudaFree(p));
  }
  void recompute_z() const {
    fusemoe::Sm90RecomputeZParams p;
    p.xs = xs; p.w13 = w13; p.z = z; p.expert_offsets = offsets;
    p.max_rows = rt.S; p.hidden = s.H; p.intermediate = s.I; p.num_experts = s.E;
    fusemoe::launch_sm90_recompute_z(p);
  }
  void dgrad_swiglu(int block_n = 0) const {
    fusemoe::Sm90DgradSwigluParams p;
    p.block_n = block_n;
    p.dys = dys; p.w2 = w2; p.z = z; p.expert_offsets = offsets; p.row_slot = row_slot; p.topk_weights = topk_w;
    p.dz = dz; p.wh = wh; p.router_partials = partials;
    p.max_rows = rt.S; p.hidden = s.H; p.intermediate = s.I; p.num_experts = s.E; p.num_slots = rt.S;
    p.use_swiglu_clamp = clamp; p.swiglu_clamp = clamp_value;
    fusemoe::launch_sm90_dgrad_swiglu(p);
  }
  void router_reduce(int block_n = 0) const {
    const int width = fusemoe::sm90_dgrad_swiglu_block_n(s.H, block_n);  // as the launcher resolves 0
    fusemoe::launch_router_grad_reduce(partials, fusemoe::sm90_dgrad_swiglu_num_n_tiles(s.I, width), slot_row,
                                       rt.S, d_topk_w, nullptr);
  }
  void dgrad_scatter() const {
    fusemoe::Sm90DgradScatterParams p;
    p.dz = dz; p.w13 = w13; p.dx_slots = dx_slots; p.expert_offsets = offsets; p.row_slot = row_slot;
    p.max_rows = rt.S; p.hidden = s.H; p.intermediate = s.I; p.num_experts = s.E; p.num_slots = rt.S;
    fusemoe::launch_sm90_dgrad_scatter(p);
  }
  // which = 0: dW2 = dys^T wh [E, H, I]; which = 1: dW13 = dz^T xs [E, 2I, H].
  void weight_grad(int which, bool bf16_grad, bool accumulate) const {
    fusemoe::Sm90WeightGradParams p;
    p.act_m = which == 0 ? (const void*)dys : (const void*)dz;
    p.act_n = which == 0 ? (const void*)wh : (const void*)xs;
    p.grad = which == 0 ? (void*)dw2 : (void*)dw13;
    p.expert_offsets = offsets; p.max_rows = rt.S;
    p.m = which == 0 ? s.H : 2 * s.I;
    p.n = which == 0 ? s.I : s.H;
    p.num_experts = s.E; p.bf16_grad = bf16_grad; p.accumulate = accumulate;
    fusemoe::launch_sm90_weight_grad(p);
  }
};

// Runs every kernel on poisoned outputs and checks it against the reference.
void check_kernels(KernelProblem& pb, bool determinism) {
  const Shape& s = pb.s;
  const int64_t R = pb.rt.R, R_max = pb.rt.S, S = pb.rt.S, H = s.H, I = s.I, E = s.E;
  const dim3 ref_block(256);
  auto ref_grid = [&](int64_t N) { return dim3((N + kRefTile - 1) / kRefTile, std::max<int64_t>((R + kRefTile - 1) / kRefTile, 1)); };

  // ---- recompute z
  CHECK_CUDA(cudaMemset(pb.z, 0xFF, R_max * 2 * I * sizeof(bf16)));
  pb.recompute_z();
  wait_device("recompute_z");
  float* z_ref = device_alloc<float>(R * 2 * I);
  if (R > 0) ref_rows_gemm<true><<<ref_grid(2 * I), ref_block>>>(pb.xs, pb.w13, pb.offsets, E, 2 * I, H, z_ref);
  compare<bf16>("z = xs W13^T", pb.z, 2 * I, nullptr, z_ref, nullptr, R, 2 * I, 1e-2f, 1e-3f);
  expect(overwritten<uint16_t>(pb.z, R_max, 2 * I, pb.row_keep) == 0, "z rows >= R were written");
  CHECK_CUDA(cudaFree(z_ref));

  // ---- dgrad + SwiGLU backward (reference from the kernel's own z), both tile widths; the
  // default width runs last, so its outputs feed the checks below.
  float* a_ref = device_alloc<float>(R * I);
  float* dz_ref = device_alloc<float>(R * 2 * I);
  float* wh_ref = device_alloc<float>(R * I);
  float* dot_ref = device_alloc<float>(R);
  if (R > 0) {
    ref_rows_gemm<false><<<ref_grid(I), ref_block>>>(pb.dys, pb.w2, pb.offsets, E, I, H, a_ref);
    ref_swiglu_backward<<<(R * 32 + 255) / 256, 256>>>(a_ref, pb.z, pb.row_slot, pb.topk_w, R, I, pb.clamp ? 1 : 0,
                                                       pb.clamp_value, dz_ref, wh_ref, dot_ref);
    CHECK_CUDA(cudaGetLastError());
  }
  for (int block_n : {256, 128}) {
    CHECK_CUDA(cudaMemset(pb.dz, 0xFF, R_max * 2 * I * sizeof(bf16)));
    CHECK_CUDA(cudaMemset(pb.wh, 0xFF, R_max * I * sizeof(bf16)));
    CHECK_CUDA(cudaMemset(pb.partials, 0xFF, R_max * pb.num_n_tiles * sizeof(float)));
    CHECK_CUDA(cudaMemset(pb.d_topk_w, 0xFF, S * sizeof(float)));
    pb.dgrad_swiglu(block_n);
    pb.router_reduce(block_n);
    wait_device("dgrad_swiglu + router_reduce");
    char what[3][64];
    std::snprintf(what[0], sizeof(what[0]), "dz (SwiGLU bwd) BN=%d", block_n);
    std::snprintf(what[1], sizeof(what[1]), "wh = w h BN=%d", block_n);
    std::snprintf(what[2], sizeof(what[2]), "d_topk_w = <h, a> BN=%d", block_n);
    compare<bf16>(what[0], pb.dz, 2 * I, nullptr, dz_ref, nullptr, R, 2 * I, 1e-2f, 1e-3f);
    compare<bf16>(what[1], pb.wh, I, nullptr, wh_ref, nullptr, R, I, 1e-2f, 1e-3f);
    // Router gradient: d_topk_w[slot_r] vs <h, a>_r; unused slots must be exactly 0.
    compare<float>(what[2], pb.d_topk_w, 1, pb.row_slot, dot_ref, nullptr, R, 1, 2e-3f, 2e-3f);
    std::vector<float> d_host(S);
    CHECK_CUDA(cudaMemcpy(d_host.data(), pb.d_topk_w, S * sizeof(float), cudaMemcpyDeviceToHost));
    int64_t nonzero = 0;
    for (int64_t i = 0; i < S; ++i) nonzero += pb.rt.slot_unused[i] && !(d_host[i] == 0.0f);
    expect(nonzero == 0, "d_topk_w of unused slots is not 0");
    expect(overwritten<uint16_t>(pb.dz, R_max, 2 * I, pb.row_keep) == 0, "dz rows >= R were written");
    expect(overwritten<uint16_t>(pb.wh, R_max, I, pb.row_keep) == 0, "wh rows >= R were written");
  }
  for (float* p : {a_ref, dz_ref, wh_ref, dot_ref}) CHECK_CUDA(cudaFree(p));

  // ---- dgrad scatter: dx_slots[slot_r] = dz_r W13_e (reference from the kernel's dz)
  CHECK_CUDA(cudaMemset(pb.dx_slots, 0xFF, S * H * sizeof(bf16)));
  pb.dgrad_scatter();
  wait_device("dgrad_scatter");
  float* dxs_ref = device_alloc<float>(R * H);
  if (R > 0) ref_rows_gemm<false><<<ref_grid(H), ref_block>>>(pb.dz, pb.w13, pb.offsets, E, H, 2 * I, dxs_ref);
  compare<bf16>("dx_slots = dz W13", pb.dx_slots, H, pb.row_slot, dxs_ref, nullptr, R, H, 1e-2f, 1e-3f);
  expect(overwritten<uint16_t>(pb.dx_slots, S, H, pb.slot_keep) == 0, "unused dx_slots rows were written");
  CHECK_CUDA(cudaFree(dxs_ref));

  // ---- weight gradients: fp32 and bf16, overwrite and accumulate
  for (int which = 0; which < 2; ++which) {
    const int64_t M = which == 0 ? H : 2 * I, N = which == 0 ? I : H;
    float* grad = which == 0 ? pb.dw2 : pb.dw13;
    const char* name = which == 0 ? "dW2 = dys^T wh" : "dW13 = dz^T xs";
    float* ref = device_alloc<float>(E * M * N);
    ref_weight_grad<<<dim3((N + 63) / 64, (M + 63) / 64, E), 256>>>(which == 0 ? pb.dys : pb.dz,
                                                                   which == 0 ? pb.wh : pb.xs, pb.offsets, M, N, ref);
    CHECK_CUDA(cudaGetLastError());
    char what[96];
    // fp32 overwrite (empty experts must come out 0: the reference is 0 there)
    CHECK_CUDA(cudaMemset(grad, 0xFF, E * M * N * sizeof(float)));
    pb.weight_grad(which, false, false);
    wait_device(name);
    std::snprintf(what, sizeof(what), "%s fp32", name);
    compare<float>(what, grad, N, nullptr, ref, nullptr, E * M, N, 1e-3f, 1e-3f);
    float* first = device_alloc<float>(E * M * N);
    CHECK_CUDA(cudaMemcpy(first, grad, E * M * N * sizeof(float), cudaMemcpyDeviceToDevice));
    // fp32 accumulate onto itself: exactly 2x (empty experts: 0 + 0)
    pb.weight_grad(which, false, true);
    wait_device(name);
    const unsigned long long not_doubled = run_count([&](unsigned long long* c) {
      count_not_doubled<<<kGrid, kBlock>>>(grad, first, E * M * N, c);
    });
    std::snprintf(what, sizeof(what), "%s fp32 accumulate is not exactly 2x (%llu elements)", name, not_doubled);
    expect(not_doubled == 0, what);
    // accumulate onto random values; empty experts must be untouched (bitwise)
    fill_random_f32<<<kGrid, kBlock>>>(first, E * M * N, 77 + which, 1.0f);
    CHECK_CUDA(cudaMemcpy(grad, first, E * M * N * sizeof(float), cudaMemcpyDeviceToDevice));
    pb.weight_grad(which, false, true);
    wait_device(name);
    std::snprintf(what, sizeof(what), "%s fp32 += init", name);
    compare<float>(what, grad, N, nullptr, ref, first, E * M, N, 1e-3f, 1e-3f);
    {
      int64_t untouched_bad = 0;
      for (int64_t e = 0; e < E; ++e) {
        if (pb.rt.counts[e] != 0) continue;
        untouched_bad += different_bytes(grad + e * M * N, first + e * M * N, M * N * sizeof(float));
      }
      std::snprintf(what, sizeof(what), "%s accumulate changed empty experts (%lld words)", name, (long long)untouched_bad);
      expect(untouched_bad == 0, what);
    }
    // bf16 overwrite
    CHECK_CUDA(cudaMemset(grad, 0xFF, E * M * N * sizeof(bf16)));
    pb.weight_grad(which, true, false);
    wait_device(name);
    std::snprintf(what, sizeof(what), "%s bf16", name);
    compare<bf16>(what, reinterpret_cast<const bf16*>(grad), N, nullptr, ref, nullptr, E * M, N, 1e-2f, 1e-3f);
    if (determinism) {
      bf16* bf_first = reinterpret_cast<bf16*>(first);
      CHECK_CUDA(cudaMemcpy(bf_first, grad, E * M * N * sizeof(bf16), cudaMemcpyDeviceToDevice));
      pb.weight_grad(which, true, false);
      wait_device(name);
      const unsigned long long diff = different_bytes(grad, bf_first, E * M * N * sizeof(bf16));
      std::snprintf(what, sizeof(what), "%s bf16 rerun differs (%llu words)", name, diff);
      expect(diff == 0, what);
    }
    CHECK_CUDA(cudaFree(first));
    CHECK_CUDA(cudaFree(ref));
  }

  // ---- determinism of the row kernels: the same launches again give the same bits
  if (determinism) {
    bf16* z1 = device_alloc<bf16>(R_max * 2 * I);
    bf16* dz1 = device_alloc<bf16>(R_max * 2 * I);
    bf16* dx1 = device_alloc<bf16>(S * H);
    float* d1 = device_alloc<float>(S);
    CHECK_CUDA(cudaMemcpy(z1, pb.z, R_max * 2 * I * sizeof(bf16), cudaMemcpyDeviceToDevice));
    CHECK_CUDA(cudaMemcpy(dz1, pb.dz, R_max * 2 * I * sizeof(bf16), cudaMemcpyDeviceToDevice));
    CHECK_CUDA(cudaMemcpy(dx1, pb.dx_slots, S * H * sizeof(bf16), cudaMemcpyDeviceToDevice));
    CHECK_CUDA(cudaMemcpy(d1, pb.d_topk_w, S * sizeof(float), cudaMemcpyDeviceToDevice));
    pb.recompute_z();
    pb.dgrad_swiglu();
    pb.router_reduce();
    pb.dgrad_scatter();
    wait_device("rerun");
    const unsigned long long diff = different_bytes(pb.z, z1, R_max * 2 * I * 2) +
                                    different_bytes(pb.dz, dz1, R_max * 2 * I * 2) +
                                    different_bytes(pb.dx_slots, dx1, S * H * 2) +
                                    different_bytes(pb.d_topk_w, d1, S * 4);
    char what[96];
    std::snprintf(what, sizeof(what), "row kernels rerun differs (%llu words)", diff);
    expect(diff == 0, what);
    for (void* p : {(void*)z1, (void*)dz1, (void*)dx1, (void*)d1}) CHECK_CUDA(cudaFree(p));
  }
}

// ===================================================================== part 2: the launcher
struct LayerProblem {
  fusemoe::LayerConfig config;
  int64_t T = 0;
  bf16 *x, *dy, *w13, *w2;
  int32_t* idx;
  float* topk_w;
};

// Uniform distinct experts per token; masked_fraction of slots set to -1; all_to_one sends every
// slot to expert 3 (repeated ids).
LayerProblem make_layer_problem(int64_t T, int64_t K, int64_t E, int64_t H, int64_t I, double masked_fraction,
                                bool all_to_one, bool clamp, uint64_t seed) {
  LayerProblem p;
  p.config.hidden = H;
  p.config.intermediate = I;
  p.config.num_experts = E;
  p.config.top_k = K;
  p.config.max_tokens = std::max<int64_t>(T, 1);
  p.config.use_swiglu_clamp = clamp;
  p.config.swiglu_clamp = 1.5f;
  p.T = T;
  p.x = device_alloc<bf16>(T * H);
  p.dy = device_alloc<bf16>(T * H);
  p.w13 = device_alloc<bf16>(E * 2 * I * H);
  p.w2 = device_alloc<bf16>(E * H * I);
  fill_random_bf16<<<kGrid, kBlock>>>(p.x, T * H, seed + 1, 1.0f);
  fill_random_bf16<<<kGrid, kBlock>>>(p.dy, T * H, seed + 2, 1.0f);
  fill_random_bf16<<<kGrid, kBlock>>>(p.w13, E * 2 * I * H, seed + 3, 2.0f / std::sqrt(float(H)));
  fill_random_bf16<<<kGrid, kBlock>>>(p.w2, E * H * I, seed + 4, 2.0f / std::sqrt(float(I)));
  CHECK_CUDA(cudaGetLastError());
  std::mt19937_64 rng(seed);
  std::vector<int32_t> idx(T * K);
  std::vector<float> w(T * K);
  std::vector<int32_t> perm(E);
  std::iota(perm.begin(), perm.end(), 0);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < K; ++j) {  // partial Fisher-Yates: K distinct experts
      const int64_t pick = j + static_cast<int64_t>(uni(rng) * (E - j));
      std::swap(perm[j], perm[std::min(pick, E - 1)]);
      idx[t * K + j] = all_to_one ? 3 % E : perm[j];
      if (uni(rng) < masked_fraction) idx[t * K + j] = -1;
      w[t * K + j] = static_cast<float>(0.05 + uni(rng));
    }
  }
  p.idx = device_upload(idx);
  p.topk_w = device_upload(w);
  return p;
}

void release_layer_problem(LayerProblem& p) {
  for (void* q : {(void*)p.x, (void*)p.dy, (void*)p.w13, (void*)p.w2, (void*)p.idx, (void*)p.topk_w}) CHECK_CUDA(cudaFree(q));
}

struct Grads {
  bf16* dx;
  float* d_topk_w;
  void* dw13;
  void* dw2;
  size_t grad_elem;
};

Grads alloc_grads(const LayerProblem& p, bool bf16_grads) {
  const auto& c = p.config;
  Grads g;
  g.grad_elem = bf16_grads ? 2 : 4;
  g.dx = device_alloc<bf16>(p.T * c.hidden);
  g.d_topk_w = device_alloc<float>(p.T * c.top_k);
  g.dw13 = device_alloc<char>(c.num_experts * 2 * c.intermediate * c.hidden * g.grad_elem);
  g.dw2 = device_alloc<char>(c.num_experts * c.hidden * c.intermediate * g.grad_elem);
  return g;
}
void free_grads(Grads& g) {
  for (void* q : {(void*)g.dx, (void*)g.d_topk_w, g.dw13, g.dw2}) CHECK_CUDA(cudaFree(q));
}
void poison_grads(const LayerProblem& p, const Grads& g) {
  const auto& c = p.config;
  CHECK_CUDA(cudaMemset(g.dx, 0xFF, p.T * c.hidden * 2));
  CHECK_CUDA(cudaMemset(g.d_topk_w, 0xFF, p.T * c.top_k * 4));
  CHECK_CUDA(cudaMemset(g.dw13, 0xFF, c.num_experts * 2 * c.intermediate * c.hidden * g.grad_elem));
  CHECK_CUDA(cudaMemset(g.dw2, 0xFF, c.num_experts * c.hidden * c.intermediate * g.grad_elem));
}

fusemoe::BackwardArgs backward_args(const LayerProblem& p, const Grads& g, bool bf16_grads, bool accumulate,
                                    void* workspace, size_t workspace_bytes) {
  fusemoe::BackwardArgs a;
  a.x = p.x; a.topk_idx = p.idx; a.topk_weights = p.topk_w; a.w13 = p.w13; a.w2 = p.w2; a.dy = p.dy;
  a.dx = g.dx; a.d_topk_weights = g.d_topk_w; a.dw13 = g.dw13; a.dw2 = g.dw2;
  a.weight_grad_dtype = bf16_grads ? fusemoe::WeightGradDtype::kBFloat16 : fusemoe::WeightGradDtype::kFloat32;
  a.accumulate_weight_grads = accumulate;
  a.num_tokens = p.T; a.workspace = workspace; a.workspace_bytes = workspace_bytes;
  return a;
}

// Relative L2 error of `out` against `ref` (same element type), NaN counted.
template <typename T>
__global__ void l2_kernel(const T* out, const T* ref, int64_t n, double* sums, unsigned long long* nan_count) {
  double dd = 0, yy = 0, xy = 0, xx = 0;
  unsigned long long nans = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const double x = load_as_float(out + i), y = load_as_float(ref + i);
    if (!(x == x)) { ++nans; continue; }
    dd += (x - y) * (x - y); yy += y * y; xy += x * y; xx += x * x;
  }
  for (int d = 16; d > 0; d /= 2) {
    dd += __shfl_xor_sync(~0u, dd, d); yy += __shfl_xor_sync(~0u, yy, d);
    xy += __shfl_xor_sync(~0u, xy, d); xx += __shfl_xor_sync(~0u, xx, d);
    nans += __shfl_xor_sync(~0u, nans, d);
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(&sums[0], dd); atomicAdd(&sums[1], yy); atomicAdd(&sums[2], xy); atomicAdd(&sums[3], xx);
    atomicAdd(nan_count, nans);
  }
}

struct L2 {
  double rel, calc_diff;
  unsigned long long nans;
};

L2 rel_l2(const void* out, const void* ref, int64_t n, bool is_bf16) {
  double* sums = device_alloc<double>(4);
  unsigned long long* nans = device_alloc<unsigned long long>(1);
  CHECK_CUDA(cudaMemset(sums, 0, 4 * sizeof(double)));
  CHECK_CUDA(cudaMemset(nans, 0, sizeof(*nans)));
  if (n > 0) {
    if (is_bf16) l2_kernel<bf16><<<kGrid, kBlock>>>(static_cast<const bf16*>(out), static_cast<const bf16*>(ref), n, sums, nans);
    else l2_kernel<float><<<kGrid, kBlock>>>(static_cast<const float*>(out), static_cast<const float*>(ref), n, sums, nans);
  }
  CHECK_CUDA(cudaGetLastError());
  double h[4];
  L2 r{};
  CHECK_CUDA(cudaMemcpy(h, sums, sizeof(h), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(&r.nans, nans, sizeof(r.nans), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(sums));
  CHECK_CUDA(cudaFree(nans));
  r.rel = h[1] > 0 ? std::sqrt(h[0] / h[1]) : std::sqrt(h[0]);
  r.calc_diff = 1.0 - 2.0 * h[2] / std::max(h[3] + h[1], 1e-300);
  return r;
}

void check_launcher(const char* name, LayerProblem& p, bool bf16_grads) {
  const auto& c = p.config;
  std::printf("launcher %s: T=%lld K=%lld E=%lld H=%lld I=%lld%s, %s weight grads\n", name, (long long)p.T,
              (long long)c.top_k, (long long)c.num_experts, (long long)c.hidden, (long long)c.intermediate,
              c.use_swiglu_clamp ? " clamp 1.5" : "", bf16_grads ? "bf16" : "fp32");
  const size_t ws_fused = fusemoe::fused_backward_workspace_bytes(c, /*z_saved=*/false);
  const size_t ws_ref = std::max(fusemoe::workspace_bytes(c, fusemoe::Impl::kReferenceFp32),
                                 fusemoe::workspace_bytes(c, fusemoe::Impl::kUnfused));
  void* ws = device_alloc<char>(std::max(ws_fused, ws_ref));
  Grads ref = alloc_grads(p, bf16_grads), unf = alloc_grads(p, bf16_grads), fus = alloc_grads(p, bf16_grads),
        again = alloc_grads(p, bf16_grads);
  try {
    fusemoe::backward(c, fusemoe::Impl::kReferenceFp32, backward_args(p, ref, bf16_grads, false, ws, ws_ref));
    fusemoe::backward(c, fusemoe::Impl::kUnfused, backward_args(p, unf, bf16_grads, false, ws, ws_ref));
  } catch (const std::exception& e) {
    std::printf("    FAIL: reference backward threw: %s\n", e.what());
    ++g_failures;
    return;
  }
  wait_device("reference backward");
  for (Grads* g : {&fus, &again}) {
    CHECK_CUDA(cudaMemset(ws, 0xFF, ws_fused));
    poison_grads(p, *g);
    fusemoe::fused_backward(c, backward_args(p, *g, bf16_grads, false, ws, ws_fused));
    wait_device("fused_backward");
  }
  const int64_t T = p.T, K = c.top_k, H = c.hidden, I = c.intermediate, E = c.num_experts;
  struct Item {
    const char* what;
    void *f, *u, *r, *a;
    int64_t n;
    bool is_bf16;
  } items[] = {
      {"dx", fus.dx, unf.dx, ref.dx, again.dx, T * H, true},
      {"d_topk_weights", fus.d_topk_w, unf.d_topk_w, ref.d_topk_w, again.d_topk_w, T * K, false},
      {"dw13", fus.dw13, unf.dw13, ref.dw13, again.dw13, E * 2 * I * H, bf16_grads},
      {"dw2", fus.dw2, unf.dw2, ref.dw2, again.dw2, E * H * I, bf16_grads},
  };
  for (const Item& it : items) {
    const L2 ef = rel_l2(it.f, it.r, it.n, it.is_bf16), eu = rel_l2(it.u, it.r, it.n, it.is_bf16);
    const unsigned long long diff = different_bytes(it.f, it.a, it.n * (it.is_bf16 ? 2 : 4) / 4 * 4);
    const double bound = 2.0 * eu.rel + 1e-3;
    const bool ok = ef.nans == 0 && ef.rel <= bound && diff == 0;
    std::printf("    %-16s %s fused rel_l2 %.2e (calc_diff %.2e)  unfused %.2e  bound %.2e  NaN %llu  rerun diff %llu\n",
                it.what, ok ? "ok  " : "FAIL", ef.rel, ef.calc_diff, eu.rel, bound, ef.nans, diff);
    if (!ok) ++g_failures;
  }
  // 20 calls in a row on a non-default stream, then a CUDA-graph capture of the call replayed:
  // every output bitwise equal to the first call's.
  {
    cudaStream_t stream;
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    Grads rep = alloc_grads(p, bf16_grads);
    auto diff_all = [&](const Grads& a) {
      return different_bytes(a.dx, fus.dx, T * H * 2) + different_bytes(a.d_topk_w, fus.d_topk_w, T * K * 4) +
             different_bytes(a.dw13, fus.dw13, E * 2 * I * H * fus.grad_elem) +
             different_bytes(a.dw2, fus.dw2, E * H * I * fus.grad_elem);
    };
    fusemoe::BackwardArgs args = backward_args(p, rep, bf16_grads, false, ws, ws_fused);
    args.stream = stream;
    unsigned long long repeat_diff = 0;
    for (int i = 0; i < 20; ++i) {
      poison_grads(p, rep);
      fusemoe::fused_backward(c, args);
      wait_device("fused_backward repeat", 30.0, stream);
      repeat_diff += diff_all(rep);
    }
    poison_grads(p, rep);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    fusemoe::fused_backward(c, args);
    CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
    CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    wait_device("graph replay", 30.0, stream);
    const unsigned long long graph_diff = diff_all(rep);
    CHECK_CUDA(cudaGraphExecDestroy(exec));
    CHECK_CUDA(cudaGraphDestroy(graph));
    free_grads(rep);
    CHECK_CUDA(cudaStreamDestroy(stream));
    char what[128];
    std::snprintf(what, sizeof(what), "20 repeated calls differ (%llu words) or graph replay differs (%llu words)",
                  repeat_diff, graph_diff);
    if (expect(repeat_diff == 0 && graph_diff == 0, what)) {
      std::printf("    determinism      ok   20 repeated calls and a CUDA-graph replay bitwise equal\n");
    }
  }
  // Accumulate onto the first result: fp32 gradients must come out exactly doubled.
  if (!bf16_grads) {
    CHECK_CUDA(cudaMemcpy(again.dw13, fus.dw13, E * 2 * I * H * 4, cudaMemcpyDeviceToDevice));
    CHECK_CUDA(cudaMemcpy(again.dw2, fus.dw2, E * H * I * 4, cudaMemcpyDeviceToDevice));
    fusemoe::fused_backward(c, backward_args(p, again, false, true, ws, ws_fused));
    wait_device("fused_backward accumulate");
    const unsigned long long bad = run_count([&](unsigned long long* cnt) {
      count_not_doubled<<<kGrid, kBlock>>>(static_cast<float*>(again.dw13), static_cast<float*>(fus.dw13), E * 2 * I * H, cnt);
      count_not_doubled<<<kGrid, kBlock>>>(static_cast<float*>(again.dw2), static_cast<float*>(fus.dw2), E * H * I, cnt);
    });
    char what[96];
    std::snprintf(what, sizeof(what), "accumulate mode is not exactly 2x (%llu elements)", bad);
    if (expect(bad == 0, what)) std::printf("    accumulate       ok   fp32 gradients exactly doubled\n");
  }
  for (Grads* g : {&ref, &unf, &fus, &again}) free_grads(*g);
  CHECK_CUDA(cudaFree(ws));
}

// ====================================================================== part 3: timing
void time_kernels(KernelProblem& pb, const char* name) {
  const Shape& s = pb.s;
  const double R = double(pb.rt.R), H = double(s.H), I = double(s.I);
  Timer timer(2, 15);
  const double t_z = timer.median_ms("z", [&] { pb.recompute_z(); });
  const double t_d1 = timer.median_ms("dgrad1", [&] { pb.dgrad_swiglu(); });  // width by shape
  const double t_d1n = timer.median_ms("dgrad1 BN128", [&] { pb.dgrad_swiglu(128); });
  const double t_d1w = timer.median_ms("dgrad1 BN256", [&] { pb.dgrad_swiglu(256); });
  const double t_red = timer.median_ms("reduce", [&] { pb.router_reduce(); });
  const double t_d2 = timer.median_ms("dgrad2", [&] { pb.dgrad_scatter(); });
  const double t_w2 = timer.median_ms("dW2", [&] { pb.weight_grad(0, false, false); });
  const double t_w13 = timer.median_ms("dW13", [&] { pb.weight_grad(1, false, false); });
  const double t_w2b = timer.median_ms("dW2 bf16", [&] { pb.weight_grad(0, true, false); });
  const double t_w13b = timer.median_ms("dW13 bf16", [&] { pb.weight_grad(1, true, false); });
  auto tf = [](double flop, double ms) { return flop / (ms * 1e-3) / 1e12; };
  const double f_z = 2 * R * H * 2 * I, f_d1 = 2 * R * H * I, f_d2 = 2 * R * 2 * I * H, f_w2 = 2 * R * H * I,
               f_w13 = 2 * R * 2 * I * H;
  const double total = t_z + t_d1 + t_red + t_d2 + t_w2 + t_w13;
  std::printf("  timing %s (R=%lld uniform)\n", name, (long long)pb.rt.R);
  std::printf("    recompute z    %.3f ms %4.0f TF/s\n", t_z, tf(f_z, t_z));
  std::printf("    dgrad1+SwiGLU  %.3f ms %4.0f TF/s (BN=%d by shape)   BN=128 %.3f ms %4.0f TF/s   BN=256 %.3f ms %4.0f TF/s\n",
              t_d1, tf(f_d1, t_d1), fusemoe::sm90_dgrad_swiglu_block_n(s.H), t_d1n, tf(f_d1, t_d1n), t_d1w,
              tf(f_d1, t_d1w));
  std::printf("    router reduce  %.3f ms\n", t_red);
  std::printf("    dgrad2 scatter %.3f ms %4.0f TF/s\n", t_d2, tf(f_d2, t_d2));
  std::printf("    dW2 fp32       %.3f ms %4.0f TF/s   bf16 %.3f ms %4.0f TF/s\n", t_w2, tf(f_w2, t_w2), t_w2b, tf(f_w2, t_w2b));
  std::printf("    dW13 fp32      %.3f ms %4.0f TF/s   bf16 %.3f ms %4.0f TF/s\n", t_w13, tf(f_w13, t_w13), t_w13b,
              tf(f_w13, t_w13b));
  std::printf("    GEMMs sum (fp32 grads) %.3f ms: %.0f TF/s useful (12 H I R), %.0f TF/s executed (16 H I R)\n", total,
              tf(12 * H * I * R, total), tf(16 * H * I * R, total));
  std::printf("| %s | %.3f | %.0f | %.3f | %.0f | %.3f | %.0f | %.3f | %.0f | %.3f | %.0f | %.3f | %.0f |\n", name, t_z,
              tf(f_z, t_z), t_d1, tf(f_d1, t_d1), t_d2, tf(f_d2, t_d2), t_w2, tf(f_w2, t_w2), t_w13, tf(f_w13, t_w13),
              total, tf(12 * H * I * R, total));
}

void time_launcher(LayerProblem& p, const char* name) {
  const auto& c = p.config;
  const size_t ws_fused = fusemoe::fused_backward_workspace_bytes(c, /*z_saved=*/false);
  const size_t ws_unf = fusemoe::workspace_bytes(c, fusemoe::Impl::kUnfused);
  void* ws = device_alloc<char>(std::max(ws_fused, ws_unf));
  Grads g = alloc_grads(p, false);
  Timer timer(2, 15);
  const double t_f = timer.median_ms("fused_backward", [&] {
    fusemoe::fused_backward(c, backward_args(p, g, false, false, ws, ws_fused));
  });
  const double t_fb = timer.median_ms("fused_backward bf16", [&] {
    fusemoe::fused_backward(c, backward_args(p, g, true, false, ws, ws_fused));
  });
  const double t_u = timer.median_ms("unfused backward", [&] {
    fusemoe::backward(c, fusemoe::Impl::kUnfused, backward_args(p, g, false, false, ws, ws_unf));
  });
  const double useful = 12.0 * c.hidden * c.intermediate * double(p.T * c.top_k);
  auto tf = [&](double ms) { return useful / (ms * 1e-3) / 1e12; };
  std::printf("  backward %s T=%lld: fused %.3f ms %.0f TF/s (bf16 grads %.3f ms %.0f TF/s) | unfused %.3f ms %.0f TF/s"
              " | speedup %.2fx\n",
              name, (long long)p.T, t_f, tf(t_f), t_fb, tf(t_fb), t_u, tf(t_u), t_u / t_f);
  free_grads(g);
  CHECK_CUDA(cudaFree(ws));
}

// The fused backward's steps launched one by one (the sequence of fused_backward), with events
// between them: where the time of the whole call goes. Random top-8 routing, median of 7.
void time_stages(LayerProblem& p, const char* name) {
  const auto& c = p.config;
  const int64_t T = p.T, K = c.top_k, E = c.num_experts, H = c.hidden, I = c.intermediate, S = T * K;
  char* plan_mem = device_alloc<char>(fusemoe::routing_plan_bytes(T, K, E));
  fusemoe::RoutingPlan plan;
  fusemoe::carve_routing_plan(plan_mem, T, K, E, &plan);
  bf16* xs = device_alloc<bf16>(S * H);
  bf16* dys = device_alloc<bf16>(S * H);
  bf16* z = device_alloc<bf16>(S * 2 * I);
  bf16* dz = device_alloc<bf16>(S * 2 * I);
  bf16* wh = device_alloc<bf16>(S * I);
  bf16* dx_slots = device_alloc<bf16>(S * H);
  const int64_t num_n_tiles = fusemoe::sm90_dgrad_swiglu_num_n_tiles(I, fusemoe::sm90_dgrad_swiglu_block_n(H));
  float* partials = device_alloc<float>(S * num_n_tiles);
  Grads g = alloc_grads(p, false);
  constexpr int kSteps = 9;
  const char* step_names[kSteps] = {"routing", "gather x, dy", "recompute z", "dgrad1+SwiGLU", "router reduce",
                                    "dgrad2 scatter", "combine dx", "dW2 fp32", "dW13 fp32"};
  cudaEvent_t ev[kSteps + 1];
  for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  Timer timer(2, 15);  // for its L2 flush buffer
  std::vector<std::vector<float>> ms(kSteps);
  const int32_t* num_rows = plan.expert_offsets + E;
  for (int rep = 0; rep < 9; ++rep) {
    CHECK_CUDA(cudaMemsetAsync(timer.flush, rep & 0xFF, Timer::kFlushBytes));
    CHECK_CUDA(cudaEventRecord(ev[0]));
    fusemoe::launch_routing(p.idx, T, K, E, plan, nullptr, nullptr);
    CHECK_CUDA(cudaEventRecord(ev[1]));
    fusemoe::launch_gather_rows_device_count(p.x, plan.row_slot, num_rows, S, K, H, xs, nullptr);
    fusemoe::launch_gather_rows_device_count(p.dy, plan.row_slot, num_rows, S, K, H, dys, nullptr);
    CHECK_CUDA(cudaEventRecord(ev[2]));
    fusemoe::Sm90RecomputeZParams zp;
    zp.xs = xs; zp.w13 = p.w13; zp.z = z; zp.expert_offsets = plan.expert_offsets;
    zp.max_rows = S; zp.hidden = H; zp.intermediate = I; zp.num_experts = E;
    fusemoe::launch_sm90_recompute_z(zp);
    CHECK_CUDA(cudaEventRecord(ev[3]));
    fusemoe::Sm90DgradSwigluParams d1;
    d1.dys = dys; d1.w2 = p.w2; d1.z = z; d1.expert_offsets = plan.expert_offsets; d1.row_slot = plan.row_slot;
    d1.topk_weights = p.topk_w; d1.dz = dz; d1.wh = wh; d1.router_partials = partials;
    d1.max_rows = S; d1.hidden = H; d1.intermediate = I; d1.num_experts = E; d1.num_slots = S;
    fusemoe::launch_sm90_dgrad_swiglu(d1);
    CHECK_CUDA(cudaEventRecord(ev[4]));
    fusemoe::launch_router_grad_reduce(partials, num_n_tiles, plan.slot_row, S, g.d_topk_w, nullptr);
    CHECK_CUDA(cudaEventRecord(ev[5]));
    fusemoe::Sm90DgradScatterParams d2;
    d2.dz = dz; d2.w13 = p.w13; d2.dx_slots = dx_slots; d2.expert_offsets = plan.expert_offsets;
    d2.row_slot = plan.row_slot; d2.max_rows = S; d2.hidden = H; d2.intermediate = I; d2.num_experts = E;
    d2.num_slots = S;
    fusemoe::launch_sm90_dgrad_scatter(d2);
    CHECK_CUDA(cudaEventRecord(ev[6]));
    fusemoe::launch_combine_slots(dx_slots, plan.slot_row, T, K, H, g.dx, nullptr);
    CHECK_CUDA(cudaEventRecord(ev[7]));
    fusemoe::Sm90WeightGradParams w;
    w.act_m = dys; w.act_n = wh; w.grad = g.dw2; w.expert_offsets = plan.expert_offsets; w.max_rows = S;
    w.m = H; w.n = I; w.num_experts = E;
    fusemoe::launch_sm90_weight_grad(w);
    CHECK_CUDA(cudaEventRecord(ev[8]));
    w.act_m = dz; w.act_n = xs; w.grad = g.dw13; w.m = 2 * I; w.n = H;
    fusemoe::launch_sm90_weight_grad(w);
    CHECK_CUDA(cudaEventRecord(ev[9]));
    wait_device("stages");
    if (rep < 2) continue;  // warm-up
    for (int i = 0; i < kSteps; ++i) {
      float t = 0;
      CHECK_CUDA(cudaEventElapsedTime(&t, ev[i], ev[i + 1]));
      ms[i].push_back(t);
    }
  }
  std::vector<int32_t> counts(E);
  CHECK_CUDA(cudaMemcpy(counts.data(), plan.expert_counts, E * 4, cudaMemcpyDeviceToHost));
  int64_t tiles = 0, rows = 0;
  for (int32_t n : counts) { tiles += (n + 127) / 128; rows += n; }
  std::printf("  stages %s T=%lld (R=%lld, %lld row tiles of 128 against %lld if every expert held R/E rows):\n    ",
              name, (long long)T, (long long)rows, (long long)tiles, (long long)((rows / E + 127) / 128 * E));
  double total = 0;
  for (int i = 0; i < kSteps; ++i) {
    std::sort(ms[i].begin(), ms[i].end());
    const double m = ms[i][ms[i].size() / 2];
    total += m;
    std::printf("%s %.3f | ", step_names[i], m);
  }
  std::printf("sum %.3f ms\n", total);
  for (auto& e : ev) CHECK_CUDA(cudaEventDestroy(e));
  free_grads(g);
  for (void* q : {(void*)plan_mem, (void*)xs, (void*)dys, (void*)z, (void*)dz, (void*)wh, (void*)dx_slots,
                  (void*)partials})
    CHECK_CUDA(cudaFree(q));
}

struct Case {
  std::string name;
  Shape s;
  std::vector<int> counts;  // empty: random (multinomial) over `rows` rows
  int64_t rows = -1;
  bool clamp = false;
  bool large = false;
  bool time = false;
};

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  bool timing = true, large = true, e2e = true, quick = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--no-timing")) timing = false;
    else if (!std::strcmp(argv[i], "--no-large")) large = false;
    else if (!std::strcmp(argv[i], "--no-e2e")) e2e = false;
    else if (!std::strcmp(argv[i], "--quick")) { quick = true; timing = false; large = false; e2e = false; }
    else {
      std::printf("unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  if (const int skip = require_sm90_or_skip()) return skip;

  std::vector<Case> cases = {
      {"small odd counts", {100, 8, 8, 256, 128}, {0, 1, 7, 199, 0, 128, 129, 64}},
      {"small random", {333, 8, 8, 256, 128}, {}, 2000},
      {"one expert holds all", {300, 8, 8, 256, 128}, {0, 0, 0, 2400, 0, 0, 0, 0}},
      {"H384 I192 clamp", {257, 4, 8, 384, 192}, {}, 1000, true},
      {"single row", {1, 1, 8, 256, 128}, {0, 0, 0, 0, 0, 1, 0, 0}},
      {"no rows", {16, 8, 8, 256, 128}, {0, 0, 0, 0, 0, 0, 0, 0}},
      {"E1024 random", {512, 8, 1024, 256, 128}, {}, 3000},
      {"30B R32768 random", {4096, 8, 128, 2048, 768}, {}, -1, false, true},
      {"30B R32768 uniform", {4096, 8, 128, 2048, 768}, std::vector<int>(128, 256), -1, false, true, true},
      {"30B R131072 uniform", {16384, 8, 128, 2048, 768}, std::vector<int>(128, 1024), -1, false, true, true},
      {"235B R32768 uniform", {4096, 8, 128, 4096, 1536}, std::vector<int>(128, 256), -1, false, true, true},
      {"235B R131072 uniform", {16384, 8, 128, 4096, 1536}, std::vector<int>(128, 1024), -1, false, true, true},
  };
  if (quick) cases.resize(4);

  std::mt19937_64 rng(20261130);
  uint64_t seed = 5000;
  std::printf("\n== part 1: kernels against the fp32 GPU reference\n");
  for (const Case& c : cases) {
    if (c.large && !large) continue;
    std::vector<int> counts = c.counts;
    if (counts.empty()) counts = random_counts(c.s.E, c.rows >= 0 ? c.rows : c.s.T * c.s.K, rng);
    KernelProblem pb;
    pb.s = c.s;
    pb.rt = make_routing(c.s, counts, rng);
    pb.clamp = c.clamp;
    pb.allocate(seed += 10);
    const int empty = static_cast<int>(std::count(counts.begin(), counts.end(), 0));
    std::printf("case %s: T=%lld K=%lld E=%lld H=%lld I=%lld R=%lld (empty experts %d, max count %d)%s\n",
                c.name.c_str(), (long long)c.s.T, (long long)c.s.K, (long long)c.s.E, (long long)c.s.H, (long long)c.s.I,
                (long long)pb.rt.R, empty, *std::max_element(counts.begin(), counts.end()), c.clamp ? " clamp 1.5" : "");
    const int before = g_failures;
    try {
      // The big uniform cases are timed only (the 30B random case checks that size).
      if (!c.time || c.name == "30B R32768 uniform") check_kernels(pb, true);
      if (c.time && timing && g_failures == before) time_kernels(pb, c.name.c_str());
    } catch (const std::exception& e) {
      std::printf("    FAIL: exception: %s\n", e.what());
      ++g_failures;
    }
    pb.release();
  }

  if (e2e) {
    std::printf("\n== part 2: fused_backward against Impl::kReferenceFp32 (bound: 2 x Impl::kUnfused error + 1e-3)\n");
    struct E2eCase {
      const char* name;
      int64_t T, K, E, H, I;
      double masked;
      bool all_to_one, clamp, bf16_grads, large;
    } e2e_cases[] = {
        {"small masked", 199, 4, 8, 256, 128, 0.2, false, false, false, false},
        {"small masked bf16 grads", 199, 4, 8, 256, 128, 0.2, false, false, true, false},
        {"all slots to expert 3", 97, 4, 8, 256, 128, 0.0, true, false, false, false},
        {"odd H384 I192 clamp", 257, 2, 16, 384, 192, 0.1, false, true, false, false},
        {"T=1", 1, 8, 16, 256, 128, 0.0, false, false, false, false},
        {"T=0", 0, 8, 16, 256, 128, 0.0, false, false, false, false},
        {"30B T4096", 4096, 8, 128, 2048, 768, 0.0, false, false, false, true},
    };
    for (const E2eCase& c : e2e_cases) {
      if (c.large && !large) continue;
      LayerProblem p = make_layer_problem(c.T, c.K, c.E, c.H, c.I, c.masked, c.all_to_one, c.clamp, seed += 10);
      try {
        check_launcher(c.name, p, c.bf16_grads);
      } catch (const std::exception& e) {
        std::printf("    FAIL: exception: %s\n", e.what());
        ++g_failures;
      }
      release_layer_problem(p);
    }
  }

  if (timing && e2e && g_failures == 0) {
    std::printf("\n== part 3: whole backward, uniform random top-8 routing (useful FLOPs 12 H I per row)\n");
    struct TimeCase {
      const char* name;
      int64_t T, H, I;
    } time_cases[] = {{"30B", 4096, 2048, 768}, {"30B", 16384, 2048, 768}, {"235B", 4096, 4096, 1536},
                      {"235B", 16384, 4096, 1536}};
    for (const TimeCase& c : time_cases) {
      LayerProblem p = make_layer_problem(c.T, 8, 128, c.H, c.I, 0.0, false, false, seed += 10);
      try {
        time_launcher(p, c.name);
        time_stages(p, c.name);
      } catch (const std::exception& e) {
        std::printf("    FAIL: exception: %s\n", e.what());
        ++g_failures;
      }
      release_layer_problem(p);
    }
  }
  std::printf("\n%s: %d failure(s)\n", g_failures ? "FAILED" : "PASSED", g_failures);
  return g_failures ? 1 : 0;
}

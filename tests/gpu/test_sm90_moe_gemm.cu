// Standalone test + benchmark of the sm_90a grouped GEMMs (src/kernels/sm90_moe_gemm.h):
//   gate/up + SwiGLU  h_r = silu(a_r Wg_e^T) * (a_r Wu_e^T)          [R, I]
//   down + weight     ys[slot_r] = w[slot_r] * (h_r W2_e^T)           [T*K, H]
// a_r = x[row_slot[r] / K]: read straight from x (direct dispatch) or from the pool xs that the
// library's gather kernel builds (pool dispatch). Checks against an fp32 GPU reference computed
// from the same bf16 inputs (tiled naive GEMM), with outputs NaN-poisoned (0xFF bytes) first:
// every row of an expert must be written and match (|out - ref| <= rtol |ref| + atol, NaN
// fails), every other row must keep its poison, direct and pool dispatch must give the same
// bits, and a second launch must be bitwise equal. Then times both kernels at the Qwen3 shapes
// (direct dispatch against gather + pool) against cuBLAS grouped GEMM
// (cublasGemmGroupedBatchedEx) and a dense cuBLAS GEMM of the same size, measured in the same
// run (median of 20 after warm-up, L2 flushed before each launch).
//
// Legend: T tokens, K top-k, E experts, H hidden, I intermediate, R routed rows (pool rows in
// use), R_max = T*K pool capacity. Exit 0 pass, 1 fail, 77 "skipped: no sm_90 GPU".
// Usage: test_sm90_moe_gemm [--no-timing] [--no-large] [--only NAME_SUBSTRING]
//        [--no-check]  (with --only: one launch of each kernel and nothing else, for profilers)
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/moe_elementwise.h"
#include "kernels/sm90_moe_gemm.h"
#include "sm90_standalone.h"  // this folder

#define CHECK_CUBLAS(expr)                                                                     \
  do {                                                                                         \
    cublasStatus_t status_ = (expr);                                                           \
    if (status_ != CUBLAS_STATUS_SUCCESS) {                                                    \
      std::fprintf(stderr, "%s:%d: %s failed: status %d\n", __FILE__, __LINE__, #expr,         \
                   static_cast<int>(status_));                                                 \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

using bf16 = __nv_bfloat16;

// ------------------------------------------------------------------------------ device helpers
// out[r, c] = sum_k A[r, k] * B[e(r) * b_rows_per_expert + c, k] in fp32, for r < R = offsets[E],
// c < N. 64 x 64 output tile per block (16 x 16 threads, 4 x 4 each); a tile spanning several
// experts is computed once per expert and each row stored under its own expert.
constexpr int kRefTile = 64, kRefK = 32;
__global__ void __launch_bounds__(256) ref_grouped_gemm(const bf16* A, const bf16* B, const int* offsets,
                                                        int E, int N, int K, int64_t b_rows_per_expert,
                                                        float* out) {
  __shared__ float As[kRefTile][kRefK + 1];
  __shared__ float Bs[kRefTile][kRefK + 1];
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
        const int r = r0 + rr, c = c0 + rr;
        As[rr][kk] = r < R ? __bfloat162float(A[int64_t(r) * K + k0 + kk]) : 0.0f;
        Bs[rr][kk] = c < N ? __bfloat162float(B[(e * b_rows_per_expert + c) * K + k0 + kk]) : 0.0f;
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

// h_ref[r, c] = silu(g) * u with g = z[r, c], u = z[r, I + c] (optionally clamped), fp32.
__global__ void ref_swiglu(const float* z, int64_t R, int I, int use_clamp, float clamp, float* h_ref) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < R * I; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / I;
    const int c = static_cast<int>(i % I);
    float g = z[r * 2 * I + c], u = z[r * 2 * I + I + c];
    if (use_clamp) {
      g = fminf(g, clamp);
      u = fminf(fmaxf(u, -clamp), clamp);
    }
    h_ref[i] = g / (1.0f + expf(-g)) * u;
  }
}

struct CompareStats {
  unsigned long long bad;
  unsigned long long first_bad;  // min flat index (r * N + c) of a failing element
  double sum_xy, sum_xx, sum_yy;
  float max_abs_err;
};

// Compares out[dest(r), c] (bf16) with scale(r) * ref[r, c] for r < R, c < N, where
// dest(r) = row_index ? row_index[r] : r and scale(r) = row_scale ? row_scale[dest(r)] : 1.
__global__ void compare_rows(const bf16* out, int64_t out_stride, const int* row_index, const float* ref,
                             const float* row_scale, int64_t R, int N, float rtol, float atol,
                             CompareStats* stats) {
  unsigned long long bad = 0, first_bad = ~0ull;
  double sxy = 0, sxx = 0, syy = 0;
  float max_err = 0.0f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < R * N; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / N;
    const int c = static_cast<int>(i % N);
    const int64_t dest = row_index ? row_index[r] : r;
    const float y = ref[i] * (row_scale ? row_scale[dest] : 1.0f);
    const float x = __bfloat162float(out[dest * out_stride + c]);
    const float err = fabsf(x - y);
    if (!(err <= rtol * fabsf(y) + atol)) {
      ++bad;
      first_bad = min(first_bad, static_cast<unsigned long long>(i));
    }
    if (err > max_err) max_err = err;
    sxy += double(x) * y; sxx += double(x) * x; syy += double(y) * y;
  }
  for (int d = 16; d > 0; d /= 2) {
    bad += __shfl_xor_sync(~0u, bad, d);
    first_bad = min(first_bad, __shfl_xor_sync(~0u, first_bad, d));
    sxy += __shfl_xor_sync(~0u, sxy, d); sxx += __shfl_xor_sync(~0u, sxx, d); syy += __shfl_xor_sync(~0u, syy, d);
    max_err = fmaxf(max_err, __shfl_xor_sync(~0u, max_err, d));
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(&stats->bad, bad);
    atomicMin(&stats->first_bad, first_bad);
    atomicAdd(&stats->sum_xy, sxy); atomicAdd(&stats->sum_xx, sxx); atomicAdd(&stats->sum_yy, syy);
    // NaN errors are counted in `bad`; max_abs_err tracks finite ones (non-negative: int order).
    if (max_err == max_err) atomicMax(reinterpret_cast<int*>(&stats->max_abs_err), __float_as_int(max_err));
  }
}

// Counts elements of rows with must_keep[r] != 0 that no longer hold the 0xFFFF poison.
__global__ void count_overwritten(const uint16_t* buf, int64_t rows, int64_t cols, int64_t stride,
                                  const uint8_t* must_keep, unsigned long long* count) {
  unsigned long long n = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * cols; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols;
    if (must_keep[r] && buf[r * stride + i % cols] != 0xFFFFu) ++n;
  }
  if (n) atomicAdd(count, n);
}

__global__ void count_different(const uint16_t* a, const uint16_t* b, int64_t n, unsigned long long* count) {
  unsigned long long d = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    d += a[i] != b[i];
  }
  if (d) atomicAdd(count, d);
}

// ---------------------------------------------------------------------------------- host side
constexpr int kGrid = 2048, kBlock = 256;

// Expert-sorted routing built on the host: counts[e] rows for expert e, drawn from random
// distinct slots of the T*K slot space (the rest are masked); inside an expert, rows are in
// increasing slot order, as the device routing produces them.
struct Routing {
  std::vector<int> counts, offsets, row_slot;
  std::vector<float> topk_w;
  std::vector<uint8_t> slot_unused;  // 1 where a slot got no row
  std::vector<int> slot_row;         // row of each slot, -1 where it has none
  int64_t R = 0, num_slots = 0;
};

Routing make_routing(const Shape& s, const std::vector<int>& counts, std::mt19937_64& rng) {
  Routing rt;
  rt.num_slots = s.T * s.K;
  rt.counts = counts;
  rt.offsets.assign(s.E + 1, 0);
  for (int64_t e = 0; e < s.E; ++e) rt.offsets[e + 1] = rt.offsets[e] + counts[e];
  rt.R = rt.offsets[s.E];
  if (rt.R > rt.num_slots) { std::fprintf(stderr, "bad case: R > T*K\n"); std::exit(1); }
  std::vector<int> slots(rt.num_slots);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  rt.row_slot.assign(slots.begin(), slots.begin() + rt.R);
  for (int64_t e = 0; e < s.E; ++e) std::sort(rt.row_slot.begin() + rt.offsets[e], rt.row_slot.begin() + rt.offsets[e + 1]);
  rt.slot_unused.assign(rt.num_slots, 1);
  for (int slot : rt.row_slot) rt.slot_unused[slot] = 0;
  rt.slot_row.assign(rt.num_slots, -1);
  for (int64_t r = 0; r < rt.R; ++r) rt.slot_row[rt.row_slot[r]] = static_cast<int>(r);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  rt.topk_w.resize(rt.num_slots);
  for (auto& w : rt.topk_w) w = uni(rng);
  return rt;
}

// Device buffers of one problem.
struct Problem {
  Shape s;
  Routing rt;
  bf16 *x, *xs, *w13, *w2, *h, *ys;
  bf16* y;              // [T, H] the fused combine's output
  int *offsets, *row_slot, *slot_row;
  int* combine_pending;  // the fused combine's counters
  int* h_ready;  // readiness counters of the one-launch forward
  float* topk_w;
  uint8_t *h_keep, *ys_keep;  // rows that the kernels must not touch
  bool clamp = false;
  float clamp_value = 0.0f;

  void allocate(uint64_t seed) {
    const int64_t R_max = rt.num_slots;
    x = device_alloc<bf16>(s.T * s.H);
    xs = device_alloc<bf16>(R_max * s.H);
    w13 = device_alloc<bf16>(s.E * 2 * s.I * s.H);
    w2 = device_alloc<bf16>(s.E * s.H * s.I);
    h = device_alloc<bf16>(R_max * s.I);
    ys = device_alloc<bf16>(rt.num_slots * s.H);
    y = device_alloc<bf16>(s.T * s.H);
    combine_pending = device_alloc<int>(fusemoe::sm90_combine_counters(s.T, s.H));
    // Scales keep z and o around 1 so that bf16 rounding, not range, sets the error.
    fill_random_bf16<<<kGrid, kBlock>>>(x, s.T * s.H, seed + 1, 1.0f);
    // Pool rows past R (read by the last tile of the last expert, never stored): random too.
    fill_random_bf16<<<kGrid, kBlock>>>(xs, R_max * s.H, seed + 4, 1.0f);
    fill_random_bf16<<<kGrid, kBlock>>>(w13, s.E * 2 * s.I * s.H, seed + 2, 2.0f / std::sqrt(float(s.H)));
    fill_random_bf16<<<kGrid, kBlock>>>(w2, s.E * s.H * s.I, seed + 3, 4.0f / std::sqrt(float(s.I)));
    CHECK_CUDA(cudaGetLastError());
    offsets = device_upload(rt.offsets);
    row_slot = device_upload(rt.row_slot);
    slot_row = device_upload(rt.slot_row);
    topk_w = device_upload(rt.topk_w);
    std::vector<uint8_t> keep(R_max);
    for (int64_t r = 0; r < R_max; ++r) keep[r] = r >= rt.R;
    h_keep = device_upload(keep);
    ys_keep = device_upload(rt.slot_unused);
    h_ready = device_alloc<int>(fusemoe::sm90_forward_row_blocks(R_max, s.E));
    gather_pool(nullptr);
  }
  // xs[r] = x[row_slot[r] / K] for r < R (the pool dispatch of the earlier pipeline).
  void gather_pool(cudaStream_t stream) const {
    fusemoe::launch_gather_rows_device_count(x, row_slot, offsets + s.E, rt.num_slots, s.K, s.H, xs, stream);
  }
  void release() {
    for (void* p : {(void*)x, (void*)xs, (void*)w13, (void*)w2, (void*)h, (void*)ys, (void*)offsets, (void*)row_slot,
                    (void*)topk_w, (void*)h_keep, (void*)ys_keep, (void*)h_ready, (void*)y, (void*)slot_row,
                    (void*)combine_pending})
      CHECK_CUDA(cudaFree(p));
  }
  fusemoe::Sm90GateUpParams gate_up_params(cudaStream_t stream, bool direct) const {
    fusemoe::Sm90GateUpParams p;
    if (direct) {
      p.sources.x[0] = x; p.sources.num_rows[0] = s.T; p.sources.num_sources = 1;
      p.row_slot = row_slot; p.top_k = s.K;
    } else {
      p.xs = xs;
    }
    p.w13 = w13; p.h = h; p.expert_offsets = offsets;
    p.max_rows = rt.num_slots; p.hidden = s.H; p.intermediate = s.I; p.num_experts = s.E;
    p.use_swiglu_clamp = clamp; p.swiglu_clamp = clamp_value; p.stream = stream;
    return p;
  }
  void launch_gate_up(cudaStream_t stream, bool direct) const {
    fusemoe::launch_sm90_gate_up_swiglu(gate_up_params(stream, direct));
  }
  fusemoe::Sm90DownParams down_params(cudaStream_t stream, int block_n) const {
    fusemoe::Sm90DownParams p;
    p.h = h; p.w2 = w2; p.ys = ys; p.expert_offsets = offsets; p.row_slot = row_slot; p.topk_weights = topk_w;
    p.max_rows = rt.num_slots; p.hidden = s.H; p.intermediate = s.I; p.num_experts = s.E;
    p.num_slots = rt.num_slots; p.block_n = block_n; p.stream = stream;
    return p;
  }
  void launch_down(cudaStream_t stream, int block_n) const {
    fusemoe::launch_sm90_down_weighted(down_params(stream, block_n));
  }
  // The down GEMM with the fused combine: ys as launch_down, and y[t] = sum_j ys[t*K + j].
  void launch_down_combine(cudaStream_t stream, int block_n) const {
    fusemoe::Sm90DownParams p = down_params(stream, block_n);
    p.y = y; p.slot_row = slot_row; p.top_k = s.K; p.combine_pending = combine_pending;
    fusemoe::launch_sm90_down_weighted(p);
  }
  // The combine as its own kernel (what the forward ran before the fused combine).
  void launch_combine_kernel(cudaStream_t stream, bf16* out) const {
    fusemoe::launch_combine_slots(ys, slot_row, s.T, s.K, s.H, out, stream);
  }
  // Both GEMMs in one launch (down tiles wait on their row blocks' readiness counters).
  void launch_both(cudaStream_t stream) const {
    fusemoe::launch_sm90_forward_gemms(gate_up_params(stream, /*direct=*/true), down_params(stream, 256), h_ready);
  }
};

struct CheckResult {
  bool ok;
  std::string text;
};

// Compares (rtol 1e-2, atol 1e-3 * rms(ref)) and prints one line; returns pass/fail.
bool compare_and_report(const char* what, const bf16* out, int64_t out_stride, const int* row_index,
                        const float* ref, const float* row_scale, int64_t R, int64_t N) {
  if (R == 0) {
    std::printf("    %-22s no rows\n", what);
    return true;
  }
  CompareStats* stats = device_alloc<CompareStats>(1);
  CompareStats host{};
  auto run = [&](float atol) {
    host = CompareStats{0, ~0ull, 0, 0, 0, 0.0f};
    CHECK_CUDA(cudaMemcpy(stats, &host, sizeof(host), cudaMemcpyHostToDevice));
    compare_rows<<<kGrid, kBlock>>>(out, out_stride, row_index, ref, row_scale, R, static_cast<int>(N), 1e-2f,
                                    atol, stats);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaMemcpy(&host, stats, sizeof(host), cudaMemcpyDeviceToHost));
  };
  run(INFINITY);  // first pass: sum of ref^2 for the absolute tolerance
  const double rms = std::sqrt(host.sum_yy / double(R * N));
  run(static_cast<float>(1e-3 * rms));
  CHECK_CUDA(cudaFree(stats));
  const double calc_diff = 1.0 - 2.0 * host.sum_xy / std::max(host.sum_xx + host.sum_yy, 1e-300);
  const bool ok = host.bad == 0;
  std::printf("    %-22s %s  bad %llu / %lld  max_abs_err %.3e  rms_ref %.3e  calc_diff %.2e", what,
              ok ? "ok  " : "FAIL", host.bad, static_cast<long long>(R * N), host.max_abs_err, rms, calc_diff);
  if (!ok) std::printf("  first bad (row %lld, col %lld)", (long long)(host.first_bad / N), (long long)(host.first_bad % N));
  std::printf("\n");
  return ok;
}

unsigned long long device_count_overwritten(const bf16* buf, int64_t rows, int64_t cols, const uint8_t* keep) {
  unsigned long long* count = device_alloc<unsigned long long>(1);
  CHECK_CUDA(cudaMemset(count, 0, sizeof(*count)));
  count_overwritten<<<kGrid, kBlock>>>(reinterpret_cast<const uint16_t*>(buf), rows, cols, cols, keep, count);
  CHECK_CUDA(cudaGetLastError());
  unsigned long long host = 0;
  CHECK_CUDA(cudaMemcpy(&host, count, sizeof(host), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(count));
  return host;
}

unsigned long long device_count_different(const bf16* a, const bf16* b, int64_t n) {
  unsigned long long* count = device_alloc<unsigned long long>(1);
  CHECK_CUDA(cudaMemset(count, 0, sizeof(*count)));
  count_different<<<kGrid, kBlock>>>(reinterpret_cast<const uint16_t*>(a), reinterpret_cast<const uint16_t*>(b), n, count);
  CHECK_CUDA(cudaGetLastError());
  unsigned long long host = 0;
  CHECK_CUDA(cudaMemcpy(&host, count, sizeof(host), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(count));
  return host;
}

// Runs both kernels on poisoned outputs and checks them; returns pass/fail.
bool check_problem(Problem& pb) {
  const Shape& s = pb.s;
  const int64_t R = pb.rt.R, R_max = pb.rt.num_slots;
  bool ok = true;
  CHECK_CUDA(cudaMemset(pb.h, 0xFF, R_max * s.I * sizeof(bf16)));
  pb.launch_gate_up(nullptr, /*direct=*/false);
  CHECK_CUDA(cudaDeviceSynchronize());

  float* z_ref = device_alloc<float>(R * 2 * s.I);
  float* h_ref = device_alloc<float>(R * s.I);
  float* o_ref = device_alloc<float>(R * s.H);
  const dim3 ref_block(256);
  if (R > 0) {
    ref_grouped_gemm<<<dim3((2 * s.I + kRefTile - 1) / kRefTile, (R + kRefTile - 1) / kRefTile), ref_block>>>(
        pb.xs, pb.w13, pb.offsets, s.E, 2 * s.I, s.H, 2 * s.I, z_ref);
    ref_swiglu<<<kGrid, kBlock>>>(z_ref, R, s.I, pb.clamp ? 1 : 0, pb.clamp_value, h_ref);
    // The down reference reads the h the kernel wrote, so it checks the down kernel alone.
    ref_grouped_gemm<<<dim3((s.H + kRefTile - 1) / kRefTile, (R + kRefTile - 1) / kRefTile), ref_block>>>(
        pb.h, pb.w2, pb.offsets, s.E, s.H, s.I, s.H, o_ref);
    CHECK_CUDA(cudaGetLastError());
  }
  ok &= compare_and_report("gate/up+SwiGLU h (pool)", pb.h, s.I, nullptr, h_ref, nullptr, R, s.I);
  unsigned long long h_touched = device_count_overwritten(pb.h, R_max, s.I, pb.h_keep);
  if (h_touched) std::printf("    FAIL: %llu elements of h rows >= R were written\n", h_touched);
  ok &= h_touched == 0;

  bf16* h_first = device_alloc<bf16>(R_max * s.I);
  bf16* ys_first = device_alloc<bf16>(R_max * s.H);
  CHECK_CUDA(cudaMemcpy(h_first, pb.h, R_max * s.I * sizeof(bf16), cudaMemcpyDeviceToDevice));
  // Direct dispatch: the same A rows, the same MMA order, so the same bits as the pool run
  // (which also covers the untouched rows: both start from the poison).
  CHECK_CUDA(cudaMemset(pb.h, 0xFF, R_max * s.I * sizeof(bf16)));
  pb.launch_gate_up(nullptr, /*direct=*/true);
  CHECK_CUDA(cudaDeviceSynchronize());
  ok &= compare_and_report("gate/up+SwiGLU h (direct)", pb.h, s.I, nullptr, h_ref, nullptr, R, s.I);
  h_touched = device_count_overwritten(pb.h, R_max, s.I, pb.h_keep);
  if (h_touched) std::printf("    FAIL: %llu elements of h rows >= R were written (direct)\n", h_touched);
  ok &= h_touched == 0;
  const unsigned long long direct_vs_pool = device_count_different(pb.h, h_first, R_max * s.I);
  if (direct_vs_pool) std::printf("    FAIL: direct and pool dispatch differ in %llu elements of h\n", direct_vs_pool);
  ok &= direct_vs_pool == 0;
  for (int block_n : {256, 128}) {
    CHECK_CUDA(cudaMemset(pb.ys, 0xFF, pb.rt.num_slots * s.H * sizeof(bf16)));
    pb.launch_down(nullptr, block_n);
    CHECK_CUDA(cudaDeviceSynchronize());
    char what[64];
    std::snprintf(what, sizeof(what), "down*w ys (BN=%d)", block_n);
    ok &= compare_and_report(what, pb.ys, s.H, pb.row_slot, o_ref, pb.topk_w, R, s.H);
    const unsigned long long ys_touched = device_count_overwritten(pb.ys, pb.rt.num_slots, s.H, pb.ys_keep);
    if (ys_touched) std::printf("    FAIL: %llu elements of unused ys slots were written\n", ys_touched);
    ok &= ys_touched == 0;
    if (block_n == 256) CHECK_CUDA(cudaMemcpy(ys_first, pb.ys, R_max * s.H * sizeof(bf16), cudaMemcpyDeviceToDevice));
  }
  // The fused combine: ys bitwise as the plain down launch of the same width, y bitwise as the
  // combine kernel over that ys (tokens without rows: zeros), every counter back at zero; on
  // NaN-poisoned ys and y, twice per width.
  bf16* y_ref = device_alloc<bf16>(s.T * s.H);
  bf16* ys_plain = device_alloc<bf16>(R_max * s.H);
  const int64_t num_counters = fusemoe::sm90_combine_counters(s.T, s.H);
  for (int block_n : {256, 128}) {
    pb.launch_down(nullptr, block_n);
    pb.launch_combine_kernel(nullptr, y_ref);
    CHECK_CUDA(cudaMemcpy(ys_plain, pb.ys, R_max * s.H * sizeof(bf16), cudaMemcpyDeviceToDevice));
    for (int rep = 0; rep < 2; ++rep) {
      CHECK_CUDA(cudaMemset(pb.ys, 0xFF, R_max * s.H * sizeof(bf16)));
      CHECK_CUDA(cudaMemset(pb.y, 0xFF, s.T * s.H * sizeof(bf16)));
      CHECK_CUDA(cudaMemset(pb.combine_pending, 0x7F, num_counters * sizeof(int)));
      pb.launch_down_combine(nullptr, block_n);
      CHECK_CUDA(cudaDeviceSynchronize());
      const unsigned long long ys_diff = device_count_different(pb.ys, ys_plain, R_max * s.H);
      const unsigned long long y_diff = device_count_different(pb.y, y_ref, s.T * s.H);
      std::vector<int> pending(num_counters);
      CHECK_CUDA(cudaMemcpy(pending.data(), pb.combine_pending, num_counters * sizeof(int), cudaMemcpyDeviceToHost));
      const int64_t num_n_tiles = (s.H + block_n - 1) / block_n;
      int64_t left = 0;
      for (int64_t i = 0; i < s.T * num_n_tiles; ++i) left += pending[i] != 0;
      std::printf("    fused combine (BN=%d, run %d) vs down + combine kernel: ys %llu, y %llu elements differ, "
                  "%lld counters not at zero%s\n", block_n, rep, ys_diff, y_diff, (long long)left,
                  (ys_diff || y_diff || left) ? "  FAIL" : "");
      ok &= ys_diff == 0 && y_diff == 0 && left == 0;
    }
  }
  CHECK_CUDA(cudaFree(y_ref));
  CHECK_CUDA(cudaFree(ys_plain));
  // Determinism: the same launch again must give the same bits.
  pb.launch_gate_up(nullptr, /*direct=*/true);
  pb.launch_down(nullptr, 256);
  CHECK_CUDA(cudaDeviceSynchronize());
  const unsigned long long diff = device_count_different(pb.h, h_first, R_max * s.I) +
                                  device_count_different(pb.ys, ys_first, R_max * s.H);
  if (diff) std::printf("    FAIL: rerun differs in %llu elements\n", diff);
  ok &= diff == 0;
  // The one-launch forward (gate/up and down tiles on one grid, readiness counters) computes
  // the same tiles: the same bits as the two launches, on poisoned outputs, twice.
  for (int rep = 0; rep < 2; ++rep) {
    CHECK_CUDA(cudaMemset(pb.h, 0xFF, R_max * s.I * sizeof(bf16)));
    CHECK_CUDA(cudaMemset(pb.ys, 0xFF, R_max * s.H * sizeof(bf16)));
    pb.launch_both(nullptr);
    CHECK_CUDA(cudaDeviceSynchronize());
    const unsigned long long both_diff = device_count_different(pb.h, h_first, R_max * s.I) +
                                         device_count_different(pb.ys, ys_first, R_max * s.H);
    std::printf("    one launch (gate/up + down, readiness) vs two launches: %llu elements differ%s\n", both_diff,
                both_diff ? "  FAIL" : "");
    ok &= both_diff == 0;
  }
  for (void* p : {(void*)z_ref, (void*)h_ref, (void*)o_ref, (void*)h_first, (void*)ys_first}) CHECK_CUDA(cudaFree(p));
  return ok;
}

// --------------------------------------------------------------------------------- timing
// cuBLAS grouped GEMM of the same problem: C_e [c_e, N] = A_e [c_e, K] * B_e [N, K]^T (bf16 out,
// fp32 compute), one group per non-empty expert. Column-major view: C_e^T = B_e^T(op T) * A_e^T.
struct CublasGrouped {
  std::vector<cublasOperation_t> ta, tb;
  std::vector<int> m, n, k, lda, ldb, ldc, group_size;
  std::vector<float> alpha, beta;
  const void** a_ptrs = nullptr;
  const void** b_ptrs = nullptr;
  void** c_ptrs = nullptr;
  int groups = 0;

  CublasGrouped(const Routing& rt, int64_t E, const bf16* act, const bf16* weight, bf16* out, int64_t N, int64_t K) {
    std::vector<const void*> a, b;
    std::vector<void*> c;
    for (int64_t e = 0; e < E; ++e) {
      if (rt.counts[e] == 0) continue;
      ta.push_back(CUBLAS_OP_T); tb.push_back(CUBLAS_OP_N);
      m.push_back(int(N)); n.push_back(rt.counts[e]); k.push_back(int(K));
      lda.push_back(int(K)); ldb.push_back(int(K)); ldc.push_back(int(N));
      alpha.push_back(1.0f); beta.push_back(0.0f); group_size.push_back(1);
      a.push_back(weight + e * N * K);
      b.push_back(act + int64_t(rt.offsets[e]) * K);
      c.push_back(out + int64_t(rt.offsets[e]) * N);
    }
    groups = static_cast<int>(a.size());
    a_ptrs = reinterpret_cast<const void**>(device_upload(a));
    b_ptrs = reinterpret_cast<const void**>(device_upload(b));
    c_ptrs = reinterpret_cast<void**>(device_upload(c));
  }
  ~CublasGrouped() {
    cudaFree(a_ptrs);
    cudaFree(b_ptrs);
    cudaFree(c_ptrs);
  }
  void run(cublasHandle_t handle) {
    CHECK_CUBLAS(cublasGemmGroupedBatchedEx(handle, ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(),
                                            a_ptrs, CUDA_R_16BF, lda.data(), b_ptrs, CUDA_R_16BF, ldb.data(),
                                            beta.data(), c_ptrs, CUDA_R_16BF, ldc.data(), groups,
                                            group_size.data(), CUBLAS_COMPUTE_32F));
  }
};

void dense_gemm(cublasHandle_t handle, const bf16* act, const bf16* weight, bf16* out, int64_t rows, int64_t N,
                int64_t K) {
  const float alpha = 1.0f, beta = 0.0f;
  CHECK_CUBLAS(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, int(N), int(rows), int(K), &alpha, weight, CUDA_R_16BF,
                            int(K), act, CUDA_R_16BF, int(K), &beta, out, CUDA_R_16BF, int(N), CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
}

// ms[]: gate/up direct, gate/up pool, gather (pool dispatch), cuBLAS grouped gate/up, dense
// gate/up, down BN256, down BN128, cuBLAS grouped down, dense down.
struct TimingRow {
  std::string name;
  double ms[10];
};

void time_problem(Problem& pb, cublasHandle_t handle, std::vector<TimingRow>& table, const std::string& name) {
  const Shape& s = pb.s;
  const int64_t R = pb.rt.R;
  Timer timer;
  bf16* scratch = device_alloc<bf16>(R * std::max(2 * s.I, s.H));
  CublasGrouped grouped_a(pb.rt, s.E, pb.xs, pb.w13, scratch, 2 * s.I, s.H);
  CublasGrouped grouped_b(pb.rt, s.E, pb.h, pb.w2, scratch, s.H, s.I);
  TimingRow row{name, {}};
  row.ms[0] = timer.median_ms("gate/up direct", [&] { pb.launch_gate_up(nullptr, /*direct=*/true); });
  row.ms[1] = timer.median_ms("gate/up pool", [&] { pb.launch_gate_up(nullptr, /*direct=*/false); });
  row.ms[2] = timer.median_ms("gather pool", [&] { pb.gather_pool(nullptr); });
  row.ms[3] = timer.median_ms("cuBLAS grouped gate/up", [&] { grouped_a.run(handle); });
  row.ms[4] = timer.median_ms("cuBLAS dense gate/up", [&] { dense_gemm(handle, pb.xs, pb.w13, scratch, R, 2 * s.I, s.H); });
  row.ms[5] = timer.median_ms("down 256", [&] { pb.launch_down(nullptr, 256); });
  row.ms[6] = timer.median_ms("down 128", [&] { pb.launch_down(nullptr, 128); });
  row.ms[7] = timer.median_ms("cuBLAS grouped down", [&] { grouped_b.run(handle); });
  row.ms[8] = timer.median_ms("cuBLAS dense down", [&] { dense_gemm(handle, pb.h, pb.w2, scratch, R, s.H, s.I); });
  // Two launches timed before and after the one launch (the clock drifts as the GPU warms).
  auto two = [&] {
    pb.launch_gate_up(nullptr, /*direct=*/true);
    pb.launch_down(nullptr, 256);
  };
  const double two_before = timer.median_ms("two launches", two);
  row.ms[9] = timer.median_ms("one launch", [&] { pb.launch_both(nullptr); });
  const double two_launches = 0.5 * (two_before + timer.median_ms("two launches", two));
  // Down + combine: the combine kernel after the down launch, against the fused combine
  // (timed before and after for the same drift reason).
  auto separate = [&] {
    pb.launch_down(nullptr, 256);
    pb.launch_combine_kernel(nullptr, pb.y);
  };
  const double separate_before = timer.median_ms("down + combine kernel", separate);
  const double fused_combine = timer.median_ms("down fused combine", [&] { pb.launch_down_combine(nullptr, 256); });
  const double separate_ms = 0.5 * (separate_before + timer.median_ms("down + combine kernel", separate));
  const double combine_alone = timer.median_ms("combine kernel", [&] { pb.launch_combine_kernel(nullptr, pb.y); });
  CHECK_CUDA(cudaFree(scratch));
  table.push_back(row);
  const double flop_a = 2.0 * R * s.H * 2 * s.I, flop_b = 2.0 * R * s.I * s.H;
  auto tf = [](double flop, double ms) { return flop / (ms * 1e-3) / 1e12; };
  std::printf("  timing %s (R=%lld)\n", name.c_str(), (long long)R);
  std::printf("    gate/up  direct %.3f ms %5.0f TF | pool %.3f ms %5.0f TF + gather %.3f ms = %.3f ms | "
              "cuBLAS grouped %.3f ms %5.0f TF | dense %.3f ms %5.0f TF\n",
              row.ms[0], tf(flop_a, row.ms[0]), row.ms[1], tf(flop_a, row.ms[1]), row.ms[2], row.ms[1] + row.ms[2],
              row.ms[3], tf(flop_a, row.ms[3]), row.ms[4], tf(flop_a, row.ms[4]));
  std::printf("    down     fusemoe BN256 %.3f ms %5.0f TF, BN128 %.3f ms %5.0f TF | cuBLAS grouped %.3f ms %5.0f TF | "
              "dense %.3f ms %5.0f TF\n",
              row.ms[5], tf(flop_b, row.ms[5]), row.ms[6], tf(flop_b, row.ms[6]), row.ms[7], tf(flop_b, row.ms[7]),
              row.ms[8], tf(flop_b, row.ms[8]));
  std::printf("    both     one launch %.3f ms %5.0f TF | two launches (direct + BN256, mean of before and after) "
              "%.3f ms %5.0f TF\n", row.ms[9],
              tf(flop_a + flop_b, row.ms[9]), two_launches, tf(flop_a + flop_b, two_launches));
  std::printf("    combine  down BN256 + combine kernel %.3f ms (combine alone %.3f) | fused combine %.3f ms "
              "(%.1f%%)\n", separate_ms, combine_alone, fused_combine, 100.0 * (fused_combine / separate_ms - 1.0));
}

// ------------------------------------------------------------------------------------- main
struct Case {
  std::string name;
  Shape s;
  std::vector<int> counts;  // empty: random (multinomial) over all T*K slots
  int64_t rows = -1;        // with random counts: number of rows (default T*K)
  bool clamp = false;
  bool time = false;
  bool large = false;
};

int main(int argc, char** argv) {
  bool timing = true, large = true, check = true;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--no-timing")) timing = false;
    else if (!std::strcmp(argv[i], "--no-large")) large = false;
    else if (!std::strcmp(argv[i], "--no-check")) check = false;
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else {
      std::fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  if (const int skip = require_sm90_or_skip()) return skip;

  const Shape small{333, 8, 8, 256, 128};
  std::vector<Case> cases = {
      {"small random", small, {}, 2000},
      {"small one expert", {300, 8, 8, 256, 128}, {0, 0, 0, 2400, 0, 0, 0, 0}},
      {"small odd counts", {100, 8, 8, 256, 128}, {0, 1, 7, 199, 0, 128, 129, 64}},
      {"H384 I192 clamp", {257, 4, 8, 384, 192}, {}, 1000, true},
      {"single row", {1, 1, 8, 256, 128}, {0, 0, 0, 0, 0, 1, 0, 0}},
      {"no rows", {16, 8, 8, 256, 128}, {0, 0, 0, 0, 0, 0, 0, 0}},
      {"E1024 random", {512, 8, 1024, 256, 128}, {}, 3000},
      {"30B T4096 random", {4096, 8, 128, 2048, 768}, {}, -1, false, true, true},
      {"235B T4096 random", {4096, 8, 128, 4096, 1536}, {}, -1, false, true, true},
      {"30B T16384 random", {16384, 8, 128, 2048, 768}, {}, -1, false, true, true},
      {"30B T4096 uniform", {4096, 8, 128, 2048, 768}, std::vector<int>(128, 4096 * 8 / 128), -1, false, true, true},
      {"30B T16384 uniform", {16384, 8, 128, 2048, 768}, std::vector<int>(128, 16384 * 8 / 128), -1, false, true, true},
      {"235B T4096 uniform", {4096, 8, 128, 4096, 1536}, std::vector<int>(128, 4096 * 8 / 128), -1, false, true, true},
      {"235B T16384 uniform", {16384, 8, 128, 4096, 1536}, std::vector<int>(128, 16384 * 8 / 128), -1, false, true, true},
      {"235B T16384 random", {16384, 8, 128, 4096, 1536}, {}, -1, false, true, true},
  };

  cublasHandle_t handle;
  CHECK_CUBLAS(cublasCreate(&handle));
  std::mt19937_64 rng(20261129);
  std::vector<TimingRow> table;
  int failures = 0;
  uint64_t seed = 1000;
  for (const Case& c : cases) {
    if (c.large && !large) continue;
    if (!only.empty() && c.name.find(only) == std::string::npos) continue;
    std::vector<int> counts = c.counts;
    if (counts.empty()) counts = random_counts(c.s.E, c.rows >= 0 ? c.rows : c.s.T * c.s.K, rng);
    Problem pb;
    pb.s = c.s;
    pb.rt = make_routing(c.s, counts, rng);
    pb.clamp = c.clamp;
    pb.clamp_value = 1.5f;
    pb.allocate(seed += 10);
    const int empty = static_cast<int>(std::count(counts.begin(), counts.end(), 0));
    std::printf("case %s: T=%lld K=%lld E=%lld H=%lld I=%lld R=%lld (empty experts %d, max count %d)%s\n",
                c.name.c_str(), (long long)c.s.T, (long long)c.s.K, (long long)c.s.E, (long long)c.s.H,
                (long long)c.s.I, (long long)pb.rt.R, empty, *std::max_element(counts.begin(), counts.end()),
                c.clamp ? " clamp 1.5" : "");
    try {
      if (!check) {
        pb.launch_gate_up(nullptr, /*direct=*/true);
        pb.launch_gate_up(nullptr, /*direct=*/false);
        pb.launch_down(nullptr, 256);
        pb.launch_down(nullptr, 128);
        pb.launch_down_combine(nullptr, 256);
        CHECK_CUDA(cudaDeviceSynchronize());
        pb.release();
        continue;
      }
      const bool ok = check_problem(pb);
      if (!ok) ++failures;
      if (ok && c.time && timing) time_problem(pb, handle, table, c.name);
    } catch (const std::exception& e) {
      std::printf("    FAIL: exception: %s\n", e.what());
      ++failures;
    }
    pb.release();
  }
  CHECK_CUBLAS(cublasDestroy(handle));

  if (!table.empty()) {
    std::printf("\n| case | gate/up direct ms | TF/s | pool ms | + gather ms | cuBLAS grp TF/s | dense TF/s | "
                "down BN256 ms | TF/s | BN128 TF/s | cuBLAS grp TF/s | dense TF/s |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const Case& c : cases) {
      for (const TimingRow& row : table) {
        if (row.name != c.name) continue;
        const double R = double(c.s.T * c.s.K);
        const double fa = 2.0 * R * c.s.H * 2 * c.s.I / 1e9, fb = 2.0 * R * c.s.I * c.s.H / 1e9;
        std::printf("| %s | %.3f | %.0f | %.3f | %.3f | %.0f | %.0f | %.3f | %.0f | %.0f | %.0f | %.0f |\n",
                    c.name.c_str(), row.ms[0], fa / row.ms[0], row.ms[1], row.ms[2], fa / row.ms[3], fa / row.ms[4],
                    row.ms[5], fb / row.ms[5], fb / row.ms[6], fb / row.ms[7], fb / row.ms[8]);
      }
    }
  }
  std::printf("\n%s: %d failing case(s)\n", failures ? "FAILED" : "PASSED", failures);
  return failures ? 1 : 0;
}

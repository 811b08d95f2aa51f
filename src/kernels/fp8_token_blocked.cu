// The token-blocked E4M3 pools of the FP8 weight gradients (fp8_quantize.h, "Token-blocked
// pools"). One CTA per (128-position block, 128 features): it copies the block's
// 128 rows x 128 features of bf16 (gathered through row_slot or not) into shared memory, takes
// the amax of each feature (or of all 128), and writes each feature's 128 positions as E4M3,
// 32 bytes (one DRAM sector) per thread. Memory-bound: the reads are the rows' bytes, the writes
// half of them.
#include <cuda_bf16.h>

#include <atomic>
#include <cstdint>

#include "common/assert.h"
#include "device/fp8_quantize.cuh"
#include "device/sm90_fragment.cuh"
#include "device/sm90_ptx.cuh"
#include "fusemoe/error.h"
#include "kernels/fp8_quantize.h"
#include "launchers/sm90_launch_common.h"

namespace fusemoe {
namespace {

using sm90::kFp8Block;

constexpr int kThreads = 256;
constexpr int kOffsetThreads = 1024;
constexpr int kRowBytes = kFp8Block * 2;                     // one block row of bf16 in shared memory
constexpr int kChunksPerRow = kRowBytes / 16;                // 16-byte loads per row
constexpr int kLoadsPerThread = kFp8Block * kChunksPerRow / kThreads;
constexpr int kRun = 32;                                     // positions a thread writes at once (one sector)
constexpr int kRunsPerThread = kFp8Block * (kFp8Block / kRun) / kThreads;
static_assert(kLoadsPerThread * kThreads == kFp8Block * kChunksPerRow, "loads spread evenly");
static_assert(kRunsPerThread == 2 && kThreads == 2 * kFp8Block, "two runs of 32 positions per thread");

// pad[e] and the expert of every position block; one CTA (E <= 1024).
__global__ void __launch_bounds__(kOffsetThreads) token_block_offsets_kernel(const int32_t* __restrict__ offsets,
                                                                             int32_t num_experts, int32_t num_blocks,
                                                                             int32_t* __restrict__ pad,
                                                                             int32_t* __restrict__ block_expert) {
  __shared__ int32_t warp_sums[kOffsetThreads / 32];
  __shared__ int32_t pad_s[kOffsetThreads + 1];
  const int e = threadIdx.x, lane = e % 32, warp = e / 32;
  const int32_t blocks = e < num_experts ? (offsets[e + 1] - offsets[e] + kFp8Block - 1) / kFp8Block : 0;
  int32_t inclusive = blocks;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int32_t other = __shfl_up_sync(0xFFFFFFFFu, inclusive, d);
    if (lane >= d) inclusive += other;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int32_t w = warp_sums[lane];
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int32_t other = __shfl_up_sync(0xFFFFFFFFu, w, d);
      if (lane >= d) w += other;
    }
    warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const int32_t before = (warp > 0 ? warp_sums[warp - 1] : 0) + inclusive - blocks;  // in blocks
  if (e < num_experts) pad_s[e] = before;
  if (e == 0) pad_s[num_experts] = warp_sums[31];
  __syncthreads();
  for (int i = e; i <= num_experts; i += kOffsetThreads) pad[i] = pad_s[i] * kFp8Block;
  const int32_t used = pad_s[num_experts];
  for (int32_t b = e; b < num_blocks; b += kOffsetThreads) {
    int32_t owner = -1;
    if (b < used) {  // the last expert whose first block is <= b (empty experts share their start)
      int lo = 0, hi = num_experts - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (pad_s[mid] <= b) lo = mid;
        else hi = mid - 1;
      }
      owner = lo;
    }
    block_expert[b] = owner;
  }
}

// One CTA per 128 positions x 128 features; its rows are copied by cp.async (rows past the expert's
// end zero-filled). The bandwidth follows the bytes in flight: 6 CTAs an SM (a slice per CTA)
// moved 2.6-2.8 TB/s where a CTA that double-buffered 4 slices, or loaded 2-4 at once for longer
// row runs, moved 2.1-2.6 (the same blocked output). A swizzled tile read two features x 16
// positions a lane measured faster still, in another layout: docs/experiments.md#fp8-weight-gradients.
constexpr int kMinBlocksPerSm = 6;
constexpr int kTileBytes = kFp8Block * kRowBytes;  // [128 rows][128 features] bf16
constexpr size_t kSmemBytes = kTileBytes + 2 * kFp8Block * sizeof(float);

template <bool kGathered, bool kBlock128x128>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) quantize_token_blocked_kernel(
    const __nv_bfloat16* __restrict__ src, int64_t ld, int32_t cols, const int32_t* __restrict__ row_slot,
    int32_t top_k, const int32_t* __restrict__ offsets, const int32_t* __restrict__ pad,
    const int32_t* __restrict__ block_expert, uint8_t* __restrict__ q, float* __restrict__ scales) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* tile = smem;
  float (*part)[kFp8Block] = reinterpret_cast<float (*)[kFp8Block]>(smem + kTileBytes);
  const int32_t pb = blockIdx.x, c0 = blockIdx.y * kFp8Block;
  const int32_t e = block_expert[pb];
  if (e < 0) return;
  const int32_t r0 = offsets[e] + (pb * kFp8Block - pad[e]);
  const int32_t rows = min(kFp8Block, offsets[e + 1] - r0);  // the rest of the block is padding
  {
    // Chunk k of rows i * 16 + tid / 16: a half-warp copies one row's 256 bytes.
    const int k = threadIdx.x % kChunksPerRow;
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
#pragma unroll
    for (int i = 0; i < kLoadsPerThread; ++i) {
      const int r = i * (kThreads / kChunksPerRow) + threadIdx.x / kChunksPerRow;
      const int64_t src_row = r < rows ? (kGathered ? row_slot[r0 + r] / top_k : r0 + r) : 0;
      sm90::cp_async_16_zfill(base + (i * kThreads + threadIdx.x) * 16, src + src_row * ld + c0 + k * 8,
                              r < rows ? 16u : 0u);
    }
    sm90::cp_async_wait_all();
  }
  __syncthreads();

  // Thread (feature f, half h): positions [32 h, +32) and [64 + 32 h, +32) of feature f; a warp
  // reads 32 consecutive features of one row at a time (no bank conflicts).
  const int f = threadIdx.x % kFp8Block, h = threadIdx.x / kFp8Block;
  auto value = [&](int run, int i) {
    const int r = (2 * run + h) * kRun + i;
    return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(tile + r * kRowBytes + f * 2));
  };
  float amax = 0.0f;
#pragma unroll
  for (int run = 0; run < kRunsPerThread; ++run) {
#pragma unroll
    for (int i = 0; i < kRun; ++i) amax = fmaxf(amax, fabsf(value(run, i)));
  }
  part[h][f] = amax;
  __syncthreads();
  amax = fmaxf(part[0][f], part[1][f]);
  if constexpr (kBlock128x128) {
    // The max over the 128 features: each warp reduces its 32, then every thread reads the four.
#pragma unroll
    for (int d = 16; d > 0; d /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, d));
    __syncthreads();  // part[] read by all before it is reused
    if (threadIdx.x % 32 == 0 && h == 0) part[0][f / 32] = amax;
    __syncthreads();
    amax = fmaxf(fmaxf(part[0][0], part[0][1]), fmaxf(part[0][2], part[0][3]));
  }
  const sm90::Fp8Scale sc = sm90::fp8_block_scale(amax);
  uint8_t* out = q + (static_cast<int64_t>(pb) * cols + c0 + f) * kFp8Block;  // the CTA's 16 KB are contiguous
#pragma unroll
  for (int run = 0; run < kRunsPerThread; ++run) {
    uint32_t w[kRun / 4];
#pragma unroll
    for (int j = 0; j < kRun / 4; ++j) {
      w[j] = sm90::cvt_e4m3x4(value(run, 4 * j) * sc.inv, value(run, 4 * j + 1) * sc.inv,
                              value(run, 4 * j + 2) * sc.inv, value(run, 4 * j + 3) * sc.inv);
    }
    uint4* dst = reinterpret_cast<uint4*>(out + (2 * run + h) * kRun);
    dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
    dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
  if (h == 0) {
    if constexpr (kBlock128x128) {
      if (f == 0) scales[static_cast<int64_t>(pb) * (cols / kFp8Block) + c0 / kFp8Block] = sc.scale;
    } else {
      scales[static_cast<int64_t>(pb) * cols + c0 + f] = sc.scale;
    }
  }
}

// One instance's launch; its shared-memory limit is raised once per device.
template <bool kGathered, bool kBlock128x128>
void launch_quantize(const Fp8TokenBlockedParams& p, dim3 grid) {
  auto kernel = quantize_token_blocked_kernel<kGathered, kBlock128x128>;
  static std::atomic<uint64_t> configured{0};
  sm90::raise_smem_limit_once(reinterpret_cast<const void*>(kernel), kSmemBytes, sm90::device_info().device,
                              &configured);
  kernel<<<grid, kThreads, kSmemBytes, p.stream>>>(
      static_cast<const __nv_bfloat16*>(p.src), p.ld, static_cast<int32_t>(p.cols), p.row_slot,
      static_cast<int32_t>(p.top_k), p.expert_offsets, p.padded_offsets, p.block_expert, static_cast<uint8_t*>(p.q),
      p.scales);
}

}  // namespace

int64_t fp8_token_blocked_positions(int64_t max_rows, int64_t num_experts) {
  return (max_rows + kFp8Block - 1) / kFp8Block * kFp8Block + kFp8Block * num_experts;
}

void launch_token_block_offsets(const int32_t* expert_offsets, int64_t num_experts, int64_t p_max,
                                int32_t* padded_offsets, int32_t* block_expert, cudaStream_t stream) {
  FUSEMOE_ASSERT(num_experts >= 1 && num_experts <= kOffsetThreads && p_max % kFp8Block == 0);
  token_block_offsets_kernel<<<1, kOffsetThreads, 0, stream>>>(expert_offsets, static_cast<int32_t>(num_experts),
                                                               static_cast<int32_t>(p_max / kFp8Block),
                                                               padded_offsets, block_expert);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_quantize_token_blocked_fp8(const Fp8TokenBlockedParams& p) {
  FUSEMOE_ASSERT(p.cols > 0 && p.cols % kFp8Block == 0 && p.ld >= p.cols && p.ld % 8 == 0);
  FUSEMOE_ASSERT(p.p_max % kFp8Block == 0 && p.p_max / kFp8Block < (int64_t{1} << 31) && p.cols / kFp8Block < 65536);
  FUSEMOE_ASSERT(p.src && p.expert_offsets && p.padded_offsets && p.block_expert && p.q && p.scales);
  FUSEMOE_ASSERT(p.row_slot == nullptr || p.top_k >= 1);
  if (p.p_max == 0) return;
  const dim3 grid(static_cast<unsigned>(p.p_max / kFp8Block), static_cast<unsigned>(p.cols / kFp8Block));
  const bool gathered = p.row_slot != nullptr, blocks_2d = p.mode == Fp8TokenScales::kPer128x128;
  if (gathered) {
    blocks_2d ? launch_quantize<true, true>(p, grid) : launch_quantize<true, false>(p, grid);
  } else {
    blocks_2d ? launch_quantize<false, true>(p, grid) : launch_quantize<false, false>(p, grid);
  }
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace fusemoe

// The token-blocked E4M3 pools of the FP8 weight gradients (fp8_quantize.h, "Token-blocked
// pools"). One CTA per (128-position block, 128 features): cp.async copies the block's 128 rows x
// 128 features of bf16 (gathered through row_slot or not; rows past the expert's end zero-filled)
// into a swizzled shared tile. Warp w then quantizes feature chunks w and w + 8 (8 features each):
// lane (pair p = lane / 8, k = lane % 8) reads features 2p, 2p + 1 of positions [16k, 16k + 16)
// as 16 bf16x2 words, and the 8 lanes of a pair write each feature's 128 positions as one 128-byte
// line. The amax is a shuffle over those 8 lanes (kPer128Tokens) or over the tile (kPer128x128).
// Memory-bound: the reads are the rows' bytes, the writes half of them.
#include <cuda_bf16.h>

#include <cstdint>

#include "common/assert.h"
#include "device/fp8_quantize.cuh"
#include "device/sm90_ptx.cuh"
#include "fusemoe/error.h"
#include "kernels/fp8_quantize.h"

namespace fusemoe {
namespace {

using sm90::kFp8Block;

constexpr int kThreads = 256;                             // 8 warps
constexpr int kOffsetThreads = 1024;
constexpr int kRowBytes = kFp8Block * 2;                  // one tile row (position) of bf16
constexpr int kChunks = kRowBytes / 16;                   // 16-byte chunks (8 features) of a row
constexpr int kTileBytes = kFp8Block * kRowBytes;         // [128 positions][128 features] bf16
constexpr int kLoadsPerThread = kTileBytes / 16 / kThreads;
constexpr int kRunPositions = 16;                         // positions a lane reads and writes per feature
constexpr int kLanesPerLine = kFp8Block / kRunPositions;  // lanes that write one feature's 128 bytes
constexpr int kPasses = kChunks / (kThreads / 32);        // chunks a warp quantizes
static_assert(kLoadsPerThread == 8 && kThreads % kChunks == 0, "thread t copies chunk t % 16 of rows t / 16 + 16 i");
static_assert(kLanesPerLine * 4 == 32 && kPasses == 2, "a warp is 4 feature pairs (one chunk) x 8 runs");
static_assert(2 * kLanesPerLine == kChunks, "the swizzle's XOR by a lane's run stays inside the row");

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

// The shared tile: chunk c of row r sits at chunk c ^ (r / 16 % 8). In one read step a warp's 32
// lanes take one chunk's 4 words in rows 16 k + i (k = 0..7): 8 slots x 4 words, all 32 banks
// (unswizzled, the 8 rows would share 4 banks).
__device__ __forceinline__ int tile_byte(int row, int chunk) {
  return row * kRowBytes + (chunk ^ (row / kRunPositions % kLanesPerLine)) * 16;
}

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

// Lane (pair, k)'s run: w[i] holds position 16 k + i of features 2 pair (low half) and 2 pair + 1.
__device__ __forceinline__ void read_run(const uint8_t* tile, int pair, int k, uint32_t (&w)[kRunPositions]) {
#pragma unroll
  for (int i = 0; i < kRunPositions; ++i) {
    w[i] = *reinterpret_cast<const uint32_t*>(tile + tile_byte(kRunPositions * k + i, pair / 4) + pair % 4 * 4);
  }
}

__device__ __forceinline__ void run_amax(const uint32_t (&w)[kRunPositions], float& amax_lo, float& amax_hi) {
#pragma unroll
  for (int i = 0; i < kRunPositions; ++i) {
    amax_lo = fmaxf(amax_lo, fabsf(bf16_lo(w[i])));
    amax_hi = fmaxf(amax_hi, fabsf(bf16_hi(w[i])));
  }
}

// The max over the 8 lanes of one feature's line (lane / 8 equal), left in each of them.
__device__ __forceinline__ float line_max(float amax) {
#pragma unroll
  for (int d = 1; d < kLanesPerLine; d *= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, d));
  return amax;
}

// One feature's 16 E4M3 bytes in position order, from the low (feature 2 pair) or high halves.
template <bool kHigh>
__device__ __forceinline__ uint4 quantize_run(const uint32_t (&w)[kRunPositions], float inv) {
  uint32_t b[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = (kHigh ? bf16_hi(w[4 * m + i]) : bf16_lo(w[4 * m + i])) * inv;
    b[m] = sm90::cvt_e4m3x4(v[0], v[1], v[2], v[3]);
  }
  return make_uint4(b[0], b[1], b[2], b[3]);
}

// One tile a CTA, no loop: the bandwidth follows the bytes in flight, so several CTAs an SM keep
// their loads going while others write. Gathered rows wait on their row_slot lookups first: 6 an
// SM (192 KB of tiles, 40 registers) hid that best; rows in pool order took 5 (160 KB, 48), where
// 6 was slower over 128 x 128 blocks. Figures: docs/experiments.md#fp8-weight-gradients.
template <bool kGathered>
constexpr int kMinBlocksPerSm = kGathered ? 6 : 5;

template <bool kGathered, bool kBlock128x128>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm<kGathered>) quantize_token_blocked_kernel(
    const __nv_bfloat16* __restrict__ src, int64_t ld, int32_t cols, const int32_t* __restrict__ row_slot,
    int32_t top_k, const int32_t* __restrict__ offsets, const int32_t* __restrict__ pad,
    const int32_t* __restrict__ block_expert, uint8_t* __restrict__ q, float* __restrict__ scales) {
  __shared__ __align__(128) uint8_t tile[kTileBytes];  // [128 positions][16 chunks, swizzled][8 features] bf16
  __shared__ float warp_amax[kThreads / 32];           // kPer128x128
  const int32_t pb = blockIdx.x, c0 = blockIdx.y * kFp8Block;
  const int32_t e = block_expert[pb];
  if (e < 0) return;
  const int32_t r0 = offsets[e] + (pb * kFp8Block - pad[e]);
  const int32_t rows = min(kFp8Block, offsets[e + 1] - r0);  // the rest of the block is padding
  {
    // Chunk t % 16 of rows t / 16 + 16 i: a half-warp copies one row's 256 bytes. Every row lookup
    // comes before the first copy (cp.async's memory clobber would otherwise serialise them).
    const int chunk = threadIdx.x % kChunks;
    int64_t from[kLoadsPerThread];
#pragma unroll
    for (int i = 0; i < kLoadsPerThread; ++i) {
      const int r = threadIdx.x / kChunks + (kThreads / kChunks) * i;
      const int64_t src_row = r < rows ? (kGathered ? row_slot[r0 + r] / top_k : r0 + r) : 0;
      from[i] = src_row * ld + c0 + chunk * 8;
    }
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
#pragma unroll
    for (int i = 0; i < kLoadsPerThread; ++i) {
      const int r = threadIdx.x / kChunks + (kThreads / kChunks) * i;
      sm90::cp_async_16_zfill(base + tile_byte(r, chunk), src + from[i], r < rows ? 16u : 0u);
    }
    sm90::cp_async_wait_all();
  }
  __syncthreads();

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, k = lane % kLanesPerLine;
  auto pair_of = [&](int pass) { return (warp + (kThreads / 32) * pass) * 4 + lane / kLanesPerLine; };
  sm90::Fp8Scale tile_scale{};
  if constexpr (kBlock128x128) {
    // One amax for the tile: each lane's two runs, its warp, then the 8 warps; the runs are read
    // again below (shared-memory reads are cheap next to the DRAM bytes).
    float amax = 0.0f;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      uint32_t w[kRunPositions];
      read_run(tile, pair_of(pass), k, w);
      run_amax(w, amax, amax);
    }
#pragma unroll
    for (int d = 16; d > 0; d /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, d));
    if (lane == 0) warp_amax[warp] = amax;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kThreads / 32; ++i) amax = fmaxf(amax, warp_amax[i]);
    tile_scale = sm90::fp8_block_scale(amax);
    if (threadIdx.x == 0) scales[static_cast<int64_t>(pb) * (cols / kFp8Block) + c0 / kFp8Block] = tile_scale.scale;
  }
  uint8_t* out = q + (static_cast<int64_t>(pb) * cols + c0) * kFp8Block;  // the CTA's 16 KB are contiguous
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int pair = pair_of(pass);
    uint32_t w[kRunPositions];
    sm90::Fp8Scale s_lo = tile_scale, s_hi = tile_scale;
    if constexpr (!kBlock128x128) {
      // The run is read again after the divisions: held across their calls, it spilled.
      read_run(tile, pair, k, w);
      float amax_lo = 0.0f, amax_hi = 0.0f;
      run_amax(w, amax_lo, amax_hi);
      s_lo = sm90::fp8_block_scale(line_max(amax_lo));
      s_hi = sm90::fp8_block_scale(line_max(amax_hi));
      // Lanes 0 and 1 of the line: a warp's 8 features' scales in one 32-byte store.
      if (k < 2) scales[static_cast<int64_t>(pb) * cols + c0 + 2 * pair + k] = k == 0 ? s_lo.scale : s_hi.scale;
    }
    read_run(tile, pair, k, w);
    uint8_t* dst = out + 2 * pair * kFp8Block + kRunPositions * k;
    *reinterpret_cast<uint4*>(dst) = quantize_run<false>(w, s_lo.inv);
    *reinterpret_cast<uint4*>(dst + kFp8Block) = quantize_run<true>(w, s_hi.inv);
  }
}

// One instance's launch: static shared memory (32 KB), under the default 48 KB limit.
template <bool kGathered, bool kBlock128x128>
void launch_quantize(const Fp8TokenBlockedParams& p, dim3 grid) {
  quantize_token_blocked_kernel<kGathered, kBlock128x128><<<grid, kThreads, 0, p.stream>>>(
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

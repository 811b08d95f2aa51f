// Quantization kernels of the blockwise FP8 path (declarations and layouts in fp8_quantize.h; the
// recipe in src/device/fp8_quantize.cuh). All are memory-bound copies with a max-reduction per
// block: rows use 16 lanes per 1 x 128 block (16 bytes of bf16 each), x's token rows as one flat
// array, the pools' rows scattered to their slots; weights one CTA per 128 x 128 block (a
// shared-memory tile turns the quantized block around for the transposed copy).
#include "kernels/fp8_quantize.h"

#include <cuda_bf16.h>

#include <algorithm>

#include "device/fp8_quantize.cuh"
#include "device/sm90_fragment.cuh"
#include "fusemoe/error.h"

namespace fusemoe {
namespace {

using sm90::kFp8Block;

constexpr int kThreads = 256;
constexpr int kLanesPerRowBlock = kFp8Block / 8;  // 16 lanes x 8 bf16
constexpr int64_t kMaxGrid = 65535LL * 16;

// The max over the kLanesPerRowBlock lanes that hold one 1 x 128 block (a half-warp); every lane
// of the warp must call it, and each ends with its half's max.
__device__ __forceinline__ float row_block_max(float amax) {
#pragma unroll
  for (int offset = kLanesPerRowBlock / 2; offset > 0; offset /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
  }
  return amax;
}

// x once per token: its rows are contiguous and its scales row-major, so 8-element chunk c of the
// flat [T * H] array belongs to block c / 16, whose scale is scales[c / 16]: one chunk a thread
// and no row or column arithmetic (a 64-bit division per 16 bytes bound the per-row version; more
// chunks a thread gained nothing: docs/experiments.md#fp8-x-quantization). H is a multiple of 128,
// so a half-warp's 16 chunks are one whole block, all in range or none.
// Chunk c of the flat array: both token-row kernels below run this, so their bytes are the same.
// Every lane of the warp must call it (the block max is a shuffle); a chunk at or past `chunks`
// computes on zeros and stores nothing.
__device__ __forceinline__ void quantize_token_chunk(const __nv_bfloat16* __restrict__ src, int64_t chunks,
                                                     uint8_t* __restrict__ dst, float* __restrict__ scales,
                                                     int64_t c) {
  const uint4 raw = c < chunks ? __ldcs(reinterpret_cast<const uint4*>(src) + c) : make_uint4(0u, 0u, 0u, 0u);
  float v[8];
  sm90::unpack_bf16x8(raw, v);
  const float amax = row_block_max(sm90::amax8(v));
  if (c >= chunks) return;
  const sm90::Fp8Scale s = sm90::fp8_block_scale(amax);
  reinterpret_cast<uint2*>(dst)[c] = sm90::quantize_e4m3x8(v, s.inv);
  if (threadIdx.x % kLanesPerRowBlock == 0) scales[c / kLanesPerRowBlock] = s.scale;
}

__global__ void __launch_bounds__(kThreads) quantize_token_rows_fp8_kernel(const __nv_bfloat16* __restrict__ src,
                                                                           int64_t chunks, uint8_t* __restrict__ dst,
                                                                           float* __restrict__ scales) {
  quantize_token_chunk(src, chunks, dst, scales, static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x);
}

// The same with the row count on the device (*num_rows; the grid is sized for the capacity): the
// CTA strides over the chunks, its first chunk uniform over the CTA, so a warp's lanes run the
// same iterations and the shuffles see all 32.
__global__ void __launch_bounds__(kThreads) quantize_token_rows_fp8_device_count_kernel(
    const __nv_bfloat16* __restrict__ src, const int32_t* __restrict__ num_rows, int64_t chunks_per_row,
    uint8_t* __restrict__ dst, float* __restrict__ scales) {
  const int64_t chunks = static_cast<int64_t>(__ldg(num_rows)) * chunks_per_row;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads; first < chunks;
       first += static_cast<int64_t>(gridDim.x) * kThreads) {
    quantize_token_chunk(src, chunks, dst, scales, first + threadIdx.x);
  }
}

// The backward's dy (with x's plain pool beside it): one warp handles two (source row, block)
// items per step, one per half-warp, and kScatterSteps steps at a time, loading all of them before
// it reduces any (docs/experiments.md#fp8-row-quantization-steps). The half-warps of a warp stay
// together (an item past the end computes on zeros and stores nothing) so the shuffles see all 32
// lanes. A source row's block is quantized once and stored once, at the source row (the GEMM that
// reads it gathers token rows); its plain bf16 copies go to each valid slot's pool row
// slot_row[row * top_k + j].
constexpr int kScatterSteps = 4;

__global__ void quantize_pool_rows_fp8_kernel(const __nv_bfloat16* __restrict__ src, const int32_t* __restrict__ slot_row,
                                              int64_t num_src_rows, int64_t top_k, int64_t hidden,
                                              __nv_bfloat16* __restrict__ dst_bf16, uint8_t* __restrict__ dst_fp8,
                                              float* __restrict__ scales, Fp8RowsPlainCopy also) {
  const auto* also_src = static_cast<const __nv_bfloat16*>(also.src_bf16);
  auto* also_dst = static_cast<__nv_bfloat16*>(also.dst_bf16_RH);
  const int64_t blocks_per_row = hidden / kFp8Block;
  const int64_t items = num_src_rows * blocks_per_row;
  const int64_t pairs = (items + 1) / 2;
  const int lane = threadIdx.x % 32;
  const int half = lane / kLanesPerRowBlock, sub = lane % kLanesPerRowBlock;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32 * kScatterSteps; first < pairs;
       first += warps * kScatterSteps) {
    uint4 raw[kScatterSteps], also_raw[kScatterSteps];
    int64_t item[kScatterSteps];
    bool valid[kScatterSteps];
#pragma unroll
    for (int step = 0; step < kScatterSteps; ++step) {
      item[step] = 2 * (first + step) + half;
      valid[step] = item[step] < items;
      // Item i's 16 bytes of lane `sub` are chunk 16 i + sub of the flat [rows * H] array.
      const int64_t chunk = item[step] * kLanesPerRowBlock + sub;
      raw[step] = also_raw[step] = make_uint4(0u, 0u, 0u, 0u);
      if (valid[step]) {
        raw[step] = reinterpret_cast<const uint4*>(src)[chunk];
        if (also_src != nullptr) also_raw[step] = reinterpret_cast<const uint4*>(also_src)[chunk];
      }
    }
#pragma unroll
    for (int step = 0; step < kScatterSteps; ++step) {
      float v[8];
      sm90::unpack_bf16x8(raw[step], v);
      const float amax = row_block_max(sm90::amax8(v));
      if (!valid[step]) continue;
      const sm90::Fp8Scale s = sm90::fp8_block_scale(amax);
      const int64_t chunk = item[step] * kLanesPerRowBlock + sub;
      reinterpret_cast<uint2*>(dst_fp8)[chunk] = sm90::quantize_e4m3x8(v, s.inv);
      if (sub == 0) scales[item[step]] = s.scale;  // row-major [rows, H/128]: item r * blocks + b
      if (dst_bf16 == nullptr && also_dst == nullptr) continue;
      const int64_t r = item[step] / blocks_per_row, c = chunk * 8 - r * hidden;
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t dst = __ldg(slot_row + r * top_k + j);
        if (dst < 0) continue;  // a masked slot: no pool row
        if (dst_bf16) *reinterpret_cast<uint4*>(dst_bf16 + dst * hidden + c) = raw[step];
        if (also_dst != nullptr) *reinterpret_cast<uint4*>(also_dst + dst * hidden + c) = also_raw[step];
      }
    }
  }
}

// One CTA per 128 x 128 block (e, block row, block column). Thread t reads 16-byte chunk t % 16 of
// rows t / 16 + 16 i (i < 8). kSeparateHalves: matrix e's rows [0, rows/2) are w's matrix e and
// rows [rows/2, rows) w_up's, each [E, rows/2, cols] (w1 and w3 for w13's layout; a 128-row block
// lies in one half); otherwise w is [E, rows, cols] and w_up unused.
constexpr int kTileRowPad = 16;  // bytes: staggers the transposed column reads over the banks

template <bool kSeparateHalves>
__global__ void __launch_bounds__(kThreads) quantize_weights_fp8_kernel(const __nv_bfloat16* __restrict__ w,
                                                                        const __nv_bfloat16* __restrict__ w_up,
                                                                        int64_t rows, int64_t cols,
                                                                        uint8_t* __restrict__ q,
                                                                        uint8_t* __restrict__ q_t,
                                                                        float* __restrict__ scales) {
  constexpr int kRowsPerPass = kThreads / kLanesPerRowBlock;  // 16
  constexpr int kPasses = kFp8Block / kRowsPerPass;           // 8
  __shared__ __align__(16) uint8_t tile[kFp8Block][kFp8Block + kTileRowPad];
  __shared__ float warp_amax[kThreads / 32];
  const int64_t block_rows = rows / kFp8Block, block_cols = cols / kFp8Block;
  const int64_t id = blockIdx.x;
  const int64_t e = id / (block_rows * block_cols);
  const int64_t rem = id - e * block_rows * block_cols;
  const int64_t br = rem / block_cols, bc = rem - br * block_cols;
  const int64_t matrix = e * rows * cols;
  const int chunk = threadIdx.x % kLanesPerRowBlock, r0 = threadIdx.x / kLanesPerRowBlock;

  // kSeparateHalves: the block's first row in the half that holds it.
  const __nv_bfloat16* half_block = nullptr;
  if constexpr (kSeparateHalves) {
    const int64_t half_rows = rows / 2, row0 = br * kFp8Block;
    half_block = row0 < half_rows ? w + (e * half_rows + row0) * cols
                                  : w_up + (e * half_rows + row0 - half_rows) * cols;
  }
  uint4 raw[kPasses];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    if constexpr (kSeparateHalves) {
      const int64_t r = r0 + kRowsPerPass * i;  // within the block
      raw[i] = *reinterpret_cast<const uint4*>(half_block + r * cols + bc * kFp8Block + chunk * 8);
    } else {
      const int64_t r = br * kFp8Block + r0 + kRowsPerPass * i;
      raw[i] = *reinterpret_cast<const uint4*>(w + matrix + r * cols + bc * kFp8Block + chunk * 8);
    }
    float v[8];
    sm90::unpack_bf16x8(raw[i], v);
    amax = fmaxf(amax, sm90::amax8(v));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kThreads / 32; ++i) amax = fmaxf(amax, warp_amax[i]);
  const sm90::Fp8Scale s = sm90::fp8_block_scale(amax);
  if (threadIdx.x == 0) scales[e * block_rows * block_cols + br * block_cols + bc] = s.scale;

#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int r = r0 + kRowsPerPass * i;
    float v[8];
    sm90::unpack_bf16x8(raw[i], v);
    const uint2 bytes = sm90::quantize_e4m3x8(v, s.inv);
    *reinterpret_cast<uint2*>(q + matrix + (br * kFp8Block + r) * cols + bc * kFp8Block + chunk * 8) = bytes;
    *reinterpret_cast<uint2*>(&tile[r][chunk * 8]) = bytes;
  }
  if (q_t == nullptr) return;
  __syncthreads();
  // Transposed block: output row c (column c of the block) holds the block's rows in order; thread
  // t writes 16-byte chunks 4 (t % 2) + k (k < 4) of output row t / 2.
  const int c = threadIdx.x / 2;
  const int64_t out_row = bc * kFp8Block + c;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int rr = 16 * (4 * (threadIdx.x % 2) + k);
    uint32_t words[4];
#pragma unroll
    for (int wd = 0; wd < 4; ++wd) {
      words[wd] = static_cast<uint32_t>(tile[rr + 4 * wd][c]) | (static_cast<uint32_t>(tile[rr + 4 * wd + 1][c]) << 8) |
                  (static_cast<uint32_t>(tile[rr + 4 * wd + 2][c]) << 16) |
                  (static_cast<uint32_t>(tile[rr + 4 * wd + 3][c]) << 24);
    }
    *reinterpret_cast<uint4*>(q_t + matrix + out_row * rows + br * kFp8Block + rr) =
        make_uint4(words[0], words[1], words[2], words[3]);
  }
}

}  // namespace

void launch_quantize_token_rows_fp8(const void* x_bf16, int64_t num_tokens, int64_t hidden, void* fp8_TH,
                                    float* scales, cudaStream_t stream) {
  FUSEMOE_CHECK(hidden > 0 && hidden % kFp8Block == 0, "internal error: FP8 rows need hidden % 128 == 0");
  if (num_tokens == 0) return;
  const int64_t chunks = num_tokens * (hidden / 8);
  const int64_t grid = (chunks + kThreads - 1) / kThreads;
  FUSEMOE_CHECK(grid < (int64_t{1} << 31), "internal error: too many token rows for one FP8 quantization grid");
  quantize_token_rows_fp8_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x_bf16), chunks, static_cast<uint8_t*>(fp8_TH), scales);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_quantize_token_rows_fp8_device_count(const void* x_bf16, const int32_t* num_rows_device, int64_t max_rows,
                                                 int64_t hidden, void* fp8_TH, float* scales, cudaStream_t stream) {
  FUSEMOE_CHECK(hidden > 0 && hidden % kFp8Block == 0, "internal error: FP8 rows need hidden % 128 == 0");
  FUSEMOE_CHECK(num_rows_device != nullptr, "internal error: a device-count quantization needs the count");
  if (max_rows == 0) return;
  const int64_t chunks_per_row = hidden / 8;
  const int64_t grid = std::min(kMaxGrid, (max_rows * chunks_per_row + kThreads - 1) / kThreads);
  quantize_token_rows_fp8_device_count_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x_bf16), num_rows_device, chunks_per_row, static_cast<uint8_t*>(fp8_TH),
      scales);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_quantize_pool_rows_fp8(const void* src_bf16, const int32_t* slot_row, int64_t num_src_rows,
                                   int64_t top_k, int64_t hidden, void* dst_bf16_RH, void* fp8_TH, float* scales,
                                   cudaStream_t stream, const Fp8RowsPlainCopy& also) {
  FUSEMOE_CHECK(hidden > 0 && hidden % kFp8Block == 0, "internal error: FP8 rows need hidden % 128 == 0");
  FUSEMOE_CHECK((also.src_bf16 == nullptr) == (also.dst_bf16_RH == nullptr),
                "internal error: a plain row copy needs both its source and its destination");
  FUSEMOE_CHECK(slot_row != nullptr && top_k >= 1, "internal error: a pool scatter needs slot_row and top_k >= 1");
  FUSEMOE_CHECK(fp8_TH != nullptr && scales != nullptr, "internal error: the FP8 rows and their scales are outputs");
  if (num_src_rows == 0) return;
  const int64_t pairs = (num_src_rows * (hidden / kFp8Block) + 1) / 2;
  const int64_t warps = (pairs + kScatterSteps - 1) / kScatterSteps;
  const int64_t grid = std::max<int64_t>(1, std::min(kMaxGrid, (warps * 32 + kThreads - 1) / kThreads));
  quantize_pool_rows_fp8_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(src_bf16), slot_row, num_src_rows, top_k, hidden,
      static_cast<__nv_bfloat16*>(dst_bf16_RH), static_cast<uint8_t*>(fp8_TH), scales, also);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_quantize_weights_fp8(const void* w_bf16, const void* w_up_bf16, int64_t num_experts, int64_t rows,
                                 int64_t cols, void* q, void* q_t, float* scales, cudaStream_t stream) {
  FUSEMOE_CHECK(rows > 0 && cols > 0 && rows % kFp8Block == 0 && cols % kFp8Block == 0 && num_experts >= 1,
                "internal error: FP8 weights need [E >= 1, rows, cols] with rows and cols multiples of 128");
  FUSEMOE_CHECK(w_up_bf16 == nullptr || rows % (2 * kFp8Block) == 0,
                "internal error: separate FP8 weight halves need rows / 2 to be a multiple of 128");
  const int64_t blocks = num_experts * (rows / kFp8Block) * (cols / kFp8Block);
  FUSEMOE_CHECK(blocks < (int64_t{1} << 31), "internal error: too many 128 x 128 weight blocks for one grid");
  const auto* w = static_cast<const __nv_bfloat16*>(w_bf16);
  const auto* w_up = static_cast<const __nv_bfloat16*>(w_up_bf16);
  auto* q8 = static_cast<uint8_t*>(q);
  auto* q8_t = static_cast<uint8_t*>(q_t);
  if (w_up != nullptr) {
    quantize_weights_fp8_kernel<true><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(w, w_up, rows, cols, q8,
                                                                                              q8_t, scales);
  } else {
    quantize_weights_fp8_kernel<false><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(w, nullptr, rows, cols,
                                                                                               q8, q8_t, scales);
  }
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace fusemoe

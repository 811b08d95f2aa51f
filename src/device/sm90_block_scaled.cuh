// Blockwise-scaled FP8 operands of the sm90 grouped GEMM (src/kernels/sm90_grouped_gemm.cuh):
// the E4M3 operand policies, the per-stage scale record, and the producer and consumer loops of
// a block-scaled instance (the kernel runs the consumer loop instead of consume() when A says
// kBlockScaled; produce() serves both). docs/design.md#blockwise-fp8-issue-16-precisionkfp8blockwise.
//
//   out[r, n] = sum_kb (sum_{k in kb} qa[r, k] qb[n, k]) * scale_a[r, kb] * scale_b[n / 128, kb]
//
// A K-block is 128 E4M3 = one 128-byte swizzle row, so stages have the BF16 layout (A [128 rows]
// [128 k] 16 KB, B [kBlockN rows][128 k]; sm90_layout.cuh). Promotion, per 128-column half of
// the tile: four wgmma m64n128k32 accumulate the K-block into a fresh fp32 tmp (64 registers); the
// warpgroup waits for them, then acc[half] += tmp * (scale_a[row] * scale_b[half]) (fp32 FMAs);
// the stage is freed after its last half. The other consumer warpgroup's MMAs run meanwhile.
// Registers: acc kBlockN / 2 + tmp 64 (192 at N = 256: one tmp per half, not one per tile).
//   A policies (each K-block brings its 128 row scales into the stage's StageScales::a)
//     Fp8PoolRowsA              K-major E4M3 pool rows by TMA (a partial tile's tail as zeros:
//                               load_pool_row_tile); their scales from a block-major
//                               scale pool [K/128][rows_pad], one cp.async per producer thread
//     Fp8GatheredTokenRowsA     token rows gathered by index (as GatheredTokenRowsA) plus one
//                               4-byte cp.async per row from the token-major scales [T, K/128]
//     Fp8TokenBlockedA          weight gradients: feature rows of a token-blocked pool (below),
//                               1 x 128 scales along the positions [P/128, rows]
//   B policies (K-major E4M3; scales by a 4-byte cp.async of the producer thread)
//     Fp8WeightsB<N>            [N rows][128 k] of one expert's weight, N = 128 or 256
//     Fp8GateUpWeightsB         a tile is one 128-column block of h in one pass: gate rows
//                               [128 n, +128) and the up rows I below them, N = 256
//     Fp8TokenBlockedB<N>       weight gradients: feature rows of a token-blocked pool, 128 x 128
//                               block scales [P/128, N/128] (one per half: the promotion's)
// A token-blocked pool [P/128][C features][128 positions] (launch_quantize_token_blocked_fp8) holds
// each expert's routed rows transposed, from a position that is a multiple of 128, zeros after them:
// Hopper's E4M3 wgmma reads K-major operands only, and a weight gradient's K is the tokens. A
// K-block is 128 positions of one expert, so no foreign row enters the sum and none is zeroed.
// The scales of B ride in A's Args (GemmParams has one argument slot per operand source, and B's
// is its tensor map).
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "device/sm90_epilogues.cuh"
#include "device/sm90_fp8_ptx.cuh"
#include "device/sm90_layout.cuh"
#include "device/sm90_operands.cuh"
#include "device/sm90_pipeline.cuh"
#include "device/sm90_ptx.cuh"
#include "device/sm90_schedulers.cuh"

namespace fusemoe::sm90 {

constexpr int kFp8BlockK = 128;  // E4M3 per K-block: one swizzle row, one scale block
static_assert(kFp8BlockK == kSwizzleRowBytes, "an FP8 K-block is one 128-byte swizzle row");
static_assert(kFp8BlockK * 1 == kBlockK * 2, "FP8 and BF16 stages have the same bytes");

// Scales of one stage. 640 bytes keep every record's A scales 128-byte aligned.
struct StageScales {
  float a[kBlockM];  // tile row r's scale for this K-block
  float b[2];        // B: columns [0, kBlockN/2) and [kBlockN/2, kBlockN); b[0] only if B::kNumBScales == 1
  float unused[30];
};
constexpr int kStageScalesBytes = 640;
static_assert(sizeof(StageScales) == kStageScalesBytes && kStageScalesBytes % 128 == 0, "scale record size");

// Whether an A policy brings block scales (BF16 policies have no kBlockScaled member).
template <class A, class = void>
struct IsBlockScaled : std::false_type {};
template <class A>
struct IsBlockScaled<A, std::void_t<decltype(A::kBlockScaled)>> : std::bool_constant<A::kBlockScaled> {};

// Where a weight's 128 x 128 block scales are: block (n, kb) of expert e's B operand at
// ptr[e * expert_stride + n * n_stride + kb * k_stride] (transposed copies swap the strides of
// the stored [E, rows/128, cols/128] scales); second: the up block's offset from the gate block.
struct WeightScales {
  const float* ptr;
  int32_t expert_stride;
  int32_t n_stride;
  int32_t k_stride;
  int32_t second;
  int32_t n_blocks;  // 128-blocks along n: a 256-wide tile past the last one reads the last one's scale
};

// ------------------------------------------------------------------------------------- A

// The rows by TMA; their 128 scales by the producer threads, one 4-byte cp.async each (a TMA box
// of the fp32 scale pool, [1][128] without swizzle, trapped as an illegal instruction on the
// H200: docs/experiments.md#fp8-first-run).
struct Fp8PoolRowsA {
  static constexpr bool kGathered = false, kMnMajor = false, kBlockScaled = true, kScalesPerThread = true;
  static constexpr uint32_t kTmaBytes = kTileABytes;
  static_assert(kThreadsPerWarpgroup == kBlockM, "producer thread p copies the scale of tile row p");
  struct Args {
    CUtensorMap map;      // pool [R_max, K] E4M3, boxes [128 rows][128 k]
    CUtensorMap quarter;  // the same pool, boxes [32 rows][128 k]
    const float* scales;  // [K/128, rows_pad] fp32, block-major
    int32_t rows_pad;
    WeightScales b_scales;
  };
  struct ThreadRows {};
  __device__ static void load(const Args& a, uint64_t* full, uint8_t* dst, const Tile& tile, int32_t kb) {
    load_pool_row_tile(a.map, a.quarter, full, dst, kb * kFp8BlockK, tile);
  }
  // Thread p: the scale of tile row p for K-block kb (rows past the pool are left as they are:
  // their accumulator rows are past the expert's end and never stored).
  __device__ static void copy_scale(const Args& a, const Tile& tile, int32_t kb, uint32_t scales_a, int thread) {
    const int32_t row = tile.row_begin + thread;
    if (row < a.rows_pad) {
      cp_async_4(scales_a + thread * sizeof(float), a.scales + static_cast<int64_t>(kb) * a.rows_pad + row);
    }
  }
};

// Whether every producer thread takes part in filling a stage (gathered rows, or per-row scales
// copied by the threads); otherwise thread 0 alone issues the stage's TMA loads.
template <class A, class = void>
struct ScalesPerThread : std::false_type {};
template <class A>
struct ScalesPerThread<A, std::void_t<decltype(A::kScalesPerThread)>> : std::bool_constant<A::kScalesPerThread> {};
template <class A>
constexpr bool kAllProducerThreads = A::kGathered || ScalesPerThread<A>::value;

// Gathers E4M3 x rows exactly as GatheredTokenRowsA gathers bf16 ones (a row of H E4M3 is H / 16
// chunks, K/128 * 8 as for bf16 at K/64); producer thread p also copies the scale of tile row p
// (one 4-byte cp.async per thread and stage), x_scales[token, kb].
struct Fp8GatheredTokenRowsA {
  static constexpr bool kGathered = true, kMnMajor = false, kBlockScaled = true;
  static constexpr uint32_t kTmaBytes = 0;
  using Rows = GatheredTokenRowsA;
  static_assert(kThreadsPerWarpgroup == kBlockM, "producer thread p copies the scale of tile row p");
  struct Args {
    Rows::Args rows;         // x [T, H] E4M3 (as bytes), row_slot, top_k
    const float* x_scales;   // [T, H/128]
    WeightScales b_scales;
  };
  static constexpr uint32_t kNoRow = 0xFFFFFFFFu;
  struct ThreadRows {
    Rows::ThreadRows rows;
    uint32_t scale_src;  // token of tile row `thread` times H/128, or kNoRow past the expert's end
  };
  __device__ static ThreadRows rows_of(const Args& a, const Tile& tile, int32_t num_k_blocks, int thread) {
    ThreadRows r;
    r.rows = Rows::rows_of(a.rows, tile, num_k_blocks, thread);
    const int32_t row = tile.row_begin + thread;
    r.scale_src = row < tile.row_end ? static_cast<uint32_t>(__ldg(a.rows.row_slot + row) / a.rows.top_k) *
                                           static_cast<uint32_t>(num_k_blocks)
                                     : kNoRow;
    return r;
  }
  __device__ static void gather(const Args& a, const ThreadRows& r, uint32_t tile_a, uint32_t scales_a, int32_t kb,
                                int thread) {
    Rows::gather(a.rows, r.rows, tile_a, kb, thread);
    if (r.scale_src != kNoRow) cp_async_4(scales_a + thread * sizeof(float), a.x_scales + r.scale_src + kb);
  }
};

// Where the 128 x 128 block scales of a token-blocked B pool are: block (position block pb, feature
// block nb) at ptr[pb * n_blocks + nb].
struct TokenBlockScales {
  const float* ptr;
  int32_t n_blocks;  // N / 128 (rounded up): a 256-wide tile past the last block reads the last one's
};

// Rows [row0 + 128 m, +128) of the pool's position block row_begin / 128 + kb by TMA (the tile's
// row_begin is its expert's padded offset); producer thread p copies the scale of tile row p.
struct Fp8TokenBlockedA {
  static constexpr bool kGathered = false, kMnMajor = false, kBlockScaled = true, kScalesPerThread = true;
  static constexpr uint32_t kTmaBytes = kTileABytes;
  static_assert(kThreadsPerWarpgroup == kBlockM, "producer thread p copies the scale of tile row p");
  struct Args {
    CUtensorMap map;      // pool [P/128 * rows, 128] E4M3 (fp8_quantize.h), boxes [128 rows][128 positions]
    const float* scales;  // [P/128, rows] fp32, 1 x 128 along the positions
    int32_t rows;         // feature rows of the pool (the scales' row length)
    int32_t row0;         // the pool row of the output's first row (dW3 reads dz's up half: I)
    TokenBlockScales b_scales;
  };
  struct ThreadRows {};
  __device__ static void load(const Args& a, uint64_t* full, uint8_t* dst, const Tile& tile, int32_t kb) {
    const int32_t block = tile.row_begin / kFp8BlockK + kb;
    tma_load_2d(&a.map, full, dst, 0, block * a.rows + a.row0 + tile.m_tile * kBlockM);
  }
  __device__ static void copy_scale(const Args& a, const Tile& tile, int32_t kb, uint32_t scales_a, int thread) {
    const int64_t block = tile.row_begin / kFp8BlockK + kb;
    cp_async_4(scales_a + thread * sizeof(float), a.scales + block * a.rows + a.row0 + tile.m_tile * kBlockM + thread);
  }
};

// ------------------------------------------------------------------------------------- B

// What the B policies that read kBlockN K-major rows as one TMA box share: the tile's shape, its
// bytes, and the 128-row block of each half's scale (one per half: the promotion's). A half past the
// last block (a 256-wide tile over N % 256 == 128) takes the last block's scale: in bounds, and its
// columns are never stored.
template <int kBlockN_>
struct Fp8KMajorRowsB {
  static constexpr int kBlockN = kBlockN_, kTileCols = kBlockN_, kNumBScales = kBlockN_ / 128;
  static constexpr bool kMnMajor = false;
  static_assert(kBlockN == 128 || kBlockN == 256, "one or two 128-row blocks per tile");
  static constexpr uint32_t kBoxRows = kBlockN;
  __device__ static uint32_t bytes(const Tile&, const BShape&) { return kBlockN * kSwizzleRowBytes; }
  __device__ static int32_t half_block(const Tile& tile, int b, int32_t n_blocks) {
    return min(tile.n_tile * kNumBScales + b, n_blocks - 1);
  }
};

// [kBlockN rows][128 k] of one expert's weight. Rows past the expert's N (a 256-wide tile over
// N % 256 == 128) are read but their columns never stored.
template <int kBlockN_>
struct Fp8WeightsB : Fp8KMajorRowsB<kBlockN_> {
  using Base = Fp8KMajorRowsB<kBlockN_>;
  using Base::kNumBScales;
  using Base::kTileCols;
  __device__ static void load(const CUtensorMap* map, uint64_t* full, uint8_t* dst, const Tile& tile, int32_t kb,
                              const BShape& s) {
    tma_load_2d(map, full, dst, kb * kFp8BlockK, tile.expert * s.b_rows_per_expert + tile.n_tile * kTileCols);
  }
  // The 128 x 128 block of each half.
  __device__ static void load_scales(const WeightScales& w, uint32_t dst, const Tile& tile, int32_t kb) {
#pragma unroll
    for (int b = 0; b < kNumBScales; ++b) {
      const int32_t n_block = Base::half_block(tile, b, w.n_blocks);
      cp_async_4(dst + b * sizeof(float),
                 w.ptr + tile.expert * w.expert_stride + n_block * w.n_stride + kb * w.k_stride);
    }
  }
};

struct Fp8GateUpWeightsB {
  static constexpr int kBlockN = 256, kNumBScales = 2;
  static constexpr int kTileCols = kBlockN / 2;  // h columns per tile: one 128-block of h
  static constexpr bool kMnMajor = false;
  static constexpr uint32_t kBoxRows = kBlockN / 2;
  static_assert(kTileCols == kFp8BlockK, "a gate/up tile is exactly one 1 x 128 block of h");
  __device__ static uint32_t bytes(const Tile&, const BShape&) { return kBlockN * kSwizzleRowBytes; }
  // Rows [gate n0 .. +128 | up the same, I below], read as one [256, 128 k] K-major operand:
  // accumulator columns c (gate, first half) and c + 128 (up, second half) hold h column c.
  __device__ static void load(const CUtensorMap* map, uint64_t* full, uint8_t* dst, const Tile& tile, int32_t kb,
                              const BShape& s) {
    const int32_t k = kb * kFp8BlockK;
    const int32_t gate_row = tile.expert * s.b_rows_per_expert + tile.n_tile * kTileCols;
    tma_load_2d(map, full, dst, k, gate_row);
    tma_load_2d(map, full, dst + kBlockN / 2 * kSwizzleRowBytes, k, gate_row + s.n_valid);
  }
  // Gate rows of the tile lie in gate block n_tile, up rows in block I/128 + n_tile (w.second).
  __device__ static void load_scales(const WeightScales& w, uint32_t dst, const Tile& tile, int32_t kb) {
    const float* src = w.ptr + tile.expert * w.expert_stride + tile.n_tile * w.n_stride + kb * w.k_stride;
    cp_async_4(dst, src);
    cp_async_4(dst + sizeof(float), src + w.second);
  }
};

// [kBlockN rows][128 positions] of a token-blocked pool's position block at feature row n_tile *
// kBlockN; rows past N (the next block's first rows, or zeros past the pool) are never stored.
template <int kBlockN_>
struct Fp8TokenBlockedB : Fp8KMajorRowsB<kBlockN_> {
  using Base = Fp8KMajorRowsB<kBlockN_>;
  using Base::kNumBScales;
  using Base::kTileCols;
  __device__ static void load(const CUtensorMap* map, uint64_t* full, uint8_t* dst, const Tile& tile, int32_t kb,
                              const BShape& s) {
    const int32_t block = tile.row_begin / kFp8BlockK + kb;
    tma_load_2d(map, full, dst, 0, block * s.n_valid + tile.n_tile * kTileCols);
  }
  __device__ static void load_scales(const TokenBlockScales& w, uint32_t dst, const Tile& tile, int32_t kb) {
    const int64_t block = tile.row_begin / kFp8BlockK + kb;
#pragma unroll
    for (int b = 0; b < kNumBScales; ++b) {
      cp_async_4(dst + b * sizeof(float), w.ptr + block * w.n_blocks + Base::half_block(tile, b, w.n_blocks));
    }
  }
};

// ------------------------------------------------------------------------------------ loops

template <class Gemm>
struct GemmParams;

// The consumer loop with promotion, one 128-column half of the tile at a time (Gemm::kBlockN / 128
// halves; B's scale b[half] when B has one per half, else b[0]). The previous tile's held output
// (HeldBoxes) goes out under this tile's first K-block, whose promotion writes acc: acc and tmp are
// dead before it, so the held words take their registers (tmp 64 + held 64 there, acc 128 + tmp 64
// in the later K-blocks).
template <class Gemm>
__device__ __forceinline__ void consume_block_scaled(const GemmParams<Gemm>& p, typename Gemm::Scheduler sched,
                                                     const StageRing<Gemm::kStages>& ring, uint8_t* tiles_a,
                                                     uint8_t* tiles_b, const StageScales* scales, uint8_t* staging,
                                                     const ConsumerThread& me) {
  using Epilogue = typename Gemm::Epilogue;
  using Mma = WgmmaE4m3<128>;
  constexpr int kAcc = Gemm::kAccRegs;
  constexpr int kHalves = Gemm::kBlockN / 128;
  constexpr int kNumBScales = Gemm::B::kNumBScales;
  constexpr int kHeldBoxes = HeldBoxes<Epilogue>::kBoxes;
  static_assert(kHalves * Mma::kAccRegs == kAcc && kFp8BlockK / Mma::kK == 4, "four k32 MMAs per half and stage");
  static_assert(kNumBScales == 1 || kNumBScales == kHalves, "one B scale per tile or per half");
  // The second half's B rows start 128 swizzle rows into the stage (descriptor address units of 16 B).
  constexpr uint64_t kDescHalfStep = 128 * kSwizzleRowBytes / 16;
  const EpilogueShape out_shape{p.shape.n_valid, p.shape.m_valid};
  const int a_row = me.consumer * kWgmmaM + me.row_in_wg;  // this thread's rows: a_row, a_row + 8
  RingCursor<Gemm::kStages> cursor;
  float acc[kAcc], tmp[Mma::kAccRegs];
  typename HeldBoxes<Epilogue>::Held held{};
  auto half_of = [](float* regs, int half) -> float (&)[Mma::kAccRegs] {
    return *reinterpret_cast<float(*)[Mma::kAccRegs]>(regs + half * Mma::kAccRegs);
  };

  // Waits for the cursor's stage and reads what this thread needs of it.
  struct StageView {
    int stage;
    float sa0, sa1, sb[kNumBScales];  // the scales of this thread's rows a_row, a_row + 8 and of B
    uint64_t desc_a, desc_b;
  };
  auto open_stage = [&]() {
    StageView v;
    v.stage = cursor.stage;
    bounded_wait(&ring.full[v.stage], cursor.phase, p.shape.wait, WaitRole::kConsumer, WaitObject::kStageFull,
                 v.stage, Gemm::A::kTmaBytes + Gemm::kTileBBytes);
    if constexpr (Gemm::A::kGathered) fence_proxy_async_shared();  // cp.async rows -> wgmma reads
    // Scales first: the stage is released as soon as the MMAs have read it.
    const uint32_t stage_scales = smem_addr(scales + v.stage);
    v.sa0 = ld_shared_f32(stage_scales + a_row * sizeof(float));
    v.sa1 = ld_shared_f32(stage_scales + (a_row + 8) * sizeof(float));
#pragma unroll
    for (int i = 0; i < kNumBScales; ++i) {
      v.sb[i] = ld_shared_f32(stage_scales + offsetof(StageScales, b) + i * sizeof(float));
    }
    v.desc_a = make_desc_sw128(tiles_a + v.stage * kTileABytes + me.consumer * kWgmmaM * kSwizzleRowBytes,
                               Gemm::LayoutA::kLbo, Gemm::LayoutA::kSbo);
    v.desc_b = make_desc_sw128(tiles_b + v.stage * Gemm::kTileBBytes, Gemm::LayoutB::kLbo, Gemm::LayoutB::kSbo);
    return v;
  };
  // Every thread has read the stage's scales (some values still unused here) and releases its
  // own reads (Gemm::kStageReleases arrivals): no cross-lane order to establish, and racecheck,
  // which does not follow a __syncwarp before one lane's arrival, sees it
  // (docs/experiments.md#racecheck-and-one-lane-releases).
  auto release_stage = [&](const StageView& v) {
    if (!releases_withheld(p.shape.wait)) mbarrier_arrive(&ring.empty[v.stage]);
    cursor.advance();
  };
  // The four k32 MMAs of one half of a K-block, overwriting d (a constant scale_d = 0 first, which
  // ptxas sees: d's earlier values are dead, and their registers free, before it).
  auto mma_half = [&](float (&d)[Mma::kAccRegs], const StageView& v, int half) {
#pragma unroll
    for (int k = 0; k < kFp8BlockK / Mma::kK; ++k) {
      Mma::mma(d, v.desc_a + k * Gemm::LayoutA::kDescStepK16,
               v.desc_b + half * kDescHalfStep + k * Gemm::LayoutB::kDescStepK16, k > 0 ? 1u : 0u);
    }
  };

  // acc_half (+)= tmp * (scale_a[row] * scale_b[half]): `add` is std::false_type for a tile's first
  // K-block (acc is written, not read), std::true_type for the others.
  auto promote = [&](auto add, float (&acc_half)[Mma::kAccRegs], const float (&t)[Mma::kAccRegs], const StageView& v,
                     int half) {
    const float b_scale = v.sb[kNumBScales == 1 ? 0 : half];
    const float r0 = v.sa0 * b_scale, r1 = v.sa1 * b_scale;
#pragma unroll
    for (int j = 0; j < Mma::kAccRegs / 4; ++j) {
      if constexpr (decltype(add)::value) {
        acc_half[4 * j + 0] = fmaf(t[4 * j + 0], r0, acc_half[4 * j + 0]);
        acc_half[4 * j + 1] = fmaf(t[4 * j + 1], r0, acc_half[4 * j + 1]);
        acc_half[4 * j + 2] = fmaf(t[4 * j + 2], r1, acc_half[4 * j + 2]);
        acc_half[4 * j + 3] = fmaf(t[4 * j + 3], r1, acc_half[4 * j + 3]);
      } else {
        acc_half[4 * j + 0] = t[4 * j + 0] * r0;
        acc_half[4 * j + 1] = t[4 * j + 1] * r0;
        acc_half[4 * j + 2] = t[4 * j + 2] * r1;
        acc_half[4 * j + 3] = t[4 * j + 3] * r1;
      }
    }
  };

  // One K-block: per half, its MMAs into tmp, a wait, then the promotion into acc[half]. A tile's
  // first (first = std::true_type) also drains the previous tile's held output under its MMAs and
  // writes acc instead of adding to it.
  auto k_block = [&](auto first) {
    constexpr bool kFirst = decltype(first)::value;
    const StageView v = open_stage();
#pragma unroll
    for (int half = 0; half < kHalves; ++half) {
      wgmma_fence();  // tmp was read by the previous promotion
      mma_half(tmp, v, half);
      wgmma_commit_group();
      if constexpr (kHeldBoxes > 0) {
        if constexpr (kFirst) {
          constexpr int kUnits = (kHeldBoxes + kHalves - 1) / kHalves;
#pragma unroll
          for (int i = half * kUnits; i < (half + 1) * kUnits && i < kHeldBoxes; ++i) {
            Epilogue::drain(p.epilogue, out_shape, staging, held, i, me);
          }
        }
      }
      wgmma_wait_group<0>();
      fence_accumulators(tmp);
      if (half == kHalves - 1) release_stage(v);
      promote(std::bool_constant<!kFirst>{}, half_of(acc, half), tmp, v, half);
    }
  };

  const int32_t num_tiles = sched.num_tiles();
  for (int32_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const Tile tile = sched.tile(t);
    if constexpr (Gemm::Scheduler::kReducesOverRows) {
      if (tile.num_k_blocks == 0) {
        // An expert without rows (weight gradients): no stage comes. The previous tile's held
        // output goes out, then the epilogue stores zeros (or nothing, accumulating). acc is
        // zeroed so it is not live across tiles (it is no wgmma operand here: tmp is).
        if constexpr (kHeldBoxes > 0) {
#pragma unroll
          for (int i = 0; i < kHeldBoxes; ++i) Epilogue::drain(p.epilogue, out_shape, staging, held, i, me);
        }
#pragma unroll
        for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
        const AccRows rows(tile, me);
        typename Epilogue::Inputs inputs = Epilogue::prepare(p.epilogue, out_shape, tile, rows, me);
        Epilogue::store(p.epilogue, out_shape, tile, rows, inputs, acc, staging, held, me);
        continue;
      }
    }
    // acc[64 rows, kBlockN] = sum over the tile's K-blocks (a row tile has at least one) of
    // promoted A[rows, kb] * B[kb, kBlockN]. The first K-block is peeled so that acc is dead before
    // it (its promotion writes acc rather than adding to it): the previous tile's held words then
    // take acc's registers while this block's MMAs run, and go out under them, half the units
    // under each half's MMAs.
    k_block(std::true_type{});
    // Loaded after the held stores, so their registers are free there; the rest of the main loop
    // hides their latency.
    const AccRows rows(tile, me);
    typename Epilogue::Inputs inputs = Epilogue::prepare(p.epilogue, out_shape, tile, rows, me);
    for (int32_t kb = 1; kb < tile.num_k_blocks; ++kb) k_block(std::false_type{});
    if constexpr (HeldBoxes<Epilogue>::kHolds) {
      Epilogue::store(p.epilogue, out_shape, tile, rows, inputs, acc, staging, held, me);
    } else {
      Epilogue::store(p.epilogue, out_shape, tile, rows, inputs, acc, staging, me);
    }
  }
  if constexpr (kHeldBoxes > 0) {
#pragma unroll
    for (int i = 0; i < kHeldBoxes; ++i) Epilogue::drain(p.epilogue, out_shape, staging, held, i, me);
  }
  Epilogue::finish(me);
}

}  // namespace fusemoe::sm90

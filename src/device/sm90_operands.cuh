// Operand policies of the sm90 grouped GEMM: where the A and B tiles of one (tile, k-block)
// stage come from, in which major, and how many bytes the stage's TMA loads deliver.
//
//   A (activations, 128 rows x 64 k per stage, 16 KB)
//     PoolRowsA                     K-major rows of a pool, one TMA box at (k, row_begin)
//     PoolRowsTransposedA           M-major (weight gradients: act_m^T), two [64 k-rows][64 m] boxes
//     GatheredTokenRowsA            K-major token rows gathered by index by all 128 producer threads
//     GatheredTokenRowsTransposedA  M-major token rows gathered likewise (dW2: dy rows^T)
//   B (weights or activations, kBlockN x 64 k per stage)
//     WeightsB                      K-major weight rows: one [kBlockN rows][64 k] box
//     GateUpWeightsB                K-major gate rows and the up rows I below them, [kBlockN/2]
//                                   each, so gate column c and up column c land in one thread's
//                                   accumulators
//     WeightsTransposedB            N-major weight [K rows][N cols]: kBlockN/64 boxes [64 k][64 n]
//     PoolRowsTransposedB           N-major pool rows (weight gradients: act_n), boxes as above
//     GatheredTokenRowsTransposedB  N-major token rows gathered by the producer threads (dW13: x rows)
// Each policy has Args (its kernel arguments) and ThreadRows (a producer thread's gather state,
// empty for TMA). Shared-memory layouts: see the wgmma section of sm90_ptx.cuh. An MN-major B box
// wholly past N is not loaded (its columns are never stored). A new element type (FP8 with block
// scales) is a new policy here plus its MMA, not a new kernel.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "device/sm90_layout.cuh"
#include "device/sm90_ptx.cuh"
#include "device/sm90_schedulers.cuh"

namespace fusemoe::sm90 {

// ------------------------------------------------------------------------------------- A

struct PoolRowsA {
  static constexpr bool kGathered = false, kMnMajor = false;
  static constexpr uint32_t kTmaBytes = kTileABytes;
  struct Args {
    CUtensorMap map;  // pool [R_max, K] bf16, boxes [128 rows][64 k]
  };
  struct ThreadRows {};
  __device__ static void load(const Args& a, uint64_t* full, uint8_t* dst, const Tile& tile, int32_t kb) {
    tma_load_2d(&a.map, full, dst, kb * kBlockK, tile.row_begin);
  }
};

struct PoolRowsTransposedA {
  static constexpr bool kGathered = false, kMnMajor = true;
  static constexpr uint32_t kTmaBytes = kTileABytes;
  struct Args {
    CUtensorMap map;  // pool [R_max, M] bf16, boxes [64 rows][64 m]
  };
  struct ThreadRows {};
  // Consumer c's box holds columns m0 + 64c of the output tile's rows.
  __device__ static void load(const Args& a, uint64_t* full, uint8_t* dst, const Tile& tile, int32_t kb) {
    const int32_t row = tile.row_begin + kb * kBlockK;
    const int32_t m0 = tile.m_tile * kBlockM;
    tma_load_2d(&a.map, full, dst, m0, row);
    tma_load_2d(&a.map, full, dst + kMnBoxBytes, m0 + kWgmmaM, row);
  }
};

// Row r of a tile is token row_slot[r] / top_k of x. Thread p copies 16-byte chunk p % 8 of
// tile rows p / 8 + 16 i (i < 8) to the swizzled place a TMA box would have used (chunk c of
// row r at c ^ (r % 8)); rows past the expert's end are not copied (their accumulator rows are
// never stored, and each depends on its own A row only). Row addresses are 32-bit indices of
// 16-byte chunks (x < 64 GiB, checked at the API) to fit the producer's 40 registers.
struct GatheredTokenRowsA {
  static constexpr bool kGathered = true, kMnMajor = false;
  static constexpr uint32_t kTmaBytes = 0;
  static constexpr int kChunksPerRow = kSwizzleRowBytes / 16;
  static constexpr int kRowStep = kThreadsPerWarpgroup / kChunksPerRow;  // 16 rows per pass
  static constexpr int kRowsPerThread = kBlockM / kRowStep;              // 8 copies per stage
  static_assert(kBlockM % kRowStep == 0 && kRowStep % 8 == 0,
                "gathered rows spread evenly over the producer threads, and each thread's rows share one "
                "swizzle phase (row % 8)");
  struct Args {
    const __nv_bfloat16* x;   // [T, H] token rows
    const int32_t* row_slot;  // [R_max]: flat slot t*K + j of each sorted row
    int32_t top_k;
  };

  // One thread's rows of one tile.
  struct ThreadRows {
    uint32_t src_chunk[kRowsPerThread];  // first chunk of the x row of tile row row0 + 16 i
    int32_t rows_left;                   // copy i happens iff 16 i < rows_left
  };

  __device__ static ThreadRows rows_of(const Args& a, const Tile& tile, int32_t num_k_blocks, int thread) {
    const int row0 = thread / kChunksPerRow;
    const uint32_t chunks_per_x_row = static_cast<uint32_t>(num_k_blocks) * kChunksPerRow;  // H / 8
    ThreadRows r;
    r.rows_left = tile.row_end - tile.row_begin - row0;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int32_t row = tile.row_begin + row0 + kRowStep * i;
      const int32_t token = kRowStep * i < r.rows_left ? __ldg(a.row_slot + row) / a.top_k : 0;
      r.src_chunk[i] = static_cast<uint32_t>(token) * chunks_per_x_row;
    }
    return r;
  }

  // Issues the copies of K-block kb into the stage at shared address tile_a.
  __device__ static void gather(const Args& a, const ThreadRows& r, uint32_t tile_a, int32_t kb, int thread) {
    const int chunk = thread % kChunksPerRow;
    const int row0 = thread / kChunksPerRow;
    // Rows row0 + 16 i all have row % 8 == row0 % 8, so one swizzled offset serves every copy.
    const uint32_t dst = tile_a + row0 * kSwizzleRowBytes + ((chunk ^ (row0 % 8)) * 16);
    const uint4* src = reinterpret_cast<const uint4*>(a.x) + chunk + kb * kChunksPerRow;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      if (kRowStep * i < r.rows_left) cp_async_16(dst + i * kRowStep * kSwizzleRowBytes, src + r.src_chunk[i]);
    }
  }
};

// Token rows read MN-major by a reduction over rows (the weight gradients, whose K runs over an
// expert's rows). A stage is kBoxes boxes [64 k-rows][64 columns]; k-row kk holds columns
// [c0, c0 + 64 kBoxes) of token row_slot[row] / top_k, row = row_begin + 64 kb + kk (c0: the
// tile's first M column for A, N column for B), at the places a TMA box of a pool would have
// used: 16-byte chunk c of box b at b * 8 KB + kk * 128 + (c ^ kk % 8) * 16. A k-row is C = 8 kBoxes
// chunks, copied by C lanes of one warp (one copy instruction reads whole 128-byte lines); warp w
// copies the k-rows with kk % 8 in {2w, 2w + 1}, so each thread's copies share one swizzle (two
// when a warp copy is one k-row). Lane l holds the token of the k-row of copy l % C of the lanes
// l / C (loaded one K-block ahead) and hands it out with a shuffle of width C. k-rows at or past
// the expert's end are not copied (the consumers zero a partial K-block's k-rows, as for pool
// boxes), nor columns past the row (never stored). Row addresses are 32-bit chunk indices as in
// GatheredTokenRowsA.
enum class OperandSide { kA, kB };

struct TokenRowsArgs {
  const __nv_bfloat16* x;   // [T, row_chunks * 8] token rows
  const int32_t* row_slot;  // [R_max]: flat slot t*K + j of each sorted row
  int32_t top_k;
  int32_t row_chunks;       // 16-byte chunks per token row
};

template <OperandSide kSide, int kBoxes>
struct GatheredTokenRowsTransposed {
  static constexpr bool kGathered = true, kMnMajor = true;
  static constexpr uint32_t kTmaBytes = 0;
  static constexpr int kBoxCols = kSwizzleRowBytes / 2;
  static constexpr int kBlockN = kBoxes * kBoxCols, kTileCols = kBlockN;     // as B
  static constexpr int kChunksPerRow = kBoxes * kSwizzleRowBytes / 16;        // C
  static constexpr int kRowsPerCopy = 32 / kChunksPerRow;                     // k-rows of one warp copy
  static constexpr int kCopies = kMnBoxRows * kChunksPerRow / kThreadsPerWarpgroup;  // per thread and stage
  static constexpr int kResiduesPerWarp = 8 / kWarpsPerWarpgroup;             // values of kk % 8 per warp
  static_assert(32 % kChunksPerRow == 0 && kCopies <= kChunksPerRow, "a lane holds the token of each copy");
  static_assert(kCopies / 8 * kRowsPerCopy == kResiduesPerWarp, "copies cover 8 k-rows per residue");
  static_assert(kSide == OperandSide::kB || kBoxes * kMnBoxBytes == kTileABytes, "A is two boxes");
  using Args = TokenRowsArgs;

  struct ThreadRows {
    int32_t block_row;   // first pool row of the next K-block to copy
    int32_t row_end;     // the expert's end
    int32_t token;       // token of this lane's k-row of that block (0 at or past the end)
    uint32_t col_chunk;  // this lane's chunk of a token row: c0 / 8 + l % C
  };

  // kk % 8 of copy c by the lanes l / C == sub_row of warp w; the copy's k-row is 8 (c % 8) + it.
  __device__ static int residue(int c, int sub_row, int warp) {
    return kResiduesPerWarp * warp + c / 8 * kRowsPerCopy + sub_row;
  }
  // The token this lane holds: of its k-row of the block at block_row.
  __device__ static int32_t load_token(const Args& a, int32_t block_row, int32_t row_end, int thread) {
    const int lane = thread % 32, c = lane % kChunksPerRow % kCopies;
    const int32_t row = block_row + 8 * (c % 8) + residue(c, lane / kChunksPerRow, thread / 32);
    return row < row_end ? __ldg(a.row_slot + row) / a.top_k : 0;
  }

  __device__ static ThreadRows rows_of(const Args& a, const Tile& tile, int32_t /*num_k_blocks*/, int thread) {
    const int32_t c0 = (kSide == OperandSide::kA ? tile.m_tile : tile.n_tile) * kBlockN;
    ThreadRows r;
    r.block_row = tile.row_begin;
    r.row_end = tile.row_end;
    r.token = load_token(a, r.block_row, r.row_end, thread);
    r.col_chunk = static_cast<uint32_t>(c0 / 8 + thread % 32 % kChunksPerRow);
    return r;
  }

  // Issues the copies of the block at r.block_row into the stage at shared address tile, then
  // loads the tokens of the next block (their latency hides under the wait for a free stage).
  __device__ static void gather(const Args& a, ThreadRows& r, uint32_t tile, int32_t /*kb*/, int thread) {
    const int lane = thread % 32, warp = thread / 32;
    const int chunk = lane % kChunksPerRow, sub_row = lane / kChunksPerRow;
    const int32_t valid_rows = r.row_end - r.block_row;
    const bool col_valid = r.col_chunk < static_cast<uint32_t>(a.row_chunks);
    const uint4* src = reinterpret_cast<const uint4*>(a.x) + r.col_chunk;
#pragma unroll
    for (int c = 0; c < kCopies; ++c) {
      const int kk_low = residue(c, sub_row, warp);
      const int32_t token = __shfl_sync(0xFFFFFFFFu, r.token, c, kChunksPerRow);
      const uint32_t dst = tile + chunk / 8 * kMnBoxBytes + (c % 8) * kSwizzleAtomBytes + kk_low * kSwizzleRowBytes +
                           ((chunk % 8) ^ kk_low) * 16;
      if (8 * (c % 8) + kk_low < valid_rows && col_valid) {
        cp_async_16(dst, src + static_cast<uint32_t>(token) * static_cast<uint32_t>(a.row_chunks));
      }
    }
    r.block_row += kBlockK;
    r.token = load_token(a, r.block_row, r.row_end, thread);
  }
};

using GatheredTokenRowsTransposedA = GatheredTokenRowsTransposed<OperandSide::kA, kTileABytes / kMnBoxBytes>;

// ------------------------------------------------------------------------------------- B

// The sizes the B policies read (the kernel's GemmShape).
struct BShape {
  int32_t n_valid;            // output columns N (gate/up: I)
  int32_t b_rows_per_expert;  // rows of one expert's weight in the B map
};

// What the B policies read by TMA share: the tensor map as their arguments, no gather state.
struct TmaB {
  static constexpr bool kGathered = false;
  struct Args {
    CUtensorMap map;
  };
  struct ThreadRows {};
};

template <int kBlockN_>
struct WeightsB : TmaB {
  static constexpr int kBlockN = kBlockN_, kTileCols = kBlockN_;
  static constexpr bool kMnMajor = false;
  static_assert(kBlockN <= 256, "TMA box dimension limit");
  static constexpr uint32_t kBoxRows = kBlockN;
  __device__ static uint32_t bytes(const Tile&, const BShape&) { return kBlockN * kSwizzleRowBytes; }
  __device__ static void load(const Args& b, uint64_t* full, uint8_t* dst, const Tile& tile, int32_t kb,
                              const BShape& s) {
    tma_load_2d(&b.map, full, dst, kb * kBlockK, tile.expert * s.b_rows_per_expert + tile.n_tile * kTileCols);
  }
};

template <int kBlockN_>
struct GateUpWeightsB : TmaB {
  static constexpr int kBlockN = kBlockN_, kTileCols = kBlockN_ / 2;
  static constexpr bool kMnMajor = false;
  static constexpr uint32_t kBoxRows = kBlockN / 2;
  __device__ static uint32_t bytes(const Tile&, const BShape&) { return kBlockN * kSwizzleRowBytes; }
  // Rows [gate n0 .. n0 + kBlockN/2 | up n0 ..], which then read as one [kBlockN, 64] K-major
  // operand: accumulator columns c (gate) and c + kBlockN/2 (up) hold one output column.
  __device__ static void load(const Args& b, uint64_t* full, uint8_t* dst, const Tile& tile, int32_t kb,
                              const BShape& s) {
    const int32_t k = kb * kBlockK;
    const int32_t gate_row = tile.expert * s.b_rows_per_expert + tile.n_tile * kTileCols;
    tma_load_2d(&b.map, full, dst, k, gate_row);
    tma_load_2d(&b.map, full, dst + kBlockN / 2 * kSwizzleRowBytes, k, gate_row + s.n_valid);  // up: I rows below
  }
};

// Where the K rows of a transposed B operand start: in the expert's weight [E * rows, N], or at
// the tile's first pool row (the weight gradient, whose K runs over the expert's rows).
enum class TransposedBRows { kExpertWeight, kPoolRow };

// B read MN-major: N-major boxes [64 k][64 n] at (n0 + 64 j, k_row) for the boxes that start
// before N.
template <int kBlockN_, TransposedBRows kRows>
struct TransposedB : TmaB {
  static constexpr int kBlockN = kBlockN_, kTileCols = kBlockN_;
  static constexpr bool kMnMajor = true;
  static constexpr uint32_t kBoxRows = kMnBoxRows;
  static constexpr int kMaxBoxes = kBlockN / 64;
  __device__ static int32_t count(const Tile& tile, const BShape& s) {
    return min(kMaxBoxes, (s.n_valid - tile.n_tile * kBlockN + 63) / 64);
  }
  __device__ static uint32_t bytes(const Tile& tile, const BShape& s) { return count(tile, s) * kMnBoxBytes; }
  __device__ static void load(const Args& b, uint64_t* full, uint8_t* dst, const Tile& tile, int32_t kb,
                              const BShape& s) {
    const int32_t k_row0 = kRows == TransposedBRows::kExpertWeight ? tile.expert * s.b_rows_per_expert : tile.row_begin;
    const int32_t k_row = k_row0 + kb * kBlockK;
    const int32_t n0 = tile.n_tile * kBlockN, boxes = count(tile, s);
    for (int j = 0; j < boxes; ++j) tma_load_2d(&b.map, full, dst + j * kMnBoxBytes, n0 + 64 * j, k_row);
  }
};

template <int kBlockN>
using WeightsTransposedB = TransposedB<kBlockN, TransposedBRows::kExpertWeight>;
template <int kBlockN>
using PoolRowsTransposedB = TransposedB<kBlockN, TransposedBRows::kPoolRow>;

// Gathered token rows as B: nothing arrives by TMA.
template <int kBlockN>
struct GatheredTokenRowsTransposedB : GatheredTokenRowsTransposed<OperandSide::kB, kBlockN / 64> {
  __device__ static uint32_t bytes(const Tile&, const BShape&) { return 0; }
};

}  // namespace fusemoe::sm90

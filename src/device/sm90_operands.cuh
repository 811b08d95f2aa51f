// Operand policies of the sm90 grouped GEMM: where the A and B tiles of one (tile, k-block)
// stage come from, in which major, and how many bytes the stage's TMA loads deliver.
//
//   A (activations, 128 rows x 64 k per stage, 16 KB)
//     PoolRowsA            K-major rows of a pool, one TMA box at (k, row_begin); an expert's
//                          last tile in 32-row boxes and zeros past them (load_pool_row_tile)
//     PoolRowsTransposedA  M-major (weight gradients: act_m^T), two [64 k-rows][64 m] boxes
//     GatheredTokenRowsA   K-major token rows gathered by index by all 128 producer threads
//   B (weights or activations, kBlockN x 64 k per stage)
//     WeightsB             K-major weight rows: one [kBlockN rows][64 k] box
//     GateUpWeightsB       K-major gate rows and the up rows I below them, [kBlockN/2] each, so
//                          gate column c and up column c land in one thread's accumulators
//     WeightsTransposedB   N-major weight [K rows][N cols]: kBlockN/64 boxes [64 k][64 n]
//     PoolRowsTransposedB  N-major pool rows (weight gradients: act_n), boxes as above
//   B from separate gate and up weights w1, w3 [E, I, H] (two tensor maps, kTwoMaps): the same
//   shared-memory image as the policy above it over w13 [E, 2I, H], so the MMAs see the same data
//     SeparateGateUpWeightsB       as GateUpWeightsB: the gate box from w1, the up box from w3
//     SeparateWeightsB             as WeightsB over the 2I rows [w1_e; w3_e]: [64 rows][64 k] boxes
//     SeparateWeightsTransposedB   as WeightsTransposedB over the K rows [w1_e; w3_e]
// Shared-memory layouts: see the wgmma section of sm90_ptx.cuh. An MN-major B box wholly past
// N is not loaded (its columns are never stored). A new element type (FP8 with block scales)
// is a new policy here plus its MMA, not a new kernel.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "device/sm90_layout.cuh"
#include "device/sm90_ptx.cuh"
#include "device/sm90_schedulers.cuh"

namespace fusemoe::sm90 {

// ------------------------------------------------------------------------------------- A

// The row boxes of one K-block of a pool row tile (K-major, one 128-byte swizzle row per pool row).
// A tile of more than 96 rows is one box of `whole`. An expert's last tile with v <= 96 rows takes
// rows [0, v32) from the pool in boxes of `quarter` (32 rows; v32: v rounded up to 32) and zeros
// in rows [v32, 128): quarter boxes at row -32, wholly outside the pool, which TMA fills with zeros
// and still counts. Those rows were the next expert's; their results are never stored either way,
// but MMAs on zeros draw less power (as the gathered rows' zero fill). Each box starts at a
// multiple of 32 rows (of the 8-row swizzle period), so the swizzle's phase stays that of one
// whole box. At most 4 boxes a stage: 8 (16-row boxes, or 8- to 64-row boxes from four maps)
// slowed the TMA-bound GEMMs by up to 23% (docs/experiments.md#zero-filled-pool-tails).
constexpr int kQuarterRows = kBlockM / 4;
__device__ __forceinline__ void load_pool_row_tile(const CUtensorMap& whole, const CUtensorMap& quarter,
                                                   uint64_t* full, uint8_t* dst, int32_t k, const Tile& tile) {
  const int32_t rows = tile.row_end - tile.row_begin;
  if (rows > kBlockM - kQuarterRows) {
    tma_load_2d(&whole, full, dst, k, tile.row_begin);
    return;
  }
#pragma unroll
  for (int q = 0; q < kBlockM / kQuarterRows; ++q) {
    const int32_t r = q * kQuarterRows;
    tma_load_2d(&quarter, full, dst + r * kSwizzleRowBytes, k, r < rows ? tile.row_begin + r : -kQuarterRows);
  }
}

struct PoolRowsA {
  static constexpr bool kGathered = false, kMnMajor = false;
  static constexpr uint32_t kTmaBytes = kTileABytes;
  struct Args {
    CUtensorMap map;      // pool [R_max, K] bf16, boxes [128 rows][64 k]
    CUtensorMap quarter;  // the same pool, boxes [32 rows][64 k]
  };
  struct ThreadRows {};
  __device__ static void load(const Args& a, uint64_t* full, uint8_t* dst, const Tile& tile, int32_t kb) {
    load_pool_row_tile(a.map, a.quarter, full, dst, kb * kBlockK, tile);
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
// row r at c ^ (r % 8)); rows past the expert's end are zero-filled, not read (their accumulator
// rows are never stored, and each depends on its own A row only; MMAs on zeros draw less power
// than on the stale rows of the stage's last fill, and the layer runs at the power cap). Row
// addresses are 32-bit indices of 16-byte chunks (x < 64 GiB, checked at the API) to fit the
// producer's 40 registers.
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
      cp_async_16_zfill(dst + i * kRowStep * kSwizzleRowBytes, src + r.src_chunk[i], kRowStep * i < r.rows_left ? 16u : 0u);
    }
  }
};

// ------------------------------------------------------------------------------------- B

// The sizes the B policies read (the kernel's GemmShape).
struct BShape {
  int32_t n_valid;            // output columns N (gate/up: I)
  int32_t b_rows_per_expert;  // rows of one expert's weight in the B map
};

template <int kBlockN_>
struct WeightsB {
  static constexpr int kBlockN = kBlockN_, kTileCols = kBlockN_;
  static constexpr bool kMnMajor = false;
  static_assert(kBlockN <= 256, "TMA box dimension limit");
  static constexpr uint32_t kBoxRows = kBlockN;
  __device__ static uint32_t bytes(const Tile&, const BShape&) { return kBlockN * kSwizzleRowBytes; }
  __device__ static void load(const CUtensorMap* map, uint64_t* full, uint8_t* dst, const Tile& tile, int32_t kb,
                              const BShape& s) {
    tma_load_2d(map, full, dst, kb * kBlockK, tile.expert * s.b_rows_per_expert + tile.n_tile * kTileCols);
  }
};

template <int kBlockN_>
struct GateUpWeightsB {
  static constexpr int kBlockN = kBlockN_, kTileCols = kBlockN_ / 2;
  static constexpr bool kMnMajor = false;
  static constexpr uint32_t kBoxRows = kBlockN / 2;
  __device__ static uint32_t bytes(const Tile&, const BShape&) { return kBlockN * kSwizzleRowBytes; }
  // Rows [gate n0 .. n0 + kBlockN/2 | up n0 ..], which then read as one [kBlockN, 64] K-major
  // operand: accumulator columns c (gate) and c + kBlockN/2 (up) hold one output column.
  __device__ static void load(const CUtensorMap* map, uint64_t* full, uint8_t* dst, const Tile& tile, int32_t kb,
                              const BShape& s) {
    const int32_t k = kb * kBlockK;
    const int32_t gate_row = tile.expert * s.b_rows_per_expert + tile.n_tile * kTileCols;
    tma_load_2d(map, full, dst, k, gate_row);
    tma_load_2d(map, full, dst + kBlockN / 2 * kSwizzleRowBytes, k, gate_row + s.n_valid);  // up: I rows below
  }
};

// ------------------------------------------------------ B from separate gate and up weights
// Two maps, gate (w1) and up (w3), each [E * I rows, H], I = BShape::b_rows_per_expert. A policy
// with kTwoMaps loads from both (GemmParams then carries map_b_up); every box lies wholly in one
// of them (I % 64 == 0), and lands where the box of the w13 policy would have put it.

template <int kBlockN_>
struct SeparateGateUpWeightsB {
  static constexpr int kBlockN = kBlockN_, kTileCols = kBlockN_ / 2;
  static constexpr bool kMnMajor = false, kTwoMaps = true;
  static constexpr uint32_t kBoxRows = kBlockN / 2;
  __device__ static uint32_t bytes(const Tile&, const BShape&) { return kBlockN * kSwizzleRowBytes; }
  __device__ static void load(const CUtensorMap* gate_map, const CUtensorMap* up_map, uint64_t* full, uint8_t* dst,
                              const Tile& tile, int32_t kb, const BShape& s) {
    const int32_t k = kb * kBlockK;
    const int32_t row = tile.expert * s.b_rows_per_expert + tile.n_tile * kTileCols;
    tma_load_2d(gate_map, full, dst, k, row);
    tma_load_2d(up_map, full, dst + kBlockN / 2 * kSwizzleRowBytes, k, row);
  }
};

// Output columns [0, I) are gate rows, [I, 2I) up rows. A box past 2I (the last tile of an expert)
// reads the next expert's up rows or zeros out of bounds: its columns are never stored, and TMA
// counts a box's full bytes either way.
template <int kBlockN_>
struct SeparateWeightsB {
  static constexpr int kBlockN = kBlockN_, kTileCols = kBlockN_;
  static constexpr bool kMnMajor = false, kTwoMaps = true;
  static constexpr uint32_t kBoxRows = 64;  // a box never straddles the gate/up boundary (I % 64 == 0)
  static constexpr int kBoxes = kBlockN / kBoxRows;
  __device__ static uint32_t bytes(const Tile&, const BShape&) { return kBlockN * kSwizzleRowBytes; }
  __device__ static void load(const CUtensorMap* gate_map, const CUtensorMap* up_map, uint64_t* full, uint8_t* dst,
                              const Tile& tile, int32_t kb, const BShape& s) {
    const int32_t k = kb * kBlockK;
    const int32_t col0 = tile.n_tile * kTileCols;
    const int32_t gate_row = tile.expert * s.b_rows_per_expert + col0;  // of box 0, in the gate map
    // Two passes, one map each: selecting a map per box kept both addresses live in the producer's
    // 40 registers and spilled.
#pragma unroll
    for (int j = 0; j < kBoxes; ++j) {
      if (col0 + j * kBoxRows < s.b_rows_per_expert) {
        tma_load_2d(gate_map, full, dst + j * kBoxRows * kSwizzleRowBytes, k, gate_row + j * kBoxRows);
      }
    }
#pragma unroll
    for (int j = 0; j < kBoxes; ++j) {
      if (col0 + j * kBoxRows >= s.b_rows_per_expert) {
        tma_load_2d(up_map, full, dst + j * kBoxRows * kSwizzleRowBytes, k,
                    gate_row + j * kBoxRows - s.b_rows_per_expert);
      }
    }
  }
};

// Where the K rows of a transposed B operand start: in the expert's weight [E * rows, N], or at
// the tile's first pool row (the weight gradient, whose K runs over the expert's rows).
enum class TransposedBRows { kExpertWeight, kPoolRow };

// B read MN-major: N-major boxes [64 k][64 n] at (n0 + 64 j, k_row) for the boxes that start
// before N.
template <int kBlockN_, TransposedBRows kRows>
struct TransposedB {
  static constexpr int kBlockN = kBlockN_, kTileCols = kBlockN_;
  static constexpr bool kMnMajor = true;
  static constexpr uint32_t kBoxRows = kMnBoxRows;
  static constexpr int kMaxBoxes = kBlockN / 64;
  __device__ static int32_t count(const Tile& tile, const BShape& s) {
    return min(kMaxBoxes, (s.n_valid - tile.n_tile * kBlockN + 63) / 64);
  }
  __device__ static uint32_t bytes(const Tile& tile, const BShape& s) { return count(tile, s) * kMnBoxBytes; }
  __device__ static void load(const CUtensorMap* map, uint64_t* full, uint8_t* dst, const Tile& tile, int32_t kb,
                              const BShape& s) {
    const int32_t k_row0 = kRows == TransposedBRows::kExpertWeight ? tile.expert * s.b_rows_per_expert : tile.row_begin;
    const int32_t k_row = k_row0 + kb * kBlockK;
    const int32_t n0 = tile.n_tile * kBlockN, boxes = count(tile, s);
    for (int j = 0; j < boxes; ++j) tma_load_2d(map, full, dst + j * kMnBoxBytes, n0 + 64 * j, k_row);
  }
};

template <int kBlockN>
using WeightsTransposedB = TransposedB<kBlockN, TransposedBRows::kExpertWeight>;

// K rows [0, I) of the expert from the gate map, [I, 2I) from the up map; each 64-row K-block lies
// in one of them.
template <int kBlockN_>
struct SeparateWeightsTransposedB {
  using Boxes = TransposedB<kBlockN_, TransposedBRows::kExpertWeight>;
  static constexpr int kBlockN = kBlockN_, kTileCols = kBlockN_;
  static constexpr bool kMnMajor = true, kTwoMaps = true;
  static constexpr uint32_t kBoxRows = kMnBoxRows;
  __device__ static uint32_t bytes(const Tile& tile, const BShape& s) { return Boxes::bytes(tile, s); }
  __device__ static void load(const CUtensorMap* gate_map, const CUtensorMap* up_map, uint64_t* full, uint8_t* dst,
                              const Tile& tile, int32_t kb, const BShape& s) {
    const int32_t k = kb * kBlockK;
    const bool gate = k < s.b_rows_per_expert;
    const CUtensorMap* map = gate ? gate_map : up_map;
    const int32_t k_row = tile.expert * s.b_rows_per_expert + (gate ? k : k - s.b_rows_per_expert);
    const int32_t n0 = tile.n_tile * kBlockN, boxes = Boxes::count(tile, s);
    for (int j = 0; j < boxes; ++j) tma_load_2d(map, full, dst + j * kMnBoxBytes, n0 + 64 * j, k_row);
  }
};
template <int kBlockN>
using PoolRowsTransposedB = TransposedB<kBlockN, TransposedBRows::kPoolRow>;

}  // namespace fusemoe::sm90

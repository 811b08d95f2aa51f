// Tile schedulers of the sm90 grouped GEMM over an expert-sorted row pool. Both derive their
// tile list on the device from expert_offsets [E+1] (no host sync: CUDA-graph capturable), and
// the kernel hands the tile indices t to its CTAs (a counter or round-robin: sm90_grouped_gemm.cuh).
//
// RowTileScheduler: output tiles of 128 pool rows x kTileCols columns, expert-major:
//   m_tiles(e)  = ceil((offsets[e+1] - offsets[e]) / 128)         (0 for an empty expert)
//   m_prefix[e] = sum_{e' < e} m_tiles(e')                         (shared memory, E+1 ints)
//   tile t      = m_prefix[e] * num_n_tiles + n * m_tiles(e) + m   (expert, then n, then m)
// so the m-tiles that read one weight slice (n) run at the same time on neighbouring CTAs and
// the slice comes from HBM once (docs/experiments.md#expert-tile-order). K = the GEMM's inner size.
//
// ExpertOutputTiles<kKRows> (weight gradients): output tile (m, n) of an expert's [M, N]
// gradient, reducing over all of the expert's rows (K = its row count, in kKRows-row blocks from
// its first row; one CTA per output tile, so the sum has a fixed order). Expert-major, m fastest.
// It needs no table: a tile reads its expert's two offsets from global memory (two loads per
// tile of 4+ K-blocks), which leaves the table's shared memory to the stage ring. BF16 reads the
// pools' offsets in 64-row blocks (ExpertOutputTileScheduler); FP8 the token-blocked pools'
// padded offsets (multiples of 128) in 128-row blocks.
#pragma once

#include <cstdint>

#include "device/sm90_layout.cuh"

namespace fusemoe::sm90 {

// One work item of either scheduler.
struct Tile {
  int32_t expert;        // e
  int32_t row_begin;     // row tiles: first pool row, offsets[e] + 128 m; output tiles: offsets[e]
  int32_t row_end;       // offsets[e+1]: rows >= row_end belong to another expert (never stored)
  int32_t m_tile;        // output tiles: m (rows [128 m, 128 m + 128) of the expert's output)
  int32_t n_tile;        // n
  int32_t num_k_blocks;  // 64-wide K-blocks to reduce over (0 for an empty expert's output tile)
};

// Shared-memory tables for the tile list; lives in the kernel's dynamic shared memory.
struct ExpertTileTable {
  int32_t* offsets;   // [E + 1] copy of expert_offsets
  int32_t* m_prefix;  // [E + 1]
  int32_t num_experts;
  int32_t num_n_tiles;

  __device__ __forceinline__ int32_t num_tiles() const {
    return m_prefix[num_experts] * num_n_tiles;
  }
};

// Fills the table from global expert_offsets. Called by every thread of the CTA; ends with
// __syncthreads(). Warp 0 scans: lane l owns experts [l * chunk, (l + 1) * chunk).
__device__ __forceinline__ void build_expert_tile_table(const int32_t* __restrict__ expert_offsets,
                                                        ExpertTileTable& table) {
  const int num_experts = table.num_experts;
  for (int i = threadIdx.x; i <= num_experts; i += blockDim.x) table.offsets[i] = expert_offsets[i];
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int chunk = (num_experts + 31) / 32;
    const int begin = min(lane * chunk, num_experts);
    const int end = min(begin + chunk, num_experts);
    int32_t local = 0;
    for (int e = begin; e < end; ++e) {
      local += (table.offsets[e + 1] - table.offsets[e] + kBlockM - 1) / kBlockM;
    }
    int32_t inclusive = local;
#pragma unroll
    for (int delta = 1; delta < 32; delta *= 2) {
      const int32_t other = __shfl_up_sync(0xFFFFFFFFu, inclusive, delta);
      if (lane >= delta) inclusive += other;
    }
    int32_t running = inclusive - local;
    for (int e = begin; e < end; ++e) {
      table.m_prefix[e] = running;
      running += (table.offsets[e + 1] - table.offsets[e] + kBlockM - 1) / kBlockM;
    }
    if (lane == 31) table.m_prefix[num_experts] = inclusive;
  }
  __syncthreads();
}

// Each role (producer, consumer warpgroups) keeps its own scheduler copy; a CTA's t only grows
// (in either tile order), so the row-tile cursor walks the experts forward once per CTA, and all
// roles see the same sequence.
struct RowTileScheduler {
  static constexpr bool kReducesOverRows = false;
  static constexpr bool kTableInSmem = true;
  ExpertTileTable table;
  int32_t num_k_blocks;  // K / 64
  int32_t expert = 0;    // cursor

  __device__ __forceinline__ int32_t num_tiles() const { return table.num_tiles(); }

  __device__ __forceinline__ Tile tile(int32_t t) {
    // Empty experts have m_prefix[e] == m_prefix[e+1] and are skipped here.
    while (table.m_prefix[expert + 1] * table.num_n_tiles <= t) ++expert;
    const int32_t m_tiles = table.m_prefix[expert + 1] - table.m_prefix[expert];
    const int32_t local = t - table.m_prefix[expert] * table.num_n_tiles;
    const int32_t n_tile = local / m_tiles, m_tile = local - n_tile * m_tiles;
    Tile out;
    out.expert = expert;
    out.row_begin = table.offsets[expert] + m_tile * kBlockM;
    out.row_end = table.offsets[expert + 1];
    out.m_tile = 0;
    out.n_tile = n_tile;
    out.num_k_blocks = num_k_blocks;
    return out;
  }
};

template <int kKRows>
struct ExpertOutputTiles {
  static constexpr bool kReducesOverRows = true;
  static constexpr bool kTableInSmem = false;
  const int32_t* offsets;  // [E + 1] expert_offsets, global
  int32_t num_experts;
  int32_t num_n_tiles;
  int32_t num_m_tiles;     // M / 128

  __device__ __forceinline__ int32_t num_tiles() const { return num_experts * num_m_tiles * num_n_tiles; }

  __device__ __forceinline__ Tile tile(int32_t t) const {
    // m varies fastest inside an expert, so neighbouring CTAs share the act_n slice (n) and the
    // expert's rows stay in L2 while its tiles run.
    const int32_t per_expert = num_m_tiles * num_n_tiles;
    Tile out;
    out.expert = t / per_expert;
    const int32_t local = t - out.expert * per_expert;
    out.n_tile = local / num_m_tiles;
    out.m_tile = local - out.n_tile * num_m_tiles;
    out.row_begin = offsets[out.expert];
    out.row_end = offsets[out.expert + 1];
    out.num_k_blocks = (out.row_end - out.row_begin + kKRows - 1) / kKRows;
    return out;
  }
};
// Named types, not aliases: the kernels' names (CUPTI's records, kernel_times_table.py) keep them.
struct ExpertOutputTileScheduler : ExpertOutputTiles<kBlockK> {};
struct TokenBlockOutputTileScheduler : ExpertOutputTiles<2 * kBlockK> {};  // FP8: 128 E4M3 a K-block

}  // namespace fusemoe::sm90

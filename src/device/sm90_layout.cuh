// Tile shape, thread roles and shared-memory budget of the sm90 grouped GEMM
// (src/kernels/sm90_grouped_gemm.cuh): one definition for every instance of the kernel.
//
// A CTA is 3 warpgroups at one CTA per SM: warpgroup 0 produces (TMA loads, or row gathers by
// all its threads), warpgroups 1 and 2 consume (wgmma m64 x kBlockN x k16, then the epilogue).
// Consumer c owns tile rows [64c, 64c + 64). Operands are bf16 tiles with TMA's 128-byte
// swizzle: a K-block is 64 bf16, one 128-byte swizzle row.
#pragma once

#include <cstdint>

namespace fusemoe::sm90 {

constexpr int kWgmmaM = 64;
constexpr int kWgmmaK = 16;
constexpr int kNumConsumers = 2;
constexpr int kBlockM = kNumConsumers * kWgmmaM;  // rows of a tile: each consumer owns 64
constexpr int kBlockK = 64;                       // bf16 per 128-byte swizzle row
constexpr int kThreadsPerWarpgroup = 128;
constexpr int kThreads = kThreadsPerWarpgroup * (1 + kNumConsumers);
constexpr int kWarpsPerWarpgroup = kThreadsPerWarpgroup / 32;

// Register split at one CTA per SM (64K registers): the producer keeps a few scalars, the
// consumers up to 128 fp32 accumulators plus epilogue temporaries.
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(kProducerRegs * kThreadsPerWarpgroup + kConsumerRegs * kThreadsPerWarpgroup * kNumConsumers <= 65536,
              "register split exceeds the register file");

// Shared memory: the stage ring and an epilogue's staging share kSmemDataBytes; the rest of the
// 227 KB holds the alignment slack, the barriers, the tile table of up to kMaxExperts and, in
// block-scaled (FP8) instances, the ring of stage scale records.
constexpr int kSmemDataBytes = 208 * 1024;
// An instance whose scheduler keeps no tile table in shared memory (the weight gradients) has
// 16 KB more: with their staging that is a fourth 48 KB stage.
constexpr int kSmemDataBytesNoTable = 224 * 1024;
constexpr int kSmemOptinBytes = 227 * 1024;  // sm90's most dynamic shared memory per block
constexpr int kSmemAlign = 1024;  // 128B-swizzle atoms start 1024-byte aligned
constexpr int kMaxExperts = 1024;

constexpr int kSwizzleRowBytes = 128;                       // one TMA box row
constexpr int kSwizzleAtomBytes = 1024;                     // 8 rows x 128 B
constexpr int kMnBoxRows = 64;                              // k-rows per MN-major TMA box
constexpr int kMnBoxBytes = kMnBoxRows * kSwizzleRowBytes;  // 8 KB
constexpr int kTileABytes = kBlockM * kBlockK * 2;          // 16 KB: [128 rows][64 k] or 2 MN boxes

static_assert(kBlockK * 2 == kSwizzleRowBytes && kBlockK == kMnBoxRows,
              "a K-block is one swizzle row (K-major) or one box of k-rows (MN-major)");
static_assert(kWgmmaM * kSwizzleRowBytes == kMnBoxBytes,
              "a consumer's A operand starts one MN box (or 64 K-major rows) into the stage");

// How the consumer warpgroups share a CTA's tiles, a template choice of each instance:
//   CooperativeConsumers  both run every tile, consumer c its rows [64c, 64c + 64) (one m64
//                         accumulator block each); their epilogues run at the same time.
//   PingPongConsumers     consumer c takes the CTA's tiles of local index i with i % 2 == c whole
//                         (two m64 blocks, rows [0, 64) and [64, 128)), so one warpgroup's
//                         epilogue runs under the other's MMAs. The main loops take turns
//                         (kOrderBarrierId0): besides keeping the tensor cores fed by one
//                         warpgroup at a time, the turn keeps a consumer from waiting on a stage's
//                         full barrier while the fill before it (the other's) is still in flight,
//                         which the parity wait could not tell apart from its own fill.
//                         Figures: docs/experiments.md#ping-pong-consumers.
struct CooperativeConsumers {
  static constexpr bool kPingPong = false;
  static constexpr int kRowBlocks = 1;                   // m64 accumulator blocks per consumer
  static constexpr int kWarpgroupsPerTile = kNumConsumers;
};
struct PingPongConsumers {
  static constexpr bool kPingPong = true;
  static constexpr int kRowBlocks = kBlockM / kWgmmaM;   // the whole tile
  static constexpr int kWarpgroupsPerTile = 1;
};

// Tile order of a cooperative row-tile instance. Static: CTA i takes tiles i, i + grid, ... .
// Dynamic: each CTA takes the next tile index from a counter as it goes (TileFeed,
// sm90_grouped_gemm.cuh), so CTAs whose tiles run short (an expert's thin last tile) do not drift
// ahead of those that share their weight slice; the launch then needs Sm90Rows::tile_counter.
// docs/experiments.md#dynamic-tile-order.
struct StaticTileOrder {
  static constexpr bool kDynamic = false;
};
struct DynamicTileOrder {
  static constexpr bool kDynamic = true;
};

// Named barriers (0 is __syncthreads).
constexpr uint32_t kConsumersBarrierId = 1;   // both consumer warpgroups
constexpr uint32_t kStagingBarrierId0 = 2;    // + consumer: one warpgroup's staging
constexpr uint32_t kOrderBarrierId0 = 4;      // + consumer: its turn to run a main loop (ping-pong)

}  // namespace fusemoe::sm90

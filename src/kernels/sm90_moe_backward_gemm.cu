// Grouped GEMMs of the fused MoE backward on sm_90a (math and shapes in
// sm90_moe_backward_gemm.h). One persistent, warp-specialised kernel template, four modes:
//
//   mode            tile (M x N)                 A (smem)               B (smem)
//   kRecomputeZ     128 pool rows x 256 of 2I    xs, K-major            W13_e rows, K-major
//   kDgradSwiglu    128 pool rows x 128|256 of I dys, K-major         W2_e [H, I], N-major
//   kDgradScatter   128 pool rows x 256 of H     dz, K-major            W13_e [2I, H], N-major
//   kWeightGrad     128 of M x 256 of N          act_m rows, M-major    act_n rows, N-major
//
// Thread roles (384 threads, one CTA per SM, static round-robin over an expert-major tile list
// built on the device from expert_offsets):
//   warpgroup 0 (producer, 40 registers): one thread issues the TMA loads of every
//     (tile, k-block) into a kStages-deep ring; it runs ahead across tiles.
//   warpgroups 1, 2 (consumers, setmaxnreg 232; ptxas still compiles them within the launch
//     bound's 168): consumer c owns tile rows [64c, 64c + 64) and issues wgmma m64 x N x k16,
//     then runs the mode's epilogue from the fp32 registers.
//   Ring protocol: full[s] (1 arrival + TMA bytes), empty[s] (one arrival per consumer warp).
//
// Weight gradients reduce over an expert's pool rows, K-blocks of 64 rows starting at the
// expert's first row. The last block of an expert whose row count is not a multiple of 64 also
// holds the next expert's rows (or rows past the pool end, zero-filled by TMA, or unused pool
// rows with arbitrary bits): the consumers zero those k-rows in shared memory before the MMA
// (both operands, so that 0 * NaN never occurs), so no foreign row enters the sum and the pools
// need no padding. Rows of another expert in a row tile (rows modes) are computed, never stored.
#include "kernels/sm90_moe_backward_gemm.h"

#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "device/sm90_expert_tiles.cuh"
#include "device/sm90_fragment.cuh"
#include "device/sm90_host.h"
#include "device/sm90_ptx.cuh"
#include "fusemoe/error.h"

namespace fusemoe {
namespace sm90 {
namespace bwd {

constexpr int kBlockM = 128;  // tile rows: kNumConsumers warpgroups x wgmma M (64)
constexpr int kWgmmaM = 64;
constexpr int kBlockK = 64;   // one 128-byte swizzle row of bf16; also the k-rows of an MN box
constexpr int kWgmmaK = 16;
constexpr int kNumConsumers = 2;
constexpr int kThreadsPerWarpgroup = 128;
constexpr int kThreads = kThreadsPerWarpgroup * (1 + kNumConsumers);
// Producer: a few scalars. Consumers: up to 128 fp32 accumulators plus epilogue temporaries.
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
constexpr int kMaxExpertsInSmem = 1024;      // tile table: 2 x (E+1) int32 in shared memory
constexpr uint32_t kConsumerBarrierId = 1;   // named barrier of the two consumer warpgroups
constexpr uint32_t kStagingBarrierId0 = 2;   // + consumer: one warpgroup's staging barrier

static_assert(kBlockM == kNumConsumers * kWgmmaM, "each consumer warpgroup owns 64 tile rows");
static_assert(kBlockK * 2 == kSwizzleRowBytes && kBlockK == kMnBoxRows,
              "a K-block is one swizzle row (K-major) or one box of k-rows (MN-major)");
static_assert(kProducerRegs * kThreadsPerWarpgroup +
                  kConsumerRegs * kThreadsPerWarpgroup * kNumConsumers <= 65536,
              "register split exceeds the register file");

enum class Mode { kRecomputeZ, kDgradSwiglu, kDgradScatter, kWeightGrad };

// Per mode: operand majors and the tile width (kDgradSwiglu: 128 or 256, chosen at launch).
template <Mode kMode>
struct ModeShape;
template <>
struct ModeShape<Mode::kRecomputeZ> {
  static constexpr bool kAMnMajor = false, kBMnMajor = false;
};
template <>
struct ModeShape<Mode::kDgradSwiglu> {
  static constexpr bool kAMnMajor = false, kBMnMajor = true;
};
template <>
struct ModeShape<Mode::kDgradScatter> {
  static constexpr bool kAMnMajor = false, kBMnMajor = true;
};
template <>
struct ModeShape<Mode::kWeightGrad> {
  static constexpr bool kAMnMajor = true, kBMnMajor = true;
};

// Ring and output staging share 208 KB of the 227 KB of shared memory (the rest: alignment,
// barriers, the tile table of up to 1024 experts). Rows modes: no staging, 4 stages of 48 KB
// at kBlockN = 256, 6 of 32 KB at 128. kWeightGrad: 64 KB of staging (32 KB per consumer
// warpgroup: 4 boxes of [64 rows][128 B]) and 3 stages of 48 KB.
constexpr int kSmemDataBytes = 208 * 1024;
constexpr int kStagingBoxBytes = kWgmmaM * 128;  // one TMA store box: 64 rows x 128 bytes
constexpr int kStagingBoxes = 4;                 // per consumer warpgroup and pass

template <Mode kMode, int kBlockN_>
struct KernelConfig : ModeShape<kMode> {
  using Shape = ModeShape<kMode>;
  static constexpr int kBlockN = kBlockN_;
  // A: [128 rows][64 k] K-major, or two MN boxes [64 k][64 m] (box c = consumer c's rows):
  // either way consumer c's operand starts kWgmmaM * 128 bytes into the stage.
  static constexpr int kTileABytes = kBlockM * kBlockK * 2;
  static constexpr int kTileBBytes = kBlockN * kBlockK * 2;
  static constexpr int kStageBytes = kTileABytes + kTileBBytes;
  static constexpr int kStagingBytes =
      kMode == Mode::kWeightGrad ? kNumConsumers * kStagingBoxes * kStagingBoxBytes : 0;
  static constexpr int kStages = (kSmemDataBytes - kStagingBytes) / kStageBytes;
  static constexpr bool kAMnMajor = Shape::kAMnMajor, kBMnMajor = Shape::kBMnMajor;
  static constexpr int kNumBBoxes = kBMnMajor ? kBlockN / 64 : 1;  // TMA boxes of B per stage
  static constexpr int kAccRegs = kBlockN / 2;
  static constexpr int kGroups = kBlockN / 32;  // groups of 4 n8 chunks (one quad transpose)
  // kDgradSwiglu: z chunks (16 B of gate + 16 B of up each, 8 registers) in flight ahead of the
  // epilogue. ptxas allocates within the launch bound's 168 registers (observed: it spills
  // once the consumers' live set passes that, setmaxnreg or not): at kBlockN = 128 (64 accumulators) all 8 chunks of the tile's two rows load
  // before the main loop; at 256 (128 accumulators) only 1 fits without spilling.
  static constexpr int kZAhead = kBlockN == 128 ? 2 * kGroups : 1;
  static constexpr int kAlign = 1024;           // 128B-swizzle atoms start 1024-byte aligned
  using LayoutA = OperandLayout<kAMnMajor>;
  using LayoutB = OperandLayout<kBMnMajor>;
  using Mma = Wgmma<kBlockN, kAMnMajor ? 1 : 0, kBMnMajor ? 1 : 0>;

  static_assert(kBlockN == 128 || kBlockN == 256, "wgmma N of the wrappers");
  static_assert(kStages >= 3, "a ring of at least 3 stages keeps TMA ahead of the MMAs");
  static_assert(kTileABytes % kAlign == 0 && kTileBBytes % kAlign == 0, "stage alignment");
  static_assert(kWgmmaM * kSwizzleRowBytes == kMnBoxBytes, "consumer offset is one MN box");
  static_assert(kBMnMajor || kBlockN <= 256, "TMA box dimension limit");
  static_assert(kMode != Mode::kWeightGrad || kBlockN == 256,
                "weight-grad staging: 256 columns = 4 boxes of 64 bf16, or 2 passes of 4 boxes of 32 fp32");

  static size_t smem_bytes(int num_experts) {
    return kAlign + static_cast<size_t>(kStages) * kStageBytes + kStagingBytes + 2 * kStages * sizeof(uint64_t) +
           2 * (static_cast<size_t>(num_experts) + 1) * sizeof(int32_t);
  }
};

// Everything the kernel needs besides the two tensor maps (by value, in the param space).
struct KernelArgs {
  const int32_t* expert_offsets;  // [E+1]
  int32_t num_experts;
  int32_t num_k_blocks;           // rows modes: K / kBlockK
  int32_t n_valid;                // output columns N
  int32_t m_valid;                // kWeightGrad: output rows M per expert
  int32_t b_rows_per_expert;      // rows modes: rows of one expert's weight in the B map
  // kRecomputeZ (z rows) and kDgradScatter (dx slot rows): bf16 output rows
  __nv_bfloat16* out_rows;
  int64_t out_row_stride;
  const int32_t* row_slot;        // [R_max]
  // kDgradSwiglu
  const float* topk_weights;      // [S]
  const __nv_bfloat16* z;         // [R_max, 2I]
  __nv_bfloat16* dz;              // [R_max, 2I]
  __nv_bfloat16* wh;              // [R_max, I]
  float* router_partials;         // [R_max, num_n_tiles]
  int32_t num_n_tiles;
  int32_t intermediate;
  int32_t use_clamp;
  float clamp;
  // kWeightGrad
  void* grad;                     // [E, M, N]
  int32_t grad_bf16;
  int32_t accumulate;
};
// KernelArgs' size reaches ptxas's choices for every mode: 16 more bytes once cost dW2 / dW13
// 8-10% (docs/perf.md, fifth session). A change of size needs a same-run timing of every mode.
static_assert(sizeof(KernelArgs) == 128, "KernelArgs' size moves ptxas's code for every mode: see above");

// One work item: rows modes use the expert's pool rows [row_begin, row_begin + 128) and output
// column tile n_tile; kWeightGrad uses output tile (m_tile, n_tile) of expert `expert` and
// reduces over pool rows [row_begin, row_end).
struct Tile {
  int32_t expert;
  int32_t row_begin;
  int32_t row_end;
  int32_t m_tile;
  int32_t n_tile;
  int32_t num_k_blocks;
};

template <Mode kMode>
struct TileScheduler {
  ExpertTileTable table;
  ExpertTileCursor<kBlockM> cursor;
  int32_t num_m_tiles;  // kWeightGrad: M / 128
  int32_t num_n_tiles;

  __device__ __forceinline__ int32_t num_tiles() const {
    if constexpr (kMode == Mode::kWeightGrad) {
      return table.num_experts * num_m_tiles * num_n_tiles;
    } else {
      return table.num_tiles();
    }
  }

  __device__ __forceinline__ Tile tile(int32_t t, const KernelArgs& args) {
    Tile out;
    if constexpr (kMode == Mode::kWeightGrad) {
      // Expert-major; inside an expert m varies fastest, so neighbouring CTAs share the act_n
      // slice (n) and the expert's rows stay in L2 while its tiles run.
      const int32_t per_expert = num_m_tiles * num_n_tiles;
      out.expert = t / per_expert;
      const int32_t local = t - out.expert * per_expert;
      out.n_tile = local / num_m_tiles;
      out.m_tile = local - out.n_tile * num_m_tiles;
      out.row_begin = table.offsets[out.expert];
      out.row_end = table.offsets[out.expert + 1];
      out.num_k_blocks = (out.row_end - out.row_begin + kBlockK - 1) / kBlockK;
    } else {
      const ExpertTile et = cursor.tile(table, t);
      out.expert = et.expert;
      out.row_begin = et.row_begin;
      out.row_end = et.row_end;
      out.m_tile = 0;
      out.n_tile = et.n_tile;
      out.num_k_blocks = args.num_k_blocks;
    }
    return out;
  }
};

// ------------------------------------------------------------------------- epilogue helpers

// The 8 fp32 accumulator values of row half h (rows l/4 and l/4 + 8) in chunk 4a + q, in
// column order: out[2p + b] = column 8(4a + q) + 2p + b.
template <int kAccRegs>
__device__ __forceinline__ void gather_chunk_fp32(const float (&acc)[kAccRegs], int a, int h, int q,
                                                  float (&out)[8]) {
  float even[4], odd[4];
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    even[p] = acc[4 * (4 * a + p) + 2 * h];
    odd[p] = acc[4 * (4 * a + p) + 2 * h + 1];
  }
  quad_transpose(even, q);
  quad_transpose(odd, q);
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    out[2 * p] = even[p];
    out[2 * p + 1] = odd[p];
  }
}

// As gather_chunk_fp32, rounded to bf16 and packed: one 16-byte row segment.
template <int kAccRegs>
__device__ __forceinline__ uint4 gather_chunk_bf16(const float (&acc)[kAccRegs], int a, int h, int q) {
  uint32_t w[4];
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    w[p] = pack_bf16x2(acc[4 * (4 * a + p) + 2 * h], acc[4 * (4 * a + p) + 2 * h + 1]);
  }
  quad_transpose(w, q);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// dgrad + SwiGLU epilogue input: the gate and up halves of z for one accumulator row, one
// 16-byte chunk per group of this lane's columns (column n0 + 8(4a + q), as gather_chunk_fp32
// orders them). The loads are unconditional (a row or column outside the tile reads z's first
// chunk, never used) so they can be issued ahead of their use (KernelConfig::kZAhead): loaded
// behind a branch, each chunk cost the epilogue one DRAM round trip. Measured (standalone
// test, same run): dgrad-1 at 30B R=131072 1.254 -> 0.972 ms, at 235B R=131072 3.577 -> 3.461.
__device__ __forceinline__ void load_z_chunk(const KernelArgs& args, int64_t row, bool row_valid, int32_t n0, int q,
                                             int a, uint4& gate, uint4& up) {
  const int64_t I = args.intermediate;
  const int64_t col = n0 + 8 * (4 * a + q);
  const bool ok = row_valid && col < I;
  const __nv_bfloat16* g = ok ? args.z + row * 2 * I + col : args.z;
  gate = __ldg(reinterpret_cast<const uint4*>(g));
  up = __ldg(reinterpret_cast<const uint4*>(ok ? g + I : args.z));
}

// Zeroes k-rows [valid_rows, 64) of one MN-major box (a k-row is one contiguous 128-byte line:
// the swizzle only permutes 16-byte chunks inside it). Called by the 128 threads of a
// warpgroup, thread index `tid`.
__device__ __forceinline__ void zero_box_rows(uint8_t* box, int valid_rows, int tid) {
  constexpr int kVecsPerRow = kSwizzleRowBytes / 16;
  const int first = valid_rows * kVecsPerRow;
  for (int i = first + tid; i < kMnBoxRows * kVecsPerRow; i += kThreadsPerWarpgroup) {
    *reinterpret_cast<uint4*>(box + i * 16) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// Weight-gradient epilogue of one consumer warpgroup: its 64 rows x 256 columns of the output
// tile go through its 32 KB of shared-memory staging, 4 boxes of [64 rows][128 B] (the
// 128-byte swizzle: 16-byte chunk c of row r sits at chunk c ^ (r % 8), so the fragment
// writes are bank-conflict free) per pass, and out through TMA stores that drain while the
// warpgroup runs the next tile's main loop (the register epilogue stalled the tensor cores
// for the whole DRAM write of every tile). fp32: two passes of 128 columns (32 per box);
// bf16: one pass of 256 (64 per box). Accumulate mode adds the old value in fp32 first, as
// before: the same bits.
struct WeightGradStore {
  const CUtensorMap* map;  // grad as [E*M rows, N], boxes of [64 rows][128 B]
  uint8_t* staging;        // this warpgroup's 4 boxes, 1024-byte aligned
  int32_t row0;            // grad row of the warpgroup's first tile row: e*M + m0 + 64c
  int32_t n0;              // first column of the tile
  int row_in_wg;           // this thread's accumulator rows: row_in_wg, row_in_wg + 8
  int q;                   // lane % 4: columns 2q, 2q + 1 of each n8 chunk
  int tid_in_wg;
  uint32_t barrier_id;
  bool acc_valid;          // false: the expert has no rows, store zeros

  // Stages accumulator chunks [kFirst, kFirst + kChunks) (8 columns each) and stores them.
  // kAccumulate is a template parameter so that the overwrite pass has no load and no branch
  // per element whatever the compiler's unswitching heuristics decide: left to them, adding
  // 16 bytes to KernelArgs turned the two specialised copies into one branchy one and dW2/dW13
  // ran 8-10% slower (H200, standalone test, 2026-11-29, fifth session).
  template <bool kFp32, int kFirst, int kChunks, bool kAccumulate, int kAccRegs>
  __device__ __forceinline__ void pass(const float (&acc)[kAccRegs], const KernelArgs& args) const {
    constexpr int kChunksPerBox = kFp32 ? 4 : 8;  // 128 B of fp32 or bf16
    static_assert(kChunks == kStagingBoxes * kChunksPerBox, "a pass fills the 4 staging boxes");
    const int64_t N = args.n_valid;
    // The staging is free once the previous pass's stores have read it.
    if (tid_in_wg == 0) bulk_wait_group_read<0>();
    named_barrier_sync(barrier_id, kThreadsPerWarpgroup);
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int box = j / kChunksPerBox;
      const int64_t col = n0 + 8 * (kFirst + j) + 2 * q;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = row_in_wg + 8 * h;
        float v0 = acc_valid ? acc[4 * (kFirst + j) + 2 * h] : 0.0f;
        float v1 = acc_valid ? acc[4 * (kFirst + j) + 2 * h + 1] : 0.0f;
        const int64_t offset = static_cast<int64_t>(row0 + r) * N + col;
        if (kAccumulate && col < N) {
          if constexpr (kFp32) {
            const float2 old = *reinterpret_cast<const float2*>(static_cast<const float*>(args.grad) + offset);
            v0 += old.x;
            v1 += old.y;
          } else {
            const __nv_bfloat162 old =
                *reinterpret_cast<const __nv_bfloat162*>(static_cast<const __nv_bfloat16*>(args.grad) + offset);
            v0 += __low2float(old);
            v1 += __high2float(old);
          }
        }
        uint8_t* line = staging + box * kStagingBoxBytes + r * 128;
        if constexpr (kFp32) {
          const int chunk = 2 * (j % 4) + q / 2;  // byte 32 (j % 4) + 8q of the line
          *reinterpret_cast<float2*>(line + ((chunk ^ (r % 8)) * 16) + (q % 2) * 8) = make_float2(v0, v1);
        } else {
          const int chunk = j % 8;  // byte 16 (j % 8) + 4q of the line
          *reinterpret_cast<uint32_t*>(line + ((chunk ^ (r % 8)) * 16) + q * 4) = pack_bf16x2(v0, v1);
        }
      }
    }
    fence_proxy_async_shared();
    named_barrier_sync(barrier_id, kThreadsPerWarpgroup);
    if (tid_in_wg == 0) {
      constexpr int kBoxCols = 8 * kChunksPerBox;
#pragma unroll
      for (int b = 0; b < kStagingBoxes; ++b) {
        const int32_t col = n0 + 8 * kFirst + b * kBoxCols;
        if (col < N) tma_store_2d(map, staging + b * kStagingBoxBytes, col, row0);
      }
      bulk_commit_group();
    }
  }
};

template <Mode kMode, int kBlockN_>
__global__ void __launch_bounds__(kThreads, 1)
    moe_backward_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                             const __grid_constant__ CUtensorMap map_b,
                             const __grid_constant__ CUtensorMap map_out, const KernelArgs args) {
  using Config = KernelConfig<kMode, kBlockN_>;
  constexpr int kBlockN = Config::kBlockN;
  constexpr int kStages = Config::kStages;
  constexpr int kAccRegs = Config::kAccRegs;

  // ---- shared memory: [stages x A tile] [stages x B tile] [full, empty barriers] [tile table]
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + Config::kAlign - 1) & ~uintptr_t(Config::kAlign - 1));
  uint8_t* tiles_a = smem;                                  // [kStages][16 KB]
  uint8_t* tiles_b = smem + kStages * Config::kTileABytes;  // [kStages][kBlockN x 128 B]
  uint8_t* staging = smem + kStages * Config::kStageBytes;  // kWeightGrad: [2][4 boxes x 8 KB]
  uint64_t* full = reinterpret_cast<uint64_t*>(staging + Config::kStagingBytes);
  uint64_t* empty = full + kStages;
  TileScheduler<kMode> sched;
  sched.table.offsets = reinterpret_cast<int32_t*>(empty + kStages);
  sched.table.m_prefix = sched.table.offsets + args.num_experts + 1;
  sched.table.num_experts = args.num_experts;
  sched.num_n_tiles = (args.n_valid + kBlockN - 1) / kBlockN;
  sched.table.num_n_tiles = sched.num_n_tiles;
  sched.num_m_tiles = args.m_valid / kBlockM;

  const int warpgroup = threadIdx.x / kThreadsPerWarpgroup;
  const int warp_in_wg = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    prefetch_tensor_map(&map_a);
    prefetch_tensor_map(&map_b);
    if constexpr (kMode == Mode::kWeightGrad) prefetch_tensor_map(&map_out);
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], kNumConsumers * 4);
    }
    fence_barrier_init();
  }
  build_expert_tile_table<kBlockM>(args.expert_offsets, sched.table);  // ends with __syncthreads()
  const int32_t num_tiles = sched.num_tiles();

  if (warpgroup == 0) {
    // ================================ producer ================================
    setmaxnreg_dec<kProducerRegs>();
    if (warp_in_wg == 0 && lane == 0) {
      int stage = 0;
      uint32_t phase = 0;
      for (int32_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
        const Tile tile = sched.tile(t, args);
        const int32_t n0 = tile.n_tile * kBlockN;
        // MN-major B boxes wholly past N are not loaded (their columns are never stored).
        const int32_t num_b_boxes =
            Config::kBMnMajor ? min(Config::kNumBBoxes, (args.n_valid - n0 + 63) / 64) : 1;
        const uint32_t stage_bytes =
            Config::kTileABytes + (Config::kBMnMajor ? num_b_boxes * kMnBoxBytes : Config::kTileBBytes);
        for (int32_t kb = 0; kb < tile.num_k_blocks; ++kb) {
          mbarrier_wait(&empty[stage], phase ^ 1);
          mbarrier_arrive_expect_tx(&full[stage], stage_bytes);
          uint8_t* tile_a = tiles_a + stage * Config::kTileABytes;
          uint8_t* tile_b = tiles_b + stage * Config::kTileBBytes;
          if constexpr (kMode == Mode::kWeightGrad) {
            const int32_t row = tile.row_begin + kb * kBlockK;
            const int32_t m0 = tile.m_tile * kBlockM;
            tma_load_2d(&map_a, &full[stage], tile_a, m0, row);
            tma_load_2d(&map_a, &full[stage], tile_a + kMnBoxBytes, m0 + kWgmmaM, row);
            for (int j = 0; j < num_b_boxes; ++j) {
              tma_load_2d(&map_b, &full[stage], tile_b + j * kMnBoxBytes, n0 + 64 * j, row);
            }
          } else {
            const int32_t k = kb * kBlockK;
            tma_load_2d(&map_a, &full[stage], tile_a, k, tile.row_begin);
            const int32_t b_row0 = tile.expert * args.b_rows_per_expert;
            if constexpr (Config::kBMnMajor) {
              for (int j = 0; j < num_b_boxes; ++j) {
                tma_load_2d(&map_b, &full[stage], tile_b + j * kMnBoxBytes, n0 + 64 * j, b_row0 + k);
              }
            } else {
              tma_load_2d(&map_b, &full[stage], tile_b, k, b_row0 + n0);
            }
          }
          if (++stage == kStages) { stage = 0; phase ^= 1; }
        }
      }
    }
  } else {
    // ================================ consumers ================================
    setmaxnreg_inc<kConsumerRegs>();
    const int consumer = warpgroup - 1;
    const int tid_in_wg = threadIdx.x % kThreadsPerWarpgroup;
    const int q = lane % 4;
    const int row_in_wg = warp_in_wg * 16 + lane / 4;  // accumulator rows row_in_wg, +8
    float acc[kAccRegs];
    int stage = 0;
    uint32_t phase = 0;
    for (int32_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      const Tile tile = sched.tile(t, args);
      const int32_t n0 = tile.n_tile * kBlockN;

      // Row-mode epilogue inputs, loaded now so their latency hides under the main loop.
      const int32_t wg_row0 = tile.row_begin + consumer * kWgmmaM;
      const int32_t rows[2] = {wg_row0 + row_in_wg, wg_row0 + row_in_wg + 8};
      const bool row_valid[2] = {rows[0] < tile.row_end, rows[1] < tile.row_end};
      int32_t slots[2] = {0, 0};
      float weights[2] = {0.0f, 0.0f};
      if constexpr (kMode == Mode::kDgradScatter || kMode == Mode::kDgradSwiglu) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (row_valid[h]) {
            slots[h] = __ldg(args.row_slot + rows[h]);
            if constexpr (kMode == Mode::kDgradSwiglu) weights[h] = __ldg(args.topk_weights + slots[h]);
          }
        }
      }
      // kDgradSwiglu: the first kZAhead z chunks (all of them at width 128) load now and are in
      // flight during the main loop; each chunk the epilogue consumes frees its registers for
      // the chunk kZAhead further on.
      constexpr int kZChunks = 2 * Config::kGroups;  // chunk c: row half c / kGroups, group c % kGroups
      constexpr int kZAhead = Config::kZAhead;
      uint4 z_gate[kZAhead], z_up[kZAhead];
      if constexpr (kMode == Mode::kDgradSwiglu) {
#pragma unroll
        for (int c = 0; c < kZAhead; ++c) {
          load_z_chunk(args, rows[c / Config::kGroups], row_valid[c / Config::kGroups], n0, q, c % Config::kGroups,
                       z_gate[c], z_up[c]);
        }
      }

      // ---- main loop: acc[64 rows, kBlockN] = A[64 rows of consumer c, K] * B[K, kBlockN]
      int prev_stage = 0;
      for (int32_t kb = 0; kb < tile.num_k_blocks; ++kb) {
        mbarrier_wait(&full[stage], phase);
        uint8_t* tile_a = tiles_a + stage * Config::kTileABytes;
        uint8_t* tile_b = tiles_b + stage * Config::kTileBBytes;
        if constexpr (kMode == Mode::kWeightGrad) {
          const int32_t valid_rows = tile.row_end - tile.row_begin - kb * kBlockK;
          if (valid_rows < kBlockK) {  // the expert's last, partial K-block: same for both WGs
            zero_box_rows(tile_a + consumer * kMnBoxBytes, valid_rows, tid_in_wg);
            for (int j = consumer; j < Config::kNumBBoxes; j += kNumConsumers) {
              zero_box_rows(tile_b + j * kMnBoxBytes, valid_rows, tid_in_wg);
            }
            fence_proxy_async_shared();
            named_barrier_sync(kConsumerBarrierId, kNumConsumers * kThreadsPerWarpgroup);
          }
        }
        const uint64_t desc_a = make_desc_sw128(tile_a + consumer * kWgmmaM * kSwizzleRowBytes,
                                                Config::LayoutA::kLbo, Config::LayoutA::kSbo);
        const uint64_t desc_b = make_desc_sw128(tile_b, Config::LayoutB::kLbo, Config::LayoutB::kSbo);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < kBlockK / kWgmmaK; ++k) {
          Config::Mma::mma(acc, desc_a + k * Config::LayoutA::kDescStepK16,
                           desc_b + k * Config::LayoutB::kDescStepK16, (kb > 0 || k > 0) ? 1u : 0u);
        }
        wgmma_commit_group();
        // Keep this K-block's MMAs in flight; the previous block's have finished reading.
        wgmma_wait_group<1>();
        if (kb > 0 && lane == 0) mbarrier_arrive(&empty[prev_stage]);
        prev_stage = stage;
        if (++stage == kStages) { stage = 0; phase ^= 1; }
      }
      wgmma_wait_group<0>();
      fence_accumulators(acc);
      if (tile.num_k_blocks > 0 && lane == 0) mbarrier_arrive(&empty[prev_stage]);
      // An expert without rows (kWeightGrad only) issued no MMA: its acc holds stale values and
      // the epilogue stores zeros instead. (Zeroing acc here, in a branch, makes ptxas
      // serialise the wgmma pipeline: warning C7518.)
      const bool acc_valid = tile.num_k_blocks > 0;

      // ---- epilogue
      if constexpr (kMode == Mode::kRecomputeZ || kMode == Mode::kDgradScatter) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t out_row = kMode == Mode::kRecomputeZ ? rows[h] : slots[h];
          __nv_bfloat16* row_ptr = args.out_rows + out_row * args.out_row_stride;
#pragma unroll
          for (int a = 0; a < Config::kGroups; ++a) {
            const uint4 bits = gather_chunk_bf16(acc, a, h, q);
            const int col = n0 + 8 * (4 * a + q);
            if (row_valid[h] && col < args.n_valid) *reinterpret_cast<uint4*>(row_ptr + col) = bits;
          }
        }
      } else if constexpr (kMode == Mode::kDgradSwiglu) {
        const int64_t I = args.intermediate;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t r = rows[h];
          const float w = weights[h];
          float dot = 0.0f;  // <h, a> over this lane's columns of the tile, fixed order
#pragma unroll
          for (int a = 0; a < Config::kGroups; ++a) {
            float av[8];
            gather_chunk_fp32(acc, a, h, q, av);
            const int col = n0 + 8 * (4 * a + q);
            float g[8], u[8];
            const int c = h * Config::kGroups + a;
            unpack_bf16x8(z_gate[c % kZAhead], g);
            unpack_bf16x8(z_up[c % kZAhead], u);
            // Chunk c + kZAhead takes the registers chunk c leaves.
            if (c + kZAhead < kZChunks) {
              const int n = c + kZAhead;
              load_z_chunk(args, rows[n / Config::kGroups], row_valid[n / Config::kGroups], n0, q, n % Config::kGroups,
                           z_gate[c % kZAhead], z_up[c % kZAhead]);
            }
            if (row_valid[h] && col < I) {
              uint32_t dg_bits[4], du_bits[4], wh_bits[4];
#pragma unroll
              for (int i = 0; i < 8; i += 2) {
                float dg[2], du[2], wh[2];
#pragma unroll
                for (int b = 0; b < 2; ++b) {
                  float gi = g[i + b], ui = u[i + b];
                  float g_pass = 1.0f, u_pass = 1.0f;  // clamp masks: gradient only where unclamped
                  if (args.use_clamp) {
                    g_pass = gi <= args.clamp ? 1.0f : 0.0f;
                    u_pass = (ui >= -args.clamp && ui <= args.clamp) ? 1.0f : 0.0f;
                    gi = fminf(gi, args.clamp);
                    ui = fminf(fmaxf(ui, -args.clamp), args.clamp);
                  }
                  // The approximate reciprocal, as the forward's silu (an IEEE division
                  // is a dozen instructions and a slow-path branch per element).
                  const float s = __fdividef(1.0f, 1.0f + __expf(-gi));
                  const float silu = gi * s;
                  const float hv = round_bf16(silu * ui);  // h, recomputed from the bf16 z
                  const float ai = av[i + b];
                  dot = fmaf(hv, ai, dot);
                  const float dh = w * ai;
                  dg[b] = dh * ui * s * (1.0f + gi * (1.0f - s)) * g_pass;
                  du[b] = dh * silu * u_pass;
                  wh[b] = w * hv;
                }
                dg_bits[i / 2] = pack_bf16x2(dg[0], dg[1]);
                du_bits[i / 2] = pack_bf16x2(du[0], du[1]);
                wh_bits[i / 2] = pack_bf16x2(wh[0], wh[1]);
              }
              *reinterpret_cast<uint4*>(args.dz + r * 2 * I + col) =
                  make_uint4(dg_bits[0], dg_bits[1], dg_bits[2], dg_bits[3]);
              *reinterpret_cast<uint4*>(args.dz + r * 2 * I + I + col) =
                  make_uint4(du_bits[0], du_bits[1], du_bits[2], du_bits[3]);
              *reinterpret_cast<uint4*>(args.wh + r * I + col) =
                  make_uint4(wh_bits[0], wh_bits[1], wh_bits[2], wh_bits[3]);
            }
          }
          // Quad sum in a fixed butterfly order: every lane ends with the same bits.
          dot += __shfl_xor_sync(0xFFFFFFFFu, dot, 1);
          dot += __shfl_xor_sync(0xFFFFFFFFu, dot, 2);
          if (row_valid[h] && q == 0) args.router_partials[r * args.num_n_tiles + tile.n_tile] = dot;
        }
      } else {  // kWeightGrad
        const bool skip = args.accumulate && !acc_valid;  // untouched when empty
        if (!skip) {
          WeightGradStore store{&map_out,
                                staging + consumer * kStagingBoxes * kStagingBoxBytes,
                                tile.expert * args.m_valid + tile.m_tile * kBlockM + consumer * kWgmmaM,
                                n0,
                                row_in_wg,
                                q,
                                tid_in_wg,
                                kStagingBarrierId0 + consumer,
                                acc_valid};
          auto store_tile = [&](auto accumulate) {
            constexpr bool kAccumulate = decltype(accumulate)::value;
            if (args.grad_bf16) {
              store.pass<false, 0, kBlockN / 8, kAccumulate>(acc, args);
            } else {
              store.pass<true, 0, kBlockN / 16, kAccumulate>(acc, args);
              store.pass<true, kBlockN / 16, kBlockN / 16, kAccumulate>(acc, args);
            }
          };
          if (args.accumulate) {
            store_tile(std::true_type{});
          } else {
            store_tile(std::false_type{});
          }
        }
      }
    }
    // The CTA's shared memory must outlive the stores still reading it.
    if constexpr (kMode == Mode::kWeightGrad) {
      if (tid_in_wg == 0) bulk_wait_group_all();
    }
  }
}

__global__ void router_grad_reduce_kernel(const float* __restrict__ partials, int32_t num_n_tiles,
                                          const int32_t* __restrict__ slot_row, int64_t num_slots,
                                          float* __restrict__ d_topk_w) {
  for (int64_t s = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; s < num_slots;
       s += int64_t(gridDim.x) * blockDim.x) {
    const int32_t row = slot_row[s];
    float sum = 0.0f;
    if (row >= 0) {
      for (int32_t n = 0; n < num_n_tiles; ++n) sum += partials[int64_t(row) * num_n_tiles + n];
    }
    d_topk_w[s] = sum;
  }
}

}  // namespace bwd
}  // namespace sm90

// ============================================ host ============================================
namespace {


using sm90::bwd::KernelArgs;
using sm90::bwd::KernelConfig;
using sm90::bwd::Mode;
using sm90::DeviceInfo;
using sm90::aligned16;
using sm90::make_tensor_map_bf16;
static_assert(sm90::bwd::kBlockK == sm90::kTensorMapBoxInner, "a K-block is one tensor-map box row");

void check_pointer(const void* ptr, const char* name) {
  FUSEMOE_CHECK(ptr != nullptr && aligned16(ptr), name << " must be a non-null 16-byte aligned device pointer");
}

void validate_rows_problem(int64_t max_rows, int64_t hidden, int64_t intermediate, int64_t num_experts,
                           int num_sms) {
  FUSEMOE_CHECK(max_rows >= 0 && max_rows < (int64_t{1} << 31), "max_rows must be in [0, 2^31), got " << max_rows);
  FUSEMOE_CHECK(hidden > 0 && hidden % 128 == 0, "hidden must be a positive multiple of 128, got " << hidden);
  FUSEMOE_CHECK(intermediate > 0 && intermediate % 64 == 0,
                "intermediate must be a positive multiple of 64, got " << intermediate);
  FUSEMOE_CHECK(num_experts >= 1 && num_experts <= sm90::bwd::kMaxExpertsInSmem,
                "num_experts must be in [1, " << sm90::bwd::kMaxExpertsInSmem << "], got " << num_experts);
  // TMA row coordinates of the weight maps are int32.
  FUSEMOE_CHECK(num_experts * 2 * intermediate < (int64_t{1} << 31) && num_experts * hidden < (int64_t{1} << 31),
                "num_experts * 2 * intermediate and num_experts * hidden must be < 2^31");
  FUSEMOE_CHECK(num_sms >= 0, "num_sms must be >= 0, got " << num_sms);
}

template <Mode kMode, int kBlockN>
void launch_mode(const DeviceInfo& info, int num_sms_override, int num_experts, const CUtensorMap& map_a,
                 const CUtensorMap& map_b, const CUtensorMap& map_out, const KernelArgs& args,
                 cudaStream_t stream) {
  using Config = KernelConfig<kMode, kBlockN>;
  auto kernel = sm90::bwd::moe_backward_gemm_kernel<kMode, kBlockN>;
  const size_t smem_bytes = Config::smem_bytes(num_experts);
  const size_t smem_limit = std::min(Config::smem_bytes(sm90::bwd::kMaxExpertsInSmem),
                                     static_cast<size_t>(info.max_smem_optin));
  FUSEMOE_CHECK(smem_bytes <= smem_limit,
                "backward GEMM needs " << smem_bytes << " bytes of shared memory, the device allows "
                                       << info.max_smem_optin);
  static std::atomic<uint64_t> configured{0};  // as the forward's launch_variant
  sm90::raise_smem_limit_once(reinterpret_cast<const void*>(kernel), smem_limit, info.device, &configured);
  const int grid = num_sms_override > 0 ? std::min(num_sms_override, info.num_sms) : info.num_sms;
  kernel<<<grid, sm90::bwd::kThreads, smem_bytes, stream>>>(map_a, map_b, map_out, args);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

// Rows modes store from registers: their output-map parameter is never read.
const CUtensorMap kNoOutputMap{};

KernelArgs base_args(const int32_t* expert_offsets, int64_t num_experts) {
  KernelArgs args{};
  args.expert_offsets = expert_offsets;
  args.num_experts = static_cast<int32_t>(num_experts);
  return args;
}

}  // namespace

int sm90_dgrad_swiglu_block_n(int64_t hidden, int block_n) {
  FUSEMOE_CHECK(block_n == 0 || block_n == 128 || block_n == 256, "block_n must be 0, 128 or 256, got " << block_n);
  if (block_n != 0) return block_n;
  return hidden >= 4096 ? 256 : 128;
}

int64_t sm90_dgrad_swiglu_num_n_tiles(int64_t intermediate, int block_n) {
  FUSEMOE_CHECK(block_n == 128 || block_n == 256, "block_n must be 128 or 256 here, got " << block_n);
  return (intermediate + block_n - 1) / block_n;
}

void launch_sm90_recompute_z(const Sm90RecomputeZParams& p) {
  // ---- validate
  validate_rows_problem(p.max_rows, p.hidden, p.intermediate, p.num_experts, p.num_sms);
  if (p.max_rows == 0) return;
  check_pointer(p.xs, "xs");
  check_pointer(p.w13, "w13");
  check_pointer(p.z, "z");
  FUSEMOE_CHECK(p.expert_offsets != nullptr, "expert_offsets must be a non-null device pointer");
  const DeviceInfo info = sm90::device_info();

  // ---- configure: A = xs [R_max, H] K-major; B = w13 as [E*2I, H] K-major, 256-row boxes
  constexpr int kBlockN = 256;  // 128 x 256 tiles, 4 stages of 48 KB (as the forward's gate/up)
  const CUtensorMap map_a = make_tensor_map_bf16(p.xs, p.hidden, p.max_rows, sm90::bwd::kBlockM, "xs");
  const CUtensorMap map_b =
      make_tensor_map_bf16(p.w13, p.hidden, p.num_experts * 2 * p.intermediate, kBlockN, "w13");
  KernelArgs args = base_args(p.expert_offsets, p.num_experts);
  args.num_k_blocks = static_cast<int32_t>(p.hidden / sm90::bwd::kBlockK);
  args.n_valid = static_cast<int32_t>(2 * p.intermediate);
  args.b_rows_per_expert = static_cast<int32_t>(2 * p.intermediate);
  args.out_rows = static_cast<__nv_bfloat16*>(p.z);
  args.out_row_stride = 2 * p.intermediate;

  // ---- launch
  launch_mode<Mode::kRecomputeZ, kBlockN>(info, p.num_sms, static_cast<int>(p.num_experts), map_a, map_b, kNoOutputMap, args, p.stream);
}

void launch_sm90_dgrad_swiglu(const Sm90DgradSwigluParams& p) {
  // ---- validate
  validate_rows_problem(p.max_rows, p.hidden, p.intermediate, p.num_experts, p.num_sms);
  FUSEMOE_CHECK(p.num_slots >= 0 && p.num_slots < (int64_t{1} << 31), "num_slots must be in [0, 2^31)");
  FUSEMOE_CHECK(!p.use_swiglu_clamp || (p.swiglu_clamp > 0.0f && p.swiglu_clamp < INFINITY),
                "swiglu_clamp must be finite and > 0 when use_swiglu_clamp, got " << p.swiglu_clamp);
  FUSEMOE_CHECK(p.block_n == 0 || p.block_n == 128 || p.block_n == 256,
                "block_n must be 0, 128 or 256, got " << p.block_n);
  if (p.max_rows == 0) return;
  check_pointer(p.dys, "dys");
  check_pointer(p.w2, "w2");
  check_pointer(p.z, "z");
  check_pointer(p.dz, "dz");
  check_pointer(p.wh, "wh");
  FUSEMOE_CHECK(p.expert_offsets && p.row_slot && p.topk_weights && p.router_partials,
                "expert_offsets, row_slot, topk_weights and router_partials must be non-null device pointers");
  const DeviceInfo info = sm90::device_info();

  // ---- configure: A = dys [R_max, H] K-major; B = w2 as [E*H, I], N-major boxes [64 k][64 n]
  const CUtensorMap map_a = make_tensor_map_bf16(p.dys, p.hidden, p.max_rows, sm90::bwd::kBlockM, "dys");
  const CUtensorMap map_b =
      make_tensor_map_bf16(p.w2, p.intermediate, p.num_experts * p.hidden, sm90::kMnBoxRows, "w2");
  KernelArgs args = base_args(p.expert_offsets, p.num_experts);
  args.num_k_blocks = static_cast<int32_t>(p.hidden / sm90::bwd::kBlockK);
  args.n_valid = static_cast<int32_t>(p.intermediate);
  args.b_rows_per_expert = static_cast<int32_t>(p.hidden);
  args.row_slot = p.row_slot;
  args.topk_weights = p.topk_weights;
  args.z = static_cast<const __nv_bfloat16*>(p.z);
  args.dz = static_cast<__nv_bfloat16*>(p.dz);
  args.wh = static_cast<__nv_bfloat16*>(p.wh);
  args.router_partials = p.router_partials;
  const int block_n = sm90_dgrad_swiglu_block_n(p.hidden, p.block_n);
  args.num_n_tiles = static_cast<int32_t>(sm90_dgrad_swiglu_num_n_tiles(p.intermediate, block_n));
  args.intermediate = static_cast<int32_t>(p.intermediate);
  args.use_clamp = p.use_swiglu_clamp ? 1 : 0;
  args.clamp = p.swiglu_clamp;

  // ---- launch
  if (block_n == 128) {
    launch_mode<Mode::kDgradSwiglu, 128>(info, p.num_sms, static_cast<int>(p.num_experts), map_a, map_b, kNoOutputMap, args,
                                         p.stream);
  } else {
    launch_mode<Mode::kDgradSwiglu, 256>(info, p.num_sms, static_cast<int>(p.num_experts), map_a, map_b, kNoOutputMap, args,
                                         p.stream);
  }
}

void launch_sm90_dgrad_scatter(const Sm90DgradScatterParams& p) {
  // ---- validate
  validate_rows_problem(p.max_rows, p.hidden, p.intermediate, p.num_experts, p.num_sms);
  FUSEMOE_CHECK(p.num_slots >= 0 && p.num_slots < (int64_t{1} << 31), "num_slots must be in [0, 2^31)");
  if (p.max_rows == 0) return;
  check_pointer(p.dz, "dz");
  check_pointer(p.w13, "w13");
  check_pointer(p.dx_slots, "dx_slots");
  FUSEMOE_CHECK(p.expert_offsets && p.row_slot, "expert_offsets and row_slot must be non-null device pointers");
  const DeviceInfo info = sm90::device_info();

  // ---- configure: A = dz [R_max, 2I] K-major; B = w13 as [E*2I, H], N-major boxes
  const CUtensorMap map_a =
      make_tensor_map_bf16(p.dz, 2 * p.intermediate, p.max_rows, sm90::bwd::kBlockM, "dz");
  const CUtensorMap map_b =
      make_tensor_map_bf16(p.w13, p.hidden, p.num_experts * 2 * p.intermediate, sm90::kMnBoxRows, "w13");
  KernelArgs args = base_args(p.expert_offsets, p.num_experts);
  args.num_k_blocks = static_cast<int32_t>(2 * p.intermediate / sm90::bwd::kBlockK);
  args.n_valid = static_cast<int32_t>(p.hidden);
  args.b_rows_per_expert = static_cast<int32_t>(2 * p.intermediate);
  args.out_rows = static_cast<__nv_bfloat16*>(p.dx_slots);
  args.out_row_stride = p.hidden;
  args.row_slot = p.row_slot;

  // ---- launch
  launch_mode<Mode::kDgradScatter, 256>(info, p.num_sms, static_cast<int>(p.num_experts), map_a, map_b, kNoOutputMap, args, p.stream);
}

void launch_sm90_weight_grad(const Sm90WeightGradParams& p) {
  // ---- validate
  FUSEMOE_CHECK(p.max_rows >= 0 && p.max_rows < (int64_t{1} << 31), "max_rows must be in [0, 2^31), got " << p.max_rows);
  FUSEMOE_CHECK(p.m > 0 && p.m % 128 == 0, "m must be a positive multiple of 128, got " << p.m);
  FUSEMOE_CHECK(p.n > 0 && p.n % 64 == 0, "n must be a positive multiple of 64, got " << p.n);
  FUSEMOE_CHECK(p.num_experts >= 1 && p.num_experts <= sm90::bwd::kMaxExpertsInSmem,
                "num_experts must be in [1, " << sm90::bwd::kMaxExpertsInSmem << "], got " << p.num_experts);
  FUSEMOE_CHECK(p.num_experts * (p.m / 128) * ((p.n + 255) / 256) < (int64_t{1} << 31), "too many output tiles");
  FUSEMOE_CHECK(p.num_experts * p.m < (int64_t{1} << 31), "num_experts * m must be < 2^31 (TMA row coordinates)");
  FUSEMOE_CHECK(p.num_sms >= 0, "num_sms must be >= 0, got " << p.num_sms);
  check_pointer(p.grad, "grad");
  if (p.max_rows == 0) {  // every expert is empty
    if (!p.accumulate) {
      FUSEMOE_CUDA_CHECK(cudaMemsetAsync(p.grad, 0, p.num_experts * p.m * p.n * (p.bf16_grad ? 2 : 4), p.stream));
    }
    return;
  }
  check_pointer(p.act_m, "act_m");
  check_pointer(p.act_n, "act_n");
  FUSEMOE_CHECK(p.expert_offsets != nullptr, "expert_offsets must be a non-null device pointer");
  const DeviceInfo info = sm90::device_info();

  // ---- configure: both operands are pool rows read as MN-major boxes [64 rows][64 columns]
  const CUtensorMap map_a = make_tensor_map_bf16(p.act_m, p.m, p.max_rows, sm90::kMnBoxRows, "act_m");
  const CUtensorMap map_b = make_tensor_map_bf16(p.act_n, p.n, p.max_rows, sm90::kMnBoxRows, "act_n");
  // grad as [E*M rows, N]: each consumer warpgroup stores boxes of [64 rows][128 B].
  const CUtensorMap map_out =
      sm90::make_store_tensor_map(p.grad, !p.bf16_grad, p.n, p.num_experts * p.m, sm90::bwd::kWgmmaM, "grad");
  KernelArgs args = base_args(p.expert_offsets, p.num_experts);
  args.n_valid = static_cast<int32_t>(p.n);
  args.m_valid = static_cast<int32_t>(p.m);
  args.grad = p.grad;
  args.grad_bf16 = p.bf16_grad ? 1 : 0;
  args.accumulate = p.accumulate ? 1 : 0;

  // ---- launch
  launch_mode<Mode::kWeightGrad, 256>(info, p.num_sms, static_cast<int>(p.num_experts), map_a, map_b, map_out, args,
                                      p.stream);
}

void launch_router_grad_reduce(const float* router_partials, int64_t num_n_tiles, const int32_t* slot_row,
                               int64_t num_slots, float* d_topk_w, cudaStream_t stream) {
  FUSEMOE_CHECK(num_n_tiles >= 1 && num_n_tiles < (int64_t{1} << 31), "num_n_tiles must be >= 1");
  if (num_slots == 0) return;
  constexpr int kThreadsPerBlock = 256;
  const int64_t blocks = std::min<int64_t>((num_slots + kThreadsPerBlock - 1) / kThreadsPerBlock, 4096);
  sm90::bwd::router_grad_reduce_kernel<<<static_cast<int>(blocks), kThreadsPerBlock, 0, stream>>>(
      router_partials, static_cast<int32_t>(num_n_tiles), slot_row, num_slots, d_topk_w);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace fusemoe

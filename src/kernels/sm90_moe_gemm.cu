// Grouped GEMMs of the fused MoE forward on sm_90a: one persistent, warp-specialised TMA +
// wgmma kernel over the expert-sorted row order (see sm90_moe_gemm.h for the math and shapes)
// that runs one pass or both:
//
//   gate/up + SwiGLU : tile = 128 sorted rows x (kBlockN/2 gate + kBlockN/2 up) weight rows,
//                      epilogue h = silu(g) * u  ->  h[row, n0 : n0 + kBlockN/2]   (bf16)
//   down + weight    : tile = 128 pool rows x kBlockN rows of W2_e,
//                      epilogue w * o  ->  ys[row_slot[row], n0 : n0 + kBlockN]    (bf16)
//
// Passes::kBoth (the fused forward): each CTA runs its gate/up tiles, then its down tiles, the
// two lists continuing one round-robin; the ring and its phases carry over. A down tile's
// producer waits for its 128-row block's readiness counter (every gate/up column tile of the
// block has stored h; the consumers signal it, see consume_pass) before loading h, so down
// tiles of finished blocks overlap the last gate/up tiles instead of waiting for a kernel
// boundary. All CTAs are resident (one per SM) and every CTA issues all its gate/up stages
// before any down stage, so the waits always end.
//
// Thread roles (384 threads, one CTA per SM, static round-robin over the expert-major tile list):
//   warpgroup 0 (producer, 40 registers): fills a kStages-deep ring of shared-memory stages
//     for every (tile, k-block), running ahead across tile boundaries so the next tile's loads
//     overlap the current tile's epilogue. B (weights) always comes by TMA, issued by thread 0.
//     A comes either as one [128 rows, 64] TMA box of a pool (thread 0), or, with kGatherA
//     (direct dispatch), as token rows of x gathered by all 128 producer threads with 16-byte
//     cp.async copies: thread p copies chunk p % 8 of rows p / 8 + 16 i, i < 8, to the 128-byte
//     swizzled position (chunk c of row r at c ^ (r % 8)) that a TMA box would have used.
//     Measured on the H200 (tests/gpu/test_sm90_moe_gemm.cu, 2026-11-29), gate/up direct vs
//     pool + gather kernel: 30B T=16384 random 1.24 vs 1.31 + 0.31 ms, 235B T=16384 random
//     5.42 vs 5.32 + 0.65 ms. One-row TMA boxes instead of cp.async (128 per stage from one
//     warp) measured 5.4x slower: 6.35 ms against 1.11 ms at 30B T=16384 (TMA issue-bound).
//   warpgroups 1, 2 (consumers, 232 registers): each owns 64 rows of the 128-row tile and
//     issues wgmma m64 x kBlockN x k16 from shared memory into fp32 registers, then runs the
//     epilogue from registers straight to global memory (16-byte stores).
//   Ring protocol: full[s] (1 arrival + TMA bytes, plus one cp.async arrival per producer
//   thread when gathering) and empty[s] (one arrival per consumer warp).
// Rows of a tile at or past the expert's end are computed but never stored: a pool box reads
// another expert's rows (or zeros past the pool end), a gathered tile leaves them uncopied
// (stale shared memory; each accumulator row depends on its own A row only). (Skipping the
// MMAs of a warpgroup whose rows are all past the end, or splitting such tiles by columns
// between the two warpgroups, both measured slower on random routing: 235B gate/up, T=4096,
// 1.40 ms -> 1.69 ms; not understood.)
#include "kernels/sm90_moe_gemm.h"

#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "device/sm90_expert_tiles.cuh"
#include "device/sm90_fragment.cuh"
#include "device/sm90_host.h"
#include "device/sm90_ptx.cuh"
#include "device/smem_work_queue.cuh"
#include "fusemoe/error.h"

namespace fusemoe {
namespace sm90 {

constexpr int kBlockM = 128;  // pool rows per tile: kNumConsumers warpgroups x wgmma M (64)
constexpr int kWgmmaM = 64;
constexpr int kBlockK = 64;   // bf16 per 128-byte swizzled row: one TMA box row, 4 wgmma k16 steps
constexpr int kWgmmaK = 16;
constexpr int kNumConsumers = 2;
constexpr int kThreadsPerWarpgroup = 128;
constexpr int kThreads = kThreadsPerWarpgroup * (1 + kNumConsumers);
// Producer keeps a handful of scalars; consumers hold up to 128 fp32 accumulators plus the
// epilogue's temporaries. The split must fit the 64K-register file at one CTA per SM.
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
constexpr int kMaxExpertsInSmem = 1024;  // the tile table holds 2 x (E+1) int32 in shared memory
constexpr int kRowBytes = kBlockK * 2;    // one K-block row of A: 64 bf16, 8 16-byte chunks
constexpr int kChunksPerRow = kRowBytes / 16;
constexpr int kGatherThreads = kThreadsPerWarpgroup;                  // the producer warpgroup
constexpr int kGatherRowStep = kGatherThreads / kChunksPerRow;        // 16 rows per pass
constexpr int kGatherRowsPerThread = kBlockM / kGatherRowStep;        // 8 copies per stage

static_assert(kBlockM == kNumConsumers * kWgmmaM, "each consumer warpgroup owns 64 tile rows");
static_assert(kBlockK * 2 == 128, "a K-block row is exactly one 128-byte swizzle row");
static_assert(kBlockK % kWgmmaK == 0, "whole wgmma k-steps per K-block");
static_assert(kBlockM % kGatherRowStep == 0 && kGatherRowStep % 8 == 0,
              "gathered rows spread evenly over the producer threads, and each thread's rows share "
              "one swizzle phase (row % 8)");
static_assert(kProducerRegs * kThreadsPerWarpgroup +
                  kConsumerRegs * kThreadsPerWarpgroup * kNumConsumers <= 65536,
              "register split exceeds the register file");

enum class Epilogue { kSwiGLU, kWeightedScatter };

// The fused combine (down pass, kCombine): every consumer warp hands the 16 ys rows it has just
// stored to the combine workers through a shared-memory queue; a worker counts them against
// their tokens' pending counters and combines each token whose K slot rows (of that column
// tile) are now all stored. Workers: producer warps 1-3 (warp 0 issues the loads) all along,
// each with two K-row shared-memory buffers when they fit, and the 8 consumer warps once their
// tiles are done.
constexpr int kRowsPerConsumerWarp = kWgmmaM / 4;
constexpr int kCombineProducerWorkers = 3;
constexpr int kCombineWorkers = kCombineProducerWorkers + kNumConsumers * 4;
constexpr int kCombineBuffersPerWorker = 2;
// 64 tiles of hand-overs before a consumer waits: most CTAs' whole down pass at Qwen3 sizes.
constexpr int kCombineQueueCapacity = 512;
using CombineQueue = SmemWorkQueue<kCombineQueueCapacity>;
constexpr uint32_t kConsumerBarrierId = 1;  // named barrier of the two consumer warpgroups

// The shape of one of the two GEMMs.
struct PassShape {
  int32_t num_k_blocks;            // K / kBlockK   (K = H for gate/up, I for down)
  int32_t n_valid;                 // output columns: I (gate/up) or H (down)
  int32_t weight_rows_per_expert;  // 2I (w13) or H (w2): row stride of one expert in the B map
};

// Everything the kernel needs besides the tensor maps (by value, in the param space).
struct KernelArgs {
  const int32_t* expert_offsets;  // [E+1]
  int32_t num_experts;
  PassShape gate_up;
  PassShape down;
  int32_t* h_ready;               // Passes::kBoth: per 128-row block, gate/up tiles done (zeroed)
  // The gate/up pass's outputs and operands, or (a down-only launch with kCombine, which reads
  // none of them) the fused combine's. They share their bytes because KernelArgs' size reaches
  // ptxas's choices for every variant: 32 more bytes made the direct gate/up kernel 400 SASS
  // instructions shorter and the forward 1.5-2% slower at Qwen3-30B T=16384 (0.5-0.8% at 235B,
  // 1% faster at 30B T=4096; H200, two interleaved bench rounds). At 120 bytes the product
  // variants compile to the same SASS as without the fused combine.
  union {
    struct {
      __nv_bfloat16* h;           // [R_max, I]
      __nv_bfloat16* z;           // [R_max, 2I] pre-activation [g | u] for the backward, or null
      int32_t use_clamp;
      float clamp;
      const __nv_bfloat16* x;     // gathered A rows: [num_tokens, H], row = row_slot[r] / top_k
    };
    struct {  // y[t] = sum_j ys[t*K + j] in slot order
      __nv_bfloat16* y;           // [num_slots / K, H]
      const int32_t* slot_row;    // [num_slots]: row of each slot, -1 where it has none
      int32_t* combine_pending;   // [num_slots / K, down column tiles]: slot rows not yet stored
      int32_t combine_buffers;    // 1: the producer workers' K-row buffers follow the queue
    };
  };
  int32_t top_k;                  // K (the gather's token index, the combine's slots)
  // down
  __nv_bfloat16* ys;              // [num_slots, ys_row_stride]
  int64_t ys_row_stride;
  const int32_t* row_slot;        // [R_max]: slot of each sorted row (down epilogue, gathered A)
  const float* topk_weights;      // [num_slots]
};
static_assert(sizeof(KernelArgs) == 120, "KernelArgs' size moves ptxas's code for every variant: see above");

template <Epilogue kEpilogue, int kBlockN_, int kStages>
struct KernelConfig {
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kTileABytes = kBlockM * kBlockK * 2;  // [128 rows, 64 k] bf16 = 16 KB
  static constexpr int kTileBBytes = kBlockN * kBlockK * 2;  // [kBlockN rows, 64 k] bf16
  static constexpr int kStageBytes = kTileABytes + kTileBBytes;
  // SwiGLU tiles load two boxes into one B tile, rows [gate n0 .. n0+kBlockN/2 | up n0 .. ],
  // which then reads as one contiguous [kBlockN, 64] K-major operand: accumulator column c
  // (gate) and c + kBlockN/2 (up) of one output column land in the same thread.
  static constexpr int kBoxRowsB = kEpilogue == Epilogue::kSwiGLU ? kBlockN / 2 : kBlockN;
  static constexpr int kOutCols = kEpilogue == Epilogue::kSwiGLU ? kBlockN / 2 : kBlockN;
  static constexpr int kOutColsDown = kBlockN;  // the down pass's columns per tile (the combine's item)
  static constexpr int kAccRegs = Wgmma<kBlockN>::kAccRegs;
  static constexpr int kNumChunks8 = kBlockN / 8;  // n8 column chunks of the accumulator
  static constexpr bool kIsSwiGLU = kEpilogue == Epilogue::kSwiGLU;
  // By value: a reference into the kernel's parameter space would make ptxas copy it to the stack.
  __device__ static PassShape shape(const KernelArgs& args) { return kIsSwiGLU ? args.gate_up : args.down; }
  static constexpr int kAlign = 1024;  // 128B-swizzle atoms must start 1024-byte aligned

  static_assert(kTileABytes % kAlign == 0 && kTileBBytes % kAlign == 0, "stage alignment");
  static_assert(kTileABytes == kBlockM * kRowBytes, "a gathered tile is kBlockM rows of 128 bytes");
  static_assert(kBoxRowsB <= 256, "TMA box dimension limit");
  static_assert(kOutCols % 32 == 0, "quad-transposed stores write groups of 4 n8 chunks");

  // The tile table's end, rounded up for the combine queue (which follows it when present).
  __host__ __device__ static size_t table_end_bytes(int num_experts) {
    const size_t end = static_cast<size_t>(kStages) * kStageBytes + 2 * kStages * sizeof(uint64_t) +
                       2 * (static_cast<size_t>(num_experts) + 1) * sizeof(int32_t);
    return (end + 15) / 16 * 16;
  }
  // The combine workers' buffers follow the queue, 128-byte aligned.
  __host__ __device__ static size_t combine_buffers_offset(int num_experts) {
    return (table_end_bytes(num_experts) + sizeof(CombineQueue) + 127) / 128 * 128;
  }
  static size_t combine_buffer_bytes(int top_k) {
    return static_cast<size_t>(kCombineProducerWorkers) * kCombineBuffersPerWorker * top_k * kOutColsDown * 2;
  }
  static size_t smem_bytes(int num_experts, bool combine_queue, int combine_top_k = 0) {
    if (!combine_queue) return kAlign + table_end_bytes(num_experts);
    return kAlign + combine_buffers_offset(num_experts) + (combine_top_k > 0 ? combine_buffer_bytes(combine_top_k) : 0);
  }
};

// silu(g) = g * sigmoid(g) with the approximate reciprocal (MUFU.RCP): the result is rounded
// to bf16 (8 bits), far coarser than its ~2 ulp fp32 error. For g < -87 the denominator
// overflows and the result is -0, where the exact value is below 1e-36 in magnitude anyway.
__device__ __forceinline__ float silu(float g) { return __fdividef(g, 1.0f + __expf(-g)); }

// Stores one accumulator row fragment: this thread holds words[j] = output columns
// col0 + 8j + 2q, +1 (q = lane % 4) of one row, j in [0, kChunks). A quad of lanes holds the row.
// A 4x4 transpose inside the quad turns every 4 chunks into one 16-byte store per lane (lane q
// writes chunk 4a+q whole): measured 1.4x faster for the down kernel than 4-byte stores.
// Columns at or past n_valid are not stored (n_valid is a multiple of 8 and col0 - 2q of 8).
template <int kChunks>
__device__ __forceinline__ void store_row_fragment(uint32_t (&words)[kChunks], __nv_bfloat16* row_ptr,
                                                   bool row_valid, int col0, int n_valid, int lane) {
  static_assert(kChunks % 4 == 0, "the quad transpose works on groups of 4 chunks");
  const int q = lane % 4;
#pragma unroll
  for (int a = 0; a < kChunks / 4; ++a) {
    uint32_t w[4] = {words[4 * a], words[4 * a + 1], words[4 * a + 2], words[4 * a + 3]};
    quad_transpose(w, q);
    // Lane q now holds chunk 4a+q: columns col0 - 2q + 8(4a+q) .. +7.
    const int col = col0 - 2 * q + 8 * (4 * a + q);
    if (row_valid && col < n_valid) {
      *reinterpret_cast<uint4*>(row_ptr + col) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// SwiGLU epilogue of one of the thread's two accumulator rows (h): output chunk j pairs gate
// registers acc[4j + 2h + b] with up registers acc[4(j + kOutChunks) + 2h + b]. With z_row
// (saved pre-activations), g and u are stored first, before the clamp, as the backward's
// recompute would produce them: gate columns at z_row[c], up columns at z_row[I + c].
template <int kOutChunks, int kRegs>
__device__ __forceinline__ void epilogue_swiglu_row(const float (&acc)[kRegs], int h, const KernelArgs& args,
                                                    __nv_bfloat16* row_ptr, __nv_bfloat16* z_row,
                                                    bool row_valid, int col0, int lane) {
  static_assert(8 * kOutChunks == kRegs, "gate and up halves fill the accumulators");
  uint32_t words[kOutChunks];
  if (z_row != nullptr) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int j = 0; j < kOutChunks; ++j) {
        const int reg = 4 * (j + half * kOutChunks) + 2 * h;
        words[j] = pack_bf16x2(acc[reg], acc[reg + 1]);
      }
      store_row_fragment<kOutChunks>(words, z_row + half * args.gate_up.n_valid, row_valid, col0, args.gate_up.n_valid,
                                     lane);
    }
  }
#pragma unroll
  for (int j = 0; j < kOutChunks; ++j) {
    const int gate = 4 * j + 2 * h, up = gate + 4 * kOutChunks;
    float g0 = acc[gate], g1 = acc[gate + 1], u0 = acc[up], u1 = acc[up + 1];
    if (args.use_clamp) {
      g0 = fminf(g0, args.clamp);
      g1 = fminf(g1, args.clamp);
      u0 = fminf(fmaxf(u0, -args.clamp), args.clamp);
      u1 = fminf(fmaxf(u1, -args.clamp), args.clamp);
    }
    words[j] = pack_bf16x2(silu(g0) * u0, silu(g1) * u1);
  }
  store_row_fragment<kOutChunks>(words, row_ptr, row_valid, col0, args.gate_up.n_valid, lane);
}

// Down epilogue of one accumulator row: w * o for chunks [0, kChunks).
template <int kChunks, int kRegs>
__device__ __forceinline__ void epilogue_scale_row(const float (&acc)[kRegs], int h, float weight,
                                                   __nv_bfloat16* row_ptr, bool row_valid, int col0, int n_valid,
                                                   int lane) {
  static_assert(4 * kChunks == kRegs, "the chunks fill the accumulators");
  uint32_t words[kChunks];
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    words[j] = pack_bf16x2(acc[4 * j + 2 * h] * weight, acc[4 * j + 2 * h + 1] * weight);
  }
  store_row_fragment<kChunks>(words, row_ptr, row_valid, col0, n_valid, lane);
}

// Which GEMMs one launch runs. kBoth: the gate/up tiles, then the down tiles, on one persistent
// grid; each CTA takes its gate/up tiles before its down tiles, and a down tile's producer
// waits until every gate/up tile of its 128-row block has stored h (a readiness counter per
// block), so down tiles of finished blocks run while other blocks' gate/up tiles still do.
enum class Passes { kGateUp, kDown, kBoth };

// The tiles of one pass a CTA takes: t = first, first + gridDim.x, ... < num_tiles, where
// the passes' tiles continue one round-robin (down tile t is global tile N_gate_up + t).
struct PassTiles {
  int32_t first;
  int32_t num_tiles;
};

// Ring position, carried from one pass to the next.
struct RingCursor {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance(int num_stages) {
    if (++stage == num_stages) { stage = 0; phase ^= 1; }
  }
};

// Index of a tile's 128-row block among all the experts' blocks (the readiness counter).
__device__ __forceinline__ int32_t row_block_index(const ExpertTileTable& table, const ExpertTile& tile) {
  return table.m_prefix[tile.expert] + (tile.row_begin - table.offsets[tile.expert]) / kBlockM;
}

// Waits (one thread) until the gate/up tiles of a row block have all stored h. A bounded
// spin: after kReadyTimeoutNs (far beyond any gate/up pass) it traps, so a broken dependency
// fails the launch (cudaErrorLaunchFailure) instead of hanging. It cannot print what it waited
// for: a printf call anywhere in the kernel makes ptxas serialise every wgmma (C7510).
constexpr uint64_t kReadyTimeoutNs = 5ull * 1000 * 1000 * 1000;
__device__ __forceinline__ void wait_row_block_ready(const int32_t* counter, int32_t target) {
  if (ld_acquire_gpu(counter) >= target) return;
  const uint64_t start = globaltimer_ns();
  while (ld_acquire_gpu(counter) < target) {
    __nanosleep(128);
    if (globaltimer_ns() - start > kReadyTimeoutNs) __trap();
  }
}

// ---- the fused combine (down pass with kCombine)
//
// y[t, cols of column tile n] = sum_j ys[t*K + j, same cols], j in slot order over the slots
// that have a row, fp32 sums rounded to bf16 once: the bits of the combine kernel
// (combine_slots_kernel). combine_pending[t * num_n_tiles + n] starts at the number of t's slots
// with a row (set by combine_counters_init_kernel) and loses one per stored slot row; the
// worker that takes it to zero combines (t, n), so each one is combined exactly once, as soon
// as its last slot row is stored, by whichever CTA stored that row. Memory order: the consumer
// warp's ys stores, __syncwarp, the queue's CTA-scope release / acquire, __syncwarp, then each
// counting lane's atom.acq_rel.gpu (its release carries the stores GPU-wide, cumulatively; its
// acquire, on the count that reaches zero, sees every other row's storer), __syncwarp, then the
// loads, through L2 (ld.global.cg / cp.async.cg), never the non-coherent path.
//
// Lane l of a worker warp owns the 8 columns n * kOutCols + 8l .. +7 of an item (none past H);
// a slot's row is loaded whether or not the slot has one (the address is valid, the value is
// skipped in the sum), so the loads need not wait for slot_row.
template <int kOutCols>
struct CombineLane {
  static_assert(kOutCols <= 32 * 8, "one 16-byte chunk per lane and row");
  bool active;
  int32_t col;
  __device__ __forceinline__ CombineLane(const KernelArgs& args, int32_t n_tile, int lane)
      : active(lane * 8 < kOutCols && n_tile * kOutCols + lane * 8 < args.down.n_valid),
        col(n_tile * kOutCols + lane * 8) {}
};

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const uint4& bits) {
  float v[8];
  unpack_bf16x8(bits, v);
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] += v[i];
}

__device__ __forceinline__ void store_y_chunk(const KernelArgs& args, int32_t token, int32_t col, const float (&acc)[8]) {
  *reinterpret_cast<uint4*>(args.y + static_cast<int64_t>(token) * args.down.n_valid + col) =
      make_uint4(pack_bf16x2(acc[0], acc[1]), pack_bf16x2(acc[2], acc[3]), pack_bf16x2(acc[4], acc[5]),
                 pack_bf16x2(acc[6], acc[7]));
}

// Lane's slot_row of slot lane of token t (lanes >= K: -1); issued early, ballot-ed late.
__device__ __forceinline__ int32_t load_slot_row(const KernelArgs& args, int32_t token, int lane) {
  return lane < args.top_k ? __ldg(args.slot_row + static_cast<int64_t>(token) * args.top_k + lane) : -1;
}

// One item from registers: kRowsInFlight rows' loads in flight per lane (4 for the producer
// warps' 40 registers, 8 for the consumer warps).
template <int kOutCols, int kRowsInFlight>
__device__ __forceinline__ void combine_item_registers(const KernelArgs& args, int32_t token, int32_t n_tile,
                                                       int lane) {
  const CombineLane<kOutCols> me(args, n_tile, lane);
  const int32_t top_k = args.top_k;
  const int32_t my_slot_row = load_slot_row(args, token, lane);
  const __nv_bfloat16* rows = args.ys + static_cast<int64_t>(token) * top_k * args.ys_row_stride + me.col;
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  unsigned has_row = 0;
  for (int32_t j0 = 0; j0 < top_k; j0 += kRowsInFlight) {
    uint4 bits[kRowsInFlight];
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      bits[u] = make_uint4(0, 0, 0, 0);
      if (me.active && j0 + u < top_k) {
        bits[u] = __ldcg(reinterpret_cast<const uint4*>(rows + static_cast<int64_t>(j0 + u) * args.ys_row_stride));
      }
    }
    if (j0 == 0) has_row = __ballot_sync(0xFFFFFFFFu, my_slot_row >= 0);
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      if (j0 + u < top_k && ((has_row >> (j0 + u)) & 1u)) add_bf16x8(acc, bits[u]);  // skipped, not +0: -0 stays
    }
  }
  if (me.active) store_y_chunk(args, token, me.col, acc);
}

// The ready items of one hand-over through two shared-memory buffers of K rows each: the rows
// of the next item are copied (cp.async, no registers held) while the current one is summed,
// so a warp keeps up to 2 K-row items in flight with the producer warps' 40 registers. Each
// lane copies and reads only its own 16-byte chunks, so no barrier is needed between them.
template <int kOutCols>
__device__ __forceinline__ void combine_items_staged(const KernelArgs& args, unsigned ready, int32_t token,
                                                     int32_t n_tile, int lane, uint32_t buffers) {
  constexpr int kRowBytes = kOutCols * 2;
  const CombineLane<kOutCols> me(args, n_tile, lane);
  const int32_t top_k = args.top_k;
  const uint32_t item_bytes = static_cast<uint32_t>(top_k) * kRowBytes;
  auto take = [&]() {
    const int src = __ffs(ready) - 1;
    ready &= ready - 1;
    return __shfl_sync(0xFFFFFFFFu, token, src);
  };
  auto issue = [&](int32_t t, uint32_t buffer) {
    const __nv_bfloat16* rows = args.ys + static_cast<int64_t>(t) * top_k * args.ys_row_stride + me.col;
    if (me.active) {
      for (int32_t j = 0; j < top_k; ++j) {
        cp_async_16(buffer + j * kRowBytes + lane * 16, rows + static_cast<int64_t>(j) * args.ys_row_stride);
      }
    }
    cp_async_commit_group();
    return load_slot_row(args, t, lane);
  };
  auto finish = [&](int32_t t, uint32_t buffer, int32_t my_slot_row) {
    const unsigned has_row = __ballot_sync(0xFFFFFFFFu, my_slot_row >= 0);
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int32_t j = 0; j < top_k; ++j) {
      if ((has_row >> j) & 1u) add_bf16x8(acc, ld_shared_v4(buffer + j * kRowBytes + lane * 16));
    }
    if (me.active) store_y_chunk(args, t, me.col, acc);
  };
  uint32_t current = buffers, next = buffers + item_bytes;
  int32_t t_current = take();
  int32_t slot_row_current = issue(t_current, current);
  for (;;) {
    const bool more = ready != 0;
    int32_t t_next = 0, slot_row_next = -1;
    if (more) {
      t_next = take();
      slot_row_next = issue(t_next, next);
      cp_async_wait_group<1>();  // the current item's copies have landed
    } else {
      cp_async_wait_group<0>();
    }
    finish(t_current, current, slot_row_current);
    if (!more) return;
    t_current = t_next;
    slot_row_current = slot_row_next;
    const uint32_t swap = current;
    current = next;
    next = swap;
  }
}

// A worker warp's loop: take a hand-over (16 stored rows of one column tile, or the end
// marker), count the rows off their tokens, combine the tokens that became complete, from two
// shared-memory buffers at `buffers` (a shared address; 0: from registers).
template <int kOutCols, int kRowsInFlight>
__device__ __forceinline__ void run_combine_worker(const KernelArgs& args, CombineQueue* queue, int32_t num_n_tiles,
                                                   int lane, uint32_t buffers) {
  for (;;) {
    int2 item = make_int2(0, 0);
    if (lane == 0) item = queue->pop();
    __syncwarp();  // lane 0's acquire before every lane's count
    item.x = __shfl_sync(0xFFFFFFFFu, item.x, 0);
    item.y = __shfl_sync(0xFFFFFFFFu, item.y, 0);
    if (item.x < 0) return;  // end marker: every hand-over has been taken
    const int32_t row0 = item.x, n_tile = item.y & 0xFFFF, num_rows = item.y >> 16;
    int32_t token = 0;
    bool complete = false;
    if (lane < num_rows) {
      token = __ldg(args.row_slot + row0 + lane) / args.top_k;
      complete =
          atom_add_acq_rel_gpu(args.combine_pending + static_cast<int64_t>(token) * num_n_tiles + n_tile, -1) == 1;
    }
    __syncwarp();  // the completing lanes' acquire before every lane's loads
    unsigned ready = __ballot_sync(0xFFFFFFFFu, complete);
    if (ready == 0) continue;
    if (buffers != 0) {
      combine_items_staged<kOutCols>(args, ready, token, n_tile, lane, buffers);
    } else {
      for (; ready != 0; ready &= ready - 1) {
        const int32_t t = __shfl_sync(0xFFFFFFFFu, token, __ffs(ready) - 1);
        combine_item_registers<kOutCols, kRowsInFlight>(args, t, n_tile, lane);
      }
    }
  }
}

// The consumers' end of the down pass: once all 8 consumer warps have handed over their last
// rows, the last one pushes one end marker per worker (after every hand-over in ticket order).
__device__ __forceinline__ void finish_handovers(CombineQueue* queue, int lane) {
  __syncwarp();
  if (lane == 0) {
    fence_acq_rel_cta();  // this warp's pushes before its count
    if (atom_add_shared(&queue->done, 1) == kNumConsumers * 4 - 1) {
      fence_acq_rel_cta();  // every warp's pushes before the end markers
      for (int i = 0; i < kCombineWorkers; ++i) queue->push(make_int2(-1, 0));  // one per worker
    }
  }
  __syncwarp();
}

// The producer of gathered A tiles (direct dispatch), run by all kGatherThreads producer
// threads. Row r of a tile is token row_slot[r] / top_k of x; thread p copies chunk p % 8 of
// rows p / 8 + 16 i. Rows past the expert's end are not copied; every thread still arrives
// (an arrival with no copies outstanding fires at once). Row addresses are kept as 32-bit
// indices of 16-byte chunks (x < 64 GiB, checked on the host) to fit the producer's 40
// registers; ptxas still keeps 3 values on the stack (3 L1-resident loads per stage, and
// the kernel measured as fast as the pool one: see the header).
template <class Config, int kStages>
__device__ __forceinline__ void produce_gathered(const __nv_bfloat16* x, const CUtensorMap* map_b,
                                                 const KernelArgs& args, const ExpertTileTable& table,
                                                 uint8_t* tiles_a, uint8_t* tiles_b, uint64_t* full,
                                                 uint64_t* empty, PassTiles tiles, int thread, RingCursor& ring) {
  const PassShape shape = Config::shape(args);
  const int chunk = thread % kChunksPerRow;
  const int row0 = thread / kChunksPerRow;
  // Rows row0 + 16 i all have row % 8 == row0 % 8, so one swizzled offset serves every copy.
  const uint32_t dst0 = smem_addr(tiles_a) + row0 * kRowBytes + ((chunk ^ (row0 % 8)) * 16);
  const uint32_t chunks_per_x_row = static_cast<uint32_t>(shape.num_k_blocks) * kChunksPerRow;  // H / 8
  ExpertTileCursor<kBlockM> cursor;
  for (int32_t t = tiles.first; t < tiles.num_tiles; t += gridDim.x) {
    const ExpertTile tile = cursor.tile(table, t);
    const int32_t b_row = tile.expert * shape.weight_rows_per_expert + tile.n_tile * Config::kOutCols;
    // Copy i happens iff tile row row0 + 16 i is before the expert's end.
    const int32_t rows_left = tile.row_end - tile.row_begin - row0;
    uint32_t src_chunk[kGatherRowsPerThread];  // first chunk of the x row of tile row row0 + 16 i
#pragma unroll
    for (int i = 0; i < kGatherRowsPerThread; ++i) {
      const int32_t row = tile.row_begin + row0 + kGatherRowStep * i;
      const int32_t token = kGatherRowStep * i < rows_left ? __ldg(args.row_slot + row) / args.top_k : 0;
      src_chunk[i] = static_cast<uint32_t>(token) * chunks_per_x_row;
    }
    const uint4* src = reinterpret_cast<const uint4*>(x) + chunk;  // this K-block, this thread's chunk
    for (int32_t kb = 0; kb < shape.num_k_blocks; ++kb, src += kChunksPerRow) {
      const int stage = ring.stage;
      mbarrier_wait(&empty[stage], ring.phase ^ 1);
      if (thread == 0) {
        const int32_t k = kb * kBlockK;
        mbarrier_arrive_expect_tx(&full[stage], Config::kTileBBytes);
        uint8_t* tile_b = tiles_b + stage * Config::kTileBBytes;
        tma_load_2d(map_b, &full[stage], tile_b, k, b_row);
        if constexpr (Config::kIsSwiGLU) {
          tma_load_2d(map_b, &full[stage], tile_b + Config::kTileBBytes / 2, k, b_row + shape.n_valid);
        }
      }
      const uint32_t dst = dst0 + stage * Config::kTileABytes;
#pragma unroll
      for (int i = 0; i < kGatherRowsPerThread; ++i) {
        if (kGatherRowStep * i < rows_left) cp_async_16(dst + i * kGatherRowStep * kRowBytes, src + src_chunk[i]);
      }
      cp_async_mbarrier_arrive_noinc(&full[stage]);
      ring.advance(kStages);
    }
  }
  cp_async_wait_all();  // no copy outlives its thread
}

// The producer of pool A tiles: thread 0 loads one [128, 64] box of A and B's boxes per stage.
// With kAllArrive (the full barriers count every producer thread, as for gathering) the other
// threads walk the same stages and add their arrival. ready (kBoth's down pass): the row block's
// readiness counters, waited for before a tile's first load.
template <class Config, int kStages, bool kAllArrive>
__device__ __forceinline__ void produce_boxes(const CUtensorMap* map_a, const CUtensorMap* map_b,
                                              const KernelArgs& args, const ExpertTileTable& table,
                                              uint8_t* tiles_a, uint8_t* tiles_b, uint64_t* full,
                                              uint64_t* empty, PassTiles tiles, int thread, RingCursor& ring,
                                              const int32_t* ready, int32_t ready_target) {
  const PassShape shape = Config::shape(args);
  ExpertTileCursor<kBlockM> cursor;
  for (int32_t t = tiles.first; t < tiles.num_tiles; t += gridDim.x) {
    const ExpertTile tile = cursor.tile(table, t);
    const int32_t b_row = tile.expert * shape.weight_rows_per_expert + tile.n_tile * Config::kOutCols;
    if (thread == 0 && ready != nullptr) {
      wait_row_block_ready(ready + row_block_index(table, tile), ready_target);
      // h was stored through the generic proxy by other CTAs; the TMA loads below read it
      // through the async proxy.
      fence_proxy_async_global();
    }
    for (int32_t kb = 0; kb < shape.num_k_blocks; ++kb) {
      const int stage = ring.stage;
      mbarrier_wait(&empty[stage], ring.phase ^ 1);
      if (thread == 0) {
        mbarrier_arrive_expect_tx(&full[stage], Config::kStageBytes);
        const int32_t k = kb * kBlockK;
        uint8_t* tile_b = tiles_b + stage * Config::kTileBBytes;
        tma_load_2d(map_a, &full[stage], tiles_a + stage * Config::kTileABytes, k, tile.row_begin);
        tma_load_2d(map_b, &full[stage], tile_b, k, b_row);
        if constexpr (Config::kIsSwiGLU) {
          // Up rows of the same output columns: I = n_valid rows below the gate rows.
          tma_load_2d(map_b, &full[stage], tile_b + Config::kTileBBytes / 2, k, b_row + shape.n_valid);
        }
      }
      if constexpr (kAllArrive) mbarrier_arrive(&full[stage]);
      ring.advance(kStages);
    }
  }
}

// Marks the h rows of a row block stored by this CTA's two consumer warpgroups: once both have
// passed the barrier (their stores before it), one thread makes them visible GPU-wide and bumps
// the block's counter (bar.sync orders the other threads' stores before that thread's fence,
// which is cumulative).
__device__ __forceinline__ void signal_row_block(int32_t* counter, int consumer, int warp_in_wg, int lane) {
  named_barrier_sync(kConsumerBarrierId, kNumConsumers * kThreadsPerWarpgroup);
  if (consumer == 0 && warp_in_wg == 0 && lane == 0) {
    __threadfence();
    red_release_gpu_add(counter, 1);
  }
}

// The consumers' loop over one pass's tiles: main loop, then the pass's epilogue from the
// registers. ready (kBoth's gate/up pass): a tile's row block is signalled after the main loop
// of the CTA's next tile (or after its last tile), not right after its own stores: by then the
// stores have long completed, so the signalling thread's fence returns at once instead of
// holding its warpgroup's wgmma for the DRAM write latency (measured 2-4% at Qwen3-235B when
// signalled right away).
// combine_queue (the down pass with kCombine): each warp hands its stored rows of every tile to
// the combine workers.
template <class Config, int kStages, bool kGatherA, bool kCombine>
__device__ __forceinline__ void consume_pass(const KernelArgs& args, const ExpertTileTable& table, uint8_t* tiles_a,
                                             uint8_t* tiles_b, uint64_t* full, uint64_t* empty, PassTiles tiles,
                                             int consumer, int warp_in_wg, int lane, RingCursor& ring,
                                             int32_t* ready, CombineQueue* combine_queue) {
  constexpr int kBlockN = Config::kBlockN;
  const PassShape shape = Config::shape(args);
  const int row_in_wg = warp_in_wg * 16 + lane / 4;  // accumulator rows row_in_wg, row_in_wg + 8
  float acc[Config::kAccRegs];
  ExpertTileCursor<kBlockM> cursor;
  int32_t* pending = nullptr;  // counter of the previous tile's row block, not yet signalled
  for (int32_t t = tiles.first; t < tiles.num_tiles; t += gridDim.x) {
    const ExpertTile tile = cursor.tile(table, t);
    // Consumer c owns tile rows [64c, 64c + 64) x all kBlockN columns.
    const int32_t wg_row0 = tile.row_begin + consumer * kWgmmaM;
    const int32_t rows[2] = {wg_row0 + row_in_wg, wg_row0 + row_in_wg + 8};
    const bool row_valid[2] = {rows[0] < tile.row_end, rows[1] < tile.row_end};

    // Down epilogue inputs, loaded now so their latency hides under the main loop.
    int32_t slots[2] = {0, 0};
    float weights[2] = {0.0f, 0.0f};
    if constexpr (!Config::kIsSwiGLU) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (row_valid[h]) {
          slots[h] = __ldg(args.row_slot + rows[h]);
          weights[h] = __ldg(args.topk_weights + slots[h]);
        }
      }
    }

    // ---- main loop: acc[64 rows, kBlockN] = A[rows 64c .. 64c+63, K] * B[kBlockN rows, K]^T
    int prev_stage = 0;
    for (int32_t kb = 0; kb < shape.num_k_blocks; ++kb) {
      const int stage = ring.stage;
      mbarrier_wait(&full[stage], ring.phase);
      if constexpr (kGatherA && Config::kIsSwiGLU) fence_proxy_async_shared();  // cp.async rows -> wgmma reads
      const uint64_t desc_a = make_kmajor_desc_sw128(tiles_a + stage * Config::kTileABytes +
                                                     consumer * kWgmmaM * kBlockK * 2);
      const uint64_t desc_b = make_kmajor_desc_sw128(tiles_b + stage * Config::kTileBBytes);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kBlockK / kWgmmaK; ++k) {
        Wgmma<kBlockN>::mma(acc, desc_a + k * OperandLayout<false>::kDescStepK16,
                            desc_b + k * OperandLayout<false>::kDescStepK16, (kb > 0 || k > 0) ? 1u : 0u);
      }
      wgmma_commit_group();
      // Keep this K-block's MMAs in flight; the previous block's have finished reading.
      wgmma_wait_group<1>();
      if (kb > 0 && lane == 0) mbarrier_arrive(&empty[prev_stage]);
      prev_stage = stage;
      ring.advance(kStages);
    }
    wgmma_wait_group<0>();
    fence_accumulators(acc);
    if (lane == 0) mbarrier_arrive(&empty[prev_stage]);
    if (pending != nullptr) signal_row_block(pending, consumer, warp_in_wg, lane);

    // ---- epilogue: registers -> bf16 -> global, rows past the expert's end masked
    const int col0 = tile.n_tile * Config::kOutCols + 2 * (lane % 4);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (Config::kIsSwiGLU) {
        __nv_bfloat16* row_ptr = args.h + static_cast<int64_t>(rows[h]) * shape.n_valid;
        __nv_bfloat16* z_row =
            args.z == nullptr ? nullptr : args.z + static_cast<int64_t>(rows[h]) * 2 * shape.n_valid;
        epilogue_swiglu_row<Config::kNumChunks8 / 2>(acc, h, args, row_ptr, z_row, row_valid[h], col0, lane);
      } else {
        __nv_bfloat16* row_ptr = args.ys + static_cast<int64_t>(slots[h]) * args.ys_row_stride;
        epilogue_scale_row<Config::kNumChunks8>(acc, h, weights[h], row_ptr, row_valid[h], col0, shape.n_valid,
                                                lane);
      }
    }
    if constexpr (kCombine) {
      const int32_t warp_row0 = wg_row0 + warp_in_wg * kRowsPerConsumerWarp;
      const int32_t rows_stored = min(kRowsPerConsumerWarp, tile.row_end - warp_row0);
      __syncwarp();  // the warp's ys stores before lane 0's release in push
      if (lane == 0 && rows_stored > 0) combine_queue->push(make_int2(warp_row0, tile.n_tile | (rows_stored << 16)));
      __syncwarp();  // reconverge before the next tile's wgmma
    }
    if (ready != nullptr) pending = ready + row_block_index(table, tile);
  }
  if (pending != nullptr) signal_row_block(pending, consumer, warp_in_wg, lane);
}

template <Passes kPasses, int kBlockN, int kStages, bool kGatherA, bool kCombine>
__global__ void __launch_bounds__(kThreads, 1)
    moe_gemm_kernel(const __grid_constant__ CUtensorMap map_xs, const __grid_constant__ CUtensorMap map_w13,
                    const __grid_constant__ CUtensorMap map_h, const __grid_constant__ CUtensorMap map_w2,
                    const KernelArgs args) {
  using GateUp = KernelConfig<Epilogue::kSwiGLU, kBlockN, kStages>;
  using Down = KernelConfig<Epilogue::kWeightedScatter, kBlockN, kStages>;
  constexpr bool kHasGateUp = kPasses != Passes::kDown, kHasDown = kPasses != Passes::kGateUp;
  static_assert(GateUp::kStageBytes == Down::kStageBytes, "both passes share the ring");
  static_assert(!kCombine || kPasses == Passes::kDown, "the fused combine belongs to the down pass alone");
  using Config = GateUp;  // the shared-memory layout

  // ---- shared memory: [stages x A tile] [stages x B tile] [full, empty barriers] [tile table]
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + Config::kAlign - 1) & ~uintptr_t(Config::kAlign - 1));
  uint8_t* tiles_a = smem;                                   // [kStages][128][64] bf16, swizzled
  uint8_t* tiles_b = smem + kStages * Config::kTileABytes;   // [kStages][kBlockN][64] bf16
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * Config::kStageBytes);
  uint64_t* empty = full + kStages;
  // One table per pass (they differ in the number of column tiles only).
  ExpertTileTable gate_up_table;
  gate_up_table.offsets = reinterpret_cast<int32_t*>(empty + kStages);
  gate_up_table.m_prefix = gate_up_table.offsets + args.num_experts + 1;
  gate_up_table.num_experts = args.num_experts;
  gate_up_table.num_n_tiles = (args.gate_up.n_valid + GateUp::kOutCols - 1) / GateUp::kOutCols;
  ExpertTileTable down_table = gate_up_table;
  down_table.num_n_tiles = (args.down.n_valid + Down::kOutCols - 1) / Down::kOutCols;
  CombineQueue* combine_queue =
      kCombine ? reinterpret_cast<CombineQueue*>(smem + Config::table_end_bytes(args.num_experts)) : nullptr;
  if constexpr (kCombine) combine_queue->init();  // the table build's __syncthreads() follows

  const int warpgroup = threadIdx.x / kThreadsPerWarpgroup;
  const int warp_in_wg = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    if constexpr (kHasGateUp) {
      if constexpr (!kGatherA) prefetch_tensor_map(&map_xs);  // gathering reads x through args.x
      prefetch_tensor_map(&map_w13);
    }
    if constexpr (kHasDown) {
      prefetch_tensor_map(&map_h);
      prefetch_tensor_map(&map_w2);
    }
    for (int s = 0; s < kStages; ++s) {
      // TMA: the expect_tx arrival; gathering adds one arrival per producer thread.
      mbarrier_init(&full[s], 1 + (kGatherA ? kGatherThreads : 0));
      mbarrier_init(&empty[s], kNumConsumers * 4);
    }
    fence_barrier_init();
  }
  build_expert_tile_table<kBlockM>(args.expert_offsets, gate_up_table);  // ends with __syncthreads()
  // Tiles of this CTA: gate/up t = blockIdx.x + i * grid, then the down tiles continuing the
  // same round-robin after the gate/up ones.
  const int32_t num_gate_up_tiles = kHasGateUp ? gate_up_table.num_tiles() : 0;
  const PassTiles gate_up_tiles{static_cast<int32_t>(blockIdx.x), num_gate_up_tiles};
  const int32_t grid = gridDim.x;
  const PassTiles down_tiles{((static_cast<int32_t>(blockIdx.x) - num_gate_up_tiles) % grid + grid) % grid,
                             kHasDown ? down_table.num_tiles() : 0};
  int32_t* ready = kPasses == Passes::kBoth ? args.h_ready : nullptr;
  RingCursor ring;

  if (warpgroup == 0) {
    // ================================ producer ================================
    setmaxnreg_dec<kProducerRegs>();
    if constexpr (kHasGateUp) {
      if constexpr (kGatherA) {
        produce_gathered<GateUp, kStages>(args.x, &map_w13, args, gate_up_table, tiles_a, tiles_b, full, empty,
                                          gate_up_tiles, threadIdx.x, ring);
      } else if (threadIdx.x == 0) {
        produce_boxes<GateUp, kStages, false>(&map_xs, &map_w13, args, gate_up_table, tiles_a, tiles_b, full,
                                              empty, gate_up_tiles, threadIdx.x, ring, nullptr, 0);
      }
    }
    if constexpr (kHasDown) {
      if (kGatherA || threadIdx.x == 0) {
        produce_boxes<Down, kStages, kGatherA>(&map_h, &map_w2, args, down_table, tiles_a, tiles_b, full, empty,
                                               down_tiles, threadIdx.x, ring, ready, gate_up_table.num_n_tiles);
      }
    }
    if constexpr (kCombine) {
      if (warp_in_wg != 0) {  // warp 0 issues the loads
        const uint32_t buffers =
            args.combine_buffers == 0
                ? 0u
                : smem_addr(smem + Config::combine_buffers_offset(args.num_experts)) +
                      (warp_in_wg - 1) * kCombineBuffersPerWorker * args.top_k * Down::kOutCols * 2;
        run_combine_worker<Down::kOutCols, 4>(args, combine_queue, down_table.num_n_tiles, lane, buffers);
      }
    }
  } else {
    // ================================ consumers ================================
    setmaxnreg_inc<kConsumerRegs>();
    const int consumer = warpgroup - 1;
    if constexpr (kHasGateUp) {
      consume_pass<GateUp, kStages, kGatherA, false>(args, gate_up_table, tiles_a, tiles_b, full, empty,
                                                     gate_up_tiles, consumer, warp_in_wg, lane, ring, ready, nullptr);
    }
    if constexpr (kHasDown) {
      consume_pass<Down, kStages, kGatherA, kCombine>(args, down_table, tiles_a, tiles_b, full, empty, down_tiles,
                                                      consumer, warp_in_wg, lane, ring, nullptr, combine_queue);
    }
    if constexpr (kCombine) {
      finish_handovers(combine_queue, lane);
      run_combine_worker<Down::kOutCols, 8>(args, combine_queue, down_table.num_n_tiles, lane, 0u);
    }
  }
}

}  // namespace sm90

// ============================================ host ============================================
namespace {

using sm90::Epilogue;
using sm90::KernelArgs;
using sm90::Passes;
using sm90::KernelConfig;
using sm90::DeviceInfo;
using sm90::aligned16;
using sm90::make_tensor_map_bf16;
static_assert(sm90::kBlockK == sm90::kTensorMapBoxInner, "a K-block is one tensor-map box row");

void validate_common(int64_t max_rows, int64_t hidden, int64_t intermediate, int64_t num_experts) {
  FUSEMOE_CHECK(max_rows >= 0 && max_rows < (int64_t{1} << 31),
                "max_rows must be in [0, 2^31), got " << max_rows);
  FUSEMOE_CHECK(hidden > 0 && hidden % 128 == 0, "hidden must be a positive multiple of 128, got " << hidden);
  FUSEMOE_CHECK(intermediate > 0 && intermediate % 64 == 0,
                "intermediate must be a positive multiple of 64, got " << intermediate);
  FUSEMOE_CHECK(num_experts >= 1 && num_experts <= sm90::kMaxExpertsInSmem,
                "num_experts must be in [1, " << sm90::kMaxExpertsInSmem << "], got " << num_experts);
  // TMA row coordinates of the weight maps are int32: E * 2I and E * H must fit.
  FUSEMOE_CHECK(num_experts * 2 * intermediate < (int64_t{1} << 31) &&
                    num_experts * hidden < (int64_t{1} << 31),
                "num_experts * 2 * intermediate and num_experts * hidden must be < 2^31");
}

// Launches one kernel variant on the persistent grid. The dynamic shared-memory limit is raised
// once per device and variant, to what the largest E needs (a limit, not an allocation: each
// launch asks for its own E's bytes), so later calls make no attribute call. With the fused
// combine the limit is the device's (the workers' buffers take what is left, see
// launch_down_variant) and args.combine_buffers says whether this launch has them.
template <Passes kPasses, int kBlockN, int kStages, bool kGatherA, bool kCombine = false>
void launch_variant(const DeviceInfo& info, int num_sms_override, int64_t num_experts, const CUtensorMap& map_xs,
                    const CUtensorMap& map_w13, const CUtensorMap& map_h, const CUtensorMap& map_w2,
                    const KernelArgs& args, cudaStream_t stream) {
  using Config = KernelConfig<Epilogue::kSwiGLU, kBlockN, kStages>;  // both passes: the same layout
  auto kernel = sm90::moe_gemm_kernel<kPasses, kBlockN, kStages, kGatherA, kCombine>;
  const size_t smem_bytes =
      Config::smem_bytes(static_cast<int>(num_experts), kCombine, args.combine_buffers ? args.top_k : 0);
  const size_t smem_limit =
      kCombine ? static_cast<size_t>(info.max_smem_optin)
               : std::min(Config::smem_bytes(sm90::kMaxExpertsInSmem, false), static_cast<size_t>(info.max_smem_optin));
  FUSEMOE_CHECK(smem_bytes <= smem_limit, "grouped GEMM needs " << smem_bytes
                                                                << " bytes of shared memory, the device allows "
                                                                << info.max_smem_optin);
  static std::atomic<uint64_t> configured{0};
  sm90::raise_smem_limit_once(reinterpret_cast<const void*>(kernel), smem_limit, info.device, &configured);
  const int grid = num_sms_override > 0 ? std::min(num_sms_override, info.num_sms) : info.num_sms;
  kernel<<<grid, sm90::kThreads, smem_bytes, stream>>>(map_xs, map_w13, map_h, map_w2, args);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

// The tensor-map parameter of an operand the launch does not read.
const CUtensorMap kUnusedMap{};

// Argument checks of the gate/up GEMM that hold even when there are no rows.
void validate_gate_up(const Sm90GateUpParams& p) {
  validate_common(p.max_rows, p.hidden, p.intermediate, p.num_experts);
  FUSEMOE_CHECK(!p.use_swiglu_clamp || (p.swiglu_clamp > 0.0f && p.swiglu_clamp < INFINITY),
                "swiglu_clamp must be finite and > 0 when use_swiglu_clamp, got " << p.swiglu_clamp);
  const Sm90RowSources& src = p.sources;
  FUSEMOE_CHECK(src.num_sources >= 0 && src.num_sources <= kMaxRowSources,
                "sources.num_sources must be in [0, " << kMaxRowSources << "], got " << src.num_sources);
  FUSEMOE_CHECK((src.num_sources > 0) != (p.xs != nullptr),
                "give either row sources (direct dispatch) or the pool xs, not both and not neither");
}

// The gate/up GEMM's maps (xs, w13) and its part of the kernel arguments, after the pointer
// checks (rows to compute). map_xs is unused with direct dispatch.
struct GateUpLaunch {
  CUtensorMap map_xs, map_w13;
  bool direct;
};
GateUpLaunch configure_gate_up(const Sm90GateUpParams& p, KernelArgs* args) {
  const Sm90RowSources& src = p.sources;
  const bool direct = src.num_sources > 0;
  if (direct) {
    FUSEMOE_CHECK(src.x[0] && aligned16(src.x[0]), "sources.x[0] must be a non-null 16-byte aligned device pointer");
    FUSEMOE_CHECK(src.num_rows[0] >= 1 && src.num_rows[0] < (int64_t{1} << 31),
                  "sources.num_rows[0] must be in [1, 2^31), got " << src.num_rows[0]);
    FUSEMOE_CHECK(p.row_slot != nullptr, "row_slot must be a non-null device pointer for direct dispatch");
    FUSEMOE_CHECK(p.top_k >= 1 && p.top_k < (int64_t{1} << 31), "top_k must be >= 1, got " << p.top_k);
    // The gather addresses x in 32-bit indices of 16-byte chunks.
    FUSEMOE_CHECK(src.num_rows[0] * p.hidden / 8 <= (int64_t{1} << 32),
                  "sources.x[0] must be at most 64 GiB for direct dispatch, got " << src.num_rows[0] << " rows of "
                                                                                  << p.hidden);
  } else {
    FUSEMOE_CHECK(aligned16(p.xs), "xs must be a 16-byte aligned device pointer");
  }
  FUSEMOE_CHECK(p.w13 && aligned16(p.w13), "w13 must be a non-null 16-byte aligned device pointer");
  FUSEMOE_CHECK(p.h && aligned16(p.h), "h must be a non-null 16-byte aligned device pointer");
  FUSEMOE_CHECK(aligned16(p.z), "z must be null or a 16-byte aligned device pointer");
  FUSEMOE_CHECK(p.expert_offsets != nullptr, "expert_offsets must be a non-null device pointer");

  // 128 x (128 gate + 128 up) tiles; A gathered from x by cp.async (direct) or one 128-row TMA
  // box of xs per stage.
  using Config = KernelConfig<Epilogue::kSwiGLU, 256, 4>;
  GateUpLaunch out;
  out.direct = direct;
  out.map_w13 =
      make_tensor_map_bf16(p.w13, p.hidden, p.num_experts * 2 * p.intermediate, Config::kBoxRowsB, "w13");
  out.map_xs = direct ? kUnusedMap : make_tensor_map_bf16(p.xs, p.hidden, p.max_rows, sm90::kBlockM, "xs");
  args->expert_offsets = p.expert_offsets;
  args->num_experts = static_cast<int32_t>(p.num_experts);
  args->gate_up.num_k_blocks = static_cast<int32_t>(p.hidden / sm90::kBlockK);
  args->gate_up.n_valid = static_cast<int32_t>(p.intermediate);
  args->gate_up.weight_rows_per_expert = static_cast<int32_t>(2 * p.intermediate);
  args->h = static_cast<__nv_bfloat16*>(p.h);
  args->z = static_cast<__nv_bfloat16*>(p.z);
  args->use_clamp = p.use_swiglu_clamp ? 1 : 0;
  args->clamp = p.swiglu_clamp;
  args->row_slot = p.row_slot;
  args->x = static_cast<const __nv_bfloat16*>(src.x[0]);
  args->top_k = static_cast<int32_t>(p.top_k);
  return out;
}

void validate_down(const Sm90DownParams& p) {
  validate_common(p.max_rows, p.hidden, p.intermediate, p.num_experts);
  FUSEMOE_CHECK(p.ys_row_stride == 0 || (p.ys_row_stride >= p.hidden && p.ys_row_stride % 8 == 0),
                "ys_row_stride must be 0 or a multiple of 8 that is >= hidden, got " << p.ys_row_stride);
  FUSEMOE_CHECK(p.num_slots >= 0 && p.num_slots < (int64_t{1} << 31),
                "num_slots must be in [0, 2^31), got " << p.num_slots);
  FUSEMOE_CHECK(p.block_n == 0 || p.block_n == 128 || p.block_n == 256,
                "block_n must be 0, 128 or 256, got " << p.block_n);
  if (p.y != nullptr) {  // the fused combine
    FUSEMOE_CHECK(p.top_k >= 1 && p.top_k <= 32, "top_k must be in [1, 32] with the fused combine, got " << p.top_k);
    FUSEMOE_CHECK(p.hidden / 128 < (int64_t{1} << 16),
                  "hidden must be < 2^23 with the fused combine (column tiles are 16-bit in the hand-over), got "
                      << p.hidden);
    FUSEMOE_CHECK(p.num_slots % p.top_k == 0,
                  "num_slots must be a multiple of top_k with the fused combine, got " << p.num_slots << " and "
                                                                                        << p.top_k);
  }
}

// Device counters of the fused combine: combine_pending[t * num_n_tiles + n] = the number of
// token t's slots that have a row; tokens with none get y[t] = 0 here (no row will ever
// complete them).
__global__ void combine_counters_init_kernel(const int32_t* __restrict__ slot_row, int64_t num_tokens,
                                             int32_t top_k, int32_t num_n_tiles, int64_t hidden,
                                             int32_t* __restrict__ pending, __nv_bfloat16* __restrict__ y) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < num_tokens;
       t += int64_t(gridDim.x) * blockDim.x) {
    int32_t rows = 0;
    for (int32_t j = 0; j < top_k; ++j) rows += slot_row[t * top_k + j] >= 0;
    for (int32_t n = 0; n < num_n_tiles; ++n) pending[t * num_n_tiles + n] = rows;
    if (rows == 0) {
      uint4* row = reinterpret_cast<uint4*>(y + t * hidden);
      for (int64_t c = 0; c < hidden / 8; ++c) row[c] = make_uint4(0, 0, 0, 0);
    }
  }
}

// The down GEMM's maps (h, w2: boxes of block_n rows) and its part of the kernel arguments.
struct DownLaunch {
  CUtensorMap map_h, map_w2;
};
DownLaunch configure_down(const Sm90DownParams& p, int block_n, KernelArgs* args) {
  FUSEMOE_CHECK(p.h && aligned16(p.h), "h must be a non-null 16-byte aligned device pointer");
  FUSEMOE_CHECK(p.w2 && aligned16(p.w2), "w2 must be a non-null 16-byte aligned device pointer");
  FUSEMOE_CHECK(p.ys && aligned16(p.ys), "ys must be a non-null 16-byte aligned device pointer");
  FUSEMOE_CHECK(p.expert_offsets && p.row_slot && p.topk_weights,
                "expert_offsets, row_slot and topk_weights must be non-null device pointers");
  DownLaunch out;
  out.map_h = make_tensor_map_bf16(p.h, p.intermediate, p.max_rows, sm90::kBlockM, "h");
  out.map_w2 = make_tensor_map_bf16(p.w2, p.intermediate, p.num_experts * p.hidden, block_n, "w2");
  args->expert_offsets = p.expert_offsets;
  args->num_experts = static_cast<int32_t>(p.num_experts);
  args->down.num_k_blocks = static_cast<int32_t>(p.intermediate / sm90::kBlockK);
  args->down.n_valid = static_cast<int32_t>(p.hidden);
  args->down.weight_rows_per_expert = static_cast<int32_t>(p.hidden);
  args->ys = static_cast<__nv_bfloat16*>(p.ys);
  args->ys_row_stride = p.ys_row_stride == 0 ? p.hidden : p.ys_row_stride;
  args->row_slot = p.row_slot;
  args->topk_weights = p.topk_weights;
  if (p.y != nullptr) {
    FUSEMOE_CHECK(aligned16(p.y), "y must be a 16-byte aligned device pointer");
    FUSEMOE_CHECK(p.slot_row != nullptr, "slot_row must be a non-null device pointer with the fused combine");
    FUSEMOE_CHECK(p.combine_pending != nullptr,
                  "combine_pending must be a device buffer of sm90_combine_counters(num_tokens, hidden) int32 with "
                  "the fused combine");
    args->y = static_cast<__nv_bfloat16*>(p.y);
    args->slot_row = p.slot_row;
    args->combine_pending = p.combine_pending;
    args->top_k = static_cast<int32_t>(p.top_k);
  }
  return out;
}

// The down GEMM at one tile width, with or without the fused combine; with it, the producer
// workers get their K-row buffers when they fit beside the ring, the tile table and the queue
// (else they combine from registers).
template <int kBlockN, int kStages>
void launch_down_variant(const DeviceInfo& info, const Sm90DownParams& p, const DownLaunch& d, KernelArgs args,
                         bool combine) {
  using Config = KernelConfig<Epilogue::kSwiGLU, kBlockN, kStages>;
  if (combine) {
    const size_t with_buffers =
        Config::smem_bytes(static_cast<int>(p.num_experts), true, static_cast<int>(p.top_k));
    args.combine_buffers = with_buffers <= static_cast<size_t>(info.max_smem_optin) ? 1 : 0;
    launch_variant<Passes::kDown, kBlockN, kStages, false, true>(info, p.num_sms, p.num_experts, kUnusedMap,
                                                                 kUnusedMap, d.map_h, d.map_w2, args, p.stream);
  } else {
    launch_variant<Passes::kDown, kBlockN, kStages, false>(info, p.num_sms, p.num_experts, kUnusedMap, kUnusedMap,
                                                           d.map_h, d.map_w2, args, p.stream);
  }
}

}  // namespace

int64_t sm90_combine_counters(int64_t num_tokens, int64_t hidden) {
  return num_tokens * ((hidden + 127) / 128);  // column tiles of the narrowest block_n
}

int64_t sm90_forward_row_blocks(int64_t max_rows, int64_t num_experts) {
  return (max_rows + sm90::kBlockM - 1) / sm90::kBlockM + num_experts;
}

void launch_sm90_gate_up_swiglu(const Sm90GateUpParams& p) {
  // ---- validate
  validate_gate_up(p);
  if (p.max_rows == 0) return;
  KernelArgs args{};
  const GateUpLaunch g = configure_gate_up(p, &args);  // pointer checks, maps, arguments
  const DeviceInfo info = sm90::device_info();

  // ---- launch: 128 x 256 tiles, 4 stages of 48 KB
  if (g.direct) {
    launch_variant<Passes::kGateUp, 256, 4, true>(info, p.num_sms, p.num_experts, g.map_xs, g.map_w13, kUnusedMap,
                                                  kUnusedMap, args, p.stream);
  } else {
    launch_variant<Passes::kGateUp, 256, 4, false>(info, p.num_sms, p.num_experts, g.map_xs, g.map_w13, kUnusedMap,
                                                   kUnusedMap, args, p.stream);
  }
}

void launch_sm90_down_weighted(const Sm90DownParams& p) {
  // ---- validate
  validate_down(p);
  if (p.max_rows == 0) return;
  KernelArgs args{};
  const int block_n = p.block_n == 0 ? 256 : p.block_n;
  const DownLaunch d = configure_down(p, block_n, &args);
  const DeviceInfo info = sm90::device_info();

  // ---- launch: the combine's counters first (they need slot_row, which routing has written),
  // then 128 x 256 tiles with 4 stages of 48 KB, or 128 x 128 with 6 stages of 32 KB
  const bool combine = p.y != nullptr;
  if (combine) {
    const int64_t num_tokens = p.num_slots / p.top_k;
    const int32_t num_n_tiles = static_cast<int32_t>((p.hidden + block_n - 1) / block_n);
    constexpr int kInitThreads = 256;
    const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((num_tokens + kInitThreads - 1) / kInitThreads,
                                                                  4 * int64_t{info.num_sms}));
    combine_counters_init_kernel<<<static_cast<unsigned>(blocks), kInitThreads, 0, p.stream>>>(
        p.slot_row, num_tokens, static_cast<int32_t>(p.top_k), num_n_tiles, p.hidden, p.combine_pending,
        static_cast<__nv_bfloat16*>(p.y));
    FUSEMOE_CUDA_CHECK(cudaGetLastError());
  }
  if (block_n == 128) {
    launch_down_variant<128, 6>(info, p, d, args, combine);
  } else {
    launch_down_variant<256, 4>(info, p, d, args, combine);
  }
}

void launch_sm90_forward_gemms(const Sm90GateUpParams& gate_up, const Sm90DownParams& down, int32_t* h_ready) {
  // ---- validate: each GEMM's own checks, then that they describe one layer and one launch
  validate_gate_up(gate_up);
  validate_down(down);
  FUSEMOE_CHECK(gate_up.max_rows == down.max_rows && gate_up.hidden == down.hidden &&
                    gate_up.intermediate == down.intermediate && gate_up.num_experts == down.num_experts,
                "gate_up and down must have the same max_rows, hidden, intermediate and num_experts");
  FUSEMOE_CHECK(gate_up.expert_offsets == down.expert_offsets && gate_up.h == down.h,
                "gate_up and down must share expert_offsets and h");
  FUSEMOE_CHECK(gate_up.num_sms == down.num_sms && gate_up.stream == down.stream,
                "gate_up and down must have the same num_sms and stream (one launch)");
  FUSEMOE_CHECK(down.block_n == 0 || down.block_n == 256, "down.block_n must be 0 or 256 in the one-launch forward");
  FUSEMOE_CHECK(down.y == nullptr, "down.y must be null in the one-launch forward (no fused combine there)");
  if (gate_up.max_rows == 0) return;
  FUSEMOE_CHECK(h_ready != nullptr && aligned16(h_ready),
                "h_ready must be a 16-byte aligned device buffer of sm90_forward_row_blocks() int32");
  KernelArgs args{};
  const GateUpLaunch g = configure_gate_up(gate_up, &args);
  const DownLaunch d = configure_down(down, 256, &args);
  args.h_ready = h_ready;
  const DeviceInfo info = sm90::device_info();

  // ---- launch: the counters start at zero (a memset node; graph capturable), then one grid
  FUSEMOE_CUDA_CHECK(cudaMemsetAsync(h_ready, 0,
                                     sm90_forward_row_blocks(gate_up.max_rows, gate_up.num_experts) * sizeof(int32_t),
                                     gate_up.stream));
  if (g.direct) {
    launch_variant<Passes::kBoth, 256, 4, true>(info, gate_up.num_sms, gate_up.num_experts, g.map_xs, g.map_w13,
                                                d.map_h, d.map_w2, args, gate_up.stream);
  } else {
    launch_variant<Passes::kBoth, 256, 4, false>(info, gate_up.num_sms, gate_up.num_experts, g.map_xs, g.map_w13,
                                                 d.map_h, d.map_w2, args, gate_up.stream);
  }
}

}  // namespace fusemoe

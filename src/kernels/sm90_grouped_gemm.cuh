// The sm90 grouped GEMM over an expert-sorted row pool: one persistent, warp-specialised TMA +
// wgmma kernel template whose instances are every GEMM of the fused MoE layer.
//
//   instance        A (activations)        B                     scheduler       epilogue
//   gate/up+SwiGLU  x rows gathered         w13 gate/up boxes*    row tiles       SwiGLU (+ z)
//   down            h pool                  w2 rows               row tiles       weighted slot rows
//   recompute z     xs pool                 w13 rows*             row tiles       sorted rows
//   dgrad+SwiGLU    dys pool                w2 N-major            row tiles       dgrad SwiGLU
//   dgrad of x      dz pool                 w13 N-major*          row tiles       slot rows
//   weight grads    act_m^T pool            act_n pool N-major    expert output   TMA-store tiles
//   FP8 weight grads  token-blocked pools, both K-major (sm90_block_scaled.cuh)
//   * or from separate gate and up weights w1, w3: a second tensor map (map_b_up), same tiles
//
// Tile order (TileOrder_): static, t = blockIdx.x + i * gridDim.x; or dynamic (TileFeed: each CTA
// takes the next tile index from the launch's counter as it goes, so the CTAs that read one
// weight slice stay in step and share it through L2). The forward's gate/up and down only, where
// the layer has many experts (sm90_forward_dynamic_tile_order, sm90_grouped_gemm.h).
// Thread roles (384 threads, one CTA per SM):
//   warpgroup 0 (producer, 40 registers): fills the kStages-deep stage ring for every (tile,
//     k-block), running ahead across tiles so the next tile's loads overlap this tile's
//     epilogue. Thread 0 issues the TMA loads; a gathered A is copied by all 128 threads.
//   warpgroups 1, 2 (consumers, 232 registers): consumer c issues wgmma m64 x kBlockN x k16 on
//     tile rows [64c, 64c + 64) into fp32 registers, then runs the epilogue from them (a holding
//     epilogue packs the tile and writes it under the next tile's main loop: HeldBoxes); or, in
//     the ping-pong schedule (PingPongConsumers, sm90_layout.cuh), takes every other tile of
//     the CTA whole, rows [0, 64) and [64, 128), the two main loops taking turns.
// Shared memory: [kStages x A tile][kStages x B tile][epilogue staging][full, empty][tile feed,
// dynamic order only][tile table, row tiles only].
// Rows of a row tile at or past its expert's end are computed but never stored. Weight
// gradients reduce over an expert's rows in 64-row K-blocks from its first row; the k-rows of
// the last block that belong to the next expert (or lie past the pool) are zeroed in shared
// memory before the MMA, both operands, so no foreign row enters the sum and 0 * NaN never
// occurs; the pools need no padding.
//
// Arguments: one GemmParams per instance, a __grid_constant__ kernel parameter read in place,
// so each instance's code does not depend on the size of the argument block (a by-value
// parameter of up to 128 bytes was copied into registers at entry and its size moved ptxas's
// unswitching: docs/experiments.md#kernelargs-size). Behaviour choices are template
// parameters of the policies, never runtime flags.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "device/sm90_block_scaled.cuh"
#include "device/sm90_epilogues.cuh"
#include "device/sm90_layout.cuh"
#include "device/sm90_operands.cuh"
#include "device/sm90_pipeline.cuh"
#include "device/sm90_ptx.cuh"
#include "device/sm90_schedulers.cuh"

namespace fusemoe::sm90 {

// Slots of the dynamic tile order's index ring (TileFeed) and their shared memory.
constexpr int kTileSlots = 4;
constexpr size_t kTileFeedBytes = kTileSlots * (2 * sizeof(uint64_t) + sizeof(int32_t));

// One instance of the kernel: its operand sources, scheduler and epilogue.
template <class A_, class B_, class Scheduler_, class Epilogue_, class Consumers_ = CooperativeConsumers,
          class TileOrder_ = StaticTileOrder>
struct GroupedGemm {
  using A = A_;
  using B = B_;
  using Scheduler = Scheduler_;
  using Epilogue = Epilogue_;
  using Consumers = Consumers_;
  static constexpr int kBlockN = B::kBlockN;      // wgmma N
  static constexpr int kTileCols = B::kTileCols;  // output columns per tile (gate/up: kBlockN / 2)
  static constexpr int kTileBBytes = kBlockN * kBlockK * 2;
  static constexpr int kStageBytes = kTileABytes + kTileBBytes;
  static constexpr int kStages =
      ((Scheduler::kTableInSmem ? kSmemDataBytes : kSmemDataBytesNoTable) - Epilogue::kStagingBytes) / kStageBytes;
  static constexpr int kAccRegs = kBlockN / 2;  // per m64 row block; a consumer holds Consumers::kRowBlocks
  // Blockwise FP8 (sm90_block_scaled.cuh): its own consumer loop and a scale record per stage.
  static constexpr bool kBlockScaled = IsBlockScaled<A>::value;
  // Arrivals that release a stage: one per consumer warp, or, block-scaled, one per consumer
  // thread, each after its own reads of the stage's scales (StageRing).
  static constexpr uint32_t kStageReleases =
      Consumers::kWarpgroupsPerTile * (kBlockScaled ? kThreadsPerWarpgroup : kWarpsPerWarpgroup);
  static constexpr int kScaleRingBytes = kBlockScaled ? kStages * kStageScalesBytes : 0;
  // Tiles from the launch's counter (TileOrder_, sm90_layout.cuh); its own template parameter, so
  // the static instances carry none of the feed's code.
  static constexpr bool kDynamicTiles = TileOrder_::kDynamic;
  using Mma = Wgmma<kBlockN, A::kMnMajor ? 1 : 0, B::kMnMajor ? 1 : 0>;
  using LayoutA = OperandLayout<A::kMnMajor>;
  using LayoutB = OperandLayout<B::kMnMajor>;

  static_assert(kBlockN == 128 || kBlockN == 256, "wgmma N of the wrappers");
  static_assert(!kDynamicTiles || (!Consumers::kPingPong && !kBlockScaled && Scheduler::kTableInSmem),
                "dynamic tile order: cooperative row-tile instances of the bf16 consumer loop (the ping-pong "
                "turns are built on the static order)");
  static_assert(kStages >= 3, "a ring of at least 3 stages keeps TMA ahead of the MMAs");
  static_assert(kTileABytes % kSmemAlign == 0 && kTileBBytes % kSmemAlign == 0, "stage alignment");
  static_assert(Epilogue::kStagingBytes % kSmemAlign == 0, "staging alignment");
  static_assert(!Scheduler::kReducesOverRows || (!A::kGathered && A::kMnMajor && B::kMnMajor) ||
                    (kBlockScaled && !A::kGathered && !A::kMnMajor && !B::kMnMajor),
                "a reduction over rows reads both operands as transposed pool boxes (bf16) or token-blocked "
                "pools (FP8, K-major)");
  static_assert(!Consumers::kPingPong || (!Scheduler::kReducesOverRows && !kBlockScaled &&
                                          Epilogue::kStagingBytes == 0 && Consumers::kRowBlocks * kAccRegs <= 128),
                "ping-pong: row tiles, the bf16 consumer loop, no per-consumer staging, and at most 128 "
                "accumulators per thread (the consumers' 232 registers after setmaxnreg)");

  static constexpr size_t smem_bytes(int num_experts) {
    return kSmemAlign + static_cast<size_t>(kStages) * kStageBytes + Epilogue::kStagingBytes + kScaleRingBytes +
           2 * kStages * sizeof(uint64_t) + (kDynamicTiles ? kTileFeedBytes : 0) +
           (Scheduler::kTableInSmem ? 2 * (static_cast<size_t>(num_experts) + 1) * sizeof(int32_t) : 0);
  }
  static_assert(smem_bytes(kMaxExperts) <= kSmemOptinBytes, "shared memory beyond sm90's opt-in limit");
};

// Sizes every instance reads.
struct GemmShape {
  const int32_t* expert_offsets;  // [E+1] device
  int32_t num_experts;
  int32_t num_k_blocks;           // row tiles: K / 64
  int32_t n_valid;                // output columns N
  int32_t m_valid;                // expert-output tiles: rows M of one expert's output
  int32_t b_rows_per_expert;      // row tiles: rows of one expert's weight in the B map
  WaitBound wait;                 // the bound of every ring wait
  int32_t* tile_counter;          // dynamic tile order: zero at launch, one atomicAdd per tile and CTA
};

// Whether a B policy reads two weights (gate and up: kTwoMaps), which adds map_b_up to GemmParams.
template <class B, class = void>
struct TwoBMaps : std::false_type {};
template <class B>
struct TwoBMaps<B, std::void_t<decltype(B::kTwoMaps)>> : std::bool_constant<B::kTwoMaps> {};

// Empty for one map: the parameters of every other instance keep their layout.
template <bool kTwoMaps>
struct UpWeightMap {};
template <>
struct UpWeightMap<true> {
  CUtensorMap map_b_up;  // the up weights w3; map_b is then the gate weights w1
};

template <class Gemm>
struct GemmParams : UpWeightMap<TwoBMaps<typename Gemm::B>::value> {
  CUtensorMap map_b;
  typename Gemm::A::Args a;
  typename Gemm::Epilogue::Args epilogue;
  GemmShape shape;
};

template <class Gemm>
__device__ __forceinline__ typename Gemm::Scheduler make_scheduler(const GemmShape& s, int32_t* table_smem) {
  typename Gemm::Scheduler sched;
  const int32_t num_n_tiles = (s.n_valid + Gemm::kTileCols - 1) / Gemm::kTileCols;
  if constexpr (Gemm::Scheduler::kTableInSmem) {
    sched.table.offsets = table_smem;
    sched.table.m_prefix = table_smem + s.num_experts + 1;
    sched.table.num_experts = s.num_experts;
    sched.table.num_n_tiles = num_n_tiles;
    sched.num_k_blocks = s.num_k_blocks;
  } else {
    sched.offsets = s.expert_offsets;
    sched.num_experts = s.num_experts;
    sched.num_n_tiles = num_n_tiles;
    sched.num_m_tiles = s.m_valid / kBlockM;
  }
  return sched;
}

// ------------------------------------------------------------------------------ tile feed

// Dynamic tile order (DynamicTileOrder): producer thread 0 takes tile indices from the
// launch's counter, one ahead of the tile whose loads it issues, and posts them in a shared-memory
// ring of kTileSlots; every role reads the same sequence from it (the producer threads that gather,
// both consumer warpgroups), lane 0 of each reading warp releasing the slot. An index >= num_tiles
// ends the sequence. The last CTA to take its end zeroes the counter for the next launch.
struct TileFeed {
  uint64_t* bars;        // [full: kTileSlots][empty: kTileSlots][index: kTileSlots int32]
  uint32_t readers = 0;  // threads that release each slot (the empty barriers' count)
  int32_t n = 0;         // entries passed: slot n % kTileSlots, phase (n / kTileSlots) & 1

  __device__ __forceinline__ int slot() const { return n % kTileSlots; }
  __device__ __forceinline__ uint32_t phase() const { return static_cast<uint32_t>(n / kTileSlots) & 1u; }
  __device__ __forceinline__ int32_t* index() const { return reinterpret_cast<int32_t*>(bars + 2 * kTileSlots); }

  // Producer thread 0: posts the next index, `ended` once the counter has passed num_tiles (no
  // atomic after that: the counter may already be zeroed for the next launch).
  __device__ __forceinline__ void post(int32_t* counter, int32_t num_tiles, bool& ended, const WaitBound& w) {
    bounded_wait(&bars[kTileSlots + slot()], phase() ^ 1, w, WaitRole::kProducer, WaitObject::kTileIndexRead, slot(),
                 readers);
    int32_t t = num_tiles;
    if (!ended) {
      t = atomicAdd(counter, 1);
      if (t >= num_tiles) {
        ended = true;
        __threadfence();  // this CTA's last take, before it counts itself done
        if (atomicAdd(counter + 1, 1) == static_cast<int32_t>(gridDim.x) - 1) {
          atomicExch(counter, 0);  // every CTA has taken its last index
          atomicExch(counter + 1, 0);
        }
      }
    }
    index()[slot()] = t;
    if (!kFaultInjection || w.fault != static_cast<int32_t>(WaitFault::kTileIndexPosted)) mbarrier_arrive(&bars[slot()]);
    ++n;
  }
  __device__ __forceinline__ int32_t read(const WaitBound& w, WaitRole role) {
    bounded_wait(&bars[slot()], phase(), w, role, WaitObject::kTileIndexPosted, slot(), 1);
    const int32_t t = *reinterpret_cast<volatile int32_t*>(&index()[slot()]);
    // Every reader releases the slot after its own read: nothing to order across lanes (and
    // racecheck, which does not follow __syncwarp before one lane's arrival, sees the order).
    mbarrier_arrive(&bars[kTileSlots + slot()]);
    ++n;
    return t;
  }
};

// ------------------------------------------------------------------------------- producer

// Fills the ring for every (tile, k-block). A block-scaled instance also fills each
// stage's scales: thread 0 copies the B scales by cp.async, and A's row scales come with its
// gathered rows or from every producer thread; each thread's one cp.async arrival on the
// stage's full barrier covers all of its copies.
template <class Gemm>
__device__ __forceinline__ void produce(const GemmParams<Gemm>& p, typename Gemm::Scheduler sched,
                                        const StageRing<Gemm::kStages>& ring, uint8_t* tiles_a, uint8_t* tiles_b,
                                        StageScales* scales, TileFeed feed, int thread) {
  using A = typename Gemm::A;
  using B = typename Gemm::B;
  const BShape b_shape{p.shape.n_valid, p.shape.b_rows_per_expert};
  RingCursor<Gemm::kStages> cursor;
  const int32_t num_tiles = sched.num_tiles();
  TileFeed post = feed;
  bool ended = false;
  constexpr bool dynamic = Gemm::kDynamicTiles;
  if (dynamic && thread == 0) post.post(p.shape.tile_counter, num_tiles, ended, p.shape.wait);
  auto next_tile = [&](int32_t t) {
    if (!dynamic) return t + static_cast<int32_t>(gridDim.x);
    if (thread == 0) post.post(p.shape.tile_counter, num_tiles, ended, p.shape.wait);  // the one after
    return feed.read(p.shape.wait, WaitRole::kProducer);
  };
  for (int32_t t = next_tile(static_cast<int32_t>(blockIdx.x) - static_cast<int32_t>(gridDim.x)); t < num_tiles;
       t = next_tile(t)) {
    const Tile tile = sched.tile(t);
    typename A::ThreadRows rows{};
    if constexpr (A::kGathered) rows = A::rows_of(p.a, tile, tile.num_k_blocks, thread);
    const uint32_t stage_bytes = announced_stage_bytes(A::kTmaBytes + B::bytes(tile, b_shape), p.shape.wait);
    for (int32_t kb = 0; kb < tile.num_k_blocks; ++kb) {
      const int stage = cursor.stage;
      bounded_wait(&ring.empty[stage], cursor.phase ^ 1, p.shape.wait, WaitRole::kProducer, WaitObject::kStageEmpty,
                   stage, Gemm::kStageReleases);
      if (thread == 0) {
        if constexpr (Gemm::kBlockScaled) {
          // Thread 0's cp.async arrival below (every producer thread makes one) covers these too.
          static_assert(kAllProducerThreads<A>, "block-scaled stages are filled by every producer thread");
          B::load_scales(p.a.b_scales, smem_addr(scales[stage].b), tile, kb);
        }
        mbarrier_arrive_expect_tx(&ring.full[stage], stage_bytes);
        if constexpr (!A::kGathered) A::load(p.a, &ring.full[stage], tiles_a + stage * kTileABytes, tile, kb);
        uint8_t* tile_b = tiles_b + stage * Gemm::kTileBBytes;
        if constexpr (TwoBMaps<B>::value) {
          B::load(&p.map_b, &p.map_b_up, &ring.full[stage], tile_b, tile, kb, b_shape);
        } else {
          B::load(&p.map_b, &ring.full[stage], tile_b, tile, kb, b_shape);
        }
      }
      if constexpr (A::kGathered) {
        const uint32_t tile_a = smem_addr(tiles_a + stage * kTileABytes);
        if constexpr (Gemm::kBlockScaled) {
          A::gather(p.a, rows, tile_a, smem_addr(scales[stage].a), kb, thread);
        } else {
          A::gather(p.a, rows, tile_a, kb, thread);
        }
        cp_async_mbarrier_arrive_noinc(&ring.full[stage]);
      } else if constexpr (ScalesPerThread<A>::value) {
        A::copy_scale(p.a, tile, kb, smem_addr(scales[stage].a), thread);
        cp_async_mbarrier_arrive_noinc(&ring.full[stage]);
      }
      cursor.advance();
    }
  }
  if constexpr (A::kGathered || Gemm::kBlockScaled) cp_async_wait_all();  // no copy outlives its thread
}

// ------------------------------------------------------------------------------- consumers

// Zeroes k-rows [valid_rows, 64) of one MN-major box (a k-row is one contiguous 128-byte line:
// the swizzle only permutes 16-byte chunks inside it). Called by a warpgroup's 128 threads.
__device__ __forceinline__ void zero_box_rows(uint8_t* box, int valid_rows, int tid) {
  constexpr int kVecsPerRow = kSwizzleRowBytes / 16;
  for (int i = valid_rows * kVecsPerRow + tid; i < kMnBoxRows * kVecsPerRow; i += kThreadsPerWarpgroup) {
    *reinterpret_cast<uint4*>(box + i * 16) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// The thread as the epilogue sees row block b of its tile: rows [64b, 64b + 64) in the ping-pong
// schedule (where ConsumerThread::consumer names the row block, not the warpgroup), its own
// rows in the cooperative one.
template <class Consumers>
__device__ __forceinline__ ConsumerThread row_block_thread(const ConsumerThread& me, int b) {
  if constexpr (!Consumers::kPingPong) return me;
  ConsumerThread block = me;
  block.consumer = b;
  return block;
}

template <class Gemm>
__device__ __forceinline__ void consume(const GemmParams<Gemm>& p, typename Gemm::Scheduler sched,
                                        const StageRing<Gemm::kStages>& ring, uint8_t* tiles_a, uint8_t* tiles_b,
                                        uint8_t* staging, TileFeed feed, const ConsumerThread& me) {
  using Epilogue = typename Gemm::Epilogue;
  using Consumers = typename Gemm::Consumers;
  constexpr int kRowBlocks = Consumers::kRowBlocks;
  // Named barrier over both consumers: one arrives (its turn is over), the other syncs.
  constexpr uint32_t kOrderThreads = kNumConsumers * kThreadsPerWarpgroup;
  const EpilogueShape out_shape{p.shape.n_valid, p.shape.m_valid};
  RingCursor<Gemm::kStages> cursor;
  float acc[kRowBlocks][Gemm::kAccRegs];
  constexpr int kHeldBoxes = HeldBoxes<Epilogue>::kBoxes;
  static_assert(kHeldBoxes == 0 || (kRowBlocks == 1 && !Consumers::kPingPong), "held boxes: cooperative tiles");
  typename HeldBoxes<Epilogue>::Held held{};
  const int32_t num_tiles = sched.num_tiles();
  constexpr bool dynamic = Gemm::kDynamicTiles;
  auto next_tile = [&](int32_t t) {
    return dynamic ? feed.read(p.shape.wait, WaitRole::kConsumer) : t + static_cast<int32_t>(gridDim.x);
  };
  for (int32_t t = next_tile(static_cast<int32_t>(blockIdx.x) - static_cast<int32_t>(gridDim.x)), local = 0;
       t < num_tiles; t = next_tile(t), ++local) {
    const Tile tile = sched.tile(t);
    if constexpr (Consumers::kPingPong) {
      if (local % kNumConsumers != me.consumer) {  // the other consumer's tile
        cursor.skip(tile.num_k_blocks);
        continue;
      }
    }
    const ConsumerThread me0 = row_block_thread<Consumers>(me, 0);
    const AccRows rows(tile, me0);
    typename Epilogue::Inputs inputs = Epilogue::prepare(p.epilogue, out_shape, tile, rows, me0);
    // Ping-pong: wait for the turn the other consumer hands over once it has waited on the last
    // stage of the CTA's previous tile.
    if constexpr (Consumers::kPingPong) {
      if (local > 0) named_barrier_sync(kOrderBarrierId0 + me.consumer, kOrderThreads);
    }
    const bool hands_over = Consumers::kPingPong && t + static_cast<int32_t>(gridDim.x) < num_tiles;

    // ---- main loop: acc[b][64 rows, kBlockN] = A[row block b, K] * B[K, kBlockN] for this
    // consumer's row blocks (its own 64 rows, or both blocks of the tile)
    int prev_stage = 0;
    for (int32_t kb = 0; kb < tile.num_k_blocks; ++kb) {
      const int stage = cursor.stage;
      bounded_wait(&ring.full[stage], cursor.phase, p.shape.wait, WaitRole::kConsumer, WaitObject::kStageFull, stage,
                   Gemm::A::kTmaBytes + Gemm::kTileBBytes);
      if constexpr (Consumers::kPingPong) {
        if (hands_over && kb == tile.num_k_blocks - 1) named_barrier_arrive(kOrderBarrierId0 + (me.consumer ^ 1), kOrderThreads);
      }
      uint8_t* tile_a = tiles_a + stage * kTileABytes;
      uint8_t* tile_b = tiles_b + stage * Gemm::kTileBBytes;
      if constexpr (Gemm::A::kGathered) fence_proxy_async_shared();  // cp.async rows -> wgmma reads
      if constexpr (Gemm::Scheduler::kReducesOverRows) {
        const int32_t valid_rows = tile.row_end - tile.row_begin - kb * kBlockK;
        if (valid_rows < kBlockK) {  // the expert's last, partial K-block: the same for both consumers
          zero_box_rows(tile_a + me.consumer * kMnBoxBytes, valid_rows, me.tid_in_wg);
          for (int j = me.consumer; j < Gemm::kBlockN / 64; j += kNumConsumers) {
            zero_box_rows(tile_b + j * kMnBoxBytes, valid_rows, me.tid_in_wg);
          }
          fence_proxy_async_shared();
          named_barrier_sync(kConsumersBarrierId, kNumConsumers * kThreadsPerWarpgroup);
        }
      }
      // Row block b's A rows start b (ping-pong) or `consumer` (cooperative) 64-row blocks into
      // the stage: 64 K-major rows or one MN box, the same 8 KB.
      uint64_t desc_a[kRowBlocks];
#pragma unroll
      for (int b = 0; b < kRowBlocks; ++b) {
        desc_a[b] = make_desc_sw128(tile_a + row_block_thread<Consumers>(me, b).consumer * kWgmmaM * kSwizzleRowBytes,
                                    Gemm::LayoutA::kLbo, Gemm::LayoutA::kSbo);
      }
      const uint64_t desc_b = make_desc_sw128(tile_b, Gemm::LayoutB::kLbo, Gemm::LayoutB::kSbo);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kBlockK / kWgmmaK; ++k) {
#pragma unroll
        for (int b = 0; b < kRowBlocks; ++b) {
          Gemm::Mma::mma(acc[b], desc_a[b] + k * Gemm::LayoutA::kDescStepK16,
                         desc_b + k * Gemm::LayoutB::kDescStepK16, (kb > 0 || k > 0) ? 1u : 0u);
        }
      }
      wgmma_commit_group();
      // The previous tile's held boxes go out one per K-block, under these MMAs.
      if constexpr (kHeldBoxes > 0) Epilogue::drain(p.epilogue, out_shape, staging, held, kb, me);
      // Keep this K-block's MMAs in flight; the previous block's have finished reading.
      wgmma_wait_group<1>();
      if (kb > 0 && me.lane == 0 && !releases_withheld(p.shape.wait)) mbarrier_arrive(&ring.empty[prev_stage]);
      prev_stage = stage;
      cursor.advance();
    }
    wgmma_wait_group<0>();
#pragma unroll
    for (int b = 0; b < kRowBlocks; ++b) fence_accumulators(acc[b]);
    if ((!Gemm::Scheduler::kReducesOverRows || tile.num_k_blocks > 0) && me.lane == 0 &&
        !releases_withheld(p.shape.wait)) {
      mbarrier_arrive(&ring.empty[prev_stage]);
    }

    // ---- epilogue, one row block at a time. Ping-pong: block 1's inputs load here, under block
    // 0's stores; loaded before the main loop they would spill (they would share the registers
    // with 128 accumulators throughout it).
    static_assert(kRowBlocks <= 2, "one or two row blocks per consumer");
    if constexpr (HeldBoxes<Epilogue>::kHolds) {
      // A tile with fewer K-blocks than held boxes: the rest of the previous tile's go out first.
      for (int i = tile.num_k_blocks; i < kHeldBoxes; ++i) Epilogue::drain(p.epilogue, out_shape, staging, held, i, me);
      Epilogue::store(p.epilogue, out_shape, tile, rows, inputs, acc[0], staging, held, me0);
    } else if constexpr (kRowBlocks == 1) {
      Epilogue::store(p.epilogue, out_shape, tile, rows, inputs, acc[0], staging, me0);
    } else {
      const ConsumerThread me_b = row_block_thread<Consumers>(me, 1);
      const AccRows rows_b(tile, me_b);
      typename Epilogue::Inputs inputs_b = Epilogue::prepare(p.epilogue, out_shape, tile, rows_b, me_b);
      Epilogue::store(p.epilogue, out_shape, tile, rows, inputs, acc[0], staging, me0);
      Epilogue::store(p.epilogue, out_shape, tile, rows_b, inputs_b, acc[1], staging, me_b);
    }
  }
  if constexpr (kHeldBoxes > 0) {
    for (int i = 0; i < kHeldBoxes; ++i) Epilogue::drain(p.epilogue, out_shape, staging, held, i, me);
  }
  Epilogue::finish(me);
}

// ----------------------------------------------------------------------------------- kernel

template <class Gemm>
__global__ void __launch_bounds__(kThreads, 1) sm90_grouped_gemm_kernel(const __grid_constant__ GemmParams<Gemm> p) {
  constexpr int kStages = Gemm::kStages;
  extern __shared__ uint8_t smem_raw[];
  // Aligned by an offset from smem_raw, not by casting through an integer, so the compiler still
  // knows these are shared-memory addresses: the epilogue staging writes become STS with 32-bit
  // addresses rather than generic 64-bit stores.
  uint8_t* smem = smem_raw + ((kSmemAlign - smem_addr(smem_raw) % kSmemAlign) % kSmemAlign);
  uint8_t* tiles_a = smem;                                          // [kStages][128 x 64] bf16
  uint8_t* tiles_b = tiles_a + kStages * kTileABytes;               // [kStages][kBlockN x 64] bf16
  uint8_t* staging = tiles_b + kStages * Gemm::kTileBBytes;         // epilogue staging, if any
  StageScales* stage_scales = reinterpret_cast<StageScales*>(staging + Gemm::Epilogue::kStagingBytes);  // FP8
  uint8_t* barriers = staging + Gemm::Epilogue::kStagingBytes + Gemm::kScaleRingBytes;
  const StageRing<kStages> ring{reinterpret_cast<uint64_t*>(barriers), reinterpret_cast<uint64_t*>(barriers) + kStages};
  TileFeed feed;
  feed.bars = ring.empty + kStages;
  feed.readers =
      kNumConsumers * kThreadsPerWarpgroup + (kAllProducerThreads<typename Gemm::A> ? kThreadsPerWarpgroup : 1);
  // [2][E + 1], row tiles only: the expert-output scheduler reserves no table memory.
  int32_t* table = !Gemm::Scheduler::kTableInSmem ? nullptr
                   : Gemm::kDynamicTiles          ? feed.index() + kTileSlots
                                                  : reinterpret_cast<int32_t*>(ring.empty + kStages);

  const int warpgroup = threadIdx.x / kThreadsPerWarpgroup;
  if (threadIdx.x == 0) {
    if constexpr (!Gemm::A::kGathered) prefetch_tensor_map(&p.a.map);
    prefetch_tensor_map(&p.map_b);
    if constexpr (TwoBMaps<typename Gemm::B>::value) prefetch_tensor_map(&p.map_b_up);
    Gemm::Epilogue::prefetch(p.epilogue);
    ring.init(kAllProducerThreads<typename Gemm::A>, Gemm::kStageReleases);
    if constexpr (Gemm::kDynamicTiles) {
      for (int i = 0; i < kTileSlots; ++i) {
        mbarrier_init(&feed.bars[i], 1);
        mbarrier_init(&feed.bars[kTileSlots + i], feed.readers);
      }
      fence_barrier_init();
    }
  }
  typename Gemm::Scheduler sched = make_scheduler<Gemm>(p.shape, table);
  if constexpr (Gemm::Scheduler::kTableInSmem) {
    build_expert_tile_table(p.shape.expert_offsets, sched.table);  // ends with __syncthreads()
  } else {
    __syncthreads();  // the ring's barriers are initialised
  }

  if (warpgroup == 0) {
    setmaxnreg_dec<kProducerRegs>();
    if (kAllProducerThreads<typename Gemm::A> || threadIdx.x == 0) {
      produce<Gemm>(p, sched, ring, tiles_a, tiles_b, stage_scales, feed, threadIdx.x);
    }
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    const int warp_in_wg = (threadIdx.x / 32) % kWarpsPerWarpgroup;
    const int lane = threadIdx.x % 32;
    const ConsumerThread me{warpgroup - 1, warp_in_wg, lane, static_cast<int>(threadIdx.x % kThreadsPerWarpgroup),
                            warp_in_wg * 16 + lane / 4};
    if constexpr (Gemm::kBlockScaled) {
      consume_block_scaled<Gemm>(p, sched, ring, tiles_a, tiles_b, stage_scales, staging, me);
    } else {
      consume<Gemm>(p, sched, ring, tiles_a, tiles_b, staging, feed, me);
    }
  }
}

}  // namespace fusemoe::sm90

// Epilogues of the sm90 grouped GEMM: what a consumer warpgroup does with its 64 x kBlockN fp32
// accumulators once a tile's main loop is done.
//
//   SwiGLUEpilogue<N, kClamp, kStoreZ>  h = silu(g) * u (g, u clamped when kClamp), bf16, into h
//                                       [R, I]; z = [g | u] (before the clamp) into z [R, 2I],
//                                       held and written under the next tile's main loop
//   RowStoreEpilogue<N, kWeighted, kDest>
//                                       bf16 rows (times the routing weight when kWeighted) to
//                                       row r of out (kSortedRow), to its slot row_slot[r]
//                                       (kSlotRow), or to that slot of another rank (kPeerSlot),
//                                       held in registers and written under the next tile's
//                                       main loop
//   DgradSwiGLUEpilogue<N, kClamp>      from a = dy W2: dz = [w a u silu'(g) | w a silu(g)]
//                                       (clamp masks), wh = w h, and the router-gradient
//                                       partial <h, a> of the tile's columns
//   WeightGradEpilogue<kFp32, kAccumulate>
//                                       an expert's gradient tile box by box through two
//                                       shared-memory staging boxes per consumer and TMA
//                                       stores, fp32 or bf16, overwritten or added to
//
// Each has Args (its kernel arguments), kStagingBytes (its share of shared memory), prefetch()
// (its tensor maps, once per CTA), prepare()
// (per-tile inputs loaded before the main loop so their latency hides under it), store(), and
// finish() (after the CTA's last tile), with one signature for all; an epilogue that holds a tile
// under the next main loop adds Held and drain() (HeldBoxes). Accumulator fragment layout:
// sm90_ptx.cuh, wgmma section.
// Row epilogues store only rows before the expert's end (AccRows::valid) and columns < N.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "device/sm90_fragment.cuh"
#include "device/sm90_layout.cuh"
#include "device/sm90_ptx.cuh"
#include "device/sm90_schedulers.cuh"

namespace fusemoe::sm90 {

// The calling consumer thread.
struct ConsumerThread {
  int consumer;    // 0 or 1: tile rows [64 consumer, 64 consumer + 64)
  int warp_in_wg;  // 0..3
  int lane;
  int tid_in_wg;   // 0..127
  int row_in_wg;   // accumulator rows row_in_wg and row_in_wg + 8 of the warpgroup's 64
};

// The pool rows of this thread's two accumulator rows (h = 0, 1) in a row tile.
struct AccRows {
  int32_t row[2];
  bool valid[2];  // before the expert's end
  __device__ AccRows(const Tile& tile, const ConsumerThread& me) {
    const int32_t r0 = tile.row_begin + me.consumer * kWgmmaM + me.row_in_wg;
    row[0] = r0;
    row[1] = r0 + 8;
    valid[0] = row[0] < tile.row_end;
    valid[1] = row[1] < tile.row_end;
  }
};

// Epilogues that hold a tile's output in registers and write it under the next tile's main
// loop declare Held, kHeldBoxes (the units drained, one per K-block) and drain(); the others
// store a tile whole after its main loop.
template <class Epilogue, class = void>
struct HeldBoxes {
  struct Held {};
  static constexpr bool kHolds = false;
  static constexpr int kBoxes = 0;
};
template <class Epilogue>
struct HeldBoxes<Epilogue, std::void_t<typename Epilogue::Held>> {
  using Held = typename Epilogue::Held;
  static constexpr bool kHolds = true;
  static constexpr int kBoxes = Epilogue::kHeldBoxes;  // may be 0 for some of its instances
};

// The output shape the epilogues read (the kernel's GemmShape).
struct EpilogueShape {
  int32_t n_valid;  // output columns N
  int32_t m_valid;  // weight gradients: rows M of one expert's output
};

// silu(g) = g * sigmoid(g) with the approximate reciprocal (MUFU.RCP): the result is rounded
// to bf16 (8 bits), far coarser than its ~2 ulp fp32 error. For g < -87 the denominator
// overflows and the result is -0, where the exact value is below 1e-36 in magnitude anyway.
__device__ __forceinline__ float silu(float g) { return __fdividef(g, 1.0f + __expf(-g)); }

// sigmoid(g) for the dgrad epilogues: ex2 and rcp in their flush-to-zero forms, without the
// denormal fix-ups of __expf / __fdividef (docs/experiments.md#fp8-dgrad-epilogue-parts). Only
// results below 1e-38 change (g < -87); g * sigmoid_ftz(g) is silu(g)'s bits elsewhere.
__device__ __forceinline__ float sigmoid_ftz(float g) {
  float e, s;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.44269504f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(s) : "f"(1.0f + e));
  return s;
}

// Stores group a of one accumulator row fragment: words[p] = bf16 pairs of output columns
// col0 + 8(4a + p) + 2q, +1 (q = lane % 4). A 4x4 transpose inside the quad turns the 4 chunks
// into one 16-byte store per lane (lane q writes chunk 4a+q whole:
// docs/experiments.md#quad-transposed-stores). Columns at or past n_valid are not stored (n_valid
// is a multiple of 8).
__device__ __forceinline__ void store_quad_group(const uint32_t (&words)[4], __nv_bfloat16* row_ptr, bool row_valid,
                                                 int col0, int a, int n_valid, int lane) {
  const int q = lane % 4;
  uint32_t w[4] = {words[0], words[1], words[2], words[3]};
  quad_transpose(w, q);
  const int col = col0 - 2 * q + 8 * (4 * a + q);  // lane q now holds chunk 4a+q
  if (row_valid && col < n_valid) *reinterpret_cast<uint4*>(row_ptr + col) = make_uint4(w[0], w[1], w[2], w[3]);
}

// Stores one accumulator row fragment: words[j] = bf16 pairs of output columns col0 + 8j + 2q, +1.
template <int kChunks>
__device__ __forceinline__ void store_row_fragment(uint32_t (&words)[kChunks], __nv_bfloat16* row_ptr,
                                                   bool row_valid, int col0, int n_valid, int lane) {
  static_assert(kChunks % 4 == 0, "the quad transpose works on groups of 4 chunks");
#pragma unroll
  for (int a = 0; a < kChunks / 4; ++a) {
    const uint32_t w[4] = {words[4 * a], words[4 * a + 1], words[4 * a + 2], words[4 * a + 3]};
    store_quad_group(w, row_ptr, row_valid, col0, a, n_valid, lane);
  }
}

// Held of an instance that holds nothing (kHeldBoxes == 0: gate/up without z).
struct NothingHeld {};

// A tile's rows held as bf16 pairs in registers and stored 16-byte column group by group under the
// next tile's main loop (the row stores' tiles, gate/up's z: docs/experiments.md#held-row-tiles).
template <int kWords>
struct HeldRows {
  uint32_t words[2][kWords];  // row half h
  __nv_bfloat16* row_ptr[2];
  bool valid[2];
  int32_t col0;  // the thread's first column, as store_quad_group takes it
  bool pending;  // a tile waits to go out
  // Words [kFirst, kFirst + 4) of both row halves as column group a of the rows at row_ptr + offset.
  template <int kFirst>
  __device__ __forceinline__ void store_group(int a, int offset, int n_valid, int lane) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t w[4] = {words[h][kFirst], words[h][kFirst + 1], words[h][kFirst + 2], words[h][kFirst + 3]};
      store_quad_group(w, row_ptr[h] + offset, valid[h], col0, a, n_valid, lane);
    }
  }
};

// ------------------------------------------------------------------------------------ SwiGLU

// The gate/up accumulators of an output chunk: chunk j of h pairs gate registers acc[4j + 2h + b]
// with up registers acc[4(j + kChunks) + 2h + b] (b = 0, 1; h the row half). The helpers below
// are shared with SwiGLUFp8Epilogue, whose tile has the same layout.
// h = silu(g) * u of chunk j, row half h, as a bf16 pair; g, u clamped first when kClamp.
template <bool kClamp, int kChunks, int kRegs>
__device__ __forceinline__ uint32_t swiglu_bf16x2(const float (&acc)[kRegs], int j, int h, float clamp) {
  const int gate = 4 * j + 2 * h, up = gate + 4 * kChunks;
  float g0 = acc[gate], g1 = acc[gate + 1], u0 = acc[up], u1 = acc[up + 1];
  if constexpr (kClamp) {
    g0 = fminf(g0, clamp);
    g1 = fminf(g1, clamp);
    u0 = fminf(fmaxf(u0, -clamp), clamp);
    u1 = fminf(fmaxf(u1, -clamp), clamp);
  }
  return pack_bf16x2(silu(g0) * u0, silu(g1) * u1);
}

// z = [g | u] of a SwiGLU tile held as bf16 pairs (64 words a thread at kOutChunks = 16) and
// drained under the next tile's main loop: unit i is g's 16-byte column group i (i < kZGroups) or
// u's group i - kZGroups, both row halves. Shared by SwiGLUEpilogue and SwiGLUFp8Epilogue, whose
// tiles have the same layout.
template <int kOutChunks>
struct HeldZ {
  static constexpr int kZGroups = kOutChunks / 4;
  static constexpr int kUnits = 2 * kZGroups;
  using Held = HeldRows<2 * kOutChunks>;  // row half h: g chunk j at [j], u at [kOutChunks + j]
  // Packs row half h (pool row `row`) and records where it goes; col0 as store_quad_group takes it.
  template <int kRegs>
  __device__ static void hold(const float (&acc)[kRegs], int h, __nv_bfloat16* z, int64_t row, bool valid, int I,
                              int col0, Held& held) {
#pragma unroll
    for (int j = 0; j < 2 * kOutChunks; ++j) held.words[h][j] = pack_bf16x2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    held.row_ptr[h] = z + row * 2 * I;
    held.valid[h] = valid;
    held.col0 = col0;
    held.pending = true;
  }
  template <int kUnit>
  __device__ static void store_unit(const Held& held, int I, int lane) {
    constexpr int a = kUnit % kZGroups;
    constexpr bool up = kUnit >= kZGroups;
    held.template store_group<(up ? kOutChunks : 0) + 4 * a>(a, up ? I : 0, I, lane);
  }
  template <int... kUnit>
  __device__ static void drain_units(const Held& held, int i, int I, int lane, std::integer_sequence<int, kUnit...>) {
    ((i == kUnit ? store_unit<kUnit>(held, I, lane) : void()), ...);
  }
  // Unit i (a runtime index, uniform over the warpgroup), if a tile is held.
  __device__ static void drain(const Held& held, int i, int I, int lane) {
    if (held.pending && i < kUnits) drain_units(held, i, I, lane, std::make_integer_sequence<int, kUnits>{});
  }
};

template <int kBlockN, bool kClamp, bool kStoreZ>
struct SwiGLUEpilogue {
  static constexpr int kStagingBytes = 0;
  static constexpr int kOutChunks = kBlockN / 16;  // n8 chunks of h per row: half the accumulators
  struct Args {
    __nv_bfloat16* h;  // [R_max, I]
    __nv_bfloat16* z;  // [R_max, 2I] pre-activations [g | u] for the backward (kStoreZ)
    float clamp;       // c > 0 (kClamp): g <- min(g, c), u <- clamp(u, -c, c)
  };
  struct Inputs {};
  // h is computed and stored after the main loop; z (kStoreZ) is held (HeldZ) and drained one
  // unit per K-block of the next tile. Computing h there too, from the bf16 z, measured 1-5%
  // slower (docs/experiments.md#held-row-tiles).
  using Z = HeldZ<kOutChunks>;
  static constexpr int kHeldBoxes = kStoreZ ? Z::kUnits : 0;
  using Held = std::conditional_t<kStoreZ, typename Z::Held, NothingHeld>;
  __device__ static void prefetch(const Args&) {}
  __device__ static Inputs prepare(const Args&, const EpilogueShape&, const Tile&, const AccRows&,
                                   const ConsumerThread&) {
    return {};
  }

  template <int kRegs>
  __device__ static void store(const Args& args, const EpilogueShape& s, const Tile& tile, const AccRows& rows,
                               Inputs&, const float (&acc)[kRegs], uint8_t*, Held& held, const ConsumerThread& me) {
    static_assert(8 * kOutChunks == kRegs, "gate and up halves fill the accumulators");
    const int I = s.n_valid;
    const int col0 = tile.n_tile * (kBlockN / 2) + 2 * (me.lane % 4);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t words[kOutChunks];
#pragma unroll
      for (int j = 0; j < kOutChunks; ++j) words[j] = swiglu_bf16x2<kClamp, kOutChunks>(acc, j, h, args.clamp);
      store_row_fragment<kOutChunks>(words, args.h + static_cast<int64_t>(rows.row[h]) * I, rows.valid[h], col0, I,
                                     me.lane);
      if constexpr (kStoreZ) Z::hold(acc, h, args.z, rows.row[h], rows.valid[h], I, col0, held);
    }
  }
  __device__ static void drain(const Args&, const EpilogueShape& s, uint8_t*, const Held& held, int i,
                               const ConsumerThread& me) {
    if constexpr (kStoreZ) Z::drain(held, i, s.n_valid, me.lane);
  }
  __device__ static void finish(const ConsumerThread&) {}
};

// ---------------------------------------------------------------------------------- row store

enum class RowDestination {
  kSortedRow,  // out row r: the pool's own order (z recompute)
  kSlotRow,    // out row row_slot[r]: the token's slot t*K + j (down, dgrad of x)
  kPeerSlot,   // row row_slot[r] of rank row_src[r]'s slot buffer (expert parallelism: the source
               // rank's memory, written over NVLink); weighted by row_weight[r]
};

constexpr int kMaxPeers = 8;  // ranks of an expert-parallel group (fusemoe::kMaxRanks)

template <int kBlockN, bool kWeighted, RowDestination kDest>
struct RowStoreEpilogue {
  static_assert(!kWeighted || kDest != RowDestination::kSortedRow, "routing weights belong to slots");
  static constexpr bool kToPeers = kDest == RowDestination::kPeerSlot;
  static constexpr int kStagingBytes = 0;
  static constexpr int kChunks = kBlockN / 8;
  struct Args {
    __nv_bfloat16* out;         // [rows, N] bf16 (kSortedRow, kSlotRow)
    const int32_t* row_slot;    // [R_max] (kSlotRow, kPeerSlot)
    const float* topk_weights;  // kWeighted: [T*K] by slot, or [R_max] by row for kPeerSlot
    const int32_t* row_src;     // [R_max] (kPeerSlot): the rank each row goes to
    __nv_bfloat16* peer_out[kMaxPeers];  // (kPeerSlot) each rank's slot buffer [S, N] as mapped here
  };
  struct Inputs {
    int32_t dest[2];
    float weight[2];
    __nv_bfloat16* peer_row[kToPeers ? 2 : 1];
  };
  __device__ static void prefetch(const Args&) {}
  __device__ static Inputs prepare(const Args& args, const EpilogueShape& s, const Tile&, const AccRows& rows,
                                   const ConsumerThread&) {
    Inputs in{{rows.row[0], rows.row[1]}, {1.0f, 1.0f}, {}};
    if constexpr (kDest != RowDestination::kSortedRow) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        in.dest[h] = 0;
        if constexpr (kToPeers) in.peer_row[h] = nullptr;
        if (rows.valid[h]) {
          in.dest[h] = __ldg(args.row_slot + rows.row[h]);
          if constexpr (kToPeers) {
            in.peer_row[h] = args.peer_out[__ldg(args.row_src + rows.row[h])] + static_cast<int64_t>(in.dest[h]) * s.n_valid;
            if constexpr (kWeighted) in.weight[h] = __ldg(args.topk_weights + rows.row[h]);
          } else if constexpr (kWeighted) {
            in.weight[h] = __ldg(args.topk_weights + in.dest[h]);
          }
        }
      }
    }
    return in;
  }
  // Held (HeldBoxes above; drained by consume() in sm90_grouped_gemm.cuh): store() packs the
  // tile's rows into bf16 pairs (weighted), 64 words a thread, freeing the accumulators; drain(i)
  // writes unit i, the 16-byte column group i of both row halves, during the next tile's main
  // loop, one unit per K-block, so the tensor cores do not wait for the tile's stores
  // (docs/experiments.md#held-row-tiles).
  static constexpr int kGroups = kChunks / 4;
  static constexpr int kHeldBoxes = kGroups;
  using Held = HeldRows<kChunks>;
  template <int kRegs>
  __device__ static void store(const Args& args, const EpilogueShape& s, const Tile& tile, const AccRows& rows,
                               Inputs& in, const float (&acc)[kRegs], uint8_t*, Held& held, const ConsumerThread& me) {
    static_assert(4 * kChunks == kRegs, "the chunks fill the accumulators");
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
        if constexpr (kWeighted) {
          v0 *= in.weight[h];
          v1 *= in.weight[h];
        }
        held.words[h][j] = pack_bf16x2(v0, v1);
      }
      if constexpr (kToPeers) {
        held.row_ptr[h] = in.peer_row[h];
      } else {
        held.row_ptr[h] = args.out + static_cast<int64_t>(in.dest[h]) * s.n_valid;
      }
      held.valid[h] = rows.valid[h];
    }
    held.col0 = tile.n_tile * kBlockN + 2 * (me.lane % 4);
    held.pending = true;
  }
  template <int... kUnit>
  __device__ static void drain_units(const EpilogueShape& s, const Held& held, int i, int lane,
                                     std::integer_sequence<int, kUnit...>) {
    ((i == kUnit ? held.template store_group<4 * kUnit>(kUnit, 0, s.n_valid, lane) : void()), ...);
  }
  // Unit i (a runtime index, uniform over the warpgroup) of the held tile out, if one is held.
  __device__ static void drain(const Args&, const EpilogueShape& s, uint8_t*, const Held& held, int i,
                               const ConsumerThread& me) {
    if (held.pending && i < kHeldBoxes) drain_units(s, held, i, me.lane, std::make_integer_sequence<int, kHeldBoxes>{});
  }
  __device__ static void finish(const ConsumerThread&) {}
};

// ------------------------------------------------------------------------------- dgrad SwiGLU

// The 8 fp32 accumulator values of row half h in chunk 4a + q, in column order:
// out[2p + b] = column 8(4a + q) + 2p + b.
template <int kAccRegs>
__device__ __forceinline__ void gather_chunk_fp32(const float (&acc)[kAccRegs], int a, int h, int q, float (&out)[8]) {
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

// What the dgrad SwiGLU epilogues (this file's and DgradSwiGLUFp8Epilogue) share: the routing
// weights of the thread's two rows and the z chunks loaded ahead of their use (Inputs, prepare),
// and the SwiGLU backward of one element. kColsMayEnd: I need not be a multiple of kBlockN, so z
// loads check the column.
template <int kBlockN, bool kClamp, int kZAhead, bool kColsMayEnd>
struct DgradSwiGLUParts {
  static constexpr int kGroups = kBlockN / 32;  // groups of 4 n8 chunks (one quad transpose)
  static constexpr int kZChunks = 2 * kGroups;  // chunk c: row half c / kGroups, group c % kGroups
  static_assert(kZAhead >= 1 && kZAhead <= kZChunks, "z chunks in flight");
  struct Inputs {
    float weight[2];
    uint4 z_gate[kZAhead], z_up[kZAhead];  // [g | u] of chunk c in slot c % kZAhead
  };

  // Chunk c (16 B of gate and 16 B of up) of z [R_max, 2I]. The loads are unconditional (an invalid
  // row or column reads z's first chunk, never used) so they can be issued ahead of their use.
  template <class Args>
  __device__ static void load_z_chunk(const Args& args, int32_t I, const AccRows& rows, int32_t n0, int q, int c,
                                      uint4& gate, uint4& up) {
    const int h = c / kGroups, a = c % kGroups;
    const int64_t col = n0 + 8 * (4 * a + q);
    const bool ok = kColsMayEnd ? rows.valid[h] && col < I : rows.valid[h];
    const __nv_bfloat16* g = ok ? args.z + static_cast<int64_t>(rows.row[h]) * 2 * I + col : args.z;
    gate = __ldg(reinterpret_cast<const uint4*>(g));
    up = __ldg(reinterpret_cast<const uint4*>(ok ? g + I : args.z));
  }

  template <class Args>
  __device__ static Inputs prepare(const Args& args, const EpilogueShape& s, const Tile& tile, const AccRows& rows,
                                   const ConsumerThread& me) {
    Inputs in;
    load_weights(args, rows, in);
    load_z_ahead(args, s.n_valid, rows, tile.n_tile * kBlockN, me.lane % 4, in);
    return in;
  }
  template <class Args>
  __device__ static void load_weights(const Args& args, const AccRows& rows, Inputs& in) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      in.weight[h] = rows.valid[h] ? __ldg(args.topk_weights + __ldg(args.row_slot + rows.row[h])) : 0.0f;
    }
  }
  // The tile's z rows into L2 (no registers held): lane q takes the 128-byte line q of its rows'
  // gate and up segments (kBlockN 2-byte columns each: 4 lines at 256, 2 at 128).
  static constexpr int kLinesPerSegment = kBlockN * 2 / 128;
  template <class Args>
  __device__ static void prefetch_z(const Args& args, int32_t I, const AccRows& rows, int32_t n0, int q) {
    const int32_t col = n0 + 64 * q;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (q < kLinesPerSegment && rows.valid[h] && col < I) {
        const __nv_bfloat16* g = args.z + static_cast<int64_t>(rows.row[h]) * 2 * I + col;
        prefetch_l2(g);
        prefetch_l2(g + I);
      }
    }
  }
  // The first kZAhead chunks (prepare's loads, or the epilogue's own where registers are short in
  // the main loop).
  template <class Args>
  __device__ static void load_z_ahead(const Args& args, int32_t I, const AccRows& rows, int32_t n0, int q, Inputs& in) {
#pragma unroll
    for (int c = 0; c < kZAhead; ++c) load_z_chunk(args, I, rows, n0, q, c, in.z_gate[c], in.z_up[c]);
  }

  // g, u of chunk c; chunk c + kZAhead takes the registers chunk c leaves.
  template <class Args>
  __device__ static void take_z_chunk(const Args& args, int32_t I, const AccRows& rows, int32_t n0, int q, int c,
                                      Inputs& in, float (&g)[8], float (&u)[8]) {
    unpack_bf16x8(in.z_gate[c % kZAhead], g);
    unpack_bf16x8(in.z_up[c % kZAhead], u);
    if (c + kZAhead < kZChunks) {
      load_z_chunk(args, I, rows, n0, q, c + kZAhead, in.z_gate[c % kZAhead], in.z_up[c % kZAhead]);
    }
  }

  // The SwiGLU backward of elements i, i + 1 of a chunk from their bf16 z (g, u), a = (dy W2) and
  // the row's weight w: dg = w a u silu'(g), du = w a silu(g) (clamp masks: gradient only where
  // unclamped) and w h; dot accumulates h a, element i first. h is recomputed as the forward
  // stored it, rounded to bf16: the pair in one cvt.
  struct GradPair {
    float dg[2], du[2], wh[2];
  };
  template <class Args>
  __device__ __forceinline__ static GradPair backward_pair(const Args& args, const float (&g_in)[8],
                                                          const float (&u_in)[8], const float (&a)[8], int i, float w,
                                                          float& dot) {
    float g[2], u[2], g_pass[2], u_pass[2], sg[2], si[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      g[e] = g_in[i + e];
      u[e] = u_in[i + e];
      g_pass[e] = u_pass[e] = 1.0f;
      if constexpr (kClamp) {
        g_pass[e] = g[e] <= args.clamp ? 1.0f : 0.0f;
        u_pass[e] = (u[e] >= -args.clamp && u[e] <= args.clamp) ? 1.0f : 0.0f;
        g[e] = fminf(g[e], args.clamp);
        u[e] = fminf(fmaxf(u[e], -args.clamp), args.clamp);
      }
      // The approximate reciprocal, so that si below is the forward's silu(g).
      sg[e] = sigmoid_ftz(g[e]);
      si[e] = g[e] * sg[e];
    }
    const uint32_t h_bits = pack_bf16x2(si[0] * u[0], si[1] * u[1]);
    const float hv[2] = {__uint_as_float(h_bits << 16), __uint_as_float(h_bits & 0xFFFF0000u)};
    GradPair d;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      dot = fmaf(hv[e], a[i + e], dot);
      const float dh = w * a[i + e];
      // silu'(g) = sg (1 + g (1 - sg)) = sg + si (1 - sg): the same FMA, one multiply less.
      const float dsilu = fmaf(si[e], 1.0f - sg[e], sg[e]);
      d.dg[e] = dh * u[e] * dsilu * g_pass[e];
      d.du[e] = dh * si[e] * u_pass[e];
      d.wh[e] = w * hv[e];
    }
    return d;
  }
};

// Quad sum of the lanes' <h, a> in a fixed butterfly order (every lane ends with the same bits);
// lane q = 0 of a valid row stores it as the row's partial of tile n_tile.
template <class Args>
__device__ __forceinline__ void store_router_partial(const Args& args, float dot, bool row_valid, int q, int64_t row,
                                                     int32_t n_tile) {
  dot += __shfl_xor_sync(0xFFFFFFFFu, dot, 1);
  dot += __shfl_xor_sync(0xFFFFFFFFu, dot, 2);
  if (row_valid && q == 0) args.router_partials[row * args.num_n_tiles + n_tile] = dot;
}

// kHeldAccRegs: the accumulators a consumer thread holds through the epilogue (kBlockN / 2 for
// its 64 rows; kBlockN for the two row blocks of a ping-pong tile).
template <int kBlockN, bool kClamp, int kHeldAccRegs = kBlockN / 2>
struct DgradSwiGLUEpilogue {
  static constexpr int kStagingBytes = 0;
  // z chunks (16 B of gate + 16 B of up each) in flight ahead of their use: all 8 (2 rows x 4
  // groups) next to 64 accumulators; next to 128, what the consumers' 232 registers (setmaxnreg)
  // hold without spilling in the unclamped instance (the clamp ones spill 12-32 bytes): 1 at width
  // 256, 2 at width 128 in the ping-pong schedule (docs/experiments.md#z-ahead).
  static constexpr int kZAhead = kHeldAccRegs == 64 ? 2 * (kBlockN / 32) : (kBlockN == 128 ? 2 : 1);
  using Parts = DgradSwiGLUParts<kBlockN, kClamp, kZAhead, true>;
  static constexpr int kGroups = Parts::kGroups;
  struct Args {
    const int32_t* row_slot;      // [R_max]
    const float* topk_weights;    // [T*K]
    const __nv_bfloat16* z;       // [R_max, 2I]
    __nv_bfloat16* dz;            // [R_max, 2I]
    __nv_bfloat16* wh;            // [R_max, I]
    float* router_partials;       // [R_max, num_n_tiles]
    int32_t num_n_tiles;          // ceil(I / kBlockN)
    float clamp;                  // kClamp
  };
  using Inputs = typename Parts::Inputs;
  __device__ static void prefetch(const Args&) {}
  __device__ static Inputs prepare(const Args& args, const EpilogueShape& s, const Tile& tile, const AccRows& rows,
                                   const ConsumerThread& me) {
    return Parts::prepare(args, s, tile, rows, me);
  }

  template <int kRegs>
  __device__ static void store(const Args& args, const EpilogueShape& s, const Tile& tile, const AccRows& rows,
                               Inputs& in, const float (&acc)[kRegs], uint8_t*, const ConsumerThread& me) {
    const int32_t I = s.n_valid;
    const int32_t n0 = tile.n_tile * kBlockN;
    const int q = me.lane % 4;
    // At width 256 (one chunk ahead) the tile's z rows go to L2 now, so the chunks the loop loads
    // one ahead come from L2, not DRAM; at the tile's start they were evicted by the main loop's
    // operands before use (docs/experiments.md#z-into-l2-at-the-epilogue).
    if constexpr (kBlockN == 256) Parts::prefetch_z(args, I, rows, n0, q);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t r = rows.row[h];
      const float w = in.weight[h];
      // The row's outputs at this lane's first column: each chunk's stores at a constant offset.
      const int32_t lane_col = n0 + 8 * q;
      __nv_bfloat16* const dz_row = args.dz + r * 2 * I + lane_col;
      __nv_bfloat16* const wh_row = args.wh + r * I + lane_col;
      float dot = 0.0f;  // <h, a> over this lane's columns of the tile, fixed order
#pragma unroll
      for (int a = 0; a < kGroups; ++a) {
        float av[8];
        gather_chunk_fp32(acc, a, h, q, av);
        const int col = lane_col + 32 * a;
        float g[8], u[8];
        Parts::take_z_chunk(args, I, rows, n0, q, h * kGroups + a, in, g, u);
        if (rows.valid[h] && col < I) {
          uint32_t dg_bits[4], du_bits[4], wh_bits[4];
#pragma unroll
          for (int i = 0; i < 8; i += 2) {
            const auto d = Parts::backward_pair(args, g, u, av, i, w, dot);
            dg_bits[i / 2] = pack_bf16x2(d.dg[0], d.dg[1]);
            du_bits[i / 2] = pack_bf16x2(d.du[0], d.du[1]);
            wh_bits[i / 2] = pack_bf16x2(d.wh[0], d.wh[1]);
          }
          *reinterpret_cast<uint4*>(dz_row + 32 * a) = make_uint4(dg_bits[0], dg_bits[1], dg_bits[2], dg_bits[3]);
          *reinterpret_cast<uint4*>(dz_row + I + 32 * a) = make_uint4(du_bits[0], du_bits[1], du_bits[2], du_bits[3]);
          *reinterpret_cast<uint4*>(wh_row + 32 * a) = make_uint4(wh_bits[0], wh_bits[1], wh_bits[2], wh_bits[3]);
        }
      }
      store_router_partial(args, dot, rows.valid[h], q, r, tile.n_tile);
    }
  }
  __device__ static void finish(const ConsumerThread&) {}
};

// ---------------------------------------------------------------------------- weight gradient

// Each consumer warpgroup's 64 rows x 256 columns of the output tile go out box by box through
// its two 8 KB staging boxes ([64 rows][128 B], the 128-byte swizzle: chunk c of row r at
// c ^ (r % 8), so the fragment writes are bank-conflict free), alternating, by TMA stores that
// drain while the warpgroup writes the next box and runs the next tile's main loop: fp32 is 8
// boxes of 32 columns, bf16 4 of 64. Two boxes (not a whole 32 KB block) leave room for a fourth
// stage in the ring. Accumulate: the boxes go out as TMA reduce-adds, old + new added per
// element in the memory system with no load in the SM (the loads stalled the epilogue: 4.5x the
// overwrite's time, docs/experiments.md#tma-reduce-add). bf16 adds the rounded new value, as
// autograd adds a bf16 gradient into a bf16 .grad. kAccumulate is a template parameter so the
// overwrite pass has no branch per element whatever the compiler's unswitching decides
// (docs/experiments.md#kernelargs-size). The instances are the named structs below it.
template <bool kFp32, bool kAccumulate, int kStagingBoxes_>
struct WeightGradStores {
  static constexpr int kBlockN = 256;
  static constexpr int kStagingBoxBytes = kWgmmaM * 128;  // one TMA store box: 64 rows x 128 B
  static constexpr int kStagingBoxes = kStagingBoxes_;    // per consumer warpgroup, used in turn
  static constexpr int kStagingBytesPerConsumer = kStagingBoxes * kStagingBoxBytes;
  static constexpr int kStagingBytes = kNumConsumers * kStagingBytesPerConsumer;
  static constexpr int kChunksPerBox = kFp32 ? 4 : 8;  // 8-column accumulator chunks in 128 B
  static constexpr int kBoxCols = 8 * kChunksPerBox;
  static constexpr int kBoxes = kBlockN / kBoxCols;
  struct Args {
    CUtensorMap map;  // grad [E, M, N] fp32 or bf16 as [E*M rows, N], boxes of [64 rows][128 B]
  };
  struct Inputs {};
  __device__ static void prefetch(const Args& args) { prefetch_tensor_map(&args.map); }
  __device__ static Inputs prepare(const Args&, const EpilogueShape&, const Tile&, const AccRows&,
                                   const ConsumerThread&) {
    return {};
  }

  // The last kHeldBoxes boxes of a tile wait in registers (16 words a box: 64 registers) and go
  // out during the next tile's main loop, one per K-block, so the tensor cores are not idle
  // while they are written (docs/experiments.md#held-weight-gradient-boxes). bf16: the whole
  // tile; fp32: its second half (its 128 values a thread do not fit beside the next
  // accumulators); none for fp32 reduce-adds, which measured slower held.
  static constexpr int kWordsPerBox = 16;
  static constexpr int kHeldBoxes = kFp32 && kAccumulate ? 0 : 4;
  static_assert(kBoxes % kStagingBoxes == 0 && kHeldBoxes <= kBoxes, "boxes alternate buffers across tiles");
  struct Held {
    uint32_t words[kHeldBoxes > 0 ? kHeldBoxes : 1][kWordsPerBox];
    int32_t row0, n0;
    bool pending;  // boxes waiting to go out
  };

  // Whether the accumulators hold the tile: yes, no (a tile without rows: zeros are stored), or
  // known at run time (a select per value).
  enum class Acc { kValid, kZero, kRuntime };

  // Box kBox's words from this thread's accumulators: chunks [kBox * kChunksPerBox,
  // +kChunksPerBox), each chunk's two row halves, as two fp32 words or one bf16 pair.
  template <int kBox, Acc kAcc, int kRegs>
  __device__ static void pack_box(const float (&acc)[kRegs], bool acc_valid, uint32_t (&w)[kWordsPerBox]) {
#pragma unroll
    for (int c = 0; c < kChunksPerBox; ++c) {
      const int j = kBox * kChunksPerBox + c;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const bool valid = kAcc == Acc::kValid || (kAcc == Acc::kRuntime && acc_valid);
        const float v0 = valid ? acc[4 * j + 2 * h] : 0.0f;
        const float v1 = valid ? acc[4 * j + 2 * h + 1] : 0.0f;
        if constexpr (kFp32) {
          w[4 * c + 2 * h] = __float_as_uint(v0);
          w[4 * c + 2 * h + 1] = __float_as_uint(v1);
        } else {
          w[2 * c + h] = pack_bf16x2(v0, v1);
        }
      }
    }
  }

  // Writes box kBox (the tile's box index: it picks the staging buffer and the columns) into
  // staging and issues its TMA store.
  template <int kBox>
  __device__ static void write_box(const Args& args, const EpilogueShape& s, uint8_t* staging, int32_t row0,
                                   int32_t n0, const uint32_t (&w)[kWordsPerBox], const ConsumerThread& me) {
    const int q = me.lane % 4;
    const uint32_t barrier_id = kStagingBarrierId0 + me.consumer;
    uint8_t* buffer = staging + (kBox % kStagingBoxes) * kStagingBoxBytes;
    // The buffer is free once the store issued two boxes ago (its last use) has read it.
    if (me.tid_in_wg == 0) bulk_wait_group_read<kStagingBoxes - 1>();
    named_barrier_sync(barrier_id, kThreadsPerWarpgroup);
#pragma unroll
    for (int c = 0; c < kChunksPerBox; ++c) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = me.row_in_wg + 8 * h;
        uint8_t* line = buffer + r * 128;
        if constexpr (kFp32) {
          const int chunk = 2 * c + q / 2;  // byte 32 c + 8q of the line
          *reinterpret_cast<uint2*>(line + ((chunk ^ (r % 8)) * 16) + (q % 2) * 8) =
              make_uint2(w[4 * c + 2 * h], w[4 * c + 2 * h + 1]);
        } else {
          const int chunk = c;  // byte 16 c + 4q of the line
          *reinterpret_cast<uint32_t*>(line + ((chunk ^ (r % 8)) * 16) + q * 4) = w[2 * c + h];
        }
      }
    }
    fence_proxy_async_shared();
    named_barrier_sync(barrier_id, kThreadsPerWarpgroup);
    if (me.tid_in_wg == 0) {
      const int32_t col = n0 + kBox * kBoxCols;
      if (col < s.n_valid) {
        if constexpr (kAccumulate) tma_reduce_add_2d(&args.map, buffer, col, row0);
        else tma_store_2d(&args.map, buffer, col, row0);
      }
      bulk_commit_group();  // a group per box, empty or not, so the wait above counts boxes
    }
  }

  template <Acc kAcc, int kRegs, int... kBox>
  __device__ static void write_now(const Args& args, const EpilogueShape& s, uint8_t* staging, int32_t row0,
                                   int32_t n0, const float (&acc)[kRegs], bool acc_valid, const ConsumerThread& me,
                                   std::integer_sequence<int, kBox...>) {
    ([&] {
      uint32_t w[kWordsPerBox];
      pack_box<kBox, kAcc>(acc, acc_valid, w);
      write_box<kBox>(args, s, staging, row0, n0, w, me);
    }(), ...);
  }

  template <Acc kAcc, int kRegs, int... kHeld>
  __device__ static void pack_held(const float (&acc)[kRegs], bool acc_valid, Held& held,
                                   std::integer_sequence<int, kHeld...>) {
    (pack_box<kBoxes - kHeldBoxes + kHeld, kAcc>(acc, acc_valid, held.words[kHeld]), ...);
  }

  // The tile's first kBoxes - kHeldBoxes boxes go out now; the rest wait in `held` for drain().
  template <int kRegs>
  __device__ static void store(const Args& args, const EpilogueShape& s, const Tile& tile, const AccRows&, Inputs&,
                               const float (&acc)[kRegs], uint8_t* staging, Held& held, const ConsumerThread& me) {
    // An expert without rows issued no MMA: its acc holds stale values, so zeros are stored
    // instead (zeroing acc in a branch would make ptxas serialise the wgmma pipeline, C7518),
    // and an accumulated gradient is left untouched.
    const bool acc_valid = tile.num_k_blocks > 0;
    held.pending = false;
    if (kAccumulate && !acc_valid) {
      // The held words are written on every path, so the previous tile's are dead once drained
      // (else they stay live through the next main loop: the FP8 loop spilled them).
      if constexpr (kHeldBoxes == kBoxes) {
        pack_held<Acc::kZero>(acc, false, held, std::make_integer_sequence<int, kHeldBoxes>{});
      }
      return;
    }
    uint8_t* mine = staging + me.consumer * kStagingBytesPerConsumer;
    const int32_t row0 = tile.expert * s.m_valid + tile.m_tile * kBlockM + me.consumer * kWgmmaM;
    const int32_t n0 = tile.n_tile * kBlockN;
    constexpr auto kNow = std::make_integer_sequence<int, kBoxes - kHeldBoxes>{};
    constexpr auto kHeld = std::make_integer_sequence<int, kHeldBoxes>{};
    if constexpr (kHeldBoxes == kBoxes) {
      // Only packing between this tile's MMAs and the next's: one branch per tile instead of a
      // select per value (128 FSEL a thread; 3-4% of the bf16 kernels at 30B T=4096).
      if (acc_valid) {
        pack_held<Acc::kValid>(acc, true, held, kHeld);
      } else {
        pack_held<Acc::kZero>(acc, false, held, kHeld);
      }
    } else {
      // Boxes stored now as well: the select per value measured faster than the branch, whose
      // two copies of the stores made fp32 3-7% slower.
      write_now<Acc::kRuntime>(args, s, mine, row0, n0, acc, acc_valid, me, kNow);
      pack_held<Acc::kRuntime>(acc, acc_valid, held, kHeld);
    }
    held.row0 = row0;
    held.n0 = n0;
    held.pending = true;
  }

  // Held box i (a runtime index, uniform over the warpgroup) out, if any is pending.
  template <int... kHeld>
  __device__ static void drain_one(const Args& args, const EpilogueShape& s, uint8_t* staging, const Held& held,
                                   int i, const ConsumerThread& me, std::integer_sequence<int, kHeld...>) {
    uint8_t* mine = staging + me.consumer * kStagingBytesPerConsumer;
    ((i == kHeld ? write_box<kBoxes - kHeldBoxes + kHeld>(args, s, mine, held.row0, held.n0, held.words[kHeld], me)
                 : void()),
     ...);
  }
  __device__ static void drain(const Args& args, const EpilogueShape& s, uint8_t* staging, const Held& held, int i,
                               const ConsumerThread& me) {
    if (held.pending && i < kHeldBoxes) {
      drain_one(args, s, staging, held, i, me, std::make_integer_sequence<int, kHeldBoxes>{});
    }
  }

  // The CTA's shared memory must outlive the stores still reading it.
  __device__ static void finish(const ConsumerThread& me) {
    if (me.tid_in_wg == 0) bulk_wait_group_all();
  }
};

// Named structs, not aliases, so the kernels' names say which (scripts/bound_table.py). The FP8
// one keeps one staging box per warpgroup: its stage ring's scale records do not fit beside two.
template <bool kFp32, bool kAccumulate>
struct WeightGradEpilogue : WeightGradStores<kFp32, kAccumulate, 2> {};
template <bool kFp32, bool kAccumulate>
struct Fp8WeightGradEpilogue : WeightGradStores<kFp32, kAccumulate, 1> {};

}  // namespace fusemoe::sm90

// Epilogues of the block-scaled FP8 instances (sm90_block_scaled.cuh) that quantize what they
// produce, in 1 x 128 blocks along the next GEMM's K (recipe: fp8_quantize.cuh). Interface as in
// sm90_epilogues.cuh. Each tile's output is one 1 x 128 block per row; a quad of lanes
// (q = lane % 4) holds all of a row's columns, so a row's amax is the max over the quad (two xor
// shuffles, run by every lane, stores predicated afterwards).
//
//   SwiGLUFp8Epilogue<kClamp, kStoreZ>   the gate/up tile of one 128-column block of h in one
//                                         pass (128 gate + 128 up accumulators): h = bf16(
//                                         silu(g) u) -> E4M3 h [R, I] + scales [I/128][rows_pad];
//                                         z = [g | u] (before the clamp) as bf16 when kStoreZ,
//                                         held and written under the next tile's first K-block
//   DgradSwiGLUFp8Epilogue<kClamp, kZAhead, kBlockN>
//                                         the BF16 dgrad SwiGLU epilogue (dz, w h, <h, a> partials)
//                                         at width 128 or 256, one or two 128-column blocks of dg
//                                         and of du: also dz in E4M3 [R, 2I] + scales
//                                         [2I/128][rows_pad], quantized per block from the bf16 dz
// Block-major scale pools: the scale of row r, block kb at scales[kb * rows_pad + r]; the next
// GEMM's producer threads load a tile's 128 row scales, one 4-byte cp.async each.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "device/fp8_quantize.cuh"
#include "device/sm90_epilogues.cuh"
#include "device/sm90_fragment.cuh"
#include "device/sm90_layout.cuh"

namespace fusemoe::sm90 {

// Max over the quad of lanes that shares a row; every lane ends with the same value.
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 2));
}

// Max |.| of the bf16 pair in a word.
__device__ __forceinline__ float amax_bf16x2(uint32_t word) {
  const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&word));
  return fmaxf(fabsf(f.x), fabsf(f.y));
}

// Quantizes and stores 4 n8 chunks of one row: words[p] = bf16 pair of columns 8 (4a + p) + 2q,
// +1 of this lane, for the group a the caller picked; after the quad transpose lane q holds chunk
// 4a + q whole and writes its 8 E4M3 bytes at row_ptr + 8 (4a + q) (row_ptr: the group's column 0).
__device__ __forceinline__ void store_fp8_group(const uint32_t (&words)[4], uint8_t* row_ptr, float inv, bool valid,
                                                int q) {
  uint32_t w[4] = {words[0], words[1], words[2], words[3]};
  quad_transpose(w, q);
  float v[8];
  unpack_bf16x8(make_uint4(w[0], w[1], w[2], w[3]), v);
  if (valid) *reinterpret_cast<uint2*>(row_ptr + 8 * q) = quantize_e4m3x8(v, inv);
}

// ------------------------------------------------------------------------------------ SwiGLU

template <bool kClamp, bool kStoreZ>
struct SwiGLUFp8Epilogue {
  static constexpr int kBlockN = 256;             // accumulator columns: gate 128 | up 128
  static constexpr int kChunks = kBlockN / 16;    // n8 chunks of h per row: 16 = one 128-block
  static constexpr int kStagingBytes = 0;
  struct Args {
    uint8_t* h;              // [R_max, I] E4M3
    float* h_scales;         // [I/128, rows_pad]
    int32_t rows_pad;
    __nv_bfloat16* z;        // [R_max, 2I] [g | u] before the clamp (kStoreZ)
    float clamp;             // kClamp
  };
  struct Inputs {};
  // z (kStoreZ) is held and goes out under the next tile's first K-block (HeldZ; the FP8 consumer
  // loop, sm90_block_scaled.cuh); h and its scales are stored now.
  using Z = HeldZ<kChunks>;
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
    static_assert(8 * kChunks == kRegs, "gate and up halves fill the accumulators");
    const int32_t I = s.n_valid;
    const int q = me.lane % 4;
    const int64_t block_col = static_cast<int64_t>(tile.n_tile) * kFp8Block;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (kStoreZ) {
        Z::hold(acc, h, args.z, rows.row[h], rows.valid[h], I, static_cast<int>(block_col) + 2 * q, held);
      }
      // words[j] = bf16 pair of h columns 8 j + 2q, +1; the row's amax over the quad.
      uint32_t words[kChunks];
      float amax = 0.0f;
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        words[j] = swiglu_bf16x2<kClamp, kChunks>(acc, j, h, args.clamp);
        amax = fmaxf(amax, amax_bf16x2(words[j]));
      }
      const Fp8Scale scale = fp8_block_scale(quad_max(amax));
      uint8_t* row_ptr = args.h + static_cast<int64_t>(rows.row[h]) * I + block_col;
#pragma unroll
      for (int a = 0; a < kChunks / 4; ++a) {
        const uint32_t group[4] = {words[4 * a], words[4 * a + 1], words[4 * a + 2], words[4 * a + 3]};
        store_fp8_group(group, row_ptr + 32 * a, scale.inv, rows.valid[h], q);
      }
      if (rows.valid[h] && q == 0) {
        args.h_scales[static_cast<int64_t>(tile.n_tile) * args.rows_pad + rows.row[h]] = scale.scale;
      }
    }
  }
  __device__ static void drain(const Args&, const EpilogueShape& s, uint8_t*, const Held& held, int i,
                               const ConsumerThread& me) {
    if constexpr (kStoreZ) Z::drain(held, i, s.n_valid, me.lane);
  }
  __device__ static void finish(const ConsumerThread&) {}
};

// ---------------------------------------------------------------------------- dgrad SwiGLU

template <bool kClamp, int kZAhead, int kBlockN_>
struct DgradSwiGLUFp8Epilogue {
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlocks = kBlockN / kFp8Block;  // 1 x 128 blocks of dg (and of du) per row
  static_assert(kBlocks == 1 || kBlocks == 2, "one or two 128-column blocks per tile");
  static constexpr int kStagingBytes = 0;
  // At width 256 the tile's second block lies past I when I / 128 is odd (I is a multiple of 128).
  using Parts = DgradSwiGLUParts<kBlockN, kClamp, kZAhead, (kBlocks > 1)>;
  static constexpr int kGroupsPerBlock = Parts::kGroups / kBlocks;  // 4
  struct Args {
    const int32_t* row_slot;    // [R_max]
    const float* topk_weights;  // [T*K]
    const __nv_bfloat16* z;     // [R_max, 2I]
    __nv_bfloat16* dz;          // [R_max, 2I] bf16 (the weight gradient's operand)
    __nv_bfloat16* wh;          // [R_max, I]
    float* router_partials;     // [R_max, num_n_tiles]
    int32_t num_n_tiles;        // ceil(I / kBlockN)
    float clamp;                // kClamp
    uint8_t* dz_fp8;            // [R_max, 2I] E4M3 (dgrad of x's operand)
    float* dz_scales;           // [2I/128, rows_pad]
    int32_t rows_pad;
  };
  using Inputs = typename Parts::Inputs;
  __device__ static void prefetch(const Args&) {}
  // The main loop (acc 128 + tmp 64) has no registers for z chunks in flight: the epilogue
  // prefetches the tile's z rows into L2 as it starts and loads them kZAhead chunks ahead, once tmp
  // is dead (prefetched at the tile's start, the main loop's operands evicted them before use:
  // docs/experiments.md#z-into-l2-at-the-epilogue).
  __device__ static Inputs prepare(const Args& args, const EpilogueShape&, const Tile&, const AccRows& rows,
                                   const ConsumerThread&) {
    Inputs in{};  // z chunks filled by store(); value-initialised so no copy reads indeterminate values
    // The rows' routing weights (two dependent loads each, 2 registers beside the main loop's):
    // loaded here they arrive under the main loop, where store() would wait for them once a tile.
    Parts::load_weights(args, rows, in);
    return in;
  }

  template <int kRegs>
  __device__ static void store(const Args& args, const EpilogueShape& s, const Tile& tile, const AccRows& rows,
                               Inputs& in, const float (&acc)[kRegs], uint8_t*, const ConsumerThread& me) {
    const int32_t I = s.n_valid;
    const int32_t n0 = tile.n_tile * kBlockN;
    const int q = me.lane % 4;
    Parts::prefetch_z(args, I, rows, n0, q);
    Parts::load_z_ahead(args, I, rows, n0, q, in);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t r = rows.row[h];
      const bool valid = rows.valid[h];
      const float w = in.weight[h];
      // The row's outputs at this lane's first column (n0 + 8q): every store below is at a
      // constant offset from one of these, with no 64-bit address arithmetic of its own.
      const int64_t lane_col = n0 + 8 * q;
      __nv_bfloat16* const dz_row = args.dz + r * 2 * I + lane_col;
      __nv_bfloat16* const wh_row = args.wh + r * I + lane_col;
      uint8_t* const dz_fp8_row = args.dz_fp8 + r * 2 * I + lane_col;
      float dot = 0.0f;  // <h, a> over this lane's columns of the tile, fixed order
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) {
        float block_dot = 0.0f;
        const int32_t b0 = n0 + b * kFp8Block;  // the block's first column
        // A block past I still takes its z chunks (the ring of loads in flight stays in step).
        const bool block_in = kBlocks == 1 || b0 < I;
        float amax_g = 0.0f, amax_u = 0.0f;
        uint32_t dg_bits[kGroupsPerBlock][4], du_bits[kGroupsPerBlock][4];
#pragma unroll
        for (int a = 0; a < kGroupsPerBlock; ++a) {
          const int group = b * kGroupsPerBlock + a;
          float av[8];
          gather_chunk_fp32(acc, group, h, q, av);
          const int off = 32 * group;  // this chunk's column minus lane_col
          float g[8], u[8];
          Parts::take_z_chunk(args, I, rows, n0, q, h * Parts::kGroups + group, in, g, u);
          uint32_t wh_bits[4];
#pragma unroll
          for (int i = 0; i < 8; i += 2) {
            const auto d = Parts::backward_pair(args, g, u, av, i, w, block_dot);
            dg_bits[a][i / 2] = pack_bf16x2(d.dg[0], d.dg[1]);
            du_bits[a][i / 2] = pack_bf16x2(d.du[0], d.du[1]);
            wh_bits[i / 2] = pack_bf16x2(d.wh[0], d.wh[1]);
            amax_g = fmaxf(amax_g, fmaxf(fabsf(d.dg[0]), fabsf(d.dg[1])));
            amax_u = fmaxf(amax_u, fmaxf(fabsf(d.du[0]), fabsf(d.du[1])));
          }
          if (valid && block_in) {
            *reinterpret_cast<uint4*>(dz_row + off) =
                make_uint4(dg_bits[a][0], dg_bits[a][1], dg_bits[a][2], dg_bits[a][3]);
            *reinterpret_cast<uint4*>(dz_row + I + off) =
                make_uint4(du_bits[a][0], du_bits[a][1], du_bits[a][2], du_bits[a][3]);
            *reinterpret_cast<uint4*>(wh_row + off) = make_uint4(wh_bits[0], wh_bits[1], wh_bits[2], wh_bits[3]);
          }
        }
        dot += block_in ? block_dot : 0.0f;
        // The amax of the fp32 values, rounded: that of the bf16 ones quantized (rounding to
        // nearest is monotone and odd), in 1 FMNMX a value instead of 2 unpacks, 2 |.| and a max.
        const Fp8Scale sg = fp8_block_scale(round_bf16(quad_max(amax_g)));
        const Fp8Scale su = fp8_block_scale(round_bf16(quad_max(amax_u)));
        // Lane q holds chunks 4a + q of this row (gather_chunk_fp32's transpose): whole 8-column runs.
#pragma unroll
        for (int a = 0; a < kGroupsPerBlock; ++a) {
          const int off = b * kFp8Block + 32 * a;
          float v[8];
          unpack_bf16x8(make_uint4(dg_bits[a][0], dg_bits[a][1], dg_bits[a][2], dg_bits[a][3]), v);
          if (valid && block_in) *reinterpret_cast<uint2*>(dz_fp8_row + off) = quantize_e4m3x8(v, sg.inv);
          unpack_bf16x8(make_uint4(du_bits[a][0], du_bits[a][1], du_bits[a][2], du_bits[a][3]), v);
          if (valid && block_in) *reinterpret_cast<uint2*>(dz_fp8_row + I + off) = quantize_e4m3x8(v, su.inv);
        }
        if (valid && block_in && q == 0) {
          const int64_t block = b0 / kFp8Block;
          args.dz_scales[block * args.rows_pad + r] = sg.scale;
          args.dz_scales[(I / kFp8Block + block) * args.rows_pad + r] = su.scale;
        }
      }
      store_router_partial(args, dot, valid, q, r, tile.n_tile);
    }
  }
  __device__ static void finish(const ConsumerThread&) {}
};

}  // namespace fusemoe::sm90

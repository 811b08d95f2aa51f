// Side jobs of the sm90 grouped GEMM (src/kernels/sm90_grouped_gemm.cuh): element-wise work that
// an instance whose operands all come by TMA runs in the producer warpgroup's warps 1-3, which
// load nothing there (thread 0 issues every TMA copy), so a launch that would follow the GEMM
// runs under its tensor-bound main loops instead (issue 19, "fewer launches").
//
//   NoSideJob        nothing (every instance but the weight gradients)
//   SlotCombineJob   the fused backward's combine (kernels/moe_elementwise.h, launch_combine_slots):
//                    dx[t] = sum_j dx_slots[t*K + j] over the slots with a row, in slot order,
//                    fp32, rounded to bf16 once; and d_topk_w[s] = sum_n partials[row(s)][n]
//                    (0 for a slot without a row): the same bits as the combine kernel
//
// A side job runs in the producer's 40 registers: each lane holds one 8-column vector's fp32 sum
// and kLoadsInFlight 16-byte loads; the rows of the warp's next item are prefetched into L2, and
// its slot mask loaded, while it sums this one. A job may be split over several launches (each
// takes a range of its work). Its work is split evenly over every CTA's 96 threads; the kernel ends when its
// last warp does, so a job must take less time than the GEMM it rides on.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "device/sm90_fragment.cuh"
#include "device/sm90_layout.cuh"
#include "device/sm90_ptx.cuh"

namespace fusemoe::sm90 {

// The side job's threads: the producer warpgroup's warps 1-3 (warp 0 is the TMA producer's).
constexpr int kSideJobFirstThread = 32;
constexpr int kSideJobThreads = kThreadsPerWarpgroup - kSideJobFirstThread;
constexpr int kSideJobWarps = kSideJobThreads / 32;

struct NoSideJob {
  struct Args {};
  static constexpr bool kRuns = false;
  __device__ static void run(const Args&, int) {}
};

struct SlotCombineJob {
  static constexpr bool kRuns = true;
  static constexpr int kVec = 8;                  // bf16 columns per lane (16 bytes)
  static constexpr int kSegmentCols = 32 * kVec;  // columns per warp item: 512 bytes, four L2 lines
  static constexpr int kLoadsInFlight = 4;        // slot rows loaded at once
  struct Args {
    const __nv_bfloat16* slots = nullptr;  // [T*K, H] bf16, one row per slot (rows of masked slots unread)
    const int32_t* slot_row = nullptr;     // [T*K]: the slot's pool row, < 0 for none
    __nv_bfloat16* out = nullptr;          // [T, H] bf16
    const float* router_partials = nullptr;  // [R, num_n_tiles] or null: no router gradient
    float* d_topk_w = nullptr;               // [T*K] (with router_partials)
    int32_t top_k = 0;
    int32_t hidden = 0;                      // multiple of 8
    int32_t num_n_tiles = 0;
    // This launch's share: tokens [token_begin, token_end), their dx rows and their K slots'
    // router gradients (empty: none).
    int32_t token_begin = 0, token_end = 0;
  };

  // Lane j's slot of a token (j0 + j < K) has a row: the warp's mask of them.
  __device__ static uint32_t slots_with_rows(const Args& a, int64_t token, int32_t j0, int lane) {
    const int32_t j = j0 + lane;
    const bool has = j < a.top_k && __ldg(a.slot_row + token * a.top_k + j) >= 0;
    return __ballot_sync(0xFFFFFFFFu, has);
  }

  // thread: 0 .. kSideJobThreads - 1 within the CTA.
  __device__ static void run(const Args& a, int thread) {
    const int64_t first = static_cast<int64_t>(blockIdx.x) * kSideJobThreads + thread;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kSideJobThreads;
    if (a.router_partials != nullptr) {
      const int64_t slot_end = static_cast<int64_t>(a.token_end) * a.top_k;
      for (int64_t s = static_cast<int64_t>(a.token_begin) * a.top_k + first; s < slot_end; s += stride) {
        const int32_t row = __ldg(a.slot_row + s);
        float sum = 0.0f;  // n in increasing order, as router_grad_of_slot
        if (row >= 0) {
          for (int32_t n = 0; n < a.num_n_tiles; ++n) sum += __ldg(a.router_partials + int64_t(row) * a.num_n_tiles + n);
        }
        a.d_topk_w[s] = sum;
      }
    }
    const int lane = thread % 32;
    const int32_t segments = (a.hidden + kSegmentCols - 1) / kSegmentCols;
    const int64_t item_begin = static_cast<int64_t>(a.token_begin) * segments;
    const int64_t item_end = static_cast<int64_t>(a.token_end) * segments;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kSideJobWarps;
    int64_t item = item_begin + static_cast<int64_t>(blockIdx.x) * kSideJobWarps + thread / 32;
    // The item's slot mask (K <= 32; more slots take their masks in the loop below).
    uint32_t mask = item < item_end ? slots_with_rows(a, item / segments, 0, lane) : 0u;
    for (; item < item_end; item += warps) {
      const int64_t token = item / segments;
      const int32_t col = static_cast<int32_t>(item % segments) * kSegmentCols + kVec * lane;
      const bool lane_in = col < a.hidden;
      // The next item's slot rows into L2 (lane l: line l % 4 of row l / 4; a masked slot's row
      // lies inside the buffer and is only never summed), and its mask.
      const int64_t next = item + warps;
      uint32_t next_mask = 0u;
      if (next < item_end) {
        const int64_t next_token = next / segments;
        const int64_t next_col = (next % segments) * kSegmentCols + 64 * (lane % 4);
        if (next_col < a.hidden) {
          for (int32_t j = lane / 4; j < a.top_k; j += 8) {
            prefetch_l2(a.slots + (next_token * a.top_k + j) * a.hidden + next_col);
          }
        }
        next_mask = slots_with_rows(a, next_token, 0, lane);
      }
      float acc[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[i] = 0.0f;
      const __nv_bfloat16* src = a.slots + token * a.top_k * a.hidden + col;
      const int64_t row_step = a.hidden;
      for (int32_t j0 = 0; j0 < a.top_k; j0 += kLoadsInFlight) {
        if (j0 > 0 && j0 % 32 == 0) mask = slots_with_rows(a, token, j0, lane);
        // Rows past K have no bit: the mask holds K's bits only.
        const uint32_t group = lane_in ? (mask >> (j0 % 32)) & ((1u << kLoadsInFlight) - 1u) : 0u;
        uint4 v[kLoadsInFlight];
#pragma unroll
        for (int u = 0; u < kLoadsInFlight; ++u) {
          v[u] = (group >> u) & 1u ? __ldg(reinterpret_cast<const uint4*>(src + u * row_step)) : make_uint4(0, 0, 0, 0);
        }
        src += kLoadsInFlight * row_step;
        // Slot order, skipping slots without a row: the combine kernel's additions exactly.
#pragma unroll
        for (int u = 0; u < kLoadsInFlight; ++u) {
          if (!((group >> u) & 1u)) continue;
          float x[kVec];
          unpack_bf16x8(v[u], x);
#pragma unroll
          for (int i = 0; i < kVec; ++i) acc[i] += x[i];
        }
      }
      if (lane_in) {
        *reinterpret_cast<uint4*>(a.out + token * a.hidden + col) =
            make_uint4(pack_bf16x2(acc[0], acc[1]), pack_bf16x2(acc[2], acc[3]), pack_bf16x2(acc[4], acc[5]),
                       pack_bf16x2(acc[6], acc[7]));
      }
      mask = next_mask;
    }
  }
};

}  // namespace fusemoe::sm90

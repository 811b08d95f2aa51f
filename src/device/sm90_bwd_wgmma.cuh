// wgmma (warpgroup MMA) for the backward GEMMs, with either operand K-major or MN-major in
// shared memory, and the matching shared-memory matrix descriptors. The forward's wrappers
// (sm90_ptx.cuh) fix both operands K-major; the backward also needs
//   B N-major: a weight [K rows, N cols] row-major (W2_e as [H, I], W13_e as [2I, H]),
//   A M-major: activations read transposed (dys^T, dz^T) for the weight gradients.
//
// Both layouts use TMA's 128-byte swizzle with boxes whose inner extent is 64 bf16 = 128 bytes:
//   K-major tile  [rows (M or N)][64 k]  : row r at r * 128 B, 16-byte chunk c at c ^ (r % 8).
//   MN-major tile boxes [64 k][64 mn], box b at b * kMnBoxBytes: k-row kk at kk * 128 B, chunk
//                 c (8 consecutive m/n) at c ^ (kk % 8). 8 k-rows form one 1024-byte atom.
// Descriptor fields (16-byte units): start address, leading byte offset (LBO), stride byte
// offset (SBO), layout 1 = SWIZZLE_128B. K-major: SBO = 1024 (next 8 rows), LBO unused.
// MN-major (canonical ((8 x 8 elements, m atoms), (8 k, k groups)) with strides
// ((1, 8, LBO), (64, SBO)) elements): LBO = distance between 64-wide MN atoms (the next TMA
// box, kMnBoxBytes), SBO = distance between groups of 8 k-rows (1024 B).
// Accumulator fragment of m64nNk16 (per thread; warp w of the warpgroup, lane l):
// d[4j + 2h + b] = row 16w + l/4 + 8h, column 8j + 2(l%4) + b.
#pragma once

#include <cstdint>

#include "device/sm90_ptx.cuh"

namespace fusemoe::sm90::bwd {

constexpr int kSwizzleRowBytes = 128;           // one TMA box row: 64 bf16
constexpr int kSwizzleAtomBytes = 1024;         // 8 rows x 128 B
constexpr int kMnBoxRows = 64;                  // k-rows per MN-major TMA box (one K-block)
constexpr int kMnBoxBytes = kMnBoxRows * kSwizzleRowBytes;  // 8 KB

// Descriptor for a 1024-byte aligned swizzled tile (both majors; the instruction's transpose
// bits say which one it is).
__device__ __forceinline__ uint64_t make_desc_sw128(const void* smem_tile, uint32_t lbo_bytes,
                                                    uint32_t sbo_bytes) {
  constexpr uint64_t kSwizzle128B = 1;
  return static_cast<uint64_t>((smem_addr(smem_tile) & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>(lbo_bytes >> 4) << 16) |
         (static_cast<uint64_t>(sbo_bytes >> 4) << 32) | (kSwizzle128B << 62);
}

template <bool kMnMajor>
struct OperandLayout {
  // K-major: LBO is ignored by the hardware for swizzled K-major tiles (1 as CUTLASS writes it).
  static constexpr uint32_t kLbo = kMnMajor ? kMnBoxBytes : 16;
  static constexpr uint32_t kSbo = kSwizzleAtomBytes;
  // Start-address step of one k16 slice: 32 bytes along a K-major row; 16 k-rows of 128 bytes
  // (two whole atoms, so the swizzle phase is unchanged) for MN-major.
  static constexpr uint64_t kDescStepK16 = kMnMajor ? (16 * kSwizzleRowBytes) >> 4 : 32 >> 4;
};

#define FUSEMOE_BWD_ACC4(b) "+f"(d[(b) + 0]), "+f"(d[(b) + 1]), "+f"(d[(b) + 2]), "+f"(d[(b) + 3])
#define FUSEMOE_BWD_ACC16(b) \
  FUSEMOE_BWD_ACC4(b), FUSEMOE_BWD_ACC4((b) + 4), FUSEMOE_BWD_ACC4((b) + 8), FUSEMOE_BWD_ACC4((b) + 12)
#define FUSEMOE_BWD_ACC64(b) \
  FUSEMOE_BWD_ACC16(b), FUSEMOE_BWD_ACC16((b) + 16), FUSEMOE_BWD_ACC16((b) + 32), FUSEMOE_BWD_ACC16((b) + 48)

// D[64 x kN] (+)= A[64 x 16] B[16 x kN], bf16 in, fp32 accumulators d[0, kN/2).
// kTransA / kTransB: 0 = K-major, 1 = MN-major. scale_d = 0 overwrites D.
template <int kN, int kTransA, int kTransB>
struct WgmmaBf16;

template <int kTransA, int kTransB>
struct WgmmaBf16<128, kTransA, kTransB> {
  static constexpr int kAccRegs = 64;
  __device__ __forceinline__ static void mma(float (&d)[kAccRegs], uint64_t desc_a, uint64_t desc_b,
                                             uint32_t scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
        : FUSEMOE_BWD_ACC64(0)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
  }
};

template <int kTransA, int kTransB>
struct WgmmaBf16<256, kTransA, kTransB> {
  static constexpr int kAccRegs = 128;
  __device__ __forceinline__ static void mma(float (&d)[kAccRegs], uint64_t desc_a, uint64_t desc_b,
                                             uint32_t scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
        : FUSEMOE_BWD_ACC64(0), FUSEMOE_BWD_ACC64(64)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
  }
};

#undef FUSEMOE_BWD_ACC64
#undef FUSEMOE_BWD_ACC16
#undef FUSEMOE_BWD_ACC4

// Orders generic-proxy shared-memory writes of this thread before later async-proxy reads
// (wgmma, TMA store) of the same bytes; a barrier must follow for other threads' reads.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Named barrier over `num_threads` threads (a multiple of 32); id 0 is __syncthreads.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t num_threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

}  // namespace fusemoe::sm90::bwd

// Thin wrappers over the Hopper (sm_90a) PTX that the fused MoE kernels use: mbarriers, TMA
// tensor loads, cp.async row copies, wgmma (warpgroup MMA) with shared-memory descriptors, and
// setmaxnreg.
//
// Conventions: shared-memory addresses are 32-bit `.shared::cta` addresses (from
// smem_addr()); every wrapper is a single PTX instruction or a fixed short sequence, so the
// kernels read as the algorithm and this file as the ISA. Operand tiles are K-major with the
// 128-byte swizzle that TMA writes (SWIZZLE_128B): row r of a tile is 128 bytes (64 bf16), its
// 16-byte chunk c is stored at chunk c ^ (r % 8), and 8 rows form one 1024-byte swizzle atom.
#pragma once

#include <cuda.h>  // CUtensorMap (types only; nothing here links libcuda)
#include <cstdint>

namespace fusemoe::sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// ---------------------------------------------------------------------------------------------
// mbarrier: a transaction-count barrier in shared memory. Phases alternate parity 0, 1, 0, ...
// A freshly initialised barrier counts as having completed the phase of parity 1, so a first
// wait on parity 1 returns at once (the producer's "all slots empty" start state).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrival_count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrival_count)
               : "memory");
}

// Makes the initialised barriers visible to the async proxy (TMA) before first use.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// One arrival plus the number of bytes the TMA loads of this phase will deliver.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t tx_bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(tx_bytes)
               : "memory");
}

// Spins until the phase with the given parity has completed. try_wait suspends the thread for
// a hardware-chosen time between polls, so the loop does not steal issue slots from the MMA
// warps. (No timeout here: every wait is on a phase that the same CTA's producer or consumers
// complete unconditionally; a missing arrival is a bug that the unit test catches as a hang.)
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_loop:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_loop;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// ---------------------------------------------------------------------------------------------
// TMA (cp.async.bulk.tensor): 2-D tile loads described by a CUtensorMap kernel parameter.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Loads the box at element coordinates (inner, outer) into smem_dst and signals `bar` with the
// box's byte count. Elements outside the tensor are filled with zeros (and still counted).
__device__ __forceinline__ void tma_load_2d(const CUtensorMap* map, uint64_t* bar, void* smem_dst,
                                            int32_t inner, int32_t outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(inner), "r"(outer), "r"(smem_addr(bar))
      : "memory");
}

// ---------------------------------------------------------------------------------------------
// cp.async (LDGSTS): 16-byte global -> shared copies issued per thread, for rows that TMA
// cannot gather. Completion is tracked by an mbarrier: cp_async_mbarrier_arrive_noinc makes
// one of the barrier's expected arrivals (counted at init) fire once all of this thread's
// earlier cp.async copies have landed.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void cp_async_16(uint32_t smem_dst, const void* global_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_dst), "l"(global_src) : "memory");
}

__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// cp.async writes shared memory through the generic proxy, wgmma reads it through the async
// proxy: a thread that has observed the writes (through the mbarrier) orders them before its
// wgmma reads with this fence.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---------------------------------------------------------------------------------------------
// Register reallocation between warpgroups (needs a register cap at kernel entry:
// __launch_bounds__(threads, 1)).
// ---------------------------------------------------------------------------------------------
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg range");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg range");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// ---------------------------------------------------------------------------------------------
// wgmma: D[64 x N] (+)= A[64 x 16] * B[N x 16]^T, A and B K-major in shared memory, fp32 D in
// registers spread over the 128 threads of a warpgroup. Accumulator fragment (per thread,
// warp w = warp index in the warpgroup, lane l): d[4*j + 2*h + b] holds row 16*w + l/4 + 8*h,
// column 8*j + 2*(l%4) + b, for j in [0, N/8), h, b in {0, 1}.
// ---------------------------------------------------------------------------------------------

// Shared-memory matrix descriptor for a K-major, 128B-swizzled tile whose base is 1024-byte
// aligned: start address >> 4 (bits 0-13), leading offset unused by this layout (1), stride
// between 8-row groups 1024 B >> 4 (bits 32-45), layout type 1 = SWIZZLE_128B (bits 62-63).
__device__ __forceinline__ uint64_t make_smem_desc_sw128(const void* smem_tile) {
  constexpr uint64_t kLeadingOffset = 1;
  constexpr uint64_t kStrideOffset = 1024 >> 4;
  constexpr uint64_t kSwizzle128B = 1;
  return static_cast<uint64_t>((smem_addr(smem_tile) & 0x3FFFF) >> 4) | (kLeadingOffset << 16) |
         (kStrideOffset << 32) | (kSwizzle128B << 62);
}
// Advancing K by 16 bf16 (32 bytes) inside a 128-byte swizzled row moves the start address by
// 32 >> 4 = 2; the hardware applies the swizzle to the computed address.
constexpr uint64_t kDescStepK16 = 2;

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Tells the compiler the accumulator registers may change here, so it neither reads them
// before a wgmma_wait_group nor moves their use across a wgmma issue.
template <int kRegs>
__device__ __forceinline__ void fence_accumulators(float (&d)[kRegs]) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define FUSEMOE_ACC8(b)                                                                  \
  "+f"(d[(b) + 0]), "+f"(d[(b) + 1]), "+f"(d[(b) + 2]), "+f"(d[(b) + 3]), "+f"(d[(b) + 4]), \
      "+f"(d[(b) + 5]), "+f"(d[(b) + 6]), "+f"(d[(b) + 7])
#define FUSEMOE_ACC32(b) FUSEMOE_ACC8(b), FUSEMOE_ACC8((b) + 8), FUSEMOE_ACC8((b) + 16), FUSEMOE_ACC8((b) + 24)
#define FUSEMOE_REGS16(a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p) \
  "%" #a ", %" #b ", %" #c ", %" #d ", %" #e ", %" #f ", %" #g ", %" #h ", %" #i ", %" #j ", %" #k ", %" #l ", %" #m ", %" #n ", %" #o ", %" #p

// wgmma.mma_async m64 x kN x k16, bf16 inputs, fp32 accumulators d[0, kN/2).
// scale_d = 0 overwrites the accumulators (first k-step of a tile), 1 accumulates.
template <int kN>
struct Wgmma;

template <>
struct Wgmma<128> {
  static constexpr int kAccRegs = 64;
  __device__ __forceinline__ static void mma(float (&d)[kAccRegs], uint64_t desc_a, uint64_t desc_b,
                                             uint32_t scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        FUSEMOE_REGS16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15) ", "
        FUSEMOE_REGS16(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31) ", "
        FUSEMOE_REGS16(32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47) ", "
        FUSEMOE_REGS16(48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63)
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : FUSEMOE_ACC32(0), FUSEMOE_ACC32(32)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};

template <>
struct Wgmma<256> {
  static constexpr int kAccRegs = 128;
  __device__ __forceinline__ static void mma(float (&d)[kAccRegs], uint64_t desc_a, uint64_t desc_b,
                                             uint32_t scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        FUSEMOE_REGS16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15) ", "
        FUSEMOE_REGS16(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31) ", "
        FUSEMOE_REGS16(32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47) ", "
        FUSEMOE_REGS16(48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63) ", "
        FUSEMOE_REGS16(64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79) ", "
        FUSEMOE_REGS16(80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95) ", "
        FUSEMOE_REGS16(96, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111) ", "
        FUSEMOE_REGS16(112, 113, 114, 115, 116, 117, 118, 119, 120, 121, 122, 123, 124, 125, 126, 127)
        "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : FUSEMOE_ACC32(0), FUSEMOE_ACC32(32), FUSEMOE_ACC32(64), FUSEMOE_ACC32(96)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};

#undef FUSEMOE_REGS16
#undef FUSEMOE_ACC32
#undef FUSEMOE_ACC8

}  // namespace fusemoe::sm90

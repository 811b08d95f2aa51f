// Thin wrappers over the Hopper (sm_90a) PTX that the fused MoE kernels use: mbarriers, TMA
// tensor loads, cp.async row copies, wgmma (warpgroup MMA) with shared-memory descriptors, and
// setmaxnreg, named barriers.
//
// Conventions: shared-memory addresses are 32-bit `.shared::cta` addresses (from
// smem_addr()); every wrapper is a single PTX instruction or a fixed short sequence, so the
// kernels read as the algorithm and this file as the ISA. Operand tiles carry the 128-byte
// swizzle that TMA writes (SWIZZLE_128B): see the wgmma section for the two layouts.
#pragma once

#include <cuda.h>  // CUtensorMap (types only; nothing here links libcuda)
#include <cstdint>

#include "device/sm90_layout.cuh"

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

// Waits until the phase with the given parity has completed. try_wait suspends the thread for a
// hardware-chosen time between polls, so the loop does not steal issue slots from the MMA warps.
// Bounded: once timeout_ns have passed since the first failed try, the first thread of the
// device to time out (the others wait until it is done) writes DeviceWaitRecord (common/device_wait.h: state, site, expected,
// parity, block, thread, waited ns at offsets 0..24) to `record` (mapped host memory), and the
// thread traps. All of it is one asm statement: a wait loop or a report branch the compiler can
// see inside the main loop changed how it scheduled the MMA loop and spilled registers.
__device__ __forceinline__ void mbarrier_wait_or_trap(uint64_t* bar, uint32_t parity, uint64_t timeout_ns,
                                                      void* record, uint32_t site, uint32_t expected) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      ".reg .u64 t0, t1;\n"
      ".reg .b32 old, v;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@p bra done;\n"
      "mov.u64 t0, %%globaltimer;\n"
      "wait_loop:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@p bra done;\n"
      "mov.u64 t1, %%globaltimer;\n"
      "sub.u64 t1, t1, t0;\n"
      "setp.le.u64 p, t1, %2;\n"
      "@p bra wait_loop;\n"
      "atom.global.cas.b32 old, [%3], 0, -1;\n"
      "setp.ne.b32 p, old, 0;\n"
      "@p bra others_wait;\n"
      "st.global.u32 [%3+4], %4;\n"
      "st.global.u32 [%3+8], %5;\n"
      "st.global.u32 [%3+12], %1;\n"
      "mov.u32 v, %%ctaid.x;\n"
      "st.global.u32 [%3+16], v;\n"
      "mov.u32 v, %%tid.x;\n"
      "st.global.u32 [%3+20], v;\n"
      "st.global.u64 [%3+24], t1;\n"
      "fence.sc.sys;\n"
      "st.global.u32 [%3], 1;\n"
      "fence.sc.sys;\n"
      "trap;\n"
      // A trap ends the whole context: a thread that lost the race waits for the winner's
      // record to be complete (state -1 -> 1) before it traps too.
      "others_wait:\n"
      "ld.volatile.global.u32 old, [%3];\n"
      "setp.eq.s32 p, old, -1;\n"
      "@p bra others_wait;\n"
      "trap;\n"
      "done:\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity), "l"(timeout_ns), "l"(record), "r"(site), "r"(expected)
      : "memory");
}

// ---------------------------------------------------------------------------------------------
// TMA (cp.async.bulk.tensor): 2-D tile loads described by a CUtensorMap kernel parameter.
// ---------------------------------------------------------------------------------------------
// Brings the 128-byte line at p into L2 (no register result: nothing waits for it).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<uint64_t>(p)));
}

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

// Stores the shared-memory box at smem_src to element coordinates (inner, outer); elements
// outside the tensor are not written. The copy runs asynchronously in the TMA unit: the
// issuing thread tracks it with bulk_commit_group / bulk_wait_group*, and the smem bytes
// must have been made visible to the async proxy (fence_proxy_async_shared + barrier).
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* smem_src, int32_t inner,
                                             int32_t outer) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(inner), "r"(outer), "r"(smem_addr(smem_src))
               : "memory");
}

// As tma_store_2d, but each element of the box is added to what global memory holds (an fp32 add
// for an fp32 tensor map), in the memory system: the SM loads nothing. Tracked as a store.
__device__ __forceinline__ void tma_reduce_add_2d(const CUtensorMap* map, const void* smem_src, int32_t inner,
                                                  int32_t outer) {
  asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(inner), "r"(outer), "r"(smem_addr(smem_src))
               : "memory");
}

__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Waits until at most kPending of this thread's committed store groups still read their
// shared-memory source (after which the source may be overwritten).
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// Waits until all of this thread's committed store groups have completed (written to global).
__device__ __forceinline__ void bulk_wait_group_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// ---------------------------------------------------------------------------------------------
// cp.async (LDGSTS): 16-byte global -> shared copies issued per thread, for rows that TMA
// cannot gather. Completion is tracked by an mbarrier: cp_async_mbarrier_arrive_noinc makes
// one of the barrier's expected arrivals (counted at init) fire once all of this thread's
// earlier cp.async copies have landed.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void cp_async_16(uint32_t smem_dst, const void* global_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_dst), "l"(global_src) : "memory");
}

// Copies src_bytes (0 or 16) of global_src and zero-fills the rest of the 16 bytes.
__device__ __forceinline__ void cp_async_16_zfill(uint32_t smem_dst, const void* global_src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_dst), "l"(global_src), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Shared memory written through the generic proxy (cp.async, st.shared) and read through the
// async proxy (wgmma, TMA store): a thread that has observed the writes (through an mbarrier)
// orders them before its async-proxy reads with this fence; a barrier must follow where other
// threads wrote the bytes.
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
// wgmma: D[64 x N] (+)= A[64 x 16] B[16 x N], bf16 operands in shared memory, fp32 D in
// registers spread over the 128 threads of a warpgroup. Accumulator fragment (per thread,
// warp w = warp index in the warpgroup, lane l): d[4*j + 2*h + b] holds row 16*w + l/4 + 8*h,
// column 8*j + 2*(l%4) + b, for j in [0, N/8), h, b in {0, 1}.
//
// Each operand is K-major or MN-major in shared memory, both with TMA's 128-byte swizzle and
// boxes whose inner extent is 64 bf16 = 128 bytes:
//   K-major tile  [rows (M or N)][64 k]  : row r at r * 128 B, 16-byte chunk c at c ^ (r % 8).
//   MN-major tile boxes [64 k][64 mn], box b at b * kMnBoxBytes: k-row kk at kk * 128 B, chunk
//                 c (8 consecutive m/n) at c ^ (kk % 8). 8 k-rows form one 1024-byte atom.
// The forward reads both operands K-major (x rows and W13_e / W2_e rows); the backward also
// reads B N-major (a weight [K rows, N cols] row-major: W2_e as [H, I], W13_e as [2I, H]) and
// A M-major (activations transposed, dys^T and dz^T, for the weight gradients).
// The layout constants (kSwizzleRowBytes, kMnBoxBytes, ...) live in sm90_layout.cuh.
// Descriptor fields (16-byte units): start address, leading byte offset (LBO), stride byte
// offset (SBO), layout 1 = SWIZZLE_128B. K-major: SBO = 1024 (next 8 rows), LBO unused.
// MN-major (canonical ((8 x 8 elements, m atoms), (8 k, k groups)) with strides
// ((1, 8, LBO), (64, SBO)) elements): LBO = distance between 64-wide MN atoms (the next TMA
// box, kMnBoxBytes), SBO = distance between groups of 8 k-rows (1024 B).
// ---------------------------------------------------------------------------------------------

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
  // Start-address step of one k16 slice: 32 bytes along a K-major row (the hardware applies the
  // swizzle to the computed address); 16 k-rows of 128 bytes (two whole atoms, so the swizzle
  // phase is unchanged) for MN-major.
  static constexpr uint64_t kDescStepK16 = kMnMajor ? (16 * kSwizzleRowBytes) >> 4 : 32 >> 4;
};

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

// Operand lists of a wgmma's fp32 accumulators: "+f" constraints of d[b, b + 32) and the asm
// operand names %a..%p. Left defined for sm90_fp8_ptx.cuh's wgmma, which writes the same lists.
#define FUSEMOE_ACC8(b)                                                                  \
  "+f"(d[(b) + 0]), "+f"(d[(b) + 1]), "+f"(d[(b) + 2]), "+f"(d[(b) + 3]), "+f"(d[(b) + 4]), \
      "+f"(d[(b) + 5]), "+f"(d[(b) + 6]), "+f"(d[(b) + 7])
#define FUSEMOE_ACC32(b) FUSEMOE_ACC8(b), FUSEMOE_ACC8((b) + 8), FUSEMOE_ACC8((b) + 16), FUSEMOE_ACC8((b) + 24)
#define FUSEMOE_REGS16(a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p) \
  "%" #a ", %" #b ", %" #c ", %" #d ", %" #e ", %" #f ", %" #g ", %" #h ", %" #i ", %" #j ", %" #k ", %" #l ", %" #m ", %" #n ", %" #o ", %" #p
// Accumulator operands %0..%63 and %64..%127 of the asm string.
#define FUSEMOE_ACC_REGS_0_63                                                                         \
  FUSEMOE_REGS16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15) ", "                          \
  FUSEMOE_REGS16(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31) ", "                \
  FUSEMOE_REGS16(32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47) ", "                \
  FUSEMOE_REGS16(48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63)
#define FUSEMOE_ACC_REGS_64_127                                                                       \
  FUSEMOE_REGS16(64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79) ", "                \
  FUSEMOE_REGS16(80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95) ", "                \
  FUSEMOE_REGS16(96, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111) ", "    \
  FUSEMOE_REGS16(112, 113, 114, 115, 116, 117, 118, 119, 120, 121, 122, 123, 124, 125, 126, 127)

// wgmma.mma_async m64 x kN x k16, bf16 inputs, fp32 accumulators d[0, kN/2).
// kTransA / kTransB: 0 = K-major, 1 = MN-major. scale_d = 0 overwrites the accumulators (first
// k-step of a tile), 1 accumulates.
template <int kN, int kTransA = 0, int kTransB = 0>
struct Wgmma {
  static_assert(kN == 128 || kN == 256, "the wgmma widths the kernels use");
  static constexpr int kAccRegs = kN / 2;
  __device__ __forceinline__ static void mma(float (&d)[kAccRegs], uint64_t desc_a, uint64_t desc_b,
                                             uint32_t scale_d) {
    if constexpr (kN == 128) {
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" FUSEMOE_ACC_REGS_0_63
                   "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
                   : FUSEMOE_ACC32(0), FUSEMOE_ACC32(32)
                   : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
    } else {
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" FUSEMOE_ACC_REGS_0_63
                   ", " FUSEMOE_ACC_REGS_64_127 "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
                   : FUSEMOE_ACC32(0), FUSEMOE_ACC32(32), FUSEMOE_ACC32(64), FUSEMOE_ACC32(96)
                   : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
    }
  }
};

// Named barrier over `num_threads` threads (a multiple of 32); id 0 is __syncthreads.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t num_threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}
// Arrives on named barrier `id` without waiting: the other `num_threads` minus these threads
// wait for it with named_barrier_sync.
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t num_threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

}  // namespace fusemoe::sm90

// Configure and launch one instance of the sm90 grouped GEMM (included by the launcher files,
// which instantiate it): the rows problem's shape and the persistent grid.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "common/device_wait.h"
#include "kernels/sm90_grouped_gemm.cuh"
#include "launchers/sm90_grouped_gemm.h"
#include "launchers/sm90_launch_common.h"

namespace fusemoe::sm90 {

static_assert(kBlockK == kTensorMapBoxInner, "a K-block is one tensor-map box row");
static_assert(kMaxPeers == kMaxRanks, "the down epilogue addresses every rank of an expert-parallel group");

// The common sizes of a row-tile GEMM: inner size K (in K-blocks of block_k elements: 64 bf16, or
// 128 E4M3 for the block-scaled instances), N output columns, B's rows per expert.
inline GemmShape rows_shape(const Sm90Rows& rows, int64_t k, int64_t n, int64_t b_rows_per_expert,
                            int64_t block_k = kBlockK) {
  GemmShape s{};
  s.expert_offsets = rows.expert_offsets;
  s.num_experts = static_cast<int32_t>(rows.num_experts);
  s.num_k_blocks = static_cast<int32_t>(k / block_k);
  s.n_valid = static_cast<int32_t>(n);
  s.b_rows_per_expert = static_cast<int32_t>(b_rows_per_expert);
  return s;
}

// The output side of a weight-gradient instance (BF16 or FP8): grad [E, M, N] stored as [E*M rows,
// N] in boxes of [64 rows][128 B], one per consumer warpgroup and box column, and the sizes of its
// expert-output tiles, reduced over each expert's rows between rows.expert_offsets.
template <class Gemm>
void set_weight_grad_output(GemmParams<Gemm>& params, const Sm90Rows& rows, void* grad, bool fp32, int64_t m,
                            int64_t n) {
  params.epilogue.map = make_store_tensor_map(grad, fp32, n, rows.num_experts * m, kWgmmaM, "grad");
  GemmShape& s = params.shape;
  s.expert_offsets = rows.expert_offsets;
  s.num_experts = static_cast<int32_t>(rows.num_experts);
  s.n_valid = static_cast<int32_t>(n);
  s.m_valid = static_cast<int32_t>(m);
}

// A weight-gradient call with no rows at all: grad [E, m, n] zeroed, or left as it is when
// accumulating. Returns true when there was nothing else to do.
inline bool weight_grad_without_rows(const Sm90Rows& rows, void* grad, int64_t m, int64_t n, bool bf16,
                                     bool accumulate) {
  if (rows.max_rows != 0) return false;
  if (!accumulate) {
    FUSEMOE_CUDA_CHECK(cudaMemsetAsync(grad, 0, rows.num_experts * m * n * (bf16 ? 2 : 4), rows.stream));
  }
  return true;
}

// One CTA per SM (or rows.num_sms of them). The dynamic shared-memory limit is raised once per
// device and instance, to what the largest E needs (a limit, not an allocation: each launch asks
// for its own E's bytes), so later calls make no attribute call and threads running layers of
// different E never race on it.
template <class Gemm>
void launch_grouped_gemm(GemmParams<Gemm> params, const Sm90Rows& rows, WaitKernel kernel_name) {
  params.shape.wait = device_wait_bound(kernel_name);
  const DeviceInfo info = device_info();
  const size_t smem_bytes = Gemm::smem_bytes(static_cast<int>(rows.num_experts));
  const size_t smem_limit = std::min(Gemm::smem_bytes(kMaxExperts), static_cast<size_t>(info.max_smem_optin));
  FUSEMOE_ASSERT(smem_bytes <= smem_limit);
  FUSEMOE_ASSERT(rows.num_sms >= 0);
  auto kernel = sm90_grouped_gemm_kernel<Gemm>;
  static std::atomic<uint64_t> configured{0};
  raise_smem_limit_once(reinterpret_cast<const void*>(kernel), smem_limit, info.device, &configured);
  const int grid = rows.num_sms > 0 ? std::min(rows.num_sms, info.num_sms) : info.num_sms;
  if constexpr (Gemm::kDynamicTiles) {
    FUSEMOE_ASSERT(rows.tile_counter != nullptr);
    params.shape.tile_counter = rows.tile_counter;
  }
  kernel<<<grid, kThreads, smem_bytes, rows.stream>>>(params);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

// The assertions every row-tile launch makes of its rows problem.
inline void assert_rows(const Sm90Rows& rows) {
  FUSEMOE_ASSERT(rows.max_rows >= 0 && rows.max_rows < (int64_t{1} << 31));
  FUSEMOE_ASSERT(rows.hidden > 0 && rows.hidden % 128 == 0);
  FUSEMOE_ASSERT(rows.intermediate > 0 && rows.intermediate % 64 == 0);
  FUSEMOE_ASSERT(rows.num_experts >= 1 && rows.num_experts <= kMaxExperts);
  FUSEMOE_ASSERT(rows.expert_offsets != nullptr);
}

// Calls launch(a, b) with the two runtime flags as std::bool_constant: the one place a launcher
// turns them into an instance's template flags.
template <class Launch>
void with_bool_constants(bool a, bool b, Launch&& launch) {
  auto with_a = [&](auto a_c) {
    if (b) {
      launch(a_c, std::true_type{});
    } else {
      launch(a_c, std::false_type{});
    }
  };
  if (a) {
    with_a(std::true_type{});
  } else {
    with_a(std::false_type{});
  }
}

// A row-tile instance whose A is a bf16 pool [R_max, K] by TMA and whose B is an expert's weight
// stored as [E * b_rows_per_expert, K] (K-major) or [E * b_rows_per_expert, N] (read MN-major).
// A B policy with two maps (TwoBMaps) reads b (gate, w1) and b_up (up, w3), each of that shape.
template <class Gemm>
void launch_pool_rows_gemm(WaitKernel kernel_name, const Sm90Rows& rows, const void* a_pool, int64_t k, const void* b,
                           int64_t b_rows_per_expert, int64_t n, const typename Gemm::Epilogue::Args& epilogue,
                           const char* a_name, const char* b_name, const void* b_up = nullptr,
                           const char* b_up_name = nullptr) {
  GemmParams<Gemm> params{};
  params.map_b = make_tensor_map_bf16(b, Gemm::B::kMnMajor ? n : k, rows.num_experts * b_rows_per_expert,
                                      Gemm::B::kBoxRows, b_name);
  if constexpr (TwoBMaps<typename Gemm::B>::value) {
    FUSEMOE_ASSERT(b_up != nullptr);
    params.map_b_up = make_tensor_map_bf16(b_up, Gemm::B::kMnMajor ? n : k, rows.num_experts * b_rows_per_expert,
                                           Gemm::B::kBoxRows, b_up_name);
  }
  params.a.map = make_tensor_map_bf16(a_pool, k, rows.max_rows, kBlockM, a_name);
  params.a.quarter = make_tensor_map_bf16(a_pool, k, rows.max_rows, kQuarterRows, a_name);
  params.epilogue = epilogue;
  params.shape = rows_shape(rows, k, n, b_rows_per_expert);
  launch_grouped_gemm(params, rows, kernel_name);
}

// The arguments of a row-store epilogue that writes slot rows (RowStoreEpilogue at kSlotRow or
// kPeerSlot): row r to row row_slot[r] of `slots`, or (kToPeers) to row to_peers->row_slot[r] of
// rank to_peers->row_src[r]'s slot buffer, weighted by to_peers->row_weight[r].
template <class Epilogue>
typename Epilogue::Args slot_store_args(void* slots, const int32_t* row_slot, const float* topk_weights,
                                        const Sm90PeerRows* to_peers) {
  typename Epilogue::Args epilogue{};
  if constexpr (Epilogue::kToPeers) {
    epilogue.row_slot = to_peers->row_slot;
    epilogue.topk_weights = to_peers->row_weight;
    epilogue.row_src = to_peers->row_src;
    for (int d = 0; d < kMaxPeers; ++d) epilogue.peer_out[d] = static_cast<__nv_bfloat16*>(to_peers->slot_buffers[d]);
  } else {
    epilogue.out = static_cast<__nv_bfloat16*>(slots);
    epilogue.row_slot = row_slot;
    epilogue.topk_weights = topk_weights;
  }
  return epilogue;
}

// The pool-row instances that write slot rows (down, dgrad of x): row r to row row_slot[r] of
// `slots`, or, with to_peers, to its source rank's slot buffer. SlotGemm<kDest> is the instance;
// topk_weights is read only by weighted ones.
template <template <RowDestination> class SlotGemm>
void launch_to_slots(WaitKernel kernel_name, const Sm90Rows& rows, const void* a_pool, int64_t k, const void* b,
                     int64_t b_rows_per_expert, int64_t n, void* slots, const int32_t* row_slot,
                     const float* topk_weights, const Sm90PeerRows* to_peers, const char* a_name, const char* b_name,
                     const void* b_up = nullptr, const char* b_up_name = nullptr) {
  auto launch = [&](auto gemm) {
    using Gemm = decltype(gemm);
    launch_pool_rows_gemm<Gemm>(kernel_name, rows, a_pool, k, b, b_rows_per_expert, n,
                                slot_store_args<typename Gemm::Epilogue>(slots, row_slot, topk_weights, to_peers),
                                a_name, b_name, b_up, b_up_name);
  };
  if (to_peers != nullptr) {
    FUSEMOE_ASSERT(to_peers->row_src && to_peers->row_slot);
    // The expert-parallel layer's GEMMs take the static order (no counter): no peer instance of
    // the dynamic order is built.
    if constexpr (!SlotGemm<RowDestination::kPeerSlot>::kDynamicTiles) launch(SlotGemm<RowDestination::kPeerSlot>{});
    else FUSEMOE_CHECK(false, "internal error: the expert-parallel down takes the static tile order");
  } else {
    FUSEMOE_ASSERT(row_slot && slots);
    launch(SlotGemm<RowDestination::kSlotRow>{});
  }
}

}  // namespace fusemoe::sm90

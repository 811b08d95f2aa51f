// Configure and launch one instance of the sm90 grouped GEMM (included by the launcher files,
// which instantiate it): the rows problem's shape and the persistent grid.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>

#include "common/device_wait.h"
#include "kernels/sm90_grouped_gemm.cuh"
#include "launchers/sm90_grouped_gemm.h"
#include "launchers/sm90_launch_common.h"

namespace fusemoe::sm90 {

static_assert(kBlockK == kTensorMapBoxInner, "a K-block is one tensor-map box row");

// The common sizes of a row-tile GEMM: inner size K, N output columns, B's rows per expert.
inline GemmShape rows_shape(const Sm90Rows& rows, int64_t k, int64_t n, int64_t b_rows_per_expert) {
  GemmShape s{};
  s.expert_offsets = rows.expert_offsets;
  s.num_experts = static_cast<int32_t>(rows.num_experts);
  s.num_k_blocks = static_cast<int32_t>(k / kBlockK);
  s.n_valid = static_cast<int32_t>(n);
  s.b_rows_per_expert = static_cast<int32_t>(b_rows_per_expert);
  return s;
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

}  // namespace fusemoe::sm90

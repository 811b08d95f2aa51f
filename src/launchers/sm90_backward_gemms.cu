// The backward's instances of the sm90 grouped GEMM (sm90_grouped_gemm.h): z recompute, dgrad +
// SwiGLU backward (tile width over I 256, or 128 when asked), dgrad of x into the slot rows, and
// the weight gradients (fp32 or bf16, overwritten or accumulated). The weight gradients keep 32 KB of
// shared memory for their store staging and no tile table, which leaves 4 stages of 48 KB (with
// 3 their consumers waited for data: docs/experiments.md#weight-gradient-fourth-stage). z
// recompute and dgrad of x read w13, or separate w1 and w3 through two tensor maps (the same tiles).
#include <cuda_bf16.h>

#include <type_traits>

#include "launchers/sm90_launch_gemm.cuh"

namespace fusemoe {
namespace {

using sm90::GroupedGemm;
using sm90::GemmParams;
using sm90::RowDestination;

using RecomputeZGemm = GroupedGemm<sm90::PoolRowsA, sm90::WeightsB<256>, sm90::RowTileScheduler,
                                   sm90::RowStoreEpilogue<256, false, RowDestination::kSortedRow>>;
using SeparateRecomputeZGemm = GroupedGemm<sm90::PoolRowsA, sm90::SeparateWeightsB<256>, sm90::RowTileScheduler,
                                           sm90::RowStoreEpilogue<256, false, RowDestination::kSortedRow>>;
// Width 256 (the layer's, sm90_dgrad_block_n): cooperative, since 256 accumulators per 128 rows
// do not fit one warpgroup. Width 128: the ping-pong schedule (each consumer warpgroup a whole
// 128-row tile, 128 accumulators, its SwiGLU-backward epilogue under the other's MMAs).
template <int kBlockN, bool kClamp>
using DgradSwigluGemm = std::conditional_t<
    kBlockN == 128,
    GroupedGemm<sm90::PoolRowsA, sm90::WeightsTransposedB<128>, sm90::RowTileScheduler,
                sm90::DgradSwiGLUEpilogue<128, kClamp, 128>, sm90::PingPongConsumers>,
    GroupedGemm<sm90::PoolRowsA, sm90::WeightsTransposedB<kBlockN>, sm90::RowTileScheduler,
                sm90::DgradSwiGLUEpilogue<kBlockN, kClamp>>>;
template <RowDestination kDest>
using DgradScatterGemm = GroupedGemm<sm90::PoolRowsA, sm90::WeightsTransposedB<256>, sm90::RowTileScheduler,
                                     sm90::RowStoreEpilogue<256, false, kDest>>;
template <RowDestination kDest>
using SeparateDgradScatterGemm = GroupedGemm<sm90::PoolRowsA, sm90::SeparateWeightsTransposedB<256>,
                                             sm90::RowTileScheduler, sm90::RowStoreEpilogue<256, false, kDest>>;
template <bool kFp32, bool kAccumulate>
using WeightGradGemm = GroupedGemm<sm90::PoolRowsTransposedA, sm90::PoolRowsTransposedB<256>,
                                   sm90::ExpertOutputTileScheduler, sm90::WeightGradEpilogue<kFp32, kAccumulate>>;

template <int kBlockN, bool kClamp>
void launch_dgrad_swiglu(const Sm90DgradSwigluParams& p) {
  using Gemm = DgradSwigluGemm<kBlockN, kClamp>;
  const Sm90Rows& rows = p.rows;
  // a = dys W2_e: w2 [E, H, I] read as [E*H rows, I] in N-major boxes [64 k][64 n].
  sm90::launch_pool_rows_gemm<Gemm>(WaitKernel::kDgradSwiglu, rows, p.dys, rows.hidden, p.w2, rows.hidden,
                                    rows.intermediate,
                                    {p.row_slot, p.topk_weights, static_cast<const __nv_bfloat16*>(p.z),
                                     static_cast<__nv_bfloat16*>(p.dz), static_cast<__nv_bfloat16*>(p.wh),
                                     p.router_partials,
                                     static_cast<int32_t>(sm90_dgrad_num_n_tiles(rows.intermediate, kBlockN)),
                                     p.swiglu_clamp},
                                    "dys", "w2");
}

template <bool kFp32, bool kAccumulate>
void launch_weight_grad(const Sm90WeightGradParams& p) {
  using Gemm = WeightGradGemm<kFp32, kAccumulate>;
  const Sm90Rows& rows = p.rows;
  GemmParams<Gemm> params{};
  // Both operands are pool rows read as MN-major boxes [64 rows][64 columns].
  params.a.map = p.act_m_row_stride == 0
                     ? sm90::make_tensor_map_bf16(p.act_m, p.m, rows.max_rows, sm90::kMnBoxRows, "act_m")
                     : sm90::make_tensor_map_bf16_rows(p.act_m, p.m, rows.max_rows, p.act_m_row_stride,
                                                       sm90::kMnBoxRows, "act_m");
  params.map_b = sm90::make_tensor_map_bf16(p.act_n, p.n, rows.max_rows, sm90::kMnBoxRows, "act_n");
  sm90::set_weight_grad_output(params, rows, p.grad, kFp32, p.m, p.n);
  sm90::launch_grouped_gemm(params, rows, WaitKernel::kWeightGrad);
}

}  // namespace

// 256 at every H: the 128 x 256 tile's main loop runs at cuBLAS dense's rate, the 128 x 128 one's
// is held by its feed (docs/experiments.md#dgrad-1-main-loop-and-held-epilogue). The 128-wide
// ping-pong instance stays for callers that ask for it (tests, kernel benchmark).
int sm90_dgrad_block_n(int64_t) { return 256; }

int64_t sm90_dgrad_num_n_tiles(int64_t intermediate, int block_n) {
  FUSEMOE_ASSERT(block_n == 128 || block_n == 256);
  return (intermediate + block_n - 1) / block_n;
}

int64_t sm90_router_partials_per_row(int64_t intermediate) { return sm90_dgrad_num_n_tiles(intermediate, 128); }

void launch_sm90_recompute_z(const Sm90RecomputeZParams& p) {
  const Sm90Rows& rows = p.rows;
  sm90::assert_rows(rows);
  if (rows.max_rows == 0) return;
  FUSEMOE_ASSERT(p.xs && p.w13 && p.z);
  const int64_t F = 2 * rows.intermediate;
  if (p.w3 != nullptr) {
    // The 2I output columns from w1's and w3's I rows per expert.
    sm90::launch_pool_rows_gemm<SeparateRecomputeZGemm>(WaitKernel::kRecomputeZ, rows, p.xs, rows.hidden, p.w13,
                                                        rows.intermediate, F,
                                                        {static_cast<__nv_bfloat16*>(p.z), nullptr, nullptr}, "xs",
                                                        "w1", p.w3, "w3");
    return;
  }
  sm90::launch_pool_rows_gemm<RecomputeZGemm>(WaitKernel::kRecomputeZ, rows, p.xs, rows.hidden, p.w13, F, F,
                                              {static_cast<__nv_bfloat16*>(p.z), nullptr, nullptr}, "xs", "w13");
}

void launch_sm90_dgrad_swiglu(const Sm90DgradSwigluParams& p) {
  sm90::assert_rows(p.rows);
  if (p.rows.max_rows == 0) return;
  FUSEMOE_ASSERT(p.dys && p.w2 && p.z && p.row_slot && p.topk_weights && p.dz && p.wh && p.router_partials);
  FUSEMOE_ASSERT(p.block_n == 128 || p.block_n == 256);
  FUSEMOE_ASSERT(!p.use_swiglu_clamp || p.swiglu_clamp > 0.0f);
  sm90::with_bool_constants(p.block_n == 128, p.use_swiglu_clamp, [&](auto narrow, auto clamp) {
    launch_dgrad_swiglu<decltype(narrow)::value ? 128 : 256, decltype(clamp)::value>(p);
  });
}

void launch_sm90_dgrad_scatter(const Sm90DgradScatterParams& p) {
  const Sm90Rows& rows = p.rows;
  sm90::assert_rows(rows);
  if (rows.max_rows == 0) return;
  FUSEMOE_ASSERT(p.dz && p.w13);
  // dxs = dz W13_e: w13 [E, 2I, H] read as [E*2I rows, H] in N-major boxes.
  const int64_t F = 2 * rows.intermediate;
  if (p.w3 != nullptr) {
    // K = 2I over w1's and w3's I rows per expert.
    sm90::launch_to_slots<SeparateDgradScatterGemm>(WaitKernel::kDgradScatter, rows, p.dz, F, p.w13,
                                                    rows.intermediate, rows.hidden, p.dx_slots, p.row_slot, nullptr,
                                                    p.to_peers, "dz", "w1", p.w3, "w3");
    return;
  }
  sm90::launch_to_slots<DgradScatterGemm>(WaitKernel::kDgradScatter, rows, p.dz, F, p.w13, F, rows.hidden,
                                          p.dx_slots, p.row_slot, nullptr, p.to_peers, "dz", "w13");
}

void launch_sm90_weight_grad(const Sm90WeightGradParams& p) {
  const Sm90Rows& rows = p.rows;
  FUSEMOE_ASSERT(rows.max_rows >= 0 && rows.max_rows < (int64_t{1} << 31));
  FUSEMOE_ASSERT(rows.num_experts >= 1 && rows.num_experts <= sm90::kMaxExperts);
  FUSEMOE_ASSERT(p.m > 0 && p.m % 128 == 0 && p.n > 0 && p.n % 64 == 0 && p.grad != nullptr);
  FUSEMOE_ASSERT(rows.num_experts * p.m < (int64_t{1} << 31));  // TMA row coordinates of grad
  if (sm90::weight_grad_without_rows(rows, p.grad, p.m, p.n, p.bf16_grad, p.accumulate)) return;
  FUSEMOE_ASSERT(p.act_m && p.act_n && rows.expert_offsets);
  sm90::with_bool_constants(!p.bf16_grad, p.accumulate, [&](auto fp32, auto accumulate) {
    launch_weight_grad<decltype(fp32)::value, decltype(accumulate)::value>(p);
  });
}

}  // namespace fusemoe

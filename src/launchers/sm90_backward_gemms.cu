// The backward's instances of the sm90 grouped GEMM (sm90_grouped_gemm.h): z recompute, dgrad +
// SwiGLU backward (tile width over I by shape), dgrad of x into the slot rows, and the weight
// gradients (fp32 or bf16, overwritten or accumulated). Every instance reads x or dy rows in
// place, gathered by the producer threads, except dgrad of x (dz pool). The weight gradients keep
// 64 KB of shared memory for their store staging, which leaves 3 stages of 48 KB.
#include <cuda_bf16.h>

#include "launchers/sm90_launch_gemm.cuh"

namespace fusemoe {
namespace {

using sm90::GroupedGemm;
using sm90::GemmParams;
using sm90::RowDestination;

using RecomputeZGemm = GroupedGemm<sm90::GatheredTokenRowsA, sm90::WeightsB<256>, sm90::RowTileScheduler,
                                   sm90::RowStoreEpilogue<256, false, RowDestination::kSortedRow>>;
template <int kBlockN, bool kClamp>
using DgradSwigluGemm = GroupedGemm<sm90::GatheredTokenRowsA, sm90::WeightsTransposedB<kBlockN>,
                                    sm90::RowTileScheduler, sm90::DgradSwiGLUEpilogue<kBlockN, kClamp>>;
template <RowDestination kDest>
using DgradScatterGemm = GroupedGemm<sm90::PoolRowsA, sm90::WeightsTransposedB<256>, sm90::RowTileScheduler,
                                     sm90::RowStoreEpilogue<256, false, kDest>>;
// dW2 = dy rows^T wh (A gathered) and dW13 = dz^T x rows (B gathered), both 128 x 256 tiles.
template <bool kFp32, bool kAccumulate>
using WeightGradW2Gemm = GroupedGemm<sm90::GatheredTokenRowsTransposedA, sm90::PoolRowsTransposedB<256>,
                                     sm90::ExpertOutputTileScheduler, sm90::WeightGradEpilogue<kFp32, kAccumulate>>;
template <bool kFp32, bool kAccumulate>
using WeightGradW13Gemm = GroupedGemm<sm90::PoolRowsTransposedA, sm90::GatheredTokenRowsTransposedB<256>,
                                      sm90::ExpertOutputTileScheduler, sm90::WeightGradEpilogue<kFp32, kAccumulate>>;

template <int kBlockN, bool kClamp>
void launch_dgrad_swiglu(const Sm90DgradSwigluParams& p) {
  using Gemm = DgradSwigluGemm<kBlockN, kClamp>;
  const Sm90Rows& rows = p.rows;
  // a = dy rows W2_e: w2 [E, H, I] read as [E*H rows, I] in N-major boxes [64 k][64 n].
  sm90::launch_rows_gemm<Gemm>(WaitKernel::kDgradSwiglu, rows, sm90::token_rows_a(p.dy), rows.hidden, p.w2,
                               rows.hidden, rows.intermediate,
                               {p.row_slot, p.topk_weights, static_cast<const __nv_bfloat16*>(p.z),
                                static_cast<__nv_bfloat16*>(p.dz), static_cast<__nv_bfloat16*>(p.wh),
                                p.router_partials,
                                static_cast<int32_t>(sm90_dgrad_num_n_tiles(rows.intermediate, kBlockN)),
                                p.swiglu_clamp},
                               "w2");
}

// grad [E, m, n] is stored as [E*m rows, n] in boxes of [64 rows][128 B], one per consumer
// warpgroup and box column.
template <class Gemm>
void launch_weight_grad(const Sm90WeightGradParams& p, const typename Gemm::A::Args& a,
                        const typename Gemm::B::Args& b, int64_t m, int64_t n) {
  const Sm90Rows& rows = p.rows;
  GemmParams<Gemm> params{};
  params.a = a;
  params.b = b;
  params.epilogue.map =
      sm90::make_store_tensor_map(p.grad, !p.bf16_grad, n, rows.num_experts * m, sm90::kWgmmaM, "grad");
  params.epilogue.grad = p.grad;
  sm90::GemmShape& s = params.shape;
  s.expert_offsets = rows.expert_offsets;
  s.num_experts = static_cast<int32_t>(rows.num_experts);
  s.n_valid = static_cast<int32_t>(n);
  s.m_valid = static_cast<int32_t>(m);
  sm90::launch_grouped_gemm(params, rows, WaitKernel::kWeightGrad);
}

}  // namespace

int sm90_dgrad_block_n(int64_t hidden) { return hidden >= 4096 ? 256 : 128; }

int64_t sm90_dgrad_num_n_tiles(int64_t intermediate, int block_n) {
  FUSEMOE_ASSERT(block_n == 128 || block_n == 256);
  return (intermediate + block_n - 1) / block_n;
}

int64_t sm90_router_partials_per_row(int64_t intermediate) { return sm90_dgrad_num_n_tiles(intermediate, 128); }

void launch_sm90_recompute_z(const Sm90RecomputeZParams& p) {
  const Sm90Rows& rows = p.rows;
  sm90::assert_rows(rows);
  if (rows.max_rows == 0) return;
  FUSEMOE_ASSERT(p.w13 && p.z);
  const int64_t F = 2 * rows.intermediate;
  sm90::launch_rows_gemm<RecomputeZGemm>(WaitKernel::kRecomputeZ, rows, sm90::token_rows_a(p.x), rows.hidden, p.w13,
                                         F, F, {static_cast<__nv_bfloat16*>(p.z), nullptr, nullptr}, "w13");
}

void launch_sm90_dgrad_swiglu(const Sm90DgradSwigluParams& p) {
  sm90::assert_rows(p.rows);
  if (p.rows.max_rows == 0) return;
  FUSEMOE_ASSERT(p.w2 && p.z && p.row_slot && p.topk_weights && p.dz && p.wh && p.router_partials);
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
  sm90::launch_to_slots<DgradScatterGemm>(WaitKernel::kDgradScatter, rows, p.dz, F, p.w13, F, rows.hidden,
                                          p.dx_slots, p.row_slot, nullptr, p.to_peers, "dz", "w13");
}

void launch_sm90_weight_grad(const Sm90WeightGradParams& p) {
  const Sm90Rows& rows = p.rows;
  const bool w2 = p.which == Sm90WeightGrad::kW2;
  const int64_t m = w2 ? rows.hidden : 2 * rows.intermediate, n = w2 ? rows.intermediate : rows.hidden;
  FUSEMOE_ASSERT(rows.max_rows >= 0 && rows.max_rows < (int64_t{1} << 31));
  FUSEMOE_ASSERT(rows.num_experts >= 1 && rows.num_experts <= sm90::kMaxExperts);
  FUSEMOE_ASSERT(rows.hidden > 0 && rows.hidden % 128 == 0 && rows.intermediate > 0 && rows.intermediate % 64 == 0);
  FUSEMOE_ASSERT(p.grad != nullptr);
  FUSEMOE_ASSERT(rows.num_experts * m < (int64_t{1} << 31));  // TMA row coordinates of grad
  if (rows.max_rows == 0) {  // every expert is empty
    if (!p.accumulate) {
      FUSEMOE_CUDA_CHECK(cudaMemsetAsync(p.grad, 0, rows.num_experts * m * n * (p.bf16_grad ? 2 : 4), rows.stream));
    }
    return;
  }
  FUSEMOE_ASSERT(p.pool && p.tokens.x && p.tokens.row_slot && p.tokens.top_k >= 1 && rows.expert_offsets);
  // The token rows are H long (dy and x); the pool is read in MN-major boxes [64 rows][64 columns].
  const sm90::TokenRowsArgs tokens{static_cast<const __nv_bfloat16*>(p.tokens.x), p.tokens.row_slot,
                                   static_cast<int32_t>(p.tokens.top_k), static_cast<int32_t>(rows.hidden / 8)};
  const CUtensorMap pool =
      sm90::make_tensor_map_bf16(p.pool, w2 ? n : m, rows.max_rows, sm90::kMnBoxRows, w2 ? "wh" : "dz");
  sm90::with_bool_constants(!p.bf16_grad, p.accumulate, [&](auto fp32, auto accumulate) {
    constexpr bool kFp32 = decltype(fp32)::value, kAccumulate = decltype(accumulate)::value;
    if (w2) {
      launch_weight_grad<WeightGradW2Gemm<kFp32, kAccumulate>>(p, tokens, {pool}, m, n);
    } else {
      launch_weight_grad<WeightGradW13Gemm<kFp32, kAccumulate>>(p, {pool}, tokens, m, n);
    }
  });
}

}  // namespace fusemoe

// The block-scaled FP8 instances of the sm90 grouped GEMM (sm90_fp8_gemms.h): 128 x 256 tiles in
// 4 stages of 48 KB (gate/up: gate 128 | up 128 columns, one 128-block of h per tile; down, z
// recompute, dgrad-SwiGLU, dgrad of x). Weight scales are the [E, rows/128, cols/128] arrays of
// Fp8Weights; a transposed copy reads them with swapped strides.
#include <cuda_bf16.h>

#include "device/sm90_fp8_epilogues.cuh"
#include "launchers/sm90_fp8_gemms.h"
#include "launchers/sm90_launch_gemm.cuh"

namespace fusemoe {
namespace {

using sm90::GemmParams;
using sm90::GroupedGemm;
using sm90::RowDestination;

// z chunks the dgrad epilogue keeps in flight ahead of their use, of the thread's 16 (two rows,
// two blocks): 2 measured faster than 3 (docs/experiments.md#fp8-dgrad-epilogue-parts).
constexpr int kDgradZAhead = 2;

template <bool kClamp, bool kStoreZ>
using GateUpGemm = GroupedGemm<sm90::Fp8GatheredTokenRowsA, sm90::Fp8GateUpWeightsB, sm90::RowTileScheduler,
                               sm90::SwiGLUFp8Epilogue<kClamp, kStoreZ>>;
// The row-store GEMMs at N = 256 (as their BF16 twins): each A tile serves twice the columns. The
// slot-row ones write this rank's slots (kSlotRow) or, in the expert-parallel layer, the source
// ranks' (kPeerSlot); block-scaled instances take the static tile order, as the EP layer needs.
template <RowDestination kDest>
using DownGemm = GroupedGemm<sm90::Fp8PoolRowsA, sm90::Fp8WeightsB<256>, sm90::RowTileScheduler,
                             sm90::RowStoreEpilogue<256, true, kDest>>;
// The z recompute and dgrad + SwiGLU gather their token rows (x, dy) as the gate/up does: each
// token's row is quantized once, not stored to each of its K pool rows.
using RecomputeZGemm = GroupedGemm<sm90::Fp8GatheredTokenRowsA, sm90::Fp8WeightsB<256>, sm90::RowTileScheduler,
                                   sm90::RowStoreEpilogue<256, false, RowDestination::kSortedRow>>;
// A tile's columns are whole 128-blocks of dg and du (the dz quantization).
template <bool kClamp>
using DgradSwigluGemm =
    GroupedGemm<sm90::Fp8GatheredTokenRowsA, sm90::Fp8WeightsB<kSm90Fp8DgradBlockN>, sm90::RowTileScheduler,
                sm90::DgradSwiGLUFp8Epilogue<kClamp, kDgradZAhead, kSm90Fp8DgradBlockN>>;
template <RowDestination kDest>
using DgradScatterGemm = GroupedGemm<sm90::Fp8PoolRowsA, sm90::Fp8WeightsB<256>, sm90::RowTileScheduler,
                                     sm90::RowStoreEpilogue<256, false, kDest>>;

// Expert-output tiles over token-blocked pools; one staging box per consumer leaves room for the
// scale records beside 4 stages.
template <bool kFp32, bool kAccumulate>
using WeightGradGemm = GroupedGemm<sm90::Fp8TokenBlockedA, sm90::Fp8TokenBlockedB<256>,
                                   sm90::TokenBlockOutputTileScheduler, sm90::Fp8WeightGradEpilogue<kFp32, kAccumulate>>;

static_assert(WeightGradGemm<false, false>::kStages == 4 && WeightGradGemm<true, true>::kStages == 4,
              "FP8 weight-gradient ring depth");
static_assert(GateUpGemm<false, false>::kStages == 4 && DownGemm<RowDestination::kSlotRow>::kStages == 4 &&
                  DgradSwigluGemm<false>::kStages == 4,
              "FP8 ring depth");
static_assert(!DownGemm<RowDestination::kPeerSlot>::kDynamicTiles &&
                  !DgradScatterGemm<RowDestination::kPeerSlot>::kDynamicTiles,
              "the expert-parallel layer's GEMMs take the static tile order (nothing zeroes a tile counter)");

// A row-tile GEMM over K (a multiple of 128) with N output columns.
sm90::GemmShape fp8_rows_shape(const Sm90Rows& rows, int64_t k, int64_t n, int64_t b_rows_per_expert) {
  return sm90::rows_shape(rows, k, n, b_rows_per_expert, sm90::kFp8BlockK);
}

// Scales of a weight stored as [E, rows/128, cols/128], read as the B operand [N = rows, K = cols]
// (transposed = false) or through its transpose [N = cols, K = rows] (transposed = true).
sm90::WeightScales weight_scales(const float* scales, int64_t E_rows, int64_t E_cols, bool transposed,
                                 int64_t second = 0) {
  const int32_t row_blocks = static_cast<int32_t>(E_rows / 128), col_blocks = static_cast<int32_t>(E_cols / 128);
  sm90::WeightScales w{};
  w.ptr = scales;
  w.expert_stride = row_blocks * col_blocks;
  w.n_stride = transposed ? 1 : col_blocks;
  w.k_stride = transposed ? col_blocks : 1;
  w.second = static_cast<int32_t>(second);
  w.n_blocks = transposed ? col_blocks : row_blocks;
  return w;
}

// The A operand of a pool: E4M3 rows [R_max, K] and their block-major scales [K/128, rows_pad].
sm90::Fp8PoolRowsA::Args pool_a(const Sm90Rows& rows, const void* pool, const float* scales, int64_t k,
                                const sm90::WeightScales& b_scales, const char* name) {
  sm90::Fp8PoolRowsA::Args a{};
  a.map = sm90::make_tensor_map_fp8(pool, k, rows.max_rows, sm90::kBlockM, name);
  a.quarter = sm90::make_tensor_map_fp8(pool, k, rows.max_rows, sm90::kQuarterRows, name);
  a.scales = scales;
  a.rows_pad = static_cast<int32_t>(sm90_fp8_rows_pad(rows.max_rows));
  a.b_scales = b_scales;
  return a;
}

void assert_fp8_rows(const Sm90Rows& rows) {
  sm90::assert_rows(rows);
  FUSEMOE_ASSERT(rows.intermediate % 128 == 0);
}

// The A operand of gathered token rows: E4M3 [T, K] and their token-major scales [T, K/128].
sm90::Fp8GatheredTokenRowsA::Args token_rows_a(const void* rows_fp8, const float* scales, const int32_t* row_slot,
                                               int64_t top_k, const sm90::WeightScales& b_scales) {
  sm90::Fp8GatheredTokenRowsA::Args a{};
  a.rows = {static_cast<const __nv_bfloat16*>(rows_fp8), row_slot, static_cast<int32_t>(top_k)};
  a.x_scales = scales;
  a.b_scales = b_scales;
  return a;
}

template <bool kClamp, bool kStoreZ>
void launch_gate_up(const Sm90Fp8GateUpParams& p) {
  using Gemm = GateUpGemm<kClamp, kStoreZ>;
  const Sm90Rows& rows = p.rows;
  const int64_t H = rows.hidden, I = rows.intermediate;
  GemmParams<Gemm> params{};
  params.map_b = sm90::make_tensor_map_fp8(p.weights.w13, H, rows.num_experts * 2 * I, Gemm::B::kBoxRows, "w13_fp8");
  // Gate block n_tile and the up block I/128 below it.
  params.a = token_rows_a(p.x_fp8, p.x_scales, p.row_slot, p.top_k,
                          weight_scales(p.weights.w13_scales, 2 * I, H, false, (I / 128) * (H / 128)));
  params.epilogue.h = static_cast<uint8_t*>(p.h_fp8);
  params.epilogue.h_scales = p.h_scales;
  params.epilogue.rows_pad = static_cast<int32_t>(sm90_fp8_rows_pad(rows.max_rows));
  params.epilogue.z = static_cast<__nv_bfloat16*>(p.z);
  params.epilogue.clamp = p.swiglu_clamp;
  params.shape = fp8_rows_shape(rows, H, I, 2 * I);
  sm90::launch_grouped_gemm(params, rows, WaitKernel::kFp8GateUp);
}

// a: pool_a() or token_rows_a().
template <class Gemm>
void launch_row_store(WaitKernel kernel_name, const Sm90Rows& rows, const typename Gemm::A::Args& a, int64_t k,
                      const void* b, int64_t b_rows_per_expert, int64_t n,
                      const typename Gemm::Epilogue::Args& epilogue, const char* b_name) {
  GemmParams<Gemm> params{};
  params.map_b = sm90::make_tensor_map_fp8(b, k, rows.num_experts * b_rows_per_expert, Gemm::B::kBoxRows, b_name);
  params.a = a;
  params.epilogue = epilogue;
  params.shape = fp8_rows_shape(rows, k, n, b_rows_per_expert);
  sm90::launch_grouped_gemm(params, rows, kernel_name);
}

// A slot-row instance (DownGemm, DgradScatterGemm) at the destination the call asks for:
// launch(Gemm) with this rank's slots (kSlotRow) or, with to_peers, the source ranks' (kPeerSlot).
template <template <RowDestination> class SlotGemm, class Launch>
void with_slot_destination(const Sm90PeerRows* to_peers, Launch&& launch) {
  if (to_peers != nullptr) {
    FUSEMOE_ASSERT(to_peers->row_src && to_peers->row_slot);
    launch(SlotGemm<RowDestination::kPeerSlot>{});
  } else {
    launch(SlotGemm<RowDestination::kSlotRow>{});
  }
}

template <bool kClamp>
void launch_dgrad_swiglu(const Sm90Fp8DgradSwigluParams& p) {
  using Gemm = DgradSwigluGemm<kClamp>;
  const Sm90Rows& rows = p.rows;
  const int64_t H = rows.hidden, I = rows.intermediate;
  typename Gemm::Epilogue::Args epilogue{};
  epilogue.row_slot = p.weight_index != nullptr ? p.weight_index : p.row_slot;  // the weight's index only
  epilogue.topk_weights = p.topk_weights;
  epilogue.z = static_cast<const __nv_bfloat16*>(p.z);
  epilogue.dz = static_cast<__nv_bfloat16*>(p.dz);
  epilogue.wh = static_cast<__nv_bfloat16*>(p.wh);
  epilogue.router_partials = p.router_partials;
  epilogue.num_n_tiles = static_cast<int32_t>(sm90_dgrad_num_n_tiles(I, kSm90Fp8DgradBlockN));
  epilogue.clamp = p.swiglu_clamp;
  epilogue.dz_fp8 = static_cast<uint8_t*>(p.dz_fp8);
  epilogue.dz_scales = p.dz_scales;
  epilogue.rows_pad = static_cast<int32_t>(sm90_fp8_rows_pad(rows.max_rows));
  // a = dy W2_e: B = W2_e^T [I, H] (K = H), i.e. w2_t; its (n = i, kb = h) block is w2's (h, i).
  launch_row_store<Gemm>(WaitKernel::kFp8DgradSwiglu, rows,
                         token_rows_a(p.dy_fp8, p.dy_scales, p.row_slot, p.top_k,
                                      weight_scales(p.weights.w2_scales, H, I, true)),
                         H, p.weights.w2_t, I, I, epilogue, "w2_t_fp8");
}

template <bool kFp32, bool kAccumulate>
void launch_weight_grad(const Sm90Fp8WeightGradParams& p) {
  using Gemm = WeightGradGemm<kFp32, kAccumulate>;
  const Sm90Rows& rows = p.rows;
  const int64_t positions = rows.max_rows;
  GemmParams<Gemm> params{};
  // Token-blocked pools [P/128][rows][128 positions] read as [P/128 * rows, 128] (sm90_block_scaled.cuh).
  params.a.map = sm90::make_tensor_map_fp8(p.a, 128, positions / 128 * p.a_rows, sm90::kBlockM, "a (token-blocked)");
  params.a.scales = p.a_scales;
  params.a.rows = static_cast<int32_t>(p.a_rows);
  params.a.row0 = static_cast<int32_t>(p.a_row0);
  params.a.b_scales = {p.b_scales, static_cast<int32_t>((p.n + 127) / 128)};
  params.map_b = sm90::make_tensor_map_fp8(p.b, 128, positions / 128 * p.n, Gemm::B::kBoxRows, "b (token-blocked)");
  sm90::set_weight_grad_output(params, rows, p.grad, kFp32, p.m, p.n);  // the padded offsets: rows.expert_offsets
  sm90::launch_grouped_gemm(params, rows, WaitKernel::kFp8WeightGrad);
}

}  // namespace

void launch_sm90_fp8_weight_grad(const Sm90Fp8WeightGradParams& p) {
  const Sm90Rows& rows = p.rows;
  FUSEMOE_ASSERT(rows.max_rows >= 0 && rows.max_rows % 128 == 0 && rows.max_rows < (int64_t{1} << 31));
  FUSEMOE_ASSERT(rows.num_experts >= 1 && rows.num_experts <= sm90::kMaxExperts);
  FUSEMOE_ASSERT(p.m > 0 && p.m % 128 == 0 && p.n > 0 && p.n % 128 == 0 && p.grad != nullptr);
  FUSEMOE_ASSERT(p.a_rows % 128 == 0 && p.a_row0 % 128 == 0 && p.a_row0 + p.m <= p.a_rows);
  FUSEMOE_ASSERT(rows.num_experts * p.m < (int64_t{1} << 31));  // TMA row coordinates of grad
  if (sm90::weight_grad_without_rows(rows, p.grad, p.m, p.n, p.bf16_grad, p.accumulate)) return;  // no positions
  FUSEMOE_ASSERT(p.a && p.a_scales && p.b && p.b_scales && rows.expert_offsets);
  sm90::with_bool_constants(!p.bf16_grad, p.accumulate, [&](auto fp32, auto accumulate) {
    launch_weight_grad<decltype(fp32)::value, decltype(accumulate)::value>(p);
  });
}

void launch_sm90_fp8_gate_up_swiglu(const Sm90Fp8GateUpParams& p) {
  assert_fp8_rows(p.rows);
  if (p.rows.max_rows == 0) return;
  FUSEMOE_ASSERT(p.x_fp8 && p.x_scales && p.row_slot && p.weights.w13 && p.weights.w13_scales && p.h_fp8 &&
                 p.h_scales && p.top_k >= 1);
  FUSEMOE_ASSERT(!p.use_swiglu_clamp || p.swiglu_clamp > 0.0f);
  sm90::with_bool_constants(p.use_swiglu_clamp, p.z != nullptr, [&](auto clamp, auto store_z) {
    launch_gate_up<decltype(clamp)::value, decltype(store_z)::value>(p);
  });
}

void launch_sm90_fp8_down_weighted(const Sm90Fp8DownParams& p) {
  const Sm90Rows& rows = p.rows;
  assert_fp8_rows(rows);
  if (rows.max_rows == 0) return;
  FUSEMOE_ASSERT(p.h_fp8 && p.h_scales && p.weights.w2 && p.weights.w2_scales);
  FUSEMOE_ASSERT(p.to_peers != nullptr ? p.to_peers->row_weight != nullptr
                                       : (p.row_slot && p.topk_weights && p.ys));
  const int64_t H = rows.hidden, I = rows.intermediate;
  const sm90::Fp8PoolRowsA::Args a =
      pool_a(rows, p.h_fp8, p.h_scales, I, weight_scales(p.weights.w2_scales, H, I, false), "h_fp8");
  with_slot_destination<DownGemm>(p.to_peers, [&](auto gemm) {
    using Gemm = decltype(gemm);
    launch_row_store<Gemm>(WaitKernel::kFp8Down, rows, a, I, p.weights.w2, H, H,
                           sm90::slot_store_args<typename Gemm::Epilogue>(p.ys, p.row_slot, p.topk_weights, p.to_peers),
                           "w2_fp8");
  });
}

void launch_sm90_fp8_recompute_z(const Sm90Fp8RecomputeZParams& p) {
  const Sm90Rows& rows = p.rows;
  assert_fp8_rows(rows);
  if (rows.max_rows == 0) return;
  FUSEMOE_ASSERT(p.x_fp8 && p.x_scales && p.row_slot && p.top_k >= 1 && p.weights.w13 && p.weights.w13_scales &&
                 p.z);
  const int64_t H = rows.hidden, I = rows.intermediate;
  launch_row_store<RecomputeZGemm>(WaitKernel::kFp8RecomputeZ, rows,
                                   token_rows_a(p.x_fp8, p.x_scales, p.row_slot, p.top_k,
                                                weight_scales(p.weights.w13_scales, 2 * I, H, false)),
                                   H, p.weights.w13, 2 * I, 2 * I, {static_cast<__nv_bfloat16*>(p.z), nullptr, nullptr},
                                   "w13_fp8");
}

void launch_sm90_fp8_dgrad_swiglu(const Sm90Fp8DgradSwigluParams& p) {
  assert_fp8_rows(p.rows);
  if (p.rows.max_rows == 0) return;
  FUSEMOE_ASSERT(p.dy_fp8 && p.dy_scales && p.top_k >= 1 && p.weights.w2_t && p.weights.w2_scales && p.z &&
                 p.row_slot && p.topk_weights && p.dz && p.wh && p.router_partials && p.dz_fp8 && p.dz_scales);
  FUSEMOE_ASSERT(!p.use_swiglu_clamp || p.swiglu_clamp > 0.0f);
  p.use_swiglu_clamp ? launch_dgrad_swiglu<true>(p) : launch_dgrad_swiglu<false>(p);
}

void launch_sm90_fp8_dgrad_scatter(const Sm90Fp8DgradScatterParams& p) {
  const Sm90Rows& rows = p.rows;
  assert_fp8_rows(rows);
  if (rows.max_rows == 0) return;
  FUSEMOE_ASSERT(p.dz_fp8 && p.dz_scales && p.weights.w13_t && p.weights.w13_scales);
  FUSEMOE_ASSERT(p.to_peers != nullptr || (p.row_slot && p.dx_slots));
  const int64_t H = rows.hidden, I = rows.intermediate;
  // dxs = dz W13_e: B = W13_e^T [H, 2I] (K = 2I), i.e. w13_t; its (n = h, kb = f) block is w13's (f, h).
  const sm90::Fp8PoolRowsA::Args a =
      pool_a(rows, p.dz_fp8, p.dz_scales, 2 * I, weight_scales(p.weights.w13_scales, 2 * I, H, true), "dz_fp8");
  with_slot_destination<DgradScatterGemm>(p.to_peers, [&](auto gemm) {
    using Gemm = decltype(gemm);
    launch_row_store<Gemm>(WaitKernel::kFp8DgradScatter, rows, a, 2 * I, p.weights.w13_t, H, H,
                           sm90::slot_store_args<typename Gemm::Epilogue>(p.dx_slots, p.row_slot, nullptr, p.to_peers),
                           "w13_t_fp8");
  });
}

}  // namespace fusemoe

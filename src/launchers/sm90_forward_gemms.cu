// The forward's instances of the sm90 grouped GEMM (sm90_grouped_gemm.h): gate/up + SwiGLU with
// the token rows gathered inside the kernel (no pool), and down + routing weight into the slot
// rows. Both use 128 x 256 tiles (gate/up: 128 gate + 128 up weight rows) and 4 stages of 48 KB.
// Gate/up reads w13 through one tensor map, or separate w1 and w3 through two (the same tiles).
// Each has a static and a dynamic tile order instance; a rows problem with a tile counter takes
// the dynamic one (sm90_forward_dynamic_tile_order).
#include <cuda_bf16.h>

#include "launchers/sm90_launch_gemm.cuh"

namespace fusemoe {
namespace {

using sm90::GroupedGemm;
using sm90::GemmParams;

constexpr int kBlockN = 256;

template <bool kClamp, bool kStoreZ, class Order>
using GateUpGemm = GroupedGemm<sm90::GatheredTokenRowsA, sm90::GateUpWeightsB<kBlockN>, sm90::RowTileScheduler,
                               sm90::SwiGLUEpilogue<kBlockN, kClamp, kStoreZ>, sm90::CooperativeConsumers, Order>;
template <bool kClamp, bool kStoreZ, class Order>
using SeparateGateUpGemm =
    GroupedGemm<sm90::GatheredTokenRowsA, sm90::SeparateGateUpWeightsB<kBlockN>, sm90::RowTileScheduler,
                sm90::SwiGLUEpilogue<kBlockN, kClamp, kStoreZ>, sm90::CooperativeConsumers, Order>;
template <class Order>
struct DownGemms {
  template <sm90::RowDestination kDest>
  using Gemm = GroupedGemm<sm90::PoolRowsA, sm90::WeightsB<kBlockN>, sm90::RowTileScheduler,
                           sm90::RowStoreEpilogue<kBlockN, true, kDest>, sm90::CooperativeConsumers, Order>;
};

// Calls f(order) with the tile order the rows problem asks for.
template <class F>
void with_tile_order(const Sm90Rows& rows, F&& f) {
  if (rows.tile_counter != nullptr) {
    f(sm90::DynamicTileOrder{});
  } else {
    f(sm90::StaticTileOrder{});
  }
}

template <bool kClamp, bool kStoreZ, class Order>
void launch_gate_up(const Sm90GateUpParams& p) {
  using Gemm = GateUpGemm<kClamp, kStoreZ, Order>;
  const Sm90Rows& rows = p.rows;
  GemmParams<Gemm> params{};
  params.map_b = sm90::make_tensor_map_bf16(p.w13, rows.hidden, rows.num_experts * 2 * rows.intermediate,
                                            Gemm::B::kBoxRows, "w13");
  params.a = {static_cast<const __nv_bfloat16*>(p.x), p.row_slot, static_cast<int32_t>(p.top_k)};
  params.epilogue = {static_cast<__nv_bfloat16*>(p.h), static_cast<__nv_bfloat16*>(p.z), p.swiglu_clamp};
  params.shape = sm90::rows_shape(rows, rows.hidden, rows.intermediate, 2 * rows.intermediate);
  sm90::launch_grouped_gemm(params, rows, WaitKernel::kGateUp);
}

template <bool kClamp, bool kStoreZ, class Order>
void launch_separate_gate_up(const Sm90GateUpParams& p) {
  using Gemm = SeparateGateUpGemm<kClamp, kStoreZ, Order>;
  const Sm90Rows& rows = p.rows;
  const int64_t I = rows.intermediate;
  GemmParams<Gemm> params{};
  params.map_b = sm90::make_tensor_map_bf16(p.w13, rows.hidden, rows.num_experts * I, Gemm::B::kBoxRows, "w1");
  params.map_b_up = sm90::make_tensor_map_bf16(p.w3, rows.hidden, rows.num_experts * I, Gemm::B::kBoxRows, "w3");
  params.a = {static_cast<const __nv_bfloat16*>(p.x), p.row_slot, static_cast<int32_t>(p.top_k)};
  params.epilogue = {static_cast<__nv_bfloat16*>(p.h), static_cast<__nv_bfloat16*>(p.z), p.swiglu_clamp};
  params.shape = sm90::rows_shape(rows, rows.hidden, I, I);
  sm90::launch_grouped_gemm(params, rows, WaitKernel::kGateUp);
}

}  // namespace

void launch_sm90_gate_up_swiglu(const Sm90GateUpParams& p) {
  sm90::assert_rows(p.rows);
  if (p.rows.max_rows == 0) return;
  FUSEMOE_ASSERT(p.x && p.row_slot && p.w13 && p.h && p.top_k >= 1);
  FUSEMOE_ASSERT(!p.use_swiglu_clamp || p.swiglu_clamp > 0.0f);
  sm90::with_bool_constants(p.use_swiglu_clamp, p.z != nullptr, [&](auto clamp, auto store_z) {
    with_tile_order(p.rows, [&](auto order) {
      using Order = decltype(order);
      if (p.w3 != nullptr) {
        launch_separate_gate_up<decltype(clamp)::value, decltype(store_z)::value, Order>(p);
      } else {
        launch_gate_up<decltype(clamp)::value, decltype(store_z)::value, Order>(p);
      }
    });
  });
}

void launch_sm90_down_weighted(const Sm90DownParams& p) {
  const Sm90Rows& rows = p.rows;
  sm90::assert_rows(rows);
  if (rows.max_rows == 0) return;
  FUSEMOE_ASSERT(p.h && p.w2);
  FUSEMOE_ASSERT(p.to_peers != nullptr ? p.to_peers->row_weight != nullptr : p.topk_weights != nullptr);
  with_tile_order(rows, [&](auto order) {
    sm90::launch_to_slots<DownGemms<decltype(order)>::template Gemm>(WaitKernel::kDown, rows, p.h, rows.intermediate,
                                                                     p.w2, rows.hidden, rows.hidden, p.ys, p.row_slot,
                                                                     p.topk_weights, p.to_peers, "h", "w2");
  });
}

}  // namespace fusemoe

// Argument checks of the sm90 kernel launchers that run before any device work, so they are
// checked here without a GPU: the shape rules they derive (dgrad tile width, row blocks) and
// the errors for bad or inconsistent arguments, each naming what is wrong.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>

#include "expect_error.h"
#include "kernels/sm90_moe_backward_gemm.h"
#include "kernels/sm90_moe_gemm.h"

namespace fusemoe {
namespace {

TEST(LauncherShapes, DgradTileWidthFollowsHidden) {
  EXPECT_EQ(sm90_dgrad_swiglu_block_n(4096), 256);  // Qwen3-235B-A22B
  EXPECT_EQ(sm90_dgrad_swiglu_block_n(2048), 128);  // Qwen3-30B-A3B
  EXPECT_EQ(sm90_dgrad_swiglu_block_n(2048, 256), 256);  // an explicit width wins
  EXPECT_EQ(sm90_dgrad_swiglu_block_n(8192, 128), 128);
  expect_error_mentioning([] { sm90_dgrad_swiglu_block_n(2048, 64); }, "block_n");
}

TEST(LauncherShapes, DgradTilesCoverIntermediate) {
  EXPECT_EQ(sm90_dgrad_swiglu_num_n_tiles(768, 128), 6);
  EXPECT_EQ(sm90_dgrad_swiglu_num_n_tiles(768, 256), 3);
  EXPECT_EQ(sm90_dgrad_swiglu_num_n_tiles(1536, 256), 6);
  EXPECT_EQ(sm90_dgrad_swiglu_num_n_tiles(192, 128), 2);  // partial last tile
  // 128 gives the most tiles: buffers sized with it serve either width.
  for (int64_t I = 64; I <= 4096; I += 64) {
    EXPECT_GE(sm90_dgrad_swiglu_num_n_tiles(I, 128), sm90_dgrad_swiglu_num_n_tiles(I, 256));
  }
  expect_error_mentioning([] { sm90_dgrad_swiglu_num_n_tiles(768, 0); }, "block_n");
}

TEST(LauncherShapes, ForwardRowBlocksBoundEveryRouting) {
  // Each non-empty expert adds at most one partial block beyond R / 128.
  EXPECT_EQ(sm90_forward_row_blocks(1000, 8), 8 + 8);
  EXPECT_EQ(sm90_forward_row_blocks(0, 8), 8);
  EXPECT_EQ(sm90_forward_row_blocks(131072, 128), 1024 + 128);
}

// A consistent pair of forward GEMM params (pointers only need to be non-null and aligned for
// the checks that run before the device is touched; max_rows 0 launches nothing).
struct ForwardPair {
  alignas(16) char dummy[64];
  Sm90GateUpParams gate_up;
  Sm90DownParams down;
  ForwardPair() {
    void* p = dummy;
    gate_up.xs = p;
    gate_up.w13 = p;
    gate_up.h = p;
    gate_up.expert_offsets = reinterpret_cast<const int32_t*>(p);
    gate_up.max_rows = 0;
    gate_up.hidden = 256;
    gate_up.intermediate = 128;
    gate_up.num_experts = 8;
    down.h = p;
    down.w2 = p;
    down.ys = p;
    down.expert_offsets = gate_up.expert_offsets;
    down.row_slot = reinterpret_cast<const int32_t*>(p);
    down.topk_weights = reinterpret_cast<const float*>(p);
    down.max_rows = 0;
    down.hidden = 256;
    down.intermediate = 128;
    down.num_experts = 8;
  }
};

TEST(LauncherValidation, OneLaunchForwardNeedsOneLayer) {
  {
    ForwardPair f;
    EXPECT_NO_THROW(launch_sm90_forward_gemms(f.gate_up, f.down, nullptr));  // no rows: nothing to do
  }
  {
    ForwardPair f;
    f.down.hidden = 512;
    expect_error_mentioning([&] { launch_sm90_forward_gemms(f.gate_up, f.down, nullptr); }, "same max_rows, hidden");
  }
  {
    ForwardPair f;
    f.down.h = f.dummy + 16;
    expect_error_mentioning([&] { launch_sm90_forward_gemms(f.gate_up, f.down, nullptr); }, "share expert_offsets and h");
  }
  {
    ForwardPair f;
    f.down.num_sms = 66;
    expect_error_mentioning([&] { launch_sm90_forward_gemms(f.gate_up, f.down, nullptr); }, "num_sms and stream");
  }
  {
    ForwardPair f;
    f.down.block_n = 128;
    expect_error_mentioning([&] { launch_sm90_forward_gemms(f.gate_up, f.down, nullptr); }, "down.block_n");
  }
  {
    ForwardPair f;
    f.gate_up.xs = nullptr;  // neither a pool nor row sources
    expect_error_mentioning([&] { launch_sm90_forward_gemms(f.gate_up, f.down, nullptr); }, "row sources");
  }
  {
    ForwardPair f;
    f.gate_up.max_rows = f.down.max_rows = 1000;  // rows to compute: the counters are required
    expect_error_mentioning([&] { launch_sm90_forward_gemms(f.gate_up, f.down, nullptr); }, "h_ready");
  }
}

TEST(LauncherValidation, WeightGradRowCoordinatesFitTma) {
  alignas(16) char dummy[64];
  Sm90WeightGradParams p;
  p.grad = dummy;
  p.m = int64_t{1} << 24;  // E * M rows of the output map exceed int32
  p.n = 256;
  p.num_experts = 1024;
  expect_error_mentioning([&] { launch_sm90_weight_grad(p); }, "num_experts * m");
  p.m = 100;
  expect_error_mentioning([&] { launch_sm90_weight_grad(p); }, "m must be a positive multiple of 128");
}

}  // namespace
}  // namespace fusemoe

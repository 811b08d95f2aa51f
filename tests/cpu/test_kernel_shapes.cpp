// The sizes the sm90 GEMM family exports to its callers (src/launchers/sm90_grouped_gemm.h),
// checked without a GPU: the dgrad tile width and the router-partials buffer that
// serves every width, BF16 and FP8.
#include <gtest/gtest.h>

#include "launchers/sm90_fp8_gemms.h"
#include "launchers/sm90_grouped_gemm.h"

namespace fusemoe {
namespace {

TEST(KernelShapes, DgradTileIs256WideAtEveryHidden) {
  EXPECT_EQ(sm90_dgrad_block_n(4096), 256);  // Qwen3-235B-A22B
  EXPECT_EQ(sm90_dgrad_block_n(7168), 256);  // DeepSeek-V3
  EXPECT_EQ(sm90_dgrad_block_n(2048), 256);  // Qwen3-30B-A3B, qwen3-next
  EXPECT_EQ(sm90_dgrad_block_n(128), 256);
}

TEST(KernelShapes, DgradTilesCoverIntermediate) {
  EXPECT_EQ(sm90_dgrad_num_n_tiles(768, 128), 6);
  EXPECT_EQ(sm90_dgrad_num_n_tiles(768, 256), 3);
  EXPECT_EQ(sm90_dgrad_num_n_tiles(1536, 256), 6);
  EXPECT_EQ(sm90_dgrad_num_n_tiles(192, 128), 2);  // partial last tile
  EXPECT_EQ(sm90_dgrad_num_n_tiles(64, 256), 1);
}

TEST(KernelShapes, RouterPartialsServeEveryWidth) {
  for (int64_t intermediate : {64, 192, 512, 768, 1536, 2048, 4096}) {
    for (int64_t hidden : {2048, 4096, 7168}) {
      EXPECT_GE(sm90_router_partials_per_row(intermediate),
                sm90_dgrad_num_n_tiles(intermediate, sm90_dgrad_block_n(hidden)))
          << "I=" << intermediate << " H=" << hidden;
    }
  }
}

// The FP8 dgrad-SwiGLU writes ceil(I / kSm90Fp8DgradBlockN) partials per row into the same buffer
// (its I is a multiple of 128; with I / 128 odd the last tile holds one block).
TEST(KernelShapes, RouterPartialsServeTheFp8Dgrad) {
  for (int64_t intermediate : {128, 384, 640, 768, 1536, 2048}) {
    const int64_t tiles = sm90_dgrad_num_n_tiles(intermediate, kSm90Fp8DgradBlockN);
    EXPECT_EQ(tiles, (intermediate + kSm90Fp8DgradBlockN - 1) / kSm90Fp8DgradBlockN) << "I=" << intermediate;
    EXPECT_GE(sm90_router_partials_per_row(intermediate), tiles) << "I=" << intermediate;
  }
}

}  // namespace
}  // namespace fusemoe

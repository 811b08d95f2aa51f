// fusemoe_bench --kernel-times without a GPU: the summary of kernel records per pass
// (bench/kernel_times.h) and the short kernel names its table prints (the flag: test_bench_options).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "bench/kernel_times.h"

namespace fusemoe::bench {
namespace {

// A record of `us` microseconds starting at `at` us.
KernelRecord record(uint64_t tag, double at, double us, const char* name) {
  return {tag, static_cast<uint64_t>(at * 1e3), static_cast<uint64_t>((at + us) * 1e3), name};
}

// Three calls of the same two kernels (records out of order, another pass's call mixed in): per
// position medians, min and max; the sums' and spans' medians.
TEST(KernelTimes, SameSequencePerPosition) {
  const std::vector<KernelRecord> records = {
      record(2, 110, 12, "b"), record(1, 0, 5, "a"),   record(1, 10, 10, "b"), record(2, 100, 6, "a"),
      record(3, 200, 7, "a"),  record(3, 212, 14, "b"), record(9, 50, 1000, "a")};
  const PassKernels pass = summarize_pass(records, {1, 2, 3});
  EXPECT_EQ(pass.calls, 3);
  EXPECT_TRUE(pass.note.empty());
  ASSERT_EQ(pass.kernels.size(), 2u);
  EXPECT_EQ(pass.kernels[0].name, "a");
  EXPECT_NEAR(pass.kernels[0].median_us, 6.0, 1e-9);
  EXPECT_NEAR(pass.kernels[0].min_us, 5.0, 1e-9);
  EXPECT_NEAR(pass.kernels[0].max_us, 7.0, 1e-9);
  EXPECT_EQ(pass.kernels[1].name, "b");
  EXPECT_NEAR(pass.kernels[1].median_us, 12.0, 1e-9);
  EXPECT_NEAR(pass.kernels_median_us, 18.0, 1e-9);  // sums 15, 18, 21
  EXPECT_NEAR(pass.span_median_us, 22.0, 1e-9);     // spans 20, 22, 26
  // Before call 2 (at 100) the last end is call 1's 20, before call 3 (at 200) call 2's 122; call
  // 1 has nothing before it. The other record (50 to 1050) ends after both.
  EXPECT_NEAR(pass.gap_before_median_us, 79.0, 1e-9);  // gaps 80, 78
  EXPECT_EQ(pass.event_median_us, 0.0);                 // set by the traced loop, not from records
}

// Calls whose kernel sequences differ: grouped by name, each time a call's sum; a call with no
// kernels counts as zero, not as absent.
TEST(KernelTimes, DifferentSequencesGroupByName) {
  const std::vector<KernelRecord> records = {record(1, 0, 4, "a"), record(1, 5, 2, "a"), record(1, 8, 3, "b"),
                                             record(2, 20, 5, "a"), record(2, 26, 3, "b")};
  const PassKernels pass = summarize_pass(records, {1, 2, 3});
  EXPECT_FALSE(pass.note.empty());
  ASSERT_EQ(pass.kernels.size(), 2u);
  EXPECT_EQ(pass.kernels[0].name, "a");
  EXPECT_NEAR(pass.kernels[0].median_us, 5.0, 1e-9);  // call sums 6, 5, 0
  EXPECT_EQ(pass.kernels[0].count, 1);                // 3 executions over 3 calls
  EXPECT_NEAR(pass.kernels[1].median_us, 3.0, 1e-9);  // 3, 3, 0
  EXPECT_NEAR(pass.kernels_median_us, 8.0, 1e-9);     // 9, 8, 0
}

TEST(KernelTimes, NoRecordsGiveZeros) {
  const PassKernels pass = summarize_pass({}, {4, 5});
  EXPECT_EQ(pass.calls, 2);
  EXPECT_TRUE(pass.kernels.empty());
  EXPECT_EQ(pass.kernels_median_us, 0.0);
  EXPECT_EQ(pass.gap_before_median_us, 0.0);
}

// The grouped GEMM's instances by their epilogue; other kernels by their unqualified name.
TEST(KernelTimes, ShortNames) {
  EXPECT_EQ(short_kernel_name("void fusemoe::sm90::sm90_grouped_gemm_kernel<fusemoe::sm90::GroupedGemm<"
                              "fusemoe::sm90::PoolRowsA, fusemoe::sm90::WeightsTransposedB<128>, "
                              "fusemoe::sm90::RowTileScheduler, "
                              "fusemoe::sm90::DgradSwiGLUEpilogue<128, false, 128>, "
                              "fusemoe::sm90::PingPongConsumers, fusemoe::sm90::StaticTileOrder> >"
                              "(fusemoe::sm90::GemmParams<fusemoe::sm90::GroupedGemm<int> > const)"),
            "gemm DgradSwiGLUEpilogue<128, false, 128>");
  EXPECT_EQ(short_kernel_name("void fusemoe::sm90::sm90_grouped_gemm_kernel<fusemoe::sm90::GroupedGemm<"
                              "fusemoe::sm90::PoolRowsA, fusemoe::sm90::WeightsB<256>, "
                              "fusemoe::sm90::RowTileScheduler, "
                              "fusemoe::sm90::RowStoreEpilogue<256, true, (fusemoe::sm90::RowDestination)1>, "
                              "fusemoe::sm90::CooperativeConsumers, fusemoe::sm90::StaticTileOrder> >(int)"),
            "gemm RowStoreEpilogue<256, true, (RowDestination)1>");
  EXPECT_EQ(
      short_kernel_name("fusemoe::(anonymous namespace)::routing_count_kernel(int const*, long, int, int*, int*)"),
      "routing_count_kernel");
  EXPECT_EQ(short_kernel_name("void fusemoe::(anonymous namespace)::combine_slots_kernel<8>(int)"),
            "combine_slots_kernel");
  EXPECT_EQ(short_kernel_name("plain_c_kernel"), "plain_c_kernel");
}

}  // namespace
}  // namespace fusemoe::bench

// The named routings of tests/common/routing.h that the GPU suites and the benchmarks draw
// from, checked on the host: each routing has the property its name promises, the draws
// depend on the seed alone, and the expert sort is the stable counting sort the device
// routing performs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <vector>

#include "common/routing.h"

namespace fusemoe::harness {
namespace {

constexpr int64_t kT = 1000, kE = 16, kK = 4;

TEST(RoutingGenerator, NamedRoutingsKeepTheirPromise) {
  for (Routing routing : kAllRoutings) {
    SCOPED_TRACE(routing_name(routing));
    const TopK topk = make_topk(kT, kE, kK, routing, 5);
    ASSERT_EQ(topk.idx_TK.size(), static_cast<size_t>(kT * kK));
    int64_t masked = 0;
    for (int64_t t = 0; t < kT; ++t) {
      std::set<int32_t> seen;
      float weight_sum = 0.0f;
      for (int64_t j = 0; j < kK; ++j) {
        const int32_t e = topk.idx_TK[t * kK + j];
        const float w = topk.w_TK[t * kK + j];
        EXPECT_TRUE(w > 0.0f && w <= 1.0f) << "token " << t << " weight " << w;
        weight_sum += w;
        ASSERT_GE(e, -1);
        ASSERT_LT(e, kE);
        masked += e < 0;
        if (e >= 0) seen.insert(e);
        switch (routing) {
          case Routing::kOneExpert: EXPECT_EQ(e == 3, j == 0); break;
          case Routing::kAllSlotsOne: EXPECT_EQ(e, 3); break;
          case Routing::kFewExperts: EXPECT_EQ(e, j % 2 == 0 ? 1 : kE - 2); break;
          default: break;
        }
      }
      EXPECT_NEAR(weight_sum, 1.0f, 1e-5f);
      const bool distinct = routing != Routing::kAllSlotsOne && routing != Routing::kFewExperts;
      if (distinct) {
        int64_t valid = 0;
        for (int64_t j = 0; j < kK; ++j) valid += topk.idx_TK[t * kK + j] >= 0;
        EXPECT_EQ(static_cast<int64_t>(seen.size()), valid) << "token " << t << " repeats an expert";
      }
      if (routing == Routing::kMasked && t % 5 == 0) {
        for (int64_t j = 0; j < kK; ++j) EXPECT_EQ(topk.idx_TK[t * kK + j], -1) << "token " << t;
      }
    }
    if (routing == Routing::kMasked) {
      EXPECT_GT(masked, kT * kK / 4);  // ~44%: every 5th token, then 30% of the rest
    } else {
      EXPECT_EQ(masked, 0);
    }
    const RoutingStats stats = routing_stats(topk.idx_TK, kE);
    EXPECT_EQ(stats.valid_rows, kT * kK - masked);
    if (routing == Routing::kFewExperts) EXPECT_EQ(stats.num_empty_experts, kE - 2);
    if (routing == Routing::kAllSlotsOne) EXPECT_EQ(stats.max_rows, kT * kK);
  }
}

TEST(RoutingGenerator, SkewedFavoursFewExpertsAndDependsOnTheSeedOnly) {
  const TopK a = make_topk(kT, kE, kK, Routing::kSkewed, 9), b = make_topk(kT, kE, kK, Routing::kSkewed, 9);
  EXPECT_EQ(a.idx_TK, b.idx_TK);
  EXPECT_EQ(a.w_TK, b.w_TK);
  EXPECT_NE(make_topk(kT, kE, kK, Routing::kSkewed, 10).idx_TK, a.idx_TK);
  const RoutingStats skewed = routing_stats(a.idx_TK, kE);
  const RoutingStats uniform = routing_stats(make_topk(kT, kE, kK, Routing::kUniform, 9).idx_TK, kE);
  EXPECT_GT(skewed.max_rows, uniform.max_rows + kT / 10);
}

TEST(RoutingGenerator, ParseRoutingRoundTrips) {
  for (Routing routing : kAllRoutings) {
    Routing parsed = Routing::kUniform;
    ASSERT_TRUE(parse_routing(routing_name(routing), &parsed));
    EXPECT_EQ(parsed, routing);
  }
  Routing unused;
  EXPECT_FALSE(parse_routing("zipf", &unused));
}

TEST(RoutingGenerator, SortByExpertIsAStableCountingSort) {
  const TopK topk = make_topk(kT, kE, kK, Routing::kMasked, 3);
  const ExpertRows rows = sort_by_expert(topk.idx_TK, kE);
  ASSERT_EQ(rows.offsets.size(), static_cast<size_t>(kE + 1));
  EXPECT_EQ(rows.num_rows(), routing_stats(topk.idx_TK, kE).valid_rows);
  for (int64_t e = 0; e < kE; ++e) {
    EXPECT_EQ(rows.offsets[e + 1] - rows.offsets[e], rows.counts[e]);
    for (int32_t r = rows.offsets[e]; r < rows.offsets[e + 1]; ++r) {
      EXPECT_EQ(topk.idx_TK[rows.row_slot[r]], e);
      EXPECT_EQ(rows.slot_row[rows.row_slot[r]], r);
      if (r > rows.offsets[e]) EXPECT_LT(rows.row_slot[r - 1], rows.row_slot[r]);  // slot order inside an expert
    }
  }
  for (size_t s = 0; s < topk.idx_TK.size(); ++s) EXPECT_EQ(rows.slot_row[s] < 0, topk.idx_TK[s] < 0);
}

TEST(RoutingGenerator, ChosenCountsLandOnRandomSlots) {
  const std::vector<int32_t> counts = {0, 1, 7, 199, 0, 128, 129, 64};
  const std::vector<int32_t> idx = topk_with_counts(counts, 800, 1);
  const ExpertRows rows = sort_by_expert(idx, 8);
  EXPECT_EQ(rows.counts, counts);
  EXPECT_EQ(rows.num_rows(), 528);
  EXPECT_EQ(std::count(idx.begin(), idx.end(), -1), 800 - 528);
}

}  // namespace
}  // namespace fusemoe::harness

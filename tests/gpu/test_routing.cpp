// GPU tests of the device routing (src/kernels/routing.h) against a host stable counting sort:
// expert counts and offsets, row_slot's first R rows, slot_row (-1 for masked and invalid slots),
// the bad-id record and the caller's report. The plan is poisoned (0xFF) before every call.
// Shapes cover T = 0, one expert, all slots on one expert, masked and invalid ids, E = 1024, and
// more chunks (1024 slots each) than SMs, where a block of routing_place takes several chunks.
// Also the backward's pools built from the plan, by tokens and by rows, against the host plan.
#include <climits>
#include <string>

#include "gpu/gpu_test_util.h"
#include "kernels/moe_elementwise.h"
#include "kernels/routing.h"

namespace fusemoe::test {
namespace {

struct HostPlan {
  std::vector<int32_t> counts, offsets, row_slot, slot_row;
  int32_t num_bad = 0, first_bad_slot = INT_MAX, first_bad_id = 0;
};

HostPlan host_routing(const std::vector<int32_t>& idx, int64_t E) {
  HostPlan p;
  p.counts.assign(E, 0);
  p.slot_row.assign(idx.size(), -1);
  for (size_t s = 0; s < idx.size(); ++s) {
    if (idx[s] >= 0 && idx[s] < E) {
      ++p.counts[idx[s]];
    } else if (idx[s] != -1) {
      if (p.num_bad++ == 0) {
        p.first_bad_slot = static_cast<int32_t>(s);
        p.first_bad_id = idx[s];
      }
    }
  }
  p.offsets.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) p.offsets[e + 1] = p.offsets[e] + p.counts[e];
  std::vector<int32_t> next(p.offsets.begin(), p.offsets.end() - 1);
  p.row_slot.assign(p.offsets[E], -1);
  for (size_t s = 0; s < idx.size(); ++s) {  // increasing slot order inside each expert
    if (idx[s] >= 0 && idx[s] < E) {
      p.row_slot[next[idx[s]]] = static_cast<int32_t>(s);
      p.slot_row[s] = next[idx[s]]++;
    }
  }
  return p;
}

// Routes idx on the device into a poisoned plan and compares every output with the host sort.
// report: the caller's report buffer (3 ints) or null.
void expect_routing_matches(const std::string& what, const std::vector<int32_t>& idx, int64_t T, int64_t K, int64_t E,
                            DeviceBuffer* report = nullptr) {
  SCOPED_TRACE(what);
  ASSERT_EQ(static_cast<int64_t>(idx.size()), T * K);
  DeviceBuffer plan_dev(routing_plan_bytes(T, K, E));
  plan_dev.poison();
  RoutingPlan plan;
  carve_routing_plan(static_cast<char*>(plan_dev.get()), T, K, E, &plan);
  DeviceBuffer idx_dev = DeviceBuffer::from(idx.empty() ? std::vector<int32_t>{0} : idx);
  launch_routing(static_cast<const int32_t*>(idx_dev.get()), T, K, E, plan,
                 report ? static_cast<int32_t*>(report->get()) : nullptr, nullptr);
  TEST_CUDA(cudaDeviceSynchronize());
  const HostPlan want = host_routing(idx, E);
  auto download = [](const int32_t* p, int64_t n) {
    std::vector<int32_t> out(n);
    if (n > 0) TEST_CUDA(cudaMemcpy(out.data(), p, n * sizeof(int32_t), cudaMemcpyDeviceToHost));
    return out;
  };
  EXPECT_EQ(download(plan.expert_counts, E), want.counts) << "expert_counts";
  EXPECT_EQ(download(plan.expert_offsets, E + 1), want.offsets) << "expert_offsets";
  EXPECT_EQ(download(plan.row_slot, want.offsets[E]), want.row_slot) << "row_slot (first R rows)";
  EXPECT_EQ(download(plan.slot_row, T * K), want.slot_row) << "slot_row";
  const std::vector<int32_t> bad = download(plan.bad_id_info, 3);
  EXPECT_EQ(bad[0], want.num_bad) << "bad_id_info count";
  if (want.num_bad > 0) {
    EXPECT_EQ(bad[1], want.first_bad_slot) << "bad_id_info first slot";
    EXPECT_EQ(bad[2], want.first_bad_id) << "bad_id_info first id";
  }
}

std::vector<int32_t> random_ids(int64_t n, int64_t E, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> idx(n);
  for (auto& id : idx) id = static_cast<int32_t>(rng() % E);
  return idx;
}

TEST(Routing, NoTokens) { expect_routing_matches("T=0", {}, 0, 8, 128); }

TEST(Routing, OneExpertOneSlot) { expect_routing_matches("T=1 K=1 E=1", {0}, 1, 1, 1); }

TEST(Routing, QwenShapeUniform) {
  expect_routing_matches("T=256 K=8 E=128", random_ids(256 * 8, 128, 1), 256, 8, 128);
  expect_routing_matches("T=4099 K=8 E=128", random_ids(4099 * 8, 128, 2), 4099, 8, 128);
}

TEST(Routing, AllSlotsOnOneExpert) {
  expect_routing_matches("all on expert 5", std::vector<int32_t>(3000 * 4, 5), 3000, 4, 16);
}

TEST(Routing, OddExpertCountsAndE1024) {
  expect_routing_matches("E=3", random_ids(1537 * 2, 3, 3), 1537, 2, 3);
  expect_routing_matches("E=1024 K=10", random_ids(999 * 10, 1024, 4), 999, 10, 1024);
}

// Masked slots get no row; invalid ids get none either and are recorded (the first by slot).
TEST(Routing, MaskedAndInvalidIds) {
  const int64_t T = 2500, K = 8, E = 64;
  std::vector<int32_t> idx = random_ids(T * K, E, 5);
  for (int64_t s = 0; s < T * K; s += 7) idx[s] = -1;
  idx[1500 * K + 3] = static_cast<int32_t>(E);  // first invalid by slot, in a later chunk than 0
  idx[1900 * K + 1] = -2;
  idx[2400 * K + 7] = 1 << 30;
  expect_routing_matches("masked + invalid", idx, T, K, E);
}

// The backward's x and dy pools from a device plan with masked slots: pool row r holds token
// row_slot[r] / K of each source, built token-major (the fused backward's) and by pool rows (the
// expert-parallel backward's); rows past the row count keep their poison.
TEST(Routing, PoolsByTokensAndByRowsHoldEachRowsToken) {
  const int64_t T = 1500, K = 8, E = 64, H = 256;
  std::vector<int32_t> idx = random_ids(T * K, E, 9);
  for (int64_t s = 0; s < T * K; s += 5) idx[s] = -1;
  const HostPlan want = host_routing(idx, E);
  const int64_t num_rows = want.offsets[E], max_rows = T * K;
  DeviceBuffer plan_dev(routing_plan_bytes(T, K, E));
  RoutingPlan plan;
  carve_routing_plan(static_cast<char*>(plan_dev.get()), T, K, E, &plan);
  DeviceBuffer idx_dev = DeviceBuffer::from(idx);
  launch_routing(static_cast<const int32_t*>(idx_dev.get()), T, K, E, plan, nullptr, nullptr);
  std::mt19937_64 rng(10);
  const std::vector<uint16_t> a = random_bf16(T * H, 1.0, rng), b = random_bf16(T * H, 1.0, rng);
  DeviceBuffer a_dev = DeviceBuffer::from(a), b_dev = DeviceBuffer::from(b);
  std::vector<uint16_t> a_want(max_rows * H, 0xFFFF), b_want(max_rows * H, 0xFFFF);
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t t = want.row_slot[r] / K;
    std::copy(a.begin() + t * H, a.begin() + (t + 1) * H, a_want.begin() + r * H);
    std::copy(b.begin() + t * H, b.begin() + (t + 1) * H, b_want.begin() + r * H);
  }
  for (const bool by_tokens : {true, false}) {
    SCOPED_TRACE(by_tokens ? "by tokens" : "by rows");
    DeviceBuffer a_pool(max_rows * H * 2), b_pool(max_rows * H * 2);
    a_pool.poison();
    b_pool.poison();
    if (by_tokens) {
      launch_scatter_token_rows(a_dev.get(), a_pool.get(), b_dev.get(), b_pool.get(), plan.slot_row, T, K, H,
                                nullptr);
    } else {
      launch_gather_rows_device_count(a_dev.get(), a_pool.get(), b_dev.get(), b_pool.get(), plan.row_slot,
                                      plan.expert_offsets + E, max_rows, K, H, nullptr);
    }
    TEST_CUDA(cudaDeviceSynchronize());
    EXPECT_TRUE(a_pool.to_host<uint16_t>() == a_want) << "first pool";
    EXPECT_TRUE(b_pool.to_host<uint16_t>() == b_want) << "second pool";
  }
}

// The record is rewritten by every call: a clean call after a bad one records nothing, and the
// caller's report is filled once, by the first bad call.
TEST(Routing, BadIdRecordResetsAndReportKeepsFirst) {
  const int64_t T = 300, K = 4, E = 16;
  DeviceBuffer report = DeviceBuffer::from(std::vector<int32_t>{0, 0, 0});
  std::vector<int32_t> bad = random_ids(T * K, E, 6);
  bad[77] = 99;
  expect_routing_matches("bad", bad, T, K, E, &report);
  EXPECT_EQ(report.to_host<int32_t>(), (std::vector<int32_t>{1, 77, 99})) << "caller report after the bad call";
  std::vector<int32_t> other_bad = random_ids(T * K, E, 7);
  other_bad[5] = -5;
  expect_routing_matches("second bad", other_bad, T, K, E, &report);
  EXPECT_EQ(report.to_host<int32_t>(), (std::vector<int32_t>{1, 77, 99})) << "a filled report is kept";
  expect_routing_matches("clean", random_ids(T * K, E, 8), T, K, E, &report);
}

// More chunks than SMs (132 on an H200): 133 chunks (2 per place block), and 938 (8 per block).
TEST(Routing, MoreChunksThanSms) {
  const int64_t K = 8, E = 128;
  expect_routing_matches("T=17024 K=8", random_ids(17024 * K, E, 9), 17024, K, E);
  const int64_t T = 120000;
  std::vector<int32_t> idx = random_ids(T * K, E, 10);
  for (int64_t s = 3; s < T * K; s += 1001) idx[s] = -1;
  idx[T * K - 5] = 4096;  // an invalid id in the last chunk
  expect_routing_matches("T=120000 K=8", idx, T, K, E);
}

}  // namespace
}  // namespace fusemoe::test

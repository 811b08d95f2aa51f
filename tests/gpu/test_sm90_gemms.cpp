// GPU tests of the sm90 grouped-GEMM instances through their host launchers
// (src/launchers/sm90_grouped_gemm.h), each against the fp32 GPU reference computed from the
// same bf16 inputs (tests/common/sm90_gemm_problem.h: NaN-poisoned outputs, |err| <= rtol |ref|
// + atol with NaN failing, rows of no expert keep their poison, a second launch bitwise equal).
// Every instance runs on every routing case: empty experts, one expert with all rows, masked
// slots, expert sizes 1, 7, 128, 129, 199 (partial and exact tiles), no rows, T = 0, E = 1024,
// H and I that are not multiples of the tile widths, H = 128 (2 K-blocks), and the Qwen3 layer
// dims. Gate/up with the clamp and the z store on and off; dgrad at both tile widths (block_n 128
// and 256, set explicitly; the pipeline takes sm90_dgrad_block_n(H)); weight gradients fp32 and
// bf16, overwritten and accumulated; the instances that hold tiles also on 3 and 1 CTAs.
#include <gtest/gtest.h>

#include <cstdio>
#include <ostream>
#include <string>
#include <vector>

#include "common/device.h"
#include "common/routing.h"
#include "common/sm90_gemm_problem.h"

namespace fusemoe::harness {
namespace {

struct GemmCase {
  const char* name;
  MoeShape shape;  // T, K, E, H, I
  Routing routing;
  std::vector<int32_t> counts;  // rows per expert, when given (routing then only sets weights)
};

// gtest prints a parameter by this (instead of its bytes).
void PrintTo(const GemmCase& c, std::ostream* out) { *out << c.name; }

const std::vector<GemmCase>& gemm_cases() {
  static const std::vector<GemmCase> cases = {
      {"odd_counts", {100, 8, 8, 256, 128}, Routing::kUniform, {0, 1, 7, 199, 0, 128, 129, 64}},
      {"uniform", {333, 8, 8, 256, 128}, Routing::kUniform, {}},
      {"skewed", {333, 4, 16, 256, 128}, Routing::kSkewed, {}},
      {"one_expert", {300, 4, 8, 256, 128}, Routing::kOneExpert, {}},
      {"all_slots_one", {300, 8, 8, 256, 128}, Routing::kAllSlotsOne, {}},
      {"few_experts", {199, 4, 8, 256, 128}, Routing::kFewExperts, {}},
      {"masked", {199, 4, 8, 256, 128}, Routing::kMasked, {}},
      {"H384_I192", {257, 4, 8, 384, 192}, Routing::kUniform, {}},
      // 2 K-blocks a tile, fewer than a tile's held boxes (gate/up's z: 4).
      {"H128", {200, 4, 4, 128, 128}, Routing::kUniform, {}},
      {"single_row", {1, 1, 8, 256, 128}, Routing::kUniform, {0, 0, 0, 0, 0, 1, 0, 0}},
      {"no_rows", {16, 8, 8, 256, 128}, Routing::kUniform, {0, 0, 0, 0, 0, 0, 0, 0}},
      {"T0", {0, 8, 8, 256, 128}, Routing::kUniform, {}},
      {"E1024", {512, 8, 1024, 256, 128}, Routing::kUniform, {}},
      {"qwen3_30b_T512", {512, 8, 128, 2048, 768}, Routing::kUniform, {}},
      // E = 32 keeps the weight-gradient buffers of 235B dims (6.4 GB at E = 128) small.
      {"qwen3_235b_dims_E32_T256", {256, 8, 32, 4096, 1536}, Routing::kUniform, {}},
  };
  return cases;
}

class Sm90Gemms : public ::testing::TestWithParam<GemmCase> {
 protected:
  static Sm90GemmProblem make_problem(const GemmCase& c) {
    uint64_t seed = 7000;  // FNV-1a of the name: a fixed seed per case
    for (const char* ch = c.name; *ch != '\0'; ++ch) seed = (seed ^ static_cast<uint8_t>(*ch)) * 0x100000001B3ull;
    const MoeShape& s = c.shape;
    TopK topk = make_topk(s.T, s.E, s.K, c.routing, seed);
    if (!c.counts.empty()) topk.idx_TK = topk_with_counts(c.counts, s.T * s.K, seed);
    Sm90GemmProblem problem(s, topk.idx_TK, topk.w_TK, seed);
    const RoutingStats stats = routing_stats(topk.idx_TK, s.E);
    std::printf("%s: T=%lld K=%lld E=%lld H=%lld I=%lld, %lld rows, rows per expert %lld..%lld, %lld empty\n", c.name,
                static_cast<long long>(s.T), static_cast<long long>(s.K), static_cast<long long>(s.E),
                static_cast<long long>(s.H), static_cast<long long>(s.I), static_cast<long long>(stats.valid_rows),
                static_cast<long long>(stats.min_rows), static_cast<long long>(stats.max_rows),
                static_cast<long long>(stats.num_empty_experts));
    return problem;
  }
};

void expect_checks(const std::vector<Check>& checks) {
  for (const Check& c : checks) {
    std::printf("  %s %s: %s\n", c.ok ? "ok  " : "FAIL", c.what.c_str(), c.detail.c_str());
    EXPECT_TRUE(c.ok) << c.what << ": " << c.detail;
  }
}

TEST_P(Sm90Gemms, GateUpSwiGLU) {
  Sm90GemmProblem p = make_problem(GetParam());
  for (bool clamp : {false, true}) {
    for (bool store_z : {false, true}) expect_checks(p.check_gate_up(clamp, store_z, /*determinism=*/true));
    // The z store is an extra output: h has the same bits with and without it.
    p.h().poison();
    p.launch_gate_up(clamp, false);
    wait_device("gate/up");
    const std::vector<uint16_t> h_plain = p.h().to_host<uint16_t>();
    p.h().poison();
    p.launch_gate_up(clamp, true);
    wait_device("gate/up with z");
    EXPECT_TRUE(p.h().to_host<uint16_t>() == h_plain) << "h differs with the z store on (clamp " << clamp << ")";
  }
  // The forward's stored z is what the backward's recompute gives, bit for bit (the fused
  // backward relies on it when it reads saved z).
  p.z().poison();
  p.launch_gate_up(false, true);
  wait_device("gate/up with z");
  const std::vector<uint16_t> z_stored = p.z().to_host<uint16_t>();
  p.z().poison();
  p.launch_recompute_z();
  wait_device("recompute z");
  EXPECT_TRUE(p.z().to_host<uint16_t>() == z_stored) << "stored and recomputed z differ";
}

TEST_P(Sm90Gemms, DownWeighted) {
  Sm90GemmProblem p = make_problem(GetParam());
  expect_checks(p.check_down(/*determinism=*/true));
}

TEST_P(Sm90Gemms, RecomputeZ) {
  Sm90GemmProblem p = make_problem(GetParam());
  expect_checks(p.check_recompute_z(/*determinism=*/true));
}

TEST_P(Sm90Gemms, DgradSwiGLUBothWidths) {
  Sm90GemmProblem p = make_problem(GetParam());
  for (int block_n : {128, 256}) {
    for (bool clamp : {false, true}) expect_checks(p.check_dgrad_swiglu(block_n, clamp, /*determinism=*/true));
  }
}

TEST_P(Sm90Gemms, DgradScatter) {
  Sm90GemmProblem p = make_problem(GetParam());
  expect_checks(p.check_dgrad_scatter(/*determinism=*/true));
}

TEST_P(Sm90Gemms, WeightGradsFp32Bf16OverwriteAccumulate) {
  Sm90GemmProblem p = make_problem(GetParam());
  expect_checks(p.check_weight_grad(WeightGrad::kW2, /*determinism=*/true));
  expect_checks(p.check_weight_grad(WeightGrad::kW13, /*determinism=*/true));
}

// The weight gradients on few CTAs (as co-resident expert-parallel ranks give part of the SMs),
// each looping over many tiles of many experts: a tile's held output boxes go out under the next
// tile's main loop, across expert boundaries and tiles with fewer K-blocks than held boxes.
TEST_P(Sm90Gemms, WeightGradsOnFewSms) {
  Sm90GemmProblem p = make_problem(GetParam());
  for (int sms : {3, 1}) {
    std::printf("  %d SMs\n", sms);
    p.set_num_sms(sms);
    expect_checks(p.check_weight_grad(WeightGrad::kW2, /*determinism=*/true));
    expect_checks(p.check_weight_grad(WeightGrad::kW13, /*determinism=*/false));
  }
}

// The row-tile instances that hold a tile's output under the next tile's main loop (gate/up's z
// boxes and the row stores) on few CTAs, each looping over many tiles: held output goes out
// across expert boundaries, between whole tiles (gate/up: TMA-stored boxes) and an expert's last,
// partial tile (stored by the threads).
TEST_P(Sm90Gemms, RowTilesOnFewSms) {
  Sm90GemmProblem p = make_problem(GetParam());
  for (int sms : {3, 1}) {
    std::printf("  %d SMs\n", sms);
    p.set_num_sms(sms);
    for (bool store_z : {false, true}) expect_checks(p.check_gate_up(false, store_z, /*determinism=*/true));
    expect_checks(p.check_down(/*determinism=*/false));
    expect_checks(p.check_recompute_z(/*determinism=*/false));
    expect_checks(p.check_dgrad_scatter(/*determinism=*/false));
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Sm90Gemms, ::testing::ValuesIn(gemm_cases()),
                         [](const ::testing::TestParamInfo<GemmCase>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace fusemoe::harness

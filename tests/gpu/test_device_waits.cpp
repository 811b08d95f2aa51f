// Bounded device waits (common/device_wait.h), in the fault-injection build of the library: a
// launch told to announce 16 TMA bytes too many (its consumers' full-barrier wait can never
// complete) or to withhold its consumers' releases (its producer's empty-barrier wait can never
// complete) must fail within the timeout with an error that names the kernel, the role and the
// barrier, instead of hanging. A trap ends the CUDA context, so each case runs in a child process
// (gtest death test, "threadsafe" style: the child re-executes this binary).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/device_wait.h"
#include "gpu/gpu_test_util.h"

namespace fusemoe::test {
namespace {

// Runs a small fused forward + backward with `fault` injected into `kernel`; prints the error
// and exits 3 if the call fails as it must, 0 if it (wrongly) completes.
[[noreturn]] void run_with_fault(WaitKernel kernel, WaitFault fault, bool recompute_z, Precision precision,
                                 int64_t experts) {
  set_device_wait_timeout(0.5);
  inject_wait_fault(kernel, fault);
  // Every instance runs more K-blocks per tile than its ring has stages (H = 2I = 1024; ~250
  // rows per expert for the weight gradients), so a withheld release is waited for. At FP8
  // (K-blocks of 128, 6 stages) that holds for all but the down GEMM (I/128 = 4 K-blocks), whose
  // releases are therefore not a case below. With 256 experts the forward's gate/up and down take
  // the dynamic tile order (sm90_forward_dynamic_tile_order) and wait on its tile feed as well.
  const HostProblem p = make_problem(Dims{1000, 1024, 512, experts, 2}, Routing::kUniform, 7);
  RunOptions opt;
  opt.save_z = !recompute_z;
  opt.precision = precision;
  try {
    run_layer(Impl::kFused, p, opt);
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    std::exit(3);
  }
  std::exit(0);
}

struct FaultCase {
  WaitKernel kernel;
  WaitFault fault;
  bool recompute_z;
  const char* expected;  // regex the error must match
  Precision precision = Precision::kBf16;
  int64_t experts = 8;
};

class DeviceWaits : public ::testing::TestWithParam<FaultCase> {};

TEST_P(DeviceWaits, TimeOutWithADescription) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const FaultCase c = GetParam();
  EXPECT_EXIT(run_with_fault(c.kernel, c.fault, c.recompute_z, c.precision, c.experts), ::testing::ExitedWithCode(3),
              c.expected);
}

constexpr const char* kFull = "\\(consumer\\) waited 0\\.[5-9][0-9]* s for ring stage [0-9]+ to be filled";
constexpr const char* kEmpty = "\\(producer\\) waited 0\\.[5-9][0-9]* s for ring stage [0-9]+ to be released";
// The FP8 instances' waits name their kernel as such.
constexpr const char* kFp8Full =
    "FP8 .* GEMM block [0-9]+ thread [0-9]+ \\(consumer\\) waited 0\\.[5-9][0-9]* s for ring stage [0-9]+ to be filled";
constexpr const char* kFp8Empty =
    "FP8 .* GEMM block [0-9]+ thread [0-9]+ \\(producer\\) waited 0\\.[5-9][0-9]* s for ring stage [0-9]+ to be "
    "released";
constexpr Precision kFp8 = Precision::kFp8Blockwise;
constexpr Precision kBf16 = Precision::kBf16;
// The dynamic tile order's feed (E = 256): its readers (consumers, gathering producer threads) left
// without a posted tile index.
constexpr const char* kPosted = "\\((consumer|producer)\\) waited 0\\.[5-9][0-9]* s for tile-index slot 0 to be posted";

INSTANTIATE_TEST_SUITE_P(
    Fused, DeviceWaits,
    ::testing::Values(FaultCase{WaitKernel::kGateUp, WaitFault::kStageFull, false, kFull},
                      FaultCase{WaitKernel::kGateUp, WaitFault::kStageEmpty, false, kEmpty},
                      FaultCase{WaitKernel::kDown, WaitFault::kStageFull, false, kFull},
                      FaultCase{WaitKernel::kRecomputeZ, WaitFault::kStageEmpty, true, kEmpty},
                      FaultCase{WaitKernel::kDgradSwiglu, WaitFault::kStageFull, false, kFull},
                      FaultCase{WaitKernel::kDgradScatter, WaitFault::kStageEmpty, false, kEmpty},
                      FaultCase{WaitKernel::kWeightGrad, WaitFault::kStageFull, false, kFull},
                      FaultCase{WaitKernel::kWeightGrad, WaitFault::kStageEmpty, false, kEmpty},
                      // The block-scaled FP8 loops (sm90_block_scaled.cuh) honour the same hook.
                      FaultCase{WaitKernel::kFp8GateUp, WaitFault::kStageFull, false, kFp8Full, kFp8},
                      FaultCase{WaitKernel::kFp8GateUp, WaitFault::kStageEmpty, false, kFp8Empty, kFp8},
                      FaultCase{WaitKernel::kFp8Down, WaitFault::kStageFull, false, kFp8Full, kFp8},
                      FaultCase{WaitKernel::kFp8RecomputeZ, WaitFault::kStageEmpty, true, kFp8Empty, kFp8},
                      FaultCase{WaitKernel::kFp8DgradSwiglu, WaitFault::kStageFull, false, kFp8Full, kFp8},
                      FaultCase{WaitKernel::kFp8DgradScatter, WaitFault::kStageEmpty, false, kFp8Empty, kFp8},
                      // Dynamic tile order: a feed that is never posted, and a withheld stage
                      // release that must still be named as such (the feed's waits, blocked in
                      // turn, run 20x longer).
                      FaultCase{WaitKernel::kGateUp, WaitFault::kTileIndexPosted, false, kPosted, kBf16, 256},
                      FaultCase{WaitKernel::kDown, WaitFault::kTileIndexPosted, false, kPosted, kBf16, 256},
                      FaultCase{WaitKernel::kGateUp, WaitFault::kStageEmpty, false, kEmpty, kBf16, 256}),
    [](const ::testing::TestParamInfo<FaultCase>& info) {
      return std::to_string(static_cast<int>(info.param.kernel)) +
             (info.param.fault == WaitFault::kStageFull   ? "_full"
              : info.param.fault == WaitFault::kStageEmpty ? "_empty"
                                                           : "_index_posted") +
             (info.param.experts == 8 ? "" : "_E" + std::to_string(info.param.experts));
    });

}  // namespace
}  // namespace fusemoe::test

// The host's description of a timed-out device wait (common/device_wait.h), from a record as a
// kernel writes it: kernel, block, thread, role, barrier, stage, parity, expectation, time.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "common/device_wait.h"
#include "fusemoe/error.h"

namespace fusemoe {
namespace {

// The message names the kernel: spot-check two of them against the description's wording.
TEST(DeviceWaitRecord, NamesKernelRoleAndBarrier) {
  DeviceWaitRecord r{};
  r.state = 1;
  r.site = wait_site(WaitKernel::kWeightGrad, WaitRole::kProducer, WaitObject::kStageEmpty, 2);
  r.expected = 8;
  r.parity = 1;
  r.block = 17;
  r.waited_ns = 1500000000ull;
  const std::string text = describe_device_wait(r);
  EXPECT_NE(text.find("weight-gradient GEMM block 17 thread 0 (producer) waited 1.5 s for ring stage 2 to be released"),
            std::string::npos)
      << text;
  r.site = wait_site(WaitKernel::kGateUp, WaitRole::kConsumer, WaitObject::kStageFull, 0);
  EXPECT_NE(describe_device_wait(r).find("gate/up GEMM block 17"), std::string::npos);
}

// Every kernel that bounds its waits has a name of its own (the FP8 instances included).
TEST(DeviceWaitRecord, EveryKernelIsNamed) {
  DeviceWaitRecord r{};
  r.state = 1;
  std::set<std::string> names;
  for (int k = 1; k < kNumWaitKernels; ++k) {
    r.site = wait_site(static_cast<WaitKernel>(k), WaitRole::kConsumer, WaitObject::kStageFull, 0);
    const std::string text = describe_device_wait(r);
    EXPECT_EQ(text.find("unknown kernel"), std::string::npos) << "kernel " << k << ": " << text;
    names.insert(text.substr(0, text.find(" block ")));
  }
  EXPECT_EQ(names.size(), static_cast<size_t>(kNumWaitKernels - 1));
  r.site = wait_site(WaitKernel::kFp8DgradSwiglu, WaitRole::kProducer, WaitObject::kStageEmpty, 1);
  EXPECT_NE(describe_device_wait(r).find("FP8 dgrad + SwiGLU GEMM block 0"), std::string::npos);
}

// The dynamic tile order's feed waits name the feed slot, not a ring stage.
TEST(DeviceWaitRecord, NamesTileFeedSlots) {
  DeviceWaitRecord r{};
  r.state = 1;
  r.block = 3;
  r.waited_ns = 2000000000ull;
  r.site = wait_site(WaitKernel::kGateUp, WaitRole::kConsumer, WaitObject::kTileIndexPosted, 1);
  r.expected = 1;
  std::string text = describe_device_wait(r);
  EXPECT_NE(text.find("gate/up GEMM block 3 thread 0 (consumer) waited 2 s for tile-index slot 1 to be posted"),
            std::string::npos)
      << text;
  r.site = wait_site(WaitKernel::kDown, WaitRole::kProducer, WaitObject::kTileIndexRead, 2);
  r.expected = 257;
  r.parity = 1;
  text = describe_device_wait(r);
  EXPECT_NE(text.find("tile-index slot 2 to be read by every role (parity 1, 257 reader arrivals expected)"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("ring stage"), std::string::npos) << text;
}

TEST(DeviceWaitRecord, TimeoutIsValidated) {
  const double before = device_wait_timeout();
  EXPECT_THROW(set_device_wait_timeout(0.0), Error);
  EXPECT_THROW(set_device_wait_timeout(-1.0), Error);
  EXPECT_EQ(device_wait_timeout(), before);
  set_device_wait_timeout(2.5);
  EXPECT_DOUBLE_EQ(device_wait_timeout(), 2.5);
  set_device_wait_timeout(before);
}

}  // namespace
}  // namespace fusemoe

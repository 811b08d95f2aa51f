// Entry point of the GPU suites: exits 77 (ctest SKIP_RETURN_CODE: reported "Skipped", never
// "Passed") when there is no sm_90 GPU, otherwise runs every GoogleTest case. A run where every
// case passed but some skipped (a case needing more memory than a smaller GPU has) also exits 77,
// so ctest does not show the suite as passed. Listing the cases (--gtest_list_tests) needs no GPU.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/device.h"

namespace fusemoe::test {
// Defined by suites that run some of their cases in child processes of this binary (the EP
// suite's CUDA IPC ranks): a child runs its part and exits inside it.
int maybe_run_ep_ipc_child(int argc, char** argv) __attribute__((weak));
}  // namespace fusemoe::test

int main(int argc, char** argv) {
  if (fusemoe::test::maybe_run_ep_ipc_child != nullptr) fusemoe::test::maybe_run_ep_ipc_child(argc, argv);
  // The expert-parallel suite runs several ranks' streams side by side in this process, their
  // kernels waiting on each other: give every stream its own hardware queue (the default 8 can
  // make two streams share one, and a waiting kernel then blocks the other stream's work).
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  // Lazy loading may synchronise the context when a kernel is first launched, which would wait
  // for another rank's kernel that spins on this rank: load every kernel up front.
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--gtest_list_tests") == 0) {
      ::testing::InitGoogleTest(&argc, argv);
      return RUN_ALL_TESTS();
    }
  }
  fusemoe::harness::GpuInfo gpu;
  std::string reason;
  if (!fusemoe::harness::find_sm90(&gpu, &reason)) {
    std::printf("SKIPPED: %s; the GPU suites need an sm_90 (Hopper) GPU\n", reason.c_str());
    return 77;
  }
  std::printf("GPU: %s, %d SMs, driver CUDA %s, runtime %s\n", gpu.name.c_str(), gpu.sm_count,
              fusemoe::harness::cuda_version_string(gpu.driver_version).c_str(),
              fusemoe::harness::cuda_version_string(gpu.runtime_version).c_str());
  // As the driver read them (setenv above keeps a value the caller's environment already had).
  std::printf("CUDA_DEVICE_MAX_CONNECTIONS=%s CUDA_MODULE_LOADING=%s\n", std::getenv("CUDA_DEVICE_MAX_CONNECTIONS"),
              std::getenv("CUDA_MODULE_LOADING"));
  ::testing::InitGoogleTest(&argc, argv);
  const int status = RUN_ALL_TESTS();
  const int skipped = ::testing::UnitTest::GetInstance()->skipped_test_count();
  if (status == 0 && skipped > 0) {
    std::printf("SKIPPED: %d case(s) skipped (listed above); the suite reports Skipped, not Passed\n", skipped);
    return 77;
  }
  return status;
}

// Entry point of the GPU suite: exits 77 (ctest SKIP_RETURN_CODE: reported "Skipped", never
// "Passed") when there is no sm_90 GPU, otherwise runs every GoogleTest case.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  // The expert-parallel suite runs several ranks' streams side by side in this process, their
  // kernels waiting on each other: give every stream its own hardware queue (the default 8 can
  // make two streams share one, and a waiting kernel then blocks the other stream's work).
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  // Lazy loading may synchronise the context when a kernel is first launched, which would wait
  // for another rank's kernel that spins on this rank: load every kernel up front.
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    std::printf("SKIPPED: no CUDA GPU (%s); the GPU suite needs an sm_90 (Hopper) GPU\n",
                status != cudaSuccess ? cudaGetErrorString(status) : "0 devices");
    return 77;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || prop.major != 9 || prop.minor != 0) {
    std::printf("SKIPPED: GPU 0 is %s (sm_%d%d); the GPU suite needs sm_90 (Hopper)\n", prop.name,
                prop.major, prop.minor);
    return 77;
  }
  std::printf("GPU: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

// Entry point of the GPU suite: exits 77 (ctest SKIP_RETURN_CODE: reported "Skipped", never
// "Passed") when there is no sm_90 GPU, otherwise runs every GoogleTest case.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>

int main(int argc, char** argv) {
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

// Host helpers shared by the standalone sm90 kernel test programs (test_sm90_moe_gemm.cu,
// test_sm90_moe_backward_gemm.cu): a CUDA check that ends the program, device buffers, the
// problem shape, random per-expert row counts, and the skip-or-describe check of the GPU.
// Legend: T tokens, K top-k, E experts, H hidden, I intermediate, R routed rows.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define CHECK_CUDA(expr)                                                                       \
  do {                                                                                         \
    cudaError_t status_ = (expr);                                                              \
    if (status_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #expr,               \
                   cudaGetErrorString(status_));                                               \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

template <typename T>
T* device_alloc(size_t count) {
  T* ptr = nullptr;
  CHECK_CUDA(cudaMalloc(&ptr, std::max<size_t>(count, 1) * sizeof(T)));
  return ptr;
}
template <typename T>
T* device_upload(const std::vector<T>& host) {
  T* ptr = device_alloc<T>(host.size());
  if (!host.empty()) CHECK_CUDA(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return ptr;
}

struct Shape {
  int64_t T, K, E, H, I;
};

// R rows spread over E experts uniformly at random (some experts may get none).
inline std::vector<int> random_counts(int64_t E, int64_t R, std::mt19937_64& rng) {
  std::vector<int> counts(E, 0);
  std::uniform_int_distribution<int64_t> pick(0, E - 1);
  for (int64_t r = 0; r < R; ++r) ++counts[pick(rng)];
  return counts;
}

// 0 when device 0 is an sm_90 GPU (and prints what it is), else prints "skipped: ..." and
// returns 77, the exit code ctest reports as a skip.
inline int require_sm90_or_skip() {
  int num_devices = 0;
  if (cudaGetDeviceCount(&num_devices) != cudaSuccess || num_devices == 0) {
    std::printf("skipped: no sm_90 GPU\n");
    return 77;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9 || prop.minor != 0) {
    std::printf("skipped: no sm_90 GPU (device 0 is %s, sm_%d%d)\n", prop.name, prop.major, prop.minor);
    return 77;
  }
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  std::printf("device: %s, %d SMs, L2 %d MB, driver %d, runtime %d\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20, driver, runtime);
  return 0;
}

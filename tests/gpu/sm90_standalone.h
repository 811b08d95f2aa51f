// Helpers shared by the standalone sm90 kernel test programs (test_sm90_moe_gemm.cu,
// test_sm90_moe_backward_gemm.cu; CUDA sources, so device code may live here too): a CUDA check
// that ends the program, device buffers, the problem shape, random per-expert row counts, the
// skip-or-describe check of the GPU, a bounded wait for the device, random fills and the
// L2-flushing median timer.
// Legend: T tokens, K top-k, E experts, H hidden, I intermediate, R routed rows.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
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

// Waits for the device with a time limit: a hung persistent kernel ends the run with a message
// naming the step instead of eating the whole time budget.
inline void wait_device(const char* what, double limit_s = 30.0, cudaStream_t stream = nullptr) {
  cudaEvent_t done;
  CHECK_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  CHECK_CUDA(cudaEventRecord(done, stream));
  const auto start = std::chrono::steady_clock::now();
  while (true) {
    const cudaError_t status = cudaEventQuery(done);
    if (status == cudaSuccess) break;
    if (status != cudaErrorNotReady) {
      std::printf("FAIL: %s: %s\n", what, cudaGetErrorString(status));
      std::exit(1);
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > limit_s) {
      std::printf("FAIL: HANG in %s (no completion after %.0f s)\n", what, limit_s);
      std::fflush(stdout);
      std::_Exit(3);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  CHECK_CUDA(cudaEventDestroy(done));
}

// ------------------------------------------------------------------------------ device helpers
__device__ __forceinline__ uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__device__ __forceinline__ float uniform_pm1(uint64_t seed, int64_t i) {
  const uint64_t r = mix64(seed * 0x100000001B3ull + i);
  return (static_cast<float>(r >> 40) / 16777216.0f) * 2.0f - 1.0f;
}

__global__ void fill_random_bf16(__nv_bfloat16* out, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = __float2bfloat16(uniform_pm1(seed, i) * scale);
  }
}
__global__ void fill_random_f32(float* out, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = uniform_pm1(seed, i) * scale;
  }
}

// --------------------------------------------------------------------------------- timing
// Median of CUDA-event timings of one launch sequence, with a 256 MB write before each timed
// launch so that no launch finds its inputs in L2; a hang ends the program (wait_device).
struct Timer {
  cudaEvent_t start, stop;
  char* flush;  // written before each launch so no launch finds its inputs in L2
  static constexpr size_t kFlushBytes = size_t(256) << 20;
  int warmup, reps;  // untimed launches, then timed ones (the median is returned)
  explicit Timer(int warmup_ = 3, int reps_ = 20) : warmup(warmup_), reps(reps_) {
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    flush = device_alloc<char>(kFlushBytes);
  }
  ~Timer() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaFree(flush);
  }
  template <typename F>
  double median_ms(const char* what, F&& launch) {
    for (int i = 0; i < warmup; ++i) launch();
    wait_device(what);
    std::vector<float> times;
    for (int i = 0; i < reps; ++i) {
      CHECK_CUDA(cudaMemsetAsync(flush, i & 0xFF, kFlushBytes));
      CHECK_CUDA(cudaEventRecord(start));
      launch();
      CHECK_CUDA(cudaEventRecord(stop));
      wait_device(what);
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      times.push_back(ms);
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  }
};

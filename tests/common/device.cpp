#include "common/device.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "fusemoe/error.h"

namespace fusemoe::harness {

std::string cuda_version_string(int version) {
  return std::to_string(version / 1000) + "." + std::to_string((version % 1000) / 10);
}

bool find_sm90(GpuInfo* info, std::string* reason) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    *reason = std::string("no CUDA GPU (") + cudaGetErrorString(status) + ")";
    return false;
  }
  if (count == 0) {
    *reason = "no CUDA GPU (0 devices)";
    return false;
  }
  FUSEMOE_CUDA_CHECK(cudaGetDevice(&info->device));
  cudaDeviceProp prop{};
  FUSEMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, info->device));
  info->name = prop.name;
  info->cc_major = prop.major;
  info->cc_minor = prop.minor;
  info->memory_bytes = prop.totalGlobalMem;
  FUSEMOE_CUDA_CHECK(cudaDeviceGetAttribute(&info->sm_count, cudaDevAttrMultiProcessorCount, info->device));
  FUSEMOE_CUDA_CHECK(cudaDeviceGetAttribute(&info->l2_bytes, cudaDevAttrL2CacheSize, info->device));
  FUSEMOE_CUDA_CHECK(cudaDriverGetVersion(&info->driver_version));
  FUSEMOE_CUDA_CHECK(cudaRuntimeGetVersion(&info->runtime_version));
  if (prop.major != 9 || prop.minor != 0) {
    *reason = "GPU " + std::to_string(info->device) + " is " + info->name + " (sm_" + std::to_string(prop.major) +
              std::to_string(prop.minor) + "), not sm_90 (Hopper)";
    return false;
  }
  return true;
}

int num_sms() {
  int device = 0, count = 0;
  FUSEMOE_CUDA_CHECK(cudaGetDevice(&device));
  FUSEMOE_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

void wait_device(const char* what, cudaStream_t stream, double limit_s) {
  cudaEvent_t done;
  FUSEMOE_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  FUSEMOE_CUDA_CHECK(cudaEventRecord(done, stream));
  const auto start = std::chrono::steady_clock::now();
  while (true) {
    const cudaError_t status = cudaEventQuery(done);
    if (status == cudaSuccess) break;
    if (status != cudaErrorNotReady) {
      cudaEventDestroy(done);
      FUSEMOE_CHECK(false, what << ": " << cudaGetErrorString(status));
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > limit_s) {
      std::printf("FAIL: HANG in %s (not finished after %.0f s)\n", what, limit_s);
      std::fflush(stdout);
      std::_Exit(3);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  FUSEMOE_CUDA_CHECK(cudaEventDestroy(done));
}

}  // namespace fusemoe::harness

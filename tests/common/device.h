// Facts of the GPU that tests and benchmarks run on, queried (never assumed: the SM count, L2
// size and versions come from the runtime), the sm_90 check that turns "no Hopper GPU" into a
// skip, and a bounded wait that ends the process when a persistent kernel hangs.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace fusemoe::harness {

struct GpuInfo {
  int device = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;         // cudaDevAttrMultiProcessorCount
  size_t memory_bytes = 0;
  int l2_bytes = 0;         // cudaDevAttrL2CacheSize
  int driver_version = 0;   // the CUDA version the driver supports, e.g. 13000
  int runtime_version = 0;  // the CUDA runtime this binary runs with
};

// "13.0" from 13000.
std::string cuda_version_string(int version);

// Fills `info` for the current device and returns true when it is an sm_90 GPU; otherwise
// returns false with `reason` saying what was found (no device, driver error, other arch).
bool find_sm90(GpuInfo* info, std::string* reason);

// The number of SMs of the current device.
int num_sms();

// Waits for everything queued on `stream`, at most `limit_s` seconds. A device error throws
// fusemoe::Error naming `what`; a hang prints "HANG in <what>" and ends the process with exit
// code 3 (a kernel that never finishes cannot be recovered from in-process).
void wait_device(const char* what, cudaStream_t stream = nullptr, double limit_s = 60.0);

}  // namespace fusemoe::harness

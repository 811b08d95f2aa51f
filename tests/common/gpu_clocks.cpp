#include "common/gpu_clocks.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

namespace fusemoe::harness {

Nvml::Nvml(int cuda_device) {
  lib_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib_ == nullptr) return;
  auto init = reinterpret_cast<int (*)()>(dlsym(lib_, "nvmlInit_v2"));
  auto by_bus = reinterpret_cast<int (*)(const char*, void**)>(dlsym(lib_, "nvmlDeviceGetHandleByPciBusId_v2"));
  clock_ = reinterpret_cast<int (*)(void*, int, unsigned*)>(dlsym(lib_, "nvmlDeviceGetClockInfo"));
  power_ = reinterpret_cast<int (*)(void*, unsigned*)>(dlsym(lib_, "nvmlDeviceGetPowerUsage"));
  temp_ = reinterpret_cast<int (*)(void*, int, unsigned*)>(dlsym(lib_, "nvmlDeviceGetTemperature"));
  // The newer name first; the older one is the same call.
  reasons_ = reinterpret_cast<int (*)(void*, unsigned long long*)>(dlsym(lib_, "nvmlDeviceGetCurrentClocksEventReasons"));
  if (reasons_ == nullptr) {
    reasons_ =
        reinterpret_cast<int (*)(void*, unsigned long long*)>(dlsym(lib_, "nvmlDeviceGetCurrentClocksThrottleReasons"));
  }
  char bus_id[32] = {};
  if (cuda_device < 0 && cudaGetDevice(&cuda_device) != cudaSuccess) cuda_device = 0;
  if (init == nullptr || by_bus == nullptr || clock_ == nullptr || power_ == nullptr || temp_ == nullptr ||
      init() != 0 || cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), cuda_device) != cudaSuccess ||
      by_bus(bus_id, &device_) != 0) {
    device_ = nullptr;
  }
}

Nvml::~Nvml() {
  if (lib_ != nullptr) dlclose(lib_);
}

Nvml::Sample Nvml::sample() const {
  Sample s;
  if (device_ == nullptr) return s;
  constexpr int kClockSm = 1, kClockMem = 2, kTemperatureGpu = 0;  // nvml.h's enum values
  constexpr unsigned long long kSwPowerCap = 0x4;                  // nvmlClocksEventReasonSwPowerCap
  s.ok = clock_(device_, kClockSm, &s.sm_mhz) == 0 && clock_(device_, kClockMem, &s.mem_mhz) == 0 &&
         power_(device_, &s.power_mw) == 0 && temp_(device_, kTemperatureGpu, &s.temp_c) == 0;
  unsigned long long reasons = 0;
  if (s.ok && reasons_ != nullptr && reasons_(device_, &reasons) == 0) s.power_capped = (reasons & kSwPowerCap) != 0;
  return s;
}

ClockSampler::ClockSampler(const Nvml& nvml, int period_ms) : nvml_(nvml) {
  if (!nvml_.available()) {
    running_ = false;
    return;
  }
  thread_ = std::thread([this, period_ms] {
    auto next = std::chrono::steady_clock::now();
    while (running_.load(std::memory_order_relaxed)) {
      samples_.push_back(nvml_.sample());  // summarize_clocks leaves out the failed reads
      next += std::chrono::milliseconds(period_ms);
      std::this_thread::sleep_until(next);
    }
  });
}

ClockSampler::~ClockSampler() { stop(); }

ClockSummary ClockSampler::stop() {
  running_ = false;
  if (thread_.joinable()) thread_.join();
  return summarize_clocks(samples_);
}

ClockSummary summarize_clocks(const std::vector<Nvml::Sample>& samples) {
  std::vector<double> sm;
  int capped = 0;
  for (const Nvml::Sample& s : samples) {
    if (!s.ok) continue;
    sm.push_back(s.sm_mhz);
    capped += s.power_capped ? 1 : 0;
  }
  ClockSummary summary;
  summary.samples = static_cast<int>(sm.size());
  if (sm.empty()) return summary;
  std::sort(sm.begin(), sm.end());
  const size_t n = sm.size();
  summary.sm_mhz_median = n % 2 == 1 ? sm[n / 2] : 0.5 * (sm[n / 2 - 1] + sm[n / 2]);
  summary.sm_mhz_min = sm.front();
  summary.sm_mhz_max = sm.back();
  summary.power_capped_fraction = static_cast<double>(capped) / summary.samples;
  return summary;
}

std::string describe(const ClockSummary& s) {
  if (s.samples == 0) return "clocks n/a (no NVML samples)";
  char text[160];
  std::snprintf(text, sizeof(text), "SM %.0f MHz median (%.0f-%.0f), power cap in %.0f%% of %d samples",
                s.sm_mhz_median, s.sm_mhz_min, s.sm_mhz_max, 100.0 * s.power_capped_fraction, s.samples);
  return text;
}

}  // namespace fusemoe::harness

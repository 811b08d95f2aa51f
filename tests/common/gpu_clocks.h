// The GPU's clocks and power through NVML, resolved from the driver's libnvidia-ml at run time
// (no build dependency; without NVML every sample says so and the programs still run), and a
// sampler that records them on a thread while a benchmark times its kernels. The H200 runs its
// GEMMs at the 700 W power cap's clock, 1.3-1.6 GHz of its 1.98 GHz
// (docs/experiments.md#power-cap), and that clock moves from run to run: a timing means more with
// the clock it ran at.
#pragma once

#include <atomic>
#include <string>
#include <thread>
#include <vector>

namespace fusemoe::harness {

class Nvml {
 public:
  struct Sample {
    bool ok = false;
    unsigned sm_mhz = 0, mem_mhz = 0, power_mw = 0, temp_c = 0;
    bool power_capped = false;  // the SW power cap is holding the clocks down (event reason 0x4)
  };

  // cuda_device -1: the current device.
  explicit Nvml(int cuda_device = -1);
  ~Nvml();
  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;

  bool available() const { return device_ != nullptr; }
  Sample sample() const;

 private:
  void* lib_ = nullptr;
  void* device_ = nullptr;
  int (*clock_)(void*, int, unsigned*) = nullptr;
  int (*power_)(void*, unsigned*) = nullptr;
  int (*temp_)(void*, int, unsigned*) = nullptr;
  int (*reasons_)(void*, unsigned long long*) = nullptr;  // may be missing in an old driver
};

// What the samples of one timed stretch say. No power figure: NVML's power reading averages over
// about a second and lags a stretch this short (it read 209 W in a 0.24 s stretch at the cap).
// The clock reading lags too: 15 samples over the 0.15 s of the cuBLAS ceiling read 1980 MHz
// where Nsight Compute measured its kernel at 1.59 GHz, so a stretch of well under a second says
// little; the layer benchmark's cases run 0.2-2 s.
struct ClockSummary {
  int samples = 0;  // 0: no NVML, or the stretch was shorter than one period
  double sm_mhz_median = 0, sm_mhz_min = 0, sm_mhz_max = 0;
  double power_capped_fraction = 0;  // of the samples: the SW power cap held the clocks down
};

// The summary of samples (those with ok set).
ClockSummary summarize_clocks(const std::vector<Nvml::Sample>& samples);

// Samples every period_ms from construction to stop() (or destruction).
class ClockSampler {
 public:
  explicit ClockSampler(const Nvml& nvml, int period_ms = 10);
  ~ClockSampler();
  ClockSampler(const ClockSampler&) = delete;
  ClockSampler& operator=(const ClockSampler&) = delete;

  ClockSummary stop();

 private:
  const Nvml& nvml_;
  std::atomic<bool> running_{true};
  std::vector<Nvml::Sample> samples_;
  std::thread thread_;
};

// "SM 1440 MHz median (1365-1770), power cap in 100% of 70 samples", or why there is none.
std::string describe(const ClockSummary& s);

}  // namespace fusemoe::harness

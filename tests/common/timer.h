// CUDA-event timing for the benchmarks: warm-up runs, then timed ones; median, min and max. A
// write of 4x the L2 size precedes every run (outside the events) so that no run finds what
// the previous one left in L2. Several ops are timed interleaved, round by round, so that the
// ops compared share the GPU's clock and thermal state (back to back, a kernel's time drifts
// by 5-10% as the GPU heats, which favoured whatever ran first).
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <vector>

#include "common/device_buffer.h"

namespace fusemoe::harness {

struct TimingStats {
  double median_ms = 0, min_ms = 0, max_ms = 0;
};

TimingStats summarize(std::vector<float> samples_ms);

// The bytes written before each timed run: 4x the current device's L2 (queried), so nothing of
// the previous run is left in it.
size_t l2_flush_bytes();

class EventTimer {
 public:
  explicit EventTimer(cudaStream_t stream);

  // Per op, the statistics of `iters` timed runs after `warmup` untimed ones; a round runs
  // every op once, in order. With min_warmup_ms > 0, untimed rounds go on until that much time
  // has passed since the first (at least `warmup` of them), so each block of ops is timed at the
  // power and thermal state it keeps, not at the one the previous block left.
  std::vector<TimingStats> run_interleaved(const std::vector<std::function<void()>>& ops, int warmup, int iters,
                                           bool flush_l2, double min_warmup_ms = 0.0);
  TimingStats run(const std::function<void()>& op, int warmup, int iters, bool flush_l2);

  size_t flush_bytes() const { return flush_.bytes(); }
  void flush_l2(int round) const;

 private:
  cudaStream_t stream_;
  DeviceBuffer flush_;
};

}  // namespace fusemoe::harness

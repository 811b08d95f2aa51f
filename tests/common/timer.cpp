#include "common/timer.h"

#include <algorithm>
#include <chrono>

#include "fusemoe/error.h"

namespace fusemoe::harness {
size_t l2_flush_bytes() {
  int device = 0, l2_bytes = 0;
  FUSEMOE_CUDA_CHECK(cudaGetDevice(&device));
  FUSEMOE_CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  return 4 * static_cast<size_t>(l2_bytes);
}

TimingStats summarize(std::vector<float> samples_ms) {
  FUSEMOE_CHECK(!samples_ms.empty(), "summarize: no samples");
  std::sort(samples_ms.begin(), samples_ms.end());
  const size_t n = samples_ms.size();
  TimingStats stats;
  stats.median_ms = n % 2 == 1 ? samples_ms[n / 2] : 0.5 * (samples_ms[n / 2 - 1] + samples_ms[n / 2]);
  stats.min_ms = samples_ms.front();
  stats.max_ms = samples_ms.back();
  return stats;
}

EventTimer::EventTimer(cudaStream_t stream) : stream_(stream), flush_(l2_flush_bytes()) {}

void EventTimer::flush_l2(int round) const {
  FUSEMOE_CUDA_CHECK(cudaMemsetAsync(flush_.get(), round & 0xFF, flush_.bytes(), stream_));
}

std::vector<TimingStats> EventTimer::run_interleaved(const std::vector<std::function<void()>>& ops, int warmup,
                                                     int iters, bool flush_l2, double min_warmup_ms) {
  const size_t num_ops = ops.size();
  std::vector<cudaEvent_t> events(2 * static_cast<size_t>(iters) * num_ops);
  for (cudaEvent_t& event : events) FUSEMOE_CUDA_CHECK(cudaEventCreate(&event));
  auto event = [&](size_t op, int timed, int end) -> cudaEvent_t& { return events[(op * iters + timed) * 2 + end]; };
  try {
    auto round = [&](int i, int timed) {
      for (size_t j = 0; j < num_ops; ++j) {
        if (flush_l2) this->flush_l2(i);
        if (timed >= 0) FUSEMOE_CUDA_CHECK(cudaEventRecord(event(j, timed, 0), stream_));
        ops[j]();
        if (timed >= 0) FUSEMOE_CUDA_CHECK(cudaEventRecord(event(j, timed, 1), stream_));
      }
    };
    const auto start = std::chrono::steady_clock::now();
    auto warm_ms = [&] {
      FUSEMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    };
    int rounds = 0;
    for (; rounds < warmup; ++rounds) round(rounds, -1);
    while (min_warmup_ms > 0.0 && warm_ms() < min_warmup_ms) round(rounds++, -1);
    for (int timed = 0; timed < iters; ++timed) round(rounds++, timed);
    FUSEMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::vector<TimingStats> stats;
    for (size_t j = 0; j < num_ops; ++j) {
      std::vector<float> samples_ms(iters);
      for (int i = 0; i < iters; ++i) {
        FUSEMOE_CUDA_CHECK(cudaEventElapsedTime(&samples_ms[i], event(j, i, 0), event(j, i, 1)));
      }
      stats.push_back(summarize(std::move(samples_ms)));
    }
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    return stats;
  } catch (...) {
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    throw;
  }
}

TimingStats EventTimer::run(const std::function<void()>& op, int warmup, int iters, bool flush_l2) {
  return run_interleaved({op}, warmup, iters, flush_l2).front();
}

}  // namespace fusemoe::harness

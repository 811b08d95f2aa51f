// Per-kernel device times of the layer inside fusemoe_bench's own loop (--kernel-times), from
// CUPTI's kernel activity records: what each kernel costs at the clock the power cap leaves a
// training step, with the caches as the calls before leave them. Nsight Compute replays a kernel
// alone, at the clock the GPU recovers between replays, and can rank two builds of a kernel the
// other way round from the layer (docs/perf.md#kernels-inside-the-layer). libcupti is loaded at run
// time (dlopen) and only when asked for, so the bench runs where CUPTI is absent.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fusemoe::bench {

// One kernel execution: the tag of the launch group it came from, its GPU timestamps, its name
// (demangled where the C++ ABI could).
struct KernelRecord {
  uint64_t tag = 0;
  uint64_t start_ns = 0, end_ns = 0;
  std::string name;
};

// One kernel of a pass (or, where the calls' kernel sequences differ, one kernel name), over the
// traced calls.
struct KernelTime {
  std::string name, short_name;
  int count = 0;  // executions per call
  double median_us = 0, min_us = 0, max_us = 0;
};

// One pass of one implementation over its traced calls, kernels in launch order.
struct PassKernels {
  std::string impl, pass, wgrad;
  int calls = 0;
  std::vector<KernelTime> kernels;
  double kernels_median_us = 0;  // median over the calls of the sum of the kernels' times
  double span_median_us = 0;     // median over the calls of first kernel start to last kernel end
  // Median over the same calls of the CUDA events around the pass, as the timed loop records them
  // (0: not recorded). Event minus span is the pass's time outside its kernels (before the first,
  // after the last); span minus the sum, the gaps between them.
  double event_median_us = 0;
  // Median over the calls (those with a kernel before them) of the device's time between the
  // last kernel before the call's first one and it: the L2 flush, and any idle time while the
  // host caught up. 0: none measured.
  double gap_before_median_us = 0;
  std::string note;              // set when the calls ran different kernel sequences
};

// CUPTI's kernel records while it lives. One at a time per process (CUPTI's buffers are global).
class KernelTracer {
 public:
  // Loads libcupti (FUSEMOE_CUPTI_LIB, else libcupti.so.13 / libcupti.so on the loader's path and
  // in the CUDA toolkit's usual folders) and enables the kernel and external-correlation records;
  // nullptr with *why set when it cannot.
  static std::unique_ptr<KernelTracer> start(std::string* why);
  ~KernelTracer();  // disables the records
  KernelTracer(const KernelTracer&) = delete;
  KernelTracer& operator=(const KernelTracer&) = delete;

  // The kernels launched by this thread between push(tag) and pop() carry tag; the others none.
  void push(uint64_t tag);
  void pop();
  // Waits for the device, flushes CUPTI's buffers and returns every tagged kernel record so far,
  // then forgets them. *dropped: records CUPTI lost; *untagged: kernel records left out for
  // having no tag (launched outside push/pop: the L2 flush).
  std::vector<KernelRecord> take(uint64_t* dropped, uint64_t* untagged);

 private:
  KernelTracer() = default;
};

// The kernels of one pass from the records of its calls (one tag per call).
PassKernels summarize_pass(const std::vector<KernelRecord>& records, const std::vector<uint64_t>& call_tags);

// "gemm <epilogue>" for an instance of the grouped GEMM (its epilogue tells the GEMMs apart), the
// unqualified function name without template arguments for the others.
std::string short_kernel_name(const std::string& demangled);

}  // namespace fusemoe::bench

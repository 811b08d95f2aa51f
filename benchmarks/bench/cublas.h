// The cuBLAS baselines the benchmarks measure in the same run as fusemoe: the bf16 GEMM
// ceiling (a large dense GEMM), a dense GEMM of a given size, and a grouped GEMM with one group
// per expert (cublasGemmGroupedBatchedEx). bf16 operands and outputs, fp32 accumulation.
// Matrices are row-major here; cuBLAS's column-major view is handled inside.
#pragma once

#include <cublas_v2.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/device_buffer.h"
#include "common/timer.h"

#define BENCH_CUBLAS_CHECK(expr)                                              \
  do {                                                                        \
    const cublasStatus_t bench_status_ = (expr);                              \
    FUSEMOE_CHECK(bench_status_ == CUBLAS_STATUS_SUCCESS,                     \
                  #expr << " failed: " << cublasGetStatusString(bench_status_)); \
  } while (0)

namespace fusemoe::bench {

class CublasHandle {
 public:
  explicit CublasHandle(cudaStream_t stream);
  ~CublasHandle();
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  cublasHandle_t get() const { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
};

struct Ceiling {
  std::string what;
  double tflops = 0;
  harness::TimingStats stats;
};

// The matrix throughput this GPU reaches today, so that every figure is also a fraction of it.
Ceiling measure_gemm_ceiling(cudaStream_t stream, harness::EventTimer& timer, uint64_t seed);

// One row-major product C [m, n] = op(A) op(B): A is [m, k] ([k, m] when a_transposed), B is
// [k, n] ([n, k] when b_transposed); bf16, C bf16.
struct GemmOperands {
  const void* a;
  bool a_transposed;
  const void* b;
  bool b_transposed;
  void* c;
  int64_t m, n, k;
};

void dense_gemm(const CublasHandle& handle, const GemmOperands& g);

// Many products in one cublasGemmGroupedBatchedEx call (products with m, n or k of 0 dropped).
class CublasGrouped {
 public:
  explicit CublasGrouped(const std::vector<GemmOperands>& gemms);
  void run(const CublasHandle& handle) const;

 private:
  std::vector<cublasOperation_t> trans_a_, trans_b_;
  std::vector<int> m_, n_, k_, lda_, ldb_, ldc_, group_size_;
  std::vector<float> alpha_, beta_;
  harness::DeviceBuffer a_ptrs_, b_ptrs_, c_ptrs_;
};

}  // namespace fusemoe::bench

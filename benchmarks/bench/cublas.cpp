#include "bench/cublas.h"

#include "common/device_checks.h"

namespace fusemoe::bench {
namespace {

// The ceiling GEMM: large enough to be compute-bound with any tile shape cuBLAS picks.
constexpr int64_t kCeilingDim = 8192;
constexpr int kCeilingWarmup = 10;  // the SM clock ramps up from idle (~345 MHz) first
constexpr int kCeilingIters = 10;

// cuBLAS is column-major: the row-major C [m, n] = A B is C^T [n, m] = B^T A^T there, so B
// comes first and each row-major [r, c] operand is a column-major [c, r] one (leading dim c).
struct ColumnMajor {
  cublasOperation_t op_first, op_second;
  int m, n, k, ld_first, ld_second, ld_c;
};

ColumnMajor column_major(const GemmOperands& g) {
  return ColumnMajor{g.b_transposed ? CUBLAS_OP_T : CUBLAS_OP_N,
                     g.a_transposed ? CUBLAS_OP_T : CUBLAS_OP_N,
                     static_cast<int>(g.n),
                     static_cast<int>(g.m),
                     static_cast<int>(g.k),
                     static_cast<int>(g.b_transposed ? g.k : g.n),
                     static_cast<int>(g.a_transposed ? g.m : g.k),
                     static_cast<int>(g.n)};
}

}  // namespace

CublasHandle::CublasHandle(cudaStream_t stream) {
  BENCH_CUBLAS_CHECK(cublasCreate(&handle_));
  const cublasStatus_t status = cublasSetStream(handle_, stream);
  if (status != CUBLAS_STATUS_SUCCESS) {
    cublasDestroy(handle_);
    BENCH_CUBLAS_CHECK(status);
  }
}

CublasHandle::~CublasHandle() { cublasDestroy(handle_); }

// Not flushed: a compute-bound GEMM of 400 MB of operands does not gain from a warm L2.
Ceiling measure_gemm_ceiling(cudaStream_t stream, harness::EventTimer& timer, uint64_t seed) {
  constexpr int64_t n = kCeilingDim;
  harness::DeviceBuffer a(n * n * 2), b(n * n * 2), c(n * n * 2);
  harness::fill_normal_bf16(a.get(), n * n, seed + 101, 1.0f, stream);
  harness::fill_normal_bf16(b.get(), n * n, seed + 102, 1.0f, stream);
  const CublasHandle handle(stream);
  Ceiling ceiling;
  ceiling.what = "cuBLAS cublasGemmEx bf16 in/out, fp32 compute, " + std::to_string(n) + "^3, random data";
  const GemmOperands square{a.get(), false, b.get(), false, c.get(), n, n, n};
  ceiling.stats = timer.run([&] { dense_gemm(handle, square); }, kCeilingWarmup, kCeilingIters, /*flush_l2=*/false);
  ceiling.tflops = 2.0 * n * n * n / (ceiling.stats.median_ms * 1e-3) / 1e12;
  return ceiling;
}

void dense_gemm(const CublasHandle& handle, const GemmOperands& g) {
  const ColumnMajor cm = column_major(g);
  const float alpha = 1.0f, beta = 0.0f;
  BENCH_CUBLAS_CHECK(cublasGemmEx(handle.get(), cm.op_first, cm.op_second, cm.m, cm.n, cm.k, &alpha, g.b, CUDA_R_16BF,
                                  cm.ld_first, g.a, CUDA_R_16BF, cm.ld_second, &beta, g.c, CUDA_R_16BF, cm.ld_c,
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

CublasGrouped::CublasGrouped(const std::vector<GemmOperands>& gemms) {
  std::vector<const void*> a, b;
  std::vector<void*> c;
  for (const GemmOperands& g : gemms) {
    if (g.m == 0 || g.n == 0 || g.k == 0) continue;
    const ColumnMajor cm = column_major(g);
    trans_a_.push_back(cm.op_first);
    trans_b_.push_back(cm.op_second);
    m_.push_back(cm.m);
    n_.push_back(cm.n);
    k_.push_back(cm.k);
    lda_.push_back(cm.ld_first);
    ldb_.push_back(cm.ld_second);
    ldc_.push_back(cm.ld_c);
    alpha_.push_back(1.0f);
    beta_.push_back(0.0f);
    group_size_.push_back(1);
    a.push_back(g.b);
    b.push_back(g.a);
    c.push_back(g.c);
  }
  a_ptrs_ = harness::DeviceBuffer::from(a);
  b_ptrs_ = harness::DeviceBuffer::from(b);
  c_ptrs_ = harness::DeviceBuffer::from(c);
}

void CublasGrouped::run(const CublasHandle& handle) const {
  if (m_.empty()) return;
  BENCH_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
      handle.get(), trans_a_.data(), trans_b_.data(), m_.data(), n_.data(), k_.data(), alpha_.data(),
      a_ptrs_.as<const void*>(), CUDA_R_16BF, lda_.data(), b_ptrs_.as<const void*>(), CUDA_R_16BF, ldb_.data(),
      beta_.data(), c_ptrs_.as<void*>(), CUDA_R_16BF, ldc_.data(), static_cast<int>(m_.size()), group_size_.data(),
      CUBLAS_COMPUTE_32F));
}

}  // namespace fusemoe::bench

#include "common/device_checks.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

#include "common/device.h"
#include "common/device_buffer.h"
#include "fusemoe/error.h"

namespace fusemoe::harness {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;  // 8 x 256 threads: a full H100/H200 SM

dim3 grid_for(int64_t n) {
  const int64_t max_blocks = int64_t{num_sms()} * kBlocksPerSm;
  return dim3(static_cast<unsigned>(std::max<int64_t>(1, std::min((n + kThreads - 1) / kThreads, max_blocks))));
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Box-Muller from two 24-bit uniforms in (0, 1).
__device__ __forceinline__ float normal_at(uint64_t seed, int64_t i) {
  const uint64_t bits = splitmix64(seed ^ splitmix64(static_cast<uint64_t>(i)));
  const float u1 = (static_cast<float>(bits >> 40) + 0.5f) * 0x1p-24f;
  const float u2 = (static_cast<float>(bits & 0xFFFFFFu) + 0.5f) * 0x1p-24f;
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

template <typename T>
__global__ void fill_normal_kernel(T* out, int64_t n, uint64_t seed, float scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = normal_at(seed, i) * scale;
    if constexpr (sizeof(T) == 2) {
      out[i] = __float2bfloat16_rn(v);
    } else {
      out[i] = v;
    }
  }
}

__device__ __forceinline__ float load(const void* base, DType dtype, int64_t i) {
  return dtype == DType::kBf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i])
                               : static_cast<const float*>(base)[i];
}

struct Sums {
  double diff_sq, out_sq, ref_sq, out_ref;
  unsigned long long bad, first_bad, nonfinite_out, nonfinite_ref;
  unsigned int max_abs_bits;  // float bits: non-negative floats order like their bits
};

struct CompareArgs {
  DeviceTensor out, ref, addend;
  const int32_t* out_row;
  const float* row_scale;
  int64_t rows, cols, out_stride;
  float rtol, atol;
};

__device__ __forceinline__ double warp_sum(double v) {
  for (int d = 16; d > 0; d /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, d);
  return v;
}
__device__ __forceinline__ unsigned long long warp_sum(unsigned long long v) {
  for (int d = 16; d > 0; d /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, d);
  return v;
}

__global__ void __launch_bounds__(kThreads) compare_kernel(CompareArgs a, Sums* sums) {
  double diff_sq = 0, out_sq = 0, ref_sq = 0, out_ref = 0;
  unsigned long long bad = 0, first_bad = ~0ull, nonfinite_out = 0, nonfinite_ref = 0;
  float max_abs = 0.0f;
  const int64_t n = a.rows * a.cols, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t r = i / a.cols, c = i - r * a.cols;
    const int64_t row = a.out_row ? a.out_row[r] : r;
    const int64_t dest = row * a.out_stride + c;
    float y = load(a.ref.ptr, a.ref.dtype, i);
    if (a.row_scale) y *= a.row_scale[row];
    if (a.addend.ptr) y += load(a.addend.ptr, a.addend.dtype, dest);
    const float x = load(a.out.ptr, a.out.dtype, dest);
    const float err = fabsf(x - y);
    if (!(err <= a.rtol * fabsf(y) + a.atol)) {
      ++bad;
      first_bad = min(first_bad, static_cast<unsigned long long>(i));
    }
    const bool finite_x = isfinite(x), finite_y = isfinite(y);
    nonfinite_out += !finite_x;
    nonfinite_ref += !finite_y;
    if (finite_y) ref_sq += double(y) * y;  // rms(y) counts every finite y, whatever x holds
    if (finite_x && finite_y) {
      diff_sq += double(err) * err;
      out_sq += double(x) * x;
      out_ref += double(x) * y;
      max_abs = fmaxf(max_abs, err);
    }
  }
  diff_sq = warp_sum(diff_sq);
  out_sq = warp_sum(out_sq);
  ref_sq = warp_sum(ref_sq);
  out_ref = warp_sum(out_ref);
  bad = warp_sum(bad);
  nonfinite_out = warp_sum(nonfinite_out);
  nonfinite_ref = warp_sum(nonfinite_ref);
  for (int d = 16; d > 0; d /= 2) {
    first_bad = min(first_bad, __shfl_xor_sync(0xFFFFFFFFu, first_bad, d));
    max_abs = fmaxf(max_abs, __shfl_xor_sync(0xFFFFFFFFu, max_abs, d));
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(&sums->diff_sq, diff_sq);
    atomicAdd(&sums->out_sq, out_sq);
    atomicAdd(&sums->ref_sq, ref_sq);
    atomicAdd(&sums->out_ref, out_ref);
    atomicAdd(&sums->bad, bad);
    atomicMin(&sums->first_bad, first_bad);
    atomicAdd(&sums->nonfinite_out, nonfinite_out);
    atomicAdd(&sums->nonfinite_ref, nonfinite_ref);
    atomicMax(&sums->max_abs_bits, __float_as_uint(max_abs));
  }
}

__global__ void count_bytes_kernel(const uint8_t* buffer, int64_t rows, int64_t row_bytes, const uint8_t* keep,
                                   uint8_t value, unsigned long long* count) {
  unsigned long long n = 0;
  const int64_t total = rows * row_bytes, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    n += keep[i / row_bytes] && buffer[i] != value;
  }
  n = warp_sum(n);
  if (threadIdx.x % 32 == 0 && n) atomicAdd(count, n);
}

// keep == null: every row.
__global__ void count_different_kernel(const uint8_t* a, const uint8_t* b, int64_t rows, int64_t row_bytes,
                                       const uint8_t* keep, unsigned long long* count) {
  unsigned long long d = 0;
  const int64_t n = rows * row_bytes, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    d += (keep == nullptr || keep[i / row_bytes]) && a[i] != b[i];
  }
  d = warp_sum(d);
  if (threadIdx.x % 32 == 0 && d) atomicAdd(count, d);
}

template <typename Launch>
uint64_t run_count(Launch&& launch) {
  FUSEMOE_CUDA_CHECK(cudaDeviceSynchronize());
  DeviceBuffer count(sizeof(unsigned long long));
  FUSEMOE_CUDA_CHECK(cudaMemset(count.get(), 0, count.bytes()));
  launch(count.as<unsigned long long>());
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
  return count.to_host<unsigned long long>()[0];
}

}  // namespace

void fill_normal_bf16(void* out, int64_t n, uint64_t seed, float scale, cudaStream_t stream) {
  if (n == 0) return;
  fill_normal_kernel<<<grid_for(n), kThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(out), n, seed, scale);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

void fill_normal_fp32(float* out, int64_t n, uint64_t seed, float scale, cudaStream_t stream) {
  if (n == 0) return;
  fill_normal_kernel<<<grid_for(n), kThreads, 0, stream>>>(out, n, seed, scale);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

std::string CompareResult::describe(int64_t cols) const {
  char text[320];
  int used = std::snprintf(text, sizeof(text),
                           "bad %llu / %lld, max_abs_err %.3e, rms_ref %.3e, atol %.2e, rel_l2 %.2e, calc_diff %.2e, "
                           "non-finite %llu (reference %llu)",
                           static_cast<unsigned long long>(num_bad), static_cast<long long>(count), max_abs_err,
                           rms_ref, atol, rel_l2, calc_diff, static_cast<unsigned long long>(nonfinite_out),
                           static_cast<unsigned long long>(nonfinite_ref));
  if (first_bad >= 0 && cols > 0 && used > 0 && used < static_cast<int>(sizeof(text))) {
    std::snprintf(text + used, sizeof(text) - used, ", first bad (row %lld, col %lld)",
                  static_cast<long long>(first_bad / cols), static_cast<long long>(first_bad % cols));
  }
  return text;
}

CompareResult compare(DeviceTensor out, DeviceTensor ref, int64_t rows, int64_t cols, const CompareOptions& options) {
  CompareResult result;
  result.count = rows * cols;
  if (result.count == 0) return result;
  FUSEMOE_CUDA_CHECK(cudaDeviceSynchronize());
  DeviceBuffer sums_buffer(sizeof(Sums));
  CompareArgs args{out, ref, options.addend, options.out_row, options.row_scale, rows, cols,
                   options.out_stride < 0 ? cols : options.out_stride, static_cast<float>(options.rtol), 0.0f};
  auto pass = [&](double atol) {
    Sums init{};
    init.first_bad = ~0ull;
    FUSEMOE_CUDA_CHECK(cudaMemcpy(sums_buffer.get(), &init, sizeof(init), cudaMemcpyHostToDevice));
    args.atol = static_cast<float>(atol);
    compare_kernel<<<grid_for(result.count), kThreads>>>(args, sums_buffer.as<Sums>());
    FUSEMOE_CUDA_CHECK(cudaGetLastError());
    return sums_buffer.to_host<Sums>()[0];
  };
  Sums sums{};
  result.atol = options.atol;
  if (options.atol_of_rms > 0.0) {  // the first pass only measures rms(y)
    sums = pass(std::numeric_limits<double>::infinity());
    result.atol += options.atol_of_rms * std::sqrt(sums.ref_sq / static_cast<double>(result.count));
  }
  sums = pass(result.atol);
  result.num_bad = sums.bad;
  result.first_bad = sums.first_bad == ~0ull ? -1 : static_cast<int64_t>(sums.first_bad);
  result.nonfinite_out = sums.nonfinite_out;
  result.nonfinite_ref = sums.nonfinite_ref;
  float max_abs;
  static_assert(sizeof(max_abs) == sizeof(sums.max_abs_bits), "float bits");
  std::memcpy(&max_abs, &sums.max_abs_bits, sizeof(max_abs));
  result.max_abs_err = max_abs;
  result.rel_l2 = sums.ref_sq > 0 ? std::sqrt(sums.diff_sq / sums.ref_sq) : std::sqrt(sums.diff_sq);
  const double denom = sums.out_sq + sums.ref_sq;
  result.calc_diff = denom > 0 ? 1.0 - 2.0 * sums.out_ref / denom : 0.0;
  result.rms_ref = std::sqrt(sums.ref_sq / static_cast<double>(result.count));
  return result;
}

uint64_t count_bytes_other_than(const void* buffer, int64_t rows, int64_t row_bytes, const uint8_t* keep_device,
                                uint8_t value) {
  if (rows * row_bytes == 0) return 0;
  return run_count([&](unsigned long long* count) {
    count_bytes_kernel<<<grid_for(rows * row_bytes), kThreads>>>(static_cast<const uint8_t*>(buffer), rows, row_bytes,
                                                                 keep_device, value, count);
  });
}

uint64_t count_different_bytes_in_rows(const void* a, const void* b, int64_t rows, int64_t row_bytes,
                                       const uint8_t* keep_device) {
  if (rows * row_bytes == 0) return 0;
  return run_count([&](unsigned long long* count) {
    count_different_kernel<<<grid_for(rows * row_bytes), kThreads>>>(
        static_cast<const uint8_t*>(a), static_cast<const uint8_t*>(b), rows, row_bytes, keep_device, count);
  });
}

uint64_t count_different_bytes(const void* a, const void* b, size_t bytes) {
  return count_different_bytes_in_rows(a, b, 1, static_cast<int64_t>(bytes), nullptr);
}

}  // namespace fusemoe::harness

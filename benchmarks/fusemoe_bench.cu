// fusemoe_bench: times the fusemoe MoE layer (forward, backward, forward + backward) on one
// Hopper GPU, after checking every implementation against the library's fp32 GPU reference.
//   useful FLOPs per valid routed row: 6·H·I forward (gate/up 4·H·I, down 2·H·I), 12·H·I
//   backward, 18·H·I forward + backward; masked slots count nothing.
// One run: GPU facts → bf16 GEMM ceiling (cuBLAS 8192³) → weights → per token count: routing
// on the host, correctness check (NaN-poisoned outputs), timings (CUDA events, median, L2
// flushed before every timed call, the implementations interleaved call by call) → table on
// stdout, progress on stderr, figures in --json.
// Exit: 0 ok, 1 a correctness check failed, 2 bad arguments, 3 no Hopper GPU, 4 runtime error.
// Shapes: T tokens, H hidden, I expert intermediate, E experts, K top-k, R valid routed rows.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "fusemoe/fusemoe.h"

namespace {

using bf16 = __nv_bfloat16;

constexpr int kExitOk = 0;
constexpr int kExitCheckFailed = 1;
constexpr int kExitBadArgs = 2;
constexpr int kExitNoHopper = 3;
constexpr int kExitRuntimeError = 4;

// bf16 keeps 8 significant bits (relative step 2^-8 ≈ 4e-3); a layer's outputs carry a few such
// roundings, so 2e-2 relative (Frobenius) error separates "bf16 noise" from "wrong".
constexpr double kRelErrTol = 2e-2;
// Written before every timed call so that weights and activations start cold: 4x the H200's
// 60 MB L2, so nothing of the previous call survives.
constexpr size_t kL2FlushBytes = size_t{256} << 20;
// The ceiling GEMM: large enough to be compute-bound with any tile shape cuBLAS picks.
constexpr int kCeilingDim = 8192;
constexpr int kCeilingWarmup = 10;  // the SM clock ramps up from idle (~345 MHz) first
constexpr int kCeilingIters = 10;
// Zipf exponent of the skewed routing: the most popular expert gets ~27% of the first draws.
constexpr double kSkewExponent = 1.2;

#define BENCH_CUBLAS_CHECK(expr)                                                 \
  do {                                                                           \
    cublasStatus_t bench_status_ = (expr);                                       \
    FUSEMOE_CHECK(bench_status_ == CUBLAS_STATUS_SUCCESS,                        \
                  #expr << " failed: " << cublasGetStatusString(bench_status_)); \
  } while (0)

// ----------------------------------------------------------------------------------------------
// Parameters
// ----------------------------------------------------------------------------------------------

struct Preset {
  const char* name;
  const char* short_name;  // for progress lines
  int64_t hidden, intermediate, num_experts, top_k;
};

constexpr Preset kPresets[] = {
    {"qwen3-30b-a3b", "30B", 2048, 768, 128, 8},
    {"qwen3-235b-a22b", "235B", 4096, 1536, 128, 8},
};

struct BenchImpl {
  const char* name;  // command-line and report name
  fusemoe::Impl impl;
  bool has_backward;  // false: forward only (its backward is not implemented yet)
  bool save_z;        // the forward saves z (ForwardArgs::saved_z), the backward reads it
  fusemoe::Precision precision = fusemoe::Precision::kBf16;
  // Relative error allowed against the fp32 reference. FP8: E4M3's quantization alone gives ~6%
  // on these inputs; the GPU suite holds FP8 to 1.1x its emulation's error (tests/gpu/
  // test_fp8_layer.cpp), this check only catches a broken path.
  double check_tol = kRelErrTol;
};

// Implementations the benchmark can time (the fp32 reference is the oracle, never timed).
// A new fusemoe::Impl is one line here; the default --impl list is all of them.
constexpr BenchImpl kBenchImpls[] = {
    {"unfused", fusemoe::Impl::kUnfused, true, false},
    {"fused", fusemoe::Impl::kFused, true, false},
    // As the PyTorch op runs it when gradients are needed.
    {"fused_saved_z", fusemoe::Impl::kFused, true, true},
    // Blockwise FP8 (Precision::kFp8Blockwise); the weights are quantized once before timing, as
    // a training step does once per optimizer step.
    {"fused_fp8", fusemoe::Impl::kFused, true, false, fusemoe::Precision::kFp8Blockwise, 1e-1},
    {"fused_fp8_saved_z", fusemoe::Impl::kFused, true, true, fusemoe::Precision::kFp8Blockwise, 1e-1},
};
// The fp32 GPU oracle every implementation is checked against.
constexpr BenchImpl kReferenceImpl = {"reference_fp32", fusemoe::Impl::kReferenceFp32, true, false};

enum class Routing { kUniform, kSkewed };

const char* routing_name(Routing routing) {
  return routing == Routing::kUniform ? "uniform" : "skewed";
}

struct BenchParams {
  Preset preset = kPresets[0];
  std::vector<int64_t> tokens = {4096};
  Routing routing = Routing::kUniform;
  std::vector<BenchImpl> impls;
  int iters = 20;
  int warmup = 5;
  std::string json_path;
  uint64_t seed = 1234;
  bool check = true;
  // Token counts above this are timed but not checked (the fp32 reference is slow at 235B).
  int64_t check_max_tokens = std::numeric_limits<int64_t>::max();
};

struct UsageError {
  std::string message;
};

const char* kUsage =
    "usage: fusemoe_bench [--preset qwen3-30b-a3b|qwen3-235b-a22b] [--tokens N[,N...]]\n"
    "                     [--routing uniform|skewed] [--impl NAME[,NAME...]] [--iters N]\n"
    "                     [--warmup N] [--json PATH] [--seed N] [--no-check]\n"
    "                     [--check-max-tokens N]\n"
    "  --preset            layer shape (default qwen3-30b-a3b: H=2048 I=768 E=128 K=8;\n"
    "                      qwen3-235b-a22b: H=4096 I=1536 E=128 K=8)\n"
    "  --tokens            token counts to run, comma separated (default 4096)\n"
    "  --routing           uniform: K distinct experts uniformly at random per token;\n"
    "                      skewed: Zipf popularity p(e) ~ 1/(rank+1)^1.2 (default uniform)\n"
    "  --impl              implementations to time (default: all of them: unfused, fused,\n"
    "                      fused_saved_z = fused with the forward saving z for the backward,\n"
    "                      fused_fp8 and fused_fp8_saved_z = the same at blockwise FP8)\n"
    "  --iters, --warmup   timed runs (median reported) and untimed runs before (20, 5)\n"
    "  --json              write all figures and metadata to PATH\n"
    "  --seed              seed of the inputs and the routing (default 1234)\n"
    "  --no-check          skip the correctness check against the fp32 reference\n"
    "  --check-max-tokens  check only token counts <= N (others are timed, check 'skipped')\n"
    "exit: 0 ok, 1 correctness failure, 2 bad arguments, 3 no Hopper GPU, 4 runtime error\n";

int64_t parse_int(const std::string& flag, const std::string& text, int64_t min_value) {
  size_t used = 0;
  long long value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size()) {
    throw UsageError{flag + " expects an integer, got '" + text + "'"};
  }
  if (value < min_value) {
    throw UsageError{flag + " must be >= " + std::to_string(min_value) + ", got " + text};
  }
  return value;
}

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream stream(text);
  std::string part;
  while (std::getline(stream, part, ',')) parts.push_back(part);
  return parts;
}

BenchParams parse_args(int argc, char** argv) {
  BenchParams params;
  for (const BenchImpl& impl : kBenchImpls) params.impls.push_back(impl);
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    std::string value;
    bool has_inline_value = false;
    if (size_t eq = flag.find('='); flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
      has_inline_value = true;
    }
    auto next_value = [&]() -> std::string {
      if (has_inline_value) return value;
      if (i + 1 >= argc) throw UsageError{flag + " needs a value"};
      return argv[++i];
    };
    if (flag == "--help" || flag == "-h") {
      throw UsageError{""};
    } else if (flag == "--preset") {
      std::string name = next_value();
      bool found = false;
      for (const Preset& preset : kPresets) {
        if (name == preset.name) {
          params.preset = preset;
          found = true;
        }
      }
      if (!found) throw UsageError{"unknown --preset '" + name + "'"};
    } else if (flag == "--tokens") {
      params.tokens.clear();
      for (const std::string& part : split_commas(next_value())) {
        params.tokens.push_back(parse_int("--tokens", part, 1));
      }
      if (params.tokens.empty()) throw UsageError{"--tokens needs at least one count"};
    } else if (flag == "--routing") {
      std::string name = next_value();
      if (name == "uniform") {
        params.routing = Routing::kUniform;
      } else if (name == "skewed") {
        params.routing = Routing::kSkewed;
      } else {
        throw UsageError{"unknown --routing '" + name + "' (uniform or skewed)"};
      }
    } else if (flag == "--impl") {
      params.impls.clear();
      for (const std::string& name : split_commas(next_value())) {
        const BenchImpl* match = nullptr;
        for (const BenchImpl& impl : kBenchImpls) {
          if (name == impl.name) match = &impl;
        }
        if (match == nullptr) {
          std::string known;
          for (const BenchImpl& impl : kBenchImpls) known += std::string(" ") + impl.name;
          throw UsageError{"unknown --impl '" + name + "' (known:" + known + ")"};
        }
        params.impls.push_back(*match);
      }
      if (params.impls.empty()) throw UsageError{"--impl needs at least one name"};
    } else if (flag == "--iters") {
      params.iters = static_cast<int>(parse_int(flag, next_value(), 1));
    } else if (flag == "--warmup") {
      params.warmup = static_cast<int>(parse_int(flag, next_value(), 0));
    } else if (flag == "--json") {
      params.json_path = next_value();
      if (params.json_path.empty()) throw UsageError{"--json needs a path"};
    } else if (flag == "--seed") {
      params.seed = static_cast<uint64_t>(parse_int(flag, next_value(), 0));
    } else if (flag == "--no-check") {
      if (has_inline_value) throw UsageError{"--no-check takes no value"};
      params.check = false;
    } else if (flag == "--check-max-tokens") {
      params.check_max_tokens = parse_int(flag, next_value(), 0);
    } else {
      throw UsageError{"unknown argument '" + std::string(argv[i]) + "'"};
    }
  }
  return params;
}

// ----------------------------------------------------------------------------------------------
// GPU facts
// ----------------------------------------------------------------------------------------------

struct GpuInfo {
  int device = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  size_t memory_bytes = 0;
  int l2_bytes = 0;
  int driver_version = 0;   // CUDA version the driver supports, e.g. 13000
  int runtime_version = 0;  // CUDA runtime this binary runs with
  int cublas_version = 0;
};

std::string cuda_version_string(int version) {
  return std::to_string(version / 1000) + "." + std::to_string((version % 1000) / 10);
}

// Returns false with `reason` filled when there is no usable sm_90 device.
bool find_hopper(GpuInfo* info, std::string* reason) {
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    *reason = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(status);
    return false;
  }
  if (count == 0) {
    *reason = "no CUDA device";
    return false;
  }
  cudaDeviceProp prop{};
  FUSEMOE_CUDA_CHECK(cudaGetDevice(&info->device));
  FUSEMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, info->device));
  if (prop.major != 9) {
    *reason = std::string(prop.name) + " is compute capability " + std::to_string(prop.major) +
              "." + std::to_string(prop.minor);
    return false;
  }
  info->name = prop.name;
  info->cc_major = prop.major;
  info->cc_minor = prop.minor;
  info->sm_count = prop.multiProcessorCount;
  info->memory_bytes = prop.totalGlobalMem;
  info->l2_bytes = prop.l2CacheSize;
  FUSEMOE_CUDA_CHECK(cudaDriverGetVersion(&info->driver_version));
  FUSEMOE_CUDA_CHECK(cudaRuntimeGetVersion(&info->runtime_version));
  BENCH_CUBLAS_CHECK(cublasGetProperty(MAJOR_VERSION, &info->cublas_version));
  int minor = 0, patch = 0;
  BENCH_CUBLAS_CHECK(cublasGetProperty(MINOR_VERSION, &minor));
  BENCH_CUBLAS_CHECK(cublasGetProperty(PATCH_LEVEL, &patch));
  info->cublas_version = info->cublas_version * 10000 + minor * 100 + patch;
  return true;
}

// The commit under test: a compile definition wins, then $FUSEMOE_COMMIT, else "unknown".
std::string commit_id() {
#ifdef FUSEMOE_COMMIT
  return FUSEMOE_COMMIT;
#else
  const char* env = std::getenv("FUSEMOE_COMMIT");
  return (env != nullptr && env[0] != '\0') ? env : "unknown";
#endif
}

std::string utc_now() {
  std::time_t now = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return text;
}

// ----------------------------------------------------------------------------------------------
// Device memory and kernels (input generation, comparison)
// ----------------------------------------------------------------------------------------------

// Owns one cudaMalloc allocation (256-byte aligned, as the API asks of the workspace).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes > 0) FUSEMOE_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept { swap(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    DeviceBuffer(std::move(other)).swap(*this);
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  void swap(DeviceBuffer& other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(bytes_, other.bytes_);
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  // 0xFF bytes are NaN in bf16 and fp32: any output element a call fails to write shows up.
  void poison(cudaStream_t stream) const {
    if (bytes_ > 0) FUSEMOE_CUDA_CHECK(cudaMemsetAsync(ptr_, 0xFF, bytes_, stream));
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Grid of a grid-stride kernel: enough blocks to fill every SM a few times over.
dim3 grid_for(int64_t n, int threads) {
  constexpr int64_t kMaxBlocks = 132 * 8;  // H200: 132 SMs, 8 resident 256-thread blocks each
  return dim3(static_cast<unsigned>(
      std::max<int64_t>(1, std::min((n + threads - 1) / threads, kMaxBlocks))));
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// out[i] = scale * N(0,1) from a counter-based hash: same values for the same seed on any grid.
__global__ void fill_normal_bf16_kernel(bf16* out, int64_t n, uint64_t seed, float scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    uint64_t bits = splitmix64(seed ^ splitmix64(static_cast<uint64_t>(i)));
    // Two 24-bit uniforms in (0, 1) → Box-Muller.
    float u1 = (static_cast<float>(bits >> 40) + 0.5f) * 0x1p-24f;
    float u2 = (static_cast<float>(bits & 0xFFFFFFu) + 0.5f) * 0x1p-24f;
    float z = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    out[i] = __float2bfloat16_rn(z * scale);
  }
}

void fill_normal_bf16(const DeviceBuffer& buffer, int64_t n, uint64_t seed, float scale,
                      cudaStream_t stream) {
  constexpr int kThreads = 256;
  fill_normal_bf16_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(buffer.as<bf16>(), n,
                                                                          seed, scale);
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
}

// Sums over one output pair (a = implementation, b = reference), accumulated in fp64.
struct CompareSums {
  double sum_diff_sq;              // Σ(a-b)²
  double sum_a_sq;                 // Σa²
  double sum_b_sq;                 // Σb²
  double sum_ab;                   // Σab
  unsigned int max_abs_diff_bits;  // float bits; non-negative floats order like their bits
  unsigned long long nonfinite_a;
  unsigned long long nonfinite_b;
};

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(bf16 v) { return __bfloat162float(v); }

__device__ __forceinline__ double warp_sum(double v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  return v;
}

constexpr int kCompareThreads = 256;  // 8 warps: the block reduction below sums 8 partials

template <typename TA, typename TB>
__global__ void __launch_bounds__(kCompareThreads)
    compare_kernel(const TA* a, const TB* b, int64_t n, CompareSums* sums) {
  constexpr int kWarps = kCompareThreads / 32;
  double diff_sq = 0, a_sq = 0, b_sq = 0, ab = 0;
  float max_abs = 0.0f;
  unsigned long long bad_a = 0, bad_b = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    float va = to_float(a[i]);
    float vb = to_float(b[i]);
    bool finite_a = isfinite(va), finite_b = isfinite(vb);
    bad_a += !finite_a;
    bad_b += !finite_b;
    // Non-finite elements are counted (and fail the check) but kept out of the sums so the
    // error figures stay readable.
    if (finite_a && finite_b) {
      double da = va, db = vb;
      diff_sq += (da - db) * (da - db);
      a_sq += da * da;
      b_sq += db * db;
      ab += da * db;
      max_abs = fmaxf(max_abs, fabsf(va - vb));
    }
  }
  __shared__ double shared_sums[4][kWarps];
  __shared__ float shared_max[kWarps];
  __shared__ unsigned long long shared_bad[2][kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  diff_sq = warp_sum(diff_sq);
  a_sq = warp_sum(a_sq);
  b_sq = warp_sum(b_sq);
  ab = warp_sum(ab);
  for (int offset = 16; offset > 0; offset /= 2) {
    max_abs = fmaxf(max_abs, __shfl_xor_sync(0xFFFFFFFFu, max_abs, offset));
    bad_a += __shfl_xor_sync(0xFFFFFFFFu, bad_a, offset);
    bad_b += __shfl_xor_sync(0xFFFFFFFFu, bad_b, offset);
  }
  if (lane == 0) {
    shared_sums[0][warp] = diff_sq;
    shared_sums[1][warp] = a_sq;
    shared_sums[2][warp] = b_sq;
    shared_sums[3][warp] = ab;
    shared_max[warp] = max_abs;
    shared_bad[0][warp] = bad_a;
    shared_bad[1][warp] = bad_b;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) {
      shared_sums[0][0] += shared_sums[0][w];
      shared_sums[1][0] += shared_sums[1][w];
      shared_sums[2][0] += shared_sums[2][w];
      shared_sums[3][0] += shared_sums[3][w];
      shared_max[0] = fmaxf(shared_max[0], shared_max[w]);
      shared_bad[0][0] += shared_bad[0][w];
      shared_bad[1][0] += shared_bad[1][w];
    }
    atomicAdd(&sums->sum_diff_sq, shared_sums[0][0]);
    atomicAdd(&sums->sum_a_sq, shared_sums[1][0]);
    atomicAdd(&sums->sum_b_sq, shared_sums[2][0]);
    atomicAdd(&sums->sum_ab, shared_sums[3][0]);
    atomicMax(&sums->max_abs_diff_bits, __float_as_uint(shared_max[0]));
    atomicAdd(&sums->nonfinite_a, shared_bad[0][0]);
    atomicAdd(&sums->nonfinite_b, shared_bad[1][0]);
  }
}

// ----------------------------------------------------------------------------------------------
// Routing (host): Gumbel top-k = K distinct experts drawn without replacement ∝ p(e)
// ----------------------------------------------------------------------------------------------

struct RoutingData {
  std::vector<int32_t> topk_idx_TK;
  std::vector<float> topk_w_TK;
  int64_t valid_rows = 0;  // R: slots with an expert id >= 0
  std::vector<int64_t> rows_per_expert_E;
  int64_t min_rows = 0, max_rows = 0, num_empty_experts = 0;
};

// logits[e] = log p(e) + Gumbel noise; the top K logits are K distinct experts sampled without
// replacement with probabilities ∝ p(e) (uniform p: K distinct experts uniformly at random).
// The weights are the softmax over all E logits restricted to the top K and renormalised, i.e.
// the normalised top-k weights a softmax router produces. Skewed: p(e) ∝ 1/(rank(e)+1)^1.2 with
// ranks a random permutation fixed by the seed (the same popular experts for every T).
RoutingData make_routing(int64_t num_tokens, int64_t num_experts, int64_t top_k, Routing routing,
                         uint64_t seed) {
  std::mt19937_64 rank_rng(seed ^ 0x5EED0F5EEDull);
  std::vector<double> log_p_E(num_experts, 0.0);
  if (routing == Routing::kSkewed) {
    std::vector<int64_t> rank_E(num_experts);
    std::iota(rank_E.begin(), rank_E.end(), 0);
    std::shuffle(rank_E.begin(), rank_E.end(), rank_rng);
    for (int64_t e = 0; e < num_experts; ++e) {
      log_p_E[e] = -kSkewExponent * std::log(static_cast<double>(rank_E[e] + 1));
    }
  }
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(num_tokens));
  auto uniform_open = [&rng]() { return (static_cast<double>(rng() >> 11) + 0.5) * 0x1p-53; };

  RoutingData data;
  data.topk_idx_TK.resize(num_tokens * top_k);
  data.topk_w_TK.resize(num_tokens * top_k);
  data.rows_per_expert_E.assign(num_experts, 0);
  std::vector<double> logits_E(num_experts);
  std::vector<int32_t> order_E(num_experts);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t e = 0; e < num_experts; ++e) {
      logits_E[e] = log_p_E[e] - std::log(-std::log(uniform_open()));
    }
    std::iota(order_E.begin(), order_E.end(), 0);
    std::partial_sort(order_E.begin(), order_E.begin() + top_k, order_E.end(),
                      [&](int32_t a, int32_t b) { return logits_E[a] > logits_E[b]; });
    const double max_logit = logits_E[order_E[0]];
    double sum = 0.0;
    for (int64_t j = 0; j < top_k; ++j) sum += std::exp(logits_E[order_E[j]] - max_logit);
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t e = order_E[j];
      data.topk_idx_TK[t * top_k + j] = e;
      data.topk_w_TK[t * top_k + j] = static_cast<float>(std::exp(logits_E[e] - max_logit) / sum);
      data.rows_per_expert_E[e] += 1;
    }
  }
  data.valid_rows = num_tokens * top_k;  // no masked slots in these distributions
  data.min_rows = *std::min_element(data.rows_per_expert_E.begin(), data.rows_per_expert_E.end());
  data.max_rows = *std::max_element(data.rows_per_expert_E.begin(), data.rows_per_expert_E.end());
  data.num_empty_experts =
      std::count(data.rows_per_expert_E.begin(), data.rows_per_expert_E.end(), int64_t{0});
  return data;
}

// ----------------------------------------------------------------------------------------------
// Timing
// ----------------------------------------------------------------------------------------------

struct TimingStats {
  double median_ms = 0, min_ms = 0, max_ms = 0;
};

TimingStats summarize(std::vector<float> samples_ms) {
  std::sort(samples_ms.begin(), samples_ms.end());
  TimingStats stats;
  const size_t n = samples_ms.size();
  stats.median_ms =
      n % 2 == 1 ? samples_ms[n / 2] : 0.5 * (samples_ms[n / 2 - 1] + samples_ms[n / 2]);
  stats.min_ms = samples_ms.front();
  stats.max_ms = samples_ms.back();
  return stats;
}

// Times ops with CUDA events on `stream`: `warmup` untimed rounds, then `iters` timed ones;
// a round runs every op once, in order, so the ops compared share the GPU's thermal and clock
// state (run back to back, a kernel's time drifts by 5-10% as the GPU heats, which made a
// sequential comparison favour whatever ran first). With `flush_l2`, a 256 MiB write precedes
// every run (outside the events) so no run reads weights the previous one left in L2.
class EventTimer {
 public:
  explicit EventTimer(cudaStream_t stream) : stream_(stream), flush_(kL2FlushBytes) {}

  std::vector<TimingStats> run_interleaved(const std::vector<std::function<void()>>& ops, int warmup, int iters,
                                           bool flush_l2) {
    const size_t num_ops = ops.size();
    std::vector<cudaEvent_t> events(2 * static_cast<size_t>(iters) * num_ops);
    for (cudaEvent_t& event : events) FUSEMOE_CUDA_CHECK(cudaEventCreate(&event));
    auto event = [&](size_t op, int timed, int end) -> cudaEvent_t& { return events[(op * iters + timed) * 2 + end]; };
    try {
      for (int i = 0; i < warmup + iters; ++i) {
        const int timed = i - warmup;
        for (size_t j = 0; j < num_ops; ++j) {
          if (flush_l2) {
            FUSEMOE_CUDA_CHECK(cudaMemsetAsync(flush_.get(), i & 0xFF, flush_.bytes(), stream_));
          }
          if (timed >= 0) FUSEMOE_CUDA_CHECK(cudaEventRecord(event(j, timed, 0), stream_));
          ops[j]();
          if (timed >= 0) FUSEMOE_CUDA_CHECK(cudaEventRecord(event(j, timed, 1), stream_));
        }
      }
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

  TimingStats run(const std::function<void()>& op, int warmup, int iters, bool flush_l2) {
    return run_interleaved({op}, warmup, iters, flush_l2).front();
  }

 private:
  cudaStream_t stream_;
  DeviceBuffer flush_;
};

struct Ceiling {
  double tflops = 0;
  TimingStats stats;
};

// cuBLAS bf16 x bf16 -> bf16 with fp32 accumulation, 8192³, random data: the matrix throughput
// this GPU reaches today, so every figure below is also a fraction of it. Not flushed: a
// compute-bound GEMM of 400 MB of operands does not gain from a warm L2.
Ceiling measure_gemm_ceiling(cudaStream_t stream, EventTimer& timer, uint64_t seed) {
  constexpr int64_t n = kCeilingDim;
  DeviceBuffer a(n * n * sizeof(bf16)), b(n * n * sizeof(bf16)), c(n * n * sizeof(bf16));
  fill_normal_bf16(a, n * n, seed + 101, 1.0f, stream);
  fill_normal_bf16(b, n * n, seed + 102, 1.0f, stream);
  cublasHandle_t handle = nullptr;
  BENCH_CUBLAS_CHECK(cublasCreate(&handle));
  Ceiling ceiling;
  try {
    BENCH_CUBLAS_CHECK(cublasSetStream(handle, stream));
    const float alpha = 1.0f, beta = 0.0f;
    auto gemm = [&]() {
      BENCH_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.get(),
                                      CUDA_R_16BF, n, b.get(), CUDA_R_16BF, n, &beta, c.get(),
                                      CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    ceiling.stats = timer.run(gemm, kCeilingWarmup, kCeilingIters, /*flush_l2=*/false);
  } catch (...) {
    cublasDestroy(handle);
    throw;
  }
  cublasDestroy(handle);
  ceiling.tflops = 2.0 * n * n * n / (ceiling.stats.median_ms * 1e-3) / 1e12;
  return ceiling;
}

// ----------------------------------------------------------------------------------------------
// The layer: inputs, outputs, calls
// ----------------------------------------------------------------------------------------------

struct LayerInputs {
  DeviceBuffer x_TH, dy_TH;      // [max T, H] bf16; a call with T tokens uses the first T rows
  DeviceBuffer w13_EFH, w2_EHI;  // bf16
  DeviceBuffer topk_idx_TK, topk_w_TK;  // [max T, K]; rewritten per token count
  DeviceBuffer fp8_weights;             // quantize_weights_fp8 of w13, w2 (FP8 impls only)
};

// The config an implementation runs with (its precision).
fusemoe::LayerConfig impl_config(const fusemoe::LayerConfig& config, const BenchImpl& impl) {
  fusemoe::LayerConfig c = config;
  c.precision = impl.precision;
  return c;
}

// Every output of forward and backward; the weight gradients are sized for fp32 and hold bf16
// in their first half when the weight-gradient dtype is bf16.
struct LayerOutputs {
  DeviceBuffer y_TH, dx_TH, d_topk_w_TK, dw13_EFH, dw2_EHI;
  DeviceBuffer saved_z_SF;  // z of the last forward of an impl with save_z, read by its backward

  LayerOutputs(const fusemoe::LayerConfig& c, bool save_z)
      : y_TH(c.max_tokens * c.hidden * sizeof(bf16)),
        dx_TH(c.max_tokens * c.hidden * sizeof(bf16)),
        d_topk_w_TK(c.max_tokens * c.top_k * sizeof(float)),
        dw13_EFH(c.num_experts * 2 * c.intermediate * c.hidden * sizeof(float)),
        dw2_EHI(c.num_experts * c.hidden * c.intermediate * sizeof(float)),
        saved_z_SF(save_z ? fusemoe::saved_z_bytes(c) : 0) {}

  void* saved_z(const BenchImpl& impl) const { return impl.save_z ? saved_z_SF.get() : nullptr; }

  void poison(cudaStream_t stream) const {
    for (const DeviceBuffer* buffer : {&y_TH, &dx_TH, &d_topk_w_TK, &dw13_EFH, &dw2_EHI}) {
      buffer->poison(stream);
    }
  }
};

DeviceBuffer allocate_workspace(const fusemoe::LayerConfig& config, const BenchImpl& impl) {
  // At least one aligned block, so a zero-byte workspace is still a valid pointer.
  return DeviceBuffer(std::max<size_t>(fusemoe::workspace_bytes(impl_config(config, impl), impl.impl), 256));
}

void run_forward(const fusemoe::LayerConfig& config, const BenchImpl& impl, const LayerInputs& in,
                 const LayerOutputs& out, const DeviceBuffer& workspace, int64_t num_tokens,
                 cudaStream_t stream) {
  fusemoe::ForwardArgs args;
  args.x = in.x_TH.get();
  args.topk_idx = in.topk_idx_TK.as<int32_t>();
  args.topk_weights = in.topk_w_TK.as<float>();
  args.w13 = in.w13_EFH.get();
  args.w2 = in.w2_EHI.get();
  args.y = out.y_TH.get();
  args.num_tokens = num_tokens;
  args.workspace = workspace.get();
  args.workspace_bytes = workspace.bytes();
  args.stream = stream;
  // As a training loop runs it: no per-call sync. The correctness check calls
  // check_expert_ids() once after its forward, which would report a bad id.
  args.sync_check_expert_ids = false;
  args.saved_z = out.saved_z(impl);
  args.fp8_weights = in.fp8_weights.get();  // read at FP8 only
  fusemoe::forward(impl_config(config, impl), impl.impl, args);
}

void run_backward(const fusemoe::LayerConfig& config, const BenchImpl& impl, const LayerInputs& in,
                  const LayerOutputs& out, const DeviceBuffer& workspace, int64_t num_tokens,
                  fusemoe::WeightGradDtype weight_grad_dtype, cudaStream_t stream) {
  fusemoe::BackwardArgs args;
  args.x = in.x_TH.get();
  args.topk_idx = in.topk_idx_TK.as<int32_t>();
  args.topk_weights = in.topk_w_TK.as<float>();
  args.w13 = in.w13_EFH.get();
  args.w2 = in.w2_EHI.get();
  args.dy = in.dy_TH.get();
  args.dx = out.dx_TH.get();
  args.d_topk_weights = out.d_topk_w_TK.as<float>();
  args.dw13 = out.dw13_EFH.get();
  args.dw2 = out.dw2_EHI.get();
  args.weight_grad_dtype = weight_grad_dtype;
  args.accumulate_weight_grads = false;
  args.sync_check_expert_ids = false;  // as in run_forward
  args.saved_z = out.saved_z(impl);     // written by the forward of these inputs just before
  args.num_tokens = num_tokens;
  args.workspace = workspace.get();
  args.workspace_bytes = workspace.bytes();
  args.stream = stream;
  args.fp8_weights = in.fp8_weights.get();
  fusemoe::backward(impl_config(config, impl), impl.impl, args);
}

const char* wgrad_name(fusemoe::WeightGradDtype dtype) {
  return dtype == fusemoe::WeightGradDtype::kFloat32 ? "fp32" : "bf16";
}

// ----------------------------------------------------------------------------------------------
// Correctness check
// ----------------------------------------------------------------------------------------------

struct CheckLine {
  std::string impl, output, wgrad;  // wgrad "-" for outputs that do not depend on it
  double rel_err = 0, max_abs_err = 0, calc_diff = 0;
  uint64_t nonfinite = 0, nonfinite_ref = 0;
  bool pass = false;
};

template <typename TA, typename TB>
CheckLine compare(const std::string& impl, const std::string& output, const std::string& wgrad,
                  const DeviceBuffer& a, const DeviceBuffer& b, int64_t n, cudaStream_t stream) {
  DeviceBuffer sums_buffer(sizeof(CompareSums));
  FUSEMOE_CUDA_CHECK(cudaMemsetAsync(sums_buffer.get(), 0, sizeof(CompareSums), stream));
  compare_kernel<TA, TB><<<grid_for(n, kCompareThreads), kCompareThreads, 0, stream>>>(
      a.as<TA>(), b.as<TB>(), n, sums_buffer.as<CompareSums>());
  FUSEMOE_CUDA_CHECK(cudaGetLastError());
  CompareSums sums{};
  FUSEMOE_CUDA_CHECK(
      cudaMemcpyAsync(&sums, sums_buffer.get(), sizeof(sums), cudaMemcpyDeviceToHost, stream));
  FUSEMOE_CUDA_CHECK(cudaStreamSynchronize(stream));

  CheckLine line{impl, output, wgrad};
  line.rel_err = sums.sum_b_sq > 0 ? std::sqrt(sums.sum_diff_sq / sums.sum_b_sq)
                                   : (sums.sum_diff_sq == 0 ? 0.0 : INFINITY);
  float max_abs;
  std::memcpy(&max_abs, &sums.max_abs_diff_bits, sizeof(max_abs));
  line.max_abs_err = max_abs;
  // DeepGEMM's calc_diff: 0 for identical tensors, scale-free, symmetric.
  const double denom = sums.sum_a_sq + sums.sum_b_sq;
  line.calc_diff = denom > 0 ? 1.0 - 2.0 * sums.sum_ab / denom : 0.0;
  line.nonfinite = sums.nonfinite_a;
  line.nonfinite_ref = sums.nonfinite_b;
  line.pass = line.nonfinite == 0 && line.nonfinite_ref == 0 && line.rel_err <= kRelErrTol;
  return line;
}

// Runs every implementation and the fp32 reference on the same inputs (outputs and workspaces
// NaN-poisoned before each call) and compares y, dx, d_topk_weights, dw13, dw2.
std::vector<CheckLine> check_case(
    const fusemoe::LayerConfig& config, const fusemoe::LayerConfig& reference_config,
    const std::vector<BenchImpl>& impls, const std::vector<DeviceBuffer>& workspaces,
    const DeviceBuffer& reference_workspace, const LayerInputs& in, const LayerOutputs& out,
    const LayerOutputs& ref, int64_t num_tokens, const std::string& label, cudaStream_t stream) {
  using fusemoe::WeightGradDtype;
  const int64_t y_elems = num_tokens * config.hidden;
  const int64_t topk_elems = num_tokens * config.top_k;
  const int64_t w13_elems = config.num_experts * 2 * config.intermediate * config.hidden;
  const int64_t w2_elems = config.num_experts * config.hidden * config.intermediate;

  std::fprintf(stderr, "[bench] %s: fp32 reference forward + backward ...\n", label.c_str());
  ref.poison(stream);
  reference_workspace.poison(stream);
  run_forward(reference_config, kReferenceImpl, in, ref, reference_workspace,
              num_tokens, stream);
  reference_workspace.poison(stream);
  run_backward(reference_config, kReferenceImpl, in, ref, reference_workspace,
               num_tokens, WeightGradDtype::kFloat32, stream);
  FUSEMOE_CUDA_CHECK(cudaStreamSynchronize(stream));

  std::vector<CheckLine> lines;
  for (size_t i = 0; i < impls.size(); ++i) {
    const std::string name = impls[i].name;
    const DeviceBuffer& workspace = workspaces[i];
    std::fprintf(stderr, "[bench] %s: checking %s ...\n", label.c_str(), name.c_str());

    out.poison(stream);
    workspace.poison(stream);
    run_forward(config, impls[i], in, out, workspace, num_tokens, stream);
    fusemoe::check_expert_ids(config, impls[i].impl, workspace.get(), stream);
    lines.push_back(compare<bf16, bf16>(name, "y", "-", out.y_TH, ref.y_TH, y_elems, stream));

    if (!impls[i].has_backward) continue;
    for (WeightGradDtype dtype : {WeightGradDtype::kFloat32, WeightGradDtype::kBFloat16}) {
      out.poison(stream);
      workspace.poison(stream);
      run_backward(config, impls[i], in, out, workspace, num_tokens, dtype, stream);
      const std::string wgrad = wgrad_name(dtype);
      // dx and d_topk_weights do not depend on the weight-gradient dtype: checked once.
      if (dtype == WeightGradDtype::kFloat32) {
        lines.push_back(
            compare<bf16, bf16>(name, "dx", "-", out.dx_TH, ref.dx_TH, y_elems, stream));
        lines.push_back(compare<float, float>(name, "d_topk_weights", "-", out.d_topk_w_TK,
                                              ref.d_topk_w_TK, topk_elems, stream));
        lines.push_back(compare<float, float>(name, "dw13", wgrad, out.dw13_EFH, ref.dw13_EFH,
                                              w13_elems, stream));
        lines.push_back(
            compare<float, float>(name, "dw2", wgrad, out.dw2_EHI, ref.dw2_EHI, w2_elems, stream));
      } else {
        lines.push_back(compare<bf16, float>(name, "dw13", wgrad, out.dw13_EFH, ref.dw13_EFH,
                                             w13_elems, stream));
        lines.push_back(
            compare<bf16, float>(name, "dw2", wgrad, out.dw2_EHI, ref.dw2_EHI, w2_elems, stream));
      }
    }
    for (CheckLine& line : lines) {
      if (line.impl == name) {
        line.pass = line.nonfinite == 0 && line.nonfinite_ref == 0 && line.rel_err <= impls[i].check_tol;
      }
    }
  }
  return lines;
}

// ----------------------------------------------------------------------------------------------
// Results
// ----------------------------------------------------------------------------------------------

enum class Pass { kForward, kBackward, kForwardBackward };

const char* pass_name(Pass pass) {
  switch (pass) {
    case Pass::kForward:
      return "forward";
    case Pass::kBackward:
      return "backward";
    case Pass::kForwardBackward:
      return "forward+backward";
  }
  return "?";
}

// Useful FLOPs per valid routed row, in units of H·I (see the file header).
int flops_per_row_in_hi(Pass pass) {
  switch (pass) {
    case Pass::kForward:
      return 6;
    case Pass::kBackward:
      return 12;
    case Pass::kForwardBackward:
      return 18;
  }
  return 0;
}

struct TimingLine {
  std::string impl;
  Pass pass = Pass::kForward;
  std::string wgrad;  // "-" for the forward
  TimingStats stats;
  double flops = 0, tflops = 0, pct_ceiling = 0;
  double speedup_vs_first = 1.0;  // median of impls[0] / this median, same pass and wgrad
};

struct CaseResult {
  int64_t num_tokens = 0;
  RoutingData routing;
  std::string check_status = "skipped";  // "pass", "FAIL", or "skipped (why)"
  std::vector<CheckLine> checks;
  std::vector<TimingLine> timings;
};

struct BenchResult {
  GpuInfo gpu;
  std::string commit, date;
  Ceiling ceiling;
  std::vector<CaseResult> cases;
  std::string error;  // set when a runtime error stopped the run
};

// Minimal JSON writer: objects, arrays, strings, numbers (non-finite → null), booleans.
class JsonWriter {
 public:
  void begin_object() { open('{'); }
  void end_object() { close('}'); }
  void begin_array() { open('['); }
  void end_array() { close(']'); }
  void key(const std::string& name) {
    separate();
    write_string(name);
    out_ << ": ";
    after_key_ = true;
  }
  void value(const std::string& text) {
    separate();
    write_string(text);
  }
  void value(const char* text) { value(std::string(text)); }
  void value(double number) {
    separate();
    if (!std::isfinite(number)) {
      out_ << "null";
      return;
    }
    char text[40];
    std::snprintf(text, sizeof(text), "%.9g", number);
    out_ << text;
  }
  void value(int64_t number) {
    separate();
    out_ << number;
  }
  void value(int number) { value(static_cast<int64_t>(number)); }
  void value(uint64_t number) {
    separate();
    out_ << number;
  }
  void value(bool flag) {
    separate();
    out_ << (flag ? "true" : "false");
  }
  template <typename T>
  void field(const std::string& name, const T& v) {
    key(name);
    value(v);
  }
  std::string str() const { return out_.str() + "\n"; }

 private:
  void open(char bracket) {
    separate();
    out_ << bracket;
    first_.push_back(true);
  }
  void close(char bracket) {
    const bool empty = first_.back();
    first_.pop_back();
    if (!empty) newline();
    out_ << bracket;
  }
  void separate() {
    if (after_key_) {
      after_key_ = false;
      return;
    }
    if (first_.empty()) return;
    if (!first_.back()) out_ << ",";
    first_.back() = false;
    newline();
  }
  void newline() { out_ << "\n" << std::string(2 * first_.size(), ' '); }
  void write_string(const std::string& text) {
    out_ << '"';
    for (unsigned char ch : text) {
      if (ch == '"' || ch == '\\') {
        out_ << '\\' << ch;
      } else if (ch < 0x20) {
        char escaped[8];
        std::snprintf(escaped, sizeof(escaped), "\\u%04x", ch);
        out_ << escaped;
      } else {
        out_ << ch;
      }
    }
    out_ << '"';
  }
  std::ostringstream out_;
  std::vector<bool> first_;
  bool after_key_ = false;
};

void write_json(const std::string& path, const BenchParams& params, const BenchResult& result) {
  JsonWriter json;
  json.begin_object();
  json.field("tool", "fusemoe_bench");
  json.field("schema", 1);
  json.key("meta");
  json.begin_object();
  json.field("gpu", result.gpu.name);
  json.field("compute_capability",
             std::to_string(result.gpu.cc_major) + "." + std::to_string(result.gpu.cc_minor));
  json.field("sm_count", result.gpu.sm_count);
  json.field("memory_bytes", static_cast<uint64_t>(result.gpu.memory_bytes));
  json.field("l2_bytes", result.gpu.l2_bytes);
  json.field("driver_cuda", cuda_version_string(result.gpu.driver_version));
  json.field("runtime_cuda", cuda_version_string(result.gpu.runtime_version));
  json.field("cublas_version", result.gpu.cublas_version);
  json.field("commit", result.commit);
  json.field("date", result.date);
  json.field("preset", params.preset.name);
  json.field("hidden", params.preset.hidden);
  json.field("intermediate", params.preset.intermediate);
  json.field("num_experts", params.preset.num_experts);
  json.field("top_k", params.preset.top_k);
  json.field("routing", routing_name(params.routing));
  json.field("skew_exponent", params.routing == Routing::kSkewed ? kSkewExponent : 0.0);
  json.field("seed", params.seed);
  json.field("iters", params.iters);
  json.field("warmup", params.warmup);
  json.field("l2_flush_bytes", static_cast<uint64_t>(kL2FlushBytes));
  json.field("rel_err_tol", kRelErrTol);
  json.key("tokens");
  json.begin_array();
  for (int64_t t : params.tokens) json.value(t);
  json.end_array();
  json.key("impls");
  json.begin_array();
  for (const BenchImpl& impl : params.impls) json.value(impl.name);
  json.end_array();
  json.end_object();

  json.key("ceiling");
  json.begin_object();
  json.field("what", "cuBLAS cublasGemmEx bf16 in/out, fp32 compute, 8192^3, random data");
  json.field("tflops", result.ceiling.tflops);
  json.field("ms_median", result.ceiling.stats.median_ms);
  json.end_object();

  json.key("cases");
  json.begin_array();
  for (const CaseResult& c : result.cases) {
    json.begin_object();
    json.field("tokens", c.num_tokens);
    json.field("valid_rows", c.routing.valid_rows);
    json.field("expert_rows_min", c.routing.min_rows);
    json.field("expert_rows_max", c.routing.max_rows);
    json.field("expert_rows_mean",
               static_cast<double>(c.routing.valid_rows) / params.preset.num_experts);
    json.field("experts_empty", c.routing.num_empty_experts);
    json.field("check_status", c.check_status);
    json.key("checks");
    json.begin_array();
    for (const CheckLine& line : c.checks) {
      json.begin_object();
      json.field("impl", line.impl);
      json.field("output", line.output);
      json.field("weight_grad_dtype", line.wgrad);
      json.field("rel_err", line.rel_err);
      json.field("max_abs_err", line.max_abs_err);
      json.field("calc_diff", line.calc_diff);
      json.field("nonfinite", line.nonfinite);
      json.field("nonfinite_reference", line.nonfinite_ref);
      json.field("pass", line.pass);
      json.end_object();
    }
    json.end_array();
    json.key("timings");
    json.begin_array();
    for (const TimingLine& line : c.timings) {
      json.begin_object();
      json.field("impl", line.impl);
      json.field("pass", pass_name(line.pass));
      json.field("weight_grad_dtype", line.wgrad);
      json.field("ms_median", line.stats.median_ms);
      json.field("ms_min", line.stats.min_ms);
      json.field("ms_max", line.stats.max_ms);
      json.field("flops", line.flops);
      json.field("tflops", line.tflops);
      json.field("pct_ceiling", line.pct_ceiling);
      json.field("speedup_vs_first_impl", line.speedup_vs_first);
      json.end_object();
    }
    json.end_array();
    json.end_object();
  }
  json.end_array();
  json.field("error", result.error);
  json.end_object();

  FILE* file = std::fopen(path.c_str(), "w");
  if (file == nullptr) {
    std::fprintf(stderr, "fusemoe_bench: cannot write --json %s: %s\n", path.c_str(),
                 std::strerror(errno));
    return;
  }
  const std::string text = json.str();
  std::fwrite(text.data(), 1, text.size(), file);
  std::fclose(file);
}

void print_case(const BenchParams& params, const BenchResult& result, const CaseResult& c) {
  const RoutingData& r = c.routing;
  std::printf(
      "\n== %s T=%lld routing=%s: %lld valid rows; rows/expert min %lld mean %.0f max %lld,"
      " %lld empty ==\n",
      params.preset.name, static_cast<long long>(c.num_tokens), routing_name(params.routing),
      static_cast<long long>(r.valid_rows), static_cast<long long>(r.min_rows),
      static_cast<double>(r.valid_rows) / params.preset.num_experts,
      static_cast<long long>(r.max_rows), static_cast<long long>(r.num_empty_experts));
  std::printf("correctness vs fp32 reference (fail: non-finite or rel_err > %.0e): %s\n",
              kRelErrTol, c.check_status.c_str());
  if (!c.checks.empty()) {
    std::printf("  %-10s %-15s %-5s %10s %10s %10s %9s  %s\n", "impl", "output", "wgrad", "rel_err",
                "max_abs", "calc_diff", "nonfinite", "result");
    for (const CheckLine& line : c.checks) {
      std::printf("  %-10s %-15s %-5s %10.2e %10.2e %10.2e %9llu  %s\n", line.impl.c_str(),
                  line.output.c_str(), line.wgrad.c_str(), line.rel_err, line.max_abs_err,
                  line.calc_diff,
                  static_cast<unsigned long long>(line.nonfinite + line.nonfinite_ref),
                  line.pass ? "pass" : "FAIL");
    }
  }
  if (c.timings.empty()) return;
  std::printf("timings (median of %d after %d warm-up, L2 flushed; ceiling %.0f TFLOP/s):\n",
              params.iters, params.warmup, result.ceiling.tflops);
  std::printf("  %-10s %-17s %-5s %9s %9s %9s %8s %12s\n", "impl", "pass", "wgrad", "ms", "min ms",
              "TFLOP/s", "%ceil", "vs first");
  for (const TimingLine& line : c.timings) {
    std::printf("  %-10s %-17s %-5s %9.3f %9.3f %9.1f %7.1f%% %11.2fx\n", line.impl.c_str(),
                pass_name(line.pass), line.wgrad.c_str(), line.stats.median_ms, line.stats.min_ms,
                line.tflops, line.pct_ceiling, line.speedup_vs_first);
  }
}

// ----------------------------------------------------------------------------------------------
// One token count: routing, check, timings
// ----------------------------------------------------------------------------------------------

struct BenchContext {
  const BenchParams& params;
  const fusemoe::LayerConfig& config;
  const LayerInputs& inputs;
  const LayerOutputs& outputs;
  const std::vector<DeviceBuffer>& workspaces;  // one per params.impls entry
  EventTimer& timer;
  double ceiling_tflops;
  cudaStream_t stream;
};

std::vector<TimingLine> time_case(const BenchContext& ctx, int64_t num_tokens, int64_t valid_rows,
                                  const std::string& label) {
  using fusemoe::WeightGradDtype;
  struct Measurement {
    Pass pass;
    WeightGradDtype dtype;
  };
  // fp32 weight gradients are the default (what an optimizer keeps); bf16 is what a bf16
  // PyTorch model's autograd produces.
  constexpr Measurement kMeasurements[] = {
      {Pass::kForward, WeightGradDtype::kFloat32},
      {Pass::kBackward, WeightGradDtype::kFloat32},
      {Pass::kForwardBackward, WeightGradDtype::kFloat32},
      {Pass::kBackward, WeightGradDtype::kBFloat16},
      {Pass::kForwardBackward, WeightGradDtype::kBFloat16},
  };
  const double hi = static_cast<double>(ctx.config.hidden) * ctx.config.intermediate;
  std::vector<TimingLine> lines;
  // Per measurement, the implementations run interleaved (EventTimer::run_interleaved), so the
  // ratios between them do not depend on the order they are listed in.
  for (const Measurement& m : kMeasurements) {
    std::vector<std::function<void()>> ops;
    std::vector<TimingLine> measured;
    for (size_t i = 0; i < ctx.params.impls.size(); ++i) {
      const BenchImpl& impl = ctx.params.impls[i];
      const DeviceBuffer& workspace = ctx.workspaces[i];
      if (m.pass != Pass::kForward && !impl.has_backward) continue;
      TimingLine line;
      line.impl = impl.name;
      line.pass = m.pass;
      line.wgrad = m.pass == Pass::kForward ? "-" : wgrad_name(m.dtype);
      measured.push_back(line);
      // The ops outlive this iteration: they hold pointers to the context, the implementation
      // and its workspace (all alive for the whole measurement), not references to locals.
      const BenchContext* c = &ctx;
      const BenchImpl* im = &impl;
      const DeviceBuffer* ws = &workspace;
      auto forward = [c, im, ws, num_tokens]() {
        run_forward(c->config, *im, c->inputs, c->outputs, *ws, num_tokens, c->stream);
      };
      auto backward = [c, im, ws, num_tokens, m]() {
        run_backward(c->config, *im, c->inputs, c->outputs, *ws, num_tokens, m.dtype, c->stream);
      };
      switch (m.pass) {
        case Pass::kForward:
          ops.push_back(forward);
          break;
        case Pass::kBackward:
          ops.push_back(backward);
          break;
        case Pass::kForwardBackward:
          ops.push_back([forward, backward]() {
            forward();
            backward();
          });
          break;
      }
    }
    if (ops.empty()) continue;
    std::fprintf(stderr, "[bench] %s: timing %s%s%s of %zu implementation(s), interleaved ...\n", label.c_str(),
                 pass_name(m.pass), m.pass == Pass::kForward ? "" : " wgrad=",
                 m.pass == Pass::kForward ? "" : wgrad_name(m.dtype), ops.size());
    const std::vector<TimingStats> stats =
        ctx.timer.run_interleaved(ops, ctx.params.warmup, ctx.params.iters, /*flush_l2=*/true);
    for (size_t k = 0; k < measured.size(); ++k) {
      TimingLine& line = measured[k];
      line.stats = stats[k];
      line.flops = flops_per_row_in_hi(m.pass) * hi * static_cast<double>(valid_rows);
      line.tflops = line.flops / (line.stats.median_ms * 1e-3) / 1e12;
      line.pct_ceiling = 100.0 * line.tflops / ctx.ceiling_tflops;
      lines.push_back(line);
    }
  }
  // Listed implementation by implementation, as before.
  std::stable_sort(lines.begin(), lines.end(), [&](const TimingLine& a, const TimingLine& b) {
    auto rank = [&](const std::string& name) {
      for (size_t i = 0; i < ctx.params.impls.size(); ++i) {
        if (name == ctx.params.impls[i].name) return i;
      }
      return ctx.params.impls.size();
    };
    return rank(a.impl) < rank(b.impl);
  });
  // Speedups against the first implementation listed, same pass and weight-gradient dtype.
  for (TimingLine& line : lines) {
    for (const TimingLine& base : lines) {
      if (base.impl == ctx.params.impls[0].name && base.pass == line.pass &&
          base.wgrad == line.wgrad) {
        line.speedup_vs_first = base.stats.median_ms / line.stats.median_ms;
      }
    }
  }
  return lines;
}

// Inputs: x, dy ~ N(0, 1); w13 ~ N(0, 1/H) and w2 ~ N(0, 1/I) so that gate/up, h and each
// expert's output are O(1) and the errors compare on a natural scale.
LayerInputs make_inputs(const fusemoe::LayerConfig& c, uint64_t seed, cudaStream_t stream) {
  LayerInputs in;
  const int64_t x_elems = c.max_tokens * c.hidden;
  const int64_t w13_elems = c.num_experts * 2 * c.intermediate * c.hidden;
  const int64_t w2_elems = c.num_experts * c.hidden * c.intermediate;
  in.x_TH = DeviceBuffer(x_elems * sizeof(bf16));
  in.dy_TH = DeviceBuffer(x_elems * sizeof(bf16));
  in.w13_EFH = DeviceBuffer(w13_elems * sizeof(bf16));
  in.w2_EHI = DeviceBuffer(w2_elems * sizeof(bf16));
  in.topk_idx_TK = DeviceBuffer(c.max_tokens * c.top_k * sizeof(int32_t));
  in.topk_w_TK = DeviceBuffer(c.max_tokens * c.top_k * sizeof(float));
  fill_normal_bf16(in.x_TH, x_elems, seed * 4 + 1, 1.0f, stream);
  fill_normal_bf16(in.dy_TH, x_elems, seed * 4 + 2, 1.0f, stream);
  fill_normal_bf16(in.w13_EFH, w13_elems, seed * 4 + 3,
                   1.0f / std::sqrt(static_cast<float>(c.hidden)), stream);
  fill_normal_bf16(in.w2_EHI, w2_elems, seed * 4 + 4,
                   1.0f / std::sqrt(static_cast<float>(c.intermediate)), stream);
  return in;
}

void print_header(const BenchParams& params, const BenchResult& result) {
  const GpuInfo& gpu = result.gpu;
  std::printf("fusemoe_bench  commit %s  %s\n", result.commit.c_str(), result.date.c_str());
  std::printf("GPU %d: %s, sm_%d%d, %d SMs, %.1f GiB, L2 %.0f MB\n", gpu.device, gpu.name.c_str(),
              gpu.cc_major, gpu.cc_minor, gpu.sm_count, gpu.memory_bytes / double(1 << 30),
              gpu.l2_bytes / 1e6);
  std::printf("CUDA driver %s, runtime %s, cuBLAS %d\n",
              cuda_version_string(gpu.driver_version).c_str(),
              cuda_version_string(gpu.runtime_version).c_str(), gpu.cublas_version);
  std::string tokens, impls;
  for (int64_t t : params.tokens) tokens += (tokens.empty() ? "" : ",") + std::to_string(t);
  for (const BenchImpl& impl : params.impls)
    impls += (impls.empty() ? "" : ",") + std::string(impl.name);
  std::printf("layer %s: H=%lld I=%lld E=%lld K=%lld; tokens %s; routing %s; impls %s\n",
              params.preset.name, static_cast<long long>(params.preset.hidden),
              static_cast<long long>(params.preset.intermediate),
              static_cast<long long>(params.preset.num_experts),
              static_cast<long long>(params.preset.top_k), tokens.c_str(),
              routing_name(params.routing), impls.c_str());
  std::printf(
      "timing: median of %d after %d warm-up, CUDA events, %zu MiB L2 flush before each call\n",
      params.iters, params.warmup, kL2FlushBytes >> 20);
  std::fflush(stdout);
}

// Runs everything after the GPU is known to be a Hopper; fills `result` as it goes so that a
// runtime error still leaves the figures gathered so far for --json.
bool run_bench(const BenchParams& params, BenchResult& result) {
  cudaStream_t stream = nullptr;
  FUSEMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { cudaStreamDestroy(s); }
  } stream_guard{stream};

  const Preset& preset = params.preset;
  fusemoe::LayerConfig config;
  config.hidden = preset.hidden;
  config.intermediate = preset.intermediate;
  config.num_experts = preset.num_experts;
  config.top_k = preset.top_k;
  config.max_tokens = *std::max_element(params.tokens.begin(), params.tokens.end());
  fusemoe::validate_config(config);

  EventTimer timer(stream);
  std::fprintf(stderr, "[bench] measuring the bf16 GEMM ceiling (cuBLAS %d^3) ...\n", kCeilingDim);
  result.ceiling = measure_gemm_ceiling(stream, timer, params.seed);
  std::printf(
      "bf16 GEMM ceiling (cuBLAS %d^3, bf16 in/out, fp32 accumulate): %.1f TFLOP/s "
      "(%.3f ms median of %d)\n",
      kCeilingDim, result.ceiling.tflops, result.ceiling.stats.median_ms, kCeilingIters);
  std::fflush(stdout);

  std::fprintf(stderr, "[bench] %s: generating inputs for up to T=%lld ...\n", preset.short_name,
               static_cast<long long>(config.max_tokens));
  LayerInputs inputs = make_inputs(config, params.seed, stream);
  const bool any_saves_z = std::any_of(params.impls.begin(), params.impls.end(),
                                        [](const BenchImpl& impl) { return impl.save_z; });
  LayerOutputs outputs(config, any_saves_z);
  std::vector<DeviceBuffer> workspaces;
  for (const BenchImpl& impl : params.impls)
    workspaces.push_back(allocate_workspace(config, impl));
  if (std::any_of(params.impls.begin(), params.impls.end(),
                  [](const BenchImpl& impl) { return impl.precision == fusemoe::Precision::kFp8Blockwise; })) {
    fusemoe::LayerConfig fp8 = config;
    fp8.precision = fusemoe::Precision::kFp8Blockwise;
    inputs.fp8_weights = DeviceBuffer(fusemoe::fp8_weights_bytes(fp8));
    fusemoe::quantize_weights_fp8(fp8, inputs.w13_EFH.get(), inputs.w2_EHI.get(), inputs.fp8_weights.get(),
                                  inputs.fp8_weights.bytes(), stream);
  }

  // The reference and its outputs exist only while some token count is checked; its config
  // is sized for the largest checked T so a skipped large T does not inflate its workspace.
  fusemoe::LayerConfig reference_config = config;
  reference_config.max_tokens = 0;
  for (int64_t t : params.tokens) {
    if (params.check && t <= params.check_max_tokens) {
      reference_config.max_tokens = std::max(reference_config.max_tokens, t);
    }
  }
  DeviceBuffer reference_workspace;
  std::unique_ptr<LayerOutputs> reference_outputs;
  if (reference_config.max_tokens > 0) {
    reference_workspace = allocate_workspace(reference_config, kReferenceImpl);
    reference_outputs = std::make_unique<LayerOutputs>(reference_config, false);
  }

  BenchContext ctx{params, config, inputs, outputs, workspaces, timer, result.ceiling.tflops,
                   stream};
  bool all_pass = true;
  for (int64_t num_tokens : params.tokens) {
    const std::string label = std::string(preset.short_name) + " T=" + std::to_string(num_tokens);
    result.cases.emplace_back();
    CaseResult& c = result.cases.back();
    c.num_tokens = num_tokens;
    c.routing =
        make_routing(num_tokens, config.num_experts, config.top_k, params.routing, params.seed);
    FUSEMOE_CUDA_CHECK(cudaMemcpyAsync(inputs.topk_idx_TK.get(), c.routing.topk_idx_TK.data(),
                                       c.routing.topk_idx_TK.size() * sizeof(int32_t),
                                       cudaMemcpyHostToDevice, stream));
    FUSEMOE_CUDA_CHECK(cudaMemcpyAsync(inputs.topk_w_TK.get(), c.routing.topk_w_TK.data(),
                                       c.routing.topk_w_TK.size() * sizeof(float),
                                       cudaMemcpyHostToDevice, stream));
    FUSEMOE_CUDA_CHECK(cudaStreamSynchronize(stream));

    if (!params.check) {
      c.check_status = "skipped (--no-check)";
    } else if (num_tokens > params.check_max_tokens) {
      c.check_status =
          "skipped (T > --check-max-tokens " + std::to_string(params.check_max_tokens) + ")";
    } else {
      c.checks = check_case(config, reference_config, params.impls, workspaces, reference_workspace,
                            inputs, outputs, *reference_outputs, num_tokens, label, stream);
      const bool pass = std::all_of(c.checks.begin(), c.checks.end(),
                                    [](const CheckLine& line) { return line.pass; });
      c.check_status = pass ? "pass" : "FAIL";
      all_pass = all_pass && pass;
    }
    c.timings = time_case(ctx, num_tokens, c.routing.valid_rows, label);
    c.routing.topk_idx_TK.clear();  // the per-case routing is summarised; drop the host copy
    c.routing.topk_w_TK.clear();
    print_case(params, result, c);
    std::fflush(stdout);
  }
  return all_pass;
}

}  // namespace

int main(int argc, char** argv) {
  BenchParams params;
  try {
    params = parse_args(argc, argv);
  } catch (const UsageError& usage) {
    if (usage.message.empty()) {
      std::fputs(kUsage, stdout);
      return kExitOk;
    }
    std::fprintf(stderr, "fusemoe_bench: %s\n%s", usage.message.c_str(), kUsage);
    return kExitBadArgs;
  }

  BenchResult result;
  result.commit = commit_id();
  result.date = utc_now();
  try {
    std::string reason;
    if (!find_hopper(&result.gpu, &reason)) {
      std::fprintf(stderr,
                   "fusemoe_bench: no Hopper (sm_90) GPU found: %s; the benchmark needs an "
                   "H100/H200\n",
                   reason.c_str());
      return kExitNoHopper;
    }
  } catch (const fusemoe::Error& error) {
    std::fprintf(stderr,
                 "fusemoe_bench: no Hopper (sm_90) GPU found: %s; the benchmark needs an "
                 "H100/H200\n",
                 error.what());
    return kExitNoHopper;
  }
  print_header(params, result);

  int exit_code = kExitOk;
  try {
    const bool all_pass = run_bench(params, result);
    if (!all_pass) {
      std::printf("\nfusemoe_bench: CORRECTNESS FAILURE (see the FAIL lines above)\n");
      exit_code = kExitCheckFailed;
    }
  } catch (const fusemoe::Error& error) {
    result.error = error.what();
    std::fprintf(stderr, "fusemoe_bench: %s\n", error.what());
    exit_code = kExitRuntimeError;
  } catch (const std::exception& error) {
    result.error = error.what();
    std::fprintf(stderr, "fusemoe_bench: error: %s\n", error.what());
    exit_code = kExitRuntimeError;
  }
  if (!params.json_path.empty()) {
    write_json(params.json_path, params, result);
    std::fprintf(stderr, "[bench] wrote %s\n", params.json_path.c_str());
  }
  return exit_code;
}

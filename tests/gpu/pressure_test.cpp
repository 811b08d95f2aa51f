// fusemoe_pressure_test: the whole layer (forward + backward) over random shapes, routings and
// options on one GPU, every call checked, every call reproducible alone from its printed seed.
//
// Loop 1, --pairs: two layers of different shapes at once, each on its own stream from its own
//   host thread (Impl::kFused; the first pair runs before any other library call, so both threads
//   meet cold caches: device attributes, shared-memory limits, the device-wait record). Each
//   layer's outputs must equal those of the same layer run alone afterwards, bitwise; with bad ids
//   its forward and its backward must each name the first bad id, together and alone (thrown, or
//   in the report zeroed before and read after each call); with valid ids neither may throw or
//   report.
// Loop 2, --calls: one layer at a time. Shapes drawn log-uniformly (most calls small): H = 128 m,
//   I = 64 m, m in [1, 64]; E in [1, 1024]; K in [1, min(E, 32)]; T in [0, 70000]; max_tokens
//   = T or more. Routings: uniform, skewed, one expert, all slots on one expert, masked, all
//   masked, bad ids. Options: fp32 or bf16 weight gradients, overwrite or accumulate, z saved or
//   recomputed, how the fused call reports expert ids (sync, device report, pinned report).
//   Checks: the fused implementation against the fp32 GPU reference under FlashAttention-3's rule
//   (error <= 2 x the unfused bf16 error + 1e-3, relative L2, per output; d_topk_weights of calls
//   with fewer than kMinSlotsForRatio valid slots is judged pooled, see below), no non-finite
//   output from any implementation, a repeated fused call bitwise equal; bad ids: every
//   implementation names the first (token, slot, value) and the count, outputs not compared.
// A shape whose buffers (weights, inputs, the three implementations' outputs, one workspace)
// exceed --memory-gib, or whose executed FLOPs (22 H I T K) exceed --max-gflop, is redrawn and
// counted. Buffers come from one arena allocated at the start. Exit 0: every check passed; 1: a
// failure, or the --seconds budget ended the run early; 77: no sm_90 GPU. --plan draws the calls
// without a GPU.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "common/device.h"
#include "common/device_checks.h"
#include "common/layer_device.h"
#include "common/tool_main.h"
#include "fusemoe/fusemoe.h"

namespace fusemoe::pressure {
namespace {

using harness::CompareResult;
using harness::DeviceArena;
using harness::fa3_bound;
using harness::kLayerOutputNames;
using harness::LayerCall;
using harness::LayerInputs;
using harness::LayerOutputs;

// d_topk_weights has one element per valid slot. With few of them its relative L2 is too noisy
// for a 2x ratio: both implementations share z's bf16 rounding, and on a single dot product
// <h, a> the unfused error can cancel to near zero by chance. Below this many valid slots of
// distinct (token, expert) (repeated ids give equal values) a call adds its squared errors to a
// pool that is judged once at the end (the calls that contribute most are named if it fails);
// every other output has >= 64 independent error terms per call.
constexpr int64_t kMinSlotsForRatio = 256;
// FLOPs a forward + backward executes per routed row, in units of H*I: forward 6 (gate/up 4,
// down 2), backward 16 (z recomputed 4, a = W2^T dy 2, dx 4, dW2 2, dW13 4). Executed, not
// useful: fusemoe_bench counts 18 useful (the recomputation of z is overhead there); this figure
// bounds the work a call runs (a call with z saved runs 4 less), and keeps a seed's draws as they
// were.
constexpr double kExecutedFlopsPerRowInHI = 22.0;

uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A small generator with a defined sequence (the draws must not depend on the C++ library).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() { return splitmix64(state_++); }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1p-53; }  // [0, 1)
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
  // Integers in [lo, hi] with P(v) proportional to log((v + 1) / v): log-uniform.
  int64_t log_uniform(int64_t lo, int64_t hi) {
    const double v = std::exp(std::log(double(lo)) + uniform() * (std::log(double(hi) + 1.0) - std::log(double(lo))));
    return std::clamp<int64_t>(static_cast<int64_t>(v), lo, hi);
  }
  bool chance(double p) { return uniform() < p; }
  double normal() {  // Box-Muller
    const double u1 = (static_cast<double>(next() >> 11) + 0.5) * 0x1p-53;
    constexpr double kTwoPi = 6.283185307179586;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * uniform());
  }

 private:
  uint64_t state_;
};

enum class Kind { kUniform, kSkewed, kOneExpert, kAllSlotsOne, kMasked, kAllMasked, kBadIds, kCount };
constexpr const char* kKindNames[] = {"uniform", "skewed", "one_expert", "all_slots_one",
                                      "masked",  "all_masked", "bad_ids"};
// Relative frequencies of the routings.
constexpr double kKindWeights[] = {30, 20, 10, 5, 10, 10, 15};
static_assert(sizeof(kKindWeights) / sizeof(double) == static_cast<size_t>(Kind::kCount), "one weight per kind");

// How the fused calls check expert ids: ForwardArgs::sync_check_expert_ids (the call syncs and
// throws) or an ExpertIdReport in device memory or in pinned host memory (no sync, no throw).
enum class IdCheck { kSync, kDeviceReport, kPinnedReport };
constexpr const char* kIdCheckNames[] = {"sync", "device_report", "pinned_report"};

struct Spec {
  uint64_t seed = 0;
  LayerConfig config;  // max_tokens >= num_tokens
  int64_t num_tokens = 0;
  Kind kind = Kind::kUniform;
  WeightGradDtype grad_dtype = WeightGradDtype::kFloat32;
  bool accumulate = false;
  bool save_z = false;
  IdCheck id_check = IdCheck::kSync;
  int64_t redrawn_for_memory = 0, redrawn_for_flops = 0;

  double executed_flops() const {
    return kExecutedFlopsPerRowInHI * double(config.hidden) * double(config.intermediate) * double(num_tokens) *
           double(config.top_k);
  }
  std::string describe() const {
    char text[320];
    std::snprintf(text, sizeof(text), "T=%lld (max_tokens %lld) H=%lld I=%lld E=%lld K=%lld %s, %s %s, z %s, ids %s",
                  static_cast<long long>(num_tokens), static_cast<long long>(config.max_tokens),
                  static_cast<long long>(config.hidden), static_cast<long long>(config.intermediate),
                  static_cast<long long>(config.num_experts), static_cast<long long>(config.top_k),
                  kKindNames[static_cast<int>(kind)], grad_dtype == WeightGradDtype::kFloat32 ? "fp32" : "bf16",
                  accumulate ? "accumulate" : "overwrite", save_z ? "saved" : "recomputed",
                  kIdCheckNames[static_cast<int>(id_check)]);
    return text;
  }
};

struct Budget {
  size_t memory_bytes = size_t(16) << 30;
  double max_flops = 0;
};

size_t grad_bytes(const LayerConfig& c, WeightGradDtype dtype, bool w13) {
  return static_cast<size_t>(c.num_experts) * (w13 ? 2 : 1) * c.intermediate * c.hidden *
         harness::weight_grad_element_bytes(dtype);
}

constexpr size_t kReportBytes = kExpertIdReportInts * sizeof(int32_t);

// Accumulation starts from N(0, 0.1^2) values in the tested dtype (exact in it), drawn from the
// spec's seed.
void fill_init(const Spec& s, void* init13, void* init2, cudaStream_t stream) {
  if (!s.accumulate) return;
  const size_t element_bytes = harness::weight_grad_element_bytes(s.grad_dtype);
  harness::fill_normal_weight_grads(init13, static_cast<int64_t>(grad_bytes(s.config, s.grad_dtype, true) / element_bytes),
                                    s.grad_dtype, s.seed ^ 0xD13ull, 0.1f, stream);
  harness::fill_normal_weight_grads(init2, static_cast<int64_t>(grad_bytes(s.config, s.grad_dtype, false) / element_bytes),
                                    s.grad_dtype, s.seed ^ 0xD2ull, 0.1f, stream);
}

// An accumulating call's outputs start from fill_init's values.
void start_from_init(const Spec& s, const LayerOutputs& out, const void* init13, const void* init2,
                     cudaStream_t stream) {
  if (s.accumulate) harness::copy_weight_grads(s.config, init13, init2, out, stream);
}

// What a spec's call carves from the arena: the inputs, the reference's outputs (fp32 weight
// gradients) and two output sets of the tested dtype (unfused, then the fused repeat; fused), the
// accumulation's starting values, saved z, one workspace for the three implementations, a report.
size_t call_footprint(const Spec& s) {
  const LayerConfig& c = s.config;
  return LayerInputs::footprint(c) + LayerOutputs::footprint(c, WeightGradDtype::kFloat32) +
         2 * LayerOutputs::footprint(c, s.grad_dtype) +
         (s.accumulate ? DeviceArena::footprint(grad_bytes(c, s.grad_dtype, true)) +
                             DeviceArena::footprint(grad_bytes(c, s.grad_dtype, false))
                       : 0) +
         (s.save_z ? DeviceArena::footprint(saved_z_bytes(c)) : 0) + DeviceArena::footprint(harness::max_workspace_bytes(c)) +
         DeviceArena::footprint(kReportBytes);
}

// One layer of a pair: inputs, outputs run together and alone, accumulation values, saved z, the
// fused workspace, a report.
size_t pair_side_footprint(const Spec& s) {
  const LayerConfig& c = s.config;
  return LayerInputs::footprint(c) + 2 * LayerOutputs::footprint(c, s.grad_dtype) +
         (s.accumulate ? DeviceArena::footprint(grad_bytes(c, s.grad_dtype, true)) +
                             DeviceArena::footprint(grad_bytes(c, s.grad_dtype, false))
                       : 0) +
         (s.save_z ? DeviceArena::footprint(saved_z_bytes(c)) : 0) +
         DeviceArena::footprint(workspace_bytes(c, Impl::kFused)) + DeviceArena::footprint(kReportBytes);
}

// Draws from `rng` until a spec fits `memory_bytes` (footprint) and the FLOP budget; the redraws
// are counted in the spec. The same rng state gives the same spec.
Spec draw_spec(Rng& rng, uint64_t seed, double max_flops, size_t memory_bytes, size_t (*footprint)(const Spec&)) {
  Spec s;
  s.seed = seed;
  for (int attempt = 0; attempt < 100000; ++attempt) {
    LayerConfig& c = s.config;
    c = LayerConfig{};
    c.hidden = 128 * rng.log_uniform(1, 64);
    c.intermediate = 64 * rng.log_uniform(1, 64);
    c.num_experts = rng.log_uniform(1, 1024);
    c.top_k = rng.log_uniform(1, std::min<int64_t>(c.num_experts, 32));
    s.num_tokens = rng.log_uniform(1, 70001) - 1;
    // A quarter of the calls pass T below the workspace's max_tokens.
    c.max_tokens = s.num_tokens + (rng.chance(0.25) ? rng.log_uniform(1, std::max<int64_t>(s.num_tokens, 1)) : 0);
    double pick = rng.uniform() * 100.0;
    int kind = 0;
    while (kind + 1 < static_cast<int>(Kind::kCount) && pick >= kKindWeights[kind]) pick -= kKindWeights[kind++];
    s.kind = static_cast<Kind>(kind);
    if (s.kind == Kind::kBadIds && s.num_tokens == 0) s.kind = Kind::kUniform;  // no slot to hold one
    s.grad_dtype = rng.chance(0.5) ? WeightGradDtype::kFloat32 : WeightGradDtype::kBFloat16;
    s.accumulate = rng.chance(0.3);
    s.save_z = rng.chance(0.5);
    s.id_check = static_cast<IdCheck>(rng.below(3));
    if (s.executed_flops() > max_flops) {
      ++s.redrawn_for_flops;
      continue;
    }
    if (footprint(s) > memory_bytes) {
      ++s.redrawn_for_memory;
      continue;
    }
    return s;
  }
  FUSEMOE_CHECK(false, "no spec within the budgets after 100000 draws (seed " << seed << ")");
  return s;
}

// ---- routings (host) ----

struct Routing {
  std::vector<int32_t> idx_TK;
  std::vector<float> w_TK;
  int64_t distinct_rows = 0;  // valid slots with distinct (token, expert): distinct d_topk_weights
  int64_t num_bad = 0;
  int64_t first_bad_slot = -1;
  int32_t first_bad_value = 0;
};

// K distinct experts of [0, n) (Floyd's sampling), shuffled.
void distinct_experts(Rng& rng, int64_t n, int64_t k, int32_t* out) {
  for (int64_t j = n - k, m = 0; j < n; ++j, ++m) {
    const int32_t t = static_cast<int32_t>(rng.below(j + 1));
    out[m] = std::find(out, out + m, t) != out + m ? static_cast<int32_t>(j) : t;
  }
  for (int64_t m = k - 1; m > 0; --m) std::swap(out[m], out[rng.below(m + 1)]);
}

Routing make_routing(const Spec& s) {
  const int64_t T = s.num_tokens, E = s.config.num_experts, K = s.config.top_k;
  Rng rng(splitmix64(s.seed ^ 0x726F7574ull));
  Routing r;
  r.idx_TK.assign(T * K, -1);
  r.w_TK.assign(T * K, 0.0f);
  const int32_t hot = static_cast<int32_t>(rng.below(E));
  // kSkewed: p(e) ~ 1 / (rank(e) + 1)^1.2 with a random ranking; cdf over experts.
  std::vector<double> cdf;
  std::vector<int32_t> by_popularity;
  if (s.kind == Kind::kSkewed) {
    by_popularity.resize(E);
    for (int64_t e = 0; e < E; ++e) by_popularity[e] = static_cast<int32_t>(e);
    for (int64_t m = E - 1; m > 0; --m) std::swap(by_popularity[m], by_popularity[rng.below(m + 1)]);
    cdf.resize(E);
    double sum = 0;
    for (int64_t rank = 0; rank < E; ++rank) cdf[rank] = (sum += std::pow(double(rank + 1), -1.2));
    for (double& v : cdf) v /= sum;
  }
  std::vector<float> logits(K);
  for (int64_t t = 0; t < T; ++t) {
    int32_t* ids = r.idx_TK.data() + t * K;
    switch (s.kind) {
      case Kind::kAllMasked: break;
      case Kind::kAllSlotsOne: std::fill(ids, ids + K, hot); break;
      case Kind::kOneExpert:
        // Slot 0 on the hot expert (it holds T rows), the others distinct and elsewhere.
        ids[0] = hot;
        distinct_experts(rng, E - 1, K - 1, ids + 1);
        for (int64_t j = 1; j < K; ++j) ids[j] += ids[j] >= hot;
        break;
      case Kind::kSkewed:
        for (int64_t j = 0; j < K; ++j) {
          int32_t e = -1;
          for (int tries = 0; tries < 64 && e < 0; ++tries) {
            const int64_t rank = std::lower_bound(cdf.begin(), cdf.end(), rng.uniform()) - cdf.begin();
            const int32_t candidate = by_popularity[std::min(rank, E - 1)];
            if (std::find(ids, ids + j, candidate) == ids + j) e = candidate;
          }
          for (int64_t rank = 0; e < 0; ++rank) {  // the most popular expert not taken yet
            if (std::find(ids, ids + j, by_popularity[rank]) == ids + j) e = by_popularity[rank];
          }
          ids[j] = e;
        }
        break;
      default: distinct_experts(rng, E, K, ids); break;  // uniform, masked, bad ids
    }
    // Weights: the softmax of random logits over the token's slots (normalised top-k weights).
    float max_logit = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < K; ++j) max_logit = std::max(max_logit, logits[j] = static_cast<float>(rng.normal()));
    float sum = 0;
    for (int64_t j = 0; j < K; ++j) sum += (logits[j] = std::exp(logits[j] - max_logit));
    for (int64_t j = 0; j < K; ++j) r.w_TK[t * K + j] = logits[j] / sum;
    if (s.kind == Kind::kMasked) {
      for (int64_t j = 0; j < K; ++j) {
        if (t % 5 == 0 || rng.chance(0.3)) ids[j] = -1;
      }
    }
  }
  // A masked slot's weight is never read (docs/numerics.md): make it NaN, so a read shows.
  for (size_t slot = 0; slot < r.idx_TK.size(); ++slot) {
    if (r.idx_TK[slot] == -1) r.w_TK[slot] = std::numeric_limits<float>::quiet_NaN();
  }
  if (s.kind == Kind::kBadIds) {
    const int32_t bad_values[] = {static_cast<int32_t>(E), static_cast<int32_t>(E + 1 + rng.below(1000)), -2,
                                  static_cast<int32_t>(-2 - rng.below(1000)), std::numeric_limits<int32_t>::max(),
                                  std::numeric_limits<int32_t>::min()};
    const int64_t num_bad = std::min<int64_t>(1 + rng.below(3), T * K);
    for (int64_t b = 0; b < num_bad; ++b) {
      int64_t slot = rng.below(T * K);
      while (r.idx_TK[slot] < -1 || r.idx_TK[slot] >= E) slot = (slot + 1) % (T * K);  // distinct slots
      const int32_t value = bad_values[rng.below(6)];
      r.idx_TK[slot] = value;
      if (r.first_bad_slot < 0 || slot < r.first_bad_slot) {
        r.first_bad_slot = slot;
        r.first_bad_value = value;
      }
    }
    r.num_bad = num_bad;
  }
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* ids = r.idx_TK.data() + t * K;
    for (int64_t j = 0; j < K; ++j) {
      if (ids[j] < 0 || ids[j] >= E) continue;
      r.distinct_rows += std::find(ids, ids + j, ids[j]) == ids + j;
    }
  }
  return r;
}

// The library's words for the first bad id (src/kernels/routing.cu, check_bad_id_record).
std::string expected_bad_id_message(const Spec& s, const Routing& r) {
  const int64_t K = s.config.top_k;
  return std::to_string(r.num_bad) + " expert id(s) outside [-1, " + std::to_string(s.config.num_experts) +
         "); first at token " + std::to_string(r.first_bad_slot / K) + ", slot " + std::to_string(r.first_bad_slot % K) +
         ", value " + std::to_string(r.first_bad_value);
}

// ---- the device side of one spec ----

struct Reports {
  int32_t* device = nullptr;  // in the arena
  int32_t* pinned = nullptr;  // cudaHostAlloc
};

// The pointer and sync flag of a fused call that checks ids per `mode`; zeroes the report first.
void set_id_check(LayerCall& call, IdCheck mode, const Reports& reports) {
  call.sync_check_expert_ids = mode == IdCheck::kSync;
  call.expert_id_report = nullptr;
  if (mode == IdCheck::kDeviceReport) {
    call.expert_id_report = reports.device;
    FUSEMOE_CUDA_CHECK(cudaMemsetAsync(reports.device, 0, kReportBytes, call.stream));
  } else if (mode == IdCheck::kPinnedReport) {
    FUSEMOE_CUDA_CHECK(cudaStreamSynchronize(call.stream));  // no earlier call still writes it
    std::memset(reports.pinned, 0, kReportBytes);
    call.expert_id_report = reports.pinned;
  }
}

// The report after the call's stream work (empty for kSync).
std::array<int32_t, 3> read_report(IdCheck mode, const Reports& reports, cudaStream_t stream) {
  std::array<int32_t, 3> report{0, 0, 0};
  FUSEMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (mode == IdCheck::kDeviceReport) {
    FUSEMOE_CUDA_CHECK(cudaMemcpy(report.data(), reports.device, kReportBytes, cudaMemcpyDeviceToHost));
  } else if (mode == IdCheck::kPinnedReport) {
    std::memcpy(report.data(), reports.pinned, kReportBytes);
  }
  return report;
}

std::string report_text(const std::array<int32_t, 3>& r) {
  return "[" + std::to_string(r[0]) + ", " + std::to_string(r[1]) + ", " + std::to_string(r[2]) + "]";
}

// Runs `call_fn`; the message of the exception (fusemoe::Error or other) it throws, or "".
template <typename Fn>
std::string error_of(Fn&& call_fn) {
  try {
    call_fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

struct Outcome {
  std::vector<std::string> failures;
  std::string figures;  // the worst err / bound of the call
  // d_topk_weights of a call with few valid slots, for the pool: squared norms.
  bool pooled = false;
  double pool_fused_sq = 0, pool_base_sq = 0, pool_ref_sq = 0;
};

void fail(Outcome& o, const std::string& what) { o.failures.push_back(what); }

double diff_norm(const CompareResult& r) {
  const double ref_norm = r.rms_ref * std::sqrt(static_cast<double>(r.count));
  return ref_norm > 0 ? r.rel_l2 * ref_norm : r.rel_l2;
}

// Bad ids: the fused forward and backward and the unfused forward each name the first bad id, by
// throwing (kSync) or in the report.
void check_bad_ids(const Spec& s, const Routing& r, const LayerInputs& in, const LayerOutputs& out,
                   LayerCall call, const Reports& reports, Outcome& o) {
  const std::string expected = expected_bad_id_message(s, r);
  const std::array<int32_t, 3> expected_report{static_cast<int32_t>(r.num_bad), static_cast<int32_t>(r.first_bad_slot),
                                               r.first_bad_value};
  struct Step {
    const char* name;
    Impl impl;
    bool backward;
  };
  for (const Step& step : {Step{"fused forward", Impl::kFused, false}, Step{"fused backward", Impl::kFused, true},
                           Step{"unfused forward", Impl::kUnfused, false}}) {
    call.impl = step.impl;
    call.saved_z = nullptr;
    set_id_check(call, s.id_check, reports);
    const std::string thrown = error_of([&] {
      if (step.backward) {
        harness::run_backward_call(s.config, s.num_tokens, in, out, call);
      } else {
        harness::run_forward_call(s.config, s.num_tokens, in, out, call);
      }
    });
    if (s.id_check == IdCheck::kSync) {
      if (thrown.find(expected) == std::string::npos) {
        fail(o, std::string(step.name) + ": expected an error naming '" + expected + "', got '" + thrown + "'");
      }
      continue;
    }
    const std::array<int32_t, 3> report = read_report(s.id_check, reports, call.stream);
    if (!thrown.empty()) fail(o, std::string(step.name) + ": threw with a report given: " + thrown);
    if (report != expected_report) {
      fail(o, std::string(step.name) + ": report " + report_text(report) + ", expected " + report_text(expected_report));
    }
    const std::string decoded = error_of([&] { throw_if_expert_id_report(report.data(), s.config.num_experts, s.config.top_k); });
    if (decoded.find(expected) == std::string::npos) {
      fail(o, std::string(step.name) + ": throw_if_expert_id_report said '" + decoded + "', expected '" + expected + "'");
    }
  }
}

Outcome run_call(const Spec& s, DeviceArena& arena, int32_t* pinned_report, cudaStream_t stream) {
  Outcome o;
  const LayerConfig& c = s.config;
  const int64_t T = s.num_tokens;
  const Routing routing = make_routing(s);
  arena.reset();
  const LayerInputs in = LayerInputs::carve(arena, c);
  const LayerOutputs ref = LayerOutputs::carve(arena, c, WeightGradDtype::kFloat32);
  const LayerOutputs first = LayerOutputs::carve(arena, c, s.grad_dtype);  // unfused, then the fused repeat
  const LayerOutputs fused = LayerOutputs::carve(arena, c, s.grad_dtype);
  void* init13 = s.accumulate ? arena.take(grad_bytes(c, s.grad_dtype, true)) : nullptr;
  void* init2 = s.accumulate ? arena.take(grad_bytes(c, s.grad_dtype, false)) : nullptr;
  void* saved_z = s.save_z ? arena.take(saved_z_bytes(c)) : nullptr;
  void* workspace = arena.take(harness::max_workspace_bytes(c));
  const Reports reports{static_cast<int32_t*>(arena.take(kReportBytes)), pinned_report};

  in.fill_normal(c, T, s.seed, stream);
  in.upload_routing(routing.idx_TK, routing.w_TK, stream);
  fill_init(s, init13, init2, stream);

  LayerCall call;
  call.workspace = workspace;
  call.stream = stream;
  if (s.kind == Kind::kBadIds) {
    check_bad_ids(s, routing, in, first, call, reports, o);
    return o;
  }

  LayerCall reference_call = call;
  reference_call.impl = Impl::kReferenceFp32;
  harness::run_layer_call(c, T, in, ref, reference_call);
  LayerCall unfused_call = call;
  unfused_call.impl = Impl::kUnfused;
  unfused_call.accumulate = s.accumulate;
  start_from_init(s, first, init13, init2, stream);
  harness::run_layer_call(c, T, in, first, unfused_call);
  LayerCall fused_call = call;
  fused_call.impl = Impl::kFused;
  fused_call.accumulate = s.accumulate;
  fused_call.saved_z = saved_z;
  set_id_check(fused_call, s.id_check, reports);
  start_from_init(s, fused, init13, init2, stream);
  harness::run_layer_call(c, T, in, fused, fused_call);
  const std::array<int32_t, 3> report = read_report(s.id_check, reports, stream);
  if (report[0] != 0) fail(o, "a call with valid ids wrote the expert-id report " + report_text(report));

  const harness::LayerErrors base = harness::compare_layer_outputs(c, T, first, ref, init13, init2);
  const harness::LayerErrors got = harness::compare_layer_outputs(c, T, fused, ref, init13, init2);
  double worst_ratio = 0;
  std::string worst;
  for (int k = 0; k < harness::kNumLayerOutputs; ++k) {
    const char* name = kLayerOutputNames[k];
    if (got[k].nonfinite_ref != 0) {
      fail(o, std::string("reference ") + name + ": " + std::to_string(got[k].nonfinite_ref) + " non-finite values");
    }
    if (base[k].nonfinite_out != 0) {
      fail(o, std::string("unfused ") + name + ": " + std::to_string(base[k].nonfinite_out) + " non-finite values");
    }
    if (got[k].nonfinite_out != 0) {
      fail(o, std::string("fused ") + name + ": " + std::to_string(got[k].nonfinite_out) + " non-finite values");
    }
    if (k == harness::kDTopkWeights && routing.distinct_rows < kMinSlotsForRatio) {
      o.pooled = true;
      o.pool_fused_sq = std::pow(diff_norm(got[k]), 2);
      o.pool_base_sq = std::pow(diff_norm(base[k]), 2);
      o.pool_ref_sq = std::pow(got[k].rms_ref, 2) * static_cast<double>(got[k].count);
      continue;
    }
    const double bound = fa3_bound(base[k].rel_l2);
    if (!(got[k].rel_l2 <= bound)) {
      char text[200];
      std::snprintf(text, sizeof(text), "fused %s: rel_l2 %.3e > bound %.3e (unfused %.3e, calc_diff %.2e)", name,
                    got[k].rel_l2, bound, base[k].rel_l2, got[k].calc_diff);
      fail(o, text);
    }
    const double ratio = got[k].rel_l2 / bound;
    if (!(ratio <= worst_ratio)) {
      worst_ratio = ratio;
      char text[120];
      std::snprintf(text, sizeof(text), "worst %s %.2e <= %.2e", name, got[k].rel_l2, bound);
      worst = text;
    }
  }
  o.figures = worst;

  // The fused call again, into the first set (the unfused outputs are judged): the same bits.
  start_from_init(s, first, init13, init2, stream);
  set_id_check(fused_call, s.id_check, reports);
  harness::run_layer_call(c, T, in, first, fused_call);
  const harness::LayerDifferences differences = harness::count_layer_differences(c, T, first, fused);
  for (int k = 0; k < harness::kNumLayerOutputs; ++k) {
    if (differences[k] != 0) {
      fail(o, std::string("repeated fused call: ") + kLayerOutputNames[k] + " differs in " +
                  std::to_string(differences[k]) + " bytes");
    }
  }
  return o;
}

// ---- pairs ----

// What one side's forward and backward did: each call's error message and its expert-id report
// (zeroed before the call, read after it), kept apart so that both must name a bad id.
struct SideResult {
  std::string setup_error;  // copying the accumulation's starting values
  std::string forward_error, backward_error;
  std::array<int32_t, 3> forward_report{}, backward_report{};
};

struct Side {
  Spec spec;
  Routing routing;
  LayerInputs in;
  LayerOutputs together, alone;
  void *init13 = nullptr, *init2 = nullptr, *saved_z = nullptr, *workspace = nullptr;
  Reports reports;
  cudaStream_t stream = nullptr;
  SideResult result_together, result_alone;
};

// Forward + backward of one side (fused): each call's error message and report.
void run_side(Side& side, const LayerOutputs& out, SideResult* result) {
  const Spec& s = side.spec;
  LayerCall call;
  call.impl = Impl::kFused;
  call.accumulate = s.accumulate;
  call.saved_z = side.saved_z;
  call.workspace = side.workspace;
  call.stream = side.stream;
  result->setup_error = error_of([&] { start_from_init(s, out, side.init13, side.init2, side.stream); });
  // With kSync and bad ids each call throws; in the report modes each fills its own report.
  result->forward_error = error_of([&] {
    set_id_check(call, s.id_check, side.reports);
    harness::run_forward_call(s.config, s.num_tokens, side.in, out, call);
    result->forward_report = read_report(s.id_check, side.reports, side.stream);
  });
  result->backward_error = error_of([&] {
    set_id_check(call, s.id_check, side.reports);
    harness::run_backward_call(s.config, s.num_tokens, side.in, out, call);
    result->backward_report = read_report(s.id_check, side.reports, side.stream);
  });
}

Outcome run_pair(std::array<Side, 2>& sides, DeviceArena& arena, int device) {
  Outcome o;
  arena.reset();
  for (Side& side : sides) {
    const Spec& s = side.spec;
    const LayerConfig& c = s.config;
    side.routing = make_routing(s);
    side.in = LayerInputs::carve(arena, c);
    side.together = LayerOutputs::carve(arena, c, s.grad_dtype);
    side.alone = LayerOutputs::carve(arena, c, s.grad_dtype);
    side.init13 = s.accumulate ? arena.take(grad_bytes(c, s.grad_dtype, true)) : nullptr;
    side.init2 = s.accumulate ? arena.take(grad_bytes(c, s.grad_dtype, false)) : nullptr;
    side.saved_z = s.save_z ? arena.take(saved_z_bytes(c)) : nullptr;
    side.workspace = arena.take(workspace_bytes(c, Impl::kFused));
    side.reports.device = static_cast<int32_t*>(arena.take(kReportBytes));
    side.in.fill_normal(c, s.num_tokens, s.seed, side.stream);
    side.in.upload_routing(side.routing.idx_TK, side.routing.w_TK, side.stream);
    fill_init(s, side.init13, side.init2, side.stream);
  }
  FUSEMOE_CUDA_CHECK(cudaDeviceSynchronize());

  // Both threads call the library at the same moment.
  std::atomic<int> ready{0};
  auto together = [&](Side* side) {
    const std::string set_error = error_of([&] { FUSEMOE_CUDA_CHECK(cudaSetDevice(device)); });
    ready.fetch_add(1);
    while (ready.load() < 2) std::this_thread::yield();
    if (!set_error.empty()) {
      side->result_together.setup_error = set_error;
      return;
    }
    run_side(*side, side->together, &side->result_together);
  };
  std::thread first(together, &sides[0]), second(together, &sides[1]);
  first.join();
  second.join();
  for (Side& side : sides) run_side(side, side.alone, &side.result_alone);

  for (int i = 0; i < 2; ++i) {
    const Side& side = sides[i];
    const Spec& s = side.spec;
    const std::string who = "layer " + std::string(i == 0 ? "A" : "B") + ": ";
    struct Run {
      const char* name;
      const SideResult& result;
    };
    const Run runs[] = {{"together", side.result_together}, {"alone", side.result_alone}};
    bool threw = false;
    for (const Run& run : runs) {
      if (run.result.setup_error.empty()) continue;
      fail(o, who + run.name + ": setting up threw '" + run.result.setup_error + "'");
      threw = true;
    }
    if (s.kind == Kind::kBadIds) {
      const std::string expected = expected_bad_id_message(s, side.routing);
      const std::array<int32_t, 3> expected_report{static_cast<int32_t>(side.routing.num_bad),
                                                   static_cast<int32_t>(side.routing.first_bad_slot),
                                                   side.routing.first_bad_value};
      for (const Run& run : runs) {
        const std::string where = who + run.name + ", ";
        if (s.id_check == IdCheck::kSync) {
          if (run.result.forward_error.find(expected) == std::string::npos) {
            fail(o, where + "forward: expected an error naming '" + expected + "', got '" + run.result.forward_error + "'");
          }
          if (run.result.backward_error.find(expected) == std::string::npos) {
            fail(o, where + "backward: expected an error naming '" + expected + "', got '" + run.result.backward_error +
                        "'");
          }
          continue;
        }
        if (!run.result.forward_error.empty() || !run.result.backward_error.empty()) {
          fail(o, where + "threw with a report given: forward '" + run.result.forward_error + "', backward '" +
                      run.result.backward_error + "'");
        }
        if (run.result.forward_report != expected_report || run.result.backward_report != expected_report) {
          fail(o, where + "reports " + report_text(run.result.forward_report) + " (forward), " +
                      report_text(run.result.backward_report) + " (backward), expected " +
                      report_text(expected_report));
        }
      }
      continue;
    }
    for (const Run& run : runs) {
      if (!run.result.forward_error.empty() || !run.result.backward_error.empty()) {
        fail(o, who + run.name + " threw: forward '" + run.result.forward_error + "', backward '" +
                    run.result.backward_error + "'");
        threw = true;
      }
      if (run.result.forward_report[0] != 0 || run.result.backward_report[0] != 0) {
        fail(o, who + run.name + ": valid ids, yet reports " + report_text(run.result.forward_report) + " (forward), " +
                    report_text(run.result.backward_report) + " (backward)");
      }
    }
    if (threw) continue;
    const harness::LayerDifferences differences =
        harness::count_layer_differences(s.config, s.num_tokens, side.together, side.alone);
    for (int k = 0; k < harness::kNumLayerOutputs; ++k) {
      if (differences[k] != 0) {
        fail(o, who + kLayerOutputNames[k] + " run together differs from alone in " + std::to_string(differences[k]) +
                    " bytes");
      }
    }
  }
  return o;
}

// ---- command line ----

struct Options {
  int64_t calls = 60;
  int64_t pairs = 4;
  double seconds = 280;
  uint64_t seed = 1;
  double memory_gib = 16;
  double max_gflop = 4000;
  bool plan = false;
  bool quiet = false;
};

void usage() {
  std::printf(
      "usage: fusemoe_pressure_test [--calls N] [--pairs P] [--seconds S] [--seed S] [--memory-gib G]\n"
      "                             [--max-gflop F] [--plan] [--quiet]\n"
      "  --calls N       random single-layer calls (default 60; the GPU round: 2000)\n"
      "  --pairs P       pairs of layers run together from two threads, first (default 4)\n"
      "  --seconds S     stop starting calls after S seconds; stopping early is a failure (default 280)\n"
      "  --seed S        seed of the first call and the first pair; each next seed is splitmix64 of\n"
      "                  the last. Reproduce call i alone: --seed <its seed> --calls 1 --pairs 0;\n"
      "                  pair i: --seed <its seed> --pairs 1 --calls 0\n"
      "  --memory-gib G  the arena every call's buffers come from (default 16): larger shapes redrawn\n"
      "  --max-gflop F   executed forward+backward GFLOP per call (22 H I T K; default 4000): larger redrawn\n"
      "  --plan          draw the calls and print what would run and an estimate; no GPU\n"
      "  --quiet         print failing calls only (and the summary)\n");
}

bool parse(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--calls") o->calls = std::atoll(value());
    else if (a == "--pairs") o->pairs = std::atoll(value());
    else if (a == "--seconds") o->seconds = std::atof(value());
    else if (a == "--seed") o->seed = std::strtoull(value(), nullptr, 0);
    else if (a == "--memory-gib") o->memory_gib = std::atof(value());
    else if (a == "--max-gflop") o->max_gflop = std::atof(value());
    else if (a == "--plan") o->plan = true;
    else if (a == "--quiet") o->quiet = true;
    else if (a == "--help" || a == "-h") {
      usage();
      std::exit(0);
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      usage();
      return false;
    }
  }
  return o->calls >= 0 && o->pairs >= 0 && o->seconds > 0 && o->memory_gib > 0 && o->max_gflop > 0;
}

std::string seed_text(uint64_t seed) {
  char text[32];
  std::snprintf(text, sizeof(text), "0x%016llx", static_cast<unsigned long long>(seed));
  return text;
}

// The calls' specs, drawn up front (host only).
std::vector<Spec> draw_calls(const Options& opt, size_t memory_bytes) {
  std::vector<Spec> specs;
  uint64_t seed = opt.seed;
  for (int64_t i = 0; i < opt.calls; ++i, seed = splitmix64(seed)) {
    Rng rng(seed);
    specs.push_back(draw_spec(rng, seed, opt.max_gflop * 1e9, memory_bytes, call_footprint));
  }
  return specs;
}

std::array<Spec, 2> draw_pair(uint64_t seed, const Options& opt, size_t memory_bytes) {
  Rng rng(splitmix64(seed ^ 0x70616972ull));
  std::array<Spec, 2> specs;
  // Each layer of the pair gets half the arena; the second has another shape.
  specs[0] = draw_spec(rng, seed, opt.max_gflop * 1e9, memory_bytes / 2, pair_side_footprint);
  do {
    specs[1] = draw_spec(rng, splitmix64(seed), opt.max_gflop * 1e9, memory_bytes / 2, pair_side_footprint);
  } while (specs[1].config.hidden == specs[0].config.hidden &&
           specs[1].config.intermediate == specs[0].config.intermediate &&
           specs[1].config.num_experts == specs[0].config.num_experts && specs[1].config.top_k == specs[0].config.top_k);
  return specs;
}

void print_coverage(const std::vector<Spec>& specs) {
  std::map<std::string, int64_t> count;
  int64_t zero_tokens = 0, below_max = 0, max_tokens = 0, max_experts = 0;
  for (const Spec& s : specs) {
    if (s.num_tokens >= 4096) ++count["T>=4096"];
    if (s.num_tokens >= 32768) ++count["T>=32768"];
    if (s.config.num_experts >= 256) ++count["E>=256"];
    if (s.config.top_k >= 16) ++count["K>=16"];
    if (s.config.hidden >= 4096) ++count["H>=4096"];
    if (s.config.intermediate >= 2048) ++count["I>=2048"];
    ++count[kKindNames[static_cast<int>(s.kind)]];
    ++count[s.grad_dtype == WeightGradDtype::kFloat32 ? "grad fp32" : "grad bf16"];
    ++count[s.accumulate ? "accumulate" : "overwrite"];
    ++count[s.save_z ? "z saved" : "z recomputed"];
    ++count[std::string("ids ") + kIdCheckNames[static_cast<int>(s.id_check)]];
    zero_tokens += s.num_tokens == 0;
    below_max += s.num_tokens < s.config.max_tokens;
    max_tokens = std::max(max_tokens, s.num_tokens);
    max_experts = std::max(max_experts, s.config.num_experts);
  }
  std::printf("coverage:");
  for (const auto& [name, n] : count) std::printf(" %s %lld,", name.c_str(), static_cast<long long>(n));
  std::printf(" T=0 %lld, T < max_tokens %lld, largest T %lld, largest E %lld\n", static_cast<long long>(zero_tokens),
              static_cast<long long>(below_max), static_cast<long long>(max_tokens), static_cast<long long>(max_experts));
}

// --plan: a rough time estimate from assumed rates (not measurements): fp32 reference 25 TFLOP/s,
// the unfused and the two fused calls 150 TFLOP/s, 3 ms of fixed cost per call (checks, syncs),
// every carved byte written about 4 times at 1.5 TB/s.
double estimated_seconds(const Spec& s) {
  const double flops = s.executed_flops();
  return 3e-3 + flops / 25e12 + 3 * flops / 150e12 + 4.0 * double(call_footprint(s)) / 1.5e12;
}

int run(const Options& opt) {
  const size_t memory_bytes = static_cast<size_t>(opt.memory_gib * double(size_t(1) << 30));
  std::printf("fusemoe_pressure_test: %lld pair(s), %lld call(s), seed %s, time budget %.0f s, memory budget %.1f GiB "
              "(weights + inputs + the three implementations' outputs + one workspace; a pair's layer: half), "
              "FLOP budget %.0f GFLOP per call\n",
              static_cast<long long>(opt.pairs), static_cast<long long>(opt.calls), seed_text(opt.seed).c_str(),
              opt.seconds, opt.memory_gib, opt.max_gflop);
  const std::vector<Spec> specs = draw_calls(opt, memory_bytes);
  int64_t redrawn_memory = 0, redrawn_flops = 0;
  for (const Spec& s : specs) {
    redrawn_memory += s.redrawn_for_memory;
    redrawn_flops += s.redrawn_for_flops;
  }
  if (opt.plan) {
    double seconds = 0, flops = 0, worst = 0;
    for (const Spec& s : specs) {
      seconds += estimated_seconds(s);
      flops += s.executed_flops();
      worst = std::max(worst, estimated_seconds(s));
    }
    print_coverage(specs);
    std::printf("plan: %lld calls, %.1f TFLOP executed in all, redrawn: %lld over the memory budget, %lld over the FLOP "
                "budget; estimate (assumed rates, not measured): %.0f s, slowest call %.2f s\n",
                static_cast<long long>(opt.calls), flops / 1e12, static_cast<long long>(redrawn_memory),
                static_cast<long long>(redrawn_flops), seconds, worst);
    return 0;
  }

  harness::GpuInfo gpu;
  std::string reason;
  if (!harness::find_sm90(&gpu, &reason)) {
    std::printf("SKIPPED: %s; the pressure test needs an sm_90 (Hopper) GPU\n", reason.c_str());
    return 77;
  }
  std::printf("GPU: %s, %d SMs, %.1f GiB, driver CUDA %s, runtime %s\n", gpu.name.c_str(), gpu.sm_count,
              gpu.memory_bytes / double(size_t(1) << 30), harness::cuda_version_string(gpu.driver_version).c_str(),
              harness::cuda_version_string(gpu.runtime_version).c_str());
  std::fflush(stdout);
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };

  DeviceArena arena(memory_bytes);
  std::array<cudaStream_t, 2> streams{};
  for (cudaStream_t& s : streams) FUSEMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::array<int32_t*, 3> pinned{};
  for (int32_t*& p : pinned) {
    FUSEMOE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&p), kReportBytes, cudaHostAllocDefault));
  }

  std::vector<std::string> failed;  // "call 17 seed 0x...: reason"
  bool context_lost = false, out_of_time = false;
  int64_t pairs_run = 0, pairs_failed = 0, calls_run = 0, calls_failed = 0;
  auto lost = [&] {  // a sticky error (a trap) ends the context: nothing after it can run
    const cudaError_t status = cudaDeviceSynchronize();
    if (status == cudaSuccess) return false;
    std::printf("FAIL: the CUDA context is lost (%s): stopping\n", cudaGetErrorString(status));
    return true;
  };

  // Loop 1: pairs, first.
  int device = 0;
  FUSEMOE_CUDA_CHECK(cudaGetDevice(&device));
  uint64_t pair_seed = opt.seed;
  for (int64_t i = 0; i < opt.pairs && !context_lost; ++i, pair_seed = splitmix64(pair_seed)) {
    if (elapsed() > opt.seconds) {
      out_of_time = true;
      break;
    }
    const auto call_start = std::chrono::steady_clock::now();
    std::array<Side, 2> sides;
    const std::array<Spec, 2> specs_of_pair = draw_pair(pair_seed, opt, memory_bytes);
    for (int k = 0; k < 2; ++k) {
      sides[k].spec = specs_of_pair[k];
      sides[k].stream = streams[k];
      sides[k].reports.pinned = pinned[1 + k];
    }
    Outcome o;
    const std::string error = error_of([&] { o = run_pair(sides, arena, device); });
    if (!error.empty()) fail(o, "error: " + error);
    ++pairs_run;
    const double ms = 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - call_start).count();
    const std::string head = "pair " + std::to_string(i) + " seed " + seed_text(pair_seed);
    if (!o.failures.empty() || !opt.quiet) {
      std::printf("%s: A %s | B %s: %s (%.1f ms)\n", head.c_str(), sides[0].spec.describe().c_str(),
                  sides[1].spec.describe().c_str(), o.failures.empty() ? "ok" : "FAIL", ms);
    }
    for (const std::string& f : o.failures) std::printf("  FAIL %s\n", f.c_str());
    if (!o.failures.empty()) {
      ++pairs_failed;
      failed.push_back(head + " (--seed " + seed_text(pair_seed) + " --pairs 1 --calls 0): " + o.failures[0]);
    }
    std::fflush(stdout);
    context_lost = !error.empty() && lost();
  }

  // Loop 2: single calls.
  double pool_fused_sq = 0, pool_base_sq = 0, pool_ref_sq = 0;
  int64_t pooled_calls = 0;
  std::vector<std::pair<double, std::string>> pool_contributors;  // (fused squared error, seed)
  for (size_t i = 0; i < specs.size() && !context_lost; ++i) {
    if (elapsed() > opt.seconds) {
      out_of_time = true;
      break;
    }
    const Spec& s = specs[i];
    const auto call_start = std::chrono::steady_clock::now();
    Outcome o;
    const std::string error = error_of([&] { o = run_call(s, arena, pinned[0], streams[0]); });
    if (!error.empty()) fail(o, "error: " + error);
    ++calls_run;
    const double ms = 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - call_start).count();
    const std::string head = "call " + std::to_string(i) + " seed " + seed_text(s.seed);
    if (!o.failures.empty() || !opt.quiet) {
      std::printf("%s: %s: %s%s%s (%.1f ms)\n", head.c_str(), s.describe().c_str(), o.failures.empty() ? "ok" : "FAIL",
                  o.figures.empty() ? "" : ", ", o.figures.c_str(), ms);
    }
    for (const std::string& f : o.failures) std::printf("  FAIL %s\n", f.c_str());
    if (!o.failures.empty()) {
      ++calls_failed;
      failed.push_back(head + " (--seed " + seed_text(s.seed) + " --calls 1 --pairs 0): " + o.failures[0]);
    }
    if (o.pooled) {
      ++pooled_calls;
      pool_fused_sq += o.pool_fused_sq;
      pool_base_sq += o.pool_base_sq;
      pool_ref_sq += o.pool_ref_sq;
      pool_contributors.emplace_back(o.pool_fused_sq, seed_text(s.seed));
    }
    std::fflush(stdout);
    context_lost = !error.empty() && lost();
  }

  // The pooled d_topk_weights of the calls with few valid slots, under the same rule.
  const double pool_ref_norm = std::sqrt(pool_ref_sq);
  const double pool_fused = pool_ref_norm > 0 ? std::sqrt(pool_fused_sq) / pool_ref_norm : std::sqrt(pool_fused_sq);
  const double pool_base = pool_ref_norm > 0 ? std::sqrt(pool_base_sq) / pool_ref_norm : std::sqrt(pool_base_sq);
  const bool pool_ok = pool_fused <= fa3_bound(pool_base);
  std::printf("pooled d_topk_weights of %lld call(s) with < %lld distinct valid slots: fused rel_l2 %.3e, unfused %.3e, bound "
              "%.3e: %s\n",
              static_cast<long long>(pooled_calls), static_cast<long long>(kMinSlotsForRatio), pool_fused, pool_base,
              fa3_bound(pool_base), pool_ok ? "ok" : "FAIL");
  if (!pool_ok) {
    std::sort(pool_contributors.rbegin(), pool_contributors.rend());
    std::printf("  largest contributions (fused squared error, seed):");
    for (size_t k = 0; k < std::min<size_t>(5, pool_contributors.size()); ++k) {
      std::printf(" %.2e %s", pool_contributors[k].first, pool_contributors[k].second.c_str());
    }
    std::printf("\n");
    failed.push_back("pooled d_topk_weights check");
  }

  std::vector<Spec> run_specs(specs.begin(), specs.begin() + calls_run);
  print_coverage(run_specs);
  const bool pass = failed.empty() && !out_of_time && !context_lost;
  std::printf("pressure summary: pairs %lld of %lld run, %lld failed; calls %lld of %lld run, %lld passed, %lld failed; "
              "shapes redrawn: %lld over the memory budget (%.1f GiB), %lld over the FLOP budget (%.0f GFLOP); "
              "%.1f s%s%s\n",
              static_cast<long long>(pairs_run), static_cast<long long>(opt.pairs), static_cast<long long>(pairs_failed),
              static_cast<long long>(calls_run), static_cast<long long>(opt.calls),
              static_cast<long long>(calls_run - calls_failed), static_cast<long long>(calls_failed),
              static_cast<long long>(redrawn_memory), opt.memory_gib, static_cast<long long>(redrawn_flops),
              opt.max_gflop, elapsed(), out_of_time ? "; INCOMPLETE: the time budget ended the run" : "",
              context_lost ? "; the CUDA context was lost" : "");
  for (const std::string& f : failed) std::printf("  failed: %s\n", f.c_str());
  std::printf("%s\n", pass ? "PASS" : "FAIL");

  for (int32_t* p : pinned) cudaFreeHost(p);
  for (cudaStream_t s : streams) cudaStreamDestroy(s);
  return pass ? 0 : 1;
}

}  // namespace
}  // namespace fusemoe::pressure

int main(int argc, char** argv) {
  return fusemoe::harness::tool_main<fusemoe::pressure::Options>(argc, argv, fusemoe::pressure::parse, fusemoe::pressure::run);
}

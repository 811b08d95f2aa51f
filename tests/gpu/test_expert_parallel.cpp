// The expert-parallel layer on one GPU, its R ranks co-resident in this process: each rank has
// its own stream, host thread, symmetric workspace (the peer table is the R workspaces) and a
// 1/R share of the SMs, so the ranks' kernels run truly concurrently and wait on each other's
// signals. Every output must be bitwise the single-GPU fused layer's on the concatenated batch
// (rank 0's tokens first) with all experts local: y, dx and d_topk_weights of each rank's tokens,
// dw13/dw2 of each rank's experts. Outputs, private workspaces (before every call) and (in one
// case) the symmetric workspaces are NaN-poisoned first. The FP8 cases (ExpertParallelFp8) compare with the single-GPU
// FP8 fused layer the same way: each rank gets the FP8 buffer of its own experts (quantized for a
// layer of E / R experts) and null bf16 weights, which an FP8 call must not read.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/device_wait.h"
#include "fusemoe/expert_parallel.h"
#include "gpu/ep_test_util.h"

namespace fusemoe::test {
namespace {

// Raw outputs (bits) of one forward + backward.
struct RawOutputs {
  std::vector<uint16_t> y, dx;     // [T, H] bf16
  std::vector<float> d_topk_w;     // [T, K]
  std::vector<uint8_t> dw13, dw2;  // [E', 2I, H], [E', H, I] of the grad dtype
};

struct EpCase {
  int world_size;
  std::vector<int64_t> tokens;  // per rank
  Routing routing;
  // Optional rewrite of the concatenated batch's topk_idx (token t of the batch, its rank).
  std::function<void(HostProblem&, const std::vector<int64_t>& first_token)> reroute;
  bool save_z = true;
  WeightGradDtype grad_dtype = WeightGradDtype::kBFloat16;
  bool poison_symmetric = false;
  int calls = 1;  // repeated forward + backward calls, each bitwise equal to the first
  // The backward adds the weight gradients to what dw13/dw2 hold (initial_grads), as gradient
  // accumulation over micro-batches does, on both sides of the comparison.
  bool accumulate = false;
  // The backward gets null dw13 (frozen gate/up weights) and/or null dw2 (frozen down weights):
  // such a buffer must keep its poison and every other output is the single-GPU layer's.
  bool frozen_gate_up = false;
  bool frozen_down = false;
  // Holds the legacy default stream this long (a host function) just before the last rank's
  // symmetric workspace is zeroed there: the zeroing then runs while the ranks are mid-protocol
  // unless the set-up waits for it before any rank starts.
  int delay_zeroing_ms = 0;
  Precision precision = Precision::kBf16;  // of both layers
  int64_t intermediate = 0;                // I of the layer; 0: kEpDims' (128)
};

// Bytes of the whole layer's initial dw13 or dw2 for an accumulating backward: element i holds
// ((i % 17) - 8) / 1024, exact in bf16 and fp32.
std::vector<uint8_t> initial_grads(int64_t elements, WeightGradDtype dtype) {
  const size_t g = dtype == WeightGradDtype::kBFloat16 ? 2 : 4;
  std::vector<uint8_t> bytes(elements * g);
  for (int64_t i = 0; i < elements; ++i) {
    const float v = static_cast<float>(i % 17 - 8) / 1024.0f;
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    if (g == 2) {
      const uint16_t half = static_cast<uint16_t>(bits >> 16);  // exact: v has few mantissa bits
      std::memcpy(&bytes[i * 2], &half, 2);
    } else {
      std::memcpy(&bytes[i * 4], &bits, 4);
    }
  }
  return bytes;
}

constexpr Dims kEpDims{0, 256, 128, 8, 4};

// The fused layer on the whole batch, all experts local: outputs, workspace and saved z
// poisoned first.
RawOutputs run_single_gpu(const HostProblem& p, const EpCase& c) {
  const Dims& d = p.d;
  LayerConfig config = config_of(d, std::max<int64_t>(d.T, 1));
  config.precision = c.precision;
  const bool fp8 = c.precision == Precision::kFp8Blockwise;
  const DeviceInputs in(p);
  const DeviceBuffer fp8_weights = fp8 ? quantized_weights(config, in.w13, in.w2) : DeviceBuffer();
  const size_t g = c.grad_dtype == WeightGradDtype::kBFloat16 ? 2 : 4;
  DeviceBuffer y(d.T * d.H * 2), dx(d.T * d.H * 2), dtw(d.T * d.K * 4), dw13(d.E * 2 * d.I * d.H * g),
      dw2(d.E * d.H * d.I * g), ws(workspace_bytes(config, Impl::kFused)),
      saved_z(c.save_z ? saved_z_bytes(config) : 0);
  for (DeviceBuffer* b : {&y, &dx, &dtw, &dw13, &dw2, &ws, &saved_z}) b->poison();
  if (c.accumulate) {
    dw13.copy_from(DeviceBuffer::from(initial_grads(d.E * 2 * d.I * d.H, c.grad_dtype)));
    dw2.copy_from(DeviceBuffer::from(initial_grads(d.E * d.H * d.I, c.grad_dtype)));
  }
  // An FP8 call reads the FP8 buffer only.
  auto set_weights = [&](auto& a) {
    if (!fp8) return;
    a.w13 = a.w2 = nullptr;
    a.fp8_weights = fp8_weights.get();
  };
  ForwardArgs fa = in.args<ForwardArgs>(d.T, ws);
  fa.y = y.get();
  fa.saved_z = c.save_z ? saved_z.get() : nullptr;
  fa.sync_check_expert_ids = false;
  set_weights(fa);
  forward(config, Impl::kFused, fa);
  BackwardArgs ba = in.args<BackwardArgs>(d.T, ws);  // dy too
  set_weights(ba);
  ba.dx = dx.get();
  ba.d_topk_weights = dtw.as<float>();
  ba.dw13 = dw13.get();
  ba.dw2 = dw2.get();
  ba.weight_grad_dtype = c.grad_dtype;
  ba.accumulate_weight_grads = c.accumulate;
  ba.saved_z = fa.saved_z;
  ba.sync_check_expert_ids = false;
  backward(config, Impl::kFused, ba);
  TEST_CUDA(cudaDeviceSynchronize());
  return {y.to_host<uint16_t>(), dx.to_host<uint16_t>(), dtw.to_host<float>(), dw13.to_host<uint8_t>(),
          dw2.to_host<uint8_t>()};
}

// One rank's device state.
struct Rank {
  RankInputs in;
  DeviceBuffer y, dx, dtw, dw13, dw2, ws, saved, symmetric;
  DeviceBuffer fp8_weights;  // FP8: the buffer of this rank's experts
  cudaStream_t stream = nullptr;
};

// Runs the EP layer with c.world_size co-resident ranks; returns each rank's outputs of every call.
std::vector<std::vector<RawOutputs>> run_ep(const HostProblem& p, const EpCase& c,
                                            const std::vector<int64_t>& first_token) {
  const Dims& d = p.d;
  const int R = c.world_size;
  const int64_t El = d.E / R;
  const size_t g = c.grad_dtype == WeightGradDtype::kBFloat16 ? 2 : 4;
  int64_t max_tokens = 1;
  for (int64_t t : c.tokens) max_tokens = std::max(max_tokens, t);
  EpConfig config;
  config.layer = config_of(d, max_tokens);
  config.layer.precision = c.precision;
  config.world_size = R;
  const bool fp8 = c.precision == Precision::kFp8Blockwise;
  int num_sms = 0;
  TEST_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
  std::vector<Rank> ranks(R);
  std::vector<void*> peers(R);
  // Each rank's slice of the layer's initial weight gradients (c.accumulate).
  const std::vector<uint8_t> init13 = initial_grads(d.E * 2 * d.I * d.H, c.grad_dtype);
  const std::vector<uint8_t> init2 = initial_grads(d.E * d.H * d.I, c.grad_dtype);
  for (int r = 0; r < R; ++r) {
    config.rank = r;
    Rank& k = ranks[r];
    const int64_t T = c.tokens[r], t0 = first_token[r];
    k.in = RankInputs(p, t0, T, r * El, El);
    if (fp8) {  // this rank's E / R experts, through the EP API (K 4 > E / R at R 4 and 8 here)
      k.fp8_weights = DeviceBuffer(ep_fp8_weights_bytes(config));
      k.fp8_weights.poison();
      ep_quantize_weights_fp8(config, k.in.w13.get(), k.in.w2.get(), k.fp8_weights.get(), k.fp8_weights.bytes(),
                              nullptr);
    }
    k.y = DeviceBuffer(T * d.H * 2);
    k.dx = DeviceBuffer(T * d.H * 2);
    k.dtw = DeviceBuffer(T * d.K * 4);
    k.dw13 = DeviceBuffer(El * 2 * d.I * d.H * g);
    k.dw2 = DeviceBuffer(El * d.H * d.I * g);
    if (c.frozen_gate_up) k.dw13.poison();
    if (c.frozen_down) k.dw2.poison();
    k.ws = DeviceBuffer(ep_workspace_bytes(config));
    k.saved = DeviceBuffer(c.save_z ? ep_saved_state_bytes(config) : 0);
    k.symmetric = DeviceBuffer(ep_symmetric_bytes(config));
    if (c.delay_zeroing_ms > 0 && r == R - 1) {
      TEST_CUDA(cudaLaunchHostFunc(
          nullptr, [](void* ms) { std::this_thread::sleep_for(std::chrono::milliseconds(*static_cast<int*>(ms))); },
          const_cast<int*>(&c.delay_zeroing_ms)));
    }
    // Zeroed once, as the API asks; or all 0xFF: the slot rows NaN, the flags and the call
    // counter -1, which the protocol must also start from.
    TEST_CUDA(cudaMemset(k.symmetric.get(), c.poison_symmetric ? 0xFF : 0, k.symmetric.bytes()));
    TEST_CUDA(cudaStreamCreateWithFlags(&k.stream, cudaStreamNonBlocking));
    peers[r] = k.symmetric.get();
  }
  // The zeroing ran on the legacy default stream, which the ranks' non-blocking streams do not
  // wait for (the next rank's DeviceBuffer::from synchronised every rank's but the last). Done
  // before any rank starts: a late memset wipes a peer's "message ready" flag (or the rank's call
  // counter) that no one writes again, and the exchange then waits out its bound for a routing
  // message of call 1. FUSEMOE_TEST_SKIP_ZEROING_SYNC=1 leaves the wait out, to show what it prevents
  // (SymmetricZeroingDoneBeforeTheRanksStart then times out; FUSEMOE_WAIT_TIMEOUT_S shortens that).
  if (std::getenv("FUSEMOE_TEST_SKIP_ZEROING_SYNC") == nullptr) TEST_CUDA(cudaDeviceSynchronize());
  std::vector<std::vector<RawOutputs>> out(R);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(R);
  for (int r = 0; r < R; ++r) {
    threads.emplace_back([&, r] {
      try {
        EpConfig rc = config;
        rc.rank = r;
        Rank& k = ranks[r];
        // Every copy and fill of a rank goes on its own stream: an operation on the legacy
        // default stream could wait behind another rank's kernel that waits for this rank.
        auto download = [&](const DeviceBuffer& b, auto* tag) {
          using T = std::remove_pointer_t<decltype(tag)>;
          std::vector<T> host(b.bytes() / sizeof(T));
          if (b.bytes()) TEST_CUDA(cudaMemcpyAsync(host.data(), b.get(), b.bytes(), cudaMemcpyDeviceToHost, k.stream));
          return host;
        };
        for (int call = 0; call < c.calls; ++call) {
          for (DeviceBuffer* b : {&k.y, &k.dx, &k.dtw, &k.dw13, &k.dw2, &k.ws}) {
            if (b->bytes()) TEST_CUDA(cudaMemsetAsync(b->get(), 0xFF, b->bytes(), k.stream));
          }
          if (c.accumulate) {  // pageable host memory: the copies finish before they return
            const std::vector<uint8_t> s13 = rows_of(init13, r * El, El, 2 * d.I * d.H * g);
            const std::vector<uint8_t> s2 = rows_of(init2, r * El, El, d.H * d.I * g);
            TEST_CUDA(cudaMemcpyAsync(k.dw13.get(), s13.data(), s13.size(), cudaMemcpyHostToDevice, k.stream));
            TEST_CUDA(cudaMemcpyAsync(k.dw2.get(), s2.data(), s2.size(), cudaMemcpyHostToDevice, k.stream));
            TEST_CUDA(cudaStreamSynchronize(k.stream));
          }
          EpForwardArgs fa;
          EpCall& call_args = fa.call;
          call_args = k.in.call(c.tokens[r], peers.data(), k.ws);
          call_args.num_sms = num_sms / R;
          call_args.stream = k.stream;
          if (fp8) {
            call_args.w13 = call_args.w2 = nullptr;
            call_args.fp8_weights = k.fp8_weights.get();
          }
          fa.y = k.y.get();
          fa.saved_state = c.save_z ? k.saved.get() : nullptr;
          // The private workspace poisoned before each call (one buffer serves every call, and a
          // call may read nothing an earlier call left there): a region read before this call
          // writes it shows as NaN rows, e.g. x rows the backward did not pull.
          TEST_CUDA(cudaMemsetAsync(k.ws.get(), 0xFF, k.ws.bytes(), k.stream));
          ep_forward(rc, fa);
          TEST_CUDA(cudaMemsetAsync(k.ws.get(), 0xFF, k.ws.bytes(), k.stream));
          EpBackwardArgs ba;
          ba.call = call_args;
          ba.dy = k.in.dy.get();
          ba.dx = k.dx.get();
          ba.d_topk_weights = static_cast<float*>(k.dtw.get());
          ba.dw13 = c.frozen_gate_up ? nullptr : k.dw13.get();
          ba.dw2 = c.frozen_down ? nullptr : k.dw2.get();
          ba.weight_grad_dtype = c.grad_dtype;
          ba.accumulate_weight_grads = c.accumulate;
          ba.saved_state = fa.saved_state;
          ep_backward(rc, ba);
          RawOutputs o{download(k.y, (uint16_t*)nullptr), download(k.dx, (uint16_t*)nullptr),
                       download(k.dtw, (float*)nullptr), download(k.dw13, (uint8_t*)nullptr),
                       download(k.dw2, (uint8_t*)nullptr)};
          TEST_CUDA(cudaStreamSynchronize(k.stream));
          out[r].push_back(std::move(o));
        }
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < R; ++r) {
    EXPECT_TRUE(errors[r].empty()) << "rank " << r << " (after " << out[r].size() << " calls): " << errors[r];
  }
  for (int r = 0; r < R; ++r) cudaStreamDestroy(ranks[r].stream);  // a failed context keeps its error
  return out;
}

// The first element where a and b differ bitwise; b.size() when they are equal; SIZE_MAX (never
// b.size()) when their sizes differ.
template <class T>
size_t first_difference(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return SIZE_MAX;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return i;
  }
  return a.size();
}

#define EXPECT_BITWISE(got, want, what)                                                                  \
  do {                                                                                                   \
    const size_t at_ = first_difference(got, want);                                                      \
    EXPECT_EQ(at_, (want).size()) << what << ": first difference at element " << at_ << " of "           \
                                  << (want).size() << " (sizes " << (got).size() << ", " << (want).size() \
                                  << ")";                                                                \
  } while (0)

void run_case(const EpCase& c) {
  Dims d = kEpDims;
  if (c.intermediate > 0) d.I = c.intermediate;
  std::vector<int64_t> first(c.tokens.size(), 0);
  d.T = 0;
  for (size_t r = 0; r < c.tokens.size(); ++r) {
    first[r] = d.T;
    d.T += c.tokens[r];
  }
  HostProblem p = make_problem(d, c.routing, 1000 + c.world_size);
  if (c.reroute) c.reroute(p, first);
  const RawOutputs single = run_single_gpu(p, c);
  // Both sides poison with 0xFF, so an output neither side writes would compare equal: the
  // reference must have written every element (an all-ones bf16/fp32 is a NaN, never a result).
  const auto unwritten = [](const auto& v) {
    using T = typename std::decay_t<decltype(v)>::value_type;
    return std::count_if(v.begin(), v.end(), [](T e) { return e == static_cast<T>(~T{0}); });
  };
  EXPECT_EQ(unwritten(single.y), 0) << "single-GPU y";
  EXPECT_EQ(unwritten(single.dx), 0) << "single-GPU dx";
  const auto ep = run_ep(p, c, first);
  const int64_t El = d.E / c.world_size;
  const size_t g = c.grad_dtype == WeightGradDtype::kBFloat16 ? 2 : 4;
  for (int r = 0; r < c.world_size; ++r) {
    ASSERT_EQ(ep[r].size(), static_cast<size_t>(c.calls)) << "rank " << r;
    for (int call = 0; call < c.calls; ++call) {
      const RawOutputs& o = ep[r][call];
      const std::string where = "rank " + std::to_string(r) + " call " + std::to_string(call);
      EXPECT_BITWISE(o.y, rows_of(single.y, first[r], c.tokens[r], d.H), where + " y");
      EXPECT_BITWISE(o.dx, rows_of(single.dx, first[r], c.tokens[r], d.H), where + " dx");
      EXPECT_BITWISE(o.d_topk_w, rows_of(single.d_topk_w, first[r], c.tokens[r], d.K), where + " d_topk_weights");
      const auto poisoned = [](const std::vector<uint8_t>& v) {
        return std::all_of(v.begin(), v.end(), [](uint8_t b) { return b == 0xFF; });
      };
      if (c.frozen_gate_up) {
        EXPECT_TRUE(poisoned(o.dw13)) << where << " dw13 was written (frozen)";
      } else {
        EXPECT_BITWISE(o.dw13, rows_of(single.dw13, r * El, El, 2 * d.I * d.H * g), where + " dw13");
      }
      if (c.frozen_down) {
        EXPECT_TRUE(poisoned(o.dw2)) << where << " dw2 was written (frozen)";
      } else {
        EXPECT_BITWISE(o.dw2, rows_of(single.dw2, r * El, El, d.H * d.I * g), where + " dw2");
      }
    }
  }
}

// Rewrites the batch's ids: every valid slot of every token to the experts `to(t, j)` returns.
std::function<void(HostProblem&, const std::vector<int64_t>&)> reroute_with(
    std::function<int32_t(int64_t t, int64_t j, int rank)> to) {
  return [to](HostProblem& p, const std::vector<int64_t>& first) {
    for (int64_t t = 0; t < p.d.T; ++t) {
      int rank = 0;
      while (rank + 1 < static_cast<int>(first.size()) && t >= first[rank + 1]) ++rank;
      for (int64_t j = 0; j < p.d.K; ++j) {
        if (p.idx_TK[t * p.d.K + j] >= 0) p.idx_TK[t * p.d.K + j] = to(t, j, rank);
      }
    }
  };
}

TEST(ExpertParallel, TwoRanksUniformMatchesSingleGpu) { run_case({2, {300, 257}, Routing::kUniform}); }
TEST(ExpertParallel, FourRanksUnevenAndEmptyRanks) { run_case({4, {400, 0, 129, 1}, Routing::kUniform}); }
TEST(ExpertParallel, EightRanksSkewedFp32GradsRecomputedZ) {
  EpCase c{8, {100, 70, 0, 3, 128, 64, 1, 200}, Routing::kSkewed};
  c.save_z = false;
  c.grad_dtype = WeightGradDtype::kFloat32;
  run_case(c);
}
TEST(ExpertParallel, OneRankIsTheWholeLayer) { run_case({1, {333}, Routing::kMasked}); }
// Gradient accumulation (accumulate_weight_grads): the EP backward adds to dw13/dw2 what the
// single-GPU backward adds, bitwise; two calls, so the second starts from the same values again.
TEST(ExpertParallel, TwoRanksAccumulateBf16WeightGrads) {
  EpCase c{2, {211, 96}, Routing::kUniform};
  c.accumulate = true;
  c.calls = 2;
  run_case(c);
}
TEST(ExpertParallel, FourRanksAccumulateFp32WeightGradsRecomputedZ) {
  EpCase c{4, {64, 0, 150, 33}, Routing::kSkewed};
  c.accumulate = true;
  c.save_z = false;
  c.grad_dtype = WeightGradDtype::kFloat32;
  run_case(c);
}
// Frozen experts: a weight gradient not asked for is not written; the others, dx and
// d_topk_weights are the single-GPU layer's (which computes them all), with z saved and recomputed.
TEST(ExpertParallel, FrozenExpertsWriteNoWeightGradients) {
  for (bool save_z : {true, false}) {
    for (const auto& [gate_up, down] : {std::pair{true, false}, std::pair{false, true}, std::pair{true, true}}) {
      EpCase c{2, {211, 96}, Routing::kUniform};
      c.frozen_gate_up = gate_up;
      c.frozen_down = down;
      c.save_z = save_z;
      run_case(c);
    }
  }
}
TEST(ExpertParallel, MaskedSlotsAndEmptyExperts) {
  run_case({2, {200, 150}, Routing::kMasked});
  run_case({4, {100, 100, 100, 100}, Routing::kFewExperts});
}
TEST(ExpertParallel, EveryTokenToOneRank) {
  EpCase c{4, {150, 90, 210, 33}, Routing::kUniform};
  c.reroute = reroute_with([](int64_t, int64_t j, int) { return static_cast<int32_t>(j % 2); });  // rank 0's experts
  run_case(c);
}
TEST(ExpertParallel, EveryTokenToOneExpert) {
  EpCase c{2, {120, 80}, Routing::kUniform};
  c.reroute = reroute_with([](int64_t, int64_t, int) { return 5; });  // repeated ids: all slots to expert 5
  run_case(c);
}
TEST(ExpertParallel, TokensStayOnTheirRank) {
  EpCase c{4, {90, 110, 64, 1}, Routing::kUniform};
  c.reroute = reroute_with([](int64_t t, int64_t j, int rank) { return static_cast<int32_t>(rank * 2 + (t + j) % 2); });
  run_case(c);
}
TEST(ExpertParallel, PoisonedSymmetricWorkspaceNeverReachesOutputs) {
  EpCase c{2, {180, 220}, Routing::kMasked};
  c.poison_symmetric = true;
  run_case(c);
}
// The set-up's zeroing is complete before the ranks start, however late the legacy stream runs
// it (here 5 ms into a run of 8 ranks over 20 calls; without the wait every later call of rank 7
// starts from a reset call counter and its peers time out on its messages).
TEST(ExpertParallel, SymmetricZeroingDoneBeforeTheRanksStart) {
  EpCase c{8, {40, 33, 0, 64, 17, 1, 50, 64}, Routing::kUniform};
  c.calls = 20;
  c.delay_zeroing_ms = 5;
  run_case(c);
}
TEST(ExpertParallel, HundredCallsBitwiseEqual) {
  EpCase c{2, {64, 96}, Routing::kUniform};
  c.calls = 100;
  run_case(c);
}

// Blockwise FP8 (Precision::kFp8Blockwise): the owner quantizes its pulled bf16 rows per row, so
// every output is bitwise the single-GPU FP8 fused layer's on the concatenated batch.
EpCase fp8_case(EpCase c) {
  c.precision = Precision::kFp8Blockwise;
  return c;
}
TEST(ExpertParallelFp8, TwoRanksUniformMatchesSingleGpu) { run_case(fp8_case({2, {300, 257}, Routing::kUniform})); }
TEST(ExpertParallelFp8, FourRanksUnevenAndEmptyRanks) {
  run_case(fp8_case({4, {400, 0, 129, 1}, Routing::kUniform}));
}
TEST(ExpertParallelFp8, EightRanksSkewedFp32GradsRecomputedZ) {
  EpCase c = fp8_case({8, {100, 70, 0, 3, 128, 64, 1, 200}, Routing::kSkewed});
  c.save_z = false;
  c.grad_dtype = WeightGradDtype::kFloat32;
  run_case(c);
}
TEST(ExpertParallelFp8, MaskedSlotsAndEmptyExperts) {
  run_case(fp8_case({2, {200, 150}, Routing::kMasked}));
  run_case(fp8_case({4, {100, 100, 100, 100}, Routing::kFewExperts}));
}
// I = 512: the FP8 dgrad writes ceil(I / 256) = 2 router partials per row (the buffer has room
// for ceil(I / 128) = 4), so a stride mismatch between the dgrad and the push shows in
// d_topk_weights (at I = 128 every row has one partial and no stride is exercised).
TEST(ExpertParallelFp8, SeveralRouterPartialsPerRow) {
  EpCase c = fp8_case({4, {150, 0, 64, 97}, Routing::kUniform});
  c.intermediate = 512;
  run_case(c);
  c.save_z = false;
  run_case(c);
}
TEST(ExpertParallelFp8, EveryTokenToOneExpert) {
  EpCase c = fp8_case({2, {120, 80}, Routing::kUniform});
  c.reroute = reroute_with([](int64_t, int64_t, int) { return 5; });  // repeated ids: all slots to expert 5
  run_case(c);
}
// The FP8 backward gathers no bf16 x rows when dW13 is not asked for, even recomputing z (its
// recompute reads the quantized x pool), and no bf16 dy rows when dW2 is not (its dgrad reads the
// quantized dy pool): either frozen alone, then both; two calls, accumulating, so the second
// starts over.
TEST(ExpertParallelFp8, FrozenExpertsAndAccumulatedGradsRecomputedZ) {
  for (bool save_z : {true, false}) {
    for (const auto& [gate_up, down] : {std::pair{true, false}, std::pair{false, true}, std::pair{true, true}}) {
      EpCase c = fp8_case({2, {211, 96}, Routing::kUniform});
      c.frozen_gate_up = gate_up;
      c.frozen_down = down;
      c.save_z = save_z;
      run_case(c);
    }
  }
  EpCase c = fp8_case({4, {64, 0, 150, 33}, Routing::kSkewed});
  c.accumulate = true;
  c.save_z = false;
  c.calls = 2;
  run_case(c);
}

TEST(ExpertParallel, BadExpertIdsAreReported) {
  Dims d = kEpDims;
  d.T = 16;
  HostProblem p = make_problem(d, Routing::kUniform, 5);
  p.idx_TK[3 * d.K + 1] = 99;  // token 3 of rank 0
  EpConfig config;
  config.layer = config_of(d, 16);
  config.world_size = 1;
  const RankInputs in(p, 0, d.T, 0, d.E);
  DeviceBuffer y(d.T * d.H * 2), ws(ep_workspace_bytes(config)), sym(ep_symmetric_bytes(config));
  TEST_CUDA(cudaMemset(sym.get(), 0, sym.bytes()));
  void* peers[1] = {sym.get()};
  EpForwardArgs fa;
  fa.call = in.call(d.T, peers, ws);
  fa.y = y.get();
  try {
    ep_forward(config, fa);
    FAIL() << "a bad expert id must be reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("first at token 3, slot 1, value 99"), std::string::npos) << e.what();
  }
}

// One rank never launches: the other fails within the timeout with an error naming the rank it
// waited for. A trap ends the CUDA context, so this runs in a child process.
TEST(ExpertParallelDeathTest, AMissingRankTimesOutWithADiagnostic) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto lonely_rank = [] {
    set_device_wait_timeout(0.5);
    Dims d = kEpDims;
    d.T = 64;
    HostProblem p = make_problem(d, Routing::kUniform, 9);
    EpConfig config;
    config.layer = config_of(d, 64);
    config.world_size = 2;
    config.rank = 0;
    const RankInputs in(p, 0, d.T, 0, 4);  // rank 0's 4 of the 8 experts
    DeviceBuffer y(d.T * d.H * 2), ws(ep_workspace_bytes(config)), sym0(ep_symmetric_bytes(config)),
        sym1(ep_symmetric_bytes(config));
    TEST_CUDA(cudaMemset(sym0.get(), 0, sym0.bytes()));
    TEST_CUDA(cudaMemset(sym1.get(), 0, sym1.bytes()));
    void* peers[2] = {sym0.get(), sym1.get()};
    EpForwardArgs fa;
    fa.call = in.call(d.T, peers, ws);
    fa.y = y.get();
    try {
      ep_forward(config, fa);  // syncs for the id check: rank 1's message never comes
    } catch (const Error& e) {
      std::fprintf(stderr, "%s\n", e.what());
      std::exit(3);
    }
    std::exit(0);
  };
  EXPECT_EXIT(lonely_rank(), ::testing::ExitedWithCode(3),
              "expert-parallel exchange .* waited 0\\.[5-9][0-9]* s for the routing message of source rank 1 "
              "\\(rank 0 waiting; call 1, flag at 0\\)");
}

}  // namespace
}  // namespace fusemoe::test

// GPU tests of the fused forward (Impl::kFused). Accuracy follows the FA3 rule: against the
// fp64 CPU reference (small shapes) or the fp32 GPU reference (Qwen3 shapes), the fused error
// must be at most 2 x the unfused bf16 baseline's error + kAtol. Also: every token count and
// routing edge case, NaN-poisoned outputs and workspace, bitwise determinism over 20 calls and
// from a CUDA-graph replay, deferred and immediate bad-id reports, clamp, max_tokens > T.
#include <string>
#include <tuple>

#include "gpu/gpu_test_util.h"

namespace fusemoe::test {
namespace {

constexpr double kAtol = 1e-3;  // relative-L2 slack for outputs whose baseline error is ~0

// y of `impl` vs `reference`, bounded by 2 x the baseline's error + kAtol.
void expect_fa3(const std::string& what, const std::vector<double>& fused,
                const std::vector<double>& baseline, const std::vector<double>& reference) {
  const ErrorStats base = compare(baseline, reference);
  const double bound = 2.0 * base.rel_l2 + kAtol;
  std::printf("  baseline %-20s rel_l2 %.3e\n", what.c_str(), base.rel_l2);
  expect_close("fused " + what, fused, reference, bound);
}

class FusedSmall : public SmallProblemTest {};

TEST_P(FusedSmall, MatchesCpuReference) {
  const HostProblem p = small_problem(2000);
  const std::vector<double> y_ref = reference::forward(to_reference(p));
  expect_fa3("y", run_forward_only(Impl::kFused, p), run_forward_only(Impl::kUnfused, p), y_ref);
}

INSTANTIATE_TEST_SUITE_P(
    Fused, FusedSmall,
    ::testing::Combine(::testing::Values<int64_t>(0, 1, 7, 199, 4097),
                       ::testing::ValuesIn(kAllRoutings)),
    token_routing_name);

TEST(FusedForward, ClampTopKAndMediumShapes) {
  struct Case {
    const char* name;
    Dims d;
    Routing routing;
    int64_t max_tokens;
  };
  Dims medium = medium_dims(300);
  Dims odd = medium;  // H and I not multiples of the 256-column tiles
  odd.H = 384;
  odd.I = 192;
  odd.T = 77;
  for (const Case& c : {Case{"clamp", clamp_dims(199), Routing::kUniform, -1},
                        Case{"top_k=1", top_k_dims(64, 1), Routing::kUniform, -1},
                        Case{"top_k=E", top_k_dims(64, 8), Routing::kUniform, -1},
                        Case{"medium, max_tokens 1000", medium, Routing::kSkewed, 1000},
                        Case{"H=384 I=192", odd, Routing::kMasked, -1}}) {
    std::printf("%s\n", c.name);
    const HostProblem p = make_problem(c.d, c.routing, 3000);
    const std::vector<double> y_ref = reference::forward(to_reference(p));
    expect_fa3("y", run_forward_only(Impl::kFused, p, c.max_tokens),
               run_forward_only(Impl::kUnfused, p, c.max_tokens), y_ref);
  }
}

// The Qwen3 layer shapes at full size against the fp32 GPU oracle: 30B and 235B (E = 128, static
// tile order) and Qwen3-Next (E = 512, dynamic tile order in gate/up and down).
TEST(FusedForward, QwenShapesAgainstFp32GpuReference) {
  const Dims d30 = qwen3_30b_dims(1000);
  const Dims d235 = qwen3_235b_dims(333, 128);
  const Dims dnext = qwen3_next_dims(1000);
  for (const auto& [name, d, routing] :
       {std::tuple<const char*, Dims, Routing>{"qwen3-30b-a3b", d30, Routing::kUniform},
        {"qwen3-30b-a3b skewed", d30, Routing::kSkewed},
        {"qwen3-235b-a22b", d235, Routing::kUniform},
        {"qwen3-next", dnext, Routing::kUniform},
        {"qwen3-next skewed", dnext, Routing::kSkewed}}) {
    std::printf("%s T=%lld\n", name, static_cast<long long>(d.T));
    const HostProblem p = make_problem(d, routing, 4000);
    expect_fa3("y", run_forward_only(Impl::kFused, p), run_forward_only(Impl::kUnfused, p),
               run_forward_only(Impl::kReferenceFp32, p));
  }
}

// Medium dims (static tile order) and 256 experts (the dynamic order of gate/up and down: any CTA
// may take any tile, and each tile's sums are the same whichever does).
class FusedForwardDeterminism : public ::testing::TestWithParam<int64_t> {};

TEST_P(FusedForwardDeterminism, BitwiseDeterministicAndGraphReplay) {
  Dims d = medium_dims(2000);
  d.E = GetParam();
  const HostProblem p = make_problem(d, Routing::kSkewed, 5000);
  ForwardSetup s(Impl::kFused, p);
  s.y.poison();
  forward(s.config, Impl::kFused, s.args);
  const std::vector<uint16_t> first = s.y.to_host<uint16_t>();
  for (int run = 0; run < 20; ++run) {
    s.y.poison();
    s.workspace.poison();
    forward(s.config, Impl::kFused, s.args);
    ASSERT_TRUE(s.y.to_host<uint16_t>() == first) << "run " << run << " differs";
  }
  // The same call captured into a CUDA graph (no host sync inside) and replayed.
  cudaStream_t stream;
  TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  s.args.stream = stream;
  cudaGraph_t graph;
  TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  forward(s.config, Impl::kFused, s.args);
  TEST_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    s.y.poison();
    s.workspace.poison();
    TEST_CUDA(cudaGraphLaunch(exec, stream));
    TEST_CUDA(cudaStreamSynchronize(stream));
    EXPECT_TRUE(s.y.to_host<uint16_t>() == first) << "graph replay " << replay << " differs";
  }
  TEST_CUDA(cudaGraphExecDestroy(exec));
  TEST_CUDA(cudaGraphDestroy(graph));
  TEST_CUDA(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(Fused, FusedForwardDeterminism, ::testing::Values<int64_t>(16, 256),
                         [](const ::testing::TestParamInfo<int64_t>& info) {
                           return "E" + std::to_string(info.param);
                         });

TEST(FusedForward, InvalidExpertIdsReportedNowOrLater) {
  const HostProblem p = make_problem_with_bad_ids(6000);
  const Dims& d = p.d;
  ForwardSetup s(Impl::kFused, p);
  try {
    forward(s.config, Impl::kFused, s.args);
    ADD_FAILURE() << "invalid expert ids were not reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token 17, slot 1, value 8"), std::string::npos)
        << e.what();
  }
  s.args.sync_check_expert_ids = false;
  EXPECT_NO_THROW(forward(s.config, Impl::kFused, s.args));
  try {
    check_expert_ids(s.config, Impl::kFused, s.workspace.get(), nullptr);
    ADD_FAILURE() << "check_expert_ids did not report the invalid ids";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("2 expert id(s) outside [-1, 8)"), std::string::npos)
        << e.what();
  }
  // Valid ids: the deferred check passes.
  const HostProblem good = make_problem(d, Routing::kUniform, 6001);
  ForwardSetup g(Impl::kFused, good);
  g.args.sync_check_expert_ids = false;
  forward(g.config, Impl::kFused, g.args);
  EXPECT_NO_THROW(check_expert_ids(g.config, Impl::kFused, g.workspace.get(), nullptr));
}

}  // namespace
}  // namespace fusemoe::test

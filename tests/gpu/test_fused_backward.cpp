// GPU tests of the fused backward (Impl::kFused) through the public API. FA3 rule for every
// gradient (dx, d_topk_weights, dw13, dw2) and for y: error against the fp64 CPU reference at
// most 2 x the unfused bf16 baseline's error + kAtol. Edge routings and token counts, clamp,
// bf16 and accumulated weight gradients, NaN-poisoned outputs and workspace (run_layer), and
// bitwise determinism over repeated calls, on a stream and from a CUDA-graph replay.
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "gpu/gpu_test_util.h"

namespace fusemoe::test {
namespace {

constexpr double kAtol = 1e-3;

void expect_all_fa3(const HostProblem& p, const RunOptions& opt = {}) {
  const reference::Problem rp = to_reference(p);
  const std::vector<double> y_ref = reference::forward(rp);
  reference::Gradients g = reference::backward(rp, widen(p.dy_TH));
  if (opt.accumulate) {
    for (size_t i = 0; i < g.dw13_EFH.size(); ++i) g.dw13_EFH[i] += (*opt.dw13_init)[i];
    for (size_t i = 0; i < g.dw2_EHI.size(); ++i) g.dw2_EHI[i] += (*opt.dw2_init)[i];
  }
  const LayerOutputs fused = run_layer(Impl::kFused, p, opt);
  RunOptions base_opt = opt;
  base_opt.save_z = false;  // a fused-only option
  const LayerOutputs base = run_layer(Impl::kUnfused, p, base_opt);
  struct Item {
    const char* name;
    const std::vector<double>& got;
    const std::vector<double>& baseline;
    const std::vector<double>& ref;
  };
  for (const Item& it : {Item{"y", fused.y, base.y, y_ref}, Item{"dx", fused.dx, base.dx, g.dx_TH},
                         Item{"d_topk_weights", fused.d_topk_w, base.d_topk_w, g.d_topk_w_TK},
                         Item{"dw13", fused.dw13, base.dw13, g.dw13_EFH},
                         Item{"dw2", fused.dw2, base.dw2, g.dw2_EHI}}) {
    const double bound = 2.0 * compare(it.baseline, it.ref).rel_l2 + kAtol;
    expect_close(std::string("fused ") + it.name, it.got, it.ref, bound);
  }
}

class FusedBackwardSmall : public SmallProblemTest {};

TEST_P(FusedBackwardSmall, MatchesCpuReference) {
  const HostProblem p = small_problem(8000);
  for (bool save_z : {false, true}) {
    std::printf(" z %s\n", save_z ? "saved by the forward" : "recomputed");
    RunOptions opt;
    opt.save_z = save_z;
    expect_all_fa3(p, opt);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Fused, FusedBackwardSmall,
    ::testing::Combine(::testing::Values<int64_t>(0, 1, 7, 199, 4097),
                       ::testing::ValuesIn(kAllRoutings)),
    token_routing_name);

TEST(FusedBackward, ClampMediumAndOddShapes) {
  Dims medium = medium_dims(300);
  Dims odd = medium;
  odd.H = 384;
  odd.I = 192;
  odd.T = 77;
  for (const auto& [name, d, routing] :
       {std::tuple<const char*, Dims, Routing>{"clamp", clamp_dims(199), Routing::kUniform},
        {"medium skewed", medium, Routing::kSkewed},
        {"H=384 I=192 masked", odd, Routing::kMasked}}) {
    for (bool save_z : {false, true}) {
      std::printf("%s, z %s\n", name, save_z ? "saved" : "recomputed");
      RunOptions opt;
      opt.save_z = save_z;
      expect_all_fa3(make_problem(d, routing, 9000), opt);
    }
  }
}

TEST(FusedBackward, Bf16AndAccumulatedWeightGrads) {
  const Dims d = small_dims(199);
  const HostProblem p = make_problem(d, Routing::kFewExperts, 9100);  // empty experts too
  for_each_weight_grad_mode(d, 9, [&](const RunOptions& opt) { expect_all_fa3(p, opt); });
}

// Frozen weights (a null gate/up or down gradient output): the other outputs are bitwise those of
// the call with every gradient, and the frozen gradient's buffer is never written (it stays NaN).
// Every single-GPU path: fused BF16 and FP8 with z saved or recomputed, FP8 with FP8 weight
// gradients, separate gate and up gradients, and the unfused pipeline.
TEST(FusedBackward, FrozenWeightsSkipTheirGradientsOnly) {
  const Dims d = medium_dims(300);
  const HostProblem p = make_problem(d, Routing::kFewExperts, 9150);  // empty experts too
  auto all_nan = [](const std::vector<double>& v) {
    for (double x : v) {
      if (!std::isnan(x)) return false;
    }
    return !v.empty();
  };
  struct Path {
    const char* name;
    Impl impl;
    RunOptions opt;
  };
  std::vector<Path> paths;
  for (bool save_z : {false, true}) {
    for (Precision precision : {Precision::kBf16, Precision::kFp8Blockwise}) {
      RunOptions opt;
      opt.save_z = save_z;
      opt.precision = precision;
      paths.push_back({precision == Precision::kBf16 ? "fused bf16" : "fused fp8", Impl::kFused, opt});
    }
  }
  // FP8 weight gradients: a frozen weight's token-blocked pools and GEMMs are skipped (fused_fp8.cu).
  RunOptions fp8_wgrad;
  fp8_wgrad.precision = Precision::kFp8Blockwise;
  fp8_wgrad.fp8_weight_grads = true;
  paths.push_back({"fused fp8, fp8 weight grads", Impl::kFused, fp8_wgrad});
  RunOptions separate;
  separate.separate_grads = true;
  separate.save_z = true;
  paths.push_back({"fused, dw1/dw3", Impl::kFused, separate});
  RunOptions bf16_grads;
  bf16_grads.grad_dtype = WeightGradDtype::kBFloat16;
  paths.push_back({"unfused", Impl::kUnfused, RunOptions{}});
  paths.push_back({"unfused, bf16 grads", Impl::kUnfused, bf16_grads});
  for (const Path& path : paths) {
    const LayerOutputs all = run_layer(path.impl, p, path.opt);
    for (int frozen = 1; frozen <= 3; ++frozen) {  // gate/up, down, both
      RunOptions opt = path.opt;
      opt.frozen_gate_up = frozen & 1;
      opt.frozen_down = frozen & 2;
      const std::string what = std::string(path.name) + (path.opt.save_z ? ", z saved" : "") +
                               (opt.frozen_gate_up ? ", gate/up frozen" : "") + (opt.frozen_down ? ", down frozen" : "");
      const LayerOutputs got = run_layer(path.impl, p, opt);
      EXPECT_TRUE(got.y == all.y) << what << ": y differs";
      EXPECT_TRUE(got.dx == all.dx) << what << ": dx differs";
      EXPECT_TRUE(got.d_topk_w == all.d_topk_w) << what << ": d_topk_weights differs";
      if (opt.frozen_gate_up) {
        EXPECT_TRUE(all_nan(got.dw13)) << what << ": the frozen dw13 buffer was written";
      } else {
        EXPECT_TRUE(got.dw13 == all.dw13) << what << ": dw13 differs";
      }
      if (opt.frozen_down) {
        EXPECT_TRUE(all_nan(got.dw2)) << what << ": the frozen dw2 buffer was written";
      } else {
        EXPECT_TRUE(got.dw2 == all.dw2) << what << ": dw2 differs";
      }
    }
  }
}

TEST(FusedBackward, BitwiseDeterministic) {
  const Dims d = medium_dims(512);
  const HostProblem p = make_problem(d, Routing::kSkewed, 9200);
  RunOptions saving;
  saving.save_z = true;
  const LayerOutputs first = run_layer(Impl::kFused, p);
  const LayerOutputs first_saved = run_layer(Impl::kFused, p, saving);
  for (int run = 0; run < 20; ++run) {
    const LayerOutputs again_saved = run_layer(Impl::kFused, p, saving);
    ASSERT_TRUE(same_outputs(again_saved, first_saved)) << "run " << run << " (z saved) differs";
    const LayerOutputs again = run_layer(Impl::kFused, p);
    ASSERT_TRUE(same_outputs(again, first)) << "run " << run << " differs";
  }
}

// On a non-blocking stream: 20 calls and a CUDA-graph replay of the call give the first call's
// bits (outputs and workspace poisoned before each), and accumulating onto the first result
// doubles the fp32 weight gradients exactly (each gradient is the same sum, added once more).
TEST(FusedBackward, StreamGraphReplayAndExactAccumulate) {
  const Dims d = medium_dims(512);
  const HostProblem p = make_problem(d, Routing::kMasked, 9600);
  const LayerConfig config = config_of(d, d.T);
  const DeviceInputs in(p);
  DeviceBuffer dx(d.T * d.H * 2), dtw(d.T * d.K * 4), dw13(d.E * 2 * d.I * d.H * 4), dw2(d.E * d.H * d.I * 4),
      workspace(workspace_bytes(config, Impl::kFused, WorkspaceUse::kBackward));
  cudaStream_t stream;
  TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  BackwardArgs a = in.args<BackwardArgs>(d.T, workspace);
  a.dx = dx.get();
  a.d_topk_weights = dtw.as<float>();
  a.dw13 = dw13.get();
  a.dw2 = dw2.get();
  a.stream = stream;
  auto poison_all = [&] {
    for (DeviceBuffer* b : {&dx, &dtw, &dw13, &dw2, &workspace}) b->poison();
  };
  auto outputs = [&] {
    TEST_CUDA(cudaStreamSynchronize(stream));
    return std::vector<std::vector<uint8_t>>{dx.to_host<uint8_t>(), dtw.to_host<uint8_t>(), dw13.to_host<uint8_t>(),
                                             dw2.to_host<uint8_t>()};
  };
  poison_all();
  backward(config, Impl::kFused, a);
  const auto first = outputs();
  for (int run = 0; run < 20; ++run) {
    poison_all();
    backward(config, Impl::kFused, a);
    ASSERT_TRUE(outputs() == first) << "call " << run << " on the stream differs";
  }
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  backward(config, Impl::kFused, a);
  TEST_CUDA(cudaStreamEndCapture(stream, &graph));
  TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  poison_all();
  TEST_CUDA(cudaGraphLaunch(exec, stream));
  EXPECT_TRUE(outputs() == first) << "the graph replay differs";
  TEST_CUDA(cudaGraphExecDestroy(exec));
  TEST_CUDA(cudaGraphDestroy(graph));

  const DeviceBuffer dw13_first = DeviceBuffer::from(first[2]), dw2_first = DeviceBuffer::from(first[3]);
  dw13.copy_from(dw13_first);
  dw2.copy_from(dw2_first);
  a.accumulate_weight_grads = true;
  backward(config, Impl::kFused, a);
  TEST_CUDA(cudaStreamSynchronize(stream));
  const std::vector<float> dw13_twice = dw13.to_host<float>(), dw2_twice = dw2.to_host<float>();
  const std::vector<float> dw13_once = dw13_first.to_host<float>(), dw2_once = dw2_first.to_host<float>();
  int64_t not_doubled = 0;
  for (size_t i = 0; i < dw13_once.size(); ++i) not_doubled += !(dw13_twice[i] == 2.0f * dw13_once[i]);
  for (size_t i = 0; i < dw2_once.size(); ++i) not_doubled += !(dw2_twice[i] == 2.0f * dw2_once[i]);
  EXPECT_EQ(not_doubled, 0) << "accumulated fp32 weight gradients are not exactly twice the first";
  TEST_CUDA(cudaStreamDestroy(stream));
}

TEST(FusedBackward, InvalidExpertIdsAreReported) {
  const HostProblem p = make_problem_with_bad_ids(9400);
  try {
    run_layer(Impl::kFused, p);  // the forward reports first; both directions route the same ids
    ADD_FAILURE() << "invalid expert ids were not reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token 17, slot 1, value 8"), std::string::npos)
        << e.what();
  }
}

// The asynchronous report (ForwardArgs::expert_id_report): filled from the device by the first
// call with bad ids, in pinned host memory (read without a sync) or device memory, left alone by
// later calls, never touched by good calls; no call throws or syncs for the check.
TEST(FusedExpertIdReport, FilledByTheFirstBadCallOfEveryImplementation) {
  const HostProblem bad = make_problem_with_bad_ids(9500);
  const Dims& d = bad.d;
  HostProblem other_bad = bad;
  other_bad.idx_TK[5 * d.K + 0] = 99;
  const HostProblem good = make_problem(d, Routing::kUniform, 9501);
  int32_t* pinned = nullptr;
  TEST_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&pinned), kExpertIdReportInts * sizeof(int32_t),
                          cudaHostAllocDefault));
  DeviceBuffer device_report(kExpertIdReportInts * sizeof(int32_t));
  for (Impl impl : {Impl::kUnfused, Impl::kFused}) {
    for (bool on_device : {false, true}) {
      SCOPED_TRACE(std::string(impl_name(impl)) + (on_device ? " device report" : " pinned report"));
      int32_t* report = on_device ? static_cast<int32_t*>(device_report.get()) : pinned;
      TEST_CUDA(cudaMemset(report, 0, kExpertIdReportInts * sizeof(int32_t)));
      RunOptions opt;
      opt.expert_id_report = report;
      EXPECT_NO_THROW(run_layer(impl, good, opt));
      int32_t host[kExpertIdReportInts];
      TEST_CUDA(cudaMemcpy(host, report, sizeof(host), cudaMemcpyDefault));
      EXPECT_EQ(host[0], 0) << "a call with valid ids wrote the report";
      EXPECT_NO_THROW(throw_if_expert_id_report(host, d.E, d.K));
      EXPECT_NO_THROW(run_layer(impl, bad, opt));        // reported, not thrown
      EXPECT_NO_THROW(run_layer(impl, other_bad, opt));  // must not overwrite the first record
      TEST_CUDA(cudaMemcpy(host, report, sizeof(host), cudaMemcpyDefault));
      EXPECT_EQ(host[0], 2);
      EXPECT_EQ(host[1], 17 * d.K + 1);
      EXPECT_EQ(host[2], d.E);
      try {
        throw_if_expert_id_report(host, d.E, d.K);
        ADD_FAILURE() << "the report holds bad ids but nothing was thrown";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("2 expert id(s) outside [-1, 8); first at token 17, "
                                             "slot 1, value 8"),
                  std::string::npos)
            << e.what();
      }
    }
  }
  TEST_CUDA(cudaFreeHost(pinned));
}

// Qwen3-30B-A3B dims (all 128 experts) against the fp32 GPU oracle, every gradient.
TEST(FusedBackward, Qwen30bAgainstFp32GpuReference) {
  const Dims d = qwen3_30b_dims(256);
  const HostProblem p = make_problem(d, Routing::kUniform, 9300);
  const LayerOutputs ref = run_layer(Impl::kReferenceFp32, p);
  RunOptions saving;
  saving.save_z = true;
  const LayerOutputs fused = run_layer(Impl::kFused, p);
  const LayerOutputs fused_saved = run_layer(Impl::kFused, p, saving);
  const LayerOutputs base = run_layer(Impl::kUnfused, p);
  auto check = [](const char* name, const std::vector<double>& got,
                  const std::vector<double>& baseline, const std::vector<double>& r) {
    expect_close(std::string("fused ") + name, got, r, 2.0 * compare(baseline, r).rel_l2 + kAtol);
  };
  check("y", fused.y, base.y, ref.y);
  check("dx", fused.dx, base.dx, ref.dx);
  check("d_topk_weights", fused.d_topk_w, base.d_topk_w, ref.d_topk_w);
  check("dw13", fused.dw13, base.dw13, ref.dw13);
  check("dw2", fused.dw2, base.dw2, ref.dw2);
  check("y (z saved)", fused_saved.y, base.y, ref.y);
  check("dx (z saved)", fused_saved.dx, base.dx, ref.dx);
  check("d_topk_weights (z saved)", fused_saved.d_topk_w, base.d_topk_w, ref.d_topk_w);
  check("dw13 (z saved)", fused_saved.dw13, base.dw13, ref.dw13);
  check("dw2 (z saved)", fused_saved.dw2, base.dw2, ref.dw2);
  // The forward's z and the recomputed z come from the same fp32 dot products in the same
  // k order, so the two paths give the same bits (docs/design.md says so; measured at b2b08ac:
  // max |diff| 0 on dx and dw13).
  std::printf("saved vs recomputed z: dx max |diff| %.3g, dw13 max |diff| %.3g\n",
              compare(fused_saved.dx, fused.dx).max_abs, compare(fused_saved.dw13, fused.dw13).max_abs);
  EXPECT_TRUE(fused_saved.dx == fused.dx && fused_saved.d_topk_w == fused.d_topk_w &&
              fused_saved.dw13 == fused.dw13 && fused_saved.dw2 == fused.dw2)
      << "saved and recomputed z give different gradients";
}

}  // namespace
}  // namespace fusemoe::test

// Separate gate and up weights (w1, w3 [E, I, H], torchtitan's layout) and gradients (dw1, dw3)
// through the public API, Impl::kFused: every output bitwise equal to the w13 / dw13 call on the
// same data (w1 and w3 are w13's gate and up rows copied apart; dw1 and dw3 are put back together
// on the host). The kernels read the same tiles either way (two tensor maps instead of one), so
// equality is exact, NaN-poisoned outputs included (run_layer). Also: the FP8 weight buffer from w1
// and w3 is byte-equal to the one from w13, and the cuBLAS impls refuse the separate form.
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "gpu/gpu_test_util.h"

namespace fusemoe::test {
namespace {

struct Form {
  bool separate_weights, separate_grads;
  const char* name;
};
constexpr Form kSeparateForms[] = {{true, true, "w1/w3 + dw1/dw3"},
                                   {true, false, "w1/w3 + dw13"},
                                   {false, true, "w13 + dw1/dw3"}};

// Every separate form against the w13 call, z saved and recomputed, every weight-gradient mode.
// I % 128 == 64 layers take the separate weights only (separate gradients need I % 128 == 0).
void expect_separate_forms_bitwise(const HostProblem& p, Precision precision = Precision::kBf16) {
  for_each_weight_grad_mode(p.d, 9100 + p.d.T, [&](const RunOptions& mode) {
    for (bool save_z : {false, true}) {
      RunOptions opt = mode;
      opt.save_z = save_z;
      opt.precision = precision;
      const LayerOutputs w13 = run_layer(Impl::kFused, p, opt);
      for (const Form& form : kSeparateForms) {
        if (form.separate_grads && p.d.I % 128 != 0) continue;
        RunOptions separate = opt;
        separate.separate_weights = form.separate_weights;
        separate.separate_grads = form.separate_grads;
        expect_same_outputs(run_layer(Impl::kFused, p, separate), w13,
                            std::string(form.name) + (save_z ? ", z saved" : ", z recomputed"));
      }
    }
  });
}

class SeparateGateUpSmall : public SmallProblemTest {};

TEST_P(SeparateGateUpSmall, BitwiseEqualToW13) { expect_separate_forms_bitwise(small_problem(9000)); }

INSTANTIATE_TEST_SUITE_P(Fused, SeparateGateUpSmall,
                         ::testing::Combine(::testing::Values<int64_t>(0, 1, 7, 199, 4097),
                                            ::testing::ValuesIn(kAllRoutings)),
                         token_routing_name);

// Several tiles per expert over I and H, top-4.
TEST(SeparateGateUp, MediumBitwiseEqualToW13) {
  expect_separate_forms_bitwise(make_problem(medium_dims(1000), Routing::kSkewed, 9201));
}

// I = 192: a 256-wide z-recompute tile straddles the gate/up boundary (gate rows 128..191, up rows
// 0..63 of the expert), and the dgrad of x has K-blocks from both weights.
TEST(SeparateGateUp, IntermediateNotMultipleOf128BitwiseEqualToW13) {
  Dims d = small_dims(333);
  d.I = 192;
  expect_separate_forms_bitwise(make_problem(d, Routing::kUniform, 9202));
}

TEST(SeparateGateUp, ClampBitwiseEqualToW13) {
  expect_separate_forms_bitwise(make_problem(clamp_dims(199), Routing::kMasked, 9203));
}

TEST(SeparateGateUp, Qwen3_30bShapeBitwiseEqualToW13) {
  const HostProblem p = make_problem(qwen3_30b_dims(512), Routing::kSkewed, 9204);
  RunOptions opt;
  const LayerOutputs w13 = run_layer(Impl::kFused, p, opt);
  opt.separate_weights = opt.separate_grads = true;
  expect_same_outputs(run_layer(Impl::kFused, p, opt), w13, "Qwen3-30B-A3B shape, w1/w3 + dw1/dw3");
}

// w1 and w3 may be one tensor (they are only read): the same as w13 = [w1; w1].
TEST(SeparateGateUp, AliasedGateAndUpBitwiseEqualToW13) {
  HostProblem p = make_problem(small_dims(199), Routing::kUniform, 9205);
  const Dims& d = p.d;
  const std::vector<uint16_t> gate = expert_rows(p.w13_EFH, d.E, 2 * d.I, 0, d.I, d.H);
  p.w13_EFH = concatenate_gate_up(gate, gate, d.E, d.I, d.H);
  const LayerConfig config = config_of(d, d.T);
  const DeviceInputs in(p);
  const DeviceBuffer w1 = DeviceBuffer::from(gate);
  DeviceBuffer workspace(workspace_bytes(config, Impl::kFused)), y_w13(d.T * d.H * 2), y_w1(d.T * d.H * 2);
  for (DeviceBuffer* b : {&workspace, &y_w13, &y_w1}) b->poison();
  ForwardArgs a = in.args<ForwardArgs>(d.T, workspace);
  a.y = y_w13.get();
  forward(config, Impl::kFused, a);
  a.w13 = nullptr;
  a.w1 = a.w3 = w1.get();
  a.y = y_w1.get();
  forward(config, Impl::kFused, a);
  TEST_CUDA(cudaDeviceSynchronize());
  EXPECT_TRUE(widen(y_w1.to_host<uint16_t>()) == widen(y_w13.to_host<uint16_t>())) << "y differs";
}

TEST(SeparateGateUp, Fp8WeightBufferBytewiseEqual) {
  Dims d = small_dims(1);
  d.I = 256;  // FP8 needs I % 128 == 0; two 128-blocks per half
  const HostProblem p = make_problem(d, Routing::kUniform, 9206);
  LayerConfig config = config_of(d, 1);
  config.precision = Precision::kFp8Blockwise;
  const DeviceInputs in(p);
  const DeviceBuffer w1 = DeviceBuffer::from(expert_rows(p.w13_EFH, d.E, 2 * d.I, 0, d.I, d.H));
  const DeviceBuffer w3 = DeviceBuffer::from(expert_rows(p.w13_EFH, d.E, 2 * d.I, d.I, d.I, d.H));
  const DeviceBuffer from_w13 = quantized_weights(config, in.w13, in.w2);
  const DeviceBuffer from_w1_w3 = quantized_weights(config, w1, w3, in.w2);
  TEST_CUDA(cudaDeviceSynchronize());
  EXPECT_TRUE(from_w13.to_host<uint8_t>() == from_w1_w3.to_host<uint8_t>()) << "FP8 weight buffers differ";
}

// FP8 reads its buffer (quantized from w1 and w3 here) and writes dw1 and dw3 with the BF16 path's
// weight-gradient launches.
TEST(SeparateGateUp, Fp8LayerBitwiseEqualToW13) {
  Dims d = small_dims(199);
  d.I = 256;
  expect_separate_forms_bitwise(make_problem(d, Routing::kSkewed, 9207), Precision::kFp8Blockwise);
}

TEST(SeparateGateUp, CublasImplsRefuseTheSeparateForm) {
  const HostProblem p = make_problem(small_dims(7), Routing::kUniform, 9208);
  for (Impl impl : {Impl::kUnfused, Impl::kReferenceFp32}) {
    RunOptions opt;
    opt.separate_weights = true;
    try {
      run_layer(impl, p, opt);
      ADD_FAILURE() << impl_name(impl) << " accepted w1/w3";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not supported yet by impl"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace fusemoe::test

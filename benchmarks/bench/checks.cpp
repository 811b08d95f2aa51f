#include "bench/checks.h"

#include <algorithm>
#include <cstdio>

#include "common/device_checks.h"

namespace fusemoe::bench {
namespace {

// out (an implementation's) against ref (the fp32 reference's); both on the device.
CheckLine compare_output(const BenchImpl& impl, const std::string& output, const std::string& wgrad,
                         harness::DeviceTensor out, harness::DeviceTensor ref, int64_t count, cudaStream_t stream) {
  FUSEMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const harness::CompareResult r = harness::compare(out, ref, 1, count, harness::CompareOptions{});
  CheckLine line{impl.name, output, wgrad};
  line.tol = impl.check_tol;
  line.rel_err = r.rel_l2;
  line.max_abs_err = r.max_abs_err;
  line.calc_diff = r.calc_diff;
  line.nonfinite = r.nonfinite_out;
  line.nonfinite_ref = r.nonfinite_ref;
  line.pass = line.nonfinite == 0 && line.nonfinite_ref == 0 && line.rel_err <= line.tol;
  return line;
}

}  // namespace

std::vector<CheckLine> check_case(const LayerConfig& config, const LayerConfig& reference_config,
                                  const std::vector<BenchImpl>& impls, const std::vector<DeviceBuffer>& workspaces,
                                  const DeviceBuffer& reference_workspace, const LayerInputs& in,
                                  const LayerOutputs& out, const LayerOutputs& ref, int64_t num_tokens,
                                  const std::string& label, cudaStream_t stream) {
  using harness::bf16_tensor;
  using harness::fp32_tensor;
  const int64_t y_elems = num_tokens * config.hidden;
  const int64_t topk_elems = num_tokens * config.top_k;
  const int64_t w13_elems = config.num_experts * 2 * config.intermediate * config.hidden;
  const int64_t w2_elems = config.num_experts * config.hidden * config.intermediate;

  std::fprintf(stderr, "[bench] %s: fp32 reference forward + backward ...\n", label.c_str());
  ref.poison(stream);
  reference_workspace.poison(stream);
  run_forward(reference_config, kReferenceImpl, in, ref, reference_workspace, num_tokens, stream);
  reference_workspace.poison(stream);
  run_backward(reference_config, kReferenceImpl, in, ref, reference_workspace, num_tokens, WeightGradDtype::kFloat32,
               stream);
  FUSEMOE_CUDA_CHECK(cudaStreamSynchronize(stream));

  // A separate_gate_up impl writes dw1, dw3 as the two halves of dw13's buffer: its reference is
  // the reference's dw13 split the same way.
  DeviceBuffer ref_dw13_split;
  if (std::any_of(impls.begin(), impls.end(), [](const BenchImpl& impl) { return impl.separate_gate_up; })) {
    ref_dw13_split = DeviceBuffer(out.dw13_EFH.bytes());
    const size_t half = static_cast<size_t>(w13_elems / 2) * sizeof(float);
    split_gate_up(config, ref.dw13_EFH.get(), ref_dw13_split.get(), static_cast<char*>(ref_dw13_split.get()) + half,
                  sizeof(float), stream);
  }

  std::vector<CheckLine> lines;
  for (size_t i = 0; i < impls.size(); ++i) {
    const std::string name = impls[i].name;
    const DeviceBuffer& workspace = workspaces[i];
    std::fprintf(stderr, "[bench] %s: checking %s ...\n", label.c_str(), name.c_str());

    out.poison(stream);
    workspace.poison(stream);
    run_forward(config, impls[i], in, out, workspace, num_tokens, stream);
    check_expert_ids(impl_config(config, impls[i]), impls[i].impl, workspace.get(), stream);
    lines.push_back(compare_output(impls[i], "y", "-", bf16_tensor(out.y_TH.get()), bf16_tensor(ref.y_TH.get()),
                                   y_elems, stream));
    if (!impls[i].has_backward) continue;
    for (WeightGradDtype dtype : {WeightGradDtype::kFloat32, WeightGradDtype::kBFloat16}) {
      // poison() takes saved z too: the backward (of an impl with save_z) reads the z of the
      // forward run here, just before it, never a z left by an earlier call or implementation.
      out.poison(stream);
      workspace.poison(stream);
      run_forward(config, impls[i], in, out, workspace, num_tokens, stream);
      workspace.poison(stream);
      run_backward(config, impls[i], in, out, workspace, num_tokens, dtype, stream);
      const std::string wgrad = wgrad_name(dtype);
      // dw13, or dw1 then dw3 (each [E, I, H]) from the buffer's start: w13_elems elements either way.
      const harness::DeviceTensor dw13{out.dw13_EFH.get(), dtype == WeightGradDtype::kFloat32 ? harness::DType::kFp32
                                                                                              : harness::DType::kBf16};
      const harness::DeviceTensor dw2{out.dw2_EHI.get(), dw13.dtype};
      // dx and d_topk_weights do not depend on the weight-gradient dtype: checked once.
      if (dtype == WeightGradDtype::kFloat32) {
        lines.push_back(compare_output(impls[i], "dx", "-", bf16_tensor(out.dx_TH.get()), bf16_tensor(ref.dx_TH.get()),
                                       y_elems, stream));
        lines.push_back(compare_output(impls[i], "d_topk_weights", "-", fp32_tensor(out.d_topk_w_TK.get()),
                                       fp32_tensor(ref.d_topk_w_TK.get()), topk_elems, stream));
      }
      const bool split = impls[i].separate_gate_up;
      lines.push_back(compare_output(impls[i], split ? "dw1,dw3" : "dw13", wgrad, dw13,
                                     fp32_tensor(split ? ref_dw13_split.get() : ref.dw13_EFH.get()), w13_elems,
                                     stream));
      lines.push_back(compare_output(impls[i], "dw2", wgrad, dw2, fp32_tensor(ref.dw2_EHI.get()), w2_elems, stream));
    }
  }
  return lines;
}

}  // namespace fusemoe::bench

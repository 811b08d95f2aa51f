#include "bench/memory.h"

#include <algorithm>
#include <cstdio>

namespace fusemoe::bench {
namespace {

// Everything one LayerOutputs holds (run.h).
size_t outputs_bytes(const LayerBufferBytes& b, bool save_z) {
  return 2 * b.x_TH + b.topk_w_TK + b.dw13_EFH + b.dw2_EHI + (save_z ? b.saved_z : 0);
}

double gib(size_t bytes) { return static_cast<double>(bytes) / double(size_t(1) << 30); }

}  // namespace

LayerBufferBytes layer_buffer_bytes(const LayerConfig& c) {
  const size_t t = static_cast<size_t>(c.max_tokens), h = static_cast<size_t>(c.hidden);
  const size_t i = static_cast<size_t>(c.intermediate), e = static_cast<size_t>(c.num_experts);
  const size_t k = static_cast<size_t>(c.top_k);
  LayerBufferBytes b;
  b.x_TH = t * h * 2;
  b.topk_idx_TK = t * k * sizeof(int32_t);
  b.topk_w_TK = t * k * sizeof(float);
  b.w13_EFH = e * 2 * i * h * 2;
  b.w2_EHI = e * h * i * 2;
  b.dw13_EFH = e * 2 * i * h * sizeof(float);
  b.dw2_EHI = e * h * i * sizeof(float);
  b.saved_z = saved_z_bytes(c);
  return b;
}

size_t bench_workspace_bytes(const LayerConfig& config, const BenchImpl& impl) {
  LayerConfig c = config;
  c.precision = impl.precision;
  c.fp8_weight_grads = impl.fp8_weight_grads;
  return std::max<size_t>(workspace_bytes(c, impl.impl), 256);
}

int64_t reference_max_tokens(const BenchParams& params) {
  int64_t max_tokens = 0;
  for (int64_t t : params.tokens) {
    if (params.check && t <= params.check_max_tokens) max_tokens = std::max(max_tokens, t);
  }
  return max_tokens;
}

size_t bench_device_bytes(const BenchParams& params, size_t flush_bytes) {
  const LayerConfig config =
      harness::layer_config(params.preset, *std::max_element(params.tokens.begin(), params.tokens.end()));
  const LayerBufferBytes b = layer_buffer_bytes(config);
  bool any_fp8 = false, any_saves_z = false, any_separate = false;
  size_t total = flush_bytes;
  for (const BenchImpl& impl : params.impls) {
    any_fp8 = any_fp8 || impl.precision == Precision::kFp8Blockwise;
    any_saves_z = any_saves_z || impl.save_z;
    any_separate = any_separate || impl.separate_gate_up;
    total += bench_workspace_bytes(config, impl);
  }
  // Inputs: x and dy, routing, weights.
  total += 2 * b.x_TH + b.topk_idx_TK + b.topk_w_TK + b.w13_EFH + b.w2_EHI;
  if (any_fp8) {
    LayerConfig fp8 = config;
    fp8.precision = Precision::kFp8Blockwise;
    total += fp8_weights_bytes(fp8);
  }
  if (any_separate) total += b.w13_EFH;  // w1 and w3
  total += outputs_bytes(b, any_saves_z);
  if (const int64_t checked = reference_max_tokens(params); checked > 0) {
    const LayerConfig reference = harness::layer_config(params.preset, checked);
    total += bench_workspace_bytes(reference, kReferenceImpl) + outputs_bytes(layer_buffer_bytes(reference), false);
    if (any_separate) total += b.dw13_EFH;  // the reference's dw13 split as dw1, dw3 (check_case)
  }
  return total;
}

ExpertFit fit_experts(const BenchParams& params, size_t flush_bytes, size_t free_bytes) {
  ExpertFit fit;
  fit.preset_experts = params.preset.num_experts;
  fit.free_bytes = free_bytes;
  BenchParams trial = params;
  for (;;) {
    const size_t bytes = bench_device_bytes(trial, flush_bytes);
    if (trial.preset.num_experts == fit.preset_experts) fit.preset_bytes = bytes;
    if (bytes + kHeadroomBytes <= free_bytes) {
      fit.num_experts = trial.preset.num_experts;
      fit.bytes = bytes;
      return fit;
    }
    const int64_t half = trial.preset.num_experts / 2;
    if (trial.preset.num_experts % 2 != 0 || half < trial.preset.top_k) break;
    trial.preset.num_experts = half;
  }
  fit.fits = false;
  fit.num_experts = fit.preset_experts;
  fit.bytes = fit.preset_bytes;
  return fit;
}

std::string expert_fit_note(const ExpertFit& fit) {
  char note[256];
  if (!fit.fits) {
    std::snprintf(note, sizeof(note),
                  "WARNING: %.1f GiB needed at E=%lld (+%.0f GiB headroom), %.1f GiB free, and no smaller E "
                  "fits either; running at E=%lld",
                  gib(fit.preset_bytes), static_cast<long long>(fit.preset_experts), gib(kHeadroomBytes),
                  gib(fit.free_bytes), static_cast<long long>(fit.preset_experts));
    return note;
  }
  if (!fit.reduced()) return "";
  std::snprintf(note, sizeof(note),
                "E reduced %lld -> %lld: %.1f GiB needed at E=%lld, %.1f GiB free (%.1f GiB at E=%lld)",
                static_cast<long long>(fit.preset_experts), static_cast<long long>(fit.num_experts),
                gib(fit.preset_bytes), static_cast<long long>(fit.preset_experts), gib(fit.free_bytes),
                gib(fit.bytes), static_cast<long long>(fit.num_experts));
  return note;
}

}  // namespace fusemoe::bench

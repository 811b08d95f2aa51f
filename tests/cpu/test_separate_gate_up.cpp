// Separate gate and up weights (w1, w3 [E, I, H], torchtitan's layout) and gradients (dw1, dw3)
// at the public API, without a GPU: exactly one form of each (w13 or w1 + w3; dw13 or dw1 + dw3),
// every pointer named in its error, w1 and w3 free to alias (they are only read), dw1 and dw3
// never overlapping (byte ranges of E * I * H elements of the weight-gradient dtype). Impl::kFused
// reads them (separate gradients need I % 128 == 0); the cuBLAS impls refuse a well-formed call with
// either separate form after every host check, naming the form, before any device work.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>

#include "common/layer_config.h"
#include "expect_error.h"
#include "plausible_args.h"
#include "fusemoe/fusemoe.h"

namespace fusemoe {
namespace {

// E = 8, I = 128, H = 256: one [E, I, H] gradient is 1 MiB in fp32, 512 KiB in bf16.
LayerConfig config() { return harness::layer_config(256, 128, 8, 2, 64); }

const void* at(uintptr_t address) { return reinterpret_cast<const void*>(address); }
void* at_mut(uintptr_t address) { return reinterpret_cast<void*>(address); }

// Past every address plausible_args.h uses.
constexpr uintptr_t kW1 = 0x200000, kW3 = 0x400000, kDw1 = 0x600000, kDw3 = 0x800000;

ForwardArgs separate_forward_args(const LayerConfig& c, Impl impl) {
  ForwardArgs a = plausible_forward_args(c, impl);
  a.w13 = nullptr;
  a.w1 = at(kW1);
  a.w3 = at(kW3);
  return a;
}

BackwardArgs separate_backward_args(const LayerConfig& c, Impl impl) {
  BackwardArgs a = plausible_backward_args(c, impl);
  a.w13 = nullptr;
  a.w1 = at(kW1);
  a.w3 = at(kW3);
  a.dw13 = nullptr;
  a.dw1 = at_mut(kDw1);
  a.dw3 = at_mut(kDw3);
  return a;
}

constexpr const char* kWeightsNotYet = "w1/w3 (separate gate and up weights) are not supported yet";
constexpr const char* kGradsNotYet = "dw1/dw3 (separate gate and up weight gradients) are not supported yet";

// A well-formed call: the cuBLAS impls refuse the separate form (`refusal`); Impl::kFused passes
// every host check and fails only at the device checks (no GPU here, or fake addresses on one).
void expect_well_formed(Impl impl, const std::function<void()>& call, const char* refusal) {
  if (impl != Impl::kFused) {
    expect_error_mentioning(call, refusal);
    return;
  }
  try {
    call();
    ADD_FAILURE() << "expected the device checks to fail on fake addresses";
  } catch (const Error& e) {
    const std::string message = e.what();
    for (const char* host_check : {"not supported", "must not be null", "aligned", "overlap", "pass either",
                                   "multiple of 128", "workspace"}) {
      EXPECT_EQ(message.find(host_check), std::string::npos) << "a host check failed: " << message;
    }
  }
}

TEST(SeparateGateUp, ForwardWeightFormsNamed) {
  const LayerConfig c = config();
  struct Case {
    std::function<void(ForwardArgs&)> mutate;
    const char* needle;
  };
  const Case cases[] = {
      {[](ForwardArgs& a) { a.w13 = at(0x40000); }, "pass either w13 or w1 and w3, not both"},
      {[](ForwardArgs& a) { a.w3 = nullptr; }, "w3 must not be null when w1 is set"},
      {[](ForwardArgs& a) { a.w1 = nullptr; }, "w1 must not be null when w3 is set"},
      {[](ForwardArgs& a) { a.w1 = a.w3 = nullptr; }, "w13 must not be null (or pass w1 and w3)"},
      {[](ForwardArgs& a) { a.w1 = at(kW1 + 8); }, "w1 must be 16-byte aligned"},
      {[](ForwardArgs& a) { a.w3 = at(kW3 + 2); }, "w3 must be 16-byte aligned"},
      {[](ForwardArgs& a) { a.w2 = nullptr; }, "w2 must not be null"},
      // The other checks still come before the refusal of the separate form.
      {[](ForwardArgs& a) { a.workspace_bytes = 0; }, "workspace_bytes"},
      {[](ForwardArgs& a) { a.y = nullptr; }, "y must not be null"},
  };
  for (Impl impl : {Impl::kUnfused, Impl::kReferenceFp32, Impl::kFused}) {
    for (bool caller_checked_pointers : {false, true}) {
      for (const Case& tc : cases) {
        ForwardArgs a = separate_forward_args(c, impl);
        a.caller_checked_pointers = caller_checked_pointers;
        tc.mutate(a);
        expect_error_mentioning([&] { forward(c, impl, a); }, tc.needle);
      }
    }
    // Well-formed, w1 and w3 aliasing included (they are only read).
    ForwardArgs a = separate_forward_args(c, impl);
    expect_well_formed(impl, [&] { forward(c, impl, a); }, kWeightsNotYet);
    a.w3 = a.w1;
    expect_well_formed(impl, [&] { forward(c, impl, a); }, kWeightsNotYet);
  }
}

TEST(SeparateGateUp, BackwardFormsNamed) {
  const LayerConfig c = config();
  struct Case {
    std::function<void(BackwardArgs&)> mutate;
    const char* needle;
  };
  const Case cases[] = {
      {[](BackwardArgs& a) { a.w13 = at(0x40000); }, "pass either w13 or w1 and w3, not both"},
      {[](BackwardArgs& a) { a.w1 = nullptr; }, "w1 must not be null when w3 is set"},
      {[](BackwardArgs& a) { a.dw13 = at_mut(0x90000); }, "pass either dw13 or dw1 and dw3, not both"},
      {[](BackwardArgs& a) { a.dw3 = nullptr; }, "dw3 must not be null when dw1 is set"},
      {[](BackwardArgs& a) { a.dw1 = nullptr; }, "dw1 must not be null when dw3 is set"},
      {[](BackwardArgs& a) { a.dw1 = at_mut(kDw1 + 4); }, "dw1 must be 16-byte aligned"},
      {[](BackwardArgs& a) { a.dw3 = at_mut(kDw3 + 4); }, "dw3 must be 16-byte aligned"},
      {[](BackwardArgs& a) { a.dw3 = a.dw1; }, "dw1 and dw3 must not overlap"},
      // fp32 [8, 128, 256] is 0x100000 bytes: dw3 starts inside dw1, and dw1 inside dw3.
      {[](BackwardArgs& a) { a.dw3 = at_mut(kDw1 + 0x80000); }, "dw1 and dw3 must not overlap"},
      {[](BackwardArgs& a) { a.dw1 = at_mut(kDw3 + 0xffff0); }, "dw1 and dw3 must not overlap"},
      {[](BackwardArgs& a) { a.dy = nullptr; }, "dy must not be null"},
  };
  struct WellFormed {
    std::function<void(BackwardArgs&)> mutate;
    const char* refusal;
  };
  const WellFormed well_formed[] = {
      {[](BackwardArgs&) {}, kWeightsNotYet},
      {[](BackwardArgs& a) { a.dw3 = at_mut(kDw1 + 0x100000); }, kWeightsNotYet},  // adjacent
      // bf16 is half the bytes: the same addresses no longer overlap.
      {[](BackwardArgs& a) {
         a.weight_grad_dtype = WeightGradDtype::kBFloat16;
         a.dw3 = at_mut(kDw1 + 0x80000);
       },
       kWeightsNotYet},
      // The two forms are independent: w13 with dw1/dw3, w1/w3 with dw13.
      {[](BackwardArgs& a) {
         a.w1 = a.w3 = nullptr;
         a.w13 = at(0x40000);
       },
       kGradsNotYet},
      {[](BackwardArgs& a) {
         a.dw1 = a.dw3 = nullptr;
         a.dw13 = at_mut(0x90000);
       },
       kWeightsNotYet},
      // Frozen weights: no gate/up gradient output, no dw2, or neither.
      {[](BackwardArgs& a) { a.dw1 = a.dw3 = nullptr; }, kWeightsNotYet},
      {[](BackwardArgs& a) { a.dw2 = nullptr; }, kWeightsNotYet},
      {[](BackwardArgs& a) { a.dw1 = a.dw3 = a.dw2 = nullptr; }, kWeightsNotYet},
  };
  for (Impl impl : {Impl::kUnfused, Impl::kFused}) {
    for (bool caller_checked_pointers : {false, true}) {
      for (const Case& tc : cases) {
        BackwardArgs a = separate_backward_args(c, impl);
        a.caller_checked_pointers = caller_checked_pointers;
        tc.mutate(a);
        expect_error_mentioning([&] { backward(c, impl, a); }, tc.needle);
      }
    }
    for (const WellFormed& tc : well_formed) {
      BackwardArgs a = separate_backward_args(c, impl);
      tc.mutate(a);
      expect_well_formed(impl, [&] { backward(c, impl, a); }, tc.refusal);
    }
  }
}

// Separate weight gradients come from two launches of 128-row tiles: I % 128 == 0. Separate
// weights with dw13 need nothing more.
TEST(SeparateGateUp, SeparateGradsNeedIntermediateMultipleOf128) {
  const LayerConfig c = harness::layer_config(256, 192, 8, 2, 64);
  BackwardArgs a = separate_backward_args(c, Impl::kFused);
  expect_error_mentioning([&] { backward(c, Impl::kFused, a); },
                          "dw1/dw3 (separate gate and up weight gradients) need intermediate (I) to be a multiple of "
                          "128 (128-row weight-gradient tiles), got 192");
  a.dw1 = a.dw3 = nullptr;
  a.dw13 = at_mut(0x90000);
  expect_well_formed(Impl::kFused, [&] { backward(c, Impl::kFused, a); }, nullptr);
}

// FP8 reads the weights from its buffer: all bf16 weights may be null, and a bf16 weight given
// is checked in its form.
TEST(SeparateGateUp, Fp8CallsAndQuantize) {
  LayerConfig c = config();
  c.precision = Precision::kFp8Blockwise;
  ForwardArgs fa = separate_forward_args(c, Impl::kFused);
  fa.fp8_weights = at(kPlausibleFp8Weights);
  fa.w1 = fa.w3 = fa.w2 = nullptr;
  fa.workspace_bytes = workspace_bytes(c, Impl::kFused);
  fa.w1 = at(kW1);
  expect_error_mentioning([&] { forward(c, Impl::kFused, fa); }, "w3 must not be null when w1 is set");

  const size_t bytes = fp8_weights_bytes(c);
  void* buffer = at_mut(0x10000000);
  expect_error_mentioning([&] { quantize_weights_fp8(c, nullptr, nullptr, at(0x40000), buffer, bytes, nullptr); },
                          "w1 and w3 must not be null");
  expect_error_mentioning([&] { quantize_weights_fp8(c, at(kW1), nullptr, at(0x40000), buffer, bytes, nullptr); },
                          "w3 must not be null when w1 is set");
  expect_error_mentioning([&] { quantize_weights_fp8(c, at(kW1 + 8), at(kW3), at(0x40000), buffer, bytes, nullptr); },
                          "w1 must be 16-byte aligned");
  expect_error_mentioning([&] { quantize_weights_fp8(c, at(kW1), at(kW3), nullptr, buffer, bytes, nullptr); },
                          "w2 must not be null");
  expect_error_mentioning(
      [&] { quantize_weights_fp8(c, at(kW1), at(kW3), at(0x40000), buffer, bytes - 1, nullptr); }, "needed");
  expect_well_formed(
      Impl::kFused, [&] { quantize_weights_fp8(c, at(kW1), at(kW3), at(0x40000), buffer, bytes, nullptr); }, nullptr);
}

}  // namespace
}  // namespace fusemoe

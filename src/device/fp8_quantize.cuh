// Device side of the blockwise FP8 quantization recipe (reference/fp8_host.h is its host twin,
// bit for bit): a block's scale pair from its amax, and the E4M3 packing of fp32 values.
//   scale = max(amax, kFp8MinAmax) / 448   (dequantization factor, stored)
//   inv   = 448 / max(amax, kFp8MinAmax)   (quantization factor)
//   q     = e4m3_rn_satfinite(v * inv)
// Both divisions are IEEE (__fdiv_rn) so the host reference reproduces them exactly. amax is taken
// with fmaxf, which ignores NaN: a NaN input stays NaN in q and leaves its block's scale finite.
#pragma once

#include <cstdint>

#include "device/sm90_fp8_ptx.cuh"

namespace fusemoe::sm90 {

constexpr float kE4m3Max = 448.0f;
constexpr float kFp8MinAmax = 1e-30f;  // reference/fp8_host.h: kFp8MinAmax
constexpr int kFp8Block = 128;         // 1 x 128 activation blocks, 128 x 128 weight blocks

struct Fp8Scale {
  float scale;  // amax / 448
  float inv;    // 448 / amax
};

__device__ __forceinline__ Fp8Scale fp8_block_scale(float amax) {
  const float a = fmaxf(amax, kFp8MinAmax);
  return {__fdiv_rn(a, kE4m3Max), __fdiv_rn(kE4m3Max, a)};
}

// Eight values -> eight E4M3 bytes (v[0] lowest), each multiplied by inv first.
__device__ __forceinline__ uint2 quantize_e4m3x8(const float (&v)[8], float inv) {
  return make_uint2(cvt_e4m3x4(v[0] * inv, v[1] * inv, v[2] * inv, v[3] * inv),
                    cvt_e4m3x4(v[4] * inv, v[5] * inv, v[6] * inv, v[7] * inv));
}

__device__ __forceinline__ float amax8(const float (&v)[8]) {
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(v[i]));
  return m;
}

}  // namespace fusemoe::sm90

// Host-side E4M3 conversion and the blockwise FP8 quantization recipe of Precision::kFp8Blockwise
// (docs/numerics.md#fp8), bit for bit as the device code computes it (src/kernels/fp8_quantize.cuh),
// so the tests and the FP8 emulation reference need no CUDA headers.
//
//   block   1 x 128 along K (activations) or 128 x 128 (weights)
//   amax    max |v| over the block's values (NaN ignored, as fmaxf), at least kFp8MinAmax
//   scale   amax / 448 (fp32, IEEE division)        the dequantization factor
//   inv     448 / amax (fp32, IEEE division)        the quantization factor
//   q       e4m3(v * inv): round to nearest even, saturated to +-448, NaN -> NaN
// Dequantized value: e4m3_to_float(q) * scale.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace fusemoe::host {

constexpr float kE4m3Max = 448.0f;
// amax floor: keeps scale a normal fp32 and inv finite for all-zero (or denormal-only) blocks, which
// then quantize to zeros with a finite scale; far below any value a bf16 layer carries in practice.
constexpr float kFp8MinAmax = 1e-30f;
constexpr int kFp8Block = 128;

// E4M3 (bias 7, no infinities, S.1111.111 is NaN) with round-to-nearest-even and saturation to the
// largest finite value, as the PTX `cvt.rn.satfinite.e4m3x2.f32` does. NaN gives 0x7F.
// Powers of two are built from their bits and every scaling is a multiplication by one, which is
// exact in this range: the same codes as ldexp/ilogb at a fraction of the cost (the FP8 emulation
// converts every weight of a layer).
inline float pow2f(int e) {  // 2^e for e in [-126, 127]
  const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint8_t float_to_e4m3_bits(float value) {
  if (std::isnan(value)) return 0x7F;
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  const float a = std::fabs(value);
  // 464 = 448 + half an ulp: the tie rounds to even (448's mantissa 110); above it saturates.
  if (a > 464.0f) return sign | 0x7E;
  if (a < 0.015625f) {  // 2^-6
    // Subnormal: units of 2^-9, m in [0, 8]; m = 8 is the smallest normal (bits 0x08).
    const float m = std::nearbyint(a * 512.0f);  // exact scaling, ties to even
    return sign | static_cast<uint8_t>(m);
  }
  uint32_t bits;
  std::memcpy(&bits, &a, sizeof(bits));
  int e = static_cast<int>(bits >> 23) - 127;                    // 2^e <= a < 2^(e+1), e in [-6, 8]
  float m = std::nearbyint(a * pow2f(3 - e)) - 8.0f;              // 3 mantissa bits, ties to even
  if (m == 8.0f) {
    m = 0.0f;
    ++e;
  }
  if (e > 8 || (e == 8 && m == 7.0f)) return sign | 0x7E;         // 480 and above is not finite
  return sign | static_cast<uint8_t>(((e + 7) << 3) | static_cast<int>(m));
}

// The value of each E4M3 code, by its definition.
inline float e4m3_bits_to_float_by_definition(uint8_t bits) {
  const float sign = (bits & 0x80) ? -1.0f : 1.0f;
  const int exponent = (bits >> 3) & 0xF;
  const int mantissa = bits & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return std::nanf("");
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);
  return sign * std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
}

struct E4m3Table {
  float value[256];
  E4m3Table() {
    for (int b = 0; b < 256; ++b) value[b] = e4m3_bits_to_float_by_definition(static_cast<uint8_t>(b));
  }
};

inline float e4m3_bits_to_float(uint8_t bits) {
  static const E4m3Table table;
  return table.value[bits];
}

struct Fp8BlockScale {
  float scale;  // amax / 448: dequantization
  float inv;    // 448 / amax: quantization
};

// The scale pair of a block whose largest magnitude is `amax` (NaN-free max, may be 0 or inf).
inline Fp8BlockScale fp8_block_scale(float amax) {
  const float a = std::max(amax, kFp8MinAmax);
  return {a / kE4m3Max, kE4m3Max / a};
}

// max(|v|) over n values with NaN ignored (fmaxf semantics), starting from 0.
inline float fp8_amax(const float* values, int64_t n, int64_t stride = 1) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(values[i * stride]));
  return amax;
}

inline uint8_t fp8_quantize(float value, const Fp8BlockScale& s) { return float_to_e4m3_bits(value * s.inv); }

// Quantizes one row of `cols` values (cols % 128 == 0) in 1 x 128 blocks: q[c], scales[c / 128].
inline void fp8_quantize_row(const float* row, int64_t cols, uint8_t* q, float* scales) {
  for (int64_t b = 0; b < cols / kFp8Block; ++b) {
    const Fp8BlockScale s = fp8_block_scale(fp8_amax(row + b * kFp8Block, kFp8Block));
    scales[b] = s.scale;
    for (int64_t c = 0; c < kFp8Block; ++c) q[b * kFp8Block + c] = fp8_quantize(row[b * kFp8Block + c], s);
  }
}

// Quantizes a [rows, cols] matrix (both multiples of 128) in 128 x 128 blocks:
// q [rows, cols], scales [rows / 128, cols / 128].
inline void fp8_quantize_matrix(const float* m, int64_t rows, int64_t cols, uint8_t* q, float* scales) {
  const int64_t block_cols = cols / kFp8Block;
  for (int64_t br = 0; br < rows / kFp8Block; ++br) {
    for (int64_t bc = 0; bc < block_cols; ++bc) {
      float amax = 0.0f;
      for (int64_t r = 0; r < kFp8Block; ++r) {
        amax = std::fmax(amax, fp8_amax(m + (br * kFp8Block + r) * cols + bc * kFp8Block, kFp8Block));
      }
      const Fp8BlockScale s = fp8_block_scale(amax);
      scales[br * block_cols + bc] = s.scale;
      for (int64_t r = 0; r < kFp8Block; ++r) {
        const int64_t offset = (br * kFp8Block + r) * cols + bc * kFp8Block;
        for (int64_t c = 0; c < kFp8Block; ++c) q[offset + c] = fp8_quantize(m[offset + c], s);
      }
    }
  }
}

}  // namespace fusemoe::host

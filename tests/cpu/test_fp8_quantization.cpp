// The host E4M3 conversion and quantization recipe of reference/fp8_host.h (the FP8 emulation
// reference's, and bit for bit the device kernels'): hand-checked values, agreement with CUDA's
// own host conversion (cuda_fp8.h, __NV_SATFINITE) over every tie and boundary pattern, exact
// decode of all 256 codes, and the block recipe's edge cases (zeros, one huge value, NaN, inf).
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "reference/fp8_host.h"

namespace fusemoe {
namespace {

using host::e4m3_bits_to_float;
using host::float_to_e4m3_bits;

float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint8_t cuda_e4m3(float f) { return __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3); }

TEST(Fp8E4m3, KnownValues) {
  struct Case {
    float value;
    uint8_t bits;
  };
  const float inf = std::numeric_limits<float>::infinity();
  for (const Case& c : {Case{0.0f, 0x00}, Case{-0.0f, 0x80}, Case{1.0f, 0x38}, Case{-1.0f, 0xB8},
                        Case{448.0f, 0x7E}, Case{-448.0f, 0xFE}, Case{460.0f, 0x7E},  // rounds down to 448
                        Case{464.0f, 0x7E},                                             // tie: even mantissa
                        Case{500.0f, 0x7E}, Case{1e30f, 0x7E}, Case{inf, 0x7E}, Case{-inf, 0xFE},  // saturated
                        Case{240.0f, 0x77}, Case{0.015625f, 0x08},                      // 2^-6: smallest normal
                        Case{0.001953125f, 0x01},                                       // 2^-9: smallest subnormal
                        Case{0.0009765625f, 0x00},                                      // 2^-10: tie to 0
                        Case{0.00146484375f, 0x01},                                     // 0.75 * 2^-9 -> 1
                        Case{0.0029296875f, 0x02},                                      // 1.5 * 2^-9: tie to 2
                        Case{0.0146484375f, 0x08},                                      // 7.5 * 2^-9: tie to 8
                        Case{1.0625f, 0x38},                                            // tie 1.0 / 1.125 -> 1.0
                        Case{1.1875f, 0x3A},                                            // tie 1.125 / 1.25 -> 1.25
                        Case{17.0f, 0x58}, Case{19.0f, 0x5A}, Case{1.9375f, 0x40}}) {  // 1.9375 -> 2.0
    EXPECT_EQ(float_to_e4m3_bits(c.value), c.bits) << "value " << c.value;
  }
  EXPECT_EQ(float_to_e4m3_bits(std::nanf("")) & 0x7F, 0x7F);
  EXPECT_EQ(float_to_e4m3_bits(-std::nanf("")) & 0x7F, 0x7F);
}

TEST(Fp8E4m3, DecodeEveryCode) {
  for (int bits = 0; bits < 256; ++bits) {
    const float decoded = e4m3_bits_to_float(static_cast<uint8_t>(bits));
    if ((bits & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(decoded)) << bits;
      continue;
    }
    // Every finite code round-trips, and decodes as CUDA's own conversion does.
    EXPECT_EQ(float_to_e4m3_bits(decoded), bits) << "code " << bits << " value " << decoded;
    __nv_fp8_e4m3 cuda;
    cuda.__x = static_cast<__nv_fp8_storage_t>(bits);
    EXPECT_EQ(static_cast<float>(cuda), decoded) << "code " << bits;
  }
}

// Every float whose mantissa is any 14-bit prefix followed by one of a few tails (all ties and
// their neighbours at E4M3's 3 bits, and far more), over every exponent and both signs, agrees
// with cuda_fp8.h's host conversion (the same saturating round-to-nearest-even as PTX cvt).
TEST(Fp8E4m3, MatchesCudaHostConversion) {
  int64_t checked = 0, mismatches = 0;
  for (uint32_t sign = 0; sign < 2; ++sign) {
    for (uint32_t exponent = 0; exponent < 256; ++exponent) {
      for (uint32_t prefix = 0; prefix < (1u << 14); ++prefix) {
        for (uint32_t tail : {0u, 1u, 0x100u, 0x1FFu, 0xFFu}) {
          const uint32_t bits = (sign << 31) | (exponent << 23) | (prefix << 9) | tail;
          const float f = from_bits(bits);
          const uint8_t ours = float_to_e4m3_bits(f), theirs = cuda_e4m3(f);
          const bool same = std::isnan(f) ? ((ours & 0x7F) == 0x7F && (theirs & 0x7F) == 0x7F) : ours == theirs;
          if (!same && mismatches++ < 10) {
            ADD_FAILURE() << "bits 0x" << std::hex << bits << " (" << f << "): ours 0x" << int(ours) << ", cuda 0x"
                          << int(theirs);
          }
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << checked;
}

TEST(Fp8Recipe, ScaleOfABlock) {
  const host::Fp8BlockScale s = host::fp8_block_scale(3.5f);
  EXPECT_EQ(s.scale, 3.5f / 448.0f);
  EXPECT_EQ(s.inv, 448.0f / 3.5f);
  // amax maps to 448 (saturation absorbs the rounding of inv).
  EXPECT_EQ(host::fp8_quantize(3.5f, s), 0x7E);
  EXPECT_EQ(host::fp8_quantize(-3.5f, s), 0xFE);
}

TEST(Fp8Recipe, EdgeBlocksGiveFiniteScalesAndNoNaN) {
  std::vector<float> row(2 * host::kFp8Block, 0.0f);
  // Block 1: one huge value among small ones.
  for (int i = 0; i < host::kFp8Block; ++i) row[host::kFp8Block + i] = 1e-3f * (i - 64);
  row[host::kFp8Block + 17] = 3.0e38f;
  std::vector<uint8_t> q(row.size());
  float scales[2];
  host::fp8_quantize_row(row.data(), static_cast<int64_t>(row.size()), q.data(), scales);
  for (float s : scales) EXPECT_TRUE(std::isfinite(s) && s > 0.0f) << s;
  for (size_t i = 0; i < q.size(); ++i) {
    const float deq = e4m3_bits_to_float(q[i]) * scales[i / host::kFp8Block];
    EXPECT_TRUE(std::isfinite(deq)) << i;
    if (i < static_cast<size_t>(host::kFp8Block)) EXPECT_EQ(deq, 0.0f) << i;  // the all-zero block
  }
  EXPECT_EQ(q[host::kFp8Block + 17], 0x7E);
  // The huge value comes back within E4M3's relative precision (2^-4).
  const float huge = e4m3_bits_to_float(q[host::kFp8Block + 17]) * scales[1];
  EXPECT_NEAR(huge / 3.0e38f, 1.0f, 1.0f / 16);
  // Denormal-only block: the amax floor keeps the scale normal and inv finite.
  const host::Fp8BlockScale tiny = host::fp8_block_scale(1e-40f);
  EXPECT_TRUE(std::isnormal(tiny.scale) && std::isfinite(tiny.inv));
}

TEST(Fp8Recipe, NaNStaysInItsElement) {
  std::vector<float> row(host::kFp8Block, 0.5f);
  row[5] = std::nanf("");
  std::vector<uint8_t> q(row.size());
  float scale;
  host::fp8_quantize_row(row.data(), host::kFp8Block, q.data(), &scale);
  EXPECT_EQ(scale, 0.5f / 448.0f);  // NaN ignored by the max
  EXPECT_EQ(q[5] & 0x7F, 0x7F);
  EXPECT_EQ(q[4], 0x7E);
}

TEST(Fp8Recipe, MatrixBlocksAreIndependent) {
  const int64_t rows = 256, cols = 128;
  std::vector<float> m(rows * cols, 1.0f);
  for (int64_t c = 0; c < cols; ++c) m[130 * cols + c] = 8.0f;  // block row 1 only
  std::vector<uint8_t> q(m.size());
  float scales[2];
  host::fp8_quantize_matrix(m.data(), rows, cols, q.data(), scales);
  EXPECT_EQ(scales[0], 1.0f / 448.0f);
  EXPECT_EQ(scales[1], 8.0f / 448.0f);
  EXPECT_EQ(q[0], 0x7E);
  EXPECT_EQ(q[200 * cols], host::float_to_e4m3_bits(56.0f));  // 1 * 448 / 8, exact in E4M3
  EXPECT_FLOAT_EQ(e4m3_bits_to_float(q[200 * cols]) * scales[1], 1.0f);
}

}  // namespace
}  // namespace fusemoe

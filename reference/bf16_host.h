// Host-side bf16 <-> fp32 conversion (round to nearest even, NaN kept quiet), so the CPU
// reference and the tests need no CUDA headers to make bf16 data.
#pragma once

#include <cstdint>
#include <cstring>

namespace fusemoe::host {

inline uint16_t float_to_bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // quiet NaN, sign kept
  }
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

inline float bf16_bits_to_float(uint16_t bits16) {
  const uint32_t bits = static_cast<uint32_t>(bits16) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline float round_to_bf16(float value) { return bf16_bits_to_float(float_to_bf16_bits(value)); }

}  // namespace fusemoe::host

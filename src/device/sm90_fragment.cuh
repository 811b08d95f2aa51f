// Helpers for wgmma accumulator fragments, shared by the forward and backward GEMM epilogues:
// bf16 packing and the 4 x 4 quad transpose that turns a thread's 4-byte fragment words into
// whole 16-byte row chunks (see the fragment layout in sm90_ptx.cuh).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace fusemoe::sm90 {

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// bf16 -> fp32 is the 16 bits moved up: one SHF or LOP3 a value on the 32-bit word (read
// through __nv_bfloat162, nvcc split the words into halves and merged them again, two PRMT a
// word, wherever they were also stored).
__device__ __forceinline__ void unpack_bf16x8(const uint4& bits, float (&out)[8]) {
  const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(words[i] << 16);
    out[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
  }
}

__device__ __forceinline__ float round_bf16(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}

// 4 x 4 transpose inside a quad of lanes (q = lane % 4): on entry v[p] is this lane's element
// of n8 chunk 4a + p; on exit v[p] is lane p's element of chunk 4a + q. Two butterfly steps on
// bits 0 and 1 of (lane, position): after the step on bit s, bit s of (owner lane, position) is
// swapped for every element whose position and owner disagree on that bit. All 32 lanes must
// call it.
template <typename T>
__device__ __forceinline__ void quad_transpose(T (&v)[4], int q) {
  const bool odd = q & 1;
  T x0 = odd ? v[0] : v[1], x1 = odd ? v[2] : v[3];
  x0 = __shfl_xor_sync(0xFFFFFFFFu, x0, 1);
  x1 = __shfl_xor_sync(0xFFFFFFFFu, x1, 1);
  if (odd) { v[0] = x0; v[2] = x1; } else { v[1] = x0; v[3] = x1; }
  const bool high = q & 2;
  T y0 = high ? v[0] : v[2], y1 = high ? v[1] : v[3];
  y0 = __shfl_xor_sync(0xFFFFFFFFu, y0, 2);
  y1 = __shfl_xor_sync(0xFFFFFFFFu, y1, 2);
  if (high) { v[0] = y0; v[1] = y1; } else { v[2] = y0; v[3] = y1; }
}

}  // namespace fusemoe::sm90

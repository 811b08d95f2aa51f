// GPU tests of the FP8 quantization kernels (src/kernels/fp8_quantize.h) against the host recipe
// (reference/fp8_host.h), bit for bit: E4M3 codes, scales, the transposed weight copies, the
// pool rows' bf16 copies and both scale layouts. Edge blocks: all zeros, one huge value among
// small ones, denormals only, a NaN element. Outputs are poisoned (0xFF) first; pool rows no slot
// maps to must keep the poison.
#include <algorithm>
#include <cstring>
#include <string>

#include "gpu/gpu_test_util.h"
#include "kernels/fp8_quantize.h"
#include "reference/fp8_host.h"

namespace fusemoe::test {
namespace {

// Compares E4M3 codes; a NaN code (S.1111.111) matches any NaN code (the sign of a NaN is not
// specified by the recipe). Reports the first few mismatches with their index.
void expect_codes_equal(const std::string& what, const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool nan_pair = (got[i] & 0x7F) == 0x7F && (want[i] & 0x7F) == 0x7F;
    if (got[i] != want[i] && !nan_pair && bad++ < 8) {
      ADD_FAILURE() << what << "[" << i << "]: got 0x" << std::hex << int(got[i]) << ", want 0x" << int(want[i]);
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " codes differ";
}

void expect_floats_bitwise(const std::string& what, const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0 && bad++ < 8) {
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " values differ";
}

// x [T, H] with edge blocks planted in the first rows.
std::vector<uint16_t> rows_with_edge_blocks(int64_t T, int64_t H, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint16_t> x = random_bf16(T * H, 1.0, rng);
  for (int64_t c = 0; c < 128; ++c) x[0 * H + c] = host::float_to_bf16_bits(0.0f);               // zeros
  for (int64_t c = 0; c < 128; ++c) x[1 * H + 128 + c] = host::float_to_bf16_bits(1e-3f * (c % 7));
  x[1 * H + 128 + 33] = host::float_to_bf16_bits(3.0e38f);                                      // one huge
  for (int64_t c = 0; c < 128; ++c) x[2 * H + c] = host::float_to_bf16_bits(1e-39f * (c % 3));  // denormals
  x[3 * H + 200] = 0x7FC0;                                                                       // NaN
  return x;
}

TEST(Fp8Quantize, TokenRowsMatchHostRecipe) {
  const int64_t T = 77, H = 384, blocks = H / 128;
  const std::vector<uint16_t> x = rows_with_edge_blocks(T, H, 11);
  DeviceBuffer x_dev = DeviceBuffer::from(x), q_dev(T * H), s_dev(T * blocks * 4);
  q_dev.poison();
  s_dev.poison();
  launch_quantize_token_rows_fp8(x_dev.get(), T, H, q_dev.get(), static_cast<float*>(s_dev.get()), nullptr);
  TEST_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> q_want(T * H);
  std::vector<float> s_want(T * blocks), row(H);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < H; ++c) row[c] = host::bf16_bits_to_float(x[t * H + c]);
    host::fp8_quantize_row(row.data(), H, q_want.data() + t * H, s_want.data() + t * blocks);
  }
  expect_codes_equal("x_fp8", q_dev.to_host<uint8_t>(), q_want);
  const std::vector<float> s_got = s_dev.to_host<float>();
  expect_floats_bitwise("x_scales", s_got, s_want);
  for (float s : s_got) EXPECT_TRUE(std::isfinite(s) && s > 0.0f) << "scale " << s;
}

// The device-count variant (the expert-parallel owner's pulled rows): rows below the count read on
// the device get the bytes of the host-count kernel above; rows past it keep their poison.
TEST(Fp8Quantize, TokenRowsWithDeviceCountMatchHostCount) {
  const int64_t max_rows = 77, H = 384, blocks = H / 128;
  const std::vector<uint16_t> x = rows_with_edge_blocks(max_rows, H, 12);
  const DeviceBuffer x_dev = DeviceBuffer::from(x);
  for (int32_t count : {0, 1, 50, 77}) {
    DeviceBuffer want_q(max_rows * H), want_s(max_rows * blocks * 4), got_q(max_rows * H),
        got_s(max_rows * blocks * 4);
    for (DeviceBuffer* b : {&want_q, &want_s, &got_q, &got_s}) b->poison();
    const DeviceBuffer count_dev = DeviceBuffer::from(std::vector<int32_t>{count});
    launch_quantize_token_rows_fp8(x_dev.get(), count, H, want_q.get(), static_cast<float*>(want_s.get()), nullptr);
    launch_quantize_token_rows_fp8_device_count(x_dev.get(), count_dev.as<int32_t>(), max_rows, H, got_q.get(),
                                                static_cast<float*>(got_s.get()), nullptr);
    TEST_CUDA(cudaDeviceSynchronize());
    const std::string where = "count " + std::to_string(count);
    EXPECT_TRUE(got_q.to_host<uint8_t>() == want_q.to_host<uint8_t>()) << where << ": E4M3 rows differ";
    EXPECT_TRUE(got_s.to_host<uint8_t>() == want_s.to_host<uint8_t>()) << where << ": scales differ";
  }
}

// The backward's dy: each token's row quantized once to [T, H] with row-major scales [T, H/128]
// (as the token kernel above), its bf16 copy stored to its slots' pool rows slot_row[t * K + j],
// masked slots (-1) skipped, and a second source's plain copy to the same rows (x beside dy);
// pool rows no slot maps to stay untouched. Tokens whose slots are all masked are quantized too.
TEST(Fp8Quantize, ScatteredRowsMatchHostRecipe) {
  const int64_t T = 50, H = 256, K = 3, max_rows = T * K, blocks = H / 128;
  const std::vector<uint16_t> x = rows_with_edge_blocks(T, H, 12);
  // Slots in a shuffled order take rows 0, 1, ...; every fourth slot is masked, so the last rows
  // of the pool belong to no slot.
  std::mt19937_64 rng(13);
  std::vector<int32_t> slots(T * K), slot_row(T * K, -1);
  for (int64_t i = 0; i < T * K; ++i) slots[i] = static_cast<int32_t>(i);
  std::shuffle(slots.begin(), slots.end(), rng);
  int32_t num_rows = 0;
  for (int32_t slot : slots) {
    if (slot % 4 != 3) slot_row[slot] = num_rows++;
  }
  for (int64_t j = 0; j < K; ++j) slot_row[7 * K + j] = -1;  // token 7: every slot masked
  ASSERT_LT(num_rows, max_rows);
  DeviceBuffer x_dev = DeviceBuffer::from(x), slot_dev = DeviceBuffer::from(slot_row);
  const std::vector<uint16_t> other = random_bf16(T * H, 1.0, rng);
  DeviceBuffer other_dev = DeviceBuffer::from(other), other_pool_dev(max_rows * H * 2);
  DeviceBuffer bf16_dev(max_rows * H * 2), q_dev(T * H), s_dev(T * blocks * 4);
  for (DeviceBuffer* b : {&bf16_dev, &q_dev, &s_dev, &other_pool_dev}) b->poison();
  launch_quantize_pool_rows_fp8(x_dev.get(), static_cast<const int32_t*>(slot_dev.get()), T, K, H, bf16_dev.get(),
                                q_dev.get(), static_cast<float*>(s_dev.get()), nullptr,
                                Fp8RowsPlainCopy{other_dev.get(), other_pool_dev.get()});
  TEST_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> q_want(T * H);
  std::vector<uint16_t> bf16_want(max_rows * H, 0xFFFF), other_want(max_rows * H, 0xFFFF);
  std::vector<float> s_want(T * blocks), row(H);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < H; ++c) row[c] = host::bf16_bits_to_float(x[t * H + c]);
    host::fp8_quantize_row(row.data(), H, q_want.data() + t * H, s_want.data() + t * blocks);
  }
  for (int64_t slot = 0; slot < T * K; ++slot) {
    const int64_t r = slot_row[slot], t = slot / K;
    if (r < 0) continue;
    for (int64_t c = 0; c < H; ++c) {
      bf16_want[r * H + c] = x[t * H + c];
      other_want[r * H + c] = other[t * H + c];
    }
  }
  expect_codes_equal("dy_fp8", q_dev.to_host<uint8_t>(), q_want);
  EXPECT_TRUE(bf16_dev.to_host<uint16_t>() == bf16_want) << "bf16 copies differ (or rows no slot maps to written)";
  EXPECT_TRUE(other_pool_dev.to_host<uint16_t>() == other_want)
      << "the second source's copies differ (or rows no slot maps to written)";
  expect_floats_bitwise("dy_scales", s_dev.to_host<float>(), s_want);
}

// The token-blocked pools of the FP8 weight gradients: the padded offsets and block owners, every
// code of each expert's positions (its rows, then zeros to the next multiple of 128) and every
// scale, bitwise against the host recipe over the same blocks; positions and scale blocks past
// the last expert keep their poison. Experts with 0, 1, 127, 128, 129 and 300 rows; sources
// gathered by row_slot / top_k or read in pool order, with a row stride above C; the edge blocks.
TEST(Fp8Quantize, TokenBlockedMatchHostRecipe) {
  struct Case {
    const char* name;
    std::vector<int32_t> counts;
    int64_t cols, ld, top_k;  // top_k 0: the source rows are the pool rows
    Fp8TokenScales mode;
  };
  const Case cases[] = {
      {"gathered 1x128", {0, 1, 127, 128, 129, 300}, 256, 256, 4, Fp8TokenScales::kPer128Tokens},
      {"gathered 128x128", {129, 0, 300, 1}, 384, 384, 8, Fp8TokenScales::kPer128x128},
      {"pool rows 1x128, ld > C", {300, 0, 1, 128}, 128, 384, 0, Fp8TokenScales::kPer128Tokens},
      {"pool rows 128x128, ld > C", {127, 129, 0}, 256, 384, 0, Fp8TokenScales::kPer128x128},
      {"all empty", {0, 0}, 128, 256, 0, Fp8TokenScales::kPer128Tokens},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const int64_t E = static_cast<int64_t>(c.counts.size()), C = c.cols;
    std::vector<int32_t> off(E + 1, 0), pad(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) {
      off[e + 1] = off[e] + c.counts[e];
      pad[e + 1] = pad[e] + (c.counts[e] + 127) / 128 * 128;
    }
    const int64_t R = off[E], P = fp8_token_blocked_positions(R, E), blocks = P / 128;
    std::mt19937_64 rng(40 + E);
    // Source rows: T tokens (gathered; slot s is token s / top_k) or the R pool rows.
    const int64_t T = c.top_k > 0 ? std::max<int64_t>(3, R / 2) : R;
    std::vector<uint16_t> src = rows_with_edge_blocks(std::max<int64_t>(T, 4), c.ld, 41);
    std::vector<int32_t> row_slot(std::max<int64_t>(R, 1));
    for (int64_t r = 0; r < R; ++r) {
      row_slot[r] = c.top_k > 0 ? static_cast<int32_t>(rng() % (T * c.top_k)) : 0;
    }
    if (c.top_k > 0 && R > 0) row_slot[0] = 0;  // the edge blocks' rows
    DeviceBuffer src_dev = DeviceBuffer::from(src), off_dev = DeviceBuffer::from(off), slot_dev = DeviceBuffer::from(row_slot);
    DeviceBuffer pad_dev((E + 1) * 4), owner_dev(blocks * 4), q_dev(C * P);
    DeviceBuffer s_dev(blocks * (c.mode == Fp8TokenScales::kPer128Tokens ? C : C / 128) * 4);
    for (DeviceBuffer* b : {&pad_dev, &owner_dev, &q_dev, &s_dev}) b->poison();
    // 0xFF is also an E4M3 NaN code, which the comparison matches with any NaN: the codes are
    // checked again after a second call over a finite poison, where an unwritten code shows.
    constexpr uint8_t kFinitePoison = 0x5A;
    launch_token_block_offsets(static_cast<const int32_t*>(off_dev.get()), E, P, static_cast<int32_t*>(pad_dev.get()),
                               static_cast<int32_t*>(owner_dev.get()), nullptr);
    Fp8TokenBlockedParams t;
    t.src = src_dev.get();
    t.ld = c.ld;
    t.cols = C;
    t.row_slot = c.top_k > 0 ? static_cast<const int32_t*>(slot_dev.get()) : nullptr;
    t.top_k = std::max<int64_t>(c.top_k, 1);
    t.expert_offsets = static_cast<const int32_t*>(off_dev.get());
    t.padded_offsets = static_cast<const int32_t*>(pad_dev.get());
    t.block_expert = static_cast<const int32_t*>(owner_dev.get());
    t.p_max = P;
    t.q = q_dev.get();
    t.scales = static_cast<float*>(s_dev.get());
    t.mode = c.mode;
    launch_quantize_token_blocked_fp8(t);
    TEST_CUDA(cudaDeviceSynchronize());
    EXPECT_TRUE(pad_dev.to_host<int32_t>() == pad) << "padded offsets";
    std::vector<int32_t> owner_want(blocks, -1);
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t b = pad[e] / 128; b < pad[e + 1] / 128; ++b) owner_want[b] = static_cast<int32_t>(e);
    }
    EXPECT_TRUE(owner_dev.to_host<int32_t>() == owner_want) << "block owners";
    // The host recipe over the same blocks; everything else stays poisoned (0xFF).
    std::vector<uint8_t> q_want(C * P, 0xFF);
    std::vector<float> s_want = s_dev.to_host<float>();
    std::memset(s_want.data(), 0xFF, s_want.size() * 4);
    const int64_t group = c.mode == Fp8TokenScales::kPer128x128 ? 128 : 1;
    auto value = [&](int64_t e, int64_t p, int64_t col) -> float {  // position p of expert e
      const int64_t i = p - pad[e];
      if (i >= c.counts[e]) return 0.0f;
      const int64_t r = off[e] + i, source = c.top_k > 0 ? row_slot[r] / c.top_k : r;
      return host::bf16_bits_to_float(src[source * c.ld + col]);
    };
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t b = pad[e] / 128; b < pad[e + 1] / 128; ++b) {
        for (int64_t g = 0; g < C / group; ++g) {
          std::vector<float> v(group * 128);
          for (int64_t f = 0; f < group; ++f) {
            for (int64_t i = 0; i < 128; ++i) v[f * 128 + i] = value(e, b * 128 + i, g * group + f);
          }
          const host::Fp8BlockScale sc = host::fp8_block_scale(host::fp8_amax(v.data(), group * 128));
          for (int64_t f = 0; f < group; ++f) {
            for (int64_t i = 0; i < 128; ++i) {
              q_want[(b * C + g * group + f) * 128 + i] = host::fp8_quantize(v[f * 128 + i], sc);  // [P/128][C][128]
            }
          }
          s_want[b * (C / group) + g] = sc.scale;
        }
      }
    }
    expect_codes_equal("token-blocked codes", q_dev.to_host<uint8_t>(), q_want);
    expect_floats_bitwise("token-blocked scales", s_dev.to_host<float>(), s_want);
    TEST_CUDA(cudaMemset(q_dev.get(), kFinitePoison, C * P));
    launch_quantize_token_blocked_fp8(t);
    TEST_CUDA(cudaDeviceSynchronize());
    for (int64_t b = pad[E] / 128; b < P / 128; ++b) {  // never written: the new poison
      std::fill(q_want.begin() + b * C * 128, q_want.begin() + (b + 1) * C * 128, kFinitePoison);
    }
    const std::vector<uint8_t> again = q_dev.to_host<uint8_t>();
    int64_t unwritten = 0;
    for (int64_t i = 0; i < pad[E] / 128 * C * 128; ++i) {
      unwritten += again[i] == kFinitePoison && q_want[i] != kFinitePoison;
    }
    EXPECT_EQ(unwritten, 0) << "codes below pad[E] not written by the second call";
    expect_codes_equal("token-blocked codes over a finite poison", again, q_want);
  }
}

// Both weight shapes' block grids, the transposed copy, and edge blocks inside a weight.
TEST(Fp8Quantize, WeightsAndTransposesMatchHostRecipe) {
  const int64_t E = 3, R = 256, C = 384;
  std::mt19937_64 rng(14);
  std::vector<uint16_t> w = random_bf16(E * R * C, 0.05, rng);
  for (int64_t r = 0; r < 128; ++r) {
    for (int64_t c = 128; c < 256; ++c) w[(1 * R + r) * C + c] = 0;  // expert 1, block (0, 1): zeros
  }
  w[(2 * R + 200) * C + 300] = host::float_to_bf16_bits(-2.5e38f);   // expert 2, block (1, 2): one huge
  DeviceBuffer w_dev = DeviceBuffer::from(w), q_dev(E * R * C), qt_dev(E * R * C), s_dev(E * (R / 128) * (C / 128) * 4);
  for (DeviceBuffer* b : {&q_dev, &qt_dev, &s_dev}) b->poison();
  launch_quantize_weights_fp8(w_dev.get(), nullptr, E, R, C, q_dev.get(), qt_dev.get(), static_cast<float*>(s_dev.get()),
                              nullptr);
  TEST_CUDA(cudaDeviceSynchronize());
  std::vector<float> wf(R * C);
  std::vector<uint8_t> q_want(E * R * C), qt_want(E * R * C);
  std::vector<float> s_want(E * (R / 128) * (C / 128));
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < R * C; ++i) wf[i] = host::bf16_bits_to_float(w[e * R * C + i]);
    host::fp8_quantize_matrix(wf.data(), R, C, q_want.data() + e * R * C, s_want.data() + e * (R / 128) * (C / 128));
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t c = 0; c < C; ++c) qt_want[e * R * C + c * R + r] = q_want[e * R * C + r * C + c];
    }
  }
  expect_codes_equal("w_fp8", q_dev.to_host<uint8_t>(), q_want);
  expect_codes_equal("w_fp8_t", qt_dev.to_host<uint8_t>(), qt_want);
  const std::vector<float> s_got = s_dev.to_host<float>();
  expect_floats_bitwise("w_scales", s_got, s_want);
  for (float s : s_got) EXPECT_TRUE(std::isfinite(s) && s > 0.0f) << "scale " << s;
}

}  // namespace
}  // namespace fusemoe::test

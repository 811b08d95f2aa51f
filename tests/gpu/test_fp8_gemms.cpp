// GPU tests of each block-scaled FP8 GEMM launcher (src/launchers/sm90_fp8_gemms.h) on its own,
// against an fp64 CPU computation from the same E4M3 codes and scales, so a failure names the
// kernel (and the expert, row and column) at fault. Inputs are random E4M3 codes with random
// power-of-two scales per block (a misplaced scale changes the result by a factor of 2-4, a
// misplaced row or column by O(1)); the routing is built on the host with the shared routing
// helpers (tests/common/routing.h: experts with 0, 1, 64, 130 and 257 rows at random slots:
// partial, single and several row tiles). Outputs are poisoned (0xFF) first; rows
// past the routed rows and slots without a row must keep the poison. Tolerances: the fp32
// tensor-core accumulation and the bf16 outputs differ from fp64 by ~1e-3 (relative L2);
// quantized outputs (h, dz) are compared after dequantization with the host recipe applied to
// the fp64 values (a code flips where fp32 and fp64 round differently: ~1e-3).
#include <cstring>
#include <limits>
#include <optional>
#include <string>

#include "common/routing.h"
#include "gpu/gpu_test_util.h"
#include "launchers/sm90_fp8_gemms.h"
#include "reference/fp8_host.h"

namespace fusemoe::test {
namespace {

constexpr double kTol = 5e-3;           // fp32 accumulation + bf16 output vs fp64
constexpr double kQuantizedTol = 2e-2;  // dequantized E4M3 outputs vs the host-quantized fp64 values

std::vector<uint8_t> random_codes(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> dist(0.0f, 64.0f);
  std::vector<uint8_t> out(n);
  for (auto& c : out) c = host::float_to_e4m3_bits(dist(rng));
  return out;
}

// Powers of two 2^(exponent + {-1, 0, 1}).
std::vector<float> random_scales(size_t n, int exponent, std::mt19937_64& rng) {
  std::vector<float> out(n);
  for (auto& s : out) s = std::ldexp(1.0f, exponent + static_cast<int>(rng() % 3) - 1);
  return out;
}

int log2_ceil(int64_t v) {
  int e = 0;
  while ((int64_t{1} << e) < v) ++e;
  return e;
}

double dq(const std::vector<uint8_t>& codes, size_t i, float scale) {
  return static_cast<double>(host::e4m3_bits_to_float(codes[i])) * scale;
}

double silu(double g) { return g / (1.0 + std::exp(-g)); }

// The rows problem: E experts with the given row counts, rows of an expert consecutive, row r
// holding a distinct slot row_slot[r] of [0, T*K) (token row_slot[r] / K), as the library's
// routing sorts them (harness::sort_by_expert).
struct RowsCase {
  const char* name;
  int64_t T, K, H, I;
  std::vector<int32_t> counts;
  int num_sms = 0;  // CTAs of every launch (0: one per SM)
};

struct Rows {
  RowsCase c;
  int64_t E, R, S, rows_pad;
  std::vector<int32_t> offsets, row_slot, slot_row, expert_of_row;
  std::optional<DeviceBuffer> offsets_dev, row_slot_dev;
  Sm90Rows rows;

  explicit Rows(const RowsCase& rc, uint64_t seed) : c(rc) {
    E = static_cast<int64_t>(c.counts.size());
    S = c.T * c.K;
    harness::ExpertRows sorted = harness::sort_by_expert(harness::topk_with_counts(c.counts, S, seed), E);
    offsets = std::move(sorted.offsets);
    row_slot = std::move(sorted.row_slot);
    slot_row = std::move(sorted.slot_row);
    R = offsets[E];
    rows_pad = sm90_fp8_rows_pad(S);
    for (int64_t e = 0; e < E; ++e) {
      for (int32_t r = offsets[e]; r < offsets[e + 1]; ++r) expert_of_row.push_back(static_cast<int32_t>(e));
    }
    offsets_dev.emplace(DeviceBuffer::from(offsets));
    row_slot_dev.emplace(DeviceBuffer::from(row_slot));
    rows.expert_offsets = static_cast<const int32_t*>(offsets_dev->get());
    rows.max_rows = S;
    rows.hidden = c.H;
    rows.intermediate = c.I;
    rows.num_experts = E;
    rows.num_sms = c.num_sms;
  }
  const int32_t* row_slot_ptr() const { return static_cast<const int32_t*>(row_slot_dev->get()); }
};

const RowsCase kCases[] = {
    {"H256_I256_E5", 300, 2, 256, 256, {130, 0, 1, 257, 64}},
    {"H384_I128_E3", 100, 3, 384, 128, {7, 129, 0}},
    // K-blocks past every instance's ring (gate/up 8, down 5, dgrad of x 10 against 4 stages;
    // dgrad-SwiGLU 8 against 4): stages are reused, which the sanitizers must see.
    {"H1024_I640_E3", 200, 2, 1024, 640, {150, 1, 249}},
    // Few CTAs, each looping over many tiles: a tile's held output (z, the row stores) goes out
    // under the next tile's first K-block, across experts and after partial tiles.
    {"H1024_I640_E3_on_3_sms", 200, 2, 1024, 640, {150, 1, 249}, 3},
    {"H256_I256_E5_on_1_sm", 300, 2, 256, 256, {130, 0, 1, 257, 64}, 1},
};

// Relative L2 of got vs ref over rows (value index row * cols + col), from compare()
// (gpu_test_util.h: NaN, non-finite values or a size mismatch fail); when over tol, reports the
// element with the largest error, with its row's expert and tiles.
void expect_rows_close(const std::string& what, const Rows& p, const std::vector<double>& got,
                       const std::vector<double>& ref, int64_t cols, double tol) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  const ErrorStats stats = compare(got, ref);
  std::printf("  %-34s rel_l2 %.3e  max_abs %.3e  (tol %.1e, n=%zu)\n", what.c_str(), stats.rel_l2, stats.max_abs,
              tol, got.size());
  if (stats.rel_l2 <= tol) return;
  double worst = -1;
  int64_t worst_row = -1, worst_col = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = std::fabs(got[i] - ref[i]);
    if (!(d <= worst)) {
      worst = d;
      worst_row = static_cast<int64_t>(i) / cols;
      worst_col = static_cast<int64_t>(i) % cols;
    }
  }
  ADD_FAILURE() << what << ": rel_l2 " << stats.rel_l2 << " > " << tol
                << (stats.all_finite ? "" : " (non-finite values)") << "; worst at output row " << worst_row
                << " (expert " << (worst_row >= 0 && worst_row < p.R ? p.expert_of_row[worst_row] : -1)
                << ", row tile "
                << (worst_row >= 0 && worst_row < p.R ? (worst_row - p.offsets[p.expert_of_row[worst_row]]) / 128 : -1)
                << ") column " << worst_col << " (column tile " << worst_col / 128 << "): got "
                << got[worst_row * cols + worst_col] << ", want " << ref[worst_row * cols + worst_col];
}

// Bytes of rows [first, last) of a [rows, row_bytes] buffer all 0xFF (never written).
void expect_rows_untouched(const std::string& what, const std::vector<uint8_t>& bytes, int64_t row_bytes,
                           const std::vector<int64_t>& rows) {
  int64_t written = 0, first = -1;
  for (int64_t r : rows) {
    for (int64_t b = 0; b < row_bytes; ++b) {
      if (bytes[r * row_bytes + b] != 0xFF) {
        if (written++ == 0) first = r;
        break;
      }
    }
  }
  EXPECT_EQ(written, 0) << what << ": " << written << " rows that no routed row owns were written (first: row "
                        << first << ")";
}

std::vector<int64_t> range(int64_t begin, int64_t end) {
  std::vector<int64_t> v;
  for (int64_t i = begin; i < end; ++i) v.push_back(i);
  return v;
}

std::vector<int64_t> unrouted_slots(const Rows& p) {
  std::vector<int64_t> out;
  for (int64_t s = 0; s < p.S; ++s) {
    if (p.slot_row[s] < 0) out.push_back(s);
  }
  return out;
}

// An FP8 weight [E, rows, cols] with its [E, rows/128, cols/128] scales, and its transpose.
struct Fp8Weight {
  int64_t E, rows, cols;
  std::vector<uint8_t> q, q_t;
  std::vector<float> s;
  std::vector<double> deq;  // dequantized, [E, rows, cols]
  Fp8Weight(int64_t E_, int64_t rows_, int64_t cols_, int fan_in, std::mt19937_64& rng)
      : E(E_), rows(rows_), cols(cols_) {
    q = random_codes(E * rows * cols, rng);
    // Codes ~ N(0, 64^2): scale 2^-6 / sqrt(fan_in) gives values ~ N(0, 1 / fan_in).
    s = random_scales(E * (rows / 128) * (cols / 128), -6 - (log2_ceil(fan_in) + 1) / 2, rng);
    q_t.resize(q.size());
    deq.resize(q.size());
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t i = (e * rows + r) * cols + c;
          q_t[(e * cols + c) * rows + r] = q[i];
          deq[i] = dq(q, i, s[(e * (rows / 128) + r / 128) * (cols / 128) + c / 128]);
        }
      }
    }
  }
  double at(int64_t e, int64_t r, int64_t c) const { return deq[(e * rows + r) * cols + c]; }
};

// A pool operand [S, K] E4M3 with block-major scales [K/128, rows_pad].
struct Fp8Pool {
  int64_t S, K, rows_pad;
  std::vector<uint8_t> q;
  std::vector<float> s;
  std::vector<double> deq;  // dequantized, [S, K]
  Fp8Pool(int64_t S_, int64_t K_, int64_t rows_pad_, std::mt19937_64& rng) : S(S_), K(K_), rows_pad(rows_pad_) {
    q = random_codes(S * K, rng);
    s = random_scales((K / 128) * rows_pad, -6, rng);
    deq.resize(q.size());
    for (int64_t r = 0; r < S; ++r) {
      for (int64_t k = 0; k < K; ++k) deq[r * K + k] = dq(q, r * K + k, s[(k / 128) * rows_pad + r]);
    }
  }
  double at(int64_t r, int64_t k) const { return deq[r * K + k]; }
};

// Token rows [T, K] E4M3 with token-major scales [T, K/128], as the gathering GEMMs read them
// (gate/up's x, the z recompute's x, dgrad + SwiGLU's dy); at(r, k): routed row r's token.
struct Fp8TokenRows {
  int64_t T, K, top_k;
  std::vector<uint8_t> q;
  std::vector<float> s;
  std::vector<double> deq;  // dequantized, [T, K]
  const std::vector<int32_t>& row_slot;
  Fp8TokenRows(const Rows& p, int64_t K_, std::mt19937_64& rng)
      : T(p.c.T), K(K_), top_k(p.c.K), row_slot(p.row_slot) {
    q = random_codes(T * K, rng);
    s = random_scales(T * (K / 128), -6, rng);
    deq.resize(q.size());
    for (int64_t i = 0; i < T * K; ++i) deq[i] = dq(q, i, s[(i / K) * (K / 128) + (i % K) / 128]);
  }
  double at(int64_t r, int64_t k) const { return deq[(row_slot[r] / top_k) * K + k]; }
};

// widen() of the first rows x cols values.
std::vector<double> widen_bf16_rows(const std::vector<uint16_t>& bits, int64_t rows, int64_t cols) {
  return widen(std::vector<uint16_t>(bits.begin(), bits.begin() + rows * cols));
}

// Dequantizes rows [0, R) of an E4M3 [*, cols] tensor with block-major scales.
std::vector<double> dequantize_rows(const std::vector<uint8_t>& q, const std::vector<float>& s, int64_t R,
                                    int64_t cols, int64_t rows_pad) {
  std::vector<double> out(R * cols);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = dq(q, r * cols + c, s[(c / 128) * rows_pad + r]);
  }
  return out;
}

// Quantizes rows (fp64 values, rounded to bf16 first) with the host recipe and dequantizes them.
std::vector<double> host_quantized(const std::vector<double>& v, int64_t R, int64_t cols, std::vector<float>* scales) {
  std::vector<double> out(R * cols);
  std::vector<float> row(cols), s(cols / 128);
  std::vector<uint8_t> q(cols);
  if (scales) scales->assign(R * (cols / 128), 0.0f);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < cols; ++c) row[c] = host::round_to_bf16(static_cast<float>(v[r * cols + c]));
    host::fp8_quantize_row(row.data(), cols, q.data(), s.data());
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = host::e4m3_bits_to_float(q[c]) * static_cast<double>(s[c / 128]);
    if (scales) std::copy(s.begin(), s.end(), scales->begin() + r * (cols / 128));
  }
  return out;
}

std::vector<double> block_major_to_rows(const std::vector<float>& s, int64_t R, int64_t blocks, int64_t rows_pad) {
  std::vector<double> out(R * blocks);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t b = 0; b < blocks; ++b) out[r * blocks + b] = s[b * rows_pad + r];
  }
  return out;
}

class Fp8Gemm : public ::testing::TestWithParam<RowsCase> {};

// ---------------------------------------------------------------------------------- gate/up

TEST_P(Fp8Gemm, GateUpSwiGLU) {
  for (bool clamp : {false, true}) {
    const Rows p(GetParam(), 100);
    const int64_t K = p.c.K, H = p.c.H, I = p.c.I, F = 2 * I;
    std::printf("%s clamp=%d: R=%lld\n", p.c.name, int(clamp), static_cast<long long>(p.R));
    std::mt19937_64 rng(101);
    const Fp8TokenRows x(p, H, rng);
    const Fp8Weight w13(p.E, F, H, static_cast<int>(H), rng);
    DeviceBuffer x_dev = DeviceBuffer::from(x.q), xs_dev = DeviceBuffer::from(x.s), w_dev = DeviceBuffer::from(w13.q),
                 ws_dev = DeviceBuffer::from(w13.s);
    DeviceBuffer h_dev(p.S * I), hs_dev((I / 128) * p.rows_pad * 4), z_dev(p.S * F * 2);
    for (DeviceBuffer* b : {&h_dev, &hs_dev, &z_dev}) b->poison();
    Sm90Fp8GateUpParams a;
    a.rows = p.rows;
    a.x_fp8 = x_dev.get();
    a.x_scales = static_cast<const float*>(xs_dev.get());
    a.row_slot = p.row_slot_ptr();
    a.top_k = K;
    a.weights.w13 = w_dev.get();
    a.weights.w13_scales = static_cast<const float*>(ws_dev.get());
    a.h_fp8 = h_dev.get();
    a.h_scales = static_cast<float*>(hs_dev.get());
    a.z = z_dev.get();
    a.use_swiglu_clamp = clamp;
    a.swiglu_clamp = 0.75f;
    launch_sm90_fp8_gate_up_swiglu(a);
    TEST_CUDA(cudaDeviceSynchronize());

    std::vector<double> z_ref(p.R * F), h_ref(p.R * I);
    for (int64_t r = 0; r < p.R; ++r) {
      const int64_t e = p.expert_of_row[r];
      for (int64_t f = 0; f < F; ++f) {
        double acc = 0.0;
        for (int64_t k = 0; k < H; ++k) acc += x.at(r, k) * w13.at(e, f, k);
        z_ref[r * F + f] = acc;
      }
      for (int64_t c = 0; c < I; ++c) {
        double g = z_ref[r * F + c], u = z_ref[r * F + I + c];
        if (clamp) {
          g = std::min(g, 0.75);
          u = std::min(std::max(u, -0.75), 0.75);
        }
        h_ref[r * I + c] = silu(g) * u;
      }
    }
    const std::vector<uint16_t> z_bits = z_dev.to_host<uint16_t>();
    const std::vector<uint8_t> h_bytes = h_dev.to_host<uint8_t>();
    const std::vector<float> h_scales = hs_dev.to_host<float>();
    expect_rows_close("z (gate/up accumulators)", p, widen_bf16_rows(z_bits, p.R, F), z_ref, F, kTol);
    std::vector<float> hs_want;
    const std::vector<double> h_want = host_quantized(h_ref, p.R, I, &hs_want);
    expect_rows_close("h scales (1 x 128, per row)", p, block_major_to_rows(h_scales, p.R, I / 128, p.rows_pad),
                      std::vector<double>(hs_want.begin(), hs_want.end()), I / 128, kTol);
    expect_rows_close("h (dequantized E4M3)", p, dequantize_rows(h_bytes, h_scales, p.R, I, p.rows_pad), h_want, I,
                      kQuantizedTol);
    std::vector<uint8_t> z_bytes(z_bits.size() * 2);
    std::memcpy(z_bytes.data(), z_bits.data(), z_bytes.size());
    expect_rows_untouched("z", z_bytes, F * 2, range(p.R, p.S));
    expect_rows_untouched("h", h_bytes, I, range(p.R, p.S));
  }
}

// ------------------------------------------------------------------------------------- down

TEST_P(Fp8Gemm, DownWeightedSlotRows) {
  const Rows p(GetParam(), 200);
  const int64_t H = p.c.H, I = p.c.I;
  std::mt19937_64 rng(201);
  const Fp8Pool h(p.S, I, p.rows_pad, rng);
  const Fp8Weight w2(p.E, H, I, static_cast<int>(I), rng);
  std::vector<float> topk_w(p.S);
  std::uniform_real_distribution<float> unit(0.05f, 1.0f);
  for (auto& v : topk_w) v = unit(rng);
  DeviceBuffer h_dev = DeviceBuffer::from(h.q), hs_dev = DeviceBuffer::from(h.s), w_dev = DeviceBuffer::from(w2.q),
               ws_dev = DeviceBuffer::from(w2.s), tw_dev = DeviceBuffer::from(topk_w), ys_dev(p.S * H * 2);
  ys_dev.poison();
  Sm90Fp8DownParams a;
  a.rows = p.rows;
  a.h_fp8 = h_dev.get();
  a.h_scales = static_cast<const float*>(hs_dev.get());
  a.weights.w2 = w_dev.get();
  a.weights.w2_scales = static_cast<const float*>(ws_dev.get());
  a.row_slot = p.row_slot_ptr();
  a.topk_weights = static_cast<const float*>(tw_dev.get());
  a.ys = ys_dev.get();
  launch_sm90_fp8_down_weighted(a);
  TEST_CUDA(cudaDeviceSynchronize());
  const std::vector<uint16_t> ys = ys_dev.to_host<uint16_t>();
  std::vector<double> got(p.R * H), ref(p.R * H);
  for (int64_t r = 0; r < p.R; ++r) {
    const int64_t e = p.expert_of_row[r], s = p.row_slot[r];
    for (int64_t n = 0; n < H; ++n) {
      double acc = 0.0;
      for (int64_t c = 0; c < I; ++c) acc += h.at(r, c) * w2.at(e, n, c);
      ref[r * H + n] = topk_w[s] * acc;
      got[r * H + n] = host::bf16_bits_to_float(ys[s * H + n]);
    }
  }
  std::printf("%s: R=%lld\n", p.c.name, static_cast<long long>(p.R));
  expect_rows_close("ys (by routed row)", p, got, ref, H, kTol);
  std::vector<uint8_t> bytes(ys.size() * 2);
  std::memcpy(bytes.data(), ys.data(), bytes.size());
  expect_rows_untouched("ys", bytes, H * 2, unrouted_slots(p));
}

// ------------------------------------------------------------------------------ recompute z

TEST_P(Fp8Gemm, RecomputeZSortedRows) {
  const Rows p(GetParam(), 300);
  const int64_t H = p.c.H, F = 2 * p.c.I;
  std::mt19937_64 rng(301);
  const Fp8TokenRows xs(p, H, rng);
  const Fp8Weight w13(p.E, F, H, static_cast<int>(H), rng);
  DeviceBuffer x_dev = DeviceBuffer::from(xs.q), xs_dev = DeviceBuffer::from(xs.s), w_dev = DeviceBuffer::from(w13.q),
               ws_dev = DeviceBuffer::from(w13.s), z_dev(p.S * F * 2);
  z_dev.poison();
  Sm90Fp8RecomputeZParams a;
  a.rows = p.rows;
  a.x_fp8 = x_dev.get();
  a.x_scales = static_cast<const float*>(xs_dev.get());
  a.row_slot = p.row_slot_ptr();
  a.top_k = p.c.K;
  a.weights.w13 = w_dev.get();
  a.weights.w13_scales = static_cast<const float*>(ws_dev.get());
  a.z = z_dev.get();
  launch_sm90_fp8_recompute_z(a);
  TEST_CUDA(cudaDeviceSynchronize());
  std::vector<double> ref(p.R * F);
  for (int64_t r = 0; r < p.R; ++r) {
    for (int64_t f = 0; f < F; ++f) {
      double acc = 0.0;
      for (int64_t k = 0; k < H; ++k) acc += xs.at(r, k) * w13.at(p.expert_of_row[r], f, k);
      ref[r * F + f] = acc;
    }
  }
  const std::vector<uint16_t> z = z_dev.to_host<uint16_t>();
  std::printf("%s: R=%lld\n", p.c.name, static_cast<long long>(p.R));
  expect_rows_close("z (recomputed)", p, widen_bf16_rows(z, p.R, F), ref, F, kTol);
  std::vector<uint8_t> bytes(z.size() * 2);
  std::memcpy(bytes.data(), z.data(), bytes.size());
  expect_rows_untouched("z", bytes, F * 2, range(p.R, p.S));
}

// --------------------------------------------------------------------------- dgrad + SwiGLU

TEST_P(Fp8Gemm, DgradSwiGLUWithDzQuantized) {
  for (bool clamp : {false, true}) {
    const Rows p(GetParam(), 400);
    const int64_t H = p.c.H, I = p.c.I, F = 2 * I, tiles = (I + kSm90Fp8DgradBlockN - 1) / kSm90Fp8DgradBlockN;
    std::printf("%s clamp=%d: R=%lld\n", p.c.name, int(clamp), static_cast<long long>(p.R));
    std::mt19937_64 rng(401);
    const Fp8TokenRows dys(p, H, rng);
    const Fp8Weight w2(p.E, H, I, static_cast<int>(H), rng);  // a = W2^T dy sums over H
    std::vector<uint16_t> z = random_bf16(p.S * F, 1.0, rng);
    std::vector<float> topk_w(p.S);
    std::uniform_real_distribution<float> unit(0.05f, 1.0f);
    for (auto& v : topk_w) v = unit(rng);
    DeviceBuffer d_dev = DeviceBuffer::from(dys.q), ds_dev = DeviceBuffer::from(dys.s),
                 wt_dev = DeviceBuffer::from(w2.q_t), ws_dev = DeviceBuffer::from(w2.s), z_dev = DeviceBuffer::from(z),
                 tw_dev = DeviceBuffer::from(topk_w);
    DeviceBuffer dz_dev(p.S * F * 2), wh_dev(p.S * I * 2), part_dev(p.S * tiles * 4), dzq_dev(p.S * F),
        dzs_dev((F / 128) * p.rows_pad * 4);
    for (DeviceBuffer* b : {&dz_dev, &wh_dev, &part_dev, &dzq_dev, &dzs_dev}) b->poison();
    Sm90Fp8DgradSwigluParams a;
    a.rows = p.rows;
    a.dy_fp8 = d_dev.get();
    a.dy_scales = static_cast<const float*>(ds_dev.get());
    a.weights.w2_t = wt_dev.get();
    a.weights.w2_scales = static_cast<const float*>(ws_dev.get());
    a.z = z_dev.get();
    a.row_slot = p.row_slot_ptr();
    a.top_k = p.c.K;
    a.topk_weights = static_cast<const float*>(tw_dev.get());
    a.dz = dz_dev.get();
    a.wh = wh_dev.get();
    a.router_partials = static_cast<float*>(part_dev.get());
    a.dz_fp8 = dzq_dev.get();
    a.dz_scales = static_cast<float*>(dzs_dev.get());
    a.use_swiglu_clamp = clamp;
    a.swiglu_clamp = 0.75f;
    launch_sm90_fp8_dgrad_swiglu(a);
    TEST_CUDA(cudaDeviceSynchronize());

    std::vector<double> a_ref(p.R * I), dz_ref(p.R * F), wh_ref(p.R * I), part_ref(p.R * tiles, 0.0);
    for (int64_t r = 0; r < p.R; ++r) {
      const int64_t e = p.expert_of_row[r];
      const double w = topk_w[p.row_slot[r]];
      for (int64_t c = 0; c < I; ++c) {
        double acc = 0.0;
        for (int64_t n = 0; n < H; ++n) acc += dys.at(r, n) * w2.at(e, n, c);
        a_ref[r * I + c] = acc;
        double g = host::bf16_bits_to_float(z[r * F + c]), u = host::bf16_bits_to_float(z[r * F + I + c]);
        double g_pass = 1.0, u_pass = 1.0;
        if (clamp) {
          g_pass = g <= 0.75 ? 1.0 : 0.0;
          u_pass = (u >= -0.75 && u <= 0.75) ? 1.0 : 0.0;
          g = std::min(g, 0.75);
          u = std::min(std::max(u, -0.75), 0.75);
        }
        const double sg = 1.0 / (1.0 + std::exp(-g)), si = g * sg;
        const double hv = host::round_to_bf16(static_cast<float>(si * u));
        part_ref[r * tiles + c / kSm90Fp8DgradBlockN] += hv * acc;
        const double dh = w * acc;
        dz_ref[r * F + c] = dh * u * sg * (1.0 + g * (1.0 - sg)) * g_pass;
        dz_ref[r * F + I + c] = dh * si * u_pass;
        wh_ref[r * I + c] = w * hv;
      }
    }
    const std::vector<uint16_t> dz = dz_dev.to_host<uint16_t>(), wh = wh_dev.to_host<uint16_t>();
    const std::vector<float> part = part_dev.to_host<float>(), dzs = dzs_dev.to_host<float>();
    const std::vector<uint8_t> dzq = dzq_dev.to_host<uint8_t>();
    std::vector<double> part_got(p.R * tiles);
    for (int64_t i = 0; i < p.R * tiles; ++i) part_got[i] = part[i];
    expect_rows_close("dz (bf16)", p, widen_bf16_rows(dz, p.R, F), dz_ref, F, kTol);
    expect_rows_close("w h (bf16)", p, widen_bf16_rows(wh, p.R, I), wh_ref, I, kTol);
    expect_rows_close("router partials <h, a> per tile", p, part_got, part_ref, tiles, kTol);
    std::vector<float> dzs_want;
    const std::vector<double> dzq_want = host_quantized(dz_ref, p.R, F, &dzs_want);
    expect_rows_close("dz scales (1 x 128, per row)", p, block_major_to_rows(dzs, p.R, F / 128, p.rows_pad),
                      std::vector<double>(dzs_want.begin(), dzs_want.end()), F / 128, kTol);
    expect_rows_close("dz (dequantized E4M3)", p, dequantize_rows(dzq, dzs, p.R, F, p.rows_pad), dzq_want, F,
                      kQuantizedTol);
    expect_rows_untouched("dz_fp8", dzq, F, range(p.R, p.S));
  }
}

// ---------------------------------------------------------------------------- dgrad of x

TEST_P(Fp8Gemm, DgradScatterSlotRows) {
  const Rows p(GetParam(), 500);
  const int64_t H = p.c.H, F = 2 * p.c.I;
  std::mt19937_64 rng(501);
  const Fp8Pool dz(p.S, F, p.rows_pad, rng);
  const Fp8Weight w13(p.E, F, H, static_cast<int>(F), rng);  // dx = W13^T dz sums over 2I
  DeviceBuffer d_dev = DeviceBuffer::from(dz.q), ds_dev = DeviceBuffer::from(dz.s),
               wt_dev = DeviceBuffer::from(w13.q_t), ws_dev = DeviceBuffer::from(w13.s), dx_dev(p.S * H * 2);
  dx_dev.poison();
  Sm90Fp8DgradScatterParams a;
  a.rows = p.rows;
  a.dz_fp8 = d_dev.get();
  a.dz_scales = static_cast<const float*>(ds_dev.get());
  a.weights.w13_t = wt_dev.get();
  a.weights.w13_scales = static_cast<const float*>(ws_dev.get());
  a.row_slot = p.row_slot_ptr();
  a.dx_slots = dx_dev.get();
  launch_sm90_fp8_dgrad_scatter(a);
  TEST_CUDA(cudaDeviceSynchronize());
  const std::vector<uint16_t> dx = dx_dev.to_host<uint16_t>();
  std::vector<double> got(p.R * H), ref(p.R * H);
  for (int64_t r = 0; r < p.R; ++r) {
    const int64_t e = p.expert_of_row[r], s = p.row_slot[r];
    for (int64_t n = 0; n < H; ++n) {
      double acc = 0.0;
      for (int64_t f = 0; f < F; ++f) acc += dz.at(r, f) * w13.at(e, f, n);
      ref[r * H + n] = acc;
      got[r * H + n] = host::bf16_bits_to_float(dx[s * H + n]);
    }
  }
  std::printf("%s: R=%lld\n", p.c.name, static_cast<long long>(p.R));
  expect_rows_close("dx slot rows (by routed row)", p, got, ref, H, kTol);
  std::vector<uint8_t> bytes(dx.size() * 2);
  std::memcpy(bytes.data(), dx.data(), bytes.size());
  expect_rows_untouched("dx_slots", bytes, H * 2, unrouted_slots(p));
}

INSTANTIATE_TEST_SUITE_P(Shapes, Fp8Gemm, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<RowsCase>& info) { return std::string(info.param.name); });

// ------------------------------------------------------------------------- weight gradients

// The weight gradient from token-blocked pools built on the host ([P/128][rows][128]): expert e's rows at positions
// [pad[e], pad[e] + count_e) with random E4M3 codes, zeros up to pad[e+1], garbage codes and NaN
// scales past pad[E] (never read); A's scales 1 x 128 along the positions per row, B's 128 x 128.
// Against fp64 sums of the dequantized products; experts without rows zeroed (overwrite) or left
// bitwise as they were (accumulate); every other element poisoned first (overwrite) or random.
struct WeightGradCase {
  const char* name;
  std::vector<int32_t> counts;
  int64_t a_rows, a_row0, m, n;
  int num_sms = 0;
};

const WeightGradCase kWeightGradCases[] = {
    {"E6_M128_N256", {0, 1, 127, 128, 129, 300}, 128, 0, 128, 256},
    // N % 256 == 128 (the second half of the last tile is past N), and rows [128, 384) of a
    // 384-row A (dW3 reads dz's up half).
    {"E3_M256_N384_row0_128", {200, 0, 77}, 384, 128, 256, 384},
    // Each CTA crosses experts, empty ones among them, with the previous tile's output held.
    {"E5_M128_N512_on_2_sms", {129, 0, 300, 1, 0}, 128, 0, 128, 512, 2},
    // More K-blocks than the 4 stages: the ring is reused within a tile.
    {"E2_M128_N256_long", {1000, 513}, 128, 0, 128, 256},
    {"E3_all_empty", {0, 0, 0}, 128, 0, 128, 256},
};

class Fp8WeightGrad : public ::testing::TestWithParam<WeightGradCase> {};

TEST_P(Fp8WeightGrad, TokenBlockedPools) {
  const WeightGradCase& c = GetParam();
  const int64_t E = static_cast<int64_t>(c.counts.size()), M = c.m, N = c.n;
  std::vector<int32_t> pad(E + 1, 0);
  int64_t R = 0;
  for (int64_t e = 0; e < E; ++e) {
    pad[e + 1] = pad[e] + (c.counts[e] + 127) / 128 * 128;
    R += c.counts[e];
  }
  const int64_t P = (R + 127) / 128 * 128 + 128 * E, blocks = P / 128;
  std::mt19937_64 rng(2026 + E);
  // Codes ~ N(0, 64^2) with scales ~2^-7: values ~ N(0, 0.25).
  std::vector<uint8_t> a = random_codes(c.a_rows * P, rng), b = random_codes(N * P, rng);
  std::vector<float> sa = random_scales(blocks * c.a_rows, -7, rng), sb = random_scales(blocks * (N / 128), -7, rng);
  // Position p of row r in the token-blocked layout [P/128][rows][128].
  auto at = [](int64_t rows, int64_t r, int64_t p) { return ((p / 128) * rows + r) * 128 + p % 128; };
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t p = pad[e] + c.counts[e]; p < pad[e + 1]; ++p) {
      for (int64_t r = 0; r < c.a_rows; ++r) a[at(c.a_rows, r, p)] = 0;
      for (int64_t r = 0; r < N; ++r) b[at(N, r, p)] = 0;
    }
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t blk = pad[E] / 128; blk < blocks; ++blk) {
    for (int64_t r = 0; r < c.a_rows; ++r) sa[blk * c.a_rows + r] = nan;
    for (int64_t nb = 0; nb < N / 128; ++nb) sb[blk * (N / 128) + nb] = nan;
  }
  // fp64 reference [E, M, N].
  std::vector<double> ref(E * M * N, 0.0);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t m = 0; m < M; ++m) {
      const int64_t ar = c.a_row0 + m;
      for (int64_t n = 0; n < N; ++n) {
        double sum = 0.0;
        for (int64_t blk = pad[e] / 128; blk < pad[e + 1] / 128; ++blk) {
          double part = 0.0;
          for (int64_t p = blk * 128; p < blk * 128 + 128; ++p) {
            part += static_cast<double>(host::e4m3_bits_to_float(a[at(c.a_rows, ar, p)])) *
                    host::e4m3_bits_to_float(b[at(N, n, p)]);
          }
          sum += part * sa[blk * c.a_rows + ar] * sb[blk * (N / 128) + n / 128];
        }
        ref[(e * M + m) * N + n] = sum;
      }
    }
  }
  DeviceBuffer pad_dev = DeviceBuffer::from(pad), a_dev = DeviceBuffer::from(a), b_dev = DeviceBuffer::from(b);
  DeviceBuffer sa_dev = DeviceBuffer::from(sa), sb_dev = DeviceBuffer::from(sb);
  for (const bool bf16 : {false, true}) {
    for (const bool accumulate : {false, true}) {
      const std::string what = std::string(c.name) + (bf16 ? " bf16" : " fp32") + (accumulate ? " +=" : " =");
      const int64_t count = E * M * N;
      DeviceBuffer grad_dev(count * (bf16 ? 2 : 4));
      std::vector<double> init(count, 0.0);
      std::vector<uint8_t> init_bytes;
      if (accumulate) {
        std::normal_distribution<float> dist(0.0f, 1.0f);
        if (bf16) {
          std::vector<uint16_t> bits(count);
          for (int64_t i = 0; i < count; ++i) bits[i] = host::float_to_bf16_bits(dist(rng));
          for (int64_t i = 0; i < count; ++i) init[i] = host::bf16_bits_to_float(bits[i]);
          grad_dev = DeviceBuffer::from(bits);
        } else {
          std::vector<float> vals(count);
          for (int64_t i = 0; i < count; ++i) init[i] = vals[i] = dist(rng);
          grad_dev = DeviceBuffer::from(vals);
        }
        init_bytes = grad_dev.to_host<uint8_t>();
      } else {
        grad_dev.poison();
      }
      Sm90Fp8WeightGradParams w;
      w.rows.expert_offsets = static_cast<const int32_t*>(pad_dev.get());
      w.rows.max_rows = P;
      w.rows.num_experts = E;
      w.rows.num_sms = c.num_sms;
      w.a = a_dev.get();
      w.a_scales = static_cast<const float*>(sa_dev.get());
      w.a_rows = c.a_rows;
      w.a_row0 = c.a_row0;
      w.b = b_dev.get();
      w.b_scales = static_cast<const float*>(sb_dev.get());
      w.grad = grad_dev.get();
      w.m = M;
      w.n = N;
      w.bf16_grad = bf16;
      w.accumulate = accumulate;
      launch_sm90_fp8_weight_grad(w);
      TEST_CUDA(cudaDeviceSynchronize());
      std::vector<double> got(count), want(count);
      if (bf16) {
        const std::vector<uint16_t> g = grad_dev.to_host<uint16_t>();
        for (int64_t i = 0; i < count; ++i) got[i] = host::bf16_bits_to_float(g[i]);
      } else {
        const std::vector<float> g = grad_dev.to_host<float>();
        for (int64_t i = 0; i < count; ++i) got[i] = g[i];
      }
      for (int64_t i = 0; i < count; ++i) want[i] = init[i] + ref[i];
      const ErrorStats stats = compare(got, want);
      std::printf("  %-40s rel_l2 %.3e  max_abs %.3e\n", what.c_str(), stats.rel_l2, stats.max_abs);
      EXPECT_LE(stats.rel_l2, kTol) << what << (stats.all_finite ? "" : " (non-finite values)");
      // Experts without rows: zeros, or the old bytes.
      const std::vector<uint8_t> bytes = grad_dev.to_host<uint8_t>();
      const int64_t expert_bytes = M * N * (bf16 ? 2 : 4);
      for (int64_t e = 0; e < E; ++e) {
        if (c.counts[e] != 0) continue;
        int64_t bad = 0;
        for (int64_t i = e * expert_bytes; i < (e + 1) * expert_bytes; ++i) {
          bad += bytes[i] != (accumulate ? init_bytes[i] : 0);
        }
        EXPECT_EQ(bad, 0) << what << ": expert " << e << " (no rows) has " << bad << " bytes changed or not zeroed";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Fp8WeightGrad, ::testing::ValuesIn(kWeightGradCases),
                         [](const ::testing::TestParamInfo<WeightGradCase>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace fusemoe::test

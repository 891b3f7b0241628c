/* The 8-bit KV formats (base/kvq.h): fp8 held to an independent definition of OCP e4m3, int8 to
 * plain integer rounding, their row quantization's edge cases, the CPU pools that store what the
 * codes read back, and the dtypes' names and pool sizes. The CUDA kernels are held to these functions in tests/gpu_decode_attn.cpp
 * and tests/gpu_attention.cpp. */
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attention/attention.h"
#include "base/kvq.h"
#include "base/kvrot.h"
#include "lfserve.h"
#include "memory/pool.h"
#include "tests/test_util.h"

namespace {

/* e4m3 from its definition, not from the encoder's bit manipulation: sign, 4 exponent bits
 * (bias 7), 3 mantissa bits; exponent 0 is subnormal (m * 2^-9); 0x7f / 0xff are NaN. */
double e4m3_ref(int c) {
  const int e = (c >> 3) & 15, m = c & 7;
  if (e == 15 && m == 7) return std::nan("");
  const double v = e == 0 ? m * std::ldexp(1.0, -9) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
  return (c & 0x80) ? -v : v;
}

/* The nearest code to x by brute force over the 127 non-negative finite codes: ties to the
 * even code, magnitudes past 448 to 448. */
int nearest_ref(float x) {
  if (std::isnan(x)) return 0x7f;
  const double a = std::fabs((double)x);
  int best = 0;
  double bd = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7e; c++) {
    const double d = std::fabs(e4m3_ref(c) - a);
    if (d < bd || (d == bd && (c & 1) == 0)) {
      bd = d;
      best = c;
    }
  }
  return (std::signbit(x) ? 0x80 : 0) | best;
}

TEST(Fp8Format, DecodesEveryCodeAsDefined) {
  for (int c = 0; c < 256; c++) {
    const double want = e4m3_ref(c);
    const float got = lf_fp8_to_f32((uint8_t)c);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      continue;
    }
    EXPECT_EQ((double)got, want) << "code " << c;
    EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << "code " << c;
  }
  EXPECT_EQ(lf_fp8_to_f32(0x7e), 448.0f);
  EXPECT_EQ(lf_fp8_to_f32(0x38), 1.0f);
  EXPECT_EQ(lf_fp8_to_f32(0x01), std::ldexp(1.0f, -9));
}

TEST(Fp8Format, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; c++) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(lf_fp8_from_f32(lf_fp8_to_f32((uint8_t)c)), c) << "code " << c;
  }
}

/* Every midpoint between neighbouring codes (the ties), one float either side of it, and random
 * values over the whole range, against the brute-force nearest code. */
TEST(Fp8Format, RoundsToNearestEvenAsBruteForce) {
  std::vector<float> xs;
  for (int c = 0; c < 0x7e; c++) {
    const float mid = (float)((e4m3_ref(c) + e4m3_ref(c + 1)) / 2); /* exact in fp32 */
    xs.push_back(mid);
    xs.push_back(std::nextafter(mid, 0.0f));
    xs.push_back(std::nextafter(mid, 1e9f));
  }
  std::mt19937_64 r(lf_test_seed_for("Fp8Format.RoundsToNearestEvenAsBruteForce"));
  std::uniform_real_distribution<float> ex(-14.0f, 10.0f);
  for (int i = 0; i < 20000; i++) xs.push_back(std::exp2(ex(r)));
  const float tiny[] = {0.0f, 1e-45f, 1e-38f, std::ldexp(1.0f, -10), 3 * std::ldexp(1.0f, -11),
                        448.0f, 449.0f, 463.99f, 464.0f, 480.0f, 1e6f, 3.4e38f,
                        std::numeric_limits<float>::infinity()};
  xs.insert(xs.end(), std::begin(tiny), std::end(tiny));
  for (float x : xs)
    for (float s : {1.0f, -1.0f}) {
      const float v = s * x;
      ASSERT_EQ(lf_fp8_from_f32(v), nearest_ref(v)) << "x = " << v;
    }
  EXPECT_EQ(lf_fp8_from_f32(std::nanf("")), 0x7f);
  EXPECT_EQ(lf_fp8_from_f32(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(lf_fp8_from_f32(std::ldexp(1.0f, -10)), 0x00); /* half of the smallest: to even 0 */
  EXPECT_EQ(lf_fp8_from_f32(3 * std::ldexp(1.0f, -10)), 0x02); /* 1.5 ulp: to even 2 */
}

/* Per row: the largest magnitude maps to 448, the rest within half a step of their code. */
void expect_row_close(const std::vector<float> &x) {
  std::vector<uint8_t> c(x.size());
  const float sc = lf_kvq_quantize_row(LF_KVQ_FP8, x.data(), (int)x.size(), c.data());
  float amax = 0.0f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  ASSERT_EQ(sc, amax / 448.0f);
  for (size_t i = 0; i < x.size(); i++) {
    const float back = lf_fp8_value(c[i], sc);
    /* normal codes: relative 2^-4; subnormal codes: half their step, 2^-10 of the scale; plus
     * the fp32 rounding of x / scale and of the product */
    const double tol = std::max(std::fabs((double)x[i]) * 0.0625, std::ldexp((double)sc, -10)) +
                       4e-7 * std::fabs((double)x[i]);
    EXPECT_LE(std::fabs((double)back - x[i]), tol) << "elem " << i << " of " << x.size();
    if (std::fabs(x[i]) == amax) {
      EXPECT_EQ(c[i] & 0x7f, 0x7e) << "amax elem " << i;
    }
  }
}

TEST(Fp8Row, ZerosConstantsOutliersAndTinyRows) {
  std::vector<uint8_t> c(8);
  const std::vector<float> z = {0.0f, -0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  EXPECT_EQ(lf_kvq_quantize_row(LF_KVQ_FP8, z.data(), 8, c.data()), 0.0f);
  EXPECT_EQ(c[0], 0x00);
  EXPECT_EQ(c[1], 0x80);
  EXPECT_EQ(lf_fp8_value(c[1], 0.0f), 0.0f);
  expect_row_close(std::vector<float>(64, 3.7f));
  expect_row_close(std::vector<float>(64, -0.001f));
  std::vector<float> out(128, 0.01f);
  out[17] = -1000.0f; /* one outlier: the rest fall to subnormal codes or zero */
  expect_row_close(out);
  std::mt19937_64 r(lf_test_seed_for("Fp8Row.ZerosConstantsOutliersAndTinyRows"));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float mag : {1e-30f, 1e-3f, 1.0f, 50.0f, 1e20f}) {
    std::vector<float> x(128);
    for (auto &v : x) v = mag * nd(r);
    expect_row_close(x);
  }
}

TEST(Fp8Row, NonFiniteRowsReadBackAsNaN) {
  for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> x(16, 1.0f);
    x[5] = bad;
    std::vector<uint8_t> c(16);
    const float sc = lf_kvq_quantize_row(LF_KVQ_FP8, x.data(), 16, c.data());
    EXPECT_TRUE(std::isnan(sc));
    for (int i = 0; i < 16; i++) {
      EXPECT_EQ(c[i], LF_FP8_NAN);
      EXPECT_TRUE(std::isnan(lf_fp8_value(c[i], sc)));
    }
  }
}

/* int8: every code in [-127, 127] is the nearest integer to x / scale (ties to even), the row's
 * largest magnitude is +-127, and values read back within half a step. */
TEST(Int8Row, RoundsToNearestEvenWithinHalfAStep) {
  std::mt19937_64 r(lf_test_seed_for("Int8Row.RoundsToNearestEvenWithinHalfAStep"));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float mag : {1e-30f, 1e-3f, 1.0f, 50.0f, 1e20f})
    for (int rep = 0; rep < 20; rep++) {
      std::vector<float> x(128);
      for (auto &v : x) v = mag * nd(r);
      x[rep] = 0.0f;
      std::vector<uint8_t> c(x.size());
      const float sc = lf_kvq_quantize_row(LF_KVQ_INT8, x.data(), 128, c.data());
      float amax = 0.0f;
      for (float v : x) amax = std::max(amax, std::fabs(v));
      ASSERT_EQ(sc, amax / 127.0f);
      for (size_t i = 0; i < x.size(); i++) {
        const int code = int8_t(c[i]);
        ASSERT_GE(code, -127);
        const double want = std::nearbyint(double(x[i] / sc)); /* fp32 quotient, then RNE */
        ASSERT_EQ(code, int(std::max(-127.0, std::min(127.0, want)))) << "x " << x[i];
        EXPECT_LE(std::fabs(double(lf_i8_value(c[i], sc)) - x[i]),
                  0.5 * sc + 1e-6 * std::fabs(x[i]));
        if (std::fabs(x[i]) == amax) {
          EXPECT_EQ(std::abs(code), 127);
        }
      }
    }
  EXPECT_EQ(int8_t(lf_i8_code(2.5f, 1.0f)), 2); /* ties to even */
  EXPECT_EQ(int8_t(lf_i8_code(-3.5f, 1.0f)), -4);
  EXPECT_EQ(int8_t(lf_i8_code(1000.0f, 1.0f)), 127); /* saturates */
  EXPECT_EQ(int8_t(lf_i8_code(-1000.0f, 1.0f)), -127);
  std::vector<float> z(16, 0.0f), bad(16, 1.0f);
  std::vector<uint8_t> c(16);
  EXPECT_EQ(lf_kvq_quantize_row(LF_KVQ_INT8, z.data(), 16, c.data()), 0.0f);
  for (uint8_t b : c) EXPECT_EQ(b, 0);
  bad[3] = std::numeric_limits<float>::infinity();
  const float sc = lf_kvq_quantize_row(LF_KVQ_INT8, bad.data(), 16, c.data());
  EXPECT_TRUE(std::isnan(sc));
  for (uint8_t b : c) EXPECT_TRUE(std::isnan(lf_i8_value(b, sc)));
}

/* The bf16 neighbours int4's scales round to, against brute force over the bf16 grid. */
TEST(Int4Format, Bf16DownAndUpAreTheNeighbours) {
  std::mt19937_64 r(lf_test_seed_for("Int4Format.Bf16DownAndUpAreTheNeighbours"));
  auto bf = [](uint32_t hi) { return lf_kvq_bits_f32(hi << 16); };
  for (int i = 0; i < 200000; i++) {
    uint32_t u = (uint32_t)r();
    if ((u & 0x7f800000u) == 0x7f800000u) continue; /* finite only */
    const float x = lf_kvq_bits_f32(u);
    const float dn = lf_kvq_bf16_down(x), up = lf_kvq_bf16_up(x);
    ASSERT_EQ(lf_kvq_f32_bits(dn) & 0xffffu, 0u);
    ASSERT_EQ(lf_kvq_f32_bits(up) & 0xffffu, 0u);
    ASSERT_LE(dn, x);
    ASSERT_GE(up, x);
    if ((u & 0xffffu) == 0) {
      ASSERT_EQ(dn, x);
      ASSERT_EQ(up, x);
    } else { /* the two bf16 around x are adjacent: x's truncation and one step out */
      const uint32_t t = u >> 16;
      const float a = bf(t), b = bf(t + 1); /* same sign, magnitudes |a| < |x| < |b| */
      ASSERT_EQ(x < 0 ? dn : up, b) << x;
      ASSERT_EQ(x < 0 ? up : dn, a) << x;
    }
  }
  EXPECT_TRUE(std::isinf(lf_kvq_bf16_up(3.4e38f)));
  EXPECT_TRUE(std::isinf(lf_kvq_bf16_down(-3.4e38f)));
}

/* Every value of a group reads back within half a step of itself, through the code brute force
 * picks as nearest (ties to even), and the group's floor and top cover its range. */
TEST(Int4Format, GroupsRoundToTheNearestLevel) {
  std::mt19937_64 r(lf_test_seed_for("Int4Format.GroupsRoundToTheNearestLevel"));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(64);
  std::vector<uint32_t> w(8), m(2);
  for (int it = 0; it < 3000; it++) {
    const float scale = std::ldexp(1.0f, (int)(r() % 60) - 30), shift = (it % 3) * 5.0f * scale;
    for (auto &v : x) v = nd(r) * scale + shift;
    if (it % 7 == 0) x[r() % 64] *= 40.0f; /* an outlier */
    lf_i4_quantize_row(x.data(), 64, w.data(), m.data());
    for (int g = 0; g < 2; g++) {
      const float s = lf_i4_meta_s(m[g]), mm = lf_i4_meta_m(m[g]);
      float mn = x[32 * g], mx = x[32 * g];
      for (int i = 0; i < 32; i++) {
        mn = std::min(mn, x[32 * g + i]);
        mx = std::max(mx, x[32 * g + i]);
      }
      ASSERT_LE(mm, mn);
      ASSERT_GE((double)mm + 15.0 * s, (double)mx * (1 - 1e-6) - 1e-30);
      for (int i = 0; i < 32; i++) {
        const int d = 32 * g + i;
        const int c = lf_i4_get(w.data(), d);
        /* brute force: the code whose exact level s * c + m is nearest, ties to even */
        double best = 1e300;
        int bc = -1;
        for (int k = 0; k < 16; k++) {
          const double e = std::fabs((double)x[d] - ((double)s * k + mm));
          if (e < best || (e == best && (k & 1) == 0)) {
            best = e;
            bc = k;
          }
        }
        const double t = ((double)x[d] - mm) / s; /* fp32 division can move a near tie */
        if (std::fabs(t - std::floor(t) - 0.5) > 1e-4) {
          ASSERT_EQ(c, bc) << "dim " << d;
        }
        ASSERT_LE(std::fabs((double)lf_i4_value((uint8_t)c, m[g]) - x[d]), 0.5 * s * 1.0001 + 1e-30)
            << "dim " << d;
      }
    }
  }
}

/* The key rotation (base/kvrot.h): on small integers every butterfly and the power-of-two
 * scales are exact, so a rotated query times a rotated key is q . k exactly, and rotating a row
 * as a key and then as a query gives the row back (H H = block I, scales 1 / block): the
 * transform is orthogonal up to its exact scale for every head_dim, blocks of 8 to 128. */
TEST(KeyRotation, KeepsDotProductsExactly) {
  std::mt19937_64 r(lf_test_seed_for("KeyRotation.KeepsDotProductsExactly"));
  for (int D : {8, 32, 64, 72, 96, 128, 256}) {
    SCOPED_TRACE("head_dim " + std::to_string(D));
    const int block = lf_rot_block(D);
    EXPECT_EQ(block, std::min(D & -D, 128));
    EXPECT_EQ(lf_rot_scale(block, 0) * lf_rot_scale(block, 1), 1.0f / (float)block);
    for (int it = 0; it < 200; it++) {
      std::vector<float> q(D), k(D), qr, kr, back;
      for (int d = 0; d < D; d++) {
        q[d] = (float)((int)(r() % 17) - 8);
        k[d] = (float)((int)(r() % 17) - 8);
      }
      qr = q;
      kr = k;
      lf_rot_row(qr.data(), D, 1);
      lf_rot_row(kr.data(), D, 0);
      double dot = 0, dotr = 0;
      for (int d = 0; d < D; d++) {
        dot += (double)q[d] * k[d];
        dotr += (double)qr[d] * kr[d];
      }
      ASSERT_EQ(dotr, dot);
      back = kr;
      lf_rot_row(back.data(), D, 1);
      for (int d = 0; d < D; d++) ASSERT_EQ(back[d], k[d]) << "dim " << d;
    }
  }
}

/* Summed squared errors of q . k, {plain, rotated}, over n draws of a 64-dim key with two large
 * channels (5 and 40, the first offset), as real models' keys have, and a query that is N(0, 1)
 * except on those channels, where it is q_share times the key's gain (0: N(0, 1) there too).
 * read_back(k, out) quantizes the key row k and writes the values its codes read back. */
template <typename ReadBack>
std::pair<double, double> outlier_dot_errors(std::mt19937_64 &r, int n, float q_share,
                                             ReadBack read_back) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int D = 64;
  std::vector<float> gain(D, 1.0f);
  gain[5] = 12.0f;
  gain[40] = -8.0f;
  double err[2] = {0, 0};
  std::vector<float> back(D);
  for (int it = 0; it < n; it++) {
    std::vector<float> q(D), k(D);
    for (int d = 0; d < D; d++) {
      q[d] = (q_share > 0.0f && (d == 5 || d == 40) ? q_share * gain[d] : 1.0f) * nd(r);
      k[d] = gain[d] * nd(r) + (d == 5 ? 6.0f : 0.0f);
    }
    double exact = 0;
    for (int d = 0; d < D; d++) exact += (double)q[d] * k[d];
    for (int rot = 0; rot < 2; rot++) {
      std::vector<float> qq = q, kk = k;
      if (rot) {
        lf_rot_row(qq.data(), D, 1);
        lf_rot_row(kk.data(), D, 0);
      }
      read_back(kk.data(), back.data());
      double got = 0;
      for (int d = 0; d < D; d++) got += (double)qq[d] * back[size_t(d)];
      err[rot] += (got - exact) * (got - exact);
    }
  }
  return {err[0], err[1]};
}

/* Why int4 pools rotate: keys with a few large channels (as real models' keys have) lose most of
 * their q . k to int4 groups, since each group's step is set by its largest value; rotated, the
 * channels spread over the block and the same codes carry about half the error or less. */
TEST(KeyRotation, HalvesInt4ErrorOnOutlierChannels) {
  std::mt19937_64 r(lf_test_seed_for("KeyRotation.HalvesInt4ErrorOnOutlierChannels"));
  std::vector<uint32_t> w(64 / 8), m(64 / 32);
  const auto read_back = [&](const float *k, float *out) {
    lf_i4_quantize_row(k, 64, w.data(), m.data());
    for (int d = 0; d < 64; d++) out[d] = lf_i4_value((uint8_t)lf_i4_get(w.data(), d), m[d / 32]);
  };
  const auto [err_plain, err_rot] = outlier_dot_errors(r, 2000, 0.0f, read_back);
  EXPECT_LT(err_rot, 0.5 * err_plain) << "rms error of q.k: rotated " << std::sqrt(err_rot / 2000)
                                      << ", plain " << std::sqrt(err_plain / 2000);
}

/* Why 8-bit pools rotate too: where a query and a key share large channels (the few channels that
 * dominate q . k in real models' attention), an 8-bit row's error on those channels is most of the
 * product's; spread over the block, the same bytes carry less of it: int8's step follows the row's
 * largest value, which the rotation shrinks (0.35-0.37 of the plain rms error over 20000 draws,
 * bound 0.45), while fp8's error follows each value's own size, so it gains less (0.77-0.82,
 * bound 0.9; on SmolLM2 both gain, DESIGN §3). Unrotated, both ratios are 1. */
TEST(KeyRotation, CutsEightBitErrorOnSharedOutlierChannels) {
  std::mt19937_64 r(lf_test_seed_for("KeyRotation.CutsEightBitErrorOnSharedOutlierChannels"));
  for (int dt : {int(LF_KV_FP8), int(LF_KV_INT8)}) {
    std::vector<uint8_t> codes(64);
    const auto read_back = [&](const float *k, float *out) {
      const float sc = lf_kvq_quantize_row(dt, k, 64, codes.data());
      for (int d = 0; d < 64; d++) out[d] = lf_kvq_value(dt, codes[size_t(d)], sc);
    };
    const auto [err_plain, err_rot] = outlier_dot_errors(r, 20000, 0.5f, read_back);
    const double bound = dt == LF_KV_FP8 ? 0.9 : 0.45; /* of the plain rms error */
    std::printf("[ rotation ] %s: rms error of q.k rotated / plain %.3f\n",
                lf_kv_dtype_str(lf_kv_dtype(dt)), std::sqrt(err_rot / err_plain));
    EXPECT_LT(err_rot, bound * bound * err_plain)
        << lf_kv_dtype_str(lf_kv_dtype(dt)) << ": rms error of q.k: rotated "
        << std::sqrt(err_rot / 20000) << ", plain " << std::sqrt(err_plain / 20000);
  }
}

/* Which pool dtypes store rotated keys: int4, fp8 and int8, not k8v4 (docs/DESIGN.md §3). */
TEST(KeyRotation, QuantizedPoolsRotate) {
  EXPECT_TRUE(lf_kv_rotates(LF_KV_INT4));
  EXPECT_TRUE(lf_kv_rotates(LF_KV_FP8));
  EXPECT_TRUE(lf_kv_rotates(LF_KV_INT8));
  EXPECT_FALSE(lf_kv_rotates(LF_KV_BF16));
}

/* The nibble order: 8 distinct positions per word, dims 2k and 2k + 1 16 bits apart. */
TEST(Int4Format, NibbleLayout) {
  uint32_t seen = 0;
  for (int e = 0; e < 8; e++) {
    const int sh = lf_i4_nibble_shift(e);
    EXPECT_EQ(sh % 4, 0);
    seen |= 0xfu << sh;
    if (e % 2 == 0) {
      EXPECT_EQ(lf_i4_nibble_shift(e + 1), sh + 16);
    }
    EXPECT_EQ(lf_i4_nibble_shift(e + 8), sh); /* per word */
  }
  EXPECT_EQ(seen, 0xffffffffu);
  std::vector<float> x(32);
  for (int i = 0; i < 32; i++) x[i] = (float)(i % 16); /* min 0, max 15: step 1, codes = x */
  std::vector<uint32_t> w(4), m(1);
  lf_i4_quantize_row(x.data(), 32, w.data(), m.data());
  EXPECT_EQ(lf_i4_meta_s(m[0]), 1.0f);
  EXPECT_EQ(lf_i4_meta_m(m[0]), 0.0f);
  for (int i = 0; i < 32; i++) EXPECT_EQ(lf_i4_get(w.data(), i), i % 16);
  /* word 0 holds dims 0..7 = codes 0..7: pairs (0,1) (2,3) (4,5) (6,7) at nibbles 0/4, 1/5, ... */
  EXPECT_EQ(w[0], 0x75316420u);
}

/* Zeros, constants (exact when the constant is a bf16), tiny and huge groups, and a non-finite
 * value poisoning only its own group. */
TEST(Int4Format, EdgeGroups) {
  std::vector<float> x(64, 0.0f);
  std::vector<uint32_t> w(8), m(2);
  lf_i4_quantize_row(x.data(), 64, w.data(), m.data());
  for (int d = 0; d < 64; d++) EXPECT_EQ(lf_i4_value(lf_i4_get(w.data(), d), m[d / 32]), 0.0f);
  for (int d = 0; d < 64; d++) x[d] = d < 32 ? 1.5f : -3.0f; /* bf16 constants: exact */
  lf_i4_quantize_row(x.data(), 64, w.data(), m.data());
  for (int d = 0; d < 64; d++) EXPECT_EQ(lf_i4_value(lf_i4_get(w.data(), d), m[d / 32]), x[d]);
  for (int d = 0; d < 64; d++) x[d] = 1.2345678f; /* not a bf16: within half a (tiny) step */
  lf_i4_quantize_row(x.data(), 64, w.data(), m.data());
  for (int d = 0; d < 64; d++)
    EXPECT_NEAR(lf_i4_value(lf_i4_get(w.data(), d), m[d / 32]), x[d], 1e-3f);
  for (int d = 0; d < 64; d++) x[d] = (d % 2 ? 1e-38f : -1e-38f) * (float)(d % 5);
  lf_i4_quantize_row(x.data(), 64, w.data(), m.data());
  for (int d = 0; d < 64; d++) {
    const float v = lf_i4_value(lf_i4_get(w.data(), d), m[d / 32]);
    EXPECT_TRUE(std::isfinite(v));
    EXPECT_NEAR(v, x[d], 1e-38f);
  }
  for (int d = 0; d < 64; d++) x[d] = (d % 2 ? 1e30f : -1e30f);
  lf_i4_quantize_row(x.data(), 64, w.data(), m.data());
  for (int d = 0; d < 64; d++)
    EXPECT_NEAR(lf_i4_value(lf_i4_get(w.data(), d), m[d / 32]) / x[d], 1.0, 0.02);
  for (int d = 0; d < 64; d++) x[d] = (float)d;
  x[40] = std::numeric_limits<float>::quiet_NaN();
  lf_i4_quantize_row(x.data(), 64, w.data(), m.data());
  for (int d = 0; d < 64; d++) {
    const float v = lf_i4_value(lf_i4_get(w.data(), d), m[d / 32]);
    if (d < 32) {
      EXPECT_NEAR(v, x[d], 0.5f * 31.0f / 15.0f * 1.01f);
    } else {
      EXPECT_TRUE(std::isnan(v));
    }
  }
  x[40] = -std::numeric_limits<float>::infinity();
  lf_i4_quantize_row(x.data(), 64, w.data(), m.data());
  EXPECT_TRUE(std::isnan(lf_i4_value(lf_i4_get(w.data(), 33), m[1])));
}

/* The CPU pools under fp8: every written row (decode write and prefill append, SnapKV's kept
 * tokens) holds exactly what its codes read back, and ||v||_1 is that of the stored values. */
class QuantPool : public ::testing::TestWithParam<int> {};

TEST_P(QuantPool, CpuPoolsStoreWhatTheCodesReadBack) {
  const int D = 32, G = 2, B = 12, kvd = GetParam();
  lf_pool_shape ps{1, 1, 1, B, D, kvd, 0, nullptr};
  lf_kv_arena a;
  ASSERT_EQ(lf_kv_arena_init(&a, &ps), LF_OK);
  std::mt19937_64 r(lf_test_seed_for("QuantPool.CpuPoolsStoreWhatTheCodesReadBack"));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  lf_attn_params p{};
  p.policy = LF_POLICY_LONGFLOW;
  p.sink = 2;
  p.window = 3;
  p.group = G;
  p.head_dim = D;
  p.scale = 0.25f;
  int pool = -1;
  ASSERT_EQ(lf_kv_arena_take(&a, &pool), LF_OK);
  lf_kv_head h = lf_kv_arena_head(&a, pool, 0, 0);
  EXPECT_EQ(h.kv_dtype, kvd);
  /* a 20-token prompt (compressed into 11 slots), then 15 decode steps that evict */
  const int T = 20;
  std::vector<float> q((size_t)T * G * D), k((size_t)T * D), v((size_t)T * D), o(q.size());
  for (auto &x : q) x = nd(r);
  for (auto &x : k) x = 3.0f * nd(r);
  for (auto &x : v) x = nd(r);
  ASSERT_EQ(lf_attn_prefill_ref(&p, &h, T, 0, q.data(), (size_t)G * D, k.data(), v.data(), D,
                                o.data(), (size_t)G * D, nullptr),
            LF_OK);
  auto check_slot = [&](int slot, const float *kx, const float *vx) {
    std::vector<uint32_t> c(D), m(D); /* words: code bytes and meta words, 4-byte aligned */
    uint8_t *cb = (uint8_t *)c.data();
    const int kf = lf_kvq_k_row(kvd), vf = lf_kvq_v_row(kvd); /* k8v4: int8 K, int4 V */
    lf_kvq_encode_row(kf, kx, D, cb, m.data());
    double l1 = 0.0;
    for (int d = 0; d < D; d++)
      ASSERT_EQ(h.k[(size_t)slot * D + d], lf_kvq_row_value(kf, cb, m.data(), d))
          << "k slot " << slot;
    lf_kvq_encode_row(vf, vx, D, cb, m.data());
    for (int d = 0; d < D; d++) {
      ASSERT_EQ(h.v[(size_t)slot * D + d], lf_kvq_row_value(vf, cb, m.data(), d))
          << "v slot " << slot;
      l1 += std::fabs((double)h.v[(size_t)slot * D + d]);
    }
    EXPECT_EQ(h.vnorm[slot], (float)l1);
  };
  for (int i = 0; i < *h.n; i++) {
    const int t = h.pos[i];
    check_slot(i, &k[(size_t)t * D], &v[(size_t)t * D]);
  }
  for (int step = 0; step < 15; step++) {
    std::vector<float> qn((size_t)G * D), kn(D), vn(D), on((size_t)G * D);
    for (auto &x : qn) x = nd(r);
    for (auto &x : kn) x = nd(r);
    for (auto &x : vn) x = 0.1f * nd(r);
    const int w = lf_kv_write_slot(&h);
    ASSERT_EQ(lf_attn_decode_ref(&p, &h, qn.data(), kn.data(), vn.data(), T + step, on.data(),
                                 nullptr, nullptr),
              LF_OK);
    check_slot(w, kn.data(), vn.data());
  }
  lf_kv_arena_free(&a);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, QuantPool,
                         ::testing::Values(int(LF_KV_FP8), int(LF_KV_INT8), int(LF_KV_INT4),
                                           int(LF_KV_K8V4)),
                         [](const ::testing::TestParamInfo<int> &i) {
                           return std::string(lf_kv_dtype_str(lf_kv_dtype(i.param)));
                         });

TEST(Fp8Pool, DeviceBytesCountCodesAndScales) {
  lf_pool_shape s{3, 2, 4, 16, 8, LF_KV_FP8, 0, nullptr};
  const uint64_t slots = 2ull * 4 * 16, heads = 2ull * 4;
  EXPECT_EQ(lf_pool_bytes_device(&s, 0), slots * (2 * (8 + 4) + 4 + 4) + heads * 2 * 4);
  EXPECT_EQ(lf_pool_bytes_device(&s, 1), slots * (2 * (8 + 4) + 4 + 4 + 4) + heads * 2 * 4);
  /* head_dim 128: 264 bytes of K/V a slot against bf16's 512 */
  lf_pool_shape b{1, 1, 1, 1, 128, LF_KV_BF16, 0, nullptr}, f = b;
  f.kv_dtype = LF_KV_FP8;
  EXPECT_EQ(lf_pool_bytes_device(&b, 0) - lf_pool_bytes_device(&f, 0), 512u - 264u);
  lf_pool_shape i8 = f;
  i8.kv_dtype = LF_KV_INT8;
  EXPECT_EQ(lf_pool_bytes_device(&i8, 0), lf_pool_bytes_device(&f, 0));
  /* int4: head_dim / 2 bytes of codes and a 4-byte (step, floor) per 32 dims, K and V: 160
   * bytes a slot at head_dim 128, 80 at 64 (0.3125 of bf16's) */
  lf_pool_shape i4 = f;
  i4.kv_dtype = LF_KV_INT4;
  EXPECT_EQ(lf_pool_bytes_device(&f, 0) - lf_pool_bytes_device(&i4, 0), 264u - 160u);
  i4.head_dim = 64;
  EXPECT_EQ(lf_pool_bytes_device(&i4, 0), 2u * (32 + 2 * 4) + 4 + 4 + 2 * 4);
  i4.head_dim = 48; /* not whole groups */
  EXPECT_EQ(lf_pool_bytes_device(&i4, 0), 0u);
  /* k8v4: an int8 K row (64 + 4 bytes) and an int4 V row (32 + 2 * 4) at head_dim 64: 108
   * bytes of K/V a slot, 0.42 of bf16's 256; its V rows need whole groups too */
  lf_pool_shape m = i4;
  m.kv_dtype = LF_KV_K8V4;
  m.head_dim = 64;
  EXPECT_EQ(lf_pool_bytes_device(&m, 0), (64u + 4) + (32u + 2 * 4) + 4 + 4 + 2 * 4);
  m.head_dim = 48;
  EXPECT_EQ(lf_pool_bytes_device(&m, 0), 0u);
  s.kv_dtype = 7;
  EXPECT_EQ(lf_pool_bytes_device(&s, 0), 0u);
  /* rkv (stage 5): the accumulators, and per head a queue of 5 slots and its step count */
  lf_pool_shape r{3, 2, 4, 16, 8, LF_KV_FP8, 5, nullptr};
  EXPECT_EQ(lf_pool_bytes_device(&r, 1), slots * (2 * (8 + 4) + 4 + 4 + 4) + heads * (2 + 5 + 1) * 4);
}

/* int4 rows need whole groups of 32 dims: any other head_dim is refused with a clear error. */
TEST(Int4Pool, ArenaRefusesPartialGroups) {
  lf_pool_shape ps{1, 1, 1, 4, 48, LF_KV_INT4, 0, nullptr};
  lf_kv_arena a;
  EXPECT_EQ(lf_kv_arena_init(&a, &ps), LF_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(lf_last_error()).find("multiple of 32"), std::string::npos)
      << lf_last_error();
  ps.head_dim = 64;
  ASSERT_EQ(lf_kv_arena_init(&a, &ps), LF_OK);
  lf_kv_arena_free(&a);
}

TEST(KvDtype, NamesAndParse) {
  lf_kv_dtype d = LF_KV_BF16;
  EXPECT_EQ(lf_kv_dtype_parse("fp8", &d), LF_OK);
  EXPECT_EQ(d, LF_KV_FP8);
  EXPECT_EQ(lf_kv_dtype_parse("bf16", &d), LF_OK);
  EXPECT_EQ(d, LF_KV_BF16);
  EXPECT_STREQ(lf_kv_dtype_str(LF_KV_FP8), "fp8");
  EXPECT_EQ(lf_kv_dtype_parse("int8", &d), LF_OK);
  EXPECT_EQ(d, LF_KV_INT8);
  EXPECT_EQ(lf_kv_dtype_parse("int4", &d), LF_OK);
  EXPECT_EQ(d, LF_KV_INT4);
  EXPECT_STREQ(lf_kv_dtype_str(LF_KV_INT4), "int4");
  EXPECT_EQ(lf_kv_dtype_parse("k8v4", &d), LF_OK);
  EXPECT_EQ(d, LF_KV_K8V4);
  EXPECT_STREQ(lf_kv_dtype_str(LF_KV_K8V4), "k8v4");
  EXPECT_FALSE(lf_kv_rotates(LF_KV_K8V4)); /* its error is its int4 values' (DESIGN §3) */
  EXPECT_EQ(lf_kv_dtype_parse("int3", &d), LF_ERR_INVALID_ARG);
  EXPECT_NE(std::string(lf_last_error()).find("bf16, fp8, int8, int4, k8v4"), std::string::npos)
      << lf_last_error();
  EXPECT_EQ(lf_kv_dtype_parse(nullptr, &d), LF_ERR_INVALID_ARG);
}

/* An engine config with a dtype outside the enum fails at init, naming it. */
TEST(KvDtype, EngineRejectsUnknownDtype) {
  lf_engine_config cfg;
  lf_engine_config_default(&cfg);
  cfg.model_path = "/nonexistent";
  cfg.kv_dtype = (lf_kv_dtype)9;
  lf_engine_t e = nullptr;
  EXPECT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_ERR_INVALID_ARG);
  EXPECT_NE(std::string(lf_last_error()).find("kv_dtype 9"), std::string::npos) << lf_last_error();
}

} // namespace

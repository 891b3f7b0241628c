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
#include <vector>

#include "attention/attention.h"
#include "base/kvq.h"
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

/* The CPU pools under fp8: every written row (decode write and prefill append, SnapKV's kept
 * tokens) holds exactly what its codes read back, and ||v||_1 is that of the stored values. */
class QuantPool : public ::testing::TestWithParam<int> {};

TEST_P(QuantPool, CpuPoolsStoreWhatTheCodesReadBack) {
  const int D = 16, G = 2, B = 12, kvd = GetParam();
  lf_pool_shape ps{1, 1, 1, B, D, kvd};
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
    std::vector<uint8_t> c(D);
    const float ks = lf_kvq_quantize_row(kvd, kx, D, c.data());
    double l1 = 0.0;
    for (int d = 0; d < D; d++)
      ASSERT_EQ(h.k[(size_t)slot * D + d], lf_kvq_value(kvd, c[d], ks)) << "k slot " << slot;
    const float vs = lf_kvq_quantize_row(kvd, vx, D, c.data());
    for (int d = 0; d < D; d++) {
      ASSERT_EQ(h.v[(size_t)slot * D + d], lf_kvq_value(kvd, c[d], vs)) << "v slot " << slot;
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

INSTANTIATE_TEST_SUITE_P(Dtypes, QuantPool, ::testing::Values(int(LF_KV_FP8), int(LF_KV_INT8)),
                         [](const ::testing::TestParamInfo<int> &i) {
                           return std::string(lf_kv_dtype_str(lf_kv_dtype(i.param)));
                         });

TEST(Fp8Pool, DeviceBytesCountCodesAndScales) {
  lf_pool_shape s{3, 2, 4, 16, 8, LF_KV_FP8};
  const uint64_t slots = 2ull * 4 * 16, heads = 2ull * 4;
  EXPECT_EQ(lf_pool_bytes_device(&s, 0), slots * (2 * (8 + 4) + 4 + 4) + heads * 2 * 4);
  EXPECT_EQ(lf_pool_bytes_device(&s, 1), slots * (2 * (8 + 4) + 4 + 4 + 4) + heads * 2 * 4);
  /* head_dim 128: 264 bytes of K/V a slot against bf16's 512 */
  lf_pool_shape b{1, 1, 1, 1, 128, LF_KV_BF16}, f = b;
  f.kv_dtype = LF_KV_FP8;
  EXPECT_EQ(lf_pool_bytes_device(&b, 0) - lf_pool_bytes_device(&f, 0), 512u - 264u);
  lf_pool_shape i8 = f;
  i8.kv_dtype = LF_KV_INT8;
  EXPECT_EQ(lf_pool_bytes_device(&i8, 0), lf_pool_bytes_device(&f, 0));
  s.kv_dtype = 7;
  EXPECT_EQ(lf_pool_bytes_device(&s, 0), 0u);
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
  EXPECT_EQ(lf_kv_dtype_parse("int3", &d), LF_ERR_INVALID_ARG);
  EXPECT_NE(std::string(lf_last_error()).find("bf16, fp8, int8"), std::string::npos) << lf_last_error();
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

// Sampling against a brute-force oracle: for fresh random logits and uniform draws, the chosen
// token equals the one picked by an independent (double precision) implementation of
// temperature / top-k / top-p, and greedy is the argmax with the lowest id on ties.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "engine/sample.h"
#include "test_util.h"

namespace {

// Returns the token an exact implementation picks for draw u, and the cumulative mass interval
// [lo, hi) of that token within the kept set (to skip draws that land on a boundary).
int oracle(const std::vector<float> &logits, float temp, int top_k, float top_p, double u,
           double *lo, double *hi) {
  const int n = int(logits.size());
  const double mx = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(n);
  for (int i = 0; i < n; i++) p[i] = std::exp((logits[i] - mx) / temp);
  std::vector<int> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return p[a] > p[b]; });
  int m = (top_k > 0 && top_k < n) ? top_k : n;
  if (top_p > 0 && top_p < 1) {
    double kept = 0;
    for (int i = 0; i < m; i++) kept += p[idx[i]];
    double c = 0;
    for (int i = 0; i < m; i++) {
      c += p[idx[i]];
      if (c >= top_p * kept) {
        m = i + 1;
        break;
      }
    }
  }
  std::sort(idx.begin(), idx.begin() + m); // the draw walks kept tokens in id order
  double sum = 0;
  for (int i = 0; i < m; i++) sum += p[idx[i]];
  double c = 0;
  for (int i = 0; i < m; i++) {
    const double next = c + p[idx[i]] / sum;
    if (u < next || i == m - 1) {
      *lo = c;
      *hi = next;
      return idx[i];
    }
    c = next;
  }
  return -1;
}

TEST(Sample, MatchesBruteForce) {
  const uint64_t seed = lf_test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> nd(0.f, 3.f);
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  for (int vocab : {2, 7, 100, 1000}) {
    lf_sampler s;
    ASSERT_EQ(lf_sampler_init(&s, vocab), LF_OK);
    std::vector<float> logits(vocab);
    int checked = 0;
    for (int trial = 0; trial < 400; trial++) {
      for (auto &x : logits) x = nd(gen);
      lf_sampling sp{};
      sp.temperature = 0.2f + 2.0f * ud(gen);
      sp.top_k = trial % 3 == 0 ? 0 : 1 + int(gen() % vocab);
      sp.top_p = trial % 4 == 0 ? 1.0f : 0.05f + 0.9f * ud(gen);
      const float u = ud(gen);
      double lo = 0, hi = 1;
      const int want = oracle(logits, sp.temperature, sp.top_k, sp.top_p, u, &lo, &hi);
      // A draw within float rounding of a boundary may legitimately go either way.
      if (u - lo < 1e-5 || hi - u < 1e-5) continue;
      EXPECT_EQ(lf_sample(&s, logits.data(), &sp, u), want)
          << "vocab " << vocab << " T " << sp.temperature << " k " << sp.top_k << " p "
          << sp.top_p << " u " << u;
      checked++;
    }
    EXPECT_GT(checked, 350);
    lf_sampler_free(&s);
  }
}

TEST(Sample, GreedyIsArgmaxLowestIdOnTies) {
  std::mt19937_64 gen(lf_test_seed());
  std::normal_distribution<float> nd(0.f, 1.f);
  lf_sampler s;
  ASSERT_EQ(lf_sampler_init(&s, 64), LF_OK);
  std::vector<float> logits(64);
  for (int trial = 0; trial < 100; trial++) {
    for (auto &x : logits) x = nd(gen);
    const int a = int(gen() % 64), b = int(gen() % 64);
    const float top = 10.f + nd(gen);
    logits[a] = top;
    logits[b] = top;
    lf_sampling sp{};
    EXPECT_EQ(lf_sample(&s, logits.data(), &sp, 0.5f), std::min(a, b));
    EXPECT_EQ(lf_argmax(logits.data(), 64), std::min(a, b));
  }
  lf_sampler_free(&s);
}

TEST(Sample, SeededStreamIsReproducibleAndUniform) {
  lf_rng a, b;
  const uint64_t seed = lf_test_seed();
  lf_rng_seed(&a, seed);
  lf_rng_seed(&b, seed);
  std::vector<int> hist(10, 0);
  for (int i = 0; i < 100000; i++) {
    const float x = lf_rng_float(&a);
    ASSERT_EQ(x, lf_rng_float(&b));
    ASSERT_GE(x, 0.f);
    ASSERT_LT(x, 1.f);
    hist[int(x * 10)]++;
  }
  for (int h : hist) EXPECT_NEAR(h, 10000, 600); // > 6 sigma for a fair stream
}

} // namespace

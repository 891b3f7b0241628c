/* Prefill attention and SnapKV prefill compression (docs/DESIGN.md §3) against brute force written here
 * in double precision, independently of attention.c; chunked prefill of a non-empty pool.
 * Fresh random data every run (seed printed; replay with LF_TEST_SEED=<seed>).
 */
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "attention/attention.h"
#include "memory/pool.h"
#include "tests/evict_oracle.h"
#include "tests/test_util.h"

namespace {

/* h2o keeps the 2 newest positions. */
lf_attn_params make_params(lf_policy pol, int sink, int window, int group, int head_dim) {
  return attn_params(pol, sink, group, head_dim, 2, window);
}

/* A sequence's tokens for n_kv KV heads, laid out as a model would: one row per token.
 *   q [tok][n_kv][G][D],  k, v [tok][n_kv][D] */
struct Tokens {
  int n, n_kv, G, D;
  std::vector<float> q, k, v;
  Tokens(std::mt19937_64 &gen, int n_, int n_kv_, int G_, int D_)
      : n(n_), n_kv(n_kv_), G(G_), D(D_), q(lf_test_normal(gen, (size_t)n_ * n_kv_ * G_ * D_, 1.5f)),
        k(lf_test_normal(gen, (size_t)n_ * n_kv_ * D_)), v(lf_test_normal(gen, (size_t)n_ * n_kv_ * D_)) {}
  size_t q_stride() const {
    return (size_t)n_kv * G * D;
  }
  size_t kv_stride() const {
    return (size_t)n_kv * D;
  }
  const float *qp(int t, int g, int h) const {
    return &q[t * q_stride() + (g * G + h) * D];
  }
  const float *kp(int t, int g) const {
    return &k[t * kv_stride() + g * D];
  }
  const float *vp(int t, int g) const {
    return &v[t * kv_stride() + g * D];
  }
};

/* Softmax weights of query (t, h) of KV head g over keys 0..t of the sequence (causal). */
std::vector<double> causal_weights(const Tokens &x, int g, int h, int t) {
  std::vector<double> l(t + 1);
  for (int j = 0; j <= t; j++) {
    double s = 0;
    for (int d = 0; d < x.D; d++)
      s += (double)x.qp(t, g, h)[d] * x.kp(j, g)[d];
    l[j] = s / std::sqrt((double)x.D);
  }
  const double m = *std::max_element(l.begin(), l.end());
  double z = 0;
  for (double e : l)
    z += std::exp(e - m);
  const double lse = m + std::log(z);
  for (double &e : l)
    e = std::exp(e - lse);
  return l;
}

/* Expected output of query (t, h) of head g: full causal attention over the whole sequence. */
std::vector<double> causal_out(const Tokens &x, int g, int h, int t) {
  std::vector<double> a = causal_weights(x, g, h, t), o(x.D, 0.0);
  for (int j = 0; j <= t; j++)
    for (int d = 0; d < x.D; d++)
      o[d] += a[j] * x.vp(j, g)[d];
  return o;
}

/* SnapKV scores for KV head g of a prompt x[0..n), budget B: the kept positions, computed the
 * long way; *near_tie is set when the selection boundary is within 1e-9 relative. Also returns
 * the pooled scores (for judging an alternative choice at a near tie). */
std::vector<int> snapkv_kept(const Tokens &x, int g, int B, int sink, int window, bool *near_tie,
                             std::vector<double> *pooled_out) {
  const int W = std::max(0, std::min(window, B - 1 - sink));
  const int L = x.n - W;
  std::vector<double> raw(L, 0.0), pooled(L, 0.0);
  for (int h = 0; h < x.G; h++)
    for (int t = L; t < x.n; t++) {
      std::vector<double> a = causal_weights(x, g, h, t);
      for (int j = 0; j < L; j++)
        raw[j] += a[j];
    }
  for (int j = 0; j < L; j++) {
    double s = 0;
    for (int i = j - 2; i <= j + 2; i++)
      s += (i >= 0 && i < L) ? raw[i] : 0.0;
    pooled[j] = s / 5.0;
  }
  /* Rank each candidate by how many candidates beat it (higher score, or equal and earlier). */
  const int n_mid = B - 1 - sink - W;
  std::vector<int> kept;
  std::vector<double> kept_scores, dropped_scores;
  for (int j = 0; j < x.n; j++) {
    if (j < sink || j >= L) {
      kept.push_back(j);
      continue;
    }
    int beaten = 0;
    for (int i = sink; i < L; i++)
      if (pooled[i] > pooled[j] || (pooled[i] == pooled[j] && i < j)) beaten++;
    if (beaten < n_mid) {
      kept.push_back(j);
      kept_scores.push_back(pooled[j]);
    } else {
      dropped_scores.push_back(pooled[j]);
    }
  }
  *near_tie = false;
  if (!kept_scores.empty() && !dropped_scores.empty()) {
    const double lo = *std::min_element(kept_scores.begin(), kept_scores.end());
    const double hi = *std::max_element(dropped_scores.begin(), dropped_scores.end());
    /* An exact tie is not "near": the rule (lower position wins) decides it. */
    *near_tie = lo != hi && lo - hi <= 1e-9 * std::fabs(lo);
  }
  if (pooled_out) *pooled_out = pooled;
  return kept;
}

/* Runs lf_attn_prefill_ref over tokens [t0, t0 + cnt) of x for every KV head; out is
 * [tok][n_kv][G][D] for the whole sequence. */
lf_status prefill(const lf_attn_params &p, OnePool &pool, const Tokens &x, int t0, int cnt,
                  std::vector<float> &out, uint64_t *evictions = nullptr) {
  for (int g = 0; g < x.n_kv; g++) {
    lf_kv_head h = pool.head(g);
    lf_status s = lf_attn_prefill_ref(
        &p, &h, cnt, t0, x.qp(t0, g, 0), x.q_stride(), x.kp(t0, g), x.vp(t0, g), x.kv_stride(),
        &out[t0 * x.q_stride() + g * x.G * x.D], x.q_stride(), evictions);
    if (s != LF_OK) return s;
  }
  return LF_OK;
}

/* Outputs of tokens [t0, t1) equal full causal attention over the sequence up to each token. */
void expect_causal_outputs(const Tokens &x, const std::vector<float> &out, int t0, int t1) {
  for (int t = t0; t < t1; t++)
    for (int g = 0; g < x.n_kv; g++)
      for (int h = 0; h < x.G; h++) {
        std::vector<double> o = causal_out(x, g, h, t);
        const float *got = &out[t * x.q_stride() + (g * x.G + h) * x.D];
        for (int d = 0; d < x.D; d++)
          ASSERT_TRUE(close_rel(got[d], o[d], 1e-5, 1e-6))
              << "token " << t << " head " << g << "/" << h << " dim " << d << ": " << got[d]
              << " vs " << o[d];
      }
}

/* The slot holds exactly token t of head g. */
void expect_slot_holds(const lf_kv_head &h, int slot, const Tokens &x, int t, int g) {
  ASSERT_EQ(h.pos[slot], t);
  ASSERT_EQ(0, std::memcmp(h.k + (size_t)slot * x.D, x.kp(t, g), x.D * sizeof(float)));
  ASSERT_EQ(0, std::memcmp(h.v + (size_t)slot * x.D, x.vp(t, g), x.D * sizeof(float)));
  double l1 = 0;
  for (int d = 0; d < x.D; d++)
    l1 += std::fabs((double)x.vp(t, g)[d]);
  ASSERT_TRUE(close_rel(h.vnorm[slot], l1, 1e-6, 0));
}

long g_near_ties = 0;

/* One empty-pool prefill of P tokens; checks outputs, the kept set and the slot contents. */
void check_prompt(lf_policy pol, int P, int B, int sink, int window, int G, int D, int n_kv,
                  std::mt19937_64 &gen, bool same_keys = false, std::vector<int> *kept0 = nullptr) {
  SCOPED_TRACE(::testing::Message()
               << "policy " << pol << " P " << P << " B " << B << " sink " << sink << " window "
               << window << " G " << G << " D " << D << " n_kv " << n_kv);
  lf_attn_params p = make_params(pol, sink, window, G, D);
  Tokens x(gen, P, n_kv, G, D);
  if (same_keys) /* every softmax row is uniform: SnapKV scores tie exactly */
    for (int t = 1; t < P; t++)
      std::memcpy(&x.k[t * x.kv_stride()], &x.k[0], x.kv_stride() * sizeof(float));
  OnePool pool(n_kv, B, D);
  std::vector<float> out((size_t)P * x.q_stride(), NAN);
  uint64_t ev = 0;
  ASSERT_EQ(prefill(p, pool, x, 0, P, out, &ev), LF_OK) << lf_last_error();
  EXPECT_EQ(ev, 0u); /* compression is not eviction: nothing was overwritten */
  expect_causal_outputs(x, out, 0, P);

  for (int g = 0; g < n_kv; g++) {
    lf_kv_head h = pool.head(g);
    std::vector<int> want;
    std::vector<double> pooled;
    bool near_tie = false;
    const bool fits = pol == LF_POLICY_FULL ? P <= B : P <= B - 1;
    if (fits) {
      for (int t = 0; t < P; t++)
        want.push_back(t);
    } else if (pol == LF_POLICY_STREAMING) {
      /* StreamingLLM keeps the sinks and the most recent tokens, prompt included */
      for (int t = 0; t < sink; t++)
        want.push_back(t);
      for (int t = P - (B - 1 - sink); t < P; t++)
        want.push_back(t);
    } else {
      want = snapkv_kept(x, g, B, sink, window, &near_tie, &pooled);
    }
    ASSERT_EQ(*h.n, (int)want.size());
    if (pol != LF_POLICY_FULL) {
      ASSERT_LE(*h.n, B - 1);
    }
    ASSERT_EQ(*h.next, -1);
    std::vector<int> got(h.pos, h.pos + *h.n);
    ASSERT_TRUE(std::is_sorted(got.begin(), got.end())) << "kept tokens not in position order";
    for (int i = 0; i < std::min(sink, *h.n); i++)
      ASSERT_EQ(got[i], i) << "sink slot " << i;
    if (got != want) {
      /* Only acceptable at a genuine near-tie at the selection boundary: every kept middle
       * position must then score within 1e-9 of every dropped one. */
      ASSERT_TRUE(near_tie) << "kept set differs from SnapKV brute force";
      std::set<int> gs(got.begin(), got.end());
      const int W = std::max(0, std::min(window, B - 1 - sink)), L = P - W;
      double lo = INFINITY, hi = -INFINITY;
      for (int j = sink; j < L; j++) {
        if (gs.count(j))
          lo = std::min(lo, pooled[j]);
        else
          hi = std::max(hi, pooled[j]);
      }
      ASSERT_GE(lo, hi - 1e-9 * std::fabs(hi));
      g_near_ties++;
    }
    for (int i = 0; i < *h.n; i++)
      expect_slot_holds(h, i, x, got[i], g);
    if (g == 0 && kept0) *kept0 = got;

    /* h2o: acc starts as the attention mass each kept token received from the whole prompt. */
    if (pol == LF_POLICY_H2O) {
      std::vector<double> col(P, 0.0);
      for (int hh = 0; hh < G; hh++)
        for (int t = 0; t < P; t++) {
          std::vector<double> a = causal_weights(x, g, hh, t);
          for (int j = 0; j <= t; j++)
            col[j] += a[j];
        }
      for (int i = 0; i < *h.n; i++)
        ASSERT_TRUE(close_rel(h.acc[i], col[got[i]], 1e-5, 1e-7)) << "acc of slot " << i;
    }
  }
}

} // namespace

TEST(Prefill, PromptsThatFitAreKeptInOrder) {
  std::mt19937_64 gen(lf_test_seed_for("Prefill.PromptsThatFitAreKeptInOrder"));
  for (int G : {1, 2, 4})
    for (int sink : {0, 4}) {
      check_prompt(LF_POLICY_LONGFLOW, 1, 16, sink, 32, G, 8, 2, gen);
      check_prompt(LF_POLICY_LONGFLOW, 9, 16, sink, 32, G, 8, 2, gen);
      check_prompt(LF_POLICY_LONGFLOW, 15, 16, sink, 32, G, 16, 1, gen); /* P = B - 1 */
    }
  check_prompt(LF_POLICY_FULL, 16, 16, 4, 32, 2, 8, 2, gen); /* full holds all B */
}

TEST(Prefill, SnapKVCompressionKeepsTheSpecSet) {
  std::mt19937_64 gen(lf_test_seed_for("Prefill.SnapKVCompressionKeepsTheSpecSet"));
  for (int G : {1, 2, 4})
    for (int sink : {0, 4}) {
      check_prompt(LF_POLICY_LONGFLOW, 48, 48, sink, 32, G, 8, 2, gen);   /* P = B */
      check_prompt(LF_POLICY_LONGFLOW, 49, 48, sink, 32, G, 8, 1, gen);   /* P = B + 1 */
      check_prompt(LF_POLICY_LONGFLOW, 300, 64, sink, 32, G, 16, 2, gen); /* P >> B */
      check_prompt(LF_POLICY_LONGFLOW, 120, 24, sink, 8, G, 4, 2, gen);   /* small window */
    }
  std::printf("[ snapkv   ] near-ties accepted: %ld\n", g_near_ties);
}

/* Identical keys make every pooled score in the interior tie exactly; the zero padding lowers
 * the two positions at each end of the scored prefix. Ties go to the lower position. */
TEST(Prefill, ExactTiesKeepLowerPositions) {
  std::mt19937_64 gen(lf_test_seed_for("Prefill.ExactTiesKeepLowerPositions"));
  for (int G : {1, 2, 4}) {
    std::vector<int> kept;
    check_prompt(LF_POLICY_LONGFLOW, 40, 12, 2, 3, G, 8, 2, gen, true, &kept);
    /* W = 3, L = 37, 6 heavy hitters among [2, 37): the lowest interior ones, 2..7. */
    EXPECT_EQ(kept, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 37, 38, 39}));
    check_prompt(LF_POLICY_LONGFLOW, 40, 12, 0, 3, G, 8, 1, gen, true, &kept);
    /* sink 0: positions 0 and 1 are padded down, so 8 heavy hitters are 2..9. */
    EXPECT_EQ(kept, (std::vector<int>{2, 3, 4, 5, 6, 7, 8, 9, 37, 38, 39}));
    check_prompt(LF_POLICY_LONGFLOW, 30, 12, 4, 0, G, 8, 1, gen, false, &kept);
    /* no window: no query scores anything, all tie at zero, the earliest are kept */
    EXPECT_EQ(kept, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}));
  }
}

/* Budgets too small for the whole window: W_eff = min(W, B - 1 - sink). */
TEST(Prefill, WindowShrinksWithSmallBudgets) {
  std::mt19937_64 gen(lf_test_seed_for("Prefill.WindowShrinksWithSmallBudgets"));
  for (int G : {1, 2, 4}) {
    check_prompt(LF_POLICY_LONGFLOW, 100, 8, 4, 32, G, 8, 2, gen); /* W_eff = 3, no middle */
    check_prompt(LF_POLICY_LONGFLOW, 100, 6, 4, 32, G, 8, 1, gen); /* W_eff = 1 */
    check_prompt(LF_POLICY_LONGFLOW, 100, 2, 0, 32, G, 8, 1, gen); /* W_eff = 1, B = 2 */
    check_prompt(LF_POLICY_LONGFLOW, 60, 40, 0, 32, G, 8, 2, gen); /* 7 heavy hitters */
    check_prompt(LF_POLICY_LONGFLOW, 60, 20, 4, 0, G, 8, 2, gen);  /* no window at all */
  }
}

/* h2o compresses like longflow (SnapKV) and also seeds acc; streaming keeps sinks + recent. */
TEST(Prefill, OtherEvictingPoliciesCompressToo) {
  std::mt19937_64 gen(lf_test_seed_for("Prefill.OtherEvictingPoliciesCompressToo"));
  check_prompt(LF_POLICY_STREAMING, 90, 32, 4, 16, 2, 8, 2, gen);
  check_prompt(LF_POLICY_H2O, 90, 32, 4, 16, 2, 8, 2, gen);
  check_prompt(LF_POLICY_H2O, 20, 32, 4, 16, 4, 8, 1, gen);
}

/* A prompt in chunks into a pool with room: every output is full attention over all tokens so
 * far, and the pool ends with every token in order. */
TEST(Prefill, ChunkedExtensionThatFits) {
  std::mt19937_64 gen(lf_test_seed_for("Prefill.ChunkedExtensionThatFits"));
  for (lf_policy pol : {LF_POLICY_LONGFLOW, LF_POLICY_FULL, LF_POLICY_H2O})
    for (int G : {1, 2, 4}) {
      const int B = 40, D = 8, n_kv = 2, P = pol == LF_POLICY_FULL ? 40 : 39;
      lf_attn_params p = make_params(pol, 4, 32, G, D);
      Tokens x(gen, P, n_kv, G, D);
      OnePool pool(n_kv, B, D);
      std::vector<float> out((size_t)P * x.q_stride(), NAN);
      /* Chunks with a decode step between two of them (token 20): the decode step chooses a
       * next, and the chunk after it must clear it again since the pool still has room. */
      const int cuts[] = {0, 7, 8, 20, 21, P};
      for (int c = 0; c + 1 < 6; c++) {
        if (cuts[c] == 20) {
          for (int g = 0; g < n_kv; g++) {
            lf_kv_head h = pool.head(g);
            ASSERT_EQ(lf_attn_decode_ref(&p, &h, x.qp(20, g, 0), x.kp(20, g), x.vp(20, g), 20,
                                         &out[20 * x.q_stride() + g * G * D], nullptr, nullptr),
                      LF_OK);
            if (pol != LF_POLICY_FULL) {
              ASSERT_GE(*h.next, 0);
            }
          }
          continue;
        }
        ASSERT_EQ(prefill(p, pool, x, cuts[c], cuts[c + 1] - cuts[c], out), LF_OK)
            << lf_last_error();
        for (int g = 0; g < n_kv; g++)
          ASSERT_EQ(*pool.head(g).next, -1);
      }
      expect_causal_outputs(x, out, 0, P);
      for (int g = 0; g < n_kv; g++) {
        lf_kv_head h = pool.head(g);
        ASSERT_EQ(*h.n, P);
        for (int t = 0; t < P; t++)
          expect_slot_holds(h, t, x, t, g);
        if (pol == LF_POLICY_H2O) { /* acc sums the mass from every chunk's queries */
          std::vector<double> col(P, 0.0);
          for (int hh = 0; hh < G; hh++)
            for (int t = 0; t < P; t++) {
              std::vector<double> a = causal_weights(x, g, hh, t);
              for (int j = 0; j <= t; j++)
                col[j] += a[j];
            }
          for (int t = 0; t < P; t++)
            ASSERT_TRUE(close_rel(h.acc[t], col[t], 1e-5, 1e-6));
        }
      }
    }
}

/* A chunk that overflows a non-empty pool is exactly a run of decode steps. */
TEST(Prefill, OverflowingChunkEqualsDecodeSteps) {
  std::mt19937_64 gen(lf_test_seed_for("Prefill.OverflowingChunkEqualsDecodeSteps"));
  struct Case {
    lf_policy pol;
    int first, second; /* chunk sizes; the first is compressed when > B - 1 */
  } cases[] = {{LF_POLICY_LONGFLOW, 10, 30},
               {LF_POLICY_LONGFLOW, 60, 25},
               {LF_POLICY_LONGFLOW, 23, 2},
               {LF_POLICY_LONGFLOW, 10, 14},
               /* ends at B */ {LF_POLICY_STREAMING, 12, 40},
               {LF_POLICY_H2O, 50, 30}};
  for (const Case &c : cases)
    for (int G : {1, 4}) {
      SCOPED_TRACE(::testing::Message()
                   << "policy " << c.pol << " chunks " << c.first << "+" << c.second << " G " << G);
      const int B = 24, D = 8, n_kv = 2, P = c.first + c.second;
      lf_attn_params p = make_params(c.pol, 4, 8, G, D);
      Tokens x(gen, P, n_kv, G, D);
      OnePool a(n_kv, B, D), b(n_kv, B, D);
      std::vector<float> out_a((size_t)P * x.q_stride(), NAN), out_b = out_a;
      uint64_t ev_a = 0, ev_b = 0;
      ASSERT_EQ(prefill(p, a, x, 0, c.first, out_a), LF_OK);
      ASSERT_EQ(prefill(p, b, x, 0, c.first, out_b), LF_OK);
      ASSERT_EQ(prefill(p, a, x, c.first, c.second, out_a, &ev_a), LF_OK) << lf_last_error();
      for (int t = c.first; t < P; t++)
        for (int g = 0; g < n_kv; g++) {
          lf_kv_head h = b.head(g);
          int e = 0;
          ASSERT_EQ(lf_attn_decode_ref(&p, &h, x.qp(t, g, 0), x.kp(t, g), x.vp(t, g), t,
                                       &out_b[t * x.q_stride() + g * G * D], &e, nullptr),
                    LF_OK);
          ev_b += (uint64_t)e;
        }
      EXPECT_EQ(ev_a, ev_b);
      /* one per token past the free slots left by the first chunk */
      const int free_slots = B - std::min(c.first, B - 1);
      EXPECT_EQ(ev_a, (uint64_t)std::max(0, c.second - free_slots) * n_kv);
      ASSERT_EQ(0, std::memcmp(out_a.data(), out_b.data(), out_a.size() * sizeof(float)));
      /* The whole arena state matches bit for bit. */
      const size_t slots = (size_t)n_kv * B;
      EXPECT_EQ(0, std::memcmp(a.a.k, b.a.k, slots * D * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(a.a.v, b.a.v, slots * D * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(a.a.pos, b.a.pos, slots * sizeof(int32_t)));
      EXPECT_EQ(0, std::memcmp(a.a.vnorm, b.a.vnorm, slots * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(a.a.acc, b.a.acc, slots * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(a.a.n, b.a.n, n_kv * sizeof(int32_t)));
      EXPECT_EQ(0, std::memcmp(a.a.next, b.a.next, n_kv * sizeof(int32_t)));
      /* Outputs of the tokens before any eviction are still plain causal attention. */
      expect_causal_outputs(x, out_a, 0, std::min(P, B));
    }
}

/* The full policy holds exactly B tokens; more is an error that changes nothing. */
TEST(Prefill, FullPolicyOverflowIsAnErrorAndChangesNothing) {
  std::mt19937_64 gen(lf_test_seed_for("Prefill.FullPolicyOverflowIsAnErrorAndChangesNothing"));
  const int B = 16, D = 8, G = 2, n_kv = 1;
  lf_attn_params p = make_params(LF_POLICY_FULL, 4, 32, G, D);
  {
    Tokens x(gen, B + 1, n_kv, G, D);
    OnePool pool(n_kv, B, D);
    std::vector<float> out((size_t)x.n * x.q_stride(), 1.25f);
    EXPECT_EQ(prefill(p, pool, x, 0, B + 1, out), LF_ERR_CONTEXT_FULL);
    EXPECT_STRNE(lf_last_error(), "");
    lf_kv_head h = pool.head(0);
    EXPECT_EQ(*h.n, 0);
    for (float o : out)
      ASSERT_EQ(o, 1.25f); /* nothing computed either */
  }
  {
    Tokens x(gen, B + 3, n_kv, G, D);
    OnePool pool(n_kv, B, D);
    std::vector<float> out((size_t)x.n * x.q_stride(), 0.5f);
    ASSERT_EQ(prefill(p, pool, x, 0, 10, out), LF_OK);
    lf_kv_head h = pool.head(0);
    std::vector<float> k0(h.k, h.k + B * D), v0(h.v, h.v + B * D);
    std::vector<int32_t> pos0(h.pos, h.pos + B);
    EXPECT_EQ(prefill(p, pool, x, 10, 7, out), LF_ERR_CONTEXT_FULL); /* 10 + 7 > 16 */
    EXPECT_EQ(*h.n, 10);
    EXPECT_EQ(std::vector<float>(h.k, h.k + B * D), k0);
    EXPECT_EQ(std::vector<float>(h.v, h.v + B * D), v0);
    EXPECT_EQ(std::vector<int32_t>(h.pos, h.pos + B), pos0);
    ASSERT_EQ(prefill(p, pool, x, 10, 6, out), LF_OK); /* exactly B */
    EXPECT_EQ(*h.n, B);
    expect_causal_outputs(x, out, 0, B);
  }
}

TEST(Prefill, ArgumentChecks) {
  std::mt19937_64 gen(lf_test_seed_for("Prefill.ArgumentChecks"));
  const int B = 8, D = 4, G = 2;
  lf_attn_params p = make_params(LF_POLICY_LONGFLOW, 2, 4, G, D);
  Tokens x(gen, 4, 1, G, D);
  OnePool pool(1, B, D);
  lf_kv_head h = pool.head(0);
  std::vector<float> out(4 * x.q_stride());
  EXPECT_EQ(lf_attn_prefill_ref(&p, &h, 0, 0, nullptr, 0, nullptr, nullptr, 0, nullptr, 0, nullptr),
            LF_OK); /* an empty chunk is a no-op */
  EXPECT_EQ(lf_attn_prefill_ref(&p, &h, -1, 0, x.q.data(), x.q_stride(), x.k.data(), x.v.data(),
                                x.kv_stride(), out.data(), x.q_stride(), nullptr),
            LF_ERR_INVALID_ARG);
  EXPECT_EQ(lf_attn_prefill_ref(&p, &h, 4, 0, x.q.data(), 1, x.k.data(), x.v.data(), x.kv_stride(),
                                out.data(), x.q_stride(), nullptr),
            LF_ERR_INVALID_ARG); /* q stride shorter than a token */
  EXPECT_EQ(lf_attn_prefill_ref(&p, &h, 4, 0, x.q.data(), x.q_stride(), nullptr, x.v.data(),
                                x.kv_stride(), out.data(), x.q_stride(), nullptr),
            LF_ERR_INVALID_ARG);
  lf_attn_params bad = p;
  bad.sink = 7; /* budget 8 < sink + 2 */
  EXPECT_EQ(lf_attn_prefill_ref(&bad, &h, 4, 0, x.q.data(), x.q_stride(), x.k.data(), x.v.data(),
                                x.kv_stride(), out.data(), x.q_stride(), nullptr),
            LF_ERR_INVALID_ARG);
  EXPECT_EQ(*h.n, 0);
}

/* The brute-force eviction oracle the attention tests hold the library against
 * (docs/DESIGN.md §3), and the small pieces those tests share: attention parameters, a one-pool
 * arena, a relative tolerance, and the per-step checks of the library against the oracle.
 *
 * The oracle shares no code with attention.c: it keeps the slots of one layer as a list indexed
 * by slot, each holding the position and the k, v of every KV head; computes every softmax in
 * double through log-sum-exp; scores a slot by summing its per-head scores over the layer's
 * heads (LongFlow: ||v_g,i||_1 * sum_h alpha_h,i; h2o: the accumulated mass; streaming: the
 * position) and finds the eviction candidate by sorting. With one KV head that is head scope;
 * with several it is layer scope (one slot per layer, shared by its heads).
 */
#ifndef LF_TESTS_EVICT_ORACLE_H
#define LF_TESTS_EVICT_ORACLE_H

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "attention/attention.h"
#include "memory/pool.h"

/* Attention parameters of one test (head scope; scale 1/sqrt(head_dim)). */
inline lf_attn_params attn_params(lf_policy pol, int sink, int group, int head_dim, int recent = 0,
                                  int window = 32) {
  lf_attn_params p{};
  p.policy = pol;
  p.sink = sink;
  p.window = window;
  p.h2o_recent = recent;
  p.group = group;
  p.head_dim = head_dim;
  p.scale = 1.0f / std::sqrt((float)head_dim);
  return p;
}

inline bool close_rel(double got, double want, double rtol, double atol) {
  return std::fabs(got - want) <= atol + rtol * std::fabs(want);
}

/* One (pool, layer 0) of an arena with n_kv heads, taken fresh. */
struct OnePool {
  lf_kv_arena a{};
  int pool = -1;
  OnePool(int n_kv, int budget, int head_dim) {
    lf_pool_shape s{1, 1, n_kv, budget, head_dim, 0, 0, nullptr};
    EXPECT_EQ(lf_kv_arena_init(&a, &s), LF_OK) << lf_last_error();
    EXPECT_EQ(lf_kv_arena_take(&a, &pool), LF_OK) << lf_last_error();
  }
  ~OnePool() {
    lf_kv_arena_free(&a);
  }
  OnePool(const OnePool &) = delete;
  OnePool &operator=(const OnePool &) = delete;
  lf_kv_head head(int g) const {
    return lf_kv_arena_head(&a, pool, 0, g);
  }
  std::vector<lf_kv_head> heads() const {
    std::vector<lf_kv_head> h;
    for (int g = 0; g < a.shape.n_kv_heads; g++)
      h.push_back(head(g));
    return h;
  }
};

/* The oracle for one layer of n_kv KV heads, G query heads each. */
struct EvictOracle {
  struct Slot {
    int32_t pos;
    std::vector<std::vector<float>> k, v; /* [n_kv][D] */
    std::vector<float> acc; /* [n_kv] h2o: fp32 like the pool's state, so both round the same */
  };
  lf_policy policy;
  int B, sink, G, D, n_kv, recent;
  double scale;
  std::vector<Slot> slots; /* index = slot */
  int next = -1;

  /* Results of the last step. */
  int w = -1;
  bool evicted = false;
  std::vector<double> out;     /* [n_kv][G][D] */
  std::vector<double> score;   /* [n] the slot's score, summed over the layer's heads */
  std::vector<int> acceptable; /* candidates within the near-tie tolerance of the minimum */

  EvictOracle(const lf_attn_params &p, int budget, int n_kv_)
      : policy(p.policy), B(budget), sink(p.sink), G(p.group), D(p.head_dim), n_kv(n_kv_),
        recent(p.h2o_recent), scale(p.scale) {}

  double tie_tol() const {
    return policy == LF_POLICY_H2O ? 1e-5 : policy == LF_POLICY_STREAMING ? 0.0 : 1e-6;
  }

  /* One decode step: q [n_kv][G][D], k and v [n_kv][D]. false when the oracle itself cannot
   * proceed (a full pool with no next). */
  bool step(const float *q, const float *k, const float *v, int32_t pos) {
    if ((int)slots.size() < B) {
      w = (int)slots.size();
      slots.push_back({});
      evicted = false;
    } else {
      if (next < sink || next >= B) return false;
      w = next;
      evicted = true;
    }
    Slot s{pos, {}, {}, std::vector<float>(n_kv, 0.0f)};
    for (int g = 0; g < n_kv; g++) {
      s.k.emplace_back(k + g * D, k + (g + 1) * D);
      s.v.emplace_back(v + g * D, v + (g + 1) * D);
    }
    slots[w] = s;
    const int n = (int)slots.size();
    out.assign((size_t)n_kv * G * D, 0.0);
    score.assign(n, 0.0);
    for (int g = 0; g < n_kv; g++)
      attend_head(g, q + (size_t)g * G * D);
    choose_next(n);
    return true;
  }

private:
  /* KV head g: its query heads' outputs, and its share of every slot's score. */
  void attend_head(int g, const float *qg) {
    const int n = (int)slots.size();
    std::vector<double> mass(n, 0.0);
    for (int h = 0; h < G; h++) {
      const float *qh = qg + (size_t)h * D;
      std::vector<double> l(n);
      for (int i = 0; i < n; i++) {
        double d = 0;
        for (int j = 0; j < D; j++)
          d += (double)qh[j] * slots[i].k[g][j];
        l[i] = d * scale;
      }
      const double m = *std::max_element(l.begin(), l.end());
      double z = 0;
      for (double x : l)
        z += std::exp(x - m);
      const double lse = m + std::log(z);
      for (int i = 0; i < n; i++) {
        const double a = std::exp(l[i] - lse);
        mass[i] += a;
        for (int j = 0; j < D; j++)
          out[((size_t)g * G + h) * D + j] += a * slots[i].v[g][j];
      }
    }
    for (int i = 0; i < n; i++) {
      if (policy == LF_POLICY_H2O) {
        slots[i].acc[g] = (i == w ? 0.0f : slots[i].acc[g]) + (float)mass[i];
        score[i] += slots[i].acc[g];
      } else if (policy == LF_POLICY_STREAMING) {
        score[i] += slots[i].pos;
      } else {
        double l1 = 0;
        for (float x : slots[i].v[g])
          l1 += std::fabs((double)x);
        score[i] += l1 * mass[i];
      }
    }
  }

  /* next: the lowest-scored slot that is not a sink, not the one just written and (h2o) not
   * among the `recent` newest positions; lower slot on an exact tie. */
  void choose_next(int n) {
    std::vector<char> protect(n, 0);
    for (int i = 0; i < std::min(sink, n); i++)
      protect[i] = 1;
    protect[w] = 1;
    if (policy == LF_POLICY_H2O) {
      std::vector<int> by_recency(n);
      std::iota(by_recency.begin(), by_recency.end(), 0);
      std::sort(by_recency.begin(), by_recency.end(), [&](int a, int b) {
        return slots[a].pos != slots[b].pos ? slots[a].pos > slots[b].pos : a > b;
      });
      for (int i = 0; i < std::min(recent, n); i++)
        protect[by_recency[i]] = 1;
    }
    std::vector<int> cand;
    for (int i = 0; i < n; i++)
      if (!protect[i]) cand.push_back(i);
    std::sort(cand.begin(), cand.end(),
              [&](int a, int b) { return score[a] != score[b] ? score[a] < score[b] : a < b; });
    acceptable.clear();
    if (policy == LF_POLICY_FULL || cand.empty()) {
      next = -1;
      return;
    }
    next = cand[0];
    for (int c : cand)
      if (score[c] <= score[next] + tie_tol() * std::fabs(score[next])) acceptable.push_back(c);
  }
};

/* The library's step output (out [n_kv][G][D] as the oracle's) and its first n slot scores
 * against the oracle's. */
inline void expect_oracle_out(const EvictOracle &o, const std::vector<float> &out,
                              const std::vector<float> &scores, int n, int step) {
  for (size_t j = 0; j < out.size(); j++)
    ASSERT_TRUE(close_rel(out[j], o.out[j], 1e-5, 1e-6))
        << "step " << step << " out[" << j << "] " << out[j] << " vs " << o.out[j];
  for (int i = 0; i < n; i++)
    ASSERT_TRUE(close_rel(scores[i], o.score[i], 1e-5, 1e-12))
        << "step " << step << " score[" << i << "] " << scores[i] << " vs " << o.score[i];
}

/* The library's next slot nx (of n filled, sink sinks): never the slot just written, never a
 * sink; the oracle's unless a near-tie makes either acceptable, in which case the oracle follows
 * the library (counted in resyncs; near_ties counts the steps with a near-tie). */
inline void expect_oracle_next(EvictOracle &o, int nx, int sink, int n, int step, long &near_ties,
                               long &resyncs) {
  ASSERT_NE(nx, o.w);
  ASSERT_TRUE(nx == -1 || (nx >= sink && nx < n)) << "next " << nx;
  if (o.acceptable.size() > 1) near_ties++;
  if (nx != o.next) {
    const bool ok = std::find(o.acceptable.begin(), o.acceptable.end(), nx) != o.acceptable.end();
    ASSERT_TRUE(ok) << "step " << step << ": next " << nx << " (score " << o.score[nx]
                    << "), oracle " << o.next << " (score " << o.score[o.next] << ")";
    o.next = nx;
    resyncs++;
  }
}

#endif

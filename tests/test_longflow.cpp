/* Decode attention with LongFlow eviction (docs/DESIGN.md §3) against an independent brute-force oracle,
 * plus the full / streaming / h2o policies, parameter checks and the slot-pool arena.
 *
 * The oracle (tests/evict_oracle.h, one per KV head here) shares no code with attention.c. It is
 * driven in lockstep with lf_attn_decode_ref on fresh random data (seed printed; replay with
 * LF_TEST_SEED=<seed>).
 */
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attention/attention.h"
#include "memory/pool.h"
#include "tests/evict_oracle.h"
#include "tests/test_util.h"

namespace {

struct Rng {
  std::mt19937_64 gen;
  explicit Rng(uint64_t s) : gen(s) {}
  int uniform_int(int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(gen);
  }
  /* Normal values with a random per-call spread, so some steps have peaked softmaxes. */
  std::vector<float> normal(size_t n, float sd = 1.0f) {
    std::normal_distribution<float> d(0.0f, sd);
    std::vector<float> x(n);
    for (auto &e : x)
      e = d(gen);
    return x;
  }
};

struct LockstepStats {
  long steps = 0, near_ties = 0, resyncs = 0, evictions = 0;
};

/* Drives the library and the oracle over `steps` decode steps of n_kv KV heads. */
void run_lockstep(const lf_attn_params &p, int budget, int n_kv, int steps, Rng &rng,
                  LockstepStats &st) {
  SCOPED_TRACE(::testing::Message() << "policy " << p.policy << " B " << budget << " G " << p.group
                                    << " D " << p.head_dim << " sink " << p.sink << " recent "
                                    << p.h2o_recent << " n_kv " << n_kv);
  const int G = p.group, D = p.head_dim;
  OnePool pool(n_kv, budget, D);
  std::vector<EvictOracle> ref(n_kv, EvictOracle(p, budget, 1));
  std::vector<float> out((size_t)G * D), scores(budget);

  for (int s = 0; s < steps; s++) {
    /* q spread varies per step: peaked and flat softmaxes both occur. */
    const float qsd = 0.5f + 2.0f * (float)(s % 7) / 6.0f;
    for (int g = 0; g < n_kv; g++) {
      std::vector<float> q = rng.normal((size_t)G * D, qsd), k = rng.normal(D), v = rng.normal(D);
      lf_kv_head h = pool.head(g);
      EvictOracle &o = ref[g];
      const int n_before = *h.n;
      const int w_lib = lf_kv_write_slot(&h);
      ASSERT_TRUE(o.step(q.data(), k.data(), v.data(), s)) << "oracle has no slot at step " << s;
      ASSERT_EQ(w_lib, o.w) << "step " << s;

      int ev = -1;
      std::fill(scores.begin(), scores.end(), NAN);
      ASSERT_EQ(lf_attn_decode_ref(&p, &h, q.data(), k.data(), v.data(), s, out.data(), &ev,
                                   scores.data()),
                LF_OK)
          << lf_last_error();
      ASSERT_EQ(ev, o.evicted ? 1 : 0) << "step " << s;
      ASSERT_EQ(*h.n, (int)o.slots.size());
      ASSERT_EQ(*h.n, std::min(n_before + 1, budget));
      st.evictions += ev;

      /* The token landed where the oracle put it, with its exact bits and cached norm. */
      ASSERT_EQ(0, std::memcmp(h.k + (size_t)o.w * D, k.data(), D * sizeof(float)));
      ASSERT_EQ(0, std::memcmp(h.v + (size_t)o.w * D, v.data(), D * sizeof(float)));
      double l1 = 0;
      for (float x : v)
        l1 += std::fabs((double)x);
      ASSERT_TRUE(close_rel(h.vnorm[o.w], l1, 1e-6, 0)) << h.vnorm[o.w] << " vs " << l1;

      /* Kept set: the position in every slot. Sinks hold positions 0..sink-1 for good. */
      for (int i = 0; i < *h.n; i++)
        ASSERT_EQ(h.pos[i], o.slots[i].pos) << "slot " << i;
      for (int i = 0; i < std::min(p.sink, *h.n); i++)
        ASSERT_EQ(h.pos[i], i);

      ASSERT_NO_FATAL_FAILURE(expect_oracle_out(o, out, scores, *h.n, s));
      if (p.policy == LF_POLICY_H2O) {
        for (int i = 0; i < *h.n; i++)
          ASSERT_EQ(h.acc[i], o.slots[i].acc[0]) << "slot " << i;
      }

      /* next: as the oracle's, or a near-tie's other candidate (then the oracle follows). */
      ASSERT_NO_FATAL_FAILURE(
          expect_oracle_next(o, *h.next, p.sink, *h.n, s, st.near_ties, st.resyncs));
    }
    st.steps++;
  }
}

void report(const char *what, const LockstepStats &st) {
  std::printf("[ lockstep ] %s: %ld steps, %ld evictions, %ld near-ties, %ld resyncs\n", what,
              st.steps, st.evictions, st.near_ties, st.resyncs);
}

} // namespace

/* ------------------------------------------------------------------------------------------- */

TEST(LongFlow, LockstepWithOracleRandomConfigs) {
  Rng rng(lf_test_seed_for("LongFlow.LockstepWithOracleRandomConfigs"));
  const int dims[] = {4, 8, 16, 64};
  LockstepStats st;
  /* Edge configurations first: the tightest budget for each sink, the widest group. */
  struct Cfg {
    int B, G, D, sink, steps;
  } fixed[] = {{4, 1, 4, 2, 300},   {6, 3, 8, 4, 300},  {5, 8, 64, 0, 200},
               {64, 8, 64, 4, 400}, {4, 2, 16, 0, 300}, {33, 1, 4, 1, 400}};
  for (const Cfg &c : fixed)
    run_lockstep(attn_params(LF_POLICY_LONGFLOW, c.sink, c.G, c.D), c.B, 2, c.steps, rng, st);
  for (int r = 0; r < 60 && !HasFatalFailure(); r++) {
    const int B = rng.uniform_int(4, 64);
    const int sink = rng.uniform_int(0, std::min(4, B - 2));
    const int G = rng.uniform_int(1, 8), D = dims[rng.uniform_int(0, 3)];
    run_lockstep(attn_params(LF_POLICY_LONGFLOW, sink, G, D), B, rng.uniform_int(1, 3),
                 rng.uniform_int(200, 400), rng, st);
  }
  report("longflow", st);
  /* Near-ties must be rare by construction (continuous random data). */
  EXPECT_LT(st.resyncs * 1000, st.steps + 1000);
}

/* While the budget exceeds the sequence, eviction never happens and the output is plain causal
 * attention over every token so far, computed here in the simplest possible way. */
TEST(LongFlow, BudgetLargerThanSequenceIsFullAttention) {
  Rng rng(lf_test_seed_for("LongFlow.BudgetLargerThanSequenceIsFullAttention"));
  for (lf_policy pol : {LF_POLICY_LONGFLOW, LF_POLICY_FULL, LF_POLICY_STREAMING, LF_POLICY_H2O}) {
    const int G = rng.uniform_int(1, 8), D = 16, steps = 150, B = 160;
    lf_attn_params p = attn_params(pol, 4, G, D, 2);
    OnePool pool(1, B, D);
    lf_kv_head h = pool.head(0);
    std::vector<std::vector<float>> ks, vs;
    std::vector<float> out((size_t)G * D);
    for (int s = 0; s < steps; s++) {
      std::vector<float> q = rng.normal((size_t)G * D, 1.5f);
      ks.push_back(rng.normal(D));
      vs.push_back(rng.normal(D));
      int ev = -1;
      ASSERT_EQ(lf_attn_decode_ref(&p, &h, q.data(), ks.back().data(), vs.back().data(), s,
                                   out.data(), &ev, nullptr),
                LF_OK)
          << lf_last_error();
      ASSERT_EQ(ev, 0);
      ASSERT_EQ(*h.n, s + 1);
      for (int g = 0; g < G; g++) {
        std::vector<double> e(s + 1);
        double z = 0;
        for (int t = 0; t <= s; t++) {
          double dotp = 0;
          for (int d = 0; d < D; d++)
            dotp += (double)q[g * D + d] * ks[t][d];
          e[t] = dotp / std::sqrt((double)D);
        }
        const double m = *std::max_element(e.begin(), e.end());
        for (double &x : e)
          z += (x = std::exp(x - m));
        for (int d = 0; d < D; d++) {
          double o = 0;
          for (int t = 0; t <= s; t++)
            o += e[t] / z * vs[t][d];
          ASSERT_TRUE(close_rel(out[g * D + d], o, 1e-6, 1e-7))
              << "policy " << pol << " step " << s << ": " << out[g * D + d] << " vs " << o;
        }
      }
    }
  }
}

/* A constructed case with an obvious answer: the slot whose value vector is tiny contributes
 * least and is evicted next, unless it is a sink. */
TEST(LongFlow, TinyValueSlotIsEvictedButSinkIsNot) {
  Rng rng(lf_test_seed_for("LongFlow.TinyValueSlotIsEvictedButSinkIsNot"));
  const int B = 8, G = 2, D = 16, sink = 2;
  lf_attn_params p = attn_params(LF_POLICY_LONGFLOW, sink, G, D);
  OnePool pool(1, B, D);
  lf_kv_head h = pool.head(0);
  std::vector<float> out((size_t)G * D);
  for (int s = 0; s < B; s++) {
    std::vector<float> q = rng.normal((size_t)G * D), k = rng.normal(D), v = rng.normal(D);
    if (s == 0 || s == 5)
      for (float &x : v)
        x *= 1e-4f;
    ASSERT_EQ(
        lf_attn_decode_ref(&p, &h, q.data(), k.data(), v.data(), s, out.data(), nullptr, nullptr),
        LF_OK);
  }
  EXPECT_EQ(*h.n, B);
  EXPECT_EQ(*h.next, 5);
  std::vector<float> q = rng.normal((size_t)G * D), k = rng.normal(D), v = rng.normal(D);
  int ev = 0;
  ASSERT_EQ(lf_attn_decode_ref(&p, &h, q.data(), k.data(), v.data(), B, out.data(), &ev, nullptr),
            LF_OK);
  EXPECT_EQ(ev, 1);
  EXPECT_EQ(h.pos[5], B);
  EXPECT_EQ(h.pos[0], 0);
}

/* Exact ties (identical keys, value vectors with the same L1 norm): the lowest candidate wins,
 * and the slot just written is skipped. */
TEST(LongFlow, ExactTiesGoToLowestSlot) {
  Rng rng(lf_test_seed_for("LongFlow.ExactTiesGoToLowestSlot"));
  const int B = 10, G = 3, D = 8, sink = 3;
  lf_attn_params p = attn_params(LF_POLICY_LONGFLOW, sink, G, D);
  OnePool pool(1, B, D);
  lf_kv_head h = pool.head(0);
  std::vector<float> k = rng.normal(D), v = rng.normal(D), out((size_t)G * D);
  int expect_next = -1;
  for (int s = 0; s < B + 6; s++) {
    std::vector<float> q = rng.normal((size_t)G * D), vs = v;
    for (float &x : vs)
      x = (s % 2 ? -x : x); /* same |v| in the same order: same L1 norm */
    const int w = s < B ? s : expect_next;
    ASSERT_EQ(
        lf_attn_decode_ref(&p, &h, q.data(), k.data(), vs.data(), s, out.data(), nullptr, nullptr),
        LF_OK);
    ASSERT_EQ(h.pos[w], s);
    const int n = std::min(s + 1, B);
    expect_next = w == sink ? sink + 1 : sink; /* lowest evictable slot other than w */
    if (expect_next >= n) expect_next = -1;
    ASSERT_EQ(*h.next, expect_next) << "step " << s;
  }
}

/* ------------------------------------------------------------------------------------------- */

TEST(FullPolicy, ErrorsAtOverflowWithNothingModified) {
  Rng rng(lf_test_seed_for("FullPolicy.ErrorsAtOverflowWithNothingModified"));
  const int B = 8, G = 2, D = 8;
  lf_attn_params p = attn_params(LF_POLICY_FULL, 4, G, D);
  OnePool pool(1, B, D);
  lf_kv_head h = pool.head(0);
  std::vector<float> out((size_t)G * D);
  LockstepStats st;
  for (int s = 0; s < B; s++) {
    std::vector<float> q = rng.normal((size_t)G * D), k = rng.normal(D), v = rng.normal(D);
    int ev = -1;
    ASSERT_EQ(lf_attn_decode_ref(&p, &h, q.data(), k.data(), v.data(), s, out.data(), &ev, nullptr),
              LF_OK);
    EXPECT_EQ(ev, 0);
    EXPECT_EQ(*h.next, -1);
  }
  ASSERT_EQ(*h.n, B);
  const size_t nv = (size_t)B * D;
  std::vector<float> k0(h.k, h.k + nv), v0(h.v, h.v + nv), vn0(h.vnorm, h.vnorm + B),
      acc0(h.acc, h.acc + B);
  std::vector<int32_t> pos0(h.pos, h.pos + B);
  std::vector<float> q = rng.normal((size_t)G * D), k = rng.normal(D), v = rng.normal(D);
  std::vector<float> out0 = out;
  int ev = 42;
  EXPECT_EQ(lf_attn_decode_ref(&p, &h, q.data(), k.data(), v.data(), B, out.data(), &ev, nullptr),
            LF_ERR_CONTEXT_FULL);
  EXPECT_STRNE(lf_last_error(), "");
  EXPECT_EQ(ev, 42);
  EXPECT_EQ(*h.n, B);
  EXPECT_EQ(*h.next, -1);
  EXPECT_EQ(std::vector<float>(h.k, h.k + nv), k0);
  EXPECT_EQ(std::vector<float>(h.v, h.v + nv), v0);
  EXPECT_EQ(std::vector<float>(h.vnorm, h.vnorm + B), vn0);
  EXPECT_EQ(std::vector<float>(h.acc, h.acc + B), acc0);
  EXPECT_EQ(std::vector<int32_t>(h.pos, h.pos + B), pos0);
  EXPECT_EQ(out, out0);
}

TEST(FullPolicy, LockstepUntilFull) {
  Rng rng(lf_test_seed_for("FullPolicy.LockstepUntilFull"));
  LockstepStats st;
  run_lockstep(attn_params(LF_POLICY_FULL, 4, 4, 16), 48, 2, 48, rng, st);
  report("full", st);
  EXPECT_EQ(st.evictions, 0);
}

TEST(StreamingPolicy, LockstepWithOracle) {
  Rng rng(lf_test_seed_for("StreamingPolicy.LockstepWithOracle"));
  LockstepStats st;
  for (int r = 0; r < 8 && !HasFatalFailure(); r++) {
    const int B = rng.uniform_int(4, 40), sink = rng.uniform_int(0, std::min(4, B - 2));
    run_lockstep(attn_params(LF_POLICY_STREAMING, sink, rng.uniform_int(1, 4), 8), B, 2, 150, rng,
                 st);
  }
  report("streaming", st);
  EXPECT_EQ(st.resyncs, 0); /* positions never tie */
}

/* Streaming keeps exactly the sinks and the most recent B - sink positions. */
TEST(StreamingPolicy, KeepsSinksAndMostRecent) {
  Rng rng(lf_test_seed_for("StreamingPolicy.KeepsSinksAndMostRecent"));
  const int B = 12, sink = 4, G = 2, D = 8, steps = 100;
  lf_attn_params p = attn_params(LF_POLICY_STREAMING, sink, G, D);
  OnePool pool(1, B, D);
  lf_kv_head h = pool.head(0);
  std::vector<float> out((size_t)G * D);
  for (int s = 0; s < steps; s++) {
    std::vector<float> q = rng.normal((size_t)G * D), k = rng.normal(D), v = rng.normal(D);
    ASSERT_EQ(
        lf_attn_decode_ref(&p, &h, q.data(), k.data(), v.data(), s, out.data(), nullptr, nullptr),
        LF_OK);
  }
  std::vector<int32_t> kept(h.pos, h.pos + B);
  std::sort(kept.begin(), kept.end());
  for (int i = 0; i < sink; i++)
    EXPECT_EQ(kept[i], i);
  for (int i = sink; i < B; i++)
    EXPECT_EQ(kept[i], steps - (B - i));
}

TEST(H2OPolicy, LockstepWithOracle) {
  Rng rng(lf_test_seed_for("H2OPolicy.LockstepWithOracle"));
  LockstepStats st;
  for (int r = 0; r < 10 && !HasFatalFailure(); r++) {
    const int sink = rng.uniform_int(0, 4), recent = rng.uniform_int(0, 4);
    const int B = rng.uniform_int(sink + recent + 2, 40);
    run_lockstep(attn_params(LF_POLICY_H2O, sink, rng.uniform_int(1, 4), 8, recent), B, 2, 200, rng,
                 st);
  }
  report("h2o", st);
  EXPECT_LT(st.resyncs * 100, st.steps + 100);
}

/* ------------------------------------------------------------------------------------------- */

TEST(AttnParams, Check) {
  lf_attn_params p = attn_params(LF_POLICY_LONGFLOW, 4, 2, 8);
  EXPECT_EQ(lf_attn_params_check(&p, 6), LF_OK);
  EXPECT_EQ(lf_attn_params_check(&p, 5), LF_ERR_INVALID_ARG); /* budget < sink + 2 */
  EXPECT_STRNE(lf_last_error(), "");
  EXPECT_EQ(lf_attn_params_check(nullptr, 6), LF_ERR_INVALID_ARG);
  for (lf_policy pol : {LF_POLICY_STREAMING, LF_POLICY_H2O}) {
    lf_attn_params q = p;
    q.policy = pol;
    EXPECT_EQ(lf_attn_params_check(&q, 6), LF_OK);
    EXPECT_EQ(lf_attn_params_check(&q, 5), LF_ERR_INVALID_ARG);
  }
  lf_attn_params f = p;
  f.policy = LF_POLICY_FULL;
  EXPECT_EQ(lf_attn_params_check(&f, 1), LF_OK); /* full never needs a free slot */
  EXPECT_EQ(lf_attn_params_check(&f, 0), LF_ERR_INVALID_ARG);
  lf_attn_params h = p;
  h.policy = LF_POLICY_H2O;
  h.h2o_recent = 3;
  EXPECT_EQ(lf_attn_params_check(&h, 9), LF_OK);
  EXPECT_EQ(lf_attn_params_check(&h, 8), LF_ERR_INVALID_ARG); /* recent leaves no candidate */
  struct Bad {
    const char *what;
    void (*mutate)(lf_attn_params *);
  } bad[] = {{"sink", [](lf_attn_params *x) { x->sink = -1; }},
             {"window", [](lf_attn_params *x) { x->window = -1; }},
             {"group", [](lf_attn_params *x) { x->group = 0; }},
             {"head_dim", [](lf_attn_params *x) { x->head_dim = 0; }},
             {"h2o_recent", [](lf_attn_params *x) { x->h2o_recent = -2; }},
             {"scale", [](lf_attn_params *x) { x->scale = 0.0f; }},
             {"scale nan", [](lf_attn_params *x) { x->scale = NAN; }},
             {"policy", [](lf_attn_params *x) { x->policy = (lf_policy)17; }}};
  for (const Bad &b : bad) {
    lf_attn_params x = p;
    b.mutate(&x);
    EXPECT_EQ(lf_attn_params_check(&x, 64), LF_ERR_INVALID_ARG) << b.what;
  }
  lf_attn_params s0 = p;
  s0.sink = 0;
  EXPECT_EQ(lf_attn_params_check(&s0, 2), LF_OK);
}

TEST(AttnDecode, RejectsBadArgumentsAndCorruptState) {
  lf_attn_params p = attn_params(LF_POLICY_LONGFLOW, 1, 1, 4);
  OnePool pool(1, 4, 4);
  lf_kv_head h = pool.head(0);
  float q[4] = {1, 2, 3, 4}, k[4] = {0.5f, -1, 2, 1}, v[4] = {1, -1, 0.25f, 3}, out[4];
  EXPECT_EQ(lf_attn_decode_ref(&p, nullptr, q, k, v, 0, out, nullptr, nullptr), LF_ERR_INVALID_ARG);
  EXPECT_EQ(lf_attn_decode_ref(&p, &h, nullptr, k, v, 0, out, nullptr, nullptr),
            LF_ERR_INVALID_ARG);
  lf_attn_params wrong_dim = p;
  wrong_dim.head_dim = 8;
  EXPECT_EQ(lf_attn_decode_ref(&wrong_dim, &h, q, k, v, 0, out, nullptr, nullptr),
            LF_ERR_INVALID_ARG);
  EXPECT_EQ(*h.n, 0);
  /* A full pool whose next is not an evictable slot is a state error, not a wild write. */
  *h.n = 4;
  *h.next = -1;
  EXPECT_EQ(lf_attn_decode_ref(&p, &h, q, k, v, 0, out, nullptr, nullptr), LF_ERR_STATE);
  *h.next = 0; /* a sink */
  EXPECT_EQ(lf_attn_decode_ref(&p, &h, q, k, v, 0, out, nullptr, nullptr), LF_ERR_STATE);
  *h.n = 5;
  EXPECT_EQ(lf_attn_decode_ref(&p, &h, q, k, v, 0, out, nullptr, nullptr), LF_ERR_STATE);
}

/* ------------------------------------------------------------------------------------------- */

TEST(Pool, BytesMatchArenaFootprint) {
  lf_pool_shape s{3, 2, 4, 16, 8, 0, 0, nullptr};
  const uint64_t slots = 2ull * 4 * 16;
  EXPECT_EQ(lf_pool_bytes(&s),
            slots * (2 * 8 * 4 + 4 + 4 + 4) + 2ull * 4 * 2 * 4 + 8 + sizeof(int) + 1);
  lf_pool_shape bad = s;
  bad.budget = 0;
  EXPECT_EQ(lf_pool_bytes(&bad), 0u);
  lf_pool_shape huge{1, 1 << 30, 1 << 30, 1 << 30, 1 << 30, 0, 0, nullptr};
  EXPECT_EQ(lf_pool_bytes(&huge), 0u); /* overflows 64 bits */
}

// The device arena: bf16 K and V, ||v||_1 and position per slot, and h2o's accumulator only
// when the shape asks for it; n and next per head.
TEST(Pool, DeviceBytesCountH2oAccumulatorsOnlyForH2o) {
  lf_pool_shape s{3, 2, 4, 16, 8, 0, 0, nullptr};
  const uint64_t slots = 2ull * 4 * 16, heads = 2ull * 4;
  EXPECT_EQ(lf_pool_bytes_device(&s, 0), slots * (2 * 8 * 2 + 4 + 4) + heads * 2 * 4);
  EXPECT_EQ(lf_pool_bytes_device(&s, 1), slots * (2 * 8 * 2 + 4 + 4 + 4) + heads * 2 * 4);
}

TEST(Pool, InitRejectsBadShapes) {
  lf_kv_arena a;
  lf_pool_shape s{2, 1, 1, 0, 8, 0, 0, nullptr};
  EXPECT_EQ(lf_kv_arena_init(&a, &s), LF_ERR_INVALID_ARG);
  EXPECT_EQ(a.k, nullptr);
  lf_pool_shape huge{1 << 30, 1 << 30, 1 << 30, 1 << 30, 1 << 30, 0, 0, nullptr};
  EXPECT_EQ(lf_kv_arena_init(&a, &huge), LF_ERR_OUT_OF_MEMORY);
  EXPECT_STRNE(lf_last_error(), "");
  lf_kv_arena_free(&a); /* safe on a failed init */
}

TEST(Pool, TakeGiveLifoAndErrors) {
  lf_pool_shape s{3, 2, 2, 4, 4, 0, 0, nullptr};
  lf_kv_arena a;
  ASSERT_EQ(lf_kv_arena_init(&a, &s), LF_OK);
  int p0, p1, p2, p3;
  ASSERT_EQ(lf_kv_arena_take(&a, &p0), LF_OK);
  ASSERT_EQ(lf_kv_arena_take(&a, &p1), LF_OK);
  ASSERT_EQ(lf_kv_arena_take(&a, &p2), LF_OK);
  EXPECT_EQ(p0, 0);
  EXPECT_EQ(p1, 1);
  EXPECT_EQ(p2, 2);
  EXPECT_EQ(lf_kv_arena_take(&a, &p3), LF_ERR_STATE);
  EXPECT_EQ(lf_kv_arena_give(&a, p1), LF_OK);
  EXPECT_EQ(lf_kv_arena_give(&a, p1), LF_ERR_STATE); /* twice */
  EXPECT_EQ(lf_kv_arena_give(&a, 3), LF_ERR_STATE);  /* unknown */
  EXPECT_EQ(lf_kv_arena_give(&a, -1), LF_ERR_STATE);
  ASSERT_EQ(lf_kv_arena_take(&a, &p3), LF_OK);
  EXPECT_EQ(p3, p1); /* LIFO */
  lf_kv_arena_free(&a);
  EXPECT_EQ(a.k, nullptr);
  lf_kv_arena_free(&a); /* idempotent */
}

TEST(Pool, TakeResetsMetadataAndViewsAreDisjoint) {
  Rng rng(lf_test_seed_for("Pool.TakeResetsMetadataAndViewsAreDisjoint"));
  const lf_pool_shape s{2, 3, 2, 6, 4, 0, 0, nullptr};
  lf_kv_arena a;
  ASSERT_EQ(lf_kv_arena_init(&a, &s), LF_OK);
  int p;
  ASSERT_EQ(lf_kv_arena_take(&a, &p), LF_OK);
  /* Every view is the contiguous block [pool][layer][head] of the arena. */
  for (int pool = 0; pool < s.n_pools; pool++)
    for (int l = 0; l < s.n_layers; l++)
      for (int g = 0; g < s.n_kv_heads; g++) {
        lf_kv_head h = lf_kv_arena_head(&a, pool, l, g);
        const size_t idx = ((size_t)pool * s.n_layers + l) * s.n_kv_heads + g;
        EXPECT_EQ(h.k, a.k + idx * s.budget * s.head_dim);
        EXPECT_EQ(h.v, a.v + idx * s.budget * s.head_dim);
        EXPECT_EQ(h.pos, a.pos + idx * s.budget);
        EXPECT_EQ(h.n, a.n + idx);
        EXPECT_EQ(h.budget, s.budget);
        EXPECT_EQ(h.head_dim, s.head_dim);
      }
  EXPECT_EQ(lf_kv_arena_head(&a, 2, 0, 0).k, nullptr);
  EXPECT_EQ(lf_kv_arena_head(&a, 0, 3, 0).k, nullptr);
  EXPECT_EQ(lf_kv_arena_head(&a, 0, 0, -1).k, nullptr);

  /* Fill pool p through decode steps (evicting), then give it back and take it again. */
  lf_attn_params prm = attn_params(LF_POLICY_H2O, 1, 1, s.head_dim);
  float out[4];
  for (int l = 0; l < s.n_layers; l++)
    for (int g = 0; g < s.n_kv_heads; g++) {
      lf_kv_head h = lf_kv_arena_head(&a, p, l, g);
      for (int t = 0; t < 9; t++) {
        auto q = rng.normal(4), k = rng.normal(4), v = rng.normal(4);
        ASSERT_EQ(
            lf_attn_decode_ref(&prm, &h, q.data(), k.data(), v.data(), t, out, nullptr, nullptr),
            LF_OK);
      }
      EXPECT_EQ(*h.n, s.budget);
      EXPECT_GE(*h.next, 1);
    }
  lf_kv_head other = lf_kv_arena_head(&a, 1 - p, 0, 0);
  EXPECT_EQ(*other.n, 0); /* the other pool is untouched */
  a.evictions[p] = 17;
  ASSERT_EQ(lf_kv_arena_give(&a, p), LF_OK);
  int p2;
  ASSERT_EQ(lf_kv_arena_take(&a, &p2), LF_OK);
  ASSERT_EQ(p2, p);
  EXPECT_EQ(a.evictions[p], 0u);
  for (int l = 0; l < s.n_layers; l++)
    for (int g = 0; g < s.n_kv_heads; g++) {
      lf_kv_head h = lf_kv_arena_head(&a, p, l, g);
      EXPECT_EQ(*h.n, 0);
      EXPECT_EQ(*h.next, -1);
      for (int i = 0; i < s.budget; i++) {
        EXPECT_EQ(h.pos[i], -1);
        EXPECT_EQ(h.acc[i], 0.0f);
      }
    }
  lf_kv_arena_free(&a);
}

/* Eviction scope: `head` (one slot per layer and KV head, docs/DESIGN.md §3) against `layer` (one slot
 * per layer shared by all its KV heads, as the released LongFlow code does).
 *
 * The layer-scope oracle (tests/evict_oracle.h over all the layer's KV heads) shares no code
 * with attention.c: it sums the per-head LongFlow scores s_g,i = ||v_g,i||_1 * sum_h alpha_h,i
 * over the layer's heads and finds the argmin by sorting. Fresh random data every run (seed
 * printed; replay with LF_TEST_SEED=<seed>).
 */
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "attention/attention.h"
#include "engine/forward.h"
#include "engine/model.h"
#include "lfserve.h"
#include "memory/pool.h"
#include "tests/engine_test_util.h"
#include "tests/evict_oracle.h"
#include "tests/test_util.h"

namespace {

/* Layer scope; window 8 unless given. */
lf_attn_params make_params(lf_policy pol, int sink, int group, int head_dim, int recent = 0,
                           int window = 8) {
  lf_attn_params p = attn_params(pol, sink, group, head_dim, recent, window);
  p.scope = LF_EVICT_LAYER;
  return p;
}

struct Stats {
  long steps = 0, evictions = 0, near_ties = 0, resyncs = 0, head_scope_diverged = 0;
};

/* Layer scope against the oracle, in lockstep, for `steps` decode steps. Alongside, the same
 * data runs through per-head (scope head) calls on a second arena, to show they differ. */
void lockstep(const lf_attn_params &p, int B, int n_kv, int steps, std::mt19937_64 &gen,
              Stats &st) {
  SCOPED_TRACE(::testing::Message() << "policy " << p.policy << " B " << B << " G " << p.group
                                    << " D " << p.head_dim << " sink " << p.sink << " n_kv "
                                    << n_kv << " recent " << p.h2o_recent);
  const int G = p.group, D = p.head_dim;
  OnePool lay(n_kv, B, D), per(n_kv, B, D);
  std::vector<lf_kv_head> hs = lay.heads(), hp = per.heads();
  EvictOracle o(p, B, n_kv);
  lf_attn_scratch ws{};
  std::vector<float> out((size_t)n_kv * G * D), out_h((size_t)n_kv * G * D), scores(B);
  lf_attn_params ph = p;
  ph.scope = LF_EVICT_HEAD;
  for (int s = 0; s < steps && !::testing::Test::HasFatalFailure(); s++) {
    const float qsd = 0.5f + 2.0f * (float)(s % 5) / 4.0f;
    std::vector<float> q = lf_test_normal(gen, (size_t)n_kv * G * D, qsd), k = lf_test_normal(gen, (size_t)n_kv * D),
                       v = lf_test_normal(gen, (size_t)n_kv * D);
    ASSERT_TRUE(o.step(q.data(), k.data(), v.data(), s)) << "oracle has no slot at step " << s;
    const int w_lib = lf_kv_write_slot(&hs[0]);
    ASSERT_EQ(w_lib, o.w) << "step " << s;
    int ev = -1;
    std::fill(scores.begin(), scores.end(), NAN);
    ASSERT_EQ(lf_attn_decode_layer_ref(&p, hs.data(), n_kv, q.data(), k.data(), v.data(), s,
                                       out.data(), &ev, scores.data(), &ws),
              LF_OK)
        << lf_last_error();
    ASSERT_EQ(ev, o.evicted ? n_kv : 0) << "step " << s;
    st.evictions += ev;
    const int n = *hs[0].n;
    ASSERT_EQ(n, (int)o.slots.size());
    /* Every head: same n, same next, the same position in every slot, equal to the oracle's;
     * and its own k / v in the slot just written. */
    for (int g = 0; g < n_kv; g++) {
      ASSERT_EQ(*hs[g].n, n);
      ASSERT_EQ(*hs[g].next, *hs[0].next);
      for (int i = 0; i < n; i++)
        ASSERT_EQ(hs[g].pos[i], o.slots[i].pos) << "head " << g << " slot " << i;
      ASSERT_EQ(0, std::memcmp(hs[g].k + (size_t)o.w * D, k.data() + g * D, D * sizeof(float)));
      ASSERT_EQ(0, std::memcmp(hs[g].v + (size_t)o.w * D, v.data() + g * D, D * sizeof(float)));
      if (p.policy == LF_POLICY_H2O) {
        for (int i = 0; i < n; i++)
          ASSERT_EQ(hs[g].acc[i], o.slots[i].acc[g]) << "head " << g << " slot " << i;
      }
    }
    for (int i = 0; i < std::min(p.sink, n); i++)
      ASSERT_EQ(hs[0].pos[i], i);
    ASSERT_NO_FATAL_FAILURE(expect_oracle_out(o, out, scores, n, s));
    ASSERT_NO_FATAL_FAILURE(
        expect_oracle_next(o, *hs[0].next, p.sink, n, s, st.near_ties, st.resyncs));

    /* Scope head on the same data: outputs are attention over each head's own kept set, so they
     * equal layer scope's bit for bit while both hold the same slots (before any eviction). */
    for (int g = 0; g < n_kv; g++)
      ASSERT_EQ(lf_attn_decode_ref_ws(&ph, &hp[g], q.data() + (size_t)g * G * D,
                                      k.data() + (size_t)g * D, v.data() + (size_t)g * D, s,
                                      out_h.data() + (size_t)g * G * D, nullptr, nullptr, &ws),
                LF_OK)
          << lf_last_error();
    if (s < B) {
      ASSERT_EQ(0, std::memcmp(out.data(), out_h.data(), out.size() * sizeof(float)))
          << "step " << s;
    }
    bool diverged = false;
    for (int g = 1; g < n_kv && !diverged; g++)
      diverged = std::memcmp(hp[g].pos, hp[0].pos, sizeof(int32_t) * *hp[0].n) != 0;
    st.head_scope_diverged += diverged;
    st.steps++;
  }
  lf_attn_scratch_free(&ws);
}

void report(const char *what, const Stats &st) {
  std::printf("[ layer    ] %s: %ld steps, %ld evictions, %ld near-ties, %ld resyncs; scope head "
              "kept different positions across heads on %ld steps\n",
              what, st.steps, st.evictions, st.near_ties, st.resyncs, st.head_scope_diverged);
}

} // namespace

TEST(LayerScope, LongflowLockstepWithOracle) {
  std::mt19937_64 gen(lf_test_seed_for("LayerScope.LongflowLockstepWithOracle"));
  Stats st;
  struct Cfg {
    int B, G, D, sink, n_kv, steps;
  } fixed[] = {{4, 1, 4, 2, 2, 300},  {6, 3, 8, 4, 4, 300},   {5, 8, 64, 0, 2, 200},
               {64, 4, 32, 4, 2, 400}, {33, 2, 16, 1, 3, 400}, {40, 1, 8, 4, 1, 300}};
  for (const Cfg &c : fixed)
    lockstep(make_params(LF_POLICY_LONGFLOW, c.sink, c.G, c.D), c.B, c.n_kv, c.steps, gen, st);
  std::uniform_int_distribution<int> u(0, 1 << 30);
  const int dims[] = {4, 8, 16, 32, 64};
  for (int r = 0; r < 30 && !HasFatalFailure(); r++) {
    const int B = 4 + u(gen) % 61, sink = u(gen) % (std::min(4, B - 2) + 1);
    const int G = 1 + u(gen) % 6, D = dims[u(gen) % 5], n_kv = 1 + u(gen) % 4;
    lockstep(make_params(LF_POLICY_LONGFLOW, sink, G, D), B, n_kv, 200 + u(gen) % 200, gen, st);
  }
  report("longflow", st);
  EXPECT_LT(st.resyncs * 1000, st.steps + 1000);
  EXPECT_GT(st.evictions, 0);
  /* The scopes really differ: per-head eviction lets the heads keep different positions. */
  EXPECT_GT(st.head_scope_diverged, 0);
}

TEST(LayerScope, H2OAndStreamingLockstepWithOracle) {
  std::mt19937_64 gen(lf_test_seed_for("LayerScope.H2OAndStreamingLockstepWithOracle"));
  Stats st;
  for (int r = 0; r < 12 && !HasFatalFailure(); r++) {
    const int sink = r % 3, recent = r % 4, n_kv = 1 + r % 3, G = 1 + r % 4;
    lockstep(make_params(LF_POLICY_H2O, sink, G, 8, recent), sink + recent + 2 + r * 3, n_kv, 200,
             gen, st);
    lockstep(make_params(LF_POLICY_STREAMING, sink, G, 8), sink + 2 + r * 3, n_kv, 150, gen, st);
  }
  report("h2o + streaming", st);
  EXPECT_LT(st.resyncs * 1000, st.steps + 1000);
}

/* With one KV head, layer scope is head scope: the same bits everywhere. And lf_attn_decode_ref
 * (its own scratch) equals lf_attn_decode_ref_ws (reused scratch). */
TEST(LayerScope, OneHeadEqualsHeadScope) {
  std::mt19937_64 gen(lf_test_seed_for("LayerScope.OneHeadEqualsHeadScope"));
  for (lf_policy pol : {LF_POLICY_LONGFLOW, LF_POLICY_H2O, LF_POLICY_STREAMING}) {
    const int B = 24, G = 3, D = 16;
    lf_attn_params p = make_params(pol, 4, G, D, 3);
    OnePool a(1, B, D), b(1, B, D), c(1, B, D);
    lf_kv_head ha = a.heads()[0], hb = b.heads()[0], hc = c.heads()[0];
    lf_attn_scratch ws{};
    std::vector<float> oa(G * D), ob(G * D), oc(G * D), sa(B), sb(B), sc(B);
    for (int s = 0; s < 150; s++) {
      std::vector<float> q = lf_test_normal(gen, G * D, 2.0f), k = lf_test_normal(gen, D), v = lf_test_normal(gen, D);
      int ea = 0, eb = 0, ec = 0;
      ASSERT_EQ(lf_attn_decode_layer_ref(&p, &ha, 1, q.data(), k.data(), v.data(), s, oa.data(),
                                         &ea, sa.data(), &ws),
                LF_OK);
      ASSERT_EQ(lf_attn_decode_ref(&p, &hb, q.data(), k.data(), v.data(), s, ob.data(), &eb,
                                   sb.data()),
                LF_OK);
      ASSERT_EQ(lf_attn_decode_ref_ws(&p, &hc, q.data(), k.data(), v.data(), s, oc.data(), &ec,
                                      sc.data(), &ws),
                LF_OK);
      ASSERT_EQ(ea, eb);
      ASSERT_EQ(ea, ec);
      ASSERT_EQ(0, std::memcmp(oa.data(), ob.data(), oa.size() * sizeof(float)));
      ASSERT_EQ(0, std::memcmp(oa.data(), oc.data(), oa.size() * sizeof(float)));
      ASSERT_EQ(0, std::memcmp(sa.data(), sb.data(), sizeof(float) * *ha.n));
      ASSERT_EQ(*ha.next, *hb.next);
      ASSERT_EQ(*ha.next, *hc.next);
      ASSERT_EQ(0, std::memcmp(ha.pos, hb.pos, sizeof(int32_t) * B));
      ASSERT_EQ(0, std::memcmp(ha.acc, hb.acc, sizeof(float) * B));
    }
    lf_attn_scratch_free(&ws);
  }
}

/* Heads that disagree (touched by per-head calls) are a state error that changes nothing. */
TEST(LayerScope, RejectsHeadsThatDisagree) {
  const int B = 6, G = 1, D = 4, n_kv = 2;
  lf_attn_params p = make_params(LF_POLICY_LONGFLOW, 1, G, D);
  OnePool a(n_kv, B, D);
  std::vector<lf_kv_head> hs = a.heads();
  float q[2 * D] = {1, 2, 3, 4, 4, 3, 2, 1}, k[2 * D] = {0}, v[2 * D] = {1, 1, 1, 1, 2, 2, 2, 2};
  float out[2 * D];
  ASSERT_EQ(lf_attn_decode_ref(&p, &hs[0], q, k, v, 0, out, nullptr, nullptr), LF_OK);
  EXPECT_EQ(lf_attn_decode_layer_ref(&p, hs.data(), n_kv, q, k, v, 1, out, nullptr, nullptr,
                                     nullptr),
            LF_ERR_STATE);
  EXPECT_EQ(*hs[0].n, 1);
  EXPECT_EQ(*hs[1].n, 0);
  EXPECT_EQ(lf_attn_decode_layer_ref(&p, hs.data(), 0, q, k, v, 1, out, nullptr, nullptr,
                                     nullptr),
            LF_ERR_INVALID_ARG);
  lf_attn_params bad = p;
  bad.scope = (lf_evict_scope)7;
  EXPECT_EQ(lf_attn_params_check(&bad, B), LF_ERR_INVALID_ARG);
  lf_evict_scope sc;
  EXPECT_EQ(lf_evict_scope_parse("layer", &sc), LF_OK);
  EXPECT_EQ(sc, LF_EVICT_LAYER);
  EXPECT_EQ(lf_evict_scope_parse("head", &sc), LF_OK);
  EXPECT_EQ(sc, LF_EVICT_HEAD);
  EXPECT_EQ(lf_evict_scope_parse("layers", &sc), LF_ERR_INVALID_ARG);
  EXPECT_STREQ(lf_evict_scope_str(LF_EVICT_LAYER), "layer");
}

/* Layer-wide SnapKV: the kept set is the top of the per-head SnapKV scores summed over the
 * layer's heads, computed here the long way; every head keeps it; outputs are plain causal
 * attention (the same as scope head's). */
TEST(LayerScope, PrefillSnapKVIsLayerWide) {
  std::mt19937_64 gen(lf_test_seed_for("LayerScope.PrefillSnapKVIsLayerWide"));
  long near = 0;
  for (int r = 0; r < 16 && !HasFatalFailure(); r++) {
    const int n_kv = 1 + r % 3, G = 1 + (r / 3) % 3, D = 8, B = 12 + r * 3, sink = r % 5,
              window = 4 + r % 6, P = B + 5 + r * 7;
    SCOPED_TRACE(::testing::Message() << "n_kv " << n_kv << " G " << G << " B " << B << " sink "
                                      << sink << " window " << window << " P " << P);
    lf_attn_params p = make_params(LF_POLICY_LONGFLOW, sink, G, D, 0, window);
    const size_t qs = (size_t)n_kv * G * D, ks = (size_t)n_kv * D;
    std::vector<float> q = lf_test_normal(gen, P * qs, 1.5f), k = lf_test_normal(gen, P * ks),
                       v = lf_test_normal(gen, P * ks);
    OnePool lay(n_kv, B, D), per(n_kv, B, D);
    std::vector<lf_kv_head> hs = lay.heads(), hp = per.heads();
    std::vector<float> out(P * qs, NAN), out_h(P * qs, NAN);
    uint64_t ev = 0;
    ASSERT_EQ(lf_attn_prefill_layer_ref(&p, hs.data(), n_kv, P, 0, q.data(), qs, k.data(),
                                        v.data(), ks, out.data(), qs, &ev, nullptr),
              LF_OK)
        << lf_last_error();
    EXPECT_EQ(ev, 0u);
    for (int g = 0; g < n_kv; g++)
      ASSERT_EQ(lf_attn_prefill_ref(&p, &hp[g], P, 0, q.data() + g * G * D, qs, k.data() + g * D,
                                    v.data() + g * D, ks, out_h.data() + g * G * D, qs, nullptr),
                LF_OK);
    ASSERT_EQ(0, std::memcmp(out.data(), out_h.data(), out.size() * sizeof(float)));

    /* Oracle: raw[j] = sum over heads g, their group's heads h and the last W queries t of
     * softmax_t(h)[j]; width-5 zero-padded average; top n_mid of [sink, L), ties lower. */
    const int W = std::max(0, std::min(window, B - 1 - sink)), L = P - W;
    std::vector<double> raw(L, 0.0);
    for (int g = 0; g < n_kv; g++)
      for (int h = 0; h < G; h++)
        for (int t = L; t < P; t++) {
          std::vector<double> l(t + 1);
          for (int j = 0; j <= t; j++) {
            double d = 0;
            for (int x = 0; x < D; x++)
              d += (double)q[t * qs + (g * G + h) * D + x] * k[j * ks + g * D + x];
            l[j] = d * (double)p.scale;
          }
          const double m = *std::max_element(l.begin(), l.end());
          double z = 0;
          for (double x : l)
            z += std::exp(x - m);
          for (int j = 0; j < L; j++)
            raw[j] += std::exp(l[j] - m) / z;
        }
    std::vector<int> mid;
    std::vector<double> pooled(L);
    for (int j = 0; j < L; j++) {
      double s = 0;
      for (int i = j - 2; i <= j + 2; i++)
        s += (i >= 0 && i < L) ? raw[i] : 0.0;
      pooled[j] = s / 5.0;
    }
    for (int j = sink; j < L; j++)
      mid.push_back(j);
    std::stable_sort(mid.begin(), mid.end(), [&](int a, int b) { return pooled[a] > pooled[b]; });
    const int n_mid = B - 1 - sink - W;
    std::vector<int> want;
    for (int j = 0; j < sink; j++)
      want.push_back(j);
    for (int i = 0; i < n_mid; i++)
      want.push_back(mid[i]);
    for (int j = L; j < P; j++)
      want.push_back(j);
    std::sort(want.begin(), want.end());
    ASSERT_EQ(*hs[0].n, B - 1);
    std::vector<int> got(hs[0].pos, hs[0].pos + B - 1);
    if (got != want) {
      /* only at a near-tie at the selection boundary */
      ASSERT_GT(n_mid, 0) << "kept set differs from layer-wide SnapKV";
      const double lo = pooled[mid[n_mid - 1]], hi = pooled[mid[n_mid]];
      ASSERT_LE(lo - hi, 1e-9 * std::fabs(lo)) << "kept set differs from layer-wide SnapKV";
      near++;
    }
    for (int g = 0; g < n_kv; g++) {
      ASSERT_EQ(*hs[g].n, B - 1);
      ASSERT_EQ(*hs[g].next, -1);
      for (int i = 0; i < B - 1; i++) {
        ASSERT_EQ(hs[g].pos[i], got[i]) << "head " << g << " slot " << i;
        ASSERT_EQ(0, std::memcmp(hs[g].k + i * D, &k[got[i] * ks + g * D], D * sizeof(float)));
        ASSERT_EQ(0, std::memcmp(hs[g].v + i * D, &v[got[i] * ks + g * D], D * sizeof(float)));
      }
    }
    /* Decoding on from there keeps the heads in step, and a chunk that overflows runs as
     * layer decode steps. */
    const int more = B;
    std::vector<float> q2 = lf_test_normal(gen, more * qs), k2 = lf_test_normal(gen, more * ks),
                       v2 = lf_test_normal(gen, more * ks), o2(more * qs);
    uint64_t ev2 = 0;
    ASSERT_EQ(lf_attn_prefill_layer_ref(&p, hs.data(), n_kv, more, P, q2.data(), qs, k2.data(),
                                        v2.data(), ks, o2.data(), qs, &ev2, nullptr),
              LF_OK)
        << lf_last_error();
    EXPECT_EQ(ev2, (uint64_t)(more - 1) * n_kv);
    for (int g = 1; g < n_kv; g++)
      ASSERT_EQ(0, std::memcmp(hs[g].pos, hs[0].pos, sizeof(int32_t) * B));
  }
  std::printf("[ snapkv   ] layer-wide near-ties accepted: %ld\n", near);
}

/* ---------------------------------------------------------------------------------------------
 * End to end: the forward and the engine with layer scope. */

namespace {

using GenRun = LfRun;

/* policy and h2o_recent: the engine's defaults (longflow) unless given */
GenRun generate(const std::string &model, lf_evict_scope scope, lf_backend_kind backend, int budget,
                const std::vector<int32_t> &prompt, int max_tokens,
                lf_policy policy = LF_POLICY_LONGFLOW, int h2o_recent = 0, int rkv_stage = 0,
                int rkv_obs = 0) {
  lf_engine_config cfg;
  lf_engine_config_default(&cfg);
  cfg.model_path = model.c_str();
  cfg.backend = backend;
  cfg.budget = budget;
  cfg.evict_scope = scope;
  cfg.policy = policy;
  cfg.h2o_recent = h2o_recent;
  cfg.rkv_stage = rkv_stage;
  cfg.rkv_obs = rkv_obs;
  GenRun r = lf_test_run_one(cfg, prompt, max_tokens, true);
  if (r.init == LF_OK) {
    EXPECT_NE(r.reason, LF_FINISH_ERROR) << lf_status_str(r.finish_status);
  }
  return r;
}

struct GroupRun {
  std::vector<int32_t> tokens;
  std::vector<std::vector<int32_t>> pos; /* [layer * n_kv + head][B] */
  std::vector<int32_t> n, next;          /* [layer * n_kv + head] */
  uint64_t evictions = 0;
};

/* The cpu forward on `model` with a pool of B slots: a 40-token prompt (compressed), then 100
 * greedy decode steps that evict; the pools at the end. */
GroupRun run_groups(const std::string &model, lf_evict_scope scope, int groups, int B) {
  GroupRun r;
  lf_checkpoint ck;
  EXPECT_EQ(lf_checkpoint_open(model.c_str(), &ck), LF_OK) << lf_last_error();
  lf_weights w;
  EXPECT_EQ(lf_weights_load_f32(&ck, &w), LF_OK) << lf_last_error();
  const lf_model_config &c = ck.cfg;
  lf_kv_arena arena;
  lf_pool_shape ps = {1, c.n_layers, c.n_kv_heads, B, c.head_dim, 0, 0, nullptr};
  EXPECT_EQ(lf_kv_arena_init(&arena, &ps), LF_OK);
  int pool = -1;
  EXPECT_EQ(lf_kv_arena_take(&arena, &pool), LF_OK);
  lf_attn_params ap = make_params(LF_POLICY_LONGFLOW, 4, c.n_heads / c.n_kv_heads, c.head_dim, 0,
                                  8);
  ap.scope = scope;
  ap.scope_groups = groups;
  lf_cpu_forward f;
  EXPECT_EQ(lf_cpu_forward_init(&f, &c, &w, &arena, &ap), LF_OK) << lf_last_error();
  std::vector<int32_t> prompt;
  for (int i = 0; i < 40; i++) prompt.push_back(1 + (i * 37) % (c.vocab_size - 1));
  std::vector<float> logits(c.vocab_size);
  EXPECT_EQ(lf_cpu_forward_run(&f, pool, 0, (int)prompt.size(), prompt.data(), logits.data(),
                               nullptr, &r.evictions),
            LF_OK)
      << lf_last_error();
  int32_t pos = (int32_t)prompt.size();
  for (int s = 0; s < 100; s++, pos++) {
    const int32_t tok = (int32_t)(std::max_element(logits.begin(), logits.end()) - logits.begin());
    r.tokens.push_back(tok);
    EXPECT_EQ(lf_cpu_forward_run(&f, pool, pos, 1, &tok, logits.data(), nullptr, &r.evictions),
              LF_OK)
        << lf_last_error();
  }
  for (int l = 0; l < c.n_layers; l++)
    for (int g = 0; g < c.n_kv_heads; g++) {
      lf_kv_head h = lf_kv_arena_head(&arena, pool, l, g);
      r.pos.emplace_back(h.pos, h.pos + B);
      r.n.push_back(*h.n);
      r.next.push_back(*h.next);
    }
  lf_cpu_forward_free(&f);
  lf_kv_arena_free(&arena);
  lf_weights_free(&ck.cfg, &w);
  lf_checkpoint_close(&ck);
  return r;
}
} // namespace

/* The cpu forward with layer scope keeps every layer's heads in step through a compressed
 * prompt and many evicting decode steps. */
TEST(LayerScope, ForwardKeepsLayerHeadsInStep) {
  const std::string dir = lf_repo_data_dir() + "/hf_tiny/llama";
  lf_checkpoint ck;
  ASSERT_EQ(lf_checkpoint_open(dir.c_str(), &ck), LF_OK) << lf_last_error();
  const int L = ck.cfg.n_layers, hkv = ck.cfg.n_kv_heads;
  lf_checkpoint_close(&ck);
  ASSERT_GT(hkv, 1);
  const int B = 24;
  const GroupRun r = run_groups(dir, LF_EVICT_LAYER, 0, B);
  EXPECT_EQ(r.evictions, (uint64_t)(100 - 1) * L * hkv);
  for (int l = 0; l < L; l++) {
    ASSERT_EQ(r.n[size_t(l * hkv)], B);
    for (int g = 1; g < hkv; g++) {
      ASSERT_EQ(r.next[size_t(l * hkv + g)], r.next[size_t(l * hkv)]);
      ASSERT_EQ(r.pos[size_t(l * hkv + g)], r.pos[size_t(l * hkv)]) << "layer " << l;
    }
  }
}

/* Eviction groups (what T tensor-parallel ranks do, on one rank): with the 4 KV heads of
 * random:tiny-llama-kv4 in 2 groups, heads {0,1} and {2,3} each stay in step through a compressed
 * prompt and 100 evicting decode steps, and the two groups choose differently; 4 groups of one
 * head are head scope, token for token and slot for slot. */
TEST(LayerScope, GroupsSplitTheLayer) {
  const int B = 24, hkv = 4, layers = 4;
  GroupRun two = run_groups("random:tiny-llama-kv4", LF_EVICT_LAYER, 2, B);
  ASSERT_EQ((int)two.pos.size(), layers * hkv);
  bool groups_differ = false;
  for (int l = 0; l < layers; l++) {
    const auto &p = two.pos;
    EXPECT_EQ(p[l * hkv + 0], p[l * hkv + 1]) << "layer " << l << ": heads 0 and 1 share a slot";
    EXPECT_EQ(p[l * hkv + 2], p[l * hkv + 3]) << "layer " << l << ": heads 2 and 3 share a slot";
    groups_differ |= p[l * hkv + 0] != p[l * hkv + 2];
  }
  EXPECT_TRUE(groups_differ) << "the two groups never chose differently: the test saw nothing";
  GroupRun one = run_groups("random:tiny-llama-kv4", LF_EVICT_LAYER, 1, B);
  bool layer_differs = false;
  for (int l = 0; l < layers; l++) {
    for (int g = 1; g < hkv; g++) EXPECT_EQ(one.pos[l * hkv], one.pos[l * hkv + g]);
    layer_differs |= one.pos[l * hkv] != two.pos[l * hkv] || one.pos[l * hkv] != two.pos[l * hkv + 2];
  }
  EXPECT_TRUE(layer_differs) << "two groups evicted exactly as one";
  GroupRun four = run_groups("random:tiny-llama-kv4", LF_EVICT_LAYER, 4, B);
  GroupRun head = run_groups("random:tiny-llama-kv4", LF_EVICT_HEAD, 0, B);
  EXPECT_EQ(four.tokens, head.tokens);
  EXPECT_EQ(four.pos, head.pos);
  EXPECT_EQ(four.evictions, head.evictions);
  EXPECT_EQ(two.evictions, head.evictions); /* one overwrite per head per step in every scope */
}

TEST(LayerScope, GroupsMustSplitTheHeads) {
  for (auto [scope, groups, want] : {std::tuple{LF_EVICT_LAYER, 3, LF_ERR_INVALID_ARG},
                                     std::tuple{LF_EVICT_HEAD, 2, LF_ERR_INVALID_ARG},
                                     std::tuple{LF_EVICT_LAYER, -1, LF_ERR_INVALID_ARG},
                                     std::tuple{LF_EVICT_LAYER, 2, LF_OK}}) {
    lf_engine_config cfg;
    lf_engine_config_default(&cfg);
    cfg.model_path = "random:tiny-llama-kv4";
    cfg.backend = LF_BACKEND_CPU;
    cfg.budget = 32;
    cfg.evict_scope = scope;
    cfg.evict_groups = groups;
    lf_engine_t e = nullptr;
    EXPECT_EQ(lf_engine_init(&cfg, nullptr, &e), want)
        << lf_evict_scope_str(scope) << " groups " << groups << ": " << lf_last_error();
    if (want != LF_OK) {
      EXPECT_NE(std::string(lf_last_error()).find("groups"), std::string::npos);
    }
    lf_engine_free(e);
  }
}

TEST(LayerScope, EngineEndToEnd) {
  const std::string dir = lf_repo_data_dir() + "/hf_tiny/llama";
  std::vector<int32_t> prompt = {1, 17, 42, 99, 7, 3, 250, 11};
  const int max_tokens = 200, budget = 32;
  GenRun lay = generate(dir, LF_EVICT_LAYER, LF_BACKEND_CPU, budget, prompt, max_tokens);
  ASSERT_EQ(lay.init, LF_OK) << lf_last_error();
  EXPECT_EQ((int)lay.tokens.size(), max_tokens);
  EXPECT_EQ(lay.stats.slots_filled, budget);
  /* every token past the pool's free slots overwrites one slot in each layer x KV head (2 x 2) */
  const int written = (int)prompt.size() + max_tokens - 1;
  EXPECT_EQ(lay.stats.evictions, (uint64_t)(written - budget) * 2 * 2);
  GenRun head = generate(dir, LF_EVICT_HEAD, LF_BACKEND_CPU, budget, prompt, max_tokens);
  ASSERT_EQ(head.init, LF_OK) << lf_last_error();
  EXPECT_EQ(head.stats.evictions, lay.stats.evictions);
  /* A pool that never fills: no eviction, so both scopes give the same tokens. */
  GenRun lay_big = generate(dir, LF_EVICT_LAYER, LF_BACKEND_CPU, 256, prompt, 100);
  GenRun head_big = generate(dir, LF_EVICT_HEAD, LF_BACKEND_CPU, 256, prompt, 100);
  EXPECT_EQ(lay_big.tokens, head_big.tokens);
  EXPECT_EQ(lay_big.stats.evictions, 0u);

  /* (cuda: tests/gpu_layer_scope.cpp; tensor parallelism: tests/mpi_tp.cpp) */
  GenRun bad = generate(dir, (lf_evict_scope)5, LF_BACKEND_CPU, budget, prompt, 4);
  EXPECT_EQ(bad.init, LF_ERR_INVALID_ARG);
}

/* lf_engine_config.h2o_recent reaches the backend: 0 is budget / 2, the same tokens as asking
 * for B/2, other than a window of 4; a negative value or one that leaves no room is refused. */
TEST(H2ORecent, EngineDefaultIsHalfTheBudget) {
  const std::string dir = lf_repo_data_dir() + "/hf_tiny/llama";
  const std::vector<int32_t> prompt = {1, 17, 42, 99, 7, 3, 250, 11};
  const int budget = 32;
  for (lf_evict_scope scope : {LF_EVICT_HEAD, LF_EVICT_LAYER}) {
    auto run = [&](int recent) {
      return generate(dir, scope, LF_BACKEND_CPU, budget, prompt, 150, LF_POLICY_H2O, recent);
    };
    const GenRun def = run(0), half = run(budget / 2), small = run(4);
    ASSERT_EQ(def.init, LF_OK) << lf_last_error();
    ASSERT_EQ(half.init, LF_OK) << lf_last_error();
    ASSERT_EQ(small.init, LF_OK) << lf_last_error();
    EXPECT_EQ((int)def.tokens.size(), 150);
    EXPECT_GT(def.stats.evictions, 0u);
    EXPECT_EQ(def.tokens, half.tokens) << lf_evict_scope_str(scope);
    EXPECT_NE(def.tokens, small.tokens) << lf_evict_scope_str(scope);
    EXPECT_EQ(run(-1).init, LF_ERR_INVALID_ARG);
    EXPECT_EQ(run(budget - 4 - 1).init, LF_ERR_INVALID_ARG); /* budget < sink + recent + 2 */
    EXPECT_NE(std::string(lf_last_error()).find("h2o_recent"), std::string::npos) << lf_last_error();
  }
}

TEST(LayerScope, Stories260KWithLayerScope) {
  const std::string bin = lf_test_data_dir() + "/models/stories260K/stories260K.bin";
  if (!lf_path_exists(bin)) GTEST_SKIP() << "stories260K not found at " << bin;
  GenRun r = generate(bin, LF_EVICT_LAYER, LF_BACKEND_CPU, 64, {1}, 511);
  ASSERT_EQ(r.init, LF_OK) << lf_last_error();
  EXPECT_EQ(r.tokens.size(), 511u);
  EXPECT_EQ(r.stats.slots_filled, 64);
  EXPECT_EQ(r.stats.evictions, uint64_t(511 - 64) * 5 * 4);
}

/* rkv through the engine (the policy's step semantics are held to the simulator by
 * tests/test_evict_sim.py): rkv_stage 0 is LF_RKV_STAGE_DEFAULT (halved where it does not fit)
 * and reaches the backend, every scope evicts, the default window (budget / 2, lowered to fit)
 * reaches it too, a budget without room for a window and a given stage is refused, and a pool
 * taken again starts with no selection. */
TEST(Rkv, EngineStageAndBudget) {
  const std::string dir = lf_repo_data_dir() + "/hf_tiny/llama";
  const std::vector<int32_t> prompt = {1, 17, 42, 99, 7, 3, 250, 11};
  auto run = [&](lf_evict_scope scope, int budget, int stage, int obs = 0) {
    return generate(dir, scope, LF_BACKEND_CPU, budget, prompt, 150, LF_POLICY_RKV, 0, stage, obs);
  };
  /* sink + window + stage + 1 for half the default stage, which is what stage 0 becomes here
   * (the full default does not fit), the default window min(budget / 2, what is left) = 8; the
   * tiny model's 158 tokens tell stages apart at this budget, not at the full default's 141 */
  const int half_stage = LF_RKV_STAGE_DEFAULT / 2, need = 4 + LF_RKV_OBS + half_stage + 1;
  for (lf_evict_scope scope : {LF_EVICT_HEAD, LF_EVICT_LAYER}) {
    const GenRun def = run(scope, need, 0), same = run(scope, need, half_stage),
                 other = run(scope, need, 4);
    ASSERT_EQ(def.init, LF_OK) << lf_last_error();
    ASSERT_EQ(same.init, LF_OK) << lf_last_error();
    ASSERT_EQ(other.init, LF_OK) << lf_last_error();
    EXPECT_EQ((int)def.tokens.size(), 150);
    /* every token past the pool's free slots overwrites a slot in each layer x KV head */
    EXPECT_EQ(def.stats.evictions, (uint64_t)((int)prompt.size() + 150 - 1 - need) * 2 * 2);
    EXPECT_EQ(def.tokens, same.tokens) << lf_evict_scope_str(scope);
    EXPECT_NE(def.tokens, other.tokens) << lf_evict_scope_str(scope);
    EXPECT_EQ(run(scope, need + half_stage, 0).tokens,
              run(scope, need + half_stage, LF_RKV_STAGE_DEFAULT).tokens)
        << "the full default where it fits";
    /* the default window here is 8 (min(need / 2, need - 4 - 64 - 1)): R-KV's, as given */
    EXPECT_EQ(def.tokens, run(scope, need, 0, LF_RKV_OBS).tokens) << lf_evict_scope_str(scope);
    EXPECT_NE(def.tokens, run(scope, need, 0, 4).tokens) << lf_evict_scope_str(scope);
    /* a budget below the full default's halves the stage (140: 64) and its default window is
     * budget / 2 (70, which fits beside 4 + 64 + 1; 158 tokens, so a selection runs; the tiny
     * model's tokens do not tell 70 from 8 apart: the window's semantics are
     * test_evict_sim.py's), and a given stage and window that leave no room are refused by the
     * backend's check */
    const GenRun half = run(scope, 140, 0);
    EXPECT_GT(half.stats.evictions, 0u);
    EXPECT_EQ(half.tokens, run(scope, 140, 64, 70).tokens) << lf_evict_scope_str(scope);
    EXPECT_EQ(run(scope, 140, 64, 72).init, LF_ERR_INVALID_ARG) << "140 < 4 + 72 + 64 + 1";
    EXPECT_EQ(run(scope, need, LF_RKV_STAGE_DEFAULT, LF_RKV_OBS + 1).init, LF_ERR_INVALID_ARG)
        << "no room";
    EXPECT_NE(std::string(lf_last_error()).find("rkv_obs"), std::string::npos) << lf_last_error();
    /* no room beside the sinks and a given stage at all */
    EXPECT_EQ(run(scope, 4 + LF_RKV_STAGE_DEFAULT + 1, LF_RKV_STAGE_DEFAULT).init,
              LF_ERR_INVALID_ARG);
    EXPECT_NE(std::string(lf_last_error()).find("rkv_stage"), std::string::npos) << lf_last_error();
    EXPECT_EQ(run(scope, need, -1).init, LF_ERR_INVALID_ARG);
  }
}

TEST(Rkv, PoolStateResetOnTake) {
  lf_kv_arena a;
  lf_pool_shape ps = {2, 2, 2, 32, 8, 0, 5, nullptr};
  ASSERT_EQ(lf_kv_arena_init(&a, &ps), LF_OK) << lf_last_error();
  int pool = -1;
  ASSERT_EQ(lf_kv_arena_take(&a, &pool), LF_OK);
  lf_kv_head h = lf_kv_arena_head(&a, pool, 1, 1);
  ASSERT_NE(h.queue, nullptr);
  ASSERT_NE(h.since, nullptr);
  EXPECT_EQ(h.stage, 5);
  EXPECT_EQ(*h.since, -1);
  *h.since = 3;
  ASSERT_EQ(lf_kv_arena_give(&a, pool), LF_OK);
  int again = -1;
  ASSERT_EQ(lf_kv_arena_take(&a, &again), LF_OK);
  EXPECT_EQ(*lf_kv_arena_head(&a, again, 1, 1).since, -1);
  /* without rkv the arena holds no such state; a stage as large as the budget is refused */
  lf_kv_arena b;
  lf_pool_shape plain = {1, 1, 1, 8, 8, 0, 0, nullptr};
  ASSERT_EQ(lf_kv_arena_init(&b, &plain), LF_OK);
  EXPECT_EQ(lf_kv_arena_head(&b, 0, 0, 0).queue, nullptr);
  lf_pool_shape bad = {1, 1, 1, 8, 8, 0, 8, nullptr};
  lf_kv_arena c;
  EXPECT_EQ(lf_kv_arena_init(&c, &bad), LF_ERR_INVALID_ARG);
  lf_kv_arena_free(&a);
  lf_kv_arena_free(&b);
}

// lf_engine_resolved_config: the settings the engine reports are the ones it runs with, defaults
// resolved (a budget of 0 is the model's context, h2o_recent 0 is B/2, rkv_stage 0 is
// LF_RKV_STAGE_DEFAULT halved to fit, rkv_obs 0 is B/2 where it fits, the pool count comes from kv_memory_bytes), and where the engine's
// behaviour shows a setting (pools held, prompt chunks) it agrees with the report.
#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <vector>

#include "attention/attention.h"
#include "lfserve.h"
#include "memory/pool.h"
#include "sched_util.h"

namespace {

lf_resolved_config resolved(const lf_engine_config &cfg) {
  lf_engine_t e = nullptr;
  lf_resolved_config r{};
  EXPECT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_OK) << lf_last_error();
  if (!e) return r;
  EXPECT_EQ(lf_engine_resolved_config(e, &r), LF_OK) << lf_last_error();
  lf_engine_free(e);
  return r;
}

TEST(EngineResolved, DefaultsResolve) {
  lf_engine_config cfg = base_config(tiny_llama(), LF_POLICY_LONGFLOW, 0, 2, 0);
  cfg.backend = LF_BACKEND_AUTO;
  const lf_resolved_config r = resolved(cfg);
  EXPECT_EQ(r.backend, LF_BACKEND_CPU); // a build without CUDA
  EXPECT_EQ(r.policy, LF_POLICY_LONGFLOW);
  EXPECT_EQ(r.evict_scope, LF_EVICT_LAYER);
  EXPECT_EQ(r.kv_dtype, LF_KV_BF16);
  EXPECT_EQ(r.max_seq_len, 512); // tests/data/hf_tiny/llama: max_position_embeddings
  EXPECT_EQ(r.budget, 512) << "budget 0 is the model's context";
  EXPECT_EQ(r.sink, 4);
  EXPECT_EQ(r.window, 32);
  EXPECT_EQ(r.h2o_recent, 0) << "not h2o";
  EXPECT_EQ(r.rkv_stage, 0) << "not rkv";
  EXPECT_EQ(r.rkv_obs, 0) << "not rkv";
  EXPECT_EQ(r.n_pools, 2);
  EXPECT_EQ(r.max_batch_tokens, 0);
  EXPECT_EQ(r.n_ranks, 1);
}

TEST(EngineResolved, H2oRecentDefaultsToHalfTheBudget) {
  lf_engine_config cfg = base_config(tiny_llama(), LF_POLICY_H2O, 64, 1, 16);
  EXPECT_EQ(resolved(cfg).h2o_recent, 32);
  cfg.budget = 65;
  EXPECT_EQ(resolved(cfg).h2o_recent, 32);
  cfg.h2o_recent = 10;
  EXPECT_EQ(resolved(cfg).h2o_recent, 10);
}

/* rkv_stage 0 is LF_RKV_STAGE_DEFAULT where the budget has room for it beside the sinks and the
 * smallest window (sink + 8 + stage + 1), else halved until it has; a given stage is kept (and
 * refused by the backend's check when it does not fit). */
TEST(EngineResolved, RkvStageDefault) {
  EXPECT_EQ(LF_RKV_STAGE_DEFAULT, 128);
  lf_engine_config cfg = base_config(tiny_llama(), LF_POLICY_RKV, 4 + 8 + 128 + 1, 1, 16);
  EXPECT_EQ(resolved(cfg).rkv_stage, 128);
  cfg.budget = 4 + 8 + 128; /* one short: 64 */
  EXPECT_EQ(resolved(cfg).rkv_stage, 64);
  cfg.budget = 4 + 8 + 32 + 1;
  EXPECT_EQ(resolved(cfg).rkv_stage, 32);
  cfg.budget = 4 + 8 + 1 + 1;
  EXPECT_EQ(resolved(cfg).rkv_stage, 1);
  cfg.budget = 128;
  cfg.rkv_stage = 8;
  EXPECT_EQ(resolved(cfg).rkv_stage, 8);
  EXPECT_EQ(lf_rkv_stage_resolve(0, 4 + 8 + 1, 4, 0), 1) << "no room at all: 1, then refused";
  EXPECT_EQ(lf_rkv_stage_resolve(0, 4 + 32 + 64 + 1, 4, 32), 64) << "a given window counts";
  EXPECT_EQ(lf_rkv_stage_resolve(96, 50, 4, 0), 96) << "a given stage is kept";
}

/* rkv_obs 0 is budget / 2, lowered to what the budget leaves beside sink + stage + 1; a given
 * window is kept as given. */
TEST(EngineResolved, RkvObsDefaultsToHalfTheBudget) {
  lf_engine_config cfg = base_config(tiny_llama(), LF_POLICY_RKV, 400, 1, 16);
  EXPECT_EQ(resolved(cfg).rkv_obs, 200);
  cfg.budget = 401;
  EXPECT_EQ(resolved(cfg).rkv_obs, 200);
  cfg.budget = 256; /* 256 - 4 - 128 - 1 = 123 < 128 */
  EXPECT_EQ(resolved(cfg).rkv_obs, 123);
  cfg.budget = 128; /* stage 64: 128 - 4 - 64 - 1 = 59 < 64 */
  EXPECT_EQ(resolved(cfg).rkv_obs, 59);
  cfg.rkv_obs = 8;
  EXPECT_EQ(resolved(cfg).rkv_obs, 8);
  EXPECT_EQ(lf_rkv_obs_resolve(0, 69, 4, 64), LF_RKV_OBS) << "no room: R-KV's, then refused";
}

TEST(EngineResolved, PoolsFromKvMemoryAreThePoolsHeld) {
  lf_engine_config cfg = base_config(tiny_llama(), LF_POLICY_LONGFLOW, 48, 1, 16);
  lf_engine_t e = nullptr;
  ASSERT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_OK) << lf_last_error();
  lf_pool_sizing ps{};
  ASSERT_EQ(lf_engine_pool_sizing(e, &ps), LF_OK);
  lf_engine_free(e);
  ASSERT_GT(ps.pool_bytes, 0u);

  cfg.n_pools = 0;
  cfg.kv_memory_bytes = ps.pool_bytes * 5 + ps.pool_bytes / 2;
  cfg.mem_util = 1.0;
  ASSERT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_OK) << lf_last_error();
  lf_resolved_config r{};
  ASSERT_EQ(lf_engine_resolved_config(e, &r), LF_OK);
  EXPECT_EQ(r.n_pools, 5);
  lf_metrics m{};
  ASSERT_EQ(lf_engine_metrics(e, &m), LF_OK);
  EXPECT_EQ(m.pools_total, r.n_pools);
  lf_engine_free(e);

  cfg.max_pools = 3; // a cap on a count sized from memory
  EXPECT_EQ(resolved(cfg).n_pools, 3);
}

TEST(EngineResolved, ChunkSizeIsTheOneThePromptRunsIn) {
  lf_engine_config cfg = base_config(tiny_llama(), LF_POLICY_LONGFLOW, 0, 1,
                                     LF_MAX_BATCH_TOKENS_DEFAULT);
  cfg.max_batch_tokens = 16;
  lf_engine_t e = nullptr;
  ASSERT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_OK) << lf_last_error();
  lf_resolved_config r{};
  ASSERT_EQ(lf_engine_resolved_config(e, &r), LF_OK);
  ASSERT_EQ(r.max_batch_tokens, 16);
  std::vector<int32_t> prompt(40);
  for (size_t i = 0; i < prompt.size(); i++)
    prompt[i] = int32_t(3 + i % 200);
  lf_request rq{};
  rq.prompt = prompt.data();
  rq.n_prompt = int(prompt.size());
  rq.max_tokens = 2;
  rq.ignore_eos = 1;
  uint64_t id = 0;
  ASSERT_EQ(lf_engine_submit(e, &rq, &id), LF_OK) << lf_last_error();
  lf_event ev[16];
  while (lf_engine_busy(e)) {
    int n = 0;
    ASSERT_EQ(lf_engine_step(e, ev, 16, &n), LF_OK) << lf_last_error();
  }
  lf_request_stats st{};
  ASSERT_EQ(lf_engine_request_stats(e, id, &st), LF_OK);
  EXPECT_EQ(st.prefill_chunks, (rq.n_prompt + r.max_batch_tokens - 1) / r.max_batch_tokens);
  lf_engine_free(e);
}

TEST(EngineResolved, NullArgumentsAndAbiSize) {
  lf_resolved_config r{};
  EXPECT_EQ(lf_engine_resolved_config(nullptr, &r), LF_ERR_INVALID_ARG);
  EXPECT_EQ(lf_abi_sizeof("lf_resolved_config"), sizeof(lf_resolved_config));
  EXPECT_EQ(lf_abi_sizeof("lf_pool_sizing"), sizeof(lf_pool_sizing));
}

} // namespace

namespace {

/* The rule of lf_engine_config.layer_weights (tools/evict/run.py's ada_budgets): floor of the
 * share, at least 16, then one slot to layers 0, 1, ... until the total is budget x L. */
TEST(LayerBudgets, RuleFromWeights) {
  int b[3];
  const double even[3] = {1, 1, 1};
  ASSERT_EQ(lf_layer_budgets_from_weights(even, 3, 10, b), LF_OK);
  EXPECT_EQ(std::vector<int>(b, b + 3), (std::vector<int>{16, 16, 16})) << "at least 16 each";
  const double w[3] = {1, 2, 4}; /* 300 slots: 42.86, 85.71, 171.43 -> 42, 85, 171 (+2) */
  ASSERT_EQ(lf_layer_budgets_from_weights(w, 3, 100, b), LF_OK);
  EXPECT_EQ(std::vector<int>(b, b + 3), (std::vector<int>{43, 86, 171}));
  const double skew[2] = {1, 100}; /* 40 slots: 0.40 -> 16, 39.6 -> 39; over the total, kept */
  ASSERT_EQ(lf_layer_budgets_from_weights(skew, 2, 20, b), LF_OK);
  EXPECT_EQ(std::vector<int>(b, b + 2), (std::vector<int>{16, 39}));
  const double bad[2] = {1, 0};
  EXPECT_EQ(lf_layer_budgets_from_weights(bad, 2, 20, b), LF_ERR_INVALID_ARG);
  const double nan[2] = {1, NAN};
  EXPECT_EQ(lf_layer_budgets_from_weights(nan, 2, 20, b), LF_ERR_INVALID_ARG);
  const double huge[4] = {8, 1e308, 8, 1e308}; /* the sum overflows (found by fuzz_weights) */
  EXPECT_EQ(lf_layer_budgets_from_weights(huge, 4, 20, b), LF_ERR_INVALID_ARG);
  const double big[2] = {1, 1};
  EXPECT_EQ(lf_layer_budgets_from_weights(big, 2, INT_MAX, b), LF_ERR_INVALID_ARG);
}

/* Per-layer pools on the cpu arena: each (pool, layer, head) view has its layer's budget, the
 * views tile the arena without overlap, and the pool's bytes count the per-layer slots. */
TEST(LayerBudgets, ArenaViews) {
  const int lb[3] = {5, 9, 7};
  lf_pool_shape s = {2, 3, 2, 7, 4, 0, 0, lb};
  lf_pool_shape uni = {2, 3, 2, 7, 4, 0, 0, nullptr};
  EXPECT_EQ(lf_pool_layer_slots(&s), 21u);
  EXPECT_EQ(lf_pool_bytes(&s), lf_pool_bytes(&uni)) << "the same 21 slots per head over layers";
  EXPECT_EQ(lf_pool_bytes_device(&s, 1), lf_pool_bytes_device(&uni, 1));
  EXPECT_EQ(lf_pool_budget_min(&s), 5);
  EXPECT_EQ(lf_pool_budget_max(&s), 9);
  lf_kv_arena a;
  ASSERT_EQ(lf_kv_arena_init(&a, &s), LF_OK) << lf_last_error();
  std::vector<int> hits(size_t(2 * 21 * 2 * 4), 0);
  for (int p = 0; p < 2; p++)
    for (int l = 0; l < 3; l++)
      for (int h = 0; h < 2; h++) {
        lf_kv_head v = lf_kv_arena_head(&a, p, l, h);
        ASSERT_EQ(v.budget, lb[l]);
        for (int i = 0; i < v.budget * v.head_dim; i++) {
          const ptrdiff_t at = v.k + i - a.k;
          ASSERT_GE(at, 0);
          ASSERT_LT(size_t(at), hits.size());
          hits[size_t(at)]++;
        }
        EXPECT_EQ(v.pos[0], -1);
      }
  for (int x : hits) EXPECT_EQ(x, 1) << "every float of K in exactly one view";
  lf_kv_arena_free(&a);
  const int tiny[3] = {5, 1, 7};
  lf_pool_shape st = {1, 3, 1, 4, 4, 0, 2, tiny};
  EXPECT_EQ(lf_kv_arena_init(&a, &st), LF_ERR_INVALID_ARG) << "a stage must fit the smallest layer";
}

/* The engine with layer_weights: budgets from the rule, reported; windows from the smallest
 * layer; bad weights refused. Equal weights run exactly as uniform pools; uneven ones evict in
 * each layer from its own budget on (the eviction count, against the uniform run's). */
TEST(LayerBudgets, Engine) {
  const double w13[2] = {1.0, 3.0}; /* tiny llama: 2 layers; budget 48: 24 and 72 */
  lf_engine_config cfg = base_config(tiny_llama(), LF_POLICY_H2O, 48, 1, 0);
  cfg.layer_weights = w13;
  cfg.n_layer_weights = 2;
  lf_resolved_config r = resolved(cfg);
  EXPECT_EQ(r.budget, 48);
  EXPECT_EQ(r.budget_min, 24);
  EXPECT_EQ(r.budget_max, 72);
  EXPECT_EQ(r.h2o_recent, 12) << "the smallest layer's B/2";
  cfg.layer_weights = nullptr;
  cfg.n_layer_weights = 0;
  r = resolved(cfg);
  EXPECT_EQ(r.budget_min, 48);
  EXPECT_EQ(r.budget_max, 48);

  lf_engine_t e = nullptr;
  const double three[3] = {1, 1, 1};
  cfg.layer_weights = three;
  cfg.n_layer_weights = 3;
  EXPECT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_ERR_INVALID_ARG) << "one weight per layer";
  cfg.n_layer_weights = 2;
  cfg.policy = LF_POLICY_FULL;
  EXPECT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_ERR_INVALID_ARG) << "full keeps everything";
  cfg.policy = LF_POLICY_RKV;
  cfg.budget = 100;
  r = resolved(cfg); /* equal weights: 100 slots each; the default stage fits 100 as 64 */
  EXPECT_EQ(r.rkv_stage, 64);

  for (lf_policy pol : {LF_POLICY_H2O, LF_POLICY_RKV, LF_POLICY_LONGFLOW}) {
    lf_engine_config c = base_config(tiny_llama(), pol, 48, 1, 0);
    c.rkv_stage = 8;
    TestReq q;
    for (int i = 0; i < 20; i++) q.prompt.push_back(int32_t(3 + (i * 37) % 200));
    q.max_tokens = 120;
    const Outcome uni = run_alone(c, q);
    const double even[2] = {2.0, 2.0};
    c.layer_weights = even;
    c.n_layer_weights = 2;
    const Outcome eq = run_alone(c, q);
    EXPECT_EQ(eq.tokens, uni.tokens) << lf_policy_str(pol) << ": equal weights are uniform pools";
    EXPECT_EQ(eq.stats.evictions, uni.stats.evictions);
    c.layer_weights = w13;
    const Outcome un = run_alone(c, q);
    EXPECT_EQ(un.tokens.size(), uni.tokens.size());
    /* uniform: 2 layers x 2 KV heads evict per write past 48; per layer: past 24 and past 72 */
    ASSERT_GT(uni.stats.evictions, 0u);
    const uint64_t written = 48 + uni.stats.evictions / 4;
    EXPECT_EQ(un.stats.evictions, 2 * (written - 24) + 2 * (written - 72)) << lf_policy_str(pol);
  }
}

} // namespace

/* Helpers of the sampling-parameter tests (tests/test_sampling_params.cpp on the cpu backend,
 * tests/gpu_sampling_params.cpp on cuda): the processing rules written out, requests run on an
 * engine, and a backend's raw logits at every position of a sequence (one forward with
 * lf_batch_item.logits_all). */
#ifndef LF_SAMPLING_PARAMS_UTIL_H
#define LF_SAMPLING_PARAMS_UTIL_H

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "engine/backend.h"
#include "engine/model.h"
#include "engine/sample.h"
#include "lfserve.h"
#include "sched_util.h"
#include "test_util.h"

namespace sp_util {


struct Params {
  float presence = 0, frequency = 0, repetition = 1;
  std::map<int32_t, float> bias;
};

// The processed logits by the written-out rules: OpenAI's presence/frequency over the output,
// the HF/vLLM repetition penalty over prompt + output, bias first (vLLM's order), in double.
inline std::vector<double> brute(const std::vector<float> &logits, const std::vector<int32_t> &prompt,
                          const std::vector<int32_t> &out, const Params &p) {
  std::vector<double> l(logits.begin(), logits.end());
  std::map<int32_t, int> cnt;
  std::set<int32_t> seen(prompt.begin(), prompt.end());
  for (int32_t t : out) {
    cnt[t]++;
    seen.insert(t);
  }
  for (size_t t = 0; t < l.size(); t++) {
    auto b = p.bias.find(int32_t(t));
    if (b != p.bias.end()) l[t] += b->second;
    if (p.repetition != 1.0f && seen.count(int32_t(t)))
      l[t] = l[t] > 0 ? l[t] / p.repetition : l[t] * p.repetition;
    auto c = cnt.find(int32_t(t));
    if (c != cnt.end()) l[t] -= p.presence + p.frequency * c->second;
  }
  return l;
}

// ---- the engine on stories260K (CPU backend) ----------------------------------------------

struct RunOut {
  std::vector<int32_t> tokens;
  std::vector<lf_event> tok_ev, prompt_ev;
  lf_finish_reason reason = LF_FINISH_NONE;
};

struct Req {
  std::vector<int32_t> prompt;
  int max_tokens = 20;
  float temperature = 0;
  uint64_t seed = 0;
  Params p;
  int logprobs = 0, top = 0, prompt_lp = 0;
};

inline lf_status submit_req(lf_engine_t e, const Req &r, uint64_t *id) {
  lf_request rq{};
  rq.prompt = r.prompt.data();
  rq.n_prompt = int(r.prompt.size());
  rq.max_tokens = r.max_tokens;
  rq.ignore_eos = 1;
  rq.sampling.temperature = r.temperature;
  rq.sampling.top_p = 1.0f;
  rq.sampling.seed = r.seed;
  rq.sampling.presence_penalty = r.p.presence;
  rq.sampling.frequency_penalty = r.p.frequency;
  rq.sampling.repetition_penalty = r.p.repetition;
  std::vector<lf_logit_bias> b;
  for (auto &x : r.p.bias) b.push_back({x.first, x.second});
  rq.sampling.logit_bias = b.empty() ? nullptr : b.data();
  rq.sampling.n_logit_bias = int(b.size());
  rq.sampling.logprobs = r.logprobs;
  rq.sampling.top_logprobs = r.top;
  rq.sampling.prompt_logprobs = r.prompt_lp;
  return lf_engine_submit(e, &rq, id);
}

// Runs the requests together on one engine (as many pools as requests).
inline lf_backend_kind g_backend = LF_BACKEND_CPU; // which backend the engine and raw_logits use

/* The engine checks need stories260K from $LF_TEST_DATA (default ../shared): without it they skip,
 * naming the path (GTEST_SKIP in a helper marks the calling test skipped). */
#define SP_NEED_STORIES()                                                                          \
  do {                                                                                             \
    if (!lf_path_exists(stories_bin()))                                                            \
      GTEST_SKIP() << "stories260K not found at " << stories_bin() << " (set LF_TEST_DATA)";       \
  } while (0)

inline std::vector<RunOut> run_batch(const std::vector<Req> &reqs, int max_batch_tokens = 0) {
  lf_engine_config cfg = base_config(stories_bin(), LF_POLICY_FULL, 128, int(reqs.size()),
                                     max_batch_tokens);
  cfg.backend = g_backend;
  lf_engine_t e = nullptr;
  std::vector<RunOut> runs(reqs.size());
  if (lf_engine_init(&cfg, nullptr, &e) != LF_OK) {
    ADD_FAILURE() << lf_last_error();
    return runs;
  }
  std::map<uint64_t, size_t> at;
  for (size_t i = 0; i < reqs.size(); i++) {
    uint64_t id;
    EXPECT_EQ(submit_req(e, reqs[i], &id), LF_OK) << lf_last_error();
    at[id] = i;
  }
  lf_event ev[16];
  for (int s = 0; s < 10000 && lf_engine_busy(e); s++) {
    int n = 0;
    EXPECT_EQ(lf_engine_step(e, ev, 16, &n), LF_OK) << lf_last_error();
    for (int k = 0; k < n; k++) {
      RunOut &r = runs[at[ev[k].id]];
      if (ev[k].type == LF_EVENT_TOKEN) {
        EXPECT_EQ(r.prompt_ev.size(), reqs[at[ev[k].id]].prompt_lp ? reqs[at[ev[k].id]].prompt.size() - 1 : 0u)
            << "prompt events come before the first token";
        r.tokens.push_back(ev[k].token);
        r.tok_ev.push_back(ev[k]);
      } else if (ev[k].type == LF_EVENT_PROMPT_TOKEN) {
        r.prompt_ev.push_back(ev[k]);
      } else {
        r.reason = ev[k].reason;
      }
    }
  }
  lf_engine_free(e);
  return runs;
}

// The model's raw logits at every position of seq, from one forward over it.
inline std::vector<float> raw_logits(const std::vector<int32_t> &seq, int *vocab) {
  lf_checkpoint ck;
  std::vector<float> all;
  if (lf_checkpoint_open(stories_bin().c_str(), &ck) != LF_OK) {
    ADD_FAILURE() << lf_last_error();
    return all;
  }
  *vocab = ck.cfg.vocab_size;
  lf_backend_params p{};
  p.policy = LF_POLICY_FULL;
  p.budget = 128;
  p.sink = 4;
  p.window = 32;
  p.n_pools = 1;
  p.n_threads = 1;
  lf_backend *be = nullptr;
  EXPECT_EQ(lf_backend_create(g_backend, &ck, &p, &be), LF_OK) << lf_last_error();
  int pool = -1;
  EXPECT_EQ(be->pool_take(be, &pool), LF_OK);
  all.resize(seq.size() * size_t(*vocab));
  lf_batch_item it{};
  it.pool = pool;
  it.pos0 = 0;
  it.n_tok = int(seq.size());
  it.tokens = seq.data();
  it.logits_all = all.data();
  lf_batch_result res{};
  EXPECT_EQ(be->forward(be, &it, 1, &res, nullptr), LF_OK) << lf_last_error();
  EXPECT_EQ(res.status, LF_OK);
  be->free(be);
  lf_checkpoint_close(&ck);
  return all;
}

inline std::vector<int32_t> random_prompt(std::mt19937_64 &g, int n, int vocab) {
  std::vector<int32_t> p(n);
  for (auto &t : p) t = int32_t(1 + g() % (vocab - 1));
  return p;
}


/* ---- engine checks, each backend against its own raw logits (tol: logit agreement between
 * the engine's passes and one forward over the whole sequence) ---- */

inline void EngineGreedyWithPenaltiesMatchesBruteForce(double tol) {
  SP_NEED_STORIES();
  const int vocab = 512; // stories260K
  std::mt19937_64 g(lf_test_seed() + 2);
  std::vector<Req> reqs(5);
  reqs[0].p.presence = 1.5f;
  reqs[1].p.frequency = 0.8f;
  reqs[2].p.repetition = 1.8f;
  reqs[3].p.bias = {{7, 5.f}, {100, -100.f}, {33, 2.5f}};
  reqs[4].p = {0.5f, 0.3f, 1.3f, {{9, 3.f}}};
  for (auto &r : reqs) r.prompt = random_prompt(g, 6, vocab);
  const std::vector<RunOut> runs = run_batch(reqs, 4); // chunked prompts, batched decodes
  int changed = 0, checked = 0;
  for (size_t i = 0; i < reqs.size(); i++) {
    SCOPED_TRACE("request " + std::to_string(i));
    const Req &r = reqs[i];
    ASSERT_EQ(runs[i].tokens.size(), size_t(r.max_tokens));
    std::vector<int32_t> seq = r.prompt;
    seq.insert(seq.end(), runs[i].tokens.begin(), runs[i].tokens.end() - 1);
    int V = 0;
    const std::vector<float> all = raw_logits(seq, &V);
    ASSERT_EQ(V, vocab);
    for (int k = 0; k < r.max_tokens; k++) {
      const size_t pos = r.prompt.size() - 1 + k;
      std::vector<float> row(all.begin() + pos * V, all.begin() + (pos + 1) * V);
      const std::vector<int32_t> out(runs[i].tokens.begin(), runs[i].tokens.begin() + k);
      const std::vector<double> l = brute(row, r.prompt, out, r.p);
      std::vector<int> ord(V);
      for (int t = 0; t < V; t++) ord[t] = t;
      std::stable_sort(ord.begin(), ord.end(), [&](int a, int b) { return l[a] > l[b]; });
      if (ord[0] != std::max_element(row.begin(), row.end()) - row.begin()) changed++;
      // a near tie may go either way: logits that differ by up to tol can flip a gap of 2 tol
      if (l[ord[0]] - l[ord[1]] < 2 * tol) continue;
      EXPECT_EQ(runs[i].tokens[k], ord[0]) << "position " << k;
      checked++;
    }
  }
  EXPECT_GE(checked, 60); // of 100 positions: most are clear of near ties (cpu 1e-4, cuda 0.15)
  EXPECT_GT(changed, 10) << "the processing should change the greedy choice often";
}

inline void HugeBiasForcesAToken(double tol) {
  SP_NEED_STORIES();
  (void)tol;
  Req r;
  r.prompt = {1, 2, 3, 4};
  r.temperature = 1.0f;
  r.seed = 5;
  r.p.bias = {{42, 100.f}};
  const std::vector<RunOut> runs = run_batch({r});
  ASSERT_EQ(runs[0].tokens.size(), size_t(r.max_tokens));
  for (int32_t t : runs[0].tokens) EXPECT_EQ(t, 42);
}

/* batch_invariant: the backend computes a request's logits the same whatever runs beside it
 * (the cpu backend). The cuda backend's bf16 passes are not: other rows and another prompt
 * chunking change the low bits, and a sampled token can flip where a draw falls on a boundary,
 * after which the texts part. There the tokens beside neighbours must start as alone's (mixed
 * random streams would part at once), and each run must repeat exactly (the caller turns off the
 * per-engine GEMM timing, whose choice may differ between two engines: LF_CUDA_GEMM_TUNE). */
inline void SeedsAreReproducibleAndIndependentOfNeighbours(double tol, bool batch_invariant = true) {
  SP_NEED_STORIES();
  (void)tol;
  std::mt19937_64 g(lf_test_seed() + 3);
  Req a;
  a.prompt = random_prompt(g, 5, 512);
  a.temperature = 1.0f;
  a.seed = 1234;
  a.max_tokens = 24;
  a.p.frequency = 0.2f;
  const std::vector<int32_t> alone = run_batch({a})[0].tokens;
  ASSERT_EQ(alone.size(), 24u);
  // beside two other sampling requests (other seeds, prompts, lengths): the same tokens
  Req b = a, c = a;
  b.seed = 99;
  b.prompt = random_prompt(g, 9, 512);
  c.seed = 7;
  c.max_tokens = 10;
  const std::vector<RunOut> together = run_batch({b, a, c}, 3);
  if (batch_invariant) {
    EXPECT_EQ(together[1].tokens, alone);
  } else {
    ASSERT_EQ(together[1].tokens.size(), alone.size());
    EXPECT_EQ(std::vector<int32_t>(together[1].tokens.begin(), together[1].tokens.begin() + 4),
              std::vector<int32_t>(alone.begin(), alone.begin() + 4));
    EXPECT_EQ(run_batch({a})[0].tokens, alone) << "the same run twice";
    EXPECT_EQ(run_batch({b, a, c}, 3)[1].tokens, together[1].tokens) << "the same batch twice";
  }
  // other seeds: other text
  int differ = 0;
  for (uint64_t s : {1ull, 2ull, 3ull}) {
    Req d = a;
    d.seed = s;
    differ += run_batch({d})[0].tokens != alone;
  }
  EXPECT_EQ(differ, 3);
}

inline void LogprobsAreTheRawModelDistribution(double tol) {
  SP_NEED_STORIES();
  std::mt19937_64 g(lf_test_seed() + 4);
  Req r;
  r.prompt = random_prompt(g, 11, 512);
  r.temperature = 0.7f; // and penalties: none of it shows in the logprobs
  r.seed = 3;
  r.p = {0.5f, 0.5f, 1.5f, {{5, 4.f}}};
  r.logprobs = 1;
  r.top = 5;
  r.prompt_lp = 1;
  r.max_tokens = 8;
  const std::vector<RunOut> runs = run_batch({r}, 4); // three prompt chunks
  const RunOut &o = runs[0];
  ASSERT_EQ(o.tokens.size(), 8u);
  ASSERT_EQ(o.prompt_ev.size(), r.prompt.size() - 1);
  std::vector<int32_t> seq = r.prompt;
  seq.insert(seq.end(), o.tokens.begin(), o.tokens.end() - 1);
  int V = 0;
  const std::vector<float> all = raw_logits(seq, &V);
  auto check = [&](const lf_event &e, size_t pos, int32_t tok) {
    const float *row = all.data() + pos * V;
    double mx = *std::max_element(row, row + V), s = 0;
    for (int t = 0; t < V; t++) s += std::exp(double(row[t]) - mx);
    const double lse = mx + std::log(s);
    EXPECT_EQ(e.token, tok);
    EXPECT_NEAR(e.logprob, row[tok] - lse, tol) << "position " << pos;
    ASSERT_EQ(e.n_top, 5);
    std::vector<int> ord(V);
    for (int t = 0; t < V; t++) ord[t] = t;
    std::stable_sort(ord.begin(), ord.end(), [&](int a, int b) { return row[a] > row[b]; });
    for (int k = 0; k < 5; k++) {
      EXPECT_NEAR(e.top_logprobs[k], row[ord[k]] - lse, tol);
      if (row[ord[k]] - row[ord[k + 1]] > tol) {
        EXPECT_EQ(e.top_ids[k], ord[k]);
      }
    }
  };
  for (size_t p = 1; p < r.prompt.size(); p++) check(o.prompt_ev[p - 1], p - 1, r.prompt[p]);
  for (size_t k = 0; k < o.tokens.size(); k++) check(o.tok_ev[k], r.prompt.size() - 1 + k, o.tokens[k]);
}

} // namespace sp_util

#endif

// Penalties, logit_bias, seeds and log-probabilities (lf_sampling since 0.2), against brute
// force: the shared arithmetic (engine/sample.c) on known logits and histories, then the engine
// on the CPU backend, whose tokens and logprobs are recomputed here from the model's raw logits
// (the backend's forward over the whole sequence at once) with the formulas written out again.
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
#include "sampling_params_util.h"
#include "sched_util.h"
#include "test_util.h"

namespace {
using namespace sp_util;

// fp32 on both sides: the engine's logits and one forward over the sequence agree closely
constexpr double kTol = 1e-4;

TEST(SamplingParams, AdjustMatchesBruteForce) {
  std::mt19937_64 gen(lf_test_seed());
  std::normal_distribution<float> nd(0.f, 3.f);
  for (int trial = 0; trial < 200; trial++) {
    const int vocab = 40;
    std::vector<float> logits(vocab);
    for (auto &x : logits) x = nd(gen);
    std::vector<int32_t> prompt(gen() % 10 + 1), out(gen() % 20);
    for (auto &t : prompt) t = int32_t(gen() % vocab);
    for (auto &t : out) t = int32_t(gen() % vocab);
    Params p;
    p.presence = float(int(gen() % 9) - 4) * 0.5f;
    p.frequency = float(int(gen() % 9) - 4) * 0.25f;
    p.repetition = trial % 3 ? 0.5f + float(gen() % 16) * 0.1f : 1.0f;
    for (int k = int(gen() % 5); k > 0; k--) p.bias[int32_t(gen() % vocab)] = float(int(gen() % 201) - 100);
    // the list the scheduler builds: bias entries, prompt tokens (seen), output counts
    std::vector<lf_logit_adj> adj;
    std::map<int32_t, size_t> at;
    auto entry = [&](int32_t t) -> lf_logit_adj & {
      if (!at.count(t)) {
        at[t] = adj.size();
        adj.push_back({t, 0, 0.f, 0.f});
      }
      return adj[at[t]];
    };
    for (auto &b : p.bias) entry(b.first).bias = b.second;
    for (int32_t t : prompt) entry(t).seen = 1;
    std::map<int32_t, int> cnt;
    for (int32_t t : out) {
      lf_logit_adj &a = entry(t);
      a.seen = 1;
      a.sub = p.presence + p.frequency * float(++cnt[t]);
    }
    std::vector<float> got = logits;
    lf_logits_adjust(got.data(), adj.data(), int(adj.size()), p.repetition);
    const std::vector<double> want = brute(logits, prompt, out, p);
    for (int t = 0; t < vocab; t++)
      ASSERT_NEAR(got[t], want[t], 1e-4 * (1 + std::fabs(want[t]))) << "trial " << trial << " token " << t;
  }
}

TEST(SamplingParams, LogprobsMatchBruteForce) {
  std::mt19937_64 gen(lf_test_seed() + 1);
  std::normal_distribution<float> nd(0.f, 4.f);
  for (int vocab : {3, 50, 5000}) {
    std::vector<float> l(vocab);
    for (auto &x : l) x = nd(gen);
    l[1] = l[2]; // a tie: lower id first
    double mx = *std::max_element(l.begin(), l.end()), s = 0;
    for (float x : l) s += std::exp(double(x) - mx);
    const double lse = mx + std::log(s);
    std::vector<int> ord(vocab);
    for (int i = 0; i < vocab; i++) ord[i] = i;
    std::stable_sort(ord.begin(), ord.end(), [&](int a, int b) { return l[a] > l[b]; });
    const int k = std::min(vocab, LF_MAX_TOP_LOGPROBS);
    int32_t ids[LF_MAX_TOP_LOGPROBS];
    float lps[LF_MAX_TOP_LOGPROBS], lp = 0;
    lf_logprobs(l.data(), vocab, vocab - 1, &lp, k, ids, lps);
    EXPECT_NEAR(lp, l[vocab - 1] - lse, 1e-5);
    for (int i = 0; i < k; i++) {
      EXPECT_EQ(ids[i], ord[i]) << "vocab " << vocab << " rank " << i;
      EXPECT_NEAR(lps[i], l[ord[i]] - lse, 1e-5);
    }
  }
}

TEST(SamplingParams, EngineGreedyWithPenaltiesMatchesBruteForce) { EngineGreedyWithPenaltiesMatchesBruteForce(kTol); }

TEST(SamplingParams, HugeBiasForcesAToken) { HugeBiasForcesAToken(kTol); }

TEST(SamplingParams, SeedsAreReproducibleAndIndependentOfNeighbours) { SeedsAreReproducibleAndIndependentOfNeighbours(kTol); }

TEST(SamplingParams, LogprobsAreTheRawModelDistribution) { LogprobsAreTheRawModelDistribution(kTol); }

TEST(SamplingParams, BadValuesAreRefused) {
  SP_NEED_STORIES();
  lf_engine_config cfg = base_config(stories_bin(), LF_POLICY_FULL, 64, 1, 0);
  lf_engine_t e = nullptr;
  ASSERT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_OK) << lf_last_error();
  Req r;
  r.prompt = {1, 2};
  uint64_t id;
  auto refused = [&](const Req &x) { return submit_req(e, x, &id) == LF_ERR_INVALID_ARG; };
  Req b = r;
  b.p.bias = {{512, 1.f}};
  EXPECT_TRUE(refused(b)) << "token outside the vocabulary";
  b.p.bias = {{3, 100.5f}};
  EXPECT_TRUE(refused(b)) << "bias beyond 100";
  b.p.bias = {{3, NAN}};
  EXPECT_TRUE(refused(b));
  b = r;
  b.p.repetition = -1.f;
  EXPECT_TRUE(refused(b));
  b = r;
  b.p.presence = INFINITY;
  EXPECT_TRUE(refused(b));
  b = r;
  b.logprobs = 1;
  b.top = LF_MAX_TOP_LOGPROBS + 1;
  EXPECT_TRUE(refused(b));
  // the same token twice
  lf_request rq{};
  rq.prompt = r.prompt.data();
  rq.n_prompt = 2;
  rq.max_tokens = 2;
  lf_logit_bias twice[2] = {{3, 1.f}, {3, 2.f}};
  rq.sampling.logit_bias = twice;
  rq.sampling.n_logit_bias = 2;
  EXPECT_EQ(lf_engine_submit(e, &rq, &id), LF_ERR_INVALID_ARG);
  EXPECT_FALSE(lf_engine_busy(e));
  lf_engine_free(e);
}

} // namespace

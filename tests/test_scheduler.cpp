// The continuous-batching scheduler behind lf_engine_* (scheduler/README.md), on the CPU backend
// with the tiny models:
//  - batch invariance: requests arriving at different steps, with different prompts (some
//    chunked), lengths, policies and sampling produce exactly the tokens each produces alone;
//  - a seeded random schedule of submit / cancel / step against an independent model of the
//    scheduler: exact events per step, metrics every step, no pool leak, one FINISH each;
//  - queue full, a `full`-policy prompt longer than its pool, a `longflow` request far longer
//    than its budget;
//  - stop ids and stop sequences (held-back tokens, flush on other endings);
//  - pool sizing from memory and the metrics' summaries.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <random>
#include <vector>

#include "lfserve.h"
#include "memory/pool.h"
#include "sched_util.h"
#include "scheduler/scheduler.h"
#include "test_util.h"

namespace {

int model_vocab(const std::string &model) {
  lf_engine_config cfg = base_config(model, LF_POLICY_LONGFLOW, 0, 1, 0);
  lf_engine_t e = nullptr;
  if (lf_engine_init(&cfg, nullptr, &e) != LF_OK) return 0;
  lf_model_info mi;
  lf_engine_model_info(e, &mi);
  lf_engine_free(e);
  return mi.vocab_size;
}

std::vector<int32_t> random_prompt(std::mt19937_64 &rng, int n, int vocab) {
  std::vector<int32_t> p(n);
  for (auto &t : p)
    t = int32_t(rng() % uint64_t(vocab));
  return p;
}

// ---- 1. batch invariance ------------------------------------------------------------------

struct InvCase {
  const char *name;
  lf_policy policy;
  int budget;           // 0: the model's context
  int max_batch_tokens; // 0: unbounded
};

void check_batch_invariance(const std::string &model, const InvCase &c, uint64_t seed) {
  SCOPED_TRACE(std::string(c.name) + " on " + model + ", seed " + std::to_string(seed));
  const int vocab = model_vocab(model);
  ASSERT_GT(vocab, 0) << lf_last_error();
  std::mt19937_64 rng(seed);
  const int lens[] = {1, 2, 5, 17, 19, 20, 23, 24, 25, 40, 49, 60, 90};
  const int N = 14;
  std::vector<TestReq> reqs(N);
  std::vector<int> arrival(N);
  for (int i = 0; i < N; i++) {
    TestReq &r = reqs[i];
    r.prompt = random_prompt(rng, lens[rng() % (sizeof lens / sizeof lens[0])], vocab);
    r.max_tokens = 1 + int(rng() % 80);
    r.ignore_eos = rng() % 10 < 7;
    if (rng() % 4 == 0) {
      r.temperature = 0.8f;
      r.seed = rng();
    }
    arrival[i] = int(rng() % 30);
  }
  const int n_pools = 5;
  lf_engine_config cfg = base_config(model, c.policy, c.budget, n_pools, c.max_batch_tokens);
  lf_engine_t e = nullptr;
  ASSERT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_OK) << lf_last_error();
  std::map<uint64_t, Outcome> out;
  std::vector<uint64_t> ids(N, 0);
  lf_event ev[64];
  int submitted = 0, max_running = 0;
  for (int step = 0; step < 100000 && (submitted < N || lf_engine_busy(e)); step++) {
    for (int i = 0; i < N; i++)
      if (arrival[i] == step) {
        ASSERT_EQ(submit(e, reqs[i], &ids[i]), LF_OK) << lf_last_error();
        submitted++;
      }
    int n = 0;
    ASSERT_EQ(lf_engine_step(e, ev, 64, &n), LF_OK) << lf_last_error();
    apply_events(ev, n, out);
    lf_metrics m;
    ASSERT_EQ(lf_engine_metrics(e, &m), LF_OK);
    ASSERT_LE(m.running, n_pools);
    max_running = std::max(max_running, m.running);
  }
  EXPECT_GT(max_running, 1) << "the schedule never batched";
  for (int i = 0; i < N; i++) {
    Outcome &b = out[ids[i]];
    ASSERT_EQ(lf_engine_request_stats(e, ids[i], &b.stats), LF_OK);
  }
  lf_engine_free(e);

  lf_engine_config alone_cfg = cfg;
  alone_cfg.n_pools = 1;
  for (int i = 0; i < N; i++) {
    SCOPED_TRACE("request " + std::to_string(i) + ": prompt " +
                 std::to_string(reqs[i].prompt.size()) + ", max_tokens " +
                 std::to_string(reqs[i].max_tokens) + ", arrival " + std::to_string(arrival[i]));
    const Outcome a = run_alone(alone_cfg, reqs[i]);
    const Outcome &b = out[ids[i]];
    EXPECT_EQ(b.n_finish, 1);
    EXPECT_EQ(b.tokens, a.tokens);
    EXPECT_EQ(b.reason, a.reason);
    EXPECT_EQ(b.status, a.status);
    EXPECT_EQ(b.stats.generated_tokens, a.stats.generated_tokens);
    EXPECT_EQ(b.stats.evictions, a.stats.evictions);
    EXPECT_EQ(b.stats.slots_filled, a.stats.slots_filled);
    EXPECT_EQ(b.stats.prefill_chunks, a.stats.prefill_chunks);
    const int C = c.max_batch_tokens;
    const int P = int(reqs[i].prompt.size());
    // a prompt that does not fit its pool runs whole (SnapKV over all of it)
    const bool fits = c.policy == LF_POLICY_FULL || P <= c.budget - 1;
    EXPECT_EQ(b.stats.prefill_chunks, C > 0 && fits ? (P + C - 1) / C : 1);
  }
}

const InvCase kInvCases[] = {
    {"longflow B=20, chunks of 24", LF_POLICY_LONGFLOW, 20, 24},
    {"longflow B=48, unbounded prefill", LF_POLICY_LONGFLOW, 48, 0},
    {"full, chunks of 16", LF_POLICY_FULL, 0, 16},
    {"streaming B=24, chunks of 7", LF_POLICY_STREAMING, 24, 7},
    {"h2o B=48, chunks of 32", LF_POLICY_H2O, 48, 32},
};

TEST(Scheduler, BatchInvarianceTinyLlama) {
  const uint64_t seed = lf_test_seed();
  for (const auto &c : kInvCases)
    check_batch_invariance(tiny_llama(), c, seed);
}

TEST(Scheduler, BatchInvarianceStories260K) {
  if (!lf_path_exists(stories_bin())) GTEST_SKIP() << "stories260K not found at " << stories_bin();
  const uint64_t seed = lf_test_seed();
  check_batch_invariance(stories_bin(), kInvCases[0], seed);
  check_batch_invariance(stories_bin(), kInvCases[2], seed);
}

// ---- 2. random schedule against a model ---------------------------------------------------

// An independent model of the scheduler's contract for requests that ignore EOS and have no
// stop ids: FCFS admission while pools are free; per step one token for every prefilled running
// request, then prompt chunks of min(C, left) in admission order, first fit under budget C; a
// request whose prompt completes samples its first token; LENGTH at max_tokens; a cancelled
// waiting request ends at once (its FINISH arrives with the next step), a cancelled running one
// at the start of the next step.
struct Model {
  struct R {
    uint64_t id;
    int P, max, prefilled = 0, gen = 0;
    bool cancel = false;
  };
  int pools, C, max_queue;
  std::deque<R> waiting;
  std::vector<R> running;
  std::vector<uint64_t> cancelled_waiting;
  int slots = 0; // pool size (longflow): a prompt of more than slots - 1 tokens runs whole

  struct Expect {
    int tokens = 0;
    lf_finish_reason reason = LF_FINISH_NONE;
    bool operator==(const Expect &o) const {
      return tokens == o.tokens && reason == o.reason;
    }
  };

  lf_status cancel(uint64_t id) {
    for (auto &r : running)
      if (r.id == id) {
        r.cancel = true;
        return LF_OK;
      }
    for (auto it = waiting.begin(); it != waiting.end(); ++it)
      if (it->id == id) {
        waiting.erase(it);
        cancelled_waiting.push_back(id);
        return LF_OK;
      }
    return LF_ERR_NOT_FOUND;
  }

  std::map<uint64_t, Expect> step() {
    std::map<uint64_t, Expect> ex;
    for (uint64_t id : cancelled_waiting)
      ex[id].reason = LF_FINISH_CANCELLED;
    cancelled_waiting.clear();
    std::vector<R> keep;
    for (auto &r : running) {
      if (r.cancel)
        ex[r.id].reason = LF_FINISH_CANCELLED;
      else
        keep.push_back(r);
    }
    running = keep;
    while (!waiting.empty() && int(running.size()) < pools) {
      running.push_back(waiting.front());
      waiting.pop_front();
    }
    std::vector<bool> decodes(running.size());
    for (size_t i = 0; i < running.size(); i++)
      decodes[i] = running[i].prefilled == running[i].P;
    std::vector<bool> samples(running.size(), false);
    long budget = C > 0 ? C : 1L << 40;
    for (size_t i = 0; i < running.size(); i++) {
      R &r = running[i];
      if (decodes[i]) {
        samples[i] = true;
        continue;
      }
      const bool whole = r.P > slots - 1; // the cpu backend compresses any length at once
      const int chunk = C > 0 && !whole ? std::min(C, r.P - r.prefilled) : r.P - r.prefilled;
      if (chunk > budget && !(chunk > C && budget == C)) continue;
      budget -= chunk;
      r.prefilled += chunk;
      samples[i] = r.prefilled == r.P;
    }
    keep.clear();
    for (size_t i = 0; i < running.size(); i++) {
      R &r = running[i];
      if (samples[i]) {
        r.gen++;
        ex[r.id].tokens++;
        if (r.gen == r.max) {
          ex[r.id].reason = LF_FINISH_LENGTH;
          continue;
        }
      }
      keep.push_back(r);
    }
    running = keep;
    return ex;
  }

  int prefilling() const {
    int n = 0;
    for (const auto &r : running)
      n += r.prefilled < r.P;
    return n;
  }
};

struct ScheduleCase {
  int n_pools, C, max_queue, budget;
};

void check_random_schedule(const ScheduleCase &sc, uint64_t seed, int n_events) {
  SCOPED_TRACE("pools " + std::to_string(sc.n_pools) + ", C " + std::to_string(sc.C) + ", queue " +
               std::to_string(sc.max_queue) + ", seed " + std::to_string(seed));
  const std::string model = tiny_llama();
  const int vocab = model_vocab(model);
  lf_engine_config cfg = base_config(model, LF_POLICY_LONGFLOW, sc.budget, sc.n_pools, sc.C);
  cfg.max_queue = sc.max_queue;
  lf_engine_t e = nullptr;
  ASSERT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_OK) << lf_last_error();
  Model model_state{sc.n_pools, sc.C, sc.max_queue, {}, {}, {}, sc.budget};
  std::mt19937_64 rng(seed);
  std::map<uint64_t, Outcome> out;
  std::map<uint64_t, TestReq> accepted;
  std::map<lf_finish_reason, int> reasons;
  uint64_t next_id = 1;
  int n_full = 0, n_cancel_ok = 0, n_cancel_nf = 0, max_running = 0;
  std::vector<lf_event> ev(4096);

  auto do_step = [&]() {
    std::map<uint64_t, Model::Expect> want = model_state.step();
    int n = 0;
    ASSERT_EQ(lf_engine_step(e, ev.data(), int(ev.size()), &n), LF_OK) << lf_last_error();
    ASSERT_LT(n, int(ev.size()));
    std::map<uint64_t, Model::Expect> got;
    for (int i = 0; i < n; i++) {
      Model::Expect &g = got[ev[i].id];
      ASSERT_EQ(g.reason, LF_FINISH_NONE) << "event after FINISH for " << ev[i].id;
      if (ev[i].type == LF_EVENT_TOKEN)
        g.tokens++;
      else
        g.reason = ev[i].reason;
    }
    apply_events(ev.data(), n, out);
    ASSERT_EQ(got.size(), want.size());
    for (const auto &[id, w] : want) {
      ASSERT_TRUE(got.count(id)) << "no events for request " << id;
      ASSERT_EQ(got[id].tokens, w.tokens) << "request " << id;
      ASSERT_EQ(got[id].reason, w.reason) << "request " << id;
      if (w.reason != LF_FINISH_NONE) reasons[w.reason]++;
    }
    lf_metrics m;
    ASSERT_EQ(lf_engine_metrics(e, &m), LF_OK);
    ASSERT_EQ(m.running, int(model_state.running.size()));
    ASSERT_EQ(m.waiting, int(model_state.waiting.size()));
    ASSERT_EQ(m.pools_used, m.running);
    ASSERT_LE(m.pools_used, m.pools_total);
    ASSERT_EQ(m.pools_total, sc.n_pools);
    ASSERT_EQ(m.prefilling, model_state.prefilling());
    max_running = std::max(max_running, m.running);
  };

  for (int k = 0; k < n_events; k++) {
    const int what = int(rng() % 100);
    if (what < 35) {
      TestReq r;
      r.prompt = random_prompt(rng, 1 + int(rng() % 40), vocab);
      r.max_tokens = 1 + int(rng() % 30);
      uint64_t id = 0;
      const lf_status s = submit(e, r, &id);
      if (sc.max_queue > 0 && int(model_state.waiting.size()) >= sc.max_queue) {
        ASSERT_EQ(s, LF_ERR_QUEUE_FULL);
        n_full++;
      } else {
        ASSERT_EQ(s, LF_OK) << lf_last_error();
        ASSERT_EQ(id, next_id);
        next_id++;
        accepted[id] = r;
        model_state.waiting.push_back({id, int(r.prompt.size()), r.max_tokens});
      }
    } else if (what < 45) {
      // any id ever handed out, plus one that never was
      const uint64_t id = 1 + rng() % next_id;
      const lf_status want = model_state.cancel(id);
      ASSERT_EQ(lf_engine_cancel(e, id), want) << "cancel " << id;
      (want == LF_OK ? n_cancel_ok : n_cancel_nf)++;
    } else {
      do_step();
      if (::testing::Test::HasFatalFailure()) break;
    }
  }
  for (int k = 0; k < 100000 && !::testing::Test::HasFatalFailure() && lf_engine_busy(e); k++)
    do_step();
  if (::testing::Test::HasFatalFailure()) {
    lf_engine_free(e);
    return;
  }
  EXPECT_FALSE(lf_engine_busy(e));
  lf_metrics m;
  ASSERT_EQ(lf_engine_metrics(e, &m), LF_OK);
  EXPECT_EQ(m.pools_used, 0);
  EXPECT_EQ(m.running, 0);
  EXPECT_EQ(m.waiting, 0);
  EXPECT_EQ(m.submitted, accepted.size());
  EXPECT_EQ(m.rejected, uint64_t(n_full));
  uint64_t fin = 0;
  for (uint64_t f : m.finished)
    fin += f;
  EXPECT_EQ(fin, accepted.size());
  EXPECT_EQ(m.finished[LF_FINISH_CANCELLED], uint64_t(reasons[LF_FINISH_CANCELLED]));
  EXPECT_EQ(m.finished[LF_FINISH_LENGTH], uint64_t(reasons[LF_FINISH_LENGTH]));
  for (const auto &[id, r] : accepted) {
    const Outcome &o = out[id];
    ASSERT_EQ(o.n_finish, 1) << "request " << id;
    if (o.reason == LF_FINISH_LENGTH) {
      EXPECT_EQ(int(o.tokens.size()), r.max_tokens);
    } else {
      EXPECT_EQ(o.reason, LF_FINISH_CANCELLED);
    }
    lf_request_stats st;
    ASSERT_EQ(lf_engine_request_stats(e, id, &st), LF_OK);
    EXPECT_EQ(st.reason, o.reason);
    EXPECT_EQ(st.output_tokens, int(o.tokens.size()));
    EXPECT_EQ(st.generated_tokens, int(o.tokens.size()));
  }
  // the schedule exercised what it is meant to
  EXPECT_EQ(max_running, sc.n_pools);
  EXPECT_GT(reasons[LF_FINISH_LENGTH], 0);
  EXPECT_GT(reasons[LF_FINISH_CANCELLED], 0);
  EXPECT_GT(n_cancel_nf, 0);
  if (sc.max_queue > 0) {
    EXPECT_GT(n_full, 0);
  }
  lf_engine_free(e);
}

TEST(Scheduler, RandomScheduleMatchesModel) {
  const uint64_t seed = lf_test_seed();
  check_random_schedule({4, 16, 8, 32}, seed, 4000);
  check_random_schedule({3, 7, 5, 12}, seed + 1, 3000);
  check_random_schedule({2, 0, 0, 24}, seed + 2, 1500);
}

// ---- 3. queue limit, context full, long longflow ------------------------------------------

TEST(Scheduler, QueueFull) {
  lf_engine_config cfg = base_config(tiny_llama(), LF_POLICY_LONGFLOW, 32, 1, 0);
  cfg.max_queue = 2;
  lf_engine_t e = nullptr;
  ASSERT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_OK) << lf_last_error();
  TestReq r;
  r.prompt = {1, 5, 9};
  r.max_tokens = 4;
  uint64_t a, b, c;
  ASSERT_EQ(submit(e, r, &a), LF_OK);
  ASSERT_EQ(submit(e, r, &b), LF_OK);
  EXPECT_EQ(submit(e, r, &c), LF_ERR_QUEUE_FULL);
  EXPECT_NE(std::string(lf_last_error()).find("limit 2"), std::string::npos) << lf_last_error();
  lf_event ev[16];
  int n;
  ASSERT_EQ(lf_engine_step(e, ev, 16, &n), LF_OK); // a takes the only pool: one waiting
  ASSERT_EQ(submit(e, r, &c), LF_OK);
  EXPECT_EQ(submit(e, r, &c), LF_ERR_QUEUE_FULL);
  ASSERT_EQ(lf_engine_cancel(e, b), LF_OK); // a cancelled waiting request frees its queue place
  ASSERT_EQ(submit(e, r, &c), LF_OK);
  std::map<uint64_t, Outcome> out;
  apply_events(ev, n, out);
  run_to_idle(e, out);
  lf_metrics m;
  ASSERT_EQ(lf_engine_metrics(e, &m), LF_OK);
  EXPECT_EQ(m.rejected, 2u);
  EXPECT_EQ(m.submitted, 4u);
  EXPECT_EQ(m.finished[LF_FINISH_LENGTH], 3u);
  EXPECT_EQ(m.finished[LF_FINISH_CANCELLED], 1u);
  EXPECT_EQ(out[b].reason, LF_FINISH_CANCELLED);
  EXPECT_TRUE(out[b].tokens.empty());
  lf_engine_free(e);
}

TEST(Scheduler, FullPolicyOverflowIsAnErrorOthersUnaffected) {
  const int B = 32;
  lf_engine_config cfg = base_config(tiny_llama(), LF_POLICY_FULL, B, 4, 16);
  lf_engine_t e = nullptr;
  ASSERT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_OK) << lf_last_error();
  std::mt19937_64 rng(7);
  TestReq too_long, overflows, exact, fine;
  too_long.prompt = random_prompt(rng, B + 8, 256); // can never fit
  too_long.max_tokens = 5;
  overflows.prompt = random_prompt(rng, 10, 256); // fits, then outgrows the pool
  overflows.max_tokens = 100;
  exact.prompt = random_prompt(rng, B, 256); // fills the pool in two chunks
  exact.max_tokens = 10;
  fine.prompt = random_prompt(rng, 6, 256);
  fine.max_tokens = 12;
  uint64_t id_long, id_over, id_exact, id_fine;
  ASSERT_EQ(submit(e, too_long, &id_long), LF_OK);
  ASSERT_EQ(submit(e, overflows, &id_over), LF_OK);
  ASSERT_EQ(submit(e, exact, &id_exact), LF_OK);
  ASSERT_EQ(submit(e, fine, &id_fine), LF_OK);
  std::map<uint64_t, Outcome> out;
  run_to_idle(e, out);
  EXPECT_EQ(out[id_long].reason, LF_FINISH_ERROR);
  EXPECT_EQ(out[id_long].status, LF_ERR_CONTEXT_FULL);
  EXPECT_TRUE(out[id_long].tokens.empty());
  // 32 slots hold positions 0..31: the tokens sampled at positions 10..32 arrive, then the
  // write of position 32 fails.
  EXPECT_EQ(out[id_over].reason, LF_FINISH_ERROR);
  EXPECT_EQ(out[id_over].status, LF_ERR_CONTEXT_FULL);
  EXPECT_EQ(out[id_over].tokens.size(), size_t(B + 1 - 10));
  EXPECT_EQ(out[id_exact].reason, LF_FINISH_ERROR);
  EXPECT_EQ(out[id_exact].tokens.size(), 1u);
  EXPECT_EQ(out[id_fine].reason, LF_FINISH_LENGTH);
  EXPECT_EQ(out[id_fine].tokens.size(), 12u);
  lf_metrics m;
  ASSERT_EQ(lf_engine_metrics(e, &m), LF_OK);
  EXPECT_EQ(m.pools_used, 0);
  EXPECT_EQ(m.finished[LF_FINISH_ERROR], 3u);
  lf_engine_free(e);
  // the healthy request is exactly what it is alone
  lf_engine_config alone = cfg;
  alone.n_pools = 1;
  EXPECT_EQ(run_alone(alone, fine).tokens, out[id_fine].tokens);
  EXPECT_EQ(run_alone(alone, overflows).tokens, out[id_over].tokens);
}

TEST(Scheduler, LongflowFarPastBudgetCompletes) {
  const int B = 16;
  lf_engine_config cfg = base_config(tiny_llama(), LF_POLICY_LONGFLOW, B, 2, 24);
  lf_engine_t e = nullptr;
  ASSERT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_OK) << lf_last_error();
  std::mt19937_64 rng(11);
  TestReq big;
  // does not fit the pool: runs whole (one chunk, SnapKV over all 100 tokens), not in chunks of 24
  big.prompt = random_prompt(rng, 100, 256);
  big.max_tokens = 300;
  TestReq small;
  small.prompt = random_prompt(rng, 8, 256);
  small.max_tokens = 400; // 408 positions through 16 slots
  uint64_t a, b;
  ASSERT_EQ(submit(e, big, &a), LF_OK);
  ASSERT_EQ(submit(e, small, &b), LF_OK);
  std::map<uint64_t, Outcome> out;
  run_to_idle(e, out);
  lf_request_stats sa, sb;
  ASSERT_EQ(lf_engine_request_stats(e, a, &sa), LF_OK);
  ASSERT_EQ(lf_engine_request_stats(e, b, &sb), LF_OK);
  EXPECT_EQ(out[a].reason, LF_FINISH_LENGTH);
  EXPECT_EQ(out[a].tokens.size(), 300u);
  EXPECT_EQ(sa.prefill_chunks, 1);
  EXPECT_EQ(sa.slots_filled, B);
  EXPECT_GT(sa.evictions, 0u);
  EXPECT_EQ(out[b].reason, LF_FINISH_LENGTH);
  EXPECT_EQ(out[b].tokens.size(), 400u);
  // 8 + 400 positions, the last never written: 407 writes into 16 slots per (layer, KV head)
  EXPECT_EQ(sb.evictions, uint64_t(407 - B) * 2 * 2);
  lf_engine_free(e);
}

// ---- 5. stop ids and stop sequences -------------------------------------------------------

// What a request with these stops must produce, given the stop-free greedy continuation g.
Outcome expected_with_stops(const std::vector<int32_t> &g, const TestReq &r) {
  Outcome o;
  std::vector<int32_t> gen;
  for (size_t t = 0; t < g.size(); t++) {
    if (std::find(r.stop_ids.begin(), r.stop_ids.end(), g[t]) != r.stop_ids.end()) {
      o.tokens = gen;
      o.reason = LF_FINISH_STOP_ID;
      return o;
    }
    gen.push_back(g[t]);
    for (const auto &s : r.stop_seqs)
      if (s.size() <= gen.size() && std::equal(s.begin(), s.end(), gen.end() - long(s.size()))) {
        o.tokens.assign(gen.begin(), gen.end() - long(s.size()));
        o.reason = LF_FINISH_STOP_SEQUENCE;
        return o;
      }
    if (int(gen.size()) == r.max_tokens) break;
  }
  o.tokens = gen;
  o.reason = LF_FINISH_LENGTH;
  return o;
}

TEST(Scheduler, StopIdsAndSequences) {
  lf_engine_config cfg = base_config(tiny_llama(), LF_POLICY_LONGFLOW, 64, 8, 16);
  std::mt19937_64 rng(5);
  TestReq base;
  base.prompt = random_prompt(rng, 12, 256);
  base.max_tokens = 60;
  lf_engine_config alone = cfg;
  alone.n_pools = 1;
  const std::vector<int32_t> g = run_alone(alone, base).tokens;
  ASSERT_EQ(g.size(), 60u);

  std::vector<TestReq> cases;
  auto with = [&](std::vector<int32_t> ids, std::vector<std::vector<int32_t>> seqs) {
    TestReq r = base;
    r.stop_ids = ids;
    r.stop_seqs = seqs;
    cases.push_back(r);
  };
  with({g[9]}, {});                                     // a single stop id
  with({}, {{g[20], g[21], g[22]}});                    // a 3-token sequence
  with({}, {{g[30]}});                                  // a 1-token sequence
  with({}, {{g[40], 1000}, {g[50], g[51]}});            // a prefix that breaks, then a match
  with({}, {{g[59], 1000}});                            // held back at max_tokens: flushed
  with({}, {{1000, 1001}});                             // never matches
  with({g[45]}, {{g[10], g[11], g[12], g[13], g[14]}}); // whichever comes first
  with({}, {{g[0], g[1]}});                             // matches at the very start
  // a sequence whose first token repeats inside it (restarts the partial match correctly)
  with({}, {{g[33], g[33], g[34]}});

  lf_engine_t e = nullptr;
  ASSERT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_OK) << lf_last_error();
  std::vector<uint64_t> ids(cases.size());
  for (size_t i = 0; i < cases.size(); i++)
    ASSERT_EQ(submit(e, cases[i], &ids[i]), LF_OK);
  std::map<uint64_t, Outcome> out;
  run_to_idle(e, out);
  for (size_t i = 0; i < cases.size(); i++) {
    SCOPED_TRACE("case " + std::to_string(i));
    const Outcome want = expected_with_stops(g, cases[i]);
    const Outcome &got = out[ids[i]];
    EXPECT_EQ(got.tokens, want.tokens);
    EXPECT_EQ(got.reason, want.reason);
    lf_request_stats st;
    ASSERT_EQ(lf_engine_request_stats(e, ids[i], &st), LF_OK);
    EXPECT_EQ(st.output_tokens, int(got.tokens.size()));
    EXPECT_GE(st.generated_tokens, st.output_tokens);
  }
  // a bad stop sequence is refused
  TestReq bad = base;
  bad.stop_seqs = {{}};
  uint64_t id;
  EXPECT_EQ(submit(e, bad, &id), LF_ERR_INVALID_ARG);
  lf_engine_free(e);
}

// ---- pool sizing and metrics --------------------------------------------------------------

TEST(Scheduler, PoolsForMemory) {
  EXPECT_EQ(lf_pools_for_memory(1000, 1.0, 100), 10);
  EXPECT_EQ(lf_pools_for_memory(999, 1.0, 100), 9);
  EXPECT_EQ(lf_pools_for_memory(1000, 0.9, 100), 9);
  EXPECT_EQ(lf_pools_for_memory(1000, 0.5, 100), 5);
  EXPECT_EQ(lf_pools_for_memory(99, 1.0, 100), 0);
  EXPECT_EQ(lf_pools_for_memory(1000, 1.0, 0), 0);
  EXPECT_EQ(lf_pools_for_memory(1000, 0.0, 100), 0);
  EXPECT_EQ(lf_pools_for_memory(1000, 1.5, 100), 0);
  EXPECT_EQ(lf_pools_for_memory(UINT64_MAX, 1.0, 1), INT32_MAX);
  // an H200-sized example: 100 GiB at 0.9 over 3200-slot Llama-3-8B bf16 pools
  const uint64_t pool = uint64_t(32) * 8 * 3200 * 128 * 2 * 2;
  EXPECT_EQ(lf_pools_for_memory(uint64_t(100) << 30, 0.9, pool),
            int(std::floor(double(uint64_t(100) << 30) * 0.9 / double(pool))));

  // The engine sizes its pools from kv_memory_bytes when n_pools is 0.
  lf_engine_config cfg = base_config(tiny_llama(), LF_POLICY_LONGFLOW, 64, 0, 0);
  lf_pool_shape ps = {1, 2, 2, 64, 16, 0, 0, nullptr}; // tiny llama: 2 layers, 2 KV heads, head_dim 16
  const uint64_t pb = lf_pool_bytes(&ps);
  cfg.kv_memory_bytes = pb * 7 + pb / 2;
  cfg.mem_util = 0.9; // 6.75 pools
  lf_engine_t e = nullptr;
  ASSERT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_OK) << lf_last_error();
  lf_metrics m;
  ASSERT_EQ(lf_engine_metrics(e, &m), LF_OK);
  EXPECT_EQ(m.pools_total, 6);
  lf_engine_free(e);
  cfg.n_pools = 3; // explicit wins
  ASSERT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_OK) << lf_last_error();
  ASSERT_EQ(lf_engine_metrics(e, &m), LF_OK);
  EXPECT_EQ(m.pools_total, 3);
  lf_engine_free(e);
  cfg.n_pools = 0;
  cfg.kv_memory_bytes = pb / 2; // not one pool
  EXPECT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_ERR_OUT_OF_MEMORY);
}

TEST(Scheduler, MetricsAndRequestStats) {
  lf_engine_config cfg = base_config(tiny_llama(), LF_POLICY_LONGFLOW, 24, 3, 8);
  lf_engine_t e = nullptr;
  ASSERT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_OK) << lf_last_error();
  std::mt19937_64 rng(3);
  std::vector<uint64_t> ids;
  for (int i = 0; i < 8; i++) {
    TestReq r;
    r.prompt = random_prompt(rng, 1 + i * 5, 256);
    r.max_tokens = 1 + i * 7;
    uint64_t id;
    ASSERT_EQ(submit(e, r, &id), LF_OK);
    ids.push_back(id);
  }
  lf_request_stats st;
  ASSERT_EQ(lf_engine_request_stats(e, ids[5], &st), LF_OK); // waiting: live stats
  EXPECT_EQ(st.reason, LF_FINISH_NONE);
  EXPECT_EQ(st.generated_tokens, 0);
  EXPECT_EQ(lf_engine_request_stats(e, 12345, &st), LF_ERR_NOT_FOUND);
  std::map<uint64_t, Outcome> out;
  run_to_idle(e, out);
  lf_metrics m;
  ASSERT_EQ(lf_engine_metrics(e, &m), LF_OK);
  uint64_t total = 0;
  for (int i = 0; i < 8; i++) {
    ASSERT_EQ(lf_engine_request_stats(e, ids[i], &st), LF_OK);
    EXPECT_EQ(st.prompt_tokens, 1 + i * 5);
    EXPECT_EQ(st.generated_tokens, 1 + i * 7);
    // chunks of 8 for the prompts that fit the 24 slots; the others run whole
    EXPECT_EQ(st.prefill_chunks, 1 + i * 5 <= 23 ? (1 + i * 5 + 7) / 8 : 1);
    EXPECT_EQ(st.reason, LF_FINISH_LENGTH);
    EXPECT_GT(st.ttft_seconds, 0.0);
    EXPECT_GE(st.ttft_seconds, st.queue_seconds);
    EXPECT_GE(st.total_seconds, st.ttft_seconds);
    if (st.generated_tokens > 1) {
      EXPECT_GT(st.tpot_seconds, 0.0);
    } else {
      EXPECT_EQ(st.tpot_seconds, 0.0);
    }
    total += uint64_t(st.generated_tokens);
  }
  EXPECT_EQ(m.tokens_generated, total);
  EXPECT_GT(m.tokens_per_s, 0.0);
  EXPECT_GT(m.steps, 0u);
  EXPECT_GT(m.decode_seconds, 0.0);
  EXPECT_EQ(m.ttft.count, 8u);
  EXPECT_EQ(m.ttft.n_window, 8);
  EXPECT_EQ(m.tpot.count, 7u); // the 1-token request has no TPOT
  uint64_t in_buckets = 0;
  for (uint64_t b : m.ttft.buckets)
    in_buckets += b;
  EXPECT_EQ(in_buckets, m.ttft.count);
  EXPECT_LE(m.ttft.p50, m.ttft.p90);
  EXPECT_LE(m.ttft.p90, m.ttft.p99);
  EXPECT_LE(m.ttft.p99, m.ttft.max);
  EXPECT_GT(m.ttft.sum, 0.0);
  const double *bounds = lf_latency_bucket_bounds();
  for (int i = 1; i < LF_LATENCY_BUCKETS; i++) {
    EXPECT_LT(bounds[i - 1], bounds[i]);
  }
  EXPECT_TRUE(std::isinf(bounds[LF_LATENCY_BUCKETS - 1]));
  lf_engine_free(e);
}

} // namespace

// ---- teacher forcing (lf_request.forced) --------------------------------------------------------
// Runs one request on a fresh engine; returns the TOKEN events' ids, the finish reason and the
// evictions. forced may be empty (free running).
namespace {
struct Forced {
  std::vector<int32_t> tokens;
  lf_finish_reason reason = LF_FINISH_NONE;
  uint64_t evictions = 0;
  lf_status submit = LF_OK;
};

Forced run_forced(const lf_engine_config &cfg, const std::vector<int32_t> &prompt, int max_tokens,
                  const std::vector<int32_t> &forced, const std::vector<int32_t> &stop = {}) {
  Forced f;
  lf_engine_t e = nullptr;
  EXPECT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_OK) << lf_last_error();
  if (!e) return f;
  lf_request rq{};
  rq.prompt = prompt.data();
  rq.n_prompt = int(prompt.size());
  rq.max_tokens = max_tokens;
  rq.ignore_eos = 1;
  rq.forced = forced.empty() ? nullptr : forced.data();
  rq.n_forced = int(forced.size());
  rq.stop_ids = stop.empty() ? nullptr : stop.data();
  rq.n_stop_ids = int(stop.size());
  uint64_t id = 0;
  f.submit = lf_engine_submit(e, &rq, &id);
  lf_event ev[16];
  while (f.submit == LF_OK && lf_engine_busy(e)) {
    int n = 0;
    EXPECT_EQ(lf_engine_step(e, ev, 16, &n), LF_OK) << lf_last_error();
    for (int i = 0; i < n; i++) {
      if (ev[i].type == LF_EVENT_TOKEN)
        f.tokens.push_back(ev[i].token);
      else
        f.reason = ev[i].reason;
    }
  }
  lf_request_stats st;
  if (f.submit == LF_OK && lf_engine_request_stats(e, id, &st) == LF_OK) f.evictions = st.evictions;
  lf_engine_free(e);
  return f;
}
} // namespace

// Forcing the model's own greedy output changes nothing: the same tokens, the same evictions
// (longflow, a pool far smaller than the output). Forcing another sequence F: the token reported
// at position i is the greedy next token of prompt + F[0..i) run from scratch (policy full, so
// the history is the same whichever way it entered the pool). EOS inside F does not stop it.
TEST(TeacherForcing, ReportsTheGreedyTokenUnderTheForcedHistory) {
  const std::string model = lf_repo_data_dir() + "/hf_tiny/llama";
  const std::vector<int32_t> prompt = {1, 17, 42, 99, 7, 3, 250, 11};
  lf_engine_config lf = base_config(model, LF_POLICY_LONGFLOW, 24, 1, 0);
  const Forced own = run_forced(lf, prompt, 80, {});
  ASSERT_EQ(own.tokens.size(), 80u);
  ASSERT_GT(own.evictions, 0u);
  const Forced again = run_forced(lf, prompt, 80, own.tokens);
  EXPECT_EQ(again.tokens, own.tokens);
  EXPECT_EQ(again.evictions, own.evictions);
  EXPECT_EQ(again.reason, LF_FINISH_LENGTH);

  lf_engine_config full = base_config(model, LF_POLICY_FULL, 128, 1, 0);
  std::mt19937_64 rng(lf_test_seed());
  const int vocab = model_vocab(model);
  ASSERT_GT(vocab, 0);
  std::vector<int32_t> F(30);
  for (auto &t : F) t = int32_t(rng() % uint64_t(vocab));
  lf_model_info mi{};
  {
    lf_engine_t e = nullptr;
    ASSERT_EQ(lf_engine_init(&full, nullptr, &e), LF_OK);
    lf_engine_model_info(e, &mi);
    lf_engine_free(e);
  }
  if (mi.n_eos > 0) F[10] = mi.eos_ids[0]; /* an EOS in the forced history */
  const Forced tf = run_forced(full, prompt, 1000, F);
  ASSERT_EQ(tf.tokens.size(), F.size()) << "runs min(max_tokens, n_forced) positions";
  EXPECT_EQ(tf.reason, LF_FINISH_LENGTH);
  int differ = 0;
  for (size_t i = 0; i < F.size(); i++) {
    std::vector<int32_t> p = prompt;
    p.insert(p.end(), F.begin(), F.begin() + long(i));
    const Forced one = run_forced(full, p, 1, {});
    ASSERT_EQ(one.tokens.size(), 1u);
    EXPECT_EQ(tf.tokens[i], one.tokens[0]) << "position " << i;
    differ += tf.tokens[i] != F[i];
  }
  EXPECT_GT(differ, 0) << "random forced ids that the model always predicts: the test saw nothing";
}

TEST(TeacherForcing, BadRequestsAreRefused) {
  const std::string model = lf_repo_data_dir() + "/hf_tiny/llama";
  lf_engine_config cfg = base_config(model, LF_POLICY_LONGFLOW, 24, 1, 0);
  const std::vector<int32_t> prompt = {1, 2, 3};
  EXPECT_EQ(run_forced(cfg, prompt, 5, {4, 5, -1}).submit, LF_ERR_INVALID_ARG);
  EXPECT_EQ(run_forced(cfg, prompt, 5, {4, 5, 1 << 30}).submit, LF_ERR_INVALID_ARG);
  EXPECT_EQ(run_forced(cfg, prompt, 5, {4, 5, 6}, {9}).submit, LF_ERR_INVALID_ARG);
  const Forced capped = run_forced(cfg, prompt, 2, {4, 5, 6});
  EXPECT_EQ(capped.submit, LF_OK);
  EXPECT_EQ(capped.tokens.size(), 2u) << "max_tokens caps the forced positions";
}

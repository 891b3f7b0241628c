/* Helpers shared by the scheduler and API tests: engines over the tiny CPU models, requests, and
 * a driver that steps an engine to idle while checking the event stream's basic contract. */
#ifndef LF_SCHED_UTIL_H
#define LF_SCHED_UTIL_H

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "lfserve.h"
#include "test_util.h"

/* These tests run thousands of tiny forwards: OpenMP fork/join would dominate them (and the CPU
 * backend does not apply cfg.n_threads yet), so one thread unless the environment says else.
 * Runs before main, i.e. before the OpenMP runtime reads the variable. */
inline const int lf_sched_tests_omp_one = setenv("OMP_NUM_THREADS", "1", 0);

struct TestReq {
  std::vector<int32_t> prompt;
  int max_tokens = 16;
  bool ignore_eos = true;
  float temperature = 0.0f;
  uint64_t seed = 0;
  std::vector<int32_t> stop_ids;
  std::vector<std::vector<int32_t>> stop_seqs;
};

struct Outcome {
  std::vector<int32_t> tokens;
  lf_finish_reason reason = LF_FINISH_NONE;
  lf_status status = LF_OK;
  int n_finish = 0;
  lf_request_stats stats{};
};

inline std::string tiny_llama() {
  return lf_repo_data_dir() + "/hf_tiny/llama";
}

inline std::string stories_bin() {
  return lf_test_data_dir() + "/models/stories260K/stories260K.bin";
}

inline lf_engine_config base_config(const std::string &model, lf_policy policy, int budget,
                                    int n_pools, int max_batch_tokens) {
  lf_engine_config cfg;
  lf_engine_config_default(&cfg);
  static std::set<std::string> paths; /* stable storage for cfg.model_path (main thread only) */
  cfg.model_path = paths.insert(model).first->c_str();
  cfg.backend = LF_BACKEND_CPU;
  cfg.policy = policy;
  cfg.budget = budget;
  cfg.n_pools = n_pools;
  cfg.max_batch_tokens = max_batch_tokens;
  cfg.n_threads = 1;
  return cfg;
}

/* Submits r; the lf_request points into storage that must live until submit returns. */
inline lf_status submit(lf_engine_t e, const TestReq &r, uint64_t *id) {
  lf_request rq{};
  rq.prompt = r.prompt.data();
  rq.n_prompt = int(r.prompt.size());
  rq.max_tokens = r.max_tokens;
  rq.ignore_eos = r.ignore_eos;
  rq.sampling.temperature = r.temperature;
  rq.sampling.top_p = 1.0f;
  rq.sampling.seed = r.seed;
  rq.stop_ids = r.stop_ids.empty() ? nullptr : r.stop_ids.data();
  rq.n_stop_ids = int(r.stop_ids.size());
  std::vector<lf_stop_seq> seqs;
  for (const auto &s : r.stop_seqs)
    seqs.push_back({s.data(), int(s.size())});
  rq.stop_seqs = seqs.empty() ? nullptr : seqs.data();
  rq.n_stop_seqs = int(seqs.size());
  return lf_engine_submit(e, &rq, id);
}

/* Applies events to outcomes, checking that nothing follows a FINISH. */
inline void apply_events(const lf_event *ev, int n, std::map<uint64_t, Outcome> &out) {
  for (int i = 0; i < n; i++) {
    Outcome &o = out[ev[i].id];
    EXPECT_EQ(o.n_finish, 0) << "event after FINISH for request " << ev[i].id;
    if (ev[i].type == LF_EVENT_TOKEN) {
      o.tokens.push_back(ev[i].token);
    } else if (ev[i].type == LF_EVENT_FINISH) {
      o.n_finish++;
      o.reason = ev[i].reason;
      o.status = ev[i].status;
    }
  }
}

/* Steps until the engine is idle (bounded), collecting events. */
inline void run_to_idle(lf_engine_t e, std::map<uint64_t, Outcome> &out, int max_steps = 100000) {
  lf_event ev[64];
  for (int s = 0; s < max_steps && lf_engine_busy(e); s++) {
    int n = 0;
    ASSERT_EQ(lf_engine_step(e, ev, 64, &n), LF_OK) << lf_last_error();
    apply_events(ev, n, out);
  }
  ASSERT_FALSE(lf_engine_busy(e)) << "engine still busy after " << max_steps << " steps";
}

/* Runs one request alone on a fresh engine with cfg. */
inline Outcome run_alone(const lf_engine_config &cfg, const TestReq &r) {
  lf_engine_t e = nullptr;
  Outcome o;
  lf_status s = lf_engine_init(&cfg, nullptr, &e);
  EXPECT_EQ(s, LF_OK) << lf_last_error();
  if (s != LF_OK) return o;
  uint64_t id = 0;
  EXPECT_EQ(submit(e, r, &id), LF_OK) << lf_last_error();
  std::map<uint64_t, Outcome> out;
  run_to_idle(e, out);
  o = out[id];
  EXPECT_EQ(lf_engine_request_stats(e, id, &o.stats), LF_OK);
  lf_engine_free(e);
  return o;
}

#endif

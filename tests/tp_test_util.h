/* Shared by the tensor-parallel suites (mpi_tp.cpp on CPU ranks, mpi_gpu_tp.cpp on GPUs). */
#ifndef LF_TP_TEST_UTIL_H
#define LF_TP_TEST_UTIL_H

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <utility>
#include <vector>

#include "lfserve.h"

struct TpGen {
  std::vector<int32_t> prompt;
  int max_tokens;
  float temperature;
  uint64_t seed;
  int top_k = 0;      /* 0: off */
  float top_p = 1.0f; /* 1: off */
  float presence = 0.0f, repetition = 1.0f;
  std::vector<lf_logit_bias> bias = {};
  int logprobs = 0;
};

/* Runs the requests on engine e, rank 0 driving and the others following in lf_engine_follow;
 * returns rank 0's generated tokens per request (empty on followers). Every request must end
 * by length (they ignore EOS). */
inline std::vector<std::vector<int32_t>> lf_tp_test_run(lf_engine_t e,
                                                        const std::vector<TpGen> &gens,
                                                        bool lead) {
  std::vector<std::vector<int32_t>> out(gens.size());
  if (!lead) {
    EXPECT_EQ(lf_engine_follow(e), LF_OK) << lf_last_error();
    return out;
  }
  std::vector<uint64_t> ids;
  for (const TpGen &g : gens) {
    lf_request rq{};
    rq.prompt = g.prompt.data();
    rq.n_prompt = (int)g.prompt.size();
    rq.max_tokens = g.max_tokens;
    rq.sampling.temperature = g.temperature;
    rq.sampling.top_k = g.top_k;
    rq.sampling.top_p = g.top_p;
    rq.sampling.seed = g.seed;
    rq.sampling.presence_penalty = g.presence;
    rq.sampling.repetition_penalty = g.repetition;
    rq.sampling.logit_bias = g.bias.empty() ? nullptr : g.bias.data();
    rq.sampling.n_logit_bias = (int)g.bias.size();
    rq.sampling.logprobs = g.logprobs;
    rq.ignore_eos = 1;
    uint64_t id;
    EXPECT_EQ(lf_engine_submit(e, &rq, &id), LF_OK) << lf_last_error();
    ids.push_back(id);
  }
  lf_event ev[64];
  while (lf_engine_busy(e)) {
    int n = 0;
    lf_status s = lf_engine_step(e, ev, 64, &n);
    EXPECT_EQ(s, LF_OK) << lf_last_error();
    if (s != LF_OK) break;
    for (int i = 0; i < n; i++)
      for (size_t k = 0; k < ids.size(); k++)
        if (ev[i].id == ids[k]) {
          if (ev[i].type == LF_EVENT_TOKEN) out[k].push_back(ev[i].token);
          else EXPECT_EQ(ev[i].reason, LF_FINISH_LENGTH) << lf_status_str(ev[i].status);
        }
  }
  return out;
}

/* The requests on a single-rank engine of config cfg (empty on a failed start). */
inline std::vector<std::vector<int32_t>> lf_tp_test_run_single(const lf_engine_config &cfg,
                                                               const std::vector<TpGen> &gens) {
  lf_engine_t e = nullptr;
  const lf_status s = lf_engine_init(&cfg, nullptr, &e);
  EXPECT_EQ(s, LF_OK) << lf_last_error();
  if (s != LF_OK) return {};
  auto out = lf_tp_test_run(e, gens, true);
  lf_engine_free(e);
  return out;
}

/* The same requests on a TP engine over comm (every rank takes part) and then, on rank 0, on a
 * single-rank engine of the same config (or of *ref_cfg). Returns {TP tokens, single-rank
 * tokens}, both empty on the followers (and on a failed start). */
inline std::pair<std::vector<std::vector<int32_t>>, std::vector<std::vector<int32_t>>>
lf_tp_test_run_both(const lf_engine_config &cfg, lf_comm_t comm, const std::vector<TpGen> &gens,
                    const lf_engine_config *ref_cfg = nullptr) {
  const bool lead = lf_comm_rank(comm) == 0;
  std::vector<std::vector<int32_t>> tp;
  lf_engine_t e = nullptr;
  lf_status s = lf_engine_init(&cfg, comm, &e);
  EXPECT_EQ(s, LF_OK) << lf_last_error();
  if (s != LF_OK) return {tp, {}};
  tp = lf_tp_test_run(e, gens, lead);
  lf_engine_free(e);
  if (!lead) return {tp, {}};
  return {tp, lf_tp_test_run_single(ref_cfg ? *ref_cfg : cfg, gens)};
}

/* The part of a lost-rank run after the deliberate failure: followers follow; rank 0 serves one
 * long request until a step fails. Returns the process exit code: a follower's follow status,
 * 1 when rank 0 noticed the loss, 0 when it finished without noticing. With hard_exit a failed
 * step ends the process at once (no teardown behind a failed communicator). */
inline int lf_tp_test_serve_after_loss(lf_engine_t e, int rank, std::vector<int32_t> prompt,
                                       int max_tokens, bool hard_exit) {
  if (rank != 0) {
    lf_status s = lf_engine_follow(e);
    fprintf(stderr, "rank %d: follow returned %s: %s\n", rank, lf_status_str(s), lf_last_error());
    return s == LF_OK ? 0 : 1;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  lf_request rq{};
  rq.prompt = prompt.data();
  rq.n_prompt = (int)prompt.size();
  rq.max_tokens = max_tokens;
  rq.ignore_eos = 1;
  uint64_t id;
  lf_engine_submit(e, &rq, &id);
  lf_event ev[16];
  while (lf_engine_busy(e)) {
    int n;
    lf_status s = lf_engine_step(e, ev, 16, &n);
    if (s != LF_OK) {
      fprintf(stderr, "rank 0: step failed: %s: %s\n", lf_status_str(s), lf_last_error());
      if (hard_exit) std::_Exit(1);
      return 1; // lfgen's behaviour: exit non-zero
    }
  }
  fprintf(stderr, "rank 0: finished without noticing the lost rank\n");
  return 0;
}

#endif

/* Running one request alone through the public engine API (shared by the engine test suites). */
#ifndef LF_ENGINE_TEST_UTIL_H
#define LF_ENGINE_TEST_UTIL_H

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "lfserve.h"

struct LfRun {
  lf_status init = LF_OK; /* lf_engine_init's status; nothing else is set when it failed */
  std::vector<int32_t> tokens;
  lf_finish_reason reason = LF_FINISH_NONE;
  lf_status finish_status = LF_OK; /* the FINISH event's status */
  lf_request_stats stats{};
};

/* Makes an engine from cfg, runs the one request to its end, frees the engine. */
inline LfRun lf_test_run_one(const lf_engine_config &cfg, const std::vector<int32_t> &prompt,
                             int max_tokens, bool ignore_eos) {
  LfRun r;
  lf_engine_t e = nullptr;
  r.init = lf_engine_init(&cfg, nullptr, &e);
  if (r.init != LF_OK) return r;
  lf_request rq{};
  rq.prompt = prompt.data();
  rq.n_prompt = int(prompt.size());
  rq.max_tokens = max_tokens;
  rq.ignore_eos = ignore_eos;
  uint64_t id;
  EXPECT_EQ(lf_engine_submit(e, &rq, &id), LF_OK) << lf_last_error();
  lf_event ev[8];
  while (lf_engine_busy(e)) {
    int n;
    EXPECT_EQ(lf_engine_step(e, ev, 8, &n), LF_OK) << lf_last_error();
    for (int i = 0; i < n; i++) {
      EXPECT_EQ(ev[i].id, id);
      if (ev[i].type == LF_EVENT_TOKEN) {
        r.tokens.push_back(ev[i].token);
      } else {
        r.reason = ev[i].reason;
        r.finish_status = ev[i].status;
      }
    }
  }
  EXPECT_EQ(lf_engine_request_stats(e, id, &r.stats), LF_OK);
  lf_engine_free(e);
  return r;
}

#endif

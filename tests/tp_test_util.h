/* Shared by the tensor-parallel suites (mpi_tp.cpp on CPU ranks, mpi_gpu_tp.cpp on GPUs). */
#ifndef LF_TP_TEST_UTIL_H
#define LF_TP_TEST_UTIL_H

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "lfserve.h"

struct TpGen {
  std::vector<int32_t> prompt;
  int max_tokens;
  float temperature;
  uint64_t seed;
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
    rq.sampling.top_p = 1.0f;
    rq.sampling.seed = g.seed;
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

#endif

// The public enums' names: lf_backend_parse / lf_backend_str, lf_policy_parse / lf_policy_str
// and lf_finish_reason_str (one distinct name per reason below LF_FINISH_COUNT).
#include <gtest/gtest.h>

#include <initializer_list>
#include <set>
#include <string>

#include "lfserve.h"

namespace {

TEST(ApiNames, BackendRoundTrips) {
  for (lf_backend_kind b : {LF_BACKEND_AUTO, LF_BACKEND_CPU, LF_BACKEND_CUDA}) {
    lf_backend_kind got = LF_BACKEND_AUTO;
    ASSERT_EQ(lf_backend_parse(lf_backend_str(b), &got), LF_OK) << lf_backend_str(b);
    EXPECT_EQ(got, b);
  }
  EXPECT_STREQ(lf_backend_str(LF_BACKEND_AUTO), "auto");
  EXPECT_STREQ(lf_backend_str(LF_BACKEND_CPU), "cpu");
  EXPECT_STREQ(lf_backend_str(LF_BACKEND_CUDA), "cuda");
  EXPECT_STREQ(lf_backend_str((lf_backend_kind)42), "unknown");
}

TEST(ApiNames, BackendRejectsOthersAndNamesTheChoices) {
  for (const char *s : std::initializer_list<const char *>{"", "CUDA", "gpu", "cpu ", nullptr}) {
    lf_backend_kind got = LF_BACKEND_CPU;
    EXPECT_EQ(lf_backend_parse(s, &got), LF_ERR_INVALID_ARG) << (s ? s : "(null)");
    EXPECT_EQ(got, LF_BACKEND_CPU) << "left unchanged";
    EXPECT_NE(std::string(lf_last_error()).find("auto, cpu, cuda"), std::string::npos)
        << lf_last_error();
  }
}

TEST(ApiNames, PolicyRoundTrips) {
  for (lf_policy p : {LF_POLICY_LONGFLOW, LF_POLICY_FULL, LF_POLICY_STREAMING, LF_POLICY_H2O,
                       LF_POLICY_RKV}) {
    lf_policy got = LF_POLICY_FULL;
    ASSERT_EQ(lf_policy_parse(lf_policy_str(p), &got), LF_OK) << lf_policy_str(p);
    EXPECT_EQ(got, p);
  }
  lf_policy got;
  EXPECT_EQ(lf_policy_parse("lru", &got), LF_ERR_INVALID_ARG);
  EXPECT_NE(
      std::string(lf_last_error()).find("unknown policy 'lru' (longflow, full, streaming, h2o, rkv)"),
      std::string::npos)
      << lf_last_error();
}

TEST(ApiNames, FinishReasonsHaveDistinctNames) {
  std::set<std::string> seen;
  for (int r = 0; r < LF_FINISH_COUNT; r++) {
    const std::string s = lf_finish_reason_str((lf_finish_reason)r);
    EXPECT_NE(s, "unknown") << r;
    EXPECT_TRUE(seen.insert(s).second) << s;
  }
  EXPECT_STREQ(lf_finish_reason_str(LF_FINISH_EOS), "eos");
  EXPECT_STREQ(lf_finish_reason_str(LF_FINISH_STOP_ID), "stop_id");
  EXPECT_STREQ(lf_finish_reason_str(LF_FINISH_STOP_SEQUENCE), "stop_sequence");
  EXPECT_STREQ(lf_finish_reason_str(LF_FINISH_COUNT), "unknown");
}

} // namespace

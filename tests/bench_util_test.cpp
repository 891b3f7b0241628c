// lfbench's shared helpers (bench/bench_util.c): the peer-row lookup every GPU subcommand uses
// to put a peer's time beside its own, and the list / median / number parsers.
#include <gtest/gtest.h>

extern "C" {
#include "bench/bench_util.h"
}

namespace {

const char *kPeer =
    "{\"bench\": \"sdpa\", \"device\": \"X\",\n"
    "  \"rows\": [\n"
    "  {\"batch\": 1, \"budget\": 1024, \"time_us\": 13.46},\n"
    "  {\"batch\": 8, \"budget\": 1024, \"time_us\": 20.5},\n"
    "  {\"batch\": 8,\"budget\":3200,\"time_us\":  44.58},\n"
    "  {\"batch\": 32, \"budget\": 3200},\n"
    "  {\"budget\": 4096, \"batch\": 64, \"time_us\": 7}\n"
    "]}\n";

TEST(BenchPeerValue, FindsTheRowWhoseKeysAllMatchOnOneLine) {
  EXPECT_DOUBLE_EQ(bench_peer_value(kPeer, "batch", 1, "budget", 1024, "time_us"), 13.46);
  EXPECT_DOUBLE_EQ(bench_peer_value(kPeer, "batch", 8, "budget", 1024, "time_us"), 20.5);
  EXPECT_DOUBLE_EQ(bench_peer_value(kPeer, "batch", 8, "budget", 3200, "time_us"), 44.58);
  // key order within the line does not matter
  EXPECT_DOUBLE_EQ(bench_peer_value(kPeer, "batch", 64, "budget", 4096, "time_us"), 7.0);
}

TEST(BenchPeerValue, MinusOneWithoutSuchARowOrFigure) {
  EXPECT_EQ(bench_peer_value(kPeer, "batch", 1, "budget", 3200, "time_us"), -1.0);
  EXPECT_EQ(bench_peer_value(kPeer, "batch", 2, "budget", 1024, "time_us"), -1.0);
  // the row exists but has no time: the next line's time must not be taken
  EXPECT_EQ(bench_peer_value(kPeer, "batch", 32, "budget", 3200, "time_us"), -1.0);
  EXPECT_EQ(bench_peer_value("", "batch", 1, "budget", 1024, "time_us"), -1.0);
}

TEST(BenchPeerValue, KeysDoNotMatchAcrossLines) {
  // batch on one line and budget on the next are not a row
  const char *split = "{\"batch\": 4,\n\"budget\": 512, \"time_us\": 9}\n";
  EXPECT_EQ(bench_peer_value(split, "batch", 4, "budget", 512, "time_us"), -1.0);
}

TEST(BenchJsonNum, NumberAfterTheKeyWithinTheLine) {
  const char *s = "{\"prompt\": 2048, \"time_ms\": null, \"batch\":8}";
  const char *e = s + strlen(s);
  double v = 0;
  ASSERT_EQ(bench_json_num(s, e, "prompt", &v), 1);
  EXPECT_EQ(v, 2048.0);
  ASSERT_EQ(bench_json_num(s, e, "batch", &v), 1);
  EXPECT_EQ(v, 8.0);
  EXPECT_EQ(bench_json_num(s, e, "time_ms", &v), 0);  // null is not a number
  EXPECT_EQ(bench_json_num(s, e, "tokens", &v), 0);
  EXPECT_EQ(bench_json_num(s, s + 10, "batch", &v), 0);  // beyond the end given
}

TEST(BenchIntList, CommaListsOfPositiveIntegers) {
  int out[4];
  EXPECT_EQ(bench_int_list("1,64,128", out, 4), 3);
  EXPECT_EQ(out[0], 1);
  EXPECT_EQ(out[2], 128);
  EXPECT_EQ(bench_int_list("1,0", out, 4), -1);
  EXPECT_EQ(bench_int_list("1,,2", out, 4), -1);
  EXPECT_EQ(bench_int_list("1,2,3,4,5", out, 4), -1);
  EXPECT_EQ(bench_int_list("7x", out, 4), -1);
}

TEST(BenchMedian, OddAndEvenCounts) {
  double a[] = {5, 1, 3};
  EXPECT_EQ(bench_median(a, 3), 3.0);
  double b[] = {4, 1, 3, 2};
  EXPECT_EQ(bench_median(b, 4), 2.5);
}

}  // namespace

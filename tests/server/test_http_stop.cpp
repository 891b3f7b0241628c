/* The server's stop-string matcher (launch/http_stop.c): text-level stops, held-back text. */
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

extern "C" {
#include "launch/http_stop.h"
}

namespace {

struct Stops {
  std::vector<std::string> s;
  std::vector<lfs_stop_str> v;
  explicit Stops(std::vector<std::string> in) : s(std::move(in)) {
    for (auto &x : s)
      v.push_back({&x[0], x.size()});
  }
};

/* Feeds pieces one by one; returns what was emitted after each, and whether it matched. */
std::vector<std::string> feed(const Stops &st, const std::vector<std::string> &pieces, int *matched,
                              int flush = 1) {
  lfs_stopper s;
  lfs_stopper_init(&s, st.v.data(), (int)st.v.size());
  std::vector<std::string> out;
  *matched = 0;
  for (const auto &p : pieces) {
    lfs_buf b = {};
    int r = lfs_stopper_put(&s, p.data(), p.size(), &b);
    EXPECT_GE(r, 0);
    out.emplace_back(b.data ? b.data : "", b.len);
    lfs_buf_free(&b);
    if (r == 1) {
      *matched = 1;
      break;
    }
  }
  if (!*matched && flush) {
    lfs_buf b = {};
    lfs_stopper_flush(&s, &b);
    out.emplace_back(b.data ? b.data : "", b.len);
    lfs_buf_free(&b);
  }
  lfs_stopper_free(&s);
  return out;
}

std::string join(const std::vector<std::string> &v) {
  std::string s;
  for (auto &x : v)
    s += x;
  return s;
}

}  // namespace

TEST(HttpStop, AcrossAndInsidePieces) {
  int m;
  /* across a boundary: "lo w" spans "hel|lo| wor|ld" */
  Stops a({"lo w"});
  auto out = feed(a, {"hel", "lo", " wor", "ld"}, &m);
  EXPECT_TRUE(m);
  EXPECT_EQ(join(out), "hel");
  EXPECT_EQ(out[0], "he"); /* "l" could begin the stop string: held */
  EXPECT_EQ(out[1], "l");  /* ruled out by "o"; now "lo" is held */
  /* inside one piece */
  Stops b({"ell"});
  out = feed(b, {"hello", " world"}, &m);
  EXPECT_TRUE(m);
  EXPECT_EQ(join(out), "h");
  /* held, then broken: released with the piece that rules it out */
  Stops c({"lo wX"});
  out = feed(c, {"hel", "lo", " wor", "ld"}, &m);
  EXPECT_FALSE(m);
  EXPECT_EQ(out[0], "he");
  EXPECT_EQ(out[1], "l");
  EXPECT_EQ(out[2], "lo wor");
  EXPECT_EQ(join(out), "hello world");
  /* held at the end: flushed */
  out = feed(c, {"hel", "lo", " w"}, &m);
  EXPECT_FALSE(m);
  EXPECT_EQ(out[2], "");
  EXPECT_EQ(out.back(), "lo w");
  /* multi-byte characters: cuts fall on character boundaries */
  Stops d({"\xe2\x98\x83!"});
  out = feed(d, {"a\xe2\x98\x83", "b\xe2\x98\x83", "!c"}, &m);
  EXPECT_TRUE(m);
  EXPECT_EQ(join(out), "a\xe2\x98\x83"
                       "b");
  /* the first to complete wins, the longer on a tie */
  Stops e({"cabc", "a"});
  out = feed(e, {"xc", "a", "bc"}, &m);
  EXPECT_TRUE(m);
  EXPECT_EQ(join(out), "xc");
  Stops f({"b", "ab"});
  out = feed(f, {"xab"}, &m);
  EXPECT_EQ(join(out), "x");
  /* no stops: everything passes */
  Stops none({});
  out = feed(none, {"a", "b"}, &m);
  EXPECT_EQ(join(out), "ab");
}

/* Random texts, stops and splits against a byte-at-a-time reference: the output is the text up
 * to the first completed stop string, and nothing past that point is ever emitted. */
TEST(HttpStop, RandomSplitsMatchReference) {
  std::mt19937 rng(7);
  const char alpha[] = {'a', 'b', '\0', 'c'};
  for (int it = 0; it < 50000; it++) {
    std::vector<std::string> stops(1 + rng() % 3);
    for (auto &s : stops)
      for (int k = 0, n = 1 + (int)(rng() % 4); k < n; k++)
        s += alpha[rng() % 4];
    std::string text;
    for (int k = 0, n = (int)(rng() % 20); k < n; k++)
      text += alpha[rng() % 4];
    size_t cut = text.size();
    bool want = false;
    for (size_t e = 1; e <= text.size() && !want; e++)
      for (auto &s : stops)
        if (s.size() <= e && text.compare(e - s.size(), s.size(), s) == 0 &&
            (!want || e - s.size() < cut)) {
          cut = e - s.size();
          want = true;
        }
    std::vector<std::string> pieces;
    for (size_t p = 0; p < text.size();) {
      size_t n = std::min(text.size() - p, (size_t)(1 + rng() % 4));
      pieces.push_back(text.substr(p, n));
      p += n;
    }
    Stops st(stops);
    int m;
    auto out = feed(st, pieces, &m);
    ASSERT_EQ(m, want ? 1 : 0) << it;
    std::string sofar;
    for (auto &o : out) {
      sofar += o;
      ASSERT_LE(sofar.size(), cut) << it << ": emitted text a stop string may still claim";
    }
    ASSERT_EQ(sofar, text.substr(0, cut)) << it;
  }
}

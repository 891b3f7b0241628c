// The JSON parser (text/json.c): types, strings, numbers, errors, limits, and fuzzed input.
#include "tests/loader_util.h"

using namespace loader_test;

namespace {

struct Json {
  lf_json *v = nullptr;
  char err[256] = "";
  lf_status st = LF_OK;
  explicit Json(const std::string &s) {
    st = lf_json_parse(s.data(), s.size(), &v, err, sizeof err);
  }
  ~Json() {
    lf_json_free(v);
  }
};

TEST(Json, ParsesAllTypes) {
  Json j(R"( {"a": 1, "b": [true, false, null, -2.5e1, "x"], "c": {"d": {}}, "e": [], "a": 7} )");
  ASSERT_EQ(j.st, LF_OK) << j.err;
  ASSERT_EQ(lf_json_typeof(j.v), LF_JSON_OBJECT);
  EXPECT_EQ(lf_json_len(j.v), 5u);
  int64_t i;
  ASSERT_TRUE(lf_json_int(lf_json_get(j.v, "a"), &i));
  EXPECT_EQ(i, 7) << "the last of duplicate keys wins";
  EXPECT_STREQ(lf_json_key_at(j.v, 0), "a");
  ASSERT_TRUE(lf_json_int(lf_json_at(j.v, 0), &i));
  EXPECT_EQ(i, 1);
  const lf_json *b = lf_json_get(j.v, "b");
  ASSERT_EQ(lf_json_len(b), 5u);
  int bv = -1;
  EXPECT_TRUE(lf_json_bool(lf_json_at(b, 0), &bv));
  EXPECT_EQ(bv, 1);
  EXPECT_TRUE(lf_json_bool(lf_json_at(b, 1), &bv));
  EXPECT_EQ(bv, 0);
  EXPECT_EQ(lf_json_typeof(lf_json_at(b, 2)), LF_JSON_NULL);
  double d;
  EXPECT_TRUE(lf_json_num(lf_json_at(b, 3), &d));
  EXPECT_EQ(d, -25.0);
  EXPECT_TRUE(lf_json_int(lf_json_at(b, 3), &i)) << "-2.5e1 is integral";
  EXPECT_EQ(i, -25);
  size_t len;
  EXPECT_STREQ(lf_json_str(lf_json_at(b, 4), &len), "x");
  EXPECT_EQ(len, 1u);
  EXPECT_EQ(lf_json_at(b, 5), nullptr);
  EXPECT_EQ(lf_json_typeof(lf_json_get(lf_json_get(j.v, "c"), "d")), LF_JSON_OBJECT);
  EXPECT_EQ(lf_json_len(lf_json_get(j.v, "e")), 0u);
  EXPECT_EQ(lf_json_get(j.v, "zz"), nullptr);
  EXPECT_EQ(lf_json_get(b, "a"), nullptr) << "arrays have no keys";
  EXPECT_EQ(lf_json_key_at(b, 0), nullptr);
  // Wrong-type reads fail and leave the output alone.
  i = 42;
  EXPECT_FALSE(lf_json_int(lf_json_at(b, 4), &i));
  EXPECT_FALSE(lf_json_int(nullptr, &i));
  EXPECT_EQ(i, 42);
  EXPECT_EQ(lf_json_str(lf_json_at(b, 0), nullptr), nullptr);
}

TEST(Json, StringEscapesAndSurrogates) {
  Json j(R"(["\"\\\/\b\f\n\r\t", "\u00e9\u20AC", "\uD83D\uDE00", "a\u0000b", "é€😀", ""])");
  ASSERT_EQ(j.st, LF_OK) << j.err;
  size_t n;
  EXPECT_EQ(std::string(lf_json_str(lf_json_at(j.v, 0), &n)), "\"\\/\b\f\n\r\t");
  EXPECT_EQ(std::string(lf_json_str(lf_json_at(j.v, 1), &n)), "\xC3\xA9\xE2\x82\xAC");
  EXPECT_EQ(std::string(lf_json_str(lf_json_at(j.v, 2), &n)), "\xF0\x9F\x98\x80");
  const char *s = lf_json_str(lf_json_at(j.v, 3), &n);
  ASSERT_EQ(n, 3u) << "\\u0000 is kept, with an explicit length";
  EXPECT_EQ(std::memcmp(s, "a\0b", 4), 0);
  EXPECT_EQ(std::string(lf_json_str(lf_json_at(j.v, 4), &n)), "é€😀");
  EXPECT_EQ(lf_json_str(lf_json_at(j.v, 5), &n), std::string());
  EXPECT_EQ(n, 0u);
  // Escaped keys are decoded too.
  Json k(R"({"k\u0065y": 1})");
  ASSERT_EQ(k.st, LF_OK);
  EXPECT_NE(lf_json_get(k.v, "key"), nullptr);
}

TEST(Json, RejectsBadStrings) {
  const char *bad[] = {
      R"("\uD83D")",          // lone high surrogate
      R"("\uDE00")",          // lone low surrogate
      R"("\uD83Dx\uDE00")",   // high surrogate not followed by its low half
      R"("\uD83D\u0041")",    // high surrogate followed by a non-surrogate
      R"("\x41")",            // no such escape
      R"("\u12G4")",          // bad hex
      R"("\u12)",             // escape cut short
      "\"abc",                // unterminated
      "\"a\\",                // unterminated after a backslash
      "\"a\nb\"",             // raw control character
      "\"\xC0\x80\"",         // overlong NUL
      "\"\xED\xA0\x80\"",     // a UTF-8-encoded surrogate
      "\"\xF5\x80\x80\x80\"", // above U+10FFFF
      "\"\xE2\x82\"",         // truncated sequence
      "\"\x80\"",             // stray continuation byte
  };
  for (const char *b : bad) {
    Json j(b);
    EXPECT_EQ(j.st, LF_ERR_FORMAT) << b;
    EXPECT_EQ(j.v, nullptr);
    EXPECT_NE(std::string(j.err).find("at byte"), std::string::npos) << j.err;
  }
}

TEST(Json, Numbers) {
  struct Case {
    const char *text;
    bool is_int;
    int64_t i;
    double d;
  } ok[] = {
      {"0", true, 0, 0.0},
      {"-0", true, 0, -0.0},
      {"123", true, 123, 123.0},
      {"-9223372036854775808", true, INT64_MIN, -9223372036854775808.0},
      {"9223372036854775807", true, INT64_MAX, 9223372036854775807.0},
      {"9223372036854775808", false, 0, 9223372036854775808.0},
      {"1.5", false, 0, 1.5},
      {"1e3", true, 1000, 1000.0},
      {"2.0", true, 2, 2.0},
      {"1E+2", true, 100, 100.0},
      {"-1.25e-2", false, 0, -0.0125},
      {"1e-400", true, 0, 0.0},
      {"500000.0", true, 500000, 500000.0},
  };
  for (const auto &c : ok) {
    Json j(c.text);
    ASSERT_EQ(j.st, LF_OK) << c.text << ": " << j.err;
    double d;
    ASSERT_TRUE(lf_json_num(j.v, &d));
    EXPECT_EQ(d, c.d) << c.text;
    int64_t i;
    EXPECT_EQ(lf_json_int(j.v, &i) != 0, c.is_int) << c.text;
    if (c.is_int) {
      EXPECT_EQ(i, c.i) << c.text;
    }
  }
  const char *bad[] = {"01",    "-",      "1.",   ".5",  "1e",       "1e+",   "+1", "--1",
                       "1e400", "-1e400", "0x10", "NaN", "Infinity", "1.2.3", "- 1"};
  for (const char *b : bad) {
    Json j(b);
    EXPECT_EQ(j.st, LF_ERR_FORMAT) << b;
  }
}

TEST(Json, ErrorsGiveByteOffsetAndLine) {
  Json a("[1,2,x]");
  EXPECT_EQ(a.st, LF_ERR_FORMAT);
  EXPECT_NE(std::string(a.err).find("at byte 5 "), std::string::npos) << a.err;
  EXPECT_NE(std::string(lf_last_error()).find("at byte 5 "), std::string::npos);
  Json b("{\n  \"a\": 1,\n  \"b\" 2\n}");
  EXPECT_EQ(b.st, LF_ERR_FORMAT);
  EXPECT_NE(std::string(b.err).find("line 3, column 7"), std::string::npos) << b.err;
  const char *bad[] = {"",        "   ",      "{",          "[",          "[1,]", "[1 2]",
                       "{\"a\"}", "{\"a\":}", "{1:2}",      "{\"a\":1,}", "{} x", "[] []",
                       "tru",     "nul",      "falsey",     "]",          "}",    "'a'",
                       "[1,2",    "{\"a\":1", "\"a\" \"b\""};
  for (const char *s : bad) {
    Json j(s);
    EXPECT_EQ(j.st, LF_ERR_FORMAT) << "[" << s << "]";
    EXPECT_EQ(j.v, nullptr);
  }
  Json ws(" \t\r\n {} \n");
  EXPECT_EQ(ws.st, LF_OK);
  Json bom("\xEF\xBB\xBF{\"a\":1}");
  EXPECT_EQ(bom.st, LF_OK) << "a leading UTF-8 BOM is allowed";
  lf_json *v = nullptr;
  EXPECT_EQ(lf_json_parse("1", 1, nullptr, nullptr, 0), LF_ERR_INVALID_ARG);
  EXPECT_EQ(lf_json_parse(nullptr, 0, &v, nullptr, 0), LF_ERR_FORMAT);
}

TEST(Json, NestingLimit) {
  const int max = LF_JSON_MAX_DEPTH;
  std::string ok = std::string(max, '[') + std::string(max, ']');
  Json a(ok);
  EXPECT_EQ(a.st, LF_OK) << a.err;
  std::string deep = std::string(max + 1, '[') + std::string(max + 1, ']');
  Json b(deep);
  EXPECT_EQ(b.st, LF_ERR_FORMAT);
  EXPECT_NE(std::string(b.err).find("nesting"), std::string::npos) << b.err;
  std::string objs;
  for (int i = 0; i <= max; i++)
    objs += "{\"a\":";
  objs += "1" + std::string(max + 1, '}');
  Json c(objs);
  EXPECT_EQ(c.st, LF_ERR_FORMAT);
  // Far deeper input must fail cleanly, not exhaust the stack.
  Json d(std::string(1 << 20, '['));
  EXPECT_EQ(d.st, LF_ERR_FORMAT);
}

TEST(Json, LengthBoundedInput) {
  const char buf[] = "[1,2]garbage";
  lf_json *v = nullptr;
  ASSERT_EQ(lf_json_parse(buf, 5, &v, nullptr, 0), LF_OK);
  EXPECT_EQ(lf_json_len(v), 2u);
  lf_json_free(v);
  ASSERT_EQ(lf_json_parse("12345", 2, &v, nullptr, 0), LF_OK);
  int64_t i;
  ASSERT_TRUE(lf_json_int(v, &i));
  EXPECT_EQ(i, 12);
  lf_json_free(v);
  EXPECT_EQ(lf_json_parse("\"abc\"", 4, &v, nullptr, 0), LF_ERR_FORMAT);
  EXPECT_EQ(lf_json_parse("true", 3, &v, nullptr, 0), LF_ERR_FORMAT);
  EXPECT_EQ(lf_json_parse("\"\\u00e9\"", 7, &v, nullptr, 0), LF_ERR_FORMAT);
  EXPECT_EQ(lf_json_parse("\"\\uD83D\\uDE00\"", 13, &v, nullptr, 0), LF_ERR_FORMAT);
  // Heap copies with nothing after the text, so ASan sees any overread.
  for (const std::string s : {"[1,2", "{\"a\":tru", "-12e", "\"\\uD83D\\uDE0", "\"\xF0\x9F\x98"}) {
    std::vector<char> exact(s.begin(), s.end());
    EXPECT_EQ(lf_json_parse(exact.data(), exact.size(), &v, nullptr, 0), LF_ERR_FORMAT) << s;
  }
  char err[8];
  EXPECT_EQ(lf_json_parse("[", 1, &v, err, sizeof err), LF_ERR_FORMAT);
  EXPECT_EQ(std::strlen(err), sizeof err - 1) << "the message is cut to errcap";
}

// Random mutations of valid documents and random bytes: no crash, no leak, no overread (run
// under ASan), and whatever parses can be walked.
size_t walk(const lf_json *v) {
  size_t n = 1;
  for (size_t i = 0; i < lf_json_len(v); i++)
    n += walk(lf_json_at(v, i));
  return n;
}

TEST(Json, FuzzDoesNotCrash) {
  auto rng = make_rng();
  const std::string seeds[] = {
      R"({"a": [1, 2.5e-3, "x\u00e9\uD83D\uDE00", {"b": null, "c": true}], "d": false})",
      R"([[[[{"k": "v"}]]], -0, 1e10, "\"\\\/\b\f\n\r\t"])",
      R"({"model.layers.0.mlp.up_proj.weight": {"dtype": "BF16", "shape": [12, 8], "data_offsets": [0, 192]}})",
  };
  const char alphabet[] = "{}[]\",:0123456789.eE+-\\u tfnrlsa\xC3\xA9\xED\xF0\x80\x00";
  size_t parsed = 0;
  for (int it = 0; it < 20000; it++) {
    std::string s = seeds[rng() % 3];
    const int edits = 1 + int(rng() % 4);
    for (int e = 0; e < edits; e++) {
      const size_t pos = s.empty() ? 0 : rng() % s.size();
      const char c = alphabet[rng() % (sizeof alphabet - 1)];
      switch (rng() % 4) {
      case 0:
        if (!s.empty()) s[pos] = c;
        break;
      case 1:
        s.insert(s.begin() + long(pos), c);
        break;
      case 2:
        if (!s.empty()) s.erase(pos, 1 + rng() % 3);
        break;
      default:
        s.resize(pos);
        break;
      }
    }
    if (it % 10 == 0) { // pure noise
      s.resize(rng() % 64);
      for (auto &ch : s)
        ch = char(rng());
    }
    std::vector<char> exact(s.begin(), s.end());
    lf_json *v = nullptr;
    char err[128];
    lf_status st = lf_json_parse(exact.data(), exact.size(), &v, err, sizeof err);
    if (st == LF_OK) {
      parsed++;
      EXPECT_GE(walk(v), 1u);
    } else {
      EXPECT_EQ(st, LF_ERR_FORMAT);
      EXPECT_EQ(v, nullptr);
    }
    lf_json_free(v);
  }
  EXPECT_GT(parsed, 0u);
}

} // namespace

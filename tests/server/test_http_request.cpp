/* The server's request parser (launch/http_request.c): every check it makes on an OpenAI-style
 * body, with the exact status, code, param and message the client gets, and what a valid body
 * turns into. The JSON text itself is cJSON's (with the stricter RFC 8259 checks in front of it):
 * malformed bodies are pinned by status and code only, since cJSON reports just a position. */
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

extern "C" {
#include "launch/http_request.h"
}

namespace {

lf_tokenizer *g_tok;
lf_chat_template *g_tmpl;
int g_vocab;

class Env : public ::testing::Environment {
public:
  void SetUp() override {
    std::string dir = LF_SOURCE_DIR "/tests/data/tokenizers/bytelevel_qwen2";
    ASSERT_EQ(lf_tokenizer_init_file((dir + "/tokenizer.json").c_str(), &g_tok), LF_OK)
        << lf_last_error();
    ASSERT_EQ(lf_chat_template_init_dir(dir.c_str(), nullptr, &g_tmpl), LF_OK) << lf_last_error();
    g_vocab = lf_tokenizer_vocab_size(g_tok);
  }
  void TearDown() override {
    lf_chat_template_free(g_tmpl);
    lf_tokenizer_free(g_tok);
  }
};
const auto *g_env = ::testing::AddGlobalTestEnvironment(new Env);

lfs_model_ctx model() {
  lfs_model_ctx m = {};
  m.tok = g_tok;
  m.tmpl = g_tmpl;
  m.model_name = "m";
  m.vocab_size = g_vocab;
  m.max_seq_len = 4096;
  m.budget = 256;
  m.policy = LF_POLICY_LONGFLOW;
  return m;
}

struct Parsed {
  int rc;
  lfs_request r;
  lfs_error e;
  Parsed(const lfs_model_ctx &m, int chat, const std::string &body) {
    memset(&e, 0, sizeof e);
    rc = lfs_request_parse(&m, chat, body.data(), body.size(), &r, &e);
  }
  ~Parsed() {
    if (rc == 0) lfs_request_free(&r);
  }
  Parsed(const Parsed &) = delete;
  Parsed &operator=(const Parsed &) = delete;
};

std::string ids_json(int n, int id = 5) {
  std::string s = "[";
  for (int i = 0; i < n; i++)
    s += (i ? "," : "") + std::to_string(id);
  return s + "]";
}

/* Expects the body to be refused with exactly this error (message "" : not checked). */
void expect_err(const lfs_model_ctx &m, int chat, const std::string &body, int status,
                const char *code, const char *param, const std::string &message) {
  Parsed p(m, chat, body);
  ASSERT_EQ(p.rc, -1) << body;
  EXPECT_EQ(p.e.status, status) << body;
  EXPECT_STREQ(p.e.code, code) << body;
  EXPECT_STREQ(p.e.param, param) << body;
  if (!message.empty()) {
    EXPECT_EQ(std::string(p.e.message), message) << body;
  }
  EXPECT_STREQ(p.e.type, "invalid_request_error") << body;
  /* A failed parse leaves *out empty. */
  EXPECT_EQ(p.r.prompt, nullptr);
  EXPECT_EQ(p.r.n_prompt, 0);
  EXPECT_EQ(p.r.stop_strs, nullptr);
}

void expect_bad_json(const std::string &body, int chat = 0) {
  lfs_model_ctx m = model();
  Parsed p(m, chat, body);
  ASSERT_EQ(p.rc, -1) << body;
  EXPECT_EQ(p.e.status, 400) << body;
  EXPECT_STREQ(p.e.code, "invalid_json") << body;
  EXPECT_STREQ(p.e.param, "") << body;
  EXPECT_EQ(std::string(p.e.message).rfind("the request body is not valid JSON: ", 0), 0u)
      << p.e.message;
}

void expect_ok(const std::string &body, int chat = 0) {
  lfs_model_ctx m = model();
  Parsed p(m, chat, body);
  EXPECT_EQ(p.rc, 0) << body << ": " << p.e.message;
}

std::vector<int32_t> prompt_of(const Parsed &p) {
  return std::vector<int32_t>(p.r.prompt, p.r.prompt + p.r.n_prompt);
}

TEST(HttpRequest, MalformedJson) {
  expect_bad_json("{not json");
  expect_bad_json("");
  expect_bad_json("   ");
  expect_bad_json("\xff\xfe{}");
  expect_bad_json("{\"prompt\": \"a\xc3\"}");         /* truncated UTF-8 */
  expect_bad_json("{\"prompt\": \"a\xed\xa0\x80\"}"); /* an encoded surrogate */
  expect_bad_json("{\"prompt\": \"a\xc0\xaf\"}");     /* overlong */
  expect_bad_json("{\"prompt\": \"a\x01\"}");         /* raw control character */
  expect_bad_json("{\"prompt\": \"a\nb\"}");
  expect_bad_json(std::string("{\"prompt\": \"a") + '\0' + "b\"}"); /* raw NUL */
  expect_bad_json("{\x01\"prompt\": \"hi\"}");                      /* not JSON whitespace */
  expect_bad_json("{\"prompt\": \"hi\"\x0b}");
  expect_bad_json(std::string("{\"prompt\": \"hi\"}") + '\0');
  expect_bad_json("{\"prompt\": \"\\x\"}"); /* invalid escape */
  expect_bad_json("{\"prompt\": \"\\u12\"}");
  expect_bad_json("{\"prompt\": \"\\u12x4\"}"); /* cJSON alone would read a NUL */
  expect_bad_json("{\"prompt\": \"hi\", \"x\\ud8dl\": 1}");
  expect_bad_json("{\"prompt\": \"\\ud800\"}"); /* unpaired surrogates */
  expect_bad_json("{\"prompt\": \"\\udc00\"}");
  expect_bad_json("{\"prompt\": \"\\ud800\\u0041\"}");
  expect_bad_json("{\"prompt\": \"abc"); /* unterminated */
  expect_bad_json("{\"prompt\": \"abc\\");
  expect_bad_json("{\"prompt\": \"abc\\\"}");
  expect_bad_json("\"");
  expect_bad_json("{\"prompt\": \"hi\"} x"); /* data after the value */
  expect_bad_json("{\"prompt\": \"hi\"}{}");
  expect_bad_json("{\"prompt\": \"hi\",}");
  expect_bad_json("{\"prompt\": tru}");
  expect_bad_json("{\"prompt\": nul");
  expect_bad_json("{'prompt': 'hi'}");
  expect_bad_json("{\"prompt\" \"hi\"}");
  expect_bad_json("[1,2");
  expect_bad_json(std::string(5000, '[') + std::string(5000, ']'));
  /* Numbers: RFC 8259's grammar, finite. */
  for (const char *n : {"01", "-01", "00", "1.", "1.e3", ".5", "-.5", "+1", "-", "1e", "1e+",
                        "0x10", "1e400", "-1e400", "Infinity", "NaN", "1.5.5", "1e5e5", "--1"})
    expect_bad_json(std::string("{\"prompt\": \"hi\", \"x\": ") + n + "}");
}

TEST(HttpRequest, JsonEdges) {
  expect_ok("\xef\xbb\xbf{\"prompt\": \"hi\"}");                   /* a leading BOM */
  expect_bad_json("\xef\xbb\xbf\xef\xbb\xbf{\"prompt\": \"hi\"}"); /* only one */
  expect_bad_json("\xef\xbb\xbf");
  expect_bad_json("{\"prompt\": \"hi\"}\xef\xbb\xbf");
  {
    lfs_model_ctx m = model();
    expect_err(m, 0,
               "\xef\xbb\xbf"
               "7",
               400, "invalid_type", "", "the request body must be a JSON object");
  }
  expect_ok(" \t\r\n{\"prompt\": \"hi\"} \t\r\n");
  expect_ok(
      "{\"prompt\": \"hi\", \"user\": [0, -0, 1.5e3, -2E-3, 1e+2, 123456789012345678901234567890]}");
  expect_ok("{\"prompt\": \"\\ud83d\\ude00 \\u00e9\\\"\\\\\\/\\b\\f\\n\\r\\t\xe2\x98\x83\"}");
  expect_ok("{\"prompt\": \"hi\", \"user\": {\"a\": [null, true, false, {}], \"b\": []}}");
  /* Nesting: 64 levels are accepted (the body object counts), 65 are not. */
  expect_ok("{\"prompt\": \"hi\", \"user\": " + std::string(63, '[') + std::string(63, ']') + "}");
  expect_bad_json("{\"prompt\": \"hi\", \"user\": " + std::string(64, '[') + std::string(64, ']') +
                  "}");
  /* Brackets inside strings do not count. */
  expect_ok("{\"prompt\": \"" + std::string(100, '[') + "\"}");
  /* A body need not be NUL-terminated: parse exactly [0, len). */
  std::string b = "{\"prompt\": [1, 2]}";
  std::vector<char> exact(b.begin(), b.end());
  lfs_model_ctx m = model();
  lfs_request r;
  lfs_error e;
  ASSERT_EQ(lfs_request_parse(&m, 0, exact.data(), exact.size(), &r, &e), 0) << e.message;
  EXPECT_EQ(r.n_prompt, 2);
  lfs_request_free(&r);
  ASSERT_EQ(lfs_request_parse(&m, 0, exact.data(), exact.size() - 1, &r, &e), -1);
  EXPECT_STREQ(e.code, "invalid_json");
}

/* cJSON strings are C strings: a "\u0000" would cut one short (and make "prompt\u0000x" read as
 * "prompt"), so a body with one is refused whatever member holds it. */
TEST(HttpRequest, NulCharacter) {
  lfs_model_ctx m = model();
  const std::string msg = "a string in the request body contains U+0000 (NUL), which is not "
                          "supported";
  expect_err(m, 0, "{\"prompt\": \"a\\u0000b\"}", 400, "invalid_value", "", msg);
  expect_err(m, 0, "{\"prompt\": \"hi\", \"x\\u0000\": 1}", 400, "invalid_value", "", msg);
  expect_err(m, 0, "{\"prompt\": \"hi\", \"stop\": \"\\u0000\"}", 400, "invalid_value", "", msg);
  expect_err(m, 1, "{\"messages\": [{\"role\": \"user\", \"content\": \"a\\u0000b\"}]}", 400,
             "invalid_value", "", msg);
  /* An escaped backslash before "u0000" is no escape of a NUL. */
  expect_ok("{\"prompt\": \"a\\\\u0000b\"}");
  expect_ok("{\"prompt\": \"\\u0001\\\\u0000\\\\\"}");
  expect_err(m, 0, "{\"prompt\": \"\\u00000\"}", 400, "invalid_value", "", msg);
  expect_err(m, 0, "{\"prompt\": \"\\\\\\u0000\"}", 400, "invalid_value", "", msg);
}

TEST(HttpRequest, TopLevel) {
  lfs_model_ctx m = model();
  expect_err(m, 0, "[1,2]", 400, "invalid_type", "", "the request body must be a JSON object");
  expect_err(m, 0, "\"hi\"", 400, "invalid_type", "", "the request body must be a JSON object");
  expect_err(m, 0, "null", 400, "invalid_type", "", "the request body must be a JSON object");
  expect_err(m, 0, "{}", 400, "missing_required_parameter", "prompt", "'prompt' is required");
  expect_err(m, 1, "{}", 400, "missing_required_parameter", "messages", "'messages' is required");
  expect_err(m, 1, "{\"prompt\": \"x\"}", 400, "missing_required_parameter", "messages",
             "'messages' is required");
  /* Every member is acted on or refused, except the listed harmless ones (user); null is
   * absent. */
  expect_ok("{\"prompt\": \"hi\", \"user\": \"u-1\", \"suffix\": null, \"tools\": null}");
  expect_err(m, 0, "{\"prompt\": \"hi\", \"Prompt\": 5}", 400, "unsupported_parameter", "Prompt",
             "'Prompt' is not supported by this server (/v1/completions); see docs/USAGE.md");
  expect_err(m, 0, "{\"prompt\": \"hi\", \"frequency_penalty\": \"x\"}", 400, "invalid_type",
             "frequency_penalty", "");
  for (const char *k : {"tools", "tool_choice", "functions", "function_call", "suffix",
                        "parallel_tool_calls", "min_tokens", "metadata", "store", "audio"})
    expect_err(m, 0, "{\"prompt\": \"hi\", \"" + std::string(k) + "\": 1}", 400,
               "unsupported_parameter", k, "");
  /* members of the other endpoint */
  expect_err(m, 0, "{\"prompt\": \"hi\", \"top_logprobs\": 1}", 400, "unsupported_parameter",
             "top_logprobs", "");
  expect_err(m, 1, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"echo\": true}",
             400, "unsupported_parameter", "echo", "");
}

TEST(HttpRequest, Model) {
  lfs_model_ctx m = model();
  expect_err(m, 0, "{\"prompt\": \"hi\", \"model\": \"gpt-4\"}", 404, "model_not_found", "model",
             "The model 'gpt-4' does not exist; this server serves 'm'");
  expect_err(m, 0, "{\"prompt\": \"hi\", \"model\": 5}", 400, "invalid_type", "model",
             "'model' must be a string");
  expect_err(m, 0, "{\"prompt\": \"hi\", \"model\": \"M\"}", 404, "model_not_found", "model", "");
  expect_ok("{\"prompt\": \"hi\", \"model\": \"m\"}");
  expect_ok("{\"prompt\": \"hi\", \"model\": null}");
}

TEST(HttpRequest, Unsupported) {
  lfs_model_ctx m = model();
  const char *p = "{\"prompt\": \"hi\", ";
  auto B = [&](const char *rest) { return std::string(p) + rest + "}"; };
  expect_err(m, 0, B("\"n\": 2"), 400, "invalid_value", "n",
             "'n' must be 1: one completion per request is supported");
  expect_err(m, 0, B("\"n\": 0"), 400, "invalid_value", "n", "");
  expect_err(m, 0, B("\"n\": 1.5"), 400, "invalid_type", "n", "'n' must be an integer");
  expect_err(m, 0, B("\"n\": \"1\""), 400, "invalid_type", "n", "'n' must be an integer");
  expect_err(m, 0, B("\"n\": 1e300"), 400, "invalid_type", "n", "'n' must be an integer");
  expect_ok(B("\"n\": 1"));
  expect_ok(B("\"n\": 1.0"));
  expect_ok(B("\"n\": 1e0"));
  expect_ok(B("\"n\": null"));
  expect_err(m, 0, B("\"best_of\": 2"), 400, "invalid_value", "best_of", "'best_of' must be 1");
  expect_ok(B("\"best_of\": 1"));
  expect_err(m, 0, B("\"echo\": 1"), 400, "invalid_type", "echo", "'echo' must be a boolean");
  expect_ok(B("\"echo\": true"));
  expect_ok(B("\"echo\": false"));
  expect_ok(B("\"echo\": null"));
  for (const char *lp : {"true", "\"x\"", "[]", "0.5"})
    expect_err(m, 0, B((std::string("\"logprobs\": ") + lp).c_str()), 400, "invalid_type",
               "logprobs", "");
  expect_err(m, 0, B("\"logprobs\": 6"), 400, "invalid_value", "logprobs", "");
  for (const char *lp : {"0", "0.0", "-0", "5", "false", "null"})
    expect_ok(B((std::string("\"logprobs\": ") + lp).c_str()));
  expect_err(m, 0, B("\"suffix\": \"x\""), 400, "unsupported_parameter", "suffix",
             "'suffix' is not supported by this server (/v1/completions); see docs/USAGE.md");
  expect_ok(B("\"suffix\": null"));
  expect_ok(B("\"response_format\": {\"type\": \"text\"}"));
  expect_err(m, 0, B("\"response_format\": {\"type\": \"json_object\"}"), 400, "invalid_value",
             "response_format", "");
  expect_err(m, 0, B("\"response_format\": {\"type\": \"text\", \"x\": 1}"), 400,
             "invalid_value", "response_format", "");
}

TEST(HttpRequest, SamplingParameters) {
  lfs_model_ctx m = model();
  const char *p = "{\"prompt\": \"hi\", ";
  auto B = [&](const char *rest) { return std::string(p) + rest + "}"; };
  lfs_request r;
  lfs_error e;
  std::string b = B("\"presence_penalty\": -2, \"frequency_penalty\": 1.5, "
                    "\"repetition_penalty\": 1.3, \"logit_bias\": {\"5\": -100, \"7\": 2.5}, "
                    "\"logprobs\": 3, \"echo\": true, \"seed\": 9");
  ASSERT_EQ(lfs_request_parse(&m, 0, b.data(), b.size(), &r, &e), 0) << e.message;
  EXPECT_EQ(r.sampling.presence_penalty, -2.0f);
  EXPECT_EQ(r.sampling.frequency_penalty, 1.5f);
  EXPECT_EQ(r.sampling.repetition_penalty, 1.3f);
  ASSERT_EQ(r.sampling.n_logit_bias, 2);
  EXPECT_EQ(r.sampling.logit_bias[0].token, 5);
  EXPECT_EQ(r.sampling.logit_bias[0].bias, -100.0f);
  EXPECT_EQ(r.sampling.logit_bias[1].token, 7);
  EXPECT_EQ(r.sampling.logit_bias[1].bias, 2.5f);
  EXPECT_EQ(r.sampling.logprobs, 1);
  EXPECT_EQ(r.sampling.top_logprobs, 3);
  EXPECT_EQ(r.sampling.prompt_logprobs, 1);
  EXPECT_EQ(r.sampling.seed, 9u);
  lfs_request_free(&r);
  for (const char *bad : {"\"presence_penalty\": 2.01", "\"frequency_penalty\": -3",
                          "\"repetition_penalty\": 0", "\"repetition_penalty\": -1",
                          "\"logit_bias\": {\"x\": 1}", "\"logit_bias\": {\"-1\": 1}",
                          "\"logit_bias\": {\"9999999\": 1}", "\"logit_bias\": {\"5\": 100.5}",
                          "\"logit_bias\": {\"5\": \"1\"}", "\"logit_bias\": {\"5\": 1, \"05\": 2}",
                          "\"logit_bias\": [1]", "\"logit_bias\": {\"\": 1}"})
  {
    Parsed q(m, 0, B(bad));
    EXPECT_EQ(q.rc, -1) << bad;
    EXPECT_EQ(q.e.status, 400) << bad;
    EXPECT_STREQ(q.e.param, std::string(bad).substr(1, std::string(bad).find('"', 1) - 1).c_str());
  }
  expect_ok(B("\"logit_bias\": {}"));
  // chat: logprobs is a bool, top_logprobs 0..20 and only with logprobs
  const char *c = "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], ";
  auto C = [&](const char *rest) { return std::string(c) + rest + "}"; };
  b = C("\"logprobs\": true, \"top_logprobs\": 20");
  ASSERT_EQ(lfs_request_parse(&m, 1, b.data(), b.size(), &r, &e), 0) << e.message;
  EXPECT_EQ(r.sampling.logprobs, 1);
  EXPECT_EQ(r.sampling.top_logprobs, 20);
  EXPECT_EQ(r.sampling.prompt_logprobs, 0);
  lfs_request_free(&r);
  expect_err(m, 1, C("\"logprobs\": true, \"top_logprobs\": 21"), 400, "invalid_value",
             "top_logprobs", "");
  expect_err(m, 1, C("\"top_logprobs\": 2"), 400, "invalid_value", "top_logprobs",
             "'top_logprobs' needs 'logprobs': true");
  expect_err(m, 1, C("\"logprobs\": 2"), 400, "invalid_type", "logprobs", "");
}

TEST(HttpRequest, Flags) {
  lfs_model_ctx m = model();
  const char *p = "{\"prompt\": \"hi\", ";
  auto B = [&](const char *rest) { return std::string(p) + rest + "}"; };
  expect_err(m, 0, B("\"stream\": 1"), 400, "invalid_type", "stream", "'stream' must be a boolean");
  expect_err(m, 0, B("\"stream\": \"true\""), 400, "invalid_type", "stream", "");
  expect_err(m, 0, B("\"stream_options\": 5"), 400, "invalid_type", "stream_options",
             "'stream_options' must be an object");
  expect_err(m, 0, B("\"stream_options\": []"), 400, "invalid_type", "stream_options", "");
  expect_err(m, 0, B("\"stream_options\": {\"include_usage\": 1}"), 400, "invalid_type",
             "include_usage", "'include_usage' must be a boolean");
  expect_err(m, 0, B("\"ignore_eos\": 0"), 400, "invalid_type", "ignore_eos",
             "'ignore_eos' must be a boolean");
  expect_err(m, 0, B("\"return_token_ids\": \"yes\""), 400, "invalid_type", "return_token_ids",
             "'return_token_ids' must be a boolean");
  {
    Parsed r(m, 0,
             B("\"stream\": true, \"stream_options\": {\"include_usage\": true, \"x\": 1}, "
               "\"ignore_eos\": true, \"return_token_ids\": true"));
    ASSERT_EQ(r.rc, 0) << r.e.message;
    EXPECT_EQ(r.r.stream, 1);
    EXPECT_EQ(r.r.include_usage, 1);
    EXPECT_EQ(r.r.ignore_eos, 1);
    EXPECT_EQ(r.r.return_token_ids, 1);
    EXPECT_EQ(r.r.chat, 0);
  }
  {
    Parsed r(m, 0, B("\"stream\": false, \"stream_options\": null, \"ignore_eos\": null"));
    ASSERT_EQ(r.rc, 0) << r.e.message;
    EXPECT_EQ(r.r.stream, 0);
    EXPECT_EQ(r.r.include_usage, 0);
    EXPECT_EQ(r.r.ignore_eos, 0);
    EXPECT_EQ(r.r.return_token_ids, 0);
  }
}

TEST(HttpRequest, Sampling) {
  lfs_model_ctx m = model();
  const char *p = "{\"prompt\": \"hi\", ";
  auto B = [&](const std::string &rest) { return std::string(p) + rest + "}"; };
  expect_err(m, 0, B("\"temperature\": \"hot\""), 400, "invalid_type", "temperature",
             "'temperature' must be a number");
  expect_err(m, 0, B("\"temperature\": -1"), 400, "invalid_value", "temperature",
             "'temperature' is -1; it must be in [0, 100]");
  expect_err(m, 0, B("\"temperature\": 100.5"), 400, "invalid_value", "temperature",
             "'temperature' is 100.5; it must be in [0, 100]");
  expect_err(m, 0, B("\"top_p\": 0"), 400, "invalid_value", "top_p",
             "'top_p' is 0; it must be in (0, 1]");
  expect_err(m, 0, B("\"top_p\": 1.5"), 400, "invalid_value", "top_p",
             "'top_p' is 1.5; it must be in (0, 1]");
  expect_err(m, 0, B("\"top_p\": true"), 400, "invalid_type", "top_p", "'top_p' must be a number");
  expect_err(m, 0, B("\"top_k\": -5"), 400, "invalid_value", "top_k",
             "'top_k' is -5; it must be in [-1, 2147483647]");
  expect_err(m, 0, B("\"top_k\": 2147483648"), 400, "invalid_value", "top_k",
             "'top_k' is 2147483648; it must be in [-1, 2147483647]");
  expect_err(m, 0, B("\"top_k\": 2.5"), 400, "invalid_type", "top_k", "'top_k' must be an integer");
  expect_err(m, 0, B("\"top_k\": 9223372036854775807"), 400, "invalid_value", "top_k",
             "'top_k' is 9223372036854775807; it must be in [-1, 2147483647]");
  expect_err(m, 0, B("\"seed\": 1.5"), 400, "invalid_type", "seed", "'seed' must be an integer");
  expect_err(m, 0, B("\"seed\": \"1\""), 400, "invalid_type", "seed", "'seed' must be an integer");
  expect_err(m, 0, B("\"seed\": 1e19"), 400, "invalid_type", "seed", "'seed' must be an integer");
  expect_err(m, 0, B("\"seed\": 9223372036854777856"), 400, "invalid_type", "seed",
             ""); /* 2^63 + 2^11 */
  expect_err(m, 0, B("\"seed\": -1e19"), 400, "invalid_type", "seed", "");
  {
    Parsed r(m, 0, B("\"temperature\": 0.7, \"top_p\": 0.9, \"top_k\": 40, \"seed\": 3"));
    ASSERT_EQ(r.rc, 0) << r.e.message;
    EXPECT_FLOAT_EQ(r.r.sampling.temperature, 0.7f);
    EXPECT_FLOAT_EQ(r.r.sampling.top_p, 0.9f);
    EXPECT_EQ(r.r.sampling.top_k, 40);
    EXPECT_EQ(r.r.sampling.seed, 3u);
  }
  {
    Parsed r(m, 0, B("\"temperature\": 100, \"top_p\": 1, \"top_k\": -1, \"seed\": -1"));
    ASSERT_EQ(r.rc, 0) << r.e.message;
    EXPECT_FLOAT_EQ(r.r.sampling.temperature, 100.f);
    EXPECT_FLOAT_EQ(r.r.sampling.top_p, 1.f);
    EXPECT_EQ(r.r.sampling.top_k, 0);
    EXPECT_EQ(r.r.sampling.seed, UINT64_MAX);
  }
  {
    Parsed r(m, 0, std::string("{\"prompt\": \"hi\"}"));
    ASSERT_EQ(r.rc, 0) << r.e.message;
    EXPECT_EQ(r.r.sampling.temperature, 0.f); /* defaults */
    EXPECT_EQ(r.r.sampling.top_p, 1.f);
    EXPECT_EQ(r.r.sampling.top_k, 0);
    EXPECT_EQ(r.r.sampling.seed, 0u);
  }
  /* Integers are read through doubles: exact up to 2^53, and "1e3" / "5.0" are integers. */
  struct {
    const char *lit;
    uint64_t want;
  } seeds[] = {{"1e3", 1000},
               {"5.0", 5},
               {"9007199254740992", 9007199254740992ull},
               {"-9007199254740992", (uint64_t)-9007199254740992ll},
               {"-9223372036854775808", (uint64_t)INT64_MIN},
               {"9223372036854775807", (uint64_t)INT64_MAX},
               {"9007199254740993", 9007199254740992ull}, /* the nearest double */
               {"2147483648", 2147483648ull}};
  for (const auto &s : seeds) {
    Parsed r(m, 0, B(std::string("\"seed\": ") + s.lit));
    ASSERT_EQ(r.rc, 0) << s.lit << ": " << r.e.message;
    EXPECT_EQ(r.r.sampling.seed, s.want) << s.lit;
  }
}

TEST(HttpRequest, MaxTokens) {
  lfs_model_ctx m = model();
  auto B = [&](const std::string &rest) { return "{\"prompt\": [1, 2, 3], " + rest + "}"; };
  expect_err(m, 0, B("\"max_tokens\": 0"), 400, "invalid_value", "max_tokens",
             "'max_tokens' is 0; it must be at least 1");
  expect_err(m, 0, B("\"max_tokens\": -3"), 400, "invalid_value", "max_tokens",
             "'max_tokens' is -3; it must be at least 1");
  expect_err(m, 0, B("\"max_tokens\": 1000000000"), 400, "invalid_value", "max_tokens",
             "'max_tokens' is 1000000000; the model's context is 4096 tokens");
  expect_err(m, 0, B("\"max_tokens\": 1e300"), 400, "invalid_type", "max_tokens",
             "'max_tokens' must be an integer");
  expect_err(m, 0, B("\"max_tokens\": \"5\""), 400, "invalid_type", "max_tokens", "");
  expect_err(m, 0, B("\"max_tokens\": 2.5"), 400, "invalid_type", "max_tokens", "");
  expect_err(m, 0, B("\"max_tokens\": 4095"), 400, "context_length_exceeded", "max_tokens",
             "the prompt (3 tokens) plus max_tokens (4095) exceed the model's context of 4096 "
             "tokens");
  {
    Parsed r(m, 0, B("\"max_tokens\": 4094")); /* the last token is sampled, never stored */
    ASSERT_EQ(r.rc, 0) << r.e.message;
    EXPECT_EQ(r.r.max_tokens, 4094);
  }
  /* max_completion_tokens is chat's: the completions endpoint refuses it */
  expect_err(m, 0, B("\"max_tokens\": 7.0, \"max_completion_tokens\": 1"), 400,
             "unsupported_parameter", "max_completion_tokens", "");
  {
    Parsed r(m, 0, B("\"max_tokens\": null"));
    ASSERT_EQ(r.rc, 0) << r.e.message;
    EXPECT_EQ(r.r.max_tokens, 16);
  }
  /* Defaults: 16 for completions (less when the context is nearly full), the room for chat. */
  {
    Parsed r(m, 0, "{\"prompt\": " + ids_json(4090) + "}");
    ASSERT_EQ(r.rc, 0) << r.e.message;
    EXPECT_EQ(r.r.max_tokens, 7);
  }
  const std::string msg = "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]";
  {
    Parsed r(m, 1, msg + "}");
    ASSERT_EQ(r.rc, 0) << r.e.message;
    EXPECT_EQ(r.r.max_tokens, 4096 - r.r.n_prompt + 1);
    EXPECT_EQ(r.r.chat, 1);
  }
  {
    Parsed r(m, 1, msg + ", \"max_completion_tokens\": 9}");
    ASSERT_EQ(r.rc, 0) << r.e.message;
    EXPECT_EQ(r.r.max_tokens, 9);
  }
  {
    Parsed r(m, 1, msg + ", \"max_tokens\": 5, \"max_completion_tokens\": 9}");
    ASSERT_EQ(r.rc, 0) << r.e.message;
    EXPECT_EQ(r.r.max_tokens, 5);
  }
  expect_err(m, 1, msg + ", \"max_completion_tokens\": 0}", 400, "invalid_value",
             "max_completion_tokens", "'max_completion_tokens' is 0; it must be at least 1");
  expect_err(m, 1, msg + ", \"max_completion_tokens\": 1.5}", 400, "invalid_type",
             "max_completion_tokens", "'max_completion_tokens' must be an integer");
  /* Under `full` the KV budget is the limit. */
  lfs_model_ctx f = model();
  f.policy = LF_POLICY_FULL;
  expect_err(f, 0, "{\"prompt\": " + ids_json(300) + "}", 400, "context_length_exceeded", "prompt",
             "the prompt has 300 tokens; at most 256 fit (the KV budget under the full policy)");
  expect_err(
      f, 0, "{\"prompt\": " + ids_json(250) + ", \"max_tokens\": 8}", 400,
      "context_length_exceeded", "max_tokens",
      "the prompt (250 tokens) plus max_tokens (8) exceed the KV budget (full policy) of 256 "
      "tokens");
  {
    Parsed r(f, 0, "{\"prompt\": " + ids_json(250) + ", \"max_tokens\": 7}");
    ASSERT_EQ(r.rc, 0) << r.e.message;
    EXPECT_EQ(r.r.max_tokens, 7);
  }
}

TEST(HttpRequest, Prompt) {
  lfs_model_ctx m = model();
  const std::string V = std::to_string(g_vocab);
  expect_err(m, 0, "{\"prompt\": \"\"}", 400, "invalid_value", "prompt",
             "'prompt' must not be empty");
  expect_err(m, 0, "{\"prompt\": []}", 400, "invalid_value", "prompt", "the prompt is empty");
  expect_err(m, 0, "{\"prompt\": [[]]}", 400, "invalid_value", "prompt", "the prompt is empty");
  expect_err(m, 0, "{\"prompt\": [\"\"]}", 400, "invalid_value", "prompt",
             "'prompt' must not be empty");
  expect_err(m, 0, "{\"prompt\": [\"a\", \"b\"]}", 400, "invalid_value", "prompt",
             "one prompt per request is supported");
  expect_err(m, 0, "{\"prompt\": [[1], [2]]}", 400, "invalid_value", "prompt",
             "one prompt per request is supported");
  expect_err(m, 0, "{\"prompt\": [1, 2, 99999999]}", 400, "invalid_token_id", "prompt",
             "'prompt'[2] is not a token id in [0, " + V + ")");
  expect_err(m, 0, "{\"prompt\": [1, 2, " + V + "]}", 400, "invalid_token_id", "prompt", "");
  expect_err(m, 0, "{\"prompt\": [1, -2]}", 400, "invalid_token_id", "prompt",
             "'prompt'[1] is not a token id in [0, " + V + ")");
  expect_err(m, 0, "{\"prompt\": [1, 2.5]}", 400, "invalid_token_id", "prompt",
             "'prompt'[1] is not a token id in [0, " + V + ")");
  expect_err(m, 0, "{\"prompt\": [1e300]}", 400, "invalid_token_id", "prompt", "");
  expect_err(m, 0, "{\"prompt\": [[1, 2.5]]}", 400, "invalid_token_id", "prompt", "");
  expect_err(m, 0, "{\"prompt\": [1, \"a\"]}", 400, "invalid_type", "prompt",
             "'prompt' must be a string or an array of token ids");
  expect_err(m, 0, "{\"prompt\": [1, null]}", 400, "invalid_type", "prompt", "");
  expect_err(m, 0, "{\"prompt\": [[\"a\"]]}", 400, "invalid_type", "prompt", "");
  expect_err(m, 0, "{\"prompt\": [{}]}", 400, "invalid_type", "prompt", "");
  expect_err(m, 0, "{\"prompt\": 5}", 400, "invalid_type", "prompt", "");
  expect_err(m, 0, "{\"prompt\": null}", 400, "invalid_type", "prompt", "");
  expect_err(m, 0, "{\"prompt\": {}}", 400, "invalid_type", "prompt", "");
  expect_err(m, 0, "{\"prompt\": true}", 400, "invalid_type", "prompt", "");
  expect_err(m, 0, "{\"prompt\": " + ids_json(8200) + "}", 400, "context_length_exceeded", "prompt",
             "'prompt' has 8200 token ids; the model's context is 4096");
  expect_err(m, 0, "{\"prompt\": " + ids_json(4097) + "}", 400, "context_length_exceeded", "prompt",
             "the prompt has 4097 tokens; the model's context is 4096 tokens");
  expect_err(m, 0, "{\"prompt\": " + ids_json(4096) + ", \"max_tokens\": 2}", 400,
             "context_length_exceeded", "max_tokens", "");
  {
    Parsed r(m, 0, "{\"prompt\": " + ids_json(4096) + "}");
    ASSERT_EQ(r.rc, 0) << r.e.message;
    EXPECT_EQ(r.r.n_prompt, 4096);
    EXPECT_EQ(r.r.max_tokens, 1);
  }
  {
    Parsed r(m, 0, "{\"prompt\": [0, 1.0, 2e0, " + std::to_string(g_vocab - 1) + "]}");
    ASSERT_EQ(r.rc, 0) << r.e.message;
    EXPECT_EQ(prompt_of(r), (std::vector<int32_t>{0, 1, 2, g_vocab - 1}));
  }
  {
    Parsed r(m, 0, "{\"prompt\": [[7, 8]]}");
    ASSERT_EQ(r.rc, 0) << r.e.message;
    EXPECT_EQ(prompt_of(r), (std::vector<int32_t>{7, 8}));
  }
  /* Text: tokenized with the tokenizer's special tokens; a one-string batch is that string. */
  lf_token_ids want = {};
  ASSERT_EQ(lf_tokenizer_encode(g_tok, "Hello world", 11, LF_TOK_ADD_SPECIAL, &want), LF_OK);
  std::vector<int32_t> w(want.ids, want.ids + want.n);
  lf_token_ids_free(&want);
  for (const char *body : {"{\"prompt\": \"Hello world\"}", "{\"prompt\": [\"Hello world\"]}",
                           "{\"prompt\": \"Hello\\u0020world\"}"}) {
    Parsed r(m, 0, body);
    ASSERT_EQ(r.rc, 0) << r.e.message;
    EXPECT_EQ(prompt_of(r), w) << body;
  }
  /* Without a tokenizer only ids work. */
  lfs_model_ctx nt = model();
  nt.tok = nullptr;
  nt.tmpl = nullptr;
  expect_err(nt, 0, "{\"prompt\": \"hi\"}", 400, "no_tokenizer", "prompt",
             "the model has no tokenizer.json: give 'prompt' as token ids");
  {
    Parsed r(nt, 0, "{\"prompt\": [3]}");
    ASSERT_EQ(r.rc, 0) << r.e.message;
  }
}

TEST(HttpRequest, Stops) {
  lfs_model_ctx m = model();
  const std::string V = std::to_string(g_vocab);
  auto B = [&](const std::string &rest) { return "{\"prompt\": \"hi\", " + rest + "}"; };
  const char *entries = "'stop' entries must be strings, token ids or non-empty arrays of at most "
                        "256 token ids";
  expect_err(m, 0, B("\"stop\": [5.5]"), 400, "invalid_token_id", "stop",
             "a stop id must be a token id in [0, " + V + ")");
  expect_err(m, 0, B("\"stop\": [-1]"), 400, "invalid_token_id", "stop", "");
  expect_err(m, 0, B("\"stop\": [1e300]"), 400, "invalid_token_id", "stop", "");
  expect_err(m, 0, B("\"stop\": [" + V + "]"), 400, "invalid_token_id", "stop", "");
  expect_err(m, 0, B("\"stop\": [{}]"), 400, "invalid_type", "stop", entries);
  expect_err(m, 0, B("\"stop\": [[]]"), 400, "invalid_type", "stop", entries);
  expect_err(m, 0, B("\"stop\": [null]"), 400, "invalid_type", "stop", entries);
  expect_err(m, 0, B("\"stop\": [true]"), 400, "invalid_type", "stop", entries);
  expect_err(m, 0, B("\"stop\": [[1, \"a\"]]"), 400, "invalid_type", "stop", entries);
  expect_err(m, 0, B("\"stop\": [" + ids_json(257) + "]"), 400, "invalid_type", "stop", entries);
  expect_err(m, 0, B("\"stop\": [[1, -1]]"), 400, "invalid_token_id", "stop",
             "'stop'[1] is not a token id in [0, " + V + ")");
  expect_err(m, 0, B("\"stop\": [[1, 0.5]]"), 400, "invalid_token_id", "stop", "");
  expect_err(m, 0, B("\"stop\": true"), 400, "invalid_type", "stop",
             "'stop' must be a string or an array");
  expect_err(m, 0, B("\"stop\": 5"), 400, "invalid_type", "stop", "");
  expect_err(m, 0, B("\"stop\": {}"), 400, "invalid_type", "stop", "");
  std::string many = "\"stop\": [";
  for (int i = 0; i < 17; i++)
    many += (i ? ",\"a\"" : "\"a\"");
  expect_err(m, 0, B(many + "]"), 400, "invalid_value", "stop",
             "'stop' has 17 entries; at most 16 are accepted");
  lfs_model_ctx m4 = model();
  m4.max_stop = 4;
  expect_err(m4, 0, B("\"stop\": [1, 2, 3, 4, 5]"), 400, "invalid_value", "stop",
             "'stop' has 5 entries; at most 4 are accepted");
  expect_err(m, 0, B("\"stop\": \"" + std::string(513, 'x') + "\""), 400, "invalid_value", "stop",
             "a stop string may be at most 512 bytes");
  expect_ok(B("\"stop\": \"" + std::string(512, 'x') + "\""));
  expect_ok(B("\"stop\": null"));
  expect_ok(B(many.substr(0, many.size() - 4) + "]")); /* 16 */
  {
    Parsed r(m, 0,
             B("\"stop\": [\"\\n\", [5, 6], 7, \"\", \"\\u00e9t\\u00e9\"], "
               "\"stop_token_ids\": [9, 10]"));
    ASSERT_EQ(r.rc, 0) << r.e.message;
    ASSERT_EQ(r.r.n_stop_strs, 2);
    EXPECT_EQ(std::string(r.r.stop_strs[0].s, r.r.stop_strs[0].n), "\n");
    EXPECT_EQ(std::string(r.r.stop_strs[1].s, r.r.stop_strs[1].n), "\xc3\xa9t\xc3\xa9");
    EXPECT_EQ(r.r.stop_strs[1].s[r.r.stop_strs[1].n], '\0');
    ASSERT_EQ(r.r.n_stop_seqs, 1);
    EXPECT_EQ(std::vector<int32_t>(r.r.stop_seqs[0].ids, r.r.stop_seqs[0].ids + 2),
              (std::vector<int32_t>{5, 6}));
    EXPECT_EQ(std::vector<int32_t>(r.r.stop_ids, r.r.stop_ids + r.r.n_stop_ids),
              (std::vector<int32_t>{7, 9, 10}));
  }
  {
    Parsed r(m, 0, B("\"stop\": \"\""));
    ASSERT_EQ(r.rc, 0) << r.e.message;
    EXPECT_EQ(r.r.n_stop_strs, 0);
  }
  {
    Parsed r(m, 0, B("\"stop\": \"x\""));
    ASSERT_EQ(r.rc, 0) << r.e.message;
    ASSERT_EQ(r.r.n_stop_strs, 1);
    EXPECT_EQ(std::string(r.r.stop_strs[0].s, r.r.stop_strs[0].n), "x");
  }
  {
    Parsed r(m, 0, B("\"stop\": [" + ids_json(256) + "]"));
    ASSERT_EQ(r.rc, 0) << r.e.message;
    ASSERT_EQ(r.r.n_stop_seqs, 1);
    EXPECT_EQ(r.r.stop_seqs[0].n_ids, 256);
  }
  expect_err(m, 0, B("\"stop_token_ids\": [-1]"), 400, "invalid_token_id", "stop_token_ids",
             "'stop_token_ids'[0] is not a token id in [0, " + V + ")");
  expect_err(m, 0, B("\"stop_token_ids\": [1, 1.5]"), 400, "invalid_token_id", "stop_token_ids",
             "");
  expect_err(m, 0, B("\"stop_token_ids\": \"x\""), 400, "invalid_type", "stop_token_ids",
             "'stop_token_ids' must be an array of token ids");
  expect_err(m, 0, B("\"stop_token_ids\": 5"), 400, "invalid_type", "stop_token_ids", "");
  expect_err(m, 0, B("\"stop_token_ids\": [[1]]"), 400, "invalid_type", "stop_token_ids", "");
  expect_err(m, 0, B("\"stop_token_ids\": " + ids_json(257)), 400, "invalid_value",
             "stop_token_ids", "at most 256 stop token ids are accepted");
  expect_ok(B("\"stop_token_ids\": []"));
  expect_ok(B("\"stop_token_ids\": null"));
  lfs_model_ctx nt = model();
  nt.tok = nullptr;
  expect_err(nt, 0, "{\"prompt\": [1], \"stop\": \"x\"}", 400, "no_tokenizer", "stop",
             "the model has no tokenizer.json: give 'stop' as token ids");
  expect_err(nt, 0, "{\"prompt\": [1], \"stop\": [\"x\"]}", 400, "no_tokenizer", "stop", "");
  {
    Parsed r(nt, 0, "{\"prompt\": [1], \"stop\": [\"\", 3, [4]]}");
    ASSERT_EQ(r.rc, 0) << r.e.message;
  }
}

TEST(HttpRequest, Messages) {
  lfs_model_ctx m = model();
  auto M = [](const std::string &msgs) { return "{\"messages\": " + msgs + "}"; };
  expect_err(m, 1, M("[]"), 400, "invalid_value", "messages", "'messages' must not be empty");
  expect_err(m, 1, M("\"hi\""), 400, "invalid_type", "messages",
             "'messages' must be an array of message objects");
  expect_err(m, 1, M("null"), 400, "invalid_type", "messages", "");
  expect_err(m, 1, M("{}"), 400, "invalid_type", "messages", "");
  expect_err(m, 1, M("[5]"), 400, "invalid_type", "messages", "messages[0] must be an object");
  const char *role =
      "messages[1].role must be \"system\", \"developer\", \"user\" or \"assistant\"";
  expect_err(m, 1,
             M("[{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"wizard\", "
               "\"content\": \"x\"}]"),
             400, "invalid_value", "messages", role);
  expect_err(m, 1, M("[{\"role\": \"user\", \"content\": \"a\"}, {\"content\": \"x\"}]"), 400,
             "invalid_value", "messages", role);
  expect_err(m, 1,
             M("[{\"role\": \"user\", \"content\": \"a\"}, {\"role\": 5, \"content\": \"x\"}]"),
             400, "invalid_value", "messages", role);
  expect_err(m, 1, M("[{\"role\": \"user\"}]"), 400, "invalid_type", "messages",
             "messages[0].content must be a string or an array of text parts");
  expect_err(m, 1, M("[{\"role\": \"user\", \"content\": null}]"), 400, "invalid_type", "messages",
             "");
  expect_err(m, 1, M("[{\"role\": \"user\", \"content\": 5}]"), 400, "invalid_type", "messages",
             "");
  expect_err(m, 1, M("[{\"role\": \"user\", \"content\": {}}]"), 400, "invalid_type", "messages",
             "");
  const char *part =
      "messages[0].content[1] must be {\"type\": \"text\", \"text\": ...} (only text "
      "is supported)";
  for (const char *p :
       {"{\"type\": \"image_url\"}", "{\"type\": \"text\"}", "{\"type\": \"text\", \"text\": 5}",
        "{\"text\": \"x\"}", "5", "\"x\"", "null", "{\"type\": \"Text\", \"text\": \"x\"}"})
    expect_err(m, 1,
               M(std::string("[{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": "
                             "\"a\"}, ") +
                 p + "]}]"),
               400, "invalid_value", "messages", part);
  std::string big = "[";
  for (int i = 0; i < 4097; i++)
    big += (i ? "," : "") + std::string("{}");
  expect_err(m, 1, M(big + "]"), 400, "invalid_value", "messages",
             "'messages' has 4097 entries; at most 4096 are accepted");
  lfs_model_ctx nt = model();
  nt.tmpl = nullptr;
  expect_err(nt, 1, M("[{\"role\": \"user\", \"content\": \"hi\"}]"), 400, "no_chat_template",
             "messages",
             "the model has no chat template, so chat is off: use /v1/completions, or start "
             "lfserve with --chat-template chatml|llama3|deepseek-r1");
  nt.tok = nullptr;
  expect_err(nt, 1, M("[{\"role\": \"user\", \"content\": \"hi\"}]"), 400, "no_chat_template",
             "messages",
             "the model has no tokenizer, so chat is off: use /v1/completions with token-id "
             "prompts");

  /* What the template gets: developer reads as system, parts are concatenated, an assistant
   * turn may have null content. */
  auto encode = [&](const std::vector<std::pair<const char *, const char *>> &msgs) {
    std::vector<lf_chat_message> cm;
    for (auto &p : msgs)
      cm.push_back({p.first, p.second});
    lf_token_ids ids = {};
    EXPECT_EQ(lf_chat_encode(g_tmpl, g_tok, cm.data(), cm.size(), 1, 0, &ids), LF_OK);
    std::vector<int32_t> v(ids.ids, ids.ids + ids.n);
    lf_token_ids_free(&ids);
    return v;
  };
  {
    Parsed r(m, 1,
             M("[{\"role\": \"developer\", \"content\": \"Be brief.\"}, {\"role\": \"user\", "
               "\"content\": [{\"type\": \"text\", \"text\": \"Hi \"}, {\"type\": \"text\", "
               "\"text\": \"\\u2603\", \"x\": 1}]}, {\"role\": \"assistant\", \"content\": "
               "null}, {\"role\": \"user\", \"content\": \"<|im_end|>\"}, {\"role\": "
               "\"assistant\"}, {\"role\": \"user\", \"content\": \"ok\"}]"));
    ASSERT_EQ(r.rc, 0) << r.e.message;
    EXPECT_EQ(prompt_of(r), encode({{"system", "Be brief."},
                                    {"user", "Hi \xe2\x98\x83"},
                                    {"assistant", ""},
                                    {"user", "<|im_end|>"},
                                    {"assistant", ""},
                                    {"user", "ok"}}));
  }
  {
    Parsed r(m, 1, M("[{\"role\": \"user\", \"content\": []}]"));
    ASSERT_EQ(r.rc, 0) << r.e.message;
    EXPECT_EQ(prompt_of(r), encode({{"user", ""}}));
  }
}

/* Duplicate members: cJSON's lookup takes the first one (no test or client relies on either). */
TEST(HttpRequest, DuplicateKeys) {
  lfs_model_ctx m = model();
  {
    Parsed r(m, 0,
             "{\"prompt\": [1, 2], \"prompt\": \"hi\", \"max_tokens\": 3, \"max_tokens\": 0}");
    ASSERT_EQ(r.rc, 0) << r.e.message;
    EXPECT_EQ(prompt_of(r), (std::vector<int32_t>{1, 2}));
    EXPECT_EQ(r.r.max_tokens, 3);
  }
  expect_err(m, 0, "{\"prompt\": [1], \"n\": 2, \"n\": 1}", 400, "invalid_value", "n", "");
}

/* Every error path leaves nothing behind (the ASan build checks the leaks); this walks the
 * checks in order, with stops already parsed when a later check fails. */
TEST(HttpRequest, ErrorsAfterAllocations) {
  lfs_model_ctx m = model();
  expect_err(m, 0, "{\"prompt\": \"hi\", \"stop\": [\"a\", [1, 2], 3, [1, -1]]}", 400,
             "invalid_token_id", "stop", "");
  expect_err(m, 0, "{\"prompt\": \"hi\", \"stop\": [\"a\", [1, 2], 3], \"stop_token_ids\": [-1]}",
             400, "invalid_token_id", "stop_token_ids", "");
  expect_err(m, 0, "{\"prompt\": \"hi\", \"stop\": [\"a\", [1], 3, {}]}", 400, "invalid_type",
             "stop", "");
  expect_err(m, 1,
             "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": "
             "\"a\"}]}, {\"role\": \"user\", \"content\": 5}]}",
             400, "invalid_type", "messages", "");
}

} // namespace

// Checkpoint loading: the JSON parser, safetensors, HF configs and shards, llama2.c files, and
// the fp32 weights they turn into. Every checkpoint here is written by the test itself, with
// fresh random values (seed printed; replay with LF_TEST_SEED).
#include <gtest/gtest.h>

#include <algorithm>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <stdlib.h>
#include <unistd.h>

#include "text/json.h"
#include "model.h"
#include "tensor.h"
#include "tests/test_util.h"

namespace {

// ---- helpers --------------------------------------------------------------------------------

uint64_t test_seed() {
  static const uint64_t seed = [] {
    uint64_t s = lf_test_seed();
    std::printf("test_loader: LF_TEST_SEED=%llu\n", (unsigned long long)s);
    return s;
  }();
  return seed;
}

// Each test starts from the same seed, so one failing test replays on its own.
std::mt19937_64 make_rng() {
  return std::mt19937_64(test_seed());
}

float bits_f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint32_t f_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// IEEE half -> float written independently of the library (exact in double, then in float).
float ref_f16(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  if (e == 31) return m ? NAN : (s ? -INFINITY : INFINITY);
  const double v = e == 0 ? std::ldexp(double(m), -24) : std::ldexp(double(1024 + m), e - 25);
  return float(s ? -v : v);
}

// A fresh directory, removed with everything in it.
struct TempDir {
  std::string path;
  TempDir() {
    const char *t = std::getenv("TMPDIR");
    std::string tmpl = std::string(t && *t ? t : "/tmp") + "/lf_loader_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data())) path = buf.data();
  }
  ~TempDir() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
  }
  std::string operator/(const std::string &name) const {
    return path + "/" + name;
  }
};

void write_file(const std::string &path, const void *data, size_t n) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(static_cast<const char *>(data), std::streamsize(n));
  ASSERT_TRUE(f.good()) << "cannot write " << path;
}

void write_file(const std::string &path, const std::string &s) {
  write_file(path, s.data(), s.size());
}

void write_file(const std::string &path, const std::vector<uint8_t> &b) {
  write_file(path, b.data(), b.size());
}

std::vector<uint8_t> read_bytes(const std::string &path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

// Checks the status and that the message names every one of subs.
::testing::AssertionResult Fails(lf_status got, lf_status want,
                                 std::initializer_list<std::string> subs) {
  const std::string msg = lf_last_error();
  if (got != want)
    return ::testing::AssertionFailure() << "status \"" << lf_status_str(got) << "\", expected \""
                                         << lf_status_str(want) << "\"; message: " << msg;
  for (const auto &s : subs)
    if (msg.find(s) == std::string::npos)
      return ::testing::AssertionFailure()
             << "message \"" << msg << "\" does not name \"" << s << "\"";
  return ::testing::AssertionSuccess() << msg;
}

struct Checkpoint {
  lf_checkpoint ck{};
  ~Checkpoint() {
    lf_checkpoint_close(&ck);
  }
};

struct Weights {
  lf_weights w{};
  const lf_model_config *cfg = nullptr;
  ~Weights() {
    if (cfg) lf_weights_free(cfg, &w);
  }
};

// ---- safetensors writer ---------------------------------------------------------------------

struct StTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

std::string shape_json(const std::vector<int64_t> &shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); i++)
    s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

// [u64 N][header][data]; the header is padded with spaces to pad_to bytes (1: no padding).
std::vector<uint8_t> st_raw(const std::string &header, const std::vector<uint8_t> &data) {
  // Sized once and filled with std::copy: GCC 12's -Warray-bounds misfires on vector::insert.
  std::vector<uint8_t> out(8 + header.size() + data.size());
  uint64_t n = header.size();
  for (int i = 0; i < 8; i++)
    out[i] = uint8_t(n >> (8 * i));
  std::copy(header.begin(), header.end(), out.begin() + 8);
  std::copy(data.begin(), data.end(), out.begin() + 8 + header.size());
  return out;
}

std::vector<uint8_t> st_file(const std::vector<StTensor> &ts, size_t pad_to = 8) {
  std::string h = "{\"__metadata__\":{\"format\":\"pt\"}";
  std::vector<uint8_t> data;
  for (const auto &t : ts) {
    const size_t b = data.size();
    data.insert(data.end(), t.bytes.begin(), t.bytes.end());
    h += ",\"" + t.name + "\":{\"dtype\":\"" + t.dtype + "\",\"shape\":" + shape_json(t.shape) +
         ",\"data_offsets\":[" + std::to_string(b) + "," + std::to_string(data.size()) + "]}";
  }
  h += "}";
  while (h.size() % pad_to)
    h += ' ';
  return st_raw(h, data);
}

// Random finite values of a dtype; expect gets their exact fp32 values.
void random_values(std::mt19937_64 &rng, const std::string &dtype, size_t n,
                   std::vector<uint8_t> &bytes, std::vector<float> &expect) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (size_t i = 0; i < n; i++) {
    if (dtype == "F32") {
      const float v = nd(rng);
      const uint32_t u = f_bits(v);
      for (int k = 0; k < 4; k++)
        bytes.push_back(uint8_t(u >> (8 * k)));
      expect.push_back(v);
    } else {
      uint16_t h = uint16_t(rng());
      if (dtype == "BF16") {
        if (((h >> 7) & 0xFF) == 0xFF) h &= uint16_t(~0x4000); // no inf / nan
        expect.push_back(bits_f(uint32_t(h) << 16));
      } else {
        if (((h >> 10) & 31) == 31) h &= uint16_t(~0x4000);
        expect.push_back(ref_f16(h));
      }
      bytes.push_back(uint8_t(h));
      bytes.push_back(uint8_t(h >> 8));
    }
  }
}

// ---- tiny HF models -------------------------------------------------------------------------

struct TinyModel {
  std::string type = "llama";
  int dim = 8, hidden = 12, layers = 2, heads = 2, kv = 1, head_dim = 4, vocab = 16, maxpos = 32;
  bool qkv_bias = false, qk_norm = false, tie = false, lm_head_anyway = false;
  std::string force_dtype; // "" = a random dtype per tensor
  std::vector<StTensor> tensors;
  std::map<std::string, std::vector<float>> expect;

  void add(std::mt19937_64 &rng, const std::string &name, std::vector<int64_t> shape) {
    static const char *const dts[] = {"F32", "F16", "BF16"};
    StTensor t;
    t.name = name;
    t.dtype = force_dtype.empty() ? dts[rng() % 3] : force_dtype;
    t.shape = shape;
    size_t n = 1;
    for (auto d : shape)
      n *= size_t(d);
    random_values(rng, t.dtype, n, t.bytes, expect[name]);
    tensors.push_back(std::move(t));
  }

  void build(std::mt19937_64 &rng) {
    tensors.clear();
    expect.clear();
    const int64_t q = int64_t(heads) * head_dim, k = int64_t(kv) * head_dim;
    add(rng, "model.embed_tokens.weight", {vocab, dim});
    for (int l = 0; l < layers; l++) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      add(rng, p + "input_layernorm.weight", {dim});
      add(rng, p + "self_attn.q_proj.weight", {q, dim});
      add(rng, p + "self_attn.k_proj.weight", {k, dim});
      add(rng, p + "self_attn.v_proj.weight", {k, dim});
      if (qkv_bias) {
        add(rng, p + "self_attn.q_proj.bias", {q});
        add(rng, p + "self_attn.k_proj.bias", {k});
        add(rng, p + "self_attn.v_proj.bias", {k});
      }
      if (qk_norm) {
        add(rng, p + "self_attn.q_norm.weight", {head_dim});
        add(rng, p + "self_attn.k_norm.weight", {head_dim});
      }
      add(rng, p + "self_attn.o_proj.weight", {dim, q});
      add(rng, p + "post_attention_layernorm.weight", {dim});
      add(rng, p + "mlp.gate_proj.weight", {hidden, dim});
      add(rng, p + "mlp.up_proj.weight", {hidden, dim});
      add(rng, p + "mlp.down_proj.weight", {dim, hidden});
    }
    add(rng, "model.norm.weight", {dim});
    if (!tie || lm_head_anyway) add(rng, "lm_head.weight", {vocab, dim});
  }

  StTensor *find(const std::string &name) {
    for (auto &t : tensors)
      if (t.name == name) return &t;
    return nullptr;
  }
  void erase(const std::string &name) {
    for (size_t i = 0; i < tensors.size(); i++)
      if (tensors[i].name == name) tensors.erase(tensors.begin() + long(i));
  }

  // Raw JSON values by key, so tests can break any of them.
  std::map<std::string, std::string> config() const {
    std::map<std::string, std::string> c = {
        {"model_type", "\"" + type + "\""},
        {"architectures", "[\"LlamaForCausalLM\"]"},
        {"hidden_size", std::to_string(dim)},
        {"intermediate_size", std::to_string(hidden)},
        {"num_hidden_layers", std::to_string(layers)},
        {"num_attention_heads", std::to_string(heads)},
        {"num_key_value_heads", std::to_string(kv)},
        {"head_dim", std::to_string(head_dim)},
        {"vocab_size", std::to_string(vocab)},
        {"max_position_embeddings", std::to_string(maxpos)},
        {"rms_norm_eps", "1e-05"},
        {"rope_theta", "10000.0"},
        {"rope_scaling", "null"},
        {"tie_word_embeddings", tie ? "true" : "false"},
        {"hidden_act", "\"silu\""},
        {"bos_token_id", "1"},
        {"eos_token_id", "2"},
        {"torch_dtype", "\"bfloat16\""},
    };
    if (type != "qwen2") c["attention_bias"] = qkv_bias ? "true" : "false";
    return c;
  }
};

std::string config_json(const std::map<std::string, std::string> &c) {
  std::string s = "{\n";
  bool first = true;
  for (const auto &kv : c) {
    s += (first ? "  \"" : ",\n  \"") + kv.first + "\": " + kv.second;
    first = false;
  }
  return s + "\n}\n";
}

void write_model(const TempDir &d, const TinyModel &m) {
  write_file(d / "config.json", config_json(m.config()));
  write_file(d / "model.safetensors", st_file(m.tensors));
}

void expect_values(const float *got, const std::vector<float> &want, const std::string &name) {
  ASSERT_NE(got, nullptr) << name;
  ASSERT_FALSE(want.empty()) << name;
  for (size_t i = 0; i < want.size(); i++)
    if (f_bits(got[i]) != f_bits(want[i])) {
      ADD_FAILURE() << name << "[" << i << "]: got " << got[i] << ", wrote " << want[i];
      return;
    }
}

void check_weights(TinyModel &m, const lf_weights &w) {
  auto &e = m.expect;
  expect_values(w.embed, e["model.embed_tokens.weight"], "embed");
  expect_values(w.rms_final, e["model.norm.weight"], "norm");
  if (m.tie && !m.lm_head_anyway)
    EXPECT_EQ(w.lm_head, w.embed);
  else
    expect_values(w.lm_head, e["lm_head.weight"], "lm_head");
  ASSERT_NE(w.layers, nullptr);
  for (int l = 0; l < m.layers; l++) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const lf_layer_weights &lw = w.layers[l];
    expect_values(lw.rms_att, e[p + "input_layernorm.weight"], p + "input_layernorm");
    expect_values(lw.wq, e[p + "self_attn.q_proj.weight"], p + "q_proj");
    expect_values(lw.wk, e[p + "self_attn.k_proj.weight"], p + "k_proj");
    expect_values(lw.wv, e[p + "self_attn.v_proj.weight"], p + "v_proj");
    expect_values(lw.wo, e[p + "self_attn.o_proj.weight"], p + "o_proj");
    expect_values(lw.rms_ffn, e[p + "post_attention_layernorm.weight"], p + "post_ln");
    expect_values(lw.w_gate, e[p + "mlp.gate_proj.weight"], p + "gate");
    expect_values(lw.w_up, e[p + "mlp.up_proj.weight"], p + "up");
    expect_values(lw.w_down, e[p + "mlp.down_proj.weight"], p + "down");
    if (m.qkv_bias) {
      expect_values(lw.bq, e[p + "self_attn.q_proj.bias"], p + "bq");
      expect_values(lw.bk, e[p + "self_attn.k_proj.bias"], p + "bk");
      expect_values(lw.bv, e[p + "self_attn.v_proj.bias"], p + "bv");
    } else {
      EXPECT_EQ(lw.bq, nullptr);
      EXPECT_EQ(lw.bk, nullptr);
      EXPECT_EQ(lw.bv, nullptr);
    }
    if (m.qk_norm) {
      expect_values(lw.q_norm, e[p + "self_attn.q_norm.weight"], p + "q_norm");
      expect_values(lw.k_norm, e[p + "self_attn.k_norm.weight"], p + "k_norm");
    } else {
      EXPECT_EQ(lw.q_norm, nullptr);
      EXPECT_EQ(lw.k_norm, nullptr);
    }
  }
}

// Opens d as a HF checkpoint, loads fp32 weights and compares them with what m wrote.
void load_and_check(const TempDir &d, TinyModel &m) {
  Checkpoint c;
  ASSERT_EQ(lf_checkpoint_open(d.path.c_str(), &c.ck), LF_OK) << lf_last_error();
  const lf_model_config &cfg = c.ck.cfg;
  EXPECT_STREQ(cfg.model_type, m.type.c_str());
  EXPECT_EQ(cfg.dim, m.dim);
  EXPECT_EQ(cfg.hidden_dim, m.hidden);
  EXPECT_EQ(cfg.n_layers, m.layers);
  EXPECT_EQ(cfg.n_heads, m.heads);
  EXPECT_EQ(cfg.n_kv_heads, m.kv);
  EXPECT_EQ(cfg.head_dim, m.head_dim);
  EXPECT_EQ(cfg.vocab_size, m.vocab);
  EXPECT_EQ(cfg.max_seq_len, m.maxpos);
  EXPECT_EQ(cfg.qkv_bias, int(m.qkv_bias));
  EXPECT_EQ(cfg.qk_norm, int(m.qk_norm));
  EXPECT_EQ(cfg.tie_embeddings, int(m.tie));
  EXPECT_EQ(cfg.rope_style, LF_ROPE_HALF);
  EXPECT_FLOAT_EQ(cfg.norm_eps, 1e-5f);
  Weights w;
  ASSERT_EQ(lf_weights_load_f32(&c.ck, &w.w), LF_OK) << lf_last_error();
  w.cfg = &c.ck.cfg;
  check_weights(m, w.w);
}

// Opening must succeed; loading the weights must fail as described.
::testing::AssertionResult WeightsFail(const TempDir &d, lf_status want,
                                       std::initializer_list<std::string> subs) {
  Checkpoint c;
  lf_status s = lf_checkpoint_open(d.path.c_str(), &c.ck);
  if (s != LF_OK) return ::testing::AssertionFailure() << "open failed: " << lf_last_error();
  Weights w;
  s = lf_weights_load_f32(&c.ck, &w.w);
  w.cfg = &c.ck.cfg;
  return Fails(s, want, subs);
}

::testing::AssertionResult OpenFails(const std::string &path, lf_status want,
                                     std::initializer_list<std::string> subs) {
  Checkpoint c;
  lf_status s = lf_checkpoint_open(path.c_str(), &c.ck);
  if (s != LF_OK) {
    // A failed open leaves nothing behind.
    if (c.ck.tensors.n != 0 || c.ck.tensors.n_maps != 0 || c.ck.tensors.t != nullptr)
      return ::testing::AssertionFailure() << "failed open left tensors behind";
  }
  return Fails(s, want, subs);
}

lf_status parse_config(const std::map<std::string, std::string> &c, lf_model_config *cfg) {
  const std::string j = config_json(c);
  return lf_config_parse_hf(j.data(), j.size(), "/models/x/config.json", cfg);
}

// ---- JSON -----------------------------------------------------------------------------------

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

// ---- conversions and slices -------------------------------------------------------------------

TEST(Tensor, F16ToF32AllValues) {
  for (uint32_t h = 0; h < 65536; h++) {
    const float got = lf_f16_to_f32(uint16_t(h)), want = ref_f16(uint16_t(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << std::hex << h;
    } else {
      ASSERT_EQ(f_bits(got), f_bits(want)) << std::hex << "f16 0x" << h;
    }
  }
  EXPECT_EQ(lf_f16_to_f32(0x0001), std::ldexp(1.0f, -24));    // smallest subnormal
  EXPECT_EQ(lf_f16_to_f32(0x03FF), std::ldexp(1023.0f, -24)); // largest subnormal
  EXPECT_EQ(lf_f16_to_f32(0x7BFF), 65504.0f);
  EXPECT_EQ(lf_f16_to_f32(0x7C00), INFINITY);
  EXPECT_EQ(lf_f16_to_f32(0xFC00), -INFINITY);
  EXPECT_EQ(f_bits(lf_f16_to_f32(0x8000)), 0x80000000u);
}

// Round-to-nearest-even reference, from the two bf16 neighbours in double.
uint16_t ref_bf16(float f) {
  const uint32_t u = f_bits(f);
  const uint16_t lo = uint16_t(u >> 16), hi = uint16_t(lo + 1);
  const double dl = std::fabs(double(bits_f(uint32_t(lo) << 16)) - f);
  const double dh = (hi & 0x7F80) == 0x7F80 && (hi & 0x7F) == 0
                        ? std::fabs(std::ldexp(1.0, 128) - std::fabs(double(f)))
                        : std::fabs(double(bits_f(uint32_t(hi) << 16)) - f);
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return (lo & 1) ? hi : lo;
}

TEST(Tensor, Bf16Conversion) {
  for (uint32_t h = 0; h < 65536; h++) {
    const float f = lf_bf16_to_f32(uint16_t(h));
    EXPECT_EQ(f_bits(f), h << 16);
    if (!std::isnan(f))
      ASSERT_EQ(lf_f32_to_bf16(f), h) << std::hex << h;
    else
      ASSERT_TRUE(std::isnan(lf_bf16_to_f32(lf_f32_to_bf16(f))));
  }
  EXPECT_EQ(lf_f32_to_bf16(bits_f(0x3F808000u)), 0x3F80) << "tie goes to even (down)";
  EXPECT_EQ(lf_f32_to_bf16(bits_f(0x3F818000u)), 0x3F82) << "tie goes to even (up)";
  EXPECT_EQ(lf_f32_to_bf16(bits_f(0x3F808001u)), 0x3F81) << "above the tie rounds up";
  EXPECT_EQ(lf_f32_to_bf16(bits_f(0x7F7FFFFFu)), 0x7F80) << "FLT_MAX rounds to inf";
  EXPECT_TRUE(std::isnan(lf_bf16_to_f32(lf_f32_to_bf16(bits_f(0x7F800001u)))))
      << "a NaN with only low mantissa bits stays NaN";
  auto rng = make_rng();
  for (int i = 0; i < 200000; i++) {
    uint32_t u = uint32_t(rng());
    if ((u & 0x7F800000u) == 0x7F800000u) continue;
    ASSERT_EQ(lf_f32_to_bf16(bits_f(u)), ref_bf16(bits_f(u))) << std::hex << u;
  }
}

TEST(Tensor, ReadSliceChecksBounds) {
  std::vector<float> m(3 * 5); // [3][5]
  for (size_t i = 0; i < m.size(); i++)
    m[i] = float(i);
  lf_tensor_src t{};
  std::snprintf(t.name, sizeof t.name, "m");
  t.dtype = LF_DTYPE_F32;
  t.ndim = 2;
  t.shape[0] = 3;
  t.shape[1] = 5;
  t.data = m.data();
  EXPECT_EQ(lf_tensor_numel(&t), 15);
  float out[6];
  ASSERT_EQ(lf_tensor_read_f32(&t, 1, 2, 2, 3, out), LF_OK);
  const float want[6] = {7, 8, 9, 12, 13, 14};
  for (int i = 0; i < 6; i++)
    EXPECT_EQ(out[i], want[i]);
  EXPECT_EQ(lf_tensor_read_f32(&t, 2, 2, 0, 1, out), LF_ERR_INVALID_ARG);
  EXPECT_EQ(lf_tensor_read_f32(&t, 0, 1, 3, 3, out), LF_ERR_INVALID_ARG);
  EXPECT_EQ(lf_tensor_read_f32(&t, -1, 1, 0, 1, out), LF_ERR_INVALID_ARG);
  EXPECT_EQ(lf_tensor_read_f32(&t, 0, 1, 0, -1, out), LF_ERR_INVALID_ARG);
  EXPECT_EQ(lf_tensor_read_f32(&t, INT64_MAX, 2, 0, 1, out), LF_ERR_INVALID_ARG);
  EXPECT_EQ(lf_tensor_read_f32(&t, 1, INT64_MAX, 0, 1, out), LF_ERR_INVALID_ARG);
  EXPECT_EQ(lf_tensor_read_f32(&t, 3, 0, 0, 5, out), LF_OK) << "empty slices are fine";
  // A vector is one row.
  t.ndim = 1;
  t.shape[0] = 4;
  ASSERT_EQ(lf_tensor_read_f32(&t, 0, 1, 1, 3, out), LF_OK);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[2], 3.0f);
  EXPECT_EQ(lf_tensor_read_f32(&t, 1, 1, 0, 1, out), LF_ERR_INVALID_ARG);
  t.ndim = 3;
  t.shape[2] = 1;
  EXPECT_EQ(lf_tensor_read_f32(&t, 0, 1, 0, 1, out), LF_ERR_SHAPE);
  // Half types convert; data need not be aligned.
  std::vector<uint8_t> raw(1 + 4);
  const uint16_t h[2] = {0x3C00 /* f16 1.0 */, 0xC000 /* f16 -2.0 */};
  std::memcpy(raw.data() + 1, h, 4);
  t.ndim = 1;
  t.shape[0] = 2;
  t.dtype = LF_DTYPE_F16;
  t.data = raw.data() + 1;
  ASSERT_EQ(lf_tensor_read_f32(&t, 0, 1, 0, 2, out), LF_OK);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -2.0f);
  t.dtype = LF_DTYPE_BF16;
  ASSERT_EQ(lf_tensor_read_f32(&t, 0, 1, 0, 2, out), LF_OK);
  EXPECT_EQ(out[0], bits_f(0x3C000000u));
}

TEST(Tensor, SetRejectsDuplicates) {
  lf_tensor_set s{};
  lf_tensor_src t{};
  std::snprintf(t.name, sizeof t.name, "a.weight");
  t.ndim = 1;
  t.shape[0] = 1;
  t.file = "f1";
  ASSERT_EQ(lf_tensor_set_add(&s, &t), LF_OK);
  for (int i = 0; i < 200; i++) { // growth
    std::snprintf(t.name, sizeof t.name, "t%d", i);
    ASSERT_EQ(lf_tensor_set_add(&s, &t), LF_OK);
  }
  std::snprintf(t.name, sizeof t.name, "a.weight");
  t.file = "f2";
  EXPECT_TRUE(Fails(lf_tensor_set_add(&s, &t), LF_ERR_FORMAT, {"a.weight", "duplicate", "f2"}));
  EXPECT_EQ(s.n, 201);
  ASSERT_NE(lf_tensor_set_find(&s, "t199"), nullptr);
  EXPECT_EQ(lf_tensor_set_find(&s, "t200"), nullptr);
  lf_tensor_set_free(&s);
  EXPECT_EQ(s.n, 0);
  EXPECT_EQ(lf_tensor_set_map_file(&s, "/nonexistent/x.safetensors", nullptr), LF_ERR_IO);
  lf_tensor_set_free(&s);
}

// ---- safetensors ----------------------------------------------------------------------------

TEST(Safetensors, LoadsEveryDtypeAndShape) {
  auto rng = make_rng();
  TempDir d;
  std::vector<StTensor> ts;
  std::map<std::string, std::vector<float>> expect;
  const struct {
    const char *name, *dtype;
    std::vector<int64_t> shape;
  } specs[] = {{"a", "F32", {3, 5}},  {"b.weight", "F16", {7}},  {"c", "BF16", {2, 3, 4}},
               {"scalar", "F32", {}}, {"empty", "BF16", {0, 4}}, {"d", "F16", {1, 1, 1, 3}}};
  for (const auto &sp : specs) {
    StTensor t{sp.name, sp.dtype, sp.shape, {}};
    size_t n = 1;
    for (auto v : sp.shape)
      n *= size_t(v);
    random_values(rng, sp.dtype, n, t.bytes, expect[sp.name]);
    ts.push_back(t);
  }
  for (size_t pad : {1, 8}) { // unpadded headers leave the data unaligned
    const std::string path = d / ("m" + std::to_string(pad) + ".safetensors");
    write_file(path, st_file(ts, pad));
    lf_tensor_set s{};
    ASSERT_EQ(lf_safetensors_load(&s, path.c_str()), LF_OK) << lf_last_error();
    EXPECT_EQ(s.n, int(ts.size()));
    EXPECT_EQ(s.n_maps, 1);
    for (const auto &sp : specs) {
      const lf_tensor_src *t = lf_tensor_set_find(&s, sp.name);
      ASSERT_NE(t, nullptr) << sp.name;
      EXPECT_STREQ(lf_dtype_str(t->dtype), sp.dtype);
      ASSERT_EQ(t->ndim, int(sp.shape.size()));
      for (int k = 0; k < t->ndim; k++)
        EXPECT_EQ(t->shape[k], sp.shape[size_t(k)]);
      EXPECT_EQ(std::string(t->file), path);
      if (t->ndim == 1 || t->ndim == 2) {
        const int64_t rows = t->ndim == 2 ? t->shape[0] : 1, cols = t->shape[t->ndim - 1];
        std::vector<float> got(size_t(rows * cols) + 1);
        ASSERT_EQ(lf_tensor_read_f32(t, 0, rows, 0, cols, got.data()), LF_OK);
        got.pop_back();
        if (rows * cols > 0) expect_values(got.data(), expect[sp.name], sp.name);
      }
    }
    EXPECT_EQ(lf_tensor_set_find(&s, "__metadata__"), nullptr);
    lf_tensor_set_free(&s);
  }
  EXPECT_EQ(lf_dtype_size(LF_DTYPE_F32), 4u);
  EXPECT_EQ(lf_dtype_size(LF_DTYPE_BF16), 2u);
  EXPECT_EQ(lf_dtype_size(LF_DTYPE_F16), 2u);
}

struct StCase {
  const char *what;
  std::vector<uint8_t> bytes;
  lf_status want;
  std::vector<std::string> subs;
};

TEST(Safetensors, RejectsMalformedFiles) {
  auto rng = make_rng();
  std::vector<uint8_t> data32;
  std::vector<float> ignore;
  random_values(rng, "F32", 6, data32, ignore); // 24 bytes
  const std::string good = R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}})";
  std::vector<StCase> cases;
  cases.push_back({"empty file", {}, LF_ERR_FORMAT, {"too short"}});
  cases.push_back({"shorter than the length", {1, 2, 3, 4, 5}, LF_ERR_FORMAT, {"too short"}});
  {
    auto b = st_raw(good, data32);
    b.resize(8 + good.size() / 2);
    cases.push_back({"header length past EOF", b, LF_ERR_FORMAT, {"past the end"}});
  }
  {
    auto b = st_raw(good, data32);
    for (int i = 0; i < 8; i++)
      b[size_t(i)] = 0xFF;
    cases.push_back({"absurd header length", b, LF_ERR_FORMAT, {"past the end"}});
  }
  {
    auto b = st_raw(good, data32);
    b.resize(b.size() - 3);
    cases.push_back(
        {"truncated data", b, LF_ERR_FORMAT, {"tensor w", "data_offsets", "truncated"}});
  }
  cases.push_back({"malformed JSON",
                   st_raw(R"({"w":{"dtype":"F32",)", data32),
                   LF_ERR_FORMAT,
                   {"JSON", "at byte"}});
  cases.push_back(
      {"header not an object", st_raw("[1,2]", data32), LF_ERR_FORMAT, {"not an object"}});
  cases.push_back({"entry not an object", st_raw(R"({"w":[1]})", data32), LF_ERR_FORMAT, {"w"}});
  cases.push_back({"offsets inconsistent with shape",
                   st_raw(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,24]}})", data32),
                   LF_ERR_FORMAT,
                   {"tensor w", "data_offsets", "need 16"}});
  cases.push_back({"offsets inconsistent with dtype",
                   st_raw(R"({"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,24]}})", data32),
                   LF_ERR_FORMAT,
                   {"tensor w", "need 12"}});
  cases.push_back({"offsets reversed",
                   st_raw(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", data32),
                   LF_ERR_FORMAT,
                   {"tensor w"}});
  cases.push_back({"offsets past the data",
                   st_raw(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[4,28]}})", data32),
                   LF_ERR_FORMAT,
                   {"tensor w", "outside the data section"}});
  cases.push_back(
      {"huge shape",
       st_raw(
           R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,24]}})",
           data32),
       LF_ERR_FORMAT,
       {"tensor w"}});
  cases.push_back({"unsupported dtype",
                   st_raw(R"({"w":{"dtype":"I8","shape":[24],"data_offsets":[0,24]}})", data32),
                   LF_ERR_UNSUPPORTED,
                   {"tensor w", "I8"}});
  cases.push_back(
      {"rank 5",
       st_raw(R"({"w":{"dtype":"F32","shape":[1,1,2,1,3],"data_offsets":[0,24]}})", data32),
       LF_ERR_UNSUPPORTED,
       {"tensor w", "rank 5"}});
  cases.push_back({"negative dim",
                   st_raw(R"({"w":{"dtype":"F32","shape":[-2,-3],"data_offsets":[0,24]}})", data32),
                   LF_ERR_FORMAT,
                   {"tensor w", "shape"}});
  cases.push_back({"fractional dim",
                   st_raw(R"({"w":{"dtype":"F32","shape":[2.5,3],"data_offsets":[0,24]}})", data32),
                   LF_ERR_FORMAT,
                   {"tensor w", "shape"}});
  cases.push_back({"missing dtype",
                   st_raw(R"({"w":{"shape":[6],"data_offsets":[0,24]}})", data32),
                   LF_ERR_FORMAT,
                   {"tensor w", "dtype"}});
  cases.push_back({"missing offsets",
                   st_raw(R"({"w":{"dtype":"F32","shape":[6]}})", data32),
                   LF_ERR_FORMAT,
                   {"tensor w", "data_offsets"}});
  cases.push_back({"duplicate name",
                   st_raw(R"({"w":{"dtype":"F32","shape":[6],"data_offsets":[0,24]},)"
                          R"("w":{"dtype":"F32","shape":[6],"data_offsets":[0,24]}})",
                          data32),
                   LF_ERR_FORMAT,
                   {"duplicate", "w"}});
  cases.push_back({"name too long",
                   st_raw("{\"" + std::string(300, 'n') +
                              R"(":{"dtype":"F32","shape":[6],"data_offsets":[0,24]}})",
                          data32),
                   LF_ERR_FORMAT,
                   {"longer than"}});
  TempDir d;
  for (const auto &c : cases) {
    const std::string path = d / "bad.safetensors";
    write_file(path, c.bytes);
    lf_tensor_set s{};
    // A tensor from an earlier good file must survive the failed load untouched.
    const std::string ok_path = d / "ok.safetensors";
    write_file(ok_path,
               st_raw(R"({"ok":{"dtype":"F32","shape":[6],"data_offsets":[0,24]}})", data32));
    ASSERT_EQ(lf_safetensors_load(&s, ok_path.c_str()), LF_OK) << lf_last_error();
    EXPECT_TRUE(Fails(lf_safetensors_load(&s, path.c_str()), c.want, {path})) << "case: " << c.what;
    for (const auto &sub : c.subs) {
      EXPECT_NE(std::string(lf_last_error()).find(sub), std::string::npos)
          << "case: " << c.what << ": \"" << lf_last_error() << "\" lacks \"" << sub << "\"";
    }
    EXPECT_EQ(s.n, 1) << c.what;
    EXPECT_EQ(s.n_maps, 1) << c.what;
    lf_tensor_set_free(&s);
  }
  lf_tensor_set s{};
  EXPECT_TRUE(Fails(lf_safetensors_load(&s, (d / "absent.safetensors").c_str()), LF_ERR_IO,
                    {"absent.safetensors"}));
  lf_tensor_set_free(&s);
}

// ---- HF checkpoints -------------------------------------------------------------------------

TEST(HfCheckpoint, LlamaLoadsExactValues) {
  auto rng = make_rng();
  for (bool tie : {false, true}) {
    TempDir d;
    TinyModel m;
    m.tie = tie;
    m.build(rng);
    write_model(d, m);
    SCOPED_TRACE(tie ? "tied" : "untied");
    load_and_check(d, m);
  }
}

TEST(HfCheckpoint, EveryDtypeEverywhere) {
  auto rng = make_rng();
  for (const char *dt : {"F32", "F16", "BF16"}) {
    TempDir d;
    TinyModel m;
    m.force_dtype = dt;
    m.build(rng);
    write_model(d, m);
    SCOPED_TRACE(dt);
    load_and_check(d, m);
  }
}

TEST(HfCheckpoint, Qwen2HasQkvBiases) {
  auto rng = make_rng();
  TempDir d;
  TinyModel m;
  m.type = "qwen2";
  m.qkv_bias = true;
  m.tie = true;
  m.build(rng);
  write_model(d, m);
  load_and_check(d, m);
}

TEST(HfCheckpoint, Qwen3HasQkNormAndOwnHeadDim) {
  auto rng = make_rng();
  TempDir d;
  TinyModel m;
  m.type = "qwen3";
  m.qk_norm = true;
  m.head_dim = 6; // != hidden / heads = 4
  m.heads = 4;
  m.kv = 2;
  m.build(rng);
  write_model(d, m);
  load_and_check(d, m);
}

TEST(HfCheckpoint, TiedModelStillUsesShippedLmHead) {
  auto rng = make_rng();
  TempDir d;
  TinyModel m;
  m.tie = true;
  m.lm_head_anyway = true;
  m.build(rng);
  write_model(d, m);
  load_and_check(d, m);
}

// Splits the model over n shards and writes the index.
void write_sharded(const TempDir &d, const TinyModel &m, int n_shards,
                   std::map<std::string, std::string> *override_map = nullptr) {
  write_file(d / "config.json", config_json(m.config()));
  std::vector<std::vector<StTensor>> shards(static_cast<size_t>(n_shards));
  std::string index = "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {";
  for (size_t i = 0; i < m.tensors.size(); i++) {
    const size_t k = i % size_t(n_shards);
    shards[k].push_back(m.tensors[i]);
    char shard[64];
    std::snprintf(shard, sizeof shard, "model-%05zu-of-%05d.safetensors", k + 1, n_shards);
    std::string target = shard;
    if (override_map && override_map->count(m.tensors[i].name))
      target = (*override_map)[m.tensors[i].name];
    index += (i ? ", \"" : "\"") + m.tensors[i].name + "\": \"" + target + "\"";
  }
  index += "}}";
  for (size_t k = 0; k < shards.size(); k++) {
    char shard[64];
    std::snprintf(shard, sizeof shard, "model-%05zu-of-%05d.safetensors", k + 1, n_shards);
    write_file(d / shard, st_file(shards[k]));
  }
  write_file(d / "model.safetensors.index.json", index);
}

TEST(HfCheckpoint, ShardedIndexLoads) {
  auto rng = make_rng();
  TempDir d;
  TinyModel m;
  m.type = "qwen3";
  m.qk_norm = true;
  m.build(rng);
  write_sharded(d, m, 3);
  load_and_check(d, m);
  Checkpoint c;
  ASSERT_EQ(lf_checkpoint_open(d.path.c_str(), &c.ck), LF_OK);
  EXPECT_EQ(c.ck.tensors.n_maps, 3) << "each shard is mapped once";
  EXPECT_EQ(c.ck.tensors.n, int(m.tensors.size()));
}

TEST(HfCheckpoint, ShardedIndexErrors) {
  auto rng = make_rng();
  TinyModel m;
  m.build(rng);
  const std::string victim = "model.layers.1.mlp.up_proj.weight";
  for (const char *bad : {"../model-00001-of-00002.safetensors", "sub/x.safetensors", ""}) {
    TempDir d;
    std::map<std::string, std::string> o = {{victim, bad}};
    write_sharded(d, m, 2, &o);
    EXPECT_TRUE(OpenFails(d.path, LF_ERR_FORMAT, {"model.safetensors.index.json", victim})) << bad;
  }
  { // mapped to a shard that exists but lacks it
    TempDir d;
    size_t idx = 0;
    while (m.tensors[idx].name != victim)
      idx++;
    char wrong[64];
    std::snprintf(wrong, sizeof wrong, "model-%05zu-of-00002.safetensors", (idx + 1) % 2 + 1);
    std::map<std::string, std::string> o = {{victim, wrong}};
    write_sharded(d, m, 2, &o);
    EXPECT_TRUE(OpenFails(d.path, LF_ERR_MISSING_TENSOR, {victim, wrong}));
  }
  { // mapped to a shard file that does not exist
    TempDir d;
    std::map<std::string, std::string> o = {{victim, "model-00009-of-00009.safetensors"}};
    write_sharded(d, m, 2, &o);
    EXPECT_TRUE(OpenFails(d.path, LF_ERR_IO, {"model-00009-of-00009.safetensors"}));
  }
  { // absent from the index and every shard: the message names the directory
    TempDir d;
    TinyModel m2 = m;
    m2.erase("model.layers.0.input_layernorm.weight");
    write_sharded(d, m2, 2);
    EXPECT_TRUE(WeightsFail(d, LF_ERR_MISSING_TENSOR,
                            {"model.layers.0.input_layernorm.weight", d.path, "2 shards"}));
  }
  { // not an index
    TempDir d;
    write_sharded(d, m, 2);
    write_file(d / "model.safetensors.index.json", std::string("{\"weight_map\": [1]}"));
    EXPECT_TRUE(OpenFails(d.path, LF_ERR_FORMAT, {"weight_map"}));
    write_file(d / "model.safetensors.index.json", std::string("{\"weight_map\": {"));
    EXPECT_TRUE(OpenFails(d.path, LF_ERR_FORMAT, {"model.safetensors.index.json", "at byte"}));
  }
}

TEST(HfCheckpoint, TensorErrors) {
  auto rng = make_rng();
  const std::string q = "model.layers.1.self_attn.q_proj.weight";
  { // wrong shape
    TempDir d;
    TinyModel m;
    m.build(rng);
    StTensor *t = m.find(q);
    t->shape = {8, 7};
    t->bytes.resize(8 * 7 * (t->dtype == "F32" ? 4 : 2));
    write_model(d, m);
    EXPECT_TRUE(WeightsFail(d, LF_ERR_SHAPE, {q, "[8, 8]", "[8, 7]", "model.safetensors"}));
  }
  { // wrong rank
    TempDir d;
    TinyModel m;
    m.build(rng);
    StTensor *t = m.find("model.norm.weight");
    t->shape = {1, 8};
    write_model(d, m);
    EXPECT_TRUE(WeightsFail(d, LF_ERR_SHAPE, {"model.norm.weight", "[8]", "[1, 8]"}));
  }
  { // a norm weight stored as I32
    TempDir d;
    TinyModel m;
    m.build(rng);
    StTensor *t = m.find("model.layers.0.post_attention_layernorm.weight");
    t->dtype = "I32";
    t->bytes.assign(8 * 4, 0);
    write_model(d, m);
    EXPECT_TRUE(
        OpenFails(d.path, LF_ERR_UNSUPPORTED,
                  {"model.layers.0.post_attention_layernorm.weight", "I32", "model.safetensors"}));
  }
  { // missing tensor
    TempDir d;
    TinyModel m;
    m.build(rng);
    m.erase("model.layers.1.mlp.up_proj.weight");
    write_model(d, m);
    EXPECT_TRUE(WeightsFail(d, LF_ERR_MISSING_TENSOR,
                            {"model.layers.1.mlp.up_proj.weight", "model.safetensors"}));
  }
  { // untied without lm_head
    TempDir d;
    TinyModel m;
    m.build(rng);
    m.erase("lm_head.weight");
    write_model(d, m);
    EXPECT_TRUE(WeightsFail(d, LF_ERR_MISSING_TENSOR, {"lm_head.weight"}));
  }
  { // qwen2 without biases
    TempDir d;
    TinyModel m;
    m.type = "qwen2";
    m.build(rng); // qkv_bias left false: no bias tensors written
    write_model(d, m);
    EXPECT_TRUE(WeightsFail(d, LF_ERR_MISSING_TENSOR, {"model.layers.0.self_attn.q_proj.bias"}));
  }
  { // a bias the forward pass has no place for
    TempDir d;
    TinyModel m;
    m.build(rng);
    m.add(rng, "model.layers.0.self_attn.o_proj.bias", {8});
    write_model(d, m);
    EXPECT_TRUE(WeightsFail(d, LF_ERR_UNSUPPORTED, {"model.layers.0.self_attn.o_proj.bias"}));
  }
  { // q/k/v biases that the config says do not exist
    TempDir d;
    TinyModel m;
    m.build(rng);
    m.add(rng, "model.layers.1.self_attn.k_proj.bias", {4});
    write_model(d, m);
    EXPECT_TRUE(WeightsFail(d, LF_ERR_FORMAT, {"model.layers.1.self_attn.k_proj.bias"}));
  }
  { // neither model.safetensors nor an index
    TempDir d;
    TinyModel m;
    m.build(rng);
    write_file(d / "config.json", config_json(m.config()));
    EXPECT_TRUE(OpenFails(d.path, LF_ERR_IO, {d.path, "model.safetensors"}));
  }
  { // truncated model.safetensors inside a checkpoint
    TempDir d;
    TinyModel m;
    m.build(rng);
    write_model(d, m);
    auto b = read_bytes(d / "model.safetensors");
    b.resize(b.size() - 10);
    write_file(d / "model.safetensors", b);
    EXPECT_TRUE(OpenFails(d.path, LF_ERR_FORMAT, {"model.safetensors", "lm_head.weight"}));
  }
}

TEST(HfCheckpoint, ConfigErrors) {
  auto rng = make_rng();
  TinyModel m;
  m.build(rng);
  struct Case {
    const char *what;
    std::string key, value; // value "" erases the key
    lf_status want;
    std::vector<std::string> subs;
  } cases[] = {
      {"unknown model_type", "model_type", "\"gpt2\"", LF_ERR_UNSUPPORTED, {"gpt2"}},
      {"model_type not a string", "model_type", "3", LF_ERR_FORMAT, {"model_type"}},
      {"missing model_type", "model_type", "", LF_ERR_FORMAT, {"model_type"}},
      {"missing hidden_size", "hidden_size", "", LF_ERR_FORMAT, {"hidden_size", "missing"}},
      {"missing vocab_size", "vocab_size", "", LF_ERR_FORMAT, {"vocab_size"}},
      {"string size", "hidden_size", "\"8\"", LF_ERR_FORMAT, {"hidden_size", "integer"}},
      {"fractional size", "intermediate_size", "12.5", LF_ERR_FORMAT, {"intermediate_size"}},
      {"zero layers", "num_hidden_layers", "0", LF_ERR_FORMAT, {"num_hidden_layers"}},
      {"negative heads", "num_attention_heads", "-2", LF_ERR_FORMAT, {"num_attention_heads"}},
      {"huge size", "hidden_size", "4294967296", LF_ERR_FORMAT, {"hidden_size"}},
      {"kv heads do not divide", "num_key_value_heads", "3", LF_ERR_FORMAT, {"key/value heads"}},
      {"odd head_dim", "head_dim", "5", LF_ERR_FORMAT, {"head_dim"}},
      {"eps as string", "rms_norm_eps", "\"1e-5\"", LF_ERR_FORMAT, {"rms_norm_eps"}},
      {"zero eps", "rms_norm_eps", "0", LF_ERR_FORMAT, {"epsilon"}},
      {"tie as string", "tie_word_embeddings", "\"yes\"", LF_ERR_FORMAT, {"tie_word_embeddings"}},
      {"eos as string", "eos_token_id", "\"2\"", LF_ERR_FORMAT, {"eos_token_id"}},
      {"eos out of vocab", "eos_token_id", "[2, 16]", LF_ERR_FORMAT, {"eos_token_id"}},
      {"too many eos", "eos_token_id", "[1,2,3,4,5,6,7,8,9]", LF_ERR_FORMAT, {"eos_token_id"}},
      {"gelu", "hidden_act", "\"gelu\"", LF_ERR_UNSUPPORTED, {"gelu"}},
      {"mlp bias", "mlp_bias", "true", LF_ERR_UNSUPPORTED, {"mlp_bias"}},
      {"yarn (v4)",
       "rope_scaling",
       R"({"rope_type": "yarn", "factor": 4.0})",
       LF_ERR_UNSUPPORTED,
       {"yarn"}},
      {"linear (v4 'type')",
       "rope_scaling",
       R"({"type": "linear", "factor": 2.0})",
       LF_ERR_UNSUPPORTED,
       {"linear"}},
      {"dynamic (v5)",
       "rope_parameters",
       R"({"rope_type": "dynamic", "rope_theta": 1e4})",
       LF_ERR_UNSUPPORTED,
       {"dynamic"}},
      {"llama3 without factor",
       "rope_scaling",
       R"({"rope_type": "llama3", "low_freq_factor": 1, "high_freq_factor": 4,
           "original_max_position_embeddings": 8192})",
       LF_ERR_FORMAT,
       {"rope_scaling.factor"}},
      {"rope_scaling not an object", "rope_scaling", "\"llama3\"", LF_ERR_FORMAT, {"rope_scaling"}},
      {"sliding layers",
       "layer_types",
       R"(["full_attention", "sliding_attention"])",
       LF_ERR_UNSUPPORTED,
       {"layer_types[1]"}},
  };
  for (const auto &c : cases) {
    TempDir d;
    auto cfg = m.config();
    if (c.value.empty())
      cfg.erase(c.key);
    else
      cfg[c.key] = c.value;
    write_file(d / "config.json", config_json(cfg));
    write_file(d / "model.safetensors", st_file(m.tensors));
    Checkpoint ck;
    lf_status st = lf_checkpoint_open(d.path.c_str(), &ck.ck);
    EXPECT_TRUE(Fails(st, c.want, {d / "config.json"})) << c.what;
    for (const auto &sub : c.subs)
      EXPECT_NE(std::string(lf_last_error()).find(sub), std::string::npos)
          << c.what << ": \"" << lf_last_error() << "\" lacks \"" << sub << "\"";
  }
  { // malformed JSON
    TempDir d;
    write_file(d / "config.json",
               std::string("{\"model_type\": \"llama\",\n \"hidden_size\": 8,,}"));
    write_file(d / "model.safetensors", st_file(m.tensors));
    EXPECT_TRUE(OpenFails(d.path, LF_ERR_FORMAT, {d / "config.json", "line 2"}));
    write_file(d / "config.json", std::string("[]"));
    EXPECT_TRUE(OpenFails(d.path, LF_ERR_FORMAT, {d / "config.json", "object"}));
  }
  { // no config.json at all
    TempDir d;
    write_file(d / "model.safetensors", st_file(m.tensors));
    EXPECT_TRUE(OpenFails(d.path, LF_ERR_IO, {d / "config.json"}));
  }
}

TEST(HfConfig, DefaultsAndVariants) {
  TinyModel m;
  lf_model_config c;
  auto base = m.config();

  auto cfg = base;
  cfg.erase("num_key_value_heads");
  cfg.erase("head_dim");
  cfg.erase("rope_theta");
  cfg.erase("rope_scaling");
  cfg.erase("tie_word_embeddings");
  cfg.erase("rms_norm_eps");
  cfg.erase("bos_token_id");
  cfg.erase("eos_token_id");
  cfg.erase("attention_bias");
  ASSERT_EQ(parse_config(cfg, &c), LF_OK) << lf_last_error();
  EXPECT_EQ(c.n_kv_heads, 2) << "defaults to the attention heads";
  EXPECT_EQ(c.head_dim, 4) << "defaults to hidden / heads";
  EXPECT_EQ(c.rope_theta, 10000.0f);
  EXPECT_EQ(c.rope_scaling, LF_ROPE_SCALING_NONE);
  EXPECT_EQ(c.tie_embeddings, 0);
  EXPECT_EQ(c.norm_eps, 1e-6f);
  EXPECT_EQ(c.bos_id, -1);
  EXPECT_EQ(c.n_eos, 0);
  EXPECT_EQ(c.qkv_bias, 0);
  EXPECT_EQ(c.rope_style, LF_ROPE_HALF);

  cfg = base; // null means default too
  cfg["num_key_value_heads"] = "null";
  cfg["head_dim"] = "null";
  cfg["eos_token_id"] = "null";
  cfg["bos_token_id"] = "null";
  ASSERT_EQ(parse_config(cfg, &c), LF_OK) << lf_last_error();
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 4);
  EXPECT_EQ(c.n_eos, 0);
  EXPECT_EQ(c.bos_id, -1);

  cfg = base;
  cfg["eos_token_id"] = "[128001, 128008, 128009]";
  cfg["tie_word_embeddings"] = "true";
  cfg["attention_bias"] = "true";
  ASSERT_EQ(parse_config(cfg, &c), LF_OK) << lf_last_error();
  ASSERT_EQ(c.n_eos, 3);
  EXPECT_EQ(c.eos_ids[0], 128001);
  EXPECT_EQ(c.eos_ids[2], 128009);
  EXPECT_EQ(c.tie_embeddings, 1);
  EXPECT_EQ(c.qkv_bias, 1) << "llama: attention_bias";
  EXPECT_EQ(c.bos_id, 1);

  // transformers 4 llama3 scaling
  cfg = base;
  cfg["rope_theta"] = "500000.0";
  cfg["rope_scaling"] = R"({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192, "rope_type": "llama3"})";
  ASSERT_EQ(parse_config(cfg, &c), LF_OK) << lf_last_error();
  EXPECT_EQ(c.rope_theta, 500000.0f);
  EXPECT_EQ(c.rope_scaling, LF_ROPE_SCALING_LLAMA3);
  EXPECT_EQ(c.rope_factor, 8.0f);
  EXPECT_EQ(c.rope_low_freq_factor, 1.0f);
  EXPECT_EQ(c.rope_high_freq_factor, 4.0f);
  EXPECT_EQ(c.rope_original_max_pos, 8192);
  cfg["rope_scaling"] = R"({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192, "type": "llama3"})";
  ASSERT_EQ(parse_config(cfg, &c), LF_OK) << lf_last_error();
  EXPECT_EQ(c.rope_scaling, LF_ROPE_SCALING_LLAMA3) << "older \"type\" key";

  // transformers 5: everything inside rope_parameters
  cfg = base;
  cfg.erase("rope_theta");
  cfg.erase("rope_scaling");
  cfg["rope_parameters"] = R"({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})";
  ASSERT_EQ(parse_config(cfg, &c), LF_OK) << lf_last_error();
  EXPECT_EQ(c.rope_theta, 500000.0f);
  EXPECT_EQ(c.rope_scaling, LF_ROPE_SCALING_LLAMA3);
  EXPECT_EQ(c.rope_factor, 32.0f);
  cfg["rope_parameters"] = R"({"rope_type": "default", "rope_theta": 1000000.0})";
  ASSERT_EQ(parse_config(cfg, &c), LF_OK) << lf_last_error();
  EXPECT_EQ(c.rope_theta, 1000000.0f);
  EXPECT_EQ(c.rope_scaling, LF_ROPE_SCALING_NONE);
  cfg["rope_parameters"] = R"({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
      "low_freq_factor": 4.0, "high_freq_factor": 1.0, "original_max_position_embeddings": 8192})";
  EXPECT_TRUE(Fails(parse_config(cfg, &c), LF_OK, {})) << "parse alone does not validate";
  {
    TempDir d;
    write_file(d / "config.json", config_json(cfg));
    EXPECT_TRUE(OpenFails(d.path, LF_ERR_FORMAT, {"llama3", d / "config.json"}));
  }

  // qwen2 always has q/k/v biases; qwen3 has q/k norms and head_dim defaulting to 128
  cfg = base;
  cfg["model_type"] = "\"qwen2\"";
  cfg.erase("attention_bias");
  ASSERT_EQ(parse_config(cfg, &c), LF_OK) << lf_last_error();
  EXPECT_EQ(c.qkv_bias, 1);
  EXPECT_EQ(c.qk_norm, 0);
  cfg["use_sliding_window"] = "true";
  EXPECT_TRUE(Fails(parse_config(cfg, &c), LF_ERR_UNSUPPORTED, {"use_sliding_window"}));
  cfg = base;
  cfg["model_type"] = "\"qwen3\"";
  cfg.erase("head_dim");
  ASSERT_EQ(parse_config(cfg, &c), LF_OK) << lf_last_error();
  EXPECT_EQ(c.qk_norm, 1);
  EXPECT_EQ(c.qkv_bias, 0);
  EXPECT_EQ(c.head_dim, 128) << "Qwen3Config's default";
  EXPECT_STREQ(c.model_type, "qwen3");
}

// The checked-in tiny models from transformers (tests/data/hf_tiny) open and load.
TEST(HfCheckpoint, RepoTinyModels) {
  for (const char *name : {"llama", "qwen2", "qwen3"}) {
    const std::string dir = lf_repo_data_dir() + "/hf_tiny/" + name;
    if (!lf_path_exists(dir + "/config.json")) GTEST_SKIP() << dir << " not found";
    Checkpoint c;
    ASSERT_EQ(lf_checkpoint_open(dir.c_str(), &c.ck), LF_OK) << lf_last_error();
    Weights w;
    ASSERT_EQ(lf_weights_load_f32(&c.ck, &w.w), LF_OK) << lf_last_error();
    w.cfg = &c.ck.cfg;
    EXPECT_STREQ(c.ck.cfg.model_type, name);
  }
}

// ---- llama2.c -------------------------------------------------------------------------------

struct L2c {
  int dim = 8, hidden = 12, layers = 2, heads = 2, kv = 1, vocab = 16, seq = 10;
  bool shared = true;
  std::vector<float> body; // every float after the header, in file order

  std::vector<uint8_t> bytes(std::mt19937_64 &rng) {
    const int64_t hd = dim / heads, kvd = hd * kv, L = layers, D = dim, H = hidden;
    const int64_t n = vocab * D + L * D + L * D * D + 2 * L * kvd * D + L * D * D + L * D +
                      3 * L * H * D + D + seq * hd + (shared ? 0 : vocab * D);
    std::normal_distribution<float> nd;
    body.resize(size_t(n));
    for (auto &v : body)
      v = nd(rng);
    const int32_t h[7] = {dim, hidden, layers, heads, kv, shared ? vocab : -vocab, seq};
    std::vector<uint8_t> out(28 + body.size() * 4);
    std::memcpy(out.data(), h, 28);
    std::memcpy(out.data() + 28, body.data(), body.size() * 4);
    return out;
  }
};

TEST(Llama2c, SharedAndUnsharedLoadExactValues) {
  auto rng = make_rng();
  for (bool shared : {true, false}) {
    SCOPED_TRACE(shared ? "shared" : "unshared");
    TempDir d;
    L2c f;
    f.shared = shared;
    const std::string path = d / "model.bin";
    write_file(path, f.bytes(rng));
    Checkpoint c;
    ASSERT_EQ(lf_checkpoint_open(path.c_str(), &c.ck), LF_OK) << lf_last_error();
    const lf_model_config &cfg = c.ck.cfg;
    EXPECT_STREQ(cfg.model_type, "llama2c");
    EXPECT_EQ(cfg.dim, 8);
    EXPECT_EQ(cfg.hidden_dim, 12);
    EXPECT_EQ(cfg.n_layers, 2);
    EXPECT_EQ(cfg.n_heads, 2);
    EXPECT_EQ(cfg.n_kv_heads, 1);
    EXPECT_EQ(cfg.head_dim, 4);
    EXPECT_EQ(cfg.vocab_size, 16);
    EXPECT_EQ(cfg.max_seq_len, 10);
    EXPECT_EQ(cfg.rope_style, LF_ROPE_INTERLEAVED);
    EXPECT_EQ(cfg.tie_embeddings, int(shared));
    EXPECT_EQ(cfg.bos_id, 1);
    ASSERT_EQ(cfg.n_eos, 1);
    EXPECT_EQ(cfg.eos_ids[0], 1);
    EXPECT_EQ(lf_tensor_set_find(&c.ck.tensors, "lm_head.weight") != nullptr, !shared);
    Weights w;
    ASSERT_EQ(lf_weights_load_f32(&c.ck, &w.w), LF_OK) << lf_last_error();
    w.cfg = &cfg;

    // Walk the file in llama2.c's order.
    const float *p = f.body.data();
    const size_t D = 8, H = 12, KV = 4, L = 2, V = 16;
    auto take = [&](size_t n) {
      std::vector<float> v(p, p + n);
      p += n;
      return v;
    };
    auto emb = take(V * D);
    expect_values(w.w.embed, emb, "embed");
    std::vector<std::vector<float>> rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3;
    for (size_t l = 0; l < L; l++)
      rms_att.push_back(take(D));
    for (size_t l = 0; l < L; l++)
      wq.push_back(take(D * D));
    for (size_t l = 0; l < L; l++)
      wk.push_back(take(KV * D));
    for (size_t l = 0; l < L; l++)
      wv.push_back(take(KV * D));
    for (size_t l = 0; l < L; l++)
      wo.push_back(take(D * D));
    for (size_t l = 0; l < L; l++)
      rms_ffn.push_back(take(D));
    for (size_t l = 0; l < L; l++)
      w1.push_back(take(H * D));
    for (size_t l = 0; l < L; l++)
      w2.push_back(take(D * H));
    for (size_t l = 0; l < L; l++)
      w3.push_back(take(H * D));
    auto rms_final = take(D);
    take(10 * 4); // RoPE tables
    for (size_t l = 0; l < L; l++) {
      const lf_layer_weights &lw = w.w.layers[l];
      expect_values(lw.rms_att, rms_att[l], "rms_att");
      expect_values(lw.wq, wq[l], "wq");
      expect_values(lw.wk, wk[l], "wk");
      expect_values(lw.wv, wv[l], "wv");
      expect_values(lw.wo, wo[l], "wo");
      expect_values(lw.rms_ffn, rms_ffn[l], "rms_ffn");
      expect_values(lw.w_gate, w1[l], "w1");
      expect_values(lw.w_down, w2[l], "w2");
      expect_values(lw.w_up, w3[l], "w3");
    }
    expect_values(w.w.rms_final, rms_final, "rms_final");
    if (shared) {
      EXPECT_EQ(w.w.lm_head, w.w.embed);
    } else {
      expect_values(w.w.lm_head, take(V * D), "wcls");
    }
    EXPECT_EQ(p, f.body.data() + f.body.size());
  }
}

TEST(Llama2c, RejectsBadFiles) {
  auto rng = make_rng();
  TempDir d;
  const std::string path = d / "model.bin";
  for (bool shared : {true, false}) {
    L2c f;
    f.shared = shared;
    auto b = f.bytes(rng);
    auto cut = b;
    cut.resize(b.size() - 4);
    write_file(path, cut);
    EXPECT_TRUE(OpenFails(path, LF_ERR_FORMAT, {path, "truncated"}));
    auto longer = b;
    longer.push_back(0);
    write_file(path, longer);
    EXPECT_TRUE(OpenFails(path, LF_ERR_FORMAT, {path, "trailing bytes"}));
  }
  L2c f;
  auto good = f.bytes(rng);
  auto with_header = [&](int i, int32_t v) {
    auto b = good;
    std::memcpy(b.data() + 4 * i, &v, 4);
    return b;
  };
  write_file(path, std::vector<uint8_t>(good.begin(), good.begin() + 20));
  EXPECT_TRUE(OpenFails(path, LF_ERR_FORMAT, {path, "truncated"}));
  write_file(path, std::vector<uint8_t>());
  EXPECT_TRUE(OpenFails(path, LF_ERR_FORMAT, {path}));
  write_file(path, with_header(0, 0));
  EXPECT_TRUE(OpenFails(path, LF_ERR_FORMAT, {path, "header"}));
  write_file(path, with_header(5, 0));
  EXPECT_TRUE(OpenFails(path, LF_ERR_FORMAT, {path}));
  write_file(path, with_header(4, 3)); // kv heads do not divide heads
  EXPECT_TRUE(OpenFails(path, LF_ERR_FORMAT, {path}));
  write_file(path, with_header(3, 3)); // dim 8 not a multiple of 3 heads
  EXPECT_TRUE(OpenFails(path, LF_ERR_FORMAT, {path}));
  write_file(path, with_header(0, 1 << 30)); // impossibly large: no overflow, just an error
  EXPECT_TRUE(OpenFails(path, LF_ERR_FORMAT, {path}));
  write_file(path, with_header(5, INT32_MIN));
  EXPECT_TRUE(OpenFails(path, LF_ERR_FORMAT, {path}));
  // Text is not a checkpoint.
  write_file(path, std::string("{\"model_type\": \"llama\"}\n"));
  EXPECT_TRUE(OpenFails(path, LF_ERR_FORMAT, {path}));
}

TEST(Checkpoint, OpenDispatchesOnPathKind) {
  TempDir d;
  EXPECT_TRUE(OpenFails(d / "nope", LF_ERR_IO, {d / "nope"}));
  EXPECT_TRUE(OpenFails(d.path, LF_ERR_IO, {d / "config.json"})) << "an empty directory is HF";
  EXPECT_TRUE(OpenFails("/dev/null", LF_ERR_IO, {"/dev/null"}));
  lf_checkpoint ck;
  EXPECT_EQ(lf_checkpoint_open(nullptr, &ck), LF_ERR_INVALID_ARG);
  lf_checkpoint_close(nullptr);
}

TEST(Checkpoint, ValidateNamesTheFile) {
  lf_model_config c{};
  std::snprintf(c.model_type, sizeof c.model_type, "llama");
  c.dim = 8;
  c.hidden_dim = 12;
  c.n_layers = 1;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.head_dim = 4;
  c.vocab_size = 16;
  c.max_seq_len = 8;
  c.rope_theta = 10000;
  c.norm_eps = 1e-5f;
  c.bos_id = -1;
  ASSERT_EQ(lf_config_validate(&c, "cfg.json"), LF_OK) << lf_last_error();
  auto bad = c;
  bad.n_layers = 0;
  EXPECT_TRUE(Fails(lf_config_validate(&bad, "cfg.json"), LF_ERR_FORMAT, {"cfg.json", "layers"}));
  bad = c;
  bad.head_dim = 3;
  EXPECT_TRUE(Fails(lf_config_validate(&bad, "cfg.json"), LF_ERR_FORMAT, {"head_dim"}));
  bad = c;
  bad.bos_id = 16;
  EXPECT_TRUE(Fails(lf_config_validate(&bad, "cfg.json"), LF_ERR_FORMAT, {"bos_token_id"}));
  bad = c;
  bad.rope_theta = NAN;
  EXPECT_TRUE(Fails(lf_config_validate(&bad, "cfg.json"), LF_ERR_FORMAT, {"rope_theta"}));
  bad = c;
  bad.model_type[0] = '\0';
  EXPECT_TRUE(Fails(lf_config_validate(&bad, "cfg.json"), LF_ERR_FORMAT, {"model_type"}));
}

// "random:NAME/T" is one rank's shard of NAME as a whole model: against the unsharded preset,
// exactly the head counts, MLP width and vocabulary divide by T.
TEST(Checkpoint, RandomShardSpec) {
  for (const char *name : {"llama3-8b", "qwen3-8b", "llama3-70b", "tiny-llama", "tiny-qwen3"}) {
    lf_checkpoint whole, part;
    ASSERT_EQ(lf_checkpoint_open((std::string("random:") + name + ":5").c_str(), &whole), LF_OK)
        << lf_last_error();
    for (int t : {1, 2}) {
      const std::string spec = std::string("random:") + name + "/" + std::to_string(t) + ":5";
      ASSERT_EQ(lf_checkpoint_open(spec.c_str(), &part), LF_OK) << spec << ": " << lf_last_error();
      const lf_model_config &w = whole.cfg, &p = part.cfg;
      EXPECT_EQ(p.n_heads * t, w.n_heads) << spec;
      EXPECT_EQ(p.n_kv_heads * t, w.n_kv_heads) << spec;
      EXPECT_EQ(p.hidden_dim * t, w.hidden_dim) << spec;
      EXPECT_EQ(p.vocab_size * t, w.vocab_size) << spec;
      EXPECT_EQ(p.dim, w.dim) << spec;
      EXPECT_EQ(p.head_dim, w.head_dim) << spec;
      EXPECT_EQ(p.n_layers, w.n_layers) << spec;
      EXPECT_EQ(part.random_seed, 5u) << spec;
      lf_checkpoint_close(&part);
    }
    lf_checkpoint_close(&whole);
  }
  lf_checkpoint ck;
  EXPECT_TRUE(Fails(lf_checkpoint_open("random:llama3-8b/3", &ck), LF_ERR_INVALID_ARG,
                    {"llama3-8b/3", "divide by 3"}));
  for (const char *bad : {"random:llama3-8b/", "random:llama3-8b/x", "random:llama3-8b/0",
                          "random:llama3-8b/2x:1"})
    EXPECT_TRUE(Fails(lf_checkpoint_open(bad, &ck), LF_ERR_INVALID_ARG, {"shard degree"})) << bad;
}

// ---- the real stories260K -------------------------------------------------------------------

TEST(Llama2c, Stories260K) {
  const std::string bin = lf_test_data_dir() + "/models/stories260K/stories260K.bin";
  if (!lf_path_exists(bin))
    GTEST_SKIP() << "stories260K not found at " << bin
                 << " (set LF_TEST_DATA to the folder holding models/stories260K)";
  Checkpoint c;
  ASSERT_EQ(lf_checkpoint_open(bin.c_str(), &c.ck), LF_OK) << lf_last_error();
  const lf_model_config &cfg = c.ck.cfg;
  EXPECT_EQ(cfg.dim, 64);
  EXPECT_EQ(cfg.hidden_dim, 172);
  EXPECT_EQ(cfg.n_layers, 5);
  EXPECT_EQ(cfg.n_heads, 8);
  EXPECT_EQ(cfg.n_kv_heads, 4);
  EXPECT_EQ(cfg.head_dim, 8);
  EXPECT_EQ(cfg.vocab_size, 512);
  EXPECT_EQ(cfg.max_seq_len, 512);
  EXPECT_EQ(cfg.tie_embeddings, 1);
  EXPECT_EQ(cfg.rope_theta, 10000.0f);
  EXPECT_EQ(cfg.norm_eps, 1e-5f);
  EXPECT_EQ(cfg.rope_style, LF_ROPE_INTERLEAVED);

  const auto raw = read_bytes(bin);
  auto raw_f32 = [&](size_t byte_off, size_t n) {
    std::vector<float> v(n);
    EXPECT_LE(byte_off + 4 * n, raw.size());
    if (byte_off + 4 * n <= raw.size()) std::memcpy(v.data(), raw.data() + byte_off, 4 * n);
    return v;
  };
  Weights w;
  ASSERT_EQ(lf_weights_load_f32(&c.ck, &w.w), LF_OK) << lf_last_error();
  w.cfg = &cfg;
  expect_values(w.w.embed, raw_f32(28, 64), "first embedding row");
  EXPECT_EQ(w.w.lm_head, w.w.embed);
  // rms_final sits just before the two RoPE tables (2 x 512 x 4 floats) at the end.
  expect_values(w.w.rms_final, raw_f32(raw.size() - 4 * (512 * 8 + 64), 64), "rms_final");
}

} // namespace

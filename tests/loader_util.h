// Shared helpers of the checkpoint-loading suites (test_json, test_tensor_convert,
// test_safetensors, test_hf_checkpoint, test_llama2c): seeds, temporary directories, a
// safetensors writer and tiny HF models written with fresh random values (seed printed; replay
// with LF_TEST_SEED).
#ifndef LF_TESTS_LOADER_UTIL_H
#define LF_TESTS_LOADER_UTIL_H

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

#include "model.h"
#include "tensor.h"
#include "tests/test_util.h"
#include "text/json.h"

namespace loader_test {

// ---- helpers --------------------------------------------------------------------------------

inline uint64_t test_seed() {
  static const uint64_t seed = [] {
    uint64_t s = lf_test_seed();
    std::printf("test_loader: LF_TEST_SEED=%llu\n", (unsigned long long)s);
    return s;
  }();
  return seed;
}

// Each test starts from the same seed, so one failing test replays on its own.
inline std::mt19937_64 make_rng() {
  return std::mt19937_64(test_seed());
}

inline float bits_f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t f_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// IEEE half -> float written independently of the library (exact in double, then in float).
inline float ref_f16(uint16_t h) {
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

inline void write_file(const std::string &path, const void *data, size_t n) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(static_cast<const char *>(data), std::streamsize(n));
  ASSERT_TRUE(f.good()) << "cannot write " << path;
}

inline void write_file(const std::string &path, const std::string &s) {
  write_file(path, s.data(), s.size());
}

inline void write_file(const std::string &path, const std::vector<uint8_t> &b) {
  write_file(path, b.data(), b.size());
}

inline std::vector<uint8_t> read_bytes(const std::string &path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

// Checks the status and that the message names every one of subs.
inline ::testing::AssertionResult Fails(lf_status got, lf_status want,
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

inline std::string shape_json(const std::vector<int64_t> &shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); i++)
    s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

// [u64 N][header][data]; the header is padded with spaces to pad_to bytes (1: no padding).
inline std::vector<uint8_t> st_raw(const std::string &header, const std::vector<uint8_t> &data) {
  // Sized once and filled with std::copy: GCC 12's -Warray-bounds misfires on vector::insert.
  std::vector<uint8_t> out(8 + header.size() + data.size());
  uint64_t n = header.size();
  for (int i = 0; i < 8; i++)
    out[i] = uint8_t(n >> (8 * i));
  std::copy(header.begin(), header.end(), out.begin() + 8);
  std::copy(data.begin(), data.end(), out.begin() + 8 + header.size());
  return out;
}

inline std::vector<uint8_t> st_file(const std::vector<StTensor> &ts, size_t pad_to = 8) {
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
inline void random_values(std::mt19937_64 &rng, const std::string &dtype, size_t n,
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

inline std::string config_json(const std::map<std::string, std::string> &c) {
  std::string s = "{\n";
  bool first = true;
  for (const auto &kv : c) {
    s += (first ? "  \"" : ",\n  \"") + kv.first + "\": " + kv.second;
    first = false;
  }
  return s + "\n}\n";
}

inline void write_model(const TempDir &d, const TinyModel &m) {
  write_file(d / "config.json", config_json(m.config()));
  write_file(d / "model.safetensors", st_file(m.tensors));
}

inline void expect_values(const float *got, const std::vector<float> &want,
                          const std::string &name) {
  ASSERT_NE(got, nullptr) << name;
  ASSERT_FALSE(want.empty()) << name;
  for (size_t i = 0; i < want.size(); i++)
    if (f_bits(got[i]) != f_bits(want[i])) {
      ADD_FAILURE() << name << "[" << i << "]: got " << got[i] << ", wrote " << want[i];
      return;
    }
}

inline void check_weights(TinyModel &m, const lf_weights &w) {
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
inline void load_and_check(const TempDir &d, TinyModel &m) {
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
inline ::testing::AssertionResult WeightsFail(const TempDir &d, lf_status want,
                                              std::initializer_list<std::string> subs) {
  Checkpoint c;
  lf_status s = lf_checkpoint_open(d.path.c_str(), &c.ck);
  if (s != LF_OK) return ::testing::AssertionFailure() << "open failed: " << lf_last_error();
  Weights w;
  s = lf_weights_load_f32(&c.ck, &w.w);
  w.cfg = &c.ck.cfg;
  return Fails(s, want, subs);
}

inline ::testing::AssertionResult OpenFails(const std::string &path, lf_status want,
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

inline lf_status parse_config(const std::map<std::string, std::string> &c, lf_model_config *cfg) {
  const std::string j = config_json(c);
  return lf_config_parse_hf(j.data(), j.size(), "/models/x/config.json", cfg);
}

} // namespace loader_test

#endif

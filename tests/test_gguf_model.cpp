// GGUF models (engine/model_gguf.c) and their tokenizers (engine/model_text.c) against the same
// models in Hugging Face form. tests/data/gguf_models holds GGUF copies of the tiny HF test models
// and tokenizers, laid out as llama.cpp's converter does (tools/make_gguf_models.py): renamed
// tensors, llama's q/k rows permuted, Llama-3 rope scaling as a rope_freqs tensor, tied
// embeddings without output.weight. Stored in the HF files' own dtypes, so the loaded model must
// equal the HF one bit for bit, and the tokenizers must give the tokenizer.json ids.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "text/json.h"
#include "engine/model.h"
#include "engine/tensor.h"
#include "engine/model_text.h"
#include "text/tokenizer.h"
#include "engine_test_util.h"
#include "test_util.h"

namespace {

std::string gguf_dir() { return lf_repo_data_dir() + "/gguf_models/"; }

struct Ck {
  lf_checkpoint ck{};
  lf_status st;
  explicit Ck(const std::string &p) { st = lf_checkpoint_open(p.c_str(), &ck); }
  ~Ck() {
    if (st == LF_OK) lf_checkpoint_close(&ck);
  }
};

struct W {
  const lf_model_config *cfg;
  lf_weights w{};
  lf_status st;
  explicit W(const lf_checkpoint &ck) : cfg(&ck.cfg) { st = lf_weights_load_f32(&ck, &w); }
  ~W() {
    if (st == LF_OK) lf_weights_free(cfg, &w);
  }
};

void expect_same(const float *a, const float *b, size_t n, const std::string &what) {
  if (!a || !b) {
    EXPECT_EQ(a == nullptr, b == nullptr) << what;
    return;
  }
  EXPECT_EQ(0, std::memcmp(a, b, n * sizeof(float))) << what << " differs";
}

class GgufModel : public ::testing::TestWithParam<const char *> {};

TEST_P(GgufModel, EqualsTheHuggingFaceModel) {
  const std::string name = GetParam();
  Ck hf(lf_repo_data_dir() + "/hf_tiny/" + name), gg(gguf_dir() + name + ".gguf");
  ASSERT_EQ(hf.st, LF_OK) << lf_last_error();
  ASSERT_EQ(gg.st, LF_OK) << lf_last_error();
  const lf_model_config &a = hf.ck.cfg, &b = gg.ck.cfg;
  EXPECT_STREQ(a.model_type, b.model_type);
  EXPECT_EQ(a.dim, b.dim);
  EXPECT_EQ(a.hidden_dim, b.hidden_dim);
  EXPECT_EQ(a.n_layers, b.n_layers);
  EXPECT_EQ(a.n_heads, b.n_heads);
  EXPECT_EQ(a.n_kv_heads, b.n_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.max_seq_len, b.max_seq_len);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.norm_eps, b.norm_eps);
  EXPECT_EQ(a.rope_style, b.rope_style);
  EXPECT_EQ(a.rope_scaling, b.rope_scaling);
  if (a.rope_scaling == LF_ROPE_SCALING_LLAMA3) {
    EXPECT_EQ(a.rope_factor, b.rope_factor);
    EXPECT_EQ(a.rope_low_freq_factor, b.rope_low_freq_factor);
    EXPECT_EQ(a.rope_high_freq_factor, b.rope_high_freq_factor);
    EXPECT_EQ(a.rope_original_max_pos, b.rope_original_max_pos);
  }
  EXPECT_EQ(a.qkv_bias, b.qkv_bias);
  EXPECT_EQ(a.qk_norm, b.qk_norm);
  EXPECT_EQ(a.tie_embeddings, b.tie_embeddings);
  EXPECT_EQ(a.bos_id, b.bos_id);
  ASSERT_GE(b.n_eos, 1);
  EXPECT_EQ(a.eos_ids[0], b.eos_ids[0]);

  W wa(hf.ck), wb(gg.ck);
  ASSERT_EQ(wa.st, LF_OK) << lf_last_error();
  ASSERT_EQ(wb.st, LF_OK) << lf_last_error();
  const size_t d = size_t(a.dim), q = size_t(a.n_heads) * a.head_dim,
               kv = size_t(a.n_kv_heads) * a.head_dim, h = size_t(a.hidden_dim);
  expect_same(wa.w.embed, wb.w.embed, size_t(a.vocab_size) * d, "embed");
  expect_same(wa.w.lm_head, wb.w.lm_head, size_t(a.vocab_size) * d, "lm_head");
  expect_same(wa.w.rms_final, wb.w.rms_final, d, "final norm");
  for (int l = 0; l < a.n_layers; l++) {
    const lf_layer_weights &x = wa.w.layers[l], &y = wb.w.layers[l];
    const std::string L = "layer " + std::to_string(l) + " ";
    expect_same(x.rms_att, y.rms_att, d, L + "attn norm");
    expect_same(x.wq, y.wq, q * d, L + "wq (un-permuted)");
    expect_same(x.wk, y.wk, kv * d, L + "wk (un-permuted)");
    expect_same(x.wv, y.wv, kv * d, L + "wv");
    expect_same(x.bq, y.bq, q, L + "bq");
    expect_same(x.bk, y.bk, kv, L + "bk");
    expect_same(x.bv, y.bv, kv, L + "bv");
    expect_same(x.q_norm, y.q_norm, size_t(a.head_dim), L + "q norm");
    expect_same(x.k_norm, y.k_norm, size_t(a.head_dim), L + "k norm");
    expect_same(x.wo, y.wo, d * q, L + "wo");
    expect_same(x.rms_ffn, y.rms_ffn, d, L + "ffn norm");
    expect_same(x.w_gate, y.w_gate, h * d, L + "gate");
    expect_same(x.w_up, y.w_up, h * d, L + "up");
    expect_same(x.w_down, y.w_down, d * h, L + "down");
  }
}

// The whole path through the public API: the same greedy tokens from the GGUF file as from the
// HF directory (whose tokens tests/test_loader.cpp checks against transformers).
TEST_P(GgufModel, GeneratesTheHuggingFaceModelsTokens) {
  const std::string name = GetParam();
  const std::string hf_dir = lf_repo_data_dir() + "/hf_tiny/" + name;
  const std::string gg_file = gguf_dir() + name + ".gguf";
  lf_engine_config c;
  lf_engine_config_default(&c);
  c.backend = LF_BACKEND_CPU;
  c.n_threads = 1;
  const std::vector<int32_t> prompt = {1, 17, 42, 99, 7, 200, 13, 5, 64, 128, 31};
  c.model_path = hf_dir.c_str();
  LfRun ra = lf_test_run_one(c, prompt, 48, true);
  c.model_path = gg_file.c_str();
  LfRun rb = lf_test_run_one(c, prompt, 48, true);
  ASSERT_EQ(ra.init, LF_OK);
  ASSERT_EQ(rb.init, LF_OK) << lf_last_error();
  EXPECT_EQ(ra.tokens.size(), 48u);
  EXPECT_EQ(ra.tokens, rb.tokens);
}

INSTANTIATE_TEST_SUITE_P(Tiny, GgufModel, ::testing::Values("llama", "qwen2", "qwen3"));

// A tokenizer rebuilt from GGUF metadata (tokens, merges, token types, pre-tokenizer name,
// add_bos) encodes and decodes as the original tokenizer.json does (its reference cases come from
// the `tokenizers` library, tools/make_tokenizer_data.py).
class GgufTokenizer : public ::testing::TestWithParam<const char *> {};

TEST_P(GgufTokenizer, MatchesTokenizerJson) {
  const std::string name = GetParam();
  lf_tokenizer *tok = nullptr;
  char why[256];
  ASSERT_EQ(lf_model_tokenizer_open((gguf_dir() + "tok_" + name + ".gguf").c_str(), &tok, why,
                                    sizeof why),
            LF_OK)
      << lf_last_error();
  ASSERT_NE(tok, nullptr) << why;
  std::ifstream f(lf_repo_data_dir() + "/tokenizers/bytelevel_" + name + "/reference.json");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string js = ss.str();
  lf_json *root = nullptr;
  char err[128];
  ASSERT_EQ(lf_json_parse(js.data(), js.size(), &root, err, sizeof err), LF_OK) << err;
  const lf_json *cases = lf_json_get(root, "cases");
  ASSERT_GT(lf_json_len(cases), 10u);
  size_t checked = 0;
  for (size_t i = 0; i < lf_json_len(cases); i++) {
    const lf_json *c = lf_json_at(cases, i);
    size_t n = 0;
    const char *text = lf_json_str(lf_json_get(c, "text"), &n);
    ASSERT_NE(text, nullptr);
    for (int special = 0; special < 2; special++) {
      const lf_json *want = lf_json_get(c, special ? "ids_special" : "ids");
      if (!want) continue;
      std::vector<int32_t> w;
      for (size_t k = 0; k < lf_json_len(want); k++) {
        int64_t v = -1;
        lf_json_int(lf_json_at(want, k), &v);
        w.push_back(int32_t(v));
      }
      lf_token_ids got{};
      ASSERT_EQ(lf_tokenizer_encode(tok, text, n, special ? LF_TOK_ADD_SPECIAL : 0, &got), LF_OK)
          << lf_last_error();
      EXPECT_EQ(std::vector<int32_t>(got.ids, got.ids + got.n), w)
          << name << " case " << i << (special ? " (add special)" : "") << ": " << text;
      if (special) { // the reference decodes the ids with BOS, keeping and skipping specials
        for (int skip = 0; skip < 2; skip++) {
          lf_tok_text out{};
          ASSERT_EQ(lf_tokenizer_decode(tok, got.ids, got.n, skip ? LF_TOK_SKIP_SPECIAL : 0, &out),
                    LF_OK);
          const char *dec = lf_json_str(lf_json_get(c, skip ? "decode_skip" : "decode"), nullptr);
          if (dec) {
            EXPECT_STREQ(out.data, dec) << name << " case " << i;
          }
          lf_tok_text_free(&out);
        }
      }
      lf_token_ids_free(&got);
      checked++;
    }
  }
  EXPECT_GT(checked, 20u);
  lf_json_free(root);
  lf_tokenizer_free(tok);
}

INSTANTIATE_TEST_SUITE_P(ByteLevel, GgufTokenizer, ::testing::Values("llama3", "qwen2"));

TEST(GgufText, NoTokenizerOrTemplateIsSaidClearly) {
  // The tiny model GGUFs carry no tokenizer metadata and no chat template.
  const std::string p = gguf_dir() + "llama.gguf";
  lf_tokenizer *tok = reinterpret_cast<lf_tokenizer *>(1);
  char why[512];
  ASSERT_EQ(lf_model_tokenizer_open(p.c_str(), &tok, why, sizeof why), LF_OK);
  EXPECT_EQ(tok, nullptr);
  EXPECT_NE(std::string(why).find("no tokenizer"), std::string::npos) << why;
  lf_chat_template *t = nullptr;
  EXPECT_EQ(lf_model_chat_template_open(p.c_str(), &t), LF_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(lf_last_error()).find("chat_template"), std::string::npos)
      << lf_last_error();
  // A llama2.c file or a random model has neither either.
  ASSERT_EQ(lf_model_tokenizer_open("random:tiny-llama", &tok, why, sizeof why), LF_OK);
  EXPECT_EQ(tok, nullptr);
}

// Model-level refusals: an architecture lfserve does not run, and a file that is not GGUF.
TEST(GgufModelErrors, UnsupportedArchitectureAndBadFiles) {
  // Rewrite the architecture string of llama.gguf ("llama" -> "llamb") in a copy.
  std::ifstream in(gguf_dir() + "llama.gguf", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string key = "general.architecture";
  const size_t at = bytes.find(key);
  ASSERT_NE(at, std::string::npos);
  // key, then u32 value type (8 = string), u64 length 5, "llama"
  const size_t val = at + key.size() + 4 + 8;
  ASSERT_EQ(bytes.compare(val, 5, "llama"), 0);
  bytes[val + 4] = 'b';
  const std::string path = testing::TempDir() + "arch.gguf";
  {
    std::ofstream out(path, std::ios::binary);
    out << bytes;
  }
  lf_checkpoint ck;
  EXPECT_EQ(lf_checkpoint_open(path.c_str(), &ck), LF_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(lf_last_error()).find("llamb"), std::string::npos) << lf_last_error();
  // Truncated right after the magic: a clear format error, no crash.
  {
    std::ofstream out(path, std::ios::binary);
    out << bytes.substr(0, 10);
  }
  EXPECT_NE(lf_checkpoint_open(path.c_str(), &ck), LF_OK);
  EXPECT_STRNE(lf_last_error(), "");
  std::remove(path.c_str());
}

// A NaN or an infinity in a tensor's data (corrupt bytes, a broken conversion) is refused at
// load, naming the tensor, on every format: here a GGUF copy with one value of the up projection
// of layer 0 replaced (by the bytes of a NaN in the tensor's own dtype).
TEST(GgufModelErrors, NonFiniteWeightsRefusedByName) {
  const std::string src = gguf_dir() + "llama.gguf";
  std::ifstream in(src, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t at = std::string::npos, elem = 0;
  std::string name;
  {
    Ck c(src);
    ASSERT_EQ(c.st, LF_OK) << lf_last_error();
    const lf_tensor_src *t = lf_tensor_set_find(&c.ck.tensors, "model.layers.0.mlp.up_proj.weight");
    ASSERT_NE(t, nullptr);
    ASSERT_TRUE(t->dtype == LF_DTYPE_F32 || t->dtype == LF_DTYPE_BF16 || t->dtype == LF_DTYPE_F16);
    name = t->name;
    // find the tensor's first 64 bytes in the file: its offset
    const std::string head((const char *)t->data, 64);
    at = bytes.find(head);
    ASSERT_NE(at, std::string::npos);
    ASSERT_EQ(bytes.find(head, at + 1), std::string::npos) << "not unique";
    elem = 5;
    if (t->dtype == LF_DTYPE_F32) {
      const uint32_t nan = 0x7fc00000u;
      std::memcpy(&bytes[at + 4 * elem], &nan, 4);
    } else { // bf16 and f16 NaN patterns
      const uint16_t nan = t->dtype == LF_DTYPE_BF16 ? 0x7fc0u : 0x7e00u;
      std::memcpy(&bytes[at + 2 * elem], &nan, 2);
    }
  }
  const std::string path = testing::TempDir() + "nan.gguf";
  {
    std::ofstream out(path, std::ios::binary);
    out << bytes;
  }
  Ck c(path);
  ASSERT_EQ(c.st, LF_OK) << lf_last_error(); // the header is fine; the values are read at load
  W w(c.ck);
  EXPECT_EQ(w.st, LF_ERR_FORMAT);
  const std::string err = lf_last_error();
  EXPECT_NE(err.find(name), std::string::npos) << err;
  EXPECT_NE(err.find("non-finite"), std::string::npos) << err;
  std::remove(path.c_str());
}

} // namespace

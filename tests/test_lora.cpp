// LoRA adapters merged at load (engine/lora.c, lf_engine_config.lora_path).
//
// Fidelity: tests/data/lora holds PEFT adapters with random nonzero factors for two tiny HF test
// models and the float64 logits of PEFT's merged model (tools/make_lora_testdata.py). The cpu
// backend must match them at every prompt position within the fidelity suite's tolerance
// (FID_CPU_TOL_REL, tests/test_fidelity.cpp says why), from the HF directory and from the GGUF
// copy of the same base (llama.gguf stores q/k rows in llama.cpp's rotary order: the merge must
// happen in the Hugging Face layout). The merged weights must equal W + scale * B·A computed
// here in double, every tensor-parallel shard must equal its slice of the whole merged model,
// and the engine API must generate PEFT's greedy tokens.
//
// Errors: every way an adapter can be wrong (its JSON, its config, unsupported variants, its
// safetensors file, names, shapes, values, tied embeddings) gives its status and a message naming
// the adapter, never an abort, and leaves the checkpoint unchanged; randomly corrupted copies of
// a real adapter do the same (seeded, printed; replay with LF_TEST_SEED).
#include "tests/loader_util.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "base/error.h"
#include "engine_test_util.h"
#include "fidelity_util.h"
#include "parallel/shard.h"

using namespace loader_test;

namespace {

std::string data_dir() {
  return lf_repo_data_dir();
}
std::string lora_dir(const std::string &name) {
  return data_dir() + "/lora/" + name;
}

// ---- reference.json ------------------------------------------------------------------------

struct LoraRef {
  std::string base; // "hf_tiny/<model>"
  std::vector<int32_t> prompt, greedy;
  int vocab = 0;
  std::vector<float> logits; // [prompt.size()][vocab]
  double margin = 0;
};

bool read_ints(const lf_json *a, std::vector<int32_t> *out) {
  if (lf_json_typeof(a) != LF_JSON_ARRAY) return false;
  for (size_t i = 0; i < lf_json_len(a); i++) {
    int64_t v;
    if (!lf_json_int(lf_json_at(a, i), &v)) return false;
    out->push_back(int32_t(v));
  }
  return true;
}

bool read_ref(const std::string &name, LoraRef *r, std::string *err) {
  const std::string path = lora_dir(name) + "/reference.json";
  const std::vector<uint8_t> text = read_bytes(path);
  lf_json *root = nullptr;
  char jerr[200];
  if (text.empty() || lf_json_parse(reinterpret_cast<const char *>(text.data()), text.size(), &root,
                                    jerr, sizeof jerr) != LF_OK) {
    *err = path + ": missing or bad JSON (run tools/make_lora_testdata.py)";
    return false;
  }
  bool ok = lf_json_str(lf_json_get(root, "base"), nullptr) &&
            read_ints(lf_json_get(root, "prompt"), &r->prompt) &&
            read_ints(lf_json_get(root, "greedy"), &r->greedy) &&
            lf_json_num(lf_json_get(root, "greedy_min_margin"), &r->margin);
  if (ok) r->base = lf_json_str(lf_json_get(root, "base"), nullptr);
  const lf_json *lg = lf_json_get(root, "logits");
  ok = ok && lf_json_len(lg) == r->prompt.size() && !r->prompt.empty();
  for (size_t i = 0; ok && i < lf_json_len(lg); i++) {
    const lf_json *row = lf_json_at(lg, i);
    if (i == 0) r->vocab = int(lf_json_len(row));
    ok = lf_json_typeof(row) == LF_JSON_ARRAY && int(lf_json_len(row)) == r->vocab;
    for (size_t j = 0; ok && j < lf_json_len(row); j++) {
      double v;
      ok = lf_json_num(lf_json_at(row, j), &v);
      r->logits.push_back(float(v));
    }
  }
  lf_json_free(root);
  if (!ok) *err = path + ": unexpected layout";
  return ok;
}

// The reference as a golden sequence for fid_run: the prompt fed one token at a time (a prompt
// of 1, then decode steps), so the logits of every prompt position come back.
FidGolden golden_of(const LoraRef &r) {
  FidGolden g;
  g.prompt_len = 1;
  g.vocab = r.vocab;
  g.tokens = r.prompt;
  g.tokens.push_back(0); /* never fed */
  for (int i = 0; i < int(r.prompt.size()); i++)
    g.pos.push_back(i);
  g.logits = r.logits;
  g.bf16_top1.assign(r.prompt.size(), -1);
  return g;
}

struct Judged {
  float worst = 0; // max over positions of max|d| / (1 + max|ref|)
  int decisive_misses = 0, n = 0;
};

Judged judge(const FidGolden &g, const std::vector<float> &got) {
  Judged j;
  for (const FidPos &p : fid_compare(g, got)) {
    j.n++;
    j.worst = std::max(j.worst, p.max_abs / (1.0f + p.ref_absmax));
    if (p.gap > 2.0f * FID_CPU_TOL_REL * (1.0f + p.ref_absmax) && p.got_top1 != p.ref_top1)
      j.decisive_misses++;
  }
  return j;
}

lf_status open_merged(const std::string &model, const std::string &adapter, lf_checkpoint *ck) {
  lf_status s = lf_checkpoint_open(model.c_str(), ck);
  if (s == LF_OK && !adapter.empty()) s = lf_checkpoint_apply_lora(ck, adapter.c_str());
  return s;
}

// ---- fidelity against PEFT -----------------------------------------------------------------

struct FidCase {
  const char *adapter, *model; // model relative to tests/data
};

class LoraFidelity : public ::testing::TestWithParam<FidCase> {};

TEST_P(LoraFidelity, MatchesPeftMergedModelInFloat64) {
  const FidCase c = GetParam();
  LoraRef ref;
  std::string err;
  ASSERT_TRUE(read_ref(c.adapter, &ref, &err)) << err;
  const FidGolden g = golden_of(ref);
  Checkpoint merged, base;
  ASSERT_EQ(open_merged(data_dir() + "/" + c.model, lora_dir(c.adapter), &merged.ck), LF_OK)
      << lf_last_error();
  const Judged j = judge(g, fid_run(LF_BACKEND_CPU, merged.ck, g));
  ASSERT_EQ(j.n, int(ref.prompt.size()));
  std::printf("%-6s on %-25s: worst max|d| / (1 + max|ref|) = %.2e over %d positions (tolerance "
              "%.0e)\n",
              c.adapter, c.model, double(j.worst), j.n, double(FID_CPU_TOL_REL));
  EXPECT_LE(j.worst, FID_CPU_TOL_REL);
  EXPECT_EQ(j.decisive_misses, 0);

  // The adapter matters: the base model alone is nowhere near the reference.
  ASSERT_EQ(open_merged(data_dir() + "/" + c.model, "", &base.ck), LF_OK) << lf_last_error();
  const Judged jb = judge(g, fid_run(LF_BACKEND_CPU, base.ck, g));
  EXPECT_GT(jb.worst, 1000 * FID_CPU_TOL_REL) << "the adapter hardly changes the model";
}

INSTANTIATE_TEST_SUITE_P(
    Peft, LoraFidelity,
    ::testing::Values(FidCase{"llama", "hf_tiny/llama"}, FidCase{"llama", "gguf_models/llama.gguf"},
                      FidCase{"qwen2", "hf_tiny/qwen2"},
                      FidCase{"qwen2", "gguf_models/qwen2.gguf"}),
    [](const ::testing::TestParamInfo<FidCase> &i) {
      return std::string(i.param.adapter) +
             (std::string(i.param.model).find("gguf") != std::string::npos ? "_gguf" : "_hf");
    });

// ---- merged weights ------------------------------------------------------------------------

// Every weight the adapter targets equals W + scale * B·A (an embedding: W + scale * (B·A)^T),
// computed here in double from the files, to fp32 rounding; every other tensor is untouched.
TEST(Lora, MergedWeightsAreWPlusScaledBA) {
  for (const char *name : {"llama", "qwen2"}) {
    SCOPED_TRACE(name);
    LoraRef ref;
    std::string err;
    ASSERT_TRUE(read_ref(name, &ref, &err)) << err;
    Checkpoint base, merged;
    const std::string model = data_dir() + "/" + ref.base;
    ASSERT_EQ(open_merged(model, "", &base.ck), LF_OK) << lf_last_error();
    ASSERT_EQ(open_merged(model, lora_dir(name), &merged.ck), LF_OK) << lf_last_error();
    lf_tensor_set ad{};
    ASSERT_EQ(lf_safetensors_load(&ad, (lora_dir(name) + "/adapter_model.safetensors").c_str()),
              LF_OK);
    // scale from the config, as PEFT computes it
    const std::vector<uint8_t> ct = read_bytes(lora_dir(name) + "/adapter_config.json");
    lf_json *cfg = nullptr;
    ASSERT_EQ(lf_json_parse(reinterpret_cast<const char *>(ct.data()), ct.size(), &cfg, nullptr, 0),
              LF_OK);
    int64_t r = 0;
    double alpha = 0;
    int rs = 0;
    ASSERT_TRUE(lf_json_int(lf_json_get(cfg, "r"), &r));
    ASSERT_TRUE(lf_json_num(lf_json_get(cfg, "lora_alpha"), &alpha));
    lf_json_bool(lf_json_get(cfg, "use_rslora"), &rs);
    lf_json_free(cfg);
    const double scale = rs ? alpha / std::sqrt(double(r)) : alpha / double(r);

    auto read_all = [](const lf_tensor_src *t) {
      const int64_t rows = t->ndim == 2 ? t->shape[0] : 1, cols = t->shape[t->ndim - 1];
      std::vector<float> v(size_t(rows * cols));
      EXPECT_EQ(lf_tensor_read_f32(t, 0, rows, 0, cols, v.data()), LF_OK) << lf_last_error();
      return v;
    };
    int n_merged = 0;
    for (int i = 0; i < base.ck.tensors.n; i++) {
      const lf_tensor_src *tb = &base.ck.tensors.t[i];
      const lf_tensor_src *tm = lf_tensor_set_find(&merged.ck.tensors, tb->name);
      ASSERT_NE(tm, nullptr) << tb->name;
      const std::string mod = std::string(tb->name).substr(0, strlen(tb->name) - 7); // .weight
      const std::string pre = "base_model.model." + mod;
      const lf_tensor_src *a = lf_tensor_set_find(&ad, (pre + ".lora_A.weight").c_str());
      const lf_tensor_src *b = lf_tensor_set_find(&ad, (pre + ".lora_B.weight").c_str());
      const lf_tensor_src *ea = lf_tensor_set_find(&ad, (pre + ".lora_embedding_A").c_str());
      const lf_tensor_src *eb = lf_tensor_set_find(&ad, (pre + ".lora_embedding_B").c_str());
      const lf_tensor_src *bl = lf_tensor_set_find(&ad, (pre + ".base_layer.weight").c_str());
      const std::vector<float> w = read_all(bl ? bl : tb), got = read_all(tm);
      if (!(a || ea)) {
        EXPECT_EQ(0, std::memcmp(w.data(), got.data(), w.size() * 4)) << tb->name << " changed";
        continue;
      }
      n_merged++;
      const std::vector<float> fa = read_all(a ? a : ea), fb = read_all(a ? b : eb);
      const int64_t rows = tb->shape[0], cols = tb->shape[1];
      double worst = 0;
      for (int64_t i0 = 0; i0 < rows; i0++)
        for (int64_t j = 0; j < cols; j++) {
          double d = 0, dabs = 0;
          for (int64_t k = 0; k < r; k++) {
            const double p = a ? double(fb[size_t(i0 * r + k)]) * fa[size_t(k * cols + j)]
                               : double(fb[size_t(j * r + k)]) * fa[size_t(k * rows + i0)];
            d += p;
            dabs += std::fabs(p);
          }
          const double want = w[size_t(i0 * cols + j)] + scale * d;
          // fp32 (u = 2^-24): the scaled factors and the r products and sums, then the add
          const double u = 0x1p-24;
          const double bound = u * std::fabs(want) + (r + 2) * u * std::fabs(scale) * dabs + 1e-30;
          worst = std::max(worst, std::fabs(got[size_t(i0 * cols + j)] - want) / bound);
        }
      EXPECT_LE(worst, 1.0) << tb->name << ": off by " << worst << " x the fp32 rounding bound";
    }
    EXPECT_EQ(n_merged, std::string(name) == "llama" ? 16 : 14);
    lf_tensor_set_free(&ad);
  }
}

void expect_same_weights(const lf_model_config &c, const lf_weights &a, const lf_weights &b) {
  const size_t d = size_t(c.dim), q = size_t(c.n_heads) * c.head_dim,
               kv = size_t(c.n_kv_heads) * c.head_dim, h = size_t(c.hidden_dim),
               v = size_t(c.vocab_size);
  auto same = [](const float *x, const float *y, size_t n, const std::string &what) {
    ASSERT_EQ(x == nullptr, y == nullptr) << what;
    if (x) {
      EXPECT_EQ(0, std::memcmp(x, y, n * 4)) << what << " differs";
    }
  };
  same(a.embed, b.embed, v * d, "embed");
  same(a.lm_head, b.lm_head, v * d, "lm_head");
  for (int l = 0; l < c.n_layers; l++) {
    const lf_layer_weights &x = a.layers[l], &y = b.layers[l];
    const std::string L = "layer " + std::to_string(l) + " ";
    same(x.wq, y.wq, q * d, L + "wq");
    same(x.wk, y.wk, kv * d, L + "wk");
    same(x.wv, y.wv, kv * d, L + "wv");
    same(x.wo, y.wo, d * q, L + "wo");
    same(x.w_gate, y.w_gate, h * d, L + "gate");
    same(x.w_up, y.w_up, h * d, L + "up");
    same(x.w_down, y.w_down, d * h, L + "down");
  }
}

// The GGUF copy's q/k rows are in llama.cpp's rotary order: merged in the HF layout, the merged
// model is the HF directory's bit for bit.
TEST(Lora, GgufMergesAsTheHfDirectory) {
  for (const char *name : {"llama", "qwen2"}) {
    SCOPED_TRACE(name);
    Checkpoint hf, gg;
    ASSERT_EQ(open_merged(data_dir() + "/hf_tiny/" + name, lora_dir(name), &hf.ck), LF_OK)
        << lf_last_error();
    ASSERT_EQ(open_merged(data_dir() + "/gguf_models/" + name + ".gguf", lora_dir(name), &gg.ck),
              LF_OK)
        << lf_last_error();
    Weights wa, wb;
    ASSERT_EQ(lf_weights_load_f32(&hf.ck, &wa.w), LF_OK) << lf_last_error();
    wa.cfg = &hf.ck.cfg;
    ASSERT_EQ(lf_weights_load_f32(&gg.ck, &wb.w), LF_OK) << lf_last_error();
    wb.cfg = &gg.ck.cfg;
    expect_same_weights(hf.ck.cfg, wa.w, wb.w);
  }
}

// A tensor-parallel rank reads only its slices; each equals the same block of the whole merged
// model (the low-rank sum of an element does not depend on the block read).
TEST(Lora, ShardsAreSlicesOfTheWholeMergedModel) {
  Checkpoint ck;
  ASSERT_EQ(open_merged(data_dir() + "/hf_tiny/llama", lora_dir("llama"), &ck.ck), LF_OK)
      << lf_last_error();
  const lf_model_config &c = ck.ck.cfg;
  Weights whole;
  ASSERT_EQ(lf_weights_load_f32(&ck.ck, &whole.w), LF_OK) << lf_last_error();
  whole.cfg = &c;
  const size_t d = size_t(c.dim), hd = size_t(c.head_dim), q_dim = size_t(c.n_heads) * hd,
               hid = size_t(c.hidden_dim);
  // rows [r0, r0 + n) of a [*][cols] matrix
  auto rows_eq = [](const float *part, const float *all, size_t r0, size_t n, size_t cols) {
    return std::memcmp(part, all + r0 * cols, n * cols * 4) == 0;
  };
  // columns [c0, c0 + n) of a [rows][cols] matrix
  auto cols_eq = [](const float *part, const float *all, size_t rows, size_t cols, size_t c0,
                    size_t n) {
    for (size_t i = 0; i < rows; i++)
      if (std::memcmp(part + i * n, all + i * cols + c0, n * 4) != 0) return false;
    return true;
  };
  for (int T : {2, 4}) {
    for (int rank = 0; rank < T; rank++) {
      SCOPED_TRACE("rank " + std::to_string(rank) + " of " + std::to_string(T));
      lf_shard sh;
      ASSERT_EQ(lf_shard_plan(rank, T, c.n_heads, c.n_kv_heads, c.hidden_dim, c.vocab_size, &sh),
                LF_OK);
      Weights part;
      ASSERT_EQ(lf_weights_load_f32_shard(&ck.ck, &sh, &part.w), LF_OK) << lf_last_error();
      part.cfg = &c;
      EXPECT_TRUE(rows_eq(part.w.embed, whole.w.embed, size_t(sh.vocab0), size_t(sh.n_vocab), d));
      EXPECT_TRUE(
          rows_eq(part.w.lm_head, whole.w.lm_head, size_t(sh.vocab0), size_t(sh.n_vocab), d));
      for (int l = 0; l < c.n_layers; l++) {
        const lf_layer_weights &p = part.w.layers[l], &w = whole.w.layers[l];
        EXPECT_TRUE(rows_eq(p.wq, w.wq, size_t(sh.cq0) * hd, size_t(sh.n_cq) * hd, d)) << l;
        EXPECT_TRUE(rows_eq(p.wk, w.wk, size_t(sh.kv0) * hd, size_t(sh.n_kv) * hd, d)) << l;
        EXPECT_TRUE(rows_eq(p.wv, w.wv, size_t(sh.kv0) * hd, size_t(sh.n_kv) * hd, d)) << l;
        EXPECT_TRUE(cols_eq(p.wo, w.wo, d, q_dim, size_t(sh.q0) * hd, size_t(sh.n_q) * hd)) << l;
        EXPECT_TRUE(rows_eq(p.w_gate, w.w_gate, size_t(sh.hid0), size_t(sh.n_hid), d)) << l;
        EXPECT_TRUE(rows_eq(p.w_up, w.w_up, size_t(sh.hid0), size_t(sh.n_hid), d)) << l;
        EXPECT_TRUE(cols_eq(p.w_down, w.w_down, d, hid, size_t(sh.hid0), size_t(sh.n_hid))) << l;
      }
    }
  }
}

// Through the public API: lf_engine_config.lora_path gives PEFT's greedy tokens; "" is no adapter.
TEST(Lora, EngineGeneratesPeftsGreedyTokens) {
  for (const char *name : {"llama", "qwen2"}) {
    SCOPED_TRACE(name);
    LoraRef ref;
    std::string err;
    ASSERT_TRUE(read_ref(name, &ref, &err)) << err;
    const std::string model = data_dir() + "/" + ref.base, adapter = lora_dir(name);
    lf_engine_config c;
    lf_engine_config_default(&c);
    c.backend = LF_BACKEND_CPU;
    c.n_threads = 1;
    c.model_path = model.c_str();
    c.lora_path = adapter.c_str();
    const LfRun run = lf_test_run_one(c, ref.prompt, int(ref.greedy.size()), true);
    ASSERT_EQ(run.init, LF_OK) << lf_last_error();
    // fp32 can only flip a top-2 pair closer than its rounding; these margins are far wider.
    ASSERT_GT(ref.margin, 1e-2);
    EXPECT_EQ(run.tokens, ref.greedy);
    c.lora_path = "";
    const LfRun plain = lf_test_run_one(c, ref.prompt, int(ref.greedy.size()), true);
    ASSERT_EQ(plain.init, LF_OK) << lf_last_error();
    EXPECT_NE(plain.tokens, ref.greedy);
  }
  lf_engine_config c;
  lf_engine_config_default(&c);
  const std::string model = data_dir() + "/hf_tiny/llama", adapter = lora_dir("qwen2");
  c.backend = LF_BACKEND_CPU;
  c.model_path = model.c_str();
  c.lora_path = adapter.c_str(); // qwen2's adapter does not fit llama
  lf_engine_t e = nullptr;
  EXPECT_TRUE(Fails(lf_engine_init(&c, nullptr, &e), LF_ERR_SHAPE,
                    {"lora/qwen2/adapter_model.safetensors", "down_proj"}));
  EXPECT_EQ(e, nullptr);
}

// ---- errors --------------------------------------------------------------------------------

// A small valid adapter for hf_tiny/llama (dim 64, 4 x 16 query and 2 x 16 KV rows, MLP 160):
// q_proj of layer 0 and v_proj of layer 1, r 2, F32. Tests break it one way at a time.
struct Adapter {
  std::vector<std::pair<std::string, std::string>> cfg; // key -> raw JSON value, in order
  std::vector<StTensor> tensors;
  std::string raw_config; // when set, written instead of cfg

  Adapter() {
    cfg = {{"peft_type", "\"LORA\""},     {"r", "2"},
           {"lora_alpha", "4"},           {"target_modules", "[\"q_proj\", \"v_proj\"]"},
           {"bias", "\"none\""},          {"use_dora", "false"},
           {"use_rslora", "false"},       {"fan_in_fan_out", "false"},
           {"init_lora_weights", "true"}, {"rank_pattern", "{}"},
           {"modules_to_save", "null"}};
    add("model.layers.0.self_attn.q_proj.lora_A.weight", {2, 64});
    add("model.layers.0.self_attn.q_proj.lora_B.weight", {64, 2});
    add("model.layers.1.self_attn.v_proj.lora_A.weight", {2, 64});
    add("model.layers.1.self_attn.v_proj.lora_B.weight", {32, 2});
  }
  void set(const std::string &k, const std::string &v) {
    for (auto &kv : cfg)
      if (kv.first == k) {
        kv.second = v;
        return;
      }
    cfg.emplace_back(k, v);
  }
  void erase(const std::string &k) {
    for (size_t i = 0; i < cfg.size(); i++)
      if (cfg[i].first == k) cfg.erase(cfg.begin() + long(i));
  }
  // name without the "base_model.model." prefix (unless raw), values N(0, 0.1^2)
  void add(const std::string &name, std::vector<int64_t> shape, const std::string &dtype = "F32",
           bool raw = false) {
    StTensor t;
    t.name = raw ? name : "base_model.model." + name;
    t.dtype = dtype;
    t.shape = shape;
    size_t n = 1;
    for (auto d : shape)
      n *= size_t(d);
    std::mt19937_64 rng(n * 31 + name.size());
    std::normal_distribution<float> nd(0.0f, 0.1f);
    const size_t es = dtype == "F64" ? 8 : dtype == "F32" ? 4 : 2;
    for (size_t i = 0; i < n; i++) {
      const float f = nd(rng);
      uint8_t b[8];
      if (es == 8) {
        const double x = f;
        std::memcpy(b, &x, 8);
      } else {
        std::memcpy(b, &f, 4);
        if (es == 2) std::memmove(b, b + 2, 2); // bf16: the high half
      }
      t.bytes.insert(t.bytes.end(), b, b + es);
    }
    tensors.push_back(std::move(t));
  }
  StTensor *find(const std::string &name) {
    for (auto &t : tensors)
      if (t.name == "base_model.model." + name) return &t;
    return nullptr;
  }
  void drop(const std::string &name) {
    for (size_t i = 0; i < tensors.size(); i++)
      if (tensors[i].name == "base_model.model." + name) tensors.erase(tensors.begin() + long(i));
  }
  std::string config_text() const {
    if (!raw_config.empty()) return raw_config;
    std::string s = "{";
    for (size_t i = 0; i < cfg.size(); i++)
      s += (i ? ",\n \"" : "\n \"") + cfg[i].first + "\": " + cfg[i].second;
    return s + "\n}\n";
  }
  void write(const std::string &dir) const {
    write_file(dir + "/adapter_config.json", config_text());
    write_file(dir + "/adapter_model.safetensors", st_file(tensors));
  }
};

// Applies dir to a fresh checkpoint of model. On failure: a message, and the checkpoint's
// tensors exactly as they were (no update attached, nothing replaced).
lf_status try_apply(const std::string &model, const std::string &dir) {
  Checkpoint c;
  lf_status s = lf_checkpoint_open(model.c_str(), &c.ck);
  if (s != LF_OK) {
    ADD_FAILURE() << "cannot open " << model << ": " << lf_last_error();
    return s;
  }
  const std::vector<lf_tensor_src> before(c.ck.tensors.t, c.ck.tensors.t + c.ck.tensors.n);
  s = lf_checkpoint_apply_lora(&c.ck, dir.c_str());
  if (s != LF_OK) {
    const std::string msg = lf_last_error();
    EXPECT_FALSE(msg.empty());
    EXPECT_EQ(c.ck.lora, nullptr);
    EXPECT_EQ(c.ck.tensors.n, int(before.size()));
    for (int i = 0; i < c.ck.tensors.n && i < int(before.size()); i++)
      EXPECT_EQ(0, std::memcmp(&before[size_t(i)], &c.ck.tensors.t[i], sizeof before[0]))
          << "tensor " << before[size_t(i)].name << " changed by a failed apply";
    lf_error(s, "%s", msg.c_str()); // restore it for the caller's check
  }
  return s;
}

std::string llama() {
  return data_dir() + "/hf_tiny/llama";
}

TEST(LoraErrors, TheBaseAdapterApplies) {
  TempDir d;
  Adapter().write(d.path);
  ASSERT_EQ(try_apply(llama(), d.path), LF_OK) << lf_last_error();
  // only q_proj of layer 0 and v_proj of layer 1 change
  Checkpoint base, merged;
  ASSERT_EQ(open_merged(llama(), "", &base.ck), LF_OK);
  ASSERT_EQ(open_merged(llama(), d.path, &merged.ck), LF_OK) << lf_last_error();
  Weights wb, wm;
  ASSERT_EQ(lf_weights_load_f32(&base.ck, &wb.w), LF_OK);
  wb.cfg = &base.ck.cfg;
  ASSERT_EQ(lf_weights_load_f32(&merged.ck, &wm.w), LF_OK);
  wm.cfg = &merged.ck.cfg;
  EXPECT_NE(0, std::memcmp(wb.w.layers[0].wq, wm.w.layers[0].wq, 64 * 64 * 4));
  EXPECT_NE(0, std::memcmp(wb.w.layers[1].wv, wm.w.layers[1].wv, 32 * 64 * 4));
  float *q = wm.w.layers[0].wq, *v = wm.w.layers[1].wv;
  wm.w.layers[0].wq = wb.w.layers[0].wq;
  wm.w.layers[1].wv = wb.w.layers[1].wv;
  expect_same_weights(base.ck.cfg, wb.w, wm.w); // everything else
  wm.w.layers[0].wq = q;
  wm.w.layers[1].wv = v;
  // a second adapter on the same checkpoint
  EXPECT_TRUE(
      Fails(lf_checkpoint_apply_lora(&merged.ck, d.path.c_str()), LF_ERR_STATE, {"already"}));
}

struct BadCase {
  const char *what;
  std::function<void(Adapter &)> edit;
  lf_status want;
  const char *names; // in the message
};

TEST(LoraErrors, EveryBrokenAdapterFailsCleanly) {
  const std::vector<BadCase> cases = {
      {"bad JSON", [](Adapter &a) { a.raw_config = "{\"r\": 2,"; }, LF_ERR_FORMAT,
       "adapter_config.json"},
      {"config not an object", [](Adapter &a) { a.raw_config = "[1, 2]"; }, LF_ERR_FORMAT,
       "adapter_config.json"},
      {"no r", [](Adapter &a) { a.erase("r"); }, LF_ERR_FORMAT, "r must be"},
      {"r 0", [](Adapter &a) { a.set("r", "0"); }, LF_ERR_FORMAT, "r must be"},
      {"r 2.5", [](Adapter &a) { a.set("r", "2.5"); }, LF_ERR_FORMAT, "r must be"},
      {"lora_alpha a string", [](Adapter &a) { a.set("lora_alpha", "\"4\""); }, LF_ERR_FORMAT,
       "lora_alpha"},
      {"no lora_alpha", [](Adapter &a) { a.erase("lora_alpha"); }, LF_ERR_FORMAT, "lora_alpha"},
      {"use_rslora a string", [](Adapter &a) { a.set("use_rslora", "\"yes\""); }, LF_ERR_FORMAT,
       "use_rslora"},
      {"DoRA", [](Adapter &a) { a.set("use_dora", "true"); }, LF_ERR_UNSUPPORTED, "use_dora"},
      {"use_dora a number", [](Adapter &a) { a.set("use_dora", "1"); }, LF_ERR_FORMAT, "use_dora"},
      {"bias all", [](Adapter &a) { a.set("bias", "\"all\""); }, LF_ERR_UNSUPPORTED, "bias"},
      {"bias lora_only", [](Adapter &a) { a.set("bias", "\"lora_only\""); }, LF_ERR_UNSUPPORTED,
       "lora_only"},
      {"lora_bias", [](Adapter &a) { a.set("lora_bias", "true"); }, LF_ERR_UNSUPPORTED,
       "lora_bias"},
      {"fan_in_fan_out", [](Adapter &a) { a.set("fan_in_fan_out", "true"); }, LF_ERR_UNSUPPORTED,
       "fan_in_fan_out"},
      {"rank_pattern", [](Adapter &a) { a.set("rank_pattern", "{\"q_proj\": 4}"); },
       LF_ERR_UNSUPPORTED, "rank_pattern"},
      {"alpha_pattern", [](Adapter &a) { a.set("alpha_pattern", "{\"q_proj\": 8}"); },
       LF_ERR_UNSUPPORTED, "alpha_pattern"},
      {"modules_to_save", [](Adapter &a) { a.set("modules_to_save", "[\"lm_head\"]"); },
       LF_ERR_UNSUPPORTED, "modules_to_save"},
      {"PiSSA", [](Adapter &a) { a.set("init_lora_weights", "\"pissa\""); }, LF_ERR_UNSUPPORTED,
       "pissa"},
      {"QALoRA", [](Adapter &a) { a.set("use_qalora", "true"); }, LF_ERR_UNSUPPORTED, "use_qalora"},
      {"aLoRA", [](Adapter &a) { a.set("alora_invocation_tokens", "[5, 6]"); }, LF_ERR_UNSUPPORTED,
       "alora_invocation_tokens"},
      {"another PEFT method", [](Adapter &a) { a.set("peft_type", "\"IA3\""); }, LF_ERR_UNSUPPORTED,
       "IA3"},
      {"a module lfserve does not merge",
       [](Adapter &a) { a.set("target_modules", "[\"q_proj\", \"c_attn\"]"); }, LF_ERR_UNSUPPORTED,
       "c_attn"},
      {"target_modules not a list", [](Adapter &a) { a.set("target_modules", "7"); }, LF_ERR_FORMAT,
       "target_modules"},
      {"a tensor of an unlisted module",
       [](Adapter &a) { a.set("target_modules", "[\"q_proj\"]"); }, LF_ERR_FORMAT, "v_proj"},
      {"a listed module without tensors",
       [](Adapter &a) { a.set("target_modules", "[\"q_proj\", \"v_proj\", \"k_proj\"]"); },
       LF_ERR_FORMAT, "k_proj"},
      {"lora_B rows do not fit",
       [](Adapter &a) {
         a.drop("model.layers.0.self_attn.q_proj.lora_B.weight");
         a.add("model.layers.0.self_attn.q_proj.lora_B.weight", {63, 2});
       },
       LF_ERR_SHAPE, "[63, 2]"},
      {"lora_A columns do not fit",
       [](Adapter &a) {
         a.drop("model.layers.1.self_attn.v_proj.lora_A.weight");
         a.add("model.layers.1.self_attn.v_proj.lora_A.weight", {2, 32});
       },
       LF_ERR_SHAPE, "v_proj.lora_A.weight"},
      {"a rank other than r", [](Adapter &a) { a.set("r", "4"); }, LF_ERR_SHAPE, "r 4"},
      {"a 1-D factor",
       [](Adapter &a) {
         a.drop("model.layers.0.self_attn.q_proj.lora_A.weight");
         a.add("model.layers.0.self_attn.q_proj.lora_A.weight", {128});
       },
       LF_ERR_SHAPE, "q_proj.lora_A.weight"},
      {"a layer the model lacks",
       [](Adapter &a) {
         a.add("model.layers.7.self_attn.q_proj.lora_A.weight", {2, 64});
         a.add("model.layers.7.self_attn.q_proj.lora_B.weight", {64, 2});
       },
       LF_ERR_MISSING_TENSOR, "model.layers.7.self_attn.q_proj.weight"},
      {"a module lfserve does not merge, in the file",
       [](Adapter &a) {
         a.add("model.layers.0.input_layernorm.lora_A.weight", {2, 64});
         a.add("model.layers.0.input_layernorm.lora_B.weight", {64, 2});
       },
       LF_ERR_UNSUPPORTED, "input_layernorm"},
      {"lora_A without lora_B",
       [](Adapter &a) { a.drop("model.layers.0.self_attn.q_proj.lora_B.weight"); }, LF_ERR_FORMAT,
       "no partner"},
      {"lora_B without lora_A",
       [](Adapter &a) { a.drop("model.layers.1.self_attn.v_proj.lora_A.weight"); }, LF_ERR_FORMAT,
       "no partner"},
      {"a DoRA magnitude",
       [](Adapter &a) { a.add("model.layers.0.self_attn.q_proj.lora_magnitude_vector", {64}); },
       LF_ERR_UNSUPPORTED, "lora_magnitude_vector"},
      {"a LoRA bias",
       [](Adapter &a) { a.add("model.layers.0.self_attn.q_proj.lora_B.bias", {64}); },
       LF_ERR_UNSUPPORTED, "lora_B.bias"},
      {"a NaN",
       [](Adapter &a) {
         const float nan = NAN;
         std::memcpy(a.find("model.layers.1.self_attn.v_proj.lora_B.weight")->bytes.data() + 20,
                     &nan, 4);
       },
       LF_ERR_FORMAT, "non-finite"},
      {"a name without PEFT's prefix",
       [](Adapter &a) {
         a.add("model.layers.0.self_attn.k_proj.lora_A.weight", {2, 64}, "F32", true);
       },
       LF_ERR_FORMAT, "base_model.model."},
      {"an embedding with Linear factors",
       [](Adapter &a) {
         a.add("model.embed_tokens.lora_A.weight", {2, 64});
         a.add("model.embed_tokens.lora_B.weight", {256, 2});
       },
       LF_ERR_FORMAT, "lora_embedding_A"},
      {"F64 factors",
       [](Adapter &a) {
         a.drop("model.layers.0.self_attn.q_proj.lora_A.weight");
         a.add("model.layers.0.self_attn.q_proj.lora_A.weight", {2, 64}, "F64");
       },
       LF_ERR_UNSUPPORTED, "F64"},
      {"a base layer of another shape",
       [](Adapter &a) {
         a.add("lm_head.base_layer.weight", {255, 64});
       },
       LF_ERR_SHAPE, "lm_head.base_layer.weight"},
      {"no factors at all",
       [](Adapter &a) {
         a.tensors.clear();
         a.erase("target_modules");
       },
       LF_ERR_FORMAT, "no LoRA factors"},
  };
  for (const BadCase &c : cases) {
    SCOPED_TRACE(c.what);
    TempDir d;
    Adapter a;
    c.edit(a);
    a.write(d.path);
    EXPECT_TRUE(Fails(try_apply(llama(), d.path), c.want, {d.path, c.names}));
  }
}

TEST(LoraErrors, BrokenFilesAndPlaces) {
  {
    TempDir d;
    EXPECT_TRUE(Fails(try_apply(llama(), d / "nothing"), LF_ERR_IO, {"nothing"}));
    EXPECT_TRUE(Fails(try_apply(llama(), llama() + "/config.json"), LF_ERR_IO, {"config.json"}));
    EXPECT_TRUE(Fails(try_apply(llama(), d.path), LF_ERR_IO, {"adapter_config.json"}));
    Adapter().write(d.path);
    std::remove((d / "adapter_model.safetensors").c_str());
    EXPECT_TRUE(Fails(try_apply(llama(), d.path), LF_ERR_IO, {"adapter_model.safetensors"}));
    write_file(d / "adapter_model.bin", std::string("PK"));
    EXPECT_TRUE(Fails(try_apply(llama(), d.path), LF_ERR_UNSUPPORTED, {"adapter_model.bin"}));
  }
  {
    TempDir d;
    Adapter().write(d.path);
    std::vector<uint8_t> b = read_bytes(d / "adapter_model.safetensors");
    b.resize(b.size() - 3);
    write_file(d / "adapter_model.safetensors", b);
    EXPECT_TRUE(Fails(try_apply(llama(), d.path), LF_ERR_FORMAT, {"adapter_model.safetensors"}));
    b.resize(5);
    write_file(d / "adapter_model.safetensors", b);
    EXPECT_TRUE(Fails(try_apply(llama(), d.path), LF_ERR_FORMAT, {"adapter_model.safetensors"}));
  }
  // Tied embeddings (hf_tiny/qwen2 and its GGUF copy): embed_tokens / lm_head are refused.
  for (const std::string &model :
       {data_dir() + "/hf_tiny/qwen2", data_dir() + "/gguf_models/qwen2.gguf"}) {
    TempDir d;
    Adapter a;
    a.tensors.clear();
    a.set("target_modules", "[\"embed_tokens\"]");
    a.add("model.embed_tokens.lora_embedding_A", {2, 256});
    a.add("model.embed_tokens.lora_embedding_B", {64, 2});
    a.write(d.path);
    EXPECT_TRUE(Fails(try_apply(model, d.path), LF_ERR_UNSUPPORTED, {"ties", "embed_tokens"}));
    a.tensors.clear();
    a.set("target_modules", "[\"lm_head\"]");
    a.add("lm_head.lora_A.weight", {2, 64});
    a.add("lm_head.lora_B.weight", {256, 2});
    a.write(d.path);
    EXPECT_TRUE(Fails(try_apply(model, d.path), LF_ERR_UNSUPPORTED, {"ties", "lm_head"}));
  }
  // Checkpoints without Hugging Face weights.
  {
    TempDir d;
    Adapter().write(d.path);
    Checkpoint c;
    ASSERT_EQ(lf_checkpoint_open("random:tiny-llama", &c.ck), LF_OK);
    EXPECT_TRUE(
        Fails(lf_checkpoint_apply_lora(&c.ck, d.path.c_str()), LF_ERR_UNSUPPORTED, {"random"}));
    c.ck.cfg = {}; // as a llama2.c file reads (model_type "llama2c")
    std::snprintf(c.ck.cfg.model_type, sizeof c.ck.cfg.model_type, "llama2c");
    c.ck.random_weights = 0;
    EXPECT_TRUE(
        Fails(lf_checkpoint_apply_lora(&c.ck, d.path.c_str()), LF_ERR_UNSUPPORTED, {"llama2.c"}));
  }
}

// A base layer (PEFT saves the embedding layers' weights with the adapter) replaces the model's
// weight, and an update goes on top of it.
TEST(Lora, BaseLayerReplacesTheWeight) {
  TempDir d;
  Adapter a;
  a.add("lm_head.base_layer.weight", {256, 64});
  a.write(d.path);
  Checkpoint c;
  ASSERT_EQ(open_merged(llama(), d.path, &c.ck), LF_OK) << lf_last_error();
  const lf_tensor_src *t = lf_tensor_set_find(&c.ck.tensors, "lm_head.weight");
  ASSERT_NE(t, nullptr);
  std::vector<float> got(256 * 64);
  ASSERT_EQ(lf_tensor_read_f32(t, 0, 256, 0, 64, got.data()), LF_OK);
  EXPECT_EQ(0, std::memcmp(got.data(), a.find("lm_head.base_layer.weight")->bytes.data(),
                           got.size() * 4));
}

// Seeded random corruptions of the llama test adapter (its config's bytes and values, its
// safetensors header, truncations): every one applies or fails with a message, never crashes,
// and a failure leaves the checkpoint unchanged; one that applies loads finite weights.
TEST(LoraErrors, RandomlyCorruptedAdaptersFailCleanly) {
  std::mt19937_64 rng(lf_test_seed_for("LoraErrors.RandomlyCorruptedAdaptersFailCleanly"));
  const std::string cfg0 = [] {
    const std::vector<uint8_t> b = read_bytes(lora_dir("llama") + "/adapter_config.json");
    return std::string(b.begin(), b.end());
  }();
  const std::vector<uint8_t> st0 = read_bytes(lora_dir("llama") + "/adapter_model.safetensors");
  ASSERT_FALSE(cfg0.empty());
  ASSERT_GT(st0.size(), 8u);
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--)
    hlen = hlen << 8 | st0[size_t(i)];
  ASSERT_LT(hlen, st0.size());
  static const char *const values[] = {
      "true",     "false", "null", "0",  "-1",           "1e308",          "4.5",       "2", "4",
      "\"none\"", "\"x\"", "[]",   "{}", "[\"q_proj\"]", "\"all-linear\"", "{\"a\": 1}"};
  static const char *const keys[] = {"r",
                                     "lora_alpha",
                                     "use_rslora",
                                     "use_dora",
                                     "bias",
                                     "fan_in_fan_out",
                                     "target_modules",
                                     "rank_pattern",
                                     "init_lora_weights",
                                     "peft_type",
                                     "layers_to_transform"};
  const lf_status allowed[] = {
      LF_OK, LF_ERR_IO, LF_ERR_FORMAT, LF_ERR_UNSUPPORTED, LF_ERR_SHAPE, LF_ERR_MISSING_TENSOR};
  TempDir d;
  int n_ok = 0, by_status[LF_STATUS_COUNT] = {0};
  const int iters = 400;
  for (int it = 0; it < iters; it++) {
    std::string cfg = cfg0;
    std::vector<uint8_t> st = st0;
    switch (rng() % 5) {
    case 0: // bytes of the config
      for (int k = 0, n = 1 + int(rng() % 4); k < n && !cfg.empty(); k++)
        cfg[rng() % cfg.size()] = char(32 + rng() % 95);
      break;
    case 1: { // a value of the config
      const std::string key =
          std::string("\"") + keys[rng() % (sizeof keys / sizeof keys[0])] + "\"";
      const size_t at = cfg.find(key);
      const std::string val = values[rng() % (sizeof values / sizeof values[0])];
      if (at == std::string::npos) {
        cfg.insert(1, "\n  " + key + ": " + val + ",");
      } else {
        size_t v0 = cfg.find(':', at) + 1, v1 = v0, depth = 0;
        for (; v1 < cfg.size(); v1++) { // to the ',' or '}' ending the value
          const char ch = cfg[v1];
          if (ch == '[' || ch == '{') depth++;
          if ((ch == ']' || ch == '}') && depth-- == 0) break;
          if (ch == ',' && depth == 0) break;
        }
        cfg.replace(v0, v1 - v0, " " + val);
      }
      break;
    }
    case 2: // bytes of the safetensors header
      for (int k = 0, n = 1 + int(rng() % 3); k < n; k++)
        st[8 + rng() % hlen] = uint8_t(32 + rng() % 95);
      break;
    case 3: // the header length
      st[rng() % 8] = uint8_t(rng());
      break;
    default: // a truncation
      if (rng() % 2)
        st.resize(rng() % st.size());
      else
        cfg.resize(rng() % cfg.size());
    }
    write_file(d / "adapter_config.json", cfg);
    write_file(d / "adapter_model.safetensors", st);
    const lf_status s = try_apply(llama(), d.path);
    ASSERT_NE(std::find(std::begin(allowed), std::end(allowed), s), std::end(allowed))
        << lf_status_str(s) << ": " << lf_last_error() << "\nconfig:\n"
        << cfg;
    by_status[s]++;
    if (s != LF_OK) continue;
    n_ok++;
    Checkpoint c;
    ASSERT_EQ(open_merged(llama(), d.path, &c.ck), LF_OK) << lf_last_error();
    Weights w;
    ASSERT_EQ(lf_weights_load_f32(&c.ck, &w.w), LF_OK) << lf_last_error();
    w.cfg = &c.ck.cfg;
    for (int l = 0; l < c.ck.cfg.n_layers; l++)
      for (size_t i = 0; i < 64 * 64; i++)
        ASSERT_TRUE(std::isfinite(w.w.layers[l].wq[i]));
  }
  std::printf("%d corrupted adapters: %d applied (still valid adapters), the others by status:",
              iters, n_ok);
  for (int s = 1; s < LF_STATUS_COUNT; s++)
    if (by_status[s]) std::printf(" %s %d;", lf_status_str(lf_status(s)), by_status[s]);
  std::printf("\n");
}

} // namespace

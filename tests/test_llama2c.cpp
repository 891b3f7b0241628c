// llama2.c checkpoints, the checkpoint dispatch on path kind, and the real stories260K.
#include "tests/loader_util.h"

using namespace loader_test;

namespace {

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
  for (const char *bad :
       {"random:llama3-8b/", "random:llama3-8b/x", "random:llama3-8b/0", "random:llama3-8b/2x:1"})
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

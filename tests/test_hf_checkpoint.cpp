// HF checkpoints: configs, single files and sharded indexes, the exact fp32 weights they load
// into, and their errors.
#include "tests/loader_util.h"

using namespace loader_test;

namespace {

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

} // namespace

// End-to-end checks of the CPU engine against independent implementations:
//  - stories260K greedy generation against llama2.c's reference output (../shared);
//  - tiny random llama / qwen2 / qwen3 models against Hugging Face transformers' logits and
//    greedy tokens (tests/data/hf_tiny, made by tools/make_hf_tiny.py).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "engine/forward.h"
#include "engine/model.h"
#include "lfserve.h"
#include "engine_test_util.h"
#include "test_util.h"

namespace {

std::string read_file(const std::string &p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Numbers of the JSON array that follows "key": in s, flattened (nested arrays included).
std::vector<double> json_numbers(const std::string &s, const std::string &key) {
  std::vector<double> out;
  size_t p = s.find("\"" + key + "\"");
  if (p == std::string::npos) return out;
  p = s.find('[', p);
  int depth = 0;
  for (size_t i = p; i < s.size(); i++) {
    char c = s[i];
    if (c == '[') depth++;
    else if (c == ']') {
      if (--depth == 0) break;
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      char *end;
      out.push_back(std::strtod(s.c_str() + i, &end));
      i = size_t(end - s.c_str()) - 1;
    }
  }
  return out;
}

using Generated = LfRun;

Generated generate(const std::string &model, const std::vector<int32_t> &prompt, int max_tokens,
                   lf_policy policy, int budget, bool ignore_eos) {
  lf_engine_config cfg;
  lf_engine_config_default(&cfg);
  cfg.model_path = model.c_str();
  cfg.backend = LF_BACKEND_CPU;
  cfg.policy = policy;
  cfg.budget = budget;
  Generated g = lf_test_run_one(cfg, prompt, max_tokens, ignore_eos);
  EXPECT_EQ(g.init, LF_OK) << lf_last_error();
  return g;
}

std::string stories_path() {
  return lf_test_data_dir() + "/models/stories260K";
}

struct RefCase {
  std::vector<int32_t> prompt, expect;
};

std::vector<RefCase> stories_reference() {
  std::vector<RefCase> cases;
  std::ifstream f(stories_path() + "/greedy_reference.txt");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("prompt ", 0) != 0) continue;
    RefCase c;
    std::stringstream ps(line.substr(7));
    std::string tok;
    while (std::getline(ps, tok, ',')) c.prompt.push_back(std::stoi(tok));
    std::getline(f, line);
    std::stringstream gs(line);
    int v;
    while (gs >> v) c.expect.push_back(v);
    cases.push_back(c);
  }
  return cases;
}

TEST(Stories260K, GreedyFullMatchesLlama2cReference) {
  const std::string bin = stories_path() + "/stories260K.bin";
  if (!lf_path_exists(bin))
    GTEST_SKIP() << "stories260K not found at " << bin
                 << " (set LF_TEST_DATA to the folder holding models/stories260K)";
  auto cases = stories_reference();
  ASSERT_EQ(cases.size(), 3u);
  for (const auto &c : cases) {
    // The reference runs positions 0..511; the last generated token sits at position 512.
    Generated g = generate(bin, c.prompt, 1000, LF_POLICY_FULL, 0, false);
    ASSERT_EQ(g.tokens.size(), c.expect.size());
    for (size_t i = 0; i < c.expect.size(); i++)
      ASSERT_EQ(g.tokens[i], c.expect[i]) << "first difference at generated token " << i;
    EXPECT_EQ(g.reason, LF_FINISH_LENGTH);
    EXPECT_EQ(g.stats.evictions, 0u);
  }
}

TEST(Stories260K, LongflowSmallBudgetRunsToContextEnd) {
  const std::string bin = stories_path() + "/stories260K.bin";
  if (!lf_path_exists(bin)) GTEST_SKIP() << "stories260K not found at " << bin;
  Generated g = generate(bin, {1}, 511, LF_POLICY_LONGFLOW, 64, true);
  EXPECT_EQ(g.tokens.size(), 511u);
  EXPECT_EQ(g.reason, LF_FINISH_LENGTH);
  EXPECT_EQ(g.stats.slots_filled, 64);
  // Positions 0..511 are written into 64 slots per (layer, head): every token past the 64th
  // overwrites one slot in each of the 5 layers x 4 KV heads.
  EXPECT_EQ(g.stats.evictions, uint64_t(511 - 64) * 5 * 4);
  // With a budget as large as the context, longflow never evicts and equals full.
  auto cases = stories_reference();
  ASSERT_FALSE(cases.empty());
  Generated big = generate(bin, cases[1].prompt, 1000, LF_POLICY_LONGFLOW, 512, false);
  EXPECT_EQ(big.tokens, cases[1].expect);
}

TEST(Stories260K, FullPolicyOverflowIsAnError) {
  const std::string bin = stories_path() + "/stories260K.bin";
  if (!lf_path_exists(bin)) GTEST_SKIP() << "stories260K not found at " << bin;
  Generated g = generate(bin, {1, 400, 20}, 100, LF_POLICY_FULL, 32, true);
  EXPECT_EQ(g.reason, LF_FINISH_ERROR);
  // 32 slots hold positions 0..31; the token at position 32 can be sampled but not written.
  EXPECT_EQ(g.tokens.size(), 30u);
}

class HfTiny : public ::testing::TestWithParam<const char *> {};

TEST_P(HfTiny, LogitsAndGreedyMatchTransformers) {
  const std::string dir = lf_repo_data_dir() + "/hf_tiny/" + GetParam();
  const std::string ref = read_file(dir + "/reference.json");
  ASSERT_FALSE(ref.empty()) << "missing " << dir << "/reference.json";
  std::vector<double> prompt_d = json_numbers(ref, "prompt");
  std::vector<double> logits_ref = json_numbers(ref, "logits");
  std::vector<double> greedy_d = json_numbers(ref, "greedy");
  std::vector<int32_t> prompt(prompt_d.begin(), prompt_d.end());
  std::vector<int32_t> greedy(greedy_d.begin(), greedy_d.end());
  ASSERT_FALSE(prompt.empty());
  ASSERT_FALSE(greedy.empty());

  // Logits of every prompt position through the forward pass directly.
  lf_checkpoint ck;
  ASSERT_EQ(lf_checkpoint_open(dir.c_str(), &ck), LF_OK) << lf_last_error();
  lf_weights w;
  ASSERT_EQ(lf_weights_load_f32(&ck, &w), LF_OK) << lf_last_error();
  const lf_model_config &c = ck.cfg;
  ASSERT_EQ(logits_ref.size(), prompt.size() * size_t(c.vocab_size));
  lf_kv_arena arena;
  lf_pool_shape ps = {1, c.n_layers, c.n_kv_heads, c.max_seq_len, c.head_dim, 0, 0, nullptr};
  ASSERT_EQ(lf_kv_arena_init(&arena, &ps), LF_OK);
  int pool;
  ASSERT_EQ(lf_kv_arena_take(&arena, &pool), LF_OK);
  lf_attn_params ap{};
  ap.policy = LF_POLICY_FULL;
  ap.sink = 4;
  ap.window = 32;
  ap.group = c.n_heads / c.n_kv_heads;
  ap.head_dim = c.head_dim;
  ap.scale = 1.0f / std::sqrt(float(c.head_dim));
  lf_cpu_forward f;
  ASSERT_EQ(lf_cpu_forward_init(&f, &c, &w, &arena, &ap), LF_OK);
  std::vector<float> logits(prompt.size() * c.vocab_size, NAN);
  ASSERT_EQ(lf_cpu_forward_run(&f, pool, 0, int(prompt.size()), prompt.data(), nullptr,
                               logits.data(), nullptr),
            LF_OK)
      << lf_last_error();
  double num = 0, den = 0;
  for (size_t i = 0; i < logits.size(); i++) {
    num += (logits[i] - logits_ref[i]) * (logits[i] - logits_ref[i]);
    den += logits_ref[i] * logits_ref[i];
  }
  const double rel = std::sqrt(num / den);
  EXPECT_LT(rel, 1e-4) << GetParam() << ": relative L2 error of all prompt logits";
  for (size_t t = 0; t < prompt.size(); t++) {
    double n2 = 0, d2 = 0;
    for (int v = 0; v < c.vocab_size; v++) {
      const double a = logits[t * c.vocab_size + v], b = logits_ref[t * c.vocab_size + v];
      n2 += (a - b) * (a - b);
      d2 += b * b;
    }
    EXPECT_LT(std::sqrt(n2 / d2), 1e-4) << "position " << t;
  }
  lf_cpu_forward_free(&f);
  lf_kv_arena_free(&arena);
  lf_weights_free(&ck.cfg, &w);
  lf_checkpoint_close(&ck);

  // Greedy continuation through the public API: full policy, and longflow with a budget that
  // never fills (which must be identical).
  Generated g = generate(dir, prompt, int(greedy.size()), LF_POLICY_FULL, 0, true);
  EXPECT_EQ(g.tokens, greedy);
  Generated lf = generate(dir, prompt, int(greedy.size()), LF_POLICY_LONGFLOW,
                          int(prompt.size() + greedy.size()) + 1, true);
  EXPECT_EQ(lf.tokens, greedy);
  EXPECT_EQ(lf.stats.evictions, 0u);
  // A small budget evicts and still completes.
  Generated small = generate(dir, prompt, int(greedy.size()), LF_POLICY_LONGFLOW, 40, true);
  EXPECT_EQ(small.tokens.size(), greedy.size());
  EXPECT_GT(small.stats.evictions, 0u);
}

INSTANTIATE_TEST_SUITE_P(Models, HfTiny, ::testing::Values("llama", "qwen2", "qwen3"));

} // namespace

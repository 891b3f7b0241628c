// Key means (lf_engine_config.key_means, --key-means FILE): a vector per (layer, KV head) taken
// from every key after RoPE, before attention reads it or a pool stores it.
//
//  - The file parser (launch/cli.c) reads what tools/evict/key_means.py writes and refuses
//    malformed files with a message (fuzzed by fuzz/fuzz_key_means.c).
//  - lf_key_means_rows slices a rank's KV heads and rotates them as keys are.
//  - The engine refuses a mean of the wrong shape or with a non-finite value.
//  - On the cpu backend's fp32 pools (LF_KV_BF16: the arena holds fp32) the softmax removes the
//    mean: a zero mean gives the same bits as none, a large one the same logits to fp32 rounding
//    at every prompt and decode position of a sharp-attention model (a mean missing from one path,
//    prefill chunk or decode write, or taken from queries too, moves them by whole units). On
//    int8 pools a mean far from the keys' own must cost precision: the pools store k - mu.
//  - rkv's selection adds the mean back (it compares the model's keys): with rkv evicting, fp32
//    pools give the same logits with a mean as without.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "base/kvrot.h"
#include "engine/backend.h"
#include "engine/forward.h"
#include "engine/model.h"
#include "launch/cli.h"
#include "test_util.h"

namespace {

struct Parsed {
  int rc = -1;
  std::vector<float> v;
  int shape[3] = {0, 0, 0};
  std::string err;
};

Parsed parse(const std::string &text) {
  Parsed p;
  float *out = nullptr;
  int n = -1;
  char err[256] = "";
  p.rc = lf_cli_parse_key_means(text.data(), text.size(), "t", &out, &n, p.shape, err, sizeof err);
  if (p.rc == 0) p.v.assign(out, out + n);
  if (p.rc != 0) {
    EXPECT_EQ(out, nullptr);
    EXPECT_EQ(n, 0);
    EXPECT_EQ(p.shape[0], 0);
    EXPECT_NE(err[0], 0) << "a refusal says why";
  }
  free(out);
  p.err = err;
  return p;
}

TEST(KeyMeansFile, ReadsHeaderAndValues) {
  const Parsed p = parse("# written by a test\n"
                         "lfserve-key-means layers 2 kv_heads 1 head_dim 3  # shape\n"
                         "1 -2.5 3e-1\n"
                         "0, -0, 1e3 # commas too\r\n");
  ASSERT_EQ(p.rc, 0) << p.err;
  EXPECT_EQ(p.shape[0], 2);
  EXPECT_EQ(p.shape[1], 1);
  EXPECT_EQ(p.shape[2], 3);
  const std::vector<float> want = {1.0f, -2.5f, 0.3f, 0.0f, -0.0f, 1000.0f};
  EXPECT_EQ(p.v, want);
}

TEST(KeyMeansFile, RefusesMalformedFiles) {
  const char *bad[] = {
      "",                                                      // nothing
      "1 2 3",                                                 // no header
      "lfserve-key-means layers 1 kv_heads 1\n1",              // header cut short
      "lfserve-key-means kv_heads 1 layers 1 head_dim 1\n1",   // keys out of order
      "lfserve-key-means layers 0 kv_heads 1 head_dim 1\n",    // a zero dimension
      "lfserve-key-means layers 1 kv_heads 1 head_dim 2000\n", // past 1024
      "lfserve-key-means layers 1024 kv_heads 1024 head_dim 8\n", // past 2^22 values
      "lfserve-key-means layers 1 kv_heads 1 head_dim 2\n1",   // too few
      "lfserve-key-means layers 1 kv_heads 1 head_dim 2\n1 2 3", // too many
      "lfserve-key-means layers 1 kv_heads 1 head_dim 2\n1 nan", // not finite
      "lfserve-key-means layers 1 kv_heads 1 head_dim 2\n1 inf",
      "lfserve-key-means layers 1 kv_heads 1 head_dim 2\n1 1e39", // past a float
      "lfserve-key-means layers 1 kv_heads 1 head_dim 2\n1 2x",
      "lfserve-key-means layers 1.5 kv_heads 1 head_dim 2\n1 2",
  };
  for (const char *b : bad) {
    const Parsed p = parse(b);
    EXPECT_NE(p.rc, 0) << "accepted: " << b;
  }
  std::string nul = "lfserve-key-means layers 1 kv_heads 1 head_dim 2\n1 ";
  nul.push_back('\0');
  EXPECT_NE(parse(nul).rc, 0) << "a NUL byte";
  char err[256];
  float *out = nullptr;
  int n = 0, shape[3];
  EXPECT_NE(lf_cli_read_key_means("/nonexistent/means.txt", &out, &n, shape, err, sizeof err), 0);
  EXPECT_NE(std::string(err).find("cannot open"), std::string::npos) << err;
}

/* A rank's rows: the right KV heads of every layer, rotated exactly as lf_rot_row rotates keys. */
TEST(KeyMeansRows, SliceAndRotate) {
  const int L = 3, H = 4, D = 64, kv0 = 1, nkv = 2;
  std::vector<float> all((size_t)L * H * D);
  for (size_t i = 0; i < all.size(); i++) all[i] = (float)((int)(i * 37 % 101) - 50);
  for (int rot = 0; rot < 2; rot++) {
    std::vector<float> out((size_t)L * nkv * D);
    lf_key_means_rows(all.data(), L, H, D, kv0, nkv, rot, out.data());
    for (int l = 0; l < L; l++)
      for (int h = 0; h < nkv; h++) {
        std::vector<float> row(all.begin() + ((size_t)l * H + kv0 + h) * D,
                               all.begin() + ((size_t)l * H + kv0 + h + 1) * D);
        if (rot) lf_rot_row(row.data(), D, 0);
        EXPECT_EQ(0, std::memcmp(row.data(), out.data() + ((size_t)l * nkv + h) * D, 4 * D))
            << "layer " << l << " head " << h << " rot " << rot;
      }
  }
}

std::string gqa_model() { return lf_repo_data_dir() + "/fidelity/llama3_gqa"; }

TEST(KeyMeansEngine, RefusesWrongShapeAndNonFinite) {
  lf_engine_config cfg;
  lf_engine_config_default(&cfg);
  const std::string path = gqa_model();
  cfg.model_path = path.c_str();
  cfg.backend = LF_BACKEND_CPU;
  cfg.budget = 64;
  cfg.n_pools = 1;
  std::vector<float> mu(2 * 2 * 64, 0.5f); /* 2 layers x 2 KV heads x 64 */
  lf_engine_t e = nullptr;
  cfg.key_means = mu.data();
  cfg.n_key_means = (int)mu.size() - 1;
  EXPECT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_ERR_INVALID_ARG);
  EXPECT_NE(std::string(lf_last_error()).find("key_means"), std::string::npos) << lf_last_error();
  cfg.key_means = nullptr;
  cfg.n_key_means = (int)mu.size();
  EXPECT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_ERR_INVALID_ARG);
  cfg.key_means = mu.data();
  mu[77] = NAN;
  EXPECT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_ERR_INVALID_ARG);
  EXPECT_NE(std::string(lf_last_error()).find("not finite"), std::string::npos) << lf_last_error();
  mu[77] = 0.5f;
  ASSERT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_OK) << lf_last_error();
  lf_engine_free(e);
}

/* Teacher-forced logits of one sequence on the cpu backend: a prompt of P tokens in chunks of
 * 128, then n_dec decode steps on fixed tokens; every chunk's logits and each step's. */
std::vector<float> run_logits(const lf_checkpoint &ck, lf_kv_dtype dt, const float *mu, int P,
                              int n_dec, lf_policy policy = LF_POLICY_FULL, int budget = 0) {
  const int V = ck.cfg.vocab_size;
  lf_backend_params bp = lf_test_backend_params(policy, budget ? budget : P + n_dec, 1);
  if (policy == LF_POLICY_RKV) {
    bp.rkv_stage = 4;
    bp.rkv_obs = 8;
  }
  bp.kv_dtype = dt;
  bp.key_means = mu;
  bp.n_threads = 1;
  lf_backend *b = nullptr;
  EXPECT_EQ(lf_backend_create(LF_BACKEND_CPU, &ck, &bp, &b), LF_OK) << lf_last_error();
  if (!b) return {};
  int pool = -1;
  EXPECT_EQ(b->pool_take(b, &pool), LF_OK);
  std::vector<int32_t> toks((size_t)(P + n_dec));
  for (size_t i = 0; i < toks.size(); i++) toks[i] = (int32_t)((7 + 31 * i + (i * i) % 13) % V);
  std::vector<float> out, all;
  lf_batch_item it{};
  lf_batch_result res{};
  for (int p0 = 0; p0 < P + n_dec;) {
    const int n = p0 < P ? std::min(128, P - p0) : 1;
    all.assign((size_t)n * V, 0.0f);
    it = lf_batch_item{};
    it.pool = pool;
    it.pos0 = p0;
    it.n_tok = n;
    it.tokens = toks.data() + p0;
    it.logits_all = all.data();
    EXPECT_EQ(b->forward(b, &it, 1, &res, nullptr), LF_OK) << lf_last_error();
    EXPECT_EQ(res.status, LF_OK);
    out.insert(out.end(), all.begin(), all.end());
    p0 += n;
  }
  b->free(b);
  return out;
}

TEST(KeyMeansEngine, SoftmaxRemovesTheMean) {
  lf_checkpoint ck{};
  ASSERT_EQ(lf_checkpoint_open(gqa_model().c_str(), &ck), LF_OK) << lf_last_error();
  const lf_model_config &c = ck.cfg;
  const size_t n = (size_t)c.n_layers * c.n_kv_heads * c.head_dim;
  const int P = 300, T = 20;
  std::vector<float> zero(n, 0.0f), big(n);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto &x : big) x = 8.0f * nd(rng);
  const std::vector<float> none = run_logits(ck, LF_KV_BF16, nullptr, P, T);
  const std::vector<float> z = run_logits(ck, LF_KV_BF16, zero.data(), P, T);
  const std::vector<float> m = run_logits(ck, LF_KV_BF16, big.data(), P, T);
  ASSERT_EQ(none.size(), (size_t)(P + T) * c.vocab_size);
  ASSERT_EQ(z.size(), none.size());
  ASSERT_EQ(m.size(), none.size());
  EXPECT_EQ(0, std::memcmp(none.data(), z.data(), 4 * none.size())) << "a zero mean changes bits";
  double worst = 0, scale = 0;
  for (size_t i = 0; i < none.size(); i++) {
    worst = std::max(worst, (double)std::fabs(m[i] - none[i]));
    scale = std::max(scale, (double)std::fabs(none[i]));
  }
  std::printf("[ key means ] fp32 pools, mean of 8 std per dim: max |dlogit| %.2e of max |logit| "
              "%.1f over %d positions\n", worst, scale, P + T);
  EXPECT_LT(worst, 1e-4 * (1.0 + scale));
  /* int8 pools: a mean of 8 std stretches each stored row's range: the logits must move by more
   * than the rotation's rounding alone, well past fp32's */
  const std::vector<float> q0 = run_logits(ck, LF_KV_INT8, nullptr, P, T);
  const std::vector<float> q1 = run_logits(ck, LF_KV_INT8, big.data(), P, T);
  double e0 = 0, e1 = 0;
  for (size_t i = 0; i < none.size(); i++) {
    e0 = std::max(e0, (double)std::fabs(q0[i] - none[i]));
    e1 = std::max(e1, (double)std::fabs(q1[i] - none[i]));
  }
  std::printf("[ key means ] int8 pools: max |dlogit| against fp32 %.2e, with the mean %.2e\n", e0,
              e1);
  EXPECT_GT(e1, 2.0 * e0) << "the mean did not reach the int8 pools";
  lf_checkpoint_close(&ck);
}

/* rkv's selection compares the model's keys (the stored rows plus the mean: lf_kv_head.k_mean),
 * so on fp32 pools a mean changes nothing there either: a prompt that overflows the budget in
 * chunks (decode steps past the first) and decode steps, a selection every 4 steps, the logits
 * to fp32 rounding. Cosines over the centred keys choose other slots (the mean of 8 std per dim
 * would otherwise be most of every key), and the logits after them move by whole units. */
TEST(KeyMeansEngine, RkvComparesTheModelsKeys) {
  lf_checkpoint ck{};
  ASSERT_EQ(lf_checkpoint_open(gqa_model().c_str(), &ck), LF_OK) << lf_last_error();
  const lf_model_config &c = ck.cfg;
  const size_t n = (size_t)c.n_layers * c.n_kv_heads * c.head_dim;
  const int P = 300, T = 60, B = 96;
  std::vector<float> big(n);
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto &x : big) x = 8.0f * nd(rng);
  const std::vector<float> none = run_logits(ck, LF_KV_BF16, nullptr, P, T, LF_POLICY_RKV, B);
  const std::vector<float> m = run_logits(ck, LF_KV_BF16, big.data(), P, T, LF_POLICY_RKV, B);
  const std::vector<float> full = run_logits(ck, LF_KV_BF16, nullptr, P, T);
  ASSERT_EQ(none.size(), (size_t)(P + T) * c.vocab_size);
  ASSERT_EQ(m.size(), none.size());
  ASSERT_EQ(full.size(), none.size());
  double worst = 0, scale = 0, evict = 0;
  for (size_t i = 0; i < none.size(); i++) {
    worst = std::max(worst, (double)std::fabs(m[i] - none[i]));
    evict = std::max(evict, (double)std::fabs(full[i] - none[i]));
    scale = std::max(scale, (double)std::fabs(none[i]));
  }
  std::printf("[ key means ] rkv, budget %d of %d, fp32 pools, mean of 8 std: max |dlogit| %.2e "
              "(eviction itself moves them %.2e)\n", B, P + T, worst, evict);
  EXPECT_GT(evict, 1.0) << "the run does not evict enough to tell selections apart";
  EXPECT_LT(worst, 1e-4 * (1.0 + scale));
  lf_checkpoint_close(&ck);
}

} // namespace

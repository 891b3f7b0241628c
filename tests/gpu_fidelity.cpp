// Fidelity of the cuda backend (bf16 weights and KV, fp32 accumulation) against transformers in
// float64, on the sharp-attention models of tests/data/fidelity (tools/fidelity/make_golden.py):
// the same sequences, chunked prefill (512) and teacher-forced decode as tests/test_fidelity.cpp.
// Labels gpu;fidelity (skips without a CUDA device).
//
// A bf16 engine cannot match float64 logits to fp32 accuracy: with sharp attention, bf16 KV and
// activations move single logits by up to ~1 std of a position's logits (measured on an H200:
// cuda max |d| <= 0.92 std; transformers run in bfloat16 reaches 1.4 std and flips top-1 at
// float64 top-2 gaps of up to 0.60 std). So the checks, per model:
//  - decisive positions: wherever the float64 top-2 gap exceeds kDecisive = 0.75 x the std of
//    the float64 logits there (above the largest gap transformers-bf16 itself flips; cuda's
//    worst flip measured 0.34 std), cuda's top-1 must be float64's; the worst gap of any miss is
//    printed in std units;
//  - max |cuda - float64| <= kMaxDiffStd = 2 std at every position (a gross-error bound: a 1%
//    wrong rope theta already moves logits by ~2.4 std on these models);
//  - overall: over all checked positions of a model, cuda's top-1 agreement with float64 must be
//    at least transformers-bf16's (the golden files' bf16_top1: transformers in bfloat16 on the
//    same teacher-forced sequence). Measured on an H200: 122/131 vs 119, 128 vs 123, 125 vs
//    121, 127 vs 123.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <random>
#include <cstdio>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/model.h"
#include "fidelity_util.h"
#include "lfserve.h"
#include "test_util.h"

namespace {

constexpr float kDecisive = 0.75f;
constexpr float kMaxDiffStd = 2.0f;

struct GpuCase {
  int n = 0, decisive = 0, eng_equal = 0, bf16_equal = 0, eng_miss = 0, bf16_miss = 0;
  float worst_miss_gap = 0; // reference top-2 gap / std at cuda's worst top-1 miss (any gap)
  float bf16_worst_miss = 0; // the same for transformers-bf16
  float max_abs_std = 0;    // max |engine - reference| / std
  void add(const GpuCase &o) {
    n += o.n;
    decisive += o.decisive;
    eng_equal += o.eng_equal;
    bf16_equal += o.bf16_equal;
    eng_miss += o.eng_miss;
    bf16_miss += o.bf16_miss;
    worst_miss_gap = std::max(worst_miss_gap, o.worst_miss_gap);
    bf16_worst_miss = std::max(bf16_worst_miss, o.bf16_worst_miss);
    max_abs_std = std::max(max_abs_std, o.max_abs_std);
  }
};

GpuCase judge(const std::vector<FidPos> &v) {
  GpuCase c;
  for (const FidPos &p : v) {
    c.n++;
    const float sd = std::max(p.ref_std, 1e-12f);
    c.max_abs_std = std::max(c.max_abs_std, p.max_abs / sd);
    c.eng_equal += p.got_top1 == p.ref_top1;
    c.bf16_equal += p.bf16_top1 == p.ref_top1;
    if (p.got_top1 != p.ref_top1) c.worst_miss_gap = std::max(c.worst_miss_gap, p.gap / sd);
    if (p.bf16_top1 != p.ref_top1) c.bf16_worst_miss = std::max(c.bf16_worst_miss, p.gap / sd);
    if (p.gap > kDecisive * sd) {
      c.decisive++;
      c.eng_miss += p.got_top1 != p.ref_top1;
      c.bf16_miss += p.bf16_top1 != p.ref_top1;
    }
  }
  return c;
}

void print_header() {
  printf("%-13s %5s %4s %8s %11s %11s %9s %9s %10s %10s %11s\n", "model", "P", "pos", "decisive",
         "cuda==fp64", "bf16==fp64", "cuda miss", "bf16 miss", "cuda worst", "bf16 worst",
         "max|d|/std");
  printf("%-13s %5s %4s %8s %11s %11s %9s %9s %10s %10s\n", "", "", "", "", "", "",
         "decisive", "decisive", "miss gap", "miss gap");
}

void print_row(const std::string &model, const std::string &P, const GpuCase &c) {
  printf("%-13s %5s %4d %8d %6d/%-4d %6d/%-4d %9d %9d %8.3fsd %8.3fsd %11.3f\n", model.c_str(),
         P.c_str(), c.n, c.decisive, c.eng_equal, c.n, c.bf16_equal, c.n, c.eng_miss,
         c.bf16_miss, c.worst_miss_gap, c.bf16_worst_miss, c.max_abs_std);
  fflush(stdout);
}

class FidelityGpu : public ::testing::TestWithParam<std::string> {};

TEST_P(FidelityGpu, Top1MatchesFloat64) {
  if (!lf_cuda_device_present()) GTEST_SKIP() << "no CUDA device";
  const std::string model = GetParam();
  lf_checkpoint ck;
  ASSERT_EQ(lf_checkpoint_open(fid_model_dir(model).c_str(), &ck), LF_OK) << lf_last_error();
  print_header();
  GpuCase all;
  for (int P : fid_prompt_lens()) {
    FidGolden g;
    std::string err;
    ASSERT_TRUE(fid_read_golden(model, P, &g, &err)) << err;
    const std::vector<float> got = fid_run(LF_BACKEND_CUDA, ck, g);
    ASSERT_FALSE(got.empty()) << model << " P=" << P;
    const GpuCase c = judge(fid_compare(g, got));
    print_row(model, std::to_string(P), c);
    EXPECT_EQ(c.n, g.n_checked());
    EXPECT_EQ(c.eng_miss, 0) << model << " P=" << P << ": top-1 differs from float64 where its "
                             << "top-2 gap exceeds " << kDecisive << " std (worst miss at a gap of "
                             << c.worst_miss_gap << " std)";
    EXPECT_LE(c.max_abs_std, kMaxDiffStd) << model << " P=" << P;
    all.add(c);
  }
  print_row(model, "all", all);
  EXPECT_GE(all.eng_equal, all.bf16_equal)
      << model << ": cuda agrees with float64's top-1 at " << all.eng_equal << " of " << all.n
      << " positions, transformers-bf16 at " << all.bf16_equal;
  lf_checkpoint_close(&ck);
}

// Mixed passes (engine/cuda/forward.cu): prompt chunks and decode rows of other sequences in one
// pass over the weights must give every sequence the logits it gets when it runs alone, prompt
// chunk by prompt chunk and then one decode step at a time. Teacher-forced, so both runs see the
// same tokens; the GEMMs run over other row counts, so the bits may differ: max |d| is bounded
// at kMixedMaxStd of the reference row's std (a row of another sequence, a wrong position or a
// chunk attending the wrong slots moves logits by whole stds), and the top-1 must agree wherever
// the reference's top-2 gap exceeds kDecisive std.
constexpr float kMixedMaxStd = 0.3f;

TEST(FidelityGpuMixed, MixedPassesMatchSeparate) {
  if (!lf_cuda_device_present()) GTEST_SKIP() << "no CUDA device";
  constexpr int kSeqs = 4, kChunk = 64, kDecode = 80, kBudget = 256;
  const int prompt_len[kSeqs] = {150, 97, 40, 130};
  for (const std::string model : {"llama3_gqa", "qwen3_qknorm"}) {
    lf_checkpoint ck;
    ASSERT_EQ(lf_checkpoint_open(fid_model_dir(model).c_str(), &ck), LF_OK) << lf_last_error();
    const int V = ck.cfg.vocab_size;
    std::mt19937 rng(1234);
    std::vector<std::vector<int32_t>> toks(kSeqs);
    for (int q = 0; q < kSeqs; q++)
      for (int i = 0; i < prompt_len[q] + kDecode; i++)
        toks[size_t(q)].push_back(int32_t(rng() % uint32_t(V)));
    const lf_backend_params p = lf_test_backend_params(LF_POLICY_FULL, kBudget, kSeqs);
    // logits[seq][k]: after the prompt (k = 0), after decode token k (k = 1 .. kDecode - 1)
    auto run = [&](bool mixed, std::vector<std::vector<std::vector<float>>> *logits) {
      logits->assign(kSeqs, std::vector<std::vector<float>>(kDecode));
      lf_backend *b = nullptr;
      ASSERT_EQ(lf_backend_create(LF_BACKEND_CUDA, &ck, &p, &b), LF_OK) << lf_last_error();
      int pool[kSeqs], fed[kSeqs] = {0, 0, 0, 0}; // tokens fed so far
      for (int q = 0; q < kSeqs; q++) ASSERT_EQ(b->pool_take(b, &pool[q]), LF_OK);
      std::vector<float> lg(size_t(kSeqs) * V);
      // one forward of the items `who` (each its next chunk or decode token); mixed passes when
      // several are given
      auto step = [&](const std::vector<int> &who) {
        std::vector<lf_batch_item> it(who.size());
        std::vector<lf_batch_result> r(who.size());
        for (size_t j = 0; j < who.size(); j++) {
          const int q = who[j], P = prompt_len[q];
          it[j] = lf_batch_item{};
          it[j].pool = pool[q];
          it[j].pos0 = fed[q];
          it[j].n_tok = fed[q] < P ? std::min(kChunk, P - fed[q]) : 1;
          it[j].tokens = toks[size_t(q)].data() + fed[q];
        }
        ASSERT_EQ(b->forward(b, it.data(), int(it.size()), r.data(), lg.data()), LF_OK)
            << lf_last_error();
        for (size_t j = 0; j < who.size(); j++) {
          const int q = who[j];
          ASSERT_EQ(r[j].status, LF_OK) << lf_last_error();
          fed[q] += it[j].n_tok;
          if (fed[q] >= prompt_len[q])
            (*logits)[size_t(q)][size_t(fed[q] - prompt_len[q])].assign(
                lg.begin() + std::ptrdiff_t(j) * V, lg.begin() + std::ptrdiff_t(j + 1) * V);
        }
      };
      auto done = [&](int q) { return fed[q] >= prompt_len[q] + kDecode - 1; };
      if (!mixed) {
        for (int q = 0; q < kSeqs; q++)
          while (!done(q)) step({q});
      } else {
        // sequence q starts at step 3q: its prompt chunks share passes with the decode rows of
        // the sequences started before it (and with other prompts' chunks)
        for (int t = 0;; t++) {
          std::vector<int> who;
          for (int q = 0; q < kSeqs; q++)
            if (t >= 3 * q && !done(q)) who.push_back(q);
          if (who.empty()) break;
          step(who);
          if (::testing::Test::HasFatalFailure()) break;
        }
      }
      b->free(b);
    };
    std::vector<std::vector<std::vector<float>>> ref, got;
    run(false, &ref);
    if (HasFatalFailure()) return;
    run(true, &got);
    if (HasFatalFailure()) return;
    float worst = 0;
    int rows = 0, exact = 0, decisive = 0;
    for (int q = 0; q < kSeqs; q++)
      for (int k = 0; k < kDecode; k++) {
        const std::vector<float> &a = ref[size_t(q)][size_t(k)], &g = got[size_t(q)][size_t(k)];
        ASSERT_EQ(a.size(), size_t(V)) << "seq " << q << " step " << k;
        ASSERT_EQ(g.size(), size_t(V)) << "seq " << q << " step " << k;
        double mean = 0, var = 0;
        for (float x : a) mean += x;
        mean /= V;
        for (float x : a) var += (x - mean) * (x - mean);
        const float sd = float(std::sqrt(var / V)) + 1e-12f;
        float md = 0;
        for (int i = 0; i < V; i++) md = std::max(md, std::fabs(a[size_t(i)] - g[size_t(i)]));
        worst = std::max(worst, md / sd);
        exact += md == 0.0f;
        rows++;
        std::vector<float> srt(a);
        std::partial_sort(srt.begin(), srt.begin() + 2, srt.end(), std::greater<float>());
        if (srt[0] - srt[1] > kDecisive * sd) {
          decisive++;
          EXPECT_EQ(std::max_element(g.begin(), g.end()) - g.begin(),
                    std::max_element(a.begin(), a.end()) - a.begin())
              << model << " seq " << q << " step " << k;
        }
        EXPECT_LE(md / sd, kMixedMaxStd) << model << " seq " << q << " step " << k;
      }
    printf("%s: mixed vs separate passes: %d rows (%d bit-identical, %d decisive), max |d| = "
           "%.3f std\n",
           model.c_str(), rows, exact, decisive, double(worst));
    lf_checkpoint_close(&ck);
  }
}

INSTANTIATE_TEST_SUITE_P(Models, FidelityGpu, ::testing::ValuesIn(fid_models()),
                         [](const ::testing::TestParamInfo<std::string> &i) { return i.param; });

} // namespace

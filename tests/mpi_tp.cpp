// Tensor parallelism on CPU ranks (MPI): the sharded engine against a single-rank engine run on
// rank 0. Greedy tokens must be identical and logits within 1e-5 relative, on the tiny HF models
// and stories260K, with `full` and `longflow`, in the divide (T | Hkv) and the replicate
// (T > Hkv) cases; an impossible T is a clear error; each rank loads about its shard.
//
// `mpi_tp --die-rank R` is not a test: rank R exits right after start-up while the others step;
// tests/mpi_tp_die.sh checks that the job then ends within seconds instead of hanging.
#include <gtest/gtest.h>
#include <mpi.h>

#include <random>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "base/kvq.h"
#include "engine/backend.h"
#include "engine/model.h"
#include "engine/sample.h"
#include "fidelity_util.h"
#include "parallel/comm.h"
#include "parallel/shard.h"
#include "engine/tp.h"
#include "test_util.h"
#include "tp_test_util.h"

namespace {

lf_comm_t g_comm = nullptr;

struct Model {
  std::string path;
  bool present; // on disk
  bool fits;    // present, and its heads can be split over this many ranks
};

// Whether the sharding plan accepts this world size for the model (e.g. 8 ranks and 4 query
// heads do not): such models are left out of the rank-count-specific tests.
int head_dim_of(const std::string &path) {
  lf_checkpoint ck;
  if (lf_checkpoint_open(path.c_str(), &ck) != LF_OK) return 0;
  const int d = ck.cfg.head_dim;
  lf_checkpoint_close(&ck);
  return d;
}

bool plan_fits(const std::string &path) {
  lf_checkpoint ck;
  if (lf_checkpoint_open(path.c_str(), &ck) != LF_OK) return false;
  const lf_model_config &c = ck.cfg;
  lf_shard sh;
  const bool ok = lf_shard_plan(0, g_comm->size, c.n_heads, c.n_kv_heads, c.hidden_dim,
                                c.vocab_size, &sh) == LF_OK;
  lf_checkpoint_close(&ck);
  return ok;
}

std::vector<Model> models() {
  std::vector<Model> m;
  for (const char *n : {"llama", "qwen2", "qwen3"}) {
    std::string p = lf_repo_data_dir() + "/hf_tiny/" + n;
    const bool present = lf_path_exists(p + "/config.json");
    m.push_back({p, present, present && plan_fits(p)});
  }
  std::string s = lf_test_data_dir() + "/models/stories260K/stories260K.bin";
  const bool present = lf_path_exists(s);
  m.push_back({s, present, present && plan_fits(s)});
  return m;
}

// Every rank must take the same branch: skip decisions come from rank 0.
bool all_agree(bool v) {
  int x = v ? 1 : 0;
  MPI_Bcast(&x, 1, MPI_INT, 0, MPI_COMM_WORLD);
  return x != 0;
}

// The cpu engines these tests compare: small pools, sink 2, SnapKV window 4.
lf_engine_config small_cpu_config(const char *path, lf_policy policy, lf_evict_scope scope,
                                  int budget, int n_pools) {
  lf_engine_config cfg;
  lf_engine_config_default(&cfg);
  cfg.model_path = path;
  cfg.backend = LF_BACKEND_CPU;
  cfg.policy = policy;
  cfg.evict_scope = scope;
  cfg.budget = budget;
  cfg.n_pools = n_pools;
  cfg.sink = 2;
  cfg.window = 4;
  return cfg;
}

void compare_engines(const std::string &path, lf_policy policy, int budget, int n_pools,
                     const std::vector<TpGen> &gens) {
  // head scope: its evictions do not depend on how the heads are split, so T ranks must equal
  // one; layer scope is rank-local (LayerScopeIsRankLocal holds it against evict_groups = T)
  const lf_engine_config cfg = small_cpu_config(path.c_str(), policy, LF_EVICT_HEAD, budget, n_pools);
  auto [tp, ref] = lf_tp_test_run_both(cfg, g_comm, gens);
  if (g_comm->rank != 0) return;
  ASSERT_EQ(ref.size(), gens.size());
  for (size_t k = 0; k < gens.size(); k++) {
    ASSERT_EQ((int)ref[k].size(), gens[k].max_tokens);
    EXPECT_EQ(tp[k], ref[k]) << path << " " << lf_policy_str(policy) << " request " << k;
  }
}

std::vector<int32_t> prompt_of(int n, int vocab, int salt) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; i++) p[i] = (int32_t)((1 + 7 * i + 13 * salt) % vocab);
  p[0] = 1;
  return p;
}

TEST(MpiTp, GreedyTokensMatchSingleRank) {
  for (const Model &m : models()) {
    if (!all_agree(m.fits)) continue;
    for (lf_policy pol : {LF_POLICY_FULL, LF_POLICY_LONGFLOW}) {
      // longflow with a small pool evicts from the first decode step on; full holds it all
      const int budget = pol == LF_POLICY_FULL ? 96 : 16;
      std::vector<TpGen> gens = {{prompt_of(9, 256, 0), 40, 0.0f, 0},
                               {prompt_of(23, 256, 1), 30, 0.0f, 0}, // SnapKV-compressed prompt
                               {prompt_of(5, 256, 2), 35, 0.8f, 7},  // sampled, same u
                               {prompt_of(7, 256, 3), 30, 1.0f, 11, 20},        // top-k
                               {prompt_of(6, 256, 4), 30, 0.9f, 12, 5, 0.8f}}; // top-k, top-p
      compare_engines(m.path, pol, budget, 2, gens); // 5 requests on 2 pools: pool reuse
    }
  }
}

// Logit processing and logprobs take the whole-logits path on every rank (the flag travels in
// the batch descriptor), so greedy and top-k items with penalties or a bias give one rank's tokens.
TEST(MpiTp, PenaltiesAndBiasMatchSingleRank) {
  for (const Model &m : models()) {
    if (!all_agree(m.fits)) continue;
    std::vector<TpGen> gens(4);
    gens[0] = {prompt_of(9, 256, 0), 30, 0.0f, 0};
    gens[0].presence = 1.5f;
    gens[0].repetition = 1.4f;
    gens[1] = {prompt_of(7, 256, 1), 30, 1.0f, 11, 20}; // top-k with a bias
    gens[1].bias = {{3, 8.0f}, {5, -100.0f}};
    gens[2] = {prompt_of(6, 256, 2), 25, 0.0f, 0};
    gens[2].logprobs = 1;
    gens[3] = {prompt_of(5, 256, 3), 25, 0.0f, 0}; // plain greedy beside them
    gens[3].bias = {{7, 100.0f}};
    compare_engines(m.path, LF_POLICY_FULL, 96, 2, gens);
  }
}

// Quantized pools under tensor parallelism: every rank quantizes the rows of the KV heads it holds,
// so T ranks must give a single rank's tokens (head scope, evicting from the first decode step),
// and for at least one dtype per model not the bf16 pools' tokens (so the dtype reached the ranks
// and changed the pools; with rotated keys int8 can give bf16's tokens on these small models).
TEST(MpiTp, QuantizedPoolsMatchSingleRank) {
  for (const Model &m : models()) {
    if (!all_agree(m.fits)) continue;
    const std::vector<TpGen> gens = {{prompt_of(9, 256, 0), 40, 0.0f, 0},
                                     {prompt_of(23, 256, 1), 30, 0.0f, 0}};
    lf_engine_config cfg =
        small_cpu_config(m.path.c_str(), LF_POLICY_LONGFLOW, LF_EVICT_HEAD, 16, 2);
    std::vector<std::vector<int32_t>> bf16;
    if (g_comm->rank == 0) bf16 = lf_tp_test_run_single(cfg, gens);
    const int hd = head_dim_of(m.path); /* the same file on every rank */
    int differ = 0;
    for (lf_kv_dtype dt : {LF_KV_FP8, LF_KV_INT8, LF_KV_INT4}) {
      if (!lf_kvq_fits(int(dt), hd)) continue; /* int4: whole groups of 32 dims (qwen3 here) */
      cfg.kv_dtype = dt;
      const auto [tp, ref] = lf_tp_test_run_both(cfg, g_comm, gens);
      if (g_comm->rank != 0) continue;
      ASSERT_EQ(ref.size(), gens.size());
      for (size_t k = 0; k < gens.size(); k++)
        EXPECT_EQ(tp[k], ref[k]) << m.path << " " << lf_kv_dtype_str(dt) << " request " << k;
      differ += ref != bf16;
      if (ref == bf16) printf("%s %s: the bf16 pools' tokens\n", m.path.c_str(), lf_kv_dtype_str(dt));
    }
    if (g_comm->rank == 0) {
      EXPECT_GE(differ, 1) << m.path << ": every dtype as bf16's pools";
    }
  }
}

// Key means (lf_engine_config.key_means) under tensor parallelism: each rank takes the rows of the
// KV heads it holds (lf_key_means_rows from the model-wide array). The means differ by head, so on
// 8-bit pools a rank taking another head's row stores other codes: T ranks must give a single
// rank's tokens (every rank taking KV head 0's rows fails here at 2 and 4 ranks). Means several
// times larger make the test fragile: the int8 steps grow with them and the CPU ranks' sums, not
// bit-identical to one rank's, then flip a code now and then (4x: request 1 of stories260K at 4).
// rkv, whose cosines add each head's mean back (lf_kv_head.k_mean), runs on fp32 pools: every
// rank taking its first head's mean there fails at 2 and 4 ranks.
TEST(MpiTp, KeyMeansMatchSingleRank) {
  for (const Model &m : models()) {
    if (!all_agree(m.fits)) continue;
    lf_checkpoint ck;
    ASSERT_EQ(lf_checkpoint_open(m.path.c_str(), &ck), LF_OK) << lf_last_error();
    const int n = ck.cfg.n_layers * ck.cfg.n_kv_heads * ck.cfg.head_dim;
    lf_checkpoint_close(&ck);
    std::vector<float> mu((size_t)n);
    for (int i = 0; i < n; i++) mu[(size_t)i] = std::sin(0.37f * (float)i) + 0.25f * (float)(i % 7);
    const std::vector<TpGen> gens = {{prompt_of(9, 256, 0), 40, 0.0f, 0},
                                     {prompt_of(23, 256, 1), 30, 0.0f, 0}};
    /* rkv adds each head's mean back in its cosines: a rank that took another head's rows
     * there selects other slots. On the cpu backend's fp32 pools (LF_KV_BF16): on int8 pools
     * one code flipped by the ranks' sums moves a cosine enough to change a near tie (4 ranks,
     * stories260K), which says nothing of the slicing */
    for (lf_policy pol : {LF_POLICY_LONGFLOW, LF_POLICY_RKV}) {
      lf_engine_config cfg = small_cpu_config(m.path.c_str(), pol, LF_EVICT_HEAD, 16, 2);
      cfg.kv_dtype = pol == LF_POLICY_RKV ? LF_KV_BF16 : LF_KV_INT8;
      cfg.key_means = mu.data();
      cfg.n_key_means = n;
      const auto [tp, ref] = lf_tp_test_run_both(cfg, g_comm, gens);
      if (g_comm->rank != 0) continue;
      ASSERT_EQ(ref.size(), gens.size());
      for (size_t k = 0; k < gens.size(); k++)
        EXPECT_EQ(tp[k], ref[k]) << m.path << " key means, " << lf_policy_str(pol)
                                 << ", request " << k;
    }
  }
}

// Layer-scope eviction under tensor parallelism is rank-local: one slot per layer among the KV
// heads a rank holds. On random:tiny-llama-kv4 (4 KV heads) the sharded engine must give the
// tokens of a single-rank engine whose layers' KV heads are split into the same groups
// (evict_groups = T, or 4 when T > 4 replicates the heads: one head a rank), and, at 2 ranks,
// not those of the whole-layer scope (so the grouping is seen). Small pools: every decode step
// evicts, and the 23-token prompt is SnapKV-compressed per group.
TEST(MpiTp, LayerScopeIsRankLocal) {
  const char *model = "random:tiny-llama-kv4";
  const int T = g_comm->size, groups = T < 4 ? T : 4;
  if (!all_agree(plan_fits(model))) GTEST_SKIP() << model << " does not split over " << T;
  const lf_engine_config cfg = small_cpu_config(model, LF_POLICY_LONGFLOW, LF_EVICT_LAYER, 16, 2);
  const std::vector<TpGen> gens = {{prompt_of(9, 1024, 0), 60, 0.0f, 0},
                                   {prompt_of(23, 1024, 1), 50, 0.0f, 0},
                                   {prompt_of(5, 1024, 2), 40, 0.8f, 7}};
  lf_engine_config grouped = cfg;
  grouped.evict_groups = groups;
  const auto [tp, ref] = lf_tp_test_run_both(cfg, g_comm, gens, &grouped);
  lf_engine_t e = nullptr;
  /* groups are a single rank's: refused on every rank alike */
  EXPECT_EQ(lf_engine_init(&grouped, g_comm, &e), LF_ERR_INVALID_ARG);
  lf_engine_free(e);
  if (g_comm->rank != 0) return;
  ASSERT_EQ(ref.size(), gens.size());
  for (size_t k = 0; k < gens.size(); k++)
    EXPECT_EQ(tp[k], ref[k]) << "request " << k << ": " << T << " ranks against " << groups
                             << " eviction groups on one";
  if (groups == 2) {
    EXPECT_NE(lf_tp_test_run_single(cfg, gens), ref)
        << "rank-local and whole-layer scope agreed: the test saw no grouping";
  }
}

// Distributed top-k sampling (lf_tp_topk_logits: each rank's k best, one gather) against the
// whole logits (lf_tp_gather_logits): lf_sample must return the same token for every draw.
// Logits drawn per rank with repeated values (ties across and within slices) and a vocab that
// does not divide by the ranks.
TEST(MpiTp, TopkCandidatesSampleLikeWholeLogits) {
  const int vocab = 1001, n = 4;
  lf_shard sh;
  ASSERT_EQ(lf_shard_plan(g_comm->rank, g_comm->size, 8, 8, 64, vocab, &sh), LF_OK);
  std::mt19937 rng(1234u + 77u * (unsigned)g_comm->rank);
  std::uniform_int_distribution<int> level(0, 40);
  std::vector<float> local((size_t)n * sh.n_vocab);
  for (float &v : local) v = 0.25f * (float)level(rng) - 3.0f; // coarse: many exact ties
  std::vector<float> whole((size_t)n * vocab), cand((size_t)n * vocab);
  ASSERT_EQ(lf_tp_gather_logits(g_comm, &sh, vocab, n, local.data(), whole.data()), LF_OK);
  lf_sampler smp;
  ASSERT_EQ(lf_sampler_init(&smp, vocab), LF_OK);
  std::mt19937 urng(99u); // the same draws on every rank
  std::uniform_real_distribution<float> U(0.0f, 1.0f);
  int checked = 0;
  for (int k : {1, 2, 7, 50, 300, 1000}) {
    std::vector<int> ks(n, k);
    ks[1] = std::max(1, k / 2); // items of one gather may ask for different k
    ASSERT_EQ(lf_tp_topk_logits(g_comm, &sh, vocab, n, ks.data(), local.data(), cand.data()),
              LF_OK);
    for (int i = 0; i < n; i++)
      for (float temp : {0.3f, 1.0f, 2.5f})
        for (float top_p : {1.0f, 0.9f, 0.5f}) {
          lf_sampling sp{};
          sp.temperature = temp;
          sp.top_k = ks[i];
          sp.top_p = top_p;
          for (int d = 0; d < 40; d++) {
            const float u = U(urng);
            const int a = lf_sample(&smp, whole.data() + (size_t)i * vocab, &sp, u);
            const int b = lf_sample(&smp, cand.data() + (size_t)i * vocab, &sp, u);
            ASSERT_EQ(a, b) << "k " << ks[i] << " T " << temp << " p " << top_p << " u " << u;
            checked++;
          }
        }
  }
  lf_sampler_free(&smp);
  EXPECT_EQ(checked, 6 * n * 9 * 40);
}

// The sharded backend's logits against the whole model's, step by step.
TEST(MpiTp, LogitsWithinTolerance) {
  for (const Model &m : models()) {
    if (!all_agree(m.fits)) continue;
    lf_checkpoint ck;
    ASSERT_EQ(lf_checkpoint_open(m.path.c_str(), &ck), LF_OK) << lf_last_error();
    const int vocab = ck.cfg.vocab_size;
    lf_backend_params p{};
    p.policy = LF_POLICY_LONGFLOW;
    p.budget = 12;
    p.sink = 2;
    p.window = 4;
    p.n_pools = 1;
    p.comm = g_comm;
    lf_backend *tp = nullptr, *ref = nullptr;
    ASSERT_EQ(lf_backend_cpu_create(&ck, &p, &tp), LF_OK) << lf_last_error();
    p.comm = nullptr;
    ASSERT_EQ(lf_backend_cpu_create(&ck, &p, &ref), LF_OK) << lf_last_error();
    int pa, pb;
    ASSERT_EQ(tp->pool_take(tp, &pa), LF_OK);
    ASSERT_EQ(ref->pool_take(ref, &pb), LF_OK);
    std::vector<int32_t> toks = prompt_of(15, vocab, 3);
    std::vector<float> la(vocab), lb(vocab);
    int32_t pos = 0, n = (int32_t)toks.size();
    double worst = 0;
    uint64_t total_ev = 0;
    for (int step = 0; step < 30; step++) {
      lf_batch_item it{};
      it.pool = pa;
      it.pos0 = pos;
      it.n_tok = n;
      it.tokens = toks.data() + pos;
      lf_batch_result ra{}, rb{};
      ASSERT_EQ(tp->forward(tp, &it, 1, &ra, la.data()), LF_OK) << lf_last_error();
      it.pool = pb;
      ASSERT_EQ(ref->forward(ref, &it, 1, &rb, lb.data()), LF_OK) << lf_last_error();
      // Every rank goes through the same collectives whatever happens: non-fatal checks only.
      EXPECT_EQ(ra.status, LF_OK);
      float scale = 0;
      for (float v : lb) scale = std::fmax(scale, std::fabs(v));
      int bad = 0;
      for (int i = 0; i < vocab; i++) {
        const double d = std::fabs(la[i] - lb[i]) / std::fmax(scale, 1e-30f);
        worst = std::fmax(worst, d);
        if (d > 1e-5 && bad++ < 3)
          ADD_FAILURE() << m.path << " step " << step << " logit " << i << ": " << la[i]
                        << " vs " << lb[i];
      }
      EXPECT_EQ(ra.token, rb.token) << m.path << " step " << step;
      // Each rank evicts in its own heads but reports the model's count (every KV head once,
      // split or replicated): what one rank holding them all reports.
      EXPECT_EQ(ra.evictions, rb.evictions) << m.path << " step " << step;
      total_ev += rb.evictions;
      pos += n;
      n = 1;
      toks.push_back(ra.token);
    }
    EXPECT_GT(total_ev, 0u); // the pool did overflow: eviction was exercised
    if (g_comm->rank == 0)
      printf("%s: worst relative logit difference %.2e, %llu evictions\n", m.path.c_str(), worst,
             (unsigned long long)total_ev);
    tp->free(tp);
    ref->free(ref);
    lf_checkpoint_close(&ck);
  }
}

// A sharp-attention model of the fidelity suite (tests/data/fidelity: llama3 rope scaling, GQA
// 4/2) over its 1500-token prompt in chunks of 512 and 24 teacher-forced decode steps: the
// sharded backend's greedy tokens equal one rank's at every observed position, its logits are
// within fp32 rounding of one rank's (1e-5 of the largest |logit|, as above), and both are within
// the fidelity tolerance of transformers' float64 logits. Ranks that do not divide the model's
// heads (8) skip.
TEST(MpiTp, SharpAttentionLongPromptMatchesSingleRank) {
  const std::string model = "llama3_gqa";
  const std::string dir = fid_model_dir(model);
  const bool fits = lf_path_exists(dir + "/config.json") && plan_fits(dir);
  if (!all_agree(fits))
    GTEST_SKIP() << dir << " absent or its heads do not split " << g_comm->size << " ways";
  FidGolden g;
  std::string err;
  ASSERT_TRUE(fid_read_golden(model, 1500, &g, &err)) << err; // same files on every rank
  lf_checkpoint ck;
  ASSERT_EQ(lf_checkpoint_open(dir.c_str(), &ck), LF_OK) << lf_last_error();
  std::vector<int32_t> tp_tok, ref_tok;
  const std::vector<float> tp = fid_run(LF_BACKEND_CPU, ck, g, FidFault{}, g_comm, &tp_tok);
  if (g_comm->rank == 0) {
    const std::vector<float> ref = fid_run(LF_BACKEND_CPU, ck, g, FidFault{}, nullptr, &ref_tok);
    ASSERT_EQ(tp.size(), g.logits.size());
    ASSERT_EQ(ref.size(), g.logits.size());
    EXPECT_EQ(tp_tok, ref_tok);
    const int V = g.vocab;
    double worst = 0;
    for (int i = 0; i < g.n_checked(); i++) {
      float scale = 0;
      for (int j = 0; j < V; j++) scale = std::fmax(scale, std::fabs(ref[size_t(i) * V + j]));
      for (int j = 0; j < V; j++) {
        const size_t k = size_t(i) * V + j;
        worst = std::fmax(worst, std::fabs(tp[k] - ref[k]) / std::fmax(scale, 1e-30f));
      }
    }
    EXPECT_LE(worst, 1e-5) << "tensor-parallel logits vs one rank's";
    float worst_tp = 0, worst_ref = 0;
    int top1_tp = 0;
    for (const FidPos &p : fid_compare(g, tp)) {
      worst_tp = std::max(worst_tp, p.max_abs / (1.0f + p.ref_absmax));
      top1_tp += p.got_top1 == p.ref_top1;
    }
    for (const FidPos &p : fid_compare(g, ref))
      worst_ref = std::max(worst_ref, p.max_abs / (1.0f + p.ref_absmax));
    EXPECT_LE(worst_tp, FID_CPU_TOL_REL);
    EXPECT_LE(worst_ref, FID_CPU_TOL_REL);
    printf("%s P=1500: %d positions, tokens %s; TP vs one rank %.2e of max|logit|; vs float64 "
           "(ratio, tolerance %.1e): TP %.2e, one rank %.2e; TP top-1 = float64 at %d/%d\n",
           model.c_str(), g.n_checked(), tp_tok == ref_tok ? "equal" : "DIFFER", worst,
           double(FID_CPU_TOL_REL), double(worst_tp), double(worst_ref), top1_tp, g.n_checked());
  }
  lf_checkpoint_close(&ck);
}

// A communicator that claims `size` ranks: enough to reach the start-up plan check, which needs
// no collective (the allgather replicates this rank's contribution).
struct FakeComm {
  lf_comm base;
  static lf_status allgather(lf_comm *c, const void *send, void *recv, size_t n, lf_comm_dtype t,
                             void *) {
    const size_t b = n * lf_comm_dtype_size(t);
    for (int r = 0; r < c->size; r++) std::memcpy((char *)recv + b * r, send, b);
    return LF_OK;
  }
  explicit FakeComm(int size) {
    std::memset(&base, 0, sizeof base);
    base.rank = 0;
    base.size = size;
    base.kind = "fake";
    base.allgather = allgather;
  }
};

TEST(MpiTp, ImpossibleSizeIsAClearError) {
  lf_shard sh;
  EXPECT_EQ(lf_shard_plan(0, 3, 4, 2, 160, 256, &sh), LF_ERR_INVALID_ARG);
  EXPECT_NE(std::string(lf_last_error()).find("T=3"), std::string::npos) << lf_last_error();
  EXPECT_NE(std::string(lf_last_error()).find("Hq=4"), std::string::npos) << lf_last_error();
  EXPECT_NE(std::string(lf_last_error()).find("Hkv=2"), std::string::npos) << lf_last_error();
  EXPECT_EQ(lf_shard_plan(0, 8, 4, 2, 160, 256, &sh), LF_ERR_INVALID_ARG); // 8 does not divide Hq
  EXPECT_EQ(lf_shard_plan(0, 6, 12, 4, 160, 256, &sh), LF_ERR_INVALID_ARG); // 6 % Hkv != 0
  ASSERT_EQ(lf_shard_plan(3, 4, 8, 2, 172, 512, &sh), LF_OK);               // replicated x2
  EXPECT_EQ(sh.kv0, 1);
  EXPECT_EQ(sh.n_kv, 1);
  EXPECT_EQ(sh.q0, 6);
  EXPECT_EQ(sh.cq0, 4);
  EXPECT_EQ(sh.n_cq, 4);
  EXPECT_EQ(sh.replicas, 2);
  EXPECT_EQ(sh.hid0 + sh.n_hid, 172);
  for (const Model &m : models()) {
    if (!m.present) continue;
    FakeComm fc(3);
    lf_engine_config cfg;
    lf_engine_config_default(&cfg);
    cfg.model_path = m.path.c_str();
    lf_engine_t e = nullptr;
    EXPECT_EQ(lf_engine_init(&cfg, &fc.base, &e), LF_ERR_INVALID_ARG) << m.path;
    EXPECT_EQ(e, nullptr);
    EXPECT_NE(std::string(lf_last_error()).find("T=3"), std::string::npos) << lf_last_error();
  }
}

size_t expected_bytes(const lf_model_config &c, const lf_shard &s, bool untied) {
  const size_t hd = c.head_dim, dim = c.dim;
  size_t per_layer = 2 * dim + s.n_cq * hd * dim + 2 * s.n_kv * hd * dim + dim * s.n_q * hd +
                     3 * (size_t)s.n_hid * dim;
  if (c.qkv_bias) per_layer += s.n_cq * hd + 2 * s.n_kv * hd;
  if (c.qk_norm) per_layer += 2 * hd;
  return 4 * ((untied ? 2 : 1) * (size_t)s.n_vocab * dim + c.n_layers * per_layer + dim);
}

TEST(MpiTp, EachRankLoadsItsShard) {
  std::vector<std::string> paths = {"random:tiny-llama:5"};
  for (const Model &m : models())
    if (m.fits) paths.push_back(m.path);
  for (const std::string &path : paths) {
    lf_checkpoint ck;
    ASSERT_EQ(lf_checkpoint_open(path.c_str(), &ck), LF_OK) << lf_last_error();
    const lf_model_config &c = ck.cfg;
    lf_shard sh;
    ASSERT_EQ(lf_shard_plan(g_comm->rank, g_comm->size, c.n_heads, c.n_kv_heads, c.hidden_dim,
                            c.vocab_size, &sh), LF_OK) << lf_last_error();
    lf_weights full{}, part{};
    ASSERT_EQ(lf_weights_load_f32(&ck, &full), LF_OK) << lf_last_error();
    ASSERT_EQ(lf_weights_load_f32_shard(&ck, &sh, &part), LF_OK) << lf_last_error();
    const bool untied = full.lm_head != full.embed;
    EXPECT_EQ(part.bytes, expected_bytes(c, sh, untied)) << path;
    EXPECT_EQ(full.bytes, expected_bytes(c, [&] {
                lf_shard w;
                lf_shard_plan(0, 1, c.n_heads, c.n_kv_heads, c.hidden_dim, c.vocab_size, &w);
                return w;
              }(), untied)) << path;
    // Only norms (and replicated KV / group queries) are repeated: about 1/T of the whole.
    const double share = (double)part.bytes / (double)full.bytes;
    if (g_comm->rank == 0)
      printf("%s: rank 0 holds %zu of %zu bytes (%.3f; 1/T = %.3f)\n", path.c_str(), part.bytes,
             full.bytes, share, 1.0 / g_comm->size);
    if (sh.replicas == 1) {
      EXPECT_LT(share, 1.0 / g_comm->size + 0.05) << path;
    }
    // The slices hold exactly the whole model's values at the same indices.
    const size_t hd = c.head_dim, dim = c.dim;
    for (int l = 0; l < c.n_layers; l++) {
      const lf_layer_weights &F = full.layers[l], &P = part.layers[l];
      ASSERT_EQ(std::memcmp(P.wq, F.wq + sh.cq0 * hd * dim, sh.n_cq * hd * dim * 4), 0) << path;
      ASSERT_EQ(std::memcmp(P.wk, F.wk + sh.kv0 * hd * dim, sh.n_kv * hd * dim * 4), 0) << path;
      for (size_t r = 0; r < dim; r++)
        ASSERT_EQ(std::memcmp(P.wo + r * sh.n_q * hd, F.wo + r * c.n_heads * hd + sh.q0 * hd,
                              sh.n_q * hd * 4), 0) << path;
      for (size_t r = 0; r < dim; r++)
        ASSERT_EQ(std::memcmp(P.w_down + r * sh.n_hid, F.w_down + r * c.hidden_dim + sh.hid0,
                              sh.n_hid * 4), 0) << path;
      ASSERT_EQ(std::memcmp(P.w_up, F.w_up + sh.hid0 * dim, sh.n_hid * dim * 4), 0) << path;
      if (c.qkv_bias) {
        ASSERT_EQ(std::memcmp(P.bq, F.bq + sh.cq0 * hd, sh.n_cq * hd * 4), 0);
      }
    }
    ASSERT_EQ(std::memcmp(part.lm_head, full.lm_head + sh.vocab0 * dim, sh.n_vocab * dim * 4), 0);
    lf_weights_free(&c, &full);
    lf_weights_free(&c, &part);
    lf_checkpoint_close(&ck);
  }
}

// After a step fails backend-wide, a tensor-parallel engine stays failed; here: a follower call
// on rank 0 and request calls on followers are state errors, not hangs.
TEST(MpiTp, RolesAreEnforced) {
  Model m{"", false, false};
  for (const Model &x : models())
    if (x.fits && !m.fits) m = x;
  if (!all_agree(m.fits)) GTEST_SKIP() << "no test model splits over " << g_comm->size << " ranks";
  lf_engine_config cfg;
  lf_engine_config_default(&cfg);
  cfg.model_path = m.path.c_str();
  lf_engine_t e = nullptr;
  ASSERT_EQ(lf_engine_init(&cfg, g_comm, &e), LF_OK) << lf_last_error();
  if (g_comm->rank == 0) {
    EXPECT_EQ(lf_engine_follow(e), LF_ERR_STATE);
  } else {
    lf_metrics mt;
    EXPECT_EQ(lf_engine_metrics(e, &mt), LF_ERR_STATE);
    EXPECT_EQ(lf_engine_busy(e), 0);
    EXPECT_EQ(lf_engine_follow(e), LF_OK) << lf_last_error();
  }
  lf_engine_free(e);
}

int die_scenario(int die_rank) {
  // Rank die_rank leaves right after start-up; rank 0 keeps stepping. The launcher must end the
  // job (non-zero) within seconds.
  std::string path = lf_repo_data_dir() + "/hf_tiny/llama";
  lf_engine_config cfg;
  lf_engine_config_default(&cfg);
  cfg.model_path = path.c_str();
  lf_engine_t e = nullptr;
  if (lf_engine_init(&cfg, g_comm, &e) != LF_OK) {
    fprintf(stderr, "rank %d: %s\n", g_comm->rank, lf_last_error());
    return 1;
  }
  if (g_comm->rank == die_rank) {
    fprintf(stderr, "rank %d: exiting on purpose\n", g_comm->rank);
    std::_Exit(3);
  }
  return lf_tp_test_serve_after_loss(e, g_comm->rank, prompt_of(8, 256, 0), 400, false);
}

} // namespace

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (lf_comm_init_mpi(&g_comm) != LF_OK) {
    fprintf(stderr, "rank %d: %s\n", rank, lf_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  for (int i = 1; i + 1 < argc; i++)
    if (!std::strcmp(argv[i], "--die-rank")) {
      int rc = die_scenario(std::atoi(argv[i + 1]));
      lf_comm_free(g_comm);
      if (rc == 0) MPI_Finalize();
      return rc;
    }
  ::testing::InitGoogleTest(&argc, argv);
  if (rank != 0) {
    auto &listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  } else {
    printf("%d ranks\n", g_comm->size);
  }
  int rc = RUN_ALL_TESTS();
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  lf_comm_free(g_comm);
  MPI_Finalize();
  return worst;
}

// Tensor parallelism on GPU ranks (NCCL, one GPU per rank, launched by mpiexec -np 2): the
// sharded cuda backend against a single-GPU cuda backend run on rank 0's GPU.
//
//  - Backend level, teacher-forced greedy decoding (both sides always get the single-GPU
//    token, so one near-tie does not end the comparison): every step's token must match, or
//    differ only where the single-GPU logits of the two tokens are within the numeric noise
//    measured on that step; logits within 2e-2 of the largest |logit|. Steps alternate between
//    asking for logits (the gathered-logits path) and not (the distributed argmax path). On the
//    tiny HF models (tests/data/hf_tiny: qwen3 has Hkv = 1, so T = 2 replicates its KV head),
//    random tiny models, and random:llama3-8b for 128 tokens.
//    Where the model is small, the fp32 CPU backend is the oracle too: TP's distance to it
//    must stay within 2x (mean) / 3x (worst) of the single GPU's distance to it.
//  - Engine level: lf_engine_init with the NCCL communicator (rank 0 leads, the other follows),
//    greedy tokens identical to the single-GPU engine on the HF tiny models; full and longflow.
//  - `mpi_gpu_tp --die-rank R` / `--hang-rank R` are not tests: rank R exits (or stops
//    following without exiting) after start-up; tests/mpi_gpu_tp_die.sh checks that the job
//    ends with an error within seconds (the hang case is caught by the NCCL deadline alone).
//
// Launch: `mpiexec -np 2 mpi_gpu_tp`, or without MPI `tests/tp_run.sh 2 mpi_gpu_tp` (the
// environment bootstrap, lf_comm_init_nccl_env). Agreement between ranks goes through the NCCL
// communicator's host path, so the test itself needs no MPI.
// Needs 2 visible GPUs; with fewer every rank prints why and exits 77 (ctest: skipped).
// Environment on NVLink H200s: NCCL_NVLS_ENABLE=0 (bench/run.sh sets it).
#include <gtest/gtest.h>
#ifdef LF_HAVE_MPI
#include <mpi.h>
#endif

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "engine/backend.h"
#include "engine/model.h"
#include "parallel/comm.h"
#include "test_util.h"
#include "tp_test_util.h"

namespace {

lf_comm_t g_comm = nullptr;

// rank 0's value on every rank
bool all_agree(bool v) {
  int32_t x = v ? 1 : 0;
  EXPECT_EQ(g_comm->bcast(g_comm, &x, sizeof x, 0, nullptr), LF_OK) << lf_last_error();
  return x != 0;
}

bool all_true(bool v) {
  int32_t x = v ? 1 : 0;
  EXPECT_EQ(g_comm->allreduce_sum(g_comm, &x, 1, LF_COMM_I32, nullptr), LF_OK) << lf_last_error();
  return x == g_comm->size;
}

std::vector<std::string> tiny_models() {
  std::vector<std::string> m = {"random:tiny-llama:5", "random:tiny-qwen3:7"};
  for (const char *n : {"llama", "qwen2", "qwen3"}) {
    std::string p = lf_repo_data_dir() + "/hf_tiny/" + n;
    if (all_agree(lf_path_exists(p + "/config.json"))) m.push_back(p);
  }
  return m;
}

std::vector<int32_t> prompt_of(int n, int vocab, int salt) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; i++) p[i] = (int32_t)((1 + 7 * i + 13 * salt) % vocab);
  return p;
}

// Teacher-forced comparison of the TP backend (all ranks) with a single-GPU one (rank 0).
// prompt_len 0: the default rule below. exact: every compared logit must equal the single GPU's
// bit for bit (and so every token). sampled: the TP backend gathers top-k candidates
// (LF_TP_TOPK=1), three steps of four sample (temperature, top-k, top-p, a fixed draw u) and
// the TP side asks for no logits, so sampling takes the candidate path; the tokens are compared.
void compare_backends(const std::string &path, lf_policy policy, int budget, int steps,
                      int prompt_len = 0, bool exact = false, bool sampled = false) {
  lf_checkpoint ck;
  ASSERT_EQ(lf_checkpoint_open(path.c_str(), &ck), LF_OK) << lf_last_error();
  const int vocab = ck.cfg.vocab_size;
  const bool lead = g_comm->rank == 0;
  lf_backend_params p{};
  p.policy = policy;
  p.budget = budget;
  p.sink = 2;
  p.window = 4;
  p.n_pools = 2;
  p.comm = g_comm;
  lf_backend *tp = nullptr, *ref = nullptr, *cpu = nullptr;
  if (sampled) setenv("LF_TP_TOPK", "1", 1);
  lf_status s = lf_backend_cuda_create(&ck, &p, &tp);
  if (sampled) unsetenv("LF_TP_TOPK");
  // a failure on one rank must not leave the other in a collective
  const bool all_ok = all_true(s == LF_OK);
  ASSERT_EQ(s, LF_OK) << lf_last_error();
  ASSERT_TRUE(all_ok);
  // The fp32 CPU backend is the oracle where it is quick (the tiny models): bf16 on the GPU
  // drifts from it by an amount the model decides (random weights amplify rounding more than
  // trained ones), so TP is judged by its distance to the CPU against the single GPU's.
  const bool with_cpu = lead && ck.cfg.dim <= 1024;
  if (lead) {
    p.comm = nullptr;
    ASSERT_EQ(lf_backend_cuda_create(&ck, &p, &ref), LF_OK) << lf_last_error();
    if (with_cpu) {
      p.n_threads = 4;
      ASSERT_EQ(lf_backend_cpu_create(&ck, &p, &cpu), LF_OK) << lf_last_error();
    }
  }
  int pa = -1, pb = -1, pc = -1;
  ASSERT_EQ(tp->pool_take(tp, &pa), LF_OK);
  if (lead) {
    ASSERT_EQ(ref->pool_take(ref, &pb), LF_OK);
    if (cpu) {
      ASSERT_EQ(cpu->pool_take(cpu, &pc), LF_OK);
    }
  }
  std::vector<int32_t> toks =
      prompt_of(prompt_len > 0 ? prompt_len : budget > 40 ? 24 : budget + 5, vocab, 3); // > B: SnapKV
  std::vector<float> la(vocab), lb(vocab), lc(vocab);
  int32_t pos = 0, n = (int32_t)toks.size();
  double worst = 0, last_diff = 0;               // TP vs single GPU
  double e_gpu = 0, e_tp = 0, w_gpu = 0, w_tp = 0; // each vs the CPU: sums and worst
  int mismatches = 0, near_ties = 0, logit_steps = 0;
  for (int step = 0; step < steps; step++) {
    lf_batch_item it{};
    it.pool = pa;
    it.pos0 = pos;
    it.n_tok = n;
    it.tokens = toks.data() + pos;
    if (sampled && step % 4 != 3) {
      it.sampling.temperature = step % 2 ? 0.8f : 1.3f;
      it.sampling.top_k = step % 3 == 0 ? 1024 : step % 3 == 1 ? 40 : 3;
      it.sampling.top_p = step % 5 == 0 ? 0.9f : 1.0f;
    }
    it.u = (float)std::fmod(0.3819660113 + 0.6180339887 * step, 1.0);
    lf_batch_result ra{}, rb{};
    // odd steps: the distributed argmax path; sampled runs: the top-k candidate path
    const bool want_logits = step % 2 == 0 && !sampled;
    // every rank makes the same forward calls whatever the checks say: non-fatal checks only
    EXPECT_EQ(tp->forward(tp, &it, 1, &ra, want_logits ? la.data() : nullptr), LF_OK)
        << lf_last_error();
    EXPECT_EQ(ra.status, LF_OK);
    int32_t next = ra.token;
    if (lead) {
      it.pool = pb;
      EXPECT_EQ(ref->forward(ref, &it, 1, &rb, lb.data()), LF_OK) << lf_last_error();
      float scale = 0, diff = 0;
      for (float v : lb) scale = std::fmax(scale, std::fabs(v));
      if (want_logits) {
        for (int i = 0; i < vocab; i++) diff = std::fmax(diff, std::fabs(la[i] - lb[i]));
        if (exact) {
          int differ = 0;
          for (int i = 0; i < vocab; i++) differ += std::memcmp(&la[i], &lb[i], sizeof(float)) != 0;
          EXPECT_EQ(differ, 0) << path << " step " << step << ": logits not bit-identical";
        }
        worst = std::fmax(worst, diff / std::fmax(scale, 1e-30f));
        last_diff = diff;
        logit_steps++;
        if (cpu) {
          lf_batch_result rc{};
          it.pool = pc;
          EXPECT_EQ(cpu->forward(cpu, &it, 1, &rc, lc.data()), LF_OK) << lf_last_error();
          float dg = 0, dt = 0;
          for (int i = 0; i < vocab; i++) {
            dg = std::fmax(dg, std::fabs(lb[i] - lc[i]));
            dt = std::fmax(dt, std::fabs(la[i] - lc[i]));
          }
          const double sc = std::fmax(scale, 1e-30f);
          e_gpu += dg / sc, e_tp += dt / sc;
          w_gpu = std::fmax(w_gpu, dg / sc), w_tp = std::fmax(w_tp, dt / sc);
        } else {
          EXPECT_LT(diff / std::fmax(scale, 1e-30f), 2e-2) << path << " step " << step;
        }
      } else if (cpu) {
        lf_batch_result rc{};
        it.pool = pc;
        EXPECT_EQ(cpu->forward(cpu, &it, 1, &rc, nullptr), LF_OK) << lf_last_error();
      }
      if (exact) {
        EXPECT_EQ(ra.token, rb.token) << path << " step " << step;
      }
      if (ra.token != rb.token) {
        mismatches++;
        // acceptable only at a near-tie: the single-GPU logits of the two tokens are closer
        // than the noise (the difference measured on this step, or on the last step that
        // compared logits when this one took the distributed argmax; at least 1e-3 of the
        // scale)
        const bool valid = ra.token >= 0 && ra.token < vocab;
        const float gap = lb[rb.token] - (valid ? lb[ra.token] : -1e30f);
        const float noise = std::fmax(3.0f * (float)std::fmax(diff, last_diff), 1e-3f * scale);
        if (gap <= noise) near_ties++;
        else
          ADD_FAILURE() << path << " step " << step << ": TP token " << ra.token << ", single-GPU "
                        << rb.token << ", logit gap " << gap << " > noise " << noise;
      }
      next = rb.token; // teacher forcing with the single-GPU token
    }
    EXPECT_EQ(g_comm->bcast(g_comm, &next, sizeof next, 0, nullptr), LF_OK) << lf_last_error();
    pos += n;
    n = 1;
    toks.push_back(next);
  }
  if (lead) {
    printf("%s %s: %d steps, worst logit difference %.2e of max |logit|, %d token mismatches "
           "(%d at near-ties)\n",
           path.c_str(), lf_policy_str(policy), steps, worst, mismatches, near_ties);
    if (cpu && logit_steps > 0) {
      e_gpu /= logit_steps, e_tp /= logit_steps;
      printf("    vs the fp32 cpu backend: single GPU mean %.2e worst %.2e; TP mean %.2e worst "
             "%.2e (of max |logit|)\n", e_gpu, w_gpu, e_tp, w_tp);
      // a TP defect shows as TP far from the CPU where the single GPU is close to it
      EXPECT_LE(e_tp, 2.0 * e_gpu + 1e-4) << path << " " << lf_policy_str(policy);
      EXPECT_LE(w_tp, 3.0 * w_gpu + 1e-3) << path << " " << lf_policy_str(policy);
      cpu->free(cpu);
    }
    /* Token agreement with the single GPU, beyond each mismatch being a near-tie: required
     * where nothing better judges TP. With the fp32 oracle and an evicting policy it is not: one
     * eviction near-tie decided the other way leaves the two caches different for the rest of
     * the run (teacher forcing fixes the tokens, not the pools), and on a random model the
     * count then measures luck (random:tiny-llama:5 longflow on 2 x H200: 4 mismatches with
     * NCCL, 19 with the fused IPC all-reduce, both as close to the fp32 CPU as the single GPU);
     * the oracle checks above are the verdict there. */
    if (!cpu || policy == LF_POLICY_FULL) {
      EXPECT_LE(mismatches, std::max(2, steps / 20)) << path;
    }
    ref->free(ref);
  }
  tp->free(tp);
  lf_checkpoint_close(&ck);
}

TEST(MpiGpuTp, TinyModelsMatchSingleGpu) {
  for (const std::string &m : tiny_models())
    for (lf_policy pol : {LF_POLICY_FULL, LF_POLICY_LONGFLOW})
      compare_backends(m, pol, pol == LF_POLICY_FULL ? 160 : 16, 120);
}

TEST(MpiGpuTp, Llama3_8bShapeMatchesSingleGpu) {
  size_t free_b = 0, total_b = 0;
  cudaMemGetInfo(&free_b, &total_b);
  // single-GPU reference (16 GB) + this rank's half (8 GB) on rank 0's GPU
  if (!all_agree(free_b > ((size_t)30 << 30))) GTEST_SKIP() << "needs ~30 GB free per GPU";
  compare_backends("random:llama3-8b", LF_POLICY_LONGFLOW, 256, 128);
}

// Batch-1 decoding after a prompt of at most 8 tokens (one GEMV-path prefill chunk) is
// bit-identical to one GPU when the fused IPC all-reduce is on: the only K-split products (O,
// down) run in 8 / T parts and the ranks' sums meet in the same tree as one GPU's 8 parts
// (engine/cuda_gemv.cuh, backend_cuda.cu gemm_res); everything else is row-parallel.
// Why the bit-identical batch-1 setting cannot run here, or "" (the same answer on every rank).
std::string exact_setting_missing() {
  size_t free_b = 0, total_b = 0;
  cudaMemGetInfo(&free_b, &total_b);
  if (!all_agree(free_b > ((size_t)30 << 30))) return "needs ~30 GB free per GPU";
  if (!all_agree(g_comm->ipc != nullptr) || 8 % g_comm->size)
    return "needs the IPC all-reduce (not LF_CUSTOM_AR=0) and T in 2, 4, 8";
  return "";
}

TEST(MpiGpuTp, Batch1ShortPromptIsBitIdentical) {
  if (const std::string why = exact_setting_missing(); !why.empty()) GTEST_SKIP() << why;
  compare_backends("random:llama3-8b", LF_POLICY_LONGFLOW, 64, 96, 7, true);
  compare_backends("random:llama3-8b", LF_POLICY_FULL, 256, 64, 5, true);
}

// Sampled decoding under TP with the top-k candidate gather (LF_TP_TOPK=1: each rank sends its
// k best (value, id) pairs instead of its logits slice): in the bit-identical batch-1 setting,
// every sampled token must equal the single GPU's, which samples from its whole logits.
TEST(MpiGpuTp, TopkSamplingMatchesSingleGpu) {
  if (const std::string why = exact_setting_missing(); !why.empty()) GTEST_SKIP() << why;
  compare_backends("random:llama3-8b", LF_POLICY_LONGFLOW, 64, 80, 6, true, true);
}

TEST(MpiGpuTp, EngineGreedyTokensMatchSingleGpu) {
  for (const std::string &m : tiny_models()) {
    // Free-running greedy decoding follows the first flipped near-tie into a different
    // continuation. The random tiny models (vocab 1024, flat logits, bf16 drift from the fp32
    // model of 1e-2 to 3e-1 of the largest logit, measured on the single GPU) meet one within
    // ~10-30 tokens whichever side is right; they are checked teacher-forced above, against
    // the CPU. The trained-shape HF models keep TP within 5e-4 of the single GPU: exact here.
    if (m.rfind("random:", 0) == 0) continue;
    for (lf_policy pol : {LF_POLICY_FULL, LF_POLICY_LONGFLOW}) {
      lf_engine_config cfg;
      lf_engine_config_default(&cfg);
      cfg.model_path = m.c_str();
      cfg.backend = LF_BACKEND_CUDA;
      cfg.policy = pol;
      cfg.evict_scope = LF_EVICT_HEAD; // TP-invariant; layer scope is rank-local
      cfg.budget = pol == LF_POLICY_FULL ? 160 : 16;
      cfg.n_pools = 2;
      cfg.sink = 2;
      cfg.window = 4;
      std::vector<TpGen> gens = {{prompt_of(9, 256, 0), 40, 0.0f, 0},
                               {prompt_of(23, 256, 1), 30, 0.0f, 0},
                               {prompt_of(5, 256, 2), 35, 0.8f, 7}}; // sampled: length only
      auto [tp, ref] = lf_tp_test_run_both(cfg, g_comm, gens);
      if (g_comm->rank != 0) continue;
      ASSERT_EQ(ref.size(), gens.size());
      for (size_t k = 0; k < gens.size(); k++) {
        EXPECT_EQ((int)tp[k].size(), gens[k].max_tokens) << m << " request " << k;
        if (gens[k].temperature > 0.0f) continue;
        if (pol == LF_POLICY_FULL) {
          EXPECT_EQ(tp[k], ref[k]) << m << " full request " << k;
          continue;
        }
        // longflow: an eviction decided by a score near-tie (the 1e-7 fp32 reordering of the
        // TP sums reaches the bf16 K/V) may pick another slot and the continuations part; the
        // tokens must agree at least until the pool has been evicting for a while.
        size_t same = 0;
        while (same < tp[k].size() && same < ref[k].size() && tp[k][same] == ref[k][same]) same++;
        if (same < ref[k].size())
          printf("%s longflow request %zu: TP equals one GPU for %zu of %zu tokens\n", m.c_str(),
                 k, same, ref[k].size());
        EXPECT_GE(same, (size_t)24) << m << " longflow request " << k;
      }
    }
  }
}

// Pools sized from free memory (n_pools 0): every rank ends up with the same count.
TEST(MpiGpuTp, PoolCountAgrees) {
  lf_engine_config cfg;
  lf_engine_config_default(&cfg);
  cfg.model_path = "random:tiny-llama:5";
  cfg.backend = LF_BACKEND_CUDA;
  cfg.budget = 64;
  cfg.mem_util = 0.002; // a few thousand tiny pools, not all of the GPU
  lf_engine_t e = nullptr;
  ASSERT_EQ(lf_engine_init(&cfg, g_comm, &e), LF_OK) << lf_last_error();
  if (g_comm->rank != 0) {
    EXPECT_EQ(lf_engine_follow(e), LF_OK) << lf_last_error();
  } else {
    lf_metrics mt;
    EXPECT_EQ(lf_engine_metrics(e, &mt), LF_OK);
  }
  lf_engine_free(e);
}

int die_scenario(int die_rank, bool hang) {
  lf_engine_config cfg;
  lf_engine_config_default(&cfg);
  cfg.model_path = "random:tiny-llama:5";
  cfg.backend = LF_BACKEND_CUDA;
  cfg.n_pools = 2;
  lf_engine_t e = nullptr;
  if (lf_engine_init(&cfg, g_comm, &e) != LF_OK) {
    fprintf(stderr, "rank %d: %s\n", g_comm->rank, lf_last_error());
    return 1;
  }
  if (g_comm->rank == die_rank) {
    if (hang) { // alive but gone from the protocol: only the NCCL deadline can notice
      fprintf(stderr, "rank %d: stopping without exiting\n", g_comm->rank);
      std::this_thread::sleep_for(std::chrono::seconds(600));
    }
    fprintf(stderr, "rank %d: exiting on purpose\n", g_comm->rank);
    std::_Exit(3);
  }
  return lf_tp_test_serve_after_loss(e, g_comm->rank, prompt_of(8, 256, 0), 1000, true);
}

} // namespace

int main(int argc, char **argv) {
  const bool env = getenv("LF_TP_RANK") != nullptr; // tests/tp_run.sh; else mpiexec
  int rank = env ? atoi(getenv("LF_TP_RANK")) : 0;
  int size = env && getenv("LF_TP_SIZE") ? atoi(getenv("LF_TP_SIZE")) : 1;
#ifdef LF_HAVE_MPI
  if (!env) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
  }
#endif
  auto finish = [&](int rc) {
#ifdef LF_HAVE_MPI
    if (!env) MPI_Finalize();
#endif
    return rc;
  };
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess) n_dev = 0;
  if (n_dev < 2 || size < 2 || size > n_dev) { // one node: every rank sees the same GPUs
    if (rank == 0)
      printf("mpi_gpu_tp: skipped: needs 2 ranks on 2 visible GPUs (ranks %d, GPUs %d)\n", size,
             n_dev);
    return finish(77);
  }
  lf_status s = env ? lf_comm_init_nccl_env(0.0, nullptr, &g_comm)
                    : lf_comm_init_nccl_mpi(0.0, nullptr, &g_comm);
  if (s != LF_OK) {
    fprintf(stderr, "rank %d: %s\n", rank, lf_last_error());
    std::_Exit(1); // the launcher ends the job
  }
  for (int i = 1; i + 1 < argc; i++)
    if (!std::strcmp(argv[i], "--die-rank") || !std::strcmp(argv[i], "--hang-rank")) {
      const int rc = die_scenario(std::atoi(argv[i + 1]), argv[i][2] == 'h');
      if (rc != 0) std::_Exit(rc);
      lf_comm_free(g_comm);
      return finish(0);
    }
  ::testing::InitGoogleTest(&argc, argv);
  if (rank != 0) {
    auto &listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  } else {
    printf("%d ranks, NCCL communicator (%s bootstrap)\n", g_comm->size, env ? "env" : "MPI");
  }
  int32_t rc = RUN_ALL_TESTS() ? 1 : 0;
  if (g_comm->allreduce_sum(g_comm, &rc, 1, LF_COMM_I32, nullptr) != LF_OK) std::_Exit(1);
  lf_comm_free(g_comm);
  return finish(rc ? 1 : 0);
}

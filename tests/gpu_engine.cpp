// The cuda engine backend against the cpu backend (the oracle); its kernels are tested against
// their CPU twins in tests/gpu_kernels.cpp. Label gpu: needs a CUDA device (skips without one).
//
// End to end: greedy tokens of both backends for the same prompt, through the backend
// interface (engine/backend.h), with `full` and with `longflow` at a small budget. The cuda
// backend keeps weights, activations fed to GEMMs and the KV cache in bf16, so the cpu side runs
// on a copy of the checkpoint whose matrices are rounded to bf16 (both then hold the same
// weights); what is left is activation and KV rounding. A run passes when the tokens agree over
// the compared length, or when they first differ at a genuine near-tie of the cpu logits (the
// first divergence and its margin are printed either way).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attention/attention.h"
#include "engine/backend.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/forward.h"
#include "engine/model.h"
#include "kernels/random_weights.h"
#include "engine/sample.h"
#include "lfserve.h"
#include "memory/pool.h"
#include "tests/gpu_util.h"
#include "test_util.h"

namespace {

// A copy of a checkpoint whose 2-D tensors are rounded to bf16 (1-D ones are shared).
struct Bf16Checkpoint {
  lf_checkpoint ck{};
  std::vector<std::vector<uint16_t>> store;
  bool make(const lf_checkpoint &src) {
    ck.cfg = src.cfg;
    ck.random_weights = src.random_weights;
    ck.random_seed = src.random_seed;
    store.reserve(src.tensors.n);
    for (int i = 0; i < src.tensors.n; i++) {
      lf_tensor_src t = src.tensors.t[i];
      if (t.ndim == 2) {
        const int64_t n = lf_tensor_numel(&t);
        std::vector<float> f(static_cast<size_t>(n));
        if (lf_tensor_read_f32(&t, 0, t.shape[0], 0, t.shape[1], f.data()) != LF_OK) return false;
        store.emplace_back(static_cast<size_t>(n));
        for (int64_t j = 0; j < n; j++) store.back()[size_t(j)] = lf_f32_to_bf16(f[size_t(j)]);
        t.data = store.back().data();
        t.dtype = LF_DTYPE_BF16;
      }
      if (lf_tensor_set_add(&ck.tensors, &t) != LF_OK) return false;
    }
    return true;
  }
  ~Bf16Checkpoint() { lf_tensor_set_free(&ck.tensors); }
};

struct Run {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits; // [step][vocab]
  uint64_t evictions = 0;
  int first_evict = -1; // first generated token whose step overwrote a slot
  int filled = 0;
  lf_status status = LF_OK;
};

// Greedy generation of n_gen tokens after `prompt`, one sequence (or several at once).
std::vector<Run> generate(lf_backend_kind kind, const lf_checkpoint &ck, lf_policy policy,
                          int budget, const std::vector<std::vector<int32_t>> &prompts, int n_gen,
                          int no_graphs = 0, lf_evict_scope scope = LF_EVICT_HEAD,
                          const std::vector<int> *layer_budget = nullptr) {
  const int ns = int(prompts.size());
  const int vocab = ck.cfg.vocab_size;
  lf_backend_params p = lf_test_backend_params(policy, budget, ns + 1);
  p.scope = scope;
  p.layer_budget = layer_budget ? layer_budget->data() : nullptr;
  p.rkv_stage = policy == LF_POLICY_RKV ? 8 : 0; // a selection every 8 steps
  p.no_graphs = no_graphs;
  lf_backend *b = nullptr;
  std::vector<Run> out(static_cast<size_t>(ns));
  lf_status s = lf_backend_create(kind, &ck, &p, &b);
  EXPECT_EQ(s, LF_OK) << lf_last_error();
  if (s != LF_OK) return out;
  std::vector<int> pools(static_cast<size_t>(ns));
  for (int i = 0; i < ns; i++) EXPECT_EQ(b->pool_take(b, &pools[size_t(i)]), LF_OK);
  std::vector<lf_batch_item> items(static_cast<size_t>(ns));
  std::vector<lf_batch_result> res(static_cast<size_t>(ns));
  std::vector<float> logits(static_cast<size_t>(ns) * vocab);
  std::vector<int32_t> last(static_cast<size_t>(ns));
  for (int step = 0; step < n_gen; step++) {
    for (int i = 0; i < ns; i++) {
      lf_batch_item &it = items[size_t(i)];
      it = lf_batch_item{};
      it.pool = pools[size_t(i)];
      if (step == 0) {
        it.pos0 = 0;
        it.n_tok = int(prompts[size_t(i)].size());
        it.tokens = prompts[size_t(i)].data();
      } else {
        it.pos0 = int32_t(prompts[size_t(i)].size()) + step - 1;
        it.n_tok = 1;
        it.tokens = &last[size_t(i)];
      }
    }
    s = b->forward(b, items.data(), ns, res.data(), logits.data());
    EXPECT_EQ(s, LF_OK) << lf_last_error();
    if (s != LF_OK) break;
    bool stop = false;
    for (int i = 0; i < ns; i++) {
      Run &r = out[size_t(i)];
      if (res[size_t(i)].status != LF_OK) {
        r.status = res[size_t(i)].status;
        stop = true;
        continue;
      }
      r.tokens.push_back(res[size_t(i)].token);
      r.logits.emplace_back(logits.begin() + size_t(i) * vocab,
                            logits.begin() + size_t(i + 1) * vocab);
      r.evictions += res[size_t(i)].evictions;
      if (res[size_t(i)].evictions && r.first_evict < 0) r.first_evict = int(r.tokens.size()) - 1;
      last[size_t(i)] = res[size_t(i)].token;
    }
    if (stop) break;
  }
  for (int i = 0; i < ns; i++) out[size_t(i)].filled = b->pool_slots_filled(b, pools[size_t(i)]);
  b->free(b);
  return out;
}

// Compares a cuda run with the cpu run over the first `exact` generated tokens (later ones are
// only reported): the logits must agree to bf16 accuracy, and the tokens must be equal or first
// differ at a near-tie, a cpu margin no larger than twice the logit difference seen at that
// step. Evicting runs are compared exactly only until the first eviction: each (layer, head)'s
// argmin may legitimately flip at near-ties of the scores, after which the pools differ (the
// eviction choice itself is checked on identical inputs in GpuKernels.DecodeAttnVsReference).
void compare(const Run &cpu, const Run &gpu, const std::string &what, size_t exact) {
  const size_t n = std::min(cpu.tokens.size(), gpu.tokens.size());
  size_t i = 0;
  while (i < n && cpu.tokens[i] == gpu.tokens[i]) i++;
  double max_rel = 0;
  auto rel = [&](size_t k, float *maxabs) {
    const auto &a = cpu.logits[k], &b = gpu.logits[k];
    double num = 0, den = 0;
    *maxabs = 0;
    for (size_t j = 0; j < a.size(); j++) {
      num += (a[j] - b[j]) * double(a[j] - b[j]);
      den += double(a[j]) * a[j];
      *maxabs = std::max(*maxabs, std::fabs(a[j] - b[j]));
    }
    return std::sqrt(num / std::max(den, 1e-30));
  };
  float mx = 0;
  for (size_t k = 0; k < std::min({i + 1, n, exact}); k++) max_rel = std::max(max_rel, rel(k, &mx));
  EXPECT_LT(max_rel, 0.15) << what << ": logits differ beyond bf16 accuracy";
  if (i == n) {
    printf("[ %s ] all %zu tokens equal (exact part %zu); rel logit error %.2e\n", what.c_str(),
           n, std::min(n, exact), max_rel);
    return;
  }
  const auto &a = cpu.logits[i];
  const float margin = a[size_t(cpu.tokens[i])] - a[size_t(gpu.tokens[i])];
  float diff_here = 0;
  rel(i, &diff_here);
  printf("[ %s ] first divergence at generated token %zu of %zu (exact part %zu; cpu %d, cuda "
         "%d): cpu logit margin %.4g, max |logit diff| there %.4g; rel logit error up to there "
         "%.2e\n",
         what.c_str(), i, n, std::min(n, exact), cpu.tokens[i], gpu.tokens[i], double(margin),
         double(diff_here), max_rel);
  if (i < exact) {
    EXPECT_LE(margin, 2.0f * diff_here) << what << ": divergence at " << i << " is not a near-tie";
  }
}

struct E2E {
  std::string name;
  lf_checkpoint src{};
  Bf16Checkpoint b16;
  bool open(const std::string &path) {
    name = path;
    lf_status s = lf_checkpoint_open(path.c_str(), &src);
    EXPECT_EQ(s, LF_OK) << lf_last_error();
    return s == LF_OK && b16.make(src);
  }
  ~E2E() { lf_checkpoint_close(&src); }

  // layer_budget: per-layer budgets (budget is then their mean; a prompt longer than the
  // smallest layer's room is compressed in some layers)
  void check(lf_policy policy, int budget, const std::vector<std::vector<int32_t>> &prompts,
             int n_gen, size_t want, lf_evict_scope scope = LF_EVICT_HEAD,
             const std::vector<int> *layer_budget = nullptr) {
    const lf_checkpoint &ck = src.random_weights ? src : b16.ck;
    auto cpu = generate(LF_BACKEND_CPU, ck, policy, budget, prompts, n_gen, 0, scope, layer_budget);
    auto gpu = generate(LF_BACKEND_CUDA, ck, policy, budget, prompts, n_gen, 0, scope, layer_budget);
    const int bmin =
        layer_budget ? *std::min_element(layer_budget->begin(), layer_budget->end()) : budget;
    for (size_t i = 0; i < prompts.size(); i++) {
      const std::string what = name + " " + lf_policy_str(policy) + " scope " +
                               lf_evict_scope_str(scope) + " B=" +
                               std::to_string(budget) + (layer_budget ? " per layer" : "") +
                               " seq " + std::to_string(i) + "/" +
                               std::to_string(prompts.size()) + " prompt " +
                               std::to_string(prompts[i].size());
      EXPECT_EQ(cpu[i].status, gpu[i].status) << what;
      const bool compressed = policy != LF_POLICY_FULL && int(prompts[i].size()) > bmin - 1;
      size_t exact = compressed ? 0 : want;
      if (policy != LF_POLICY_FULL && cpu[i].first_evict >= 0)
        exact = std::min(exact, size_t(cpu[i].first_evict));
      compare(cpu[i], gpu[i], what, exact);
      EXPECT_EQ(cpu[i].filled, gpu[i].filled) << what;
      EXPECT_EQ(cpu[i].evictions, gpu[i].evictions) << what;
    }
  }
};

std::vector<int32_t> prompt_of(int n, int vocab, uint64_t seed) {
  std::mt19937_64 r(seed);
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (auto &t : p) t = int32_t(r() % uint64_t(vocab));
  return p;
}

void e2e_model(const std::string &path) {
  E2E m;
  ASSERT_TRUE(m.open(path));
  const int V = m.src.cfg.vocab_size, ctx = m.src.cfg.max_seq_len;
  const int n_gen = std::min(220, ctx - 40);
  // full (budget = context), one sequence, then three at once (batched decode)
  m.check(LF_POLICY_FULL, ctx, {prompt_of(7, V, 1)}, n_gen, 200);
  m.check(LF_POLICY_FULL, ctx, {prompt_of(5, V, 2), prompt_of(12, V, 3), prompt_of(1, V, 4)},
          n_gen, 200);
  // longflow at a small budget: eviction every step after the pool fills
  m.check(LF_POLICY_LONGFLOW, 48, {prompt_of(9, V, 5), prompt_of(3, V, 6)}, n_gen, 200);
  // longflow with a prompt longer than the budget: SnapKV compression at prefill
  m.check(LF_POLICY_LONGFLOW, 64, {prompt_of(100, V, 7)}, std::min(n_gen, ctx - 110), 100);
  // the same two with layer scope (one slot per layer; layer-wide SnapKV)
  m.check(LF_POLICY_LONGFLOW, 48, {prompt_of(9, V, 5), prompt_of(3, V, 6)}, n_gen, 200,
          LF_EVICT_LAYER);
  m.check(LF_POLICY_LONGFLOW, 64, {prompt_of(100, V, 7)}, std::min(n_gen, ctx - 110), 100,
          LF_EVICT_LAYER);
  // h2o (the generic decode kernel, accumulators from the prefill's column sums on): per head
  // and per layer, a prompt that is appended and one SnapKV compresses
  m.check(LF_POLICY_H2O, 48, {prompt_of(9, V, 5), prompt_of(30, V, 6)}, n_gen, 200);
  m.check(LF_POLICY_H2O, 64, {prompt_of(100, V, 7)}, std::min(n_gen, ctx - 110), 100);
  m.check(LF_POLICY_H2O, 48, {prompt_of(9, V, 5), prompt_of(30, V, 6)}, n_gen, 200,
          LF_EVICT_LAYER);
  // rkv (stage 8: the generic decode kernel's window and queue, then the selection kernel's
  // due pass): per head and per layer, appended and compressed prompts
  m.check(LF_POLICY_RKV, 48, {prompt_of(9, V, 5), prompt_of(30, V, 6)}, n_gen, 200);
  m.check(LF_POLICY_RKV, 64, {prompt_of(100, V, 7)}, std::min(n_gen, ctx - 110), 100);
  m.check(LF_POLICY_RKV, 48, {prompt_of(9, V, 5), prompt_of(30, V, 6)}, n_gen, 200,
          LF_EVICT_LAYER);
  // full policy outgrowing its pool: LF_ERR_CONTEXT_FULL on both
  m.check(LF_POLICY_FULL, 16, {prompt_of(6, V, 8)}, 20, 10);
}

// Per-layer budgets (lf_backend_params.layer_budget): the layer-major device arena with one view
// per layer against the cpu reference, for each evicting policy the budgets serve: prompts that
// append everywhere and one that overflows the smallest layers (compressed there, appended in
// the larger ones), every layer evicting at its own point.
void e2e_layer_budgets(const std::string &path) {
  E2E m;
  ASSERT_TRUE(m.open(path));
  const int V = m.src.cfg.vocab_size, ctx = m.src.cfg.max_seq_len, L = m.src.cfg.n_layers;
  const int n_gen = std::min(220, ctx - 80);
  std::vector<int> lb(static_cast<size_t>(L));
  const int pattern[] = {36, 60, 44, 52};
  int sum = 0;
  for (int l = 0; l < L; l++) sum += lb[size_t(l)] = pattern[l % 4];
  const int B = sum / L;
  const std::vector<std::vector<int32_t>> fit = {prompt_of(9, V, 5), prompt_of(30, V, 6)};
  const std::vector<std::vector<int32_t>> over = {prompt_of(50, V, 7)};
  for (lf_policy pol : {LF_POLICY_LONGFLOW, LF_POLICY_H2O, LF_POLICY_RKV}) {
    m.check(pol, B, fit, n_gen, 200, LF_EVICT_HEAD, &lb);
    m.check(pol, B, fit, n_gen, 200, LF_EVICT_LAYER, &lb);
    m.check(pol, B, over, n_gen, 100, LF_EVICT_LAYER, &lb);
  }
}

TEST(GpuEngine, LayerBudgetsRandomTinyQwen3) {
  NEED_GPU();
  e2e_layer_budgets("random:tiny-qwen3:11");
}

TEST(GpuEngine, LayerBudgetsRandomTinyLlama) {
  NEED_GPU();
  e2e_layer_budgets("random:tiny-llama:7");
}

TEST(GpuEngine, Stories260K) {
  NEED_GPU();
  const std::string bin = lf_test_data_dir() + "/models/stories260K/stories260K.bin";
  if (!lf_path_exists(bin)) GTEST_SKIP() << "no " << bin;
  e2e_model(bin);
}

TEST(GpuEngine, HfTinyLlama) {
  NEED_GPU();
  e2e_model(lf_repo_data_dir() + "/hf_tiny/llama");
}

TEST(GpuEngine, HfTinyQwen2) {
  NEED_GPU();
  e2e_model(lf_repo_data_dir() + "/hf_tiny/qwen2");
}

TEST(GpuEngine, HfTinyQwen3) {
  NEED_GPU();
  e2e_model(lf_repo_data_dir() + "/hf_tiny/qwen3");
}

TEST(GpuEngine, RandomTinyLlama) {
  NEED_GPU();
  e2e_model("random:tiny-llama:7");
}

TEST(GpuEngine, RandomTinyQwen3FusedKernel) {
  NEED_GPU();
  e2e_model("random:tiny-qwen3:11");
}

// The decode step replayed from a CUDA graph gives the same bits as the eager pass: tokens,
// every logit and the eviction counts, over steps that evict, at batch sizes on the GEMV path
// (1, 3) and on the cuBLAS path (10).
TEST(GpuEngine, GraphReplayIsBitIdentical) {
  NEED_GPU();
  // GEMM algorithms chosen by timing may differ between two backends; each backend replays
  // its own choice, so compare with cuBLAS's fixed choice.
  setenv("LF_CUDA_GEMM_TUNE", "0", 1);
  for (const char *model : {"random:tiny-llama:7", "random:tiny-qwen3:11"}) {
    lf_checkpoint ck{};
    ASSERT_EQ(lf_checkpoint_open(model, &ck), LF_OK) << lf_last_error();
    const int V = ck.cfg.vocab_size;
    for (int ns : {1, 3, 10}) {
      std::vector<std::vector<int32_t>> prompts;
      for (int i = 0; i < ns; i++) prompts.push_back(prompt_of(2 + 5 * i % 17, V, 100 + i));
      auto eager = generate(LF_BACKEND_CUDA, ck, LF_POLICY_LONGFLOW, 40, prompts, 60, 1);
      auto graph = generate(LF_BACKEND_CUDA, ck, LF_POLICY_LONGFLOW, 40, prompts, 60, 0);
      for (int i = 0; i < ns; i++) {
        const auto &a = eager[size_t(i)], &b = graph[size_t(i)];
        ASSERT_EQ(a.tokens, b.tokens) << model << " batch " << ns << " seq " << i;
        ASSERT_EQ(a.logits.size(), b.logits.size());
        for (size_t k = 0; k < a.logits.size(); k++)
          ASSERT_EQ(0, std::memcmp(a.logits[k].data(), b.logits[k].data(),
                                   a.logits[k].size() * sizeof(float)))
              << model << " batch " << ns << " seq " << i << " step " << k;
        EXPECT_EQ(a.evictions, b.evictions);
        EXPECT_GT(a.evictions, 0u) << "the run should evict";
      }
    }
    lf_checkpoint_close(&ck);
  }
  unsetenv("LF_CUDA_GEMM_TUNE");
}

// Another engine of the same process (lfbench eval --jobs, an embedding application) may be
// capturing its decode step into a CUDA graph while this one is created or freed. Creation works
// beside any capture and leaves it valid. Freeing synchronizes the device (cudaFree), which would
// invalidate the capture, so it waits for lf_cuda_capture_lock, which every engine's capture holds:
// here the test holds it around its own capture, and the free on the other thread must not run
// (nor break the capture) until it is released.
TEST(GpuEngine, CreateAndFreeWhileAnotherEngineCaptures) {
  NEED_GPU();
  lf_checkpoint ck{};
  ASSERT_EQ(lf_checkpoint_open("random:tiny-llama:7", &ck), LF_OK) << lf_last_error();
  cudaStream_t cs = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking), cudaSuccess);
  float *buf = nullptr;
  ASSERT_EQ(cudaMalloc(&buf, 4096), cudaSuccess);
  lf_backend *b = nullptr;
  for (int phase = 0; phase < 2; phase++) { // 0: create, 1: free
    SCOPED_TRACE(phase ? "free" : "create");
    if (phase == 1) lf_cuda_capture_lock();
    ASSERT_EQ(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(buf, 0, 4096, cs), cudaSuccess);
    lf_status st = LF_OK;
    std::string err;
    std::atomic<int> freed{0};
    std::thread t([&] {
      if (phase == 0) {
        const lf_backend_params p = lf_test_backend_params(LF_POLICY_LONGFLOW, 64, 2);
        st = lf_backend_create(LF_BACKEND_CUDA, &ck, &p, &b);
        if (st != LF_OK) err = lf_last_error();
      } else {
        b->free(b);
        freed = 1;
      }
    });
    if (phase == 0) {
      t.join();
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(100)); // the free reaches the lock
      EXPECT_EQ(freed.load(), 0) << "the free did not wait for the capture";
    }
    cudaGraph_t g = nullptr;
    const cudaError_t e = cudaStreamEndCapture(cs, &g);
    if (phase == 1) {
      lf_cuda_capture_unlock();
      t.join();
      b = nullptr;
    }
    EXPECT_EQ(st, LF_OK) << err;
    EXPECT_EQ(e, cudaSuccess) << "the other engine's capture: " << cudaGetErrorString(e);
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
    if (!b && phase == 0) break;
  }
  if (b) b->free(b);
  cudaFree(buf);
  cudaStreamDestroy(cs);
  lf_checkpoint_close(&ck);
}

// n_pools == 0: the cuda backend sizes the pools from its free memory (a small mem_util here).
TEST(GpuEngine, PoolsFromDeviceMemory) {
  NEED_GPU();
  lf_checkpoint ck{};
  ASSERT_EQ(lf_checkpoint_open("random:tiny-llama:7", &ck), LF_OK);
  lf_backend_params p = lf_test_backend_params(LF_POLICY_LONGFLOW, 64, 0);
  p.mem_util = 0.002;
  size_t free_b = 0, total_b = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_b, &total_b), cudaSuccess);
  lf_backend *b = nullptr;
  ASSERT_EQ(lf_backend_create(LF_BACKEND_CUDA, &ck, &p, &b), LF_OK) << lf_last_error();
  const int n = b->pools_free(b);
  const lf_model_config &m = ck.cfg;
  const double pool = double(m.n_layers) * m.n_kv_heads * p.budget * m.head_dim * 4;
  printf("[ pools ] %d pools of >= %.0f KV bytes from %.2f GiB free at mem_util %g\n", n, pool,
         double(free_b) / (1 << 30), p.mem_util);
  EXPECT_GE(n, 1);
  EXPECT_LE(double(n) * pool, 0.002 * double(free_b));
  int id = -1;
  EXPECT_EQ(b->pool_take(b, &id), LF_OK);
  b->free(b);
  lf_checkpoint_close(&ck);
}

// kv_memory_bytes on the cuda backend: the pool count is what the device arena's own bytes per
// pool allow (bf16 K/V), not the CPU arena's fp32 size, which gave about half the pools.
TEST(GpuEngine, PoolsFromKvMemoryBytes) {
  NEED_GPU();
  lf_engine_config cfg;
  lf_engine_config_default(&cfg);
  cfg.model_path = "random:tiny-llama:7";
  cfg.backend = LF_BACKEND_CUDA;
  cfg.budget = 256;
  lf_checkpoint ck{};
  ASSERT_EQ(lf_checkpoint_open(cfg.model_path, &ck), LF_OK);
  const lf_pool_shape ps = {1, ck.cfg.n_layers, ck.cfg.n_kv_heads, cfg.budget, ck.cfg.head_dim, 0, 0, nullptr};
  lf_checkpoint_close(&ck);
  const uint64_t dev_pool = lf_pool_bytes_device(&ps, 0);
  ASSERT_LT(dev_pool, lf_pool_bytes(&ps) * 6 / 10); // bf16 against fp32: the sizes differ
  cfg.kv_memory_bytes = dev_pool * 20 + dev_pool / 3;
  cfg.mem_util = 0.9; // 18.3 pools
  lf_engine_t e = nullptr;
  ASSERT_EQ(lf_engine_init(&cfg, nullptr, &e), LF_OK) << lf_last_error();
  lf_metrics m;
  ASSERT_EQ(lf_engine_metrics(e, &m), LF_OK);
  EXPECT_EQ(m.pools_total, 18);
  lf_engine_free(e);
}

// Decode-step timing of the random 8B shapes (LF_GPU_BENCH=1 only): pools filled to budget-1
// by a prefill, then steps at batch 1 and 64 (host clock around forward(), which synchronises).
TEST(GpuBench, DecodeStepRandom8B) {
  NEED_GPU();
  if (!std::getenv("LF_GPU_BENCH")) GTEST_SKIP() << "set LF_GPU_BENCH=1";
  for (const char *model : {"random:llama3-8b", "random:qwen3-8b"}) {
    lf_checkpoint ck{};
    ASSERT_EQ(lf_checkpoint_open(model, &ck), LF_OK);
    const int budget = 1024, npool = 64;
    const lf_backend_params p = lf_test_backend_params(LF_POLICY_LONGFLOW, budget, npool);
    lf_backend *b = nullptr;
    auto t0 = std::chrono::steady_clock::now();
    ASSERT_EQ(lf_backend_create(LF_BACKEND_CUDA, &ck, &p, &b), LF_OK) << lf_last_error();
    const double t_load =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::vector<int> pools(npool);
    std::vector<std::vector<int32_t>> prompts(npool);
    std::vector<lf_batch_item> items(npool);
    std::vector<lf_batch_result> res(npool);
    std::vector<int32_t> last(npool);
    t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < npool; i++) {
      ASSERT_EQ(b->pool_take(b, &pools[size_t(i)]), LF_OK);
      prompts[size_t(i)] = prompt_of(budget - 1, ck.cfg.vocab_size, uint64_t(i));
      lf_batch_item it{};
      it.pool = pools[size_t(i)];
      it.n_tok = budget - 1;
      it.tokens = prompts[size_t(i)].data();
      ASSERT_EQ(b->forward(b, &it, 1, &res[0], nullptr), LF_OK) << lf_last_error();
      ASSERT_EQ(res[0].status, LF_OK);
      last[size_t(i)] = res[0].token;
    }
    const double t_prefill =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    int32_t pos = budget - 1;
    for (int bs : {1, 64}) {
      double best = 1e9, sum = 0;
      const int steps = 12;
      for (int st = 0; st < steps; st++) {
        for (int i = 0; i < bs; i++) {
          items[size_t(i)] = lf_batch_item{};
          items[size_t(i)].pool = pools[size_t(i)];
          items[size_t(i)].pos0 = pos;
          items[size_t(i)].n_tok = 1;
          items[size_t(i)].tokens = &last[size_t(i)];
        }
        t0 = std::chrono::steady_clock::now();
        ASSERT_EQ(b->forward(b, items.data(), bs, res.data(), nullptr), LF_OK) << lf_last_error();
        const double dt =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (st >= 2) {
          best = std::min(best, dt);
          sum += dt;
        }
        for (int i = 0; i < bs; i++) last[size_t(i)] = res[size_t(i)].token;
        pos++;
      }
      printf("[ bench ] %s budget %d batch %d: decode step %.3f ms (min), %.3f ms (mean of %d); "
             "create %.1f s, %d prefills of %d tokens %.2f s\n",
             model, budget, bs, best * 1e3, sum / (steps - 2) * 1e3, steps - 2, t_load, npool,
             budget - 1, t_prefill);
    }
    b->free(b);
    lf_checkpoint_close(&ck);
  }
}

} // namespace

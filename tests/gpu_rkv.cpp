// rkv's selection kernel (attention/rkv_select.cu, lf_cuda_rkv_select) against its CPU twin
// (lf_attn_rkv_select_ref): pools with look-alike keys (a quarter of the keys near copies of an
// earlier or later one, so the most-recent-look-alike rule matters; in the `near` cases at a
// cosine within 2e-3 of the threshold, where the kernel's tensor-core scan must hand the pair to
// its fp64 check), sharp and flat attention mass, positions out of slot order, head and layer
// scope, every KV dtype, head_dims that are not multiples of 16 or 8, with and without key means
// (the rows plus the mean compared). Every
// candidate's total must agree to 1e-12 (relative; the kernel divides the dot by the norms, the
// twin normalizes the rows first), the non-candidates must be NaN on both, and each queue entry
// must be the twin's wherever the twin's totals around it are not within 1e-9 of each other
// (a near tie may go either way), and a candidate in any case; since must become 0.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "attention/attention.h"
#include "attention/rkv_select.cuh"
#include "base/kvq.h"
#include "gpu_util.h"
#include "memory/pool.h"

namespace {

struct Case {
  int budget, n, n_kv, heads_per_scope, group, sink, stage, head_dim;
  lf_kv_dtype dtype;
  uint64_t seed;
  bool near = false; // look-alikes at a cosine of 0.5 +- 2e-3 before rounding
  int ws_blocks = 0;  // over LF_CUDA_RKV_SMEM_BUDGET: a workspace of this many blocks' room (0:
                      // lf_cuda_rkv_select_ws_bytes's)
  bool mean = false;  // a key mean per head: the pool stores key - mean, both sides add it back
};

void run_case(const Case &c) {
  SCOPED_TRACE("budget " + std::to_string(c.budget) + " n " + std::to_string(c.n) + " kv " +
               std::to_string(c.n_kv) + " per scope " + std::to_string(c.heads_per_scope) +
               " stage " + std::to_string(c.stage) + " " + lf_kv_dtype_str(c.dtype) +
               (c.mean ? " key mean" : ""));
  const int B = c.budget, D = c.head_dim, H = c.n_kv;
  std::mt19937_64 g(c.seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  // positions: distinct, with gaps, out of slot order (the same in every head of a layer)
  std::vector<int32_t> order(c.n);
  for (int i = 0; i < c.n; i++) order[i] = 3 * i + int(g() % 3);
  std::shuffle(order.begin(), order.end(), g);
  std::vector<int32_t> pos(size_t(H) * B, -1);
  std::vector<float> k(size_t(H) * B * D, 0.f), acc(size_t(H) * B, 0.f);
  // the values the pool reads back: bf16-rounded, or a quantized row's codes under its meta
  const bool quant = c.dtype != LF_KV_BF16;
  const int kf = lf_kvq_k_row(c.dtype); /* the selection reads K rows only (k8v4: int8) */
  const size_t cb = quant ? size_t(lf_kvq_code_bytes(kf, D)) : 0,
               mw = quant ? size_t(lf_kvq_meta_words(kf, D)) : 0;
  std::vector<uint16_t> kb(size_t(H) * B * D, 0);
  std::vector<uint8_t> kq(size_t(H) * B * cb, 0);
  std::vector<uint32_t> ks(size_t(H) * B * mw, 0);
  for (int h = 0; h < H; h++)
    for (int i = 0; i < c.n; i++) {
      pos[size_t(h) * B + i] = order[i];
      float *r = &k[(size_t(h) * B + i) * D];
      const int like = i > 4 && g() % 4 == 0 ? int(g() % uint64_t(i)) : -1;
      if (like >= 0 && c.near) { // cos(theta) u + sin(theta) w, w a unit vector normal to u
        const float *u = &k[(size_t(h) * B + like) * D];
        double uu = 0, uw = 0, ww = 0;
        std::vector<double> w(D);
        for (int d = 0; d < D; d++) w[d] = nd(g), uu += double(u[d]) * u[d], uw += double(u[d]) * w[d];
        for (int d = 0; d < D; d++) w[d] -= uw / uu * u[d], ww += w[d] * w[d];
        const double ct = 0.5 + 4e-3 * (ud(g) - 0.5), st = std::sqrt(1 - ct * ct);
        for (int d = 0; d < D; d++) r[d] = float(ct * u[d] + st * std::sqrt(uu / ww) * w[d]);
      } else {
        for (int d = 0; d < D; d++)
          r[d] = like >= 0 ? k[(size_t(h) * B + like) * D + d] + 0.3f * nd(g) : nd(g) * (d % 7 ? 1.f : 4.f);
      }
      // a few slots take most of the mass (sharp), the rest a little
      acc[size_t(h) * B + i] = g() % 10 == 0 ? 2.f + 3.f * ud(g) : 0.05f * ud(g);
    }
  // key means (lf_engine_config.key_means): of the keys' size, so cosines of the stored rows
  // alone would choose other look-alikes; the pool stores key - mean
  std::vector<float> mu(c.mean ? size_t(H) * D : 0);
  for (size_t i = 0; i < mu.size(); i++) mu[i] = 1.5f * nd(g) + (i % 5 == 0 ? 2.f : 0.f);
  if (c.mean)
    for (int h = 0; h < H; h++)
      for (int i = 0; i < c.n; i++)
        for (int d = 0; d < D; d++) k[(size_t(h) * B + i) * D + d] -= mu[size_t(h) * D + d];
  for (size_t row = 0; row < size_t(H) * B; row++) {
    float *r = &k[row * D];
    if (quant) {
      lf_kvq_encode_row(kf, r, D, &kq[row * cb], &ks[row * mw]);
      for (int d = 0; d < D; d++) r[d] = lf_kvq_row_value(kf, &kq[row * cb], &ks[row * mw], d);
    } else {
      for (int d = 0; d < D; d++) {
        r[d] = bfr(r[d]);
        uint32_t u;
        std::memcpy(&u, &r[d], 4);
        kb[row * D + d] = uint16_t(u >> 16);
      }
    }
  }

  // the CPU twin, scope by scope
  lf_attn_params p{};
  p.policy = LF_POLICY_RKV;
  p.sink = c.sink;
  p.group = c.group;
  p.head_dim = D;
  p.scale = 1.f / std::sqrt(float(D));
  p.scope = c.heads_per_scope > 1 ? LF_EVICT_LAYER : LF_EVICT_HEAD;
  p.rkv_stage = c.stage;
  std::vector<float> v(size_t(B) * D, 0.f), vnorm(B, 0.f);
  std::vector<int32_t> nn(H, c.n), next(H, -1), queue(size_t(H) * c.stage, -1), since(H, 5);
  std::vector<lf_kv_head> heads(H);
  for (int h = 0; h < H; h++) {
    lf_kv_head &kh = heads[h];
    kh.k = &k[size_t(h) * B * D];
    kh.v = v.data();
    kh.pos = &pos[size_t(h) * B];
    kh.vnorm = vnorm.data();
    kh.acc = &acc[size_t(h) * B];
    kh.n = &nn[h];
    kh.next = &next[h];
    kh.queue = &queue[size_t(h) * c.stage];
    kh.since = &since[h];
    kh.stage = c.stage;
    kh.budget = B;
    kh.head_dim = D;
    kh.kv_dtype = c.dtype;
    kh.k_mean = c.mean ? &mu[size_t(h) * D] : nullptr;
  }
  const int scopes = H / c.heads_per_scope;
  std::vector<double> want(size_t(scopes) * B);
  for (int s = 0; s < scopes; s++)
    ASSERT_EQ(lf_attn_rkv_select_ref(&p, &heads[size_t(s) * c.heads_per_scope], c.heads_per_scope,
                                     &want[size_t(s) * B]),
              LF_OK)
        << lf_last_error();

  // the kernel on the same pool (one pool, one layer)
  void *dk = nullptr;
  float *dscale = nullptr, *dacc = nullptr;
  int32_t *dpos = nullptr, *dn = nullptr, *dnext = nullptr, *dq = nullptr, *dsince = nullptr,
          *dids = nullptr;
  double *dtot = nullptr;
  const size_t kbytes = quant ? kq.size() : kb.size() * 2;
  CK(cudaMalloc(&dk, kbytes));
  CK(cudaMemcpy(dk, quant ? (const void *)kq.data() : (const void *)kb.data(), kbytes,
                cudaMemcpyHostToDevice));
  if (quant) {
    CK(cudaMalloc(&dscale, ks.size() * 4));
    CK(cudaMemcpy(dscale, ks.data(), ks.size() * 4, cudaMemcpyHostToDevice));
  }
  CK(cudaMalloc(&dacc, acc.size() * 4));
  CK(cudaMemcpy(dacc, acc.data(), acc.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&dpos, pos.size() * 4));
  CK(cudaMemcpy(dpos, pos.data(), pos.size() * 4, cudaMemcpyHostToDevice));
  const std::vector<int32_t> n_dev(H, c.n), neg(H, -1), since0(H, 5), ids{0};
  CK(cudaMalloc(&dn, H * 4));
  CK(cudaMemcpy(dn, n_dev.data(), H * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&dnext, H * 4));
  CK(cudaMemcpy(dnext, neg.data(), H * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&dq, queue.size() * 4));
  CK(cudaMemset(dq, 0xff, queue.size() * 4));
  CK(cudaMalloc(&dsince, H * 4));
  CK(cudaMemcpy(dsince, since0.data(), H * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&dids, 4));
  CK(cudaMemcpy(dids, ids.data(), 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&dtot, want.size() * 8));
  float *dmu = nullptr;
  if (c.mean) {
    CK(cudaMalloc(&dmu, mu.size() * 4));
    CK(cudaMemcpy(dmu, mu.data(), mu.size() * 4, cudaMemcpyHostToDevice));
  }
  // budgets over shared memory: the arrays in a workspace, fewer blocks than scopes if asked
  size_t ws_bytes = lf_cuda_rkv_select_ws_bytes(B, scopes);
  if (c.ws_blocks > 0) ws_bytes = size_t(c.ws_blocks) * lf_cuda_rkv_select_ws_bytes(B, 1);
  EXPECT_EQ(ws_bytes > 0, B > LF_CUDA_RKV_SMEM_BUDGET);
  void *dws = nullptr;
  if (ws_bytes) {
    CK(cudaMalloc(&dws, ws_bytes));
  }
  lf_rkv_select_args a{};
  a.ws = dws;
  a.ws_bytes = ws_bytes;
  a.pool.k = dk;
  a.pool.k_scale = dscale;
  a.pool.pos = dpos;
  a.pool.acc = dacc;
  a.pool.n = dn;
  a.pool.next = dnext;
  a.pool.n_layers = 1;
  a.pool.n_kv_heads = H;
  a.pool.budget = B;
  a.pool.head_dim = D;
  a.pool.kv_dtype = c.dtype;
  a.layer = 0;
  a.n_scopes = scopes;
  a.pool_ids = dids;
  a.heads_per_scope = c.heads_per_scope;
  a.group = c.group;
  a.sink = c.sink;
  a.pool.stage = c.stage;
  a.pool.queue = dq;
  a.pool.since = dsince;
  a.totals = dtot;
  a.k_mean = dmu;
  ASSERT_EQ(lf_cuda_rkv_select(&a, nullptr), LF_OK) << lf_last_error();
  CK(cudaDeviceSynchronize());
  std::vector<double> got(want.size());
  std::vector<int32_t> gq(queue.size()), gs(H);
  CK(cudaMemcpy(got.data(), dtot, got.size() * 8, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(gq.data(), dq, gq.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(gs.data(), dsince, H * 4, cudaMemcpyDeviceToHost));
  for (void *ptr : {dk, (void *)dscale, (void *)dacc, (void *)dpos, (void *)dn, (void *)dnext,
                    (void *)dq, (void *)dsince, (void *)dids, (void *)dtot, dws, (void *)dmu})
    cudaFree(ptr);

  int ties = 0;
  for (int s = 0; s < scopes; s++) {
    const double *w = &want[size_t(s) * B], *gt = &got[size_t(s) * B];
    std::vector<std::pair<double, int>> cand;
    for (int i = 0; i < B; i++) {
      ASSERT_EQ(std::isnan(w[i]), std::isnan(gt[i])) << "scope " << s << " slot " << i;
      if (std::isnan(w[i])) continue;
      ASSERT_NEAR(gt[i], w[i], 1e-12 * std::max(1.0, std::fabs(w[i]))) << "scope " << s << " slot " << i;
      if (i >= c.sink) cand.push_back({w[i], i});
    }
    ASSERT_EQ(int(cand.size()), c.n - LF_RKV_OBS - std::min(c.sink, c.n)) << "scope " << s;
    std::sort(cand.begin(), cand.end());
    for (int h = s * c.heads_per_scope; h < (s + 1) * c.heads_per_scope; h++) {
      EXPECT_EQ(gs[h], 0) << "head " << h;
      EXPECT_EQ(since[h], 0) << "head " << h;
      for (int r = 0; r < c.stage; r++) {
        const int gotq = gq[size_t(h) * c.stage + r], wantq = queue[size_t(h) * c.stage + r];
        EXPECT_EQ(wantq, cand[r].second);
        const bool near_prev = r > 0 && cand[r].first - cand[r - 1].first < 1e-9;
        const bool near_next = r + 1 < int(cand.size()) && cand[r + 1].first - cand[r].first < 1e-9;
        if (near_prev || near_next) {
          ties++;
          EXPECT_TRUE(std::any_of(cand.begin(), cand.end(), [&](auto &x) { return x.second == gotq; }))
              << "head " << h << " rank " << r;
        } else {
          EXPECT_EQ(gotq, wantq) << "head " << h << " rank " << r;
        }
      }
    }
  }
  EXPECT_LT(ties, c.stage) << "near ties should be rare on these pools";
}

TEST(GpuRkv, SelectionMatchesCpuTwin) {
  NEED_GPU();
  const Case cases[] = {
      {64, 64, 2, 1, 1, 4, 8, 64, LF_KV_BF16, 1},      // full pool, head scope
      {128, 71, 3, 1, 3, 4, 32, 64, LF_KV_BF16, 2},    // partly filled, group 3
      {256, 256, 4, 4, 2, 4, 32, 128, LF_KV_BF16, 3},  // layer scope, head_dim 128
      {300, 300, 3, 3, 3, 0, 17, 64, LF_KV_INT8, 4},   // int8 codes, sink 0, odd stage
      {1024, 1024, 2, 1, 4, 4, 32, 128, LF_KV_BF16, 5}, // a serving budget
      {4096, 4096, 1, 1, 1, 4, 64, 64, LF_KV_BF16, 6}, // the largest in shared memory
      {6000, 6000, 3, 1, 2, 4, 64, 64, LF_KV_BF16, 16}, // the arrays in the workspace
      {5000, 4900, 4, 1, 2, 4, 32, 128, LF_KV_INT8, 17, true, 2}, // 4 scopes through 2 blocks
      {4500, 4500, 2, 2, 2, 4, 32, 64, LF_KV_INT4, 18}, // workspace, layer scope, int4 split
      {1024, 1024, 2, 1, 4, 4, 32, 128, LF_KV_BF16, 7, true}, // cosines at the threshold
      {512, 512, 2, 2, 2, 4, 32, 128, LF_KV_FP8, 8},   // fp8 codes, layer scope
      {300, 300, 2, 1, 2, 4, 16, 64, LF_KV_INT8, 9, true},  // int8 at the threshold
      {256, 250, 2, 1, 2, 4, 16, 64, LF_KV_INT4, 10},  // int4: the two-term bf16 split
      {384, 384, 2, 1, 2, 4, 16, 128, LF_KV_INT4, 11, true}, // int4 at the threshold
      {300, 300, 2, 1, 2, 4, 16, 64, LF_KV_K8V4, 15, true},  // k8v4: its int8 K rows
      {200, 200, 2, 1, 1, 4, 16, 8, LF_KV_BF16, 12},   // head_dim 8 (stories260K)
      {300, 297, 1, 1, 1, 4, 8, 72, LF_KV_BF16, 13, true}, // head_dim 72: not whole k steps
      {128, 128, 2, 1, 1, 4, 8, 36, LF_KV_BF16, 14},   // head_dim 36: not whole 16-byte chunks
  };
  for (const Case &c : cases) run_case(c);
}

// With key means (the engine's --key-means): every dtype's rows plus the mean, through the
// two-term split scan (bf16 pools leave their asynchronous copies), at and away from the
// threshold, in shared memory and in the workspace, head and layer scope.
TEST(GpuRkv, SelectionWithKeyMeansMatchesCpuTwin) {
  NEED_GPU();
  Case cases[] = {
      {256, 256, 2, 1, 2, 4, 16, 128, LF_KV_BF16, 21},
      {384, 384, 2, 1, 2, 4, 16, 128, LF_KV_BF16, 22, true},
      {300, 297, 2, 2, 3, 4, 17, 64, LF_KV_INT8, 23, true},
      {512, 512, 2, 2, 2, 4, 32, 128, LF_KV_FP8, 24},
      {384, 384, 2, 1, 2, 4, 16, 128, LF_KV_INT4, 25, true},
      {300, 300, 2, 1, 3, 0, 16, 64, LF_KV_K8V4, 26, true},
      {1024, 1024, 3, 3, 3, 4, 32, 64, LF_KV_INT4, 27}, // SmolLM2's heads, layer scope
      {4500, 4500, 2, 2, 2, 4, 32, 64, LF_KV_INT4, 28}, // workspace
      {300, 297, 1, 1, 1, 4, 8, 72, LF_KV_BF16, 29, true}, // head_dim 72
  };
  for (Case &c : cases) {
    c.mean = true;
    run_case(c);
  }
}

// Engines in other threads launch the selection with other budgets at the same time (lfbench
// eval --jobs runs one engine per thread): no launch may fail for another's shared-memory limit.
TEST(GpuRkv, ConcurrentLaunchesWithOtherBudgets) {
  NEED_GPU();
  struct Side {
    int B;
    void *k = nullptr;
    float *acc = nullptr;
    int32_t *pos = nullptr, *n = nullptr, *next = nullptr, *q = nullptr, *since = nullptr,
            *ids = nullptr;
    cudaStream_t st = nullptr;
  };
  Side sides[2];
  sides[0].B = 96;
  sides[1].B = 3000;
  const int D = 64, S = 8;
  for (Side &sd : sides) {
    std::vector<uint16_t> k(size_t(sd.B) * D);
    std::mt19937_64 g(uint64_t(sd.B));
    for (auto &x : k) x = uint16_t(0x3c00 + g() % 512); // bf16 values in [0.008, 0.03) and signs +
    std::vector<int32_t> pos(sd.B);
    for (int i = 0; i < sd.B; i++) pos[i] = i;
    CK(cudaMalloc(&sd.k, k.size() * 2));
    CK(cudaMemcpy(sd.k, k.data(), k.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&sd.acc, size_t(sd.B) * 4));
    CK(cudaMemset(sd.acc, 0, size_t(sd.B) * 4));
    CK(cudaMalloc(&sd.pos, size_t(sd.B) * 4));
    CK(cudaMemcpy(sd.pos, pos.data(), size_t(sd.B) * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&sd.n, 4));
    CK(cudaMemcpy(sd.n, &sd.B, 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&sd.next, 4));
    CK(cudaMalloc(&sd.q, S * 4));
    CK(cudaMalloc(&sd.since, 4));
    CK(cudaMalloc(&sd.ids, 4));
    CK(cudaMemset(sd.ids, 0, 4));
    CK(cudaStreamCreate(&sd.st));
  }
  std::atomic<int> failures{0};
  auto work = [&](Side &sd) {
    lf_rkv_select_args a{};
    a.pool.k = sd.k;
    a.pool.pos = sd.pos;
    a.pool.acc = sd.acc;
    a.pool.n = sd.n;
    a.pool.next = sd.next;
    a.pool.n_layers = 1;
    a.pool.n_kv_heads = 1;
    a.pool.budget = sd.B;
    a.pool.head_dim = D;
    a.pool.kv_dtype = LF_KV_BF16;
    a.n_scopes = 1;
    a.pool_ids = sd.ids;
    a.heads_per_scope = 1;
    a.group = 1;
    a.sink = 4;
    a.pool.stage = S;
    a.pool.queue = sd.q;
    a.pool.since = sd.since;
    for (int r = 0; r < 200; r++)
      if (lf_cuda_rkv_select(&a, sd.st) != LF_OK) failures++;
    if (cudaStreamSynchronize(sd.st) != cudaSuccess) failures++;
  };
  std::thread t0(work, std::ref(sides[0])), t1(work, std::ref(sides[1]));
  t0.join();
  t1.join();
  EXPECT_EQ(failures.load(), 0) << lf_last_error();
  for (Side &sd : sides) {
    int32_t since = -1;
    CK(cudaMemcpy(&since, sd.since, 4, cudaMemcpyDeviceToHost));
    EXPECT_EQ(since, 0);
    for (void *ptr : {sd.k, (void *)sd.acc, (void *)sd.pos, (void *)sd.n, (void *)sd.next,
                      (void *)sd.q, (void *)sd.since, (void *)sd.ids})
      cudaFree(ptr);
    cudaStreamDestroy(sd.st);
  }
}

TEST(GpuRkv, RefusesWhatItCannotRun) {
  NEED_GPU();
  lf_rkv_select_args a{};
  EXPECT_EQ(lf_cuda_rkv_select(&a, nullptr), LF_ERR_INVALID_ARG);
  int32_t *d = nullptr;
  CK(cudaMalloc(&d, 64));
  a.pool.k = d;
  a.pool.pos = d;
  a.pool.acc = (float *)d;
  a.pool.n = d;
  a.pool_ids = d;
  a.pool.queue = d;
  a.pool.since = d;
  a.pool.budget = LF_CUDA_RKV_MAX_BUDGET + 1;
  a.pool.head_dim = 64;
  a.pool.n_layers = 1;
  a.pool.n_kv_heads = 2;
  a.heads_per_scope = 1;
  a.n_scopes = 1;
  a.pool.stage = 4;
  a.group = 1;
  EXPECT_EQ(lf_cuda_rkv_select(&a, nullptr), LF_ERR_INVALID_ARG);
  EXPECT_NE(std::string(lf_last_error()).find("budget"), std::string::npos) << lf_last_error();
  a.pool.budget = LF_CUDA_RKV_SMEM_BUDGET + 1; // over shared memory, without a workspace
  EXPECT_EQ(lf_cuda_rkv_select(&a, nullptr), LF_ERR_INVALID_ARG);
  EXPECT_NE(std::string(lf_last_error()).find("workspace"), std::string::npos) << lf_last_error();
  a.ws = d;
  a.ws_bytes = 64; // too small for one block's arrays
  EXPECT_EQ(lf_cuda_rkv_select(&a, nullptr), LF_ERR_INVALID_ARG);
  a.ws = nullptr;
  a.ws_bytes = 0;
  a.pool.budget = 64;
  a.heads_per_scope = 3; // does not divide 2 KV heads
  EXPECT_EQ(lf_cuda_rkv_select(&a, nullptr), LF_ERR_INVALID_ARG);
  cudaFree(d);
}

} // namespace

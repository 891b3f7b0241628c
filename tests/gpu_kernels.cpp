// The CUDA kernels of kernels/ and the KV slot write (attention/kv_write.cuh) against their CPU
// twins (engine/forward.h, engine/sample.h, kernels/random_weights.h, engine/tp.h, or a plain
// host loop) on fresh random inputs with poisoned outputs: exact where the arithmetic is exact,
// else within a stated tolerance. The attention kernels are in gpu_attention.cpp and
// gpu_decode_attn.cpp. Label gpu: needs a CUDA device (skips without one).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention/kv_write.cuh"
#include "engine/forward.h"
#include "engine/model.h"
#include "kernels/random_weights.h"
#include "engine/sample.h"
#include "kernels/embed.cuh"
#include "kernels/gemv.cuh"
#include "kernels/random_weights.cuh"
#include "kernels/rmsnorm.cuh"
#include "kernels/sample.cuh"
#include "kernels/silu_mul.cuh"
#include "kernels/tp_select.cuh"
#include "lfserve.h"
#include "parallel/shard.h"
#include "tests/gpu_util.h"
#include "test_util.h"

namespace {

TEST(GpuKernels, RandomWeightsMatchHost) {
  NEED_GPU();
  const size_t n = 100003;
  uint16_t *d = dev<uint16_t>(n);
  ASSERT_EQ(lf_cuda_random_bf16(d, n, 42, LF_RW_LAYER(3, LF_RW_WK), 0.05f, 17, nullptr), LF_OK);
  std::vector<uint16_t> h(n);
  CK(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n; i++)
    ASSERT_EQ(bf(h[i]), lf_rw_value(42, LF_RW_LAYER(3, LF_RW_WK), LF_RW_MATRIX, 0.05f, 17 + i))
        << i;
  cudaFree(d);
}

// Small-batch GEMV against a double reference, every output mode; a token's result must not
// depend on the batch it runs in (bitwise equal to running that token alone).
TEST(GpuKernels, GemvVsHost) {
  NEED_GPU();
  const uint64_t seed = lf_test_seed();
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> U(-1.0f, 1.0f);
  for (int n_in : {64, 1000, 4104})
    for (int n_out : {1, 37, 300})
      for (int nt : {1, 3, 8})
        for (int mode = 0; mode < 4; mode++) { // F32 beta 0, F32 beta 1, BF16, GLU
          const lf_gemv_out om = mode < 2 ? LF_GEMV_F32 : mode == 2 ? LF_GEMV_BF16 : LF_GEMV_GLU;
          const int wrows = om == LF_GEMV_GLU ? 2 * n_out : n_out;
          std::vector<uint16_t> w(size_t(wrows) * n_in), x(size_t(nt) * n_in);
          for (auto &v : w) v = lf_f32_to_bf16(U(rng) * 0.05f);
          for (auto &v : x) v = lf_f32_to_bf16(U(rng));
          std::vector<float> y0(size_t(nt) * n_out);
          for (auto &v : y0) v = mode == 1 ? U(rng) : std::nanf("");
          uint16_t *dw = dev<uint16_t>(w.size()), *dx = dev<uint16_t>(x.size());
          float *dy = dev<float>(y0.size()), *dy1 = dev<float>(size_t(n_out));
          CK(cudaMemcpy(dw, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
          CK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
          CK(cudaMemcpy(dy, y0.data(), y0.size() * 4, cudaMemcpyHostToDevice));
          ASSERT_EQ(lf_cuda_gemv(dw, dx, size_t(n_in), n_in, n_out, nt, dy, size_t(n_out), om,
                                 mode == 1 ? 1.0f : 0.0f, nullptr),
                    LF_OK)
              << lf_last_error();
          CK(cudaDeviceSynchronize());
          std::vector<float> y(y0.size());
          std::vector<uint16_t> yb(y0.size());
          if (om == LF_GEMV_F32) CK(cudaMemcpy(y.data(), dy, y.size() * 4, cudaMemcpyDeviceToHost));
          else CK(cudaMemcpy(yb.data(), dy, yb.size() * 2, cudaMemcpyDeviceToHost));
          for (int t = 0; t < nt; t++)
            for (int o = 0; o < n_out; o++) {
              double acc[2] = {0, 0}, mag = 0;
              for (int r = 0; r < (om == LF_GEMV_GLU ? 2 : 1); r++)
                for (int i = 0; i < n_in; i++) {
                  const double p = double(bf(w[(size_t(o) + size_t(r) * n_out) * n_in + i])) *
                                   bf(x[size_t(t) * n_in + i]);
                  acc[r] += p;
                  mag += std::fabs(p);
                }
              double ref = acc[0], got;
              const size_t k = size_t(t) * n_out + o;
              if (mode == 1) ref += y0[k];
              if (om == LF_GEMV_GLU) ref = acc[0] / (1.0 + std::exp(-acc[0])) * acc[1];
              got = om == LF_GEMV_F32 ? y[k] : bf(yb[k]);
              const double tol = 1e-5 * mag + (om == LF_GEMV_F32 ? 1e-6 : 8e-3 * std::fabs(ref)) +
                                 (om == LF_GEMV_GLU ? 1e-5 * mag * std::fabs(acc[1]) : 0.0);
              ASSERT_NEAR(got, ref, tol) << "n_in " << n_in << " n_out " << n_out << " nt " << nt
                                         << " mode " << mode << " t " << t << " o " << o
                                         << " seed " << seed;
            }
          if (mode == 0 && nt > 1) // batch invariance: the last token alone
            for (int t = 0; t < nt; t++) {
              ASSERT_EQ(lf_cuda_gemv(dw, dx + size_t(t) * n_in, size_t(n_in), n_in, n_out, 1, dy1,
                                     size_t(n_out), om, 0.0f, nullptr),
                        LF_OK);
              std::vector<float> alone(static_cast<size_t>(n_out));
              CK(cudaMemcpy(alone.data(), dy1, alone.size() * 4, cudaMemcpyDeviceToHost));
              ASSERT_EQ(0, std::memcmp(alone.data(), y.data() + size_t(t) * n_out, alone.size() * 4))
                  << "token " << t << " differs when run alone";
            }
          cudaFree(dw);
          cudaFree(dx);
          cudaFree(dy);
          cudaFree(dy1);
        }
}

/* Top-k candidates of a vocab slice (lf_cuda_topk_pairs) against a host sort by (value desc, id
 * asc), with many equal values (logits on a 1/8 grid) so the tie rule is exercised, and the
 * scatter of every rank's candidates into -inf logits (lf_cuda_scatter_pairs). */
TEST(GpuKernels, TopkPairsVsHost) {
  NEED_GPU();
  const uint64_t seed = lf_test_seed();
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> q(-40, 40);
  const int kmax = 1024;
  for (int nv : {1, 5, 1000, 3000, 70000}) {
    const int n = 4, id0 = 12345;
    // item 0 greedy (k 1), then top-k 7, 40, 1024
    std::vector<lf_sample_params> sp = {{0.0f, 50, 0.0f, 0.5f},
                                        {0.9f, 7, 0.0f, 0.5f},
                                        {0.7f, 40, 0.9f, 0.5f},
                                        {1.2f, 1024, 0.0f, 0.5f}};
    std::vector<float> l((size_t)n * nv);
    for (auto &v : l) v = q(rng) / 8.0f;
    float *dl = dev<float>(l.size());
    int32_t *dp = dev<int32_t>((size_t)n * kmax * 2);
    lf_sample_params *dsp = dev<lf_sample_params>(sp.size());
    CK(cudaMemcpy(dl, l.data(), l.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dsp, sp.data(), sp.size() * sizeof sp[0], cudaMemcpyHostToDevice));
    CK(cudaMemset(dp, 0x7f, (size_t)n * kmax * 8)); // poison
    ASSERT_EQ(lf_cuda_topk_pairs(dl, nv, n, id0, dsp, kmax, dp, nullptr), LF_OK)
        << lf_last_error();
    std::vector<int32_t> got((size_t)n * kmax * 2);
    CK(cudaMemcpy(got.data(), dp, got.size() * 4, cudaMemcpyDeviceToHost));
    for (int it = 0; it < n; it++) {
      const int k = std::min(it == 0 ? 1 : sp[it].top_k, nv);
      std::vector<int> ord(nv);
      for (int i = 0; i < nv; i++) ord[i] = i;
      const float *row = l.data() + (size_t)it * nv;
      std::stable_sort(ord.begin(), ord.end(), [&](int a, int b) { return row[a] > row[b]; });
      std::vector<std::pair<int, float>> want, have;
      for (int j = 0; j < k; j++) want.push_back({id0 + ord[j], row[ord[j]]});
      const int32_t *o = got.data() + (size_t)it * kmax * 2;
      for (int j = 0; j < kmax; j++) {
        float v;
        std::memcpy(&v, &o[2 * j], 4);
        if (j < k) have.push_back({o[2 * j + 1], v});
        else
          ASSERT_TRUE(o[2 * j + 1] == -1 && std::isinf(v) && v < 0)
              << "nv " << nv << " item " << it << " pad " << j;
      }
      std::sort(want.begin(), want.end());
      std::sort(have.begin(), have.end());
      ASSERT_EQ(have, want) << "nv " << nv << " item " << it << " k " << k << " seed " << seed;
    }
    // two "ranks": this slice's pairs twice, the second shifted by nv ids; scatter
    const int V = 2 * nv + id0 + 7;
    std::vector<int32_t> all(got);
    all.insert(all.end(), got.begin(), got.end());
    for (size_t j = got.size() / 2; j < all.size() / 2; j++)
      if (all[2 * j + 1] >= 0) all[2 * j + 1] += nv;
    int32_t *dall = dev<int32_t>(all.size());
    float *dfull = dev<float>((size_t)n * V);
    CK(cudaMemcpy(dall, all.data(), all.size() * 4, cudaMemcpyHostToDevice));
    ASSERT_EQ(lf_cuda_scatter_pairs(dall, 2, n, kmax, V, dfull, nullptr), LF_OK) << lf_last_error();
    std::vector<float> full((size_t)n * V);
    CK(cudaMemcpy(full.data(), dfull, full.size() * 4, cudaMemcpyDeviceToHost));
    for (int it = 0; it < n; it++) {
      std::vector<float> want((size_t)V, -INFINITY);
      for (int r = 0; r < 2; r++)
        for (int j = 0; j < kmax; j++) {
          const int32_t *p = all.data() + (((size_t)r * n + it) * kmax + j) * 2;
          if (p[1] >= 0) std::memcpy(&want[(size_t)p[1]], &p[0], 4);
        }
      for (int v = 0; v < V; v++)
        ASSERT_EQ(full[(size_t)it * V + v], want[(size_t)v]) << "item " << it << " id " << v;
    }
    CK(cudaFree(dl));
    CK(cudaFree(dp));
    CK(cudaFree(dsp));
    CK(cudaFree(dall));
    CK(cudaFree(dfull));
  }
}

/* The residual GEMV in K parts (lf_cuda_gemv_parts): against the double-precision sum, and the
 * property tensor parallelism relies on: the matrix cut into T column blocks, block r run with
 * 8 / T parts, and the T results added by the pairwise tree with the old y added last, gives
 * exactly the bits of one call over the whole matrix with 8 parts and beta 1. */
TEST(GpuKernels, GemvPartsSplitEqualsWhole) {
  NEED_GPU();
  const uint64_t seed = lf_test_seed();
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> U(-1.0f, 1.0f);
  for (int n_in : {512, 4096, 14336})
    for (int n_out : {5, 300})
      for (int nt : {1, 2, 7}) {
        std::vector<uint16_t> w(size_t(n_out) * n_in), x(size_t(nt) * n_in);
        for (auto &v : w) v = lf_f32_to_bf16(U(rng) * 0.05f);
        for (auto &v : x) v = lf_f32_to_bf16(U(rng));
        std::vector<float> y0(size_t(nt) * n_out);
        for (auto &v : y0) v = U(rng);
        uint16_t *dw = dev<uint16_t>(w.size()), *dx = dev<uint16_t>(x.size());
        float *dy = dev<float>(y0.size());
        CK(cudaMemcpy(dw, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dy, y0.data(), y0.size() * 4, cudaMemcpyHostToDevice));
        ASSERT_TRUE(lf_cuda_gemv_parts_ok(n_in, 8));
        ASSERT_EQ(lf_cuda_gemv_parts(dw, dx, size_t(n_in), n_in, n_out, nt, dy, size_t(n_out), 8,
                                     1.0f, nullptr),
                  LF_OK)
            << lf_last_error();
        std::vector<float> whole(y0.size());
        CK(cudaMemcpy(whole.data(), dy, whole.size() * 4, cudaMemcpyDeviceToHost));
        for (int t = 0; t < nt; t++) // the oracle: double sums
          for (int o = 0; o < n_out; o++) {
            double acc = y0[size_t(t) * n_out + o], mag = std::fabs(acc);
            for (int i = 0; i < n_in; i++) {
              const double p = double(bf(w[size_t(o) * n_in + i])) * bf(x[size_t(t) * n_in + i]);
              acc += p;
              mag += std::fabs(p);
            }
            ASSERT_NEAR(whole[size_t(t) * n_out + o], acc, 1e-5 * mag + 1e-6)
                << "n_in " << n_in << " n_out " << n_out << " nt " << nt << " seed " << seed;
          }
        for (int T : {2, 4, 8}) {
          const int kb = n_in / T;
          std::vector<std::vector<float>> part(T, std::vector<float>(y0.size()));
          for (int r = 0; r < T; r++) {
            std::vector<uint16_t> wr(size_t(n_out) * kb), xr(size_t(nt) * kb);
            for (int o = 0; o < n_out; o++)
              std::copy_n(w.begin() + size_t(o) * n_in + size_t(r) * kb, kb,
                          wr.begin() + size_t(o) * kb);
            for (int t = 0; t < nt; t++)
              std::copy_n(x.begin() + size_t(t) * n_in + size_t(r) * kb, kb,
                          xr.begin() + size_t(t) * kb);
            uint16_t *dwr = dev<uint16_t>(wr.size()), *dxr = dev<uint16_t>(xr.size());
            float *dyr = dev<float>(y0.size());
            CK(cudaMemcpy(dwr, wr.data(), wr.size() * 2, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(dxr, xr.data(), xr.size() * 2, cudaMemcpyHostToDevice));
            CK(cudaMemset(dyr, 0xff, y0.size() * 4)); // NaN: beta 0 must not read it
            ASSERT_EQ(lf_cuda_gemv_parts(dwr, dxr, size_t(kb), kb, n_out, nt, dyr, size_t(n_out),
                                         8 / T, 0.0f, nullptr),
                      LF_OK)
                << lf_last_error();
            CK(cudaMemcpy(part[r].data(), dyr, y0.size() * 4, cudaMemcpyDeviceToHost));
            CK(cudaFree(dwr));
            CK(cudaFree(dxr));
            CK(cudaFree(dyr));
          }
          for (size_t k = 0; k < y0.size(); k++) {
            std::vector<float> v(T);
            for (int r = 0; r < T; r++) v[r] = part[r][k];
            for (int st = 1; st < T; st *= 2)
              for (int r = 0; r + st < T; r += 2 * st) v[r] = v[r] + v[r + st];
            const float got = y0[k] + v[0];
            ASSERT_EQ(f32_bits(got), f32_bits(whole[k]))
                << "T " << T << " n_in " << n_in << " n_out " << n_out << " nt " << nt << " k "
                << k << " seed " << seed;
          }
        }
        CK(cudaFree(dw));
        CK(cudaFree(dx));
        CK(cudaFree(dy));
      }
  EXPECT_FALSE(lf_cuda_gemv_parts_ok(1000, 8)); // parts of whole 16-byte chunks only
  EXPECT_FALSE(lf_cuda_gemv_parts_ok(4096, 3));
}

TEST(GpuKernels, RmsNorm) {
  NEED_GPU();
  const uint64_t seed = lf_test_seed();
  std::mt19937_64 r(seed);
  std::normal_distribution<float> nd(0.f, 2.f);
  // 257 and 12300 take the scalar kernel, the others the register-held float4 one (1..8 per thread)
  for (int n : {8, 64, 257, 1000, 4096, 5120, 8192, 12300}) {
    const int rows = 5;
    std::vector<float> x(static_cast<size_t>(rows) * n), w(static_cast<size_t>(n));
    for (auto &v : x) v = nd(r);
    for (auto &v : w) v = 1.f + 0.2f * nd(r);
    std::vector<int32_t> map = {3, 0, 4, 1, 2};
    float *dx = dev<float>(x.size()), *dw = dev<float>(w.size());
    uint16_t *dout = dev<uint16_t>(x.size());
    int32_t *dmap = dev<int32_t>(5);
    CK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dmap, map.data(), 20, cudaMemcpyHostToDevice));
    CK(cudaMemset(dout, 0xff, x.size() * 2)); // NaN poison
    ASSERT_EQ(lf_cuda_rmsnorm(dx, size_t(n), dw, n, 1e-5f, rows, dout, size_t(n), dmap, nullptr),
              LF_OK);
    std::vector<uint16_t> out(x.size());
    CK(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost));
    std::vector<float> ref(static_cast<size_t>(n));
    for (int row = 0; row < rows; row++) {
      lf_rmsnorm(ref.data(), &x[size_t(row) * n], w.data(), n, 1e-5f);
      for (int i = 0; i < n; i++) {
        const float g = bf(out[size_t(map[size_t(row)]) * n + i]);
        ASSERT_NEAR(g, ref[size_t(i)], 1e-2f * std::fabs(ref[size_t(i)]) + 1e-6f)
            << "n " << n << " row " << row << " i " << i << " seed " << seed;
      }
    }
    cudaFree(dx);
    cudaFree(dw);
    cudaFree(dout);
    cudaFree(dmap);
  }
}

// qkv bias + q/k norm + RoPE + the decode write into the pool, against lf_rmsnorm/lf_rope_apply.
TEST(GpuKernels, QkvRopeKvWrite) {
  NEED_GPU();
  const uint64_t seed = lf_test_seed();
  std::mt19937_64 r(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int style = 0; style < 2; style++)
    for (int D : {8, 64, 128}) {
      const int hq = 8, hkv = 2, B = 16, L = 3, P = 3, layer = 1, T = 3;
      const int qd = hq * D, kd = hkv * D, W = qd + 2 * kd;
      lf_model_config cfg{};
      cfg.head_dim = D;
      cfg.rope_theta = 10000.f;
      if (style) {
        cfg.rope_scaling = LF_ROPE_SCALING_LLAMA3;
        cfg.rope_factor = 8;
        cfg.rope_low_freq_factor = 1;
        cfg.rope_high_freq_factor = 4;
        cfg.rope_original_max_pos = 64;
      }
      std::vector<float> inv(static_cast<size_t>(D / 2));
      lf_rope_freqs(&cfg, inv.data());
      std::vector<float> qkv(static_cast<size_t>(T) * W), bias(static_cast<size_t>(W)), qn(static_cast<size_t>(D)), kn(static_cast<size_t>(D));
      for (auto &v : qkv) v = nd(r);
      for (auto &v : bias) v = 0.1f * nd(r);
      for (auto &v : qn) v = 1.f + 0.1f * nd(r);
      for (auto &v : kn) v = 1.f + 0.1f * nd(r);
      std::vector<int32_t> pools = {2, 0, 1}, pos = {5, 1000, 77};
      // pool 2: n = 4 (free slot 4); pool 0: full with next = 9; pool 1: full, next = 5
      std::vector<int32_t> n_h(static_cast<size_t>(P) * L * hkv, 0), next_h(static_cast<size_t>(P) * L * hkv, -1);
      auto hidx = [&](int pool, int g) { return (static_cast<size_t>(pool) * L + layer) * hkv + g; };
      for (int g = 0; g < hkv; g++) {
        n_h[hidx(2, g)] = 4;
        n_h[hidx(0, g)] = B;
        next_h[hidx(0, g)] = 9 + g;
        n_h[hidx(1, g)] = B;
        next_h[hidx(1, g)] = 5;
      }
      const size_t slots = size_t(P) * L * hkv * B;
      float *dqkv = dev<float>(qkv.size()), *dbias = dev<float>(W), *dqn = dev<float>(D),
            *dkn = dev<float>(D), *dinv = dev<float>(D / 2), *dvn = dev<float>(slots);
      uint16_t *dq = dev<uint16_t>(static_cast<size_t>(T) * qd), *dk = dev<uint16_t>(slots * D),
               *dv = dev<uint16_t>(slots * D);
      int32_t *dpos = dev<int32_t>(T), *dpools = dev<int32_t>(T), *dppos = dev<int32_t>(slots),
              *dn = dev<int32_t>(n_h.size()), *dnext = dev<int32_t>(n_h.size()),
              *dw = dev<int32_t>(static_cast<size_t>(T) * hkv);
      CK(cudaMemcpy(dqkv, qkv.data(), qkv.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dbias, bias.data(), W * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dqn, qn.data(), D * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dkn, kn.data(), D * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dinv, inv.data(), D / 2 * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dpos, pos.data(), T * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dpools, pools.data(), T * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dn, n_h.data(), n_h.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dnext, next_h.data(), n_h.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemset(dq, 0xff, size_t(T) * qd * 2));
      CK(cudaMemset(dk, 0xff, slots * D * 2));
      CK(cudaMemset(dv, 0xff, slots * D * 2));
      CK(cudaMemset(dvn, 0xff, slots * 4));
      CK(cudaMemset(dppos, 0xff, slots * 4));
      CK(cudaMemset(dw, 0x7f, size_t(T) * hkv * 4));
      lf_qkv_rope_args a{};
      a.qkv = dqkv;
      a.qkv_stride = size_t(W);
      a.bias = dbias;
      a.q_norm = dqn;
      a.k_norm = dkn;
      a.eps = 1e-6f;
      a.inv_freq = dinv;
      a.interleaved = style;
      a.n_heads = hq;
      a.n_kv_heads = hkv;
      a.head_dim = D;
      a.n_tok = T;
      a.pos = dpos;
      a.q_out = dq;
      a.pool.k = dk;
      a.pool.v = dv;
      a.pool.vnorm = dvn;
      a.pool.pos = dppos;
      a.pool.n = dn;
      a.pool.next = dnext;
      a.pool.n_layers = L;
      a.pool.n_kv_heads = hkv;
      a.pool.budget = B;
      a.pool.head_dim = D;
      a.pool_ids = dpools;
      a.layer = layer;
      a.sink = 4;
      a.policy = LF_POLICY_LONGFLOW;
      a.w = dw;
      ASSERT_EQ(lf_cuda_qkv_rope(&a, nullptr), LF_OK);
      std::vector<uint16_t> q(static_cast<size_t>(T) * qd), k(slots * D), v(slots * D);
      std::vector<float> vn(slots);
      std::vector<int32_t> pp(slots), n2(n_h.size()), w(static_cast<size_t>(T) * hkv);
      CK(cudaMemcpy(q.data(), dq, q.size() * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(k.data(), dk, k.size() * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(v.data(), dv, v.size() * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(vn.data(), dvn, slots * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(pp.data(), dppos, slots * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(n2.data(), dn, n2.size() * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(w.data(), dw, w.size() * 4, cudaMemcpyDeviceToHost));
      const lf_rope_style rs = style ? LF_ROPE_INTERLEAVED : LF_ROPE_HALF;
      for (int t = 0; t < T; t++) {
        std::vector<float> x(qkv.begin() + size_t(t) * W, qkv.begin() + size_t(t + 1) * W);
        for (int i = 0; i < W; i++) x[size_t(i)] += bias[size_t(i)];
        for (int h = 0; h < hq; h++) lf_rmsnorm(&x[size_t(h) * D], &x[size_t(h) * D], qn.data(), D, 1e-6f);
        for (int g = 0; g < hkv; g++)
          lf_rmsnorm(&x[size_t(qd + g * D)], &x[size_t(qd + g * D)], kn.data(), D, 1e-6f);
        lf_rope_apply(x.data(), hq, D, pos[size_t(t)], inv.data(), rs);
        lf_rope_apply(&x[size_t(qd)], hkv, D, pos[size_t(t)], inv.data(), rs);
        for (int i = 0; i < qd; i++)
          ASSERT_NEAR(bf(q[size_t(t) * qd + i]), x[size_t(i)], 1e-2f * std::fabs(x[size_t(i)]) + 1e-3f)
              << "q t " << t << " i " << i << " D " << D << " seed " << seed;
        for (int g = 0; g < hkv; g++) {
          const size_t h = hidx(pools[size_t(t)], g);
          const int want_w = n_h[h] < B ? n_h[h] : next_h[h];
          ASSERT_EQ(w[size_t(t) * hkv + g], want_w);
          ASSERT_EQ(n2[h], std::min(n_h[h] + 1, B));
          const size_t s = h * B + size_t(want_w);
          ASSERT_EQ(pp[s], pos[size_t(t)]);
          float l1 = 0;
          for (int d = 0; d < D; d++) {
            const float kr = x[size_t(qd + g * D + d)], vr = x[size_t(qd + kd + g * D + d)];
            ASSERT_NEAR(bf(k[s * D + d]), kr, 1e-2f * std::fabs(kr) + 1e-3f);
            ASSERT_NEAR(bf(v[s * D + d]), vr, 1e-2f * std::fabs(vr) + 1e-3f);
            l1 += std::fabs(bf(v[s * D + d]));
          }
          ASSERT_NEAR(vn[s], l1, 1e-4f * l1);
        }
      }
      // nothing else in the pool was touched
      size_t written = 0;
      for (size_t s = 0; s < slots; s++) written += pp[s] != -1;
      EXPECT_EQ(written, size_t(T * hkv));
      for (void *p : {(void *)dqkv, (void *)dbias, (void *)dqn, (void *)dkn, (void *)dinv,
                      (void *)dvn, (void *)dq, (void *)dk, (void *)dv, (void *)dpos,
                      (void *)dpools, (void *)dppos, (void *)dn, (void *)dnext, (void *)dw})
        cudaFree(p);
    }
}

// Device sampling with fixed u against lf_sample on the same fp32 logits.
TEST(GpuKernels, SamplingMatchesHost) {
  NEED_GPU();
  const uint64_t seed = lf_test_seed();
  std::mt19937_64 r(seed);
  std::normal_distribution<float> nd(0.f, 3.f);
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  // 5003: rows start off 16-byte alignment, so the argmax's unaligned head and tail are used
  for (int vocab : {300, 5000, 5003, 151936}) {
    const int n = 24;
    std::vector<float> lg(static_cast<size_t>(n) * vocab);
    for (auto &v : lg) v = nd(r);
    lg[7] = lg[8] = 40.f; // a tie in row 0: greedy picks the lower id
    // row 6 (greedy): a three-way tie across the head / first group / next group of a row
    lg[size_t(6) * vocab + 2] = lg[size_t(6) * vocab + 3] = lg[size_t(6) * vocab + 9] = 41.f;
    std::vector<lf_sample_params> sp(static_cast<size_t>(n));
    std::vector<lf_sampling> hs(static_cast<size_t>(n));
    for (int i = 0; i < n; i++) {
      lf_sampling s{};
      const int kind = i % 6;
      s.temperature = kind == 0 ? 0.f : 0.3f + 1.2f * ud(r);
      s.top_k = kind == 2 || kind == 4 ? 1 + int(r() % 50) : 0;
      s.top_p = kind == 3 || kind == 4 ? 0.3f + 0.6f * ud(r) : 1.f;
      if (kind == 5) s.top_k = vocab; // off
      hs[size_t(i)] = s;
      sp[size_t(i)] = lf_sample_params{s.temperature, s.top_k, s.top_p, ud(r)};
    }
    float *dl = dev<float>(lg.size()), *dp = dev<float>(lg.size());
    lf_sample_params *dsp = dev<lf_sample_params>(static_cast<size_t>(n));
    int32_t *dt = dev<int32_t>(static_cast<size_t>(n));
    const size_t sb = lf_cuda_sample_sort_bytes(vocab);
    void *ws = dev<char>(sb);
    CK(cudaMemcpy(dl, lg.data(), lg.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dsp, sp.data(), sp.size() * sizeof sp[0], cudaMemcpyHostToDevice));
    CK(cudaMemset(dt, 0xff, size_t(n) * 4));
    ASSERT_EQ(lf_cuda_sample(dl, vocab, n, dsp, dt, dp, nullptr), LF_OK) << lf_last_error();
    for (int i = 0; i < n; i++)
      if (lf_sample_needs_sort(&sp[size_t(i)], vocab)) {
        ASSERT_EQ(lf_cuda_sample_sorted(dl + size_t(i) * vocab, vocab, &sp[size_t(i)], dt + i, ws,
                                        sb, nullptr),
                  LF_OK)
            << lf_last_error();
      }
    std::vector<int32_t> tok(static_cast<size_t>(n));
    CK(cudaMemcpy(tok.data(), dt, size_t(n) * 4, cudaMemcpyDeviceToHost));
    lf_sampler smp;
    ASSERT_EQ(lf_sampler_init(&smp, vocab), LF_OK);
    for (int i = 0; i < n; i++) {
      const int want = lf_sample(&smp, &lg[size_t(i) * vocab], &hs[size_t(i)], sp[size_t(i)].u);
      EXPECT_EQ(tok[size_t(i)], want) << "vocab " << vocab << " item " << i << " T "
                                      << hs[size_t(i)].temperature << " k " << hs[size_t(i)].top_k
                                      << " p " << hs[size_t(i)].top_p << " seed " << seed;
    }
    EXPECT_EQ(tok[0], 7);
    EXPECT_EQ(tok[6], 2);
    lf_sampler_free(&smp);
    cudaFree(dl);
    cudaFree(dp);
    cudaFree(dsp);
    cudaFree(dt);
    cudaFree(ws);
  }
}

// Embedding gather against the host lookup (engine/forward.c's CPU twin copies the row):
// exact. The vocab-parallel slices give the row inside the slice and zeros outside, so the sum
// over a partition of the vocabulary is the full lookup, exactly.
TEST(GpuKernels, EmbedVsHost) {
  NEED_GPU();
  std::mt19937_64 rng(lf_test_seed());
  std::normal_distribution<float> nd(0.f, 1.f);
  const int V = 1000, dim = 300, n = 7;
  std::vector<uint16_t> e(size_t(V) * dim);
  for (auto &x : e) x = lf_f32_to_bf16(nd(rng));
  std::vector<int32_t> tok = {0, V - 1, 399, 400, 699, 700, 123};
  uint16_t *de = dev<uint16_t>(e.size());
  int32_t *dt = dev<int32_t>(size_t(n));
  float *dx = dev<float>(size_t(n) * dim);
  CK(cudaMemcpy(de, e.data(), e.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dt, tok.data(), size_t(n) * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(dx, 0xff, size_t(n) * dim * 4));
  ASSERT_EQ(lf_cuda_embed(de, dim, dt, n, dx, nullptr), LF_OK) << lf_last_error();
  std::vector<float> x(size_t(n) * dim), sum(size_t(n) * dim, 0.0f);
  CK(cudaMemcpy(x.data(), dx, x.size() * 4, cudaMemcpyDeviceToHost));
  for (int t = 0; t < n; t++)
    for (int i = 0; i < dim; i++)
      ASSERT_EQ(f32_bits(x[size_t(t) * dim + i]), f32_bits(bf(e[size_t(tok[size_t(t)]) * dim + i])))
          << "token " << t << " dim " << i;
  const int cut[] = {0, 400, 700, V};
  for (int r = 0; r < 3; r++) {
    const int v0 = cut[r], nr = cut[r + 1] - cut[r];
    CK(cudaMemset(dx, 0xff, size_t(n) * dim * 4));
    ASSERT_EQ(lf_cuda_embed_slice(de + size_t(v0) * dim, dim, v0, nr, dt, n, dx, nullptr), LF_OK)
        << lf_last_error();
    std::vector<float> xs(size_t(n) * dim);
    CK(cudaMemcpy(xs.data(), dx, xs.size() * 4, cudaMemcpyDeviceToHost));
    for (int t = 0; t < n; t++) {
      const int id = tok[size_t(t)];
      const bool own = id >= v0 && id < v0 + nr;
      for (int i = 0; i < dim; i++) {
        const float want = own ? bf(e[size_t(id) * dim + i]) : 0.0f;
        ASSERT_EQ(f32_bits(xs[size_t(t) * dim + i]), f32_bits(want))
            << "slice " << r << " token " << t << " dim " << i;
        sum[size_t(t) * dim + i] += xs[size_t(t) * dim + i];
      }
    }
  }
  ASSERT_EQ(0, std::memcmp(sum.data(), x.data(), x.size() * 4)) << "the slices' sum";
  for (void *p : {(void *)de, (void *)dt, (void *)dx}) cudaFree(p);
}

// SiLU(gate) * up against a double host loop (engine/forward.c's twin in fp32): the kernel
// rounds an fp32 result to bf16, so the tolerance is half a bf16 ulp (2^-8 relative) plus fp32
// rounding of the SiLU (1e-5 relative).
TEST(GpuKernels, SiluMulVsHost) {
  NEED_GPU();
  std::mt19937_64 rng(lf_test_seed());
  std::normal_distribution<float> nd(0.f, 3.f);
  for (int hidden : {1, 255, 1000, 20000})
    for (int nt : {1, 5, 700}) { // 700 x 20000: more vector groups than the grid has threads
      std::vector<float> gu(size_t(nt) * 2 * hidden);
      for (auto &x : gu) x = nd(rng);
      float *dg = dev<float>(gu.size());
      uint16_t *dout = dev<uint16_t>(size_t(nt) * hidden);
      CK(cudaMemcpy(dg, gu.data(), gu.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemset(dout, 0xff, size_t(nt) * hidden * 2));
      ASSERT_EQ(lf_cuda_silu_mul(dg, hidden, nt, dout, nullptr), LF_OK) << lf_last_error();
      std::vector<uint16_t> out(size_t(nt) * hidden);
      CK(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost));
      for (int t = 0; t < nt; t++)
        for (int i = 0; i < hidden; i++) {
          const double g = gu[size_t(t) * 2 * hidden + i], u = gu[size_t(t) * 2 * hidden + hidden + i];
          const double ref = g / (1.0 + std::exp(-g)) * u;
          ASSERT_NEAR(bf(out[size_t(t) * hidden + i]), ref, std::fabs(ref) * (1.0 / 256 + 1e-5))
              << "hidden " << hidden << " token " << t << " i " << i;
        }
      cudaFree(dg);
      cudaFree(dout);
    }
}

// Tensor-parallel greedy choice: every rank's (max bits, global id) of its vocab slice
// (lf_cuda_argmax_pairs) against a host scan of the slice (first maximum), then the pick over
// the gathered pairs (lf_cuda_tp_pick) against lf_argmax of the whole logits (engine/sample.h,
// the CPU twin): exact, with planted ties inside a slice and across slices (lowest id wins).
TEST(GpuKernels, ArgmaxPairsAndTpPick) {
  NEED_GPU();
  std::mt19937_64 rng(lf_test_seed());
  std::normal_distribution<float> nd(0.f, 1.f);
  const int V = 50021, n = 6;
  for (int T : {1, 2, 3, 8}) {
    std::vector<float> full(size_t(n) * V);
    for (auto &x : full) x = nd(rng);
    // item 0: one maximum; 1: a tie inside slice 0; 2: a tie across the first two slices; 3: the
    // maximum in the last slice's last entry; 4: all equal; 5: a tie of the last two slices
    auto at = [&](int i, int id) -> float & { return full[size_t(i) * V + id]; };
    at(0, 17) = 9.f;
    at(1, 3) = at(1, 5) = 9.f;
    at(2, lf_shard_split(V, T, 1) - 1) = at(2, V - 2) = 9.f;
    at(3, V - 1) = 9.f;
    for (int id = 0; id < V; id++) at(4, id) = 0.5f;
    at(5, lf_shard_split(V, T, T - 1)) = at(5, V - 1) = 9.f;
    std::vector<int32_t> all(size_t(T) * n * 2);
    int32_t *dpairs = dev<int32_t>(size_t(n) * 2);
    for (int r = 0; r < T; r++) {
      const int v0 = lf_shard_split(V, T, r), nv = lf_shard_split(V, T, r + 1) - v0;
      std::vector<float> slice(size_t(n) * nv);
      for (int i = 0; i < n; i++)
        std::memcpy(slice.data() + size_t(i) * nv, &at(i, v0), size_t(nv) * 4);
      float *dl = dev<float>(slice.size());
      CK(cudaMemcpy(dl, slice.data(), slice.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemset(dpairs, 0x7f, size_t(n) * 8));
      ASSERT_EQ(lf_cuda_argmax_pairs(dl, nv, n, v0, dpairs, nullptr), LF_OK) << lf_last_error();
      std::vector<int32_t> pairs(size_t(n) * 2);
      CK(cudaMemcpy(pairs.data(), dpairs, pairs.size() * 4, cudaMemcpyDeviceToHost));
      for (int i = 0; i < n; i++) {
        int best = 0;
        for (int j = 1; j < nv; j++)
          if (slice[size_t(i) * nv + j] > slice[size_t(i) * nv + best]) best = j;
        EXPECT_EQ(uint32_t(pairs[size_t(2 * i)]), f32_bits(slice[size_t(i) * nv + best]))
            << "T " << T << " rank " << r << " item " << i;
        EXPECT_EQ(pairs[size_t(2 * i + 1)], v0 + best) << "T " << T << " rank " << r << " item " << i;
      }
      std::memcpy(all.data() + size_t(r) * n * 2, pairs.data(), pairs.size() * 4);
      cudaFree(dl);
    }
    int32_t *dall = dev<int32_t>(all.size()), *dtok = dev<int32_t>(size_t(n));
    CK(cudaMemcpy(dall, all.data(), all.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemset(dtok, 0xff, size_t(n) * 4));
    ASSERT_EQ(lf_cuda_tp_pick(dall, T, n, dtok, nullptr), LF_OK) << lf_last_error();
    std::vector<int32_t> tok(static_cast<size_t>(n));
    CK(cudaMemcpy(tok.data(), dtok, tok.size() * 4, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
      EXPECT_EQ(tok[size_t(i)], lf_argmax(&at(i, 0), V)) << "T " << T << " item " << i;
    for (void *p : {(void *)dpairs, (void *)dall, (void *)dtok}) cudaFree(p);
  }
}

} // namespace

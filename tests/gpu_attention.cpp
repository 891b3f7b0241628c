// The attention kernels that sit beside the fused decode kernel (attention/prefill_attn.cuh,
// attention/decode_attn_generic.cuh) against the CPU reference (attention/attention.h) on
// identical bf16 inputs. The fused decode kernel is tested in gpu_decode_attn.cpp. Label gpu.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention/attention.h"
#include "attention/decode_attn.cuh"
#include "attention/decode_attn_generic.cuh"
#include "attention/prefill_attn.cuh"
#include "base/kvq.h"
#include "lfserve.h"
#include "memory/pool.h"
#include "tests/gpu_util.h"
#include "test_util.h"

namespace {

struct DevPool {
  lf_cuda_pool_view v{};
  size_t slots = 0, heads = 0;
  void init(const lf_kv_arena &a) {
    const lf_pool_shape &s = a.shape;
    heads = size_t(s.n_pools) * s.n_layers * s.n_kv_heads;
    slots = heads * s.budget;
    v.n_layers = s.n_layers;
    v.n_kv_heads = s.n_kv_heads;
    v.budget = s.budget;
    v.head_dim = s.head_dim;
    v.kv_dtype = s.kv_dtype;
    v.k = dev<uint16_t>(slots * s.head_dim);
    v.v = dev<uint16_t>(slots * s.head_dim);
    if (s.kv_dtype != LF_KV_BF16) { // codes in the bf16-sized buffers; scales; the chunk scratch
      v.k_scale = dev<float>(slots * size_t(lf_kvq_meta_words(lf_kvq_k_row(s.kv_dtype), s.head_dim)));
      v.v_scale = dev<float>(slots * size_t(lf_kvq_meta_words(lf_kvq_v_row(s.kv_dtype), s.head_dim)));
      v.deq_k = dev<uint16_t>(size_t(s.n_kv_heads) * s.budget * s.head_dim);
      v.deq_v = dev<uint16_t>(size_t(s.n_kv_heads) * s.budget * s.head_dim);
    }
    v.vnorm = dev<float>(slots);
    v.acc = dev<float>(slots);
    v.pos = dev<int32_t>(slots);
    v.n = dev<int32_t>(heads);
    v.next = dev<int32_t>(heads);
  }
  void upload(const lf_kv_arena &a) {
    const size_t D = size_t(a.shape.head_dim);
    if (a.shape.kv_dtype != LF_KV_BF16) { // each row's codes and scales
      const int kf = lf_kvq_k_row(a.shape.kv_dtype), vf = lf_kvq_v_row(a.shape.kv_dtype);
      const size_t krb = size_t(lf_kvq_code_bytes(kf, int(D))), kmw = size_t(lf_kvq_meta_words(kf, int(D)));
      const size_t vrb = size_t(lf_kvq_code_bytes(vf, int(D))), vmw = size_t(lf_kvq_meta_words(vf, int(D)));
      std::vector<uint32_t> k(slots * krb / 4), vv(slots * vrb / 4), ks(slots * kmw), vs(slots * vmw);
      for (size_t i = 0; i < slots; i++) {
        lf_kvq_encode_row(kf, a.k + i * D, int(D), (uint8_t *)k.data() + i * krb, &ks[i * kmw]);
        lf_kvq_encode_row(vf, a.v + i * D, int(D), (uint8_t *)vv.data() + i * vrb, &vs[i * vmw]);
      }
      EXPECT_EQ(cudaMemcpy(v.k, k.data(), slots * krb, cudaMemcpyHostToDevice), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(v.v, vv.data(), slots * vrb, cudaMemcpyHostToDevice), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(v.k_scale, ks.data(), ks.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(v.v_scale, vs.data(), vs.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    }
    std::vector<uint16_t> k(slots * D), vv(slots * D);
    for (size_t i = 0; i < slots * D; i++) {
      k[i] = lf_f32_to_bf16(a.k[i]);
      vv[i] = lf_f32_to_bf16(a.v[i]);
    }
    if (a.shape.kv_dtype == LF_KV_BF16) {
      EXPECT_EQ(cudaMemcpy(v.k, k.data(), k.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(v.v, vv.data(), vv.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    }
    EXPECT_EQ(cudaMemcpy(v.vnorm, a.vnorm, slots * 4, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(v.acc, a.acc, slots * 4, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(v.pos, a.pos, slots * 4, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(v.n, a.n, heads * 4, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(v.next, a.next, heads * 4, cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DevPool() {
    for (void *p : {v.k, v.v, (void *)v.vnorm, (void *)v.acc, (void *)v.pos, (void *)v.n,
                    (void *)v.next, (void *)v.k_scale, (void *)v.v_scale, v.deq_k, v.deq_v})
      cudaFree(p);
  }
};

// Step 1 of a decode step on the host, layer 0: *after (initialised by the caller) becomes a
// copy of a with each sequence's new k and v (kn, vn: [seq][kv head][head_dim]) in the slot
// lf_kv_write_slot picks, at position 1000 + seq, the fill count grown. -> the write slots
// [seq][kv head].
std::vector<int32_t> write_new_tokens(const lf_kv_arena &a, lf_kv_arena *after,
                                      const std::vector<int32_t> &pools,
                                      const std::vector<float> &kn, const std::vector<float> &vn) {
  const lf_pool_shape &ps = a.shape;
  const int hkv = ps.n_kv_heads, B = ps.budget, D = ps.head_dim, NS = int(pools.size());
  const size_t heads = size_t(ps.n_pools) * ps.n_layers * hkv, slots = heads * B;
  std::copy(a.k, a.k + slots * D, after->k);
  std::copy(a.v, a.v + slots * D, after->v);
  std::copy(a.vnorm, a.vnorm + slots, after->vnorm);
  std::copy(a.acc, a.acc + slots, after->acc);
  std::copy(a.pos, a.pos + slots, after->pos);
  std::copy(a.n, a.n + heads, after->n);
  std::copy(a.next, a.next + heads, after->next);
  std::vector<int32_t> w(size_t(NS) * hkv);
  for (int s2 = 0; s2 < NS; s2++)
    for (int g = 0; g < hkv; g++) {
      lf_kv_head h = lf_kv_arena_head(after, pools[size_t(s2)], 0, g);
      const int ws = lf_kv_write_slot(&h);
      w[size_t(s2) * hkv + g] = ws;
      const float *kr = &kn[(size_t(s2) * hkv + g) * D], *vr = &vn[(size_t(s2) * hkv + g) * D];
      double l1 = 0;
      for (int d = 0; d < D; d++) {
        h.k[size_t(ws) * D + d] = kr[d];
        h.v[size_t(ws) * D + d] = vr[d];
        l1 += std::fabs(double(vr[d]));
      }
      h.vnorm[ws] = float(l1);
      h.pos[ws] = 1000 + s2;
      if (*h.n < B) (*h.n)++;
    }
  return w;
}

// The generic decode attention (steps 2-4) against lf_attn_decode_ref on identical bf16 inputs:
// outputs within bf16 tolerance, next equal except at near-ties of the cpu scores; h2o's
// accumulators after the step within fp32 summation error (recent window 6 of positions that
// are not contiguous: the new token's is 1000 + seq).
TEST(GpuKernels, DecodeAttnVsReference) {
  NEED_GPU();
  const uint64_t seed = lf_test_seed();
  std::mt19937_64 r(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  int near_ties = 0, cases = 0;
  std::uniform_real_distribution<float> ud(0.f, 3.f);
  const int recent = 6;
  for (lf_policy pol : {LF_POLICY_LONGFLOW, LF_POLICY_STREAMING, LF_POLICY_H2O, LF_POLICY_FULL})
    for (int D : {8, 32, 64})
      for (int G : {1, 4})
        for (int B : {16, 100})
          for (int fill : {0, 1}) { // partly filled, full
            const int hkv = 2, hq = hkv * G, P = 3, NS = 2;
            if (pol == LF_POLICY_FULL && fill) continue;
            lf_pool_shape ps{P, 1, hkv, B, D, 0, 0, nullptr};
            lf_kv_arena a;
            ASSERT_EQ(lf_kv_arena_init(&a, &ps), LF_OK);
            std::vector<int32_t> pools = {2, 0};
            const int n_before = fill ? B : B / 2;
            for (int pl : pools)
              for (int g = 0; g < hkv; g++) {
                lf_kv_head h = lf_kv_arena_head(&a, pl, 0, g);
                for (int i = 0; i < n_before; i++) {
                  double l1 = 0;
                  for (int d = 0; d < D; d++) {
                    h.k[size_t(i) * D + d] = bfr(nd(r));
                    h.v[size_t(i) * D + d] = bfr(nd(r));
                    l1 += std::fabs(double(h.v[size_t(i) * D + d]));
                  }
                  h.vnorm[i] = float(l1);
                  h.acc[i] = ud(r);
                  h.pos[i] = i;
                }
                *h.n = n_before;
                *h.next = fill ? 4 + int(r() % uint64_t(B - 4)) : -1;
              }
            // new tokens: written on the host (step 1) into a copy uploaded to the device
            std::vector<float> q(static_cast<size_t>(NS) * hq * D), kn(static_cast<size_t>(NS) * hkv * D), vn(kn.size());
            for (auto &x : q) x = bfr(nd(r));
            for (auto &x : kn) x = bfr(nd(r));
            for (auto &x : vn) x = bfr(nd(r));
            lf_kv_arena after;
            ASSERT_EQ(lf_kv_arena_init(&after, &ps), LF_OK);
            const std::vector<int32_t> w = write_new_tokens(a, &after, pools, kn, vn);
            DevPool dp;
            dp.init(after);
            dp.upload(after);
            CK(cudaMemset(dp.v.next, 0x7f, dp.heads * 4)); // poison
            std::vector<uint16_t> qb(q.size());
            for (size_t i = 0; i < q.size(); i++) qb[i] = lf_f32_to_bf16(q[i]);
            uint16_t *dq = dev<uint16_t>(q.size()), *dout = dev<uint16_t>(q.size());
            int32_t *dpools = dev<int32_t>(NS), *dw = dev<int32_t>(w.size());
            float *scr = dev<float>(lf_cuda_decode_attn_simple_scratch(NS, hq, B));
            CK(cudaMemcpy(dq, qb.data(), qb.size() * 2, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(dpools, pools.data(), NS * 4, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
            CK(cudaMemset(dout, 0xff, q.size() * 2));
            const float scale = 1.0f / std::sqrt(float(D));
            ASSERT_EQ(lf_cuda_decode_attn_simple(&dp.v, 0, NS, dpools, dw, hq, dq, scale, 4, pol,
                                                 recent, dout, scr, nullptr, nullptr),
                      LF_OK)
                << lf_last_error();
            std::vector<uint16_t> out(q.size());
            std::vector<int32_t> next(dp.heads);
            std::vector<float> acc(dp.slots);
            CK(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(next.data(), dp.v.next, dp.heads * 4, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(acc.data(), dp.v.acc, dp.slots * 4, cudaMemcpyDeviceToHost));
            lf_attn_params ap{pol, 4, 32, recent, G, D, scale, LF_EVICT_HEAD, 0, 0, 0, 0};
            for (int s2 = 0; s2 < NS; s2++)
              for (int g = 0; g < hkv; g++) {
                lf_kv_head h = lf_kv_arena_head(&a, pools[size_t(s2)], 0, g);
                std::vector<float> ref(static_cast<size_t>(G) * D), sc(static_cast<size_t>(B));
                int ev = 0;
                ASSERT_EQ(lf_attn_decode_ref(&ap, &h, &q[(static_cast<size_t>(s2) * hq + size_t(g) * G) * D],
                                             &kn[(static_cast<size_t>(s2) * hkv + g) * D],
                                             &vn[(static_cast<size_t>(s2) * hkv + g) * D], 1000 + s2,
                                             ref.data(), &ev, sc.data()),
                          LF_OK);
                for (int i = 0; i < G * D; i++) {
                  const float gv = bf(out[(static_cast<size_t>(s2) * hq + size_t(g) * G) * D + i]);
                  ASSERT_NEAR(gv, ref[size_t(i)], 1e-2f * std::fabs(ref[size_t(i)]) + 2e-3f)
                      << "D " << D << " G " << G << " B " << B << " seed " << seed;
                }
                const size_t hi = size_t(pools[size_t(s2)]) * hkv + g;
                if (pol == LF_POLICY_H2O) {
                  for (int i = 0; i < *h.n; i++) {
                    ASSERT_NEAR(acc[hi * B + size_t(i)], h.acc[i], 1e-4f * h.acc[i] + 1e-5f)
                        << "acc of slot " << i << " D " << D << " G " << G << " B " << B
                        << " seed " << seed;
                  }
                }
                const int got = next[hi], want = *h.next;
                cases++;
                if (got != want) {
                  ASSERT_TRUE((pol == LF_POLICY_LONGFLOW || pol == LF_POLICY_H2O) && got >= 4 &&
                              got < *h.n &&
                              got != w[size_t(s2) * hkv + g])
                      << "next " << got << " vs " << want << " policy " << pol << " seed " << seed;
                  const float d = std::fabs(sc[size_t(got)] - sc[size_t(want)]);
                  ASSERT_LE(d, 1e-4f * sc[size_t(want)] + 1e-9f)
                      << "next " << got << " vs " << want << ": not a near-tie, seed " << seed;
                  near_ties++;
                }
              }
            cudaFree(dq);
            cudaFree(dout);
            cudaFree(dpools);
            cudaFree(dw);
            cudaFree(scr);
            lf_kv_arena_free(&a);
            lf_kv_arena_free(&after);
          }
  printf("decode attention: %d (sequence, head) choices, %d near-tie differences\n", cases,
         near_ties);
}

// Prefill attention + pool write (append, and SnapKV compression of an empty pool) against
// lf_attn_prefill_ref on identical bf16 inputs.
// One instance per pool dtype (PrefillVsReference/Dtype.Cases/k8v4), so each can run alone or
// beside the others: the CPU reference over the long cases takes minutes per dtype.
class PrefillVsReference : public ::testing::TestWithParam<int> {};

TEST_P(PrefillVsReference, Cases) {
  NEED_GPU();
  const int kvd = GetParam();
  const uint64_t seed = lf_test_seed();
  std::mt19937_64 r(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  struct Case {
    int D, G, B, T1, T2; // T2 > 0: a second chunk appended after T1
    float qs;            // query scale: 1 diffuse, 8 sharp (logits of std ~8)
  };
  // head_dim 64 and 128 take the tensor-core kernel: long chunks, chunks after n0 filled slots
  // that are not a multiple of its 64-key tiles, GQA groups 1..8, SnapKV compression of long
  // prompts, diffuse and sharp queries; the others the one-warp kernel.
  for (Case c : {Case{32, 4, 64, 100, 0, 1}, Case{8, 2, 48, 47, 0, 1}, Case{64, 1, 40, 300, 0, 1},
                 Case{16, 4, 64, 20, 30, 1}, Case{32, 2, 600, 500, 0, 1},
                 Case{128, 4, 2400, 1000, 1300, 1}, Case{128, 4, 2400, 1000, 1300, 8},
                 Case{64, 8, 1200, 130, 1000, 8}, Case{128, 1, 300, 1500, 0, 8},
                 Case{64, 4, 500, 2100, 0, 1}, Case{128, 2, 60, 70, 0, 8},
                 Case{128, 4, 40, 37, 0, 8}, Case{64, 2, 200, 1, 150, 8}}) {
   for (lf_policy pol : {LF_POLICY_LONGFLOW, LF_POLICY_H2O}) {
    // 8-bit pools: a chunk attends to the pool's slots through bf16 copies of what their codes
    // read back (the CPU pool holds those values exactly in fp32). The output is held to the
    // reference run over a copy of the CPU pool with the same bf16 rounding, so the bound stays
    // bf16's (with sharp queries the rounding alone moves outputs by up to 0.02, far beyond it);
    // every slot written must read back bit-identically.
    const int hkv = 2, hq = hkv * c.G, D = c.D, B = c.B;
    if (!lf_kvq_fits(kvd, D)) continue; // int4: whole groups of 32 dims
    lf_pool_shape ps{1, 1, hkv, B, D, kvd, 0, nullptr};
    lf_kv_arena a;
    ASSERT_EQ(lf_kv_arena_init(&a, &ps), LF_OK);
    int pool = -1;
    ASSERT_EQ(lf_kv_arena_take(&a, &pool), LF_OK);
    DevPool dp;
    dp.init(a);
    dp.upload(a);
    // h2o: recent window 8 (the smallest budget, 40, holds sink + 8 + 2)
    lf_attn_params ap{pol, 4, 32, pol == LF_POLICY_H2O ? 8 : 32, c.G, D,
                     1.0f / std::sqrt(float(D)), LF_EVICT_HEAD, 0, 0, 0, 0};
    const bool h2o = pol == LF_POLICY_H2O;
    int32_t pos0 = 0;
    for (int T : {c.T1, c.T2}) {
      if (T == 0) continue;
      const int n0 = *lf_kv_arena_head(&a, 0, 0, 0).n;
      std::vector<float> q(static_cast<size_t>(T) * hq * D), k(static_cast<size_t>(T) * hkv * D), v(k.size());
      for (auto &x : q) x = bfr(c.qs * nd(r));
      for (auto &x : k) x = bfr(nd(r));
      for (auto &x : v) x = bfr(nd(r));
      std::vector<float> ref(q.size()), ref_state(q.size());
      lf_kv_arena ar{}; // 8-bit: the pool as the chunk reads it, each value rounded to bf16
      if (kvd != LF_KV_BF16) {
        ASSERT_EQ(lf_kv_arena_init(&ar, &ps), LF_OK);
        const size_t ns = size_t(hkv) * B;
        for (size_t i = 0; i < ns * D; i++) {
          ar.k[i] = bfr(a.k[i]);
          ar.v[i] = bfr(a.v[i]);
        }
        std::copy(a.pos, a.pos + ns, ar.pos);
        std::copy(a.vnorm, a.vnorm + ns, ar.vnorm);
        std::copy(a.acc, a.acc + ns, ar.acc);
        std::copy(a.n, a.n + hkv, ar.n);
        std::copy(a.next, a.next + hkv, ar.next);
      }
      for (int g = 0; g < hkv; g++) {
        lf_kv_head h = lf_kv_arena_head(&a, 0, 0, g);
        ASSERT_EQ(lf_attn_prefill_ref(&ap, &h, T, pos0, &q[size_t(g) * c.G * D], size_t(hq) * D,
                                      &k[size_t(g) * D], &v[size_t(g) * D], size_t(hkv) * D,
                                      &ref_state[size_t(g) * c.G * D], size_t(hq) * D, nullptr),
                  LF_OK);
        if (kvd == LF_KV_BF16) continue;
        lf_kv_head hr = lf_kv_arena_head(&ar, 0, 0, g);
        ASSERT_EQ(lf_attn_prefill_ref(&ap, &hr, T, pos0, &q[size_t(g) * c.G * D], size_t(hq) * D,
                                      &k[size_t(g) * D], &v[size_t(g) * D], size_t(hkv) * D,
                                      &ref[size_t(g) * c.G * D], size_t(hq) * D, nullptr),
                  LF_OK);
      }
      // h2o's accumulators after the chunk, from the same reference as the output
      const lf_kv_arena &acc_from = kvd == LF_KV_BF16 ? a : ar;
      const std::vector<float> acc_ref(acc_from.acc, acc_from.acc + size_t(hkv) * B);
      if (kvd == LF_KV_BF16) ref = ref_state;
      else lf_kv_arena_free(&ar);
      auto up = [&](const std::vector<float> &x) {
        std::vector<uint16_t> b(x.size());
        for (size_t i = 0; i < x.size(); i++) b[i] = lf_f32_to_bf16(x[i]);
        uint16_t *d = dev<uint16_t>(b.size());
        EXPECT_EQ(cudaMemcpy(d, b.data(), b.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
        return d;
      };
      uint16_t *dq = up(q), *dk = up(k), *dv = up(v), *dout = dev<uint16_t>(q.size());
      float *ml = dev<float>(static_cast<size_t>(T) * hq * 2), *snap = dev<float>(static_cast<size_t>(hkv) * 2 * T);
      int32_t *slot_of = dev<int32_t>(static_cast<size_t>(hkv) * T);
      float *cs = dev<float>(static_cast<size_t>(hq) * (n0 + T));
      CK(cudaMemset(dout, 0xff, q.size() * 2));
      const bool compress = n0 == 0 && T > B - 1;
      ASSERT_EQ(lf_cuda_prefill_attn(&dp.v, 0, 0, n0, hq, T, dq, dk, dv, ap.scale, dout,
                                     compress || h2o ? ml : nullptr, nullptr),
                LF_OK);
      if (D == 64 || D == 128) {
        // the tensor-core kernel with one and with two 16-row tiles a warp: the same MMAs and
        // softmax steps for every row in the same order (a row of a 128-query block only adds
        // a tile it cannot see, exactly 0), so bit-identical outputs and (max, normaliser)
        std::vector<uint16_t> ot[2];
        std::vector<float> mt[2];
        for (int w = 1; w <= 2; w++) {
          CK(cudaMemset(dout, 0xff, q.size() * 2));
          ASSERT_EQ(lf_cuda_prefill_attn_tiles(&dp.v, 0, 0, n0, hq, T, dq, dk, dv, ap.scale, dout,
                                               ml, w, nullptr),
                    LF_OK);
          ot[w - 1].resize(q.size());
          mt[w - 1].resize(static_cast<size_t>(T) * hq * 2);
          CK(cudaMemcpy(ot[w - 1].data(), dout, q.size() * 2, cudaMemcpyDeviceToHost));
          CK(cudaMemcpy(mt[w - 1].data(), ml, mt[w - 1].size() * 4, cudaMemcpyDeviceToHost));
        }
        ASSERT_TRUE(ot[0] == ot[1]) << "warp tiles 1 vs 2 differ, D " << D << " G " << c.G
                                    << " n0 " << n0 << " T " << T << " seed " << seed;
        ASSERT_EQ(std::memcmp(mt[0].data(), mt[1].data(), mt[0].size() * 4), 0)
            << "(max, normaliser) differ between warp tiles 1 and 2, D " << D << " n0 " << n0
            << " T " << T;
        // the checks below hold the auto choice's output (and ml, which SnapKV and h2o read) to
        // the reference; the one the auto choice did not take is the same bits
        ASSERT_EQ(lf_cuda_prefill_attn(&dp.v, 0, 0, n0, hq, T, dq, dk, dv, ap.scale, dout,
                                       compress || h2o ? ml : nullptr, nullptr),
                  LF_OK);
      }
      if (compress) {
        const int w_eff = std::max(0, std::min(32, B - 1 - 4));
        ASSERT_EQ(lf_cuda_snapkv_select(hq, hkv, D, T, B, 4, w_eff, 1, dq, dk, ml, ap.scale, snap,
                                        slot_of, nullptr),
                  LF_OK);
        if (h2o) {
          ASSERT_EQ(lf_cuda_h2o_prefill_acc(&dp.v, 0, 0, 0, hq, T, dq, dk, ml, ap.scale, slot_of,
                                            cs, nullptr),
                    LF_OK);
        }
        ASSERT_EQ(lf_cuda_kv_store(&dp.v, 0, 0, T, pos0, dk, dv, slot_of, 0, B - 1, nullptr), LF_OK);
      } else {
        if (h2o) {
          ASSERT_EQ(lf_cuda_h2o_prefill_acc(&dp.v, 0, 0, n0, hq, T, dq, dk, ml, ap.scale, nullptr,
                                            cs, nullptr),
                    LF_OK);
        }
        ASSERT_EQ(lf_cuda_kv_store(&dp.v, 0, 0, T, pos0, dk, dv, nullptr, n0, n0 + T, nullptr),
                  LF_OK);
      }
      std::vector<uint16_t> out(q.size()), pk(dp.slots * D);
      std::vector<int32_t> ppos(dp.slots), pn(dp.heads), pnext(dp.heads);
      std::vector<float> pacc(dp.slots);
      CK(cudaMemcpy(pacc.data(), dp.v.acc, dp.slots * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost));
      const int kf = lf_kvq_k_row(kvd); /* the K rows read back below */
      const size_t rb = size_t(lf_kvq_code_bytes(kf, D)), mw = size_t(lf_kvq_meta_words(kf, D));
      std::vector<uint32_t> pk8(kvd != LF_KV_BF16 ? dp.slots * rb / 4 : 0);
      std::vector<uint32_t> pks(kvd != LF_KV_BF16 ? dp.slots * mw : 0);
      if (kvd != LF_KV_BF16) {
        CK(cudaMemcpy(pk8.data(), dp.v.k, pk8.size() * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(pks.data(), dp.v.k_scale, pks.size() * 4, cudaMemcpyDeviceToHost));
      } else {
        CK(cudaMemcpy(pk.data(), dp.v.k, pk.size() * 2, cudaMemcpyDeviceToHost));
      }
      CK(cudaMemcpy(ppos.data(), dp.v.pos, dp.slots * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(pn.data(), dp.v.n, dp.heads * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(pnext.data(), dp.v.next, dp.heads * 4, cudaMemcpyDeviceToHost));
      // Each output is a softmax-weighted mean of bf16 values of |v| ~ 1; the tensor-core kernel
      // rounds the weights to bf16 (2^-9 relative) as flash attention does, which moves an output
      // by up to ~2^-8 when two keys share the weight. Bound each element by that, and the mean
      // error (measured on an H200: 1-3e-4 diffuse, 8.5-9e-4 sharp) below 2e-3, so a systematic
      // error (a wrong mask, scale or slot, ~1e-1) cannot hide.
      double err_sum = 0.0;
      for (size_t i = 0; i < q.size(); i++) {
        ASSERT_NEAR(bf(out[i]), ref[i], 1e-2f * std::fabs(ref[i]) + 6e-3f)
            << "case D " << D << " G " << c.G << " B " << B << " n0 " << n0 << " T " << T
            << " qs " << c.qs << " kv " << lf_kv_dtype_str(lf_kv_dtype(kvd)) << " i " << i
            << " seed " << seed;
        err_sum += std::fabs(double(bf(out[i])) - ref[i]);
      }
      EXPECT_LT(err_sum / double(q.size()), 2e-3)
          << "mean error, case D " << D << " G " << c.G << " n0 " << n0 << " T " << T;
      printf("prefill D %d G %d B %d n0 %d T %d qs %.0f %s: mean |err| %.2e\n", D, c.G, B, n0, T,
             double(c.qs), lf_kv_dtype_str(lf_kv_dtype(kvd)), err_sum / double(q.size()));
      for (int g = 0; g < hkv; g++) {
        lf_kv_head h = lf_kv_arena_head(&a, 0, 0, g);
        ASSERT_EQ(pn[size_t(g)], *h.n);
        ASSERT_EQ(pnext[size_t(g)], *h.next);
        for (int i = 0; i < *h.n; i++) {
          ASSERT_EQ(ppos[size_t(g) * B + i], h.pos[i]) << "slot " << i << " head " << g
                                                       << " B " << B << " T " << T << " seed "
                                                       << seed;
          for (int d = 0; d < D; d++) {
            const size_t row = static_cast<size_t>(g) * B + i;
            const float got = kvd != LF_KV_BF16
                                  ? lf_kvq_row_value(kf, (const uint8_t *)pk8.data() + row * rb,
                                                     &pks[row * mw], d)
                                  : bf(pk[row * D + d]);
            ASSERT_EQ(got, h.k[size_t(i) * D + d]) << "k slot " << i << " head " << g;
          }
          // h2o: the column sums (fp32 against fp64 over the same bf16 inputs; the prefill
          // kernel's max and normaliser)
          if (h2o) {
            const float want = acc_ref[size_t(g) * B + i];
            ASSERT_NEAR(pacc[size_t(g) * B + i], want, 2e-3f * want + 1e-4f)
                << "acc of slot " << i << " head " << g << " B " << B << " n0 " << n0 << " T "
                << T << " qs " << c.qs << " seed " << seed;
          }
        }
      }
      pos0 += T;
      for (void *p : {(void *)dq, (void *)dk, (void *)dv, (void *)dout, (void *)ml, (void *)snap,
                      (void *)slot_of, (void *)cs})
        cudaFree(p);
    }
    lf_kv_arena_free(&a);
   }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtype, PrefillVsReference,
                         ::testing::Values(int(LF_KV_BF16), int(LF_KV_FP8), int(LF_KV_INT8),
                                           int(LF_KV_INT4), int(LF_KV_K8V4)),
                         [](const ::testing::TestParamInfo<int> &i) {
                           return std::string(lf_kv_dtype_str(lf_kv_dtype(i.param)));
                         });

// Layer-scope eviction on the GPU (either decode kernel with `scores`, then lf_cuda_layer_argmin)
// against lf_attn_decode_layer_ref on identical bf16 inputs: 4 KV heads as one group (the layer)
// or two groups of two (rank-local at 2 ranks), generic (head_dim 32) and fused (64, 128) kernels,
// several splits (budget 700). Every head of a group gets the same slot, equal to the CPU's
// except at near-ties of the summed score.
TEST(GpuKernels, LayerScopeDecodeVsReference) {
  NEED_GPU();
  const uint64_t seed = lf_test_seed();
  std::mt19937_64 r(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  int near_ties = 0, cases = 0, moved = 0;
  std::uniform_real_distribution<float> ud(0.f, 3.f);
  for (lf_policy pol : {LF_POLICY_LONGFLOW, LF_POLICY_H2O})
  for (int D : {32, 64, 128})
    for (int per : {4, 2})
      for (int G : {1, 4})
        for (int B : {40, 700}) {
          const int hkv = 4, hq = hkv * G, P = 3, NS = 2, sink = 4, recent = 8;
          lf_pool_shape ps{P, 1, hkv, B, D, 0, 0, nullptr};
          lf_kv_arena a;
          ASSERT_EQ(lf_kv_arena_init(&a, &ps), LF_OK);
          const std::vector<int32_t> pools = {2, 0};
          for (int pl : pools)
            for (int g0 = 0; g0 < hkv; g0 += per) {
              const int nxt = sink + int(r() % uint64_t(B - sink)); // shared by the group
              for (int g = g0; g < g0 + per; g++) {
                lf_kv_head h = lf_kv_arena_head(&a, pl, 0, g);
                for (int i = 0; i < B; i++) {
                  double l1 = 0;
                  for (int d = 0; d < D; d++) {
                    h.k[size_t(i) * D + d] = bfr(nd(r));
                    h.v[size_t(i) * D + d] = bfr(nd(r));
                    l1 += std::fabs(double(h.v[size_t(i) * D + d]));
                  }
                  h.vnorm[i] = float(l1);
                  h.acc[i] = ud(r);
                  h.pos[i] = i;
                }
                *h.n = B;
                *h.next = nxt;
              }
            }
          std::vector<float> q(size_t(NS) * hq * D), kn(size_t(NS) * hkv * D), vn(kn.size());
          for (auto &x : q) x = bfr(nd(r));
          for (auto &x : kn) x = bfr(nd(r));
          for (auto &x : vn) x = bfr(nd(r));
          // the device gets the pools after step 1 (the new k/v in the shared slot)
          lf_kv_arena after;
          ASSERT_EQ(lf_kv_arena_init(&after, &ps), LF_OK);
          const std::vector<int32_t> w = write_new_tokens(a, &after, pools, kn, vn);
          DevPool dp;
          dp.init(after);
          dp.upload(after);
          CK(cudaMemset(dp.v.next, 0x7f, dp.heads * 4)); // poison
          std::vector<uint16_t> qb(q.size());
          for (size_t i = 0; i < q.size(); i++) qb[i] = lf_f32_to_bf16(q[i]);
          uint16_t *dq = dev<uint16_t>(q.size()), *dout = dev<uint16_t>(q.size());
          int32_t *dpools = dev<int32_t>(NS), *dw = dev<int32_t>(w.size());
          float *dsc = dev<float>(size_t(NS) * hkv * B);
          CK(cudaMemcpy(dq, qb.data(), qb.size() * 2, cudaMemcpyHostToDevice));
          CK(cudaMemcpy(dpools, pools.data(), NS * 4, cudaMemcpyHostToDevice));
          CK(cudaMemcpy(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
          const float scale = 1.0f / std::sqrt(float(D));
          void *ws_mem = nullptr;
          if (D == 32) {
            float *scr = dev<float>(lf_cuda_decode_attn_simple_scratch(NS, hq, B));
            ASSERT_EQ(lf_cuda_decode_attn_simple(&dp.v, 0, NS, dpools, dw, hq, dq, scale, sink,
                                                 pol, recent, dout, scr, dsc, nullptr),
                      LF_OK)
                << lf_last_error();
            ws_mem = scr;
          } else {
            lf_decode_attn_args d{};
            d.pool = dp.v;
            d.layer = 0;
            d.n_seq = NS;
            d.pool_ids = dpools;
            d.w = dw;
            d.q = dq;
            d.out = dout;
            d.group = G;
            d.sink = sink;
            d.policy = pol;
            d.recent = recent;
            d.scale = scale;
            d.workspace_bytes = lf_cuda_decode_attn_workspace_bytes(NS, hkv, B, G, D, 0);
            CK(cudaMalloc(&ws_mem, d.workspace_bytes));
            ASSERT_EQ(lf_cuda_decode_attn_workspace_init(ws_mem, d.workspace_bytes, nullptr), LF_OK);
            d.workspace = ws_mem;
            d.scores = dsc;
            ASSERT_EQ(lf_cuda_decode_attn(&d, nullptr), LF_OK) << lf_last_error();
          }
          ASSERT_EQ(lf_cuda_layer_argmin(&dp.v, 0, NS, dpools, dw, sink,
                                         pol == LF_POLICY_H2O ? recent : 0, per, dsc, nullptr),
                    LF_OK)
              << lf_last_error();
          std::vector<int32_t> next(dp.heads);
          CK(cudaMemcpy(next.data(), dp.v.next, dp.heads * 4, cudaMemcpyDeviceToHost));
          lf_attn_params ap{pol, sink, 32, recent, G, D, scale, LF_EVICT_LAYER, 0, 0, 0, 0};
          lf_attn_scratch aws{};
          for (int s2 = 0; s2 < NS; s2++)
            for (int g0 = 0; g0 < hkv; g0 += per) {
              std::vector<lf_kv_head> hs;
              for (int g = g0; g < g0 + per; g++)
                hs.push_back(lf_kv_arena_head(&a, pools[size_t(s2)], 0, g));
              std::vector<float> ref(size_t(per) * G * D), S(static_cast<size_t>(B));
              int ev = 0;
              ASSERT_EQ(lf_attn_decode_layer_ref(&ap, hs.data(), per,
                                                 &q[(size_t(s2) * hq + size_t(g0) * G) * D],
                                                 &kn[(size_t(s2) * hkv + g0) * D],
                                                 &vn[(size_t(s2) * hkv + g0) * D], 1000 + s2,
                                                 ref.data(), &ev, S.data(), &aws),
                        LF_OK);
              const int want = *hs[0].next;
              const size_t hi = size_t(pools[size_t(s2)]) * hkv + g0;
              const int got = next[hi];
              for (int g = 1; g < per; g++)
                ASSERT_EQ(next[hi + size_t(g)], got) << "a group's heads disagree, seed " << seed;
              cases++;
              moved += want != w[size_t(s2) * hkv + g0];
              if (got != want) {
                ASSERT_TRUE(got >= sink && got < B && got != w[size_t(s2) * hkv + g0])
                    << "next " << got << " vs " << want << " seed " << seed;
                if (pol == LF_POLICY_H2O) { // outside the window: recent slots hold later positions
                  int later = 0;
                  for (int i = 0; i < *hs[0].n; i++) later += hs[0].pos[i] > hs[0].pos[got];
                  ASSERT_GE(later, recent) << "next " << got << " is in h2o's window, seed " << seed;
                }
                ASSERT_LE(std::fabs(S[size_t(got)] - S[size_t(want)]), 1e-4f * S[size_t(want)] + 1e-9f)
                    << "next " << got << " vs " << want << ": not a near-tie (D " << D << " per "
                    << per << " G " << G << " B " << B << "), seed " << seed;
                near_ties++;
              }
            }
          lf_attn_scratch_free(&aws);
          cudaFree(ws_mem);
          cudaFree(dq);
          cudaFree(dout);
          cudaFree(dpools);
          cudaFree(dw);
          cudaFree(dsc);
          lf_kv_arena_free(&a);
          lf_kv_arena_free(&after);
        }
  printf("layer-scope decode: %d group choices, %d near-tie differences\n", cases, near_ties);
  EXPECT_GT(moved, 0);
}

// Layer-scope SnapKV (lf_cuda_snapkv_select with per > 1) against lf_attn_prefill_layer_ref: the
// heads of a group keep the same positions, and the kept set is the CPU's but for near-ties.
TEST(GpuKernels, LayerScopeSnapKV) {
  NEED_GPU();
  const uint64_t seed = lf_test_seed();
  std::mt19937_64 r(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int D : {64, 128})
    for (int per : {4, 2}) {
      const int hkv = 4, G = 2, hq = hkv * G, B = 120, T = 400, sink = 4;
      const int w_eff = std::max(0, std::min(32, B - 1 - sink));
      std::vector<float> q(size_t(T) * hq * D), k(size_t(T) * hkv * D), v(k.size());
      for (auto &x : q) x = bfr(4.0f * nd(r));
      for (auto &x : k) x = bfr(nd(r));
      for (auto &x : v) x = bfr(nd(r));
      lf_pool_shape ps{1, 1, hkv, B, D, 0, 0, nullptr};
      lf_kv_arena a;
      ASSERT_EQ(lf_kv_arena_init(&a, &ps), LF_OK);
      int pool = -1;
      ASSERT_EQ(lf_kv_arena_take(&a, &pool), LF_OK);
      lf_attn_params ap{LF_POLICY_LONGFLOW, sink, 32, 32, G, D, 1.0f / std::sqrt(float(D)),
                        LF_EVICT_LAYER, 0, 0, 0, 0};
      lf_attn_scratch aws{};
      std::vector<float> ref(q.size());
      for (int g0 = 0; g0 < hkv; g0 += per) {
        std::vector<lf_kv_head> hs;
        for (int g = g0; g < g0 + per; g++) hs.push_back(lf_kv_arena_head(&a, 0, 0, g));
        ASSERT_EQ(lf_attn_prefill_layer_ref(&ap, hs.data(), per, T, 0, &q[size_t(g0) * G * D],
                                            size_t(hq) * D, &k[size_t(g0) * D], &v[size_t(g0) * D],
                                            size_t(hkv) * D, &ref[size_t(g0) * G * D],
                                            size_t(hq) * D, nullptr, &aws),
                  LF_OK);
      }
      lf_attn_scratch_free(&aws);
      DevPool dp;
      dp.init(a);
      auto up = [&](const std::vector<float> &x) {
        std::vector<uint16_t> b(x.size());
        for (size_t i = 0; i < x.size(); i++) b[i] = lf_f32_to_bf16(x[i]);
        uint16_t *d = dev<uint16_t>(b.size());
        EXPECT_EQ(cudaMemcpy(d, b.data(), b.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
        return d;
      };
      uint16_t *dq = up(q), *dk = up(k), *dv = up(v), *dout = dev<uint16_t>(q.size());
      float *ml = dev<float>(size_t(T) * hq * 2), *snap = dev<float>(size_t(hkv) * 2 * T);
      int32_t *slot_of = dev<int32_t>(size_t(hkv) * T);
      CK(cudaMemset(dp.v.n, 0, dp.heads * 4));
      ASSERT_EQ(lf_cuda_prefill_attn(&dp.v, 0, 0, 0, hq, T, dq, dk, dv, ap.scale, dout, ml, nullptr),
                LF_OK);
      ASSERT_EQ(lf_cuda_snapkv_select(hq, hkv, D, T, B, sink, w_eff, per, dq, dk, ml, ap.scale,
                                      snap, slot_of, nullptr),
                LF_OK)
          << lf_last_error();
      std::vector<int32_t> so(size_t(hkv) * T);
      CK(cudaMemcpy(so.data(), slot_of, so.size() * 4, cudaMemcpyDeviceToHost));
      int differ = 0;
      for (int g = 0; g < hkv; g++) {
        const int g0 = g / per * per;
        for (int t = 0; t < T; t++)
          ASSERT_EQ(so[size_t(g) * T + t], so[size_t(g0) * T + t])
              << "head " << g << " keeps another set than head " << g0 << ", seed " << seed;
        // the CPU's kept positions for this head
        lf_kv_head h = lf_kv_arena_head(&a, 0, 0, g);
        std::vector<char> cpu_keep(size_t(T), 0);
        for (int i = 0; i < *h.n; i++) cpu_keep[size_t(h.pos[i])] = 1;
        for (int t = 0; t < T; t++) differ += (so[size_t(g) * T + t] >= 0) != (cpu_keep[size_t(t)] != 0);
      }
      // bf16 attention against fp64 scores: a few swaps at the selection's edge at most
      EXPECT_LE(differ, 2 * hkv * 4) << "D " << D << " per " << per << ", seed " << seed;
      printf("layer-scope SnapKV D %d per %d: %d kept/dropped positions differ from the cpu\n", D,
             per, differ);
      for (void *p : {(void *)dq, (void *)dk, (void *)dv, (void *)dout, (void *)ml, (void *)snap,
                      (void *)slot_of})
        cudaFree(p);
      lf_kv_arena_free(&a);
    }
}

} // namespace

/* The CUDA decode step (the slot write of lf_cuda_qkv_rope, the kernel production runs, then
 * lf_cuda_decode_attn) against the CPU reference lf_attn_decode_ref on freshly drawn random
 * inputs. The new q/k/v go through lf_cuda_qkv_rope as fp32 QKV rows with no bias, no q/k norm
 * and zero rotation frequencies, so the kernel stores exactly the drawn bf16 values.
 *
 * K/V/q are drawn, rounded to bf16, and the same rounded values go to the CPU reference (fp32
 * arena, double math), so the only differences are the kernel's own: bf16 P in P.V, fp32
 * accumulation order, bf16 output. next must equal the CPU's except at near-ties, judged on the
 * CPU's own scores; the count of near-ties is printed. Unfilled slots hold NaN on the GPU, and the
 * output and next are poisoned before every launch, so a read past n or an unwritten element
 * fails. LF_TEST_SEED replays a run.
 *
 * Quantized pools (DecodeAttnFp8, DecodeAttnInt8, DecodeAttnInt4): the CPU arena holds what each row's codes read
 * back (base/kvq.h),
 * the GPU arena the codes and scales of the same rows; the new token's row is quantized by both
 * sides on its own, and every kept row must read back bit-identically at the end. int4 pools
 * store rotated keys (base/kvrot.h): the slot write rotates q and k, and the CPU reference gets
 * the same rotation of its copies, rounded to bf16 as the kernel rounds them.
 */
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attention/attention.h"
#include "attention/decode_attn.cuh"
#include "attention/kv_write.cuh"
#include "attention/rkv_select.cuh"
#include "base/error.h"
#include "base/kvq.h"
#include "base/kvrot.h"
#include "engine/forward.h"
#include "memory/pool.h"
#include "tests/test_util.h"

#define CUDA_OK(stmt)                                                                              \
  do {                                                                                             \
    cudaError_t e_ = (stmt);                                                                       \
    ASSERT_EQ(e_, cudaSuccess) << #stmt << ": " << cudaGetErrorString(e_);                         \
  } while (0)

#define LF_OK_(stmt)                                                                               \
  do {                                                                                             \
    lf_status s_ = (stmt);                                                                         \
    ASSERT_EQ(s_, LF_OK) << #stmt << ": " << lf_status_str(s_) << ": " << lf_last_error();         \
  } while (0)

namespace {

uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
float bf2f(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
float round_bf(float f) {
  return bf2f(f2bf(f));
}
const uint16_t BF_NAN = 0x7fc0;

template <typename T> struct dev_buf {
  T *p = nullptr;
  size_t n = 0;
  ~dev_buf() {
    if (p) cudaFree(p);
  }
  cudaError_t alloc(size_t count) {
    n = count;
    return cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T));
  }
  cudaError_t put(const std::vector<T> &h) {
    return cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  cudaError_t get(std::vector<T> &h) const {
    h.resize(n);
    return cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
  }
};

struct Case {
  int head_dim, group, budget, n_kv, n_seq;
  int fill; /* 0: partly filled, 1: full, 2: mixed per head */
  lf_policy policy;
  int sink;
  int n_splits; /* 0: auto */
  int steps;
  int recent; /* h2o's window; rkv's stage (0 for the other policies) */
};

std::string case_name(const Case &c) {
  char b[200];
  std::snprintf(b, sizeof b, "D%d_G%d_B%d_kv%d_seq%d_fill%d_%s_sink%d_splits%d_steps%d", c.head_dim,
                c.group, c.budget, c.n_kv, c.n_seq, c.fill,
                c.policy == LF_POLICY_LONGFLOW ? "longflow"
                : c.policy == LF_POLICY_FULL   ? "full"
                : c.policy == LF_POLICY_H2O    ? "h2o"
                : c.policy == LF_POLICY_RKV    ? "rkv"
                                               : "streaming",
                c.sink, c.n_splits, c.steps);
  if (c.policy == LF_POLICY_H2O)
    std::snprintf(b + std::strlen(b), sizeof b - std::strlen(b), "_recent%d", c.recent);
  if (c.policy == LF_POLICY_RKV)
    std::snprintf(b + std::strlen(b), sizeof b - std::strlen(b), "_stage%d", c.recent);
  return b;
}

/* Runs one case: set up identical CPU and GPU pools, then `steps` decode steps on both. */
void run_case(const Case &c, int kv_dtype, bool key_mean = false) {
  const uint64_t seed = lf_test_seed();
  const bool f8 = kv_dtype != LF_KV_BF16; /* codes and scales (8-bit rows, int4 groups) */
  SCOPED_TRACE(case_name(c) + " " + lf_kv_dtype_str(lf_kv_dtype(kv_dtype)) +
               (key_mean ? " key mean" : "") + " seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int D = c.head_dim, G = c.group, B = c.budget, H = c.n_kv, NS = c.n_seq;
  const int HQ = H * G, L = 2, layer = 1, NP = NS + 3;
  const size_t n_heads_all = (size_t)NP * L * H, n_slots_all = n_heads_all * B;
  const bool rkv = c.policy == LF_POLICY_RKV, acc_pol = rkv || c.policy == LF_POLICY_H2O;
  const int stage = rkv ? c.recent : 0;
  const int rot = lf_kv_rotates(kv_dtype); /* as the engine sets it for this pool dtype */

  lf_pool_shape shape = {NP, L, H, B, D, kv_dtype, stage, nullptr};
  lf_kv_arena cpu;
  LF_OK_(lf_kv_arena_init(&cpu, &shape));
  struct arena_guard {
    lf_kv_arena *a;
    ~arena_guard() {
      lf_kv_arena_free(a);
    }
  } guard{&cpu};

  /* Distinct pools in random order, so the kernel must follow pool_ids. */
  std::vector<int32_t> pool_ids(NP);
  std::iota(pool_ids.begin(), pool_ids.end(), 0);
  std::shuffle(pool_ids.begin(), pool_ids.end(), rng);
  pool_ids.resize(NS);

  /* GPU arena: everything NaN except filled slots, metadata mirrors the CPU's. */
  std::vector<uint16_t> hk(n_slots_all * D, BF_NAN), hv(n_slots_all * D, BF_NAN);
  /* fp8: NaN codes and NaN scales outside the filled slots */
  /* quantized: codes 0xff and NaN scales (NaN as fp32 and as both bf16 halves) outside */
  /* each side's row format (k8v4: int8 K rows, int4 V rows), bytes and meta words */
  const int kf = lf_kvq_k_row(kv_dtype), vf = lf_kvq_v_row(kv_dtype);
  const size_t krb = (size_t)lf_kvq_code_bytes(kf, D), kmw = (size_t)lf_kvq_meta_words(kf, D);
  const size_t vrb = (size_t)lf_kvq_code_bytes(vf, D), vmw = (size_t)lf_kvq_meta_words(vf, D);
  std::vector<uint8_t> hk8(f8 ? n_slots_all * krb : 0, 0xff), hv8(f8 ? n_slots_all * vrb : 0, 0xff);
  std::vector<uint32_t> hks(f8 ? n_slots_all * kmw : 0, 0x7fc07fc0u),
      hvs(f8 ? n_slots_all * vmw : 0, 0x7fc07fc0u);
  std::vector<int32_t> max_pos(NS, 0);
  for (int s = 0; s < NS; s++) {
    const int pool = pool_ids[s];
    for (int l = 0; l < L; l++)
      for (int h = 0; h < H; h++) {
        lf_kv_head kh = lf_kv_arena_head(&cpu, pool, l, h);
        int fill = c.fill == 2 ? (int)(rng() % 2) : c.fill;
        if (c.policy == LF_POLICY_FULL) fill = 0; /* full never holds a full pool here */
        /* < B: room for this token; full never outgrows its pool during the steps */
        const int room = c.policy == LF_POLICY_FULL ? c.steps : 0;
        /* rkv: a partly filled pool fills within the first half of the steps, so its first
         * selection runs */
        const int n0 = fill ? B
                       : rkv ? std::max(0, B - 1 - (int)(rng() % (uint64_t)std::max(1, c.steps / 2)))
                             : (int)(rng() % (uint64_t)(B - room));
        /* positions: sinks first, the rest distinct and shuffled */
        std::vector<int32_t> pos(n0);
        for (int i = 0; i < n0; i++)
          pos[i] = i < c.sink ? i : c.sink + (int32_t)(rng() % 4) + 4 * i;
        if (n0 > c.sink) std::shuffle(pos.begin() + c.sink, pos.end(), rng);
        const size_t slot0 = (((size_t)pool * L + l) * H + h) * B;
        for (int i = 0; i < n0; i++) {
          double l1 = 0.0;
          float *kr = kh.k + (size_t)i * D, *vr = kh.v + (size_t)i * D;
          for (int d = 0; d < D; d++) {
            kr[d] = round_bf(nd(rng));
            vr[d] = round_bf(nd(rng));
          }
          if (f8) { /* the GPU gets the codes, the CPU what they read back */
            uint8_t *kc = &hk8[(slot0 + i) * krb], *vc = &hv8[(slot0 + i) * vrb];
            uint32_t *km = &hks[(slot0 + i) * kmw], *vm = &hvs[(slot0 + i) * vmw];
            lf_kvq_encode_row(kf, kr, D, kc, km);
            lf_kvq_encode_row(vf, vr, D, vc, vm);
            for (int d = 0; d < D; d++) {
              kr[d] = lf_kvq_row_value(kf, kc, km, d);
              vr[d] = lf_kvq_row_value(vf, vc, vm, d);
            }
          }
          for (int d = 0; d < D; d++) l1 += std::fabs((double)vr[d]);
          kh.vnorm[i] = (float)l1;
          kh.acc[i] = 0.05f * (float)(rng() % 64); /* h2o: mass from earlier steps */
          kh.pos[i] = pos[i];
          if (l == layer) max_pos[s] = std::max(max_pos[s], pos[i]);
        }
        *kh.n = n0;
        *kh.next = fill ? c.sink + (int)(rng() % (uint64_t)(B - c.sink)) : -1;
        if (rkv && fill) { /* mid-stage: a queue of distinct non-sink slots, since in [0, S) */
          std::vector<int32_t> cand(B - c.sink);
          std::iota(cand.begin(), cand.end(), c.sink);
          std::shuffle(cand.begin(), cand.end(), rng);
          std::copy(cand.begin(), cand.begin() + stage, kh.queue);
          *kh.since = (int)(rng() % (uint64_t)stage);
          *kh.next = kh.queue[*kh.since];
        } else if (rkv) {
          *kh.since = -1; /* no selection yet */
        }
        for (int i = 0; i < n0 && !f8; i++)
          for (int d = 0; d < D; d++) {
            hk[(slot0 + i) * D + d] = f2bf(kh.k[(size_t)i * D + d]);
            hv[(slot0 + i) * D + d] = f2bf(kh.v[(size_t)i * D + d]);
          }
      }
  }

  dev_buf<uint16_t> dk, dv, dq, dout;
  dev_buf<uint8_t> dk8, dv8;
  dev_buf<float> dvnorm, dqkv, dinv, dacc;
  dev_buf<uint32_t> dks, dvs;
  dev_buf<int32_t> dpos, dn, dnext, dpool, dw, dposnew, dqueue, dsince;
  dev_buf<char> dws;
  CUDA_OK(dk.alloc(hk.size()));
  CUDA_OK(dv.alloc(hv.size()));
  CUDA_OK(dk.put(hk));
  CUDA_OK(dv.put(hv));
  if (f8) {
    CUDA_OK(dk8.alloc(hk8.size()));
    CUDA_OK(dv8.alloc(hv8.size()));
    CUDA_OK(dk8.put(hk8));
    CUDA_OK(dv8.put(hv8));
    CUDA_OK(dks.alloc(hks.size()));
    CUDA_OK(dvs.alloc(hvs.size()));
    CUDA_OK(dks.put(hks));
    CUDA_OK(dvs.put(hvs));
  }
  CUDA_OK(dvnorm.alloc(n_slots_all));
  CUDA_OK(dpos.alloc(n_slots_all));
  CUDA_OK(dn.alloc(n_heads_all));
  CUDA_OK(dnext.alloc(n_heads_all));
  CUDA_OK(cudaMemcpy(dvnorm.p, cpu.vnorm, n_slots_all * 4, cudaMemcpyHostToDevice));
  CUDA_OK(dacc.alloc(n_slots_all));
  CUDA_OK(cudaMemcpy(dacc.p, cpu.acc, n_slots_all * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dpos.p, cpu.pos, n_slots_all * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dn.p, cpu.n, n_heads_all * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dnext.p, cpu.next, n_heads_all * 4, cudaMemcpyHostToDevice));
  CUDA_OK(dpool.alloc(NS));
  CUDA_OK(dpool.put(pool_ids));
  if (rkv) {
    CUDA_OK(dqueue.alloc(n_heads_all * stage));
    CUDA_OK(dsince.alloc(n_heads_all));
    CUDA_OK(cudaMemcpy(dqueue.p, cpu.queue, n_heads_all * stage * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dsince.p, cpu.since, n_heads_all * 4, cudaMemcpyHostToDevice));
  }
  CUDA_OK(dw.alloc((size_t)NS * H));
  CUDA_OK(dposnew.alloc(NS));
  CUDA_OK(dq.alloc((size_t)NS * HQ * D));
  const size_t qkv_dim = (size_t)(HQ + 2 * H) * D;
  CUDA_OK(dqkv.alloc((size_t)NS * qkv_dim));
  CUDA_OK(dinv.alloc((size_t)D / 2));
  CUDA_OK(dinv.put(std::vector<float>((size_t)D / 2, 0.0f))); /* no rotation: stored as drawn */
  /* a key mean per KV head (lf_engine_config.key_means), as the engine uploads it: rotated like
   * the keys (lf_key_means_rows); large against the keys, so a mean left out or taken twice
   * moves every stored code */
  std::vector<float> mu;
  dev_buf<float> dmu;
  if (key_mean) {
    std::vector<float> mu_all((size_t)H * D);
    for (auto &x : mu_all) x = 3.0f * nd(rng);
    mu.resize(mu_all.size());
    lf_key_means_rows(mu_all.data(), 1, H, D, 0, H, rot, mu.data());
    CUDA_OK(dmu.alloc(mu.size()));
    CUDA_OK(dmu.put(mu));
  }
  CUDA_OK(dout.alloc((size_t)NS * HQ * D));
  const size_t ws_bytes = lf_cuda_decode_attn_workspace_bytes(NS, H, B, G, D, c.n_splits);
  ASSERT_GT(ws_bytes, 0u) << lf_last_error();
  CUDA_OK(dws.alloc(ws_bytes));
  LF_OK_(lf_cuda_decode_attn_workspace_init(dws.p, ws_bytes, nullptr));
  /* rkv over shared memory's budget: the selection's workspace, as the engine sizes it */
  const size_t rws_bytes = rkv ? lf_cuda_rkv_select_ws_bytes(B, NS * H) : 0;
  dev_buf<char> drws;
  if (rws_bytes) CUDA_OK(drws.alloc(rws_bytes));

  lf_attn_params prm = {};
  prm.policy = c.policy;
  prm.sink = c.sink;
  prm.window = 32;
  prm.h2o_recent = c.policy == LF_POLICY_H2O ? c.recent : 0;
  prm.rkv_stage = stage;
  prm.group = G;
  prm.head_dim = D;
  prm.scale = 1.0f / std::sqrt((float)D);

  int near_ties = 0, next_checked = 0, selections = 0;
  double worst_rel = 0.0;
  for (int step = 0; step < c.steps; step++) {
    SCOPED_TRACE("step " + std::to_string(step));
    /* new token per sequence */
    std::vector<float> q((size_t)NS * HQ * D), kn((size_t)NS * H * D), vn((size_t)NS * H * D);
    for (auto &x : q)
      x = round_bf(1.5f * nd(rng));
    for (auto &x : kn)
      x = round_bf(nd(rng));
    for (auto &x : vn)
      x = round_bf(nd(rng));
    std::vector<int32_t> posnew(NS);
    for (int s = 0; s < NS; s++)
      posnew[s] = ++max_pos[s];
    std::vector<float> hqkv((size_t)NS * qkv_dim);
    for (int s = 0; s < NS; s++) {
      float *row = hqkv.data() + (size_t)s * qkv_dim;
      std::memcpy(row, q.data() + (size_t)s * HQ * D, (size_t)HQ * D * 4);
      std::memcpy(row + (size_t)HQ * D, kn.data() + (size_t)s * H * D, (size_t)H * D * 4);
      std::memcpy(row + (size_t)(HQ + H) * D, vn.data() + (size_t)s * H * D, (size_t)H * D * 4);
    }
    CUDA_OK(dqkv.put(hqkv));
    if (rot || key_mean) { /* the kernel rotates q and k (base/kvrot.h), takes the key mean
                              from k in fp32, then rounds both to bf16 */
      if (rot) {
        for (size_t i = 0; i < q.size(); i += (size_t)D) lf_rot_row(&q[i], D, 1);
        for (size_t i = 0; i < kn.size(); i += (size_t)D) lf_rot_row(&kn[i], D, 0);
      }
      if (key_mean)
        for (size_t i = 0; i < kn.size(); i++) kn[i] -= mu[i % mu.size()];
      for (auto &x : q)
        x = round_bf(x);
      for (auto &x : kn)
        x = round_bf(x);
    }
    CUDA_OK(cudaMemset(dq.p, 0xff, dq.n * 2)); /* bf16 NaN: q must come from the kernel */
    CUDA_OK(dposnew.put(posnew));
    CUDA_OK(cudaMemset(dw.p, 0x7f, (size_t)NS * H * 4));

    /* GPU: write (with q's rounding to bf16), poison next and out, attend */
    lf_cuda_pool_view pv = {};
    pv.k = f8 ? (void *)dk8.p : (void *)dk.p;
    pv.v = f8 ? (void *)dv8.p : (void *)dv.p;
    pv.kv_dtype = kv_dtype;
    pv.k_scale = f8 ? (float *)dks.p : nullptr;
    pv.v_scale = f8 ? (float *)dvs.p : nullptr;
    pv.vnorm = dvnorm.p;
    pv.pos = dpos.p;
    pv.n = dn.p;
    pv.next = dnext.p;
    pv.n_layers = L;
    pv.n_kv_heads = H;
    pv.budget = B;
    pv.head_dim = D;
    pv.acc = acc_pol ? dacc.p : nullptr;
    pv.queue = rkv ? dqueue.p : nullptr;
    pv.since = rkv ? dsince.p : nullptr;
    pv.stage = stage;
    lf_qkv_rope_args wa = {};
    wa.qkv = dqkv.p;
    wa.qkv_stride = qkv_dim;
    wa.inv_freq = dinv.p;
    wa.n_heads = HQ;
    wa.n_kv_heads = H;
    wa.head_dim = D;
    wa.n_tok = NS;
    wa.pos = dposnew.p;
    wa.q_out = dq.p;
    wa.pool = pv;
    wa.pool_ids = dpool.p;
    wa.layer = layer;
    wa.sink = c.sink;
    wa.policy = c.policy;
    wa.w = dw.p;
    wa.rot = rot;
    wa.k_mean = key_mean ? dmu.p : nullptr;
    LF_OK_(lf_cuda_qkv_rope(&wa, nullptr));
    std::vector<int32_t> gnext;
    CUDA_OK(dnext.get(gnext));
    for (int s = 0; s < NS; s++)
      for (int h = 0; h < H; h++)
        gnext[((size_t)pool_ids[s] * L + layer) * H + h] = 0x7f7f7f7f;
    CUDA_OK(dnext.put(gnext));
    CUDA_OK(cudaMemset(dout.p, 0xff, dout.n * 2)); /* bf16 NaN */

    lf_decode_attn_args aa = {};
    aa.pool = pv;
    aa.layer = layer;
    aa.n_seq = NS;
    aa.pool_ids = dpool.p;
    aa.w = dw.p;
    aa.q = dq.p;
    aa.out = dout.p;
    aa.group = G;
    aa.sink = c.sink;
    aa.policy = c.policy;
    aa.recent = c.recent;
    aa.scale = prm.scale;
    aa.n_splits = c.n_splits;
    aa.workspace = dws.p;
    aa.workspace_bytes = ws_bytes;
    LF_OK_(lf_cuda_decode_attn(&aa, nullptr));
    if (rkv) { /* the selections due after this step, as the engine launches them */
      lf_rkv_select_args ra{};
      ra.pool = pv;
      ra.layer = layer;
      ra.n_scopes = NS * H;
      ra.pool_ids = dpool.p;
      ra.heads_per_scope = 1;
      ra.group = G;
      ra.sink = c.sink;
      ra.due_only = 1;
      ra.ws = drws.p;
      ra.ws_bytes = rws_bytes;
      ra.k_mean = key_mean ? dmu.p : nullptr;
      LF_OK_(lf_cuda_rkv_select(&ra, nullptr));
    }
    CUDA_OK(cudaDeviceSynchronize());

    std::vector<uint16_t> gout;
    std::vector<int32_t> gn, gw, gqueue, gsince;
    if (rkv) {
      CUDA_OK(dqueue.get(gqueue));
      CUDA_OK(dsince.get(gsince));
    }
    std::vector<float> gacc;
    CUDA_OK(dout.get(gout));
    CUDA_OK(dacc.get(gacc));
    CUDA_OK(dnext.get(gnext));
    CUDA_OK(dn.get(gn));
    CUDA_OK(dw.get(gw));

    /* CPU reference, and the comparison per (sequence, KV head) */
    std::vector<float> cout_((size_t)G * D), scores(B);
    for (int s = 0; s < NS; s++)
      for (int h = 0; h < H; h++) {
        lf_kv_head kh = lf_kv_arena_head(&cpu, pool_ids[s], layer, h);
        if (key_mean) kh.k_mean = &mu[(size_t)h * D]; /* rkv compares the model's keys */
        const size_t hidx = ((size_t)pool_ids[s] * L + layer) * H + h;
        const int w_cpu = lf_kv_write_slot(&kh);
        int ev = 0;
        std::fill(scores.begin(), scores.end(), NAN);
        const std::vector<float> acc_before(kh.acc, kh.acc + B);
        /* rkv: whether this step's selection is due (attention.h: k_left reaches 0) */
        const bool due = rkv && (*kh.since < 0 ? *kh.n + (*kh.n < B) == B : *kh.since + 1 >= stage);
        LF_OK_(lf_attn_decode_ref(&prm, &kh, &q[((size_t)s * HQ + h * G) * D],
                                  &kn[((size_t)s * H + h) * D], &vn[((size_t)s * H + h) * D],
                                  posnew[s], cout_.data(), &ev, scores.data()));
        ASSERT_EQ(gw[(size_t)s * H + h], w_cpu) << "slot written, seq " << s << " head " << h;
        ASSERT_EQ(gn[hidx], *kh.n) << "n, seq " << s << " head " << h;
        /* output */
        double num = 0.0, den = 0.0;
        for (int j = 0; j < G * D; j++) {
          const float gv = bf2f(gout[((size_t)s * HQ + h * G) * D + j]);
          ASSERT_TRUE(std::isfinite(gv))
              << "out not written / NaN, seq " << s << " head " << h << " elem " << j;
          const double e = (double)gv - cout_[j];
          num += e * e;
          den += (double)cout_[j] * cout_[j];
        }
        const double rel = std::sqrt(num / std::max(den, 1e-30));
        worst_rel = std::max(worst_rel, rel);
        EXPECT_LT(rel, 1.2e-2) << "output, seq " << s << " head " << h;
        /* h2o: every filled slot's accumulator (fp32 sums of the kernel's weights, against the
         * CPU's of exact weights), then the GPU's values carried over so errors do not pile up */
        if (rkv) {
          /* rkv: the window's accumulators (a sum of at most LF_RKV_OBS steps' fp32 masses;
           * a lost, doubled or unreset step is a share of the whole), carried over as h2o's */
          for (int i = 0; i < *kh.n; i++) {
            ASSERT_NEAR(gacc[hidx * B + i], kh.acc[i], 2e-3f * kh.acc[i] + 1e-9f)
                << "rkv acc, seq " << s << " head " << h << " slot " << i;
            kh.acc[i] = gacc[hidx * B + i];
          }
          ASSERT_EQ(gsince[hidx], *kh.since) << "since, seq " << s << " head " << h;
          if (due) {
            /* the CPU's selection again, now from the GPU's accumulators: the queues must
             * agree except at near-ties of the twin's totals (then the GPU's is followed) */
            selections++;
            std::vector<double> tot(B);
            LF_OK_(lf_attn_rkv_select_ref(&prm, &kh, 1, tot.data()));
            std::vector<std::pair<double, int>> cand;
            for (int i = c.sink; i < B; i++)
              if (!std::isnan(tot[i])) cand.push_back({tot[i], i});
            std::sort(cand.begin(), cand.end());
            for (int r = 0; r < stage; r++) {
              const int gq = gqueue[hidx * stage + r];
              if (gq == kh.queue[r]) continue;
              const auto it = std::find_if(cand.begin(), cand.end(),
                                           [&](const std::pair<double, int> &x) { return x.second == gq; });
              ASSERT_TRUE(it != cand.end()) << "queue " << r << ": slot " << gq
                                            << " is not a candidate, seq " << s << " head " << h;
              ASSERT_LE(it->first - cand[r].first, 1e-9 * std::max(1.0, std::fabs(cand[r].first)))
                  << "queue " << r << ": slot " << gq << " vs cpu " << kh.queue[r];
              near_ties++;
              kh.queue[r] = gq;
            }
            *kh.next = kh.queue[0];
          }
          ASSERT_EQ(gnext[hidx], *kh.next) << "rkv next, seq " << s << " head " << h;
          next_checked++;
          continue;
        }
        if (c.policy == LF_POLICY_H2O)
          for (int i = 0; i < *kh.n; i++) {
            /* the tolerance scales with this step's mass, so a lost or doubled one fails */
            const float mass = kh.acc[i] - (i == w_cpu ? 0.0f : acc_before[i]);
            ASSERT_NEAR(gacc[hidx * B + i], kh.acc[i], 1e-6f * kh.acc[i] + 2e-3f * mass + 1e-9f)
                << "acc, seq " << s << " head " << h << " slot " << i << " (step mass " << mass
                << ")";
            kh.acc[i] = gacc[hidx * B + i];
          }
        /* next */
        const int gnx = gnext[hidx], cnx = *kh.next;
        next_checked++;
        if (gnx != cnx) {
          const bool valid =
              gnx >= c.sink && gnx < *kh.n && gnx != w_cpu && c.policy != LF_POLICY_FULL;
          ASSERT_TRUE(valid) << "next " << gnx << " is not evictable (cpu " << cnx << ", n "
                             << *kh.n << ", w " << w_cpu << "), seq " << s << " head " << h;
          ASSERT_GE(cnx, 0);
          if (c.policy == LF_POLICY_H2O) { /* not in the window: recent slots hold later positions */
            int later = 0;
            for (int i = 0; i < *kh.n; i++) later += kh.pos[i] > kh.pos[gnx];
            ASSERT_GE(later, c.recent) << "next " << gnx << " is in h2o's window, seq " << s;
          }
          const double sg = scores[gnx], sc = scores[cnx];
          const bool near = sg - sc <= 1e-4 * std::fabs(sc) + 1e-30;
          ASSERT_TRUE(near) << "next " << gnx << " (score " << sg << ") vs cpu " << cnx
                            << " (score " << sc << "), seq " << s << " head " << h;
          near_ties++;
          *kh.next = gnx; /* follow the GPU's equally good choice so both stay in step */
        }
      }
  }

  /* Whole state of the attended layer after all steps: the kept positions and metadata. */
  std::vector<int32_t> gpos, gn;
  std::vector<float> gvn;
  CUDA_OK(dpos.get(gpos));
  CUDA_OK(dn.get(gn));
  CUDA_OK(dvnorm.get(gvn));
  std::vector<uint16_t> gk, gv;
  std::vector<uint8_t> gk8, gv8;
  std::vector<uint32_t> gks, gvs;
  if (f8) {
    CUDA_OK(dk8.get(gk8));
    CUDA_OK(dv8.get(gv8));
    CUDA_OK(dks.get(gks));
    CUDA_OK(dvs.get(gvs));
  } else {
    CUDA_OK(dk.get(gk));
    CUDA_OK(dv.get(gv));
  }
  for (int s = 0; s < NS; s++)
    for (int h = 0; h < H; h++) {
      lf_kv_head kh = lf_kv_arena_head(&cpu, pool_ids[s], layer, h);
      const size_t hidx = ((size_t)pool_ids[s] * L + layer) * H + h;
      ASSERT_EQ(gn[hidx], *kh.n);
      for (int i = 0; i < *kh.n; i++) {
        ASSERT_EQ(gpos[hidx * B + i], kh.pos[i])
            << "kept position, seq " << s << " head " << h << " slot " << i;
        EXPECT_NEAR(gvn[hidx * B + i], kh.vnorm[i], 1e-5f * kh.vnorm[i]);
        const size_t row = hidx * B + i;
        for (int d = 0; d < D; d++) {
          const float gkx = f8 ? lf_kvq_row_value(kf, &gk8[row * krb], &gks[row * kmw], d)
                               : bf2f(gk[row * D + d]);
          const float gvx = f8 ? lf_kvq_row_value(vf, &gv8[row * vrb], &gvs[row * vmw], d)
                               : bf2f(gv[row * D + d]);
          ASSERT_EQ(gkx, kh.k[(size_t)i * D + d]) << "k, slot " << i << " dim " << d;
          ASSERT_EQ(gvx, kh.v[(size_t)i * D + d]) << "v, slot " << i << " dim " << d;
        }
      }
    }
  if (rkv) { /* every head's queue and step count at the end */
    std::vector<int32_t> gqueue, gsince;
    CUDA_OK(dqueue.get(gqueue));
    CUDA_OK(dsince.get(gsince));
    for (int s = 0; s < NS; s++)
      for (int h = 0; h < H; h++) {
        lf_kv_head kh = lf_kv_arena_head(&cpu, pool_ids[s], layer, h);
        const size_t hidx = ((size_t)pool_ids[s] * L + layer) * H + h;
        ASSERT_EQ(gsince[hidx], *kh.since);
        for (int r = 0; r < stage && *kh.since >= 0; r++) ASSERT_EQ(gqueue[hidx * stage + r], kh.queue[r]);
      }
    EXPECT_GT(selections, 0) << "no selection ran: the case does not test it";
  }
  std::printf("[ %s %s ] worst output rel err %.2e, next: %d checked, %d near-ties, %d rkv selections\n",
              case_name(c).c_str(), lf_kv_dtype_str(lf_kv_dtype(kv_dtype)), worst_rel, next_checked,
              near_ties, selections);
}

class DecodeAttn : public ::testing::TestWithParam<Case> {};

TEST_P(DecodeAttn, MatchesCpuReference) {
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) GTEST_SKIP() << "no CUDA device";
  run_case(GetParam(), LF_KV_BF16);
}

/* The same cases over fp8 pools: the F8 kernel, and the fp8 write in lf_cuda_qkv_rope. */
class DecodeAttnFp8 : public ::testing::TestWithParam<Case> {};

TEST_P(DecodeAttnFp8, MatchesCpuReference) {
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) GTEST_SKIP() << "no CUDA device";
  run_case(GetParam(), LF_KV_FP8);
}

class DecodeAttnInt8 : public ::testing::TestWithParam<Case> {};

TEST_P(DecodeAttnInt8, MatchesCpuReference) {
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) GTEST_SKIP() << "no CUDA device";
  run_case(GetParam(), LF_KV_INT8);
}

/* int4 pools: the INT4 kernel (group sums of q against 4-bit images, V dequantized in bf16)
 * and the int4 write. */
class DecodeAttnInt4 : public ::testing::TestWithParam<Case> {};

TEST_P(DecodeAttnInt4, MatchesCpuReference) {
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) GTEST_SKIP() << "no CUDA device";
  run_case(GetParam(), LF_KV_INT4);
}

/* k8v4 pools: the 8-bit K path and the int4 V path in one instantiation, and each side's write. */
class DecodeAttnK8V4 : public ::testing::TestWithParam<Case> {};

TEST_P(DecodeAttnK8V4, MatchesCpuReference) {
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) GTEST_SKIP() << "no CUDA device";
  run_case(GetParam(), LF_KV_K8V4);
}

/* int4 and k8v4 pools with a key mean (lf_engine_config.key_means) subtracted in the slot write:
 * the CPU reference takes the same mean, rotated as the engine rotates it, from its copies; rkv's
 * selections add it back on both sides (the twin through lf_kv_head.k_mean). */
class DecodeAttnKeyMean : public ::testing::TestWithParam<Case> {};

TEST_P(DecodeAttnKeyMean, MatchesCpuReference) {
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) GTEST_SKIP() << "no CUDA device";
  run_case(GetParam(), LF_KV_INT4, true);
  run_case(GetParam(), LF_KV_K8V4, true);
}

/* Single steps over the shape grid, each with one split and with several (exercising the
 * in-block finish and the cross-block combines: on sm_90, 2..8 splits combine in a thread-block
 * cluster, more through the workspace), then multi-step runs that evict. */
std::vector<Case> cases() {
  std::vector<Case> v;
  const lf_policy LF = LF_POLICY_LONGFLOW;
  struct S {
    int D, G, B, kv, seq, fill;
  } grid[] = {
      {128, 4, 16, 2, 1, 1},   {128, 4, 4096, 8, 1, 1},  {128, 4, 3200, 8, 2, 2},
      {128, 1, 1024, 4, 3, 0}, {128, 8, 2048, 2, 2, 1},  {128, 8, 4096, 1, 1, 0},
      {64, 1, 16, 1, 1, 1},    {64, 4, 1000, 4, 8, 2},   {64, 8, 4096, 2, 2, 1},
      {128, 4, 256, 2, 32, 2}, {128, 4, 128, 2, 128, 1}, {64, 8, 64, 2, 128, 0},
      {128, 2, 77, 3, 5, 2},   {64, 3, 300, 2, 4, 1},    {128, 5, 50, 1, 7, 0},
  };
  for (const S &g : grid) {
    v.push_back({g.D, g.G, g.B, g.kv, g.seq, g.fill, LF, 4, 1, 1, 0});
    v.push_back({g.D, g.G, g.B, g.kv, g.seq, g.fill, LF, 4, 0, 1, 0});
    v.push_back({g.D, g.G, g.B, g.kv, g.seq, g.fill, LF, 4, 7, 1, 0});
    v.push_back({g.D, g.G, g.B, g.kv, g.seq, g.fill, LF_POLICY_H2O, 4, 0, 1, 8});
  }
  /* the largest cluster combine (8 splits) and the ticket combine past it (16) */
  v.push_back({128, 4, 4096, 8, 1, 1, LF, 4, 8, 1, 0});
  v.push_back({128, 4, 4096, 8, 1, 1, LF, 4, 16, 1, 0});
  v.push_back({64, 8, 2048, 2, 3, 2, LF_POLICY_STREAMING, 4, 8, 2, 0});
  /* sink 0, other policies */
  v.push_back({128, 4, 512, 2, 3, 2, LF, 0, 5, 1, 0});
  v.push_back({128, 4, 512, 2, 3, 2, LF_POLICY_STREAMING, 4, 0, 3, 0});
  v.push_back({64, 8, 300, 2, 3, 0, LF_POLICY_FULL, 4, 3, 3, 0});
  /* multi-step: alternating write and attend, evicting, kept positions compared at the end */
  v.push_back({128, 4, 16, 2, 4, 2, LF, 4, 1, 60, 0});
  v.push_back({128, 4, 64, 2, 4, 1, LF, 4, 3, 40, 0});
  v.push_back({64, 8, 100, 2, 3, 2, LF, 2, 0, 40, 0});
  v.push_back({128, 1, 200, 4, 2, 1, LF, 4, 9, 30, 0});
  v.push_back({128, 4, 40, 2, 2, 2, LF_POLICY_STREAMING, 4, 2, 40, 0});
  /* h2o, every combine path (one split, a cluster, the ticket past it), for more steps than its
   * window: the drawn positions have gaps, so the window's threshold is bisected at first and
   * guessed right once the window holds only new tokens. Windows of B/2 and past n too. */
  const lf_policy H2 = LF_POLICY_H2O;
  v.push_back({64, 3, 100, 3, 3, 2, H2, 4, 0, 40, 8}); /* SmolLM2's group and head_dim */
  v.push_back({128, 4, 512, 2, 3, 2, H2, 4, 1, 20, 8});
  v.push_back({128, 4, 64, 2, 4, 1, H2, 4, 3, 40, 6});
  v.push_back({64, 8, 2048, 2, 3, 2, H2, 4, 8, 12, 5});
  v.push_back({128, 4, 4096, 8, 1, 1, H2, 4, 16, 12, 4});
  v.push_back({128, 4, 200, 2, 2, 1, H2, 4, 5, 30, 100});
  v.push_back({64, 4, 1000, 4, 8, 2, H2, 0, 0, 3, 500});
  v.push_back({128, 2, 77, 3, 5, 1, H2, 4, 2, 50, 1});
  /* rkv (stage in `recent`): one split, a cluster, the ticket past it; stages longer than, equal
   * to and shorter than the observation window (the window then opens right after a selection),
   * down to a selection every step; sink 0 */
  const lf_policy RK = LF_POLICY_RKV;
  v.push_back({64, 3, 100, 3, 3, 2, RK, 4, 0, 40, 8}); /* SmolLM2's group and head_dim */
  v.push_back({128, 4, 64, 2, 4, 1, RK, 4, 3, 40, 5});
  v.push_back({64, 8, 1024, 2, 3, 2, RK, 4, 8, 12, 4});
  v.push_back({128, 4, 1024, 4, 1, 1, RK, 4, 16, 8, 3});
  v.push_back({128, 2, 77, 3, 5, 1, RK, 4, 2, 30, 1});
  v.push_back({64, 4, 300, 4, 8, 2, RK, 0, 0, 30, 17});
  v.push_back({128, 4, 200, 2, 2, 0, RK, 4, 5, 40, 12});
  v.push_back({64, 3, 4500, 1, 2, 1, RK, 4, 0, 8, 4}); /* over shared memory: the workspace */
  return v;
}

INSTANTIATE_TEST_SUITE_P(Grid, DecodeAttn, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case> &i) {
                           return case_name(i.param);
                         });
INSTANTIATE_TEST_SUITE_P(Grid, DecodeAttnFp8, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case> &i) {
                           return case_name(i.param);
                         });
INSTANTIATE_TEST_SUITE_P(Grid, DecodeAttnInt8, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case> &i) {
                           return case_name(i.param);
                         });
INSTANTIATE_TEST_SUITE_P(Grid, DecodeAttnInt4, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case> &i) {
                           return case_name(i.param);
                         });
/* every fifth case: each policy, single and multi-step, both head_dims */
std::vector<Case> key_mean_cases() {
  std::vector<Case> all = cases(), v;
  for (size_t i = 0; i < all.size(); i += 5) v.push_back(all[i]);
  return v;
}

INSTANTIATE_TEST_SUITE_P(Grid, DecodeAttnKeyMean, ::testing::ValuesIn(key_mean_cases()),
                         [](const ::testing::TestParamInfo<Case> &i) {
                           return case_name(i.param);
                         });
INSTANTIATE_TEST_SUITE_P(Grid, DecodeAttnK8V4, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case> &i) {
                           return case_name(i.param);
                         });

TEST(DecodeAttnArgs, RejectsBadArguments) {
  lf_decode_attn_args a = {};
  EXPECT_EQ(lf_cuda_decode_attn(&a, nullptr), LF_ERR_INVALID_ARG);
  EXPECT_EQ(lf_cuda_decode_attn(nullptr, nullptr), LF_ERR_INVALID_ARG);
  /* h2o without the pool's accumulators, or with a negative window */
  int dummy[64] = {};
  a.pool.k = a.pool.v = a.out = dummy;
  a.q = dummy;
  a.pool.vnorm = reinterpret_cast<float *>(dummy);
  a.pool.n = a.pool.next = a.pool.pos = dummy;
  a.pool_ids = a.w = dummy;
  a.pool.head_dim = 64;
  a.pool.n_kv_heads = a.pool.budget = a.pool.n_layers = 1;
  a.group = 1;
  a.n_seq = 1;
  a.scale = 0.125f;
  a.policy = LF_POLICY_H2O;
  EXPECT_EQ(lf_cuda_decode_attn(&a, nullptr), LF_ERR_INVALID_ARG);
  a.pool.acc = reinterpret_cast<float *>(dummy);
  a.recent = -1;
  EXPECT_EQ(lf_cuda_decode_attn(&a, nullptr), LF_ERR_INVALID_ARG);
  EXPECT_NE(std::string(lf_last_error()), "");
}

} // namespace

/* The generic decode attention (see decode_attn_generic.cuh): one block per (KV head, sequence),
 * correctness first; the fused kernel (decode_attn.cu) serves the shapes it takes. */
#include "attention/decode_attn_generic.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <float.h>
#include <limits.h>

#include "attention/evict.cuh"
#include "attention/pool_row.cuh"
#include "attention/rkv_step.h"
#include "base/cuda_check.h"

#define DEC_NT 128

static __device__ float block_reduce(float x, int is_max, float *red) {
  for (int o = 16; o > 0; o >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, o);
    x = is_max ? fmaxf(x, y) : x + y;
  }
  __syncthreads(); /* red may still be read from the previous call */
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
  __syncthreads();
  x = red[0];
  for (int i = 1; i < DEC_NT / 32; i++) x = is_max ? fmaxf(x, red[i]) : x + red[i];
  return x;
}

/* The block's smallest (score, slot) key; every thread gets it. */
static __device__ unsigned long long block_min_key(unsigned long long x, unsigned long long *red) {
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long y = __shfl_xor_sync(0xffffffffu, x, o);
    x = y < x ? y : x;
  }
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
  __syncthreads();
  x = red[0];
  for (int i = 1; i < DEC_NT / 32; i++) x = red[i] < x ? red[i] : x;
  return x;
}

/* One block per (KV head g, sequence s). Logits, then weights, of the group's heads live in the
 * scratch [s][head][budget]. */
static __global__ void decode_simple_kernel(lf_cuda_pool_view p, int layer,
                                            const int32_t *pool_ids, const int32_t *w, int n_heads,
                                            const __nv_bfloat16 *q, float scale, int sink,
                                            int policy, int recent, __nv_bfloat16 *out,
                                            float *scratch, float *scores) {
  extern __shared__ float sm[]; /* q [G][D], then m [G], L [G] */
  __shared__ float red[DEC_NT / 32];
  __shared__ int redi[DEC_NT / 32];
  __shared__ unsigned long long redk[DEC_NT / 32];
  const int g = blockIdx.x, s = blockIdx.y, D = p.head_dim, B = p.budget;
  const int hkv = p.n_kv_heads, G = n_heads / hkv;
  const size_t hidx = ((size_t)pool_ids[s] * p.n_layers + layer) * hkv + g;
  const int n = p.n[hidx];
  float *qs = sm, *mh = sm + G * D, *lh = mh + G;
  float *lg = scratch + ((size_t)s * n_heads + (size_t)g * G) * B; /* [G][B] */
  for (int i = threadIdx.x; i < G * D; i += DEC_NT)
    qs[i] = __bfloat162float(q[((size_t)s * n_heads + (size_t)g * G) * D + i]);
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += DEC_NT) {
    for (int h = 0; h < G; h++) {
      float dot = 0.0f;
      for (int d = 0; d < D; d++) dot += qs[h * D + d] * pool_val(p, p.k, p.k_scale, hidx, i, d);
      lg[(size_t)h * B + i] = dot * scale;
    }
  }
  for (int h = 0; h < G; h++) {
    float m = -FLT_MAX;
    for (int i = threadIdx.x; i < n; i += DEC_NT) m = fmaxf(m, lg[(size_t)h * B + i]);
    m = block_reduce(m, 1, red);
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n; i += DEC_NT) {
      const float e = expf(lg[(size_t)h * B + i] - m);
      lg[(size_t)h * B + i] = e;
      sum += e;
    }
    sum = block_reduce(sum, 0, red);
    if (threadIdx.x == 0) {
      mh[h] = m;
      lh[h] = sum;
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * D; idx += DEC_NT) {
    const int h = idx / D, d = idx % D;
    float o = 0.0f;
    for (int i = 0; i < n; i++) o += lg[(size_t)h * B + i] * pool_val(p, p.v, p.v_scale, hidx, i, d);
    out[((size_t)s * n_heads + (size_t)g * G + h) * D + d] = __float2bfloat16(o / lh[h]);
  }
  if (policy == LF_POLICY_FULL) {
    if (threadIdx.x == 0) p.next[hidx] = -1;
    return;
  }
  const int ws = w[(size_t)s * hkv + g];
  if (policy == LF_POLICY_RKV) { /* as the fused kernel's score_key and finish_head */
    const int sn = lf_rkv_advance(p.since[hidx]), kl = lf_rkv_k_left(sn, n, B, p.stage);
    const int obs = lf_rkv_obs_of(p.obs);
    if (kl < obs) {
      const bool reset = lf_rkv_window_reset(sn, kl, obs);
      float *acc = p.acc + hidx * B;
      for (int i = threadIdx.x; i < n; i += DEC_NT) {
        float mass = 0.0f;
        for (int h = 0; h < G; h++) mass += lg[(size_t)h * B + i] / lh[h];
        acc[i] = (reset || i == ws ? 0.0f : acc[i]) + mass;
      }
    }
    __syncthreads(); /* every thread has read since */
    if (threadIdx.x == 0) {
      p.since[hidx] = sn;
      p.next[hidx] = lf_rkv_next(p.queue + hidx * p.stage, sn, p.stage);
    }
    return;
  }
  if (policy == LF_POLICY_H2O) {
    /* the mass accumulates from the write on: the slot just written starts from this step's */
    float *acc = p.acc + hidx * B;
    for (int i = threadIdx.x; i < n; i += DEC_NT) {
      float mass = 0.0f;
      for (int h = 0; h < G; h++) mass += lg[(size_t)h * B + i] / lh[h];
      acc[i] = lf_evict_h2o_acc(acc[i], mass, i == ws);
    }
  }
  /* layer scope (scores): lf_cuda_layer_argmin applies the window and overwrites next */
  const int rfrom = policy == LF_POLICY_H2O && !scores
                        ? h2o_window<DEC_NT>(p.pos + hidx * B, n, ws, recent, redi)
                        : INT_MAX;
  unsigned long long best = ~0ull;
  for (int i = threadIdx.x; i < n; i += DEC_NT) {
    if (i < sink || i == ws) continue;
    const int32_t pos = p.pos[hidx * B + i];
    unsigned long long key;
    if (policy == LF_POLICY_H2O) {
      /* scores for layer scope: every candidate's, the recent ones too (layer_argmin
       * excludes them by the same rule) */
      const float sc = p.acc[hidx * B + i];
      if (scores) scores[((size_t)s * hkv + g) * B + i] = sc;
      key = lf_evict_key_f(sc, i);
    } else if (policy == LF_POLICY_STREAMING) {
      key = lf_evict_key((uint32_t)pos, i);
    } else {
      float mass = 0.0f;
      for (int h = 0; h < G; h++) mass += lg[(size_t)h * B + i] / lh[h];
      const float sc = lf_evict_longflow_score(p.vnorm[hidx * B + i], mass);
      key = lf_evict_key_f(sc, i);
      if (scores) scores[((size_t)s * hkv + g) * B + i] = sc;
    }
    if (lf_evict_candidate(i, sink, ws, pos, rfrom)) best = key < best ? key : best;
  }
  best = block_min_key(best, redk);
  if (threadIdx.x == 0) p.next[hidx] = lf_evict_slot_of(best);
}

extern "C" size_t lf_cuda_decode_attn_simple_scratch(int n_seq, int n_heads, int budget) {
  return (size_t)n_seq * n_heads * budget;
}

extern "C" lf_status lf_cuda_decode_attn_simple(const lf_cuda_pool_view *pv, int layer, int n_seq,
                                                const int32_t *pool_ids, const int32_t *w,
                                                int n_heads, const void *q, float scale, int sink,
                                                lf_policy policy, int recent, void *out,
                                                float *scratch, float *scores,
                                                cudaStream_t stream) {
  if (!pv || !pool_ids || !w || !q || !out || !scratch || n_heads % pv->n_kv_heads ||
      n_seq < 0 || n_seq > 65535)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_decode_attn_simple: bad arguments");
  if (policy != LF_POLICY_LONGFLOW && policy != LF_POLICY_FULL && policy != LF_POLICY_STREAMING &&
      policy != LF_POLICY_H2O && policy != LF_POLICY_RKV)
    return lf_error(LF_ERR_UNSUPPORTED, "lf_cuda_decode_attn_simple: policy %d", (int)policy);
  if (policy == LF_POLICY_RKV && (!pv->acc || !pv->queue || !pv->since || pv->stage < 1))
    return lf_error(LF_ERR_INVALID_ARG,
                    "lf_cuda_decode_attn_simple: rkv needs the pool's acc, queue and since and a "
                    "stage >= 1 (got %d)", pv->stage);
  if (policy == LF_POLICY_H2O && !pv->acc)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_decode_attn_simple: h2o needs the pool's acc");
  if (!lf_kvq_fits(pv->kv_dtype, pv->head_dim) ||
      (pv->kv_dtype != LF_KV_BF16 && (!pv->k_scale || !pv->v_scale)))
    return lf_error(LF_ERR_UNSUPPORTED, "lf_cuda_decode_attn_simple: kv dtype %d (scales %s)",
                    pv->kv_dtype, pv->k_scale ? "set" : "missing");
  if (n_seq == 0) return LF_OK;
  const int G = n_heads / pv->n_kv_heads;
  const size_t smem = ((size_t)G * pv->head_dim + 2 * (size_t)G) * sizeof(float);
  if (smem > 48 * 1024)
    return lf_error(LF_ERR_UNSUPPORTED, "lf_cuda_decode_attn_simple: group %d x head_dim %d", G,
                    pv->head_dim);
  decode_simple_kernel<<<dim3(pv->n_kv_heads, n_seq), DEC_NT, smem, stream>>>(
      *pv, layer, pool_ids, w, n_heads, (const __nv_bfloat16 *)q, scale, sink, (int)policy,
      recent, (__nv_bfloat16 *)out, scratch,
      policy == LF_POLICY_LONGFLOW || policy == LF_POLICY_H2O ? scores : NULL);
  LF_CUDA_CHECK_LAUNCH("decode_simple_kernel");
  return LF_OK;
}

/* One block per (sequence s, group c of `per` KV heads): the sum of the group's scores per slot
 * (in head order), its argmin over slots >= sink except the one written this step (lowest slot
 * on ties), written to next of every head of the group. All heads of a group hold the same n
 * and wrote the same slot: they have shared every decision since the pool was taken. */
static __global__ void layer_argmin_kernel(lf_cuda_pool_view p, int layer, const int32_t *pool_ids,
                                           const int32_t *w, int sink, int recent, int per,
                                           const float *scores) {
  __shared__ unsigned long long redk[DEC_NT / 32];
  __shared__ int redi[DEC_NT / 32];
  const int s = blockIdx.x, g0 = blockIdx.y * per, hkv = p.n_kv_heads, B = p.budget;
  const size_t hidx = ((size_t)pool_ids[s] * p.n_layers + layer) * hkv + g0;
  const int n = p.n[hidx], ws = w[(size_t)s * hkv + g0];
  const float *sc = scores + ((size_t)s * hkv + g0) * B;
  /* h2o (recent > 0): the group's heads hold the same positions, so the first head's rank them */
  const int rfrom = h2o_window<DEC_NT>(p.pos + hidx * B, n, ws, recent, redi);
  unsigned long long best = ~0ull;
  for (int i = sink + (int)threadIdx.x; i < n; i += DEC_NT) {
    if (!lf_evict_candidate(i, sink, ws, p.pos[hidx * B + i], rfrom)) continue;
    float sum = 0.0f;
    for (int gg = 0; gg < per; gg++) sum += sc[(size_t)gg * B + i];
    const unsigned long long key = lf_evict_key_f(sum, i);
    best = key < best ? key : best;
  }
  best = block_min_key(best, redk);
  if (threadIdx.x < per) p.next[hidx + threadIdx.x] = lf_evict_slot_of(best);
}

extern "C" lf_status lf_cuda_layer_argmin(const lf_cuda_pool_view *pv, int layer, int n_seq,
                                          const int32_t *pool_ids, const int32_t *w, int sink,
                                          int recent, int per, const float *scores,
                                          cudaStream_t stream) {
  if (!pv || !pool_ids || !w || !scores || per < 1 || per > DEC_NT || pv->n_kv_heads % per ||
      n_seq < 0 || n_seq > 65535 || sink < 0 || layer < 0 || layer >= pv->n_layers)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_layer_argmin: bad arguments");
  if (n_seq == 0) return LF_OK;
  layer_argmin_kernel<<<dim3(n_seq, pv->n_kv_heads / per), DEC_NT, 0, stream>>>(
      *pv, layer, pool_ids, w, sink, recent, per, scores);
  LF_CUDA_CHECK_LAUNCH("layer_argmin_kernel");
  return LF_OK;
}

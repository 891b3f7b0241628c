/* Prefill attention, SnapKV selection and the chunk store (see prefill_attn.cuh). Simple
 * one-warp kernels: correctness first. */
#include "attention/prefill_attn.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <float.h>

#include "attention/pool_row.cuh"
#include "base/cuda_check.h"

#define ATT_DMAX 256
#define ATT_ND (ATT_DMAX / 32) /* dims per lane */

/* One warp per (query head h, token t): grid [n_heads, n_tok]. Keys come 32 at a time, lane j
 * computing key j's logit; an online softmax keeps (max, sum) and each lane accumulates the
 * output dims lane, lane + 32, ... */
static __global__ void prefill_attn_kernel(lf_cuda_pool_view p, int pool, int layer, int n0,
                                           int n_heads, const __nv_bfloat16 *q,
                                           const __nv_bfloat16 *k, const __nv_bfloat16 *v,
                                           float scale, __nv_bfloat16 *out, float *ml) {
  __shared__ float qs[ATT_DMAX];
  const int h = blockIdx.x, t = blockIdx.y, lane = threadIdx.x, D = p.head_dim;
  const int hkv = p.n_kv_heads, g = h / (n_heads / hkv);
  const size_t hidx = ((size_t)pool * p.n_layers + layer) * hkv + g;
  const __nv_bfloat16 *qr = q + ((size_t)t * n_heads + h) * D;
  for (int d = lane; d < D; d += 32) qs[d] = __bfloat162float(qr[d]);
  __syncwarp();
  const int nk = n0 + t + 1;
  float m = -FLT_MAX, s = 0.0f, acc[ATT_ND];
#pragma unroll
  for (int i = 0; i < ATT_ND; i++) acc[i] = 0.0f;
  for (int base = 0; base < nk; base += 32) {
    const int kk = base + lane;
    float l = -FLT_MAX;
    if (kk < nk) {
      const __nv_bfloat16 *kr =
          kk < n0 ? pool_row(p, p.k, hidx, kk) : k + ((size_t)(kk - n0) * hkv + g) * D;
      float dot = 0.0f;
      for (int d = 0; d < D; d++) dot += qs[d] * __bfloat162float(kr[d]);
      l = dot * scale;
    }
    float tm = l;
    for (int o = 16; o > 0; o >>= 1) tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, o));
    const float mn = fmaxf(m, tm);
    const float corr = expf(m - mn);
    const float pj = kk < nk ? expf(l - mn) : 0.0f;
    float ps = pj;
    for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
    s = s * corr + ps;
    m = mn;
#pragma unroll
    for (int i = 0; i < ATT_ND; i++) acc[i] *= corr;
    const int cnt = nk - base < 32 ? nk - base : 32;
    for (int j = 0; j < cnt; j++) {
      const float pb = __shfl_sync(0xffffffffu, pj, j);
      const int kj = base + j;
      const __nv_bfloat16 *vr =
          kj < n0 ? pool_row(p, p.v, hidx, kj) : v + ((size_t)(kj - n0) * hkv + g) * D;
#pragma unroll
      for (int i = 0; i < ATT_ND; i++) {
        const int d = lane + 32 * i;
        if (d < D) acc[i] += pb * __bfloat162float(vr[d]);
      }
    }
  }
  __nv_bfloat16 *o = out + ((size_t)t * n_heads + h) * D;
#pragma unroll
  for (int i = 0; i < ATT_ND; i++) {
    const int d = lane + 32 * i;
    if (d < D) o[d] = __float2bfloat16(acc[i] / s);
  }
  if (ml && lane == 0) {
    ml[((size_t)t * n_heads + h) * 2] = m;
    ml[((size_t)t * n_heads + h) * 2 + 1] = s;
  }
}

extern "C" lf_status lf_cuda_prefill_attn(const lf_cuda_pool_view *pv, int pool, int layer,
                                          int n0, int n_heads, int n_tok, const void *q,
                                          const void *k, const void *v, float scale, void *out,
                                          float *ml, cudaStream_t stream) {
  if (!pv || !q || !k || !v || !out || pv->head_dim > ATT_DMAX || n_heads % pv->n_kv_heads ||
      n_tok < 0 || n_tok > 65535 || n0 < 0 || n0 > pv->budget)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_prefill_attn: bad arguments");
  if (n_tok == 0) return LF_OK;
  prefill_attn_kernel<<<dim3(n_heads, n_tok), 32, 0, stream>>>(
      *pv, pool, layer, n0, n_heads, (const __nv_bfloat16 *)q, (const __nv_bfloat16 *)k,
      (const __nv_bfloat16 *)v, scale, (__nv_bfloat16 *)out, ml);
  LF_CUDA_CHECK_LAUNCH("prefill_attn_kernel");
  return LF_OK;
}

/* snap[g][0][j], j < L = n_tok - w_eff: the softmax weight of key j summed over the last w_eff
 * queries and the group's heads. One thread per (j, g), a fixed summation order. */
static __global__ void snapkv_score_kernel(int n_heads, int hkv, int D, int n_tok, int w_eff,
                                           const __nv_bfloat16 *q, const __nv_bfloat16 *k,
                                           const float *ml, float scale, float *snap) {
  const int g = blockIdx.y, L = n_tok - w_eff, G = n_heads / hkv;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= L) return;
  const __nv_bfloat16 *kr = k + ((size_t)j * hkv + g) * D;
  float s = 0.0f;
  for (int t = L; t < n_tok; t++)
    for (int hh = 0; hh < G; hh++) {
      const int h = g * G + hh;
      const __nv_bfloat16 *qr = q + ((size_t)t * n_heads + h) * D;
      float dot = 0.0f;
      for (int d = 0; d < D; d++) dot += __bfloat162float(qr[d]) * __bfloat162float(kr[d]);
      const float *mls = ml + ((size_t)t * n_heads + h) * 2;
      s += expf(dot * scale - mls[0]) / mls[1];
    }
  snap[(size_t)g * 2 * n_tok + j] = s;
}

/* One block per KV head: pooled scores (width-5 average, zero padded, divided by 5), the rank of
 * every candidate (higher score first, ties to the lower position), then the slot of every kept
 * token in position order. */
static __global__ void snapkv_select_kernel(int n_tok, int budget, int sink, int w_eff,
                                            float *snap, int32_t *slot_of) {
  const int g = blockIdx.x, L = n_tok - w_eff, n_mid = budget - 1 - sink - w_eff;
  const float *raw = snap + (size_t)g * 2 * n_tok;
  float *ps = snap + (size_t)g * 2 * n_tok + n_tok;
  int32_t *keep = slot_of + (size_t)g * n_tok;
  for (int j = threadIdx.x; j < L; j += blockDim.x) {
    float s = 0.0f;
    for (int d = -2; d <= 2; d++)
      if (j + d >= 0 && j + d < L) s += raw[j + d];
    ps[j] = s / 5.0f;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < n_tok; j += blockDim.x) {
    int kept = j < sink || j >= L;
    if (!kept) {
      const float sj = ps[j];
      int rank = 0;
      for (int i = sink; i < L && rank < n_mid; i++)
        rank += ps[i] > sj || (ps[i] == sj && i < j);
      kept = rank < n_mid;
    }
    keep[j] = kept;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int slot = 0;
    for (int j = 0; j < n_tok; j++) keep[j] = keep[j] ? slot++ : -1;
  }
}

extern "C" lf_status lf_cuda_snapkv_select(int n_heads, int n_kv_heads, int head_dim, int n_tok,
                                           int budget, int sink, int w_eff, const void *q,
                                           const void *k, const float *ml, float scale,
                                           float *snap, int32_t *slot_of, cudaStream_t stream) {
  if (!q || !k || !ml || !snap || !slot_of || n_kv_heads < 1 || n_heads % n_kv_heads ||
      n_tok < budget || w_eff < 0 || sink < 0 || budget - 1 - sink - w_eff < 0 || n_kv_heads > 65535)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_snapkv_select: bad arguments");
  const int L = n_tok - w_eff;
  if (L > 0) {
    snapkv_score_kernel<<<dim3((L + 127) / 128, n_kv_heads), 128, 0, stream>>>(
        n_heads, n_kv_heads, head_dim, n_tok, w_eff, (const __nv_bfloat16 *)q,
        (const __nv_bfloat16 *)k, ml, scale, snap);
    LF_CUDA_CHECK_LAUNCH("snapkv_score_kernel");
  }
  snapkv_select_kernel<<<n_kv_heads, 1024, 0, stream>>>(n_tok, budget, sink, w_eff, snap, slot_of);
  LF_CUDA_CHECK_LAUNCH("snapkv_select_kernel");
  return LF_OK;
}

/* One warp per (chunk token t, KV head g). */
static __global__ void kv_store_kernel(lf_cuda_pool_view p, int pool, int layer, int n_tok,
                                       int32_t pos0, const __nv_bfloat16 *k,
                                       const __nv_bfloat16 *v, const int32_t *slot_of, int n0,
                                       int n_final) {
  const int t = blockIdx.x, g = blockIdx.y, lane = threadIdx.x, D = p.head_dim;
  const size_t hidx = ((size_t)pool * p.n_layers + layer) * p.n_kv_heads + g;
  const int slot = slot_of ? slot_of[(size_t)g * n_tok + t] : n0 + t;
  if (slot >= 0) {
    const __nv_bfloat16 *ks = k + ((size_t)t * p.n_kv_heads + g) * D;
    const __nv_bfloat16 *vs = v + ((size_t)t * p.n_kv_heads + g) * D;
    __nv_bfloat16 *kd = (__nv_bfloat16 *)p.k + (hidx * p.budget + slot) * D;
    __nv_bfloat16 *vd = (__nv_bfloat16 *)p.v + (hidx * p.budget + slot) * D;
    float l1 = 0.0f;
    for (int d = lane; d < D; d += 32) {
      kd[d] = ks[d];
      vd[d] = vs[d];
      l1 += fabsf(__bfloat162float(vs[d]));
    }
    for (int o = 16; o > 0; o >>= 1) l1 += __shfl_xor_sync(0xffffffffu, l1, o);
    if (lane == 0) {
      p.vnorm[hidx * p.budget + slot] = l1;
      p.pos[hidx * p.budget + slot] = pos0 + t;
    }
  }
  if (t == 0 && lane == 0) {
    p.n[hidx] = n_final;
    p.next[hidx] = -1;
  }
}

extern "C" lf_status lf_cuda_kv_store(const lf_cuda_pool_view *pv, int pool, int layer, int n_tok,
                                      int32_t pos0, const void *k, const void *v,
                                      const int32_t *slot_of, int n0, int n_final,
                                      cudaStream_t stream) {
  if (!pv || !k || !v || n_tok < 0 || n_final < 0 || n_final > pv->budget ||
      (!slot_of && n0 + n_tok > pv->budget))
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_kv_store: bad arguments");
  if (n_tok == 0) return LF_OK;
  kv_store_kernel<<<dim3(n_tok, pv->n_kv_heads), 32, 0, stream>>>(
      *pv, pool, layer, n_tok, pos0, (const __nv_bfloat16 *)k, (const __nv_bfloat16 *)v, slot_of,
      n0, n_final);
  LF_CUDA_CHECK_LAUNCH("kv_store_kernel");
  return LF_OK;
}

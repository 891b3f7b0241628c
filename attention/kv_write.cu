/* Bias, q/k norm, RoPE and the decode-step KV slot write (see kv_write.cuh). */
#include "attention/kv_write.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "base/cuda_check.h"
#include "base/cuda_ptx.cuh"
#include "base/cuda_launch.cuh"
#include "base/kvrot.h"

#define ROPE_DMAX 256
#define ROPE_WARPS 4 /* heads per block: one-warp blocks made a 2048-token prefill launch-bound */

/* One warp per (head, token): grid [ceil((n_heads + n_kv_heads) / ROPE_WARPS), n_tok], block
 * [32, ROPE_WARPS]. Head x < n_heads is a query head; the others are KV head g = x - n_heads and
 * do both k and v. Warps share nothing but the block. */
static __global__ void qkv_rope_kernel(lf_qkv_rope_args a) {
  __shared__ float sbuf[ROPE_WARPS][ROPE_DMAX];
  const int hx = (int)(blockIdx.x * ROPE_WARPS + threadIdx.y);
  if (hx >= a.n_heads + a.n_kv_heads) return;
  float *buf = sbuf[threadIdx.y];
  const int t = blockIdx.y, lane = threadIdx.x, D = a.head_dim, half = D / 2;
  const int is_q = hx < a.n_heads;
  const int g = is_q ? 0 : hx - a.n_heads;
  const int qd = a.n_heads * D, kd = a.n_kv_heads * D;
  const int off = is_q ? hx * D : qd + g * D; /* column of this head in qkv */
  const float *src = a.qkv + (size_t)t * a.qkv_stride;
  /* Before the wait, what no recent kernel writes: the positions and pool ids (uploaded before
   * the pass), the pool's fill and eviction candidate (written by the previous step's kernels of
   * this layer: when a PDL kernel starts, every kernel but the one just before it has completed,
   * cuda_launch.cuh) and the rotation angles. Then wait for qkv. */
  const int32_t pos = a.pos ? a.pos[t] : a.pos0 + t;
  float rs[ROPE_DMAX / 64], rc[ROPE_DMAX / 64];
#pragma unroll
  for (int j = 0; j < ROPE_DMAX / 64; j++)
    if (lane + 32 * j < half) sincosf((float)pos * a.inv_freq[lane + 32 * j], &rs[j], &rc[j]);
  size_t hidx = 0;
  int n = 0, w = -1;
  if (!is_q && a.pool.k) {
    hidx = ((size_t)a.pool_ids[t] * a.pool.n_layers + a.layer) * a.n_kv_heads + g;
    n = a.pool.n[hidx];
    w = lf_evict_slot_for_write(n, a.pool.next[hidx], a.pool.budget, a.sink, a.policy);
  }
  pdl_wait(); /* qkv comes from the previous kernel (base/cuda_launch.cuh) */
  pdl_trigger();

  for (int d = lane; d < D; d += 32) buf[d] = src[off + d] + (a.bias ? a.bias[off + d] : 0.0f);
  __syncwarp();
  const float *nw = is_q ? a.q_norm : a.k_norm;
  if (nw) {
    float ss = 0.0f;
    for (int d = lane; d < D; d += 32) ss += buf[d] * buf[d];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float r = 1.0f / sqrtf(ss / (float)D + a.eps);
    __syncwarp();
    for (int d = lane; d < D; d += 32) buf[d] = nw[d] * (buf[d] * r);
    __syncwarp();
  }
  /* rotate pairs; each lane owns whole pairs so no other lane reads what it writes */
#pragma unroll
  for (int j = 0; j < ROPE_DMAX / 64; j++) {
    const int i = lane + 32 * j;
    if (i >= half) break;
    const float s = rs[j], c = rc[j];
    const int i0 = a.interleaved ? 2 * i : i, i1 = a.interleaved ? 2 * i + 1 : i + half;
    const float x0 = buf[i0], x1 = buf[i1];
    buf[i0] = x0 * c - x1 * s;
    buf[i1] = x1 * c + x0 * s;
  }
  __syncwarp();
  if (a.rot) { /* base/kvrot.h: the same pairs as lf_rot_row, one stage at a time */
    const int block = lf_rot_block(D);
    for (int h = 1; h < block; h <<= 1) {
      for (int p = lane; p < half; p += 32) lf_rot_pair(buf, ((p & ~(h - 1)) << 1) | (p & (h - 1)), h);
      __syncwarp();
    }
    const float sc = lf_rot_scale(block, is_q);
    for (int d = lane; d < D; d += 32) buf[d] *= sc;
    __syncwarp();
  }
  if (!is_q && a.k_mean) { /* as the cpu forward: after the rotation, in fp32 */
    const float *mu = a.k_mean + (size_t)g * D;
    for (int d = lane; d < D; d += 32) buf[d] -= mu[d];
    __syncwarp();
  }

  if (is_q) {
    __nv_bfloat16 *q = (__nv_bfloat16 *)a.q_out + (size_t)t * qd + (size_t)hx * D;
    for (int d = lane; d < D; d += 32) q[d] = __float2bfloat16(buf[d]);
    return;
  }
  const float *vsrc = src + qd + kd + g * D;
  const float *vb = a.bias ? a.bias + qd + kd + g * D : NULL;
  if (a.k_out) {
    __nv_bfloat16 *k = (__nv_bfloat16 *)a.k_out + (size_t)t * kd + (size_t)g * D;
    __nv_bfloat16 *v = (__nv_bfloat16 *)a.v_out + (size_t)t * kd + (size_t)g * D;
    for (int d = lane; d < D; d += 32) {
      k[d] = __float2bfloat16(buf[d]);
      v[d] = __float2bfloat16(vsrc[d] + (vb ? vb[d] : 0.0f));
    }
  }
  if (!a.pool.k) return;
  const int B = a.pool.budget;
  if (w >= 0) {
    /* the row the pool stores is the bf16 rounding of k and v (what k_out/v_out hold), then,
     * under fp8, quantized from those values as a prompt chunk's rows are */
    float kx[ROPE_DMAX / 32], vx[ROPE_DMAX / 32];
#pragma unroll
    for (int i = 0; i < ROPE_DMAX / 32; i++) {
      const int d = lane + 32 * i;
      kx[i] = d < D ? __bfloat162float(__float2bfloat16(buf[d])) : 0.0f;
      vx[i] = d < D ? __bfloat162float(__float2bfloat16(vsrc[d] + (vb ? vb[d] : 0.0f))) : 0.0f;
    }
    const size_t row = hidx * B + w;
    lf_kvq_store_row(a.pool, a.pool.k, a.pool.k_scale, row, kx, D, lane);
    const float l1 = lf_kvq_store_row(a.pool, a.pool.v, a.pool.v_scale, row, vx, D, lane);
    if (lane == 0) {
      a.pool.vnorm[hidx * B + w] = l1;
      a.pool.pos[hidx * B + w] = pos;
      if (n < B) a.pool.n[hidx] = n + 1;
    }
  }
  if (lane == 0) a.w[(size_t)t * a.n_kv_heads + g] = w;
}

extern "C" lf_status lf_cuda_qkv_rope(const lf_qkv_rope_args *a, cudaStream_t stream) {
  if (!a || !a->qkv || !a->inv_freq || !a->q_out || (!a->k_out != !a->v_out))
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_qkv_rope: NULL argument");
  if (a->head_dim < 2 || a->head_dim > ROPE_DMAX || a->head_dim % 2 || a->n_heads < 1 ||
      a->n_kv_heads < 1 || a->n_tok < 0 || a->n_tok > 65535)
    return lf_error(LF_ERR_UNSUPPORTED, "lf_cuda_qkv_rope: head_dim %d (even, <= %d), %d tokens",
                    a->head_dim, ROPE_DMAX, a->n_tok);
  const lf_cuda_pool_view *pv = &a->pool;
  if (pv->k && (!pv->v || !pv->vnorm || !pv->pos || !pv->n || !pv->next || !a->pool_ids || !a->w ||
                a->layer < 0 || a->layer >= pv->n_layers || pv->budget < 1 ||
                pv->n_kv_heads != a->n_kv_heads || pv->head_dim != a->head_dim ||
                (pv->kv_dtype != LF_KV_BF16 && (!pv->k_scale || !pv->v_scale))))
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_qkv_rope: incomplete pool write");
  if (pv->k && !lf_kvq_fits(pv->kv_dtype, pv->head_dim))
    return lf_error(LF_ERR_UNSUPPORTED, "lf_cuda_qkv_rope: kv dtype %d", pv->kv_dtype);
  if (a->n_tok == 0) return LF_OK;
  lf_launch(qkv_rope_kernel, dim3((a->n_heads + a->n_kv_heads + ROPE_WARPS - 1) / ROPE_WARPS, a->n_tok),
            dim3(32, ROPE_WARPS), 0, stream, *a);
  LF_CUDA_CHECK_LAUNCH("qkv_rope_kernel");
  return LF_OK;
}

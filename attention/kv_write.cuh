/* Step 1 of the decode step on the GPU (docs/DESIGN.md §3): the KV slot write, fused with what
 * produces its inputs. From the fused QKV GEMM output, one kernel does the q/k/v bias (qwen2),
 * q/k RMSNorm over head_dim (qwen3), RoPE (both styles; the frequency table comes from
 * lf_rope_freqs, llama3 scaling included) and the rounding to bf16, and, for a decode step,
 * writes the new k/v into the pool slot w = (n < B) ? n++ : next chosen by the previous step
 * (lf_evict_slot_for_write, attention/evict.cuh),
 * with ||v||_1 (of exactly the bf16 values stored, so the LongFlow score of the slot matches what
 * is in the pool) and the position cached. w is returned per (token, KV head) for
 * lf_cuda_decode_attn, which must not pick the slot just written. When a pool has no slot for
 * the token (full policy and n == B, or a full pool whose next is not valid) nothing is written
 * and w = -1: the engine checks context length on the host before the step.
 * Prefill chunks use the same kernel without the pool write (k, v out for the prefill attention).
 *
 * Includable from C; bf16 buffers are void *; every pointer is device memory.
 */
#ifndef LF_KV_WRITE_CUH
#define LF_KV_WRITE_CUH

#include <stddef.h>
#include <stdint.h>

#include "base/kvq.h"
#include "lfserve.h"
#include "memory/pool.h"

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st;

typedef struct lf_qkv_rope_args {
  const float *qkv;       /* fp32 [n_tok][qkv_stride]: q heads, then k heads, then v heads */
  size_t qkv_stride;      /* >= (n_heads + 2 n_kv_heads) head_dim */
  const float *bias;      /* fp32 [(n_heads + 2 n_kv_heads) head_dim] or NULL */
  const float *q_norm, *k_norm; /* fp32 [head_dim] each, or NULL (no q/k norm) */
  float eps;
  const float *inv_freq;  /* fp32 [head_dim / 2] */
  int interleaved;        /* 1: llama2.c pairs (2i, 2i+1); 0: HF halves (i, i + hd/2) */
  int n_heads, n_kv_heads, head_dim; /* head_dim even, <= 256 */
  int n_tok;
  const int32_t *pos;     /* [n_tok] positions, or NULL: token t is at pos0 + t */
  int32_t pos0;
  void *q_out;            /* bf16 [n_tok][n_heads head_dim] post-RoPE */
  void *k_out, *v_out;    /* bf16 [n_tok][n_kv_heads head_dim], or NULL (decode: pool only) */
  /* Decode write into the pool (pool.k NULL: no write; pool.n_kv_heads and pool.head_dim must
   * equal n_kv_heads and head_dim). Token t belongs to pool pool_ids[t]. */
  lf_cuda_pool_view pool;
  const int32_t *pool_ids; /* [n_tok] */
  int layer, sink;
  lf_policy policy;
  int32_t *w;             /* [n_tok][n_kv_heads] out: slot written, -1 when none */
  int rot;                /* 1: q and k leave rotated (base/kvrot.h), for pools whose dtype
                             stores rotated keys (lf_kv_rotates); 0: as RoPE leaves them */
  const float *k_mean;    /* fp32 [n_kv_heads][head_dim] or NULL: subtracted from each key after
                             RoPE (and the rotation), before the rounding to bf16 and the pool
                             write (lf_engine_config.key_means); queries unchanged */
} lf_qkv_rope_args;

lf_status lf_cuda_qkv_rope(const lf_qkv_rope_args *a, struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif

#ifdef __CUDACC__
#include <cuda_bf16.h>

#include "attention/evict.cuh"
#include "attention/pool_row.cuh"

/* One warp stores one (slot, KV head) row of K or V in the pool's dtype: lane l holds the values
 * of dims l, l + 32, ... in x[] (dims >= D ignored). base: p.k or p.v; scales: p.k_scale or
 * p.v_scale (fp8, int8: a scale per row; int4: head_dim / 32 meta words per row); row: hidx *
 * budget + slot. bf16 rounds each value; fp8 and int8 take the row's amax across the warp, int4
 * each group's min and max, and store codes and scales as base/kvq.h defines them. Returns, in every
 * lane, ||stored row||_1 (lane sums in dim order, then the xor reduction: the same bits the bf16
 * write always produced). */
template <int NE>
static __device__ __forceinline__ float lf_kvq_store_row(const lf_cuda_pool_view &p, void *base,
                                                         float *scales, size_t row,
                                                         const float (&x)[NE], int D, int lane) {
  float l1 = 0.0f;
  const int fmt = pool_fmt(p, base); /* this side's row format (pool_row.cuh) */
  if (fmt == LF_KV_INT4) {
    /* dims lane + 32 i are group i (D a multiple of 32): the group's min and max across the
     * warp, each lane's nibble, the 8 nibbles of a code word gathered by xor shuffles */
    uint32_t *words = (uint32_t *)base + row * (size_t)(D / 8);
    uint32_t *meta = (uint32_t *)scales + row * (size_t)(D / LF_I4_GROUP);
#pragma unroll
    for (int i = 0; i < NE; i++)
      if (32 * i < D) {
        const int finite = fabsf(x[i]) <= 3.40282347e38f;
        float mn = finite ? x[i] : 3.40282347e38f, mx = finite ? x[i] : -3.40282347e38f;
        for (int o = 16; o > 0; o >>= 1) {
          mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, o));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        }
        const uint32_t m = lf_i4_group_meta(mn, mx, __any_sync(0xffffffffu, !finite));
        const uint8_t c = lf_i4_code(x[i], m);
        uint32_t w = (uint32_t)c << lf_i4_nibble_shift(lane);
        w |= __shfl_xor_sync(0xffffffffu, w, 1);
        w |= __shfl_xor_sync(0xffffffffu, w, 2);
        w |= __shfl_xor_sync(0xffffffffu, w, 4);
        if ((lane & 7) == 0) words[(lane + 32 * i) >> 3] = w;
        if (lane == 0) meta[i] = m;
        l1 += fabsf(lf_i4_value(c, m));
      }
  } else if (fmt != LF_KV_BF16) {
    float amax = 0.0f;
    int nonfinite = 0;
#pragma unroll
    for (int i = 0; i < NE; i++)
      if (lane + 32 * i < D) {
        const float a = fabsf(x[i]);
        if (!(a <= 3.40282347e38f)) nonfinite = 1;
        else amax = fmaxf(amax, a);
      }
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    nonfinite = __any_sync(0xffffffffu, nonfinite);
    const float sc = lf_kvq_row_scale(fmt, amax, nonfinite);
    uint8_t *dst = (uint8_t *)base + row * (size_t)D;
#pragma unroll
    for (int i = 0; i < NE; i++)
      if (lane + 32 * i < D) {
        const uint8_t c = lf_kvq_code(fmt, x[i], sc);
        dst[lane + 32 * i] = c;
        l1 += fabsf(lf_kvq_value(fmt, c, sc));
      }
    if (lane == 0) scales[row] = sc;
  } else {
    __nv_bfloat16 *dst = (__nv_bfloat16 *)base + row * (size_t)D;
#pragma unroll
    for (int i = 0; i < NE; i++)
      if (lane + 32 * i < D) {
        const __nv_bfloat16 b = __float2bfloat16(x[i]);
        dst[lane + 32 * i] = b;
        l1 += fabsf(__bfloat162float(b));
      }
  }
  for (int o = 16; o > 0; o >>= 1) l1 += __shfl_xor_sync(0xffffffffu, l1, o);
  return l1;
}
#endif
#endif

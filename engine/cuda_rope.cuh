/* From the fused QKV GEMM output to attention inputs, one kernel: q/k/v bias (qwen2), q/k
 * RMSNorm over head_dim (qwen3), RoPE (both styles; the frequency table comes from
 * lf_rope_freqs, llama3 scaling included), rounding to bf16, and, for a decode step, the write
 * of the new k/v into the pool slot w = (n < B) ? n++ : next chosen by the previous step, with
 * ||v||_1 (of the bf16 values stored) and the position cached (docs/DESIGN.md §3 step 1).
 *
 * Includable from C; bf16 buffers are void *; every pointer is device memory.
 */
#ifndef LF_CUDA_ROPE_CUH
#define LF_CUDA_ROPE_CUH

#include <stddef.h>
#include <stdint.h>

#include "lfserve.h"

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
  /* Decode write into the pool (all NULL: no write). Token t belongs to pool pool_ids[t]. */
  void *pk, *pv;          /* bf16 [n_pools][n_layers][n_kv_heads][budget][head_dim] */
  float *pvnorm;          /* [n_pools][n_layers][n_kv_heads][budget] */
  int32_t *ppos;          /* [n_pools][n_layers][n_kv_heads][budget] */
  int32_t *pn;            /* [n_pools][n_layers][n_kv_heads] */
  const int32_t *pnext;   /* [n_pools][n_layers][n_kv_heads] */
  const int32_t *pool_ids; /* [n_tok] */
  int n_layers, budget, layer, sink;
  lf_policy policy;
  int32_t *w;             /* [n_tok][n_kv_heads] out: slot written, -1 when none */
} lf_qkv_rope_args;

lf_status lf_cuda_qkv_rope(const lf_qkv_rope_args *a, struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif
#endif

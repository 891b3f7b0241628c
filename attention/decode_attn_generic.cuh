/* Generic decode attention with LongFlow scoring and argmin, for the shapes the fused kernel
 * (attention/decode_attn.cuh: head_dim 64/128, group <= 8) does not take. Same semantics as
 * lf_attn_decode_ref (attention/attention.h), fp32 math over bf16 inputs.
 *
 * Includable from C; bf16 buffers are void *; every pointer is device memory.
 */
#ifndef LF_DECODE_ATTN_GENERIC_CUH
#define LF_DECODE_ATTN_GENERIC_CUH

#include <stddef.h>
#include <stdint.h>

#include "lfserve.h"
#include "memory/pool.h"

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st;

/* Generic decode attention (steps 2-4 of docs/DESIGN.md §3) for a batch of sequences, after the write
 * of step 1: for each (sequence s, KV head g) attends the group over the n filled slots, writes
 * out, and sets next (longflow: argmin of ||v||_1 * sum_h alpha; streaming: smallest position;
 * h2o: acc[i] += sum_h alpha (acc[w] starts from 0), argmin of acc outside the `recent` most
 * recent slots by position; full: -1) over slots >= sink except w[s][g], lowest slot on ties;
 * rkv: the fused kernel's step (decode_attn.cuh: acc inside the observation window, since and
 * next = queue[since]; lf_cuda_rkv_select's due pass chooses after it).
 *   q, out: bf16 [n_seq][n_heads][head_dim]; w: [n_seq][n_kv_heads];
 *   scratch: fp32 >= lf_cuda_decode_attn_simple_scratch(n_seq, ...) floats; scores: NULL, or (layer
 *   scope, longflow or h2o) fp32 [n_seq][n_kv_heads][budget], every candidate's score
 *   (lf_cuda_layer_argmin, which applies h2o's window: the kernel then skips it). recent: h2o's
 *   recent window (ignored by the other policies). */
size_t lf_cuda_decode_attn_simple_scratch(int n_seq, int n_heads, int budget);
lf_status lf_cuda_decode_attn_simple(const lf_cuda_pool_view *pv, int layer, int n_seq,
                                     const int32_t *pool_ids, const int32_t *w, int n_heads,
                                     const void *q, float scale, int sink, lf_policy policy,
                                     int recent, void *out, float *scratch, float *scores,
                                     struct CUstream_st *stream);

/* Layer-scope eviction (docs/DESIGN.md §3), after either decode kernel ran with `scores`
 * (fp32 [n_seq][n_kv_heads][budget], longflow): the layer's KV heads in groups of `per`
 * contiguous heads (per = n_kv_heads: the whole layer; under tensor parallelism the rank's
 * heads), one slot per group: the argmin of the scores summed over the group's heads, over slots
 * >= sink except w[s][first head of the group] (and, recent > 0, h2o's recent most recent slots
 * by position), lowest slot on ties, written to next of every head of the group (-1 when there
 * is no candidate). */
lf_status lf_cuda_layer_argmin(const lf_cuda_pool_view *pv, int layer, int n_seq,
                               const int32_t *pool_ids, const int32_t *w, int sink, int recent,
                               int per,
                               const float *scores, struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif
#endif

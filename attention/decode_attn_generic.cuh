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
 * full: -1) over slots >= sink except w[s][g], lowest slot on ties.
 *   q, out: bf16 [n_seq][n_heads][head_dim]; w: [n_seq][n_kv_heads];
 *   scratch: fp32 >= lf_cuda_decode_attn_simple_scratch(n_seq, ...) floats. */
size_t lf_cuda_decode_attn_simple_scratch(int n_seq, int n_heads, int budget);
lf_status lf_cuda_decode_attn_simple(const lf_cuda_pool_view *pv, int layer, int n_seq,
                                     const int32_t *pool_ids, const int32_t *w, int n_heads,
                                     const void *q, float scale, int sink, lf_policy policy,
                                     void *out, float *scratch, struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif
#endif

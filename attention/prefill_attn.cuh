/* Prefill attention on the GPU (simple, correct first): causal GQA attention of a prompt chunk
 * over the pool's filled slots and the chunk, and the pool write after it (append, or SnapKV
 * compression of an empty pool, docs/DESIGN.md §3). Same semantics as lf_attn_prefill_ref
 * (attention/attention.h), fp32 math over bf16 inputs.
 *
 * Includable from C; bf16 buffers are void *; every pointer is device memory.
 */
#ifndef LF_PREFILL_ATTN_CUH
#define LF_PREFILL_ATTN_CUH

#include <stddef.h>
#include <stdint.h>

#include "lfserve.h"
#include "memory/pool.h"

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st;

/* Prefill attention for one sequence (pool `pool`, layer `layer`): query t (position pos0 + t)
 * of head h attends the n0 filled slots of its KV head and chunk tokens 0..t.
 *   q: bf16 [n_tok][n_heads][head_dim]; k, v: bf16 [n_tok][n_kv_heads][head_dim]
 *   out: bf16 [n_tok][n_heads][head_dim]
 *   ml: fp32 [n_tok][n_heads][2] (max logit, softmax normaliser) per query, for SnapKV; may be
 *       NULL. */
lf_status lf_cuda_prefill_attn(const lf_cuda_pool_view *pv, int pool, int layer, int n0,
                               int n_heads, int n_tok, const void *q, const void *k, const void *v,
                               float scale, void *out, float *ml, struct CUstream_st *stream);

/* lf_cuda_prefill_attn with the tensor-core kernel's 16-row tiles a warp chosen (head_dim 64
 * and 128; other head dims ignore it): 1 or 2, or 0 for the choice lf_cuda_prefill_attn makes
 * (by grid size). Results agree within bf16 rounding of P; for tests and lfbench. */
lf_status lf_cuda_prefill_attn_tiles(const lf_cuda_pool_view *pv, int pool, int layer, int n0,
                                     int n_heads, int n_tok, const void *q, const void *k,
                                     const void *v, float scale, void *out, float *ml,
                                     int warp_tiles, struct CUstream_st *stream);

/* SnapKV selection for an empty pool (n_tok > budget - 1): for every KV head the first `sink`
 * tokens, the last w_eff and the budget-1-sink-w_eff others of highest pooled score are kept.
 * Fills slot_of [n_kv_heads][n_tok] with the slot of each kept token (kept tokens fill slots
 * 0..budget-2 in position order) or -1. snap: fp32 scratch [n_kv_heads][2][n_tok]. q, k and ml as
 * passed to (and produced by) lf_cuda_prefill_attn. per: KV heads per eviction group (1: every
 * head its own selection; layer scope: the group's scores are summed, in head order, and the
 * group keeps one set); must divide n_kv_heads. */
lf_status lf_cuda_snapkv_select(int n_heads, int n_kv_heads, int head_dim, int n_tok, int budget,
                                int sink, int w_eff, int per, const void *q, const void *k,
                                const float *ml, float scale, float *snap, int32_t *slot_of,
                                struct CUstream_st *stream);

/* Writes chunk token t of every KV head into slot slot_of[g][t] (slot_of NULL: slot n0 + t;
 * -1: not kept) of (pool, layer), with ||v||_1 and position pos0 + t, then sets n = n_final and
 * next = -1 for every KV head. */
lf_status lf_cuda_kv_store(const lf_cuda_pool_view *pv, int pool, int layer, int n_tok,
                           int32_t pos0, const void *k, const void *v, const int32_t *slot_of,
                           int n0, int n_final, struct CUstream_st *stream);

/* Quantized pools (fp8, int8): the n0 first slots of every KV head of (pool, layer), dequantized
 * (base/kvq.h) and rounded to bf16, into pv->deq_k / deq_v ([n_kv_heads][budget][head_dim]).
 * lf_cuda_prefill_attn calls it itself: a chunk attends to the pool's stored slots as the decode
 * kernel reads them, and to its own tokens in bf16; lf_cuda_h2o_prefill_acc reads that copy. */
lf_status lf_cuda_pool_dequant(const lf_cuda_pool_view *pv, int pool, int layer, int n0,
                               struct CUstream_st *stream);

/* h2o after a chunk's prefill attention (ml as lf_cuda_prefill_attn wrote it; under fp8 / int8
 * it reads the pool's slots from the bf16 copy that call made): every key's softmax weight
 * from the chunk's queries that see it, summed over them and the group's heads (cs: fp32
 * scratch [n_heads][n0 + n_tok], one row a query head), goes into the pool's acc: appended (slot_of NULL) the n0
 * filled slots add theirs and chunk token t's slot n0 + t starts from its own; compressed
 * (slot_of as lf_cuda_snapkv_select filled it, n0 = 0) each kept token's slot starts from its
 * own. lf_attn_prefill_ref's accumulators, in fp32. */
lf_status lf_cuda_h2o_prefill_acc(const lf_cuda_pool_view *pv, int pool, int layer, int n0,
                                  int n_heads, int n_tok, const void *q, const void *k,
                                  const float *ml, float scale, const int32_t *slot_of, float *cs,
                                  struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif
#endif

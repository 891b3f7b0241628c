/* Token selection on the device under tensor parallelism, where each rank holds a vocab slice
 * of the logits (docs/DESIGN.md §4): greedy items by (max, id) pairs, sampled items with a top-k
 * by each rank's k best candidates. CPU twins: lf_argmax (engine/sample.h) over the whole
 * logits, lf_tp_topk_logits (engine/tp.h).
 * Includable from C; every pointer is device memory.
 */
#ifndef LF_KERNELS_TP_SELECT_CUH
#define LF_KERNELS_TP_SELECT_CUH

#include <stddef.h>
#include <stdint.h>

#include "kernels/sample.cuh"
#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st;

/* Tensor parallelism, greedy items, the vocab-parallel LM head (docs/DESIGN.md §4):
 * lf_cuda_argmax_pairs: for each item i < n of this rank's logits slice [n][n_vocab] (global ids
 * id0 ..), pairs[i] = (bits of the largest logit, its global id; lowest id on ties).
 * lf_cuda_tp_pick: all = every rank's pairs gathered [n_ranks][n][2]; tokens[i] = the id of the
 * largest value, the lowest rank on ties: exactly the argmax of the full logits. */
lf_status lf_cuda_argmax_pairs(const float *logits, int n_vocab, int n, int id0, int32_t *pairs,
                               struct CUstream_st *stream);
lf_status lf_cuda_tp_pick(const int32_t *all, int n_ranks, int n, int32_t *tokens,
                          struct CUstream_st *stream);

/* Tensor parallelism, sampled items with a top-k (engine/tp.h lf_tp_topk_logits, on the
 * device). lf_cuda_topk_pairs: for item i < n of this rank's slice [n][n_vocab] (global ids
 * id0 ..), pairs [n][kmax][2] get the (bits, global id) of its k largest logits, ties by lower
 * id, in no particular order, then (-inf, -1) up to kmax; k = 1 where params[i].temperature <= 0,
 * else params[i].top_k, at most kmax (params: device [n]). lf_cuda_scatter_pairs: full [n][vocab]
 * = -inf except every gathered candidate (all [n_ranks][n][kmax][2]) at its id. The global top-k
 * is among the candidates and sampling reads nothing else, so full gives the token the whole
 * logits give. */
lf_status lf_cuda_topk_pairs(const float *logits, int n_vocab, int n, int id0,
                             const lf_sample_params *params, int kmax, int32_t *pairs,
                             struct CUstream_st *stream);
lf_status lf_cuda_scatter_pairs(const int32_t *all, int n_ranks, int n, int kmax, int vocab,
                                float *full, struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif
#endif

/* Token selection on the GPU with the semantics of lf_sample (engine/sample.c): greedy argmax
 * (lowest id on ties), or temperature with optional top-k / top-p (the kept set from the
 * descending order), the draw walking the kept tokens in id order with the item's host-drawn
 * uniform u, so a seed gives the same token on both backends (up to logit
 * differences).
 *
 * Items without top-k/top-p are done by one launch for the whole batch. An item with them needs
 * its probabilities in descending order (ties by ascending id): lf_cuda_sample_sorted runs a
 * stable radix sort (CUB) over that item alone, in buffers sized once by
 * lf_cuda_sample_sort_bytes.
 * Includable from C; every pointer is device memory.
 */
#ifndef LF_KERNELS_SAMPLE_CUH
#define LF_KERNELS_SAMPLE_CUH

#include <stddef.h>
#include <stdint.h>

#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st;

typedef struct lf_sample_params {
  float temperature; /* <= 0: greedy */
  int top_k;         /* <= 0 or >= vocab: off */
  float top_p;       /* <= 0 or >= 1: off */
  float u;           /* uniform [0, 1) */
} lf_sample_params;

/* One entry of an item's logit processing (engine/sample.h lf_logit_adj) on its logits row. */
typedef struct lf_cuda_logit_adj {
  int32_t row;   /* the item's row of logits */
  int32_t token; /* distinct within a row */
  int32_t seen;
  float bias, sub;
  float rep; /* the item's repetition penalty (1 or 0: off) */
} lf_cuda_logit_adj;

/* logits[row][token] processed as lf_logits_adjust does on the host (same float operations, in
 * the same order, correctly rounded): + bias, repetition penalty when seen, - sub. entries:
 * device [n]. */
lf_status lf_cuda_logits_adjust(float *logits, int vocab, const lf_cuda_logit_adj *entries, int n,
                                struct CUstream_st *stream);

/* 1 when the item needs lf_cuda_sample_sorted (temperature > 0 with top-k or top-p). */
int lf_sample_needs_sort(const lf_sample_params *p, int vocab);

/* For every item i < n whose params do not need the sort: tokens[i] from logits[i] [vocab].
 * Items that do are skipped (tokens[i] untouched). params: device [n]; probs: fp32 scratch
 * [n][vocab]. */
lf_status lf_cuda_sample(const float *logits, int vocab, int n, const lf_sample_params *params,
                         int32_t *tokens, float *probs, struct CUstream_st *stream);

/* Scratch bytes for lf_cuda_sample_sorted at this vocabulary size. */
size_t lf_cuda_sample_sort_bytes(int vocab);

/* One item with top-k/top-p: *token from logits [vocab] with host params p; scratch of
 * lf_cuda_sample_sort_bytes(vocab) bytes, 256-byte aligned. */
lf_status lf_cuda_sample_sorted(const float *logits, int vocab, const lf_sample_params *p,
                                int32_t *token, void *scratch, size_t scratch_bytes,
                                struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif
#endif

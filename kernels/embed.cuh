/* Embedding gather of the cuda forward: bf16 rows to the fp32 residual stream, whole or one
 * rank's vocab slice (tensor parallelism). CPU twin: the embedding in engine/forward.c.
 * Includable from C; bf16 buffers are void *; every pointer is device memory.
 */
#ifndef LF_KERNELS_EMBED_CUH
#define LF_KERNELS_EMBED_CUH

#include <stddef.h>
#include <stdint.h>

#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st;

/* x[t] = fp32(embed[tokens[t]]); embed bf16 [vocab][dim], x fp32 [n_tok][dim]. */
lf_status lf_cuda_embed(const void *embed, int dim, const int32_t *tokens, int n_tok, float *x,
                        struct CUstream_st *stream);

/* Vocab-parallel embedding (tensor parallelism): embed bf16 [n_rows][dim] holds the rows
 * [vocab0, vocab0 + n_rows); x[t] = fp32(embed[tokens[t] - vocab0]) for tokens in the slice and
 * zeros for the others, so a sum over ranks is the full lookup, exactly. */
lf_status lf_cuda_embed_slice(const void *embed, int dim, int vocab0, int n_rows,
                              const int32_t *tokens, int n_tok, float *x,
                              struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif
#endif

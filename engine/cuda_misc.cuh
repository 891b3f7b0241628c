/* Small elementwise kernels of the cuda forward: embedding gather, SiLU(gate) * up, and the
 * device side of random:NAME weights (engine/random_weights.h).
 * Includable from C; bf16 buffers are void *; every pointer is device memory.
 */
#ifndef LF_CUDA_MISC_CUH
#define LF_CUDA_MISC_CUH

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

/* out[t][i] = bf16(silu(gu[t][i]) * gu[t][hidden + i]); gu fp32 [n_tok][2 hidden] (gate, up),
 * out bf16 [n_tok][hidden]. */
lf_status lf_cuda_silu_mul(const float *gu, int hidden, int n_tok, void *out,
                           struct CUstream_st *stream);

/* dst[i] = bf16(lf_rw_value(seed, tensor, LF_RW_MATRIX, scale, index0 + i)) for i < n. */
lf_status lf_cuda_random_bf16(void *dst, size_t n, uint64_t seed, uint32_t tensor, float scale,
                              uint64_t index0, struct CUstream_st *stream);

/* A [n_rows][n_cols] slice at (row0, col0) of a random [.][cols] matrix: dst[r][j] is the value
 * the whole matrix holds at (row0 + r, col0 + j), i.e. global index (row0 + r) * cols + col0 + j
 * (a tensor-parallel rank's rows or columns). */
lf_status lf_cuda_random_bf16_slice(void *dst, int64_t n_rows, int64_t n_cols, int64_t cols,
                                    int64_t row0, int64_t col0, uint64_t seed, uint32_t tensor,
                                    float scale, struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif
#endif

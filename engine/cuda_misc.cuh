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

/* out[t][i] = bf16(silu(gu[t][i]) * gu[t][hidden + i]); gu fp32 [n_tok][2 hidden] (gate, up),
 * out bf16 [n_tok][hidden]. */
lf_status lf_cuda_silu_mul(const float *gu, int hidden, int n_tok, void *out,
                           struct CUstream_st *stream);

/* dst[i] = bf16(lf_rw_value(seed, tensor, LF_RW_MATRIX, scale, index0 + i)) for i < n. */
lf_status lf_cuda_random_bf16(void *dst, size_t n, uint64_t seed, uint32_t tensor, float scale,
                              uint64_t index0, struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif
#endif

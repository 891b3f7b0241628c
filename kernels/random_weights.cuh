/* The device side of random:NAME weights (engine/random_weights.h, the host twin): the same
 * counter-based values, generated in place in bf16.
 * Includable from C; bf16 buffers are void *; every pointer is device memory.
 */
#ifndef LF_KERNELS_RANDOM_WEIGHTS_CUH
#define LF_KERNELS_RANDOM_WEIGHTS_CUH

#include <stddef.h>
#include <stdint.h>

#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st;

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

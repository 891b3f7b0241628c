/* RMSNorm on the GPU: fp32 residual rows in, bf16 normed rows out (the next GEMM's input).
 *
 * The residual add that precedes each norm is done by the GEMM that produces it (cuBLAS with
 * beta = 1 accumulates into the fp32 residual), so the norm reads the stream once.
 * Includable from C; bf16 buffers are void *; every pointer is device memory.
 */
#ifndef LF_KERNELS_RMSNORM_CUH
#define LF_KERNELS_RMSNORM_CUH

#include <stddef.h>
#include <stdint.h>

#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st;

/* For r < n_rows: out[out_rows ? out_rows[r] : r] = bf16(w * x[r] / sqrt(mean(x[r]^2) + eps)).
 * x: fp32 [n_rows][x_stride] (first n values used), w: fp32 [n], out: bf16 [..][out_stride]. */
lf_status lf_cuda_rmsnorm(const float *x, size_t x_stride, const float *w, int n, float eps,
                          int n_rows, void *out, size_t out_stride, const int32_t *out_rows,
                          struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif
#endif

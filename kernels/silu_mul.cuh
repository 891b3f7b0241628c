/* The gated MLP's SiLU(gate) * up of the cuda forward (when gate|up ran on cuBLAS; the GEMV
 * path fuses it, kernels/gemv.cuh LF_GEMV_GLU). CPU twin: engine/forward.c.
 * Includable from C; bf16 buffers are void *; every pointer is device memory.
 */
#ifndef LF_KERNELS_SILU_MUL_CUH
#define LF_KERNELS_SILU_MUL_CUH

#include <stddef.h>
#include <stdint.h>

#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st;

/* out[t][i] = bf16(silu(gu[t][i]) * gu[t][hidden + i]); gu fp32 [n_tok][2 hidden] (gate, up),
 * out bf16 [n_tok][hidden]. */
lf_status lf_cuda_silu_mul(const float *gu, int hidden, int n_tok, void *out,
                           struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif
#endif

/* Bandwidth-bound matrix-vector products for small decode batches (n_tok <= LF_GEMV_MAX_TOK).
 *
 * Y[t][o] = sum_i W[o][i] X[t][i] with W bf16 [n_out][n_in] (row-major, the checkpoint's layout),
 * X bf16 [n_tok][ldx], fp32 accumulation. A decode step at small batch only streams the
 * weights once; cuBLAS's n = 1 path does not reach the copy bandwidth, so one warp (or KS warps)
 * owns one output row (two for the gated MLP), reads it with 128-bit streaming loads and reads X
 * through L1. Each token's sum is formed in the same order whatever n_tok is, so a sequence's
 * result does not depend on what else is in the batch. The engine uses it at batch 1 only: from
 * batch 2 on cuBLAS is faster (engine/cuda/gemm.cu).
 *
 * Includable from C; bf16 buffers are void *; every pointer is device memory.
 */
#ifndef LF_KERNELS_GEMV_CUH
#define LF_KERNELS_GEMV_CUH

#include <stddef.h>
#include <stdint.h>

#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st;

#define LF_GEMV_MAX_TOK 8

typedef enum lf_gemv_out {
  LF_GEMV_F32 = 0,  /* Y fp32 [n_tok][ldy]: Y = acc + beta Y (beta 0: Y is not read) */
  LF_GEMV_BF16 = 1, /* Y bf16 [n_tok][ldy]: Y = bf16(acc) */
  LF_GEMV_GLU = 2,  /* W holds [2 n_out][n_in] (gate rows, then up rows); Y bf16 [n_tok][ldy]:
                       Y[t][o] = bf16(silu(gate_o . x_t) * (up_o . x_t)) */
} lf_gemv_out;

/* Nonzero when lf_cuda_gemv takes this shape: 1 <= n_tok <= LF_GEMV_MAX_TOK, n_in and ldx
 * multiples of 8, W and X 16-byte aligned. */
int lf_cuda_gemv_ok(const void *W, const void *X, int n_in, size_t ldx, int n_tok);

lf_status lf_cuda_gemv(const void *W, const void *X, size_t ldx, int n_in, int n_out, int n_tok,
                       void *Y, size_t ldy, lf_gemv_out mode, float beta,
                       struct CUstream_st *stream);

/* F32 mode with K cut into `parts` contiguous parts (1, 2, 4 or 8; n_in a multiple of 8 * parts),
 * each part summed on its own and the parts added in a fixed pairwise tree. Running the column
 * block r of T (n_in / T inputs) with parts / T parts on each of T ranks, and adding the T
 * results in the same tree, gives bit for bit what one call over the whole matrix gives: the
 * tensor-parallel residual projections (O, down) equal the single GPU's. Y = acc + beta Y. */
int lf_cuda_gemv_parts_ok(int n_in, int parts);
lf_status lf_cuda_gemv_parts(const void *W, const void *X, size_t ldx, int n_in, int n_out,
                             int n_tok, float *Y, size_t ldy, int parts, float beta,
                             struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif
#endif

/* GEMM selection of the cuda backend: Y[t][o] = sum_i W[o][i] X[t][i] (+ beta Y), bf16 in, fp32
 * accumulate. Small token counts on the bandwidth GEMV (kernels/gemv.cuh), the others on cuBLAS,
 * decode shapes with the cublasLt algorithm timed for them. */
#include <string.h>

#include "engine/cuda/cuda_backend.h"
#include "kernels/gemv.cuh"

/* The GEMV only at batch 1: it beats cuBLAS there but loses from
 * batch 2 on, its per-token X reads growing with the batch (bench/RESULTS.md). */
#define GEMV_MAX 1
/* Prompt chunks of up to 8 tokens on the GEMVs, and the residual GEMVs in 8 K parts over all
 * ranks: with them batch-1 decoding of a short prompt gives the same bits at TP = 1, 2, 4 and 8
 * (cb_gemm_res); the parts are also faster than the plain GEMV (bench/RESULTS.md, "Settings"). */
#define GEMV_PREFILL 8
#define GEMV_PARTS 8

/* cuBLAS's default choice for the skinny decode GEMMs (n_tok = batch, 9..n_pools) reads the
 * weights well below the copy bandwidth (bench/RESULTS.md).
 * So, for each decode shape, the first eager run asks cublasLt for its candidates, times each on
 * a scratch output (beta = 1 shapes would otherwise add into the residual stream) and keeps the
 * fastest; the graph captured later replays that choice, so graph and eager passes agree bit for
 * bit. Shapes met during capture, or with no scratch room, keep cublasGemmEx. */
static lf_status tuned_lookup(cuda_backend *c, int n_out, int n_in, int n_tok, int y_bf16,
                              int beta1, gemm_tune **out) {
  *out = NULL;
  for (int i = 0; i < c->n_tunes; i++) {
    gemm_tune *t = &c->tunes[i];
    if (t->n_out == n_out && t->n_in == n_in && t->n_tok == n_tok && t->y_bf16 == y_bf16 &&
        t->beta1 == beta1) {
      *out = t;
      return LF_OK;
    }
  }
  const size_t scratch = (size_t)c->max_items * c->cfg.vocab_size * sizeof(float); /* probs */
  if (c->in_capture || c->n_tunes >= GEMM_TUNE_MAX || !c->tunes ||
      (size_t)n_out * n_tok * 4 > scratch)
    return LF_OK;
  gemm_tune *t = &c->tunes[c->n_tunes++];
  memset(t, 0, sizeof *t);
  t->n_out = n_out, t->n_in = n_in, t->n_tok = n_tok, t->y_bf16 = y_bf16, t->beta1 = beta1;
  *out = t;
  const cudaDataType yt = y_bf16 ? CUDA_R_16BF : CUDA_R_32F;
  const cublasOperation_t opT = CUBLAS_OP_T;
  LF_CUBLAS_CHECK(cublasLtMatmulDescCreate(&t->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  LF_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(t->op, CUBLASLT_MATMUL_DESC_TRANSA, &opT,
                                                 sizeof opT));
  LF_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&t->a, CUDA_R_16BF, n_in, n_out, n_in));
  LF_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&t->b, CUDA_R_16BF, n_in, n_tok, n_in));
  LF_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&t->y, yt, n_out, n_tok, n_out));
  cublasLtMatmulPreference_t pref;
  LF_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  size_t wsb = c->blas_ws_bytes;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb,
                                       sizeof wsb);
  cublasLtMatmulHeuristicResult_t h[16];
  int nh = 0;
  cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(c->lt, t->op, t->a, t->b, t->y, t->y, pref,
                                                     16, h, &nh);
  cublasLtMatmulPreferenceDestroy(pref);
  if (hs != CUBLAS_STATUS_SUCCESS || nh < 1) return LF_OK;
  /* time on scratch: W real, X whatever the buffer holds (finite bf16), Y = probs */
  cudaEvent_t e0, e1;
  LF_CUDA_CHECK(cudaEventCreate(&e0));
  LF_CUDA_CHECK(cudaEventCreate(&e1));
  const float alpha = 1.0f, beta = beta1 ? 1.0f : 0.0f;
  const size_t rows_all = (size_t)c->max_items + (size_t)c->max_chunk;
  if ((size_t)n_tok * n_in * 2 > rows_all * 2 * c->cfg.hidden_dim * sizeof(float)) {
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return LF_OK;
  }
  const bf16 *X = (const bf16 *)c->gu; /* read only; any finite or not values time the same */
  const bf16 *W = c->layers[0].wgu; /* any weight as large: only the time matters */
  const size_t wneed = (size_t)n_out * n_in;
  const size_t have = (size_t)2 * c->cfg.hidden_dim * c->cfg.dim;
  if (wneed > have) W = c->lm_head;
  if (wneed > (size_t)c->nv * c->cfg.dim && wneed > have) {
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return LF_OK;
  }
  if (c->comm) {
    /* the collectives queued before this point must not sit under the event waits below */
    const lf_status ws = lf_comm_sync(c->comm, c->stream);
    if (ws != LF_OK) {
      cudaEventDestroy(e0);
      cudaEventDestroy(e1);
      return ws;
    }
  }
  float best = 1e30f;
  for (int k = 0; k < nh; k++) {
    if (h[k].state != CUBLAS_STATUS_SUCCESS) continue;
    float ms = 0.0f;
    int bad = 0;
    for (int r = 0; r < 4 && !bad; r++) {
      if (r == 1) cudaEventRecord(e0, c->stream);
      bad = cublasLtMatmul(c->lt, t->op, &alpha, W, t->a, X, t->b, &beta, c->probs, t->y,
                           c->probs, t->y, &h[k].algo, c->blas_ws, c->blas_ws_bytes,
                           c->stream) != CUBLAS_STATUS_SUCCESS;
    }
    cudaEventRecord(e1, c->stream);
    LF_CUDA_CHECK(cudaEventSynchronize(e1));
    if (bad) continue;
    LF_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (ms < best) {
      best = ms;
      t->algo = h[k].algo;
      t->ok = 1;
    }
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaGetLastError();
  return LF_OK;
}

/* Largest n_tok on the GEMV: GEMV_MAX in decode; in a prefill chunk at least GEMV_PREFILL, so a
 * short prompt takes the same kernels (and bits) at every TP degree (see cb_gemm_res). */
int cb_gemv_lim(const cuda_backend *c) {
  return c->in_prefill && GEMV_PREFILL > GEMV_MAX ? GEMV_PREFILL : GEMV_MAX;
}

lf_status cb_gemm(cuda_backend *c, const bf16 *W, const bf16 *X, void *Y, cudaDataType yt,
                  int n_out, int n_in, int n_tok, float beta) {
  if (n_tok <= cb_gemv_lim(c) && lf_cuda_gemv_ok(W, X, n_in, (size_t)n_in, n_tok))
    return lf_cuda_gemv(W, X, (size_t)n_in, n_in, n_out, n_tok, Y, (size_t)n_out,
                        yt == CUDA_R_32F ? LF_GEMV_F32 : LF_GEMV_BF16, beta, c->stream);
  const float alpha = 1.0f;
  /* decode steps only: a pass with prompt chunks has row counts of every size */
  if (c->tune_on && !c->in_prefill && n_tok <= c->max_items && (beta == 0.0f || beta == 1.0f)) {
    gemm_tune *t = NULL;
    LF_TRY(tuned_lookup(c, n_out, n_in, n_tok, yt == CUDA_R_16BF, beta == 1.0f, &t));
    if (t && t->ok) {
      LF_CUBLAS_CHECK(cublasLtMatmul(c->lt, t->op, &alpha, W, t->a, X, t->b, &beta, Y, t->y, Y,
                                     t->y, &t->algo, c->blas_ws, c->blas_ws_bytes, c->stream));
      return LF_OK;
    }
  }
  LF_CUBLAS_CHECK(cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, n_out, n_tok, n_in, &alpha, W,
                               CUDA_R_16BF, n_in, X, CUDA_R_16BF, n_in, &beta, Y, yt, n_out,
                               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return LF_OK;
}

/* A GEMM whose result adds into the residual stream (O, down: K is cut across the TP ranks).
 * On the GEMV path it runs with K in GEMV_PARTS / T parts (lf_cuda_gemv_parts), and the fused
 * all-reduce adds the ranks' results in the same tree, so TP=T gives the single GPU's bits; the
 * rest of a batch-1 step is row-parallel and identical anyway. */
lf_status cb_gemm_res(cuda_backend *c, const bf16 *W, const bf16 *X, float *Y, int n_out,
                      int n_in, int n_tok, float beta) {
  const int T = c->comm ? c->comm->size : 1;
  const int parts = GEMV_PARTS % T == 0 ? GEMV_PARTS / T : 0;
  if (parts > 0 && n_tok <= cb_gemv_lim(c) && lf_cuda_gemv_ok(W, X, n_in, (size_t)n_in, n_tok) &&
      lf_cuda_gemv_parts_ok(n_in, parts) && (T == 1 || cb_fused_ar(c, n_tok)))
    return lf_cuda_gemv_parts(W, X, (size_t)n_in, n_in, n_out, n_tok, Y, (size_t)n_out, parts,
                              beta, c->stream);
  return cb_gemm(c, W, X, Y, CUDA_R_32F, n_out, n_in, n_tok, beta);
}

void cb_gemm_free(cuda_backend *c) {
  for (int i = 0; c->tunes && i < c->n_tunes; i++) {
    gemm_tune *t = &c->tunes[i];
    if (t->op) cublasLtMatmulDescDestroy(t->op);
    if (t->a) cublasLtMatrixLayoutDestroy(t->a);
    if (t->b) cublasLtMatrixLayoutDestroy(t->b);
    if (t->y) cublasLtMatrixLayoutDestroy(t->y);
  }
}

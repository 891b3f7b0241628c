/* The cuda backend: bf16 weights and KV, fp32 accumulation (docs/DESIGN.md §2).
 *
 * One forward, top to bottom:
 *   prefill items (n_tok > 1), one at a time, in chunks of at most max_chunk tokens:
 *     embed -> per layer [RMSNorm -> QKV GEMM -> bias, q/k norm, RoPE (bf16 q, k, v) -> causal
 *     GQA attention over the pool's filled slots and the chunk -> append to the pool, or SnapKV
 *     compression into an empty pool -> O GEMM (+= residual) -> RMSNorm -> gate|up GEMM ->
 *     SiLU * up -> down GEMM (+= residual)] -> final RMSNorm of the last token into xf[item]
 *   decode items (n_tok == 1), all in one batched pass: the same layers, with the new k/v
 *     written straight into the slot w = (n < B) ? n++ : next inside the RoPE kernel, and the
 *     fused LongFlow decode attention (attention/decode_attn.cuh; a generic kernel for shapes it
 *     does not take) choosing every (sequence, layer, KV head)'s next slot
 *   LM head GEMM over xf [items][dim] -> argmax / sampling on the device -> tokens to the host.
 * Residual adds are the GEMMs' beta = 1: the fp32 residual stream x is cuBLAS's C.
 *
 * Pools: the device arena has the memory/pool.h layout [pool][layer][kv_head][slot][dim] (bf16
 * K and V) with per-slot ||v||_1 and position and per-(pool, layer, head) n and next. The free
 * list and each pool's fill count n (the same for every layer and head) are mirrored on the
 * host, so admission, context-full checks and eviction counts never read the device.
 * Every buffer is allocated at create for n_pools decode items and max_chunk prefill tokens; a
 * forward allocates nothing.
 */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "attention/cuda_check.h"
#include "attention/cuda_launch.cuh"
#include "attention/decode_attn.cuh"
#include "backend.h"
#include "cuda_attn.cuh"
#include "cuda_gemv.cuh"
#include "cuda_misc.cuh"
#include "cuda_norm.cuh"
#include "cuda_rope.cuh"
#include "cuda_sample.cuh"
#include "error.h"
#include "forward.h"
#include "parallel/ar_ipc.h"
#include "parallel/comm.h"
#include "parallel/tp.h"
#include "parallel/shard.h"
#include "random_weights.h"
#include "scheduler/scheduler.h"

#define LF_CUBLAS_CHECK(stmt)                                                                      \
  do {                                                                                             \
    cublasStatus_t lf_cublas_s_ = (stmt);                                                          \
    if (lf_cublas_s_ != CUBLAS_STATUS_SUCCESS)                                                     \
      return lf_error(LF_ERR_BACKEND, "%s:%d: %s: %s", __FILE__, __LINE__, #stmt,                  \
                      cublasGetStatusString(lf_cublas_s_));                                        \
  } while (0)

/* Allocation failures are out-of-memory, not backend errors. */
#define CB_ALLOC(ptr, bytes)                                                                       \
  do {                                                                                             \
    size_t cb_b_ = (bytes);                                                                        \
    if (cudaMalloc((void **)&(ptr), cb_b_ ? cb_b_ : 1) != cudaSuccess) {                           \
      cudaGetLastError();                                                                          \
      return lf_error(LF_ERR_OUT_OF_MEMORY, "cuda backend: cannot allocate %zu bytes for %s",     \
                      cb_b_, #ptr);                                                                \
    }                                                                                              \
  } while (0)

typedef __nv_bfloat16 bf16;

typedef struct cuda_layer {
  bf16 *wqkv;          /* [qd + 2 kd][dim]: q rows, k rows, v rows */
  bf16 *wo;            /* [dim][qd] */
  bf16 *wgu;           /* [2 hidden][dim]: gate rows, then up rows */
  bf16 *wdown;         /* [dim][hidden] */
  float *rms_att;      /* [dim] */
  float *rms_ffn;      /* [dim] */
  float *bqkv;         /* [qd + 2 kd] or NULL */
  float *q_norm, *k_norm; /* [head_dim] or NULL */
} cuda_layer;

/* Per-forward inputs of a batched decode pass, uploaded in one copy. */
typedef struct step_io {
  int32_t *tok, *pool, *pos, *rows; /* [max_items] each */
} step_io;

/* A GEMM shape whose cublasLt algorithm was chosen by timing (see tuned_gemm). */
typedef struct gemm_tune {
  int n_out, n_in, n_tok, y_bf16, beta1;
  int ok; /* 0: no cublasLt algorithm ran; use cublasGemmEx */
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t a, b, y;
  cublasLtMatmulAlgo_t algo;
} gemm_tune;

#define GEMM_TUNE_MAX 4096

typedef struct cuda_backend {
  lf_backend base;
  const lf_checkpoint *ck;
  /* cfg: this rank's part of the model (n_heads = the query heads it computes, n_kv_heads = the
   * KV heads in its pools, hidden_dim = its intermediate slice; vocab_size stays the whole
   * vocabulary); gcfg: the whole model. Equal on a single rank. */
  lf_model_config cfg, gcfg;
  lf_backend_params p;
  lf_attn_params ap;
  int qd, kd, qkv_dim, group;
  int max_items, max_chunk;
  int use_fused; /* decode attention: the fused kernel (else the generic one) */

  cudaStream_t stream;
  cublasHandle_t blas;

  /* weights */
  bf16 *embed;    /* [vocab][dim] */
  bf16 *lm_head;  /* [vocab][dim]; == embed when tied */
  float *rms_final; /* [dim] */
  cuda_layer *layers; /* host array [n_layers] of device pointers */
  float *inv_freq;    /* [head_dim / 2] */

  /* pools */
  lf_cuda_pool_view pv; /* k, v, vnorm, pos, n, next: the device arena */
  int *free_list, n_free;
  uint8_t *in_use;
  int *host_n; /* [n_pools] fill count mirror */

  /* activations, rows = max(max_items, max_chunk) */
  float *x;     /* [rows][dim] residual stream */
  bf16 *xb;     /* [rows][dim] normed input of a GEMM */
  float *qkv;   /* [rows][qd + 2 kd] */
  bf16 *qb;     /* [rows][qd] post-RoPE q */
  bf16 *kb, *vb; /* [max_chunk][kd] prefill chunk k (post-RoPE), v */
  bf16 *att;    /* [rows][qd] attention output */
  float *gu;    /* [rows][2 hidden] gate | up */
  bf16 *hb;     /* [rows][hidden] SiLU(gate) * up */
  bf16 *xf;     /* [max_items][dim] final-normed last position of each item */
  float *logits; /* [max_items][vocab] */
  float *probs;  /* [max_items][vocab] sampling scratch */
  int32_t *w;    /* [max_items][n_kv_heads] slot written this step */
  float *ml;     /* [max_chunk][n_heads][2] prefill softmax (max, sum) */
  float *snap;   /* [n_kv_heads][2][max_chunk] */
  int32_t *slot_of; /* [n_kv_heads][max_chunk] */
  int32_t *ptok;    /* [max_chunk] prefill tokens */
  void *attn_ws;
  size_t attn_ws_bytes;
  float *simple_scratch; /* generic decode attention logits */
  void *sort_ws;
  size_t sort_ws_bytes;
  int32_t *io;        /* device: step_io arrays, then sample params, then tokens */
  int32_t *h_io;      /* host copy of the same layout */
  step_io d_step, h_step;
  lf_sample_params *d_sp, *h_sp; /* [max_items] */
  int32_t *d_tok_out, *h_tok_out; /* [max_items] */
  size_t io_bytes;

  /* Decode-step CUDA graphs, one per exact batch size, captured the second time a size runs
   * (the first run is eager, so lazily loaded kernels and cuBLAS's algorithm choice happen
   * outside capture) and replayed after; at most graph_cap live, least recently used dropped.
   * A replay reads the same device buffers the eager pass does (d_step, the pool metadata), so
   * it needs no re-capture: only the batch size is baked in. */
  int use_graphs, graph_cap, n_graphs;
  cudaGraphExec_t *graph; /* [max_items + 1] */
  uint64_t *graph_used;   /* [max_items + 1] last use (0: never) */
  uint8_t *graph_seen;    /* [max_items + 1] eager runs of this size so far (saturates at 2) */
  uint64_t graph_clock;
  void *blas_ws; /* cuBLAS workspace, owned here so cuBLAS never allocates (graph capture) */
  size_t blas_ws_bytes;
  cublasLtHandle_t lt;
  int tune_on;       /* decode-batch GEMMs: time cublasLt's candidate algorithms once per shape */
  int in_capture;    /* a graph is being captured: no timing */
  gemm_tune *tunes;  /* [n_tunes] */
  int n_tunes;
  int gemv_max;    /* GEMMs with at most this many tokens use lf_cuda_gemv (0: never) */
  int prefill_gemv; /* ... and in prefill chunks of at most this many (LF_CUDA_PREFILL_GEMV) */
  int gemv_parts;   /* K parts of the residual GEMVs over all ranks (LF_GEMV_PARTS; 0: off) */
  int in_prefill;   /* set while prefill_chunk runs */
  int tp_topk;      /* sampled TP batches gather top-k pairs (tp_topk_kmax); LF_TP_TOPK=0: off */
  int pdl_max_rows; /* passes of more rows launch without PDL (LF_PDL_MAX_ROWS; default 16
                       under TP, no limit on one GPU) */
  int attn_splits; /* decode attention split count (0: automatic) */
  int l2_prefetch_rows; /* decode attention asks L2 for the O weights up to this batch
                           (LF_L2_PREFETCH_ROWS, default 0: never) */
  unsigned skip;   /* benchmark knob (LF_CUDA_SKIP=attn,rope,...: SKIP_* bits): those kernels of
                      a decode pass are not run; the results are wrong, only the time of the
                      rest is meaningful (what a kernel costs inside the replayed step) */
  int device;      /* the CUDA device at create: set again on every entry (server threads) */

  /* Tensor parallelism (docs/DESIGN.md §4, parallel/shard.h); comm NULL on a single rank. See the
   * essay above tp_allreduce_x. */
  lf_comm_t comm;
  lf_shard sh;
  int qd_own;       /* n_q head_dim: the O-projection's input columns this rank owns */
  int nv;           /* own vocabulary rows (embedding and LM head) */
  float *llocal;    /* [max_items][nv] own logits slice (== logits on a single rank) */
  float *lsend;     /* [max_items][max_vocab] the slice padded for the logits gather */
  int32_t *pairs;   /* [max_items][2] own (max bits, id); pairs_all [T][max_items][2] */
  int32_t *pairs_all;
} cuda_backend;

/* ---- GEMM: Y[t][o] = sum_i W[o][i] X[t][i] (+ beta Y), bf16 in, fp32 accumulate ---------- */

/* cuBLAS's default choice for the skinny decode GEMMs (n_tok = batch, 9..n_pools) reads the
 * weights well below the copy bandwidth (batch 64 on an H200: ~65% with attention left out).
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
  const size_t rows_all = (size_t)(c->max_items > c->max_chunk ? c->max_items : c->max_chunk);
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

static int fused_ar(const cuda_backend *c, int rows);

/* The integer in environment variable `name`, clamped to [lo, hi]; dflt when unset. */
static int env_int(const char *name, int dflt, int lo, int hi) {
  const char *e = getenv(name);
  if (!e) return dflt;
  const long v = strtol(e, NULL, 10);
  return v < lo ? lo : v > hi ? hi : (int)v;
}

/* Largest n_tok on the GEMV: gemv_max in decode; in a prefill chunk at least prefill_gemv, so a
 * short prompt takes the same kernels (and bits) at every TP degree (see gemm_res). */
static int gemv_lim(const cuda_backend *c) {
  return c->in_prefill && c->prefill_gemv > c->gemv_max ? c->prefill_gemv : c->gemv_max;
}

static lf_status gemm(cuda_backend *c, const bf16 *W, const bf16 *X, void *Y, cudaDataType yt,
                      int n_out, int n_in, int n_tok, float beta) {
  if (n_tok <= gemv_lim(c) && lf_cuda_gemv_ok(W, X, n_in, (size_t)n_in, n_tok))
    return lf_cuda_gemv(W, X, (size_t)n_in, n_in, n_out, n_tok, Y, (size_t)n_out,
                        yt == CUDA_R_32F ? LF_GEMV_F32 : LF_GEMV_BF16, beta, c->stream);
  const float alpha = 1.0f;
  if (c->tune_on && n_tok <= c->max_items && (beta == 0.0f || beta == 1.0f)) {
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
 * On the GEMV path it runs with K in gemv_parts / T parts (lf_cuda_gemv_parts), and the fused
 * all-reduce adds the ranks' results in the same tree, so TP=T gives the single GPU's bits; the
 * rest of a batch-1 step is row-parallel and identical anyway. */
static lf_status gemm_res(cuda_backend *c, const bf16 *W, const bf16 *X, float *Y, int n_out,
                          int n_in, int n_tok, float beta) {
  const int T = c->comm ? c->comm->size : 1;
  const int parts = c->gemv_parts > 0 && c->gemv_parts % T == 0 ? c->gemv_parts / T : 0;
  if (parts > 0 && n_tok <= gemv_lim(c) && lf_cuda_gemv_ok(W, X, n_in, (size_t)n_in, n_tok) &&
      lf_cuda_gemv_parts_ok(n_in, parts) && (T == 1 || fused_ar(c, n_tok)))
    return lf_cuda_gemv_parts(W, X, (size_t)n_in, n_in, n_out, n_tok, Y, (size_t)n_out, parts,
                              beta, c->stream);
  return gemm(c, W, X, Y, CUDA_R_32F, n_out, n_in, n_tok, beta);
}

/* ---- weights ------------------------------------------------------------------------------ */

/* The tensor must exist with shape [rows][cols] (cols 0: a vector [rows]). */
static lf_status find_tensor(const lf_checkpoint *ck, const char *name, int64_t rows, int64_t cols,
                             const lf_tensor_src **out) {
  const lf_tensor_src *t = lf_tensor_set_find(&ck->tensors, name);
  if (!t) return lf_error(LF_ERR_MISSING_TENSOR, "tensor %s is missing from the checkpoint", name);
  const int ndim = cols > 0 ? 2 : 1;
  if (t->ndim != ndim || t->shape[0] != rows || (ndim == 2 && t->shape[1] != cols))
    return lf_error(LF_ERR_SHAPE, "tensor %s in %s: expected [%lld%s%lld], found a %d-D tensor",
                    name, t->file ? t->file : "the checkpoint", (long long)rows,
                    ndim == 2 ? ", " : "", ndim == 2 ? (long long)cols : 0LL, t->ndim);
  *out = t;
  return LF_OK;
}

/* Rows [row0, row0 + nrows) x columns [col0, col0 + ncols) of matrix `name` [rows][cols] into
 * dst (bf16 [nrows][ncols]), converted on the host in slices of ~4M values. A tensor-parallel
 * rank reads only its slice (mmap); a random checkpoint generates the values the whole matrix
 * holds at the same indices (scale from the whole fan-in), so every T sees one model. */
static lf_status upload_matrix(cuda_backend *c, const char *name, int64_t rows, int64_t cols,
                               int64_t row0, int64_t nrows, int64_t col0, int64_t ncols,
                               bf16 *dst) {
  const lf_checkpoint *ck = c->ck;
  if (row0 < 0 || col0 < 0 || row0 + nrows > rows || col0 + ncols > cols)
    return lf_error(LF_ERR_INTERNAL, "%s: slice [%lld +%lld][%lld +%lld] of [%lld][%lld]", name,
                    (long long)row0, (long long)nrows, (long long)col0, (long long)ncols,
                    (long long)rows, (long long)cols);
  if (ck->random_weights) {
    uint32_t id = 0;
    int kind = 0;
    if (!lf_rw_tensor_of(name, &id, &kind))
      return lf_error(LF_ERR_MISSING_TENSOR, "random checkpoint has no tensor %s", name);
    const float scale = sqrtf(3.0f / (float)cols);
    if (ncols == cols)
      return lf_cuda_random_bf16(dst, (size_t)(nrows * cols), ck->random_seed, id, scale,
                                 (uint64_t)(row0 * cols), c->stream);
    return lf_cuda_random_bf16_slice(dst, nrows, ncols, cols, row0, col0, ck->random_seed, id,
                                     scale, c->stream);
  }
  const lf_tensor_src *t = NULL;
  LF_TRY(find_tensor(ck, name, rows, cols, &t));
  int64_t chunk = ((int64_t)1 << 22) / ncols;
  if (chunk < 1) chunk = 1;
  if (chunk > nrows) chunk = nrows;
  float *f = (float *)malloc((size_t)(chunk * ncols) * sizeof(float)); /* [chunk][ncols] */
  uint16_t *h = (uint16_t *)malloc((size_t)(chunk * ncols) * sizeof(uint16_t));
  lf_status s = LF_OK;
  if (!f || !h) s = lf_error(LF_ERR_OUT_OF_MEMORY, "staging for %s", name);
  for (int64_t r0 = 0; s == LF_OK && r0 < nrows; r0 += chunk) {
    const int64_t nr = nrows - r0 < chunk ? nrows - r0 : chunk;
    s = lf_tensor_read_f32(t, row0 + r0, nr, col0, ncols, f);
    if (s != LF_OK) break;
    for (int64_t i = 0; i < nr * ncols; i++) h[i] = lf_f32_to_bf16(f[i]);
    /* synchronous: the staging buffer is reused at once */
    if (cudaMemcpy(dst + r0 * ncols, h, (size_t)(nr * ncols) * 2, cudaMemcpyHostToDevice) !=
        cudaSuccess)
      s = lf_error(LF_ERR_BACKEND, "%s:%d: upload of %s: %s", __FILE__, __LINE__, name,
                   cudaGetErrorString(cudaGetLastError()));
  }
  free(f);
  free(h);
  return s;
}

/* Elements [i0, i0 + n) of vector `name` [len] into dst (fp32). */
static lf_status upload_vector(cuda_backend *c, const char *name, int64_t len, int64_t i0,
                               int64_t n, float *dst) {
  const lf_checkpoint *ck = c->ck;
  if (i0 < 0 || i0 + n > len)
    return lf_error(LF_ERR_INTERNAL, "%s: slice [%lld +%lld] of [%lld]", name, (long long)i0,
                    (long long)n, (long long)len);
  float *f = (float *)malloc((size_t)n * sizeof(float));
  if (!f) return lf_error(LF_ERR_OUT_OF_MEMORY, "staging for %s", name);
  lf_status s = LF_OK;
  if (ck->random_weights) {
    uint32_t id = 0;
    int kind = 0;
    if (!lf_rw_tensor_of(name, &id, &kind))
      s = lf_error(LF_ERR_MISSING_TENSOR, "random checkpoint has no tensor %s", name);
    for (int64_t i = 0; s == LF_OK && i < n; i++)
      f[i] = lf_rw_value(ck->random_seed, id, kind, 1.0f, (uint64_t)(i0 + i));
  } else {
    const lf_tensor_src *t = NULL;
    s = find_tensor(ck, name, len, 0, &t);
    if (s == LF_OK) s = lf_tensor_read_f32(t, 0, 1, i0, n, f);
  }
  if (s == LF_OK && cudaMemcpy(dst, f, (size_t)n * sizeof(float), cudaMemcpyHostToDevice) !=
                        cudaSuccess)
    s = lf_error(LF_ERR_BACKEND, "%s:%d: upload of %s: %s", __FILE__, __LINE__, name,
                 cudaGetErrorString(cudaGetLastError()));
  free(f);
  return s;
}

/* This rank's shard (the whole model on a single rank): c->sh's query/KV head rows (+ biases),
 * O-projection input columns, intermediate slice of gate/up rows and down columns, and vocab
 * rows of the embedding and LM head; norms whole. */
static lf_status load_weights(cuda_backend *c) {
  const lf_model_config *g = &c->gcfg;
  const lf_shard *sh = &c->sh;
  const int64_t dim = g->dim, hid = g->hidden_dim, hd = g->head_dim;
  const int64_t gqd = (int64_t)g->n_heads * hd, gkd = (int64_t)g->n_kv_heads * hd;
  const int64_t qd = c->qd, kd = c->kd, qd_own = c->qd_own, nhid = sh->n_hid;
  const int64_t cq0 = (int64_t)sh->cq0 * hd, kv0 = (int64_t)sh->kv0 * hd,
                q0 = (int64_t)sh->q0 * hd;
  const int64_t V = g->vocab_size, v0 = sh->vocab0, nv = sh->n_vocab;
  char nm[LF_TENSOR_NAME_MAX];
  static const char *const never[] = {"self_attn.o_proj.bias", "mlp.gate_proj.bias",
                                      "mlp.up_proj.bias", "mlp.down_proj.bias"};
  CB_ALLOC(c->embed, (size_t)nv * dim * 2);
  LF_TRY(upload_matrix(c, "model.embed_tokens.weight", V, dim, v0, nv, 0, dim, c->embed));
  CB_ALLOC(c->rms_final, (size_t)dim * 4);
  LF_TRY(upload_vector(c, "model.norm.weight", dim, 0, dim, c->rms_final));
  if (c->ck->random_weights || lf_tensor_set_find(&c->ck->tensors, "lm_head.weight") ||
      !g->tie_embeddings) {
    CB_ALLOC(c->lm_head, (size_t)nv * dim * 2);
    LF_TRY(upload_matrix(c, "lm_head.weight", V, dim, v0, nv, 0, dim, c->lm_head));
  } else {
    c->lm_head = c->embed; /* tied: the same vocab rows */
  }
  for (int l = 0; l < g->n_layers; l++) {
    cuda_layer *L = &c->layers[l];
#define NM(suffix) (snprintf(nm, sizeof nm, "model.layers.%d.%s", l, suffix), nm)
    for (size_t i = 0; i < sizeof never / sizeof never[0]; i++)
      if (lf_tensor_set_find(&c->ck->tensors, NM(never[i])))
        return lf_error(LF_ERR_UNSUPPORTED, "tensor %s: this bias is not supported", nm);
    CB_ALLOC(L->wqkv, (size_t)(qd + 2 * kd) * dim * 2);
    LF_TRY(upload_matrix(c, NM("self_attn.q_proj.weight"), gqd, dim, cq0, qd, 0, dim, L->wqkv));
    LF_TRY(upload_matrix(c, NM("self_attn.k_proj.weight"), gkd, dim, kv0, kd, 0, dim,
                         L->wqkv + qd * dim));
    LF_TRY(upload_matrix(c, NM("self_attn.v_proj.weight"), gkd, dim, kv0, kd, 0, dim,
                         L->wqkv + (qd + kd) * dim));
    if (g->qkv_bias) {
      CB_ALLOC(L->bqkv, (size_t)(qd + 2 * kd) * 4);
      LF_TRY(upload_vector(c, NM("self_attn.q_proj.bias"), gqd, cq0, qd, L->bqkv));
      LF_TRY(upload_vector(c, NM("self_attn.k_proj.bias"), gkd, kv0, kd, L->bqkv + qd));
      LF_TRY(upload_vector(c, NM("self_attn.v_proj.bias"), gkd, kv0, kd, L->bqkv + qd + kd));
    }
    if (g->qk_norm) {
      CB_ALLOC(L->q_norm, (size_t)hd * 4);
      CB_ALLOC(L->k_norm, (size_t)hd * 4);
      LF_TRY(upload_vector(c, NM("self_attn.q_norm.weight"), hd, 0, hd, L->q_norm));
      LF_TRY(upload_vector(c, NM("self_attn.k_norm.weight"), hd, 0, hd, L->k_norm));
    }
    CB_ALLOC(L->wo, (size_t)dim * qd_own * 2);
    LF_TRY(upload_matrix(c, NM("self_attn.o_proj.weight"), dim, gqd, 0, dim, q0, qd_own, L->wo));
    CB_ALLOC(L->rms_att, (size_t)dim * 4);
    CB_ALLOC(L->rms_ffn, (size_t)dim * 4);
    LF_TRY(upload_vector(c, NM("input_layernorm.weight"), dim, 0, dim, L->rms_att));
    LF_TRY(upload_vector(c, NM("post_attention_layernorm.weight"), dim, 0, dim, L->rms_ffn));
    CB_ALLOC(L->wgu, (size_t)2 * nhid * dim * 2);
    LF_TRY(upload_matrix(c, NM("mlp.gate_proj.weight"), hid, dim, sh->hid0, nhid, 0, dim, L->wgu));
    LF_TRY(upload_matrix(c, NM("mlp.up_proj.weight"), hid, dim, sh->hid0, nhid, 0, dim,
                         L->wgu + nhid * dim));
    CB_ALLOC(L->wdown, (size_t)dim * nhid * 2);
    LF_TRY(upload_matrix(c, NM("mlp.down_proj.weight"), dim, hid, 0, dim, sh->hid0, nhid,
                         L->wdown));
#undef NM
  }
  return LF_OK; /* create() synchronises the device before any kernel reads these */
}

/* ---- tensor parallelism -------------------------------------------------------------------
 *
 * With a communicator of T > 1 ranks (lf_backend_params.comm, an NCCL one: comm->device), this
 * rank holds the shard of parallel/shard.h: its query heads' Q rows and KV heads' K/V rows (and
 * pools), the O-projection's input columns of its own heads, an intermediate slice of gate/up
 * rows and down columns, and a vocab slice of the embedding and LM head. c->cfg is that local
 * model (heads, hidden size), so every kernel launch is unchanged; what changes:
 *   - embedding: own rows, zeros elsewhere, all-reduce (exact: one nonzero term per element);
 *   - the two residual adds per layer. The O and down GEMMs used to add into the fp32 residual
 *     stream x (beta = 1). Now rank 0 keeps beta = 1 (x_old + its partial) and the other ranks
 *     write their partial with beta = 0, then one in-place fp32 all-reduce of x gives every rank
 *     x_old + sum of partials: the residual add costs no extra kernel and no extra buffer. x is
 *     the same on every rank (NCCL's all-reduce hands every rank the same bits), so rank 0's
 *     x_old is everyone's.
 *     fp32, not bf16: x is fp32 on a single rank too, so TP=T differs from TP=1 only by the
 *     order of the fp32 sums inside O and down (each GEMM sums its own K slice, then the ranks
 *     are added), ~1e-6 relative; bf16 would round the residual stream at every layer and move
 *     greedy tokens. The bytes hardly matter: batch 1 of an 8B model is 16 KB per call, latency
 *     bound either way.
 *     With the IPC path (comm->ipc: on unless LF_CUSTOM_AR=0) the residual adds take the fused
 *     route instead (fused_ar below): every rank writes its partial into a staging buffer, and
 *     one kernel sums the ranks' partials in a fixed pairwise tree, adds x_old and computes the
 *     next RMSNorm, so a layer makes 2 launches where NCCL needs 2 all-reduces and 2 norms. The
 *     sum is x_old + tree(p_0 .. p_T-1), the same bits on every rank, and on the GEMV path the
 *     same bits as one GPU's (gemm_res).
 *   - replicated KV heads (T > Hkv): attention runs for the whole group (exact eviction, see
 *     shard.h); only the own heads' columns of att are packed (into qb, free by then) for O;
 *   - LM head on the vocab slice; greedy batches: each rank's (max, id) per item, one all-gather
 *     of [n][2] int32, the pick on the device (largest value, lowest rank on ties == lowest id:
 *     exactly the argmax of the full logits); when an item samples or logits are wanted, one
 *     padded all-gather of the slices [n][max_vocab] into the full logits [n][vocab] and the
 *     single-rank sampling code on them (distributed top-k is a later optimisation).
 *   - every wait on the stream goes through lf_comm_sync (a dead peer is an error within the
 *     communicator's timeout, not a hang).
 *   - CUDA graphs: NCCL collectives and the IPC kernels can be captured (NCCL >= 2.9), and the
 *     capture happens at the same step on every rank (a batch size's second run). On under TP
 *     too (LF_CUDA_GRAPHS_TP=0 turns them off there): 3.88 vs 4.10 ms at batch 1 on 2 x H200.
 * Which collectives run depends only on the items (the same on every rank: parallel/tp.h) and
 * on logits being wanted, so the ranks' NCCL calls always pair up. */

/* x[rows][dim] summed over the ranks, in place on the stream (nothing waits). */
static lf_status tp_allreduce_x(cuda_backend *c, int rows) {
  if (!c->comm) return LF_OK;
  return c->comm->allreduce_sum(c->comm, c->x, (size_t)rows * c->cfg.dim, LF_COMM_F32, c->stream);
}

/* beta of the GEMMs that add into the residual stream (see above). */
static float res_beta(const cuda_backend *c) {
  return !c->comm || c->comm->rank == 0 ? 1.0f : 0.0f;
}

/* cudaStreamSynchronize, or the communicator's wait with a deadline under TP. */
static lf_status stream_wait(cuda_backend *c) {
  if (c->comm) return lf_comm_sync(c->comm, c->stream);
  LF_CUDA_CHECK(cudaStreamSynchronize(c->stream));
  return LF_OK;
}

/* The fused residual all-reduce (parallel/ar_ipc.h) for a pass of `rows` rows: under TP with the
 * IPC path, when the rows fit its staging buffers. The same answer on every rank. Then the O and
 * down projections write their partial sums into a staging slot (beta 0) instead of adding into
 * x, and one kernel sums the ranks' partials into x and norms the result for the next GEMM:
 * per layer two launches instead of two all-reduces and two norms. The slots alternate
 * (embedding 2, O 0, down 1), so two calls in a row never share one. */
enum { AR_SLOT_O = 0, AR_SLOT_DOWN = 1, AR_SLOT_EMBED = 2 };

/* LF_CUDA_SKIP (benchmark only): the kernels a decode pass leaves out. */
enum {
  SKIP_ATTN = 1u << 0,  /* decode attention */
  SKIP_ROPE = 1u << 1,  /* QKV bias / norm / RoPE and the slot write */
  SKIP_RES = 1u << 2,   /* the residual all-reduce + RMSNorm after O and down (none under TP) */
  SKIP_QKV = 1u << 3,   /* the GEMMs: QKV, O, gate|up, down */
  SKIP_O = 1u << 4,
  SKIP_GU = 1u << 5,
  SKIP_DOWN = 1u << 6,
};

static lf_status parse_skip(const char *list, unsigned *out) {
  static const struct {
    const char *name;
    unsigned bit;
  } names[] = {{"attn", SKIP_ATTN}, {"rope", SKIP_ROPE}, {"res", SKIP_RES}, {"qkv", SKIP_QKV},
               {"o", SKIP_O},       {"gu", SKIP_GU},     {"down", SKIP_DOWN}};
  *out = 0;
  const char *p = list;
  while (*p) {
    const size_t n = strcspn(p, ",");
    unsigned bit = 0;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
      if (n == strlen(names[i].name) && !strncmp(p, names[i].name, n)) bit = names[i].bit;
    if (n && !bit)
      return lf_error(LF_ERR_INVALID_ARG,
                      "LF_CUDA_SKIP=%s: '%.*s' is not one of attn, rope, res, qkv, o, gu, down",
                      list, (int)n, p);
    *out |= bit;
    p += n + (p[n] == ',');
  }
  return LF_OK;
}

static int fused_ar(const cuda_backend *c, int rows) {
  return c->comm && c->comm->ipc && lf_ar_ipc_norm_fits(c->comm->ipc, rows, c->cfg.dim);
}

/* Where a GEMM whose result adds into the residual stream writes, and with which beta. */
static float *res_out(cuda_backend *c, int rows, int slot, float *beta) {
  if (fused_ar(c, rows)) {
    *beta = 0.0f;
    return lf_ar_ipc_stage(c->comm->ipc, slot);
  }
  *beta = res_beta(c);
  return c->x;
}

/* After res_out's GEMM: x complete on every rank, then (w non-NULL) out[out_rows[r] or r] =
 * RMSNorm(x[r]) * w. */
static lf_status res_norm(cuda_backend *c, int rows, int slot, const float *w, void *out,
                          const int32_t *out_rows) {
  const lf_model_config *m = &c->cfg;
  if (fused_ar(c, rows))
    return lf_ar_ipc_residual_norm(c->comm->ipc, slot, c->x, slot != AR_SLOT_EMBED, rows, m->dim,
                                   w, m->norm_eps, out, (size_t)m->dim, out_rows, c->stream);
  LF_TRY(tp_allreduce_x(c, rows));
  if (!w) return LF_OK;
  return lf_cuda_rmsnorm(c->x, m->dim, w, m->dim, m->norm_eps, rows, out, m->dim, out_rows,
                         c->stream);
}

/* x[t] = embedding of tokens[t] (device ids), over the ranks' vocab slices under TP; then
 * xb = RMSNorm(x) * w (the first layer's attention norm). */
static lf_status embed_rows(cuda_backend *c, const int32_t *tokens, int rows, const float *w) {
  const lf_model_config *m = &c->cfg;
  if (!c->comm) {
    LF_TRY(lf_cuda_embed(c->embed, m->dim, tokens, rows, c->x, c->stream));
  } else {
    float beta;
    float *dst = res_out(c, rows, AR_SLOT_EMBED, &beta);
    LF_TRY(lf_cuda_embed_slice(c->embed, m->dim, c->sh.vocab0, c->nv, tokens, rows, dst,
                               c->stream));
  }
  return res_norm(c, rows, AR_SLOT_EMBED, w, c->xb, NULL);
}

/* ---- the layers ---------------------------------------------------------------------------- */

/* Everything after attention of one layer: O-proj (+= x), RMSNorm, gate|up, SiLU*up, down (+= x),
 * then (next_w non-NULL) the next norm: out[out_rows[r] or r] = RMSNorm(x[r]) * next_w. */
static lf_status layer_tail(cuda_backend *c, const cuda_layer *L, int rows, const float *next_w,
                            void *out, const int32_t *out_rows) {
  const lf_model_config *m = &c->cfg;
  const bf16 *att = c->att;
  if (c->qd_own != c->qd) { /* replicated KV head: this rank's heads of the group only */
    const size_t off = (size_t)(c->sh.q0 - c->sh.cq0) * m->head_dim;
    LF_CUDA_CHECK(cudaMemcpy2DAsync(c->qb, (size_t)c->qd_own * 2, c->att + off, (size_t)c->qd * 2,
                                    (size_t)c->qd_own * 2, (size_t)rows, cudaMemcpyDeviceToDevice,
                                    c->stream));
    att = c->qb;
  }
  float beta;
  float *dst = res_out(c, rows, AR_SLOT_O, &beta);
  if (!(c->skip & SKIP_O)) LF_TRY(gemm_res(c, L->wo, att, dst, m->dim, c->qd_own, rows, beta));
  if (!(c->skip & SKIP_RES)) LF_TRY(res_norm(c, rows, AR_SLOT_O, L->rms_ffn, c->xb, NULL));
  if (c->skip & SKIP_GU) {
    /* benchmark knob only: hb keeps whatever it held */
  } else if (rows <= gemv_lim(c) && lf_cuda_gemv_ok(L->wgu, c->xb, m->dim, (size_t)m->dim, rows)) {
    /* SiLU(gate) * up in the GEMV's epilogue: no fp32 gate|up round trip */
    LF_TRY(lf_cuda_gemv(L->wgu, c->xb, (size_t)m->dim, m->dim, m->hidden_dim, rows, c->hb,
                        (size_t)m->hidden_dim, LF_GEMV_GLU, 0.0f, c->stream));
  } else {
    LF_TRY(gemm(c, L->wgu, c->xb, c->gu, CUDA_R_32F, 2 * m->hidden_dim, m->dim, rows, 0.0f));
    LF_TRY(lf_cuda_silu_mul(c->gu, m->hidden_dim, rows, c->hb, c->stream));
  }
  dst = res_out(c, rows, AR_SLOT_DOWN, &beta);
  if (!(c->skip & SKIP_DOWN))
    LF_TRY(gemm_res(c, L->wdown, c->hb, dst, m->dim, m->hidden_dim, rows, beta));
  /* the last layer's norm feeds the LM head: kept */
  if ((c->skip & SKIP_RES) && out != (void *)c->xf) return LF_OK;
  return res_norm(c, rows, AR_SLOT_DOWN, next_w, out, out_rows);
}

static lf_qkv_rope_args rope_args(cuda_backend *c, const cuda_layer *L, int rows) {
  const lf_model_config *m = &c->cfg;
  lf_qkv_rope_args a;
  memset(&a, 0, sizeof a);
  a.qkv = c->qkv;
  a.qkv_stride = (size_t)c->qkv_dim;
  a.bias = L->bqkv;
  a.q_norm = L->q_norm;
  a.k_norm = L->k_norm;
  a.eps = m->norm_eps;
  a.inv_freq = c->inv_freq;
  a.interleaved = m->rope_style == LF_ROPE_INTERLEAVED;
  a.n_heads = m->n_heads;
  a.n_kv_heads = m->n_kv_heads;
  a.head_dim = m->head_dim;
  a.n_tok = rows;
  a.q_out = c->qb;
  return a;
}

/* One batched decode pass over `rows` sequences whose inputs are in d_step (device); the final
 * normed row of sequence r goes to xf[rows_out[r]]. */
static lf_status decode_pass(cuda_backend *c, int rows) {
  const lf_model_config *m = &c->cfg;
  LF_TRY(embed_rows(c, c->d_step.tok, rows, c->layers[0].rms_att));
  for (int l = 0; l < m->n_layers; l++) {
    const cuda_layer *L = &c->layers[l];
    /* xb = RMSNorm(x) * rms_att: done by the step before (embedding or the last layer_tail) */
    if (!(c->skip & SKIP_QKV))
      LF_TRY(gemm(c, L->wqkv, c->xb, c->qkv, CUDA_R_32F, c->qkv_dim, m->dim, rows, 0.0f));
    lf_qkv_rope_args a = rope_args(c, L, rows);
    a.pos = c->d_step.pos;
    a.pk = c->pv.k;
    a.pv = c->pv.v;
    a.pvnorm = c->pv.vnorm;
    a.ppos = c->pv.pos;
    a.pn = c->pv.n;
    a.pnext = c->pv.next;
    a.pool_ids = c->d_step.pool;
    a.n_layers = m->n_layers;
    a.budget = c->p.budget;
    a.layer = l;
    a.sink = c->p.sink;
    a.policy = c->p.policy;
    a.w = c->w;
    if (!(c->skip & SKIP_ROPE)) LF_TRY(lf_cuda_qkv_rope(&a, c->stream));
    if (c->skip & SKIP_ATTN) {
      /* benchmark knob only: att keeps whatever it held */
    } else if (c->use_fused) {
      lf_decode_attn_args d;
      memset(&d, 0, sizeof d);
      d.k = c->pv.k;
      d.v = c->pv.v;
      d.vnorm = c->pv.vnorm;
      d.pos = c->pv.pos;
      d.n = c->pv.n;
      d.next = c->pv.next;
      d.n_layers = m->n_layers;
      d.n_kv_heads = m->n_kv_heads;
      d.budget = c->p.budget;
      d.head_dim = m->head_dim;
      d.layer = l;
      d.n_seq = rows;
      d.pool_ids = c->d_step.pool;
      d.w = c->w;
      d.q = c->qb;
      d.q_stride = 0;
      d.out = c->att;
      d.group = c->group;
      d.sink = c->p.sink;
      d.policy = c->p.policy;
      d.scale = c->ap.scale;
      d.n_splits = c->attn_splits;
      d.workspace = c->attn_ws;
      d.workspace_bytes = c->attn_ws_bytes;
      if (rows <= c->l2_prefetch_rows) { /* see lf_decode_attn_args.l2_next */
        d.l2_next = L->wo;
        d.l2_next_bytes = (size_t)m->dim * c->qd_own * sizeof(bf16);
      }
      LF_TRY(lf_cuda_decode_attn(&d, c->stream));
    } else {
      LF_TRY(lf_cuda_decode_attn_simple(&c->pv, l, rows, c->d_step.pool, c->w, m->n_heads, c->qb,
                                        c->ap.scale, c->p.sink, c->p.policy, c->att,
                                        c->simple_scratch, c->stream));
    }
    const int last = l + 1 == m->n_layers;
    LF_TRY(layer_tail(c, L, rows, last ? c->rms_final : c->layers[l + 1].rms_att,
                      last ? (void *)c->xf : (void *)c->xb, last ? c->d_step.rows : NULL));
  }
  return LF_OK;
}

static lf_status decode_run_graph(cuda_backend *c, int rows);

/* decode_run_graph with programmatic dependent launch only up to pdl_max_rows rows (the
 * launches record it, graphs included: each batch size has its own graph). */
static lf_status decode_run(cuda_backend *c, int rows) {
  const int saved = lf_pdl_pass_off;
  lf_pdl_pass_off = rows > c->pdl_max_rows;
  const lf_status s = decode_run_graph(c, rows);
  lf_pdl_pass_off = saved;
  return s;
}

/* decode_pass through the graph cache (see cuda_backend.graph). */
static lf_status decode_run_graph(cuda_backend *c, int rows) {
  if (!c->use_graphs || rows < 1 || rows > c->max_items) return decode_pass(c, rows);
  cudaGraphExec_t ex = c->graph[rows];
  if (!ex) {
    if (c->graph_seen[rows] < 1) {
      c->graph_seen[rows]++;
      return decode_pass(c, rows);
    }
    if (c->n_graphs >= c->graph_cap) {
      int lru = 0;
      for (int r = 1; r <= c->max_items; r++)
        if (c->graph[r] && (!lru || c->graph_used[r] < c->graph_used[lru])) lru = r;
      if (lru) {
        LF_CUDA_CHECK(cudaGraphExecDestroy(c->graph[lru]));
        c->graph[lru] = NULL;
        c->n_graphs--;
      }
    }
    cudaGraph_t g = NULL;
    LF_CUDA_CHECK(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal));
    c->in_capture = 1;
    const lf_status s = decode_pass(c, rows);
    c->in_capture = 0;
    const cudaError_t e = cudaStreamEndCapture(c->stream, &g);
    if (s != LF_OK) {
      if (g) cudaGraphDestroy(g);
      cudaGetLastError();
      return s;
    }
    LF_CUDA_CHECK(e);
    const cudaError_t ei = cudaGraphInstantiate(&ex, g, 0);
    cudaGraphDestroy(g);
    LF_CUDA_CHECK(ei);
    c->graph[rows] = ex;
    c->n_graphs++;
  }
  c->graph_used[rows] = ++c->graph_clock;
  LF_CUDA_CHECK(cudaGraphLaunch(ex, c->stream));
  return LF_OK;
}

/* Uploads the first `rows` entries of the host step arrays. */
static lf_status step_upload(cuda_backend *c, int rows) {
  const size_t b = (size_t)rows * sizeof(int32_t);
  LF_CUDA_CHECK(cudaMemcpyAsync(c->d_step.tok, c->h_step.tok, b, cudaMemcpyHostToDevice, c->stream));
  LF_CUDA_CHECK(cudaMemcpyAsync(c->d_step.pool, c->h_step.pool, b, cudaMemcpyHostToDevice, c->stream));
  LF_CUDA_CHECK(cudaMemcpyAsync(c->d_step.pos, c->h_step.pos, b, cudaMemcpyHostToDevice, c->stream));
  LF_CUDA_CHECK(cudaMemcpyAsync(c->d_step.rows, c->h_step.rows, b, cudaMemcpyHostToDevice, c->stream));
  return LF_OK;
}

static lf_status prefill_layers(cuda_backend *c, int pool, int32_t pos0, int T, int n0,
                                int compress);

/* A chunk of one sequence's prompt, n0 slots already filled: attention, then the pool write
 * (compress: SnapKV into the empty pool). last: the final normed last row goes to xf[row]. */
static lf_status prefill_chunk(cuda_backend *c, int pool, int32_t pos0, const int32_t *tokens,
                               int T, int n0, int compress, int last, int row) {
  const lf_model_config *m = &c->cfg;
  const int B = c->p.budget;
  LF_CUDA_CHECK(cudaMemcpyAsync(c->ptok, tokens, (size_t)T * sizeof(int32_t),
                                cudaMemcpyHostToDevice, c->stream));
  c->in_prefill = 1;
  const int pdl_saved = lf_pdl_pass_off;
  lf_pdl_pass_off = T > c->pdl_max_rows;
  const lf_status st = prefill_layers(c, pool, pos0, T, n0, compress);
  lf_pdl_pass_off = pdl_saved;
  c->in_prefill = 0;
  LF_TRY(st);
  c->host_n[pool] = compress ? B - 1 : n0 + T;
  if (!last) return LF_OK;
  return lf_cuda_rmsnorm(c->x + (size_t)(T - 1) * m->dim, m->dim, c->rms_final, m->dim,
                         m->norm_eps, 1, c->xf + (size_t)row * m->dim, m->dim, NULL, c->stream);
}

/* prefill_chunk's embedding and layers (in_prefill set). */
static lf_status prefill_layers(cuda_backend *c, int pool, int32_t pos0, int T, int n0,
                                int compress) {
  const lf_model_config *m = &c->cfg;
  const int B = c->p.budget;
  LF_TRY(embed_rows(c, c->ptok, T, c->layers[0].rms_att));
  const int w_eff = lf_snapkv_window(&c->ap, B);
  for (int l = 0; l < m->n_layers; l++) {
    const cuda_layer *L = &c->layers[l];
    LF_TRY(gemm(c, L->wqkv, c->xb, c->qkv, CUDA_R_32F, c->qkv_dim, m->dim, T, 0.0f));
    lf_qkv_rope_args a = rope_args(c, L, T);
    a.pos0 = pos0;
    a.k_out = c->kb;
    a.v_out = c->vb;
    LF_TRY(lf_cuda_qkv_rope(&a, c->stream));
    LF_TRY(lf_cuda_prefill_attn(&c->pv, pool, l, n0, m->n_heads, T, c->qb, c->kb, c->vb,
                                c->ap.scale, c->att, compress ? c->ml : NULL, c->stream));
    if (compress) {
      LF_TRY(lf_cuda_snapkv_select(m->n_heads, m->n_kv_heads, m->head_dim, T, B, c->p.sink, w_eff,
                                   c->qb, c->kb, c->ml, c->ap.scale, c->snap, c->slot_of,
                                   c->stream));
      LF_TRY(lf_cuda_kv_store(&c->pv, pool, l, T, pos0, c->kb, c->vb, c->slot_of, 0, B - 1,
                              c->stream));
    } else {
      LF_TRY(lf_cuda_kv_store(&c->pv, pool, l, T, pos0, c->kb, c->vb, NULL, n0, n0 + T, c->stream));
    }
    /* the last layer leaves x alone: only its last row is normed, below */
    LF_TRY(layer_tail(c, L, T, l + 1 < m->n_layers ? c->layers[l + 1].rms_att : NULL, c->xb, NULL));
  }
  return LF_OK;
}

/* The host's mirror of a decode write into `pool`: the fill count grows until the pool is
 * full, then every (layer, KV head) overwrites a slot. Returns those evictions, over the
 * model's KV heads (gcfg): under tensor parallelism every rank holds a part of them, and each
 * head evicts alike, so this is the model's total with each head counted once. */
static uint64_t note_decode_write(cuda_backend *c, int pool) {
  if (c->host_n[pool] == c->p.budget) return (uint64_t)c->gcfg.n_layers * c->gcfg.n_kv_heads;
  c->host_n[pool]++;
  return 0;
}

/* One decode step of one sequence (a prompt chunk run token by token); xf[row] when last. */
static lf_status decode_one(cuda_backend *c, int pool, int32_t pos, int32_t tok, int row,
                            uint64_t *evictions) {
  c->h_step.tok[0] = tok;
  c->h_step.pool[0] = pool;
  c->h_step.pos[0] = pos;
  c->h_step.rows[0] = row;
  LF_TRY(step_upload(c, 1));
  /* the host arrays are reused at once: wait for the copies (pageable memory is staged, but
   * the step arrays are pinned) */
  LF_TRY(stream_wait(c));
  LF_TRY(decode_run(c, 1));
  *evictions += note_decode_write(c, pool);
  return LF_OK;
}

/* ---- the backend interface ---------------------------------------------------------------- */

/* Under TP, sampled batches: the largest top-k when every item is greedy (k 1) or samples with
 * 1 <= top_k <= LF_TP_TOPK_MAX, so each rank sends its k best pairs instead of its whole slice
 * (parallel/tp.h lf_tp_topk_logits does the same on CPU ranks); 0: gather the slices. Depends
 * only on the items, the same on every rank. */
static int tp_topk_kmax(const cuda_backend *c, const lf_batch_item *items,
                        const lf_batch_result *res, int n, int logits_wanted) {
  if (!c->tp_topk || logits_wanted) return 0;
  const int V = c->cfg.vocab_size;
  int kmax = 1;
  for (int i = 0; i < n; i++) {
    if (res[i].status != LF_OK || items[i].sampling.temperature <= 0.0f) continue;
    const int k = items[i].sampling.top_k;
    if (k < 1 || k > LF_TP_TOPK_MAX || k >= V) return 0;
    if (k > kmax) kmax = k;
  }
  return 2 * kmax <= c->sh.max_vocab ? kmax : 0;
}

static lf_status cuda_forward(lf_backend *b, const lf_batch_item *items, int n,
                              lf_batch_result *res, float *logits_out) {
  cuda_backend *c = (cuda_backend *)b;
  const lf_model_config *m = &c->cfg;
  const int B = c->p.budget, evicts = c->p.policy != LF_POLICY_FULL;
  LF_CUDA_CHECK(cudaSetDevice(c->device));
  if (n < 0 || n > c->max_items)
    return lf_error(LF_ERR_INVALID_ARG, "cuda forward: %d items (at most %d, one per pool)", n,
                    c->max_items);
  if (n == 0) return LF_OK;
  if (!items || !res) return lf_error(LF_ERR_INVALID_ARG, "cuda forward: NULL items or results");

  /* Per-item checks, as the cpu forward makes them; a pool may appear once per batch. */
  for (int i = 0; i < n; i++) {
    const lf_batch_item *it = &items[i];
    lf_batch_result *r = &res[i];
    r->token = -1;
    r->evictions = 0;
    r->status = LF_OK;
    if (it->n_tok < 1 || !it->tokens) {
      r->status = lf_error(LF_ERR_INVALID_ARG, "forward: n_tok %d < 1", it->n_tok);
      continue;
    }
    if (it->pool < 0 || it->pool >= c->p.n_pools || !c->in_use[it->pool]) {
      r->status = lf_error(LF_ERR_INVALID_ARG, "forward: pool %d is not a taken pool", it->pool);
      continue;
    }
    for (int j = 0; j < i && r->status == LF_OK; j++)
      if (items[j].pool == it->pool)
        r->status = lf_error(LF_ERR_INVALID_ARG, "forward: pool %d appears twice in one batch",
                             it->pool);
    for (int t = 0; t < it->n_tok && r->status == LF_OK; t++)
      if (it->tokens[t] < 0 || it->tokens[t] >= m->vocab_size)
        r->status = lf_error(LF_ERR_INVALID_ARG, "token id %d out of range [0, %d)",
                             it->tokens[t], m->vocab_size);
    if (r->status != LF_OK) continue;
    const int n0 = c->host_n[it->pool];
    if (!evicts && n0 + it->n_tok > B)
      r->status = lf_error(LF_ERR_CONTEXT_FULL,
                           "full policy: %d filled + %d new tokens exceed the budget of %d slots",
                           n0, it->n_tok, B);
    else if (it->n_tok > c->max_chunk &&
             lf_prefill_kind_of(c->p.policy, B, n0, it->n_tok) == LF_PREFILL_COMPRESS)
      r->status = lf_error(LF_ERR_UNSUPPORTED,
                           "cuda: a %d-token prompt needs SnapKV compression over more than the "
                           "%d-token prefill chunk",
                           it->n_tok, c->max_chunk);
  }

  /* Prefill items, one at a time. */
  for (int i = 0; i < n; i++) {
    const lf_batch_item *it = &items[i];
    if (res[i].status != LF_OK || it->n_tok == 1) continue;
    const lf_prefill_kind kind = lf_prefill_kind_of(c->p.policy, B, c->host_n[it->pool], it->n_tok);
    if (kind == LF_PREFILL_DECODE_STEPS) {
      for (int t = 0; t < it->n_tok; t++)
        LF_TRY(decode_one(c, it->pool, it->pos0 + t, it->tokens[t], i, &res[i].evictions));
      continue;
    }
    const int compress = kind == LF_PREFILL_COMPRESS;
    for (int off = 0; off < it->n_tok; off += c->max_chunk) {
      const int T = it->n_tok - off < c->max_chunk ? it->n_tok - off : c->max_chunk;
      LF_TRY(prefill_chunk(c, it->pool, it->pos0 + off, it->tokens + off, T, c->host_n[it->pool],
                           compress, off + T == it->n_tok, i));
    }
  }

  /* Decode items, one batched pass. */
  int nd = 0;
  for (int i = 0; i < n; i++) {
    const lf_batch_item *it = &items[i];
    if (res[i].status != LF_OK || it->n_tok != 1) continue;
    c->h_step.tok[nd] = it->tokens[0];
    c->h_step.pool[nd] = it->pool;
    c->h_step.pos[nd] = it->pos0;
    c->h_step.rows[nd] = i;
    nd++;
    res[i].evictions += note_decode_write(c, it->pool);
  }
  if (nd > 0) {
    LF_TRY(step_upload(c, nd));
    LF_TRY(decode_run(c, nd));
  }

  /* LM head and token selection for every item (failed items' rows are ignored). */
  int need_full = c->comm == NULL || logits_out != NULL;
  for (int i = 0; i < n && !need_full; i++) need_full = items[i].sampling.temperature > 0.0f;
  LF_TRY(gemm(c, c->lm_head, c->xf, c->llocal, CUDA_R_32F, c->nv, m->dim, n, 0.0f));
  if (!need_full) {
    /* tensor parallel, all greedy: one gather of (max, id) pairs, the pick on the device */
    LF_TRY(lf_cuda_argmax_pairs(c->llocal, c->nv, n, c->sh.vocab0, c->pairs, c->stream));
    LF_TRY(c->comm->allgather(c->comm, c->pairs, c->pairs_all, 2 * (size_t)n, LF_COMM_I32,
                              c->stream));
    LF_TRY(lf_cuda_tp_pick(c->pairs_all, c->comm->size, n, c->d_tok_out, c->stream));
  } else {
    for (int i = 0; i < n; i++) {
      lf_sample_params *sp = &c->h_sp[i];
      sp->temperature = items[i].sampling.temperature;
      sp->top_k = items[i].sampling.top_k;
      sp->top_p = items[i].sampling.top_p;
      sp->u = items[i].u;
    }
    LF_CUDA_CHECK(cudaMemcpyAsync(c->d_sp, c->h_sp, (size_t)n * sizeof *c->h_sp,
                                  cudaMemcpyHostToDevice, c->stream));
    const int kmax = c->comm ? tp_topk_kmax(c, items, res, n, logits_out != NULL) : 0;
    if (kmax > 0) {
      /* every item greedy or top-k: each rank's k best (value, id) pairs, gathered, spread
       * over -inf logits [n][vocab] (lsend and probs are free until sampling) */
      LF_TRY(lf_cuda_topk_pairs(c->llocal, c->nv, n, c->sh.vocab0, c->d_sp, kmax,
                                (int32_t *)c->lsend, c->stream));
      LF_TRY(c->comm->allgather(c->comm, c->lsend, c->probs, (size_t)n * kmax * 2, LF_COMM_I32,
                                c->stream));
      LF_TRY(lf_cuda_scatter_pairs((const int32_t *)c->probs, c->comm->size, n, kmax,
                                   m->vocab_size, c->logits, c->stream));
    } else if (c->comm) {
      /* the full logits on every rank: the slices padded to max_vocab, gathered into probs
       * [T][n][max_vocab] (free until sampling), unpacked into logits [n][vocab] */
      const int T = c->comm->size, mv = c->sh.max_vocab, V = m->vocab_size;
      LF_CUDA_CHECK(cudaMemcpy2DAsync(c->lsend, (size_t)mv * 4, c->llocal, (size_t)c->nv * 4,
                                      (size_t)c->nv * 4, (size_t)n, cudaMemcpyDeviceToDevice,
                                      c->stream));
      LF_TRY(c->comm->allgather(c->comm, c->lsend, c->probs, (size_t)n * mv, LF_COMM_F32,
                                c->stream));
      for (int r = 0; r < T; r++) {
        const int v0 = lf_shard_split(V, T, r), nvr = lf_shard_split(V, T, r + 1) - v0;
        LF_CUDA_CHECK(cudaMemcpy2DAsync(c->logits + v0, (size_t)V * 4,
                                        c->probs + (size_t)r * n * mv, (size_t)mv * 4,
                                        (size_t)nvr * 4, (size_t)n, cudaMemcpyDeviceToDevice,
                                        c->stream));
      }
    }
    LF_TRY(lf_cuda_sample(c->logits, m->vocab_size, n, c->d_sp, c->d_tok_out, c->probs,
                          c->stream));
    for (int i = 0; i < n; i++)
      if (res[i].status == LF_OK && lf_sample_needs_sort(&c->h_sp[i], m->vocab_size))
        LF_TRY(lf_cuda_sample_sorted(c->logits + (size_t)i * m->vocab_size, m->vocab_size,
                                     &c->h_sp[i], c->d_tok_out + i, c->sort_ws, c->sort_ws_bytes,
                                     c->stream));
  }
  /* the stream must have passed the collectives before a copy to pageable memory, which
   * would block in CUDA with no deadline */
  if (c->comm && logits_out) LF_TRY(stream_wait(c));
  LF_CUDA_CHECK(cudaMemcpyAsync(c->h_tok_out, c->d_tok_out, (size_t)n * sizeof(int32_t),
                                cudaMemcpyDeviceToHost, c->stream));
  if (logits_out)
    LF_CUDA_CHECK(cudaMemcpyAsync(logits_out, c->logits, (size_t)n * m->vocab_size * sizeof(float),
                                  cudaMemcpyDeviceToHost, c->stream));
  LF_TRY(stream_wait(c));
  for (int i = 0; i < n; i++)
    if (res[i].status == LF_OK) res[i].token = c->h_tok_out[i];
  return LF_OK;
}

static lf_status cuda_pool_take(lf_backend *b, int *pool) {
  cuda_backend *c = (cuda_backend *)b;
  if (!pool) return lf_error(LF_ERR_INVALID_ARG, "pool_take: NULL argument");
  if (c->n_free <= 0)
    return lf_error(LF_ERR_STATE, "pool_take: all %d pools are in use", c->p.n_pools);
  LF_CUDA_CHECK(cudaSetDevice(c->device));
  const int p = c->free_list[--c->n_free];
  const size_t heads = (size_t)c->cfg.n_layers * c->cfg.n_kv_heads;
  /* metadata only (n = 0, next = -1, pos = -1); K/V keep stale values below n */
  LF_CUDA_CHECK(cudaMemsetAsync(c->pv.n + p * heads, 0, heads * sizeof(int32_t), c->stream));
  LF_CUDA_CHECK(cudaMemsetAsync(c->pv.next + p * heads, 0xff, heads * sizeof(int32_t), c->stream));
  LF_CUDA_CHECK(cudaMemsetAsync(c->pv.pos + p * heads * c->p.budget, 0xff,
                                heads * c->p.budget * sizeof(int32_t), c->stream));
  c->in_use[p] = 1;
  c->host_n[p] = 0;
  *pool = p;
  return LF_OK;
}

static lf_status cuda_pool_give(lf_backend *b, int pool) {
  cuda_backend *c = (cuda_backend *)b;
  if (pool < 0 || pool >= c->p.n_pools)
    return lf_error(LF_ERR_STATE, "pool_give: pool %d is not in [0, %d)", pool, c->p.n_pools);
  if (!c->in_use[pool]) return lf_error(LF_ERR_STATE, "pool_give: pool %d is already free", pool);
  c->in_use[pool] = 0;
  c->free_list[c->n_free++] = pool;
  return LF_OK;
}

static int cuda_pools_free(lf_backend *b) {
  return ((cuda_backend *)b)->n_free;
}

static int cuda_pool_slots_filled(lf_backend *b, int pool) {
  cuda_backend *c = (cuda_backend *)b;
  return pool >= 0 && pool < c->p.n_pools ? c->host_n[pool] : 0;
}

/* Tensor parallelism: ranks size their pools from their own free memory, and every rank must
 * hold the same pools (rank 0's scheduler hands out ids for all). The engine takes the minimum
 * over ranks and lowers the others' count here, before any pool is taken: the free list is
 * rebuilt so pool_take returns the same ids on every rank. The extra arena stays allocated. */
extern "C" lf_status lf_backend_cuda_limit_pools(lf_backend *b, int n_pools) {
  cuda_backend *c = (cuda_backend *)b;
  if (!c || n_pools < 1 || n_pools > c->p.n_pools)
    return lf_error(LF_ERR_INVALID_ARG, "limit_pools: %d pools of %d", n_pools,
                    c ? c->p.n_pools : 0);
  if (c->n_free != c->p.n_pools)
    return lf_error(LF_ERR_STATE, "limit_pools: %d pools are in use", c->p.n_pools - c->n_free);
  c->p.n_pools = n_pools;
  c->max_items = n_pools;
  for (int i = 0; i < n_pools; i++) c->free_list[i] = n_pools - 1 - i;
  c->n_free = n_pools;
  return LF_OK;
}

/* Everything cuda_free releases on the device side (memory, graphs, handles, the stream). */
static void free_device_side(cuda_backend *c) {
  if (c->layers) {
    for (int l = 0; l < c->cfg.n_layers; l++) {
      cuda_layer *L = &c->layers[l];
      cudaFree(L->wqkv);
      cudaFree(L->wo);
      cudaFree(L->wgu);
      cudaFree(L->wdown);
      cudaFree(L->rms_att);
      cudaFree(L->rms_ffn);
      cudaFree(L->bqkv);
      cudaFree(L->q_norm);
      cudaFree(L->k_norm);
    }
  }
  if (c->lm_head != c->embed) cudaFree(c->lm_head);
  cudaFree(c->embed);
  cudaFree(c->rms_final);
  cudaFree(c->inv_freq);
  cudaFree(c->pv.k);
  cudaFree(c->pv.v);
  cudaFree(c->pv.vnorm);
  cudaFree(c->pv.pos);
  cudaFree(c->pv.n);
  cudaFree(c->pv.next);
  void *bufs[] = {c->x,     c->xb,    c->qkv,  c->qb,      c->kb,       c->vb,
                  c->att,   c->gu,    c->hb,   c->xf,      c->logits,   c->probs,
                  c->w,     c->ml,    c->snap, c->slot_of, c->ptok,     c->attn_ws,
                  c->simple_scratch, c->sort_ws, c->io,   c->lsend,    c->pairs,
                  c->pairs_all};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cudaFree(bufs[i]);
  if (c->llocal != c->logits) cudaFree(c->llocal);
  cudaFreeHost(c->h_io);
  if (c->graph)
    for (int r = 0; r <= c->max_items; r++)
      if (c->graph[r]) cudaGraphExecDestroy(c->graph[r]);
  cudaFree(c->blas_ws);
  for (int i = 0; c->tunes && i < c->n_tunes; i++) {
    gemm_tune *t = &c->tunes[i];
    if (t->op) cublasLtMatmulDescDestroy(t->op);
    if (t->a) cublasLtMatrixLayoutDestroy(t->a);
    if (t->b) cublasLtMatrixLayoutDestroy(t->b);
    if (t->y) cublasLtMatrixLayoutDestroy(t->y);
  }
  if (c->lt) cublasLtDestroy(c->lt);
  if (c->blas) cublasDestroy(c->blas);
  if (c->stream) cudaStreamDestroy(c->stream);
}

static void cuda_free(lf_backend *b) {
  cuda_backend *c = (cuda_backend *)b;
  if (!c) return;
  cudaSetDevice(c->device);
  /* under TP a peer may be gone: the communicator's wait gives up (and aborts) at its deadline.
   * Then the device may still run a kernel that never ends (an abandoned NCCL abort), and
   * cudaFree would wait for it: the device memory is left to the process's exit. */
  const int dev_ok = !c->comm || !c->stream || lf_comm_sync(c->comm, c->stream) == LF_OK;
  if (c->stream && dev_ok) cudaStreamSynchronize(c->stream);
  if (dev_ok) free_device_side(c);
  free(c->layers);
  free(c->graph);
  free(c->graph_used);
  free(c->graph_seen);
  free(c->tunes);
  free(c->free_list);
  free(c->in_use);
  free(c->host_n);
  free(c);
}

/* n_pools == 0 (docs/DESIGN.md §5): the pools take mem_util of the device memory left after the weights
 * (loaded by now) and the workspaces. The workspaces that grow with the number of decode items
 * (logits and sampling scratch, activation rows beyond the prefill chunk, step I/O) are charged
 * to each pool; the fixed ones (prefill chunk buffers, attention, cuBLAS, sorting) are estimated
 * from above and set aside first. */
static lf_status size_pools(cuda_backend *c) {
  const lf_model_config *m = &c->cfg;
  const uint64_t V = (uint64_t)m->vocab_size, T = (uint64_t)c->max_chunk;
  const lf_pool_shape ps = {1, m->n_layers, m->n_kv_heads, c->p.budget, m->head_dim};
  const uint64_t arena = lf_pool_bytes_device(&ps);
  const uint64_t row = (uint64_t)m->dim * (4 + 2) + (uint64_t)c->qkv_dim * 4 +
                       (uint64_t)c->qd * (2 + 2) + (uint64_t)m->hidden_dim * (2 * 4 + 2);
  /* logits [V], probs (the gather of max_vocab slices under TP), own slice and its padded copy,
   * the (max, id) pairs */
  const uint64_t Tr = c->comm ? (uint64_t)c->comm->size : 1, mv = (uint64_t)c->sh.max_vocab;
  const uint64_t vbytes = 4 * (V + (Tr * mv > V ? Tr * mv : V)) +
                          (c->comm ? 4 * ((uint64_t)c->nv + mv) + 8 * (Tr + 1) : 0);
  const uint64_t item = vbytes + (uint64_t)m->dim * 2 + (uint64_t)m->n_kv_heads * 4 + 64 +
                        sizeof(lf_sample_params) + row; /* row: charged even below max_chunk */
  const uint64_t fixed = T * row + 2 * T * (uint64_t)c->kd * 2 + T * m->n_heads * 8 +
                         (uint64_t)m->n_kv_heads * T * 12 + lf_cuda_sample_sort_bytes(m->vocab_size) +
                         ((uint64_t)64 << 20) /* attention split workspace, graphs, slack */;
  size_t free_b = 0, total_b = 0;
  LF_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const double util = c->p.mem_util > 0 ? c->p.mem_util : LF_MEM_UTIL_DEFAULT;
  if (!(util <= 1.0))
    return lf_error(LF_ERR_INVALID_ARG, "cuda backend: mem_util %g must be in (0, 1]",
                    c->p.mem_util);
  const uint64_t avail = free_b > fixed ? free_b - fixed : 0;
  const int n = lf_sched_pools_for_memory(avail, util, arena + item);
  if (n < 1)
    return lf_error(LF_ERR_OUT_OF_MEMORY,
                    "cuda backend: %.2f GiB free after the weights hold no pool of %.1f MiB "
                    "(budget %d) at mem_util %g",
                    (double)free_b / (1 << 30), (double)(arena + item) / (1 << 20), c->p.budget,
                    util);
  c->p.n_pools = n;
  return LF_OK;
}

static lf_status create(cuda_backend *c) {
  const lf_model_config *m = &c->cfg;
  const lf_backend_params *p = &c->p;
  const int hkv = m->n_kv_heads, D = m->head_dim;
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < 1) {
    cudaGetLastError();
    return lf_error(LF_ERR_UNAVAILABLE, "cuda backend: no CUDA device");
  }
  if (p->policy == LF_POLICY_H2O)
    return lf_error(LF_ERR_UNSUPPORTED, "cuda backend: the h2o policy is not implemented on cuda "
                                        "(longflow, full, streaming are)");
  if (D > 256 || D % 2) return lf_error(LF_ERR_UNSUPPORTED, "cuda backend: head_dim %d", D);
  LF_TRY(lf_attn_params_check(&c->ap, p->budget));
  if (p->n_pools < 0) return lf_error(LF_ERR_INVALID_ARG, "cuda backend: n_pools %d", p->n_pools);
  if (c->comm && !c->comm->device)
    return lf_error(LF_ERR_INVALID_ARG,
                    "cuda backend: tensor parallelism needs a device communicator "
                    "(lf_comm_init_nccl / lf_comm_init_nccl_mpi), not '%s'",
                    c->comm->kind ? c->comm->kind : "?");
  LF_CUDA_CHECK(cudaGetDevice(&c->device));

  LF_CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
  LF_CUBLAS_CHECK(cublasCreate(&c->blas));
  LF_CUBLAS_CHECK(cublasSetStream(c->blas, c->stream));
  /* Our own workspace (32 MiB, what cuBLAS takes by default on Hopper): cuBLAS then never
   * allocates, which graph capture requires. */
  c->blas_ws_bytes = (size_t)32 << 20;
  CB_ALLOC(c->blas_ws, c->blas_ws_bytes);
  LF_CUBLAS_CHECK(cublasSetWorkspace(c->blas, c->blas_ws, c->blas_ws_bytes));
  LF_CUBLAS_CHECK(cublasLtCreate(&c->lt));
  c->tunes = (gemm_tune *)calloc(GEMM_TUNE_MAX, sizeof *c->tunes);
  if (!c->tunes) return lf_error(LF_ERR_OUT_OF_MEMORY, "cuda backend: GEMM tuning table");

  c->layers = (cuda_layer *)calloc((size_t)m->n_layers, sizeof *c->layers);
  if (!c->layers) return lf_error(LF_ERR_OUT_OF_MEMORY, "cuda backend: host tables");
  LF_TRY(load_weights(c));
  if (p->n_pools == 0) LF_TRY(size_pools(c));
  c->max_items = p->n_pools;

  c->free_list = (int *)malloc((size_t)p->n_pools * sizeof(int));
  c->in_use = (uint8_t *)calloc((size_t)p->n_pools, 1);
  c->host_n = (int *)calloc((size_t)p->n_pools, sizeof(int));
  if (!c->layers || !c->free_list || !c->in_use || !c->host_n)
    return lf_error(LF_ERR_OUT_OF_MEMORY, "cuda backend: host tables");
  for (int i = 0; i < p->n_pools; i++) c->free_list[i] = p->n_pools - 1 - i;
  c->n_free = p->n_pools;

  {
    float *f = (float *)malloc(sizeof(float) * (size_t)(D / 2));
    if (!f) return lf_error(LF_ERR_OUT_OF_MEMORY, "rope table");
    lf_rope_freqs(m, f);
    CB_ALLOC(c->inv_freq, sizeof(float) * (size_t)(D / 2));
    cudaError_t e = cudaMemcpy(c->inv_freq, f, sizeof(float) * (size_t)(D / 2),
                               cudaMemcpyHostToDevice);
    free(f);
    LF_CUDA_CHECK(e);
  }

  /* The arena. */
  const size_t heads = (size_t)p->n_pools * m->n_layers * hkv, slots = heads * p->budget;
  c->pv.n_layers = m->n_layers;
  c->pv.n_kv_heads = hkv;
  c->pv.budget = p->budget;
  c->pv.head_dim = D;
  CB_ALLOC(c->pv.k, slots * D * 2);
  CB_ALLOC(c->pv.v, slots * D * 2);
  CB_ALLOC(c->pv.vnorm, slots * 4);
  CB_ALLOC(c->pv.pos, slots * 4);
  CB_ALLOC(c->pv.n, heads * 4);
  CB_ALLOC(c->pv.next, heads * 4);
  LF_CUDA_CHECK(cudaMemset(c->pv.n, 0, heads * 4));
  LF_CUDA_CHECK(cudaMemset(c->pv.next, 0xff, heads * 4));
  LF_CUDA_CHECK(cudaMemset(c->pv.pos, 0xff, slots * 4));
  LF_CUDA_CHECK(cudaMemset(c->pv.vnorm, 0, slots * 4));

  /* Workspaces. */
  const size_t rows = (size_t)(c->max_items > c->max_chunk ? c->max_items : c->max_chunk);
  const size_t V = (size_t)m->vocab_size, T = (size_t)c->max_chunk;
  CB_ALLOC(c->x, rows * m->dim * 4);
  CB_ALLOC(c->xb, rows * m->dim * 2);
  CB_ALLOC(c->qkv, rows * c->qkv_dim * 4);
  CB_ALLOC(c->qb, rows * c->qd * 2);
  CB_ALLOC(c->kb, T * c->kd * 2);
  CB_ALLOC(c->vb, T * c->kd * 2);
  CB_ALLOC(c->att, rows * c->qd * 2);
  CB_ALLOC(c->gu, rows * 2 * m->hidden_dim * 4);
  CB_ALLOC(c->hb, rows * m->hidden_dim * 2);
  CB_ALLOC(c->xf, (size_t)c->max_items * m->dim * 2);
  CB_ALLOC(c->logits, (size_t)c->max_items * V * 4);
  if (c->comm) {
    const size_t T = (size_t)c->comm->size, mv = (size_t)c->sh.max_vocab;
    CB_ALLOC(c->probs, (size_t)c->max_items * (T * mv > V ? T * mv : V) * 4);
    CB_ALLOC(c->llocal, (size_t)c->max_items * c->nv * 4);
    CB_ALLOC(c->lsend, (size_t)c->max_items * mv * 4);
    CB_ALLOC(c->pairs, (size_t)c->max_items * 2 * 4);
    CB_ALLOC(c->pairs_all, T * c->max_items * 2 * 4);
  } else {
    CB_ALLOC(c->probs, (size_t)c->max_items * V * 4);
    c->llocal = c->logits;
  }
  CB_ALLOC(c->w, (size_t)c->max_items * hkv * 4);
  CB_ALLOC(c->ml, T * m->n_heads * 2 * 4);
  CB_ALLOC(c->snap, (size_t)hkv * 2 * T * 4);
  CB_ALLOC(c->slot_of, (size_t)hkv * T * 4);
  CB_ALLOC(c->ptok, T * 4);
  /* xf rows of failed items are read by the LM head: keep them finite */
  LF_CUDA_CHECK(cudaMemset(c->xf, 0, (size_t)c->max_items * m->dim * 2));

  c->use_fused = (D == 64 || D == 128) && c->group <= 8 && !getenv("LF_CUDA_SIMPLE_ATTN");
  if (c->use_fused) {
    /* Split counts fall as the batch grows and are at their minimum once a batch fills the
     * SMs: the sizes up to a few hundred, and the largest, cover every batch. */
    for (int ns = 1; ns <= c->max_items; ns = ns < 512 ? ns + 1 : c->max_items) {
      const size_t wb = lf_cuda_decode_attn_workspace_bytes(ns, hkv, p->budget, c->group, D,
                                                                 c->attn_splits);
      if (wb > c->attn_ws_bytes) c->attn_ws_bytes = wb;
      if (ns == c->max_items) break;
    }
    CB_ALLOC(c->attn_ws, c->attn_ws_bytes);
    LF_TRY(lf_cuda_decode_attn_workspace_init(c->attn_ws, c->attn_ws_bytes, c->stream));
  } else {
    CB_ALLOC(c->simple_scratch,
             lf_cuda_decode_attn_simple_scratch(c->max_items, m->n_heads, p->budget) * 4);
  }
  c->sort_ws_bytes = lf_cuda_sample_sort_bytes(m->vocab_size);
  CB_ALLOC(c->sort_ws, c->sort_ws_bytes);

  c->graph = (cudaGraphExec_t *)calloc((size_t)c->max_items + 1, sizeof *c->graph);
  c->graph_used = (uint64_t *)calloc((size_t)c->max_items + 1, sizeof *c->graph_used);
  c->graph_seen = (uint8_t *)calloc((size_t)c->max_items + 1, 1);
  if (!c->graph || !c->graph_used || !c->graph_seen)
    return lf_error(LF_ERR_OUT_OF_MEMORY, "cuda backend: graph cache");

  /* Step I/O: 4 int arrays, sample params, tokens; pinned on the host. */
  const size_t mi = (size_t)c->max_items;
  c->io_bytes = 5 * mi * 4 + mi * sizeof(lf_sample_params);
  CB_ALLOC(c->io, c->io_bytes);
  if (cudaMallocHost((void **)&c->h_io, c->io_bytes) != cudaSuccess) {
    cudaGetLastError();
    return lf_error(LF_ERR_OUT_OF_MEMORY, "cuda backend: pinned step buffers");
  }
  int32_t *d = c->io, *h = c->h_io;
  c->d_step.tok = d, c->h_step.tok = h;
  c->d_step.pool = d + mi, c->h_step.pool = h + mi;
  c->d_step.pos = d + 2 * mi, c->h_step.pos = h + 2 * mi;
  c->d_step.rows = d + 3 * mi, c->h_step.rows = h + 3 * mi;
  c->d_tok_out = d + 4 * mi, c->h_tok_out = h + 4 * mi;
  c->d_sp = (lf_sample_params *)(d + 5 * mi), c->h_sp = (lf_sample_params *)(h + 5 * mi);
  /* The whole device, not only c->stream: a cudaMemcpy from pageable host memory (the weight
   * and table uploads above) returns once its data is staged, and the DMA still in flight on the
   * legacy stream is not ordered before c->stream's kernels (a non-blocking stream). */
  LF_CUDA_CHECK(cudaDeviceSynchronize());
  return LF_OK;
}

extern "C" lf_status lf_backend_cuda_create(const lf_checkpoint *ck, const lf_backend_params *p,
                                            lf_backend **out) {
  if (!ck || !p || !out) return lf_error(LF_ERR_INVALID_ARG, "cuda backend: NULL argument");
  *out = NULL;
  const lf_model_config *m = &ck->cfg;
  const lf_comm_t comm = p->comm && p->comm->size > 1 ? p->comm : NULL;
  lf_shard sh;
  LF_TRY(lf_shard_plan(comm ? comm->rank : 0, comm ? comm->size : 1, m->n_heads, m->n_kv_heads,
                       m->hidden_dim, m->vocab_size, &sh));
  cuda_backend *c = (cuda_backend *)calloc(1, sizeof *c);
  if (!c) return lf_error(LF_ERR_OUT_OF_MEMORY, "cuda backend");
  c->ck = ck;
  c->gcfg = *m;
  c->cfg = *m; /* this rank's part: */
  c->cfg.n_heads = sh.n_cq;
  c->cfg.n_kv_heads = sh.n_kv;
  c->cfg.hidden_dim = sh.n_hid;
  c->comm = comm;
  c->sh = sh;
  c->nv = sh.n_vocab;
  c->p = *p;
  m = &c->cfg;
  c->base.name = "cuda";
  c->base.forward = cuda_forward;
  c->base.pool_take = cuda_pool_take;
  c->base.pool_give = cuda_pool_give;
  c->base.pools_free = cuda_pools_free;
  c->base.pool_slots_filled = cuda_pool_slots_filled;
  c->base.free = cuda_free;
  c->qd = m->n_heads * m->head_dim;
  c->kd = m->n_kv_heads * m->head_dim;
  c->qd_own = sh.n_q * m->head_dim;
  c->qkv_dim = c->qd + 2 * c->kd;
  c->group = m->n_heads / m->n_kv_heads;
  c->ap.policy = p->policy;
  c->ap.sink = p->sink;
  c->ap.window = p->window;
  c->ap.h2o_recent = p->window;
  c->ap.group = c->group;
  c->ap.head_dim = m->head_dim;
  c->ap.scale = 1.0f / sqrtf((float)m->head_dim);
  const char *e = NULL;
  c->max_items = p->n_pools; /* n_pools 0: set by create() */
  c->use_graphs = !p->no_graphs;
  e = getenv("LF_CUDA_GRAPHS");
  if (e && !strcmp(e, "0")) c->use_graphs = 0;
  if (comm) { /* collectives inside captured graphs: measured on 2 x H200 (see tp_allreduce_x) */
    e = getenv("LF_CUDA_GRAPHS_TP");
    if (e && !strcmp(e, "0")) c->use_graphs = 0;
  }
  /* At small batches decode attention is latency-bound (~20 us a layer at batch 1 on an H200
   * for 4 MB of K/V) and DRAM idles meanwhile; LF_L2_PREFETCH_ROWS=N has it prefetch the O
   * projection into L2 up to batch N. Off: on an H200 it made the batch-1 step 1.3% slower
   * (5.148 vs 5.080 ms, llama3-8b; bench/RESULTS.md, session 4). */
  c->l2_prefetch_rows = env_int("LF_L2_PREFETCH_ROWS", 0, 0, INT_MAX);
  c->graph_cap = 64;
  e = getenv("LF_CUDA_GRAPH_CACHE");
  if (e && atoi(e) > 0) c->graph_cap = atoi(e);
  /* PDL (attention/cuda_launch.cuh): on 2 x H200 it made batch-1 steps 2-3% faster, one GPU's
   * batch-64 steps 0.8-1% faster, but TP=2 batch-64 steps 3-4% slower (three calls,
   * bench/RESULTS.md): under TP only for passes of up to 16 rows. */
  c->pdl_max_rows = env_int("LF_PDL_MAX_ROWS", comm ? 16 : INT_MAX, INT_MIN, INT_MAX);
  /* The GEMV only at batch 1: on an H200 (random:llama3-8b, session 3) it beat cuBLAS there
   * (5.05 vs 5.72 ms a step in session 2's attribution) but lost from batch 2 on (2: 5.47 vs
   * 5.23 ms, 4: 6.37 vs 5.19, 8: 9.92 vs 5.37), its per-token X reads growing with the batch. */
  c->gemv_max = env_int("LF_CUDA_GEMV_MAX", 1, 0, LF_GEMV_MAX_TOK);
  /* Prompt chunks of up to 8 tokens on the GEMVs, and the residual GEMVs in 8 K parts: with
   * them batch-1 decoding of a short prompt gives the same bits at TP = 1, 2, 4 and 8 (gemm_res). */
  c->prefill_gemv = env_int("LF_CUDA_PREFILL_GEMV", 8, 0, LF_GEMV_MAX_TOK);
  c->gemv_parts = env_int("LF_GEMV_PARTS", 8, 0, 8);
  /* device top-k for sampled TP batches: on since it passed mpi_gpu_tp on 2 x H200 (session 5) */
  c->tp_topk = env_int("LF_TP_TOPK", 1, 0, 1);
  c->tune_on = 1;
  e = getenv("LF_CUDA_GEMM_TUNE");
  if (e && !strcmp(e, "0")) c->tune_on = 0;
  e = getenv("LF_CUDA_ATTN_SPLITS");
  if (e && atoi(e) > 0) c->attn_splits = atoi(e);
  e = getenv("LF_CUDA_SKIP");
  if (e) LF_TRY(parse_skip(e, &c->skip));
  e = getenv("LF_CUDA_SKIP_ATTN"); /* the older spelling of LF_CUDA_SKIP=attn */
  if (e && !strcmp(e, "1")) c->skip |= SKIP_ATTN;
  /* Prefill chunk: LF_CUDA_PREFILL_CHUNK tokens, default min(max_seq_len, 2048). */
  c->max_chunk = m->max_seq_len < 2048 ? m->max_seq_len : 2048;
  e = getenv("LF_CUDA_PREFILL_CHUNK");
  if (e && atoi(e) > 0) c->max_chunk = atoi(e);
  lf_status s = create(c);
  if (s != LF_OK) {
    cuda_free(&c->base);
    return s;
  }
  *out = &c->base;
  return LF_OK;
}

extern "C" int lf_cuda_device_present(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n > 0;
}

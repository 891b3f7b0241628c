/* The cuda backend's private state, shared by its files (docs/DESIGN.md §2):
 *   create.cu   creation, sizing of the pools, the tuning settings, destruction
 *   forward.cu  the vtable's forward: prefill chunks, the batched decode pass, the LM head and
 *               token selection
 *   gemm.cu     GEMM selection: the bandwidth GEMV, cuBLAS, cublasLt algorithms timed per shape
 *   graphs.cu   the decode step's CUDA-graph cache
 *   tp.cu       the tensor-parallel pieces: residual all-reduces, the fused IPC route, the
 *               vocab-parallel token selection
 *   weights.cu  weights (this rank's shard) uploaded in bf16
 *   pools.cu    the pool free list and the host mirror of fill counts
 *
 * One forward, top to bottom:
 *   prompt chunks that overflow a non-empty pool under eviction: token by token, as decode
 *     steps (lf_prefill_kind_of);
 *   the other prompt chunks (appended, or SnapKV-compressed into an empty pool) and the decode
 *     items (n_tok == 1) in one mixed pass over the weights, Sarathi-style (the scheduler's
 *     max_batch_tokens caps the prompt tokens of a step); more passes only for prompt tokens
 *     beyond max_chunk:
 *     embed -> per layer [RMSNorm -> QKV GEMM over every row -> bias, q/k norm, RoPE; prompt
 *     rows to bf16 q, k, v, decode rows' k/v straight into the slot w = (n < B) ? n++ : next
 *     (attention/kv_write.cuh) -> per prompt chunk: causal GQA attention over the pool's filled
 *     slots and the chunk on tensor cores (attention/prefill_attn.cuh), then the append to the
 *     pool (or SnapKV's selection and the compressed write); the decode rows, on the side
 *     stream beside the chunks' attention when the pass has both: the fused LongFlow decode
 *     attention (attention/decode_attn.cuh; decode_attn_generic.cuh for shapes it does not
 *     take), choosing every (sequence, layer, KV head)'s next slot -> O GEMM (+= residual) -> RMSNorm -> gate|up GEMM -> SiLU * up ->
 *     down GEMM (+= residual)] -> final RMSNorm of each item's last row into xf[item].
 *     A step of decode items only replays a captured CUDA graph of the same layers (graphs.cu);
 *   LM head GEMM over xf [items][dim] -> argmax / sampling on the device -> tokens to the host.
 * Residual adds are the GEMMs' beta = 1: the fp32 residual stream x is cuBLAS's C.
 *
 * Pools: the device arena is layer-major, [layer][pool][kv_head][slot][dim] (bf16 K and V) with
 * per-slot ||v||_1 and position and per-(layer, pool, head) n and next, and every kernel gets one
 * layer of it as a view of n_layers 1 (lv[l]), so each layer may hold its own number of slots
 * (per-layer budgets, lf_engine_config.layer_weights). The free list and each (pool, layer)'s
 * fill count n (the same for every head) are mirrored on the host, so admission, context-full
 * checks and eviction counts never read the device.
 * Every buffer is allocated at create for n_pools decode items and max_chunk prefill tokens; a
 * forward allocates nothing.
 */
#ifndef LF_CUDA_BACKEND_H
#define LF_CUDA_BACKEND_H

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "attention/attention.h"
#include "base/cuda_check.h"
#include "engine/backend.h"
#include "base/error.h"
#include "kernels/sample.cuh"
#include "memory/pool.h"
#include "parallel/comm.h"
#include "parallel/shard.h"

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

/* A GEMM shape whose cublasLt algorithm was chosen by timing (see gemm.cu). */
typedef struct gemm_tune {
  int n_out, n_in, n_tok, y_bf16, beta1;
  int ok; /* 0: no cublasLt algorithm ran; use cublasGemmEx */
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t a, b, y;
  cublasLtMatmulAlgo_t algo;
} gemm_tune;

#define GEMM_TUNE_MAX 4096

/* A prompt chunk in a forward pass (forward.cu): rows row0 .. row0 + T - 1 of the pass, tokens
 * tok_off .. of item `item`, entering pool `pool` that holds n0 filled slots at positions
 * pos0 ..; appended, or (compress) SnapKV-compressed into the empty pool; last: the prompt ends
 * here and its final normed row goes to xf[item]. */
typedef struct pass_seg {
  int item, pool, T, tok_off, n0, row0, compress, last;
  int32_t pos0;
} pass_seg;

/* cuda_backend.kinds entry of an item that is not a prompt (or failed its checks) */
#define KIND_NONE 255

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
  int use_fused; /* decode attention: the fused kernel (else the generic one, for shapes the
                    fused one does not take) */

  cudaStream_t stream;
  /* A pass with prompt chunks and decode rows runs the decode rows' RoPE and attention on
   * `side` (higher priority), beside the chunks' attention on `stream`: the one reads the KV
   * pools at memory speed, the other works the tensor cores. fork/join order the two. */
  cudaStream_t side;
  cudaEvent_t fork, join;
  cublasHandle_t blas;

  /* weights */
  bf16 *embed;    /* [vocab][dim] */
  bf16 *lm_head;  /* [vocab][dim]; == embed when tied */
  float *rms_final; /* [dim] */
  cuda_layer *layers; /* host array [n_layers] of device pointers */
  float *inv_freq;    /* [head_dim / 2] */
  float *kmu;         /* [n_layers][kd] key means as subtracted (lf_key_means_rows of
                         p.key_means: this rank's KV heads, rotated as keys are), or NULL */

  /* pools */
  lf_cuda_pool_view pv; /* the device arena's allocations (layer-major; kernels get lv[l]) */
  lf_cuda_pool_view *lv; /* [n_layers] layer l's part of the arena as a view of one layer */
  int *lbud;    /* [n_layers] slots per (pool, head) of each layer (p.budget in each, unless
                   p.layer_budget) */
  int *lrecent; /* [n_layers] h2o's recent window of each layer (lf_attn_params_for_budget) */
  int bmin, bmax, lmin; /* the smallest and largest layer budget; lmin: the first layer of bmin,
                           whose fill decides how a prompt chunk enters a pool */
  int *d_lbud;      /* device copy of lbud (the pool-reset kernel) */
  int pv_pools;     /* the pools the arena was laid out for (its per-layer stride; a later
                       lf_backend_cuda_limit_pools leaves it) */
  lf_pool_list pools; /* which pools are free (memory/pool.h) */
  int *host_n; /* [n_pools][n_layers] fill count mirror */

  /* activations, rows = max_items + max_chunk (a mixed pass: a prompt chunk and every decode
   * item) */
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
  float *h2o_cs; /* h2o only: [n_heads][bmax + max_chunk] a chunk's column sums */
  int32_t *slot_of; /* [n_kv_heads][max_chunk] */
  int32_t *ptok;    /* [rows] a pass's tokens: prompt chunks, then the decode items' */
  int32_t *h_ptok;  /* pinned host staging of ptok */
  void *attn_ws;
  size_t attn_ws_bytes;
  void *rkv_ws; /* rkv with a layer over LF_CUDA_RKV_SMEM_BUDGET slots: the selection's arrays */
  size_t rkv_ws_bytes;
  float *simple_scratch; /* generic decode attention logits */
  int evict_per;  /* KV heads per eviction decision: 1 (scope head), or a group of the layer's
                     (scope layer: all this rank's, or n_kv / scope_groups) */
  float *scores;  /* [max_items][n_kv_heads][bmax] layer scope, longflow or h2o: every
                     candidate's score for lf_cuda_layer_argmin (NULL otherwise) */
  void *sort_ws;
  size_t sort_ws_bytes;
  int32_t *io;        /* device: step_io arrays, then sample params, then tokens */
  int32_t *h_io;      /* host copy of the same layout */
  step_io d_step, h_step;
  lf_sample_params *d_sp, *h_sp; /* [max_items] */
  lf_cuda_logit_adj *d_adj, *h_adj; /* the step's logit processing entries, grown on demand */
  size_t cap_adj;
  /* prompt logits at every position (lf_batch_item.logits_all), allocated at the first use:
   * a chunk's final-normed rows and their logits, [max_chunk] rows each */
  bf16 *pl_x;
  float *pl_logits;
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
  int in_prefill;   /* set while a pass with prompt chunks runs */
  pass_seg *segs;   /* host [max_items]: one pass's prompt chunks (at most one per item) */
  uint8_t *kinds;   /* host [max_items]: each item's lf_prefill_kind, or KIND_NONE */
  int pdl_max_rows; /* passes of more rows launch without PDL (LF_PDL_MAX_ROWS; default 16
                       under TP, no limit on one GPU) */
#ifdef LF_BENCH_INSTRUMENTS
  unsigned skip;   /* benchmark instrument (LF_CUDA_SKIP=attn,rope,...: SKIP_* bits): those
                      kernels of a decode pass are not run; the results are wrong, only the time
                      of the rest is meaningful (what a kernel costs inside the replayed step) */
#endif
  int device;      /* the CUDA device at create: set again on every entry (server threads) */

  /* Tensor parallelism (docs/DESIGN.md §4, parallel/shard.h); comm NULL on a single rank. See the
   * essay at the top of tp.cu. */
  lf_comm_t comm;
  lf_shard sh;
  int qd_own;       /* n_q head_dim: the O-projection's input columns this rank owns */
  int nv;           /* own vocabulary rows (embedding and LM head) */
  float *llocal;    /* [max_items][nv] own logits slice (== logits on a single rank) */
  float *lsend;     /* [max_items][max_vocab] the slice padded for the logits gather */
  int32_t *pairs;   /* [max_items][2] own (max bits, id); pairs_all [T][max_items][2] */
  int32_t *pairs_all;
} cuda_backend;

/* The fused residual all-reduce's staging slots (tp.cu): they alternate (embedding 2, O 0,
 * down 1), so two calls in a row never share one. */
enum { AR_SLOT_O = 0, AR_SLOT_DOWN = 1, AR_SLOT_EMBED = 2 };

#ifdef LF_BENCH_INSTRUMENTS
/* LF_CUDA_SKIP (benchmark instrument): the kernels a decode pass leaves out. */
enum {
  SKIP_ATTN = 1u << 0,  /* decode attention */
  SKIP_ROPE = 1u << 1,  /* QKV bias / norm / RoPE and the slot write */
  SKIP_RES = 1u << 2,   /* the residual all-reduce + RMSNorm after O and down (none under TP) */
  SKIP_QKV = 1u << 3,   /* the GEMMs: QKV, O, gate|up, down */
  SKIP_O = 1u << 4,
  SKIP_GU = 1u << 5,
  SKIP_DOWN = 1u << 6,
};
#define CB_SKIP(c, bit) ((c)->skip & (bit))
#else
#define CB_SKIP(c, bit) 0 /* no instruments in this build */
#endif

/* pools.cu: the vtable's pool functions */
lf_status cb_pool_take(lf_backend *b, int *pool);
/* rkv after a prompt chunk: no selection and an empty observation window (since -1, acc 0) for
 * pool's heads of layer l, on c->stream. */
lf_status cb_rkv_reset(cuda_backend *c, int pool, int l);
/* The host mirror of pool's fill count in layer l (lmin: the layer that decides prompt kinds). */
static inline int *cb_host_n(cuda_backend *c, int pool, int l) {
  return &c->host_n[(size_t)pool * c->cfg.n_layers + l];
}
lf_status cb_pool_give(lf_backend *b, int pool);
int cb_pools_free(lf_backend *b);
int cb_pool_slots_filled(lf_backend *b, int pool);

/* forward.cu */
lf_status cb_forward(lf_backend *b, const lf_batch_item *items, int n, lf_batch_result *res,
                     float *logits_out);
/* One batched decode pass over `rows` sequences whose inputs are in d_step (device). */
lf_status cb_decode_pass(cuda_backend *c, int rows);

/* gemm.cu: Y = W X (+ beta Y) on the GEMV or cuBLAS; cb_gemm_res for the products that add
 * into the residual stream (O, down); cb_gemv_lim: the largest n_tok on the GEMV now. */
int cb_gemv_lim(const cuda_backend *c);
lf_status cb_gemm(cuda_backend *c, const bf16 *W, const bf16 *X, void *Y, cudaDataType yt,
                  int n_out, int n_in, int n_tok, float beta);
lf_status cb_gemm_res(cuda_backend *c, const bf16 *W, const bf16 *X, float *Y, int n_out,
                      int n_in, int n_tok, float beta);
void cb_gemm_free(cuda_backend *c); /* the timed shapes' cublasLt descriptors */

/* graphs.cu: cb_decode_pass through the graph cache, PDL by pass size */
lf_status cb_graphs_init(cuda_backend *c);
lf_status cb_decode_run(cuda_backend *c, int rows);
void cb_graphs_free(cuda_backend *c);
/* The process-wide lock that graph capture and the release of device memory take, so that one
 * engine's frees never invalidate another engine's capture (graphs.cu). */
extern "C" void lf_cuda_capture_lock(void);
extern "C" void lf_cuda_capture_unlock(void);

/* tp.cu */
lf_status cb_stream_wait(cuda_backend *c);
int cb_fused_ar(const cuda_backend *c, int rows);
float *cb_res_out(cuda_backend *c, int rows, int slot, float *beta);
lf_status cb_res_norm(cuda_backend *c, int rows, int slot, const float *w, void *out,
                      const int32_t *out_rows);
/* Greedy tokens of n items from the vocab slices: into d_tok_out. */
lf_status cb_tp_greedy(cuda_backend *c, int n);
/* The full logits [n][vocab] on every rank for sampling (the top-k candidates, or the slices). */
lf_status cb_tp_gather_logits(cuda_backend *c, const lf_batch_item *items,
                              const lf_batch_result *res, int n, int logits_wanted);

/* weights.cu */
lf_status cb_load_weights(cuda_backend *c);
void cb_weights_free(cuda_backend *c);

#endif

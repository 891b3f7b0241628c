/* Creation and destruction of the cuda backend: the tuning settings, handles, weights, the pool
 * arena (sized from free device memory when nothing else sizes it) and every workspace, all
 * allocated here once. */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention/decode_attn.cuh"
#include "attention/decode_attn_generic.cuh"
#include "attention/rkv_select.cuh"
#include "base/cuda_launch.cuh"
#include "base/kvq.h"
#include "base/kvrot.h"
#include "base/tuning.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/forward.h"

#ifdef LF_BENCH_INSTRUMENTS
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
#endif

/* The settings of base/tuning.h this backend uses, read once here (kernels never read the
 * environment; launches take PDL from lf_pdl_allowed). */
static lf_status apply_tuning(cuda_backend *c) {
  lf_tuning tu;
  lf_tuning_read(&tu);
  c->use_graphs = !c->p.no_graphs && tu.cuda_graphs;
  /* collectives inside captured graphs: faster than eager TP steps (see tp.cu; bench/RESULTS.md) */
  if (c->comm && !tu.cuda_graphs_tp) c->use_graphs = 0;
  c->graph_cap = tu.graph_cache;
  lf_pdl_allowed = tu.pdl;
  /* PDL (base/cuda_launch.cuh): faster batch-1 steps everywhere and one GPU's batch-64 steps,
   * but slower TP batch-64 steps (bench/RESULTS.md): under TP only for passes of
   * up to 16 rows. */
  c->pdl_max_rows = tu.pdl_max_rows >= 0 ? tu.pdl_max_rows : c->comm ? 16 : INT_MAX;
  c->tune_on = tu.gemm_tune;
  /* Prefill chunk: LF_CUDA_PREFILL_CHUNK tokens, default min(max_seq_len, 2048). */
  c->max_chunk = c->cfg.max_seq_len < 2048 ? c->cfg.max_seq_len : 2048;
  if (tu.prefill_chunk > 0) c->max_chunk = tu.prefill_chunk;
  c->base.max_compress_tokens = c->max_chunk; /* SnapKV needs the whole prompt in one chunk */
#ifdef LF_BENCH_INSTRUMENTS
  if (tu.cuda_skip) LF_TRY(parse_skip(tu.cuda_skip, &c->skip));
#endif
  return LF_OK;
}

/* Everything cuda_free releases on the device side (memory, graphs, handles, the stream); the
 * caller holds lf_cuda_capture_lock (free_device_side). */
static void free_device_side_locked(cuda_backend *c) {
  cb_weights_free(c);
  cudaFree(c->inv_freq);
  cudaFree(c->kmu);
  cudaFree(c->d_adj);
  cudaFree(c->pl_x);
  cudaFree(c->pl_logits);
  free(c->h_adj);
  cudaFree(c->pv.k);
  cudaFree(c->pv.v);
  cudaFree(c->pv.k_scale);
  cudaFree(c->pv.v_scale);
  cudaFree(c->pv.deq_k);
  cudaFree(c->pv.deq_v);
  cudaFree(c->pv.vnorm);
  cudaFree(c->pv.acc);
  cudaFree(c->pv.queue);
  cudaFree(c->pv.since);
  cudaFree(c->h2o_cs);
  cudaFree(c->pv.pos);
  cudaFree(c->pv.n);
  cudaFree(c->pv.next);
  cudaFree(c->d_lbud);
  void *bufs[] = {c->x,     c->xb,    c->qkv,  c->qb,      c->kb,       c->vb,
                  c->att,   c->gu,    c->hb,   c->xf,      c->logits,   c->probs,
                  c->w,     c->ml,    c->snap, c->slot_of, c->ptok,     c->attn_ws,
                  c->simple_scratch, c->sort_ws, c->io,   c->lsend,    c->pairs,
                  c->pairs_all, c->scores, c->rkv_ws};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cudaFree(bufs[i]);
  if (c->llocal != c->logits) cudaFree(c->llocal);
  cudaFreeHost(c->h_io);
  cudaFreeHost(c->h_ptok);
  cb_graphs_free(c);
  cudaFree(c->blas_ws);
  cb_gemm_free(c);
  if (c->lt) cublasLtDestroy(c->lt);
  if (c->blas) cublasDestroy(c->blas);
  if (c->fork) cudaEventDestroy(c->fork);
  if (c->join) cudaEventDestroy(c->join);
  if (c->side) cudaStreamDestroy(c->side);
  if (c->stream) cudaStreamDestroy(c->stream);
}

/* free_device_side_locked under lf_cuda_capture_lock: these calls synchronize the device, which would
 * invalidate a graph that another engine of this process is capturing. */
static void free_device_side(cuda_backend *c) {
  lf_cuda_capture_lock();
  free_device_side_locked(c);
  lf_cuda_capture_unlock();
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
  lf_pool_list_free(&c->pools);
  free(c->host_n);
  free(c->lv);
  free(c->lbud);
  free(c->lrecent);
  free(c->segs);
  free(c->kinds);
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
  const lf_pool_shape ps = {1, m->n_layers, m->n_kv_heads, c->p.budget, m->head_dim,
                            (int)c->p.kv_dtype,
                            c->p.policy == LF_POLICY_RKV ? c->p.rkv_stage : 0, c->lbud};
  const uint64_t arena = lf_pool_bytes_device(&ps, lf_policy_accumulates(c->p.policy));
  const uint64_t row = (uint64_t)m->dim * (4 + 2) + (uint64_t)c->qkv_dim * 4 +
                       (uint64_t)c->qd * (2 + 2) + (uint64_t)m->hidden_dim * (2 * 4 + 2);
  /* logits [V], probs (the gather of max_vocab slices under TP), own slice and its padded copy,
   * the (max, id) pairs */
  const uint64_t Tr = c->comm ? (uint64_t)c->comm->size : 1, mv = (uint64_t)c->sh.max_vocab;
  const uint64_t vbytes = 4 * (V + (Tr * mv > V ? Tr * mv : V)) +
                          (c->comm ? 4 * ((uint64_t)c->nv + mv) + 8 * (Tr + 1) : 0);
  const uint64_t item = vbytes + (uint64_t)m->dim * 2 + (uint64_t)m->n_kv_heads * 4 + 64 +
                        sizeof(lf_sample_params) + row; /* row: charged even below max_chunk */
  const uint64_t h2o_cs = c->p.policy == LF_POLICY_H2O
                              ? (uint64_t)m->n_heads * ((uint64_t)c->bmax + T) * 4
                              : 0; /* h2o's prefill column sums */
  const uint64_t fixed = T * row + 2 * T * (uint64_t)c->kd * 2 + T * m->n_heads * 8 +
                         (uint64_t)m->n_kv_heads * T * 12 + lf_cuda_sample_sort_bytes(m->vocab_size) +
                         h2o_cs +
                         (c->p.kv_dtype != LF_KV_BF16 /* a chunk's dequantized slots */
                              ? 2 * (uint64_t)m->n_kv_heads * c->bmax * m->head_dim * 2
                              : 0) +
                         (c->p.policy == LF_POLICY_RKV /* rkv's arrays past shared memory */
                              ? (uint64_t)lf_cuda_rkv_select_ws_bytes(c->bmax, INT_MAX)
                              : 0) +
                         ((uint64_t)64 << 20) /* attention split workspace, graphs, slack */;
  size_t free_b = 0, total_b = 0;
  LF_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const double util = c->p.mem_util > 0 ? c->p.mem_util : LF_MEM_UTIL_DEFAULT;
  if (!(util <= 1.0))
    return lf_error(LF_ERR_INVALID_ARG, "cuda backend: mem_util %g must be in (0, 1]",
                    c->p.mem_util);
  const uint64_t avail = free_b > fixed ? free_b - fixed : 0;
  int n = lf_pools_for_memory(avail, util, arena + item);
  const int capped = c->p.max_pools > 0 && n > c->p.max_pools;
  if (capped) n = c->p.max_pools;
  if (n < 1)
    return lf_error(LF_ERR_OUT_OF_MEMORY,
                    "cuda backend: %.2f GiB free after the weights hold no pool of %.1f MiB "
                    "(budget %d) at mem_util %g",
                    (double)free_b / (1 << 30), (double)(arena + item) / (1 << 20), c->p.budget,
                    util);
  c->p.n_pools = n;
  if (c->p.sizing) {
    c->p.sizing->n_pools = n;
    c->p.sizing->pool_bytes = arena + item;
    c->p.sizing->basis_bytes = avail;
    c->p.sizing->util = util;
    c->p.sizing->capped = capped;
    c->p.sizing->basis = "free device memory";
  }
  return LF_OK;
}

/* What the device and the configuration must allow before anything is created. */
static lf_status check_config(cuda_backend *c) {
  const lf_backend_params *p = &c->p;
  const int D = c->cfg.head_dim;
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < 1) {
    cudaGetLastError();
    return lf_error(LF_ERR_UNAVAILABLE, "cuda backend: no CUDA device");
  }
  if (D > 256 || D % 2) return lf_error(LF_ERR_UNSUPPORTED, "cuda backend: head_dim %d", D);
  if (!lf_kvq_fits((int)p->kv_dtype, D))
    return lf_error(LF_ERR_UNSUPPORTED,
                    "cuda backend: kv dtype %s with head_dim %d (bf16, fp8 and int8 take any "
                    "even head_dim; int4 and k8v4 need a multiple of %d)",
                    lf_kv_dtype_str(p->kv_dtype), D, LF_I4_GROUP);
  LF_TRY(lf_attn_params_check(&c->ap, p->budget));
  for (int l = 0; l < c->cfg.n_layers; l++) { /* each layer's windows from its own budget */
    const lf_attn_params a =
        lf_attn_params_for_budget(&c->ap, p->h2o_recent, p->rkv_obs, c->lbud[l], c->bmin);
    if (lf_attn_params_check(&a, c->lbud[l]) != LF_OK) {
      char why[256];
      snprintf(why, sizeof why, "%s", lf_last_error());
      return lf_error(LF_ERR_INVALID_ARG, "cuda backend: layer %d (budget %d): %s", l, c->lbud[l],
                      why);
    }
  }
  if (p->n_pools < 0) return lf_error(LF_ERR_INVALID_ARG, "cuda backend: n_pools %d", p->n_pools);
  if (c->comm && !c->comm->device)
    return lf_error(LF_ERR_INVALID_ARG,
                    "cuda backend: tensor parallelism needs a device communicator "
                    "(lf_comm_init_nccl / lf_comm_init_nccl_mpi), not '%s'",
                    c->comm->kind ? c->comm->kind : "?");
  if (p->policy == LF_POLICY_RKV && D > LF_CUDA_RKV_MAX_HEAD_DIM)
    return lf_error(LF_ERR_UNSUPPORTED,
                    "cuda backend: policy rkv takes head_dim up to %d (this model: %d)",
                    LF_CUDA_RKV_MAX_HEAD_DIM, D);
  return LF_OK;
}

/* The streams, the fork/join events and cuBLAS with its own workspace. */
static lf_status create_streams(cuda_backend *c) {
  LF_CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
  int prio_low = 0, prio_high = 0;
  LF_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&prio_low, &prio_high));
  LF_CUDA_CHECK(cudaStreamCreateWithPriority(&c->side, cudaStreamNonBlocking, prio_high));
  LF_CUDA_CHECK(cudaEventCreateWithFlags(&c->fork, cudaEventDisableTiming));
  LF_CUDA_CHECK(cudaEventCreateWithFlags(&c->join, cudaEventDisableTiming));
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
  return LF_OK;
}

/* The host tables per pool and the RoPE frequencies. */
static lf_status create_tables(cuda_backend *c) {
  const lf_backend_params *p = &c->p;
  const int D = c->cfg.head_dim;
  LF_TRY(lf_pool_list_init(&c->pools, p->n_pools));
  c->host_n = (int *)calloc((size_t)p->n_pools * c->cfg.n_layers, sizeof(int));
  c->segs = (pass_seg *)calloc((size_t)p->n_pools, sizeof(pass_seg));
  c->kinds = (uint8_t *)calloc((size_t)p->n_pools, 1);
  if (!c->host_n || !c->segs || !c->kinds)
    return lf_error(LF_ERR_OUT_OF_MEMORY, "cuda backend: host tables");
  float *f = (float *)malloc(sizeof(float) * (size_t)(D / 2));
  if (!f) return lf_error(LF_ERR_OUT_OF_MEMORY, "rope table");
  lf_rope_freqs(&c->cfg, f);
  CB_ALLOC(c->inv_freq, sizeof(float) * (size_t)(D / 2));
  cudaError_t e = cudaMemcpy(c->inv_freq, f, sizeof(float) * (size_t)(D / 2), cudaMemcpyHostToDevice);
  free(f);
  LF_CUDA_CHECK(e);
  if (p->key_means) {
    const size_t n = (size_t)c->cfg.n_layers * c->kd;
    float *h = (float *)malloc(sizeof(float) * n);
    if (!h) return lf_error(LF_ERR_OUT_OF_MEMORY, "key means");
    lf_key_means_rows(p->key_means, c->cfg.n_layers, c->gcfg.n_kv_heads, D, c->sh.kv0,
                      c->cfg.n_kv_heads, lf_kv_rotates(p->kv_dtype), h);
    e = cudaMalloc((void **)&c->kmu, sizeof(float) * n);
    if (e == cudaSuccess) e = cudaMemcpy(c->kmu, h, sizeof(float) * n, cudaMemcpyHostToDevice);
    free(h);
    LF_CUDA_CHECK(e);
  }
  return LF_OK;
}

/* The pool arena: K/V in the pool dtype, per-slot metadata and each policy's state, layer-major
 * ([layer][pool][head][slot]) so that layer l's part is a view of one layer with its own budget
 * (lv[l]); pv keeps the allocations. */
static lf_status create_arena(cuda_backend *c) {
  const lf_model_config *m = &c->cfg;
  const lf_backend_params *p = &c->p;
  const int hkv = m->n_kv_heads, D = m->head_dim, L = m->n_layers;
  const size_t heads = (size_t)p->n_pools * L * hkv, ph = (size_t)p->n_pools * hkv;
  size_t slots = 0;
  for (int l = 0; l < L; l++) slots += ph * (size_t)c->lbud[l];
  c->pv_pools = p->n_pools;
  c->pv.n_layers = L;
  c->pv.n_kv_heads = hkv;
  c->pv.budget = p->budget;
  c->pv.head_dim = D;
  c->pv.kv_dtype = (int)p->kv_dtype;
  /* codes and scales of the K and of the V rows (k8v4: int8 K rows, int4 V rows) */
  const int kf = lf_kvq_k_row((int)p->kv_dtype), vf = lf_kvq_v_row((int)p->kv_dtype);
  const size_t krb = (size_t)lf_kvq_code_bytes(kf, D), vrb = (size_t)lf_kvq_code_bytes(vf, D);
  const size_t kmb = 4 * (size_t)lf_kvq_meta_words(kf, D), vmb = 4 * (size_t)lf_kvq_meta_words(vf, D);
  CB_ALLOC(c->pv.k, slots * krb);
  CB_ALLOC(c->pv.v, slots * vrb);
  if (p->kv_dtype != LF_KV_BF16) {
    CB_ALLOC(c->pv.k_scale, slots * kmb);
    CB_ALLOC(c->pv.v_scale, slots * vmb);
    CB_ALLOC(c->pv.deq_k, (size_t)hkv * c->bmax * D * 2);
    CB_ALLOC(c->pv.deq_v, (size_t)hkv * c->bmax * D * 2);
  }
  CB_ALLOC(c->pv.vnorm, slots * 4);
  CB_ALLOC(c->pv.pos, slots * 4);
  CB_ALLOC(c->pv.n, heads * 4);
  CB_ALLOC(c->pv.next, heads * 4);
  LF_CUDA_CHECK(cudaMemset(c->pv.n, 0, heads * 4));
  LF_CUDA_CHECK(cudaMemset(c->pv.next, 0xff, heads * 4));
  LF_CUDA_CHECK(cudaMemset(c->pv.pos, 0xff, slots * 4));
  LF_CUDA_CHECK(cudaMemset(c->pv.vnorm, 0, slots * 4));
  if (lf_policy_accumulates(p->policy)) { /* h2o's and rkv's per-slot accumulators */
    CB_ALLOC(c->pv.acc, slots * 4);
    LF_CUDA_CHECK(cudaMemset(c->pv.acc, 0, slots * 4));
  }
  if (p->policy == LF_POLICY_H2O) /* the prefill column sums of one chunk over the pool's slots
                                   * and the chunk ([n_heads][bmax + max_chunk]) */
    CB_ALLOC(c->h2o_cs, (size_t)m->n_heads * ((size_t)c->bmax + (size_t)c->max_chunk) * 4);
  if (p->policy == LF_POLICY_RKV) {
    /* rkv: per (layer, pool, head) the staged overwrite order and the steps since its
     * selection (cb_pool_take resets both) */
    CB_ALLOC(c->pv.queue, heads * (size_t)p->rkv_stage * 4);
    LF_CUDA_CHECK(cudaMemset(c->pv.queue, 0xff, heads * (size_t)p->rkv_stage * 4));
    CB_ALLOC(c->pv.since, heads * 4);
    LF_CUDA_CHECK(cudaMemset(c->pv.since, 0xff, heads * 4));
    c->pv.stage = p->rkv_stage;
  }
  CB_ALLOC(c->d_lbud, (size_t)L * sizeof(int));
  LF_CUDA_CHECK(cudaMemcpy(c->d_lbud, c->lbud, (size_t)L * sizeof(int), cudaMemcpyHostToDevice));
  /* the per-layer views */
  c->lv = (lf_cuda_pool_view *)calloc((size_t)L, sizeof *c->lv);
  if (!c->lv) return lf_error(LF_ERR_OUT_OF_MEMORY, "cuda backend: layer views");
  size_t s0 = 0; /* first slot of layer l */
  for (int l = 0; l < L; l++) {
    lf_cuda_pool_view *v = &c->lv[l];
    const size_t h0 = (size_t)l * ph;
    *v = c->pv;
    v->n_layers = 1;
    v->budget = c->lbud[l];
    v->k = (uint8_t *)c->pv.k + s0 * krb;
    v->v = (uint8_t *)c->pv.v + s0 * vrb;
    if (c->pv.k_scale) {
      v->k_scale = (float *)((uint8_t *)c->pv.k_scale + s0 * kmb);
      v->v_scale = (float *)((uint8_t *)c->pv.v_scale + s0 * vmb);
    }
    v->vnorm = c->pv.vnorm + s0;
    v->pos = c->pv.pos + s0;
    if (c->pv.acc) v->acc = c->pv.acc + s0;
    v->n = c->pv.n + h0;
    v->next = c->pv.next + h0;
    if (c->pv.queue) {
      v->queue = c->pv.queue + h0 * (size_t)p->rkv_stage;
      v->since = c->pv.since + h0;
      /* rkv's window of this layer's budget (lf_attn_params_for_budget) */
      v->obs = lf_rkv_obs_resolve(p->rkv_obs, c->lbud[l], p->sink, p->rkv_stage);
    }
    s0 += ph * (size_t)c->lbud[l];
  }
  return LF_OK;
}

/* The activations, logits and per-pass scratch of a mixed pass (a whole prefill chunk and every
 * decode item, forward.cu). */
static lf_status create_workspaces(cuda_backend *c) {
  const lf_model_config *m = &c->cfg;
  const int hkv = m->n_kv_heads;
  const size_t rows = (size_t)c->max_items + (size_t)c->max_chunk;
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
  CB_ALLOC(c->ptok, rows * 4);
  if (cudaMallocHost((void **)&c->h_ptok, rows * 4) != cudaSuccess) {
    cudaGetLastError();
    return lf_error(LF_ERR_OUT_OF_MEMORY, "cuda backend: pinned prompt buffer");
  }
  /* xf rows of failed items are read by the LM head: keep them finite */
  LF_CUDA_CHECK(cudaMemset(c->xf, 0, (size_t)c->max_items * m->dim * 2));
  return LF_OK;
}

/* Decode attention's kernel (fused, or the generic one for the shapes it does not take), its
 * workspace, the eviction scope's score buffer and the sampler's sort space. */
static lf_status create_attention(cuda_backend *c) {
  const lf_model_config *m = &c->cfg;
  const lf_backend_params *p = &c->p;
  const int hkv = m->n_kv_heads, D = m->head_dim;
  c->use_fused = (D == 64 || D == 128) && c->group <= 8;
  if (c->use_fused) {
    /* Split counts fall as the batch grows and are at their minimum once a batch fills the
     * SMs: the sizes up to a few hundred, and the largest, cover every batch. */
    for (int ns = 1; ns <= c->max_items; ns = ns < 512 ? ns + 1 : c->max_items) {
      const size_t wb = lf_cuda_decode_attn_workspace_bytes(ns, hkv, c->bmax, c->group, D, 0);
      if (wb > c->attn_ws_bytes) c->attn_ws_bytes = wb;
      if (ns == c->max_items) break;
    }
    CB_ALLOC(c->attn_ws, c->attn_ws_bytes);
    LF_TRY(lf_cuda_decode_attn_workspace_init(c->attn_ws, c->attn_ws_bytes, c->stream));
  } else {
    CB_ALLOC(c->simple_scratch,
             lf_cuda_decode_attn_simple_scratch(c->max_items, m->n_heads, c->bmax) * 4);
  }
  c->evict_per = lf_evict_group_heads(p->scope, p->scope_groups, hkv);
  if (!c->evict_per)
    return lf_error(LF_ERR_INVALID_ARG, "cuda backend: %d KV heads do not split into %d "
                    "eviction groups", hkv, p->scope_groups);
  if (c->evict_per > 1 && (p->policy == LF_POLICY_LONGFLOW || p->policy == LF_POLICY_H2O))
    CB_ALLOC(c->scores, (size_t)c->max_items * hkv * c->bmax * 4);
  if (p->policy == LF_POLICY_RKV) { /* selections of layers over the shared-memory budget */
    c->rkv_ws_bytes = lf_cuda_rkv_select_ws_bytes(c->bmax, c->max_items * (hkv / c->evict_per));
    if (c->rkv_ws_bytes) CB_ALLOC(c->rkv_ws, c->rkv_ws_bytes);
  }
  c->sort_ws_bytes = lf_cuda_sample_sort_bytes(m->vocab_size);
  CB_ALLOC(c->sort_ws, c->sort_ws_bytes);
  return LF_OK;
}

/* The step's I/O: 4 int arrays, sample params and tokens, on the device and pinned on the host. */
static lf_status create_step_io(cuda_backend *c) {
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
  return LF_OK;
}

static lf_status create(cuda_backend *c) {
  LF_TRY(check_config(c));
  LF_CUDA_CHECK(cudaGetDevice(&c->device));
  LF_TRY(create_streams(c));
  c->layers = (cuda_layer *)calloc((size_t)c->cfg.n_layers, sizeof *c->layers);
  if (!c->layers) return lf_error(LF_ERR_OUT_OF_MEMORY, "cuda backend: host tables");
  LF_TRY(cb_load_weights(c));
  if (c->p.n_pools == 0) LF_TRY(size_pools(c));
  c->max_items = c->p.n_pools;
  LF_TRY(create_tables(c));
  LF_TRY(create_arena(c));
  LF_TRY(create_workspaces(c));
  LF_TRY(create_attention(c));
  LF_TRY(cb_graphs_init(c));
  LF_TRY(create_step_io(c));
  /* The legacy stream as well as c->stream: a cudaMemcpy from pageable host memory (the weight
   * and table uploads above) returns once its data is staged, and the DMA still in flight on the
   * legacy stream is not ordered before c->stream's kernels (a non-blocking stream). Not the
   * whole device: another engine of this process may be capturing a graph on its own stream,
   * and a device-wide synchronize would fail here and invalidate that capture. */
  LF_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  LF_CUDA_CHECK(cudaStreamSynchronize(c->stream)); /* creation puts nothing on c->side */
  return LF_OK;
}

extern "C" lf_status lf_backend_cuda_create(const lf_checkpoint *ck, const lf_backend_params *p,
                                            lf_backend **out) {
  if (!ck || !p || !out) return lf_error(LF_ERR_INVALID_ARG, "cuda backend: NULL argument");
  *out = NULL;
  const lf_model_config *m = &ck->cfg;
  const lf_pool_shape layers = {1, m->n_layers, 1, p->budget, 1, 0, 0, p->layer_budget};
  const int bmax = lf_pool_budget_max(&layers);
  if (p->policy == LF_POLICY_RKV && (bmax > LF_CUDA_RKV_MAX_BUDGET || p->rkv_stage < 1))
    return lf_error(LF_ERR_UNSUPPORTED,
                    "cuda backend: policy rkv takes budgets up to %d slots and rkv_stage >= 1 "
                    "(budget %d%s, rkv_stage %d; the cpu backend takes any)",
                    LF_CUDA_RKV_MAX_BUDGET, bmax, p->layer_budget ? " in a layer" : "",
                    p->rkv_stage);
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
  c->p.layer_budget = NULL; /* the caller's array: lbud holds a copy (every layer's budget) */
  m = &c->cfg;
  c->lbud = (int *)malloc(sizeof(int) * (size_t)m->n_layers);
  c->lrecent = (int *)malloc(sizeof(int) * (size_t)m->n_layers);
  if (!c->lbud || !c->lrecent) {
    cuda_free(&c->base);
    return lf_error(LF_ERR_OUT_OF_MEMORY, "cuda backend: layer tables");
  }
  for (int l = 0; l < m->n_layers; l++) c->lbud[l] = lf_pool_layer_budget(&layers, l);
  c->lmin = lf_pool_layer_min(&layers);
  c->bmin = c->lbud[c->lmin];
  c->bmax = bmax;
  /* lf_backend's fields in order (name, forward, pool_take, pool_give, pools_free,
   * pool_slots_filled, free, max_compress_tokens: set below, once max_chunk is): C++17 has no
   * designated initializers */
  c->base = lf_backend{"cuda", cb_forward, cb_pool_take, cb_pool_give, cb_pools_free,
                       cb_pool_slots_filled, cuda_free, 0};
  c->qd = m->n_heads * m->head_dim;
  c->kd = m->n_kv_heads * m->head_dim;
  c->qd_own = sh.n_q * m->head_dim;
  c->qkv_dim = c->qd + 2 * c->kd;
  c->group = m->n_heads / m->n_kv_heads;
  c->ap.policy = p->policy;
  c->ap.sink = p->sink;
  c->ap.window = p->window;
  c->ap.h2o_recent = lf_h2o_recent(p->h2o_recent, p->budget);
  c->ap.rkv_stage = p->policy == LF_POLICY_RKV ? p->rkv_stage : 0;
  c->ap.rkv_obs = p->policy == LF_POLICY_RKV
                      ? lf_rkv_obs_resolve(p->rkv_obs, p->budget, p->sink, p->rkv_stage)
                      : 0;
  c->ap.group = c->group;
  c->ap.head_dim = m->head_dim;
  c->ap.scale = 1.0f / sqrtf((float)m->head_dim);
  for (int l = 0; l < m->n_layers; l++)
    c->lrecent[l] = lf_attn_params_for_budget(&c->ap, p->h2o_recent, p->rkv_obs, c->lbud[l], c->bmin)
                        .h2o_recent;
  c->max_items = p->n_pools; /* n_pools 0: set by create() */
  lf_status s = apply_tuning(c);
  if (s == LF_OK) s = create(c);
  c->p.key_means = NULL; /* the caller's array: create_tables uploaded kmu from it */
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

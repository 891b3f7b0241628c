/* The cpu backend: fp32 weights, the reference attention, host sampling. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "backend.h"
#include "error.h"
#include "forward.h"
#include "memory/pool.h"
#include "parallel/tp.h"
#include "sample.h"

typedef struct cpu_backend {
  lf_backend base;
  const lf_checkpoint *ck;
  lf_weights w;
  lf_kv_arena arena;
  lf_cpu_forward fwd;
  lf_sampler sampler;
  float *logits; /* [vocab] */
  /* tensor parallel (fwd.comm set): per-batch scratch, grown on demand */
  int cap_items;
  float *local;    /* [cap_items][n_vocab] each item's slice of the logits */
  float *full;     /* [cap_items][vocab] gathered logits of the items that need them all */
  float *lmax;     /* [cap_items] */
  int32_t *lid;    /* [cap_items] */
  int32_t *greedy; /* [cap_items] */
  float *kloc;     /* [cap_items][n_vocab] slices of the items sampled by distributed top-k */
  int *kk;         /* [cap_items] their top_k */
} cpu_backend;

static lf_status grow_items(cpu_backend *c, int n) {
  if (n <= c->cap_items) return LF_OK;
  const size_t nv = (size_t)c->fwd.sh.n_vocab, v = (size_t)c->ck->cfg.vocab_size;
  float *l = realloc(c->local, sizeof(float) * nv * (size_t)n);
  if (l) c->local = l;
  float *f = realloc(c->full, sizeof(float) * v * (size_t)n);
  if (f) c->full = f;
  float *m = realloc(c->lmax, sizeof(float) * (size_t)n);
  if (m) c->lmax = m;
  int32_t *i = realloc(c->lid, sizeof(int32_t) * (size_t)n);
  if (i) c->lid = i;
  int32_t *g = realloc(c->greedy, sizeof(int32_t) * (size_t)n);
  if (g) c->greedy = g;
  float *kl = realloc(c->kloc, sizeof(float) * nv * (size_t)n);
  if (kl) c->kloc = kl;
  int *kk = realloc(c->kk, sizeof(int) * (size_t)n);
  if (kk) c->kk = kk;
  if (!l || !f || !m || !i || !g || !kl || !kk)
    return lf_error(LF_ERR_OUT_OF_MEMORY, "batch of %d items", n);
  c->cap_items = n;
  return LF_OK;
}

/* Sampled with top-k from the ranks' candidates (lf_tp_topk_logits) rather than whole logits. */
static int tp_topk_item(const lf_batch_item *it, int vocab, const float *logits_out) {
  return !logits_out && it->sampling.temperature > 0.0f && it->sampling.top_k >= 1 &&
         it->sampling.top_k <= LF_TP_TOPK_MAX && it->sampling.top_k < vocab;
}

/* Tensor-parallel forward: every rank runs every item on its shard, then the tokens are chosen
 * from the vocab-parallel logits with one all-gather of (max, id) per batch (greedy), one of
 * the ranks' top-k candidates for the items that sample with top-k, and one of the logit slices
 * for the other items that sample or when logits are wanted. Which collectives run depends only
 * on the items and on logits_out being NULL, the same on every rank. */
static lf_status cpu_forward_tp(cpu_backend *c, const lf_batch_item *items, int n,
                                lf_batch_result *res, float *logits_out) {
  const lf_shard *sh = &c->fwd.sh;
  const int vocab = c->ck->cfg.vocab_size, nv = sh->n_vocab;
  LF_TRY(grow_items(c, n));
  for (int i = 0; i < n; i++) {
    const lf_batch_item *it = &items[i];
    lf_batch_result *r = &res[i];
    float *li = c->local + (size_t)i * nv;
    r->evictions = 0;
    r->token = -1;
    r->status = lf_cpu_forward_run(&c->fwd, it->pool, it->pos0, it->n_tok, it->tokens, li, NULL,
                                   &r->evictions);
    /* Only failures every rank meets alike may stay per-item (see parallel/tp.h). */
    if (r->status != LF_OK && r->status != LF_ERR_CONTEXT_FULL && r->status != LF_ERR_INVALID_ARG)
      return r->status;
    if (r->status != LF_OK) memset(li, 0, sizeof(float) * nv);
    const int a = lf_argmax(li, nv);
    c->lmax[i] = li[a];
    c->lid[i] = sh->vocab0 + a;
  }
  LF_TRY(lf_tp_argmax(c->fwd.comm, n, c->lmax, c->lid, c->greedy));
  /* Items sampled by top-k: their slices copied to kloc[0..nk). Then the items whose whole
   * logits are needed, packed in order into local[0..k). full holds the gathered rows, then the
   * top-k ones. */
  int k = 0, nk = 0;
  for (int i = 0; i < n; i++) {
    if (!tp_topk_item(&items[i], vocab, logits_out)) continue;
    memcpy(c->kloc + (size_t)nk * nv, c->local + (size_t)i * nv, sizeof(float) * nv);
    c->kk[nk++] = items[i].sampling.top_k;
  }
  for (int i = 0; i < n; i++) {
    if (!logits_out && items[i].sampling.temperature <= 0.0f) continue;
    if (tp_topk_item(&items[i], vocab, logits_out)) continue;
    if (k != i)
      memmove(c->local + (size_t)k * nv, c->local + (size_t)i * nv, sizeof(float) * nv);
    k++;
  }
  LF_TRY(lf_tp_gather_logits(c->fwd.comm, sh, vocab, k, c->local, c->full));
  LF_TRY(lf_tp_topk_logits(c->fwd.comm, sh, vocab, nk, c->kk, c->kloc,
                           c->full + (size_t)k * vocab));
  for (int i = 0, j = 0, jk = k; i < n; i++) {
    const float *full = NULL;
    if (tp_topk_item(&items[i], vocab, logits_out))
      full = c->full + (size_t)jk++ * vocab;
    else if (logits_out || items[i].sampling.temperature > 0.0f)
      full = c->full + (size_t)j++ * vocab;
    if (res[i].status != LF_OK) continue;
    if (logits_out) memcpy(logits_out + (size_t)i * vocab, full, sizeof(float) * vocab);
    res[i].token = items[i].sampling.temperature > 0.0f
                       ? lf_sample(&c->sampler, full, &items[i].sampling, items[i].u)
                       : c->greedy[i];
  }
  return LF_OK;
}

static lf_status cpu_forward(lf_backend *b, const lf_batch_item *items, int n,
                             lf_batch_result *res, float *logits_out) {
  cpu_backend *c = (cpu_backend *)b;
  if (c->fwd.comm) return cpu_forward_tp(c, items, n, res, logits_out);
  const int vocab = c->ck->cfg.vocab_size;
  for (int i = 0; i < n; i++) {
    const lf_batch_item *it = &items[i];
    lf_batch_result *r = &res[i];
    r->evictions = 0;
    r->token = -1;
    r->status = lf_cpu_forward_run(&c->fwd, it->pool, it->pos0, it->n_tok, it->tokens, c->logits,
                                   NULL, &r->evictions);
    if (r->status != LF_OK) continue;
    if (logits_out) memcpy(logits_out + (size_t)i * vocab, c->logits, sizeof(float) * vocab);
    r->token = lf_sample(&c->sampler, c->logits, &it->sampling, it->u);
  }
  return LF_OK;
}

static lf_status cpu_pool_take(lf_backend *b, int *pool) {
  return lf_kv_arena_take(&((cpu_backend *)b)->arena, pool);
}

static lf_status cpu_pool_give(lf_backend *b, int pool) {
  return lf_kv_arena_give(&((cpu_backend *)b)->arena, pool);
}

static int cpu_pools_free(lf_backend *b) {
  return ((cpu_backend *)b)->arena.n_free;
}

static int cpu_pool_slots_filled(lf_backend *b, int pool) {
  return *lf_kv_arena_head(&((cpu_backend *)b)->arena, pool, 0, 0).n;
}

static void cpu_free(lf_backend *b) {
  cpu_backend *c = (cpu_backend *)b;
  if (!c) return;
  free(c->logits);
  free(c->local);
  free(c->full);
  free(c->lmax);
  free(c->lid);
  free(c->greedy);
  free(c->kloc);
  free(c->kk);
  lf_sampler_free(&c->sampler);
  lf_cpu_forward_free(&c->fwd);
  lf_kv_arena_free(&c->arena);
  lf_weights_free(&c->ck->cfg, &c->w);
  free(c);
}

lf_status lf_backend_cpu_create(const lf_checkpoint *ck, const lf_backend_params *p,
                                lf_backend **out) {
  const lf_model_config *mc = &ck->cfg;
  cpu_backend *c = calloc(1, sizeof *c);
  if (!c) return lf_error(LF_ERR_OUT_OF_MEMORY, "cpu backend");
  c->ck = ck;
  c->base.name = "cpu";
  c->base.forward = cpu_forward;
  c->base.pool_take = cpu_pool_take;
  c->base.pool_give = cpu_pool_give;
  c->base.pools_free = cpu_pools_free;
  c->base.pool_slots_filled = cpu_pool_slots_filled;
  c->base.free = cpu_free;
  lf_attn_params ap = {.policy = p->policy,
                       .scope = p->scope,
                       .sink = p->sink,
                       .window = p->window,
                       .h2o_recent = p->window,
                       .group = mc->n_heads / mc->n_kv_heads,
                       .head_dim = mc->head_dim,
                       .scale = 1.0f / sqrtf((float)mc->head_dim)};
  const lf_comm_t comm = p->comm && p->comm->size > 1 ? p->comm : NULL;
  lf_shard sh;
  lf_status s = lf_shard_plan(comm ? comm->rank : 0, comm ? comm->size : 1, mc->n_heads,
                              mc->n_kv_heads, mc->hidden_dim, mc->vocab_size, &sh);
  /* n_pools == 0 (nothing sized them): one pool, the cpu backend's default */
  lf_pool_shape ps = {p->n_pools > 0 ? p->n_pools : 1, mc->n_layers, sh.n_kv, p->budget,
                      mc->head_dim};
  if (s == LF_OK) s = lf_attn_params_check(&ap, p->budget);
  if (s == LF_OK) s = comm ? lf_weights_load_f32_shard(ck, &sh, &c->w) : lf_weights_load_f32(ck, &c->w);
  if (s == LF_OK) s = lf_kv_arena_init(&c->arena, &ps);
  if (s == LF_OK) s = lf_cpu_forward_init_tp(&c->fwd, mc, &c->w, &c->arena, &ap, &sh, comm);
  if (s == LF_OK) c->fwd.n_threads = p->n_threads;
  if (s == LF_OK) s = lf_sampler_init(&c->sampler, mc->vocab_size);
  if (s == LF_OK && !(c->logits = malloc(sizeof(float) * (size_t)mc->vocab_size)))
    s = lf_error(LF_ERR_OUT_OF_MEMORY, "logits");
  if (s != LF_OK) {
    cpu_free(&c->base);
    return s;
  }
  *out = &c->base;
  return LF_OK;
}

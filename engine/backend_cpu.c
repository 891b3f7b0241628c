/* The cpu backend: fp32 weights, the reference attention, host sampling. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "backend.h"
#include "base/error.h"
#include "base/tuning.h"
#include "forward.h"
#include "memory/pool.h"
#include "engine/tp.h"
#include "sample.h"

typedef struct cpu_backend {
  lf_backend base;
  const lf_checkpoint *ck;
  lf_weights w;
  lf_kv_arena arena;
  lf_cpu_forward fwd;
  lf_sampler sampler;
  float *logits; /* [vocab] */
  float *adjusted; /* [vocab] an item's logits after its logit processing */
  /* tensor parallel (fwd.comm set): per-batch scratch, grown on demand */
  int cap_items;
  float *local;    /* [cap_items][n_vocab] each item's slice of the logits */
  float *full;     /* [cap_items][vocab] gathered logits of the items that need them all */
  float *lmax;     /* [cap_items] */
  int32_t *lid;    /* [cap_items] */
  int32_t *greedy; /* [cap_items] */
  float *kloc;     /* [cap_items][n_vocab] slices of the items sampled by distributed top-k */
  int *kk;         /* [cap_items] their top_k */
  /* the batch's decode items, run together (lf_cpu_forward_decode) */
  int *d_item;        /* [cap_items] item index of each decode row */
  int *d_pool;        /* [cap_items] */
  int32_t *d_pos;     /* [cap_items] */
  int32_t *d_tok;     /* [cap_items] */
  uint64_t *d_ev;     /* [cap_items] */
  lf_status *d_st;    /* [cap_items] */
  float *d_logits;    /* [cap_items][n_vocab] */
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
  int *di = realloc(c->d_item, sizeof(int) * (size_t)n);
  if (di) c->d_item = di;
  int *dp = realloc(c->d_pool, sizeof(int) * (size_t)n);
  if (dp) c->d_pool = dp;
  int32_t *dq = realloc(c->d_pos, sizeof(int32_t) * (size_t)n);
  if (dq) c->d_pos = dq;
  int32_t *dt = realloc(c->d_tok, sizeof(int32_t) * (size_t)n);
  if (dt) c->d_tok = dt;
  uint64_t *de = realloc(c->d_ev, sizeof(uint64_t) * (size_t)n);
  if (de) c->d_ev = de;
  lf_status *ds = realloc(c->d_st, sizeof(lf_status) * (size_t)n);
  if (ds) c->d_st = ds;
  float *dl = realloc(c->d_logits, sizeof(float) * nv * (size_t)n);
  if (dl) c->d_logits = dl;
  if (!l || !f || !m || !i || !g || !kl || !kk || !di || !dp || !dq || !dt || !de || !ds || !dl)
    return lf_error(LF_ERR_OUT_OF_MEMORY, "batch of %d items", n);
  c->cap_items = n;
  return LF_OK;
}

/* A decode item that goes into the batched decode (its token in range: a bad one fails alone
 * in lf_cpu_forward_run). */
static int batched(const cpu_backend *c, const lf_batch_item *it) {
  return it->n_tok == 1 && it->tokens[0] >= 0 && it->tokens[0] < c->ck->cfg.vocab_size;
}

/* Runs the batch's decode items in one lf_cpu_forward_decode, so each weight row is read once
 * per step for all of them rather than once per sequence. Row k (item c->d_item[k]) leaves its
 * logits in c->d_logits, its status in c->d_st and its evictions in c->d_ev; *nd = rows. */
static lf_status run_decodes(cpu_backend *c, const lf_batch_item *items, int n, int *nd) {
  int k = 0;
  for (int i = 0; i < n; i++) {
    if (!batched(c, &items[i])) continue;
    c->d_item[k] = i;
    c->d_pool[k] = items[i].pool;
    c->d_pos[k] = items[i].pos0;
    c->d_tok[k] = items[i].tokens[0];
    c->d_ev[k] = 0;
    k++;
  }
  *nd = k;
  if (k == 0) return LF_OK;
  return lf_cpu_forward_decode(&c->fwd, k, c->d_pool, c->d_pos, c->d_tok, c->d_logits, c->d_ev,
                               c->d_st);
}

/* The item's token from its whole raw logits lg [vocab]: copied out when asked
 * (logits_last), processed (adj) on a copy, then lf_sample. */
static int32_t pick(cpu_backend *c, const lf_batch_item *it, const float *lg) {
  const size_t vocab = (size_t)c->ck->cfg.vocab_size;
  if (it->logits_last) memcpy(it->logits_last, lg, sizeof(float) * vocab);
  if (it->n_adj > 0) {
    memcpy(c->adjusted, lg, sizeof(float) * vocab);
    lf_logits_adjust(c->adjusted, it->adj, it->n_adj, it->rep);
    lg = c->adjusted;
  }
  return lf_sample(&c->sampler, lg, &it->sampling, it->u);
}

/* Sampled with top-k from the ranks' candidates (lf_tp_topk_logits) rather than whole logits. */
static int tp_topk_item(const lf_batch_item *it, int vocab, const float *logits_out) {
  return !logits_out && !it->full_logits && it->sampling.temperature > 0.0f && it->sampling.top_k >= 1 &&
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
  int nd;
  LF_TRY(run_decodes(c, items, n, &nd));
  for (int k = 0; k < nd; k++) {
    const int i = c->d_item[k];
    res[i].evictions = c->d_ev[k];
    res[i].status = c->d_st[k];
    memcpy(c->local + (size_t)i * nv, c->d_logits + (size_t)k * nv, sizeof(float) * nv);
  }
  for (int i = 0; i < n; i++) {
    const lf_batch_item *it = &items[i];
    lf_batch_result *r = &res[i];
    float *li = c->local + (size_t)i * nv;
    r->token = -1;
    if (!batched(c, it)) {
      r->evictions = 0;
      r->status = lf_cpu_forward_run(&c->fwd, it->pool, it->pos0, it->n_tok, it->tokens, li,
                                     NULL, &r->evictions);
    }
    /* every rank sees the same items: the same status on all of them */
    if (r->status == LF_OK && it->logits_all)
      r->status = lf_error(LF_ERR_UNSUPPORTED, "prompt logits under tensor parallelism");
    /* Evictions are counted over the model's KV heads, each once however many ranks hold it.
     * Every KV head of a pool takes the same writes and so overwrites as many slots as any
     * other (in every scope: one write, so at most one overwrite, per head), so this rank's count times
     * Hkv / (KV heads held here) is the model's total, also when KV heads are replicated. */
    r->evictions *= (uint64_t)(c->ck->cfg.n_kv_heads / sh->n_kv);
    /* Only failures every rank meets alike may stay per-item (see engine/tp.h). */
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
    if (!logits_out && !items[i].full_logits && items[i].sampling.temperature <= 0.0f) continue;
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
    else if (logits_out || items[i].full_logits || items[i].sampling.temperature > 0.0f)
      full = c->full + (size_t)j++ * vocab;
    if (res[i].status != LF_OK) continue;
    if (logits_out) memcpy(logits_out + (size_t)i * vocab, full, sizeof(float) * vocab);
    /* a top-k item's row holds its candidates only (-inf elsewhere): enough for lf_sample */
    res[i].token = items[i].sampling.temperature > 0.0f || items[i].full_logits
                       ? pick(c, &items[i], full)
                       : c->greedy[i];
  }
  return LF_OK;
}

static lf_status cpu_forward(lf_backend *b, const lf_batch_item *items, int n,
                             lf_batch_result *res, float *logits_out) {
  cpu_backend *c = (cpu_backend *)b;
  if (c->fwd.comm) return cpu_forward_tp(c, items, n, res, logits_out);
  const int vocab = c->ck->cfg.vocab_size;
  LF_TRY(grow_items(c, n));
  int nd;
  LF_TRY(run_decodes(c, items, n, &nd));
  for (int k = 0; k < nd; k++) {
    const int i = c->d_item[k];
    const float *lg = c->d_logits + (size_t)k * vocab;
    lf_batch_result *r = &res[i];
    r->evictions = c->d_ev[k];
    r->status = c->d_st[k];
    r->token = -1;
    if (r->status != LF_OK) continue;
    if (logits_out) memcpy(logits_out + (size_t)i * vocab, lg, sizeof(float) * vocab);
    if (items[i].logits_all) memcpy(items[i].logits_all, lg, sizeof(float) * vocab);
    r->token = pick(c, &items[i], lg);
  }
  for (int i = 0; i < n; i++) {
    const lf_batch_item *it = &items[i];
    lf_batch_result *r = &res[i];
    if (batched(c, it)) continue;
    r->evictions = 0;
    r->token = -1;
    r->status = lf_cpu_forward_run(&c->fwd, it->pool, it->pos0, it->n_tok, it->tokens, c->logits,
                                   it->logits_all, &r->evictions);
    if (r->status != LF_OK) continue;
    if (logits_out) memcpy(logits_out + (size_t)i * vocab, c->logits, sizeof(float) * vocab);
    r->token = pick(c, it, c->logits);
  }
  return LF_OK;
}

static lf_status cpu_pool_take(lf_backend *b, int *pool) {
  return lf_kv_arena_take(&((cpu_backend *)b)->arena, pool);
}

static lf_status cpu_pool_give(lf_backend *b, int pool) {
  return lf_kv_arena_give(&((cpu_backend *)b)->arena, pool);
}

lf_status lf_backend_cpu_limit_pools(lf_backend *b, int n_pools) {
  return lf_pool_list_limit(&((cpu_backend *)b)->arena.pools, n_pools);
}

static int cpu_pools_free(lf_backend *b) {
  return ((cpu_backend *)b)->arena.pools.n_free;
}

static int cpu_pool_slots_filled(lf_backend *b, int pool) {
  const lf_kv_arena *a = &((cpu_backend *)b)->arena;
  /* the layer a prompt chunk is measured against (scheduler/README.md) */
  const lf_kv_head h = lf_kv_arena_head(a, pool, lf_pool_layer_min(&a->shape), 0);
  return h.n ? *h.n : 0;
}

static void cpu_free(lf_backend *b) {
  cpu_backend *c = (cpu_backend *)b;
  if (!c) return;
  free(c->logits);
  free(c->adjusted);
  free(c->local);
  free(c->full);
  free(c->lmax);
  free(c->lid);
  free(c->greedy);
  free(c->kloc);
  free(c->kk);
  free(c->d_item);
  free(c->d_pool);
  free(c->d_pos);
  free(c->d_tok);
  free(c->d_ev);
  free(c->d_st);
  free(c->d_logits);
  lf_sampler_free(&c->sampler);
  lf_cpu_forward_free(&c->fwd);
  lf_kv_arena_free(&c->arena);
  lf_weights_free(&c->ck->cfg, &c->w);
  free(c);
}

/* MemAvailable from /proc/meminfo in bytes (override: LF_MEM_AVAILABLE_BYTES, base/tuning.h);
 * 0 when unknown (not Linux). */
static uint64_t mem_available(void) {
  lf_tuning t;
  lf_tuning_read(&t);
  if (t.mem_available) return (uint64_t)t.mem_available;
  FILE *f = fopen("/proc/meminfo", "r");
  if (!f) return 0;
  char line[256];
  unsigned long long kb = 0;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) break;
  fclose(f);
  return (uint64_t)kb * 1024;
}

/* Checks the fp32 weights of this rank's shard and its KV pools against the memory available,
 * before any of it is allocated: a model that cannot fit fails at once with the figures,
 * rather than after a long load, in the kernel's out-of-memory killer. */
static lf_status check_memory(const lf_model_config *mc, const lf_shard *sh,
                              const lf_pool_shape *ps, int lm_head_own) {
  const uint64_t D = (uint64_t)mc->dim, hd = (uint64_t)mc->head_dim;
  uint64_t f = (uint64_t)sh->n_vocab * D * (lm_head_own ? 2 : 1) + D;
  f += (uint64_t)mc->n_layers * (((uint64_t)sh->n_cq + 2u * (uint64_t)sh->n_kv) * hd * D +
                                 D * (uint64_t)sh->n_q * hd + 3u * (uint64_t)sh->n_hid * D + 2u * D);
  const uint64_t weights = f * sizeof(float), pools = lf_pool_bytes(ps) * (uint64_t)ps->n_pools;
  const uint64_t avail = mem_available();
  if (avail && weights + pools > avail)
    return lf_error(LF_ERR_OUT_OF_MEMORY,
                    "the model needs about %.1f GiB of memory (fp32 weights %.1f GiB%s + %d KV "
                    "pool%s %.1f GiB) but %.1f GiB is available (MemAvailable): choose a smaller "
                    "model, fewer pools or a smaller budget, or run tensor parallel over ranks "
                    "on several machines",
                    (double)(weights + pools) / 1073741824.0, (double)weights / 1073741824.0,
                    sh->size > 1 ? " of this rank's shard" : "", ps->n_pools,
                    ps->n_pools == 1 ? "" : "s", (double)pools / 1073741824.0,
                    (double)avail / 1073741824.0);
  return LF_OK;
}

lf_status lf_backend_cpu_create(const lf_checkpoint *ck, const lf_backend_params *p,
                                lf_backend **out) {
  const lf_model_config *mc = &ck->cfg;
  cpu_backend *c = calloc(1, sizeof *c);
  if (!c) return lf_error(LF_ERR_OUT_OF_MEMORY, "cpu backend");
  c->ck = ck;
  c->base = (lf_backend){.name = "cpu", .forward = cpu_forward, .pool_take = cpu_pool_take,
                         .pool_give = cpu_pool_give, .pools_free = cpu_pools_free,
                         .pool_slots_filled = cpu_pool_slots_filled, .free = cpu_free};
  lf_attn_params ap = {.policy = p->policy,
                       .scope = p->scope,
                       .scope_groups = p->scope_groups,
                       .sink = p->sink,
                       .window = p->window,
                       .h2o_recent = lf_h2o_recent(p->h2o_recent, p->budget),
                       .rkv_stage = p->rkv_stage,
                       .rkv_obs = p->policy == LF_POLICY_RKV
                                      ? lf_rkv_obs_resolve(p->rkv_obs, p->budget, p->sink,
                                                           p->rkv_stage)
                                      : 0,
                       .group = mc->n_heads / mc->n_kv_heads,
                       .head_dim = mc->head_dim,
                       .scale = 1.0f / sqrtf((float)mc->head_dim)};
  const lf_comm_t comm = p->comm && p->comm->size > 1 ? p->comm : NULL;
  lf_shard sh;
  lf_status s = lf_shard_plan(comm ? comm->rank : 0, comm ? comm->size : 1, mc->n_heads,
                              mc->n_kv_heads, mc->hidden_dim, mc->vocab_size, &sh);
  /* n_pools == 0 (nothing sized them): from MemAvailable after the weights when host_mem_util
   * is set (checked here for one pool), else one pool, the cpu backend's default */
  const int from_host = p->n_pools <= 0 && p->host_mem_util > 0;
  lf_pool_shape ps = {p->n_pools > 0 ? p->n_pools : 1, mc->n_layers, sh.n_kv, p->budget,
                      mc->head_dim, (int)p->kv_dtype,
                      p->policy == LF_POLICY_RKV ? p->rkv_stage : 0, p->layer_budget};
  if (from_host && !(p->host_mem_util <= 1.0))
    s = lf_error(LF_ERR_INVALID_ARG, "host_mem_util %g must be in (0, 1]", p->host_mem_util);
  if (s == LF_OK) s = lf_attn_params_check(&ap, p->budget);
  /* per-layer budgets: each layer's windows from its own budget, checked layer by layer */
  lf_attn_params *lap = NULL;
  if (s == LF_OK && p->layer_budget) {
    const int bmin = lf_pool_budget_min(&ps);
    if (!(lap = malloc(sizeof *lap * (size_t)mc->n_layers)))
      s = lf_error(LF_ERR_OUT_OF_MEMORY, "per-layer attention params");
    for (int l = 0; s == LF_OK && l < mc->n_layers; l++) {
      lap[l] = lf_attn_params_for_budget(&ap, p->h2o_recent, p->rkv_obs, p->layer_budget[l],
                                         bmin);
      s = lf_attn_params_check(&lap[l], p->layer_budget[l]);
      if (s != LF_OK) {
        char why[256];
        snprintf(why, sizeof why, "%s", lf_last_error());
        s = lf_error(s, "layer %d (budget %d): %s", l, p->layer_budget[l], why);
      }
    }
  }
  if (s == LF_OK)
    s = check_memory(mc, &sh, &ps,
                     lf_tensor_set_find(&ck->tensors, "lm_head.weight") || !mc->tie_embeddings);
  if (s == LF_OK) s = comm ? lf_weights_load_f32_shard(ck, &sh, &c->w) : lf_weights_load_f32(ck, &c->w);
  if (s == LF_OK && from_host) {
    /* The weights are resident by now (read and converted): what MemAvailable says is what is
     * left for the pools, the activations and everything else on the machine. */
    lf_pool_shape one = ps;
    one.n_pools = 1;
    const uint64_t avail = mem_available(), pool = lf_pool_bytes(&one);
    int n = lf_pools_for_memory(avail, p->host_mem_util, pool);
    const int capped = p->max_pools > 0 && n > p->max_pools;
    if (capped) n = p->max_pools;
    if (avail == 0)
      s = lf_error(LF_ERR_UNAVAILABLE, "cpu backend: cannot read MemAvailable from /proc/meminfo "
                                       "to size the KV pools: give the number of pools");
    else if (n < 1)
      s = lf_error(LF_ERR_OUT_OF_MEMORY,
                   "cpu backend: %.2f GiB available after the weights (MemAvailable) x %g holds "
                   "no KV pool of %.1f MiB (budget %d slots, %d layers, %d KV heads, kv %s): "
                   "give a smaller budget, a smaller kv dtype, a larger fraction, or the number "
                   "of pools",
                   (double)avail / 1073741824.0, p->host_mem_util, (double)pool / 1048576.0,
                   p->budget, mc->n_layers, sh.n_kv, lf_kv_dtype_str(p->kv_dtype));
    if (s == LF_OK) {
      ps.n_pools = n;
      if (p->sizing)
        *p->sizing = (lf_pool_sizing){.n_pools = n, .pool_bytes = pool, .basis_bytes = avail,
                                      .util = p->host_mem_util, .capped = capped,
                                      .basis = "MemAvailable"};
    }
  }
  if (s == LF_OK) s = lf_kv_arena_init(&c->arena, &ps);
  if (s == LF_OK) s = lf_cpu_forward_init_tp(&c->fwd, mc, &c->w, &c->arena, &ap, &sh, comm);
  if (s == LF_OK && lap) s = lf_cpu_forward_set_layer_params(&c->fwd, lap);
  if (s == LF_OK && p->key_means) s = lf_cpu_forward_set_key_means(&c->fwd, p->key_means);
  free(lap);
  if (s == LF_OK) c->fwd.n_threads = p->n_threads;
  if (s == LF_OK) s = lf_sampler_init(&c->sampler, mc->vocab_size);
  if (s == LF_OK && (!(c->logits = malloc(sizeof(float) * (size_t)mc->vocab_size)) ||
                     !(c->adjusted = malloc(sizeof(float) * (size_t)mc->vocab_size))))
    s = lf_error(LF_ERR_OUT_OF_MEMORY, "logits");
  if (s != LF_OK) {
    cpu_free(&c->base);
    return s;
  }
  *out = &c->base;
  return LF_OK;
}

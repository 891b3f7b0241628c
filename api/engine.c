/* The engine: a loaded model, its backend (weights + KV pools) and the scheduler, glued behind
 * include/lfserve.h. The request loop itself (queue, admission, batching, finishing, threading)
 * is scheduler/scheduler.c; its rules are in scheduler/README.md.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend.h"
#include "engine/forward.h"
#include "base/error.h"
#include "attention/attention.h"
#include "base/kvq.h"
#include "memory/pool.h"
#include "engine/model.h"
#include "parallel/comm.h"
#include "parallel/shard.h"
#include "engine/tp.h"
#include "scheduler/scheduler.h"

/* Tensor parallel: every rank holds a backend over its shard; rank 0 alone has the scheduler,
 * over a wrapper that broadcasts each step (engine/tp.h); the others sit in lf_engine_follow. */
struct lf_engine {
  lf_engine_config cfg;
  lf_checkpoint ck;
  int ck_open;
  lf_backend *be;  /* rank 0 of T > 1: the lead wrapper around this rank's backend */
  lf_sched *sched; /* NULL on followers */
  lf_comm_t comm;  /* NULL on a single rank */
  lf_pool_sizing sizing;
  int *layer_budget; /* [n_layers] from cfg.layer_weights, or NULL (every layer `budget`) */
  int budget_min, budget_max;
};

void lf_engine_config_default(lf_engine_config *cfg) {
  memset(cfg, 0, sizeof *cfg);
  cfg->backend = LF_BACKEND_AUTO;
  cfg->policy = LF_POLICY_LONGFLOW;
  cfg->sink = 4;
  cfg->window = 32;
  cfg->mem_util = LF_MEM_UTIL_DEFAULT;
  cfg->max_batch_tokens = LF_MAX_BATCH_TOKENS_DEFAULT;
  cfg->evict_scope = LF_EVICT_LAYER; /* docs/TASK.md section 10: lower error at every budget */
}

void lf_engine_free(lf_engine_t e) {
  if (!e) return;
  lf_sched_free(e->sched); /* gives running requests' pools back to the backend */
  if (e->be) e->be->free(e->be); /* rank 0 of T > 1: also releases the followers */
  if (e->ck_open) lf_checkpoint_close(&e->ck);
  free(e->layer_budget);
  free(e);
}

/* n_pools (docs/DESIGN.md §5): explicit when given; else floor(kv_memory_bytes * mem_util / pool
 * bytes), a pool's bytes in the chosen backend's own arena for the KV heads this rank holds; else
 * left to the backend (cuda: free device memory; cpu: 1). cfg->backend is resolved by now. */
static lf_status resolve_pools(lf_engine_config *cfg, const lf_model_config *mc, int n_kv,
                               const int *layer_budget, lf_pool_sizing *sz) {
  const double util = cfg->mem_util > 0 ? cfg->mem_util : LF_MEM_UTIL_DEFAULT;
  if (!(util <= 1.0))
    return lf_error(LF_ERR_INVALID_ARG, "mem_util %g must be in (0, 1]", cfg->mem_util);
  if (!lf_kvq_fits((int)cfg->kv_dtype, mc->head_dim))
    return lf_error(LF_ERR_UNSUPPORTED,
                    "%s pools need head_dim a multiple of %d; this model's is %d (bf16, fp8 or "
                    "int8 pools fit it)",
                    lf_kv_dtype_str(cfg->kv_dtype), LF_I4_GROUP, mc->head_dim);
  if (cfg->max_pools < 0 || !(cfg->host_mem_util >= 0 && cfg->host_mem_util <= 1.0))
    return lf_error(LF_ERR_INVALID_ARG, "max_pools %d must be >= 0, host_mem_util %g in [0, 1]",
                    cfg->max_pools, cfg->host_mem_util);
  lf_pool_shape ps = {1, mc->n_layers, n_kv, cfg->budget, mc->head_dim, (int)cfg->kv_dtype,
                      cfg->policy == LF_POLICY_RKV ? cfg->rkv_stage : 0, layer_budget};
  const uint64_t pool_bytes = cfg->backend == LF_BACKEND_CUDA
                                  ? lf_pool_bytes_device(&ps, lf_policy_accumulates(cfg->policy))
                                  : lf_pool_bytes(&ps);
  *sz = (lf_pool_sizing){.n_pools = cfg->n_pools, .pool_bytes = pool_bytes, .basis = "n_pools"};
  if (cfg->n_pools > 0) return LF_OK;
  sz->basis = "the backend's default";
  if (cfg->kv_memory_bytes == 0) return LF_OK; /* the backend's own sizing (it fills *sz) */
  cfg->n_pools = lf_pools_for_memory(cfg->kv_memory_bytes, util, pool_bytes);
  sz->capped = cfg->max_pools > 0 && cfg->n_pools > cfg->max_pools;
  if (sz->capped) cfg->n_pools = cfg->max_pools;
  sz->basis = "kv_memory_bytes";
  sz->basis_bytes = cfg->kv_memory_bytes;
  sz->util = util;
  sz->n_pools = cfg->n_pools;
  if (cfg->n_pools < 1)
    return lf_error(LF_ERR_OUT_OF_MEMORY,
                    "kv_memory_bytes %llu x mem_util %g holds no pool of %llu bytes (budget %d)",
                    (unsigned long long)cfg->kv_memory_bytes, util, (unsigned long long)pool_bytes,
                    cfg->budget);
  return LF_OK;
}

/* Everything a rank does on its own at start-up: checkpoint, plan check, backend. */
static lf_status engine_init_local(lf_engine_t e) {
  lf_status s = lf_checkpoint_open(e->cfg.model_path, &e->ck);
  if (s != LF_OK) return s;
  e->ck_open = 1;
  /* Before any backend reads a weight: every reader then sees the merged model. */
  if (e->cfg.lora_path && e->cfg.lora_path[0])
    LF_TRY(lf_checkpoint_apply_lora(&e->ck, e->cfg.lora_path));
  const lf_model_config *mc = &e->ck.cfg;
  if (e->cfg.budget == 0) e->cfg.budget = mc->max_seq_len;
  e->budget_min = e->budget_max = e->cfg.budget;
  if (e->cfg.layer_weights || e->cfg.n_layer_weights) {
    if (!e->cfg.layer_weights || e->cfg.n_layer_weights != mc->n_layers)
      return lf_error(LF_ERR_INVALID_ARG,
                      "layer_weights: %d weights for a model of %d layers (one per layer)",
                      e->cfg.layer_weights ? e->cfg.n_layer_weights : 0, mc->n_layers);
    if (e->cfg.policy == LF_POLICY_FULL)
      return lf_error(LF_ERR_INVALID_ARG,
                      "layer_weights: per-layer budgets need an evicting policy, not full");
    if (!(e->layer_budget = malloc(sizeof(int) * (size_t)mc->n_layers)))
      return lf_error(LF_ERR_OUT_OF_MEMORY, "layer budgets");
    LF_TRY(lf_layer_budgets_from_weights(e->cfg.layer_weights, mc->n_layers, e->cfg.budget,
                                         e->layer_budget));
    const lf_pool_shape one = {1, mc->n_layers, 1, e->cfg.budget, 1, 0, 0, e->layer_budget};
    e->budget_min = lf_pool_budget_min(&one);
    e->budget_max = lf_pool_budget_max(&one);
  }
  if (e->cfg.key_means || e->cfg.n_key_means)
    LF_TRY(lf_key_means_check(mc, e->cfg.key_means, e->cfg.n_key_means));
  /* rkv's default stage fits the smallest layer (every layer shares it) */
  e->cfg.rkv_stage =
      lf_rkv_stage_resolve(e->cfg.rkv_stage, e->budget_min, e->cfg.sink, e->cfg.rkv_obs);
  int n_kv = mc->n_kv_heads; /* KV heads this rank holds */
  if (e->comm) {
    lf_shard sh;
    LF_TRY(lf_shard_plan(e->comm->rank, e->comm->size, mc->n_heads, mc->n_kv_heads,
                         mc->hidden_dim, mc->vocab_size, &sh));
    /* A device communicator (NCCL) means GPU ranks; a host one (MPI) CPU ranks. The cpu
     * backend runs on either (host buffers); the cuda backend needs a device one. */
    if (e->cfg.backend == LF_BACKEND_AUTO)
      e->cfg.backend = e->comm->device ? LF_BACKEND_CUDA : LF_BACKEND_CPU;
    n_kv = sh.n_kv;
    if (e->cfg.backend == LF_BACKEND_CUDA && !e->comm->device)
      return lf_error(LF_ERR_INVALID_ARG,
                      "tensor parallelism (%d ranks) on the cuda backend needs an NCCL "
                      "communicator (lf_comm_init_nccl_mpi), not '%s'",
                      e->comm->size, e->comm->kind ? e->comm->kind : "?");
  }
  /* Layer-scope eviction: under tensor parallelism it is rank-local (each rank's KV heads of a
   * layer share a slot); evict_groups splits a single rank's heads the same way, e.g. to measure
   * what T ranks would do on one. Both backends (cuda: lf_cuda_layer_argmin). */
  if (e->cfg.evict_groups < 0 || e->cfg.evict_groups > 4096)
    return lf_error(LF_ERR_INVALID_ARG, "evict_groups %d (0..4096)", e->cfg.evict_groups);
  if (e->cfg.evict_scope == LF_EVICT_HEAD && e->cfg.evict_groups > 1)
    return lf_error(LF_ERR_INVALID_ARG, "evict_groups %d needs eviction scope layer",
                    e->cfg.evict_groups);
  if (e->cfg.evict_scope != LF_EVICT_HEAD) {
    if (e->cfg.evict_scope != LF_EVICT_LAYER)
      return lf_error(LF_ERR_INVALID_ARG, "unknown eviction scope %d", (int)e->cfg.evict_scope);
    if (e->comm && e->cfg.evict_groups > 1)
      return lf_error(LF_ERR_INVALID_ARG,
                      "evict_groups %d with %d ranks: under tensor parallelism layer scope is "
                      "rank-local (each rank's KV heads are one group); leave evict_groups 0",
                      e->cfg.evict_groups, e->comm->size);
    if (e->cfg.evict_groups > 1 && mc->n_kv_heads % e->cfg.evict_groups)
      return lf_error(LF_ERR_INVALID_ARG, "evict_groups %d does not divide the model's %d KV heads",
                      e->cfg.evict_groups, mc->n_kv_heads);
  }
  e->cfg.backend = lf_backend_resolve(e->cfg.backend);
  LF_TRY(resolve_pools(&e->cfg, mc, n_kv, e->layer_budget, &e->sizing));
  lf_backend_params bp = {.policy = e->cfg.policy,
                          .scope = e->cfg.evict_scope,
                          .scope_groups = e->cfg.evict_groups,
                          .budget = e->cfg.budget,
                          .sink = e->cfg.sink,
                          .window = e->cfg.window,
                          .layer_budget = e->layer_budget,
                          .h2o_recent = e->cfg.h2o_recent,
                          .rkv_stage = e->cfg.rkv_stage,
                          .rkv_obs = e->cfg.rkv_obs,
                          .kv_dtype = e->cfg.kv_dtype,
                          .key_means = e->cfg.key_means,
                          .n_pools = e->cfg.n_pools,
                          .mem_util = e->cfg.mem_util,
                          .host_mem_util = e->cfg.host_mem_util,
                          .max_pools = e->cfg.max_pools,
                          .sizing = &e->sizing,
                          .n_threads = e->cfg.n_threads,
                          .comm = e->comm};
  return lf_backend_create(e->cfg.backend, &e->ck, &bp, &e->be);
}

/* Start-up agreement: one all-gather of (status, pools) so that a rank that failed on its own
 * (a missing file, memory) makes every rank fail instead of leaving them in a collective.
 * Pools: the cuda backend sizes them from each GPU's free memory, which can differ by a few
 * pools; every rank then keeps the minimum (rank 0's scheduler hands out ids for all). */
static lf_status engine_agree(lf_engine_t e, lf_status local) {
  const int T = e->comm->size;
  int32_t mine[2] = {(int32_t)local, local == LF_OK ? (int32_t)e->be->pools_free(e->be) : -1};
  int32_t *all = malloc(sizeof(int32_t) * 2 * (size_t)T);
  if (!all) return lf_error(LF_ERR_OUT_OF_MEMORY, "start-up agreement");
  lf_status s = e->comm->allgather(e->comm, mine, all, 2, LF_COMM_I32, NULL);
  int fewest = s == LF_OK ? all[1] : 0;
  for (int r = 0; s == LF_OK && r < T; r++)
    if (all[2 * r] == LF_OK && all[2 * r + 1] < fewest) fewest = all[2 * r + 1];
  /* Pools sized from memory (free device memory; MemAvailable on the cpu) differ by rank. */
  const int may_lower = e->cfg.n_pools == 0 && e->cfg.kv_memory_bytes == 0 &&
                        (e->cfg.backend == LF_BACKEND_CUDA || e->cfg.host_mem_util > 0);
  for (int r = 0; s == LF_OK && r < T; r++) {
    if (all[2 * r] != LF_OK) {
      s = local != LF_OK ? local /* keep this rank's own message */
                         : lf_error((lf_status)all[2 * r], "rank %d of %d failed to start: %s",
                                    r, T, lf_status_str((lf_status)all[2 * r]));
    } else if (all[2 * r + 1] != all[1] && !may_lower) {
      s = lf_error(LF_ERR_INTERNAL, "rank %d holds %d pools, rank 0 %d", r, all[2 * r + 1],
                   all[1]);
    }
  }
  free(all);
  if (s == LF_OK && may_lower && mine[1] > fewest) {
#ifdef LF_HAVE_CUDA_BACKEND
    if (e->cfg.backend == LF_BACKEND_CUDA) s = lf_backend_cuda_limit_pools(e->be, fewest);
#endif
    if (e->cfg.backend == LF_BACKEND_CPU) s = lf_backend_cpu_limit_pools(e->be, fewest);
  }
  return s;
}

lf_status lf_engine_init(const lf_engine_config *cfg_in, lf_comm_t comm, lf_engine_t *out) {
  if (!cfg_in || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_engine_init: NULL argument");
  *out = NULL;
  if (!cfg_in->model_path) return lf_error(LF_ERR_INVALID_ARG, "no model path given");
  if (cfg_in->budget < 0 || cfg_in->sink < 0 || cfg_in->window < 0 || cfg_in->n_pools < 0 ||
      cfg_in->max_queue < 0 || cfg_in->max_batch_tokens < 0 || cfg_in->h2o_recent < 0 ||
      cfg_in->rkv_stage < 0 || cfg_in->rkv_obs < 0 || !(cfg_in->mem_util >= 0))
    return lf_error(LF_ERR_INVALID_ARG, "negative budget, sink, window, n_pools, max_queue, "
                                        "max_batch_tokens, h2o_recent, rkv_stage, rkv_obs or "
                                        "mem_util");
  if ((int)cfg_in->kv_dtype < (int)LF_KV_BF16 || (int)cfg_in->kv_dtype > (int)LF_KV_K8V4)
    return lf_error(LF_ERR_INVALID_ARG,
                    "unknown kv_dtype %d (bf16 %d, fp8 %d, int8 %d, int4 %d, k8v4 %d)",
                    (int)cfg_in->kv_dtype, (int)LF_KV_BF16, (int)LF_KV_FP8, (int)LF_KV_INT8,
                    (int)LF_KV_INT4, (int)LF_KV_K8V4);
  if (comm && (comm->size < 1 || comm->rank < 0 || comm->rank >= comm->size))
    return lf_error(LF_ERR_INVALID_ARG, "communicator rank %d of %d", comm->rank, comm->size);

  lf_engine_t e = calloc(1, sizeof *e);
  if (!e) return lf_error(LF_ERR_OUT_OF_MEMORY, "engine");
  e->cfg = *cfg_in;
  e->comm = comm && comm->size > 1 ? comm : NULL;
  lf_status s = engine_init_local(e);
  if (e->comm) {
    /* Every rank gets here, failed or not: the agreement is the only collective of init. */
    lf_status a = engine_agree(e, s);
    if (s == LF_OK) s = a;
  }
  if (s != LF_OK) goto fail;
  const lf_model_config *mc = &e->ck.cfg;
  e->sizing.n_pools = e->be->pools_free(e->be); /* after the agreement: what this rank holds */
  if (e->comm && e->comm->rank != 0) {
    e->cfg.n_pools = e->be->pools_free(e->be);
    *out = e; /* a follower: no scheduler */
    return LF_OK;
  }
  if (e->comm) {
    lf_backend *lead;
    if ((s = lf_backend_tp_lead(e->be, e->comm, &lead)) != LF_OK) goto fail;
    e->be = lead;
  }
  lf_sched_config sc = {.max_batch_tokens = e->cfg.max_batch_tokens,
                        .max_queue = e->cfg.max_queue,
                        .policy = e->cfg.policy,
                        .budget = e->budget_min, /* a prompt fits when it fits every layer */
                        .max_seq_len = mc->max_seq_len,
                        .vocab_size = mc->vocab_size,
                        .n_eos = mc->n_eos < 8 ? mc->n_eos : 8};
  for (int i = 0; i < sc.n_eos; i++)
    sc.eos_ids[i] = mc->eos_ids[i];
  if ((s = lf_sched_init(&sc, e->be, &e->sched)) != LF_OK) goto fail;
  e->cfg.n_pools = e->be->pools_free(e->be); /* what the backend really holds */
  *out = e;
  return LF_OK;
fail:
  /* Past the agreement the followers wait in lf_engine_follow: rank 0's lead wrapper, freed
   * here, releases them with a stop. */
  lf_engine_free(e);
  return s;
}

lf_status lf_engine_follow(lf_engine_t e) {
  if (!e) return lf_error(LF_ERR_INVALID_ARG, "lf_engine_follow: NULL engine");
  if (!e->comm || e->comm->rank == 0)
    return lf_error(LF_ERR_STATE, "lf_engine_follow: rank 0 (or a single rank) leads; "
                                  "it drives the engine with lf_engine_step");
  return lf_backend_tp_follow(e->be, e->comm, e->ck.cfg.vocab_size);
}

/* The request calls on a follower rank. */
static lf_status follower_call(lf_engine_t e, const char *what) {
  return lf_error(LF_ERR_STATE, "%s on rank %d: only rank 0 takes requests; followers call "
                                "lf_engine_follow", what, e->comm->rank);
}

lf_status lf_engine_pool_sizing(lf_engine_t e, lf_pool_sizing *out) {
  if (!e || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_engine_pool_sizing: NULL argument");
  *out = e->sizing;
  return LF_OK;
}

lf_status lf_engine_resolved_config(lf_engine_t e, lf_resolved_config *o) {
  if (!e || !o) return lf_error(LF_ERR_INVALID_ARG, "lf_engine_resolved_config: NULL argument");
  /* e->cfg holds what lf_engine_init resolved: backend, budget, rkv_stage, n_pools. */
  const lf_engine_config *c = &e->cfg;
  memset(o, 0, sizeof *o);
  o->backend = c->backend;
  o->policy = c->policy;
  o->evict_scope = c->evict_scope;
  o->kv_dtype = c->kv_dtype;
  o->budget = c->budget;
  o->sink = c->sink;
  o->window = c->window;
  /* the backends' own rule (attention/attention.h), so this is the window they keep */
  o->h2o_recent =
      c->policy == LF_POLICY_H2O ? lf_h2o_recent(c->h2o_recent, e->budget_min) : 0;
  o->rkv_stage = c->policy == LF_POLICY_RKV ? c->rkv_stage : 0;
  o->rkv_obs = c->policy == LF_POLICY_RKV
                   ? lf_rkv_obs_resolve(c->rkv_obs, e->budget_min, c->sink, c->rkv_stage)
                   : 0;
  o->budget_min = e->budget_min;
  o->budget_max = e->budget_max;
  o->n_pools = e->sizing.n_pools;
  o->max_batch_tokens = c->max_batch_tokens;
  o->max_queue = c->max_queue;
  o->max_seq_len = e->ck.cfg.max_seq_len;
  o->n_ranks = e->comm ? e->comm->size : 1;
  return LF_OK;
}

lf_status lf_engine_model_info(lf_engine_t e, lf_model_info *o) {
  if (!e || !o) return lf_error(LF_ERR_INVALID_ARG, "lf_engine_model_info: NULL argument");
  const lf_model_config *c = &e->ck.cfg;
  memset(o, 0, sizeof *o);
  snprintf(o->model_type, sizeof o->model_type, "%s", c->model_type);
  o->vocab_size = c->vocab_size;
  o->n_layers = c->n_layers;
  o->n_heads = c->n_heads;
  o->n_kv_heads = c->n_kv_heads;
  o->head_dim = c->head_dim;
  o->dim = c->dim;
  o->hidden_dim = c->hidden_dim;
  o->max_seq_len = c->max_seq_len;
  o->bos_id = c->bos_id;
  o->n_eos = c->n_eos;
  for (int i = 0; i < c->n_eos && i < 8; i++)
    o->eos_ids[i] = c->eos_ids[i];
  return LF_OK;
}

lf_status lf_engine_submit(lf_engine_t e, const lf_request *rq, uint64_t *id) {
  if (!e) return lf_error(LF_ERR_INVALID_ARG, "lf_engine_submit: NULL engine");
  if (!e->sched) return follower_call(e, "lf_engine_submit");
  if (rq && rq->sampling.prompt_logprobs && e->comm && e->comm->size > 1)
    return lf_error(LF_ERR_UNSUPPORTED,
                    "prompt_logprobs is not supported under tensor parallelism (%d ranks)",
                    e->comm->size);
  return lf_sched_submit(e->sched, rq, id);
}

lf_status lf_engine_step(lf_engine_t e, lf_event *events, int cap, int *n) {
  if (!e) return lf_error(LF_ERR_INVALID_ARG, "lf_engine_step: NULL engine");
  if (!e->sched) return follower_call(e, "lf_engine_step");
  return lf_sched_step(e->sched, events, cap, n);
}

int lf_engine_busy(lf_engine_t e) {
  return e && e->sched ? lf_sched_busy(e->sched) : 0;
}

lf_status lf_engine_cancel(lf_engine_t e, uint64_t id) {
  if (!e) return lf_error(LF_ERR_INVALID_ARG, "lf_engine_cancel: NULL engine");
  if (!e->sched) return follower_call(e, "lf_engine_cancel");
  return lf_sched_cancel(e->sched, id);
}

lf_status lf_engine_request_stats(lf_engine_t e, uint64_t id, lf_request_stats *out) {
  if (!e) return lf_error(LF_ERR_INVALID_ARG, "lf_engine_request_stats: NULL engine");
  if (!e->sched) return follower_call(e, "lf_engine_request_stats");
  return lf_sched_request_stats(e->sched, id, out);
}

lf_status lf_engine_metrics(lf_engine_t e, lf_metrics *m) {
  if (!e) return lf_error(LF_ERR_INVALID_ARG, "lf_engine_metrics: NULL engine");
  if (!e->sched) return follower_call(e, "lf_engine_metrics");
  return lf_sched_metrics(e->sched, m);
}

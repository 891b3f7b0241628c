/* A backend runs the model over a batch of sequence chunks and owns the KV pools' storage.
 *
 * The engine (and the scheduler) decide which sequences run and where their tokens go; the
 * backend only computes. Two implementations: cpu (fp32 reference, engine/backend_cpu.c) and
 * cuda (bf16, engine/cuda/). Sampling is part of the forward so a GPU backend can
 * sample on the device: the engine draws each item's uniform random number on the host, so the
 * same seed gives the same token on every backend.
 */
#ifndef LF_BACKEND_H
#define LF_BACKEND_H

#include <stdint.h>

#include "lfserve.h"
#include "model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lf_batch_item {
  int pool;              /* the sequence's pool */
  int32_t pos0;          /* position of tokens[0] */
  int n_tok;             /* 1 for a decode step, more for a prompt chunk */
  const int32_t *tokens; /* [n_tok] */
  lf_sampling sampling;  /* how to pick the token after the chunk's last position */
  float u;               /* uniform [0,1) random draw used when sampling is not greedy */
  /* Logit processing before the pick (greedy too), applied to the last position's logits:
   * lf_logits_adjust(logits, adj, n_adj, rep) (engine/sample.h). The forward's logits output
   * and logits_last/logits_all stay raw. */
  const struct lf_logit_adj *adj;
  int n_adj;
  float rep;           /* repetition penalty; 1 or 0: off */
  float *logits_last;  /* non-NULL: the last position's raw logits [vocab] copied here */
  float *logits_all;   /* non-NULL (prompt chunks): every position's raw logits [n_tok][vocab];
                          single rank only (LF_ERR_UNSUPPORTED in the item's status otherwise) */
  int full_logits;     /* nonzero when adj or logits_last is set: under tensor parallelism the
                          item takes the whole-logits path (this flag is what followers see) */
} lf_batch_item;

typedef struct lf_batch_result {
  int32_t token;      /* sampled next token */
  uint64_t evictions; /* slot overwrites this forward caused (all layers and KV heads) */
  lf_status status;   /* LF_OK, or this item's own failure (e.g. LF_ERR_CONTEXT_FULL); the
                         other items are unaffected */
} lf_batch_result;

/* mem_util when none is given (lf_engine_config.mem_util, lf_backend_params.mem_util == 0). */
#define LF_MEM_UTIL_DEFAULT 0.9

typedef struct lf_backend_params {
  lf_policy policy;
  lf_evict_scope scope; /* LF_EVICT_LAYER: under tensor parallelism each rank's KV heads of a
                           layer share a slot */
  int scope_groups;     /* LF_EVICT_LAYER on one rank: the layer's KV heads in this many groups
                           of one slot each (0/1: one); lf_engine_config.evict_groups */
  int budget, sink, window;
  const int *layer_budget; /* NULL: `budget` slots in every layer; else [n_layers] per-layer
                              budgets (lf_engine_config.layer_weights), budget their mean */
  int h2o_recent;  /* LF_POLICY_H2O: recent slots never evicted; 0: budget / 2 (lf_h2o_recent) */
  int rkv_stage;   /* LF_POLICY_RKV: slots per selection (lf_engine_config.rkv_stage, resolved) */
  int rkv_obs;     /* LF_POLICY_RKV: its observation window; 0: lf_rkv_obs_resolve's default */
  lf_kv_dtype kv_dtype; /* how the pools store K and V (lf_engine_config.kv_dtype) */
  const float *key_means; /* NULL or [n_layers][model's n_kv_heads][head_dim]: subtracted from
                             each key after RoPE (lf_engine_config.key_means); the backend
                             copies its own KV heads' rows (lf_key_means_rows), valid finite */
  int n_pools;     /* cuda: 0 sizes the pools from the free device memory (see mem_util);
                     pools_free() after create says how many. The cpu backend needs >= 1. */
  int n_threads;
  double mem_util; /* n_pools == 0: fraction of the memory left after weights and workspaces
                      the pools take; 0: LF_MEM_UTIL_DEFAULT */
  double host_mem_util; /* cpu, n_pools == 0: > 0 sizes the pools from MemAvailable after the
                           weights (lf_engine_config.host_mem_util); 0: one pool */
  int max_pools;        /* n_pools sized from memory: at most this many; 0: no cap */
  lf_pool_sizing *sizing; /* filled by create when it sized the pools; may be NULL */
  int no_graphs;   /* cuda: 1 runs the decode step without CUDA graphs (tests, benchmarks) */
  /* Tensor parallelism: NULL or a single rank runs the whole model. With T > 1 ranks the
   * backend holds this rank's shard (parallel/shard.h) and its forward calls collectives, so
   * every rank must call forward with the same items (engine/tp.h keeps them in step);
   * results (tokens, statuses, logits) are the same on every rank. cpu: any communicator;
   * cuda: a device one (NCCL, comm->device). */
  lf_comm_t comm;
} lf_backend_params;

typedef struct lf_backend lf_backend;
struct lf_backend {
  const char *name;
  /* Runs every item and fills res[i]. A non-OK return is a backend-wide failure (device error);
   * per-item failures go to res[i].status. logits (may be NULL): [n][vocab] of each item's last
   * position, for tests. */
  lf_status (*forward)(lf_backend *b, const lf_batch_item *items, int n, lf_batch_result *res,
                       float *logits);
  /* Pool lifecycle: take a free pool (metadata reset), give it back, query fill. */
  lf_status (*pool_take)(lf_backend *b, int *pool);
  lf_status (*pool_give)(lf_backend *b, int pool);
  int (*pools_free)(lf_backend *b);
  int (*pool_slots_filled)(lf_backend *b, int pool); /* KV head 0 of the layer with the
                                                         smallest budget (the first such) */
  void (*free)(lf_backend *b);
  /* The longest prompt chunk it SnapKV-compresses in one forward (lf_prefill_kind_of's
   * LF_PREFILL_COMPRESS); 0: no limit. The scheduler runs a prompt that does not fit its pool
   * whole only up to this (scheduler/README.md). */
  int max_compress_tokens;
};

/* LF_BACKEND_AUTO -> cuda when built in and a device is present, else cpu; others unchanged. */
lf_backend_kind lf_backend_resolve(lf_backend_kind which);

/* Creates the backend `which` names (LF_BACKEND_AUTO: cuda when built in and a device is
 * present, else cpu) over an opened checkpoint, which must outlive the backend. */
lf_status lf_backend_create(lf_backend_kind which, const lf_checkpoint *ck,
                            const lf_backend_params *p, lf_backend **out);

lf_status lf_backend_cpu_create(const lf_checkpoint *ck, const lf_backend_params *p,
                                lf_backend **out);
/* Under tensor parallelism, pools sized from host memory (host_mem_util) can differ by rank:
 * lowers this cpu backend's count to n_pools (all free), as the cuda one does. */
lf_status lf_backend_cpu_limit_pools(lf_backend *b, int n_pools);
#ifdef LF_HAVE_CUDA_BACKEND
lf_status lf_backend_cuda_create(const lf_checkpoint *ck, const lf_backend_params *p,
                                 lf_backend **out);
/* Nonzero when a CUDA device is usable. */
int lf_cuda_device_present(void);
/* Tensor parallelism: lowers the pool count to n_pools (the minimum over ranks) right after
 * create, before any pool is taken (engine.c's start-up agreement). */
lf_status lf_backend_cuda_limit_pools(lf_backend *b, int n_pools);
#endif

#ifdef __cplusplus
}
#endif
#endif

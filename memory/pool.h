/* The static KV slot pools of one rank (docs/DESIGN.md §3), CPU (fp32) arena.
 *
 * One allocation per array; a pool belongs to one sequence at a time and holds, for every layer
 * and every KV head this rank owns, `budget` slots of (k, v). One (pool, layer, head) is a
 * contiguous [budget][head_dim] block, so the attention kernel streams it in one pass.
 * Pools are taken and returned through a LIFO free list; nothing is allocated after init.
 */
#ifndef LF_POOL_H
#define LF_POOL_H

#include <stdint.h>

#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lf_pool_shape {
  int n_pools;
  int n_layers;
  int n_kv_heads; /* heads this rank owns */
  int budget;     /* slots per (pool, layer, head) */
  int head_dim;
  int kv_dtype;   /* lf_kv_dtype: the CUDA arena's K/V storage (lf_pool_bytes_device); the CPU
                     arena stores fp32 in any case, holding a quantized dtype's dequantized values */
  int stage;      /* LF_POLICY_RKV: slots chosen per selection (the staged overwrite order kept
                     per (pool, layer, head)); 0: no such state */
  const int *layer_budget; /* NULL: every layer holds `budget` slots. Else [n_layers] per-layer
                              budgets (each >= 1; budget is then only their nominal mean): a
                              layer's (pool, head) blocks hold layer_budget[l] slots. The arena
                              keeps its own copy */
} lf_pool_shape;

/* Slots of layer l in shape s (its layer_budget, else budget). */
int lf_pool_layer_budget(const lf_pool_shape *s, int layer);
/* The first layer holding the smallest budget of s (0 when uniform). */
int lf_pool_layer_min(const lf_pool_shape *s);
/* The smallest and largest layer budget of s (budget when uniform). */
int lf_pool_budget_min(const lf_pool_shape *s);
int lf_pool_budget_max(const lf_pool_shape *s);
/* Slots of one pool summed over layers, per KV head: sum of the layer budgets (L * budget when
 * uniform); 0 on an invalid shape. */
uint64_t lf_pool_layer_slots(const lf_pool_shape *s);

/* Per-layer budgets from per-layer weights (lf_engine_config.layer_weights): B_l =
 * max(16, floor(budget * L * w_l / sum(w))) (the sum taken in layer order, in double), then one
 * more slot to layers 0, 1, 2, ... in turn until the budgets sum to at least budget * L; the
 * same rule as tools/evict/run.py's ada_budgets, so the simulator and the engine agree slot for
 * slot. LF_ERR_INVALID_ARG when a weight is not finite and > 0, or budget < 1. */
lf_status lf_layer_budgets_from_weights(const double *w, int n_layers, int budget, int *out);

/* A view of one (pool, layer, kv head): everything the attention step reads and writes. */
typedef struct lf_kv_head {
  float *k, *v;  /* [budget][head_dim] */
  int32_t *pos;  /* [budget] position of the token in each slot (-1: empty) */
  float *vnorm;  /* [budget] ||v_slot||_1, cached when the slot is written */
  float *acc;    /* [budget] h2o: attention mass accumulated since the slot was written */
  int32_t *n;    /* filled slots */
  int32_t *next; /* slot the next token overwrites once n == budget (-1: none yet) */
  int32_t *queue; /* rkv only (else NULL): [stage] the slots the last selection chose, in the
                     order they are overwritten */
  int32_t *since; /* rkv only (else NULL): decode steps since the last selection (-1: none yet) */
  int stage;      /* rkv: the length of queue */
  int budget;
  int head_dim;
  int kv_dtype;  /* lf_kv_dtype: a quantized dtype stores each written row as the values its
                    format reads back (base/kvq.h), in fp32 */
  const float *k_mean; /* NULL, or [head_dim]: the key mean the forward took from this head's
                          keys before storing them (lf_engine_config.key_means, in the stored
                          keys' frame). Only rkv's selection reads it: its cosines compare the
                          model's keys, each stored row plus k_mean (an fp32 sum). Not set by
                          lf_kv_arena_head; the forward sets it */
} lf_kv_head;

/* The free list of a rank's pools, shared by every backend's arena: a LIFO stack of free ids
 * and an in-use flag per pool. Fresh (and after lf_pool_list_limit) it hands out 0, 1, 2, ...,
 * so ranks that take and give in the same order hold the same ids. */
typedef struct lf_pool_list {
  int n_pools;
  int *free_ids; /* [n_pools] stack of free pool ids */
  int n_free;
  uint8_t *in_use; /* [n_pools] */
} lf_pool_list;

/* LF_ERR_OUT_OF_MEMORY if the tables cannot be allocated (n_pools >= 1). */
lf_status lf_pool_list_init(lf_pool_list *l, int n_pools);
void lf_pool_list_free(lf_pool_list *l);
/* Pops a free pool id; LF_ERR_STATE if none (the caller resets the pool's metadata). */
lf_status lf_pool_list_take(lf_pool_list *l, int *pool);
/* Returns a pool; a free or unknown pool is LF_ERR_STATE. */
lf_status lf_pool_list_give(lf_pool_list *l, int pool);
/* Lowers the count to n_pools (1..n_pools) and restacks 0, 1, 2, ...; every pool must be free
 * (LF_ERR_STATE otherwise). The tables keep their size. */
lf_status lf_pool_list_limit(lf_pool_list *l, int n_pools);
/* 1 when pool is a taken id in [0, n_pools). */
int lf_pool_list_in_use(const lf_pool_list *l, int pool);

typedef struct lf_kv_arena {
  lf_pool_shape shape; /* shape.layer_budget points at layer_budget below (or is NULL) */
  int *layer_budget;   /* [n_layers] the arena's copy of the per-layer budgets (NULL: uniform) */
  size_t *layer_off;   /* [n_layers] first slot of layer l within a pool, per KV head: the sum of
                          the budgets before it (times the KV heads it is a slot index) */
  size_t pool_slots;   /* slots of one pool: KV heads x the sum of the layer budgets */
  float *k, *v;        /* [pool][layer][kv_head][slot of the layer's budget][dim] */
  int32_t *pos;        /* [pool][layer][kv_head][slot] */
  float *vnorm;        /* [pool][layer][kv_head][slot] */
  float *acc;          /* [pool][layer][kv_head][slot] */
  int32_t *n, *next;   /* [pool][layer][kv_head] */
  int32_t *queue;      /* rkv (shape.stage > 0): [pool][layer][kv_head][stage] */
  int32_t *since;      /* rkv: [pool][layer][kv_head] */
  uint64_t *evictions; /* [pool] slot overwrites since the pool was taken */
  lf_pool_list pools;  /* which pools are free */
} lf_kv_arena;

/* The CUDA backend's device arena as its kernels address it: [pool][layer][kv_head][slot] with
 * bf16 K/V, and h2o's accumulator only under that policy. Every pointer is device memory;
 * kernels take it by value. The engine's arena is layer-major and hands its kernels one layer at
 * a time as a view of n_layers 1 (engine/cuda/create.cu), so each layer may have its own budget;
 * kernels index (pool, layer, head) as ((pool * n_layers + layer) * n_kv_heads + head). */
typedef struct lf_cuda_pool_view {
  void *k, *v;       /* [n_pools][n_layers][n_kv_heads][budget][head_dim] (K post-RoPE): bf16, or
                        e4m3 / int8 bytes under LF_KV_FP8 / LF_KV_INT8, or head_dim / 8 words of
                        4-bit codes under LF_KV_INT4 (base/kvq.h) */
  float *vnorm;      /* [n_pools][n_layers][n_kv_heads][budget] ||v||_1 of the bf16 v */
  int32_t *pos;      /* [n_pools][n_layers][n_kv_heads][budget] */
  int32_t *n, *next; /* [n_pools][n_layers][n_kv_heads] */
  float *acc;        /* h2o and rkv (else NULL): [n_pools][n_layers][n_kv_heads][budget] attention
                        mass accumulated since the slot was written (rkv: over its observation
                        window) */
  int32_t *queue;    /* rkv (else NULL): [n_pools][n_layers][n_kv_heads][stage] the slots its
                        last selection chose, in overwrite order */
  int32_t *since;    /* rkv: [n_pools][n_layers][n_kv_heads] decode steps since that selection
                        (-1: none yet) */
  int stage;         /* rkv: the queue's length (0 otherwise) */
  int obs;           /* rkv: its observation window (0: LF_RKV_OBS, attention/rkv_step.h) */
  int n_layers, n_kv_heads, budget, head_dim;
  int kv_dtype;      /* lf_kv_dtype */
  float *k_scale, *v_scale; /* quantized dtypes (else NULL): [n_pools][n_layers][n_kv_heads][budget]
                               each row's scale (fp8, int8), or each row's head_dim / 32 meta
                               words (step, floor) as 32-bit words (int4; base/kvq.h) */
  void *deq_k, *deq_v;      /* quantized dtypes (else NULL): bf16 [n_kv_heads][budget][head_dim] scratch
                               where a prompt chunk's attention reads the pool's slots dequantized
                               (lf_cuda_pool_dequant) */
} lf_cuda_pool_view;

/* Bytes one pool needs in this arena (K, V and per-slot metadata). */
uint64_t lf_pool_bytes(const lf_pool_shape *s);
/* Bytes one pool needs in the CUDA backend's device arena (K/V in s->kv_dtype and its metadata; acc: 1
 * when it holds per-slot accumulators, policies h2o and rkv; rkv's queue and step count from
 * s->stage). These two are the only pool-size
 * formulas: the engine (kv_memory_bytes), the CUDA backend (sizing from free memory) and lfbench
 * all call them. */
uint64_t lf_pool_bytes_device(const lf_pool_shape *s, int acc);
/* Pools of pool_bytes each that fit in floor(bytes * util) bytes, util in (0, 1] (0 otherwise,
 * and 0 for pool_bytes 0); at most INT_MAX. The one rule behind kv_memory_bytes and the CUDA
 * backend's sizing from free device memory (docs/DESIGN.md §5). */
int lf_pools_for_memory(uint64_t bytes, double util, uint64_t pool_bytes);
lf_status lf_kv_arena_init(lf_kv_arena *a, const lf_pool_shape *s);
void lf_kv_arena_free(lf_kv_arena *a);
/* Pops a free pool, resets its metadata (n = 0, next = -1, pos = -1). LF_ERR_STATE if none. */
lf_status lf_kv_arena_take(lf_kv_arena *a, int *pool);
/* Returns a pool to the free list; returning a free or unknown pool is LF_ERR_STATE. */
lf_status lf_kv_arena_give(lf_kv_arena *a, int pool);
void lf_kv_arena_reset_pool(lf_kv_arena *a, int pool);
lf_kv_head lf_kv_arena_head(const lf_kv_arena *a, int pool, int layer, int kv_head);

#ifdef __cplusplus
}
#endif
#endif

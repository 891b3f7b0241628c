/* The static KV slot pools of one rank: one fp32 arena, a LIFO free list (docs/DESIGN.md §3, §5).
 *
 * Every array is allocated once at init; take/give only move pool ids on the free list and reset
 * per-pool metadata, so admission never allocates and never fragments.
 */
#include "memory/pool.h"

#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "base/kvq.h"

/* a * b into *out; 0 on overflow of size_t. */
static int mul_size(size_t a, size_t b, size_t *out) {
  if (a != 0 && b > SIZE_MAX / a) return 0;
  *out = a * b;
  return 1;
}

int lf_pool_layer_budget(const lf_pool_shape *s, int layer) {
  if (!s || layer < 0 || layer >= s->n_layers) return 0;
  return s->layer_budget ? s->layer_budget[layer] : s->budget;
}

int lf_pool_layer_min(const lf_pool_shape *s) {
  int m = 0;
  for (int l = 1; s && l < s->n_layers; l++)
    if (lf_pool_layer_budget(s, l) < lf_pool_layer_budget(s, m)) m = l;
  return m;
}

int lf_pool_budget_min(const lf_pool_shape *s) {
  return lf_pool_layer_budget(s, lf_pool_layer_min(s));
}

int lf_pool_budget_max(const lf_pool_shape *s) {
  if (!s || s->n_layers < 1) return 0;
  int m = lf_pool_layer_budget(s, 0);
  for (int l = 1; l < s->n_layers; l++)
    if (lf_pool_layer_budget(s, l) > m) m = lf_pool_layer_budget(s, l);
  return m;
}

uint64_t lf_pool_layer_slots(const lf_pool_shape *s) {
  if (!s || s->n_layers < 1 || s->budget < 1) return 0;
  uint64_t t = 0;
  for (int l = 0; l < s->n_layers; l++) {
    const int b = lf_pool_layer_budget(s, l);
    if (b < 1) return 0;
    t += (uint64_t)b;
  }
  return t;
}

lf_status lf_layer_budgets_from_weights(const double *w, int n_layers, int budget, int *out) {
  if (!w || !out || n_layers < 1 || budget < 1)
    return lf_error(LF_ERR_INVALID_ARG, "layer budgets: %d layers, budget %d", n_layers, budget);
  double sum = 0.0;
  for (int l = 0; l < n_layers; l++) {
    if (!(w[l] > 0.0) || !isfinite(w[l]))
      return lf_error(LF_ERR_INVALID_ARG, "layer weight %d is %g: each must be finite and > 0", l,
                      w[l]);
    sum += w[l];
  }
  const double total = (double)budget * (double)n_layers;
  if (!isfinite(sum))
    return lf_error(LF_ERR_INVALID_ARG, "layer weights: their sum overflows (scale them down)");
  long long have = 0;
  for (int l = 0; l < n_layers; l++) {
    const double b = floor(total * w[l] / sum); /* Python: int(B * L * x / sum(w)) */
    if (!isfinite(b) || b > (double)INT_MAX / 2)
      return lf_error(LF_ERR_INVALID_ARG,
                      "layer budgets: layer %d's share of %d x %d slots is out of range (weight "
                      "%g of %g)",
                      l, budget, n_layers, w[l], sum);
    out[l] = b < 16.0 ? 16 : (int)b;
    have += out[l];
  }
  /* the floors lose less than one slot a layer: fewer than n_layers to hand out */
  for (int l = 0; have < (long long)budget * n_layers && l < n_layers; l++, have++) out[l]++;
  return LF_OK;
}

static int shape_valid(const lf_pool_shape *s) {
  return s && s->n_pools >= 1 && s->n_layers >= 1 && s->n_kv_heads >= 1 && s->budget >= 1 &&
         s->head_dim >= 1 && s->stage >= 0 && lf_pool_layer_slots(s) > 0 &&
         s->stage < lf_pool_budget_min(s);
}

/* Bytes of every per-pool array of the arena for one pool, so n_pools * lf_pool_bytes() is the
 * arena's whole footprint (lf_pools_for_memory sizes n_pools from it, docs/DESIGN.md §5). 0 when
 * the shape is invalid or the size does not fit in 64 bits. n_pools is not used. */
uint64_t lf_pool_bytes(const lf_pool_shape *s) {
  if (!s || s->n_layers < 1 || s->n_kv_heads < 1 || s->budget < 1 || s->head_dim < 1) return 0;
  /* Each factor is < 2^31, so the products below are checked in steps. */
  const uint64_t heads = (uint64_t)s->n_layers * (uint64_t)s->n_kv_heads;
  const uint64_t lslots = lf_pool_layer_slots(s); /* per KV head, over the layers */
  const uint64_t slot_bytes = 2u * (uint64_t)s->head_dim * sizeof(float) /* k, v */
                              + sizeof(int32_t) + 2u * sizeof(float);    /* pos, vnorm, acc */
  if (lslots == 0 || lslots > UINT64_MAX / slot_bytes / (uint64_t)s->n_kv_heads) return 0;
  uint64_t head_bytes = 2u * sizeof(int32_t); /* n, next */
  if (s->stage > 0) /* rkv: the staged overwrite order and the steps since its selection */
    head_bytes += ((uint64_t)s->stage + 1u) * sizeof(int32_t);
  const uint64_t slots = lslots * (uint64_t)s->n_kv_heads * slot_bytes;
  if (head_bytes > (UINT64_MAX - 64u - slots) / heads) return 0;
  return slots + heads * head_bytes + sizeof(uint64_t) /* evictions */ +
         sizeof(int) /* free_list */ + sizeof(uint8_t) /* in_use */;
}

/* The CUDA backend's device arena (engine/cuda/): K and V (bf16, or e4m3 bytes and an fp32 scale
 * per row under fp8 and int8), fp32 ||v||_1 and int32 position per slot (and an fp32 accumulator
 * when acc: h2o and rkv); int32 n and next per (pool, layer, head), and rkv's queue of s->stage
 * slots and its step count when s->stage > 0. 0 as lf_pool_bytes, and for an unknown dtype.
 * The fp8 / int8 scratch a chunk's attention reads (one layer's slots of one pool) is a workspace, not
 * pool memory. */
uint64_t lf_pool_bytes_device(const lf_pool_shape *s, int acc) {
  if (!s || s->n_layers < 1 || s->n_kv_heads < 1 || s->budget < 1 || s->head_dim < 1) return 0;
  const uint64_t heads = (uint64_t)s->n_layers * (uint64_t)s->n_kv_heads;
  /* a K row and a V row, codes and metadata (bf16: 2 bytes a value; 8-bit: a byte a value and
   * the scale; int4: half a byte a value and a (step, floor) word per group) */
  if (!lf_kvq_fits(s->kv_dtype, s->head_dim)) return 0;
  const uint64_t kv_bytes = (uint64_t)lf_kvq_row_bytes(lf_kvq_k_row(s->kv_dtype), s->head_dim) +
                            (uint64_t)lf_kvq_row_bytes(lf_kvq_v_row(s->kv_dtype), s->head_dim);
  const uint64_t slot_bytes = kv_bytes + 4u + 4u + (acc ? 4u : 0u);
  const uint64_t lslots = lf_pool_layer_slots(s); /* per KV head, over the layers */
  const uint64_t head_bytes = 2u * sizeof(int32_t) +
                              (s->stage > 0 ? ((uint64_t)s->stage + 1u) * sizeof(int32_t) : 0u);
  if (lslots == 0 || lslots > UINT64_MAX / slot_bytes / (uint64_t)s->n_kv_heads) return 0;
  const uint64_t slots = lslots * (uint64_t)s->n_kv_heads * slot_bytes;
  if (head_bytes > (UINT64_MAX - slots) / heads) return 0;
  return slots + heads * head_bytes;
}

int lf_pools_for_memory(uint64_t bytes, double util, uint64_t pool_bytes) {
  if (pool_bytes == 0 || !(util > 0.0 && util <= 1.0)) return 0;
  /* util * bytes in long double: exact for every byte count below 2^64 */
  const long double usable = floorl((long double)bytes * (long double)util);
  const long double n = floorl(usable / (long double)pool_bytes);
  return n >= (long double)INT_MAX ? INT_MAX : (int)n;
}

static void pool_list_restack(lf_pool_list *l, int n_pools) {
  /* Stack order: pool 0 on top, so pools are handed out 0, 1, 2, ... */
  for (int i = 0; i < n_pools; i++)
    l->free_ids[i] = n_pools - 1 - i;
  l->n_pools = n_pools;
  l->n_free = n_pools;
}

lf_status lf_pool_list_init(lf_pool_list *l, int n_pools) {
  if (!l) return lf_error(LF_ERR_INVALID_ARG, "lf_pool_list_init: list is NULL");
  memset(l, 0, sizeof *l);
  if (n_pools < 1) return lf_error(LF_ERR_INVALID_ARG, "lf_pool_list_init: %d pools", n_pools);
  l->free_ids = calloc((size_t)n_pools, sizeof(int));
  l->in_use = calloc((size_t)n_pools, sizeof(uint8_t));
  if (!l->free_ids || !l->in_use) {
    lf_pool_list_free(l);
    return lf_error(LF_ERR_OUT_OF_MEMORY, "lf_pool_list_init: free list of %d pools", n_pools);
  }
  pool_list_restack(l, n_pools);
  return LF_OK;
}

void lf_pool_list_free(lf_pool_list *l) {
  if (!l) return;
  free(l->free_ids);
  free(l->in_use);
  memset(l, 0, sizeof *l);
}

lf_status lf_pool_list_take(lf_pool_list *l, int *pool) {
  if (!l || !pool) return lf_error(LF_ERR_INVALID_ARG, "pool_take: NULL argument");
  if (l->n_free <= 0)
    return lf_error(LF_ERR_STATE, "pool_take: all %d pools are in use", l->n_pools);
  const int p = l->free_ids[--l->n_free];
  l->in_use[p] = 1;
  *pool = p;
  return LF_OK;
}

lf_status lf_pool_list_give(lf_pool_list *l, int pool) {
  if (!l) return lf_error(LF_ERR_INVALID_ARG, "pool_give: list is NULL");
  if (pool < 0 || pool >= l->n_pools)
    return lf_error(LF_ERR_STATE, "pool_give: pool %d is not in [0, %d)", pool, l->n_pools);
  if (!l->in_use[pool]) return lf_error(LF_ERR_STATE, "pool_give: pool %d is already free", pool);
  l->in_use[pool] = 0;
  l->free_ids[l->n_free++] = pool;
  return LF_OK;
}

lf_status lf_pool_list_limit(lf_pool_list *l, int n_pools) {
  if (!l || n_pools < 1 || n_pools > l->n_pools)
    return lf_error(LF_ERR_INVALID_ARG, "limit_pools: %d pools of %d", n_pools, l ? l->n_pools : 0);
  if (l->n_free != l->n_pools)
    return lf_error(LF_ERR_STATE, "limit_pools: %d pools are in use", l->n_pools - l->n_free);
  pool_list_restack(l, n_pools);
  return LF_OK;
}

int lf_pool_list_in_use(const lf_pool_list *l, int pool) {
  return l && pool >= 0 && pool < l->n_pools && l->in_use[pool];
}

lf_status lf_kv_arena_init(lf_kv_arena *a, const lf_pool_shape *s) {
  if (!a) return lf_error(LF_ERR_INVALID_ARG, "lf_kv_arena_init: arena is NULL");
  memset(a, 0, sizeof *a);
  if (!shape_valid(s))
    return lf_error(LF_ERR_INVALID_ARG,
                    "lf_kv_arena_init: every shape field and layer budget must be >= 1 and the "
                    "rkv stage below the smallest budget (pools %d, layers %d, kv heads %d, "
                    "budget %d (smallest layer %d), head_dim %d, stage %d)",
                    s ? s->n_pools : 0, s ? s->n_layers : 0, s ? s->n_kv_heads : 0,
                    s ? s->budget : 0, lf_pool_budget_min(s), s ? s->head_dim : 0,
                    s ? s->stage : 0);
  size_t n_heads, n_slots, n_vals; /* element counts: (pool, layer, head), slots, floats of K */
  size_t pool_slots;
  const uint64_t lslots = lf_pool_layer_slots(s);
  if (lslots > SIZE_MAX || !mul_size((size_t)lslots, (size_t)s->n_kv_heads, &pool_slots) ||
      !mul_size((size_t)s->n_pools, (size_t)s->n_layers, &n_heads) ||
      !mul_size(n_heads, (size_t)s->n_kv_heads, &n_heads) ||
      !mul_size(pool_slots, (size_t)s->n_pools, &n_slots) ||
      !mul_size(n_slots, (size_t)s->head_dim, &n_vals) || n_vals > SIZE_MAX / sizeof(float))
    return lf_error(LF_ERR_OUT_OF_MEMORY,
                    "lf_kv_arena_init: arena of %d pools x %d layers x %d heads x %d slots x %d "
                    "dims overflows the address space",
                    s->n_pools, s->n_layers, s->n_kv_heads, s->budget, s->head_dim);
  if (!lf_kvq_fits(s->kv_dtype, s->head_dim) ||
      ((lf_kvq_k_row(s->kv_dtype) == LF_KVQ_INT4 || lf_kvq_v_row(s->kv_dtype) == LF_KVQ_INT4) &&
       s->head_dim > LF_I4_MAX_DIM))
    return lf_error(LF_ERR_UNSUPPORTED,
                    "lf_kv_arena_init: kv dtype %d cannot store rows of %d values (int4 rows: a "
                    "multiple of %d, at most %d)",
                    s->kv_dtype, s->head_dim, LF_I4_GROUP, LF_I4_MAX_DIM);

  a->shape = *s;
  a->shape.layer_budget = NULL;
  a->pool_slots = pool_slots;
  a->layer_off = calloc((size_t)s->n_layers, sizeof(size_t));
  if (s->layer_budget && (a->layer_budget = calloc((size_t)s->n_layers, sizeof(int)))) {
    memcpy(a->layer_budget, s->layer_budget, sizeof(int) * (size_t)s->n_layers);
    a->shape.layer_budget = a->layer_budget;
  }
  for (int l = 1; a->layer_off && l < s->n_layers; l++)
    a->layer_off[l] = a->layer_off[l - 1] +
                      (size_t)s->n_kv_heads * (size_t)lf_pool_layer_budget(s, l - 1);
  a->k = calloc(n_vals, sizeof(float));
  a->v = calloc(n_vals, sizeof(float));
  a->pos = calloc(n_slots, sizeof(int32_t));
  a->vnorm = calloc(n_slots, sizeof(float));
  a->acc = calloc(n_slots, sizeof(float));
  a->n = calloc(n_heads, sizeof(int32_t));
  a->next = calloc(n_heads, sizeof(int32_t));
  a->evictions = calloc((size_t)s->n_pools, sizeof(uint64_t));
  const int rkv_bad = s->stage > 0 && (!(a->queue = calloc(n_heads * (size_t)s->stage,
                                                           sizeof(int32_t))) ||
                                       !(a->since = calloc(n_heads, sizeof(int32_t))));
  if (rkv_bad || !a->layer_off || (s->layer_budget && !a->layer_budget) || !a->k || !a->v || !a->pos || !a->vnorm || !a->acc || !a->n || !a->next ||
      !a->evictions ||
      lf_pool_list_init(&a->pools, s->n_pools) != LF_OK) {
    lf_kv_arena_free(a);
    return lf_error(LF_ERR_OUT_OF_MEMORY,
                    "lf_kv_arena_init: cannot allocate %d pools of %llu bytes", s->n_pools,
                    (unsigned long long)lf_pool_bytes(s));
  }
  for (int p = 0; p < s->n_pools; p++)
    lf_kv_arena_reset_pool(a, p);
  return LF_OK;
}

void lf_kv_arena_free(lf_kv_arena *a) {
  if (!a) return;
  free(a->k);
  free(a->v);
  free(a->pos);
  free(a->vnorm);
  free(a->acc);
  free(a->n);
  free(a->next);
  free(a->queue);
  free(a->since);
  free(a->evictions);
  free(a->layer_budget);
  free(a->layer_off);
  lf_pool_list_free(&a->pools);
  memset(a, 0, sizeof *a);
}

lf_status lf_kv_arena_take(lf_kv_arena *a, int *pool) {
  if (!a) return lf_error(LF_ERR_INVALID_ARG, "lf_kv_arena_take: arena is NULL");
  LF_TRY(lf_pool_list_take(&a->pools, pool));
  lf_kv_arena_reset_pool(a, *pool);
  return LF_OK;
}

lf_status lf_kv_arena_give(lf_kv_arena *a, int pool) {
  if (!a) return lf_error(LF_ERR_INVALID_ARG, "lf_kv_arena_give: arena is NULL");
  return lf_pool_list_give(&a->pools, pool);
}

/* Metadata only: K/V keep stale values, which is safe because every reader stops at n. */
void lf_kv_arena_reset_pool(lf_kv_arena *a, int pool) {
  if (!a || pool < 0 || pool >= a->shape.n_pools) return;
  const lf_pool_shape *s = &a->shape;
  size_t heads = (size_t)s->n_layers * (size_t)s->n_kv_heads;
  size_t h0 = (size_t)pool * heads; /* first (layer, head) of the pool */
  size_t slot0 = (size_t)pool * a->pool_slots, n_slots = a->pool_slots;
  for (size_t i = 0; i < heads; i++) {
    a->n[h0 + i] = 0;
    a->next[h0 + i] = -1;
    if (a->since) a->since[h0 + i] = -1;
  }
  for (size_t i = 0; i < n_slots; i++) {
    a->pos[slot0 + i] = -1;
    a->vnorm[slot0 + i] = 0.0f;
    a->acc[slot0 + i] = 0.0f;
  }
  a->evictions[pool] = 0;
}

/* An out-of-range index gives an all-NULL view (budget 0) rather than a wild pointer. */
lf_kv_head lf_kv_arena_head(const lf_kv_arena *a, int pool, int layer, int kv_head) {
  lf_kv_head h;
  memset(&h, 0, sizeof h);
  if (!a || !a->k || pool < 0 || pool >= a->shape.n_pools || layer < 0 ||
      layer >= a->shape.n_layers || kv_head < 0 || kv_head >= a->shape.n_kv_heads)
    return h;
  const lf_pool_shape *s = &a->shape;
  size_t idx = ((size_t)pool * (size_t)s->n_layers + (size_t)layer) * (size_t)s->n_kv_heads +
               (size_t)kv_head; /* index of the (pool, layer, head) */
  const int B = lf_pool_layer_budget(s, layer);
  size_t slot0 = (size_t)pool * a->pool_slots + a->layer_off[layer] + (size_t)kv_head * (size_t)B;
  h.k = a->k + slot0 * (size_t)s->head_dim;
  h.v = a->v + slot0 * (size_t)s->head_dim;
  h.pos = a->pos + slot0;
  h.vnorm = a->vnorm + slot0;
  h.acc = a->acc + slot0;
  h.n = a->n + idx;
  h.next = a->next + idx;
  if (a->queue) {
    h.queue = a->queue + idx * (size_t)s->stage;
    h.since = a->since + idx;
    h.stage = s->stage;
  }
  h.budget = B;
  h.head_dim = s->head_dim;
  h.kv_dtype = s->kv_dtype;
  return h;
}

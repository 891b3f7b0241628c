/* The cpu backend: fp32 weights, the reference attention, host sampling. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "backend.h"
#include "error.h"
#include "forward.h"
#include "memory/pool.h"
#include "sample.h"

typedef struct cpu_backend {
  lf_backend base;
  const lf_checkpoint *ck;
  lf_weights w;
  lf_kv_arena arena;
  lf_cpu_forward fwd;
  lf_sampler sampler;
  float *logits; /* [vocab] */
} cpu_backend;

static lf_status cpu_forward(lf_backend *b, const lf_batch_item *items, int n,
                             lf_batch_result *res, float *logits_out) {
  cpu_backend *c = (cpu_backend *)b;
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
                       .sink = p->sink,
                       .window = p->window,
                       .h2o_recent = p->window,
                       .group = mc->n_heads / mc->n_kv_heads,
                       .head_dim = mc->head_dim,
                       .scale = 1.0f / sqrtf((float)mc->head_dim)};
  lf_pool_shape ps = {p->n_pools, mc->n_layers, mc->n_kv_heads, p->budget, mc->head_dim};
  lf_status s = lf_attn_params_check(&ap, p->budget);
  if (s == LF_OK) s = lf_weights_load_f32(ck, &c->w);
  if (s == LF_OK) s = lf_kv_arena_init(&c->arena, &ps);
  if (s == LF_OK) s = lf_cpu_forward_init(&c->fwd, mc, &c->w, &c->arena, &ap);
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

#include "forward.h"

#ifdef LF_HAVE_OPENMP
#include <omp.h>
#endif

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "base/kvrot.h"

void lf_rmsnorm(float *out, const float *x, const float *w, int n, float eps) {
  float ss = 0.0f;
  for (int i = 0; i < n; i++) ss += x[i] * x[i];
  const float r = 1.0f / sqrtf(ss / (float)n + eps);
  for (int i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* Eight independent partial sums: vectorisable without -ffast-math, and the summation order
 * depends only on n, so a token's result never depends on what else is in the batch. */
static float dot(const float *a, const float *b, int n) {
  float s[8] = {0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; j++) s[j] += a[i + j] * b[i + j];
  float r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < n; i++) r += a[i] * b[i];
  return r;
}

/* Threads for the matmuls of the forward running on this thread (0: OpenMP's default). Set per
 * lf_cpu_forward_run from the backend's n_threads, so an embedding process keeps its own
 * OpenMP settings. */
static _Thread_local int matmul_threads;

void lf_matmul(float *y, const float *x, const float *W, const float *b, int n_tok, int n_in,
               int n_out) {
#ifdef LF_HAVE_OPENMP
  /* Every thread gets at least ~4M multiply-adds (a millisecond or more of work): a parallel
   * region costs tens of microseconds on idle cores and a whole scheduler time slice when a
   * core is shared with other processes (the region waits for its slowest thread), so small
   * models, whose matmuls are far below that even in a batch, run on one thread and a batch is
   * never slower per token than one sequence; large ones still use every core. */
  const long work = (long)n_out * n_in * n_tok;
  int nt = matmul_threads > 0 ? matmul_threads : omp_get_max_threads();
  if (nt > work / (1L << 22)) nt = (int)(work / (1L << 22));
  if (nt < 1) nt = 1;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
#endif
  for (int o = 0; o < n_out; o++) {
    const float *wr = W + (size_t)o * n_in;
    const float bo = b ? b[o] : 0.0f;
    for (int t = 0; t < n_tok; t++) y[(size_t)t * n_out + o] = dot(wr, x + (size_t)t * n_in, n_in) + bo;
  }
}

void lf_rope_freqs(const lf_model_config *cfg, float *inv_freq) {
  const int half = cfg->head_dim / 2;
  for (int i = 0; i < half; i++) {
    /* fp32 like the reference implementations, so positions rotate identically */
    float f = 1.0f / powf(cfg->rope_theta, (float)(2 * i) / (float)cfg->head_dim);
    if (cfg->rope_scaling == LF_ROPE_SCALING_LLAMA3) {
      const float old = (float)cfg->rope_original_max_pos;
      const float low_wl = old / cfg->rope_low_freq_factor;
      const float high_wl = old / cfg->rope_high_freq_factor;
      /* transformers divides a Python scalar by a tensor as reciprocal-then-multiply; doing
       * the same keeps every frequency equal to its fp32 table (2pi / f rounds differently in
       * 1 ulp of a few entries, which moves logits measurably at positions of thousands). */
      const float wl = (1.0f / f) * (2.0f * (float)M_PI);
      if (wl > low_wl) {
        f = f / cfg->rope_factor;
      } else if (wl >= high_wl) {
        const float smooth = ((1.0f / wl) * old - cfg->rope_low_freq_factor) /
                             (cfg->rope_high_freq_factor - cfg->rope_low_freq_factor);
        f = (1.0f - smooth) * f / cfg->rope_factor + smooth * f;
      }
    }
    inv_freq[i] = f;
  }
}

void lf_rope_apply(float *x, int n_heads, int head_dim, int32_t pos, const float *inv_freq,
                   lf_rope_style style) {
  const int half = head_dim / 2;
  for (int i = 0; i < half; i++) {
    const float ang = (float)pos * inv_freq[i];
    const float c = cosf(ang), s = sinf(ang);
    for (int h = 0; h < n_heads; h++) {
      float *xh = x + (size_t)h * head_dim;
      const int i0 = style == LF_ROPE_INTERLEAVED ? 2 * i : i;
      const int i1 = style == LF_ROPE_INTERLEAVED ? 2 * i + 1 : i + half;
      const float a = xh[i0], b = xh[i1];
      xh[i0] = a * c - b * s;
      xh[i1] = b * c + a * s;
    }
  }
}

static void free_scratch(lf_cpu_forward *f) {
  free(f->x);
  free(f->xb);
  free(f->q);
  free(f->k);
  free(f->v);
  free(f->att);
  free(f->hb);
  free(f->hb2);
  f->x = f->xb = f->q = f->k = f->v = f->att = f->hb = f->hb2 = NULL;
  f->cap_tok = 0;
}

static lf_status grow_scratch(lf_cpu_forward *f, int n_tok) {
  if (n_tok <= f->cap_tok) return LF_OK;
  const lf_model_config *c = f->cfg;
  free_scratch(f);
  const size_t t = (size_t)n_tok;
  const size_t qd = (size_t)f->sh.n_cq * c->head_dim, kd = (size_t)f->sh.n_kv * c->head_dim;
  f->x = malloc(t * c->dim * sizeof(float));
  f->xb = malloc(t * (c->dim > (int)qd ? (size_t)c->dim : qd) * sizeof(float));
  f->q = malloc(t * qd * sizeof(float));
  f->k = malloc(t * kd * sizeof(float));
  f->v = malloc(t * kd * sizeof(float));
  f->att = malloc(t * qd * sizeof(float));
  f->hb = malloc(t * f->sh.n_hid * sizeof(float));
  f->hb2 = malloc(t * f->sh.n_hid * sizeof(float));
  if (!f->x || !f->xb || !f->q || !f->k || !f->v || !f->att || !f->hb || !f->hb2) {
    free_scratch(f);
    return lf_error(LF_ERR_OUT_OF_MEMORY, "forward scratch for %d tokens", n_tok);
  }
  f->cap_tok = n_tok;
  return LF_OK;
}

lf_status lf_cpu_forward_init(lf_cpu_forward *f, const lf_model_config *cfg, const lf_weights *w,
                              lf_kv_arena *arena, const lf_attn_params *ap) {
  return lf_cpu_forward_init_tp(f, cfg, w, arena, ap, NULL, NULL);
}

lf_status lf_cpu_forward_init_tp(lf_cpu_forward *f, const lf_model_config *cfg,
                                 const lf_weights *w, lf_kv_arena *arena, const lf_attn_params *ap,
                                 const lf_shard *sh, lf_comm_t comm) {
  memset(f, 0, sizeof *f);
  f->cfg = cfg;
  f->w = w;
  f->arena = arena;
  f->ap = *ap;
  f->comm = comm && comm->size > 1 ? comm : NULL;
  if (sh) {
    f->sh = *sh;
  } else {
    LF_TRY(lf_shard_plan(0, 1, cfg->n_heads, cfg->n_kv_heads, cfg->hidden_dim, cfg->vocab_size,
                         &f->sh));
  }
  if (!f->comm && f->sh.size != 1)
    return lf_error(LF_ERR_INVALID_ARG, "forward: a plan for %d ranks needs a communicator",
                    f->sh.size);
  if (f->comm && (f->sh.size != f->comm->size || f->sh.rank != f->comm->rank))
    return lf_error(LF_ERR_INVALID_ARG, "forward: plan for rank %d/%d on communicator rank %d/%d",
                    f->sh.rank, f->sh.size, f->comm->rank, f->comm->size);
  if (arena->shape.n_kv_heads != f->sh.n_kv || ap->group * f->sh.n_kv != f->sh.n_cq)
    return lf_error(LF_ERR_INVALID_ARG, "forward: arena has %d KV heads, the plan %d",
                    arena->shape.n_kv_heads, f->sh.n_kv);
  if (ap->scope == LF_EVICT_LAYER) {
    /* Under tensor parallelism a group never spans ranks: each rank's KV heads of a layer are
     * its own group (rank-local layer scope), so eviction needs no communication. */
    const int g = ap->scope_groups > 1 ? ap->scope_groups : 1;
    if (f->comm && g != 1)
      return lf_error(LF_ERR_INVALID_ARG,
                      "forward: eviction groups (%d) apply to a single rank; under tensor "
                      "parallelism each rank's KV heads are one group",
                      g);
    if (!lf_evict_group_heads(ap->scope, g, f->sh.n_kv))
      return lf_error(LF_ERR_INVALID_ARG,
                      "forward: %d KV heads do not split into %d eviction groups", f->sh.n_kv, g);
  } else if (ap->scope_groups > 1) {
    return lf_error(LF_ERR_INVALID_ARG, "forward: eviction groups need scope layer");
  }
  f->inv_freq = malloc(sizeof(float) * (size_t)(cfg->head_dim / 2));
  f->heads = malloc(sizeof(lf_kv_head) * (size_t)f->sh.n_kv);
  if (!f->inv_freq || !f->heads) {
    lf_cpu_forward_free(f);
    return lf_error(LF_ERR_OUT_OF_MEMORY, "rope table");
  }
  lf_rope_freqs(cfg, f->inv_freq);
  lf_status s = grow_scratch(f, 1);
  if (s != LF_OK) lf_cpu_forward_free(f);
  return s;
}

void lf_cpu_forward_free(lf_cpu_forward *f) {
  free_scratch(f);
  free(f->inv_freq);
  f->inv_freq = NULL;
  free(f->heads);
  f->heads = NULL;
  free(f->layer_ap);
  f->layer_ap = NULL;
  free(f->kmu);
  f->kmu = NULL;
  lf_attn_scratch_free(&f->ws);
}

lf_status lf_key_means_check(const lf_model_config *mc, const float *all, int n) {
  const long long want = (long long)mc->n_layers * mc->n_kv_heads * mc->head_dim;
  if (!all || n != want)
    return lf_error(LF_ERR_INVALID_ARG,
                    "key_means: %d values for a model of %d layers x %d KV heads x %d dims (%lld)",
                    all ? n : 0, mc->n_layers, mc->n_kv_heads, mc->head_dim, want);
  for (long long i = 0; i < want; i++)
    if (!isfinite(all[i]))
      return lf_error(LF_ERR_INVALID_ARG, "key_means: value %lld is not finite", i);
  return LF_OK;
}

void lf_key_means_rows(const float *all, int n_layers, int n_kv_all, int head_dim, int kv0,
                       int n_kv, int rotate, float *out) {
  for (int l = 0; l < n_layers; l++)
    for (int h = 0; h < n_kv; h++) {
      float *row = out + ((size_t)l * n_kv + h) * head_dim;
      memcpy(row, all + ((size_t)l * n_kv_all + kv0 + h) * head_dim, sizeof(float) * head_dim);
      if (rotate) lf_rot_row(row, head_dim, 0);
    }
}

/* Pool `pool`'s (layer, KV head) as attention takes it here: with the head's key mean, which rkv's
 * selection adds back to compare the model's keys (memory/pool.h). */
static lf_kv_head forward_head(const lf_cpu_forward *f, int pool, int layer, int kv_head) {
  lf_kv_head h = lf_kv_arena_head(f->arena, pool, layer, kv_head);
  if (f->kmu)
    h.k_mean = f->kmu + ((size_t)layer * f->sh.n_kv + (size_t)kv_head) * f->cfg->head_dim;
  return h;
}

lf_status lf_cpu_forward_set_key_means(lf_cpu_forward *f, const float *all) {
  free(f->kmu);
  f->kmu = NULL;
  if (!all) return LF_OK;
  const lf_model_config *c = f->cfg;
  const size_t n = (size_t)c->n_layers * f->sh.n_kv * c->head_dim;
  if (!(f->kmu = malloc(sizeof(float) * n)))
    return lf_error(LF_ERR_OUT_OF_MEMORY, "key means");
  lf_key_means_rows(all, c->n_layers, c->n_kv_heads, c->head_dim, f->sh.kv0, f->sh.n_kv,
                    lf_kv_rotates(f->arena->shape.kv_dtype), f->kmu);
  return LF_OK;
}

lf_status lf_cpu_forward_set_layer_params(lf_cpu_forward *f, const lf_attn_params *per_layer) {
  free(f->layer_ap);
  f->layer_ap = NULL;
  if (!per_layer) return LF_OK;
  const size_t L = (size_t)f->cfg->n_layers;
  if (!(f->layer_ap = malloc(L * sizeof *f->layer_ap)))
    return lf_error(LF_ERR_OUT_OF_MEMORY, "per-layer attention params");
  memcpy(f->layer_ap, per_layer, L * sizeof *f->layer_ap);
  return LF_OK;
}

/* The forward pass over n_tok rows. One sequence (pools NULL): rows are its tokens at
 * positions pos0.., attention over `pool` (decode when n_tok is 1, else prefill). A decode batch
 * (pools set): row t is one token of its own sequence, at pos[t] on pools[t]; status[t] and
 * evictions[t] are per row, and a row whose attention fails leaves the others alone. The
 * matmuls take every row at once, so a weight row is read once per step however many
 * sequences run, and each row's dot products are summed exactly as alone: the result of a row
 * never depends on the others. */
static lf_status forward_rows(lf_cpu_forward *f, int n_tok, const int32_t *tokens, int pool,
                              int32_t pos0, const int *pools, const int32_t *pos,
                              lf_status *status, float *logits, float *logits_all,
                              uint64_t *evictions) {
  matmul_threads = f->n_threads;
  const lf_model_config *c = f->cfg;
  const lf_weights *w = f->w;
  if (n_tok < 1) return lf_error(LF_ERR_INVALID_ARG, "forward: n_tok %d < 1", n_tok);
  for (int t = 0; t < (pools ? n_tok : 1); t++) {
    const int p = pools ? pools[t] : pool;
    if (p < 0 || p >= f->arena->shape.n_pools)
      return lf_error(LF_ERR_INVALID_ARG, "forward: pool %d out of range", p);
  }
  for (int t = 0; t < n_tok; t++)
    if (tokens[t] < 0 || tokens[t] >= c->vocab_size)
      return lf_error(LF_ERR_INVALID_ARG, "token id %d out of range [0, %d)", tokens[t],
                      c->vocab_size);
  LF_TRY(grow_scratch(f, n_tok));
  if (status)
    for (int t = 0; t < n_tok; t++)
      status[t] = LF_OK;

  const lf_shard *sh = &f->sh;
  const int dim = c->dim, hd = c->head_dim, hq = sh->n_cq, hkv = sh->n_kv, hid = sh->n_hid;
  const int qd = hq * hd, kd = hkv * hd, group = hq / hkv, qd_own = sh->n_q * hd;
  float *x = f->x;   /* [n_tok][dim] */
  float *xb = f->xb; /* [n_tok][max(dim, qd)] */
  const size_t nx = (size_t)n_tok * dim;

  /* Vocab-parallel embedding: each row comes from the one rank that owns it. */
  for (int t = 0; t < n_tok; t++) {
    const int row = tokens[t] - sh->vocab0;
    if (row >= 0 && row < sh->n_vocab)
      memcpy(x + (size_t)t * dim, w->embed + (size_t)row * dim, sizeof(float) * dim);
    else
      memset(x + (size_t)t * dim, 0, sizeof(float) * dim);
  }
  if (f->comm) LF_TRY(f->comm->allreduce_sum(f->comm, x, nx, LF_COMM_F32, NULL));

  for (int l = 0; l < c->n_layers; l++) {
    const lf_layer_weights *L = &w->layers[l];
    for (int t = 0; t < n_tok; t++)
      lf_rmsnorm(xb + (size_t)t * dim, x + (size_t)t * dim, L->rms_att, dim, c->norm_eps);
    lf_matmul(f->q, xb, L->wq, L->bq, n_tok, dim, qd);
    lf_matmul(f->k, xb, L->wk, L->bk, n_tok, dim, kd);
    lf_matmul(f->v, xb, L->wv, L->bv, n_tok, dim, kd);
    for (int t = 0; t < n_tok; t++) {
      float *qt = f->q + (size_t)t * qd, *kt = f->k + (size_t)t * kd;
      if (c->qk_norm) {
        for (int h = 0; h < hq; h++) lf_rmsnorm(qt + h * hd, qt + h * hd, L->q_norm, hd, c->norm_eps);
        for (int h = 0; h < hkv; h++) lf_rmsnorm(kt + h * hd, kt + h * hd, L->k_norm, hd, c->norm_eps);
      }
      const int32_t p = pools ? pos[t] : pos0 + t;
      lf_rope_apply(qt, hq, hd, p, f->inv_freq, c->rope_style);
      lf_rope_apply(kt, hkv, hd, p, f->inv_freq, c->rope_style);
      if (lf_kv_rotates(f->arena->shape.kv_dtype)) { /* int4 pools store rotated keys */
        for (int h = 0; h < hq; h++) lf_rot_row(qt + h * hd, hd, 1);
        for (int h = 0; h < hkv; h++) lf_rot_row(kt + h * hd, hd, 0);
      }
      if (f->kmu) { /* the layer's key means, as the CUDA qkv kernel takes them */
        const float *mu = f->kmu + (size_t)l * kd;
        for (int i = 0; i < kd; i++) kt[i] -= mu[i];
      }
    }
    /* Attention over this sequence's pool, one call per eviction scope: a KV head (head scope)
     * or a group of the layer's heads held here (layer scope: all of them unless scope_groups
     * splits them; one eviction decision shared by the group's heads). With one
     * head the *_layer_ref functions are exactly the per-head ones, and f->ws serves every
     * call, prefill's decode steps included. An error here (only LF_ERR_CONTEXT_FULL in
     * practice) depends on the pool's fill alone, which is the same on every rank, so all ranks
     * leave at the same point and no collective is left half-entered. */
    const lf_attn_params *ap = f->layer_ap ? &f->layer_ap[l] : &f->ap;
    const int per = lf_evict_group_heads(ap->scope, ap->scope_groups, hkv);
    for (int t = 0; pools && t < n_tok; t++) {
      float *att = f->att + (size_t)t * qd;
      if (status[t] != LF_OK) {
        memset(att, 0, sizeof(float) * qd);
        continue;
      }
      for (int g0 = 0; g0 < hkv && status[t] == LF_OK; g0 += per) {
        for (int g = 0; g < per; g++)
          f->heads[g] = forward_head(f, pools[t], l, g0 + g);
        const size_t qo = (size_t)t * qd + (size_t)g0 * group * hd;
        const size_t ko = (size_t)t * kd + (size_t)g0 * hd;
        int ev = 0;
        status[t] = lf_attn_decode_layer_ref(ap, f->heads, per, f->q + qo, f->k + ko,
                                             f->v + ko, pos[t], f->att + qo, &ev, NULL, &f->ws);
        evictions[t] += (uint64_t)ev;
      }
      if (status[t] != LF_OK) memset(att, 0, sizeof(float) * qd);
    }
    for (int g0 = 0; !pools && g0 < hkv; g0 += per) {
      for (int g = 0; g < per; g++)
        f->heads[g] = forward_head(f, pool, l, g0 + g);
      const size_t qo = (size_t)g0 * group * hd, ko = (size_t)g0 * hd;
      if (n_tok == 1) {
        int ev = 0;
        LF_TRY(lf_attn_decode_layer_ref(ap, f->heads, per, f->q + qo, f->k + ko, f->v + ko,
                                        pos0, f->att + qo, &ev, NULL, &f->ws));
        if (evictions) *evictions += (uint64_t)ev;
      } else {
        LF_TRY(lf_attn_prefill_layer_ref(ap, f->heads, per, n_tok, pos0, f->q + qo, qd,
                                         f->k + ko, f->v + ko, kd, f->att + qo, qd, evictions,
                                         &f->ws));
      }
    }
    /* O-proj over the heads this rank owns: all computed heads, or (KV head replicated) this
     * rank's part of the group, packed into q (free now) as [n_tok][qd_own]. */
    const float *att_own = f->att;
    if (qd_own != qd) {
      const size_t off = (size_t)(sh->q0 - sh->cq0) * hd;
      for (int t = 0; t < n_tok; t++)
        memcpy(f->q + (size_t)t * qd_own, f->att + (size_t)t * qd + off, sizeof(float) * qd_own);
      att_own = f->q;
    }
    lf_matmul(xb, att_own, L->wo, NULL, n_tok, qd_own, dim);
    if (f->comm) LF_TRY(f->comm->allreduce_sum(f->comm, xb, nx, LF_COMM_F32, NULL));
    for (size_t i = 0; i < nx; i++) x[i] += xb[i];

    for (int t = 0; t < n_tok; t++)
      lf_rmsnorm(xb + (size_t)t * dim, x + (size_t)t * dim, L->rms_ffn, dim, c->norm_eps);
    lf_matmul(f->hb, xb, L->w_gate, NULL, n_tok, dim, hid);
    lf_matmul(f->hb2, xb, L->w_up, NULL, n_tok, dim, hid);
    for (size_t i = 0; i < (size_t)n_tok * hid; i++) {
      const float g = f->hb[i];
      f->hb[i] = g / (1.0f + expf(-g)) * f->hb2[i];
    }
    lf_matmul(xb, f->hb, L->w_down, NULL, n_tok, hid, dim);
    if (f->comm) LF_TRY(f->comm->allreduce_sum(f->comm, xb, nx, LF_COMM_F32, NULL));
    for (size_t i = 0; i < nx; i++) x[i] += xb[i];
  }

  if (logits_all) {
    for (int t = 0; t < n_tok; t++)
      lf_rmsnorm(xb + (size_t)t * dim, x + (size_t)t * dim, w->rms_final, dim, c->norm_eps);
    lf_matmul(logits_all, xb, w->lm_head, NULL, n_tok, dim, sh->n_vocab);
    if (logits)
      memcpy(logits, logits_all + (size_t)(n_tok - 1) * sh->n_vocab, sizeof(float) * sh->n_vocab);
  } else if (logits) {
    lf_rmsnorm(xb, x + (size_t)(n_tok - 1) * dim, w->rms_final, dim, c->norm_eps);
    lf_matmul(logits, xb, w->lm_head, NULL, 1, dim, sh->n_vocab);
  }
  return LF_OK;
}

lf_status lf_cpu_forward_run(lf_cpu_forward *f, int pool, int32_t pos0, int n_tok,
                             const int32_t *tokens, float *logits, float *logits_all,
                             uint64_t *evictions) {
  return forward_rows(f, n_tok, tokens, pool, pos0, NULL, NULL, NULL, logits, logits_all,
                      evictions);
}

lf_status lf_cpu_forward_decode(lf_cpu_forward *f, int n, const int *pools, const int32_t *pos,
                                const int32_t *tokens, float *logits, uint64_t *evictions,
                                lf_status *status) {
  if (!pools || !pos || !tokens || !logits || !evictions || !status)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cpu_forward_decode: NULL argument");
  return forward_rows(f, n, tokens, -1, 0, pools, pos, status, NULL, logits, evictions);
}

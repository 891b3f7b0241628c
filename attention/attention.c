/* CPU reference of decode attention with LongFlow scoring and eviction, prefill attention with
 * SnapKV compression, and the comparison policies (DESIGN §3, normative; attention.h is the
 * contract).
 *
 * This file is the oracle every backend kernel is tested against, so clarity and exactness come
 * first: logits, softmax, outputs and scores are computed in double from the fp32 inputs and only
 * rounded to fp32 where they are stored. Eviction choices (argmin, top-k) are made on the double
 * values with ties to the lowest slot / position, so they are well-defined; a fp32 kernel may
 * differ only at genuine near-ties.
 *
 * Each call allocates its scratch (a few doubles per slot) before touching the pool, so a failed
 * call leaves the pool as it was.
 */
#include "attention/attention.h"

#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"

static int policy_evicts(lf_policy p) {
  return p != LF_POLICY_FULL;
}

lf_status lf_attn_params_check(const lf_attn_params *p, int budget) {
  if (!p) return lf_error(LF_ERR_INVALID_ARG, "attention params are NULL");
  if ((int)p->policy < (int)LF_POLICY_LONGFLOW || (int)p->policy > (int)LF_POLICY_H2O)
    return lf_error(LF_ERR_INVALID_ARG, "unknown eviction policy %d", (int)p->policy);
  if (budget < 1) return lf_error(LF_ERR_INVALID_ARG, "budget %d must be >= 1", budget);
  if (p->group < 1) return lf_error(LF_ERR_INVALID_ARG, "group %d must be >= 1", p->group);
  if (p->head_dim < 1) return lf_error(LF_ERR_INVALID_ARG, "head_dim %d must be >= 1", p->head_dim);
  if (p->sink < 0) return lf_error(LF_ERR_INVALID_ARG, "sink %d must be >= 0", p->sink);
  if (p->window < 0) return lf_error(LF_ERR_INVALID_ARG, "window %d must be >= 0", p->window);
  if (p->h2o_recent < 0)
    return lf_error(LF_ERR_INVALID_ARG, "h2o_recent %d must be >= 0", p->h2o_recent);
  if (!(p->scale > 0.0f) || !isfinite(p->scale))
    return lf_error(LF_ERR_INVALID_ARG, "scale %g must be finite and > 0", (double)p->scale);
  /* An evicting pool must always have a candidate besides the sinks and the slot just written,
   * or a full pool would have no slot for the next token. */
  if (policy_evicts(p->policy) && (long long)budget < (long long)p->sink + 2)
    return lf_error(LF_ERR_INVALID_ARG, "policy %s needs budget >= sink + 2 (budget %d, sink %d)",
                    lf_policy_str(p->policy), budget, p->sink);
  /* Likewise h2o also protects its recent window. */
  if (p->policy == LF_POLICY_H2O && (long long)budget < (long long)p->sink + p->h2o_recent + 2)
    return lf_error(LF_ERR_INVALID_ARG,
                    "policy h2o needs budget >= sink + h2o_recent + 2 (budget %d, sink %d, "
                    "h2o_recent %d)",
                    budget, p->sink, p->h2o_recent);
  return LF_OK;
}

int lf_kv_write_slot(const lf_kv_head *h) {
  return *h->n < h->budget ? *h->n : *h->next;
}

/* The head view must be complete and agree with the params. */
static lf_status head_check(const lf_attn_params *p, const lf_kv_head *h, const char *fn) {
  if (!h || !h->k || !h->v || !h->pos || !h->vnorm || !h->acc || !h->n || !h->next)
    return lf_error(LF_ERR_INVALID_ARG, "%s: incomplete KV head view", fn);
  if (h->head_dim != p->head_dim)
    return lf_error(LF_ERR_INVALID_ARG, "%s: pool head_dim %d != params head_dim %d", fn,
                    h->head_dim, p->head_dim);
  if (*h->n < 0 || *h->n > h->budget)
    return lf_error(LF_ERR_STATE, "%s: pool has n = %d outside [0, %d]", fn, *h->n, h->budget);
  return LF_OK;
}

static double dot(const float *a, const float *b, int d) {
  double s = 0.0;
  for (int i = 0; i < d; i++)
    s += (double)a[i] * (double)b[i];
  return s;
}

/* x[0..n) <- softmax(x), with max subtraction so no exp overflows. n >= 1. */
static void softmax_inplace(double *x, int n) {
  double m = x[0], sum = 0.0;
  for (int i = 1; i < n; i++)
    if (x[i] > m) m = x[i];
  for (int i = 0; i < n; i++) {
    x[i] = exp(x[i] - m);
    sum += x[i];
  }
  for (int i = 0; i < n; i++)
    x[i] /= sum;
}

/* Stores one token in a slot; ||v||_1 is cached here so scoring never re-reads V (DESIGN §3). */
static void write_slot(lf_kv_head *h, int slot, const float *k, const float *v, int32_t pos) {
  const int d = h->head_dim;
  double l1 = 0.0;
  memcpy(h->k + (size_t)slot * d, k, (size_t)d * sizeof(float));
  memcpy(h->v + (size_t)slot * d, v, (size_t)d * sizeof(float));
  for (int i = 0; i < d; i++)
    l1 += fabs((double)v[i]);
  h->pos[slot] = pos;
  h->vnorm[slot] = (float)l1;
}

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

/* Orders slots by (position, slot index); comparable as one int64 since |pos| < 2^31. */
static int64_t recency_key(const lf_kv_head *h, int slot) {
  return (int64_t)h->pos[slot] * ((int64_t)1 << 32) + slot;
}

/* One decode step; see attention.h. Scratch layout in one allocation:
 *   alpha [group][budget]  softmax weights of each query head over the filled slots
 *   mass  [budget]         sum over the group of alpha
 *   score [budget]         the policy's eviction score
 *   o     [head_dim]       output accumulator
 *   keys  [budget] int64   h2o only: recency keys, sorted to find the protected window */
lf_status lf_attn_decode_ref(const lf_attn_params *p, lf_kv_head *h, const float *q,
                             const float *k_new, const float *v_new, int32_t pos_new, float *out,
                             int *evicted, float *scores) {
  if (!h) return lf_error(LF_ERR_INVALID_ARG, "lf_attn_decode_ref: KV head is NULL");
  LF_TRY(lf_attn_params_check(p, h->budget));
  LF_TRY(head_check(p, h, "lf_attn_decode_ref"));
  if (!q || !k_new || !v_new || !out)
    return lf_error(LF_ERR_INVALID_ARG, "lf_attn_decode_ref: NULL q, k, v or out");

  const int B = h->budget, D = p->head_dim, G = p->group;
  const int was_full = *h->n == B;
  int w;
  if (!was_full) {
    w = *h->n;
  } else if (!policy_evicts(p->policy)) {
    return lf_error(LF_ERR_CONTEXT_FULL,
                    "full policy: all %d slots are filled; token at position %d does not fit", B,
                    (int)pos_new);
  } else {
    w = *h->next;
    if (w < p->sink || w >= B)
      return lf_error(LF_ERR_STATE,
                      "lf_attn_decode_ref: pool is full but next = %d is not an evictable slot "
                      "in [%d, %d)",
                      w, p->sink, B);
  }

  const size_t nd = (size_t)(G + 2) * B + D;
  double *buf = malloc(nd * sizeof(double) + (size_t)B * sizeof(int64_t));
  if (!buf) return lf_error(LF_ERR_OUT_OF_MEMORY, "lf_attn_decode_ref: scratch for %d slots", B);
  double *alpha = buf;                  /* [G][B] */
  double *mass = alpha + (size_t)G * B; /* [B] */
  double *score = mass + B;             /* [B] */
  double *o = score + B;                /* [D] */
  int64_t *keys = (int64_t *)(o + D);   /* [B] */

  /* 1. write the new token */
  write_slot(h, w, k_new, v_new, pos_new);
  if (!was_full) (*h->n)++;
  const int n = *h->n;

  /* 2. exact softmax and output per query head of the group */
  for (int i = 0; i < n; i++)
    mass[i] = 0.0;
  for (int g = 0; g < G; g++) {
    const float *qh = q + (size_t)g * D;
    double *a = alpha + (size_t)g * B;
    for (int i = 0; i < n; i++)
      a[i] = dot(qh, h->k + (size_t)i * D, D) * (double)p->scale;
    softmax_inplace(a, n);
    for (int d = 0; d < D; d++)
      o[d] = 0.0;
    for (int i = 0; i < n; i++) {
      const float *vi = h->v + (size_t)i * D;
      for (int d = 0; d < D; d++)
        o[d] += a[i] * (double)vi[d];
      mass[i] += a[i];
    }
    for (int d = 0; d < D; d++)
      out[(size_t)g * D + d] = (float)o[d];
  }

  /* 3. the policy's score. h2o accumulates mass since the slot was written, so the slot just
   * written starts from this step's mass alone. */
  if (p->policy == LF_POLICY_H2O) {
    h->acc[w] = 0.0f;
    for (int i = 0; i < n; i++)
      h->acc[i] += (float)mass[i];
  }
  for (int i = 0; i < n; i++) {
    switch (p->policy) {
    case LF_POLICY_H2O:
      score[i] = (double)h->acc[i];
      break;
    case LF_POLICY_STREAMING:
      score[i] = (double)h->pos[i];
      break;
    case LF_POLICY_LONGFLOW:
    case LF_POLICY_FULL: /* full never evicts; its score is longflow's, for analysis only */
    default:
      score[i] = (double)h->vnorm[i] * mass[i];
      break;
    }
    if (scores) scores[i] = (float)score[i];
  }

  /* h2o never evicts its h2o_recent most recent slots: ranked by position among all filled
   * slots, the one just written included (it is excluded below anyway), i.e. those whose
   * recency key is >= the h2o_recent-th largest. */
  int64_t recent_from = INT64_MAX;
  if (p->policy == LF_POLICY_H2O && p->h2o_recent > 0) {
    for (int i = 0; i < n; i++)
      keys[i] = recency_key(h, i);
    qsort(keys, (size_t)n, sizeof *keys, cmp_i64);
    recent_from = p->h2o_recent >= n ? INT64_MIN : keys[n - p->h2o_recent];
  }

  /* 4. next = argmin over evictable slots, lowest index on ties (strict <). */
  int best = -1;
  if (policy_evicts(p->policy)) {
    for (int i = p->sink; i < n; i++) {
      if (i == w || recency_key(h, i) >= recent_from) continue;
      if (best < 0 || score[i] < score[best]) best = i;
    }
  }
  *h->next = best;
  if (evicted) *evicted = was_full;
  free(buf);
  return LF_OK;
}

typedef struct ranked {
  double score;
  int pos;
} ranked;

/* Higher score first; ties to the lower position. */
static int cmp_ranked(const void *a, const void *b) {
  const ranked *x = a, *y = b;
  if (x->score != y->score) return x->score > y->score ? -1 : 1;
  return (x->pos > y->pos) - (x->pos < y->pos);
}

/* Causal attention of a chunk over the pool's n0 filled slots and the chunk itself, writing out.
 * Optionally accumulates
 *   snap   [n_tok]      SnapKV: for queries t >= snap_from, the weight of chunk key j < snap_from
 *   colsum [n0 + n_tok] h2o: the weight of every key (pool slots, then chunk tokens) over all
 *                       queries and heads
 * logits [n0 + n_tok] and o [head_dim] are scratch. */
static void prefill_attend(const lf_attn_params *p, const lf_kv_head *h, int n0, int n_tok,
                           const float *q, size_t q_stride, const float *k, const float *v,
                           size_t kv_stride, float *out, size_t out_stride, double *snap,
                           int snap_from, double *colsum, double *logits, double *o) {
  const int D = p->head_dim;
  for (int t = 0; t < n_tok; t++) {
    const int nk = n0 + t + 1; /* keys visible to query t */
    for (int g = 0; g < p->group; g++) {
      const float *qh = q + (size_t)t * q_stride + (size_t)g * D;
      for (int i = 0; i < n0; i++)
        logits[i] = dot(qh, h->k + (size_t)i * D, D) * (double)p->scale;
      for (int j = 0; j <= t; j++)
        logits[n0 + j] = dot(qh, k + (size_t)j * kv_stride, D) * (double)p->scale;
      softmax_inplace(logits, nk);
      for (int d = 0; d < D; d++)
        o[d] = 0.0;
      for (int i = 0; i < nk; i++) {
        const float *vi = i < n0 ? h->v + (size_t)i * D : v + (size_t)(i - n0) * kv_stride;
        for (int d = 0; d < D; d++)
          o[d] += logits[i] * (double)vi[d];
      }
      float *oh = out + (size_t)t * out_stride + (size_t)g * D;
      for (int d = 0; d < D; d++)
        oh[d] = (float)o[d];
      if (snap && t >= snap_from)
        for (int j = 0; j < snap_from; j++)
          snap[j] += logits[n0 + j];
      if (colsum)
        for (int i = 0; i < nk; i++)
          colsum[i] += logits[i];
    }
  }
}

/* SnapKV selection for an empty pool (DESIGN §3): keep[j] = 1 for the B-1 prompt positions
 * kept. snap [L] holds the raw scores of positions 0..L-1 (L = n_tok - W); rank [L] is scratch. */
static void snapkv_select(int n_tok, int budget, int sink, int w_eff, const double *snap,
                          ranked *rank, unsigned char *keep) {
  const int L = n_tok - w_eff;
  const int n_mid = budget - 1 - sink - w_eff; /* heavy hitters to keep from [sink, L) */
  int m = 0;
  memset(keep, 0, (size_t)n_tok);
  for (int j = 0; j < sink; j++)
    keep[j] = 1;
  for (int j = L; j < n_tok; j++)
    keep[j] = 1;
  /* Width-5 average pool, zero padded, always divided by 5 (avg_pool1d, count_include_pad). */
  for (int j = sink; j < L; j++) {
    double s = 0.0;
    for (int d = -2; d <= 2; d++)
      if (j + d >= 0 && j + d < L) s += snap[j + d];
    rank[m].score = s / 5.0;
    rank[m].pos = j;
    m++;
  }
  qsort(rank, (size_t)m, sizeof *rank, cmp_ranked);
  for (int i = 0; i < n_mid && i < m; i++)
    keep[rank[i].pos] = 1; /* m > n_mid since n_tok >= B */
}

lf_status lf_attn_prefill_ref(const lf_attn_params *p, lf_kv_head *h, int n_tok, int32_t pos0,
                              const float *q, size_t q_stride, const float *k, const float *v,
                              size_t kv_stride, float *out, size_t out_stride,
                              uint64_t *evictions) {
  if (!h) return lf_error(LF_ERR_INVALID_ARG, "lf_attn_prefill_ref: KV head is NULL");
  LF_TRY(lf_attn_params_check(p, h->budget));
  LF_TRY(head_check(p, h, "lf_attn_prefill_ref"));
  const int B = h->budget, D = p->head_dim, G = p->group;
  if (n_tok < 0 || n_tok > INT_MAX - B)
    return lf_error(LF_ERR_INVALID_ARG, "lf_attn_prefill_ref: n_tok %d out of range", n_tok);
  if (n_tok == 0) return LF_OK;
  if (!q || !k || !v || !out)
    return lf_error(LF_ERR_INVALID_ARG, "lf_attn_prefill_ref: NULL q, k, v or out");
  if (q_stride < (size_t)G * D || out_stride < (size_t)G * D || kv_stride < (size_t)D)
    return lf_error(LF_ERR_INVALID_ARG,
                    "lf_attn_prefill_ref: strides q %zu, kv %zu, out %zu are smaller than one "
                    "token (group %d x head_dim %d)",
                    q_stride, kv_stride, out_stride, G, D);
  if ((int64_t)pos0 + n_tok - 1 > INT32_MAX)
    return lf_error(LF_ERR_INVALID_ARG, "lf_attn_prefill_ref: positions %d + %d out of range",
                    (int)pos0, n_tok);

  const int n0 = *h->n;
  const int evicts = policy_evicts(p->policy);
  if (!evicts && n0 + n_tok > B)
    return lf_error(LF_ERR_CONTEXT_FULL,
                    "full policy: %d filled + %d new tokens exceed the budget of %d slots", n0,
                    n_tok, B);

  /* Evicting policy, a non-empty pool and a chunk that does not leave a free slot: the chunk is
   * a run of ordinary decode steps, so eviction decisions stay per token. */
  if (evicts && n0 > 0 && n0 + n_tok > B - 1) {
    for (int t = 0; t < n_tok; t++) {
      int ev = 0;
      LF_TRY(lf_attn_decode_ref(p, h, q + (size_t)t * q_stride, k + (size_t)t * kv_stride,
                                v + (size_t)t * kv_stride, pos0 + t, out + (size_t)t * out_stride,
                                &ev, NULL));
      if (evictions) *evictions += (uint64_t)ev;
    }
    return LF_OK;
  }

  /* From here the chunk is attended in one pass, then appended (fits) or compressed into an
   * empty pool. W_eff shrinks the observation window when the budget cannot hold it whole. */
  const int compress = evicts && n0 == 0 && n_tok > B - 1;
  int w_eff = p->window < B - 1 - p->sink ? p->window : B - 1 - p->sink;
  /* streaming keeps the sinks and the most recent tokens: a window that fills the pool */
  if (p->policy == LF_POLICY_STREAMING) w_eff = B - 1 - p->sink;
  if (w_eff < 0) w_eff = 0;
  const int snap_from = n_tok - w_eff; /* L: prompt positions scored by SnapKV */
  const int want_colsum = p->policy == LF_POLICY_H2O;

  size_t n_keys = (size_t)n0 + (size_t)n_tok;
  double *logits = malloc((n_keys + (size_t)D) * sizeof(double));          /* [n0+n_tok] + o [D] */
  double *snap = compress ? calloc((size_t)n_tok, sizeof(double)) : NULL;  /* [n_tok] */
  double *colsum = want_colsum ? calloc(n_keys, sizeof(double)) : NULL;    /* [n0+n_tok] */
  ranked *rank = compress ? malloc((size_t)n_tok * sizeof(ranked)) : NULL; /* [n_tok] */
  unsigned char *keep = compress ? malloc((size_t)n_tok) : NULL;           /* [n_tok] */
  if (!logits || (compress && (!snap || !rank || !keep)) || (want_colsum && !colsum)) {
    free(logits);
    free(snap);
    free(colsum);
    free(rank);
    free(keep);
    return lf_error(LF_ERR_OUT_OF_MEMORY, "lf_attn_prefill_ref: scratch for %d tokens", n_tok);
  }

  prefill_attend(p, h, n0, n_tok, q, q_stride, k, v, kv_stride, out, out_stride, snap,
                 compress ? snap_from : 0, colsum, logits, logits + n_keys);

  if (compress) {
    snapkv_select(n_tok, B, p->sink, w_eff, snap, rank, keep);
    int slot = 0;
    for (int j = 0; j < n_tok; j++) {
      if (!keep[j]) continue;
      write_slot(h, slot, k + (size_t)j * kv_stride, v + (size_t)j * kv_stride, pos0 + j);
      if (want_colsum) h->acc[slot] = (float)colsum[j];
      slot++;
    }
    *h->n = slot; /* == B - 1 */
  } else {
    if (want_colsum)
      for (int i = 0; i < n0; i++)
        h->acc[i] += (float)colsum[i];
    for (int j = 0; j < n_tok; j++) {
      write_slot(h, n0 + j, k + (size_t)j * kv_stride, v + (size_t)j * kv_stride, pos0 + j);
      if (want_colsum) h->acc[n0 + j] = (float)colsum[n0 + j];
    }
    *h->n = n0 + n_tok;
  }
  /* n <= B - 1 for evicting policies, so the next token has a free slot and its decode step
   * chooses next; nothing to overwrite is decided yet. */
  *h->next = -1;

  free(logits);
  free(snap);
  free(colsum);
  free(rank);
  free(keep);
  return LF_OK;
}

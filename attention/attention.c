/* CPU reference of decode attention with LongFlow scoring and eviction, prefill attention with
 * SnapKV compression, and the comparison policies (docs/DESIGN.md §3, normative; attention.h is the
 * contract).
 *
 * This file is the oracle every backend kernel is tested against, so clarity and exactness come
 * first: logits, softmax, outputs and scores are computed in double from the fp32 inputs and only
 * rounded to fp32 where they are stored. Eviction choices (argmin, top-k) are made on the double
 * values with ties to the lowest slot / position, so they are well-defined; a fp32 kernel may
 * differ only at genuine near-ties. Every result is a fixed function of the inputs.
 *
 * The decode step is the hot path of a CPU run, so it is written for speed without giving up
 * fp64: K is read once per step for the whole group (each key row widened once, then one dot
 * product per query head with eight partial sums on 2-wide fp64 vectors, a fixed order), V once
 * (exp(l - max), the normaliser and every head's unnormalised output in the same pass), then
 * alpha = e / Z and the scores. It differs from a plain sequential fp64 loop only in the
 * summation order of the dot products and of the outputs (~1e-16 relative). Its scratch is the
 * caller's (lf_attn_scratch, reused across calls) or allocated per call, and is in hand before
 * the pool is touched, so a failed call leaves the pool as it was.
 *
 * Eviction scope: every function works on the KV heads of one scope: one head (scope head), or
 * all KV heads of a layer (scope layer), whose per-head scores are summed before the argmin and
 * whose SnapKV scores are summed before the prefill selection.
 */
#include "attention/attention.h"

#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention/rkv_step.h"
#include "base/error.h"
#include "base/kvq.h"

static int policy_evicts(lf_policy p) {
  return p != LF_POLICY_FULL;
}

int lf_h2o_recent(int requested, int budget) { return requested > 0 ? requested : budget / 2; }

int lf_rkv_obs_resolve(int requested, int budget, int sink, int stage) {
  if (requested > 0) return requested;
  int obs = budget / 2;
  const long long room = (long long)budget - sink - stage - 1;
  if (obs > room) obs = (int)(room > 0 ? room : 0);
  return obs >= 1 ? obs : LF_RKV_OBS;
}

int lf_rkv_stage_resolve(int requested, int budget, int sink, int obs) {
  if (requested > 0) return requested;
  int stage = LF_RKV_STAGE_DEFAULT;
  while (stage > 1 && (long long)budget < (long long)sink + lf_rkv_obs_of(obs) + stage + 1)
    stage /= 2;
  return stage;
}

lf_attn_params lf_attn_params_for_budget(const lf_attn_params *base, int req_recent, int req_obs,
                                         int budget, int bmin) {
  lf_attn_params a = *base;
  a.h2o_recent = base->policy == LF_POLICY_H2O ? lf_h2o_recent(req_recent, budget) : 0;
  a.rkv_obs = base->policy == LF_POLICY_RKV
                  ? lf_rkv_obs_resolve(req_obs, budget, base->sink, base->rkv_stage)
                  : 0;
  a.prefill_budget = bmin < budget ? bmin : 0;
  return a;
}

int lf_policy_accumulates(lf_policy p) { return p == LF_POLICY_H2O || p == LF_POLICY_RKV; }

lf_status lf_attn_params_check(const lf_attn_params *p, int budget) {
  if (!p) return lf_error(LF_ERR_INVALID_ARG, "attention params are NULL");
  if ((int)p->policy < (int)LF_POLICY_LONGFLOW || (int)p->policy > (int)LF_POLICY_RKV)
    return lf_error(LF_ERR_INVALID_ARG, "unknown eviction policy %d", (int)p->policy);
  if ((int)p->scope != (int)LF_EVICT_HEAD && (int)p->scope != (int)LF_EVICT_LAYER)
    return lf_error(LF_ERR_INVALID_ARG, "unknown eviction scope %d", (int)p->scope);
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
  /* rkv keeps its observation window and chooses a stage of candidates outside it. */
  if (p->policy == LF_POLICY_RKV &&
      (p->rkv_stage < 1 || p->rkv_obs < 0 ||
       (long long)budget < (long long)p->sink + lf_rkv_obs_of(p->rkv_obs) + p->rkv_stage + 1))
    return lf_error(LF_ERR_INVALID_ARG,
                    "policy rkv needs rkv_stage >= 1 and budget >= sink + rkv_obs + rkv_stage + 1 "
                    "(budget %d, sink %d, rkv_obs %d, rkv_stage %d)",
                    budget, p->sink, lf_rkv_obs_of(p->rkv_obs), p->rkv_stage);
  return LF_OK;
}

lf_prefill_kind lf_prefill_kind_of(lf_policy policy, int budget, int n0, int n_tok) {
  if (!policy_evicts(policy) || (int64_t)n0 + n_tok <= (int64_t)budget - 1)
    return LF_PREFILL_APPEND;
  return n0 == 0 ? LF_PREFILL_COMPRESS : LF_PREFILL_DECODE_STEPS;
}

int lf_snapkv_window(const lf_attn_params *p, int budget) {
  const int fill = budget - 1 - p->sink;
  const int w = p->policy == LF_POLICY_STREAMING || p->window > fill ? fill : p->window;
  return w < 0 ? 0 : w;
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
  if (p->policy == LF_POLICY_RKV && (!h->queue || !h->since || h->stage < p->rkv_stage))
    return lf_error(LF_ERR_INVALID_ARG,
                    "%s: policy rkv needs the pool's queue of %d slots (pool stage %d)", fn,
                    p->rkv_stage, h->stage);
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

_Static_assert(LF_KVQ_FP8 == (int)LF_KV_FP8 && LF_KVQ_INT8 == (int)LF_KV_INT8 &&
                   LF_KVQ_INT4 == (int)LF_KV_INT4 && LF_KVQ_K8V4 == (int)LF_KV_K8V4,
               "base/kvq.h's dtype numbers are lf_kv_dtype's");

/* A row as the pool's dtype stores it: fp8, int8 and int4 keep the values its codes read back
 * (base/kvq.h). */
static void store_row(float *dst, const float *x, int d, int kv_dtype) {
  if (kv_dtype == LF_KV_BF16) {
    memcpy(dst, x, (size_t)d * sizeof(float));
    return;
  }
  if (kv_dtype == LF_KV_INT4) { /* lf_kv_arena_init checked d: <= LF_I4_MAX_DIM, whole groups */
    uint32_t words[LF_I4_MAX_DIM / 8], meta[LF_I4_MAX_DIM / LF_I4_GROUP];
    lf_i4_quantize_row(x, d, words, meta);
    for (int i = 0; i < d; i++)
      dst[i] = lf_i4_value(lf_i4_get(words, i), meta[i / LF_I4_GROUP]);
    return;
  }
  const float scale = lf_kvq_scale_of_row(kv_dtype, x, d);
  for (int i = 0; i < d; i++)
    dst[i] = lf_kvq_value(kv_dtype, lf_kvq_code(kv_dtype, x[i], scale), scale);
}

/* Stores one token in a slot; ||v||_1 (of the values stored) is cached here so scoring never
 * re-reads V (docs/DESIGN.md §3). */
static void write_slot(lf_kv_head *h, int slot, const float *k, const float *v, int32_t pos) {
  const int d = h->head_dim;
  double l1 = 0.0;
  store_row(h->k + (size_t)slot * d, k, d, lf_kvq_k_row(h->kv_dtype));
  store_row(h->v + (size_t)slot * d, v, d, lf_kvq_v_row(h->kv_dtype));
  v = h->v + (size_t)slot * d;
  for (int i = 0; i < d; i++)
    l1 += fabs((double)v[i]);
  h->pos[slot] = pos;
  h->vnorm[slot] = (float)l1;
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

/* Orders slots by (position, slot index); comparable as one int64 since |pos| < 2^31. */
static int64_t recency_key(const lf_kv_head *h, int slot) {
  return (int64_t)h->pos[slot] * ((int64_t)1 << 32) + slot;
}

/* The r-th largest recency key of the n filled slots (1 <= r < n): a min-heap of the r largest
 * keys seen so far, O(n log r). Keys are distinct (the slot is part of the key). */
static int64_t rth_largest_key(const lf_kv_head *h, int n, int r, int64_t *heap) {
  int sz = 0;
  for (int i = 0; i < n; i++) {
    const int64_t key = recency_key(h, i);
    int j;
    if (sz < r) { /* sift up */
      j = sz++;
      while (j > 0 && heap[(j - 1) / 2] > key) {
        heap[j] = heap[(j - 1) / 2];
        j = (j - 1) / 2;
      }
    } else if (key > heap[0]) { /* replace the smallest, sift down */
      j = 0;
      for (;;) {
        int c = 2 * j + 1;
        if (c >= sz) break;
        if (c + 1 < sz && heap[c + 1] < heap[c]) c++;
        if (heap[c] >= key) break;
        heap[j] = heap[c];
        j = c;
      }
    } else {
      continue;
    }
    heap[j] = key;
  }
  return heap[0];
}

/* The decode step's inner loops on fp64 vectors of 2 (GCC / Clang vector extensions: one SSE2
 * register on x86-64, one NEON register on arm64), combined in a fixed order so the result
 * depends only on the inputs. Loads and stores go through memcpy (any alignment). */
typedef double v2d __attribute__((vector_size(16)));
typedef float v2f __attribute__((vector_size(8)));

static inline v2d ld2d(const double *p) {
  v2d r;
  memcpy(&r, p, sizeof r);
  return r;
}

static inline void st2d(double *p, v2d x) {
  memcpy(p, &x, sizeof x);
}

/* a . b over d values with eight partial sums. */
static inline double dot_f64(const double *a, const double *b, int d) {
  v2d s0 = {0, 0}, s1 = {0, 0}, s2 = {0, 0}, s3 = {0, 0};
  int i = 0;
  for (; i + 8 <= d; i += 8) {
    s0 += ld2d(a + i) * ld2d(b + i);
    s1 += ld2d(a + i + 2) * ld2d(b + i + 2);
    s2 += ld2d(a + i + 4) * ld2d(b + i + 4);
    s3 += ld2d(a + i + 6) * ld2d(b + i + 6);
  }
  const v2d s = (s0 + s1) + (s2 + s3);
  double r = s[0] + s[1];
  for (; i < d; i++)
    r += a[i] * b[i];
  return r;
}

/* o[0..d) += e * v[0..d). */
static inline void axpy_f64(double *o, const double *v, double e, int d) {
  const v2d ev = {e, e};
  int i = 0;
  for (; i + 2 <= d; i += 2)
    st2d(o + i, ld2d(o + i) + ev * ld2d(v + i));
  for (; i < d; i++)
    o[i] += e * v[i];
}

/* o[0..d) = v[0..d) widened to fp64. */
static inline void widen(double *o, const float *v, int d) {
  int i = 0;
  for (; i + 2 <= d; i += 2) {
    v2f f;
    memcpy(&f, v + i, sizeof f);
    st2d(o + i, __builtin_convertvector(f, v2d));
  }
  for (; i < d; i++)
    o[i] = (double)v[i];
}

#define LF_ALIGN64(x) (((x) + (size_t)63) & ~(size_t)63)

/* Decode scratch, carved from one buffer (64-byte aligned pieces):
 *   lg    [G][B] double  logits, then e = exp(l - max)
 *   mass  [B]            sum over the group of alpha
 *   total [B]            the policy's score, summed over the call's KV heads
 *   qd    [G][D]         the queries, widened
 *   od    [G][D]         output accumulators (sum of e * v)
 *   row   [D]            one key or value row, widened
 *   m, z  [G]            per query head: max logit, softmax normaliser
 *   heap  [R] int64      h2o: the recent window's keys */
typedef struct decode_ws {
  double *lg, *mass, *total, *qd, *od, *row, *m, *z;
  int64_t *heap;
  char *rkv; /* rkv_ws_bytes */
} decode_ws;

static size_t decode_ws_doubles(const lf_attn_params *p, int B, size_t sizes[8]) {
  const size_t G = (size_t)p->group, D = (size_t)p->head_dim, b = (size_t)B;
  const size_t sz[8] = {G * b, b, b, G * D, G * D, D, G, G};
  size_t t = 0;
  for (int i = 0; i < 8; i++) {
    sizes[i] = LF_ALIGN64(sz[i] * sizeof(double));
    t += sizes[i];
  }
  return t;
}

/* rkv's selection scratch, after the heap: keys int64 [B] (recency keys, then slots in position
 * order), then double kn [B][D] (unit keys), imp, pooled, csum, lastv, red [B] each, then
 * ranked cand [B]. */
static size_t rkv_ws_bytes(const lf_attn_params *p, int B) {
  if (p->policy != LF_POLICY_RKV) return 0;
  const size_t b = (size_t)B, D = (size_t)p->head_dim;
  return b * sizeof(int64_t) + (b * D + 5 * b) * sizeof(double) + b * sizeof(ranked) + 64;
}

static size_t decode_ws_bytes(const lf_attn_params *p, int B) {
  size_t sizes[8];
  const size_t R = p->h2o_recent > 0 ? (size_t)p->h2o_recent : 1;
  return decode_ws_doubles(p, B, sizes) + R * sizeof(int64_t) + 64 + rkv_ws_bytes(p, B);
}

static decode_ws decode_ws_carve(const lf_attn_params *p, int B, void *buf) {
  size_t sizes[8];
  decode_ws_doubles(p, B, sizes);
  char *c = (char *)LF_ALIGN64((uintptr_t)buf);
  double **piece[8];
  decode_ws w;
  piece[0] = &w.lg, piece[1] = &w.mass, piece[2] = &w.total, piece[3] = &w.qd;
  piece[4] = &w.od, piece[5] = &w.row, piece[6] = &w.m, piece[7] = &w.z;
  for (int i = 0; i < 8; i++) {
    *piece[i] = (double *)c;
    c += sizes[i];
  }
  w.heap = (int64_t *)c;
  const size_t R = p->h2o_recent > 0 ? (size_t)p->h2o_recent : 1;
  w.rkv = (char *)LF_ALIGN64((uintptr_t)(w.heap + R));
  return w;
}

void lf_attn_scratch_free(lf_attn_scratch *s) {
  if (!s) return;
  free(s->buf);
  s->buf = NULL;
  s->bytes = 0;
}

static lf_status scratch_reserve(lf_attn_scratch *s, size_t bytes, const char *fn) {
  if (s->bytes >= bytes) return LF_OK;
  void *b = malloc(bytes);
  if (!b) return lf_error(LF_ERR_OUT_OF_MEMORY, "%s: %zu bytes of scratch", fn, bytes);
  free(s->buf);
  s->buf = b;
  s->bytes = bytes;
  return LF_OK;
}

/* Steps 2 and 3 of the decode step for one KV head with n filled slots: out [G][D], and
 * ws->mass[i] = sum over the group of alpha_h,i. One pass over K (every query head's logits),
 * one over V (weights and outputs), one over the weights (mass). */
static void decode_attend(const lf_attn_params *p, const lf_kv_head *h, int n, const float *q,
                          float *out, const decode_ws *ws) {
  const int G = p->group, D = p->head_dim, B = h->budget;
  const double scale = (double)p->scale;
  double *lg = ws->lg, *m = ws->m, *z = ws->z, *od = ws->od, *row = ws->row, *mass = ws->mass;

  widen(ws->qd, q, G * D);
  for (int g = 0; g < G; g++)
    m[g] = -INFINITY;
  for (int i = 0; i < n; i++) {
    widen(row, h->k + (size_t)i * D, D);
    for (int g = 0; g < G; g++) {
      const double l = dot_f64(ws->qd + (size_t)g * D, row, D) * scale;
      lg[(size_t)g * B + i] = l;
      if (l > m[g]) m[g] = l;
    }
  }

  for (int g = 0; g < G; g++)
    z[g] = 0.0;
  memset(od, 0, sizeof(double) * (size_t)G * D);
  for (int i = 0; i < n; i++) {
    widen(row, h->v + (size_t)i * D, D);
    for (int g = 0; g < G; g++) {
      double *e = &lg[(size_t)g * B + i];
      *e = exp(*e - m[g]);
      z[g] += *e;
      axpy_f64(od + (size_t)g * D, row, *e, D);
    }
  }

  for (int i = 0; i < n; i++)
    mass[i] = 0.0;
  for (int g = 0; g < G; g++) {
    const double zg = z[g];
    for (int d = 0; d < D; d++)
      out[(size_t)g * D + d] = (float)(od[(size_t)g * D + d] / zg);
    const double *e = lg + (size_t)g * B;
    for (int i = 0; i < n; i++)
      mass[i] += e[i] / zg;
  }
}

static int cmp_i64(const void *a, const void *b) {
  const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

/* rkv's selection (attention.h) over the n filled slots of the scope's heads: fills every head's
 * queue with the rkv_stage slots to overwrite next. Runs on ws->rkv (rkv_ws_bytes). */
static void rkv_select(const lf_attn_params *p, lf_kv_head *hs, int n_kv, int n,
                       const decode_ws *ws, double *slot_total) {
  const int obs = lf_rkv_obs_of(p->rkv_obs);
  const int D = p->head_dim, S = p->rkv_stage, M = n - obs, half = LF_RKV_POOL_KERNEL / 2;
  const size_t b = (size_t)hs[0].budget;
  int64_t *slot_of = (int64_t *)ws->rkv;
  double *kn = (double *)(slot_of + b), *imp = kn + b * (size_t)D, *pooled = imp + b;
  double *csum = pooled + b, *lastv = csum + b, *red = lastv + b;
  ranked *cand = (ranked *)(red + b);
  double *total = ws->total; /* indexed by rank in position order here */

  /* slots in position order; the last obs (the window) stay */
  for (int i = 0; i < n; i++)
    slot_of[i] = recency_key(&hs[0], i);
  qsort(slot_of, (size_t)n, sizeof *slot_of, cmp_i64);
  for (int i = 0; i < n; i++)
    slot_of[i] &= 0xffffffff;
  for (int j = 0; j < M; j++)
    total[j] = 0.0;

  for (int g = 0; g < n_kv; g++) {
    const lf_kv_head *h = &hs[g];
    for (int j = 0; j < M; j++) {
      const int s = (int)slot_of[j];
      imp[j] = (double)h->acc[s] / ((double)p->group * obs);
      double *r = kn + (size_t)j * D;
      const float *kr = h->k + (size_t)s * D;
      if (h->k_mean) /* the model's key: the stored row plus the mean taken from it, in fp32 */
        for (int d = 0; d < D; d++)
          r[d] = (double)(kr[d] + h->k_mean[d]);
      else
        widen(r, kr, D);
      const double nrm = sqrt(dot_f64(r, r, D)) + 1e-8;
      for (int d = 0; d < D; d++)
        r[d] /= nrm;
      csum[j] = lastv[j] = 0.0;
    }
    for (int j = 0; j < M; j++) { /* max-pool over the neighbours that exist */
      double mx = imp[j];
      for (int t = j - half; t <= j + half; t++)
        if (t >= 0 && t < M && imp[t] > mx) mx = imp[t];
      pooled[j] = mx;
    }
    /* a row's cosines with all the others sum to its dot with the sum of the unit keys, less
     * its own square (O(M D)); its most recent look-alike is the first met scanning the
     * others from the newest down (the whole row only when it has none) */
    double *ksum = ws->row; /* [D]; the step's attention is done with it */
    for (int d = 0; d < D; d++)
      ksum[d] = 0.0;
    for (int j = 0; j < M; j++)
      for (int d = 0; d < D; d++)
        ksum[d] += kn[(size_t)j * D + d];
    for (int i = 0; i < M; i++) {
      const double *ri = kn + (size_t)i * D;
      csum[i] = dot_f64(ri, ksum, D) - dot_f64(ri, ri, D);
      for (int j = M - 1; j >= 0; j--) {
        if (j == i) continue;
        const double c = dot_f64(ri, kn + (size_t)j * D, D);
        if (c > LF_RKV_SIM_THRESHOLD) {
          lastv[i] = c;
          break;
        }
      }
    }
    double mmax = -INFINITY, z = 0.0;
    for (int j = 0; j < M; j++) {
      red[j] = (csum[j] - lastv[j]) / (double)M;
      if (red[j] > mmax) mmax = red[j];
    }
    for (int j = 0; j < M; j++) {
      red[j] = exp(red[j] - mmax);
      z += red[j];
    }
    for (int j = 0; j < M; j++)
      total[j] += LF_RKV_LAMBDA * pooled[j] - (1.0 - LF_RKV_LAMBDA) * (red[j] / z);
  }

  if (slot_total) {
    for (size_t i = 0; i < b; i++)
      slot_total[i] = NAN;
    for (int j = 0; j < M; j++)
      slot_total[slot_of[j]] = total[j];
  }
  /* the stage: the lowest total among non-sink slots, ties to the lower slot */
  int m = 0;
  for (int j = 0; j < M; j++)
    if (slot_of[j] >= p->sink) {
      cand[m].score = -total[j]; /* cmp_ranked: highest first */
      cand[m].pos = (int)slot_of[j];
      m++;
    }
  qsort(cand, (size_t)m, sizeof *cand, cmp_ranked); /* m >= S: lf_attn_params_check */
  for (int g = 0; g < n_kv; g++) {
    for (int i = 0; i < S; i++)
      hs[g].queue[i] = cand[i].pos;
    *hs[g].since = 0;
  }
}

/* The decode step for the n_kv heads of one eviction scope (one head, or a layer's heads):
 * q [n_kv][G][D], k_new / v_new [n_kv][D], out [n_kv][G][D]. */
static lf_status decode_impl(const lf_attn_params *p, lf_kv_head *hs, int n_kv, const float *q,
                             const float *k_new, const float *v_new, int32_t pos_new, float *out,
                             int *evicted, float *scores, lf_attn_scratch *ws_in,
                             const char *fn) {
  if (!hs) return lf_error(LF_ERR_INVALID_ARG, "%s: KV head is NULL", fn);
  if (n_kv < 1) return lf_error(LF_ERR_INVALID_ARG, "%s: n_kv %d < 1", fn, n_kv);
  LF_TRY(lf_attn_params_check(p, hs[0].budget));
  for (int g = 0; g < n_kv; g++) {
    LF_TRY(head_check(p, &hs[g], fn));
    if (g > 0 && (hs[g].budget != hs[0].budget || *hs[g].n != *hs[0].n ||
                  *hs[g].next != *hs[0].next))
      return lf_error(LF_ERR_STATE,
                      "%s: layer-scope heads disagree: head %d has budget %d, n %d, next %d; "
                      "head 0 budget %d, n %d, next %d",
                      fn, g, hs[g].budget, *hs[g].n, *hs[g].next, hs[0].budget, *hs[0].n,
                      *hs[0].next);
  }
  if (!q || !k_new || !v_new || !out)
    return lf_error(LF_ERR_INVALID_ARG, "%s: NULL q, k, v or out", fn);

  const int B = hs[0].budget, D = p->head_dim, G = p->group;
  const int was_full = *hs[0].n == B;
  int w;
  if (!was_full) {
    w = *hs[0].n;
  } else if (!policy_evicts(p->policy)) {
    return lf_error(LF_ERR_CONTEXT_FULL,
                    "full policy: all %d slots are filled; token at position %d does not fit", B,
                    (int)pos_new);
  } else {
    w = *hs[0].next;
    if (w < p->sink || w >= B)
      return lf_error(LF_ERR_STATE,
                      "%s: pool is full but next = %d is not an evictable slot in [%d, %d)", fn,
                      w, p->sink, B);
  }

  lf_attn_scratch local = {0}, *sc = ws_in ? ws_in : &local;
  LF_TRY(scratch_reserve(sc, decode_ws_bytes(p, B), fn));
  const decode_ws ws = decode_ws_carve(p, B, sc->buf);
  const int n = was_full ? B : *hs[0].n + 1;
  double *total = ws.total;
  for (int i = 0; i < n; i++)
    total[i] = 0.0;
  /* rkv: the steps left before its next selection */
  const int rkv = p->policy == LF_POLICY_RKV;
  const int since = rkv ? lf_rkv_advance(*hs[0].since) : -1;
  const int k_left = rkv ? lf_rkv_k_left(since, n, B, p->rkv_stage) : 0;
  const int obs = lf_rkv_obs_of(p->rkv_obs);

  for (int g = 0; g < n_kv; g++) {
    lf_kv_head *h = &hs[g];
    /* 1. write the new token */
    write_slot(h, w, k_new + (size_t)g * D, v_new + (size_t)g * D, pos_new);
    *h->n = n;
    /* 2. exact softmax and output per query head of the group */
    decode_attend(p, h, n, q + (size_t)g * G * D, out + (size_t)g * G * D, &ws);
    /* 3. the policy's score. h2o accumulates mass since the slot was written, so the slot just
     * written starts from this step's mass alone. */
    if (p->policy == LF_POLICY_H2O || (rkv && k_left < obs)) {
      /* rkv: the observation window opens obs steps before the selection, or at the first step
       * after the last one when the stage is shorter */
      if (rkv && lf_rkv_window_reset(since, k_left, obs))
        for (int i = 0; i < n; i++)
          h->acc[i] = 0.0f;
      h->acc[w] = 0.0f;
      for (int i = 0; i < n; i++)
        h->acc[i] += (float)ws.mass[i];
    }
    if (rkv) {
      *h->since = since;
      continue;
    }
    for (int i = 0; i < n; i++) {
      switch (p->policy) {
      case LF_POLICY_H2O:
        total[i] += (double)h->acc[i];
        break;
      case LF_POLICY_STREAMING:
        total[i] += (double)h->pos[i];
        break;
      case LF_POLICY_LONGFLOW:
      case LF_POLICY_FULL: /* full never evicts; its score is longflow's, for analysis only */
      default:
        total[i] += (double)h->vnorm[i] * ws.mass[i];
        break;
      }
    }
  }
  if (rkv) {
    if (k_left <= 0) rkv_select(p, hs, n_kv, n, &ws, NULL);
    const int s = *hs[0].since;
    for (int g = 0; g < n_kv; g++)
      *hs[g].next = lf_rkv_next(hs[g].queue, s, p->rkv_stage);
    if (evicted) *evicted = was_full ? n_kv : 0;
    lf_attn_scratch_free(&local);
    return LF_OK;
  }
  if (scores)
    for (int i = 0; i < n; i++)
      scores[i] = (float)total[i];

  /* h2o never evicts its h2o_recent most recent slots: ranked by position among all filled
   * slots, the one just written included (it is excluded below anyway), i.e. those whose
   * recency key is >= the h2o_recent-th largest. In layer scope every head holds the same
   * positions in the same slots, so head 0's keys stand for all. */
  int64_t recent_from = INT64_MAX;
  if (p->policy == LF_POLICY_H2O && p->h2o_recent > 0)
    recent_from = p->h2o_recent >= n ? INT64_MIN : rth_largest_key(&hs[0], n, p->h2o_recent, ws.heap);

  /* 4. next = argmin over evictable slots, lowest index on ties (strict <). */
  int best = -1;
  if (policy_evicts(p->policy)) {
    for (int i = p->sink; i < n; i++) {
      if (i == w || recency_key(&hs[0], i) >= recent_from) continue;
      if (best < 0 || total[i] < total[best]) best = i;
    }
  }
  for (int g = 0; g < n_kv; g++)
    *hs[g].next = best;
  if (evicted) *evicted = was_full ? n_kv : 0;
  lf_attn_scratch_free(&local);
  return LF_OK;
}

lf_status lf_attn_decode_ref(const lf_attn_params *p, lf_kv_head *h, const float *q,
                             const float *k_new, const float *v_new, int32_t pos_new, float *out,
                             int *evicted, float *scores) {
  return decode_impl(p, h, 1, q, k_new, v_new, pos_new, out, evicted, scores, NULL,
                     "lf_attn_decode_ref");
}

lf_status lf_attn_decode_ref_ws(const lf_attn_params *p, lf_kv_head *h, const float *q,
                                const float *k_new, const float *v_new, int32_t pos_new,
                                float *out, int *evicted, float *scores, lf_attn_scratch *ws) {
  return decode_impl(p, h, 1, q, k_new, v_new, pos_new, out, evicted, scores, ws,
                     "lf_attn_decode_ref");
}

lf_status lf_attn_rkv_select_ref(const lf_attn_params *p, lf_kv_head *heads, int n_kv,
                                 double *slot_total) {
  if (!p || !heads || n_kv < 1)
    return lf_error(LF_ERR_INVALID_ARG, "lf_attn_rkv_select_ref: NULL argument or n_kv < 1");
  if (p->policy != LF_POLICY_RKV)
    return lf_error(LF_ERR_INVALID_ARG, "lf_attn_rkv_select_ref: policy is not rkv");
  LF_TRY(lf_attn_params_check(p, heads[0].budget));
  for (int g = 0; g < n_kv; g++) {
    LF_TRY(head_check(p, &heads[g], "lf_attn_rkv_select_ref"));
    if (*heads[g].n != *heads[0].n || heads[g].budget != heads[0].budget)
      return lf_error(LF_ERR_STATE, "lf_attn_rkv_select_ref: head %d disagrees with head 0", g);
  }
  const int n = *heads[0].n, B = heads[0].budget;
  if (n < p->sink + lf_rkv_obs_of(p->rkv_obs) + p->rkv_stage + 1)
    return lf_error(LF_ERR_INVALID_ARG,
                    "lf_attn_rkv_select_ref: %d filled slots leave fewer than rkv_stage %d "
                    "candidates outside the sink and the window",
                    n, p->rkv_stage);
  lf_attn_scratch sc = {0};
  LF_TRY(scratch_reserve(&sc, decode_ws_bytes(p, B), "lf_attn_rkv_select_ref"));
  const decode_ws ws = decode_ws_carve(p, B, sc.buf);
  rkv_select(p, heads, n_kv, n, &ws, slot_total);
  lf_attn_scratch_free(&sc);
  return LF_OK;
}

lf_status lf_attn_decode_layer_ref(const lf_attn_params *p, lf_kv_head *heads, int n_kv,
                                   const float *q, const float *k_new, const float *v_new,
                                   int32_t pos_new, float *out, int *evicted, float *scores,
                                   lf_attn_scratch *ws) {
  return decode_impl(p, heads, n_kv, q, k_new, v_new, pos_new, out, evicted, scores, ws,
                     "lf_attn_decode_layer_ref");
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

/* SnapKV selection for an empty pool (docs/DESIGN.md §3): keep[j] = 1 for the B-1 prompt positions
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

/* Prefill for the n_kv heads of one eviction scope (one head, or a layer's heads); see
 * lf_attn_prefill_layer_ref for the layout. */
static lf_status prefill_impl(const lf_attn_params *p, lf_kv_head *hs, int n_kv, int n_tok,
                              int32_t pos0, const float *q, size_t q_stride, const float *k,
                              const float *v, size_t kv_stride, float *out, size_t out_stride,
                              uint64_t *evictions, lf_attn_scratch *ws, const char *fn) {
  if (!hs) return lf_error(LF_ERR_INVALID_ARG, "%s: KV head is NULL", fn);
  if (n_kv < 1) return lf_error(LF_ERR_INVALID_ARG, "%s: n_kv %d < 1", fn, n_kv);
  LF_TRY(lf_attn_params_check(p, hs[0].budget));
  for (int g = 0; g < n_kv; g++) {
    LF_TRY(head_check(p, &hs[g], fn));
    if (g > 0 && (hs[g].budget != hs[0].budget || *hs[g].n != *hs[0].n))
      return lf_error(LF_ERR_STATE,
                      "%s: layer-scope heads disagree: head %d has budget %d, n %d; head 0 "
                      "budget %d, n %d",
                      fn, g, hs[g].budget, *hs[g].n, hs[0].budget, *hs[0].n);
  }
  const int B = hs[0].budget, D = p->head_dim, G = p->group;
  const size_t GD = (size_t)G * D;
  if (n_tok < 0 || n_tok > INT_MAX - B)
    return lf_error(LF_ERR_INVALID_ARG, "%s: n_tok %d out of range", fn, n_tok);
  if (n_tok == 0) return LF_OK;
  if (!q || !k || !v || !out) return lf_error(LF_ERR_INVALID_ARG, "%s: NULL q, k, v or out", fn);
  if (q_stride < (size_t)n_kv * GD || out_stride < (size_t)n_kv * GD ||
      kv_stride < (size_t)n_kv * D)
    return lf_error(LF_ERR_INVALID_ARG,
                    "%s: strides q %zu, kv %zu, out %zu are smaller than one token (%d heads x "
                    "group %d x head_dim %d)",
                    fn, q_stride, kv_stride, out_stride, n_kv, G, D);
  if ((int64_t)pos0 + n_tok - 1 > INT32_MAX)
    return lf_error(LF_ERR_INVALID_ARG, "%s: positions %d + %d out of range", fn, (int)pos0,
                    n_tok);

  const int n0 = *hs[0].n;
  const int evicts = policy_evicts(p->policy);
  if (!evicts && n0 + n_tok > B)
    return lf_error(LF_ERR_CONTEXT_FULL,
                    "full policy: %d filled + %d new tokens exceed the budget of %d slots", n0,
                    n_tok, B);

  /* Evicting policy, a non-empty pool and a chunk that does not leave a free slot: the chunk is
   * a run of ordinary decode steps, so eviction decisions stay per token. */
  lf_prefill_kind kind = lf_prefill_kind_of(p->policy, B, n0, n_tok);
  if (kind == LF_PREFILL_APPEND && p->prefill_budget > 0 && p->prefill_budget < B &&
      lf_prefill_kind_of(p->policy, p->prefill_budget, n0, n_tok) == LF_PREFILL_DECODE_STEPS)
    kind = LF_PREFILL_DECODE_STEPS;
  if (kind == LF_PREFILL_DECODE_STEPS) {
    for (int t = 0; t < n_tok; t++) {
      int ev = 0;
      LF_TRY(decode_impl(p, hs, n_kv, q + (size_t)t * q_stride, k + (size_t)t * kv_stride,
                         v + (size_t)t * kv_stride, pos0 + t, out + (size_t)t * out_stride, &ev,
                         NULL, ws, fn));
      if (evictions) *evictions += (uint64_t)ev;
    }
    return LF_OK;
  }

  /* From here the chunk is attended in one pass, then appended (fits) or compressed into an
   * empty pool. W_eff shrinks the observation window when the budget cannot hold it whole. */
  const int compress = kind == LF_PREFILL_COMPRESS;
  const int w_eff = lf_snapkv_window(p, B);
  const int snap_from = n_tok - w_eff; /* L: prompt positions scored by SnapKV */
  const int want_colsum = p->policy == LF_POLICY_H2O;

  const size_t n_keys = (size_t)n0 + (size_t)n_tok;
  double *logits = malloc((n_keys + (size_t)D) * sizeof(double));         /* [n0+n_tok] + o [D] */
  double *snap = compress ? calloc((size_t)n_tok, sizeof(double)) : NULL; /* [n_tok] */
  double *colsum = want_colsum ? calloc(n_keys * (size_t)n_kv, sizeof(double)) : NULL;
  ranked *rank = compress ? malloc((size_t)n_tok * sizeof(ranked)) : NULL; /* [n_tok] */
  unsigned char *keep = compress ? malloc((size_t)n_tok) : NULL;           /* [n_tok] */
  if (!logits || (compress && (!snap || !rank || !keep)) || (want_colsum && !colsum)) {
    free(logits);
    free(snap);
    free(colsum);
    free(rank);
    free(keep);
    return lf_error(LF_ERR_OUT_OF_MEMORY, "%s: scratch for %d tokens", fn, n_tok);
  }

  /* Every head attends; SnapKV scores add up over the heads (layer scope: one kept set), h2o's
   * column sums stay per head ([n_kv][n0+n_tok]). */
  for (int g = 0; g < n_kv; g++)
    prefill_attend(p, &hs[g], n0, n_tok, q + (size_t)g * GD, q_stride, k + (size_t)g * D,
                   v + (size_t)g * D, kv_stride, out + (size_t)g * GD, out_stride, snap,
                   compress ? snap_from : 0, want_colsum ? colsum + (size_t)g * n_keys : NULL,
                   logits, logits + n_keys);

  if (compress) snapkv_select(n_tok, B, p->sink, w_eff, snap, rank, keep);
  for (int g = 0; g < n_kv; g++) {
    lf_kv_head *h = &hs[g];
    const float *kg = k + (size_t)g * D, *vg = v + (size_t)g * D;
    const double *cs = want_colsum ? colsum + (size_t)g * n_keys : NULL;
    if (compress) {
      int slot = 0;
      for (int j = 0; j < n_tok; j++) {
        if (!keep[j]) continue;
        write_slot(h, slot, kg + (size_t)j * kv_stride, vg + (size_t)j * kv_stride, pos0 + j);
        if (cs) h->acc[slot] = (float)cs[j];
        slot++;
      }
      *h->n = slot; /* == B - 1 */
    } else {
      if (cs)
        for (int i = 0; i < n0; i++)
          h->acc[i] += (float)cs[i];
      for (int j = 0; j < n_tok; j++) {
        write_slot(h, n0 + j, kg + (size_t)j * kv_stride, vg + (size_t)j * kv_stride, pos0 + j);
        if (cs) h->acc[n0 + j] = (float)cs[n0 + j];
      }
      *h->n = n0 + n_tok;
    }
    /* n <= B - 1 for evicting policies, so the next token has a free slot and its decode step
     * chooses next; nothing to overwrite is decided yet. */
    *h->next = -1;
    if (p->policy == LF_POLICY_RKV) { /* no selection yet; the window counts decode steps */
      for (int i = 0; i < *h->n; i++)
        h->acc[i] = 0.0f;
      *h->since = -1;
    }
  }

  free(logits);
  free(snap);
  free(colsum);
  free(rank);
  free(keep);
  return LF_OK;
}

lf_status lf_attn_prefill_ref(const lf_attn_params *p, lf_kv_head *h, int n_tok, int32_t pos0,
                              const float *q, size_t q_stride, const float *k, const float *v,
                              size_t kv_stride, float *out, size_t out_stride,
                              uint64_t *evictions) {
  return prefill_impl(p, h, 1, n_tok, pos0, q, q_stride, k, v, kv_stride, out, out_stride,
                      evictions, NULL, "lf_attn_prefill_ref");
}

lf_status lf_attn_prefill_layer_ref(const lf_attn_params *p, lf_kv_head *heads, int n_kv,
                                    int n_tok, int32_t pos0, const float *q, size_t q_stride,
                                    const float *k, const float *v, size_t kv_stride, float *out,
                                    size_t out_stride, uint64_t *evictions,
                                    lf_attn_scratch *ws) {
  return prefill_impl(p, heads, n_kv, n_tok, pos0, q, q_stride, k, v, kv_stride, out,
                      out_stride, evictions, ws, "lf_attn_prefill_layer_ref");
}

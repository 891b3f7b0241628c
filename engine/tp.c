#include "tp.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"

/* ---- vocab-parallel token choice ------------------------------------------------------------ */

lf_status lf_tp_argmax(lf_comm_t comm, int n, const float *local_max, const int32_t *local_id,
                       int32_t *tok) {
  if (n <= 0) return LF_OK;
  const int T = comm->size;
  int32_t *send = malloc(sizeof(int32_t) * 2 * (size_t)n);         /* [n][value bits, id] */
  int32_t *recv = malloc(sizeof(int32_t) * 2 * (size_t)n * (size_t)T); /* [T][n][2] */
  if (!send || !recv) {
    free(send);
    free(recv);
    return lf_error(LF_ERR_OUT_OF_MEMORY, "rank %d: argmax gather of %d items", comm->rank, n);
  }
  for (int i = 0; i < n; i++) {
    memcpy(&send[2 * i], &local_max[i], 4);
    send[2 * i + 1] = local_id[i];
  }
  lf_status s = comm->allgather(comm, send, recv, 2 * (size_t)n, LF_COMM_I32, NULL);
  if (s == LF_OK) {
    for (int i = 0; i < n; i++) {
      float best;
      memcpy(&best, &recv[2 * i], 4);
      int32_t id = recv[2 * i + 1];
      for (int r = 1; r < T; r++) { /* strictly larger: ties keep the lower rank's lower id */
        float v;
        memcpy(&v, &recv[((size_t)r * n + i) * 2], 4);
        if (v > best) {
          best = v;
          id = recv[((size_t)r * n + i) * 2 + 1];
        }
      }
      tok[i] = id;
    }
  }
  free(send);
  free(recv);
  return s;
}

lf_status lf_tp_gather_logits(lf_comm_t comm, const lf_shard *sh, int vocab, int n,
                              const float *local, float *full) {
  if (n <= 0) return LF_OK;
  const int T = comm->size, mv = sh->max_vocab;
  const size_t per = (size_t)n * mv;
  float *send = calloc(per, sizeof(float));               /* [n][max_vocab], zero padded */
  float *recv = malloc(sizeof(float) * per * (size_t)T);  /* [T][n][max_vocab] */
  if (!send || !recv) {
    free(send);
    free(recv);
    return lf_error(LF_ERR_OUT_OF_MEMORY, "rank %d: logits gather of %d x %d", comm->rank, n,
                    vocab);
  }
  for (int i = 0; i < n; i++)
    memcpy(send + (size_t)i * mv, local + (size_t)i * sh->n_vocab, sizeof(float) * sh->n_vocab);
  lf_status s = comm->allgather(comm, send, recv, per, LF_COMM_F32, NULL);
  if (s == LF_OK)
    for (int r = 0; r < T; r++) {
      const int v0 = lf_shard_split(vocab, T, r), nv = lf_shard_split(vocab, T, r + 1) - v0;
      for (int i = 0; i < n; i++)
        memcpy(full + (size_t)i * vocab + v0, recv + (size_t)r * per + (size_t)i * mv,
               sizeof(float) * nv);
    }
  free(send);
  free(recv);
  return s;
}

/* (value, id) before (value', id') in top-k order: larger value first, lower id on ties. */
static int topk_before(float a, int32_t ia, float b, int32_t ib) {
  return a > b || (a == b && ia < ib);
}

/* The k best of v[0..nv) (ids id0 + j) into val/ids, best first: a bounded insertion (k is
 * small beside the slice). */
static int topk_select(const float *v, int nv, int32_t id0, int k, float *val, int32_t *ids) {
  int m = 0;
  for (int j = 0; j < nv; j++) {
    const float x = v[j];
    const int32_t id = id0 + j;
    if (m == k && !topk_before(x, id, val[m - 1], ids[m - 1])) continue;
    int p = m < k ? m++ : k - 1;
    while (p > 0 && topk_before(x, id, val[p - 1], ids[p - 1])) {
      val[p] = val[p - 1];
      ids[p] = ids[p - 1];
      p--;
    }
    val[p] = x;
    ids[p] = id;
  }
  return m;
}

lf_status lf_tp_topk_logits(lf_comm_t comm, const lf_shard *sh, int vocab, int n,
                            const int *top_k, const float *local, float *full) {
  if (n <= 0) return LF_OK;
  const int T = comm->size;
  int kmax = 0;
  for (int i = 0; i < n; i++) {
    if (top_k[i] < 1 || top_k[i] > LF_TP_TOPK_MAX)
      return lf_error(LF_ERR_INTERNAL, "lf_tp_topk_logits: top_k %d", top_k[i]);
    if (top_k[i] > kmax) kmax = top_k[i];
  }
  const size_t per = (size_t)n * (size_t)kmax * 2; /* int32 words per rank: [n][kmax][2] */
  int32_t *send = malloc(sizeof(int32_t) * per);
  int32_t *recv = malloc(sizeof(int32_t) * per * (size_t)T);
  float *val = malloc(sizeof(float) * (size_t)kmax);
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)kmax);
  if (!send || !recv || !val || !ids) {
    free(send);
    free(recv);
    free(val);
    free(ids);
    return lf_error(LF_ERR_OUT_OF_MEMORY, "rank %d: top-k gather of %d x %d", comm->rank, n, kmax);
  }
  for (int i = 0; i < n; i++) {
    const int m = topk_select(local + (size_t)i * sh->n_vocab, sh->n_vocab, sh->vocab0,
                              top_k[i], val, ids);
    int32_t *o = send + (size_t)i * kmax * 2;
    for (int j = 0; j < kmax; j++) {
      const float v = j < m ? val[j] : -INFINITY;
      memcpy(&o[2 * j], &v, 4);
      o[2 * j + 1] = j < m ? ids[j] : -1;
    }
  }
  lf_status s = comm->allgather(comm, send, recv, per, LF_COMM_I32, NULL);
  if (s == LF_OK)
    for (int i = 0; i < n; i++) {
      float *f = full + (size_t)i * vocab;
      for (int v = 0; v < vocab; v++) f[v] = -INFINITY;
      for (int r = 0; r < T; r++) {
        const int32_t *c = recv + (size_t)r * per + (size_t)i * kmax * 2;
        for (int j = 0; j < kmax; j++)
          if (c[2 * j + 1] >= 0 && c[2 * j + 1] < vocab) memcpy(&f[c[2 * j + 1]], &c[2 * j], 4);
      }
    }
  free(send);
  free(recv);
  free(val);
  free(ids);
  return s;
}

/* ---- the descriptor ------------------------------------------------------------------------- */

enum { TP_MAGIC = 0x4c465450 /* "LFTP" */, TP_OP_FORWARD = 1, TP_OP_STOP = 2 };
enum { H_MAGIC, H_OP, H_NOPS, H_NITEMS, H_NTOK, H_LOGITS, H_WORDS, H_COUNT = 8 };
#define TP_ITEM_WORDS 10

/* Grows buf to at least `need` words; `what` names it in the error. */
static lf_status grow_words(int32_t **buf, size_t *cap, size_t need, const char *what) {
  if (need <= *cap) return LF_OK;
  size_t c = *cap ? *cap : LF_TP_INLINE;
  while (c < need) c *= 2;
  int32_t *b = realloc(*buf, sizeof(int32_t) * c);
  if (!b) return lf_error(LF_ERR_OUT_OF_MEMORY, "%s of %zu words", what, need);
  *buf = b;
  *cap = c;
  return LF_OK;
}

typedef struct tp_lead {
  lf_backend base;
  lf_backend *inner;
  lf_comm_t comm;
  int32_t *ops; /* [n_ops] pool ops since the last forward: take p -> p + 1, give p -> -(p + 1) */
  int n_ops;
  size_t cap_ops;
  int32_t *msg; /* the descriptor being sent */
  size_t cap_msg;
  int failed;   /* a backend-wide failure: the followers are gone or out of step */
  int stopped;
} tp_lead;

static lf_status lead_note(tp_lead *t, int32_t op) {
  LF_TRY(grow_words(&t->ops, &t->cap_ops, (size_t)t->n_ops + 1, "pool op record"));
  t->ops[t->n_ops++] = op;
  return LF_OK;
}

/* Sends the descriptor in msg[0 .. words): the first LF_TP_INLINE words always, the rest only
 * when there is more. */
static lf_status desc_send(lf_comm_t comm, int32_t *msg, size_t words) {
  LF_TRY(comm->bcast(comm, msg, sizeof(int32_t) * LF_TP_INLINE, 0, NULL));
  if (words > LF_TP_INLINE)
    LF_TRY(comm->bcast(comm, msg + LF_TP_INLINE, sizeof(int32_t) * (words - LF_TP_INLINE), 0,
                       NULL));
  return LF_OK;
}

static lf_status lead_forward(lf_backend *b, const lf_batch_item *items, int n,
                              lf_batch_result *res, float *logits) {
  tp_lead *t = (tp_lead *)b;
  if (t->failed || t->stopped)
    return lf_error(LF_ERR_STATE, "tensor-parallel engine is %s", t->failed ? "failed" : "stopped");
  size_t ntok = 0;
  for (int i = 0; i < n; i++) ntok += (size_t)items[i].n_tok;
  const size_t words = H_COUNT + (size_t)t->n_ops + (size_t)TP_ITEM_WORDS * n + ntok;
  if (words > (size_t)INT32_MAX) return lf_error(LF_ERR_INVALID_ARG, "batch too large");
  LF_TRY(grow_words(&t->msg, &t->cap_msg, words > LF_TP_INLINE ? words : LF_TP_INLINE,
                    "batch descriptor"));
  int32_t *m = t->msg;
  m[H_MAGIC] = TP_MAGIC;
  m[H_OP] = TP_OP_FORWARD;
  m[H_NOPS] = t->n_ops;
  m[H_NITEMS] = n;
  m[H_NTOK] = (int32_t)ntok;
  m[H_LOGITS] = logits != NULL;
  m[H_WORDS] = (int32_t)words;
  m[H_COUNT - 1] = 0;
  int32_t *p = m + H_COUNT;
  memcpy(p, t->ops, sizeof(int32_t) * (size_t)t->n_ops);
  p += t->n_ops;
  for (int i = 0; i < n; i++, p += TP_ITEM_WORDS) {
    const lf_batch_item *it = &items[i];
    p[0] = it->pool;
    p[1] = it->pos0;
    p[2] = it->n_tok;
    memcpy(&p[3], &it->sampling.temperature, 4);
    p[4] = it->sampling.top_k;
    memcpy(&p[5], &it->sampling.top_p, 4);
    p[6] = (int32_t)(uint32_t)it->sampling.seed;
    p[7] = (int32_t)(uint32_t)(it->sampling.seed >> 32);
    memcpy(&p[8], &it->u, 4);
    p[9] = it->full_logits != 0; /* the collectives an item takes depend on it */
  }
  for (int i = 0; i < n; i++) {
    memcpy(p, items[i].tokens, sizeof(int32_t) * (size_t)items[i].n_tok);
    p += items[i].n_tok;
  }
  lf_status s = desc_send(t->comm, m, words);
  if (s == LF_OK) {
    t->n_ops = 0;
    s = t->inner->forward(t->inner, items, n, res, logits);
  }
  if (s != LF_OK) t->failed = 1;
  return s;
}

static lf_status lead_pool_take(lf_backend *b, int *pool) {
  tp_lead *t = (tp_lead *)b;
  LF_TRY(t->inner->pool_take(t->inner, pool));
  lf_status s = lead_note(t, *pool + 1);
  if (s != LF_OK) t->inner->pool_give(t->inner, *pool);
  return s;
}

static lf_status lead_pool_give(lf_backend *b, int pool) {
  tp_lead *t = (tp_lead *)b;
  LF_TRY(t->inner->pool_give(t->inner, pool));
  lf_status s = lead_note(t, -(pool + 1));
  if (s != LF_OK) t->failed = 1; /* the followers can no longer replay this */
  return s;
}

static int lead_pools_free(lf_backend *b) {
  tp_lead *t = (tp_lead *)b;
  return t->inner->pools_free(t->inner);
}

static int lead_pool_slots_filled(lf_backend *b, int pool) {
  tp_lead *t = (tp_lead *)b;
  return t->inner->pool_slots_filled(t->inner, pool);
}

lf_status lf_backend_tp_stop(lf_backend *b) {
  tp_lead *t = (tp_lead *)b;
  if (!t || t->stopped) return LF_OK;
  t->stopped = 1;
  if (t->failed) return LF_OK; /* the job is going down anyway; a bcast could block */
  LF_TRY(grow_words(&t->msg, &t->cap_msg, LF_TP_INLINE, "batch descriptor"));
  memset(t->msg, 0, sizeof(int32_t) * LF_TP_INLINE);
  t->msg[H_MAGIC] = TP_MAGIC;
  t->msg[H_OP] = TP_OP_STOP;
  t->msg[H_WORDS] = H_COUNT;
  return desc_send(t->comm, t->msg, H_COUNT);
}

static void lead_free(lf_backend *b) {
  tp_lead *t = (tp_lead *)b;
  if (!t) return;
  lf_backend_tp_stop(b);
  if (t->inner) t->inner->free(t->inner);
  free(t->ops);
  free(t->msg);
  free(t);
}

lf_status lf_backend_tp_lead(lf_backend *inner, lf_comm_t comm, lf_backend **out) {
  if (!inner || !comm || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_backend_tp_lead: NULL");
  if (comm->rank != 0)
    return lf_error(LF_ERR_INVALID_ARG, "rank %d cannot lead (rank 0 decides)", comm->rank);
  tp_lead *t = calloc(1, sizeof *t);
  if (!t) return lf_error(LF_ERR_OUT_OF_MEMORY, "tensor-parallel backend");
  t->base = (lf_backend){.name = inner->name, .forward = lead_forward, .pool_take = lead_pool_take,
                         .pool_give = lead_pool_give, .pools_free = lead_pools_free,
                         .pool_slots_filled = lead_pool_slots_filled, .free = lead_free,
                         .max_compress_tokens = inner->max_compress_tokens};
  t->inner = inner;
  t->comm = comm;
  *out = &t->base;
  return LF_OK;
}

/* ---- followers -------------------------------------------------------------------------- */

typedef struct tp_follower {
  int32_t *msg;
  size_t cap_msg;
  lf_batch_item *items;
  lf_batch_result *res;
  int cap_items;
  float *logits; /* [cap_items][vocab] when rank 0 wants logits */
  int cap_logits;
} tp_follower;

static void follower_free(tp_follower *f) {
  free(f->msg);
  free(f->items);
  free(f->res);
  free(f->logits);
}

static lf_status follow_one(tp_follower *f, lf_backend *be, lf_comm_t comm, int vocab, int *stop) {
  LF_TRY(grow_words(&f->msg, &f->cap_msg, LF_TP_INLINE, "batch descriptor"));
  LF_TRY(comm->bcast(comm, f->msg, sizeof(int32_t) * LF_TP_INLINE, 0, NULL));
  int32_t *m = f->msg;
  if (m[H_MAGIC] != TP_MAGIC || m[H_WORDS] < H_COUNT)
    return lf_error(LF_ERR_INTERNAL, "rank %d: bad batch descriptor from rank 0", comm->rank);
  if (m[H_OP] == TP_OP_STOP) {
    *stop = 1;
    return LF_OK;
  }
  const size_t words = (size_t)m[H_WORDS];
  if (words > LF_TP_INLINE) {
    LF_TRY(grow_words(&f->msg, &f->cap_msg, words, "batch descriptor"));
    m = f->msg;
    LF_TRY(comm->bcast(comm, m + LF_TP_INLINE, sizeof(int32_t) * (words - LF_TP_INLINE), 0,
                       NULL));
  }
  const int n_ops = m[H_NOPS], n = m[H_NITEMS];
  if (n_ops < 0 || n < 0 ||
      (size_t)H_COUNT + n_ops + (size_t)TP_ITEM_WORDS * n + (size_t)m[H_NTOK] != words)
    return lf_error(LF_ERR_INTERNAL, "rank %d: inconsistent batch descriptor", comm->rank);
  const int32_t *p = m + H_COUNT;
  for (int i = 0; i < n_ops; i++) {
    if (p[i] > 0) {
      int pool = -1;
      LF_TRY(be->pool_take(be, &pool));
      if (pool != p[i] - 1)
        return lf_error(LF_ERR_INTERNAL, "rank %d took pool %d where rank 0 took %d", comm->rank,
                        pool, p[i] - 1);
    } else {
      LF_TRY(be->pool_give(be, -p[i] - 1));
    }
  }
  p += n_ops;
  if (n > f->cap_items) {
    lf_batch_item *it = realloc(f->items, sizeof *it * (size_t)n);
    if (it) f->items = it;
    lf_batch_result *r = realloc(f->res, sizeof *r * (size_t)n);
    if (r) f->res = r;
    if (!it || !r) return lf_error(LF_ERR_OUT_OF_MEMORY, "rank %d: %d items", comm->rank, n);
    f->cap_items = n;
  }
  const int32_t *tok = p + (size_t)TP_ITEM_WORDS * n;
  for (int i = 0; i < n; i++, p += TP_ITEM_WORDS) {
    lf_batch_item *it = &f->items[i];
    memset(it, 0, sizeof *it);
    it->pool = p[0];
    it->pos0 = p[1];
    it->n_tok = p[2];
    memcpy(&it->sampling.temperature, &p[3], 4);
    it->sampling.top_k = p[4];
    memcpy(&it->sampling.top_p, &p[5], 4);
    it->sampling.seed = (uint64_t)(uint32_t)p[6] | (uint64_t)(uint32_t)p[7] << 32;
    memcpy(&it->u, &p[8], 4);
    it->full_logits = p[9];
    it->tokens = tok;
    tok += it->n_tok;
  }
  float *logits = NULL;
  if (m[H_LOGITS]) {
    if (n > f->cap_logits) {
      float *l = realloc(f->logits, sizeof(float) * (size_t)n * (size_t)vocab);
      if (!l) return lf_error(LF_ERR_OUT_OF_MEMORY, "rank %d: logits", comm->rank);
      f->logits = l;
      f->cap_logits = n;
    }
    logits = f->logits;
  }
  return n > 0 ? be->forward(be, f->items, n, f->res, logits) : LF_OK;
}

lf_status lf_backend_tp_follow(lf_backend *be, lf_comm_t comm, int vocab) {
  if (!be || !comm) return lf_error(LF_ERR_INVALID_ARG, "lf_backend_tp_follow: NULL");
  if (comm->rank == 0) return lf_error(LF_ERR_STATE, "rank 0 leads; it does not follow");
  tp_follower f;
  memset(&f, 0, sizeof f);
  lf_status s = LF_OK;
  for (int stop = 0; s == LF_OK && !stop;)
    s = follow_one(&f, be, comm, vocab, &stop);
  follower_free(&f);
  return s;
}

/* Continuous batching: queue, admission, one batch per step, finishing. See scheduler/README.md
 * for the invariants this file keeps.
 *
 * Locking: one mutex guards everything below except what only the stepping thread touches
 * while it is outside the lock (the batch scratch and the token arrays of running requests,
 * which no other thread reads). Every field another thread may read (queue, running list,
 * counters, request progress, events, finished records) changes only under the lock. The
 * forward pass runs without the lock, so submit/cancel/metrics never wait for the model.
 */
#include "scheduler/scheduler.h"

#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/error.h"
#include "engine/sample.h"

/* One position's log-probabilities (lf_sampling.logprobs). */
typedef struct lp_entry {
  float lp;
  int n_top;
  int32_t ids[LF_MAX_TOP_LOGPROBS];
  float lps[LF_MAX_TOP_LOGPROBS];
} lp_entry;

typedef struct lf_sreq lf_sreq;
struct lf_sreq {
  uint64_t id;
  lf_sreq *prev, *next; /* waiting list links */
  int32_t *tokens;      /* [n_prompt + max_tokens] prompt, then generated ids that were kept (teacher
                           forcing: the forced ids, all written at submit) */
  int n_prompt;
  int n_prefilled; /* prompt tokens already run through the model */
  int n_gen;       /* generated ids kept in tokens (excludes a final EOS / stop id) */
  int n_sampled;   /* tokens the model sampled (includes a final EOS / stop id) */
  int n_out;       /* generated ids emitted as TOKEN events (n_gen - n_out are held back) */
  int max_tokens;
  lf_sampling sp;
  lf_rng rng;
  int ignore_eos;
  int32_t *stop_ids; /* [n_stop_ids] */
  int n_stop_ids;
  int forced;       /* teacher forcing: tokens already holds the ids fed back after the prompt */
  int32_t *seq_ids; /* all stop sequences back to back */
  int *seq_off;     /* [n_seqs + 1] offsets into seq_ids */
  int n_seqs;
  int pool;      /* -1 while waiting */
  int cancelled; /* set by cancel while running; acted on at the next step */
  int done;      /* finished this step; removed from running at the end of it */
  int chunks;
  uint64_t evictions;
  double t_submit, t_admit, t_first, t_last;
  /* Logit processing (lf_logits_adjust): the bias entries, then one per distinct token of the
   * prompt (repetition penalty on) and of the output; NULL when the request has none. adj_of:
   * an open-addressing table of entry indices (-1 empty), [adj_mask + 1] at least twice the
   * entries' capacity, so a request's memory follows its own size, not the vocabulary's.
   * n_counted: output tokens already folded in. */
  lf_logit_adj *adj;
  int n_adj;
  int *adj_of;
  uint32_t adj_mask;
  int *adj_cnt; /* [entries] occurrences in the output */
  int n_counted;
  lp_entry *lp; /* [max_tokens] the generated ids' logprobs (lf_sampling.logprobs), else NULL */
};

#define FINISHED_KEEP 4096
#define RATE_RING 1024
#define RATE_WINDOW_S 10.0

typedef struct lat_hist {
  double win[LF_METRICS_WINDOW]; /* ring of the most recent samples */
  int win_next, win_len;
  uint64_t count;
  double sum;
  uint64_t buckets[LF_LATENCY_BUCKETS];
} lat_hist;

struct lf_sched {
  lf_sched_config cfg;
  lf_backend *be;
  int pools_total;

  pthread_mutex_t mu;
  int stepping;
  uint64_t next_id;
  lf_sreq *wait_head, *wait_tail; /* FIFO, oldest first */
  int n_waiting;
  lf_sreq **running; /* [pools_total] in admission order */
  int n_running;

  /* step scratch, [pools_total] each: at most one item per running request */
  lf_batch_item *items;
  lf_batch_result *res;
  lf_sreq **item_req;
  /* logprobs scratch, [pools_total] each: the raw last-position logits rows ([vocab] each,
   * allocated at the first request that wants logprobs), each item's sampled token's entry,
   * and a prompt chunk's per-position entries and logits (prompt_logprobs, per step) */
  float *lrows;
  lp_entry *item_lp;
  lp_entry **item_plp;
  int *item_oom;

  /* Pending events, a growing ring. Work that ends in events first reserves room for them
   * (ev_reserved counts reservations not yet released, an upper bound of the pushes still to
   * come), so a push never allocates and never fails once the work it reports is done. */
  lf_event *ev;
  int ev_head, ev_len, ev_cap, ev_reserved;

  lf_request_stats fin[FINISHED_KEEP]; /* ring of the most recent finished requests */
  uint64_t fin_id[FINISHED_KEEP];
  int fin_next, fin_len;

  /* metrics */
  uint64_t tokens_generated, prompt_tokens, evictions, steps, submitted, rejected;
  uint64_t finished[LF_FINISH_COUNT];
  double step_seconds;
  double t_init;
  double rate_t[RATE_RING]; /* end time of recent steps that sampled tokens */
  int rate_n[RATE_RING];    /* tokens they sampled */
  int rate_next, rate_len;
  lat_hist ttft, tpot;
};

static const double lat_bounds[LF_LATENCY_BUCKETS] = {0.001, 0.002, 0.005, 0.01, 0.02, 0.05,    0.1,
                                                      0.2,   0.5,   1,     2,    5,    10,      20,
                                                      50,    100,   200,   500,  1000, INFINITY};

const double *lf_latency_bucket_bounds(void) {
  return lat_bounds;
}

/* ---- requests ------------------------------------------------------------------------------ */

static void req_free(lf_sreq *r) {
  if (!r) return;
  free(r->tokens);
  free(r->stop_ids);
  free(r->seq_ids);
  free(r->seq_off);
  free(r->adj);
  free(r->adj_of);
  free(r->adj_cnt);
  free(r->lp);
  free(r);
}

/* r's entry for token t, created (zeroed) when absent. */
static lf_logit_adj *adj_entry(lf_sreq *r, int32_t t) {
  uint32_t i = ((uint32_t)t * 2654435761u) & r->adj_mask;
  while (r->adj_of[i] >= 0) {
    if (r->adj[r->adj_of[i]].token == t) return &r->adj[r->adj_of[i]];
    i = (i + 1) & r->adj_mask;
  }
  r->adj_of[i] = r->n_adj;
  r->adj[r->n_adj] = (lf_logit_adj){.token = t};
  return &r->adj[r->n_adj++];
}

static void wait_push(lf_sched *s, lf_sreq *r) {
  r->next = NULL;
  r->prev = s->wait_tail;
  if (s->wait_tail)
    s->wait_tail->next = r;
  else
    s->wait_head = r;
  s->wait_tail = r;
  s->n_waiting++;
}

static void wait_remove(lf_sched *s, lf_sreq *r) {
  if (r->prev)
    r->prev->next = r->next;
  else
    s->wait_head = r->next;
  if (r->next)
    r->next->prev = r->prev;
  else
    s->wait_tail = r->prev;
  r->prev = r->next = NULL;
  s->n_waiting--;
}

/* ---- events -------------------------------------------------------------------------------- */

/* Promises room for k more events until ev_release(k); grows the ring. Fails only when out of
 * memory, before anything changed. */
static lf_status ev_reserve(lf_sched *s, int k) {
  const int need = s->ev_len + s->ev_reserved + k;
  if (need > s->ev_cap) {
    int cap = s->ev_cap ? s->ev_cap : 64;
    while (cap < need) {
      if (cap > INT_MAX / 2) return lf_error(LF_ERR_OUT_OF_MEMORY, "event queue");
      cap *= 2;
    }
    lf_event *n = malloc(sizeof(lf_event) * (size_t)cap);
    if (!n) return lf_error(LF_ERR_OUT_OF_MEMORY, "event queue of %d events", cap);
    for (int i = 0; i < s->ev_len; i++)
      n[i] = s->ev[(s->ev_head + i) % s->ev_cap];
    free(s->ev);
    s->ev = n;
    s->ev_head = 0;
    s->ev_cap = cap;
  }
  s->ev_reserved += k;
  return LF_OK;
}

static void ev_release(lf_sched *s, int k) {
  s->ev_reserved -= k;
}

/* Appends an event into reserved room. */
static void ev_push(lf_sched *s, const lf_event *ev) {
  s->ev[(s->ev_head + s->ev_len) % s->ev_cap] = *ev;
  s->ev_len++;
}

static void ev_drain(lf_sched *s, lf_event *events, int cap, int *n) {
  int k = 0;
  while (k < cap && s->ev_len > 0) {
    events[k++] = s->ev[s->ev_head];
    s->ev_head = (s->ev_head + 1) % s->ev_cap;
    s->ev_len--;
  }
  *n = k;
}

/* Events a request may produce when it finishes now: held-back tokens + FINISH. */
static int finish_events(const lf_sreq *r) {
  return r->n_gen - r->n_out + 1;
}

/* Emits TOKEN events for generated ids [n_out, upto). Reserved by the caller. */
static void ev_set_lp(lf_event *e, const lp_entry *l) {
  e->logprob = l->lp;
  e->n_top = l->n_top;
  memcpy(e->top_ids, l->ids, sizeof(int32_t) * (size_t)l->n_top);
  memcpy(e->top_logprobs, l->lps, sizeof(float) * (size_t)l->n_top);
}

static void emit_tokens(lf_sched *s, lf_sreq *r, int upto) {
  for (; r->n_out < upto; r->n_out++) {
    lf_event te = {.id = r->id, .type = LF_EVENT_TOKEN, .token = r->tokens[r->n_prompt + r->n_out]};
    if (r->lp) ev_set_lp(&te, &r->lp[r->n_out]);
    ev_push(s, &te);
  }
}

/* ---- stats --------------------------------------------------------------------------------- */

static void lat_add(lat_hist *h, double v) {
  h->win[h->win_next] = v;
  h->win_next = (h->win_next + 1) % LF_METRICS_WINDOW;
  if (h->win_len < LF_METRICS_WINDOW) h->win_len++;
  h->count++;
  h->sum += v;
  int b = 0;
  while (b < LF_LATENCY_BUCKETS - 1 && !(v <= lat_bounds[b]))
    b++;
  h->buckets[b]++;
}

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static void lat_summary(const lat_hist *h, lf_latency_summary *o) {
  memset(o, 0, sizeof *o);
  o->count = h->count;
  o->sum = h->sum;
  memcpy(o->buckets, h->buckets, sizeof o->buckets);
  o->n_window = h->win_len;
  if (h->win_len == 0) return;
  double v[LF_METRICS_WINDOW];
  memcpy(v, h->win, sizeof(double) * (size_t)h->win_len);
  qsort(v, (size_t)h->win_len, sizeof(double), cmp_double);
  double sum = 0;
  for (int i = 0; i < h->win_len; i++)
    sum += v[i];
  const int n = h->win_len;
  /* nearest rank: the smallest value with at least p% of the samples at or below it */
  o->p50 = v[(int)ceil(0.50 * n) - 1];
  o->p90 = v[(int)ceil(0.90 * n) - 1];
  o->p99 = v[(int)ceil(0.99 * n) - 1];
  o->mean = sum / n;
  o->max = v[n - 1];
}

static void req_stats(const lf_sreq *r, double now, lf_request_stats *st) {
  memset(st, 0, sizeof *st);
  st->prompt_tokens = r->n_prompt;
  st->generated_tokens = r->n_sampled;
  st->evictions = r->evictions;
  st->output_tokens = r->n_out;
  st->prefill_chunks = r->chunks;
  st->reason = LF_FINISH_NONE;
  st->status = LF_OK;
  st->queue_seconds = (r->pool >= 0 ? r->t_admit : now) - r->t_submit;
  st->ttft_seconds = r->n_sampled > 0 ? r->t_first - r->t_submit : 0.0;
  st->tpot_seconds = r->n_sampled > 1 ? (r->t_last - r->t_first) / (r->n_sampled - 1) : 0.0;
  st->total_seconds = now - r->t_submit;
}

/* With the lock held and k = finish_events(r) reserved: emits the held-back tokens (all of them
 * unless a stop sequence matched: then up to `upto`), records stats, returns the pool and emits
 * FINISH. The caller removes r from wherever it is listed and frees it. */
static void finish(lf_sched *s, lf_sreq *r, lf_finish_reason why, lf_status st, int32_t last,
                   int upto, double now) {
  emit_tokens(s, r, why == LF_FINISH_STOP_SEQUENCE ? upto : r->n_gen);
  lf_request_stats *f = &s->fin[s->fin_next];
  req_stats(r, now, f);
  f->reason = why;
  f->status = st;
  if (r->pool >= 0) {
    f->slots_filled = s->be->pool_slots_filled(s->be, r->pool);
    /* give fails only for a pool that is not taken: a bug, and nothing to undo here */
    (void)s->be->pool_give(s->be, r->pool);
    r->pool = -1;
  }
  s->fin_id[s->fin_next] = r->id;
  s->fin_next = (s->fin_next + 1) % FINISHED_KEEP;
  if (s->fin_len < FINISHED_KEEP) s->fin_len++;
  if (r->n_sampled > 0) lat_add(&s->ttft, f->ttft_seconds);
  if (r->n_sampled > 1) lat_add(&s->tpot, f->tpot_seconds);
  s->finished[why]++;
  lf_event ev = {.id = r->id, .type = LF_EVENT_FINISH, .token = last, .reason = why, .status = st};
  ev_push(s, &ev);
  r->done = 1;
}

/* ---- init / free --------------------------------------------------------------------------- */

lf_status lf_sched_init(const lf_sched_config *cfg, lf_backend *be, lf_sched **out) {
  if (!cfg || !be || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_sched_init: NULL argument");
  *out = NULL;
  if (cfg->max_batch_tokens < 0 || cfg->max_queue < 0 || cfg->budget < 1 || cfg->max_seq_len < 1 ||
      cfg->vocab_size < 1 || cfg->n_eos < 0 || cfg->n_eos > 8)
    return lf_error(LF_ERR_INVALID_ARG,
                    "scheduler: max_batch_tokens %d and max_queue %d must be >= 0, budget %d and "
                    "max_seq_len %d >= 1",
                    cfg->max_batch_tokens, cfg->max_queue, cfg->budget, cfg->max_seq_len);
  const int pools = be->pools_free(be);
  if (pools < 1) return lf_error(LF_ERR_INVALID_ARG, "scheduler: the backend has no free pool");
  lf_sched *s = calloc(1, sizeof *s);
  if (!s) return lf_error(LF_ERR_OUT_OF_MEMORY, "scheduler");
  s->cfg = *cfg;
  s->be = be;
  s->pools_total = pools;
  s->next_id = 1;
  s->t_init = lf_now_s();
  s->running = calloc((size_t)pools, sizeof *s->running);
  s->items = calloc((size_t)pools, sizeof *s->items);
  s->res = calloc((size_t)pools, sizeof *s->res);
  s->item_req = calloc((size_t)pools, sizeof *s->item_req);
  s->item_lp = calloc((size_t)pools, sizeof *s->item_lp);
  s->item_plp = calloc((size_t)pools, sizeof *s->item_plp);
  s->item_oom = calloc((size_t)pools, sizeof *s->item_oom);
  if (!s->running || !s->items || !s->res || !s->item_req || !s->item_lp || !s->item_plp ||
      !s->item_oom || ev_reserve(s, 64) != LF_OK) {
    free(s->running);
    free(s->items);
    free(s->res);
    free(s->item_req);
    free(s->item_lp);
    free(s->item_plp);
    free(s->item_oom);
    free(s->ev);
    free(s);
    return lf_error(LF_ERR_OUT_OF_MEMORY, "scheduler for %d pools", pools);
  }
  s->ev_reserved = 0;
  pthread_mutex_init(&s->mu, NULL);
  *out = s;
  return LF_OK;
}

void lf_sched_free(lf_sched *s) {
  if (!s) return;
  while (s->wait_head) {
    lf_sreq *r = s->wait_head;
    wait_remove(s, r);
    req_free(r);
  }
  for (int i = 0; i < s->n_running; i++) {
    if (s->running[i]->pool >= 0) (void)s->be->pool_give(s->be, s->running[i]->pool);
    req_free(s->running[i]);
  }
  free(s->running);
  free(s->items);
  free(s->res);
  free(s->item_req);
  free(s->item_lp);
  free(s->item_plp);
  free(s->item_oom);
  free(s->lrows);
  free(s->ev);
  pthread_mutex_destroy(&s->mu);
  free(s);
}

/* ---- submit / cancel ----------------------------------------------------------------------- */

/* lf_sched_submit's checks of a request against the engine (c); *seq_total gets the stop
 * sequences' total length. */
static lf_status submit_check(const lf_sched_config *c, const lf_request *rq, int *seq_total_out) {
  if (rq->n_prompt < 1 || !rq->prompt) return lf_error(LF_ERR_INVALID_ARG, "empty prompt");
  if (rq->max_tokens < 1)
    return lf_error(LF_ERR_INVALID_ARG, "max_tokens %d must be >= 1", rq->max_tokens);
  if (rq->n_prompt > c->max_seq_len)
    return lf_error(LF_ERR_INVALID_ARG, "prompt of %d tokens exceeds the model's context %d",
                    rq->n_prompt, c->max_seq_len);
  for (int i = 0; i < rq->n_prompt; i++)
    if (rq->prompt[i] < 0 || rq->prompt[i] >= c->vocab_size)
      return lf_error(LF_ERR_INVALID_ARG, "prompt token %d at index %d is outside [0, %d)",
                      rq->prompt[i], i, c->vocab_size);
  if (rq->n_stop_ids < 0 || (rq->n_stop_ids > 0 && !rq->stop_ids))
    return lf_error(LF_ERR_INVALID_ARG, "bad stop id list");
  if (rq->n_stop_seqs < 0 || (rq->n_stop_seqs > 0 && !rq->stop_seqs))
    return lf_error(LF_ERR_INVALID_ARG, "bad stop sequence list");
  int seq_total = 0;
  for (int i = 0; i < rq->n_stop_seqs; i++) {
    if (rq->stop_seqs[i].n_ids < 1 || !rq->stop_seqs[i].ids ||
        rq->stop_seqs[i].n_ids > INT_MAX / 2 - seq_total)
      return lf_error(LF_ERR_INVALID_ARG, "stop sequence %d is empty or too long", i);
    seq_total += rq->stop_seqs[i].n_ids;
  }
  if (rq->n_forced < 0 || (rq->n_forced > 0 && !rq->forced))
    return lf_error(LF_ERR_INVALID_ARG, "bad forced token list");
  if (rq->n_forced > 0 && (rq->n_stop_ids > 0 || rq->n_stop_seqs > 0))
    return lf_error(LF_ERR_INVALID_ARG, "teacher forcing takes no stop ids or sequences");
  for (int i = 0; i < rq->n_forced; i++)
    if (rq->forced[i] < 0 || rq->forced[i] >= c->vocab_size)
      return lf_error(LF_ERR_INVALID_ARG, "forced token %d at index %d is outside [0, %d)",
                      rq->forced[i], i, c->vocab_size);
  if (!(rq->sampling.temperature >= 0.0f) || rq->sampling.top_k < 0 ||
      !(rq->sampling.top_p >= 0.0f && rq->sampling.top_p <= 1.0f))
    return lf_error(LF_ERR_INVALID_ARG, "sampling: temperature >= 0, top_k >= 0, 0 <= top_p <= 1");
  const lf_sampling *sp = &rq->sampling;
  if (!isfinite(sp->presence_penalty) || !isfinite(sp->frequency_penalty) ||
      !(sp->repetition_penalty >= 0.0f && isfinite(sp->repetition_penalty)))
    return lf_error(LF_ERR_INVALID_ARG,
                    "sampling: presence_penalty %g and frequency_penalty %g must be finite, "
                    "repetition_penalty %g > 0 (0: off)",
                    (double)sp->presence_penalty, (double)sp->frequency_penalty,
                    (double)sp->repetition_penalty);
  if (sp->n_logit_bias < 0 || (sp->n_logit_bias > 0 && !sp->logit_bias))
    return lf_error(LF_ERR_INVALID_ARG, "bad logit_bias list");
  for (int i = 0; i < sp->n_logit_bias; i++) {
    const lf_logit_bias *b = &sp->logit_bias[i];
    if (b->token < 0 || b->token >= c->vocab_size)
      return lf_error(LF_ERR_INVALID_ARG, "logit_bias token %d is outside [0, %d)", b->token,
                      c->vocab_size);
    if (!(b->bias >= -LF_LOGIT_BIAS_MAX && b->bias <= LF_LOGIT_BIAS_MAX))
      return lf_error(LF_ERR_INVALID_ARG, "logit_bias of token %d is %g; it must lie in [-%g, %g]",
                      b->token, (double)b->bias, (double)LF_LOGIT_BIAS_MAX,
                      (double)LF_LOGIT_BIAS_MAX);
  }
  if (sp->logprobs < 0 || sp->logprobs > 1 || sp->prompt_logprobs < 0 || sp->prompt_logprobs > 1 ||
      sp->top_logprobs < 0 || sp->top_logprobs > LF_MAX_TOP_LOGPROBS)
    return lf_error(LF_ERR_INVALID_ARG,
                    "sampling: logprobs and prompt_logprobs are 0 or 1, top_logprobs in [0, %d]",
                    LF_MAX_TOP_LOGPROBS);
  *seq_total_out = seq_total;
  return LF_OK;
}

/* The scheduler's copy of a checked request: token buffer (prompt, then the output or the forced
 * tokens), stop lists, the logit-adjustment table (logit_bias, and the tokens seen when a
 * penalty needs them), logprob slots. */
static lf_status req_build(const lf_sched_config *c, const lf_request *rq, int seq_total,
                           lf_sreq **out) {
  const lf_sampling *sp = &rq->sampling;
  const float rep_pen = sp->repetition_penalty;
  const int track_prompt = rep_pen > 0.0f && rep_pen != 1.0f;
  const int track_out =
      track_prompt || sp->presence_penalty != 0.0f || sp->frequency_penalty != 0.0f;
  /* Generation never passes the model's context: the last generated token occupies position
   * max_seq_len and is never fed back (as in llama2.c). */
  int max_tokens = rq->max_tokens;
  if (max_tokens > c->max_seq_len - rq->n_prompt + 1)
    max_tokens = c->max_seq_len - rq->n_prompt + 1;
  if (rq->n_forced > 0 && max_tokens > rq->n_forced) max_tokens = rq->n_forced;

  lf_sreq *r = calloc(1, sizeof *r);
  if (!r) return lf_error(LF_ERR_OUT_OF_MEMORY, "request");
  r->tokens = malloc(sizeof(int32_t) * (size_t)(rq->n_prompt + max_tokens));
  r->stop_ids = rq->n_stop_ids ? malloc(sizeof(int32_t) * (size_t)rq->n_stop_ids) : NULL;
  r->seq_ids = seq_total ? malloc(sizeof(int32_t) * (size_t)seq_total) : NULL;
  r->seq_off = rq->n_stop_seqs ? malloc(sizeof(int) * (size_t)(rq->n_stop_seqs + 1)) : NULL;
  const int processed = track_out || sp->n_logit_bias > 0;
  const size_t cap_adj = processed ? (size_t)sp->n_logit_bias +
                                         (track_prompt ? (size_t)rq->n_prompt : 0) +
                                         (track_out ? (size_t)max_tokens : 0)
                                   : 0;
  size_t table = 16;
  while (table < 2 * cap_adj) table *= 2;
  if (processed) {
    r->adj = malloc(sizeof *r->adj * cap_adj);
    r->adj_of = malloc(sizeof(int) * table);
    r->adj_cnt = calloc(cap_adj, sizeof(int));
    r->adj_mask = (uint32_t)(table - 1);
  }
  if (sp->logprobs) r->lp = calloc((size_t)max_tokens, sizeof *r->lp);
  if (!r->tokens || (rq->n_stop_ids && !r->stop_ids) || (seq_total && !r->seq_ids) ||
      (rq->n_stop_seqs && !r->seq_off) || (processed && (!r->adj || !r->adj_of || !r->adj_cnt)) ||
      (sp->logprobs && !r->lp)) {
    req_free(r);
    return lf_error(LF_ERR_OUT_OF_MEMORY, "request");
  }
  memcpy(r->tokens, rq->prompt, sizeof(int32_t) * (size_t)rq->n_prompt);
  r->forced = rq->n_forced > 0;
  if (r->forced) memcpy(r->tokens + rq->n_prompt, rq->forced, sizeof(int32_t) * (size_t)max_tokens);
  if (rq->n_stop_ids) memcpy(r->stop_ids, rq->stop_ids, sizeof(int32_t) * (size_t)rq->n_stop_ids);
  r->n_stop_ids = rq->n_stop_ids;
  int off = 0;
  for (int i = 0; i < rq->n_stop_seqs; i++) {
    r->seq_off[i] = off;
    memcpy(r->seq_ids + off, rq->stop_seqs[i].ids,
           sizeof(int32_t) * (size_t)rq->stop_seqs[i].n_ids);
    off += rq->stop_seqs[i].n_ids;
  }
  if (r->seq_off) r->seq_off[rq->n_stop_seqs] = off;
  r->n_seqs = rq->n_stop_seqs;
  r->n_prompt = rq->n_prompt;
  r->max_tokens = max_tokens;
  r->sp = rq->sampling;
  r->sp.logit_bias = NULL; /* copied into adj */
  if (processed) {
    for (size_t i = 0; i < table; i++) r->adj_of[i] = -1;
    for (int i = 0; i < sp->n_logit_bias; i++) {
      const int before = r->n_adj;
      lf_logit_adj *a = adj_entry(r, sp->logit_bias[i].token);
      if (r->n_adj == before) {
        const int t = sp->logit_bias[i].token;
        req_free(r);
        return lf_error(LF_ERR_INVALID_ARG, "logit_bias lists token %d twice", t);
      }
      a->bias = sp->logit_bias[i].bias;
    }
    if (track_prompt)
      for (int i = 0; i < rq->n_prompt; i++) adj_entry(r, rq->prompt[i])->seen = 1;
  }
  lf_rng_seed(&r->rng, rq->sampling.seed);
  r->ignore_eos = rq->ignore_eos;
  r->pool = -1;
  r->t_submit = lf_now_s();
  *out = r;
  return LF_OK;
}

lf_status lf_sched_submit(lf_sched *s, const lf_request *rq, uint64_t *id) {
  if (!s || !rq || !id) return lf_error(LF_ERR_INVALID_ARG, "lf_engine_submit: NULL argument");
  const lf_sched_config *c = &s->cfg;
  int seq_total = 0;
  LF_TRY(submit_check(c, rq, &seq_total));
  lf_sreq *r = NULL;
  LF_TRY(req_build(c, rq, seq_total, &r));
  /* The `full` policy holds exactly `budget` tokens: a longer prompt can never run. It is
   * accepted (the caller gets an id) and finished at once with a clear status. */
  const int never_fits = c->policy == LF_POLICY_FULL && rq->n_prompt > c->budget;

  pthread_mutex_lock(&s->mu);
  lf_status st = LF_OK;
  if (never_fits) {
    const int k = finish_events(r);
    if ((st = ev_reserve(s, k)) == LF_OK) {
      r->id = s->next_id++;
      s->submitted++;
      finish(s, r, LF_FINISH_ERROR, LF_ERR_CONTEXT_FULL, -1, 0, r->t_submit);
      ev_release(s, k);
      *id = r->id;
    }
    pthread_mutex_unlock(&s->mu);
    req_free(r);
    return st;
  }
  if (c->max_queue > 0 && s->n_waiting >= c->max_queue) {
    s->rejected++;
    pthread_mutex_unlock(&s->mu);
    req_free(r);
    return lf_error(LF_ERR_QUEUE_FULL, "%d requests already waiting (limit %d)", c->max_queue,
                    c->max_queue);
  }
  r->id = s->next_id++;
  s->submitted++;
  wait_push(s, r);
  *id = r->id;
  pthread_mutex_unlock(&s->mu);
  return LF_OK;
}

lf_status lf_sched_cancel(lf_sched *s, uint64_t id) {
  if (!s) return lf_error(LF_ERR_INVALID_ARG, "lf_engine_cancel: NULL engine");
  lf_status st = LF_OK;
  pthread_mutex_lock(&s->mu);
  for (int i = 0; i < s->n_running; i++)
    if (s->running[i]->id == id && !s->running[i]->done) {
      s->running[i]->cancelled = 1; /* the stepper returns its pool at its next start */
      pthread_mutex_unlock(&s->mu);
      return LF_OK;
    }
  lf_sreq *r = s->wait_head;
  while (r && r->id != id)
    r = r->next;
  if (r) {
    /* A waiting request has no pool: it leaves the queue now, its FINISH waits for a step. */
    const int k = finish_events(r);
    if ((st = ev_reserve(s, k)) == LF_OK) {
      wait_remove(s, r);
      finish(s, r, LF_FINISH_CANCELLED, LF_OK, -1, 0, lf_now_s());
      ev_release(s, k);
      req_free(r);
    }
  } else {
    st = lf_error(LF_ERR_NOT_FOUND, "no running or waiting request %llu", (unsigned long long)id);
  }
  pthread_mutex_unlock(&s->mu);
  return st;
}

/* ---- the step ------------------------------------------------------------------------------ */

static int is_eos(const lf_sched *s, const lf_sreq *r, int32_t tok) {
  if (r->ignore_eos) return 0;
  for (int i = 0; i < s->cfg.n_eos; i++)
    if (tok == s->cfg.eos_ids[i]) return 1;
  return 0;
}

static int is_stop_id(const lf_sreq *r, int32_t tok) {
  for (int i = 0; i < r->n_stop_ids; i++)
    if (tok == r->stop_ids[i]) return 1;
  return 0;
}

/* Over the generated ids g[0..n): the length of the stop sequence g ends with (the first listed
 * on a tie), or 0; and in *hold the longest suffix of g that is a proper prefix of some stop
 * sequence (those tokens must be held back). */
static int stop_seq_match(const lf_sreq *r, const int32_t *g, int n, int *hold) {
  *hold = 0;
  for (int i = 0; i < r->n_seqs; i++) {
    const int32_t *q = r->seq_ids + r->seq_off[i];
    const int L = r->seq_off[i + 1] - r->seq_off[i];
    if (L <= n && memcmp(g + n - L, q, sizeof(int32_t) * (size_t)L) == 0) return L;
    for (int k = (L - 1 < n ? L - 1 : n); k > *hold; k--)
      if (memcmp(g + n - k, q, sizeof(int32_t) * (size_t)k) == 0) {
        *hold = k;
        break;
      }
  }
  return 0;
}

/* Applies one sampled token (lock held, finish_events(r) + 1 reserved); lp: its logprobs or
 * NULL. */
static void take_token(lf_sched *s, lf_sreq *r, int32_t tok, const lp_entry *lp, double now) {
  if (r->n_sampled == 0) r->t_first = now;
  r->t_last = now;
  r->n_sampled++;
  s->tokens_generated++;
  if (r->forced) { /* teacher forcing: report what was sampled; the forced id is fed */
    r->n_gen++;
    r->n_out++;
    lf_event te = {.id = r->id, .type = LF_EVENT_TOKEN, .token = tok};
    if (lp) ev_set_lp(&te, lp);
    ev_push(s, &te);
    if (r->n_gen >= r->max_tokens) finish(s, r, LF_FINISH_LENGTH, LF_OK, tok, 0, now);
    return;
  }
  if (is_eos(s, r, tok)) {
    finish(s, r, LF_FINISH_EOS, LF_OK, tok, 0, now);
    return;
  }
  if (is_stop_id(r, tok)) {
    finish(s, r, LF_FINISH_STOP_ID, LF_OK, tok, r->n_gen, now);
    return;
  }
  if (r->lp && lp) r->lp[r->n_gen] = *lp;
  r->tokens[r->n_prompt + r->n_gen++] = tok;
  int hold = 0;
  const int L = stop_seq_match(r, r->tokens + r->n_prompt, r->n_gen, &hold);
  if (L > 0) {
    finish(s, r, LF_FINISH_STOP_SEQUENCE, LF_OK, tok, r->n_gen - L, now);
    return;
  }
  if (r->n_gen >= r->max_tokens) {
    finish(s, r, LF_FINISH_LENGTH, LF_OK, tok, 0, now);
    return;
  }
  emit_tokens(s, r, r->n_gen - hold);
}

/* Removes the requests finished this step from `running`, keeping admission order. */
static void compact_running(lf_sched *s) {
  int k = 0;
  for (int i = 0; i < s->n_running; i++) {
    lf_sreq *r = s->running[i];
    if (r->done)
      req_free(r);
    else
      s->running[k++] = r;
  }
  s->n_running = k;
}

/* Appends r's tokens [pos0, pos0 + n_tok) to the step's batch as item *n. */
static void batch_add(lf_sched *s, int *n, lf_sreq *r, int pos0, int n_tok) {
  lf_batch_item *it = &s->items[*n];
  it->pool = r->pool;
  it->pos0 = pos0;
  it->n_tok = n_tok;
  it->tokens = r->tokens + pos0; /* position p's token is tokens[p] */
  s->item_req[(*n)++] = r;
}

/* Builds the step's batch (lock held). Decodes first, then prefill chunks in admission order
 * under the token budget. A prompt's chunk boundaries depend only on its length, the pool size,
 * the backend's compression limit and max_batch_tokens, never on what else is in the batch: a
 * prompt that does not fit its pool (P > budget - 1 under eviction) runs whole when the backend
 * can SnapKV-compress that many tokens at once; any other prompt runs in chunks of exactly
 * max_batch_tokens, the last one shorter (scheduler/README.md). A chunk that does not fit into what is left of this
 * step's budget waits whole for the next step (later, smaller chunks may use the rest: first
 * fit); a whole prompt longer than the budget runs in a step that has no other chunk. The oldest
 * prefilling request comes first, so none starves. */
static int build_batch(lf_sched *s) {
  int n = 0;
  for (int i = 0; i < s->n_running; i++) {
    lf_sreq *r = s->running[i];
    if (r->n_prefilled == r->n_prompt) batch_add(s, &n, r, r->n_prompt + r->n_gen - 1, 1);
  }
  const int C = s->cfg.max_batch_tokens;
  long budget = C > 0 ? C : LONG_MAX;
  for (int i = 0; i < s->n_running && budget > 0; i++) {
    lf_sreq *r = s->running[i];
    const int left = r->n_prompt - r->n_prefilled;
    if (left == 0) continue;
    const int whole = s->cfg.policy != LF_POLICY_FULL && r->n_prompt > s->cfg.budget - 1 &&
                      (s->be->max_compress_tokens == 0 || r->n_prompt <= s->be->max_compress_tokens);
    const int chunk = C > 0 && left > C && !whole ? C : left;
    if (chunk > budget && !(chunk > C && budget == C)) continue;
    budget -= chunk;
    batch_add(s, &n, r, r->n_prefilled, chunk);
  }
  return n;
}

/* Sampling settings and the random draw per item, after the events are reserved (a draw
 * advances the request's generator, so it happens only for items that will run). A chunk that
 * does not end the prompt samples nothing that is used: greedy, no draw, so the generator's
 * stream does not depend on how the prompt was chunked. */
/* Folds the output tokens fed since the last call into r's logit adjustments. */
static void fold_output(lf_sreq *r) {
  const int track = r->sp.presence_penalty != 0.0f || r->sp.frequency_penalty != 0.0f ||
                    (r->sp.repetition_penalty > 0.0f && r->sp.repetition_penalty != 1.0f);
  if (!r->adj || !track) return;
  for (; r->n_counted < r->n_gen; r->n_counted++) {
    lf_logit_adj *a = adj_entry(r, r->tokens[r->n_prompt + r->n_counted]);
    const int k = ++r->adj_cnt[a - r->adj];
    a->seen = 1;
    a->sub = r->sp.presence_penalty + r->sp.frequency_penalty * (float)k;
  }
}

static void set_sampling(lf_sched *s, int n) {
  for (int i = 0; i < n; i++) {
    lf_batch_item *it = &s->items[i];
    lf_sreq *r = s->item_req[i];
    const int samples = r->n_prefilled == r->n_prompt || r->n_prefilled + it->n_tok == r->n_prompt;
    memset(&it->sampling, 0, sizeof it->sampling);
    it->u = 0.0f;
    it->adj = NULL;
    it->n_adj = 0;
    it->rep = 1.0f;
    it->logits_last = it->logits_all = NULL;
    it->full_logits = 0;
    s->item_plp[i] = NULL;
    s->item_oom[i] = 0;
    if (samples) {
      it->sampling = r->sp;
      if (r->sp.temperature > 0.0f) it->u = lf_rng_float(&r->rng);
      fold_output(r);
      if (r->n_adj > 0) {
        it->adj = r->adj;
        it->n_adj = r->n_adj;
        it->rep = r->sp.repetition_penalty;
      }
      if (r->lp) it->logits_last = s->lrows + (size_t)i * (size_t)s->cfg.vocab_size;
      it->full_logits = it->n_adj > 0 || it->logits_last != NULL;
    }
  }
}

/* Events a batch item may push: its request's finish events, its token, and with
 * prompt_logprobs one per position of a prompt chunk. */
static int item_events(const lf_sched *s, int i) {
  const lf_sreq *r = s->item_req[i];
  int k = finish_events(r) + 1;
  if (r->sp.prompt_logprobs && r->n_prefilled < r->n_prompt) k += s->items[i].n_tok;
  return k;
}

/* Without the lock, before the forward: the prompt chunks' logits buffers (prompt_logprobs).
 * A failed allocation ends that request after the forward (item_oom). */
static void prompt_lp_alloc(lf_sched *s, int n) {
  const size_t V = (size_t)s->cfg.vocab_size;
  for (int i = 0; i < n; i++) {
    lf_batch_item *it = &s->items[i];
    const lf_sreq *r = s->item_req[i];
    if (!r->sp.prompt_logprobs || r->n_prefilled >= r->n_prompt) continue;
    it->logits_all = malloc(sizeof(float) * V * (size_t)it->n_tok);
    s->item_plp[i] = malloc(sizeof(lp_entry) * (size_t)it->n_tok);
    if (!it->logits_all || !s->item_plp[i]) {
      free(it->logits_all);
      free(s->item_plp[i]);
      it->logits_all = NULL;
      s->item_plp[i] = NULL;
      s->item_oom[i] = 1;
    }
  }
}

/* Without the lock, after the forward: log-probabilities from the raw logits the backend copied
 * out (the sampled token's, and a prompt chunk's per position). */
static void logprobs_compute(lf_sched *s, int n) {
  const int V = s->cfg.vocab_size;
  for (int i = 0; i < n; i++) {
    lf_batch_item *it = &s->items[i];
    const lf_sreq *r = s->item_req[i];
    if (s->res[i].status != LF_OK) continue;
    const int k = r->sp.top_logprobs;
    if (it->logits_last) {
      lp_entry *e = &s->item_lp[i];
      e->n_top = k;
      lf_logprobs(it->logits_last, V, s->res[i].token, &e->lp, k, e->ids, e->lps);
    }
    if (it->logits_all) {
      for (int t = 0; t < it->n_tok; t++) {
        const int p = it->pos0 + t; /* predicts position p + 1 */
        lp_entry *e = &s->item_plp[i][t];
        e->n_top = 0;
        if (p + 1 >= r->n_prompt) continue;
        e->n_top = k;
        lf_logprobs(it->logits_all + (size_t)t * (size_t)V, V, r->tokens[p + 1], &e->lp, k,
                    e->ids, e->lps);
      }
      free(it->logits_all);
      it->logits_all = NULL;
    }
  }
}

lf_status lf_sched_step(lf_sched *s, lf_event *events, int cap, int *n) {
  if (!s || !n || cap < 0 || (cap > 0 && !events))
    return lf_error(LF_ERR_INVALID_ARG, "lf_engine_step: NULL engine, n or events");
  *n = 0;
  pthread_mutex_lock(&s->mu);
  if (s->stepping) {
    pthread_mutex_unlock(&s->mu);
    return lf_error(LF_ERR_STATE, "lf_engine_step called from two threads at once");
  }
  s->stepping = 1;
  const double t0 = lf_now_s();
  lf_status st = LF_OK;
  int reserved = 0, n_items = 0;

  /* 1. Cancelled running requests end first, so their pools serve admission below. */
  for (int i = 0; i < s->n_running; i++) {
    lf_sreq *r = s->running[i];
    if (!r->cancelled) continue;
    const int k = finish_events(r);
    if ((st = ev_reserve(s, k)) != LF_OK) break;
    finish(s, r, LF_FINISH_CANCELLED, LF_OK, -1, 0, t0);
    ev_release(s, k);
  }
  compact_running(s);
  if (st != LF_OK) goto out;

  /* 2. FCFS admission: the oldest waiting request takes a pool as soon as one is free. */
  while (s->wait_head && s->n_running < s->pools_total) {
    lf_sreq *r = s->wait_head;
    if ((st = s->be->pool_take(s->be, &r->pool)) != LF_OK) {
      r->pool = -1;
      st = lf_error(LF_ERR_INTERNAL, "scheduler: %d of %d pools running but pool_take failed: %s",
                    s->n_running, s->pools_total, lf_last_error());
      goto out;
    }
    wait_remove(s, r);
    r->t_admit = t0;
    s->running[s->n_running++] = r;
  }

  /* 3. One batch: a decode token for every running sequence, prompt chunks up to the budget. */
  n_items = build_batch(s);
  int need = 0;
  for (int i = 0; i < n_items; i++)
    need += item_events(s, i);
  if ((st = ev_reserve(s, need)) != LF_OK) goto out;
  for (int i = 0; i < n_items && !s->lrows; i++)
    if (s->item_req[i]->lp) {
      s->lrows = malloc(sizeof(float) * (size_t)s->pools_total * (size_t)s->cfg.vocab_size);
      if (!s->lrows) {
        ev_release(s, need);
        st = lf_error(LF_ERR_OUT_OF_MEMORY, "logprobs rows for %d pools", s->pools_total);
        goto out;
      }
    }
  reserved = need;
  set_sampling(s, n_items);
  pthread_mutex_unlock(&s->mu);
  prompt_lp_alloc(s, n_items);

  /* 4. The forward pass, without the lock. Only this thread touches the items, their requests'
   * token arrays and the pools, so submit/cancel can proceed meanwhile. */
  lf_status fs = LF_OK;
  if (n_items > 0) fs = s->be->forward(s->be, s->items, n_items, s->res, NULL);
  if (fs == LF_OK) logprobs_compute(s, n_items);

  pthread_mutex_lock(&s->mu);
  const double t1 = lf_now_s();
  uint64_t sampled_before = s->tokens_generated;
  if (fs != LF_OK) {
    /* A backend-wide failure leaves these sequences' pools in an unknown state: end them. */
    for (int i = 0; i < n_items; i++)
      finish(s, s->item_req[i], LF_FINISH_ERROR, fs, -1, 0, t1);
    st = fs;
  } else {
    for (int i = 0; i < n_items; i++) {
      lf_sreq *r = s->item_req[i];
      const lf_batch_item *it = &s->items[i];
      const lf_batch_result *res = &s->res[i];
      r->evictions += res->evictions;
      s->evictions += res->evictions;
      const int prefill = r->n_prefilled < r->n_prompt;
      if (res->status != LF_OK || s->item_oom[i]) {
        finish(s, r, LF_FINISH_ERROR, res->status != LF_OK ? res->status : LF_ERR_OUT_OF_MEMORY,
               -1, 0, t1);
        continue;
      }
      if (prefill && s->item_plp[i])
        for (int t = 0; t < it->n_tok; t++) {
          if (it->pos0 + t + 1 >= r->n_prompt) break;
          lf_event pe = {.id = r->id, .type = LF_EVENT_PROMPT_TOKEN,
                         .token = r->tokens[it->pos0 + t + 1]};
          ev_set_lp(&pe, &s->item_plp[i][t]);
          ev_push(s, &pe);
        }
      if (prefill) {
        r->n_prefilled += it->n_tok;
        r->chunks++;
        s->prompt_tokens += (uint64_t)it->n_tok;
        if (r->n_prefilled < r->n_prompt) continue; /* more chunks to come */
      }
      take_token(s, r, res->token, it->logits_last ? &s->item_lp[i] : NULL, t1);
    }
  }
  if (s->tokens_generated > sampled_before) {
    s->rate_t[s->rate_next] = t1;
    s->rate_n[s->rate_next] = (int)(s->tokens_generated - sampled_before);
    s->rate_next = (s->rate_next + 1) % RATE_RING;
    if (s->rate_len < RATE_RING) s->rate_len++;
  }
  for (int i = 0; i < n_items; i++) {
    free(s->item_plp[i]);
    s->item_plp[i] = NULL;
    free(s->items[i].logits_all);
    s->items[i].logits_all = NULL;
  }
  compact_running(s);
  s->steps++;
out:
  ev_release(s, reserved);
  ev_drain(s, events, cap, n);
  s->step_seconds += lf_now_s() - t0;
  s->stepping = 0;
  pthread_mutex_unlock(&s->mu);
  return st;
}

int lf_sched_busy(lf_sched *s) {
  if (!s) return 0;
  pthread_mutex_lock(&s->mu);
  const int b = s->n_waiting > 0 || s->n_running > 0 || s->ev_len > 0;
  pthread_mutex_unlock(&s->mu);
  return b;
}

/* ---- queries ------------------------------------------------------------------------------- */

lf_status lf_sched_request_stats(lf_sched *s, uint64_t id, lf_request_stats *out) {
  if (!s || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_engine_request_stats: NULL argument");
  lf_status st = LF_ERR_NOT_FOUND;
  const double now = lf_now_s();
  pthread_mutex_lock(&s->mu);
  for (int i = 0; i < s->n_running && st != LF_OK; i++)
    if (s->running[i]->id == id && !s->running[i]->done) {
      req_stats(s->running[i], now, out);
      st = LF_OK;
    }
  for (lf_sreq *r = s->wait_head; r && st != LF_OK; r = r->next)
    if (r->id == id) {
      req_stats(r, now, out);
      st = LF_OK;
    }
  for (int i = 0; i < s->fin_len && st != LF_OK; i++)
    if (s->fin_id[i] == id) {
      *out = s->fin[i];
      st = LF_OK;
    }
  pthread_mutex_unlock(&s->mu);
  if (st != LF_OK)
    return lf_error(LF_ERR_NOT_FOUND,
                    "no waiting, running or recently finished request %llu "
                    "(stats are kept for the last %d finished)",
                    (unsigned long long)id, FINISHED_KEEP);
  return LF_OK;
}

lf_status lf_sched_metrics(lf_sched *s, lf_metrics *m) {
  if (!s || !m) return lf_error(LF_ERR_INVALID_ARG, "lf_engine_metrics: NULL argument");
  const double now = lf_now_s();
  pthread_mutex_lock(&s->mu);
  *m = (lf_metrics){.running = s->n_running,
                    .waiting = s->n_waiting,
                    .pools_total = s->pools_total,
                    .pools_used = s->pools_total - s->be->pools_free(s->be),
                    .tokens_generated = s->tokens_generated,
                    .prompt_tokens = s->prompt_tokens,
                    .evictions = s->evictions,
                    .decode_seconds = s->step_seconds,
                    .steps = s->steps,
                    .submitted = s->submitted,
                    .rejected = s->rejected};
  for (int i = 0; i < s->n_running; i++)
    if (s->running[i]->n_prefilled < s->running[i]->n_prompt) m->prefilling++;
  memcpy(m->finished, s->finished, sizeof m->finished);
  /* Tokens per second over the last RATE_WINDOW_S seconds; when the ring holds fewer seconds
   * than that (many fast steps), over the span the ring covers. */
  uint64_t tok = 0;
  double since = now - RATE_WINDOW_S > s->t_init ? now - RATE_WINDOW_S : s->t_init;
  for (int i = 0; i < s->rate_len; i++) {
    const int j = (s->rate_next - 1 - i + RATE_RING) % RATE_RING;
    if (s->rate_t[j] <= now - RATE_WINDOW_S) break;
    if (i == RATE_RING - 1) {
      since = s->rate_t[j]; /* the oldest record only marks where the span starts */
      break;
    }
    tok += (uint64_t)s->rate_n[j];
  }
  m->tokens_per_s = now > since ? (double)tok / (now - since) : 0.0;
  lat_summary(&s->ttft, &m->ttft);
  lat_summary(&s->tpot, &m->tpot);
  pthread_mutex_unlock(&s->mu);
  return LF_OK;
}

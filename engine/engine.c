/* The engine: a loaded model, its KV pools and the request loop behind include/lfserve.h.
 *
 * Threading: lf_engine_submit, lf_engine_cancel, lf_engine_metrics and lf_engine_request_stats
 * may be called from any thread; lf_engine_step from one thread at a time (a second concurrent
 * caller gets LF_ERR_STATE). The mutex guards the queues and counters; the forward pass runs
 * outside it so submitters never wait for a step.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "error.h"
#include "model.h"
#include "sample.h"

typedef struct lf_req {
  uint64_t id;
  int32_t *tokens; /* [n_prompt + max_tokens] prompt then generated ids */
  int n_prompt, n_gen, max_tokens;
  lf_sampling sp;
  lf_rng rng;
  int ignore_eos;
  int32_t *stop; /* [n_stop] */
  int n_stop;
  int pool;         /* -1 while waiting */
  int prefilled;    /* prompt has been run */
  int cancelled;
  uint64_t evictions;
} lf_req;

typedef struct lf_finished {
  uint64_t id;
  lf_request_stats st;
} lf_finished;

#define LF_FINISHED_KEEP 4096

struct lf_engine {
  lf_engine_config cfg;
  lf_checkpoint ck;
  lf_backend *be;

  pthread_mutex_t mu;
  int stepping;
  uint64_t next_id;
  lf_req **waiting; /* FIFO [cap_q], head at q_head */
  int q_head, q_len, cap_q;
  lf_req **running; /* [n_pools] */
  int n_running;
  lf_event *ev; /* pending events, FIFO */
  int ev_head, ev_len, ev_cap;
  lf_finished fin[LF_FINISHED_KEEP]; /* ring of the most recent finished requests */
  int fin_next, fin_len;
  uint64_t tokens_generated, evictions;
  double step_seconds;
};

const char *lf_policy_str(lf_policy p) {
  switch (p) {
  case LF_POLICY_LONGFLOW: return "longflow";
  case LF_POLICY_FULL: return "full";
  case LF_POLICY_STREAMING: return "streaming";
  case LF_POLICY_H2O: return "h2o";
  }
  return "unknown";
}

lf_status lf_policy_parse(const char *s, lf_policy *out) {
  static const lf_policy all[] = {LF_POLICY_LONGFLOW, LF_POLICY_FULL, LF_POLICY_STREAMING,
                                  LF_POLICY_H2O};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
    if (s && strcmp(s, lf_policy_str(all[i])) == 0) {
      *out = all[i];
      return LF_OK;
    }
  return lf_error(LF_ERR_INVALID_ARG, "unknown policy '%s' (longflow, full, streaming, h2o)",
                  s ? s : "(null)");
}

const char *lf_finish_reason_str(lf_finish_reason r) {
  switch (r) {
  case LF_FINISH_NONE: return "none";
  case LF_FINISH_EOS: return "stop";
  case LF_FINISH_LENGTH: return "length";
  case LF_FINISH_CANCELLED: return "cancelled";
  case LF_FINISH_ERROR: return "error";
  }
  return "unknown";
}

void lf_engine_config_default(lf_engine_config *cfg) {
  memset(cfg, 0, sizeof *cfg);
  cfg->backend = LF_BACKEND_AUTO;
  cfg->policy = LF_POLICY_LONGFLOW;
  cfg->sink = 4;
  cfg->window = 32;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void req_free(lf_req *r) {
  if (!r) return;
  free(r->tokens);
  free(r->stop);
  free(r);
}

void lf_engine_free(lf_engine_t e) {
  if (!e) return;
  for (int i = 0; i < e->q_len; i++) req_free(e->waiting[(e->q_head + i) % e->cap_q]);
  for (int i = 0; i < e->n_running; i++) req_free(e->running[i]);
  free(e->waiting);
  free(e->running);
  free(e->ev);
  if (e->be) e->be->free(e->be);
  lf_checkpoint_close(&e->ck);
  pthread_mutex_destroy(&e->mu);
  free(e);
}

lf_status lf_engine_init(const lf_engine_config *cfg_in, lf_comm_t comm, lf_engine_t *out) {
  if (!cfg_in || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_engine_init: NULL argument");
  *out = NULL;
  if (comm) return lf_error(LF_ERR_UNAVAILABLE, "tensor parallelism is not built in yet");
  if (!cfg_in->model_path) return lf_error(LF_ERR_INVALID_ARG, "no model path given");
  if (cfg_in->budget < 0 || cfg_in->sink < 0 || cfg_in->window < 0 || cfg_in->n_pools < 0 ||
      cfg_in->max_queue < 0)
    return lf_error(LF_ERR_INVALID_ARG, "negative budget, sink, window, n_pools or max_queue");

  lf_engine_t e = calloc(1, sizeof *e);
  if (!e) return lf_error(LF_ERR_OUT_OF_MEMORY, "engine");
  pthread_mutex_init(&e->mu, NULL);
  e->cfg = *cfg_in;
  e->next_id = 1;
  lf_status s = lf_checkpoint_open(cfg_in->model_path, &e->ck);
  if (s != LF_OK) goto fail;
  const lf_model_config *mc = &e->ck.cfg;
  if (e->cfg.budget == 0) e->cfg.budget = mc->max_seq_len;
  if (e->cfg.n_pools == 0) e->cfg.n_pools = 1;

  lf_backend_params bp = {.policy = e->cfg.policy,
                          .budget = e->cfg.budget,
                          .sink = e->cfg.sink,
                          .window = e->cfg.window,
                          .n_pools = e->cfg.n_pools,
                          .n_threads = e->cfg.n_threads};
  s = lf_backend_create(e->cfg.backend, &e->ck, &bp, &e->be);
  if (s != LF_OK) goto fail;
  e->cap_q = 16;
  e->waiting = malloc(sizeof(lf_req *) * (size_t)e->cap_q);
  e->running = malloc(sizeof(lf_req *) * (size_t)e->cfg.n_pools);
  e->ev_cap = 64;
  e->ev = malloc(sizeof(lf_event) * (size_t)e->ev_cap);
  if (!e->waiting || !e->running || !e->ev) {
    s = lf_error(LF_ERR_OUT_OF_MEMORY, "engine queues");
    goto fail;
  }
  *out = e;
  return LF_OK;
fail:
  lf_engine_free(e);
  return s;
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
  for (int i = 0; i < c->n_eos && i < 8; i++) o->eos_ids[i] = c->eos_ids[i];
  return LF_OK;
}

/* Appends an event; the buffer grows (events are small and drained every step). */
static lf_status push_event(lf_engine_t e, const lf_event *ev) {
  if (e->ev_len == e->ev_cap) {
    lf_event *n = malloc(sizeof(lf_event) * (size_t)e->ev_cap * 2);
    if (!n) return lf_error(LF_ERR_OUT_OF_MEMORY, "event queue");
    for (int i = 0; i < e->ev_len; i++) n[i] = e->ev[(e->ev_head + i) % e->ev_cap];
    free(e->ev);
    e->ev = n;
    e->ev_head = 0;
    e->ev_cap *= 2;
  }
  e->ev[(e->ev_head + e->ev_len) % e->ev_cap] = *ev;
  e->ev_len++;
  return LF_OK;
}

lf_status lf_engine_submit(lf_engine_t e, const lf_request *rq, uint64_t *id) {
  if (!e || !rq || !id) return lf_error(LF_ERR_INVALID_ARG, "lf_engine_submit: NULL argument");
  const lf_model_config *c = &e->ck.cfg;
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
  if (rq->sampling.temperature < 0.0f || rq->sampling.top_k < 0 || rq->sampling.top_p < 0.0f ||
      rq->sampling.top_p > 1.0f)
    return lf_error(LF_ERR_INVALID_ARG, "sampling: temperature >= 0, top_k >= 0, 0 <= top_p <= 1");
  /* Generation can never pass the model's context: cap what we allocate for. */
  int max_tokens = rq->max_tokens;
  if (max_tokens > c->max_seq_len - rq->n_prompt + 1) max_tokens = c->max_seq_len - rq->n_prompt + 1;

  lf_req *r = calloc(1, sizeof *r);
  if (!r) return lf_error(LF_ERR_OUT_OF_MEMORY, "request");
  r->tokens = malloc(sizeof(int32_t) * (size_t)(rq->n_prompt + max_tokens));
  r->stop = rq->n_stop_ids ? malloc(sizeof(int32_t) * (size_t)rq->n_stop_ids) : NULL;
  if (!r->tokens || (rq->n_stop_ids && !r->stop)) {
    req_free(r);
    return lf_error(LF_ERR_OUT_OF_MEMORY, "request");
  }
  memcpy(r->tokens, rq->prompt, sizeof(int32_t) * (size_t)rq->n_prompt);
  if (rq->n_stop_ids) memcpy(r->stop, rq->stop_ids, sizeof(int32_t) * (size_t)rq->n_stop_ids);
  r->n_stop = rq->n_stop_ids;
  r->n_prompt = rq->n_prompt;
  r->max_tokens = max_tokens;
  r->sp = rq->sampling;
  lf_rng_seed(&r->rng, rq->sampling.seed);
  r->ignore_eos = rq->ignore_eos;
  r->pool = -1;

  pthread_mutex_lock(&e->mu);
  if (e->cfg.max_queue > 0 && e->q_len >= e->cfg.max_queue) {
    pthread_mutex_unlock(&e->mu);
    req_free(r);
    return lf_error(LF_ERR_QUEUE_FULL, "%d requests already waiting (limit %d)", e->cfg.max_queue,
                    e->cfg.max_queue);
  }
  if (e->q_len == e->cap_q) {
    lf_req **n = malloc(sizeof(lf_req *) * (size_t)e->cap_q * 2);
    if (!n) {
      pthread_mutex_unlock(&e->mu);
      req_free(r);
      return lf_error(LF_ERR_OUT_OF_MEMORY, "request queue");
    }
    for (int i = 0; i < e->q_len; i++) n[i] = e->waiting[(e->q_head + i) % e->cap_q];
    free(e->waiting);
    e->waiting = n;
    e->q_head = 0;
    e->cap_q *= 2;
  }
  r->id = e->next_id++;
  e->waiting[(e->q_head + e->q_len) % e->cap_q] = r;
  e->q_len++;
  *id = r->id;
  pthread_mutex_unlock(&e->mu);
  return LF_OK;
}

lf_status lf_engine_cancel(lf_engine_t e, uint64_t id) {
  if (!e) return lf_error(LF_ERR_INVALID_ARG, "lf_engine_cancel: NULL engine");
  lf_status s = lf_error(LF_ERR_NOT_FOUND, "no running or waiting request %llu",
                         (unsigned long long)id);
  pthread_mutex_lock(&e->mu);
  for (int i = 0; i < e->q_len; i++) {
    lf_req *r = e->waiting[(e->q_head + i) % e->cap_q];
    if (r->id == id) r->cancelled = 1, s = LF_OK;
  }
  for (int i = 0; i < e->n_running; i++)
    if (e->running[i]->id == id) e->running[i]->cancelled = 1, s = LF_OK;
  pthread_mutex_unlock(&e->mu);
  return s;
}

/* Called with the mutex held: records stats, returns the pool, emits FINISH, frees r. */
static lf_status finish(lf_engine_t e, lf_req *r, lf_finish_reason why, lf_status st,
                        int32_t last) {
  lf_finished *f = &e->fin[e->fin_next];
  f->id = r->id;
  f->st.prompt_tokens = r->n_prompt;
  f->st.generated_tokens = r->n_gen;
  f->st.evictions = r->evictions;
  f->st.slots_filled = 0;
  if (r->pool >= 0) {
    f->st.slots_filled = e->be->pool_slots_filled(e->be, r->pool);
    e->be->pool_give(e->be, r->pool);
  }
  e->fin_next = (e->fin_next + 1) % LF_FINISHED_KEEP;
  if (e->fin_len < LF_FINISHED_KEEP) e->fin_len++;
  lf_event ev = {.id = r->id, .type = LF_EVENT_FINISH, .token = last, .reason = why, .status = st};
  req_free(r);
  return push_event(e, &ev); /* fails only when the queue cannot grow (out of memory) */
}

static int is_stop(const lf_engine_t e, const lf_req *r, int32_t tok) {
  if (!r->ignore_eos)
    for (int i = 0; i < e->ck.cfg.n_eos; i++)
      if (tok == e->ck.cfg.eos_ids[i]) return 1;
  for (int i = 0; i < r->n_stop; i++)
    if (tok == r->stop[i]) return 1;
  return 0;
}

/* Runs the model for one request (its prompt, or its last token) and samples the next token.
 * Returns 1 when the request ended (FINISH queued, r freed), 0 when it goes on; *st receives an
 * engine-level failure (the event queue could not grow), which ends the step. */
static int advance(lf_engine_t e, lf_req *r, lf_status *st) {
  lf_batch_item it;
  it.pos0 = r->prefilled ? r->n_prompt + r->n_gen - 1 : 0;
  it.n_tok = r->prefilled ? 1 : r->n_prompt;
  it.tokens = r->tokens + it.pos0;
  it.pool = r->pool;
  it.sampling = r->sp;
  it.u = r->sp.temperature > 0.0f ? lf_rng_float(&r->rng) : 0.0f;
  lf_batch_result res;
  lf_status s = e->be->forward(e->be, &it, 1, &res, NULL);
  if (s == LF_OK) s = res.status;
  r->evictions += res.evictions;
  r->prefilled = 1;
  pthread_mutex_lock(&e->mu);
  e->evictions += res.evictions;
  int done = 1;
  if (s != LF_OK) {
    *st = finish(e, r, LF_FINISH_ERROR, s, -1);
  } else {
    const int32_t tok = res.token;
    if (is_stop(e, r, tok)) {
      *st = finish(e, r, LF_FINISH_EOS, LF_OK, tok);
    } else {
      r->tokens[r->n_prompt + r->n_gen++] = tok;
      e->tokens_generated++;
      lf_event te = {.id = r->id, .type = LF_EVENT_TOKEN, .token = tok};
      *st = push_event(e, &te);
      /* max_tokens was capped at submit so the last token's position stays within context */
      if (r->n_gen >= r->max_tokens) {
        lf_status fs = finish(e, r, LF_FINISH_LENGTH, LF_OK, tok);
        if (*st == LF_OK) *st = fs;
      } else {
        done = 0;
      }
    }
  }
  pthread_mutex_unlock(&e->mu);
  return done;
}

static void drain(lf_engine_t e, lf_event *events, int cap, int *n) {
  int k = 0;
  while (k < cap && e->ev_len > 0) {
    events[k++] = e->ev[e->ev_head];
    e->ev_head = (e->ev_head + 1) % e->ev_cap;
    e->ev_len--;
  }
  *n = k;
}

lf_status lf_engine_step(lf_engine_t e, lf_event *events, int cap, int *n) {
  if (!e || !n || (cap > 0 && !events)) return lf_error(LF_ERR_INVALID_ARG, "lf_engine_step");
  *n = 0;
  pthread_mutex_lock(&e->mu);
  if (e->stepping) {
    pthread_mutex_unlock(&e->mu);
    return lf_error(LF_ERR_STATE, "lf_engine_step called from two threads at once");
  }
  e->stepping = 1;
  const double t0 = now_s();
  lf_status st = LF_OK;
  /* Cancellations first, so their pools are free for admission below. */
  for (int i = 0; i < e->n_running;) {
    lf_req *r = e->running[i];
    if (r->cancelled) {
      e->running[i] = e->running[--e->n_running];
      if ((st = finish(e, r, LF_FINISH_CANCELLED, LF_OK, -1)) != LF_OK) goto out;
    } else {
      i++;
    }
  }
  /* FCFS admission: a waiting request gets a pool as soon as one is free. */
  while (e->q_len > 0) {
    lf_req *r = e->waiting[e->q_head];
    if (!r->cancelled && e->be->pools_free(e->be) == 0) break;
    e->q_head = (e->q_head + 1) % e->cap_q;
    e->q_len--;
    if (r->cancelled) {
      if ((st = finish(e, r, LF_FINISH_CANCELLED, LF_OK, -1)) != LF_OK) goto out;
      continue;
    }
    if ((st = e->be->pool_take(e->be, &r->pool)) != LF_OK) goto out;
    e->running[e->n_running++] = r;
  }
  /* One token for every running request: decode for the old ones, prefill for the new. */
  const int n_run = e->n_running;
  lf_req **batch = malloc(sizeof(lf_req *) * (size_t)(n_run ? n_run : 1));
  if (!batch) {
    st = lf_error(LF_ERR_OUT_OF_MEMORY, "step batch");
    goto out;
  }
  memcpy(batch, e->running, sizeof(lf_req *) * (size_t)n_run);
  pthread_mutex_unlock(&e->mu);
  for (int i = 0; i < n_run && st == LF_OK; i++)
    if (advance(e, batch[i], &st)) batch[i] = NULL;
  pthread_mutex_lock(&e->mu);
  /* Only this thread changes `running`, so it still matches batch slot for slot. */
  int k = 0;
  for (int i = 0; i < n_run; i++)
    if (batch[i]) e->running[k++] = batch[i];
  e->n_running = k;
  free(batch);
out:
  drain(e, events, cap, n);
  e->step_seconds += now_s() - t0;
  e->stepping = 0;
  pthread_mutex_unlock(&e->mu);
  return st;
}

int lf_engine_busy(lf_engine_t e) {
  pthread_mutex_lock(&e->mu);
  const int b = e->q_len > 0 || e->n_running > 0 || e->ev_len > 0;
  pthread_mutex_unlock(&e->mu);
  return b;
}

lf_status lf_engine_request_stats(lf_engine_t e, uint64_t id, lf_request_stats *out) {
  if (!e || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_engine_request_stats");
  lf_status s = lf_error(LF_ERR_NOT_FOUND, "no finished request %llu (stats are kept for the "
                                           "last %d)", (unsigned long long)id, LF_FINISHED_KEEP);
  pthread_mutex_lock(&e->mu);
  for (int i = 0; i < e->fin_len; i++)
    if (e->fin[i].id == id) *out = e->fin[i].st, s = LF_OK;
  pthread_mutex_unlock(&e->mu);
  return s;
}

lf_status lf_engine_metrics(lf_engine_t e, lf_metrics *m) {
  if (!e || !m) return lf_error(LF_ERR_INVALID_ARG, "lf_engine_metrics");
  pthread_mutex_lock(&e->mu);
  memset(m, 0, sizeof *m);
  m->running = e->n_running;
  m->waiting = e->q_len;
  m->pools_total = e->cfg.n_pools;
  m->pools_used = m->pools_total - e->be->pools_free(e->be);
  m->tokens_generated = e->tokens_generated;
  m->evictions = e->evictions;
  m->decode_seconds = e->step_seconds;
  pthread_mutex_unlock(&e->mu);
  return LF_OK;
}

/* lfbench eval — accuracy against KV budget on `trace` task problems (docs/TASK.md), through the
 * engine's continuous-batching scheduler.
 *
 * Problems come from a JSON-lines file (tools/task/gen.py --out: id, prompt, output, answer,
 * prompt_tokens, output_tokens, ...). The prompt text is encoded with the model's tokenizer.json
 * exactly as `lfgen --prompt` does (post-processor specials added: the task's <bos>), and the
 * count must equal the file's prompt_tokens. Every (policy, scope, fraction) of the grid is a
 * series of runs, one per problem: budget = max(1, ceil(fraction * output_tokens)) (as
 * tools/task/eval.py), rounded up to a multiple of --budget-round (default 1: exact); `full` runs
 * once per problem with a pool that fits prompt + output + margin of every problem (the whole
 * context with --full-budget ctx). A pool's size is per engine, so the runs of a series are
 * grouped by budget and each group gets one engine with n_pools = min(group size,
 * --max-concurrent); all its requests are submitted at once and stepped to the end (greedy,
 * max_tokens = output_tokens + margin, stopping on the model's EOS). --jobs runs that many
 * groups at once, each engine in its own thread.
 *
 * Each run is scored as tools/task/gen.py:check() does: the generated ids (the final EOS
 * included when the model stopped) against encode(output) + [eos] (trace_ok, first_error), and
 * the first decoded line starting with "ans " against the answer (answer_ok). The JSON has
 * eval.py's schema (runs, and a summary per series and fraction: n, accuracy, trace_exact,
 * median_first_error, mean_evictions, errors), so eval.py's table and plot read it.
 */
#define _XOPEN_SOURCE 700 /* getline, realpath */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"
#include "bench/bench_eval.h"
#include "bench/bench_util.h"
#include "engine/backend.h"
#include "engine/model.h"
#include "lfserve.h"
#include "text/json.h"
#include "text/tokenizer.h"

int bench_eval(int argc, char **argv);

/* ---- runs and groups ----------------------------------------------------------------------- */




static int run_push(ev_run *r, int32_t t) {
  if (r->n_ids == r->cap_ids) {
    int c = r->cap_ids ? 2 * r->cap_ids : 256;
    int32_t *p = realloc(r->ids, sizeof(int32_t) * (size_t)c);
    if (!p) return -1;
    r->ids = p;
    r->cap_ids = c;
  }
  r->ids[r->n_ids++] = t;
  return 0;
}

static void run_fail(ev_run *r, const char *fmt, lf_status s, const char *msg) {
  char b[512];
  snprintf(b, sizeof b, fmt, lf_status_str(s), msg ? msg : "");
  free(r->error);
  r->error = ev_strdup(b);
  r->rc = 1;
}

/* gen.py:check(): trace against encode(output) + [eos], the first "ans " line against the
 * answer. The text is decoded up to the first eos, specials as their names (gen.decode); an id
 * the tokenizer does not know reads "<idN>" as there. */
static void score_run(const ev_ctx *c, ev_run *r) {
  const ev_problem *p = &c->probs[r->problem];
  r->first_error = -1;
  for (int i = 0; i < p->n_want; i++)
    if (i >= r->n_ids || r->ids[i] != p->want[i]) {
      r->first_error = i;
      break;
    }
  if (r->first_error < 0 && r->n_ids > p->n_want) r->first_error = p->n_want;
  r->tf_wrong = 0;
  for (int i = 0; i < p->n_want; i++) r->tf_wrong += ev_wrong_at(p, r, i);
  r->trace_ok = r->first_error < 0;
  r->stopped = 0;
  int n = 0;
  while (n < r->n_ids && r->ids[n] != c->eos)
    n++;
  for (int i = 0; i < r->n_ids; i++)
    if (r->ids[i] == c->eos) r->stopped = 1;
  lf_tok_text text = {0}, piece = {0};
  const int32_t vocab = lf_tokenizer_vocab_size(c->tok);
  for (int i = 0; i < n;) {
    int j = i;
    while (j < n && r->ids[j] >= 0 && r->ids[j] < vocab &&
           lf_tokenizer_id_to_token(c->tok, r->ids[j]))
      j++;
    if (j > i) {
      if (lf_tokenizer_decode(c->tok, r->ids + i, (size_t)(j - i), 0, &piece) == LF_OK)
        lf_tok_text_append(&text, piece.data, piece.len);
      i = j;
    } else {
      char b[32];
      snprintf(b, sizeof b, "<id%d>", (int)r->ids[i]);
      lf_tok_text_append(&text, b, strlen(b));
      i++;
    }
  }
  free(r->answer);
  r->answer = NULL;
  for (const char *s = text.data; s && *s;) {
    const char *e = strchr(s, '\n');
    const size_t len = e ? (size_t)(e - s) : strlen(s);
    if (len >= 4 && !strncmp(s, "ans ", 4)) {
      r->answer = malloc(len + 1);
      if (r->answer) {
        memcpy(r->answer, s, len);
        r->answer[len] = '\0';
      }
      break;
    }
    if (!e) break;
    s = e + 1;
  }
  r->answer_ok = r->answer && !strcmp(r->answer, p->answer);
  lf_tok_text_free(&text);
  lf_tok_text_free(&piece);
}

static void print_progress(ev_ctx *c, const ev_run *r) {
  /* called with c->lock held */
  c->runs_done++;
  if (c->o->quiet) return;
  const ev_series *se = &c->series[r->series];
  char tag[64], b[32] = "";
  if (r->fi >= 0) ev_py_float(c->o->fractions[r->fi], b, sizeof b);
  snprintf(tag, sizeof tag, "%s%s%s", se->name, r->fi >= 0 ? "@" : "", b);
  printf("[%d/%d %6.0fs] %14s %-15s budget %5d answer %s trace %s first_err ", c->runs_done,
         c->n_runs, lf_now_s() - c->t0, c->probs[r->problem].id, tag, r->budget,
         r->answer_ok ? "ok " : "bad", r->trace_ok ? "ok " : "bad");
  if (r->first_error >= 0)
    printf("%d", r->first_error);
  else
    printf("None");
  printf(" gen %d finish %s", r->n_ids, r->rc ? "error" : lf_finish_reason_str(r->reason));
  if (r->rc) printf(" rc 1: %s", r->error ? r->error : "");
  printf("\n");
  fflush(stdout);
}

/* One group: one engine, every run submitted at once, stepped until all end. A failure of the
 * engine (init, step) fails that group's unfinished runs; the rest of the grid goes on. */
static void run_group(ev_ctx *c, ev_group *g) {
  const ev_opts *o = c->o;
  const ev_series *se = &c->series[g->series];
  lf_engine_config cfg;
  lf_engine_config_default(&cfg);
  cfg.model_path = o->model;
  cfg.lora_path = o->lora;
  cfg.backend = o->backend;
  cfg.policy = se->policy;
  cfg.evict_scope = se->scope;
  cfg.evict_groups = se->scope == LF_EVICT_LAYER ? o->evict_groups : 0;
  cfg.budget = g->budget;
  cfg.sink = o->sink;
  cfg.window = o->window;
  cfg.h2o_recent = o->h2o_recent;
  cfg.rkv_stage = o->rkv_stage;
  cfg.rkv_obs = o->rkv_obs;
  if (se->policy != LF_POLICY_FULL) { /* per-layer budgets: the evicting series */
    cfg.layer_weights = o->layer_weights;
    cfg.n_layer_weights = o->n_layer_weights;
  }
  cfg.kv_dtype = o->kv_dtype;
  cfg.key_means = o->key_means;
  cfg.n_key_means = o->n_key_means;
  cfg.max_batch_tokens = o->max_batch_tokens;
  cfg.n_threads = o->threads;
  g->pools = g->n < o->max_concurrent ? g->n : o->max_concurrent;
  cfg.n_pools = g->pools;
  lf_engine_t e = NULL;
  const double t0 = lf_now_s();
  g->start_s = t0 - c->t0;
  lf_status s = lf_engine_init(&cfg, NULL, &e);
  g->init_s = lf_now_s() - t0;
  enum { EV_CAP = 1024 };
  lf_event *ev = NULL;
  if (s == LF_OK && !(ev = malloc(sizeof *ev * EV_CAP))) s = LF_ERR_OUT_OF_MEMORY;
  if (s != LF_OK) {
    pthread_mutex_lock(&c->lock);
    for (int i = 0; i < g->n; i++) {
      ev_run *r = &c->runs[g->runs[i]];
      run_fail(r, "engine init: %s: %s", s, lf_last_error());
      r->finished = 1;
      score_run(c, r);
      g->errors++;
      print_progress(c, r);
    }
    pthread_mutex_unlock(&c->lock);
    lf_engine_free(e);
    return;
  }
  int open = 0;
  for (int i = 0; i < g->n; i++) {
    ev_run *r = &c->runs[g->runs[i]];
    const ev_problem *p = &c->probs[r->problem];
    lf_request rq;
    memset(&rq, 0, sizeof rq);
    rq.prompt = p->prompt;
    rq.n_prompt = p->n_prompt;
    rq.max_tokens = r->max_tokens; /* greedy: sampling all zero */
    if (c->o->teacher_forced) { /* every expected id fed, <eos> included; EOS does not stop it */
      rq.forced = p->want;
      rq.n_forced = p->n_want;
      rq.max_tokens = r->max_tokens = p->n_want;
    }
    s = lf_engine_submit(e, &rq, &r->req_id);
    if (s != LF_OK) {
      pthread_mutex_lock(&c->lock);
      run_fail(r, "submit: %s: %s", s, lf_last_error());
      r->finished = 1;
      score_run(c, r);
      g->errors++;
      print_progress(c, r);
      pthread_mutex_unlock(&c->lock);
      continue;
    }
    open++;
  }
  while (open > 0 && lf_engine_busy(e)) {
    int n = 0;
    s = lf_engine_step(e, ev, EV_CAP, &n);
    if (s != LF_OK) break;
    for (int k = 0; k < n; k++) {
      /* ids are 1, 2, ... in submit order: guess, then scan */
      int i = (int)ev[k].id - 1;
      if (i < 0 || i >= g->n || c->runs[g->runs[i]].req_id != ev[k].id)
        for (i = 0; i < g->n && c->runs[g->runs[i]].req_id != ev[k].id; i++) {
        }
      if (i >= g->n) continue;
      ev_run *r = &c->runs[g->runs[i]];
      if (r->finished) continue;
      if (ev[k].type == LF_EVENT_TOKEN) {
        if (run_push(r, ev[k].token)) {
          lf_engine_cancel(e, r->req_id);
          run_fail(r, "%s: %s", LF_ERR_OUT_OF_MEMORY, "token list");
        }
        g->tokens++;
        continue;
      }
      /* FINISH: the EOS is not emitted as a token; gen.check wants it at the end */
      r->reason = ev[k].reason;
      if (ev[k].reason == LF_FINISH_EOS && ev[k].token >= 0) {
        run_push(r, ev[k].token);
        g->tokens++;
      }
      if (ev[k].reason == LF_FINISH_ERROR) run_fail(r, "generation: %s%s", ev[k].status, "");
      lf_request_stats st;
      if (lf_engine_request_stats(e, r->req_id, &st) == LF_OK) {
        r->have_stats = 1;
        r->evictions = st.evictions;
        r->tokens_per_s = st.tpot_seconds > 0 ? 1.0 / st.tpot_seconds : 0.0;
        r->seconds = st.total_seconds;
      }
      score_run(c, r);
      pthread_mutex_lock(&c->lock);
      r->finished = 1;
      if (r->rc) g->errors++;
      print_progress(c, r);
      pthread_mutex_unlock(&c->lock);
      open--;
    }
  }
  if (open > 0) { /* the engine failed: the rest of the group fails with it */
    const char *msg = s != LF_OK ? lf_last_error() : "the engine went idle";
    if (s == LF_OK) s = LF_ERR_INTERNAL;
    pthread_mutex_lock(&c->lock);
    for (int i = 0; i < g->n; i++) {
      ev_run *r = &c->runs[g->runs[i]];
      if (r->finished) continue;
      run_fail(r, "step: %s: %s", s, msg);
      r->finished = 1;
      score_run(c, r);
      g->errors++;
      print_progress(c, r);
    }
    pthread_mutex_unlock(&c->lock);
  }
  g->wall_s = lf_now_s() - t0;
  free(ev);
  lf_engine_free(e);
}

static void *worker(void *arg) {
  ev_ctx *c = arg;
  for (;;) {
    pthread_mutex_lock(&c->lock);
    const int k = c->next < c->n_groups ? c->order[c->next++] : -1;
    pthread_mutex_unlock(&c->lock);
    if (k < 0) return NULL;
    run_group(c, &c->groups[k]);
  }
}


/* Series in eval.py's order: full, longflow (every scope), streaming, h2o and rkv (every
 * scope). */
static void make_series(ev_ctx *c) {
  const lf_policy order[] = {LF_POLICY_FULL, LF_POLICY_LONGFLOW, LF_POLICY_STREAMING,
                             LF_POLICY_H2O, LF_POLICY_RKV};
  for (int i = 0; i < 5; i++) {
    if (!c->o->want_policy[order[i]]) continue;
    for (int sc = 0; sc < 2; sc++) {
      const int scoped = order[i] != LF_POLICY_FULL && order[i] != LF_POLICY_STREAMING;
      if (scoped ? !c->o->want_scope[sc] : sc != LF_EVICT_HEAD) continue;
      ev_series *se = &c->series[c->n_series++];
      se->policy = order[i];
      se->scope = (lf_evict_scope)sc;
      snprintf(se->name, sizeof se->name, "%s%s%s", lf_policy_str(order[i]),
               sc == LF_EVICT_HEAD ? "" : "-", sc == LF_EVICT_HEAD ? "" : lf_evict_scope_str(sc));
    }
  }
}

/* Runs (problem-major, as eval.py sorts them) and their groups. */
static int make_runs(ev_ctx *c, int ctx_len) {
  const ev_opts *o = c->o;
  int per_problem = 0;
  for (int s = 0; s < c->n_series; s++)
    per_problem += c->series[s].policy == LF_POLICY_FULL ? 1 : o->n_fractions;
  c->n_runs = per_problem * c->n_probs;
  c->runs = calloc((size_t)c->n_runs, sizeof *c->runs);
  if (!c->runs) return -1;
  int full_budget = ctx_len;
  if (!o->full_ctx) {
    full_budget = 1;
    for (int i = 0; i < c->n_probs; i++) {
      const long long b =
          (long long)c->probs[i].prompt_tokens + c->probs[i].output_tokens + o->margin;
      if (b > full_budget) full_budget = b > ctx_len ? ctx_len : (int)b;
    }
  }
  int k = 0;
  for (int i = 0; i < c->n_probs; i++)
    for (int s = 0; s < c->n_series; s++) {
      const int full = c->series[s].policy == LF_POLICY_FULL;
      for (int f = full ? -1 : 0; f < (full ? 0 : o->n_fractions); f++) {
        ev_run *r = &c->runs[k++];
        r->problem = i;
        r->series = s;
        r->fi = f;
        r->max_tokens = c->probs[i].output_tokens + o->margin;
        r->first_error = -1;
        if (full) {
          r->budget = full_budget;
        } else {
          const int base = o->budget_of_live ? c->probs[i].live_tokens : c->probs[i].output_tokens;
          const double b = ceil(o->fractions[f] * (double)base);
          long long bb = b < 1 ? 1 : b > (double)INT_MAX ? INT_MAX : (long long)b;
          bb = (bb + o->budget_round - 1) / o->budget_round * o->budget_round;
          r->budget = bb > INT_MAX ? INT_MAX : (int)bb;
        }
      }
    }
  /* Groups: per (series, fraction), one per distinct budget. */
  c->groups = calloc((size_t)c->n_runs, sizeof *c->groups);
  c->order = calloc((size_t)c->n_runs, sizeof *c->order);
  int *budgets = malloc(sizeof(int) * (size_t)c->n_probs);
  if (!c->groups || !c->order || !budgets) {
    free(budgets);
    return -1;
  }
  for (int s = 0; s < c->n_series; s++) {
    const int full = c->series[s].policy == LF_POLICY_FULL;
    for (int f = full ? -1 : 0; f < (full ? 0 : o->n_fractions); f++) {
      int nb = 0;
      for (int r = 0; r < c->n_runs; r++)
        if (c->runs[r].series == s && c->runs[r].fi == f) budgets[nb++] = c->runs[r].budget;
      qsort(budgets, (size_t)nb, sizeof *budgets, ev_cmp_int);
      for (int j = 0; j < nb; j++) {
        if (j && budgets[j] == budgets[j - 1]) continue;
        ev_group *g = &c->groups[c->n_groups++];
        g->series = s;
        g->fi = f;
        g->budget = budgets[j];
        g->runs = malloc(sizeof(int) * (size_t)nb);
        if (!g->runs) {
          free(budgets);
          return -1;
        }
        for (int r = 0; r < c->n_runs; r++)
          if (c->runs[r].series == s && c->runs[r].fi == f && c->runs[r].budget == g->budget) {
            c->runs[r].group = (int)(g - c->groups);
            g->runs[g->n++] = r;
          }
      }
    }
  }
  free(budgets);
  return 0;
}

/* Largest work first (output tokens x budget), so --jobs ends together. */
static const ev_ctx *sort_ctx;
static double group_work(const ev_group *g) {
  double t = 0;
  for (int i = 0; i < g->n; i++)
    t += sort_ctx->runs[g->runs[i]].max_tokens;
  return t * (64.0 + (double)g->budget);
}
static int cmp_group(const void *a, const void *b) {
  const double x = group_work(&sort_ctx->groups[*(const int *)a]),
               y = group_work(&sort_ctx->groups[*(const int *)b]);
  return (x < y) - (x > y);
}

/* ---- main --------------------------------------------------------------------------------- */

int bench_eval(int argc, char **argv) {
  ev_opts o;
  if (ev_parse(argc, argv, &o)) {
    ev_usage(stderr);
    return 2;
  }
  lf_model_config mc;
  if (bench_model_config(EV_NAME, o.model, &mc)) return 1;
  lf_status s;

  char tpath[4096];
  if (o.tokenizer)
    snprintf(tpath, sizeof tpath, "%s", o.tokenizer);
  else
    snprintf(tpath, sizeof tpath, "%s/tokenizer.json", o.model);
  lf_tokenizer *tok = NULL;
  s = lf_tokenizer_init_file(tpath, &tok);
  if (s != LF_OK) {
    fprintf(stderr, EV_NAME ": tokenizer %s: %s: %s\n", tpath, lf_status_str(s), lf_last_error());
    return 1;
  }
  /* The eos that ends a trace: the model's first EOS id, else the tokenizer's <eos>. */
  int eos = mc.n_eos > 0 ? mc.eos_ids[0] : lf_tokenizer_token_to_id(tok, "<eos>");
  if (mc.n_eos == 0)
    fprintf(stderr, EV_NAME ": warning: the model has no eos_token_id: runs go to max tokens\n");
  else if (lf_tokenizer_token_to_id(tok, "<eos>") >= 0 &&
           lf_tokenizer_token_to_id(tok, "<eos>") != eos)
    fprintf(stderr, EV_NAME ": warning: the model's eos_token_id is %d, the tokenizer's <eos> %d\n",
            eos, lf_tokenizer_token_to_id(tok, "<eos>"));

  ev_ctx c;
  memset(&c, 0, sizeof c);
  c.o = &o;
  c.tok = tok;
  c.eos = eos;
  c.n_probs = ev_load_problems(&o, tok, eos, &c.probs);
  if (c.n_probs < 0) {
    lf_tokenizer_free(tok);
    return 2;
  }
  int too_long = 0, min_out = INT_MAX, max_out = 0;
  for (int i = 0; i < c.n_probs; i++) {
    too_long += c.probs[i].prompt_tokens + c.probs[i].output_tokens > mc.max_seq_len;
    if (c.probs[i].output_tokens < min_out) min_out = c.probs[i].output_tokens;
    if (c.probs[i].output_tokens > max_out) max_out = c.probs[i].output_tokens;
  }
  if (too_long)
    fprintf(stderr, EV_NAME ": warning: %d problems exceed the model's context %d\n", too_long,
            mc.max_seq_len);
  make_series(&c);
  int rc = 0;
  if (make_runs(&c, mc.max_seq_len)) {
    fprintf(stderr, EV_NAME ": out of memory\n");
    rc = 1;
    goto out;
  }
  sort_ctx = &c;
  for (int i = 0; i < c.n_groups; i++)
    c.order[i] = i;
  qsort(c.order, (size_t)c.n_groups, sizeof *c.order, cmp_group);

  /* auto resolved as lf_backend_create does */
  const char *backend =
      lf_backend_str(o.backend == LF_BACKEND_CUDA ? LF_BACKEND_CUDA : LF_BACKEND_CPU);
#ifdef LF_HAVE_CUDA_BACKEND
  if (o.backend == LF_BACKEND_AUTO && lf_cuda_device_present())
    backend = lf_backend_str(LF_BACKEND_CUDA);
#endif
  printf("%d problems (output tokens %d..%d), %d series, %d fractions: %d runs in %d engine "
         "groups, %d at once, up to %d pools each; backend %s%s\n",
         c.n_probs, min_out, max_out, c.n_series, o.n_fractions, c.n_runs, c.n_groups, o.jobs,
         o.max_concurrent, backend,
         o.budget_round > 1 ? ", budgets rounded up to a multiple of --budget-round" : "");
  fflush(stdout);
  if (pthread_mutex_init(&c.lock, NULL)) {
    rc = 1;
    goto out;
  }
  c.t0 = lf_now_s();
  const int nw = o.jobs < c.n_groups ? o.jobs : c.n_groups;
  if (nw <= 1) {
    worker(&c);
  } else {
    pthread_t th[1024];
    int started = 0;
    for (; started < nw; started++)
      if (pthread_create(&th[started], NULL, worker, &c)) break;
    if (!started) worker(&c);
    for (int i = 0; i < started; i++)
      pthread_join(th[i], NULL);
  }
  const double wall = lf_now_s() - c.t0;
  pthread_mutex_destroy(&c.lock);

  int *fe = malloc(sizeof(int) * (size_t)(c.n_probs + 1));
  if (!fe) {
    rc = 1;
    goto out;
  }
  ev_print_table(&c, fe);
  int failed = 0;
  for (int i = 0; i < c.n_runs; i++)
    failed += c.runs[i].rc != 0;
  printf("%d runs in %.1f s (%d engine groups)%s\n", c.n_runs, wall, c.n_groups,
         failed ? "; some runs failed (their errors are in the table and the JSON)" : "");
  if (o.json) {
    if (ev_write_json(&c, backend, wall, fe))
      rc = 1;
    else
      printf("wrote %s\n", o.json);
  }
  free(fe);
out:
  for (int i = 0; i < c.n_runs; i++) {
    free(c.runs[i].ids);
    free(c.runs[i].error);
    free(c.runs[i].answer);
  }
  for (int i = 0; i < c.n_groups; i++)
    free(c.groups[i].runs);
  free(c.runs);
  free(c.groups);
  free(c.order);
  ev_problems_free(c.probs, c.n_probs);
  lf_tokenizer_free(tok);
  return rc;
}

/* lfbench eval: the small helpers, the summary per series and fraction, the table and the JSON
 * in tools/task/eval.py's schema (bench/bench_eval.c says what it measures). */
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
#include "engine/backend.h"
#include "engine/model.h"
#include "lfserve.h"
#include "text/json.h"
#include "text/tokenizer.h"

/* ---- small helpers ----------------------------------------------------------------------- */

char *ev_strdup(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = malloc(n);
  if (d) memcpy(d, s, n);
  return d;
}

/* A double as Python's repr() writes it (shortest round-trip digits; "0.2", "1.0", "1e-05"), so
 * the summary keys equal eval.py's str(fraction). */
void ev_py_float(double x, char *out, size_t cap) {
  if (!isfinite(x)) {
    snprintf(out, cap, "%s", isnan(x) ? "NaN" : x > 0 ? "Infinity" : "-Infinity");
    return;
  }
  if (x == 0) {
    snprintf(out, cap, "%s", signbit(x) ? "-0.0" : "0.0");
    return;
  }
  char e[40];
  int p = 1;
  for (; p <= 17; p++) {
    snprintf(e, sizeof e, "%.*e", p - 1, x);
    if (strtod(e, NULL) == x) break;
  }
  /* e = [-]d[.ddd]e[+-]XX: the digits and the decimal exponent */
  char digits[24];
  int nd = 0, neg = e[0] == '-';
  const char *c = e + neg;
  for (; *c && *c != 'e'; c++)
    if (*c >= '0' && *c <= '9') digits[nd++] = *c;
  while (nd > 1 && digits[nd - 1] == '0')
    nd--;
  digits[nd] = '\0';
  const int exp10 = atoi(c + 1);
  char buf[64];
  size_t k = 0;
  if (neg) buf[k++] = '-';
  if (exp10 >= -4 && exp10 < 16) {
    if (exp10 < 0) {
      buf[k++] = '0';
      buf[k++] = '.';
      for (int i = 0; i < -exp10 - 1; i++)
        buf[k++] = '0';
      for (int i = 0; i < nd; i++)
        buf[k++] = digits[i];
    } else {
      for (int i = 0; i <= exp10; i++)
        buf[k++] = i < nd ? digits[i] : '0';
      buf[k++] = '.';
      if (nd > exp10 + 1)
        for (int i = exp10 + 1; i < nd; i++)
          buf[k++] = digits[i];
      else
        buf[k++] = '0';
    }
    buf[k] = '\0';
  } else {
    buf[k++] = digits[0];
    if (nd > 1) {
      buf[k++] = '.';
      for (int i = 1; i < nd; i++)
        buf[k++] = digits[i];
    }
    snprintf(buf + k, sizeof buf - k, "e%c%02d", exp10 < 0 ? '-' : '+', abs(exp10));
  }
  snprintf(out, cap, "%s", buf);
}

/* A JSON string literal. */
static void json_str(FILE *f, const char *s, size_t n) {
  fputc('"', f);
  for (size_t i = 0; i < n; i++) {
    const unsigned char ch = (unsigned char)s[i];
    if (ch == '"' || ch == '\\')
      fprintf(f, "\\%c", ch);
    else if (ch == '\n')
      fputs("\\n", f);
    else if (ch == '\t')
      fputs("\\t", f);
    else if (ch == '\r')
      fputs("\\r", f);
    else if (ch < 0x20)
      fprintf(f, "\\u%04x", ch);
    else
      fputc(ch, f);
  }
  fputc('"', f);
}
static void json_cstr(FILE *f, const char *s) {
  if (s)
    json_str(f, s, strlen(s));
  else
    fputs("null", f);
}
static void json_num(FILE *f, double x) {
  char b[64];
  if (!isfinite(x)) {
    fputs("null", f);
    return;
  }
  ev_py_float(x, b, sizeof b);
  fputs(b, f);
}

/* Writes a parsed JSON value back out (compact), e.g. a problem's "lookback" object. */
static void json_value(FILE *f, const lf_json *v) {
  switch (lf_json_typeof(v)) {
  case LF_JSON_NULL:
    fputs("null", f);
    break;
  case LF_JSON_BOOL:
    fputs(v->boolean ? "true" : "false", f);
    break;
  case LF_JSON_NUMBER:
    if (v->is_int)
      fprintf(f, "%lld", (long long)v->i64);
    else
      json_num(f, v->num);
    break;
  case LF_JSON_STRING:
    json_str(f, v->str, v->len);
    break;
  case LF_JSON_ARRAY:
  case LF_JSON_OBJECT: {
    const int obj = v->type == LF_JSON_OBJECT;
    fputc(obj ? '{' : '[', f);
    for (size_t i = 0; i < v->len; i++) {
      if (i) fputs(", ", f);
      if (obj) {
        json_str(f, v->items[i].key, v->items[i].key_len);
        fputs(": ", f);
      }
      json_value(f, &v->items[i]);
    }
    fputc(obj ? '}' : ']', f);
    break;
  }
  }
}

/* Fraction fi of the grid, null for full (fi -1). */
static void json_fraction(FILE *f, const ev_opts *o, int fi) {
  if (fi >= 0)
    json_num(f, o->fractions[fi]);
  else
    fputs("null", f);
}

int ev_cmp_int(const void *a, const void *b) {
  const int x = *(const int *)a, y = *(const int *)b;
  return (x > y) - (x < y);
}

/* ---- summary ------------------------------------------------------------------------------ */

typedef struct ev_sum {
  int n, errors, n_ev;
  double accuracy, trace_exact, mean_evictions;
  double token_error; /* teacher forcing: wrong positions / expected positions */
  int median_first_error;
} ev_sum;

static void summarize(const ev_ctx *c, int s, int f, ev_sum *out, int *fe) {
  memset(out, 0, sizeof *out);
  int ok = 0, tr = 0;
  double ev = 0, wrong = 0, want = 0;
  for (int i = 0; i < c->n_runs; i++) {
    const ev_run *r = &c->runs[i];
    if (r->series != s || r->fi != f) continue;
    fe[out->n++] = r->first_error >= 0 ? r->first_error : c->probs[r->problem].output_tokens;
    ok += r->answer_ok;
    tr += r->trace_ok;
    wrong += r->tf_wrong;
    want += c->probs[r->problem].n_want;
    out->errors += r->rc != 0;
    if (r->have_stats) {
      ev += (double)r->evictions;
      out->n_ev++;
    }
  }
  if (!out->n) return;
  qsort(fe, (size_t)out->n, sizeof *fe, ev_cmp_int);
  out->accuracy = (double)ok / out->n;
  out->trace_exact = (double)tr / out->n;
  out->median_first_error = fe[out->n / 2];
  out->mean_evictions = out->n_ev ? ev / out->n_ev : 0;
  out->token_error = want > 0 ? wrong / want : 0;
}

void ev_print_table(const ev_ctx *c, int *fe) {
  printf("\n%-15s %7s %4s %9s %7s %8s %10s%s\n", "policy", "budget", "n", "accuracy", "trace",
         "1st err", "evictions", c->o->teacher_forced ? "  tok err" : "");
  for (int s = 0; s < c->n_series; s++) {
    const int full = c->series[s].policy == LF_POLICY_FULL;
    for (int f = full ? -1 : 0; f < (full ? 0 : c->o->n_fractions); f++) {
      ev_sum m;
      summarize(c, s, f, &m, fe);
      if (!m.n) continue;
      char b[32], evs[32] = "";
      if (full)
        snprintf(b, sizeof b, "%s", c->o->full_ctx ? "ctx" : "fit");
      else
        snprintf(b, sizeof b, c->o->budget_of_live ? "%gxlive" : "%g%%",
                 c->o->budget_of_live ? c->o->fractions[f] : 100 * c->o->fractions[f]);
      if (m.n_ev) snprintf(evs, sizeof evs, "%.0f", m.mean_evictions);
      printf("%-15s %7s %4d %8.1f%% %6.1f%% %8d %10s", c->series[s].name, b, m.n, 100 * m.accuracy,
             100 * m.trace_exact, m.median_first_error, evs);
      if (c->o->teacher_forced) printf(" %8.3f%%", 100 * m.token_error);
      if (m.errors) printf("  (%d runs failed)", m.errors);
      printf("\n");
    }
  }
}

/* The opening object: model, problems file, backend, engine settings and the grid (fractions,
 * scopes, policies), up to the "problems" array's bracket. */
static void json_write_header(FILE *f, const ev_opts *o, const char *backend, double wall) {
  char path[PATH_MAX];
  const char *model = realpath(o->model, path) ? path : o->model;
  fprintf(f, "{\"task\": \"trace\", \"runner\": \"lfbench\", \"model\": ");
  json_cstr(f, model);
  fprintf(f, ", \"problems_file\": ");
  json_cstr(f, o->problems);
  fprintf(f,
          ", \"backend\": \"%s\",\n \"engine\": {\"sink\": %d, \"window\": %d, \"h2o_recent\": %d, "
          "\"rkv_stage\": %d, \"rkv_obs\": %d, \"max_batch_tokens\": %d, \"threads\": %d, \"jobs\": %d, \"max_concurrent\": %d, "
          "\"full_budget\": \"%s\", \"evict_groups\": %d, \"kv_dtype\": \"%s\", "
          "\"layer_weights\": ",
          backend, o->sink, o->window, o->h2o_recent,
          o->rkv_stage ? o->rkv_stage : LF_RKV_STAGE_DEFAULT, o->rkv_obs, o->max_batch_tokens, o->threads, o->jobs,
          o->max_concurrent, o->full_ctx ? "ctx" : "fit", o->evict_groups,
          lf_kv_dtype_str(o->kv_dtype));
  if (o->layer_weights_path)
    json_cstr(f, o->layer_weights_path);
  else
    fputs("null", f);
  fputs(", \"key_means\": ", f);
  if (o->key_means_path)
    json_cstr(f, o->key_means_path);
  else
    fputs("null", f);
  fprintf(f, "},\n \"teacher_forced\": %s, \"budget_of\": \"%s\", \"budget_round\": %d, "
          "\"fractions\": [",
          o->teacher_forced ? "true" : "false", o->budget_of_live ? "live" : "output",
          o->budget_round);
  for (int i = 0; i < o->n_fractions; i++) {
    if (i) fputs(", ", f);
    json_num(f, o->fractions[i]);
  }
  fprintf(f, "], \"scopes\": [");
  for (int sc = 0, k = 0; sc < 2; sc++)
    if (o->want_scope[sc]) fprintf(f, "%s\"%s\"", k++ ? ", " : "", lf_evict_scope_str(sc));
  fprintf(f, "], \"policies\": [");
  {
    const lf_policy order[] = {LF_POLICY_FULL, LF_POLICY_LONGFLOW, LF_POLICY_STREAMING,
                               LF_POLICY_H2O, LF_POLICY_RKV};
    for (int i = 0, k = 0; i < 5; i++)
      if (o->want_policy[order[i]])
        fprintf(f, "%s\"%s\"", k++ ? ", " : "", lf_policy_str(order[i]));
  }
  fprintf(f, "], \"margin\": %d, \"wall_s\": %.3f,\n \"problems\": [\n", o->margin, wall);
}

/* The "problems" array's rows: id, prompt and output lengths, lookback. */
static void json_write_problems(FILE *f, const ev_ctx *c) {
  for (int i = 0; i < c->n_probs; i++) {
    const ev_problem *p = &c->probs[i];
    fprintf(f, "  {\"id\": ");
    json_cstr(f, p->id);
    fprintf(f, ", \"prompt_tokens\": %d, \"output_tokens\": %d, \"lookback\": ", p->prompt_tokens,
            p->output_tokens);
    json_value(f, lf_json_get(p->doc, "lookback"));
    fprintf(f, "}%s\n", i + 1 < c->n_probs ? "," : "");
  }
}

/* The "groups" array's rows: one per (series, fraction) engine, with its timings and tokens. */
static void json_write_groups(FILE *f, const ev_ctx *c) {
  for (int i = 0; i < c->n_groups; i++) {
    const ev_group *g = &c->groups[i];
    fprintf(f, "  {\"series\": \"%s\", \"fraction\": ", c->series[g->series].name);
    json_fraction(f, c->o, g->fi);
    fprintf(f,
            ", \"budget\": %d, \"runs\": %d, \"pools\": %d, \"start_s\": %.3f, \"init_s\": "
            "%.3f, \"wall_s\": %.3f, \"tokens\": %llu, \"tokens_per_s\": %.1f, \"errors\": %d}%s\n",
            g->budget, g->n, g->pools, g->start_s, g->init_s, g->wall_s,
            (unsigned long long)g->tokens, g->wall_s > 0 ? (double)g->tokens / g->wall_s : 0.0,
            g->errors, i + 1 < c->n_groups ? "," : "");
  }
}

/* The "summary" object's members: per series, one object keyed by fraction (eval.py's
 * str(fraction); "all" for full KV) of the summarize() figures. */
static void json_write_summary(FILE *f, const ev_ctx *c, int *fe) {
  const ev_opts *o = c->o;
  int first_series = 1;
  for (int s = 0; s < c->n_series; s++) {
    const int full = c->series[s].policy == LF_POLICY_FULL;
    int first_row = 1;
    for (int fi = full ? -1 : 0; fi < (full ? 0 : o->n_fractions); fi++) {
      ev_sum m;
      summarize(c, s, fi, &m, fe);
      if (!m.n) continue;
      if (first_row) fprintf(f, "%s\n  \"%s\": {", first_series ? "" : ",", c->series[s].name);
      first_series = 0;
      char key[32] = "all";
      if (!full) ev_py_float(o->fractions[fi], key, sizeof key);
      fprintf(f, "%s\"%s\": {\"n\": %d, \"accuracy\": ", first_row ? "" : ", ", key, m.n);
      first_row = 0;
      json_num(f, m.accuracy);
      fprintf(f, ", \"trace_exact\": ");
      json_num(f, m.trace_exact);
      fprintf(f, ", \"median_first_error\": %d, \"mean_evictions\": ", m.median_first_error);
      if (m.n_ev)
        json_num(f, m.mean_evictions);
      else
        fputs("null", f);
      if (o->teacher_forced) {
        fprintf(f, ", \"token_error\": ");
        json_num(f, m.token_error);
      }
      fprintf(f, ", \"errors\": %d}", m.errors);
    }
    if (!first_row) fputc('}', f);
  }
}

/* One row of the "runs" array, without its trailing comma and newline. */
static void json_write_run(FILE *f, const ev_ctx *c, const ev_run *r) {
  const ev_opts *o = c->o;
  const ev_problem *p = &c->probs[r->problem];
  const ev_series *se = &c->series[r->series];
  fprintf(f, "  {\"problem\": ");
  json_cstr(f, p->id);
  fprintf(f, ", \"policy\": \"%s\", \"scope\": \"%s\", \"fraction\": ", lf_policy_str(se->policy),
          lf_evict_scope_str(se->scope));
  json_fraction(f, o, r->fi);
  fprintf(f,
          ", \"budget\": %d, \"prompt_tokens\": %d, \"output_tokens\": %d, \"max_tokens\": "
          "%d, \"rc\": %d, \"finish\": ",
          r->budget, p->prompt_tokens, p->output_tokens, r->max_tokens, r->rc);
  if (r->finished && r->reason != LF_FINISH_NONE)
    fprintf(f, "\"%s\"", lf_finish_reason_str(r->reason));
  else
    fputs("null", f);
  fprintf(f, ", \"evictions\": ");
  if (r->have_stats)
    fprintf(f, "%llu", (unsigned long long)r->evictions);
  else
    fputs("null", f);
  fprintf(f, ", \"tokens_per_s\": ");
  if (r->have_stats)
    json_num(f, round(r->tokens_per_s * 10) / 10);
  else
    fputs("null", f);
  fprintf(f, ", \"seconds\": ");
  if (r->have_stats)
    json_num(f, round(r->seconds * 1000) / 1000);
  else
    fputs("null", f);
  fprintf(f, ", \"group\": %d, \"answer_ok\": %s, \"trace_ok\": %s, \"first_error\": ", r->group,
          r->answer_ok ? "true" : "false", r->trace_ok ? "true" : "false");
  if (r->first_error >= 0)
    fprintf(f, "%d", r->first_error);
  else
    fputs("null", f);
  fprintf(f, ", \"answer\": ");
  json_cstr(f, r->answer);
  fprintf(f, ", \"stopped\": %s, \"generated\": %d", r->stopped ? "true" : "false", r->n_ids);
  if (o->teacher_forced) { /* positions of the expected output whose greedy token differs */
    fprintf(f, ", \"tf_wrong\": %d, \"tf_wrong_at\": [", r->tf_wrong);
    for (int j = 0, k = 0; j < p->n_want; j++)
      if (ev_wrong_at(p, r, j)) fprintf(f, k++ ? ",%d" : "%d", j);
    fputc(']', f);
  }
  if (r->error) {
    fprintf(f, ", \"stderr\": ");
    json_cstr(f, r->error);
  }
  if (o->ids) {
    fprintf(f, ",\n   \"prompt_ids\": [");
    for (int j = 0; j < p->n_prompt; j++)
      fprintf(f, j ? ",%d" : "%d", p->prompt[j]);
    fprintf(f, "],\n   \"ids\": [");
    for (int j = 0; j < r->n_ids; j++)
      fprintf(f, j ? ",%d" : "%d", r->ids[j]);
    fputc(']', f);
  }
  fputc('}', f);
}

/* The JSON in eval.py's schema, written to o->json's .tmp and renamed over it when whole:
 * header, problems, groups, summary, runs. */
int ev_write_json(const ev_ctx *c, const char *backend, double wall, int *fe) {
  const ev_opts *o = c->o;
  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s.tmp", o->json);
  FILE *f = fopen(tmp, "w");
  if (!f) {
    fprintf(stderr, EV_NAME ": cannot write %s: %s\n", tmp, strerror(errno));
    return 1;
  }
  json_write_header(f, o, backend, wall);
  json_write_problems(f, c);
  fprintf(f, " ],\n \"groups\": [\n");
  json_write_groups(f, c);
  fprintf(f, " ],\n \"summary\": {");
  json_write_summary(f, c, fe);
  fprintf(f, "},\n \"runs\": [\n");
  for (int i = 0; i < c->n_runs; i++) {
    json_write_run(f, c, &c->runs[i]);
    fprintf(f, "%s\n", i + 1 < c->n_runs ? "," : "");
  }
  fprintf(f, " ]}\n");
  const int bad = ferror(f);
  if (fclose(f) || bad || rename(tmp, o->json)) {
    fprintf(stderr, EV_NAME ": cannot write %s\n", o->json);
    remove(tmp);
    return 1;
  }
  return 0;
}

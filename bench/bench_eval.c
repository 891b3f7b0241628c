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
#include "engine/backend.h"
#include "text/json.h"
#include "engine/model.h"
#include "text/tokenizer.h"
#include "lfserve.h"

int bench_eval(int argc, char **argv);

#define EV_MAX_FRACTIONS 16
#define EV_NAME "lfbench eval"

/* ---- small helpers ----------------------------------------------------------------------- */

static char *ev_strdup(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = malloc(n);
  if (d) memcpy(d, s, n);
  return d;
}

/* A double as Python's repr() writes it (shortest round-trip digits; "0.2", "1.0", "1e-05"), so
 * the summary keys equal eval.py's str(fraction). */
static void py_float(double x, char *out, size_t cap) {
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
  py_float(x, b, sizeof b);
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

/* ---- options ------------------------------------------------------------------------------ */

typedef struct ev_series {
  lf_policy policy;
  lf_evict_scope scope;
  char name[32]; /* "longflow", "longflow-layer": eval.py's series_name */
} ev_series;

typedef struct ev_opts {
  const char *model, *problems, *json, *tokenizer;
  lf_backend_kind backend;
  int want_policy[4]; /* by lf_policy */
  int want_scope[2];  /* by lf_evict_scope */
  double fractions[EV_MAX_FRACTIONS];
  int n_fractions;
  int margin, max_concurrent, jobs, threads, sink, window, max_batch_tokens, budget_round;
  int full_ctx, limit, ids, quiet;
} ev_opts;

static void eval_usage(FILE *f) {
  fprintf(f,
          "usage: lfbench eval --model DIR --problems FILE.jsonl [options]\n"
          "Accuracy against KV budget on trace-task problems (tools/task/gen.py --out), every\n"
          "series run through the engine's scheduler, one engine per (series, budget) group.\n"
          "  --model DIR          HF model directory (its tokenizer.json encodes the prompts)\n"
          "  --problems FILE      JSON lines: id, prompt, output, answer, prompt_tokens,\n"
          "                       output_tokens (gen.py --out)\n"
          "  --n N                first N problems only (default 0: all)\n"
          "  --policies LIST      comma list of full, longflow, streaming, h2o (default all)\n"
          "  --fractions LIST     budgets as fractions of each problem's output length\n"
          "                       (default 0.05,0.1,0.2,0.4): ceil(fraction x output_tokens)\n"
          "  --scopes LIST        eviction scopes for longflow: head, layer (default head;\n"
          "                       layer: cpu backend only)\n"
          "  --budget-round Q     round budgets up to a multiple of Q: fewer, larger groups\n"
          "                       (default 1: exact budgets)\n"
          "  --full-budget fit|ctx  full's pool: the largest prompt + output + margin (fit,\n"
          "                       default) or the model's context\n"
          "  --margin M           max tokens = output_tokens + M (default 32)\n"
          "  --max-concurrent K   pools per engine: min(group size, K) (default 64)\n"
          "  --jobs J             groups run at once, each engine in its own thread (default 1)\n"
          "  --backend B          auto | cpu | cuda (default auto)\n"
          "  --threads T          cpu backend threads per engine (default 0: all cores with\n"
          "                       --jobs 1, else 1)\n"
          "  --sink S --window W  policy parameters as lfgen (default 4 32)\n"
          "  --max-batch-tokens N prompt tokens per step (default 0: whole prompts)\n"
          "  --tokenizer FILE     tokenizer.json (default MODEL/tokenizer.json)\n"
          "  --json FILE          write runs + summary (tools/task/eval.py's schema)\n"
          "  --ids                also write every run's prompt and generated token ids\n"
          "  --quiet              no per-run progress lines\n");
}

static int parse_int_opt(const char *name, const char *v, long lo, long hi, int *out) {
  char *end;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (errno || end == v || *end || x < lo || x > hi) {
    fprintf(stderr, EV_NAME ": bad value '%s' for %s (an integer in [%ld, %ld])\n", v, name, lo,
            hi);
    return -1;
  }
  *out = (int)x;
  return 0;
}

static int parse_list(const char *name, const char *s, int (*item)(const char *, ev_opts *),
                      ev_opts *o) {
  char buf[512];
  if (strlen(s) >= sizeof buf) {
    fprintf(stderr, EV_NAME ": %s: list too long\n", name);
    return -1;
  }
  snprintf(buf, sizeof buf, "%s", s);
  int n = 0;
  char *save = NULL;
  for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save), n++)
    if (item(t, o)) return -1;
  if (!n) {
    fprintf(stderr, EV_NAME ": %s: empty list\n", name);
    return -1;
  }
  return 0;
}
static int policy_item(const char *t, ev_opts *o) {
  lf_policy p;
  if (lf_policy_parse(t, &p) != LF_OK) {
    fprintf(stderr, EV_NAME ": unknown policy '%s' (full, longflow, streaming, h2o)\n", t);
    return -1;
  }
  o->want_policy[p] = 1;
  return 0;
}
static int scope_item(const char *t, ev_opts *o) {
  lf_evict_scope s;
  if (lf_evict_scope_parse(t, &s) != LF_OK) {
    fprintf(stderr, EV_NAME ": unknown scope '%s' (head, layer)\n", t);
    return -1;
  }
  o->want_scope[s] = 1;
  return 0;
}
static int fraction_item(const char *t, ev_opts *o) {
  char *end;
  errno = 0;
  double f = strtod(t, &end);
  if (errno || end == t || *end || !(f > 0) || !isfinite(f)) {
    fprintf(stderr, EV_NAME ": bad fraction '%s' (a number > 0)\n", t);
    return -1;
  }
  for (int i = 0; i < o->n_fractions; i++)
    if (o->fractions[i] == f) return 0;
  if (o->n_fractions == EV_MAX_FRACTIONS) {
    fprintf(stderr, EV_NAME ": at most %d fractions\n", EV_MAX_FRACTIONS);
    return -1;
  }
  o->fractions[o->n_fractions++] = f;
  return 0;
}

static int eval_parse(int argc, char **argv, ev_opts *o) {
  memset(o, 0, sizeof *o);
  o->backend = LF_BACKEND_AUTO;
  for (int p = 0; p < 4; p++)
    o->want_policy[p] = 1;
  o->want_scope[LF_EVICT_HEAD] = 1;
  const double fr[] = {0.05, 0.1, 0.2, 0.4};
  for (int i = 0; i < 4; i++)
    o->fractions[i] = fr[i];
  o->n_fractions = 4;
  o->margin = 32;
  o->max_concurrent = 64;
  o->jobs = 1;
  o->threads = -1;
  o->sink = 4;
  o->window = 32;
  o->budget_round = 1;
  int set_policies = 0, set_scopes = 0, set_fractions = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      eval_usage(stdout);
      exit(0);
    }
    if (!strcmp(a, "--ids")) {
      o->ids = 1;
      continue;
    }
    if (!strcmp(a, "--quiet")) {
      o->quiet = 1;
      continue;
    }
    static const char *const valued[] = {"--model",          "--problems",  "--json",
                                         "--tokenizer",      "--policies",  "--policy",
                                         "--scopes",         "--fractions", "--backend",
                                         "--full-budget",    "--n",         "--margin",
                                         "--max-concurrent", "--jobs",      "--threads",
                                         "--sink",           "--window",    "--max-batch-tokens",
                                         "--budget-round"};
    int known = 0;
    for (size_t k = 0; k < sizeof valued / sizeof *valued; k++)
      known |= !strcmp(a, valued[k]);
    if (!known) {
      fprintf(stderr, EV_NAME ": unknown option '%s'\n", a);
      return -1;
    }
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!v) {
      fprintf(stderr, EV_NAME ": %s needs a value\n", a);
      return -1;
    }
    i++;
    int r = 0;
    if (!strcmp(a, "--model"))
      o->model = v;
    else if (!strcmp(a, "--problems"))
      o->problems = v;
    else if (!strcmp(a, "--json"))
      o->json = v;
    else if (!strcmp(a, "--tokenizer"))
      o->tokenizer = v;
    else if (!strcmp(a, "--policies") || !strcmp(a, "--policy")) {
      if (!set_policies) memset(o->want_policy, 0, sizeof o->want_policy);
      set_policies = 1;
      r = parse_list(a, v, policy_item, o);
    } else if (!strcmp(a, "--scopes")) {
      if (!set_scopes) memset(o->want_scope, 0, sizeof o->want_scope);
      set_scopes = 1;
      r = parse_list(a, v, scope_item, o);
    } else if (!strcmp(a, "--fractions")) {
      if (!set_fractions) o->n_fractions = 0;
      set_fractions = 1;
      r = parse_list(a, v, fraction_item, o);
    } else if (!strcmp(a, "--backend")) {
      if (!strcmp(v, "auto"))
        o->backend = LF_BACKEND_AUTO;
      else if (!strcmp(v, "cpu"))
        o->backend = LF_BACKEND_CPU;
      else if (!strcmp(v, "cuda"))
        o->backend = LF_BACKEND_CUDA;
      else {
        fprintf(stderr, EV_NAME ": bad backend '%s' (auto, cpu, cuda)\n", v);
        r = -1;
      }
    } else if (!strcmp(a, "--full-budget")) {
      if (!strcmp(v, "fit"))
        o->full_ctx = 0;
      else if (!strcmp(v, "ctx"))
        o->full_ctx = 1;
      else {
        fprintf(stderr, EV_NAME ": bad --full-budget '%s' (fit, ctx)\n", v);
        r = -1;
      }
    } else if (!strcmp(a, "--n"))
      r = parse_int_opt(a, v, 0, INT_MAX, &o->limit);
    else if (!strcmp(a, "--margin"))
      r = parse_int_opt(a, v, 0, 1 << 20, &o->margin);
    else if (!strcmp(a, "--max-concurrent"))
      r = parse_int_opt(a, v, 1, 1 << 20, &o->max_concurrent);
    else if (!strcmp(a, "--jobs"))
      r = parse_int_opt(a, v, 1, 1024, &o->jobs);
    else if (!strcmp(a, "--threads"))
      r = parse_int_opt(a, v, 0, 4096, &o->threads);
    else if (!strcmp(a, "--sink"))
      r = parse_int_opt(a, v, 0, INT_MAX, &o->sink);
    else if (!strcmp(a, "--window"))
      r = parse_int_opt(a, v, 0, INT_MAX, &o->window);
    else if (!strcmp(a, "--max-batch-tokens"))
      r = parse_int_opt(a, v, 0, INT_MAX, &o->max_batch_tokens);
    else if (!strcmp(a, "--budget-round"))
      r = parse_int_opt(a, v, 1, 1 << 20, &o->budget_round);
    else {
      fprintf(stderr, EV_NAME ": unknown option '%s'\n", a);
      return -1;
    }
    if (r) return -1;
  }
  if (!o->model || !o->problems) {
    fprintf(stderr, EV_NAME ": --model and --problems are required\n");
    return -1;
  }
  if (o->threads < 0) o->threads = o->jobs > 1 ? 1 : 0;
  return 0;
}

/* ---- problems ----------------------------------------------------------------------------- */

typedef struct ev_problem {
  char *id, *answer;
  int prompt_tokens, output_tokens;
  int32_t *prompt; /* [n_prompt] */
  int n_prompt;
  int32_t *want; /* encode(output) + [eos]: [n_want] */
  int n_want;
  lf_json *doc; /* the parsed line (for "lookback") */
} ev_problem;

static void problems_free(ev_problem *p, int n) {
  for (int i = 0; i < n; i++) {
    free(p[i].id);
    free(p[i].answer);
    free(p[i].prompt);
    free(p[i].want);
    lf_json_free(p[i].doc);
  }
  free(p);
}

static const char *field_str(const lf_json *o, const char *key, const char *file, int line) {
  const char *s = lf_json_str(lf_json_get(o, key), NULL);
  if (!s) fprintf(stderr, EV_NAME ": %s:%d: no string field \"%s\"\n", file, line, key);
  return s;
}
static int field_int(const lf_json *o, const char *key, const char *file, int line, int *out) {
  int64_t v;
  if (!lf_json_int(lf_json_get(o, key), &v) || v < 1 || v > INT_MAX / 4) {
    fprintf(stderr, EV_NAME ": %s:%d: no positive integer field \"%s\"\n", file, line, key);
    return -1;
  }
  *out = (int)v;
  return 0;
}

/* Reads, encodes and checks the problems. Returns the count, or -1 after printing why. */
static int load_problems(const ev_opts *o, const lf_tokenizer *tok, int eos, ev_problem **out) {
  *out = NULL;
  FILE *f = fopen(o->problems, "rb");
  if (!f) {
    fprintf(stderr, EV_NAME ": cannot open %s: %s\n", o->problems, strerror(errno));
    return -1;
  }
  ev_problem *ps = NULL;
  int n = 0, cap = 0, line_no = 0, rc = 0;
  char *line = NULL;
  size_t lcap = 0;
  ssize_t len;
  lf_token_ids enc = {0};
  while ((len = getline(&line, &lcap, f)) >= 0) {
    line_no++;
    size_t k = (size_t)len;
    while (k && (line[k - 1] == '\n' || line[k - 1] == '\r' || line[k - 1] == ' ' ||
                 line[k - 1] == '\t'))
      k--;
    size_t b = 0;
    while (b < k && (line[b] == ' ' || line[b] == '\t'))
      b++;
    if (b == k) continue; /* blank line */
    if (o->limit && n == o->limit) break;
    lf_json *doc = NULL;
    char err[256];
    if (lf_json_parse(line + b, k - b, &doc, err, sizeof err) != LF_OK) {
      fprintf(stderr, EV_NAME ": %s:%d: bad JSON: %s\n", o->problems, line_no, err);
      rc = -1;
      break;
    }
    if (lf_json_typeof(doc) != LF_JSON_OBJECT) {
      fprintf(stderr, EV_NAME ": %s:%d: not a JSON object\n", o->problems, line_no);
      lf_json_free(doc);
      rc = -1;
      break;
    }
    if (n == cap) {
      ev_problem *q = realloc(ps, sizeof *ps * (size_t)(cap = cap ? 2 * cap : 16));
      if (!q) {
        lf_json_free(doc);
        rc = -1;
        break;
      }
      ps = q;
    }
    ev_problem *p = &ps[n++];
    memset(p, 0, sizeof *p);
    p->doc = doc;
    const char *id = field_str(doc, "id", o->problems, line_no);
    const char *prompt = field_str(doc, "prompt", o->problems, line_no);
    const char *output = field_str(doc, "output", o->problems, line_no);
    const char *answer = field_str(doc, "answer", o->problems, line_no);
    if (!id || !prompt || !output || !answer ||
        field_int(doc, "prompt_tokens", o->problems, line_no, &p->prompt_tokens) ||
        field_int(doc, "output_tokens", o->problems, line_no, &p->output_tokens)) {
      rc = -1;
      break;
    }
    for (int j = 0; j < n - 1; j++)
      if (!strcmp(ps[j].id, id)) {
        fprintf(stderr, EV_NAME ": %s:%d: duplicate problem id '%s'\n", o->problems, line_no, id);
        rc = -1;
        break;
      }
    if (rc) break;
    p->id = ev_strdup(id);
    p->answer = ev_strdup(answer);
    /* The prompt as `lfgen --prompt` encodes it: post-processor specials (<bos>) added. */
    size_t plen, olen;
    lf_json_str(lf_json_get(doc, "prompt"), &plen);
    lf_json_str(lf_json_get(doc, "output"), &olen);
    lf_status s = lf_tokenizer_encode(tok, prompt, plen, LF_TOK_ADD_SPECIAL, &enc);
    if (s == LF_OK) {
      p->n_prompt = (int)enc.n;
      p->prompt = malloc(sizeof(int32_t) * (enc.n ? enc.n : 1));
      if (p->prompt) memcpy(p->prompt, enc.ids, sizeof(int32_t) * enc.n);
      s = lf_tokenizer_encode(tok, output, olen, 0, &enc);
    }
    if (s == LF_OK) {
      p->n_want = (int)enc.n + 1;
      p->want = malloc(sizeof(int32_t) * (size_t)p->n_want);
      if (p->want) {
        memcpy(p->want, enc.ids, sizeof(int32_t) * enc.n);
        p->want[enc.n] = eos;
      }
    }
    if (s != LF_OK || !p->id || !p->answer || !p->prompt || !p->want) {
      fprintf(stderr, EV_NAME ": %s:%d: cannot encode problem '%s': %s: %s\n", o->problems, line_no,
              id, lf_status_str(s == LF_OK ? LF_ERR_OUT_OF_MEMORY : s),
              s == LF_OK ? "out of memory" : lf_last_error());
      rc = -1;
      break;
    }
    if (p->n_prompt != p->prompt_tokens || p->n_want != p->output_tokens) {
      fprintf(stderr,
              EV_NAME ": %s:%d: problem '%s': the tokenizer gives %d prompt and %d output tokens "
                      "(with <eos>), the file says %d and %d: not the task's tokenizer?\n",
              o->problems, line_no, id, p->n_prompt, p->n_want, p->prompt_tokens, p->output_tokens);
      rc = -1;
      break;
    }
  }
  if (!rc && ferror(f)) {
    fprintf(stderr, EV_NAME ": reading %s: %s\n", o->problems, strerror(errno));
    rc = -1;
  }
  fclose(f);
  free(line);
  lf_token_ids_free(&enc);
  if (!rc && !n) {
    fprintf(stderr, EV_NAME ": %s holds no problems\n", o->problems);
    rc = -1;
  }
  if (rc) {
    problems_free(ps, n);
    return -1;
  }
  *out = ps;
  return n;
}

/* ---- runs and groups ----------------------------------------------------------------------- */

typedef struct ev_run {
  int problem, series, fi; /* fi: fraction index, -1 for full */
  int budget, max_tokens, group;
  uint64_t req_id;
  /* results */
  int32_t *ids;
  int n_ids, cap_ids;
  int finished, rc, have_stats;
  lf_finish_reason reason;
  char *error;
  uint64_t evictions;
  double tokens_per_s, seconds;
  /* scores (gen.check) */
  int answer_ok, trace_ok, first_error, stopped; /* first_error -1: none */
  char *answer;
} ev_run;

typedef struct ev_group {
  int series, fi, budget;
  int *runs, n;
  int pools;
  double wall_s, init_s, start_s;
  uint64_t tokens;
  int errors;
} ev_group;

typedef struct ev_ctx {
  const ev_opts *o;
  const lf_tokenizer *tok;
  int eos;
  ev_problem *probs;
  int n_probs;
  ev_series series[8];
  int n_series;
  ev_run *runs;
  int n_runs;
  ev_group *groups;
  int n_groups;
  int *order; /* groups, largest first */
  int next;   /* next index into order (under lock) */
  int runs_done;
  double t0;
  pthread_mutex_t lock;
} ev_ctx;

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
  if (r->fi >= 0) py_float(c->o->fractions[r->fi], b, sizeof b);
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
  cfg.backend = o->backend;
  cfg.policy = se->policy;
  cfg.evict_scope = se->scope;
  cfg.budget = g->budget;
  cfg.sink = o->sink;
  cfg.window = o->window;
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

static int cmp_int(const void *a, const void *b) {
  const int x = *(const int *)a, y = *(const int *)b;
  return (x > y) - (x < y);
}

/* Series in eval.py's order: full, longflow (every scope), streaming, h2o. */
static void make_series(ev_ctx *c) {
  const lf_policy order[] = {LF_POLICY_FULL, LF_POLICY_LONGFLOW, LF_POLICY_STREAMING,
                             LF_POLICY_H2O};
  for (int i = 0; i < 4; i++) {
    if (!c->o->want_policy[order[i]]) continue;
    for (int sc = 0; sc < 2; sc++) {
      const int scoped = order[i] == LF_POLICY_LONGFLOW;
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
          const double b = ceil(o->fractions[f] * (double)c->probs[i].output_tokens);
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
      qsort(budgets, (size_t)nb, sizeof *budgets, cmp_int);
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

/* ---- summary ------------------------------------------------------------------------------ */

typedef struct ev_sum {
  int n, errors, n_ev;
  double accuracy, trace_exact, mean_evictions;
  int median_first_error;
} ev_sum;

static void summarize(const ev_ctx *c, int s, int f, ev_sum *out, int *fe) {
  memset(out, 0, sizeof *out);
  int ok = 0, tr = 0;
  double ev = 0;
  for (int i = 0; i < c->n_runs; i++) {
    const ev_run *r = &c->runs[i];
    if (r->series != s || r->fi != f) continue;
    fe[out->n++] = r->first_error >= 0 ? r->first_error : c->probs[r->problem].output_tokens;
    ok += r->answer_ok;
    tr += r->trace_ok;
    out->errors += r->rc != 0;
    if (r->have_stats) {
      ev += (double)r->evictions;
      out->n_ev++;
    }
  }
  if (!out->n) return;
  qsort(fe, (size_t)out->n, sizeof *fe, cmp_int);
  out->accuracy = (double)ok / out->n;
  out->trace_exact = (double)tr / out->n;
  out->median_first_error = fe[out->n / 2];
  out->mean_evictions = out->n_ev ? ev / out->n_ev : 0;
}

static void print_table(const ev_ctx *c, int *fe) {
  printf("\n%-15s %7s %4s %9s %7s %8s %10s\n", "policy", "budget", "n", "accuracy", "trace",
         "1st err", "evictions");
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
        snprintf(b, sizeof b, "%g%%", 100 * c->o->fractions[f]);
      if (m.n_ev) snprintf(evs, sizeof evs, "%.0f", m.mean_evictions);
      printf("%-15s %7s %4d %8.1f%% %6.1f%% %8d %10s", c->series[s].name, b, m.n, 100 * m.accuracy,
             100 * m.trace_exact, m.median_first_error, evs);
      if (m.errors) printf("  (%d runs failed)", m.errors);
      printf("\n");
    }
  }
}

static int write_json(const ev_ctx *c, const char *backend, double wall, int *fe) {
  const ev_opts *o = c->o;
  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s.tmp", o->json);
  FILE *f = fopen(tmp, "w");
  if (!f) {
    fprintf(stderr, EV_NAME ": cannot write %s: %s\n", tmp, strerror(errno));
    return 1;
  }
  char path[PATH_MAX];
  const char *model = realpath(o->model, path) ? path : o->model;
  fprintf(f, "{\"task\": \"trace\", \"runner\": \"lfbench\", \"model\": ");
  json_cstr(f, model);
  fprintf(f, ", \"problems_file\": ");
  json_cstr(f, o->problems);
  fprintf(f,
          ", \"backend\": \"%s\",\n \"engine\": {\"sink\": %d, \"window\": %d, "
          "\"max_batch_tokens\": %d, \"threads\": %d, \"jobs\": %d, \"max_concurrent\": %d, "
          "\"full_budget\": \"%s\"},\n \"budget_round\": %d, \"fractions\": [",
          backend, o->sink, o->window, o->max_batch_tokens, o->threads, o->jobs, o->max_concurrent,
          o->full_ctx ? "ctx" : "fit", o->budget_round);
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
                               LF_POLICY_H2O};
    for (int i = 0, k = 0; i < 4; i++)
      if (o->want_policy[order[i]])
        fprintf(f, "%s\"%s\"", k++ ? ", " : "", lf_policy_str(order[i]));
  }
  fprintf(f, "], \"margin\": %d, \"wall_s\": %.3f,\n \"problems\": [\n", o->margin, wall);
  for (int i = 0; i < c->n_probs; i++) {
    const ev_problem *p = &c->probs[i];
    fprintf(f, "  {\"id\": ");
    json_cstr(f, p->id);
    fprintf(f, ", \"prompt_tokens\": %d, \"output_tokens\": %d, \"lookback\": ", p->prompt_tokens,
            p->output_tokens);
    json_value(f, lf_json_get(p->doc, "lookback"));
    fprintf(f, "}%s\n", i + 1 < c->n_probs ? "," : "");
  }
  fprintf(f, " ],\n \"groups\": [\n");
  for (int i = 0; i < c->n_groups; i++) {
    const ev_group *g = &c->groups[i];
    fprintf(f, "  {\"series\": \"%s\", \"fraction\": ", c->series[g->series].name);
    if (g->fi >= 0)
      json_num(f, o->fractions[g->fi]);
    else
      fputs("null", f);
    fprintf(f,
            ", \"budget\": %d, \"runs\": %d, \"pools\": %d, \"start_s\": %.3f, \"init_s\": "
            "%.3f, \"wall_s\": %.3f, \"tokens\": %llu, \"tokens_per_s\": %.1f, \"errors\": %d}%s\n",
            g->budget, g->n, g->pools, g->start_s, g->init_s, g->wall_s,
            (unsigned long long)g->tokens, g->wall_s > 0 ? (double)g->tokens / g->wall_s : 0.0,
            g->errors, i + 1 < c->n_groups ? "," : "");
  }
  fprintf(f, " ],\n \"summary\": {");
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
      if (!full) py_float(o->fractions[fi], key, sizeof key);
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
      fprintf(f, ", \"errors\": %d}", m.errors);
    }
    if (!first_row) fputc('}', f);
  }
  fprintf(f, "},\n \"runs\": [\n");
  for (int i = 0; i < c->n_runs; i++) {
    const ev_run *r = &c->runs[i];
    const ev_problem *p = &c->probs[r->problem];
    const ev_series *se = &c->series[r->series];
    fprintf(f, "  {\"problem\": ");
    json_cstr(f, p->id);
    fprintf(f, ", \"policy\": \"%s\", \"scope\": \"%s\", \"fraction\": ", lf_policy_str(se->policy),
            lf_evict_scope_str(se->scope));
    if (r->fi >= 0)
      json_num(f, o->fractions[r->fi]);
    else
      fputs("null", f);
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
    fprintf(f, "}%s\n", i + 1 < c->n_runs ? "," : "");
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

/* ---- main --------------------------------------------------------------------------------- */

int bench_eval(int argc, char **argv) {
  ev_opts o;
  if (eval_parse(argc, argv, &o)) {
    eval_usage(stderr);
    return 2;
  }
  lf_checkpoint ck;
  lf_status s = lf_checkpoint_open(o.model, &ck);
  if (s != LF_OK) {
    fprintf(stderr, EV_NAME ": %s: %s: %s\n", o.model, lf_status_str(s), lf_last_error());
    return 1;
  }
  const lf_model_config mc = ck.cfg;
  lf_checkpoint_close(&ck);

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
  c.n_probs = load_problems(&o, tok, eos, &c.probs);
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

  /* auto resolved as lf_backend_create does; layer-scope engines always run on the cpu */
  const char *backend = o.backend == LF_BACKEND_CUDA ? "cuda" : "cpu";
#ifdef LF_HAVE_CUDA_BACKEND
  if (o.backend == LF_BACKEND_AUTO && lf_cuda_device_present()) backend = "cuda";
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
  print_table(&c, fe);
  int failed = 0;
  for (int i = 0; i < c.n_runs; i++)
    failed += c.runs[i].rc != 0;
  printf("%d runs in %.1f s (%d engine groups)%s\n", c.n_runs, wall, c.n_groups,
         failed ? "; some runs failed (their errors are in the table and the JSON)" : "");
  if (o.json) {
    if (write_json(&c, backend, wall, fe))
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
  problems_free(c.probs, c.n_probs);
  lf_tokenizer_free(tok);
  return rc;
}

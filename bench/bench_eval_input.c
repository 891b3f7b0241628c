/* lfbench eval: its options and its problems (bench/bench_eval.c says what it measures). */
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
#include "launch/cli.h"
#include "bench/bench_eval.h"
#include "engine/backend.h"
#include "engine/model.h"
#include "lfserve.h"
#include "text/json.h"
#include "text/tokenizer.h"

/* ---- options ------------------------------------------------------------------------------ */



void ev_usage(FILE *f) {
  fprintf(f,
          "usage: lfbench eval --model DIR --problems FILE.jsonl [options]\n"
          "Accuracy against KV budget on trace-task problems (tools/task/gen.py --out), every\n"
          "series run through the engine's scheduler, one engine per (series, budget) group.\n"
          "  --model DIR          HF model directory (its tokenizer.json encodes the prompts)\n"
          "  --lora DIR           a PEFT LoRA adapter merged into the model at load\n"
          "  --problems FILE      JSON lines: id, prompt, output, answer, prompt_tokens,\n"
          "                       output_tokens (gen.py --out)\n"
          "  --n N                first N problems only (default 0: all)\n"
          "  --policies LIST      comma list of full, longflow, streaming, h2o, rkv (default:\n"
          "                       full, longflow, streaming, h2o)\n"
          "  --fractions LIST     budgets as fractions of each problem's output length\n"
          "                       (default 0.05,0.1,0.2,0.4): ceil(fraction x output_tokens)\n"
          "  --budget-of output|live  live: the fractions are multiples of each problem's\n"
          "                       oracle live set instead (gen.py's live_tokens)\n"
          "  --scopes LIST        eviction scopes for longflow, h2o and rkv: head, layer (default\n"
          "                       head)\n"
          "  --evict-groups G     layer scope: each layer's KV heads in G groups of one slot,\n"
          "                       what G tensor-parallel ranks evict (default 0: one group)\n"
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
          "  --h2o-recent R       h2o's recent window as lfgen (default 0: each budget's B/2)\n"
          "  --rkv-stage S        rkv's slots per selection as lfgen (default 0: 128, halved to\n"
          "                       fit)\n"
          "  --rkv-obs O          rkv's observation window as lfgen (default 0: budget/2)\n"
          "  --layer-weights F    per-layer budgets (lfgen's option) for the evicting series\n"
          "  --key-means F        key means (lfgen's option) for every series\n"
          "  --kv-dtype T         bf16|fp8|int8|int4|k8v4: the pools' K/V storage (default bf16);\n"
          "                       the fractions stay in slots, not bytes\n"
          "  --max-batch-tokens N prompt tokens per step (default 0: whole prompts)\n"
          "  --tokenizer FILE     tokenizer.json (default MODEL/tokenizer.json)\n"
          "  --json FILE          write runs + summary (tools/task/eval.py's schema)\n"
          "  --ids                also write every run's prompt and generated token ids\n"
          "  --teacher-forced     feed each run the expected output (the engine's teacher\n"
          "                       forcing) and score every position's greedy token: token\n"
          "                       error per run and series, wrong positions in the JSON\n"
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
    fprintf(stderr, EV_NAME ": unknown policy '%s' (full, longflow, streaming, h2o, rkv)\n", t);
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

int ev_parse(int argc, char **argv, ev_opts *o) {
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
      ev_usage(stdout);
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
    if (!strcmp(a, "--teacher-forced")) {
      o->teacher_forced = 1;
      continue;
    }
    static const char *const valued[] = {"--model",          "--lora",      "--problems",  "--json",
                                         "--tokenizer",      "--policies",  "--policy",
                                         "--scopes",         "--fractions", "--backend",
                                         "--full-budget",    "--n",         "--margin",
                                         "--max-concurrent", "--jobs",      "--threads",
                                         "--sink",           "--window",    "--max-batch-tokens",
                                         "--budget-round",   "--evict-groups",
                                         "--budget-of",      "--h2o-recent", "--kv-dtype",
                                         "--rkv-stage",      "--rkv-obs",     "--layer-weights",
                                         "--key-means"};
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
    else if (!strcmp(a, "--lora"))
      o->lora = v;
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
      if (lf_backend_parse(v, &o->backend) != LF_OK) {
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
    else if (!strcmp(a, "--h2o-recent"))
      r = parse_int_opt(a, v, 0, INT_MAX, &o->h2o_recent);
    else if (!strcmp(a, "--rkv-stage"))
      r = parse_int_opt(a, v, 0, INT_MAX, &o->rkv_stage);
    else if (!strcmp(a, "--rkv-obs"))
      r = parse_int_opt(a, v, 0, INT_MAX, &o->rkv_obs);
    else if (!strcmp(a, "--layer-weights")) {
      char why[256];
      free(o->layer_weights);
      o->layer_weights_path = v;
      if (lf_cli_read_weights(v, &o->layer_weights, &o->n_layer_weights, why, sizeof why)) {
        fprintf(stderr, EV_NAME ": --layer-weights: %s\n", why);
        r = -1;
      }
    }
    else if (!strcmp(a, "--key-means")) {
      o->key_means_path = v;
      r = lf_cli_load_key_means(EV_NAME, v, &o->key_means, &o->n_key_means);
    }
    else if (!strcmp(a, "--kv-dtype")) {
      if (lf_kv_dtype_parse(v, &o->kv_dtype) != LF_OK) {
        fprintf(stderr, EV_NAME ": %s\n", lf_last_error());
        r = -1;
      }
    }
    else if (!strcmp(a, "--window"))
      r = parse_int_opt(a, v, 0, INT_MAX, &o->window);
    else if (!strcmp(a, "--evict-groups"))
      r = parse_int_opt(a, v, 0, 4096, &o->evict_groups);
    else if (!strcmp(a, "--budget-of")) {
      if (!strcmp(v, "live") || !strcmp(v, "output")) {
        o->budget_of_live = !strcmp(v, "live");
      } else {
        fprintf(stderr, EV_NAME ": --budget-of output|live, not '%s'\n", v);
        r = -1;
      }
    }
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


void ev_problems_free(ev_problem *p, int n) {
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
int ev_load_problems(const ev_opts *o, const lf_tokenizer *tok, int eos, ev_problem **out) {
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
    if (o->budget_of_live &&
        field_int(doc, "live_tokens", o->problems, line_no, &p->live_tokens)) {
      fprintf(stderr, EV_NAME ": --budget-of live needs gen.py's live_tokens in every problem (for "
                      "hf records: written with --hf-tokenizer)\n");
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
    ev_problems_free(ps, n);
    return -1;
  }
  *out = ps;
  return n;
}

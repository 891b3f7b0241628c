/* lfbench natural — eviction on a model's own long answers, beside the trace task.
 *
 * Each prompt of a file (one per line, wrapped in the model's chat template) gets the model's own
 * answer, written greedily with full KV (EOS ignored, --max-tokens tokens). Every (policy,
 * budget) run is teacher-forced on that answer in lockstep with the full-KV run: all backends get
 * the same tokens each step (the prompts in one batch, each in its own pool), and at every answer
 * position the two next-token distributions are compared: KL(full || run) in nats (fp64 over
 * the whole vocabulary, from the raw logits) and whether the top-1 tokens agree. Budgets are
 * fractions of the answer length, as `lfbench eval`'s are of the task outputs.
 *
 * The backend interface (engine/backend.h) is driven directly: it hands back every item's
 * logits, which the engine's API does not. One backend per run, so memory grows with the runs.
 */
#define _POSIX_C_SOURCE 200809L
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"

#include "attention/attention.h"
#include "base/clock.h"
#include "base/error.h"
#include "engine/backend.h"
#include "engine/forward.h"
#include "engine/model.h"
#include "launch/cli.h"
#include "lfserve.h"
#include "memory/pool.h"

#define NAT_MAX_LIST 16
#define NAT_MAX_PROMPTS 64

typedef struct nat_opts {
  const char *model, *prompts, *json, *chat_format;
  int max_tokens, n, threads, rkv_stage, quiet;
  lf_backend_kind backend;
  lf_evict_scope scope;
  lf_kv_dtype kv_dtype;
  lf_kv_dtype ref_kv_dtype; /* the full-KV run's pools (--ref-kv-dtype; default kv_dtype) */
  int ref_set;
  lf_policy policies[NAT_MAX_LIST];
  int n_policies;
  double fractions[NAT_MAX_LIST];
  int n_fractions;
  int budgets[NAT_MAX_LIST]; /* --budgets: slots, instead of the fractions */
  int n_budgets;
  const char *lw_path; /* --layer-weights: per-layer budgets for every policy run */
  double *lw;
  int n_lw;
  const char *km_path; /* --key-means: key means for every policy run */
  float *km;
  int n_km;
} nat_opts;

typedef struct nat_run {
  lf_policy policy;
  double fraction;
  int budget;
  lf_backend *b;
  int *pools;
  float *logits;       /* [P][V] */
  double *kl;          /* [P] sums over positions */
  int *agree;          /* [P] top-1 agreements */
  uint64_t evictions;
  lf_status status;    /* the first failure, which stops the run */
} nat_run;

static void nat_usage(FILE *f) {
  fprintf(f,
          "usage: lfbench natural --model PATH [options]\n"
          "The model's own greedy answers (full KV, EOS ignored) to the prompts of a file, then\n"
          "each (policy, budget) teacher-forced on them: KL(full || policy) and top-1 agreement\n"
          "per answer position.\n"
          "  --prompts FILE      one prompt per line, chat-wrapped (default\n"
          "                      bench/natural_prompts.txt)\n"
          "  --n N               first N prompts only (default 0: all, at most %d)\n"
          "  --max-tokens N      answer length (default 2048)\n"
          "  --policies LIST     comma list of longflow, streaming, h2o, rkv (default\n"
          "                      longflow,h2o,rkv)\n"
          "  --fractions LIST    budgets as fractions of the answer length (default 0.1,0.2)\n"
          "  --budgets LIST      budgets in slots instead (a budget past prompt + answer never\n"
          "                      evicts: its KL is 0, its top-1 1)\n"
          "  --scope S           head | layer (default head)\n"
          "  --rkv-stage S       rkv's stage (default 0: %d, halved to fit the budget)\n"
          "  --layer-weights F   per-layer budgets for the policy runs (lfgen's option)\n"
          "  --key-means F       key means for the policy runs (lfgen's option)\n"
          "  --kv-dtype T        bf16|fp8|int8|int4|k8v4 (default bf16; the full run too)\n"
          "  --ref-kv-dtype T    the full run's pools instead (e.g. bf16 against quantized\n"
          "                      policy runs: quantization and eviction together)\n"
          "  --backend B         auto | cpu | cuda (default auto)\n"
          "  --threads T         cpu backend threads (default 0: OpenMP's default)\n"
          "  --chat-format F     chatml | llama3 | deepseek-r1 (default: the model's template)\n"
          "  --json FILE         write the runs, per prompt and in sum\n"
          "  --quiet             no progress lines\n",
          NAT_MAX_PROMPTS, LF_RKV_STAGE_DEFAULT);
}

static int nat_double_list(const char *s, double *out, int cap) {
  int n = 0;
  const char *p = s;
  while (*p) {
    char *end;
    errno = 0;
    const double v = strtod(p, &end);
    if (end == p || errno || !(v > 0.0 && v <= 1.0) || n >= cap) return -1;
    out[n++] = v;
    if (*end == ',') end++;
    else if (*end) return -1;
    p = end;
  }
  return n;
}

static int nat_parse(int argc, char **argv, nat_opts *o) {
  *o = (nat_opts){.prompts = "bench/natural_prompts.txt", .max_tokens = 2048,
                  .backend = LF_BACKEND_AUTO, .scope = LF_EVICT_HEAD, .kv_dtype = LF_KV_BF16,
                  .policies = {LF_POLICY_LONGFLOW, LF_POLICY_H2O, LF_POLICY_RKV}, .n_policies = 3,
                  .fractions = {0.1, 0.2}, .n_fractions = 2};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      nat_usage(stdout);
      return 1;
    }
    if (!strcmp(a, "--quiet")) {
      o->quiet = 1;
      continue;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "lfbench natural: %s needs a value\n", a);
      return 2;
    }
    const char *v = argv[++i];
    char *end = NULL;
    long x = 0;
    int bad = 0;
    if (!strcmp(a, "--model")) o->model = v;
    else if (!strcmp(a, "--prompts")) o->prompts = v;
    else if (!strcmp(a, "--json")) o->json = v;
    else if (!strcmp(a, "--chat-format")) o->chat_format = v;
    else if (!strcmp(a, "--layer-weights")) {
      char why[256];
      free(o->lw);
      o->lw_path = v;
      if (lf_cli_read_weights(v, &o->lw, &o->n_lw, why, sizeof why)) {
        fprintf(stderr, "lfbench natural: --layer-weights: %s\n", why);
        return 2;
      }
    }
    else if (!strcmp(a, "--key-means")) {
      o->km_path = v;
      if (lf_cli_load_key_means("lfbench natural", v, &o->km, &o->n_km)) return 2;
    }
    else if (!strcmp(a, "--n") || !strcmp(a, "--max-tokens") || !strcmp(a, "--threads") ||
             !strcmp(a, "--rkv-stage")) {
      errno = 0;
      x = strtol(v, &end, 10);
      bad = errno || *end || x < 0 || x > (1 << 20) || (!strcmp(a, "--max-tokens") && x < 1);
      if (!bad) {
        if (!strcmp(a, "--n")) o->n = (int)x;
        else if (!strcmp(a, "--max-tokens")) o->max_tokens = (int)x;
        else if (!strcmp(a, "--threads")) o->threads = (int)x;
        else o->rkv_stage = (int)x;
      }
    } else if (!strcmp(a, "--policies")) {
      char buf[256];
      snprintf(buf, sizeof buf, "%s", v);
      o->n_policies = 0;
      for (char *sv = NULL, *t = strtok_r(buf, ",", &sv); t && !bad; t = strtok_r(NULL, ",", &sv)) {
        lf_policy p;
        bad = lf_policy_parse(t, &p) != LF_OK || p == LF_POLICY_FULL ||
              o->n_policies >= NAT_MAX_LIST;
        if (!bad) o->policies[o->n_policies++] = p;
      }
      bad = bad || o->n_policies == 0;
    } else if (!strcmp(a, "--fractions")) {
      bad = (o->n_fractions = nat_double_list(v, o->fractions, NAT_MAX_LIST)) < 1;
    } else if (!strcmp(a, "--budgets")) {
      bad = (o->n_budgets = bench_int_list(v, o->budgets, NAT_MAX_LIST)) < 1;
    } else if (!strcmp(a, "--scope")) {
      bad = lf_evict_scope_parse(v, &o->scope) != LF_OK;
    } else if (!strcmp(a, "--kv-dtype")) {
      bad = lf_kv_dtype_parse(v, &o->kv_dtype) != LF_OK;
    } else if (!strcmp(a, "--ref-kv-dtype")) {
      bad = lf_kv_dtype_parse(v, &o->ref_kv_dtype) != LF_OK;
      o->ref_set = 1;
    } else if (!strcmp(a, "--backend")) {
      bad = lf_backend_parse(v, &o->backend) != LF_OK;
    } else {
      fprintf(stderr, "lfbench natural: unknown option %s\n", a);
      return 2;
    }
    if (bad) {
      fprintf(stderr, "lfbench natural: bad value '%s' for %s (policies: longflow, streaming, "
                      "h2o, rkv; fractions in (0, 1])\n", v, a);
      return 2;
    }
  }
  if (!o->model) {
    fprintf(stderr, "lfbench natural: --model is required\n");
    nat_usage(stderr);
    return 2;
  }
  if (!o->ref_set) o->ref_kv_dtype = o->kv_dtype;
  return 0;
}

/* The prompt file's non-empty lines (at most max, or NAT_MAX_PROMPTS), each chat-wrapped and
 * encoded into ids[i] / len[i]. 0, or 1 after a message. */
static int nat_prompts(const nat_opts *o, const lf_tokenizer *tok, int32_t **ids, int *len,
                       int *n_out) {
  char *text = bench_read_file(o->prompts);
  if (!text) {
    fprintf(stderr, "lfbench natural: cannot read %s\n", o->prompts);
    return 1;
  }
  const int cap = o->n > 0 && o->n < NAT_MAX_PROMPTS ? o->n : NAT_MAX_PROMPTS;
  int n = 0, rc = 0;
  for (char *sv = NULL, *line = strtok_r(text, "\n", &sv); line && n < cap;
       line = strtok_r(NULL, "\n", &sv)) {
    while (isspace((unsigned char)*line)) line++;
    if (!*line || *line == '#') continue;
    const lf_chat_message msg = {"user", line};
    if (lf_tokenize_chat(tok, o->model, o->chat_format, &msg, 1, &ids[n], &len[n]) != LF_OK) {
      fprintf(stderr, "lfbench natural: prompt %d: %s\n", n, lf_last_error());
      rc = 1;
      break;
    }
    n++;
  }
  free(text);
  if (!rc && n == 0) {
    fprintf(stderr, "lfbench natural: %s holds no prompt\n", o->prompts);
    rc = 1;
  }
  *n_out = n;
  return rc;
}

static lf_status nat_backend(const nat_opts *o, const lf_checkpoint *ck, lf_policy policy,
                             int budget, int n_pools, lf_backend **b, int *pools) {
  const lf_kv_dtype dt = policy == LF_POLICY_FULL ? o->ref_kv_dtype : o->kv_dtype;
  lf_backend_params p = {.policy = policy, .scope = o->scope, .budget = budget, .sink = 4,
                         .window = 32, .kv_dtype = dt, .n_pools = n_pools,
                         .n_threads = o->threads, .no_graphs = 0};
  int bmin = budget, *lb = NULL;
  if (o->km && policy != LF_POLICY_FULL) { /* the backend takes them as checked */
    LF_TRY(lf_key_means_check(&ck->cfg, o->km, o->n_km));
    p.key_means = o->km;
  }
  if (o->lw && policy != LF_POLICY_FULL) { /* per-layer budgets, the engine's rule */
    const int L = ck->cfg.n_layers;
    if (o->n_lw != L)
      return lf_error(LF_ERR_INVALID_ARG, "--layer-weights: %d weights for %d layers", o->n_lw, L);
    if (!(lb = malloc(sizeof(int) * (size_t)L))) return lf_error(LF_ERR_OUT_OF_MEMORY, "budgets");
    lf_status s = lf_layer_budgets_from_weights(o->lw, L, budget, lb);
    if (s != LF_OK) {
      free(lb);
      return s;
    }
    for (int l = 0; l < L; l++) bmin = lb[l] < bmin ? lb[l] : bmin;
    p.layer_budget = lb;
  }
  p.rkv_stage = lf_rkv_stage_resolve(o->rkv_stage, bmin, p.sink, p.rkv_obs);
  const lf_status cs = lf_backend_create(o->backend, ck, &p, b); /* it keeps its own copy */
  free(lb);
  LF_TRY(cs);
  for (int i = 0; i < n_pools; i++) LF_TRY((*b)->pool_take(*b, &pools[i]));
  return LF_OK;
}

/* log-softmax of x[V] into lp (fp64); returns the argmax (lowest id on ties). */
static int nat_logsoftmax(const float *x, int V, double *lp) {
  int am = 0;
  double m = -INFINITY;
  for (int v = 0; v < V; v++)
    if (x[v] > m) m = x[v], am = v;
  double z = 0.0;
  for (int v = 0; v < V; v++) z += exp((double)x[v] - m);
  const double lz = m + log(z);
  for (int v = 0; v < V; v++) lp[v] = (double)x[v] - lz;
  return am;
}

static void nat_json(const nat_opts *o, const char *model_name, int P, const int *plen, int T,
                     const nat_run *runs, int R, const char *backend_name, double wall) {
  FILE *f = fopen(o->json, "w");
  if (!f) {
    fprintf(stderr, "lfbench natural: cannot write %s\n", o->json);
    return;
  }
  fprintf(f, "{\n  \"bench\": \"natural\", \"model\": \"%s\", \"backend\": \"%s\", \"prompts\": %d, "
             "\"answer_tokens\": %d, \"scope\": \"%s\", \"kv_dtype\": \"%s\", "
             "\"ref_kv_dtype\": \"%s\", \"wall_s\": %.1f,\n"
             "  \"layer_weights\": \"%s\", \"key_means\": \"%s\", \"prompt_tokens\": [",
          model_name, backend_name, P, T, lf_evict_scope_str(o->scope),
          lf_kv_dtype_str(o->kv_dtype), lf_kv_dtype_str(o->ref_kv_dtype), wall,
          o->lw_path ? o->lw_path : "", o->km_path ? o->km_path : "");
  for (int i = 0; i < P; i++) fprintf(f, "%s%d", i ? ", " : "", plen[i]);
  fprintf(f, "],\n  \"runs\": [");
  for (int r = 0; r < R; r++) {
    const nat_run *x = &runs[r];
    double kl = 0.0, ag = 0.0;
    for (int i = 0; i < P; i++) kl += x->kl[i], ag += x->agree[i];
    fprintf(f,
            "%s\n    {\"policy\": \"%s\", \"fraction\": %.4g, \"budget\": %d, \"status\": \"%s\", "
            "\"kl\": %.6g, \"top1\": %.6g, \"evictions\": %llu, \"kl_per_prompt\": [",
            r ? "," : "", lf_policy_str(x->policy), x->fraction, x->budget,
            lf_status_str(x->status), kl / ((double)P * T), ag / ((double)P * T),
            (unsigned long long)x->evictions);
    for (int i = 0; i < P; i++) fprintf(f, "%s%.6g", i ? ", " : "", x->kl[i] / T);
    fprintf(f, "], \"top1_per_prompt\": [");
    for (int i = 0; i < P; i++) fprintf(f, "%s%.6g", i ? ", " : "", (double)x->agree[i] / T);
    fprintf(f, "]}");
  }
  fprintf(f, "\n  ]\n}\n");
  fclose(f);
}

/* Run r = policy r / nb at budget r % nb: its backend and P pools, its logits and sums. 1 on an
 * error (said on stderr). */
static int nat_runs_create(const nat_opts *o, lf_checkpoint *ck, int P, int T, nat_run *runs,
                           int nb) {
  const int V = ck->cfg.vocab_size;
  for (int pi = 0; pi < o->n_policies; pi++)
    for (int fi = 0; fi < nb; fi++) {
      nat_run *x = &runs[pi * nb + fi];
      x->policy = o->policies[pi];
      x->budget = o->n_budgets ? o->budgets[fi] : (int)ceil(o->fractions[fi] * T);
      x->fraction = (double)x->budget / T;
      x->pools = calloc((size_t)P, sizeof *x->pools);
      x->logits = malloc(sizeof(float) * (size_t)P * V);
      x->kl = calloc((size_t)P, sizeof *x->kl);
      x->agree = calloc((size_t)P, sizeof *x->agree);
      if (!x->pools || !x->logits || !x->kl || !x->agree) {
        fprintf(stderr, "lfbench natural: out of host memory\n");
        return 1;
      }
      if (nat_backend(o, ck, x->policy, x->budget, P, &x->b, x->pools) != LF_OK) {
        fprintf(stderr, "lfbench natural: %s at budget %d: %s\n", lf_policy_str(x->policy),
                x->budget, lf_last_error());
        return 1;
      }
    }
  return 0;
}

/* Run x's step t on the full run's inputs, its logits against the full run's flog: KL and top-1
 * added per prompt (lpf, lpr: [V] scratch). A failure stops the run (said on stderr). */
static void nat_compare(nat_run *x, const lf_batch_item *items, int P, int t, const float *flog,
                        int V, double *lpf, double *lpr) {
  if (x->status != LF_OK) return;
  lf_batch_item its[NAT_MAX_PROMPTS];
  lf_batch_result rs[NAT_MAX_PROMPTS];
  for (int i = 0; i < P; i++) {
    its[i] = items[i];
    its[i].pool = x->pools[i];
  }
  lf_status s = x->b->forward(x->b, its, P, rs, x->logits);
  for (int i = 0; i < P && s == LF_OK; i++) s = rs[i].status;
  if (s != LF_OK) {
    x->status = s;
    fprintf(stderr, "lfbench natural: %s at budget %d, step %d: %s (run stopped)\n",
            lf_policy_str(x->policy), x->budget, t, lf_last_error());
    return;
  }
  for (int i = 0; i < P; i++) {
    x->evictions += rs[i].evictions;
    const int af = nat_logsoftmax(flog + (size_t)i * V, V, lpf);
    const int ar = nat_logsoftmax(x->logits + (size_t)i * V, V, lpr);
    double kl = 0.0;
    for (int v = 0; v < V; v++) kl += exp(lpf[v]) * (lpf[v] - lpr[v]);
    x->kl[i] += kl;
    x->agree[i] += af == ar;
  }
}

/* The table of every run's mean KL and top-1 agreement, and the JSON file when asked. */
static void nat_report(const nat_opts *o, const nat_run *runs, int R, int P, const int *plen,
                       int T, const char *backend, double wall) {
  printf("\npolicy       fraction  budget   KL (nats)   top-1   evictions\n");
  for (int r = 0; r < R; r++) {
    const nat_run *x = &runs[r];
    double kl = 0.0, ag = 0.0;
    for (int i = 0; i < P; i++) kl += x->kl[i], ag += x->agree[i];
    printf("%-12s %8.2f %7d %11.5f %7.4f %11llu%s\n", lf_policy_str(x->policy), x->fraction,
           x->budget, kl / ((double)P * T), ag / ((double)P * T),
           (unsigned long long)x->evictions, x->status == LF_OK ? "" : "  (stopped)");
  }
  printf("%d prompts x %d answer tokens in %.1f s\n", P, T, wall);
  if (o->json) {
    char name[512];
    snprintf(name, sizeof name, "%s", o->model);
    bench_json_safe(name);
    nat_json(o, name, P, plen, T, runs, R, backend, wall);
    printf("wrote %s\n", o->json);
  }
}

int bench_natural(int argc, char **argv) {
  nat_opts o;
  const int pr = nat_parse(argc, argv, &o);
  if (pr) {
    free(o.lw);
    free(o.km);
    return pr == 1 ? 0 : pr;
  }
  const double t0 = lf_now_s();
  lf_tokenizer *tok = NULL;
  if (lf_tokenizer_open(o.model, &tok) != LF_OK) {
    fprintf(stderr, "lfbench natural: %s: %s\n", o.model, lf_last_error());
    free(o.lw);
    free(o.km);
    return 1;
  }
  int32_t *ids[NAT_MAX_PROMPTS] = {0};
  int plen[NAT_MAX_PROMPTS] = {0}, P = 0, rc = 0;
  lf_checkpoint ck;
  memset(&ck, 0, sizeof ck);
  lf_backend *full = NULL;
  nat_run *runs = NULL;
  int R = 0, *fpools = NULL;
  int32_t *next = NULL;
  float *flog = NULL;
  double *lpf = NULL, *lpr = NULL;
  lf_batch_item *items = NULL;
  lf_batch_result *res = NULL;
  if (nat_prompts(&o, tok, ids, plen, &P)) {
    rc = 1;
    goto done;
  }
  if (lf_checkpoint_open(o.model, &ck) != LF_OK) {
    fprintf(stderr, "lfbench natural: %s: %s\n", o.model, lf_last_error());
    rc = 1;
    goto done;
  }
  const int V = ck.cfg.vocab_size, T = o.max_tokens;
  int maxp = 0;
  for (int i = 0; i < P; i++) maxp = plen[i] > maxp ? plen[i] : maxp;
  if (maxp + T > ck.cfg.max_seq_len) {
    fprintf(stderr, "lfbench natural: prompt (%d) + answer (%d) tokens exceed the context %d\n",
            maxp, T, ck.cfg.max_seq_len);
    rc = 2;
    goto done;
  }
  const int nb = o.n_budgets ? o.n_budgets : o.n_fractions;
  R = o.n_policies * nb;
  runs = calloc((size_t)R, sizeof *runs);
  fpools = calloc((size_t)P, sizeof *fpools);
  next = calloc((size_t)P, sizeof *next);
  flog = malloc(sizeof(float) * (size_t)P * V);
  lpf = malloc(sizeof(double) * (size_t)V);
  lpr = malloc(sizeof(double) * (size_t)V);
  items = calloc((size_t)P, sizeof *items);
  res = calloc((size_t)P, sizeof *res);
  if (!runs || !fpools || !next || !flog || !lpf || !lpr || !items || !res) {
    fprintf(stderr, "lfbench natural: out of host memory\n");
    rc = 1;
    goto done;
  }
  /* the full run's pools hold every prompt and answer */
  if (nat_backend(&o, &ck, LF_POLICY_FULL, maxp + T + 1, P, &full, fpools) != LF_OK) {
    fprintf(stderr, "lfbench natural: full-KV backend: %s\n", lf_last_error());
    rc = 1;
    goto done;
  }
  if (nat_runs_create(&o, &ck, P, T, runs, nb)) {
    rc = 1;
    goto done;
  }
  if (!o.quiet)
    printf("# %d prompts (%d..%d tokens), answers of %d tokens; %d runs on %s\n", P,
           plen[0], maxp, T, R, full->name);

  /* step t feeds the prompts (t = 0) or the full run's answer token t - 1; every run's logits
   * after it are compared with the full run's */
  for (int t = 0; t < T && !rc; t++) {
    for (int i = 0; i < P; i++) {
      lf_batch_item *it = &items[i];
      memset(it, 0, sizeof *it);
      it->pool = fpools[i];
      it->pos0 = t == 0 ? 0 : plen[i] + t - 1;
      it->n_tok = t == 0 ? plen[i] : 1;
      it->tokens = t == 0 ? ids[i] : &next[i];
    }
    if (full->forward(full, items, P, res, flog) != LF_OK) {
      fprintf(stderr, "lfbench natural: full-KV step %d: %s\n", t, lf_last_error());
      rc = 1;
      break;
    }
    for (int i = 0; i < P; i++)
      if (res[i].status != LF_OK) {
        fprintf(stderr, "lfbench natural: full-KV step %d, prompt %d: %s\n", t, i,
                lf_status_str(res[i].status));
        rc = 1;
      }
    for (int r = 0; r < R && !rc; r++) nat_compare(&runs[r], items, P, t, flog, V, lpf, lpr);
    for (int i = 0; i < P; i++) next[i] = res[i].token; /* greedy, EOS ignored */
    if (!o.quiet && (t + 1) % 256 == 0) {
      printf("[%6.0fs] position %d/%d:", lf_now_s() - t0, t + 1, T);
      for (int r = 0; r < R; r++) {
        double kl = 0.0, ag = 0.0;
        for (int i = 0; i < P; i++) kl += runs[r].kl[i], ag += runs[r].agree[i];
        printf("  %s@%.2g KL %.4f top1 %.3f", lf_policy_str(runs[r].policy), runs[r].fraction,
               kl / ((double)P * (t + 1)), ag / ((double)P * (t + 1)));
      }
      printf("\n");
      fflush(stdout);
    }
  }
  if (!rc) nat_report(&o, runs, R, P, plen, T, full->name, lf_now_s() - t0);
done:
  for (int r = 0; r < R && runs; r++) {
    if (runs[r].b) runs[r].b->free(runs[r].b);
    free(runs[r].pools);
    free(runs[r].logits);
    free(runs[r].kl);
    free(runs[r].agree);
  }
  if (full) full->free(full);
  lf_checkpoint_close(&ck);
  for (int i = 0; i < P; i++) lf_free(ids[i]);
  lf_tokenizer_free(tok);
  free(o.lw);
  free(o.km);
  free(runs);
  free(fpools);
  free(next);
  free(flog);
  free(lpf);
  free(lpr);
  free(items);
  free(res);
  return rc;
}

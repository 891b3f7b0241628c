/* lfbench eval (bench/bench_eval.c): the types its three files share and the functions they
 * call across. bench_eval.c runs the grid; bench_eval_input.c parses the options and loads the
 * problems; bench_eval_report.c scores the summary and writes the table and the JSON. */
#ifndef LF_BENCH_EVAL_H
#define LF_BENCH_EVAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "engine/backend.h"
#include "lfserve.h"
#include "text/json.h"
#include "text/tokenizer.h"

#define EV_MAX_FRACTIONS 16
#define EV_NAME "lfbench eval"

typedef struct ev_series {
  lf_policy policy;
  lf_evict_scope scope;
  char name[32]; /* "longflow", "longflow-layer": eval.py's series_name */
} ev_series;

typedef struct ev_opts {
  const char *model, *problems, *json, *tokenizer;
  const char *lora; /* --lora DIR: a PEFT adapter merged at load, or NULL */
  lf_backend_kind backend;
  int want_policy[LF_POLICY_RKV + 1]; /* by lf_policy */
  int want_scope[2];  /* by lf_evict_scope */
  double fractions[EV_MAX_FRACTIONS];
  int n_fractions;
  int margin, max_concurrent, jobs, threads, sink, window, max_batch_tokens, budget_round;
  int h2o_recent; /* lf_engine_config.h2o_recent (0: each budget's B/2) */
  int rkv_stage;  /* lf_engine_config.rkv_stage (0: LF_RKV_STAGE_DEFAULT) */
  int rkv_obs;    /* lf_engine_config.rkv_obs (0: budget / 2) */
  const char *layer_weights_path; /* --layer-weights F, or NULL */
  double *layer_weights;          /* its weights (lf_engine_config.layer_weights; the evicting
                                     series only), n_layer_weights of them */
  int n_layer_weights;
  const char *key_means_path; /* --key-means F, or NULL */
  float *key_means;           /* its values (lf_engine_config.key_means; every series) */
  int n_key_means;
  lf_kv_dtype kv_dtype; /* lf_engine_config.kv_dtype of every series */
  int evict_groups; /* layer-scope series: lf_engine_config.evict_groups */
  int full_ctx, limit, ids, quiet;
  int teacher_forced; /* feed the expected output, score every position's greedy token */
  int budget_of_live; /* --budget-of live: fractions are of each problem's live_tokens */
} ev_opts;

typedef struct ev_problem {
  char *id, *answer;
  int prompt_tokens, output_tokens;
  int live_tokens; /* the oracle live set (gen.py "live_tokens"); 0 when the file has none */
  int32_t *prompt; /* [n_prompt] */
  int n_prompt;
  int32_t *want; /* encode(output) + [eos]: [n_want] */
  int n_want;
  lf_json *doc; /* the parsed line (for "lookback") */
} ev_problem;

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
  int tf_wrong; /* teacher forcing: positions whose greedy token is not the expected one */
  char *answer;
} ev_run;

/* Whether run r's token at expected position j differs from problem p's (or is missing). */
static inline int ev_wrong_at(const ev_problem *p, const ev_run *r, int j) {
  return j >= r->n_ids || r->ids[j] != p->want[j];
}

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

/* bench_eval_input.c */
void ev_usage(FILE *f);
/* 0 on success, -1 on a bad option (reported); --help prints the usage and exits. */
int ev_parse(int argc, char **argv, ev_opts *o);
int ev_load_problems(const ev_opts *o, const lf_tokenizer *tok, int eos, ev_problem **out);
void ev_problems_free(ev_problem *p, int n);

/* bench_eval_report.c */
char *ev_strdup(const char *s);
/* x as Python's repr(float) writes it, so the JSON matches eval.py's. */
void ev_py_float(double x, char *out, size_t cap);
int ev_cmp_int(const void *a, const void *b);
void ev_print_table(const ev_ctx *c, int *fe);
int ev_write_json(const ev_ctx *c, const char *backend, double wall, int *fe);

#endif

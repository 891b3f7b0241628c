/* lfbench prefill — time to first token of a batch of prompts submitted together, through the
 * public engine API, against a transformers forward of the same shapes (bench/prefill_peer.py).
 *
 * One row per (P, B): B prompts of P seeded random tokens each are submitted at once to a fresh
 * engine (policy full unless --policy, one pool of P + 1 slots per prompt, so nothing is evicted
 * or compressed; max_tokens 1, EOS ignored, greedy), and the engine is stepped until every prompt
 * has sampled its first token. The row's time is the host wall time from just before the first submit to
 * the end of the step that produced the last first token (the step ends after the tokens are on
 * the host, so nothing is still running on the device); the median over --iters repetitions
 * after --warmup ones on the same engine.
 *
 * FLOPs of one row (multiply-add = 2), the same formula as bench/prefill_peer.py:
 *
 *   2 * N_lin * B * P                          the matmuls of every layer, every token
 *   + 2 * vocab * dim * B                      the LM head, once per prompt (only the last
 *                                              position's logits are needed)
 *   + 2 * 2 * H * D * L * P * (P + 1) / 2 * B  causal attention: q.k and p.v over the
 *                                              P (P + 1) / 2 (query, key) pairs a prompt has
 *
 *   N_lin = L * (dim * H * D          q
 *                + 2 * dim * Hkv * D  k, v
 *                + H * D * dim        o
 *                + 3 * dim * hidden)  gate, up, down
 *
 * (the embedding lookup, norms, RoPE, SiLU and the softmax's exponentials are not counted).
 * TFLOP/s = FLOPs / time. With --peer (the peer's JSON), each row also shows the peer's time
 * for the same (P, B) and ratio = peer time / lfserve time: above 1, lfserve is faster.
 *
 * Rows run in order of B * P (then B), smallest first, so --time-limit, which skips (or runs
 * fewer repetitions of) the rows predicted not to fit in what is left of it, drops the largest
 * ones. A row whose engine does not fit in memory is reported as skipped, not as a failure.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "bench_gpu.h"
#include "bench_util.h"
#include "engine/backend.h"
#include "engine/model.h"
#include "lfserve.h"

#ifdef LF_HAVE_CUDA
#include <cuda_runtime.h>
#endif

int bench_prefill(int argc, char **argv);

#define PF_MAX_LIST 32

typedef struct pf_opts {
  const char *model, *json, *peer, *lora;
  lf_backend_kind backend;
  lf_policy policy;
  int prompts[PF_MAX_LIST], n_prompts;
  int batches[PF_MAX_LIST], n_batches;
  int warmup, iters, max_batch_tokens, prefill_chunk, threads;
  double time_limit;
  uint64_t seed;
} pf_opts;

typedef struct pf_row {
  int prompt, batch;
  int iters;              /* repetitions timed (fewer than asked under --time-limit) */
  int steps;              /* lf_engine_step calls to the last first token (last repetition) */
  int chunks;             /* most prefill chunks of one prompt (engine statistics) */
  double flops, time_s, min_s, init_s, engine_ttft_s;
  double peer_s;          /* < 0: none */
  const char *skipped;    /* NULL: measured */
  char why[400];          /* details of a skip */
} pf_row;

static void pf_usage(FILE *f) {
  fprintf(f,
          "usage: lfbench prefill [options]\n"
          "  --model M              (default random:qwen3-8b)\n"
          "  --lora DIR             a PEFT LoRA adapter merged into the model at load\n"
          "  --backend B            auto | cpu | cuda (default auto)\n"
          "  --prompts LIST         prompt lengths P (default 512,1024,2048,4096,8192,16384,32768)\n"
          "  --batches LIST         prompts submitted together B (default 1,8)\n"
          "  --warmup N --iters N   repetitions before / timed, median reported (default 1 3)\n"
          "  --max-batch-tokens N   the engine's prefill tokens per step (default 0: unbounded,\n"
          "                         every prompt whole in the first step)\n"
          "  --prefill-chunk N      set LF_CUDA_PREFILL_CHUNK=N for the engines (cuda backend's\n"
          "                         tokens per prefill chunk; default: left as it is)\n"
          "  --time-limit S         seconds for the whole grid: a row predicted (from the last\n"
          "                         row's FLOP rate) not to fit runs fewer iters or is skipped\n"
          "                         (default 0: no limit)\n"
          "  --peer FILE            bench/prefill_peer.py's JSON: peer time and ratio per row\n"
          "  --json FILE            write the rows as JSON\n"
          "  --threads T            cpu backend threads (default 0: all cores)\n"
          "  --seed S               prompt tokens (default 1)\n"
          "  --policy P             the engines' policy (default full); the budget is P + 1\n"
          "                         either way, so what differs is what the policy does\n"
          "                         besides attention at prefill (h2o: its column sums)\n");
}

static int pf_parse(int argc, char **argv, pf_opts *o) {
  static const int def_p[] = {512, 1024, 2048, 4096, 8192, 16384, 32768};
  memset(o, 0, sizeof *o);
  o->model = "random:qwen3-8b";
  o->backend = LF_BACKEND_AUTO;
  o->policy = LF_POLICY_FULL;
  o->n_prompts = (int)(sizeof def_p / sizeof def_p[0]);
  memcpy(o->prompts, def_p, sizeof def_p);
  o->batches[0] = 1;
  o->batches[1] = 8;
  o->n_batches = 2;
  o->warmup = 1;
  o->iters = 3;
  o->seed = 1;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      pf_usage(stdout);
      exit(0);
    }
    if (!v) {
      fprintf(stderr, "lfbench prefill: bad or incomplete option '%s'\n", a);
      return -1;
    }
    i++;
    if (!strcmp(a, "--model")) {
      o->model = v;
    } else if (!strcmp(a, "--lora")) {
      o->lora = v;
    } else if (!strcmp(a, "--backend")) {
      if (lf_backend_parse(v, &o->backend) != LF_OK) return -1;
    } else if (!strcmp(a, "--prompts")) {
      if ((o->n_prompts = bench_int_list(v, o->prompts, PF_MAX_LIST)) < 1) return -1;
    } else if (!strcmp(a, "--batches")) {
      if ((o->n_batches = bench_int_list(v, o->batches, PF_MAX_LIST)) < 1) return -1;
    } else if (!strcmp(a, "--warmup")) {
      o->warmup = atoi(v);
    } else if (!strcmp(a, "--iters")) {
      o->iters = atoi(v);
    } else if (!strcmp(a, "--max-batch-tokens")) {
      o->max_batch_tokens = atoi(v);
    } else if (!strcmp(a, "--prefill-chunk")) {
      o->prefill_chunk = atoi(v);
    } else if (!strcmp(a, "--time-limit")) {
      o->time_limit = atof(v);
    } else if (!strcmp(a, "--peer")) {
      o->peer = v;
    } else if (!strcmp(a, "--json")) {
      o->json = v;
    } else if (!strcmp(a, "--threads")) {
      o->threads = atoi(v);
    } else if (!strcmp(a, "--seed")) {
      o->seed = strtoull(v, NULL, 10);
    } else if (!strcmp(a, "--policy")) {
      if (lf_policy_parse(v, &o->policy) != LF_OK) {
        fprintf(stderr, "lfbench prefill: %s\n", lf_last_error());
        return -1;
      }
    } else {
      fprintf(stderr, "lfbench prefill: unknown option '%s'\n", a);
      return -1;
    }
  }
  if (o->warmup < 0 || o->iters < 1 || o->max_batch_tokens < 0 || o->prefill_chunk < 0 ||
      o->threads < 0 || !(o->time_limit >= 0)) {
    fprintf(stderr, "lfbench prefill: an option is out of range\n");
    return -1;
  }
  return 0;
}

/* ---- FLOPs (the formula at the top of this file) ------------------------------------------ */

static double pf_linear_params(const lf_model_config *m) {
  const double dim = m->dim, qd = (double)m->n_heads * m->head_dim,
               kd = (double)m->n_kv_heads * m->head_dim, hid = m->hidden_dim;
  return (double)m->n_layers * (dim * qd + 2.0 * dim * kd + qd * dim + 3.0 * dim * hid);
}

static double pf_flops(const lf_model_config *m, int P, int B) {
  const double p = P, b = B;
  return 2.0 * pf_linear_params(m) * b * p + 2.0 * (double)m->vocab_size * m->dim * b +
         4.0 * m->n_heads * m->head_dim * (double)m->n_layers * (p * (p + 1.0) / 2.0) * b;
}

/* ---- the peer's JSON: one row object per line ------------------------------------------- */

/* The peer's time (seconds) for (P, B), or -1. */
static double pf_peer_time(const char *text, int P, int B) {
  const double t = bench_peer_value(text, "prompt", P, "batch", B, "time_ms");
  return t > 0 ? t * 1e-3 : -1.0;
}

/* Warns when the peer's header (its first line) describes another shape. */
static void pf_peer_shape_check(const char *text, const lf_model_config *m) {
  const char *eol = strchr(text, '\n');
  const char *e = eol ? eol : text + strlen(text);
  const struct {
    const char *key;
    int want;
  } k[] = {{"n_layers", m->n_layers},     {"dim", m->dim},
           {"hidden_dim", m->hidden_dim}, {"n_heads", m->n_heads},
           {"n_kv_heads", m->n_kv_heads}, {"head_dim", m->head_dim},
           {"vocab_size", m->vocab_size}};
  for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
    double v;
    if (!bench_json_num(text, e, k[i].key, &v))
      printf("# WARNING: the peer's JSON does not state %s\n", k[i].key);
    else if ((int)v != k[i].want)
      printf("# WARNING: the peer's %s is %d, this model's %d: the ratios compare different "
             "shapes\n",
             k[i].key, (int)v, k[i].want);
  }
}

/* ---- one row ------------------------------------------------------------------------------ */

static uint64_t pf_rng;
static uint32_t pf_rand(uint32_t n) { /* splitmix64 */
  uint64_t z = (pf_rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return (uint32_t)((z ^ (z >> 31)) % n);
}

static int pf_is_oom(lf_status s) { return s == LF_ERR_OUT_OF_MEMORY; }

/* One repetition: submit B prompts, step to the last first token, drain. *t: seconds. Returns
 * LF_OK, or the failure (an item's error status, or the step's). */
static lf_status pf_once(lf_engine_t e, const lf_model_config *m, int P, int B, int32_t *prompts,
                         uint64_t *ids, lf_event *ev, int cap, pf_row *r, double *t) {
  for (size_t i = 0; i < (size_t)B * P; i++)
    prompts[i] = (int32_t)pf_rand((uint32_t)m->vocab_size);
  int got = 0, steps = 0;
  lf_status fail = LF_OK;
  const double t0 = lf_now_s();
  for (int i = 0; i < B; i++) {
    lf_request q;
    memset(&q, 0, sizeof q);
    q.prompt = prompts + (size_t)i * P;
    q.n_prompt = P;
    q.max_tokens = 1;
    q.ignore_eos = 1;
    const lf_status s = lf_engine_submit(e, &q, &ids[i]);
    if (s != LF_OK) {
      fprintf(stderr, "lfbench prefill: submit: %s: %s\n", lf_status_str(s), lf_last_error());
      return s;
    }
  }
  double t1 = t0;
  while (lf_engine_busy(e)) {
    int n = 0;
    const lf_status s = lf_engine_step(e, ev, cap, &n);
    const double ts = lf_now_s();
    if (s != LF_OK) {
      snprintf(r->why, sizeof r->why, "lf_engine_step: %s: %s", lf_status_str(s),
               lf_last_error());
      return s;
    }
    if (got < B) steps++;
    for (int k = 0; k < n; k++) {
      if (ev[k].type == LF_EVENT_TOKEN && ++got == B) t1 = ts;
      if (ev[k].type == LF_EVENT_FINISH && ev[k].reason == LF_FINISH_ERROR && fail == LF_OK) {
        fail = ev[k].status;
        snprintf(r->why, sizeof r->why, "a prompt ended with an error: %s",
                 lf_status_str(ev[k].status));
      }
    }
  }
  if (fail != LF_OK) return fail;
  if (got != B) {
    snprintf(r->why, sizeof r->why, "%d of %d prompts produced a token", got, B);
    return LF_ERR_INTERNAL;
  }
  r->steps = steps;
  r->chunks = 0;
  r->engine_ttft_s = 0.0;
  for (int i = 0; i < B; i++) {
    lf_request_stats st;
    if (lf_engine_request_stats(e, ids[i], &st) != LF_OK) continue;
    if (st.prefill_chunks > r->chunks) r->chunks = st.prefill_chunks;
    if (st.ttft_seconds > r->engine_ttft_s) r->engine_ttft_s = st.ttft_seconds;
  }
  *t = t1 - t0;
  return LF_OK;
}

/* A fresh engine for the row, warm-up, timed repetitions. Returns 0 when measured or skipped
 * for memory, 1 on a failure. */
static int pf_row_run(const pf_opts *o, const lf_model_config *m, lf_backend_kind backend,
                      int warmup, pf_row *r) {
  const int P = r->prompt, B = r->batch;
  lf_engine_config cfg;
  lf_engine_config_default(&cfg);
  cfg.model_path = o->model;
  cfg.lora_path = o->lora;
  cfg.backend = backend;
  cfg.policy = o->policy;
  cfg.budget = P + 1; /* the prompt and the first token: never full */
  cfg.n_pools = B;
  cfg.max_batch_tokens = o->max_batch_tokens;
  cfg.n_threads = o->threads;
  lf_engine_t e = NULL;
  const double ti = lf_now_s();
  lf_status s = lf_engine_init(&cfg, NULL, &e);
  r->init_s = lf_now_s() - ti;
  if (s != LF_OK) {
    snprintf(r->why, sizeof r->why, "lf_engine_init: %s: %s", lf_status_str(s), lf_last_error());
    if (pf_is_oom(s)) {
      r->skipped = "out of memory";
      return 0;
    }
    return 1;
  }
  int rc = 0;
  const int cap = 2 * B + 16;
  int32_t *prompts = malloc(sizeof(int32_t) * (size_t)B * (size_t)P);
  uint64_t *ids = calloc((size_t)B, sizeof *ids);
  lf_event *ev = calloc((size_t)cap, sizeof *ev);
  double *t = calloc((size_t)r->iters, sizeof *t);
  if (!prompts || !ids || !ev || !t) {
    snprintf(r->why, sizeof r->why, "out of host memory for the prompts");
    r->skipped = "out of memory";
    goto out;
  }
  for (int i = 0; i < warmup + r->iters; i++) {
    double dt = 0.0;
    s = pf_once(e, m, P, B, prompts, ids, ev, cap, r, &dt);
    if (s != LF_OK) {
      if (!r->why[0])
        snprintf(r->why, sizeof r->why, "%s: %s", lf_status_str(s), lf_last_error());
      if (pf_is_oom(s)) r->skipped = "out of memory";
      else rc = 1;
      goto out;
    }
    if (i >= warmup) t[i - warmup] = dt;
  }
  r->time_s = bench_median(t, r->iters);
  r->min_s = t[0]; /* sorted by bench_median */
out:
  free(prompts);
  free(ids);
  free(ev);
  free(t);
  lf_engine_free(e);
  return rc;
}

/* ---- output ------------------------------------------------------------------------------- */

static void pf_fmt(char *buf, size_t n, double v, const char *fmt) {
  if (v > 0) snprintf(buf, n, fmt, v);
  else snprintf(buf, n, "-");
}

static void pf_print_row(const pf_row *r) {
  if (r->skipped) {
    printf("  %6d %3d  skipped: %s (%s)\n", r->prompt, r->batch, r->skipped, r->why);
  } else {
    char peer[32], ratio[32];
    pf_fmt(peer, sizeof peer, r->peer_s * 1e3, "%.2f");
    pf_fmt(ratio, sizeof ratio, r->peer_s > 0 ? r->peer_s / r->time_s : 0, "%.3f");
    printf("  %6d %3d %11.2f %11.0f %8.2f %11s %7s %5d %5d %6d %7.2f\n", r->prompt, r->batch,
           r->time_s * 1e3, (double)r->prompt * r->batch / r->time_s,
           r->flops / r->time_s / 1e12, peer, ratio, r->iters, r->steps, r->chunks, r->init_s);
  }
  fflush(stdout);
}

/* The closing line: the issue-19 rows (P = 2048 at every B) against the peer when there is
 * one, else the throughput alone. */
static void pf_verdict(const pf_row *rows, int n, int have_peer, char *out, size_t cap) {
  int measured = 0, with_peer = 0, skipped = 0;
  double lsum = 0.0, rmin = 1e30, rmax = 0.0, best = 0.0;
  const pf_row *best_row = NULL;
  for (int i = 0; i < n; i++) {
    const pf_row *r = &rows[i];
    if (r->skipped) {
      skipped++;
      continue;
    }
    measured++;
    const double tf = r->flops / r->time_s / 1e12;
    if (tf > best) best = tf, best_row = r;
    if (r->peer_s > 0) {
      const double q = r->peer_s / r->time_s;
      with_peer++;
      lsum += log(q);
      rmin = q < rmin ? q : rmin;
      rmax = q > rmax ? q : rmax;
    }
  }
  size_t k = 0;
  if (!measured) {
    snprintf(out + k, cap - k, "no row was measured (%d skipped)", skipped);
    return;
  }
  if (with_peer) {
    char p2048[256] = "";
    size_t m = 0;
    int all_ok = 1, any = 0;
    for (int i = 0; i < n; i++) {
      const pf_row *r = &rows[i];
      if (r->skipped || r->prompt != 2048 || r->peer_s <= 0 || m >= sizeof p2048 - 32) continue;
      const double q = r->peer_s / r->time_s;
      m += (size_t)snprintf(p2048 + m, sizeof p2048 - m, "%sB=%d %.2fx", any ? ", " : "",
                            r->batch, q);
      any = 1;
      all_ok &= q >= 1.0;
    }
    k += (size_t)snprintf(out + k, cap - k,
                          "lfserve vs transformers (peer time / lfserve time) over %d row%s: "
                          "geomean %.2fx, min %.2fx, max %.2fx",
                          with_peer, with_peer > 1 ? "s" : "", exp(lsum / with_peer), rmin, rmax);
    if (any)
      k += (size_t)snprintf(out + k, cap - k, "; at P=2048: %s: %s the issue-19 target (>= 1.0x)",
                            p2048, all_ok ? "MEETS" : "BELOW");
  } else {
    k += (size_t)snprintf(out + k, cap - k, "%s; best %.1f TFLOP/s at P=%d B=%d",
                          have_peer ? "the peer has none of these rows" : "no peer",
                          best, best_row->prompt, best_row->batch);
  }
  if (skipped && k < cap)
    snprintf(out + k, cap - k, " (%d row%s skipped)", skipped, skipped > 1 ? "s" : "");
}

static int pf_write_json(const pf_opts *o, const char *backend, const char *device,
                         const lf_model_config *m, const char *chunk_env, const pf_row *rows,
                         int n, const char *verdict) {
  FILE *f = fopen(o->json, "w");
  if (!f) {
    fprintf(stderr, "lfbench prefill: cannot write %s\n", o->json);
    return 1;
  }
  fprintf(f,
          "{\"bench\": \"prefill\", \"model\": \"%s\", \"backend\": \"%s\", \"device\": \"%s\", "
          "\"n_layers\": %d, \"dim\": %d, \"hidden_dim\": %d, \"n_heads\": %d, "
          "\"n_kv_heads\": %d, \"head_dim\": %d, \"vocab_size\": %d,\n \"policy\": \"%s\", "
          "\"budget\": \"P + 1\", \"max_batch_tokens\": %d, \"prefill_chunk_env\": \"%s\", "
          "\"warmup\": %d, \"iters\": %d, \"time_limit_s\": %g, \"seed\": %llu, "
          "\"peer\": \"%s\",\n \"timer\": \"host wall, submit of the first prompt to the end of "
          "the step that sampled the last first token; median\",\n \"flops\": \"2*N_lin*B*P + "
          "2*vocab*dim*B + 2*2*H*D*L*P*(P+1)/2*B, N_lin = L*(dim*H*D + 2*dim*Hkv*D + H*D*dim + "
          "3*dim*hidden) = %.0f\",\n \"rows\": [\n",
          o->model, backend, device, m->n_layers, m->dim, m->hidden_dim, m->n_heads,
          m->n_kv_heads, m->head_dim, m->vocab_size, lf_policy_str(o->policy), o->max_batch_tokens,
          chunk_env, o->warmup, o->iters, o->time_limit, (unsigned long long)o->seed, o->peer ? o->peer : "",
          pf_linear_params(m));
  for (int i = 0; i < n; i++) {
    const pf_row *r = &rows[i];
    fprintf(f, "  {\"prompt\": %d, \"batch\": %d, \"flops\": %.6e, ", r->prompt, r->batch,
            r->flops);
    if (r->skipped) {
      char why[sizeof r->why];
      size_t k = 0;
      for (const char *c = r->why; *c && k + 1 < sizeof why; c++)
        why[k++] = *c == '"' || *c == '\\' || (unsigned char)*c < 0x20 ? '\'' : *c;
      why[k] = '\0';
      fprintf(f, "\"time_ms\": null, \"skipped\": \"%s\", \"why\": \"%s\"", r->skipped, why);
    } else {
      char peer[32] = "null", ratio[32] = "null";
      if (r->peer_s > 0) {
        snprintf(peer, sizeof peer, "%.3f", r->peer_s * 1e3);
        snprintf(ratio, sizeof ratio, "%.4f", r->peer_s / r->time_s);
      }
      fprintf(f,
              "\"time_ms\": %.3f, \"min_ms\": %.3f, \"tokens_per_s\": %.1f, \"tflops\": %.2f, "
              "\"peer_time_ms\": %s, \"ratio\": %s, \"iters\": %d, \"steps\": %d, "
              "\"prefill_chunks\": %d, \"engine_ttft_ms\": %.3f, \"init_s\": %.2f",
              r->time_s * 1e3, r->min_s * 1e3, (double)r->prompt * r->batch / r->time_s,
              r->flops / r->time_s / 1e12, peer, ratio, r->iters, r->steps, r->chunks,
              r->engine_ttft_s * 1e3, r->init_s);
    }
    fprintf(f, "}%s\n", i + 1 < n ? "," : "");
  }
  fprintf(f, "],\n \"verdict\": \"%s\"}\n", verdict);
  fclose(f);
  return 0;
}

static int pf_row_order(const void *a, const void *b) {
  const pf_row *x = a, *y = b;
  const double tx = (double)x->prompt * x->batch, ty = (double)y->prompt * y->batch;
  if (tx != ty) return tx < ty ? -1 : 1;
  return (x->batch > y->batch) - (x->batch < y->batch);
}

int bench_prefill(int argc, char **argv) {
  pf_opts o;
  if (pf_parse(argc, argv, &o)) {
    pf_usage(stderr);
    return 2;
  }
  lf_model_config mc;
  if (bench_model_config("lfbench prefill", o.model, &mc)) return 1;

  const lf_backend_kind backend = lf_backend_resolve(o.backend);
  char device[256] = "cpu";
  bench_gpu gpu;
  if (backend == LF_BACKEND_CUDA && !bench_gpu_open("lfbench prefill", 0, &gpu))
    snprintf(device, sizeof device, "%s", gpu.name);
  if (o.prefill_chunk > 0) {
    char v[32];
    snprintf(v, sizeof v, "%d", o.prefill_chunk);
    setenv("LF_CUDA_PREFILL_CHUNK", v, 1);
  }
  const char *chunk_env = getenv("LF_CUDA_PREFILL_CHUNK");
  char chunk_s[64];
  snprintf(chunk_s, sizeof chunk_s, "%s", chunk_env ? chunk_env : "unset");
  bench_json_safe(chunk_s);

  char *peer_text = NULL;
  if (o.peer && !(peer_text = bench_read_file(o.peer))) {
    fprintf(stderr, "lfbench prefill: cannot read the peer's JSON %s\n", o.peer);
    return 1;
  }

  /* the grid, smallest B * P first; repeated values once */
  pf_row *rows = calloc((size_t)o.n_prompts * (size_t)o.n_batches, sizeof *rows);
  if (!rows) return 1;
  int n = 0;
  for (int bi = 0; bi < o.n_batches; bi++)
    for (int pi = 0; pi < o.n_prompts; pi++) {
      int dup = 0;
      for (int k = 0; k < n; k++)
        dup |= rows[k].prompt == o.prompts[pi] && rows[k].batch == o.batches[bi];
      if (dup) continue;
      rows[n].prompt = o.prompts[pi];
      rows[n].batch = o.batches[bi];
      rows[n].flops = pf_flops(&mc, rows[n].prompt, rows[n].batch);
      rows[n].peer_s = peer_text ? pf_peer_time(peer_text, rows[n].prompt, rows[n].batch) : -1.0;
      n++;
    }
  qsort(rows, (size_t)n, sizeof *rows, pf_row_order);

  printf("# lfbench prefill: model %s (%d layers, dim %d, MLP %d, %d/%d heads of %d, vocab %d), "
         "backend %s, device %s\n",
         o.model, mc.n_layers, mc.dim, mc.hidden_dim, mc.n_heads, mc.n_kv_heads, mc.head_dim,
         mc.vocab_size, lf_backend_str(backend), device);
  printf("# engine per row: policy %s, budget P + 1, n_pools B, max_batch_tokens %d%s, "
         "LF_CUDA_PREFILL_CHUNK %s%s\n",
         lf_policy_str(o.policy), o.max_batch_tokens,
         o.max_batch_tokens ? "" : " (unbounded: every prompt whole in the first step)",
         chunk_env ? chunk_env : "unset", chunk_env ? "" : " (the backend's default)");
  printf("# time: host wall from the first submit to the end of the step that sampled the last "
         "prompt's first token; median of %d after %d warm-up%s\n",
         o.iters, o.warmup, o.time_limit > 0 ? ", within --time-limit" : "");
  printf("# FLOPs = 2*N_lin*B*P + 2*vocab*dim*B + 2*2*H*D*L*B*P(P+1)/2, N_lin = %.4g "
         "(matmul params of the layers)\n",
         pf_linear_params(&mc));
  if (peer_text) {
    printf("# peer: %s; ratio = peer time / lfserve time (> 1: lfserve faster)\n", o.peer);
    pf_peer_shape_check(peer_text, &mc);
  }
  printf("# %6s %3s %11s %11s %8s %11s %7s %5s %5s %6s %7s\n", "P", "B", "time_ms", "tok/s",
         "TFLOP/s", "peer_ms", "ratio", "iters", "steps", "chunks", "init_s");

  int rc = 0;
  const double t_start = lf_now_s();
  double rate = 0.0; /* FLOP/s of the last measured row */
  for (int i = 0; i < n; i++) {
    pf_row *r = &rows[i];
    r->iters = o.iters;
    int warmup = o.warmup;
    if (r->prompt + 1 > mc.max_seq_len) {
      r->skipped = "longer than the context";
      snprintf(r->why, sizeof r->why, "P + 1 = %d > %d", r->prompt + 1, mc.max_seq_len);
      pf_print_row(r);
      continue;
    }
    if (o.time_limit > 0 && rate > 0) {
      const double left = o.time_limit - (lf_now_s() - t_start), one = r->flops / rate;
      const int fit = one > 0 ? (int)floor(left / one) : warmup + r->iters;
      if (fit < warmup + r->iters) {
        warmup = warmup < 1 ? warmup : 1;
        r->iters = fit - warmup < r->iters ? fit - warmup : r->iters;
      }
      if (r->iters < 1) {
        r->skipped = "time limit";
        snprintf(r->why, sizeof r->why, "predicted %.1f s a run, %.0f s of --time-limit left",
                 one, left);
        pf_print_row(r);
        continue;
      }
    }
    if (pf_row_run(&o, &mc, backend, warmup, r)) {
      fprintf(stderr, "lfbench prefill: P=%d B=%d failed: %s\n", r->prompt, r->batch, r->why);
      r->skipped = "FAILED";
      rc = 1;
    } else if (!r->skipped) {
      rate = r->flops / r->time_s;
    }
    pf_print_row(r);
  }
  char verdict[768];
  pf_verdict(rows, n, peer_text != NULL, verdict, sizeof verdict);
  printf("# verdict: %s\n", verdict);
  if (o.json && pf_write_json(&o, lf_backend_str(backend), device, &mc, chunk_s, rows, n, verdict))
    rc = 1;
  free(rows);
  free(peer_text);
  return rc;
}

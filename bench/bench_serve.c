/* lfbench serve — a synthetic long-output workload through the real engine and scheduler.
 *
 * N requests of P random prompt tokens (seeded) each generate exactly O tokens (EOS ignored,
 * greedy), arriving all at once or as a Poisson process, for each policy asked for (full,
 * longflow, streaming, h2o). Each policy gets its own engine, pool count and budget:
 * `full` pools hold P + O slots (nothing is evicted), the others hold B. With --kv-gb every policy
 * gets n_pools = floor(kv_gb * 1e9 * mem_util / pool_bytes) from the same byte figure, where
 * pool_bytes is the per-pool size of the backend that runs (the engine sizes the pools:
 * lf_engine_config.kv_memory_bytes), so the comparison is at the same KV memory. N defaults to the pool count (one full wave).
 *
 * Reported per policy: output tokens/s, TTFT and TPOT p50/p99 (measured here at step
 * boundaries from the events, per request), wall time, pools, memory (device used on cuda,
 * via cudaMemGetInfo; RSS on the cpu), the fraction of wall time inside lf_engine_step vs
 * outside it (host overhead: submit, event handling) vs idle (waiting for Poisson arrivals),
 * NVML GPU utilisation sampled during the run on cuda, evictions, and an FNV-1a hash of every
 * request's generated tokens (in request order), so two runs can be compared token for token.
 * Also per policy: the mean and largest decode batch (requests past their first token, before
 * each step), and with --decode-only-ref, measured on the same engine after the run: the
 * isolated prefill time of one prompt and the mean step time of a decode-only batch of the
 * run's mean decode batch (decode_reference below), the references for TTFT p50 and TPOT p99,
 * and the prompt's passes run with that batch decoding in them (the mixed passes). With
 * --warmup W (Poisson), TTFT and TPOT are over the requests arriving from W on and the decode
 * batch over the steps from W to the last arrival: the steady state, without the ramp up from an
 * empty engine or the drain after the arrivals stop.
 *
 * Under mpirun -np T (tensor parallelism, docs/DESIGN.md §4) every rank builds the same engines, rank 0
 * drives and reports, the others follow (lf_engine_follow). --kv-gb is then per rank: a rank
 * holds 1/T of each pool's KV heads (all of one when T > KV heads), so T ranks get about T
 * times the pools; memory and GPU utilisation are rank 0's.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "bench/bench_util.h"
#include "engine/backend.h"
#include "engine/model.h"
#include "lfserve.h"
#include "launch/tp_launch.h"

#ifdef LF_HAVE_CUDA
#include <cuda_runtime.h>
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 34))
#include <dlfcn.h>
#define SERVE_HAVE_NVML 1 /* dlopen is in libc: no link change needed */
#endif
#endif

int bench_serve(int argc, char **argv);

/* ---- small helpers ----------------------------------------------------------------------- */

static void sleep_s(double s) {
  if (s <= 0) return;
  struct timespec t = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  while (nanosleep(&t, &t) != 0 && errno == EINTR) {
  }
}

static uint64_t rng_s;
static uint64_t rng_u64(void) { /* splitmix64 */
  uint64_t z = (rng_s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static double rng_unit(void) { /* (0, 1] */
  return ((double)(rng_u64() >> 11) + 1.0) * (1.0 / 9007199254740992.0);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}
/* Nearest-rank percentile of v[0..n) (sorted in place); 0 when empty. */
static double pct(double *v, int n, double p) {
  if (n <= 0) return 0.0;
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  int k = (int)ceil(p / 100.0 * n) - 1;
  return v[k < 0 ? 0 : k >= n ? n - 1 : k];
}

/* ---- memory: device used (cuda) or resident set (cpu) ------------------------------------ */

static uint64_t proc_status_kb(const char *key) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  uint64_t v = 0;
  const size_t kl = strlen(key);
  while (fgets(line, sizeof line, f))
    if (!strncmp(line, key, kl) && line[kl] == ':') {
      v = strtoull(line + kl + 1, NULL, 10);
      break;
    }
  fclose(f);
  return v;
}
/* Resets VmHWM to the current RSS (Linux >= 4.0); harmless where unsupported. */
static void rss_peak_reset(void) {
  FILE *f = fopen("/proc/self/clear_refs", "w");
  if (f) {
    fputs("5", f);
    fclose(f);
  }
}

/* Bytes in use: device memory (total - free) when cuda is the backend, else RSS. */
static uint64_t mem_used(int cuda) {
#ifdef LF_HAVE_CUDA
  if (cuda) {
    size_t fr = 0, tot = 0;
    if (cudaMemGetInfo(&fr, &tot) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return (uint64_t)(tot - fr);
  }
#else
  (void)cuda;
#endif
  return proc_status_kb("VmRSS") * 1024u;
}
static uint64_t mem_peak_rss(void) {
  return proc_status_kb("VmHWM") * 1024u;
}

/* ---- GPU busy: NVML utilisation ("percent of time over the past sample period during which
 * one or more kernels was executing"), polled during the run. Coarse (1/6 s .. 1 s sample
 * periods) but free of backend hooks. ------------------------------------------------------ */

typedef struct gpu_util {
  int ok;
  double sum;
  int n;
#ifdef SERVE_HAVE_NVML
  void *lib, *dev;
  int (*get)(void *dev, unsigned int *util_gpu_mem); /* nvmlUtilization_t = {gpu, memory} */
  int (*shutdown)(void);
#endif
} gpu_util;

static void gpu_util_open(gpu_util *g, int cuda) {
  memset(g, 0, sizeof *g);
#ifdef SERVE_HAVE_NVML
  if (!cuda) return;
  g->lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!g->lib) return;
  int (*init)(void) = (int (*)(void))dlsym(g->lib, "nvmlInit_v2");
  int (*by_bus)(const char *, void **) =
      (int (*)(const char *, void **))dlsym(g->lib, "nvmlDeviceGetHandleByPciBusId_v2");
  g->get = (int (*)(void *, unsigned int *))dlsym(g->lib, "nvmlDeviceGetUtilizationRates");
  g->shutdown = (int (*)(void))dlsym(g->lib, "nvmlShutdown");
  char bus[64];
  int dev = 0;
  if (!init || !by_bus || !g->get || !g->shutdown || init() != 0) goto fail;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetPCIBusId(bus, sizeof bus, dev) != cudaSuccess ||
      by_bus(bus, &g->dev) != 0) {
    cudaGetLastError();
    g->shutdown();
    goto fail;
  }
  g->ok = 1;
  return;
fail:
  dlclose(g->lib);
  g->lib = NULL;
#else
  (void)cuda;
#endif
}
static void gpu_util_sample(gpu_util *g) {
#ifdef SERVE_HAVE_NVML
  unsigned int u[2];
  if (g->ok && g->get(g->dev, u) == 0) {
    g->sum += u[0];
    g->n++;
  }
#else
  (void)g;
#endif
}
/* Mean utilisation in [0, 1], or -1 when not measured. */
static double gpu_util_close(gpu_util *g) {
  double r = g->n ? g->sum / g->n / 100.0 : -1.0;
#ifdef SERVE_HAVE_NVML
  if (g->ok) g->shutdown();
  if (g->lib) dlclose(g->lib);
#endif
  memset(g, 0, sizeof *g);
  return r;
}

/* ---- options ------------------------------------------------------------------------------ */

#define MAX_POLICIES 4

typedef struct serve_opts {
  const char *model, *json, *lora;
  lf_backend_kind backend;
  lf_policy policies[MAX_POLICIES];
  int n_policies;
  int n_req, prompt, output, budget, full_budget, n_pools, max_batch_tokens, threads;
  int sink, window;
  int h2o_recent; /* lf_engine_config.h2o_recent (0: B/2) */
  lf_evict_scope scope;
  lf_kv_dtype kv_dtype;
  double kv_gb, mem_util, rate, duration;
  double warmup; /* --warmup: the steady-state window starts here (Poisson only) */
  int poisson;
  uint64_t seed;
  int quiet;
  int decode_ref, ref_batch, ref_tokens; /* --decode-only-ref, --ref-batch, --ref-tokens */
} serve_opts;

static void serve_usage(FILE *f) {
  fprintf(f,
          "usage: lfbench serve [options]\n"
          "  --model M          HF dir, llama2.c .bin or random:NAME (default random:tiny-llama)\n"
          "  --lora DIR         a PEFT LoRA adapter merged into the model at load\n"
          "  --backend B        auto | cpu | cuda (default auto)\n"
          "  --policies LIST    comma list of full, longflow, streaming, h2o (default\n"
          "                     full,longflow)\n"
          "  --prompt P         prompt tokens (default 64)\n"
          "  --output O         output tokens per request, EOS ignored (default 512)\n"
          "  --requests N       requests per policy (default 0: that policy's pool count)\n"
          "  --budget B         slots per pool of longflow / streaming / h2o (default 3200)\n"
          "  --full-budget B    slots per pool of full (default P + O)\n"
          "  --n-pools K        pools for every policy (overrides --kv-gb)\n"
          "  --kv-gb G          KV bytes (1e9) for every policy: n_pools = floor(G * 1e9 *\n"
          "                     mem_util / pool bytes of that policy's budget on that backend)\n"
          "  --mem-util U       (default 0.9)\n"
          "  --arrival A        all | poisson (default all)\n"
          "  --rate R           Poisson arrivals per second (default 1)\n"
          "  --max-batch-tokens T  prefill tokens per step (default: the engine's, 512)\n"
          "  --sink S --window W   policy parameters (default 4 32)\n"
          "  --h2o-recent R     h2o's recent window (default 0: budget / 2)\n"
          "  --evict-scope S    layer | head: one eviction slot per layer or per KV head\n"
          "                     (default layer)\n"
          "  --kv-dtype T       bf16|fp8|int8|int4|k8v4: the pools' K/V storage (default bf16)\n"
          "  --threads T        cpu backend threads (default 0: all cores)\n"
          "  --duration S       stop after S seconds of wall time: cancel what is left and\n"
          "                     report the window (default 0: run every request to its end)\n"
          "  --warmup W         Poisson only: measure the steady state. Requests that arrive\n"
          "                     before W s still run but are left out of TTFT / TPOT, and the\n"
          "                     decode batch is averaged over the steps between W and the\n"
          "                     last arrival (default 0: every request and step)\n"
          "  --seed S           prompts and arrivals (default 1)\n"
          "  --decode-only-ref  after each policy's run, on the same engine: the isolated\n"
          "                     prefill time of one P-token prompt (median of 3) and the mean\n"
          "                     step time of a decode-only batch at the run's mean decode batch,\n"
          "                     then that prompt's passes with the batch decoding in them\n"
          "  --ref-batch N      that batch instead (default 0: the run's mean, rounded)\n"
          "  --ref-tokens K     output tokens of each reference request (default O)\n"
          "  --json FILE        write the rows as JSON\n"
          "  --quiet            no progress lines\n");
}

static int parse_policies(const char *s, serve_opts *o) {
  char buf[256];
  snprintf(buf, sizeof buf, "%s", s);
  o->n_policies = 0;
  for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
    if (o->n_policies == MAX_POLICIES || lf_policy_parse(tok, &o->policies[o->n_policies]) != LF_OK)
      return -1;
    o->n_policies++;
  }
  return o->n_policies ? 0 : -1;
}

static int parse_args(int argc, char **argv, serve_opts *o) {
  *o = (serve_opts){.model = "random:tiny-llama", .backend = LF_BACKEND_AUTO,
                    .policies = {LF_POLICY_FULL, LF_POLICY_LONGFLOW}, .n_policies = 2,
                    .prompt = 64, .output = 512, .budget = 3200, .mem_util = 0.9, .rate = 1.0,
                    .sink = 4, .window = 32, .scope = LF_EVICT_LAYER, .seed = 1,
                    .max_batch_tokens = -1};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define OPT(name) (!strcmp(a, name) && v && (i++, 1))
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      serve_usage(stdout);
      exit(0);
    } else if (!strcmp(a, "--quiet")) {
      o->quiet = 1;
    } else if (!strcmp(a, "--decode-only-ref")) {
      o->decode_ref = 1;
    } else if (OPT("--ref-batch")) {
      o->ref_batch = atoi(v);
    } else if (OPT("--ref-tokens")) {
      o->ref_tokens = atoi(v);
    } else if (OPT("--model")) {
      o->model = v;
    } else if (OPT("--lora")) {
      o->lora = v;
    } else if (OPT("--backend")) {
      if (lf_backend_parse(v, &o->backend) != LF_OK) return -1;
    } else if (OPT("--policies") || OPT("--policy")) {
      if (parse_policies(v, o)) return -1;
    } else if (OPT("--prompt")) {
      o->prompt = atoi(v);
    } else if (OPT("--output")) {
      o->output = atoi(v);
    } else if (OPT("--requests")) {
      o->n_req = atoi(v);
    } else if (OPT("--budget")) {
      o->budget = atoi(v);
    } else if (OPT("--full-budget")) {
      o->full_budget = atoi(v);
    } else if (OPT("--n-pools")) {
      o->n_pools = atoi(v);
    } else if (OPT("--kv-gb")) {
      o->kv_gb = atof(v);
    } else if (OPT("--mem-util")) {
      o->mem_util = atof(v);
    } else if (OPT("--arrival")) {
      if (!strcmp(v, "all")) o->poisson = 0;
      else if (!strcmp(v, "poisson")) o->poisson = 1;
      else return -1;
    } else if (OPT("--rate")) {
      o->rate = atof(v);
    } else if (OPT("--max-batch-tokens")) {
      o->max_batch_tokens = atoi(v);
    } else if (OPT("--evict-scope")) {
      if (lf_evict_scope_parse(v, &o->scope) != LF_OK) return -1;
    } else if (OPT("--kv-dtype")) {
      if (lf_kv_dtype_parse(v, &o->kv_dtype) != LF_OK) return -1;
    } else if (OPT("--sink")) {
      o->sink = atoi(v);
    } else if (OPT("--window")) {
      o->window = atoi(v);
    } else if (OPT("--h2o-recent")) {
      o->h2o_recent = atoi(v);
    } else if (OPT("--threads")) {
      o->threads = atoi(v);
    } else if (OPT("--duration")) {
      o->duration = atof(v);
    } else if (OPT("--warmup")) {
      o->warmup = atof(v);
    } else if (OPT("--seed")) {
      o->seed = strtoull(v, NULL, 10);
    } else if (OPT("--json")) {
      o->json = v;
    } else {
      fprintf(stderr, "lfbench serve: bad or incomplete option '%s'\n", a);
      return -1;
    }
#undef OPT
  }
  if (o->prompt < 1 || o->output < 1 || o->n_req < 0 || o->budget < 1 || o->full_budget < 0 ||
      o->n_pools < 0 || o->kv_gb < 0 || !(o->mem_util > 0 && o->mem_util <= 1) ||
      !(o->rate > 0) || o->sink < 0 || o->window < 0 || o->h2o_recent < 0 || o->threads < 0 ||
      o->duration < 0 || o->warmup < 0 || o->ref_batch < 0 || o->ref_tokens < 0 || o->ref_tokens > o->output) {
    fprintf(stderr, "lfbench serve: an option is out of range\n");
    return -1;
  }
  if (o->warmup > 0 && !o->poisson) {
    fprintf(stderr, "lfbench serve: --warmup needs --arrival poisson\n");
    return -1;
  }
  if (o->max_batch_tokens < 0) o->max_batch_tokens = LF_MAX_BATCH_TOKENS_DEFAULT;
  return 0;
}

/* ---- one policy's run -------------------------------------------------------------------- */

typedef struct req_state {
  double arrival; /* offset from the start, seconds */
  double submit_t, first_t, last_t;
  int tokens;     /* TOKEN events */
  uint64_t hash;  /* FNV-1a over the tokens */
  int finished;
  lf_finish_reason reason;
  lf_status status;
  uint64_t id;
  int submitted;
  int decoding; /* counted in the decode batch: first token out, not finished */
} req_state;

typedef struct serve_row {
  const char *policy;
  int budget, pools, n_req;
  uint64_t pool_bytes;
  int finished_length, finished_other, not_finished;
  int measured; /* requests in TTFT / TPOT: those arriving at or after --warmup */
  double window_end; /* the decode batch's window: [--warmup, this] seconds from the start */
  uint64_t output_tokens, evictions, steps;
  double wall_s, init_s, tokens_per_s;
  double ttft_p50, ttft_p99, tpot_p50, tpot_p99;
  double eng_ttft_p50, eng_ttft_p99, eng_tpot_p50, eng_tpot_p99;
  double step_s, host_s, idle_s, mean_step_ms, gpu_busy;
  uint64_t mem_before, mem_init, mem_peak, mem_end;
  uint64_t tokens_hash; /* FNV-1a over the requests' token hashes, in request order */
  /* decode batch: requests past their first token and not finished, before each step of the
   * window (steps with none are not counted; with --warmup, only steps that begin between the
   * warm-up and the last arrival) */
  double decode_batch_mean;
  int decode_batch_max;
  /* steps of the window split by whether some submitted request was still without its first
   * token before the step (its prompt in the step, or waiting for a pool): count and mean ms */
  uint64_t prompt_steps, decode_steps;
  double prompt_step_ms, decode_step_ms;
  /* --decode-only-ref (ref_batch 0: not measured) */
  int ref_batch, ref_steps;
  double ref_prefill_s, ref_step_mean_s, ref_step_median_s;
  /* the prompt's passes alone (isolated prefill: steps, mean) and with ref_batch sequences
   * decoding in the same passes (mixed: steps, mean; 0 steps: not measured) */
  int ref_prefill_steps, ref_mixed_steps, ref_mixed_batch;
  double ref_prefill_step_s, ref_mixed_step_s;
} serve_row;

#define FNV_OFFSET 1469598103934665603ull
#define FNV_PRIME 1099511628211ull

static uint64_t fnv1a(uint64_t h, uint64_t v) {
  for (int i = 0; i < 8; i++) {
    h ^= (v >> (8 * i)) & 0xffu;
    h *= FNV_PRIME;
  }
  return h;
}

/* The reference runs' event buffer and step: one lf_engine_step, *k events in ref_ev, *dt its
 * host time (the run's clock). Returns 0, or 1 on failure (reported). */
enum { REF_EV = 1024 };
static lf_event ref_ev[REF_EV];

static int ref_step(lf_engine_t e, int *k, double *t_end, double *dt) {
  const double ts = lf_now_s();
  const lf_status s = lf_engine_step(e, ref_ev, REF_EV, k);
  *t_end = lf_now_s();
  *dt = *t_end - ts;
  if (s == LF_OK) return 0;
  fprintf(stderr, "lfbench serve: reference step: %s: %s\n", lf_status_str(s), lf_last_error());
  return 1;
}

/* Steps e until it is idle. Returns 0, or 1 on failure. */
static int ref_drain(lf_engine_t e) {
  while (lf_engine_busy(e)) {
    int k = 0;
    double te, dt;
    if (ref_step(e, &k, &te, &dt)) return 1;
  }
  return 0;
}

/* Submits n requests of P prompt tokens (prompts[i * P ..]) and K output tokens: ids[0..n).
 * Returns 0, or 1 on failure. */
static int ref_submit(lf_engine_t e, const int32_t *prompts, int P, int K, int n, uint64_t *ids) {
  for (int i = 0; i < n; i++) {
    lf_request q = {.prompt = prompts + (size_t)i * P, .n_prompt = P, .max_tokens = K,
                    .ignore_eos = 1};
    if (lf_engine_submit(e, &q, &ids[i]) != LF_OK) {
      fprintf(stderr, "lfbench serve: reference submit: %s\n", lf_last_error());
      return 1;
    }
  }
  return 0;
}

/* Steps e until it is idle, following the requests ids[0..n): first[i] / fin[i] get the end
 * time of the step that sampled request i's first token / finished it (0 until then). The
 * duration of every step that began with all n requests past their first token and none
 * finished (a decode-only step of exactly n sequences) goes to dec_t[*n_dec] (up to cap).
 * With cancel_rest, the others are cancelled once one finishes. Returns 0, or 1 on failure. */
static int ref_drive(lf_engine_t e, const uint64_t *ids, int n, double *first, double *fin,
                     double *dec_t, int cap, int *n_dec, int cancel_rest) {
  const lf_event *ev = ref_ev;
  int n_first = 0, n_fin = 0, cancelled = 0;
  *n_dec = 0;
  while (lf_engine_busy(e)) {
    const int decode_only = n_first == n && n_fin == 0;
    int k = 0;
    double te, dt;
    if (ref_step(e, &k, &te, &dt)) return 1;
    if (decode_only && *n_dec < cap) dec_t[(*n_dec)++] = dt;
    for (int j = 0; j < k; j++)
      for (int i = 0; i < n; i++) {
        if (ids[i] != ev[j].id) continue;
        if (ev[j].type == LF_EVENT_TOKEN && first[i] == 0.0) {
          first[i] = te;
          n_first++;
        } else if (ev[j].type == LF_EVENT_FINISH) {
          fin[i] = te;
          n_fin++;
          if (ev[j].reason == LF_FINISH_ERROR) {
            fprintf(stderr, "lfbench serve: a reference request ended with an error: %s\n",
                    lf_status_str(ev[j].status));
            return 1;
          }
        }
      }
    if (n_fin && cancel_rest && !cancelled) {
      for (int i = 0; i < n; i++)
        if (fin[i] == 0.0) lf_engine_cancel(e, ids[i]);
      cancelled = 1;
    }
  }
  return 0;
}

/* Submits one P-token prompt (one output token) to e and steps until its first token, timing
 * every step: *steps, *mean_s (host time around lf_engine_step, the run's clock), *ttft_s.
 * Requests already in e keep decoding in the same steps. Returns 0, or 1 on failure. */
static int probe_prompt(lf_engine_t e, const int32_t *prompt, int P, int *steps, double *mean_s,
                        double *ttft_s) {
  const lf_event *ev = ref_ev;
  uint64_t id = 0;
  const double t0 = lf_now_s();
  if (ref_submit(e, prompt, P, 1, 1, &id)) return 1;
  double sum = 0.0;
  int n = 0, got = 0;
  while (!got) {
    int k = 0;
    double te, dt;
    if (ref_step(e, &k, &te, &dt)) return 1;
    sum += dt;
    n++;
    for (int j = 0; j < k; j++) {
      if (ev[j].id != id) continue;
      if (ev[j].type == LF_EVENT_TOKEN) {
        got = 1;
        *ttft_s = te - t0;
      } else if (ev[j].type == LF_EVENT_FINISH && ev[j].reason == LF_FINISH_ERROR) {
        fprintf(stderr, "lfbench serve: the reference prompt ended with an error: %s\n",
                lf_status_str(ev[j].status));
        return 1;
      }
    }
  }
  *steps = n;
  *mean_s = sum / n;
  return 0;
}

/* Steps e until every request ids[0..n) has its first token; then `extra` more steps. Returns
 * 0; 2 when one of them finished meanwhile (too few output tokens); 1 on failure. */
static int until_decoding(lf_engine_t e, const uint64_t *ids, int n, int extra) {
  const lf_event *ev = ref_ev;
  int n_first = 0;
  uint8_t *seen = calloc((size_t)n, 1);
  if (!seen) return 1;
  int rc = 0;
  while (rc == 0 && (n_first < n || extra-- > 0)) {
    int k = 0;
    double te, dt;
    rc = ref_step(e, &k, &te, &dt);
    for (int j = 0; j < k && rc == 0; j++)
      for (int i = 0; i < n; i++) {
        if (ids[i] != ev[j].id) continue;
        if (ev[j].type == LF_EVENT_TOKEN && !seen[i]) {
          seen[i] = 1;
          n_first++;
        } else if (ev[j].type == LF_EVENT_FINISH) {
          rc = 2;
        }
      }
  }
  free(seen);
  return rc;
}

/* --decode-only-ref, on the engine of the run that just ended (idle by now):
 *  1. isolated prefill: one P-token prompt alone, submit -> end of the step that sampled its
 *     first token; median of 3;
 *  2. decode-only steps: ref_batch requests of P prompt and K output tokens submitted at once;
 *     once all of them have their first token (their prefills are over), each step is a
 *     decode step of exactly ref_batch sequences, until the first one finishes. The figure is
 *     the mean (and median) host time around lf_engine_step of those steps, the first two left
 *     out (a CUDA graph may be captured there): the same clock as the run's TPOT. The context
 *     grows from about P + ref_batch (with one prefill a step) to P + K: on average about the
 *     run's P + O / 2 when K = O.
 *  3. mixed passes: ref_batch requests as in 2 again; once all of them decode (and two more
 *     steps), one P-token prompt as in 1, each step until its first token timed: every such
 *     step runs a chunk of the prompt and the ref_batch decode rows in one pass. Against the
 *     prompt's steps in 1 (the same chunks alone) and the decode-only step of 2, the difference
 *     is what a mixed pass costs beyond its two parts; then all are cancelled. */
static int decode_reference(const serve_opts *o, const lf_model_config *mc, lf_engine_t e,
                            serve_row *r) {
  const int P = o->prompt, K = o->ref_tokens ? o->ref_tokens : o->output;
  int Bd = o->ref_batch ? o->ref_batch : (int)lround(r->decode_batch_mean);
  if (Bd < 1) Bd = 1;
  if (Bd > r->pools) Bd = r->pools;
  int32_t *pr = malloc(sizeof(int32_t) * (size_t)Bd * (size_t)P);
  uint64_t *ids = calloc((size_t)Bd, sizeof *ids);
  double *first = calloc((size_t)Bd, sizeof *first), *fin = calloc((size_t)Bd, sizeof *fin);
  const int cap = K + 16;
  double *dt = calloc((size_t)cap, sizeof *dt);
  int rc = 1, nd = 0;
  if (!pr || !ids || !first || !fin || !dt) {
    fprintf(stderr, "lfbench serve: out of memory\n");
    goto out;
  }
  for (size_t i = 0; i < (size_t)Bd * P; i++)
    pr[i] = (int32_t)(rng_u64() % (uint64_t)mc->vocab_size);
  double tp[3], ps[3];
  for (int it = 0; it < 3; it++) {
    int steps = 0;
    if (probe_prompt(e, pr, P, &steps, &ps[it], &tp[it]) || ref_drain(e)) goto out;
    r->ref_prefill_steps = steps;
  }
  qsort(tp, 3, sizeof tp[0], cmp_double);
  qsort(ps, 3, sizeof ps[0], cmp_double);
  r->ref_prefill_s = tp[1];
  r->ref_prefill_step_s = ps[1];
  if (ref_submit(e, pr, P, K, Bd, ids) || ref_drive(e, ids, Bd, first, fin, dt, cap, &nd, 1))
    goto out;
  r->ref_batch = Bd;
  const int skip = nd > 4 ? 2 : 0;
  r->ref_steps = nd - skip;
  if (r->ref_steps > 0) {
    double sum = 0.0;
    for (int i = skip; i < nd; i++) sum += dt[i];
    r->ref_step_mean_s = sum / r->ref_steps;
    r->ref_step_median_s = pct(dt + skip, r->ref_steps, 50);
  }
  /* 3. the mixed passes (a pool left for the prompt) */
  const int Bm = Bd < r->pools ? Bd : r->pools - 1;
  if (ref_submit(e, pr, P, K, Bm, ids)) goto out;
  const int ud = Bm > 0 ? until_decoding(e, ids, Bm, 2) : 2;
  if (ud == 1) goto out;
  if (ud == 0) {
    double ttft = 0.0;
    if (probe_prompt(e, pr, P, &r->ref_mixed_steps, &r->ref_mixed_step_s, &ttft)) goto out;
    r->ref_mixed_batch = Bm;
  }
  for (int i = 0; i < Bm; i++) lf_engine_cancel(e, ids[i]);
  if (ref_drain(e)) goto out;
  rc = 0;
out:
  free(pr);
  free(ids);
  free(first);
  free(fin);
  free(dt);
  return rc;
}

/* One policy's engine (r: policy, budget, init time, memory, pools, requests). Under TP (comm)
 * every rank builds it; a rank other than 0 then follows rank 0's steps until it frees its
 * engine, and returns with *out NULL. Returns 0, or 1 after a message. */
static int start_engine(const serve_opts *o, int cuda, lf_policy pol, lf_comm_t comm,
                        serve_row *r, lf_engine_t *out) {
  *out = NULL;
  memset(r, 0, sizeof *r);
  r->policy = lf_policy_str(pol);
  r->budget = pol == LF_POLICY_FULL ? (o->full_budget ? o->full_budget : o->prompt + o->output)
                                    : o->budget;
  lf_engine_config cfg;
  lf_engine_config_default(&cfg);
  cfg.model_path = o->model;
  cfg.lora_path = o->lora;
  cfg.backend = cuda ? LF_BACKEND_CUDA : LF_BACKEND_CPU;
  cfg.policy = pol;
  cfg.budget = r->budget;
  cfg.sink = o->sink;
  cfg.window = o->window;
  cfg.h2o_recent = o->h2o_recent;
  cfg.evict_scope = o->scope;
  cfg.kv_dtype = o->kv_dtype;
  /* Pools: --pools, else the engine's own sizing from --kv-gb (floor(kv_gb * 1e9 * mem_util /
   * pool bytes), pool bytes those of the backend's arena for this rank's KV heads), else 8. */
  cfg.n_pools = o->n_pools ? o->n_pools : o->kv_gb > 0 ? 0 : 8;
  if (!o->n_pools && o->kv_gb > 0) {
    cfg.kv_memory_bytes = (uint64_t)(o->kv_gb * 1e9);
    cfg.mem_util = o->mem_util;
    cfg.max_pools = 1000000;
  }
  cfg.max_batch_tokens = o->max_batch_tokens;
  cfg.n_threads = o->threads;

  if (!cuda) rss_peak_reset();
  r->mem_before = mem_used(cuda);
  lf_engine_t e = NULL;
  double t = lf_now_s();
  lf_status s = lf_engine_init(&cfg, comm, &e);
  r->init_s = lf_now_s() - t;
  if (s != LF_OK) {
    fprintf(stderr, "lfbench serve: rank %d: %s: lf_engine_init: %s: %s\n", lf_comm_rank(comm),
            r->policy, lf_status_str(s), lf_last_error());
    return 1;
  }
  if (lf_comm_rank(comm) != 0) { /* a follower: rank 0's steps until it frees its engine */
    s = lf_engine_follow(e);
    if (s != LF_OK)
      fprintf(stderr, "lfbench serve: rank %d: %s: %s: %s\n", lf_comm_rank(comm), r->policy,
              lf_status_str(s), lf_last_error());
    lf_engine_free(e);
    return s == LF_OK ? 0 : 1;
  }
  r->mem_init = r->mem_peak = mem_used(cuda);
  /* what the engine holds: its pool count and the bytes of one pool */
  lf_resolved_config rcfg;
  lf_pool_sizing ps;
  lf_engine_resolved_config(e, &rcfg);
  lf_engine_pool_sizing(e, &ps);
  r->pools = rcfg.n_pools;
  r->pool_bytes = ps.pool_bytes;
  r->n_req = o->n_req ? o->n_req : r->pools;
  *out = e;
  return 0;
}

/* The workload: seeded prompts (*prompts, [n_req][P]) and arrival offsets (*rq), the same for
 * every policy. Returns 0, or 1 after a message. */
static int make_workload(const serve_opts *o, const lf_model_config *mc, serve_row *r,
                         req_state **rq_out, int32_t **prompts_out) {
  rng_s = o->seed;
  const int N = r->n_req, P = o->prompt;
  req_state *rq = calloc((size_t)N, sizeof *rq);
  int32_t *prompts = malloc(sizeof(int32_t) * (size_t)N * (size_t)P);
  if (!rq || !prompts) {
    fprintf(stderr, "lfbench serve: out of memory\n");
    free(rq);
    free(prompts);
    return 1;
  }
  double at = 0.0;
  for (int i = 0; i < N; i++) {
    if (o->poisson) at += -log(rng_unit()) / o->rate;
    rq[i].arrival = o->poisson ? at : 0.0;
    for (int j = 0; j < P; j++)
      prompts[(size_t)i * P + j] = (int32_t)(rng_u64() % (uint64_t)mc->vocab_size);
  }
  r->window_end = o->warmup > 0 ? at : 0.0;
  if (o->warmup > 0 && !(at > o->warmup)) {
    fprintf(stderr, "lfbench serve: --warmup %g s: the last of %d arrivals is at %.1f s, so no "
            "steady-state window is left; ask for more requests\n", o->warmup, N, at);
    free(rq);
    free(prompts);
    return 1;
  }
  *rq_out = rq;
  *prompts_out = prompts;
  return 0;
}

/* What the run loop keeps beside the requests and the row. */
typedef struct run_tally {
  int N, next_sub, done;
  int decoding, dec_steps; /* the decode batch: see serve_row */
  double dec_sum;
  int no_token; /* submitted, not finished, no token yet */
  double prompt_step_s, decode_step_s;
  double t0;
  double cutoff; /* --duration: the end of the window once reached; -1 before */
} run_tally;

/* Submits the requests that have arrived by tn (until the queue is full). 0, or 1 after a
 * message. */
static int submit_arrived(const serve_opts *o, lf_engine_t e, req_state *rq,
                          const int32_t *prompts, double tn, run_tally *t) {
  const int P = o->prompt;
  while (t->next_sub < t->N && rq[t->next_sub].arrival <= tn - t->t0) {
    lf_request req = {.prompt = prompts + (size_t)t->next_sub * P,
                      .n_prompt = P,
                      .max_tokens = o->output,
                      .ignore_eos = 1};
    lf_status s = lf_engine_submit(e, &req, &rq[t->next_sub].id);
    if (s == LF_ERR_QUEUE_FULL) break;
    if (s != LF_OK) {
      fprintf(stderr, "lfbench serve: submit: %s: %s\n", lf_status_str(s), lf_last_error());
      return 1;
    }
    rq[t->next_sub].submit_t = tn;
    rq[t->next_sub].submitted = 1;
    t->no_token++;
    t->next_sub++;
  }
  return 0;
}

/* A step's events into the requests' state; te is the step's end. */
static void route_events(const lf_event *ev, int n, req_state *rq, double te, run_tally *t) {
  const int N = t->N;
  for (int k = 0; k < n; k++) {
    /* ids are handed out 1, 2, ... in submit order by the scheduler; search from the id's
     * guess and fall back to a scan. */
    int i = (int)ev[k].id - 1;
    if (i < 0 || i >= N || rq[i].id != ev[k].id)
      for (i = 0; i < N && rq[i].id != ev[k].id; i++) {
      }
    if (i >= N) continue;
    req_state *q = &rq[i];
    if (ev[k].type == LF_EVENT_TOKEN) {
      if (t->cutoff >= 0) continue; /* after the window */
      if (!q->tokens) {
        t->no_token--;
        q->first_t = te;
        q->hash = FNV_OFFSET;
        q->decoding = 1;
        t->decoding++;
      }
      q->last_t = te;
      q->tokens++;
      q->hash = fnv1a(q->hash, (uint64_t)(uint32_t)ev[k].token);
    } else {
      if (q->decoding) {
        q->decoding = 0;
        t->decoding--;
      }
      if (!q->tokens) t->no_token--;
      q->finished = 1;
      q->reason = ev[k].reason;
      q->status = ev[k].status;
      t->done++;
    }
  }
}

/* Runs the workload through the engine: submits requests as they arrive, steps, routes the
 * events, samples memory and GPU utilisation, and ends at the last finish (or --duration's
 * window, cancelling what is still open). Fills r's timing figures. 0, or 1 after a message. */
static int drive(const serve_opts *o, lf_engine_t e, int cuda, req_state *rq,
                 const int32_t *prompts, serve_row *r, run_tally *t) {
  gpu_util gu;
  gpu_util_open(&gu, cuda);
  enum { EV_CAP = 4096 };
  static lf_event ev[EV_CAP];
  const int N = t->N;
  int rc = 0;
  t->t0 = lf_now_s();
  t->cutoff = -1.0;
  const double t0 = t->t0;
  double last_mem = t0, last_util = t0, last_print = t0;
  while (t->done < N) {
    double tn = lf_now_s();
    if (o->duration > 0 && t->cutoff < 0 && tn - t0 >= o->duration) {
      /* End of the window: cancel everything still open and drain. */
      t->cutoff = t0 + o->duration;
      for (int i = 0; i < t->next_sub; i++)
        if (!rq[i].finished) lf_engine_cancel(e, rq[i].id);
      t->done += N - t->next_sub; /* never submitted */
      t->next_sub = N;
    }
    /* Submit what has arrived; wait for the next arrival when idle. */
    if (submit_arrived(o, e, rq, prompts, tn, t)) {
      rc = 1;
      break;
    }
    if (!lf_engine_busy(e)) {
      if (t->next_sub < N) {
        double w = t0 + rq[t->next_sub].arrival - lf_now_s();
        if (o->duration > 0 && w > t0 + o->duration - lf_now_s()) w = t0 + o->duration - lf_now_s();
        const double ts = lf_now_s();
        sleep_s(w);
        r->idle_s += lf_now_s() - ts;
        continue;
      }
      break; /* nothing left: every request ended */
    }
    const int in_window = o->warmup <= 0 || (tn - t0 >= o->warmup && tn - t0 <= r->window_end);
    if (t->cutoff < 0 && t->decoding > 0 && in_window) {
      t->dec_sum += t->decoding;
      t->dec_steps++;
      if (t->decoding > r->decode_batch_max) r->decode_batch_max = t->decoding;
    }
    int n = 0;
    const double ts = lf_now_s();
    lf_status s = lf_engine_step(e, ev, EV_CAP, &n);
    const double te = lf_now_s();
    if (t->cutoff < 0) { /* steps that drain cancellations after the window are not counted */
      const double lim = o->duration > 0 ? t0 + o->duration : te;
      const double dt = (te < lim ? te : lim) - ts;
      r->step_s += dt;
      r->steps++;
      if (t->no_token > 0) {
        t->prompt_step_s += dt;
        r->prompt_steps++;
      } else {
        t->decode_step_s += dt;
        r->decode_steps++;
      }
    }
    if (s != LF_OK) {
      fprintf(stderr, "lfbench serve: step: %s: %s\n", lf_status_str(s), lf_last_error());
      rc = 1;
      break;
    }
    route_events(ev, n, rq, te, t);
    if (te - last_mem > 0.5) {
      const uint64_t m = mem_used(cuda);
      if (m > r->mem_peak) r->mem_peak = m;
      last_mem = te;
    }
    if (gu.ok && te - last_util > 0.2) {
      gpu_util_sample(&gu);
      last_util = te;
    }
    if (!o->quiet && te - last_print > 10.0) {
      lf_metrics mm;
      if (lf_engine_metrics(e, &mm) == LF_OK)
        fprintf(stderr, "# %s t=%.0fs running %d waiting %d done %d/%d tok/s(10s) %.0f\n",
                r->policy, te - t0, mm.running, mm.waiting, t->done, N, mm.tokens_per_s);
      last_print = te;
    }
  }
  if (rc == 0) {
    const double t_end = t->cutoff >= 0 ? t->cutoff : lf_now_s();
    r->wall_s = t_end - t0;
    r->mem_end = mem_used(cuda);
    if (r->mem_end > r->mem_peak) r->mem_peak = r->mem_end;
    if (!cuda) {
      const uint64_t hwm = mem_peak_rss();
      if (hwm > r->mem_peak) r->mem_peak = hwm;
    }
  }
  const double busy = gpu_util_close(&gu);
  if (rc == 0) r->gpu_busy = busy;
  return rc;
}

/* The row's figures from the requests' state (TTFT / TPOT over the requests arriving from
 * --warmup on, outcomes, the tokens' hash), the tally and the engine's own metrics. */
static void summarize(const serve_opts *o, lf_engine_t e, const req_state *rq,
                      const run_tally *t, serve_row *r) {
  const int N = t->N;
  double *ttft = malloc(sizeof(double) * (size_t)N), *tpot = malloc(sizeof(double) * (size_t)N);
  int nt = 0, np = 0;
  r->tokens_hash = FNV_OFFSET;
  for (int i = 0; i < N; i++) {
    const req_state *q = &rq[i];
    r->output_tokens += (uint64_t)q->tokens;
    r->tokens_hash = fnv1a(r->tokens_hash, q->tokens ? q->hash : 0);
    if (q->finished && q->reason == LF_FINISH_LENGTH) r->finished_length++;
    else if (q->finished && q->reason != LF_FINISH_CANCELLED) r->finished_other++;
    else r->not_finished++;
    if (q->finished && q->reason == LF_FINISH_ERROR && r->finished_other == 1)
      fprintf(stderr, "lfbench serve: %s: request %d ended with an error: %s\n", r->policy, i,
              lf_status_str(q->status));
    if (q->arrival < o->warmup) continue; /* warm-up: not in the figures */
    r->measured++;
    if (q->tokens >= 1) ttft[nt++] = q->first_t - q->submit_t;
    if (q->tokens >= 2) tpot[np++] = (q->last_t - q->first_t) / (q->tokens - 1);
  }
  r->ttft_p50 = pct(ttft, nt, 50);
  r->ttft_p99 = pct(ttft, nt, 99);
  r->tpot_p50 = pct(tpot, np, 50);
  r->tpot_p99 = pct(tpot, np, 99);
  free(ttft);
  free(tpot);
  r->tokens_per_s = r->wall_s > 0 ? (double)r->output_tokens / r->wall_s : 0.0;
  r->host_s = r->wall_s - r->step_s - r->idle_s;
  if (r->host_s < 0) r->host_s = 0;
  r->mean_step_ms = r->steps ? 1e3 * r->step_s / (double)r->steps : 0.0;
  r->decode_batch_mean = t->dec_steps ? t->dec_sum / t->dec_steps : 0.0;
  r->prompt_step_ms = r->prompt_steps ? 1e3 * t->prompt_step_s / (double)r->prompt_steps : 0.0;
  r->decode_step_ms = r->decode_steps ? 1e3 * t->decode_step_s / (double)r->decode_steps : 0.0;
  lf_metrics m;
  if (lf_engine_metrics(e, &m) == LF_OK) {
    r->evictions = m.evictions;
    r->eng_ttft_p50 = m.ttft.p50;
    r->eng_ttft_p99 = m.ttft.p99;
    r->eng_tpot_p50 = m.tpot.p50;
    r->eng_tpot_p99 = m.tpot.p99;
  }
}

/* One policy's engine and workload. Under TP (comm) every rank calls this with the same
 * arguments; ranks other than 0 only build the engine and follow rank 0's steps. Returns 0, 1
 * on a failure, 3 when a request ended other than by its length. */
static int run_policy(const serve_opts *o, const lf_model_config *mc, int cuda, lf_policy pol,
                      lf_comm_t comm, serve_row *r) {
  lf_engine_t e = NULL;
  int rc = start_engine(o, cuda, pol, comm, r, &e);
  if (rc || !e) return rc; /* a failure, or a follower that is done */
  req_state *rq = NULL;
  int32_t *prompts = NULL;
  if (make_workload(o, mc, r, &rq, &prompts)) {
    lf_engine_free(e);
    return 1;
  }
  run_tally t = {.N = r->n_req};
  rc = drive(o, e, cuda, rq, prompts, r, &t);
  if (rc == 0) {
    summarize(o, e, rq, &t, r);
    if (r->finished_other) rc = 3;
    if (o->decode_ref && rc == 0 && decode_reference(o, mc, e, r)) rc = 1;
  }
  lf_engine_free(e);
  free(rq);
  free(prompts);
  return rc;
}

/* ---- output ------------------------------------------------------------------------------- */

static void print_header(void) {
  printf("# %-9s %6s %6s %6s %10s %9s %9s %9s %9s %9s %8s %6s %6s %6s %6s %9s %9s %12s %5s\n",
         "policy", "budget", "pools", "reqs", "out_tok", "tok/s", "ttft_p50", "ttft_p99",
         "tpot_p50", "tpot_p99", "wall_s", "step%", "host%", "idle%", "gpu%", "mem_MB", "peak_MB",
         "evictions", "ok");
}
static void print_row(const serve_row *r) {
  char gpu[16];
  if (r->gpu_busy >= 0) snprintf(gpu, sizeof gpu, "%.1f", 100.0 * r->gpu_busy);
  else snprintf(gpu, sizeof gpu, "-");
  const double w = r->wall_s > 0 ? r->wall_s : 1.0;
  printf("  %-9s %6d %6d %6d %10llu %9.1f %9.4f %9.4f %9.5f %9.5f %8.2f %6.1f %6.1f %6.1f %6s "
         "%9.1f %9.1f %12llu %5s\n",
         r->policy, r->budget, r->pools, r->n_req, (unsigned long long)r->output_tokens,
         r->tokens_per_s, r->ttft_p50, r->ttft_p99, r->tpot_p50, r->tpot_p99, r->wall_s,
         100.0 * r->step_s / w, 100.0 * r->host_s / w, 100.0 * r->idle_s / w, gpu,
         (double)r->mem_init / 1048576.0, (double)r->mem_peak / 1048576.0,
         (unsigned long long)r->evictions, r->finished_other ? "ERR" : "OK");
  fflush(stdout);
}

static int write_json(const serve_opts *o, const char *backend, const lf_model_config *mc,
                      const serve_row *rows, int n, int tp) {
  FILE *f = fopen(o->json, "w");
  if (!f) {
    fprintf(stderr, "lfbench serve: cannot write %s\n", o->json);
    return 1;
  }
  char host[128] = "";
  if (gethostname(host, sizeof host) != 0) host[0] = '\0';
  host[sizeof host - 1] = '\0';
  bench_json_safe(host);
  fprintf(f,
          "{\"bench\": \"serve\", \"model\": \"%s\", \"backend\": \"%s\", \"host\": \"%s\", "
          "\"n_layers\": %d, \"n_kv_heads\": %d, \"head_dim\": %d,\n \"prompt\": %d, "
          "\"output\": %d, \"arrival\": \"%s\", \"rate\": %g, \"kv_gb\": %g, \"mem_util\": %g, "
          "\"max_batch_tokens\": %d, \"sink\": %d, \"window\": %d, \"h2o_recent\": %d, \"evict_scope\": \"%s\", \"kv_dtype\": \"%s\", "
          "\"duration\": %g, \"warmup\": %g, "
          "\"seed\": %llu, \"mem_kind\": \"%s\", \"tp\": %d, \"decode_only_ref\": %s, "
          "\"ref_tokens\": %d,\n \"rows\": [\n",
          o->model, backend, host, mc->n_layers, mc->n_kv_heads, mc->head_dim, o->prompt,
          o->output, o->poisson ? "poisson" : "all", o->poisson ? o->rate : 0.0, o->kv_gb,
          o->mem_util, o->max_batch_tokens, o->sink, o->window, o->h2o_recent, lf_evict_scope_str(o->scope),
          lf_kv_dtype_str(o->kv_dtype), o->duration, o->warmup,
          (unsigned long long)o->seed, strcmp(backend, "cuda") ? "rss" : "device_used", tp,
          o->decode_ref ? "true" : "false",
          o->decode_ref ? (o->ref_tokens ? o->ref_tokens : o->output) : 0);
  for (int i = 0; i < n; i++) {
    const serve_row *r = &rows[i];
    char gpu[32] = "null";
    if (r->gpu_busy >= 0) snprintf(gpu, sizeof gpu, "%.4f", r->gpu_busy);
    const double w = r->wall_s > 0 ? r->wall_s : 1.0;
    char ref[12][32];
    for (int k = 0; k < 12; k++) snprintf(ref[k], sizeof ref[k], "null");
    if (r->ref_batch) {
      snprintf(ref[0], sizeof ref[0], "%d", r->ref_batch);
      snprintf(ref[1], sizeof ref[1], "%d", r->ref_steps);
      snprintf(ref[2], sizeof ref[2], "%.6f", r->ref_prefill_s);
      if (r->ref_steps > 0) {
        snprintf(ref[3], sizeof ref[3], "%.4f", 1e3 * r->ref_step_mean_s);
        snprintf(ref[4], sizeof ref[4], "%.4f", 1e3 * r->ref_step_median_s);
        snprintf(ref[5], sizeof ref[5], "%.4f", r->tpot_p99 / r->ref_step_mean_s);
      }
      if (r->ref_prefill_s > 0)
        snprintf(ref[6], sizeof ref[6], "%.4f", r->ttft_p50 / r->ref_prefill_s);
      snprintf(ref[7], sizeof ref[7], "%d", r->ref_prefill_steps);
      snprintf(ref[8], sizeof ref[8], "%.4f", 1e3 * r->ref_prefill_step_s);
      if (r->ref_mixed_steps > 0) {
        snprintf(ref[9], sizeof ref[9], "%d", r->ref_mixed_batch);
        snprintf(ref[10], sizeof ref[10], "%d", r->ref_mixed_steps);
        snprintf(ref[11], sizeof ref[11], "%.4f", 1e3 * r->ref_mixed_step_s);
      }
    }
    fprintf(f,
            "  {\"policy\": \"%s\", \"budget\": %d, \"pools\": %d, \"pool_bytes\": %llu, "
            "\"requests\": %d, \"measured_requests\": %d, \"window_end_s\": %.3f, \"finished_length\": %d, \"finished_other\": %d, "
            "\"not_finished\": %d, \"output_tokens\": %llu, \"wall_s\": %.4f, \"init_s\": %.3f, "
            "\"tokens_per_s\": %.3f, \"ttft_p50_s\": %.6f, \"ttft_p99_s\": %.6f, "
            "\"tpot_p50_s\": %.7f, \"tpot_p99_s\": %.7f, \"engine_ttft_p50_s\": %.6f, "
            "\"engine_ttft_p99_s\": %.6f, \"engine_tpot_p50_s\": %.7f, \"engine_tpot_p99_s\": %.7f, "
            "\"steps\": %llu, \"mean_step_ms\": %.4f, \"step_fraction\": %.5f, "
            "\"host_fraction\": %.5f, \"idle_fraction\": %.5f, \"gpu_busy\": %s, "
            "\"mem_before\": %llu, \"mem_init\": %llu, \"mem_peak\": %llu, \"mem_end\": %llu, "
            "\"evictions\": %llu, \"tokens_fnv1a\": \"%016llx\", \"decode_batch_mean\": %.3f, "
            "\"decode_batch_max\": %d, \"prompt_steps\": %llu, \"prompt_step_ms\": %.4f, "
            "\"decode_steps\": %llu, \"decode_step_ms\": %.4f, \"ref_batch\": %s, \"ref_steps\": %s, "
            "\"ref_prefill_s\": %s, \"ref_decode_step_ms\": %s, \"ref_decode_step_ms_median\": %s, "
            "\"tpot_p99_over_ref\": %s, \"ttft_p50_over_ref_prefill\": %s, "
            "\"ref_prefill_steps\": %s, \"ref_prefill_step_ms\": %s, \"ref_mixed_batch\": %s, "
            "\"ref_mixed_steps\": %s, \"ref_mixed_step_ms\": %s}%s\n",
            r->policy, r->budget, r->pools, (unsigned long long)r->pool_bytes, r->n_req, r->measured,
            r->window_end,
            r->finished_length, r->finished_other, r->not_finished,
            (unsigned long long)r->output_tokens, r->wall_s, r->init_s, r->tokens_per_s,
            r->ttft_p50, r->ttft_p99, r->tpot_p50, r->tpot_p99, r->eng_ttft_p50, r->eng_ttft_p99,
            r->eng_tpot_p50, r->eng_tpot_p99, (unsigned long long)r->steps, r->mean_step_ms,
            r->step_s / w, r->host_s / w, r->idle_s / w, gpu, (unsigned long long)r->mem_before,
            (unsigned long long)r->mem_init, (unsigned long long)r->mem_peak,
            (unsigned long long)r->mem_end, (unsigned long long)r->evictions,
            (unsigned long long)r->tokens_hash, r->decode_batch_mean, r->decode_batch_max,
            (unsigned long long)r->prompt_steps, r->prompt_step_ms,
            (unsigned long long)r->decode_steps, r->decode_step_ms, ref[0], ref[1], ref[2], ref[3], ref[4], ref[5], ref[6], ref[7], ref[8], ref[9], ref[10],
            ref[11], i + 1 < n ? "," : "");
  }
  fprintf(f, "]}\n");
  fclose(f);
  return 0;
}

int bench_serve(int argc, char **argv) {
  serve_opts o;
  if (parse_args(argc, argv, &o)) {
    serve_usage(stderr);
    return 2;
  }
  lf_model_config mc;
  if (bench_model_config("lfbench serve", o.model, &mc)) return 1;
  lf_status s;

  /* Resolved as lf_backend_create resolves it, so pool sizes use the right layout. */
  const int cuda = lf_backend_resolve(o.backend) == LF_BACKEND_CUDA;
  const char *backend = lf_backend_str(cuda ? LF_BACKEND_CUDA : LF_BACKEND_CPU);
  if (o.prompt + o.output > mc.max_seq_len) {
    fprintf(stderr, "lfbench serve: prompt + output = %d exceeds the model's context %d\n",
            o.prompt + o.output, mc.max_seq_len);
    return 2;
  }
  lf_comm_t comm = NULL;
  if (lf_launched_multi_rank()) {
    s = lf_tp_start(&argc, &argv, cuda ? LF_BACKEND_CUDA : LF_BACKEND_CPU, &comm);
    if (s != LF_OK) {
      fprintf(stderr, "lfbench serve: mpirun: %s: %s\n", lf_status_str(s), lf_last_error());
      return 1;
    }
  }
  const int tp = lf_comm_size(comm);
  if (lf_comm_rank(comm) != 0) { /* a follower: the same engines, in the same order */
    int rc = 0;
    serve_row row;
    for (int i = 0; i < o.n_policies && !rc; i++)
      rc = run_policy(&o, &mc, cuda, o.policies[i], comm, &row);
    if (rc) return 1;
    lf_tp_end(comm);
    return 0;
  }

  printf("# lfbench serve: model %s, backend %s, prompt %d, output %d, arrival %s", o.model,
         backend, o.prompt, o.output, o.poisson ? "poisson" : "all");
  if (o.poisson) printf(" (%g/s)", o.rate);
  if (o.n_pools) printf(", n_pools %d", o.n_pools);
  else if (o.kv_gb > 0) printf(", kv %g GB x %g%s", o.kv_gb, o.mem_util, tp > 1 ? " per rank" : "");
  printf(", max_batch_tokens %d%s", o.max_batch_tokens, o.duration > 0 ? ", windowed" : "");
  if (tp > 1) printf(", tensor parallel over %d ranks (memory: rank 0's)", tp);
  printf("\n");
  printf("# times in seconds; step%% = wall inside lf_engine_step, host%% = outside it, idle%% = "
         "waiting for arrivals; mem = %s after init, peak during the run\n",
         cuda ? "device used (cudaMemGetInfo)" : "RSS");
  print_header();
  serve_row rows[MAX_POLICIES];
  int rc = 0, n = 0;
  for (int i = 0; i < o.n_policies; i++) {
    int r = run_policy(&o, &mc, cuda, o.policies[i], comm, &rows[n]);
    if (r == 1) {
      if (comm) return 1; /* the followers are in that engine: the launcher ends the job */
      rc = 1;
      continue;
    }
    if (r) rc = r;
    print_row(&rows[n]);
    n++;
  }
  for (int i = 0; i < n; i++)
    printf("# %s: generated tokens, FNV-1a over the requests in order: %016llx\n", rows[i].policy,
           (unsigned long long)rows[i].tokens_hash);
  for (int i = 0; i < n; i++) {
    const serve_row *r = &rows[i];
    printf("# %s: decode batch (sequences past their first token, before each step) mean %.1f, "
           "max %d\n",
           r->policy, r->decode_batch_mean, r->decode_batch_max);
    if (o.warmup > 0)
      printf("# %s: steady state: TTFT / TPOT over the %d requests arriving from %.1f s on, the "
             "decode batch over the steps from %.1f s to the last arrival at %.1f s\n",
             r->policy, r->measured, o.warmup, o.warmup, r->window_end);
    printf("# %s: steps with a request still before its first token (prompt work or a wait for "
           "a pool): %llu, mean %.3f ms; the others: %llu, mean %.3f ms\n",
           r->policy, (unsigned long long)r->prompt_steps, r->prompt_step_ms,
           (unsigned long long)r->decode_steps, r->decode_step_ms);
    if (!o.decode_ref) continue;
    if (!r->ref_batch) {
      printf("# %s: decode-only reference: not measured\n", r->policy);
      continue;
    }
    printf("# %s: isolated prefill of one %d-token prompt %.4f s (median of 3): TTFT p50 / it = "
           "%.2fx (issue 19: <= 2)\n",
           r->policy, o.prompt, r->ref_prefill_s,
           r->ref_prefill_s > 0 ? r->ttft_p50 / r->ref_prefill_s : 0.0);
    if (r->ref_steps > 0)
      printf("# %s: decode-only step at batch %d: %.3f ms mean, %.3f median (%d steps): TPOT p99 "
             "/ it = %.2fx (issue 19: <= 1.5), TPOT p50 / it = %.2fx\n",
             r->policy, r->ref_batch, 1e3 * r->ref_step_mean_s, 1e3 * r->ref_step_median_s,
             r->ref_steps, r->tpot_p99 / r->ref_step_mean_s, r->tpot_p50 / r->ref_step_mean_s);
    else
      printf("# %s: decode-only step at batch %d: no decode-only step (--ref-tokens too small "
             "for the batch)\n",
             r->policy, r->ref_batch);
    if (r->ref_mixed_steps > 0)
      printf("# %s: the %d-token prompt's passes: alone %d, %.3f ms each; with %d sequences "
             "decoding %d, %.3f ms each: %.3f ms more than alone%s\n",
             r->policy, o.prompt, r->ref_prefill_steps, 1e3 * r->ref_prefill_step_s,
             r->ref_mixed_batch, r->ref_mixed_steps, 1e3 * r->ref_mixed_step_s,
             1e3 * (r->ref_mixed_step_s - r->ref_prefill_step_s),
             r->ref_mixed_batch == r->ref_batch ? " (compare the decode-only step above)" : "");
    else
      printf("# %s: mixed passes: not measured (no pool left beside the batch, or --ref-tokens "
             "too small)\n",
             r->policy);
  }
  /* The headline ratio, when both are there. */
  const serve_row *full = NULL, *lf = NULL;
  for (int i = 0; i < n; i++) {
    if (!strcmp(rows[i].policy, "full")) full = &rows[i];
    if (!strcmp(rows[i].policy, "longflow")) lf = &rows[i];
  }
  if (full && lf && full->tokens_per_s > 0)
    printf("# longflow / full output tokens/s: %.2fx (pools %d vs %d)\n",
           lf->tokens_per_s / full->tokens_per_s, lf->pools, full->pools);
  if (o.json && n && write_json(&o, backend, &mc, rows, n, tp)) rc = 1;
  if (rc == 0 || !comm) lf_tp_end(comm);
  return rc;
}

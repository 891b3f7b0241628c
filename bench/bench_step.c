/* lfbench step — one decode step of the cuda engine backend against its memory-bandwidth floor.
 *
 * For each model (random:NAME checkpoints: real shapes, no files) the backend is created with
 * budget B and as many pools as the largest batch; every pool is filled by a prefill of B - 1
 * random tokens, so each decode step reads B slots per (sequence, layer, KV head) and evicts.
 * Then, per batch size, `warmup` steps and `steps` timed steps; the figure is the median.
 *
 * Timing: host clock around backend->forward(), which ends in a stream synchronise, so a step
 * is everything a serving loop waits for: step upload, the layers (a CUDA graph replay once the
 * batch size has been seen twice), LM head, sampling, the token copy back. Events on the
 * backend's private stream are not reachable from here, and on the legacy stream they would
 * measure the same host interval.
 *
 * Floor = (bf16 matrix bytes read per step, LM head included, embedding table excluded: it is a
 * gather + K and V bytes of the batch's filled slots) / device-to-device copy bandwidth measured
 * in the same run (2 GiB cudaMemcpy, read + write). ratio = step / floor; roofline = floor / step.
 *
 * --tp (under mpirun -np T, one GPU per rank, NCCL): every rank creates its shard of the backend
 * (lf_backend_params.comm); rank 0 drives through the tensor-parallel lead wrapper
 * (engine/tp.h: one descriptor broadcast per step, as the engine does) and the others follow.
 * The step time is then rank 0's host clock around the wrapper's forward, descriptor included;
 * the floor is per GPU: (weights + KV) / T.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_gpu.h"
#include "bench_util.h"

#include "attention/attention.h"
#include "base/clock.h"
#include "launch/cli.h"
#include "lfserve.h"
#include "memory/pool.h"

#if defined(LF_HAVE_CUDA) && defined(LF_HAVE_CUDA_BACKEND)
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include "engine/backend.h"
#include "engine/model.h"
#include "parallel/comm.h"
#include "engine/tp.h"
#ifdef LF_HAVE_MPI
#include <mpi.h>
#endif

#define STEP_MAX_LIST 16

static uint64_t step_rng = 0x2545f4914f6cdd1dull;
static uint32_t rnd(uint32_t n) {
  step_rng ^= step_rng << 13;
  step_rng ^= step_rng >> 7;
  step_rng ^= step_rng << 17;
  return (uint32_t)(step_rng >> 33) % n;
}

static double weight_bytes(const lf_model_config *m) {
  const double dim = m->dim, hid = m->hidden_dim, qd = (double)m->n_heads * m->head_dim,
               kd = (double)m->n_kv_heads * m->head_dim;
  const double layer = (qd + 2 * kd) * dim + dim * qd + 2 * hid * dim + dim * hid;
  return 2.0 * (m->n_layers * layer + (double)m->vocab_size * dim);
}

#define STEP_FAIL(...)                                                                             \
  do {                                                                                             \
    fprintf(stderr, "lfbench step: " __VA_ARGS__);                                                 \
    fprintf(stderr, ": %s\n", lf_last_error());                                                    \
    rc = 1;                                                                                        \
    goto done;                                                                                     \
  } while (0)

/* items[0..n): one decode token of each pool at position pos (each pool's last token). */
static void stage_decode(lf_batch_item *items, const int *pools, const int32_t *last, int n,
                         int32_t pos) {
  for (int i = 0; i < n; i++) {
    memset(&items[i], 0, sizeof items[i]);
    items[i].pool = pools[i];
    items[i].pos0 = pos;
    items[i].n_tok = 1;
    items[i].tokens = &last[i];
  }
}

/* One model: create, fill the pools, time each batch size; rows appended to json. rkv_stage as
 * requested (0: the engine's default for the smallest layer budget). */
static int run_model(const char *model, const int *batches, int nb, int budget, int steps,
                     int warmup, double copy_gbs, FILE *json, int *first_row, lf_comm_t comm,
                     lf_kv_dtype kv_dtype, lf_policy policy, int rkv_stage,
                     const double *lw, int n_lw) {
  int rc = 0, max_b = 0;
  int *lb = NULL; /* per-layer budgets from --layer-weights */
  for (int i = 0; i < nb; i++) max_b = batches[i] > max_b ? batches[i] : max_b;
  lf_checkpoint ck;
  memset(&ck, 0, sizeof ck);
  lf_backend *b = NULL;
  int *pools = NULL;
  int32_t *prompt = NULL, *last = NULL;
  lf_batch_item *items = NULL;
  lf_batch_result *res = NULL;
  double *t = NULL;
  if (lf_checkpoint_open(model, &ck) != LF_OK) {
    fprintf(stderr, "lfbench step: cannot open %s: %s\n", model, lf_last_error());
    return 1;
  }
  const lf_model_config *m = &ck.cfg;
  lf_backend_params p = {.policy = policy, .budget = budget, .sink = 4, .window = 32,
                         .n_pools = max_b, .comm = comm, .kv_dtype = kv_dtype};
  int fill = budget - 1, extra = 0; /* prompt tokens per pool; decode steps that fill the rest */
  int bmin = budget;                /* rkv's stage fits the smallest layer, as the engine's */
  if (lw) {
    if (n_lw != m->n_layers) {
      fprintf(stderr, "lfbench step: %s has %d layers, --layer-weights %d weights\n", model,
              m->n_layers, n_lw);
      lf_checkpoint_close(&ck);
      return 1;
    }
    lb = malloc(sizeof(int) * (size_t)m->n_layers);
    if (!lb || lf_layer_budgets_from_weights(lw, m->n_layers, budget, lb) != LF_OK) {
      fprintf(stderr, "lfbench step: layer budgets: %s\n", lb ? lf_last_error() : "no memory");
      free(lb);
      lf_checkpoint_close(&ck);
      return 1;
    }
    const lf_pool_shape layers = {1, m->n_layers, 1, budget, 1, 0, 0, lb};
    bmin = lf_pool_budget_min(&layers);
    p.layer_budget = lb;
    fill = bmin - 1; /* appended in every layer; decode steps then fill the larger ones */
    extra = lf_pool_budget_max(&layers) - bmin + 1;
  }
  p.rkv_stage = policy == LF_POLICY_RKV ? lf_rkv_stage_resolve(rkv_stage, bmin, 4, 0) : 0;
  const int tp = comm ? comm->size : 1;
  double t0 = lf_now_s();
  if (lf_backend_create(LF_BACKEND_CUDA, &ck, &p, &b) != LF_OK) STEP_FAIL("create %s", model);
  if (comm && comm->rank != 0) { /* a follower: rank 0's descriptors until it stops */
    if (lf_backend_tp_follow(b, comm, m->vocab_size) != LF_OK)
      STEP_FAIL("rank %d: following rank 0", comm->rank);
    goto done;
  }
  if (comm) {
    lf_backend *lead = NULL;
    if (lf_backend_tp_lead(b, comm, &lead) != LF_OK) STEP_FAIL("tensor-parallel lead");
    b = lead; /* frees the inner backend, and stops the followers, when freed */
  }
  const double t_create = lf_now_s() - t0;
  pools = calloc((size_t)max_b, sizeof *pools);
  prompt = calloc((size_t)budget, sizeof *prompt);
  last = calloc((size_t)max_b, sizeof *last);
  items = calloc((size_t)max_b, sizeof *items);
  res = calloc((size_t)max_b, sizeof *res);
  t = calloc((size_t)(steps > 0 ? steps : 1), sizeof *t);
  if (!pools || !prompt || !last || !items || !res || !t) {
    fprintf(stderr, "lfbench step: out of host memory\n");
    rc = 1;
    goto done;
  }
  t0 = lf_now_s();
  for (int i = 0; i < max_b; i++) {
    if (b->pool_take(b, &pools[i]) != LF_OK) STEP_FAIL("pool_take");
    for (int k = 0; k < fill; k++) prompt[k] = (int32_t)rnd((uint32_t)m->vocab_size);
    lf_batch_item it;
    memset(&it, 0, sizeof it);
    it.pool = pools[i];
    it.n_tok = fill;
    it.tokens = prompt;
    if (b->forward(b, &it, 1, &res[0], NULL) != LF_OK || res[0].status != LF_OK)
      STEP_FAIL("prefill of pool %d", i);
    last[i] = res[0].token;
  }
  int32_t pos = fill;
  for (int st = 0; st < extra; st++, pos++) { /* per-layer budgets: every layer full */
    stage_decode(items, pools, last, max_b, pos);
    if (b->forward(b, items, max_b, res, NULL) != LF_OK) STEP_FAIL("filling decode step");
    for (int i = 0; i < max_b; i++) last[i] = res[i].token;
  }
  const double t_fill = lf_now_s() - t0;
  const double wb = weight_bytes(m);
  for (int bi = 0; bi < nb; bi++) {
    const int bs = batches[bi];
    double best = 1e30;
    for (int st = 0; st < warmup + steps; st++) {
      stage_decode(items, pools, last, bs, pos);
      /* LF_PROFILE_STEP=1: the last step of each batch size is the profiler's range
       * (`ncu --profile-from-start off` then sees exactly one decode step) */
      const int prof = st == warmup + steps - 1 && getenv("LF_PROFILE_STEP") != NULL;
      if (prof) cudaProfilerStart();
      t0 = lf_now_s();
      if (b->forward(b, items, bs, res, NULL) != LF_OK) STEP_FAIL("decode step");
      const double dt = lf_now_s() - t0;
      if (prof) cudaProfilerStop();
      for (int i = 0; i < bs; i++) {
        if (res[i].status != LF_OK) STEP_FAIL("decode step, item %d", i);
        last[i] = res[i].token;
      }
      if (st >= warmup) {
        t[st - warmup] = dt;
        if (dt < best) best = dt;
      }
      pos++;
    }
    double mean = 0.0; /* rkv's selections run every rkv_stage steps: the mean counts them */
    for (int k = 0; k < steps; k++) mean += t[k] / steps;
    const double med = bench_median(t, steps);
    /* every pool holds `budget` slots once its first decode token is in */
    const double slot_kv = kv_dtype == LF_KV_BF16 ? m->head_dim * 2.0 * 2.0   /* K, V bf16 */
                                                  : (m->head_dim + 4.0) * 2.0; /* codes, scale */
    const double kv = (double)bs * m->n_layers * m->n_kv_heads * budget * slot_kv;
    const double floor_s = (wb + kv) / tp / (copy_gbs * 1e9); /* per GPU */
    printf("%-18s %6d %7d %10.3f %10.3f %10.3f %10.3f %8.2f %8.2f %9.3f %8.1f%%\n", model, bs,
           budget, med * 1e3, mean * 1e3, best * 1e3, floor_s * 1e3, wb / 1e9, kv / 1e9,
           med / floor_s, 100.0 * floor_s / med);
    if (json) {
      fprintf(json,
              "%s\n    {\"model\": \"%s\", \"batch\": %d, \"budget\": %d, \"steps\": %d, "
              "\"step_ms_median\": %.4f, \"step_ms_mean\": %.4f, \"step_ms_min\": %.4f, "
              "\"floor_ms\": %.4f, \"policy\": \"%s\", \"rkv_stage\": %d, "
              "\"weight_bytes\": %.0f, \"kv_bytes\": %.0f, \"ratio\": %.4f, "
              "\"roofline_fraction\": %.4f, \"create_s\": %.2f, \"fill_s\": %.2f, \"tp\": %d, "
              "\"kv_dtype\": \"%s\"}",
              *first_row ? "" : ",", model, bs, budget, steps, med * 1e3, mean * 1e3, best * 1e3,
              floor_s * 1e3, lf_policy_str(policy), p.rkv_stage, wb, kv, med / floor_s, floor_s / med, t_create, t_fill, tp,
              lf_kv_dtype_str(kv_dtype));
      *first_row = 0;
    }
  }
  fflush(stdout);
done:
  if (b) b->free(b);
  lf_checkpoint_close(&ck);
  free(pools);
  free(prompt);
  free(last);
  free(items);
  free(res);
  free(t);
  free(lb);
  return rc;
}

int bench_step(int argc, char **argv) {
  char models_buf[512] = "random:llama3-8b,random:qwen3-8b";
  const char *json_path = NULL;
  int batches[STEP_MAX_LIST] = {1, 64}, nb = 2, budget = 1024, steps = 50, warmup = 5, tp = 0;
  lf_kv_dtype kv_dtype = LF_KV_BF16;
  lf_policy policy = LF_POLICY_LONGFLOW;
  int rkv_stage = 0, n_lw = 0;
  double *lw = NULL; /* --layer-weights */
  for (int i = 1; i < argc; i++) {
    const char *o = argv[i];
    if (!strcmp(o, "--tp")) {
      tp = 1;
      continue;
    }
    if (!strcmp(o, "-h") || !strcmp(o, "--help")) {
      printf("usage: lfbench step [--models LIST] [--batches LIST] [--budget N] [--steps N] "
             "[--warmup N] [--kv-dtype T] [--policy P] [--rkv-stage S] [--json FILE] [--tp]\n"
             "  one decode step of the cuda backend (pools filled to the budget) against the\n"
             "  weights + KV bytes / copy-bandwidth floor; defaults: random:llama3-8b,\n"
             "  random:qwen3-8b; batches 1,64; budget 1024; 50 timed steps after 5\n"
             "  --kv-dtype bf16|fp8|int8|int4|k8v4: the pools' K/V storage (default bf16)\n"
             "  --policy P: the eviction policy (default longflow; h2o keeps budget / 2 recent)\n"
             "  --rkv-stage S: rkv's stage (default 0: LF_RKV_STAGE_DEFAULT)\n"
             "  --layer-weights F: per-layer budgets (lfgen's option; one weight per layer of\n"
             "    each model): pools filled with the smallest layer's room, then decode steps\n"
             "    until every layer is full\n"
             "  --tp: tensor parallel over the ranks of mpirun -np T (NCCL, one GPU each)\n");
      return 0;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "lfbench step: %s needs a value\n", o);
      return 2;
    }
    const char *v = argv[++i];
    if (!strcmp(o, "--models")) {
      snprintf(models_buf, sizeof models_buf, "%s", v);
    } else if (!strcmp(o, "--batches")) {
      if ((nb = bench_int_list(v, batches, STEP_MAX_LIST)) < 1) return 2;
    } else if (!strcmp(o, "--budget")) {
      budget = atoi(v);
    } else if (!strcmp(o, "--steps")) {
      steps = atoi(v);
    } else if (!strcmp(o, "--warmup")) {
      warmup = atoi(v);
    } else if (!strcmp(o, "--json")) {
      json_path = v;
    } else if (!strcmp(o, "--policy")) {
      if (lf_policy_parse(v, &policy) != LF_OK) {
        fprintf(stderr, "lfbench step: %s\n", lf_last_error());
        return 2;
      }
    } else if (!strcmp(o, "--rkv-stage")) {
      rkv_stage = atoi(v);
    } else if (!strcmp(o, "--layer-weights")) {
      char why[256];
      free(lw);
      if (lf_cli_read_weights(v, &lw, &n_lw, why, sizeof why)) {
        fprintf(stderr, "lfbench step: --layer-weights: %s\n", why);
        return 2;
      }
    } else if (!strcmp(o, "--kv-dtype")) {
      if (lf_kv_dtype_parse(v, &kv_dtype) != LF_OK) {
        fprintf(stderr, "lfbench step: %s\n", lf_last_error());
        return 2;
      }
    } else {
      fprintf(stderr, "lfbench step: unknown option %s\n", o);
      return 2;
    }
  }
  if (budget < 2 || steps < 1 || warmup < 0) {
    fprintf(stderr, "lfbench step: budget >= 2, steps >= 1, warmup >= 0\n");
    return 2;
  }
  const int rkv_req = rkv_stage; /* run_model resolves it per model (per-layer: the smallest) */
  rkv_stage = lf_rkv_stage_resolve(rkv_stage, budget, 4, 0); /* the engine's rule; sink 4 below */
  lf_comm_t comm = NULL;
  const int env = getenv("LF_TP_RANK") != NULL; /* tests/tp_run.sh instead of mpirun */
  if (tp) {
    lf_status cs = LF_ERR_UNAVAILABLE;
    if (env) {
      cs = lf_comm_init_nccl_env(0.0, NULL, &comm);
    } else {
#if defined(LF_HAVE_MPI) && defined(LF_HAVE_NCCL)
      int inited = 0;
      MPI_Initialized(&inited);
      if (!inited && MPI_Init(&argc, &argv) != MPI_SUCCESS) return 1;
      cs = lf_comm_init_nccl_mpi(0.0, NULL, &comm);
#else
      fprintf(stderr, "lfbench step: --tp: launch with mpirun (needs MPI and NCCL) or "
                      "tests/tp_run.sh (NCCL)\n");
      return 1;
#endif
    }
    if (cs != LF_OK) {
      fprintf(stderr, "lfbench step: --tp: %s\n", lf_last_error());
      return 1;
    }
  }
  const int lead = !comm || comm->rank == 0;
  bench_gpu gpu;
  if (bench_gpu_open("lfbench step", lead, &gpu)) return 1;
  const double copy_gbs = gpu.copy_gbs;
  const char *graphs = getenv("LF_CUDA_GRAPHS"), *graphs_tp = getenv("LF_CUDA_GRAPHS_TP");
  /* under TP LF_CUDA_GRAPHS_TP=0 turns them off as well */
  const int graphs_on = !(graphs && !strcmp(graphs, "0")) &&
                        (!comm || !(graphs_tp && !strcmp(graphs_tp, "0")));
  if (lead)
  printf("# device %s, copy bandwidth %.1f GB/s (2 GiB D2D, read + write); cuda graphs %s; "
         "timed: host clock around forward(), median of %d after %d; tp %d\n",
         gpu.name, copy_gbs, graphs_on ? "on" : "off", steps, warmup, comm ? comm->size : 1);
  if (lead)
  printf("# policy %s (rkv stage %d); ratio and roofline from the median\n# %-16s %6s %7s %10s %10s %10s "
         "%10s %8s %8s %9s %9s\n", lf_policy_str(policy), policy == LF_POLICY_RKV ? rkv_stage : 0,
         "model", "batch", "budget", "step_ms", "mean_ms", "min_ms", "floor_ms", "w_GB", "kv_GB",
         "ratio", "roofline");
  FILE *json = NULL;
  if (lead && json_path && !(json = fopen(json_path, "w"))) {
    fprintf(stderr, "lfbench step: cannot write %s\n", json_path);
    return 1;
  }
  if (json)
    fprintf(json,
            "{\n  \"bench\": \"step\", \"device\": \"%s\", \"copy_gbs\": %.1f, \"cuda_graphs\": "
            "%s, \"gemv_max\": \"1\", \"timer\": \"host clock around forward(), median\",\n"
            "  \"rows\": [",
            gpu.name, copy_gbs, graphs_on ? "true" : "false");
  int rc = 0, first = 1;
  for (char *save = NULL, *mdl = strtok_r(models_buf, ",", &save); mdl;
       mdl = strtok_r(NULL, ",", &save))
    rc |= run_model(mdl, batches, nb, budget, steps, warmup, copy_gbs, json, &first, comm,
                    kv_dtype, policy, rkv_req, lw, n_lw);
  free(lw);
  if (json) {
    fprintf(json, "\n  ]\n}\n");
    fclose(json);
  }
  if (comm && rc == 0) { /* on failure: exit without finalizing, the launcher ends the job */
    lf_comm_free(comm);
#ifdef LF_HAVE_MPI
    if (!env) MPI_Finalize();
#endif
  }
  return rc;
}

#else
int bench_step(int argc, char **argv) {
  (void)argc;
  (void)argv;
  fprintf(stderr, "lfbench step: this build has no CUDA engine backend\n");
  return 1;
}
#endif

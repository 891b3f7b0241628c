/* lfbench — lfserve benchmarks: `lfbench <subcommand> [options]`.
 *
 *   kernel   the fused LongFlow decode-attention kernel (attention/decode_attn.cuh) over a grid of
 *            batch sizes and budgets, against the device-to-device copy bandwidth measured in the
 *            same run and, with --peer, against torch SDPA (bench/sdpa_peer.py).
 *
 * The other subcommands (step, serve, prefill, attn, comm, eval) live in bench/bench_<name>.c.
 *
 * Output is one fixed-column row per shape (nccl-tests style), ending with whether the result
 * was checked right; --json writes the same rows for bench/results/.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_gpu.h"
#include "bench_util.h"
#include "lfserve.h"

#ifdef LF_HAVE_CUDA
#include <cuda_runtime.h>

#include "attention/decode_attn.cuh"
#include "base/kvq.h"
#endif

static void usage(FILE *f) {
  fprintf(f, "usage: lfbench <subcommand> [options]\n"
             "subcommands:\n"
             "  kernel   fused decode-attention kernel vs copy bandwidth (and torch SDPA)\n"
             "  step     one decode step of the random 8B models vs the weights + KV floor\n"
             "  serve    long-output workload through the engine (lfbench serve --help)\n"
             "  prefill  time to first token of B prompts of P tokens, TFLOP/s, and the\n"
             "           transformers peer (bench/prefill_peer.py) (lfbench prefill --help)\n"
             "  attn     the prefill attention kernel alone: TFLOP/s per tiling, torch SDPA\n"
             "           (bench/sdpa_prefill_peer.py) (lfbench attn --help)\n"
             "  comm     all-reduce latency / bus bandwidth under mpirun (lfbench comm --help)\n"
             "  eval     trace-task accuracy against KV budget per policy (lfbench eval --help)\n"
             "  natural  KL and top-1 against full KV on the model's own long answers\n"
             "           (lfbench natural --help)\n"
             "kernel options:\n"
             "  --batches LIST    comma list (default 1,8,32,128)\n"
             "  --budgets LIST    comma list (default 1024,2048,3200)\n"
             "  --heads N --kv-heads N --head-dim N   (default 32 8 128)\n"
             "  --iters N --warmup N                  timed and warm-up calls (default 300 30)\n"
             "  --splits N        force the split count (default 0: automatic)\n"
             "  --kv-dtype T      bf16|fp8|int8|int4|k8v4: the pools' K/V storage (default bf16)\n"
             "  --no-flush        do not clear L2 before each timed call\n"
             "  --peer FILE       sdpa_peer.py JSON: fills sdpa_ratio\n"
             "  --json FILE       write the rows as JSON\n");
}

#ifdef LF_HAVE_CUDA
#define BENCH_CUDA(stmt)                                                                           \
  do {                                                                                             \
    cudaError_t e_ = (stmt);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      fprintf(stderr, "lfbench: %s:%d: %s: %s\n", __FILE__, __LINE__, #stmt,                       \
              cudaGetErrorString(e_));                                                             \
      return 1;                                                                                    \
    }                                                                                              \
  } while (0)

#define BENCH_LF(stmt)                                                                             \
  do {                                                                                             \
    lf_status s_ = (stmt);                                                                         \
    if (s_ != LF_OK) {                                                                             \
      fprintf(stderr, "lfbench: %s:%d: %s: %s: %s\n", __FILE__, __LINE__, #stmt,                   \
              lf_status_str(s_), lf_last_error());                                                 \
      return 1;                                                                                    \
    }                                                                                              \
  } while (0)

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng_next(void) { return bench_rng_next(&rng_state); }
static float rng_normal(void) { return bench_rng_normal(&rng_state); }
static float bf2f(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

typedef struct kernel_row {
  int batch, budget, splits;
  double kv_bytes, time_us, gbs, bw_fraction, sdpa_ratio, max_rel_err;
  int check_ok, next_gpu, next_cpu;
} kernel_row;

/* CPU check of sequence 0 (KV heads of pool 0): output and next against a double computation.
 * hk, hv: [n_kv][B][D] the pool's values (bf16, or what fp8 codes read back); hq: [n_heads][D];
 * hout: [n_heads][D] from the GPU; w: slot excluded; next_gpu: [n_kv]. Returns 1 when right. */
static int check_seq0(int n_kv, int group, int B, int D, int sink, const float *hk,
                      const float *hv, const uint16_t *hq, const uint16_t *hout, int w,
                      const int32_t *next_gpu, double *max_rel, int *ng, int *nc) {
  double *alpha = malloc(sizeof(double) * (size_t)B), *mass = malloc(sizeof(double) * (size_t)B);
  int ok = 1;
  *max_rel = 0.0;
  for (int g = 0; g < n_kv; g++) {
    const float *K = hk + (size_t)g * B * D, *V = hv + (size_t)g * B * D;
    for (int i = 0; i < B; i++)
      mass[i] = 0.0;
    for (int j = 0; j < group; j++) {
      const int h = g * group + j;
      double m = -INFINITY, sum = 0.0, num = 0.0, den = 0.0;
      for (int i = 0; i < B; i++) {
        double s = 0.0;
        for (int d = 0; d < D; d++)
          s += (double)bf2f(hq[(size_t)h * D + d]) * K[(size_t)i * D + d];
        alpha[i] = s / sqrt((double)D);
        if (alpha[i] > m) m = alpha[i];
      }
      for (int i = 0; i < B; i++)
        sum += (alpha[i] = exp(alpha[i] - m));
      for (int i = 0; i < B; i++)
        mass[i] += (alpha[i] /= sum);
      for (int d = 0; d < D; d++) {
        double o = 0.0;
        for (int i = 0; i < B; i++)
          o += alpha[i] * V[(size_t)i * D + d];
        const double e = bf2f(hout[(size_t)h * D + d]) - o;
        if (!isfinite(e)) ok = 0;
        num += e * e;
        den += o * o;
      }
      const double rel = sqrt(num / (den > 0 ? den : 1e-30));
      if (rel > *max_rel) *max_rel = rel;
    }
    int best = -1;
    double bs = 0.0;
    for (int i = sink; i < B; i++) {
      if (i == w) continue;
      double l1 = 0.0;
      for (int d = 0; d < D; d++)
        l1 += fabs((double)V[(size_t)i * D + d]);
      const double s = (double)(float)l1 * mass[i];
      if (best < 0 || s < bs) best = i, bs = s;
    }
    if (g == 0) *ng = next_gpu[0], *nc = best;
    if (next_gpu[g] != best) {
      /* a near-tie is no error: recompute the GPU choice's score */
      const int j = next_gpu[g];
      if (j < sink || j >= B || j == w) {
        ok = 0;
      } else {
        double l1 = 0.0;
        for (int d = 0; d < D; d++)
          l1 += fabs((double)V[(size_t)j * D + d]);
        if ((double)(float)l1 * mass[j] - bs > 1e-4 * bs) ok = 0;
      }
    }
  }
  if (*max_rel > 1e-2) ok = 0;
  free(alpha);
  free(mass);
  return ok;
}

/* The seed's rows of D as one side (K or V) of a quantized pool stores them: row format fmt
 * (base/kvq.h; a pool dtype's K and V formats differ under k8v4), rb code bytes and mw meta
 * words a row. */
typedef struct kernel_side {
  int fmt;
  size_t rb, mw;
  uint8_t *codes;
  uint32_t *meta;
} kernel_side;

/* kernel_one's timing: the median of iters calls after warmup, each on the next set of pools
 * (dpool: n_sets sets of batch ids), L2 cleared before each when flush is given. 0, or 1. */
static int kernel_time(lf_decode_attn_args *a, const int32_t *dpool, int n_sets, int batch,
                       int iters, int warmup, void *flush, size_t flush_bytes, float *ms_out) {
  cudaEvent_t *ev = malloc(sizeof(cudaEvent_t) * 2 * (size_t)iters);
  double *t = malloc(sizeof(double) * (size_t)iters);
  for (int i = 0; i < 2 * iters; i++)
    BENCH_CUDA(cudaEventCreate(&ev[i]));
  for (int i = 0; i < warmup; i++) {
    a->pool_ids = dpool + (size_t)(i % n_sets) * batch;
    BENCH_LF(lf_cuda_decode_attn(a, 0));
  }
  for (int i = 0; i < iters; i++) {
    a->pool_ids = dpool + (size_t)(i % n_sets) * batch;
    /* as triton's do_bench: clear L2 before each call; it also keeps the GPU busy, so host
     * time between the events never counts */
    if (flush) BENCH_CUDA(cudaMemsetAsync(flush, 0, flush_bytes, 0));
    BENCH_CUDA(cudaEventRecord(ev[2 * i], 0));
    BENCH_LF(lf_cuda_decode_attn(a, 0));
    BENCH_CUDA(cudaEventRecord(ev[2 * i + 1], 0));
  }
  BENCH_CUDA(cudaDeviceSynchronize());
  for (int i = 0; i < iters; i++) {
    float ms = 0.0f;
    BENCH_CUDA(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    t[i] = ms;
  }
  *ms_out = (float)bench_median(t, iters);
  for (int i = 0; i < 2 * iters; i++)
    cudaEventDestroy(ev[i]);
  free(ev);
  free(t);

  return 0;
}

/* kernel_one's arena: arena_rows rows of K (rbk bytes, mwk meta words each) and of V (rbv, mwv)
 * cut from the seed at shifting offsets (not zeros, not all equal; under a quantized dtype whole
 * rows of codes and meta from side[0] and side[1]). 0, or 1 on a CUDA error. */
static int kernel_fill_pools(int q8, const kernel_side side[2], const uint16_t *seed,
                             size_t seed_elems, int D, size_t arena_rows, size_t rbk, size_t mwk,
                             size_t rbv, size_t mwv, void **dk, void **dv, float **dks,
                             float **dvs) {
  const size_t arena_elems = arena_rows * (size_t)D, seed_rows = seed_elems / (size_t)D;
  BENCH_CUDA(cudaMalloc(dk, arena_rows * rbk));
  BENCH_CUDA(cudaMalloc(dv, arena_rows * rbv));
  if (q8) {
    BENCH_CUDA(cudaMalloc((void **)dks, arena_rows * mwk * 4));
    BENCH_CUDA(cudaMalloc((void **)dvs, arena_rows * mwv * 4));
    for (int sd = 0; sd < 2; sd++) { /* K rows, then V rows, from different seed offsets */
      const kernel_side *x = &side[sd];
      void *d8 = NULL, *dsc = NULL;
      BENCH_CUDA(cudaMalloc(&d8, seed_rows * x->rb));
      BENCH_CUDA(cudaMalloc(&dsc, seed_rows * x->mw * 4));
      BENCH_CUDA(cudaMemcpy(d8, x->codes, seed_rows * x->rb, cudaMemcpyHostToDevice));
      BENCH_CUDA(cudaMemcpy(dsc, x->meta, seed_rows * x->mw * 4, cudaMemcpyHostToDevice));
      uint8_t *codes = (uint8_t *)(sd ? *dv : *dk);
      uint32_t *meta = (uint32_t *)(sd ? *dvs : *dks);
      size_t i = 0;
      for (size_t off = 0; off < arena_rows; i++) { /* in whole rows */
        size_t n = seed_rows / 2;
        if (n > arena_rows - off) n = arena_rows - off;
        const size_t so = sd ? (i * 104729u + 12345u) % (seed_rows / 2) : (i * 7919u) % (seed_rows / 2);
        BENCH_CUDA(cudaMemcpy(codes + off * x->rb, (uint8_t *)d8 + so * x->rb, n * x->rb,
                              cudaMemcpyDeviceToDevice));
        BENCH_CUDA(cudaMemcpy(meta + off * x->mw, (uint32_t *)dsc + so * x->mw, n * x->mw * 4,
                              cudaMemcpyDeviceToDevice));
        off += n;
      }
      cudaFree(d8);
      cudaFree(dsc);
    }
  } else {
    /* device copies of the seed, shifted, make K and V (not zeros, not all equal) */
    void *dseed = NULL;
    BENCH_CUDA(cudaMalloc(&dseed, seed_elems * 2));
    BENCH_CUDA(cudaMemcpy(dseed, seed, seed_elems * 2, cudaMemcpyHostToDevice));
    size_t i = 0;
    for (size_t off = 0; off < arena_elems; i++) {
      size_t n = seed_elems / 2;
      if (n > arena_elems - off) n = arena_elems - off;
      const size_t sk = ((i * 7919u) % (seed_elems / 2)) & ~(size_t)7;
      const size_t sv = ((i * 104729u + 12345u) % (seed_elems / 2)) & ~(size_t)7;
      BENCH_CUDA(cudaMemcpy((uint16_t *)*dk + off, (uint16_t *)dseed + sk, n * 2,
                            cudaMemcpyDeviceToDevice));
      BENCH_CUDA(cudaMemcpy((uint16_t *)*dv + off, (uint16_t *)dseed + sv, n * 2,
                            cudaMemcpyDeviceToDevice));
      off += n;
    }
    cudaFree(dseed);
  }
  return 0;
}

/* Pool 0's K and V (n_kv heads of head_elems values) as the kernel reads them, dequantized under
 * a quantized dtype, into hk and hv for the check. 0, or 1. */
static int kernel_pool0(int q8, const kernel_side side[2], int n_kv, size_t head_elems, int D,
                        const void *dk, const void *dv, const float *dks, const float *dvs,
                        size_t rbk, size_t mwk, size_t rbv, size_t mwv, float *hk, float *hv) {
  /* pool 0's values as the kernel reads them */
  const size_t ne = (size_t)n_kv * head_elems, nr = ne / (size_t)D;
  uint8_t *bk = malloc(nr * rbk), *bv = malloc(nr * rbv);
  uint32_t *sk = malloc(nr * (mwk + 1) * 4), *sv = malloc(nr * (mwv + 1) * 4);
  if (!bk || !bv || !sk || !sv) return 1;
  BENCH_CUDA(cudaMemcpy(bk, dk, nr * rbk, cudaMemcpyDeviceToHost));
  BENCH_CUDA(cudaMemcpy(bv, dv, nr * rbv, cudaMemcpyDeviceToHost));
  if (q8) {
    BENCH_CUDA(cudaMemcpy(sk, dks, nr * mwk * 4, cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(sv, dvs, nr * mwv * 4, cudaMemcpyDeviceToHost));
  }
  for (size_t i = 0; i < ne; i++) {
    const size_t r = i / (size_t)D;
    const int d = (int)(i % (size_t)D);
    hk[i] = q8 ? lf_kvq_row_value(side[0].fmt, bk + r * rbk, sk + r * mwk, d)
               : bf2f(((uint16_t *)bk)[i]);
    hv[i] = q8 ? lf_kvq_row_value(side[1].fmt, bv + r * rbv, sv + r * mwv, d)
               : bf2f(((uint16_t *)bv)[i]);
  }
  free(bk);
  free(bv);
  free(sk);
  free(sv);
  return 0;
}

/* One (batch, budget) row. Quantized dtypes (q8, kv_dtype not bf16): side[0] and side[1] hold
 * the seed's seed_elems / D rows as the K and the V rows are stored; the arena copies whole
 * rows of codes and meta. */
static int kernel_one(int batch, int budget, int n_heads, int n_kv, int D, int iters, int warmup,
                      int splits_req, const uint16_t *seed, const kernel_side side[2],
                      lf_kv_dtype kv_dtype, size_t seed_elems, size_t l2_bytes, void *flush,
                      size_t flush_bytes, kernel_row *row) {
  const int group = n_heads / n_kv, sink = 4, B = budget, q8 = kv_dtype != LF_KV_BF16;
  const size_t head_elems = (size_t)B * D; /* one (pool, kv head) of K */
  /* bytes of codes and meta words per K and per V row (bf16: 2 D bytes, no meta) */
  const size_t rbk = q8 ? side[0].rb : 2 * (size_t)D, mwk = q8 ? side[0].mw : 0;
  const size_t rbv = q8 ? side[1].rb : 2 * (size_t)D, mwv = q8 ? side[1].mw : 0;
  /* K + V of one pool, codes and scales */
  const size_t pool_kv_bytes = (size_t)n_kv * (size_t)B * (rbk + 4 * mwk + rbv + 4 * mwv);
  const double kv_bytes = (double)batch * (double)pool_kv_bytes;
  /* rotate among sets of pools so the working set is >= 4x L2 */
  int n_sets = (int)ceil(4.0 * (double)l2_bytes / kv_bytes);
  if (n_sets < 1) n_sets = 1;
  const int n_pools = batch * n_sets;
  const size_t arena_elems = (size_t)n_pools * n_kv * head_elems;
  void *dk = NULL, *dv = NULL, *dq = NULL, *dout = NULL, *dws = NULL;
  float *dvnorm = NULL, *dks = NULL, *dvs = NULL;
  int32_t *dn = NULL, *dnext = NULL, *dpool = NULL, *dw = NULL, *dpos = NULL;
  const size_t arena_rows = arena_elems / (size_t)D;
  if (kernel_fill_pools(q8, side, seed, seed_elems, D, arena_rows, rbk, mwk, rbv, mwv, &dk, &dv,
                        &dks, &dvs))
    return 1;
  const size_t n_slots = (size_t)n_pools * n_kv * B;
  BENCH_CUDA(cudaMalloc((void **)&dvnorm, n_slots * 4));
  BENCH_CUDA(cudaMalloc((void **)&dpos, n_slots * 4));
  BENCH_CUDA(cudaMalloc((void **)&dn, (size_t)n_pools * n_kv * 4));
  BENCH_CUDA(cudaMalloc((void **)&dnext, (size_t)n_pools * n_kv * 4));
  BENCH_CUDA(cudaMalloc((void **)&dpool, (size_t)n_pools * 4));
  BENCH_CUDA(cudaMalloc((void **)&dw, (size_t)batch * n_kv * 4));
  BENCH_CUDA(cudaMalloc(&dq, (size_t)batch * n_heads * D * 2));
  BENCH_CUDA(cudaMalloc(&dout, (size_t)batch * n_heads * D * 2));

  /* host: pool 0's K/V (the checked sequence), q, metadata */
  float *hk = malloc((size_t)n_kv * head_elems * 4), *hv = malloc((size_t)n_kv * head_elems * 4);
  uint16_t *hq = malloc((size_t)batch * n_heads * D * 2), *hout = malloc((size_t)n_heads * D * 2);
  float *hvn = malloc(n_slots * 4);
  int32_t *hi = malloc((n_slots > (size_t)n_pools * n_kv ? n_slots : (size_t)n_pools * n_kv) * 4);
  if (!hk || !hv || !hq || !hout || !hvn || !hi) {
    fprintf(stderr, "lfbench: out of host memory\n");
    return 1;
  }
  if (kernel_pool0(q8, side, n_kv, head_elems, D, dk, dv, dks, dvs, rbk, mwk, rbv, mwv, hk, hv))
    return 1;
  /* vnorm: exact for pool 0; elsewhere a deterministic positive value (only argmin reads it) */
  for (size_t i = 0; i < n_slots; i++)
    hvn[i] = 50.0f + (float)(rng_next() >> 44) * 1e-4f;
  for (int g = 0; g < n_kv; g++)
    for (int i = 0; i < B; i++) {
      double l1 = 0.0;
      for (int d = 0; d < D; d++)
        l1 += fabs((double)hv[((size_t)g * B + i) * D + d]);
      hvn[(size_t)g * B + i] = (float)l1;
    }
  BENCH_CUDA(cudaMemcpy(dvnorm, hvn, n_slots * 4, cudaMemcpyHostToDevice));
  for (size_t i = 0; i < n_slots; i++)
    hi[i] = (int32_t)(i % (size_t)B);
  BENCH_CUDA(cudaMemcpy(dpos, hi, n_slots * 4, cudaMemcpyHostToDevice));
  for (int i = 0; i < n_pools * n_kv; i++)
    hi[i] = B; /* all pools full */
  BENCH_CUDA(cudaMemcpy(dn, hi, (size_t)n_pools * n_kv * 4, cudaMemcpyHostToDevice));
  for (int i = 0; i < n_pools * n_kv; i++)
    hi[i] = sink;
  BENCH_CUDA(cudaMemcpy(dnext, hi, (size_t)n_pools * n_kv * 4, cudaMemcpyHostToDevice));
  for (int i = 0; i < n_pools; i++)
    hi[i] = i; /* set r uses pools [r*batch, (r+1)*batch) */
  BENCH_CUDA(cudaMemcpy(dpool, hi, (size_t)n_pools * 4, cudaMemcpyHostToDevice));
  const int w = B - 1; /* the slot "written" this step */
  for (int i = 0; i < batch * n_kv; i++)
    hi[i] = w;
  BENCH_CUDA(cudaMemcpy(dw, hi, (size_t)batch * n_kv * 4, cudaMemcpyHostToDevice));
  for (size_t i = 0; i < (size_t)batch * n_heads * D; i++)
    hq[i] = bench_f2bf(1.5f * rng_normal());
  BENCH_CUDA(cudaMemcpy(dq, hq, (size_t)batch * n_heads * D * 2, cudaMemcpyHostToDevice));

  int S = splits_req;
  if (S <= 0) {
    int dev = 0, n_sm = 0;
    BENCH_CUDA(cudaGetDevice(&dev));
    BENCH_CUDA(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev));
    S = lf_cuda_decode_attn_splits(batch, n_kv, B, group, D, n_sm);
  }
  const size_t ws_bytes = lf_cuda_decode_attn_workspace_bytes(batch, n_kv, B, group, D, S);
  BENCH_CUDA(cudaMalloc(&dws, ws_bytes ? ws_bytes : 1));
  BENCH_LF(lf_cuda_decode_attn_workspace_init(dws, ws_bytes, 0));

  const lf_cuda_pool_view pool = {.k = dk, .v = dv, .vnorm = dvnorm, .pos = dpos, .n = dn,
                                  .next = dnext, .n_layers = 1, .n_kv_heads = n_kv, .budget = B,
                                  .head_dim = D, .kv_dtype = kv_dtype,
                                  .k_scale = dks, .v_scale = dvs};
  lf_decode_attn_args a = {.pool = pool, .layer = 0, .n_seq = batch, .w = dw, .q = dq,
                           .out = dout, .group = group, .sink = sink,
                           .policy = LF_POLICY_LONGFLOW, .scale = 1.0f / sqrtf((float)D),
                           .n_splits = S, .workspace = dws, .workspace_bytes = ws_bytes};

  float ms = 0.0f;
  if (kernel_time(&a, dpool, n_sets, batch, iters, warmup, flush, flush_bytes, &ms)) return 1;

  /* the checked call: set 0, sequence 0 = pool 0 */
  a.pool_ids = dpool;
  BENCH_LF(lf_cuda_decode_attn(&a, 0));
  BENCH_CUDA(cudaDeviceSynchronize());
  BENCH_CUDA(cudaMemcpy(hout, dout, (size_t)n_heads * D * 2, cudaMemcpyDeviceToHost));
  BENCH_CUDA(cudaMemcpy(hi, dnext, (size_t)n_kv * 4, cudaMemcpyDeviceToHost));
  row->batch = batch;
  row->budget = budget;
  row->splits = S;
  row->kv_bytes = kv_bytes;
  row->time_us = ms * 1e3;
  row->gbs = kv_bytes / (ms * 1e-3) / 1e9;
  row->check_ok = check_seq0(n_kv, group, B, D, sink, hk, hv, hq, hout, w, hi, &row->max_rel_err,
                             &row->next_gpu, &row->next_cpu);

  free(hk);
  free(hv);
  free(hq);
  free(hout);
  free(hvn);
  free(hi);
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(dq);
  cudaFree(dout);
  cudaFree(dws);
  cudaFree(dvnorm);
  cudaFree(dn);
  cudaFree(dnext);
  cudaFree(dpool);
  cudaFree(dw);
  cudaFree(dpos);
  cudaFree(dks);
  cudaFree(dvs);
  return 0;
}

/* lfbench kernel's options. */
typedef struct kernel_opts {
  int batches[16], n_batches, budgets[16], n_budgets;
  int n_heads, n_kv, D, iters, warmup, splits, no_flush;
  const char *peer, *json;
  lf_kv_dtype kv_dtype;
} kernel_opts;

/* The options into *o: 0, or the exit status (2 after the usage). */
static int kernel_parse(int argc, char **argv, kernel_opts *o) {
  *o = (kernel_opts){.batches = {1, 8, 32, 128}, .n_batches = 4, .budgets = {1024, 2048, 3200},
                     .n_budgets = 3, .n_heads = 32, .n_kv = 8, .D = 128, .iters = 300,
                     .warmup = 30, .kv_dtype = LF_KV_BF16};
  for (int i = 1; i < argc; i++) {
    const char *opt = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(opt, "--no-flush")) {
      o->no_flush = 1;
      continue;
    }
    if (!v) {
      usage(stderr);
      return 2;
    }
    if (!strcmp(opt, "--batches"))
      o->n_batches = bench_int_list(v, o->batches, 16);
    else if (!strcmp(opt, "--budgets"))
      o->n_budgets = bench_int_list(v, o->budgets, 16);
    else if (!strcmp(opt, "--heads"))
      o->n_heads = atoi(v);
    else if (!strcmp(opt, "--kv-heads"))
      o->n_kv = atoi(v);
    else if (!strcmp(opt, "--head-dim"))
      o->D = atoi(v);
    else if (!strcmp(opt, "--iters"))
      o->iters = atoi(v);
    else if (!strcmp(opt, "--warmup"))
      o->warmup = atoi(v);
    else if (!strcmp(opt, "--splits"))
      o->splits = atoi(v);
    else if (!strcmp(opt, "--peer"))
      o->peer = v;
    else if (!strcmp(opt, "--json"))
      o->json = v;
    else if (!strcmp(opt, "--kv-dtype")) {
      if (lf_kv_dtype_parse(v, &o->kv_dtype) != LF_OK) {
        fprintf(stderr, "lfbench kernel: %s\n", lf_last_error());
        return 2;
      }
    } else {
      usage(stderr);
      return 2;
    }
    i++;
  }
  if (o->n_batches < 1 || o->n_budgets < 1 || o->n_kv < 1 || o->n_heads % o->n_kv ||
      o->iters < 1 || o->warmup < 0) {
    usage(stderr);
    return 2;
  }
  return 0;
}

/* The random bf16 seed the pools are cut from (32 Mi values), and under a quantized dtype its
 * rows of D as the pool's K (side[0]) and V rows (side[1]) store them: 0, or the exit status. */
static int kernel_seed(lf_kv_dtype kv_dtype, int D, size_t seed_elems, uint16_t **seed_out,
                       kernel_side side[2]) {
  uint16_t *seed = malloc(seed_elems * 2);
  if (!seed) return 1;
  for (size_t i = 0; i < seed_elems; i++)
    seed[i] = bench_f2bf(rng_normal());
  *seed_out = seed;
  memset(side, 0, 2 * sizeof *side);
  if (kv_dtype == LF_KV_BF16) return 0;
  if (!lf_kvq_fits((int)kv_dtype, D)) {
    fprintf(stderr, "lfbench kernel: %s pools cannot hold head_dim %d\n", lf_kv_dtype_str(kv_dtype),
            D);
    return 2;
  }
  float *row = malloc((size_t)D * 4);
  if (!row) return 1;
  const size_t rows = seed_elems / (size_t)D;
  for (int sd = 0; sd < 2; sd++) {
    kernel_side *x = &side[sd];
    x->fmt = sd ? lf_kvq_v_row((int)kv_dtype) : lf_kvq_k_row((int)kv_dtype);
    x->rb = (size_t)lf_kvq_code_bytes(x->fmt, D);
    x->mw = (size_t)lf_kvq_meta_words(x->fmt, D);
    x->codes = malloc(rows * x->rb);
    x->meta = malloc(rows * x->mw * 4);
    if (!x->codes || !x->meta) return 1;
    for (size_t r = 0; r < rows; r++) {
      for (int d = 0; d < D; d++) row[d] = bf2f(seed[r * (size_t)D + (size_t)d]);
      lf_kvq_encode_row(x->fmt, row, D, x->codes + r * x->rb, x->meta + r * x->mw);
    }
  }
  free(row);
  return 0;
}

/* The rows as JSON into json. 0, or 1 when it cannot be written. */
static int kernel_json(const char *json, const bench_gpu *g, const kernel_opts *o,
                       const kernel_row *rows, int n_rows) {
  FILE *f = fopen(json, "w");
  if (!f) {
    fprintf(stderr, "lfbench: cannot write %s\n", json);
    return 1;
  }
  fprintf(f,
          "{\"bench\": \"kernel\", \"device\": \"%s\", \"n_sm\": %d, \"copy_bw_GBs\": %.1f, "
          "\"heads\": %d, \"kv_heads\": %d, \"head_dim\": %d, \"kv_dtype\": \"%s\", "
          "\"iters\": %d,\n \"rows\": [\n",
          g->name, g->n_sm, g->copy_gbs, o->n_heads, o->n_kv, o->D,
          lf_kv_dtype_str(o->kv_dtype), o->iters);
  for (int i = 0; i < n_rows; i++) {
    const kernel_row *r = &rows[i];
    char ratio_s[32] = "null";
    if (r->sdpa_ratio > 0) snprintf(ratio_s, sizeof ratio_s, "%.4f", r->sdpa_ratio);
    fprintf(f,
            "  {\"batch\": %d, \"budget\": %d, \"kv_bytes\": %.0f, \"time_us\": %.3f, "
            "\"GBs\": %.1f, \"bw_fraction\": %.4f, \"sdpa_ratio\": %s, \"splits\": %d, "
            "\"rel_err\": %.3e, \"next_gpu\": %d, \"next_cpu\": %d, \"check\": %s}%s\n",
            r->batch, r->budget, r->kv_bytes, r->time_us, r->gbs, r->bw_fraction, ratio_s,
            r->splits, r->max_rel_err, r->next_gpu, r->next_cpu, r->check_ok ? "true" : "false",
            i + 1 < n_rows ? "," : "");
  }
  fprintf(f, "]}\n");
  fclose(f);
  return 0;
}

static int bench_kernel(int argc, char **argv) {
  kernel_opts o;
  const int pr = kernel_parse(argc, argv, &o);
  if (pr) return pr;
  const int n_heads = o.n_heads, n_kv = o.n_kv, D = o.D, iters = o.iters, warmup = o.warmup;
  const lf_kv_dtype kv_dtype = o.kv_dtype;
  char *peer_text = NULL;
  if (o.peer && !(peer_text = bench_read_file(o.peer))) {
    fprintf(stderr, "lfbench: cannot read peer file %s\n", o.peer);
    return 1;
  }

  bench_gpu gpu;
  if (bench_gpu_open("lfbench kernel", 1, &gpu)) {
    free(peer_text);
    return 1;
  }
  const double copy_gbs = gpu.copy_gbs;

  const size_t flush_bytes = (size_t)256 << 20; /* > 4x L2 */
  void *flush = NULL;
  if (!o.no_flush) BENCH_CUDA(cudaMalloc(&flush, flush_bytes));

  const size_t seed_elems = (size_t)32 << 20;
  uint16_t *seed = NULL;
  kernel_side side[2];
  const int sr = kernel_seed(kv_dtype, D, seed_elems, &seed, side);
  if (sr) return sr;

  printf("# lfbench kernel: fused LongFlow decode attention, %d query heads, %d KV heads, "
         "head_dim %d, %s pools, all full, sink 4\n",
         n_heads, n_kv, D, lf_kv_dtype_str(kv_dtype));
  printf("# device %s (%d SMs, L2 %d MB); copy bandwidth (read+write) %.1f GB/s\n", gpu.name,
         gpu.n_sm, (int)(gpu.l2_bytes >> 20), copy_gbs);
  printf("# time: median of %d calls after %d warm-up, CUDA events, %s, pools rotated past 4x L2\n",
         iters, warmup, flush ? "L2 cleared before each call" : "L2 not cleared");
  printf("#%6s %7s %13s %10s %9s %8s %10s %6s %9s %6s\n", "batch", "budget", "kv_bytes", "time_us",
         "GB/s", "bw_frac", "sdpa_ratio", "splits", "rel_err", "check");
  kernel_row rows[256];
  int n_rows = 0, all_ok = 1;
  for (int bi = 0; bi < o.n_budgets; bi++)
    for (int ba = 0; ba < o.n_batches && n_rows < 256; ba++) {
      kernel_row *r = &rows[n_rows];
      memset(r, 0, sizeof *r);
      if (kernel_one(o.batches[ba], o.budgets[bi], n_heads, n_kv, D, iters, warmup, o.splits, seed,
                     side, kv_dtype, seed_elems, gpu.l2_bytes, flush, flush_bytes, r))
        return 1;
      r->bw_fraction = r->gbs / copy_gbs;
      const double pt =
          peer_text ? bench_peer_value(peer_text, "batch", r->batch, "budget", r->budget, "time_us")
                    : -1.0;
      r->sdpa_ratio = pt > 0 ? r->time_us / pt : -1.0;
      char ratio[16];
      if (r->sdpa_ratio > 0)
        snprintf(ratio, sizeof ratio, "%.3f", r->sdpa_ratio);
      else
        snprintf(ratio, sizeof ratio, "-");
      printf(" %6d %7d %13.0f %10.2f %9.1f %8.3f %10s %6d %9.2e %6s\n", r->batch, r->budget,
             r->kv_bytes, r->time_us, r->gbs, r->bw_fraction, ratio, r->splits, r->max_rel_err,
             r->check_ok ? "OK" : "FAIL");
      fflush(stdout);
      all_ok &= r->check_ok;
      n_rows++;
    }
  printf("# %s\n", all_ok ? "all rows checked OK" : "SOME ROWS FAILED THE CHECK");

  if (o.json && kernel_json(o.json, &gpu, &o, rows, n_rows)) return 1;
  free(seed);
  for (int sd = 0; sd < 2; sd++) {
    free(side[sd].codes);
    free(side[sd].meta);
  }
  free(peer_text);
  cudaFree(flush);
  return all_ok ? 0 : 3;
}

#else

static int bench_kernel(int argc, char **argv) {
  (void)argc;
  (void)argv;
  fprintf(stderr, "lfbench kernel: this build has no CUDA backend (LF_CUDA=OFF); the kernel "
                  "benchmark needs CUDA\n");
  return 1;
}

#endif

int main(int argc, char **argv) {
  if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (!strcmp(argv[1], "kernel")) return bench_kernel(argc - 1, argv + 1);
  if (!strcmp(argv[1], "step")) { int bench_step(int, char **); return bench_step(argc - 1, argv + 1); }
  if (!strcmp(argv[1], "serve")) { int bench_serve(int, char **); return bench_serve(argc - 1, argv + 1); }
  if (!strcmp(argv[1], "prefill")) { int bench_prefill(int, char **); return bench_prefill(argc - 1, argv + 1); }
  if (!strcmp(argv[1], "attn")) { int bench_attn(int, char **); return bench_attn(argc - 1, argv + 1); }
  if (!strcmp(argv[1], "comm")) { int bench_comm(int, char **); return bench_comm(argc - 1, argv + 1); }
  if (!strcmp(argv[1], "eval")) { int bench_eval(int, char **); return bench_eval(argc - 1, argv + 1); }
  if (!strcmp(argv[1], "natural")) { int bench_natural(int, char **); return bench_natural(argc - 1, argv + 1); }
  fprintf(stderr, "lfbench: unknown subcommand '%s'\n", argv[1]);
  usage(stderr);
  return 2;
}

/* lfbench attn — the tensor-core prefill attention kernel (attention/prefill_attn.cuh) alone,
 * over chunk lengths T and pool prefixes n0, in each of its tilings (one or two 16-row tiles a
 * warp) and in the one lf_cuda_prefill_attn picks, against torch SDPA on the same shapes
 * (bench/sdpa_prefill_peer.py, with --peer).
 *
 * A row is one chunk of T queries of every query head over n0 filled pool slots and its own
 * causal block: q [T][H][D], k, v [T][Hkv][D] and the pool's n0 slots, seeded random bf16
 * (queries of std 2, so the softmax is not flat). Time: the median of --iters launches after
 * --warmup, CUDA events around each launch (L2 is not cleared: the kernel is compute-bound and a
 * chunk's K/V are fresh in L2 when the engine runs it). FLOPs (multiply-add = 2):
 *
 *   4 * H * D * (T * n0 + T (T + 1) / 2)     q.k and p.v over the (query, key) pairs it sees
 *
 * The check: the two tilings' outputs and (max, normaliser) are the same bits (the CPU reference
 * check of the kernel is tests/gpu_attention.cpp). Peak: the bf16 dense tensor peak of the
 * device's data sheet, given with --peak-tflops (default 989, an H100/H200 SXM).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_gpu.h"
#include "bench_util.h"
#include "lfserve.h"

int bench_attn(int argc, char **argv);

static void attn_usage(FILE *f) {
  fprintf(f,
          "usage: lfbench attn [options]\n"
          "  --tokens LIST     chunk lengths T (default 512,1024,2048,4096,8192,16384)\n"
          "  --prefix LIST     filled pool slots n0 before the chunk (default 0,1536)\n"
          "  --heads N --kv-heads N --head-dim N   (default 32 8 128; head_dim 64 or 128)\n"
          "  --iters N --warmup N                  timed and warm-up launches (default 20 3)\n"
          "  --peer FILE       sdpa_prefill_peer.py JSON: fills sdpa_us and ratio\n"
          "  --peak-tflops X   the device's dense bf16 peak, for the fraction (default 989)\n"
          "  --json FILE       write the rows as JSON\n");
}

#ifdef LF_HAVE_CUDA
#include <cuda_runtime.h>

#include "attention/prefill_attn.cuh"

#define AB_CUDA(stmt)                                                                              \
  do {                                                                                             \
    cudaError_t e_ = (stmt);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      fprintf(stderr, "lfbench attn: %s:%d: %s: %s\n", __FILE__, __LINE__, #stmt,                  \
              cudaGetErrorString(e_));                                                             \
      goto fail;                                                                                   \
    }                                                                                              \
  } while (0)
#define AB_LF(stmt)                                                                                \
  do {                                                                                             \
    if ((stmt) != LF_OK) {                                                                         \
      fprintf(stderr, "lfbench attn: %s: %s\n", #stmt, lf_last_error());                          \
      goto fail;                                                                                   \
    }                                                                                              \
  } while (0)

typedef struct attn_row {
  int n0, T;
  double flops;
  double us[3];   /* tilings 1, 2, and the automatic choice */
  int auto_tiles; /* which of 1, 2 the automatic choice matched in time */
  double peer_us; /* < 0: none */
  int same;       /* tilings 1 and 2 gave the same bits */
} attn_row;

static uint64_t ab_rng = 0x2545f4914f6cdd1dull;

/* One row: every tiling timed, then the bit comparison. Returns 0, or 1 on a CUDA/lfserve error. */
static int attn_one(int n0, int T, int H, int Hkv, int D, int iters, int warmup, attn_row *r) {
  const size_t qn = (size_t)T * H * D, kn = (size_t)T * Hkv * D;
  const int budget = n0 > 0 ? n0 : 1;
  const size_t pn = (size_t)Hkv * budget * D;
  uint16_t *hbuf = NULL, *h1 = NULL, *h2 = NULL;
  float *m1 = NULL, *m2 = NULL;
  double *t = NULL;
  void *dq = NULL, *dk = NULL, *dv = NULL, *dout = NULL, *pk = NULL, *pv = NULL;
  float *dml = NULL;
  cudaEvent_t ev[2] = {NULL, NULL};
  int rc = 1;
  const size_t big = qn > pn ? qn : pn;
  if (!(hbuf = malloc(big * 2)) || !(h1 = malloc(qn * 2)) || !(h2 = malloc(qn * 2)) ||
      !(m1 = malloc((size_t)T * H * 8)) || !(m2 = malloc((size_t)T * H * 8)) ||
      !(t = malloc(sizeof(double) * (size_t)iters))) {
    fprintf(stderr, "lfbench attn: out of host memory\n");
    goto fail;
  }
  AB_CUDA(cudaMalloc(&dq, qn * 2));
  AB_CUDA(cudaMalloc(&dk, kn * 2));
  AB_CUDA(cudaMalloc(&dv, kn * 2));
  AB_CUDA(cudaMalloc(&dout, qn * 2));
  AB_CUDA(cudaMalloc(&pk, pn * 2));
  AB_CUDA(cudaMalloc(&pv, pn * 2));
  AB_CUDA(cudaMalloc((void **)&dml, (size_t)T * H * 8));
  void *dsts[5] = {dq, dk, dv, pk, pv};
  const size_t lens[5] = {qn, kn, kn, pn, pn};
  for (int b = 0; b < 5; b++) {
    for (size_t i = 0; i < lens[b]; i++)
      hbuf[i] = bench_f2bf((b == 0 ? 2.0f : 1.0f) * bench_rng_normal(&ab_rng));
    AB_CUDA(cudaMemcpy(dsts[b], hbuf, lens[b] * 2, cudaMemcpyHostToDevice));
  }
  /* a pool view of one pool and one layer whose n0 slots hold the prefix (the prefill kernel
   * reads only k and v; the chunk's store into the pool is not part of the row) */
  const lf_cuda_pool_view p = {.k = pk, .v = pv, .n_layers = 1, .n_kv_heads = Hkv,
                               .budget = budget, .head_dim = D};
  const float scale = 1.0f / sqrtf((float)D);
  AB_CUDA(cudaEventCreate(&ev[0]));
  AB_CUDA(cudaEventCreate(&ev[1]));
  for (int v = 0; v < 3; v++) {
    const int tiles = v < 2 ? v + 1 : 0;
    for (int i = 0; i < warmup; i++)
      AB_LF(lf_cuda_prefill_attn_tiles(&p, 0, 0, n0, H, T, dq, dk, dv, scale, dout, dml, tiles,
                                       NULL));
    for (int i = 0; i < iters; i++) {
      AB_CUDA(cudaEventRecord(ev[0], 0));
      AB_LF(lf_cuda_prefill_attn_tiles(&p, 0, 0, n0, H, T, dq, dk, dv, scale, dout, dml, tiles,
                                       NULL));
      AB_CUDA(cudaEventRecord(ev[1], 0));
      AB_CUDA(cudaEventSynchronize(ev[1]));
      float ms = 0.0f;
      AB_CUDA(cudaEventElapsedTime(&ms, ev[0], ev[1]));
      t[i] = ms;
    }
    r->us[v] = 1e3 * bench_median(t, iters);
    if (v < 2) {
      AB_CUDA(cudaMemcpy(v == 0 ? h1 : h2, dout, qn * 2, cudaMemcpyDeviceToHost));
      AB_CUDA(cudaMemcpy(v == 0 ? m1 : m2, dml, (size_t)T * H * 8, cudaMemcpyDeviceToHost));
    }
  }
  r->same = !memcmp(h1, h2, qn * 2) && !memcmp(m1, m2, (size_t)T * H * 8);
  r->auto_tiles = fabs(r->us[2] - r->us[0]) <= fabs(r->us[2] - r->us[1]) ? 1 : 2;
  r->n0 = n0;
  r->T = T;
  r->flops = 4.0 * H * D * ((double)T * n0 + (double)T * (T + 1) / 2.0);
  rc = 0;
fail:
  if (ev[0]) cudaEventDestroy(ev[0]);
  if (ev[1]) cudaEventDestroy(ev[1]);
  cudaFree(dq);
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(dout);
  cudaFree(pk);
  cudaFree(pv);
  cudaFree(dml);
  free(hbuf);
  free(h1);
  free(h2);
  free(m1);
  free(m2);
  free(t);
  return rc;
}

int bench_attn(int argc, char **argv) {
  int tokens[32] = {512, 1024, 2048, 4096, 8192, 16384}, n_tokens = 6;
  int prefix[32] = {0, 1536}, n_prefix = 2;
  int H = 32, Hkv = 8, D = 128, iters = 20, warmup = 3;
  double peak = 989.0;
  const char *peer = NULL, *json = NULL;
  for (int i = 1; i < argc; i++) {
    const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(o, "-h") || !strcmp(o, "--help")) {
      attn_usage(stdout);
      return 0;
    }
    if (!v) {
      attn_usage(stderr);
      return 2;
    }
    if (!strcmp(o, "--tokens"))
      n_tokens = bench_int_list(v, tokens, 32);
    else if (!strcmp(o, "--prefix")) {
      /* 0 is a valid prefix, which bench_int_list refuses: parse by hand */
      n_prefix = 0;
      for (const char *s = v; *s && n_prefix >= 0;) {
        char *end;
        const long x = strtol(s, &end, 10);
        if (end == s || x < 0 || x > 1 << 20 || n_prefix == 32 || (*end && *end != ','))
          n_prefix = -1;
        else
          prefix[n_prefix++] = (int)x, s = *end ? end + 1 : end;
      }
    } else if (!strcmp(o, "--heads"))
      H = atoi(v);
    else if (!strcmp(o, "--kv-heads"))
      Hkv = atoi(v);
    else if (!strcmp(o, "--head-dim"))
      D = atoi(v);
    else if (!strcmp(o, "--iters"))
      iters = atoi(v);
    else if (!strcmp(o, "--warmup"))
      warmup = atoi(v);
    else if (!strcmp(o, "--peak-tflops"))
      peak = atof(v);
    else if (!strcmp(o, "--peer"))
      peer = v;
    else if (!strcmp(o, "--json"))
      json = v;
    else {
      attn_usage(stderr);
      return 2;
    }
    i++;
  }
  if (n_tokens < 1 || n_prefix < 1 || Hkv < 1 || H < 1 || H % Hkv || (D != 64 && D != 128) ||
      iters < 1 || warmup < 0 || !(peak > 0)) {
    attn_usage(stderr);
    return 2;
  }
  for (int i = 0; i < n_tokens; i++)
    if (tokens[i] > 65535) {
      fprintf(stderr, "lfbench attn: a chunk is at most 65535 tokens\n");
      return 2;
    }
  char *peer_text = NULL;
  if (peer && !(peer_text = bench_read_file(peer))) {
    fprintf(stderr, "lfbench attn: cannot read peer file %s\n", peer);
    return 1;
  }
  bench_gpu gpu;
  if (bench_gpu_open("lfbench attn", 0, &gpu)) {
    free(peer_text);
    return 1;
  }
  printf("# lfbench attn: prefill attention, %d query heads, %d KV heads, head_dim %d, causal "
         "chunk of T over n0 pool slots\n",
         H, Hkv, D);
  printf("# device %s (%d SMs); median of %d launches after %d warm-up, CUDA events; peak %.0f "
         "TFLOP/s\n",
         gpu.name, gpu.n_sm, iters, warmup, peak);
  printf("#%6s %6s %10s %10s %10s %5s %8s %6s %10s %7s %5s\n", "n0", "T", "us_tiles1",
         "us_tiles2", "us_auto", "auto", "TFLOP/s", "peak", "sdpa_us", "ratio", "same");
  attn_row rows[256];
  int n_rows = 0, all_same = 1;
  for (int a = 0; a < n_prefix; a++)
    for (int b = 0; b < n_tokens && n_rows < 256; b++) {
      attn_row *r = &rows[n_rows];
      memset(r, 0, sizeof *r);
      if (attn_one(prefix[a], tokens[b], H, Hkv, D, iters, warmup, r)) {
        free(peer_text);
        return 1;
      }
      r->peer_us =
          peer_text ? bench_peer_value(peer_text, "n0", r->n0, "T", r->T, "time_us") : -1.0;
      const double tf = r->flops / (r->us[2] * 1e-6) / 1e12;
      char sd[24] = "-", ra[24] = "-";
      if (r->peer_us > 0) {
        snprintf(sd, sizeof sd, "%.1f", r->peer_us);
        snprintf(ra, sizeof ra, "%.3f", r->peer_us / r->us[2]);
      }
      printf(" %6d %6d %10.1f %10.1f %10.1f %5d %8.1f %6.3f %10s %7s %5s\n", r->n0, r->T,
             r->us[0], r->us[1], r->us[2], r->auto_tiles, tf, tf / peak, sd, ra,
             r->same ? "yes" : "NO");
      fflush(stdout);
      all_same &= r->same;
      n_rows++;
    }
  printf("# ratio = sdpa time / lfserve time (above 1: lfserve faster); %s\n",
         all_same ? "tilings bit-identical on every row" : "TILINGS DIFFER ON SOME ROWS");
  if (json) {
    FILE *f = fopen(json, "w");
    if (!f) {
      fprintf(stderr, "lfbench attn: cannot write %s\n", json);
      free(peer_text);
      return 1;
    }
    fprintf(f,
            "{\"bench\": \"attn\", \"device\": \"%s\", \"n_sm\": %d, \"heads\": %d, "
            "\"kv_heads\": %d, \"head_dim\": %d, \"iters\": %d, \"peak_tflops\": %.1f,\n"
            " \"rows\": [\n",
            gpu.name, gpu.n_sm, H, Hkv, D, iters, peak);
    for (int i = 0; i < n_rows; i++) {
      const attn_row *r = &rows[i];
      char ps[32] = "null";
      if (r->peer_us > 0) snprintf(ps, sizeof ps, "%.3f", r->peer_us);
      fprintf(f,
              "  {\"n0\": %d, \"T\": %d, \"flops\": %.0f, \"us_tiles1\": %.3f, \"us_tiles2\": "
              "%.3f, \"us_auto\": %.3f, \"auto_tiles\": %d, \"tflops\": %.2f, \"sdpa_us\": %s, "
              "\"same_bits\": %s}%s\n",
              r->n0, r->T, r->flops, r->us[0], r->us[1], r->us[2], r->auto_tiles,
              r->flops / (r->us[2] * 1e-6) / 1e12, ps, r->same ? "true" : "false",
              i + 1 < n_rows ? "," : "");
    }
    fprintf(f, "]}\n");
    fclose(f);
  }
  free(peer_text);
  return all_same ? 0 : 3;
}

#else

int bench_attn(int argc, char **argv) {
  for (int i = 1; i < argc; i++)
    if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
      attn_usage(stdout);
      return 0;
    }
  fprintf(stderr, "lfbench attn: this build has no CUDA backend (LF_CUDA=OFF); the kernel "
                  "benchmark needs CUDA\n");
  return 1;
}

#endif

/* lfbench comm — all-reduce latency and bus bandwidth of the tensor-parallel communicator, in
 * nccl-tests' columns, under mpirun:
 *
 *   mpirun -np 2 lfbench comm [--comm nccl|mpi] [--type f32|bf16] [--min BYTES] [--max BYTES]
 *                             [--iters N] [--warmup N] [--json FILE]
 *   tests/tp_run.sh 2 lfbench comm ...   (NCCL without MPI: the environment bootstrap)
 *
 * Sizes double from --min (8 KB) to --max (64 MB). Per size: one correctness run (rank r holds
 * (r + 1) * (1 + i % 7) at element i, so the sum is exact in bf16 too: (1 + i % 7) * T(T+1)/2;
 * #wrong counts the elements that differ on this rank, summed over ranks), then `warmup` and
 * `iters` timed in-place all-reduces. Time: nccl: CUDA events around the iters on the stream
 * the collectives run on (device time per call, as nccl-tests' out-of-place/in-place columns);
 * mpi: host clock (the calls block). algbw = bytes / time; busbw = algbw * 2 (T - 1) / T, the
 * bandwidth-optimal all-reduce's per-link traffic (nccl-tests' definition). Printed on rank 0.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"
#include "lfserve.h"

#include "parallel/comm.h"
#ifdef LF_HAVE_MPI
#include <mpi.h>
#endif
#ifdef LF_HAVE_NCCL
#include <cuda_runtime.h>
#endif

static uint16_t to_bf16(float f) { /* exact for the small integers used here */
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* host[i] = scale * (1 + i % 7) in dtype t */
static void fill(void *host, size_t n, lf_comm_dtype t, float scale) {
  for (size_t i = 0; i < n; i++) {
    const float v = scale * (float)(1 + i % 7);
    if (t == LF_COMM_BF16) ((uint16_t *)host)[i] = to_bf16(v);
    else ((float *)host)[i] = v;
  }
}

static long long count_wrong(const void *host, size_t n, lf_comm_dtype t, float scale) {
  long long bad = 0;
  for (size_t i = 0; i < n; i++) {
    const float want = scale * (float)(1 + i % 7);
    const float got = t == LF_COMM_BF16 ? from_bf16(((const uint16_t *)host)[i])
                                        : ((const float *)host)[i];
    bad += got != want;
  }
  return bad;
}

#define COMM_FAIL(...)                                                                             \
  do {                                                                                             \
    fprintf(stderr, "lfbench comm: rank %d: ", rank);                                              \
    fprintf(stderr, __VA_ARGS__);                                                                  \
    fprintf(stderr, ": %s\n", lf_last_error());                                                    \
    rc = 1;                                                                                        \
    goto done;                                                                                     \
  } while (0)

int bench_comm(int argc, char **argv) {
  const char *kind = NULL, *json_path = NULL;
  lf_comm_dtype type = LF_COMM_F32;
  size_t min_b = 8 << 10, max_b = (size_t)64 << 20;
  int iters = 20, warmup = 5;
  for (int i = 1; i < argc; i++) {
    const char *o = argv[i];
    if (!strcmp(o, "-h") || !strcmp(o, "--help")) {
      printf("usage: mpirun -np T lfbench comm [--comm nccl|mpi] [--type f32|bf16] [--min BYTES]\n"
             "                   [--max BYTES] [--iters N] [--warmup N] [--json FILE]\n"
             "  all-reduce latency and bus bandwidth, nccl-tests columns, with a correctness\n"
             "  column; default: nccl where built (GPU ranks), else mpi; 8 KB .. 64 MB, f32\n");
      return 0;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "lfbench comm: %s needs a value\n", o);
      return 2;
    }
    const char *v = argv[++i];
    if (!strcmp(o, "--comm")) kind = v;
    else if (!strcmp(o, "--type")) {
      if (!strcmp(v, "f32")) type = LF_COMM_F32;
      else if (!strcmp(v, "bf16")) type = LF_COMM_BF16;
      else {
        fprintf(stderr, "lfbench comm: --type f32|bf16\n");
        return 2;
      }
    } else if (!strcmp(o, "--min")) min_b = (size_t)strtoull(v, NULL, 10);
    else if (!strcmp(o, "--max")) max_b = (size_t)strtoull(v, NULL, 10);
    else if (!strcmp(o, "--iters")) iters = atoi(v);
    else if (!strcmp(o, "--warmup")) warmup = atoi(v);
    else if (!strcmp(o, "--json")) json_path = v;
    else {
      fprintf(stderr, "lfbench comm: unknown option %s\n", o);
      return 2;
    }
  }
  if (iters < 1 || warmup < 0 || min_b < 4 || max_b < min_b) {
    fprintf(stderr, "lfbench comm: iters >= 1, warmup >= 0, 4 <= min <= max\n");
    return 2;
  }
#ifdef LF_HAVE_NCCL
  if (!kind) kind = "nccl";
#else
  if (!kind) kind = "mpi";
#endif
  const int nccl = !strcmp(kind, "nccl");
  if (!nccl && strcmp(kind, "mpi")) {
    fprintf(stderr, "lfbench comm: --comm nccl|mpi\n");
    return 2;
  }
  const int env = getenv("LF_TP_RANK") != NULL; /* tests/tp_run.sh: no MPI */
  if (env && !nccl) {
    fprintf(stderr, "lfbench comm: --comm mpi runs under mpirun\n");
    return 2;
  }
  int rank = env ? atoi(getenv("LF_TP_RANK")) : 0, rc = 0, dev = -1;
  if (!env) {
#ifdef LF_HAVE_MPI
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited && MPI_Init(&argc, &argv) != MPI_SUCCESS) {
      fprintf(stderr, "lfbench comm: MPI_Init failed\n");
      return 1;
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
#else
    fprintf(stderr, "lfbench comm: no MPI in this build: launch with tests/tp_run.sh\n");
    return 1;
#endif
  }
  lf_comm_t comm = NULL;
  void *host = NULL;
  FILE *json = NULL;
#ifdef LF_HAVE_NCCL
  void *dbuf = NULL;
  cudaStream_t st = NULL;
  cudaEvent_t e0 = NULL, e1 = NULL;
#endif
  lf_status s = env    ? lf_comm_init_nccl_env(0.0, &dev, &comm)
                : nccl ? lf_comm_init_nccl_mpi(0.0, &dev, &comm)
                       : lf_comm_init_mpi(&comm);
  if (s != LF_OK) COMM_FAIL("%s communicator", kind);
  const int T = comm->size;
  const size_t es = lf_comm_dtype_size(type);
  host = malloc(max_b + es);
  if (!host) COMM_FAIL("host buffer");
#ifdef LF_HAVE_NCCL
  if (nccl) {
    if (cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess ||
        cudaMalloc(&dbuf, max_b + es) != cudaSuccess)
      COMM_FAIL("CUDA setup: %s", cudaGetErrorString(cudaGetLastError()));
  }
#endif
  if (rank == 0) {
    if (json_path && !(json = fopen(json_path, "w"))) COMM_FAIL("cannot write %s", json_path);
    printf("# lfbench comm: %s all-reduce (sum, in place), %d ranks%s; %d iters after %d warm-up\n",
           kind, T, nccl ? ", device time per call (CUDA events)" : ", host time per call", iters,
           warmup);
    printf("# %12s %12s %6s %6s %10s %10s %10s %8s\n", "size(B)", "count", "type", "redop",
           "time(us)", "algbw", "busbw", "#wrong");
    if (json)
      fprintf(json, "{\n  \"bench\": \"comm\", \"comm\": \"%s\", \"ranks\": %d, \"type\": \"%s\", "
                    "\"iters\": %d, \"warmup\": %d,\n  \"rows\": [",
              kind, T, type == LF_COMM_BF16 ? "bf16" : "float", iters, warmup);
  }
  int first = 1;
  for (size_t bytes = min_b; bytes <= max_b; bytes *= 2) {
    const size_t n = bytes / es;
    /* correctness: one all-reduce of known values */
    fill(host, n, type, (float)(rank + 1));
    void *buf = host;
#ifdef LF_HAVE_NCCL
    if (nccl) {
      /* on st: a plain cudaMemcpy from pageable memory returns before its DMA ends, and st (a
       * non-blocking stream) would not wait for it; the first versions of the IPC all-reduce,
       * whose first kernel starts at once, read half-uploaded inputs and were counted wrong */
      if (cudaMemcpyAsync(dbuf, host, n * es, cudaMemcpyHostToDevice, st) != cudaSuccess)
        COMM_FAIL("upload");
      buf = dbuf;
    }
    void *stream = nccl ? (void *)st : NULL;
#else
    void *stream = NULL;
#endif
    if (comm->allreduce_sum(comm, buf, n, type, stream) != LF_OK ||
        lf_comm_sync(comm, stream) != LF_OK)
      COMM_FAIL("all-reduce of %zu bytes", bytes);
#ifdef LF_HAVE_NCCL
    if (nccl && cudaMemcpy(host, dbuf, n * es, cudaMemcpyDeviceToHost) != cudaSuccess)
      COMM_FAIL("download");
#endif
    const long long wrong = count_wrong(host, n, type, (float)T * (float)(T + 1) / 2.0f);
    /* timing (zeros: repeated in-place sums of data would overflow) */
    double t_us = 0;
#ifdef LF_HAVE_NCCL
    if (nccl) {
      cudaMemsetAsync(dbuf, 0, n * es, st);
      for (int i = 0; i < warmup; i++)
        if (comm->allreduce_sum(comm, dbuf, n, type, st) != LF_OK) COMM_FAIL("warm-up");
      cudaEventRecord(e0, st);
      for (int i = 0; i < iters; i++)
        if (comm->allreduce_sum(comm, dbuf, n, type, st) != LF_OK) COMM_FAIL("timed run");
      cudaEventRecord(e1, st);
      if (lf_comm_sync(comm, st) != LF_OK) COMM_FAIL("sync");
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      t_us = 1e3 * (double)ms / iters;
    } else
#endif
    {
      memset(host, 0, n * es);
      for (int i = 0; i < warmup; i++)
        if (comm->allreduce_sum(comm, host, n, type, NULL) != LF_OK) COMM_FAIL("warm-up");
      if (comm->barrier(comm) != LF_OK) COMM_FAIL("barrier");
      const double t0 = lf_now_s();
      for (int i = 0; i < iters; i++)
        if (comm->allreduce_sum(comm, host, n, type, NULL) != LF_OK) COMM_FAIL("timed run");
      t_us = 1e6 * (lf_now_s() - t0) / iters;
    }
    /* the slowest rank's time, as nccl-tests reports, and every rank's wrong count: one
     * host-path gather of (time, wrong) through the communicator itself */
    float mine[2] = {(float)t_us, (float)wrong}, *every = calloc(2 * (size_t)T, sizeof(float));
    if (!every || comm->allgather(comm, mine, every, 2, LF_COMM_F32, NULL) != LF_OK) {
      free(every);
      COMM_FAIL("gathering the results");
    }
    double t_max = 0;
    long long all_wrong = 0;
    for (int r = 0; r < T; r++) {
      if (every[2 * r] > t_max) t_max = every[2 * r];
      all_wrong += (long long)every[2 * r + 1];
    }
    free(every);
    const double algbw = (double)(n * es) / (t_max * 1e-6) / 1e9;
    const double busbw = algbw * 2.0 * (T - 1) / T;
    if (rank == 0) {
      printf("  %12zu %12zu %6s %6s %10.2f %10.2f %10.2f %8lld\n", n * es, n,
             type == LF_COMM_BF16 ? "bf16" : "float", "sum", t_max, algbw, busbw, all_wrong);
      if (json) {
        fprintf(json,
                "%s\n    {\"bytes\": %zu, \"count\": %zu, \"time_us\": %.3f, \"algbw_gbs\": %.3f, "
                "\"busbw_gbs\": %.3f, \"wrong\": %lld}",
                first ? "" : ",", n * es, n, t_max, algbw, busbw, all_wrong);
        first = 0;
      }
      fflush(stdout);
    }
    if (all_wrong) rc = 1;
  }
  if (json) fprintf(json, "\n  ]\n}\n");
done:
  if (json) fclose(json);
#ifdef LF_HAVE_NCCL
  if (dbuf) cudaFree(dbuf);
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  if (st) cudaStreamDestroy(st);
#endif
  free(host);
  (void)dev;
  if (rc) {
    /* a failed communicator may leave peers in a collective: let the launcher end the job */
    fprintf(stderr, "lfbench comm: rank %d failed\n", rank);
    return rc;
  }
  lf_comm_free(comm);
#ifdef LF_HAVE_MPI
  if (!env) MPI_Finalize();
#endif
  return 0;
}

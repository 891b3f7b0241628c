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
#include <stdarg.h>
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

/* Prints "lfbench comm: rank R: <what>: <lf_last_error()>"; returns 1. */
static int comm_fail(int rank, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int comm_fail(int rank, const char *fmt, ...) {
  fprintf(stderr, "lfbench comm: rank %d: ", rank);
  va_list ap;
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, ": %s\n", lf_last_error());
  return 1;
}

#define COMM_FAIL(...)                                                                             \
  do {                                                                                             \
    rc = comm_fail(rank, __VA_ARGS__);                                                             \
    goto done;                                                                                     \
  } while (0)

/* The options, then the communicator and buffers of one run. */
typedef struct comm_bench {
  const char *kind, *json_path;
  lf_comm_dtype type;
  size_t min_b, max_b, es;
  int iters, warmup, nccl, env;
  int rank, T;
  lf_comm_t comm;
  void *host;
  FILE *json;
#ifdef LF_HAVE_NCCL
  void *dbuf;
  cudaStream_t st;
  cudaEvent_t e0, e1;
#endif
} comm_bench;

/* The command line into b (kind defaulted, nccl and env set). -1: go on; else the exit code
 * (0 after --help, 2 for a bad option). */
static int comm_parse(int argc, char **argv, comm_bench *b) {
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
    if (!strcmp(o, "--comm")) b->kind = v;
    else if (!strcmp(o, "--type")) {
      if (!strcmp(v, "f32")) b->type = LF_COMM_F32;
      else if (!strcmp(v, "bf16")) b->type = LF_COMM_BF16;
      else {
        fprintf(stderr, "lfbench comm: --type f32|bf16\n");
        return 2;
      }
    } else if (!strcmp(o, "--min")) b->min_b = (size_t)strtoull(v, NULL, 10);
    else if (!strcmp(o, "--max")) b->max_b = (size_t)strtoull(v, NULL, 10);
    else if (!strcmp(o, "--iters")) b->iters = atoi(v);
    else if (!strcmp(o, "--warmup")) b->warmup = atoi(v);
    else if (!strcmp(o, "--json")) b->json_path = v;
    else {
      fprintf(stderr, "lfbench comm: unknown option %s\n", o);
      return 2;
    }
  }
  if (b->iters < 1 || b->warmup < 0 || b->min_b < 4 || b->max_b < b->min_b) {
    fprintf(stderr, "lfbench comm: iters >= 1, warmup >= 0, 4 <= min <= max\n");
    return 2;
  }
#ifdef LF_HAVE_NCCL
  if (!b->kind) b->kind = "nccl";
#else
  if (!b->kind) b->kind = "mpi";
#endif
  b->nccl = !strcmp(b->kind, "nccl");
  if (!b->nccl && strcmp(b->kind, "mpi")) {
    fprintf(stderr, "lfbench comm: --comm nccl|mpi\n");
    return 2;
  }
  b->env = getenv("LF_TP_RANK") != NULL; /* tests/tp_run.sh: no MPI */
  if (b->env && !b->nccl) {
    fprintf(stderr, "lfbench comm: --comm mpi runs under mpirun\n");
    return 2;
  }
  return -1;
}

/* This process's rank: LF_TP_RANK's, else MPI's (MPI_Init here when not yet). 0 or the exit
 * code. */
static int comm_rank(int *argc, char ***argv, comm_bench *b) {
  b->rank = b->env ? atoi(getenv("LF_TP_RANK")) : 0;
  if (!b->env) {
#ifdef LF_HAVE_MPI
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited && MPI_Init(argc, argv) != MPI_SUCCESS) {
      fprintf(stderr, "lfbench comm: MPI_Init failed\n");
      return 1;
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &b->rank);
#else
    (void)argc;
    (void)argv;
    fprintf(stderr, "lfbench comm: no MPI in this build: launch with tests/tp_run.sh\n");
    return 1;
#endif
  }
  return 0;
}

/* Rank 0: the JSON file opened and its head written, the table's two header lines. */
static int comm_header(comm_bench *b) {
  if (b->json_path && !(b->json = fopen(b->json_path, "w")))
    return comm_fail(b->rank, "cannot write %s", b->json_path);
  printf("# lfbench comm: %s all-reduce (sum, in place), %d ranks%s; %d iters after %d warm-up\n",
         b->kind, b->T, b->nccl ? ", device time per call (CUDA events)" : ", host time per call",
         b->iters, b->warmup);
  printf("# %12s %12s %6s %6s %10s %10s %10s %8s\n", "size(B)", "count", "type", "redop",
         "time(us)", "algbw", "busbw", "#wrong");
  if (b->json)
    fprintf(b->json, "{\n  \"bench\": \"comm\", \"comm\": \"%s\", \"ranks\": %d, \"type\": \"%s\", "
                     "\"iters\": %d, \"warmup\": %d,\n  \"rows\": [",
            b->kind, b->T, b->type == LF_COMM_BF16 ? "bf16" : "float", b->iters, b->warmup);
  return 0;
}

/* The correctness run: one all-reduce of known values; *wrong: this rank's elements that
 * differ. */
static int comm_check(comm_bench *b, size_t bytes, size_t n, long long *wrong) {
  fill(b->host, n, b->type, (float)(b->rank + 1));
  void *buf = b->host;
#ifdef LF_HAVE_NCCL
  const size_t es = b->es;
  if (b->nccl) {
    /* on st: a plain cudaMemcpy from pageable memory returns before its DMA ends, and st (a
     * non-blocking stream) would not wait for it; the first versions of the IPC all-reduce,
     * whose first kernel starts at once, read half-uploaded inputs and were counted wrong */
    if (cudaMemcpyAsync(b->dbuf, b->host, n * es, cudaMemcpyHostToDevice, b->st) != cudaSuccess)
      return comm_fail(b->rank, "upload");
    buf = b->dbuf;
  }
  void *stream = b->nccl ? (void *)b->st : NULL;
#else
  void *stream = NULL;
#endif
  if (b->comm->allreduce_sum(b->comm, buf, n, b->type, stream) != LF_OK ||
      lf_comm_sync(b->comm, stream) != LF_OK)
    return comm_fail(b->rank, "all-reduce of %zu bytes", bytes);
#ifdef LF_HAVE_NCCL
  if (b->nccl && cudaMemcpy(b->host, b->dbuf, n * es, cudaMemcpyDeviceToHost) != cudaSuccess)
    return comm_fail(b->rank, "download");
#endif
  *wrong = count_wrong(b->host, n, b->type, (float)b->T * (float)(b->T + 1) / 2.0f);
  return 0;
}

/* warmup then iters timed in-place all-reduces of zeros (repeated in-place sums of data would
 * overflow); *t_us: the time per call on this rank. */
static int comm_time(comm_bench *b, size_t n, double *t_us) {
  const size_t es = b->es;
  lf_comm_t comm = b->comm;
#ifdef LF_HAVE_NCCL
  if (b->nccl) {
    cudaMemsetAsync(b->dbuf, 0, n * es, b->st);
    for (int i = 0; i < b->warmup; i++)
      if (comm->allreduce_sum(comm, b->dbuf, n, b->type, b->st) != LF_OK)
        return comm_fail(b->rank, "warm-up");
    cudaEventRecord(b->e0, b->st);
    for (int i = 0; i < b->iters; i++)
      if (comm->allreduce_sum(comm, b->dbuf, n, b->type, b->st) != LF_OK)
        return comm_fail(b->rank, "timed run");
    cudaEventRecord(b->e1, b->st);
    if (lf_comm_sync(comm, b->st) != LF_OK) return comm_fail(b->rank, "sync");
    float ms = 0;
    cudaEventElapsedTime(&ms, b->e0, b->e1);
    *t_us = 1e3 * (double)ms / b->iters;
    return 0;
  }
#endif
  memset(b->host, 0, n * es);
  for (int i = 0; i < b->warmup; i++)
    if (comm->allreduce_sum(comm, b->host, n, b->type, NULL) != LF_OK)
      return comm_fail(b->rank, "warm-up");
  if (comm->barrier(comm) != LF_OK) return comm_fail(b->rank, "barrier");
  const double t0 = lf_now_s();
  for (int i = 0; i < b->iters; i++)
    if (comm->allreduce_sum(comm, b->host, n, b->type, NULL) != LF_OK)
      return comm_fail(b->rank, "timed run");
  *t_us = 1e6 * (lf_now_s() - t0) / b->iters;
  return 0;
}

/* The slowest rank's time, as nccl-tests reports, and every rank's wrong count: one host-path
 * gather of (time, wrong) through the communicator itself. */
static int comm_gather(comm_bench *b, double t_us, long long wrong, double *t_max,
                       long long *all_wrong) {
  const int T = b->T;
  float mine[2] = {(float)t_us, (float)wrong}, *every = calloc(2 * (size_t)T, sizeof(float));
  if (!every || b->comm->allgather(b->comm, mine, every, 2, LF_COMM_F32, NULL) != LF_OK) {
    free(every);
    return comm_fail(b->rank, "gathering the results");
  }
  *t_max = 0;
  *all_wrong = 0;
  for (int r = 0; r < T; r++) {
    if (every[2 * r] > *t_max) *t_max = every[2 * r];
    *all_wrong += (long long)every[2 * r + 1];
  }
  free(every);
  return 0;
}

/* Rank 0: one size's table row and JSON row. */
static void comm_print_row(comm_bench *b, size_t n, double t_max, long long all_wrong,
                           int *first) {
  const size_t es = b->es;
  const double algbw = (double)(n * es) / (t_max * 1e-6) / 1e9;
  const double busbw = algbw * 2.0 * (b->T - 1) / b->T;
  printf("  %12zu %12zu %6s %6s %10.2f %10.2f %10.2f %8lld\n", n * es, n,
         b->type == LF_COMM_BF16 ? "bf16" : "float", "sum", t_max, algbw, busbw, all_wrong);
  if (b->json) {
    fprintf(b->json,
            "%s\n    {\"bytes\": %zu, \"count\": %zu, \"time_us\": %.3f, \"algbw_gbs\": %.3f, "
            "\"busbw_gbs\": %.3f, \"wrong\": %lld}",
            *first ? "" : ",", n * es, n, t_max, algbw, busbw, all_wrong);
    *first = 0;
  }
  fflush(stdout);
}

int bench_comm(int argc, char **argv) {
  comm_bench b = {.type = LF_COMM_F32, .min_b = 8 << 10, .max_b = (size_t)64 << 20,
                  .iters = 20, .warmup = 5};
  int rc = comm_parse(argc, argv, &b);
  if (rc >= 0) return rc;
  rc = comm_rank(&argc, &argv, &b);
  if (rc) return rc;
  const int rank = b.rank;
  int dev = -1;
  lf_status s = b.env    ? lf_comm_init_nccl_env(0.0, &dev, &b.comm)
                : b.nccl ? lf_comm_init_nccl_mpi(0.0, &dev, &b.comm)
                         : lf_comm_init_mpi(&b.comm);
  if (s != LF_OK) COMM_FAIL("%s communicator", b.kind);
  b.T = b.comm->size;
  b.es = lf_comm_dtype_size(b.type);
  b.host = malloc(b.max_b + b.es);
  if (!b.host) COMM_FAIL("host buffer");
#ifdef LF_HAVE_NCCL
  if (b.nccl) {
    if (cudaStreamCreateWithFlags(&b.st, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreate(&b.e0) != cudaSuccess || cudaEventCreate(&b.e1) != cudaSuccess ||
        cudaMalloc(&b.dbuf, b.max_b + b.es) != cudaSuccess)
      COMM_FAIL("CUDA setup: %s", cudaGetErrorString(cudaGetLastError()));
  }
#endif
  if (rank == 0 && comm_header(&b)) {
    rc = 1;
    goto done;
  }
  int first = 1;
  for (size_t bytes = b.min_b; bytes <= b.max_b; bytes *= 2) {
    const size_t n = bytes / b.es;
    long long wrong = 0, all_wrong = 0;
    double t_us = 0, t_max = 0;
    if (comm_check(&b, bytes, n, &wrong) || comm_time(&b, n, &t_us) ||
        comm_gather(&b, t_us, wrong, &t_max, &all_wrong)) {
      rc = 1;
      goto done;
    }
    if (rank == 0) comm_print_row(&b, n, t_max, all_wrong, &first);
    if (all_wrong) rc = 1;
  }
  if (b.json) fprintf(b.json, "\n  ]\n}\n");
done:
  if (b.json) fclose(b.json);
#ifdef LF_HAVE_NCCL
  if (b.dbuf) cudaFree(b.dbuf);
  if (b.e0) cudaEventDestroy(b.e0);
  if (b.e1) cudaEventDestroy(b.e1);
  if (b.st) cudaStreamDestroy(b.st);
#endif
  free(b.host);
  (void)dev;
  if (rc) {
    /* a failed communicator may leave peers in a collective: let the launcher end the job */
    fprintf(stderr, "lfbench comm: rank %d failed\n", rank);
    return rc;
  }
  lf_comm_free(b.comm);
#ifdef LF_HAVE_MPI
  if (!b.env) MPI_Finalize();
#endif
  return 0;
}

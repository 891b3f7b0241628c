/* The NCCL communicator (GPU ranks).
 *
 * Two kinds of call, told apart by `stream` (parallel/comm.h):
 *   - stream != NULL: device buffers. The collective is enqueued on that stream and the call
 *     returns; nothing waits. This is what the cuda backend's forward uses (all-reduce after O
 *     and after down, the LM head's gathers), and it may be captured into a CUDA graph.
 *   - stream == NULL: host buffers (parallel/tp.c's descriptor broadcast, the engine's start-up
 *     agreement). Staged through a device buffer on the communicator's own stream; the call
 *     returns once the result is back on the host.
 *
 * Failure handling: why no call here can hang forever (except the one that must).
 * NCCL kernels spin on the GPU until their peers deliver; a peer that died never does, and a
 * cudaStreamSynchronize behind such a kernel never returns. So nothing here blocks in CUDA or
 * NCCL: communicators we create are non-blocking (ncclConfig_t.blocking = 0: every NCCL call may
 * return ncclInProgress and is settled by polling ncclCommGetAsyncError), and every wait for a
 * stream (comm->sync, the host path) polls cudaStreamQuery and ncclCommGetAsyncError against a
 * deadline. When NCCL reports an error or the deadline passes, the communicator is aborted
 * (ncclCommAbort also ends this rank's spinning kernels, so the backend can free its memory) and
 * LF_ERR_BACKEND comes back naming the rank, file:line and statement; every later call fails at
 * once. The peers time out the same way on their side, so the whole job ends within about the
 * timeout (default 60 s, LF_NCCL_TIMEOUT_S; under mpirun sooner: the launcher ends the job when
 * the first rank exits non-zero).
 * Deadlines: timeout_s for the device path's waits and for the root of a host broadcast; none
 * for a non-root host broadcast (a follower waiting for rank 0's next batch descriptor may idle
 * for hours between requests; NCCL's async error still ends the wait when the transport sees
 * the peer go); 10 x timeout_s for the other host collectives (the start-up agreement, where
 * ranks arrive when their weights are loaded) and for creating the communicator.
 *
 * bf16 sums: NCCL reduces each element once per step of its ring/tree and the result is then
 * copied, so every rank gets the same bits (NVLS, which could differ, is off: NCCL_NVLS_ENABLE=0
 * wherever bench/run.sh runs).
 */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <nccl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ar_ipc.h"
#include "base/tuning.h"
#include "comm.h"
#include "base/clock.h"
#include "base/error.h"

_Static_assert(sizeof(ncclUniqueId) == LF_NCCL_ID_BYTES, "ncclUniqueId size");
_Static_assert(LF_NCCL_ID_BYTES == LF_NCCL_UNIQUE_ID_BYTES, "public id size");
_Static_assert(sizeof(lf_ar_record) % 4 == 0, "records travel as int32");

typedef struct nccl_impl {
  ncclComm_t comm;
  int owned;          /* created here: finalized and destroyed by lf_comm_free */
  int failed;         /* aborted: every later call fails at once */
  int aborted;        /* the abort finished (else NCCL kernels may still spin on the device) */
  int dev;            /* the communicator's CUDA device */
  double timeout_s;
  cudaStream_t hstream; /* host-buffer collectives */
  void *stage;          /* device staging for them */
  size_t stage_bytes;
  lf_ar_ipc *ar;        /* one-shot IPC all-reduce for small device messages, or NULL */
  lf_comm_t host;       /* host broadcasts through this (MPI under mpirun), or NULL: NCCL */
} nccl_impl;

/* Polling cadence: yield for the first 20 ms (a decode step ends within that, and a sleep would
 * add its granularity to every step), then sleep 20 us between polls. */
static void nc_pause(double t0) {
  if (lf_now_s() - t0 < 0.02) {
    sched_yield();
  } else {
    struct timespec ts = {0, 20000};
    nanosleep(&ts, NULL);
  }
}

/* ncclCommAbort on its own thread: recent NCCL versions synchronise with the peers' aborts
 * inside ncclCommAbort, so with a peer that is stuck (alive, not in NCCL) it may never return
 * (NCCL 2.28 was seen to hang in it). The failing call waits for it a
 * bounded time, then returns its error anyway; the thread is left behind (the communicator is
 * unusable after a failure; the programs built on it end once they have reported it). */
typedef struct {
  ncclComm_t comm;
  atomic_int done;
} nc_abort_job;

static void *nc_abort_main(void *arg) {
  nc_abort_job *j = (nc_abort_job *)arg;
  ncclCommAbort(j->comm); /* also ends this rank's spinning NCCL kernels */
  atomic_store(&j->done, 1);
  return NULL;
}

/* 1 when the abort finished within `wait_s`. The job is leaked when it did not (its thread
 * still uses it). */
static int nc_abort_bounded(ncclComm_t comm, double wait_s) {
  nc_abort_job *j = (nc_abort_job *)calloc(1, sizeof *j);
  if (!j) return 0;
  j->comm = comm;
  pthread_t th;
  if (pthread_create(&th, NULL, nc_abort_main, j) != 0) {
    free(j);
    return 0;
  }
  const double t0 = lf_now_s();
  while (!atomic_load(&j->done) && lf_now_s() - t0 < wait_s) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  if (!atomic_load(&j->done)) {
    pthread_detach(th);
    return 0;
  }
  pthread_join(th, NULL);
  free(j);
  return 1;
}

/* Aborts (once) and records the failure; returns LF_ERR_BACKEND. */
static lf_status nc_fail(lf_comm_t c, const char *file, int line, const char *stmt,
                         const char *why) {
  nccl_impl *m = c->impl;
  int aborted = 1;
  if (!m->failed) {
    m->failed = 1;
    if (m->comm) aborted = nc_abort_bounded(m->comm, 3.0);
    m->aborted = aborted;
    m->comm = NULL;
  }
  return lf_error(LF_ERR_BACKEND, "rank %d: %s:%d: %s: %s (NCCL communicator %s)", c->rank, file,
                  line, stmt, why,
                  aborted ? "aborted" : "abandoned: its abort did not finish within 3 s");
}

static lf_status nc_dead(lf_comm_t c) {
  return lf_error(LF_ERR_BACKEND, "rank %d: the NCCL communicator failed earlier and was aborted",
                  c->rank);
}

/* Settles the result r of an NCCL call: ncclInProgress (non-blocking communicator) is polled
 * until it turns into success or an error, or `timeout` seconds pass (<= 0: no deadline). */
static lf_status nc_settle(lf_comm_t c, ncclResult_t r, double timeout, const char *file,
                           int line, const char *stmt) {
  nccl_impl *m = c->impl;
  const double t0 = lf_now_s();
  while (r == ncclInProgress) {
    if (timeout > 0 && lf_now_s() - t0 > timeout) {
      char why[96];
      snprintf(why, sizeof why, "still in progress after %.0f s", timeout);
      return nc_fail(c, file, line, stmt, why);
    }
    nc_pause(t0);
    ncclResult_t a = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(m->comm, &a);
    r = q != ncclSuccess ? q : a;
  }
  if (r != ncclSuccess) {
    char why[320];
    const char *last = m->comm ? ncclGetLastError(m->comm) : NULL;
    snprintf(why, sizeof why, "%s%s%s", ncclGetErrorString(r), last && *last ? ": " : "",
             last ? last : "");
    return nc_fail(c, file, line, stmt, why);
  }
  return LF_OK;
}

/* nccl-tests style: log rank, file:line and the statement, return the error up (never abort
 * the process). For NCCL calls on this communicator, with the settle above. */
#define LF_NCCL_CHECK(c, stmt, timeout)                                                            \
  do {                                                                                             \
    if (((nccl_impl *)(c)->impl)->failed) return nc_dead(c);                                       \
    lf_status lf_nccl_s_ = nc_settle((c), (stmt), (timeout), __FILE__, __LINE__, #stmt);           \
    if (lf_nccl_s_ != LF_OK) return lf_nccl_s_;                                                    \
  } while (0)

/* CUDA runtime calls of the communicator: a failure also aborts it (the peers would otherwise
 * wait for this rank's half of a collective). */
#define LF_NC_CUDA_CHECK(c, stmt)                                                                  \
  do {                                                                                             \
    cudaError_t lf_nc_e_ = (stmt);                                                                 \
    if (lf_nc_e_ != cudaSuccess) return nc_fail((c), __FILE__, __LINE__, #stmt,                    \
                                                cudaGetErrorString(lf_nc_e_));                     \
  } while (0)

/* Waits for everything queued on `st`, polling NCCL's error state; timeout <= 0: no deadline. */
static lf_status nc_wait(lf_comm_t c, cudaStream_t st, double timeout, const char *what) {
  nccl_impl *m = c->impl;
  if (m->failed) return nc_dead(c);
  const double t0 = lf_now_s();
  for (;;) {
    const cudaError_t e = cudaStreamQuery(st);
    if (m->ar && lf_ar_ipc_failed(m->ar)) /* its kernel gave up on a peer, then returned */
      return nc_fail(c, __FILE__, __LINE__, what,
                     "a peer did not reach the IPC all-reduce within the timeout: it is gone or "
                     "stuck (LF_NCCL_TIMEOUT_S)");
    if (e == cudaSuccess) return LF_OK;
    if (e != cudaErrorNotReady) return nc_fail(c, __FILE__, __LINE__, what, cudaGetErrorString(e));
    ncclResult_t a = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(m->comm, &a);
    if (q != ncclSuccess || (a != ncclSuccess && a != ncclInProgress)) {
      char why[320];
      const char *last = ncclGetLastError(m->comm);
      snprintf(why, sizeof why, "NCCL async error: %s%s%s",
               ncclGetErrorString(q != ncclSuccess ? q : a), last && *last ? ": " : "",
               last ? last : "");
      return nc_fail(c, __FILE__, __LINE__, what, why);
    }
    if (timeout > 0 && lf_now_s() - t0 > timeout) {
      char why[160];
      snprintf(why, sizeof why,
               "no completion after %.0f s: a peer rank is gone or stuck (LF_NCCL_TIMEOUT_S)",
               timeout);
      return nc_fail(c, __FILE__, __LINE__, what, why);
    }
    nc_pause(t0);
  }
}

static ncclDataType_t nc_type(lf_comm_dtype t) {
  switch (t) {
  case LF_COMM_F32: return ncclFloat32;
  case LF_COMM_BF16: return ncclBfloat16;
  case LF_COMM_I32: return ncclInt32;
  }
  return ncclInt8;
}

/* Host path: the staging buffer holds at least `bytes`; the device is the communicator's. */
static lf_status nc_host_begin(lf_comm_t c, size_t bytes) {
  nccl_impl *m = c->impl;
  if (m->failed) return nc_dead(c);
  LF_NC_CUDA_CHECK(c, cudaSetDevice(m->dev));
  if (bytes <= m->stage_bytes) return LF_OK;
  size_t want = m->stage_bytes ? m->stage_bytes : 4096;
  while (want < bytes) want *= 2;
  if (m->stage) LF_NC_CUDA_CHECK(c, cudaFree(m->stage)); /* the stream is idle between calls */
  m->stage = NULL;
  m->stage_bytes = 0;
  if (cudaMalloc(&m->stage, want) != cudaSuccess) {
    cudaGetLastError();
    return lf_error(LF_ERR_OUT_OF_MEMORY, "rank %d: NCCL staging buffer of %zu bytes", c->rank,
                    want);
  }
  m->stage_bytes = want;
  return LF_OK;
}

static double nc_host_timeout(const nccl_impl *m) {
  return 10.0 * m->timeout_s;
}

static lf_status nc_allreduce(lf_comm_t c, void *buf, size_t n, lf_comm_dtype t, void *stream) {
  nccl_impl *m = c->impl;
  if (n == 0) return LF_OK;
  if (stream) {
    if (m->failed) return nc_dead(c);
    /* small fp32/bf16 messages: the one-shot IPC kernel (the choice depends only on the size,
     * type and alignment, the same on every rank) */
    if (m->ar && (t == LF_COMM_F32 || t == LF_COMM_BF16) &&
        lf_ar_ipc_fits(m->ar, buf, n * lf_comm_dtype_size(t)))
      return lf_ar_ipc_run(m->ar, buf, n, t == LF_COMM_BF16, stream);
    LF_NCCL_CHECK(c, ncclAllReduce(buf, buf, n, nc_type(t), ncclSum, m->comm,
                                   (cudaStream_t)stream), m->timeout_s);
    return LF_OK;
  }
  const size_t b = n * lf_comm_dtype_size(t);
  LF_TRY(nc_host_begin(c, b));
  LF_NC_CUDA_CHECK(c, cudaMemcpyAsync(m->stage, buf, b, cudaMemcpyHostToDevice, m->hstream));
  LF_NCCL_CHECK(c, ncclAllReduce(m->stage, m->stage, n, nc_type(t), ncclSum, m->comm, m->hstream),
                nc_host_timeout(m));
  LF_TRY(nc_wait(c, m->hstream, nc_host_timeout(m), "host all-reduce"));
  LF_NC_CUDA_CHECK(c, cudaMemcpyAsync(buf, m->stage, b, cudaMemcpyDeviceToHost, m->hstream));
  return nc_wait(c, m->hstream, m->timeout_s, "host all-reduce copy");
}

static lf_status nc_allgather(lf_comm_t c, const void *send, void *recv, size_t n,
                              lf_comm_dtype t, void *stream) {
  nccl_impl *m = c->impl;
  if (n == 0) return LF_OK;
  if (stream) {
    LF_NCCL_CHECK(c, ncclAllGather(send, recv, n, nc_type(t), m->comm, (cudaStream_t)stream),
                  m->timeout_s);
    return LF_OK;
  }
  const size_t b = n * lf_comm_dtype_size(t), all = b * (size_t)c->size;
  LF_TRY(nc_host_begin(c, all));
  char *st = m->stage;
  /* in place: this rank's part sits at its own offset of the result */
  LF_NC_CUDA_CHECK(c, cudaMemcpyAsync(st + b * (size_t)c->rank, send, b, cudaMemcpyHostToDevice,
                                      m->hstream));
  LF_NCCL_CHECK(c, ncclAllGather(st + b * (size_t)c->rank, st, n, nc_type(t), m->comm,
                                 m->hstream), nc_host_timeout(m));
  LF_TRY(nc_wait(c, m->hstream, nc_host_timeout(m), "host all-gather"));
  LF_NC_CUDA_CHECK(c, cudaMemcpyAsync(recv, st, all, cudaMemcpyDeviceToHost, m->hstream));
  return nc_wait(c, m->hstream, m->timeout_s, "host all-gather copy");
}

static lf_status nc_bcast(lf_comm_t c, void *buf, size_t bytes, int root, void *stream) {
  nccl_impl *m = c->impl;
  if (root < 0 || root >= c->size)
    return lf_error(LF_ERR_INVALID_ARG, "rank %d: bcast root %d of %d ranks", c->rank, root,
                    c->size);
  if (bytes == 0) return LF_OK;
  if (stream) {
    LF_NCCL_CHECK(c, ncclBroadcast(buf, buf, bytes, ncclUint8, root, m->comm,
                                   (cudaStream_t)stream), m->timeout_s);
    return LF_OK;
  }
  if (m->host) { /* the step descriptor: host memory to host memory, no device round trip */
    if (m->failed) return nc_dead(c);
    return m->host->bcast(m->host, buf, bytes, root, NULL);
  }
  LF_TRY(nc_host_begin(c, bytes));
  if (c->rank == root)
    LF_NC_CUDA_CHECK(c, cudaMemcpyAsync(m->stage, buf, bytes, cudaMemcpyHostToDevice, m->hstream));
  LF_NCCL_CHECK(c, ncclBroadcast(m->stage, m->stage, bytes, ncclUint8, root, m->comm, m->hstream),
                m->timeout_s);
  /* A non-root rank may be a follower idling until the next request: no deadline. */
  LF_TRY(nc_wait(c, m->hstream, c->rank == root ? m->timeout_s : 0.0, "host broadcast"));
  if (c->rank != root)
    LF_NC_CUDA_CHECK(c, cudaMemcpyAsync(buf, m->stage, bytes, cudaMemcpyDeviceToHost, m->hstream));
  return nc_wait(c, m->hstream, m->timeout_s, "host broadcast copy");
}

static lf_status nc_barrier(lf_comm_t c) {
  int32_t one = 1;
  return nc_allreduce(c, &one, 1, LF_COMM_I32, NULL);
}

static lf_status nc_sync(lf_comm_t c, void *stream) {
  nccl_impl *m = c->impl;
  return nc_wait(c, stream ? (cudaStream_t)stream : m->hstream, m->timeout_s, "stream wait");
}

static void nc_destroy(lf_comm_t c) {
  nccl_impl *m = c->impl;
  if (m) {
    if (!m->failed) cudaSetDevice(m->dev);
    if (m->hstream && !m->failed) nc_wait(c, m->hstream, m->timeout_s, "free");
    if (m->owned && !m->failed && m->comm) {
      /* finalize flushes outstanding work; a peer that is gone makes it fail: then abort */
      if (nc_settle(c, ncclCommFinalize(m->comm), m->timeout_s, __FILE__, __LINE__,
                    "ncclCommFinalize") == LF_OK)
        ncclCommDestroy(m->comm);
    }
    /* behind an abandoned abort a kernel may still spin: freeing could block, so leak */
    const int dev_ok = !m->failed || m->aborted;
    lf_ar_ipc_free(m->ar, dev_ok);
    if (m->host) lf_comm_free(m->host);
    if (m->stage && dev_ok) cudaFree(m->stage);
    if (m->hstream && dev_ok) cudaStreamDestroy(m->hstream);
    free(m);
  }
  free(c);
}

lf_status lf_comm_nccl_set_host(lf_comm_t c, lf_comm_t host) {
  if (!c || !host || strcmp(c->kind, "nccl") || host->rank != c->rank || host->size != c->size)
    return lf_error(LF_ERR_INVALID_ARG, "lf_comm_nccl_set_host: not an NCCL communicator with a "
                                        "host communicator of the same ranks");
  nccl_impl *m = c->impl;
  if (m->host) lf_comm_free(m->host);
  m->host = host;
  return LF_OK;
}

double lf_comm_nccl_timeout(const struct lf_comm *c) {
  return c && c->kind && !strcmp(c->kind, "nccl") ? ((const nccl_impl *)c->impl)->timeout_s : 0.0;
}

lf_status lf_comm_nccl_unique_id(void *unique_id) {
  if (!unique_id) return lf_error(LF_ERR_INVALID_ARG, "lf_comm_nccl_unique_id: NULL argument");
  const ncclResult_t r = ncclGetUniqueId((ncclUniqueId *)unique_id);
  if (r != ncclSuccess)
    return lf_error(LF_ERR_BACKEND, "%s:%d: ncclGetUniqueId: %s", __FILE__, __LINE__,
                    ncclGetErrorString(r));
  return LF_OK;
}

/* timeout_s, or (0) the tuning's LF_NCCL_TIMEOUT_S, default 60 s. */
static double nc_default_timeout(double timeout_s, const lf_tuning *tu) {
  return timeout_s > 0 ? timeout_s : tu->nccl_timeout_s;
}

/* The IPC all-reduce (ar_ipc.h) when every rank can take part: each allocates its region and
 * publishes a record, all records are gathered, each maps its peers, and all must succeed
 * (else every rank keeps NCCL). On unless LF_CUSTOM_AR=0 (faster than NCCL below 1 MB:
 * bench/RESULTS.md). LF_CUSTOM_AR_BYTES
 * sets the largest message it takes (default 8 MiB: beyond that NCCL's bandwidth wins anyway).
 * Only a communicator failure is an error. */
static lf_status nc_ar_setup(lf_comm_t c, const lf_tuning *tu) {
  nccl_impl *m = c->impl;
  if (c->size < 2 || c->size > LF_AR_MAX_RANKS || !tu->custom_ar) return LF_OK;
  int timing = 0;
#ifdef LF_BENCH_INSTRUMENTS
  timing = tu->ar_timing;
#endif
  lf_ar_record rec;
  lf_ar_ipc *a = NULL;
  (void)lf_ar_ipc_prepare(tu->custom_ar_bytes, m->timeout_s, timing, &a,
                          &rec); /* rec.ok = 0 on failure */
  lf_ar_record *all = (lf_ar_record *)calloc((size_t)c->size, sizeof *all);
  if (!all) {
    lf_ar_ipc_free(a, 1);
    return lf_error(LF_ERR_OUT_OF_MEMORY, "IPC all-reduce records");
  }
  lf_status s = nc_allgather(c, &rec, all, sizeof rec / 4, LF_COMM_I32, NULL);
  int32_t ok = s == LF_OK && a && lf_ar_ipc_attach(a, c->rank, c->size, all) == LF_OK;
  free(all);
  if (s == LF_OK) s = nc_allreduce(c, &ok, 1, LF_COMM_I32, NULL);
  if (s == LF_OK && ok == c->size) {
    m->ar = a;
    c->ipc = a;
  } else {
    lf_ar_ipc_free(a, 1);
  }
  return s;
}

lf_status lf_comm_init_nccl(void *nccl_comm, const void *unique_id, int rank, int size,
                            double timeout_s, lf_comm_t *out) {
  if (!out) return lf_error(LF_ERR_INVALID_ARG, "lf_comm_init_nccl: NULL argument");
  *out = NULL;
  if (!nccl_comm && (!unique_id || size < 1 || rank < 0 || rank >= size))
    return lf_error(LF_ERR_INVALID_ARG, "lf_comm_init_nccl: rank %d of %d%s", rank, size,
                    unique_id ? "" : " without a unique id");
  static const struct lf_comm proto = {.kind = "nccl", .device = 1, .allreduce_sum = nc_allreduce,
                                       .allgather = nc_allgather, .bcast = nc_bcast,
                                       .barrier = nc_barrier, .sync = nc_sync,
                                       .destroy = nc_destroy};
  lf_comm_t c;
  LF_TRY(lf_comm_new(&proto, sizeof(nccl_impl), &c));
  nccl_impl *m = c->impl;
  c->rank = rank;
  c->size = size;
  lf_tuning tu;
  lf_tuning_read(&tu);
  m->timeout_s = nc_default_timeout(timeout_s, &tu);
  lf_status s = LF_OK;
  if (nccl_comm) {
    m->comm = (ncclComm_t)nccl_comm;
    ncclResult_t r = ncclCommUserRank(m->comm, &c->rank);
    if (r == ncclSuccess) r = ncclCommCount(m->comm, &c->size);
    if (r == ncclSuccess) r = ncclCommCuDevice(m->comm, &m->dev);
    if (r != ncclSuccess)
      s = lf_error(LF_ERR_INVALID_ARG, "lf_comm_init_nccl: the given ncclComm_t: %s",
                   ncclGetErrorString(r));
  } else {
    m->owned = 1;
    if (cudaGetDevice(&m->dev) != cudaSuccess) {
      s = lf_error(LF_ERR_UNAVAILABLE, "rank %d: lf_comm_init_nccl: no current CUDA device: %s",
                   rank, cudaGetErrorString(cudaGetLastError()));
    } else {
      ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
      cfg.blocking = 0; /* every wait is ours, with a deadline (see the top of this file) */
      ncclUniqueId id;
      memcpy(&id, unique_id, sizeof id);
      /* m->comm is set by the call even while it is in progress */
      const ncclResult_t r = ncclCommInitRankConfig(&m->comm, size, id, rank, &cfg);
      s = nc_settle(c, r, nc_host_timeout(m), __FILE__, __LINE__, "ncclCommInitRankConfig");
    }
  }
  if (s == LF_OK && cudaSetDevice(m->dev) != cudaSuccess)
    s = lf_error(LF_ERR_BACKEND, "rank %d: cudaSetDevice(%d): %s", c->rank, m->dev,
                 cudaGetErrorString(cudaGetLastError()));
  if (s == LF_OK && cudaStreamCreateWithFlags(&m->hstream, cudaStreamNonBlocking) != cudaSuccess)
    s = lf_error(LF_ERR_BACKEND, "rank %d: cudaStreamCreateWithFlags: %s", c->rank,
                 cudaGetErrorString(cudaGetLastError()));
  if (s == LF_OK) s = nc_ar_setup(c, &tu);
  if (s != LF_OK) {
    if (!nccl_comm) m->failed = 1; /* aborted by nc_settle, or never made */
    if (!nccl_comm && m->comm) nc_abort_bounded(m->comm, 3.0);
    m->comm = NULL;
    m->owned = 0;
    nc_destroy(c);
    return s;
  }
  *out = c;
  return LF_OK;
}

lf_status lf_nccl_pick_device(int rank, int local, int *dev) {
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < 1) {
    cudaGetLastError();
    return lf_error(LF_ERR_UNAVAILABLE, "rank %d: no CUDA device visible", rank);
  }
  if (n_dev > 1 && local >= n_dev)
    return lf_error(LF_ERR_INVALID_ARG,
                    "rank %d: local rank %d but only %d GPUs on this node (one rank per GPU)", rank,
                    local, n_dev);
  *dev = n_dev == 1 ? 0 : local;
  if (cudaSetDevice(*dev) != cudaSuccess)
    return lf_error(LF_ERR_BACKEND, "rank %d: cudaSetDevice(%d): %s", rank, *dev,
                    cudaGetErrorString(cudaGetLastError()));
  return LF_OK;
}

/* Bootstrap without MPI (one node): LF_TP_RANK, LF_TP_SIZE, LF_TP_ID_FILE (and optionally
 * LF_TP_LOCAL_RANK, default the rank) from a launcher such as tests/tp_run.sh. Rank 0 writes the
 * NCCL id to the file (a temporary name, then rename, so a reader never sees half of it); the
 * others poll for it. The launcher gives each run a fresh file name. */
lf_status lf_comm_init_nccl_env(double timeout_s, int *device, lf_comm_t *out) {
  if (!out) return lf_error(LF_ERR_INVALID_ARG, "lf_comm_init_nccl_env: NULL argument");
  *out = NULL;
  lf_tuning tu;
  lf_tuning_read(&tu);
  const char *er = tu.tp_rank, *es = tu.tp_size, *ef = tu.tp_id_file, *el = tu.tp_local_rank;
  if (!er || !es || !ef || !*ef)
    return lf_error(LF_ERR_INVALID_ARG,
                    "lf_comm_init_nccl_env: LF_TP_RANK, LF_TP_SIZE and LF_TP_ID_FILE must be set");
  const int rank = atoi(er), size = atoi(es), local = el ? atoi(el) : rank;
  if (size < 1 || rank < 0 || rank >= size || local < 0)
    return lf_error(LF_ERR_INVALID_ARG, "lf_comm_init_nccl_env: rank %d of %d", rank, size);
  int dev = -1;
  LF_TRY(lf_nccl_pick_device(rank, local, &dev));
  unsigned char id[LF_NCCL_ID_BYTES];
  if (rank == 0) {
    LF_TRY(lf_comm_nccl_unique_id(id));
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", ef);
    FILE *f = fopen(tmp, "wb");
    const int ok = f && fwrite(id, 1, sizeof id, f) == sizeof id;
    if (f) fclose(f);
    if (!ok || rename(tmp, ef) != 0)
      return lf_error(LF_ERR_IO, "rank 0: cannot write the NCCL id to %s", ef);
  } else {
    const double t0 = lf_now_s(), limit = 10.0 * nc_default_timeout(timeout_s, &tu);
    for (;;) {
      FILE *f = fopen(ef, "rb");
      const int ok = f && fread(id, 1, sizeof id, f) == sizeof id;
      if (f) fclose(f);
      if (ok) break;
      if (lf_now_s() - t0 > limit)
        return lf_error(LF_ERR_BACKEND, "rank %d: no NCCL id in %s after %.0f s", rank, ef, limit);
      struct timespec ts = {0, 10000000};
      nanosleep(&ts, NULL);
    }
  }
  LF_TRY(lf_comm_init_nccl(NULL, id, rank, size, timeout_s, out));
  if (device) *device = dev;
  return LF_OK;
}

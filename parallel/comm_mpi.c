/* The MPI communicator (CPU ranks). bf16 sums go through a user-defined MPI op that adds in
 * fp32 and rounds once per element, so every rank gets bit-identical results. */
#include <mpi.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm.h"
#include "base/clock.h"
#include "base/error.h"
#include "base/bf16.h"

typedef struct mpi_impl {
  MPI_Comm comm;
  MPI_Op bf16_sum;
  double root_timeout_s; /* > 0: a broadcast's root gives up after this (lf_comm_mpi_set_timeout) */
} mpi_impl;


/* Logs rank, file:line and the statement, then returns the error up. */
#define LF_MPI_CHECK(c, stmt)                                                                      \
  do {                                                                                             \
    int lf_mpi_rc_ = (stmt);                                                                       \
    if (lf_mpi_rc_ != MPI_SUCCESS) {                                                               \
      char lf_mpi_msg_[MPI_MAX_ERROR_STRING];                                                      \
      int lf_mpi_len_ = 0;                                                                         \
      MPI_Error_string(lf_mpi_rc_, lf_mpi_msg_, &lf_mpi_len_);                                     \
      return lf_error(LF_ERR_BACKEND, "rank %d: %s:%d: %s: %s", (c)->rank, __FILE__, __LINE__,    \
                      #stmt, lf_mpi_msg_);                                                         \
    }                                                                                              \
  } while (0)

static void bf16_sum_op(void *in, void *inout, int *len, MPI_Datatype *dt) {
  (void)dt;
  const uint16_t *a = in;
  uint16_t *b = inout;
  for (int i = 0; i < *len; i++) b[i] = lf_f32_to_bf16(lf_bf16_to_f32(a[i]) + lf_bf16_to_f32(b[i]));
}

static MPI_Datatype mpi_type(lf_comm_dtype t) {
  switch (t) {
  case LF_COMM_F32: return MPI_FLOAT;
  case LF_COMM_BF16: return MPI_UINT16_T;
  case LF_COMM_I32: return MPI_INT32_T;
  }
  return MPI_DATATYPE_NULL;
}

static lf_status check_count(lf_comm_t c, size_t n) {
  if (n > (size_t)INT32_MAX)
    return lf_error(LF_ERR_INVALID_ARG, "rank %d: collective of %zu elements exceeds MPI's int "
                                        "count", c->rank, n);
  return LF_OK;
}

static lf_status mpi_allreduce(lf_comm_t c, void *buf, size_t n, lf_comm_dtype t, void *stream) {
  (void)stream;
  mpi_impl *m = c->impl;
  LF_TRY(check_count(c, n));
  MPI_Op op = t == LF_COMM_BF16 ? m->bf16_sum : MPI_SUM;
  LF_MPI_CHECK(c, MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, mpi_type(t), op, m->comm));
  return LF_OK;
}

static lf_status mpi_allgather(lf_comm_t c, const void *send, void *recv, size_t n,
                               lf_comm_dtype t, void *stream) {
  (void)stream;
  mpi_impl *m = c->impl;
  LF_TRY(check_count(c, n));
  LF_MPI_CHECK(c, MPI_Allgather(send, (int)n, mpi_type(t), recv, (int)n, mpi_type(t), m->comm));
  return LF_OK;
}

static lf_status mpi_bcast(lf_comm_t c, void *buf, size_t bytes, int root, void *stream) {
  (void)stream;
  mpi_impl *m = c->impl;
  LF_TRY(check_count(c, bytes));
  if (root < 0 || root >= c->size)
    return lf_error(LF_ERR_INVALID_ARG, "rank %d: bcast root %d of %d ranks", c->rank, root,
                    c->size);
  /* A follower waits here for rank 0's next step descriptor, possibly for a long idle time;
   * a blocking MPI_Bcast busy-polls a core all that while. Poll a non-blocking broadcast
   * instead: for 20 ms, yielding between polls (the lead's host work between two steps,
   * scheduling and HTTP included, stays inside that, and a follower asleep would wake up late
   * every step; ranks oversubscribed on few cores lose no time to the yielding either), then
   * sleep with a backoff capped at 1 ms, which is all an idle server adds to its first step. */
  MPI_Request req;
  LF_MPI_CHECK(c, MPI_Ibcast(buf, (int)bytes, MPI_BYTE, root, m->comm, &req));
  /* The root has a deadline (when set): a message too large to go eagerly completes only once
   * every peer takes it, and a peer that is stuck must make the root fail, not wait forever.
   * (The request is left behind: the job is failing.) Followers keep none: they idle here. */
  const double t0 = lf_now_s();
  const double deadline = c->rank == root && m->root_timeout_s > 0 ? t0 + m->root_timeout_s : 0.0;
  long sleep_ns = 0;
  for (int spins = 0;; spins++) {
    int done = 0;
    LF_MPI_CHECK(c, MPI_Test(&req, &done, MPI_STATUS_IGNORE));
    if (done) break;
    if (deadline > 0 && (spins & 255) == 0 && lf_now_s() > deadline)
      return lf_error(LF_ERR_BACKEND,
                      "rank %d: broadcast of %zu bytes: a peer did not take it within %.0f s: it "
                      "is gone or stuck",
                      c->rank, bytes, m->root_timeout_s);
    if (lf_now_s() - t0 < 0.02) {
      if (spins >= 64) sched_yield(); /* a few polls flat out, then let the others run */
      continue;
    }
    sleep_ns = sleep_ns ? (sleep_ns * 2 > 1000000 ? 1000000 : sleep_ns * 2) : 20000;
    struct timespec ts = {0, sleep_ns};
    nanosleep(&ts, NULL);
  }
  return LF_OK;
}

static lf_status mpi_barrier(lf_comm_t c) {
  LF_MPI_CHECK(c, MPI_Barrier(((mpi_impl *)c->impl)->comm));
  return LF_OK;
}

static void mpi_destroy(lf_comm_t c) {
  mpi_impl *m = c->impl;
  if (m) {
    MPI_Op_free(&m->bf16_sum);
    MPI_Comm_free(&m->comm);
    free(m);
  }
  free(c);
}

lf_status lf_comm_mpi_set_timeout(lf_comm_t c, double root_timeout_s) {
  if (!c || !c->kind || strcmp(c->kind, "mpi") || !(root_timeout_s >= 0))
    return lf_error(LF_ERR_INVALID_ARG, "lf_comm_mpi_set_timeout: not an MPI communicator or a "
                                        "negative timeout");
  ((mpi_impl *)c->impl)->root_timeout_s = root_timeout_s;
  return LF_OK;
}

/* A communicator over a duplicate of `parent` (an MPI_Comm *). */
lf_status lf_comm_init_mpi_on(const void *parent, lf_comm_t *out) {
  if (!parent || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_comm_init_mpi_on: NULL argument");
  *out = NULL;
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited) return lf_error(LF_ERR_STATE, "lf_comm_init_mpi: MPI_Init has not been called");
  static const struct lf_comm proto = {.kind = "mpi", .allreduce_sum = mpi_allreduce,
                                       .allgather = mpi_allgather, .bcast = mpi_bcast,
                                       .barrier = mpi_barrier, .destroy = mpi_destroy};
  lf_comm_t c;
  LF_TRY(lf_comm_new(&proto, sizeof(mpi_impl), &c));
  mpi_impl *m = c->impl;
  /* Errors come back as codes so a failing collective becomes an lf_status, not an abort. */
  int rc = MPI_Comm_dup(*(const MPI_Comm *)parent, &m->comm);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(m->comm, &c->rank);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(m->comm, &c->size);
  if (rc == MPI_SUCCESS) rc = MPI_Op_create(bf16_sum_op, 1, &m->bf16_sum);
  if (rc != MPI_SUCCESS) {
    free(m);
    free(c);
    return lf_error(LF_ERR_BACKEND, "MPI communicator setup failed (code %d)", rc);
  }
  *out = c;
  return LF_OK;
}

lf_status lf_comm_init_mpi(lf_comm_t *out) {
  MPI_Comm world = MPI_COMM_WORLD;
  return lf_comm_init_mpi_on(&world, out);
}

lf_status lf_comm_init_mpi_color(int color, lf_comm_t *out) {
  if (!out) return lf_error(LF_ERR_INVALID_ARG, "lf_comm_init_mpi_color: NULL argument");
  *out = NULL;
  if (color < 0) return lf_error(LF_ERR_INVALID_ARG, "lf_comm_init_mpi_color: color %d < 0", color);
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited) return lf_error(LF_ERR_STATE, "lf_comm_init_mpi_color: MPI_Init has not been called");
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm g;
  if (MPI_Comm_split(MPI_COMM_WORLD, color, rank, &g) != MPI_SUCCESS)
    return lf_error(LF_ERR_BACKEND, "rank %d: lf_comm_init_mpi_color: MPI_Comm_split failed", rank);
  const lf_status s = lf_comm_init_mpi_on(&g, out);
  MPI_Comm_free(&g);
  return s;
}

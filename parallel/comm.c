#include "comm.h"

#include <stdlib.h>
#include <string.h>

#include "engine/error.h"

size_t lf_comm_dtype_size(lf_comm_dtype t) {
  switch (t) {
  case LF_COMM_F32: return 4;
  case LF_COMM_BF16: return 2;
  case LF_COMM_I32: return 4;
  }
  return 0;
}

static lf_status local_allreduce(lf_comm_t c, void *buf, size_t n, lf_comm_dtype t, void *stream) {
  (void)c, (void)buf, (void)n, (void)t, (void)stream;
  return LF_OK;
}

static lf_status local_allgather(lf_comm_t c, const void *send, void *recv, size_t n,
                                 lf_comm_dtype t, void *stream) {
  (void)c, (void)stream;
  if (send != recv) memmove(recv, send, n * lf_comm_dtype_size(t));
  return LF_OK;
}

static lf_status local_bcast(lf_comm_t c, void *buf, size_t bytes, int root, void *stream) {
  (void)c, (void)buf, (void)bytes, (void)stream;
  if (root != 0) return lf_error(LF_ERR_INVALID_ARG, "bcast root %d on a single rank", root);
  return LF_OK;
}

static lf_status local_barrier(lf_comm_t c) {
  (void)c;
  return LF_OK;
}

static void local_destroy(lf_comm_t c) {
  free(c);
}

lf_status lf_comm_init_local(lf_comm_t *out) {
  lf_comm_t c = calloc(1, sizeof *c);
  if (!c) return lf_error(LF_ERR_OUT_OF_MEMORY, "communicator");
  c->rank = 0;
  c->size = 1;
  c->kind = "local";
  c->allreduce_sum = local_allreduce;
  c->allgather = local_allgather;
  c->bcast = local_bcast;
  c->barrier = local_barrier;
  c->destroy = local_destroy;
  *out = c;
  return LF_OK;
}

void lf_comm_free(lf_comm_t c) {
  if (c) c->destroy(c);
}

int lf_comm_rank(lf_comm_t c) {
  return c ? c->rank : 0;
}

int lf_comm_size(lf_comm_t c) {
  return c ? c->size : 1;
}

#ifndef LF_HAVE_MPI
lf_status lf_comm_init_mpi(lf_comm_t *out) {
  if (out) *out = NULL;
  return lf_error(LF_ERR_UNAVAILABLE, "lf_comm_init_mpi: this build has no MPI (LF_MPI=OFF)");
}
#endif

#include "comm.h"

#include <stdlib.h>
#include <string.h>

#include "base/error.h"

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

lf_status lf_comm_new(const struct lf_comm *proto, size_t impl_bytes, lf_comm_t *out) {
  lf_comm_t c = calloc(1, sizeof *c);
  void *impl = impl_bytes ? calloc(1, impl_bytes) : NULL;
  if (!c || (impl_bytes && !impl)) {
    free(c);
    free(impl);
    return lf_error(LF_ERR_OUT_OF_MEMORY, "communicator");
  }
  *c = *proto;
  c->rank = c->size = 0;
  c->impl = impl;
  *out = c;
  return LF_OK;
}

lf_status lf_comm_init_local(lf_comm_t *out) {
  static const struct lf_comm local = {.kind = "local", .allreduce_sum = local_allreduce,
                                       .allgather = local_allgather, .bcast = local_bcast,
                                       .barrier = local_barrier, .destroy = local_destroy};
  LF_TRY(lf_comm_new(&local, 0, out));
  (*out)->size = 1;
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

lf_status lf_comm_sync(lf_comm_t c, void *stream) {
  return c && c->sync ? c->sync(c, stream) : LF_OK;
}

#ifndef LF_HAVE_NCCL
lf_status lf_comm_nccl_unique_id(void *unique_id) {
  (void)unique_id;
  return lf_error(LF_ERR_UNAVAILABLE, "lf_comm_nccl_unique_id: this build has no NCCL");
}

lf_status lf_comm_init_nccl(void *nccl_comm, const void *unique_id, int rank, int size,
                            double timeout_s, lf_comm_t *out) {
  (void)nccl_comm, (void)unique_id, (void)rank, (void)size, (void)timeout_s;
  if (out) *out = NULL;
  return lf_error(LF_ERR_UNAVAILABLE, "lf_comm_init_nccl: this build has no NCCL (needs LF_CUDA "
                                      "and nccl.h / libnccl at configure time)");
}

lf_status lf_comm_init_nccl_env(double timeout_s, int *device, lf_comm_t *out) {
  (void)timeout_s, (void)device;
  if (out) *out = NULL;
  return lf_error(LF_ERR_UNAVAILABLE, "lf_comm_init_nccl_env: this build has no NCCL");
}
#endif

#if !defined(LF_HAVE_NCCL) || !defined(LF_HAVE_MPI)
lf_status lf_comm_init_nccl_mpi(double timeout_s, int *device, lf_comm_t *out) {
  return lf_comm_init_nccl_mpi_color(0, timeout_s, device, out);
}

lf_status lf_comm_init_nccl_mpi_color(int color, double timeout_s, int *device, lf_comm_t *out) {
  (void)color, (void)timeout_s, (void)device;
  if (out) *out = NULL;
  return lf_error(LF_ERR_UNAVAILABLE, "lf_comm_init_nccl_mpi: this build lacks %s",
#ifdef LF_HAVE_MPI
                  "NCCL"
#else
                  "MPI"
#endif
  );
}
#endif

#ifndef LF_HAVE_MPI
lf_status lf_comm_init_mpi(lf_comm_t *out) {
  if (out) *out = NULL;
  return lf_error(LF_ERR_UNAVAILABLE, "lf_comm_init_mpi: this build has no MPI (LF_MPI=OFF)");
}

lf_status lf_comm_init_mpi_color(int color, lf_comm_t *out) {
  (void)color;
  if (out) *out = NULL;
  return lf_error(LF_ERR_UNAVAILABLE, "lf_comm_init_mpi_color: this build has no MPI (LF_MPI=OFF)");
}
#endif

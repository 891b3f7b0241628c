/* Communicators for tensor parallelism: one interface, an MPI implementation for CPU ranks, an
 * NCCL one for GPUs (parallel/comm_nccl.c), and a single-rank one.
 *
 * The core library only sees lf_comm; MPI lives in parallel/ and launch/ so a stack without MPI
 * can pass its own communicator. Collectives are blocking for the CPU implementations; the
 * `stream` argument is for device implementations (a cudaStream_t), NULL on the host.
 */
#ifndef LF_COMM_H
#define LF_COMM_H

#include <stddef.h>

#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum lf_comm_dtype { LF_COMM_F32 = 0, LF_COMM_BF16, LF_COMM_I32 } lf_comm_dtype;

size_t lf_comm_dtype_size(lf_comm_dtype t);

struct lf_comm {
  int rank, size;
  const char *kind; /* "local", "mpi", "nccl" */
  /* buf [n] summed over ranks, in place. */
  lf_status (*allreduce_sum)(struct lf_comm *c, void *buf, size_t n, lf_comm_dtype t,
                             void *stream);
  /* recv [size][n] = every rank's send [n], in rank order. */
  lf_status (*allgather)(struct lf_comm *c, const void *send, void *recv, size_t n,
                         lf_comm_dtype t, void *stream);
  /* bytes of buf from rank root to all. */
  lf_status (*bcast)(struct lf_comm *c, void *buf, size_t bytes, int root, void *stream);
  lf_status (*barrier)(struct lf_comm *c);
  void (*destroy)(struct lf_comm *c);
  void *impl;
  /* Device communicators (NCCL) only; zero / NULL for the host ones.
   * device: 1 when a non-NULL `stream` means device buffers and stream-ordered collectives
   *   (the call enqueues and returns; the result is there once the stream gets past it). A NULL
   *   stream still means host buffers and a blocking call, so parallel/tp.c's descriptor
   *   broadcast and the engine's start-up agreement work unchanged on any communicator.
   * sync: waits until everything queued on `stream` (collectives included) has finished, or
   *   fails within the communicator's timeout (LF_ERR_BACKEND, the communicator aborted) when
   *   a peer is gone. A device backend calls it where it would call cudaStreamSynchronize. */
  int device;
  lf_status (*sync)(struct lf_comm *c, void *stream);
  /* The one-shot IPC all-reduce of this communicator's GPUs (parallel/ar_ipc.h) when every rank
   * set it up (NCCL, unless LF_CUSTOM_AR=0), else NULL: the CUDA backend's fused residual
   * all-reduce. */
  struct lf_ar_ipc *ipc;
};

/* A new communicator for an implementation's init: a copy of proto (its kind, device flag and
 * operations; rank and size 0) whose impl is impl_bytes of zeroed state (NULL for 0).
 * LF_ERR_OUT_OF_MEMORY when either allocation fails (nothing is left allocated). */
lf_status lf_comm_new(const struct lf_comm *proto, size_t impl_bytes, struct lf_comm **out);

/* comm->sync when the communicator has one; LF_OK otherwise (host communicators block). */
lf_status lf_comm_sync(struct lf_comm *c, void *stream);

/* NCCL (parallel/comm_nccl.c, built with LF_HAVE_NCCL): lf_comm_init_nccl, lf_comm_nccl_unique_id
 * and, under MPI, lf_comm_init_nccl_mpi (parallel/bootstrap_mpi.c) are public: include/lfserve.h.
 * Inside the library, bytes of an ncclUniqueId: */
#define LF_NCCL_ID_BYTES 128

/* NCCL bootstraps (built with LF_HAVE_NCCL): makes the CUDA device of node-local rank `local`
 * current (device 0 when only one is visible) and sets *dev to it. */
lf_status lf_nccl_pick_device(int rank, int local, int *dev);

/* Host-buffer broadcasts of NCCL communicator c (the step descriptor, parallel/tp.c) go through
 * host (same ranks, e.g. MPI) instead of a device round trip through NCCL; c owns host from then
 * on. lf_comm_init_nccl_mpi sets an MPI one. */
lf_status lf_comm_nccl_set_host(struct lf_comm *c, struct lf_comm *host);
/* The NCCL communicator's deadline for its waits, in seconds (LF_NCCL_TIMEOUT_S resolved). */
double lf_comm_nccl_timeout(const struct lf_comm *c);

/* MPI communicators (parallel/comm_mpi.c): a broadcast's root gives up with LF_ERR_BACKEND after
 * root_timeout_s (0, the default: never) when a peer does not take the message. */
lf_status lf_comm_mpi_set_timeout(struct lf_comm *c, double root_timeout_s);

/* MPI (parallel/comm_mpi.c): a communicator over a duplicate of *(MPI_Comm *)parent, so
 * callers without mpi.h can pass one through (lf_comm_init_mpi_color and the NCCL bootstrap's
 * host communicator use it). */
lf_status lf_comm_init_mpi_on(const void *parent, struct lf_comm **out);

/* lf_comm_init_local, lf_comm_init_mpi (over MPI_COMM_WORLD, duplicated; MPI must be initialised
 * by the caller; LF_ERR_UNAVAILABLE without MPI), lf_comm_free, lf_comm_rank and lf_comm_size
 * are public: include/lfserve.h. */

#ifdef __cplusplus
}
#endif
#endif

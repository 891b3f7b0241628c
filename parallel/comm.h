/* Communicators for tensor parallelism: one interface, an MPI implementation for CPU ranks, an
 * NCCL one for GPUs (later), and a single-rank one.
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
};

/* lf_comm_init_local, lf_comm_init_mpi (over MPI_COMM_WORLD, duplicated; MPI must be initialised
 * by the caller; LF_ERR_UNAVAILABLE without MPI), lf_comm_free, lf_comm_rank and lf_comm_size
 * are public: include/lfserve.h. */

#ifdef __cplusplus
}
#endif
#endif

/* Tensor-parallel start-up shared by the programs (lfgen, lfserve): whether a launcher started
 * several ranks, and the communicator each rank gets. MPI starts here, in the programs, never in
 * the library (docs/DESIGN.md §4). */
#ifndef LF_TP_LAUNCH_H
#define LF_TP_LAUNCH_H

#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when a launcher's world-size variable (Open MPI, PMI, PMIx, MPICH; tests/tp_run.sh's
 * LF_TP_SIZE) says more than one rank. */
int lf_launched_multi_rank(void);

/* The communicator of this rank. GPU ranks (backend cuda, or auto in a build with NCCL) get an
 * NCCL communicator (one GPU per local rank) through the MPI bootstrap, or through
 * tests/tp_run.sh's environment; auto falls back to MPI when no rank has a GPU (the bootstrap
 * agrees on that before entering NCCL, so every rank falls back alike); cpu ranks get MPI.
 * Starts MPI when it has not started. */
lf_status lf_tp_start(int *argc, char ***argv, lf_backend_kind backend, lf_comm_t *comm);

/* The same with the ranks split into groups of tp (0: one group of all): rank r is in group
 * (replica) r / tp of size / tp, and *comm spans its group. A world size that tp does not
 * divide is LF_ERR_INVALID_ARG naming the sizes that do. With several groups MPI starts with
 * MPI_THREAD_MULTIPLE (LF_ERR_UNAVAILABLE when the MPI library cannot give it). */
lf_status lf_tp_start_groups(int *argc, char ***argv, lf_backend_kind backend, int tp,
                             lf_comm_t *comm, int *replica, int *n_replicas);

/* After a successful run: frees comm and finalizes MPI where it was started (no-op for NULL).
 * A failed rank skips this and exits: the launcher then ends the job. */
void lf_tp_end(lf_comm_t comm);

#ifdef __cplusplus
}
#endif
#endif

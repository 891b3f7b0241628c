/* Rank bootstrap under mpirun for GPU ranks (docs/DESIGN.md §4), the nccl-tests recipe:
 *
 *   MPI_Init (the caller) -> local rank from an MPI_COMM_TYPE_SHARED split of MPI_COMM_WORLD ->
 *   cudaSetDevice(local rank) -> rank 0 ncclGetUniqueId -> MPI_Bcast of the id ->
 *   ncclCommInitRank (non-blocking, with a deadline: lf_comm_init_nccl).
 *
 * Each step that can fail on one rank alone (no GPU for this local rank, no id) is agreed on
 * with an MPI collective before NCCL is entered, so a rank that cannot start makes every rank
 * return an error instead of leaving the others in ncclCommInitRank. When the launcher shows
 * each rank exactly one GPU (CUDA_VISIBLE_DEVICES set per rank), that GPU is device 0.
 */
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "base/error.h"

lf_status lf_comm_init_nccl_mpi(double timeout_s, int *device, lf_comm_t *out) {
  return lf_comm_init_nccl_mpi_color(0, timeout_s, device, out);
}

static lf_status nccl_on(MPI_Comm g, int local, double timeout_s, int *device, lf_comm_t *out);

lf_status lf_comm_init_nccl_mpi_color(int color, double timeout_s, int *device, lf_comm_t *out) {
  if (!out) return lf_error(LF_ERR_INVALID_ARG, "lf_comm_init_nccl_mpi: NULL argument");
  *out = NULL;
  if (color < 0) return lf_error(LF_ERR_INVALID_ARG, "lf_comm_init_nccl_mpi: color %d < 0", color);
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited) return lf_error(LF_ERR_STATE, "lf_comm_init_nccl_mpi: MPI_Init has not been called");
  /* The node-local rank counts every rank of the job on this host, whatever its group, so the
   * groups that share a host take different GPUs. */
  int wrank = 0, local = 0;
  MPI_Comm node, g;
  if (MPI_Comm_rank(MPI_COMM_WORLD, &wrank) != MPI_SUCCESS ||
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, wrank, MPI_INFO_NULL, &node) !=
          MPI_SUCCESS)
    return lf_error(LF_ERR_BACKEND, "lf_comm_init_nccl_mpi: MPI rank / node split failed");
  MPI_Comm_rank(node, &local);
  MPI_Comm_free(&node);
  if (MPI_Comm_split(MPI_COMM_WORLD, color, wrank, &g) != MPI_SUCCESS)
    return lf_error(LF_ERR_BACKEND, "rank %d: lf_comm_init_nccl_mpi: MPI_Comm_split failed", wrank);
  MPI_Comm_set_errhandler(g, MPI_ERRORS_RETURN);
  const lf_status s = nccl_on(g, local, timeout_s, device, out);
  MPI_Comm_free(&g);
  return s;
}

/* The bootstrap within group g (every collective below is g's: a group that fails never leaves
 * another group's ranks waiting). */
static lf_status nccl_on(MPI_Comm g, int local, double timeout_s, int *device, lf_comm_t *out) {
  int rank = 0, size = 1;
  MPI_Comm_rank(g, &rank);
  MPI_Comm_size(g, &size);

  /* 1. this rank's device */
  int dev = -1;
  lf_status s = lf_nccl_pick_device(rank, local, &dev);
  /* 2. rank 0's id, in one broadcast with rank 0's status */
  unsigned char msg[4 + LF_NCCL_ID_BYTES];
  memset(msg, 0, sizeof msg);
  if (rank == 0) {
    lf_status si = s == LF_OK ? lf_comm_nccl_unique_id(msg + 4) : s;
    int32_t st = (int32_t)si;
    memcpy(msg, &st, 4);
  }
  /* everyone's device status, then the id: both collectives are entered by every rank */
  int bad = s != LF_OK, any_bad = 0;
  if (MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, g) != MPI_SUCCESS ||
      MPI_Bcast(msg, (int)sizeof msg, MPI_BYTE, 0, g) != MPI_SUCCESS)
    return lf_error(LF_ERR_BACKEND, "rank %d: lf_comm_init_nccl_mpi: MPI collective failed", rank);
  if (s != LF_OK) return s;
  int32_t st0;
  memcpy(&st0, msg, 4);
  if (any_bad || st0 != LF_OK)
    return lf_error(LF_ERR_UNAVAILABLE, "rank %d: another rank could not start its GPU or NCCL "
                                        "(see its message)", rank);
  /* 3. the communicator, its host broadcasts (the step descriptor) over MPI: shared memory on
   * one node, instead of a host->device copy, an NCCL broadcast and a device->host copy with a
   * stream wait on each side */
  lf_status sc = lf_comm_init_nccl(NULL, msg + 4, rank, size, timeout_s, out);
  /* agreed by every rank before the next collective (MPI_Comm_dup): the communicator came up
   * everywhere (MPI carries the step descriptor: a host message through NCCL would take a device
   * round trip) */
  int mine = sc == LF_OK, all = 0;
  if (MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, g) != MPI_SUCCESS) all = 0;
  if (!all) {
    if (*out) lf_comm_free(*out);
    *out = NULL;
    return sc != LF_OK ? sc
                       : lf_error(LF_ERR_UNAVAILABLE, "rank %d: another rank could not create "
                                                      "its NCCL communicator (see its message)",
                                  rank);
  }
  {
    lf_comm_t host = NULL;
    lf_status hs = lf_comm_init_mpi_on(&g, &host);
    if (hs != LF_OK) host = NULL;
    /* the lead fails, as with NCCL, when a follower does not take a descriptor in time */
    if (hs == LF_OK) hs = lf_comm_mpi_set_timeout(host, lf_comm_nccl_timeout(*out));
    int hbad = hs != LF_OK, any_hbad = 0; /* every rank the same way, or none */
    if (MPI_Allreduce(&hbad, &any_hbad, 1, MPI_INT, MPI_MAX, g) != MPI_SUCCESS)
      any_hbad = 1;
    if (!any_hbad) hs = lf_comm_nccl_set_host(*out, host);
    if (any_hbad || hs != LF_OK) {
      if (host) lf_comm_free(host);
      lf_comm_free(*out);
      *out = NULL;
      return hs != LF_OK ? hs
                         : lf_error(LF_ERR_BACKEND, "rank %d: another rank could not set up its "
                                                    "MPI host communicator", rank);
    }
  }
  if (device) *device = dev;
  return LF_OK;
}

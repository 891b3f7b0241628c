#include "launch/tp_launch.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef LF_HAVE_MPI
#include <mpi.h>
#endif

#include "base/error.h"

static const char *const size_vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE",
                                        "MPI_LOCALNRANKS", "LF_TP_SIZE"};

int lf_launched_multi_rank(void) {
  for (size_t i = 0; i < sizeof size_vars / sizeof size_vars[0]; i++) {
    const char *v = getenv(size_vars[i]);
    if (v && atoi(v) > 1) return 1;
  }
  return 0;
}

/* The launcher's world size, 0 when no variable says. */
static int launched_size(void) {
  for (size_t i = 0; i < sizeof size_vars / sizeof size_vars[0]; i++) {
    const char *v = getenv(size_vars[i]);
    if (v && atoi(v) > 0) return atoi(v);
  }
  return 0;
}

lf_status lf_tp_start(int *argc, char ***argv, lf_backend_kind backend, lf_comm_t *comm) {
  int replica = 0, n_replicas = 1;
  return lf_tp_start_groups(argc, argv, backend, 0, comm, &replica, &n_replicas);
}

#ifdef LF_HAVE_MPI
/* "1, 2 and 4": the group sizes that divide n ranks. */
static void divisors(int n, char *out, size_t cap) {
  size_t len = 0;
  out[0] = '\0';
  int k = 0, count = 0;
  for (int d = 1; d <= n; d++) count += n % d == 0;
  for (int d = 1; d <= n && len < cap; d++) {
    if (n % d) continue;
    k++;
    len += (size_t)snprintf(out + len, cap - len, "%s%d", k == 1 ? "" : k == count ? " or " : ", ", d);
  }
}
#endif

lf_status lf_tp_start_groups(int *argc, char ***argv, lf_backend_kind backend, int tp,
                             lf_comm_t *comm, int *replica, int *n_replicas) {
  *comm = NULL;
  *replica = 0;
  *n_replicas = 1;
  if (tp < 0) return lf_error(LF_ERR_INVALID_ARG, "--tp %d: must be >= 1", tp);
  /* tests/tp_run.sh (GPU ranks on one node, no MPI): one group */
  if (getenv("LF_TP_RANK") && backend != LF_BACKEND_CPU) {
    if (tp > 0 && launched_size() != tp)
      return lf_error(LF_ERR_UNSUPPORTED, "--tp %d: ranks started without MPI form one group of "
                                          "all %d ranks", tp, launched_size());
    return lf_comm_init_nccl_env(0.0, NULL, comm);
  }
#ifdef LF_HAVE_MPI
  const int env_size = launched_size();
  /* Several groups: lfserve's rank 0 talks to the other replicas from a thread of its own while
   * its engine thread runs its group's collectives, so MPI must allow calls from any thread. */
  const int groups = tp > 0 && (env_size == 0 || tp < env_size);
  int inited = 0, provided = MPI_THREAD_SINGLE;
  MPI_Initialized(&inited);
  if (!inited) {
    if (groups ? MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS
               : MPI_Init(argc, argv) != MPI_SUCCESS)
      return lf_error(LF_ERR_BACKEND, "MPI_Init failed");
  } else {
    MPI_Query_thread(&provided);
  }
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (tp == 0) tp = size;
  if (size % tp) {
    char valid[512];
    divisors(size, valid, sizeof valid);
    return lf_error(LF_ERR_INVALID_ARG, "--tp %d: %d ranks do not split into groups of %d; with "
                                        "%d ranks --tp may be %s (then check that it divides the "
                                        "model's KV heads)", tp, size, tp, size, valid);
  }
  *replica = rank / tp;
  *n_replicas = size / tp;
  if (*n_replicas > 1 && provided < MPI_THREAD_MULTIPLE)
    return lf_error(LF_ERR_UNAVAILABLE, "%d replicas need MPI_THREAD_MULTIPLE, and this MPI "
                                        "provides level %d only", *n_replicas, provided);
  const int color = *n_replicas > 1 ? *replica : 0;
  lf_status s = LF_ERR_UNAVAILABLE;
#ifdef LF_HAVE_NCCL
  if (backend != LF_BACKEND_CPU) {
    s = lf_comm_init_nccl_mpi_color(color, 0.0, NULL, comm);
    if (backend == LF_BACKEND_CUDA) return s;
  }
#endif
  if (*n_replicas > 1) {
    /* Every group fell back to MPI, or none did: the next split spans them all. */
    int fell = s == LF_ERR_UNAVAILABLE, all = 0, any = 0;
    MPI_Allreduce(&fell, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&fell, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (all != any) {
      if (*comm) lf_comm_free(*comm);
      *comm = NULL;
      return lf_error(LF_ERR_UNAVAILABLE, "rank %d: some replicas started GPU ranks and others "
                                          "could not: give --backend cpu or cuda", rank);
    }
  }
  if (s == LF_OK || s != LF_ERR_UNAVAILABLE) return s;
  (void)backend;
  return *n_replicas > 1 ? lf_comm_init_mpi_color(color, comm) : lf_comm_init_mpi(comm);
#else
  (void)argc, (void)argv, (void)backend;
  return lf_comm_init_mpi(comm); /* LF_ERR_UNAVAILABLE with its message */
#endif
}

void lf_tp_end(lf_comm_t comm) {
  if (!comm) return;
  lf_comm_free(comm);
#ifdef LF_HAVE_MPI
  int inited = 0;
  MPI_Initialized(&inited);
  if (inited) MPI_Finalize();
#endif
}

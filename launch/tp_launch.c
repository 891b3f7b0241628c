#include "launch/tp_launch.h"

#include <stdlib.h>
#ifdef LF_HAVE_MPI
#include <mpi.h>
#endif

int lf_launched_multi_rank(void) {
  static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE",
                                     "MPI_LOCALNRANKS", "LF_TP_SIZE"};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
    const char *v = getenv(vars[i]);
    if (v && atoi(v) > 1) return 1;
  }
  return 0;
}

lf_status lf_tp_start(int *argc, char ***argv, lf_backend_kind backend, lf_comm_t *comm) {
  /* tests/tp_run.sh (GPU ranks on one node, no MPI) */
  if (getenv("LF_TP_RANK") && backend != LF_BACKEND_CPU)
    return lf_comm_init_nccl_env(0.0, NULL, comm);
#ifdef LF_HAVE_MPI
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited && MPI_Init(argc, argv) != MPI_SUCCESS) return LF_ERR_BACKEND;
#ifdef LF_HAVE_NCCL
  if (backend != LF_BACKEND_CPU) {
    const lf_status s = lf_comm_init_nccl_mpi(0.0, NULL, comm);
    if (s == LF_OK || backend == LF_BACKEND_CUDA || s != LF_ERR_UNAVAILABLE) return s;
  }
#endif
  (void)backend;
  return lf_comm_init_mpi(comm);
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

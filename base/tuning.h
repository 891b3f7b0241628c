/* The operator controls of the library, read from the environment in one place.
 *
 * lf_tuning_read() is the library's only reader of the environment: the cuda backend calls it
 * once at creation and the NCCL communicator once at its creation; everything below them (kernels,
 * the all-reduce) gets the values passed in. Programs (launch/, bench/) may read their own
 * variables. Every setting is documented in README.md (Environment settings).
 */
#ifndef LF_TUNING_H
#define LF_TUNING_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lf_tuning {
  /* cuda backend */
  int cuda_graphs;      /* LF_CUDA_GRAPHS=0: no CUDA-graph replay of the decode step (1) */
  int cuda_graphs_tp;   /* LF_CUDA_GRAPHS_TP=0: none under tensor parallelism only (1) */
  int graph_cache;      /* LF_CUDA_GRAPH_CACHE=N: decode graphs kept, N >= 1 (64) */
  int pdl;              /* LF_PDL=0: no programmatic dependent launch (1; Hopper only) */
  int pdl_max_rows;     /* LF_PDL_MAX_ROWS=N >= 0: PDL only in passes of at most N rows (-1: the
                           backend's default, 16 under TP and no limit on one GPU) */
  int prefill_chunk;    /* LF_CUDA_PREFILL_CHUNK=N: prompt tokens per prefill chunk, N >= 1 (0:
                           min(context, 2048)) */
  int gemm_tune;        /* LF_CUDA_GEMM_TUNE=0: cuBLAS's default algorithm for every GEMM instead
                           of the one timed per decode shape (1) */
  /* tensor parallelism on GPUs */
  int custom_ar;            /* LF_CUSTOM_AR=0: NCCL for every all-reduce (1: the IPC path) */
  size_t custom_ar_bytes;   /* LF_CUSTOM_AR_BYTES=N: the IPC path's staging bytes (8 MiB) */
  double nccl_timeout_s;    /* LF_NCCL_TIMEOUT_S=S: deadline of NCCL waits (60) */
  /* cpu backend */
  unsigned long long mem_available; /* LF_MEM_AVAILABLE_BYTES=N: the host memory the cpu backend
                                       takes as available (pool sizing, the start-up check)
                                       instead of /proc/meminfo's MemAvailable; 0: unset */
  /* rank identity when ranks start without mpirun (tests/tp_run.sh); NULL: unset */
  const char *tp_rank, *tp_size, *tp_local_rank, *tp_id_file; /* LF_TP_RANK, ... */
#ifdef LF_BENCH_INSTRUMENTS
  /* benchmark instruments (cmake -DLF_BENCH_INSTRUMENTS=ON only; never in the default library) */
  const char *cuda_skip; /* LF_CUDA_SKIP=attn,rope,res,qkv,o,gu,down: kernels a decode pass
                            leaves out (wrong results; NULL: none) */
  int ar_timing;         /* LF_AR_TIMING=1: the fused residual all-reduce times itself */
#endif
} lf_tuning;

/* Fills *t from the environment (defaults for what is unset or out of range). */
void lf_tuning_read(lf_tuning *t);

#ifdef __cplusplus
}
#endif
#endif

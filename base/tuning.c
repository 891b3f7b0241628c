/* The one reader of the environment (see tuning.h). */
#include "base/tuning.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

/* Nonzero unless `name` is set to exactly "0". */
static int env_on(const char *name) {
  const char *e = getenv(name);
  return !(e && !strcmp(e, "0"));
}

/* The integer in `name` when it is in [lo, hi]; dflt when unset or outside. */
static long env_long(const char *name, long dflt, long lo, long hi) {
  const char *e = getenv(name);
  if (!e) return dflt;
  const long v = strtol(e, NULL, 10);
  return v >= lo && v <= hi ? v : dflt;
}

void lf_tuning_read(lf_tuning *t) {
  memset(t, 0, sizeof *t);
  t->cuda_graphs = env_on("LF_CUDA_GRAPHS");
  t->cuda_graphs_tp = env_on("LF_CUDA_GRAPHS_TP");
  t->graph_cache = (int)env_long("LF_CUDA_GRAPH_CACHE", 64, 1, INT_MAX);
  t->pdl = env_on("LF_PDL");
  t->pdl_max_rows = (int)env_long("LF_PDL_MAX_ROWS", -1, 0, INT_MAX);
  t->prefill_chunk = (int)env_long("LF_CUDA_PREFILL_CHUNK", 0, 1, INT_MAX);
  t->gemm_tune = env_on("LF_CUDA_GEMM_TUNE");
  t->custom_ar = env_on("LF_CUSTOM_AR");
  t->custom_ar_bytes = (size_t)env_long("LF_CUSTOM_AR_BYTES", 8L << 20, 1, LONG_MAX);
  const char *e = getenv("LF_NCCL_TIMEOUT_S");
  const double to = e ? atof(e) : 0.0;
  t->nccl_timeout_s = to > 0 ? to : 60.0;
  e = getenv("LF_MEM_AVAILABLE_BYTES");
  t->mem_available = e ? strtoull(e, NULL, 10) : 0;
  t->tp_rank = getenv("LF_TP_RANK");
  t->tp_size = getenv("LF_TP_SIZE");
  t->tp_local_rank = getenv("LF_TP_LOCAL_RANK");
  t->tp_id_file = getenv("LF_TP_ID_FILE");
#ifdef LF_BENCH_INSTRUMENTS
  t->cuda_skip = getenv("LF_CUDA_SKIP");
  e = getenv("LF_AR_TIMING");
  t->ar_timing = e && !strcmp(e, "1");
#endif
}

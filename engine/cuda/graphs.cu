/* The decode step's CUDA-graph cache of the cuda backend (see cuda_backend.graph). */
#include <pthread.h>
#include <stdlib.h>

#include "base/cuda_launch.cuh"
#include "engine/cuda/cuda_backend.h"

static lf_status decode_run_graph(cuda_backend *c, int rows);

/* A device-wide synchronizing call (cudaFree, cudaFreeHost, destroying a stream or graph) made
 * while another thread's stream is capturing invalidates that capture. The process's engines
 * (lfbench eval --jobs, an application embedding several) therefore capture and free under one
 * lock; creation needs none (gpu_engine's CreateAndFreeWhileAnotherEngineCaptures). */
static pthread_mutex_t capture_mu = PTHREAD_MUTEX_INITIALIZER;

void lf_cuda_capture_lock(void) { pthread_mutex_lock(&capture_mu); }
void lf_cuda_capture_unlock(void) { pthread_mutex_unlock(&capture_mu); }

lf_status cb_graphs_init(cuda_backend *c) {
  c->graph = (cudaGraphExec_t *)calloc((size_t)c->max_items + 1, sizeof *c->graph);
  c->graph_used = (uint64_t *)calloc((size_t)c->max_items + 1, sizeof *c->graph_used);
  c->graph_seen = (uint8_t *)calloc((size_t)c->max_items + 1, 1);
  if (!c->graph || !c->graph_used || !c->graph_seen)
    return lf_error(LF_ERR_OUT_OF_MEMORY, "cuda backend: graph cache");
  return LF_OK;
}

void cb_graphs_free(cuda_backend *c) {
  if (c->graph)
    for (int r = 0; r <= c->max_items; r++)
      if (c->graph[r]) cudaGraphExecDestroy(c->graph[r]);
}

/* decode_run_graph with programmatic dependent launch only up to pdl_max_rows rows (the
 * launches record it, graphs included: each batch size has its own graph). */
lf_status cb_decode_run(cuda_backend *c, int rows) {
  const int saved = lf_pdl_pass_off;
  lf_pdl_pass_off = rows > c->pdl_max_rows;
  const lf_status s = decode_run_graph(c, rows);
  lf_pdl_pass_off = saved;
  return s;
}

/* Captures and instantiates the decode pass of `rows` rows into the cache (an LRU entry makes
 * room); under lf_cuda_capture_lock. */
static lf_status capture(cuda_backend *c, int rows, cudaGraphExec_t *out) {
  if (c->n_graphs >= c->graph_cap) {
    int lru = 0;
    for (int r = 1; r <= c->max_items; r++)
      if (c->graph[r] && (!lru || c->graph_used[r] < c->graph_used[lru])) lru = r;
    if (lru) {
      LF_CUDA_CHECK(cudaGraphExecDestroy(c->graph[lru]));
      c->graph[lru] = NULL;
      c->n_graphs--;
    }
  }
  cudaGraph_t g = NULL;
  LF_CUDA_CHECK(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal));
  c->in_capture = 1;
  const lf_status s = cb_decode_pass(c, rows);
  c->in_capture = 0;
  const cudaError_t e = cudaStreamEndCapture(c->stream, &g);
  if (s != LF_OK) {
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
    return s;
  }
  LF_CUDA_CHECK(e);
  cudaGraphExec_t ex = NULL;
  const cudaError_t ei = cudaGraphInstantiate(&ex, g, 0);
  cudaGraphDestroy(g);
  LF_CUDA_CHECK(ei);
  c->graph[rows] = *out = ex;
  c->n_graphs++;
  return LF_OK;
}

/* cb_decode_pass through the graph cache (see cuda_backend.graph). */
static lf_status decode_run_graph(cuda_backend *c, int rows) {
  if (!c->use_graphs || rows < 1 || rows > c->max_items) return cb_decode_pass(c, rows);
  cudaGraphExec_t ex = c->graph[rows];
  if (!ex) {
    if (c->graph_seen[rows] < 1) {
      c->graph_seen[rows]++;
      return cb_decode_pass(c, rows);
    }
    lf_cuda_capture_lock();
    const lf_status s = capture(c, rows, &ex);
    lf_cuda_capture_unlock();
    LF_TRY(s);
  }
  c->graph_used[rows] = ++c->graph_clock;
  LF_CUDA_CHECK(cudaGraphLaunch(ex, c->stream));
  return LF_OK;
}

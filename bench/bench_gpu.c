/* The device and copy-bandwidth half of the GPU subcommands' common frame (bench_gpu.h). */
#include "bench_gpu.h"

#include <stdio.h>
#include <string.h>

#include "bench_util.h"

#ifdef LF_HAVE_CUDA
#include <cuda_runtime.h>

static int gpu_fail(const char *prog, const char *what, cudaError_t e) {
  fprintf(stderr, "%s: %s: %s\n", prog, what, cudaGetErrorString(e));
  cudaGetLastError(); /* clear it: the caller may go on without a figure */
  return 1;
}

static int copy_bandwidth(const char *prog, double *gbs) {
  enum { N = 20 };
  const size_t bytes = (size_t)2 << 30;
  void *a = NULL, *b = NULL;
  cudaEvent_t e0 = NULL, e1 = NULL;
  double t[N];
  int rc = 0;
  cudaError_t e;
  if ((e = cudaMalloc(&a, bytes)) != cudaSuccess || (e = cudaMalloc(&b, bytes)) != cudaSuccess ||
      (e = cudaMemset(a, 1, bytes)) != cudaSuccess || (e = cudaEventCreate(&e0)) != cudaSuccess ||
      (e = cudaEventCreate(&e1)) != cudaSuccess) {
    rc = gpu_fail(prog, "copy bandwidth", e);
    goto out;
  }
  for (int i = 0; i < 3 + N && !rc; i++) {
    float ms = 0;
    if ((e = cudaEventRecord(e0, 0)) != cudaSuccess ||
        (e = cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0)) != cudaSuccess ||
        (e = cudaEventRecord(e1, 0)) != cudaSuccess ||
        (e = cudaEventSynchronize(e1)) != cudaSuccess ||
        (e = cudaEventElapsedTime(&ms, e0, e1)) != cudaSuccess)
      rc = gpu_fail(prog, "copy bandwidth", e);
    if (i >= 3) t[i - 3] = ms; /* the first three warm the copy engines up */
  }
  if (!rc) *gbs = 2.0 * (double)bytes / (bench_median(t, N) * 1e-3) / 1e9;
out:
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  return rc;
}

int bench_gpu_open(const char *prog, int copy_bw, bench_gpu *g) {
  memset(g, 0, sizeof *g);
  int dev = 0;
  struct cudaDeviceProp prop;
  cudaError_t e;
  if ((e = cudaGetDevice(&dev)) != cudaSuccess ||
      (e = cudaGetDeviceProperties(&prop, dev)) != cudaSuccess)
    return gpu_fail(prog, "no CUDA device", e);
  snprintf(g->name, sizeof g->name, "%s", prop.name);
  bench_json_safe(g->name);
  g->n_sm = prop.multiProcessorCount;
  g->l2_bytes = (size_t)prop.l2CacheSize;
  return copy_bw ? copy_bandwidth(prog, &g->copy_gbs) : 0;
}

#else

int bench_gpu_open(const char *prog, int copy_bw, bench_gpu *g) {
  (void)copy_bw;
  memset(g, 0, sizeof *g);
  fprintf(stderr, "%s: this build has no CUDA backend (LF_CUDA=OFF)\n", prog);
  return 1;
}

#endif

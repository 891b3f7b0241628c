/* RMSNorm (see cuda_norm.cuh). */
#include "cuda_norm.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "attention/cuda_check.h"
#include "attention/cuda_ptx.cuh"
#include "attention/cuda_launch.cuh"

#define NORM_NT 256

/* One block per row; the sum of squares in fp32 like the CPU reference (order differs). */
static __global__ void rmsnorm_kernel(const float *x, size_t x_stride, const float *w, int n,
                                      float eps, __nv_bfloat16 *out, size_t out_stride,
                                      const int32_t *out_rows) {
  __shared__ float red[NORM_NT / 32];
  pdl_wait(); /* x comes from the previous kernel (attention/cuda_launch.cuh) */
  pdl_trigger();
  const int r = blockIdx.x;
  const float *xr = x + (size_t)r * x_stride;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < n; i += NORM_NT) ss += xr[i] * xr[i];
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    ss = threadIdx.x < NORM_NT / 32 ? red[threadIdx.x] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (threadIdx.x == 0) red[0] = ss;
  }
  __syncthreads();
  const float rs = 1.0f / sqrtf(red[0] / (float)n + eps);
  __nv_bfloat16 *o = out + (size_t)(out_rows ? out_rows[r] : r) * out_stride;
  for (int i = threadIdx.x; i < n; i += NORM_NT) o[i] = __float2bfloat16(w[i] * (xr[i] * rs));
}

extern "C" lf_status lf_cuda_rmsnorm(const float *x, size_t x_stride, const float *w, int n,
                                     float eps, int n_rows, void *out, size_t out_stride,
                                     const int32_t *out_rows, cudaStream_t stream) {
  if (!x || !w || !out || n < 1 || n_rows < 0)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_rmsnorm: bad arguments");
  if (n_rows == 0) return LF_OK;
  lf_launch(rmsnorm_kernel, dim3((unsigned)n_rows), dim3(NORM_NT), 0, stream, x, x_stride, w, n,
            eps, (__nv_bfloat16 *)out, out_stride, out_rows);
  LF_CUDA_CHECK_LAUNCH("rmsnorm_kernel");
  return LF_OK;
}

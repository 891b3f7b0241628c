/* RMSNorm (see rmsnorm.cuh). */
#include "kernels/rmsnorm.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "base/cuda_check.h"
#include "base/cuda_launch.cuh"
#include "base/cuda_ptx.cuh"
#include "base/rmsnorm_dev.cuh"

#define NORM_NT LF_NORM_NT

/* One block per row; the sum of squares in fp32 like the CPU reference (order differs). */
static __global__ void rmsnorm_kernel(const float *x, size_t x_stride, const float *w, int n,
                                      float eps, __nv_bfloat16 *out, size_t out_stride,
                                      const int32_t *out_rows) {
  __shared__ float red[NORM_NT / 32 + 1];
  pdl_wait(); /* x comes from the previous kernel (base/cuda_launch.cuh) */
  pdl_trigger();
  const int r = blockIdx.x;
  const float *xr = x + (size_t)r * x_stride;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < n; i += NORM_NT) ss += xr[i] * xr[i];
  const float rs = lf_rms_scale(ss, red, n, eps);
  __nv_bfloat16 *o = out + (size_t)(out_rows ? out_rows[r] : r) * out_stride;
  for (int i = threadIdx.x; i < n; i += NORM_NT) o[i] = __float2bfloat16(w[i] * (xr[i] * rs));
}

/* The same with every row held in registers (VPT float4 per thread) and 16-byte loads, each x
 * read once: the decode step's norms are latency-bound (a 4096-wide row per block), so the loads
 * of x and w are all issued before the first use. Same reduction order as rmsnorm_kernel. */
template <int VPT>
static __global__ void rmsnorm_vec_kernel(const float *x, size_t x_stride, const float *w, int n,
                                          float eps, __nv_bfloat16 *out, size_t out_stride,
                                          const int32_t *out_rows) {
  __shared__ float red[NORM_NT / 32 + 1];
  const int n4 = n >> 2;
  float4 wv[VPT];
#pragma unroll
  for (int j = 0; j < VPT; j++) {
    const int i = threadIdx.x + j * NORM_NT;
    wv[j] = i < n4 ? ((const float4 *)w)[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  pdl_wait(); /* x comes from the previous kernel; w does not */
  pdl_trigger();
  const int r = blockIdx.x;
  const float4 *xr = (const float4 *)(x + (size_t)r * x_stride);
  float4 xv[VPT];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < VPT; j++) {
    const int i = threadIdx.x + j * NORM_NT;
    xv[j] = i < n4 ? xr[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
#pragma unroll
  for (int j = 0; j < VPT; j++) ss += lf_sq4(xv[j]);
  const float rs = lf_rms_scale(ss, red, n, eps);
  __nv_bfloat16 *o = out + (size_t)(out_rows ? out_rows[r] : r) * out_stride;
#pragma unroll
  for (int j = 0; j < VPT; j++) {
    const int i = threadIdx.x + j * NORM_NT;
    if (i < n4) lf_store_normed4(o, i, wv[j], xv[j], rs);
  }
}

extern "C" lf_status lf_cuda_rmsnorm(const float *x, size_t x_stride, const float *w, int n,
                                     float eps, int n_rows, void *out, size_t out_stride,
                                     const int32_t *out_rows, cudaStream_t stream) {
  if (!x || !w || !out || n < 1 || n_rows < 0)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_rmsnorm: bad arguments");
  if (n_rows == 0) return LF_OK;
  const int vec = n % 4 == 0 && x_stride % 4 == 0 && out_stride % 4 == 0 &&
                  ((uintptr_t)x & 15) == 0 && ((uintptr_t)w & 15) == 0 &&
                  ((uintptr_t)out & 7) == 0;
  const int vpt = (n / 4 + NORM_NT - 1) / NORM_NT; /* float4 per thread */
  const dim3 grid((unsigned)n_rows), block(NORM_NT);
  __nv_bfloat16 *o = (__nv_bfloat16 *)out;
  if (vec && vpt <= 1)
    lf_launch(rmsnorm_vec_kernel<1>, grid, block, 0, stream, x, x_stride, w, n, eps, o, out_stride, out_rows);
  else if (vec && vpt <= 2)
    lf_launch(rmsnorm_vec_kernel<2>, grid, block, 0, stream, x, x_stride, w, n, eps, o, out_stride, out_rows);
  else if (vec && vpt <= 4)
    lf_launch(rmsnorm_vec_kernel<4>, grid, block, 0, stream, x, x_stride, w, n, eps, o, out_stride, out_rows);
  else if (vec && vpt <= 8)
    lf_launch(rmsnorm_vec_kernel<8>, grid, block, 0, stream, x, x_stride, w, n, eps, o, out_stride, out_rows);
  else
    lf_launch(rmsnorm_kernel, grid, block, 0, stream, x, x_stride, w, n, eps, o, out_stride, out_rows);
  LF_CUDA_CHECK_LAUNCH("rmsnorm_kernel");
  return LF_OK;
}

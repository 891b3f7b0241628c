/* RMSNorm pieces shared by the device code that norms a residual row: kernels/rmsnorm.cu's
 * kernels and the fused residual all-reduce (parallel/ar_ipc.cu). Sharing them is what makes the
 * two give the same bits for the same row, which bit-identical tensor parallelism relies on.
 * CUDA only. */
#ifndef LF_RMSNORM_DEV_CUH
#define LF_RMSNORM_DEV_CUH

#include <cuda_bf16.h>
#include <stdint.h>

#define LF_NORM_NT 256 /* threads of a norming block */

/* Sum of squares of four values, in one fixed order. */
static __device__ __forceinline__ float lf_sq4(const float4 v) {
  return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
}

/* 1 / sqrt(mean + eps) of a row from each thread's partial sum of squares: warp sums, then the
 * warps' in order. red: shared [LF_NORM_NT / 32 + 1], free again when this returns. Every thread
 * of the LF_NORM_NT-thread block gets the result. */
static __device__ __forceinline__ float lf_rms_scale(float ss, float *red, int n, float eps) {
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    ss = threadIdx.x < LF_NORM_NT / 32 ? red[threadIdx.x] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (threadIdx.x == 0) red[LF_NORM_NT / 32] = ss;
  }
  __syncthreads();
  const float r = 1.0f / sqrtf(red[LF_NORM_NT / 32] / (float)n + eps);
  __syncthreads();
  return r;
}

/* o[4 i .. 4 i + 3] = bf16(w * (v * rs)). */
static __device__ __forceinline__ void lf_store_normed4(__nv_bfloat16 *o, int i, const float4 w,
                                                        const float4 v, float rs) {
  union {
    __nv_bfloat162 h[2];
    uint2 u;
  } y;
  y.h[0] = __floats2bfloat162_rn(w.x * (v.x * rs), w.y * (v.y * rs));
  y.h[1] = __floats2bfloat162_rn(w.z * (v.z * rs), w.w * (v.w * rs));
  *(uint2 *)(o + 4 * (size_t)i) = y.u;
}

#endif

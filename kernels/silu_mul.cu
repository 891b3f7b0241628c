/* SiLU(gate) * up (see silu_mul.cuh). */
#include "kernels/silu_mul.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "base/cuda_check.h"

static __global__ void silu_mul_kernel(const float *gu, int hidden, __nv_bfloat16 *out) {
  const int t = blockIdx.y;
  const float *g = gu + (size_t)t * 2 * hidden, *u = g + hidden;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < hidden; i += gridDim.x * blockDim.x) {
    const float x = g[i];
    out[(size_t)t * hidden + i] = __float2bfloat16(x / (1.0f + expf(-x)) * u[i]);
  }
}

extern "C" lf_status lf_cuda_silu_mul(const float *gu, int hidden, int n_tok, void *out,
                                      cudaStream_t stream) {
  if (!gu || !out || hidden < 1 || n_tok < 0 || n_tok > 65535)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_silu_mul: bad arguments");
  if (n_tok == 0) return LF_OK;
  const int bx = (hidden + 255) / 256 < 64 ? (hidden + 255) / 256 : 64;
  silu_mul_kernel<<<dim3(bx, n_tok), 256, 0, stream>>>(gu, hidden, (__nv_bfloat16 *)out);
  LF_CUDA_CHECK_LAUNCH("silu_mul_kernel");
  return LF_OK;
}

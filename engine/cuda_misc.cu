/* Embedding gather, SiLU * up, random weights (see cuda_misc.cuh). */
#include "cuda_misc.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "attention/cuda_check.h"
#include "random_weights.h"

static __global__ void embed_kernel(const __nv_bfloat16 *embed, int dim, const int32_t *tokens,
                                    float *x) {
  const int t = blockIdx.x;
  const __nv_bfloat16 *e = embed + (size_t)tokens[t] * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) x[(size_t)t * dim + i] = __bfloat162float(e[i]);
}

extern "C" lf_status lf_cuda_embed(const void *embed, int dim, const int32_t *tokens, int n_tok,
                                   float *x, cudaStream_t stream) {
  if (!embed || !tokens || !x || dim < 1 || n_tok < 0)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_embed: bad arguments");
  if (n_tok == 0) return LF_OK;
  embed_kernel<<<n_tok, 256, 0, stream>>>((const __nv_bfloat16 *)embed, dim, tokens, x);
  LF_CUDA_CHECK_LAUNCH("embed_kernel");
  return LF_OK;
}

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

static __global__ void random_bf16_kernel(__nv_bfloat16 *dst, size_t n, uint64_t seed,
                                          uint32_t tensor, float scale, uint64_t index0) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] = __float2bfloat16(lf_rw_value(seed, tensor, LF_RW_MATRIX, scale, index0 + i));
}

extern "C" lf_status lf_cuda_random_bf16(void *dst, size_t n, uint64_t seed, uint32_t tensor,
                                         float scale, uint64_t index0, cudaStream_t stream) {
  if (!dst && n) return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_random_bf16: NULL destination");
  if (n == 0) return LF_OK;
  size_t blocks = (n + 255) / 256;
  if (blocks > 65536) blocks = 65536;
  random_bf16_kernel<<<(unsigned)blocks, 256, 0, stream>>>((__nv_bfloat16 *)dst, n, seed, tensor,
                                                           scale, index0);
  LF_CUDA_CHECK_LAUNCH("random_bf16_kernel");
  return LF_OK;
}

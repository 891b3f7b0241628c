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

/* Vocab-parallel rows: embed holds rows [vocab0, vocab0 + n_rows); other tokens get zeros. */
static __global__ void embed_slice_kernel(const __nv_bfloat16 *embed, int dim, int vocab0,
                                          int n_rows, const int32_t *tokens, float *x) {
  const int t = blockIdx.x;
  const int r = tokens[t] - vocab0;
  const bool own = r >= 0 && r < n_rows;
  const __nv_bfloat16 *e = embed + (size_t)(own ? r : 0) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x)
    x[(size_t)t * dim + i] = own ? __bfloat162float(e[i]) : 0.0f;
}

extern "C" lf_status lf_cuda_embed_slice(const void *embed, int dim, int vocab0, int n_rows,
                                         const int32_t *tokens, int n_tok, float *x,
                                         cudaStream_t stream) {
  if (!embed || !tokens || !x || dim < 1 || n_tok < 0 || n_rows < 1 || vocab0 < 0)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_embed_slice: bad arguments");
  if (n_tok == 0) return LF_OK;
  embed_slice_kernel<<<n_tok, 256, 0, stream>>>((const __nv_bfloat16 *)embed, dim, vocab0, n_rows,
                                                tokens, x);
  LF_CUDA_CHECK_LAUNCH("embed_slice_kernel");
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

/* dst[r][j] = value at global index (row0 + r) * cols + col0 + j. */
static __global__ void random_bf16_slice_kernel(__nv_bfloat16 *dst, int64_t n_rows, int64_t n_cols,
                                                int64_t cols, int64_t row0, int64_t col0,
                                                uint64_t seed, uint32_t tensor, float scale) {
  const size_t n = (size_t)n_rows * (size_t)n_cols;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t r = i / (size_t)n_cols, j = i % (size_t)n_cols;
    const uint64_t g =
        (uint64_t)(row0 + (int64_t)r) * (uint64_t)cols + (uint64_t)(col0 + (int64_t)j);
    dst[i] = __float2bfloat16(lf_rw_value(seed, tensor, LF_RW_MATRIX, scale, g));
  }
}

extern "C" lf_status lf_cuda_random_bf16_slice(void *dst, int64_t n_rows, int64_t n_cols,
                                               int64_t cols, int64_t row0, int64_t col0,
                                               uint64_t seed, uint32_t tensor, float scale,
                                               cudaStream_t stream) {
  if ((!dst && n_rows > 0 && n_cols > 0) || n_rows < 0 || n_cols < 0 || row0 < 0 || col0 < 0 ||
      col0 + n_cols > cols)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_random_bf16_slice: bad arguments");
  const size_t n = (size_t)n_rows * (size_t)n_cols;
  if (n == 0) return LF_OK;
  size_t blocks = (n + 255) / 256;
  if (blocks > 65536) blocks = 65536;
  random_bf16_slice_kernel<<<(unsigned)blocks, 256, 0, stream>>>(
      (__nv_bfloat16 *)dst, n_rows, n_cols, cols, row0, col0, seed, tensor, scale);
  LF_CUDA_CHECK_LAUNCH("random_bf16_slice_kernel");
  return LF_OK;
}

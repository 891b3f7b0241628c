/* Embedding gather (see embed.cuh). */
#include "kernels/embed.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "base/cuda_check.h"

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

/* Random weights on the device (see random_weights.cuh). */
#include "kernels/random_weights.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "base/cuda_check.h"
#include "kernels/random_weights.h"

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

/* Device addressing of the CUDA pool arena (memory/pool.h lf_cuda_pool_view). CUDA only. */
#ifndef LF_POOL_ROW_CUH
#define LF_POOL_ROW_CUH

#include <cuda_bf16.h>

#include "memory/pool.h"

/* The [head_dim] row of `slot` in (pool, layer, KV head) hidx of K or V (base: p.k or p.v). */
static __device__ __forceinline__ const __nv_bfloat16 *pool_row(const lf_cuda_pool_view &p,
                                                               const void *base, size_t hidx,
                                                               int slot) {
  return (const __nv_bfloat16 *)base + (hidx * p.budget + slot) * p.head_dim;
}

#endif

/* Device addressing of the CUDA pool arena (memory/pool.h lf_cuda_pool_view). CUDA only. */
#ifndef LF_POOL_ROW_CUH
#define LF_POOL_ROW_CUH

#include <cuda_bf16.h>

#include "base/kvq.h"
#include "memory/pool.h"

/* The row format of one side of the pool, base p.k (K) or p.v (V): k8v4 stores int8 K rows and
 * int4 V rows, every other dtype the same format on both sides. */
static __device__ __forceinline__ int pool_fmt(const lf_cuda_pool_view &p, const void *base) {
  return base == p.k ? lf_kvq_k_row(p.kv_dtype) : lf_kvq_v_row(p.kv_dtype);
}

/* The [head_dim] row of `slot` in (pool, layer, KV head) hidx of K or V (base: p.k or p.v). */
static __device__ __forceinline__ const __nv_bfloat16 *pool_row(const lf_cuda_pool_view &p,
                                                               const void *base, size_t hidx,
                                                               int slot) {
  return (const __nv_bfloat16 *)base + (hidx * p.budget + slot) * p.head_dim;
}

/* Element d of that row as attention computes on it: the bf16 value, or under fp8 / int8 the
 * code read back under the row's scale, under int4 under its group's step and floor (scales:
 * p.k_scale or p.v_scale). */
static __device__ __forceinline__ float pool_val(const lf_cuda_pool_view &p, const void *base,
                                                 const float *scales, size_t hidx, int slot,
                                                 int d) {
  const size_t row = hidx * p.budget + slot;
  const int fmt = pool_fmt(p, base);
  if (fmt == LF_KV_INT4)
    return lf_i4_value(lf_i4_get((const uint32_t *)base + row * (p.head_dim / 8), d),
                       ((const uint32_t *)scales)[row * (p.head_dim / LF_I4_GROUP) + d / LF_I4_GROUP]);
  if (fmt != LF_KV_BF16)
    return lf_kvq_value(fmt, ((const uint8_t *)base)[row * p.head_dim + d], scales[row]);
  return __bfloat162float(((const __nv_bfloat16 *)base)[row * p.head_dim + d]);
}

#endif

/* Step 1 of the decode step: the new token's k/v into its slot (see kv_write.cuh). */
#include "attention/kv_write.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "attention/cuda_check.h"

/* One warp per (sequence, KV head): [n_kv_heads, n_seq] blocks of 32 threads. */
static __global__ void kv_write_kernel(lf_kv_write_args a) {
  const int seq = blockIdx.y, kvh = blockIdx.x, lane = threadIdx.x;
  const int D = a.head_dim, B = a.budget;
  const size_t hidx =
      ((size_t)a.pool_ids[seq] * a.n_layers + a.layer) * a.n_kv_heads + kvh; /* (pool,l,g) */
  const int n = a.n[hidx];
  const int w = lf_kv_slot_for_write(n, a.next[hidx], B, a.sink, a.policy);
  __syncwarp();
  if (w >= 0) {
    const size_t stride = a.new_stride ? a.new_stride : (size_t)a.n_kv_heads * D;
    const __nv_bfloat16 *kn = (const __nv_bfloat16 *)a.k_new + seq * stride + (size_t)kvh * D;
    const __nv_bfloat16 *vn = (const __nv_bfloat16 *)a.v_new + seq * stride + (size_t)kvh * D;
    __nv_bfloat16 *kd = (__nv_bfloat16 *)a.k + (hidx * B + w) * D;
    __nv_bfloat16 *vd = (__nv_bfloat16 *)a.v + (hidx * B + w) * D;
    float l1 = 0.0f;
    for (int d = lane; d < D; d += 32) {
      const __nv_bfloat16 vv = vn[d];
      kd[d] = kn[d];
      vd[d] = vv;
      l1 += fabsf(__bfloat162float(vv));
    }
    for (int o = 16; o > 0; o >>= 1)
      l1 += __shfl_xor_sync(0xffffffffu, l1, o);
    if (lane == 0) {
      a.vnorm[hidx * B + w] = l1;
      a.pos[hidx * B + w] = a.pos_new[seq];
      if (n < B) a.n[hidx] = n + 1;
    }
  }
  if (lane == 0) a.w[(size_t)seq * a.n_kv_heads + kvh] = w;
}

extern "C" lf_status lf_cuda_kv_write(const lf_kv_write_args *a, cudaStream_t stream) {
  if (!a || !a->k || !a->v || !a->vnorm || !a->pos || !a->n || !a->next || !a->pool_ids ||
      !a->k_new || !a->v_new || !a->pos_new || !a->w)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_kv_write: NULL argument");
  if (a->n_seq < 0 || a->n_seq > 65535 || a->n_kv_heads < 1 || a->budget < 1 || a->head_dim < 1 ||
      a->layer < 0 || a->layer >= a->n_layers)
    return lf_error(LF_ERR_INVALID_ARG,
                    "lf_cuda_kv_write: bad shape (n_seq %d, kv heads %d, budget %d, head_dim %d, "
                    "layer %d of %d)",
                    a->n_seq, a->n_kv_heads, a->budget, a->head_dim, a->layer, a->n_layers);
  if (a->n_seq == 0) return LF_OK;
  kv_write_kernel<<<dim3(a->n_kv_heads, a->n_seq), 32, 0, stream>>>(*a);
  LF_CUDA_CHECK_LAUNCH("kv_write_kernel");
  return LF_OK;
}

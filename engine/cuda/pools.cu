/* The cuda backend's pools: memory/'s free list and each (pool, layer)'s fill count mirrored on
 * the host (the device arena's metadata is reset on take), so admission never reads the device. */
#include "engine/cuda/cuda_backend.h"

lf_status cb_rkv_reset(cuda_backend *c, int pool, int l) {
  const lf_cuda_pool_view *v = &c->lv[l];
  const size_t hkv = (size_t)c->cfg.n_kv_heads, B = (size_t)v->budget;
  LF_CUDA_CHECK(cudaMemsetAsync(v->since + (size_t)pool * hkv, 0xff, hkv * sizeof(int32_t),
                                c->stream));
  LF_CUDA_CHECK(cudaMemsetAsync(v->acc + (size_t)pool * hkv * B, 0, hkv * B * sizeof(float),
                                c->stream));
  return LF_OK;
}

/* One block per layer: pool's metadata in the layer-major arena (n = 0, next = -1, pos = -1;
 * rkv: since = -1, acc = 0). */
__global__ void pool_reset_kernel(lf_cuda_pool_view pv, const int *lbud, int n_pools, int pool) {
  const int l = blockIdx.x, hkv = pv.n_kv_heads;
  size_t s0 = 0; /* first slot of layer l */
  for (int i = 0; i < l; i++) s0 += (size_t)n_pools * hkv * lbud[i];
  const size_t B = (size_t)lbud[l], first = s0 + (size_t)pool * hkv * B, n = (size_t)hkv * B;
  const int rkv = pv.since != nullptr;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
    pv.pos[first + i] = -1;
    if (rkv) pv.acc[first + i] = 0.0f;
  }
  const size_t h0 = ((size_t)l * n_pools + pool) * hkv;
  for (int h = threadIdx.x; h < hkv; h += blockDim.x) {
    pv.n[h0 + h] = 0;
    pv.next[h0 + h] = -1;
    if (rkv) pv.since[h0 + h] = -1;
  }
}

lf_status cb_pool_take(lf_backend *b, int *pool) {
  cuda_backend *c = (cuda_backend *)b;
  int p;
  if (!pool) return lf_error(LF_ERR_INVALID_ARG, "pool_take: NULL argument");
  LF_CUDA_CHECK(cudaSetDevice(c->device));
  LF_TRY(lf_pool_list_take(&c->pools, &p));
  /* metadata only; K/V keep stale values below n */
  pool_reset_kernel<<<c->cfg.n_layers, 256, 0, c->stream>>>(c->pv, c->d_lbud, c->pv_pools, p);
  LF_CUDA_CHECK(cudaGetLastError());
  for (int l = 0; l < c->cfg.n_layers; l++) *cb_host_n(c, p, l) = 0;
  *pool = p;
  return LF_OK;
}

lf_status cb_pool_give(lf_backend *b, int pool) {
  return lf_pool_list_give(&((cuda_backend *)b)->pools, pool);
}

int cb_pools_free(lf_backend *b) {
  return ((cuda_backend *)b)->pools.n_free;
}

int cb_pool_slots_filled(lf_backend *b, int pool) {
  cuda_backend *c = (cuda_backend *)b;
  return pool >= 0 && pool < c->p.n_pools ? *cb_host_n(c, pool, c->lmin) : 0;
}

/* Tensor parallelism: ranks size their pools from their own free memory, and every rank must
 * hold the same pools (rank 0's scheduler hands out ids for all). The engine takes the minimum
 * over ranks and lowers the others' count here, before any pool is taken: the free list is
 * rebuilt so pool_take returns the same ids on every rank. The extra arena stays allocated (the
 * layer-major arena keeps its pool stride, pv_pools). */
extern "C" lf_status lf_backend_cuda_limit_pools(lf_backend *b, int n_pools) {
  cuda_backend *c = (cuda_backend *)b;
  if (!c) return lf_error(LF_ERR_INVALID_ARG, "limit_pools: no backend");
  LF_TRY(lf_pool_list_limit(&c->pools, n_pools));
  c->p.n_pools = n_pools;
  c->max_items = n_pools;
  return LF_OK;
}

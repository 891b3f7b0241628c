/* The cuda backend's pools: memory/'s free list and each pool's fill count mirrored on the host
 * (the device arena's metadata is reset on take), so admission never reads the device. */
#include "engine/cuda/cuda_backend.h"

lf_status cb_rkv_reset(cuda_backend *c, size_t h0, size_t n_heads) {
  LF_CUDA_CHECK(cudaMemsetAsync(c->pv.since + h0, 0xff, n_heads * sizeof(int32_t), c->stream));
  LF_CUDA_CHECK(cudaMemsetAsync(c->pv.acc + h0 * c->p.budget, 0,
                                n_heads * c->p.budget * sizeof(float), c->stream));
  return LF_OK;
}

lf_status cb_pool_take(lf_backend *b, int *pool) {
  cuda_backend *c = (cuda_backend *)b;
  int p;
  if (!pool) return lf_error(LF_ERR_INVALID_ARG, "pool_take: NULL argument");
  LF_CUDA_CHECK(cudaSetDevice(c->device));
  LF_TRY(lf_pool_list_take(&c->pools, &p));
  const size_t heads = (size_t)c->cfg.n_layers * c->cfg.n_kv_heads;
  /* metadata only (n = 0, next = -1, pos = -1; rkv: since = -1, acc = 0); K/V keep stale values
   * below n */
  LF_CUDA_CHECK(cudaMemsetAsync(c->pv.n + p * heads, 0, heads * sizeof(int32_t), c->stream));
  LF_CUDA_CHECK(cudaMemsetAsync(c->pv.next + p * heads, 0xff, heads * sizeof(int32_t), c->stream));
  LF_CUDA_CHECK(cudaMemsetAsync(c->pv.pos + p * heads * c->p.budget, 0xff,
                                heads * c->p.budget * sizeof(int32_t), c->stream));
  if (c->pv.since) LF_TRY(cb_rkv_reset(c, p * heads, heads));
  c->host_n[p] = 0;
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
  return pool >= 0 && pool < c->p.n_pools ? c->host_n[pool] : 0;
}

/* Tensor parallelism: ranks size their pools from their own free memory, and every rank must
 * hold the same pools (rank 0's scheduler hands out ids for all). The engine takes the minimum
 * over ranks and lowers the others' count here, before any pool is taken: the free list is
 * rebuilt so pool_take returns the same ids on every rank. The extra arena stays allocated. */
extern "C" lf_status lf_backend_cuda_limit_pools(lf_backend *b, int n_pools) {
  cuda_backend *c = (cuda_backend *)b;
  if (!c) return lf_error(LF_ERR_INVALID_ARG, "limit_pools: no backend");
  LF_TRY(lf_pool_list_limit(&c->pools, n_pools));
  c->p.n_pools = n_pools;
  c->max_items = n_pools;
  return LF_OK;
}

/* rkv's selection on the GPU (attention.h: the rkv policy; the CPU twin is
 * lf_attn_rkv_select_ref).
 *
 * For each eviction scope (a pool's KV head, or a layer's KV heads in layer scope) the kernel
 * ranks the scope's n filled slots by position, leaves out the obs newest (the observation
 * window: pool.obs, LF_RKV_OBS where 0), and scores the rest, summed over the scope's heads: LF_RKV_LAMBDA x the
 * window's attention mass (acc / (group x obs)), max-pooled over LF_RKV_POOL_KERNEL
 * neighbours in position order, minus (1 - LF_RKV_LAMBDA) x the softmax of each key's mean
 * cosine similarity to the others (its most recent look-alike above LF_RKV_SIM_THRESHOLD left
 * out). The rkv_stage lowest scores among non-sink slots (ties to the lower slot) become every
 * head's queue, in that order, and each head's since becomes 0. As the twin computes it: a
 * key's cosines with the others sum to its dot with the sum of the unit keys less its own
 * square, and its most recent look-alike is the first met scanning the others from the newest
 * down. The scores are in fp64 (the twin divides the rows first, the kernel the dots), so totals
 * agree with the twin to ~1e-15 relative and the queues wherever no two totals are that close.
 *
 * One block per scope. The look-alike scan runs on the tensor cores: tiles of 128 keys against
 * tiles of 64 others from the newest down (mma.sync m16n8k16, bf16 operands exact for bf16 pools
 * and for fp8 / int8 codes, whose row scale goes into the norm; int4 values as a two-term bf16
 * split), fp32 sums; a tile of keys stops once each has found one. A cosine within 5e-4 of the
 * threshold (the fp32 sums are within ~1e-5) is decided again in fp64 by the whole warp, so the
 * choice of look-alike is the fp64 one; its cosine, the sums and the scores are fp64. The sort,
 * the norms and the sums are O(n x head_dim); the scan O(n^2 x head_dim) for keys without a
 * look-alike, less for those with a recent one. Up to LF_CUDA_RKV_SMEM_BUDGET slots the ranks
 * and the fp64 arrays live in shared memory; above it, in a device workspace the caller sizes by
 * lf_cuda_rkv_select_ws_bytes (a block's room per resident block, the blocks looping over the
 * scopes), only the scan's tiles in shared memory. K is read as attention reads it (pool_val:
 * bf16, or a quantized dtype's values), plus the key mean where one is given (the model's keys;
 * the scan then splits every dtype's values as int4's). Includable from C. Every pointer is
 * device memory.
 */
#ifndef LF_RKV_SELECT_CUH
#define LF_RKV_SELECT_CUH

#include <stdint.h>

#include "lfserve.h"
#include "memory/pool.h"

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st;

/* The largest budget whose selection state fits in shared memory, the largest budget the kernel
 * takes (through the workspace above the first), and the largest head_dim. */
#define LF_CUDA_RKV_SMEM_BUDGET 4096
#define LF_CUDA_RKV_MAX_BUDGET (1 << 20)
#define LF_CUDA_RKV_MAX_HEAD_DIM 128

typedef struct lf_rkv_select_args {
  lf_cuda_pool_view pool; /* K, pos, acc and n read; its queue ([n_pools][n_layers][n_kv_heads]
                             [stage]) written, its since set to 0 */
  int layer;
  int n_scopes;             /* scopes = sequences x (n_kv_heads / heads_per_scope) */
  const int32_t *pool_ids;  /* [n_scopes / (n_kv_heads / heads_per_scope)] each sequence's pool */
  int heads_per_scope;      /* 1 (head scope) or n_kv_heads (layer scope) */
  int group;                /* query heads per KV head */
  int sink;
  double *totals;           /* NULL, or [n_scopes][budget]: each slot's total (NaN outside the
                               candidates), for tests */
  int due_only;             /* 1: only the scopes whose selection is due after a decode step
                               (since == -1 with a full pool, or since >= stage: the count the
                               decode kernel left); they also set next = queue[0]. The others
                               are skipped. 0: every scope. */
  void *ws;                 /* budgets over LF_CUDA_RKV_SMEM_BUDGET: ws_bytes of device memory,
                               lf_cuda_rkv_select_ws_bytes(budget, ...) or more; else unused */
  size_t ws_bytes;
  const float *k_mean;      /* NULL, or fp32 [pool.n_kv_heads][head_dim]: the layer's key means
                               as the engine took them from the keys (lf_engine_config.key_means,
                               in the stored keys' frame); the cosines compare each stored row
                               plus its head's mean, as the twin's lf_kv_head.k_mean */
} lf_rkv_select_args;

/* The workspace a selection over pools of `budget` slots needs: 0 up to LF_CUDA_RKV_SMEM_BUDGET;
 * above it one block's arrays for each block that can be resident on the current device (two
 * per SM), at most max_scopes. A selection of a smaller budget runs in the same workspace. */
size_t lf_cuda_rkv_select_ws_bytes(int budget, int max_scopes);

/* Launches the selection on stream; asynchronous. Argument errors (a budget over
 * LF_CUDA_RKV_MAX_BUDGET, one over LF_CUDA_RKV_SMEM_BUDGET without room for one block's arrays
 * in ws; too few filled slots is the caller's to avoid) are LF_ERR_INVALID_ARG; launch failures
 * LF_ERR_BACKEND. */
lf_status lf_cuda_rkv_select(const lf_rkv_select_args *a, struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif
#endif

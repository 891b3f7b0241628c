/* Step 1 of the decode step on the GPU (docs/DESIGN.md §3): write each sequence's new token into the slot
 * w = (n < B) ? n++ : next of every KV head of one layer, caching ||v||_1 and the position.
 *
 * k/v arrive post-RoPE in bf16; vnorm is the fp32 L1 norm of exactly the bf16 values stored, so
 * the LongFlow score of the slot matches what is in the pool. w is returned per (sequence, KV
 * head) for lf_cuda_decode_attn, which must not pick the slot just written. When a pool has no
 * slot for the token (full policy and n == B, or a full pool whose next is not valid) nothing is
 * written and w = -1: the engine checks context length on the host before the step.
 *
 * Includable from C; every pointer is device memory.
 */
#ifndef LF_KV_WRITE_CUH
#define LF_KV_WRITE_CUH

#include <stddef.h>
#include <stdint.h>

#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st;

typedef struct lf_kv_write_args {
  void *k, *v;         /* bf16 [n_pools][n_layers][n_kv_heads][budget][head_dim] */
  float *vnorm;        /* [n_pools][n_layers][n_kv_heads][budget] */
  int32_t *pos;        /* [n_pools][n_layers][n_kv_heads][budget] */
  int32_t *n;          /* [n_pools][n_layers][n_kv_heads] incremented while n < budget */
  const int32_t *next; /* [n_pools][n_layers][n_kv_heads] */
  int n_layers, n_kv_heads, budget, head_dim, layer;
  int n_seq;
  const int32_t *pool_ids; /* [n_seq] */
  const void *k_new;       /* bf16, head g of sequence s at k_new[s * new_stride + g * head_dim] */
  const void *v_new;       /* bf16, same layout as k_new */
  size_t new_stride;       /* elements between sequences; 0: n_kv_heads * head_dim */
  const int32_t *pos_new;  /* [n_seq] position of each new token */
  int sink;                /* a full pool's next must be in [sink, budget) */
  lf_policy policy;
  int32_t *w; /* [n_seq][n_kv_heads] out: slot written, -1 if none */
} lf_kv_write_args;

lf_status lf_cuda_kv_write(const lf_kv_write_args *a, struct CUstream_st *stream);

#ifdef __CUDACC__
/* The slot a new token goes to (docs/DESIGN.md §3 step 1): a free slot while n < B, else `next`;
 * -1 when nothing may be written (full policy with a full pool, or no valid eviction target). */
static __device__ __forceinline__ int lf_kv_slot_for_write(int n, int next, int budget, int sink,
                                                         int policy) {
  if (n < budget) return n;
  if (policy == LF_POLICY_FULL) return -1;
  return next >= sink && next < budget ? next : -1;
}
#endif

#ifdef __cplusplus
}
#endif
#endif

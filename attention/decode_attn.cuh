/* Fused LongFlow decode attention on the GPU (docs/DESIGN.md §3, steps 2-4), for a batch of sequences.
 *
 * For each (sequence, KV head) the kernel attends the group's query heads over the pool's n
 * filled slots, writes the output, scores every filled slot with s_i = ||v_i||_1 * sum_h alpha_h,i
 * (fp32, exact softmax) and stores next = argmin s_i (slots < sink and the slot w written this
 * step excluded, ties to the lowest slot, -1 when no slot is evictable) into the pool metadata.
 * K and V are read exactly once; scoring never re-reads them. Step 1 (the write of the new token)
 * is lf_cuda_qkv_rope's slot write (attention/kv_write.cuh), launched before this on the same
 * stream.
 *
 * Same semantics as lf_attn_decode_ref (attention.h) for the policies longflow, full (next = -1),
 * streaming (next = the evictable slot with the smallest position) and h2o (acc[i] += sum_h
 * alpha_h,i, acc[w] starting from 0; next = argmin acc outside the `recent` most recent slots by
 * position; the window in attention/evict.cuh), and rkv's decode step: the mass added to
 * acc inside its observation window, since advanced and next = queue[since]; when a selection is
 * due (since reaches the stage, or the pool just filled) next is left -1 and
 * lf_cuda_rkv_select's due pass (attention/rkv_select.cuh), launched after this, chooses.
 *
 * Includable from C: bf16 buffers are `void *` (__nv_bfloat16 on the device, raw bf16 bits on the
 * host), the stream is a cudaStream_t (struct CUstream_st *). Every pointer is device memory.
 */
#ifndef LF_DECODE_ATTN_CUH
#define LF_DECODE_ATTN_CUH

#include <stddef.h>
#include <stdint.h>

#include "lfserve.h"
#include "memory/pool.h"

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st;

typedef struct lf_decode_attn_args {
  /* The rank's pool arena (docs/DESIGN.md §3 layout; head_dim 64 or 128): K, V, vnorm and n
   * read (n counts this step's token), pos read by streaming and h2o, acc read and written by
   * h2o and rkv, rkv's since read and written and its queue read, next written (the slot the
   * next token takes). */
  lf_cuda_pool_view pool;
  int layer; /* the layer attended */
  /* The batch. */
  int n_seq;
  const int32_t *pool_ids; /* [n_seq] the pool of each sequence */
  const int32_t *w;        /* [n_seq][n_kv_heads] slot written this step (lf_cuda_qkv_rope) */
  const void *q;           /* bf16, query head h of sequence s at q[s * q_stride + h * head_dim],
                            * post-RoPE; 16-byte aligned rows */
  size_t q_stride;         /* elements between sequences; 0: n_kv_heads * group * head_dim */
  void *out;               /* bf16 [n_seq][n_kv_heads * group][head_dim] attention output */
  int group;               /* query heads per KV head, 1..8; query head h uses KV head h/group */
  int sink;                /* slots 0..sink-1 are never evicted */
  lf_policy policy;        /* longflow, full, streaming, h2o or rkv */
  int recent;              /* h2o: its protected window, the `recent` most recent slots by
                            * position (docs/DESIGN.md §3); >= 0, ignored by the others */
  float scale;             /* softmax scale, 1/sqrt(head_dim) */
  /* Split-K (flash decoding): each (sequence, KV head) is cut into n_splits blocks of slots.
   * 0: lf_cuda_decode_attn_splits() picks it. A request is raised to the fewest splits whose
   * logits fit in shared memory (64 KB per block) and capped at 64; the workspace size follows
   * the same rule. On sm_90, 2..8 splits combine inside a thread-block cluster (no workspace
   * used), more (or any count before sm_90) through the workspace. */
  int n_splits;
  void *workspace; /* >= lf_cuda_decode_attn_workspace_bytes(), prepared once with
                    * lf_cuda_decode_attn_workspace_init() and reused by every call */
  size_t workspace_bytes;
  /* Layer-scope eviction: NULL, or fp32 [n_seq][n_kv_heads][budget] where longflow and h2o
   * also write every candidate's score (slots >= sink, except w; h2o: its window too, which
   * lf_cuda_layer_argmin then excludes) for lf_cuda_layer_argmin; next is still written per head
   * (the layer argmin overwrites it). */
  float *scores;
} lf_decode_attn_args;

/* The split count the launcher uses for n_splits == 0 on a device with n_sm multiprocessors
 * (at most 8, one cluster, when the current device takes the cluster combine). */
int lf_cuda_decode_attn_splits(int n_seq, int n_kv_heads, int budget, int group, int head_dim,
                               int n_sm);

/* Workspace bytes for a call with this shape; n_splits as passed in the args (0: the automatic
 * choice on the current device, which this then queries). Calls with smaller n_seq or budget, or
 * fewer splits, fit in the same workspace. */
size_t lf_cuda_decode_attn_workspace_bytes(int n_seq, int n_kv_heads, int budget, int group,
                                           int head_dim, int n_splits);

/* Zeroes the workspace's arrival counters; needed once after allocation (each call leaves them
 * zeroed again). */
lf_status lf_cuda_decode_attn_workspace_init(void *workspace, size_t workspace_bytes,
                                             struct CUstream_st *stream);

/* Launches the fused kernel on stream; asynchronous. Argument errors are LF_ERR_INVALID_ARG or
 * LF_ERR_UNSUPPORTED, launch failures LF_ERR_BACKEND, all with a message in lf_last_error(). */
lf_status lf_cuda_decode_attn(const lf_decode_attn_args *a, struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif
#endif

/* Eviction on the GPU, the rules in one place (docs/DESIGN.md §3). The kernels that evict take
 * every decision from here:
 *  - which slot a new token is written to (the slot write, attention/kv_write.cu);
 *  - which slots may be evicted, and the key the argmin compares: (score bits << 32 | slot), so
 *    the smallest score wins and the lowest slot breaks ties (the fused decode kernel's scoring,
 *    attention/decode_attn_parts.cuh; the one-warp kernel and the layer-scope argmin,
 *    attention/decode_attn_generic.cu);
 *  - each policy's score of a slot from the attention mass it received this step: LongFlow's
 *    mass x ||v||_1, H2O's accumulated mass, StreamingLLM's position;
 *  - H2O's protected window of recent positions;
 *  - how many slots a decode write overwrites, the host's count (engine/cuda/forward.cu).
 * rkv's staged selection has its own kernel (attention/rkv_select.cu) and step rule
 * (attention/rkv_step.h). The CPU reference (attention/attention.c) states the same rules;
 * the GPU tests hold every kernel to it.
 *
 * Device code, except lf_evict_count_write (host and device). The window functions are called
 * by all NT threads of a block, which all get the result.
 */
#ifndef LF_EVICT_CUH
#define LF_EVICT_CUH

#include <limits.h>
#include <stdint.h>

#include "lfserve.h"

/* The slot a new token goes to: a free slot while n < budget, else `next` (chosen by the
 * previous step); -1 when nothing may be written (full policy with a full pool, or no valid
 * eviction target). */
static __device__ __forceinline__ int lf_evict_slot_for_write(int n, int next, int budget,
                                                              int sink, int policy) {
  if (n < budget) return n;
  if (policy == LF_POLICY_FULL) return -1;
  return next >= sink && next < budget ? next : -1;
}

/* Slots overwritten by one decode write into a pool holding n of budget slots, counted over
 * layers x KV heads (each head counted once): 0 while the pool fills, then every head evicts;
 * *n grows with the write. The host mirrors the device's fill count with it. */
static __host__ __device__ __forceinline__ uint64_t lf_evict_count_write(int *n, int budget,
                                                                        int n_layers,
                                                                        int n_kv_heads) {
  if (*n == budget) return (uint64_t)n_layers * (uint64_t)n_kv_heads;
  (*n)++;
  return 0;
}

/* May slot i be evicted? Not a sink (i < sink), not the slot written this step (ws), not inside
 * H2O's window (pos_i >= rfrom; rfrom INT_MAX when there is none). */
static __device__ __forceinline__ bool lf_evict_candidate(int i, int sink, int ws, int32_t pos_i,
                                                          int rfrom) {
  return i >= sink && i != ws && pos_i < rfrom;
}

/* The argmin's key of a slot: the score's bits above the slot (scores are >= 0, so their bits
 * order as the floats do), and the slot it names (-1 for the empty key ~0). */
static __device__ __forceinline__ unsigned long long lf_evict_key(uint32_t score_bits, int slot) {
  return ((unsigned long long)score_bits << 32) | (unsigned)slot;
}
static __device__ __forceinline__ unsigned long long lf_evict_key_f(float score, int slot) {
  return lf_evict_key(__float_as_uint(score), slot);
}
static __device__ __forceinline__ int32_t lf_evict_slot_of(unsigned long long key) {
  return key == ~0ull ? -1 : (int32_t)(key & 0xffffffffu);
}

/* LongFlow: the slot's contribution to this step's output, ||alpha v||_1 = mass x ||v||_1. */
static __device__ __forceinline__ float lf_evict_longflow_score(float vnorm, float mass) {
  return vnorm * mass;
}

/* H2O: the slot's accumulated mass after this step; the slot written this step (fresh) starts
 * from this step's mass alone. */
static __device__ __forceinline__ float lf_evict_h2o_acc(float acc, float mass, bool fresh) {
  return (fresh ? 0.0f : acc) + mass;
}

/* H2O's window. A pool's positions are distinct, so "the `recent` most recent filled slots"
 * (lf_attn_decode_ref's rank by position) is the set {i : pos[i] >= T} with T the recent-th
 * largest position. Any t with count(pos >= t) == recent gives the same set, so a caller that
 * can guess such a t (the new token's position - recent + 1: right whenever the window's
 * positions are contiguous, which is every step of steady decode) pays one block-wide count;
 * otherwise (SnapKV left gaps in the prompt's tail, or the guess is off) a bisection on the
 * value finds T exactly. */

/* count of i in [lo, hi) with pos[i] >= t, over the whole block; red: int [NT / 32] shared. */
template <int NT>
static __device__ __forceinline__ int h2o_count_ge(const int32_t *pos, int lo, int hi, int t,
                                                   int *red) {
  int c = 0;
  for (int i = lo + (int)threadIdx.x; i < hi; i += NT) c += pos[i] >= t;
  for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
  __syncthreads(); /* red may still be read from the previous call */
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = c;
  __syncthreads();
  c = 0;
#pragma unroll
  for (int w = 0; w < NT / 32; w++) c += red[w];
  return c;
}

/* The guess for T: the new token's position (in slot ws) - recent + 1; 0 when ws is no slot. */
static __device__ __forceinline__ int h2o_window_guess(const int32_t *pos, int n, int ws,
                                                       int recent) {
  return ws >= 0 && ws < n ? pos[ws] - recent + 1 : 0;
}

/* The window's threshold over the n filled slots of pos: slot i is protected iff
 * pos[i] >= the value returned (INT_MAX: no window, recent <= 0; INT_MIN: every slot, recent >=
 * n). t0 is the guess and c0 = count(pos[0..n) >= t0), which the caller may have summed across
 * the blocks of a cluster. */
template <int NT>
static __device__ int h2o_window_from(const int32_t *pos, int n, int recent, int t0, int c0,
                                      int *red) {
  if (recent <= 0) return INT_MAX;
  if (recent >= n) return INT_MIN;
  if (c0 == recent) return t0;
  /* invariant: count(pos >= lo) >= recent > count(pos >= hi + 1); every position is >= 0 */
  int lo = 0, hi = INT_MAX;
  if (c0 > recent)
    lo = t0 > 0 ? t0 : 0;
  else
    hi = t0 - 1; /* c0 < recent < n = count(pos >= 0): t0 > 0 */
  while (lo < hi) {
    const int mid = lo + (int)(((unsigned)hi - (unsigned)lo + 1u) / 2u);
    if (h2o_count_ge<NT>(pos, 0, n, mid, red) >= recent)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

/* The threshold for one block that sees all n slots. */
template <int NT>
static __device__ int h2o_window(const int32_t *pos, int n, int ws, int recent, int *red) {
  if (recent <= 0) return INT_MAX;
  if (recent >= n) return INT_MIN;
  const int t0 = h2o_window_guess(pos, n, ws, recent);
  return h2o_window_from<NT>(pos, n, recent, t0, h2o_count_ge<NT>(pos, 0, n, t0, red), red);
}

#endif

/* h2o's protected recent window on the GPU, shared by the decode kernels and the layer argmin.
 *
 * A pool's positions are distinct, so "the `recent` most recent filled slots" (lf_attn_decode_ref's
 * rank by position) is the set {i : pos[i] >= T} with T the recent-th largest position. Any t
 * with count(pos >= t) == recent gives the same set, so a caller that can guess such a t (the
 * new token's position - recent + 1: right whenever the window's positions are contiguous,
 * which is every step of steady decode) pays one block-wide count; otherwise (SnapKV left gaps
 * in the prompt's tail, or the guess is off) a bisection on the value finds T exactly.
 *
 * Device code only; every function is called by all NT threads of a block, which all get the
 * result.
 */
#ifndef LF_H2O_WINDOW_CUH
#define LF_H2O_WINDOW_CUH

#include <limits.h>
#include <stdint.h>

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

/* rkv's per-head step bookkeeping (attention.h: the rkv policy), in one place for the CPU step
 * (attention.c), both CUDA decode kernels and the selection kernel's due test. `since` counts the
 * decode steps after the head's last selection (-1: none yet, the pool still filling); n is the
 * head's filled slots after the step's write. Plain C, also compiled for the device.
 */
#ifndef LF_RKV_STEP_H
#define LF_RKV_STEP_H

#include <stdint.h>

#include "attention/attention.h"

#ifdef __CUDACC__
#define LF_RKV_FN static __host__ __device__ __forceinline__
#else
#define LF_RKV_FN static inline
#endif

/* The count after one more decode step. */
LF_RKV_FN int lf_rkv_advance(int since) {
  return since < 0 ? -1 : since + 1;
}

/* The steps left before the next selection at count since: budget - n before the first (it runs
 * when the pool fills), then stage - since. The selection is due at <= 0. */
LF_RKV_FN int lf_rkv_k_left(int since, int n, int budget, int stage) {
  return since < 0 ? budget - n : stage - since;
}

/* The observation window of a pool whose obs field is obs (0: LF_RKV_OBS, R-KV's). */
LF_RKV_FN int lf_rkv_obs_of(int obs) {
  return obs > 0 ? obs : LF_RKV_OBS;
}

/* Inside the observation window (k_left < obs) a step adds its mass to acc; this says whether it
 * zeroes acc first: at the window's first step, or at the first step after a selection when the
 * stage is shorter than the window. */
LF_RKV_FN int lf_rkv_window_reset(int since, int k_left, int obs) {
  return k_left == obs - 1 || (since == 1 && k_left < obs - 1);
}

/* The slot the next token overwrites: queue[since] inside the stage, else -1 (none chosen yet,
 * or a selection is due and will set it). */
LF_RKV_FN int32_t lf_rkv_next(const int32_t *queue, int since, int stage) {
  return since >= 0 && since < stage ? queue[since] : -1;
}

#endif

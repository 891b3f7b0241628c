/* rkv's selection on the GPU (rkv_select.cuh). */
#include "attention/rkv_select.cuh"

#include <cuda_runtime.h>
#include <limits.h>
#include <math.h>

#include "attention/attention.h"
#include "attention/pool_row.cuh"
#include "attention/rkv_step.h"
#include "base/error.h"

#define RK_NT 256
#define RK_NW (RK_NT / 32)
#define RK_UNR 4 /* rows scanned at once for a look-alike */
#define RK_DMAX LF_CUDA_RKV_MAX_HEAD_DIM

static __device__ double rk_block_max(double v, double *red) {
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = red[0];
  for (int w = 1; w < RK_NT / 32; w++) v = fmax(v, red[w]);
  return v;
}

/* The warp's sum, the same value in every lane (lane 0's, broadcast). */
static __device__ __forceinline__ double rk_warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return __shfl_sync(0xffffffffu, v, 0);
}

static __device__ double rk_block_sum(double v, double *red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = 0.0;
  for (int w = 0; w < RK_NT / 32; w++) v += red[w];
  return v;
}

/* (total, slot) order: the lower total first, ties to the lower slot. */
static __device__ __forceinline__ bool rk_before(double t, int s, double bt, int bs) {
  return t < bt || (t == bt && s < bs);
}

static size_t rk_pow2(int n) {
  size_t p = 1;
  while (p < (size_t)n) p <<= 1;
  return p;
}

/* Shared bytes for n filled slots: the ranks' keys (later the pooled importance), the slots in
 * position order, and five fp64 arrays. */
static __host__ __device__ size_t rk_smem_bytes(int n, size_t pow2) {
  return 8 * pow2 + 8 * (size_t)((n + 1) / 2) + 5 * 8 * (size_t)n;
}

static __global__ void __launch_bounds__(RK_NT) rkv_select_kernel(lf_rkv_select_args a) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ double red[RK_NT / 32];
  __shared__ int red_s[RK_NT / 32], red_j[RK_NT / 32];
  __shared__ double ksum[RK_DMAX]; /* the sum of the unit keys */
  const int B = a.pool.budget, D = a.pool.head_dim, nkv = a.pool.n_kv_heads;
  const int per_seq = nkv / a.heads_per_scope, tid = (int)threadIdx.x;
  const int seq = (int)blockIdx.x / per_seq, h0 = ((int)blockIdx.x % per_seq) * a.heads_per_scope;
  const size_t hidx0 = ((size_t)a.pool_ids[seq] * a.pool.n_layers + a.layer) * nkv + h0;
  const int n = a.pool.n[hidx0];
  /* due only: since is the count the decode kernel just left (block-uniform) */
  if (a.due_only && lf_rkv_k_left(a.pool.since[hidx0], n, B, a.pool.stage) > 0) return;
  int P = 1;
  while (P < n) P <<= 1;
  long long *key = (long long *)smem;
  double *pooled = (double *)smem; /* the keys' room, once the slots are ranked */
  int *slot_of = (int *)(smem + 8 * (size_t)P);
  double *nrm = (double *)(smem + 8 * (size_t)P + 8 * (size_t)((n + 1) / 2));
  double *imp = nrm + n, *csum = imp + n, *lastv = csum + n, *total = lastv + n;

  /* rank the filled slots by (position, slot): a bitonic sort of P keys */
  const int32_t *pos = a.pool.pos + hidx0 * B;
  for (int i = tid; i < P; i += RK_NT)
    key[i] = i < n ? (long long)pos[i] * (1LL << 32) + i : LLONG_MAX;
  __syncthreads();
  for (int k = 2; k <= P; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = tid; i < P; i += RK_NT) {
        const int ixj = i ^ j;
        if (ixj > i) {
          const long long x = key[i], y = key[ixj];
          if ((x > y) == ((i & k) == 0)) {
            key[i] = y;
            key[ixj] = x;
          }
        }
      }
      __syncthreads();
    }
  for (int i = tid; i < n; i += RK_NT) slot_of[i] = (int)(key[i] & 0xffffffffLL);
  __syncthreads();

  const int M = n - LF_RKV_OBS, half = LF_RKV_POOL_KERNEL / 2;
  const int warp = tid >> 5, lane = tid & 31, NDL = (D + 31) / 32; /* dims per lane */
  for (int j = tid; j < M; j += RK_NT) total[j] = 0.0;
  for (int g = 0; g < a.heads_per_scope; g++) {
    const size_t hidx = hidx0 + g;
    const float *acc = a.pool.acc + hidx * B;
    /* importance, and each row's norm (a warp per row, lanes over dims) */
    for (int j = warp; j < M; j += RK_NW) {
      const int s = slot_of[j];
      double ss = 0.0;
      for (int d = lane; d < D; d += 32) {
        const double v = pool_val(a.pool, a.pool.k, a.pool.k_scale, hidx, s, d);
        ss += v * v;
      }
      ss = rk_warp_sum(ss);
      if (lane == 0) {
        nrm[j] = sqrt(ss) + 1e-8;
        imp[j] = (double)acc[s] / ((double)a.group * LF_RKV_OBS);
      }
    }
    __syncthreads();
    for (int j = tid; j < M; j += RK_NT) { /* max-pool over the neighbours that exist */
      double mx = imp[j];
      for (int t = j - half; t <= j + half; t++)
        if (t >= 0 && t < M && imp[t] > mx) mx = imp[t];
      pooled[j] = mx;
    }
    /* the sum of the unit keys, dim by dim in rank order (as the twin adds it) */
    for (int d = tid; d < D; d += RK_NT) {
      double t = 0.0;
      for (int j = 0; j < M; j++)
        t += pool_val(a.pool, a.pool.k, a.pool.k_scale, hidx, slot_of[j], d) / nrm[j];
      ksum[d] = t;
    }
    __syncthreads();
    /* a warp per row x: its cosines' sum is its dot with ksum less its own square; its most
     * recent look-alike the first met scanning the others from the newest down, RK_UNR rows at
     * a time (every lane holds the same reduced dots, so the warp leaves together) */
    for (int x = warp; x < M; x += RK_NW) {
      const int sx = slot_of[x];
      double kx[RK_DMAX / 32], cs = 0.0, self = 0.0;
#pragma unroll
      for (int i = 0; i < RK_DMAX / 32; i++) {
        const int d = lane + 32 * i;
        kx[i] = i < NDL && d < D ? pool_val(a.pool, a.pool.k, a.pool.k_scale, hidx, sx, d) / nrm[x]
                                 : 0.0;
        if (i < NDL && d < D) {
          cs += kx[i] * ksum[d];
          self += kx[i] * kx[i];
        }
      }
      cs = rk_warp_sum(cs);
      self = rk_warp_sum(self);
      double lv = 0.0;
      bool found = false;
      for (int y0 = M - 1; y0 >= 0 && !found; y0 -= RK_UNR) {
        double dt[RK_UNR];
#pragma unroll
        for (int u = 0; u < RK_UNR; u++) {
          const int y = y0 - u;
          dt[u] = 0.0;
          if (y >= 0) {
            const int sy = slot_of[y];
#pragma unroll
            for (int i = 0; i < RK_DMAX / 32; i++) {
              const int d = lane + 32 * i;
              if (i < NDL && d < D)
                dt[u] += kx[i] * (double)pool_val(a.pool, a.pool.k, a.pool.k_scale, hidx, sy, d);
            }
          }
        }
#pragma unroll
        for (int u = 0; u < RK_UNR; u++) dt[u] = rk_warp_sum(dt[u]);
#pragma unroll
        for (int u = 0; u < RK_UNR; u++) {
          const int y = y0 - u;
          if (found || y < 0 || y == x) continue;
          const double c = dt[u] / nrm[y];
          if (c > LF_RKV_SIM_THRESHOLD) {
            lv = c;
            found = true;
          }
        }
      }
      if (lane == 0) {
        csum[x] = cs - self;
        lastv[x] = lv;
      }
    }
    __syncthreads();
    double m = -INFINITY;
    for (int j = tid; j < M; j += RK_NT) {
      csum[j] = (csum[j] - lastv[j]) / (double)M;
      m = fmax(m, csum[j]);
    }
    const double mmax = rk_block_max(m, red);
    double zl = 0.0;
    for (int j = tid; j < M; j += RK_NT) {
      csum[j] = exp(csum[j] - mmax);
      zl += csum[j];
    }
    const double z = rk_block_sum(zl, red);
    for (int j = tid; j < M; j += RK_NT)
      total[j] += LF_RKV_LAMBDA * pooled[j] - (1.0 - LF_RKV_LAMBDA) * (csum[j] / z);
    __syncthreads();
  }

  if (a.totals) {
    double *o = a.totals + (size_t)blockIdx.x * B;
    for (int i = tid; i < B; i += RK_NT) o[i] = NAN;
    __syncthreads();
    for (int j = tid; j < M; j += RK_NT) o[slot_of[j]] = total[j];
  }
  for (int j = tid; j < M; j += RK_NT)
    if (slot_of[j] < a.sink) total[j] = INFINITY;
  __syncthreads();
  /* the stage: stage rounds of a block-wide argmin over (total, slot) */
  for (int r = 0; r < a.pool.stage; r++) {
    double bt = INFINITY;
    int bs = INT_MAX, bj = -1;
    for (int j = tid; j < M; j += RK_NT)
      if (rk_before(total[j], slot_of[j], bt, bs)) bt = total[j], bs = slot_of[j], bj = j;
    for (int o = 16; o > 0; o >>= 1) {
      const double t2 = __shfl_xor_sync(0xffffffffu, bt, o);
      const int s2 = __shfl_xor_sync(0xffffffffu, bs, o), j2 = __shfl_xor_sync(0xffffffffu, bj, o);
      if (rk_before(t2, s2, bt, bs)) bt = t2, bs = s2, bj = j2;
    }
    if ((tid & 31) == 0) red[tid >> 5] = bt, red_s[tid >> 5] = bs, red_j[tid >> 5] = bj;
    __syncthreads();
    if (tid == 0) {
      for (int w = 1; w < RK_NT / 32; w++)
        if (rk_before(red[w], red_s[w], bt, bs)) bt = red[w], bs = red_s[w], bj = red_j[w];
      for (int g = 0; g < a.heads_per_scope; g++)
        a.pool.queue[(hidx0 + g) * a.pool.stage + r] = bs;
      if (bj >= 0) total[bj] = INFINITY;
    }
    __syncthreads();
  }
  if (tid < a.heads_per_scope) {
    a.pool.since[hidx0 + tid] = 0;
    if (a.due_only) a.pool.next[hidx0 + tid] = a.pool.queue[(hidx0 + tid) * a.pool.stage];
  }
}

extern "C" lf_status lf_cuda_rkv_select(const lf_rkv_select_args *a, struct CUstream_st *stream) {
  if (!a || !a->pool.k || !a->pool.pos || !a->pool.acc || !a->pool.n || !a->pool_ids ||
      !a->pool.queue || !a->pool.since)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_rkv_select: NULL argument");
  const int B = a->pool.budget, nkv = a->pool.n_kv_heads;
  if (B < 1 || B > LF_CUDA_RKV_MAX_BUDGET)
    return lf_error(LF_ERR_INVALID_ARG,
                    "lf_cuda_rkv_select: budget %d outside [1, %d] (policy rkv on the cuda "
                    "backend)", B, LF_CUDA_RKV_MAX_BUDGET);
  if (a->pool.head_dim < 1 || a->pool.head_dim > RK_DMAX)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_rkv_select: head_dim %d outside [1, %d]",
                    a->pool.head_dim, RK_DMAX);
  if (a->heads_per_scope < 1 || nkv % a->heads_per_scope || a->n_scopes < 1 || a->pool.stage < 1 ||
      a->group < 1 || a->sink < 0 || a->layer < 0 || a->layer >= a->pool.n_layers)
    return lf_error(LF_ERR_INVALID_ARG,
                    "lf_cuda_rkv_select: bad shape (heads_per_scope %d of %d KV heads, %d "
                    "scopes, stage %d, group %d, sink %d, layer %d)",
                    a->heads_per_scope, nkv, a->n_scopes, a->pool.stage, a->group, a->sink, a->layer);
  const size_t smem = rk_smem_bytes(B, rk_pow2(B));
  /* The limit is the largest budget's, set the same by every caller: engines in other threads
   * launch with other budgets, and a limit set per launch could fall under one of theirs
   * between its set and its launch. Per device, as the attribute is. */
  const size_t smem_max = rk_smem_bytes(LF_CUDA_RKV_MAX_BUDGET, rk_pow2(LF_CUDA_RKV_MAX_BUDGET));
  if (cudaFuncSetAttribute(rkv_select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           (int)smem_max) != cudaSuccess) {
    const cudaError_t e = cudaGetLastError();
    return lf_error(LF_ERR_BACKEND, "lf_cuda_rkv_select: %zu bytes of shared memory: %s",
                    smem_max, cudaGetErrorString(e));
  }
  rkv_select_kernel<<<a->n_scopes, RK_NT, smem, (cudaStream_t)stream>>>(*a);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return lf_error(LF_ERR_BACKEND, "lf_cuda_rkv_select: launch failed: %s", cudaGetErrorString(e));
  return LF_OK;
}

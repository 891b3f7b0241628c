/* rkv's selection on the GPU (rkv_select.cuh). */
#include "attention/rkv_select.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <math.h>

#include "attention/attention.h"
#include "attention/pool_row.cuh"
#include "attention/rkv_step.h"
#include "base/cuda_launch.cuh"
#include "base/cuda_ptx.cuh"
#include "base/error.h"
#include "base/kvq.h"

#define RK_NT 256
#define RK_NW (RK_NT / 32)
#define RK_DMAX LF_CUDA_RKV_MAX_HEAD_DIM
#define RK_ROWS 4                 /* rows a warp reads at once in the row passes */
#define RK_XT (RK_NW * 16)        /* x rows per tile of the look-alike scan: 16 per warp */
#define RK_YT 64                  /* y rows per tile: 8 mma columns of 8 */
#define RK_NJ 4                   /* mma columns computed at once */
#define RK_Q 64                   /* a warp's queue of pairs in the band, per tile */
#define RK_KS_MAX (RK_DMAX / 16)  /* k steps of 16 dims */
#define RK_LDW (RK_KS_MAX * 8 + 4) /* 32-bit words per tile row: the pad staggers the banks */
/* The scan's cosines come from fp32 sums of exact bf16 products (under int4 or a key mean, of a
 * two-term bf16 split), at most ~1e-5 from the fp64 value; one within RK_BAND of the threshold
 * is decided again in fp64 as the twin computes it. */
#define RK_BAND 5e-4f

static __device__ double rk_block_max(double v, double *red) {
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = red[0];
  for (int w = 1; w < RK_NW; w++) v = fmax(v, red[w]);
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
  for (int w = 0; w < RK_NW; w++) v += red[w];
  return v;
}

/* (total, slot) order: the lower total first, ties to the lower slot. */
static __device__ __forceinline__ bool rk_before(double t, int s, double bt, int bs) {
  return t < bt || (t == bt && s < bs);
}

/* Element d of a key row as the selection compares keys: the pool's value (pool_val) plus the
 * key mean the engine took from the key (mu, [head_dim], or NULL), an fp32 sum as the twin's. */
static __device__ __forceinline__ float rk_val(const lf_cuda_pool_view &p, const float *mu,
                                               size_t hidx, int slot, int d) {
  const float v = pool_val(p, p.k, p.k_scale, hidx, slot, d);
  return mu ? v + mu[d] : v;
}

/* Dims 2w and 2w + 1 of a key row as the scan multiplies them (zero past head_dim), packed as
 * two bf16: bf16 pools their values; fp8 and int8 their codes' values, exact in bf16 (the row's
 * scale is folded into the norm); under SPLIT (int4, or any dtype with a key mean) the value's
 * bf16 rounding in hi and the rest's in lo. */
template <bool SPLIT>
static __device__ __forceinline__ void rk_pair(const lf_cuda_pool_view &p, const float *mu,
                                               size_t hidx, int slot, int w, uint32_t &hi,
                                               uint32_t &lo) {
  const int d = 2 * w, D = p.head_dim;
  lo = 0;
  if (d >= D) {
    hi = 0;
    return;
  }
  if (SPLIT) {
    const float v0 = rk_val(p, mu, hidx, slot, d);
    const float v1 = d + 1 < D ? rk_val(p, mu, hidx, slot, d + 1) : 0.f;
    hi = bf16_pack(v0, v1);
    const __nv_bfloat162 h = *(const __nv_bfloat162 *)&hi;
    lo = bf16_pack(v0 - __low2float(h), v1 - __high2float(h));
  } else if (p.kv_dtype == LF_KV_BF16) {
    const __nv_bfloat16 *r = pool_row(p, p.k, hidx, slot);
    if (!(D & 1)) {
      hi = *(const uint32_t *)(r + d);
    } else {
      const uint32_t a = *(const uint16_t *)(r + d), b = d + 1 < D ? *(const uint16_t *)(r + d + 1) : 0u;
      hi = a | b << 16;
    }
  } else {
    const uint8_t *c = (const uint8_t *)p.k + (hidx * p.budget + slot) * (size_t)D;
    const int kf = lf_kvq_k_row(p.kv_dtype); /* the 8-bit K rows (k8v4's too) */
    hi = bf16_pack(lf_kvq_value(kf, c[d], 1.f), d + 1 < D ? lf_kvq_value(kf, c[d + 1], 1.f) : 0.f);
  }
}

/* The factor from a row's scan values to its values: the row's scale under fp8 and int8 without
 * a key mean (with one the scan takes the values, SPLIT). */
static __device__ __forceinline__ double rk_row_factor(const lf_cuda_pool_view &p, const float *mu,
                                                       size_t hidx, int slot) {
  if (mu) return 1.0;
  const int kf = lf_kvq_k_row(p.kv_dtype);
  return kf == LF_KV_INT8 || kf == LF_KV_FP8 ? (double)p.k_scale[hidx * p.budget + slot] : 1.0;
}

/* Dims 4 lane .. 4 lane + 3 of a key row (rk_val; zero past head_dim): one 8-byte load for bf16
 * rows of whole groups of 4. */
static __device__ __forceinline__ void rk_row4(const lf_cuda_pool_view &p, const float *mu,
                                               size_t hidx, int slot, int lane, float v[4]) {
  const int d0 = 4 * lane, D = p.head_dim;
  if (p.kv_dtype == LF_KV_BF16 && !(D & 3)) {
    if (d0 < D) {
      const uint2 u = *(const uint2 *)(pool_row(p, p.k, hidx, slot) + d0);
      v[0] = __uint_as_float(u.x << 16), v[1] = __uint_as_float(u.x & 0xffff0000u);
      v[2] = __uint_as_float(u.y << 16), v[3] = __uint_as_float(u.y & 0xffff0000u);
      if (mu) {
#pragma unroll
        for (int i = 0; i < 4; i++) v[i] += mu[d0 + i];
      }
    } else {
      v[0] = v[1] = v[2] = v[3] = 0.f;
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < 4; i++) v[i] = d0 + i < D ? rk_val(p, mu, hidx, slot, d0 + i) : 0.f;
}

/* The cosine of two rows in fp64 as the twin computes it: row x over its norm, dotted with row y,
 * over y's norm. */
static __device__ __forceinline__ double rk_cos(const lf_cuda_pool_view &p, const float *mu,
                                                size_t hidx, int sx, int sy, double nx, double ny) {
  double s = 0.0;
  for (int d = 0; d < p.head_dim; d++)
    s += (double)rk_val(p, mu, hidx, sx, d) / nx * (double)rk_val(p, mu, hidx, sy, d);
  return s / ny;
}

/* rk_cos by the whole warp (lanes over 4 dims each), in every lane. */
static __device__ __forceinline__ double rk_cos_warp(const lf_cuda_pool_view &p, const float *mu,
                                                     size_t hidx, int sx, int sy, double nx,
                                                     double ny, int lane) {
  float vx[4], vy[4];
  rk_row4(p, mu, hidx, sx, lane, vx);
  rk_row4(p, mu, hidx, sy, lane, vy);
  double s = 0.0;
#pragma unroll
  for (int i = 0; i < 4; i++) s += (double)vx[i] / nx * (double)vy[i];
  return rk_warp_sum(s) / ny;
}

/* Where the scratch area starts: 16-byte aligned, as the scan's asynchronous copies need. */
static __host__ __device__ size_t rk_scratch_at(int n, size_t pow2) {
  return (8 * pow2 + 8 * (size_t)((n + 1) / 2) + 3 * 8 * (size_t)n + 8 * (size_t)n + 15) & ~(size_t)15;
}

/* Shared bytes for n filled slots: the ranks' keys (later the pooled importance), the slots in
 * position order, three fp64 arrays (norms, redundancy, totals), the look-alikes and the scan's
 * inverse norms, and a scratch area (the unit keys' partial sums, then the scan's y tile, two
 * under SPLIT). */
static __host__ __device__ size_t rk_scratch_bytes(bool two_tiles) {
  const size_t tile = (two_tiles ? 2 : 1) * (size_t)RK_YT * RK_LDW * 4, sums = (size_t)RK_NW * RK_DMAX * 8;
  return tile > sums ? tile : sums;
}

static __host__ __device__ size_t rk_smem_bytes(int n, size_t pow2, bool two_tiles) {
  return rk_scratch_at(n, pow2) + rk_scratch_bytes(two_tiles);
}

/* The smallest power of two >= n. */
static __host__ __device__ size_t rk_pow2(int n) {
  size_t p = 1;
  while (p < (size_t)n) p <<= 1;
  return p;
}

/* A block's room in the workspace (budgets over LF_CUDA_RKV_SMEM_BUDGET): the arrays of
 * rk_scratch_at for a full pool of B slots, in whole 256 bytes. */
static __host__ __device__ size_t rk_ws_stride(int B) {
  return (rk_scratch_at(B, rk_pow2(B)) + 255) & ~(size_t)255;
}

/* The y tile whose first row is rank ybase (rows outside the ranks zero) into tile (and its lo
 * halves into yl under SPLIT). CP (bf16 rows of whole 16-byte chunks): asynchronous copies the
 * caller waits for (rk_wait); otherwise read, converted and stored here. */
template <bool CP, bool SPLIT>
static __device__ __forceinline__ void rk_load_tile(const lf_cuda_pool_view &p, const float *mu,
                                                    size_t hidx, const int *slot_of, int ybase,
                                                    int wpr, uint32_t *tile, uint32_t *yl) {
  if (CP) {
    const int cpr = wpr / 4, D = p.head_dim; /* 16-byte chunks per row */
    for (int q = (int)threadIdx.x; q < RK_YT * cpr; q += RK_NT) {
      const int r = q / cpr, c = q % cpr, y = ybase + r;
      const bool in = y >= 0 && 8 * c < D;
      const __nv_bfloat16 *src = in ? pool_row(p, p.k, hidx, slot_of[y]) + 8 * c
                                    : (const __nv_bfloat16 *)p.k;
      const unsigned dst = (unsigned)__cvta_generic_to_shared(tile + r * RK_LDW + 4 * c);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                   "r"(in ? 16 : 0));
    }
    asm volatile("cp.async.commit_group;\n" ::);
  } else {
#pragma unroll 4
    for (int q = (int)threadIdx.x; q < RK_YT * wpr; q += RK_NT) {
      const int r = q / wpr, w = q % wpr, y = ybase + r;
      uint32_t hi = 0, lo = 0;
      if (y >= 0) rk_pair<SPLIT>(p, mu, hidx, slot_of[y], w, hi, lo);
      tile[r * RK_LDW + w] = hi;
      if (SPLIT) yl[r * RK_LDW + w] = lo;
    }
  }
}

static __device__ __forceinline__ void rk_wait() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

/* The look-alike scan of one head: lastidx[x] = the newest rank y != x whose cosine with x is
 * over the threshold, or -1. Tiles of RK_XT x rows against RK_YT y rows from the newest down,
 * on the tensor cores; a tile of x rows stops once every row has found one. tile: CP two y
 * tiles (the next one's copies fly while this one is scanned), else one (two under SPLIT: hi
 * and lo). */
template <bool CP, bool SPLIT>
static __device__ void rk_scan(const lf_cuda_pool_view &p, const float *mu, size_t hidx, int M,
                               const int *slot_of, const double *nrm, const float *ninv,
                               int *lastidx, uint32_t *tile) {
  const int tid = (int)threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int KS = (p.head_dim + 15) / 16, WPR = KS * 8; /* words per row */
  uint32_t *yl = tile + RK_YT * RK_LDW;                 /* CP: the second buffer; SPLIT: lo */
  const float thr = (float)LF_RKV_SIM_THRESHOLD;
  /* per warp: its rows' newest look-alike in the tile, and the pairs in the band */
  __shared__ int tb_all[RK_NW][16], nq_all[RK_NW];
  __shared__ int2 rq_all[RK_NW][RK_Q];
  int *tb = tb_all[warp], *nq = &nq_all[warp];
  int2 *rq = rq_all[warp];
  if (lane < 16) tb[lane] = -1;
  if (lane == 0) *nq = 0;
  __syncwarp();
  for (int x0 = 0; x0 < M; x0 += RK_XT) {
    const int xa = x0 + warp * 16 + g, xb = xa + 8; /* this lane's two rows */
    uint32_t ah[RK_KS_MAX][4], al[RK_KS_MAX][4];
#pragma unroll
    for (int kk = 0; kk < RK_KS_MAX; kk++)
#pragma unroll
      for (int q = 0; q < 4; q++) {
        const int x = q & 1 ? xb : xa, w = kk * 8 + t + (q & 2 ? 4 : 0);
        ah[kk][q] = al[kk][q] = 0;
        if (kk < KS && x < M) rk_pair<SPLIT>(p, mu, hidx, slot_of[x], w, ah[kk][q], al[kk][q]);
      }
    const float nia = xa < M ? ninv[xa] : 0.f, nib = xb < M ? ninv[xb] : 0.f;
    /* a dot over its row's bar may be over the band's floor */
    const float bara = xa < M && nia > 0.f ? (thr - RK_BAND) / nia : INFINITY;
    const float barb = xb < M && nib > 0.f ? (thr - RK_BAND) / nib : INFINITY;
    int besta = -1, bestb = -1;
    bool done = __all_sync(0xffffffffu, (xa >= M) && (xb >= M));
    int ybase = M - RK_YT, buf = 0;
    if (CP) rk_load_tile<CP, SPLIT>(p, mu, hidx, slot_of, ybase, WPR, tile, yl);
    for (;;) {
      const uint32_t tb_sh = (uint32_t)__cvta_generic_to_shared(CP && buf ? yl : tile),
                     lb_sh = (uint32_t)__cvta_generic_to_shared(yl);
      if (CP) rk_wait();
      else rk_load_tile<CP, SPLIT>(p, mu, hidx, slot_of, ybase, WPR, tile, yl);
      __syncthreads();
      const int cur = ybase;
      const bool more = cur > 0;
      if (CP && more) /* the next tile's copies fly while this one is scanned */
        rk_load_tile<CP, SPLIT>(p, mu, hidx, slot_of, cur - RK_YT, WPR, buf ? tile : yl, nullptr);
      if (!done) {
        /* the newest look-alike in this tile of each of the warp's 16 rows: tb */
#pragma unroll 1
        for (int j0 = 0; j0 < RK_YT / 8; j0 += RK_NJ) {
          float c[RK_NJ][4];
#pragma unroll
          for (int jj = 0; jj < RK_NJ; jj++) c[jj][0] = c[jj][1] = c[jj][2] = c[jj][3] = 0.f;
          /* B fragments by ldmatrix: lanes 8i..8i+7 address rows j * 8.. of k half i (two k
           * steps per load) */
#pragma unroll
          for (int kk = 0; kk < RK_KS_MAX; kk += 2) {
            if (kk < KS) {
#pragma unroll
              for (int jj = 0; jj < RK_NJ; jj++) { /* RK_NJ independent chains */
                const uint32_t off =
                    4u * (uint32_t)(((j0 + jj) * 8 + (lane & 7)) * RK_LDW + kk * 8 + (lane >> 3) * 4);
                uint32_t b[4];
                ldsm_x4(b, tb_sh + off);
                mma_bf16(c[jj], ah[kk], b[0], b[1]);
                if (kk + 1 < KS) mma_bf16(c[jj], ah[kk + 1], b[2], b[3]);
                if (SPLIT) {
                  uint32_t bl[4];
                  ldsm_x4(bl, lb_sh + off);
                  mma_bf16(c[jj], al[kk], b[0], b[1]);
                  mma_bf16(c[jj], ah[kk], bl[0], bl[1]);
                  if (kk + 1 < KS) {
                    mma_bf16(c[jj], al[kk + 1], b[2], b[3]);
                    mma_bf16(c[jj], ah[kk + 1], bl[2], bl[3]);
                  }
                }
              }
            }
          }
          /* the cosine over the threshold's band, as c x ninv[y] > the row's bar: rare (rows
           * past M and y below 0 have zero products; the diagonal and look-alikes pass) */
          bool hit = false;
#pragma unroll
          for (int jj = 0; jj < RK_NJ; jj++) {
            const int y0 = cur + (j0 + jj) * 8 + 2 * t;
            const float n0 = ninv[max(y0, 0)], n1 = ninv[max(y0 + 1, 0)];
            hit |= c[jj][0] * n0 > bara || c[jj][1] * n1 > bara || c[jj][2] * n0 > barb ||
                   c[jj][3] * n1 > barb;
          }
          if (hit) {
#pragma unroll
            for (int jj = 0; jj < RK_NJ; jj++)
#pragma unroll
              for (int e = 0; e < 4; e++) {
                const int x = e < 2 ? xa : xb, y = cur + (j0 + jj) * 8 + 2 * t + (e & 1);
                if (y < 0 || y == x || x >= M || (e < 2 ? besta : bestb) >= 0) continue;
                const float cs = c[jj][e] * (e < 2 ? nia : nib) * ninv[y];
                const int row = e < 2 ? g : g + 8;
                if (cs > thr + RK_BAND) {
                  atomicMax(&tb[row], y);
                } else if (cs > thr - RK_BAND) { /* for the warp's fp64 check below */
                  const int q = atomicAdd(nq, 1);
                  if (q < RK_Q) rq[q] = make_int2(row, y);
                  else if (rk_cos(p, mu, hidx, slot_of[x], slot_of[y], nrm[x], nrm[y]) >
                           LF_RKV_SIM_THRESHOLD)
                    atomicMax(&tb[row], y);
                }
              }
          }
        }
        __syncwarp();
        /* the band's pairs, each by the whole warp in fp64 (those under a row's newest so far
         * cannot change it) */
        const int nqw = min(*nq, RK_Q);
        for (int q = 0; q < nqw; q++) {
          const int2 r = rq[q];
          if (r.y < tb[r.x]) continue;
          const int x = x0 + warp * 16 + r.x;
          if (rk_cos_warp(p, mu, hidx, slot_of[x], slot_of[r.y], nrm[x], nrm[r.y], lane) >
              LF_RKV_SIM_THRESHOLD && lane == 0)
            tb[r.x] = max(tb[r.x], r.y);
          __syncwarp();
        }
        const int na = tb[g], nb = tb[g + 8];
        __syncwarp();
        if (lane < 16) tb[lane] = -1;
        if (lane == 0) *nq = 0;
        __syncwarp();
        if (besta < 0) besta = na;
        if (bestb < 0) bestb = nb;
        done = __all_sync(0xffffffffu, (xa >= M || besta >= 0) && (xb >= M || bestb >= 0));
      }
      const int all_done = __syncthreads_and(done);
      if (all_done || !more) {
        if (CP) rk_wait(); /* copies in flight must land before the tile is reused */
        break;
      }
      ybase = cur - RK_YT;
      buf ^= 1;
    }
    if (t == 0) {
      if (xa < M) lastidx[xa] = besta;
      if (xb < M) lastidx[xb] = bestb;
    }
  }
  __syncthreads();
}

/* The filled slots ranked by (position, slot): a bitonic sort of P (a power of two >= n) keys;
 * slot_of[rank] is the slot. */
static __device__ void rk_rank(const int32_t *pos, int n, int P, long long *key, int *slot_of) {
  const int tid = (int)threadIdx.x;
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
}

/* One head's row pass over ranks < M: each row's norm (nrm, and ninv for the scan), its
 * importance (imp), and the sum of the unit keys (ksum, through each warp's partial sums in
 * part). A warp per row, each lane over 4 dims, RK_ROWS rows at once. */
static __device__ void rk_rows(const lf_cuda_pool_view &p, const float *mu, size_t hidx, int M,
                               const int *slot_of, int group, double *nrm, float *ninv,
                               double *imp, double *part, double *ksum) {
  const int tid = (int)threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const float *acc = p.acc + hidx * p.budget;
  double ks[4] = {0.0, 0.0, 0.0, 0.0};
  for (int j0 = warp * RK_ROWS; j0 < M; j0 += RK_NW * RK_ROWS) {
    float v[RK_ROWS][4];
    double ss[RK_ROWS];
#pragma unroll
    for (int u = 0; u < RK_ROWS; u++) {
      const int j = j0 + u;
      if (j < M) rk_row4(p, mu, hidx, slot_of[j], lane, v[u]);
      else v[u][0] = v[u][1] = v[u][2] = v[u][3] = 0.f;
      ss[u] = 0.0;
#pragma unroll
      for (int i = 0; i < 4; i++) ss[u] += (double)v[u][i] * v[u][i];
    }
#pragma unroll
    for (int u = 0; u < RK_ROWS; u++) {
      const int j = j0 + u;
      if (j >= M) break;
      const double nr = sqrt(rk_warp_sum(ss[u])) + 1e-8, inr = 1.0 / nr;
#pragma unroll
      for (int i = 0; i < 4; i++) ks[i] += (double)v[u][i] * inr;
      if (lane == 0) {
        const int s = slot_of[j];
        nrm[j] = nr;
        ninv[j] = (float)(rk_row_factor(p, mu, hidx, s) / nr);
        imp[j] = (double)acc[s] / ((double)group * lf_rkv_obs_of(p.obs));
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; i++) part[warp * RK_DMAX + 4 * lane + i] = ks[i];
  __syncthreads();
  for (int d = tid; d < p.head_dim; d += RK_NT) {
    double s = 0.0;
    for (int w = 0; w < RK_NW; w++) s += part[w * RK_DMAX + d];
    ksum[d] = s;
  }
}

/* pooled[j] = the largest imp over the LF_RKV_POOL_KERNEL neighbours of rank j that exist. */
static __device__ void rk_maxpool(const double *imp, int M, double *pooled) {
  const int half = LF_RKV_POOL_KERNEL / 2;
  for (int j = (int)threadIdx.x; j < M; j += RK_NT) {
    double mx = imp[j];
    for (int t = j - half; t <= j + half; t++)
      if (t >= 0 && t < M && imp[t] > mx) mx = imp[t];
    pooled[j] = mx;
  }
}

/* One head's redundancy before its softmax: red[x] = (x's cosines with the others, less the
 * one with its look-alike lastidx[x]) / M; the cosines' sum is x's dot with ksum less its own
 * square. A warp per row, RK_ROWS rows at once. */
static __device__ void rk_redundancy(const lf_cuda_pool_view &p, const float *mu, size_t hidx,
                                     int M, const int *slot_of, const double *nrm,
                                     const int *lastidx, const double *ksum, double *red) {
  const int warp = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31, D = p.head_dim;
  const double inv_m = 1.0 / (double)M;
  for (int x0 = warp * RK_ROWS; x0 < M; x0 += RK_NW * RK_ROWS) {
    float vx[RK_ROWS][4], vy[RK_ROWS][4];
    int yr[RK_ROWS];
#pragma unroll
    for (int u = 0; u < RK_ROWS; u++) {
      const int x = min(x0 + u, M - 1); /* rows past M repeat the last; not written */
      yr[u] = lastidx[x];
      rk_row4(p, mu, hidx, slot_of[x], lane, vx[u]);
      rk_row4(p, mu, hidx, slot_of[yr[u] >= 0 ? yr[u] : x], lane, vy[u]);
    }
#pragma unroll
    for (int u = 0; u < RK_ROWS; u++) {
      const int x = x0 + u;
      if (x >= M) break;
      double cs = 0.0, self = 0.0, lv = 0.0;
      const double inx = 1.0 / nrm[x];
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const double kx = vx[u][i] * inx;
        cs += kx * (4 * lane + i < D ? ksum[4 * lane + i] : 0.0);
        self += kx * kx;
        lv += kx * (double)vy[u][i];
      }
      for (int o = 16; o > 0; o >>= 1) {
        cs += __shfl_xor_sync(0xffffffffu, cs, o);
        self += __shfl_xor_sync(0xffffffffu, self, o);
        lv += __shfl_xor_sync(0xffffffffu, lv, o);
      }
      if (lane == 0) red[x] = ((cs - self) - (yr[u] >= 0 ? lv / nrm[yr[u]] : 0.0)) * inv_m;
    }
  }
}

/* total[j] += LF_RKV_LAMBDA pooled[j] - (1 - LF_RKV_LAMBDA) softmax(red)[j]; red is overwritten. */
static __device__ void rk_add_scores(int M, const double *pooled, double *red, double *total,
                                     double *scratch) {
  const int tid = (int)threadIdx.x;
  double m = -INFINITY;
  for (int j = tid; j < M; j += RK_NT) m = fmax(m, red[j]);
  const double mmax = rk_block_max(m, scratch);
  double zl = 0.0;
  for (int j = tid; j < M; j += RK_NT) {
    red[j] = exp(red[j] - mmax);
    zl += red[j];
  }
  const double z = rk_block_sum(zl, scratch);
  for (int j = tid; j < M; j += RK_NT)
    total[j] += LF_RKV_LAMBDA * pooled[j] - (1.0 - LF_RKV_LAMBDA) * (red[j] / z);
  __syncthreads();
}

/* The stage: stage rounds of a block-wide argmin over (total, slot), the sinks left out; round
 * r's slot is queue entry r of each of the scope's heads (queue: head hidx0's entry 0). */
static __device__ void rk_stage(int M, const int *slot_of, double *total, int sink, int stage,
                                int heads, int32_t *queue) {
  __shared__ double red[RK_NW];
  __shared__ int red_s[RK_NW], red_j[RK_NW];
  const int tid = (int)threadIdx.x;
  for (int j = tid; j < M; j += RK_NT)
    if (slot_of[j] < sink) total[j] = INFINITY;
  __syncthreads();
  for (int r = 0; r < stage; r++) {
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
      for (int w = 1; w < RK_NW; w++)
        if (rk_before(red[w], red_s[w], bt, bs)) bt = red[w], bs = red_s[w], bj = red_j[w];
      for (int g = 0; g < heads; g++) queue[(size_t)g * stage + r] = bs;
      if (bj >= 0) total[bj] = INFINITY;
    }
    __syncthreads();
  }
}

/* One block per scope, or (workspace) each block over scopes blockIdx.x, + gridDim.x, ... */
template <bool CP, bool SPLIT>
static __global__ void __launch_bounds__(RK_NT, 2) rkv_select_kernel(lf_rkv_select_args a) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ double red[RK_NW];
  __shared__ double ksum[RK_DMAX]; /* the sum of the unit keys */
  const int B = a.pool.budget, nkv = a.pool.n_kv_heads, tid = (int)threadIdx.x;
  const int per_seq = nkv / a.heads_per_scope;
  /* the arrays: in shared memory before the scratch area, or in this block's workspace room */
  unsigned char *arr = a.ws ? (unsigned char *)a.ws + (size_t)blockIdx.x * rk_ws_stride(B) : smem;
  for (int sc = (int)blockIdx.x; sc < a.n_scopes; sc += (int)gridDim.x) {
    const int seq = sc / per_seq, h0 = (sc % per_seq) * a.heads_per_scope;
    const size_t hidx0 = ((size_t)a.pool_ids[seq] * a.pool.n_layers + a.layer) * nkv + h0;
    const int n = a.pool.n[hidx0];
    /* due only: since is the count the decode kernel just left (block-uniform) */
    if (a.due_only && lf_rkv_k_left(a.pool.since[hidx0], n, B, a.pool.stage) > 0) continue;
    const int P = (int)rk_pow2(n);
    long long *key = (long long *)arr;
    double *pooled = (double *)arr; /* the keys' room, once the slots are ranked */
    int *slot_of = (int *)(arr + 8 * (size_t)P);
    double *nrm = (double *)(arr + 8 * (size_t)P + 8 * (size_t)((n + 1) / 2));
    double *csum = nrm + n, *total = csum + n; /* csum: importance, then redundancy */
    int *lastidx = (int *)(total + n);
    float *ninv = (float *)(lastidx + n);
    unsigned char *scratch = a.ws ? smem : smem + rk_scratch_at(n, (size_t)P);

    rk_rank(a.pool.pos + hidx0 * B, n, P, key, slot_of);
    const int M = n - lf_rkv_obs_of(a.pool.obs);
    for (int j = tid; j < M; j += RK_NT) total[j] = 0.0;
    for (int g = 0; g < a.heads_per_scope; g++) {
      const size_t hidx = hidx0 + g;
      const float *mu = a.k_mean ? a.k_mean + (size_t)(h0 + g) * a.pool.head_dim : nullptr;
      rk_rows(a.pool, mu, hidx, M, slot_of, a.group, nrm, ninv, csum, (double *)scratch, ksum);
      rk_maxpool(csum, M, pooled);
      __syncthreads();
      rk_scan<CP, SPLIT>(a.pool, mu, hidx, M, slot_of, nrm, ninv, lastidx, (uint32_t *)scratch);
      rk_redundancy(a.pool, mu, hidx, M, slot_of, nrm, lastidx, ksum, csum);
      __syncthreads();
      rk_add_scores(M, pooled, csum, total, red);
    }

    if (a.totals) {
      double *o = a.totals + (size_t)sc * B;
      for (int i = tid; i < B; i += RK_NT) o[i] = NAN;
      __syncthreads();
      for (int j = tid; j < M; j += RK_NT) o[slot_of[j]] = total[j];
    }
    rk_stage(M, slot_of, total, a.sink, a.pool.stage, a.heads_per_scope,
             a.pool.queue + hidx0 * a.pool.stage);
    if (tid < a.heads_per_scope) {
      a.pool.since[hidx0 + tid] = 0;
      if (a.due_only) a.pool.next[hidx0 + tid] = a.pool.queue[(hidx0 + tid) * a.pool.stage];
    }
    __syncthreads(); /* the arrays are the next scope's */
  }
}

extern "C" size_t lf_cuda_rkv_select_ws_bytes(int budget, int max_scopes) {
  if (budget <= LF_CUDA_RKV_SMEM_BUDGET || max_scopes < 1) return 0;
  int dev = 0, n_sm = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n_sm < 1) {
    cudaGetLastError();
    n_sm = 132;
  }
  const int blocks = max_scopes < 2 * n_sm ? max_scopes : 2 * n_sm;
  return (size_t)blocks * rk_ws_stride(budget);
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
  const bool in_ws = B > LF_CUDA_RKV_SMEM_BUDGET;
  const size_t stride = in_ws ? rk_ws_stride(B) : 0; /* one block's room in the workspace */
  if (in_ws && (!a->ws || a->ws_bytes < stride))
    return lf_error(LF_ERR_INVALID_ARG,
                    "lf_cuda_rkv_select: budget %d over %d needs a workspace of at least %zu "
                    "bytes (%zu given)", B, LF_CUDA_RKV_SMEM_BUDGET, stride,
                    a->ws ? a->ws_bytes : (size_t)0);
  if (a->pool.head_dim < 1 || a->pool.head_dim > RK_DMAX)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_rkv_select: head_dim %d outside [1, %d]",
                    a->pool.head_dim, RK_DMAX);
  if (a->heads_per_scope < 1 || nkv % a->heads_per_scope || a->n_scopes < 1 || a->pool.stage < 1 ||
      a->group < 1 || a->sink < 0 || a->layer < 0 || a->layer >= a->pool.n_layers)
    return lf_error(LF_ERR_INVALID_ARG,
                    "lf_cuda_rkv_select: bad shape (heads_per_scope %d of %d KV heads, %d "
                    "scopes, stage %d, group %d, sink %d, layer %d)",
                    a->heads_per_scope, nkv, a->n_scopes, a->pool.stage, a->group, a->sink, a->layer);
  /* a key mean makes every dtype's values fp32 sums, split as int4's are */
  const bool split = lf_kvq_k_row(a->pool.kv_dtype) == LF_KV_INT4 || a->k_mean;
  const bool cp = !split && a->pool.kv_dtype == LF_KV_BF16 && a->pool.head_dim % 8 == 0;
  const size_t smem = in_ws ? rk_scratch_bytes(split || cp) : rk_smem_bytes(B, rk_pow2(B), split || cp);
  lf_rkv_select_args k = *a;
  int grid = a->n_scopes;
  if (in_ws) {
    const size_t room = a->ws_bytes / stride;
    if ((size_t)grid > room) grid = (int)room;
  } else {
    k.ws = NULL; /* the arrays in shared memory */
  }
  const cudaError_t lim = split ? lf_smem_optin<rkv_select_kernel<false, true>>()
                          : cp  ? lf_smem_optin<rkv_select_kernel<true, false>>()
                                : lf_smem_optin<rkv_select_kernel<false, false>>();
  if (lim != cudaSuccess) {
    cudaGetLastError();
    return lf_error(LF_ERR_BACKEND, "lf_cuda_rkv_select: %zu bytes of shared memory: %s", smem,
                    cudaGetErrorString(lim));
  }
  if (split)
    rkv_select_kernel<false, true><<<grid, RK_NT, smem, (cudaStream_t)stream>>>(k);
  else if (cp)
    rkv_select_kernel<true, false><<<grid, RK_NT, smem, (cudaStream_t)stream>>>(k);
  else
    rkv_select_kernel<false, false><<<grid, RK_NT, smem, (cudaStream_t)stream>>>(k);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return lf_error(LF_ERR_BACKEND, "lf_cuda_rkv_select: launch failed: %s", cudaGetErrorString(e));
  return LF_OK;
}

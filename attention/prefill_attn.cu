/* Prefill attention, SnapKV selection and the chunk store (see prefill_attn.cuh).
 *
 * Attention for head_dim 64 and 128 runs on tensor cores (flash_kernel: mma.sync m16n8k16 bf16,
 * fp32 accumulation, online softmax, sm_80 and later); other head dims take the one-warp kernel
 * (warp_kernel). SnapKV scoring and the store are small kernels beside them. */
#include "attention/prefill_attn.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <float.h>
#include <stdint.h>

#include "attention/flash_tile.cuh"
#include "attention/kv_write.cuh"
#include "attention/pool_row.cuh"
#include "base/cuda_check.h"
#include "base/cuda_ptx.cuh"

#define ATT_DMAX 256
#define ATT_ND (ATT_DMAX / 32) /* dims per lane */

/* ---- tensor-core prefill ---------------------------------------------------------------------
 * One block of FL_WARPS warps per (query head, 16 * MT * FL_WARPS queries of the chunk); warp w
 * owns MT consecutive 16-row tiles of the block's queries. The block walks the keys it can see
 * (the n0 pool slots, then the chunk up to its last query) FL_N at a time: K and V tiles come into
 * shared memory by cp.async, double-buffered (the next tile loads while this one computes);
 * S = Q K^T and O += P V are m16n8k16 MMAs fed by ldmatrix, with P rounded to bf16 as the MMA's A
 * operand while the softmax sums stay fp32. Rows of D bf16 are stored with their 16-byte chunks
 * XOR-swizzled by (row % 8), so the 8 row addresses of every ldmatrix hit 8 different bank
 * groups. Later query tiles see more keys: they are launched first.
 *
 * MT is the number of 16-row tiles a warp owns. Each K or V fragment a warp reads from shared
 * memory feeds MT MMAs, so MT = 2 halves the shared-memory reads per MMA and the K/V tiles a
 * chunk loads from L2; the warp then keeps 2x the accumulators, so its Q fragments are re-read
 * from a Q tile that stays in shared memory instead of being held in registers. MT = 1 (64-query
 * blocks, Q in registers) makes twice the blocks, which short chunks need to fill the SMs.
 * lf_cuda_prefill_attn picks by grid size (flash_tiles_auto). Both give the same bits: a row
 * runs the same MMAs and softmax steps in the same order either way (a row of a 128-query block
 * also walks a tile it cannot see, which adds exactly 0 and leaves its max alone). */
template <int MT> struct fl_tile {
  static constexpr int M = 16 * MT * FL_WARPS; /* queries a block */
  /* MT 1, head_dim 128: three blocks an SM, 64 KB of shared memory each (the Q tile lives in K's
   * second buffer) and at most 168 registers a thread. MT 2: two blocks, 96 KB each (K, V and a
   * resident Q tile) and up to 255 registers (128 fp32 O accumulators and 64 S a thread). */
  static constexpr int MIN_BLOCKS = MT == 1 ? 3 : 2;
  template <int D> static constexpr size_t shm_bytes() {
    return (size_t)(4 * FL_N + (MT == 1 ? 0 : M)) * D * sizeof(__nv_bfloat16);
  }
};
static_assert(fl_tile<1>::M == FL_N, "MT 1 stores its Q tile in a K tile buffer");

/* flash_kernel's phases, one key tile at a time (forced inline: compiled as one body). */

/* S = Q K^T of this warp's 16 MT rows and the FL_N keys of tile tk; MT 1 takes Q from the
 * fragments qf held in registers, MT 2 from the Q tile sq. */
template <int D, int MT>
static __device__ __forceinline__ void fl_qk(float (&s)[MT][FL_N / 8][4],
                                             const uint32_t (&qf)[MT == 1 ? D / 16 : 1][4],
                                             const __nv_bfloat16 *sq, const __nv_bfloat16 *tk,
                                             int wrow, int lane) {
  constexpr int KS = D / 16;
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
#pragma unroll
    for (int i = 0; i < FL_N / 8; i++)
      s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < KS; ks++) {
    uint32_t qa[MT][4];
    if constexpr (MT == 1) {
#pragma unroll
      for (int e = 0; e < 4; e++) qa[0][e] = qf[ks][e];
    } else {
#pragma unroll
      for (int mt = 0; mt < MT; mt++) fl_load_qa<D>(qa[mt], sq, wrow + 16 * mt, ks, lane);
    }
#pragma unroll
    for (int n2 = 0; n2 < FL_N / 16; n2++) {
      uint32_t r[4];
      ldsm_x4(r, fl_smem(tk + fl_sw<D>(n2 * 16 + (lane % 8) + 8 * (lane / 16),
                                       2 * ks + (lane / 8) % 2)));
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        mma_bf16(s[mt][2 * n2], qa[mt], r[0], r[1]);
        mma_bf16(s[mt][2 * n2 + 1], qa[mt], r[2], r[3]);
      }
    }
  }
}

/* The tile's scores into log2 units (sl2), keys a row must not see masked (masked: the tile
 * reaches past some row's last key, or past nk), then the online softmax: s becomes the rows'
 * exp2 weights, m and l the running max and this thread's part of the sum, o rescaled. */
template <int D, int MT>
static __device__ __forceinline__ void fl_softmax(float (&s)[MT][FL_N / 8][4],
                                                  float (&o)[MT][D / 8][4], float (&m)[2 * MT],
                                                  float (&l)[2 * MT], int k0, int r0, int n0,
                                                  int nk, int q0, int wrow, float sl2, int lane) {
  const bool masked = k0 + FL_N - 1 > n0 + q0 + wrow || k0 + FL_N > nk;
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
    const int lim0 = n0 + r0 + 16 * mt, lim1 = lim0 + 8; /* last key each row sees */
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int i = 0; i < FL_N / 8; i++)
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int kk = k0 + i * 8 + 2 * (lane % 4) + e;
        float x0 = s[mt][i][e] * sl2, x1 = s[mt][i][2 + e] * sl2;
        if (masked) {
          if (kk > lim0 || kk >= nk) x0 = -INFINITY;
          if (kk > lim1 || kk >= nk) x1 = -INFINITY;
        }
        s[mt][i][e] = x0;
        s[mt][i][2 + e] = x1;
        mx0 = fmaxf(mx0, x0);
        mx1 = fmaxf(mx1, x1);
      }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
    }
    /* a row sees key 0 in tile 0, so mn is finite from there on; a row that sees none of
     * this tile's keys keeps m (exp2(-inf - m) = 0 below) */
    const float mn0 = fmaxf(m[2 * mt], mx0), mn1 = fmaxf(m[2 * mt + 1], mx1);
    const float c0 = fl_ex2(m[2 * mt] - mn0), c1 = fl_ex2(m[2 * mt + 1] - mn1);
    m[2 * mt] = mn0;
    m[2 * mt + 1] = mn1;
    float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
    for (int i = 0; i < FL_N / 8; i++) {
      s[mt][i][0] = fl_ex2(s[mt][i][0] - mn0);
      s[mt][i][1] = fl_ex2(s[mt][i][1] - mn0);
      s[mt][i][2] = fl_ex2(s[mt][i][2] - mn1);
      s[mt][i][3] = fl_ex2(s[mt][i][3] - mn1);
      ps0 += s[mt][i][0] + s[mt][i][1];
      ps1 += s[mt][i][2] + s[mt][i][3];
    }
    l[2 * mt] = l[2 * mt] * c0 + ps0;
    l[2 * mt + 1] = l[2 * mt + 1] * c1 + ps1;
#pragma unroll
    for (int i = 0; i < D / 8; i++) {
      o[mt][i][0] *= c0;
      o[mt][i][1] *= c0;
      o[mt][i][2] *= c1;
      o[mt][i][3] *= c1;
    }
  }

}

/* O += P V over the tile tv, P from the S accumulators as bf16 A fragments. */
template <int D, int MT>
static __device__ __forceinline__ void fl_pv(float (&o)[MT][D / 8][4],
                                             float (&s)[MT][FL_N / 8][4],
                                             const __nv_bfloat16 *tv, int lane) {
#pragma unroll
  for (int kt = 0; kt < FL_N / 16; kt++) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      a[mt][0] = bf16_pack(s[mt][2 * kt][0], s[mt][2 * kt][1]);
      a[mt][1] = bf16_pack(s[mt][2 * kt][2], s[mt][2 * kt][3]);
      a[mt][2] = bf16_pack(s[mt][2 * kt + 1][0], s[mt][2 * kt + 1][1]);
      a[mt][3] = bf16_pack(s[mt][2 * kt + 1][2], s[mt][2 * kt + 1][3]);
    }
#pragma unroll
    for (int d2 = 0; d2 < D / 16; d2++) {
      uint32_t r[4];
      ldsm_x4_t(r, fl_smem(tv + fl_sw<D>(kt * 16 + (lane % 8) + 8 * ((lane / 8) % 2),
                                         2 * d2 + lane / 16)));
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        mma_bf16(o[mt][2 * d2], a[mt], r[0], r[1]);
        mma_bf16(o[mt][2 * d2 + 1], a[mt], r[2], r[3]);
      }
    }
  }
}

/* The rows' outputs O / l as bf16 into out [n_tok][n_heads][D] (head h), and with ml their
 * (max logit, sum of exp(logit - max)) in natural units, as the one-warp kernel writes them. */
template <int D, int MT>
static __device__ __forceinline__ void fl_store(const float (&o)[MT][D / 8][4],
                                                const float (&m)[2 * MT], const float (&l)[2 * MT],
                                                int r0, int n_tok, int n_heads, int h,
                                                __nv_bfloat16 *out, float *ml, int lane) {
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
    const int ra = r0 + 16 * mt, rb = ra + 8;
    float la = l[2 * mt], lb = l[2 * mt + 1];
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      la += __shfl_xor_sync(0xffffffffu, la, off);
      lb += __shfl_xor_sync(0xffffffffu, lb, off);
    }
    const float ia = 1.0f / la, ib = 1.0f / lb;
#pragma unroll
    for (int i = 0; i < D / 8; i++) {
      const int d = i * 8 + 2 * (lane % 4);
      if (ra < n_tok)
        *(uint32_t *)(out + ((size_t)ra * n_heads + h) * D + d) =
            bf16_pack(o[mt][i][0] * ia, o[mt][i][1] * ia);
      if (rb < n_tok)
        *(uint32_t *)(out + ((size_t)rb * n_heads + h) * D + d) =
            bf16_pack(o[mt][i][2] * ib, o[mt][i][3] * ib);
    }
    if (ml && lane % 4 == 0) {
      if (ra < n_tok) {
        ml[((size_t)ra * n_heads + h) * 2] = m[2 * mt] / FL_LOG2E;
        ml[((size_t)ra * n_heads + h) * 2 + 1] = la;
      }
      if (rb < n_tok) {
        ml[((size_t)rb * n_heads + h) * 2] = m[2 * mt + 1] / FL_LOG2E;
        ml[((size_t)rb * n_heads + h) * 2 + 1] = lb;
      }
    }
  }
}

template <int D, int MT>
static __global__ void __launch_bounds__(FL_WARPS * 32, fl_tile<MT>::MIN_BLOCKS)
    flash_kernel(lf_cuda_pool_view p, int pool, int layer, int n0, int n_heads, int n_tok,
                 const __nv_bfloat16 *q, const __nv_bfloat16 *k, const __nv_bfloat16 *v,
                 float scale, __nv_bfloat16 *out, float *ml) {
  constexpr int FL_M = fl_tile<MT>::M;
  extern __shared__ __align__(128) unsigned char fl_shm[];
  __nv_bfloat16 *sk = (__nv_bfloat16 *)fl_shm; /* [2][FL_N][D] */
  __nv_bfloat16 *sv = sk + 2 * FL_N * D;
  /* MT 1: the Q tile borrows K's second buffer until qf is read; MT 2: [FL_M][D] after V */
  __nv_bfloat16 *sq = MT == 1 ? sk + FL_N * D : sv + 2 * FL_N * D;
  constexpr int CH = D / 8, KS = D / 16;
  const int h = blockIdx.y, hkv = p.n_kv_heads, g = h / (n_heads / hkv);
  const int q0 = (gridDim.x - 1 - blockIdx.x) * FL_M; /* heaviest tiles first */
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wrow = warp * 16 * MT; /* the warp's first query, within the block */
  const size_t hidx = ((size_t)pool * p.n_layers + layer) * hkv + g;
  const __nv_bfloat16 *pk = (const __nv_bfloat16 *)p.k + hidx * p.budget * D;
  const __nv_bfloat16 *pv = (const __nv_bfloat16 *)p.v + hidx * p.budget * D;
  const __nv_bfloat16 *ck = k + (size_t)g * D, *cv = v + (size_t)g * D;
  const int nk = n0 + n_tok;                                    /* keys of the chunk's last query */
  const int nvis = min(nk, n0 + q0 + FL_M);                     /* keys this block sees */
  const int ntiles = (nvis + FL_N - 1) / FL_N;

  for (int i = threadIdx.x; i < FL_M * CH; i += FL_WARPS * 32) {
    const int row = i / CH, ch = i % CH, t = q0 + row;
    const __nv_bfloat16 *src = q + ((size_t)(t < n_tok ? t : 0) * n_heads + h) * D + ch * 8;
    fl_cp16(fl_smem(sq + fl_sw<D>(row, ch)), src, t < n_tok);
  }
  fl_load_kv<D>(sk, pk, ck, hkv * D, 0, n0, nk);
  fl_load_kv<D>(sv, pv, cv, hkv * D, 0, n0, nk);
  fl_commit();
  fl_wait<0>();
  __syncthreads();
  uint32_t qf[MT == 1 ? KS : 1][4];
  if constexpr (MT == 1) {
#pragma unroll
    for (int ks = 0; ks < KS; ks++) fl_load_qa<D>(qf[ks], sq, wrow, ks, lane);
    __syncthreads(); /* every warp holds its Q fragments before tile 1 overwrites the Q tile */
  }

  float o[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
#pragma unroll
    for (int i = 0; i < D / 8; i++) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.0f;
  /* row max and this thread's part of the row sum (the quad adds them at the end), for rows
   * r0 + 16 mt (index 2 mt) and r0 + 16 mt + 8 (2 mt + 1) */
  float m[2 * MT], l[2 * MT];
#pragma unroll
  for (int i = 0; i < 2 * MT; i++) m[i] = -INFINITY, l[i] = 0.0f;
  const float sl2 = scale * FL_LOG2E;
  const int r0 = q0 + wrow + lane / 4; /* this thread's first row (chunk index) */

  for (int j = 0; j < ntiles; j++) {
    const int b = j & 1, k0 = j * FL_N;
    if (j + 1 < ntiles) {
      fl_load_kv<D>(sk + (b ^ 1) * FL_N * D, pk, ck, hkv * D, k0 + FL_N, n0, nk);
      fl_load_kv<D>(sv + (b ^ 1) * FL_N * D, pv, cv, hkv * D, k0 + FL_N, n0, nk);
      fl_commit();
      fl_wait<1>();
    } else {
      fl_wait<0>();
    }
    __syncthreads();
    const __nv_bfloat16 *tk = sk + b * FL_N * D, *tv = sv + b * FL_N * D;

    float s[MT][FL_N / 8][4];
    fl_qk<D, MT>(s, qf, sq, tk, wrow, lane);
    fl_softmax<D, MT>(s, o, m, l, k0, r0, n0, nk, q0, wrow, sl2, lane);
    fl_pv<D, MT>(o, s, tv, lane);
    __syncthreads(); /* the next iteration's loads overwrite the other buffer's neighbour */
  }

  fl_store<D, MT>(o, m, l, r0, n_tok, n_heads, h, out, ml, lane);
}

template <int D, int MT>
static lf_status flash_launch(const lf_cuda_pool_view *pv, int pool, int layer, int n0,
                              int n_heads, int n_tok, const void *q, const void *k, const void *v,
                              float scale, void *out, float *ml, cudaStream_t stream) {
  const size_t shm = fl_tile<MT>::template shm_bytes<D>();
  /* set on every call: the attribute belongs to the current device, and the call is cheap */
  LF_CUDA_CHECK(cudaFuncSetAttribute(flash_kernel<D, MT>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm));
  const dim3 grid((unsigned)((n_tok + fl_tile<MT>::M - 1) / fl_tile<MT>::M), (unsigned)n_heads);
  flash_kernel<D, MT><<<grid, FL_WARPS * 32, shm, stream>>>(
      *pv, pool, layer, n0, n_heads, n_tok, (const __nv_bfloat16 *)q, (const __nv_bfloat16 *)k,
      (const __nv_bfloat16 *)v, scale, (__nv_bfloat16 *)out, ml);
  LF_CUDA_CHECK_LAUNCH("prefill flash_kernel");
  return LF_OK;
}

/* ---- other head dims: one warp per (query head h, token t), grid [n_heads, n_tok]. Keys come
 * 32 at a time, lane j computing key j's logit; an online softmax keeps (max, sum) and each lane
 * accumulates the output dims lane, lane + 32, ... */
static __global__ void warp_kernel(lf_cuda_pool_view p, int pool, int layer, int n0,
                                           int n_heads, const __nv_bfloat16 *q,
                                           const __nv_bfloat16 *k, const __nv_bfloat16 *v,
                                           float scale, __nv_bfloat16 *out, float *ml) {
  __shared__ float qs[ATT_DMAX];
  const int h = blockIdx.x, t = blockIdx.y, lane = threadIdx.x, D = p.head_dim;
  const int hkv = p.n_kv_heads, g = h / (n_heads / hkv);
  const size_t hidx = ((size_t)pool * p.n_layers + layer) * hkv + g;
  const __nv_bfloat16 *qr = q + ((size_t)t * n_heads + h) * D;
  for (int d = lane; d < D; d += 32) qs[d] = __bfloat162float(qr[d]);
  __syncwarp();
  const int nk = n0 + t + 1;
  float m = -FLT_MAX, s = 0.0f, acc[ATT_ND];
#pragma unroll
  for (int i = 0; i < ATT_ND; i++) acc[i] = 0.0f;
  for (int base = 0; base < nk; base += 32) {
    const int kk = base + lane;
    float l = -FLT_MAX;
    if (kk < nk) {
      const __nv_bfloat16 *kr =
          kk < n0 ? pool_row(p, p.k, hidx, kk) : k + ((size_t)(kk - n0) * hkv + g) * D;
      float dot = 0.0f;
      for (int d = 0; d < D; d++) dot += qs[d] * __bfloat162float(kr[d]);
      l = dot * scale;
    }
    float tm = l;
    for (int o = 16; o > 0; o >>= 1) tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, o));
    const float mn = fmaxf(m, tm);
    const float corr = expf(m - mn);
    const float pj = kk < nk ? expf(l - mn) : 0.0f;
    float ps = pj;
    for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
    s = s * corr + ps;
    m = mn;
#pragma unroll
    for (int i = 0; i < ATT_ND; i++) acc[i] *= corr;
    const int cnt = nk - base < 32 ? nk - base : 32;
    for (int j = 0; j < cnt; j++) {
      const float pb = __shfl_sync(0xffffffffu, pj, j);
      const int kj = base + j;
      const __nv_bfloat16 *vr =
          kj < n0 ? pool_row(p, p.v, hidx, kj) : v + ((size_t)(kj - n0) * hkv + g) * D;
#pragma unroll
      for (int i = 0; i < ATT_ND; i++) {
        const int d = lane + 32 * i;
        if (d < D) acc[i] += pb * __bfloat162float(vr[d]);
      }
    }
  }
  __nv_bfloat16 *o = out + ((size_t)t * n_heads + h) * D;
#pragma unroll
  for (int i = 0; i < ATT_ND; i++) {
    const int d = lane + 32 * i;
    if (d < D) o[d] = __float2bfloat16(acc[i] / s);
  }
  if (ml && lane == 0) {
    ml[((size_t)t * n_heads + h) * 2] = m;
    ml[((size_t)t * n_heads + h) * 2 + 1] = s;
  }
}

/* Which tiling a chunk gets (measured: bench/RESULTS.md, "Prefill attention kernel"). head_dim
 * 128: MT 2 is level or ahead once its grid covers half the SMs; below that MT 1's twice as
 * many blocks spread the chunk wider. head_dim 64, where MT 1 fits three blocks an SM against
 * MT 2's two: MT 2 only from two full waves of its two blocks an SM. */
static lf_status flash_tiles_auto(int head_dim, int n_heads, int n_tok, int *mt) {
  int dev = 0, n_sm = 0;
  LF_CUDA_CHECK(cudaGetDevice(&dev));
  LF_CUDA_CHECK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev));
  const long blocks2 = (long)((n_tok + fl_tile<2>::M - 1) / fl_tile<2>::M) * n_heads;
  *mt = (head_dim == 128 ? 2 * blocks2 >= n_sm : blocks2 >= 4L * n_sm) ? 2 : 1;
  return LF_OK;
}

/* ---- quantized pools: the chunk's attention reads the pool's n0 slots through a bf16 copy ---- */

/* One warp per (slot, KV head) of (pool, layer): the dequantized row (base/kvq.h), rounded to
 * bf16, into the scratch [g][slot][D]. */
static __global__ void pool_dequant_kernel(lf_cuda_pool_view p, int pool, int layer, int n0) {
  const int slot = blockIdx.x * 4 + threadIdx.y, g = blockIdx.y, lane = threadIdx.x;
  if (slot >= n0) return;
  const int D = p.head_dim;
  const size_t hidx = ((size_t)pool * p.n_layers + layer) * p.n_kv_heads + g;
  const size_t drow = ((size_t)g * p.budget + slot) * D;
  __nv_bfloat16 *kd = (__nv_bfloat16 *)p.deq_k + drow, *vd = (__nv_bfloat16 *)p.deq_v + drow;
  for (int d = lane; d < D; d += 32) {
    kd[d] = __float2bfloat16(pool_val(p, p.k, p.k_scale, hidx, slot, d));
    vd[d] = __float2bfloat16(pool_val(p, p.v, p.v_scale, hidx, slot, d));
  }
}

extern "C" lf_status lf_cuda_pool_dequant(const lf_cuda_pool_view *pv, int pool, int layer, int n0,
                                          cudaStream_t stream) {
  if (!pv || pv->kv_dtype == LF_KV_BF16 || !lf_kvq_fits(pv->kv_dtype, pv->head_dim) || !pv->deq_k ||
      !pv->deq_v || !pv->k_scale ||
      !pv->v_scale || n0 < 0 || n0 > pv->budget || layer < 0 || layer >= pv->n_layers)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_pool_dequant: bad arguments");
  if (n0 == 0) return LF_OK;
  pool_dequant_kernel<<<dim3((unsigned)((n0 + 3) / 4), (unsigned)pv->n_kv_heads), dim3(32, 4), 0,
                        stream>>>(*pv, pool, layer, n0);
  LF_CUDA_CHECK_LAUNCH("pool_dequant_kernel");
  return LF_OK;
}

/* flash_tile.cuh */
lf_status lf_cuda_read_view(const lf_cuda_pool_view *pv, int *pool, int *layer, int n0, int fill,
                            cudaStream_t stream, lf_cuda_pool_view *rv) {
  *rv = *pv;
  if (pv->kv_dtype == LF_KV_BF16) return LF_OK;
  if (!lf_kvq_fits(pv->kv_dtype, pv->head_dim))
    return lf_error(LF_ERR_UNSUPPORTED, "prefill attention: kv dtype %d, head_dim %d",
                    pv->kv_dtype, pv->head_dim);
  if (fill) LF_TRY(lf_cuda_pool_dequant(pv, *pool, *layer, n0, stream));
  rv->k = pv->deq_k;
  rv->v = pv->deq_v;
  rv->n_layers = 1;
  rv->kv_dtype = LF_KV_BF16;
  *pool = 0;
  *layer = 0;
  return LF_OK;
}

extern "C" lf_status lf_cuda_prefill_attn_tiles(const lf_cuda_pool_view *pv, int pool, int layer,
                                                int n0, int n_heads, int n_tok, const void *q,
                                                const void *k, const void *v, float scale,
                                                void *out, float *ml, int warp_tiles,
                                                cudaStream_t stream) {
  if (!pv || !q || !k || !v || !out || pv->head_dim > ATT_DMAX || n_heads % pv->n_kv_heads ||
      n_tok < 0 || n_tok > 65535 || n0 < 0 || n0 > pv->budget || warp_tiles < 0 || warp_tiles > 2)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_prefill_attn: bad arguments");
  if (n_tok == 0) return LF_OK;
  lf_cuda_pool_view rv;
  LF_TRY(lf_cuda_read_view(pv, &pool, &layer, n0, 1, stream, &rv));
  pv = &rv;
  if (pv->head_dim == 128 || pv->head_dim == 64) {
    int mt = warp_tiles;
    if (!mt) LF_TRY(flash_tiles_auto(pv->head_dim, n_heads, n_tok, &mt));
    if (pv->head_dim == 128)
      return mt == 2 ? flash_launch<128, 2>(pv, pool, layer, n0, n_heads, n_tok, q, k, v, scale,
                                            out, ml, stream)
                     : flash_launch<128, 1>(pv, pool, layer, n0, n_heads, n_tok, q, k, v, scale,
                                            out, ml, stream);
    return mt == 2 ? flash_launch<64, 2>(pv, pool, layer, n0, n_heads, n_tok, q, k, v, scale, out,
                                         ml, stream)
                   : flash_launch<64, 1>(pv, pool, layer, n0, n_heads, n_tok, q, k, v, scale, out,
                                         ml, stream);
  }
  warp_kernel<<<dim3(n_heads, n_tok), 32, 0, stream>>>(
      *pv, pool, layer, n0, n_heads, (const __nv_bfloat16 *)q, (const __nv_bfloat16 *)k,
      (const __nv_bfloat16 *)v, scale, (__nv_bfloat16 *)out, ml);
  LF_CUDA_CHECK_LAUNCH("prefill warp_kernel");
  return LF_OK;
}

extern "C" lf_status lf_cuda_prefill_attn(const lf_cuda_pool_view *pv, int pool, int layer,
                                          int n0, int n_heads, int n_tok, const void *q,
                                          const void *k, const void *v, float scale, void *out,
                                          float *ml, cudaStream_t stream) {
  return lf_cuda_prefill_attn_tiles(pv, pool, layer, n0, n_heads, n_tok, q, k, v, scale, out, ml,
                                    0, stream);
}

/* snap[g][0][j], j < L = n_tok - w_eff: the softmax weight of key j summed over the last w_eff
 * queries and the group's heads. One thread per (j, g), a fixed summation order. */
static __global__ void snapkv_score_kernel(int n_heads, int hkv, int D, int n_tok, int w_eff,
                                           const __nv_bfloat16 *q, const __nv_bfloat16 *k,
                                           const float *ml, float scale, float *snap) {
  const int g = blockIdx.y, L = n_tok - w_eff, G = n_heads / hkv;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= L) return;
  const __nv_bfloat16 *kr = k + ((size_t)j * hkv + g) * D;
  float s = 0.0f;
  for (int t = L; t < n_tok; t++)
    for (int hh = 0; hh < G; hh++) {
      const int h = g * G + hh;
      const __nv_bfloat16 *qr = q + ((size_t)t * n_heads + h) * D;
      float dot = 0.0f;
      for (int d = 0; d < D; d++) dot += __bfloat162float(qr[d]) * __bfloat162float(kr[d]);
      const float *mls = ml + ((size_t)t * n_heads + h) * 2;
      s += expf(dot * scale - mls[0]) / mls[1];
    }
  snap[(size_t)g * 2 * n_tok + j] = s;
}

/* Layer-scope SnapKV: every head of a group of `per` gets the group's summed raw scores (head
 * order), so the per-head selection below keeps one set for the group. */
static __global__ void snapkv_group_sum_kernel(int n_tok, int L, int per, float *snap) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x, g0 = blockIdx.y * per;
  if (j >= L) return;
  float s = 0.0f;
  for (int gg = 0; gg < per; gg++) s += snap[(size_t)(g0 + gg) * 2 * n_tok + j];
  for (int gg = 0; gg < per; gg++) snap[(size_t)(g0 + gg) * 2 * n_tok + j] = s;
}

/* One block per KV head: pooled scores (width-5 average, zero padded, divided by 5), the rank of
 * every candidate (higher score first, ties to the lower position), then the slot of every kept
 * token in position order. */
static __global__ void snapkv_select_kernel(int n_tok, int budget, int sink, int w_eff,
                                            float *snap, int32_t *slot_of) {
  const int g = blockIdx.x, L = n_tok - w_eff, n_mid = budget - 1 - sink - w_eff;
  const float *raw = snap + (size_t)g * 2 * n_tok;
  float *ps = snap + (size_t)g * 2 * n_tok + n_tok;
  int32_t *keep = slot_of + (size_t)g * n_tok;
  for (int j = threadIdx.x; j < L; j += blockDim.x) {
    float s = 0.0f;
    for (int d = -2; d <= 2; d++)
      if (j + d >= 0 && j + d < L) s += raw[j + d];
    ps[j] = s / 5.0f;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < n_tok; j += blockDim.x) {
    int kept = j < sink || j >= L;
    if (!kept) {
      const float sj = ps[j];
      int rank = 0;
      for (int i = sink; i < L && rank < n_mid; i++)
        rank += ps[i] > sj || (ps[i] == sj && i < j);
      kept = rank < n_mid;
    }
    keep[j] = kept;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int slot = 0;
    for (int j = 0; j < n_tok; j++) keep[j] = keep[j] ? slot++ : -1;
  }
}

extern "C" lf_status lf_cuda_snapkv_select(int n_heads, int n_kv_heads, int head_dim, int n_tok,
                                           int budget, int sink, int w_eff, int per, const void *q,
                                           const void *k, const float *ml, float scale,
                                           float *snap, int32_t *slot_of, cudaStream_t stream) {
  if (!q || !k || !ml || !snap || !slot_of || n_kv_heads < 1 || n_heads % n_kv_heads ||
      n_tok < budget || w_eff < 0 || sink < 0 || budget - 1 - sink - w_eff < 0 || n_kv_heads > 65535 ||
      per < 1 || n_kv_heads % per)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_snapkv_select: bad arguments");
  const int L = n_tok - w_eff;
  if (L > 0) {
    snapkv_score_kernel<<<dim3((L + 127) / 128, n_kv_heads), 128, 0, stream>>>(
        n_heads, n_kv_heads, head_dim, n_tok, w_eff, (const __nv_bfloat16 *)q,
        (const __nv_bfloat16 *)k, ml, scale, snap);
    LF_CUDA_CHECK_LAUNCH("snapkv_score_kernel");
    if (per > 1) {
      snapkv_group_sum_kernel<<<dim3((L + 127) / 128, n_kv_heads / per), 128, 0, stream>>>(
          n_tok, L, per, snap);
      LF_CUDA_CHECK_LAUNCH("snapkv_group_sum_kernel");
    }
  }
  snapkv_select_kernel<<<n_kv_heads, 1024, 0, stream>>>(n_tok, budget, sink, w_eff, snap, slot_of);
  LF_CUDA_CHECK_LAUNCH("snapkv_select_kernel");
  return LF_OK;
}

/* One warp per (chunk token t, KV head g). */
static __global__ void kv_store_kernel(lf_cuda_pool_view p, int pool, int layer, int n_tok,
                                       int32_t pos0, const __nv_bfloat16 *k,
                                       const __nv_bfloat16 *v, const int32_t *slot_of, int n0,
                                       int n_final) {
  const int t = blockIdx.x, g = blockIdx.y, lane = threadIdx.x, D = p.head_dim;
  const size_t hidx = ((size_t)pool * p.n_layers + layer) * p.n_kv_heads + g;
  const int slot = slot_of ? slot_of[(size_t)g * n_tok + t] : n0 + t;
  if (slot >= 0) {
    const __nv_bfloat16 *ks = k + ((size_t)t * p.n_kv_heads + g) * D;
    const __nv_bfloat16 *vs = v + ((size_t)t * p.n_kv_heads + g) * D;
    float kx[ATT_DMAX / 32], vx[ATT_DMAX / 32];
#pragma unroll
    for (int i = 0; i < ATT_DMAX / 32; i++) {
      const int d = lane + 32 * i;
      kx[i] = d < D ? __bfloat162float(ks[d]) : 0.0f;
      vx[i] = d < D ? __bfloat162float(vs[d]) : 0.0f;
    }
    const size_t row = hidx * p.budget + slot;
    lf_kvq_store_row(p, p.k, p.k_scale, row, kx, D, lane);
    const float l1 = lf_kvq_store_row(p, p.v, p.v_scale, row, vx, D, lane);
    if (lane == 0) {
      p.vnorm[hidx * p.budget + slot] = l1;
      p.pos[hidx * p.budget + slot] = pos0 + t;
    }
  }
  if (t == 0 && lane == 0) {
    p.n[hidx] = n_final;
    p.next[hidx] = -1;
  }
}

extern "C" lf_status lf_cuda_kv_store(const lf_cuda_pool_view *pv, int pool, int layer, int n_tok,
                                      int32_t pos0, const void *k, const void *v,
                                      const int32_t *slot_of, int n0, int n_final,
                                      cudaStream_t stream) {
  if (!pv || !k || !v || n_tok < 0 || n_final < 0 || n_final > pv->budget ||
      (!slot_of && n0 + n_tok > pv->budget))
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_kv_store: bad arguments");
  if (pv->head_dim > ATT_DMAX ||
      !lf_kvq_fits(pv->kv_dtype, pv->head_dim) ||
      (pv->kv_dtype != LF_KV_BF16 && (!pv->k_scale || !pv->v_scale)))
    return lf_error(LF_ERR_UNSUPPORTED, "lf_cuda_kv_store: head_dim %d, kv dtype %d",
                    pv->head_dim, pv->kv_dtype);
  if (n_tok == 0) return LF_OK;
  kv_store_kernel<<<dim3(n_tok, pv->n_kv_heads), 32, 0, stream>>>(
      *pv, pool, layer, n_tok, pos0, (const __nv_bfloat16 *)k, (const __nv_bfloat16 *)v, slot_of,
      n0, n_final);
  LF_CUDA_CHECK_LAUNCH("kv_store_kernel");
  return LF_OK;
}

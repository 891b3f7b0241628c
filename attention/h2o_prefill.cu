/* h2o's prefill accumulators (see prefill_attn.cuh, lf_cuda_h2o_prefill_acc): each key's softmax
 * weight from a chunk's queries, summed, into the pool's acc. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "attention/flash_tile.cuh"
#include "attention/pool_row.cuh"
#include "attention/prefill_attn.cuh"
#include "base/cuda_check.h"

/* h2o: cs[h][j] = the softmax weight key j (pool slot j < n0, else chunk token j - n0) gets from
 * query head h's rows of the chunk that see it, summed over them; the weights from ml as the
 * prefill kernel left them (row max, normaliser). h2o_acc_store_kernel adds a group's heads.
 *
 * head_dim 64 and 128 (cs_mma_kernel): one block of FL_WARPS warps per (128-key tile, query
 * head); the block computes S^T = K Q^T so that keys are the MMA rows. Each warp's 32 keys stay
 * in registers as A fragments for the whole block; the query tiles that see them stream through
 * shared memory (64 queries at a time, double-buffered by cp.async, with each query's
 * m log2e + log2 l beside them), and each element of S^T becomes its softmax weight
 * exp2(s scale log2e - (m log2e + log2 l)) added to its row's (key's) sum in registers: one FMA,
 * one MUFU op and one add an element, the causal mask only on the tiles that cross the diagonal.
 * A key's sum is its thread's, then its quad's lanes in a fixed order: deterministic. Pool tiles
 * (every query sees them) are the heaviest: blockIdx.x is the head, so they come first. Other
 * head dims: one thread per (key, query head) (cs_scalar_kernel). */
#define CS_KW 32                 /* keys a warp */
#define CS_KB (CS_KW * FL_WARPS) /* keys a block */
#define CS_QT 64                 /* queries a tile */

template <int D>
static __global__ void __launch_bounds__(FL_WARPS * 32)
    cs_mma_kernel(lf_cuda_pool_view p, int pool, int layer, int n0, int n_heads, int n_tok,
                  const __nv_bfloat16 *q, const __nv_bfloat16 *k, const float *ml, float scale,
                  float *cs) {
  /* the key tile [CS_KB][D] until its fragments are in registers, then the query tiles
   * [2][CS_QT][D] (the same bytes: CS_KB == 2 CS_QT) */
  extern __shared__ __align__(128) unsigned char cs_shm[];
  __nv_bfloat16 *sq = (__nv_bfloat16 *)cs_shm;
  __shared__ float sbias[2][CS_QT];
  static_assert(CS_KB == 2 * CS_QT, "the key tile and the two query tiles share their bytes");
  constexpr int KS = D / 16, CH = D / 8;
  const int hkv = p.n_kv_heads, G = n_heads / hkv, h = blockIdx.x, g = h / G;
  const int k0 = blockIdx.y * CS_KB, nk = n0 + n_tok;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const size_t hidx = ((size_t)pool * p.n_layers + layer) * hkv + g;
  const __nv_bfloat16 *pk = (const __nv_bfloat16 *)p.k + hidx * p.budget * D;
  const __nv_bfloat16 *ck = k + (size_t)g * D;
  fl_load_kv<D>(sq, pk, ck, hkv * D, k0, n0, nk);
  fl_load_kv<D>(sq + FL_N * D, pk, ck, hkv * D, k0 + FL_N, n0, nk);
  fl_commit();
  fl_wait<0>();
  __syncthreads();
  uint32_t ka[2][KS][4]; /* this warp's keys kw .. kw + 31 as two 16-row A tiles */
  const int kw = k0 + warp * CS_KW;
#pragma unroll
  for (int mt = 0; mt < 2; mt++)
#pragma unroll
    for (int ks = 0; ks < KS; ks++) fl_load_qa<D>(ka[mt][ks], sq, warp * CS_KW + mt * 16, ks, lane);
  __syncthreads(); /* the query tiles overwrite the key tile */

  /* the first query that sees key k0; the tile's later keys are seen by fewer */
  const int t_lo = k0 > n0 ? k0 - n0 : 0;
  const int nqt = (n_tok - t_lo + CS_QT - 1) / CS_QT;
  auto load_q = [&](int it, int b) {
    const int t0 = t_lo + it * CS_QT;
    __nv_bfloat16 *dst = sq + b * CS_QT * D;
    for (int i = threadIdx.x; i < CS_QT * CH; i += FL_WARPS * 32) {
      const int row = i / CH, ch = i % CH, t = t0 + row;
      const __nv_bfloat16 *src = q + ((size_t)(t < n_tok ? t : 0) * n_heads + h) * D + ch * 8;
      fl_cp16(fl_smem(dst + fl_sw<D>(row, ch)), src, t < n_tok);
    }
    for (int i = threadIdx.x; i < CS_QT; i += FL_WARPS * 32) {
      const int t = t0 + i;
      const float *r = ml + ((size_t)(t < n_tok ? t : 0) * n_heads + h) * 2;
      sbias[b][i] = t < n_tok ? r[0] * FL_LOG2E + __log2f(r[1]) : INFINITY; /* weight 0 */
    }
  };
  if (nqt > 0) load_q(0, 0);
  fl_commit();

  float rs[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}}; /* keys kw + 16 mt + lane / 4 + 8 r */
  const float sl2 = scale * FL_LOG2E;
  for (int it = 0; it < nqt; it++) {
    const int b = it & 1;
    if (it + 1 < nqt) {
      load_q(it + 1, b ^ 1);
      fl_commit();
      fl_wait<1>();
    } else {
      fl_wait<0>();
    }
    __syncthreads();
    const __nv_bfloat16 *tq = sq + b * CS_QT * D;
#pragma unroll
    for (int c = 0; c < CS_QT / 32; c++) {
      const int tc = t_lo + it * CS_QT + c * 32; /* queries tc .. tc + 31 */
      /* key kk is seen by query t < n_tok when kk <= n0 + t */
      if (tc >= n_tok || kw > n0 + tc + 31) continue; /* none of this warp's keys is seen */
      float s[2][4][4];
#pragma unroll
      for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int j = 0; j < 4; j++) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < KS; ks++)
#pragma unroll
        for (int n2 = 0; n2 < 2; n2++) {
          uint32_t r[4];
          ldsm_x4(r, fl_smem(tq + fl_sw<D>(c * 32 + n2 * 16 + (lane % 8) + 8 * (lane / 16),
                                           2 * ks + (lane / 8) % 2)));
#pragma unroll
          for (int mt = 0; mt < 2; mt++) {
            mma_bf16(s[mt][2 * n2], ka[mt][ks], r[0], r[1]);
            mma_bf16(s[mt][2 * n2 + 1], ka[mt][ks], r[2], r[3]);
          }
        }
      float bias[4][2]; /* column (query) tc + 8 j + 2 (lane % 4) + e */
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const float2 bb = *(const float2 *)&sbias[b][c * 32 + j * 8 + 2 * (lane % 4)];
        bias[j][0] = bb.x;
        bias[j][1] = bb.y;
      }
      if (kw + CS_KW - 1 <= n0 + tc) { /* every query here sees every key of the warp */
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
          for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++)
              rs[mt][e / 2] += fl_ex2(s[mt][j][e] * sl2 - bias[j][e % 2]);
      } else {
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
          for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
              const int kk = kw + mt * 16 + lane / 4 + 8 * (e / 2);
              const int t = tc + j * 8 + 2 * (lane % 4) + e % 2;
              rs[mt][e / 2] += kk <= n0 + t ? fl_ex2(s[mt][j][e] * sl2 - bias[j][e % 2]) : 0.0f;
            }
      }
    }
    __syncthreads(); /* the next iteration's load overwrites this buffer's neighbour */
  }
#pragma unroll
  for (int mt = 0; mt < 2; mt++)
#pragma unroll
    for (int r = 0; r < 2; r++) {
      float x = rs[mt][r];
      x += __shfl_xor_sync(0xffffffffu, x, 1);
      x += __shfl_xor_sync(0xffffffffu, x, 2);
      const int kk = kw + mt * 16 + lane / 4 + 8 * r;
      if (lane % 4 == 0 && kk < nk) cs[(size_t)h * nk + kk] = x;
    }
}

template <int D>
static lf_status cs_mma_launch(const lf_cuda_pool_view *pv, int pool, int layer, int n0,
                               int n_heads, int n_tok, const void *q, const void *k,
                               const float *ml, float scale, float *cs, cudaStream_t stream) {
  const size_t shm = (size_t)CS_KB * D * sizeof(__nv_bfloat16);
  LF_CUDA_CHECK(cudaFuncSetAttribute(cs_mma_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)shm));
  const dim3 grid((unsigned)n_heads, (unsigned)((n0 + n_tok + CS_KB - 1) / CS_KB));
  cs_mma_kernel<D><<<grid, FL_WARPS * 32, shm, stream>>>(
      *pv, pool, layer, n0, n_heads, n_tok, (const __nv_bfloat16 *)q, (const __nv_bfloat16 *)k, ml,
      scale, cs);
  LF_CUDA_CHECK_LAUNCH("cs_mma_kernel");
  return LF_OK;
}

static __global__ void cs_scalar_kernel(lf_cuda_pool_view p, int pool, int layer, int n0,
                                         int n_heads, int n_tok, const __nv_bfloat16 *q,
                                         const __nv_bfloat16 *k, const float *ml, float scale,
                                         float *cs) {
  const int h = blockIdx.y, hkv = p.n_kv_heads, g = h / (n_heads / hkv), D = p.head_dim;
  const int j = blockIdx.x * blockDim.x + threadIdx.x, nk = n0 + n_tok;
  if (j >= nk) return;
  const size_t hidx = ((size_t)pool * p.n_layers + layer) * hkv + g;
  const __nv_bfloat16 *kr =
      j < n0 ? pool_row(p, p.k, hidx, j) : k + ((size_t)(j - n0) * hkv + g) * D;
  float s = 0.0f;
  for (int t = j < n0 ? 0 : j - n0; t < n_tok; t++) {
    const __nv_bfloat16 *qr = q + ((size_t)t * n_heads + h) * D;
    float dot = 0.0f;
    for (int d = 0; d < D; d++) dot += __bfloat162float(qr[d]) * __bfloat162float(kr[d]);
    const float *mls = ml + ((size_t)t * n_heads + h) * 2;
    s += expf(dot * scale - mls[0]) / mls[1];
  }
  cs[(size_t)h * nk + j] = s;
}

/* acc from the column sums, a group's heads added in order: appended (slot_of NULL) the pool's
 * slots add theirs and the chunk's tokens start from theirs; compressed (n0 = 0) each kept token's
 * slot starts from its own. */
static __global__ void h2o_acc_store_kernel(lf_cuda_pool_view p, int pool, int layer, int n0,
                                            int n_heads, int n_tok, const int32_t *slot_of,
                                            const float *cs) {
  const int g = blockIdx.y, G = n_heads / p.n_kv_heads, nk = n0 + n_tok;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= nk) return;
  const size_t hidx = ((size_t)pool * p.n_layers + layer) * p.n_kv_heads + g;
  float *acc = p.acc + hidx * p.budget;
  float c = 0.0f;
  for (int hh = 0; hh < G; hh++) c += cs[(size_t)(g * G + hh) * nk + j];
  if (slot_of) {
    const int slot = slot_of[(size_t)g * n_tok + j];
    if (slot >= 0) acc[slot] = c;
  } else if (j < n0) {
    acc[j] += c;
  } else {
    acc[j] = c;
  }
}

extern "C" lf_status lf_cuda_h2o_prefill_acc(const lf_cuda_pool_view *pv, int pool, int layer,
                                             int n0, int n_heads, int n_tok, const void *q,
                                             const void *k, const float *ml, float scale,
                                             const int32_t *slot_of, float *cs,
                                             cudaStream_t stream) {
  if (!pv || !pv->acc || !q || !k || !ml || !cs || n0 < 0 || n_tok < 0 || pv->n_kv_heads < 1 ||
      n_heads % pv->n_kv_heads || (slot_of && n0 != 0) || n0 > pv->budget)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_h2o_prefill_acc: bad arguments");
  const int nk = n0 + n_tok;
  if (nk == 0) return LF_OK;
  const unsigned nb = (unsigned)((nk + 127) / 128);
  int rpool = pool, rlayer = layer;
  lf_cuda_pool_view rv;
  LF_TRY(lf_cuda_read_view(pv, &rpool, &rlayer, n0, 0, stream, &rv));
  if (rv.head_dim == 128) {
    LF_TRY(cs_mma_launch<128>(&rv, rpool, rlayer, n0, n_heads, n_tok, q, k, ml, scale, cs, stream));
  } else if (rv.head_dim == 64) {
    LF_TRY(cs_mma_launch<64>(&rv, rpool, rlayer, n0, n_heads, n_tok, q, k, ml, scale, cs, stream));
  } else {
    cs_scalar_kernel<<<dim3(nb, (unsigned)n_heads), 128, 0, stream>>>(
        rv, rpool, rlayer, n0, n_heads, n_tok, (const __nv_bfloat16 *)q, (const __nv_bfloat16 *)k,
        ml, scale, cs);
    LF_CUDA_CHECK_LAUNCH("cs_scalar_kernel");
  }
  h2o_acc_store_kernel<<<dim3(nb, (unsigned)pv->n_kv_heads), 128, 0, stream>>>(
      *pv, pool, layer, n0, n_heads, n_tok, slot_of, cs);
  LF_CUDA_CHECK_LAUNCH("h2o_acc_store_kernel");
  return LF_OK;
}

/* Fused LongFlow decode attention (see decode_attn.cuh; docs/DESIGN.md §3 is normative).
 *
 * Grid [n_splits, n_kv_heads, n_seq], 4 warps per block. Block (split, g, seq) owns a contiguous
 * run of 16-slot tiles of the pool's n filled slots and works in two passes over it:
 *   pass 1 streams K: logits l_h,i = scale * q_h.k_i for the group's heads with one
 *          mma.m16n8k16 per 16 slots x 16 dims (slots are the M side, the <= 8 heads the N side),
 *          kept in shared memory; the block's max per head follows.
 *   pass 2 streams V: p = exp(l - m) in bf16 as the B operand, V^T as the A operand (transposed
 *          in registers with byte permutes), fp32 accumulators; sum of p per head in fp32.
 * Both operands come straight from global memory with 16-byte loads, in a dimension order that
 * makes each thread's loads contiguous: the dot product over dims does not care about order as
 * long as q uses the same one, and the output rows of P.V are mapped back to dims explicitly.
 *
 * Exact split-K combine and argmin (the protocol docs/DESIGN.md §3 asks for):
 *   s_i = ||v_i||_1 * sum_h exp(l_h,i - M_h) / L_h needs every head's final max M_h and
 *   normaliser L_h, which no split knows alone. Each split therefore publishes its partial
 *   (m_h, l_h, o_h = sum p v) and its slots' fp32 logits (group floats per slot, ~3% of the K+V
 *   bytes at group 4) to the workspace, then takes a ticket from a per-(seq, head) counter. The
 *   block that draws the last ticket (threadfence before the ticket, so everything the others
 *   wrote is visible to it) knows every partial: it forms M_h, L_h, the output
 *   sum_s exp(m_s,h - M_h) o_s,h / L_h, every slot's score from the stored logits (not from K or
 *   V, which are never read twice) and the argmin, and resets the counter for the next call.
 *   With one split there is nothing to publish: the block scores from its shared-memory logits.
 * On sm_90 with 2..8 splits (the usual batch 1..8 case) the splits of one (sequence, KV head)
 * run as one thread-block cluster instead: each split publishes (m_h, l_h) in its shared memory,
 * every split reads all of them through distributed shared memory after a cluster barrier, so
 * every split knows M_h and L_h, scores its own slots from its own shared logits and combines its
 * share of the output from the others' partial outputs; split 0 takes the minimum of the splits'
 * keys after a second barrier. Same arithmetic as the ticket combine, in parallel and without a
 * global-memory round trip.
 * The argmin is a min over 64-bit keys (score bits << 32 | slot): non-negative fp32 scores order
 * like their bit patterns, and equal scores fall to the lowest slot, as in the CPU reference.
 */
#include "attention/decode_attn.cuh"

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>


#include "attention/decode_attn_parts.cuh"
#include "base/kvq.h"
#include "attention/evict.cuh"
#include "base/cuda_check.h"
#include "base/cuda_launch.cuh"
#include "base/cuda_ptx.cuh"


/* What the kernel's closing phases (da_finish_*) read: the block's place in the grid, its
 * slot range and its shared-memory buffers, the kernel's own locals (everything is inlined). */
struct da_tail {
  int G, B, S, split, n, wslot, s0, s1, tid;
  size_t pair, hidx;
  bool window; /* h2o's recent window applies here (head scope) */
  const int32_t *posh;
  __nv_bfloat16 *out;
  float *scores_row, *lg_s, *o_s, *cw;
  float (*red_m)[DA_GMAX], (*red_l)[DA_GMAX];
  float *fin_m, *fin_il;
  unsigned long long *red_key;
  int *red_i;
};

/* One split: the block has every slot. The output from o_s, the scores from the shared logits,
 * the argmin. */
template <int D, bool H2O>
static __device__ __forceinline__ void da_finish_single(const attn_params &p, const da_tail &b) {
  const int G = b.G, n = b.n, wslot = b.wslot, tid = b.tid;
  const size_t hidx = b.hidx;
  const bool window = b.window;
  const int32_t *posh = b.posh;
  __nv_bfloat16 *out = b.out;
  float *scores_row = b.scores_row, *o_s = b.o_s, *fin_m = b.fin_m, *fin_il = b.fin_il;
  float(*red_m)[DA_GMAX] = b.red_m, (*red_l)[DA_GMAX] = b.red_l;
  unsigned long long *red_key = b.red_key;
  int *red_i = b.red_i;
  float *lg_s = b.lg_s;
  if (tid < G) {
    float l = 0.0f, m = -INFINITY;
    for (int i = 0; i < DA_NW; i++) {
      l += red_l[i][tid];
      m = fmaxf(m, red_m[i][tid]);
    }
    fin_m[tid] = m;
    fin_il[tid] = 1.0f / l;
  }
  __syncthreads();
  for (int i = tid; i < G * D / 2; i += DA_NT) {
    const int h = i / (D / 2), d = 2 * (i % (D / 2));
    *(__nv_bfloat162 *)(out + h * D + d) =
        __floats2bfloat162_rn(o_s[h * D + d] * fin_il[h], o_s[h * D + d + 1] * fin_il[h]);
  }
  const int rfrom = window ? h2o_window<DA_NT>(posh, n, wslot, p.recent, red_i) : INT_MAX;
  const unsigned long long best =
      score_key<false, H2O>(p, hidx, 0, n, wslot, lg_s, fin_m, fin_il, rfrom, red_key, scores_row);
  if (tid == 0) finish_head<H2O>(p, hidx, best);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
/* The splits of one (sequence, KV head) as a thread-block cluster (cl_*: the kernel's shared
 * arrays for the exchange). */
template <int D, bool H2O>
static __device__ __forceinline__ void da_finish_cluster(const attn_params &p, const da_tail &b,
                                                         float2 *cl_ml,
                                                         unsigned long long *cl_key,
                                                         int *cl_cnt) {
  const int G = b.G, n = b.n, wslot = b.wslot, tid = b.tid;
  const size_t hidx = b.hidx;
  const bool window = b.window;
  const int32_t *posh = b.posh;
  __nv_bfloat16 *out = b.out;
  float *scores_row = b.scores_row, *o_s = b.o_s, *fin_m = b.fin_m, *fin_il = b.fin_il;
  float(*red_m)[DA_GMAX] = b.red_m, (*red_l)[DA_GMAX] = b.red_l;
  unsigned long long *red_key = b.red_key;
  int *red_i = b.red_i;
  const int S = b.S, split = b.split, s0 = b.s0, s1 = b.s1;
  float *lg_s = b.lg_s, *cw = b.cw;
  /* The splits of this (sequence, KV head) form one thread-block cluster: they exchange
   * (m, l) and the partial outputs through distributed shared memory, so every split knows the
   * final M_h and L_h and scores its own slots from its own shared logits; split 0 takes the
   * minimum of the splits' keys. No workspace, no ticket, no serial pass over all slots. */
  namespace cg = cooperative_groups;
  cg::cluster_group cl = cg::this_cluster();
  /* h2o: each split counts its own slots at the window's guess; the sum follows the barrier */
  const int t0 = window ? h2o_window_guess(posh, n, wslot, p.recent) : 0;
  if (window) {
    const int c = h2o_count_ge<DA_NT>(posh, s0, s1, t0, red_i);
    if (tid == 0) cl_cnt[0] = c;
  }
  if (tid < G) {
    float l = 0.0f, m = -INFINITY;
    for (int i = 0; i < DA_NW; i++) {
      l += red_l[i][tid];
      m = fmaxf(m, red_m[i][tid]);
    }
    cl_ml[tid] = make_float2(m, l);
  }
  cl.sync(); /* every split's (m, l) and o_s are written */
  if (tid < G) {
    if (p.fast_tail) { /* all S remote reads in flight at once */
      float2 x[DA_CL_MAX];
#pragma unroll
      for (int s = 0; s < DA_CL_MAX; s++)
        x[s] = s < S ? cl.map_shared_rank(cl_ml, s)[tid] : make_float2(-INFINITY, 0.0f);
      combine_weights_reg(x, S, G, tid, cw, fin_m, fin_il);
    } else {
      combine_weights([&](int s) { return cl.map_shared_rank(cl_ml, s)[tid]; }, S, G, tid, cw,
                      fin_m, fin_il);
    }
  }
  if (window && tid == DA_NT - 1) {
    int c = 0;
    for (int s = 0; s < S; s++) c += cl.map_shared_rank(cl_cnt, s)[0];
    cl_cnt[1] = c;
  }
  __syncthreads();
  /* this split's share of the output, from every split's o_s */
  for (int i = split * DA_NT + tid; i < G * D / 2; i += S * DA_NT) {
    const int h = i / (D / 2), d = 2 * (i % (D / 2));
    float a = 0.0f, b = 0.0f;
    if (p.fast_tail) { /* the S remote reads in flight at once, summed in the same order */
      float2 x[DA_CL_MAX];
#pragma unroll
      for (int s = 0; s < DA_CL_MAX; s++)
        if (s < S) x[s] = *(const float2 *)(cl.map_shared_rank(o_s, s) + h * D + d);
#pragma unroll
      for (int s = 0; s < DA_CL_MAX; s++)
        if (s < S) {
          a += cw[s * G + h] * x[s].x;
          b += cw[s * G + h] * x[s].y;
        }
    } else {
      for (int s = 0; s < S; s++) {
        const float2 x = *(const float2 *)(cl.map_shared_rank(o_s, s) + h * D + d);
        a += cw[s * G + h] * x.x;
        b += cw[s * G + h] * x.y;
      }
    }
    *(__nv_bfloat162 *)(out + h * D + d) = __floats2bfloat162_rn(a, b);
  }
  /* every split finds the same threshold (a bisection over all n slots when the guess is off) */
  const int rfrom = window ? h2o_window_from<DA_NT>(posh, n, p.recent, t0, cl_cnt[1], red_i)
                           : INT_MAX;
  const unsigned long long best = score_key<false, H2O>(p, hidx, s0, s1, wslot, lg_s, fin_m, fin_il,
                                                   rfrom, red_key, scores_row);
  if (tid == 0) cl.map_shared_rank(cl_key, 0)[split] = best;
  cl.sync(); /* keys are in split 0; nobody reads another split's memory after this */
  if (split == 0 && tid == 0) {
    unsigned long long k = cl_key[0];
    for (int s = 1; s < S; s++)
      k = cl_key[s] < k ? cl_key[s] : k;
    finish_head<H2O>(p, hidx, k);
  }
}
#endif

/* Splits as separate blocks: publish this split's partials to the workspace, then take a
 * ticket; the last block combines, scores every slot from the stored logits and takes the
 * argmin (is_last: the kernel's shared flag). */
template <int D, bool H2O>
static __device__ __forceinline__ void da_finish_ticket(const attn_params &p, const da_tail &b,
                                                        int *is_last_p) {
  const int G = b.G, n = b.n, wslot = b.wslot, tid = b.tid;
  const size_t hidx = b.hidx;
  const bool window = b.window;
  const int32_t *posh = b.posh;
  __nv_bfloat16 *out = b.out;
  float *scores_row = b.scores_row, *o_s = b.o_s, *fin_m = b.fin_m, *fin_il = b.fin_il;
  float(*red_m)[DA_GMAX] = b.red_m, (*red_l)[DA_GMAX] = b.red_l;
  unsigned long long *red_key = b.red_key;
  int *red_i = b.red_i;
  const int S = b.S, split = b.split, B = b.B;
  const size_t pair = b.pair;
  float *cw = b.cw;
  int &is_last = *is_last_p;
  float2 *ml = p.ml + pair * S * G;
  float *po = p.po + (pair * S * G) * D;
  if (tid < G) {
    float l = 0.0f, m = -INFINITY;
    for (int i = 0; i < DA_NW; i++) {
      l += red_l[i][tid];
      m = fmaxf(m, red_m[i][tid]);
    }
    __stcg(ml + split * G + tid, make_float2(m, l));
  }
  for (int i = tid; i < G * D; i += DA_NT)
    __stcg(po + (size_t)split * G * D + i, o_s[i]);
  __threadfence();
  __syncthreads();
  if (tid == 0) is_last = atomicAdd(p.cnt + pair, 1u) == (unsigned)(S - 1);
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  if (tid == 0) p.cnt[pair] = 0;

  /* The last split: combine. All (m, l) in parallel into cw, then per head
   * M_h = max m_s,h, L_h = sum l_s,h exp(m_s,h - M_h), and cw[s][h] = exp(m_s,h - M_h) / L_h. */
  float2 *mls = (float2 *)(cw + ((S * G + 1) & ~1)); /* [S][G] */
  for (int i = tid; i < S * G; i += DA_NT)
    mls[i] = __ldcg(ml + i);
  __syncthreads();
  if (tid < G)
    combine_weights([&](int s) { return mls[s * G + tid]; }, S, G, tid, cw, fin_m, fin_il);
  __syncthreads();
  for (int i = tid; i < G * D / 2; i += DA_NT) {
    const int h = i / (D / 2), d = 2 * (i % (D / 2));
    float a = 0.0f, b = 0.0f;
#pragma unroll 8
    for (int s = 0; s < S; s++) {
      const float2 x = __ldcg((const float2 *)(po + ((size_t)s * G + h) * D + d));
      a += cw[s * G + h] * x.x;
      b += cw[s * G + h] * x.y;
    }
    *(__nv_bfloat162 *)(out + h * D + d) = __floats2bfloat162_rn(a, b);
  }
  const int rfrom = window ? h2o_window<DA_NT>(posh, n, wslot, p.recent, red_i) : INT_MAX;
  const unsigned long long best =
      score_key<true, H2O>(p, hidx, 0, n, wslot, p.lg + pair * B * G, fin_m, fin_il, rfrom, red_key,
                      scores_row);
  if (tid == 0) finish_head<H2O>(p, hidx, best);
}

/* One block's share of a (sequence, KV head) pair: slots [s0, s1) of pool row hidx, in ntiles
 * mma tiles, and the thread's place in the mma layout (g = lane / 4: a tile row and a head;
 * t = lane % 4: a column pair). */
struct da_slab {
  int G, B, s0, s1, ntiles, warp, lane, g, t;
  size_t hidx;
};

/* The pool row of one (sequence, KV head) in each storage's view, the rows' scales or int4
 * metadata, and what the scales are multiplied by. */
struct da_rows {
  const __nv_bfloat16 *K, *V;
  const uint8_t *K8, *V8;
  const uint32_t *K4, *V4;
  const float *ksc_row, *vsc_row;
  const uint32_t *kmeta, *vmeta;
  float kmul, vmul;
};

/* q as the B operand of pass 1: thread (g, t) holds head g, dims 32j + 8t .. 32j + 8t + 7. */
template <int D, int QK>
static __device__ __forceinline__ void da_load_q(const attn_params &p, int seq, int kvh,
                                                 const da_slab &bs, uint4 (&qf)[D / 32],
                                                 float (&qs0)[D / 32], float (&qs1)[D / 32]) {
  constexpr int NJ = D / 32;
  constexpr bool F8 = QK == DA_FP8, I4 = QK == DA_INT4;
  constexpr bool K16 = QK == DA_FP8 || QK == DA_INT8; /* decode_attn_kernel's comment on K16 */
  const int G = bs.G, g = bs.g, t = bs.t;
  {
    const uint4 *qp = (const uint4 *)(p.q + seq * p.q_stride + (size_t)(kvh * G + g) * D) + t;
    /* (K16: qp + t + qi = 8 (j >> 1) + 2t + (j & 1): dims 64 (j >> 1) + 16t + 8 (j & 1)) */
#pragma unroll
    for (int j = 0; j < NJ; j++) {
      const int qi = K16 ? 8 * (j >> 1) + t + (j & 1) : 4 * j; /* qp starts at t (K16: 2t) */
      qf[j] = g < G ? qp[qi] : make_uint4(0, 0, 0, 0);
      if (F8)
        qf[j] = make_uint4(bf16x2_scale(qf[j].x, DA_F8_QUP), bf16x2_scale(qf[j].y, DA_F8_QUP),
                           bf16x2_scale(qf[j].z, DA_F8_QUP), bf16x2_scale(qf[j].w, DA_F8_QUP));
    }
  }
  /* int4: the sum of q over each group of 32 dims, for this thread's accumulator heads 2t and
   * 2t + 1: a group's floor m adds m * sum(q) to every slot's dot product, and the codes enter
   * the MMA as (128 + code), whose extra 128 * sum(q) the floor term takes back. */
#pragma unroll
  for (int j = 0; j < NJ; j++) {
    qs0[j] = qs1[j] = 0.0f;
    if (I4) {
      float a = 0.0f;
#pragma unroll
      for (int w = 0; w < 4; w++) {
        const uint32_t x = u4_get(qf[j], w);
        a += __uint_as_float(x << 16) + __uint_as_float(x & 0xffff0000u);
      }
      a += __shfl_xor_sync(0xffffffffu, a, 1);
      a += __shfl_xor_sync(0xffffffffu, a, 2);
      qs0[j] = __shfl_sync(0xffffffffu, a, 8 * t);
      qs1[j] = __shfl_sync(0xffffffffu, a, 8 * t + 4);
    }
  }

}

/* Pass 1: the logits of slots [s0, s1) into lg_s [slot][G], and this thread's running maxima of
 * heads 2t and 2t + 1 in mx0, mx1. Tile rows are slots sb + g and sb + g + 8; the accumulator
 * holds heads 2t and 2t + 1 of both. */
template <int D, int QK>
static __device__ __forceinline__ void da_logits(const attn_params &p, const da_slab &bs,
                                                 const da_rows &rw, const uint4 (&qf)[D / 32],
                                                 const float (&qs0)[D / 32],
                                                 const float (&qs1)[D / 32], float *lg_s,
                                                 float &mx0, float &mx1) {
  constexpr int NJ = D / 32, NG = D / 32;
  constexpr bool Q8 = QK == DA_FP8 || QK == DA_INT8, I4 = QK == DA_INT4;
  const int G = bs.G, s0 = bs.s0, s1 = bs.s1, ntiles = bs.ntiles, warp = bs.warp, lane = bs.lane,
            g = bs.g, t = bs.t;
  const __nv_bfloat16 *K = rw.K;
  const uint8_t *K8 = rw.K8;
  const uint32_t *K4 = rw.K4, *kmeta = rw.kmeta;
  const float *ksc_row = rw.ksc_row;
  const float kmul = rw.kmul;
  for (int ti0 = warp; ti0 < ntiles; ti0 += DA_NW * DA_UNR) {
    if (QK == DA_BF16 && p.prefetch) prefetch_tiles<D>(K, s0, s1, ti0 + DA_NW * DA_UNR, lane);
    uint4 kr[DA_UNR][2][NJ];
    uint4 kr8[DA_UNR][2][NJ / 2];
    uint32_t kr4[DA_UNR][2][NJ], km4[DA_UNR][2][NJ];
    float ksc[DA_UNR][2];
#pragma unroll
    for (int u = 0; u < DA_UNR; u++)
#pragma unroll
      for (int r = 0; r < 2; r++) {
        const int slot = s0 + (ti0 + u * DA_NW) * DA_TILE + g + 8 * r;
        if (Q8) {
          const uint4 *src = (const uint4 *)(K8 + (size_t)slot * D) + t;
#pragma unroll
          for (int jj = 0; jj < NJ / 2; jj++)
            kr8[u][r][jj] = slot < s1 ? ld_stream(src + 4 * jj) : make_uint4(0, 0, 0, 0);
          ksc[u][r] = slot < s1 ? ksc_row[slot] * kmul : 0.0f;
        } else if (I4) {
          const uint32_t *src = K4 + (size_t)slot * (D / 8) + t;
          const uint32_t *ms = kmeta + (size_t)slot * NG;
#pragma unroll
          for (int j = 0; j < NJ; j++) {
            kr4[u][r][j] = slot < s1 ? ld_stream(src + 4 * j) : 0u;
            km4[u][r][j] = slot < s1 ? ms[j] : 0u;
          }
          ksc[u][r] = p.scale;
        } else {
          const uint4 *src = (const uint4 *)(K + (size_t)slot * D) + t;
#pragma unroll
          for (int j = 0; j < NJ; j++)
            kr[u][r][j] = slot < s1 ? ld_stream(src + 4 * j) : make_uint4(0, 0, 0, 0);
          ksc[u][r] = p.scale;
        }
      }
#pragma unroll
    for (int u = 0; u < DA_UNR; u++) {
      const int ti = ti0 + u * DA_NW;
      if (ti >= ntiles) break;
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int j = 0; j < NJ; j++) {
        const uint4 k0 = Q8   ? q8x8_bf16x8<QK>(u4_half(kr8[u][0][j >> 1], j & 1))
                         : I4 ? i4x8_img(kr4[u][0][j])
                              : kr[u][0][j];
        const uint4 k1 = Q8   ? q8x8_bf16x8<QK>(u4_half(kr8[u][1][j >> 1], j & 1))
                         : I4 ? i4x8_img(kr4[u][1][j])
                              : kr[u][1][j];
        if (I4) { /* group j alone, then its step and floor: s * q.(128 + c) + (m - 128 s) sum q */
          float cj[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int hf = 0; hf < 2; hf++)
            mma_bf16(cj, u4_get(k0, 2 * hf), u4_get(k1, 2 * hf), u4_get(k0, 2 * hf + 1),
                     u4_get(k1, 2 * hf + 1), u4_get(qf[j], 2 * hf), u4_get(qf[j], 2 * hf + 1));
#pragma unroll
          for (int r = 0; r < 2; r++) {
            const float sg = lf_i4_meta_s(km4[u][r][j]);
            const float mg = fmaf(-128.0f, sg, lf_i4_meta_m(km4[u][r][j]));
            c[2 * r] += fmaf(cj[2 * r], sg, mg * qs0[j]);
            c[2 * r + 1] += fmaf(cj[2 * r + 1], sg, mg * qs1[j]);
          }
        } else {
#pragma unroll
          for (int hf = 0; hf < 2; hf++)
            mma_bf16(c, u4_get(k0, 2 * hf), u4_get(k1, 2 * hf), u4_get(k0, 2 * hf + 1),
                     u4_get(k1, 2 * hf + 1), u4_get(qf[j], 2 * hf), u4_get(qf[j], 2 * hf + 1));
        }
      }
#pragma unroll
      for (int r = 0; r < 2; r++) {
        const int sl = ti * DA_TILE + g + 8 * r; /* local slot */
        if (s0 + sl >= s1) continue;
        const float l0 = c[2 * r] * ksc[u][r], l1 = c[2 * r + 1] * ksc[u][r];
        if (2 * t < G) {
          lg_s[sl * G + 2 * t] = l0;
          mx0 = fmaxf(mx0, l0);
        }
        if (2 * t + 1 < G) {
          lg_s[sl * G + 2 * t + 1] = l1;
          mx1 = fmaxf(mx1, l1);
        }
      }
    }
  }
}

/* Pass 2: O^T[dims][heads] += V^T[dims][slots] P^T[slots][heads] over slots [s0, s1), with
 * p = exp(logit - m) (mg2 = m log2 e) from lg_s, into oacc, and this thread's share of the sum of
 * p in psum. Thread (g, t) owns dims 64c + 8g + e (e < 8) and slots 2t, 2t+1, 2t+8, 2t+9 of each
 * tile; P column = head g. */
template <int D, int QV>
static __device__ __forceinline__ void da_values(const attn_params &p, const da_slab &bs,
                                                 const da_rows &rw, float mg2, const float *lg_s,
                                                 float (&oacc)[D / 16][4], float &psum) {
  constexpr int NC = D / 64, NMT = D / 16, NG = D / 32;
  constexpr bool Q8V = QV == DA_FP8 || QV == DA_INT8, I4V = QV == DA_INT4;
  constexpr bool V16 = (Q8V || I4V) && NC == 2; /* decode_attn_kernel's comment on V16 */
  const int G = bs.G, s0 = bs.s0, s1 = bs.s1, ntiles = bs.ntiles, warp = bs.warp, lane = bs.lane,
            g = bs.g, t = bs.t;
  const __nv_bfloat16 *V = rw.V;
  const uint8_t *V8 = rw.V8;
  const uint32_t *V4 = rw.V4, *vmeta = rw.vmeta;
  const float *vsc_row = rw.vsc_row;
  const float vmul = rw.vmul;
  for (int ti0 = warp; ti0 < ntiles; ti0 += DA_NW * DA_UNR) {
    if (QV == DA_BF16 && p.prefetch) prefetch_tiles<D>(V, s0, s1, ti0 + DA_NW * DA_UNR, lane);
    uint4 vr[DA_UNR][4][NC];
    uint2 vr8[DA_UNR][4][NC];
    uint4 v16[DA_UNR][4]; /* V16: 8-bit codes of dims 16g .. 16g + 15, or int4's in .x, .y */
    uint32_t vr4[DA_UNR][4][NC], vm4[DA_UNR][4][NC];
    float vsc[DA_UNR][4];
#pragma unroll
    for (int u = 0; u < DA_UNR; u++)
#pragma unroll
      for (int r = 0; r < 4; r++) {
        const int slot = s0 + (ti0 + u * DA_NW) * DA_TILE + 2 * t + (r & 1) + 8 * (r >> 1);
        if (V16 && Q8V) {
          v16[u][r] = slot < s1 ? ld_stream((const uint4 *)(V8 + (size_t)slot * D) + g)
                                : make_uint4(0, 0, 0, 0);
          vsc[u][r] = slot < s1 ? vsc_row[slot] * vmul : 0.0f;
        } else if (V16) { /* int4: code words 2g and 2g + 1, group g / 2 */
          const uint2 w = slot < s1 ? ld_stream((const uint2 *)(V4 + (size_t)slot * (D / 8)) + g)
                                    : make_uint2(0, 0);
          v16[u][r] = make_uint4(w.x, w.y, 0, 0);
          vm4[u][r][0] = slot < s1 ? vmeta[(size_t)slot * NG + (g >> 1)] : 0u;
        } else if (Q8V) {
          const uint2 *src = (const uint2 *)(V8 + (size_t)slot * D) + g;
#pragma unroll
          for (int c = 0; c < NC; c++)
            vr8[u][r][c] = slot < s1 ? ld_stream(src + 8 * c) : make_uint2(0, 0);
          vsc[u][r] = slot < s1 ? vsc_row[slot] * vmul : 0.0f;
        } else if (I4V) { /* dims 64c + 8g .. + 7: code word 8c + g, group 2c + g / 4 */
          const uint32_t *src = V4 + (size_t)slot * (D / 8) + g;
          const uint32_t *ms = vmeta + (size_t)slot * NG + (g >> 2);
#pragma unroll
          for (int c = 0; c < NC; c++) {
            vr4[u][r][c] = slot < s1 ? ld_stream(src + 8 * c) : 0u;
            vm4[u][r][c] = slot < s1 ? ms[2 * c] : 0u;
          }
        } else {
          const uint4 *src = (const uint4 *)(V + (size_t)slot * D) + g;
#pragma unroll
          for (int c = 0; c < NC; c++)
            vr[u][r][c] = slot < s1 ? ld_stream(src + 8 * c) : make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
    for (int u = 0; u < DA_UNR; u++) {
      const int ti = ti0 + u * DA_NW;
      if (ti >= ntiles) break;
      float pv[4];
#pragma unroll
      for (int r = 0; r < 4; r++) {
        const int sl = ti * DA_TILE + 2 * t + (r & 1) + 8 * (r >> 1);
        pv[r] = (g < G && s0 + sl < s1) ? exp2f(fmaf(lg_s[sl * G + g], DA_LOG2E, -mg2)) : 0.0f;
      }
      psum += (pv[0] + pv[1]) + (pv[2] + pv[3]);
      const uint32_t b0 = Q8V ? bf16_pack(pv[0] * vsc[u][0], pv[1] * vsc[u][1])
                             : bf16_pack(pv[0], pv[1]);
      const uint32_t b1 = Q8V ? bf16_pack(pv[2] * vsc[u][2], pv[3] * vsc[u][3])
                             : bf16_pack(pv[2], pv[3]);
      uint4 vx[4][NC]; /* this tile's V as bf16 */
#pragma unroll
      for (int r = 0; r < 4; r++)
#pragma unroll
        for (int c = 0; c < NC; c++)
          vx[r][c] = V16 && Q8V ? q8x8_bf16x8<QV>(u4_half(v16[u][r], c))
                     : V16     ? i4x8_bf16x8(u4_get(v16[u][r], c), vm4[u][r][0])
                     : Q8V     ? q8x8_bf16x8<QV>(vr8[u][r][c])
                     : I4V ? i4x8_bf16x8(vr4[u][r][c], vm4[u][r][c])
                          : vr[u][r][c];
#pragma unroll
      for (int mt = 0; mt < NMT; mt++) {
        const int e0 = mt, e1 = mt + NMT; /* this thread's dims of rows g and g + 8 */
        const int c0 = e0 >> 3, w0 = (e0 & 7) >> 1, h0 = e0 & 1;
        const int c1 = e1 >> 3, w1 = (e1 & 7) >> 1, h1 = e1 & 1;
        mma_bf16(oacc[mt], bf16_interleave(u4_get(vx[0][c0], w0), u4_get(vx[1][c0], w0), h0),
                 bf16_interleave(u4_get(vx[0][c1], w1), u4_get(vx[1][c1], w1), h1),
                 bf16_interleave(u4_get(vx[2][c0], w0), u4_get(vx[3][c0], w0), h0),
                 bf16_interleave(u4_get(vx[2][c1], w1), u4_get(vx[3][c1], w1), h1), b0, b1);
      }
    }
  }
}

/* The warps' accumulators summed into o_s [G][D]. */
template <int D, bool CL, bool V16>
static __device__ __forceinline__ void da_sum_warps(const attn_params &p,
                                                    const float (&oacc)[D / 16][4], float *o_s,
                                                    float *cw, int S, int G, int warp, int g, int t,
                                                    int tid) {
  if (CL && p.fast_tail) {
    /* every warp into its own buffer at once (warp 0: o_s), one barrier, then the sum in the
     * order of the loop below, ((0 + o0) + o1) + o2) + o3: the same bits, two barriers not four */
    float *ox = cw + ((S * G + 1) & ~1) + 2 * S * G; /* [DA_NW - 1][G][D] after cw */
    store_acc<D, V16>(warp == 0 ? o_s : ox + (size_t)(warp - 1) * G * D, oacc, G, g, t,
                 warp == 0 ? ACC_FIRST : ACC_SET);
    __syncthreads();
    for (int i = tid; i < G * D; i += DA_NT) {
      float a = o_s[i];
#pragma unroll
      for (int w = 1; w < DA_NW; w++) a = a + ox[(size_t)(w - 1) * G * D + i];
      o_s[i] = a;
    }
    __syncthreads();
  } else {
    /* one warp at a time into one buffer (shared memory is what limits blocks per SM) */
    for (int ww = 0; ww < DA_NW; ww++) {
      if (warp == ww) store_acc<D, V16>(o_s, oacc, G, g, t, ww ? ACC_ADD : ACC_FIRST);
      __syncthreads();
    }
  }

}

/* H2O: the h2o instantiation (accumulators and window); the others are compiled without it.
 * Q: the pools' storage (DA_BF16, DA_FP8, DA_INT8, DA_INT4, DA_K8V4: K and V each take their row
 * format's path, da_kfmt / da_vfmt). 8-bit codes come in with 8-byte loads (the
 * same dims per thread as the bf16 16-byte loads) and become bf16 pairs in registers (exact:
 * fp8 as its 2^-120 image, int8 as itself), and the rows' scales enter where they are per slot:
 * K's multiplies the slot's logit after the MMA, V's multiplies the slot's p before P goes to
 * bf16 (the sum of p stays unscaled). */
template <int D, int MINB, bool CL, bool H2O, int Q>
static __global__ void __launch_bounds__(DA_NT, MINB) decode_attn_kernel(const attn_params p) {
  constexpr int NJ = D / 32;  /* 16-byte K loads per slot per thread */
  constexpr int NC = D / 64;  /* 16-byte V loads per slot per thread */
  constexpr int NMT = D / 16; /* mma tiles over dims in P.V */
  extern __shared__ float4 da_smem[];
  __shared__ float red_m[DA_NW][DA_GMAX], red_l[DA_NW][DA_GMAX];
  __shared__ float fin_m[DA_GMAX], fin_il[DA_GMAX];
  __shared__ unsigned long long red_key[DA_NW];
  __shared__ int red_i[DA_NW];
  __shared__ int is_last;

  /* the next kernels' inputs that depend on nothing here (attn_params.l2_next; none now) */
  prefetch_l2_share(p.l2_next, p.l2_next_bytes,
                    blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z),
                    gridDim.x * gridDim.y * gridDim.z);
  pdl_wait(); /* q, pools and the step's tables come from earlier kernels (cuda_launch.cuh) */
  const int G = p.group, B = p.budget;
  const int split = blockIdx.x, S = gridDim.x, kvh = blockIdx.y, seq = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const size_t pair = (size_t)seq * p.n_kv + kvh;
  const size_t hidx = ((size_t)p.pool_ids[seq] * p.n_layers + p.layer) * p.n_kv + kvh;
  const int n = p.n[hidx];
  const int wslot = p.w[pair];
  __nv_bfloat16 *out = p.out + (pair * G) * D; /* [G][D] of this (seq, kv head) */
  float *scores_row = p.scores ? p.scores + pair * B : nullptr;
  /* h2o's window, unless layer scope (scores), where lf_cuda_layer_argmin applies it */
  const bool window = H2O && p.policy == LF_POLICY_H2O && !p.scores;
  const int32_t *posh = p.pos + hidx * B;

  if (n <= 0) { /* nothing to attend: zero output, no candidate */
    if (split == 0) {
      for (int i = tid; i < G * D; i += DA_NT)
        out[i] = __float2bfloat16(0.0f);
      if (tid == 0) p.next[hidx] = -1;
    }
    return;
  }

  const int chunk = ((n + S - 1) / S + DA_TILE - 1) / DA_TILE * DA_TILE;
  const int s0 = min(split * chunk, n), s1 = min(s0 + chunk, n);
  const int ntiles = (s1 - s0 + DA_TILE - 1) / DA_TILE;
  /* K's row format and V's (the same but under k8v4: int8 K, int4 V) */
  constexpr int QK = da_kfmt(Q), QV = da_vfmt(Q);
  /* fp8 (the 2^-120 image): q raised (da_load_q), K's and V's scales (da_rows), O lowered */
  constexpr bool F8V = QV == DA_FP8;
  constexpr bool Q8V = QV == DA_FP8 || QV == DA_INT8; /* V: 8-bit codes and row scales */
  constexpr bool I4V = QV == DA_INT4;                 /* V: 4-bit codes, (step, floor) per 32 dims */
  constexpr int RBV = Q8V ? D : I4V ? D / 2 : 2 * D;  /* bytes per V row */
  /* 8-bit K: 16-byte loads, thread t holding dims 64jj + 16t .. + 15 (jj < NJ / 2), so that a
   * load moves as many bytes as bf16's; q takes the same order (the dot product does not care).
   * V at D 128 (8-bit and int4): one contiguous run of dims 16g .. 16g + 15 per thread and slot
   * (16 or 8 bytes), its accumulators mapped back by store_acc<D, true>. (K16, V16) */
  constexpr bool V16 = (Q8V || I4V) && NC == 2;
  constexpr bool F8 = QK == DA_FP8, Q8 = QK == DA_FP8 || QK == DA_INT8, I4 = QK == DA_INT4;
  constexpr int NG = D / 32; /* int4 groups per row */
  const da_rows rw{(const __nv_bfloat16 *)p.k + (hidx * B) * D,
                   (const __nv_bfloat16 *)p.v + (hidx * B) * D,
                   (const uint8_t *)p.k + (hidx * B) * D,
                   (const uint8_t *)p.v + (hidx * B) * D,
                   (const uint32_t *)p.k + (hidx * B) * (D / 8),
                   (const uint32_t *)p.v + (hidx * B) * (D / 8),
                   Q8 ? p.k_scale + hidx * B : nullptr,
                   Q8V ? p.v_scale + hidx * B : nullptr,
                   I4 ? (const uint32_t *)p.k_scale + hidx * B * NG : nullptr,
                   I4V ? (const uint32_t *)p.v_scale + hidx * B * NG : nullptr,
                   F8 ? DA_F8_KDOWN * p.scale : p.scale,
                   F8V ? DA_F8_PUP : 1.0f};
  float *lg_s = (float *)da_smem;                   /* [chunk_max][G] */
  float *o_s = lg_s + ((p.chunk_max * G + 3) & ~3); /* [G][D] */
  float *cw = o_s + G * D;                          /* [S][G] combine weights (last block) */

  /* The tail of the kernel reads vnorm, and pass 2 starts with V of the block's first 128
   * slots: start both on their way to L2 now, beside pass 1's K loads. */
  for (int i = tid; i < (s1 - s0 + 31) / 32; i += DA_NT)
    prefetch_l2(p.vnorm + hidx * B + s0 + 32 * i);
  {
    const int nv = min(s1 - s0, DA_NW * DA_UNR * DA_TILE) * RBV / 128; /* 128-byte lines */
    const char *vb = (const char *)p.v + ((hidx * B) + s0) * RBV;
    for (int i = tid; i < nv; i += DA_NT)
      prefetch_l2(vb + 128 * i);
  }

  const da_slab bs{G, B, s0, s1, ntiles, warp, lane, g, t, hidx};
  uint4 qf[NJ];
  float qs0[NJ], qs1[NJ];
  da_load_q<D, QK>(p, seq, kvh, bs, qf, qs0, qs1);

  /* pass 1: the logits, then the block's max per head */
  float mx0 = -INFINITY, mx1 = -INFINITY;
  da_logits<D, QK>(p, bs, rw, qf, qs0, qs1, lg_s, mx0, mx1);
  for (int o = 4; o < 32; o <<= 1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
  }
  if (g == 0) {
    red_m[warp][2 * t] = mx0;
    red_m[warp][2 * t + 1] = mx1;
  }
  __syncthreads();
  float m_g = -INFINITY; /* this block's max for head g */
#pragma unroll
  for (int i = 0; i < DA_NW; i++)
    m_g = fmaxf(m_g, red_m[i][g]);

  if (S > 1 && !CL) { /* publish the logits for the combine; overlaps with pass 2's loads */
    float *dst = p.lg + (pair * B + s0) * G;
    const int cnt = (s1 - s0) * G;
    for (int i = tid; i < cnt; i += DA_NT)
      __stcg(dst + i, lg_s[i]);
  }

  /* pass 2: P.V into each warp's accumulators, then their sum into o_s */
  float oacc[NMT][4];
#pragma unroll
  for (int i = 0; i < NMT; i++)
    oacc[i][0] = oacc[i][1] = oacc[i][2] = oacc[i][3] = 0.0f;
  float psum = 0.0f;
  const float mg2 = m_g * DA_LOG2E;
  da_values<D, QV>(p, bs, rw, mg2, lg_s, oacc, psum);
  /* K and V are read: what is left (the split combine, the scores) needs no DRAM bandwidth, so
   * the next kernel (the O GEMV) may launch now and start its weights towards L2; it waits for
   * this grid's completion before reading the output (cuda_launch.cuh). */
  if (p.early_trigger) pdl_trigger();
  if (F8V)
#pragma unroll
    for (int i = 0; i < NMT; i++)
#pragma unroll
      for (int r = 0; r < 4; r++) oacc[i][r] *= DA_F8_ODOWN;
  psum += __shfl_xor_sync(0xffffffffu, psum, 1);
  psum += __shfl_xor_sync(0xffffffffu, psum, 2);
  if (t == 0) red_l[warp][g] = psum;
  da_sum_warps<D, CL, V16>(p, oacc, o_s, cw, S, G, warp, g, t, tid);

  const da_tail b{G,    B,    S,      split, n,          wslot, s0,  s1,    tid,
                  pair, hidx, window, posh,  out,        scores_row, lg_s, o_s, cw,
                  red_m, red_l, fin_m, fin_il, red_key, red_i};
  if (S == 1) {
    da_finish_single<D, H2O>(p, b);
    return;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (CL) {
    __shared__ float2 cl_ml[DA_GMAX];                /* this split's (m, l) per head */
    __shared__ unsigned long long cl_key[DA_CL_MAX]; /* each split's best key (in split 0) */
    __shared__ int cl_cnt[2]; /* h2o: this split's count of the window guess, then the total */
    da_finish_cluster<D, H2O>(p, b, cl_ml, cl_key, cl_cnt);
    return;
  }
#endif
  da_finish_ticket<D, H2O>(p, b, &is_last);
}

/* Workspace layout; every array starts on a 256-byte boundary. */
typedef struct ws_layout {
  size_t cnt, ml, po, lg, total;
} ws_layout;

static size_t align256(size_t x) {
  return (x + 255) & ~(size_t)255;
}

static ws_layout ws_plan(int n_seq, int n_kv, int budget, int group, int head_dim, int n_splits) {
  ws_layout l;
  const size_t pairs = (size_t)n_seq * (size_t)n_kv;
  l.cnt = 0;
  l.ml = align256(pairs * sizeof(unsigned));
  if (n_splits <= 1) {
    l.po = l.lg = l.total = l.ml;
    return l;
  }
  l.po = l.ml + align256(pairs * n_splits * group * sizeof(float2));
  l.lg = l.po + align256(pairs * n_splits * group * (size_t)head_dim * sizeof(float));
  l.total = l.lg + align256(pairs * (size_t)budget * group * sizeof(float));
  return l;
}

/* Smallest split size whose logits fit in shared memory. */
static int min_splits_for_smem(int budget, int group) {
  int s = 1;
  while (s < DA_SPLITS_MAX &&
         (size_t)((budget + s - 1) / s + DA_TILE - 1) / DA_TILE * DA_TILE * group * 4 >
             DA_LG_SMEM_MAX)
    s++;
  return s;
}

/* The cluster combine (sm_90+, 2..DA_CL_MAX splits; the ticket combine through the workspace
 * serves every other split count), decided once per process from the device. */
static int cluster_combine(void) {
  static const int on = lf_device_sm90();
  return on;
}

/* The kernel's variant fields of attn_params, fixed to the fastest variants (bench/RESULTS.md,
 * "Settings"): the programmatic-launch trigger after pass 2 and the cluster path's fast tail (the
 * same bits); neither per-warp tile prefetch (never faster) nor the L2 prefetch of the O weights
 * (slower). The kernel keeps its branches for the others until an A/B run on the GPU shows that
 * removing them leaves the step time alone (register allocation moves with them). */
static void kernel_switches(attn_params *p) {
  p->prefetch = 0;
  p->early_trigger = 1;
  p->fast_tail = 1;
  p->l2_next = NULL;
  p->l2_next_bytes = 0;
}

extern "C" int lf_cuda_decode_attn_splits(int n_seq, int n_kv_heads, int budget, int group,
                                          int head_dim, int n_sm) {
  (void)head_dim;
  const long pairs = (long)n_seq * n_kv_heads;
  int s = 1;
  if (pairs > 0 && pairs < n_sm) {
    /* About two blocks per SM, at most 16 splits, none shorter than 64 slots: beyond that more
     * splits cost more in the combine than they gain in parallelism (bench/RESULTS.md). */
    s = (int)(2L * n_sm / pairs);
    if (s > 16) s = 16;
    const int by_len = (budget + 63) / 64;
    if (s > by_len) s = by_len;
  }
  const int smin = min_splits_for_smem(budget, group);
  /* With the cluster combine, one cluster's worth of splits where that suffices: combining
   * inside the cluster beats twice the splits with the ticket combine (bench/RESULTS.md). */
  if (s > DA_CL_MAX && smin <= DA_CL_MAX && cluster_combine()) s = DA_CL_MAX;
  if (s < smin) s = smin;
  if (s > DA_SPLITS_MAX) s = DA_SPLITS_MAX;
  if (s < 1) s = 1;
  return s;
}

static lf_status auto_splits(int n_seq, int n_kv, int budget, int group, int head_dim, int *out) {
  int dev = 0, n_sm = 0;
  LF_CUDA_CHECK(cudaGetDevice(&dev));
  LF_CUDA_CHECK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev));
  *out = lf_cuda_decode_attn_splits(n_seq, n_kv, budget, group, head_dim, n_sm);
  return LF_OK;
}

extern "C" size_t lf_cuda_decode_attn_workspace_bytes(int n_seq, int n_kv_heads, int budget,
                                                      int group, int head_dim, int n_splits) {
  if (n_seq < 1 || n_kv_heads < 1 || budget < 1 || group < 1) return 0;
  if (n_splits <= 0 && auto_splits(n_seq, n_kv_heads, budget, group, head_dim, &n_splits) != LF_OK)
    return 0;
  const int smin = min_splits_for_smem(budget, group);
  if (n_splits < smin) n_splits = smin;
  if (n_splits > DA_SPLITS_MAX) n_splits = DA_SPLITS_MAX;
  return ws_plan(n_seq, n_kv_heads, budget, group, head_dim, n_splits).total;
}

extern "C" lf_status lf_cuda_decode_attn_workspace_init(void *workspace, size_t workspace_bytes,
                                                        cudaStream_t stream) {
  if (!workspace && workspace_bytes)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_decode_attn_workspace_init: NULL workspace");
  if (workspace_bytes) LF_CUDA_CHECK(cudaMemsetAsync(workspace, 0, workspace_bytes, stream));
  return LF_OK;
}

template <int D, int MINB, bool CL, bool H2O, int Q>
static lf_status launch(const attn_params &p, dim3 grid, cudaStream_t stream) {
  const int S = (int)grid.x;
  const size_t smem =
      (size_t)((p.chunk_max * p.group + 3) & ~3) * sizeof(float) +
      (size_t)p.group * D * sizeof(float) +
      (S > 1 ? (size_t)(((S * p.group + 1) & ~1) + 2 * S * p.group) * sizeof(float) : 0) +
      (CL && p.fast_tail ? (size_t)(DA_NW - 1) * p.group * D * sizeof(float) : 0);
  /* The carveout is left to the driver on purpose: streaming loads are staged in L1 while in
   * flight, so the L1 left beside shared memory bounds the bytes in flight per SM (forcing the
   * largest shared carveout cuts the bandwidth). */
  if (smem > 48 * 1024) LF_CUDA_CHECK((lf_smem_optin<decode_attn_kernel<D, MINB, CL, H2O, Q>>()));
  if (CL) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(DA_NT);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute at[2];
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = (unsigned)S;
    at[0].val.clusterDim.y = 1;
    at[0].val.clusterDim.z = 1;
    at[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[1].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = lf_pdl_now() ? 2 : 1;
    LF_CUDA_CHECK(cudaLaunchKernelEx(&cfg, decode_attn_kernel<D, MINB, CL, H2O, Q>, p));
  } else {
    lf_launch(decode_attn_kernel<D, MINB, CL, H2O, Q>, grid, dim3(DA_NT), smem, stream, p);
  }
  LF_CUDA_CHECK_LAUNCH("decode_attn_kernel");
  return LF_OK;
}

template <int D, int MINB, int Q>
static lf_status launch_dtype(const attn_params &p, dim3 grid, int cl, cudaStream_t stream) {
  if (lf_policy_accumulates((lf_policy)p.policy))
    return cl ? launch<D, MINB, true, true, Q>(p, grid, stream)
              : launch<D, MINB, false, true, Q>(p, grid, stream);
  return cl ? launch<D, MINB, true, false, Q>(p, grid, stream)
            : launch<D, MINB, false, false, Q>(p, grid, stream);
}

template <int D, int MINB>
static lf_status launch_any(const attn_params &p, int q, dim3 grid, int cl,
                            cudaStream_t stream) {
  return q == DA_FP8    ? launch_dtype<D, MINB, DA_FP8>(p, grid, cl, stream)
         : q == DA_INT8 ? launch_dtype<D, MINB, DA_INT8>(p, grid, cl, stream)
         : q == DA_INT4 ? launch_dtype<D, MINB, DA_INT4>(p, grid, cl, stream)
         : q == DA_K8V4 ? launch_dtype<D, MINB, DA_K8V4>(p, grid, cl, stream)
                        : launch_dtype<D, MINB, DA_BF16>(p, grid, cl, stream);
}

extern "C" lf_status lf_cuda_decode_attn(const lf_decode_attn_args *a, cudaStream_t stream) {
  const lf_cuda_pool_view *pv = a ? &a->pool : NULL;
  if (!a || !pv->k || !pv->v || !pv->vnorm || !pv->n || !pv->next || !a->pool_ids || !a->w ||
      !a->q || !a->out)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_decode_attn: NULL argument");
  if (pv->head_dim != 64 && pv->head_dim != 128)
    return lf_error(LF_ERR_UNSUPPORTED, "lf_cuda_decode_attn: head_dim %d (64 or 128)",
                    pv->head_dim);
  if (a->group < 1 || a->group > DA_GMAX)
    return lf_error(LF_ERR_UNSUPPORTED, "lf_cuda_decode_attn: group %d (1..%d)", a->group, DA_GMAX);
  if (a->policy != LF_POLICY_LONGFLOW && a->policy != LF_POLICY_FULL &&
      a->policy != LF_POLICY_STREAMING && a->policy != LF_POLICY_H2O &&
      a->policy != LF_POLICY_RKV)
    return lf_error(LF_ERR_UNSUPPORTED, "lf_cuda_decode_attn: policy %d not implemented on cuda",
                    (int)a->policy);
  if (!lf_kvq_known(pv->kv_dtype))
    return lf_error(LF_ERR_UNSUPPORTED, "lf_cuda_decode_attn: kv dtype %d", pv->kv_dtype);
  if (pv->kv_dtype != LF_KV_BF16 && (!pv->k_scale || !pv->v_scale))
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_decode_attn: quantized pools need their scales");
  if ((a->policy == LF_POLICY_STREAMING || a->policy == LF_POLICY_H2O) && !pv->pos)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_decode_attn: streaming and h2o need pos");
  if (a->policy == LF_POLICY_H2O && (!pv->acc || a->recent < 0))
    return lf_error(LF_ERR_INVALID_ARG,
                    "lf_cuda_decode_attn: h2o needs the pool's acc and a window >= 0 (got %d)",
                    a->recent);
  if (a->policy == LF_POLICY_RKV &&
      (!pv->acc || !pv->queue || !pv->since || pv->stage < 1 || !pv->pos))
    return lf_error(LF_ERR_INVALID_ARG,
                    "lf_cuda_decode_attn: rkv needs the pool's acc, queue, since and pos and a "
                    "stage >= 1 (got %d)", pv->stage);
  if (a->n_seq < 0 || a->n_seq > 65535 || pv->n_kv_heads < 1 || pv->n_kv_heads > 65535 ||
      pv->budget < 1 || pv->n_layers < 1 || a->layer < 0 || a->layer >= pv->n_layers ||
      a->sink < 0 || !(a->scale > 0.0f))
    return lf_error(LF_ERR_INVALID_ARG,
                    "lf_cuda_decode_attn: bad shape (n_seq %d, kv heads %d, budget %d, layer %d "
                    "of %d, sink %d, scale %g)",
                    a->n_seq, pv->n_kv_heads, pv->budget, a->layer, pv->n_layers, a->sink,
                    (double)a->scale);
  if (a->q_stride % 8 || ((uintptr_t)a->q & 15) || ((uintptr_t)pv->k & 15) ||
      ((uintptr_t)pv->v & 15) || ((uintptr_t)a->out & 3))
    return lf_error(LF_ERR_INVALID_ARG,
                    "lf_cuda_decode_attn: q, k, v must be 16-byte aligned (q_stride a multiple "
                    "of 8), out 4-byte aligned");
  if (a->n_seq == 0) return LF_OK;

  int S = a->n_splits;
  const int smin = min_splits_for_smem(pv->budget, a->group);
  if (S <= 0)
    LF_TRY(auto_splits(a->n_seq, pv->n_kv_heads, pv->budget, a->group, pv->head_dim, &S));
  if (S < smin) S = smin; /* the logits of one split must fit in shared memory */
  if (S > DA_SPLITS_MAX) S = DA_SPLITS_MAX;
  const int cl = S >= 2 && S <= DA_CL_MAX && cluster_combine();
  const ws_layout wl = ws_plan(a->n_seq, pv->n_kv_heads, pv->budget, a->group, pv->head_dim, S);
  if (S > 1 && !cl && (!a->workspace || a->workspace_bytes < wl.total))
    return lf_error(LF_ERR_INVALID_ARG,
                    "lf_cuda_decode_attn: workspace of %zu bytes, %zu needed for %d splits",
                    a->workspace_bytes, wl.total, S);

  attn_params p;
  p.k = pv->k;
  p.v = pv->v;
  p.k_scale = pv->k_scale;
  p.v_scale = pv->v_scale;
  p.vnorm = pv->vnorm;
  p.pos = pv->pos;
  p.n = pv->n;
  p.next = pv->next;
  p.n_layers = pv->n_layers;
  p.n_kv = pv->n_kv_heads;
  p.budget = pv->budget;
  p.layer = a->layer;
  p.pool_ids = a->pool_ids;
  p.w = a->w;
  p.q = (const __nv_bfloat16 *)a->q;
  p.q_stride = a->q_stride ? a->q_stride : (size_t)pv->n_kv_heads * a->group * pv->head_dim;
  p.out = (__nv_bfloat16 *)a->out;
  p.group = a->group;
  p.sink = a->sink;
  p.policy = (int)a->policy;
  p.scale = a->scale;
  p.chunk_max = ((pv->budget + S - 1) / S + DA_TILE - 1) / DA_TILE * DA_TILE;
  kernel_switches(&p);
  char *ws = (char *)a->workspace;
  p.cnt = S > 1 && !cl ? (unsigned *)(ws + wl.cnt) : NULL;
  p.ml = S > 1 && !cl ? (float2 *)(ws + wl.ml) : NULL;
  p.po = S > 1 && !cl ? (float *)(ws + wl.po) : NULL;
  p.lg = S > 1 && !cl ? (float *)(ws + wl.lg) : NULL;
  p.scores = a->policy == LF_POLICY_LONGFLOW || a->policy == LF_POLICY_H2O ? a->scores : NULL;
  p.acc = lf_policy_accumulates(a->policy) ? pv->acc : NULL;
  p.recent = a->recent;
  p.since = a->policy == LF_POLICY_RKV ? pv->since : NULL;
  p.queue = a->policy == LF_POLICY_RKV ? pv->queue : NULL;
  p.stage = a->policy == LF_POLICY_RKV ? pv->stage : 0;
  p.obs = lf_rkv_obs_of(pv->obs);

  const dim3 grid(S, pv->n_kv_heads, a->n_seq);
  const int qd = pv->kv_dtype == LF_KV_FP8    ? DA_FP8
                 : pv->kv_dtype == LF_KV_INT8 ? DA_INT8
                 : pv->kv_dtype == LF_KV_INT4 ? DA_INT4
                 : pv->kv_dtype == LF_KV_K8V4 ? DA_K8V4
                                              : DA_BF16;
  /* Four blocks per SM (128 registers) while four blocks' shared memory still leaves L1 room
   * for loads in flight; past that, three blocks with the registers the compiler wants. */
  const size_t smem_est = (size_t)p.chunk_max * p.group * 4 + (size_t)p.group * pv->head_dim * 4;
  if (smem_est > 44 * 1024)
    return pv->head_dim == 64 ? launch_any<64, 1>(p, qd, grid, cl, stream)
                              : launch_any<128, 1>(p, qd, grid, cl, stream);
  return pv->head_dim == 64 ? launch_any<64, 4>(p, qd, grid, cl, stream)
                            : launch_any<128, 4>(p, qd, grid, cl, stream);
}

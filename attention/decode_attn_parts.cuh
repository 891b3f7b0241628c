/* The fused decode kernel's shared pieces (attention/decode_attn.cu only): its constants, its
 * parameter block, and the device helpers around the kernel: register transposes, the L2
 * prefetch, the scoring tail (score_key: LongFlow's, streaming's and h2o's scores and the argmin
 * key) and the exact split combine (combine_weights, store_acc). decode_attn.cu's opening comment
 * describes the protocol they implement.
 */
#ifndef LF_DECODE_ATTN_PARTS_CUH
#define LF_DECODE_ATTN_PARTS_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "attention/decode_attn.cuh"
#include "attention/evict.cuh"
#include "attention/rkv_step.h"
#include "base/cuda_ptx.cuh"

#define DA_NW 4                    /* warps per block */
#define DA_NT (DA_NW * 32)         /* threads per block */
#define DA_TILE 16                 /* slots per mma tile */
#define DA_UNR 2                   /* tiles in flight per warp */
#define DA_GMAX 8                  /* heads per KV head: the N side of the mma */
#define DA_SPLITS_MAX 64           /* combine weights live in static shared memory */
#define DA_LG_SMEM_MAX (64 * 1024) /* logits of one block kept in shared memory */
#define DA_LOG2E 1.4426950408889634f
#define DA_CL_MAX 8                /* splits combined in one thread-block cluster (portable size) */

/* Device pointers and shape, by value. Workspace arrays (n_splits > 1):
 *   cnt [n_seq][n_kv]                 arrival tickets
 *   ml  [n_seq][n_kv][n_splits][G]    (max, sum) of each split per head
 *   po  [n_seq][n_kv][n_splits][G][D] un-normalised partial outputs
 *   lg  [n_seq][n_kv][budget][G]      fp32 logits of every filled slot */
typedef struct attn_params {
  const void *k, *v;            /* bf16, or e4m3 codes (the F8 instantiation) */
  const float *k_scale, *v_scale; /* F8: each row's scale */
  const float *vnorm;
  const int32_t *pos, *n;
  int32_t *next;
  int n_layers, n_kv, budget, layer;
  const int32_t *pool_ids, *w;
  const __nv_bfloat16 *q;
  size_t q_stride;
  __nv_bfloat16 *out;
  int group, sink, policy;
  float scale;
  int chunk_max; /* slots of the largest split, sizes the shared logits */
  /* Fixed by the launcher (see kernel_switches below): */
  int prefetch;      /* 0: no per-warp L2 prefetch of the next tiles */
  int early_trigger; /* 1: the next kernel may launch once K and V are read */
  int fast_tail;     /* 1: the cluster path's tail with two barriers, every remote read at once */
  const void *l2_next; /* NULL: no L2 prefetch of the next kernel's weights */
  size_t l2_next_bytes;
  unsigned *cnt;
  float2 *ml;
  float *po, *lg;
  float *scores; /* NULL, or [n_seq][n_kv][budget]: every candidate's score (layer scope) */
  float *acc;    /* h2o and rkv: the pool's accumulators, [pool][layer][kv head][budget] */
  int recent;    /* h2o: the protected recent window */
  int32_t *since;         /* rkv: steps since each head's selection, [pool][layer][kv head] */
  const int32_t *queue;   /* rkv: each head's overwrite order, [pool][layer][kv head][stage] */
  int stage;              /* rkv: the queue's length */
  int obs;                /* rkv: its observation window (resolved: never 0) */
} attn_params;

/* fp8 pools (the F8 kernel). Two e4m3 codes (bytes of w picked by sel: 0x1404 bytes 0 and 1,
 * 0x3424 bytes 2 and 3) as a bf16 pair, lower byte in the low half: the code's sign, exponent and
 * mantissa bits moved into bf16's fields. That is the code's exact value times 2^-120
 * (subnormal codes included, bf16 sharing e4m3's zero exponent), with no arithmetic at all; the
 * kernel folds 2^120 back in with the row's scale. */
static __device__ __forceinline__ uint32_t fp8x2_bf16x2(uint32_t w, uint32_t sel) {
  const uint32_t x = __byte_perm(w, 0, sel);
  return ((x >> 4) & 0x07f007f0u) | (x & 0x80008000u);
}

/* Eight codes (one 8-byte load, in memory order) as the bf16 octet a 16-byte bf16 load gives. */
static __device__ __forceinline__ uint4 fp8x8_bf16x8(uint2 w) {
  return make_uint4(fp8x2_bf16x2(w.x, 0x1404), fp8x2_bf16x2(w.x, 0x3424),
                    fp8x2_bf16x2(w.y, 0x1404), fp8x2_bf16x2(w.y, 0x3424));
}

/* Eight int8 codes (one 8-byte load) as bf16 (exact: every integer up to 256 is a bf16): each
 * byte, sign bit flipped (v + 128), becomes the low byte of the fp32 2^23 + v + 128, from which
 * 2^23 + 128 is taken; pairs are then packed. */
static __device__ __forceinline__ uint32_t i8x2_bf16x2(uint32_t t, uint32_t sel0, uint32_t sel1) {
  const float a = __uint_as_float(__byte_perm(t, 0x4b000000u, sel0)) - 8388736.0f;
  const float b = __uint_as_float(__byte_perm(t, 0x4b000000u, sel1)) - 8388736.0f;
  return bf16_pack(a, b);
}

static __device__ __forceinline__ uint4 i8x8_bf16x8(uint2 w) {
  const uint32_t x = w.x ^ 0x80808080u, y = w.y ^ 0x80808080u;
  return make_uint4(i8x2_bf16x2(x, 0x7540, 0x7541), i8x2_bf16x2(x, 0x7542, 0x7543),
                    i8x2_bf16x2(y, 0x7540, 0x7541), i8x2_bf16x2(y, 0x7542, 0x7543));
}

/* The kernel's K/V storage: bf16, 8-bit codes with a scale per row, or 4-bit codes with a step
 * and floor per 32 dims (base/kvq.h). */
enum { DA_BF16 = 0, DA_FP8 = 1, DA_INT8 = 2, DA_INT4 = 3, DA_K8V4 = 4 };
/* The K and V row formats of a pool storage Q (k8v4: int8 keys, int4 values). */
constexpr int da_kfmt(int q) { return q == DA_K8V4 ? DA_INT8 : q; }
constexpr int da_vfmt(int q) { return q == DA_K8V4 ? DA_INT4 : q; }

/* int4 pools (the INT4 kernel). The nibbles of dims 2k and 2k + 1 of a code word (base/kvq.h's
 * order) as the bf16 pair (128 + code): the nibbles land in the low mantissa bits of 128.0's
 * pattern, so the pair is exact with one shift and one mask (a LOP3). */
static __device__ __forceinline__ uint32_t i4x2_img(uint32_t w, int k) {
  return ((w >> (4 * k)) & 0x000f000fu) | 0x43004300u;
}

/* Eight codes (one code word) as the bf16 octet of their images (128 + code), in dim order. */
static __device__ __forceinline__ uint4 i4x8_img(uint32_t w) {
  return make_uint4(i4x2_img(w, 0), i4x2_img(w, 1), i4x2_img(w, 2), i4x2_img(w, 3));
}

static __device__ __forceinline__ uint32_t bf16x2_fma(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

/* Eight codes as their values in bf16, s * code + m rounded once (the meta word (s, m) of
 * their group): the image minus 128 is the code exactly, then one bf16x2 fma. */
static __device__ __forceinline__ uint4 i4x8_bf16x8(uint32_t w, uint32_t meta) {
  const uint32_t s2 = __byte_perm(meta, 0, 0x1010), m2 = __byte_perm(meta, 0, 0x3232);
  uint4 r;
  r.x = bf16x2_fma(bf16x2_fma(i4x2_img(w, 0), 0x3f803f80u, 0xc300c300u), s2, m2);
  r.y = bf16x2_fma(bf16x2_fma(i4x2_img(w, 1), 0x3f803f80u, 0xc300c300u), s2, m2);
  r.z = bf16x2_fma(bf16x2_fma(i4x2_img(w, 2), 0x3f803f80u, 0xc300c300u), s2, m2);
  r.w = bf16x2_fma(bf16x2_fma(i4x2_img(w, 3), 0x3f803f80u, 0xc300c300u), s2, m2);
  return r;
}

/* Eight codes of storage Q as the bf16 octet a 16-byte bf16 load gives: fp8 scaled by 2^-120,
 * int8 exact. */
template <int Q>
static __device__ __forceinline__ uint4 q8x8_bf16x8(uint2 w) {
  return Q == DA_FP8 ? fp8x8_bf16x8(w) : i8x8_bf16x8(w);
}

/* A bf16 pair times a power of two (exact unless it overflows). */
static __device__ __forceinline__ uint32_t bf16x2_scale(uint32_t x, float s) {
  return bf16_pack(__uint_as_float(x << 16) * s, __uint_as_float(x & 0xffff0000u) * s);
}

/* The F8 kernel's fixed powers of two: q is raised by 2^64 so that q times a code's 2^-120 image
 * stays far from fp32's subnormals (products q.k 2^-56); the logit takes 2^56 back with the row's
 * scale. P is raised by 2^112 with the row's V scale (P' = p * scale_v * 2^112 <= 2^128 for any
 * scale_v below 2^16), and the accumulated output takes the remaining 2^8. */
#define DA_F8_QUP 18446744073709551616.0f      /* 2^64 */
#define DA_F8_KDOWN 72057594037927936.0f       /* 2^56 */
#define DA_F8_PUP 5192296858534827628530496329220096.0f /* 2^112 */
#define DA_F8_ODOWN 256.0f                     /* 2^8 */

static __device__ __forceinline__ uint32_t u4_get(const uint4 &x, int i) {
  return i == 0 ? x.x : i == 1 ? x.y : i == 2 ? x.z : x.w;
}

/* The low (h == 0) or high 8 bytes of x. */
static __device__ __forceinline__ uint2 u4_half(const uint4 &x, int h) {
  return h ? make_uint2(x.z, x.w) : make_uint2(x.x, x.y);
}

/* (x.lo, y.lo) for hi == 0, (x.hi, y.hi) otherwise: the register transpose of two bf16 pairs. */
static __device__ __forceinline__ uint32_t bf16_interleave(uint32_t x, uint32_t y, int hi) {
  return __byte_perm(x, y, hi ? 0x7632 : 0x5410);
}

static __device__ __forceinline__ unsigned long long warp_min_u64(unsigned long long x) {
  for (int o = 16; o > 0; o >>= 1) {
    unsigned long long y = __shfl_xor_sync(0xffffffffu, x, o);
    x = y < x ? y : x;
  }
  return x;
}

/* Asks L2 for the DA_UNR tiles this warp reads next (first tile index ti, DA_NW apart) of a
 * split's slots [s0, s1) of K or V: one 128-byte line per lane per tile, so the next
 * iteration's loads find their lines on chip while this one computes. A hint only. */
template <int D>
static __device__ __forceinline__ void prefetch_tiles(const __nv_bfloat16 *base, int s0, int s1,
                                                      int ti, int lane) {
  constexpr int LINES = DA_TILE * D * 2 / 128; /* lines per tile: 32 (D 128) or 16 (D 64) */
#pragma unroll
  for (int u = 0; u < DA_UNR; u++) {
    const int first = s0 + (ti + u * DA_NW) * DA_TILE;
    /* lane's line holds slot first + lane * 128 / (2 D): only lines of the split's slots */
    if (lane < LINES && first + lane * 64 / D < s1)
      prefetch_l2((const char *)(base + (size_t)first * D) + 128 * lane);
  }
}

/* sum_h alpha_h,i of slot i from its logits li [G] (shared memory, or global written by other
 * blocks of this launch: then read through L2) */
template <bool GLOBAL_LG>
static __device__ __forceinline__ float slot_mass(const float *li, int G, const float *fin_m,
                                                  const float *fin_il) {
  float l[DA_GMAX];
#pragma unroll
  for (int h = 0; h < DA_GMAX; h++)
    if (h < G) l[h] = GLOBAL_LG ? __ldcg(li + h) : li[h];
  float mass = 0.0f;
#pragma unroll
  for (int h = 0; h < DA_GMAX; h++)
    if (h < G) mass += exp2f((l[h] - fin_m[h]) * DA_LOG2E) * fin_il[h];
  return mass;
}

/* The end of a head's step, in one thread once every thread of every split has scored: next from
 * the argmin key; rkv instead advances since and takes next from its queue (-1 when a selection
 * is due: lf_cuda_rkv_select's due pass, launched after this kernel, sets it). */
template <bool H2O>
static __device__ __forceinline__ void finish_head(const attn_params &p, size_t hidx,
                                                   unsigned long long best) {
  if (H2O && p.policy == LF_POLICY_RKV) {
    const int sn = lf_rkv_advance(p.since[hidx]);
    p.since[hidx] = sn;
    p.next[hidx] = lf_rkv_next(p.queue + hidx * p.stage, sn, p.stage);
    return;
  }
  p.next[hidx] = lf_evict_slot_of(best);
}

/* Scores of slots [lo, hi) from logits lg [hi - lo][G]; returns, in thread 0, the smallest key
 * (lf_evict_key, attention/evict.cuh) over the evictable ones (~0 when there is none). h2o adds this
 * step's mass to the accumulators of every slot of the range (the slot written starts from 0)
 * and scores by them; slots with pos >= rfrom are its protected window. rkv (the H2O
 * instantiation) adds the mass only inside its observation window (k_left < obs; the
 * window's first step, or the first after a selection when the stage is shorter, starts every
 * slot from 0) and chooses nothing here: its queue does (finish_head). */
template <bool GLOBAL_LG, bool H2O>
static __device__ unsigned long long score_key(const attn_params &p, size_t hidx, int lo, int hi,
                                               int wslot, const float *lg, const float *fin_m,
                                               const float *fin_il, int rfrom,
                                               unsigned long long *red_key, float *sc) {
  const int G = p.group, B = p.budget;
  unsigned long long best = ~0ull;
  if (H2O && p.policy == LF_POLICY_RKV) {
    const int sn = lf_rkv_advance(p.since[hidx]), kl = lf_rkv_k_left(sn, p.n[hidx], B, p.stage);
    if (kl < p.obs) {
      const bool reset = lf_rkv_window_reset(sn, kl, p.obs);
      for (int i = lo + (int)threadIdx.x; i < hi; i += DA_NT) {
        float *a = p.acc + hidx * B + i;
        *a = lf_evict_h2o_acc(*a, slot_mass<GLOBAL_LG>(lg + (size_t)(i - lo) * G, G, fin_m, fin_il),
                              reset || i == wslot);
      }
    }
    __syncthreads(); /* every thread has read since before finish_head writes it */
    return best;
  }
  if (H2O) /* the sinks' accumulators (never candidates) */
    for (int i = lo + (int)threadIdx.x; i < min(p.sink, hi); i += DA_NT)
      p.acc[hidx * B + i] =
          lf_evict_h2o_acc(p.acc[hidx * B + i],
                           slot_mass<GLOBAL_LG>(lg + (size_t)(i - lo) * G, G, fin_m, fin_il),
                           i == wslot);
  if (p.policy != LF_POLICY_FULL) {
    const int i0 = max(p.sink, lo);
    /* unrolled with every load first: this loop runs after the block's streaming work, so its
     * latency is the kernel's tail */
#pragma unroll 4
    for (int i = i0 + (int)threadIdx.x; i < hi; i += DA_NT) {
      int32_t pos = 0; /* read where a rule needs it: h2o's window, streaming's score */
      uint32_t key;
      if (H2O) {
        pos = p.pos[hidx * B + i];
        const float mass = slot_mass<GLOBAL_LG>(lg + (size_t)(i - lo) * G, G, fin_m, fin_il);
        float *a = p.acc + hidx * B + i;
        const float s = lf_evict_h2o_acc(*a, mass, i == wslot);
        *a = s;
        key = __float_as_uint(s);
        if (sc && i != wslot) sc[i] = s; /* layer scope: the window is its argmin's to apply */
      } else if (p.policy == LF_POLICY_STREAMING) {
        pos = p.pos[hidx * B + i];
        key = (uint32_t)pos;
      } else {
        const float mass = slot_mass<GLOBAL_LG>(lg + (size_t)(i - lo) * G, G, fin_m, fin_il);
        const float s = lf_evict_longflow_score(p.vnorm[hidx * B + i], mass);
        key = __float_as_uint(s);
        if (sc && i != wslot) sc[i] = s;
      }
      const unsigned long long kk = lf_evict_key(key, i);
      if (lf_evict_candidate(i, p.sink, wslot, pos, H2O ? rfrom : INT_MAX))
        best = kk < best ? kk : best;
    }
  }
  best = warp_min_u64(best);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) red_key[warp] = best;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int i = 1; i < DA_NW; i++)
      best = red_key[i] < best ? red_key[i] : best;
  return best;
}

/* Head h's final max M and 1 / L from every split's (m, l) (ml(s) gives split s's), and the
 * weights cw[s][h] = exp(m_s - M) / L of the splits' partial outputs: the exact combine. */
template <class ML>
static __device__ __forceinline__ void combine_weights(ML ml, int S, int G, int h, float *cw,
                                                       float *fin_m, float *fin_il) {
  float m = -INFINITY, l = 0.0f;
  for (int s = 0; s < S; s++)
    m = fmaxf(m, ml(s).x);
  for (int s = 0; s < S; s++) {
    const float2 x = ml(s);
    const float c = x.y > 0.0f ? exp2f((x.x - m) * DA_LOG2E) : 0.0f;
    cw[s * G + h] = c;
    l += c * x.y;
  }
  fin_m[h] = m;
  fin_il[h] = 1.0f / l;
  for (int s = 0; s < S; s++)
    cw[s * G + h] *= 1.0f / l;
}

/* combine_weights over splits' (m, l) already in registers (x[s], s < S <= SM): the same
 * arithmetic in the same order, every loop unrolled so x stays in registers. */
template <int SM>
static __device__ __forceinline__ void combine_weights_reg(const float2 (&x)[SM], int S, int G,
                                                           int h, float *cw, float *fin_m,
                                                           float *fin_il) {
  float m = -INFINITY, l = 0.0f, c[SM];
#pragma unroll
  for (int s = 0; s < SM; s++)
    if (s < S) m = fmaxf(m, x[s].x);
#pragma unroll
  for (int s = 0; s < SM; s++)
    if (s < S) {
      c[s] = x[s].y > 0.0f ? exp2f((x[s].x - m) * DA_LOG2E) : 0.0f;
      l += c[s] * x[s].y;
    }
  fin_m[h] = m;
  fin_il[h] = 1.0f / l;
#pragma unroll
  for (int s = 0; s < SM; s++)
    if (s < S) cw[s * G + h] = c[s] * (1.0f / l);
}

/* A warp's P.V accumulators into dst [G][D]: accumulator (mt, 0/1) is the dim of e0 = mt,
 * heads 2t / 2t+1; (mt, 2/3) the dim of e1 = mt + NMT; dim d = 64 (e >> 3) + 8 g + (e & 7), or
 * d = 16 g + e when V came in as one contiguous run of 16 dims per thread (V16).
 * ACC_FIRST stores 0 + x (the first add of a running sum), ACC_ADD adds x, ACC_SET stores x. */
enum { ACC_FIRST, ACC_ADD, ACC_SET };
template <int D, bool V16>
static __device__ __forceinline__ void store_acc(float *dst, const float (&oacc)[D / 16][4], int G,
                                                 int g, int t, int mode) {
  constexpr int NMT = D / 16;
#pragma unroll
  for (int mt = 0; mt < NMT; mt++)
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const int h = 2 * t + (r & 1), e = (r < 2) ? mt : mt + NMT;
      const int d = V16 ? 16 * g + e : 64 * (e >> 3) + 8 * g + (e & 7);
      if (h < G) {
        float *o = dst + h * D + d;
        *o = mode == ACC_ADD ? *o + oacc[mt][r] : mode == ACC_FIRST ? 0.0f + oacc[mt][r] : oacc[mt][r];
      }
    }
}

#endif

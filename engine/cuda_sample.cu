/* Device sampling (see cuda_sample.cuh). Sums are in double, as in lf_sample; a block walks the
 * cumulative distribution with each thread owning a contiguous run of entries, so the first
 * crossing is found in index order. */
#include "cuda_sample.cuh"

#include <cub/device/device_radix_sort.cuh>
#include <cuda_runtime.h>
#include <float.h>

#include "attention/cuda_check.h"

#define SMP_NT 1024

/* Index of the largest logit, lowest on ties; every thread gets it. Each thread visits its
 * entries in increasing index order (the unaligned head, its 16-byte groups, the tail), so a
 * strict comparison keeps its lowest index on ties; the groups are loaded 4 at a time per thread,
 * so a 128K-entry row is a few round trips, not a hundred. */
static __device__ int block_argmax(const float *x, int n) {
  __shared__ float bv[SMP_NT / 32];
  __shared__ int bi[SMP_NT / 32];
  float v = -FLT_MAX;
  int idx = n; /* none */
  const int head = min(n, (int)(((16 - ((uintptr_t)x & 15)) & 15) >> 2));
  for (int i = threadIdx.x; i < head; i += blockDim.x)
    if (idx == n || x[i] > v) {
      v = x[i];
      idx = i;
    }
  const float4 *x4 = (const float4 *)(x + head);
  const int n4 = (n - head) >> 2;
#pragma unroll 4
  for (int j = threadIdx.x; j < n4; j += blockDim.x) {
    const float4 q = x4[j];
    const int b = head + 4 * j;
    if (idx == n || q.x > v) { v = q.x; idx = b; }
    if (q.y > v) { v = q.y; idx = b + 1; }
    if (q.z > v) { v = q.z; idx = b + 2; }
    if (q.w > v) { v = q.w; idx = b + 3; }
  }
  for (int i = head + 4 * n4 + threadIdx.x; i < n; i += blockDim.x)
    if (idx == n || x[i] > v) {
      v = x[i];
      idx = i;
    }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (oi < n && (idx == n || ov > v || (ov == v && oi < idx))) {
      v = ov;
      idx = oi;
    }
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) {
    bv[threadIdx.x >> 5] = v;
    bi[threadIdx.x >> 5] = idx;
  }
  __syncthreads();
  v = bv[0];
  idx = bi[0];
  for (int w = 1; w < (int)blockDim.x / 32; w++)
    if (bi[w] < n && (idx == n || bv[w] > v || (bv[w] == v && bi[w] < idx))) {
      v = bv[w];
      idx = bi[w];
    }
  return idx < n ? idx : 0;
}

/* The first i < m where the inclusive prefix sum c_i of prob satisfies `thr < c_i` (strict) or
 * `c_i >= thr` (!strict), or -1; *total gets the sum of prob[0..m). Every thread gets both. */
static __device__ int block_first_crossing(const float *prob, int m, double thr, int strict,
                                           double *total) {
  __shared__ double part[SMP_NT];
  __shared__ int first;
  const int nt = blockDim.x, t = threadIdx.x;
  const int chunk = (m + nt - 1) / nt;
  const int i0 = t * chunk < m ? t * chunk : m, i1 = i0 + chunk < m ? i0 + chunk : m;
  double s = 0.0;
  for (int i = i0; i < i1; i++) s += prob[i];
  __syncthreads();
  part[t] = s;
  if (t == 0) first = m;
  __syncthreads();
  if (t == 0) {
    double c = 0.0;
    for (int i = 0; i < nt; i++) {
      const double x = part[i];
      part[i] = c;
      c += x;
    }
    *total = c;
  }
  __syncthreads();
  double c = part[t];
  for (int i = i0; i < i1; i++) {
    c += prob[i];
    if (strict ? thr < c : c >= thr) {
      atomicMin(&first, i);
      break;
    }
  }
  __syncthreads();
  const int f = first;
  __syncthreads();
  return f < m ? f : -1;
}

/* One block per item; prob is the item's scratch row [vocab] (the logits row itself is not
 * modified). */
static __global__ void sample_kernel(const float *logits, int vocab,
                                     const lf_sample_params *params, int32_t *tokens,
                                     float *probs) {
  __shared__ double total;
  const int it = blockIdx.x;
  const lf_sample_params p = params[it];
  const float *l = logits + (size_t)it * vocab;
  const int want_k = p.top_k > 0 && p.top_k < vocab, want_p = p.top_p > 0.0f && p.top_p < 1.0f;
  if (p.temperature > 0.0f && (want_k || want_p)) return; /* the sorted path */
  const int am = block_argmax(l, vocab);
  if (p.temperature <= 0.0f) {
    if (threadIdx.x == 0) tokens[it] = am;
    return;
  }
  const float mx = l[am];
  float *pr = probs + (size_t)it * vocab;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) pr[i] = expf((l[i] - mx) / p.temperature);
  __syncthreads();
  /* total first, then the crossing of u * total */
  block_first_crossing(pr, vocab, 0.0, 0, &total);
  const double target = (double)p.u * total;
  const int f = block_first_crossing(pr, vocab, target, 1, &total);
  if (threadIdx.x == 0) tokens[it] = f >= 0 ? f : vocab - 1;
}

extern "C" int lf_sample_needs_sort(const lf_sample_params *p, int vocab) {
  return p->temperature > 0.0f &&
         ((p->top_k > 0 && p->top_k < vocab) || (p->top_p > 0.0f && p->top_p < 1.0f));
}

/* Scratch of the sorted path: probs, ids, sorted probs, sorted ids ([vocab] each, 256-byte
 * aligned), then CUB's temporary storage. */
static size_t al256(size_t x) {
  return (x + 255) & ~(size_t)255;
}

static size_t cub_bytes(int vocab) {
  size_t tb = 0;
  cub::DeviceRadixSort::SortPairsDescending((void *)NULL, tb, (const float *)NULL, (float *)NULL,
                                            (const int *)NULL, (int *)NULL, vocab);
  return tb;
}

extern "C" size_t lf_cuda_sample_sort_bytes(int vocab) {
  return 4 * al256((size_t)vocab * 4) + al256(cub_bytes(vocab));
}

extern "C" lf_status lf_cuda_sample(const float *logits, int vocab, int n,
                                    const lf_sample_params *params, int32_t *tokens, float *probs,
                                    cudaStream_t stream) {
  if (!logits || !params || !tokens || !probs || vocab < 1 || n < 0)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_sample: bad arguments");
  if (n == 0) return LF_OK;
  sample_kernel<<<n, SMP_NT, 0, stream>>>(logits, vocab, params, tokens, probs);
  LF_CUDA_CHECK_LAUNCH("sample_kernel");
  return LF_OK;
}

static __global__ void sort_prep_kernel(const float *l, int vocab, float temperature, float *prob,
                                        int *ids) {
  const float mx = l[block_argmax(l, vocab)];
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    prob[i] = expf((l[i] - mx) / temperature);
    ids[i] = i;
  }
}

/* After the sort: top-k, then the top-p cut on the descending order; then, as lf_sample does,
 * the draw walks the kept tokens in id order. kp [vocab] is scratch (the kept probabilities by
 * id, zero elsewhere: zeros never move the cumulative sum, so the first crossing is a kept id). */
static __global__ void sort_pick_kernel(const float *sprob, const int *sids, int vocab,
                                        lf_sample_params p, float *kp, int32_t *token) {
  __shared__ double total;
  __shared__ int max_id;
  int m = p.top_k > 0 && p.top_k < vocab ? p.top_k : vocab;
  if (p.top_p > 0.0f && p.top_p < 1.0f) {
    block_first_crossing(sprob, m, 0.0, 0, &total);
    const double kept = total;
    const int cut = block_first_crossing(sprob, m, (double)p.top_p * kept, 0, &total);
    if (cut >= 0) m = cut + 1;
  }
  if (threadIdx.x == 0) max_id = 0;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) kp[i] = 0.0f;
  __syncthreads();
  for (int i = threadIdx.x; i < m; i += blockDim.x) {
    kp[sids[i]] = sprob[i];
    atomicMax(&max_id, sids[i]);
  }
  __syncthreads();
  block_first_crossing(kp, vocab, 0.0, 0, &total);
  const double target = (double)p.u * total;
  const int f = block_first_crossing(kp, vocab, target, 1, &total);
  if (threadIdx.x == 0) *token = f >= 0 ? f : max_id;
}

extern "C" lf_status lf_cuda_sample_sorted(const float *logits, int vocab,
                                           const lf_sample_params *p, int32_t *token,
                                           void *scratch, size_t scratch_bytes,
                                           cudaStream_t stream) {
  if (!logits || !p || !token || !scratch || vocab < 1 || !(p->temperature > 0.0f))
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_sample_sorted: bad arguments");
  const size_t a = al256((size_t)vocab * 4), tb = cub_bytes(vocab);
  if (scratch_bytes < 4 * a + tb)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_sample_sorted: scratch of %zu bytes, %zu needed",
                    scratch_bytes, 4 * a + tb);
  char *s = (char *)scratch;
  float *prob = (float *)s, *sprob = (float *)(s + 2 * a);
  int *ids = (int *)(s + a), *sids = (int *)(s + 3 * a);
  sort_prep_kernel<<<1, SMP_NT, 0, stream>>>(logits, vocab, p->temperature, prob, ids);
  LF_CUDA_CHECK_LAUNCH("sort_prep_kernel");
  size_t tbytes = tb;
  LF_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(s + 4 * a, tbytes, prob, sprob, ids,
                                                          sids, vocab, 0, 32, stream));
  sort_pick_kernel<<<1, SMP_NT, 0, stream>>>(sprob, sids, vocab, *p, prob, token);
  LF_CUDA_CHECK_LAUNCH("sort_pick_kernel");
  return LF_OK;
}

/* ---- vocab-parallel greedy choice (tensor parallelism) ------------------------------------- */

static __global__ void argmax_pairs_kernel(const float *logits, int n_vocab, int id0,
                                           int32_t *pairs) {
  const int it = blockIdx.x;
  const float *l = logits + (size_t)it * n_vocab;
  const int am = block_argmax(l, n_vocab);
  if (threadIdx.x == 0) {
    pairs[2 * it] = __float_as_int(l[am]);
    pairs[2 * it + 1] = id0 + am;
  }
}

extern "C" lf_status lf_cuda_argmax_pairs(const float *logits, int n_vocab, int n, int id0,
                                          int32_t *pairs, cudaStream_t stream) {
  if (!logits || !pairs || n_vocab < 1 || n < 0)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_argmax_pairs: bad arguments");
  if (n == 0) return LF_OK;
  argmax_pairs_kernel<<<n, SMP_NT, 0, stream>>>(logits, n_vocab, id0, pairs);
  LF_CUDA_CHECK_LAUNCH("argmax_pairs_kernel");
  return LF_OK;
}

/* Strictly larger wins, so a tie keeps the lower rank, whose ids are lower: lf_argmax. */
static __global__ void tp_pick_kernel(const int32_t *all, int n_ranks, int n, int32_t *tokens) {
  const int it = blockIdx.x * blockDim.x + threadIdx.x;
  if (it >= n) return;
  float best = __int_as_float(all[2 * it]);
  int32_t id = all[2 * it + 1];
  for (int r = 1; r < n_ranks; r++) {
    const int32_t *p = all + ((size_t)r * n + it) * 2;
    const float v = __int_as_float(p[0]);
    if (v > best) {
      best = v;
      id = p[1];
    }
  }
  tokens[it] = id;
}

extern "C" lf_status lf_cuda_tp_pick(const int32_t *all, int n_ranks, int n, int32_t *tokens,
                                     cudaStream_t stream) {
  if (!all || !tokens || n_ranks < 1 || n < 0)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_tp_pick: bad arguments");
  if (n == 0) return LF_OK;
  tp_pick_kernel<<<(n + 127) / 128, 128, 0, stream>>>(all, n_ranks, n, tokens);
  LF_CUDA_CHECK_LAUNCH("tp_pick_kernel");
  return LF_OK;
}

/* ---- vocab-parallel top-k candidates (tensor parallelism, sampled items) -------------------- */

/* Order-preserving key: a larger float gives a larger key (-inf lowest, NaN above +inf). */
static __device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* One block per item: the k largest of the slice, ties by lower id (k = 1 for greedy items,
 * top_k otherwise). The k-th largest key by a 4-pass radix select (8 bits a pass) over the
 * slice, then every element above it (any order: the set is what counts) and, of those equal
 * to it, the lowest ids in id order (a block scan per tile of SMP_NT). Pads to kmax. */
static __global__ void topk_pairs_kernel(const float *logits, int n_vocab, int id0,
                                         const lf_sample_params *params, int kmax,
                                         int32_t *pairs) {
  __shared__ unsigned hist[256];
  __shared__ uint32_t s_prefix;
  __shared__ int s_krem, s_cnt, s_base;
  __shared__ int wsum[SMP_NT / 32];
  const int it = blockIdx.x, t = threadIdx.x;
  const float *l = logits + (size_t)it * n_vocab;
  int32_t *o = pairs + (size_t)it * kmax * 2;
  const lf_sample_params sp = params[it];
  int k = sp.temperature <= 0.0f ? 1 : sp.top_k;
  if (k > kmax) k = kmax;
  if (k > n_vocab) k = n_vocab;
  for (int j = k + t; j < kmax; j += blockDim.x) { /* padding */
    o[2 * j] = __float_as_int(-INFINITY);
    o[2 * j + 1] = -1;
  }
  if (k < 1) return;
  uint32_t prefix = 0, mask = 0;
  int krem = k;
  if (k < n_vocab) {
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = t; i < 256; i += blockDim.x) hist[i] = 0;
      __syncthreads();
      for (int i = t; i < n_vocab; i += blockDim.x) {
        const uint32_t key = order_key(l[i]);
        if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
      }
      __syncthreads();
      if (t == 0) {
        int cum = 0, d = 255;
        for (; d > 0; d--) {
          if (cum + (int)hist[d] >= krem) break;
          cum += (int)hist[d];
        }
        s_krem = krem - cum;
        s_prefix = prefix | ((uint32_t)d << shift);
      }
      __syncthreads();
      krem = s_krem;
      prefix = s_prefix;
      mask |= 255u << shift;
      __syncthreads();
    }
  } else {
    prefix = 0; /* every element: "above" the lowest key, none needed at it */
    krem = 0;
  }
  const uint32_t kth = prefix; /* k < n_vocab: the k-th largest key; krem of its equals wanted */
  const bool all = k >= n_vocab;
  if (t == 0) {
    s_cnt = 0;
    s_base = 0;
  }
  __syncthreads();
  for (int i = t; i < n_vocab; i += blockDim.x) {
    const float v = l[i];
    if (all || order_key(v) > kth) {
      const int j = atomicAdd(&s_cnt, 1);
      o[2 * j] = __float_as_int(v);
      o[2 * j + 1] = id0 + i;
    }
  }
  __syncthreads();
  const int above = s_cnt; /* k - krem */
  for (int i0 = 0; krem > 0 && i0 < n_vocab; i0 += blockDim.x) {
    const int i = i0 + t;
    const int eq = i < n_vocab && order_key(l[i]) == kth;
    /* exclusive prefix of eq over the tile, in thread order */
    const unsigned b = __ballot_sync(0xffffffffu, eq);
    const int lane = t & 31, w = t >> 5;
    const int in_warp = __popc(b & ((1u << lane) - 1u));
    if (lane == 0) wsum[w] = __popc(b);
    __syncthreads();
    int before = 0, total = 0;
    for (int x = 0; x < (int)blockDim.x / 32; x++) {
      if (x < w) before += wsum[x];
      total += wsum[x];
    }
    const int pos = s_base + before + in_warp;
    if (eq && pos < krem) {
      o[2 * (above + pos)] = __float_as_int(l[i]);
      o[2 * (above + pos) + 1] = id0 + i;
    }
    __syncthreads();
    if (t == 0) s_base += total;
    __syncthreads();
    if (s_base >= krem) break;
  }
}

extern "C" lf_status lf_cuda_topk_pairs(const float *logits, int n_vocab, int n, int id0,
                                        const lf_sample_params *params, int kmax, int32_t *pairs,
                                        cudaStream_t stream) {
  if (!logits || !params || !pairs || n_vocab < 1 || n < 0 || kmax < 1)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_topk_pairs: bad arguments");
  if (n == 0) return LF_OK;
  topk_pairs_kernel<<<n, SMP_NT, 0, stream>>>(logits, n_vocab, id0, params, kmax, pairs);
  LF_CUDA_CHECK_LAUNCH("topk_pairs_kernel");
  return LF_OK;
}

static __global__ void fill_kernel(float *x, size_t n, float v) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    x[i] = v;
}

static __global__ void scatter_pairs_kernel(const int32_t *all, int n_ranks, int n, int kmax,
                                            int vocab, float *full) {
  const size_t total = (size_t)n_ranks * n * kmax;
  for (size_t q = (size_t)blockIdx.x * blockDim.x + threadIdx.x; q < total;
       q += (size_t)gridDim.x * blockDim.x) {
    const int it = (int)(q / kmax % n);
    const int32_t id = all[2 * q + 1];
    if (id >= 0 && id < vocab) full[(size_t)it * vocab + id] = __int_as_float(all[2 * q]);
  }
}

extern "C" lf_status lf_cuda_scatter_pairs(const int32_t *all, int n_ranks, int n, int kmax,
                                           int vocab, float *full, cudaStream_t stream) {
  if (!all || !full || n_ranks < 1 || n < 0 || kmax < 1 || vocab < 1)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_scatter_pairs: bad arguments");
  if (n == 0) return LF_OK;
  fill_kernel<<<264, 256, 0, stream>>>(full, (size_t)n * vocab, -INFINITY);
  LF_CUDA_CHECK_LAUNCH("fill_kernel");
  const size_t total = (size_t)n_ranks * n * kmax;
  const unsigned blocks = (unsigned)((total + 255) / 256 < 1024 ? (total + 255) / 256 : 1024);
  scatter_pairs_kernel<<<blocks, 256, 0, stream>>>(all, n_ranks, n, kmax, vocab, full);
  LF_CUDA_CHECK_LAUNCH("scatter_pairs_kernel");
  return LF_OK;
}

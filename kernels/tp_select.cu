/* Token selection under tensor parallelism over the vocab-parallel LM head (see tp_select.cuh). */
#include "kernels/tp_select.cuh"

#include <cuda_runtime.h>
#include <math.h>

#include "base/cuda_check.h"
#include "kernels/block_argmax.cuh"

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

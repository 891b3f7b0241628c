/* Device sampling (see sample.cuh). Sums are in double, as in lf_sample; a block walks the
 * cumulative distribution with each thread owning a contiguous run of entries, so the first
 * crossing is found in index order. */
#include "kernels/sample.cuh"

#include <cub/device/device_radix_sort.cuh>
#include <cuda_runtime.h>
#include <float.h>

#include "base/cuda_check.h"
#include "kernels/block_argmax.cuh"

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

static __global__ void logits_adjust_kernel(float *logits, int vocab, const lf_cuda_logit_adj *e,
                                            int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const lf_cuda_logit_adj a = e[i];
  float *p = logits + (size_t)a.row * vocab + a.token;
  float l = __fadd_rn(*p, a.bias);
  if (a.seen && a.rep > 0.0f && a.rep != 1.0f)
    l = l > 0.0f ? __fdiv_rn(l, a.rep) : __fmul_rn(l, a.rep);
  *p = __fsub_rn(l, a.sub);
}

extern "C" lf_status lf_cuda_logits_adjust(float *logits, int vocab,
                                           const lf_cuda_logit_adj *entries, int n,
                                           cudaStream_t stream) {
  if (!logits || vocab < 1 || n < 0 || (n > 0 && !entries))
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_logits_adjust: bad arguments");
  if (n == 0) return LF_OK;
  logits_adjust_kernel<<<(n + 255) / 256, 256, 0, stream>>>(logits, vocab, entries, n);
  LF_CUDA_CHECK_LAUNCH("logits_adjust_kernel");
  return LF_OK;
}

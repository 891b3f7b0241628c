/* The block-wide argmax shared by greedy sampling (kernels/sample.cu) and the tensor-parallel
 * (max, id) pairs (kernels/tp_select.cu): one definition, so both pick the same index. CUDA only;
 * blocks of SMP_NT threads. */
#ifndef LF_KERNELS_BLOCK_ARGMAX_CUH
#define LF_KERNELS_BLOCK_ARGMAX_CUH

#include <float.h>
#include <stdint.h>

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

#endif

/* Small-batch bf16 GEMV (see gemv.cuh). */
#include "kernels/gemv.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "base/cuda_check.h"
#include "base/cuda_ptx.cuh"
#include "base/cuda_launch.cuh"

#define GV_WARPS 8 /* warps (output rows) per block */

static __device__ __forceinline__ void unpack8(const uint4 v, float f[8]) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; i++) {
    f[2 * i] = __uint_as_float(u[i] << 16);
    f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
}

/* Every acc[i][j] summed over the warp (butterfly: every lane gets the sum, in one fixed order). */
template <int A, int B> static __device__ __forceinline__ void warp_sum_all(float (&acc)[A][B]) {
#pragma unroll
  for (int i = 0; i < A; i++)
#pragma unroll
    for (int j = 0; j < B; j++)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[i][j] += __shfl_xor_sync(0xffffffffu, acc[i][j], o);
}

/* KS warps per output row o (MODE GLU: rows o and n_out + o), 8 / KS rows per block. Part p of
 * a row reads the groups of 32 * U chunks p, p + KS, ... (a chunk is 16 bytes; lane l takes
 * chunk l + 32 u of a group), all U loads of a group in flight before any is used; the KS
 * partial sums meet in shared memory in part order, so the result is deterministic. */
template <int NT, int MODE, int KS>
static __global__ void __launch_bounds__(GV_WARPS * 32)
    gemv_kernel(const __nv_bfloat16 *__restrict__ W, const __nv_bfloat16 *__restrict__ X,
                size_t ldx, int n_in, int n_out, void *__restrict__ Y, size_t ldy, float beta) {
  constexpr int R = MODE == LF_GEMV_GLU ? 2 : 1;
  constexpr int U = R == 2 ? 4 : 8;
  constexpr int RPB = GV_WARPS / KS;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int part = warp % KS;
  const int row = blockIdx.x * RPB + warp / KS;
  if (KS == 1 && row >= n_out) return;
  const bool valid = row < n_out;
  const int nch = valid ? n_in >> 3 : 0;
  const uint4 *wr[R];
#pragma unroll
  for (int r = 0; r < R; r++)
    wr[r] = (const uint4 *)(W + ((size_t)(valid ? row : 0) + (size_t)r * n_out) * (size_t)n_in);
  const int c_first = lane + 32 * U * part, c_step = 32 * U * KS;
  /* The weights do not depend on the previous kernel: start this warp's first chunks towards L2
   * while it finishes, then wait for X (programmatic dependent launch, cuda_launch.cuh). */
#pragma unroll
  for (int u = 0; u < U; u++)
    if (c_first + 32 * u < nch)
#pragma unroll
      for (int r = 0; r < R; r++) prefetch_l2(wr[r] + c_first + 32 * u);
  pdl_wait();
  float acc[R][NT];
#pragma unroll
  for (int r = 0; r < R; r++)
#pragma unroll
    for (int t = 0; t < NT; t++) acc[r][t] = 0.0f;

  for (int c0 = c_first; c0 < nch; c0 += c_step) {
    uint4 wv[R][U];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int c = c0 + 32 * u;
#pragma unroll
      for (int r = 0; r < R; r++) wv[r][u] = c < nch ? ld_stream(wr[r] + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int c = c0 + 32 * u;
      if (c < nch) {
        float wf[R][8];
#pragma unroll
        for (int r = 0; r < R; r++) unpack8(wv[r][u], wf[r]);
#pragma unroll
        for (int t = 0; t < NT; t++) {
          float xf[8];
          unpack8(__ldg((const uint4 *)(X + (size_t)t * ldx) + c), xf);
#pragma unroll
          for (int r = 0; r < R; r++)
#pragma unroll
            for (int k = 0; k < 8; k++) acc[r][t] = fmaf(wf[r][k], xf[k], acc[r][t]);
        }
      }
    }
  }
  pdl_trigger();
  warp_sum_all(acc);
  if (KS > 1) {
    __shared__ float red[GV_WARPS][R][NT];
    if (lane == 0)
#pragma unroll
      for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) red[warp][r][t] = acc[r][t];
    __syncthreads();
    if (part != 0 || !valid) return;
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
      for (int t = 0; t < NT; t++) {
        float a = red[warp][r][t];
#pragma unroll
        for (int q = 1; q < KS; q++) a += red[warp + q][r][t];
        acc[r][t] = a;
      }
  }
  if (lane != 0) return;
#pragma unroll
  for (int t = 0; t < NT; t++) {
    if (MODE == LF_GEMV_F32) {
      float *y = (float *)Y + (size_t)t * ldy + row;
      *y = beta != 0.0f ? acc[0][t] + beta * *y : acc[0][t];
    } else if (MODE == LF_GEMV_BF16) {
      ((__nv_bfloat16 *)Y)[(size_t)t * ldy + row] = __float2bfloat16(acc[0][t]);
    } else {
      const float g = acc[0][t];
      ((__nv_bfloat16 *)Y)[(size_t)t * ldy + row] =
          __float2bfloat16(g / (1.0f + expf(-g)) * acc[R - 1][t]);
    }
  }
}

extern "C" int lf_cuda_gemv_ok(const void *W, const void *X, int n_in, size_t ldx, int n_tok) {
  return W && X && n_tok >= 1 && n_tok <= LF_GEMV_MAX_TOK && n_in >= 8 && n_in % 8 == 0 &&
         ldx % 8 == 0 && ((uintptr_t)W & 15) == 0 && ((uintptr_t)X & 15) == 0;
}

typedef void (*gemv_fn)(const __nv_bfloat16 *, const __nv_bfloat16 *, size_t, int, int, void *,
                        size_t, float);

/* The instance of kernel template K for nt tokens (1..LF_GEMV_MAX_TOK), the other template
 * arguments given: `return` from the calling function. */
#define GV_RETURN_BY_NT(nt, K, ...)                                                               \
  switch (nt) {                                                                                    \
  case 1: return K<1, __VA_ARGS__>;                                                                \
  case 2: return K<2, __VA_ARGS__>;                                                                \
  case 3: return K<3, __VA_ARGS__>;                                                                \
  case 4: return K<4, __VA_ARGS__>;                                                                \
  case 5: return K<5, __VA_ARGS__>;                                                                \
  case 6: return K<6, __VA_ARGS__>;                                                                \
  case 7: return K<7, __VA_ARGS__>;                                                                \
  default: return K<8, __VA_ARGS__>;                                                               \
  }

template <int MODE, int KS> static gemv_fn pick_nt(int nt) {
  GV_RETURN_BY_NT(nt, gemv_kernel, MODE, KS)
}

/* The kernel of a mode: 8 chunks of 16 bytes in flight per lane (16 is slower: more registers,
 * fewer warps), one warp a row (KS = 1: rows split over 2 or 4 warps are slower than one warp a
 * row, bench/RESULTS.md). */
static gemv_fn pick(lf_gemv_out mode, int nt) {
  if (mode == LF_GEMV_BF16) return pick_nt<LF_GEMV_BF16, 1>(nt);
  if (mode == LF_GEMV_GLU) return pick_nt<LF_GEMV_GLU, 1>(nt);
  return pick_nt<LF_GEMV_F32, 1>(nt);
}

extern "C" lf_status lf_cuda_gemv(const void *W, const void *X, size_t ldx, int n_in, int n_out,
                                  int n_tok, void *Y, size_t ldy, lf_gemv_out mode, float beta,
                                  cudaStream_t stream) {
  if (!lf_cuda_gemv_ok(W, X, n_in, ldx, n_tok) || !Y || n_out < 1 || ldy < (size_t)n_out)
    return lf_error(LF_ERR_INVALID_ARG,
                    "lf_cuda_gemv: unsupported shape (n_in %d, ldx %zu, n_out %d, n_tok %d, ldy "
                    "%zu) or misaligned pointer",
                    n_in, ldx, n_out, n_tok, ldy);
  if (mode != LF_GEMV_F32 && mode != LF_GEMV_BF16 && mode != LF_GEMV_GLU)
    return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_gemv: mode %d", (int)mode);
  const int rpb = GV_WARPS;
  const dim3 grid((unsigned)((n_out + rpb - 1) / rpb));
  lf_launch(pick(mode, n_tok), grid, dim3(GV_WARPS * 32), 0, stream,
            (const __nv_bfloat16 *)W, (const __nv_bfloat16 *)X, ldx, n_in, n_out, Y, ldy, beta);
  LF_CUDA_CHECK_LAUNCH("gemv_kernel");
  return LF_OK;
}

/* K in P contiguous parts (F32 mode): lane l of part p accumulates the part's chunks l, l + 32,
 * ... in that order, each part's sum is reduced over the warp alone, and the P sums meet in a
 * fixed pairwise tree ((a0 + a1) + (a2 + a3)) + ... So a part's bits depend only on its own
 * K slice, and a matrix cut into T column blocks, each block's GEMV run with P / T parts and the
 * blocks' results added by the same tree, gives exactly the bits of the whole matrix run with P
 * parts: the tensor-parallel O and down projections equal one GPU's (engine/cuda/gemm.cu).
 * KS warps per row, each owning P / KS whole parts; every warp keeps 8 loads per lane in flight
 * (UJ = 8 / parts-per-warp per part). */
template <int NT, int P, int KS>
static __global__ void __launch_bounds__(GV_WARPS * 32)
    gemv_parts_kernel(const __nv_bfloat16 *__restrict__ W, const __nv_bfloat16 *__restrict__ X,
                      size_t ldx, int n_in, int n_out, float *__restrict__ Y, size_t ldy,
                      float beta) {
  constexpr int PW = P / KS;             /* parts per warp */
  constexpr int UJ = PW >= 8 ? 1 : 8 / PW; /* loads per part per iteration */
  constexpr int RPB = GV_WARPS / KS;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wpart = warp % KS;
  const int row = blockIdx.x * RPB + warp / KS;
  const bool valid = row < n_out;
  const int cpp = valid ? (n_in >> 3) / P : 0; /* 16-byte chunks per part */
  const uint4 *wr = (const uint4 *)(W + (size_t)(valid ? row : 0) * (size_t)n_in);
  const int p0 = wpart * PW;
#pragma unroll
  for (int q = 0; q < PW; q++)
#pragma unroll
    for (int u = 0; u < UJ; u++)
      if (lane + 32 * u < cpp) prefetch_l2(wr + (size_t)(p0 + q) * cpp + lane + 32 * u);
  pdl_wait();
  float acc[PW][NT];
#pragma unroll
  for (int q = 0; q < PW; q++)
#pragma unroll
    for (int t = 0; t < NT; t++) acc[q][t] = 0.0f;
  for (int j0 = lane; j0 < cpp; j0 += 32 * UJ) {
    uint4 wv[PW][UJ];
#pragma unroll
    for (int q = 0; q < PW; q++)
#pragma unroll
      for (int u = 0; u < UJ; u++) {
        const int c = j0 + 32 * u;
        wv[q][u] = c < cpp ? ld_stream(wr + (size_t)(p0 + q) * cpp + c) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
    for (int q = 0; q < PW; q++)
#pragma unroll
      for (int u = 0; u < UJ; u++) {
        const int c = j0 + 32 * u;
        if (c < cpp) {
          float wf[8];
          unpack8(wv[q][u], wf);
          const int xc = (p0 + q) * cpp + c;
#pragma unroll
          for (int t = 0; t < NT; t++) {
            float xf[8];
            unpack8(__ldg((const uint4 *)(X + (size_t)t * ldx) + xc), xf);
#pragma unroll
            for (int k = 0; k < 8; k++) acc[q][t] = fmaf(wf[k], xf[k], acc[q][t]);
          }
        }
      }
  }
  pdl_trigger();
  warp_sum_all(acc);
  __shared__ float red[GV_WARPS / KS][P][NT];
  if (lane == 0)
#pragma unroll
    for (int q = 0; q < PW; q++)
#pragma unroll
      for (int t = 0; t < NT; t++) red[warp / KS][p0 + q][t] = acc[q][t];
  if (KS > 1) __syncthreads();
  if (wpart != 0 || lane != 0 || !valid) return;
#pragma unroll
  for (int t = 0; t < NT; t++) {
    float a[P];
#pragma unroll
    for (int q = 0; q < P; q++) a[q] = red[warp / KS][q][t];
#pragma unroll
    for (int s = 1; s < P; s *= 2)
#pragma unroll
      for (int i = 0; i + s < P; i += 2 * s) a[i] += a[i + s];
    float *y = Y + (size_t)t * ldy + row;
    *y = beta != 0.0f ? a[0] + beta * *y : a[0];
  }
}

typedef void (*gemv_parts_fn)(const __nv_bfloat16 *, const __nv_bfloat16 *, size_t, int, int,
                              float *, size_t, float);

template <int P, int KS> static gemv_parts_fn pick_parts_nt(int nt) {
  GV_RETURN_BY_NT(nt, gemv_parts_kernel, P, KS)
}

/* The kernel of a part count, one warp a row (4 warps a row are slower, bench/RESULTS.md). */
static gemv_parts_fn pick_parts(int parts, int nt) {
  switch (parts) {
  case 1: return pick_parts_nt<1, 1>(nt);
  case 2: return pick_parts_nt<2, 1>(nt);
  case 4: return pick_parts_nt<4, 1>(nt);
  case 8: return pick_parts_nt<8, 1>(nt);
  default: return NULL;
  }
}

extern "C" int lf_cuda_gemv_parts_ok(int n_in, int parts) {
  return (parts == 1 || parts == 2 || parts == 4 || parts == 8) && n_in % (8 * parts) == 0;
}

extern "C" lf_status lf_cuda_gemv_parts(const void *W, const void *X, size_t ldx, int n_in,
                                        int n_out, int n_tok, float *Y, size_t ldy, int parts,
                                        float beta, cudaStream_t stream) {
  if (!lf_cuda_gemv_ok(W, X, n_in, ldx, n_tok) || !Y || n_out < 1 || ldy < (size_t)n_out ||
      !lf_cuda_gemv_parts_ok(n_in, parts))
    return lf_error(LF_ERR_INVALID_ARG,
                    "lf_cuda_gemv_parts: unsupported shape (n_in %d in %d parts, ldx %zu, n_out "
                    "%d, n_tok %d) or misaligned pointer",
                    n_in, parts, ldx, n_out, n_tok);
  const gemv_parts_fn f = pick_parts(parts, n_tok);
  const int rpb = GV_WARPS;
  const dim3 grid((unsigned)((n_out + rpb - 1) / rpb));
  lf_launch(f, grid, dim3(GV_WARPS * 32), 0, stream, (const __nv_bfloat16 *)W,
            (const __nv_bfloat16 *)X, ldx, n_in, n_out, Y, ldy, beta);
  LF_CUDA_CHECK_LAUNCH("gemv_parts_kernel");
  return LF_OK;
}

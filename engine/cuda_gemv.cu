/* Small-batch bf16 GEMV (see cuda_gemv.cuh). */
#include "cuda_gemv.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "attention/cuda_check.h"
#include "attention/cuda_ptx.cuh"
#include "attention/cuda_launch.cuh"

#define GV_WARPS 8 /* warps (output rows) per block */

static __device__ __forceinline__ void unpack8(const uint4 v, float f[8]) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; i++) {
    f[2 * i] = __uint_as_float(u[i] << 16);
    f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
}

/* One warp per output row o (MODE GLU: rows o and n_out + o). Lane l reads the 16-byte chunks
 * l, l + 32, ... of the row; U chunks per row are in flight before any is used. */
template <int NT, int MODE>
static __global__ void __launch_bounds__(GV_WARPS * 32)
    gemv_kernel(const __nv_bfloat16 *__restrict__ W, const __nv_bfloat16 *__restrict__ X,
                size_t ldx, int n_in, int n_out, void *__restrict__ Y, size_t ldy, float beta) {
  constexpr int R = MODE == LF_GEMV_GLU ? 2 : 1;
  constexpr int U = R == 2 ? 4 : 8;
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * GV_WARPS + (threadIdx.x >> 5);
  if (row >= n_out) return;
  const int nch = n_in >> 3;
  const uint4 *wr[R];
#pragma unroll
  for (int r = 0; r < R; r++)
    wr[r] = (const uint4 *)(W + ((size_t)row + (size_t)r * n_out) * (size_t)n_in);
  /* The weights do not depend on the previous kernel: start this warp's first chunks towards L2
   * while it finishes, then wait for X (programmatic dependent launch, cuda_launch.cuh). */
#pragma unroll
  for (int u = 0; u < U; u++)
    if (lane + 32 * u < nch)
#pragma unroll
      for (int r = 0; r < R; r++) prefetch_l2(wr[r] + lane + 32 * u);
  pdl_wait();
  float acc[R][NT];
#pragma unroll
  for (int r = 0; r < R; r++)
#pragma unroll
    for (int t = 0; t < NT; t++) acc[r][t] = 0.0f;

  for (int c0 = lane; c0 < nch; c0 += 32 * U) {
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
#pragma unroll
  for (int r = 0; r < R; r++)
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[r][t] += __shfl_xor_sync(0xffffffffu, acc[r][t], o);
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

template <int MODE>
static void launch_mode(int nt, dim3 grid, cudaStream_t st, const __nv_bfloat16 *W,
                        const __nv_bfloat16 *X, size_t ldx, int n_in, int n_out, void *Y,
                        size_t ldy, float beta) {
  const int nth = GV_WARPS * 32;
  void (*k)(const __nv_bfloat16 *, const __nv_bfloat16 *, size_t, int, int, void *, size_t,
            float);
  switch (nt) {
  case 1: k = gemv_kernel<1, MODE>; break;
  case 2: k = gemv_kernel<2, MODE>; break;
  case 3: k = gemv_kernel<3, MODE>; break;
  case 4: k = gemv_kernel<4, MODE>; break;
  case 5: k = gemv_kernel<5, MODE>; break;
  case 6: k = gemv_kernel<6, MODE>; break;
  case 7: k = gemv_kernel<7, MODE>; break;
  default: k = gemv_kernel<8, MODE>; break;
  }
  lf_launch(k, grid, dim3(nth), 0, st, W, X, ldx, n_in, n_out, Y, ldy, beta);
}

extern "C" lf_status lf_cuda_gemv(const void *W, const void *X, size_t ldx, int n_in, int n_out,
                                  int n_tok, void *Y, size_t ldy, lf_gemv_out mode, float beta,
                                  cudaStream_t stream) {
  if (!lf_cuda_gemv_ok(W, X, n_in, ldx, n_tok) || !Y || n_out < 1 || ldy < (size_t)n_out)
    return lf_error(LF_ERR_INVALID_ARG,
                    "lf_cuda_gemv: unsupported shape (n_in %d, ldx %zu, n_out %d, n_tok %d, ldy "
                    "%zu) or misaligned pointer",
                    n_in, ldx, n_out, n_tok, ldy);
  const dim3 grid((unsigned)((n_out + GV_WARPS - 1) / GV_WARPS));
  const __nv_bfloat16 *w = (const __nv_bfloat16 *)W, *x = (const __nv_bfloat16 *)X;
  switch (mode) {
  case LF_GEMV_F32: launch_mode<LF_GEMV_F32>(n_tok, grid, stream, w, x, ldx, n_in, n_out, Y, ldy, beta); break;
  case LF_GEMV_BF16: launch_mode<LF_GEMV_BF16>(n_tok, grid, stream, w, x, ldx, n_in, n_out, Y, ldy, beta); break;
  case LF_GEMV_GLU: launch_mode<LF_GEMV_GLU>(n_tok, grid, stream, w, x, ldx, n_in, n_out, Y, ldy, beta); break;
  default: return lf_error(LF_ERR_INVALID_ARG, "lf_cuda_gemv: mode %d", (int)mode);
  }
  LF_CUDA_CHECK_LAUNCH("gemv_kernel");
  return LF_OK;
}

/* Tensor-core tile helpers shared by the prefill attention kernel (prefill_attn.cu) and h2o's
 * prefill column sums (h2o_prefill.cu): cp.async loads of 64-row K tiles and 16-byte Q chunks into
 * XOR-swizzled shared-memory tiles, and the ldmatrix fragment address of a Q tile. CUDA only;
 * head_dim 64 or 128. */
#ifndef LF_FLASH_TILE_CUH
#define LF_FLASH_TILE_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "base/cuda_ptx.cuh"
#include "lfserve.h"
#include "memory/pool.h"

/* The view a chunk's attention reads the pool's first n0 slots through: the pool itself (bf16),
 * or, under fp8 / int8, its dequantized copy (filled when fill, else the copy the chunk's
 * lf_cuda_prefill_attn left), addressed as pool 0 of one layer (*pool and *layer are set to
 * it). */
lf_status lf_cuda_read_view(const lf_cuda_pool_view *pv, int *pool, int *layer, int n0, int fill,
                            cudaStream_t stream, lf_cuda_pool_view *rv);

#define FL_N 64
#define FL_WARPS 4
#define FL_LOG2E 1.4426950408889634f

static __device__ __forceinline__ uint32_t fl_smem(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16 bytes global -> shared, or 16 zero bytes when !valid (src is not read then). */
static __device__ __forceinline__ void fl_cp16(uint32_t dst, const void *src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
static __device__ __forceinline__ void fl_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N> static __device__ __forceinline__ void fl_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}


/* 2^x, one MUFU op (flushes subnormal results to 0: a weight below 2^-126 of the row max's
 * is 0 either way once rounded to bf16 for the P V MMA) */
static __device__ __forceinline__ float fl_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/* Element offset of 16-byte chunk ch of row `row` in a swizzled [rows][D] tile. */
template <int D> static __device__ __forceinline__ int fl_sw(int row, int ch) {
  return row * D + ((ch ^ (row & 7)) << 3);
}

/* Rows k0..k0+FL_N-1 of the keys (or values) this block sees into a swizzled tile: key kk < n0
 * from the pool, n0 <= kk < nk from the chunk, the rest zero. */
template <int D>
static __device__ __forceinline__ void fl_load_kv(__nv_bfloat16 *tile, const __nv_bfloat16 *pool,
                                                  const __nv_bfloat16 *chunk, int chunk_stride,
                                                  int k0, int n0, int nk) {
  constexpr int CH = D / 8;
  for (int i = threadIdx.x; i < FL_N * CH; i += FL_WARPS * 32) {
    const int row = i / CH, ch = i % CH, kk = k0 + row;
    const __nv_bfloat16 *src = kk < n0 ? pool + (size_t)kk * D
                               : kk < nk ? chunk + (size_t)(kk - n0) * chunk_stride
                                         : pool;
    fl_cp16(fl_smem(tile + fl_sw<D>(row, ch)), src + ch * 8, kk < nk);
  }
}

/* The A fragment (16 rows x 16 dims) of Q rows row0.. and dims 16 ks.. from a swizzled Q tile. */
template <int D>
static __device__ __forceinline__ void fl_load_qa(uint32_t r[4], const __nv_bfloat16 *sq,
                                                  int row0, int ks, int lane) {
  ldsm_x4(r, fl_smem(sq + fl_sw<D>(row0 + (lane % 8) + 8 * ((lane / 8) % 2), 2 * ks + lane / 16)));
}

#endif

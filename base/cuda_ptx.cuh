/* Small device helpers shared by the kernels (CUDA only). */
#ifndef LF_CUDA_PTX_CUH
#define LF_CUDA_PTX_CUH

#include <cuda_bf16.h>
#include <stdint.h>

/* (lo, hi) rounded to bf16 in one register, lo in the low half: an MMA operand pair. */
static __device__ __forceinline__ uint32_t bf16_pack(float lo, float hi) {
  union {
    __nv_bfloat162 h;
    uint32_t u;
  } x;
  x.h = __floats2bfloat162_rn(lo, hi);
  return x.u;
}

/* c += A B on tensor cores (sm_80+): mma.sync m16n8k16, bf16 A (16x16, row: a0..a3) and B
 * (16x8, col: b0, b1), fp32 accumulators c (the fragment layouts of the PTX ISA). */
static __device__ __forceinline__ void mma_bf16(float c[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                                uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
static __device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0,
                                                uint32_t b1) {
  mma_bf16(c, a[0], a[1], a[2], a[3], b0, b1);
}

/* Four 8x8 bf16 matrices from shared memory (ldmatrix .x4): lanes 8i..8i+7 give matrix i's row
 * addresses (16-byte aligned), r[i] its fragment; _t transposed. */
static __device__ __forceinline__ void ldsm_x4(uint32_t r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
static __device__ __forceinline__ void ldsm_x4_t(uint32_t r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

/* A 16-byte load of data read once per launch (K/V slots, weights): through the non-coherent
 * path without allocating in L1, so it does not displace what is reused. */
static __device__ __forceinline__ uint4 ld_stream(const uint4 *p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

/* The same for 8 bytes. */
static __device__ __forceinline__ uint2 ld_stream(const uint2 *p) {
  uint2 r;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

/* The same for 4 bytes. */
static __device__ __forceinline__ uint32_t ld_stream(const uint32_t *p) {
  uint32_t r;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}

/* Programmatic dependent launch (Hopper; base/cuda_launch.cuh launches with it unless it is
 * turned off). A kernel so launched may start while its predecessor on the stream still runs, so
 * every such kernel calls pdl_wait() before touching memory the predecessor writes or reads (it
 * returns once the predecessor grid has completed and its writes are visible; without a
 * programmatic dependency it returns at once). pdl_trigger() lets the successor launch early
 * (its own pdl_wait still waits for this grid's completion). Both are no-ops before sm_90. */
static __device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
static __device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* A hint: bring the 128-byte line at p into L2 (read-only data such as weights, safe to touch
 * before pdl_wait()). */
static __device__ __forceinline__ void prefetch_l2(const void *p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

/* Asks L2 for bytes [p, p + bytes) (16-byte aligned, bytes a multiple of 16, < 4 GiB) with one
 * bulk prefetch (sm_90: cp.async.bulk.prefetch.L2; nothing before it). A hint, fire and forget. */
static __device__ __forceinline__ void prefetch_l2_bulk(const void *p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#else
  (void)p;
  (void)bytes;
#endif
}

/* Block b of n asks L2 for its share of [base, base + bytes): 16 KB pieces, one per lane of
 * warp 0, the pieces dealt round-robin over the grid's lanes. */
static __device__ __forceinline__ void prefetch_l2_share(const void *base, size_t bytes,
                                                         unsigned b, unsigned n) {
  if (!base || threadIdx.x >= 32) return;
  const size_t piece = 16384, pieces = (bytes + piece - 1) / piece;
  for (size_t i = (size_t)b * 32 + threadIdx.x; i < pieces; i += (size_t)n * 32) {
    const size_t off = i * piece;
    const size_t len = bytes - off < piece ? bytes - off : piece;
    if (len >= 16) prefetch_l2_bulk((const char *)base + off, (uint32_t)(len & ~(size_t)15));
  }
}

#endif

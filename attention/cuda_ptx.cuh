/* Small device helpers shared by the kernels (CUDA only). */
#ifndef LF_CUDA_PTX_CUH
#define LF_CUDA_PTX_CUH

#include <stdint.h>

/* A 16-byte load of data read once per launch (K/V slots, weights): through the non-coherent
 * path without allocating in L1, so it does not displace what is reused. */
static __device__ __forceinline__ uint4 ld_stream(const uint4 *p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

#endif

// Helpers shared by the GPU suites (tests/gpu_*.cpp, label gpu).
#ifndef LF_TESTS_GPU_UTIL_H
#define LF_TESTS_GPU_UTIL_H

#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "engine/tensor.h"

inline bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define NEED_GPU()                                                                                 \
  do {                                                                                             \
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";                                             \
  } while (0)

#define CK(x) ASSERT_EQ((x), cudaSuccess)

inline float bf(uint16_t h) {
  return lf_bf16_to_f32(h);
}

// A value exactly representable in bf16, so the cpu oracle and the kernels see the same inputs.
inline float bfr(float x) {
  return lf_bf16_to_f32(lf_f32_to_bf16(x));
}

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// n elements of device memory (freed by the test with cudaFree).
template <class T> T *dev(size_t n) {
  void *p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
  return static_cast<T *>(p);
}

#endif

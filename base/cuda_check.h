/* Check macros for CUDA runtime calls inside the library (nccl-tests style, docs/DESIGN.md §7).
 *
 * A failing call records "file:line: statement: error string" through lf_error() (engine/error.h)
 * and returns LF_ERR_BACKEND from the enclosing function, which must return lf_status. Library
 * code never exits; the caller reads the message with lf_last_error().
 */
#ifndef LF_CUDA_CHECK_H
#define LF_CUDA_CHECK_H

#include <cuda_runtime.h>

#include "base/error.h"

#define LF_CUDA_CHECK(stmt)                                                                        \
  do {                                                                                             \
    cudaError_t lf_cuda_e_ = (stmt);                                                               \
    if (lf_cuda_e_ != cudaSuccess)                                                                 \
      return lf_error(LF_ERR_BACKEND, "%s:%d: %s: %s (%s)", __FILE__, __LINE__, #stmt,             \
                      cudaGetErrorString(lf_cuda_e_), cudaGetErrorName(lf_cuda_e_));               \
  } while (0)

/* After a kernel launch: catches bad launch configurations (and earlier sticky errors). */
#define LF_CUDA_CHECK_LAUNCH(kernel)                                                               \
  do {                                                                                             \
    cudaError_t lf_cuda_e_ = cudaGetLastError();                                                   \
    if (lf_cuda_e_ != cudaSuccess)                                                                 \
      return lf_error(LF_ERR_BACKEND, "%s:%d: launch of %s: %s (%s)", __FILE__, __LINE__, kernel,  \
                      cudaGetErrorString(lf_cuda_e_), cudaGetErrorName(lf_cuda_e_));               \
  } while (0)

#endif

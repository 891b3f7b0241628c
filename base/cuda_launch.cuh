/* Kernel launches with programmatic dependent launch (PDL) on Hopper (on unless the cuda backend
 * was created with lf_tuning.pdl = 0, i.e. LF_PDL=0).
 *
 * A decode step at batch 1 is ~260 dependent kernels (8 per layer), each short; between two of
 * them the GPU drains the first grid, then launches and ramps up the second. With PDL the second
 * grid may be launched while the first finishes (the launch attribute
 * cudaLaunchAttributeProgrammaticStreamSerialization; CUDA graphs capture it as programmatic
 * edges): its blocks do their independent work (a GEMV
 * prefetches its weight rows) and then wait in pdl_wait() (base/cuda_ptx.cuh) for the first
 * grid's results. Every kernel launched through lf_launch must call pdl_wait() before touching
 * memory its predecessor writes or reads. On by default: it makes the single-GPU batch-1 decode
 * step faster and is within noise at batch 64 (bench/RESULTS.md).
 */
#ifndef LF_CUDA_LAUNCH_CUH
#define LF_CUDA_LAUNCH_CUH

#include <cuda_runtime.h>

#include <atomic>

/* Nonzero when the current device has compute capability 9.0 or newer. */
static inline int lf_device_sm90(void) {
  int dev = 0, major = 0;
  const int ok = cudaGetDevice(&dev) == cudaSuccess &&
                 cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                 major >= 9;
  cudaGetLastError();
  return ok;
}

/* The process's PDL setting (base/cuda_launch.cu): 1 (the default) or 0. Set from the tuning
 * (lf_tuning.pdl) when a cuda backend is created, before any of its launches; kernels never read
 * the environment. */
extern int lf_pdl_allowed;

/* On a device of compute capability 9.0 or newer (queried once per translation unit) while
 * lf_pdl_allowed. */
static inline int lf_pdl_enabled(void) {
  static int sm90 = -1;
  if (sm90 < 0) sm90 = lf_device_sm90();
  return sm90 && lf_pdl_allowed;
}

/* Nonzero while this host thread builds a pass that should not use PDL (the CUDA backend sets
 * it per pass by batch size: under TP, PDL made batch-64 steps slower while it made batch 1
 * faster). Defined in base/cuda_launch.cu. */
extern thread_local int lf_pdl_pass_off;

/* PDL for the launch being made now. */
static inline int lf_pdl_now(void) { return lf_pdl_enabled() && !lf_pdl_pass_off; }

/* Lets kernel Fn's blocks take all the dynamic shared memory the current device lets a block opt
 * in to (less Fn's static shared memory). The value is the same from every caller on a device,
 * so engines in other host threads, launching Fn with other sizes, can never lower one another's
 * limit between a set and a launch. Set once per device (a racing second set writes the same
 * value). The carveout is not touched: it stays the driver's choice per launch. */
template <auto Fn> static cudaError_t lf_smem_optin(void) {
  static std::atomic<unsigned long long> done{0}; /* a bit per device set so far */
  int dev = 0, optin = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const unsigned long long bit = dev < 64 ? 1ull << dev : 0;
  if (bit && (done.load(std::memory_order_relaxed) & bit)) return cudaSuccess;
  cudaFuncAttributes fa;
  if ((e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)) != cudaSuccess ||
      (e = cudaFuncGetAttributes(&fa, Fn)) != cudaSuccess ||
      (e = cudaFuncSetAttribute(Fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                optin - (int)fa.sharedSizeBytes)) != cudaSuccess)
    return e;
  done.fetch_or(bit, std::memory_order_relaxed);
  return cudaSuccess;
}

/* kernel<<<grid, block, smem, stream>>>(args...), with the PDL attribute when enabled. */
template <typename... KArgs, typename... Args>
static cudaError_t lf_launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                             cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = lf_pdl_now() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);
}

#endif

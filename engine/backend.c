#include "backend.h"

#include "base/error.h"

lf_backend_kind lf_backend_resolve(lf_backend_kind which) {
  if (which != LF_BACKEND_AUTO) return which;
#ifdef LF_HAVE_CUDA_BACKEND
  if (lf_cuda_device_present()) return LF_BACKEND_CUDA;
#endif
  return LF_BACKEND_CPU;
}

lf_status lf_backend_create(lf_backend_kind which, const lf_checkpoint *ck,
                            const lf_backend_params *p, lf_backend **out) {
  *out = NULL;
  switch (which) {
  case LF_BACKEND_CPU: return lf_backend_cpu_create(ck, p, out);
  case LF_BACKEND_CUDA:
#ifdef LF_HAVE_CUDA_BACKEND
    return lf_backend_cuda_create(ck, p, out);
#else
    return lf_error(LF_ERR_UNAVAILABLE, "this build has no CUDA engine backend");
#endif
  case LF_BACKEND_AUTO:
#ifdef LF_HAVE_CUDA_BACKEND
    if (lf_cuda_device_present()) return lf_backend_cuda_create(ck, p, out);
#endif
    return lf_backend_cpu_create(ck, p, out);
  }
  return lf_error(LF_ERR_INVALID_ARG, "unknown backend %d", (int)which);
}

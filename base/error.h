/* Error reporting inside the library: set a thread-local message and return the status up. */
#ifndef LF_ERROR_H
#define LF_ERROR_H

#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Records a printf-style message for lf_last_error() and returns s. */
lf_status lf_error(lf_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void lf_error_clear(void);

#ifdef __cplusplus
}
#endif

/* Propagate a failing status unchanged (the callee already set the message). */
#define LF_TRY(expr)                                                                               \
  do {                                                                                             \
    lf_status lf_try_s_ = (expr);                                                                  \
    if (lf_try_s_ != LF_OK) return lf_try_s_;                                                      \
  } while (0)

#endif

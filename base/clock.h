/* The library's one clock: monotonic seconds, for intervals and deadlines only. */
#ifndef LF_CLOCK_H
#define LF_CLOCK_H

#include <time.h>

static inline double lf_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#endif

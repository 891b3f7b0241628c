/* Small helpers the lfbench subcommands share (bench_util.h). */
#include "bench_util.h"

#include <stdlib.h>

int bench_int_list(const char *s, int *out, int cap) {
  int n = 0;
  while (*s) {
    char *end;
    const long v = strtol(s, &end, 10);
    if (end == s || v <= 0 || v > 1 << 24 || n == cap) return -1;
    out[n++] = (int)v;
    if (*end && *end != ',') return -1;
    s = *end == ',' ? end + 1 : end;
  }
  return n;
}

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

double bench_median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

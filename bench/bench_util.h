/* Small helpers the lfbench subcommands share. */
#ifndef LF_BENCH_UTIL_H
#define LF_BENCH_UTIL_H

/* A comma list of positive integers (each at most 1 << 24) into out[cap]: the count, or -1 for
 * a malformed list or one of more than cap items. */
int bench_int_list(const char *s, int *out, int cap);

/* The median of v[n] (n >= 1), sorting v in place; the mean of the middle two for even n. */
double bench_median(double *v, int n);

#endif

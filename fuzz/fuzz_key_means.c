/* libFuzzer target: the key-means file parser (launch/cli.c, lfgen/lfserve/lfbench --key-means)
 * on arbitrary bytes. What it accepts has a shape of 1..1024 per dimension, at most 2^22 values
 * in all, each finite as a float; what it refuses hands back nothing and says why. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "launch/cli.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  float *m = NULL;
  int n = 0, shape[3];
  char err[256];
  err[0] = 0;
  if (lf_cli_parse_key_means((const char *)data, size, "fuzz", &m, &n, shape, err, sizeof err)) {
    if (m || n || shape[0] || shape[1] || shape[2] || !err[0]) abort();
    return 0;
  }
  for (int d = 0; d < 3; d++)
    if (shape[d] < 1 || shape[d] > 1024) abort();
  if (!m || (long long)n != (long long)shape[0] * shape[1] * shape[2] || n > (1 << 22)) abort();
  for (int i = 0; i < n; i++)
    if (!isfinite(m[i])) abort();
  free(m);
  return 0;
}

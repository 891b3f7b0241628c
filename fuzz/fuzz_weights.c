/* libFuzzer target: the per-layer weights file parser (launch/cli.c, lfgen/lfserve/lfbench
 * --layer-weights) on arbitrary bytes, then the engine's budget rule on what it accepts. Parsed
 * weights are finite and > 0, 1..4096 of them; the budgets from them are each >= 16 and sum to
 * at least budget x layers (memory/pool.c). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "launch/cli.h"
#include "memory/pool.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  double *w = NULL;
  int n = 0;
  char err[256];
  if (lf_cli_parse_weights((const char *)data, size, "fuzz", &w, &n, err, sizeof err) != 0) {
    if (w || n || !err[0]) abort(); /* a refusal says why and hands back nothing */
    return 0;
  }
  if (!w || n < 1 || n > 4096) abort();
  for (int i = 0; i < n; i++)
    if (!(w[i] > 0.0) || !isfinite(w[i])) abort();
  const int budget = 1 + (int)(size % 5000);
  int *b = malloc(sizeof(int) * (size_t)n);
  if (b && lf_layer_budgets_from_weights(w, n, budget, b) == LF_OK) {
    long long sum = 0;
    for (int i = 0; i < n; i++) {
      if (b[i] < 16) abort();
      sum += b[i];
    }
    if (sum < (long long)budget * n) abort();
  }
  free(b);
  free(w);
  return 0;
}

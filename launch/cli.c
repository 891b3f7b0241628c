/* Command-line helpers shared by the programs (launch/cli.h). */
#include "launch/cli.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

int lf_cli_parse_long(const char *s, long lo, long hi, long *out) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi) return -1;
  *out = v;
  return 0;
}

const lf_cli_int *lf_cli_int_find(const lf_cli_int *opts, size_t n, const char *name) {
  for (size_t i = 0; i < n; i++)
    if (!strcmp(opts[i].name, name)) return &opts[i];
  return NULL;
}

int lf_cli_int_set(const lf_cli_int *o, const char *v) {
  long n;
  if (lf_cli_parse_long(v, o->lo, o->hi, &n)) return -1;
  *o->dst = (int)n;
  return 0;
}

int lf_cli_unknown_option(const char *prog, const char *a, void (*usage)(FILE *)) {
  fprintf(stderr, "%s: unknown option '%s'\n", prog, a);
  usage(stderr);
  return 2;
}

int lf_cli_bad_value(const char *prog, const char *a, const char *v) {
  fprintf(stderr, "%s: bad value '%s' for %s\n", prog, v, a);
  return 2;
}

int lf_cli_read_weights(const char *path, double **out, int *n, char *err, size_t err_len) {
  enum { MAX_W = 4096 };
  *out = NULL;
  *n = 0;
  FILE *f = fopen(path, "r");
  if (!f) {
    snprintf(err, err_len, "cannot open layer weights file '%s'", path);
    return -1;
  }
  double *w = malloc(sizeof(double) * MAX_W);
  char line[4096];
  int k = 0, ln = 0, ok = w != NULL;
  if (!ok) snprintf(err, err_len, "out of memory");
  while (ok && fgets(line, sizeof line, f)) {
    ln++;
    char *hash = strchr(line, '#');
    if (hash) *hash = 0;
    for (char *t = strtok(line, " \t\r\n,"); ok && t; t = strtok(NULL, " \t\r\n,")) {
      char *end;
      errno = 0;
      const double v = strtod(t, &end);
      if (*end || errno || !(v > 0.0) || !isfinite(v) || k >= MAX_W) {
        snprintf(err, err_len,
                 "%s:%d: '%.32s' is not a layer weight (a finite number > 0, at most %d)", path,
                 ln, t, MAX_W);
        ok = 0;
      } else {
        w[k++] = v;
      }
    }
  }
  fclose(f);
  if (ok && k == 0) {
    snprintf(err, err_len, "%s: no layer weights", path);
    ok = 0;
  }
  if (!ok) {
    free(w);
    return -1;
  }
  *out = w;
  *n = k;
  return 0;
}

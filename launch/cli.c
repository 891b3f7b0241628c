/* Command-line helpers shared by the programs (launch/cli.h). */
#include "launch/cli.h"

#include <errno.h>
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

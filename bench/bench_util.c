/* Small helpers the lfbench subcommands share (bench_util.h). */
#include "bench_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

char *bench_read_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  char *s = NULL;
  if (fseek(f, 0, SEEK_END) == 0) {
    const long n = ftell(f);
    if (n >= 0 && fseek(f, 0, SEEK_SET) == 0 && (s = malloc((size_t)n + 1))) {
      if (fread(s, 1, (size_t)n, f) != (size_t)n) {
        free(s);
        s = NULL;
      } else {
        s[n] = '\0';
      }
    }
  }
  fclose(f);
  return s;
}

int bench_json_num(const char *s, const char *e, const char *key, double *out) {
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\":", key);
  const size_t pl = strlen(pat);
  const char *p = strstr(s, pat);
  if (!p || p + pl > e) return 0;
  const char *v = p + pl;
  while (v < e && (*v == ' ' || *v == '\t')) v++;
  char *end;
  const double x = strtod(v, &end);
  if (end == v || end > e) return 0;
  *out = x;
  return 1;
}

double bench_peer_value(const char *text, const char *k1, int v1, const char *k2, int v2,
                        const char *key) {
  for (const char *line = text; line && *line;) {
    const char *eol = strchr(line, '\n');
    const char *e = eol ? eol : line + strlen(line);
    double a, b, t;
    if (bench_json_num(line, e, k1, &a) && bench_json_num(line, e, k2, &b) && (int)a == v1 &&
        (int)b == v2)
      return bench_json_num(line, e, key, &t) ? t : -1.0;
    line = eol ? eol + 1 : NULL;
  }
  return -1.0;
}

uint64_t bench_rng_next(uint64_t *state) {
  uint64_t x = *state;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return *state = x;
}

float bench_rng_normal(uint64_t *state) {
  float s = 0.0f;
  for (int i = 0; i < 4; i++)
    s += (float)(bench_rng_next(state) >> 40) * (1.0f / 16777216.0f);
  return (s - 2.0f) * 1.7320508f;
}

uint16_t bench_f2bf(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

int bench_model_config(const char *prog, const char *model, lf_model_config *out) {
  lf_checkpoint ck;
  lf_status s = lf_checkpoint_open(model, &ck);
  if (s != LF_OK) {
    fprintf(stderr, "%s: %s: %s: %s\n", prog, model, lf_status_str(s), lf_last_error());
    return 1;
  }
  *out = ck.cfg;
  lf_checkpoint_close(&ck);
  return 0;
}

void bench_json_safe(char *s) {
  for (char *c = s; *c; c++)
    if (*c == '"' || *c == '\\') *c = '_';
}

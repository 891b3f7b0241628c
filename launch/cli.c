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

/* The next token of text[*i..len): skips whitespace, commas and '#' comments (counting lines in
 * *ln); its start and length, or length 0 at the end. A NUL byte is a token of its own (which no
 * caller accepts). */
static size_t next_token(const char *text, size_t len, size_t *i, int *ln, size_t *start) {
  while (*i < len) {
    const char c = text[*i];
    if (c == '\n') {
      (*ln)++;
      (*i)++;
    } else if (c == ' ' || c == '\t' || c == '\r' || c == ',') {
      (*i)++;
    } else if (c == '#') {
      while (*i < len && text[*i] != '\n') (*i)++;
    } else {
      break;
    }
  }
  *start = *i;
  if (*i >= len) return 0;
  if (text[*i] == 0) return ++*i - *start;
  while (*i < len && !strchr(" \t\r\n,#", text[*i]) && text[*i] != 0) (*i)++;
  return *i - *start;
}

/* Token text[st, st + tl) as a string in tok[cap]: 0 when it is empty or does not fit. */
static int token_copy(const char *text, size_t st, size_t tl, char *tok, size_t cap) {
  if (tl == 0 || tl >= cap) return 0;
  memcpy(tok, text + st, tl);
  tok[tl] = 0;
  return 1;
}

/* Token text[st, st + tl) as a number: 1 when strtod reads all of it without a range error. */
static int token_double(const char *text, size_t st, size_t tl, double *v) {
  char tok[64], *end;
  *v = 0.0;
  if (!token_copy(text, st, tl, tok, sizeof tok)) return 0;
  errno = 0;
  *v = strtod(tok, &end);
  return end != tok && !*end && !errno;
}

int lf_cli_parse_weights(const char *text, size_t len, const char *name, double **out, int *n,
                         char *err, size_t err_len) {
  enum { MAX_W = 4096 };
  *out = NULL;
  *n = 0;
  double *w = malloc(sizeof(double) * MAX_W);
  if (!w) {
    snprintf(err, err_len, "out of memory");
    return -1;
  }
  int k = 0, ln = 1;
  size_t i = 0, st, tl;
  while ((tl = next_token(text, len, &i, &ln, &st)) > 0) {
    double v = 0.0;
    if (k >= MAX_W || !token_double(text, st, tl, &v) || !(v > 0.0) || !isfinite(v)) {
      snprintf(err, err_len,
               "%s:%d: '%.*s' is not a layer weight (a finite number > 0, at most %d of them)",
               name, ln, (int)(tl < 32 ? tl : 32), text + st, MAX_W);
      free(w);
      return -1;
    }
    w[k++] = v;
  }
  if (k == 0) {
    snprintf(err, err_len, "%s: no layer weights", name);
    free(w);
    return -1;
  }
  *out = w;
  *n = k;
  return 0;
}

/* Reads a whole file of at most max_bytes into *buf (malloc'd, the caller frees) and *len: 0, or
 * -1 with a message in err (`what` names the kind of file). */
static int read_small_file(const char *path, size_t max_bytes, const char *what, char **buf,
                           size_t *len, char *err, size_t err_len) {
  *buf = NULL;
  *len = 0;
  FILE *f = fopen(path, "rb");
  if (!f) {
    snprintf(err, err_len, "cannot open %s file '%s'", what, path);
    return -1;
  }
  char *b = malloc(max_bytes + 1);
  const size_t n = b ? fread(b, 1, max_bytes + 1, f) : 0;
  const int bad = !b || ferror(f);
  fclose(f);
  if (bad || n > max_bytes) {
    if (bad)
      snprintf(err, err_len, "%s: cannot read it", path);
    else
      snprintf(err, err_len, "%s: larger than %zu MiB", path, max_bytes >> 20);
    free(b);
    return -1;
  }
  *buf = b;
  *len = n;
  return 0;
}

int lf_cli_read_weights(const char *path, double **out, int *n, char *err, size_t err_len) {
  *out = NULL;
  *n = 0;
  char *buf;
  size_t len;
  if (read_small_file(path, (size_t)1 << 20, "layer weights", &buf, &len, err, err_len)) return -1;
  const int r = lf_cli_parse_weights(buf, len, path, out, n, err, err_len);
  free(buf);
  return r;
}

int lf_cli_parse_key_means(const char *text, size_t len, const char *name, float **out, int *n,
                           int shape[3], char *err, size_t err_len) {
  enum { MAX_DIM = 1024, MAX_VALUES = 1 << 22 };
  static const char *const keys[4] = {"lfserve-key-means", "layers", "kv_heads", "head_dim"};
  *out = NULL;
  *n = 0;
  if (shape) shape[0] = shape[1] = shape[2] = 0;
  int sh[3] = {0, 0, 0}; /* the header's shape, handed back on success only */
  size_t i = 0, st, tl;
  int ln = 1;
  char tok[64];
  /* the header: the magic word, then three (name, count) pairs in order */
  for (int h = 0; h < 4; h++) {
    tl = next_token(text, len, &i, &ln, &st);
    if (tl != strlen(keys[h]) || memcmp(text + st, keys[h], tl)) {
      snprintf(err, err_len,
               "%s:%d: expected '%s' (the header is 'lfserve-key-means layers L kv_heads H "
               "head_dim D'), found '%.*s'",
               name, ln, keys[h], (int)(tl < 32 ? tl : 32), tl ? text + st : "");
      return -1;
    }
    if (h == 0) continue;
    tl = next_token(text, len, &i, &ln, &st);
    long v = -1;
    if (token_copy(text, st, tl, tok, sizeof tok) && lf_cli_parse_long(tok, 1, MAX_DIM, &v))
      v = -1;
    if (v < 0) {
      snprintf(err, err_len, "%s:%d: %s wants an integer in [1, %d], found '%.*s'", name, ln,
               keys[h], MAX_DIM, (int)(tl < 32 ? tl : 32), tl ? text + st : "");
      return -1;
    }
    sh[h - 1] = (int)v;
  }
  const long long want = (long long)sh[0] * sh[1] * sh[2];
  if (want > MAX_VALUES) {
    snprintf(err, err_len, "%s: %d x %d x %d values, more than %d", name, sh[0], sh[1], sh[2],
             MAX_VALUES);
    return -1;
  }
  float *m = malloc(sizeof(float) * (size_t)want);
  if (!m) {
    snprintf(err, err_len, "out of memory");
    return -1;
  }
  long long k = 0;
  while ((tl = next_token(text, len, &i, &ln, &st)) > 0) {
    double v = 0.0;
    /* finite as a float too: the engine subtracts it in fp32 */
    if (k >= want || !token_double(text, st, tl, &v) || !isfinite(v) ||
        fabs(v) > 3.4028234663852886e38) {
      if (k >= want)
        snprintf(err, err_len, "%s:%d: more than the %lld values the header announces", name, ln,
                 want);
      else
        snprintf(err, err_len, "%s:%d: '%.*s' is not a key mean (a finite number)", name, ln,
                 (int)(tl < 32 ? tl : 32), text + st);
      free(m);
      return -1;
    }
    m[k++] = (float)v;
  }
  if (k != want) {
    snprintf(err, err_len, "%s: %lld values where the header announces %d x %d x %d = %lld", name,
             k, sh[0], sh[1], sh[2], want);
    free(m);
    return -1;
  }
  *out = m;
  *n = (int)want;
  if (shape) memcpy(shape, sh, sizeof sh);
  return 0;
}

int lf_cli_read_key_means(const char *path, float **out, int *n, int shape[3], char *err,
                          size_t err_len) {
  *out = NULL;
  *n = 0;
  if (shape) shape[0] = shape[1] = shape[2] = 0;
  char *buf;
  size_t len;
  if (read_small_file(path, (size_t)64 << 20, "key means", &buf, &len, err, err_len)) return -1;
  const int r = lf_cli_parse_key_means(buf, len, path, out, n, shape, err, err_len);
  free(buf);
  return r;
}

int lf_cli_load_key_means(const char *prog, const char *path, float **out, int *n) {
  char why[256];
  free(*out);
  if (lf_cli_read_key_means(path, out, n, NULL, why, sizeof why)) {
    fprintf(stderr, "%s: --key-means: %s\n", prog, why);
    return -1;
  }
  return 0;
}

/* Command-line helpers shared by the programs (lfgen, lfserve): integer options with bounds. */
#ifndef LF_LAUNCH_CLI_H
#define LF_LAUNCH_CLI_H

#include <stddef.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Parses the whole of s as a base-10 integer in [lo, hi] into *out: 0, or -1 (out unchanged). */
int lf_cli_parse_long(const char *s, long lo, long hi, long *out);

/* An option `name N` that sets *dst to N, lo <= N <= hi (hi at most INT_MAX). */
typedef struct lf_cli_int {
  const char *name;
  long lo, hi;
  int *dst;
} lf_cli_int;

/* The option of opts[0..n) called name, or NULL. */
const lf_cli_int *lf_cli_int_find(const lf_cli_int *opts, size_t n, const char *name);

/* Sets *o->dst from v: 0, or -1 when v is not an integer in o's bounds (*dst unchanged). */
int lf_cli_int_set(const lf_cli_int *o, const char *v);

/* --layer-weights FILE: reads a text file of per-layer weights (lf_engine_config.layer_weights):
 * numbers separated by whitespace or commas, '#' to the end of a line a comment. *out (malloc'd,
 * the caller frees) and *n on success (0); -1 with a message in err otherwise (unreadable file,
 * a token that is not a finite number > 0, no numbers, more than 4096, over 1 MiB). */
int lf_cli_read_weights(const char *path, double **out, int *n, char *err, size_t err_len);
/* The same over text[0..len) (a file's bytes; NUL bytes are refused), messages naming `name`. */
int lf_cli_parse_weights(const char *text, size_t len, const char *name, double **out, int *n,
                         char *err, size_t err_len);

/* --key-means FILE: reads a key-means file (lf_engine_config.key_means; tools/evict/key_means.py
 * writes one, docs/USAGE.md describes it): '#' to the end of a line a comment; first the header
 * `lfserve-key-means layers L kv_heads H head_dim D`, then exactly L x H x D finite numbers
 * (layer-major, then KV head, then dim) separated by whitespace or commas. *out (malloc'd, the
 * caller frees), *n = L H D and the shape on success (0); -1 with a message in err otherwise
 * (unreadable file, over 64 MiB, no or a malformed header, a shape past 1024 layers, 1024 KV
 * heads, 1024 dims or 2^22 values, a token that is not a finite number, too few or too many).
 * shape may be NULL. */
int lf_cli_read_key_means(const char *path, float **out, int *n, int shape[3], char *err,
                          size_t err_len);
/* The same over text[0..len) (a file's bytes; NUL bytes are refused), messages naming `name`. */
int lf_cli_parse_key_means(const char *text, size_t len, const char *name, float **out, int *n,
                           int shape[3], char *err, size_t err_len);

/* --key-means PATH for program prog: frees *out, then reads PATH into *out and *n; on failure
 * prints "<prog>: --key-means: <why>" on stderr and returns -1 (*out NULL). */
int lf_cli_load_key_means(const char *prog, const char *path, float **out, int *n);

/* Report a command-line error on stderr ("<prog>: unknown option '<a>'" then the usage;
 * "<prog>: bad value '<v>' for <a>") and return 2, the programs' exit status for one. */
int lf_cli_unknown_option(const char *prog, const char *a, void (*usage)(FILE *));
int lf_cli_bad_value(const char *prog, const char *a, const char *v);

#ifdef __cplusplus
}
#endif
#endif

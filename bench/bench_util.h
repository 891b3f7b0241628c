/* Small helpers the lfbench subcommands share. */
#ifndef LF_BENCH_UTIL_H
#define LF_BENCH_UTIL_H

#include <stdint.h>

#include "engine/model.h"

/* A comma list of positive integers (each at most 1 << 24) into out[cap]: the count, or -1 for
 * a malformed list or one of more than cap items. */
int bench_int_list(const char *s, int *out, int cap);

/* The median of v[n] (n >= 1), sorting v in place; the mean of the middle two for even n. */
double bench_median(double *v, int n);

/* The whole file as a NUL-terminated string (free() it), or NULL when it cannot be read. */
char *bench_read_file(const char *path);

/* The number after "key": in s[0, e) (one line of a peer's JSON) into *out: 1, or 0 when the
 * key is absent there or not followed by a number. */
int bench_json_num(const char *s, const char *e, const char *key, double *out);

/* A peer's figure (sdpa_peer.py, prefill_peer.py, ...: one row object per line): `key` of the
 * first line whose k1 and k2 equal v1 and v2 (as integers), or -1 when no line has them all. */
double bench_peer_value(const char *text, const char *k1, int v1, const char *k2, int v2,
                        const char *key);

/* xorshift64 (state nonzero), and about N(0, 1) from it: four uniforms, centred and scaled. */
uint64_t bench_rng_next(uint64_t *state);
float bench_rng_normal(uint64_t *state);

/* The model's config without loading it (the checkpoint is opened, read and closed): 0, or 1
 * after "<prog>: <model>: <status>: <message>" on stderr. */
int bench_model_config(const char *prog, const char *model, lf_model_config *out);

/* Replaces '"' and '\\' in s with '_', so that s can be written inside a JSON string as is. */
void bench_json_safe(char *s);

/* float -> bf16 bits, round to nearest even. */
uint16_t bench_f2bf(float f);

#endif

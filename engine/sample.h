/* Token sampling on the host: greedy, temperature, top-k, top-p, with a per-request seed. */
#ifndef LF_SAMPLE_H
#define LF_SAMPLE_H

#include <stdint.h>

#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

/* xoshiro256** state; seeded through splitmix64 so any 64-bit seed gives a good stream. */
typedef struct lf_rng {
  uint64_t s[4];
} lf_rng;

void lf_rng_seed(lf_rng *r, uint64_t seed);
uint64_t lf_rng_next(lf_rng *r);
/* Uniform in [0, 1) with 24 bits. */
float lf_rng_float(lf_rng *r);

/* Index of the largest value; lowest index on ties. */
int lf_argmax(const float *x, int n);

/* Scratch for lf_sample: n entries each. */
typedef struct lf_sampler {
  int n;
  float *prob; /* [n] */
  int *idx;    /* [n] */
} lf_sampler;

lf_status lf_sampler_init(lf_sampler *s, int vocab);
void lf_sampler_free(lf_sampler *s);

/* Picks a token from logits [vocab] (not modified). temperature <= 0 is greedy. top_k keeps the
 * k most likely, top_p the smallest prefix (by descending probability) whose mass reaches p;
 * u in [0, 1) picks within what is kept: the first kept token, in increasing id order, whose
 * cumulative probability exceeds u. */
int lf_sample(lf_sampler *s, const float *logits, const lf_sampling *p, float u);

#ifdef __cplusplus
}
#endif
#endif

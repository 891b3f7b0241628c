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

/* One token's logit adjustment (the scheduler builds a request's list; every backend applies it
 * with the same arithmetic, the cpu one through lf_logits_adjust, the cuda one in
 * kernels/sample.cu): l = logit + bias; if seen and rep != 1: l = l > 0 ? l / rep : l * rep;
 * then l -= sub. bias is the request's logit_bias, seen marks a token of the prompt or the output
 * (repetition penalty, vLLM's choice), sub = presence * [count > 0] + frequency * count over
 * the output tokens so far (OpenAI's penalties). The order (bias, then repetition, then
 * presence/frequency) is vLLM's. Tokens are distinct within a list. */
typedef struct lf_logit_adj {
  int32_t token;
  int32_t seen;
  float bias;
  float sub;
} lf_logit_adj;

void lf_logits_adjust(float *logits, const lf_logit_adj *a, int n, float rep);

/* The raw model distribution's log-probabilities from logits [vocab] (log-softmax in double):
 * *lp_token for `token` (-1: skipped) and the k (<= LF_MAX_TOP_LOGPROBS) most likely ids in
 * top_ids / top_lp (descending, ties by ascending id). */
void lf_logprobs(const float *logits, int vocab, int32_t token, float *lp_token, int k,
                 int32_t *top_ids, float *top_lp);

#ifdef __cplusplus
}
#endif
#endif

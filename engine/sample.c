#include "sample.h"

#include <math.h>
#include <stdlib.h>

#include "base/error.h"

static uint64_t splitmix64(uint64_t *x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

void lf_rng_seed(lf_rng *r, uint64_t seed) {
  uint64_t x = seed;
  for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&x);
}

static uint64_t rotl(uint64_t x, int k) {
  return (x << k) | (x >> (64 - k));
}

uint64_t lf_rng_next(lf_rng *r) {
  uint64_t *s = r->s;
  const uint64_t out = rotl(s[1] * 5, 7) * 9;
  const uint64_t t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = rotl(s[3], 45);
  return out;
}

float lf_rng_float(lf_rng *r) {
  return (float)(lf_rng_next(r) >> 40) * (1.0f / 16777216.0f);
}

int lf_argmax(const float *x, int n) {
  int best = 0;
  for (int i = 1; i < n; i++)
    if (x[i] > x[best]) best = i;
  return best;
}

lf_status lf_sampler_init(lf_sampler *s, int vocab) {
  s->n = vocab;
  s->prob = malloc(sizeof(float) * (size_t)vocab);
  s->idx = malloc(sizeof(int) * (size_t)vocab);
  if (!s->prob || !s->idx) {
    lf_sampler_free(s);
    return lf_error(LF_ERR_OUT_OF_MEMORY, "sampler for %d tokens", vocab);
  }
  return LF_OK;
}

void lf_sampler_free(lf_sampler *s) {
  free(s->prob);
  free(s->idx);
  s->prob = NULL;
  s->idx = NULL;
}

/* Descending probability, then ascending id: a total order, so the result is deterministic. */
static _Thread_local const float *cmp_prob;
static int cmp_desc(const void *a, const void *b) {
  const int i = *(const int *)a, j = *(const int *)b;
  if (cmp_prob[i] != cmp_prob[j]) return cmp_prob[i] > cmp_prob[j] ? -1 : 1;
  return (i > j) - (i < j);
}

static int cmp_id(const void *a, const void *b) {
  const int i = *(const int *)a, j = *(const int *)b;
  return (i > j) - (i < j);
}

int lf_sample(lf_sampler *s, const float *logits, const lf_sampling *p, float u) {
  const int n = s->n;
  if (p->temperature <= 0.0f) return lf_argmax(logits, n);
  const float mx = logits[lf_argmax(logits, n)];
  double sum = 0.0;
  for (int i = 0; i < n; i++) {
    s->prob[i] = expf((logits[i] - mx) / p->temperature);
    sum += s->prob[i];
    s->idx[i] = i;
  }
  int m = n;
  const int want_k = p->top_k > 0 && p->top_k < n;
  const int want_p = p->top_p > 0.0f && p->top_p < 1.0f;
  if (want_k || want_p) {
    /* qsort's comparator takes no context: pass the probabilities through a thread-local. */
    cmp_prob = s->prob;
    qsort(s->idx, (size_t)n, sizeof(int), cmp_desc);
    if (want_k) m = p->top_k;
    double kept = 0.0;
    for (int i = 0; i < m; i++) kept += s->prob[s->idx[i]];
    if (want_p) {
      double c = 0.0;
      int cut = m;
      for (int i = 0; i < m; i++) {
        c += s->prob[s->idx[i]];
        if (c >= p->top_p * kept) {
          cut = i + 1;
          break;
        }
      }
      m = cut;
    }
    /* The draw walks the kept tokens in id order, like the unfiltered case, so every backend
     * can reproduce it with a prefix sum over ids. */
    qsort(s->idx, (size_t)m, sizeof(int), cmp_id);
    sum = 0.0;
    for (int i = 0; i < m; i++) sum += s->prob[s->idx[i]];
  }
  const double target = (double)u * sum;
  double c = 0.0;
  for (int i = 0; i < m; i++) {
    c += s->prob[s->idx[i]];
    if (target < c) return s->idx[i];
  }
  return s->idx[m - 1];
}

void lf_logits_adjust(float *logits, const lf_logit_adj *a, int n, float rep) {
  const int use_rep = rep > 0.0f && rep != 1.0f;
  for (int i = 0; i < n; i++) {
    float l = logits[a[i].token] + a[i].bias;
    if (use_rep && a[i].seen) l = l > 0.0f ? l / rep : l * rep;
    logits[a[i].token] = l - a[i].sub;
  }
}

void lf_logprobs(const float *logits, int vocab, int32_t token, float *lp_token, int k,
                 int32_t *top_ids, float *top_lp) {
  const float mx = logits[lf_argmax(logits, vocab)];
  double sum = 0.0;
  for (int i = 0; i < vocab; i++) sum += exp((double)logits[i] - (double)mx);
  const double lse = (double)mx + log(sum);
  if (token >= 0 && token < vocab && lp_token) *lp_token = (float)((double)logits[token] - lse);
  if (k > LF_MAX_TOP_LOGPROBS) k = LF_MAX_TOP_LOGPROBS;
  if (k > vocab) k = vocab;
  /* insertion into a k-long list, descending by logit, ascending id on ties */
  int m = 0;
  for (int i = 0; i < vocab && k > 0; i++) {
    const float v = logits[i];
    if (m == k && !(v > logits[top_ids[m - 1]])) continue;
    int j = m < k ? m++ : k - 1;
    while (j > 0 && v > logits[top_ids[j - 1]]) {
      top_ids[j] = top_ids[j - 1];
      j--;
    }
    top_ids[j] = i;
  }
  for (int i = 0; i < m; i++) top_lp[i] = (float)((double)logits[top_ids[i]] - lse);
}

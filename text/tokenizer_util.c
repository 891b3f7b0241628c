/* The tokenizer's small shared pieces: growable id and text buffers, UTF-8 classification and
 * coding, hashing and the model-vocabulary lookup (text/tokenizer_internal.h). */
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "text/tokenizer_internal.h"

/* ---- small buffers ---------------------------------------------------------------------- */

void lf_token_ids_free(lf_token_ids *v) {
  if (!v) return;
  free(v->ids);
  v->ids = NULL;
  v->n = v->cap = 0;
}

void lf_tok_text_free(lf_tok_text *t) {
  if (!t) return;
  free(t->data);
  t->data = NULL;
  t->len = t->cap = 0;
}

lf_status tok_ids_push(lf_token_ids *v, int32_t id) {
  if (v->n == v->cap) {
    size_t cap = v->cap ? v->cap * 2 : 64;
    int32_t *p = realloc(v->ids, cap * sizeof *p);
    if (!p) return lf_error(LF_ERR_OUT_OF_MEMORY, "tokenizer: out of memory");
    v->ids = p;
    v->cap = cap;
  }
  v->ids[v->n++] = id;
  return LF_OK;
}

static lf_status text_reserve(lf_tok_text *t, size_t extra) {
  if (t->len + extra + 1 <= t->cap) return LF_OK;
  size_t cap = t->cap ? t->cap : 64;
  while (cap < t->len + extra + 1)
    cap *= 2;
  char *p = realloc(t->data, cap);
  if (!p) return lf_error(LF_ERR_OUT_OF_MEMORY, "tokenizer: out of memory");
  t->data = p;
  t->cap = cap;
  return LF_OK;
}

lf_status tok_text_append(lf_tok_text *t, const void *s, size_t n) {
  LF_TRY(text_reserve(t, n));
  if (n) memcpy(t->data + t->len, s, n);
  t->len += n;
  t->data[t->len] = '\0';
  return LF_OK;
}

lf_status tok_text_clear(lf_tok_text *t) {
  t->len = 0;
  LF_TRY(text_reserve(t, 0));
  t->data[0] = '\0';
  return LF_OK;
}

lf_status lf_tok_text_append(lf_tok_text *t, const char *s, size_t n) {
  return tok_text_append(t, s, n);
}
lf_status lf_tok_text_clear(lf_tok_text *t) {
  return tok_text_clear(t);
}

/* ---- UTF-8 ------------------------------------------------------------------------------- */

/* Classifies the character starting at b[0..n): U8_OK with its length; U8_BAD with the length of
 * the maximal valid subpart to replace by one U+TOK_FFFD (the Unicode "substitution of maximal
 * subparts" practice that Rust's from_utf8_lossy, and so `tokenizers`, follow); U8_SHORT when
 * b is a valid but unfinished prefix (*len bytes). */
int tok_utf8_class(const uint8_t *b, size_t n, int *len) {
  uint8_t c = b[0];
  int need;
  uint8_t lo = 0x80, hi = 0xBF;
  if (c < 0x80) {
    *len = 1;
    return U8_OK;
  } else if (c >= 0xC2 && c <= 0xDF) {
    need = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F; /* surrogates are not UTF-8 */
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    *len = 1;
    return U8_BAD;
  }
  for (int i = 1; i < need; i++) {
    if ((size_t)i >= n) {
      *len = i;
      return U8_SHORT;
    }
    uint8_t l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
    if (b[i] < l || b[i] > h) {
      *len = i;
      return U8_BAD;
    }
  }
  *len = need;
  return U8_OK;
}

/* Decodes one code point of valid UTF-8 (the caller validated it). */
uint32_t tok_utf8_cp(const uint8_t *b, int *len) {
  uint8_t c = b[0];
  if (c < 0x80) return *len = 1, c;
  if (c < 0xE0) return *len = 2, ((uint32_t)(c & 0x1F) << 6) | (b[1] & 0x3F);
  if (c < 0xF0)
    return *len = 3, ((uint32_t)(c & 0x0F) << 12) | ((uint32_t)(b[1] & 0x3F) << 6) | (b[2] & 0x3F);
  return *len = 4, ((uint32_t)(c & 0x07) << 18) | ((uint32_t)(b[1] & 0x3F) << 12) |
                       ((uint32_t)(b[2] & 0x3F) << 6) | (b[3] & 0x3F);
}

int tok_utf8_put(uint32_t cp, char *o) {
  if (cp < 0x80) return o[0] = (char)cp, 1;
  if (cp < 0x800) return o[0] = (char)(0xC0 | (cp >> 6)), o[1] = (char)(0x80 | (cp & 0x3F)), 2;
  if (cp < 0x10000) {
    o[0] = (char)(0xE0 | (cp >> 12));
    o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[2] = (char)(0x80 | (cp & 0x3F));
    return 3;
  }
  o[0] = (char)(0xF0 | (cp >> 18));
  o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
  o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
  o[3] = (char)(0x80 | (cp & 0x3F));
  return 4;
}

int tok_utf8_valid(const char *s, size_t n, size_t *bad_at) {
  const uint8_t *b = (const uint8_t *)s;
  size_t i = 0;
  while (i < n) {
    int len;
    if (tok_utf8_class(b + i, n - i, &len) != U8_OK) {
      if (bad_at) *bad_at = i;
      return 0;
    }
    i += (size_t)len;
  }
  return 1;
}

const char TOK_FFFD[3] = {(char)0xEF, (char)0xBF, (char)0xBD};
const char TOK_META[3] = {(char)0xE2, (char)0x96, (char)0x81}; /* U+2581 ▁ */

/* ---- hashing ----------------------------------------------------------------------------- */

uint64_t tok_hash_bytes(const char *s, size_t n) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a, then a final mix for the low bits */
  for (size_t i = 0; i < n; i++)
    h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
  h ^= h >> 29;
  h *= 0xbf58476d1ce4e5b9ull;
  return h ^ (h >> 32);
}

uint64_t tok_hash_u64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

int32_t tok_vocab_find(const lf_tokenizer *t, const char *s, size_t n) {
  if (!t->vocab_tab) return -1;
  size_t h = tok_hash_bytes(s, n) & t->vocab_mask;
  for (;;) {
    int32_t id = t->vocab_tab[h];
    if (id < 0) return -1;
    if (t->model_len[id] == n && memcmp(t->model_str[id], s, n) == 0) return id;
    h = (h + 1) & t->vocab_mask;
  }
}

/* Hugging Face tokenizer.json: loading, BPE encode, decode and streaming decode.
 *
 * Encode follows `tokenizers`' pipeline step by step, because ids only match when every step
 * matches: (1) split the text on added tokens (leftmost-longest); (2) per remaining segment,
 * the normalizer; (3) the pre-tokenizer chain splits the segment into words; (4) byte-level
 * mapping of each word when a ByteLevel pre-tokenizer is present; (5) BPE per word, merging the
 * lowest-ranked adjacent pair first (leftmost on ties); (6) the post-processor template.
 *
 * Decode precomputes, per id, the bytes that id contributes (byte-level unmapping, or ▁ ->
 * space), so the batch and the stream decoders share one per-token path and differ only in
 * when they may emit a character.
 */
#include "text/tokenizer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "text/json.h"
#include "text/tokenizer_unicode.h"

#ifdef LF_HAVE_PCRE2
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#endif

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

static lf_status ids_push(lf_token_ids *v, int32_t id) {
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

static lf_status text_append(lf_tok_text *t, const void *s, size_t n) {
  LF_TRY(text_reserve(t, n));
  if (n) memcpy(t->data + t->len, s, n);
  t->len += n;
  t->data[t->len] = '\0';
  return LF_OK;
}

static lf_status text_clear(lf_tok_text *t) {
  t->len = 0;
  LF_TRY(text_reserve(t, 0));
  t->data[0] = '\0';
  return LF_OK;
}

lf_status lf_tok_text_append(lf_tok_text *t, const char *s, size_t n) {
  return text_append(t, s, n);
}
lf_status lf_tok_text_clear(lf_tok_text *t) {
  return text_clear(t);
}

/* ---- UTF-8 ------------------------------------------------------------------------------- */

enum { U8_OK = 0, U8_BAD, U8_SHORT };

/* Classifies the character starting at b[0..n): U8_OK with its length; U8_BAD with the length of
 * the maximal valid subpart to replace by one U+FFFD (the Unicode "substitution of maximal
 * subparts" practice that Rust's from_utf8_lossy, and so `tokenizers`, follow); U8_SHORT when
 * b is a valid but unfinished prefix (*len bytes). */
static int utf8_class(const uint8_t *b, size_t n, int *len) {
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
static uint32_t utf8_cp(const uint8_t *b, int *len) {
  uint8_t c = b[0];
  if (c < 0x80) return *len = 1, c;
  if (c < 0xE0) return *len = 2, ((uint32_t)(c & 0x1F) << 6) | (b[1] & 0x3F);
  if (c < 0xF0)
    return *len = 3, ((uint32_t)(c & 0x0F) << 12) | ((uint32_t)(b[1] & 0x3F) << 6) | (b[2] & 0x3F);
  return *len = 4, ((uint32_t)(c & 0x07) << 18) | ((uint32_t)(b[1] & 0x3F) << 12) |
                       ((uint32_t)(b[2] & 0x3F) << 6) | (b[3] & 0x3F);
}

static int utf8_put(uint32_t cp, char *o) {
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

static int utf8_valid(const char *s, size_t n, size_t *bad_at) {
  const uint8_t *b = (const uint8_t *)s;
  size_t i = 0;
  while (i < n) {
    int len;
    if (utf8_class(b + i, n - i, &len) != U8_OK) {
      if (bad_at) *bad_at = i;
      return 0;
    }
    i += (size_t)len;
  }
  return 1;
}

/* Rust's char::is_whitespace (the White_Space property), for added-token lstrip/rstrip. */
static int cp_is_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

static const char FFFD[3] = {(char)0xEF, (char)0xBF, (char)0xBD};
static const char META[3] = {(char)0xE2, (char)0x96, (char)0x81}; /* U+2581 ▁ */

/* ---- hashing ----------------------------------------------------------------------------- */

static uint64_t hash_bytes(const char *s, size_t n) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a, then a final mix for the low bits */
  for (size_t i = 0; i < n; i++)
    h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
  h ^= h >> 29;
  h *= 0xbf58476d1ce4e5b9ull;
  return h ^ (h >> 32);
}

static uint64_t hash_u64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

static size_t pow2_at_least(size_t n) {
  size_t c = 16;
  while (c < n)
    c *= 2;
  return c;
}

/* ---- the tokenizer ----------------------------------------------------------------------- */

typedef enum { NORM_PREPEND, NORM_REPLACE, NORM_NFC } norm_kind;
typedef struct norm_step {
  norm_kind kind;
  char *a; /* PREPEND: text; REPLACE: pattern (string form) */
  size_t a_len;
  char *b; /* REPLACE: content */
  size_t b_len;
  void *re; /* REPLACE with a regex pattern: pcre2_code */
} norm_step;

typedef enum { BEHAV_REMOVED, BEHAV_ISOLATED, BEHAV_PREV, BEHAV_NEXT, BEHAV_CONTIGUOUS } behav;
typedef enum { PRE_SPLIT, PRE_BYTELEVEL, PRE_DIGITS, PRE_METASPACE } pre_kind;
typedef struct pre_step {
  pre_kind kind;
  behav behavior; /* SPLIT */
  int invert;     /* SPLIT */
  void *re;       /* SPLIT with a regex (also ByteLevel's GPT-2 regex): pcre2_code */
  char *lit;      /* SPLIT with a string pattern */
  size_t lit_len;
  int prefix_space; /* BYTELEVEL add_prefix_space; METASPACE: 0 never, 1 first, 2 always */
  int individual;   /* DIGITS individual_digits; METASPACE split */
} pre_step;

typedef struct added_tok {
  int32_t id;
  char *s;
  size_t len;
  int special, lstrip, rstrip, single_word;
} added_tok;

#define MAX_PRE 16
#define MAX_NORM 16
#define MAX_AFFIX 8

struct lf_tokenizer {
  int32_t n_ids; /* one past the largest id */
  /* Per id [n_ids]: */
  char **model_str; /* the model vocab's string (NULL when the id is not in it) */
  uint32_t *model_len;
  const char **tok_str; /* what id_to_token returns: an added token's content, else model's */
  uint8_t *id_flags;    /* ID_ADDED | ID_SPECIAL */
  const char **piece;   /* bytes this id contributes to decoded text */
  uint32_t *piece_len;
  int16_t *piece_byte; /* 0..255 for a <0xXX> byte-fallback token when the decoder does that */

  int32_t *vocab_tab; /* open addressing over model vocab ids, -1 empty */
  size_t vocab_mask;

  uint64_t *merge_key; /* (left << 32 | right), UINT64_MAX empty */
  int32_t *merge_rank, *merge_new;
  size_t merge_mask;

  added_tok *added; /* [n_added], sorted by (first byte, length descending) */
  size_t n_added;
  uint32_t added_first[257]; /* added[added_first[c] .. added_first[c+1]) start with byte c */

  norm_step norm[MAX_NORM];
  int n_norm;
  pre_step pre[MAX_PRE];
  int n_pre;
  int byte_level; /* words go through the byte->unicode mapping before BPE */

  int ignore_merges, byte_fallback, fuse_unk;
  int32_t unk_id;         /* -1 when none */
  int32_t byte_id[256];   /* <0xXX> ids for byte fallback, -1 when absent */
  char byte_char[256][2]; /* byte-level: each byte's mapped character, as UTF-8 */
  uint8_t byte_char_len[256];

  int32_t prefix[MAX_AFFIX], suffix[MAX_AFFIX]; /* post-processor's single template */
  int n_prefix, n_suffix;

  /* decoder */
  int dec_bytelevel, dec_byte_fallback, dec_strip, dec_meta_first;

  /* string storage */
  char **chunks;
  size_t n_chunks, chunk_used, chunk_cap;
};

enum { ID_ADDED = 1, ID_SPECIAL = 2 };

/* GPT-2's byte <-> unicode table: printable bytes map to themselves, the rest to U+0100.. in
 * order, so every byte is a visible character and BPE never sees control bytes or spaces. */
static void byte_level_table(uint32_t cp_of_byte[256]) {
  int n = 0;
  for (int b = 0; b < 256; b++) {
    int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    cp_of_byte[b] = printable ? (uint32_t)b : (uint32_t)(256 + n++);
  }
}

static char *arena_dup(lf_tokenizer *t, const char *s, size_t n) {
  if (t->n_chunks == 0 || t->chunk_used + n + 1 > t->chunk_cap) {
    size_t cap = n + 1 > 65536 ? n + 1 : 65536;
    char **c = realloc(t->chunks, (t->n_chunks + 1) * sizeof *c);
    if (!c) return NULL;
    t->chunks = c;
    if (!(c[t->n_chunks] = malloc(cap))) return NULL;
    t->n_chunks++;
    t->chunk_used = 0;
    t->chunk_cap = cap;
  }
  char *p = t->chunks[t->n_chunks - 1] + t->chunk_used;
  if (n) memcpy(p, s, n);
  p[n] = '\0';
  t->chunk_used += n + 1;
  return p;
}

static void re_free(void *re) {
#ifdef LF_HAVE_PCRE2
  if (re) pcre2_code_free((pcre2_code *)re);
#else
  (void)re;
#endif
}

void lf_tokenizer_free(lf_tokenizer *t) {
  if (!t) return;
  free(t->model_str);
  free(t->model_len);
  free(t->tok_str);
  free(t->id_flags);
  free(t->piece);
  free(t->piece_len);
  free(t->piece_byte);
  free(t->vocab_tab);
  free(t->merge_key);
  free(t->merge_rank);
  free(t->merge_new);
  free(t->added);
  for (int i = 0; i < t->n_norm; i++)
    re_free(t->norm[i].re);
  for (int i = 0; i < t->n_pre; i++)
    re_free(t->pre[i].re);
  for (size_t i = 0; i < t->n_chunks; i++)
    free(t->chunks[i]);
  free(t->chunks);
  free(t);
}

static int32_t vocab_find(const lf_tokenizer *t, const char *s, size_t n) {
  if (!t->vocab_tab) return -1;
  size_t h = hash_bytes(s, n) & t->vocab_mask;
  for (;;) {
    int32_t id = t->vocab_tab[h];
    if (id < 0) return -1;
    if (t->model_len[id] == n && memcmp(t->model_str[id], s, n) == 0) return id;
    h = (h + 1) & t->vocab_mask;
  }
}

static int merge_find(const lf_tokenizer *t, int32_t a, int32_t b, int32_t *rank, int32_t *id) {
  if (!t->merge_key) return 0;
  uint64_t k = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
  size_t h = hash_u64(k) & t->merge_mask;
  for (;;) {
    uint64_t e = t->merge_key[h];
    if (e == UINT64_MAX) return 0;
    if (e == k) {
      *rank = t->merge_rank[h];
      *id = t->merge_new[h];
      return 1;
    }
    h = (h + 1) & t->merge_mask;
  }
}

/* ---- loading ----------------------------------------------------------------------------- */

#ifdef LF_HAVE_PCRE2
static lf_status re_compile(const char *pat, size_t len, void **out) {
  int err;
  PCRE2_SIZE off;
  /* UTF + UCP: \s, \p{L}, \p{N} and (?i) act on Unicode properties as Oniguruma (the regex
   * engine inside `tokenizers`) does. */
  pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, len, PCRE2_UTF | PCRE2_UCP, &err, &off, NULL);
  if (!re) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    return lf_error(LF_ERR_FORMAT, "tokenizer.json: bad regex at offset %zu: %s", (size_t)off,
                    (const char *)msg);
  }
  /* JIT is an optimisation only: without it (unsupported arch) the interpreter matches. */
  (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
  *out = re;
  return LF_OK;
}
#else
static lf_status re_compile(const char *pat, size_t len, void **out) {
  (void)pat;
  (void)len;
  *out = NULL;
  return lf_error(LF_ERR_UNAVAILABLE,
                  "tokenizer.json needs a regex (byte-level BPE pre-tokenizer), but lfserve was "
                  "built without PCRE2: install libpcre2-dev and reconfigure");
}
#endif

static const char *type_of(const lf_json *v) {
  return lf_json_str(lf_json_get(v, "type"), NULL);
}

static int str_is(const lf_json *v, const char *s) {
  const char *x = lf_json_str(v, NULL);
  return x && strcmp(x, s) == 0;
}

/* A pattern is {"String": s} or {"Regex": r}. */
static lf_status load_pattern(lf_tokenizer *t, const lf_json *pat, const char *what, void **re,
                              char **lit, size_t *lit_len) {
  size_t n;
  const char *s;
  *re = NULL;
  *lit = NULL;
  if ((s = lf_json_str(lf_json_get(pat, "Regex"), &n))) return re_compile(s, n, re);
  if ((s = lf_json_str(lf_json_get(pat, "String"), &n))) {
    if (n == 0) return lf_error(LF_ERR_FORMAT, "tokenizer.json: %s: empty pattern", what);
    if (!(*lit = arena_dup(t, s, n))) return lf_error(LF_ERR_OUT_OF_MEMORY, "out of memory");
    *lit_len = n;
    return LF_OK;
  }
  return lf_error(LF_ERR_FORMAT, "tokenizer.json: %s: pattern is neither String nor Regex", what);
}

static lf_status load_normalizer(lf_tokenizer *t, const lf_json *n) {
  if (lf_json_typeof(n) == LF_JSON_NULL) return LF_OK;
  const char *ty = type_of(n);
  if (!ty) return lf_error(LF_ERR_FORMAT, "tokenizer.json: normalizer without a type");
  if (strcmp(ty, "Sequence") == 0) {
    const lf_json *list = lf_json_get(n, "normalizers");
    if (lf_json_typeof(list) != LF_JSON_ARRAY)
      return lf_error(LF_ERR_FORMAT, "tokenizer.json: Sequence normalizer without a list");
    for (size_t i = 0; i < lf_json_len(list); i++)
      LF_TRY(load_normalizer(t, lf_json_at(list, i)));
    return LF_OK;
  }
  if (t->n_norm == MAX_NORM)
    return lf_error(LF_ERR_UNSUPPORTED, "tokenizer.json: more than %d normalizers", MAX_NORM);
  norm_step *st = &t->norm[t->n_norm];
  memset(st, 0, sizeof *st);
  if (strcmp(ty, "Prepend") == 0) {
    size_t len;
    const char *s = lf_json_str(lf_json_get(n, "prepend"), &len);
    if (!s) return lf_error(LF_ERR_FORMAT, "tokenizer.json: Prepend without a string");
    st->kind = NORM_PREPEND;
    if (!(st->a = arena_dup(t, s, len))) return lf_error(LF_ERR_OUT_OF_MEMORY, "out of memory");
    st->a_len = len;
  } else if (strcmp(ty, "Replace") == 0) {
    size_t len;
    const char *s = lf_json_str(lf_json_get(n, "content"), &len);
    if (!s) return lf_error(LF_ERR_FORMAT, "tokenizer.json: Replace without content");
    st->kind = NORM_REPLACE;
    if (!(st->b = arena_dup(t, s, len))) return lf_error(LF_ERR_OUT_OF_MEMORY, "out of memory");
    st->b_len = len;
    LF_TRY(load_pattern(t, lf_json_get(n, "pattern"), "Replace normalizer", &st->re, &st->a,
                        &st->a_len));
  } else if (strcmp(ty, "NFC") == 0) {
    st->kind = NORM_NFC;
  } else {
    return lf_error(LF_ERR_UNSUPPORTED, "tokenizer.json: normalizer type \"%s\" not supported", ty);
  }
  t->n_norm++;
  return LF_OK;
}

#ifdef LF_HAVE_PCRE2
/* ByteLevel(use_regex=true): GPT-2's split, used when no Split pre-tokenizer precedes it. */
static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
#endif

static lf_status add_pre(lf_tokenizer *t, pre_step **out) {
  if (t->n_pre == MAX_PRE)
    return lf_error(LF_ERR_UNSUPPORTED, "tokenizer.json: more than %d pre-tokenizers", MAX_PRE);
  *out = &t->pre[t->n_pre++];
  memset(*out, 0, sizeof **out);
  return LF_OK;
}

static lf_status load_pre_tokenizer(lf_tokenizer *t, const lf_json *p) {
  if (lf_json_typeof(p) == LF_JSON_NULL) return LF_OK;
  const char *ty = type_of(p);
  if (!ty) return lf_error(LF_ERR_FORMAT, "tokenizer.json: pre_tokenizer without a type");
  if (t->byte_level)
    return lf_error(LF_ERR_UNSUPPORTED,
                    "tokenizer.json: a pre-tokenizer after ByteLevel is not supported");
  pre_step *st = NULL;
  int b;
  if (strcmp(ty, "Sequence") == 0) {
    const lf_json *list = lf_json_get(p, "pretokenizers");
    if (lf_json_typeof(list) != LF_JSON_ARRAY)
      return lf_error(LF_ERR_FORMAT, "tokenizer.json: Sequence pre_tokenizer without a list");
    for (size_t i = 0; i < lf_json_len(list); i++)
      LF_TRY(load_pre_tokenizer(t, lf_json_at(list, i)));
    return LF_OK;
  }
  if (strcmp(ty, "Split") == 0) {
    LF_TRY(add_pre(t, &st));
    st->kind = PRE_SPLIT;
    const lf_json *bh = lf_json_get(p, "behavior");
    if (str_is(bh, "Removed"))
      st->behavior = BEHAV_REMOVED;
    else if (str_is(bh, "Isolated"))
      st->behavior = BEHAV_ISOLATED;
    else if (str_is(bh, "MergedWithPrevious"))
      st->behavior = BEHAV_PREV;
    else if (str_is(bh, "MergedWithNext"))
      st->behavior = BEHAV_NEXT;
    else if (str_is(bh, "Contiguous"))
      st->behavior = BEHAV_CONTIGUOUS;
    else
      return lf_error(LF_ERR_FORMAT, "tokenizer.json: Split with an unknown behavior");
    if (lf_json_bool(lf_json_get(p, "invert"), &b)) st->invert = b;
    return load_pattern(t, lf_json_get(p, "pattern"), "Split pre-tokenizer", &st->re, &st->lit,
                        &st->lit_len);
  }
  if (strcmp(ty, "ByteLevel") == 0) {
    int use_regex = 1, prefix = 1;
    lf_json_bool(lf_json_get(p, "use_regex"), &use_regex);
    lf_json_bool(lf_json_get(p, "add_prefix_space"), &prefix);
    LF_TRY(add_pre(t, &st));
    st->kind = PRE_BYTELEVEL;
    st->behavior = BEHAV_ISOLATED; /* how its GPT-2 regex splits */
    st->prefix_space = prefix;
    /* The regex alone needs PCRE2, but the byte mapping it feeds only makes sense for BPE over
     * regex-split words: every byte-level model has a regex somewhere, so require PCRE2 here. */
#ifndef LF_HAVE_PCRE2
    return re_compile("", 0, &st->re);
#else
    if (use_regex) LF_TRY(re_compile(GPT2_PATTERN, sizeof GPT2_PATTERN - 1, &st->re));
#endif
    t->byte_level = 1;
    return LF_OK;
  }
  if (strcmp(ty, "Digits") == 0) {
    LF_TRY(add_pre(t, &st));
    st->kind = PRE_DIGITS;
    if (lf_json_bool(lf_json_get(p, "individual_digits"), &b)) st->individual = b;
    return LF_OK;
  }
  if (strcmp(ty, "Metaspace") == 0) {
    size_t n;
    const char *rep = lf_json_str(lf_json_get(p, "replacement"), &n);
    if (!rep || n != 3 || memcmp(rep, META, 3) != 0)
      return lf_error(LF_ERR_UNSUPPORTED, "tokenizer.json: Metaspace replacement must be U+2581");
    LF_TRY(add_pre(t, &st));
    st->kind = PRE_METASPACE;
    st->prefix_space = 2;
    st->individual = 1;
    const lf_json *sch = lf_json_get(p, "prepend_scheme");
    if (str_is(sch, "never"))
      st->prefix_space = 0;
    else if (str_is(sch, "first"))
      st->prefix_space = 1;
    else if (lf_json_bool(lf_json_get(p, "add_prefix_space"), &b) && !b)
      st->prefix_space = 0;
    if (lf_json_bool(lf_json_get(p, "split"), &b)) st->individual = b;
    return LF_OK;
  }
  return lf_error(LF_ERR_UNSUPPORTED, "tokenizer.json: pre_tokenizer type \"%s\" not supported",
                  ty);
}

static lf_status load_decoder(lf_tokenizer *t, const lf_json *d) {
  if (lf_json_typeof(d) == LF_JSON_NULL) return LF_OK;
  const char *ty = type_of(d);
  if (!ty) return lf_error(LF_ERR_FORMAT, "tokenizer.json: decoder without a type");
  if (strcmp(ty, "Sequence") == 0) {
    const lf_json *list = lf_json_get(d, "decoders");
    if (lf_json_typeof(list) != LF_JSON_ARRAY)
      return lf_error(LF_ERR_FORMAT, "tokenizer.json: Sequence decoder without a list");
    for (size_t i = 0; i < lf_json_len(list); i++)
      LF_TRY(load_decoder(t, lf_json_at(list, i)));
    return LF_OK;
  }
  if (strcmp(ty, "ByteLevel") == 0) {
    t->dec_bytelevel = 1;
  } else if (strcmp(ty, "ByteFallback") == 0) {
    t->dec_byte_fallback = 1;
  } else if (strcmp(ty, "Fuse") == 0) {
    /* Joining tokens is what our decoder does anyway. */
  } else if (strcmp(ty, "Replace") == 0) {
    const lf_json *pat = lf_json_get(d, "pattern");
    size_t pn, cn;
    const char *ps = lf_json_str(lf_json_get(pat, "String"), &pn);
    const char *cs = lf_json_str(lf_json_get(d, "content"), &cn);
    if (!ps || !cs || pn != 3 || memcmp(ps, META, 3) != 0 || cn != 1 || cs[0] != ' ')
      return lf_error(
          LF_ERR_UNSUPPORTED,
          "tokenizer.json: only the Replace(\"\\u2581\" -> \" \") decoder is supported");
    /* Nothing to record: every token of a non-byte-level decoder has ▁ -> space applied. */
  } else if (strcmp(ty, "Strip") == 0) {
    int64_t start = 0, stop = 0;
    lf_json_int(lf_json_get(d, "start"), &start);
    lf_json_int(lf_json_get(d, "stop"), &stop);
    if (!str_is(lf_json_get(d, "content"), " ") || stop != 0 || start < 0 || start > 64)
      return lf_error(LF_ERR_UNSUPPORTED,
                      "tokenizer.json: only Strip(content=\" \", stop=0) decoders are supported");
    t->dec_strip = (int)start;
  } else if (strcmp(ty, "Metaspace") == 0) {
    int b;
    t->dec_meta_first = 1;
    const lf_json *sch = lf_json_get(d, "prepend_scheme");
    if (str_is(sch, "never"))
      t->dec_meta_first = 0;
    else if (lf_json_bool(lf_json_get(d, "add_prefix_space"), &b) && !b)
      t->dec_meta_first = 0;
  } else {
    return lf_error(LF_ERR_UNSUPPORTED, "tokenizer.json: decoder type \"%s\" not supported", ty);
  }
  return LF_OK;
}

static lf_status lookup_special(const lf_json *specials, const lf_json *item, int32_t *ids,
                                int *n) {
  const char *name = lf_json_str(lf_json_get(item, "id"), NULL);
  const lf_json *sp = lf_json_get(specials, name ? name : "");
  const lf_json *list = lf_json_get(sp, "ids");
  if (!name || lf_json_typeof(list) != LF_JSON_ARRAY)
    return lf_error(LF_ERR_FORMAT, "tokenizer.json: TemplateProcessing names unknown token %s",
                    name ? name : "(none)");
  for (size_t i = 0; i < lf_json_len(list); i++) {
    int64_t id;
    if (!lf_json_int(lf_json_at(list, i), &id) || id < 0 || id > INT32_MAX)
      return lf_error(LF_ERR_FORMAT, "tokenizer.json: bad id in TemplateProcessing");
    if (*n == MAX_AFFIX)
      return lf_error(LF_ERR_UNSUPPORTED, "tokenizer.json: template adds too many tokens");
    ids[(*n)++] = (int32_t)id;
  }
  return LF_OK;
}

static lf_status load_post_processor(lf_tokenizer *t, const lf_json *p) {
  if (lf_json_typeof(p) == LF_JSON_NULL) return LF_OK;
  const char *ty = type_of(p);
  if (!ty) return lf_error(LF_ERR_FORMAT, "tokenizer.json: post_processor without a type");
  if (strcmp(ty, "Sequence") == 0) {
    const lf_json *list = lf_json_get(p, "processors");
    for (size_t i = 0; i < lf_json_len(list); i++)
      LF_TRY(load_post_processor(t, lf_json_at(list, i)));
    return LF_OK;
  }
  if (strcmp(ty, "ByteLevel") == 0) return LF_OK; /* offsets only: no ids change */
  if (strcmp(ty, "TemplateProcessing") == 0) {
    const lf_json *single = lf_json_get(p, "single"), *specials = lf_json_get(p, "special_tokens");
    int seen_a = 0;
    t->n_prefix = t->n_suffix = 0;
    for (size_t i = 0; i < lf_json_len(single); i++) {
      const lf_json *it = lf_json_at(single, i), *sp = lf_json_get(it, "SpecialToken");
      if (lf_json_get(it, "Sequence")) {
        seen_a = 1;
      } else if (sp) {
        LF_TRY(seen_a ? lookup_special(specials, sp, t->suffix, &t->n_suffix)
                      : lookup_special(specials, sp, t->prefix, &t->n_prefix));
      } else {
        return lf_error(LF_ERR_FORMAT, "tokenizer.json: bad TemplateProcessing item");
      }
    }
    return LF_OK;
  }
  if (strcmp(ty, "RobertaProcessing") == 0 || strcmp(ty, "BertProcessing") == 0) {
    int64_t cls, sep;
    if (!lf_json_int(lf_json_at(lf_json_get(p, "cls"), 1), &cls) ||
        !lf_json_int(lf_json_at(lf_json_get(p, "sep"), 1), &sep))
      return lf_error(LF_ERR_FORMAT, "tokenizer.json: %s without cls/sep ids", ty);
    t->prefix[0] = (int32_t)cls;
    t->suffix[0] = (int32_t)sep;
    t->n_prefix = t->n_suffix = 1;
    return LF_OK;
  }
  return lf_error(LF_ERR_UNSUPPORTED, "tokenizer.json: post_processor type \"%s\" not supported",
                  ty);
}

static int added_cmp(const void *a, const void *b) {
  const added_tok *x = a, *y = b;
  uint8_t cx = (uint8_t)x->s[0], cy = (uint8_t)y->s[0];
  if (cx != cy) return cx < cy ? -1 : 1;
  if (x->len != y->len) return x->len > y->len ? -1 : 1;
  return x->id < y->id ? -1 : x->id > y->id;
}

static lf_status load_model(lf_tokenizer *t, const lf_json *m, const lf_json *added) {
  const char *ty = type_of(m);
  if (ty && strcmp(ty, "BPE") != 0)
    return lf_error(LF_ERR_UNSUPPORTED,
                    "tokenizer.json: model type \"%s\" not supported (only BPE)", ty);
  const lf_json *vocab = lf_json_get(m, "vocab"), *merges = lf_json_get(m, "merges");
  if (lf_json_typeof(vocab) != LF_JSON_OBJECT)
    return lf_error(LF_ERR_FORMAT, "tokenizer.json: model has no vocab object");
  if (!ty && lf_json_typeof(merges) != LF_JSON_ARRAY)
    return lf_error(LF_ERR_UNSUPPORTED, "tokenizer.json: model without a type is not BPE");
  if (lf_json_typeof(merges) != LF_JSON_ARRAY)
    return lf_error(LF_ERR_FORMAT, "tokenizer.json: BPE model has no merges array");
  const char *s;
  if ((s = lf_json_str(lf_json_get(m, "continuing_subword_prefix"), NULL)) && *s)
    return lf_error(LF_ERR_UNSUPPORTED, "tokenizer.json: continuing_subword_prefix not supported");
  if ((s = lf_json_str(lf_json_get(m, "end_of_word_suffix"), NULL)) && *s)
    return lf_error(LF_ERR_UNSUPPORTED, "tokenizer.json: end_of_word_suffix not supported");
  lf_json_bool(lf_json_get(m, "ignore_merges"), &t->ignore_merges);
  lf_json_bool(lf_json_get(m, "byte_fallback"), &t->byte_fallback);
  lf_json_bool(lf_json_get(m, "fuse_unk"), &t->fuse_unk);

  /* Ids: the largest of vocab and added tokens. */
  int64_t max_id = -1, id;
  size_t nv = lf_json_len(vocab);
  for (size_t i = 0; i < nv; i++) {
    if (!lf_json_int(lf_json_at(vocab, i), &id) || id < 0 || id >= (1 << 30))
      return lf_error(LF_ERR_FORMAT, "tokenizer.json: vocab entry \"%s\" has a bad id",
                      lf_json_key_at(vocab, i));
    if (id > max_id) max_id = id;
  }
  for (size_t i = 0; i < lf_json_len(added); i++) {
    const lf_json *a = lf_json_at(added, i);
    if (!lf_json_int(lf_json_get(a, "id"), &id) || id < 0 || id >= (1 << 30) ||
        !lf_json_str(lf_json_get(a, "content"), NULL))
      return lf_error(LF_ERR_FORMAT, "tokenizer.json: added_tokens[%zu] lacks id or content", i);
    if (id > max_id) max_id = id;
  }
  t->n_ids = (int32_t)(max_id + 1);
  size_t n = (size_t)t->n_ids;
  t->model_str = calloc(n ? n : 1, sizeof *t->model_str);
  t->model_len = calloc(n ? n : 1, sizeof *t->model_len);
  t->tok_str = calloc(n ? n : 1, sizeof *t->tok_str);
  t->id_flags = calloc(n ? n : 1, 1);
  t->vocab_mask = pow2_at_least(nv * 2) - 1;
  t->vocab_tab = malloc((t->vocab_mask + 1) * sizeof *t->vocab_tab);
  if (!t->model_str || !t->model_len || !t->tok_str || !t->id_flags || !t->vocab_tab)
    return lf_error(LF_ERR_OUT_OF_MEMORY, "tokenizer: out of memory for %zu ids", n);
  memset(t->vocab_tab, 0xff, (t->vocab_mask + 1) * sizeof *t->vocab_tab);
  for (size_t i = 0; i < nv; i++) {
    size_t len = lf_json_at(vocab, i)->key_len;
    const char *key = lf_json_key_at(vocab, i);
    lf_json_int(lf_json_at(vocab, i), &id);
    if (t->model_str[id])
      return lf_error(LF_ERR_FORMAT, "tokenizer.json: id %lld appears twice in the vocab",
                      (long long)id);
    if (vocab_find(t, key, len) >= 0)
      return lf_error(LF_ERR_FORMAT, "tokenizer.json: token \"%s\" appears twice in the vocab",
                      key);
    if (!(t->model_str[id] = arena_dup(t, key, len)))
      return lf_error(LF_ERR_OUT_OF_MEMORY, "out of memory");
    t->model_len[id] = (uint32_t)len;
    t->tok_str[id] = t->model_str[id];
    size_t h = hash_bytes(key, len) & t->vocab_mask;
    while (t->vocab_tab[h] >= 0)
      h = (h + 1) & t->vocab_mask;
    t->vocab_tab[h] = (int32_t)id;
  }

  /* Merges: rank = position. Each is "a b" (older files) or ["a", "b"]. */
  size_t nm = lf_json_len(merges);
  t->merge_mask = pow2_at_least(nm * 2) - 1;
  t->merge_key = malloc((t->merge_mask + 1) * sizeof *t->merge_key);
  t->merge_rank = malloc((t->merge_mask + 1) * sizeof *t->merge_rank);
  t->merge_new = malloc((t->merge_mask + 1) * sizeof *t->merge_new);
  if (!t->merge_key || !t->merge_rank || !t->merge_new)
    return lf_error(LF_ERR_OUT_OF_MEMORY, "tokenizer: out of memory for %zu merges", nm);
  memset(t->merge_key, 0xff, (t->merge_mask + 1) * sizeof *t->merge_key);
  char *cat = NULL;
  size_t cat_cap = 0;
  lf_status st = LF_OK;
  for (size_t i = 0; i < nm && st == LF_OK; i++) {
    const lf_json *e = lf_json_at(merges, i);
    const char *a, *b;
    size_t al, bl;
    if (lf_json_typeof(e) == LF_JSON_STRING) {
      const char *sp = memchr(e->str, ' ', e->len);
      a = e->str;
      al = sp ? (size_t)(sp - e->str) : 0;
      b = sp ? sp + 1 : NULL;
      bl = sp ? e->len - al - 1 : 0;
      if (!sp || memchr(b, ' ', bl)) {
        st =
            lf_error(LF_ERR_FORMAT, "tokenizer.json: merges[%zu] \"%s\" is not \"a b\"", i, e->str);
        break;
      }
    } else if (lf_json_typeof(e) == LF_JSON_ARRAY && lf_json_len(e) == 2 &&
               (a = lf_json_str(lf_json_at(e, 0), &al)) &&
               (b = lf_json_str(lf_json_at(e, 1), &bl))) {
    } else {
      st = lf_error(LF_ERR_FORMAT, "tokenizer.json: merges[%zu] is neither \"a b\" nor [a, b]", i);
      break;
    }
    int32_t ia = vocab_find(t, a, al), ib = vocab_find(t, b, bl);
    if (al + bl > cat_cap) {
      cat_cap = (al + bl) * 2;
      char *p = realloc(cat, cat_cap);
      if (!p) {
        st = lf_error(LF_ERR_OUT_OF_MEMORY, "out of memory");
        break;
      }
      cat = p;
    }
    memcpy(cat, a, al);
    memcpy(cat + al, b, bl);
    int32_t in = vocab_find(t, cat, al + bl);
    if (ia < 0 || ib < 0 || in < 0) {
      st = lf_error(LF_ERR_FORMAT,
                    "tokenizer.json: merges[%zu] uses a token missing from the "
                    "vocab (%.*s + %.*s)",
                    i, (int)al, a, (int)bl, b);
      break;
    }
    uint64_t k = ((uint64_t)(uint32_t)ia << 32) | (uint32_t)ib;
    size_t h = hash_u64(k) & t->merge_mask;
    while (t->merge_key[h] != UINT64_MAX && t->merge_key[h] != k)
      h = (h + 1) & t->merge_mask;
    if (t->merge_key[h] == k) continue; /* a repeated merge keeps its first (lowest) rank */
    t->merge_key[h] = k;
    t->merge_rank[h] = (int32_t)i;
    t->merge_new[h] = in;
  }
  free(cat);
  LF_TRY(st);

  t->unk_id = -1;
  size_t ul;
  const char *unk = lf_json_str(lf_json_get(m, "unk_token"), &ul);
  if (unk) t->unk_id = vocab_find(t, unk, ul);
  for (int b = 0; b < 256; b++) {
    char nm8[8];
    snprintf(nm8, sizeof nm8, "<0x%02X>", b);
    t->byte_id[b] = vocab_find(t, nm8, 6);
  }

  /* Added tokens. */
  size_t na = lf_json_len(added);
  t->added = calloc(na ? na : 1, sizeof *t->added);
  if (!t->added) return lf_error(LF_ERR_OUT_OF_MEMORY, "out of memory");
  for (size_t i = 0; i < na; i++) {
    const lf_json *a = lf_json_at(added, i);
    added_tok *x = &t->added[t->n_added];
    size_t len;
    const char *c = lf_json_str(lf_json_get(a, "content"), &len);
    lf_json_int(lf_json_get(a, "id"), &id);
    if (len == 0) continue; /* can never match */
    x->id = (int32_t)id;
    if (!(x->s = arena_dup(t, c, len))) return lf_error(LF_ERR_OUT_OF_MEMORY, "out of memory");
    x->len = len;
    lf_json_bool(lf_json_get(a, "special"), &x->special);
    lf_json_bool(lf_json_get(a, "lstrip"), &x->lstrip);
    lf_json_bool(lf_json_get(a, "rstrip"), &x->rstrip);
    lf_json_bool(lf_json_get(a, "single_word"), &x->single_word);
    t->tok_str[id] = x->s;
    t->id_flags[id] = (uint8_t)(ID_ADDED | (x->special ? ID_SPECIAL : 0));
    t->n_added++;
  }
  qsort(t->added, t->n_added, sizeof *t->added, added_cmp);
  size_t j = 0;
  for (int c = 0; c <= 256; c++) {
    while (j < t->n_added && (uint8_t)t->added[j].s[0] < c)
      j++;
    t->added_first[c] = (uint32_t)j;
  }
  return LF_OK;
}

/* Per-id decoded bytes, so decode is a table walk. */
static lf_status build_pieces(lf_tokenizer *t) {
  size_t n = (size_t)t->n_ids;
  t->piece = calloc(n ? n : 1, sizeof *t->piece);
  t->piece_len = calloc(n ? n : 1, sizeof *t->piece_len);
  t->piece_byte = malloc((n ? n : 1) * sizeof *t->piece_byte);
  if (!t->piece || !t->piece_len || !t->piece_byte)
    return lf_error(LF_ERR_OUT_OF_MEMORY, "out of memory");
  uint32_t cp_of_byte[256];
  int16_t byte_of_cp[324];
  byte_level_table(cp_of_byte);
  memset(byte_of_cp, 0xff, sizeof byte_of_cp);
  for (int b = 0; b < 256; b++)
    byte_of_cp[cp_of_byte[b]] = (int16_t)b;
  char *buf = NULL;
  size_t cap = 0;
  for (size_t id = 0; id < n; id++) {
    const char *s = t->tok_str[id];
    t->piece_byte[id] = -1;
    if (!s) continue;
    size_t len = strlen(s);
    /* A NUL inside a token ("\u0000") is rare; we stop at it, like a C string would. */
    if (len * 3 + 1 > cap) {
      cap = len * 3 + 1;
      char *p = realloc(buf, cap);
      if (!p) {
        free(buf);
        return lf_error(LF_ERR_OUT_OF_MEMORY, "out of memory");
      }
      buf = p;
    }
    size_t o = 0;
    if (t->dec_bytelevel) {
      /* A token whose every character is in the table becomes those bytes; any other (say
       * "<｜User｜>") passes through as its own UTF-8, exactly as tokenizers' ByteLevel does. */
      int all = 1;
      for (size_t i = 0; i < len && all;) {
        int l;
        uint32_t cp = utf8_cp((const uint8_t *)s + i, &l);
        if (cp < 324 && byte_of_cp[cp] >= 0)
          buf[o++] = (char)byte_of_cp[cp];
        else
          all = 0;
        i += (size_t)l;
      }
      if (!all) {
        memcpy(buf, s, len);
        o = len;
      }
    } else {
      if (t->dec_byte_fallback && len == 6 && memcmp(s, "<0x", 3) == 0 && s[5] == '>') {
        unsigned v;
        char hex[3] = {s[3], s[4], 0};
        char *end;
        v = (unsigned)strtoul(hex, &end, 16);
        if (*end == '\0' && end == hex + 2) t->piece_byte[id] = (int16_t)v;
      }
      for (size_t i = 0; i < len;) {
        if (i + 3 <= len && memcmp(s + i, META, 3) == 0) {
          buf[o++] = ' ';
          i += 3;
        } else {
          buf[o++] = s[i++];
        }
      }
    }
    if (!(t->piece[id] = arena_dup(t, buf, o))) {
      free(buf);
      return lf_error(LF_ERR_OUT_OF_MEMORY, "out of memory");
    }
    t->piece_len[id] = (uint32_t)o;
  }
  free(buf);
  for (int b = 0; b < 256; b++) {
    char c[4];
    int l = utf8_put(cp_of_byte[b], c); /* code points < U+0144: at most 2 bytes */
    memcpy(t->byte_char[b], c, (size_t)l);
    t->byte_char_len[b] = (uint8_t)l;
  }
  return LF_OK;
}

lf_status lf_tokenizer_init(const char *json, size_t len, lf_tokenizer **out) {
  if (!json || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_tokenizer_init: NULL argument");
  *out = NULL;
  lf_json *root;
  char err[256];
  lf_status st = lf_json_parse(json, len, &root, err, sizeof err);
  if (st != LF_OK) return lf_error(st, "tokenizer.json: %s", err);
  lf_tokenizer *t = calloc(1, sizeof *t);
  if (!t) {
    lf_json_free(root);
    return lf_error(LF_ERR_OUT_OF_MEMORY, "out of memory");
  }
  const lf_json *model = lf_json_get(root, "model"), *added = lf_json_get(root, "added_tokens");
  if (lf_json_typeof(root) != LF_JSON_OBJECT || lf_json_typeof(model) != LF_JSON_OBJECT)
    st = lf_error(LF_ERR_FORMAT, "tokenizer.json: no \"model\" object");
  else if (lf_json_typeof(added) != LF_JSON_NULL && lf_json_typeof(added) != LF_JSON_ARRAY)
    st = lf_error(LF_ERR_FORMAT, "tokenizer.json: \"added_tokens\" is not an array");
  if (st == LF_OK) st = load_model(t, model, added);
  if (st == LF_OK) st = load_normalizer(t, lf_json_get(root, "normalizer"));
  if (st == LF_OK) st = load_pre_tokenizer(t, lf_json_get(root, "pre_tokenizer"));
  if (st == LF_OK) st = load_decoder(t, lf_json_get(root, "decoder"));
  if (st == LF_OK) st = load_post_processor(t, lf_json_get(root, "post_processor"));
  if (st == LF_OK) st = build_pieces(t);
  lf_json_free(root);
  if (st != LF_OK) {
    lf_tokenizer_free(t);
    return st;
  }
  *out = t;
  return LF_OK;
}

lf_status lf_tokenizer_init_file(const char *path, lf_tokenizer **out) {
  if (!path || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_tokenizer_init_file: NULL argument");
  *out = NULL;
  FILE *f = fopen(path, "rb");
  if (!f) return lf_error(LF_ERR_IO, "%s: %s", path, strerror(errno));
  char *buf = NULL;
  size_t len = 0, cap = 0;
  for (;;) {
    if (len == cap) {
      cap = cap ? cap * 2 : 1 << 20;
      char *p = realloc(buf, cap);
      if (!p) {
        free(buf);
        fclose(f);
        return lf_error(LF_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
      }
      buf = p;
    }
    size_t r = fread(buf + len, 1, cap - len, f);
    len += r;
    if (r == 0) break;
  }
  int bad = ferror(f);
  fclose(f);
  if (bad) {
    free(buf);
    return lf_error(LF_ERR_IO, "%s: read error", path);
  }
  lf_status st = lf_tokenizer_init(buf, len, out);
  free(buf);
  return st;
}

int32_t lf_tokenizer_vocab_size(const lf_tokenizer *t) {
  return t ? t->n_ids : 0;
}

const char *lf_tokenizer_id_to_token(const lf_tokenizer *t, int32_t id) {
  if (!t || id < 0 || id >= t->n_ids) return NULL;
  return t->tok_str[id];
}

int32_t lf_tokenizer_token_to_id(const lf_tokenizer *t, const char *token) {
  if (!t || !token) return -1;
  size_t n = strlen(token);
  for (size_t i = 0; n && i < t->n_added; i++)
    if (t->added[i].len == n && memcmp(t->added[i].s, token, n) == 0) return t->added[i].id;
  return vocab_find(t, token, n);
}

int lf_tokenizer_is_special(const lf_tokenizer *t, int32_t id) {
  return t && id >= 0 && id < t->n_ids && (t->id_flags[id] & ID_SPECIAL);
}

/* ---- encode ------------------------------------------------------------------------------ */

typedef struct span {
  size_t off, len;
} span;

/* Per-call scratch: nothing in lf_tokenizer changes during encode. */
typedef struct scratch {
  char *buf; /* the normalized segment, then pre-tokenizer rewrites appended after it */
  size_t len, cap;
  span *pieces, *next;
  size_t n_pieces, n_next, cap_pieces, cap_next;
  span *marks;   /* one piece's matches and the gaps between them, in order */
  int *is_match; /* marks[i] is a match (1) or a gap (0) */
  size_t cap_marks, cap_is_match;
  char *word; /* byte-level mapped word */
  size_t word_cap;
  int32_t *sym, *prev, *nxt; /* BPE symbols of one word */
  size_t sym_cap;
  struct heap_e *heap;
  size_t heap_cap;
  char *norm2; /* normalizer double buffer */
  size_t norm2_cap;
  uint32_t *cps; /* NFC: the segment's code points, decomposed then recomposed */
  size_t cps_cap;
#ifdef LF_HAVE_PCRE2
  pcre2_match_data *md;
#endif
} scratch;

typedef struct heap_e {
  int32_t rank, pos, id;
} heap_e;

static lf_status grow(void **p, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap) return LF_OK;
  size_t c = *cap ? *cap : 16;
  while (c < need)
    c *= 2;
  void *q = realloc(*p, c * elem);
  if (!q) return lf_error(LF_ERR_OUT_OF_MEMORY, "tokenizer: out of memory");
  *p = q;
  *cap = c;
  return LF_OK;
}

static void scratch_free(scratch *s) {
  free(s->buf);
  free(s->pieces);
  free(s->next);
  free(s->marks);
  free(s->is_match);
  free(s->word);
  free(s->sym);
  free(s->prev);
  free(s->nxt);
  free(s->heap);
  free(s->norm2);
  free(s->cps);
#ifdef LF_HAVE_PCRE2
  if (s->md) pcre2_match_data_free(s->md);
#endif
}

static int heap_less(const heap_e *a, const heap_e *b) {
  return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(heap_e *h, size_t *n, heap_e e) {
  size_t i = (*n)++;
  while (i > 0) {
    size_t p = (i - 1) / 2;
    if (!heap_less(&e, &h[p])) break;
    h[i] = h[p];
    i = p;
  }
  h[i] = e;
}

static heap_e heap_pop(heap_e *h, size_t *n) {
  heap_e top = h[0], last = h[--(*n)];
  size_t i = 0;
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= *n) break;
    if (c + 1 < *n && heap_less(&h[c + 1], &h[c])) c++;
    if (!heap_less(&h[c], &last)) break;
    h[i] = h[c];
    i = c;
  }
  if (*n) h[i] = last;
  return top;
}

/* BPE of one word w[0..n) (already byte-level mapped where that applies), appending ids.
 * Follows tokenizers' Word::merge_all: a heap of candidate merges ordered by (rank, position);
 * a popped candidate is stale when its left symbol has since changed or lost its neighbour. */
static lf_status bpe_word(const lf_tokenizer *t, scratch *sc, const char *w, size_t n,
                          lf_token_ids *out) {
  if (n == 0) return LF_OK;
  if (t->ignore_merges) {
    int32_t id = vocab_find(t, w, n);
    if (id >= 0) return ids_push(out, id);
  }
  /* A word of n bytes has at most n symbols (byte fallback never yields more than one per
   * byte); prev/nxt follow sym's capacity. */
  if (n > sc->sym_cap) {
    LF_TRY(grow((void **)&sc->sym, &sc->sym_cap, n, sizeof *sc->sym));
    int32_t *p = realloc(sc->prev, sc->sym_cap * sizeof *p);
    if (!p) return lf_error(LF_ERR_OUT_OF_MEMORY, "tokenizer: out of memory");
    sc->prev = p;
    p = realloc(sc->nxt, sc->sym_cap * sizeof *p);
    if (!p) return lf_error(LF_ERR_OUT_OF_MEMORY, "tokenizer: out of memory");
    sc->nxt = p;
  }
  /* Each merge pushes at most two candidates: n initial + 2n later bounds the heap. */
  LF_TRY(grow((void **)&sc->heap, &sc->heap_cap, 3 * n, sizeof *sc->heap));

  /* Initial symbols: one per character; unknown characters fall back to <0xXX> byte tokens,
   * then to <unk> (consecutive unknowns fused when fuse_unk), else are dropped (as upstream). */
  size_t ns = 0;
  int last_unk = 0;
  for (size_t i = 0; i < n;) {
    int l;
    if (utf8_class((const uint8_t *)w + i, n - i, &l) != U8_OK) l = 1; /* cannot happen */
    int32_t id = vocab_find(t, w + i, (size_t)l);
    if (id >= 0) {
      sc->sym[ns++] = id;
      last_unk = 0;
    } else {
      int ok = t->byte_fallback;
      for (int k = 0; ok && k < l; k++)
        ok = t->byte_id[(uint8_t)w[i + k]] >= 0;
      if (ok) {
        for (int k = 0; k < l; k++)
          sc->sym[ns++] = t->byte_id[(uint8_t)w[i + k]];
        last_unk = 0;
      } else if (t->unk_id >= 0) {
        if (!(t->fuse_unk && last_unk)) sc->sym[ns++] = t->unk_id;
        last_unk = 1;
      }
    }
    i += (size_t)l;
  }
  if (ns == 0) return LF_OK;
  size_t nh = 0;
  for (size_t i = 0; i < ns; i++) {
    sc->prev[i] = (int32_t)i - 1;
    sc->nxt[i] = i + 1 < ns ? (int32_t)i + 1 : -1;
    int32_t rank, id;
    if (i + 1 < ns && merge_find(t, sc->sym[i], sc->sym[i + 1], &rank, &id))
      heap_push(sc->heap, &nh, (heap_e){rank, (int32_t)i, id});
  }
  while (nh) {
    heap_e e = heap_pop(sc->heap, &nh);
    int32_t i = e.pos, j = sc->nxt[i];
    if (sc->sym[i] < 0 || j < 0) continue; /* merged away, or no right neighbour now */
    int32_t rank, id;
    if (!merge_find(t, sc->sym[i], sc->sym[j], &rank, &id) || id != e.id) continue;
    sc->sym[i] = id;
    sc->sym[j] = -1;
    sc->nxt[i] = sc->nxt[j];
    if (sc->nxt[j] >= 0) sc->prev[sc->nxt[j]] = i;
    if (sc->prev[i] >= 0 && merge_find(t, sc->sym[sc->prev[i]], id, &rank, &id))
      heap_push(sc->heap, &nh, (heap_e){rank, sc->prev[i], id});
    if (sc->nxt[i] >= 0 && merge_find(t, sc->sym[i], sc->sym[sc->nxt[i]], &rank, &id))
      heap_push(sc->heap, &nh, (heap_e){rank, i, id});
  }
  for (int32_t i = 0; i >= 0; i = sc->nxt[i])
    LF_TRY(ids_push(out, sc->sym[i]));
  return LF_OK;
}

/* Words of a byte-level tokenizer go through the byte -> unicode table, then BPE. */
static lf_status encode_word(const lf_tokenizer *t, scratch *sc, const char *w, size_t n,
                             lf_token_ids *out) {
  if (!t->byte_level) return bpe_word(t, sc, w, n, out);
  LF_TRY(grow((void **)&sc->word, &sc->word_cap, n * 2 + 1, 1));
  size_t o = 0;
  for (size_t i = 0; i < n; i++) {
    uint8_t b = (uint8_t)w[i];
    memcpy(sc->word + o, t->byte_char[b], t->byte_char_len[b]);
    o += t->byte_char_len[b];
  }
  return bpe_word(t, sc, sc->word, o, out);
}

static lf_status piece_add(span **arr, size_t *n, size_t *cap, size_t off, size_t len) {
  if (len == 0) return LF_OK; /* empty splits are dropped, as upstream does */
  LF_TRY(grow((void **)arr, cap, *n + 1, sizeof **arr));
  (*arr)[(*n)++] = (span){off, len};
  return LF_OK;
}

/* Appends bytes to the segment buffer (pieces index into it by offset, so realloc is safe).
 * s must not point into buf itself, which the growth may move. */
static lf_status buf_append(scratch *sc, const char *s, size_t n, size_t *off) {
  LF_TRY(grow((void **)&sc->buf, &sc->cap, sc->len + n + 1, 1));
  if (off) *off = sc->len;
  memcpy(sc->buf + sc->len, s, n);
  sc->len += n;
  return LF_OK;
}

/* Finds the matches of a Split step in buf[p.off ..+ p.len) and turns matches and the gaps
 * between them into new pieces by the step's behaviour (tokenizers' NormalizedString::split). */
static lf_status split_piece(scratch *sc, const pre_step *st, span p) {
  size_t nm = 0;
  const char *s = sc->buf + p.off;
#define MARK(o, l, m)                                                                              \
  do {                                                                                             \
    LF_TRY(grow((void **)&sc->marks, &sc->cap_marks, nm + 1, sizeof *sc->marks));                  \
    LF_TRY(grow((void **)&sc->is_match, &sc->cap_is_match, nm + 1, sizeof *sc->is_match));         \
    sc->marks[nm] = (span){(o), (l)};                                                              \
    sc->is_match[nm++] = (m);                                                                      \
  } while (0)
  size_t pos = 0, last = 0;
  while (pos <= p.len) {
    size_t ms, me;
    if (st->kind == PRE_DIGITS) {
      while (pos < p.len && !(s[pos] >= '0' && s[pos] <= '9'))
        pos++;
      if (pos >= p.len) break;
      ms = pos;
      me = pos + 1;
      if (!st->individual)
        while (me < p.len && s[me] >= '0' && s[me] <= '9')
          me++;
    } else if (st->lit) {
      const char *f = NULL;
      for (size_t k = pos; k + st->lit_len <= p.len; k++)
        if (memcmp(s + k, st->lit, st->lit_len) == 0) {
          f = s + k;
          break;
        }
      if (!f) break;
      ms = (size_t)(f - s);
      me = ms + st->lit_len;
    } else {
#ifdef LF_HAVE_PCRE2
      int rc = pcre2_match((const pcre2_code *)st->re, (PCRE2_SPTR)s, p.len, pos,
                           PCRE2_NO_UTF_CHECK, sc->md, NULL);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0 && rc != 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        return lf_error(LF_ERR_INTERNAL, "tokenizer: regex match failed: %s", (const char *)msg);
      }
      PCRE2_SIZE *ov = pcre2_get_ovector_pointer(sc->md);
      ms = ov[0];
      me = ov[1];
#else
      return lf_error(LF_ERR_UNAVAILABLE, "tokenizer: built without PCRE2");
#endif
    }
    if (me == ms) { /* an empty match splits nothing; step over one character */
      int l = 1;
      if (ms < p.len) utf8_class((const uint8_t *)s + ms, p.len - ms, &l);
      pos = ms + (size_t)l;
      continue;
    }
    if (ms > last) MARK(last, ms - last, 0);
    MARK(ms, me - ms, 1);
    last = pos = me;
  }
  if (last < p.len) MARK(last, p.len - last, 0);
#undef MARK
  if (st->kind == PRE_SPLIT && st->invert)
    for (size_t i = 0; i < nm; i++)
      sc->is_match[i] = !sc->is_match[i];
  behav b =
      st->kind == PRE_DIGITS ? (st->individual ? BEHAV_ISOLATED : BEHAV_CONTIGUOUS) : st->behavior;
  /* Fold the marks by behaviour, in place, into out[0..k). */
  span *m = sc->marks;
  int *im = sc->is_match;
  size_t k = 0;
  if (b == BEHAV_REMOVED) {
    for (size_t i = 0; i < nm; i++)
      if (!im[i]) m[k++] = m[i];
  } else if (b == BEHAV_ISOLATED) {
    k = nm;
  } else if (b == BEHAV_PREV || b == BEHAV_CONTIGUOUS) {
    int prev_match = 0;
    for (size_t i = 0; i < nm; i++) {
      int join = b == BEHAV_PREV ? (im[i] && !prev_match) : (im[i] == prev_match);
      if (join && k > 0)
        m[k - 1].len = m[i].off + m[i].len - m[k - 1].off;
      else
        m[k++] = m[i];
      prev_match = im[i];
    }
  } else { /* BEHAV_NEXT: the same fold from the right */
    int prev_match = 0;
    size_t w = nm; /* results fill m[w..nm) from the back */
    for (size_t i = nm; i-- > 0;) {
      if (im[i] && !prev_match && w < nm) {
        m[w].len = m[w].off + m[w].len - m[i].off;
        m[w].off = m[i].off;
      } else {
        m[--w] = m[i];
      }
      prev_match = im[i];
    }
    memmove(m, m + w, (nm - w) * sizeof *m);
    k = nm - w;
  }
  for (size_t i = 0; i < k; i++)
    LF_TRY(piece_add(&sc->next, &sc->n_next, &sc->cap_next, p.off + m[i].off, m[i].len));
  return LF_OK;
}

/* Metaspace: spaces become ▁, ▁ prepended by the scheme, then split before each ▁. */
static lf_status metaspace_piece(scratch *sc, const pre_step *st, span p, int first) {
  size_t start = sc->len;
  size_t off;
  int pre = st->prefix_space == 2 || (st->prefix_space == 1 && first);
  /* Upstream replaces spaces first, then prepends unless the piece now starts with ▁. */
  if (pre && !(p.len >= 3 && memcmp(sc->buf + p.off, META, 3) == 0) &&
      !(p.len >= 1 && sc->buf[p.off] == ' '))
    LF_TRY(buf_append(sc, META, 3, &off));
  for (size_t i = 0; i < p.len; i++) {
    char c = sc->buf[p.off + i];
    if (c == ' ')
      LF_TRY(buf_append(sc, META, 3, NULL));
    else
      LF_TRY(buf_append(sc, &c, 1, NULL));
  }
  span q = {start, sc->len - start};
  if (!st->individual) return piece_add(&sc->next, &sc->n_next, &sc->cap_next, q.off, q.len);
  size_t s0 = 0;
  for (size_t i = 3; i + 3 <= q.len; i++)
    if (memcmp(sc->buf + q.off + i, META, 3) == 0) {
      LF_TRY(piece_add(&sc->next, &sc->n_next, &sc->cap_next, q.off + s0, i - s0));
      s0 = i;
      i += 2;
    }
  return piece_add(&sc->next, &sc->n_next, &sc->cap_next, q.off + s0, q.len - s0);
}

/* ---- NFC (Qwen2/Qwen3 normalizer) ---------------------------------------------------------
 * Canonical decomposition, canonical ordering, then canonical composition (UAX #15), with the
 * tables generated from Python's unicodedata. Hangul syllables are algorithmic. */

enum {
  H_SBASE = 0xAC00,
  H_LBASE = 0x1100,
  H_VBASE = 0x1161,
  H_TBASE = 0x11A7,
  H_LCOUNT = 19,
  H_VCOUNT = 21,
  H_TCOUNT = 28,
  H_NCOUNT = 588,
  H_SCOUNT = 11172
};

static int uni_ccc(uint32_t c) {
  if (c < 0x300) return 0;
  size_t lo = 0, hi = sizeof UNI_CCC / sizeof UNI_CCC[0];
  while (lo < hi) {
    size_t m = (lo + hi) / 2;
    if (UNI_CCC[m][0] < c)
      lo = m + 1;
    else
      hi = m;
  }
  return lo < sizeof UNI_CCC / sizeof UNI_CCC[0] && UNI_CCC[lo][0] == c ? (int)UNI_CCC[lo][1] : 0;
}

static const uint32_t *uni_decomp(uint32_t c, uint32_t *len) {
  if (c < 0xC0) return NULL;
  size_t lo = 0, hi = sizeof UNI_DECOMP / sizeof UNI_DECOMP[0];
  while (lo < hi) {
    size_t m = (lo + hi) / 2;
    if (UNI_DECOMP[m][0] < c)
      lo = m + 1;
    else
      hi = m;
  }
  if (lo == sizeof UNI_DECOMP / sizeof UNI_DECOMP[0] || UNI_DECOMP[lo][0] != c) return NULL;
  *len = UNI_DECOMP[lo][2];
  return UNI_DECOMP_CPS + UNI_DECOMP[lo][1];
}

static uint32_t uni_compose(uint32_t a, uint32_t b) {
  if (a >= H_LBASE && a < H_LBASE + H_LCOUNT && b >= H_VBASE && b < H_VBASE + H_VCOUNT)
    return H_SBASE + ((a - H_LBASE) * H_VCOUNT + (b - H_VBASE)) * H_TCOUNT;
  if (a >= H_SBASE && a < H_SBASE + H_SCOUNT && (a - H_SBASE) % H_TCOUNT == 0 && b > H_TBASE &&
      b < H_TBASE + H_TCOUNT)
    return a + (b - H_TBASE);
  size_t lo = 0, hi = sizeof UNI_COMPOSE / sizeof UNI_COMPOSE[0];
  while (lo < hi) {
    size_t m = (lo + hi) / 2;
    if (UNI_COMPOSE[m][0] < a || (UNI_COMPOSE[m][0] == a && UNI_COMPOSE[m][1] < b))
      lo = m + 1;
    else
      hi = m;
  }
  if (lo < sizeof UNI_COMPOSE / sizeof UNI_COMPOSE[0] && UNI_COMPOSE[lo][0] == a &&
      UNI_COMPOSE[lo][1] == b)
    return UNI_COMPOSE[lo][2];
  return 0;
}

/* NFC of sc->buf[0..len), in place. */
static lf_status nfc(scratch *sc) {
  size_t i, n = 0;
  for (i = 0; i < sc->len; i++)
    if ((uint8_t)sc->buf[i] >= 0xCC) break; /* lead bytes of U+0300 and above */
  if (i == sc->len) return LF_OK;           /* nothing below U+0300 changes under NFC */
  /* Decompose. No full canonical decomposition is longer than 18 code points (UAX #15). */
  for (i = 0; i < sc->len;) {
    int l;
    uint32_t c = utf8_cp((const uint8_t *)sc->buf + i, &l), dl;
    i += (size_t)l;
    LF_TRY(grow((void **)&sc->cps, &sc->cps_cap, n + 19, sizeof *sc->cps));
    const uint32_t *d;
    if (c >= H_SBASE && c < H_SBASE + H_SCOUNT) {
      uint32_t s = c - H_SBASE;
      sc->cps[n++] = H_LBASE + s / H_NCOUNT;
      sc->cps[n++] = H_VBASE + (s % H_NCOUNT) / H_TCOUNT;
      if (s % H_TCOUNT) sc->cps[n++] = H_TBASE + s % H_TCOUNT;
    } else if ((d = uni_decomp(c, &dl))) {
      for (uint32_t k = 0; k < dl; k++)
        sc->cps[n++] = d[k];
    } else {
      sc->cps[n++] = c;
    }
  }
  /* Canonical ordering: stable insertion sort of each run of non-starters by class. */
  uint32_t *cp = sc->cps;
  for (i = 1; i < n; i++) {
    int cc = uni_ccc(cp[i]);
    if (cc == 0) continue;
    size_t j = i;
    uint32_t x = cp[i];
    while (j > 0 && uni_ccc(cp[j - 1]) > cc) {
      cp[j] = cp[j - 1];
      j--;
    }
    cp[j] = x;
  }
  /* Compose: a character joins the last starter unless a character of the same or higher class
   * (or a starter) stands between them. */
  size_t starter = 0, o = 1;
  int last = uni_ccc(cp[0]) ? 256 : 0;
  for (i = 1; i < n; i++) {
    uint32_t c = cp[i];
    int cc = uni_ccc(c);
    uint32_t comp = uni_compose(cp[starter], c);
    if (comp && (last < cc || last == 0)) {
      cp[starter] = comp;
      continue;
    }
    if (cc == 0) starter = o;
    last = cc;
    cp[o++] = c;
  }
  /* Re-encode: NFC never makes UTF-8 longer than the decomposed form had code points * 4. */
  LF_TRY(grow((void **)&sc->buf, &sc->cap, o * 4 + 1, 1));
  size_t b = 0;
  for (i = 0; i < o; i++)
    b += (size_t)utf8_put(cp[i], sc->buf + b);
  sc->len = b;
  return LF_OK;
}

/* Normalizes text[0..n) into sc->buf[0..len). */
static lf_status normalize(const lf_tokenizer *t, scratch *sc, const char *text, size_t n) {
  sc->len = 0;
  LF_TRY(buf_append(sc, text, n, NULL));
  for (int i = 0; i < t->n_norm; i++) {
    const norm_step *st = &t->norm[i];
    if (st->kind == NORM_NFC) {
      LF_TRY(nfc(sc));
      continue;
    }
    if (st->kind == NORM_PREPEND) {
      if (sc->len == 0) continue; /* upstream prepends to non-empty strings only */
      LF_TRY(grow((void **)&sc->buf, &sc->cap, sc->len + st->a_len + 1, 1));
      memmove(sc->buf + st->a_len, sc->buf, sc->len);
      memcpy(sc->buf, st->a, st->a_len);
      sc->len += st->a_len;
      continue;
    }
    /* NORM_REPLACE: rebuild into norm2, then swap. */
    size_t o = 0, pos = 0;
    for (;;) {
      size_t ms, me;
      if (st->a) {
        const char *f = NULL;
        for (size_t k = pos; k + st->a_len <= sc->len; k++)
          if (memcmp(sc->buf + k, st->a, st->a_len) == 0) {
            f = sc->buf + k;
            break;
          }
        if (!f) break;
        ms = (size_t)(f - sc->buf);
        me = ms + st->a_len;
      } else {
#ifdef LF_HAVE_PCRE2
        int rc = pcre2_match((const pcre2_code *)st->re, (PCRE2_SPTR)sc->buf, sc->len, pos,
                             PCRE2_NO_UTF_CHECK, sc->md, NULL);
        if (rc < 0) break;
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(sc->md);
        ms = ov[0];
        me = ov[1];
        if (me == ms) {
          if (ms >= sc->len) break;
          int l;
          utf8_class((const uint8_t *)sc->buf + ms, sc->len - ms, &l);
          me = ms; /* keep text; only advance the search */
          LF_TRY(grow((void **)&sc->norm2, &sc->norm2_cap, o + (ms + l - pos) + 1, 1));
          memcpy(sc->norm2 + o, sc->buf + pos, ms + l - pos);
          o += ms + l - pos;
          pos = ms + l;
          continue;
        }
#else
        return lf_error(LF_ERR_UNAVAILABLE, "tokenizer: built without PCRE2");
#endif
      }
      LF_TRY(grow((void **)&sc->norm2, &sc->norm2_cap, o + (ms - pos) + st->b_len + 1, 1));
      memcpy(sc->norm2 + o, sc->buf + pos, ms - pos);
      o += ms - pos;
      memcpy(sc->norm2 + o, st->b, st->b_len);
      o += st->b_len;
      pos = me;
    }
    LF_TRY(grow((void **)&sc->norm2, &sc->norm2_cap, o + (sc->len - pos) + 1, 1));
    memcpy(sc->norm2 + o, sc->buf + pos, sc->len - pos);
    o += sc->len - pos;
    char *tmp = sc->buf;
    size_t tcap = sc->cap;
    sc->buf = sc->norm2;
    sc->cap = sc->norm2_cap;
    sc->norm2 = tmp;
    sc->norm2_cap = tcap;
    sc->len = o;
  }
  return LF_OK;
}

/* One segment of text between added tokens: normalize, pre-tokenize, BPE each word. */
static lf_status encode_segment(const lf_tokenizer *t, scratch *sc, const char *text, size_t n,
                                int first, lf_token_ids *out) {
  LF_TRY(normalize(t, sc, text, n));
  sc->n_pieces = 0;
  LF_TRY(piece_add(&sc->pieces, &sc->n_pieces, &sc->cap_pieces, 0, sc->len));
  for (int i = 0; i < t->n_pre; i++) {
    const pre_step *st = &t->pre[i];
    sc->n_next = 0;
    for (size_t j = 0; j < sc->n_pieces; j++) {
      span p = sc->pieces[j];
      if (st->kind == PRE_BYTELEVEL) {
        if (st->prefix_space && sc->buf[p.off] != ' ') {
          /* Copy the piece behind a space at the end of buf (grown first: the copy reads buf). */
          LF_TRY(grow((void **)&sc->buf, &sc->cap, sc->len + p.len + 2, 1));
          size_t off = sc->len;
          sc->buf[off] = ' ';
          memcpy(sc->buf + off + 1, sc->buf + p.off, p.len);
          sc->len += p.len + 1;
          p = (span){off, p.len + 1};
        }
        if (st->re)
          LF_TRY(split_piece(sc, st, p));
        else
          LF_TRY(piece_add(&sc->next, &sc->n_next, &sc->cap_next, p.off, p.len));
      } else if (st->kind == PRE_METASPACE) {
        LF_TRY(metaspace_piece(sc, st, p, first && j == 0));
      } else {
        LF_TRY(split_piece(sc, st, p));
      }
    }
    span *tmp = sc->pieces;
    size_t tcap = sc->cap_pieces;
    sc->pieces = sc->next;
    sc->cap_pieces = sc->cap_next;
    sc->n_pieces = sc->n_next;
    sc->next = tmp;
    sc->cap_next = tcap;
  }
  for (size_t j = 0; j < sc->n_pieces; j++)
    LF_TRY(encode_word(t, sc, sc->buf + sc->pieces[j].off, sc->pieces[j].len, out));
  return LF_OK;
}

static int is_word_cp(uint32_t c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
         (c >= 0x80 && !cp_is_space(c));
}

/* The last code point before s[i] (valid UTF-8), or 0 at the start. */
static uint32_t cp_before(const char *s, size_t i, size_t *start) {
  if (i == 0) return *start = 0, 0;
  size_t j = i - 1;
  while (j > 0 && ((uint8_t)s[j] & 0xC0) == 0x80)
    j--;
  int l;
  *start = j;
  return utf8_cp((const uint8_t *)s + j, &l);
}

/* 1 when [b, e) overlaps one of the sorted ranges plain[0..n_plain). */
static int in_plain(const lf_text_range *plain, size_t n_plain, size_t b, size_t e) {
  size_t lo = 0, hi = n_plain; /* the first range ending after b */
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (plain[mid].end <= b)
      lo = mid + 1;
    else
      hi = mid;
  }
  while (lo < n_plain && plain[lo].begin == plain[lo].end) /* empty ranges cover nothing */
    lo++;
  return lo < n_plain && plain[lo].begin < e;
}

/* Leftmost-longest added-token match at or after *from; 0 when none. Special tokens are not
 * matched under LF_TOK_PLAIN_SPECIAL, nor where they touch a plain range. */
static int find_added(const lf_tokenizer *t, const char *s, size_t n, size_t from, unsigned flags,
                      const lf_text_range *plain, size_t n_plain, size_t *ms, size_t *me,
                      int32_t *id) {
  for (size_t i = from; i < n; i++) {
    uint8_t c = (uint8_t)s[i];
    for (uint32_t k = t->added_first[c]; k < t->added_first[c + 1]; k++) {
      const added_tok *a = &t->added[k];
      if (a->len > n - i || memcmp(s + i, a->s, a->len) != 0) continue;
      if (a->special && (flags & LF_TOK_PLAIN_SPECIAL)) continue;
      if (a->special && n_plain && in_plain(plain, n_plain, i, i + a->len)) continue;
      size_t b = i, e = i + a->len, st;
      if (a->single_word) {
        int l;
        uint32_t before = cp_before(s, b, &st);
        uint32_t after = e < n ? utf8_cp((const uint8_t *)s + e, &l) : 0;
        if ((b > 0 && is_word_cp(before)) || (e < n && is_word_cp(after))) continue;
      }
      if (a->lstrip)
        while (b > from) {
          uint32_t c0 = cp_before(s, b, &st);
          if (!cp_is_space(c0)) break;
          b = st;
        }
      if (a->rstrip)
        while (e < n) {
          int l;
          uint32_t c1 = utf8_cp((const uint8_t *)s + e, &l);
          if (!cp_is_space(c1)) break;
          e += (size_t)l;
        }
      *ms = b;
      *me = e;
      *id = a->id;
      return 1;
    }
  }
  return 0;
}

lf_status lf_tokenizer_encode(const lf_tokenizer *t, const char *text, size_t len, unsigned flags,
                              lf_token_ids *out) {
  return lf_tokenizer_encode_ranges(t, text, len, flags, NULL, 0, out);
}

lf_status lf_tokenizer_encode_ranges(const lf_tokenizer *t, const char *text, size_t len,
                                     unsigned flags, const lf_text_range *plain, size_t n_plain,
                                     lf_token_ids *out) {
  if (!t || (!text && len) || !out || (!plain && n_plain))
    return lf_error(LF_ERR_INVALID_ARG, "lf_tokenizer_encode: NULL argument");
  for (size_t i = 0; i < n_plain; i++)
    if (plain[i].begin > plain[i].end || plain[i].end > len ||
        (i > 0 && plain[i].begin < plain[i - 1].end))
      return lf_error(LF_ERR_INVALID_ARG,
                      "lf_tokenizer_encode_ranges: range %zu [%zu, %zu) is out of order or "
                      "beyond the text (%zu bytes)",
                      i, plain[i].begin, plain[i].end, len);
  size_t bad;
  if (len && !utf8_valid(text, len, &bad))
    return lf_error(LF_ERR_INVALID_ARG, "lf_tokenizer_encode: invalid UTF-8 at byte %zu", bad);
  out->n = 0;
  lf_status st = LF_OK;
  scratch sc;
  memset(&sc, 0, sizeof sc);
#ifdef LF_HAVE_PCRE2
  /* One ovector pair suffices: only the whole match is used. */
  if (!(sc.md = pcre2_match_data_create(1, NULL)))
    return lf_error(LF_ERR_OUT_OF_MEMORY, "tokenizer: out of memory");
#endif
  if (flags & LF_TOK_ADD_SPECIAL)
    for (int i = 0; i < t->n_prefix && st == LF_OK; i++)
      st = ids_push(out, t->prefix[i]);
  size_t pos = 0;
  int first = 1;
  while (st == LF_OK && pos < len) {
    size_t ms = len, me = len;
    int32_t id = -1;
    find_added(t, text, len, pos, flags, plain, n_plain, &ms, &me, &id);
    if (ms > pos) st = encode_segment(t, &sc, text + pos, ms - pos, first, out);
    if (st == LF_OK && id >= 0) st = ids_push(out, id);
    first = 0;
    pos = me;
  }
  if (flags & LF_TOK_ADD_SPECIAL)
    for (int i = 0; i < t->n_suffix && st == LF_OK; i++)
      st = ids_push(out, t->suffix[i]);
  scratch_free(&sc);
  return st;
}

/* ---- decode ------------------------------------------------------------------------------ */

/* Appends bytes to out, first dropping up to *strip leading spaces (the Strip decoder). */
static lf_status emit(lf_tok_text *out, int *strip, const char *s, size_t n) {
  while (*strip > 0 && n > 0 && s[0] == ' ') {
    s++;
    n--;
    (*strip)--;
  }
  if (n > 0) *strip = 0;
  return text_append(out, s, n);
}

/* Converts b[0..n) like from_utf8_lossy, returning how many bytes were consumed: when !final a
 * trailing unfinished character is left unconsumed for the next call. */
static lf_status lossy(lf_tok_text *out, int *strip, const uint8_t *b, size_t n, int final,
                       size_t *used) {
  size_t i = 0, run = 0; /* b[run..i) is valid text not yet emitted */
  while (i < n) {
    int l, c = utf8_class(b + i, n - i, &l);
    if (c == U8_OK) {
      i += (size_t)l;
      continue;
    }
    if (c == U8_SHORT && !final) break;
    LF_TRY(emit(out, strip, (const char *)b + run, i - run));
    LF_TRY(emit(out, strip, FFFD, 3));
    i += (size_t)l;
    run = i;
  }
  LF_TRY(emit(out, strip, (const char *)b + run, i - run));
  *used = i;
  return LF_OK;
}

static int skip_id(const lf_tokenizer *t, int32_t id, unsigned flags) {
  return (flags & LF_TOK_SKIP_SPECIAL) && (t->id_flags[id] & ID_SPECIAL);
}

/* A token's text; the Metaspace decoder drops the first token's leading space. */
static void token_text(const lf_tokenizer *t, int32_t id, int first, const char **s, size_t *n) {
  *s = t->piece[id];
  *n = t->piece_len[id];
  if (first && t->dec_meta_first && *n && (*s)[0] == ' ') {
    (*s)++;
    (*n)--;
  }
}

lf_status lf_tokenizer_decode(const lf_tokenizer *t, const int32_t *ids, size_t n, unsigned flags,
                              lf_tok_text *out) {
  if (!t || (!ids && n) || !out)
    return lf_error(LF_ERR_INVALID_ARG, "lf_tokenizer_decode: NULL argument");
  LF_TRY(text_clear(out));
  for (size_t i = 0; i < n; i++)
    if (ids[i] < 0 || ids[i] >= t->n_ids || !t->tok_str[ids[i]])
      return lf_error(LF_ERR_INVALID_ARG, "lf_tokenizer_decode: unknown id %d at %zu", ids[i], i);
  int strip = t->dec_strip;
  if (t->dec_bytelevel) {
    /* Concatenate every token's bytes, then one lossy conversion, as upstream. */
    lf_tok_text raw = {0};
    lf_status st = LF_OK;
    for (size_t i = 0; i < n && st == LF_OK; i++)
      if (!skip_id(t, ids[i], flags))
        st = text_append(&raw, t->piece[ids[i]], t->piece_len[ids[i]]);
    size_t used;
    if (st == LF_OK && raw.len) st = lossy(out, &strip, (uint8_t *)raw.data, raw.len, 1, &used);
    lf_tok_text_free(&raw);
    return st;
  }
  /* Text tokens; runs of <0xXX> tokens become their bytes when those form valid UTF-8, else one
   * U+FFFD per byte (tokenizers' ByteFallback decoder). */
  uint8_t run[64];
  size_t nrun = 0, run_total = 0;
  lf_tok_text big = {0}; /* a run longer than run[] spills here */
  int first = 1;
  lf_status st = LF_OK;
  for (size_t i = 0; i <= n && st == LF_OK; i++) {
    int32_t id = i < n ? ids[i] : -1;
    if (id >= 0 && skip_id(t, id, flags)) continue;
    if (id >= 0 && t->piece_byte[id] >= 0) {
      if (nrun == sizeof run) {
        st = text_append(&big, run, nrun);
        nrun = 0;
      }
      run[nrun++] = (uint8_t)t->piece_byte[id];
      run_total++;
      first = 0;
      continue;
    }
    if (run_total) {
      if (st == LF_OK) st = text_append(&big, run, nrun);
      if (st == LF_OK) {
        if (utf8_valid(big.data, big.len, NULL)) {
          st = emit(out, &strip, big.data, big.len);
        } else {
          for (size_t k = 0; k < run_total && st == LF_OK; k++)
            st = emit(out, &strip, FFFD, 3);
        }
      }
      big.len = 0;
      nrun = run_total = 0;
    }
    if (id >= 0 && st == LF_OK) {
      const char *s;
      size_t len;
      token_text(t, id, first, &s, &len);
      st = emit(out, &strip, s, len);
      first = 0;
    }
  }
  lf_tok_text_free(&big);
  return st;
}

lf_status lf_tok_stream_init(lf_tok_stream *s, const lf_tokenizer *t, unsigned flags) {
  if (!s || !t) return lf_error(LF_ERR_INVALID_ARG, "lf_tok_stream_init: NULL argument");
  memset(s, 0, sizeof *s);
  s->tok = t;
  s->flags = flags;
  s->at_start = t->dec_strip;
  s->first_token = 1;
  return LF_OK;
}

void lf_tok_stream_free(lf_tok_stream *s) {
  if (s) memset(s, 0, sizeof *s);
}

/* Emits the pending fallback bytes as replacement characters: a run that cannot complete. */
static lf_status stream_drop_pending(lf_tok_stream *s, lf_tok_text *out) {
  for (int k = 0; k < s->npending; k++)
    LF_TRY(emit(out, &s->at_start, FFFD, 3));
  s->npending = 0;
  return LF_OK;
}

lf_status lf_tok_stream_put(lf_tok_stream *s, int32_t id, lf_tok_text *out) {
  if (!s || !s->tok || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_tok_stream_put: bad args");
  const lf_tokenizer *t = s->tok;
  if (id < 0 || id >= t->n_ids || !t->tok_str[id])
    return lf_error(LF_ERR_INVALID_ARG, "lf_tok_stream_put: unknown id %d", id);
  if (!out->data) LF_TRY(text_clear(out));
  if (skip_id(t, id, s->flags)) return LF_OK;
  if (t->dec_bytelevel) {
    /* pending (< 4 bytes of an unfinished character) + this token, converted; whatever is
     * still unfinished at the end waits for the next token. */
    size_t n = (size_t)s->npending + t->piece_len[id];
    uint8_t small[64];
    uint8_t *b = n <= sizeof small ? small : malloc(n);
    if (!b) return lf_error(LF_ERR_OUT_OF_MEMORY, "tokenizer: out of memory");
    memcpy(b, s->pending, (size_t)s->npending);
    memcpy(b + s->npending, t->piece[id], t->piece_len[id]);
    size_t used;
    lf_status st = lossy(out, &s->at_start, b, n, 0, &used);
    if (st == LF_OK) {
      s->npending = (int)(n - used);
      memcpy(s->pending, b + used, n - used);
    }
    if (b != small) free(b);
    return st;
  }
  if (t->piece_byte[id] >= 0) {
    s->pending[s->npending++] = (uint8_t)t->piece_byte[id];
    s->first_token = 0;
    int l, c = utf8_class(s->pending, (size_t)s->npending, &l);
    if (c == U8_OK) { /* a whole character: emit it now rather than at the run's end */
      LF_TRY(emit(out, &s->at_start, (const char *)s->pending, (size_t)s->npending));
      s->npending = 0;
    } else if (c == U8_BAD) {
      LF_TRY(stream_drop_pending(s, out));
    }
    return LF_OK;
  }
  LF_TRY(stream_drop_pending(s, out));
  const char *p;
  size_t n;
  token_text(t, id, s->first_token, &p, &n);
  s->first_token = 0;
  return emit(out, &s->at_start, p, n);
}

lf_status lf_tok_stream_flush(lf_tok_stream *s, lf_tok_text *out) {
  if (!s || !s->tok || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_tok_stream_flush: bad args");
  if (!out->data) LF_TRY(text_clear(out));
  if (s->tok->dec_bytelevel) {
    size_t used;
    LF_TRY(lossy(out, &s->at_start, s->pending, (size_t)s->npending, 1, &used));
    s->npending = 0;
    return LF_OK;
  }
  return stream_drop_pending(s, out);
}

/* The tokenizer's internals, shared by its files (private to text/):
 *
 *   tokenizer_load.c    tokenizer.json's model (vocabulary, merges, added tokens), the per-id
 *                       decode pieces, lifetime and lookups
 *   tokenizer_config.c  the pipeline around the model: normalizer, pre-tokenizer, decoder,
 *                       post-processor
 *   tokenizer_pretok.c  encode before BPE: normalizing, NFC, pre-tokenizing a segment into words
 *   tokenizer_encode.c  encode: added tokens, BPE, the post-processor's template
 *   tokenizer_decode.c  decode and streaming decode
 *   tokenizer_util.c    buffers, UTF-8, hashing, vocabulary lookup
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
#ifndef LF_TEXT_TOKENIZER_INTERNAL_H
#define LF_TEXT_TOKENIZER_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "text/json.h"
#include "text/tokenizer.h"

#ifdef LF_HAVE_PCRE2
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#endif

/* ---- the tokenizer (loaded once, then read-only) ------------------------------------------ */

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

/* ---- encode's per-call scratch -------------------------------------------------------------- */

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

/* ---- tokenizer_util.c ------------------------------------------------------------------------ */

lf_status tok_ids_push(lf_token_ids *v, int32_t id);
lf_status tok_text_append(lf_tok_text *t, const void *s, size_t n);
lf_status tok_text_clear(lf_tok_text *t);

enum { U8_OK = 0, U8_BAD, U8_SHORT };
/* Classifies the character starting at b[0..n): U8_OK with its length; U8_BAD with the length of
 * the maximal valid subpart to replace by one U+FFFD (the Unicode "substitution of maximal
 * subparts" practice that Rust's from_utf8_lossy, and so `tokenizers`, follow); U8_SHORT when
 * b is a valid but unfinished prefix (*len bytes). */
int tok_utf8_class(const uint8_t *b, size_t n, int *len);
/* Decodes one code point of valid UTF-8 (the caller validated it). */
uint32_t tok_utf8_cp(const uint8_t *b, int *len);
/* Encodes cp into o (up to 4 bytes); returns the length. */
int tok_utf8_put(uint32_t cp, char *o);
/* 1 when s[0..n) is valid UTF-8, else 0 with *bad_at the first bad byte. */
int tok_utf8_valid(const char *s, size_t n, size_t *bad_at);
extern const char TOK_FFFD[3]; /* U+FFFD, the replacement character */
extern const char TOK_META[3]; /* U+2581 ▁, Metaspace's space */

uint64_t tok_hash_bytes(const char *s, size_t n);
uint64_t tok_hash_u64(uint64_t x);
/* The model-vocabulary id of s[0..n), or -1. */
int32_t tok_vocab_find(const lf_tokenizer *t, const char *s, size_t n);

/* ---- tokenizer_load.c / tokenizer_config.c --------------------------------------------------- */

/* A copy of s[0..n) (NUL-terminated) in t's string storage, freed with t; NULL when out of
 * memory. */
char *tok_arena_dup(lf_tokenizer *t, const char *s, size_t n);
/* The "type" string of a tokenizer.json component, or NULL. */
const char *tok_type_of(const lf_json *v);
/* The pipeline components; a JSON null is none. */
lf_status tok_load_normalizer(lf_tokenizer *t, const lf_json *n);
lf_status tok_load_pre_tokenizer(lf_tokenizer *t, const lf_json *p);
lf_status tok_load_decoder(lf_tokenizer *t, const lf_json *d);
lf_status tok_load_post_processor(lf_tokenizer *t, const lf_json *p);

/* ---- tokenizer_pretok.c ---------------------------------------------------------------------- */

/* Grows *p (of *cap elements of elem bytes) to hold at least need. */
lf_status tok_grow(void **p, size_t *cap, size_t need, size_t elem);
lf_status tok_piece_add(span **arr, size_t *n, size_t *cap, size_t off, size_t len);
/* Normalizes text[0..n) into sc->buf[0..len). */
lf_status tok_normalize(const lf_tokenizer *t, scratch *sc, const char *text, size_t n);
/* One pre-tokenizer step over the piece p of sc->buf, appending the resulting pieces to
 * sc->next: a Split (or ByteLevel's regex), or Metaspace (first: p starts the segment). */
lf_status tok_split_piece(scratch *sc, const pre_step *st, span p);
lf_status tok_metaspace_piece(scratch *sc, const pre_step *st, span p, int first);

#endif

/* Decode and streaming decode: a walk over the per-id pieces precomputed at load, with
 * from_utf8_lossy's replacement of invalid bytes; the stream holds back an unfinished character
 * until the token that completes it (text/tokenizer_internal.h). */
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "text/tokenizer_internal.h"

/* Appends bytes to out, first dropping up to *strip leading spaces (the Strip decoder). */
static lf_status emit(lf_tok_text *out, int *strip, const char *s, size_t n) {
  while (*strip > 0 && n > 0 && s[0] == ' ') {
    s++;
    n--;
    (*strip)--;
  }
  if (n > 0) *strip = 0;
  return tok_text_append(out, s, n);
}

/* Converts b[0..n) like from_utf8_lossy, returning how many bytes were consumed: when !final a
 * trailing unfinished character is left unconsumed for the next call. */
static lf_status lossy(lf_tok_text *out, int *strip, const uint8_t *b, size_t n, int final,
                       size_t *used) {
  size_t i = 0, run = 0; /* b[run..i) is valid text not yet emitted */
  while (i < n) {
    int l, c = tok_utf8_class(b + i, n - i, &l);
    if (c == U8_OK) {
      i += (size_t)l;
      continue;
    }
    if (c == U8_SHORT && !final) break;
    LF_TRY(emit(out, strip, (const char *)b + run, i - run));
    LF_TRY(emit(out, strip, TOK_FFFD, 3));
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
  LF_TRY(tok_text_clear(out));
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
        st = tok_text_append(&raw, t->piece[ids[i]], t->piece_len[ids[i]]);
    size_t used;
    if (st == LF_OK && raw.len) st = lossy(out, &strip, (uint8_t *)raw.data, raw.len, 1, &used);
    lf_tok_text_free(&raw);
    return st;
  }
  /* Text tokens; runs of <0xXX> tokens become their bytes when those form valid UTF-8, else one
   * U+TOK_FFFD per byte (tokenizers' ByteFallback decoder). */
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
        st = tok_text_append(&big, run, nrun);
        nrun = 0;
      }
      run[nrun++] = (uint8_t)t->piece_byte[id];
      run_total++;
      first = 0;
      continue;
    }
    if (run_total) {
      if (st == LF_OK) st = tok_text_append(&big, run, nrun);
      if (st == LF_OK) {
        if (tok_utf8_valid(big.data, big.len, NULL)) {
          st = emit(out, &strip, big.data, big.len);
        } else {
          for (size_t k = 0; k < run_total && st == LF_OK; k++)
            st = emit(out, &strip, TOK_FFFD, 3);
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
    LF_TRY(emit(out, &s->at_start, TOK_FFFD, 3));
  s->npending = 0;
  return LF_OK;
}

lf_status lf_tok_stream_put(lf_tok_stream *s, int32_t id, lf_tok_text *out) {
  if (!s || !s->tok || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_tok_stream_put: bad args");
  const lf_tokenizer *t = s->tok;
  if (id < 0 || id >= t->n_ids || !t->tok_str[id])
    return lf_error(LF_ERR_INVALID_ARG, "lf_tok_stream_put: unknown id %d", id);
  if (!out->data) LF_TRY(tok_text_clear(out));
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
    int l, c = tok_utf8_class(s->pending, (size_t)s->npending, &l);
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
  if (!out->data) LF_TRY(tok_text_clear(out));
  if (s->tok->dec_bytelevel) {
    size_t used;
    LF_TRY(lossy(out, &s->at_start, s->pending, (size_t)s->npending, 1, &used));
    s->npending = 0;
    return LF_OK;
  }
  return stream_drop_pending(s, out);
}

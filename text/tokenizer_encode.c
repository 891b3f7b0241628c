/* Encode: added tokens split the text into segments; each segment is normalized and
 * pre-tokenized (tokenizer_pretok.c), and every word goes through BPE; the post-processor's
 * template adds its ids around the result (text/tokenizer_internal.h). */
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "text/tokenizer_internal.h"

/* Rust's char::is_whitespace (the White_Space property), for added-token lstrip/rstrip. */
static int cp_is_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

static int merge_find(const lf_tokenizer *t, int32_t a, int32_t b, int32_t *rank, int32_t *id) {
  if (!t->merge_key) return 0;
  uint64_t k = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
  size_t h = tok_hash_u64(k) & t->merge_mask;
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
    int32_t id = tok_vocab_find(t, w, n);
    if (id >= 0) return tok_ids_push(out, id);
  }
  /* A word of n bytes has at most n symbols (byte fallback never yields more than one per
   * byte); prev/nxt follow sym's capacity. */
  if (n > sc->sym_cap) {
    LF_TRY(tok_grow((void **)&sc->sym, &sc->sym_cap, n, sizeof *sc->sym));
    int32_t *p = realloc(sc->prev, sc->sym_cap * sizeof *p);
    if (!p) return lf_error(LF_ERR_OUT_OF_MEMORY, "tokenizer: out of memory");
    sc->prev = p;
    p = realloc(sc->nxt, sc->sym_cap * sizeof *p);
    if (!p) return lf_error(LF_ERR_OUT_OF_MEMORY, "tokenizer: out of memory");
    sc->nxt = p;
  }
  /* Each merge pushes at most two candidates: n initial + 2n later bounds the heap. */
  LF_TRY(tok_grow((void **)&sc->heap, &sc->heap_cap, 3 * n, sizeof *sc->heap));

  /* Initial symbols: one per character; unknown characters fall back to <0xXX> byte tokens,
   * then to <unk> (consecutive unknowns fused when fuse_unk), else are dropped (as upstream). */
  size_t ns = 0;
  int last_unk = 0;
  for (size_t i = 0; i < n;) {
    int l;
    if (tok_utf8_class((const uint8_t *)w + i, n - i, &l) != U8_OK) l = 1; /* cannot happen */
    int32_t id = tok_vocab_find(t, w + i, (size_t)l);
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
    LF_TRY(tok_ids_push(out, sc->sym[i]));
  return LF_OK;
}

/* Words of a byte-level tokenizer go through the byte -> unicode table, then BPE. */
static lf_status encode_word(const lf_tokenizer *t, scratch *sc, const char *w, size_t n,
                             lf_token_ids *out) {
  if (!t->byte_level) return bpe_word(t, sc, w, n, out);
  LF_TRY(tok_grow((void **)&sc->word, &sc->word_cap, n * 2 + 1, 1));
  size_t o = 0;
  for (size_t i = 0; i < n; i++) {
    uint8_t b = (uint8_t)w[i];
    memcpy(sc->word + o, t->byte_char[b], t->byte_char_len[b]);
    o += t->byte_char_len[b];
  }
  return bpe_word(t, sc, sc->word, o, out);
}

/* One segment of text between added tokens: tok_normalize, pre-tokenize, BPE each word. */
static lf_status encode_segment(const lf_tokenizer *t, scratch *sc, const char *text, size_t n,
                                int first, lf_token_ids *out) {
  LF_TRY(tok_normalize(t, sc, text, n));
  sc->n_pieces = 0;
  LF_TRY(tok_piece_add(&sc->pieces, &sc->n_pieces, &sc->cap_pieces, 0, sc->len));
  for (int i = 0; i < t->n_pre; i++) {
    const pre_step *st = &t->pre[i];
    sc->n_next = 0;
    for (size_t j = 0; j < sc->n_pieces; j++) {
      span p = sc->pieces[j];
      if (st->kind == PRE_BYTELEVEL) {
        if (st->prefix_space && sc->buf[p.off] != ' ') {
          /* Copy the piece behind a space at the end of buf (grown first: the copy reads buf). */
          LF_TRY(tok_grow((void **)&sc->buf, &sc->cap, sc->len + p.len + 2, 1));
          size_t off = sc->len;
          sc->buf[off] = ' ';
          memcpy(sc->buf + off + 1, sc->buf + p.off, p.len);
          sc->len += p.len + 1;
          p = (span){off, p.len + 1};
        }
        if (st->re)
          LF_TRY(tok_split_piece(sc, st, p));
        else
          LF_TRY(tok_piece_add(&sc->next, &sc->n_next, &sc->cap_next, p.off, p.len));
      } else if (st->kind == PRE_METASPACE) {
        LF_TRY(tok_metaspace_piece(sc, st, p, first && j == 0));
      } else {
        LF_TRY(tok_split_piece(sc, st, p));
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
  return tok_utf8_cp((const uint8_t *)s + j, &l);
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
        uint32_t after = e < n ? tok_utf8_cp((const uint8_t *)s + e, &l) : 0;
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
          uint32_t c1 = tok_utf8_cp((const uint8_t *)s + e, &l);
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
  if (len && !tok_utf8_valid(text, len, &bad))
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
      st = tok_ids_push(out, t->prefix[i]);
  size_t pos = 0;
  int first = 1;
  while (st == LF_OK && pos < len) {
    size_t ms = len, me = len;
    int32_t id = -1;
    find_added(t, text, len, pos, flags, plain, n_plain, &ms, &me, &id);
    if (ms > pos) st = encode_segment(t, &sc, text + pos, ms - pos, first, out);
    if (st == LF_OK && id >= 0) st = tok_ids_push(out, id);
    first = 0;
    pos = me;
  }
  if (flags & LF_TOK_ADD_SPECIAL)
    for (int i = 0; i < t->n_suffix && st == LF_OK; i++)
      st = tok_ids_push(out, t->suffix[i]);
  scratch_free(&sc);
  return st;
}

/* Encode's steps before BPE: the normalizers (Prepend, Replace, NFC) and the pre-tokenizers
 * (Split, ByteLevel's regex, Digits, Metaspace) that cut a segment into words
 * (text/tokenizer_internal.h). */
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "text/tokenizer_internal.h"
#include "text/tokenizer_unicode.h"

lf_status tok_grow(void **p, size_t *cap, size_t need, size_t elem) {
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

lf_status tok_piece_add(span **arr, size_t *n, size_t *cap, size_t off, size_t len) {
  if (len == 0) return LF_OK; /* empty splits are dropped, as upstream does */
  LF_TRY(tok_grow((void **)arr, cap, *n + 1, sizeof **arr));
  (*arr)[(*n)++] = (span){off, len};
  return LF_OK;
}

/* Appends bytes to the segment buffer (pieces index into it by offset, so realloc is safe).
 * s must not point into buf itself, which the growth may move. */
static lf_status buf_append(scratch *sc, const char *s, size_t n, size_t *off) {
  LF_TRY(tok_grow((void **)&sc->buf, &sc->cap, sc->len + n + 1, 1));
  if (off) *off = sc->len;
  memcpy(sc->buf + sc->len, s, n);
  sc->len += n;
  return LF_OK;
}

/* Finds the matches of a Split step in buf[p.off ..+ p.len) and turns matches and the gaps
 * between them into new pieces by the step's behaviour (tokenizers' NormalizedString::split). */
lf_status tok_split_piece(scratch *sc, const pre_step *st, span p) {
  size_t nm = 0;
  const char *s = sc->buf + p.off;
#define MARK(o, l, m)                                                                              \
  do {                                                                                             \
    LF_TRY(tok_grow((void **)&sc->marks, &sc->cap_marks, nm + 1, sizeof *sc->marks));              \
    LF_TRY(tok_grow((void **)&sc->is_match, &sc->cap_is_match, nm + 1, sizeof *sc->is_match));     \
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
      if (ms < p.len) tok_utf8_class((const uint8_t *)s + ms, p.len - ms, &l);
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
    LF_TRY(tok_piece_add(&sc->next, &sc->n_next, &sc->cap_next, p.off + m[i].off, m[i].len));
  return LF_OK;
}

/* Metaspace: spaces become ▁, ▁ prepended by the scheme, then split before each ▁. */
lf_status tok_metaspace_piece(scratch *sc, const pre_step *st, span p, int first) {
  size_t start = sc->len;
  size_t off;
  int pre = st->prefix_space == 2 || (st->prefix_space == 1 && first);
  /* Upstream replaces spaces first, then prepends unless the piece now starts with ▁. */
  if (pre && !(p.len >= 3 && memcmp(sc->buf + p.off, TOK_META, 3) == 0) &&
      !(p.len >= 1 && sc->buf[p.off] == ' '))
    LF_TRY(buf_append(sc, TOK_META, 3, &off));
  for (size_t i = 0; i < p.len; i++) {
    char c = sc->buf[p.off + i];
    if (c == ' ')
      LF_TRY(buf_append(sc, TOK_META, 3, NULL));
    else
      LF_TRY(buf_append(sc, &c, 1, NULL));
  }
  span q = {start, sc->len - start};
  if (!st->individual) return tok_piece_add(&sc->next, &sc->n_next, &sc->cap_next, q.off, q.len);
  size_t s0 = 0;
  for (size_t i = 3; i + 3 <= q.len; i++)
    if (memcmp(sc->buf + q.off + i, TOK_META, 3) == 0) {
      LF_TRY(tok_piece_add(&sc->next, &sc->n_next, &sc->cap_next, q.off + s0, i - s0));
      s0 = i;
      i += 2;
    }
  return tok_piece_add(&sc->next, &sc->n_next, &sc->cap_next, q.off + s0, q.len - s0);
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

#define N_ROWS(tab) (sizeof(tab) / sizeof((tab)[0]))

/* The first of the n rows of tab (rows of `width` code points, sorted by their first n_keys) that
 * is not below key[0..n_keys): a binary search. */
static size_t row_lower_bound(const uint32_t *tab, size_t n, size_t width, const uint32_t *key,
                              int n_keys) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    const size_t m = (lo + hi) / 2;
    const uint32_t *r = tab + m * width;
    int below = 0;
    for (int k = 0; k < n_keys; k++)
      if (r[k] != key[k]) {
        below = r[k] < key[k];
        break;
      }
    if (below)
      lo = m + 1;
    else
      hi = m;
  }
  return lo;
}

static int uni_ccc(uint32_t c) {
  if (c < 0x300) return 0;
  const size_t i = row_lower_bound(UNI_CCC[0], N_ROWS(UNI_CCC), 2, &c, 1);
  return i < N_ROWS(UNI_CCC) && UNI_CCC[i][0] == c ? (int)UNI_CCC[i][1] : 0;
}

static const uint32_t *uni_decomp(uint32_t c, uint32_t *len) {
  if (c < 0xC0) return NULL;
  const size_t i = row_lower_bound(UNI_DECOMP[0], N_ROWS(UNI_DECOMP), 3, &c, 1);
  if (i == N_ROWS(UNI_DECOMP) || UNI_DECOMP[i][0] != c) return NULL;
  *len = UNI_DECOMP[i][2];
  return UNI_DECOMP_CPS + UNI_DECOMP[i][1];
}

static uint32_t uni_compose(uint32_t a, uint32_t b) {
  if (a >= H_LBASE && a < H_LBASE + H_LCOUNT && b >= H_VBASE && b < H_VBASE + H_VCOUNT)
    return H_SBASE + ((a - H_LBASE) * H_VCOUNT + (b - H_VBASE)) * H_TCOUNT;
  if (a >= H_SBASE && a < H_SBASE + H_SCOUNT && (a - H_SBASE) % H_TCOUNT == 0 && b > H_TBASE &&
      b < H_TBASE + H_TCOUNT)
    return a + (b - H_TBASE);
  const uint32_t key[2] = {a, b};
  const size_t i = row_lower_bound(UNI_COMPOSE[0], N_ROWS(UNI_COMPOSE), 3, key, 2);
  if (i < N_ROWS(UNI_COMPOSE) && UNI_COMPOSE[i][0] == a && UNI_COMPOSE[i][1] == b)
    return UNI_COMPOSE[i][2];
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
    uint32_t c = tok_utf8_cp((const uint8_t *)sc->buf + i, &l), dl;
    i += (size_t)l;
    LF_TRY(tok_grow((void **)&sc->cps, &sc->cps_cap, n + 19, sizeof *sc->cps));
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
  LF_TRY(tok_grow((void **)&sc->buf, &sc->cap, o * 4 + 1, 1));
  size_t b = 0;
  for (i = 0; i < o; i++)
    b += (size_t)tok_utf8_put(cp[i], sc->buf + b);
  sc->len = b;
  return LF_OK;
}

/* Normalizes text[0..n) into sc->buf[0..len). */
lf_status tok_normalize(const lf_tokenizer *t, scratch *sc, const char *text, size_t n) {
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
      LF_TRY(tok_grow((void **)&sc->buf, &sc->cap, sc->len + st->a_len + 1, 1));
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
          tok_utf8_class((const uint8_t *)sc->buf + ms, sc->len - ms, &l);
          me = ms; /* keep text; only advance the search */
          LF_TRY(tok_grow((void **)&sc->norm2, &sc->norm2_cap, o + (ms + l - pos) + 1, 1));
          memcpy(sc->norm2 + o, sc->buf + pos, ms + l - pos);
          o += ms + l - pos;
          pos = ms + l;
          continue;
        }
#else
        return lf_error(LF_ERR_UNAVAILABLE, "tokenizer: built without PCRE2");
#endif
      }
      LF_TRY(tok_grow((void **)&sc->norm2, &sc->norm2_cap, o + (ms - pos) + st->b_len + 1, 1));
      memcpy(sc->norm2 + o, sc->buf + pos, ms - pos);
      o += ms - pos;
      memcpy(sc->norm2 + o, st->b, st->b_len);
      o += st->b_len;
      pos = me;
    }
    LF_TRY(tok_grow((void **)&sc->norm2, &sc->norm2_cap, o + (sc->len - pos) + 1, 1));
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

/* Loading a tokenizer.json: the BPE model (vocabulary, merges, added tokens), the per-id decode
 * pieces, and the tokenizer's lifetime and lookups (text/tokenizer_internal.h). The pipeline
 * around the model is loaded by tokenizer_config.c. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "text/json.h"
#include "text/tokenizer_internal.h"

static size_t pow2_at_least(size_t n) {
  size_t c = 16;
  while (c < n)
    c *= 2;
  return c;
}

/* GPT-2's byte <-> unicode table: printable bytes map to themselves, the rest to U+0100.. in
 * order, so every byte is a visible character and BPE never sees control bytes or spaces. */
static void byte_level_table(uint32_t cp_of_byte[256]) {
  int n = 0;
  for (int b = 0; b < 256; b++) {
    int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    cp_of_byte[b] = printable ? (uint32_t)b : (uint32_t)(256 + n++);
  }
}

char *tok_arena_dup(lf_tokenizer *t, const char *s, size_t n) {
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

static int added_cmp(const void *a, const void *b) {
  const added_tok *x = a, *y = b;
  uint8_t cx = (uint8_t)x->s[0], cy = (uint8_t)y->s[0];
  if (cx != cy) return cx < cy ? -1 : 1;
  if (x->len != y->len) return x->len > y->len ? -1 : 1;
  return x->id < y->id ? -1 : x->id > y->id;
}

/* The id space (the largest id of vocab and added tokens), the per-id tables and the vocab's
 * hash table. */
static lf_status load_vocab(lf_tokenizer *t, const lf_json *vocab, const lf_json *added) {
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
    if (tok_vocab_find(t, key, len) >= 0)
      return lf_error(LF_ERR_FORMAT, "tokenizer.json: token \"%s\" appears twice in the vocab",
                      key);
    if (!(t->model_str[id] = tok_arena_dup(t, key, len)))
      return lf_error(LF_ERR_OUT_OF_MEMORY, "out of memory");
    t->model_len[id] = (uint32_t)len;
    t->tok_str[id] = t->model_str[id];
    size_t h = tok_hash_bytes(key, len) & t->vocab_mask;
    while (t->vocab_tab[h] >= 0)
      h = (h + 1) & t->vocab_mask;
    t->vocab_tab[h] = (int32_t)id;
  }

  return LF_OK;
}

/* The merges' hash table: (left id, right id) -> rank (its position) and the merged id. */
static lf_status load_merges(lf_tokenizer *t, const lf_json *merges) {
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
    int32_t ia = tok_vocab_find(t, a, al), ib = tok_vocab_find(t, b, bl);
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
    int32_t in = tok_vocab_find(t, cat, al + bl);
    if (ia < 0 || ib < 0 || in < 0) {
      st = lf_error(LF_ERR_FORMAT,
                    "tokenizer.json: merges[%zu] uses a token missing from the "
                    "vocab (%.*s + %.*s)",
                    i, (int)al, a, (int)bl, b);
      break;
    }
    uint64_t k = ((uint64_t)(uint32_t)ia << 32) | (uint32_t)ib;
    size_t h = tok_hash_u64(k) & t->merge_mask;
    while (t->merge_key[h] != UINT64_MAX && t->merge_key[h] != k)
      h = (h + 1) & t->merge_mask;
    if (t->merge_key[h] == k) continue; /* a repeated merge keeps its first (lowest) rank */
    t->merge_key[h] = k;
    t->merge_rank[h] = (int32_t)i;
    t->merge_new[h] = in;
  }
  free(cat);
  return st;
}

/* Added tokens, sorted for the matcher, with the first index per leading byte. */
static lf_status load_added(lf_tokenizer *t, const lf_json *added) {
  int64_t id;
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
    if (!(x->s = tok_arena_dup(t, c, len))) return lf_error(LF_ERR_OUT_OF_MEMORY, "out of memory");
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

static lf_status load_model(lf_tokenizer *t, const lf_json *m, const lf_json *added) {
  const char *ty = tok_type_of(m);
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

  LF_TRY(load_vocab(t, vocab, added));
  LF_TRY(load_merges(t, merges));
  t->unk_id = -1;
  size_t ul;
  const char *unk = lf_json_str(lf_json_get(m, "unk_token"), &ul);
  if (unk) t->unk_id = tok_vocab_find(t, unk, ul);
  for (int b = 0; b < 256; b++) {
    char nm8[8];
    snprintf(nm8, sizeof nm8, "<0x%02X>", b);
    t->byte_id[b] = tok_vocab_find(t, nm8, 6);
  }

  return load_added(t, added);
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
        uint32_t cp = tok_utf8_cp((const uint8_t *)s + i, &l);
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
        if (i + 3 <= len && memcmp(s + i, TOK_META, 3) == 0) {
          buf[o++] = ' ';
          i += 3;
        } else {
          buf[o++] = s[i++];
        }
      }
    }
    if (!(t->piece[id] = tok_arena_dup(t, buf, o))) {
      free(buf);
      return lf_error(LF_ERR_OUT_OF_MEMORY, "out of memory");
    }
    t->piece_len[id] = (uint32_t)o;
  }
  free(buf);
  for (int b = 0; b < 256; b++) {
    char c[4];
    int l = tok_utf8_put(cp_of_byte[b], c); /* code points < U+0144: at most 2 bytes */
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
  if (st == LF_OK) st = tok_load_normalizer(t, lf_json_get(root, "normalizer"));
  if (st == LF_OK) st = tok_load_pre_tokenizer(t, lf_json_get(root, "pre_tokenizer"));
  if (st == LF_OK) st = tok_load_decoder(t, lf_json_get(root, "decoder"));
  if (st == LF_OK) st = tok_load_post_processor(t, lf_json_get(root, "post_processor"));
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
  return tok_vocab_find(t, token, n);
}

int lf_tokenizer_is_special(const lf_tokenizer *t, int32_t id) {
  return t && id >= 0 && id < t->n_ids && (t->id_flags[id] & ID_SPECIAL);
}

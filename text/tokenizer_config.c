/* Loading the tokenizer.json pipeline around the model: normalizer, pre-tokenizer, decoder and
 * post-processor (text/tokenizer_internal.h). Each is a component or a Sequence of them; only the
 * kinds and options the supported models use are accepted, anything else is LF_ERR_UNSUPPORTED. */
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "text/json.h"
#include "text/tokenizer_internal.h"

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

const char *tok_type_of(const lf_json *v) {
  return lf_json_str(lf_json_get(v, "type"), NULL);
}

static int str_is(const lf_json *v, const char *s) {
  const char *x = lf_json_str(v, NULL);
  return x && strcmp(x, s) == 0;
}

/* A copy of the string member key of v in t's storage; LF_ERR_FORMAT with "tokenizer.json:
 * <missing>" when there is none. */
static lf_status dup_member(lf_tokenizer *t, const lf_json *v, const char *key, const char *missing,
                            char **out, size_t *len) {
  const char *s = lf_json_str(lf_json_get(v, key), len);
  if (!s) return lf_error(LF_ERR_FORMAT, "tokenizer.json: %s", missing);
  if (!(*out = tok_arena_dup(t, s, *len))) return lf_error(LF_ERR_OUT_OF_MEMORY, "out of memory");
  return LF_OK;
}

/* The common head of the pipeline components. A JSON null is none; a Sequence loads each item of
 * its list `list_key` with load (the list must be an array when list_required, else a missing one
 * is empty). Either way *ty is NULL and the component is done. Otherwise *ty is the component's
 * type, for the caller to load. */
static lf_status load_component(lf_tokenizer *t, const lf_json *v, const char *what,
                                const char *list_key, int list_required,
                                lf_status (*load)(lf_tokenizer *, const lf_json *),
                                const char **ty) {
  *ty = NULL;
  if (lf_json_typeof(v) == LF_JSON_NULL) return LF_OK;
  const char *type = tok_type_of(v);
  if (!type) return lf_error(LF_ERR_FORMAT, "tokenizer.json: %s without a type", what);
  if (strcmp(type, "Sequence") != 0) {
    *ty = type;
    return LF_OK;
  }
  const lf_json *list = lf_json_get(v, list_key);
  if (list_required && lf_json_typeof(list) != LF_JSON_ARRAY)
    return lf_error(LF_ERR_FORMAT, "tokenizer.json: Sequence %s without a list", what);
  for (size_t i = 0; i < lf_json_len(list); i++)
    LF_TRY(load(t, lf_json_at(list, i)));
  return LF_OK;
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
    if (!(*lit = tok_arena_dup(t, s, n))) return lf_error(LF_ERR_OUT_OF_MEMORY, "out of memory");
    *lit_len = n;
    return LF_OK;
  }
  return lf_error(LF_ERR_FORMAT, "tokenizer.json: %s: pattern is neither String nor Regex", what);
}

lf_status tok_load_normalizer(lf_tokenizer *t, const lf_json *n) {
  const char *ty;
  LF_TRY(load_component(t, n, "normalizer", "normalizers", 1, tok_load_normalizer, &ty));
  if (!ty) return LF_OK;
  if (t->n_norm == MAX_NORM)
    return lf_error(LF_ERR_UNSUPPORTED, "tokenizer.json: more than %d normalizers", MAX_NORM);
  norm_step *st = &t->norm[t->n_norm];
  memset(st, 0, sizeof *st);
  if (strcmp(ty, "Prepend") == 0) {
    st->kind = NORM_PREPEND;
    LF_TRY(dup_member(t, n, "prepend", "Prepend without a string", &st->a, &st->a_len));
  } else if (strcmp(ty, "Replace") == 0) {
    st->kind = NORM_REPLACE;
    LF_TRY(dup_member(t, n, "content", "Replace without content", &st->b, &st->b_len));
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

lf_status tok_load_pre_tokenizer(lf_tokenizer *t, const lf_json *p) {
  if (t->byte_level && lf_json_typeof(p) != LF_JSON_NULL && tok_type_of(p))
    return lf_error(LF_ERR_UNSUPPORTED,
                    "tokenizer.json: a pre-tokenizer after ByteLevel is not supported");
  const char *ty;
  LF_TRY(load_component(t, p, "pre_tokenizer", "pretokenizers", 1, tok_load_pre_tokenizer, &ty));
  if (!ty) return LF_OK;
  pre_step *st = NULL;
  int b;
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
    if (!rep || n != 3 || memcmp(rep, TOK_META, 3) != 0)
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

lf_status tok_load_decoder(lf_tokenizer *t, const lf_json *d) {
  const char *ty;
  LF_TRY(load_component(t, d, "decoder", "decoders", 1, tok_load_decoder, &ty));
  if (!ty) return LF_OK;
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
    if (!ps || !cs || pn != 3 || memcmp(ps, TOK_META, 3) != 0 || cn != 1 || cs[0] != ' ')
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

lf_status tok_load_post_processor(lf_tokenizer *t, const lf_json *p) {
  const char *ty;
  LF_TRY(load_component(t, p, "post_processor", "processors", 0, tok_load_post_processor, &ty));
  if (!ty) return LF_OK;
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

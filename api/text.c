/* The public version, memory and text calls (include/lfserve.h, "Version" and "Text"): thin wrappers over the model's tokenizer
 * and chat template (engine/model_text.c, text/), with ids and strings in plain C arrays so that
 * embedding code and foreign-function interfaces (python/lfserve) need no internal struct. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "engine/model_text.h"
#include "text/tokenizer.h"

#define LF_STR2(x) #x
#define LF_STR(x) LF_STR2(x)

const char *lf_version(void) {
  return LF_STR(LFSERVE_VERSION_MAJOR) "." LF_STR(LFSERVE_VERSION_MINOR) "." LF_STR(
      LFSERVE_VERSION_PATCH);
}

void lf_free(void *p) { free(p); }

size_t lf_abi_sizeof(const char *type_name) {
  static const struct {
    const char *name;
    size_t size;
  } sizes[] = {
      {"lf_engine_config", sizeof(lf_engine_config)}, {"lf_request", sizeof(lf_request)},
      {"lf_event", sizeof(lf_event)},                 {"lf_model_info", sizeof(lf_model_info)},
      {"lf_request_stats", sizeof(lf_request_stats)}, {"lf_sampling", sizeof(lf_sampling)},
      {"lf_chat_message", sizeof(lf_chat_message)},   {"lf_metrics", sizeof(lf_metrics)},
      {"lf_logit_bias", sizeof(lf_logit_bias)},       {"lf_pool_sizing", sizeof(lf_pool_sizing)},
      {"lf_resolved_config", sizeof(lf_resolved_config)},
  };
  if (!type_name) return 0;
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
    if (!strcmp(type_name, sizes[i].name)) return sizes[i].size;
  return 0;
}

lf_status lf_tokenizer_open(const char *model_path, lf_tokenizer **out) {
  if (!model_path || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_tokenizer_open: NULL argument");
  *out = NULL;
  char why[512] = "";
  LF_TRY(lf_model_tokenizer_open(model_path, out, why, sizeof why));
  if (!*out) return lf_error(LF_ERR_UNSUPPORTED, "no tokenizer: %s", why);
  return LF_OK;
}

/* Hands v's ids to the caller (*ids NULL when empty); v is left empty. */
static lf_status give_ids(lf_token_ids *v, int32_t **ids, int *n) {
  if (v->n > INT_MAX) {
    lf_token_ids_free(v);
    return lf_error(LF_ERR_INVALID_ARG, "the text has more than INT_MAX tokens");
  }
  *n = (int)v->n;
  *ids = v->n ? v->ids : NULL;
  if (!v->n) lf_token_ids_free(v);
  *v = (lf_token_ids){0};
  return LF_OK;
}

lf_status lf_tokenize(const lf_tokenizer *t, const char *text, int add_special, int32_t **ids,
                      int *n) {
  if (!t || !text || !ids || !n) return lf_error(LF_ERR_INVALID_ARG, "lf_tokenize: NULL argument");
  *ids = NULL;
  *n = 0;
  lf_token_ids v = {0};
  const lf_status s =
      lf_tokenizer_encode(t, text, strlen(text), add_special ? LF_TOK_ADD_SPECIAL : 0, &v);
  if (s != LF_OK) {
    lf_token_ids_free(&v);
    return s;
  }
  return give_ids(&v, ids, n);
}

lf_status lf_tokenize_chat(const lf_tokenizer *t, const char *model_path, const char *chat_format,
                           const lf_chat_message *msgs, int n_msgs, int32_t **ids, int *n) {
  if (!t || !model_path || !ids || !n || (!msgs && n_msgs))
    return lf_error(LF_ERR_INVALID_ARG, "lf_tokenize_chat: NULL argument");
  *ids = NULL;
  *n = 0;
  if (n_msgs < 1) return lf_error(LF_ERR_INVALID_ARG, "lf_tokenize_chat: no messages");
  for (int i = 0; i < n_msgs; i++)
    if (!msgs[i].role || !msgs[i].content)
      return lf_error(LF_ERR_INVALID_ARG, "lf_tokenize_chat: message %d has a NULL role or content",
                      i);
  lf_chat_template *tmpl = NULL;
  LF_TRY(lf_model_chat_template_open_as(model_path, chat_format, &tmpl));
  lf_token_ids v = {0};
  const lf_status s = lf_chat_encode(tmpl, t, msgs, (size_t)n_msgs, 1, 0, &v);
  lf_chat_template_free(tmpl);
  if (s != LF_OK) {
    lf_token_ids_free(&v);
    return s;
  }
  return give_ids(&v, ids, n);
}

lf_status lf_detokenize(const lf_tokenizer *t, const int32_t *ids, int n, char **text) {
  if (!t || !text || (!ids && n) || n < 0)
    return lf_error(LF_ERR_INVALID_ARG, "lf_detokenize: NULL argument or negative count");
  *text = NULL;
  lf_tok_text out = {0};
  lf_status s = lf_tok_text_clear(&out);
  if (s == LF_OK && n) s = lf_tokenizer_decode(t, ids, (size_t)n, LF_TOK_SKIP_SPECIAL, &out);
  if (s != LF_OK) {
    lf_tok_text_free(&out);
    return s;
  }
  *text = out.data;
  return LF_OK;
}

struct lf_detokenizer {
  lf_tok_stream stream;
  lf_tok_text piece; /* what the last put / flush produced */
};

lf_status lf_detokenizer_init(const lf_tokenizer *t, lf_detokenizer **out) {
  if (!t || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_detokenizer_init: NULL argument");
  *out = NULL;
  lf_detokenizer *d = calloc(1, sizeof *d);
  if (!d) return lf_error(LF_ERR_OUT_OF_MEMORY, "lf_detokenizer_init: out of memory");
  lf_status s = lf_tok_stream_init(&d->stream, t, LF_TOK_SKIP_SPECIAL);
  if (s != LF_OK) {
    free(d);
    return s;
  }
  s = lf_tok_text_clear(&d->piece);
  if (s != LF_OK) {
    lf_detokenizer_free(d);
    return s;
  }
  *out = d;
  return LF_OK;
}

lf_status lf_detokenizer_put(lf_detokenizer *d, int32_t token, const char **text, size_t *len) {
  if (!d || !text || !len) return lf_error(LF_ERR_INVALID_ARG, "lf_detokenizer_put: NULL argument");
  *text = "";
  *len = 0;
  LF_TRY(lf_tok_text_clear(&d->piece));
  LF_TRY(lf_tok_stream_put(&d->stream, token, &d->piece));
  *text = d->piece.data;
  *len = d->piece.len;
  return LF_OK;
}

lf_status lf_detokenizer_flush(lf_detokenizer *d, const char **text, size_t *len) {
  if (!d || !text || !len)
    return lf_error(LF_ERR_INVALID_ARG, "lf_detokenizer_flush: NULL argument");
  *text = "";
  *len = 0;
  LF_TRY(lf_tok_text_clear(&d->piece));
  LF_TRY(lf_tok_stream_flush(&d->stream, &d->piece));
  const lf_tokenizer *t = d->stream.tok;
  lf_tok_stream_free(&d->stream);
  LF_TRY(lf_tok_stream_init(&d->stream, t, LF_TOK_SKIP_SPECIAL));
  *text = d->piece.data;
  *len = d->piece.len;
  return LF_OK;
}

void lf_detokenizer_free(lf_detokenizer *d) {
  if (!d) return;
  lf_tok_stream_free(&d->stream);
  lf_tok_text_free(&d->piece);
  free(d);
}

/* OpenAI-style request bodies -> engine requests. See http_request.h.
 *
 * The body is parsed and its members are read by http_body.c (cJSON, with the RFC 8259 rules it
 * does not enforce put back).
 */
#include "http_request.h"

#include <cJSON.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "launch/http_body.h"
#include "text/utf8.h"

void lfs_error_set(lfs_error *e, int status, const char *type, const char *code, const char *param,
                   const char *fmt, ...) {
  e->status = status;
  e->type = type;
  e->code = code;
  snprintf(e->param, sizeof e->param, "%s", param ? param : "");
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(e->message, sizeof e->message, fmt, ap);
  va_end(ap);
}

#define BAD(param, ...)                                                                            \
  do {                                                                                             \
    lfs_error_set(err, 400, "invalid_request_error", "invalid_value", param, __VA_ARGS__);         \
    goto fail;                                                                                     \
  } while (0)
#define BAD_TYPE(param, want)                                                                      \
  do {                                                                                             \
    lfs_error_set(err, 400, "invalid_request_error", "invalid_type", param, "'%s' must be %s",     \
                  param, want);                                                                    \
    goto fail;                                                                                     \
  } while (0)
#define OOM()                                                                                      \
  do {                                                                                             \
    lfs_error_set(err, 500, "server_error", "out_of_memory", NULL, "out of memory");               \
    goto fail;                                                                                     \
  } while (0)

void lfs_request_free(lfs_request *r) {
  free(r->prompt);
  free(r->logit_bias);
  free(r->stop_ids);
  for (int i = 0; i < r->n_stop_seqs; i++)
    free((void *)r->stop_seqs[i].ids);
  free(r->stop_seqs);
  for (int i = 0; i < r->n_stop_strs; i++)
    free(r->stop_strs[i].s);
  free(r->stop_strs);
  memset(r, 0, sizeof *r);
}

/* A token-id array -> ids (each an exact integer in [0, vocab)). */
static int read_ids(const lfs_model_ctx *m, const cJSON *arr, const char *param, int32_t **out,
                    int *n, lfs_error *err) {
  size_t len = lfs_json_count(arr);
  if (len > (size_t)m->max_seq_len + 1 || len > 0x7fffffff) {
    lfs_error_set(err, 400, "invalid_request_error", "context_length_exceeded", param,
                  "'%s' has %zu token ids; the model's context is %d", param, len, m->max_seq_len);
    return -1;
  }
  int32_t *ids = malloc(sizeof(int32_t) * (len ? len : 1));
  if (!ids) {
    lfs_error_set(err, 500, "server_error", "out_of_memory", NULL, "out of memory");
    return -1;
  }
  size_t i = 0;
  const cJSON *it;
  cJSON_ArrayForEach(it, arr) {
    int64_t x;
    if (!lfs_json_int(it, &x) || x < 0 || x >= m->vocab_size) {
      lfs_error_set(err, 400, "invalid_request_error", "invalid_token_id", param,
                    "'%s'[%zu] is not a token id in [0, %d)", param, i, m->vocab_size);
      free(ids);
      return -1;
    }
    ids[i++] = (int32_t)x;
  }
  *out = ids;
  *n = (int)len;
  return 0;
}

static int is_id_array(const cJSON *v) {
  if (!cJSON_IsArray(v)) return 0;
  const cJSON *it;
  cJSON_ArrayForEach(it, v) {
    if (!cJSON_IsNumber(it)) return 0;
  }
  return 1;
}

static int encode(const lfs_model_ctx *m, const char *s, size_t n, unsigned flags,
                  const char *param, lf_token_ids *ids, lfs_error *err) {
  if (!m->tok) {
    lfs_error_set(err, 400, "invalid_request_error", "no_tokenizer", param,
                  "the model has no tokenizer.json: give '%s' as token ids", param);
    return -1;
  }
  lf_status s2 = lf_tokenizer_encode(m->tok, s, n, flags, ids);
  if (s2 != LF_OK) {
    if (s2 == LF_ERR_OUT_OF_MEMORY)
      lfs_error_set(err, 500, "server_error", "out_of_memory", NULL, "out of memory");
    else
      lfs_error_set(err, 400, "invalid_request_error", "invalid_value", param,
                    "'%s' could not be tokenized: %s", param, lf_last_error());
    return -1;
  }
  return 0;
}

static int add_stop_seq(lfs_request *r, int32_t *ids, int n) {
  lf_stop_seq *p = realloc(r->stop_seqs, sizeof *p * (size_t)(r->n_stop_seqs + 1));
  if (!p) return -1;
  r->stop_seqs = p;
  p[r->n_stop_seqs].ids = ids;
  p[r->n_stop_seqs].n_ids = n;
  r->n_stop_seqs++;
  return 0;
}

static int add_stop_id(lfs_request *r, int32_t id) {
  int32_t *p = realloc(r->stop_ids, sizeof *p * (size_t)(r->n_stop_ids + 1));
  if (!p) return -1;
  r->stop_ids = p;
  p[r->n_stop_ids++] = id;
  return 0;
}

static int add_stop_str(lfs_request *r, const char *s, size_t n) {
  lfs_stop_str *p = realloc(r->stop_strs, sizeof *p * (size_t)(r->n_stop_strs + 1));
  if (!p) return -1;
  r->stop_strs = p;
  char *c = malloc(n + 1);
  if (!c) return -1;
  memcpy(c, s, n);
  c[n] = '\0';
  p[r->n_stop_strs].s = c;
  p[r->n_stop_strs].n = n;
  r->n_stop_strs++;
  return 0;
}

/* One entry of "stop": a string (matched on the decoded text; an empty one is ignored), an id,
 * or an id sequence. */
static int read_stop_entry(const lfs_model_ctx *m, const cJSON *v, lfs_request *r, lfs_error *err) {
  int64_t x;
  if (cJSON_IsString(v)) {
    size_t n = 0;
    const char *s = lfs_json_string(v, &n);
    if (n == 0) return 0;
    if (!m->tok) {
      lfs_error_set(err, 400, "invalid_request_error", "no_tokenizer", "stop",
                    "the model has no tokenizer.json: give 'stop' as token ids");
      return -1;
    }
    if (n > LFS_MAX_STOP_BYTES) {
      lfs_error_set(err, 400, "invalid_request_error", "invalid_value", "stop",
                    "a stop string may be at most %d bytes", LFS_MAX_STOP_BYTES);
      return -1;
    }
    if (add_stop_str(r, s, n)) goto oom;
    return 0;
  }
  if (cJSON_IsNumber(v)) {
    if (!lfs_json_int(v, &x) || x < 0 || x >= m->vocab_size) {
      lfs_error_set(err, 400, "invalid_request_error", "invalid_token_id", "stop",
                    "a stop id must be a token id in [0, %d)", m->vocab_size);
      return -1;
    }
    if (add_stop_id(r, (int32_t)x)) goto oom;
    return 0;
  }
  if (is_id_array(v) && lfs_json_count(v) >= 1 && lfs_json_count(v) <= 256) {
    int32_t *ids;
    int n;
    if (read_ids(m, v, "stop", &ids, &n, err)) return -1;
    if (add_stop_seq(r, ids, n)) {
      free(ids);
      goto oom;
    }
    return 0;
  }
  lfs_error_set(err, 400, "invalid_request_error", "invalid_type", "stop",
                "'stop' entries must be strings, token ids or non-empty arrays of at most 256 "
                "token ids");
  return -1;
oom:
  lfs_error_set(err, 500, "server_error", "out_of_memory", NULL, "out of memory");
  return -1;
}

/* messages -> prompt ids through the chat template: its markers are special tokens, the
 * messages' content is plain text unless m->chat_content_special. */
static int read_messages(const lfs_model_ctx *m, const cJSON *msgs, lf_token_ids *ids,
                         lfs_error *err) {
  size_t n = lfs_json_count(msgs);
  lf_chat_message *cm = NULL;
  lf_tok_text *parts = NULL;
  int rc = -1;
  if (!cJSON_IsArray(msgs)) {
    lfs_error_set(err, 400, "invalid_request_error", "invalid_type", "messages",
                  "'messages' must be an array of message objects");
    return -1;
  }
  if (n == 0) {
    lfs_error_set(err, 400, "invalid_request_error", "invalid_value", "messages",
                  "'messages' must not be empty");
    return -1;
  }
  if (n > 4096) {
    lfs_error_set(err, 400, "invalid_request_error", "invalid_value", "messages",
                  "'messages' has %zu entries; at most 4096 are accepted", n);
    return -1;
  }
  if (!m->tok) {
    lfs_error_set(err, 400, "invalid_request_error", "no_chat_template", "messages",
                  "the model has no tokenizer, so chat is off: use /v1/completions with "
                  "token-id prompts");
    return -1;
  }
  if (!m->tmpl) {
    lfs_error_set(err, 400, "invalid_request_error", "no_chat_template", "messages",
                  "the model has no chat template, so chat is off: use /v1/completions, or "
                  "start lfserve with --chat-template chatml|llama3|deepseek-r1");
    return -1;
  }
  cm = calloc(n, sizeof *cm);
  parts = calloc(n, sizeof *parts);
  if (!cm || !parts) {
    lfs_error_set(err, 500, "server_error", "out_of_memory", NULL, "out of memory");
    goto done;
  }
  size_t i = 0;
  const cJSON *msg;
  cJSON_ArrayForEach(msg, msgs) {
    if (!cJSON_IsObject(msg)) {
      lfs_error_set(err, 400, "invalid_request_error", "invalid_type", "messages",
                    "messages[%zu] must be an object", i);
      goto done;
    }
    const char *role = lfs_json_string(lfs_json_member(msg, "role"), NULL);
    if (!role || (strcmp(role, "system") && strcmp(role, "user") && strcmp(role, "assistant") &&
                  strcmp(role, "developer"))) {
      lfs_error_set(err, 400, "invalid_request_error", "invalid_value", "messages",
                    "messages[%zu].role must be \"system\", \"developer\", \"user\" or "
                    "\"assistant\"",
                    i);
      goto done;
    }
    cm[i].role = strcmp(role, "developer") ? role : "system";
    const cJSON *c = lfs_json_member(msg, "content");
    if (cJSON_IsString(c)) {
      size_t len = 0;
      const char *s = lfs_json_string(c, &len);
      if (lf_tok_text_append(&parts[i], s, len) != LF_OK) goto oom;
    } else if (cJSON_IsArray(c)) {
      size_t k = 0;
      const cJSON *p;
      cJSON_ArrayForEach(p, c) {
        const char *type = lfs_json_string(lfs_json_member(p, "type"), NULL);
        size_t len = 0;
        const char *s = lfs_json_string(lfs_json_member(p, "text"), &len);
        if (!type || strcmp(type, "text") || !s) {
          lfs_error_set(err, 400, "invalid_request_error", "invalid_value", "messages",
                        "messages[%zu].content[%zu] must be {\"type\": \"text\", \"text\": ...} "
                        "(only text is supported)",
                        i, k);
          goto done;
        }
        if (lf_tok_text_append(&parts[i], s, len) != LF_OK) goto oom;
        k++;
      }
    } else if (lfs_json_is_null(c) && !strcmp(role, "assistant")) {
      /* an assistant turn without content (null or absent) */
    } else {
      lfs_error_set(err, 400, "invalid_request_error", "invalid_type", "messages",
                    "messages[%zu].content must be a string or an array of text parts", i);
      goto done;
    }
    /* The template API takes NUL-terminated content (parse_body refused any "\u0000"). */
    if (lf_tok_text_append(&parts[i], "", 0) != LF_OK) goto oom;
    cm[i].content = parts[i].data;
    i++;
  }
  lf_status s = lf_chat_encode(m->tmpl, m->tok, cm, n, 1,
                               m->chat_content_special ? LF_CHAT_CONTENT_SPECIAL : 0, ids);
  if (s != LF_OK) {
    if (s == LF_ERR_OUT_OF_MEMORY) goto oom;
    lfs_error_set(err, 400, "invalid_request_error", "invalid_value", "messages",
                  "the chat template or tokenizer refused the messages: %s", lf_last_error());
    goto done;
  }
  rc = 0;
  goto done;
oom:
  lfs_error_set(err, 500, "server_error", "out_of_memory", NULL, "out of memory");
done:
  if (parts)
    for (size_t j = 0; j < n; j++)
      lf_tok_text_free(&parts[j]);
  free(parts);
  free(cm);
  return rc;
}

const char *const lfs_ignored_members[] = {"user", NULL};

/* The members the server acts on (both endpoints, then each one's own). */
static const char *const common_members[] = {
    "model",           "max_tokens",        "temperature",        "top_p",
    "top_k",           "seed",              "stop",               "stop_token_ids",
    "stream",          "stream_options",    "n",                  "ignore_eos",
    "return_token_ids", "presence_penalty", "frequency_penalty",  "repetition_penalty",
    "logit_bias",      "logprobs",          "response_format",    NULL};
static const char *const chat_members[] = {"messages", "max_completion_tokens", "top_logprobs",
                                           NULL};
static const char *const completion_members[] = {"prompt", "echo", "best_of", NULL};

static int in_list(const char *const *l, const char *k) {
  for (; *l; l++)
    if (!strcmp(*l, k)) return 1;
  return 0;
}

/* logit_bias: {"token id": bias}; ids in the vocabulary, each once, biases in [-100, 100]. */
static int read_logit_bias(const lfs_model_ctx *m, const cJSON *v, lfs_request *r,
                           lfs_error *err) {
  if (!cJSON_IsObject(v)) {
    lfs_error_set(err, 400, "invalid_request_error", "invalid_type", "logit_bias",
                  "'logit_bias' must be an object mapping token ids to biases");
    return -1;
  }
  const size_t n = lfs_json_count(v);
  if (n > LFS_MAX_LOGIT_BIAS) {
    lfs_error_set(err, 400, "invalid_request_error", "invalid_value", "logit_bias",
                  "'logit_bias' has %zu entries; at most %d are accepted", n, LFS_MAX_LOGIT_BIAS);
    return -1;
  }
  if (n == 0) return 0;
  r->logit_bias = malloc(sizeof *r->logit_bias * n);
  if (!r->logit_bias) {
    lfs_error_set(err, 500, "server_error", "out_of_memory", NULL, "out of memory");
    return -1;
  }
  int k = 0;
  const cJSON *e;
  cJSON_ArrayForEach(e, v) {
    const char *key = e->string ? e->string : "";
    long long id = -1;
    int digits = 0;
    for (const char *c = key; *c; c++, digits++) {
      if (*c < '0' || *c > '9' || digits >= 10) {
        id = -1;
        break;
      }
      id = (id < 0 ? 0 : id * 10) + (*c - '0');
    }
    if (id < 0 || id >= m->vocab_size) {
      lfs_error_set(err, 400, "invalid_request_error", "invalid_value", "logit_bias",
                    "'logit_bias' key '%.40s' is not a token id in [0, %d)", key, m->vocab_size);
      return -1;
    }
    double b;
    if (!cJSON_IsNumber(e) || !((b = e->valuedouble) >= -LF_LOGIT_BIAS_MAX) ||
        !(b <= LF_LOGIT_BIAS_MAX)) {
      lfs_error_set(err, 400, "invalid_request_error", "invalid_value", "logit_bias",
                    "'logit_bias' of token %lld must be a number in [-100, 100]", id);
      return -1;
    }
    for (int i = 0; i < k; i++)
      if (r->logit_bias[i].token == (int32_t)id) {
        lfs_error_set(err, 400, "invalid_request_error", "invalid_value", "logit_bias",
                      "'logit_bias' lists token %lld twice", id);
        return -1;
      }
    r->logit_bias[k].token = (int32_t)id;
    r->logit_bias[k].bias = (float)b;
    k++;
  }
  r->sampling.logit_bias = r->logit_bias;
  r->sampling.n_logit_bias = k;
  return 0;
}

/* Every member is acted on, or listed as harmless: nothing is silently ignored. (A body without
 * its prompt hears that first.) */
static int check_members(const cJSON *root, int chat, lfs_error *err) {
  for (const cJSON *e = lfs_json_member(root, chat ? "messages" : "prompt") ? root->child : NULL; e;
       e = e->next) {
    const char *k = e->string ? e->string : "";
    if (cJSON_IsNull(e)) continue; /* null: the member is absent, as for the known ones */
    if (in_list(common_members, k) || in_list(chat ? chat_members : completion_members, k) ||
        in_list(lfs_ignored_members, k))
      continue;
    lfs_error_set(err, 400, "invalid_request_error", "unsupported_parameter", k,
                  "'%.100s' is not supported by this server (%s); see docs/USAGE.md", k,
                  chat ? "/v1/chat/completions" : "/v1/completions");
    return -1;
  }
  return 0;
}

/* "model": absent, or the name this server serves (404 otherwise). */
static int read_model(const lfs_model_ctx *m, const cJSON *root, lfs_error *err) {
  const cJSON *v = lfs_json_member(root, "model");
  if (lfs_json_is_null(v)) return 0;
  const char *name = lfs_json_string(v, NULL);
  if (!name) BAD_TYPE("model", "a string");
  if (strcmp(name, m->model_name)) {
    lfs_error_set(err, 404, "invalid_request_error", "model_not_found", "model",
                  "The model '%.200s' does not exist; this server serves '%.100s'", name,
                  m->model_name);
    return -1;
  }
  return 0;
fail:
  return -1;
}

/* One completion (n, best_of), echo, logprobs / top_logprobs, response_format. */
static int read_output_shape(const cJSON *root, int chat, lfs_request *r, lfs_error *err) {
  int64_t x;
  switch (lfs_member_int(root, "n", INT64_MIN, INT64_MAX, &x, err)) {
  case -1:
    goto fail;
  case 1:
    if (x != 1) BAD("n", "'n' must be 1: one completion per request is supported");
  }
  switch (lfs_member_int(root, "best_of", INT64_MIN, INT64_MAX, &x, err)) {
  case -1:
    goto fail;
  case 1:
    if (x != 1) BAD("best_of", "'best_of' must be 1");
  }
  if (!chat && lfs_member_bool(root, "echo", &r->echo, err) < 0) goto fail;
  const cJSON *v = lfs_json_member(root, "logprobs");
  if (chat) {
    if (lfs_member_bool(root, "logprobs", &r->logprobs, err) < 0) goto fail;
    switch (lfs_member_int(root, "top_logprobs", 0, LF_MAX_TOP_LOGPROBS, &x, err)) {
    case -1:
      goto fail;
    case 1:
      if (x > 0 && !r->logprobs) BAD("top_logprobs", "'top_logprobs' needs 'logprobs': true");
      r->top_logprobs = (int)x;
    }
  } else if (!lfs_json_is_null(v) && !cJSON_IsFalse(v)) {
    switch (lfs_member_int(root, "logprobs", 0, LFS_MAX_LOGPROBS_COMPLETION, &x, err)) {
    case -1:
      goto fail;
    case 1:
      r->logprobs = 1;
      r->top_logprobs = (int)x;
    }
  }
  r->sampling.logprobs = r->logprobs;
  r->sampling.top_logprobs = r->top_logprobs;
  r->sampling.prompt_logprobs = r->echo && r->logprobs;
  v = lfs_json_member(root, "response_format");
  if (!lfs_json_is_null(v)) {
    const char *t = cJSON_IsObject(v) ? lfs_json_string(lfs_json_member(v, "type"), NULL) : NULL;
    if (!t || strcmp(t, "text") || lfs_json_count(v) != 1)
      BAD("response_format",
          "'response_format' must be {\"type\": \"text\"}: structured output is not supported");
  }
  return 0;
fail:
  return -1;
}

/* presence_penalty, frequency_penalty, repetition_penalty, logit_bias. */
static int read_penalties(const lfs_model_ctx *m, const cJSON *root, lfs_request *r,
                          lfs_error *err) {
  double d;
  switch (lfs_member_num(root, "presence_penalty", -2, 2, 0, &d, err)) {
  case -1:
    return -1;
  case 1:
    r->sampling.presence_penalty = (float)d;
  }
  switch (lfs_member_num(root, "frequency_penalty", -2, 2, 0, &d, err)) {
  case -1:
    return -1;
  case 1:
    r->sampling.frequency_penalty = (float)d;
  }
  switch (lfs_member_num(root, "repetition_penalty", 0, 100, 1, &d, err)) {
  case -1:
    return -1;
  case 1:
    r->sampling.repetition_penalty = (float)d;
  }
  const cJSON *v = lfs_json_member(root, "logit_bias");
  if (!lfs_json_is_null(v) && read_logit_bias(m, v, r, err)) return -1;
  return 0;
}

/* stream, stream_options, ignore_eos, return_token_ids. */
static int read_flags(const cJSON *root, lfs_request *r, lfs_error *err) {
  if (lfs_member_bool(root, "stream", &r->stream, err) < 0) return -1;
  const cJSON *v = lfs_json_member(root, "stream_options");
  if (!lfs_json_is_null(v)) {
    if (!cJSON_IsObject(v)) BAD_TYPE("stream_options", "an object");
    if (lfs_member_bool(v, "include_usage", &r->include_usage, err) < 0) return -1;
  }
  if (lfs_member_bool(root, "ignore_eos", &r->ignore_eos, err) < 0) return -1;
  if (lfs_member_bool(root, "return_token_ids", &r->return_token_ids, err) < 0) return -1;
  return 0;
fail:
  return -1;
}

/* temperature, top_p, top_k, seed. */
static int read_sampling(const cJSON *root, lfs_request *r, lfs_error *err) {
  int64_t x;
  double d;
  switch (lfs_member_num(root, "temperature", 0, 100, 0, &d, err)) {
  case -1:
    return -1;
  case 1:
    r->sampling.temperature = (float)d;
  }
  switch (lfs_member_num(root, "top_p", 0, 1, 1, &d, err)) {
  case -1:
    return -1;
  case 1:
    r->sampling.top_p = (float)d;
  }
  switch (lfs_member_int(root, "top_k", -1, INT32_MAX, &x, err)) {
  case -1:
    return -1;
  case 1:
    r->sampling.top_k = x < 0 ? 0 : (int)x;
  }
  switch (lfs_member_int(root, "seed", INT64_MIN, INT64_MAX, &x, err)) {
  case -1:
    return -1;
  case 1:
    r->sampling.seed = (uint64_t)x;
  }
  return 0;
}

/* The prompt (chat: "messages" rendered with the chat template; else "prompt": text or token
 * ids) into r->prompt, within the model's context. */
static int read_prompt(const lfs_model_ctx *m, const cJSON *root, int chat, lfs_request *r,
                       lfs_error *err) {
  lf_token_ids ids = {0};
  if (chat) {
    if (!lfs_json_member(root, "messages")) {
      lfs_error_set(err, 400, "invalid_request_error", "missing_required_parameter", "messages",
                    "'messages' is required");
      goto fail;
    }
    /* The rendered template carries its own BOS and special markers. */
    if (read_messages(m, lfs_json_member(root, "messages"), &ids, err)) goto fail;
  } else {
    const cJSON *v = lfs_json_member(root, "prompt");
    if (!v) {
      lfs_error_set(err, 400, "invalid_request_error", "missing_required_parameter", "prompt",
                    "'prompt' is required");
      goto fail;
    }
    /* A batch of exactly one prompt is the same as that prompt. */
    if (cJSON_IsArray(v) && v->child && (cJSON_IsString(v->child) || cJSON_IsArray(v->child))) {
      if (v->child->next) BAD("prompt", "one prompt per request is supported");
      v = v->child;
    }
    if (cJSON_IsString(v)) {
      size_t n = 0;
      const char *s = lfs_json_string(v, &n);
      if (n == 0) BAD("prompt", "'prompt' must not be empty");
      if (encode(m, s, n, LF_TOK_ADD_SPECIAL, "prompt", &ids, err)) goto fail;
    } else if (cJSON_IsArray(v)) {
      if (!is_id_array(v)) BAD_TYPE("prompt", "a string or an array of token ids");
      int32_t *p;
      int n;
      if (read_ids(m, v, "prompt", &p, &n, err)) goto fail;
      ids.ids = p;
      ids.n = ids.cap = (size_t)n;
    } else {
      BAD_TYPE("prompt", "a string or an array of token ids");
    }
  }
  if (ids.n == 0) BAD(chat ? "messages" : "prompt", "the prompt is empty");
  if (ids.n > (size_t)m->max_seq_len) {
    lfs_error_set(
        err, 400, "invalid_request_error", "context_length_exceeded", chat ? "messages" : "prompt",
        "the prompt has %zu tokens; the model's context is %d tokens", ids.n, m->max_seq_len);
    goto fail;
  }
  r->prompt = ids.ids;
  r->n_prompt = (int)ids.n;
  return 0;
fail:
  lf_token_ids_free(&ids);
  return -1;
}

/* max_tokens (chat: or max_completion_tokens) within what the prompt leaves. Under `full`
 * nothing is ever evicted: prompt and output must fit the pool. Otherwise the model's context is
 * the limit (LongFlow's pool holds a bounded window of it). Without one: all that is left (chat)
 * or 16 (completions), as OpenAI's defaults. */
static int read_max_tokens(const lfs_model_ctx *m, const cJSON *root, int chat, lfs_request *r,
                           lfs_error *err) {
  const int full = m->policy == LF_POLICY_FULL;
  const int limit = full && m->budget < m->max_seq_len ? m->budget : m->max_seq_len;
  if (r->n_prompt > limit) {
    lfs_error_set(err, 400, "invalid_request_error", "context_length_exceeded",
                  chat ? "messages" : "prompt",
                  "the prompt has %d tokens; at most %d fit (the KV budget under the full policy)",
                  r->n_prompt, limit);
    return -1;
  }
  const int room = limit - r->n_prompt + 1; /* the last token is sampled, never stored */
  int have = 0;
  int64_t x;
  const char *mt_key = "max_tokens";
  switch (lfs_member_int(root, "max_tokens", INT64_MIN, INT64_MAX, &x, err)) {
  case -1:
    return -1;
  case 1:
    have = 1;
  }
  if (chat && !have) {
    mt_key = "max_completion_tokens";
    switch (lfs_member_int(root, mt_key, INT64_MIN, INT64_MAX, &x, err)) {
    case -1:
      return -1;
    case 1:
      have = 1;
    }
  }
  if (!have) {
    r->max_tokens = chat ? room : (room < 16 ? room : 16);
    return 0;
  }
  if (x < 1) BAD(mt_key, "'%s' is %lld; it must be at least 1", mt_key, (long long)x);
  if (x > m->max_seq_len)
    BAD(mt_key, "'%s' is %lld; the model's context is %d tokens", mt_key, (long long)x,
        m->max_seq_len);
  if (x > room) {
    lfs_error_set(err, 400, "invalid_request_error", "context_length_exceeded", mt_key,
                  "the prompt (%d tokens) plus %s (%lld) exceed the %s of %d tokens", r->n_prompt,
                  mt_key, (long long)x,
                  limit < m->max_seq_len ? "KV budget (full policy)" : "model's context", limit);
    return -1;
  }
  r->max_tokens = (int)x;
  return 0;
fail:
  return -1;
}

/* stop (a string or an array of strings / token-id arrays) and stop_token_ids. */
static int read_stops(const lfs_model_ctx *m, const cJSON *root, lfs_request *r, lfs_error *err) {
  const int max_stop = m->max_stop > 0 ? m->max_stop : 16;
  const cJSON *v = lfs_json_member(root, "stop");
  if (!lfs_json_is_null(v)) {
    if (cJSON_IsString(v)) {
      if (read_stop_entry(m, v, r, err)) return -1;
    } else if (cJSON_IsArray(v)) {
      if (lfs_json_count(v) > (size_t)max_stop)
        BAD("stop", "'stop' has %zu entries; at most %d are accepted", lfs_json_count(v), max_stop);
      const cJSON *e;
      cJSON_ArrayForEach(e, v) {
        if (read_stop_entry(m, e, r, err)) return -1;
      }
    } else {
      BAD_TYPE("stop", "a string or an array");
    }
  }
  v = lfs_json_member(root, "stop_token_ids");
  if (!lfs_json_is_null(v)) {
    if (!is_id_array(v)) BAD_TYPE("stop_token_ids", "an array of token ids");
    if (lfs_json_count(v) > 256) BAD("stop_token_ids", "at most 256 stop token ids are accepted");
    int32_t *p;
    int n;
    if (read_ids(m, v, "stop_token_ids", &p, &n, err)) return -1;
    for (int i = 0; i < n; i++)
      if (add_stop_id(r, p[i])) {
        free(p);
        OOM();
      }
    free(p);
  }
  return 0;
fail:
  return -1;
}

int lfs_request_parse(const lfs_model_ctx *m, int chat, const char *body, size_t len,
                      lfs_request *out, lfs_error *err) {
  lfs_request r;
  memset(&r, 0, sizeof r);
  memset(out, 0, sizeof *out);
  r.chat = chat;
  r.sampling.top_p = 1.0f;
  cJSON *root = lfs_body_parse(body, len, err);
  if (!root) goto fail;
  if (!cJSON_IsObject(root)) {
    lfs_error_set(err, 400, "invalid_request_error", "invalid_type", NULL,
                  "the request body must be a JSON object");
    goto fail;
  }
  /* In this order: the first problem of a body is the one reported. */
  if (check_members(root, chat, err) || read_model(m, root, err) ||
      read_output_shape(root, chat, &r, err) || read_penalties(m, root, &r, err) ||
      read_flags(root, &r, err) || read_sampling(root, &r, err) ||
      read_prompt(m, root, chat, &r, err) || read_max_tokens(m, root, chat, &r, err) ||
      read_stops(m, root, &r, err))
    goto fail;
  cJSON_Delete(root);
  *out = r;
  return 0;
fail:
  cJSON_Delete(root);
  lfs_request_free(&r);
  return -1;
}

/* OpenAI-style request bodies -> engine requests. See http_request.h.
 *
 * The body is parsed by cJSON, the distribution's JSON library (Debian: libcjson-dev). cJSON is
 * more lenient than RFC 8259, and json_precheck() below puts back, on the raw bytes and before
 * cJSON sees them, the rules the server has always enforced (engine/json.c's, which the server
 * used before; model files still go through engine/json.c):
 *   - strings are valid UTF-8 (cJSON copies any byte) with no raw control characters (cJSON
 *     takes them), and only ' ', '\t', '\n', '\r' separate tokens (cJSON skips any byte <= 32,
 *     NUL included); one leading BOM is allowed;
 *   - \u escapes have four hex digits (cJSON reads a bad digit as 0);
 *   - numbers follow the RFC grammar: no leading zeros, "1.", "-.5" or "1.e3" (cJSON hands any
 *     run of [0-9+-.eE] to strtod) and none overflow to infinity;
 *   - at most LFS_JSON_MAX_DEPTH nested arrays/objects (cJSON allows CJSON_NESTING_LIMIT, 1000,
 *     recursing once per level on libmicrohttpd's 1 MiB connection stacks);
 *   - no "\u0000": cJSON strings are C strings, so a NUL would silently cut a prompt short and
 *     make a member named "prompt\u0000x" read as "prompt". Such bodies are refused (400).
 * cJSON itself checks the structure, literals, escapes and \u surrogate pairs.
 * Numbers are cJSON's doubles: integer members must be integral and in range (5.0 and 1e3 are
 * integers; token ids, below the vocabulary size, are exact), and integers beyond 2^53 are the
 * nearest double (json_int). Duplicate members: the first one counts
 * (cJSON_GetObjectItemCaseSensitive). Responses are not written with cJSON's printer,
 * which copies invalid UTF-8 through: http_json.c's writer turns it into U+FFFD.
 */
#include "http_request.h"

#include <cJSON.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/utf8.h"

#define LFS_JSON_MAX_DEPTH 64

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
  free(r->stop_ids);
  for (int i = 0; i < r->n_stop_seqs; i++)
    free((void *)r->stop_seqs[i].ids);
  free(r->stop_seqs);
  for (int i = 0; i < r->n_stop_strs; i++)
    free(r->stop_strs[i].s);
  free(r->stop_strs);
  memset(r, 0, sizeof *r);
}

static int is_digit(unsigned char c) {
  return c >= '0' && c <= '9';
}

static int hex_val(unsigned char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

static int is_ws(unsigned char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

/* The RFC 8259 rules cJSON does not enforce (see the top of this file), on the raw body. Returns
 * 0, or -1 with *what and the byte offset *at of the first violation. *has_nul: a string holds
 * "\u0000" (not a JSON error: reported once cJSON has accepted the body). Structure is cJSON's
 * to check; up to the first structural error the bracket count here is cJSON's depth. */
static int json_precheck(const unsigned char *s, size_t len, size_t *at, const char **what,
                         int *has_nul) {
  size_t i = 0;
  int depth = 0;
  *has_nul = 0;
  /* a leading BOM (parse_body skips it) */
  if (len >= 3 && memcmp(s, "\xEF\xBB\xBF", 3) == 0) i = 3;
#define PRE_FAIL(pos, msg)                                                                         \
  do {                                                                                             \
    *at = (pos);                                                                                   \
    *what = (msg);                                                                                 \
    return -1;                                                                                     \
  } while (0)
  while (i < len) {
    unsigned c = s[i];
    if (c == '"') {
      for (i++;;) {
        if (i >= len) PRE_FAIL(len, "unterminated string");
        c = s[i];
        if (c == '"') break;
        if (c < 0x20) PRE_FAIL(i, "control character in string");
        if (c == '\\') {
          if (i + 1 >= len) PRE_FAIL(len, "unterminated string");
          if (s[i + 1] == 'u') {
            /* cJSON reads a bad hex digit as 0: "\u12x4" would become a NUL. */
            unsigned cp = 0;
            for (size_t k = i + 2; k < i + 6; k++) {
              int h = k < len ? hex_val(s[k]) : -1;
              if (h < 0) PRE_FAIL(i, "invalid \\u escape");
              cp = cp << 4 | (unsigned)h;
            }
            if (cp == 0) *has_nul = 1;
            i += 6; /* cJSON checks the surrogate pairs */
          } else {
            i += 2; /* cJSON checks the other escapes */
          }
        } else if (c >= 0x80) {
          size_t k = lf_utf8_len(s + i, len - i);
          if (!k) PRE_FAIL(i, "invalid UTF-8 in string");
          i += k;
        } else {
          i++;
        }
      }
      i++; /* the closing quote */
    } else if (c == '-' || is_digit((unsigned char)c)) {
      if (c == '-') i++;
      if (i >= len || !is_digit(s[i])) PRE_FAIL(i, "invalid number");
      if (s[i] == '0') {
        i++;
        if (i < len && is_digit(s[i])) PRE_FAIL(i, "leading zero in number");
      } else {
        while (i < len && is_digit(s[i]))
          i++;
      }
      if (i < len && s[i] == '.') {
        i++;
        if (i >= len || !is_digit(s[i])) PRE_FAIL(i, "digit expected after decimal point");
        while (i < len && is_digit(s[i]))
          i++;
      }
      if (i < len && (s[i] == 'e' || s[i] == 'E')) {
        i++;
        if (i < len && (s[i] == '+' || s[i] == '-')) i++;
        if (i >= len || !is_digit(s[i])) PRE_FAIL(i, "digit expected in exponent");
        while (i < len && is_digit(s[i]))
          i++;
      }
    } else {
      if (c == '[' || c == '{') {
        if (++depth > LFS_JSON_MAX_DEPTH) PRE_FAIL(i, "nesting too deep");
      } else if (c == ']' || c == '}') {
        if (depth > 0) depth--;
      } else if ((c < 0x20 && !is_ws((unsigned char)c)) || c >= 0x80) {
        PRE_FAIL(i, "unexpected character");
      }
      i++; /* anything else (letters, ':', ',') is cJSON's to judge */
    }
  }
#undef PRE_FAIL
  return 0;
}

/* cJSON turns an overflowing number into an infinity. The tree is at most LFS_JSON_MAX_DEPTH
 * deep (json_precheck). */
static int json_finite(const cJSON *v) {
  if (cJSON_IsNumber(v)) return isfinite(v->valuedouble);
  for (const cJSON *c = v->child; c; c = c->next)
    if (!json_finite(c)) return 0;
  return 1;
}

/* "the request body is not valid JSON: <what> at byte N (line L, column C)" (N < 0: no place). */
static void bad_json(lfs_error *err, const char *body, size_t len, const char *what, long long at) {
  if (at < 0) {
    lfs_error_set(err, 400, "invalid_request_error", "invalid_json", NULL,
                  "the request body is not valid JSON: %s", what);
    return;
  }
  size_t line = 1, col = 1;
  for (size_t i = 0; i < (size_t)at && i < len; i++) {
    if (body[i] == '\n') {
      line++;
      col = 1;
    } else {
      col++;
    }
  }
  lfs_error_set(err, 400, "invalid_request_error", "invalid_json", NULL,
                "the request body is not valid JSON: %s at byte %lld (line %zu, column %zu)", what,
                at, line, col);
}

/* cJSON_ParseWithLengthOpts records every call's error position in a process-wide variable (for
 * cJSON_GetErrorPtr, which is not used here); libmicrohttpd parses on a thread per connection,
 * so the calls take turns to keep that store race-free. */
static pthread_mutex_t cjson_mu = PTHREAD_MUTEX_INITIALIZER;

/* body[0..len) (no NUL terminator needed) as one JSON value; NULL with *err set when it is not. */
static cJSON *parse_body(const char *body, size_t len, lfs_error *err) {
  size_t at;
  const char *what;
  int has_nul;
  if (json_precheck((const unsigned char *)body, len, &at, &what, &has_nul)) {
    bad_json(err, body, len, what, (long long)at);
    return NULL;
  }
  /* A leading BOM is skipped here: cJSON skips one only in bodies of 5 bytes or more. */
  const size_t skip = len >= 3 && memcmp(body, "\xEF\xBB\xBF", 3) == 0 ? 3 : 0;
  if (len == skip) {
    bad_json(err, body, len, "unexpected end of input", (long long)len);
    return NULL;
  }
  /* cJSON 1.7.15 as released (bench/gpu_tp.sh builds it where the distribution has none) reads
   * one byte past the end of a body that stops right after '{' or ',' (upstream issue #800, fixed
   * in 1.7.18). So it parses a NUL-terminated copy; the length it gets leaves the NUL out. */
  const size_t n = len - skip;
  char *text = malloc(n + 1);
  if (!text) {
    lfs_error_set(err, 500, "server_error", "out_of_memory", NULL, "out of memory");
    return NULL;
  }
  memcpy(text, body + skip, n);
  text[n] = '\0';
  const char *end = NULL;
  pthread_mutex_lock(&cjson_mu);
  /* require_null_terminated = 0: the text is length-bounded; the tail is checked below. */
  cJSON *root = cJSON_ParseWithLengthOpts(text, n, &end, 0);
  pthread_mutex_unlock(&cjson_mu);
  const size_t stop = end ? skip + (size_t)(end - text) : len; /* in body */
  free(text);
  if (!root) {
    /* cJSON says where, not why (nor whether it ran out of memory). */
    bad_json(err, body, len, "syntax error", (long long)stop);
    return NULL;
  }
  for (size_t i = stop; i < len; i++)
    if (!is_ws((unsigned char)body[i])) {
      bad_json(err, body, len, "unexpected data after the value", (long long)i);
      cJSON_Delete(root);
      return NULL;
    }
  if (!json_finite(root)) {
    bad_json(err, body, len, "number out of range", -1);
    cJSON_Delete(root);
    return NULL;
  }
  if (has_nul) {
    lfs_error_set(err, 400, "invalid_request_error", "invalid_value", NULL,
                  "a string in the request body contains U+0000 (NUL), which is not supported");
    cJSON_Delete(root);
    return NULL;
  }
  return root;
}

/* Reading the tree. get: a member of an object (the first of that name), NULL when absent or
 * v is not an object. */
static const cJSON *get(const cJSON *v, const char *key) {
  return cJSON_IsObject(v) ? cJSON_GetObjectItemCaseSensitive(v, key) : NULL;
}

static int is_null(const cJSON *v) {
  return !v || cJSON_IsNull(v);
}

/* Items of an array or members of an object (cJSON keeps them in a list: count once, then walk
 * with cJSON_ArrayForEach, never index); 0 for anything else. */
static size_t json_len(const cJSON *v) {
  size_t n = 0;
  if (cJSON_IsArray(v) || cJSON_IsObject(v))
    for (const cJSON *c = v->child; c; c = c->next)
      n++;
  return n;
}

/* The string (NUL-terminated; json_precheck ruled out NULs inside) or NULL; *n gets its length. */
static const char *json_str(const cJSON *v, size_t *n) {
  if (!cJSON_IsString(v) || !v->valuestring) return NULL;
  if (n) *n = strlen(v->valuestring);
  return v->valuestring;
}

/* An integral number in int64's range: 5, 5.0, 5e0 (not 5.5, 1e19, "5"). cJSON keeps numbers as
 * doubles, so an integer beyond 2^53 reads as the nearest double; 2^63, the double nearest to
 * INT64_MAX (and to the integers up to 1024 above it), reads as INT64_MAX. */
static int json_int(const cJSON *v, int64_t *out) {
  if (!cJSON_IsNumber(v)) return 0;
  double d = v->valuedouble;
  if (!(d == floor(d)) || d < -9223372036854775808.0 || d > 9223372036854775808.0) return 0;
  *out = d == 9223372036854775808.0 ? INT64_MAX : (int64_t)d;
  return 1;
}

/* An integer member in [lo, hi]; 0 absent/null, 1 read, -1 error (err set). */
static int get_int(const cJSON *root, const char *key, int64_t lo, int64_t hi, int64_t *out,
                   lfs_error *err) {
  const cJSON *v = get(root, key);
  if (is_null(v)) return 0;
  int64_t x;
  if (!json_int(v, &x)) {
    lfs_error_set(err, 400, "invalid_request_error", "invalid_type", key, "'%s' must be an integer",
                  key);
    return -1;
  }
  if (x < lo || x > hi) {
    lfs_error_set(err, 400, "invalid_request_error", "invalid_value", key,
                  "'%s' is %lld; it must be in [%lld, %lld]", key, (long long)x, (long long)lo,
                  (long long)hi);
    return -1;
  }
  *out = x;
  return 1;
}

static int get_num(const cJSON *root, const char *key, double lo, double hi, int lo_open,
                   double *out, lfs_error *err) {
  const cJSON *v = get(root, key);
  if (is_null(v)) return 0;
  if (!cJSON_IsNumber(v)) {
    lfs_error_set(err, 400, "invalid_request_error", "invalid_type", key, "'%s' must be a number",
                  key);
    return -1;
  }
  double x = v->valuedouble;
  if (!isfinite(x) || x < lo || x > hi || (lo_open && x == lo)) {
    lfs_error_set(err, 400, "invalid_request_error", "invalid_value", key,
                  "'%s' is %g; it must be in %c%g, %g]", key, x, lo_open ? '(' : '[', lo, hi);
    return -1;
  }
  *out = x;
  return 1;
}

static int get_bool(const cJSON *root, const char *key, int *out, lfs_error *err) {
  const cJSON *v = get(root, key);
  if (is_null(v)) return 0;
  if (!cJSON_IsBool(v)) {
    lfs_error_set(err, 400, "invalid_request_error", "invalid_type", key, "'%s' must be a boolean",
                  key);
    return -1;
  }
  *out = cJSON_IsTrue(v) ? 1 : 0;
  return 1;
}

/* A token-id array -> ids (each an exact integer in [0, vocab)). */
static int read_ids(const lfs_model_ctx *m, const cJSON *arr, const char *param, int32_t **out,
                    int *n, lfs_error *err) {
  size_t len = json_len(arr);
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
    if (!json_int(it, &x) || x < 0 || x >= m->vocab_size) {
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
    const char *s = json_str(v, &n);
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
    if (!json_int(v, &x) || x < 0 || x >= m->vocab_size) {
      lfs_error_set(err, 400, "invalid_request_error", "invalid_token_id", "stop",
                    "a stop id must be a token id in [0, %d)", m->vocab_size);
      return -1;
    }
    if (add_stop_id(r, (int32_t)x)) goto oom;
    return 0;
  }
  if (is_id_array(v) && json_len(v) >= 1 && json_len(v) <= 256) {
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
  size_t n = json_len(msgs);
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
    const char *role = json_str(get(msg, "role"), NULL);
    if (!role || (strcmp(role, "system") && strcmp(role, "user") && strcmp(role, "assistant") &&
                  strcmp(role, "developer"))) {
      lfs_error_set(err, 400, "invalid_request_error", "invalid_value", "messages",
                    "messages[%zu].role must be \"system\", \"developer\", \"user\" or "
                    "\"assistant\"",
                    i);
      goto done;
    }
    cm[i].role = strcmp(role, "developer") ? role : "system";
    const cJSON *c = get(msg, "content");
    if (cJSON_IsString(c)) {
      size_t len = 0;
      const char *s = json_str(c, &len);
      if (lf_tok_text_append(&parts[i], s, len) != LF_OK) goto oom;
    } else if (cJSON_IsArray(c)) {
      size_t k = 0;
      const cJSON *p;
      cJSON_ArrayForEach(p, c) {
        const char *type = json_str(get(p, "type"), NULL);
        size_t len = 0;
        const char *s = json_str(get(p, "text"), &len);
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
    } else if (is_null(c) && !strcmp(role, "assistant")) {
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

int lfs_request_parse(const lfs_model_ctx *m, int chat, const char *body, size_t len,
                      lfs_request *out, lfs_error *err) {
  cJSON *root = NULL;
  lf_token_ids ids = {0};
  lfs_request r;
  memset(&r, 0, sizeof r);
  memset(out, 0, sizeof *out);
  r.chat = chat;
  r.sampling.top_p = 1.0f;
  root = parse_body(body, len, err);
  if (!root) goto fail;
  if (!cJSON_IsObject(root)) {
    lfs_error_set(err, 400, "invalid_request_error", "invalid_type", NULL,
                  "the request body must be a JSON object");
    goto fail;
  }

  const cJSON *v = get(root, "model");
  if (!is_null(v)) {
    const char *name = json_str(v, NULL);
    if (!name) BAD_TYPE("model", "a string");
    if (strcmp(name, m->model_name)) {
      lfs_error_set(err, 404, "invalid_request_error", "model_not_found", "model",
                    "The model '%.200s' does not exist; this server serves '%.100s'", name,
                    m->model_name);
      goto fail;
    }
  }
  int64_t x;
  double d;
  int b = 0;
  switch (get_int(root, "n", INT64_MIN, INT64_MAX, &x, err)) {
  case -1:
    goto fail;
  case 1:
    if (x != 1) BAD("n", "'n' must be 1: one completion per request is supported");
  }
  switch (get_int(root, "best_of", INT64_MIN, INT64_MAX, &x, err)) {
  case -1:
    goto fail;
  case 1:
    if (x != 1) BAD("best_of", "'best_of' must be 1");
  }
  if (get_bool(root, "echo", &b, err) < 0) goto fail;
  if (get(root, "echo") && b) BAD("echo", "'echo' is not supported");
  v = get(root, "logprobs");
  if (!is_null(v) && !cJSON_IsFalse(v) && !(cJSON_IsNumber(v) && v->valuedouble == 0))
    BAD("logprobs", "'logprobs' is not supported");
  if (!is_null(get(root, "suffix"))) BAD("suffix", "'suffix' is not supported");

  if (get_bool(root, "stream", &r.stream, err) < 0) goto fail;
  v = get(root, "stream_options");
  if (!is_null(v)) {
    if (!cJSON_IsObject(v)) BAD_TYPE("stream_options", "an object");
    if (get_bool(v, "include_usage", &r.include_usage, err) < 0) goto fail;
  }
  if (get_bool(root, "ignore_eos", &r.ignore_eos, err) < 0) goto fail;
  if (get_bool(root, "return_token_ids", &r.return_token_ids, err) < 0) goto fail;

  switch (get_num(root, "temperature", 0, 100, 0, &d, err)) {
  case -1:
    goto fail;
  case 1:
    r.sampling.temperature = (float)d;
  }
  switch (get_num(root, "top_p", 0, 1, 1, &d, err)) {
  case -1:
    goto fail;
  case 1:
    r.sampling.top_p = (float)d;
  }
  switch (get_int(root, "top_k", -1, INT32_MAX, &x, err)) {
  case -1:
    goto fail;
  case 1:
    r.sampling.top_k = x < 0 ? 0 : (int)x;
  }
  switch (get_int(root, "seed", INT64_MIN, INT64_MAX, &x, err)) {
  case -1:
    goto fail;
  case 1:
    r.sampling.seed = (uint64_t)x;
  }

  /* The prompt. */
  if (chat) {
    if (!get(root, "messages")) {
      lfs_error_set(err, 400, "invalid_request_error", "missing_required_parameter", "messages",
                    "'messages' is required");
      goto fail;
    }
    /* The rendered template carries its own BOS and special markers. */
    if (read_messages(m, get(root, "messages"), &ids, err)) goto fail_ids;
  } else {
    v = get(root, "prompt");
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
      const char *s = json_str(v, &n);
      if (n == 0) BAD("prompt", "'prompt' must not be empty");
      if (encode(m, s, n, LF_TOK_ADD_SPECIAL, "prompt", &ids, err)) goto fail_ids;
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
  if (ids.n == 0) {
    lf_token_ids_free(&ids);
    BAD(chat ? "messages" : "prompt", "the prompt is empty");
  }
  if (ids.n > (size_t)m->max_seq_len) {
    lfs_error_set(
        err, 400, "invalid_request_error", "context_length_exceeded", chat ? "messages" : "prompt",
        "the prompt has %zu tokens; the model's context is %d tokens", ids.n, m->max_seq_len);
    goto fail_ids;
  }
  r.prompt = ids.ids;
  r.n_prompt = (int)ids.n;
  ids.ids = NULL;

  /* Under `full` nothing is ever evicted: prompt and output must fit the pool. Otherwise the
   * model's context is the limit (LongFlow's pool holds a bounded window of it). */
  const int full = m->policy == LF_POLICY_FULL;
  const int limit = full && m->budget < m->max_seq_len ? m->budget : m->max_seq_len;
  if (r.n_prompt > limit) {
    lfs_error_set(err, 400, "invalid_request_error", "context_length_exceeded",
                  chat ? "messages" : "prompt",
                  "the prompt has %d tokens; at most %d fit (the KV budget under the full policy)",
                  r.n_prompt, limit);
    goto fail;
  }
  const int room = limit - r.n_prompt + 1; /* the last token is sampled, never stored */
  int have = 0;
  const char *mt_key = "max_tokens";
  switch (get_int(root, "max_tokens", INT64_MIN, INT64_MAX, &x, err)) {
  case -1:
    goto fail;
  case 1:
    have = 1;
  }
  if (chat && !have) {
    mt_key = "max_completion_tokens";
    switch (get_int(root, mt_key, INT64_MIN, INT64_MAX, &x, err)) {
    case -1:
      goto fail;
    case 1:
      have = 1;
    }
  }
  if (have) {
    if (x < 1) BAD(mt_key, "'%s' is %lld; it must be at least 1", mt_key, (long long)x);
    if (x > m->max_seq_len)
      BAD(mt_key, "'%s' is %lld; the model's context is %d tokens", mt_key, (long long)x,
          m->max_seq_len);
    if (x > room) {
      lfs_error_set(err, 400, "invalid_request_error", "context_length_exceeded", mt_key,
                    "the prompt (%d tokens) plus %s (%lld) exceed the %s of %d tokens", r.n_prompt,
                    mt_key, (long long)x,
                    limit < m->max_seq_len ? "KV budget (full policy)" : "model's context", limit);
      goto fail;
    }
    r.max_tokens = (int)x;
  } else {
    r.max_tokens = chat ? room : (room < 16 ? room : 16);
  }

  /* Stops. */
  const int max_stop = m->max_stop > 0 ? m->max_stop : 16;
  v = get(root, "stop");
  if (!is_null(v)) {
    if (cJSON_IsString(v)) {
      if (read_stop_entry(m, v, &r, err)) goto fail;
    } else if (cJSON_IsArray(v)) {
      if (json_len(v) > (size_t)max_stop)
        BAD("stop", "'stop' has %zu entries; at most %d are accepted", json_len(v), max_stop);
      const cJSON *e;
      cJSON_ArrayForEach(e, v) {
        if (read_stop_entry(m, e, &r, err)) goto fail;
      }
    } else {
      BAD_TYPE("stop", "a string or an array");
    }
  }
  v = get(root, "stop_token_ids");
  if (!is_null(v)) {
    if (!is_id_array(v)) BAD_TYPE("stop_token_ids", "an array of token ids");
    if (json_len(v) > 256) BAD("stop_token_ids", "at most 256 stop token ids are accepted");
    int32_t *p;
    int n;
    if (read_ids(m, v, "stop_token_ids", &p, &n, err)) goto fail;
    for (int i = 0; i < n; i++)
      if (add_stop_id(&r, p[i])) {
        free(p);
        OOM();
      }
    free(p);
  }

  cJSON_Delete(root);
  *out = r;
  return 0;
fail_ids:
  lf_token_ids_free(&ids);
fail:
  cJSON_Delete(root);
  lfs_request_free(&r);
  return -1;
}

/* The JSON layer under the server's request parser (http_body.h).
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
 * nearest double (lfs_json_int). Duplicate members: the first one counts
 * (cJSON_GetObjectItemCaseSensitive). Responses are not written with cJSON's printer,
 * which copies invalid UTF-8 through: http_json.c's writer turns it into U+FFFD.
 */
#include "launch/http_body.h"

#include <cJSON.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "text/utf8.h"

#define LFS_JSON_MAX_DEPTH 64

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
cJSON *lfs_body_parse(const char *body, size_t len, lfs_error *err) {
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
  /* cJSON 1.7.15 as released (bench/run.sh builds it where the distribution has none) reads
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
const cJSON *lfs_json_member(const cJSON *v, const char *key) {
  return cJSON_IsObject(v) ? cJSON_GetObjectItemCaseSensitive(v, key) : NULL;
}

int lfs_json_is_null(const cJSON *v) {
  return !v || cJSON_IsNull(v);
}

/* Items of an array or members of an object (cJSON keeps them in a list: count once, then walk
 * with cJSON_ArrayForEach, never index); 0 for anything else. */
size_t lfs_json_count(const cJSON *v) {
  size_t n = 0;
  if (cJSON_IsArray(v) || cJSON_IsObject(v))
    for (const cJSON *c = v->child; c; c = c->next)
      n++;
  return n;
}

/* The string (NUL-terminated; json_precheck ruled out NULs inside) or NULL; *n gets its length. */
const char *lfs_json_string(const cJSON *v, size_t *n) {
  if (!cJSON_IsString(v) || !v->valuestring) return NULL;
  if (n) *n = strlen(v->valuestring);
  return v->valuestring;
}

/* An integral number in int64's range: 5, 5.0, 5e0 (not 5.5, 1e19, "5"). cJSON keeps numbers as
 * doubles, so an integer beyond 2^53 reads as the nearest double; 2^63, the double nearest to
 * INT64_MAX (and to the integers up to 1024 above it), reads as INT64_MAX. */
int lfs_json_int(const cJSON *v, int64_t *out) {
  if (!cJSON_IsNumber(v)) return 0;
  double d = v->valuedouble;
  if (!(d == floor(d)) || d < -9223372036854775808.0 || d > 9223372036854775808.0) return 0;
  *out = d == 9223372036854775808.0 ? INT64_MAX : (int64_t)d;
  return 1;
}

/* The 400 for member key of the wrong type ("'key' must be <what>"); returns -1. */
static int wrong_type(lfs_error *err, const char *key, const char *what) {
  lfs_error_set(err, 400, "invalid_request_error", "invalid_type", key, "'%s' must be %s", key,
                what);
  return -1;
}

/* An integer member in [lo, hi]; 0 absent/null, 1 read, -1 error (err set). */
int lfs_member_int(const cJSON *root, const char *key, int64_t lo, int64_t hi, int64_t *out,
                   lfs_error *err) {
  const cJSON *v = lfs_json_member(root, key);
  if (lfs_json_is_null(v)) return 0;
  int64_t x;
  if (!lfs_json_int(v, &x)) return wrong_type(err, key, "an integer");
  if (x < lo || x > hi) {
    lfs_error_set(err, 400, "invalid_request_error", "invalid_value", key,
                  "'%s' is %lld; it must be in [%lld, %lld]", key, (long long)x, (long long)lo,
                  (long long)hi);
    return -1;
  }
  *out = x;
  return 1;
}

int lfs_member_num(const cJSON *root, const char *key, double lo, double hi, int lo_open,
                   double *out, lfs_error *err) {
  const cJSON *v = lfs_json_member(root, key);
  if (lfs_json_is_null(v)) return 0;
  if (!cJSON_IsNumber(v)) return wrong_type(err, key, "a number");
  double x = v->valuedouble;
  if (!isfinite(x) || x < lo || x > hi || (lo_open && x == lo)) {
    lfs_error_set(err, 400, "invalid_request_error", "invalid_value", key,
                  "'%s' is %g; it must be in %c%g, %g]", key, x, lo_open ? '(' : '[', lo, hi);
    return -1;
  }
  *out = x;
  return 1;
}

int lfs_member_bool(const cJSON *root, const char *key, int *out, lfs_error *err) {
  const cJSON *v = lfs_json_member(root, key);
  if (lfs_json_is_null(v)) return 0;
  if (!cJSON_IsBool(v)) return wrong_type(err, key, "a boolean");
  *out = cJSON_IsTrue(v) ? 1 : 0;
  return 1;
}

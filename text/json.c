#include "text/json.h"

#include <locale.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "text/utf8.h"

typedef struct json_parser {
  const unsigned char *s; /* [len] */
  size_t len, pos;
  int depth;
  lf_status status;
  size_t err_pos;
  char msg[96];
} json_parser;

/* Records the first error only: later failures are consequences of it. */
static int json_fail(json_parser *p, size_t at, lf_status st, const char *msg) {
  if (p->status == LF_OK) {
    p->status = st;
    p->err_pos = at;
    snprintf(p->msg, sizeof p->msg, "%s", msg);
  }
  return -1;
}

static void json_skip_ws(json_parser *p) {
  while (p->pos < p->len) {
    unsigned char c = p->s[p->pos];
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
    p->pos++;
  }
}

static int json_hex4(const unsigned char *h, unsigned *out) {
  unsigned v = 0;
  for (int i = 0; i < 4; i++) {
    unsigned c = h[i], d;
    if (c >= '0' && c <= '9')
      d = c - '0';
    else if (c >= 'a' && c <= 'f')
      d = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F')
      d = c - 'A' + 10;
    else
      return 0;
    v = v << 4 | d;
  }
  *out = v;
  return 1;
}

static size_t json_put_utf8(unsigned char *o, unsigned cp) {
  if (cp < 0x80) {
    o[0] = (unsigned char)cp;
    return 1;
  }
  if (cp < 0x800) {
    o[0] = (unsigned char)(0xC0 | cp >> 6);
    o[1] = (unsigned char)(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    o[0] = (unsigned char)(0xE0 | cp >> 12);
    o[1] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
    o[2] = (unsigned char)(0x80 | (cp & 0x3F));
    return 3;
  }
  o[0] = (unsigned char)(0xF0 | cp >> 18);
  o[1] = (unsigned char)(0x80 | (cp >> 12 & 0x3F));
  o[2] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
  o[3] = (unsigned char)(0x80 | (cp & 0x3F));
  return 4;
}

/* Parses the string starting at the opening quote into a fresh NUL-terminated buffer. */
static int json_string(json_parser *p, char **out, size_t *out_len) {
  size_t start = ++p->pos; /* after '"' */
  /* Find the closing quote first: the decoded string is never longer than the raw span
   * (every escape decodes to at most as many bytes as it occupies), so one allocation does. */
  size_t end = start;
  for (;;) {
    if (end >= p->len) return json_fail(p, p->len, LF_ERR_FORMAT, "unterminated string");
    unsigned char c = p->s[end];
    if (c == '"') break;
    end += c == '\\' ? 2 : 1;
  }
  unsigned char *buf = malloc(end - start + 1);
  if (!buf) return json_fail(p, start, LF_ERR_OUT_OF_MEMORY, "out of memory");
  size_t n = 0, i = start;
  while (i < end) {
    unsigned char c = p->s[i];
    if (c < 0x20) {
      free(buf);
      return json_fail(p, i, LF_ERR_FORMAT, "control character in string");
    }
    if (c >= 0x80) {
      size_t k = lf_utf8_len(p->s + i, end - i);
      if (!k) {
        free(buf);
        return json_fail(p, i, LF_ERR_FORMAT, "invalid UTF-8 in string");
      }
      memcpy(buf + n, p->s + i, k);
      n += k;
      i += k;
      continue;
    }
    if (c != '\\') {
      buf[n++] = c;
      i++;
      continue;
    }
    /* end was found by skipping two bytes per backslash, so i + 1 < end: in bounds. */
    static const char esc_from[8] = "\"\\/bfnrt", esc_to[8] = "\"\\/\b\f\n\r\t";
    const unsigned char e = p->s[i + 1];
    const char *hit = memchr(esc_from, e, sizeof esc_from);
    if (hit) {
      buf[n++] = (unsigned char)esc_to[hit - esc_from];
      i += 2;
      continue;
    }
    if (e != 'u') {
      free(buf);
      return json_fail(p, i, LF_ERR_FORMAT, "invalid escape in string");
    }
    unsigned cp;
    if (end - i < 6 || !json_hex4(p->s + i + 2, &cp)) {
      free(buf);
      return json_fail(p, i, LF_ERR_FORMAT, "invalid \\u escape");
    }
    if (cp >= 0xDC00 && cp <= 0xDFFF) {
      free(buf);
      return json_fail(p, i, LF_ERR_FORMAT, "unpaired low surrogate in \\u escape");
    }
    if (cp >= 0xD800 && cp <= 0xDBFF) {
      /* A lone surrogate has no UTF-8 encoding: require its low half right after. */
      unsigned lo;
      if (end - i < 12 || p->s[i + 6] != '\\' || p->s[i + 7] != 'u' ||
          !json_hex4(p->s + i + 8, &lo) || lo < 0xDC00 || lo > 0xDFFF) {
        free(buf);
        return json_fail(p, i, LF_ERR_FORMAT, "unpaired high surrogate in \\u escape");
      }
      cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
      i += 6;
    }
    n += json_put_utf8(buf + n, cp);
    i += 6;
  }
  buf[n] = '\0';
  p->pos = end + 1;
  *out = (char *)buf;
  *out_len = n;
  return 0;
}

static int json_digit(unsigned char c) {
  return c >= '0' && c <= '9';
}

static int json_number(json_parser *p, lf_json *v) {
  size_t start = p->pos, i = start;
  int neg = 0, integral = 1;
  if (i < p->len && p->s[i] == '-') {
    neg = 1;
    i++;
  }
  if (i >= p->len || !json_digit(p->s[i])) return json_fail(p, i, LF_ERR_FORMAT, "invalid number");
  if (p->s[i] == '0') {
    i++;
    if (i < p->len && json_digit(p->s[i]))
      return json_fail(p, i, LF_ERR_FORMAT, "leading zero in number");
  } else {
    while (i < p->len && json_digit(p->s[i]))
      i++;
  }
  size_t int_end = i;
  if (i < p->len && p->s[i] == '.') {
    integral = 0;
    i++;
    if (i >= p->len || !json_digit(p->s[i]))
      return json_fail(p, i, LF_ERR_FORMAT, "digit expected after decimal point");
    while (i < p->len && json_digit(p->s[i]))
      i++;
  }
  if (i < p->len && (p->s[i] == 'e' || p->s[i] == 'E')) {
    integral = 0;
    i++;
    if (i < p->len && (p->s[i] == '+' || p->s[i] == '-')) i++;
    if (i >= p->len || !json_digit(p->s[i]))
      return json_fail(p, i, LF_ERR_FORMAT, "digit expected in exponent");
    while (i < p->len && json_digit(p->s[i]))
      i++;
  }
  size_t n = i - start;

  /* strtod needs a NUL-terminated copy and follows LC_NUMERIC, which the host program may have
   * changed: swap '.' for the locale's decimal point so "1.5" never parses as 1. */
  char small[64];
  char *tmp = n < sizeof small ? small : malloc(n + 1);
  if (!tmp) return json_fail(p, start, LF_ERR_OUT_OF_MEMORY, "out of memory");
  memcpy(tmp, p->s + start, n);
  tmp[n] = '\0';
  const char *dp = localeconv()->decimal_point;
  if (dp && dp[0] && !dp[1] && dp[0] != '.') {
    char *dot = memchr(tmp, '.', n);
    if (dot) *dot = dp[0];
  }
  double d = strtod(tmp, NULL);
  if (tmp != small) free(tmp);
  if (isinf(d)) return json_fail(p, start, LF_ERR_FORMAT, "number out of range");

  v->type = LF_JSON_NUMBER;
  v->num = d;
  v->is_int = 0;
  if (integral) {
    /* Exact int64 from the digits, since doubles lose integers beyond 2^53. */
    uint64_t m = 0, lim = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    int ok = 1;
    for (size_t k = start + (size_t)neg; k < int_end; k++) {
      unsigned dig = p->s[k] - '0';
      if (m > (lim - dig) / 10) {
        ok = 0;
        break;
      }
      m = m * 10 + dig;
    }
    if (ok) {
      v->is_int = 1;
      v->i64 = neg ? (m == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)m) : (int64_t)m;
    }
  } else if (d == floor(d) && d >= -9223372036854775808.0 && d < 9223372036854775808.0) {
    v->is_int = 1;
    v->i64 = (int64_t)d;
  }
  p->pos = i;
  return 0;
}

static int json_literal(json_parser *p, const char *word) {
  size_t n = strlen(word);
  if (p->len - p->pos < n || memcmp(p->s + p->pos, word, n) != 0)
    return json_fail(p, p->pos, LF_ERR_FORMAT, "invalid literal");
  p->pos += n;
  return 0;
}

/* Appends a zeroed item to a container so that the tree stays freeable if parsing it fails. */
static lf_json *json_push(json_parser *p, lf_json *c, size_t *cap) {
  if (c->len == *cap) {
    size_t nc = *cap ? *cap * 2 : 4;
    if (nc > SIZE_MAX / sizeof(lf_json)) {
      json_fail(p, p->pos, LF_ERR_OUT_OF_MEMORY, "out of memory");
      return NULL;
    }
    lf_json *ni = realloc(c->items, nc * sizeof(lf_json));
    if (!ni) {
      json_fail(p, p->pos, LF_ERR_OUT_OF_MEMORY, "out of memory");
      return NULL;
    }
    c->items = ni;
    *cap = nc;
  }
  lf_json *it = &c->items[c->len++];
  memset(it, 0, sizeof *it);
  return it;
}

static int json_value(json_parser *p, lf_json *v);

static int json_container(json_parser *p, lf_json *v, int is_obj) {
  if (++p->depth > LF_JSON_MAX_DEPTH)
    return json_fail(p, p->pos, LF_ERR_FORMAT, "nesting too deep");
  unsigned char close = is_obj ? '}' : ']';
  v->type = is_obj ? LF_JSON_OBJECT : LF_JSON_ARRAY;
  size_t cap = 0;
  p->pos++; /* the opening bracket */
  json_skip_ws(p);
  if (p->pos < p->len && p->s[p->pos] == close) {
    p->pos++;
    p->depth--;
    return 0;
  }
  for (;;) {
    lf_json *it = json_push(p, v, &cap);
    if (!it) return -1;
    if (is_obj) {
      if (p->pos >= p->len || p->s[p->pos] != '"')
        return json_fail(p, p->pos, LF_ERR_FORMAT, "object key (a string) expected");
      if (json_string(p, &it->key, &it->key_len)) return -1;
      json_skip_ws(p);
      if (p->pos >= p->len || p->s[p->pos] != ':')
        return json_fail(p, p->pos, LF_ERR_FORMAT, "':' expected after object key");
      p->pos++;
      json_skip_ws(p);
    }
    if (json_value(p, it)) return -1;
    json_skip_ws(p);
    if (p->pos >= p->len)
      return json_fail(p, p->pos, LF_ERR_FORMAT,
                       is_obj ? "unterminated object" : "unterminated array");
    unsigned char c = p->s[p->pos];
    if (c == close) {
      p->pos++;
      break;
    }
    if (c != ',')
      return json_fail(p, p->pos, LF_ERR_FORMAT,
                       is_obj ? "',' or '}' expected in object" : "',' or ']' expected in array");
    p->pos++;
    json_skip_ws(p);
  }
  /* Give back the slack of the doubling growth: big arrays of small items would otherwise
   * keep up to twice their size. Failure to shrink is harmless. */
  if (cap > v->len) {
    lf_json *ni = realloc(v->items, v->len * sizeof(lf_json));
    if (ni) v->items = ni;
  }
  p->depth--;
  return 0;
}

/* Expects p->pos at the first byte of a value (whitespace already skipped). */
static int json_value(json_parser *p, lf_json *v) {
  if (p->pos >= p->len) return json_fail(p, p->pos, LF_ERR_FORMAT, "unexpected end of input");
  switch (p->s[p->pos]) {
  case '{':
    return json_container(p, v, 1);
  case '[':
    return json_container(p, v, 0);
  case '"':
    v->type = LF_JSON_STRING;
    return json_string(p, &v->str, &v->len);
  case 't':
    v->type = LF_JSON_BOOL;
    v->boolean = 1;
    return json_literal(p, "true");
  case 'f':
    v->type = LF_JSON_BOOL;
    v->boolean = 0;
    return json_literal(p, "false");
  case 'n':
    v->type = LF_JSON_NULL;
    return json_literal(p, "null");
  default:
    if (p->s[p->pos] == '-' || json_digit(p->s[p->pos])) return json_number(p, v);
    return json_fail(p, p->pos, LF_ERR_FORMAT, "unexpected character");
  }
}

static void json_free_inner(lf_json *v) {
  for (size_t i = 0; v->items && i < v->len; i++)
    json_free_inner(&v->items[i]);
  free(v->items);
  free(v->str);
  free(v->key);
}

void lf_json_free(lf_json *v) {
  if (!v) return;
  json_free_inner(v);
  free(v);
}

lf_status lf_json_parse(const char *text, size_t len, lf_json **out, char *err, size_t errcap) {
  if (err && errcap) err[0] = '\0';
  if (!out) return lf_error(LF_ERR_INVALID_ARG, "lf_json_parse: out is NULL");
  *out = NULL;
  if (!text && len) return lf_error(LF_ERR_INVALID_ARG, "lf_json_parse: text is NULL");
  json_parser p = {.s = (const unsigned char *)text, .len = len};
  if (len >= 3 && memcmp(text, "\xEF\xBB\xBF", 3) == 0) p.pos = 3;
  lf_json *root = calloc(1, sizeof *root);
  if (!root) return lf_error(LF_ERR_OUT_OF_MEMORY, "JSON: out of memory");
  json_skip_ws(&p);
  if (json_value(&p, root) == 0) {
    json_skip_ws(&p);
    if (p.pos != p.len) json_fail(&p, p.pos, LF_ERR_FORMAT, "unexpected data after the value");
  }
  if (p.status != LF_OK) {
    lf_json_free(root);
    size_t line = 1, col = 1;
    for (size_t i = 0; i < p.err_pos && i < len; i++) {
      if (p.s[i] == '\n') {
        line++;
        col = 1;
      } else {
        col++;
      }
    }
    char msg[160];
    snprintf(msg, sizeof msg, "%s at byte %zu (line %zu, column %zu)", p.msg, p.err_pos, line, col);
    if (err && errcap) snprintf(err, errcap, "%s", msg);
    return lf_error(p.status, "JSON: %s", msg);
  }
  *out = root;
  return LF_OK;
}

lf_json_type lf_json_typeof(const lf_json *v) {
  return v ? v->type : LF_JSON_NULL;
}

const char *lf_json_type_str(lf_json_type t) {
  switch (t) {
  case LF_JSON_NULL:
    return "null";
  case LF_JSON_BOOL:
    return "boolean";
  case LF_JSON_NUMBER:
    return "number";
  case LF_JSON_STRING:
    return "string";
  case LF_JSON_ARRAY:
    return "array";
  case LF_JSON_OBJECT:
    return "object";
  }
  return "unknown";
}

size_t lf_json_len(const lf_json *v) {
  return v && (v->type == LF_JSON_ARRAY || v->type == LF_JSON_OBJECT) ? v->len : 0;
}

const lf_json *lf_json_get(const lf_json *obj, const char *key) {
  if (!obj || obj->type != LF_JSON_OBJECT || !key) return NULL;
  size_t n = strlen(key);
  for (size_t i = obj->len; i-- > 0;) {
    const lf_json *m = &obj->items[i];
    if (m->key_len == n && memcmp(m->key, key, n) == 0) return m;
  }
  return NULL;
}

const lf_json *lf_json_at(const lf_json *v, size_t i) {
  if (!v || (v->type != LF_JSON_ARRAY && v->type != LF_JSON_OBJECT) || i >= v->len) return NULL;
  return &v->items[i];
}

const char *lf_json_key_at(const lf_json *obj, size_t i) {
  if (!obj || obj->type != LF_JSON_OBJECT || i >= obj->len) return NULL;
  return obj->items[i].key;
}

int lf_json_bool(const lf_json *v, int *out) {
  if (!v || v->type != LF_JSON_BOOL) return 0;
  *out = v->boolean;
  return 1;
}

int lf_json_num(const lf_json *v, double *out) {
  if (!v || v->type != LF_JSON_NUMBER) return 0;
  *out = v->num;
  return 1;
}

int lf_json_int(const lf_json *v, int64_t *out) {
  if (!v || v->type != LF_JSON_NUMBER || !v->is_int) return 0;
  *out = v->i64;
  return 1;
}

const char *lf_json_str(const lf_json *v, size_t *len) {
  if (!v || v->type != LF_JSON_STRING) return NULL;
  if (len) *len = v->len;
  return v->str;
}

/* A growable byte buffer and a small JSON writer. See http_json.h. */
#include "http_json.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/utf8.h"

void lfs_buf_free(lfs_buf *b) {
  free(b->data);
  memset(b, 0, sizeof *b);
}

void lfs_buf_clear(lfs_buf *b) {
  b->len = 0;
  if (b->data) b->data[0] = '\0';
}

static int reserve(lfs_buf *b, size_t extra) {
  if (b->oom) return 0;
  if (extra > ((size_t)-1) / 4 - b->len) {
    b->oom = 1;
    return 0;
  }
  size_t need = b->len + extra + 1;
  if (need <= b->cap) return 1;
  size_t cap = b->cap ? b->cap : 256;
  while (cap < need)
    cap *= 2;
  char *p = realloc(b->data, cap);
  if (!p) {
    b->oom = 1;
    return 0;
  }
  b->data = p;
  b->cap = cap;
  return 1;
}

void lfs_buf_put(lfs_buf *b, const char *s, size_t n) {
  if (!reserve(b, n)) return;
  if (n) memcpy(b->data + b->len, s, n);
  b->len += n;
  b->data[b->len] = '\0';
}

void lfs_buf_puts(lfs_buf *b, const char *s) {
  lfs_buf_put(b, s, strlen(s));
}

void lfs_buf_printf(lfs_buf *b, const char *fmt, ...) {
  char small[256];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(small, sizeof small, fmt, ap);
  va_end(ap);
  if (n < 0) {
    b->oom = 1;
    return;
  }
  if ((size_t)n < sizeof small) {
    lfs_buf_put(b, small, (size_t)n);
    return;
  }
  if (!reserve(b, (size_t)n)) return;
  va_start(ap, fmt);
  vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
  va_end(ap);
  b->len += (size_t)n;
}

void lfs_buf_json_str(lfs_buf *b, const char *s, size_t n) {
  const unsigned char *u = (const unsigned char *)s;
  lfs_buf_put(b, "\"", 1);
  size_t i = 0;
  while (i < n) {
    /* A run of bytes that need no escaping goes out in one copy. */
    size_t j = i;
    while (j < n && u[j] >= 0x20 && u[j] < 0x80 && u[j] != '"' && u[j] != '\\')
      j++;
    if (j > i) {
      lfs_buf_put(b, s + i, j - i);
      i = j;
      continue;
    }
    unsigned c = u[i];
    if (c >= 0x80) {
      size_t k = lf_utf8_len(u + i, n - i);
      if (k) {
        lfs_buf_put(b, s + i, k);
        i += k;
      } else {
        lfs_buf_put(b, "\xef\xbf\xbd", 3);
        i++;
      }
      continue;
    }
    /* '"', '\\' and the control characters: JSON's two-character escapes, else \u00XX. */
    static const char short_from[] = "\"\\\n\r\t\b\f", short_to[] = "\"\\nrtbf";
    const char *e = c ? strchr(short_from, (int)c) : NULL;
    if (e) {
      const char esc[2] = {'\\', short_to[e - short_from]};
      lfs_buf_put(b, esc, 2);
    } else {
      lfs_buf_printf(b, "\\u%04x", c);
    }
    i++;
  }
  lfs_buf_put(b, "\"", 1);
}

void lfs_buf_json_cstr(lfs_buf *b, const char *s) {
  if (!s)
    lfs_buf_puts(b, "null");
  else
    lfs_buf_json_str(b, s, strlen(s));
}

void lfs_buf_json_num(lfs_buf *b, double v) {
  if (!isfinite(v)) v = 0;
  if (v == (double)(long long)v && fabs(v) < 1e15)
    lfs_buf_printf(b, "%lld", (long long)v);
  else
    lfs_buf_printf(b, "%.9g", v);
}

void lfs_buf_consume(lfs_buf *b, size_t n) {
  if (n >= b->len) {
    lfs_buf_clear(b);
    return;
  }
  memmove(b->data, b->data + n, b->len - n);
  b->len -= n;
  b->data[b->len] = '\0';
}

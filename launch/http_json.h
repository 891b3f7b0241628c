/* A growable byte buffer and a small JSON writer for the server's responses.
 *
 * Appends never fail loudly: an allocation failure sets `oom` and later appends do nothing, so a
 * writer builds a whole response and checks once at the end. Strings are escaped for JSON and
 * forced to valid UTF-8 (an invalid byte becomes U+FFFD), so a response is always valid JSON
 * whatever bytes a tokenizer or a client handed us. (Requests are parsed with cJSON, but cJSON's
 * printer copies invalid UTF-8 through unchanged, so responses are written here.)
 */
#ifndef LF_HTTP_JSON_H
#define LF_HTTP_JSON_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lfs_buf {
  char *data; /* [cap], NUL-terminated after len when non-NULL */
  size_t len, cap;
  int oom;
} lfs_buf;

void lfs_buf_free(lfs_buf *b);
void lfs_buf_clear(lfs_buf *b);
void lfs_buf_put(lfs_buf *b, const char *s, size_t n);
void lfs_buf_puts(lfs_buf *b, const char *s);
void lfs_buf_printf(lfs_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* s[0..n) as a quoted JSON string. */
void lfs_buf_json_str(lfs_buf *b, const char *s, size_t n);
void lfs_buf_json_cstr(lfs_buf *b, const char *s); /* NULL writes null */
/* A finite double (non-finite values write 0). */
void lfs_buf_json_num(lfs_buf *b, double v);
/* Removes the first n bytes. */
void lfs_buf_consume(lfs_buf *b, size_t n);

#ifdef __cplusplus
}
#endif
#endif

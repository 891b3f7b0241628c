/* Stop strings matched on decoded text. See http_stop.h. */
#include "launch/http_stop.h"

#include <string.h>

void lfs_stopper_init(lfs_stopper *st, const lfs_stop_str *stops, int n_stops) {
  memset(st, 0, sizeof *st);
  st->stops = stops;
  st->n_stops = n_stops;
  st->which = -1;
}

void lfs_stopper_free(lfs_stopper *st) {
  lfs_buf_free(&st->held);
}

/* The first occurrence of needle[0..m) in h[0..n), or n when none. */
static size_t find(const char *h, size_t n, const char *needle, size_t m) {
  if (m == 0 || m > n) return n;
  const char first = needle[0];
  for (size_t i = 0; i + m <= n; i++) {
    const char *p = memchr(h + i, first, n - m + 1 - i);
    if (!p) return n;
    i = (size_t)(p - h);
    if (memcmp(p, needle, m) == 0) return i;
  }
  return n;
}

int lfs_stopper_put(lfs_stopper *st, const char *s, size_t n, lfs_buf *out) {
  if (st->matched) return 1;
  if (st->n_stops == 0) {
    lfs_buf_put(out, s, n);
    return out->oom ? -1 : 0;
  }
  lfs_buf *h = &st->held;
  lfs_buf_put(h, s, n);
  if (h->oom) return -1;
  const char *b = h->data ? h->data : "";
  const size_t len = h->len;
  /* The held text holds no whole stop string, so a match ends in the new text; searching all
   * of it is cheap (held is shorter than the longest stop string). The match that completes
   * first wins (as if the text had come one byte at a time), the longer one on a tie. */
  size_t at = len, at_end = (size_t)-1;
  for (int i = 0; i < st->n_stops; i++) {
    const size_t m = st->stops[i].n;
    const size_t p = find(b, len, st->stops[i].s, m);
    if (p < len && (p + m < at_end || (p + m == at_end && p < at))) {
      at = p;
      at_end = p + m;
      st->which = i;
    }
  }
  if (at < len) {
    lfs_buf_put(out, b, at);
    lfs_buf_clear(h);
    st->matched = 1;
    return out->oom ? -1 : 1;
  }
  /* Hold back the longest tail that is a proper prefix of a stop string. */
  size_t keep = 0;
  for (int i = 0; i < st->n_stops; i++) {
    const size_t m = st->stops[i].n;
    for (size_t k = (m - 1 < len ? m - 1 : len); k > keep; k--)
      if (memcmp(b + len - k, st->stops[i].s, k) == 0) {
        keep = k;
        break;
      }
  }
  lfs_buf_put(out, b, len - keep);
  lfs_buf_consume(h, len - keep);
  return out->oom ? -1 : 0;
}

void lfs_stopper_flush(lfs_stopper *st, lfs_buf *out) {
  if (!st->matched && st->held.len) lfs_buf_put(out, st->held.data, st->held.len);
  lfs_buf_clear(&st->held);
}

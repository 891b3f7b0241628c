/* Stop strings matched on text, not tokens.
 *
 * The server decodes a request's tokens incrementally (lf_tok_stream) and feeds the text here.
 * A stop string may be spelled by the model with any tokens, may span tokens or sit inside one;
 * matching the decoded text catches every spelling. Text that could be the start of a stop
 * string is held back (at most the longest stop string less one byte) until the next text
 * either completes the stop string (the output ends exactly before it; the held text is never
 * emitted) or rules it out (the held text is emitted). When the request ends for another reason,
 * lfs_stopper_flush releases what is held.
 *
 * Matching is on bytes of valid UTF-8 (the decoder's output and JSON strings both are), so cuts
 * always fall on character boundaries. The stop string whose match completes first wins, as if
 * the text came one byte at a time, so the result does not depend on how the text is split into
 * tokens; of two completing at the same byte, the longer.
 */
#ifndef LF_HTTP_STOP_H
#define LF_HTTP_STOP_H

#include <stddef.h>

#include "launch/http_json.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A stop string: s[0..n), n >= 1 (may hold NUL bytes). */
typedef struct lfs_stop_str {
  char *s;
  size_t n;
} lfs_stop_str;

typedef struct lfs_stopper {
  const lfs_stop_str *stops; /* [n_stops], not owned: must outlive the stopper */
  int n_stops;
  lfs_buf held; /* text withheld: a proper prefix of some stop string ends it */
  int matched;  /* a stop string was found; nothing more is emitted */
  int which;    /* the index of the stop string that matched (-1 before) */
} lfs_stopper;

void lfs_stopper_init(lfs_stopper *st, const lfs_stop_str *stops, int n_stops);
void lfs_stopper_free(lfs_stopper *st);
/* Feeds decoded text s[0..n) and appends to out what may be emitted now. Returns 1 when a stop
 * string matched (out then ends exactly before it; later calls emit nothing), 0 otherwise, -1 out
 * of memory. */
int lfs_stopper_put(lfs_stopper *st, const char *s, size_t n, lfs_buf *out);
/* The request ended without a match: appends the held text to out. */
void lfs_stopper_flush(lfs_stopper *st, lfs_buf *out);

#ifdef __cplusplus
}
#endif
#endif

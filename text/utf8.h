/* UTF-8 well-formedness, shared by the JSON reader (engine/json.c), the server's request check
 * and its response writer (launch/). The tokenizer keeps its own classifier: it also needs the
 * maximal-subpart and unfinished-prefix cases of streaming decode. */
#ifndef LF_UTF8_H
#define LF_UTF8_H

#include <stddef.h>

/* Length of the well-formed UTF-8 character at s[0..n) (n >= 1), or 0 when it is not one:
 * overlongs, encoded surrogates and code points above U+10FFFF are ill-formed (Unicode 15,
 * table 3-7). ASCII is 1. */
static inline size_t lf_utf8_len(const unsigned char *s, size_t n) {
  const unsigned c = s[0];
  unsigned lo = 0x80, hi = 0xBF;
  size_t need;
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (n < need + 1 || s[1] < lo || s[1] > hi) return 0;
  for (size_t i = 2; i <= need; i++)
    if (s[i] < 0x80 || s[i] > 0xBF) return 0;
  return need + 1;
}

#endif

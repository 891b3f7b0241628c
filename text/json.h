/* A small JSON DOM parser (RFC 8259) for config files, safetensors headers and HTTP bodies.
 *
 * Input is length-bounded (no NUL terminator needed) and untrusted: the parser never reads past
 * len, limits nesting to LF_JSON_MAX_DEPTH, requires valid UTF-8, and reports the byte offset of
 * the first error. Strings are decoded to UTF-8 (escapes, \uXXXX surrogate pairs) and stored
 * NUL-terminated with an explicit length, since "\u0000" may put a NUL inside them.
 *
 * Lookups are linear: objects in configs and requests are small. Duplicate object keys are kept;
 * lf_json_get returns the last one (as Python's json does), iteration sees all of them.
 */
#ifndef LF_JSON_H
#define LF_JSON_H

#include <stddef.h>
#include <stdint.h>

#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LF_JSON_MAX_DEPTH 64

typedef enum lf_json_type {
  LF_JSON_NULL = 0,
  LF_JSON_BOOL,
  LF_JSON_NUMBER,
  LF_JSON_STRING,
  LF_JSON_ARRAY,
  LF_JSON_OBJECT,
} lf_json_type;

/* One value. Fields are readable, but prefer the accessors below (they are NULL-safe). */
typedef struct lf_json {
  lf_json_type type;
  int boolean;           /* LF_JSON_BOOL: 0 or 1 */
  int is_int;            /* LF_JSON_NUMBER: 1 when the value is integral and fits in int64 */
  double num;            /* LF_JSON_NUMBER */
  int64_t i64;           /* LF_JSON_NUMBER with is_int */
  char *str;             /* LF_JSON_STRING: [len + 1] UTF-8, NUL-terminated */
  size_t len;            /* LF_JSON_STRING: bytes; LF_JSON_ARRAY / OBJECT: number of items */
  struct lf_json *items; /* LF_JSON_ARRAY / OBJECT: [len] */
  char *key;             /* a member of an object: its name, [key_len + 1], NUL-terminated */
  size_t key_len;
} lf_json;

/* Parses text[0..len) as one JSON value (surrounding whitespace and a leading UTF-8 BOM are
 * allowed). On success *out owns the tree (free with lf_json_free). On failure *out is NULL,
 * the message ("... at byte N (line L, column C)") goes to err[errcap] when err is non-NULL and
 * to lf_last_error(); returns LF_ERR_FORMAT for bad input, LF_ERR_OUT_OF_MEMORY,
 * or LF_ERR_INVALID_ARG for NULL arguments. */
lf_status lf_json_parse(const char *text, size_t len, lf_json **out, char *err, size_t errcap);
void lf_json_free(lf_json *v);

/* LF_JSON_NULL for a NULL v as well: an absent key reads like null to callers that want that. */
lf_json_type lf_json_typeof(const lf_json *v);
const char *lf_json_type_str(lf_json_type t);
/* Items of an array or members of an object; 0 for anything else. */
size_t lf_json_len(const lf_json *v);
/* The last member named key (exact bytes), or NULL when v is not an object or lacks it. */
const lf_json *lf_json_get(const lf_json *obj, const char *key);
/* Item i of an array, or the value of member i of an object; NULL when out of range. */
const lf_json *lf_json_at(const lf_json *v, size_t i);
/* Name of member i of an object; NULL otherwise. */
const char *lf_json_key_at(const lf_json *obj, size_t i);

/* Typed reads: return 1 and store the value when v has that type, else return 0 and leave *out
 * alone. lf_json_int accepts only integral numbers that fit in int64 (1e3 does, 1.5 does not). */
int lf_json_bool(const lf_json *v, int *out);
int lf_json_num(const lf_json *v, double *out);
int lf_json_int(const lf_json *v, int64_t *out);
/* The string (NUL-terminated) or NULL; *len (when non-NULL) gets its length in bytes. */
const char *lf_json_str(const lf_json *v, size_t *len);

#ifdef __cplusplus
}
#endif
#endif

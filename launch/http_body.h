/* The JSON layer under the server's request parser (http_request.c): a request body parsed with
 * cJSON after the RFC 8259 checks cJSON leaves out, and typed, range-checked member reads that
 * set the OpenAI-style error (400) a client gets. Private to lfserve_http. */
#ifndef LF_LAUNCH_HTTP_BODY_H
#define LF_LAUNCH_HTTP_BODY_H

#include <cJSON.h>
#include <stddef.h>
#include <stdint.h>

#include "launch/http_request.h"

/* body[0..len) (no NUL terminator needed) as one JSON value; NULL with *err set when it is not.
 * Free with cJSON_Delete. */
cJSON *lfs_body_parse(const char *body, size_t len, lfs_error *err);

/* A member of an object (the first of that name); NULL when absent or v is not an object. */
const cJSON *lfs_json_member(const cJSON *v, const char *key);
/* Absent (NULL) or JSON null. */
int lfs_json_is_null(const cJSON *v);
/* Items of an array or members of an object (cJSON keeps them in a list: count once, then walk
 * with cJSON_ArrayForEach, never index); 0 for anything else. */
size_t lfs_json_count(const cJSON *v);
/* The string (NUL-terminated; the body check ruled out NULs inside) or NULL; *n gets its
 * length. */
const char *lfs_json_string(const cJSON *v, size_t *n);
/* An integral number in int64's range: 5, 5.0, 5e0 (not 5.5, 1e19, "5"); 1 read, 0 not one. */
int lfs_json_int(const cJSON *v, int64_t *out);

/* Members of root, read into *out: 0 absent or null, 1 read, -1 wrong type or out of range
 * (err set). An integer in [lo, hi]; a finite number in [lo, hi] ((lo, hi] when lo_open); a
 * boolean (0 / 1). */
int lfs_member_int(const cJSON *root, const char *key, int64_t lo, int64_t hi, int64_t *out,
                   lfs_error *err);
int lfs_member_num(const cJSON *root, const char *key, double lo, double hi, int lo_open,
                   double *out, lfs_error *err);
int lfs_member_bool(const cJSON *root, const char *key, int *out, lfs_error *err);

#endif

/* GGUF parser (see gguf.h). Reads with a cursor that checks every length against the bytes left
 * before using it; arrays grow as entries actually parse, so a count that the file cannot hold
 * fails before any allocation and one that it could hold costs memory only for the entries that
 * turn out to be there. */
#include "gguf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "quant.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the GGUF reader assumes a little-endian host"
#endif

#define GGUF_DEFAULT_ALIGNMENT 32
/* The fewest bytes a key/value pair (8-byte key length, 4-byte type, a 1-byte value) and a tensor
 * info (8-byte name length, 4-byte n_dims, 4-byte type, 8-byte offset) can take: bound the
 * header's counts by the bytes that follow. */
#define GGUF_MIN_KV_BYTES 13
#define GGUF_MIN_TENSOR_INFO_BYTES 24

typedef struct gguf_kv {
  lf_gguf_str key;
  lf_gguf_vtype type;
  lf_gguf_vtype elem_type;    /* arrays only */
  uint64_t n;                 /* arrays only: element count */
  const unsigned char *val;   /* scalar: its bytes; string: its length; array: element 0 */
  const unsigned char **strs; /* string arrays: element j's length prefix [n] */
} gguf_kv;

/* Sorted (name, index) pairs: duplicate detection and binary search. */
typedef struct name_ref {
  const char *p;
  uint64_t len;
  int64_t idx;
} name_ref;

struct lf_gguf {
  char *name;
  uint32_t version;
  uint64_t alignment, data_offset;
  int64_t n_kv, cap_kv;
  gguf_kv *kv;
  name_ref *kv_sorted; /* [n_kv] */
  int64_t n_t, cap_t;
  lf_gguf_tensor *t;
  name_ref *t_sorted; /* [n_t] */
};

typedef struct rd {
  const unsigned char *p;
  size_t size, pos;
  const char *name;
} rd;

static size_t rd_left(const rd *r) {
  return r->size - r->pos;
}

/* A string quoted for a message: at most 64 bytes, non-printable bytes as '?'. */
static const char *msg_str(lf_gguf_str s, char *buf, size_t cap) {
  size_t n = 0;
  for (uint64_t i = 0; i < s.len && n + 4 < cap && i < 64; i++) {
    unsigned char c = (unsigned char)s.ptr[i];
    buf[n++] = c >= 0x20 && c < 0x7F ? (char)c : '?';
  }
  if (s.len > 64 && n + 3 < cap) {
    memcpy(buf + n, "...", 3);
    n += 3;
  }
  buf[n] = '\0';
  return buf;
}

static lf_status rd_bytes(rd *r, size_t n, const unsigned char **out, const char *what) {
  if (n > rd_left(r))
    return lf_error(LF_ERR_FORMAT, "%s: truncated: %s at byte %zu needs %zu bytes, %zu left",
                    r->name, what, r->pos, n, rd_left(r));
  if (out) *out = r->p + r->pos;
  r->pos += n;
  return LF_OK;
}

static lf_status rd_u32(rd *r, uint32_t *v, const char *what) {
  const unsigned char *p = NULL;
  LF_TRY(rd_bytes(r, 4, &p, what));
  memcpy(v, p, 4);
  return LF_OK;
}

static lf_status rd_u64(rd *r, uint64_t *v, const char *what) {
  const unsigned char *p = NULL;
  LF_TRY(rd_bytes(r, 8, &p, what));
  memcpy(v, p, 8);
  return LF_OK;
}

static lf_status rd_str(rd *r, lf_gguf_str *s, const char *what) {
  uint64_t len;
  size_t at = r->pos;
  LF_TRY(rd_u64(r, &len, what));
  if (len > rd_left(r))
    return lf_error(LF_ERR_FORMAT,
                    "%s: %s: string length %llu at byte %zu runs past the end of the file (%zu "
                    "bytes left)",
                    r->name, what, (unsigned long long)len, at, rd_left(r));
  s->ptr = (const char *)r->p + r->pos;
  s->len = len;
  r->pos += (size_t)len;
  return LF_OK;
}

/* Bytes of a fixed-size value type; 0 for string, array and unknown types. */
static size_t vtype_size(uint32_t t) {
  switch (t) {
  case LF_GGUF_UINT8:
  case LF_GGUF_INT8:
  case LF_GGUF_BOOL:
    return 1;
  case LF_GGUF_UINT16:
  case LF_GGUF_INT16:
    return 2;
  case LF_GGUF_UINT32:
  case LF_GGUF_INT32:
  case LF_GGUF_FLOAT32:
    return 4;
  case LF_GGUF_UINT64:
  case LF_GGUF_INT64:
  case LF_GGUF_FLOAT64:
    return 8;
  }
  return 0;
}

const char *lf_gguf_vtype_str(lf_gguf_vtype t) {
  static const char *const names[] = {"uint8",  "int8",    "uint16", "int16",  "uint32",
                                      "int32",  "float32", "bool",   "string", "array",
                                      "uint64", "int64",   "float64"};
  if ((unsigned)t >= sizeof names / sizeof names[0]) return "?";
  return names[t];
}

/* Doubles *cap (starting from a small number) until it exceeds n; reallocs *arr accordingly. */
static int grow(void **arr, int64_t *cap, int64_t n, size_t elem) {
  if (n < *cap) return 1;
  int64_t nc = *cap ? *cap * 2 : 16;
  if ((uint64_t)nc > SIZE_MAX / elem) return 0;
  void *p = realloc(*arr, (size_t)nc * elem);
  if (!p) return 0;
  *arr = p;
  *cap = nc;
  return 1;
}

/* The value after a key: type, then a scalar, a string or an array. */
static lf_status parse_value(rd *r, gguf_kv *kv, const char *ctx) {
  uint32_t t;
  LF_TRY(rd_u32(r, &t, ctx));
  if (t > LF_GGUF_FLOAT64)
    return lf_error(LF_ERR_FORMAT, "%s: %s has unknown value type %u (at byte %zu)", r->name, ctx,
                    t, r->pos - 4);
  kv->type = (lf_gguf_vtype)t;
  kv->val = r->p + r->pos;
  if (t == LF_GGUF_STRING) {
    lf_gguf_str s;
    return rd_str(r, &s, ctx);
  }
  if (t != LF_GGUF_ARRAY) {
    const unsigned char *p = NULL;
    LF_TRY(rd_bytes(r, vtype_size(t), &p, ctx));
    if (t == LF_GGUF_BOOL && *p > 1)
      return lf_error(LF_ERR_FORMAT, "%s: %s: bool byte is %u, not 0 or 1", r->name, ctx, *p);
    return LF_OK;
  }
  uint32_t et;
  uint64_t n;
  LF_TRY(rd_u32(r, &et, ctx));
  LF_TRY(rd_u64(r, &n, ctx));
  if (et > LF_GGUF_FLOAT64)
    return lf_error(LF_ERR_FORMAT, "%s: %s is an array of unknown value type %u", r->name, ctx, et);
  if (et == LF_GGUF_ARRAY)
    return lf_error(LF_ERR_FORMAT, "%s: %s is an array of arrays (not supported)", r->name, ctx);
  kv->elem_type = (lf_gguf_vtype)et;
  kv->n = n;
  kv->val = r->p + r->pos;
  if (et == LF_GGUF_STRING) {
    if (n > rd_left(r) / 8)
      return lf_error(LF_ERR_FORMAT,
                      "%s: %s: array of %llu strings cannot fit in the %zu bytes left (truncated "
                      "or corrupt)",
                      r->name, ctx, (unsigned long long)n, rd_left(r));
    int64_t cap = 0;
    for (uint64_t j = 0; j < n; j++) {
      if (!grow((void **)&kv->strs, &cap, (int64_t)j, sizeof *kv->strs))
        return lf_error(LF_ERR_OUT_OF_MEMORY, "%s: %s: out of memory for %llu strings", r->name,
                        ctx, (unsigned long long)n);
      kv->strs[j] = r->p + r->pos;
      lf_gguf_str s;
      LF_TRY(rd_str(r, &s, ctx));
    }
    return LF_OK;
  }
  size_t es = vtype_size(et);
  if (n > rd_left(r) / es)
    return lf_error(LF_ERR_FORMAT,
                    "%s: %s: array of %llu %s values runs past the end of the file (%zu bytes "
                    "left)",
                    r->name, ctx, (unsigned long long)n, lf_gguf_vtype_str((lf_gguf_vtype)et),
                    rd_left(r));
  const unsigned char *p = NULL;
  LF_TRY(rd_bytes(r, (size_t)n * es, &p, ctx));
  if (et == LF_GGUF_BOOL)
    for (uint64_t j = 0; j < n; j++)
      if (p[j] > 1)
        return lf_error(LF_ERR_FORMAT, "%s: %s: bool element %llu is %u, not 0 or 1", r->name, ctx,
                        (unsigned long long)j, p[j]);
  return LF_OK;
}

static int ref_cmp(const void *a, const void *b) {
  const name_ref *x = a, *y = b;
  uint64_t n = x->len < y->len ? x->len : y->len;
  int c = n ? memcmp(x->p, y->p, (size_t)n) : 0;
  if (c) return c;
  return x->len < y->len ? -1 : x->len > y->len;
}

/* Sorts refs[n] and reports the first duplicate name as LF_ERR_FORMAT. */
static lf_status sort_unique(const char *file, name_ref *refs, int64_t n, const char *what) {
  if (n > 1) qsort(refs, (size_t)n, sizeof *refs, ref_cmp);
  for (int64_t i = 1; i < n; i++) {
    if (ref_cmp(&refs[i - 1], &refs[i]) == 0) {
      char b[80];
      return lf_error(LF_ERR_FORMAT, "%s: duplicate %s '%s'", file, what,
                      msg_str((lf_gguf_str){refs[i].p, refs[i].len}, b, sizeof b));
    }
  }
  return LF_OK;
}

static int64_t find_ref(const name_ref *refs, int64_t n, const char *name) {
  if (!name) return -1;
  name_ref key = {name, strlen(name), 0};
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    int64_t mid = lo + (hi - lo) / 2;
    int c = ref_cmp(&refs[mid], &key);
    if (c == 0) return refs[mid].idx;
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return -1;
}

static lf_status build_index(const char *file, name_ref **out, int64_t n, const char *what,
                             lf_gguf_str (*get)(const lf_gguf *, int64_t), const lf_gguf *g) {
  if (n == 0) return LF_OK;
  name_ref *refs = malloc((size_t)n * sizeof *refs);
  if (!refs) return lf_error(LF_ERR_OUT_OF_MEMORY, "%s: out of memory", file);
  for (int64_t i = 0; i < n; i++) {
    lf_gguf_str s = get(g, i);
    refs[i] = (name_ref){s.ptr, s.len, i};
  }
  *out = refs;
  return sort_unique(file, refs, n, what);
}

static lf_gguf_str tensor_name_at(const lf_gguf *g, int64_t i) {
  return g->t[i].name;
}

static lf_status parse_header(rd *r, lf_gguf *g, uint64_t *n_tensors, uint64_t *n_kv) {
  const unsigned char *magic = NULL;
  if (r->size < 4)
    return lf_error(LF_ERR_FORMAT, "%s: %zu bytes is too short for a GGUF file", r->name, r->size);
  LF_TRY(rd_bytes(r, 4, &magic, "magic"));
  if (memcmp(magic, "GGUF", 4) != 0)
    return lf_error(LF_ERR_FORMAT,
                    "%s: not a GGUF file (magic bytes %02x %02x %02x %02x, expected \"GGUF\")",
                    r->name, magic[0], magic[1], magic[2], magic[3]);
  LF_TRY(rd_u32(r, &g->version, "version"));
  if (g->version == 1)
    return lf_error(LF_ERR_UNSUPPORTED,
                    "%s: GGUF version 1 (32-bit counts, 2023) is not supported; convert the "
                    "model again with a current llama.cpp",
                    r->name);
  if (g->version != 2 && g->version != 3)
    return lf_error(g->version == 0 ? LF_ERR_FORMAT : LF_ERR_UNSUPPORTED,
                    "%s: GGUF version %u is not supported (2 and 3 are)", r->name, g->version);
  LF_TRY(rd_u64(r, n_tensors, "tensor count"));
  LF_TRY(rd_u64(r, n_kv, "metadata count"));
  if (*n_kv > rd_left(r) / GGUF_MIN_KV_BYTES)
    return lf_error(LF_ERR_FORMAT,
                    "%s: header says %llu metadata entries, but the %zu bytes left hold at most "
                    "%zu (truncated or corrupt)",
                    r->name, (unsigned long long)*n_kv, rd_left(r), rd_left(r) / GGUF_MIN_KV_BYTES);
  if (*n_tensors > rd_left(r) / GGUF_MIN_TENSOR_INFO_BYTES)
    return lf_error(LF_ERR_FORMAT,
                    "%s: header says %llu tensors, but the %zu bytes left hold at most %zu "
                    "tensor infos (truncated or corrupt)",
                    r->name, (unsigned long long)*n_tensors, rd_left(r),
                    rd_left(r) / GGUF_MIN_TENSOR_INFO_BYTES);
  return LF_OK;
}

static lf_status parse_kvs(rd *r, lf_gguf *g, uint64_t n) {
  for (uint64_t i = 0; i < n; i++) {
    if (!grow((void **)&g->kv, &g->cap_kv, g->n_kv, sizeof *g->kv))
      return lf_error(LF_ERR_OUT_OF_MEMORY, "%s: out of memory for metadata", r->name);
    gguf_kv *kv = &g->kv[g->n_kv];
    memset(kv, 0, sizeof *kv);
    g->n_kv++; /* counted now so that lf_gguf_free releases kv->strs on failure */
    char ctx[120];
    snprintf(ctx, sizeof ctx, "metadata entry %llu", (unsigned long long)i);
    LF_TRY(rd_str(r, &kv->key, ctx));
    char kb[80];
    snprintf(ctx, sizeof ctx, "key '%s'", msg_str(kv->key, kb, sizeof kb));
    LF_TRY(parse_value(r, kv, ctx));
  }
  return build_index(r->name, &g->kv_sorted, g->n_kv, "key", lf_gguf_kv_key, g);
}

static lf_status parse_alignment(const char *file, lf_gguf *g) {
  g->alignment = GGUF_DEFAULT_ALIGNMENT;
  int64_t i = lf_gguf_find_key(g, "general.alignment");
  if (i < 0) return LF_OK;
  int64_t a;
  LF_TRY(lf_gguf_kv_int(g, i, &a));
  if (a <= 0 || (a & (a - 1)) != 0)
    return lf_error(LF_ERR_FORMAT, "%s: general.alignment %lld is not a positive power of two",
                    file, (long long)a);
  g->alignment = (uint64_t)a;
  return LF_OK;
}

/* One tensor info up to its offset; the byte range is checked once the data section is known. */
static lf_status parse_tensor_info(rd *r, lf_gguf_tensor *t, uint64_t i) {
  char ctx[160], nb[80];
  snprintf(ctx, sizeof ctx, "tensor info %llu", (unsigned long long)i);
  LF_TRY(rd_str(r, &t->name, ctx));
  if (t->name.len == 0 || memchr(t->name.ptr, '\0', (size_t)t->name.len))
    return lf_error(LF_ERR_FORMAT, "%s: tensor %llu has an empty or NUL-containing name", r->name,
                    (unsigned long long)i);
  const char *tn = msg_str(t->name, nb, sizeof nb);
  snprintf(ctx, sizeof ctx, "tensor %s", tn);
  uint32_t nd;
  LF_TRY(rd_u32(r, &nd, ctx));
  if (nd > LF_GGUF_MAX_DIMS)
    return lf_error(LF_ERR_FORMAT, "%s: tensor %s has %u dimensions (at most %d)", r->name, tn, nd,
                    LF_GGUF_MAX_DIMS);
  t->n_dims = (int)nd;
  for (int d = 0; d < LF_GGUF_MAX_DIMS; d++)
    t->ne[d] = 1;
  for (uint32_t d = 0; d < nd; d++) {
    uint64_t v;
    LF_TRY(rd_u64(r, &v, ctx));
    if (v > (uint64_t)INT64_MAX)
      return lf_error(LF_ERR_FORMAT, "%s: tensor %s: ne[%u] = %lld is negative", r->name, tn, d,
                      (long long)v);
    t->ne[d] = (int64_t)v;
  }
  LF_TRY(rd_u32(r, &t->type, ctx));
  int64_t bs, ts;
  if (!lf_ggml_type_info(t->type, &bs, &ts))
    return lf_error(LF_ERR_UNSUPPORTED, "%s: tensor %s has unknown ggml type %u", r->name, tn,
                    t->type);
  LF_TRY(rd_u64(r, &t->offset, ctx));

  if (t->ne[0] % bs != 0)
    return lf_error(LF_ERR_FORMAT,
                    "%s: tensor %s: ne[0] = %lld is not a multiple of %s's %lld-element blocks",
                    r->name, tn, (long long)t->ne[0], lf_ggml_type_name(t->type), (long long)bs);
  /* Bytes = blocks per row * type size * the other dimensions, each step checked. */
  uint64_t nbytes = (uint64_t)(t->ne[0] / bs);
  int overflow = nbytes > UINT64_MAX / (uint64_t)ts;
  if (!overflow) nbytes *= (uint64_t)ts;
  for (int d = 1; d < LF_GGUF_MAX_DIMS && !overflow; d++) {
    uint64_t v = (uint64_t)t->ne[d];
    if (v != 0 && nbytes > UINT64_MAX / v)
      overflow = 1;
    else
      nbytes *= v;
  }
  /* The element count must fit int64 too (readers index with it). */
  int64_t numel = 1;
  for (int d = 0; d < LF_GGUF_MAX_DIMS && !overflow; d++) {
    if (t->ne[d] == 0) {
      numel = 0;
      break;
    }
    if (numel > INT64_MAX / t->ne[d])
      overflow = 1;
    else
      numel *= t->ne[d];
  }
  int zero = t->ne[0] == 0 || t->ne[1] == 0 || t->ne[2] == 0 || t->ne[3] == 0;
  if (overflow && !zero)
    return lf_error(LF_ERR_FORMAT, "%s: tensor %s: dimensions %lld x %lld x %lld x %lld overflow",
                    r->name, tn, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                    (long long)t->ne[3]);
  t->nbytes = zero ? 0 : nbytes;
  return LF_OK;
}

static lf_status parse_tensors(rd *r, lf_gguf *g, uint64_t n) {
  for (uint64_t i = 0; i < n; i++) {
    if (!grow((void **)&g->t, &g->cap_t, g->n_t, sizeof *g->t))
      return lf_error(LF_ERR_OUT_OF_MEMORY, "%s: out of memory for tensor infos", r->name);
    lf_gguf_tensor *t = &g->t[g->n_t];
    memset(t, 0, sizeof *t);
    LF_TRY(parse_tensor_info(r, t, i));
    g->n_t++;
  }
  LF_TRY(build_index(r->name, &g->t_sorted, g->n_t, "tensor", tensor_name_at, g));

  /* The data section starts at the first multiple of the alignment after the tensor infos. */
  uint64_t pos = r->pos, rem = pos % g->alignment;
  uint64_t pad = rem ? g->alignment - rem : 0;
  g->data_offset = pad > UINT64_MAX - pos ? UINT64_MAX : pos + pad;
  if (g->n_t == 0) return LF_OK;
  if (g->data_offset > r->size)
    return lf_error(LF_ERR_FORMAT,
                    "%s: the data section would start at byte %llu, past the end of the file "
                    "(%zu bytes)",
                    r->name, (unsigned long long)g->data_offset, r->size);
  const uint64_t data_size = r->size - g->data_offset;
  for (int64_t i = 0; i < g->n_t; i++) {
    lf_gguf_tensor *t = &g->t[i];
    char nb[80];
    if (t->offset % g->alignment != 0)
      return lf_error(LF_ERR_FORMAT,
                      "%s: tensor %s: offset %llu is not a multiple of the alignment %llu", r->name,
                      msg_str(t->name, nb, sizeof nb), (unsigned long long)t->offset,
                      (unsigned long long)g->alignment);
    if (t->offset > data_size || t->nbytes > data_size - t->offset)
      return lf_error(LF_ERR_FORMAT,
                      "%s: tensor %s: bytes [%llu, +%llu) of the data section run past its end "
                      "(%llu bytes; truncated?)",
                      r->name, msg_str(t->name, nb, sizeof nb), (unsigned long long)t->offset,
                      (unsigned long long)t->nbytes, (unsigned long long)data_size);
    t->data = r->p + g->data_offset + t->offset;
  }
  return LF_OK;
}

int lf_gguf_file_has_magic(const char *path) {
  char magic[4] = {0};
  FILE *f = path ? fopen(path, "rb") : NULL;
  const int yes = f && fread(magic, 1, 4, f) == 4 && memcmp(magic, "GGUF", 4) == 0;
  if (f) fclose(f);
  return yes;
}

lf_status lf_gguf_parse(const void *data, size_t size, const char *name, lf_gguf **out) {
  if (!out || (!data && size > 0))
    return lf_error(LF_ERR_INVALID_ARG, "lf_gguf_parse: NULL argument");
  *out = NULL;
  if (!name) name = "GGUF buffer";
  lf_gguf *g = calloc(1, sizeof *g);
  size_t nl = strlen(name);
  if (g) g->name = malloc(nl + 1);
  if (!g || !g->name) {
    free(g);
    return lf_error(LF_ERR_OUT_OF_MEMORY, "%s: out of memory", name);
  }
  memcpy(g->name, name, nl + 1);
  rd r = {.p = data, .size = size, .pos = 0, .name = g->name};
  uint64_t n_tensors = 0, n_kv = 0;
  lf_status st = parse_header(&r, g, &n_tensors, &n_kv);
  if (st == LF_OK) st = parse_kvs(&r, g, n_kv);
  if (st == LF_OK) st = parse_alignment(g->name, g);
  if (st == LF_OK) st = parse_tensors(&r, g, n_tensors);
  if (st != LF_OK) {
    lf_gguf_free(g);
    return st;
  }
  *out = g;
  return LF_OK;
}

void lf_gguf_free(lf_gguf *g) {
  if (!g) return;
  for (int64_t i = 0; i < g->n_kv; i++)
    free(g->kv[i].strs);
  free(g->kv);
  free(g->kv_sorted);
  free(g->t);
  free(g->t_sorted);
  free(g->name);
  free(g);
}

uint32_t lf_gguf_version(const lf_gguf *g) {
  return g ? g->version : 0;
}

uint64_t lf_gguf_alignment(const lf_gguf *g) {
  return g ? g->alignment : 0;
}

uint64_t lf_gguf_data_offset(const lf_gguf *g) {
  return g ? g->data_offset : 0;
}

lf_status lf_gguf_str_copy(lf_gguf_str s, char *buf, size_t cap) {
  if (!buf || cap == 0) return lf_error(LF_ERR_INVALID_ARG, "lf_gguf_str_copy: no buffer");
  if (s.len >= cap) {
    buf[0] = '\0';
    return lf_error(LF_ERR_INVALID_ARG, "GGUF string of %llu bytes does not fit in %zu",
                    (unsigned long long)s.len, cap);
  }
  if (s.len && memchr(s.ptr, '\0', (size_t)s.len)) {
    buf[0] = '\0';
    return lf_error(LF_ERR_FORMAT, "GGUF string contains a NUL byte");
  }
  if (s.len) memcpy(buf, s.ptr, (size_t)s.len);
  buf[s.len] = '\0';
  return LF_OK;
}

int lf_gguf_str_eq(lf_gguf_str s, const char *c) {
  if (!c) return 0;
  size_t n = strlen(c);
  return s.len == n && (n == 0 || memcmp(s.ptr, c, n) == 0);
}

/* ---- metadata ------------------------------------------------------------------------------ */

int64_t lf_gguf_kv_count(const lf_gguf *g) {
  return g ? g->n_kv : 0;
}

int64_t lf_gguf_find_key(const lf_gguf *g, const char *key) {
  return g ? find_ref(g->kv_sorted, g->n_kv, key) : -1;
}

lf_gguf_str lf_gguf_kv_key(const lf_gguf *g, int64_t i) {
  if (!g || i < 0 || i >= g->n_kv) return (lf_gguf_str){NULL, 0};
  return g->kv[i].key;
}

lf_gguf_vtype lf_gguf_kv_type(const lf_gguf *g, int64_t i) {
  if (!g || i < 0 || i >= g->n_kv) return (lf_gguf_vtype)-1;
  return g->kv[i].type;
}

/* 1 when t is an integer type; *out gets the value at p, *big is set for a uint64 > INT64_MAX. */
static int load_int(lf_gguf_vtype t, const unsigned char *p, int64_t *out, int *big) {
/* the value at p read as T (memcpy: p need not be aligned) */
#define LOAD_AS(T)                                                                                 \
  {                                                                                                \
    T v_;                                                                                          \
    memcpy(&v_, p, sizeof v_);                                                                     \
    *out = v_;                                                                                     \
    return 1;                                                                                      \
  }
  *big = 0;
  switch (t) {
  case LF_GGUF_UINT8:
    LOAD_AS(uint8_t)
  case LF_GGUF_INT8:
    LOAD_AS(int8_t)
  case LF_GGUF_UINT16:
    LOAD_AS(uint16_t)
  case LF_GGUF_INT16:
    LOAD_AS(int16_t)
  case LF_GGUF_UINT32:
    LOAD_AS(uint32_t)
  case LF_GGUF_INT32:
    LOAD_AS(int32_t)
  case LF_GGUF_INT64:
    LOAD_AS(int64_t)
  case LF_GGUF_UINT64: {
    uint64_t v;
    memcpy(&v, p, 8);
    *big = v > (uint64_t)INT64_MAX;
    *out = *big ? INT64_MAX : (int64_t)v;
    return 1;
  }
  default:
    return 0;
  }
#undef LOAD_AS
}

static int load_float(lf_gguf_vtype t, const unsigned char *p, double *out) {
  if (t == LF_GGUF_FLOAT32) {
    float v;
    memcpy(&v, p, 4);
    *out = v;
    return 1;
  }
  if (t == LF_GGUF_FLOAT64) {
    memcpy(out, p, 8);
    return 1;
  }
  int64_t i = -1;
  int big;
  if (!load_int(t, p, &i, &big)) return 0;
  if (big) {
    uint64_t u;
    memcpy(&u, p, 8);
    *out = (double)u;
  } else {
    *out = (double)i;
  }
  return 1;
}

static lf_gguf_str str_at(const unsigned char *p) {
  uint64_t len;
  memcpy(&len, p, 8);
  return (lf_gguf_str){(const char *)p + 8, len};
}

/* One value to read: a key's scalar, or element j of a key's array (elem set). */
typedef struct val_ref {
  const gguf_kv *kv;
  lf_gguf_vtype type;
  const unsigned char *p;
  int elem;
} val_ref;

static lf_status kv_ref(const lf_gguf *g, int64_t i, val_ref *r) {
  if (!g || i < 0 || i >= g->n_kv)
    return lf_error(LF_ERR_INVALID_ARG, "GGUF metadata index %lld out of range", (long long)i);
  r->kv = &g->kv[i];
  r->type = r->kv->type;
  r->p = r->kv->val;
  r->elem = 0;
  return LF_OK;
}

static lf_status type_error(const lf_gguf *g, const val_ref *r, const char *want) {
  char kb[80];
  const gguf_kv *kv = r->kv;
  if (r->elem)
    return lf_error(LF_ERR_FORMAT, "%s: key %s is an array of %s, not of %s", g->name,
                    msg_str(kv->key, kb, sizeof kb), lf_gguf_vtype_str(kv->elem_type), want);
  return lf_error(
      LF_ERR_FORMAT, "%s: key %s is %s %s, not %s", g->name, msg_str(kv->key, kb, sizeof kb),
      kv->type == LF_GGUF_ARRAY || kv->type == LF_GGUF_INT8 || kv->type == LF_GGUF_INT16 ||
              kv->type == LF_GGUF_INT32 || kv->type == LF_GGUF_INT64
          ? "an"
          : "a",
      lf_gguf_vtype_str(kv->type), want);
}

lf_status lf_gguf_arr_info(const lf_gguf *g, int64_t i, lf_gguf_vtype *elem_type, uint64_t *n) {
  val_ref r = {0};
  LF_TRY(kv_ref(g, i, &r));
  if (r.type != LF_GGUF_ARRAY) return type_error(g, &r, "an array");
  if (elem_type) *elem_type = r.kv->elem_type;
  if (n) *n = r.kv->n;
  return LF_OK;
}

/* The array element j of key i. */
static lf_status elem_ref(const lf_gguf *g, int64_t i, uint64_t j, val_ref *r) {
  LF_TRY(lf_gguf_arr_info(g, i, NULL, NULL));
  const gguf_kv *kv = &g->kv[i];
  if (j >= kv->n) {
    char kb[80];
    return lf_error(LF_ERR_INVALID_ARG, "%s: key %s: index %llu outside its %llu elements", g->name,
                    msg_str(kv->key, kb, sizeof kb), (unsigned long long)j,
                    (unsigned long long)kv->n);
  }
  r->kv = kv;
  r->type = kv->elem_type;
  r->p = kv->elem_type == LF_GGUF_STRING ? kv->strs[j]
                                         : kv->val + (size_t)j * vtype_size(kv->elem_type);
  r->elem = 1;
  return LF_OK;
}

static lf_status key_ref(const lf_gguf *g, const char *key, val_ref *r) {
  if (!g || !key) return lf_error(LF_ERR_INVALID_ARG, "GGUF key lookup: NULL argument");
  const int64_t i = lf_gguf_find_key(g, key);
  if (i < 0) return lf_error(LF_ERR_NOT_FOUND, "%s: no metadata key %s", g->name, key);
  return kv_ref(g, i, r);
}

/* The readers by value type; each names what it wants for a scalar and for an array. */
static lf_status read_int(const lf_gguf *g, const val_ref *r, int64_t *out) {
  int big;
  if (!load_int(r->type, r->p, out, &big))
    return type_error(g, r, r->elem ? "integers" : "an integer");
  if (big) {
    char kb[80];
    return lf_error(LF_ERR_FORMAT, "%s: key %s holds a uint64 above the int64 range", g->name,
                    msg_str(r->kv->key, kb, sizeof kb));
  }
  return LF_OK;
}

static lf_status read_float(const lf_gguf *g, const val_ref *r, double *out) {
  if (!load_float(r->type, r->p, out)) return type_error(g, r, r->elem ? "numbers" : "a number");
  return LF_OK;
}

static lf_status read_bool(const lf_gguf *g, const val_ref *r, int *out) {
  if (r->type != LF_GGUF_BOOL) return type_error(g, r, r->elem ? "bools" : "a bool");
  *out = r->p[0];
  return LF_OK;
}

static lf_status read_str(const lf_gguf *g, const val_ref *r, lf_gguf_str *out) {
  if (r->type != LF_GGUF_STRING) return type_error(g, r, r->elem ? "strings" : "a string");
  *out = str_at(r->p);
  return LF_OK;
}

/* lf_gguf_kv_<name> (by index), lf_gguf_arr_<name> (array element) and lf_gguf_get_<name> (by
 * key) for one value type T (gguf.h): locate the value, then read it with read_<name>. */
#define GGUF_READERS(name, T)                                                                      \
  lf_status lf_gguf_kv_##name(const lf_gguf *g, int64_t i, T *out) {                               \
    val_ref r = {0};                                                                               \
    LF_TRY(kv_ref(g, i, &r));                                                                      \
    return read_##name(g, &r, out);                                                                \
  }                                                                                                \
  lf_status lf_gguf_arr_##name(const lf_gguf *g, int64_t i, uint64_t j, T *out) {                  \
    val_ref r = {0};                                                                               \
    LF_TRY(elem_ref(g, i, j, &r));                                                                 \
    return read_##name(g, &r, out);                                                                \
  }                                                                                                \
  lf_status lf_gguf_get_##name(const lf_gguf *g, const char *key, T *out) {                        \
    val_ref r = {0};                                                                               \
    LF_TRY(key_ref(g, key, &r));                                                                   \
    return read_##name(g, &r, out);                                                                \
  }

GGUF_READERS(int, int64_t)
GGUF_READERS(float, double)
GGUF_READERS(bool, int)
GGUF_READERS(str, lf_gguf_str)
#undef GGUF_READERS

/* ---- tensors ------------------------------------------------------------------------------- */

int64_t lf_gguf_tensor_count(const lf_gguf *g) {
  return g ? g->n_t : 0;
}

const lf_gguf_tensor *lf_gguf_tensor_at(const lf_gguf *g, int64_t i) {
  if (!g || i < 0 || i >= g->n_t) return NULL;
  return &g->t[i];
}

int64_t lf_gguf_find_tensor(const lf_gguf *g, const char *name) {
  return g ? find_ref(g->t_sorted, g->n_t, name) : -1;
}

/* GGUF (llama.cpp's checkpoint format, versions 2 and 3): a bounds-checked parser over a memory
 * buffer, metadata accessors and tensor descriptions.
 *
 * File: "GGUF", u32 version, u64 tensor_count, u64 kv_count, the key/value pairs, the tensor
 * infos, padding to general.alignment (default 32), then the data section. All little-endian;
 * strings are a u64 length and that many bytes, not NUL-terminated.
 *
 * Every count, length and offset is checked against the bytes that remain before anything is
 * allocated, so a corrupt or hostile file gives LF_ERR_FORMAT, never a huge allocation. Tensors
 * of a ggml type that the parser does not know (quant.h: lf_ggml_type_name is NULL) are refused
 * at parse (LF_ERR_UNSUPPORTED, naming tensor and type); known types that lfserve cannot
 * dequantize parse fine, their byte ranges checked, and are refused by whoever converts them
 * (lf_gguf_tensor_set_load in tensor.h). Duplicate keys or tensor names are LF_ERR_FORMAT, as
 * are arrays of arrays, which no GGUF writer in use produces.
 *
 * Dimensions keep ggml's order: ne[0] is the innermost (contiguous) one, so a Hugging Face
 * [out][in] weight has ne = {in, out}. */
#ifndef LF_GGUF_H
#define LF_GGUF_H

#include <stddef.h>
#include <stdint.h>

#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum lf_gguf_vtype {
  LF_GGUF_UINT8 = 0,
  LF_GGUF_INT8 = 1,
  LF_GGUF_UINT16 = 2,
  LF_GGUF_INT16 = 3,
  LF_GGUF_UINT32 = 4,
  LF_GGUF_INT32 = 5,
  LF_GGUF_FLOAT32 = 6,
  LF_GGUF_BOOL = 7,
  LF_GGUF_STRING = 8,
  LF_GGUF_ARRAY = 9,
  LF_GGUF_UINT64 = 10,
  LF_GGUF_INT64 = 11,
  LF_GGUF_FLOAT64 = 12,
} lf_gguf_vtype;

/* A string inside the buffer: len bytes at ptr, no terminating NUL, may contain any bytes. */
typedef struct lf_gguf_str {
  const char *ptr;
  uint64_t len;
} lf_gguf_str;

#define LF_GGUF_MAX_DIMS 4

typedef struct lf_gguf_tensor {
  lf_gguf_str name;             /* non-empty, no NUL bytes */
  int n_dims;                   /* 0..4 */
  int64_t ne[LF_GGUF_MAX_DIMS]; /* ne[0] innermost; 1 beyond n_dims */
  uint32_t type;                /* ggml type number (quant.h) */
  uint64_t offset;              /* in the data section, a multiple of the alignment */
  const void *data;             /* inside the buffer */
  uint64_t nbytes;              /* [data, data + nbytes) lies inside the buffer */
} lf_gguf_tensor;

typedef struct lf_gguf lf_gguf;

/* Parses size bytes at data; name is used in messages (copied). The result points into data,
 * which must outlive it. */
lf_status lf_gguf_parse(const void *data, size_t size, const char *name, lf_gguf **out);
void lf_gguf_free(lf_gguf *g);
/* 1 when path is a regular file that starts with the GGUF magic (how a checkpoint path is told
 * apart from a llama2.c file). */
int lf_gguf_file_has_magic(const char *path);

uint32_t lf_gguf_version(const lf_gguf *g);
uint64_t lf_gguf_alignment(const lf_gguf *g);
/* Byte offset of the data section in the buffer. */
uint64_t lf_gguf_data_offset(const lf_gguf *g);
const char *lf_gguf_vtype_str(lf_gguf_vtype t); /* "uint32", "string", ...; "?" if unknown */

/* Copies s into buf[cap] with a terminating NUL. LF_ERR_INVALID_ARG when it does not fit,
 * LF_ERR_FORMAT when s contains a NUL byte (use ptr/len for such strings). */
lf_status lf_gguf_str_copy(lf_gguf_str s, char *buf, size_t cap);
/* 1 when s equals the C string c. */
int lf_gguf_str_eq(lf_gguf_str s, const char *c);

/* ---- metadata: by index (0 <= i < lf_gguf_kv_count) ---------------------------------------- */

int64_t lf_gguf_kv_count(const lf_gguf *g);
/* Index of the key, or -1 when absent (a binary search). */
int64_t lf_gguf_find_key(const lf_gguf *g, const char *key);
lf_gguf_str lf_gguf_kv_key(const lf_gguf *g, int64_t i);    /* {NULL, 0} when i is out of range */
lf_gguf_vtype lf_gguf_kv_type(const lf_gguf *g, int64_t i); /* LF_GGUF_ARRAY for arrays */

/* Scalar values, type-checked: a wrong type is LF_ERR_FORMAT naming key and types, an index out
 * of range LF_ERR_INVALID_ARG.
 * _int: any integer type (not bool); a uint64 above INT64_MAX is LF_ERR_FORMAT.
 * _float: float32, float64, or any integer type (converted).
 * _bool: bool only (stored as 0 or 1; other bytes are refused at parse).
 * _str: string only. */
lf_status lf_gguf_kv_int(const lf_gguf *g, int64_t i, int64_t *out);
lf_status lf_gguf_kv_float(const lf_gguf *g, int64_t i, double *out);
lf_status lf_gguf_kv_bool(const lf_gguf *g, int64_t i, int *out);
lf_status lf_gguf_kv_str(const lf_gguf *g, int64_t i, lf_gguf_str *out);

/* Arrays: element type and length (LF_ERR_FORMAT if the value is not an array); element j,
 * type-checked as the scalar getters are (j out of range: LF_ERR_INVALID_ARG). */
lf_status lf_gguf_arr_info(const lf_gguf *g, int64_t i, lf_gguf_vtype *elem_type, uint64_t *n);
lf_status lf_gguf_arr_int(const lf_gguf *g, int64_t i, uint64_t j, int64_t *out);
lf_status lf_gguf_arr_float(const lf_gguf *g, int64_t i, uint64_t j, double *out);
lf_status lf_gguf_arr_bool(const lf_gguf *g, int64_t i, uint64_t j, int *out);
lf_status lf_gguf_arr_str(const lf_gguf *g, int64_t i, uint64_t j, lf_gguf_str *out);

/* ---- metadata: by key ---------------------------------------------------------------------- */
/* As the _kv_ getters; an absent key is LF_ERR_NOT_FOUND (with a message naming it). */
lf_status lf_gguf_get_int(const lf_gguf *g, const char *key, int64_t *out);
lf_status lf_gguf_get_float(const lf_gguf *g, const char *key, double *out);
lf_status lf_gguf_get_bool(const lf_gguf *g, const char *key, int *out);
lf_status lf_gguf_get_str(const lf_gguf *g, const char *key, lf_gguf_str *out);

/* ---- tensors ------------------------------------------------------------------------------- */

int64_t lf_gguf_tensor_count(const lf_gguf *g);
/* NULL when i is out of range. */
const lf_gguf_tensor *lf_gguf_tensor_at(const lf_gguf *g, int64_t i);
/* Index of the tensor, or -1 when absent (a binary search). */
int64_t lf_gguf_find_tensor(const lf_gguf *g, const char *name);

#ifdef __cplusplus
}
#endif
#endif

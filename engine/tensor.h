/* Checkpoint tensors, mmap'd and described before any of them is converted.
 *
 * Every loader (safetensors, llama2.c) fills an lf_tensor_set with Hugging Face names
 * ("model.layers.0.self_attn.q_proj.weight", ...) pointing into mapped files; weights.c then
 * validates names and shapes once for all formats and converts (slices of) them to fp32.
 */
#ifndef LF_TENSOR_H
#define LF_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum lf_dtype { LF_DTYPE_F32 = 0, LF_DTYPE_F16, LF_DTYPE_BF16 } lf_dtype;

const char *lf_dtype_str(lf_dtype t);
size_t lf_dtype_size(lf_dtype t);

#define LF_TENSOR_MAX_DIMS 4
#define LF_TENSOR_NAME_MAX 160

typedef struct lf_tensor_src {
  char name[LF_TENSOR_NAME_MAX];
  lf_dtype dtype;
  int ndim;
  int64_t shape[LF_TENSOR_MAX_DIMS];
  const void *data;  /* inside a mapping of the set; nbytes = numel * dtype size, in bounds */
  const char *file;  /* the file it lives in (owned by the set) */
} lf_tensor_src;

typedef struct lf_mapping {
  char *path;
  void *addr;
  size_t size;
} lf_mapping;

typedef struct lf_tensor_set {
  lf_tensor_src *t; /* [n] */
  int n, cap;
  lf_mapping *maps; /* [n_maps] files kept mapped while the set lives */
  int n_maps, cap_maps;
} lf_tensor_set;

void lf_tensor_set_free(lf_tensor_set *s);
/* Maps a whole file read-only; the set owns the mapping. *idx receives its index in maps. */
lf_status lf_tensor_set_map_file(lf_tensor_set *s, const char *path, int *idx);
/* Appends a tensor description (copied). Duplicate names are a format error. */
lf_status lf_tensor_set_add(lf_tensor_set *s, const lf_tensor_src *t);
/* NULL when absent. */
const lf_tensor_src *lf_tensor_set_find(const lf_tensor_set *s, const char *name);

int64_t lf_tensor_numel(const lf_tensor_src *t);

/* Reads rows [row0, row0+nrows) x cols [col0, col0+ncols) of a 2-D tensor (a 1-D tensor is one
 * row) into dst [nrows][ncols] as fp32. Bounds are checked. */
lf_status lf_tensor_read_f32(const lf_tensor_src *t, int64_t row0, int64_t nrows, int64_t col0,
                             int64_t ncols, float *dst);

float lf_bf16_to_f32(uint16_t h);
float lf_f16_to_f32(uint16_t h);
uint16_t lf_f32_to_bf16(float f); /* round to nearest even */

/* Parses one .safetensors file into the set (tensors named as in the file). */
lf_status lf_safetensors_load(lf_tensor_set *s, const char *path);

#ifdef __cplusplus
}
#endif
#endif

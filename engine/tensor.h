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

#include "base/bf16.h"
#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Plain element types, then ggml's block-quantized ones (GGUF files; quant.h has the layouts):
 * a row of a block type is a sequence of blocks of lf_dtype_block_size elements. */
typedef enum lf_dtype {
  LF_DTYPE_F32 = 0,
  LF_DTYPE_F16,
  LF_DTYPE_BF16,
  LF_DTYPE_Q4_0,
  LF_DTYPE_Q4_1,
  LF_DTYPE_Q8_0,
  LF_DTYPE_Q4_K,
  LF_DTYPE_Q5_K,
  LF_DTYPE_Q6_K,
} lf_dtype;

const char *lf_dtype_str(lf_dtype t);
/* Bytes per element of a plain type; 0 for block types (see lf_dtype_row_bytes). */
size_t lf_dtype_size(lf_dtype t);
/* Elements per block: 1 for plain types, 32 or 256 for block types; 0 for an invalid dtype. */
int64_t lf_dtype_block_size(lf_dtype t);
/* Bytes of a row of ncols elements; 0 when ncols is negative or not a multiple of the block
 * size (or the dtype is invalid, or the size overflows). */
size_t lf_dtype_row_bytes(lf_dtype t, int64_t ncols);

#define LF_TENSOR_MAX_DIMS 4
#define LF_TENSOR_NAME_MAX 160

typedef struct lf_tensor_src {
  char name[LF_TENSOR_NAME_MAX];
  lf_dtype dtype;
  int ndim;
  int64_t shape[LF_TENSOR_MAX_DIMS];
  const void *data; /* inside a mapping of the set; nbytes = rows * lf_dtype_row_bytes(cols)
                       (numel * dtype size for plain types), in bounds */
  const char *file; /* the file it lives in (owned by the set) */
  /* 0, or the number of heads when the rows are stored in llama.cpp's Q/K rotary order
   * (convert_hf_to_gguf.py's permute): with hd = rows / row_perm_heads, Hugging Face row
   * h*hd + i*(hd/2) + j (i in {0, 1}, j < hd/2) is stored as row h*hd + 2*j + i.
   * lf_tensor_read_f32 undoes it, so readers see the Hugging Face layout. For a 1-D tensor (a
   * q/k bias) the elements are the rows. */
  int row_perm_heads;
  /* NULL, or a low-rank update that lf_tensor_read_f32 adds to every value it reads: a LoRA
   * adapter merged at load (engine/lora.c). Owned by whoever attached it (the checkpoint). */
  const struct lf_tensor_lowrank *lowrank;
} lf_tensor_src;

/* W + u·v for a [rows][cols] matrix W, in the Hugging Face layout (after any row_perm_heads is
 * undone): element (r, c) gains sum_k u[r][k] * v[k][c], summed in fp32 over k = 0..rank-1 in
 * order and added to W's value once. The sum depends only on (r, c), so any block read (a
 * tensor-parallel slice, a chunk of rows) gets the same values as the whole matrix. */
typedef struct lf_tensor_lowrank {
  int64_t rows, cols;
  int rank;
  const float *u; /* [rows][rank], any scale already folded in */
  const float *v; /* [rank][cols] */
} lf_tensor_lowrank;

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
 * row) into dst [nrows][ncols] as fp32, dequantizing block types, undoing row_perm_heads and
 * adding the lowrank update, if any. Bounds are checked. */
lf_status lf_tensor_read_f32(const lf_tensor_src *t, int64_t row0, int64_t nrows, int64_t col0,
                             int64_t ncols, float *dst);


/* Parses one .safetensors file into the set (tensors named as in the file). */
lf_status lf_safetensors_load(lf_tensor_set *s, const char *path);

struct lf_gguf;
/* Maps a GGUF file into the set and adds every tensor under its GGUF name
 * ("blk.0.attn_q.weight"), its shape in row-major (Hugging Face) order, i.e. ne reversed:
 * [ne[1]][ne[0]] for a matrix. A tensor of a ggml type without an lf_dtype is
 * LF_ERR_UNSUPPORTED (naming tensor and type), a name of LF_TENSOR_NAME_MAX bytes or more
 * LF_ERR_FORMAT. On success *meta (if not NULL) receives the parsed file for its metadata, to be
 * freed with lf_gguf_free; it points into the set's mapping, so it is usable only while the set
 * lives. On failure the set is left as it was and *meta is NULL. */
lf_status lf_gguf_tensor_set_load(lf_tensor_set *s, const char *path, struct lf_gguf **meta);

#ifdef __cplusplus
}
#endif
#endif

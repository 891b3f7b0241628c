/* O_CLOEXEC, mmap, fstat: POSIX.1-2008, also under -std=c11. */
#define _POSIX_C_SOURCE 200809L

#include "tensor.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/error.h"
#include "gguf.h"
#include "text/json.h"
#include "quant.h"

#ifdef LF_HAVE_OPENMP
#include <omp.h>
#endif

/* Checkpoint files are little-endian and read by memcpy of their bytes. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "lfserve's checkpoint readers assume a little-endian host"
#endif

const char *lf_dtype_str(lf_dtype t) {
  switch (t) {
  case LF_DTYPE_F32:
    return "F32";
  case LF_DTYPE_F16:
    return "F16";
  case LF_DTYPE_BF16:
    return "BF16";
  case LF_DTYPE_Q4_0:
    return "Q4_0";
  case LF_DTYPE_Q4_1:
    return "Q4_1";
  case LF_DTYPE_Q8_0:
    return "Q8_0";
  case LF_DTYPE_Q4_K:
    return "Q4_K";
  case LF_DTYPE_Q5_K:
    return "Q5_K";
  case LF_DTYPE_Q6_K:
    return "Q6_K";
  }
  return "?";
}

size_t lf_dtype_size(lf_dtype t) {
  switch (t) {
  case LF_DTYPE_F32:
    return 4;
  case LF_DTYPE_F16:
    return 2;
  case LF_DTYPE_BF16:
    return 2;
  default:
    return 0;
  }
}

/* The ggml type number of each lf_dtype (quant.h dequantizes by it); -1 for an invalid dtype. */
static int64_t dtype_ggml(lf_dtype t) {
  switch (t) {
  case LF_DTYPE_F32:
    return LF_GGML_F32;
  case LF_DTYPE_F16:
    return LF_GGML_F16;
  case LF_DTYPE_BF16:
    return LF_GGML_BF16;
  case LF_DTYPE_Q4_0:
    return LF_GGML_Q4_0;
  case LF_DTYPE_Q4_1:
    return LF_GGML_Q4_1;
  case LF_DTYPE_Q8_0:
    return LF_GGML_Q8_0;
  case LF_DTYPE_Q4_K:
    return LF_GGML_Q4_K;
  case LF_DTYPE_Q5_K:
    return LF_GGML_Q5_K;
  case LF_DTYPE_Q6_K:
    return LF_GGML_Q6_K;
  }
  return -1;
}

int64_t lf_dtype_block_size(lf_dtype t) {
  int64_t g = dtype_ggml(t), bs;
  if (g < 0 || !lf_ggml_type_info((uint32_t)g, &bs, NULL)) return 0;
  return bs;
}

size_t lf_dtype_row_bytes(lf_dtype t, int64_t ncols) {
  int64_t g = dtype_ggml(t);
  int64_t b = g < 0 ? -1 : lf_quant_row_bytes((uint32_t)g, ncols);
  if (b < 0 || (uint64_t)b > SIZE_MAX) return 0;
  return (size_t)b;
}


void lf_tensor_set_free(lf_tensor_set *s) {
  if (!s) return;
  for (int i = 0; i < s->n_maps; i++) {
    if (s->maps[i].addr) munmap(s->maps[i].addr, s->maps[i].size);
    free(s->maps[i].path);
  }
  free(s->maps);
  free(s->t);
  memset(s, 0, sizeof *s);
}

lf_status lf_tensor_set_map_file(lf_tensor_set *s, const char *path, int *idx) {
  if (!s || !path) return lf_error(LF_ERR_INVALID_ARG, "lf_tensor_set_map_file: NULL argument");
  if (s->n_maps == s->cap_maps) {
    int nc = s->cap_maps ? s->cap_maps * 2 : 4;
    lf_mapping *nm = realloc(s->maps, (size_t)nc * sizeof *nm);
    if (!nm) return lf_error(LF_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    s->maps = nm;
    s->cap_maps = nc;
  }
  size_t plen = strlen(path);
  char *pcopy = malloc(plen + 1);
  if (!pcopy) return lf_error(LF_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
  memcpy(pcopy, path, plen + 1);

  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    free(pcopy);
    return lf_error(LF_ERR_IO, "%s: cannot open: %s", path, strerror(e));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int e = errno;
    close(fd);
    free(pcopy);
    return lf_error(LF_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    free(pcopy);
    return lf_error(LF_ERR_IO, "%s: not a regular file", path);
  }
  if ((uint64_t)st.st_size > (uint64_t)SIZE_MAX) {
    close(fd);
    free(pcopy);
    return lf_error(LF_ERR_IO, "%s: too large to map", path);
  }
  size_t size = (size_t)st.st_size;
  void *addr = NULL;
  /* mmap of length 0 is an error; an empty file is mapped as (NULL, 0) and rejected by the
   * format readers with a better message than EINVAL. */
  if (size > 0) {
    addr = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (addr == MAP_FAILED) {
      int e = errno;
      close(fd);
      free(pcopy);
      return lf_error(LF_ERR_IO, "%s: cannot mmap %zu bytes: %s", path, size, strerror(e));
    }
  }
  close(fd); /* the mapping keeps the file alive */
  s->maps[s->n_maps] = (lf_mapping){.path = pcopy, .addr = addr, .size = size};
  if (idx) *idx = s->n_maps;
  s->n_maps++;
  return LF_OK;
}

const lf_tensor_src *lf_tensor_set_find(const lf_tensor_set *s, const char *name) {
  if (!s || !name) return NULL;
  for (int i = 0; i < s->n; i++)
    if (strcmp(s->t[i].name, name) == 0) return &s->t[i];
  return NULL;
}

lf_status lf_tensor_set_add(lf_tensor_set *s, const lf_tensor_src *t) {
  if (!s || !t) return lf_error(LF_ERR_INVALID_ARG, "lf_tensor_set_add: NULL argument");
  if (memchr(t->name, '\0', sizeof t->name) == NULL || t->name[0] == '\0')
    return lf_error(LF_ERR_INVALID_ARG, "lf_tensor_set_add: bad tensor name");
  if (t->ndim < 0 || t->ndim > LF_TENSOR_MAX_DIMS)
    return lf_error(LF_ERR_INVALID_ARG, "lf_tensor_set_add: %s has rank %d", t->name, t->ndim);
  for (int d = 0; d < t->ndim; d++)
    if (t->shape[d] < 0)
      return lf_error(LF_ERR_INVALID_ARG, "lf_tensor_set_add: %s has a negative dimension",
                      t->name);
  const lf_tensor_src *old = lf_tensor_set_find(s, t->name);
  if (old) {
    return lf_error(LF_ERR_FORMAT, "%s: duplicate tensor %s (also in %s)", t->file ? t->file : "?",
                    t->name, old->file ? old->file : "?");
  }
  if (s->n == s->cap) {
    if (s->cap > INT_MAX / 2) return lf_error(LF_ERR_OUT_OF_MEMORY, "too many tensors");
    int nc = s->cap ? s->cap * 2 : 64;
    lf_tensor_src *nt = realloc(s->t, (size_t)nc * sizeof *nt);
    if (!nt) return lf_error(LF_ERR_OUT_OF_MEMORY, "out of memory adding tensor %s", t->name);
    s->t = nt;
    s->cap = nc;
  }
  s->t[s->n++] = *t;
  return LF_OK;
}

int64_t lf_tensor_numel(const lf_tensor_src *t) {
  int64_t n = 1;
  for (int d = 0; d < t->ndim; d++)
    n *= t->shape[d];
  return n;
}

/* The stored row of Hugging Face row r of a tensor in llama.cpp's rotary order with heads of hd
 * rows (see row_perm_heads in tensor.h): r = h*hd + i*(hd/2) + j is stored at h*hd + 2*j + i. */
static int64_t perm_row(int64_t r, int64_t hd) {
  const int64_t half = hd / 2, h = r / hd, k = r % hd;
  return h * hd + 2 * (k % half) + k / half;
}

/* Columns [col0, col0+ncols) of a block-typed row (or, with perm_hd, of a whole 1-D tensor in
 * rotary order) into out[ncols]: the blocks covering the range are dequantized, into scratch
 * when the range does not start and end on block boundaries. */
static lf_status read_block_row(const lf_tensor_src *t, uint32_t type, const unsigned char *row,
                                int64_t cols, int64_t col0, int64_t ncols, int64_t perm_hd,
                                float *scratch, float *out) {
  const int64_t bs = lf_dtype_block_size(t->dtype);
  const size_t block_bytes = lf_dtype_row_bytes(t->dtype, bs);
  if (perm_hd) {
    LF_TRY(lf_quant_dequant_row(type, row, cols, scratch));
    for (int64_t c = 0; c < ncols; c++)
      out[c] = scratch[perm_row(col0 + c, perm_hd)];
    return LF_OK;
  }
  const int64_t b0 = col0 / bs, b1 = (col0 + ncols + bs - 1) / bs;
  const unsigned char *src = row + (size_t)b0 * block_bytes;
  if (b0 * bs == col0 && b1 * bs == col0 + ncols)
    return lf_quant_dequant_row(type, src, ncols, out);
  LF_TRY(lf_quant_dequant_row(type, src, (b1 - b0) * bs, scratch));
  memcpy(out, scratch + (col0 - b0 * bs), (size_t)ncols * sizeof *out);
  return LF_OK;
}

/* The stored values of the block (tensor.h: lf_tensor_read_f32 without the lowrank update). */
static lf_status read_stored_f32(const lf_tensor_src *t, int64_t row0, int64_t nrows, int64_t col0,
                                 int64_t ncols, float *dst) {
  int64_t rows, cols;
  if (t->ndim == 1) {
    rows = 1;
    cols = t->shape[0];
  } else if (t->ndim == 2) {
    rows = t->shape[0];
    cols = t->shape[1];
  } else {
    return lf_error(LF_ERR_SHAPE, "%s: cannot read a rank-%d tensor as a matrix", t->name, t->ndim);
  }
  /* Written as differences so that huge arguments cannot overflow the sums. */
  if (row0 < 0 || nrows < 0 || row0 > rows || nrows > rows - row0 || col0 < 0 || ncols < 0 ||
      col0 > cols || ncols > cols - col0)
    return lf_error(LF_ERR_INVALID_ARG,
                    "%s: slice rows [%lld, +%lld) cols [%lld, +%lld) is outside [%lld][%lld]",
                    t->name, (long long)row0, (long long)nrows, (long long)col0, (long long)ncols,
                    (long long)rows, (long long)cols);
  if (nrows == 0 || ncols == 0) return LF_OK;
  if (!dst || !t->data)
    return lf_error(LF_ERR_INVALID_ARG, "lf_tensor_read_f32: %s: NULL buffer", t->name);
  const int64_t ggml = dtype_ggml(t->dtype);
  if (ggml < 0) return lf_error(LF_ERR_INTERNAL, "%s: bad dtype %d", t->name, (int)t->dtype);

  /* Heads of perm_hd rows (elements of a 1-D tensor) stored in rotary order, or 0. */
  int64_t perm_hd = 0;
  if (t->row_perm_heads != 0) {
    const int64_t n = t->ndim == 1 ? cols : rows;
    if (t->row_perm_heads < 0 || n % t->row_perm_heads != 0 || n / t->row_perm_heads % 2 != 0)
      return lf_error(LF_ERR_SHAPE,
                      "%s: %lld %s cannot be split into %d heads of an even size to undo the "
                      "rotary permutation",
                      t->name, (long long)n, t->ndim == 1 ? "elements" : "rows", t->row_perm_heads);
    perm_hd = n / t->row_perm_heads;
  }
  const int64_t bs = lf_dtype_block_size(t->dtype);
  const int perm_cols = perm_hd && t->ndim == 1;

  const unsigned char *base = t->data;
  if (bs == 1 && !perm_cols) {
    size_t es = lf_dtype_size(t->dtype);
    for (int64_t r = 0; r < nrows; r++) {
      const int64_t pr = perm_hd ? perm_row(row0 + r, perm_hd) : row0 + r;
      const unsigned char *src = base + ((size_t)pr * (size_t)cols + (size_t)col0) * es;
      float *out = dst + (size_t)r * (size_t)ncols; /* [ncols] */
      /* Safetensors data need not be aligned (the header length is arbitrary): memcpy loads. */
      switch (t->dtype) {
      case LF_DTYPE_F32:
        memcpy(out, src, (size_t)ncols * 4);
        break;
      case LF_DTYPE_F16:
        for (int64_t c = 0; c < ncols; c++) {
          uint16_t h;
          memcpy(&h, src + 2 * c, 2);
          out[c] = lf_f16_to_f32(h);
        }
        break;
      case LF_DTYPE_BF16:
        for (int64_t c = 0; c < ncols; c++) {
          uint16_t h;
          memcpy(&h, src + 2 * c, 2);
          out[c] = lf_bf16_to_f32(h);
        }
        break;
      default:
        return lf_error(LF_ERR_INTERNAL, "%s: bad dtype %d", t->name, (int)t->dtype);
      }
    }
    return LF_OK;
  }

  /* Block types (and permuted 1-D tensors): whole blocks are dequantized, through a scratch row
   * when the columns asked for are not whole blocks. Rows are contiguous, row_bytes apart. */
  const size_t row_bytes = lf_dtype_row_bytes(t->dtype, cols);
  if (bs <= 0 || row_bytes == 0)
    return lf_error(LF_ERR_SHAPE,
                    "%s: %lld columns are not a whole number of %s's %lld-element blocks", t->name,
                    (long long)cols, lf_dtype_str(t->dtype), (long long)bs);
  if ((uint64_t)cols + (uint64_t)bs > SIZE_MAX / sizeof(float))
    return lf_error(LF_ERR_OUT_OF_MEMORY, "%s: rows of %lld columns are too long", t->name,
                    (long long)cols);
  float *scratch = malloc(((size_t)cols + (size_t)bs) * sizeof *scratch);
  if (!scratch)
    return lf_error(LF_ERR_OUT_OF_MEMORY, "%s: cannot allocate a row of %lld floats", t->name,
                    (long long)cols);
  lf_status st = LF_OK;
  for (int64_t r = 0; r < nrows && st == LF_OK; r++) {
    const int64_t pr = perm_hd && !perm_cols ? perm_row(row0 + r, perm_hd) : row0 + r;
    st = read_block_row(t, (uint32_t)ggml, base + (size_t)pr * row_bytes, cols, col0, ncols,
                        perm_cols ? perm_hd : 0, scratch, dst + (size_t)r * (size_t)ncols);
  }
  free(scratch);
  return st;
}

/* dst [nrows][ncols] += the block of u·v (tensor.h: lf_tensor_lowrank). Each row's sum runs in
 * acc over k in order, so an element's bits depend neither on the block around it nor on the
 * threads (rows are split among OpenMP threads, each with its own acc, when there is enough
 * work: ~4M multiply-adds a thread, as lf_matmul). */
static lf_status add_lowrank(const lf_tensor_src *t, int64_t row0, int64_t nrows, int64_t col0,
                             int64_t ncols, float *dst) {
  const lf_tensor_lowrank *lr = t->lowrank;
  if (t->ndim != 2 || lr->rows != t->shape[0] || lr->cols != t->shape[1] || lr->rank < 1 ||
      !lr->u || !lr->v)
    return lf_error(LF_ERR_INTERNAL, "%s: low-rank update does not fit the tensor", t->name);
  if ((uint64_t)ncols > SIZE_MAX / sizeof(float))
    return lf_error(LF_ERR_OUT_OF_MEMORY, "%s: rows of %lld columns are too long", t->name,
                    (long long)ncols);
  const size_t rank = (size_t)lr->rank, cols = (size_t)lr->cols;
  int failed = 0;
#ifdef LF_HAVE_OPENMP
  const double work = (double)nrows * (double)ncols * (double)rank;
  int nt = omp_get_max_threads();
  if (nt > work / (double)(1L << 22)) nt = (int)(work / (double)(1L << 22));
  if (nt < 1) nt = 1;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(| : failed)
#endif
  {
    float *acc = malloc((size_t)ncols * sizeof *acc); /* [ncols] */
    if (!acc) failed = 1;
#ifdef LF_HAVE_OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t r = 0; r < nrows; r++) {
      if (!acc) continue;
      const float *u = lr->u + (size_t)(row0 + r) * rank; /* [rank] */
      memset(acc, 0, (size_t)ncols * sizeof *acc);
      for (size_t k = 0; k < rank; k++) {
        const float uk = u[k];
        const float *v = lr->v + k * cols + (size_t)col0; /* [ncols] */
        for (int64_t c = 0; c < ncols; c++)
          acc[c] += uk * v[c];
      }
      float *d = dst + (size_t)r * (size_t)ncols;
      for (int64_t c = 0; c < ncols; c++)
        d[c] += acc[c];
    }
    free(acc);
  }
  if (failed)
    return lf_error(LF_ERR_OUT_OF_MEMORY, "%s: cannot allocate a row of %lld floats", t->name,
                    (long long)ncols);
  return LF_OK;
}

lf_status lf_tensor_read_f32(const lf_tensor_src *t, int64_t row0, int64_t nrows, int64_t col0,
                             int64_t ncols, float *dst) {
  if (!t) return lf_error(LF_ERR_INVALID_ARG, "lf_tensor_read_f32: NULL tensor");
  LF_TRY(read_stored_f32(t, row0, nrows, col0, ncols, dst));
  /* Every weight of every format reaches the engine through here: a NaN or an infinity in a
   * file (corrupt bytes, a broken conversion) is refused by name instead of turning every
   * output into NaN. */
  for (int64_t r = 0; r < nrows; r++)
    for (int64_t c = 0; c < ncols; c++)
      if (!isfinite(dst[r * ncols + c]))
        return lf_error(LF_ERR_FORMAT,
                        "%s: tensor %s holds a non-finite value (%g) at row %lld, column %lld",
                        t->file ? t->file : "(no file)", t->name, (double)dst[r * ncols + c],
                        (long long)(row0 + r), (long long)(col0 + c));
  if (t->lowrank && nrows > 0 && ncols > 0) LF_TRY(add_lowrank(t, row0, nrows, col0, ncols, dst));
  return LF_OK;
}

/* ---- safetensors ---------------------------------------------------------------------------
 * [u64 N little-endian][N bytes JSON header][data]. The header maps each tensor name to
 * {"dtype", "shape", "data_offsets": [begin, end]} with offsets relative to the data section;
 * "__metadata__" holds free-form strings. */

/* The reference implementation refuses headers above 100 MB; so do we, before parsing. */
#define LF_SAFETENSORS_MAX_HEADER 100000000ull

static int st_parse_dtype(const char *s, lf_dtype *out) {
  if (strcmp(s, "F32") == 0)
    *out = LF_DTYPE_F32;
  else if (strcmp(s, "F16") == 0)
    *out = LF_DTYPE_F16;
  else if (strcmp(s, "BF16") == 0)
    *out = LF_DTYPE_BF16;
  else
    return 0;
  return 1;
}

/* Reads one header entry into t (data left NULL); its data starts at byte *begin of the data
 * section. */
static lf_status st_parse_entry(const char *path, const char *name, const lf_json *e,
                                uint64_t data_size, lf_tensor_src *t, uint64_t *begin) {
  if (lf_json_typeof(e) != LF_JSON_OBJECT)
    return lf_error(LF_ERR_FORMAT, "%s: tensor %s: header entry is not an object", path, name);
  if (strlen(name) >= LF_TENSOR_NAME_MAX)
    return lf_error(LF_ERR_FORMAT, "%s: tensor name longer than %d bytes: %.60s...", path,
                    LF_TENSOR_NAME_MAX - 1, name);
  memset(t, 0, sizeof *t);
  memcpy(t->name, name, strlen(name) + 1);

  const char *dt = lf_json_str(lf_json_get(e, "dtype"), NULL);
  if (!dt) return lf_error(LF_ERR_FORMAT, "%s: tensor %s: missing or non-string dtype", path, name);
  if (!st_parse_dtype(dt, &t->dtype))
    return lf_error(LF_ERR_UNSUPPORTED, "%s: tensor %s has dtype %s (supported: F32, F16, BF16)",
                    path, name, dt);

  const lf_json *shape = lf_json_get(e, "shape");
  if (lf_json_typeof(shape) != LF_JSON_ARRAY)
    return lf_error(LF_ERR_FORMAT, "%s: tensor %s: missing or non-array shape", path, name);
  size_t rank = lf_json_len(shape);
  if (rank > LF_TENSOR_MAX_DIMS)
    return lf_error(LF_ERR_UNSUPPORTED, "%s: tensor %s has rank %zu (at most %d supported)", path,
                    name, rank, LF_TENSOR_MAX_DIMS);
  t->ndim = (int)rank;
  /* numel * size must equal end - begin <= data_size, so bounding the running product by
   * data_size keeps it from overflowing and loses no valid tensor. */
  uint64_t numel = 1;
  int zero = 0, too_big = 0;
  for (size_t d = 0; d < rank; d++) {
    int64_t v;
    if (!lf_json_int(lf_json_at(shape, d), &v) || v < 0)
      return lf_error(LF_ERR_FORMAT, "%s: tensor %s: shape[%zu] is not a non-negative integer",
                      path, name, d);
    t->shape[d] = v;
    if (v == 0)
      zero = 1;
    else if (numel > data_size / (uint64_t)v)
      too_big = 1; /* numel * v > data_size */
    else
      numel *= (uint64_t)v;
  }
  if (zero) {
    numel = 0;
    too_big = 0;
  }

  const lf_json *off = lf_json_get(e, "data_offsets");
  int64_t b, en;
  if (lf_json_typeof(off) != LF_JSON_ARRAY || lf_json_len(off) != 2 ||
      !lf_json_int(lf_json_at(off, 0), &b) || !lf_json_int(lf_json_at(off, 1), &en) || b < 0 ||
      en < 0)
    return lf_error(LF_ERR_FORMAT, "%s: tensor %s: data_offsets must be two non-negative integers",
                    path, name);
  if (b > en || (uint64_t)en > data_size)
    return lf_error(LF_ERR_FORMAT,
                    "%s: tensor %s: data_offsets [%lld, %lld] outside the data section of %llu "
                    "bytes (file truncated?)",
                    path, name, (long long)b, (long long)en, (unsigned long long)data_size);
  uint64_t nbytes = too_big ? UINT64_MAX : numel * lf_dtype_size(t->dtype);
  if ((uint64_t)(en - b) != nbytes)
    return lf_error(LF_ERR_FORMAT,
                    "%s: tensor %s: data_offsets [%lld, %lld] span %lld bytes but shape and dtype "
                    "%s need %s%llu",
                    path, name, (long long)b, (long long)en, (long long)(en - b), dt,
                    nbytes == UINT64_MAX ? "more than " : "",
                    nbytes == UINT64_MAX ? (unsigned long long)data_size
                                         : (unsigned long long)nbytes);
  *begin = (uint64_t)b;
  return LF_OK;
}

lf_status lf_safetensors_load(lf_tensor_set *s, const char *path) {
  if (!s || !path) return lf_error(LF_ERR_INVALID_ARG, "lf_safetensors_load: NULL argument");
  int idx;
  LF_TRY(lf_tensor_set_map_file(s, path, &idx));
  const int n0 = s->n;
  const lf_mapping *m = &s->maps[idx];
  const unsigned char *base = m->addr;
  const size_t size = m->size;
  const char *file = m->path; /* owned by the set: tensors point at it */
  lf_status st = LF_OK;
  lf_json *hdr = NULL;

  if (size < 8) {
    st = lf_error(LF_ERR_FORMAT, "%s: %zu bytes is too short for a safetensors file", path, size);
    goto fail;
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--)
    n = n << 8 | base[i];
  if (n > size - 8) {
    st = lf_error(LF_ERR_FORMAT,
                  "%s: header length %llu runs past the end of the file (%zu bytes; truncated "
                  "or not safetensors)",
                  path, (unsigned long long)n, size);
    goto fail;
  }
  if (n > LF_SAFETENSORS_MAX_HEADER) {
    st = lf_error(LF_ERR_FORMAT, "%s: header length %llu is larger than the 100 MB limit", path,
                  (unsigned long long)n);
    goto fail;
  }
  char jerr[200];
  st = lf_json_parse((const char *)base + 8, (size_t)n, &hdr, jerr, sizeof jerr);
  if (st != LF_OK) {
    st = lf_error(st, "%s: bad JSON header: %s", path, jerr);
    goto fail;
  }
  if (lf_json_typeof(hdr) != LF_JSON_OBJECT) {
    st = lf_error(LF_ERR_FORMAT, "%s: JSON header is not an object", path);
    goto fail;
  }
  const unsigned char *data = base + 8 + n;
  const uint64_t data_size = size - 8 - n;
  for (size_t i = 0; i < lf_json_len(hdr); i++) {
    const char *name = lf_json_key_at(hdr, i);
    const lf_json *e = lf_json_at(hdr, i);
    if (strcmp(name, "__metadata__") == 0) continue;
    size_t name_len = hdr->items[i].key_len;
    if (name_len == 0 || name_len != strlen(name)) {
      st = lf_error(LF_ERR_FORMAT, "%s: empty or NUL-containing tensor name in header", path);
      goto fail;
    }
    lf_tensor_src t;
    uint64_t b = 0;
    st = st_parse_entry(path, name, e, data_size, &t, &b);
    if (st != LF_OK) goto fail;
    t.data = data + b;
    t.file = file;
    st = lf_tensor_set_add(s, &t);
    if (st != LF_OK) goto fail;
  }
  lf_json_free(hdr);
  return LF_OK;

fail:
  /* Leave the set as it was: drop this file's tensors and mapping (the last one). */
  lf_json_free(hdr);
  s->n = n0;
  if (s->maps[idx].addr) munmap(s->maps[idx].addr, s->maps[idx].size);
  free(s->maps[idx].path);
  s->n_maps = idx;
  return st;
}

/* ---- GGUF ----------------------------------------------------------------------------------
 * gguf.c parses and bounds-checks the file; here its tensors become lf_tensor_src entries. */

static int ggml_to_dtype(uint32_t type, lf_dtype *out) {
  static const lf_dtype all[] = {LF_DTYPE_F32,  LF_DTYPE_F16,  LF_DTYPE_BF16,
                                 LF_DTYPE_Q4_0, LF_DTYPE_Q4_1, LF_DTYPE_Q8_0,
                                 LF_DTYPE_Q4_K, LF_DTYPE_Q5_K, LF_DTYPE_Q6_K};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
    if (dtype_ggml(all[i]) == (int64_t)type) {
      *out = all[i];
      return 1;
    }
  }
  return 0;
}

lf_status lf_gguf_tensor_set_load(lf_tensor_set *s, const char *path, lf_gguf **meta) {
  if (!s || !path) return lf_error(LF_ERR_INVALID_ARG, "lf_gguf_tensor_set_load: NULL argument");
  if (meta) *meta = NULL;
  int idx;
  LF_TRY(lf_tensor_set_map_file(s, path, &idx));
  const int n0 = s->n;
  const lf_mapping *m = &s->maps[idx];
  const char *file = m->path; /* owned by the set: tensors point at it */
  lf_gguf *g = NULL;
  lf_status st = lf_gguf_parse(m->addr, m->size, file, &g);
  for (int64_t i = 0; st == LF_OK && i < lf_gguf_tensor_count(g); i++) {
    const lf_gguf_tensor *gt = lf_gguf_tensor_at(g, i);
    lf_tensor_src t;
    memset(&t, 0, sizeof t);
    if (gt->name.len >= LF_TENSOR_NAME_MAX) {
      st = lf_error(LF_ERR_FORMAT, "%s: tensor name longer than %d bytes: %.60s...", file,
                    LF_TENSOR_NAME_MAX - 1, gt->name.ptr);
      break;
    }
    memcpy(t.name, gt->name.ptr, (size_t)gt->name.len);
    if (!ggml_to_dtype(gt->type, &t.dtype)) {
      const char *tn = lf_ggml_type_name(gt->type);
      st = lf_error(LF_ERR_UNSUPPORTED,
                    "%s: tensor %s has ggml type %s (%u), which lfserve cannot dequantize "
                    "(supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)",
                    file, t.name, tn ? tn : "?", (unsigned)gt->type);
      break;
    }
    /* ggml's ne[0] is the innermost dimension; lf shapes are row-major, outermost first. */
    t.ndim = gt->n_dims;
    for (int d = 0; d < gt->n_dims; d++)
      t.shape[d] = gt->ne[gt->n_dims - 1 - d];
    t.data = gt->data;
    t.file = file;
    st = lf_tensor_set_add(s, &t);
  }
  if (st != LF_OK) {
    /* Leave the set as it was: drop this file's tensors and mapping (the last one). */
    lf_gguf_free(g);
    s->n = n0;
    if (s->maps[idx].addr) munmap(s->maps[idx].addr, s->maps[idx].size);
    free(s->maps[idx].path);
    s->n_maps = idx;
    return st;
  }
  if (meta)
    *meta = g;
  else
    lf_gguf_free(g);
  return LF_OK;
}

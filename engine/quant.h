/* ggml tensor types: their block layouts and dequantization of rows to fp32.
 *
 * A GGUF file stores each tensor as rows of ne[0] elements; a row is a sequence of blocks of
 * block_size elements, each block_size-element block taking type_size bytes. Plain types (F32,
 * F16, BF16, ...) have blocks of one element. The results are bit-identical to the python `gguf`
 * package's gguf.quants.dequantize (which follows ggml's dequantize_row_* reference code). */
#ifndef LF_QUANT_H
#define LF_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The ggml type numbers stored in GGUF tensor infos that lfserve can dequantize. */
enum {
  LF_GGML_F32 = 0,
  LF_GGML_F16 = 1,
  LF_GGML_Q4_0 = 2,
  LF_GGML_Q4_1 = 3,
  LF_GGML_Q8_0 = 8,
  LF_GGML_Q4_K = 12,
  LF_GGML_Q5_K = 13,
  LF_GGML_Q6_K = 14,
  LF_GGML_BF16 = 30,
};

/* The type's name ("Q4_K") for every type ggml defines, dequantizable or not; NULL when the
 * number is not a ggml type (or a retired one). */
const char *lf_ggml_type_name(uint32_t type);
/* 1 with the block size (elements) and type size (bytes per block) when the type is known to
 * ggml, else 0. Either output may be NULL. */
int lf_ggml_type_info(uint32_t type, int64_t *block_size, int64_t *type_size);
/* 1 when lf_quant_dequant_row handles the type. */
int lf_quant_can_dequant(uint32_t type);
/* Bytes of a row of n elements; -1 when the type is unknown, n is negative or not a multiple of
 * the block size, or the size does not fit in int64. */
int64_t lf_quant_row_bytes(uint32_t type, int64_t n);
/* Dequantizes n elements (a multiple of the block size) from src, which need not be aligned, to
 * dst[n]. LF_ERR_UNSUPPORTED for a type it cannot dequantize, LF_ERR_INVALID_ARG for a bad n. */
lf_status lf_quant_dequant_row(uint32_t type, const void *src, int64_t n, float *dst);

#ifdef __cplusplus
}
#endif
#endif

/* Dequantization of ggml block types to fp32.
 *
 * Block layouts follow ggml's ggml-common.h (see quant.h). The arithmetic follows gguf.quants
 * (numpy) step for step, e.g. Q4_K is (d * sc) * q - (dmin * m). Every product here is exact in
 * fp32 (an fp16 scale has 11 significant bits, the 6-bit sub-scales and the quants at most 7
 * more each, 24 in all), so the only rounding is the final sum's: the results are bit-identical
 * to the reference whatever the order or a compiler's fused multiply-adds. */
#include "quant.h"

#include <string.h>

#include "base/error.h"
#include "tensor.h"

#define QK_K 256

typedef struct ggml_type_row {
  const char *name;
  int16_t block_size, type_size;
} ggml_type_row;

/* Indexed by ggml type number; a NULL name marks a number ggml does not (or no longer) use. */
static const ggml_type_row ggml_types[] = {
    [0] = {"F32", 1, 4},
    [1] = {"F16", 1, 2},
    [2] = {"Q4_0", 32, 2 + 16},
    [3] = {"Q4_1", 32, 2 + 2 + 16},
    [6] = {"Q5_0", 32, 2 + 4 + 16},
    [7] = {"Q5_1", 32, 2 + 2 + 4 + 16},
    [8] = {"Q8_0", 32, 2 + 32},
    [9] = {"Q8_1", 32, 4 + 4 + 32},
    [10] = {"Q2_K", QK_K, 2 + 2 + QK_K / 16 + QK_K / 4},
    [11] = {"Q3_K", QK_K, 2 + QK_K / 4 + QK_K / 8 + 12},
    [12] = {"Q4_K", QK_K, 2 + 2 + 12 + QK_K / 2},
    [13] = {"Q5_K", QK_K, 2 + 2 + 12 + QK_K / 8 + QK_K / 2},
    [14] = {"Q6_K", QK_K, QK_K / 2 + QK_K / 4 + QK_K / 16 + 2},
    [15] = {"Q8_K", QK_K, 4 + QK_K + QK_K / 8},
    [16] = {"IQ2_XXS", QK_K, 2 + QK_K / 4},
    [17] = {"IQ2_XS", QK_K, 2 + QK_K / 4 + QK_K / 32},
    [18] = {"IQ3_XXS", QK_K, 2 + QK_K / 4 + QK_K / 8},
    [19] = {"IQ1_S", QK_K, 2 + QK_K / 8 + QK_K / 16},
    [20] = {"IQ4_NL", 32, 2 + 16},
    [21] = {"IQ3_S", QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4},
    [22] = {"IQ2_S", QK_K, 2 + QK_K / 4 + QK_K / 16},
    [23] = {"IQ4_XS", QK_K, 2 + 2 + QK_K / 2 + QK_K / 64},
    [24] = {"I8", 1, 1},
    [25] = {"I16", 1, 2},
    [26] = {"I32", 1, 4},
    [27] = {"I64", 1, 8},
    [28] = {"F64", 1, 8},
    [29] = {"IQ1_M", QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32},
    [30] = {"BF16", 1, 2},
    [34] = {"TQ1_0", QK_K, 2 + 4 * 13},
    [35] = {"TQ2_0", QK_K, 2 + 64},
    [39] = {"MXFP4", 32, 1 + 16},
    [40] = {"NVFP4", 64, 4 + 32},
    [41] = {"Q1_0", 128, 2 + 16},
};

static const ggml_type_row *type_row(uint32_t type) {
  if (type >= sizeof ggml_types / sizeof ggml_types[0] || !ggml_types[type].name) return NULL;
  return &ggml_types[type];
}

const char *lf_ggml_type_name(uint32_t type) {
  const ggml_type_row *r = type_row(type);
  return r ? r->name : NULL;
}

int lf_ggml_type_info(uint32_t type, int64_t *block_size, int64_t *type_size) {
  const ggml_type_row *r = type_row(type);
  if (!r) return 0;
  if (block_size) *block_size = r->block_size;
  if (type_size) *type_size = r->type_size;
  return 1;
}

int lf_quant_can_dequant(uint32_t type) {
  switch (type) {
  case LF_GGML_F32:
  case LF_GGML_F16:
  case LF_GGML_BF16:
  case LF_GGML_Q4_0:
  case LF_GGML_Q4_1:
  case LF_GGML_Q8_0:
  case LF_GGML_Q4_K:
  case LF_GGML_Q5_K:
  case LF_GGML_Q6_K:
    return 1;
  }
  return 0;
}

int64_t lf_quant_row_bytes(uint32_t type, int64_t n) {
  const ggml_type_row *r = type_row(type);
  if (!r || n < 0 || n % r->block_size != 0) return -1;
  int64_t blocks = n / r->block_size;
  if (blocks > INT64_MAX / r->type_size) return -1;
  return blocks * r->type_size;
}

static float load_f16(const unsigned char *p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return lf_f16_to_f32(h);
}

/* ---- 32-element blocks --------------------------------------------------------------------- */

/* d (f16), then 16 bytes: element l < 16 is the low nibble of byte l, element l + 16 its high
 * nibble; value d * (q - 8). */
static void dq_q4_0(const unsigned char *b, float *y) {
  const float d = load_f16(b);
  const unsigned char *qs = b + 2;
  for (int l = 0; l < 16; l++) {
    y[l] = d * (float)((qs[l] & 0x0F) - 8);
    y[l + 16] = d * (float)((qs[l] >> 4) - 8);
  }
}

/* d, m (f16), then nibbles as Q4_0; value d * q + m. */
static void dq_q4_1(const unsigned char *b, float *y) {
  const float d = load_f16(b), m = load_f16(b + 2);
  const unsigned char *qs = b + 4;
  for (int l = 0; l < 16; l++) {
    y[l] = d * (float)(qs[l] & 0x0F) + m;
    y[l + 16] = d * (float)(qs[l] >> 4) + m;
  }
}

/* d (f16), then 32 int8; value q * d. */
static void dq_q8_0(const unsigned char *b, float *y) {
  const float d = load_f16(b);
  for (int l = 0; l < 32; l++) {
    int8_t q;
    memcpy(&q, b + 2 + l, 1);
    y[l] = (float)q * d;
  }
}

/* ---- 256-element K-quant super-blocks ------------------------------------------------------ */

/* Q4_K / Q5_K pack 8 six-bit scales and 8 six-bit mins in 12 bytes: sub-block j < 4 keeps its
 * scale and min in the low 6 bits of bytes j and j + 4; j >= 4 takes its low 4 bits from the
 * nibbles of byte j + 4 (scale low, min high) and its top 2 bits from the top bits of bytes j - 4
 * (scale) and j (min). */
static void k_scale_min(const unsigned char *s, int j, int *sc, int *mn) {
  if (j < 4) {
    *sc = s[j] & 0x3F;
    *mn = s[j + 4] & 0x3F;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

/* Q4_K and Q5_K share the super-block of 8 sub-blocks of 32: d, dmin (f16), scales[12], then for
 * Q5_K qh[32], then qs[128]. Sub-block j (32 elements) takes nibble j % 2 of bytes
 * qs[32 * (j / 2) + l], and in Q5_K a fifth bit, bit j of qh[l]; value (d * sc_j) * q - (dmin *
 * m_j). qh is NULL for Q4_K. */
static void dq_k_nibbles(const unsigned char *b, const unsigned char *qh, const unsigned char *qs,
                         float *y) {
  const float d = load_f16(b), dmin = load_f16(b + 2);
  const unsigned char *scales = b + 4;
  for (int j = 0; j < 8; j++) {
    int sc, mn;
    k_scale_min(scales, j, &sc, &mn);
    const float ds = d * (float)sc, ms = dmin * (float)mn;
    const unsigned char *q = qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int l = 0; l < 32; l++) {
      int v = (q[l] >> shift) & 0x0F;
      if (qh) v |= ((qh[l] >> j) & 1) << 4;
      y[32 * j + l] = ds * (float)v - ms;
    }
  }
}

static void dq_q4_k(const unsigned char *b, float *y) {
  dq_k_nibbles(b, NULL, b + 16, y);
}

static void dq_q5_k(const unsigned char *b, float *y) {
  dq_k_nibbles(b, b + 16, b + 48, y);
}

/* ql[128], qh[64], scales[16] (int8), d (f16). Two halves of 128 elements; in half h, element
 * r takes nibble r / 64 of ql[64h + r % 64] and bits 2 * (r / 32) of qh[32h + r % 32] as its top
 * two bits; value (d * scales[e / 16]) * (q - 32). */
static void dq_q6_k(const unsigned char *b, float *y) {
  const unsigned char *ql = b, *qh = b + 128, *sc = b + 192;
  const float d = load_f16(b + 208);
  for (int e = 0; e < QK_K; e++) {
    const int h = e / 128, r = e % 128;
    int lo = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
    int hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 0x03;
    int8_t s;
    memcpy(&s, sc + e / 16, 1);
    y[e] = (d * (float)s) * (float)((lo | hi << 4) - 32);
  }
}

lf_status lf_quant_dequant_row(uint32_t type, const void *src, int64_t n, float *dst) {
  const ggml_type_row *r = type_row(type);
  if (!r || !lf_quant_can_dequant(type))
    return lf_error(LF_ERR_UNSUPPORTED, "cannot dequantize ggml type %s (%u)",
                    r ? r->name : "unknown", (unsigned)type);
  if (n < 0 || n % r->block_size != 0)
    return lf_error(LF_ERR_INVALID_ARG,
                    "dequantizing %lld elements of %s: not a multiple of its %d-element blocks",
                    (long long)n, r->name, (int)r->block_size);
  if (n == 0) return LF_OK;
  if (!src || !dst) return lf_error(LF_ERR_INVALID_ARG, "lf_quant_dequant_row: NULL buffer");
  const unsigned char *p = src;
  switch (type) {
  case LF_GGML_F32:
    memcpy(dst, p, (size_t)n * 4);
    return LF_OK;
  case LF_GGML_F16:
  case LF_GGML_BF16:
    for (int64_t i = 0; i < n; i++) {
      uint16_t h;
      memcpy(&h, p + 2 * i, 2);
      dst[i] = type == LF_GGML_F16 ? lf_f16_to_f32(h) : lf_bf16_to_f32(h);
    }
    return LF_OK;
  default:
    break;
  }
  void (*block_fn)(const unsigned char *, float *) = NULL;
  switch (type) {
  case LF_GGML_Q4_0:
    block_fn = dq_q4_0;
    break;
  case LF_GGML_Q4_1:
    block_fn = dq_q4_1;
    break;
  case LF_GGML_Q8_0:
    block_fn = dq_q8_0;
    break;
  case LF_GGML_Q4_K:
    block_fn = dq_q4_k;
    break;
  case LF_GGML_Q5_K:
    block_fn = dq_q5_k;
    break;
  case LF_GGML_Q6_K:
    block_fn = dq_q6_k;
    break;
  default:
    return lf_error(LF_ERR_INTERNAL, "no dequantizer for ggml type %s", r->name);
  }
  const int64_t nb = n / r->block_size;
  for (int64_t i = 0; i < nb; i++)
    block_fn(p + (size_t)i * (size_t)r->type_size, dst + (size_t)i * (size_t)r->block_size);
  return LF_OK;
}

/* The quantized KV slot formats (docs/DESIGN.md §3, "Quantized pools"): the one definition of
 * their rounding, saturation, zeros and non-finite values, compiled into the CPU reference and
 * into the CUDA kernels that write slots, so the bytes a GPU stores are the bytes the CPU twin
 * computes (tests hold them to that, bit for bit). fp8 and int8 store every (slot, KV head) row
 * of head_dim values of K (and, separately, of V) as head_dim bytes and one fp32 scale; int4
 * (below) as head_dim / 2 bytes and a bf16 step and floor per 32 dims.
 *
 * int8: symmetric integers with a uniform step:
 *   scale = amax / 127, code = round-to-nearest-even(x_d / scale) in [-127, 127] (two's
 *   complement byte), value = code * scale (fp32 multiply)
 *
 * fp8:
 *   amax  = max |x_d| over the row
 *   scale = amax / 448 (448: e4m3's largest finite value); the row's largest value maps to 448
 *   code  = e4m3(x_d / scale), round to nearest even, magnitudes above 448 saturate to 448
 *   value = e4m3_to_float(code) * scale (fp32 multiply): what attention computes on
 * A row of zeros has scale 0 and codes +-0. A row with a NaN or an infinity stores scale NaN and
 * NaN codes (0x7f), so every value of it reads back as NaN, as the same row would poison an
 * unquantized pool's attention. fp32 division and multiplication are IEEE-rounded on the host
 * and on the device (lfserve never builds with fast math), so both sides agree.
 *
 * Plain C (and CUDA): LF_HD marks the functions for both sides.
 */
#ifndef LF_KVQ_H
#define LF_KVQ_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define LF_HD __host__ __device__ __forceinline__
#else
#define LF_HD static inline
#endif

#define LF_FP8_MAX 448.0f
#define LF_FP8_NAN ((uint8_t)0x7f)

LF_HD uint32_t lf_kvq_f32_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}

LF_HD float lf_kvq_bits_f32(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

/* e4m3 (OCP FP8: bias 7, no infinities, 0x7f/0xff NaN, largest finite 448) from fp32: round to
 * nearest even, saturating finite (|x| > 448 and +-inf give +-448), NaN gives 0x7f. */
LF_HD uint8_t lf_fp8_from_f32(float x) {
  const uint32_t u = lf_kvq_f32_bits(x);
  const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return LF_FP8_NAN;
  if (a >= 0x43e00000u) return (uint8_t)(sign | 0x7e); /* >= 448 (inf included) */
  if (a < 0x3c800000u) {                              /* below 2^-6: subnormal codes m * 2^-9 */
    /* |x| * 512 is exact (a power of two) and below 8; the add of 2^23 rounds it to an integer
     * with the current (nearest-even) rounding, in fp32 on both sides. */
    const float r = (lf_kvq_bits_f32(a) * 512.0f + 8388608.0f) - 8388608.0f;
    return (uint8_t)(sign | (uint8_t)r); /* r == 8 is code 0x08, the smallest normal */
  }
  const uint32_t mant = a & 0x7fffffu, rem = mant & 0xfffffu;
  uint32_t r = ((((a >> 23) - 127u + 7u) & 0xfu) << 3) | (mant >> 20);
  if (rem > 0x80000u || (rem == 0x80000u && (r & 1u))) r++; /* a carry moves to the exponent */
  return (uint8_t)(sign | r);
}

/* The exact value of an e4m3 code (NaN for 0x7f and 0xff). */
LF_HD float lf_fp8_to_f32(uint8_t c) {
  const uint32_t e = (c >> 3) & 0xfu, m = c & 7u;
  float v;
  if (e == 15 && m == 7) return lf_kvq_bits_f32(0x7fc00000u);
  if (e == 0)
    v = (float)m * (1.0f / 512.0f);
  else
    v = lf_kvq_bits_f32(((e - 7u + 127u) << 23) | (m << 20));
  return (c & 0x80) ? -v : v;
}

/* The row's scale: amax / 448, 0 for a row of zeros, NaN when a value is not finite
 * (nonfinite != 0). */
LF_HD float lf_fp8_row_scale(float amax, int nonfinite) {
  if (nonfinite) return lf_kvq_bits_f32(0x7fc00000u);
  return amax / LF_FP8_MAX;
}

/* One value's code under its row's scale (lf_fp8_row_scale). */
LF_HD uint8_t lf_fp8_code(float x, float scale) {
  if (scale != scale) return LF_FP8_NAN;
  if (scale == 0.0f) return (uint8_t)((lf_kvq_f32_bits(x) >> 24) & 0x80); /* +-0 */
  return lf_fp8_from_f32(x / scale);
}

/* A code read back under its row's scale. */
LF_HD float lf_fp8_value(uint8_t code, float scale) {
  return lf_fp8_to_f32(code) * scale;
}

/* int8: the row's scale (amax / 127; 0 for zeros; NaN when a value is not finite). */
LF_HD float lf_i8_row_scale(float amax, int nonfinite) {
  if (nonfinite) return lf_kvq_bits_f32(0x7fc00000u);
  return amax / 127.0f;
}

/* int8: one value's code (as its byte) under the row's scale; 0 under a NaN or zero scale. The
 * add and subtract of 1.5 * 2^23 round |x / scale| <= 127 (plus rounding) to an integer, nearest
 * even, in fp32 on both sides. */
LF_HD uint8_t lf_i8_code(float x, float scale) {
  if (scale != scale || scale == 0.0f) return 0;
  float r = (x / scale + 12582912.0f) - 12582912.0f;
  r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
  return (uint8_t)(int8_t)r;
}

LF_HD float lf_i8_value(uint8_t code, float scale) {
  return (float)(int8_t)code * scale;
}

/* int4 (docs/DESIGN.md §3 says why this shape): a row is cut into groups of LF_I4_GROUP
 * consecutive dims; a group stores one 4-bit code per dim and two bf16, its step s and its
 * floor m (asymmetric: the 16 levels span the group's own range):
 *   m     = the largest bf16 <= min
 *   s     = the smallest bf16 >= (max - m) / 15
 *   code  = clamp(round-to-nearest-even((x - m) / s), 0, 15)   (0 when s == 0)
 *   value = fmaf(s, code, m)
 * A group with a NaN or an infinity stores s = m = NaN and codes 0: it reads back as NaN. Ranges
 * beyond bf16's largest finite value read back as infinities.
 * In memory a row is head_dim / 8 little-endian 32-bit words of codes, and (in a separate array)
 * head_dim / 32 32-bit words of (s, m): s in the low half, m in the high half. Word w of codes
 * holds dims 8w .. 8w + 7, dim 8w + e at bit 4 * (e >> 1) + 16 * (e & 1): the nibbles of dims 2k
 * and 2k + 1 are 16 bits apart, so one shift and one mask put them in the two halves of a
 * register, where the decode kernel reads them as the bf16 pair (128 + code) (docs/DESIGN.md §3). */
#define LF_I4_GROUP 32
#define LF_I4_MAX_DIM 512 /* the CPU pools' row buffer */

/* The largest bf16 <= x and the smallest bf16 >= x, for finite x (as the fp32 they equal);
 * past bf16's largest finite value, an infinity. */
LF_HD float lf_kvq_bf16_down(float x) {
  uint32_t u = lf_kvq_f32_bits(x);
  if ((u & 0xffffu) && (u >> 31)) u = (u | 0xffffu) + 1u; /* negative: away from zero */
  return lf_kvq_bits_f32(u & 0xffff0000u);
}

LF_HD float lf_kvq_bf16_up(float x) {
  uint32_t u = lf_kvq_f32_bits(x);
  if ((u & 0xffffu) && !(u >> 31)) u = (u | 0xffffu) + 1u; /* positive: away from zero */
  return lf_kvq_bits_f32(u & 0xffff0000u);
}

LF_HD uint32_t lf_kvq_bf16_bits(float x) { return lf_kvq_f32_bits(x) >> 16; }

/* A group's meta word (s, m) from its min and max and whether a value is not finite. */
LF_HD uint32_t lf_i4_group_meta(float mn, float mx, int nonfinite) {
  if (nonfinite) return 0x7fc07fc0u;
  const float m = lf_kvq_bf16_down(mn);
  const float s = lf_kvq_bf16_up((mx - m) / 15.0f);
  return lf_kvq_bf16_bits(s) | (lf_kvq_bf16_bits(m) << 16);
}

LF_HD float lf_i4_meta_s(uint32_t meta) { return lf_kvq_bits_f32(meta << 16); }
LF_HD float lf_i4_meta_m(uint32_t meta) { return lf_kvq_bits_f32(meta & 0xffff0000u); }

/* One value's code under its group's meta word. */
LF_HD uint8_t lf_i4_code(float x, uint32_t meta) {
  const float s = lf_i4_meta_s(meta), m = lf_i4_meta_m(meta);
  if (s != s || s == 0.0f) return 0;
  /* the add and subtract of 1.5 * 2^23 round to an integer, nearest even, in fp32 */
  float r = ((x - m) / s + 12582912.0f) - 12582912.0f;
  if (!(r >= 0.0f)) r = 0.0f;
  if (r > 15.0f) r = 15.0f;
  return (uint8_t)r;
}

LF_HD float lf_i4_value(uint8_t code, uint32_t meta) {
  return fmaf(lf_i4_meta_s(meta), (float)code, lf_i4_meta_m(meta));
}

/* Bit position of dim d's nibble in its 32-bit code word. */
LF_HD int lf_i4_nibble_shift(int d) { return 4 * ((d & 7) >> 1) + 16 * (d & 1); }

/* Code of dim d in a row's code words. */
LF_HD uint8_t lf_i4_get(const uint32_t *words, int d) {
  return (uint8_t)((words[d >> 3] >> lf_i4_nibble_shift(d)) & 0xfu);
}

/* A whole row (n a multiple of LF_I4_GROUP) on the host: n / 8 code words, n / 32 meta words. */
LF_HD void lf_i4_quantize_row(const float *x, int n, uint32_t *words, uint32_t *meta) {
  for (int w = 0; w < n / 8; w++) words[w] = 0;
  for (int g = 0; g < n / LF_I4_GROUP; g++) {
    const float *xg = x + g * LF_I4_GROUP;
    float mn = 3.40282347e38f, mx = -3.40282347e38f;
    int nonfinite = 0;
    for (int i = 0; i < LF_I4_GROUP; i++) {
      const float v = xg[i];
      if (!(fabsf(v) <= 3.40282347e38f)) nonfinite = 1;
      else {
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
      }
    }
    meta[g] = lf_i4_group_meta(mn, mx, nonfinite);
    for (int i = 0; i < LF_I4_GROUP; i++) {
      const int d = g * LF_I4_GROUP + i;
      words[d >> 3] |= (uint32_t)lf_i4_code(xg[i], meta[g]) << lf_i4_nibble_shift(d);
    }
  }
}

/* The dtype-generic forms the pools use (kv_dtype: lf_kv_dtype's LF_KV_BF16 = 0,
 * LF_KV_FP8 = 1, LF_KV_INT8 = 2, LF_KV_INT4 = 3). The 8-bit functions below (row scale, code,
 * value, quantize_row) are for LF_KVQ_FP8 and LF_KVQ_INT8; int4 has its own above. */
#define LF_KVQ_FP8 1
#define LF_KVQ_INT8 2
#define LF_KVQ_INT4 3
#define LF_KVQ_K8V4 4 /* a pool dtype, not a row format: int8 K rows, int4 V rows */

/* The row formats of a pool dtype's K and V rows: the dtype itself, except LF_KVQ_K8V4. Every
 * row-level function below takes a row format; pool code maps its dtype through these. */
LF_HD int lf_kvq_k_row(int kv_dtype) {
  return kv_dtype == LF_KVQ_K8V4 ? LF_KVQ_INT8 : kv_dtype;
}
LF_HD int lf_kvq_v_row(int kv_dtype) {
  return kv_dtype == LF_KVQ_K8V4 ? LF_KVQ_INT4 : kv_dtype;
}

/* 1 for a pool dtype the pools know (bf16, the 8-bit formats, int4, int8 K with int4 V). */
LF_HD int lf_kvq_known(int kv_dtype) {
  return kv_dtype >= 0 && kv_dtype <= LF_KVQ_K8V4;
}

/* Bytes of codes per row of head_dim values, and 32-bit metadata words per row (scales), of a
 * row format (lf_kvq_k_row / lf_kvq_v_row of a pool dtype). */
LF_HD int lf_kvq_code_bytes(int kv_dtype, int head_dim) {
  return kv_dtype == 0 ? 2 * head_dim : kv_dtype == LF_KVQ_INT4 ? head_dim / 2 : head_dim;
}
LF_HD int lf_kvq_meta_words(int kv_dtype, int head_dim) {
  return kv_dtype == 0 ? 0 : kv_dtype == LF_KVQ_INT4 ? head_dim / LF_I4_GROUP : 1;
}

/* 1 when the pool dtype can store rows of head_dim values: int4 rows, K's or V's, need whole
 * groups. */
LF_HD int lf_kvq_fits(int kv_dtype, int head_dim) {
  return lf_kvq_known(kv_dtype) && head_dim > 0 &&
         ((lf_kvq_k_row(kv_dtype) != LF_KVQ_INT4 && lf_kvq_v_row(kv_dtype) != LF_KVQ_INT4) ||
          head_dim % LF_I4_GROUP == 0);
}

/* Bytes one stored row of a row format takes: its codes and its metadata words. */
LF_HD int lf_kvq_row_bytes(int row, int head_dim) {
  return lf_kvq_code_bytes(row, head_dim) + 4 * lf_kvq_meta_words(row, head_dim);
}

LF_HD float lf_kvq_row_scale(int kv_dtype, float amax, int nonfinite) {
  return kv_dtype == LF_KVQ_INT8 ? lf_i8_row_scale(amax, nonfinite)
                                 : lf_fp8_row_scale(amax, nonfinite);
}

LF_HD uint8_t lf_kvq_code(int kv_dtype, float x, float scale) {
  return kv_dtype == LF_KVQ_INT8 ? lf_i8_code(x, scale) : lf_fp8_code(x, scale);
}

LF_HD float lf_kvq_value(int kv_dtype, uint8_t code, float scale) {
  return kv_dtype == LF_KVQ_INT8 ? lf_i8_value(code, scale) : lf_fp8_value(code, scale);
}

/* Any quantized dtype's row as stored: codes (lf_kvq_code_bytes of them; 4-byte aligned) and
 * meta (lf_kvq_meta_words: an 8-bit row's scale as its fp32 bits, int4's (step, floor) words).
 * lf_kvq_row_value reads value d back, lf_kvq_encode_row (below) quantizes n values (int4: n a
 * multiple of LF_I4_GROUP). */
LF_HD float lf_kvq_row_value(int kv_dtype, const uint8_t *codes, const uint32_t *meta, int d) {
  if (kv_dtype == LF_KVQ_INT4)
    return lf_i4_value(lf_i4_get((const uint32_t *)codes, d), meta[d / LF_I4_GROUP]);
  return lf_kvq_value(kv_dtype, codes[d], lf_kvq_bits_f32(meta[0]));
}

/* A whole row's scale, on the host (the CUDA writes take the amax across a warp). */
LF_HD float lf_kvq_scale_of_row(int kv_dtype, const float *x, int n) {
  float amax = 0.0f;
  int nonfinite = 0;
  for (int i = 0; i < n; i++) {
    const float a = fabsf(x[i]);
    if (!(a <= 3.40282347e38f)) nonfinite = 1; /* NaN or inf */
    else if (a > amax) amax = a;
  }
  return lf_kvq_row_scale(kv_dtype, amax, nonfinite);
}

/* A whole row on the host: codes[d] and the scale; returns the scale. */
LF_HD float lf_kvq_quantize_row(int kv_dtype, const float *x, int n, uint8_t *codes) {
  const float scale = lf_kvq_scale_of_row(kv_dtype, x, n);
  for (int i = 0; i < n; i++) codes[i] = lf_kvq_code(kv_dtype, x[i], scale);
  return scale;
}

LF_HD void lf_kvq_encode_row(int kv_dtype, const float *x, int n, uint8_t *codes, uint32_t *meta) {
  if (kv_dtype == LF_KVQ_INT4)
    lf_i4_quantize_row(x, n, (uint32_t *)codes, meta);
  else
    meta[0] = lf_kvq_f32_bits(lf_kvq_quantize_row(kv_dtype, x, n, codes));
}

#endif

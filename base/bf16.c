/* Half-precision conversions shared by the checkpoint readers, the backends and the
 * communicators (bf16 sums), bit-exact on every host. */
#include "base/bf16.h"

#include <string.h>

static float bits_to_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static uint32_t f32_to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

float lf_bf16_to_f32(uint16_t h) {
  return bits_to_f32((uint32_t)h << 16);
}

uint16_t lf_f32_to_bf16(float f) {
  uint32_t u = f32_to_bits(f);
  /* Rounding a NaN's mantissa could carry it into infinity; keep it a (quiet) NaN instead. */
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)(u >> 16 | 0x0040u);
  /* Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit. Overflow of the
   * largest finite values correctly rounds to infinity. */
  u += 0x7FFFu + (u >> 16 & 1u);
  return (uint16_t)(u >> 16);
}

float lf_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = h >> 10 & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) return bits_to_f32(sign | 0x7F800000u | man << 13); /* inf, nan (payload kept) */
  if (exp == 0) {
    if (man == 0) return bits_to_f32(sign); /* +-0 */
    /* Subnormal: man * 2^-24, exact in fp32. */
    float v = (float)man * 0x1p-24f;
    return sign ? -v : v;
  }
  return bits_to_f32(sign | (exp + 112) << 23 | man << 13); /* rebias 15 -> 127 */
}

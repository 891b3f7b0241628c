/* bf16 / f16 <-> fp32 conversions (IEEE bit patterns; no hardware support needed). */
#ifndef LF_BF16_H
#define LF_BF16_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

float lf_bf16_to_f32(uint16_t h);
float lf_f16_to_f32(uint16_t h);
uint16_t lf_f32_to_bf16(float f); /* round to nearest even */

#ifdef __cplusplus
}
#endif
#endif

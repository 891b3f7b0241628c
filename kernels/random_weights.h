/* Seeded random weights for "random:NAME[:seed]" checkpoints (benchmarking real shapes without
 * files).
 *
 * Every value is a pure function of (seed, tensor id, element index), so the cpu backend
 * (weights.c, fp32) and the cuda backend (generated on the device, bf16) hold the same model:
 * matrices are drawn uniform in +-sqrt(3 / fan_in) (variance 1 / fan_in) and rounded to bf16 on
 * both sides; norm weights are 1 + U(-1/8, 1/8) and biases U(-1/32, 1/32), kept in fp32.
 * Includable from C and CUDA.
 */
#ifndef LF_RANDOM_WEIGHTS_H
#define LF_RANDOM_WEIGHTS_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#ifdef __CUDACC__
#define LF_RW_HD __host__ __device__ __forceinline__
#else
#define LF_RW_HD static inline
#endif

/* What a tensor holds decides its distribution. */
enum { LF_RW_MATRIX = 0, LF_RW_NORM = 1, LF_RW_BIAS = 2 };

/* Ids: embed 0, final norm 1, lm_head 2; layer l, part k (LF_RW_PART_*) at 16 + 16 l + k. */
enum {
  LF_RW_RMS_ATT = 0, LF_RW_WQ, LF_RW_WK, LF_RW_WV, LF_RW_BQ, LF_RW_BK, LF_RW_BV, LF_RW_QNORM,
  LF_RW_KNORM, LF_RW_WO, LF_RW_RMS_FFN, LF_RW_GATE, LF_RW_UP, LF_RW_DOWN
};
#define LF_RW_EMBED 0u
#define LF_RW_FINAL_NORM 1u
#define LF_RW_LM_HEAD 2u
#define LF_RW_LAYER(l, part) (16u + 16u * (uint32_t)(l) + (uint32_t)(part))

/* A counter-based hash (splitmix64 finaliser over the three words). */
LF_RW_HD uint64_t lf_rw_hash(uint64_t seed, uint32_t tensor, uint64_t index) {
  uint64_t z = seed * 0x9e3779b97f4a7c15ULL ^ ((uint64_t)tensor << 40) ^ index;
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  z += (uint64_t)tensor * 0xd1b54a32d192ed03ULL;
  z = (z ^ (z >> 29)) * 0xbf58476d1ce4e5b9ULL;
  return z ^ (z >> 32);
}

/* Uniform in [-1, 1) with 24 bits; exact in fp32 on every machine. */
LF_RW_HD float lf_rw_sym(uint64_t seed, uint32_t tensor, uint64_t index) {
  const float u = (float)(lf_rw_hash(seed, tensor, index) >> 40) * (1.0f / 16777216.0f);
  return 2.0f * u - 1.0f;
}

/* Round to nearest even bf16 and back (NaN-free inputs). */
LF_RW_HD float lf_rw_bf16_round(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  memcpy(&f, &u, 4);
  return f;
}

/* The value of element `index` of tensor `tensor`; scale = sqrtf(3.0f / fan_in) for matrices. */
LF_RW_HD float lf_rw_value(uint64_t seed, uint32_t tensor, int kind, float scale, uint64_t index) {
  const float s = lf_rw_sym(seed, tensor, index);
  if (kind == LF_RW_NORM) return 1.0f + 0.125f * s;
  if (kind == LF_RW_BIAS) return 0.03125f * s;
  return lf_rw_bf16_round(s * scale);
}

/* Maps a Hugging Face tensor name to (id, kind); 0 when the name is not a model tensor. */
static inline int lf_rw_tensor_of(const char *name, uint32_t *id, int *kind) {
  static const struct {
    const char *suffix;
    int part, kind;
  } parts[] = {
      {"input_layernorm.weight", LF_RW_RMS_ATT, LF_RW_NORM},
      {"self_attn.q_proj.weight", LF_RW_WQ, LF_RW_MATRIX},
      {"self_attn.k_proj.weight", LF_RW_WK, LF_RW_MATRIX},
      {"self_attn.v_proj.weight", LF_RW_WV, LF_RW_MATRIX},
      {"self_attn.q_proj.bias", LF_RW_BQ, LF_RW_BIAS},
      {"self_attn.k_proj.bias", LF_RW_BK, LF_RW_BIAS},
      {"self_attn.v_proj.bias", LF_RW_BV, LF_RW_BIAS},
      {"self_attn.q_norm.weight", LF_RW_QNORM, LF_RW_NORM},
      {"self_attn.k_norm.weight", LF_RW_KNORM, LF_RW_NORM},
      {"self_attn.o_proj.weight", LF_RW_WO, LF_RW_MATRIX},
      {"post_attention_layernorm.weight", LF_RW_RMS_FFN, LF_RW_NORM},
      {"mlp.gate_proj.weight", LF_RW_GATE, LF_RW_MATRIX},
      {"mlp.up_proj.weight", LF_RW_UP, LF_RW_MATRIX},
      {"mlp.down_proj.weight", LF_RW_DOWN, LF_RW_MATRIX},
  };
  if (!strcmp(name, "model.embed_tokens.weight")) {
    *id = LF_RW_EMBED;
    *kind = LF_RW_MATRIX;
    return 1;
  }
  if (!strcmp(name, "model.norm.weight")) {
    *id = LF_RW_FINAL_NORM;
    *kind = LF_RW_NORM;
    return 1;
  }
  if (!strcmp(name, "lm_head.weight")) {
    *id = LF_RW_LM_HEAD;
    *kind = LF_RW_MATRIX;
    return 1;
  }
  int l = -1, off = 0;
  if (sscanf(name, "model.layers.%d.%n", &l, &off) != 1 || l < 0 || off <= 0) return 0;
  for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++)
    if (!strcmp(name + off, parts[i].suffix)) {
      *id = LF_RW_LAYER(l, parts[i].part);
      *kind = parts[i].kind;
      return 1;
    }
  return 0;
}

#endif

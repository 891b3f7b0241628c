/* The key rotation of quantized pools (docs/DESIGN.md §3, "Rotated keys"): before a pool of a
 * rotating dtype stores a key, the key and every query that reads it are multiplied by the same
 * orthogonal matrix, a Walsh-Hadamard transform over blocks of LF_ROT_BLOCK(head_dim) dims.
 * q·k is unchanged (up to rounding), so attention, its softmax and every eviction score mean what
 * they did; what changes is the vector the quantizer sees: a key's few large channels (the
 * quantizer's error, DESIGN §3) are spread over the whole block, so each group's range holds
 * values of about the same size.
 *
 * The transform is unnormalised butterflies (each stage one add and one subtract per pair, in the
 * same order on both sides, so the CPU reference and the CUDA kernels agree bit for bit) and a
 * power-of-two scale, exact in floating point: keys by 2^-floor(L/2), queries by 2^-ceil(L/2),
 * L = log2(block), so the product of the two scales is 1/block and H q · H k / block = q · k.
 * Values are never rotated: ||v||_1, LongFlow's value factor, stays that of v.
 *
 * Plain C (and CUDA): LF_HD marks the functions for both sides (base/kvq.h).
 */
#ifndef LF_KVROT_H
#define LF_KVROT_H

#include "base/kvq.h"
#include "lfserve.h"

#define LF_ROT_MAX_BLOCK 128

/* Whether pools of this dtype store rotated keys: int4, fp8 and int8; not k8v4, whose error is its
 * int4 values' (docs/DESIGN.md §3 has the measurements). */
LF_HD int lf_kv_rotates(int kv_dtype) {
  return kv_dtype == LF_KV_INT4 || kv_dtype == LF_KV_FP8 || kv_dtype == LF_KV_INT8;
}

/* The block: the largest power of two dividing head_dim, at most LF_ROT_MAX_BLOCK. */
LF_HD int lf_rot_block(int head_dim) {
  int b = head_dim & -head_dim;
  return b > LF_ROT_MAX_BLOCK ? LF_ROT_MAX_BLOCK : b;
}

/* log2 of the block. */
LF_HD int lf_rot_log2(int block) {
  int l = 0;
  while ((1 << l) < block) l++;
  return l;
}

/* The exact power-of-two scale of a rotated key (is_query 0) or query (1). */
LF_HD float lf_rot_scale(int block, int is_query) {
  const int l = lf_rot_log2(block);
  const int e = is_query ? (l + 1) / 2 : l / 2;
  return 1.0f / (float)(1 << e);
}

/* One butterfly stage of half-width h over a row of d values (d a multiple of 2h): pairs
 * (i, i + h) with (i & h) == 0. The CUDA side runs the same pairs across a warp's lanes. */
LF_HD void lf_rot_pair(float *x, int i, int h) {
  const float a = x[i], b = x[i + h];
  x[i] = a + b;
  x[i + h] = a - b;
}

/* Rotates one row of head_dim values in place (the CPU reference). */
LF_HD void lf_rot_row(float *x, int head_dim, int is_query) {
  const int block = lf_rot_block(head_dim);
  for (int h = 1; h < block; h <<= 1)
    for (int i = 0; i < head_dim; i++)
      if (!(i & h)) lf_rot_pair(x, i, h);
  const float s = lf_rot_scale(block, is_query);
  for (int i = 0; i < head_dim; i++) x[i] *= s;
}

#endif

/* GGUF checkpoints (llama.cpp's format): the model config from the metadata and the tensors
 * renamed to their Hugging Face names, so weights.c and both backends see the same model a
 * Hugging Face directory would give.
 *
 * Three things differ from a Hugging Face checkpoint and are undone here:
 *  - names: "blk.3.attn_q.weight" is "model.layers.3.self_attn.q_proj.weight", and so on;
 *  - for architecture llama, llama.cpp's converter permutes the rows of q_proj and k_proj within
 *    each head (it rotates interleaved pairs where transformers rotates halves): the tensors are
 *    marked with row_perm_heads and lf_tensor_read_f32 reads them back in the HF order. qwen2 and
 *    qwen3 are converted without the permutation;
 *  - weights may be block-quantized (Q4_0, Q4_1, Q8_0, K-quants): read_f32 dequantizes them.
 * Llama-3 rope scaling is stored as a tensor of per-frequency divisors ("rope_freqs.weight"); it
 * is accepted when it equals the Llama-3 formula for some factor (the published parameters), so
 * lfserve's RoPE computes the same frequencies. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "forward.h"
#include "gguf.h"
#include "model.h"
#include "quant.h"

/* GGUF block-name suffix -> Hugging Face layer-name suffix. perm: 1 q rows, 2 k rows. */
static const struct {
  const char *gguf, *hf;
  int perm;
} k_layer_names[] = {
    {"attn_norm.weight", "input_layernorm.weight", 0},
    {"attn_q.weight", "self_attn.q_proj.weight", 1},
    {"attn_k.weight", "self_attn.k_proj.weight", 2},
    {"attn_v.weight", "self_attn.v_proj.weight", 0},
    {"attn_q.bias", "self_attn.q_proj.bias", 1},
    {"attn_k.bias", "self_attn.k_proj.bias", 2},
    {"attn_v.bias", "self_attn.v_proj.bias", 0},
    {"attn_q_norm.weight", "self_attn.q_norm.weight", 0},
    {"attn_k_norm.weight", "self_attn.k_norm.weight", 0},
    {"attn_output.weight", "self_attn.o_proj.weight", 0},
    {"ffn_norm.weight", "post_attention_layernorm.weight", 0},
    {"ffn_gate.weight", "mlp.gate_proj.weight", 0},
    {"ffn_up.weight", "mlp.up_proj.weight", 0},
    {"ffn_down.weight", "mlp.down_proj.weight", 0},
};

static const struct {
  const char *gguf, *hf;
} k_global_names[] = {
    {"token_embd.weight", "model.embed_tokens.weight"},
    {"output_norm.weight", "model.norm.weight"},
    {"output.weight", "lm_head.weight"},
};

/* An integer key "<arch>.<suffix>" into *out within [lo, hi]; absent: def (or an error when
 * def < 0 means required). */
static lf_status arch_int(const lf_gguf *g, const char *path, const char *arch, const char *suffix,
                          int64_t def, int64_t lo, int64_t hi, int *out) {
  char key[128];
  snprintf(key, sizeof key, "%s.%s", arch, suffix);
  const int64_t i = lf_gguf_find_key(g, key);
  int64_t v = def;
  if (i < 0) {
    if (def < 0) return lf_error(LF_ERR_FORMAT, "%s: GGUF metadata lacks %s", path, key);
  } else {
    LF_TRY(lf_gguf_kv_int(g, i, &v));
  }
  if (v < lo || v > hi)
    return lf_error(LF_ERR_FORMAT, "%s: GGUF %s = %lld is outside [%lld, %lld]", path, key,
                    (long long)v, (long long)lo, (long long)hi);
  *out = (int)v;
  return LF_OK;
}

static lf_status arch_float(const lf_gguf *g, const char *arch, const char *suffix, double def,
                            double *out) {
  char key[128];
  snprintf(key, sizeof key, "%s.%s", arch, suffix);
  const int64_t i = lf_gguf_find_key(g, key);
  if (i < 0) {
    *out = def;
    return LF_OK;
  }
  return lf_gguf_kv_float(g, i, out);
}

/* rope_freqs.weight holds, per pair, the divisor of the base frequency. Accept it when it is
 * the Llama-3 rule with the published low/high factors and some factor / original context. */
static lf_status gguf_rope_freqs(const lf_checkpoint *ck, const char *path, lf_model_config *c) {
  const lf_tensor_src *t = lf_tensor_set_find(&ck->tensors, "rope_freqs.weight");
  if (!t) return LF_OK;
  const int half = c->head_dim / 2;
  if (t->ndim != 1 || t->shape[0] != half)
    return lf_error(LF_ERR_FORMAT, "%s: rope_freqs.weight must have %d elements", path, half);
  /* [3][half]: the stored divisors, the plain frequencies, the Llama-3 ones (lf_rope_freqs,
   * the table the forward pass uses) */
  float *f = malloc(3 * (size_t)half * sizeof *f);
  if (!f) return lf_error(LF_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
  float *plain = f + half, *scaled = f + 2 * half;
  lf_status st = lf_tensor_read_f32(t, 0, 1, 0, half, f);
  if (st != LF_OK) {
    free(f);
    return st;
  }
  float factor = 1.0f;
  for (int i = 0; i < half; i++)
    if (f[i] > factor) factor = f[i];
  if (factor == 1.0f) { /* all ones: no scaling */
    free(f);
    return LF_OK;
  }
  lf_rope_freqs(c, plain); /* rope_scaling is still NONE here */
  c->rope_scaling = LF_ROPE_SCALING_LLAMA3;
  c->rope_factor = factor;
  c->rope_low_freq_factor = 1.0f;
  c->rope_high_freq_factor = 4.0f;
  /* The original context is not stored either: try the powers of two (8192 for Llama 3.x). */
  int ok = 0;
  for (int orig = 16; orig <= (1 << 22) && !ok; orig *= 2) {
    c->rope_original_max_pos = orig;
    lf_rope_freqs(c, scaled);
    ok = 1;
    for (int i = 0; i < half && ok; i++) {
      const double want = (double)plain[i] / scaled[i];
      if (fabs(want - f[i]) > 1e-4 * want) ok = 0;
    }
  }
  free(f);
  if (!ok)
    return lf_error(LF_ERR_UNSUPPORTED,
                    "%s: rope_freqs.weight is not the Llama-3 rope scaling rule (factor %g, low 1, "
                    "high 4); other per-frequency RoPE factors are not supported",
                    path, (double)factor);
  return LF_OK;
}

/* Renames every tensor to its HF name (unknown names are kept) and marks Q/K for llama. */
static lf_status gguf_rename(lf_checkpoint *ck, const char *path, int permute) {
  const lf_model_config *c = &ck->cfg;
  for (int k = 0; k < ck->tensors.n; k++) {
    lf_tensor_src *t = &ck->tensors.t[k];
    char hf[LF_TENSOR_NAME_MAX] = "";
    int layer = -1, used = 0;
    if (sscanf(t->name, "blk.%d.%n", &layer, &used) == 1 && used > 0 && layer >= 0) {
      if (layer >= c->n_layers)
        return lf_error(LF_ERR_FORMAT, "%s: tensor %s names layer %d of %d", path, t->name, layer,
                        c->n_layers);
      for (size_t i = 0; i < sizeof k_layer_names / sizeof k_layer_names[0]; i++) {
        if (strcmp(t->name + used, k_layer_names[i].gguf) != 0) continue;
        snprintf(hf, sizeof hf, "model.layers.%d.%s", layer, k_layer_names[i].hf);
        if (permute && k_layer_names[i].perm)
          t->row_perm_heads = k_layer_names[i].perm == 1 ? c->n_heads : c->n_kv_heads;
      }
    } else {
      for (size_t i = 0; i < sizeof k_global_names / sizeof k_global_names[0]; i++)
        if (strcmp(t->name, k_global_names[i].gguf) == 0)
          snprintf(hf, sizeof hf, "%s", k_global_names[i].hf);
    }
    if (hf[0]) {
      if (lf_tensor_set_find(&ck->tensors, hf))
        return lf_error(LF_ERR_FORMAT, "%s: two tensors map to %s", path, hf);
      snprintf(t->name, sizeof t->name, "%s", hf);
    }
  }
  return LF_OK;
}

static lf_status gguf_config(const lf_gguf *g, const lf_checkpoint *ck, const char *path,
                             lf_model_config *c, int *permute) {
  lf_gguf_str s;
  char arch[32];
  LF_TRY(lf_gguf_get_str(g, "general.architecture", &s));
  if (lf_gguf_str_copy(s, arch, sizeof arch) != LF_OK)
    return lf_error(LF_ERR_UNSUPPORTED, "%s: GGUF architecture name is too long", path);
  if (strcmp(arch, "llama") && strcmp(arch, "qwen2") && strcmp(arch, "qwen3"))
    return lf_error(LF_ERR_UNSUPPORTED,
                    "%s: GGUF architecture \"%s\" is not supported (llama, qwen2, qwen3 are)", path,
                    arch);
  snprintf(c->model_type, sizeof c->model_type, "%s", arch);
  *permute = strcmp(arch, "llama") == 0;
  const int big = 1 << 30;
  LF_TRY(arch_int(g, path, arch, "embedding_length", -1, 1, 1 << 20, &c->dim));
  LF_TRY(arch_int(g, path, arch, "feed_forward_length", -1, 1, big, &c->hidden_dim));
  LF_TRY(arch_int(g, path, arch, "block_count", -1, 1, 4096, &c->n_layers));
  LF_TRY(arch_int(g, path, arch, "attention.head_count", -1, 1, 4096, &c->n_heads));
  LF_TRY(arch_int(g, path, arch, "attention.head_count_kv", c->n_heads, 1, 4096, &c->n_kv_heads));
  LF_TRY(arch_int(g, path, arch, "attention.key_length", c->dim / c->n_heads, 1, 4096,
                  &c->head_dim));
  int vlen = c->head_dim, rdim = c->head_dim;
  LF_TRY(arch_int(g, path, arch, "attention.value_length", c->head_dim, 1, 4096, &vlen));
  LF_TRY(arch_int(g, path, arch, "rope.dimension_count", c->head_dim, 1, 4096, &rdim));
  if (vlen != c->head_dim || rdim != c->head_dim)
    return lf_error(LF_ERR_UNSUPPORTED,
                    "%s: key length %d, value length %d and rotary dimensions %d differ "
                    "(only full-width RoPE with equal K/V head sizes is supported)",
                    path, c->head_dim, vlen, rdim);
  LF_TRY(arch_int(g, path, arch, "context_length", -1, 1, big, &c->max_seq_len));
  double theta, eps;
  LF_TRY(arch_float(g, arch, "rope.freq_base", 10000.0, &theta));
  LF_TRY(arch_float(g, arch, "attention.layer_norm_rms_epsilon", 1e-6, &eps));
  c->rope_theta = (float)theta;
  c->norm_eps = (float)eps;
  char key[128];
  snprintf(key, sizeof key, "%s.rope.scaling.type", arch);
  const int64_t ks = lf_gguf_find_key(g, key);
  if (ks >= 0) {
    LF_TRY(lf_gguf_kv_str(g, ks, &s));
    if (!lf_gguf_str_eq(s, "none"))
      return lf_error(LF_ERR_UNSUPPORTED, "%s: rope scaling \"%.*s\" is not supported", path,
                      (int)(s.len > 32 ? 32 : s.len), s.ptr);
  }
  c->rope_style = LF_ROPE_HALF; /* llama: rows un-permuted at read; qwen: NEOX, never permuted */
  c->rope_scaling = LF_ROPE_SCALING_NONE;

  /* The vocabulary: the embedding's row count (the metadata's count must agree). */
  const lf_tensor_src *emb = lf_tensor_set_find(&ck->tensors, "token_embd.weight");
  if (!emb || emb->ndim != 2)
    return lf_error(LF_ERR_FORMAT, "%s: GGUF lacks a 2-D token_embd.weight", path);
  if (emb->shape[0] < 1 || emb->shape[0] > big)
    return lf_error(LF_ERR_FORMAT, "%s: token_embd.weight has %lld rows", path,
                    (long long)emb->shape[0]);
  c->vocab_size = (int)emb->shape[0];
  int vs = c->vocab_size;
  LF_TRY(arch_int(g, path, arch, "vocab_size", c->vocab_size, 1, big, &vs));
  if (vs != c->vocab_size)
    return lf_error(LF_ERR_FORMAT, "%s: %s.vocab_size %d but token_embd.weight has %d rows", path,
                    arch, vs, c->vocab_size);
  c->tie_embeddings = lf_tensor_set_find(&ck->tensors, "output.weight") == NULL;
  c->qkv_bias = lf_tensor_set_find(&ck->tensors, "blk.0.attn_q.bias") != NULL;
  c->qk_norm = lf_tensor_set_find(&ck->tensors, "blk.0.attn_q_norm.weight") != NULL;

  int64_t v;
  c->bos_id = -1;
  if (lf_gguf_find_key(g, "tokenizer.ggml.bos_token_id") >= 0) {
    LF_TRY(lf_gguf_get_int(g, "tokenizer.ggml.bos_token_id", &v));
    if (v >= 0 && v < c->vocab_size) c->bos_id = (int)v;
  }
  c->n_eos = 0;
  static const char *const eos_keys[] = {"tokenizer.ggml.eos_token_id",
                                         "tokenizer.ggml.eot_token_id"};
  for (size_t k = 0; k < 2; k++) {
    if (lf_gguf_find_key(g, eos_keys[k]) < 0) continue;
    LF_TRY(lf_gguf_get_int(g, eos_keys[k], &v));
    if (v < 0 || v >= c->vocab_size)
      return lf_error(LF_ERR_FORMAT, "%s: %s = %lld is outside the vocabulary", path, eos_keys[k],
                      (long long)v);
    if (c->n_eos == 0 || c->eos_ids[0] != (int)v) c->eos_ids[c->n_eos++] = (int)v;
  }
  return LF_OK;
}

lf_status lf_checkpoint_open_gguf(const char *file, lf_checkpoint *out) {
  if (!file || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_checkpoint_open_gguf: NULL argument");
  memset(out, 0, sizeof *out);
  lf_gguf *g = NULL;
  int permute = 0;
  lf_status st = lf_gguf_tensor_set_load(&out->tensors, file, &g);
  if (st == LF_OK) st = gguf_config(g, out, file, &out->cfg, &permute);
  if (st == LF_OK) st = gguf_rename(out, file, permute);
  if (st == LF_OK) st = gguf_rope_freqs(out, file, &out->cfg);
  if (st == LF_OK) st = lf_config_validate(&out->cfg, file);
  lf_gguf_free(g);
  if (st != LF_OK) lf_checkpoint_close(out);
  return st;
}

/* llama2.c legacy checkpoints (version 0 of run.c's export): a 7-int32 header, then fp32 arrays
 * stacked over layers. We register slices of the mapping under Hugging Face names so that
 * weights.c checks and converts both formats the same way. Layout:
 * ../shared/models/stories260K/README.md. */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "base/error.h"
#include "model.h"

#define LLAMA2C_HEADER_BYTES 28

/* Sizes come from an untrusted header: every product is checked. */
static int u64_mul(uint64_t a, uint64_t b, uint64_t *r) {
  if (a != 0 && b > UINT64_MAX / a) return 0;
  *r = a * b;
  return 1;
}

static int u64_add(uint64_t a, uint64_t b, uint64_t *r) {
  if (b > UINT64_MAX - a) return 0;
  *r = a + b;
  return 1;
}

/* *total += a * b * c, clearing *ok on overflow. */
static void l2c_count(int *ok, uint64_t *total, uint64_t a, uint64_t b, uint64_t c) {
  uint64_t t;
  *ok = *ok && u64_mul(a, b, &t) && u64_mul(t, c, &t) && u64_add(*total, t, total);
}

static lf_status l2c_add(lf_tensor_set *s, const char *file, const char *name, int64_t d0,
                         int64_t d1, const float *data) {
  lf_tensor_src t;
  memset(&t, 0, sizeof t);
  snprintf(t.name, sizeof t.name, "%s", name);
  t.dtype = LF_DTYPE_F32;
  t.ndim = d1 > 0 ? 2 : 1;
  t.shape[0] = d0;
  t.shape[1] = d1 > 0 ? d1 : 0;
  t.data = data;
  t.file = file;
  return lf_tensor_set_add(s, &t);
}

static lf_status l2c_register(lf_checkpoint *ck, const char *file, const float *p, int dim,
                              int hidden, int n_layers, int kv_dim, int vocab, int seq_len,
                              int head_dim, int shared) {
  lf_tensor_set *s = &ck->tensors;
  const int64_t D = dim, H = hidden, KV = kv_dim, V = vocab;
  char nm[LF_TENSOR_NAME_MAX];

  LF_TRY(l2c_add(s, file, "model.embed_tokens.weight", V, D, p));
  p += V * D;
  /* Stacked arrays in file order, [n_layers][d0][d1] each (d1 0: a vector); layer l of one is its
   * l-th block. */
  const struct {
    const char *suffix;
    int64_t d0, d1;
  } parts[] = {
      {"input_layernorm.weight", D, 0},   {"self_attn.q_proj.weight", D, D},
      {"self_attn.k_proj.weight", KV, D}, {"self_attn.v_proj.weight", KV, D},
      {"self_attn.o_proj.weight", D, D},  {"post_attention_layernorm.weight", D, 0},
      {"mlp.gate_proj.weight", H, D},     {"mlp.down_proj.weight", D, H},
      {"mlp.up_proj.weight", H, D},
  };
  enum { N_PARTS = sizeof parts / sizeof parts[0] };
  const float *stacked[N_PARTS];
  int64_t per_layer[N_PARTS];
  for (int i = 0; i < N_PARTS; i++) {
    per_layer[i] = parts[i].d0 * (parts[i].d1 > 0 ? parts[i].d1 : 1);
    stacked[i] = p;
    p += n_layers * per_layer[i];
  }
  const float *rms_final = p;
  p += D;
  p += (int64_t)seq_len * head_dim; /* freq_cis_real, freq_cis_imag: [seq_len][head_dim/2] each */
  const float *wcls = p;            /* [vocab][dim] when unshared */

  for (int l = 0; l < n_layers; l++)
    for (int i = 0; i < N_PARTS; i++) {
      snprintf(nm, sizeof nm, "model.layers.%d.%s", l, parts[i].suffix);
      LF_TRY(l2c_add(s, file, nm, parts[i].d0, parts[i].d1, stacked[i] + l * per_layer[i]));
    }
  LF_TRY(l2c_add(s, file, "model.norm.weight", D, 0, rms_final));
  if (!shared) LF_TRY(l2c_add(s, file, "lm_head.weight", V, D, wcls));
  return LF_OK;
}

static lf_status l2c_open(const char *path, lf_checkpoint *ck) {
  int idx;
  LF_TRY(lf_tensor_set_map_file(&ck->tensors, path, &idx));
  const lf_mapping *m = &ck->tensors.maps[idx];
  const char *file = m->path;
  if (m->size < LLAMA2C_HEADER_BYTES)
    return lf_error(LF_ERR_FORMAT,
                    "%s: truncated: %zu bytes, a llama2.c checkpoint has a 28-byte header", file,
                    m->size);
  int32_t h[7]; /* dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len */
  memcpy(h, m->addr, sizeof h);
  const int dim = h[0], hidden = h[1], n_layers = h[2], n_heads = h[3], n_kv = h[4];
  const int seq_len = h[6];
  if (dim <= 0 || hidden <= 0 || n_layers <= 0 || n_heads <= 0 || n_kv <= 0 || seq_len <= 0 ||
      h[5] == 0 || h[5] == INT32_MIN)
    return lf_error(LF_ERR_FORMAT,
                    "%s: bad llama2.c header (dim %d, hidden_dim %d, n_layers %d, n_heads %d, "
                    "n_kv_heads %d, vocab_size %d, seq_len %d): not a llama2.c checkpoint?",
                    file, dim, hidden, n_layers, n_heads, n_kv, h[5], seq_len);
  /* A negative vocab_size marks an unshared classifier (llama2.c's export convention). */
  const int shared = h[5] > 0;
  const int vocab = shared ? h[5] : -h[5];
  if (dim % n_heads != 0 || n_heads % n_kv != 0)
    return lf_error(LF_ERR_FORMAT,
                    "%s: dim %d must be a multiple of n_heads %d, and n_heads of n_kv_heads %d",
                    file, dim, n_heads, n_kv);
  const int head_dim = dim / n_heads;
  const int kv_dim = head_dim * n_kv;
  if (head_dim % 2 != 0)
    return lf_error(LF_ERR_FORMAT, "%s: head_dim %d (dim / n_heads) is odd", file, head_dim);

  const uint64_t L = (uint64_t)n_layers, D = (uint64_t)dim, H = (uint64_t)hidden;
  const uint64_t KV = (uint64_t)kv_dim, V = (uint64_t)vocab;
  uint64_t total = 0; /* floats after the header */
  int ok = 1;
  l2c_count(&ok, &total, V, D, 1);                                  /* token_embedding */
  l2c_count(&ok, &total, L, D, 1);                                  /* rms_att */
  l2c_count(&ok, &total, L, D, D);                                  /* wq */
  l2c_count(&ok, &total, L, KV, D);                                 /* wk */
  l2c_count(&ok, &total, L, KV, D);                                 /* wv */
  l2c_count(&ok, &total, L, D, D);                                  /* wo */
  l2c_count(&ok, &total, L, D, 1);                                  /* rms_ffn */
  l2c_count(&ok, &total, L, H, D);                                  /* w1 */
  l2c_count(&ok, &total, L, D, H);                                  /* w2 */
  l2c_count(&ok, &total, L, H, D);                                  /* w3 */
  l2c_count(&ok, &total, D, 1, 1);                                  /* rms_final */
  l2c_count(&ok, &total, (uint64_t)seq_len, (uint64_t)head_dim, 1); /* freq_cis re + im */
  if (!shared) l2c_count(&ok, &total, V, D, 1);                     /* wcls */
  uint64_t expect = 0;
  ok = ok && u64_mul(total, 4, &expect) && u64_add(expect, LLAMA2C_HEADER_BYTES, &expect);
  /* The pointer arithmetic in l2c_register uses int64 element counts. */
  if (!ok || total > (uint64_t)INT64_MAX / 4)
    return lf_error(LF_ERR_FORMAT, "%s: llama2.c header describes an impossibly large model", file);
  if ((uint64_t)m->size < expect)
    return lf_error(LF_ERR_FORMAT,
                    "%s: truncated: %zu bytes, the header (dim %d, hidden_dim %d, %d layers, "
                    "vocab %d%s) needs %llu",
                    file, m->size, dim, hidden, n_layers, vocab,
                    shared ? "" : ", unshared classifier", (unsigned long long)expect);
  if ((uint64_t)m->size > expect)
    return lf_error(LF_ERR_FORMAT,
                    "%s: trailing bytes: %zu bytes, the header (dim %d, hidden_dim %d, %d layers, "
                    "vocab %d%s) needs exactly %llu",
                    file, m->size, dim, hidden, n_layers, vocab,
                    shared ? "" : ", unshared classifier", (unsigned long long)expect);

  lf_model_config *c = &ck->cfg;
  /* The llama2.c reference (run.c) stops generating when the model emits BOS (1), not the
   * sentencepiece EOS (2): stories models end a story by starting the next one. Declaring 1 as
   * the end-of-sequence id makes the engine stop exactly where the reference does
   * (greedy_reference.txt was produced that way). */
  *c = (lf_model_config){.model_type = "llama2c",
                         .dim = dim,
                         .hidden_dim = hidden,
                         .n_layers = n_layers,
                         .n_heads = n_heads,
                         .n_kv_heads = n_kv,
                         .head_dim = head_dim,
                         .vocab_size = vocab,
                         .max_seq_len = seq_len,
                         .rope_theta = 10000.0f,
                         .norm_eps = 1e-5f,
                         .rope_style = LF_ROPE_INTERLEAVED,
                         .rope_scaling = LF_ROPE_SCALING_NONE,
                         .tie_embeddings = shared,
                         .bos_id = 1,
                         .eos_ids = {1},
                         .n_eos = 1};

  LF_TRY(l2c_register(ck, file, (const float *)((const char *)m->addr + LLAMA2C_HEADER_BYTES), dim,
                      hidden, n_layers, kv_dim, vocab, seq_len, head_dim, shared));
  return lf_config_validate(c, file);
}

lf_status lf_checkpoint_open_llama2c(const char *file, lf_checkpoint *out) {
  if (!file || !out)
    return lf_error(LF_ERR_INVALID_ARG, "lf_checkpoint_open_llama2c: NULL argument");
  memset(out, 0, sizeof *out);
  lf_status st = l2c_open(file, out);
  if (st != LF_OK) lf_checkpoint_close(out);
  return st;
}

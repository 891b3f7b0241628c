/* Opening a checkpoint of either format, and the config checks every format shares. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/error.h"
#include "gguf.h"
#include "model.h"

lf_status lf_checkpoint_open(const char *path, lf_checkpoint *out) {
  if (!path || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_checkpoint_open: NULL argument");
  memset(out, 0, sizeof *out);
  if (!strncmp(path, "random:", 7)) return lf_checkpoint_open_random(path + 7, out);
  struct stat st;
  if (stat(path, &st) != 0)
    return lf_error(LF_ERR_IO, "%s: cannot open checkpoint: %s", path, strerror(errno));
  if (S_ISDIR(st.st_mode)) return lf_checkpoint_open_hf(path, out);
  /* GGUF files start with their magic; llama2.c files with a config of seven int32s. */
  if (S_ISREG(st.st_mode))
    return lf_gguf_file_has_magic(path) ? lf_checkpoint_open_gguf(path, out)
                                        : lf_checkpoint_open_llama2c(path, out);
  return lf_error(LF_ERR_IO, "%s: checkpoint is neither a directory nor a regular file", path);
}

/* The random:NAME presets: the published configs of those models. tiny-llama and tiny-qwen3 are
 * small enough for the cpu backend in tests; tiny-qwen3 has head_dim 64 and group 4, the shape
 * the fused cuda decode kernel takes. */
typedef struct random_preset {
  const char *name;
  lf_model_config cfg;
} random_preset;

#define LLAMA3_ROPE                                                                                \
  .rope_theta = 500000.0f, .rope_scaling = LF_ROPE_SCALING_LLAMA3, .rope_factor = 8.0f,            \
  .rope_low_freq_factor = 1.0f, .rope_high_freq_factor = 4.0f, .rope_original_max_pos = 8192
#define LLAMA3_TOKENS .bos_id = 128000, .eos_ids = {128001, 128009}, .n_eos = 2

/* clang-format off */ /* one preset to a paragraph */
static const random_preset random_presets[] = {
    {"llama3-8b",
     {.model_type = "llama", .dim = 4096, .hidden_dim = 14336, .n_layers = 32, .n_heads = 32,
      .n_kv_heads = 8, .head_dim = 128, .vocab_size = 128256, .max_seq_len = 131072,
      .norm_eps = 1e-5f, LLAMA3_ROPE, LLAMA3_TOKENS}},
    {"llama3-70b",
     {.model_type = "llama", .dim = 8192, .hidden_dim = 28672, .n_layers = 80, .n_heads = 64,
      .n_kv_heads = 8, .head_dim = 128, .vocab_size = 128256, .max_seq_len = 131072,
      .norm_eps = 1e-5f, LLAMA3_ROPE, LLAMA3_TOKENS}},
    {"qwen3-8b",
     {.model_type = "qwen3", .dim = 4096, .hidden_dim = 12288, .n_layers = 36, .n_heads = 32,
      .n_kv_heads = 8, .head_dim = 128, .vocab_size = 151936, .max_seq_len = 40960,
      .rope_theta = 1000000.0f, .norm_eps = 1e-6f, .qk_norm = 1, .bos_id = -1,
      .eos_ids = {151645, 151643}, .n_eos = 2}},
    {"tiny-llama",
     {.model_type = "llama", .dim = 256, .hidden_dim = 768, .n_layers = 4, .n_heads = 8,
      .n_kv_heads = 2, .head_dim = 32, .vocab_size = 1024, .max_seq_len = 2048,
      .rope_theta = 10000.0f, .norm_eps = 1e-5f, .bos_id = -1}},
    {"tiny-qwen3",
     {.model_type = "qwen3", .dim = 256, .hidden_dim = 768, .n_layers = 4, .n_heads = 8,
      .n_kv_heads = 2, .head_dim = 64, .vocab_size = 1024, .max_seq_len = 2048,
      .rope_theta = 1000000.0f, .norm_eps = 1e-5f, .qk_norm = 1, .bos_id = -1}},
    {"tiny-llama-kv4", /* four KV heads: eviction groups and rank-local layer scope in tests */
     {.model_type = "llama", .dim = 256, .hidden_dim = 768, .n_layers = 4, .n_heads = 8,
      .n_kv_heads = 4, .head_dim = 32, .vocab_size = 1024, .max_seq_len = 2048,
      .rope_theta = 10000.0f, .norm_eps = 1e-5f, .bos_id = -1}},
};
/* clang-format on */
#undef LLAMA3_ROPE
#undef LLAMA3_TOKENS

lf_status lf_checkpoint_open_random(const char *spec, lf_checkpoint *out) {
  if (!spec || !out)
    return lf_error(LF_ERR_INVALID_ARG, "lf_checkpoint_open_random: NULL argument");
  memset(out, 0, sizeof *out);
  char name[64];
  const char *colon = strchr(spec, ':');
  size_t nl = colon ? (size_t)(colon - spec) : strlen(spec);
  if (nl >= sizeof name) nl = sizeof name - 1;
  memcpy(name, spec, nl);
  name[nl] = '\0';
  uint64_t seed = 0;
  if (colon) {
    char *end = NULL;
    errno = 0;
    seed = strtoull(colon + 1, &end, 10);
    if (errno || !end || *end || end == colon + 1)
      return lf_error(LF_ERR_INVALID_ARG, "random:%s: the seed after ':' must be a number", spec);
  }
  /* "NAME/T": one rank's shard of NAME at tensor-parallel degree T, as a whole model (heads, KV
   * heads, MLP width and vocabulary divided by T), to time a rank's kernels on one GPU. */
  int shard = 1;
  char *slash = strchr(name, '/');
  if (slash) {
    char *end = NULL;
    errno = 0;
    const long t = strtol(slash + 1, &end, 10);
    if (errno || !end || *end || end == slash + 1 || t < 1 || t > 64)
      return lf_error(LF_ERR_INVALID_ARG, "random:%s: the shard degree after '/' must be 1..64",
                      spec);
    shard = (int)t;
    *slash = '\0';
  }
  const random_preset *pr = NULL;
  for (size_t i = 0; i < sizeof random_presets / sizeof random_presets[0]; i++)
    if (!strcmp(name, random_presets[i].name)) pr = &random_presets[i];
  if (!pr)
    return lf_error(LF_ERR_INVALID_ARG,
                    "random:%s: unknown model (llama3-8b, qwen3-8b, llama3-70b, tiny-llama, "
                    "tiny-qwen3, tiny-llama-kv4)",
                    name);
  lf_model_config *c = &out->cfg;
  *c = pr->cfg;
  if (shard > 1) {
    if (c->n_kv_heads % shard || c->hidden_dim % shard || c->vocab_size % shard)
      return lf_error(
          LF_ERR_INVALID_ARG,
          "random:%s: %d KV heads, MLP width %d and vocabulary %d must all divide by %d", spec,
          c->n_kv_heads, c->hidden_dim, c->vocab_size, shard);
    c->n_heads /= shard;
    c->n_kv_heads /= shard;
    c->hidden_dim /= shard;
    c->vocab_size /= shard;
    c->n_eos = 0; /* the EOS ids may be outside the smaller vocabulary */
    c->bos_id = -1;
  }
  out->random_weights = 1;
  out->random_seed = seed;
  return lf_config_validate(c, "random checkpoint");
}

void lf_checkpoint_close(lf_checkpoint *ck) {
  if (!ck) return;
  lf_lora_free(ck->lora);
  lf_tensor_set_free(&ck->tensors);
  memset(ck, 0, sizeof *ck);
}

lf_status lf_config_validate(const lf_model_config *c, const char *path) {
  if (!c) return lf_error(LF_ERR_INVALID_ARG, "lf_config_validate: NULL config");
  if (!path) path = "(config)";
  if (!memchr(c->model_type, '\0', sizeof c->model_type) || !c->model_type[0])
    return lf_error(LF_ERR_FORMAT, "%s: model_type is empty", path);

  const struct {
    const char *name;
    int v;
  } pos[] = {
      {"hidden size (dim)", c->dim},
      {"intermediate size (hidden_dim)", c->hidden_dim},
      {"number of layers", c->n_layers},
      {"number of attention heads", c->n_heads},
      {"number of key/value heads", c->n_kv_heads},
      {"head_dim", c->head_dim},
      {"vocab_size", c->vocab_size},
      {"max sequence length", c->max_seq_len},
  };
  for (size_t i = 0; i < sizeof pos / sizeof pos[0]; i++)
    if (pos[i].v <= 0)
      return lf_error(LF_ERR_FORMAT, "%s: %s is %d, must be positive", path, pos[i].name, pos[i].v);

  if (c->n_heads % c->n_kv_heads != 0)
    return lf_error(LF_ERR_FORMAT,
                    "%s: %d attention heads are not a multiple of %d key/value heads", path,
                    c->n_heads, c->n_kv_heads);
  /* Both RoPE styles rotate pairs of a head's dimensions. */
  if (c->head_dim % 2 != 0)
    return lf_error(LF_ERR_FORMAT, "%s: head_dim %d is odd (RoPE needs pairs)", path, c->head_dim);
  /* Row counts are ints throughout the engine. */
  if ((int64_t)c->n_heads * c->head_dim > INT_MAX)
    return lf_error(LF_ERR_FORMAT, "%s: %d heads x head_dim %d is too large", path, c->n_heads,
                    c->head_dim);

  if (!(c->norm_eps > 0) || !isfinite(c->norm_eps))
    return lf_error(LF_ERR_FORMAT, "%s: RMSNorm epsilon %g must be positive and finite", path,
                    (double)c->norm_eps);
  if (!(c->rope_theta > 0) || !isfinite(c->rope_theta))
    return lf_error(LF_ERR_FORMAT, "%s: rope_theta %g must be positive and finite", path,
                    (double)c->rope_theta);
  if (c->rope_style != LF_ROPE_HALF && c->rope_style != LF_ROPE_INTERLEAVED)
    return lf_error(LF_ERR_FORMAT, "%s: bad rope style %d", path, (int)c->rope_style);
  if (c->rope_scaling == LF_ROPE_SCALING_LLAMA3) {
    /* The llama3 ramp divides by (high - low) and by the factor. */
    if (!(c->rope_factor > 0) || !isfinite(c->rope_factor) || !(c->rope_low_freq_factor > 0) ||
        !(c->rope_high_freq_factor > c->rope_low_freq_factor) ||
        !isfinite(c->rope_high_freq_factor) || c->rope_original_max_pos <= 0)
      return lf_error(LF_ERR_FORMAT,
                      "%s: llama3 rope scaling needs factor > 0, 0 < low_freq_factor < "
                      "high_freq_factor and original_max_position_embeddings > 0 (got %g, %g, "
                      "%g, %d)",
                      path, (double)c->rope_factor, (double)c->rope_low_freq_factor,
                      (double)c->rope_high_freq_factor, c->rope_original_max_pos);
  } else if (c->rope_scaling != LF_ROPE_SCALING_NONE) {
    return lf_error(LF_ERR_FORMAT, "%s: bad rope scaling %d", path, (int)c->rope_scaling);
  }

  if (c->bos_id < -1 || c->bos_id >= c->vocab_size)
    return lf_error(LF_ERR_FORMAT, "%s: bos_token_id %d is outside the vocabulary (%d)", path,
                    c->bos_id, c->vocab_size);
  if (c->n_eos < 0 || c->n_eos > (int)(sizeof c->eos_ids / sizeof c->eos_ids[0]))
    return lf_error(LF_ERR_FORMAT, "%s: bad number of eos ids %d", path, c->n_eos);
  for (int i = 0; i < c->n_eos; i++)
    if (c->eos_ids[i] < 0 || c->eos_ids[i] >= c->vocab_size)
      return lf_error(LF_ERR_FORMAT, "%s: eos_token_id %d is outside the vocabulary (%d)", path,
                      c->eos_ids[i], c->vocab_size);
  return LF_OK;
}

/* Opening a checkpoint of either format, and the config checks every format shares. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>

#include "error.h"
#include "model.h"

lf_status lf_checkpoint_open(const char *path, lf_checkpoint *out) {
  if (!path || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_checkpoint_open: NULL argument");
  memset(out, 0, sizeof *out);
  struct stat st;
  if (stat(path, &st) != 0)
    return lf_error(LF_ERR_IO, "%s: cannot open checkpoint: %s", path, strerror(errno));
  if (S_ISDIR(st.st_mode)) return lf_checkpoint_open_hf(path, out);
  if (S_ISREG(st.st_mode)) return lf_checkpoint_open_llama2c(path, out);
  return lf_error(LF_ERR_IO, "%s: checkpoint is neither a directory nor a regular file", path);
}

void lf_checkpoint_close(lf_checkpoint *ck) {
  if (!ck) return;
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

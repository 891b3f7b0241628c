/* Checking a checkpoint's tensors against its config and converting them to fp32.
 *
 * Both checkpoint formats arrive here as an lf_tensor_set with Hugging Face names, so presence,
 * shape and the conversion are checked once. Every tensor goes through wt_load_slice, which
 * reads any [rows x cols] block of a tensor after checking its full shape: a tensor-parallel
 * loader takes its heads (rows) or its columns with the same call. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "model.h"
#include "parallel/shard.h"
#include "kernels/random_weights.h"

/* Where the checkpoint lives, for messages: the file, or the directory of the shards. */
static void wt_where(const lf_checkpoint *ck, char *buf, size_t cap) {
  const lf_tensor_set *s = &ck->tensors;
  if (s->n_maps <= 0) {
    snprintf(buf, cap, "the checkpoint");
  } else if (s->n_maps == 1) {
    snprintf(buf, cap, "%s", s->maps[0].path);
  } else {
    const char *p = s->maps[0].path, *slash = strrchr(p, '/');
    int dl = slash ? (int)(slash - p) : 1;
    snprintf(buf, cap, "%.*s (%d shards)", dl, slash ? p : ".", s->n_maps);
  }
}

static void wt_shape_str(char *buf, size_t cap, int ndim, const int64_t *shape) {
  size_t n = (size_t)snprintf(buf, cap, "[");
  for (int d = 0; d < ndim && n < cap; d++)
    n += (size_t)snprintf(buf + n, cap - n, d ? ", %lld" : "%lld", (long long)shape[d]);
  if (n < cap) snprintf(buf + n, cap - n, "]");
}

/* A random checkpoint's block (see wt_load_slice): element (r, c) of a [rows][cols] tensor is
 * value number r * cols + c, as on the device. */
static lf_status wt_random_slice(const lf_checkpoint *ck, const char *name, int64_t cols,
                                 int64_t row0, int64_t nrows, int64_t col0, int64_t ncols,
                                 float **out) {
  uint32_t id = 0;
  int kind = 0;
  if (!lf_rw_tensor_of(name, &id, &kind))
    return lf_error(LF_ERR_MISSING_TENSOR, "random checkpoint has no tensor %s", name);
  if (nrows <= 0 || ncols <= 0 || (uint64_t)nrows > SIZE_MAX / sizeof(float) / (uint64_t)ncols)
    return lf_error(LF_ERR_INVALID_ARG, "tensor %s: bad slice", name);
  float *buf = malloc((size_t)nrows * (size_t)ncols * sizeof(float)); /* [nrows][ncols] */
  if (!buf) return lf_error(LF_ERR_OUT_OF_MEMORY, "tensor %s: %lld x %lld", name,
                            (long long)nrows, (long long)ncols);
  const int64_t rowlen = cols > 0 ? cols : 0; /* a vector is one row */
  const float scale = sqrtf(3.0f / (float)(cols > 0 ? cols : 1));
  for (int64_t r = 0; r < nrows; r++)
    for (int64_t c = 0; c < ncols; c++)
      buf[r * ncols + c] = lf_rw_value(ck->random_seed, id, kind, scale,
                                       (uint64_t)((row0 + r) * rowlen + col0 + c));
  *out = buf;
  return LF_OK;
}

/* The tensor `name` must exist with shape [rows][cols] (cols == 0: a vector [rows]). Reads the
 * block rows [row0, row0 + nrows) x cols [col0, col0 + ncols) into a fresh buffer
 * *out [nrows][ncols] (for a vector the block is elements [col0, col0 + ncols), row0 = 0,
 * nrows = 1). */
static lf_status wt_load_slice(const lf_checkpoint *ck, const char *name, int64_t rows,
                               int64_t cols, int64_t row0, int64_t nrows, int64_t col0,
                               int64_t ncols, float **out) {
  *out = NULL;
  char where[320];
  if (ck->random_weights) return wt_random_slice(ck, name, cols, row0, nrows, col0, ncols, out);
  const lf_tensor_src *t = lf_tensor_set_find(&ck->tensors, name);
  if (!t) {
    wt_where(ck, where, sizeof where);
    return lf_error(LF_ERR_MISSING_TENSOR, "tensor %s is missing from %s", name, where);
  }
  const int ndim = cols > 0 ? 2 : 1;
  const int64_t want[2] = {rows, cols};
  if (t->ndim != ndim || t->shape[0] != rows || (ndim == 2 && t->shape[1] != cols)) {
    char a[64], b[120];
    wt_shape_str(a, sizeof a, ndim, want);
    wt_shape_str(b, sizeof b, t->ndim, t->shape);
    return lf_error(LF_ERR_SHAPE, "tensor %s in %s: expected shape %s, found %s", name,
                    t->file ? t->file : "the checkpoint", a, b);
  }
  if (nrows <= 0 || ncols <= 0 || (uint64_t)nrows > SIZE_MAX / sizeof(float) / (uint64_t)ncols)
    return lf_error(LF_ERR_INVALID_ARG, "tensor %s: bad slice %lld x %lld", name, (long long)nrows,
                    (long long)ncols);
  size_t bytes = (size_t)nrows * (size_t)ncols * sizeof(float);
  float *buf = malloc(bytes); /* [nrows][ncols] */
  if (!buf)
    return lf_error(LF_ERR_OUT_OF_MEMORY, "tensor %s: cannot allocate %zu bytes", name, bytes);
  lf_status st = lf_tensor_read_f32(t, row0, nrows, col0, ncols, buf);
  if (st != LF_OK) {
    free(buf);
    return st;
  }
  *out = buf;
  return LF_OK;
}

/* Tensors the forward pass has no slot for: loading the rest would compute another model. */
static lf_status wt_check_unused(const lf_checkpoint *ck, int l) {
  const lf_model_config *c = &ck->cfg;
  static const char *const never[] = {"self_attn.o_proj.bias", "mlp.gate_proj.bias",
                                      "mlp.up_proj.bias", "mlp.down_proj.bias"};
  static const char *const bias[] = {"self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                     "self_attn.v_proj.bias"};
  static const char *const norm[] = {"self_attn.q_norm.weight", "self_attn.k_norm.weight"};
  char nm[LF_TENSOR_NAME_MAX];
  for (size_t i = 0; i < sizeof never / sizeof never[0]; i++) {
    snprintf(nm, sizeof nm, "model.layers.%d.%s", l, never[i]);
    const lf_tensor_src *t = lf_tensor_set_find(&ck->tensors, nm);
    if (t)
      return lf_error(LF_ERR_UNSUPPORTED, "tensor %s in %s: this bias is not supported", nm,
                      t->file ? t->file : "the checkpoint");
  }
  for (size_t i = 0; !c->qkv_bias && i < sizeof bias / sizeof bias[0]; i++) {
    snprintf(nm, sizeof nm, "model.layers.%d.%s", l, bias[i]);
    const lf_tensor_src *t = lf_tensor_set_find(&ck->tensors, nm);
    if (t)
      return lf_error(LF_ERR_FORMAT,
                      "tensor %s in %s: the config (%s) has no q/k/v biases (attention_bias)", nm,
                      t->file ? t->file : "the checkpoint", c->model_type);
  }
  for (size_t i = 0; !c->qk_norm && i < sizeof norm / sizeof norm[0]; i++) {
    snprintf(nm, sizeof nm, "model.layers.%d.%s", l, norm[i]);
    const lf_tensor_src *t = lf_tensor_set_find(&ck->tensors, nm);
    if (t)
      return lf_error(LF_ERR_FORMAT, "tensor %s in %s: the config (%s) has no q/k norms", nm,
                      t->file ? t->file : "the checkpoint", c->model_type);
  }
  return LF_OK;
}

/* Rows [row0, row0 + nrows) of a [rows][cols] matrix (cols > 0), or elements
 * [row0, row0 + nrows) of a vector [rows] (cols == 0). */
static lf_status wt_load_rows(const lf_checkpoint *ck, const char *name, int64_t rows,
                              int64_t cols, int64_t row0, int64_t nrows, float **out,
                              size_t *bytes) {
  lf_status st = cols > 0 ? wt_load_slice(ck, name, rows, cols, row0, nrows, 0, cols, out)
                          : wt_load_slice(ck, name, rows, 0, 0, 1, row0, nrows, out);
  if (st == LF_OK) *bytes += (size_t)nrows * (size_t)(cols > 0 ? cols : 1) * sizeof(float);
  return st;
}

/* Columns [col0, col0 + ncols) of a [rows][cols] matrix. */
static lf_status wt_load_cols(const lf_checkpoint *ck, const char *name, int64_t rows,
                              int64_t cols, int64_t col0, int64_t ncols, float **out,
                              size_t *bytes) {
  lf_status st = wt_load_slice(ck, name, rows, cols, 0, rows, col0, ncols, out);
  if (st == LF_OK) *bytes += (size_t)rows * (size_t)ncols * sizeof(float);
  return st;
}

/* One layer's slices under the plan sh (the whole layer when sh is the single-rank plan). */
static lf_status wt_load_layer(const lf_checkpoint *ck, const lf_shard *sh, int l,
                               lf_layer_weights *lw, size_t *by) {
  const lf_model_config *c = &ck->cfg;
  const int64_t dim = c->dim, hid = c->hidden_dim, hd = c->head_dim;
  const int64_t q_dim = (int64_t)c->n_heads * hd, kv_dim = (int64_t)c->n_kv_heads * hd;
  const int64_t cq0 = (int64_t)sh->cq0 * hd, ncq = (int64_t)sh->n_cq * hd;
  const int64_t kv0 = (int64_t)sh->kv0 * hd, nkv = (int64_t)sh->n_kv * hd;
  char nm[LF_TENSOR_NAME_MAX];
#define WT_NAME(suffix) (snprintf(nm, sizeof nm, "model.layers.%d.%s", l, suffix), nm)
  LF_TRY(wt_check_unused(ck, l));
  LF_TRY(wt_load_rows(ck, WT_NAME("input_layernorm.weight"), dim, 0, 0, dim, &lw->rms_att, by));
  LF_TRY(wt_load_rows(ck, WT_NAME("self_attn.q_proj.weight"), q_dim, dim, cq0, ncq, &lw->wq, by));
  LF_TRY(wt_load_rows(ck, WT_NAME("self_attn.k_proj.weight"), kv_dim, dim, kv0, nkv, &lw->wk, by));
  LF_TRY(wt_load_rows(ck, WT_NAME("self_attn.v_proj.weight"), kv_dim, dim, kv0, nkv, &lw->wv, by));
  if (c->qkv_bias) {
    LF_TRY(wt_load_rows(ck, WT_NAME("self_attn.q_proj.bias"), q_dim, 0, cq0, ncq, &lw->bq, by));
    LF_TRY(wt_load_rows(ck, WT_NAME("self_attn.k_proj.bias"), kv_dim, 0, kv0, nkv, &lw->bk, by));
    LF_TRY(wt_load_rows(ck, WT_NAME("self_attn.v_proj.bias"), kv_dim, 0, kv0, nkv, &lw->bv, by));
  }
  if (c->qk_norm) {
    LF_TRY(wt_load_rows(ck, WT_NAME("self_attn.q_norm.weight"), hd, 0, 0, hd, &lw->q_norm, by));
    LF_TRY(wt_load_rows(ck, WT_NAME("self_attn.k_norm.weight"), hd, 0, 0, hd, &lw->k_norm, by));
  }
  LF_TRY(wt_load_cols(ck, WT_NAME("self_attn.o_proj.weight"), dim, q_dim, (int64_t)sh->q0 * hd,
                      (int64_t)sh->n_q * hd, &lw->wo, by));
  LF_TRY(wt_load_rows(ck, WT_NAME("post_attention_layernorm.weight"), dim, 0, 0, dim,
                      &lw->rms_ffn, by));
  LF_TRY(wt_load_rows(ck, WT_NAME("mlp.gate_proj.weight"), hid, dim, sh->hid0, sh->n_hid,
                      &lw->w_gate, by));
  LF_TRY(wt_load_rows(ck, WT_NAME("mlp.up_proj.weight"), hid, dim, sh->hid0, sh->n_hid, &lw->w_up,
                      by));
  LF_TRY(wt_load_cols(ck, WT_NAME("mlp.down_proj.weight"), dim, hid, sh->hid0, sh->n_hid,
                      &lw->w_down, by));
#undef WT_NAME
  return LF_OK;
}

/* sh NULL: the whole model (the single-rank plan, which a valid config always has). */
static lf_status wt_load_all(const lf_checkpoint *ck, const lf_shard *sh, lf_weights *w) {
  const lf_model_config *c = &ck->cfg;
  LF_TRY(lf_config_validate(c, NULL));
  lf_shard whole;
  if (!sh) {
    LF_TRY(lf_shard_plan(0, 1, c->n_heads, c->n_kv_heads, c->hidden_dim, c->vocab_size, &whole));
    sh = &whole;
  }
  w->layers = calloc((size_t)c->n_layers, sizeof *w->layers);
  if (!w->layers) return lf_error(LF_ERR_OUT_OF_MEMORY, "out of memory (%d layers)", c->n_layers);
  LF_TRY(wt_load_rows(ck, "model.embed_tokens.weight", c->vocab_size, c->dim, sh->vocab0,
                      sh->n_vocab, &w->embed, &w->bytes));
  for (int l = 0; l < c->n_layers; l++)
    LF_TRY(wt_load_layer(ck, sh, l, &w->layers[l], &w->bytes));
  LF_TRY(wt_load_rows(ck, "model.norm.weight", c->dim, 0, 0, c->dim, &w->rms_final, &w->bytes));
  /* Some tied checkpoints still ship lm_head.weight; when present it is what transformers
   * would have saved as the head, so use it rather than assume it equals the embedding. */
  if (lf_tensor_set_find(&ck->tensors, "lm_head.weight") || !c->tie_embeddings)
    LF_TRY(wt_load_rows(ck, "lm_head.weight", c->vocab_size, c->dim, sh->vocab0, sh->n_vocab,
                        &w->lm_head, &w->bytes));
  else
    w->lm_head = w->embed;
  return LF_OK;
}

lf_status lf_weights_load_f32_shard(const lf_checkpoint *ck, const lf_shard *sh, lf_weights *w) {
  if (!ck || !w) return lf_error(LF_ERR_INVALID_ARG, "lf_weights_load_f32_shard: NULL argument");
  memset(w, 0, sizeof *w);
  if (sh) {
    /* The plan must be one lf_shard_plan made for this model. */
    lf_shard chk;
    LF_TRY(lf_shard_plan(sh->rank, sh->size, ck->cfg.n_heads, ck->cfg.n_kv_heads,
                         ck->cfg.hidden_dim, ck->cfg.vocab_size, &chk));
    if (memcmp(&chk, sh, sizeof chk) != 0)
      return lf_error(LF_ERR_INVALID_ARG, "shard plan of rank %d/%d does not match the model",
                      sh->rank, sh->size);
  }
  lf_status st = wt_load_all(ck, sh, w);
  if (st != LF_OK) lf_weights_free(&ck->cfg, w);
  return st;
}

lf_status lf_weights_load_f32(const lf_checkpoint *ck, lf_weights *w) {
  if (!ck || !w) return lf_error(LF_ERR_INVALID_ARG, "lf_weights_load_f32: NULL argument");
  return lf_weights_load_f32_shard(ck, NULL, w);
}

void lf_weights_free(const lf_model_config *cfg, lf_weights *w) {
  if (!w) return;
  if (w->layers && cfg) {
    for (int l = 0; l < cfg->n_layers; l++) {
      lf_layer_weights *lw = &w->layers[l];
      free(lw->rms_att);
      free(lw->wq);
      free(lw->wk);
      free(lw->wv);
      free(lw->bq);
      free(lw->bk);
      free(lw->bv);
      free(lw->q_norm);
      free(lw->k_norm);
      free(lw->wo);
      free(lw->rms_ffn);
      free(lw->w_gate);
      free(lw->w_up);
      free(lw->w_down);
    }
  }
  free(w->layers);
  if (w->lm_head != w->embed) free(w->lm_head);
  free(w->embed);
  free(w->rms_final);
  memset(w, 0, sizeof *w);
}

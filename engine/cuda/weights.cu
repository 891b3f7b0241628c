/* The cuda backend's weights: this rank's shard of every tensor, converted on the host and
 * uploaded in bf16 (norms and biases fp32), or generated on the device for random checkpoints. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "engine/cuda/cuda_backend.h"
#include "kernels/random_weights.h"
#include "kernels/random_weights.cuh"

/* The tensor must exist with shape [rows][cols] (cols 0: a vector [rows]). */
static lf_status find_tensor(const lf_checkpoint *ck, const char *name, int64_t rows, int64_t cols,
                             const lf_tensor_src **out) {
  const lf_tensor_src *t = lf_tensor_set_find(&ck->tensors, name);
  if (!t) return lf_error(LF_ERR_MISSING_TENSOR, "tensor %s is missing from the checkpoint", name);
  const int ndim = cols > 0 ? 2 : 1;
  if (t->ndim != ndim || t->shape[0] != rows || (ndim == 2 && t->shape[1] != cols))
    return lf_error(LF_ERR_SHAPE, "tensor %s in %s: expected [%lld%s%lld], found a %d-D tensor",
                    name, t->file ? t->file : "the checkpoint", (long long)rows,
                    ndim == 2 ? ", " : "", ndim == 2 ? (long long)cols : 0LL, t->ndim);
  *out = t;
  return LF_OK;
}

/* Rows [row0, row0 + nrows) x columns [col0, col0 + ncols) of matrix `name` [rows][cols] into
 * dst (bf16 [nrows][ncols]), converted on the host in slices of ~4M values. A tensor-parallel
 * rank reads only its slice (mmap); a random checkpoint generates the values the whole matrix
 * holds at the same indices (scale from the whole fan-in), so every T sees one model. */
static lf_status upload_matrix(cuda_backend *c, const char *name, int64_t rows, int64_t cols,
                               int64_t row0, int64_t nrows, int64_t col0, int64_t ncols,
                               bf16 *dst) {
  const lf_checkpoint *ck = c->ck;
  if (row0 < 0 || col0 < 0 || row0 + nrows > rows || col0 + ncols > cols)
    return lf_error(LF_ERR_INTERNAL, "%s: slice [%lld +%lld][%lld +%lld] of [%lld][%lld]", name,
                    (long long)row0, (long long)nrows, (long long)col0, (long long)ncols,
                    (long long)rows, (long long)cols);
  if (ck->random_weights) {
    uint32_t id = 0;
    int kind = 0;
    if (!lf_rw_tensor_of(name, &id, &kind))
      return lf_error(LF_ERR_MISSING_TENSOR, "random checkpoint has no tensor %s", name);
    const float scale = sqrtf(3.0f / (float)cols);
    if (ncols == cols)
      return lf_cuda_random_bf16(dst, (size_t)(nrows * cols), ck->random_seed, id, scale,
                                 (uint64_t)(row0 * cols), c->stream);
    return lf_cuda_random_bf16_slice(dst, nrows, ncols, cols, row0, col0, ck->random_seed, id,
                                     scale, c->stream);
  }
  const lf_tensor_src *t = NULL;
  LF_TRY(find_tensor(ck, name, rows, cols, &t));
  int64_t chunk = ((int64_t)1 << 22) / ncols;
  if (chunk < 1) chunk = 1;
  if (chunk > nrows) chunk = nrows;
  float *f = (float *)malloc((size_t)(chunk * ncols) * sizeof(float)); /* [chunk][ncols] */
  uint16_t *h = (uint16_t *)malloc((size_t)(chunk * ncols) * sizeof(uint16_t));
  lf_status s = LF_OK;
  if (!f || !h) s = lf_error(LF_ERR_OUT_OF_MEMORY, "staging for %s", name);
  for (int64_t r0 = 0; s == LF_OK && r0 < nrows; r0 += chunk) {
    const int64_t nr = nrows - r0 < chunk ? nrows - r0 : chunk;
    s = lf_tensor_read_f32(t, row0 + r0, nr, col0, ncols, f);
    if (s != LF_OK) break;
    for (int64_t i = 0; i < nr * ncols; i++) h[i] = lf_f32_to_bf16(f[i]);
    /* synchronous: the staging buffer is reused at once */
    if (cudaMemcpy(dst + r0 * ncols, h, (size_t)(nr * ncols) * 2, cudaMemcpyHostToDevice) !=
        cudaSuccess)
      s = lf_error(LF_ERR_BACKEND, "%s:%d: upload of %s: %s", __FILE__, __LINE__, name,
                   cudaGetErrorString(cudaGetLastError()));
  }
  free(f);
  free(h);
  return s;
}

/* Elements [i0, i0 + n) of vector `name` [len] into dst (fp32). */
static lf_status upload_vector(cuda_backend *c, const char *name, int64_t len, int64_t i0,
                               int64_t n, float *dst) {
  const lf_checkpoint *ck = c->ck;
  if (i0 < 0 || i0 + n > len)
    return lf_error(LF_ERR_INTERNAL, "%s: slice [%lld +%lld] of [%lld]", name, (long long)i0,
                    (long long)n, (long long)len);
  float *f = (float *)malloc((size_t)n * sizeof(float));
  if (!f) return lf_error(LF_ERR_OUT_OF_MEMORY, "staging for %s", name);
  lf_status s = LF_OK;
  if (ck->random_weights) {
    uint32_t id = 0;
    int kind = 0;
    if (!lf_rw_tensor_of(name, &id, &kind))
      s = lf_error(LF_ERR_MISSING_TENSOR, "random checkpoint has no tensor %s", name);
    for (int64_t i = 0; s == LF_OK && i < n; i++)
      f[i] = lf_rw_value(ck->random_seed, id, kind, 1.0f, (uint64_t)(i0 + i));
  } else {
    const lf_tensor_src *t = NULL;
    s = find_tensor(ck, name, len, 0, &t);
    if (s == LF_OK) s = lf_tensor_read_f32(t, 0, 1, i0, n, f);
  }
  if (s == LF_OK && cudaMemcpy(dst, f, (size_t)n * sizeof(float), cudaMemcpyHostToDevice) !=
                        cudaSuccess)
    s = lf_error(LF_ERR_BACKEND, "%s:%d: upload of %s: %s", __FILE__, __LINE__, name,
                 cudaGetErrorString(cudaGetLastError()));
  free(f);
  return s;
}

/* This rank's shard (the whole model on a single rank): c->sh's query/KV head rows (+ biases),
 * O-projection input columns, intermediate slice of gate/up rows and down columns, and vocab
 * rows of the embedding and LM head; norms whole. */
lf_status cb_load_weights(cuda_backend *c) {
  const lf_model_config *g = &c->gcfg;
  const lf_shard *sh = &c->sh;
  const int64_t dim = g->dim, hid = g->hidden_dim, hd = g->head_dim;
  const int64_t gqd = (int64_t)g->n_heads * hd, gkd = (int64_t)g->n_kv_heads * hd;
  const int64_t qd = c->qd, kd = c->kd, qd_own = c->qd_own, nhid = sh->n_hid;
  const int64_t cq0 = (int64_t)sh->cq0 * hd, kv0 = (int64_t)sh->kv0 * hd,
                q0 = (int64_t)sh->q0 * hd;
  const int64_t V = g->vocab_size, v0 = sh->vocab0, nv = sh->n_vocab;
  char nm[LF_TENSOR_NAME_MAX];
  static const char *const never[] = {"self_attn.o_proj.bias", "mlp.gate_proj.bias",
                                      "mlp.up_proj.bias", "mlp.down_proj.bias"};
  CB_ALLOC(c->embed, (size_t)nv * dim * 2);
  LF_TRY(upload_matrix(c, "model.embed_tokens.weight", V, dim, v0, nv, 0, dim, c->embed));
  CB_ALLOC(c->rms_final, (size_t)dim * 4);
  LF_TRY(upload_vector(c, "model.norm.weight", dim, 0, dim, c->rms_final));
  if (c->ck->random_weights || lf_tensor_set_find(&c->ck->tensors, "lm_head.weight") ||
      !g->tie_embeddings) {
    CB_ALLOC(c->lm_head, (size_t)nv * dim * 2);
    LF_TRY(upload_matrix(c, "lm_head.weight", V, dim, v0, nv, 0, dim, c->lm_head));
  } else {
    c->lm_head = c->embed; /* tied: the same vocab rows */
  }
  for (int l = 0; l < g->n_layers; l++) {
    cuda_layer *L = &c->layers[l];
#define NM(suffix) (snprintf(nm, sizeof nm, "model.layers.%d.%s", l, suffix), nm)
    for (size_t i = 0; i < sizeof never / sizeof never[0]; i++)
      if (lf_tensor_set_find(&c->ck->tensors, NM(never[i])))
        return lf_error(LF_ERR_UNSUPPORTED, "tensor %s: this bias is not supported", nm);
    CB_ALLOC(L->wqkv, (size_t)(qd + 2 * kd) * dim * 2);
    LF_TRY(upload_matrix(c, NM("self_attn.q_proj.weight"), gqd, dim, cq0, qd, 0, dim, L->wqkv));
    LF_TRY(upload_matrix(c, NM("self_attn.k_proj.weight"), gkd, dim, kv0, kd, 0, dim,
                         L->wqkv + qd * dim));
    LF_TRY(upload_matrix(c, NM("self_attn.v_proj.weight"), gkd, dim, kv0, kd, 0, dim,
                         L->wqkv + (qd + kd) * dim));
    if (g->qkv_bias) {
      CB_ALLOC(L->bqkv, (size_t)(qd + 2 * kd) * 4);
      LF_TRY(upload_vector(c, NM("self_attn.q_proj.bias"), gqd, cq0, qd, L->bqkv));
      LF_TRY(upload_vector(c, NM("self_attn.k_proj.bias"), gkd, kv0, kd, L->bqkv + qd));
      LF_TRY(upload_vector(c, NM("self_attn.v_proj.bias"), gkd, kv0, kd, L->bqkv + qd + kd));
    }
    if (g->qk_norm) {
      CB_ALLOC(L->q_norm, (size_t)hd * 4);
      CB_ALLOC(L->k_norm, (size_t)hd * 4);
      LF_TRY(upload_vector(c, NM("self_attn.q_norm.weight"), hd, 0, hd, L->q_norm));
      LF_TRY(upload_vector(c, NM("self_attn.k_norm.weight"), hd, 0, hd, L->k_norm));
    }
    CB_ALLOC(L->wo, (size_t)dim * qd_own * 2);
    LF_TRY(upload_matrix(c, NM("self_attn.o_proj.weight"), dim, gqd, 0, dim, q0, qd_own, L->wo));
    CB_ALLOC(L->rms_att, (size_t)dim * 4);
    CB_ALLOC(L->rms_ffn, (size_t)dim * 4);
    LF_TRY(upload_vector(c, NM("input_layernorm.weight"), dim, 0, dim, L->rms_att));
    LF_TRY(upload_vector(c, NM("post_attention_layernorm.weight"), dim, 0, dim, L->rms_ffn));
    CB_ALLOC(L->wgu, (size_t)2 * nhid * dim * 2);
    LF_TRY(upload_matrix(c, NM("mlp.gate_proj.weight"), hid, dim, sh->hid0, nhid, 0, dim, L->wgu));
    LF_TRY(upload_matrix(c, NM("mlp.up_proj.weight"), hid, dim, sh->hid0, nhid, 0, dim,
                         L->wgu + nhid * dim));
    CB_ALLOC(L->wdown, (size_t)dim * nhid * 2);
    LF_TRY(upload_matrix(c, NM("mlp.down_proj.weight"), dim, hid, 0, dim, sh->hid0, nhid,
                         L->wdown));
#undef NM
  }
  return LF_OK; /* create() synchronises the device before any kernel reads these */
}

void cb_weights_free(cuda_backend *c) {
  if (c->layers) {
    for (int l = 0; l < c->cfg.n_layers; l++) {
      cuda_layer *L = &c->layers[l];
      cudaFree(L->wqkv);
      cudaFree(L->wo);
      cudaFree(L->wgu);
      cudaFree(L->wdown);
      cudaFree(L->rms_att);
      cudaFree(L->rms_ffn);
      cudaFree(L->bqkv);
      cudaFree(L->q_norm);
      cudaFree(L->k_norm);
    }
  }
  if (c->lm_head != c->embed) cudaFree(c->lm_head);
  cudaFree(c->embed);
  cudaFree(c->rms_final);
}

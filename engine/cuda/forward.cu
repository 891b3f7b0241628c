/* The cuda backend's forward (lf_backend.forward): prefill chunks one sequence at a time, the
 * decode items in one batched pass, then the LM head and token selection on the device (see
 * cuda_backend.h for the order of the kernels). */
#include <string.h>

#include "attention/decode_attn.cuh"
#include "attention/decode_attn_generic.cuh"
#include "attention/evict.cuh"
#include "attention/kv_write.cuh"
#include "attention/prefill_attn.cuh"
#include "attention/rkv_select.cuh"
#include "base/cuda_launch.cuh"
#include "base/kvrot.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/sample.h"
#include "kernels/embed.cuh"
#include "kernels/gemv.cuh"
#include "kernels/rmsnorm.cuh"
#include "kernels/silu_mul.cuh"

/* x[t] = embedding of tokens[t] (device ids), over the ranks' vocab slices under TP; then
 * xb = RMSNorm(x) * w (the first layer's attention norm). */
static lf_status embed_rows(cuda_backend *c, const int32_t *tokens, int rows, const float *w) {
  const lf_model_config *m = &c->cfg;
  if (!c->comm) {
    LF_TRY(lf_cuda_embed(c->embed, m->dim, tokens, rows, c->x, c->stream));
  } else {
    float beta;
    float *dst = cb_res_out(c, rows, AR_SLOT_EMBED, &beta);
    LF_TRY(lf_cuda_embed_slice(c->embed, m->dim, c->sh.vocab0, c->nv, tokens, rows, dst,
                               c->stream));
  }
  return cb_res_norm(c, rows, AR_SLOT_EMBED, w, c->xb, NULL);
}

/* ---- the layers ---------------------------------------------------------------------------- */

/* Everything after attention of one layer: O-proj (+= x), RMSNorm, gate|up, SiLU*up, down (+= x),
 * then (next_w non-NULL) the next norm: out[out_rows[r] or r] = RMSNorm(x[r]) * next_w. */
static lf_status layer_tail(cuda_backend *c, const cuda_layer *L, int rows, const float *next_w,
                            void *out, const int32_t *out_rows) {
  const lf_model_config *m = &c->cfg;
  const bf16 *att = c->att;
  if (c->qd_own != c->qd) { /* replicated KV head: this rank's heads of the group only */
    const size_t off = (size_t)(c->sh.q0 - c->sh.cq0) * m->head_dim;
    LF_CUDA_CHECK(cudaMemcpy2DAsync(c->qb, (size_t)c->qd_own * 2, c->att + off, (size_t)c->qd * 2,
                                    (size_t)c->qd_own * 2, (size_t)rows, cudaMemcpyDeviceToDevice,
                                    c->stream));
    att = c->qb;
  }
  float beta;
  float *dst = cb_res_out(c, rows, AR_SLOT_O, &beta);
  if (!CB_SKIP(c, SKIP_O)) LF_TRY(cb_gemm_res(c, L->wo, att, dst, m->dim, c->qd_own, rows, beta));
  if (!CB_SKIP(c, SKIP_RES)) LF_TRY(cb_res_norm(c, rows, AR_SLOT_O, L->rms_ffn, c->xb, NULL));
  if (CB_SKIP(c, SKIP_GU)) {
    /* benchmark instrument only: hb keeps whatever it held */
  } else if (rows <= cb_gemv_lim(c) &&
             lf_cuda_gemv_ok(L->wgu, c->xb, m->dim, (size_t)m->dim, rows)) {
    /* SiLU(gate) * up in the GEMV's epilogue: no fp32 gate|up round trip */
    LF_TRY(lf_cuda_gemv(L->wgu, c->xb, (size_t)m->dim, m->dim, m->hidden_dim, rows, c->hb,
                        (size_t)m->hidden_dim, LF_GEMV_GLU, 0.0f, c->stream));
  } else {
    LF_TRY(cb_gemm(c, L->wgu, c->xb, c->gu, CUDA_R_32F, 2 * m->hidden_dim, m->dim, rows, 0.0f));
    LF_TRY(lf_cuda_silu_mul(c->gu, m->hidden_dim, rows, c->hb, c->stream));
  }
  dst = cb_res_out(c, rows, AR_SLOT_DOWN, &beta);
  if (!CB_SKIP(c, SKIP_DOWN))
    LF_TRY(cb_gemm_res(c, L->wdown, c->hb, dst, m->dim, m->hidden_dim, rows, beta));
  /* the last layer's norm feeds the LM head: kept */
  if (CB_SKIP(c, SKIP_RES) && out != (void *)c->xf) return LF_OK;
  return cb_res_norm(c, rows, AR_SLOT_DOWN, next_w, out, out_rows);
}

static lf_qkv_rope_args rope_args(cuda_backend *c, const cuda_layer *L, int l, int rows) {
  const lf_model_config *m = &c->cfg;
  lf_qkv_rope_args a;
  memset(&a, 0, sizeof a);
  a.qkv = c->qkv;
  a.qkv_stride = (size_t)c->qkv_dim;
  a.bias = L->bqkv;
  a.q_norm = L->q_norm;
  a.k_norm = L->k_norm;
  a.eps = m->norm_eps;
  a.inv_freq = c->inv_freq;
  a.interleaved = m->rope_style == LF_ROPE_INTERLEAVED;
  a.n_heads = m->n_heads;
  a.n_kv_heads = m->n_kv_heads;
  a.head_dim = m->head_dim;
  a.n_tok = rows;
  a.q_out = c->qb;
  a.rot = lf_kv_rotates(c->p.kv_dtype);
  a.k_mean = c->kmu ? c->kmu + (size_t)l * c->kd : NULL;
  return a;
}

/* RoPE of the decode rows (row offset Tp of the pass): their k/v go straight into the pool slot
 * the kernel picks (written to c->w for the attention). On stream st. */
static lf_status decode_rope(cuda_backend *c, const cuda_layer *L, int l, int Tp, int nd,
                             cudaStream_t st) {
  lf_qkv_rope_args a = rope_args(c, L, l, nd);
  a.qkv = c->qkv + (size_t)Tp * c->qkv_dim;
  a.q_out = c->qb + (size_t)Tp * c->qd;
  a.pos = c->d_step.pos;
  a.pool = c->lv[l];
  a.pool_ids = c->d_step.pool;
  a.layer = 0; /* lv[l]: layer l as a view of one layer */
  a.sink = c->p.sink;
  a.policy = c->p.policy;
  a.w = c->w;
  return lf_cuda_qkv_rope(&a, st);
}

/* The fused kernel (decode_attn.cu) on the decode rows. */
static lf_status decode_attention_fused(cuda_backend *c, int l, const bf16 *q, bf16 *out, int nd,
                                        cudaStream_t st) {
  lf_decode_attn_args d;
  memset(&d, 0, sizeof d);
  d.pool = c->lv[l];
  d.layer = 0;
  d.n_seq = nd;
  d.pool_ids = c->d_step.pool;
  d.w = c->w;
  d.q = q;
  d.q_stride = 0;
  d.out = out;
  d.group = c->group;
  d.sink = c->p.sink;
  d.policy = c->p.policy;
  d.recent = c->lrecent[l];
  d.scale = c->ap.scale;
  d.n_splits = 0; /* lf_cuda_decode_attn_splits */
  d.workspace = c->attn_ws;
  d.workspace_bytes = c->attn_ws_bytes;
  d.scores = c->scores;
  return lf_cuda_decode_attn(&d, st);
}

/* rkv: the selection of every eviction scope whose step count the kernel just brought to the
 * stage (or whose pool just filled); the others' blocks return at once (attention/rkv_select.cuh). */
static lf_status rkv_due(cuda_backend *c, int l, int nd, cudaStream_t st) {
  lf_rkv_select_args a;
  memset(&a, 0, sizeof a);
  a.pool = c->lv[l];
  a.layer = 0;
  a.heads_per_scope = c->evict_per;
  a.n_scopes = nd * (c->cfg.n_kv_heads / c->evict_per);
  a.pool_ids = c->d_step.pool;
  a.group = c->group;
  a.sink = c->p.sink;
  a.due_only = 1;
  a.ws = c->rkv_ws;
  a.ws_bytes = c->rkv_ws_bytes;
  a.k_mean = c->kmu ? c->kmu + (size_t)l * c->kd : NULL; /* cosines over the model's keys */
  return lf_cuda_rkv_select(&a, st);
}

/* LongFlow decode attention of the nd decode rows at row offset Tp, on stream st. */
static lf_status decode_attention(cuda_backend *c, int l, int Tp, int nd, cudaStream_t st) {
  const bf16 *q = c->qb + (size_t)Tp * c->qd;
  bf16 *out = c->att + (size_t)Tp * c->qd;
  if (!c->use_fused) {
    LF_TRY(lf_cuda_decode_attn_simple(&c->lv[l], 0, nd, c->d_step.pool, c->w, c->cfg.n_heads, q,
                                      c->ap.scale, c->p.sink, c->p.policy, c->lrecent[l], out,
                                      c->simple_scratch, c->scores, st));
  } else {
    LF_TRY(decode_attention_fused(c, l, q, out, nd, st));
  }
  if (c->p.policy == LF_POLICY_RKV) return rkv_due(c, l, nd, st);
  /* layer scope: one slot per group of KV heads, from the scores the kernel left */
  if (!c->scores) return LF_OK;
  return lf_cuda_layer_argmin(&c->lv[l], 0, nd, c->d_step.pool, c->w, c->p.sink,
                              c->p.policy == LF_POLICY_H2O ? c->lrecent[l] : 0, c->evict_per,
                              c->scores, st);
}

/* The decode rows' part of a layer (RoPE, attention) on stream st. */
static lf_status decode_rows(cuda_backend *c, const cuda_layer *L, int l, int Tp, int nd,
                             cudaStream_t st) {
  if (!CB_SKIP(c, SKIP_ROPE)) LF_TRY(decode_rope(c, L, l, Tp, nd, st));
  /* (CB_SKIP: benchmark instrument only, att keeps whatever it held) */
  if (!CB_SKIP(c, SKIP_ATTN)) LF_TRY(decode_attention(c, l, Tp, nd, st));
  return LF_OK;
}

/* Whether segment s is SnapKV-compressed in a layer of B slots: a prompt into an empty pool that
 * overflows the smallest layer is appended in each layer it fits and compressed to that layer's
 * own budget in the others (the cpu reference decides per layer alike, attention.c). */
static int seg_compresses(const cuda_backend *c, const pass_seg *s, int B) {
  return s->compress && lf_prefill_kind_of(c->p.policy, B, 0, s->T) == LF_PREFILL_COMPRESS;
}

/* One prompt chunk's part of a layer: RoPE into bf16 q, k, v, causal attention over the pool's
 * filled slots and the chunk, then the pool write (append, or SnapKV's selection). */
static lf_status seg_attention(cuda_backend *c, const cuda_layer *L, int l, const pass_seg *s) {
  const lf_model_config *m = &c->cfg;
  const lf_cuda_pool_view *pv = &c->lv[l]; /* layer l, as a view of one layer */
  const int B = pv->budget, compress = seg_compresses(c, s, B);
  lf_qkv_rope_args a = rope_args(c, L, l, s->T);
  a.qkv = c->qkv + (size_t)s->row0 * c->qkv_dim;
  a.q_out = c->qb + (size_t)s->row0 * c->qd;
  a.pos0 = s->pos0;
  a.k_out = c->kb + (size_t)s->row0 * c->kd;
  a.v_out = c->vb + (size_t)s->row0 * c->kd;
  LF_TRY(lf_cuda_qkv_rope(&a, c->stream));
  bf16 *q = (bf16 *)a.q_out, *k = (bf16 *)a.k_out, *v = (bf16 *)a.v_out;
  const int h2o = c->p.policy == LF_POLICY_H2O;
  LF_TRY(lf_cuda_prefill_attn(pv, s->pool, 0, s->n0, m->n_heads, s->T, q, k, v, c->ap.scale,
                              c->att + (size_t)s->row0 * c->qd,
                              compress || h2o ? c->ml : NULL, c->stream));
  /* rkv after a prompt chunk: no selection yet and an empty observation window for the pool's
   * heads of layer l, as the cpu prefill leaves them (attention.h) */
  if (c->p.policy == LF_POLICY_RKV) LF_TRY(cb_rkv_reset(c, s->pool, l));
  if (!compress) {
    /* h2o's column sums read the pool's n0 slots (8-bit: the copy the attention made), which
     * the append leaves alone */
    if (h2o)
      LF_TRY(lf_cuda_h2o_prefill_acc(pv, s->pool, 0, s->n0, m->n_heads, s->T, q, k, c->ml,
                                     c->ap.scale, NULL, c->h2o_cs, c->stream));
    return lf_cuda_kv_store(pv, s->pool, 0, s->T, s->pos0, k, v, NULL, s->n0, s->n0 + s->T,
                            c->stream);
  }
  LF_TRY(lf_cuda_snapkv_select(m->n_heads, m->n_kv_heads, m->head_dim, s->T, B, c->p.sink,
                               lf_snapkv_window(&c->ap, B), c->evict_per, q, k, c->ml,
                               c->ap.scale, c->snap,
                               c->slot_of, c->stream));
  if (h2o)
    LF_TRY(lf_cuda_h2o_prefill_acc(pv, s->pool, 0, 0, m->n_heads, s->T, q, k, c->ml,
                                   c->ap.scale, c->slot_of, c->h2o_cs, c->stream));
  return lf_cuda_kv_store(pv, s->pool, 0, s->T, s->pos0, k, v, c->slot_of, 0, B - 1,
                          c->stream);
}

/* One pass over the weights: the prompt chunks seg[0 .. n_seg) (rows 0 .. Tp - 1) and nd decode
 * rows after them, tokens[Tp + nd] on the device (decode rows: d_step staged). Every GEMM runs
 * once over all the rows; attention per chunk and once for the decode rows. The final normed
 * rows go to xf: a chunk's last row to xf[item] when its prompt ends there, decode row r to
 * xf[d_step.rows[r]] (fused into the last layer's residual step when there is no chunk, which
 * is the decode step the graphs capture). */
static lf_status run_pass(cuda_backend *c, const int32_t *tokens, const pass_seg *seg, int n_seg,
                          int Tp, int nd) {
  const lf_model_config *m = &c->cfg;
  const int R = Tp + nd;
  LF_TRY(embed_rows(c, tokens, R, c->layers[0].rms_att));
  for (int l = 0; l < m->n_layers; l++) {
    const cuda_layer *L = &c->layers[l];
    /* xb = RMSNorm(x) * rms_att: done by the step before (embedding or the last layer_tail) */
    if (!CB_SKIP(c, SKIP_QKV))
      LF_TRY(cb_gemm(c, L->wqkv, c->xb, c->qkv, CUDA_R_32F, c->qkv_dim, m->dim, R, 0.0f));
    /* With prompt chunks too, the decode rows go on the side stream, launched first, beside the
     * chunks' attention; they touch other rows of qb and att, other pools, and their own
     * workspace. The join happens whatever failed, so a wait on c->stream covers both. */
    const int side = n_seg > 0 && nd > 0;
    if (side) {
      LF_CUDA_CHECK(cudaEventRecord(c->fork, c->stream));
      LF_CUDA_CHECK(cudaStreamWaitEvent(c->side, c->fork, 0));
    }
    lf_status st = nd > 0 ? decode_rows(c, L, l, Tp, nd, side ? c->side : c->stream) : LF_OK;
    if (side) LF_CUDA_CHECK(cudaEventRecord(c->join, c->side));
    for (int i = 0; i < n_seg && st == LF_OK; i++) st = seg_attention(c, L, l, &seg[i]);
    if (side) LF_CUDA_CHECK(cudaStreamWaitEvent(c->stream, c->join, 0));
    LF_TRY(st);
    if (l + 1 < m->n_layers)
      LF_TRY(layer_tail(c, L, R, c->layers[l + 1].rms_att, c->xb, NULL));
    else if (n_seg == 0)
      LF_TRY(layer_tail(c, L, R, c->rms_final, c->xf, c->d_step.rows));
    else
      LF_TRY(layer_tail(c, L, R, NULL, c->xb, NULL)); /* x complete; the rows wanted are normed below */
  }
  if (n_seg == 0) return LF_OK;
  for (int i = 0; i < n_seg; i++)
    if (seg[i].last)
      LF_TRY(lf_cuda_rmsnorm(c->x + (size_t)(seg[i].row0 + seg[i].T - 1) * m->dim, m->dim,
                             c->rms_final, m->dim, m->norm_eps, 1,
                             c->xf + (size_t)seg[i].item * m->dim, m->dim, NULL, c->stream));
  if (nd > 0)
    LF_TRY(lf_cuda_rmsnorm(c->x + (size_t)Tp * m->dim, m->dim, c->rms_final, m->dim, m->norm_eps,
                           nd, c->xf, m->dim, c->d_step.rows, c->stream));
  return LF_OK;
}

/* The decode step of `rows` staged items (d_step): the pass the graphs capture (graphs.cu). */
lf_status cb_decode_pass(cuda_backend *c, int rows) {
  return run_pass(c, c->d_step.tok, NULL, 0, 0, rows);
}

/* Uploads the first `rows` entries of the host step arrays. */
static lf_status step_upload(cuda_backend *c, int rows) {
  const size_t b = (size_t)rows * sizeof(int32_t);
  LF_CUDA_CHECK(cudaMemcpyAsync(c->d_step.tok, c->h_step.tok, b, cudaMemcpyHostToDevice, c->stream));
  LF_CUDA_CHECK(cudaMemcpyAsync(c->d_step.pool, c->h_step.pool, b, cudaMemcpyHostToDevice, c->stream));
  LF_CUDA_CHECK(cudaMemcpyAsync(c->d_step.pos, c->h_step.pos, b, cudaMemcpyHostToDevice, c->stream));
  LF_CUDA_CHECK(cudaMemcpyAsync(c->d_step.rows, c->h_step.rows, b, cudaMemcpyHostToDevice, c->stream));
  return LF_OK;
}

/* A chunk's logits at every position, from its rows of x after the last layer: the final norm,
 * the LM head, then to the host at out + tok_off * vocab (pageable: the copy has finished when
 * it returns, so the scratch is free again). Single rank (the engine refuses prompt logprobs
 * under tensor parallelism). */
static lf_status seg_logits(cuda_backend *c, const pass_seg *s, float *out) {
  const lf_model_config *m = &c->cfg;
  const int V = m->vocab_size;
  if (c->comm) return lf_error(LF_ERR_UNSUPPORTED, "cuda: prompt logits under tensor parallelism");
  if (!c->pl_x) {
    LF_CUDA_CHECK(cudaMalloc((void **)&c->pl_x, (size_t)c->max_chunk * m->dim * sizeof(bf16)));
    if (cudaMalloc((void **)&c->pl_logits, (size_t)c->max_chunk * V * sizeof(float)) !=
        cudaSuccess) {
      cudaFree(c->pl_x);
      c->pl_x = NULL;
      (void)cudaGetLastError();
      return lf_error(LF_ERR_OUT_OF_MEMORY, "cuda: prompt logits for %d positions", c->max_chunk);
    }
  }
  LF_TRY(lf_cuda_rmsnorm(c->x + (size_t)s->row0 * m->dim, m->dim, c->rms_final, m->dim,
                         m->norm_eps, s->T, c->pl_x, m->dim, NULL, c->stream));
  LF_TRY(cb_gemm(c, c->lm_head, c->pl_x, c->pl_logits, CUDA_R_32F, c->nv, m->dim, s->T, 0.0f));
  LF_CUDA_CHECK(cudaMemcpyAsync(out + (size_t)s->tok_off * V, c->pl_logits,
                                (size_t)s->T * V * sizeof(float), cudaMemcpyDeviceToHost,
                                c->stream));
  return LF_OK;
}

/* A pass with prompt chunks: their tokens (and the decode items' after them) through the pinned
 * staging buffer, eager (no graph), the GEMV only up to a short prompt's rows (cb_gemv_lim), no
 * GEMM timing for its row counts (gemm.cu). The caller has waited for any earlier use of
 * h_ptok. Afterwards the host mirror of each chunk's pool holds its new fill count. */
static lf_status mixed_pass(cuda_backend *c, const lf_batch_item *items, const pass_seg *seg,
                            int n_seg, int nd) {
  int Tp = 0;
  for (int i = 0; i < n_seg; i++) {
    memcpy(c->h_ptok + Tp, items[seg[i].item].tokens + seg[i].tok_off,
           (size_t)seg[i].T * sizeof(int32_t));
    Tp += seg[i].T;
  }
  memcpy(c->h_ptok + Tp, c->h_step.tok, (size_t)nd * sizeof(int32_t));
  LF_CUDA_CHECK(cudaMemcpyAsync(c->ptok, c->h_ptok, (size_t)(Tp + nd) * sizeof(int32_t),
                                cudaMemcpyHostToDevice, c->stream));
  if (nd > 0) LF_TRY(step_upload(c, nd));
  c->in_prefill = 1;
  const int pdl_saved = lf_pdl_pass_off;
  lf_pdl_pass_off = Tp + nd > c->pdl_max_rows;
  lf_status st = run_pass(c, c->ptok, seg, n_seg, Tp, nd);
  lf_pdl_pass_off = pdl_saved;
  /* prompt logits wanted (prompt_logprobs): the chunks' rows are still in x */
  for (int i = 0; i < n_seg && st == LF_OK; i++)
    if (items[seg[i].item].logits_all) st = seg_logits(c, &seg[i], items[seg[i].item].logits_all);
  c->in_prefill = 0;
  LF_TRY(st);
  for (int i = 0; i < n_seg; i++)
    for (int l = 0; l < c->cfg.n_layers; l++)
      *cb_host_n(c, seg[i].pool, l) =
          seg_compresses(c, &seg[i], c->lbud[l]) ? c->lbud[l] - 1 : seg[i].n0 + seg[i].T;
  return LF_OK;
}

/* The host's mirror of a decode write into `pool`: the fill count grows until the pool is
 * full, then every (layer, KV head) overwrites a slot. Returns those evictions, over the
 * model's KV heads (gcfg): under tensor parallelism every rank holds a part of them, and each
 * head evicts alike, so this is the model's total with each head counted once. */
static uint64_t note_decode_write(cuda_backend *c, int pool) {
  uint64_t ev = 0;
  for (int l = 0; l < c->cfg.n_layers; l++)
    ev += lf_evict_count_write(cb_host_n(c, pool, l), c->lbud[l], 1, c->gcfg.n_kv_heads);
  return ev;
}

/* One decode step of one sequence (a prompt chunk run token by token); xf[row] when last. */
static lf_status decode_one(cuda_backend *c, int pool, int32_t pos, int32_t tok, int row,
                            uint64_t *evictions) {
  c->h_step.tok[0] = tok;
  c->h_step.pool[0] = pool;
  c->h_step.pos[0] = pos;
  c->h_step.rows[0] = row;
  LF_TRY(step_upload(c, 1));
  /* the host arrays are reused at once: wait for the copies (pageable memory is staged, but
   * the step arrays are pinned) */
  LF_TRY(cb_stream_wait(c));
  LF_TRY(cb_decode_run(c, 1));
  *evictions += note_decode_write(c, pool);
  return LF_OK;
}

/* ---- the forward ---------------------------------------------------------------------------- */

/* After the LM head (and the tensor-parallel gather): the raw rows items ask for go to the host
 * (logits_last), then the items' logit processing runs on the device rows, before sampling. */
static lf_status cb_logits_last_and_adjust(cuda_backend *c, const lf_batch_item *items,
                                           const lf_batch_result *res, int n) {
  const int V = c->cfg.vocab_size;
  size_t na = 0;
  int want_rows = 0;
  for (int i = 0; i < n; i++) {
    if (res[i].status != LF_OK) continue;
    na += (size_t)items[i].n_adj;
    want_rows |= items[i].logits_last != NULL || items[i].logits_all != NULL;
  }
  /* a copy to pageable memory must not wait inside CUDA on a collective */
  if (want_rows && c->comm) LF_TRY(cb_stream_wait(c));
  for (int i = 0; i < n; i++) {
    if (res[i].status != LF_OK) continue;
    if (items[i].logits_last)
      LF_CUDA_CHECK(cudaMemcpyAsync(items[i].logits_last, c->logits + (size_t)i * V,
                                    (size_t)V * sizeof(float), cudaMemcpyDeviceToHost,
                                    c->stream));
    if (items[i].logits_all && items[i].n_tok == 1) /* a one-token chunk: its row is this */
      LF_CUDA_CHECK(cudaMemcpyAsync(items[i].logits_all, c->logits + (size_t)i * V,
                                    (size_t)V * sizeof(float), cudaMemcpyDeviceToHost,
                                    c->stream));
  }
  if (na == 0) return LF_OK;
  if (na > c->cap_adj) {
    LF_TRY(cb_stream_wait(c)); /* the old device buffer may still be read */
    cudaFree(c->d_adj);
    free(c->h_adj);
    c->d_adj = NULL;
    c->cap_adj = 0;
    c->h_adj = (lf_cuda_logit_adj *)malloc(na * sizeof *c->h_adj);
    if (!c->h_adj) return lf_error(LF_ERR_OUT_OF_MEMORY, "%zu logit processing entries", na);
    LF_CUDA_CHECK(cudaMalloc((void **)&c->d_adj, na * sizeof *c->d_adj));
    c->cap_adj = na;
  }
  size_t k = 0;
  for (int i = 0; i < n; i++) {
    if (res[i].status != LF_OK) continue;
    for (int j = 0; j < items[i].n_adj; j++) {
      const lf_logit_adj *a = &items[i].adj[j];
      c->h_adj[k++] = (lf_cuda_logit_adj){i, a->token, a->seen, a->bias, a->sub, items[i].rep};
    }
  }
  /* from pageable memory: staged before the call returns, so h_adj is free again */
  LF_CUDA_CHECK(cudaMemcpyAsync(c->d_adj, c->h_adj, na * sizeof *c->h_adj,
                                cudaMemcpyHostToDevice, c->stream));
  return lf_cuda_logits_adjust(c->logits, V, c->d_adj, (int)na, c->stream);
}

lf_status cb_forward(lf_backend *b, const lf_batch_item *items, int n, lf_batch_result *res,
                     float *logits_out) {
  cuda_backend *c = (cuda_backend *)b;
  const lf_model_config *m = &c->cfg;
  /* per-layer budgets: a prompt chunk's kind follows the smallest layer (lmin) */
  const int B = c->bmin, evicts = c->p.policy != LF_POLICY_FULL;
  LF_CUDA_CHECK(cudaSetDevice(c->device));
  if (n < 0 || n > c->max_items)
    return lf_error(LF_ERR_INVALID_ARG, "cuda forward: %d items (at most %d, one per pool)", n,
                    c->max_items);
  if (n == 0) return LF_OK;
  if (!items || !res) return lf_error(LF_ERR_INVALID_ARG, "cuda forward: NULL items or results");

  /* Per-item checks, as the cpu forward makes them; a pool may appear once per batch. */
  for (int i = 0; i < n; i++) {
    const lf_batch_item *it = &items[i];
    lf_batch_result *r = &res[i];
    r->token = -1;
    r->evictions = 0;
    r->status = LF_OK;
    if (it->n_tok < 1 || !it->tokens) {
      r->status = lf_error(LF_ERR_INVALID_ARG, "forward: n_tok %d < 1", it->n_tok);
      continue;
    }
    if (it->pool < 0 || it->pool >= c->p.n_pools || !lf_pool_list_in_use(&c->pools, it->pool)) {
      r->status = lf_error(LF_ERR_INVALID_ARG, "forward: pool %d is not a taken pool", it->pool);
      continue;
    }
    for (int j = 0; j < i && r->status == LF_OK; j++)
      if (items[j].pool == it->pool)
        r->status = lf_error(LF_ERR_INVALID_ARG, "forward: pool %d appears twice in one batch",
                             it->pool);
    for (int t = 0; t < it->n_tok && r->status == LF_OK; t++)
      if (it->tokens[t] < 0 || it->tokens[t] >= m->vocab_size)
        r->status = lf_error(LF_ERR_INVALID_ARG, "token id %d out of range [0, %d)",
                             it->tokens[t], m->vocab_size);
    if (r->status != LF_OK) continue;
    const int n0 = *cb_host_n(c, it->pool, c->lmin);
    if (!evicts && n0 + it->n_tok > B)
      r->status = lf_error(LF_ERR_CONTEXT_FULL,
                           "full policy: %d filled + %d new tokens exceed the budget of %d slots",
                           n0, it->n_tok, B);
    else if (it->n_tok > c->max_chunk &&
             lf_prefill_kind_of(c->p.policy, B, n0, it->n_tok) == LF_PREFILL_COMPRESS)
      r->status = lf_error(LF_ERR_UNSUPPORTED,
                           "cuda: a %d-token prompt needs SnapKV compression over more than the "
                           "%d-token prefill chunk",
                           it->n_tok, c->max_chunk);
  }

  /* Every prompt's kind first: the ones run as decode steps change their pool's fill count. */
  for (int i = 0; i < n; i++)
    c->kinds[i] = res[i].status == LF_OK && items[i].n_tok > 1
                      ? (uint8_t)lf_prefill_kind_of(c->p.policy, B, *cb_host_n(c, items[i].pool, c->lmin),
                                                    items[i].n_tok)
                      : KIND_NONE;
  for (int i = 0; i < n; i++)
    if (c->kinds[i] == LF_PREFILL_DECODE_STEPS && items[i].logits_all) {
      res[i].status = lf_error(LF_ERR_UNSUPPORTED,
                               "cuda: prompt logprobs of a chunk run token by token (a prompt "
                               "overflowing its pool)");
      c->kinds[i] = KIND_NONE;
    }
  /* Prompt chunks that overflow a non-empty pool under eviction: token by token. They use the
   * step arrays and wait for their copies, so they go before the decode items are staged. */
  for (int i = 0; i < n; i++)
    if (c->kinds[i] == LF_PREFILL_DECODE_STEPS)
      for (int t = 0; t < items[i].n_tok; t++)
        LF_TRY(decode_one(c, items[i].pool, items[i].pos0 + t, items[i].tokens[t], i,
                          &res[i].evictions));

  /* Decode items, staged for the first pass. */
  int nd = 0;
  for (int i = 0; i < n; i++) {
    const lf_batch_item *it = &items[i];
    if (res[i].status != LF_OK || it->n_tok != 1) continue;
    c->h_step.tok[nd] = it->tokens[0];
    c->h_step.pool[nd] = it->pool;
    c->h_step.pos[nd] = it->pos0;
    c->h_step.rows[nd] = i;
    nd++;
    res[i].evictions += note_decode_write(c, it->pool);
  }

  /* The other prompts in chunks of at most max_chunk tokens, packed in order into passes of at
   * most max_chunk prompt rows; the decode items ride in the first pass. Without prompts, the
   * decode step alone (its graph). */
  int n_seg = 0, Tp = 0, passes = 0;
  for (int i = 0; i < n; i++) {
    if (c->kinds[i] != LF_PREFILL_APPEND && c->kinds[i] != LF_PREFILL_COMPRESS) continue;
    const lf_batch_item *it = &items[i];
    const int compress = c->kinds[i] == LF_PREFILL_COMPRESS, n0 = *cb_host_n(c, it->pool, c->lmin);
    for (int off = 0; off < it->n_tok; off += c->max_chunk) {
      const int T = it->n_tok - off < c->max_chunk ? it->n_tok - off : c->max_chunk;
      if (Tp + T > c->max_chunk) {
        if (passes > 0) LF_TRY(cb_stream_wait(c)); /* h_ptok is reused */
        LF_TRY(mixed_pass(c, items, c->segs, n_seg, passes == 0 ? nd : 0));
        passes++;
        n_seg = Tp = 0;
      }
      pass_seg *sg = &c->segs[n_seg++];
      sg->item = i, sg->pool = it->pool, sg->T = T, sg->tok_off = off;
      sg->n0 = compress ? 0 : n0 + off, sg->row0 = Tp, sg->compress = compress;
      sg->last = off + T == it->n_tok, sg->pos0 = it->pos0 + off;
      Tp += T;
    }
  }
  if (n_seg > 0) {
    if (passes > 0) LF_TRY(cb_stream_wait(c));
    LF_TRY(mixed_pass(c, items, c->segs, n_seg, passes == 0 ? nd : 0));
  } else if (nd > 0) {
    LF_TRY(step_upload(c, nd));
    LF_TRY(cb_decode_run(c, nd));
  }

  /* LM head and token selection for every item (failed items' rows are ignored). */
  int need_full = c->comm == NULL || logits_out != NULL;
  for (int i = 0; i < n && !need_full; i++)
    need_full = items[i].sampling.temperature > 0.0f || items[i].full_logits;
  LF_TRY(cb_gemm(c, c->lm_head, c->xf, c->llocal, CUDA_R_32F, c->nv, m->dim, n, 0.0f));
  if (!need_full) {
    /* tensor parallel, all greedy: one gather of (max, id) pairs, the pick on the device */
    LF_TRY(cb_tp_greedy(c, n));
  } else {
    for (int i = 0; i < n; i++) {
      lf_sample_params *sp = &c->h_sp[i];
      sp->temperature = items[i].sampling.temperature;
      sp->top_k = items[i].sampling.top_k;
      sp->top_p = items[i].sampling.top_p;
      sp->u = items[i].u;
    }
    LF_CUDA_CHECK(cudaMemcpyAsync(c->d_sp, c->h_sp, (size_t)n * sizeof *c->h_sp,
                                  cudaMemcpyHostToDevice, c->stream));
    /* tensor parallel: the full logits (or every item's top-k candidates) on every rank */
    if (c->comm) LF_TRY(cb_tp_gather_logits(c, items, res, n, logits_out != NULL));
    LF_TRY(cb_logits_last_and_adjust(c, items, res, n));
    LF_TRY(lf_cuda_sample(c->logits, m->vocab_size, n, c->d_sp, c->d_tok_out, c->probs,
                          c->stream));
    for (int i = 0; i < n; i++)
      if (res[i].status == LF_OK && lf_sample_needs_sort(&c->h_sp[i], m->vocab_size))
        LF_TRY(lf_cuda_sample_sorted(c->logits + (size_t)i * m->vocab_size, m->vocab_size,
                                     &c->h_sp[i], c->d_tok_out + i, c->sort_ws, c->sort_ws_bytes,
                                     c->stream));
  }
  /* the stream must have passed the collectives before a copy to pageable memory, which
   * would block in CUDA with no deadline */
  if (c->comm && logits_out) LF_TRY(cb_stream_wait(c));
  LF_CUDA_CHECK(cudaMemcpyAsync(c->h_tok_out, c->d_tok_out, (size_t)n * sizeof(int32_t),
                                cudaMemcpyDeviceToHost, c->stream));
  if (logits_out)
    LF_CUDA_CHECK(cudaMemcpyAsync(logits_out, c->logits, (size_t)n * m->vocab_size * sizeof(float),
                                  cudaMemcpyDeviceToHost, c->stream));
  LF_TRY(cb_stream_wait(c));
  for (int i = 0; i < n; i++)
    if (res[i].status == LF_OK) res[i].token = c->h_tok_out[i];
  return LF_OK;
}

/* The tensor-parallel pieces of the cuda backend (see the essay below). */
#include <string.h>

#include "engine/cuda/cuda_backend.h"
#include "kernels/rmsnorm.cuh"
#include "kernels/tp_select.cuh"
#include "parallel/ar_ipc.h"
#include "engine/tp.h"

/*
 * With a communicator of T > 1 ranks (lf_backend_params.comm, an NCCL one: comm->device), this
 * rank holds the shard of parallel/shard.h: its query heads' Q rows and KV heads' K/V rows (and
 * pools), the O-projection's input columns of its own heads, an intermediate slice of gate/up
 * rows and down columns, and a vocab slice of the embedding and LM head. c->cfg is that local
 * model (heads, hidden size), so every kernel launch is unchanged; what changes:
 *   - embedding: own rows, zeros elsewhere, all-reduce (exact: one nonzero term per element);
 *   - the two residual adds per layer. The O and down GEMMs used to add into the fp32 residual
 *     stream x (beta = 1). Now rank 0 keeps beta = 1 (x_old + its partial) and the other ranks
 *     write their partial with beta = 0, then one in-place fp32 all-reduce of x gives every rank
 *     x_old + sum of partials: the residual add costs no extra kernel and no extra buffer. x is
 *     the same on every rank (NCCL's all-reduce hands every rank the same bits), so rank 0's
 *     x_old is everyone's.
 *     fp32, not bf16: x is fp32 on a single rank too, so TP=T differs from TP=1 only by the
 *     order of the fp32 sums inside O and down (each GEMM sums its own K slice, then the ranks
 *     are added), ~1e-6 relative; bf16 would round the residual stream at every layer and move
 *     greedy tokens. The bytes hardly matter: batch 1 of an 8B model is 16 KB per call, latency
 *     bound either way.
 *     With the IPC path (comm->ipc: on unless LF_CUSTOM_AR=0) the residual adds take the fused
 *     route instead (cb_fused_ar below): every rank writes its partial into a staging buffer, and
 *     one kernel sums the ranks' partials in a fixed pairwise tree, adds x_old and computes the
 *     next RMSNorm, so a layer makes 2 launches where NCCL needs 2 all-reduces and 2 norms. The
 *     sum is x_old + tree(p_0 .. p_T-1), the same bits on every rank, and on the GEMV path the
 *     same bits as one GPU's (cb_gemm_res, gemm.cu).
 *   - replicated KV heads (T > Hkv): attention runs for the whole group (exact eviction, see
 *     shard.h); only the own heads' columns of att are packed (into qb, free by then) for O;
 *   - LM head on the vocab slice; greedy batches: each rank's (max, id) per item, one all-gather
 *     of [n][2] int32, the pick on the device (largest value, lowest rank on ties == lowest id:
 *     exactly the argmax of the full logits); when every sampled item has a top-k, each rank's
 *     k best (value, id) pairs, gathered (cb_tp_gather_logits); otherwise, or when logits are
 *     wanted, one padded all-gather of the slices [n][max_vocab] into the full logits
 *     [n][vocab]; then the single-rank sampling code on them.
 *   - every wait on the stream goes through lf_comm_sync (a dead peer is an error within the
 *     communicator's timeout, not a hang).
 *   - CUDA graphs: NCCL collectives and the IPC kernels can be captured (NCCL >= 2.9), and the
 *     capture happens at the same step on every rank (a batch size's second run). On under TP
 *     too (LF_CUDA_GRAPHS_TP=0 turns them off there): faster at batch 1 (bench/RESULTS.md).
 * Which collectives run depends only on the items (the same on every rank: engine/tp.h) and
 * on logits being wanted, so the ranks' NCCL calls always pair up. */

/* x[rows][dim] summed over the ranks, in place on the stream (nothing waits). */
static lf_status tp_allreduce_x(cuda_backend *c, int rows) {
  if (!c->comm) return LF_OK;
  return c->comm->allreduce_sum(c->comm, c->x, (size_t)rows * c->cfg.dim, LF_COMM_F32, c->stream);
}

/* beta of the GEMMs that add into the residual stream (see above). */
static float res_beta(const cuda_backend *c) {
  return !c->comm || c->comm->rank == 0 ? 1.0f : 0.0f;
}

/* cudaStreamSynchronize, or the communicator's wait with a deadline under TP. */
lf_status cb_stream_wait(cuda_backend *c) {
  if (c->comm) return lf_comm_sync(c->comm, c->stream);
  LF_CUDA_CHECK(cudaStreamSynchronize(c->stream));
  return LF_OK;
}

/* The fused residual all-reduce (parallel/ar_ipc.h) for a pass of `rows` rows: under TP with the
 * IPC path, when the rows fit its staging buffers. The same answer on every rank. Then the O and
 * down projections write their partial sums into a staging slot (beta 0) instead of adding into
 * x, and one kernel sums the ranks' partials into x and norms the result for the next GEMM:
 * per layer two launches instead of two all-reduces and two norms. The slots alternate
 * (AR_SLOT_*, cuda_backend.h), so two calls in a row never share one. */
int cb_fused_ar(const cuda_backend *c, int rows) {
  return c->comm && c->comm->ipc && lf_ar_ipc_norm_fits(c->comm->ipc, rows, c->cfg.dim);
}

/* Where a GEMM whose result adds into the residual stream writes, and with which beta. */
float *cb_res_out(cuda_backend *c, int rows, int slot, float *beta) {
  if (cb_fused_ar(c, rows)) {
    *beta = 0.0f;
    return lf_ar_ipc_stage(c->comm->ipc, slot);
  }
  *beta = res_beta(c);
  return c->x;
}

/* After res_out's GEMM: x complete on every rank, then (w non-NULL) out[out_rows[r] or r] =
 * RMSNorm(x[r]) * w. */
lf_status cb_res_norm(cuda_backend *c, int rows, int slot, const float *w, void *out,
                      const int32_t *out_rows) {
  const lf_model_config *m = &c->cfg;
  if (cb_fused_ar(c, rows))
    return lf_ar_ipc_residual_norm(c->comm->ipc, slot, c->x, slot != AR_SLOT_EMBED, rows, m->dim,
                                   w, m->norm_eps, out, (size_t)m->dim, out_rows, c->stream);
  LF_TRY(tp_allreduce_x(c, rows));
  if (!w) return LF_OK;
  return lf_cuda_rmsnorm(c->x, m->dim, w, m->dim, m->norm_eps, rows, out, m->dim, out_rows,
                         c->stream);
}

/* Under TP, sampled batches: the largest top-k when every item is greedy (k 1) or samples with
 * 1 <= top_k <= LF_TP_TOPK_MAX, so each rank sends its k best pairs instead of its whole slice
 * (engine/tp.h lf_tp_topk_logits does the same on CPU ranks); 0: gather the slices. Depends
 * only on the items, the same on every rank. */
static int tp_topk_kmax(const cuda_backend *c, const lf_batch_item *items,
                        const lf_batch_result *res, int n, int logits_wanted) {
  if (logits_wanted) return 0;
  const int V = c->cfg.vocab_size;
  int kmax = 1;
  for (int i = 0; i < n; i++)
    if (res[i].status == LF_OK && items[i].full_logits) return 0; /* processed or logprobs */
  for (int i = 0; i < n; i++) {
    if (res[i].status != LF_OK || items[i].sampling.temperature <= 0.0f) continue;
    const int k = items[i].sampling.top_k;
    if (k < 1 || k > LF_TP_TOPK_MAX || k >= V) return 0;
    if (k > kmax) kmax = k;
  }
  return 2 * kmax <= c->sh.max_vocab ? kmax : 0;
}

lf_status cb_tp_greedy(cuda_backend *c, int n) {
  /* tensor parallel, all greedy: one gather of (max, id) pairs, the pick on the device */
  LF_TRY(lf_cuda_argmax_pairs(c->llocal, c->nv, n, c->sh.vocab0, c->pairs, c->stream));
  LF_TRY(c->comm->allgather(c->comm, c->pairs, c->pairs_all, 2 * (size_t)n, LF_COMM_I32,
                            c->stream));
  LF_TRY(lf_cuda_tp_pick(c->pairs_all, c->comm->size, n, c->d_tok_out, c->stream));
  return LF_OK;
}

lf_status cb_tp_gather_logits(cuda_backend *c, const lf_batch_item *items,
                              const lf_batch_result *res, int n, int logits_wanted) {
  const lf_model_config *m = &c->cfg;
  const int kmax = tp_topk_kmax(c, items, res, n, logits_wanted);
  if (kmax > 0) {
    /* every item greedy or top-k: each rank's k best (value, id) pairs, gathered, spread
     * over -inf logits [n][vocab] (lsend and probs are free until sampling) */
    LF_TRY(lf_cuda_topk_pairs(c->llocal, c->nv, n, c->sh.vocab0, c->d_sp, kmax,
                              (int32_t *)c->lsend, c->stream));
    LF_TRY(c->comm->allgather(c->comm, c->lsend, c->probs, (size_t)n * kmax * 2, LF_COMM_I32,
                              c->stream));
    return lf_cuda_scatter_pairs((const int32_t *)c->probs, c->comm->size, n, kmax,
                                 m->vocab_size, c->logits, c->stream);
  }
  /* the full logits on every rank: the slices padded to max_vocab, gathered into probs
   * [T][n][max_vocab] (free until sampling), unpacked into logits [n][vocab] */
  const int T = c->comm->size, mv = c->sh.max_vocab, V = m->vocab_size;
  LF_CUDA_CHECK(cudaMemcpy2DAsync(c->lsend, (size_t)mv * 4, c->llocal, (size_t)c->nv * 4,
                                  (size_t)c->nv * 4, (size_t)n, cudaMemcpyDeviceToDevice,
                                  c->stream));
  LF_TRY(c->comm->allgather(c->comm, c->lsend, c->probs, (size_t)n * mv, LF_COMM_F32,
                            c->stream));
  for (int r = 0; r < T; r++) {
    const int v0 = lf_shard_split(V, T, r), nvr = lf_shard_split(V, T, r + 1) - v0;
    LF_CUDA_CHECK(cudaMemcpy2DAsync(c->logits + v0, (size_t)V * 4,
                                    c->probs + (size_t)r * n * mv, (size_t)mv * 4,
                                    (size_t)nvr * 4, (size_t)n, cudaMemcpyDeviceToDevice,
                                    c->stream));
  }
  return LF_OK;
}

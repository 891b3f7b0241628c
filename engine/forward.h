/* The forward pass of the CPU backend (fp32): one sequence chunk at a time.
 *
 * embed -> per layer [RMSNorm -> QKV (+bias) (-> q/k RMSNorm) -> RoPE -> attention over the
 * sequence's pool with LongFlow eviction -> O-proj -> residual -> RMSNorm -> gate/up -> SiLU*up
 * -> down -> residual] -> final RMSNorm -> LM head.
 *
 * Tensor parallel (a communicator of T > 1 ranks and a plan, parallel/shard.h): the weights are
 * this rank's slices; the embedding lookup is vocab-parallel (rows this rank owns, zeros
 * elsewhere, all-reduce: exact), attention runs on this rank's KV heads and pools only (eviction
 * is local), and the partial O-proj and down outputs are all-reduced: 2 per layer + 1. The LM
 * head gives this rank's vocabulary slice; the backend gathers (engine/tp.h).
 *
 * Eviction scope (ap.scope): the attention step is lf_attn_decode_layer_ref /
 * lf_attn_prefill_layer_ref, called per KV head for LF_EVICT_HEAD (with one head they are
 * exactly the per-head functions) and once per layer over all KV heads for LF_EVICT_LAYER (one
 * eviction slot per layer, layer-wide SnapKV), or once per group of ap.scope_groups contiguous
 * groups. With more than one rank, layer scope is rank-local: the KV heads this rank holds are
 * the group, so eviction stays communication-free (ap.scope_groups must then be 0 or 1).
 */
#ifndef LF_FORWARD_H
#define LF_FORWARD_H

#include <stdint.h>

#include "attention/attention.h"
#include "memory/pool.h"
#include "model.h"
#include "parallel/comm.h"
#include "parallel/shard.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lf_cpu_forward {
  const lf_model_config *cfg;
  const lf_weights *w;
  lf_kv_arena *arena;
  lf_attn_params ap;
  lf_attn_params *layer_ap; /* [n_layers] per-layer params (per-layer budgets), or NULL: ap */
  lf_shard sh;     /* this rank's slices (the whole model on one rank) */
  lf_comm_t comm;  /* NULL or a single rank: no collectives */
  int n_threads;   /* OpenMP threads for the matmuls (0: OpenMP's default) */
  float *inv_freq; /* [head_dim/2] RoPE frequencies (after llama3 scaling) */
  lf_attn_scratch ws; /* the decode step's scratch, reused by every call */
  lf_kv_head *heads;  /* [n_kv] head views of one eviction scope (a head, or a layer's) */
  float *kmu;         /* [n_layers][n_kv][head_dim] key means as subtracted (rotated like the
                         keys when the dtype rotates), or NULL */
  /* scratch for up to cap_tok tokens, grown on demand */
  int cap_tok;
  float *x;   /* [tok][dim] residual stream */
  float *xb;  /* [tok][dim] normed input / O-proj output */
  float *q;   /* [tok][n_cq*head_dim] queries computed here (all heads on one rank) */
  float *k;   /* [tok][n_kv*head_dim] */
  float *v;   /* [tok][n_kv*head_dim] */
  float *att; /* [tok][n_cq*head_dim] attention output */
  float *hb;  /* [tok][n_hid] gate, then SiLU(gate)*up */
  float *hb2; /* [tok][n_hid] up */
} lf_cpu_forward;

lf_status lf_cpu_forward_init(lf_cpu_forward *f, const lf_model_config *cfg, const lf_weights *w,
                              lf_kv_arena *arena, const lf_attn_params *ap);
/* The same for one tensor-parallel rank: w holds the slices of plan sh (lf_weights_load_f32_shard)
 * and arena this rank's KV heads (sh->n_kv). sh / comm NULL: a single rank. */
lf_status lf_cpu_forward_init_tp(lf_cpu_forward *f, const lf_model_config *cfg,
                                 const lf_weights *w, lf_kv_arena *arena, const lf_attn_params *ap,
                                 const lf_shard *sh, lf_comm_t comm);
void lf_cpu_forward_free(lf_cpu_forward *f);
/* A key mean per (layer, KV head) taken from every key after RoPE (and after the rotation of a
 * rotating dtype), before attention reads it or the pool stores it (lf_engine_config.key_means):
 * all is [n_layers][cfg's n_kv_heads][head_dim] in the model's frame, or NULL for none. The
 * forward keeps its own KV heads' rows, rotated as keys are when the arena's dtype rotates. */
lf_status lf_cpu_forward_set_key_means(lf_cpu_forward *f, const float *all);
/* LF_OK when all holds n finite values, [n_layers][n_kv_heads][head_dim] of mc (the whole
 * model); else LF_ERR_INVALID_ARG naming the shape wanted (lf_engine_config.key_means). */
lf_status lf_key_means_check(const lf_model_config *mc, const float *all, int n);
/* The rows of KV heads [kv0, kv0 + n_kv) of every layer of all ([n_layers][n_kv_all][head_dim])
 * into out ([n_layers][n_kv][head_dim]), each rotated by lf_rot_row as a key is when rotate is
 * set: what the CPU forward subtracts and the CUDA backend uploads, so both take the same bits. */
void lf_key_means_rows(const float *all, int n_layers, int n_kv_all, int head_dim, int kv0,
                       int n_kv, int rotate, float *out);
/* Per-layer attention params (per-layer budgets: each layer's h2o window and rkv observation
 * window, lf_attn_params_for_budget): copies cfg->n_layers of them; NULL goes back to ap. */
lf_status lf_cpu_forward_set_layer_params(lf_cpu_forward *f, const lf_attn_params *per_layer);

/* Runs n_tok tokens at positions pos0.. of the sequence that owns `pool` through the model,
 * writing their K/V into the pool (with the policy's eviction).
 * logits: [vocab] for the last token, or NULL. logits_all: [n_tok][vocab] or NULL. Under tensor
 * parallelism both hold this rank's vocabulary slice only ([n_vocab] per token). Every rank
 * must make the same calls with the same arguments (collectives inside).
 * *evictions (may be NULL) grows by the slots overwritten. */
lf_status lf_cpu_forward_run(lf_cpu_forward *f, int pool, int32_t pos0, int n_tok,
                             const int32_t *tokens, float *logits, float *logits_all,
                             uint64_t *evictions);

/* One decode step of n sequences at once: row t is token tokens[t] at position pos[t] of the
 * sequence that owns pools[t] (pools distinct). logits: [n][vocab] (this rank's slice under
 * tensor parallelism). evictions[t] grows by row t's overwrites; status[t] is row t's own
 * failure (LF_ERR_CONTEXT_FULL under full), which leaves the other rows alone; the return value
 * is a failure of the whole call. Each row's logits are bit for bit those of
 * lf_cpu_forward_run on that row alone. */
lf_status lf_cpu_forward_decode(lf_cpu_forward *f, int n, const int *pools, const int32_t *pos,
                                const int32_t *tokens, float *logits, uint64_t *evictions,
                                lf_status *status);

/* Pieces shared with other backends' tests. */
void lf_rmsnorm(float *out, const float *x, const float *w, int n, float eps);
/* y[t][o] = sum_i W[o][i] x[t][i] (+ b[o]); W: [n_out][n_in], x: [n_tok][n_in]. */
void lf_matmul(float *y, const float *x, const float *W, const float *b, int n_tok, int n_in,
               int n_out);
/* Fills inv_freq[head_dim/2] (with llama3 scaling if configured). */
void lf_rope_freqs(const lf_model_config *cfg, float *inv_freq);
/* Rotates n_heads heads of x [n_heads][head_dim] in place for position pos. */
void lf_rope_apply(float *x, int n_heads, int head_dim, int32_t pos, const float *inv_freq,
                   lf_rope_style style);

#ifdef __cplusplus
}
#endif
#endif

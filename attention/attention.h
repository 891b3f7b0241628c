/* CPU reference of decode attention fused with LongFlow scoring and eviction, prefill attention
 * with SnapKV compression, and the other eviction policies (docs/DESIGN.md §3, normative).
 *
 * fp32 inputs and outputs; logits, an exact softmax and the scores in fp64 (attention.c).
 * These functions are the oracle for every backend's kernels.
 *
 * Eviction scope: the per-head functions decide one eviction slot per (layer, KV head)
 * (LF_EVICT_HEAD, docs/DESIGN.md §3). The *_layer_ref functions take all KV heads of one layer and decide
 * one slot for the whole layer (LF_EVICT_LAYER, as the released LongFlow code does): the slot
 * with the least score summed over the layer's KV heads, which every head then overwrites.
 */
#ifndef LF_ATTENTION_H
#define LF_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#include "lfserve.h"
#include "memory/pool.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lf_attn_params {
  lf_policy policy;
  int sink;       /* slots 0..sink-1 are never evicted */
  int window;     /* prefill: last W prompt tokens always kept (SnapKV observation window) */
  int h2o_recent; /* h2o: the most recent slots (by position) that are never evicted */
  int group;      /* query heads per KV head */
  int head_dim;
  float scale;    /* 1/sqrt(head_dim) */
  lf_evict_scope scope; /* which heads share an eviction decision; the per-head functions
                           below ignore it, the forward picks per-head or *_layer_ref calls */
  int scope_groups;     /* layer scope: the layer's KV heads held here, split into this many
                           contiguous groups of one eviction slot each (0 or 1: one group).
                           The forward reads it; the functions below see one group's heads */
  int rkv_stage;        /* rkv: slots chosen per selection, one selection every rkv_stage steps */
  int rkv_obs;          /* rkv: its observation window (lf_rkv_obs_of: 0 is LF_RKV_OBS) */
  int prefill_budget;   /* per-layer budgets: the pool's smallest layer budget (0: this pool's
                           own). A chunk into a non-empty pool that overflows it runs as decode
                           steps in every layer, as the cuda backend decides once per pool */
} lf_attn_params;

/* rkv's fixed parameters, R-KV's published values (Cai et al. 2025, "R-KV: Redundancy-aware KV
 * Cache Compression for Reasoning Models"): the importance is the attention of the last
 * LF_RKV_OBS queries (which are never evicted themselves), max-pooled over LF_RKV_POOL_KERNEL
 * neighbours in position order; two keys are look-alikes above a cosine of
 * LF_RKV_SIM_THRESHOLD; score = LF_RKV_LAMBDA * importance - (1 - LF_RKV_LAMBDA) * redundancy.
 * The window is a parameter (lf_attn_params.rkv_obs; the engine's default is budget / 2,
 * lf_engine_config.rkv_obs); LF_RKV_OBS is the published one, taken where rkv_obs is 0. */
#define LF_RKV_OBS 8
#define LF_RKV_POOL_KERNEL 7
#define LF_RKV_SIM_THRESHOLD 0.5
#define LF_RKV_LAMBDA 0.1

/* KV heads that share one eviction decision: 1 for LF_EVICT_HEAD; for LF_EVICT_LAYER the n_kv
 * heads held here, or one of `groups` contiguous groups of them when groups > 1. 0 when groups
 * does not divide n_kv. */
static inline int lf_evict_group_heads(lf_evict_scope scope, int groups, int n_kv) {
  if (scope != LF_EVICT_LAYER) return 1;
  if (groups <= 1) return n_kv;
  return n_kv % groups ? 0 : n_kv / groups;
}

/* Reusable scratch for the decode step, so a forward does not allocate per call: zero it
 * ({0}) before first use; the functions grow it as needed; free it with lf_attn_scratch_free. */
typedef struct lf_attn_scratch {
  void *buf;
  size_t bytes;
} lf_attn_scratch;

void lf_attn_scratch_free(lf_attn_scratch *s);

/* h2o's recent window for a requested value (lf_engine_config.h2o_recent): itself when > 0,
 * else budget / 2. Every backend resolves it here. */
int lf_h2o_recent(int requested, int budget);

/* rkv's observation window: requested when > 0; else (the engine's default) budget / 2, as h2o's
 * recent window, lowered where the budget leaves no room for it beside the sinks and a stage
 * (budget >= sink + window + stage + 1), and LF_RKV_OBS when even that leaves none (the check
 * then names the budget as too small). On the trace task a window of budget / 2 had 0.59x H2O's
 * token error on three train-split problems and 0.96x on four held-out ones, R-KV's 8 0.95x
 * and 3.0x (docs/TASK.md §11). */
int lf_rkv_obs_resolve(int requested, int budget, int sink, int stage);

/* rkv's stage: requested when > 0; else (the engine's default) LF_RKV_STAGE_DEFAULT, halved
 * while the budget has no room for it beside the sinks and the smallest window
 * (budget >= sink + lf_rkv_obs_of(obs) + stage + 1, obs as requested) and it is above 1. */
int lf_rkv_stage_resolve(int requested, int budget, int sink, int obs);

/* The params of a layer whose pools hold `budget` slots, from base (policy, sink, stage, ...):
 * h2o_recent and rkv_obs resolved for that budget from the requested values (lf_h2o_recent,
 * lf_rkv_obs_resolve; 0 where the policy has none), prefill_budget = bmin when per-layer budgets
 * differ (else 0). Every backend derives its per-layer params here. */
lf_attn_params lf_attn_params_for_budget(const lf_attn_params *base, int req_recent, int req_obs,
                                         int budget, int bmin);

/* Whether the policy keeps a per-slot accumulator (the pools' acc): h2o and rkv. */
int lf_policy_accumulates(lf_policy p);

/* Checks a policy/budget/sink/window combination; names the problem on failure. */
lf_status lf_attn_params_check(const lf_attn_params *p, int budget);

/* How a prompt chunk of n_tok tokens enters a pool holding n0 of `budget` slots (the cases of
 * lf_attn_prefill_ref below, so every backend splits them alike): appended when it leaves a
 * free slot (the full policy always appends, or is LF_ERR_CONTEXT_FULL); otherwise compressed
 * with SnapKV into an empty pool, or run token by token as decode steps. */
typedef enum lf_prefill_kind {
  LF_PREFILL_APPEND = 0,
  LF_PREFILL_COMPRESS,
  LF_PREFILL_DECODE_STEPS
} lf_prefill_kind;

lf_prefill_kind lf_prefill_kind_of(lf_policy policy, int budget, int n0, int n_tok);

/* The SnapKV observation window W_eff a prefill keeps whole in a pool of `budget` slots: the
 * params' window, shrunk to budget - 1 - sink when the pool cannot hold it; the streaming policy
 * keeps the sinks and the most recent tokens, a window that fills the pool. Never negative. */
int lf_snapkv_window(const lf_attn_params *p, int budget);

/* The slot a new token is written to: n < budget ? n : next. */
int lf_kv_write_slot(const lf_kv_head *h);

/* rkv (LF_POLICY_RKV) replaces steps 3-4 below. Its state per (layer, KV head) is the pool's acc
 * (the observation window's attention mass), queue and since. With k_left the steps left before
 * the next selection (B - n before the first, when the pool fills; then rkv_stage - since, since
 * counting the steps after a selection), a step with k_left < obs (obs = lf_rkv_obs_of(rkv_obs), attention/rkv_step.h) adds this
 * step's mass to acc (acc zeroed first at the step with k_left == obs - 1, or at the first step
 * after a selection when rkv_stage < obs, and at a prefill; the slot just written starts from its
 * own mass). At k_left == 0 the selection runs over the filled slots
 * in position order less the obs newest (the window, kept): importance = acc / (group * obs),
 * max-pooled over LF_RKV_POOL_KERNEL neighbours; redundancy = softmax over these
 * slots of each key's mean cosine similarity (keys / (||k|| + 1e-8), in fp64; a key is the stored
 * row plus the head's k_mean where the forward set one, memory/pool.h) to the others, its
 * most recent look-alike (cosine > LF_RKV_SIM_THRESHOLD) left out of the mean; the rkv_stage
 * candidates (not sinks) with the lowest score summed over the scope's heads, ties to the
 * lower slot, become queue in that order, and next = queue[since] afterwards. */

/* One decode step of one sequence for one (layer, KV head):
 *   1. write k_new/v_new (post-RoPE) at w = (n < B) ? n++ : next  (full policy: n == B is
 *      LF_ERR_CONTEXT_FULL, nothing written);
 *   2. for each of the group's query heads: alpha = softmax(q.k_i * scale) over the n filled
 *      slots, out = sum alpha_i v_i;
 *   3. score s_i = ||v_i||_1 * sum_h alpha_h,i (longflow), or the policy's own score;
 *   4. next = argmin s_i over filled slots except w and slots < sink; lowest index on ties.
 * q: [group][head_dim]; out: [group][head_dim]. *evicted (may be NULL) is set to 1 when a
 * filled slot was overwritten. scores (may be NULL): [budget], receives s_i for filled slots. */
lf_status lf_attn_decode_ref(const lf_attn_params *p, lf_kv_head *h, const float *q,
                             const float *k_new, const float *v_new, int32_t pos_new, float *out,
                             int *evicted, float *scores);
/* The same with caller-owned scratch (ws NULL: allocated for the call, as above). */
lf_status lf_attn_decode_ref_ws(const lf_attn_params *p, lf_kv_head *h, const float *q,
                                const float *k_new, const float *v_new, int32_t pos_new,
                                float *out, int *evicted, float *scores, lf_attn_scratch *ws);

/* Layer scope: one decode step of one sequence for all n_kv KV heads of one layer (heads[g]),
 * which must agree on budget, n and next (they do when only *_layer_ref calls touched them).
 * Steps 1-3 run per head as in lf_attn_decode_ref (each head writes its own k/v at the shared
 * slot w); step 4 picks ONE slot: next = argmin over filled slots (same exclusions: w, slots <
 * sink, h2o's recent window) of S_i = sum_g s_g,i, lowest index on ties, and sets every head's
 * next to it. Layout: q [n_kv][group][head_dim], k_new/v_new [n_kv][head_dim],
 * out [n_kv][group][head_dim]. *evicted (may be NULL) is set to the number of heads that
 * overwrote a filled slot (0 or n_kv). scores (may be NULL): [budget], receives S_i. With n_kv == 1
 * this is exactly lf_attn_decode_ref_ws. */
/* rkv's selection alone (the step that runs when k_left reaches 0), over the n = *heads[0].n
 * filled slots of n_kv heads sharing one decision (1: head scope): fills every head's queue
 * with the rkv_stage slots to overwrite next and sets its since to 0. slot_total, when not NULL,
 * gets [budget] each slot's total score (NaN outside the candidates: the obs newest
 * slots and the empty ones). The CPU twin of lf_cuda_rkv_select. Needs n >= sink + obs
 * + rkv_stage + 1. */
lf_status lf_attn_rkv_select_ref(const lf_attn_params *p, lf_kv_head *heads, int n_kv,
                                 double *slot_total);

lf_status lf_attn_decode_layer_ref(const lf_attn_params *p, lf_kv_head *heads, int n_kv,
                                   const float *q, const float *k_new, const float *v_new,
                                   int32_t pos_new, float *out, int *evicted, float *scores,
                                   lf_attn_scratch *ws);

/* Attention for a chunk of n_tok tokens at positions pos0.. of one sequence, for one KV head,
 * followed by writing the chunk into the pool.
 *   q:   token t, group head j at q[t*q_stride + j*head_dim]      (post-RoPE)
 *   k,v: token t at k[t*kv_stride], v[t*kv_stride]                 (post-RoPE k)
 *   out: token t, group head j at out[t*out_stride + j*head_dim]
 * Each query attends causally to the pool's filled slots and the chunk's tokens up to itself.
 * Pool empty and n_tok <= B-1: all tokens go to slots 0..n_tok-1.
 * Pool empty and n_tok  > B-1 (evicting policies): SnapKV compression keeps the first sink
 * tokens, the last W, and the B-1-sink-W others with the highest score (softmax of the last W
 * queries over their causal keys, summed over the group's heads and the W queries, then a
 * width-5 zero-padded average pool), ties to the lower position; kept tokens fill slots
 * 0..B-2 in position order. Afterwards n <= B-1. The streaming policy instead keeps the
 * first sink tokens and the last B-1-sink (its own rule, applied to the prompt too).
 * Pool not empty and the chunk fits (n + n_tok <= B-1): appended in order.
 * Pool not empty and it does not fit: the full policy returns LF_ERR_CONTEXT_FULL; the others
 * process the chunk token by token as decode steps (step semantics above).
 * *evictions (may be NULL) is increased by the number of filled slots overwritten. */
lf_status lf_attn_prefill_ref(const lf_attn_params *p, lf_kv_head *h, int n_tok, int32_t pos0,
                              const float *q, size_t q_stride, const float *k, const float *v,
                              size_t kv_stride, float *out, size_t out_stride,
                              uint64_t *evictions);

/* Layer scope: lf_attn_prefill_ref for all n_kv KV heads of one layer at once (heads[g]; they
 * must agree on budget and n). Head g's queries of token t start at q[t*q_stride + g*group*
 * head_dim], its k/v at k[t*kv_stride + g*head_dim], its outputs at out[t*out_stride +
 * g*group*head_dim]. SnapKV compression is layer-wide: the kept set is chosen once from the
 * per-head SnapKV scores summed over the layer's KV heads (then pooled and ranked as above), so
 * every head keeps the same positions in the same slots; a chunk that overflows a non-empty pool
 * runs as lf_attn_decode_layer_ref steps. With n_kv == 1 this is exactly lf_attn_prefill_ref. */
lf_status lf_attn_prefill_layer_ref(const lf_attn_params *p, lf_kv_head *heads, int n_kv,
                                    int n_tok, int32_t pos0, const float *q, size_t q_stride,
                                    const float *k, const float *v, size_t kv_stride, float *out,
                                    size_t out_stride, uint64_t *evictions,
                                    lf_attn_scratch *ws);

#ifdef __cplusplus
}
#endif
#endif

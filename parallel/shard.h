/* The tensor-parallel sharding plan (docs/DESIGN.md §4): which heads, rows and columns rank r of T owns.
 *
 * Megatron-style. Rank r owns query heads [r*Hq/T, (r+1)*Hq/T) and, for them:
 *   - Q/K/V projection rows (+ biases) of its heads, and the O-projection's input columns;
 *   - an intermediate slice [r*I/T, (r+1)*I/T) of gate/up rows and down columns;
 *   - a vocabulary slice [r*V/T, (r+1)*V/T) of the LM head and of the embedding (the embedding
 *     lookup is vocab-parallel: a rank copies the rows it owns, zeros elsewhere, then one
 *     all-reduce, which is exact because every element has exactly one nonzero term).
 * The intermediate size and the vocabulary need not divide by T: slices differ by at most one
 * row. Heads must divide: T | Hkv (each rank owns Hkv/T KV heads and their whole query groups),
 * or T > Hkv with T % Hkv == 0 and T | Hq: each KV head is replicated on m = T/Hkv ranks, each
 * owning Hq/T of the group's query heads. Anything else is LF_ERR_INVALID_ARG.
 *
 * Replication and exact eviction: the LongFlow score of a slot sums the attention of *every*
 * query head of the group (docs/DESIGN.md §3). A replica that only knew its own query heads would score
 * differently from its siblings and the copies would diverge. So a replica computes the queries
 * and attention of the whole group (compute_q0 / n_compute_q: its K/V copy, the group's Q rows)
 * and only its own heads' outputs enter its O-projection columns. Eviction stays local and
 * needs no communication, at the price of m-fold redundant attention for that KV head.
 *
 * Pure arithmetic: no communicator, no allocation; the same plan serves CPU and GPU ranks.
 */
#ifndef LF_SHARD_H
#define LF_SHARD_H

#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lf_shard {
  int rank, size;       /* r of T */
  int q0, n_q;          /* query heads owned: their outputs feed this rank's O-proj columns */
  int kv0, n_kv;        /* KV heads held in this rank's pools */
  int cq0, n_cq;        /* query heads computed (Q rows loaded, attention run): the whole
                           groups of [kv0, kv0 + n_kv); equals [q0, q0 + n_q) unless replicated */
  int replicas;         /* ranks holding each KV head (1, or T / Hkv when T > Hkv) */
  int hid0, n_hid;      /* intermediate rows (gate/up) and down columns */
  int vocab0, n_vocab;  /* LM head / embedding rows */
  int max_vocab;        /* the largest vocab slice over ranks (padding of the logits gather) */
} lf_shard;

/* Fills the plan for rank `rank` of `size` over a model of n_heads query heads, n_kv_heads KV
 * heads, hidden_dim intermediate size and vocab_size tokens. LF_ERR_INVALID_ARG naming T, Hq and
 * Hkv when the heads cannot be split. size 1 gives the whole model. */
lf_status lf_shard_plan(int rank, int size, int n_heads, int n_kv_heads, int hidden_dim,
                        int vocab_size, lf_shard *out);

/* Start of rank r's slice of n items over T ranks: r * n / T (slices differ by at most 1). */
static inline int lf_shard_split(int n, int size, int r) {
  return (int)((long long)n * r / size);
}

#ifdef __cplusplus
}
#endif
#endif

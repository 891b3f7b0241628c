/* Tensor parallelism above the forward pass: the vocab-parallel LM head's token choice, and the
 * "rank 0 decides, the others follow" protocol that keeps every rank's backend in step.
 *
 * Nothing here touches MPI or NCCL: only lf_comm. The same code drives CPU and GPU ranks.
 */
#ifndef LF_TP_H
#define LF_TP_H

#include <stdint.h>

#include "engine/backend.h"
#include "parallel/comm.h"
#include "parallel/shard.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Distributed greedy choice: each rank gives, per item, the largest logit of its slice and its
 * (global) id, lowest id on ties within the slice; one all-gather of the n pairs; every rank
 * then takes the largest value, the lowest rank (= lowest id, slices are in id order) on ties.
 * That is exactly lf_argmax over the full logits. tok[n] is set on every rank. */
lf_status lf_tp_argmax(lf_comm_t comm, int n, const float *local_max, const int32_t *local_id,
                       int32_t *tok);

/* Full logits on every rank: local [n][sh->n_vocab] -> full [n][vocab] (one padded all-gather
 * of [n][max_vocab] per rank). */
lf_status lf_tp_gather_logits(lf_comm_t comm, const lf_shard *sh, int vocab, int n,
                              const float *local, float *full);

/* Distributed top-k sampling: the largest-k candidates of every rank's slice instead of the
 * whole logits. Items with 1 <= top_k[i] <= LF_TP_TOPK_MAX: each rank selects the top_k[i]
 * largest logits of its slice (ties: lower id first), one padded all-gather of [n][kmax]
 * (value, id) pairs, and full[i] gets those values at their ids and -inf elsewhere. The global
 * top-k is among the candidates and lf_sample() of a top-k request reads nothing else (-inf
 * has probability 0, and the tokens it keeps and its draw depend only on the k largest), so
 * sampling full[i] gives exactly the token the whole logits give. kmax = the largest top_k[i];
 * each rank sends n * kmax pairs instead of n * max_vocab floats. */
#define LF_TP_TOPK_MAX 1024
lf_status lf_tp_topk_logits(lf_comm_t comm, const lf_shard *sh, int vocab, int n,
                            const int *top_k, const float *local, float *full);

/* ---- rank 0 decides, the others follow ---------------------------------------------------------
 *
 * The scheduler runs on rank 0 only and talks to a backend; lf_backend_tp_lead wraps rank 0's
 * real backend so every call the scheduler makes reaches every rank:
 *   - pool_take / pool_give run on rank 0 at once (the scheduler needs the id now) and are
 *     recorded; the record travels with the next forward's descriptor, and followers replay it
 *     in order before that forward. Pool free lists are deterministic stacks, so a follower's
 *     take must return the id rank 0 got; it checks (LF_ERR_INTERNAL otherwise).
 *   - forward broadcasts one descriptor (pool ops, items with their sampling and u, tokens,
 *     whether logits are wanted), then runs the local backend; the followers run theirs on the
 *     same descriptor, and the collectives inside pair up.
 *   - lf_backend_tp_stop (rank 0, at engine free) broadcasts a stop descriptor.
 * A follower sits in lf_backend_tp_follow: receive, replay, forward, repeat until stop.
 *
 * Descriptor: a fixed LF_TP_INLINE-word message (header + payload when it fits), then the
 * rest of the payload in a second broadcast only when it does not: one broadcast per decode
 * step in the common case.
 *
 * Failures. Per-item failures (LF_ERR_CONTEXT_FULL, a bad token) depend only on the descriptor
 * and the pools' fill, which every rank shares, so they happen on every rank alike and stay
 * per-item. Anything rank-local (out of memory, a communicator error) is backend-wide: the rank
 * returns it (a follower from lf_backend_tp_follow, rank 0 from lf_engine_step), the wrapper
 * refuses further work (LF_ERR_STATE), and the program is expected to exit non-zero; the MPI
 * launcher then ends the job, so ranks blocked in a collective do not wait forever.
 */
#define LF_TP_INLINE 1024

/* Wraps rank 0's backend `inner` (taken over: freed with the wrapper). */
lf_status lf_backend_tp_lead(lf_backend *inner, lf_comm_t comm, lf_backend **out);
/* Rank 0: tells the followers to leave lf_backend_tp_follow. Idempotent. */
lf_status lf_backend_tp_stop(lf_backend *lead);
/* A follower: runs descriptors on `be` until rank 0 stops. LF_OK on stop. */
lf_status lf_backend_tp_follow(lf_backend *be, lf_comm_t comm, int vocab);

#ifdef __cplusplus
}
#endif
#endif

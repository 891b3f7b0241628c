/* Continuous batching (docs/DESIGN.md §5): the request queue, FCFS admission by free pools,
 * building each step's single batch (one decode token per running sequence + chunked prefill under
 * a token budget), finishing and cancelling requests, events, per-request stats and engine metrics.
 *
 * The scheduler decides; the backend computes (engine/backend.h). The invariants and the
 * threading rules are in scheduler/README.md, which is normative.
 */
#ifndef LF_SCHEDULER_H
#define LF_SCHEDULER_H

#include <stdint.h>

#include "engine/backend.h"
#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lf_sched_config {
  int max_batch_tokens; /* prefill tokens per step (and the chunk size); 0: unbounded */
  int max_queue;        /* waiting requests beyond which submit fails; 0: unbounded */
  lf_policy policy;     /* the pools' policy: `full` cannot hold more than `budget` tokens */
  int budget;           /* slots per pool */
  int max_seq_len;      /* the model's context */
  int vocab_size;
  int eos_ids[8];
  int n_eos;
} lf_sched_config;

typedef struct lf_sched lf_sched;

/* Creates a scheduler over a backend whose pools are all free; pools_total is read from it.
 * The backend must outlive the scheduler. */
lf_status lf_sched_init(const lf_sched_config *cfg, lf_backend *be, lf_sched **out);
/* Frees every request still queued or running (their pools go back to the backend). */
void lf_sched_free(lf_sched *s);

/* The calls behind lf_engine_submit / step / busy / cancel / request_stats / metrics, with the
 * same contracts (include/lfserve.h). */
lf_status lf_sched_submit(lf_sched *s, const lf_request *req, uint64_t *id);
lf_status lf_sched_step(lf_sched *s, lf_event *events, int cap, int *n);
int lf_sched_busy(lf_sched *s);
lf_status lf_sched_cancel(lf_sched *s, uint64_t id);
lf_status lf_sched_request_stats(lf_sched *s, uint64_t id, lf_request_stats *out);
lf_status lf_sched_metrics(lf_sched *s, lf_metrics *m);

#ifdef __cplusplus
}
#endif
#endif

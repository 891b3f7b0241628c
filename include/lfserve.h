/* lfserve.h — the one public header of lfserve.
 *
 * lfserve serves long-output LLMs with a fixed-size KV slot pool per sequence. Once a pool is
 * full, every new token overwrites the slot that contributed least to the last attention output
 * (LongFlow eviction). See docs/DESIGN.md.
 *
 * Conventions: every function that can fail returns an lf_status; on failure
 * lf_last_error() returns a message (thread-local) naming what went wrong. Library code never
 * exits or aborts. Handles are opaque; every *_init has a matching *_free.
 */
#ifndef LFSERVE_H
#define LFSERVE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum lf_status {
  LF_OK = 0,
  LF_ERR_INVALID_ARG,      /* a caller-supplied value is out of range or inconsistent */
  LF_ERR_IO,               /* a file could not be opened, read or mapped */
  LF_ERR_FORMAT,           /* a file is malformed: truncated, bad header, bad JSON */
  LF_ERR_UNSUPPORTED,      /* valid but not supported: model type, dtype, rope type */
  LF_ERR_SHAPE,            /* a tensor has the wrong shape or dtype */
  LF_ERR_MISSING_TENSOR,   /* a required tensor is absent from the checkpoint */
  LF_ERR_OUT_OF_MEMORY,    /* host or device allocation failed */
  LF_ERR_CONTEXT_FULL,     /* a sequence outgrew its pool under a policy that never evicts */
  LF_ERR_QUEUE_FULL,       /* the request queue is at its limit; try again later */
  LF_ERR_NOT_FOUND,        /* no such request */
  LF_ERR_BACKEND,          /* CUDA / cuBLAS / NCCL / MPI reported an error */
  LF_ERR_UNAVAILABLE,      /* the requested backend is not built in or has no device */
  LF_ERR_STATE,            /* the call is not valid in the object's current state */
  LF_ERR_INTERNAL,         /* an invariant broke: a bug in lfserve */
  LF_STATUS_COUNT
} lf_status;

/* A static string for a status code. */
const char *lf_status_str(lf_status s);
/* The message of the last failure on this thread ("" if none). */
const char *lf_last_error(void);

typedef enum lf_backend_kind {
  LF_BACKEND_AUTO = 0, /* cuda when built in and a device is present, else cpu */
  LF_BACKEND_CPU,
  LF_BACKEND_CUDA,
} lf_backend_kind;

/* What happens when a pool is full. DESIGN §3. */
typedef enum lf_policy {
  LF_POLICY_LONGFLOW = 0, /* overwrite the slot with least ||alpha*v||_1 (per KV head) */
  LF_POLICY_FULL,         /* never evict; a sequence longer than its pool is an error */
  LF_POLICY_STREAMING,    /* keep the sinks and the most recent tokens */
  LF_POLICY_H2O,          /* heavy hitters: accumulated attention mass, recent window kept */
} lf_policy;

const char *lf_policy_str(lf_policy p);
/* Parses "longflow", "full", "streaming", "h2o". */
lf_status lf_policy_parse(const char *s, lf_policy *out);

typedef struct lf_engine_config {
  const char *model_path; /* HF model dir (config.json + safetensors) or llama2.c .bin */
  lf_backend_kind backend; /* default LF_BACKEND_AUTO */
  lf_policy policy;       /* default LF_POLICY_LONGFLOW */
  int budget;             /* KV slots per pool (B); 0: the model's max context */
  int sink;               /* slots never evicted (positions 0..sink-1); default 4 */
  int window;             /* prefill compression: last W prompt tokens always kept; default 32 */
  int n_pools;            /* number of pools (max concurrent sequences); 0: 1 on cpu */
  int max_batch_tokens;   /* prefill tokens per step (0: unbounded) */
  int max_queue;          /* waiting requests beyond which submit fails (0: unbounded) */
  int n_threads;          /* cpu backend threads (0: all cores when built with OpenMP) */
} lf_engine_config;

/* Fills defaults: backend auto, longflow, budget 0, sink 4, window 32. */
void lf_engine_config_default(lf_engine_config *cfg);

/* Model facts the caller may need (vocabulary size, special tokens). */
typedef struct lf_model_info {
  char model_type[32];
  int vocab_size;
  int n_layers, n_heads, n_kv_heads, head_dim, dim, hidden_dim;
  int max_seq_len;
  int bos_id;           /* -1 when unknown */
  int eos_ids[8];       /* end-of-sequence ids; n_eos of them */
  int n_eos;
} lf_model_info;

typedef struct lf_sampling {
  float temperature; /* 0: greedy (argmax, lowest id on ties) */
  int top_k;         /* 0: off */
  float top_p;       /* 1 (or 0): off */
  uint64_t seed;
} lf_sampling;

typedef struct lf_request {
  const int32_t *prompt; /* token ids, copied at submit */
  int n_prompt;          /* >= 1 */
  int max_tokens;        /* tokens to generate, >= 1 */
  lf_sampling sampling;
  int ignore_eos;        /* 1: do not stop at the model's EOS ids */
  const int32_t *stop_ids; /* extra ids that end generation (copied); may be NULL */
  int n_stop_ids;
} lf_request;

typedef enum lf_event_type {
  LF_EVENT_TOKEN = 0, /* one generated token */
  LF_EVENT_FINISH,    /* the request ended; finish_reason says why */
} lf_event_type;

typedef enum lf_finish_reason {
  LF_FINISH_NONE = 0,
  LF_FINISH_EOS,        /* the model produced an end-of-sequence or stop id */
  LF_FINISH_LENGTH,     /* max_tokens reached */
  LF_FINISH_CANCELLED,  /* lf_engine_cancel */
  LF_FINISH_ERROR,      /* status says what went wrong */
} lf_finish_reason;

const char *lf_finish_reason_str(lf_finish_reason r);

typedef struct lf_event {
  uint64_t id;
  lf_event_type type;
  int32_t token;          /* LF_EVENT_TOKEN */
  lf_finish_reason reason; /* LF_EVENT_FINISH */
  lf_status status;       /* LF_EVENT_FINISH with LF_FINISH_ERROR */
} lf_event;

/* Per-request statistics, valid once its FINISH event has been returned. */
typedef struct lf_request_stats {
  int prompt_tokens;
  int generated_tokens;
  uint64_t evictions;   /* slot overwrites summed over layers and KV heads (this rank) */
  int slots_filled;     /* filled slots of layer 0, KV head 0 at the end */
} lf_request_stats;

typedef struct lf_metrics {
  int running, waiting;
  int pools_used, pools_total;
  uint64_t tokens_generated;
  uint64_t evictions;
  double decode_seconds; /* wall time spent in steps */
} lf_metrics;

typedef struct lf_engine *lf_engine_t;
/* A communicator for tensor parallelism; NULL means a single rank. */
typedef struct lf_comm *lf_comm_t;

lf_status lf_engine_init(const lf_engine_config *cfg, lf_comm_t comm, lf_engine_t *out);
void lf_engine_free(lf_engine_t e);
lf_status lf_engine_model_info(lf_engine_t e, lf_model_info *out);
/* Queues a request; *id identifies it in events. */
lf_status lf_engine_submit(lf_engine_t e, const lf_request *req, uint64_t *id);
/* Runs one iteration (admission, prefill, one decode token per running sequence) and returns
 * up to cap events in events[0..*n). Events that do not fit are kept for the next call. */
lf_status lf_engine_step(lf_engine_t e, lf_event *events, int cap, int *n);
/* Nonzero while any request is running, waiting or has undelivered events. */
int lf_engine_busy(lf_engine_t e);
lf_status lf_engine_cancel(lf_engine_t e, uint64_t id);
lf_status lf_engine_request_stats(lf_engine_t e, uint64_t id, lf_request_stats *out);
lf_status lf_engine_metrics(lf_engine_t e, lf_metrics *m);

#ifdef __cplusplus
}
#endif
#endif /* LFSERVE_H */

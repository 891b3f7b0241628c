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

/* "auto", "cpu", "cuda" ("unknown" for a value outside the enum). */
const char *lf_backend_str(lf_backend_kind b);
/* Parses "auto", "cpu", "cuda"; LF_ERR_INVALID_ARG (lf_last_error names the choices) otherwise,
 * *out unchanged. */
lf_status lf_backend_parse(const char *s, lf_backend_kind *out);

/* What happens when a pool is full. docs/DESIGN.md §3. */
typedef enum lf_policy {
  LF_POLICY_LONGFLOW = 0, /* overwrite the slot with least ||alpha*v||_1 (per KV head) */
  LF_POLICY_FULL,         /* never evict; a sequence longer than its pool is an error */
  LF_POLICY_STREAMING,    /* keep the sinks and the most recent tokens */
  LF_POLICY_H2O,          /* heavy hitters: accumulated attention mass, recent window kept */
  LF_POLICY_RKV,          /* R-KV: every rkv_stage steps, the next rkv_stage slots to overwrite
                             chosen by recent attention and key redundancy (docs/DESIGN.md §3) */
} lf_policy;

const char *lf_policy_str(lf_policy p);
/* Parses "longflow", "full", "streaming", "h2o", "rkv". */
lf_status lf_policy_parse(const char *s, lf_policy *out);

/* Which KV heads share an eviction decision. docs/DESIGN.md §3. */
typedef enum lf_evict_scope {
  LF_EVICT_HEAD = 0, /* one slot per (layer, KV head), chosen from that head's scores (ours) */
  LF_EVICT_LAYER,    /* one slot per layer, shared by all its KV heads: the argmin of the scores
                        summed over the layer's KV heads (the released LongFlow code). A prompt
                        longer than the pool is SnapKV-compressed layer-wide too (the per-head
                        SnapKV scores summed over the layer's KV heads). Under tensor
                        parallelism it is rank-local: one slot per layer among the KV heads a
                        rank holds, so eviction needs no communication. Both backends. */
} lf_evict_scope;

const char *lf_evict_scope_str(lf_evict_scope s);
/* Parses "head", "layer". */
lf_status lf_evict_scope_parse(const char *s, lf_evict_scope *out);

/* How the KV pools store K and V. docs/DESIGN.md §3, "Quantized pools". */
typedef enum lf_kv_dtype {
  LF_KV_BF16 = 0, /* unquantized: bf16 on cuda; the cpu reference keeps fp32 */
  LF_KV_FP8,      /* OCP fp8 e4m3, one fp32 scale per (slot, KV head) for K and one for V:
                     about half of bf16's bytes per slot, so twice the slots in the same memory.
                     Every policy, both backends (the cpu stores the dequantized values, so it
                     computes on exactly what the cuda kernels read), fp8 hardware not needed;
                     keys stored rotated (DESIGN §3) */
  LF_KV_INT8,     /* int8 with the same per-row scales and bytes as fp8; its uniform step keeps
                     keys more exact than e4m3's 3-bit mantissa, which is most of fp8's error
                     (docs/DESIGN.md §3, "Quantized pools"); keys stored rotated */
  LF_KV_INT4,     /* 4-bit codes with a bf16 step and floor per 32 dims (head_dim a multiple
                     of 32): 0.31 of bf16's bytes per slot; keys stored rotated (DESIGN §3) */
  LF_KV_K8V4,     /* keys as LF_KV_INT8, values as LF_KV_INT4 (head_dim a multiple of 32):
                     0.42 of bf16's bytes per slot at head_dim 64: int4 keys carry most of
                     int4's error, int4 values little (docs/DESIGN.md §3). Both backends; keys
                     not rotated */
} lf_kv_dtype;

const char *lf_kv_dtype_str(lf_kv_dtype d);
/* Parses "bf16", "fp8", "int8", "int4", "k8v4"; LF_ERR_INVALID_ARG naming the choices otherwise. */
lf_status lf_kv_dtype_parse(const char *s, lf_kv_dtype *out);

/* lf_engine_config.max_batch_tokens's default: at Poisson arrivals of 2048-token prompts on one
 * H200 it kept the decodes' TPOT p99 within 1.5x of a decode-only step while TTFT stayed within
 * 1.3x of an isolated prefill (bench/RESULTS.md, "Serving under arrivals"). */
#define LF_MAX_BATCH_TOKENS_DEFAULT 512

/* lf_engine_config.rkv_stage's default, halved where a pool has no room for it (rkv_stage):
 * stage 128 had 0.93x and 0.95x stage 64's teacher-forced token error on the 32 held-out task
 * problems at 10% and 20% of the output (level at 30%), and a selection every 128 steps brings
 * rkv's mean decode step from 1.07x LongFlow's to 1.05x (docs/TASK.md §11, bench/RESULTS.md). */
#define LF_RKV_STAGE_DEFAULT 128

typedef struct lf_engine_config {
  const char *model_path; /* HF model dir (config.json + safetensors), GGUF file or llama2.c .bin */
  lf_backend_kind backend; /* default LF_BACKEND_AUTO */
  lf_policy policy;       /* default LF_POLICY_LONGFLOW */
  int budget;             /* KV slots per pool (B); 0: the model's max context */
  int sink;               /* slots never evicted (positions 0..sink-1); default 4 */
  int window;             /* prefill compression: last W prompt tokens always kept; default 32 */
  int n_pools;            /* number of pools (max concurrent sequences). An explicit value wins;
                             0: derived from kv_memory_bytes when set, else by the backend
                             (cuda: mem_util of the device memory left after weights and
                             workspaces; cpu: 1). */
  int max_batch_tokens;   /* prompt (prefill) tokens per step; 0: unbounded; default
                             LF_MAX_BATCH_TOKENS_DEFAULT. A prompt that fits its pool and is
                             longer than this is split into chunks of exactly this many tokens,
                             which share steps (on cuda: passes over the weights) with the
                             running decodes; a prompt that does not fit its pool runs whole and
                             is SnapKV-compressed as a whole (scheduler/README.md). Decode tokens
                             are not counted: every running sequence decodes every step. */
  int max_queue;          /* waiting requests beyond which submit fails with LF_ERR_QUEUE_FULL
                             (0: unbounded) */
  int n_threads;          /* cpu backend threads (0: all cores when built with OpenMP) */
  uint64_t kv_memory_bytes; /* memory the KV pools may use when n_pools is 0: n_pools =
                               floor(kv_memory_bytes * mem_util / bytes of one pool
                               in the backend's own arena: its KV dtype, this rank's KV heads)
                               (docs/DESIGN.md §5); 0: not set */
  double mem_util;        /* fraction of kv_memory_bytes (or of free device memory) the pools
                             may take, in (0, 1]; default 0.9 (0: 0.9) */
  lf_evict_scope evict_scope; /* lf_engine_config_default: LF_EVICT_LAYER, rank-local under
                                 tensor parallelism (a zeroed config: LF_EVICT_HEAD) */
  int evict_groups;       /* LF_EVICT_LAYER on one rank: split each layer's KV heads into this
                             many contiguous groups of one eviction slot each (0 or 1: one
                             group). G = T gives on one rank exactly what T tensor-parallel
                             ranks evict (rank-local layer scope). Must divide the KV heads;
                             with more than one rank it must be 0 */
  const char *lora_path;  /* a PEFT LoRA adapter directory (adapter_config.json +
                             adapter_model.safetensors) merged into the model at load:
                             W + scale * B·A in fp32 for q/k/v/o_proj, gate/up/down_proj, and on
                             models with untied embeddings lm_head and embed_tokens; every
                             backend and tensor-parallel rank runs the merged model. Plain LoRA
                             only: DoRA, LoRA biases, other modules, mismatched shapes or a
                             malformed adapter fail lf_engine_init with a message naming the
                             file. HF directory or GGUF models only. NULL or "": none */
  int h2o_recent;         /* LF_POLICY_H2O: the most recent slots (by position) never evicted;
                             0 (default): budget / 2, the split of the H2O paper, which had
                             about half the token error of a window of 32 on the task model
                             (docs/TASK.md section 10). budget >= sink + h2o_recent + 2 */
  lf_kv_dtype kv_dtype;   /* how the pools store K and V; default LF_KV_BF16. Pool sizing from
                             memory counts this dtype's bytes */
  double host_mem_util;   /* cpu backend, n_pools and kv_memory_bytes 0: > 0 sizes the pools
                             from host memory, n_pools = floor(MemAvailable as it stands after
                             the weights are loaded x host_mem_util / bytes of one pool), in
                             (0, 1]; 0 (default): one pool. LF_MEM_AVAILABLE_BYTES replaces
                             MemAvailable (base/tuning.h) */
  int max_pools;          /* a cap on n_pools sized from memory (kv_memory_bytes, the cuda
                             backend's free memory, host_mem_util); 0: none. An explicit n_pools
                             is never capped */
  int rkv_stage;          /* LF_POLICY_RKV: steps between selections, each of which chooses the
                             next rkv_stage slots to overwrite; 0 (default): LF_RKV_STAGE_DEFAULT,
                             halved until it fits beside the sinks and the smallest window.
                             budget >= sink + rkv_obs + rkv_stage + 1; the CUDA backend takes
                             head_dim up to 128 */
  int rkv_obs;            /* Since 0.3. LF_POLICY_RKV: its observation window: the rkv_obs
                             newest slots are never evicted, and a selection scores the others
                             by the attention mass of the steps inside it (at most the rkv_stage
                             steps since the last selection) over group x rkv_obs. 0 (default):
                             budget / 2, as h2o's recent window, lowered where budget leaves no
                             room beside sink + rkv_stage + 1 (R-KV's published window is 8;
                             on the trace task budget / 2 measured 0.59x H2O's token error on
                             three train-split problems and 0.96x on four held-out ones, where
                             8 had 0.95x and 3.0x: docs/TASK.md §11) */
  const double *layer_weights; /* Since 0.4. Per-layer budgets within the same total: NULL
                             (default) gives every layer `budget` slots. Else n_layer_weights
                             (the model's layer count) positive weights: layer l gets
                             max(16, floor(budget x L x w_l / sum w)) slots, then one more to
                             layers 0, 1, ... in turn until they sum to budget x L; h2o's recent
                             and rkv's observation windows are each layer's own budget / 2, rkv's
                             default stage fits the smallest. A prompt fits its pool when it
                             fits the smallest layer. Not with the full policy. lfgen/lfbench/
                             lfserve: --layer-weights FILE (tools/evict/layer_reads.py --weights
                             writes one; docs/TASK.md §11 says which rule and why). Read by
                             lf_engine_init only */
  int n_layer_weights;
  const float *key_means; /* Since 0.5. A vector per (layer, KV head) taken from every key after
                             RoPE, before the pools store it: n_key_means = n_layers x
                             n_kv_heads x head_dim values (the model's KV heads, all of them
                             under tensor parallelism), layer-major, then KV head, then dim, in
                             the model's own frame (rotating dtypes rotate it as they rotate
                             keys). No attention weight changes: a query's logits all move by
                             q.mu, which the softmax removes. What changes is the range a
                             quantized pool's keys span: a calibrated mean (the keys' average
                             over sample text of the workload) cuts int4 keys' error most
                             (docs/DESIGN.md §3). rkv's redundancy adds the mean back: it
                             compares the model's keys, which select better than centred ones.
                             NULL (default): none. lfgen/lfbench/
                             lfserve: --key-means FILE (tools/evict/key_means.py writes one).
                             Read by lf_engine_init only */
  int n_key_means;
} lf_engine_config;

/* How the engine's pool count was reached (lf_engine_pool_sizing). */
typedef struct lf_pool_sizing {
  int n_pools;
  uint64_t pool_bytes;  /* one pool (K, V and metadata) in the backend's arena */
  uint64_t basis_bytes; /* the memory figure the count came from; 0 when n_pools was given */
  double util;          /* the fraction of basis_bytes the pools could take */
  int capped;           /* 1: max_pools lowered the count */
  const char *basis;    /* "n_pools", "kv_memory_bytes", "MemAvailable" or "free device
                           memory" (static strings) */
} lf_pool_sizing;

/* The settings an engine runs with once lf_engine_init has resolved what lf_engine_config left
 * to it (lf_engine_resolved_config): a program prints and uses these instead of repeating the
 * defaults. Since 0.2; fields are only ever appended (bindings check its size with
 * lf_abi_sizeof("lf_resolved_config")). */
typedef struct lf_resolved_config {
  lf_backend_kind backend;     /* LF_BACKEND_CPU or LF_BACKEND_CUDA, never AUTO */
  lf_policy policy;
  lf_evict_scope evict_scope;
  lf_kv_dtype kv_dtype;
  int budget;                  /* KV slots per pool: the model's context when 0 was given */
  int sink;                    /* as given */
  int window;                  /* as given (a prompt shorter than it keeps every token) */
  int h2o_recent;              /* LF_POLICY_H2O: budget / 2 when 0 was given (the smallest
                                  layer's, per-layer budgets); 0 otherwise */
  int rkv_stage;               /* LF_POLICY_RKV: LF_RKV_STAGE_DEFAULT (halved to fit the
                                  budget) when 0 was given; 0 otherwise */
  int n_pools;                 /* pools this rank holds (lf_engine_pool_sizing says why) */
  int max_batch_tokens;        /* prompt tokens per step (the chunk size); 0: unbounded */
  int max_queue;               /* 0: unbounded */
  int max_seq_len;             /* the model's context: prompt + output never pass it */
  int n_ranks;                 /* tensor-parallel ranks (1: a single rank) */
  int rkv_obs;                 /* Since 0.3. LF_POLICY_RKV: its observation window, the default
                                  resolved; 0 otherwise */
  int budget_min, budget_max;  /* Since 0.4. The smallest and largest layer budget (both budget
                                  without layer_weights); rkv_obs is the smallest layer's */
} lf_resolved_config;

/* Fills defaults: backend auto, longflow, budget 0, sink 4, window 32, mem_util 0.9, scope layer,
 * max_batch_tokens LF_MAX_BATCH_TOKENS_DEFAULT, the rest 0. */
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

/* Most alternatives a token's log-probabilities may list (lf_sampling.top_logprobs). */
#define LF_MAX_TOP_LOGPROBS 20
/* logit_bias values lie in [-LF_LOGIT_BIAS_MAX, LF_LOGIT_BIAS_MAX] (OpenAI's range). */
#define LF_LOGIT_BIAS_MAX 100.0f

/* An additive bias on one token's logit. */
typedef struct lf_logit_bias {
  int32_t token; /* in [0, vocab) */
  float bias;    /* finite, within +-LF_LOGIT_BIAS_MAX */
} lf_logit_bias;

/* How a request picks its tokens. A zeroed struct is greedy with nothing else on. Since 0.2 the
 * struct holds the fields after `seed` (appended, so the first four keep their offsets; the
 * struct and lf_request grew: see lf_abi_sizeof). Every backend applies the same logit
 * processing before the pick, in this order (vLLM's): logit_bias added; repetition_penalty on
 * every token of the prompt or the output so far (a positive logit divided by it, a negative one
 * multiplied: the Hugging Face / vLLM rule; vLLM's choice of tokens); then presence_penalty *
 * [count > 0] + frequency_penalty * count subtracted, count being the token's occurrences in the
 * output so far (OpenAI's rule; teacher forcing: the forced ids). Then temperature, top-k, top-p
 * and the seeded draw. */
typedef struct lf_sampling {
  float temperature; /* 0: greedy (argmax, lowest id on ties) */
  int top_k;         /* 0: off */
  float top_p;       /* 1 (or 0): off */
  uint64_t seed;     /* the request's own random stream: the same seed and request give the same
                        tokens whatever else runs in the batch */
  float presence_penalty;   /* finite; 0: off */
  float frequency_penalty;  /* finite; 0: off */
  float repetition_penalty; /* > 0; 1 (or 0): off */
  int n_logit_bias;
  const lf_logit_bias *logit_bias; /* [n_logit_bias], distinct tokens, copied at submit */
  /* Log-probabilities, always of the model's raw distribution: the log-softmax of its logits,
   * before temperature, penalties, bias or top-k/top-p (OpenAI's choice, vLLM's "raw_logprobs"),
   * computed in double from the backend's fp32 logits. */
  int logprobs;        /* 1: each TOKEN event carries its token's logprob */
  int top_logprobs;    /* 0..LF_MAX_TOP_LOGPROBS: and that many most likely alternatives */
  int prompt_logprobs; /* 1: before its first TOKEN, the request emits one LF_EVENT_PROMPT_TOKEN
                          per prompt position 1..n_prompt-1 (position 0 has no logprob) with the
                          prompt token's logprob given the tokens before it and top_logprobs
                          alternatives. Single-rank engines only (LF_ERR_UNSUPPORTED under
                          tensor parallelism) */
} lf_sampling;

/* A stop sequence: generation ends when the generated tokens end with ids[0..n_ids). */
typedef struct lf_stop_seq {
  const int32_t *ids; /* [n_ids], n_ids >= 1 */
  int n_ids;
} lf_stop_seq;

typedef struct lf_request {
  const int32_t *prompt; /* token ids, copied at submit */
  int n_prompt;          /* >= 1 */
  int max_tokens;        /* tokens to generate, >= 1 (capped so the last sits within context) */
  lf_sampling sampling;
  int ignore_eos;        /* 1: do not stop at the model's EOS ids */
  const int32_t *stop_ids; /* extra single ids that end generation (copied); may be NULL */
  int n_stop_ids;
  /* Stop sequences (copied; may be NULL). A generated token that could begin one of them is
   * held back until the sequence either completes (the request finishes with
   * LF_FINISH_STOP_SEQUENCE and the sequence's tokens are never emitted) or breaks (the held
   * tokens are emitted). Held tokens are also emitted when the request ends for any other
   * reason. Matching looks at generated tokens only, not the prompt. */
  const lf_stop_seq *stop_seqs;
  int n_stop_seqs;
  /* Teacher forcing (evaluation), when n_forced > 0: at generated position i the model is fed
   * forced[i] instead of what it sampled, and the TOKEN event of position i carries the token it
   * sampled there (with temperature 0: its argmax given the forced history). EOS does not end
   * such a request: it runs min(max_tokens, n_forced) positions and finishes with
   * LF_FINISH_LENGTH. Copied at submit; ids must be in the vocabulary; no stop ids or
   * sequences with it. */
  const int32_t *forced;
  int n_forced;
} lf_request;

typedef enum lf_event_type {
  LF_EVENT_TOKEN = 0,   /* one generated token */
  LF_EVENT_FINISH,      /* the request ended; finish_reason says why */
  LF_EVENT_PROMPT_TOKEN, /* lf_sampling.prompt_logprobs: a prompt token (position 1 onwards, in
                            order) with its logprob */
} lf_event_type;

/* Why a request ended. lf_finish_reason_str gives the name in brackets. */
typedef enum lf_finish_reason {
  LF_FINISH_NONE = 0,       /* "none": not finished */
  LF_FINISH_EOS,            /* "eos": the model produced one of its end-of-sequence ids (not
                               emitted) */
  LF_FINISH_LENGTH,         /* "length": max_tokens reached (capped by the model's context) */
  LF_FINISH_CANCELLED,      /* "cancelled": lf_engine_cancel */
  LF_FINISH_ERROR,          /* "error": status says what went wrong (e.g. LF_ERR_CONTEXT_FULL) */
  LF_FINISH_STOP_ID,        /* "stop_id": one of lf_request.stop_ids was generated (not
                               emitted) */
  LF_FINISH_STOP_SEQUENCE,  /* "stop_sequence": one of lf_request.stop_seqs was generated (its
                               tokens are not emitted) */
  LF_FINISH_COUNT           /* the number of reasons, for arrays indexed by reason */
} lf_finish_reason;

const char *lf_finish_reason_str(lf_finish_reason r);

typedef struct lf_event {
  uint64_t id;
  lf_event_type type;
  int32_t token;          /* LF_EVENT_TOKEN: the token. LF_EVENT_FINISH: the last token the model
                             sampled (the EOS / stop id for those reasons), -1 if none */
  lf_finish_reason reason; /* LF_EVENT_FINISH */
  lf_status status;       /* LF_EVENT_FINISH with LF_FINISH_ERROR */
  /* Since 0.2. TOKEN (lf_sampling.logprobs) and PROMPT_TOKEN events: token's log-probability
   * and the n_top most likely ids (descending, ties by ascending id) with theirs; 0 otherwise. */
  float logprob;
  int n_top;
  int32_t top_ids[LF_MAX_TOP_LOGPROBS];
  float top_logprobs[LF_MAX_TOP_LOGPROBS];
} lf_event;

/* Per-request statistics. Times are seconds on a monotonic clock, measured at step boundaries
 * (a token counts as produced when the step that sampled it ends). */
typedef struct lf_request_stats {
  int prompt_tokens;
  int generated_tokens; /* tokens the model sampled, including a final EOS / stop id */
  uint64_t evictions;   /* slot overwrites summed over layers and the model's KV heads (each
                            counted once under tensor parallelism, whatever rank holds it) */
  int slots_filled;     /* filled slots of layer 0, KV head 0 at the end (0 until finished) */
  int output_tokens;    /* LF_EVENT_TOKEN events produced (held-back stop-sequence tokens and
                           the final EOS / stop id are not) */
  int prefill_chunks;   /* forward calls the prompt took (1 unless longer than max_batch_tokens) */
  lf_finish_reason reason; /* LF_FINISH_NONE while waiting or running */
  lf_status status;     /* with LF_FINISH_ERROR: why */
  double queue_seconds; /* submit -> admission (a pool taken); while still waiting, submit ->
                           now: equal to total_seconds exactly then */
  double ttft_seconds;  /* submit -> first token sampled; 0 if none yet */
  double tpot_seconds;  /* time per output token after the first: (last - first) /
                           (generated_tokens - 1); 0 with fewer than 2 */
  double total_seconds; /* submit -> finish (or -> now while running) */
} lf_request_stats;

/* Latency histograms have LF_LATENCY_BUCKETS fixed buckets; bucket i counts values v with
 * bounds[i-1] < v <= bounds[i] (seconds; bounds[-1] = -inf, the last bound is +inf), the
 * non-cumulative form of a Prometheus histogram. */
#define LF_LATENCY_BUCKETS 20
/* The upper bounds [LF_LATENCY_BUCKETS] in seconds: 0.001 0.002 0.005 ... 500 1000 +inf. */
const double *lf_latency_bucket_bounds(void);

/* A latency distribution: percentiles over the most recent finished requests (a window of at
 * most LF_METRICS_WINDOW samples) and a histogram over all of them since init. */
#define LF_METRICS_WINDOW 1024
typedef struct lf_latency_summary {
  int n_window;          /* samples in the window */
  double p50, p90, p99;  /* over the window (nearest rank); 0 when empty */
  double mean, max;      /* over the window */
  uint64_t count;        /* histogram: samples since init */
  double sum;            /* histogram: their sum, seconds */
  uint64_t buckets[LF_LATENCY_BUCKETS];
} lf_latency_summary;

typedef struct lf_metrics {
  int running, waiting;   /* running: holds a pool (prefilling or decoding) */
  int pools_used, pools_total;
  uint64_t tokens_generated; /* tokens sampled, all requests */
  uint64_t evictions;
  double decode_seconds;  /* wall time spent in steps */
  int prefilling;         /* running requests whose prompt is not complete yet */
  uint64_t prompt_tokens; /* prompt tokens prefilled */
  uint64_t steps;
  uint64_t submitted;     /* accepted by submit */
  uint64_t rejected;      /* refused by submit with LF_ERR_QUEUE_FULL */
  uint64_t finished[LF_FINISH_COUNT]; /* by finish reason */
  double tokens_per_s;    /* tokens sampled per second over the last 10 s */
  lf_latency_summary ttft; /* time to first token (requests that produced one) */
  lf_latency_summary tpot; /* time per output token (requests with >= 2 tokens) */
} lf_metrics;

typedef struct lf_engine *lf_engine_t;
/* A communicator for tensor parallelism; NULL means a single rank. */
typedef struct lf_comm *lf_comm_t;

/* Communicators. lf_comm_init_mpi spans MPI_COMM_WORLD (duplicated, MPI_ERRORS_RETURN so a
 * failing collective comes back as LF_ERR_BACKEND rather than an abort). The caller calls
 * MPI_Init before it and MPI_Finalize after lf_comm_free; without MPI_Init it is LF_ERR_STATE,
 * and in a build without MPI it is LF_ERR_UNAVAILABLE. The library itself never includes mpi.h
 * outside parallel/, so a stack without MPI can pass its own communicator (parallel/comm.h). */
lf_status lf_comm_init_mpi(lf_comm_t *out);
/* Since 0.3. The ranks of MPI_COMM_WORLD that pass the same color (>= 0), in world-rank order:
 * one tensor-parallel group among several (data-parallel replicas, each a group). Collective
 * over MPI_COMM_WORLD: every rank calls it. */
lf_status lf_comm_init_mpi_color(int color, lf_comm_t *out);
/* A single-rank communicator (collectives are copies). */
lf_status lf_comm_init_local(lf_comm_t *out);
void lf_comm_free(lf_comm_t c);
int lf_comm_rank(lf_comm_t c); /* 0 for NULL */
int lf_comm_size(lf_comm_t c); /* 1 for NULL */

/* NCCL communicators for GPU ranks (LF_ERR_UNAVAILABLE in a build without NCCL; the cuda
 * backend's tensor parallelism needs one). Collectives are issued non-blocking and every wait
 * polls NCCL's asynchronous error state against a deadline: when a peer dies, the waiting rank
 * aborts the communicator and returns LF_ERR_BACKEND within timeout_s instead of hanging.
 * timeout_s <= 0: $LF_NCCL_TIMEOUT_S, else 60 s. Waits for rank 0's next batch descriptor (a
 * follower idling between requests) have no deadline; there the launcher (mpirun) ends the job.
 *
 * lf_comm_init_nccl: nccl_comm is an ncclComm_t the caller made (an embedding stack's own; it
 * stays the caller's, lf_comm_free does not destroy it; the caller keeps its CUDA device
 * current on the calling threads), or NULL to create one, non-blocking, on the current CUDA
 * device as rank `rank` of `size` from `unique_id` (LF_NCCL_UNIQUE_ID_BYTES bytes made by
 * lf_comm_nccl_unique_id on one rank and handed to all by the caller). */
#define LF_NCCL_UNIQUE_ID_BYTES 128
lf_status lf_comm_nccl_unique_id(void *unique_id);
lf_status lf_comm_init_nccl(void *nccl_comm, const void *unique_id, int rank, int size,
                            double timeout_s, lf_comm_t *out);
/* The nccl-tests bootstrap over MPI_COMM_WORLD (the caller ran MPI_Init and runs MPI_Finalize
 * after lf_comm_free): local rank from a shared-memory split, cudaSetDevice(local rank) (device
 * 0 when the launcher shows each rank one GPU), rank 0 makes the id, MPI_Bcast,
 * ncclCommInitRank. *device (may be NULL) gets the CUDA device chosen. LF_ERR_UNAVAILABLE
 * without MPI or NCCL. */
lf_status lf_comm_init_nccl_mpi(double timeout_s, int *device, lf_comm_t *out);
/* Since 0.3. The same bootstrap within the ranks that pass the same color (collective over
 * MPI_COMM_WORLD; every later step is the group's own): a group per replica. The device is
 * still picked by the rank's place among all the job's ranks on its host, so groups sharing a
 * host take different GPUs (or all take device 0 where one GPU is visible). */
lf_status lf_comm_init_nccl_mpi_color(int color, double timeout_s, int *device, lf_comm_t *out);
/* The same without MPI, on one node: rank, size and a fresh file for the id come from the
 * environment (LF_TP_RANK, LF_TP_SIZE, LF_TP_ID_FILE, optional LF_TP_LOCAL_RANK), as
 * tests/tp_run.sh sets them; rank 0 writes the id there and the others read it. */
lf_status lf_comm_init_nccl_env(double timeout_s, int *device, lf_comm_t *out);

/* Threading rules (enforced, see scheduler/README.md):
 *  - lf_engine_submit, lf_engine_cancel, lf_engine_metrics, lf_engine_request_stats,
 *    lf_engine_busy, lf_engine_model_info, lf_engine_pool_sizing and lf_engine_resolved_config
 *    may be called from any thread at any time;
 *  - lf_engine_step from one thread at a time: a call while another is in progress returns
 *    LF_ERR_STATE at once and changes nothing;
 *  - lf_engine_init and lf_engine_free are not concurrent with anything on that engine.
 * Submitters never wait for a forward pass: the queue lock is not held while the model runs. */

/* Tensor parallelism (docs/DESIGN.md §4): every rank of comm calls lf_engine_init with the same config
 * and loads only its shard; T must divide the KV heads, or be a multiple of them that divides
 * the query heads (KV heads replicated), else LF_ERR_INVALID_ARG naming T, Hq and Hkv on every
 * rank. Init agrees across ranks: if any rank fails, all return an error. The tensor-parallel
 * backend is the cpu one for now (LF_BACKEND_AUTO picks it; LF_BACKEND_CUDA is
 * LF_ERR_UNAVAILABLE). Rank 0 then uses the engine as usual (submit, step, ...); every other
 * rank calls lf_engine_follow, which runs what rank 0's steps broadcast and returns LF_OK when
 * rank 0 calls lf_engine_free, or an error if this rank fails. On a follower the request calls
 * return LF_ERR_STATE. A backend-wide failure on any rank ends tensor-parallel serving: the
 * failing rank's call returns the error, later steps on rank 0 return LF_ERR_STATE, and the
 * program should exit non-zero so the launcher (mpirun) ends the job instead of leaving ranks
 * blocked in a collective. comm NULL or of size 1: a single rank, as before. */
lf_status lf_engine_init(const lf_engine_config *cfg, lf_comm_t comm, lf_engine_t *out);
lf_status lf_engine_follow(lf_engine_t e);
/* On rank 0 of a tensor-parallel engine this also releases the followers. */
void lf_engine_free(lf_engine_t e);
lf_status lf_engine_model_info(lf_engine_t e, lf_model_info *out);
/* How many pools this rank's engine holds and why (lf_pool_sizing). */
lf_status lf_engine_pool_sizing(lf_engine_t e, lf_pool_sizing *out);
/* The settings this rank's engine runs with, defaults resolved (lf_resolved_config). Any thread,
 * any rank. */
lf_status lf_engine_resolved_config(lf_engine_t e, lf_resolved_config *out);
/* Validates and queues a request (FCFS); *id identifies it in events. LF_ERR_QUEUE_FULL when
 * max_queue requests are already waiting; LF_ERR_INVALID_ARG for a bad request (nothing is
 * queued). A request that can never fit (a `full`-policy prompt longer than the pool) is
 * accepted and ends at the next step with LF_FINISH_ERROR / LF_ERR_CONTEXT_FULL. */
lf_status lf_engine_submit(lf_engine_t e, const lf_request *req, uint64_t *id);
/* Runs one iteration: returns the pools of cancelled requests, admits waiting requests while
 * pools are free, then runs ONE forward over a batch of one decode token for every running
 * sequence plus prompt chunks up to max_batch_tokens, and turns the results into events.
 * Returns up to cap events in events[0..*n) (a request's events are in order; every request
 * gets exactly one LF_EVENT_FINISH, its last event). Events that do not fit are kept for the
 * next call. A non-OK return is an engine-wide failure (the backend failed: the requests in the
 * batch were finished with LF_FINISH_ERROR; or out of memory before anything changed). */
lf_status lf_engine_step(lf_engine_t e, lf_event *events, int cap, int *n);
/* Nonzero while any request is running, waiting or has undelivered events. */
int lf_engine_busy(lf_engine_t e);
/* Cancels a waiting or running request: a waiting one leaves the queue at once, a running one
 * at the start of the next step (its pool is returned before admission); either way its FINISH
 * (LF_FINISH_CANCELLED) comes from the next step. LF_ERR_NOT_FOUND once it has finished. A
 * running request that ends in a step already in progress keeps that step's finish reason. */
lf_status lf_engine_cancel(lf_engine_t e, uint64_t id);
/* Statistics of a waiting, running or recently finished request (the last 4096 finished are
 * kept); LF_ERR_NOT_FOUND otherwise. */
lf_status lf_engine_request_stats(lf_engine_t e, uint64_t id, lf_request_stats *out);
lf_status lf_engine_metrics(lf_engine_t e, lf_metrics *m);


/* ---- Version ---------------------------------------------------------------------------- */

/* The library's version, "MAJOR.MINOR.PATCH" (also LFSERVE_VERSION_* below). */
#define LFSERVE_VERSION_MAJOR 0
#define LFSERVE_VERSION_MINOR 5
#define LFSERVE_VERSION_PATCH 0
const char *lf_version(void);

/* sizeof of a public struct by its name ("lf_engine_config", "lf_request", "lf_event",
 * "lf_model_info", "lf_request_stats", "lf_sampling", "lf_chat_message", "lf_metrics",
 * "lf_logit_bias", "lf_pool_sizing", "lf_resolved_config"), 0 for another name: lets a binding
 * built without this header (python/lfserve) check its layouts. */
size_t lf_abi_sizeof(const char *type_name);

/* Frees memory the library handed to the caller (lf_tokenize's ids, lf_detokenize's text). */
void lf_free(void *p);

/* ---- Text: a model's own tokenizer and chat template ---------------------------------------
 * The engine takes and returns token ids; these calls turn text into a request's prompt and its
 * tokens back into text, with the tokenizer a model carries (a Hugging Face directory's
 * tokenizer.json and tokenizer_config.json, or a GGUF file's metadata). A tokenizer is immutable
 * once open: any thread may use it. A detokenizer is one stream's state (one request). */

typedef struct lf_tokenizer lf_tokenizer;
typedef struct lf_detokenizer lf_detokenizer;

/* One chat message: role "system", "user" or "assistant"; content UTF-8, NUL-terminated. */
typedef struct lf_chat_message {
  const char *role;
  const char *content;
} lf_chat_message;

/* The tokenizer of the model at model_path (the same path as lf_engine_config.model_path).
 * LF_ERR_UNSUPPORTED when the model carries none (a llama2.c file, "random:..."), with the
 * reason in lf_last_error; other errors when it is present but cannot be loaded. */
lf_status lf_tokenizer_open(const char *model_path, lf_tokenizer **out);
void lf_tokenizer_free(lf_tokenizer *t);
/* text (UTF-8, NUL-terminated) -> ids. add_special: add what the tokenizer's template adds
 * (BOS where it has one), as for a plain prompt. *ids is allocated (free with lf_free; NULL
 * when *n is 0). */
lf_status lf_tokenize(const lf_tokenizer *t, const char *text, int add_special, int32_t **ids,
                      int *n);
/* msgs[0..n_msgs) rendered with the chat template of the model at model_path (or the built-in
 * format named by chat_format: "chatml", "llama3", "deepseek-r1"; NULL: the model's own) and
 * encoded with t, ending with the assistant's turn opened. Message content is encoded with
 * special-token text as plain text. LF_ERR_UNSUPPORTED when the model has no template lfserve
 * can render and no format is named. *ids as for lf_tokenize. */
lf_status lf_tokenize_chat(const lf_tokenizer *t, const char *model_path, const char *chat_format,
                           const lf_chat_message *msgs, int n_msgs, int32_t **ids, int *n);
/* ids -> text (NUL-terminated, allocated: free with lf_free), special tokens (BOS, EOS, chat
 * markers) left out. Unknown ids are LF_ERR_INVALID_ARG. */
lf_status lf_detokenize(const lf_tokenizer *t, const int32_t *ids, int n, char **text);
/* A streaming decoder over t (which must outlive it), special tokens left out. */
lf_status lf_detokenizer_init(const lf_tokenizer *t, lf_detokenizer **out);
/* Feeds one generated token: *text gets the whole UTF-8 characters it completed (*len bytes,
 * NUL-terminated; possibly ""), valid until the next call on d. The bytes of a character still
 * incomplete are held back. */
lf_status lf_detokenizer_put(lf_detokenizer *d, int32_t token, const char **text, size_t *len);
/* Ends the stream: held-back bytes come out (an incomplete character as U+FFFD) and d starts
 * over, as for a new request. */
lf_status lf_detokenizer_flush(lf_detokenizer *d, const char **text, size_t *len);
void lf_detokenizer_free(lf_detokenizer *d);

#ifdef __cplusplus
}
#endif
#endif /* LFSERVE_H */

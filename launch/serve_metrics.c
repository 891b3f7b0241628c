/* lfserve's GET endpoints: /v1/models, /health and /metrics (Prometheus text format), and the
 * counters only /metrics reads (serve.h). */
#include <stdio.h>
#include <stdlib.h>

#include "launch/serve.h"

static const char *const outcome_names[OUT_N] = {"stop",         "length",   "error",
                                                 "disconnected", "rejected", "invalid"};
static const int status_codes[N_CODES] = {200, 400, 401, 404, 405, 408, 413, 429, 500, 503};
const char *const srv_refused_names[REF_N] = {"queue_full", "queue_timeout",
                                              "too_many_connections", "shutting_down"};
void srv_count_code(int status) {
  for (int i = 0; i < N_CODES; i++)
    if (status_codes[i] == status) {
      atomic_fetch_add(&S.codes[i], 1);
      return;
    }
  atomic_fetch_add(&S.codes[N_CODES], 1);
}

MHD_Result_t srv_handle_models(struct MHD_Connection *mc) {
  lfs_buf b = {0};
  lfs_buf_puts(&b, "{\"object\":\"list\",\"data\":[{\"id\":");
  lfs_buf_json_cstr(&b, S.model_name);
  lfs_buf_printf(&b,
                 ",\"object\":\"model\",\"created\":%lld,\"owned_by\":\"lfserve\","
                 "\"max_model_len\":%d,\"kv_budget\":%d,\"policy\":\"%s\"}]}",
                 (long long)S.started, S.mi.max_seq_len, S.budget, lf_policy_str(S.policy));
  MHD_Result_t r = srv_send_buf(mc, 200, "application/json", &b, NULL);
  lfs_buf_free(&b);
  return r;
}

MHD_Result_t srv_handle_health(struct MHD_Connection *mc) {
  lfs_buf b = {0};
  pthread_mutex_lock(&S.mu);
  const int stopping = S.stopping, failed = srv_any_step_failed();
  pthread_mutex_unlock(&S.mu);
  lfs_buf_puts(&b, stopping ? "{\"status\":\"stopping\"}"
                   : failed ? "{\"status\":\"engine_failed\"}"
                            : "{\"status\":\"ok\"}");
  MHD_Result_t r = srv_send_buf(mc, stopping || failed ? 503 : 200, "application/json", &b, NULL);
  lfs_buf_free(&b);
  return r;
}

static void prom_hist(lfs_buf *b, const char *name, const char *help, const lf_latency_summary *h) {
  const double *bounds = lf_latency_bucket_bounds();
  lfs_buf_printf(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
  uint64_t cum = 0;
  for (int i = 0; i < LF_LATENCY_BUCKETS; i++) {
    cum += h->buckets[i];
    if (i == LF_LATENCY_BUCKETS - 1)
      lfs_buf_printf(b, "%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)cum);
    else
      lfs_buf_printf(b, "%s_bucket{le=\"%g\"} %llu\n", name, bounds[i], (unsigned long long)cum);
  }
  lfs_buf_printf(b, "%s_sum %.9g\n%s_count %llu\n", name, h->sum, name,
                 (unsigned long long)h->count);
}

MHD_Result_t srv_handle_metrics(struct MHD_Connection *mc) {
  lf_metrics m, per[64];
  lf_metrics *pr = S.n_replicas <= 64 ? per : malloc(sizeof *pr * (size_t)S.n_replicas);
  if (!pr) return srv_reply_error(mc, 500, "server_error", "out_of_memory", "out of memory");
  if (srv_metrics_collect(&m, pr) != LF_OK) {
    if (pr != per) free(pr);
    return srv_reply_error(mc, 500, "server_error", "metrics_failed", lf_last_error());
  }
  pthread_mutex_lock(&S.mu);
  const int n_jobs = S.n_jobs;
  const unsigned long long step_errors = S.step_errors;
  pthread_mutex_unlock(&S.mu);
  lfs_buf b = {0};
#define GAUGE(name, help, fmt, v)                                                                  \
  lfs_buf_printf(&b, "# HELP " name " " help "\n# TYPE " name " gauge\n" name " " fmt "\n", v)
#define COUNTER(name, help, v)                                                                     \
  lfs_buf_printf(&b, "# HELP " name " " help "\n# TYPE " name " counter\n" name " %llu\n",         \
                 (unsigned long long)(v))
  lfs_buf_puts(&b, "# HELP lfserve_requests_total Completion requests by outcome.\n"
                   "# TYPE lfserve_requests_total counter\n");
  for (int i = 0; i < OUT_N; i++)
    lfs_buf_printf(&b, "lfserve_requests_total{outcome=\"%s\"} %llu\n", outcome_names[i],
                   (unsigned long long)atomic_load(&S.outcomes[i]));
  lfs_buf_puts(&b, "# HELP lfserve_refused_total Completion requests refused with 503 and "
                   "Retry-After, by reason (each is also outcome=\"rejected\").\n"
                   "# TYPE lfserve_refused_total counter\n");
  for (int i = 0; i < REF_N; i++)
    lfs_buf_printf(&b, "lfserve_refused_total{reason=\"%s\"} %llu\n", srv_refused_names[i],
                   (unsigned long long)atomic_load(&S.refused[i]));
  static const char *const sk_names[4] = {"idle", "reading", "handling", "sending"};
  lfs_buf_puts(&b, "# HELP lfserve_timeouts_total Connections closed after --timeout of client "
                   "idleness, by where the client was (idle and reading get 408 first).\n"
                   "# TYPE lfserve_timeouts_total counter\n");
  for (int i = 0; i < 4; i++)
    if (i != SK_HANDLING)
      lfs_buf_printf(&b, "lfserve_timeouts_total{state=\"%s\"} %llu\n", sk_names[i],
                     (unsigned long long)atomic_load(&S.idle_closed[i]));
  lfs_buf_puts(&b, "# HELP lfserve_http_responses_total HTTP responses by status code.\n"
                   "# TYPE lfserve_http_responses_total counter\n");
  for (int i = 0; i <= N_CODES; i++) {
    char code[8];
    if (i < N_CODES)
      snprintf(code, sizeof code, "%d", status_codes[i]);
    else
      snprintf(code, sizeof code, "other");
    lfs_buf_printf(&b, "lfserve_http_responses_total{code=\"%s\"} %llu\n", code,
                   (unsigned long long)atomic_load(&S.codes[i]));
  }
  lfs_buf_puts(&b, "# HELP lfserve_engine_finished_total Requests the engine finished, by reason.\n"
                   "# TYPE lfserve_engine_finished_total counter\n");
  for (int r = LF_FINISH_EOS; r < LF_FINISH_COUNT; r++)
    lfs_buf_printf(&b, "lfserve_engine_finished_total{reason=\"%s\"} %llu\n",
                   lf_finish_reason_str((lf_finish_reason)r), (unsigned long long)m.finished[r]);
  GAUGE("lfserve_queue_length", "Requests waiting for a pool.", "%d", m.waiting);
  GAUGE("lfserve_running", "Requests holding a pool.", "%d", m.running);
  GAUGE("lfserve_prefilling", "Running requests whose prompt is not complete.", "%d", m.prefilling);
  GAUGE("lfserve_pools_used", "KV pools in use.", "%d", m.pools_used);
  GAUGE("lfserve_pools_total", "KV pools.", "%d", m.pools_total);
  GAUGE("lfserve_requests_in_flight", "Submitted requests the server still tracks.", "%d", n_jobs);
  GAUGE("lfserve_open_streams", "Streaming responses open.", "%d", atomic_load(&S.open_streams));
  GAUGE("lfserve_tokens_per_second", "Tokens sampled per second over the last 10 s.", "%.3f",
        m.tokens_per_s);
  COUNTER("lfserve_tokens_generated_total", "Tokens sampled.", m.tokens_generated);
  COUNTER("lfserve_prompt_tokens_total", "Prompt tokens prefilled.", m.prompt_tokens);
  COUNTER("lfserve_evictions_total", "KV slot overwrites (LongFlow and other policies).",
          m.evictions);
  COUNTER("lfserve_steps_total", "Engine steps.", m.steps);
  COUNTER("lfserve_step_errors_total", "Engine steps that failed.", step_errors);
  COUNTER("lfserve_submitted_total", "Requests accepted by the engine.", m.submitted);
  COUNTER("lfserve_rejected_total", "Requests refused because the queue was full.", m.rejected);
  lfs_buf_printf(&b,
                 "# HELP lfserve_step_seconds_total Wall time spent in engine steps.\n"
                 "# TYPE lfserve_step_seconds_total counter\nlfserve_step_seconds_total %.6f\n",
                 m.decode_seconds);
  prom_hist(&b, "lfserve_ttft_seconds", "Time to first token.", &m.ttft);
  prom_hist(&b, "lfserve_tpot_seconds", "Time per output token after the first.", &m.tpot);
  /* Per replica (under mpirun --tp T: N/T of them; replica 0 is rank 0's engine). The lines
   * above are their sums; another replica's figures are its last report (every 200 ms). */
  pthread_mutex_lock(&S.mu);
#define PER_REPLICA(name, type, help, fmt, expr)                                                   \
  do {                                                                                             \
    lfs_buf_puts(&b, "# HELP " name " " help "\n# TYPE " name " " type "\n");                   \
    for (int r = 0; r < S.n_replicas; r++) {                                                       \
      const lf_metrics *q = &pr[r];                                                                \
      const struct srv_replica *rp = &S.rep[r];                                                    \
      (void)q, (void)rp;                                                                           \
      lfs_buf_printf(&b, name "{replica=\"%d\"} " fmt "\n", r, expr);                            \
    }                                                                                              \
  } while (0)
  PER_REPLICA("lfserve_replica_pools_total", "gauge", "KV pools of each replica.", "%d",
              q->pools_total);
  PER_REPLICA("lfserve_replica_pools_used", "gauge", "KV pools in use, per replica.", "%d",
              q->pools_used);
  PER_REPLICA("lfserve_replica_running", "gauge", "Requests holding a pool, per replica.", "%d",
              q->running);
  PER_REPLICA("lfserve_replica_queue_length", "gauge", "Requests waiting for a pool, per replica.",
              "%d", q->waiting);
  PER_REPLICA("lfserve_replica_routed_total", "counter", "Requests rank 0 sent to each replica.",
              "%llu", (unsigned long long)rp->routed);
  PER_REPLICA("lfserve_replica_tokens_generated_total", "counter", "Tokens sampled, per replica.",
              "%llu", (unsigned long long)q->tokens_generated);
  PER_REPLICA("lfserve_replica_steps_total", "counter", "Engine steps, per replica.", "%llu",
              (unsigned long long)q->steps);
  PER_REPLICA("lfserve_replica_step_failed", "gauge", "1 when the replica's last step failed.",
              "%d", r == 0 ? S.last_step_failed : rp->step_failed);
#undef PER_REPLICA
  pthread_mutex_unlock(&S.mu);
  if (pr != per) free(pr);
#undef GAUGE
#undef COUNTER
  MHD_Result_t r = srv_send_buf(mc, 200, "text/plain; version=0.0.4; charset=utf-8", &b, NULL);
  lfs_buf_free(&b);
  return r;
}

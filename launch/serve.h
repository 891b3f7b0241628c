/* lfserve's internals, shared by its files (private to the lfserve program):
 *
 *   lfserve.c          main: options, start-up, the signal wait, shutdown
 *   serve_jobs.c       jobs (one per submitted request) and the engine thread that feeds them
 *   serve_conn.c       sockets and connections, the libmicrohttpd callbacks, error replies
 *   serve_completion.c /v1/completions and /v1/chat/completions: streaming (SSE) and whole
 *                      responses
 *   serve_metrics.c    GET /v1/models, /health, /metrics and the counters behind them
 *   serve_replicas.c   data-parallel replicas under mpirun (--tp T of N ranks): rank 0's router
 *                      thread and the other replicas' lead ranks (docs/DESIGN.md §4)
 *
 * Threads. One engine thread runs lf_engine_step in a loop and routes each event to its
 * request's job (a token queue under S.mu, with a condition variable). libmicrohttpd runs one
 * thread per connection: a request is parsed and checked (http_request.c), submitted, and then
 * its connection thread waits on its job, writing SSE chunks (stream) or one JSON body. Lock
 * order: S.mu, then the engine's own lock (submit and busy are called under S.mu, so the
 * engine thread can never route an event before its job is in the table).
 *
 * Disconnects. A waiting connection thread wakes at least every 200 ms and peeks at its socket;
 * a peer that has gone (FIN/RST) gets its request cancelled, and the engine returns the pool at
 * its next step. libmicrohttpd's connection timeout closes clients that stall while sending a
 * request or reading a response; it is switched off only while a non-streaming request is being
 * generated (the server, not the client, is the slow one then).
 */
#ifndef LF_LAUNCH_SERVE_H
#define LF_LAUNCH_SERVE_H

#include <microhttpd.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <time.h>

#include "launch/http_json.h"
#include "launch/http_request.h"
#include "launch/http_stop.h"
#include "lfserve.h"
#include "text/tokenizer.h"

#if MHD_VERSION < 0x00097002
typedef int MHD_Result_t;
#else
typedef enum MHD_Result MHD_Result_t;
#endif

/* ---- jobs (serve_jobs.c) ------------------------------------------------------------------ */

typedef struct job {
  uint64_t id;
  int refs;          /* under S.mu: the engine side (until FINISH) + the connection */
  pthread_cond_t cv; /* tokens or the finish arrived (waits on S.mu) */
  int32_t *toks;     /* [n_toks] routed, not yet taken by the connection */
  int n_toks, cap_toks;
  /* With logprobs (want_lp): each routed token's event, parallel to toks ([cap_toks]); the
   * prompt's PROMPT_TOKEN events (echo with logprobs), in order; and the connection's own copy
   * of the events it took (taken_lp, [cap_taken_lp]). lp_oom: an event could not be kept. */
  int want_lp, lp_oom;
  lf_event *lps;
  lf_event *plp;
  int n_plp, cap_plp;
  lf_event *taken_lp;
  int cap_taken_lp;
  /* the connection's progress through the logprobs: prompt echoed, text offset so far */
  int echoed;
  long long text_off;
  int finished;
  lf_finish_reason reason;
  lf_status status;
  lf_request_stats stats;
  int have_stats;
  int text_stop;    /* the connection matched a stop string and cancelled the request */
  int outcome;      /* OUT_*, once finished */
  int refused;      /* the connection refused it (503, counted there) and cancelled it: the
                       engine's FINISH is not counted again */
  struct job *next; /* hash chain */
  /* Replicas (serve_replicas.c). id above is the table's key: the engine's id on replica 0,
   * (replica << 48) | its engine's id on the others. */
  int replica;        /* the replica serving it: 0 is this rank's engine */
  uint64_t eid;       /* its id in that replica's engine */
  int admitted;       /* another replica: it said the request holds a pool */
  /* another replica, until it answers the submission (under S.mu) */
  uint64_t token;     /* the submission's number in that answer */
  int acked;          /* the answer came: submit_status, submit_err */
  lf_status submit_status;
  char submit_err[256];
  struct job *pend_next;
} job;

#define SRV_REPLICA_SHIFT 48

#define JOB_BUCKETS 4096

/* How a completion request ended, as /metrics counts it (names in serve_metrics.c). */
enum { OUT_STOP, OUT_LENGTH, OUT_ERROR, OUT_DISCONNECT, OUT_REJECTED, OUT_INVALID, OUT_N };
/* Why a completion request was refused with 503 + Retry-After (lfserve_refused_total{reason};
 * each is also an OUT_REJECTED outcome). Names in serve_metrics.c. */
enum { REF_QUEUE_FULL, REF_QUEUE_TIMEOUT, REF_CONNECTIONS, REF_SHUTTING_DOWN, REF_N };
extern const char *const srv_refused_names[REF_N];
/* HTTP status codes /metrics counts one by one (the list is in serve_metrics.c); the rest are
 * counted together. */
#define N_CODES 10

/* Accepted sockets beyond --max-connections, kept for /health and /metrics: libmicrohttpd's own
 * limit is this much higher, and completions are refused (503) beyond --max-connections. */
#define CONN_RESERVE 16u

/* Where a socket is (serve_conn.c's reaper applies --timeout to the client's part only). */
enum {
  SK_IDLE,     /* no request yet, or between keep-alive requests */
  SK_READING,  /* headers in, the body arriving */
  SK_HANDLING, /* the whole request in: the server's work (parsing, queue, generation) */
  SK_SENDING,  /* a response queued: the client is reading it */
};

/* One accepted socket (libmicrohttpd's socket context). */
struct sock {
  int fd;
  int busy;   /* a request in progress (between its headers and its completion) */
  int shed;   /* shut down to make room, or by the reaper */
  int state;  /* SK_* */
  int served; /* a request has completed on it (keep-alive) */
  double since;  /* the client's last sign of life in this state (lf_now_s) */
  int outq;      /* SK_SENDING: bytes unsent at the last look */
  struct sock *prev, *next;
};

/* The server: one per process, set up by main. */
struct srv {
  lf_engine_t e;
  lf_model_info mi;
  lf_tokenizer *tok;
  lf_chat_template *tmpl;
  lfs_model_ctx mctx;
  char model_name[256];
  unsigned timeout_s;
  double queue_timeout_s; /* a request still waiting for a pool after this long gets 503; 0: none */
  size_t max_body;
  const char *api_key;    /* NULL: no authentication */
  size_t api_key_len;
  int auth_metrics;       /* /health and /metrics need the key too */
  lf_policy policy;
  int budget;

  pthread_mutex_t mu;
  pthread_cond_t work_cv; /* a submission arrived (the engine thread may be idle) */
  job *table[JOB_BUCKETS];
  int n_jobs;
  int stopping;
  int streams_abort; /* stopping and the engine cannot end the requests: connections end them */
  pthread_t engine_thread;
  /* Data-parallel replicas (serve_replicas.c): 1 without; rep[0] is this rank's engine. */
  int n_replicas, tp;
  struct srv_replica *rep;
  uint64_t step_errors;
  int last_step_failed;

  atomic_ullong outcomes[OUT_N];
  atomic_ullong codes[N_CODES + 1]; /* the last: any other status */
  atomic_ullong refused[REF_N];
  atomic_ullong idle_closed[4]; /* sockets the reaper closed, by SK_* state */
  pthread_t reaper;
  atomic_int reaper_stop;
  pthread_mutex_t logmu; /* the refusal log lines (at most one a second per reason) */
  double log_last[REF_N];
  unsigned long long log_since[REF_N];
  atomic_int open_streams;
  time_t started;

  /* Connections, oldest first (under cmu): at the limit, the oldest one without a request in
   * progress is shut down to make room, so half-open or idle keep-alive connections cannot
   * lock out /health and /metrics. */
  pthread_mutex_t cmu;
  struct sock *socks;
  int n_socks;
  int n_shed; /* of n_socks: shut down to make room, closing (they do not count as in use) */
  unsigned max_conn;
  atomic_int n_handed; /* sockets the acceptor handed to libmicrohttpd, not yet closed */
};

extern struct srv S;

/* CLOCK_REALTIME now + 200 ms: the deadline of the waits that poll (engine idle, peer gone). */
struct timespec srv_deadline_200ms(void);

/* Under S.mu: hands events of replica r's engine to their jobs; fin[] holds, in order, the
 * statistics of the FINISH events among them (NULL: ask this rank's engine). */
void srv_route_locked(int r, const lf_event *ev, int n, const lf_request_stats *fin);
/* Under S.mu: where the job with table key id is, or would go. */
job **srv_job_slot(uint64_t id);
/* Under S.mu. Drops one reference; the last frees the job. */
void srv_job_unref(job *j);
/* Creates the job of rq and submits rq under S.mu (so the engine thread cannot route an event
 * before the job is in the table); the job starts with two references, the engine side's and the
 * caller's. Returns 0 with *out set; 1 when the server is stopping (nothing submitted); -1 out
 * of memory; -2 when the engine refused the request (*s says why). */
int srv_job_submit(const lf_request *rq, job **out, lf_status *s);
/* Under S.mu: cancels every request in flight (stopping). */
void srv_jobs_cancel_all(void);
/* Under S.mu: wakes every connection waiting on a job. */
void srv_jobs_wake_all(void);
/* After the engine thread has stopped: drops the jobs whose FINISH never came. */
void srv_jobs_free_all(void);
/* The engine thread (pthread start routine). */
void *srv_engine_main(void *arg);

/* ---- connections (serve_conn.c) ----------------------------------------------------------- */

typedef struct conn {
  atomic_int refs; /* the connection (until completed) + a streaming response (until freed) */
  struct MHD_Connection *mc;
  int fd;
  lfs_buf body;
  int too_large, replied;
  size_t dropped; /* body bytes read and dropped after too_large */
  /* a completion in flight */
  job *j;
  lfs_request rq;
  int chat;
  int have_stream;
  lf_tok_stream ts;
  lfs_stopper stop; /* the request's stop strings, matched on the decoded text */
  int text_stopped; /* a stop string matched: the output ended, the request was cancelled */
  lfs_buf out;      /* SSE bytes not yet handed to libmicrohttpd */
  lf_tok_text text; /* scratch: decoded text */
  lfs_buf emit;     /* scratch: decoded text the stop strings let through */
  int32_t *taken;   /* [cap_taken] tokens taken from the job, not yet formatted */
  int cap_taken;
  int n_out; /* tokens emitted so far */
  int first_chunk_sent;
  int done; /* [DONE] queued */
  double last_peer_check;
  char cid[48];
  long long created;
} conn;

/* Drops one reference; the last cancels the request if it is still running and frees c. */
void srv_conn_unref(conn *c);
/* 1 when the peer has closed its end (or the socket failed). */
int srv_peer_gone(int fd);

/* Queues b as the response (a 500 instead when b ran out of memory) and counts the status. */
MHD_Result_t srv_send_buf(struct MHD_Connection *mc, int status, const char *ctype, lfs_buf *b,
                          const char *retry_after);
/* OpenAI's error object {"error": {...}} for e. */
void srv_error_json(lfs_buf *b, const lfs_error *e);
MHD_Result_t srv_send_error(struct MHD_Connection *mc, const lfs_error *e, const char *retry_after);
MHD_Result_t srv_reply_error(struct MHD_Connection *mc, int status, const char *type,
                             const char *code, const char *msg);
/* Refuses a completion request that cannot be served: 503 with Retry-After, counted under
 * reason (REF_*) and as an OUT_REJECTED outcome, and logged (at most a line a second per
 * reason, with the count since the last line). */
MHD_Result_t srv_refuse(struct MHD_Connection *mc, int reason, const char *code, const char *msg);
/* srv_refuse's accounting alone: the outcome, the reason's count and the log line. */
void srv_refusal_count(int reason);

/* ---- the listening socket (serve_accept.c) ------------------------------------------------ */

/* Binds host:port (IPv4; port 0: any free one) and listens; returns the socket, or -1 after
 * saying why on stderr. *bound_port: the port it got; *loopback: 1 for a 127.x.x.x address. */
int srv_listen(const char *host, long port, int backlog, int *bound_port, int *loopback);
/* Starts the acceptor thread: it accepts every connection on lfd and hands it to d while d holds
 * fewer than room sockets; beyond, it answers 503 + Retry-After itself (counted as a refusal,
 * reason too_many_connections) and closes the socket once the client has closed its end. */
int srv_acceptor_start(int lfd, struct MHD_Daemon *d, unsigned room);
/* Writes a whole 503 + Retry-After response (too_many_connections) on fd, before or without
 * reading its request, and counts it as a refusal. */
void srv_raw_refuse(int fd);
/* Stops the acceptor (before MHD_stop_daemon). The listening socket stays the caller's. */
void srv_acceptor_stop(void);
/* The reaper (a thread, started when --timeout is set; libmicrohttpd's own timeout is off): every
 * 100 ms it closes sockets whose client has been idle longer than --timeout: no request started
 * (408 Request Timeout first, unless the socket already served one: keep-alive clients expect a
 * silent close), a body stalled (408), or a response the client stopped reading. Bytes waiting
 * in the socket count as life, so a request that has arrived is never dropped unread, however
 * late the server gets to it; and the server's own work (queue, generation) never counts. */
void *srv_reaper_main(void *arg);

/* The libmicrohttpd callbacks. */
void srv_on_connection(void *cls, struct MHD_Connection *mc, void **socket_context,
                       enum MHD_ConnectionNotificationCode toe);
MHD_Result_t srv_on_request(void *cls, struct MHD_Connection *mc, const char *url,
                            const char *method, const char *version, const char *upload,
                            size_t *upload_size, void **con_cls);
void srv_on_completed(void *cls, struct MHD_Connection *mc, void **con_cls,
                      enum MHD_RequestTerminationCode toe);

/* ---- completions (serve_completion.c) ----------------------------------------------------- */

/* POST /v1/completions (chat 0) or /v1/chat/completions (chat 1), c->body holding the request. */
MHD_Result_t srv_handle_completion(conn *c, int chat);

/* ---- data-parallel replicas (serve_replicas.c) ---------------------------------------------
 *
 * `mpirun -np N lfserve --tp T`: N / T replicas, each a tensor-parallel group of T ranks
 * (world ranks r*T .. r*T+T-1). Rank 0 leads replica 0 and serves HTTP; every request goes to
 * the replica with the most free pools (pools less the requests it holds or queues; ties to the
 * lower index). The lead rank of each other replica runs srv_leader_main: it submits what rank
 * 0 sends, steps its engine (its followers follow it as under plain tensor parallelism) and
 * sends the events back. Rank 0's router thread does all of rank 0's talking to them. */

/* Per replica, on rank 0 (under S.mu). */
struct srv_replica {
  int pools;            /* its pools (from start-up) */
  int outstanding;      /* requests submitted to it and not finished */
  int step_failed;      /* its last step failed */
  int have_metrics;
  lf_metrics m;         /* its last report (replica 0: unused, asked directly) */
  uint64_t routed;      /* requests sent to it */
  int bye;              /* it has stopped */
};

/* Rank 0, once S.rep is set up: starts the router thread (n_replicas > 1). 0, or 1 after a
 * message. */
int srv_replicas_start(void *dp_comm);
/* Rank 0, after the engine thread has stopped: tells every other replica to stop and waits for
 * their answer (at most 5 s; not at all when the launcher is ending the job), then stops the
 * router. */
void srv_replicas_stop(int launcher_abort);
/* Under S.mu: submits rq to the replica with the most free pools. Returns 0 with *out set; -1
 * out of memory; -2 refused (*s says why, lf_last_error the message). May wait (S.mu released)
 * for another replica's answer. The job gets two references, as srv_job_submit's. */
int srv_replica_submit(const lf_request *rq, job *j, lf_status *s);
/* Under S.mu: cancels j's request wherever it runs. */
void srv_job_cancel(job *j);
/* Under S.mu: 1 while j's request still waits for a pool. */
int srv_job_queued(job *j);
/* The metrics of every replica (per[n_replicas]) and their sum. LF_OK, or this engine's error. */
lf_status srv_metrics_collect(lf_metrics *sum, lf_metrics *per);
/* Under S.mu: 1 when some replica's last step failed. */
int srv_any_step_failed(void);
/* A lead rank of replica r >= 1: serves rank 0's requests on e until rank 0 says stop (0) or
 * the launcher signals (2: the job is being ended) or MPI fails (1). */
int srv_leader_main(lf_engine_t e, void *dp_comm, int replica, const sigset_t *sigs);

/* ---- GET endpoints and counters (serve_metrics.c) ----------------------------------------- */

void srv_count_code(int status);
MHD_Result_t srv_handle_models(struct MHD_Connection *mc);
MHD_Result_t srv_handle_health(struct MHD_Connection *mc);
MHD_Result_t srv_handle_metrics(struct MHD_Connection *mc);

#endif

/* lfserve: an OpenAI-compatible HTTP server over the lfserve engine.
 *
 *   lfserve --model DIR [--budget B] [--port 8000] [--host 0.0.0.0] [--policy P] [--pools N]
 *           [--max-queue N] [--backend auto|cpu|cuda] [--served-model-name NAME] ...
 *
 * Threads. One engine thread runs lf_engine_step in a loop and routes each event to its
 * request's job (a token queue under srv.mu, with a condition variable). libmicrohttpd runs one
 * thread per connection: a request is parsed and checked (http_request.c), submitted, and then
 * its connection thread waits on its job, writing SSE chunks (stream) or one JSON body. Lock
 * order: srv.mu, then the engine's own lock (submit and busy are called under srv.mu, so the
 * engine thread can never route an event before its job is in the table).
 *
 * Disconnects. A waiting connection thread wakes at least every 200 ms and peeks at its socket;
 * a peer that has gone (FIN/RST) gets its request cancelled, and the engine returns the pool at
 * its next step. libmicrohttpd's connection timeout closes clients that stall while sending a
 * request or reading a response; it is switched off only while a non-streaming request is being
 * generated (the server, not the client, is the slow one then).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "engine/model_text.h"
#include "text/tokenizer.h"
#include "launch/http_json.h"
#include "launch/http_request.h"
#include "launch/tp_launch.h"
#include "lfserve.h"
#ifdef LF_HAVE_MPI
#include <mpi.h>
#endif

#if MHD_VERSION < 0x00097002
typedef int MHD_Result_t;
#else
typedef enum MHD_Result MHD_Result_t;
#endif

/* ---- jobs: one per submitted request ---------------------------------------------------- */

typedef struct job {
  uint64_t id;
  int refs;          /* under srv.mu: the engine side (until FINISH) + the connection */
  pthread_cond_t cv; /* tokens or the finish arrived (waits on srv.mu) */
  int32_t *toks;     /* [n_toks] routed, not yet taken by the connection */
  int n_toks, cap_toks;
  int finished;
  lf_finish_reason reason;
  lf_status status;
  lf_request_stats stats;
  int have_stats;
  int text_stop;    /* the connection matched a stop string and cancelled the request */
  int outcome;      /* OUT_*, once finished */
  struct job *next; /* hash chain */
} job;

#define JOB_BUCKETS 4096

enum { OUT_STOP, OUT_LENGTH, OUT_ERROR, OUT_DISCONNECT, OUT_REJECTED, OUT_INVALID, OUT_N };
static const char *const outcome_names[OUT_N] = {"stop",         "length",   "error",
                                                 "disconnected", "rejected", "invalid"};
static const int status_codes[] = {200, 400, 404, 405, 413, 429, 500, 503};
#define N_CODES (int)(sizeof status_codes / sizeof status_codes[0])

/* One accepted socket (libmicrohttpd's socket context). */
struct sock {
  int fd;
  int busy; /* a request in progress (between its headers and its completion) */
  int shed; /* shut down to make room */
  struct sock *prev, *next;
};

static struct srv {
  lf_engine_t e;
  lf_model_info mi;
  lf_tokenizer *tok;
  lf_chat_template *tmpl;
  lfs_model_ctx mctx;
  char model_name[256];
  unsigned timeout_s;
  size_t max_body;
  lf_policy policy;
  int budget;

  pthread_mutex_t mu;
  pthread_cond_t work_cv; /* a submission arrived (the engine thread may be idle) */
  job *table[JOB_BUCKETS];
  int n_jobs;
  int stopping;
  int streams_abort; /* stopping and the engine cannot end the requests: connections end them */
  pthread_t engine_thread;
  uint64_t step_errors;
  int last_step_failed;

  atomic_ullong outcomes[OUT_N];
  atomic_ullong codes[N_CODES + 1]; /* the last: any other status */
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
} S;

static void count_code(int status) {
  for (int i = 0; i < N_CODES; i++)
    if (status_codes[i] == status) {
      atomic_fetch_add(&S.codes[i], 1);
      return;
    }
  atomic_fetch_add(&S.codes[N_CODES], 1);
}

static job **job_slot(uint64_t id) {
  job **p = &S.table[id % JOB_BUCKETS];
  while (*p && (*p)->id != id)
    p = &(*p)->next;
  return p;
}

/* Under srv.mu. */
static void job_unref(job *j) {
  if (--j->refs > 0) return;
  pthread_cond_destroy(&j->cv);
  free(j->toks);
  free(j);
}

/* Engine thread: hands events to their jobs. */
static void route(const lf_event *ev, int n) {
  pthread_mutex_lock(&S.mu);
  for (int i = 0; i < n; i++) {
    job **slot = job_slot(ev[i].id);
    job *j = *slot;
    if (!j) continue;
    if (ev[i].type == LF_EVENT_TOKEN) {
      if (j->n_toks == j->cap_toks) {
        int cap = j->cap_toks ? 2 * j->cap_toks : 16;
        int32_t *p = realloc(j->toks, sizeof *p * (size_t)cap);
        if (!p) {
          /* Cannot keep the token: end the request rather than return a hole in its text. */
          lf_engine_cancel(S.e, j->id);
          continue;
        }
        j->toks = p;
        j->cap_toks = cap;
      }
      j->toks[j->n_toks++] = ev[i].token;
    } else {
      j->finished = 1;
      j->reason = ev[i].reason;
      j->status = ev[i].status;
      j->have_stats = lf_engine_request_stats(S.e, j->id, &j->stats) == LF_OK;
      int o = j->text_stop                       ? OUT_STOP
              : j->reason == LF_FINISH_LENGTH    ? OUT_LENGTH
              : j->reason == LF_FINISH_ERROR     ? OUT_ERROR
              : j->reason == LF_FINISH_CANCELLED ? OUT_DISCONNECT
                                                 : OUT_STOP;
      j->outcome = o;
      atomic_fetch_add(&S.outcomes[o], 1);
      *slot = j->next;
      S.n_jobs--;
      pthread_cond_broadcast(&j->cv);
      job_unref(j);
      continue;
    }
    pthread_cond_broadcast(&j->cv);
  }
  pthread_mutex_unlock(&S.mu);
}

/* The engine thread. Under mpirun the other ranks follow the descriptors rank 0 broadcasts from
 * inside lf_engine_step; see main(). */
static void *engine_main(void *arg) {
  (void)arg;
  enum { CAP = 1024 };
  lf_event *ev = malloc(sizeof *ev * CAP);
  if (!ev) {
    fprintf(stderr, "lfserve: out of memory in the engine thread\n");
    return NULL;
  }
  for (;;) {
    pthread_mutex_lock(&S.mu);
    while (!(S.stopping == 2) && !lf_engine_busy(S.e)) {
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_nsec += 200 * 1000 * 1000;
      if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
      pthread_cond_timedwait(&S.work_cv, &S.mu, &ts);
    }
    const int stop = S.stopping == 2;
    pthread_mutex_unlock(&S.mu);
    if (stop) break;
    int n = 0;
    lf_status s = lf_engine_step(S.e, ev, CAP, &n);
    pthread_mutex_lock(&S.mu);
    S.last_step_failed = s != LF_OK;
    pthread_mutex_unlock(&S.mu);
    if (s != LF_OK) {
      /* Under mpirun a failed rank ends tensor-parallel serving (later steps return
       * LF_ERR_STATE); /health then reports 503 and the operator restarts the job. */
      fprintf(stderr, "lfserve: engine step failed: %s: %s\n", lf_status_str(s), lf_last_error());
      pthread_mutex_lock(&S.mu);
      S.step_errors++;
      pthread_mutex_unlock(&S.mu);
      if (n == 0) usleep(10000);
    }
    route(ev, n);
  }
  free(ev);
  return NULL;
}

/* ---- connections -------------------------------------------------------------------------- */

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

static void conn_release_job(conn *c) {
  if (!c->j) return;
  pthread_mutex_lock(&S.mu);
  if (!c->j->finished) lf_engine_cancel(S.e, c->j->id); /* the client went away */
  job_unref(c->j);
  pthread_mutex_unlock(&S.mu);
  c->j = NULL;
}

static void conn_unref(conn *c) {
  if (atomic_fetch_sub(&c->refs, 1) != 1) return;
  conn_release_job(c);
  lfs_buf_free(&c->body);
  lfs_buf_free(&c->out);
  lfs_buf_free(&c->emit);
  lfs_stopper_free(&c->stop);
  lf_tok_text_free(&c->text);
  if (c->have_stream) lf_tok_stream_free(&c->ts);
  lfs_request_free(&c->rq);
  free(c->taken);
  free(c);
}

/* 1 when the peer has closed its end (or the socket failed). */
static int peer_gone(int fd) {
  if (fd < 0) return 0;
  struct pollfd p = {.fd = fd, .events = POLLIN | POLLRDHUP};
  if (poll(&p, 1, 0) <= 0) return 0;
  if (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return 1;
  if (p.revents & POLLIN) {
    char b;
    ssize_t r = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (r == 0) return 1;
    if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return 1;
  }
  return 0;
}

static MHD_Result_t send_buf(struct MHD_Connection *mc, int status, const char *ctype, lfs_buf *b,
                             const char *retry_after) {
  if (b->oom) {
    lfs_buf_clear(b);
    b->oom = 0;
    lfs_buf_puts(b, "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\","
                    "\"param\":null,\"code\":\"out_of_memory\"}}");
    status = 500;
    ctype = "application/json";
  }
  struct MHD_Response *r = MHD_create_response_from_buffer(b->len, b->data ? b->data : (char *)"",
                                                           MHD_RESPMEM_MUST_COPY);
  if (!r) return MHD_NO;
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
  if (retry_after) MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, retry_after);
  MHD_Result_t ret = MHD_queue_response(mc, (unsigned)status, r);
  MHD_destroy_response(r);
  count_code(status);
  return ret;
}

static void error_json(lfs_buf *b, const lfs_error *e) {
  lfs_buf_puts(b, "{\"error\":{\"message\":");
  lfs_buf_json_cstr(b, e->message);
  lfs_buf_puts(b, ",\"type\":");
  lfs_buf_json_cstr(b, e->type);
  lfs_buf_puts(b, ",\"param\":");
  lfs_buf_json_cstr(b, e->param[0] ? e->param : NULL);
  lfs_buf_puts(b, ",\"code\":");
  lfs_buf_json_cstr(b, e->code);
  lfs_buf_puts(b, "}}");
}

static MHD_Result_t send_error(struct MHD_Connection *mc, const lfs_error *e,
                               const char *retry_after) {
  lfs_buf b = {0};
  error_json(&b, e);
  if (e->status >= 400 && e->status < 500 && e->status != 429)
    atomic_fetch_add(&S.outcomes[OUT_INVALID], 1);
  MHD_Result_t r = send_buf(mc, e->status, "application/json", &b, retry_after);
  lfs_buf_free(&b);
  return r;
}

static MHD_Result_t reply_error(struct MHD_Connection *mc, int status, const char *type,
                                const char *code, const char *msg) {
  lfs_error e;
  lfs_error_set(&e, status, type, code, NULL, "%s", msg);
  return send_error(mc, &e, NULL);
}

static const char *finish_str(lf_finish_reason r) {
  switch (r) {
  case LF_FINISH_LENGTH:
    return "length";
  case LF_FINISH_CANCELLED:
    return "abort";
  case LF_FINISH_ERROR:
    return "error";
  default:
    return "stop";
  }
}

/* The error a failed generation reports. */
static void finish_error(const job *j, lfs_error *e) {
  if (j->status == LF_ERR_CONTEXT_FULL)
    lfs_error_set(e, 400, "invalid_request_error", "context_length_exceeded", NULL,
                  "the sequence outgrew its KV pool under the full policy");
  else if (j->reason == LF_FINISH_CANCELLED)
    lfs_error_set(e, 503, "server_error", "cancelled", NULL, "the request was cancelled");
  else
    lfs_error_set(e, 500, "server_error", "generation_failed", NULL, "generation failed: %s",
                  lf_status_str(j->status));
}

static void put_usage(lfs_buf *b, const conn *c, const job *j) {
  /* After a stop string the job may still be running: only c's own count is safe to read. */
  const int completion = !c->text_stopped && j->have_stats ? j->stats.generated_tokens : c->n_out;
  lfs_buf_printf(b, "{\"prompt_tokens\":%d,\"completion_tokens\":%d,\"total_tokens\":%d}",
                 c->rq.n_prompt, completion, c->rq.n_prompt + completion);
}

static void put_ids(lfs_buf *b, const int32_t *ids, int n) {
  lfs_buf_puts(b, "[");
  for (int i = 0; i < n; i++)
    lfs_buf_printf(b, i ? ",%d" : "%d", ids[i]);
  lfs_buf_puts(b, "]");
}

/* The common head of a response object / stream chunk. */
static void put_head(lfs_buf *b, const conn *c, int chunk) {
  lfs_buf_puts(b, "{\"id\":");
  lfs_buf_json_cstr(b, c->cid);
  lfs_buf_printf(b, ",\"object\":\"%s\",\"created\":%lld,\"model\":",
                 c->chat ? (chunk ? "chat.completion.chunk" : "chat.completion")
                         : "text_completion",
                 c->created);
  lfs_buf_json_cstr(b, S.model_name);
}

/* One SSE chunk carrying text (and ids), or the final one (finish != NULL). */
static void put_chunk(conn *c, const char *text, size_t len, const int32_t *ids, int n_ids,
                      const char *finish) {
  lfs_buf *b = &c->out;
  lfs_buf_puts(b, "data: ");
  put_head(b, c, 1);
  lfs_buf_puts(b, ",\"choices\":[{\"index\":0,");
  if (c->chat) {
    lfs_buf_puts(b, "\"delta\":{");
    if (!c->first_chunk_sent) lfs_buf_puts(b, "\"role\":\"assistant\"");
    if (!finish || len || !c->first_chunk_sent) {
      if (!c->first_chunk_sent) lfs_buf_puts(b, ",");
      lfs_buf_puts(b, "\"content\":");
      lfs_buf_json_str(b, text, len);
    }
    lfs_buf_puts(b, "}");
  } else {
    lfs_buf_puts(b, "\"text\":");
    lfs_buf_json_str(b, text, len);
  }
  if (c->rq.return_token_ids || !S.tok) {
    lfs_buf_puts(b, ",\"token_ids\":");
    put_ids(b, ids, n_ids);
  }
  lfs_buf_puts(b, ",\"logprobs\":null,\"finish_reason\":");
  lfs_buf_json_cstr(b, finish);
  /* Usage goes only in the separate final chunk that stream_options.include_usage asks for,
   * as OpenAI sends it: clients that sum usage over chunks count it once. */
  lfs_buf_puts(b, "}]}\n\n");
  c->first_chunk_sent = 1;
}

/* A stop string matched: the request is cancelled at once so its pool returns at the engine's
 * next step; it finishes as a stop, whatever the engine reports. */
static void text_stop_cancel(conn *c) {
  pthread_mutex_lock(&S.mu);
  job *j = c->j;
  j->text_stop = 1;
  if (!j->finished) {
    lf_engine_cancel(S.e, j->id);
  } else if (j->outcome != OUT_STOP) { /* it ended (length) before we read that far */
    atomic_fetch_sub(&S.outcomes[j->outcome], 1);
    atomic_fetch_add(&S.outcomes[OUT_STOP], 1);
    j->outcome = OUT_STOP;
  }
  pthread_mutex_unlock(&S.mu);
}

/* Decodes one token (tok >= 0) or the decoder's final flush (tok < 0) and passes the text
 * through the stop strings; c->emit is what may be sent. Returns 1 when a stop string matched
 * (c->emit ends exactly before it; the request has been cancelled). */
static int text_of(conn *c, int32_t tok) {
  lfs_buf_clear(&c->emit);
  if (!S.tok || c->text_stopped) return c->text_stopped;
  lf_tok_text_clear(&c->text);
  lf_status s =
      tok >= 0 ? lf_tok_stream_put(&c->ts, tok, &c->text) : lf_tok_stream_flush(&c->ts, &c->text);
  if (s != LF_OK) return 0;
  const int r = lfs_stopper_put(&c->stop, c->text.data, c->text.len, &c->emit);
  if (r < 0) c->out.oom = 1; /* the stream ends with an error */
  if (r != 1) return 0;
  c->text_stopped = 1;
  text_stop_cancel(c);
  return 1;
}

/* The final chunk (text, finish_reason), the usage chunk when asked for, [DONE]. */
static void stream_end(conn *c, const char *text, size_t len, const char *finish, const job *j) {
  put_chunk(c, text, len, NULL, 0, finish);
  if (c->rq.include_usage) {
    lfs_buf_puts(&c->out, "data: ");
    put_head(&c->out, c, 1);
    lfs_buf_puts(&c->out, ",\"choices\":[],\"usage\":");
    put_usage(&c->out, c, j);
    lfs_buf_puts(&c->out, "}\n\n");
  }
  lfs_buf_puts(&c->out, "data: [DONE]\n\n");
  c->done = 1;
}

/* An error event and [DONE]: the server is stopping and the request cannot finish. */
static void stream_abort(conn *c) {
  if (c->done) return;
  lfs_error e;
  lfs_error_set(&e, 503, "server_error", "shutting_down", NULL,
                "the server is shutting down (the engine stopped): the output is incomplete");
  lfs_buf_puts(&c->out, "data: ");
  error_json(&c->out, &e);
  lfs_buf_puts(&c->out, "\n\ndata: [DONE]\n\n");
  c->done = 1;
}

/* Formats what the job handed over: one chunk per token (held-back partial UTF-8 characters, and
 * text that may begin a stop string, go out with the token that completes or rules them out),
 * then the end. A stop string ends the stream at once, cut exactly before it. */
static void stream_format(conn *c, const int32_t *toks, int n, int finished, const job *j) {
  if (c->done) return;
  for (int i = 0; i < n; i++) {
    const int stopped = text_of(c, toks[i]);
    c->n_out++;
    if (stopped) {
      if (c->emit.len || c->rq.return_token_ids || !S.tok)
        put_chunk(c, c->emit.data ? c->emit.data : "", c->emit.len, toks + i, 1, NULL);
      stream_end(c, "", 0, "stop", j);
      return;
    }
    if (c->emit.len == 0 && S.tok && !c->rq.return_token_ids) continue;
    put_chunk(c, c->emit.data ? c->emit.data : "", c->emit.len, toks + i, 1, NULL);
  }
  if (!finished) return;
  if (j->reason == LF_FINISH_ERROR) {
    lfs_error e;
    finish_error(j, &e);
    lfs_buf_puts(&c->out, "data: ");
    error_json(&c->out, &e);
    lfs_buf_puts(&c->out, "\n\n");
    lfs_buf_puts(&c->out, "data: [DONE]\n\n");
    c->done = 1;
    return;
  }
  const int stopped = text_of(c, -1); /* the decoder's last bytes may complete a stop string */
  if (!stopped) lfs_stopper_flush(&c->stop, &c->emit);
  stream_end(c, c->emit.data ? c->emit.data : "", c->emit.len,
             stopped ? "stop" : finish_str(j->reason), j);
}

/* Waits (under srv.mu) until the job has news, the peer is gone or the server stops.
 * Returns 0 with news, -1 when the peer is gone or the server has stopped, 1 when the server is
 * stopping and the connection must end the request itself (the engine cannot). */
static int wait_job(conn *c) {
  job *j = c->j;
  /* Tokens may keep arriving (no timeout ever fires): look at the socket every 200 ms anyway. */
  const double t = lf_now_s();
  if (t - c->last_peer_check > 0.2) {
    c->last_peer_check = t;
    pthread_mutex_unlock(&S.mu);
    const int gone = peer_gone(c->fd);
    pthread_mutex_lock(&S.mu);
    if (gone) return -1;
  }
  while (j->n_toks == 0 && !j->finished) {
    if (S.streams_abort) return 1;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 200 * 1000 * 1000;
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    if (pthread_cond_timedwait(&j->cv, &S.mu, &ts) == ETIMEDOUT) {
      if (S.stopping == 2) return -1;
      pthread_mutex_unlock(&S.mu);
      const int gone = peer_gone(c->fd);
      pthread_mutex_lock(&S.mu);
      if (gone) return -1;
    }
  }
  return 0;
}

/* Takes the job's tokens into c->taken; returns how many. Under srv.mu. */
static int take_tokens(conn *c) {
  job *j = c->j;
  int n = j->n_toks;
  if (n > c->cap_taken) {
    /* Swap buffers instead of copying: the job gets our (smaller) one back. */
    int32_t *t = c->taken;
    int cap = c->cap_taken;
    c->taken = j->toks;
    c->cap_taken = j->cap_toks;
    j->toks = t;
    j->cap_toks = cap;
  } else if (n > 0) {
    memcpy(c->taken, j->toks, sizeof(int32_t) * (size_t)n);
  }
  j->n_toks = 0;
  return n;
}

static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max) {
  (void)pos;
  conn *c = cls;
  for (;;) {
    if (c->out.len) {
      size_t n = c->out.len < max ? c->out.len : max;
      memcpy(buf, c->out.data, n);
      lfs_buf_consume(&c->out, n);
      return (ssize_t)n;
    }
    if (c->done || c->out.oom || !c->j)
      return c->done && !c->out.oom ? MHD_CONTENT_READER_END_OF_STREAM
                                    : MHD_CONTENT_READER_END_WITH_ERROR;
    /* The wait (a queued request may wait minutes) would count as idleness to libmicrohttpd,
     * which closes the connection on our return once --timeout has passed since its last
     * activity, after the headers went out. So the timeout is off while we wait (the server,
     * not the client, is the slow one then) and set again after: libmicrohttpd restarts its
     * timer only when a timeout is set on a connection that had none (setting the same value
     * again leaves the old start in place). */
    MHD_set_connection_option(c->mc, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    pthread_mutex_lock(&S.mu);
    const int gone = wait_job(c);
    const int n = gone ? 0 : take_tokens(c);
    const int finished = !gone && c->j->finished && c->j->n_toks == 0;
    pthread_mutex_unlock(&S.mu);
    MHD_set_connection_option(c->mc, MHD_CONNECTION_OPTION_TIMEOUT, S.timeout_s);
    if (gone < 0) return MHD_CONTENT_READER_END_WITH_ERROR; /* conn_unref cancels the request */
    if (gone > 0) {
      /* The server is going down with the engine stuck (a rank died; the launcher is ending
       * the job): end the stream properly while the process still can. */
      stream_abort(c);
      continue;
    }
    /* After finished is seen, the job is only read: the engine thread is done with it. */
    stream_format(c, c->taken, n, finished, c->j);
  }
}

static void stream_free(void *cls) {
  atomic_fetch_sub(&S.open_streams, 1);
  conn_unref(cls);
}

/* A whole (non-streaming) completion: waits for the end, then one JSON body. */
static MHD_Result_t complete_blocking(conn *c) {
  int32_t *all = NULL;
  int n_all = 0, cap_all = 0;
  /* With stop strings the text is decoded as the tokens arrive, so a match ends the request at
   * once; without, it is decoded in one go at the end. */
  const int incremental = S.tok && c->rq.n_stop_strs > 0;
  lfs_buf txt = {0};
  MHD_set_connection_option(c->mc, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
  for (;;) {
    pthread_mutex_lock(&S.mu);
    const int gone = wait_job(c);
    if (gone) {
      pthread_mutex_unlock(&S.mu);
      free(all);
      lfs_buf_free(&txt);
      if (gone > 0)
        return reply_error(c->mc, 503, "server_error", "shutting_down",
                           "the server is shutting down (the engine stopped)");
      return MHD_NO; /* closes the connection; conn_unref cancels the request */
    }
    job *j = c->j;
    if (n_all + j->n_toks > cap_all) {
      int cap = cap_all ? cap_all : 64;
      while (cap < n_all + j->n_toks)
        cap *= 2;
      int32_t *p = realloc(all, sizeof *p * (size_t)cap);
      if (!p) {
        pthread_mutex_unlock(&S.mu);
        free(all);
        lfs_buf_free(&txt);
        return reply_error(c->mc, 500, "server_error", "out_of_memory", "out of memory");
      }
      all = p;
      cap_all = cap;
    }
    if (j->n_toks) memcpy(all + n_all, j->toks, sizeof(int32_t) * (size_t)j->n_toks);
    const int from = n_all;
    n_all += j->n_toks;
    j->n_toks = 0;
    const int finished = j->finished;
    pthread_mutex_unlock(&S.mu);
    if (incremental) {
      for (int i = from; i < n_all; i++) {
        const int stopped = text_of(c, all[i]);
        lfs_buf_put(&txt, c->emit.data, c->emit.len);
        if (stopped) {
          n_all = i + 1; /* tokens past the one that completed the stop string are dropped */
          break;
        }
      }
      if (c->text_stopped) break;
    }
    if (finished) break;
  }
  MHD_set_connection_option(c->mc, MHD_CONNECTION_OPTION_TIMEOUT, S.timeout_s);
  const job *j = c->j;
  c->n_out = n_all;
  /* After a stop string the job may still be running: its fields are not read then. */
  if (!c->text_stopped && (j->reason == LF_FINISH_ERROR || j->reason == LF_FINISH_CANCELLED)) {
    free(all);
    lfs_buf_free(&txt);
    lfs_error e;
    finish_error(j, &e);
    return send_error(c->mc, &e, NULL);
  }
  lf_tok_text text = {0};
  if (incremental) {
    if (!c->text_stopped) {
      text_of(c, -1); /* the decoder's last bytes may still complete a stop string */
      lfs_buf_put(&txt, c->emit.data, c->emit.len);
      lfs_buf_clear(&c->emit);
      lfs_stopper_flush(&c->stop, &c->emit);
      lfs_buf_put(&txt, c->emit.data, c->emit.len);
    }
    if (txt.oom || lf_tok_text_append(&text, txt.data ? txt.data : "", txt.len) != LF_OK) {
      free(all);
      lfs_buf_free(&txt);
      lf_tok_text_free(&text);
      return reply_error(c->mc, 500, "server_error", "out_of_memory", "out of memory");
    }
    lfs_buf_free(&txt);
  } else if (S.tok &&
             lf_tokenizer_decode(S.tok, all, (size_t)n_all, LF_TOK_SKIP_SPECIAL, &text) != LF_OK) {
    lf_tok_text_clear(&text);
  }
  lfs_buf b = {0};
  put_head(&b, c, 0);
  lfs_buf_puts(&b, ",\"choices\":[{\"index\":0,");
  if (c->chat) {
    lfs_buf_puts(&b, "\"message\":{\"role\":\"assistant\",\"content\":");
    lfs_buf_json_str(&b, text.data ? text.data : "", text.len);
    lfs_buf_puts(&b, "}");
  } else {
    lfs_buf_puts(&b, "\"text\":");
    lfs_buf_json_str(&b, text.data ? text.data : "", text.len);
  }
  if (c->rq.return_token_ids || !S.tok) {
    lfs_buf_puts(&b, ",\"token_ids\":");
    put_ids(&b, all, n_all);
  }
  lfs_buf_puts(&b, ",\"logprobs\":null,\"finish_reason\":");
  lfs_buf_json_cstr(&b, c->text_stopped ? "stop" : finish_str(j->reason));
  lfs_buf_puts(&b, "}],\"usage\":");
  put_usage(&b, c, j);
  lfs_buf_puts(&b, "}");
  MHD_Result_t r = send_buf(c->mc, 200, "application/json", &b, NULL);
  lfs_buf_free(&b);
  lf_tok_text_free(&text);
  free(all);
  return r;
}

static MHD_Result_t handle_completion(conn *c, int chat) {
  lfs_error err;
  c->chat = chat;
  if (lfs_request_parse(&S.mctx, chat, c->body.data ? c->body.data : "", c->body.len, &c->rq, &err))
    return send_error(c->mc, &err, NULL);
  lfs_buf_free(&c->body);

  lf_request rq;
  memset(&rq, 0, sizeof rq);
  rq.prompt = c->rq.prompt;
  rq.n_prompt = c->rq.n_prompt;
  rq.max_tokens = c->rq.max_tokens;
  rq.sampling = c->rq.sampling;
  rq.ignore_eos = c->rq.ignore_eos;
  rq.stop_ids = c->rq.stop_ids;
  rq.n_stop_ids = c->rq.n_stop_ids;
  rq.stop_seqs = c->rq.stop_seqs;
  rq.n_stop_seqs = c->rq.n_stop_seqs;

  job *j = calloc(1, sizeof *j);
  if (!j || pthread_cond_init(&j->cv, NULL)) {
    free(j);
    return reply_error(c->mc, 500, "server_error", "out_of_memory", "out of memory");
  }
  pthread_mutex_lock(&S.mu);
  if (S.stopping) {
    pthread_mutex_unlock(&S.mu);
    pthread_cond_destroy(&j->cv);
    free(j);
    return reply_error(c->mc, 503, "server_error", "shutting_down", "the server is shutting down");
  }
  uint64_t id;
  lf_status s = lf_engine_submit(S.e, &rq, &id);
  if (s == LF_OK) {
    j->id = id;
    j->refs = 2;
    job **slot = job_slot(id);
    j->next = *slot;
    *slot = j;
    S.n_jobs++;
    pthread_cond_signal(&S.work_cv);
  }
  pthread_mutex_unlock(&S.mu);
  if (s != LF_OK) {
    pthread_cond_destroy(&j->cv);
    free(j);
    if (s == LF_ERR_QUEUE_FULL) {
      atomic_fetch_add(&S.outcomes[OUT_REJECTED], 1);
      lfs_error_set(&err, 429, "server_overloaded", "queue_full", NULL,
                    "the request queue is full; retry later");
      return send_error(c->mc, &err, "1");
    }
    if (s == LF_ERR_INVALID_ARG) {
      lfs_error_set(&err, 400, "invalid_request_error", "invalid_value", NULL, "%s",
                    lf_last_error());
      return send_error(c->mc, &err, NULL);
    }
    lfs_error_set(&err, 500, "server_error", "submit_failed", NULL, "%s: %s", lf_status_str(s),
                  lf_last_error());
    return send_error(c->mc, &err, NULL);
  }
  c->j = j;
  snprintf(c->cid, sizeof c->cid, "%s-%llu", chat ? "chatcmpl" : "cmpl", (unsigned long long)id);
  c->created = (long long)time(NULL);

  lfs_stopper_init(&c->stop, c->rq.stop_strs, c->rq.n_stop_strs);
  if (S.tok) {
    if (lf_tok_stream_init(&c->ts, S.tok, LF_TOK_SKIP_SPECIAL) != LF_OK)
      return reply_error(c->mc, 500, "server_error", "out_of_memory", "out of memory");
    c->have_stream = 1;
  }
  if (!c->rq.stream) return complete_blocking(c);
  struct MHD_Response *r =
      MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_reader, c, stream_free);
  if (!r) return MHD_NO;
  atomic_fetch_add(&c->refs, 1);
  atomic_fetch_add(&S.open_streams, 1);
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
  MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
  MHD_Result_t ret = MHD_queue_response(c->mc, MHD_HTTP_OK, r);
  MHD_destroy_response(r);
  count_code(200);
  return ret;
}

/* ---- GET endpoints ------------------------------------------------------------------------ */

static MHD_Result_t handle_models(struct MHD_Connection *mc) {
  lfs_buf b = {0};
  lfs_buf_puts(&b, "{\"object\":\"list\",\"data\":[{\"id\":");
  lfs_buf_json_cstr(&b, S.model_name);
  lfs_buf_printf(&b,
                 ",\"object\":\"model\",\"created\":%lld,\"owned_by\":\"lfserve\","
                 "\"max_model_len\":%d,\"kv_budget\":%d,\"policy\":\"%s\"}]}",
                 (long long)S.started, S.mi.max_seq_len, S.budget, lf_policy_str(S.policy));
  MHD_Result_t r = send_buf(mc, 200, "application/json", &b, NULL);
  lfs_buf_free(&b);
  return r;
}

static MHD_Result_t handle_health(struct MHD_Connection *mc) {
  lfs_buf b = {0};
  pthread_mutex_lock(&S.mu);
  const int stopping = S.stopping, failed = S.last_step_failed;
  pthread_mutex_unlock(&S.mu);
  lfs_buf_puts(&b, stopping ? "{\"status\":\"stopping\"}"
                   : failed ? "{\"status\":\"engine_failed\"}"
                            : "{\"status\":\"ok\"}");
  MHD_Result_t r = send_buf(mc, stopping || failed ? 503 : 200, "application/json", &b, NULL);
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

static MHD_Result_t handle_metrics(struct MHD_Connection *mc) {
  lf_metrics m;
  if (lf_engine_metrics(S.e, &m) != LF_OK)
    return reply_error(mc, 500, "server_error", "metrics_failed", lf_last_error());
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
  for (int r = LF_FINISH_EOS; r <= LF_FINISH_STOP; r++)
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
#undef GAUGE
#undef COUNTER
  MHD_Result_t r = send_buf(mc, 200, "text/plain; version=0.0.4; charset=utf-8", &b, NULL);
  lfs_buf_free(&b);
  return r;
}

/* Accepted sockets beyond --max-connections, kept for /health and /metrics: libmicrohttpd's own
 * limit is this much higher, and completions are refused (503) beyond --max-connections. */
#define CONN_RESERVE 16u

static void on_connection(void *cls, struct MHD_Connection *mc, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe) {
  (void)cls;
  if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
    struct sock *k = calloc(1, sizeof *k);
    *socket_context = k;
    if (!k) return;
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(mc, MHD_CONNECTION_INFO_CONNECTION_FD);
    k->fd = ci ? ci->connect_fd : -1;
    pthread_mutex_lock(&S.cmu);
    struct sock *tail = S.socks ? S.socks->prev : NULL; /* circular: head->prev is the tail */
    if (!tail) {
      S.socks = k->prev = k->next = k;
    } else {
      k->prev = tail;
      k->next = S.socks;
      tail->next = k;
      S.socks->prev = k;
    }
    S.n_socks++;
    /* Over the limit: shut down the oldest idle socket (nothing sent yet, or a keep-alive
     * connection between requests). Its thread sees the end of the stream and closes it. */
    if ((unsigned)S.n_socks > S.max_conn) {
      struct sock *o = S.socks;
      do {
        if (o != k && !o->busy && !o->shed && o->fd >= 0) {
          o->shed = 1;
          S.n_shed++;
          shutdown(o->fd, SHUT_RDWR);
          break;
        }
        o = o->next;
      } while (o != S.socks);
    }
    pthread_mutex_unlock(&S.cmu);
  } else if (toe == MHD_CONNECTION_NOTIFY_CLOSED) {
    struct sock *k = *socket_context;
    *socket_context = NULL;
    if (!k) return;
    pthread_mutex_lock(&S.cmu);
    if (k->next == k) {
      S.socks = NULL;
    } else {
      k->prev->next = k->next;
      k->next->prev = k->prev;
      if (S.socks == k) S.socks = k->next;
    }
    S.n_socks--;
    if (k->shed) S.n_shed--;
    pthread_mutex_unlock(&S.cmu);
    free(k);
  }
}

/* Marks the socket of mc busy (a request is in progress) or idle. */
static void sock_busy(struct MHD_Connection *mc, int busy) {
  const union MHD_ConnectionInfo *ci =
      MHD_get_connection_info(mc, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
  struct sock *k = ci ? ci->socket_context : NULL;
  if (!k) return;
  pthread_mutex_lock(&S.cmu);
  k->busy = busy;
  pthread_mutex_unlock(&S.cmu);
}

/* ---- the libmicrohttpd callbacks ---------------------------------------------------------- */

static MHD_Result_t reply_too_large(struct MHD_Connection *mc) {
  char msg[96];
  snprintf(msg, sizeof msg, "the request body exceeds the limit of %zu bytes", S.max_body);
  return reply_error(mc, 413, "invalid_request_error", "request_too_large", msg);
}

static MHD_Result_t on_request(void *cls, struct MHD_Connection *mc, const char *url,
                               const char *method, const char *version, const char *upload,
                               size_t *upload_size, void **con_cls) {
  (void)cls;
  (void)version;
  conn *c = *con_cls;
  if (!c) {
    c = calloc(1, sizeof *c);
    if (!c) return MHD_NO;
    atomic_init(&c->refs, 1);
    c->mc = mc;
    c->fd = -1;
    sock_busy(mc, 1);
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(mc, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (ci) c->fd = ci->connect_fd;
    *con_cls = c;
    const char *cl =
        MHD_lookup_connection_value(mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl) {
      char *end;
      errno = 0;
      unsigned long long n = strtoull(cl, &end, 10);
      if (errno || *end || n > S.max_body) c->too_large = 1;
    }
    if (!c->too_large) return MHD_YES;
    /* Refuse at once: the connection closes after the reply, the body is never read. */
    c->replied = 1;
    return reply_too_large(mc);
  }
  if (*upload_size) {
    /* A body without Content-Length that outgrows the limit: read and drop the rest (a reply
     * cannot be queued mid-upload), up to a bound past which the connection is just closed. */
    if (!c->too_large && c->body.len + *upload_size > S.max_body) {
      c->too_large = 1;
      lfs_buf_free(&c->body);
    }
    if (c->too_large) {
      c->dropped += *upload_size;
      if (c->dropped > 4 * S.max_body + (1u << 20)) return MHD_NO;
    } else if (!c->replied) {
      lfs_buf_put(&c->body, upload, *upload_size);
    }
    *upload_size = 0;
    return MHD_YES;
  }
  if (c->replied) return MHD_YES;
  c->replied = 1;
  if (c->too_large) return reply_too_large(mc);

  const int get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
  const int post = !strcmp(method, "POST");
  const int is_cmpl = !strcmp(url, "/v1/completions");
  const int is_chat = !strcmp(url, "/v1/chat/completions");
  const int is_get =
      !strcmp(url, "/v1/models") || !strcmp(url, "/health") || !strcmp(url, "/metrics");
  if (c->body.oom) return reply_error(mc, 500, "server_error", "out_of_memory", "out of memory");
  if (is_cmpl || is_chat) {
    if (!post)
      return reply_error(mc, 405, "invalid_request_error", "method_not_allowed",
                         "use POST for this endpoint");
    pthread_mutex_lock(&S.cmu);
    const int over = (unsigned)(S.n_socks - S.n_shed) > S.max_conn;
    pthread_mutex_unlock(&S.cmu);
    if (over) { /* the sockets beyond the limit are kept for /health and /metrics */
      lfs_error e;
      lfs_error_set(&e, 503, "server_error", "too_many_connections", NULL,
                    "the server is at its connection limit; retry later");
      return send_error(mc, &e, "1");
    }
    return handle_completion(c, is_chat);
  }
  if (is_get) {
    if (!get)
      return reply_error(mc, 405, "invalid_request_error", "method_not_allowed",
                         "use GET for this endpoint");
    if (!strcmp(url, "/v1/models")) return handle_models(mc);
    if (!strcmp(url, "/health")) return handle_health(mc);
    return handle_metrics(mc);
  }
  return reply_error(mc, 404, "invalid_request_error", "not_found", "no such endpoint");
}

static void on_completed(void *cls, struct MHD_Connection *mc, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
  (void)cls;
  (void)toe;
  conn *c = *con_cls;
  *con_cls = NULL;
  sock_busy(mc, 0);
  if (c) conn_unref(c);
}

/* ---- main --------------------------------------------------------------------------------- */

static void usage(FILE *f) {
  fprintf(f,
          "usage: lfserve --model DIR [options]\n"
          "  --model PATH            HF model directory or GGUF file (its tokenizer for text prompts)\n"
          "  --served-model-name S   the model id clients use (default: the directory's name)\n"
          "  --host ADDR             IPv4 address to listen on (default 0.0.0.0)\n"
          "  --port N                (default 8000; 0 picks a free port, printed at start)\n"
          "  --budget B              KV slots per sequence (default: the model's context)\n"
          "  --policy P              longflow | full | streaming | h2o (default longflow)\n"
          "  --sink S  --window W    eviction sinks / prefill window (defaults 4, 32)\n"
          "  --pools N               concurrent sequences (default: from --kv-memory-gb, else 1)\n"
          "  --kv-memory-gb G        memory for KV pools when --pools is not given\n"
          "  --max-queue N           waiting requests before 429 (default 1024)\n"
          "  --max-batch-tokens N    prompt tokens per step (default 0 = whole prompts)\n"
          "  --backend B             auto | cpu | cuda (default auto)\n"
          "  --threads N             cpu backend threads (default: all)\n"
          "  --max-body BYTES        request body limit (default 8388608), 413 beyond\n"
          "  --timeout S             idle connection timeout in seconds (default 30)\n"
          "  --max-connections N     (default 1024)\n"
          "  --chat-template NAME    chatml | llama3 | deepseek-r1: render chat with this built-in\n"
          "                          template (default: the model's own; without one chat is off)\n"
          "  --chat-content-special  read special-token text inside chat message content as\n"
          "                          real markers, as Hugging Face's apply_chat_template does\n"
          "                          (default: content is plain text)\n");
}


static int parse_long(const char *s, long lo, long hi, long *out) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi) return -1;
  *out = v;
  return 0;
}

int main(int argc, char **argv) {
  lf_engine_config cfg;
  lf_engine_config_default(&cfg);
  cfg.max_queue = 1024;
  const char *host = "0.0.0.0", *name = NULL;
  long port = 8000, max_conn = 1024, timeout = 30, max_body = 8L << 20;
  int chat_content_special = 0;
  const char *chat_template = NULL;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    long n;
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage(stdout);
      return 0;
    }
    if (!strcmp(a, "--chat-content-special")) {
      chat_content_special = 1;
      continue;
    }
    if (!v) {
      fprintf(stderr, "lfserve: unknown option or missing value: %s\n", a);
      usage(stderr);
      return 2;
    }
    i++;
    if (!strcmp(a, "--model"))
      cfg.model_path = v;
    else if (!strcmp(a, "--served-model-name"))
      name = v;
    else if (!strcmp(a, "--host"))
      host = v;
    else if (!strcmp(a, "--chat-template")) {
      lf_chat_format f;
      if (lf_chat_format_parse(v, &f) != LF_OK) goto bad;
      chat_template = v;
    }
    else if (!strcmp(a, "--port")) {
      if (parse_long(v, 0, 65535, &port)) goto bad;
    } else if (!strcmp(a, "--budget")) {
      if (parse_long(v, 1, INT_MAX, &n)) goto bad;
      cfg.budget = (int)n;
    } else if (!strcmp(a, "--sink")) {
      if (parse_long(v, 0, INT_MAX, &n)) goto bad;
      cfg.sink = (int)n;
    } else if (!strcmp(a, "--window")) {
      if (parse_long(v, 0, INT_MAX, &n)) goto bad;
      cfg.window = (int)n;
    } else if (!strcmp(a, "--pools")) {
      if (parse_long(v, 1, INT_MAX, &n)) goto bad;
      cfg.n_pools = (int)n;
    } else if (!strcmp(a, "--max-queue")) {
      if (parse_long(v, 0, INT_MAX, &n)) goto bad;
      cfg.max_queue = (int)n;
    } else if (!strcmp(a, "--max-batch-tokens")) {
      if (parse_long(v, 0, INT_MAX, &n)) goto bad;
      cfg.max_batch_tokens = (int)n;
    } else if (!strcmp(a, "--threads")) {
      if (parse_long(v, 0, 4096, &n)) goto bad;
      cfg.n_threads = (int)n;
    } else if (!strcmp(a, "--max-body")) {
      if (parse_long(v, 1, LONG_MAX, &max_body)) goto bad;
    } else if (!strcmp(a, "--timeout")) {
      if (parse_long(v, 0, 86400, &timeout)) goto bad;
    } else if (!strcmp(a, "--max-connections")) {
      if (parse_long(v, 1, 1 << 20, &max_conn)) goto bad;
    } else if (!strcmp(a, "--kv-memory-gb")) {
      char *end;
      double g = strtod(v, &end);
      if (*end || end == v || !(g > 0)) goto bad;
      cfg.kv_memory_bytes = (uint64_t)(g * 1073741824.0);
    } else if (!strcmp(a, "--policy")) {
      if (lf_policy_parse(v, &cfg.policy) != LF_OK) goto bad;
    } else if (!strcmp(a, "--backend")) {
      if (!strcmp(v, "auto"))
        cfg.backend = LF_BACKEND_AUTO;
      else if (!strcmp(v, "cpu"))
        cfg.backend = LF_BACKEND_CPU;
      else if (!strcmp(v, "cuda"))
        cfg.backend = LF_BACKEND_CUDA;
      else
        goto bad;
    } else {
      fprintf(stderr, "lfserve: unknown option '%s'\n", a);
      usage(stderr);
      return 2;
    }
    continue;
  bad:
    fprintf(stderr, "lfserve: bad value '%s' for %s\n", v, a);
    return 2;
  }
  if (!cfg.model_path) {
    fprintf(stderr, "lfserve: --model is required\n");
    usage(stderr);
    return 2;
  }

  /* SIGINT / SIGTERM are taken by sigwait in this thread only: every thread started below
   * (engine, OpenMP, libmicrohttpd) inherits the blocked mask. */
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, NULL);
  signal(SIGPIPE, SIG_IGN);

  int rc = 1;
  struct MHD_Daemon *d = NULL;
  pthread_mutex_init(&S.mu, NULL);
  pthread_cond_init(&S.work_cv, NULL);
  pthread_mutex_init(&S.cmu, NULL);
  S.started = time(NULL);
  S.timeout_s = (unsigned)timeout;
  S.max_conn = (unsigned)max_conn;
  S.max_body = (size_t)max_body;
  S.policy = cfg.policy;

  /* Under mpirun (DESIGN §4): every rank loads its shard; rank 0 serves HTTP and drives the
   * engine, the others run lf_engine_follow until rank 0 frees the engine. MPI starts here, in
   * the program, never in the library. */
  lf_comm_t comm = NULL;
  int launcher_abort = 0; /* the launcher is ending the job: MPI_Finalize would never return */
  siginfo_t si;
  memset(&si, 0, sizeof si);
  const double t0 = lf_now_s();
  lf_status s = LF_OK;
  if (lf_launched_multi_rank()) {
    s = lf_tp_start(&argc, &argv, cfg.backend, &comm);
    if (s != LF_OK) {
      fprintf(stderr, "lfserve: mpirun: %s: %s\n", lf_status_str(s), lf_last_error());
      return 1;
    }
  }
  s = lf_engine_init(&cfg, comm, &S.e);
  if (s != LF_OK) {
    fprintf(stderr, "lfserve: %s: %s\n", lf_status_str(s), lf_last_error());
    return 1;
  }
  if (lf_comm_rank(comm) != 0) {
    s = lf_engine_follow(S.e);
    if (s != LF_OK)
      fprintf(stderr, "lfserve: rank %d: %s: %s\n", lf_comm_rank(comm), lf_status_str(s),
              lf_last_error());
    const int rank = lf_comm_rank(comm), size = lf_comm_size(comm);
    lf_engine_free(S.e);
    if (s != LF_OK) return 1; /* without MPI_Finalize: the launcher ends the job */
    lf_comm_free(comm);
    /* Rank 0 released us. When the launcher is ending the job it has signalled this rank too
     * (the signal waits, blocked): skip MPI_Finalize then, as rank 0 does. */
    const struct timespec zero = {0, 0};
    launcher_abort = sigtimedwait(&sigs, &si, &zero) > 0 && si.si_pid > 0 && si.si_pid == getppid();
#ifdef LF_HAVE_MPI
    if (!launcher_abort) MPI_Finalize();
#endif
    fprintf(stderr, "lfserve: rank %d of %d: stopped%s\n", rank, size,
            launcher_abort ? " (the launcher is ending the job: MPI_Finalize skipped)" : "");
    return 0;
  }
  lf_engine_model_info(S.e, &S.mi);
  S.budget = cfg.budget ? cfg.budget : S.mi.max_seq_len;

  /* The tokenizer and chat template the model carries (HF directory or GGUF metadata). */
  char why[4200] = "", chat_state[512] = "";
  s = lf_model_tokenizer_open(cfg.model_path, &S.tok, why, sizeof why);
  if (s != LF_OK) {
    fprintf(stderr, "lfserve: %s: %s\n", lf_status_str(s), lf_last_error());
    goto out;
  }
  if (S.tok) {
    if (lf_tokenizer_vocab_size(S.tok) > S.mi.vocab_size)
      fprintf(stderr, "lfserve: warning: the tokenizer has %d ids, the model %d\n",
              lf_tokenizer_vocab_size(S.tok), S.mi.vocab_size);
    s = lf_model_chat_template_open_as(cfg.model_path, chat_template, &S.tmpl);
    if (s != LF_OK && chat_template) { /* an explicit choice that cannot be honoured */
      fprintf(stderr, "lfserve: --chat-template %s: %s\n", chat_template, lf_last_error());
      goto out;
    }
    if (s != LF_OK) {
      snprintf(chat_state, sizeof chat_state,
               "off (%s; --chat-template chatml|llama3|deepseek-r1 to choose one)",
               lf_last_error());
      S.tmpl = NULL;
    } else {
      static const char *const fmt_names[] = {"none", "llama3", "chatml", "deepseek-r1"};
      const lf_chat_format f = lf_chat_template_format(S.tmpl);
      snprintf(chat_state, sizeof chat_state, "%s (%s)",
               (int)f >= 0 && (int)f < 4 ? fmt_names[f] : "?",
               chat_template ? "--chat-template" : "the model's template");
    }
  } else {
    snprintf(chat_state, sizeof chat_state, "off (no tokenizer)");
    fprintf(stderr, "lfserve: %s: token-id prompts only, no text output\n", why);
  }
  if (name) {
    snprintf(S.model_name, sizeof S.model_name, "%.255s", name);
  } else {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s", cfg.model_path);
    size_t l = strlen(tmp);
    while (l > 1 && tmp[l - 1] == '/')
      tmp[--l] = '\0';
    const char *base = strrchr(tmp, '/');
    snprintf(S.model_name, sizeof S.model_name, "%.255s", base ? base + 1 : tmp);
  }
  S.mctx.tok = S.tok;
  S.mctx.tmpl = S.tmpl;
  S.mctx.model_name = S.model_name;
  S.mctx.vocab_size = S.mi.vocab_size;
  S.mctx.max_seq_len = S.mi.max_seq_len;
  S.mctx.budget = S.budget;
  S.mctx.policy = cfg.policy;
  S.mctx.chat_content_special = chat_content_special;

  if (pthread_create(&S.engine_thread, NULL, engine_main, NULL)) {
    fprintf(stderr, "lfserve: cannot start the engine thread\n");
    goto out;
  }

  struct sockaddr_in sa;
  memset(&sa, 0, sizeof sa);
  sa.sin_family = AF_INET;
  sa.sin_port = htons((uint16_t)port);
  if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) {
    fprintf(stderr, "lfserve: --host wants an IPv4 address, got '%s'\n", host);
    goto stop_engine;
  }
  d = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
                           MHD_USE_POLL | MHD_USE_ERROR_LOG,
                       (uint16_t)port, NULL, NULL, on_request, NULL, MHD_OPTION_SOCK_ADDR,
                       (struct sockaddr *)&sa, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)timeout,
                       MHD_OPTION_CONNECTION_LIMIT, (unsigned)max_conn + CONN_RESERVE,
                       MHD_OPTION_NOTIFY_COMPLETED, on_completed, NULL,
                       MHD_OPTION_NOTIFY_CONNECTION, on_connection, NULL, MHD_OPTION_LISTEN_BACKLOG_SIZE, 1024u,
                       MHD_OPTION_THREAD_STACK_SIZE, (size_t)(1u << 20), MHD_OPTION_END);
  if (!d) {
    fprintf(stderr, "lfserve: cannot listen on %s:%ld: %s\n", host, port, strerror(errno));
    goto stop_engine;
  }
  const union MHD_DaemonInfo *di = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
  fprintf(stderr,
          "lfserve: serving '%s' (%s, %d layers, vocab %d, context %d; policy %s, budget %d; "
          "tokenizer %s) on http://%s:%u, loaded in %.2f s; pid %ld, %d rank%s\n"
          "lfserve: chat: %s\n",
          S.model_name, S.mi.model_type, S.mi.n_layers, S.mi.vocab_size, S.mi.max_seq_len,
          lf_policy_str(cfg.policy), S.budget, S.tok ? "yes" : "no", host,
          di ? (unsigned)di->port : (unsigned)port, lf_now_s() - t0, (long)getpid(),
          lf_comm_size(comm), lf_comm_size(comm) > 1 ? "s" : "", chat_state);
  fflush(stderr);

  int sig;
  while ((sig = sigwaitinfo(&sigs, &si)) < 0) {
  }
  /* mpirun / orted turn a SIGTERM or SIGINT they receive into a job abort: they signal every
   * rank, then kill them about a second later, and no longer take part in MPI_Finalize. */
  launcher_abort = comm && si.si_pid > 0 && si.si_pid == getppid();
  fprintf(stderr, "lfserve: signal %d%s, stopping\n", sig,
          launcher_abort ? " from the MPI launcher (it is ending the job)" : "");

  /* Stop: refuse new requests, cancel the ones in flight, let the engine finish them (their
   * connections end), then stop the HTTP server and the engine thread. */
  pthread_mutex_lock(&S.mu);
  S.stopping = 1;
  for (int b = 0; b < JOB_BUCKETS; b++)
    for (job *j = S.table[b]; j; j = j->next)
      lf_engine_cancel(S.e, j->id);
  pthread_mutex_unlock(&S.mu);
  /* The engine ends the cancelled requests at its next step. When it cannot (a rank died and
   * the engine waits on it; the launcher, ending the job, kills this process about a second
   * after its signal), the connections end them themselves: an error event and [DONE] for a
   * stream, a 503 for the others, while the process still can. */
  const double t_stop = lf_now_s(), grace = launcher_abort ? 0.2 : 1.0;
  int aborted = 0;
  for (;;) {
    pthread_mutex_lock(&S.mu);
    const int left = S.n_jobs;
    if (left && !aborted && lf_now_s() - t_stop > grace) {
      aborted = 1;
      S.streams_abort = 1;
      for (int b = 0; b < JOB_BUCKETS; b++)
        for (job *j = S.table[b]; j; j = j->next)
          pthread_cond_broadcast(&j->cv);
    }
    pthread_mutex_unlock(&S.mu);
    if (!left || lf_now_s() - t_stop > 5.0) break;
    /* Once aborted, wait only for the streams' last bytes to go out. */
    if (aborted && (atomic_load(&S.open_streams) == 0 || lf_now_s() - t_stop > grace + 0.5)) break;
    usleep(10000);
  }
  if (aborted) fprintf(stderr, "lfserve: the engine did not end the requests: ended them here\n");
  MHD_stop_daemon(d);
  rc = 0;
stop_engine:
  pthread_mutex_lock(&S.mu);
  S.stopping = 2;
  pthread_cond_broadcast(&S.work_cv);
  pthread_mutex_unlock(&S.mu);
  pthread_join(S.engine_thread, NULL);
  /* Jobs whose FINISH never came (none unless the engine failed) */
  for (int b = 0; b < JOB_BUCKETS; b++)
    while (S.table[b]) {
      job *j = S.table[b];
      S.table[b] = j->next;
      job_unref(j);
    }
out:
  lf_chat_template_free(S.tmpl);
  lf_tokenizer_free(S.tok);
  lf_engine_free(S.e); /* under mpirun this releases the followers */
  pthread_cond_destroy(&S.work_cv);
  pthread_mutex_destroy(&S.mu);
  pthread_mutex_destroy(&S.cmu);
  const int world = lf_comm_size(comm);
  if (comm) {
    /* A first signal from elsewhere (a terminal's ^C) may have been followed by the launcher's
     * own: look once more. */
    const struct timespec zero = {0, 0};
    if (!launcher_abort)
      launcher_abort =
          sigtimedwait(&sigs, &si, &zero) > 0 && si.si_pid > 0 && si.si_pid == getppid();
    lf_comm_free(comm);
#ifdef LF_HAVE_MPI
    if (!launcher_abort) MPI_Finalize();
#endif
  }
  if (rc == 0)
    fprintf(stderr, "lfserve: rank 0 of %d: stopped%s\n", world,
            launcher_abort ? " (the launcher is ending the job: MPI_Finalize skipped)" : "");
  return rc;
}

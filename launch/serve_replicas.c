/* Data-parallel replicas under mpirun (serve.h, docs/DESIGN.md §4): the choice of replica for
 * each request, rank 0's router thread, and the loop of every other replica's lead rank.
 *
 * Messages go over a duplicate of MPI_COMM_WORLD, one tag each way, in order between two ranks
 * (MPI's non-overtaking rule: a submission's answer always comes before its request's events).
 * Each starts with its type:
 *   down (rank 0 -> a lead rank): SUBMIT (a number and the request), CANCEL (an engine id), STOP;
 *   up (a lead rank -> rank 0): ACK (the number, the engine id, the status and message), EVENTS
 *   (one step's events, the requests that took a pool since the last, the statistics of the
 *   finished ones), METRICS (lf_metrics every 200 ms and at the end), BYE.
 * Rank 0 sends without blocking (MPI_Isend), so a lead rank busy in a long step holds up
 * nothing else; lead ranks send blocking, and rank 0's router takes every message as it comes.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/error.h"
#include "launch/serve.h"
#ifdef LF_HAVE_MPI
#include <mpi.h>
#endif

/* ---- the choice of replica and the calls that do not care where a request runs ------------ */

/* Under S.mu: the replica with the most free pools, counting what it was sent and has not
 * finished (its running and waiting requests); ties go to the lower index. */
static int pick_replica(void) {
  int best = 0;
  long best_free = (long)S.rep[0].pools - S.rep[0].outstanding;
  for (int r = 1; r < S.n_replicas; r++) {
    const long f = (long)S.rep[r].pools - S.rep[r].outstanding;
    if (f > best_free) best = r, best_free = f;
  }
  return best;
}

static int queue_down(int r, const void *msg, size_t len);
static int serialize_request(const lf_request *rq, uint64_t token, unsigned char **out,
                             size_t *len);

/* Submissions waiting for another replica's answer (under S.mu). */
static job *pending;
static uint64_t next_token = 1;

/* Under S.mu: j, submitted under table key id, into the table with its two references (the
 * engine side's and the connection's). */
static void table_insert(job *j, uint64_t id) {
  j->id = id;
  j->refs = 2;
  job **slot = srv_job_slot(id);
  j->next = *slot;
  *slot = j;
  S.n_jobs++;
}

/* Under S.mu: rq to replica r >= 1's lead rank; waits for its answer (ACK puts the job in the
 * table, on_ack). srv_replica_submit's returns. */
static int submit_remote(int r, const lf_request *rq, job *j, lf_status *s) {
  unsigned char *buf;
  size_t len;
  j->token = next_token++;
  if (serialize_request(rq, j->token, &buf, &len)) return -1;
  const int q = queue_down(r, buf, len);
  free(buf);
  if (q) return -1;
  j->pend_next = pending;
  pending = j;
  S.rep[r].outstanding++;
  /* The answer is one round trip to a rank polling between its steps. */
  const double t0 = lf_now_s();
  while (!j->acked && !S.streams_abort && S.stopping != 2 && lf_now_s() - t0 < 30.0) {
    struct timespec ts = srv_deadline_200ms();
    pthread_cond_timedwait(&j->cv, &S.mu, &ts);
  }
  if (!j->acked) { /* gone from the pending list; a late answer cancels what it started */
    for (job **p = &pending; *p; p = &(*p)->pend_next)
      if (*p == j) {
        *p = j->pend_next;
        break;
      }
    S.rep[r].outstanding--;
    *s = lf_error(LF_ERR_BACKEND, "replica %d did not answer the submission within 30 s", r);
    return -2;
  }
  if (j->submit_status != LF_OK) {
    *s = lf_error(j->submit_status, "%s", j->submit_err);
    return -2;
  }
  return 0;
}

int srv_replica_submit(const lf_request *rq, job *j, lf_status *s) {
  const int r = S.n_replicas > 1 ? pick_replica() : 0;
  j->replica = r;
  if (r != 0) {
    const int rc = submit_remote(r, rq, j, s);
    if (rc) return rc;
  } else {
    uint64_t id;
    *s = lf_engine_submit(S.e, rq, &id);
    if (*s != LF_OK) return -2;
    j->eid = id;
    table_insert(j, id);
    S.rep[0].outstanding++;
    pthread_cond_signal(&S.work_cv);
  }
  S.rep[r].routed++;
  return 0;
}

enum { M_SUBMIT = 1, M_CANCEL, M_STOP, M_ACK, M_EVENTS, M_METRICS, M_BYE };

typedef struct {
  uint32_t type, pad;
  uint64_t id;
} msg_id;

void srv_job_cancel(job *j) {
  if (j->replica == 0) {
    lf_engine_cancel(S.e, j->eid);
    return;
  }
  const msg_id m = {M_CANCEL, 0, j->eid};
  queue_down(j->replica, &m, sizeof m);
}

int srv_job_queued(job *j) {
  if (j->replica != 0) return !j->admitted && !j->finished;
  lf_request_stats st;
  /* Still queued exactly when its queue time is its whole time so far (lfserve.h). */
  return !(lf_engine_request_stats(S.e, j->eid, &st) == LF_OK &&
           st.queue_seconds < st.total_seconds);
}

int srv_any_step_failed(void) {
  if (S.last_step_failed) return 1;
  for (int r = 1; r < S.n_replicas; r++)
    if (S.rep[r].step_failed) return 1;
  return 0;
}

static void add_summary(lf_latency_summary *a, const lf_latency_summary *b) {
  a->count += b->count;
  a->sum += b->sum;
  for (int i = 0; i < LF_LATENCY_BUCKETS; i++) a->buckets[i] += b->buckets[i];
  if (b->max > a->max) a->max = b->max;
  /* percentiles and the window are per replica; a sum of them means nothing */
  a->n_window += b->n_window;
}

lf_status srv_metrics_collect(lf_metrics *sum, lf_metrics *per) {
  LF_TRY(lf_engine_metrics(S.e, &per[0]));
  pthread_mutex_lock(&S.mu);
  for (int r = 1; r < S.n_replicas; r++) {
    if (S.rep[r].have_metrics)
      per[r] = S.rep[r].m;
    else
      memset(&per[r], 0, sizeof per[r]);
  }
  pthread_mutex_unlock(&S.mu);
  *sum = per[0];
  for (int r = 1; r < S.n_replicas; r++) {
    const lf_metrics *m = &per[r];
    sum->running += m->running;
    sum->waiting += m->waiting;
    sum->pools_used += m->pools_used;
    sum->pools_total += m->pools_total;
    sum->tokens_generated += m->tokens_generated;
    sum->evictions += m->evictions;
    sum->decode_seconds += m->decode_seconds;
    sum->prefilling += m->prefilling;
    sum->prompt_tokens += m->prompt_tokens;
    sum->steps += m->steps;
    sum->submitted += m->submitted;
    sum->rejected += m->rejected;
    for (int k = 0; k < LF_FINISH_COUNT; k++) sum->finished[k] += m->finished[k];
    sum->tokens_per_s += m->tokens_per_s;
    add_summary(&sum->ttft, &m->ttft);
    add_summary(&sum->tpot, &m->tpot);
  }
  return LF_OK;
}

/* ---- requests as bytes ---------------------------------------------------------------------
 * The lf_request struct (its pointers meaningless on arrival), then its arrays in order: prompt,
 * logit biases, stop ids, each stop sequence (its length, its ids), forced ids. Both ends are
 * the same program, so the struct's layout is the same. */

typedef struct {
  unsigned char *p;
  size_t len, cap;
  int oom;
} wbuf;

static void put(wbuf *b, const void *src, size_t n) {
  if (b->oom || n == 0) return;
  if (b->len + n > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + n) cap *= 2;
    unsigned char *q = realloc(b->p, cap);
    if (!q) {
      b->oom = 1;
      return;
    }
    b->p = q;
    b->cap = cap;
  }
  memcpy(b->p + b->len, src, n);
  b->len += n;
}

static int serialize_request(const lf_request *rq, uint64_t token, unsigned char **out,
                             size_t *len) {
  wbuf b = {0};
  const msg_id h = {M_SUBMIT, 0, token};
  put(&b, &h, sizeof h);
  put(&b, rq, sizeof *rq);
  put(&b, rq->prompt, sizeof *rq->prompt * (size_t)rq->n_prompt);
  put(&b, rq->sampling.logit_bias, sizeof(lf_logit_bias) * (size_t)rq->sampling.n_logit_bias);
  put(&b, rq->stop_ids, sizeof(int32_t) * (size_t)rq->n_stop_ids);
  for (int i = 0; i < rq->n_stop_seqs; i++) {
    const int32_t n = rq->stop_seqs[i].n_ids;
    put(&b, &n, sizeof n);
    put(&b, rq->stop_seqs[i].ids, sizeof(int32_t) * (size_t)n);
  }
  put(&b, rq->forced, sizeof(int32_t) * (size_t)rq->n_forced);
  if (b.oom) {
    free(b.p);
    return -1;
  }
  *out = b.p;
  *len = b.len;
  return 0;
}

#ifdef LF_HAVE_MPI
typedef struct {
  const unsigned char *p;
  size_t len, off;
  int bad;
} rbuf;

static const void *take(rbuf *b, size_t n) {
  if (b->bad || n > b->len - b->off) {
    b->bad = 1;
    return NULL;
  }
  const void *q = b->p + b->off;
  b->off += n;
  return q;
}

/* A request from SUBMIT's bytes; its arrays point into buf, the stop sequences into *seqs
 * (the caller frees it). -1 when the bytes do not add up. */
static int parse_request(const unsigned char *buf, size_t len, uint64_t *token, lf_request *rq,
                         lf_stop_seq **seqs) {
  rbuf b = {buf, len, 0, 0};
  const msg_id *h = take(&b, sizeof *h);
  const lf_request *in = take(&b, sizeof *in);
  *seqs = NULL;
  if (!h || !in) return -1;
  *token = h->id;
  *rq = *in;
  if (rq->n_prompt < 0 || rq->sampling.n_logit_bias < 0 || rq->n_stop_ids < 0 ||
      rq->n_stop_seqs < 0 || rq->n_forced < 0)
    return -1;
  rq->prompt = take(&b, sizeof(int32_t) * (size_t)rq->n_prompt);
  rq->sampling.logit_bias = take(&b, sizeof(lf_logit_bias) * (size_t)rq->sampling.n_logit_bias);
  rq->stop_ids = take(&b, sizeof(int32_t) * (size_t)rq->n_stop_ids);
  if (rq->n_stop_seqs > 0) {
    *seqs = calloc((size_t)rq->n_stop_seqs, sizeof **seqs);
    if (!*seqs) return -1;
    for (int i = 0; i < rq->n_stop_seqs; i++) {
      const int32_t *n = take(&b, sizeof *n);
      if (!n || *n < 0) return -1;
      (*seqs)[i].n_ids = *n;
      (*seqs)[i].ids = take(&b, sizeof(int32_t) * (size_t)*n);
    }
  }
  rq->stop_seqs = *seqs;
  rq->forced = take(&b, sizeof(int32_t) * (size_t)rq->n_forced);
  return b.bad || b.off != b.len ? -1 : 0;
}
#endif

/* ---- rank 0: the router ------------------------------------------------------------------ */

/* Between two polls of a loop with nothing to do: sleep 20 us, doubling up to 1 ms (the most a
 * message waits); a busy round starts over without sleeping. */
static void idle_wait(int busy, long *sleep_ns) {
  if (busy) {
    *sleep_ns = 0;
    return;
  }
  *sleep_ns = *sleep_ns ? (*sleep_ns * 2 > 1000000 ? 1000000 : *sleep_ns * 2) : 20000;
  const struct timespec ts = {0, *sleep_ns};
  nanosleep(&ts, NULL);
}

#define TAG_DOWN 0x1f01
#define TAG_UP 0x1f02

typedef struct out_msg {
  int dest;
  size_t len;
  unsigned char *buf;
#ifdef LF_HAVE_MPI
  MPI_Request req;
#endif
  struct out_msg *next;
} out_msg;

static struct {
  pthread_mutex_t mu; /* after S.mu */
  out_msg *head, *tail; /* queued, not yet handed to MPI */
  int stop;             /* 1: send STOP to every replica, then end once all said BYE */
  int abort;            /* the launcher is ending the job: do not wait for anyone */
  int started;
  pthread_t th;
#ifdef LF_HAVE_MPI
  MPI_Comm comm;
#endif
} R = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* Queues a message to replica r's lead rank (any thread; may hold S.mu). 0, or -1 out of
 * memory. */
static int queue_down(int r, const void *msg, size_t len) {
  out_msg *m = calloc(1, sizeof *m);
  unsigned char *b = malloc(len);
  if (!m || !b) {
    free(m);
    free(b);
    return -1;
  }
  memcpy(b, msg, len);
  m->dest = r * S.tp;
  m->len = len;
  m->buf = b;
  pthread_mutex_lock(&R.mu);
  if (R.tail)
    R.tail->next = m;
  else
    R.head = m;
  R.tail = m;
  pthread_mutex_unlock(&R.mu);
  return 0;
}

#ifdef LF_HAVE_MPI
typedef struct {
  uint32_t type;
  int32_t status;
  uint64_t token, eid;
  char err[256];
} msg_ack;

typedef struct {
  uint32_t type;
  int32_t n_ev, n_admit, n_fin, step_failed, pad;
} msg_events;
/* An EVENTS message is this header, then lf_event[n_ev], uint64_t[n_admit] and
 * lf_request_stats[n_fin]: each part stays 8-byte aligned in a malloc'd buffer. */
_Static_assert(sizeof(msg_events) % 8 == 0 && sizeof(lf_event) % 8 == 0 &&
                   sizeof(lf_request_stats) % 8 == 0,
               "EVENTS parts must keep 8-byte alignment");

static void on_ack(int r, const msg_ack *a) {
  job *j = NULL;
  for (job **p = &pending; *p; p = &(*p)->pend_next)
    if ((*p)->token == a->token && (*p)->replica == r) {
      j = *p;
      *p = j->pend_next;
      break;
    }
  if (!j) { /* its connection gave up waiting: undo what the replica started */
    if (a->status == LF_OK) {
      const msg_id m = {M_CANCEL, 0, a->eid};
      queue_down(r, &m, sizeof m);
    }
    return;
  }
  j->acked = 1;
  j->submit_status = (lf_status)a->status;
  if (a->status != LF_OK) {
    snprintf(j->submit_err, sizeof j->submit_err, "replica %d: %.200s", r, a->err);
    S.rep[r].outstanding--;
  } else {
    j->eid = a->eid;
    table_insert(j, ((uint64_t)r << SRV_REPLICA_SHIFT) | a->eid);
    if (S.stopping) srv_job_cancel(j); /* it missed srv_jobs_cancel_all */
  }
  pthread_cond_broadcast(&j->cv);
}

/* One message from replica r's lead rank (under S.mu). */
static void on_up(int r, const unsigned char *buf, size_t len) {
  if (len < sizeof(uint32_t)) return;
  uint32_t type;
  memcpy(&type, buf, sizeof type);
  if (type == M_ACK && len == sizeof(msg_ack)) {
    msg_ack a;
    memcpy(&a, buf, sizeof a);
    a.err[sizeof a.err - 1] = '\0';
    on_ack(r, &a);
  } else if (type == M_EVENTS && len >= sizeof(msg_events)) {
    msg_events h;
    memcpy(&h, buf, sizeof h);
    const size_t need = sizeof h + sizeof(lf_event) * (size_t)h.n_ev +
                        sizeof(uint64_t) * (size_t)h.n_admit + sizeof(lf_request_stats) * (size_t)h.n_fin;
    if (h.n_ev < 0 || h.n_admit < 0 || h.n_fin < 0 || len != need) {
      fprintf(stderr, "lfserve: replica %d: a malformed events message (%zu bytes)\n", r, len);
      return;
    }
    /* The receive buffer is malloc'd and every part starts at a multiple of 8 (the asserts at
     * msg_events), so the events and statistics are read where they lie. */
    const unsigned char *p = buf + sizeof h;
    const lf_event *ev = (const lf_event *)p;
    p += sizeof *ev * (size_t)h.n_ev;
    const uint64_t *admitted = (const uint64_t *)p;
    for (int i = 0; i < h.n_admit; i++) {
      job *j = *srv_job_slot(((uint64_t)r << SRV_REPLICA_SHIFT) | admitted[i]);
      if (j) {
        j->admitted = 1;
        pthread_cond_broadcast(&j->cv);
      }
    }
    p += sizeof *admitted * (size_t)h.n_admit;
    S.rep[r].step_failed = h.step_failed;
    if (h.step_failed) S.step_errors++;
    srv_route_locked(r, ev, h.n_ev, (const lf_request_stats *)p);
  } else if (type == M_METRICS && len == sizeof(uint64_t) + sizeof(lf_metrics)) {
    memcpy(&S.rep[r].m, buf + sizeof(uint64_t), sizeof(lf_metrics));
    S.rep[r].have_metrics = 1;
  } else if (type == M_BYE) {
    S.rep[r].bye = 1;
  } else {
    fprintf(stderr, "lfserve: replica %d: unknown message %u (%zu bytes)\n", r, type, len);
  }
}

static void *router_main(void *arg) {
  (void)arg;
  out_msg *inflight = NULL; /* handed to MPI_Isend, not complete */
  int stop_sent = 0;
  double stop_t = 0;
  long sleep_ns = 0;
  unsigned char *rb = NULL;
  size_t rb_cap = 0;
  for (;;) {
    int busy = 0;
    pthread_mutex_lock(&R.mu);
    out_msg *q = R.head;
    R.head = R.tail = NULL;
    const int stop = R.stop, abort_now = R.abort;
    pthread_mutex_unlock(&R.mu);
    if (stop && !stop_sent) { /* after everything queued before it */
      out_msg **t = &q;
      while (*t) t = &(*t)->next;
      for (int r = 1; r < S.n_replicas; r++) {
        out_msg *m = calloc(1, sizeof *m);
        const msg_id h = {M_STOP, 0, 0};
        if (!m || !(m->buf = malloc(sizeof h))) {
          free(m);
          continue;
        }
        memcpy(m->buf, &h, sizeof h);
        m->len = sizeof h;
        m->dest = r * S.tp;
        *t = m;
        t = &m->next;
      }
      stop_sent = 1;
      stop_t = lf_now_s();
    }
    while (q) {
      out_msg *m = q;
      q = q->next;
      busy = 1;
      if (MPI_Isend(m->buf, (int)m->len, MPI_BYTE, m->dest, TAG_DOWN, R.comm, &m->req) !=
          MPI_SUCCESS) {
        fprintf(stderr, "lfserve: rank 0: a message to rank %d could not be sent\n", m->dest);
        free(m->buf);
        free(m);
        continue;
      }
      m->next = inflight;
      inflight = m;
    }
    for (out_msg **p = &inflight; *p;) {
      int done = 0;
      if (MPI_Test(&(*p)->req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) done = 1;
      if (done) {
        out_msg *m = *p;
        *p = m->next;
        free(m->buf);
        free(m);
      } else {
        p = &(*p)->next;
      }
    }
    for (int k = 0; k < 64; k++) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_UP, R.comm, &flag, &st) != MPI_SUCCESS || !flag) break;
      int count = 0;
      MPI_Get_count(&st, MPI_BYTE, &count);
      if ((size_t)count > rb_cap) {
        unsigned char *nb = realloc(rb, (size_t)count);
        if (!nb) {
          fprintf(stderr, "lfserve: rank 0: out of memory for a %d-byte message\n", count);
          break;
        }
        rb = nb;
        rb_cap = (size_t)count;
      }
      if (MPI_Recv(rb, count, MPI_BYTE, st.MPI_SOURCE, TAG_UP, R.comm, MPI_STATUS_IGNORE) !=
          MPI_SUCCESS)
        break;
      const int r = st.MPI_SOURCE / S.tp;
      if (r >= 1 && r < S.n_replicas && st.MPI_SOURCE % S.tp == 0) {
        pthread_mutex_lock(&S.mu);
        on_up(r, rb, (size_t)count);
        pthread_mutex_unlock(&S.mu);
      }
      busy = 1;
    }
    if (stop_sent) {
      pthread_mutex_lock(&S.mu);
      int all = 1;
      for (int r = 1; r < S.n_replicas; r++) all &= S.rep[r].bye;
      pthread_mutex_unlock(&S.mu);
      if (abort_now || (all && !inflight)) break;
      if (lf_now_s() - stop_t > 5.0) {
        fprintf(stderr, "lfserve: rank 0: a replica did not stop within 5 s\n");
        break;
      }
    }
    idle_wait(busy, &sleep_ns);
  }
  /* Sends still in flight (a replica that never took them: the launcher is ending the job, or
   * one did not stop in time) keep their buffers: MPI may still read them. */
  free(rb);
  return NULL;
}
#endif

int srv_replicas_start(void *dp_comm) {
#ifdef LF_HAVE_MPI
  if (S.n_replicas <= 1) return 0;
  R.comm = *(MPI_Comm *)dp_comm;
  if (pthread_create(&R.th, NULL, router_main, NULL)) {
    fprintf(stderr, "lfserve: cannot start the replica router thread\n");
    return 1;
  }
  R.started = 1;
  return 0;
#else
  (void)dp_comm;
  return 0;
#endif
}

void srv_replicas_stop(int launcher_abort) {
  if (!R.started) return;
  pthread_mutex_lock(&R.mu);
  R.stop = 1;
  R.abort = launcher_abort;
  pthread_mutex_unlock(&R.mu);
  pthread_join(R.th, NULL);
  R.started = 0;
  /* anything queued after the router stopped */
  for (out_msg *m = R.head; m;) {
    out_msg *n = m->next;
    free(m->buf);
    free(m);
    m = n;
  }
  R.head = R.tail = NULL;
}

/* ---- the lead rank of another replica ------------------------------------------------------ */

#ifdef LF_HAVE_MPI
/* A pending SIGINT / SIGTERM: the launcher is ending the job (it signals every rank). */
static int signalled(const sigset_t *sigs) {
  sigset_t p;
  if (sigpending(&p)) return 0;
  for (int s = 1; s < 32; s++)
    if (sigismember(sigs, s) && sigismember(&p, s)) return 1;
  return 0;
}

static int send_up(MPI_Comm comm, const void *buf, size_t len) {
  return MPI_Send(buf, (int)len, MPI_BYTE, 0, TAG_UP, comm) == MPI_SUCCESS ? 0 : 1;
}

static int send_metrics(lf_engine_t e, MPI_Comm comm) {
  unsigned char b[sizeof(uint64_t) + sizeof(lf_metrics)];
  memset(b, 0, sizeof b);
  const uint32_t t = M_METRICS;
  memcpy(b, &t, sizeof t);
  lf_metrics m;
  if (lf_engine_metrics(e, &m) != LF_OK) return 0;
  memcpy(b + sizeof(uint64_t), &m, sizeof m);
  return send_up(comm, b, sizeof b);
}

/* A lead rank's state: its engine, the step's events, the requests not yet holding a pool, and
 * the message buffers. */
enum { LEAD_CAP = 1024 };
typedef struct {
  lf_engine_t e;
  MPI_Comm comm;
  int replica;
  lf_event *ev;          /* [LEAD_CAP] one step's events */
  lf_request_stats *fin; /* [LEAD_CAP] the statistics of its finished requests */
  uint64_t *waiting;     /* [n_wait] submitted, not yet holding a pool */
  int n_wait, cap_wait;
  uint64_t *admit;       /* [cap_admit] holding one since the last report */
  int cap_admit;
  wbuf out;
  unsigned char *rb;
  size_t rb_cap;
} leader;

/* SUBMIT: the request into the engine, its answer to rank 0. 0, or 1 when MPI failed. */
static int lead_submit(leader *L, int count) {
  lf_request rq;
  lf_stop_seq *seqs = NULL;
  msg_ack a;
  memset(&a, 0, sizeof a);
  a.type = M_ACK;
  uint64_t id = 0;
  lf_status s;
  if (parse_request(L->rb, (size_t)count, &a.token, &rq, &seqs))
    s = lf_error(LF_ERR_INVALID_ARG, "a malformed submission (%d bytes)", count);
  else
    s = lf_engine_submit(L->e, &rq, &id);
  free(seqs);
  a.status = s;
  a.eid = id;
  if (s != LF_OK) snprintf(a.err, sizeof a.err, "%s", lf_last_error());
  if (s == LF_OK) {
    if (L->n_wait == L->cap_wait) {
      const int c = L->cap_wait ? 2 * L->cap_wait : 64;
      uint64_t *w = realloc(L->waiting, sizeof *w * (size_t)c);
      if (w) {
        L->waiting = w;
        L->cap_wait = c;
      }
    }
    if (L->n_wait < L->cap_wait)
      L->waiting[L->n_wait++] = id;
    else /* without its admission notice rank 0 could time it out wrongly: refuse it */
      lf_engine_cancel(L->e, id);
  }
  return send_up(L->comm, &a, sizeof a);
}

/* Every message rank 0 has sent. 0, or 1 when MPI failed; *busy when there was one, *stop on
 * STOP. */
static int lead_receive(leader *L, int *busy, int *stop) {
  for (;;) {
    int flag = 0, count = 0;
    MPI_Status st;
    if (MPI_Iprobe(0, TAG_DOWN, L->comm, &flag, &st) != MPI_SUCCESS) return 1;
    if (!flag) return 0;
    MPI_Get_count(&st, MPI_BYTE, &count);
    if ((size_t)count > L->rb_cap || !L->rb) {
      unsigned char *nb = realloc(L->rb, (size_t)count + 16);
      if (!nb) {
        fprintf(stderr, "lfserve: replica %d: out of memory\n", L->replica);
        return 1;
      }
      L->rb = nb;
      L->rb_cap = (size_t)count + 16;
    }
    if (MPI_Recv(L->rb, count, MPI_BYTE, 0, TAG_DOWN, L->comm, MPI_STATUS_IGNORE) != MPI_SUCCESS)
      return 1;
    *busy = 1;
    uint32_t type = 0;
    if (count >= (int)sizeof type) memcpy(&type, L->rb, sizeof type);
    if (type == M_SUBMIT) {
      if (lead_submit(L, count)) return 1;
    } else if (type == M_CANCEL && count == (int)sizeof(msg_id)) {
      msg_id m;
      memcpy(&m, L->rb, sizeof m);
      lf_engine_cancel(L->e, m.id); /* LF_ERR_NOT_FOUND: it has ended */
    } else if (type == M_STOP) {
      *stop = 1;
      return 0;
    } else {
      fprintf(stderr, "lfserve: replica %d: unknown message %u (%d bytes)\n", L->replica, type,
              count);
    }
  }
}

/* One engine step (when there is work) and its report: the metrics first (once rank 0 has
 * routed a finish, /metrics shows the pool free), then the events, the newly admitted and the
 * finished requests' statistics. 0, or 1 when MPI failed; *busy when a step ran. */
static int lead_step(leader *L, double *last_metrics, int *busy) {
  int n = 0, n_fin = 0, n_admit = 0, failed = 0;
  if (lf_engine_busy(L->e)) {
    *busy = 1;
    const lf_status s = lf_engine_step(L->e, L->ev, LEAD_CAP, &n);
    if (s != LF_OK) {
      failed = 1;
      fprintf(stderr, "lfserve: replica %d: engine step failed: %s: %s\n", L->replica,
              lf_status_str(s), lf_last_error());
      if (n == 0) usleep(10000);
    }
    for (int i = 0; i < n; i++)
      if (L->ev[i].type == LF_EVENT_FINISH) {
        memset(&L->fin[n_fin], 0, sizeof L->fin[n_fin]);
        lf_engine_request_stats(L->e, L->ev[i].id, &L->fin[n_fin]);
        n_fin++;
      }
  }
  /* the requests that took a pool (or ended) since the last look */
  for (int i = 0; i < L->n_wait;) {
    lf_request_stats st;
    const int gone = lf_engine_request_stats(L->e, L->waiting[i], &st) != LF_OK;
    if (gone || st.queue_seconds < st.total_seconds || st.reason != LF_FINISH_NONE) {
      if (n_admit == L->cap_admit) {
        uint64_t *a = realloc(L->admit, sizeof *a * (size_t)L->cap_admit * 2);
        if (!a) break; /* the next look */
        L->admit = a;
        L->cap_admit *= 2;
      }
      L->admit[n_admit++] = L->waiting[i];
      L->waiting[i] = L->waiting[--L->n_wait];
    } else {
      i++;
    }
  }
  const double now = lf_now_s();
  if (n_fin || n_admit || now - *last_metrics > 0.2) {
    if (send_metrics(L->e, L->comm)) return 1;
    *last_metrics = now;
  }
  if (n || n_admit || failed) {
    const msg_events h = {M_EVENTS, n, n_admit, n_fin, failed, 0};
    L->out.len = 0;
    put(&L->out, &h, sizeof h);
    put(&L->out, L->ev, sizeof *L->ev * (size_t)n);
    put(&L->out, L->admit, sizeof *L->admit * (size_t)n_admit);
    put(&L->out, L->fin, sizeof *L->fin * (size_t)n_fin);
    if (L->out.oom || send_up(L->comm, L->out.p, L->out.len)) {
      fprintf(stderr, "lfserve: replica %d: cannot send events to rank 0\n", L->replica);
      return 1;
    }
  }
  return 0;
}

int srv_leader_main(lf_engine_t e, void *dp_comm, int replica, const sigset_t *sigs) {
  leader L = {.e = e, .comm = *(MPI_Comm *)dp_comm, .replica = replica, .cap_admit = 64};
  L.ev = malloc(sizeof *L.ev * LEAD_CAP);
  L.fin = malloc(sizeof *L.fin * LEAD_CAP);
  L.admit = malloc(sizeof *L.admit * (size_t)L.cap_admit);
  int rc = 0, stopped = 0;
  double last_metrics = 0, signal_t = 0;
  long sleep_ns = 0;
  if (!L.ev || !L.fin || !L.admit) {
    fprintf(stderr, "lfserve: replica %d: out of memory\n", replica);
    rc = 1;
  }
  while (!rc && !stopped) {
    /* The launcher is ending the job: rank 0 got the signal too and sends STOP once it has
     * ended its requests; this rank exits without MPI_Finalize only if that never comes (an
     * early exit would make the launcher kill every rank at once, before rank 0 ends its
     * streams). */
    if (!signal_t && signalled(sigs)) signal_t = lf_now_s();
    if (signal_t && lf_now_s() - signal_t > 3.0) {
      rc = 2;
      break;
    }
    int busy = 0;
    if (lead_receive(&L, &busy, &stopped) || (!stopped && lead_step(&L, &last_metrics, &busy))) {
      rc = 1;
      break;
    }
    if (!stopped) idle_wait(busy, &sleep_ns);
  }
  if (stopped) {
    const msg_id bye = {M_BYE, 0, 0};
    if (send_metrics(e, L.comm) || send_up(L.comm, &bye, sizeof bye)) rc = 1;
  }
  free(L.ev);
  free(L.fin);
  free(L.waiting);
  free(L.admit);
  free(L.out.p);
  free(L.rb);
  return rc;
}
#else
int srv_leader_main(lf_engine_t e, void *dp_comm, int replica, const sigset_t *sigs) {
  (void)e, (void)dp_comm, (void)replica, (void)sigs;
  return 1;
}
#endif

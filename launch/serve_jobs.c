/* lfserve's jobs: one per submitted request, in a hash table under S.mu, and the engine thread
 * that steps the engine and routes each event to its request's job (serve.h). */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "launch/serve.h"

struct timespec srv_deadline_200ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_nsec += 200 * 1000 * 1000;
  if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
  return ts;
}

job **srv_job_slot(uint64_t id) {
  job **p = &S.table[id % JOB_BUCKETS];
  while (*p && (*p)->id != id)
    p = &(*p)->next;
  return p;
}

/* Under S.mu. */
void srv_job_unref(job *j) {
  if (--j->refs > 0) return;
  pthread_cond_destroy(&j->cv);
  free(j->toks);
  free(j->lps);
  free(j->plp);
  free(j->taken_lp);
  free(j);
}

int srv_job_submit(const lf_request *rq, job **out, lf_status *s) {
  *out = NULL;
  job *j = calloc(1, sizeof *j);
  if (!j || pthread_cond_init(&j->cv, NULL)) {
    free(j);
    return -1;
  }
  j->want_lp = rq->sampling.logprobs || rq->sampling.prompt_logprobs;
  pthread_mutex_lock(&S.mu);
  if (S.stopping) {
    pthread_mutex_unlock(&S.mu);
    pthread_cond_destroy(&j->cv);
    free(j);
    return 1;
  }
  const int r = srv_replica_submit(rq, j, s);
  pthread_mutex_unlock(&S.mu);
  if (r != 0) {
    pthread_cond_destroy(&j->cv);
    free(j);
    return r;
  }
  *out = j;
  return 0;
}

void srv_jobs_cancel_all(void) {
  for (int b = 0; b < JOB_BUCKETS; b++)
    for (job *j = S.table[b]; j; j = j->next)
      srv_job_cancel(j);
}

void srv_jobs_wake_all(void) {
  for (int b = 0; b < JOB_BUCKETS; b++)
    for (job *j = S.table[b]; j; j = j->next)
      pthread_cond_broadcast(&j->cv);
}

void srv_jobs_free_all(void) {
  for (int b = 0; b < JOB_BUCKETS; b++)
    while (S.table[b]) {
      job *j = S.table[b];
      S.table[b] = j->next;
      srv_job_unref(j);
    }
}

void srv_route_locked(int r, const lf_event *ev, int n, const lf_request_stats *fin) {
  int n_fin = 0;
  for (int i = 0; i < n; i++) {
    const uint64_t key = r == 0 ? ev[i].id : ((uint64_t)r << SRV_REPLICA_SHIFT) | ev[i].id;
    const lf_request_stats *st = fin && ev[i].type == LF_EVENT_FINISH ? &fin[n_fin++] : NULL;
    job **slot = srv_job_slot(key);
    job *j = *slot;
    if (!j) continue;
    if (ev[i].type == LF_EVENT_PROMPT_TOKEN) {
      if (j->n_plp == j->cap_plp) {
        const int cap = j->cap_plp ? 2 * j->cap_plp : 64;
        lf_event *p = realloc(j->plp, sizeof *p * (size_t)cap);
        if (!p) {
          j->lp_oom = 1;
          srv_job_cancel(j);
          continue;
        }
        j->plp = p;
        j->cap_plp = cap;
      }
      j->plp[j->n_plp++] = ev[i];
      continue; /* the connection looks at them with the first token or the finish */
    }
    if (ev[i].type == LF_EVENT_TOKEN) {
      if (j->n_toks == j->cap_toks || (j->want_lp && !j->lps)) {
        int cap = j->n_toks == j->cap_toks ? (j->cap_toks ? 2 * j->cap_toks : 16) : j->cap_toks;
        int32_t *p = cap != j->cap_toks ? realloc(j->toks, sizeof *p * (size_t)cap) : j->toks;
        if (p) j->toks = p;
        lf_event *q = j->want_lp ? realloc(j->lps, sizeof *q * (size_t)cap) : NULL;
        if (q) j->lps = q;
        if (!p || (j->want_lp && !q)) {
          /* Cannot keep the token: end the request rather than return a hole in its text. */
          srv_job_cancel(j);
          continue;
        }
        j->cap_toks = cap;
      }
      if (j->want_lp) j->lps[j->n_toks] = ev[i];
      j->toks[j->n_toks++] = ev[i].token;
    } else {
      j->finished = 1;
      j->reason = ev[i].reason;
      j->status = ev[i].status;
      if (st) {
        j->stats = *st;
        j->have_stats = 1;
      } else {
        j->have_stats = lf_engine_request_stats(S.e, j->eid, &j->stats) == LF_OK;
      }
      if (S.rep && S.rep[j->replica].outstanding > 0) S.rep[j->replica].outstanding--;
      int o = j->text_stop                       ? OUT_STOP
              : j->reason == LF_FINISH_LENGTH    ? OUT_LENGTH
              : j->reason == LF_FINISH_ERROR     ? OUT_ERROR
              : j->reason == LF_FINISH_CANCELLED ? OUT_DISCONNECT
                                                 : OUT_STOP;
      j->outcome = o;
      if (!j->refused) atomic_fetch_add(&S.outcomes[o], 1);
      *slot = j->next;
      S.n_jobs--;
      pthread_cond_broadcast(&j->cv);
      srv_job_unref(j);
      continue;
    }
    pthread_cond_broadcast(&j->cv);
  }
}

/* The engine thread. Under mpirun the other ranks follow the descriptors rank 0 broadcasts from
 * inside lf_engine_step; see main(). */
void *srv_engine_main(void *arg) {
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
      const struct timespec ts = srv_deadline_200ms();
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
    pthread_mutex_lock(&S.mu);
    srv_route_locked(0, ev, n, NULL);
    pthread_mutex_unlock(&S.mu);
  }
  free(ev);
  return NULL;
}

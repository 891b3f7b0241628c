/* lfserve's completions: a request is parsed, submitted as a job, and answered either as a
 * stream of SSE chunks (one per token, cut exactly before a stop string) or as one JSON body
 * once it has finished (serve.h). */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"
#include "launch/serve.h"

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

/* ---- log-probabilities ----------------------------------------------------------------------
 * A token's string is the token decoded alone (special tokens as their text; bytes of an
 * incomplete UTF-8 character as U+FFFD, as in vLLM), or "token_id:N" without a tokenizer;
 * "bytes" lists that string's UTF-8 bytes. Completions' text_offset is the byte offset of each
 * token's string in the returned text, counting the strings of the tokens before it (from the
 * prompt's start with echo) but not special tokens', which the text leaves out. Values are the raw model distribution's (lf_sampling). */

static void token_str(int32_t id, lf_tok_text *t) {
  lf_tok_text_clear(t);
  if (!S.tok || lf_tokenizer_decode(S.tok, &id, 1, 0, t) != LF_OK) {
    char x[32];
    snprintf(x, sizeof x, "token_id:%d", (int)id);
    lf_tok_text_clear(t);
    lf_tok_text_append(t, x, strlen(x));
  }
}

static void put_lp_num(lfs_buf *b, float v) {
  /* OpenAI writes -9999.0 for a probability that underflows */
  lfs_buf_printf(b, "%.9g", isfinite(v) ? (double)v : -9999.0);
}

/* {"token", "logprob", "bytes"} of chat's logprobs, without the closing brace. */
static void put_chat_tok(lfs_buf *b, int32_t id, float lp, lf_tok_text *t) {
  token_str(id, t);
  lfs_buf_puts(b, "{\"token\":");
  lfs_buf_json_str(b, t->data ? t->data : "", t->len);
  lfs_buf_puts(b, ",\"logprob\":");
  put_lp_num(b, lp);
  lfs_buf_puts(b, ",\"bytes\":[");
  for (size_t i = 0; i < t->len; i++)
    lfs_buf_printf(b, i ? ",%u" : "%u", (unsigned)(unsigned char)t->data[i]);
  lfs_buf_puts(b, "]");
}

/* One entry of chat's choices[].logprobs.content. */
static void put_chat_lp(lfs_buf *b, const lf_event *e, lf_tok_text *t) {
  put_chat_tok(b, e->token, e->logprob, t);
  lfs_buf_puts(b, ",\"top_logprobs\":[");
  for (int k = 0; k < e->n_top; k++) {
    if (k) lfs_buf_puts(b, ",");
    put_chat_tok(b, e->top_ids[k], e->top_logprobs[k], t);
    lfs_buf_puts(b, "}");
  }
  lfs_buf_puts(b, "]}");
}

/* Completions' logprobs, column by column: tokens, token_logprobs, top_logprobs, text_offset. */
typedef struct lp_cols {
  lfs_buf tokens, lps, tops, offs;
  int n;
} lp_cols;

static void lp_cols_free(lp_cols *a) {
  lfs_buf_free(&a->tokens);
  lfs_buf_free(&a->lps);
  lfs_buf_free(&a->tops);
  lfs_buf_free(&a->offs);
}

/* Token id with its event e (NULL: a prompt's first token, null logprobs); *off advances by the
 * token's string. top_logprobs: the n_top most likely plus the token itself (OpenAI: up to
 * logprobs + 1 entries), a string already listed not repeated. */
static void lp_cols_add(lp_cols *a, int32_t id, const lf_event *e, long long *off,
                        lf_tok_text *t) {
  const char *sep = a->n ? "," : "";
  token_str(id, t);
  lfs_buf_puts(&a->tokens, sep);
  lfs_buf_json_str(&a->tokens, t->data ? t->data : "", t->len);
  lfs_buf_printf(&a->offs, "%s%lld", sep, *off);
  /* special tokens (BOS, chat markers) are not in the returned text */
  if (!S.tok || !lf_tokenizer_is_special(S.tok, id)) *off += (long long)t->len;
  lfs_buf_puts(&a->lps, sep);
  lfs_buf_puts(&a->tops, sep);
  if (!e) {
    lfs_buf_puts(&a->lps, "null");
    lfs_buf_puts(&a->tops, "null");
    a->n++;
    return;
  }
  put_lp_num(&a->lps, e->logprob);
  lfs_buf_puts(&a->tops, "{");
  char *seen[LF_MAX_TOP_LOGPROBS + 1];
  int n_seen = 0;
  for (int k = 0; k <= e->n_top; k++) {
    const int32_t tid = k < e->n_top ? e->top_ids[k] : e->token;
    const float v = k < e->n_top ? e->top_logprobs[k] : e->logprob;
    token_str(tid, t);
    const char *str = t->data ? t->data : "";
    int dup = 0;
    for (int q = 0; q < n_seen && !dup; q++) dup = !strcmp(seen[q], str);
    if (dup) continue;
    seen[n_seen] = strdup(str);
    if (!seen[n_seen]) {
      a->tops.oom = 1;
      break;
    }
    if (n_seen++) lfs_buf_puts(&a->tops, ",");
    lfs_buf_json_str(&a->tops, str, t->len);
    lfs_buf_puts(&a->tops, ":");
    put_lp_num(&a->tops, v);
  }
  for (int q = 0; q < n_seen; q++) free(seen[q]);
  lfs_buf_puts(&a->tops, "}");
  a->n++;
}

static void lp_cols_put(lfs_buf *b, lp_cols *a) {
  lfs_buf_puts(b, "{\"tokens\":[");
  lfs_buf_put(b, a->tokens.data ? a->tokens.data : "", a->tokens.len);
  lfs_buf_puts(b, "],\"token_logprobs\":[");
  lfs_buf_put(b, a->lps.data ? a->lps.data : "", a->lps.len);
  lfs_buf_puts(b, "],\"top_logprobs\":[");
  lfs_buf_put(b, a->tops.data ? a->tops.data : "", a->tops.len);
  lfs_buf_puts(b, "],\"text_offset\":[");
  lfs_buf_put(b, a->offs.data ? a->offs.data : "", a->offs.len);
  lfs_buf_puts(b, "]}");
  if (a->tokens.oom || a->lps.oom || a->tops.oom || a->offs.oom) b->oom = 1;
}

/* The prompt's columns (echo): its first token without logprobs, then the PROMPT_TOKEN events
 * (all routed before the first generated token); with_lp 0: tokens and offsets only, null
 * logprobs. */
static void lp_cols_prompt(lp_cols *a, const conn *c, const job *j, long long *off,
                           lf_tok_text *t) {
  for (int i = 0; i < c->rq.n_prompt; i++) {
    const lf_event *e = i > 0 && i - 1 < j->n_plp ? &j->plp[i - 1] : NULL;
    lp_cols_add(a, c->rq.prompt[i], e, off, t);
  }
}

/* The prompt's text for echo. */
static int prompt_text(const conn *c, lf_tok_text *t) {
  lf_tok_text_clear(t);
  if (S.tok)
    return lf_tokenizer_decode(S.tok, c->rq.prompt, (size_t)c->rq.n_prompt, LF_TOK_SKIP_SPECIAL,
                               t) == LF_OK
               ? 0
               : -1;
  char x[16];
  for (int i = 0; i < c->rq.n_prompt; i++) {
    snprintf(x, sizeof x, "%d ", (int)c->rq.prompt[i]);
    if (lf_tok_text_append(t, x, strlen(x)) != LF_OK) return -1;
  }
  return 0;
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

/* One SSE chunk carrying text (and ids), or the final one (finish != NULL). lp: the logprobs
 * of ids[0] (with logprobs on), else NULL. */
static void put_chunk(conn *c, const char *text, size_t len, const int32_t *ids, int n_ids,
                      const char *finish, const lf_event *lp) {
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
  lfs_buf_puts(b, ",\"logprobs\":");
  if (lp && c->chat) {
    lfs_buf_puts(b, "{\"content\":[");
    put_chat_lp(b, lp, &c->text);
    lfs_buf_puts(b, "]}");
  } else if (lp) {
    lp_cols a = {0};
    lp_cols_add(&a, lp->token, lp, &c->j->text_off, &c->text);
    lp_cols_put(b, &a);
    lp_cols_free(&a);
  } else {
    lfs_buf_puts(b, "null");
  }
  lfs_buf_puts(b, ",\"finish_reason\":");
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
    srv_job_cancel(j);
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
  put_chunk(c, text, len, NULL, 0, finish, NULL);
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
  srv_error_json(&c->out, &e);
  lfs_buf_puts(&c->out, "\n\ndata: [DONE]\n\n");
  c->done = 1;
}

/* Formats what the job handed over: one chunk per token (held-back partial UTF-8 characters, and
 * text that may begin a stop string, go out with the token that completes or rules them out),
 * then the end. A stop string ends the stream at once, cut exactly before it. */
/* Echo (completions): one chunk with the prompt's text first, its logprobs with logprobs on. */
static void stream_echo(conn *c, job *j) {
  if (!c->rq.echo || j->echoed) return;
  j->echoed = 1;
  lf_tok_text pt = {0};
  if (prompt_text(c, &pt)) c->out.oom = 1;
  lfs_buf *b = &c->out;
  lfs_buf_puts(b, "data: ");
  put_head(b, c, 1);
  lfs_buf_puts(b, ",\"choices\":[{\"index\":0,\"text\":");
  lfs_buf_json_str(b, pt.data ? pt.data : "", pt.len);
  if (c->rq.return_token_ids || !S.tok) {
    lfs_buf_puts(b, ",\"prompt_token_ids\":");
    put_ids(b, c->rq.prompt, c->rq.n_prompt);
  }
  lfs_buf_puts(b, ",\"logprobs\":");
  if (c->rq.logprobs) {
    lp_cols a = {0};
    lp_cols_prompt(&a, c, j, &j->text_off, &c->text);
    lp_cols_put(b, &a);
    lp_cols_free(&a);
  } else {
    lfs_buf_puts(b, "null");
  }
  lfs_buf_puts(b, ",\"finish_reason\":null}]}\n\n");
  c->first_chunk_sent = 1;
  lf_tok_text_free(&pt);
}

static void stream_format(conn *c, const int32_t *toks, int n, int finished, const job *j) {
  if (c->done) return;
  if (n > 0 || finished) stream_echo(c, c->j);
  const lf_event *lps = c->rq.logprobs && !j->lp_oom ? j->taken_lp : NULL;
  for (int i = 0; i < n; i++) {
    const int stopped = text_of(c, toks[i]);
    c->n_out++;
    if (stopped) {
      if (c->emit.len || c->rq.return_token_ids || !S.tok || lps)
        put_chunk(c, c->emit.data ? c->emit.data : "", c->emit.len, toks + i, 1, NULL,
                  lps ? &lps[i] : NULL);
      stream_end(c, "", 0, "stop", j);
      return;
    }
    /* with logprobs every token gets its chunk, so each chunk carries one token's */
    if (c->emit.len == 0 && S.tok && !c->rq.return_token_ids && !lps) continue;
    put_chunk(c, c->emit.data ? c->emit.data : "", c->emit.len, toks + i, 1, NULL,
              lps ? &lps[i] : NULL);
  }
  if (c->rq.logprobs && j->lp_oom) c->out.oom = 1; /* the stream ends with an error */
  if (!finished) return;
  if (j->reason == LF_FINISH_ERROR) {
    lfs_error e;
    finish_error(j, &e);
    lfs_buf_puts(&c->out, "data: ");
    srv_error_json(&c->out, &e);
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

/* Waits (under S.mu) until the job has news, the peer is gone or the server stops.
 * Returns 0 with news, -1 when the peer is gone or the server has stopped, 1 when the server is
 * stopping and the connection must end the request itself (the engine cannot). */
static int wait_job(conn *c) {
  job *j = c->j;
  /* Tokens may keep arriving (no timeout ever fires): look at the socket every 200 ms anyway. */
  const double t = lf_now_s();
  if (t - c->last_peer_check > 0.2) {
    c->last_peer_check = t;
    pthread_mutex_unlock(&S.mu);
    const int gone = srv_peer_gone(c->fd);
    pthread_mutex_lock(&S.mu);
    if (gone) return -1;
  }
  while (j->n_toks == 0 && !j->finished) {
    if (S.streams_abort) return 1;
    const struct timespec ts = srv_deadline_200ms();
    if (pthread_cond_timedwait(&j->cv, &S.mu, &ts) == ETIMEDOUT) {
      if (S.stopping == 2) return -1;
      pthread_mutex_unlock(&S.mu);
      const int gone = srv_peer_gone(c->fd);
      pthread_mutex_lock(&S.mu);
      if (gone) return -1;
    }
  }
  return 0;
}

/* Waits until c's request holds a pool (or has output, or finished), at most --queue-timeout.
 * Returns 0 then; 2 when the time ran out with the request still queued (it is cancelled and
 * marked refused); -1 when the peer is gone or the server has stopped; 1 when the server is
 * stopping and the engine cannot end the request. */
static int wait_admitted(conn *c) {
  job *j = c->j;
  const double t0 = lf_now_s();
  int ret = 0;
  pthread_mutex_lock(&S.mu);
  for (;;) {
    if (j->n_toks || j->finished) break;
    if (S.streams_abort) {
      ret = 1;
      break;
    }
    if (S.stopping == 2) {
      ret = -1;
      break;
    }
    /* Still queued exactly when its queue time is its whole time so far (lfserve.h). */
    if (!srv_job_queued(j)) break;
    const double now = lf_now_s();
    if (now - t0 >= S.queue_timeout_s) {
      j->refused = 1;
      srv_job_cancel(j);
      ret = 2;
      break;
    }
    struct timespec ts = srv_deadline_200ms();
    pthread_cond_timedwait(&j->cv, &S.mu, &ts);
    pthread_mutex_unlock(&S.mu);
    const int gone = srv_peer_gone(c->fd);
    pthread_mutex_lock(&S.mu);
    if (gone) {
      ret = -1;
      break;
    }
  }
  pthread_mutex_unlock(&S.mu);
  return ret;
}

/* Takes the job's tokens into c->taken; returns how many. Under S.mu. */
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
  if (j->want_lp && n > 0 && !j->lp_oom) {
    if (n > j->cap_taken_lp) {
      lf_event *p = realloc(j->taken_lp, sizeof *p * (size_t)n);
      if (p) {
        j->taken_lp = p;
        j->cap_taken_lp = n;
      } else {
        j->lp_oom = 1;
      }
    }
    if (!j->lp_oom) memcpy(j->taken_lp, j->lps, sizeof(lf_event) * (size_t)n);
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
    /* A queued request may wait minutes: that is the server's slowness, not the client's, and
     * --timeout (serve_conn.c's reaper) never counts it: nothing is unsent meanwhile. */
    pthread_mutex_lock(&S.mu);
    const int gone = wait_job(c);
    const int n = gone ? 0 : take_tokens(c);
    const int finished = !gone && c->j->finished && c->j->n_toks == 0;
    pthread_mutex_unlock(&S.mu);
    if (gone < 0) return MHD_CONTENT_READER_END_WITH_ERROR; /* srv_conn_unref cancels the request */
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
  srv_conn_unref(cls);
}

/* What a whole (non-streaming) completion gathers before its body is written: the generated
 * tokens (and their logprobs when asked for) and, with stop strings, the text decoded so far. */
typedef struct blocking_out {
  int32_t *all;
  lf_event *all_lp; /* [cap_all] with logprobs */
  int n_all, cap_all;
  lfs_buf txt;
} blocking_out;

static void blocking_out_free(blocking_out *k) {
  free(k->all);
  free(k->all_lp);
  lfs_buf_free(&k->txt);
}

enum { COLLECT_DONE = 0, COLLECT_SHUTDOWN, COLLECT_CLOSED, COLLECT_OOM };

/* Takes the job's tokens as they arrive until it finishes or (incremental) a stop string
 * completes. COLLECT_SHUTDOWN: the engine stopped; COLLECT_CLOSED: the connection went;
 * COLLECT_OOM: out of memory. */
static int collect_tokens(conn *c, int incremental, blocking_out *k) {
  for (;;) {
    pthread_mutex_lock(&S.mu);
    const int gone = wait_job(c);
    if (gone) {
      pthread_mutex_unlock(&S.mu);
      return gone > 0 ? COLLECT_SHUTDOWN : COLLECT_CLOSED;
    }
    job *j = c->j;
    if (k->n_all + j->n_toks > k->cap_all) {
      int cap = k->cap_all ? k->cap_all : 64;
      while (cap < k->n_all + j->n_toks)
        cap *= 2;
      int32_t *p = realloc(k->all, sizeof *p * (size_t)cap);
      if (p) k->all = p;
      lf_event *q = j->want_lp ? realloc(k->all_lp, sizeof *q * (size_t)cap) : NULL;
      if (q) k->all_lp = q;
      if (!p || (j->want_lp && !q)) {
        pthread_mutex_unlock(&S.mu);
        return COLLECT_OOM;
      }
      k->cap_all = cap;
    }
    if (j->n_toks) memcpy(k->all + k->n_all, j->toks, sizeof(int32_t) * (size_t)j->n_toks);
    if (j->n_toks && j->want_lp)
      memcpy(k->all_lp + k->n_all, j->lps, sizeof(lf_event) * (size_t)j->n_toks);
    const int from = k->n_all;
    k->n_all += j->n_toks;
    j->n_toks = 0;
    const int finished = j->finished;
    pthread_mutex_unlock(&S.mu);
    if (incremental) {
      for (int i = from; i < k->n_all; i++) {
        const int stopped = text_of(c, k->all[i]);
        lfs_buf_put(&k->txt, c->emit.data, c->emit.len);
        if (stopped) {
          k->n_all = i + 1; /* tokens past the one that completed the stop string are dropped */
          break;
        }
      }
      if (c->text_stopped) return COLLECT_DONE;
    }
    if (finished) return COLLECT_DONE;
  }
}

/* The completion's text: with stop strings, what was decoded as the tokens came (plus the
 * decoder's and the stopper's last bytes); without, all tokens decoded in one go. Nonzero: out
 * of memory. */
static int final_text(conn *c, int incremental, blocking_out *k, lf_tok_text *text) {
  if (incremental) {
    if (!c->text_stopped) {
      text_of(c, -1); /* the decoder's last bytes may still complete a stop string */
      lfs_buf_put(&k->txt, c->emit.data, c->emit.len);
      lfs_buf_clear(&c->emit);
      lfs_stopper_flush(&c->stop, &c->emit);
      lfs_buf_put(&k->txt, c->emit.data, c->emit.len);
    }
    if (k->txt.oom ||
        lf_tok_text_append(text, k->txt.data ? k->txt.data : "", k->txt.len) != LF_OK)
      return 1;
    lfs_buf_free(&k->txt);
  } else if (S.tok && lf_tokenizer_decode(S.tok, k->all, (size_t)k->n_all, LF_TOK_SKIP_SPECIAL,
                                          text) != LF_OK) {
    lf_tok_text_clear(text);
  }
  return 0;
}

/* The choice's "message" (chat) or "text" (with the prompt's text first when echoed, and its
 * ids where token ids are returned). */
static void put_choice_text(lfs_buf *b, conn *c, const lf_tok_text *text) {
  if (c->chat) {
    lfs_buf_puts(b, "\"message\":{\"role\":\"assistant\",\"content\":");
    lfs_buf_json_str(b, text->data ? text->data : "", text->len);
    lfs_buf_puts(b, "}");
    return;
  }
  lfs_buf_puts(b, "\"text\":");
  lf_tok_text pt = {0};
  if (c->rq.echo) {
    if (prompt_text(c, &pt)) b->oom = 1;
    if (pt.len) lf_tok_text_append(&pt, "", 0);
    lfs_buf *e = &c->emit; /* scratch: prompt then completion text */
    lfs_buf_clear(e);
    lfs_buf_put(e, pt.data ? pt.data : "", pt.len);
    lfs_buf_put(e, text->data ? text->data : "", text->len);
    if (e->oom) b->oom = 1;
    lfs_buf_json_str(b, e->data ? e->data : "", e->len);
  } else {
    lfs_buf_json_str(b, text->data ? text->data : "", text->len);
  }
  lf_tok_text_free(&pt);
  if (c->rq.echo && (c->rq.return_token_ids || !S.tok)) {
    lfs_buf_puts(b, ",\"prompt_token_ids\":");
    put_ids(b, c->rq.prompt, c->rq.n_prompt);
  }
}

/* The choice's "logprobs" value: null when not asked for; chat's {"content": [...]}; the
 * completions columns (the prompt's first when echoed). */
static void put_blocking_logprobs(lfs_buf *b, conn *c, const job *j, const blocking_out *k) {
  if (!c->rq.logprobs || !k->all_lp) {
    if (c->rq.logprobs && c->rq.echo && !c->chat) { /* echo with nothing generated */
      lp_cols a = {0};
      long long off = 0;
      lp_cols_prompt(&a, c, j, &off, &c->text);
      lp_cols_put(b, &a);
      lp_cols_free(&a);
    } else if (c->rq.logprobs && c->chat) {
      lfs_buf_puts(b, "{\"content\":[]}");
    } else {
      lfs_buf_puts(b, "null");
    }
  } else if (c->chat) {
    lfs_buf_puts(b, "{\"content\":[");
    for (int i = 0; i < k->n_all; i++) {
      if (i) lfs_buf_puts(b, ",");
      put_chat_lp(b, &k->all_lp[i], &c->text);
    }
    lfs_buf_puts(b, "]}");
  } else {
    lp_cols a = {0};
    long long off = 0;
    if (c->rq.echo) lp_cols_prompt(&a, c, j, &off, &c->text);
    for (int i = 0; i < k->n_all; i++) lp_cols_add(&a, k->all[i], &k->all_lp[i], &off, &c->text);
    lp_cols_put(b, &a);
    lp_cols_free(&a);
  }
}

/* A whole (non-streaming) completion: waits for the end, then one JSON body. */
static MHD_Result_t complete_blocking(conn *c) {
  /* With stop strings the text is decoded as the tokens arrive, so a match ends the request at
   * once; without, it is decoded in one go at the end. */
  const int incremental = S.tok && c->rq.n_stop_strs > 0;
  blocking_out k = {0};
  const int st = collect_tokens(c, incremental, &k);
  if (st != COLLECT_DONE) {
    blocking_out_free(&k);
    if (st == COLLECT_OOM)
      return srv_reply_error(c->mc, 500, "server_error", "out_of_memory", "out of memory");
    if (st == COLLECT_SHUTDOWN)
      return srv_reply_error(c->mc, 503, "server_error", "shutting_down",
                             "the server is shutting down (the engine stopped)");
    return MHD_NO; /* closes the connection; srv_conn_unref cancels the request */
  }
  const job *j = c->j;
  c->n_out = k.n_all;
  /* After a stop string the job may still be running: its fields are not read then. */
  if (!c->text_stopped && (j->reason == LF_FINISH_ERROR || j->reason == LF_FINISH_CANCELLED)) {
    blocking_out_free(&k);
    lfs_error e;
    finish_error(j, &e);
    return srv_send_error(c->mc, &e, NULL);
  }
  lf_tok_text text = {0};
  if (final_text(c, incremental, &k, &text)) {
    blocking_out_free(&k);
    lf_tok_text_free(&text);
    return srv_reply_error(c->mc, 500, "server_error", "out_of_memory", "out of memory");
  }
  lfs_buf b = {0};
  put_head(&b, c, 0);
  lfs_buf_puts(&b, ",\"choices\":[{\"index\":0,");
  put_choice_text(&b, c, &text);
  if (c->rq.return_token_ids || !S.tok) {
    lfs_buf_puts(&b, ",\"token_ids\":");
    put_ids(&b, k.all, k.n_all);
  }
  lfs_buf_puts(&b, ",\"logprobs\":");
  put_blocking_logprobs(&b, c, j, &k);
  lfs_buf_puts(&b, ",\"finish_reason\":");
  lfs_buf_json_cstr(&b, c->text_stopped ? "stop" : finish_str(j->reason));
  lfs_buf_puts(&b, "}],\"usage\":");
  put_usage(&b, c, j);
  lfs_buf_puts(&b, "}");
  MHD_Result_t r = srv_send_buf(c->mc, 200, "application/json", &b, NULL);
  lfs_buf_free(&b);
  lf_tok_text_free(&text);
  blocking_out_free(&k);
  return r;
}

MHD_Result_t srv_handle_completion(conn *c, int chat) {
  lfs_error err;
  c->chat = chat;
  if (lfs_request_parse(&S.mctx, chat, c->body.data ? c->body.data : "", c->body.len, &c->rq, &err))
    return srv_send_error(c->mc, &err, NULL);
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

  job *j;
  lf_status s = LF_OK;
  const int sub = srv_job_submit(&rq, &j, &s);
  if (sub == -1)
    return srv_reply_error(c->mc, 500, "server_error", "out_of_memory", "out of memory");
  if (sub > 0)
    return srv_refuse(c->mc, REF_SHUTTING_DOWN, "shutting_down", "the server is shutting down");
  if (sub == -2) {
    if (s == LF_ERR_QUEUE_FULL)
      return srv_refuse(c->mc, REF_QUEUE_FULL, "queue_full",
                        "the request queue is full; retry later");
    if (s == LF_ERR_INVALID_ARG) {
      lfs_error_set(&err, 400, "invalid_request_error", "invalid_value", NULL, "%s",
                    lf_last_error());
      return srv_send_error(c->mc, &err, NULL);
    }
    lfs_error_set(&err, 500, "server_error", "submit_failed", NULL, "%s: %s", lf_status_str(s),
                  lf_last_error());
    return srv_send_error(c->mc, &err, NULL);
  }
  c->j = j;
  snprintf(c->cid, sizeof c->cid, "%s-%llu", chat ? "chatcmpl" : "cmpl", (unsigned long long)j->id);
  c->created = (long long)time(NULL);

  lfs_stopper_init(&c->stop, c->rq.stop_strs, c->rq.n_stop_strs);
  if (S.tok) {
    if (lf_tok_stream_init(&c->ts, S.tok, LF_TOK_SKIP_SPECIAL) != LF_OK)
      return srv_reply_error(c->mc, 500, "server_error", "out_of_memory", "out of memory");
    c->have_stream = 1;
  }
  /* With --queue-timeout, nothing is sent until the request holds a pool: a request still
   * waiting when it runs out gets a 503 rather than a 200 stream that would have to break off. */
  if (S.queue_timeout_s > 0) {
    const int w = wait_admitted(c);
    if (w == 2)
      return srv_refuse(c->mc, REF_QUEUE_TIMEOUT, "queue_timeout",
                        "no KV pool became free within the server's --queue-timeout; retry later");
    if (w < 0) return MHD_NO; /* the client went away: srv_conn_unref cancels the request */
    if (w == 1)
      return srv_refuse(c->mc, REF_SHUTTING_DOWN, "shutting_down", "the server is shutting down");
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
  srv_count_code(200);
  return ret;
}

/* lfserve's connections: the accepted sockets (shed at the limit), the per-request connection
 * state, the libmicrohttpd callbacks that read requests and dispatch them, and error replies
 * (serve.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/clock.h"
#include "launch/serve.h"

static void conn_release_job(conn *c) {
  if (!c->j) return;
  pthread_mutex_lock(&S.mu);
  if (!c->j->finished) srv_job_cancel(c->j); /* the client went away */
  srv_job_unref(c->j);
  pthread_mutex_unlock(&S.mu);
  c->j = NULL;
}

void srv_conn_unref(conn *c) {
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
int srv_peer_gone(int fd) {
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

MHD_Result_t srv_send_buf(struct MHD_Connection *mc, int status, const char *ctype, lfs_buf *b,
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
  srv_count_code(status);
  return ret;
}

void srv_error_json(lfs_buf *b, const lfs_error *e) {
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

MHD_Result_t srv_send_error(struct MHD_Connection *mc, const lfs_error *e,
                            const char *retry_after) {
  lfs_buf b = {0};
  srv_error_json(&b, e);
  if (e->status >= 400 && e->status < 500 && e->status != 429)
    atomic_fetch_add(&S.outcomes[OUT_INVALID], 1);
  MHD_Result_t r = srv_send_buf(mc, e->status, "application/json", &b, retry_after);
  lfs_buf_free(&b);
  return r;
}

MHD_Result_t srv_reply_error(struct MHD_Connection *mc, int status, const char *type,
                             const char *code, const char *msg) {
  lfs_error e;
  lfs_error_set(&e, status, type, code, NULL, "%s", msg);
  return srv_send_error(mc, &e, NULL);
}

static const char *const refuse_why[REF_N] = {
    "the request queue is full (--max-queue)",
    "no KV pool became free within --queue-timeout",
    "the server is at --max-connections",
    "the server is shutting down",
};

void srv_refusal_count(int reason) {
  atomic_fetch_add(&S.outcomes[OUT_REJECTED], 1);
  const unsigned long long total = atomic_fetch_add(&S.refused[reason], 1) + 1;
  /* One line a second per reason at most: a flood of refusals must not become a flood of log. */
  const double now = lf_now_s();
  pthread_mutex_lock(&S.logmu);
  S.log_since[reason]++;
  if (now - S.log_last[reason] >= 1.0) {
    fprintf(stderr,
            "lfserve: refused %llu request%s with 503 (%s: %s; Retry-After 1), %llu in all\n",
            S.log_since[reason], S.log_since[reason] == 1 ? "" : "s", srv_refused_names[reason],
            refuse_why[reason], total);
    S.log_since[reason] = 0;
    S.log_last[reason] = now;
  }
  pthread_mutex_unlock(&S.logmu);
}

MHD_Result_t srv_refuse(struct MHD_Connection *mc, int reason, const char *code, const char *msg) {
  srv_refusal_count(reason);
  lfs_error e;
  lfs_error_set(&e, 503, "server_error", code, NULL, "%s", msg);
  lfs_buf b = {0};
  srv_error_json(&b, &e);
  MHD_Result_t r = srv_send_buf(mc, 503, "application/json", &b, "1");
  lfs_buf_free(&b);
  return r;
}

/* Under S.cmu: k's client has been idle past --timeout in a state where it owes us bytes. */
static void reap(struct sock *k, int with_408) {
  if (with_408) {
    static const char r408[] = "HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n"
                               "Content-Type: application/json\r\nContent-Length: 149\r\n\r\n"
                               "{\"error\":{\"message\":\"the request did not arrive within the "
                               "server's --timeout\",\"type\":\"invalid_request_error\",\"param\":null,"
                               "\"code\":\"request_timeout\"}}";
    (void)!send(k->fd, r408, sizeof r408 - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    srv_count_code(408);
  }
  atomic_fetch_add(&S.idle_closed[k->state], 1);
  k->shed = 1;
  S.n_shed++;
  shutdown(k->fd, SHUT_RDWR); /* its thread sees the end of the stream and closes it */
}

void *srv_reaper_main(void *arg) {
  (void)arg;
  while (!atomic_load(&S.reaper_stop)) {
    usleep(100000);
    const double now = lf_now_s(), limit = (double)S.timeout_s;
    pthread_mutex_lock(&S.cmu);
    struct sock *k = S.socks;
    for (int i = 0; k && i < S.n_socks; i++, k = k->next) {
      if (k->shed || k->fd < 0 || k->state == SK_HANDLING) continue;
      int q = 0;
      if (k->state == SK_SENDING) {
        /* Stalled: bytes unsent and none taken since the last look. Nothing unsent: the server
         * is the slow one (a stream waiting for tokens). */
        if (ioctl(k->fd, SIOCOUTQ, &q) != 0 || q == 0 || q < k->outq) k->since = now;
        k->outq = q;
      } else if (ioctl(k->fd, FIONREAD, &q) == 0 && q > 0) {
        k->since = now; /* a request (or more of one) is waiting to be read */
      }
      if (now - k->since > limit)
        reap(k, k->state == SK_READING || (k->state == SK_IDLE && !k->served));
    }
    pthread_mutex_unlock(&S.cmu);
  }
  return NULL;
}

/* 1 when the request carries "Authorization: Bearer <the key>" (or no key is set). The
 * comparison takes the same time wherever the first difference is: it runs over every byte of
 * the key whatever was sent, and the lengths are compared in the same pass. */
static int authorized(struct MHD_Connection *mc) {
  if (!S.api_key) return 1;
  const char *h = MHD_lookup_connection_value(mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
  if (!h || strncasecmp(h, "Bearer ", 7)) return 0;
  const char *got = h + 7;
  while (*got == ' ')
    got++;
  size_t n = strlen(got);
  while (n && (got[n - 1] == ' ' || got[n - 1] == '\t'))
    n--;
  volatile unsigned char diff = (unsigned char)(n != S.api_key_len);
  for (size_t i = 0; i < S.api_key_len; i++)
    diff |= (unsigned char)(S.api_key[i] ^ (i < n ? got[i] : 0));
  return diff == 0;
}

static MHD_Result_t reply_unauthorized(struct MHD_Connection *mc) {
  lfs_error e;
  lfs_error_set(&e, 401, "invalid_request_error", "invalid_api_key", NULL, "%s",
                "missing or incorrect API key: send the header 'Authorization: Bearer <key>'");
  lfs_buf b = {0};
  srv_error_json(&b, &e);
  MHD_Result_t r = MHD_NO;
  struct MHD_Response *rs = b.oom ? NULL
                                  : MHD_create_response_from_buffer(b.len, b.data,
                                                                    MHD_RESPMEM_MUST_COPY);
  if (rs) {
    MHD_add_response_header(rs, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    MHD_add_response_header(rs, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    r = MHD_queue_response(mc, 401, rs);
    MHD_destroy_response(rs);
    srv_count_code(401);
  }
  lfs_buf_free(&b);
  return r;
}

void srv_on_connection(void *cls, struct MHD_Connection *mc, void **socket_context,
                       enum MHD_ConnectionNotificationCode toe) {
  (void)cls;
  if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
    struct sock *k = calloc(1, sizeof *k);
    *socket_context = k;
    if (!k) return;
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(mc, MHD_CONNECTION_INFO_CONNECTION_FD);
    k->fd = ci ? ci->connect_fd : -1;
    k->state = SK_IDLE;
    k->since = lf_now_s();
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
     * connection between requests), never one whose request has arrived unread. Its thread sees
     * the end of the stream and closes it. One that never sent a request gets a 503 first (its
     * client may be about to send one); a keep-alive one is closed silently, as idle keep-alive
     * connections are. */
    if ((unsigned)S.n_socks > S.max_conn) {
      struct sock *o = S.socks;
      do {
        int q = 0;
        if (o != k && !o->busy && !o->shed && o->fd >= 0 &&
            !(ioctl(o->fd, FIONREAD, &q) == 0 && q > 0)) {
          o->shed = 1;
          S.n_shed++;
          if (!o->served) srv_raw_refuse(o->fd);
          shutdown(o->fd, SHUT_RDWR);
          break;
        }
        o = o->next;
      } while (o != S.socks);
    }
    pthread_mutex_unlock(&S.cmu);
  } else if (toe == MHD_CONNECTION_NOTIFY_CLOSED) {
    atomic_fetch_sub(&S.n_handed, 1);
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

/* Moves the socket of mc to state (SK_*): busy (a request in progress) unless SK_IDLE. Returns 1
 * when the socket was shed (it has had its answer, if any). */
static int sock_state(struct MHD_Connection *mc, int state) {
  const union MHD_ConnectionInfo *ci =
      MHD_get_connection_info(mc, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
  struct sock *k = ci ? ci->socket_context : NULL;
  if (!k) return 0;
  pthread_mutex_lock(&S.cmu);
  const int shed = k->shed;
  if (k->state == SK_SENDING && state == SK_IDLE) k->served = 1;
  k->busy = state != SK_IDLE;
  k->state = state;
  k->since = lf_now_s();
  k->outq = 0;
  pthread_mutex_unlock(&S.cmu);
  return shed;
}

static MHD_Result_t reply_too_large(struct MHD_Connection *mc) {
  char msg[96];
  snprintf(msg, sizeof msg, "the request body exceeds the limit of %zu bytes", S.max_body);
  return srv_reply_error(mc, 413, "invalid_request_error", "request_too_large", msg);
}

static MHD_Result_t on_request(struct MHD_Connection *mc, const char *url, const char *method,
                               const char *upload, size_t *upload_size, void **con_cls) {
  conn *c = *con_cls;
  if (!c) {
    c = calloc(1, sizeof *c);
    if (!c) return MHD_NO;
    atomic_init(&c->refs, 1);
    c->mc = mc;
    c->fd = -1;
    *con_cls = c;
    /* Shed while its request arrived (the 503 went out when it was shed): nothing more. */
    if (sock_state(mc, SK_READING)) return MHD_NO;
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(mc, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (ci) c->fd = ci->connect_fd;
    *con_cls = c;
    /* A key is checked on the headers: without it the body is never read. */
    if (S.api_key && (!strncmp(url, "/v1/", 4) ||
                      (S.auth_metrics && (!strcmp(url, "/health") || !strcmp(url, "/metrics")))) &&
        !authorized(mc)) {
      c->replied = 1;
      return reply_unauthorized(mc);
    }
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
    sock_state(mc, SK_READING); /* more of the body: the client is alive */
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
  sock_state(mc, SK_HANDLING);
  if (c->too_large) return reply_too_large(mc);

  const int get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
  const int post = !strcmp(method, "POST");
  const int is_cmpl = !strcmp(url, "/v1/completions");
  const int is_chat = !strcmp(url, "/v1/chat/completions");
  const int is_get =
      !strcmp(url, "/v1/models") || !strcmp(url, "/health") || !strcmp(url, "/metrics");
  if (c->body.oom)
    return srv_reply_error(mc, 500, "server_error", "out_of_memory", "out of memory");
  if (is_cmpl || is_chat) {
    if (!post)
      return srv_reply_error(mc, 405, "invalid_request_error", "method_not_allowed",
                             "use POST for this endpoint");
    pthread_mutex_lock(&S.cmu);
    const int over = (unsigned)(S.n_socks - S.n_shed) > S.max_conn;
    pthread_mutex_unlock(&S.cmu);
    if (over) /* the sockets beyond the limit are kept for /health and /metrics */
      return srv_refuse(mc, REF_CONNECTIONS, "too_many_connections",
                        "the server is at its connection limit; retry later");
    return srv_handle_completion(c, is_chat);
  }
  if (is_get) {
    if (!get)
      return srv_reply_error(mc, 405, "invalid_request_error", "method_not_allowed",
                             "use GET for this endpoint");
    if (!strcmp(url, "/v1/models")) return srv_handle_models(mc);
    if (!strcmp(url, "/health")) return srv_handle_health(mc);
    return srv_handle_metrics(mc);
  }
  return srv_reply_error(mc, 404, "invalid_request_error", "not_found", "no such endpoint");
}

MHD_Result_t srv_on_request(void *cls, struct MHD_Connection *mc, const char *url,
                            const char *method, const char *version, const char *upload,
                            size_t *upload_size, void **con_cls) {
  (void)cls;
  (void)version;
  const conn *c0 = *con_cls;
  const int replied_before = c0 && c0->replied;
  const MHD_Result_t r = on_request(mc, url, method, upload, upload_size, con_cls);
  const conn *c = *con_cls;
  /* A reply was queued by this call: from now on the client is the one reading. */
  if (c && c->replied && !replied_before) sock_state(mc, SK_SENDING);
  return r;
}

void srv_on_completed(void *cls, struct MHD_Connection *mc, void **con_cls,
                      enum MHD_RequestTerminationCode toe) {
  (void)cls;
  (void)toe;
  conn *c = *con_cls;
  *con_cls = NULL;
  sock_state(mc, SK_IDLE);
  if (c) srv_conn_unref(c);
}

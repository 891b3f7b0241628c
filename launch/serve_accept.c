/* lfserve's listening socket and its acceptor thread (serve.h): every connection is accepted
 * here. While libmicrohttpd has room it is handed over (MHD_add_connection); beyond
 * --max-connections + CONN_RESERVE it is answered here with 503 + Retry-After, so no accepted
 * socket is ever closed without an HTTP status (libmicrohttpd's own limit closes them silently). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/clock.h"
#include "launch/serve.h"

/* Sockets answered with 503 and waiting for the client to close its end: closing one while the
 * client's request is still arriving would reset the connection, and a reset can discard the
 * response before the client reads it. Each waits at most OVERFLOW_LINGER_S. */
#define OVERFLOW_MAX 4096
#define OVERFLOW_LINGER_S 2.0

static struct {
  int lfd;
  int wake[2]; /* a pipe: stop */
  struct MHD_Daemon *d;
  unsigned room; /* sockets handed to libmicrohttpd at most */
  pthread_t thread;
  int running;
  int ofd[OVERFLOW_MAX];
  double odeadline[OVERFLOW_MAX];
  int n_over;
} A = {.lfd = -1, .wake = {-1, -1}};

int srv_listen(const char *host, long port, int backlog, int *bound_port, int *loopback) {
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof sa);
  sa.sin_family = AF_INET;
  sa.sin_port = htons((uint16_t)port);
  if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) {
    fprintf(stderr, "lfserve: --host wants an IPv4 address, got '%s'\n", host);
    return -1;
  }
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    fprintf(stderr, "lfserve: cannot create a socket: %s\n", strerror(errno));
    return -1;
  }
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(fd, (struct sockaddr *)&sa, sizeof sa) || listen(fd, backlog)) {
    fprintf(stderr, "lfserve: cannot listen on %s:%ld: %s\n", host, port, strerror(errno));
    close(fd);
    return -1;
  }
  socklen_t len = sizeof sa;
  *bound_port = getsockname(fd, (struct sockaddr *)&sa, &len) ? (int)port : ntohs(sa.sin_port);
  *loopback = (ntohl(sa.sin_addr.s_addr) >> 24) == 127;
  return fd;
}

static void overflow_close(int i) {
  close(A.ofd[i]);
  A.n_over--;
  A.ofd[i] = A.ofd[A.n_over];
  A.odeadline[i] = A.odeadline[A.n_over];
}

void srv_raw_refuse(int fd) {
  static const char body[] =
      "{\"error\":{\"message\":\"the server is at --max-connections: retry later\","
      "\"type\":\"server_error\",\"param\":null,\"code\":\"too_many_connections\"}}";
  char msg[512];
  const int n = snprintf(msg, sizeof msg,
                         "HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n"
                         "Content-Type: application/json\r\nRetry-After: 1\r\n"
                         "Content-Length: %zu\r\n\r\n%s",
                         sizeof body - 1, body);
  srv_refusal_count(REF_CONNECTIONS);
  srv_count_code(503);
  (void)!send(fd, msg, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT);
}

/* A socket beyond the limit: the 503, the end of our half, then it lingers. */
static void overflow_answer(int fd) {
  srv_raw_refuse(fd);
  shutdown(fd, SHUT_WR);
  if (A.n_over == OVERFLOW_MAX) overflow_close(0); /* the oldest waits no longer */
  A.ofd[A.n_over] = fd;
  A.odeadline[A.n_over] = lf_now_s() + OVERFLOW_LINGER_S;
  A.n_over++;
}

/* 1 when libmicrohttpd may take another socket. S.n_handed counts the sockets handed over and
 * not yet closed: libmicrohttpd queues a socket handed from this thread and registers it later,
 * so its own counts (and S.n_socks) lag behind a burst. */
static int has_room(void) {
  return (unsigned)atomic_load(&S.n_handed) < A.room;
}

static void *acceptor_main(void *arg) {
  (void)arg;
  static struct pollfd p[2 + OVERFLOW_MAX];
  for (;;) {
    p[0] = (struct pollfd){.fd = A.wake[0], .events = POLLIN};
    p[1] = (struct pollfd){.fd = A.lfd, .events = POLLIN};
    for (int i = 0; i < A.n_over; i++) p[2 + i] = (struct pollfd){.fd = A.ofd[i], .events = POLLIN};
    const int n_over = A.n_over;
    if (poll(p, 2 + (nfds_t)n_over, n_over ? 100 : -1) < 0 && errno != EINTR) break;
    if (p[0].revents) break;
    /* Lingering 503s: drain what the client sends; close at its end or the deadline. */
    const double now = lf_now_s();
    for (int i = n_over - 1; i >= 0; i--) {
      int done = now >= A.odeadline[i];
      if (!done && p[2 + i].revents) {
        char buf[4096];
        ssize_t r;
        while ((r = recv(A.ofd[i], buf, sizeof buf, MSG_DONTWAIT)) > 0) {
        }
        done = r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
      }
      if (done) overflow_close(i);
    }
    if (!(p[1].revents & POLLIN)) continue;
    for (int k = 0; k < 64; k++) { /* a batch, then the wake pipe and the lingering sockets */
      struct sockaddr_storage ss;
      socklen_t len = sizeof ss;
      const int fd = accept4(A.lfd, (struct sockaddr *)&ss, &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE) {
          /* Out of descriptors: those lingering give theirs back first. */
          while (A.n_over) overflow_close(A.n_over - 1);
          fprintf(stderr, "lfserve: warning: accept: %s\n", strerror(errno));
          usleep(10000);
        }
        break;
      }
      if (!has_room()) {
        overflow_answer(fd);
        continue;
      }
      /* libmicrohttpd closes the socket itself when it cannot take it. */
      atomic_fetch_add(&S.n_handed, 1);
      if (MHD_add_connection(A.d, fd, (struct sockaddr *)&ss, len) != MHD_YES) {
        atomic_fetch_sub(&S.n_handed, 1);
        fprintf(stderr, "lfserve: warning: a connection could not be handed over: %s\n",
                strerror(errno));
      }
    }
  }
  while (A.n_over) overflow_close(A.n_over - 1);
  return NULL;
}

int srv_acceptor_start(int lfd, struct MHD_Daemon *d, unsigned room) {
  A.lfd = lfd;
  A.d = d;
  A.room = room;
  A.n_over = 0;
  if (pipe2(A.wake, O_CLOEXEC)) return -1;
  if (pthread_create(&A.thread, NULL, acceptor_main, NULL)) {
    close(A.wake[0]);
    close(A.wake[1]);
    return -1;
  }
  A.running = 1;
  return 0;
}

void srv_acceptor_stop(void) {
  if (!A.running) return;
  (void)!write(A.wake[1], "x", 1);
  pthread_join(A.thread, NULL);
  close(A.wake[0]);
  close(A.wake[1]);
  A.running = 0;
}

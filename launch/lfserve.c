/* lfserve: an OpenAI-compatible HTTP server over the lfserve engine.
 *
 *   lfserve --model DIR [--lora DIR] [--budget B] [--port 8000] [--host 127.0.0.1] [--policy P]
 *           [--evict-scope layer|head] [--kv-dtype bf16|fp8|int8|int4|k8v4]
 *           [--pools N] [--max-queue N] [--backend auto|cpu|cuda] [--served-model-name NAME] ...
 *
 * This file holds main: the options, start-up (the engine, the model's tokenizer and chat
 * template, the engine thread, libmicrohttpd), the signal wait and the shutdown. launch/serve.h
 * lists the other files and describes the threads and locks.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/stat.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/clock.h"
#include "engine/model_text.h"
#include "launch/cli.h"
#include "launch/serve.h"
#include "launch/tp_launch.h"
#ifdef LF_HAVE_MPI
#include <mpi.h>
#endif

/* The server (launch/serve.h). */
struct srv S;

static void usage(FILE *f) {
  fprintf(f,
          "usage: lfserve --model DIR [options]\n"
          "  --model PATH            HF model directory or GGUF file (its tokenizer for text prompts)\n"
          "  --lora DIR              merge this PEFT LoRA adapter (adapter_config.json +\n"
          "                          adapter_model.safetensors) into the model at load\n"
          "  --served-model-name S   the model id clients use (default: the directory's name)\n"
          "  --host ADDR             IPv4 address to listen on (default 127.0.0.1: this machine\n"
          "                          only; --host 0.0.0.0 serves every interface)\n"
          "  --port N                (default 8000; 0 picks a free port, printed at start)\n"
          "  --budget B              KV slots per sequence (default: the model's context)\n"
          "  --policy P              longflow | full | streaming | h2o | rkv (default longflow)\n"
          "  --sink S  --window W    eviction sinks / prefill window (defaults 4, 32)\n"
          "  --h2o-recent R          h2o: the R newest slots never evicted (default 0: budget/2)\n"
          "  --rkv-stage S           rkv: slots chosen per selection, every S steps (default 0: 128,\n"
          "                          halved to fit the budget)\n"
          "  --rkv-obs O             rkv: its observation window, the O newest slots kept\n"
          "                          (default 0: budget/2)\n"
          "  --layer-weights F       per-layer budgets within the same total: one weight per layer\n"
          "  --key-means F           a key mean per (layer, KV head) taken from every key before\n"
          "                          the pool stores it (tools/evict/key_means.py)\n"
          "  --evict-scope S         layer | head: one eviction slot per layer or per KV head\n"
          "  --kv-dtype T            bf16|fp8|int8|int4|k8v4: the pools' K/V storage (default bf16)\n"
          "                          (default layer; rank-local under mpirun)\n"
          "  --pools N               concurrent sequences (KV pools); default: sized from memory\n"
          "  --kv-memory-gb G        without --pools: the pools take --kv-memory-fraction of G GiB\n"
          "  --kv-memory-fraction F  without --pools and --kv-memory-gb: the pools take F of the\n"
          "                          memory left after the weights (cpu: MemAvailable, default\n"
          "                          0.5; cuda: free device memory after the workspaces, default\n"
          "                          0.9); with --kv-memory-gb, F of G (default 0.9)\n"
          "  --max-pools N           at most N pools when sized from memory (default 256)\n"
          "  --max-queue N           waiting requests beyond which new ones get 503 + Retry-After\n"
          "                          (default 1024)\n"
          "  --queue-timeout S       a request still waiting for a pool after S seconds gets 503 +\n"
          "                          Retry-After; nothing is sent before it holds a pool (default\n"
          "                          60; 0: wait for ever, a stream's headers go out at once)\n"
          "  --max-batch-tokens N    prompt tokens per step; longer prompts that fit the pool are\n"
          "                          chunked (default 512; 0 = whole prompts)\n"
          "  --backend B             auto | cpu | cuda (default auto)\n"
          "  --tp T                  under mpirun -np N: N/T data-parallel replicas of T\n"
          "                          tensor-parallel ranks each behind rank 0's endpoint (default\n"
          "                          N: one replica)\n"
          "  --threads N             cpu backend threads (default: all)\n"
          "  --max-body BYTES        request body limit (default 8388608), 413 beyond\n"
          "  --timeout S             idle connection timeout in seconds: the client's idleness\n"
          "                          only, never the server's own work or queue (default 30)\n"
          "  --max-connections N     (default 1024) completions beyond get 503 + Retry-After\n"
          "  --api-key-file PATH     require 'Authorization: Bearer <key>' on /v1/* (401\n"
          "                          otherwise); the key is the file's first line. Or set\n"
          "                          LFSERVE_API_KEY (the file wins). Never on the command line:\n"
          "                          other users can read it there\n"
          "  --auth-metrics          with a key: /health and /metrics need it too (default open)\n"
          "  --chat-template NAME    chatml | llama3 | deepseek-r1: render chat with this built-in\n"
          "                          template (default: the model's own; without one chat is off)\n"
          "  --chat-content-special  read special-token text inside chat message content as\n"
          "                          real markers, as Hugging Face's apply_chat_template does\n"
          "                          (default: content is plain text)\n");
}

/* The API key: the first line of --api-key-file, else $LFSERVE_API_KEY; NULL when neither is
 * set. Returns 0, or 2 after a message (unreadable or empty file, a key with spaces or control
 * characters: it could never match a header). */
static int load_api_key(const char *path, char **key, const char **from) {
  *key = NULL;
  *from = NULL;
  char buf[4097];
  size_t n = 0;
  if (path) {
    FILE *f = fopen(path, "r");
    if (!f) {
      fprintf(stderr, "lfserve: --api-key-file %s: %s\n", path, strerror(errno));
      return 2;
    }
    struct stat st;
    if (fstat(fileno(f), &st) == 0 && (st.st_mode & 077))
      fprintf(stderr, "lfserve: warning: --api-key-file %s can be read by other users (mode %03o); "
                      "chmod 600 it\n", path, (unsigned)(st.st_mode & 0777));
    n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    n = strcspn(buf, "\r\n");
    *from = "--api-key-file";
  } else {
    const char *e = getenv("LFSERVE_API_KEY");
    if (!e) return 0;
    snprintf(buf, sizeof buf, "%s", e);
    n = strlen(buf);
    *from = "LFSERVE_API_KEY";
  }
  buf[n] = '\0';
  if (n == 0) {
    fprintf(stderr, "lfserve: %s: the API key is empty\n", *from);
    return 2;
  }
  for (size_t i = 0; i < n; i++)
    if ((unsigned char)buf[i] <= ' ' || (unsigned char)buf[i] >= 0x7f) {
      fprintf(stderr, "lfserve: %s: the API key has a space or a non-printable character at byte "
                      "%zu; keys are printable ASCII without spaces\n", *from, i + 1);
      return 2;
    }
  *key = strdup(buf);
  memset(buf, 0, sizeof buf);
  if (!*key) {
    fprintf(stderr, "lfserve: out of memory\n");
    return 2;
  }
  return 0;
}

/* What the command line asks for. */
typedef struct serve_opts {
  lf_engine_config cfg;
  const char *host, *name, *key_file, *chat_template;
  int auth_metrics, chat_content_special;
  int tp; /* ranks per replica under mpirun (0: all of them, one replica) */
  double queue_timeout;
  long port, max_conn, timeout, max_body;
} serve_opts;

enum { SERVE_GO = -1 }; /* parse_args: carry on (otherwise it returns main's exit status) */

static int parse_args(int argc, char **argv, serve_opts *o) {
  lf_engine_config *cfg = &o->cfg;
  lf_engine_config_default(cfg);
  cfg->max_queue = 1024;
  /* Pools sized from memory by default: on the cpu half of MemAvailable after the weights (the
   * rest is the machine's: other processes, page cache, the activations that grow with the
   * batch), on cuda mem_util (0.9) of the free device memory; at most 256 sequences. */
  cfg->host_mem_util = 0.5;
  cfg->max_pools = 256;
  o->host = "127.0.0.1";
  o->queue_timeout = 60;
  o->port = 8000;
  o->max_conn = 1024;
  o->timeout = 30;
  o->max_body = 8L << 20;
  const lf_cli_int ints[] = {
      {"--budget", 1, INT_MAX, &cfg->budget},
      {"--sink", 0, INT_MAX, &cfg->sink},
      {"--window", 0, INT_MAX, &cfg->window},
      {"--h2o-recent", 0, INT_MAX, &cfg->h2o_recent},
      {"--rkv-stage", 0, INT_MAX, &cfg->rkv_stage},
      {"--rkv-obs", 0, INT_MAX, &cfg->rkv_obs},
      {"--pools", 1, INT_MAX, &cfg->n_pools},
      {"--max-pools", 1, INT_MAX, &cfg->max_pools},
      {"--max-queue", 0, INT_MAX, &cfg->max_queue},
      {"--max-batch-tokens", 0, INT_MAX, &cfg->max_batch_tokens},
      {"--threads", 0, 4096, &cfg->n_threads},
      {"--tp", 1, 4096, &o->tp},
  };
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage(stdout);
      return 0;
    }
    if (!strcmp(a, "--chat-content-special")) {
      o->chat_content_special = 1;
      continue;
    }
    if (!strcmp(a, "--auth-metrics")) {
      o->auth_metrics = 1;
      continue;
    }
    if (!strcmp(a, "--api-key") || !strncmp(a, "--api-key=", 10)) {
      fprintf(stderr, "lfserve: --api-key is not accepted: a key on the command line is visible to "
                      "every user of this machine (ps, /proc/PID/cmdline); put it in a file only "
                      "you can read and give --api-key-file PATH, or set LFSERVE_API_KEY\n");
      return 2;
    }
    if (!v) {
      fprintf(stderr, "lfserve: unknown option or missing value: %s\n", a);
      usage(stderr);
      return 2;
    }
    i++;
    const lf_cli_int *io = lf_cli_int_find(ints, sizeof ints / sizeof ints[0], a);
    if (io) {
      if (lf_cli_int_set(io, v)) goto bad;
    } else if (!strcmp(a, "--model"))
      cfg->model_path = v;
    else if (!strcmp(a, "--lora"))
      cfg->lora_path = v;
    else if (!strcmp(a, "--layer-weights")) {
      static double *lw; /* kept to the process's exit */
      char why[256];
      free(lw);
      lw = NULL;
      if (lf_cli_read_weights(v, &lw, &cfg->n_layer_weights, why, sizeof why)) {
        fprintf(stderr, "lfserve: --layer-weights: %s\n", why);
        return 2;
      }
      cfg->layer_weights = lw;
    } else if (!strcmp(a, "--key-means")) {
      static float *km; /* kept to the process's exit */
      if (lf_cli_load_key_means("lfserve", v, &km, &cfg->n_key_means)) return 2;
      cfg->key_means = km;
    } else if (!strcmp(a, "--served-model-name"))
      o->name = v;
    else if (!strcmp(a, "--host"))
      o->host = v;
    else if (!strcmp(a, "--api-key-file"))
      o->key_file = v;
    else if (!strcmp(a, "--queue-timeout")) {
      char *end;
      o->queue_timeout = strtod(v, &end);
      if (*end || end == v || !(o->queue_timeout >= 0 && o->queue_timeout <= 86400)) goto bad;
    }
    else if (!strcmp(a, "--chat-template")) {
      lf_chat_format f;
      if (lf_chat_format_parse(v, &f) != LF_OK) goto bad;
      o->chat_template = v;
    }
    else if (!strcmp(a, "--port")) {
      if (lf_cli_parse_long(v, 0, 65535, &o->port)) goto bad;
    } else if (!strcmp(a, "--max-body")) {
      if (lf_cli_parse_long(v, 1, LONG_MAX, &o->max_body)) goto bad;
    } else if (!strcmp(a, "--timeout")) {
      if (lf_cli_parse_long(v, 0, 86400, &o->timeout)) goto bad;
    } else if (!strcmp(a, "--max-connections")) {
      if (lf_cli_parse_long(v, 1, 1 << 20, &o->max_conn)) goto bad;
    } else if (!strcmp(a, "--kv-memory-gb")) {
      char *end;
      double g = strtod(v, &end);
      if (*end || end == v || !(g > 0)) goto bad;
      cfg->kv_memory_bytes = (uint64_t)(g * 1073741824.0);
    } else if (!strcmp(a, "--kv-memory-fraction")) {
      char *end;
      double f = strtod(v, &end);
      if (*end || end == v || !(f > 0 && f <= 1)) goto bad;
      cfg->host_mem_util = cfg->mem_util = f;
    } else if (!strcmp(a, "--policy")) {
      if (lf_policy_parse(v, &cfg->policy) != LF_OK) goto bad;
    } else if (!strcmp(a, "--evict-scope")) {
      if (lf_evict_scope_parse(v, &cfg->evict_scope) != LF_OK) goto bad;
    } else if (!strcmp(a, "--kv-dtype")) {
      if (lf_kv_dtype_parse(v, &cfg->kv_dtype) != LF_OK) {
        fprintf(stderr, "lfserve: %s\n", lf_last_error());
        return 2;
      }
    } else if (!strcmp(a, "--backend")) {
      if (lf_backend_parse(v, &cfg->backend) != LF_OK) goto bad;
    } else {
      return lf_cli_unknown_option("lfserve", a, usage);
    }
    continue;
  bad:
    return lf_cli_bad_value("lfserve", a, v);
  }
  if (!cfg->model_path) {
    fprintf(stderr, "lfserve: --model is required\n");
    usage(stderr);
    return 2;
  }
  return SERVE_GO;
}

/* The launcher (mpirun / orted) is ending the job when the signal came from it: it signals
 * every rank, then kills them about a second later, and no longer takes part in MPI_Finalize.
 * Looks for a pending SIGINT / SIGTERM without waiting. */
static int launcher_signalled(const sigset_t *sigs, siginfo_t *si) {
  const struct timespec zero = {0, 0};
  return sigtimedwait(sigs, si, &zero) > 0 && si->si_pid > 0 && si->si_pid == getppid();
}

/* The end of a rank under mpirun: frees its communicators (dp: an MPI_Comm * that may hold
 * MPI_COMM_NULL, or NULL) and finalizes MPI, unless the launcher is ending the job (it no longer
 * takes part in MPI_Finalize then). */
static void end_mpi(lf_comm_t comm, void *dp, int launcher_abort) {
  lf_comm_free(comm);
#ifdef LF_HAVE_MPI
  if (launcher_abort) return;
  if (dp && *(MPI_Comm *)dp != MPI_COMM_NULL) MPI_Comm_free((MPI_Comm *)dp);
  MPI_Finalize();
#else
  (void)dp, (void)launcher_abort;
#endif
}

static void say_stopped(int rank, int size, int launcher_abort) {
  fprintf(stderr, "lfserve: rank %d of %d: stopped%s\n", rank, size,
          launcher_abort ? " (the launcher is ending the job: MPI_Finalize skipped)" : "");
}

/* A rank other than 0 under mpirun: runs rank 0's steps until it frees its engine, then stops.
 * main's exit status. */
static int follow(lf_comm_t comm, void *dp, int rank, int size, const sigset_t *sigs) {
  lf_status s = lf_engine_follow(S.e);
  if (s != LF_OK)
    fprintf(stderr, "lfserve: rank %d: %s: %s\n", rank, lf_status_str(s), lf_last_error());
  lf_engine_free(S.e);
  if (s != LF_OK) return 1; /* without MPI_Finalize: the launcher ends the job */
  /* Rank 0 released us. When the launcher is ending the job it has signalled this rank too
   * (the signal waits, blocked): skip MPI_Finalize then, as rank 0 does. */
  siginfo_t si;
  memset(&si, 0, sizeof si);
  const int launcher_abort = launcher_signalled(sigs, &si);
  end_mpi(comm, dp, launcher_abort);
  say_stopped(rank, size, launcher_abort);
  return 0;
}

/* The lead rank of replica r >= 1 (serve.h): serves what rank 0 sends until it says stop, then
 * frees the engine (which releases its group's other ranks). main's exit status. */
static int lead_replica(lf_comm_t comm, void *dp, int r, int rank, int size, const sigset_t *sigs) {
  const int lr = srv_leader_main(S.e, dp, r, sigs);
  if (lr == 1) {
    fprintf(stderr, "lfserve: rank %d (replica %d): lost rank 0; exiting\n", rank, r);
    return 1; /* without MPI_Finalize: the launcher ends the job */
  }
  siginfo_t si;
  memset(&si, 0, sizeof si);
  const int launcher_abort = lr == 2 || launcher_signalled(sigs, &si);
  if (lr != 2) lf_engine_free(S.e); /* releases the group's other ranks */
  end_mpi(comm, dp, launcher_abort);
  say_stopped(rank, size, launcher_abort);
  return 0;
}

/* One line on the pools the engine holds and where their count came from. */
static void print_pools(const lf_resolved_config *rc) {
  lf_pool_sizing ps;
  if (lf_engine_pool_sizing(S.e, &ps) != LF_OK) return;
  char basis[160] = "";
  if (ps.basis_bytes)
    snprintf(basis, sizeof basis, " from %.2f GiB %s x %g = %.2f GiB%s", ps.basis_bytes / 1073741824.0,
             ps.basis, ps.util, ps.basis_bytes * ps.util / 1073741824.0,
             ps.capped ? ", capped by --max-pools" : "");
  else
    snprintf(basis, sizeof basis, " (%s)", ps.basis && !strcmp(ps.basis, "n_pools") ? "--pools" : ps.basis ? ps.basis : "?");
  fprintf(stderr, "lfserve: pools: %d of %.1f MiB (%llu bytes) each (budget %d slots, kv %s), "
          "%.2f GiB in all%s\n", ps.n_pools, ps.pool_bytes / 1048576.0,
          (unsigned long long)ps.pool_bytes, rc->budget, lf_kv_dtype_str(rc->kv_dtype),
          (double)ps.pool_bytes * ps.n_pools / 1073741824.0, basis);
}

/* The tokenizer and chat template the model carries (HF directory or GGUF metadata) into S.tok
 * and S.tmpl; chat_state[cap] gets the banner's word on chat. Returns 0, or 1 after a message. */
static int open_text(const serve_opts *o, char *chat_state, size_t cap) {
  char why[4200] = "";
  lf_status s = lf_model_tokenizer_open(o->cfg.model_path, &S.tok, why, sizeof why);
  if (s != LF_OK) {
    fprintf(stderr, "lfserve: %s: %s\n", lf_status_str(s), lf_last_error());
    return 1;
  }
  if (!S.tok) {
    snprintf(chat_state, cap, "off (no tokenizer)");
    fprintf(stderr, "lfserve: %s: token-id prompts only, no text output\n", why);
    return 0;
  }
  if (lf_tokenizer_vocab_size(S.tok) > S.mi.vocab_size)
    fprintf(stderr, "lfserve: warning: the tokenizer has %d ids, the model %d\n",
            lf_tokenizer_vocab_size(S.tok), S.mi.vocab_size);
  s = lf_model_chat_template_open_as(o->cfg.model_path, o->chat_template, &S.tmpl);
  if (s != LF_OK && o->chat_template) { /* an explicit choice that cannot be honoured */
    fprintf(stderr, "lfserve: --chat-template %s: %s\n", o->chat_template, lf_last_error());
    return 1;
  }
  if (s != LF_OK) {
    snprintf(chat_state, cap, "off (%s; --chat-template chatml|llama3|deepseek-r1 to choose one)",
             lf_last_error());
    S.tmpl = NULL;
  } else {
    static const char *const fmt_names[] = {"none", "llama3", "chatml", "deepseek-r1"};
    const lf_chat_format f = lf_chat_template_format(S.tmpl);
    snprintf(chat_state, cap, "%s (%s)", (int)f >= 0 && (int)f < 4 ? fmt_names[f] : "?",
             o->chat_template ? "--chat-template" : "the model's template");
  }
  return 0;
}

/* The model id clients use: --served-model-name, else the last part of the model's path. */
static void set_model_name(const serve_opts *o) {
  if (o->name) {
    snprintf(S.model_name, sizeof S.model_name, "%.255s", o->name);
    return;
  }
  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s", o->cfg.model_path);
  size_t l = strlen(tmp);
  while (l > 1 && tmp[l - 1] == '/')
    tmp[--l] = '\0';
  const char *base = strrchr(tmp, '/');
  snprintf(S.model_name, sizeof S.model_name, "%.255s", base ? base + 1 : tmp);
}

/* The acceptor (serve_accept.c) owns the listening socket and hands connections to
 * libmicrohttpd while it has room, answering the rest with 503 itself: libmicrohttpd closes
 * sockets beyond its limit without a word. Its limit is set above the acceptor's so a count
 * that lags behind a closing socket never reaches it. *lfd, *d, *bound_port and *loopback get what was
 * started (left -1 / NULL otherwise, for main to stop). Returns 0, or 1 after a message. */
static int start_http(const serve_opts *o, int *lfd, struct MHD_Daemon **d, int *bound_port,
                      int *loopback) {
  *lfd = srv_listen(o->host, o->port, 1024, bound_port, loopback);
  if (*lfd < 0) return 1;
  const unsigned room = (unsigned)o->max_conn + CONN_RESERVE;
  *d = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
                            MHD_USE_POLL | MHD_USE_ERROR_LOG | MHD_USE_NO_LISTEN_SOCKET |
                            MHD_USE_ITC,
                        0, NULL, NULL, srv_on_request, NULL, MHD_OPTION_CONNECTION_TIMEOUT, 0u,
                        MHD_OPTION_CONNECTION_LIMIT, room + 64u,
                        MHD_OPTION_NOTIFY_COMPLETED, srv_on_completed, NULL,
                        MHD_OPTION_NOTIFY_CONNECTION, srv_on_connection, NULL,
                        MHD_OPTION_THREAD_STACK_SIZE, (size_t)(1u << 20), MHD_OPTION_END);
  if (!*d) {
    fprintf(stderr, "lfserve: cannot start the HTTP server: %s\n", strerror(errno));
    return 1;
  }
  if (srv_acceptor_start(*lfd, *d, room)) {
    fprintf(stderr, "lfserve: cannot start the acceptor thread\n");
    return 1;
  }
  return 0;
}

/* The start-up banner: what is served where, chat and authentication. */
static void print_banner(const serve_opts *o, const lf_resolved_config *rc, int bound_port, int loopback,
                         double load_s, const char *chat_state, const char *key_from) {
  const char *lora = o->cfg.lora_path;
  char replicas[64] = "";
  if (S.n_replicas > 1)
    snprintf(replicas, sizeof replicas, " (%d replicas x tp %d)", S.n_replicas, rc->n_ranks);
  fprintf(stderr,
          "lfserve: serving '%s' (%s%s%s, %d layers, vocab %d, context %d; policy %s, budget %d, kv %s; "
          "tokenizer %s) on http://%s:%u, loaded in %.2f s; pid %ld, %d rank%s%s\n"
          "lfserve: chat: %s\n"
          "lfserve: auth: %s%s%s\n",
          S.model_name, S.mi.model_type, lora && lora[0] ? " + LoRA adapter " : "",
          lora ? lora : "", S.mi.n_layers, S.mi.vocab_size, S.mi.max_seq_len,
          lf_policy_str(rc->policy), rc->budget, lf_kv_dtype_str(rc->kv_dtype),
          S.tok ? "yes" : "no", o->host, (unsigned)bound_port, load_s, (long)getpid(),
          S.n_replicas * rc->n_ranks, S.n_replicas * rc->n_ranks > 1 ? "s" : "", replicas,
          chat_state,
          S.api_key ? "an API key (" : "none: anyone who can reach the port may use it",
          S.api_key ? key_from : "",
          !S.api_key ? "" : o->auth_metrics ? ") on every endpoint" : ") on /v1/*; /health and /metrics open");
  if (!S.api_key && !loopback)
    fprintf(stderr, "lfserve: warning: listening on %s, beyond this machine, without an API key "
                    "(--api-key-file or LFSERVE_API_KEY)\n", o->host);
  fflush(stderr);
}

/* Stopping: refuses new requests and cancels the ones in flight. The engine ends the cancelled
 * requests at its next step. When it cannot (a rank died and the engine waits on it; the
 * launcher, ending the job, kills this process about a second after its signal), the
 * connections end them themselves: an error event and [DONE] for a stream, a 503 for the
 * others, while the process still can. */
static void drain_requests(int launcher_abort) {
  pthread_mutex_lock(&S.mu);
  S.stopping = 1;
  srv_jobs_cancel_all();
  pthread_mutex_unlock(&S.mu);
  const double t_stop = lf_now_s(), grace = launcher_abort ? 0.2 : 1.0;
  int aborted = 0;
  for (;;) {
    pthread_mutex_lock(&S.mu);
    const int left = S.n_jobs;
    if (left && !aborted && lf_now_s() - t_stop > grace) {
      aborted = 1;
      S.streams_abort = 1;
      srv_jobs_wake_all();
    }
    pthread_mutex_unlock(&S.mu);
    if (!left || lf_now_s() - t_stop > 5.0) break;
    /* Once aborted, wait only for the streams' last bytes to go out. */
    if (aborted && (atomic_load(&S.open_streams) == 0 || lf_now_s() - t_stop > grace + 0.5)) break;
    usleep(10000);
  }
  if (aborted) fprintf(stderr, "lfserve: the engine did not end the requests: ended them here\n");
}

/* The server state main's later phases share: the key, limits and locks (srv_state_free undoes
 * it, with the engine and the text pieces). */
static void srv_state_init(const serve_opts *o, char *api_key) {
  S.api_key = api_key;
  S.api_key_len = api_key ? strlen(api_key) : 0;
  S.auth_metrics = o->auth_metrics;
  S.queue_timeout_s = o->queue_timeout;
  pthread_mutex_init(&S.mu, NULL);
  pthread_cond_init(&S.work_cv, NULL);
  pthread_mutex_init(&S.cmu, NULL);
  pthread_mutex_init(&S.logmu, NULL);
  S.started = time(NULL);
  S.timeout_s = (unsigned)o->timeout;
  S.max_conn = (unsigned)o->max_conn;
  S.max_body = (size_t)o->max_body;
}

/* What request parsing needs of the model (serve.h lfs_model_ctx), once the engine and the text
 * pieces are up. */
static void srv_model_context(const serve_opts *o) {
  S.mctx.tok = S.tok;
  S.mctx.tmpl = S.tmpl;
  S.mctx.model_name = S.model_name;
  S.mctx.vocab_size = S.mi.vocab_size;
  S.mctx.max_seq_len = S.mi.max_seq_len;
  S.mctx.budget = S.budget;
  S.mctx.policy = S.policy;
  S.mctx.chat_content_special = o->chat_content_special;
}

static void srv_state_free(char *api_key) {
  lf_chat_template_free(S.tmpl);
  lf_tokenizer_free(S.tok);
  lf_engine_free(S.e); /* under mpirun this releases the followers */
  pthread_cond_destroy(&S.work_cv);
  pthread_mutex_destroy(&S.mu);
  pthread_mutex_destroy(&S.cmu);
  pthread_mutex_destroy(&S.logmu);
  free(api_key);
  S.api_key = NULL;
}

/* Where this process stands under mpirun (one rank alone: replica 0 of 1, no communicator). */
typedef struct ranks {
  lf_comm_t comm; /* this rank's tensor-parallel group (NULL alone) */
  int replica, n_replicas, wrank, wsize;
  int *pools; /* [wsize] every rank's pool count (several replicas), else NULL */
  int my_pools;
#ifdef LF_HAVE_MPI
  MPI_Comm dp_comm; /* rank 0 and the replicas' lead ranks talk over it */
#endif
} ranks;

static void *rk_dp(ranks *rk) {
#ifdef LF_HAVE_MPI
  return &rk->dp_comm;
#else
  (void)rk;
  return NULL;
#endif
}

/* Under mpirun (DESIGN §4): every rank loads its shard; rank 0 serves HTTP and drives its
 * group's engine, the others run lf_engine_follow until their lead rank frees the engine; with
 * --tp T of N ranks, the lead rank of every other group serves rank 0's requests
 * (serve_replicas.c). MPI starts here, in the program, never in the library. Creates S.e.
 * Returns SERVE_GO, or main's exit status after a message. */
static int start_ranks(int *argc, char ***argv, const serve_opts *o, ranks *rk) {
  rk->n_replicas = rk->wsize = 1;
#ifdef LF_HAVE_MPI
  rk->dp_comm = MPI_COMM_NULL;
#endif
  lf_status s;
  if (lf_launched_multi_rank()) {
    s = lf_tp_start_groups(argc, argv, o->cfg.backend, o->tp, &rk->comm, &rk->replica,
                           &rk->n_replicas);
#ifdef LF_HAVE_MPI
    int inited = 0;
    MPI_Initialized(&inited);
    if (inited) {
      MPI_Comm_rank(MPI_COMM_WORLD, &rk->wrank);
      MPI_Comm_size(MPI_COMM_WORLD, &rk->wsize);
    }
#endif
    if (s != LF_OK) {
      /* a bad --tp is every rank's: said once */
      if (s != LF_ERR_INVALID_ARG || rk->wrank == 0)
        fprintf(stderr, "lfserve: mpirun: %s: %s\n", lf_status_str(s), lf_last_error());
      return s == LF_ERR_INVALID_ARG ? 2 : 1;
    }
  } else if (o->tp > 1) {
    fprintf(stderr, "lfserve: --tp %d: start the ranks with mpirun -np N (N a multiple of %d)\n",
            o->tp, o->tp);
    return 2;
  }
  s = lf_engine_init(&o->cfg, rk->comm, &S.e);
  if (s != LF_OK) {
    fprintf(stderr, "lfserve: %s%s: %s\n", rk->n_replicas > 1 ? "replica " : "",
            lf_status_str(s), lf_last_error());
    return 1; /* without MPI_Finalize: the launcher ends the job */
  }
  lf_resolved_config rc0;
  lf_engine_resolved_config(S.e, &rc0);
  rk->my_pools = rc0.n_pools;
#ifdef LF_HAVE_MPI
  if (rk->n_replicas > 1) {
    /* every replica came up (a group agreed within itself), and rank 0 learns their pools */
    rk->pools = calloc((size_t)rk->wsize, sizeof *rk->pools);
    int ok = rk->pools != NULL, all = 0;
    if (MPI_Comm_dup(MPI_COMM_WORLD, &rk->dp_comm) != MPI_SUCCESS ||
        MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, rk->dp_comm) != MPI_SUCCESS || !all ||
        MPI_Allgather(&rk->my_pools, 1, MPI_INT, rk->pools, 1, MPI_INT, rk->dp_comm) !=
            MPI_SUCCESS) {
      fprintf(stderr, "lfserve: rank %d: replicas could not agree at start-up\n", rk->wrank);
      return 1;
    }
  }
#endif
  return SERVE_GO;
}

/* Rank 0: S.rep from every replica's pools; with several, a line on them and the router
 * thread. 0, or 1 after a message. */
static int setup_replicas(ranks *rk) {
  S.n_replicas = rk->n_replicas;
  S.tp = rk->wsize / rk->n_replicas;
  S.rep = calloc((size_t)rk->n_replicas, sizeof *S.rep);
  if (!S.rep) {
    free(rk->pools);
    rk->pools = NULL;
    fprintf(stderr, "lfserve: out of memory\n");
    return 1;
  }
  for (int r = 0; r < rk->n_replicas; r++)
    S.rep[r].pools = rk->pools ? rk->pools[r * S.tp] : rk->my_pools;
  free(rk->pools);
  rk->pools = NULL;
  if (rk->n_replicas <= 1) return 0;
  char list[512] = "";
  size_t len = 0;
  for (int r = 0; r < rk->n_replicas && len < sizeof list; r++)
    len += (size_t)snprintf(list + len, sizeof list - len, "%s%d", r ? " + " : "", S.rep[r].pools);
  fprintf(stderr, "lfserve: %d data-parallel replicas of %d rank%s each (ranks r*%d..): pools %s\n",
          rk->n_replicas, S.tp, S.tp > 1 ? "s" : "", S.tp, list);
  return srv_replicas_start(rk_dp(rk));
}

int main(int argc, char **argv) {
  serve_opts o;
  memset(&o, 0, sizeof o);
  int rc = parse_args(argc, argv, &o);
  if (rc != SERVE_GO) return rc;
  char *api_key = NULL;
  const char *key_from = NULL;
  if (load_api_key(o.key_file, &api_key, &key_from)) return 2;
  if (o.auth_metrics && !api_key)
    fprintf(stderr, "lfserve: warning: --auth-metrics without a key (--api-key-file or "
                    "LFSERVE_API_KEY): nothing is protected\n");

  /* SIGINT / SIGTERM are taken by sigwait in this thread only: every thread started below
   * (engine, OpenMP, libmicrohttpd) inherits the blocked mask. */
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, NULL);
  signal(SIGPIPE, SIG_IGN);

  rc = 1;
  struct MHD_Daemon *d = NULL;
  int lfd = -1; /* the listening socket (serve_accept.c) */
  srv_state_init(&o, api_key);

  lf_comm_t comm = NULL;
  int launcher_abort = 0; /* the launcher is ending the job: MPI_Finalize would never return */
  siginfo_t si;
  memset(&si, 0, sizeof si);
  const double t0 = lf_now_s();
  ranks rk;
  memset(&rk, 0, sizeof rk);
  rc = start_ranks(&argc, &argv, &o, &rk);
  if (rc != SERVE_GO) return rc;
  rc = 1;
  comm = rk.comm;
  const int n_replicas = rk.n_replicas, wsize = rk.wsize;
  void *dp = rk_dp(&rk);
  if (lf_comm_rank(comm) != 0) {
    free(rk.pools);
    return follow(comm, dp, rk.wrank, wsize, &sigs);
  }
  if (rk.replica != 0) {
    free(rk.pools);
    return lead_replica(comm, dp, rk.replica, rk.wrank, wsize, &sigs);
  }
  lf_engine_model_info(S.e, &S.mi);
  lf_resolved_config rc_eng; /* what the engine runs with: the budget with its default resolved */
  lf_engine_resolved_config(S.e, &rc_eng);
  S.policy = rc_eng.policy;
  S.budget = rc_eng.budget;
  print_pools(&rc_eng);
  if (setup_replicas(&rk)) goto out;

  char chat_state[512] = "";
  if (open_text(&o, chat_state, sizeof chat_state)) goto out;
  set_model_name(&o);
  srv_model_context(&o);

  if (pthread_create(&S.engine_thread, NULL, srv_engine_main, NULL)) {
    fprintf(stderr, "lfserve: cannot start the engine thread\n");
    goto out;
  }
  int bound_port = 0, loopback = 0;
  if (start_http(&o, &lfd, &d, &bound_port, &loopback)) goto stop_engine;
  /* --timeout is applied by our reaper (serve.h), not libmicrohttpd: its timer starts at accept
   * and is checked before the socket is read, so under load (300 connections opened at once on
   * two cores) it closed connections whose requests had arrived, unread and unanswered. */
  const int reaper = o.timeout > 0 && pthread_create(&S.reaper, NULL, srv_reaper_main, NULL) == 0;
  if (o.timeout > 0 && !reaper)
    fprintf(stderr, "lfserve: warning: cannot start the idle-connection reaper: --timeout is off\n");
  print_banner(&o, &rc_eng, bound_port, loopback, lf_now_s() - t0, chat_state, key_from);

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
  drain_requests(launcher_abort);
  srv_acceptor_stop();
  MHD_stop_daemon(d);
  d = NULL;
  if (reaper) {
    atomic_store(&S.reaper_stop, 1);
    pthread_join(S.reaper, NULL);
  }
  rc = 0;
stop_engine:
  if (d) MHD_stop_daemon(d);
  if (lfd >= 0) close(lfd);
  pthread_mutex_lock(&S.mu);
  S.stopping = 2;
  pthread_cond_broadcast(&S.work_cv);
  pthread_mutex_unlock(&S.mu);
  pthread_join(S.engine_thread, NULL);
  srv_replicas_stop(launcher_abort);
  /* Jobs whose FINISH never came (none unless the engine failed) */
  srv_jobs_free_all();
out:
  srv_state_free(api_key);
  const int world = wsize;
  free(S.rep);
  S.rep = NULL;
  if (comm || n_replicas > 1) {
    /* A first signal from elsewhere (a terminal's ^C) may have been followed by the launcher's
     * own: look once more. */
    if (!launcher_abort) launcher_abort = launcher_signalled(&sigs, &si);
    end_mpi(comm, dp, launcher_abort);
  }
  if (rc == 0) say_stopped(0, world, launcher_abort);
  return rc;
}

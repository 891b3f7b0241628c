/* lfgen: generate from the command line.
 *
 *   lfgen --model PATH [--lora DIR] --prompt-ids 1,2,3 --max-tokens N [--budget B] [--policy P]
 *         [--sink S] [--max-batch-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed X]
 *         [--backend auto|cpu|cuda] [--evict-scope head|layer] [--evict-groups G] [--ignore-eos]
 *         [--kv-dtype bf16|fp8|int8|int4|k8v4]
 *         [--print-ids]
 *
 * Generated token ids go to stdout, space-separated on one line; statistics go to stderr.
 */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "engine/model_text.h"
#include "launch/cli.h"
#include "text/tokenizer.h"
#include "launch/tp_launch.h"
#include "lfserve.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: lfgen --model PATH (--prompt-ids 1,2,3 | --prompt TEXT) [options]\n"
          "  --model PATH        HF model directory (config.json + safetensors) or llama2.c .bin\n"
          "  --lora DIR          merge this PEFT LoRA adapter (adapter_config.json +\n"
          "                      adapter_model.safetensors) into the model at load\n"
          "  --prompt-ids LIST   comma-separated prompt token ids\n"
          "  --prompt TEXT       prompt text (needs a model with a tokenizer)\n"
          "  --chat              wrap --prompt as one user message in the model's chat template\n"
          "  --chat-template T   chatml | llama3 | deepseek-r1: the built-in template --chat uses\n"
          "                      (default: the model's own; a model without one needs this)\n"
          "  --max-tokens N      tokens to generate (default 256, at most what the context\n"
          "                      leaves after the prompt; more is an error)\n"
          "  --budget B          KV slots per sequence (default: the model's context)\n"
          "  --policy P          longflow | full | streaming | h2o | rkv (default longflow)\n"
          "  --evict-scope S     layer | head: one eviction slot per layer or per KV head\n"
          "                      (default layer; rank-local under --tp)\n"
          "  --kv-dtype T        bf16|fp8|int8|int4|k8v4: the pools' K/V storage (default bf16)\n"
          "  --evict-groups G    layer scope: each layer's KV heads in G groups of one slot\n"
          "                      (G = T: what T tensor-parallel ranks evict; default 1)\n"
          "  --sink S            never-evicted first slots (default 4)\n"
          "  --window W          prefill: last W prompt tokens always kept (default 32)\n"
          "  --h2o-recent R      h2o: the R newest slots are never evicted (default 0: budget/2)\n"
          "  --rkv-stage S       rkv: slots chosen per selection, every S steps (default 0: 128,\n"
          "                      halved to fit the budget)\n"
          "  --rkv-obs O         rkv: its observation window, the O newest slots kept (default 0:\n"
          "                      budget/2)\n"
          "  --layer-weights F   per-layer budgets within the same total: F lists one weight per\n"
          "                      layer (lf_engine_config.layer_weights; docs/USAGE.md)\n"
          "  --key-means F       a key mean per (layer, KV head) taken from every key before the\n"
          "                      pool stores it (tools/evict/key_means.py; docs/USAGE.md)\n"
          "  --max-batch-tokens N  prompt tokens per step; longer prompts that fit the pool are "
          "chunked (default 512; 0 = whole prompt)\n"
          "  --temperature T     0 = greedy (default 0)\n"
          "  --top-k K           sample among the K most likely (default 0 = off)\n"
          "  --top-p P           nucleus sampling mass (default 1 = off)\n"
          "  --seed X            sampling seed (default 0)\n"
          "  --backend B         auto | cpu | cuda (default auto)\n"
          "  --ignore-eos        keep generating past end-of-sequence tokens\n"
          "  --print-ids         print generated token ids (the default without a tokenizer)\n"
          "  --tp                tensor parallel over the MPI ranks (automatic when launched\n"
          "                      by mpirun with more than one rank): rank 0 prints\n");
}

static int parse_float(const char *s, double *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (errno || end == s || *end) return -1;
  *out = v;
  return 0;
}

static int parse_ids(const char *s, int32_t **ids, int *n) {
  int cap = 16, k = 0;
  int32_t *a = malloc(sizeof(int32_t) * (size_t)cap);
  if (!a) return -1;
  const char *p = s;
  while (*p) {
    char *end;
    errno = 0;
    long v = strtol(p, &end, 10);
    if (errno || end == p || v < 0 || v > INT32_MAX || (*end && *end != ',')) {
      free(a);
      return -1;
    }
    if (k == cap) {
      int32_t *b = realloc(a, sizeof(int32_t) * (size_t)(cap *= 2));
      if (!b) {
        free(a);
        return -1;
      }
      a = b;
    }
    a[k++] = (int32_t)v;
    p = *end ? end + 1 : end;
  }
  if (k == 0) {
    free(a);
    return -1;
  }
  *ids = a;
  *n = k;
  return 0;
}

/* Progress of a long load: a line every few seconds with the memory resident so far (the
 * engine loads in one call; what it has read shows in this process's resident set). */
typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done;
  double t0;
} load_progress;

static double rss_gib(void) {
  FILE *f = fopen("/proc/self/statm", "r");
  unsigned long long size = 0, res = 0;
  if (f) {
    if (fscanf(f, "%llu %llu", &size, &res) != 2) res = 0;
    fclose(f);
  }
  return (double)res * (double)sysconf(_SC_PAGESIZE) / 1073741824.0;
}

static void *load_progress_main(void *arg) {
  load_progress *p = arg;
  pthread_mutex_lock(&p->mu);
  while (!p->done) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 5;
    if (pthread_cond_timedwait(&p->cv, &p->mu, &ts) == ETIMEDOUT && !p->done)
      fprintf(stderr, "lfgen: loading the model: %.0f s, %.1f GiB resident\n", lf_now_s() - p->t0,
              rss_gib());
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

/* What the command line asks for. */
typedef struct gen_opts {
  lf_engine_config cfg;
  lf_request rq;
  int32_t *ids; /* the prompt (malloc'ed; rq.prompt once it is known) */
  const char *prompt_text, *chat_template;
  int chat, print_ids, max_tokens_given, want_tp;
} gen_opts;

enum { GEN_GO = -1 }; /* parse_args: carry on (otherwise it returns main's exit status) */

static double *layer_weights; /* --layer-weights, kept to the process's exit */
static float *key_means;      /* --key-means, the same */

static int parse_args(int argc, char **argv, gen_opts *o) {
  lf_engine_config_default(&o->cfg);
  memset(&o->rq, 0, sizeof o->rq);
  o->rq.max_tokens = 256;
  o->rq.sampling.top_p = 1.0f;
  o->want_tp = lf_launched_multi_rank();
  lf_engine_config *cfg = &o->cfg;
  lf_request *rq = &o->rq;
  const lf_cli_int ints[] = {
      {"--budget", 1, INT_MAX, &cfg->budget},
      {"--max-batch-tokens", 0, INT_MAX, &cfg->max_batch_tokens},
      {"--sink", 0, INT_MAX, &cfg->sink},
      {"--evict-groups", 0, 4096, &cfg->evict_groups},
      {"--window", 0, INT_MAX, &cfg->window},
      {"--h2o-recent", 0, INT_MAX, &cfg->h2o_recent},
      {"--rkv-stage", 0, INT_MAX, &cfg->rkv_stage},
      {"--rkv-obs", 0, INT_MAX, &cfg->rkv_obs},
      {"--top-k", 0, INT_MAX, &rq->sampling.top_k},
  };
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    double d;
    const lf_cli_int *io = lf_cli_int_find(ints, sizeof ints / sizeof ints[0], a);
#define NEED_VALUE                                                                                 \
  if (!v) {                                                                                        \
    fprintf(stderr, "lfgen: %s needs a value\n", a);                                              \
    return 2;                                                                                      \
  }                                                                                                \
  i++
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage(stdout);
      return 0;
    } else if (io) {
      NEED_VALUE;
      if (lf_cli_int_set(io, v)) goto bad;
    } else if (!strcmp(a, "--model")) {
      NEED_VALUE;
      cfg->model_path = v;
    } else if (!strcmp(a, "--lora")) {
      NEED_VALUE;
      cfg->lora_path = v;
    } else if (!strcmp(a, "--layer-weights")) {
      NEED_VALUE;
      char why[256];
      free(layer_weights);
      if (lf_cli_read_weights(v, &layer_weights, &cfg->n_layer_weights, why, sizeof why)) {
        fprintf(stderr, "lfgen: --layer-weights: %s\n", why);
        return 2;
      }
      cfg->layer_weights = layer_weights;
    } else if (!strcmp(a, "--key-means")) {
      NEED_VALUE;
      if (lf_cli_load_key_means("lfgen", v, &key_means, &cfg->n_key_means)) return 2;
      cfg->key_means = key_means;
    } else if (!strcmp(a, "--prompt-ids")) {
      NEED_VALUE;
      free(o->ids);
      o->ids = NULL;
      if (parse_ids(v, &o->ids, &rq->n_prompt)) {
        fprintf(stderr, "lfgen: --prompt-ids wants comma-separated non-negative ids, got '%s'\n", v);
        return 2;
      }
    } else if (!strcmp(a, "--prompt")) {
      NEED_VALUE;
      o->prompt_text = v;
    } else if (!strcmp(a, "--max-tokens")) {
      NEED_VALUE;
      long n;
      if (lf_cli_parse_long(v, 1, INT_MAX, &n)) goto bad;
      rq->max_tokens = (int)n;
      o->max_tokens_given = 1;
    } else if (!strcmp(a, "--policy")) {
      NEED_VALUE;
      if (lf_policy_parse(v, &cfg->policy) != LF_OK) {
        fprintf(stderr, "lfgen: %s\n", lf_last_error());
        return 2;
      }
    } else if (!strcmp(a, "--evict-scope")) {
      NEED_VALUE;
      if (lf_evict_scope_parse(v, &cfg->evict_scope) != LF_OK) {
        fprintf(stderr, "lfgen: %s\n", lf_last_error());
        return 2;
      }
    } else if (!strcmp(a, "--kv-dtype")) {
      NEED_VALUE;
      if (lf_kv_dtype_parse(v, &cfg->kv_dtype) != LF_OK) {
        fprintf(stderr, "lfgen: %s\n", lf_last_error());
        return 2;
      }
    } else if (!strcmp(a, "--temperature")) {
      NEED_VALUE;
      if (parse_float(v, &d) || d < 0) goto bad;
      rq->sampling.temperature = (float)d;
    } else if (!strcmp(a, "--top-p")) {
      NEED_VALUE;
      if (parse_float(v, &d) || d <= 0 || d > 1) goto bad;
      rq->sampling.top_p = (float)d;
    } else if (!strcmp(a, "--seed")) {
      NEED_VALUE;
      char *end;
      errno = 0;
      rq->sampling.seed = strtoull(v, &end, 10);
      if (errno || *end || end == v) goto bad;
    } else if (!strcmp(a, "--backend")) {
      NEED_VALUE;
      if (lf_backend_parse(v, &cfg->backend) != LF_OK) goto bad;
    } else if (!strcmp(a, "--tp")) {
      o->want_tp = 1;
    } else if (!strcmp(a, "--ignore-eos")) {
      rq->ignore_eos = 1;
    } else if (!strcmp(a, "--print-ids")) {
      o->print_ids = 1;
    } else if (!strcmp(a, "--chat")) {
      o->chat = 1;
    } else if (!strcmp(a, "--chat-template")) {
      NEED_VALUE;
      lf_chat_format f;
      if (lf_chat_format_parse(v, &f) != LF_OK) {
        fprintf(stderr, "lfgen: %s\n", lf_last_error());
        return 2;
      }
      o->chat_template = v;
    } else {
      return lf_cli_unknown_option("lfgen", a, usage);
    }
    continue;
  bad:
    return lf_cli_bad_value("lfgen", a, v);
#undef NEED_VALUE
  }
  if (!cfg->model_path) {
    fprintf(stderr, "lfgen: --model is required\n");
    usage(stderr);
    return 2;
  }
  return GEN_GO;
}

/* The model's tokenizer (a HF directory's tokenizer.json or a GGUF file's metadata) into *tok,
 * or NULL with the reason in no_tok: token ids in and out need none. Returns 0, or 1 after a
 * message when --prompt needs one that cannot be opened. */
static int open_tokenizer(const gen_opts *o, lf_tokenizer **tok, char *no_tok, size_t cap) {
  lf_status ts = lf_model_tokenizer_open(o->cfg.model_path, tok, no_tok, cap);
  if (ts != LF_OK && o->prompt_text) {
    fprintf(stderr, "lfgen: %s: %s\n", lf_status_str(ts), lf_last_error());
    return 1;
  }
  if (ts != LF_OK) { /* say why there is none */
    snprintf(no_tok, cap, "%s", lf_last_error());
    fprintf(stderr, "lfgen: warning: no tokenizer (%s): printing token ids\n", no_tok);
    *tok = NULL;
  }
  return 0;
}

/* --prompt (with --chat: as one user message in the chat template) -> o->ids. Returns 0, or 2
 * after a message. */
static int encode_prompt(gen_opts *o, const lf_tokenizer *tok, const char *no_tok) {
  if (!tok) {
    fprintf(stderr, "lfgen: --prompt needs a tokenizer (%s); use --prompt-ids\n", no_tok);
    return 2;
  }
  lf_tok_text rendered = {0};
  lf_token_ids enc = {0};
  lf_status ts = LF_OK;
  if (o->chat) {
    lf_chat_template *tmpl = NULL;
    ts = lf_model_chat_template_open_as(o->cfg.model_path, o->chat_template, &tmpl);
    if (ts != LF_OK) {
      fprintf(stderr, "lfgen: --chat: %s; give --chat-template chatml|llama3|deepseek-r1 to "
                      "choose one, or drop --chat\n", lf_last_error());
      return 2;
    }
    lf_chat_message msg = {"user", o->prompt_text};
    ts = lf_chat_template_render(tmpl, &msg, 1, 1, &rendered);
    lf_chat_template_free(tmpl);
    /* The rendered template carries its own BOS and markers. */
    if (ts == LF_OK) ts = lf_tokenizer_encode(tok, rendered.data, rendered.len, 0, &enc);
  } else {
    ts = lf_tokenizer_encode(tok, o->prompt_text, strlen(o->prompt_text), LF_TOK_ADD_SPECIAL,
                             &enc);
  }
  lf_tok_text_free(&rendered);
  if (ts == LF_OK && enc.n == 0) {
    fprintf(stderr, "lfgen: the prompt is empty: it encodes to no tokens (this tokenizer adds "
                    "no BOS); give a non-empty --prompt, or --prompt-ids\n");
    lf_token_ids_free(&enc);
    return 2;
  }
  if (ts != LF_OK || enc.n > INT_MAX) {
    fprintf(stderr, "lfgen: cannot encode the prompt: %s: %s\n", lf_status_str(ts),
            ts == LF_OK ? "more than INT_MAX tokens" : lf_last_error());
    lf_token_ids_free(&enc);
    return 2;
  }
  o->ids = enc.ids; /* malloc'ed: freed with free() like parse_ids' array */
  o->rq.n_prompt = (int)enc.n;
  return 0;
}

/* lf_engine_init with a progress line every few seconds on rank 0 (load_progress_main). */
static lf_status init_engine(const gen_opts *o, lf_comm_t comm, double t_load, lf_engine_t *e) {
  load_progress lp = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, t_load};
  pthread_t lp_thread;
  const int lp_on = lf_comm_rank(comm) == 0 &&
                    pthread_create(&lp_thread, NULL, load_progress_main, &lp) == 0;
  lf_status s = lf_engine_init(&o->cfg, comm, e);
  if (lp_on) {
    pthread_mutex_lock(&lp.mu);
    lp.done = 1;
    pthread_cond_signal(&lp.cv);
    pthread_mutex_unlock(&lp.mu);
    pthread_join(lp_thread, NULL);
  }
  return s;
}

/* A rank other than 0: runs rank 0's steps until it frees its engine. main's exit status. */
static int follow(lf_engine_t e, lf_comm_t comm) {
  lf_status s = lf_engine_follow(e);
  if (s != LF_OK)
    fprintf(stderr, "lfgen: rank %d: %s: %s\n", lf_comm_rank(comm), lf_status_str(s),
            lf_last_error());
  lf_engine_free(e);
  if (s != LF_OK) return 1; /* without MPI_Finalize: the launcher ends the job */
  lf_tp_end(comm);
  return 0;
}

/* The same limits as the server's: the prompt must fit the context, and --max-tokens what it
 * leaves (the last token is sampled, never stored); the default is cut to that room. Returns 0,
 * or 2 after a message. */
static int fit_context(gen_opts *o, const lf_resolved_config *rc) {
  lf_request *rq = &o->rq;
  const int ctx = rc->max_seq_len, room = ctx - rq->n_prompt + 1;
  if (rq->n_prompt > ctx || (o->max_tokens_given && rq->max_tokens > room)) {
    if (rq->n_prompt > ctx)
      fprintf(stderr, "lfgen: the prompt has %d tokens; the model's context is %d tokens\n",
              rq->n_prompt, ctx);
    else
      fprintf(stderr,
              "lfgen: the prompt (%d tokens) plus --max-tokens %d exceed the model's context of "
              "%d tokens: at most %d can be generated\n",
              rq->n_prompt, rq->max_tokens, ctx, room);
    return 2;
  }
  if (rq->max_tokens > room) rq->max_tokens = room;
  return 0;
}

/* Steps the engine until request id finishes, writing its tokens to stdout as they come: text
 * (whole UTF-8 characters only) when tok is given, else ids, then a newline. *why gets the
 * finish reason. Returns 0, or 1 after a message. */
static int run_events(lf_engine_t e, const lf_request *rq, const lf_resolved_config *rc,
                      const lf_tokenizer *tok, lf_finish_reason *why) {
  int n_out = 0, rc_exit = 0;
  lf_tok_stream tstream;
  lf_tok_text piece = {0};
  if (tok && lf_tok_stream_init(&tstream, tok, LF_TOK_SKIP_SPECIAL) != LF_OK) {
    fprintf(stderr, "lfgen: out of memory\n");
    return 1;
  }
  lf_event ev[16];
  while (lf_engine_busy(e)) {
    int n;
    lf_status s = lf_engine_step(e, ev, 16, &n);
    if (s != LF_OK) {
      fprintf(stderr, "\nlfgen: step failed: %s: %s\n", lf_status_str(s), lf_last_error());
      rc_exit = 1;
      break;
    }
    for (int i = 0; i < n; i++) {
      if (ev[i].type == LF_EVENT_TOKEN && tok) {
        lf_tok_text_clear(&piece);
        if (lf_tok_stream_put(&tstream, ev[i].token, &piece) == LF_OK)
          fwrite(piece.data, 1, piece.len, stdout);
        fflush(stdout);
        n_out++;
      } else if (ev[i].type == LF_EVENT_TOKEN) {
        printf(n_out ? " %d" : "%d", ev[i].token);
        fflush(stdout);
        n_out++;
      } else {
        *why = ev[i].reason;
        if (*why == LF_FINISH_ERROR && ev[i].status == LF_ERR_CONTEXT_FULL) {
          /* The engine reports only the status: the figures are ours. The sequence holds the
           * prompt and every sampled token but the last (never fed back). */
          const int need = rq->n_prompt + rq->max_tokens - 1;
          fprintf(stderr,
                  "\nlfgen: generation failed: context full: the full policy keeps every token, "
                  "and the pool of --budget %d slots filled after %d prompt + %d generated "
                  "tokens; %d prompt + --max-tokens %d need --budget %d or more. Give a larger "
                  "--budget, fewer --max-tokens, or an evicting --policy (longflow, streaming, "
                  "h2o)\n",
                  rc->budget, rq->n_prompt, n_out, rq->n_prompt, rq->max_tokens, need);
          rc_exit = 1;
        } else if (*why == LF_FINISH_ERROR) {
          fprintf(stderr, "\nlfgen: generation failed: %s\n", lf_status_str(ev[i].status));
          rc_exit = 1;
        }
      }
    }
  }
  if (tok) {
    lf_tok_text_clear(&piece);
    if (lf_tok_stream_flush(&tstream, &piece) == LF_OK) fwrite(piece.data, 1, piece.len, stdout);
    lf_tok_stream_free(&tstream);
    lf_tok_text_free(&piece);
  }
  printf("\n");
  return rc_exit;
}

static void print_loaded(const gen_opts *o, const lf_model_info *mi, const lf_resolved_config *rc,
                         double load_s) {
  const char *lora = o->cfg.lora_path;
  char per_layer[64] = "";
  if (rc->budget_min != rc->budget_max)
    snprintf(per_layer, sizeof per_layer, " (per layer %d-%d)", rc->budget_min, rc->budget_max);
  fprintf(stderr, "lfgen: %s model%s%s, %d layers, %d/%d heads, vocab %d; policy %s, scope %s, "
                  "kv %s, budget %d%s, loaded in %.2f s\n",
          mi->model_type, lora && lora[0] ? " + LoRA adapter " : "", lora ? lora : "",
          mi->n_layers, mi->n_heads, mi->n_kv_heads, mi->vocab_size, lf_policy_str(rc->policy),
          lf_evict_scope_str(rc->evict_scope), lf_kv_dtype_str(rc->kv_dtype), rc->budget,
          per_layer, load_s);
}

static void print_stats(lf_engine_t e, uint64_t id, lf_finish_reason why,
                        const lf_resolved_config *rc) {
  char tp_note[80] = "";
  if (rc->n_ranks > 1)
    snprintf(tp_note, sizeof tp_note, "; tp %d (tensor parallel over %d ranks)", rc->n_ranks,
             rc->n_ranks);
  lf_request_stats st;
  if (lf_engine_request_stats(e, id, &st) == LF_OK) {
    fprintf(stderr,
            "lfgen: %d prompt + %d generated tokens, finish %s; time to first token %.3f s, "
            "%.1f tokens/s decode; slots filled %d of %d; evictions %llu (slot overwrites over "
            "all layers and KV heads)%s\n",
            st.prompt_tokens, st.generated_tokens, lf_finish_reason_str(why), st.ttft_seconds,
            st.tpot_seconds > 0 ? 1.0 / st.tpot_seconds : 0.0, st.slots_filled, rc->budget,
            (unsigned long long)st.evictions, tp_note);
  }
}

int main(int argc, char **argv) {
  gen_opts o;
  memset(&o, 0, sizeof o);
  int rc = parse_args(argc, argv, &o);
  if (rc != GEN_GO) { /* a refused option after --prompt-ids: its ids are ours to free */
    free(o.ids);
    return rc;
  }
  lf_tokenizer *tok = NULL;
  char no_tok[4200] = "";
  if (open_tokenizer(&o, &tok, no_tok, sizeof no_tok)) {
    free(o.ids);
    return 1;
  }
  if (o.chat && !o.prompt_text) {
    fprintf(stderr, "lfgen: --chat needs --prompt\n");
    return 2;
  }
  if (o.prompt_text && !o.ids && (rc = encode_prompt(&o, tok, no_tok)) != 0) {
    lf_tokenizer_free(tok);
    free(o.ids);
    return rc;
  }
  if (!o.ids) {
    fprintf(stderr, "lfgen: give --prompt-ids\n");
    return 2;
  }
  o.rq.prompt = o.ids;

  const double t_load = lf_now_s();
  lf_comm_t comm = NULL;
  lf_engine_t e;
  lf_status s = LF_OK;
  if (o.want_tp && (s = lf_tp_start(&argc, &argv, o.cfg.backend, &comm)) != LF_OK) {
    fprintf(stderr, "lfgen: --tp: %s: %s\n", lf_status_str(s), lf_last_error());
    free(o.ids);
    return 1;
  }
  if ((s = init_engine(&o, comm, t_load, &e)) != LF_OK) {
    fprintf(stderr, "lfgen: %s: %s\n", lf_status_str(s), lf_last_error());
    free(o.ids);
    return 1;
  }
  if (lf_comm_rank(comm) != 0) { /* a follower: rank 0 decides and prints */
    free(o.ids);
    return follow(e, comm);
  }
  lf_model_info mi;
  lf_engine_model_info(e, &mi);
  lf_resolved_config rc_eng; /* what the engine runs with: the budget with its default resolved */
  lf_engine_resolved_config(e, &rc_eng);
  print_loaded(&o, &mi, &rc_eng, lf_now_s() - t_load);
  if ((rc = fit_context(&o, &rc_eng)) != 0) {
    lf_engine_free(e); /* releases the followers */
    lf_tokenizer_free(tok);
    free(o.ids);
    lf_tp_end(comm);
    return rc;
  }

  uint64_t id;
  s = lf_engine_submit(e, &o.rq, &id);
  if (s != LF_OK) {
    fprintf(stderr, "lfgen: %s: %s\n", lf_status_str(s), lf_last_error());
    lf_engine_free(e);
    free(o.ids);
    return 1;
  }
  lf_finish_reason why = LF_FINISH_NONE;
  /* Text output when a tokenizer exists, unless --print-ids. */
  rc = run_events(e, &o.rq, &rc_eng, o.print_ids ? NULL : tok, &why);
  print_stats(e, id, why, &rc_eng);
  lf_engine_free(e); /* releases the followers */
  lf_tokenizer_free(tok);
  free(o.ids);
  if (rc == 0) lf_tp_end(comm);
  return rc;
}

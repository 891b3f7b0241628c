/* generate: the smallest complete use of include/lfserve.h.
 *
 * Loads a model, submits two prompts as two requests, steps the engine until both are done and
 * streams each one's text as it is generated (a line at a time, tagged with its request).
 *
 *   generate MODEL [PROMPT1 [PROMPT2]] [--max-tokens N] [--budget B]
 *
 * MODEL is anything lf_engine_config.model_path takes that carries a tokenizer: a Hugging Face
 * directory with tokenizer.json (e.g. the repository's models/trace) or a GGUF file (e.g.
 * SmolLM2, `bash tools/smollm2.sh` prints its path). Greedy decoding; LongFlow eviction at a
 * budget of B KV slots per layer (default: the model's context, i.e. no eviction).
 *
 * Build: see examples/CMakeLists.txt, or
 *   cc generate.c $(pkg-config --cflags --libs lfserve) -o generate
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <lfserve.h>

#define N_REQ 2

/* Each request's text not yet printed: printed up to its last newline after every token, and
 * whatever is left when the request finishes. */
typedef struct {
  char *buf;
  size_t len, cap;
} text_buf;

static int append(text_buf *b, const char *s, size_t n) {
  if (b->len + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap * 2 : 256;
    while (cap < b->len + n + 1) cap *= 2;
    char *p = realloc(b->buf, cap);
    if (!p) return -1;
    b->buf = p;
    b->cap = cap;
  }
  memcpy(b->buf + b->len, s, n);
  b->len += n;
  b->buf[b->len] = '\0';
  return 0;
}

/* Prints b's complete lines (all of it when final), each tagged "[k] ". */
static void print_lines(int k, text_buf *b, int final) {
  size_t start = 0;
  for (size_t i = 0; i < b->len; i++) {
    if (b->buf[i] != '\n') continue;
    printf("[%d] %.*s\n", k, (int)(i - start), b->buf + start);
    start = i + 1;
  }
  if (final && start < b->len) printf("[%d] %s\n", k, b->buf + start);
  if (final) start = b->len;
  memmove(b->buf, b->buf + start, b->len - start);
  b->len -= start;
  fflush(stdout);
}

/* The prompt, each line tagged "[k] > ". */
static void print_prompt(int k, const char *p) {
  while (*p) {
    const char *nl = strchr(p, '\n');
    const int n = nl ? (int)(nl - p) : (int)strlen(p);
    printf("[%d] > %.*s\n", k, n, p);
    p += n + (nl != NULL);
  }
}

static int fail(const char *what, lf_status s) {
  fprintf(stderr, "generate: %s: %s: %s\n", what, lf_status_str(s), lf_last_error());
  return 1;
}

int main(int argc, char **argv) {
  const char *model = NULL;
  const char *prompts[N_REQ] = {"Once upon a time", "The best way to learn"};
  int n_prompts = 0, max_tokens = 64, budget = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--max-tokens") && i + 1 < argc)
      max_tokens = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--budget") && i + 1 < argc)
      budget = atoi(argv[++i]);
    else if (!model)
      model = argv[i];
    else if (n_prompts < N_REQ)
      prompts[n_prompts++] = argv[i];
    else {
      fprintf(stderr, "generate: unexpected argument '%s'\n", argv[i]);
      return 2;
    }
  }
  if (!model || max_tokens < 1 || budget < 0) {
    fprintf(stderr, "usage: generate MODEL [PROMPT1 [PROMPT2]] [--max-tokens N] [--budget B]\n");
    return 2;
  }

  lf_tokenizer *tok = NULL;
  lf_status s = lf_tokenizer_open(model, &tok);
  if (s != LF_OK) return fail("tokenizer", s);

  lf_engine_config cfg;
  lf_engine_config_default(&cfg);
  cfg.model_path = model;
  cfg.budget = budget;
  cfg.n_pools = N_REQ; /* both requests run at once */
  lf_engine_t e = NULL;
  s = lf_engine_init(&cfg, NULL, &e);
  if (s != LF_OK) {
    lf_tokenizer_free(tok);
    return fail("engine", s);
  }
  lf_model_info mi;
  lf_engine_model_info(e, &mi);
  fprintf(stderr, "generate: lfserve %s, %s model, %d layers, vocab %d\n", lf_version(),
          mi.model_type, mi.n_layers, mi.vocab_size);
  /* what the engine made of the config: a budget of 0 is the model's context, and so on */
  lf_resolved_config rc_cfg;
  if (lf_engine_resolved_config(e, &rc_cfg) == LF_OK)
    fprintf(stderr, "generate: %s backend, policy %s, %d KV slots per pool, %d pools, kv %s\n",
            rc_cfg.backend == LF_BACKEND_CUDA ? "cuda" : "cpu", lf_policy_str(rc_cfg.policy),
            rc_cfg.budget, rc_cfg.n_pools, lf_kv_dtype_str(rc_cfg.kv_dtype));

  int rc = 0;
  uint64_t ids[N_REQ];
  lf_detokenizer *detok[N_REQ] = {NULL};
  text_buf out[N_REQ] = {{0}};
  for (int k = 0; k < N_REQ && rc == 0; k++) {
    int32_t *prompt = NULL;
    int n = 0;
    s = lf_tokenize(tok, prompts[k], 1, &prompt, &n);
    if (s == LF_OK && n == 0) {
      fprintf(stderr, "generate: prompt %d is empty\n", k + 1);
      rc = 1;
      break;
    }
    lf_request rq = {0};
    rq.prompt = prompt;
    rq.n_prompt = n;
    rq.max_tokens = max_tokens; /* sampling left zero: greedy */
    if (s == LF_OK) s = lf_engine_submit(e, &rq, &ids[k]); /* the prompt is copied */
    lf_free(prompt);
    if (s == LF_OK) s = lf_detokenizer_init(tok, &detok[k]);
    if (s != LF_OK) rc = fail("submit", s);
    else print_prompt(k + 1, prompts[k]);
  }

  lf_event ev[32];
  while (rc == 0 && lf_engine_busy(e)) {
    int n = 0;
    s = lf_engine_step(e, ev, 32, &n);
    if (s != LF_OK) {
      rc = fail("step", s);
      break;
    }
    for (int i = 0; i < n; i++) {
      int k = ev[i].id == ids[0] ? 0 : 1;
      const char *piece;
      size_t len;
      if (ev[i].type == LF_EVENT_TOKEN) {
        if ((s = lf_detokenizer_put(detok[k], ev[i].token, &piece, &len)) != LF_OK) {
          rc = fail("detokenize", s);
          break;
        }
        if (append(&out[k], piece, len)) {
          fprintf(stderr, "generate: out of memory\n");
          rc = 1;
          break;
        }
        print_lines(k + 1, &out[k], 0);
      } else { /* LF_EVENT_FINISH: the request's last event */
        if (lf_detokenizer_flush(detok[k], &piece, &len) == LF_OK) append(&out[k], piece, len);
        print_lines(k + 1, &out[k], 1);
        lf_request_stats st;
        lf_engine_request_stats(e, ev[i].id, &st);
        printf("[%d] finished: %s, %d prompt + %d generated tokens, %llu evictions\n", k + 1,
               lf_finish_reason_str(ev[i].reason), st.prompt_tokens, st.generated_tokens,
               (unsigned long long)st.evictions);
        if (ev[i].reason == LF_FINISH_ERROR) rc = fail("generation", ev[i].status);
      }
    }
  }
  for (int k = 0; k < N_REQ; k++) {
    lf_detokenizer_free(detok[k]);
    free(out[k].buf);
  }
  lf_engine_free(e);
  lf_tokenizer_free(tok);
  return rc;
}

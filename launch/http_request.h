/* OpenAI-style request bodies -> engine requests, with every check the server makes before it
 * submits. No HTTP here, so the libFuzzer target (fuzz/fuzz_request.c) drives exactly this code.
 *
 * /v1/completions:      prompt: string | [int...] | [string] | [[int...]] (one prompt; n = 1)
 * /v1/chat/completions: messages: [{role, content: string | [{type:"text", text}...]}...]
 * Both: model, max_tokens (chat also max_completion_tokens), temperature, top_p, top_k, seed,
 * stop (string | [string | int | [int...]]: strings are matched on the decoded text, at most
 * LFS_MAX_STOP_BYTES bytes each; ids and id arrays on tokens), stop_token_ids [int], stream,
 * stream_options {include_usage}, n (1 only), ignore_eos and return_token_ids (extensions, as in
 * vLLM), presence_penalty, frequency_penalty ([-2, 2]), repetition_penalty ((0, 100], vLLM's),
 * logit_bias ({"id": bias in [-100, 100]}, at most LFS_MAX_LOGIT_BIAS), chat: logprobs (bool)
 * and top_logprobs (0..20); completions: logprobs (0..5), echo, best_of (1 only).
 * response_format is accepted as {"type": "text"} only. user is accepted and ignored
 * (lfs_ignored_members). Any other member is a 400 naming it (tools, functions, suffix, ...),
 * and so is a known member of the wrong type.
 * Bodies are parsed with cJSON behind strict RFC 8259 checks (http_request.c has the details):
 * integers are read through doubles, a duplicate member's first occurrence counts, and strings
 * holding "\u0000" are refused.
 */
#ifndef LF_HTTP_REQUEST_H
#define LF_HTTP_REQUEST_H

#include <stddef.h>
#include <stdint.h>

#include "text/tokenizer.h"
#include "launch/http_stop.h"
#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LFS_MAX_STOP_BYTES 512
#define LFS_MAX_LOGIT_BIAS 1024
#define LFS_MAX_LOGPROBS_COMPLETION 5

/* What the server knows about its model when it checks a request. */
typedef struct lfs_model_ctx {
  const lf_tokenizer *tok;      /* NULL: token-id prompts only, no text */
  const lf_chat_template *tmpl; /* NULL: no /v1/chat/completions */
  const char *model_name;       /* the one served model id */
  int vocab_size;               /* the model's (ids must be below it) */
  int max_seq_len;              /* the model's context */
  int budget;                   /* slots per pool (B) */
  lf_policy policy;
  int max_stop; /* most stop entries (default 16 when 0) */
  /* Chat: read special-token text in message content as real markers (Hugging Face's
   * apply_chat_template behaviour). 0, the default: content is plain text, so a user writing
   * "<|im_end|>" cannot end the turn or forge another role's turn. */
  int chat_content_special;
} lfs_model_ctx;

typedef struct lfs_request {
  int chat; /* parsed as a chat completion */
  int stream, include_usage, return_token_ids;
  int32_t *prompt; /* [n_prompt] */
  int n_prompt;
  int max_tokens;
  lf_sampling sampling;
  int ignore_eos;
  int32_t *stop_ids; /* [n_stop_ids] single ids */
  int n_stop_ids;
  lf_stop_seq *stop_seqs; /* [n_stop_seqs], each ids owned: "stop" given as id arrays */
  int n_stop_seqs;
  lfs_stop_str *stop_strs; /* [n_stop_strs], each owned: "stop" strings, matched on the text */
  int n_stop_strs;
  lf_logit_bias *logit_bias; /* [sampling.n_logit_bias], owned; sampling.logit_bias points here */
  /* Log-probabilities: chat `logprobs` true (top: top_logprobs), completions `logprobs` n
   * (top: n); sampling.logprobs / top_logprobs / prompt_logprobs are set to match */
  int logprobs, top_logprobs;
  int echo; /* completions: the prompt goes first in the text (and the logprobs) */
} lfs_request;

/* An OpenAI-style error: {"error": {"message", "type", "param", "code"}} with an HTTP status. */
typedef struct lfs_error {
  int status;       /* 400, 404, 413, 429, 500, 503 */
  const char *type; /* "invalid_request_error", ... */
  const char *code; /* "invalid_value", "model_not_found", "context_length_exceeded", ... */
  char param[48];   /* the offending member ("" when none) */
  char message[400];
} lfs_error;

void lfs_error_set(lfs_error *e, int status, const char *type, const char *code, const char *param,
                   const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* Request members the server accepts without acting on them (they only describe the client);
 * NULL-terminated. Every member that is neither acted on nor listed here is refused (400). */
extern const char *const lfs_ignored_members[];

/* Parses and checks body[0..len). On success returns 0 and fills *out (free with
 * lfs_request_free); on failure returns -1, fills *err and leaves *out empty. */
int lfs_request_parse(const lfs_model_ctx *m, int chat, const char *body, size_t len,
                      lfs_request *out, lfs_error *err);
void lfs_request_free(lfs_request *r);

#ifdef __cplusplus
}
#endif
#endif

/* libFuzzer target: the server's request parser (launch/http_request.c: its RFC 8259 checks, then
 * cJSON) and JSON writer, with a real byte-level BPE tokenizer and chat template, on arbitrary
 * bodies.
 * The first byte picks the endpoint (completions / chat) and the policy (longflow / full). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/json.h"
#include "launch/http_json.h"
#include "launch/http_request.h"

static lfs_model_ctx ctx;

static void setup(void) {
  static int done;
  if (done) return;
  done = 1;
  const char *dir = getenv("LF_FUZZ_TOKENIZER_DIR");
  char path[4096];
  if (!dir) dir = LF_SOURCE_DIR "/tests/data/tokenizers/bytelevel_qwen2";
  snprintf(path, sizeof path, "%s/tokenizer.json", dir);
  lf_tokenizer *tok = NULL;
  lf_chat_template *tmpl = NULL;
  if (lf_tokenizer_init_file(path, &tok) != LF_OK) {
    fprintf(stderr, "fuzz_request: %s: %s\n", path, lf_last_error());
    abort();
  }
  if (lf_chat_template_init_dir(dir, NULL, &tmpl) != LF_OK) tmpl = NULL;
  ctx.tok = tok;
  ctx.tmpl = tmpl;
  ctx.model_name = "m";
  ctx.vocab_size = lf_tokenizer_vocab_size(tok);
  ctx.max_seq_len = 4096;
  ctx.budget = 256;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  setup();
  if (size < 1) return 0;
  lfs_model_ctx c = ctx;
  c.policy = (data[0] & 2) ? LF_POLICY_FULL : LF_POLICY_LONGFLOW;
  lfs_request r;
  lfs_error err;
  if (lfs_request_parse(&c, data[0] & 1, (const char *)data + 1, size - 1, &r, &err) == 0) {
    if (r.n_prompt < 1 || r.max_tokens < 1 || r.n_prompt + r.max_tokens - 1 > c.max_seq_len)
      abort();
    for (int i = 0; i < r.n_prompt; i++)
      if (r.prompt[i] < 0 || r.prompt[i] >= c.vocab_size) abort();
    /* what the engine's submit would refuse must not get through */
    const lf_sampling *sp = &r.sampling;
    if (sp->n_logit_bias < 0 || sp->n_logit_bias > LFS_MAX_LOGIT_BIAS ||
        (sp->n_logit_bias > 0 && !sp->logit_bias))
      abort();
    for (int i = 0; i < sp->n_logit_bias; i++)
      if (sp->logit_bias[i].token < 0 || sp->logit_bias[i].token >= c.vocab_size ||
          !(sp->logit_bias[i].bias >= -LF_LOGIT_BIAS_MAX && sp->logit_bias[i].bias <= LF_LOGIT_BIAS_MAX))
        abort();
    if (sp->top_logprobs < 0 || sp->top_logprobs > LF_MAX_TOP_LOGPROBS ||
        !(sp->repetition_penalty >= 0.0f) || (sp->prompt_logprobs && (r.chat || !sp->logprobs)))
      abort();
    lfs_request_free(&r);
  } else {
    if (err.status < 400 || err.status > 599 || !err.message[0]) abort();
  }
  /* The writer must turn any bytes into a valid JSON string: checked with the engine's strict
   * parser (engine/json.c validates UTF-8; cJSON, which parses the requests, does not). */
  lfs_buf b = {0};
  lfs_buf_json_str(&b, (const char *)data, size);
  lf_json *j = NULL;
  if (!b.oom && lf_json_parse(b.data, b.len, &j, NULL, 0) != LF_OK) abort();
  lf_json_free(j);
  lfs_buf_free(&b);
  return 0;
}

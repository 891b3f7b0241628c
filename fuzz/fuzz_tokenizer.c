/* libFuzzer target: tokenizer encode / decode / streaming decode on arbitrary input, for a
 * byte-level BPE (Qwen2-style) and a sentencepiece-style BPE tokenizer.
 * The first byte picks the tokenizer and the flags; the rest is text to encode, and also read as
 * 16-bit ids to decode (whole and streamed: the stream must never emit broken UTF-8). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/json.h"
#include "text/tokenizer.h"

static lf_tokenizer *toks[2];

static void setup(void) {
  static int done;
  if (done) return;
  done = 1;
  const char *names[2] = {"bytelevel_qwen2", "sentencepiece_llama2"};
  for (int i = 0; i < 2; i++) {
    char path[4096];
    snprintf(path, sizeof path, "%s/tests/data/tokenizers/%s/tokenizer.json", LF_SOURCE_DIR,
             names[i]);
    if (lf_tokenizer_init_file(path, &toks[i]) != LF_OK) {
      fprintf(stderr, "fuzz_tokenizer: %s: %s\n", path, lf_last_error());
      abort();
    }
  }
}

static int valid_utf8(const char *s, size_t n) {
  /* Valid iff the library's JSON parser accepts it inside a string: cheap reuse. */
  char *q = malloc(n + 2);
  if (!q) return 1;
  q[0] = '"';
  size_t k = 1;
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c < 0x20 || c == '"' || c == '\\') c = 'x';
    q[k++] = (char)c;
  }
  q[k++] = '"';
  lf_json *j = NULL;
  int ok = lf_json_parse(q, k, &j, NULL, 0) == LF_OK;
  lf_json_free(j);
  free(q);
  return ok;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  setup();
  if (size < 1) return 0;
  const lf_tokenizer *t = toks[data[0] & 1];
  const unsigned eflags =
      ((data[0] & 2) ? LF_TOK_ADD_SPECIAL : 0) | ((data[0] & 4) ? LF_TOK_PLAIN_SPECIAL : 0);
  const unsigned dflags = (data[0] & 8) ? LF_TOK_SKIP_SPECIAL : 0;
  const char *text = (const char *)data + 1;
  const size_t n = size - 1;
  lf_token_ids ids = {0};
  lf_tok_text out = {0}, piece = {0};
  if (lf_tokenizer_encode(t, text, n, eflags, &ids) == LF_OK) {
    if (lf_tokenizer_decode(t, ids.ids, ids.n, dflags, &out) != LF_OK) abort();
  }
  /* Arbitrary ids (in range) through decode and the stream decoder. */
  const int32_t V = lf_tokenizer_vocab_size(t);
  size_t m = n / 2;
  int32_t *arb = malloc(sizeof(int32_t) * (m ? m : 1));
  if (!arb) goto done;
  for (size_t i = 0; i < m; i++)
    arb[i] = (int32_t)((data[1 + 2 * i] | (data[2 + 2 * i] << 8)) % V);
  lf_tokenizer_decode(t, arb, m, dflags, &out);
  lf_tok_stream st;
  if (lf_tok_stream_init(&st, t, dflags) == LF_OK) {
    for (size_t i = 0; i < m; i++) {
      lf_tok_text_clear(&piece);
      if (lf_tok_stream_put(&st, arb[i], &piece) == LF_OK && !valid_utf8(piece.data, piece.len))
        abort();
    }
    lf_tok_text_clear(&piece);
    if (lf_tok_stream_flush(&st, &piece) == LF_OK && !valid_utf8(piece.data, piece.len)) abort();
    lf_tok_stream_free(&st);
  }
  free(arb);
done:
  lf_token_ids_free(&ids);
  lf_tok_text_free(&out);
  lf_tok_text_free(&piece);
  return 0;
}

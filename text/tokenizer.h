/* Hugging Face tokenizer.json: encode, decode, streaming decode; and built-in chat templates.
 *
 * Two families are supported, and must give the same ids as the `tokenizers` library:
 *  - byte-level BPE (Llama-3, Qwen2/Qwen3, DeepSeek-R1 distills): added tokens split out first,
 *    the NFC normalizer where present (Qwen), the pre-tokenizer regexes (Split, or ByteLevel's
 *    own GPT-2 regex; PCRE2 with UTF + UCP), the GPT-2 byte<->unicode mapping and BPE merges by
 *    rank. Needs PCRE2: without it these files load with LF_ERR_UNAVAILABLE.
 *  - sentencepiece-style BPE (Llama-2 family): normalizer Prepend("▁") + Replace(" " -> "▁") or
 *    the newer Metaspace pre-tokenizer, byte fallback to <0xXX> tokens, decoder ▁ -> space with
 *    the leading space stripped.
 * Other model types (WordPiece, Unigram, ...) and other normalizers / pre-tokenizers / decoders
 * are refused at load with LF_ERR_UNSUPPORTED naming the part.
 *
 * A loaded tokenizer is immutable: encode/decode from many threads at once is fine (every call
 * uses its own scratch memory). A stream decoder is per request.
 */
#ifndef LF_TOKENIZER_H
#define LF_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "lfserve.h"

#ifdef __cplusplus
extern "C" {
#endif

/* lf_tokenizer is declared in include/lfserve.h. */

/* A growable id array, owned by the caller (zero-initialise, free with lf_token_ids_free). */
typedef struct lf_token_ids {
  int32_t *ids; /* [n] */
  size_t n, cap;
} lf_token_ids;
void lf_token_ids_free(lf_token_ids *v);

/* A growable byte string, NUL-terminated after every append (zero-initialise, free with
 * lf_tok_text_free). Output of decode and of the chat templates is valid UTF-8. */
typedef struct lf_tok_text {
  char *data; /* [len + 1] */
  size_t len, cap;
} lf_tok_text;
void lf_tok_text_free(lf_tok_text *t);
lf_status lf_tok_text_append(lf_tok_text *t, const char *s, size_t n);
lf_status lf_tok_text_clear(lf_tok_text *t); /* empty, but data is non-NULL ("") */

enum {
  /* encode: apply the post-processor template (e.g. prepend <|begin_of_text|> or <s>), as
   * `tokenizers`' add_special_tokens=True does. */
  LF_TOK_ADD_SPECIAL = 1u << 0,
  /* encode: do not recognise special added tokens written in the text (treat "<|im_end|>" in
   * untrusted user content as plain text). Non-special added tokens are still recognised. */
  LF_TOK_PLAIN_SPECIAL = 1u << 1,
  /* decode: drop added tokens whose "special" flag is set (skip_special_tokens=True). */
  LF_TOK_SKIP_SPECIAL = 1u << 2,
};

/* Loads tokenizer.json from text[0..len) or from a file path. */
lf_status lf_tokenizer_init(const char *json, size_t len, lf_tokenizer **out);
lf_status lf_tokenizer_init_file(const char *path, lf_tokenizer **out);
void lf_tokenizer_free(lf_tokenizer *t);

/* One past the largest id (model vocab and added tokens together). */
int32_t lf_tokenizer_vocab_size(const lf_tokenizer *t);
/* The token's string as stored (byte-level tokens are in their mapped form); NULL if unknown. */
const char *lf_tokenizer_id_to_token(const lf_tokenizer *t, int32_t id);
/* The id of an exact token string (vocab or added token), or -1. */
int32_t lf_tokenizer_token_to_id(const lf_tokenizer *t, const char *token);
/* 1 when id is an added token marked special (BOS/EOS/chat markers). */
int lf_tokenizer_is_special(const lf_tokenizer *t, int32_t id);

/* text[0..len) (UTF-8; invalid bytes are an error) -> ids, replacing out's contents. */
lf_status lf_tokenizer_encode(const lf_tokenizer *t, const char *text, size_t len, unsigned flags,
                              lf_token_ids *out);
/* A byte range [begin, end) of a text. */
typedef struct lf_text_range {
  size_t begin, end;
} lf_text_range;

/* Encode with special added tokens recognised only outside the `plain` ranges (sorted, not
 * overlapping): a special token whose text touches a plain range is read as plain text there, as
 * LF_TOK_PLAIN_SPECIAL does for the whole text. Everything else is as lf_tokenizer_encode (the
 * text between recognised tokens is one segment, wherever the ranges cut it, so a text without
 * special-token strings in its plain ranges gets exactly lf_tokenizer_encode's ids).
 * n_plain 0 is lf_tokenizer_encode. */
lf_status lf_tokenizer_encode_ranges(const lf_tokenizer *t, const char *text, size_t len,
                                     unsigned flags, const lf_text_range *plain, size_t n_plain,
                                     lf_token_ids *out);
/* ids -> text, replacing out's contents; the same text as `tokenizers`' decode (invalid byte
 * sequences become U+FFFD as it does). Unknown ids are LF_ERR_INVALID_ARG. */
lf_status lf_tokenizer_decode(const lf_tokenizer *t, const int32_t *ids, size_t n, unsigned flags,
                              lf_tok_text *out);

/* Streaming decode, one per request: feed ids as they are generated; each call appends to out
 * only whole UTF-8 characters, holding back the bytes of a character still incomplete. The
 * concatenation of every append and the final flush equals lf_tokenizer_decode of all ids
 * whenever those decode to valid UTF-8; for invalid byte runs both emit U+FFFD, though the
 * count may differ from the batch decode under byte fallback. */
typedef struct lf_tok_stream {
  const lf_tokenizer *tok;
  unsigned flags;
  uint8_t pending[8]; /* [npending] bytes of an incomplete character */
  int npending;
  int pending_fallback; /* pending came from <0xXX> tokens (sentencepiece byte fallback) */
  int at_start;         /* leading spaces the decoder may still strip (Strip decoder) */
  int first_token;      /* no token decoded yet (Metaspace strips only the first token's) */
} lf_tok_stream;
lf_status lf_tok_stream_init(lf_tok_stream *s, const lf_tokenizer *t, unsigned flags);
lf_status lf_tok_stream_put(lf_tok_stream *s, int32_t id, lf_tok_text *out);
/* Ends the stream: any incomplete bytes become U+FFFD. */
lf_status lf_tok_stream_flush(lf_tok_stream *s, lf_tok_text *out);
void lf_tok_stream_free(lf_tok_stream *s);

/* ---- chat templates ---------------------------------------------------------------------- */

typedef enum lf_chat_format {
  LF_CHAT_NONE = 0,
  LF_CHAT_LLAMA3,      /* <|start_header_id|>role<|end_header_id|>\n\n content <|eot_id|> */
  LF_CHAT_CHATML,      /* <|im_start|>role\n content <|im_end|>\n (Qwen) */
  LF_CHAT_DEEPSEEK_R1, /* <｜User｜> ... <｜Assistant｜> ... <｜end▁of▁sentence｜> */
} lf_chat_format;

/* lf_chat_message is public (include/lfserve.h). */

typedef struct lf_chat_template lf_chat_template;

/* A built-in format by name: "chatml", "llama3", "deepseek-r1" (LF_ERR_INVALID_ARG otherwise). */
lf_status lf_chat_format_parse(const char *name, lf_chat_format *out);
/* Chooses the format from tokenizer_config.json text (its chat_template's markers; bos_token),
 * or takes the one format names (an explicit choice: it wins over the config's template). Either
 * may be NULL. Without format, LF_ERR_UNSUPPORTED when the config has no chat template or one
 * of no known format: nothing is guessed from the model's architecture. */
lf_status lf_chat_template_init(const char *tokenizer_config_json, size_t len, const char *format,
                                lf_chat_template **out);
/* Same from a model directory's tokenizer_config.json (which may be absent when format is
 * given). */
lf_status lf_chat_template_init_dir(const char *model_dir, const char *format,
                                    lf_chat_template **out);
void lf_chat_template_free(lf_chat_template *t);
lf_chat_format lf_chat_template_format(const lf_chat_template *t);
/* Renders messages as the model's Jinja template does for plain messages, replacing out. */
lf_status lf_chat_template_render(const lf_chat_template *t, const lf_chat_message *msgs, size_t n,
                                  int add_generation_prompt, lf_tok_text *out);
/* The same render, also listing where the messages' content went: content->r[0..n) are the byte
 * ranges of out that came from message content (in order; the rest is the template's own text:
 * markers, roles, BOS, a default system prompt). content is replaced; free with
 * lf_text_ranges_free. */
typedef struct lf_text_ranges {
  lf_text_range *r; /* [n] */
  size_t n, cap;
} lf_text_ranges;
void lf_text_ranges_free(lf_text_ranges *v);
lf_status lf_chat_template_render_ranges(const lf_chat_template *t, const lf_chat_message *msgs,
                                         size_t n, int add_generation_prompt, lf_tok_text *out,
                                         lf_text_ranges *content);

enum {
  /* lf_chat_encode: read special-token text inside message content as real markers, as Hugging
   * Face's apply_chat_template + encode does (a user writing "<|im_end|>" ends the turn). Off by
   * default: content is encoded with special tokens as plain text. */
  LF_CHAT_CONTENT_SPECIAL = 1u << 0,
};
/* Renders and encodes a chat prompt: the template's markers are encoded with special-token
 * parsing, message content (unless LF_CHAT_CONTENT_SPECIAL) with special tokens as plain text
 * (lf_tokenizer_encode_ranges over the content ranges). The rendered template writes its own
 * BOS, so no post-processor tokens are added. For content without special-token text the ids
 * equal lf_tokenizer_encode(render, 0). out is replaced. */
lf_status lf_chat_encode(const lf_chat_template *t, const lf_tokenizer *tok,
                         const lf_chat_message *msgs, size_t n, int add_generation_prompt,
                         unsigned flags, lf_token_ids *out);

#ifdef __cplusplus
}
#endif
#endif

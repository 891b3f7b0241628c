/* The tokenizer and chat template that come with a model, whatever its format:
 *  - a Hugging Face directory: tokenizer.json, tokenizer_config.json (+ config.json's model_type);
 *  - a GGUF file: the tokenizer.ggml.* metadata (vocabulary, merges, token types, bos/eos,
 *    add_bos, pre-tokenizer name) and tokenizer.chat_template. They are turned into the same
 *    tokenizer.json / tokenizer_config.json structures the directory loader reads, so both
 *    formats go through one tokenizer and one template implementation;
 *  - anything else (a llama2.c .bin, "random:NAME"): no tokenizer.
 */
#ifndef LF_MODEL_TEXT_H
#define LF_MODEL_TEXT_H

#include "lfserve.h"
#include "text/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* *tok is NULL (and LF_OK returned) when the model carries no tokenizer; why (may be NULL) then
 * says so in a sentence fit for a user. A tokenizer that is present but cannot be loaded is an
 * error. */
lf_status lf_model_tokenizer_open(const char *model_path, lf_tokenizer **tok, char *why,
                                  size_t why_cap);

/* The model's chat template: LF_ERR_UNSUPPORTED (with the reason in lf_last_error) when the
 * model has none that lfserve can render. */
lf_status lf_model_chat_template_open(const char *model_path, lf_chat_template **tmpl);
/* Same, or the built-in format named by format ("chatml", "llama3", "deepseek-r1"; NULL: the
 * model's own) whatever the model carries: an explicit choice for models without a template. */
lf_status lf_model_chat_template_open_as(const char *model_path, const char *format,
                                         lf_chat_template **tmpl);

/* Exposed for tests: the tokenizer.json text built from a GGUF file's metadata (malloc'ed). */
lf_status lf_gguf_tokenizer_json(const char *gguf_path, char **json, size_t *len);

#ifdef __cplusplus
}
#endif
#endif

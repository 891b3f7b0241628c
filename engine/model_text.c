/* A model's tokenizer and chat template from a HF directory or a GGUF file (model_text.h). */
#define _POSIX_C_SOURCE 200809L

#include "engine/model_text.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/error.h"
#include "gguf.h"
#include "tensor.h"

static int is_dir(const char *p) {
  struct stat st;
  return p && stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

static int is_gguf(const char *p) {
  struct stat st;
  return p && stat(p, &st) == 0 && S_ISREG(st.st_mode) && lf_gguf_file_has_magic(p);
}

/* ---- JSON text building --------------------------------------------------------------------- */

#define PUT(s) LF_TRY(lf_tok_text_append(out, (s), strlen(s)))

static lf_status put_json_str(lf_tok_text *out, const char *s, size_t n) {
  LF_TRY(lf_tok_text_append(out, "\"", 1));
  size_t run = 0; /* bytes copied as they are */
  for (size_t i = 0; i < n; i++) {
    const unsigned char c = (unsigned char)s[i];
    if (c >= 0x20 && c != '"' && c != '\\') continue;
    LF_TRY(lf_tok_text_append(out, s + run, i - run));
    char esc[8];
    if (c == '"' || c == '\\')
      snprintf(esc, sizeof esc, "\\%c", c);
    else
      snprintf(esc, sizeof esc, "\\u%04x", c);
    LF_TRY(lf_tok_text_append(out, esc, strlen(esc)));
    run = i + 1;
  }
  LF_TRY(lf_tok_text_append(out, s + run, n - run));
  return lf_tok_text_append(out, "\"", 1);
}

/* A GGUF file mapped and parsed (metadata only is used here). */
typedef struct gguf_file {
  lf_tensor_set set; /* owns the mapping */
  lf_gguf *g;
} gguf_file;

static void gguf_file_close(gguf_file *f) {
  lf_gguf_free(f->g);
  lf_tensor_set_free(&f->set);
  memset(f, 0, sizeof *f);
}

static lf_status gguf_file_open(const char *path, gguf_file *f) {
  memset(f, 0, sizeof *f);
  int idx = -1;
  lf_status st = lf_tensor_set_map_file(&f->set, path, &idx);
  if (st == LF_OK) st = lf_gguf_parse(f->set.maps[idx].addr, f->set.maps[idx].size, path, &f->g);
  if (st != LF_OK) gguf_file_close(f);
  return st;
}

/* Pre-tokenizer regexes of the byte-level BPE families, by llama.cpp's tokenizer.ggml.pre name
 * (the patterns are those of the models' own tokenizer.json files). */
static const char LLAMA3_SPLIT[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char QWEN2_SPLIT[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

static lf_status put_split_bytelevel(lf_tok_text *out, const char *re) {
  PUT("{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"Regex\":");
  LF_TRY(put_json_str(out, re, strlen(re)));
  PUT("},\"behavior\":\"Isolated\",\"invert\":false},{\"type\":\"ByteLevel\","
      "\"add_prefix_space\":false,\"trim_offsets\":true,\"use_regex\":false}]}");
  return LF_OK;
}

static lf_status build_tokenizer_json(const lf_gguf *g, const char *path, lf_tok_text *out) {
  lf_gguf_str model, pre = {"default", 7};
  LF_TRY(lf_gguf_get_str(g, "tokenizer.ggml.model", &model));
  if (!lf_gguf_str_eq(model, "gpt2"))
    return lf_error(LF_ERR_UNSUPPORTED,
                    "%s: GGUF tokenizer model \"%.*s\" is not supported (byte-level BPE, \"gpt2\", "
                    "is)",
                    path, (int)(model.len > 32 ? 32 : model.len), model.ptr);
  if (lf_gguf_find_key(g, "tokenizer.ggml.pre") >= 0)
    LF_TRY(lf_gguf_get_str(g, "tokenizer.ggml.pre", &pre));
  const int64_t kt = lf_gguf_find_key(g, "tokenizer.ggml.tokens");
  const int64_t km = lf_gguf_find_key(g, "tokenizer.ggml.merges");
  const int64_t ky = lf_gguf_find_key(g, "tokenizer.ggml.token_type");
  if (kt < 0 || km < 0)
    return lf_error(LF_ERR_FORMAT, "%s: GGUF tokenizer lacks tokenizer.ggml.tokens or .merges",
                    path);
  lf_gguf_vtype et;
  uint64_t n_tok, n_merge, n_type = 0;
  LF_TRY(lf_gguf_arr_info(g, kt, &et, &n_tok));
  if (et != LF_GGUF_STRING || n_tok == 0 || n_tok > (1u << 24))
    return lf_error(LF_ERR_FORMAT, "%s: tokenizer.ggml.tokens must be 1..2^24 strings", path);
  LF_TRY(lf_gguf_arr_info(g, km, &et, &n_merge));
  if (et != LF_GGUF_STRING)
    return lf_error(LF_ERR_FORMAT, "%s: tokenizer.ggml.merges must be strings", path);
  if (ky >= 0) {
    LF_TRY(lf_gguf_arr_info(g, ky, &et, &n_type));
    if (n_type != n_tok)
      return lf_error(LF_ERR_FORMAT, "%s: %llu token types for %llu tokens", path,
                      (unsigned long long)n_type, (unsigned long long)n_tok);
  }
  int add_bos = 0;
  int64_t bos = -1;
  if (lf_gguf_find_key(g, "tokenizer.ggml.add_bos_token") >= 0)
    LF_TRY(lf_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &add_bos));
  if (lf_gguf_find_key(g, "tokenizer.ggml.bos_token_id") >= 0)
    LF_TRY(lf_gguf_get_int(g, "tokenizer.ggml.bos_token_id", &bos));
  if (add_bos && (bos < 0 || (uint64_t)bos >= n_tok))
    return lf_error(LF_ERR_FORMAT, "%s: add_bos_token without a valid bos_token_id", path);

  LF_TRY(lf_tok_text_clear(out));
  PUT("{\"version\":\"1.0\",\"added_tokens\":[");
  /* Control tokens (type 3) are special added tokens; user-defined ones (4) plain added ones. */
  int first = 1;
  lf_gguf_str s;
  for (uint64_t i = 0; i < n_type; i++) {
    int64_t ty;
    LF_TRY(lf_gguf_arr_int(g, ky, i, &ty));
    if (ty != 3 && ty != 4) continue;
    LF_TRY(lf_gguf_arr_str(g, kt, i, &s));
    char head[64];
    snprintf(head, sizeof head, "%s{\"id\":%llu,\"content\":", first ? "" : ",",
             (unsigned long long)i);
    PUT(head);
    LF_TRY(put_json_str(out, s.ptr, s.len));
    PUT(",\"single_word\":false,\"lstrip\":false,\"rstrip\":false,\"normalized\":false,"
        "\"special\":");
    PUT(ty == 3 ? "true}" : "false}");
    first = 0;
  }
  PUT("],\"normalizer\":");
  int ignore_merges = 0;
  if (lf_gguf_str_eq(pre, "smollm")) {
    /* SmolLM's tokenizer.json: digits split one by one, then GPT-2's byte-level regex. */
    PUT("null,\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Digits\","
        "\"individual_digits\":true},{\"type\":\"ByteLevel\",\"add_prefix_space\":false,"
        "\"trim_offsets\":true,\"use_regex\":true}]}");
  } else if (lf_gguf_str_eq(pre, "default") || lf_gguf_str_eq(pre, "gpt-2") ||
             lf_gguf_str_eq(pre, "gpt2")) {
    PUT("null,\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":false,"
        "\"trim_offsets\":true,\"use_regex\":true}");
  } else if (lf_gguf_str_eq(pre, "llama-bpe") || lf_gguf_str_eq(pre, "llama3")) {
    PUT("null,\"pre_tokenizer\":");
    LF_TRY(put_split_bytelevel(out, LLAMA3_SPLIT));
    ignore_merges = 1;
  } else if (lf_gguf_str_eq(pre, "qwen2") || lf_gguf_str_eq(pre, "deepseek-r1-qwen")) {
    PUT("{\"type\":\"NFC\"},\"pre_tokenizer\":");
    LF_TRY(put_split_bytelevel(out, QWEN2_SPLIT));
  } else {
    return lf_error(LF_ERR_UNSUPPORTED,
                    "%s: GGUF pre-tokenizer \"%.*s\" is not supported (smollm, gpt-2, llama-bpe, "
                    "qwen2, deepseek-r1-qwen are)",
                    path, (int)(pre.len > 48 ? 48 : pre.len), pre.ptr);
  }
  PUT(",\"post_processor\":");
  if (add_bos) {
    LF_TRY(lf_gguf_arr_str(g, kt, (uint64_t)bos, &s));
    char ids[48];
    PUT("{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":");
    LF_TRY(put_json_str(out, s.ptr, s.len));
    PUT(",\"type_id\":0}},{\"Sequence\":{\"id\":\"A\",\"type_id\":0}}],\"special_tokens\":{");
    LF_TRY(put_json_str(out, s.ptr, s.len));
    snprintf(ids, sizeof ids, ":{\"ids\":[%lld]}}}", (long long)bos);
    PUT(ids);
  } else {
    PUT("{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":false,"
        "\"use_regex\":true}");
  }
  PUT(",\"decoder\":{\"type\":\"ByteLevel\",\"add_prefix_space\":true,\"trim_offsets\":true,"
      "\"use_regex\":true},\"model\":{\"type\":\"BPE\",\"dropout\":null,\"unk_token\":null,"
      "\"fuse_unk\":false,\"byte_fallback\":false,\"ignore_merges\":");
  PUT(ignore_merges ? "true" : "false");
  PUT(",\"vocab\":{");
  for (uint64_t i = 0; i < n_tok; i++) {
    LF_TRY(lf_gguf_arr_str(g, kt, i, &s));
    if (i) PUT(",");
    LF_TRY(put_json_str(out, s.ptr, s.len));
    char id[32];
    snprintf(id, sizeof id, ":%llu", (unsigned long long)i);
    PUT(id);
  }
  PUT("},\"merges\":[");
  for (uint64_t i = 0; i < n_merge; i++) {
    LF_TRY(lf_gguf_arr_str(g, km, i, &s));
    /* "left right": byte-level tokens never hold a plain space, so the first one splits. */
    const char *sp = s.len ? memchr(s.ptr, ' ', s.len) : NULL;
    if (!sp || sp == s.ptr || sp == s.ptr + s.len - 1)
      return lf_error(LF_ERR_FORMAT, "%s: tokenizer.ggml.merges[%llu] is not \"left right\"", path,
                      (unsigned long long)i);
    PUT(i ? ",[" : "[");
    LF_TRY(put_json_str(out, s.ptr, (size_t)(sp - s.ptr)));
    PUT(",");
    LF_TRY(put_json_str(out, sp + 1, s.len - (size_t)(sp - s.ptr) - 1));
    PUT("]");
  }
  PUT("]}}");
  return LF_OK;
}

/* The tokenizer.json text of an opened GGUF file into *json (malloc'ed). */
static lf_status gguf_json(const gguf_file *f, const char *path, char **json, size_t *len) {
  lf_tok_text out = {0};
  lf_status st = build_tokenizer_json(f->g, path, &out);
  if (st != LF_OK) {
    lf_tok_text_free(&out);
    return st;
  }
  *json = out.data;
  *len = out.len;
  return LF_OK;
}

lf_status lf_gguf_tokenizer_json(const char *path, char **json, size_t *len) {
  if (!path || !json || !len) return lf_error(LF_ERR_INVALID_ARG, "lf_gguf_tokenizer_json: NULL");
  *json = NULL;
  *len = 0;
  gguf_file f;
  LF_TRY(gguf_file_open(path, &f));
  lf_status st = gguf_json(&f, path, json, len);
  gguf_file_close(&f);
  return st;
}

/* Re-raises st with "what: " before the current message (copied first: lf_error writes the
 * buffer lf_last_error reads). */
static lf_status prefix_error(lf_status st, const char *what) {
  char msg[512];
  snprintf(msg, sizeof msg, "%s", lf_last_error());
  return lf_error(st, "%s: %s", what, msg);
}

lf_status lf_model_tokenizer_open(const char *path, lf_tokenizer **tok, char *why,
                                  size_t why_cap) {
  if (!path || !tok) return lf_error(LF_ERR_INVALID_ARG, "lf_model_tokenizer_open: NULL argument");
  *tok = NULL;
  if (why && why_cap) why[0] = '\0';
  if (is_gguf(path)) {
    gguf_file f;
    LF_TRY(gguf_file_open(path, &f));
    if (lf_gguf_find_key(f.g, "tokenizer.ggml.tokens") < 0) {
      gguf_file_close(&f);
      if (why) snprintf(why, why_cap, "%s has no tokenizer metadata", path);
      return LF_OK;
    }
    char *json = NULL;
    size_t len = 0;
    lf_status st = gguf_json(&f, path, &json, &len); /* one parse of the file, not two */
    gguf_file_close(&f);
    if (st != LF_OK) return st;
    st = lf_tokenizer_init(json, len, tok);
    free(json);
    if (st != LF_OK) return prefix_error(st, path);
    return LF_OK;
  }
  if (is_dir(path)) {
    char tpath[4096];
    snprintf(tpath, sizeof tpath, "%s/tokenizer.json", path);
    if (access(tpath, R_OK) != 0) {
      if (why) snprintf(why, why_cap, "%s has no tokenizer.json", path);
      return LF_OK;
    }
    lf_status st = lf_tokenizer_init_file(tpath, tok);
    if (st != LF_OK) return prefix_error(st, tpath);
    return LF_OK;
  }
  if (why) snprintf(why, why_cap, "%s carries no tokenizer (a HF directory or GGUF file does)", path);
  return LF_OK;
}

lf_status lf_model_chat_template_open(const char *path, lf_chat_template **tmpl) {
  return lf_model_chat_template_open_as(path, NULL, tmpl);
}

lf_status lf_model_chat_template_open_as(const char *path, const char *format,
                                         lf_chat_template **tmpl) {
  if (!path || !tmpl) return lf_error(LF_ERR_INVALID_ARG, "lf_model_chat_template_open: NULL");
  *tmpl = NULL;
  if (is_dir(path)) return lf_chat_template_init_dir(path, format, tmpl);
  if (!is_gguf(path)) {
    if (format) return lf_chat_template_init(NULL, 0, format, tmpl);
    return lf_error(LF_ERR_UNSUPPORTED, "the model has no chat template");
  }
  gguf_file f;
  LF_TRY(gguf_file_open(path, &f));
  lf_status st = LF_OK;
  lf_gguf_str t = {NULL, 0}, b = {NULL, 0};
  lf_tok_text cfg = {0};
  if (lf_gguf_find_key(f.g, "tokenizer.chat_template") >= 0)
    st = lf_gguf_get_str(f.g, "tokenizer.chat_template", &t);
  else if (!format)
    st = lf_error(LF_ERR_UNSUPPORTED,
                  "the model has no chat template (no tokenizer.chat_template in %s)", path);
  int64_t bos = -1, kt = lf_gguf_find_key(f.g, "tokenizer.ggml.tokens");
  if (st == LF_OK && kt >= 0 && lf_gguf_find_key(f.g, "tokenizer.ggml.bos_token_id") >= 0 &&
      lf_gguf_get_int(f.g, "tokenizer.ggml.bos_token_id", &bos) == LF_OK && bos >= 0)
    if (lf_gguf_arr_str(f.g, kt, (uint64_t)bos, &b) != LF_OK) b.ptr = NULL;
  if (st == LF_OK) st = lf_tok_text_append(&cfg, "{", 1);
  if (st == LF_OK && t.ptr) st = lf_tok_text_append(&cfg, "\"chat_template\":", 16);
  if (st == LF_OK && t.ptr) st = put_json_str(&cfg, t.ptr, t.len);
  if (st == LF_OK && t.ptr && b.ptr) st = lf_tok_text_append(&cfg, ",", 1);
  if (st == LF_OK && b.ptr) st = lf_tok_text_append(&cfg, "\"bos_token\":", 12);
  if (st == LF_OK && b.ptr) st = put_json_str(&cfg, b.ptr, b.len);
  if (st == LF_OK) st = lf_tok_text_append(&cfg, "}", 1);
  /* The template text alone decides the format (or the caller's explicit choice): no guess
   * from the architecture. */
  if (st == LF_OK) st = lf_chat_template_init(cfg.data, cfg.len, format, tmpl);
  lf_tok_text_free(&cfg);
  gguf_file_close(&f);
  return st;
}

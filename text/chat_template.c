/* Built-in chat templates: llama3, chatml (Qwen) and deepseek-r1.
 *
 * We do not run Jinja. The model families' templates are fixed text, so we recognise which one a
 * tokenizer_config.json carries by its markers and render the same string in C. What varies
 * between releases of a family and matters for plain messages is read from the config: the BOS
 * text, the chatml default system prompt (Qwen2 has one, Qwen3 none) and whether the R1
 * generation prompt opens a <think> block. Tool calls and multimodal content are out of scope.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "text/json.h"
#include "text/tokenizer.h"

#define R1_USER "<\xef\xbd\x9cUser\xef\xbd\x9c>"
#define R1_ASSISTANT                                                                               \
  "<\xef\xbd\x9c"                                                                                  \
  "Assistant\xef\xbd\x9c>"
#define R1_EOS                                                                                     \
  "<\xef\xbd\x9c"                                                                                  \
  "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>"
#define R1_BOS                                                                                     \
  "<\xef\xbd\x9c"                                                                                  \
  "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>"

struct lf_chat_template {
  lf_chat_format format;
  char *bos;            /* text the template writes for bos_token ("" when none) */
  char *default_system; /* chatml: system prompt used when the first message is not one */
  int r1_think;         /* deepseek-r1: the generation prompt ends with "<think>\n" */
};

void lf_chat_template_free(lf_chat_template *t) {
  if (!t) return;
  free(t->bos);
  free(t->default_system);
  free(t);
}

lf_chat_format lf_chat_template_format(const lf_chat_template *t) {
  return t ? t->format : LF_CHAT_NONE;
}

static char *dup_n(const char *s, size_t n) {
  char *p = malloc(n + 1);
  if (p) {
    memcpy(p, s, n);
    p[n] = '\0';
  }
  return p;
}

/* The default system prompt of a chatml template: the first literal
 * '<|im_start|>system\n...<|im_end|>' whose body holds no Jinja (no quotes or braces). The
 * newline appears either escaped ("\\n" inside a Jinja string literal) or raw. */
static char *chatml_default_system(const char *tmpl) {
  static const char head[] = "<|im_start|>system";
  for (const char *p = strstr(tmpl, head); p; p = strstr(p + 1, head)) {
    const char *b = p + sizeof head - 1;
    if (b[0] == '\\' && b[1] == 'n')
      b += 2;
    else if (b[0] == '\n')
      b += 1;
    else
      continue;
    const char *e = strstr(b, "<|im_end|>");
    if (!e || e == b) continue;
    size_t n = (size_t)(e - b);
    if (strcspn(b, "'\"{}") < n) continue;
    /* Undo the escapes a Jinja string literal may contain. */
    char *out = malloc(n + 1);
    if (!out) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
      if (b[i] == '\\' && i + 1 < n) {
        char c = b[++i];
        out[o++] = c == 'n' ? '\n' : c == 't' ? '\t' : c;
      } else {
        out[o++] = b[i];
      }
    }
    out[o] = '\0';
    return out;
  }
  return NULL;
}

static const char *json_token_text(const lf_json *v) {
  /* bos_token is a string or an AddedToken object {"content": ...}. */
  const char *s = lf_json_str(v, NULL);
  return s ? s : lf_json_str(lf_json_get(v, "content"), NULL);
}

lf_status lf_chat_format_parse(const char *name, lf_chat_format *out) {
  if (!name || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_chat_format_parse: NULL argument");
  if (strcmp(name, "llama3") == 0)
    *out = LF_CHAT_LLAMA3;
  else if (strcmp(name, "chatml") == 0)
    *out = LF_CHAT_CHATML;
  else if (strcmp(name, "deepseek-r1") == 0)
    *out = LF_CHAT_DEEPSEEK_R1;
  else
    return lf_error(LF_ERR_INVALID_ARG,
                    "unknown chat template '%s' (built-in: chatml, llama3, deepseek-r1)", name);
  return LF_OK;
}

lf_status lf_chat_template_init(const char *cfg_json, size_t len, const char *format,
                                lf_chat_template **out) {
  if (!out) return lf_error(LF_ERR_INVALID_ARG, "lf_chat_template_init: NULL argument");
  *out = NULL;
  lf_chat_format f = LF_CHAT_NONE;
  if (format) {
    lf_status st = lf_chat_format_parse(format, &f);
    if (st != LF_OK) return st;
  }
  lf_json *cfg = NULL;
  if (cfg_json) {
    char err[256];
    lf_status st = lf_json_parse(cfg_json, len, &cfg, err, sizeof err);
    if (st != LF_OK) return lf_error(st, "tokenizer_config.json: %s", err);
  }
  const char *tmpl = lf_json_str(lf_json_get(cfg, "chat_template"), NULL);
  const lf_json *tl = lf_json_get(cfg, "chat_template");
  if (!tmpl && lf_json_typeof(tl) == LF_JSON_ARRAY) { /* [{"name", "template"}, ...] */
    for (size_t i = 0; i < lf_json_len(tl); i++) {
      const lf_json *e = lf_json_at(tl, i);
      const char *name = lf_json_str(lf_json_get(e, "name"), NULL);
      if (name && strcmp(name, "default") == 0)
        tmpl = lf_json_str(lf_json_get(e, "template"), NULL);
    }
  }
  if (tmpl && f == LF_CHAT_NONE) {
    /* R1 distills are Llama- or Qwen-based but carry their own markers: check them first. */
    if (strstr(tmpl, R1_USER) || strstr(tmpl, R1_ASSISTANT))
      f = LF_CHAT_DEEPSEEK_R1;
    else if (strstr(tmpl, "<|start_header_id|>"))
      f = LF_CHAT_LLAMA3;
    else if (strstr(tmpl, "<|im_start|>"))
      f = LF_CHAT_CHATML;
  }
  /* No format is guessed from the architecture: a base model's family says nothing about the
   * markup it was trained on, and rendering one it never saw only produces noise. */
  if (f == LF_CHAT_NONE) {
    lf_json_free(cfg);
    return lf_error(LF_ERR_UNSUPPORTED,
                    tmpl ? "the model's chat template matches no built-in one (chatml, llama3, "
                           "deepseek-r1)"
                         : "the model has no chat template");
  }
  lf_chat_template *t = calloc(1, sizeof *t);
  const char *bos = json_token_text(lf_json_get(cfg, "bos_token"));
  if (!bos)
    bos = f == LF_CHAT_LLAMA3 ? "<|begin_of_text|>" : f == LF_CHAT_DEEPSEEK_R1 ? R1_BOS : "";
  if (!t || !(t->bos = dup_n(bos, strlen(bos)))) {
    lf_json_free(cfg);
    lf_chat_template_free(t);
    return lf_error(LF_ERR_OUT_OF_MEMORY, "out of memory");
  }
  t->format = f;
  if (f == LF_CHAT_CHATML && tmpl) t->default_system = chatml_default_system(tmpl);
  /* Later R1 releases open the reasoning block in the prompt; without a template, do so. */
  t->r1_think = !tmpl || strstr(tmpl, R1_ASSISTANT "<think>") != NULL;
  lf_json_free(cfg);
  *out = t;
  return LF_OK;
}

static lf_status read_all(const char *path, char **buf, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return lf_error(LF_ERR_IO, "%s: %s", path, strerror(errno));
  size_t cap = 1 << 16, n = 0;
  char *b = malloc(cap);
  while (b) {
    size_t r = fread(b + n, 1, cap - n, f);
    n += r;
    if (r == 0) break;
    if (n == cap) {
      char *p = realloc(b, cap * 2);
      if (!p) {
        free(b);
        b = NULL;
      } else {
        b = p;
        cap *= 2;
      }
    }
  }
  int bad = ferror(f);
  fclose(f);
  if (!b) return lf_error(LF_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
  if (bad) {
    free(b);
    return lf_error(LF_ERR_IO, "%s: read error", path);
  }
  *buf = b;
  *len = n;
  return LF_OK;
}

lf_status lf_chat_template_init_dir(const char *dir, const char *format, lf_chat_template **out) {
  if (!dir || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_chat_template_init_dir: NULL argument");
  char path[4096];
  char *tc = NULL;
  size_t tcl = 0;
  snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
  if (read_all(path, &tc, &tcl) != LF_OK) tc = NULL; /* optional when format names one */
  lf_status st = lf_chat_template_init(tc, tcl, format, out);
  if (st == LF_ERR_UNSUPPORTED) {
    char why[256];
    snprintf(why, sizeof why, "%s", lf_last_error());
    st = lf_error(st, "%s (%s%s)", why, tc ? "checked " : "", tc ? path : "no tokenizer_config.json");
  }
  free(tc);
  return st;
}

/* Python's str.isspace, which Jinja's trim filter (str.strip) uses. */
static int py_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

static uint32_t cp_at(const unsigned char *s, size_t n, size_t i, int *len) {
  unsigned char c = s[i];
  int l = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
  if (i + (size_t)l > n) l = 1;
  uint32_t v = l == 1 ? c : l == 2 ? (c & 0x1Fu) : l == 3 ? (c & 0x0Fu) : (c & 0x07u);
  for (int k = 1; k < l; k++)
    v = (v << 6) | (s[i + k] & 0x3Fu);
  *len = l;
  return v;
}

static void trim(const char *s, const char **b, size_t *n) {
  const unsigned char *u = (const unsigned char *)s;
  size_t len = strlen(s), i = 0, e = len;
  int l;
  while (i < len && py_space(cp_at(u, len, i, &l)))
    i += (size_t)l;
  while (e > i) {
    size_t j = e - 1;
    while (j > i && (u[j] & 0xC0) == 0x80)
      j--;
    if (!py_space(cp_at(u, len, j, &l))) break;
    e = j;
  }
  *b = s + i;
  *n = e - i;
}

void lf_text_ranges_free(lf_text_ranges *v) {
  if (!v) return;
  free(v->r);
  memset(v, 0, sizeof *v);
}

/* Appends content text, recording its range when ranges are wanted (empty content records
 * nothing). */
static lf_status put_content(lf_tok_text *out, lf_text_ranges *rg, const char *s, size_t n) {
  const size_t begin = out->len;
  LF_TRY(lf_tok_text_append(out, s, n));
  if (!rg || n == 0) return LF_OK;
  if (rg->n && rg->r[rg->n - 1].end == begin) { /* adjacent to the last one: extend it */
    rg->r[rg->n - 1].end = out->len;
    return LF_OK;
  }
  if (rg->n == rg->cap) {
    size_t cap = rg->cap ? 2 * rg->cap : 8;
    lf_text_range *p = realloc(rg->r, sizeof *p * cap);
    if (!p) return lf_error(LF_ERR_OUT_OF_MEMORY, "chat template: out of memory");
    rg->r = p;
    rg->cap = cap;
  }
  rg->r[rg->n++] = (lf_text_range){begin, out->len};
  return LF_OK;
}

#define PUT(s) LF_TRY(lf_tok_text_append(out, (s), strlen(s)))
#define PUT_CONTENT(s, n) LF_TRY(put_content(out, rg, (s), (n)))

lf_status lf_chat_template_render(const lf_chat_template *t, const lf_chat_message *m, size_t n,
                                  int add_generation_prompt, lf_tok_text *out) {
  return lf_chat_template_render_ranges(t, m, n, add_generation_prompt, out, NULL);
}

lf_status lf_chat_template_render_ranges(const lf_chat_template *t, const lf_chat_message *m,
                                         size_t n, int add_generation_prompt, lf_tok_text *out,
                                         lf_text_ranges *rg) {
  if (!t || (!m && n) || !out)
    return lf_error(LF_ERR_INVALID_ARG, "lf_chat_template_render: NULL argument");
  for (size_t i = 0; i < n; i++)
    if (!m[i].role || !m[i].content)
      return lf_error(LF_ERR_INVALID_ARG, "chat message %zu lacks a role or content", i);
  LF_TRY(lf_tok_text_clear(out));
  if (rg) rg->n = 0;
  switch (t->format) {
  case LF_CHAT_LLAMA3:
    for (size_t i = 0; i < n; i++) {
      const char *c;
      size_t cn;
      if (i == 0) PUT(t->bos);
      PUT("<|start_header_id|>");
      PUT(m[i].role);
      PUT("<|end_header_id|>\n\n");
      trim(m[i].content, &c, &cn); /* the template trims content */
      PUT_CONTENT(c, cn);
      PUT("<|eot_id|>");
    }
    if (add_generation_prompt) PUT("<|start_header_id|>assistant<|end_header_id|>\n\n");
    return LF_OK;
  case LF_CHAT_CHATML:
    for (size_t i = 0; i < n; i++) {
      if (i == 0 && t->default_system && strcmp(m[0].role, "system") != 0) {
        PUT("<|im_start|>system\n");
        PUT(t->default_system);
        PUT("<|im_end|>\n");
      }
      PUT("<|im_start|>");
      PUT(m[i].role);
      PUT("\n");
      PUT_CONTENT(m[i].content, strlen(m[i].content));
      PUT("<|im_end|>\n");
    }
    if (add_generation_prompt) PUT("<|im_start|>assistant\n");
    return LF_OK;
  case LF_CHAT_DEEPSEEK_R1: {
    /* The last system message goes right after BOS; earlier turns' reasoning is dropped. */
    const char *sys = "";
    for (size_t i = 0; i < n; i++)
      if (strcmp(m[i].role, "system") == 0) sys = m[i].content;
    PUT(t->bos);
    PUT_CONTENT(sys, strlen(sys));
    for (size_t i = 0; i < n; i++) {
      if (strcmp(m[i].role, "user") == 0) {
        PUT(R1_USER);
        PUT_CONTENT(m[i].content, strlen(m[i].content));
      } else if (strcmp(m[i].role, "assistant") == 0) {
        const char *c = m[i].content, *p;
        while ((p = strstr(c, "</think>")))
          c = p + strlen("</think>");
        PUT(R1_ASSISTANT);
        PUT_CONTENT(c, strlen(c));
        PUT(R1_EOS);
      }
    }
    if (add_generation_prompt) PUT(t->r1_think ? R1_ASSISTANT "<think>\n" : R1_ASSISTANT);
    return LF_OK;
  }
  default:
    return lf_error(LF_ERR_STATE, "chat template has no format");
  }
}

lf_status lf_chat_encode(const lf_chat_template *t, const lf_tokenizer *tok,
                         const lf_chat_message *m, size_t n, int add_generation_prompt,
                         unsigned flags, lf_token_ids *out) {
  if (!t || !tok || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_chat_encode: NULL argument");
  lf_tok_text text = {0};
  lf_text_ranges rg = {0};
  lf_status s = lf_chat_template_render_ranges(t, m, n, add_generation_prompt, &text, &rg);
  if (s == LF_OK) {
    const int hf = (flags & LF_CHAT_CONTENT_SPECIAL) != 0;
    s = lf_tokenizer_encode_ranges(tok, text.data, text.len, 0, hf ? NULL : rg.r, hf ? 0 : rg.n,
                                   out);
  }
  lf_tok_text_free(&text);
  lf_text_ranges_free(&rg);
  return s;
}

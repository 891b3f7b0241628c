/* LoRA adapters in PEFT's layout, merged into an opened checkpoint at load.
 *
 * An adapter directory holds adapter_config.json (r, lora_alpha, use_rslora, target_modules and
 * the flags of LoRA's variants) and adapter_model.safetensors, whose tensors are named after the
 * modules they adapt:
 *   base_model.model.<module>.lora_A.weight      [r][in]      a Linear (q_proj ... lm_head)
 *   base_model.model.<module>.lora_B.weight      [out][r]
 *   base_model.model.<module>.lora_embedding_A   [r][vocab]   embed_tokens
 *   base_model.model.<module>.lora_embedding_B   [dim][r]
 *   base_model.model.<module>.base_layer.weight  the module's own weight: PEFT saves the embedding
 *                                                layers' weights when they are targeted, and
 *                                                loads them over the base model's
 * PEFT's merge_and_unload makes W' = W + scale * B·A for a Linear and W + scale * (B·A)^T for an
 * embedding, scale = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora).
 *
 * The update is not written into a copy of W here: it is attached to W's tensor as a low-rank
 * term (tensor.h: lf_tensor_lowrank, u = scale * B and v = A, or u = scale * A^T and v = B^T for
 * an embedding) that lf_tensor_read_f32 adds to every block it reads, after undoing a GGUF
 * file's Q/K row permutation, i.e. in the Hugging Face layout the adapter was trained in. Every
 * reader (the cpu backend's fp32 weights, the cuda backend's bf16 upload, a tensor-parallel
 * rank's slice) therefore sees the merged weight without knowing about adapters, and no rank
 * holds more than its slice of it.
 *
 * Only plain LoRA is merged. The variants that change the merge (DoRA, LoRA biases, QALoRA,
 * per-module rank or alpha patterns, initialisations that rewrite the base weights, ...) are
 * refused by name, as is any tensor that is not one of the four factors above or a base layer.
 * The adapter is checked whole before anything is attached: a failure leaves the checkpoint as
 * it was. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/error.h"
#include "model.h"
#include "text/json.h"

#define PEFT_PREFIX "base_model.model."

/* The modules lfserve can merge, by the last component of their name. */
typedef enum { MOD_LINEAR, MOD_HEAD, MOD_EMBED } mod_kind;
static const struct {
  const char *name;
  mod_kind kind;
} k_modules[] = {
    {"q_proj", MOD_LINEAR},    {"k_proj", MOD_LINEAR},    {"v_proj", MOD_LINEAR},
    {"o_proj", MOD_LINEAR},    {"gate_proj", MOD_LINEAR}, {"up_proj", MOD_LINEAR},
    {"down_proj", MOD_LINEAR}, {"lm_head", MOD_HEAD},     {"embed_tokens", MOD_EMBED},
};
#define N_MODULES (sizeof k_modules / sizeof k_modules[0])
#define MODULE_LIST                                                                                \
  "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head, embed_tokens"

/* The index in k_modules of the module whose name is s[0..len) or ends in "." + that, or -1. */
static int module_index(const char *s, size_t len) {
  size_t start = len;
  while (start > 0 && s[start - 1] != '.')
    start--;
  for (size_t i = 0; i < N_MODULES; i++)
    if (strlen(k_modules[i].name) == len - start &&
        !memcmp(s + start, k_modules[i].name, len - start))
      return (int)i;
  return -1;
}

/* One low-rank update and the tensor of the checkpoint it goes to. */
typedef struct lora_update {
  lf_tensor_lowrank lr;
  int target;   /* index into the checkpoint's tensors */
  int module;   /* index into k_modules */
  float data[]; /* u [rows][rank], then v [rank][cols] */
} lora_update;

struct lf_lora {
  lf_tensor_set set; /* adapter_model.safetensors, mapped: base layers point into it */
  lora_update **up;  /* [n_up] */
  int n_up;
};

void lf_lora_free(struct lf_lora *l) {
  if (!l) return;
  for (int i = 0; i < l->n_up; i++)
    free(l->up[i]);
  free(l->up);
  lf_tensor_set_free(&l->set);
  free(l);
}

/* ---- adapter_config.json ------------------------------------------------------------------- */

typedef struct lora_cfg {
  int r;
  double scale;
  const lf_json *targets; /* target_modules when it is a list, else NULL */
  int partial;            /* layers_to_transform / layers_pattern / exclude_modules: a listed
                             module may have no tensors */
} lora_cfg;

/* A boolean flag that must be off: absent, null or false. */
static lf_status flag_off(const lf_json *root, const char *key, const char *path, const char *why) {
  const lf_json *v = lf_json_get(root, key);
  int b = 0;
  if (lf_json_typeof(v) == LF_JSON_NULL) return LF_OK;
  if (!lf_json_bool(v, &b))
    return lf_error(LF_ERR_FORMAT, "%s: %s must be true or false, not %s", path, key,
                    lf_json_type_str(lf_json_typeof(v)));
  return b ? lf_error(LF_ERR_UNSUPPORTED, "%s: %s is true: %s", path, key, why) : LF_OK;
}

/* A setting that must be unset: absent, null, false, {} or []. */
static lf_status unset(const lf_json *root, const char *key, const char *path, const char *why) {
  const lf_json *v = lf_json_get(root, key);
  const lf_json_type t = lf_json_typeof(v);
  int b = 1;
  if (t == LF_JSON_NULL || (lf_json_bool(v, &b) && !b) ||
      ((t == LF_JSON_OBJECT || t == LF_JSON_ARRAY) && lf_json_len(v) == 0))
    return LF_OK;
  return lf_error(LF_ERR_UNSUPPORTED, "%s: %s is set: %s", path, key, why);
}

static lf_status parse_config(const lf_json *root, const char *path, lora_cfg *c) {
  memset(c, 0, sizeof *c);
  if (lf_json_typeof(root) != LF_JSON_OBJECT)
    return lf_error(LF_ERR_FORMAT, "%s: not a JSON object", path);
  const lf_json *v = lf_json_get(root, "peft_type");
  const char *s = lf_json_str(v, NULL);
  if (lf_json_typeof(v) != LF_JSON_NULL && (!s || strcmp(s, "LORA") != 0))
    return lf_error(LF_ERR_UNSUPPORTED, "%s: peft_type is %s%.40s%s; only LORA adapters merge",
                    path, s ? "\"" : "", s ? s : "not a string", s ? "\"" : "");

  int64_t r = 0;
  if (!lf_json_int(lf_json_get(root, "r"), &r) || r < 1 || r > 65536)
    return lf_error(LF_ERR_FORMAT, "%s: r must be an integer in [1, 65536]", path);
  c->r = (int)r;
  double alpha = 0;
  if (!lf_json_num(lf_json_get(root, "lora_alpha"), &alpha) || !isfinite(alpha))
    return lf_error(LF_ERR_FORMAT, "%s: lora_alpha must be a finite number", path);
  int rslora = 0;
  v = lf_json_get(root, "use_rslora");
  if (lf_json_typeof(v) != LF_JSON_NULL && !lf_json_bool(v, &rslora))
    return lf_error(LF_ERR_FORMAT, "%s: use_rslora must be true or false", path);
  c->scale = rslora ? alpha / sqrt((double)r) : alpha / (double)r;

  v = lf_json_get(root, "bias");
  s = lf_json_str(v, NULL);
  if (lf_json_typeof(v) != LF_JSON_NULL && !s)
    return lf_error(LF_ERR_FORMAT, "%s: bias must be a string", path);
  if (s && strcmp(s, "none") != 0)
    return lf_error(LF_ERR_UNSUPPORTED,
                    "%s: bias is \"%.40s\": trained biases are not supported (only \"none\")", path,
                    s);
  LF_TRY(flag_off(root, "use_dora", path,
                  "DoRA is not supported (its merge rescales every column by a trained "
                  "magnitude; plain LoRA only)"));
  LF_TRY(flag_off(root, "lora_bias", path, "a bias on lora_B is not supported"));
  LF_TRY(flag_off(root, "use_qalora", path, "QALoRA is not supported"));
  LF_TRY(flag_off(root, "fan_in_fan_out", path,
                  "transposed (Conv1D, GPT-2 style) weights are not supported; Llama and Qwen "
                  "projections are Linear"));
  static const struct {
    const char *key, *why;
  } not_plain[] = {
      {"rank_pattern", "per-module ranks are not supported"},
      {"alpha_pattern", "per-module lora_alpha is not supported"},
      {"modules_to_save", "fully trained modules (modules_to_save) are not supported"},
      {"trainable_token_indices", "trained token embeddings are not supported"},
      {"layer_replication", "layer replication is not supported"},
      {"target_parameters", "LoRA on bare parameters (target_parameters) is not supported"},
      {"alora_invocation_tokens", "activated LoRA (aLoRA) cannot be merged"},
      {"use_bdlora", "block-diagonal LoRA is not supported"},
      {"kasa_config", "KaSA is not supported"},
      {"monteclora_config", "MonteCLoRA is not supported"},
      {"velora_config", "VeLoRA is not supported"},
      {"arrow_config", "Arrow routing is not supported"},
  };
  for (size_t i = 0; i < sizeof not_plain / sizeof not_plain[0]; i++)
    LF_TRY(unset(root, not_plain[i].key, path, not_plain[i].why));

  /* Initialisations that leave the base weights alone; the others (PiSSA, OLoRA, CorDA, LoftQ,
   * LoRA-GA) make the adapter relative to rewritten base weights, or change the computation. */
  v = lf_json_get(root, "init_lora_weights");
  s = lf_json_str(v, NULL);
  int b;
  if (lf_json_typeof(v) != LF_JSON_NULL && !lf_json_bool(v, &b) && !s)
    return lf_error(LF_ERR_FORMAT, "%s: init_lora_weights must be a boolean or a string", path);
  if (s && strcmp(s, "gaussian") && strcmp(s, "eva") && strcmp(s, "orthogonal"))
    return lf_error(LF_ERR_UNSUPPORTED,
                    "%s: init_lora_weights is \"%.40s\": such an adapter is relative to rewritten "
                    "base weights or computes differently; convert it to a plain LoRA adapter",
                    path, s);

  v = lf_json_get(root, "target_modules");
  const lf_json_type tt = lf_json_typeof(v);
  if (tt == LF_JSON_ARRAY) {
    for (size_t i = 0; i < lf_json_len(v); i++) {
      size_t len = 0;
      s = lf_json_str(lf_json_at(v, i), &len);
      if (!s) return lf_error(LF_ERR_FORMAT, "%s: target_modules[%zu] is not a string", path, i);
      if (module_index(s, len) < 0)
        return lf_error(LF_ERR_UNSUPPORTED,
                        "%s: target module \"%.60s\" is not one lfserve merges (" MODULE_LIST ")",
                        path, s);
    }
    c->targets = v;
  } else if (tt != LF_JSON_NULL && tt != LF_JSON_STRING) {
    /* a string is a regular expression (or "all-linear"): the tensors say what it matched */
    return lf_error(LF_ERR_FORMAT, "%s: target_modules must be a list, a string or null", path);
  }
  static const char *const narrowing[] = {"layers_to_transform", "layers_pattern",
                                          "exclude_modules"};
  for (size_t i = 0; i < sizeof narrowing / sizeof narrowing[0]; i++) {
    v = lf_json_get(root, narrowing[i]);
    if (lf_json_typeof(v) != LF_JSON_NULL &&
        !((lf_json_typeof(v) == LF_JSON_ARRAY || lf_json_typeof(v) == LF_JSON_OBJECT) &&
          lf_json_len(v) == 0))
      c->partial = 1;
  }
  return LF_OK;
}

/* ---- adapter_model.safetensors ------------------------------------------------------------- */

/* What a tensor of the adapter is, by its name's ending. */
typedef enum { PART_A, PART_B, PART_EMB_A, PART_EMB_B, PART_BASE } part_kind;
static const struct {
  const char *suffix;
  part_kind kind;
} k_parts[] = {
    {".lora_A.weight", PART_A},        {".lora_B.weight", PART_B},
    {".lora_embedding_A", PART_EMB_A}, {".lora_embedding_B", PART_EMB_B},
    {".base_layer.weight", PART_BASE},
};

/* The index of the checkpoint tensor named name, or -1. */
static int find_index(const lf_tensor_set *s, const char *name) {
  for (int i = 0; i < s->n; i++)
    if (!strcmp(s->t[i].name, name)) return i;
  return -1;
}

static void shape_str(char *buf, size_t cap, const lf_tensor_src *t) {
  size_t n = (size_t)snprintf(buf, cap, "[");
  for (int d = 0; d < t->ndim && n < cap; d++)
    n += (size_t)snprintf(buf + n, cap - n, d ? ", %lld" : "%lld", (long long)t->shape[d]);
  if (n < cap) snprintf(buf + n, cap - n, "]");
}

/* t must be the matrix [rows][cols]. */
static lf_status want_shape(const char *path, const lf_tensor_src *t, int64_t rows, int64_t cols,
                            const char *what) {
  if (t->ndim == 2 && t->shape[0] == rows && t->shape[1] == cols) return LF_OK;
  char got[96];
  shape_str(got, sizeof got, t);
  return lf_error(LF_ERR_SHAPE, "%s: tensor %s has shape %s, expected [%lld, %lld] (%s)", path,
                  t->name, got, (long long)rows, (long long)cols, what);
}

/* The whole matrix t as fp32 in a fresh buffer, every value finite (lf_tensor_read_f32 refuses
 * a non-finite one, naming the file and the tensor). */
static lf_status read_factor(const char *path, const lf_tensor_src *t, float **out) {
  *out = NULL;
  const size_t n = (size_t)t->shape[0] * (size_t)t->shape[1];
  float *f = malloc((n ? n : 1) * sizeof *f);
  if (!f) return lf_error(LF_ERR_OUT_OF_MEMORY, "%s: tensor %s: out of memory", path, t->name);
  lf_status st = lf_tensor_read_f32(t, 0, t->shape[0], 0, t->shape[1], f);
  if (st != LF_OK) {
    free(f);
    return st;
  }
  *out = f;
  return LF_OK;
}

/* The checkpoint tensor the adapter's module adapts: "<module>.weight", a matrix. */
static lf_status find_target(const lf_checkpoint *ck, const char *path, const char *tensor,
                             const char *module, size_t mlen, int mod, int *idx) {
  char name[LF_TENSOR_NAME_MAX];
  if (mlen + sizeof ".weight" > sizeof name)
    return lf_error(LF_ERR_FORMAT, "%s: tensor %s: module name too long", path, tensor);
  memcpy(name, module, mlen);
  memcpy(name + mlen, ".weight", sizeof ".weight");
  if (k_modules[mod].kind != MOD_LINEAR && ck->cfg.tie_embeddings)
    return lf_error(LF_ERR_UNSUPPORTED,
                    "%s: tensor %s changes %s, but the model ties its output layer to its "
                    "embedding: merging into a tied layer would change both (PEFT warns about "
                    "it), which lfserve does not do. Untie the model first",
                    path, tensor, name);
  *idx = find_index(&ck->tensors, name);
  if (*idx < 0)
    return lf_error(LF_ERR_MISSING_TENSOR, "%s: tensor %s adapts %s, which the model does not have",
                    path, tensor, name);
  if (ck->tensors.t[*idx].ndim != 2)
    return lf_error(LF_ERR_SHAPE, "%s: %s is not a matrix", path, name);
  return LF_OK;
}

/* The update of the module whose lora_A (or lora_embedding_A) is a: u = scale * B, v = A (an
 * embedding: u = scale * A^T, v = B^T), checked against the target [rows][cols] and cfg's r. */
static lf_status make_update(const lf_checkpoint *ck, const lf_tensor_set *set, const char *path,
                             const lora_cfg *c, const lf_tensor_src *a, int mod, int target,
                             lora_update **out) {
  *out = NULL;
  const int emb = k_modules[mod].kind == MOD_EMBED;
  const size_t alen = strlen(a->name), slen = strlen(emb ? ".lora_embedding_A" : ".lora_A.weight");
  char bname[LF_TENSOR_NAME_MAX];
  snprintf(bname, sizeof bname, "%.*s%s", (int)(alen - slen), a->name,
           emb ? ".lora_embedding_B" : ".lora_B.weight");
  const lf_tensor_src *b = lf_tensor_set_find(set, bname);
  if (!b) return lf_error(LF_ERR_FORMAT, "%s: %s has no partner %s", path, a->name, bname);
  const lf_tensor_src *w = &ck->tensors.t[target];
  const int64_t rows = w->shape[0], cols = w->shape[1], r = c->r;
  char what[LF_TENSOR_NAME_MAX + 64];
  snprintf(what, sizeof what, "r %d for %s [%lld, %lld]", c->r, w->name, (long long)rows,
           (long long)cols);
  if (emb) {
    LF_TRY(want_shape(path, a, r, rows, what));
    LF_TRY(want_shape(path, b, cols, r, what));
  } else {
    LF_TRY(want_shape(path, a, r, cols, what));
    LF_TRY(want_shape(path, b, rows, r, what));
  }
  /* The factors' own sizes are bounded by the mapped file, so this cannot overflow on a real
   * file; checked anyway for the arithmetic below. */
  if ((uint64_t)rows + (uint64_t)cols >
      (SIZE_MAX / 2 - sizeof(lora_update)) / sizeof(float) / (uint64_t)r)
    return lf_error(LF_ERR_OUT_OF_MEMORY, "%s: %s is too large", path, a->name);
  float *fa = NULL, *fb = NULL;
  LF_TRY(read_factor(path, a, &fa));
  lf_status st = read_factor(path, b, &fb);
  lora_update *u = NULL;
  if (st == LF_OK) {
    u = malloc(sizeof *u + ((size_t)rows + (size_t)cols) * (size_t)r * sizeof(float));
    if (!u) st = lf_error(LF_ERR_OUT_OF_MEMORY, "%s: %s: out of memory", path, a->name);
  }
  if (st == LF_OK) {
    float *uu = u->data, *vv = u->data + (size_t)rows * (size_t)r; /* [rows][r], [r][cols] */
    for (int64_t i = 0; i < rows; i++)
      for (int64_t k = 0; k < r; k++)
        uu[i * r + k] = (float)(c->scale * (emb ? fa[k * rows + i] : fb[i * r + k]));
    for (int64_t k = 0; k < r; k++)
      for (int64_t j = 0; j < cols; j++)
        vv[k * cols + j] = emb ? fb[j * r + k] : fa[k * cols + j];
    /* Every sum of r products stays far inside fp32 (a real update is small next to W). */
    double umax = 0, vmax = 0;
    for (size_t i = 0; i < (size_t)rows * (size_t)r; i++)
      umax = fmax(umax, fabs((double)uu[i]));
    for (size_t i = 0; i < (size_t)r * (size_t)cols; i++)
      vmax = fmax(vmax, fabs((double)vv[i]));
    if (!(umax * vmax * (double)r < 1e30))
      st = lf_error(LF_ERR_FORMAT,
                    "%s: %s: scale %g times the factors (largest %g, %g) overflows fp32", path,
                    a->name, c->scale, umax / fabs(c->scale), vmax);
    u->lr = (lf_tensor_lowrank){.rows = rows, .cols = cols, .rank = c->r, .u = uu, .v = vv};
    u->target = target;
    u->module = mod;
  }
  if (st == LF_OK)
    *out = u;
  else
    free(u);
  free(fa);
  free(fb);
  return st;
}

/* Everything the adapter would change, checked; nothing attached yet. base[i] (NULL or an
 * adapter tensor) replaces checkpoint tensor i. */
static lf_status plan(const lf_checkpoint *ck, struct lf_lora *l, const char *path,
                      const lora_cfg *c, const lf_tensor_src **base) {
  const lf_tensor_set *set = &l->set;
  l->up = calloc((size_t)(set->n > 0 ? set->n : 1), sizeof *l->up);
  if (!l->up) return lf_error(LF_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
  const size_t plen = strlen(PEFT_PREFIX);
  for (int i = 0; i < set->n; i++) {
    const lf_tensor_src *t = &set->t[i];
    const size_t len = strlen(t->name);
    if (len <= plen || memcmp(t->name, PEFT_PREFIX, plen) != 0)
      return lf_error(LF_ERR_FORMAT,
                      "%s: tensor %s is not named " PEFT_PREFIX "<module>.<part> as PEFT names "
                      "adapter tensors",
                      path, t->name);
    int part = -1;
    size_t slen = 0;
    for (size_t p = 0; p < sizeof k_parts / sizeof k_parts[0] && part < 0; p++) {
      slen = strlen(k_parts[p].suffix);
      if (len > plen + slen && !memcmp(t->name + len - slen, k_parts[p].suffix, slen))
        part = (int)p;
    }
    if (part < 0)
      return lf_error(LF_ERR_UNSUPPORTED,
                      "%s: tensor %s is not a LoRA factor lfserve merges (lora_A / lora_B, "
                      "lora_embedding_A / B, base_layer): DoRA magnitudes, LoRA biases and other "
                      "variants are not supported",
                      path, t->name);
    const part_kind kind = k_parts[part].kind;
    const char *module = t->name + plen;
    const size_t mlen = len - plen - slen;
    const int mod = module_index(module, mlen);
    if (mod < 0)
      return lf_error(LF_ERR_UNSUPPORTED,
                      "%s: tensor %s adapts module %.*s; lfserve merges only " MODULE_LIST, path,
                      t->name, (int)mlen, module);
    const int emb = k_modules[mod].kind == MOD_EMBED;
    if (kind != PART_BASE && emb != (kind == PART_EMB_A || kind == PART_EMB_B))
      return lf_error(LF_ERR_FORMAT, "%s: tensor %s: %s's factors are named %s", path, t->name,
                      k_modules[mod].name,
                      emb ? "lora_embedding_A / lora_embedding_B" : "lora_A / lora_B");
    if (kind == PART_B || kind == PART_EMB_B) {
      char aname[LF_TENSOR_NAME_MAX];
      snprintf(aname, sizeof aname, "%.*s%s", (int)(len - slen), t->name,
               kind == PART_B ? ".lora_A.weight" : ".lora_embedding_A");
      if (!lf_tensor_set_find(set, aname))
        return lf_error(LF_ERR_FORMAT, "%s: %s has no partner %s", path, t->name, aname);
      continue; /* merged with its A */
    }
    int target = -1;
    LF_TRY(find_target(ck, path, t->name, module, mlen, mod, &target));
    if (kind == PART_BASE) {
      const lf_tensor_src *w = &ck->tensors.t[target];
      char what[LF_TENSOR_NAME_MAX + 64];
      snprintf(what, sizeof what, "the shape of %s: an adapter that resizes it is not supported",
               w->name);
      LF_TRY(want_shape(path, t, w->shape[0], w->shape[1], what));
      base[target] = t;
      continue;
    }
    for (int j = 0; j < l->n_up; j++)
      if (l->up[j]->target == target)
        return lf_error(LF_ERR_FORMAT, "%s: two LoRA updates for %s", path,
                        ck->tensors.t[target].name);
    LF_TRY(make_update(ck, set, path, c, t, mod, target, &l->up[l->n_up]));
    l->n_up++;
  }
  if (l->n_up == 0)
    return lf_error(LF_ERR_FORMAT, "%s: no LoRA factors (lora_A / lora_B) in the adapter", path);
  return LF_OK;
}

/* target_modules (a list) against the tensors: every module adapted is listed, and every listed
 * module is adapted somewhere unless the config narrows the layers. */
static lf_status check_targets(const struct lf_lora *l, const lora_cfg *c, const char *path,
                               const char *cfg_path) {
  if (!c->targets) return LF_OK;
  int listed[N_MODULES] = {0}, used[N_MODULES] = {0};
  for (size_t i = 0; i < lf_json_len(c->targets); i++) {
    size_t len = 0;
    const char *s = lf_json_str(lf_json_at(c->targets, i), &len);
    listed[module_index(s, len)] = 1; /* parse_config checked every entry */
  }
  for (int i = 0; i < l->n_up; i++)
    used[l->up[i]->module] = 1;
  for (size_t m = 0; m < N_MODULES; m++) {
    if (used[m] && !listed[m])
      return lf_error(LF_ERR_FORMAT, "%s adapts %s, which target_modules in %s does not list", path,
                      k_modules[m].name, cfg_path);
    if (listed[m] && !used[m] && !c->partial)
      return lf_error(LF_ERR_FORMAT,
                      "%s: target_modules lists %s, but %s has no LoRA factors "
                      "for it",
                      cfg_path, k_modules[m].name, path);
  }
  return LF_OK;
}

static char *path_join(const char *dir, const char *file) {
  const size_t n = strlen(dir) + 1 + strlen(file) + 1;
  char *p = malloc(n);
  if (p) snprintf(p, n, "%s/%s", dir, file);
  return p;
}

static int is_file(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

lf_status lf_checkpoint_apply_lora(lf_checkpoint *ck, const char *dir) {
  if (!ck || !dir) return lf_error(LF_ERR_INVALID_ARG, "lf_checkpoint_apply_lora: NULL argument");
  if (ck->lora)
    return lf_error(LF_ERR_STATE, "%s: the checkpoint already has a LoRA adapter merged", dir);
  if (ck->random_weights)
    return lf_error(LF_ERR_UNSUPPORTED,
                    "%s: a LoRA adapter needs a checkpoint with weights; random:NAME has none",
                    dir);
  if (!strcmp(ck->cfg.model_type, "llama2c"))
    return lf_error(LF_ERR_UNSUPPORTED,
                    "%s: LoRA adapters merge into Hugging Face and GGUF checkpoints, not llama2.c "
                    "files (their q/k rows are in another order)",
                    dir);
  struct stat st;
  if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
    return lf_error(LF_ERR_IO,
                    "%s: not a LoRA adapter directory (adapter_config.json + "
                    "adapter_model.safetensors)",
                    dir);
  char *cfg_path = path_join(dir, "adapter_config.json");
  char *st_path = path_join(dir, "adapter_model.safetensors");
  char *bin_path = path_join(dir, "adapter_model.bin");
  char *text = NULL;
  size_t len = 0;
  lf_json *root = NULL;
  const lf_tensor_src **base = NULL;
  struct lf_lora *l = calloc(1, sizeof *l);
  lora_cfg c;
  lf_status s = LF_OK;
  if (!cfg_path || !st_path || !bin_path || !l) {
    s = lf_error(LF_ERR_OUT_OF_MEMORY, "%s: out of memory", dir);
    goto done;
  }
  if ((s = lf_read_small_file(cfg_path, &text, &len)) != LF_OK) goto done;
  char jerr[200];
  if ((s = lf_json_parse(text, len, &root, jerr, sizeof jerr)) != LF_OK) {
    s = lf_error(s, "%s: bad JSON: %s", cfg_path, jerr);
    goto done;
  }
  if ((s = parse_config(root, cfg_path, &c)) != LF_OK) goto done;
  if (!is_file(st_path)) {
    s = is_file(bin_path)
            ? lf_error(LF_ERR_UNSUPPORTED,
                       "%s: only adapter_model.bin (a pickle) is there; lfserve reads "
                       "adapter_model.safetensors (save with safe_serialization=True)",
                       dir)
            : lf_error(LF_ERR_IO, "%s: adapter_model.safetensors is missing", dir);
    goto done;
  }
  if ((s = lf_safetensors_load(&l->set, st_path)) != LF_OK) goto done;
  base = calloc((size_t)(ck->tensors.n > 0 ? ck->tensors.n : 1), sizeof *base);
  if (!base) {
    s = lf_error(LF_ERR_OUT_OF_MEMORY, "%s: out of memory", dir);
    goto done;
  }
  if ((s = plan(ck, l, st_path, &c, base)) != LF_OK) goto done;
  if ((s = check_targets(l, &c, st_path, cfg_path)) != LF_OK) goto done;

  /* Checked: attach. A base layer replaces the stored weight (in the Hugging Face layout, so
   * no row permutation), then the update goes on top of it. */
  for (int i = 0; i < ck->tensors.n; i++) {
    if (!base[i]) continue;
    lf_tensor_src *t = &ck->tensors.t[i];
    t->dtype = base[i]->dtype;
    t->ndim = base[i]->ndim;
    memcpy(t->shape, base[i]->shape, sizeof t->shape);
    t->data = base[i]->data;
    t->file = base[i]->file;
    t->row_perm_heads = 0;
  }
  for (int i = 0; i < l->n_up; i++)
    ck->tensors.t[l->up[i]->target].lowrank = &l->up[i]->lr;
  ck->lora = l;
  l = NULL;
done:
  lf_lora_free(l);
  free(base);
  lf_json_free(root);
  free(text);
  free(bin_path);
  free(st_path);
  free(cfg_path);
  return s;
}

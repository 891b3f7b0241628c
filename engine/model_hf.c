/* Hugging Face checkpoints: config.json (llama, qwen2, qwen3) plus model.safetensors or a sharded
 * model.safetensors.index.json. Defaults follow transformers' config classes, so a config that
 * omits a key means what it means to transformers. */
/* O_CLOEXEC: POSIX.1-2008, also under -std=c11. */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/error.h"
#include "text/json.h"
#include "model.h"

/* config.json and the shard index are small; anything bigger is not what we think it is. */
#define HF_MAX_JSON_BYTES (64u << 20)

lf_status lf_read_small_file(const char *path, char **out, size_t *len) {
  *out = NULL;
  *len = 0;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return lf_error(LF_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return lf_error(LF_ERR_IO, "%s: not a readable regular file", path);
  }
  if ((uint64_t)st.st_size > HF_MAX_JSON_BYTES) {
    close(fd);
    return lf_error(LF_ERR_FORMAT, "%s: %lld bytes is too large for a JSON config", path,
                    (long long)st.st_size);
  }
  size_t cap = (size_t)st.st_size, n = 0;
  char *buf = malloc(cap + 1);
  if (!buf) {
    close(fd);
    return lf_error(LF_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
  }
  while (n < cap) {
    ssize_t r = read(fd, buf + n, cap - n);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      int e = errno;
      free(buf);
      close(fd);
      return lf_error(LF_ERR_IO, "%s: read failed: %s", path, strerror(e));
    }
    if (r == 0) break; /* shrank while we read: take what is there */
    n += (size_t)r;
  }
  close(fd);
  buf[n] = '\0';
  *out = buf;
  *len = n;
  return LF_OK;
}

/* dir + "/" + name in a fresh string. */
static lf_status hf_join(const char *dir, const char *name, char **out) {
  size_t dl = strlen(dir), nl = strlen(name);
  int slash = dl > 0 && dir[dl - 1] == '/';
  char *p = malloc(dl + nl + 2);
  if (!p) return lf_error(LF_ERR_OUT_OF_MEMORY, "out of memory");
  memcpy(p, dir, dl);
  if (!slash) p[dl++] = '/';
  memcpy(p + dl, name, nl + 1);
  *out = p;
  return LF_OK;
}

/* ---- config.json ------------------------------------------------------------------------- */

/* Absent and null both mean "use the default", as in transformers. */
static int hf_absent(const lf_json *v) {
  return lf_json_typeof(v) == LF_JSON_NULL;
}

/* An integer key in [min, INT_MAX]. where names the enclosing object in messages ("" for the
 * top level). */
static lf_status hf_int(const char *path, const lf_json *obj, const char *where, const char *key,
                        int required, int def, int min, int *out) {
  const lf_json *v = lf_json_get(obj, key);
  if (hf_absent(v)) {
    if (required) return lf_error(LF_ERR_FORMAT, "%s: missing required key %s%s", path, where, key);
    *out = def;
    return LF_OK;
  }
  int64_t x;
  if (!lf_json_int(v, &x))
    return lf_error(LF_ERR_FORMAT, "%s: key %s%s must be an integer, found a %s", path, where, key,
                    v->type == LF_JSON_NUMBER ? "non-integral number" : lf_json_type_str(v->type));
  if (x < min || x > INT_MAX)
    return lf_error(LF_ERR_FORMAT, "%s: key %s%s is %lld, must be in [%d, %d]", path, where, key,
                    (long long)x, min, INT_MAX);
  *out = (int)x;
  return LF_OK;
}

static lf_status hf_float(const char *path, const lf_json *obj, const char *where, const char *key,
                          int required, float def, float *out) {
  const lf_json *v = lf_json_get(obj, key);
  if (hf_absent(v)) {
    if (required) return lf_error(LF_ERR_FORMAT, "%s: missing required key %s%s", path, where, key);
    *out = def;
    return LF_OK;
  }
  double x;
  if (!lf_json_num(v, &x))
    return lf_error(LF_ERR_FORMAT, "%s: key %s%s must be a number, found a %s", path, where, key,
                    lf_json_type_str(v->type));
  /* Converting an out-of-range double to float is undefined behaviour, not infinity. */
  if (!(fabs(x) <= FLT_MAX))
    return lf_error(LF_ERR_FORMAT, "%s: key %s%s is %g, out of range for a float", path, where, key,
                    x);
  *out = (float)x;
  return LF_OK;
}

static lf_status hf_bool(const char *path, const lf_json *obj, const char *key, int def, int *out) {
  const lf_json *v = lf_json_get(obj, key);
  if (hf_absent(v)) {
    *out = def;
    return LF_OK;
  }
  if (!lf_json_bool(v, out))
    return lf_error(LF_ERR_FORMAT, "%s: key %s must be true or false, found a %s", path, key,
                    lf_json_type_str(v->type));
  return LF_OK;
}

/* rope_theta and rope scaling, from either transformers 5's "rope_parameters" or transformers
 * 4's top-level "rope_theta" + "rope_scaling". */
static lf_status hf_rope(const char *path, const lf_json *root, lf_model_config *c) {
  const lf_json *params = lf_json_get(root, "rope_parameters");
  const lf_json *src = NULL;
  const char *where = "";
  LF_TRY(hf_float(path, root, "", "rope_theta", 0, 10000.0f, &c->rope_theta));
  if (!hf_absent(params)) {
    if (params->type != LF_JSON_OBJECT)
      return lf_error(LF_ERR_FORMAT, "%s: key rope_parameters must be an object, found a %s", path,
                      lf_json_type_str(params->type));
    src = params;
    where = "rope_parameters.";
    LF_TRY(hf_float(path, params, where, "rope_theta", 0, c->rope_theta, &c->rope_theta));
  } else {
    const lf_json *scaling = lf_json_get(root, "rope_scaling");
    if (!hf_absent(scaling)) {
      if (scaling->type != LF_JSON_OBJECT)
        return lf_error(LF_ERR_FORMAT, "%s: key rope_scaling must be an object or null, found a %s",
                        path, lf_json_type_str(scaling->type));
      src = scaling;
      where = "rope_scaling.";
    }
  }
  c->rope_scaling = LF_ROPE_SCALING_NONE;
  if (!src) return LF_OK;

  /* transformers 4 wrote "type" before it settled on "rope_type". */
  const lf_json *type = lf_json_get(src, "rope_type");
  const char *type_key = "rope_type";
  if (hf_absent(type)) {
    type = lf_json_get(src, "type");
    type_key = "type";
  }
  if (hf_absent(type)) return LF_OK;
  const char *t = lf_json_str(type, NULL);
  if (!t)
    return lf_error(LF_ERR_FORMAT, "%s: key %s%s must be a string, found a %s", path, where,
                    type_key, lf_json_type_str(type->type));
  if (strcmp(t, "default") == 0) return LF_OK;
  if (strcmp(t, "llama3") != 0)
    return lf_error(LF_ERR_UNSUPPORTED,
                    "%s: rope type \"%s\" (%s%s) is not supported (default, llama3)", path, t,
                    where, type_key);
  c->rope_scaling = LF_ROPE_SCALING_LLAMA3;
  LF_TRY(hf_float(path, src, where, "factor", 1, 0, &c->rope_factor));
  LF_TRY(hf_float(path, src, where, "low_freq_factor", 1, 0, &c->rope_low_freq_factor));
  LF_TRY(hf_float(path, src, where, "high_freq_factor", 1, 0, &c->rope_high_freq_factor));
  LF_TRY(hf_int(path, src, where, "original_max_position_embeddings", 1, 0, 1,
                &c->rope_original_max_pos));
  return LF_OK;
}

static lf_status hf_special_tokens(const char *path, const lf_json *root, lf_model_config *c) {
  LF_TRY(hf_int(path, root, "", "bos_token_id", 0, -1, 0, &c->bos_id));
  c->n_eos = 0;
  const lf_json *eos = lf_json_get(root, "eos_token_id");
  if (hf_absent(eos)) return LF_OK;
  const int cap = (int)(sizeof c->eos_ids / sizeof c->eos_ids[0]);
  if (eos->type == LF_JSON_NUMBER) {
    LF_TRY(hf_int(path, root, "", "eos_token_id", 1, 0, 0, &c->eos_ids[0]));
    c->n_eos = 1;
    return LF_OK;
  }
  if (eos->type != LF_JSON_ARRAY)
    return lf_error(LF_ERR_FORMAT,
                    "%s: key eos_token_id must be an integer or a list of integers, found a %s",
                    path, lf_json_type_str(eos->type));
  if (lf_json_len(eos) > (size_t)cap)
    return lf_error(LF_ERR_FORMAT, "%s: eos_token_id lists %zu ids, at most %d are supported", path,
                    lf_json_len(eos), cap);
  for (size_t i = 0; i < lf_json_len(eos); i++) {
    int64_t x;
    if (!lf_json_int(lf_json_at(eos, i), &x) || x < 0 || x > INT_MAX)
      return lf_error(LF_ERR_FORMAT, "%s: eos_token_id[%zu] is not a non-negative integer", path,
                      i);
    c->eos_ids[c->n_eos++] = (int)x;
  }
  return LF_OK;
}

static lf_status hf_config(const char *path, const lf_json *root, lf_model_config *c) {
  if (lf_json_typeof(root) != LF_JSON_OBJECT)
    return lf_error(LF_ERR_FORMAT, "%s: top level is not a JSON object", path);
  const lf_json *mt = lf_json_get(root, "model_type");
  if (hf_absent(mt)) return lf_error(LF_ERR_FORMAT, "%s: missing required key model_type", path);
  const char *type = lf_json_str(mt, NULL);
  if (!type)
    return lf_error(LF_ERR_FORMAT, "%s: key model_type must be a string, found a %s", path,
                    lf_json_type_str(mt->type));
  const int llama = strcmp(type, "llama") == 0, qwen2 = strcmp(type, "qwen2") == 0,
            qwen3 = strcmp(type, "qwen3") == 0;
  if (!llama && !qwen2 && !qwen3)
    return lf_error(LF_ERR_UNSUPPORTED,
                    "%s: model_type \"%.64s\" is not supported (llama, qwen2, qwen3)", path, type);
  snprintf(c->model_type, sizeof c->model_type, "%s", type);

  LF_TRY(hf_int(path, root, "", "hidden_size", 1, 0, 1, &c->dim));
  LF_TRY(hf_int(path, root, "", "intermediate_size", 1, 0, 1, &c->hidden_dim));
  LF_TRY(hf_int(path, root, "", "num_hidden_layers", 1, 0, 1, &c->n_layers));
  LF_TRY(hf_int(path, root, "", "num_attention_heads", 1, 0, 1, &c->n_heads));
  LF_TRY(hf_int(path, root, "", "num_key_value_heads", 0, c->n_heads, 1, &c->n_kv_heads));
  /* Qwen3Config's head_dim defaults to 128, the others' to hidden_size / heads. */
  LF_TRY(hf_int(path, root, "", "head_dim", 0, qwen3 ? 128 : c->dim / c->n_heads, 1, &c->head_dim));
  LF_TRY(hf_int(path, root, "", "vocab_size", 1, 0, 1, &c->vocab_size));
  LF_TRY(hf_int(path, root, "", "max_position_embeddings", 1, 0, 1, &c->max_seq_len));
  LF_TRY(hf_float(path, root, "", "rms_norm_eps", 0, 1e-6f, &c->norm_eps));
  LF_TRY(hf_rope(path, root, c));
  LF_TRY(hf_bool(path, root, "tie_word_embeddings", 0, &c->tie_embeddings));
  c->rope_style = LF_ROPE_HALF;

  int attention_bias = 0;
  LF_TRY(hf_bool(path, root, "attention_bias", 0, &attention_bias));
  /* Qwen2's attention always has q/k/v biases (and no o_proj bias); it has no config key. */
  c->qkv_bias = qwen2 ? 1 : attention_bias;
  c->qk_norm = qwen3;

  /* Keys that change the architecture in ways the forward pass does not implement: refuse
   * rather than compute something else. */
  const lf_json *act = lf_json_get(root, "hidden_act");
  if (!hf_absent(act)) {
    const char *a = lf_json_str(act, NULL);
    if (!a)
      return lf_error(LF_ERR_FORMAT, "%s: key hidden_act must be a string, found a %s", path,
                      lf_json_type_str(act->type));
    if (strcmp(a, "silu") != 0)
      return lf_error(LF_ERR_UNSUPPORTED, "%s: hidden_act \"%.32s\" is not supported (silu)", path,
                      a);
  }
  /* transformers 5 lists each layer's attention kind; only full attention is implemented. */
  const lf_json *kinds = lf_json_get(root, "layer_types");
  for (size_t i = 0; i < lf_json_len(kinds); i++) {
    const char *k = lf_json_str(lf_json_at(kinds, i), NULL);
    if (!k || strcmp(k, "full_attention") != 0)
      return lf_error(LF_ERR_UNSUPPORTED,
                      "%s: layer_types[%zu] is not \"full_attention\" (only full attention is "
                      "supported)",
                      path, i);
  }
  int flag = 0;
  LF_TRY(hf_bool(path, root, "mlp_bias", 0, &flag));
  if (flag) return lf_error(LF_ERR_UNSUPPORTED, "%s: mlp_bias=true is not supported", path);
  if (!llama) {
    LF_TRY(hf_bool(path, root, "use_sliding_window", 0, &flag));
    if (flag)
      return lf_error(LF_ERR_UNSUPPORTED, "%s: use_sliding_window=true is not supported", path);
  }
  return hf_special_tokens(path, root, c);
}

lf_status lf_config_parse_hf(const char *json, size_t len, const char *path, lf_model_config *cfg) {
  if (!cfg || (!json && len))
    return lf_error(LF_ERR_INVALID_ARG, "lf_config_parse_hf: NULL argument");
  if (!path) path = "config.json";
  memset(cfg, 0, sizeof *cfg);
  lf_json *root = NULL;
  char jerr[200];
  lf_status st = lf_json_parse(json, len, &root, jerr, sizeof jerr);
  if (st != LF_OK) return lf_error(st, "%s: bad JSON: %s", path, jerr);
  st = hf_config(path, root, cfg);
  lf_json_free(root);
  return st;
}

/* ---- weights ----------------------------------------------------------------------------- */

/* A shard name from the index must name a file inside dir. */
static int hf_shard_name_ok(const char *s, size_t len) {
  return len > 0 && len == strlen(s) && !strchr(s, '/') && !strchr(s, '\\') && !strstr(s, "..");
}

static lf_status hf_load_index(const char *dir, const char *index_path, lf_tensor_set *set) {
  char *text = NULL;
  size_t len = 0;
  lf_json *root = NULL;
  const char **shards = NULL; /* [n_shards] distinct names, pointing into root */
  char **shard_paths = NULL;  /* [n_shards] */
  size_t n_shards = 0;
  char jerr[200];
  lf_status st = lf_read_small_file(index_path, &text, &len);
  if (st != LF_OK) return st;
  st = lf_json_parse(text, len, &root, jerr, sizeof jerr);
  free(text);
  if (st != LF_OK) return lf_error(st, "%s: bad JSON: %s", index_path, jerr);

  const lf_json *map = lf_json_get(root, "weight_map");
  const size_t n = lf_json_len(map);
  if (lf_json_typeof(map) != LF_JSON_OBJECT) {
    st = lf_error(LF_ERR_FORMAT, "%s: missing or non-object weight_map", index_path);
    goto done;
  }
  shards = calloc(n ? n : 1, sizeof *shards);
  shard_paths = calloc(n ? n : 1, sizeof *shard_paths);
  if (!shards || !shard_paths) {
    st = lf_error(LF_ERR_OUT_OF_MEMORY, "%s: out of memory", index_path);
    goto done;
  }
  for (size_t i = 0; i < n; i++) {
    size_t sl;
    const char *shard = lf_json_str(lf_json_at(map, i), &sl);
    if (!shard) {
      st = lf_error(LF_ERR_FORMAT, "%s: weight_map entry for %s is not a string", index_path,
                    lf_json_key_at(map, i));
      goto done;
    }
    if (!hf_shard_name_ok(shard, sl)) {
      st = lf_error(LF_ERR_FORMAT,
                    "%s: shard name \"%.100s\" for %s must be a plain file name in the directory",
                    index_path, shard, lf_json_key_at(map, i));
      goto done;
    }
    size_t k = 0;
    while (k < n_shards && strcmp(shards[k], shard) != 0)
      k++;
    if (k == n_shards) shards[n_shards++] = shard;
  }
  /* Each shard once, in order of first appearance. */
  for (size_t k = 0; k < n_shards; k++) {
    st = hf_join(dir, shards[k], &shard_paths[k]);
    if (st != LF_OK) goto done;
    st = lf_safetensors_load(set, shard_paths[k]);
    if (st != LF_OK) goto done;
  }
  for (size_t i = 0; i < n; i++) {
    const char *name = lf_json_key_at(map, i);
    const char *shard = lf_json_str(lf_json_at(map, i), NULL);
    size_t k = 0;
    while (strcmp(shards[k], shard) != 0)
      k++;
    const lf_tensor_src *t = lf_tensor_set_find(set, name);
    if (!t) {
      st = lf_error(LF_ERR_MISSING_TENSOR, "%s: maps tensor %s to %s, which does not contain it",
                    index_path, name, shard_paths[k]);
      goto done;
    }
    if (strcmp(t->file, shard_paths[k]) != 0) {
      st = lf_error(LF_ERR_MISSING_TENSOR,
                    "%s: maps tensor %s to %s, which does not contain it (it is in %s)", index_path,
                    name, shard_paths[k], t->file);
      goto done;
    }
  }
done:
  for (size_t k = 0; shard_paths && k < n_shards; k++)
    free(shard_paths[k]);
  free(shard_paths);
  free(shards);
  lf_json_free(root);
  return st;
}

static int hf_is_file(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static lf_status hf_open(const char *dir, lf_checkpoint *ck) {
  char *cfg_path = NULL, *single = NULL, *index = NULL, *text = NULL;
  size_t len = 0;
  lf_status st = hf_join(dir, "config.json", &cfg_path);
  if (st == LF_OK) st = hf_join(dir, "model.safetensors", &single);
  if (st == LF_OK) st = hf_join(dir, "model.safetensors.index.json", &index);
  if (st == LF_OK) st = lf_read_small_file(cfg_path, &text, &len);
  if (st == LF_OK) st = lf_config_parse_hf(text, len, cfg_path, &ck->cfg);
  if (st == LF_OK) st = lf_config_validate(&ck->cfg, cfg_path);
  if (st == LF_OK) {
    if (hf_is_file(single))
      st = lf_safetensors_load(&ck->tensors, single);
    else if (hf_is_file(index))
      st = hf_load_index(dir, index, &ck->tensors);
    else
      st = lf_error(LF_ERR_IO,
                    "%s: neither model.safetensors nor model.safetensors.index.json "
                    "found",
                    dir);
  }
  free(text);
  free(index);
  free(single);
  free(cfg_path);
  return st;
}

lf_status lf_checkpoint_open_hf(const char *dir, lf_checkpoint *out) {
  if (!dir || !out) return lf_error(LF_ERR_INVALID_ARG, "lf_checkpoint_open_hf: NULL argument");
  memset(out, 0, sizeof *out);
  lf_status st = hf_open(dir, out);
  if (st != LF_OK) lf_checkpoint_close(out);
  return st;
}

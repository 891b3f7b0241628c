/* Model configuration and fp32 weights (CPU backend; the CUDA backend converts from these
 * sources to bf16 itself). */
#ifndef LF_MODEL_H
#define LF_MODEL_H

#include <stdint.h>

#include "lfserve.h"
#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum lf_rope_style {
  LF_ROPE_HALF = 0,    /* HF rotate_half: pairs (x[i], x[i + hd/2]) */
  LF_ROPE_INTERLEAVED, /* llama2.c: pairs (x[2i], x[2i+1]) */
} lf_rope_style;

typedef enum lf_rope_scaling { LF_ROPE_SCALING_NONE = 0, LF_ROPE_SCALING_LLAMA3 } lf_rope_scaling;

typedef struct lf_model_config {
  char model_type[32]; /* "llama", "qwen2", "qwen3", "llama2c" */
  int dim;             /* hidden_size */
  int hidden_dim;      /* intermediate_size */
  int n_layers;
  int n_heads;         /* query heads */
  int n_kv_heads;
  int head_dim;        /* may differ from dim / n_heads (qwen3) */
  int vocab_size;
  int max_seq_len;
  float rope_theta;
  float norm_eps;
  lf_rope_style rope_style;
  lf_rope_scaling rope_scaling;
  float rope_factor, rope_low_freq_factor, rope_high_freq_factor;
  int rope_original_max_pos;
  int qkv_bias;       /* qwen2: q/k/v projections have biases */
  int qk_norm;        /* qwen3: RMSNorm over head_dim on q and k before RoPE */
  int tie_embeddings; /* lm_head shares the embedding matrix */
  int bos_id;         /* -1 when unknown */
  int eos_ids[8];
  int n_eos;
} lf_model_config;

/* Shapes are [out][in], row-major, as in the checkpoints. */
typedef struct lf_layer_weights {
  float *rms_att;          /* [dim] */
  float *wq;               /* [n_heads*head_dim][dim] */
  float *wk, *wv;          /* [n_kv_heads*head_dim][dim] */
  float *bq;               /* [n_heads*head_dim] or NULL */
  float *bk, *bv;          /* [n_kv_heads*head_dim] or NULL */
  float *q_norm, *k_norm;  /* [head_dim] or NULL */
  float *wo;               /* [dim][n_heads*head_dim] */
  float *rms_ffn;          /* [dim] */
  float *w_gate, *w_up;    /* [hidden_dim][dim] */
  float *w_down;           /* [dim][hidden_dim] */
} lf_layer_weights;

typedef struct lf_weights {
  float *embed;     /* [vocab][dim] */
  float *rms_final; /* [dim] */
  float *lm_head;   /* [vocab][dim]; == embed when tied */
  lf_layer_weights *layers; /* [n_layers] */
  size_t bytes;     /* host bytes the tensors above hold (a rank's shard: about 1/T) */
} lf_weights;

/* An opened checkpoint: config plus mapped tensors (not yet converted). */
typedef struct lf_checkpoint {
  lf_model_config cfg;
  lf_tensor_set tensors;
  /* "random:NAME[:seed]": no tensors; every weight is generated from (seed, tensor, index)
   * (engine/random_weights.h), the same on every backend. */
  int random_weights;
  uint64_t random_seed;
  /* A LoRA adapter merged by lf_checkpoint_apply_lora (its tensors and low-rank updates, which
   * tensors above point to), or NULL. Freed by lf_checkpoint_close. */
  struct lf_lora *lora;
} lf_checkpoint;

/* Opens a HF model directory (config.json + model.safetensors or model.safetensors.index.json),
 * a GGUF file or a llama2.c legacy .bin file, chosen by what path is, or "random:NAME[:seed]" (NAME one of
 * llama3-8b, qwen3-8b, llama3-70b, tiny-llama, tiny-qwen3, tiny-llama-kv4) for seeded random weights of that
 * shape ("random:NAME/T[:seed]": one rank's shard at tensor-parallel degree T, as a whole
 * model: heads, KV heads, MLP width and vocabulary divided by T). Validates the config. */
lf_status lf_checkpoint_open(const char *path, lf_checkpoint *out);
void lf_checkpoint_close(lf_checkpoint *ck);

/* Format-specific openers used by lf_checkpoint_open. */
lf_status lf_checkpoint_open_hf(const char *dir, lf_checkpoint *out);
lf_status lf_checkpoint_open_llama2c(const char *file, lf_checkpoint *out);
/* A GGUF file (engine/model_gguf.c): architectures llama, qwen2, qwen3; tensors renamed to their
 * HF names, llama's Q/K rows un-permuted and quantized blocks dequantized when read. */
lf_status lf_checkpoint_open_gguf(const char *file, lf_checkpoint *out);
/* spec: what follows "random:" ("NAME" or "NAME:seed"; the seed defaults to 0). */
lf_status lf_checkpoint_open_random(const char *spec, lf_checkpoint *out);

/* Merges a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) into
 * an opened Hugging Face or GGUF checkpoint (engine/lora.c): every targeted weight W reads as
 * W + scale * B·A from then on (scale lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora),
 * in the Hugging Face layout, through lf_tensor_read_f32, so every backend and every
 * tensor-parallel slice sees the merged model. Modules: q/k/v/o_proj, gate/up/down_proj, and on
 * untied models lm_head and embed_tokens. Anything else (DoRA and other variants, LoRA biases,
 * other modules, shapes that do not fit, bad files) is an error naming the adapter file, and
 * leaves ck unchanged. A second adapter is LF_ERR_STATE. */
lf_status lf_checkpoint_apply_lora(lf_checkpoint *ck, const char *dir);
struct lf_lora;
void lf_lora_free(struct lf_lora *l);

/* Reads a whole small file (at most 64 MiB: configs, indices) into a fresh buffer [*len + 1],
 * NUL-terminated; the caller frees *out. */
lf_status lf_read_small_file(const char *path, char **out, size_t *len);

/* Parses a HF config.json text into cfg (model_type llama, qwen2, qwen3). path names the file in
 * messages. */
lf_status lf_config_parse_hf(const char *json, size_t len, const char *path, lf_model_config *cfg);
/* Consistency checks shared by all formats. */
lf_status lf_config_validate(const lf_model_config *cfg, const char *path);

/* Validates every tensor's presence, shape and dtype and converts to fp32 (full model). */
lf_status lf_weights_load_f32(const lf_checkpoint *ck, lf_weights *w);
/* The same for one tensor-parallel rank: only the slices the plan names (parallel/shard.h) are
 * read, through the mmap, so the rank's host memory stays near its shard size. Shapes become
 * wq [n_cq*head_dim][dim], wk/wv [n_kv*head_dim][dim], wo [dim][n_q*head_dim],
 * w_gate/w_up [n_hid][dim], w_down [dim][n_hid], embed/lm_head [n_vocab][dim]; norms whole.
 * Random checkpoints give exactly the values of the same indices of the whole model.
 * sh NULL: the whole model. */
struct lf_shard;
lf_status lf_weights_load_f32_shard(const lf_checkpoint *ck, const struct lf_shard *sh,
                                    lf_weights *w);
void lf_weights_free(const lf_model_config *cfg, lf_weights *w);

#ifdef __cplusplus
}
#endif
#endif

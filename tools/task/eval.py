#!/usr/bin/env python3
"""Accuracy against KV budget for the eviction policies, on held-out `trace` problems, with our
engine: one `lfgen` process per (problem, policy, budget), greedy, stopping on <eos> (the model's
eos_token_id), the answer checked exactly (tools/task/gen.py:check).

    /opt/hfref/bin/python tools/task/eval.py --model DIR --n 50 --jobs 2 \
        --out results.json --plot results.png

Budgets are fractions of each problem's expected output length (--fractions, default
5/10/20/40%), rounded up; the pool also has to hold the prompt (~100 tokens; a prompt longer than
the budget is compressed by SnapKV at prefill, as the engine does for every policy but `full`).
`full` runs once per problem with the model's whole context. --engine-args passes options through
to every lfgen run (e.g. "--sink 4 --backend cuda"); --policy-args adds some to one policy only
(e.g. "h2o=--window 64"). --scopes head,layer runs longflow with both eviction scopes (`layer`:
one slot per layer shared by its KV heads, `lfgen --evict-scope layer`, cpu backend only); its
layer-scope series is named `longflow-layer`. --resume reuses the runs already in --out. Exit status 1 when
--min-full-accuracy is given and full-KV accuracy is below it (the CI assertion).

Metrics per (policy, fraction): accuracy (answer line exact), trace_exact (whole output exact),
median first wrong output token, mean evictions.
"""
import argparse
import concurrent.futures as cf
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen  # noqa: E402

POLICIES = ("full", "longflow", "streaming", "h2o")
SCOPES = ("head", "layer")
SCOPED = ("longflow",)  # policies run with every --scopes value; the others with scope head


def series_name(policy, scope):
    return policy if scope == "head" else f"{policy}-{scope}"


def default_lfgen():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for p in ("build/lfgen", "build-lead/lfgen"):
        if os.path.exists(os.path.join(root, p)):
            return os.path.join(root, p)
    return "lfgen"


def run_one(job, args):
    p, policy, frac, budget = job["problem"], job["policy"], job["fraction"], job["budget"]
    scope = job.get("scope", "head")
    prompt = gen.encode(p["prompt"])
    max_tokens = p["output_tokens"] + args.margin
    cmd = [args.lfgen, "--model", args.model, "--prompt-ids", ",".join(map(str, prompt)),
           "--max-tokens", str(max_tokens), "--temperature", "0", "--policy", policy,
           "--print-ids"]
    if budget:
        cmd += ["--budget", str(budget)]
    if scope != "head":
        cmd += ["--evict-scope", scope]
    cmd += shlex.split(args.engine_args) + args.policy_extra.get(policy, [])
    t0 = time.time()
    try:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1" if args.jobs > 1 else env.get("OMP_NUM_THREADS", ""))
        if not env["OMP_NUM_THREADS"]:
            del env["OMP_NUM_THREADS"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        rc, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", (e.stdout or b"").decode() if isinstance(e.stdout, bytes) \
            else (e.stdout or ""), "timeout"
    ids = [int(x) for x in out.split()] if out.strip() else []
    res = gen.check(p, ids)
    m = re.search(r"evictions (\d+)", err)
    tps = re.search(r"([\d.]+) tokens/s decode", err)
    fin = re.search(r"finish (\w+)", err)
    rec = {"problem": p["id"], "policy": policy, "scope": scope, "fraction": frac,
           "budget": budget,
           "prompt_tokens": p["prompt_tokens"], "output_tokens": p["output_tokens"],
           "max_tokens": max_tokens, "rc": rc, "finish": fin.group(1) if fin else None,
           "evictions": int(m.group(1)) if m else None,
           "tokens_per_s": float(tps.group(1)) if tps else None,
           "seconds": round(time.time() - t0, 3), **res}
    if rc != 0:
        rec["stderr"] = err.strip()[-400:]
    return rec


def summarize(runs, fractions, scopes=("head",)):
    out = {}
    series = [(pol, sc) for pol in POLICIES for sc in (scopes if pol in SCOPED else ("head",))]
    for pol, scope in series:
        rows = {}
        keys = [None] if pol == "full" else fractions
        for f in keys:
            rs = [r for r in runs if r["policy"] == pol and r.get("scope", "head") == scope and
                  (pol == "full" or r["fraction"] == f)]
            if not rs:
                continue
            fe = sorted(r["first_error"] if r["first_error"] is not None else r["output_tokens"]
                        for r in rs)
            ev = [r["evictions"] for r in rs if r["evictions"] is not None]
            rows["all" if f is None else str(f)] = {
                "n": len(rs),
                "accuracy": sum(r["answer_ok"] for r in rs) / len(rs),
                "trace_exact": sum(r["trace_ok"] for r in rs) / len(rs),
                "median_first_error": fe[len(fe) // 2],
                "mean_evictions": sum(ev) / len(ev) if ev else None,
                "errors": sum(r["rc"] != 0 for r in rs)}
        if rows:
            out[series_name(pol, scope)] = rows
    return out


def plot(summary, fractions, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    styles = {"longflow": ("tab:red", "o", "-"), "longflow-layer": ("tab:purple", "D", "--"),
              "streaming": ("tab:blue", "s", "-"), "h2o": ("tab:green", "^", "-")}
    for pol, (color, marker, ls) in styles.items():
        if pol not in summary:
            continue
        xs = [f for f in fractions if str(f) in summary[pol]]
        ys = [100 * summary[pol][str(f)]["accuracy"] for f in xs]
        ax.plot([100 * x for x in xs], ys, marker=marker, color=color, ls=ls,
                label=pol.replace("-layer", " (scope layer)"))
    if "full" in summary:
        ax.axhline(100 * summary["full"]["all"]["accuracy"], color="black", ls="--",
                   label="full KV")
    ax.set_xscale("log")
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xticks([100 * f for f in fractions])
    ax.set_xticklabels([f"{100 * f:g}%" for f in fractions])
    ax.set_xlabel("KV budget (slots per layer and KV head), % of the output length")
    ax.set_ylabel("answer accuracy (%)")
    ax.set_ylim(-3, 103)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="exported model directory")
    ap.add_argument("--lfgen", default=default_lfgen())
    ap.add_argument("--problems", help="JSON lines from gen.py --out (default: generate)")
    ap.add_argument("--n", type=int, default=20, help="problems to generate")
    ap.add_argument("--split", default="test")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--scopes", default="head",
                    help="eviction scopes for longflow, e.g. head,layer (layer: lfgen "
                         "--evict-scope layer, cpu backend only)")
    ap.add_argument("--fractions", default="0.05,0.1,0.2,0.4",
                    help="budgets as fractions of each problem's output length")
    ap.add_argument("--margin", type=int, default=32, help="max tokens = expected + margin")
    ap.add_argument("--jobs", type=int, default=1,
                    help="lfgen processes at once (each gets OMP_NUM_THREADS=1 unless set)")
    ap.add_argument("--full-budget", default="fit", choices=["fit", "ctx"],
                    help="full policy pool: prompt + max tokens (fit) or the model's context")
    ap.add_argument("--engine-args", default="", help="extra lfgen options, every run")
    ap.add_argument("--policy-args", action="append", default=[],
                    help="POLICY=OPTIONS: extra lfgen options for one policy (repeatable)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per lfgen run")
    ap.add_argument("--out", default="task_eval.json")
    ap.add_argument("--plot", help="PNG of accuracy against budget")
    ap.add_argument("--resume", action="store_true", help="reuse matching runs from --out")
    ap.add_argument("--min-full-accuracy", type=float,
                    help="exit 1 when full-KV accuracy is below this (CI)")
    gen.add_task_args(ap, 2000, 8000)
    args = ap.parse_args()
    args.policy_extra = {}
    for s in args.policy_args:
        pol, _, opts = s.partition("=")
        args.policy_extra[pol] = shlex.split(opts)
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        if p not in POLICIES:
            ap.error(f"unknown policy {p}")
    scopes = [x for x in args.scopes.split(",") if x]
    for sc in scopes:
        if sc not in SCOPES:
            ap.error(f"unknown scope {sc} (head, layer)")
    if not scopes:
        ap.error("--scopes needs at least one scope")
    args.scopes_list = scopes
    fractions = [float(x) for x in args.fractions.split(",") if x]
    if args.problems:
        with open(args.problems) as f:
            probs = [json.loads(line) for line in f if line.strip()]
        if args.n:
            probs = probs[:args.n]
    else:
        probs = list(gen.problems(args.n, args.split, args.seed, **gen.gen_kwargs(args)))
    with open(os.path.join(args.model, "config.json")) as f:
        mcfg = json.load(f)
    eos = mcfg.get("eos_token_id")
    if eos != gen.EOS_ID and not (isinstance(eos, list) and gen.EOS_ID in eos):
        print(f"warning: the model's eos_token_id is {eos}, not the task's <eos> {gen.EOS_ID}; "
              "runs go to max tokens", file=sys.stderr)
    ctx = mcfg.get("max_position_embeddings", 0)
    too_long = [p["id"] for p in probs if p["prompt_tokens"] + p["output_tokens"] > ctx]
    if too_long:
        print(f"warning: {len(too_long)} problems exceed the model's context {ctx}",
              file=sys.stderr)

    jobs = []
    for p in probs:
        for pol in policies:
            if pol == "full":
                # exactly enough slots for prompt + output: same result as the whole context,
                # without paying for slots that are never used
                b = 0 if args.full_budget == "ctx" else min(
                    ctx, p["prompt_tokens"] + p["output_tokens"] + args.margin)
                jobs.append({"problem": p, "policy": pol, "fraction": None, "budget": b})
            else:
                for sc in (scopes if pol in SCOPED else ["head"]):
                    for fr in fractions:
                        jobs.append({"problem": p, "policy": pol, "scope": sc, "fraction": fr,
                                     "budget": max(1, math.ceil(fr * p["output_tokens"]))})
    done = {}
    if args.resume and os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
        if old.get("model") == os.path.abspath(args.model) and \
                old.get("engine_args") == args.engine_args:
            for r in old["runs"]:
                done[(r["problem"], r["policy"], r.get("scope", "head"), r["fraction"],
                      r["budget"])] = r
    todo = [j for j in jobs if (j["problem"]["id"], j["policy"], j.get("scope", "head"),
                                j["fraction"], j["budget"]) not in done]
    print(f"{len(probs)} problems (output tokens {min(p['output_tokens'] for p in probs)}.."
          f"{max(p['output_tokens'] for p in probs)}), policies {policies}, scopes {scopes}, fractions "
          f"{fractions}: {len(jobs)} runs, {len(jobs) - len(todo)} reused, {args.jobs} at once; "
          f"lfgen {args.lfgen}", flush=True)
    runs = list(done.values())
    t0 = time.time()

    def save():
        runs.sort(key=lambda r: (r["problem"], POLICIES.index(r["policy"]),
                                 SCOPES.index(r.get("scope", "head")), r["fraction"] or 0))
        res = {"task": "trace", "model": os.path.abspath(args.model), "lfgen": args.lfgen,
               "engine_args": args.engine_args, "policy_args": args.policy_args,
               "fractions": fractions, "scopes": scopes, "margin": args.margin,
               "problems": [{"id": p["id"], "prompt_tokens": p["prompt_tokens"],
                             "output_tokens": p["output_tokens"], "lookback": p["lookback"]}
                            for p in probs],
               "summary": summarize(runs, fractions, scopes), "runs": runs}
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, args.out)
        return res

    with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as ex:
        futs = [ex.submit(run_one, j, args) for j in todo]
        for i, fu in enumerate(cf.as_completed(futs)):
            r = fu.result()
            runs.append(r)
            tag = series_name(r["policy"], r.get("scope", "head")) + \
                (f"@{r['fraction']:g}" if r["fraction"] is not None else "")
            print(f"[{i + 1}/{len(todo)} {time.time() - t0:6.0f}s] {r['problem']:>14} {tag:<15} "
                  f"budget {r['budget'] or 'ctx':>5} answer {'ok ' if r['answer_ok'] else 'bad'} "
                  f"trace {'ok ' if r['trace_ok'] else 'bad'} first_err {r['first_error']} "
                  f"gen {r['generated']} finish {r['finish']}"
                  + (f" rc {r['rc']}: {r.get('stderr', '')[-120:]}" if r["rc"] != 0 else ""),
                  flush=True)
            if (i + 1) % 20 == 0:
                save()
    res = save()
    summary = res["summary"]
    print(f"\n{'policy':<15} {'budget':>7} {'n':>4} {'accuracy':>9} {'trace':>7} "
          f"{'1st err':>8} {'evictions':>10}")
    for pol, rows in summary.items():
        for k, s in rows.items():
            b = args.full_budget if k == "all" else f"{100 * float(k):g}%"
            ev = "" if s["mean_evictions"] is None else f"{s['mean_evictions']:.0f}"
            print(f"{pol:<15} {b:>7} {s['n']:4d} {100 * s['accuracy']:8.1f}% "
                  f"{100 * s['trace_exact']:6.1f}% {s['median_first_error']:8d} {ev:>10}"
                  + (f"  ({s['errors']} runs failed)" if s["errors"] else ""))
    print(f"wrote {args.out}")
    if args.plot:
        plot(summary, fractions, args.plot,
             f"trace task, {len(probs)} problems, {os.path.basename(os.path.abspath(args.model))}"
             + (f", {args.engine_args}" if args.engine_args else ""))
        print(f"wrote {args.plot}")
    if args.min_full_accuracy is not None:
        acc = summary.get("full", {}).get("all", {}).get("accuracy")
        if acc is None or acc < args.min_full_accuracy:
            print(f"FAIL: full-KV accuracy {acc} < {args.min_full_accuracy}")
            return 1
        print(f"ok: full-KV accuracy {acc:.3f} >= {args.min_full_accuracy}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

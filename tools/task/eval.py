#!/usr/bin/env python3
"""Accuracy against KV budget for the eviction policies, on held-out `trace` problems, with our
engine: `lfbench eval` runs the whole grid in one process through the engine's scheduler (all
problems of one policy and budget batched in one engine), greedy, stopping on <eos> (the model's
eos_token_id), each run scored as tools/task/gen.py:check() does.

    python3 tools/task/eval.py --model DIR --n 50 --out results.json --plot results.png

Problems are generated here (gen.py; --n/--split/--seed and the task knobs) or read from
--problems, written to a JSON-lines file and handed to `lfbench eval` (bench/README.md), whose
JSON this script extends, summarizes, prints and plots. Budgets are fractions of each problem's
expected output length (--fractions, default 5/10/20/40%), rounded up; the pool also has to hold
the prompt (~100 tokens; a prompt longer than the budget is compressed by SnapKV at prefill, as
the engine does for every policy but `full`). `full` runs once per problem with a pool that fits
every problem's prompt + output (--full-budget ctx: the model's whole context). --engine-args
passes options through to `lfbench eval` (e.g. "--sink 4 --backend cuda --budget-round 16
--max-concurrent 64"); --policy-args adds some to one policy only (e.g. "h2o=--window 64"), which
runs that policy in a separate `lfbench eval`. --scopes head,layer runs longflow with both
eviction scopes (`layer`: one slot per layer shared by its KV heads); its
layer-scope series is named `longflow-layer`. Exit status 1 when --min-full-accuracy is given
and full-KV accuracy is below it (the CI assertion).

Metrics per (policy, fraction): accuracy (answer line exact), trace_exact (whole output exact,
<eos> included), median first wrong output token, mean evictions; and, in `answer_credit`,
partial credit: the mean fraction of answer registers right (gen.answer_credit), next to exact
match. The JSON's `task_knobs` lists the generator settings (gen.py `knobs`) of the problems.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen  # noqa: E402

POLICIES = ("full", "longflow", "streaming", "h2o")
SCOPES = ("head", "layer")
SCOPED = ("longflow", "h2o")  # policies run with every --scopes value; the others with scope head


def series_name(policy, scope):
    return policy if scope == "head" else f"{policy}-{scope}"


def default_lfbench():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for p in ("build/lfbench", "build-lead/lfbench"):
        if os.path.exists(os.path.join(root, p)):
            return os.path.join(root, p)
    return "lfbench"


def summarize(runs, fractions, scopes=("head",)):
    """The summary `lfbench eval` writes, recomputed (runs of several lfbench calls merge)."""
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


def credit_summary(runs, problems, fractions, scopes=("head",)):
    """Partial credit per answer register: per run, the fraction of the expected answer's
    registers the generated answer line has right (gen.answer_credit; 0 for a failed run or no
    answer line); per (series, fraction), n, their mean, and the shares of runs with every
    register right (= accuracy) and with none. Kept apart from `summary` and `runs`, which
    have lfbench eval's schema."""
    per_run = []
    for r in runs:
        want = problems[r["problem"]]["answer"]
        c = 0.0 if r.get("rc", 0) != 0 else gen.answer_credit(want, r.get("answer"))
        per_run.append({"problem": r["problem"], "policy": r["policy"],
                        "scope": r.get("scope", "head"), "fraction": r["fraction"],
                        "credit": round(c, 6)})
    out = {}
    series = [(pol, sc) for pol in POLICIES for sc in (scopes if pol in SCOPED else ("head",))]
    for pol, scope in series:
        rows = {}
        for f in ([None] if pol == "full" else fractions):
            cs = [x["credit"] for x in per_run if x["policy"] == pol and x["scope"] == scope and
                  (pol == "full" or x["fraction"] == f)]
            if cs:
                rows["all" if f is None else str(f)] = {
                    "n": len(cs), "mean_credit": sum(cs) / len(cs),
                    "all_right": sum(c == 1.0 for c in cs) / len(cs),
                    "none_right": sum(c == 0.0 for c in cs) / len(cs)}
        if rows:
            out[series_name(pol, scope)] = rows
    return {"summary": out, "runs": per_run}


def task_knobs(problems):
    """The distinct generator settings of the problems (gen.py's `knobs`; None for problems
    written before it recorded them)."""
    seen = []
    for p in problems.values():
        k = p.get("knobs")
        if k not in seen:
            seen.append(k)
    return seen


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
    ax.legend(loc="center left")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def print_table(summary, full_budget):
    print(f"\n{'policy':<15} {'budget':>7} {'n':>4} {'accuracy':>9} {'trace':>7} "
          f"{'1st err':>8} {'evictions':>10}")
    for pol, rows in summary.items():
        for k, s in rows.items():
            b = full_budget if k == "all" else f"{100 * float(k):g}%"
            ev = "" if s["mean_evictions"] is None else f"{s['mean_evictions']:.0f}"
            print(f"{pol:<15} {b:>7} {s['n']:4d} {100 * s['accuracy']:8.1f}% "
                  f"{100 * s['trace_exact']:6.1f}% {s['median_first_error']:8d} {ev:>10}"
                  + (f"  ({s['errors']} runs failed)" if s["errors"] else ""))


def print_credit(credit, full_budget):
    print(f"\npartial credit (fraction of answer registers right)\n{'policy':<15} {'budget':>7} "
          f"{'n':>4} {'credit':>7} {'all':>7} {'none':>7}")
    for pol, rows in credit.items():
        for k, s in rows.items():
            b = full_budget if k == "all" else f"{100 * float(k):g}%"
            print(f"{pol:<15} {b:>7} {s['n']:4d} {100 * s['mean_credit']:6.1f}% "
                  f"{100 * s['all_right']:6.1f}% {100 * s['none_right']:6.1f}%")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="exported model directory")
    ap.add_argument("--lfbench", default=default_lfbench(),
                    help="lfbench binary (default build/lfbench, else build-lead/lfbench)")
    ap.add_argument("--problems", help="JSON lines from gen.py --out (default: generate)")
    ap.add_argument("--n", type=int, default=20,
                    help="problems to generate, or the first N of --problems (0: all)")
    ap.add_argument("--split", default="test")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--scopes", default="head",
                    help="eviction scopes for longflow, e.g. head,layer")
    ap.add_argument("--fractions", default="0.05,0.1,0.2,0.4",
                    help="budgets as fractions of each problem's output length")
    ap.add_argument("--margin", type=int, default=32, help="max tokens = expected + margin")
    ap.add_argument("--jobs", type=int, default=1,
                    help="engines at once (lfbench eval --jobs; each gets 1 cpu thread unless "
                         "--engine-args sets --threads)")
    ap.add_argument("--full-budget", default="fit", choices=["fit", "ctx"],
                    help="full policy pool: the largest prompt + max tokens (fit) or the "
                         "model's context")
    ap.add_argument("--engine-args", default="", help="extra lfbench eval options, every run")
    ap.add_argument("--policy-args", action="append", default=[],
                    help="POLICY=OPTIONS: extra lfbench eval options for one policy (repeatable)")
    ap.add_argument("--out", default="task_eval.json")
    ap.add_argument("--plot", help="PNG of accuracy against budget")
    ap.add_argument("--min-full-accuracy", type=float,
                    help="exit 1 when full-KV accuracy is below this (CI)")
    gen.add_task_args(ap, 2000, 8000)
    args = ap.parse_args()
    policy_extra = {}
    for s in args.policy_args:
        pol, _, opts = s.partition("=")
        if pol not in POLICIES:
            ap.error(f"--policy-args: unknown policy {pol}")
        policy_extra[pol] = shlex.split(opts)
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
    fractions = [float(x) for x in args.fractions.split(",") if x]

    with tempfile.TemporaryDirectory(prefix="lf-task-eval-") as tmp:
        if args.problems:
            problems_file = args.problems
        else:
            problems_file = os.path.join(tmp, "problems.jsonl")
            with open(problems_file, "w") as f:
                for p in gen.problems(args.n, args.split, args.seed, **gen.gen_kwargs(args)):
                    f.write(json.dumps(p) + "\n")
        with open(problems_file) as f:
            problems = {p["id"]: p for p in (json.loads(ln) for ln in f if ln.strip())}
        # one lfbench call per distinct set of policy options (usually one for everything)
        calls = {}
        for pol in policies:
            calls.setdefault(tuple(policy_extra.get(pol, [])), []).append(pol)
        runs, res, t0 = [], None, time.time()
        for i, (extra, pols) in enumerate(calls.items()):
            out = os.path.join(tmp, f"eval{i}.json")
            cmd = [args.lfbench, "eval", "--model", args.model, "--problems", problems_file,
                   "--n", str(args.n if args.problems else 0), "--policies", ",".join(pols),
                   "--scopes", ",".join(scopes), "--fractions", args.fractions,
                   "--margin", str(args.margin), "--jobs", str(args.jobs),
                   "--full-budget", args.full_budget, "--json", out]
            cmd += shlex.split(args.engine_args) + list(extra)
            print("+ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
            try:
                rc = subprocess.run(cmd).returncode
            except OSError as e:
                print(f"eval.py: cannot run {args.lfbench}: {e} (build it: ninja -C build "
                      "lfbench, or give --lfbench)", file=sys.stderr)
                return 2
            if rc != 0:
                print(f"eval.py: lfbench eval failed (exit {rc})", file=sys.stderr)
                return 2
            with open(out) as f:
                r = json.load(f)
            runs += r["runs"]
            res = res or r
    # eval.py's order: problem, policy, scope, fraction
    order = {p["id"]: i for i, p in enumerate(res["problems"])}
    runs.sort(key=lambda r: (order[r["problem"]], POLICIES.index(r["policy"]),
                             SCOPES.index(r.get("scope", "head")), r["fraction"] or 0))
    summary = summarize(runs, fractions, scopes)
    credit = credit_summary(runs, problems, fractions, scopes)
    knobs = task_knobs({p["id"]: problems[p["id"]] for p in res["problems"]})
    res.update({"lfbench": args.lfbench, "engine_args": args.engine_args,
                "policy_args": args.policy_args, "policies": policies,
                "wall_s": round(time.time() - t0, 3), "summary": summary, "runs": runs,
                "answer_credit": credit, "task_knobs": knobs})
    if len(calls) > 1:
        res["groups"] = None  # per call; not merged
    tmp_out = args.out + ".tmp"
    with open(tmp_out, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp_out, args.out)
    if len(calls) > 1:
        print_table(summary, args.full_budget)
    print_credit(credit["summary"], args.full_budget)
    print(f"task knobs: {json.dumps(knobs)}")
    print(f"wrote {args.out}")
    if args.plot:
        plot(summary, fractions, args.plot,
             f"trace task, {len(res['problems'])} problems, "
             f"{os.path.basename(os.path.abspath(args.model))}"
             + "".join(f", {gen.knobs_label(k)}" for k in knobs if k and gen.knobs_label(k))
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

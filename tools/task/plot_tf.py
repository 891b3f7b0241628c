#!/usr/bin/env python3
"""Teacher-forced token error against KV budget, one line per policy, from `lfbench eval
--teacher-forced` JSONs and, optionally, tools/evict simulator JSONs (floor and ceiling).

    python3 tools/task/plot_tf.py OUT.png --eval A.json,B.json [--shortest N] \\
        [--eval2 C.json,D.json --shortest2 N] [--sim S.json,T.json] [--title TEXT]

Each --eval group is one panel. Runs of several JSONs merge; a series is the policy, its scope
and (h2o) its recent window, so runs with a window of 32 and of B/2 stay apart. The error of a
(series, fraction) is pooled as lfbench eval pools it: wrong positions over expected positions
of the problems kept (--shortest N: the N with the fewest output tokens, else all). A panel
uses only the fractions of the output (`budget_of` output); budgets are as each JSON ran them
(its `budget_round` is in the legend's note). --sim adds a panel of the simulator's mean
tf_error over its texts, per spec name (the part before /B). Prints the numbers it plots.
"""
import argparse
import collections
import json
import os
import sys


def h2o_window(engine):
    r = engine.get("h2o_recent")
    if r is not None:
        return "B/2" if r == 0 else str(r)
    w = engine.get("window", 32)
    return "B/2" if w == "half" else str(w)  # before h2o_recent: the window was h2o's


def eval_series(paths, shortest):
    """{series: {fraction: (wrong, want, n_runs)}}, the problems kept, the budget roundings."""
    docs = [json.load(open(p)) for p in paths]
    out_tok = {}
    for d in docs:
        if not d.get("teacher_forced"):
            raise SystemExit("%s: not a --teacher-forced run" % d.get("problems_file"))
        if d.get("budget_of", "output") != "output":
            raise SystemExit("plot_tf.py: budgets of the live set are not plotted")
        for p in d["problems"]:
            out_tok[p["id"]] = p["output_tokens"]
    keep = sorted(out_tok, key=lambda i: (out_tok[i], i))
    if shortest:
        keep = keep[:shortest]
    keep = set(keep)
    acc = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0, 0]))
    rounds = set()
    for d in docs:
        rounds.add(d.get("budget_round", 1))
        want = {p["id"]: p["output_tokens"] for p in d["problems"]}
        for r in d["runs"]:
            if r["problem"] not in keep or r["policy"] == "full" or r.get("rc", 0):
                continue
            name = r["policy"] + ("" if r.get("scope", "head") == "head" else "-" + r["scope"])
            if r["policy"] == "h2o":
                name += " (recent %s)" % h2o_window(d["engine"])
            a = acc[name][r["fraction"]]
            a[0] += r["tf_wrong"]
            a[1] += want[r["problem"]]
            a[2] += 1
    return acc, keep, rounds


def sim_series(paths):
    """{spec name: {fraction: [tf_error per text]}} over the simulator JSONs' texts."""
    acc = collections.defaultdict(lambda: collections.defaultdict(list))
    for p in paths:
        d = json.load(open(p))
        fr = [float(x) for x in str(d["budget_fractions"]).split(",")]
        for t in d["texts"].values():
            budgets = t["budgets"]
            for name, r in t["runs"].items():
                f = fr[budgets.index(r["budget"])]
                acc[sim_name(name.split("/B")[0])][f].append(r["tf_error"])
    return acc


def sim_name(n):
    """The simulator's spec names as lfbench eval's series (one legend for every panel)."""
    if n == "longflow-head":
        return "longflow"
    if n.startswith("h2o-recent-"):
        w = n[len("h2o-recent-"):]
        return "h2o (recent %s)" % ("B/2" if w == "half" else w)
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--eval", required=True, help="comma list of lfbench eval JSONs")
    ap.add_argument("--shortest", type=int, default=0)
    ap.add_argument("--eval2", default="", help="a second panel of lfbench eval JSONs")
    ap.add_argument("--shortest2", type=int, default=0)
    ap.add_argument("--sim", default="", help="comma list of tools/evict/run.py JSONs")
    ap.add_argument("--title", default="teacher-forced token error against KV budget")
    a = ap.parse_args()

    panels = [("lfbench eval", eval_series(a.eval.split(","), a.shortest))]
    if a.eval2:
        panels.append(("lfbench eval", eval_series(a.eval2.split(","), a.shortest2)))
    sim = sim_series(a.sim.split(",")) if a.sim else None

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    names = sorted(set(k for _, (acc, _, _) in panels for k in acc) | set(sim or ()))
    cmap = plt.get_cmap("tab20")
    color = {k: cmap(i % 20) for i, k in enumerate(names)}
    n = len(panels) + (1 if sim else 0)
    fig, axes = plt.subplots(1, n, figsize=(6.2 * n, 4.6), squeeze=False)
    for ax, (what, (acc, keep, rounds)) in zip(axes[0], panels):
        sub = "%d problems, budgets rounded to %s" % (
            len(keep), "/".join(str(r) for r in sorted(rounds)))
        print("%s (%s):" % (what, sub))
        for name in sorted(acc):
            fs = sorted(acc[name])
            ys = [100.0 * acc[name][f][0] / acc[name][f][1] for f in fs]
            ax.plot([100 * f for f in fs], ys, marker="o", label=name, color=color[name])
            print("  %-30s %s" % (name, "  ".join("%g%%: %.2f%% (%d runs)" % (
                100 * f, y, acc[name][f][2]) for f, y in zip(fs, ys))))
        ax.set_title("%s\n%s" % (what, sub), fontsize=9)
    if sim:
        ax = axes[0][-1]
        k = max(len(v) for s in sim.values() for v in s.values())
        print("simulator (mean over up to %d texts):" % k)
        for name in sorted(sim):
            fs = sorted(sim[name])
            ys = [100.0 * sum(sim[name][f]) / len(sim[name][f]) for f in fs]
            style = "--" if name.startswith(("random", "oracle")) else "-"
            ax.plot([100 * f for f in fs], ys, style, marker="o", label=name, color=color[name])
            print("  %-30s %s" % (name, "  ".join("%g%%: %.2f%% (%d texts)" % (
                100 * f, y, len(sim[name][f])) for f, y in zip(fs, ys))))
        ax.set_title("simulator (tools/evict), mean over up to %d problems\n"
                     "dashed: random (floor), oracle (ceiling)" % k, fontsize=9)
    for ax in axes[0]:
        ax.set_xlabel("KV budget (% of the output)")
        ax.set_ylabel("token error (%)")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(a.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

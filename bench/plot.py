#!/usr/bin/env python3
"""Plot `lfbench serve --json` results: output throughput and TPOT by policy, and by output length.

    python3 bench/plot.py OUT.png RUN1.json [RUN2.json ...]

Every row of every file is one point (policy, output length O). Left: output tokens/s per
policy, one bar group per (O, arrival, memory setting) run. Middle: TPOT p50 (bar) with p99
(whisker) per policy. Right, when the files cover more than one O: tokens/s vs O, one line per
policy. Needs matplotlib (pip install matplotlib).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"full": "#7f7f7f", "longflow": "#1f77b4", "streaming": "#ff7f0e", "h2o": "#2ca02c"}


def load(paths):
    runs = []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        if d.get("bench") != "serve":
            sys.exit(f"{p}: not an lfbench serve JSON")
        mem = f"kv {d['kv_gb']:g} GB" if d.get("kv_gb") else "same pools"
        label = f"{d['prompt']}->{d['output']}, {d['arrival']}, {mem}"
        runs.append((label, d))
    return runs


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out, runs = sys.argv[1], load(sys.argv[2:])
    policies = []
    for _, d in runs:
        for r in d["rows"]:
            if r["policy"] not in policies:
                policies.append(r["policy"])
    outputs = sorted({d["output"] for _, d in runs})
    ncols = 3 if len(outputs) > 1 else 2
    fig, ax = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4.5))

    width = 0.8 / max(1, len(policies))
    for gi, (label, d) in enumerate(runs):
        rows = {r["policy"]: r for r in d["rows"]}
        for pi, pol in enumerate(policies):
            if pol not in rows:
                continue
            r = rows[pol]
            x = gi + (pi - (len(policies) - 1) / 2) * width
            kw = dict(color=COLORS.get(pol, None), label=pol if gi == 0 else None)
            ax[0].bar(x, r["tokens_per_s"], width, **kw)
            ax[0].annotate(f"{r['pools']}p", (x, r["tokens_per_s"]), ha="center", va="bottom",
                           fontsize=7)
            p50, p99 = 1e3 * r["tpot_p50_s"], 1e3 * r["tpot_p99_s"]
            ax[1].bar(x, p50, width, yerr=[[0], [max(0.0, p99 - p50)]], capsize=3, **kw)
    labels = [lab for lab, _ in runs]
    for a, title, yl in ((ax[0], "output throughput (bar label: pools)", "output tokens / s"),
                         (ax[1], "time per output token (p50, whisker p99)", "TPOT ms")):
        a.set_xticks(range(len(runs)))
        a.set_xticklabels(labels, rotation=15, ha="right", fontsize=8)
        a.set_title(title, fontsize=10)
        a.set_ylabel(yl)
        a.legend(fontsize=8)
        a.grid(axis="y", alpha=0.3)

    if ncols == 3:
        a = ax[2]
        for pol in policies:
            pts = {}
            for _, d in runs:
                for r in d["rows"]:
                    if r["policy"] == pol:
                        pts.setdefault(d["output"], max(pts.get(d["output"], 0), r["tokens_per_s"]))
            xs = sorted(pts)
            a.plot(xs, [pts[x] for x in xs], "o-", color=COLORS.get(pol), label=pol)
        a.set_xscale("log", base=2)
        a.set_xlabel("output tokens per request (O)")
        a.set_ylabel("output tokens / s (best run)")
        a.set_title("throughput vs output length", fontsize=10)
        a.legend(fontsize=8)
        a.grid(alpha=0.3)

    first = runs[0][1]
    fig.suptitle(f"lfbench serve: {first['model']} on {first['backend']} ({first.get('host', '')})",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

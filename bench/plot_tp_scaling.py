#!/usr/bin/env python3
"""Tensor-parallel scaling from `lfbench step --json` files: speed-up over one GPU and step time
against the GPU count, per batch size, for one model.

    python3 bench/plot_tp_scaling.py OUT.png STEP1.json [STEP2.json ...] [--model random:llama3-8b]

Each row of each file is one point (its "tp", 1 when absent; "batch"; "step_ms_median"). Where
two files give the same (tp, batch), the later one wins. Only measured points are drawn; the
issue targets (TP=2: batch 1 <= 0.6x the TP=1 step, batch 64 >= 1.8x the throughput; TP=4: 0.35x
and 3.4x; TP=8: 6x the batch-64 throughput) are drawn as open markers for comparison, whether
or not that GPU count was run. Needs matplotlib.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (tp, batch) -> speed-up over TP=1 that the issues ask for (batch 1: 1 / step ratio)
TARGETS = {(2, 1): 1 / 0.6, (2, 64): 1.8, (4, 1): 1 / 0.35, (4, 64): 3.4, (8, 64): 6.0}
COLORS = {1: "#1f77b4", 64: "#ff7f0e"}


def main(argv):
    model = "random:llama3-8b"
    args = []
    i = 0
    while i < len(argv):
        if argv[i] == "--model":
            model = argv[i + 1]
            i += 2
        else:
            args.append(argv[i])
            i += 1
    if len(args) < 2:
        sys.exit(__doc__)
    out, paths = args[0], args[1:]
    pts = {}  # (tp, batch) -> ms
    device = set()
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        if d.get("bench") != "step":
            sys.exit(f"{p}: not an lfbench step JSON")
        device.add(d.get("device", "?"))
        for r in d["rows"]:
            if r["model"] == model:
                pts[(r.get("tp", 1), r["batch"])] = r["step_ms_median"]
    batches = sorted({b for _, b in pts})
    if not batches:
        sys.exit(f"no rows of {model}")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for b in batches:
        tps = sorted(t for t, bb in pts if bb == b)
        ms = [pts[(t, b)] for t in tps]
        ax2.plot(tps, ms, "o-", color=COLORS.get(b), label=f"batch {b}")
        for t, m in zip(tps, ms):
            ax2.annotate(f"{m:.2f}", (t, m), textcoords="offset points", xytext=(4, 4), fontsize=8)
        if (1, b) in pts:
            sp = [pts[(1, b)] / pts[(t, b)] for t in tps]
            ax1.plot(tps, sp, "o-", color=COLORS.get(b), label=f"batch {b}, measured")
            for t, s in zip(tps, sp):
                ax1.annotate(f"{s:.2f}x", (t, s), textcoords="offset points",
                             xytext=(6, 6 if b == batches[-1] else -12), fontsize=8,
                             color=COLORS.get(b))
        tt = sorted((t, v) for (t, bb), v in TARGETS.items() if bb == b)
        ax1.plot([t for t, _ in tt], [v for _, v in tt], "o", mfc="none", color=COLORS.get(b),
                 label=f"batch {b}, target")
    top = max(t for t, _ in TARGETS)
    lin = [t for t in (1, 2, 4, 8) if t <= top]
    ax1.plot(lin, lin, ":", color="#999999", label="linear")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8])
        ax.set_xticklabels(["1", "2", "4", "8"])
        ax.set_xlabel("GPUs (tensor-parallel degree)")
        ax.grid(alpha=0.3)
    ax1.set_ylabel("speed-up over one GPU (step time)")
    ax1.set_title(f"{model}: speed-up")
    ax2.set_ylabel("decode step, ms (median)")
    ax2.set_title(f"{model}: step time")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.suptitle(", ".join(sorted(device)) + "; only measured GPU counts are drawn", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}: {len(pts)} points")


if __name__ == "__main__":
    main(sys.argv[1:])

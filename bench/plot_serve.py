#!/usr/bin/env python3
"""Plot TTFT and TPOT percentiles against the arrival rate from several `lfbench serve` runs.

    python3 bench/plot_serve.py OUT.png RUN1.json [RUN2.json ...]

Each file is one run (`--arrival poisson --rate R`, usually with `--decode-only-ref`); every
row (policy) of it is one point at x = R. Left: TTFT p50 (solid) and p99 (dashed) in seconds,
log scale, with the isolated prefill time of one prompt (dotted, from --decode-only-ref) and
2x it (the issue-19 bound on TTFT p50) when the runs have it. Middle: TPOT p50 and p99 in ms,
with the decode-only step time at the run's mean decode batch (crosses) and 1.5x it (the bound
on TPOT p99). Right: the mean decode batch and output tokens/s. Also prints one line per point.
Needs matplotlib.
"""
import json
import sys

COLORS = {"full": "#7f7f7f", "longflow": "#1f77b4", "streaming": "#ff7f0e", "h2o": "#2ca02c"}


def load(paths):
    pts = {}  # policy -> list of (rate, row, run)
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        if d.get("bench") != "serve":
            sys.exit(f"{p}: not an lfbench serve JSON")
        if d.get("arrival") != "poisson":
            print(f"{p}: arrival {d.get('arrival')!r}, not poisson: plotted at rate 0",
                  file=sys.stderr)
        for r in d["rows"]:
            pts.setdefault(r["policy"], []).append((float(d.get("rate") or 0.0), r, d))
    for v in pts.values():
        v.sort(key=lambda x: x[0])
    return pts


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out, pts = sys.argv[1], load(sys.argv[2:])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16.5, 4.8))
    ax2 = ax[2].twinx()  # tokens/s beside the decode batch
    print(f"{'policy':<10} {'rate/s':>7} {'ttft_p50':>9} {'ttft_p99':>9} {'prefill':>8} "
          f"{'tpot_p50':>9} {'tpot_p99':>9} {'dec_ref':>8} {'p99/ref':>8} {'dec_b':>6} "
          f"{'tok/s':>8}")
    for pol, v in pts.items():
        c = COLORS.get(pol)
        x = [rate for rate, _, _ in v]
        rows = [r for _, r, _ in v]
        ax[0].plot(x, [r["ttft_p50_s"] for r in rows], "o-", color=c, label=f"{pol} p50")
        ax[0].plot(x, [r["ttft_p99_s"] for r in rows], "s--", color=c, label=f"{pol} p99")
        ax[1].plot(x, [1e3 * r["tpot_p50_s"] for r in rows], "o-", color=c, label=f"{pol} p50")
        ax[1].plot(x, [1e3 * r["tpot_p99_s"] for r in rows], "s--", color=c, label=f"{pol} p99")
        pre = [(rate, r["ref_prefill_s"]) for rate, r, _ in v if r.get("ref_prefill_s")]
        if pre:
            ax[0].plot([a for a, _ in pre], [b for _, b in pre], "_:", color=c, ms=12,
                       label=f"{pol} isolated prefill")
            ax[0].plot([a for a, _ in pre], [2 * b for _, b in pre], "v", color=c, alpha=0.5,
                       label=f"{pol} 2x isolated prefill")
        ref = [(rate, r["ref_decode_step_ms"], r.get("ref_batch"))
               for rate, r, _ in v if r.get("ref_decode_step_ms")]
        if ref:
            ax[1].plot([a for a, _, _ in ref], [b for _, b, _ in ref], "x", color=c, ms=9,
                       mew=2, label=f"{pol} decode-only step (batch = run's mean)")
            ax[1].plot([a for a, _, _ in ref], [1.5 * b for _, b, _ in ref], "v", color=c,
                       alpha=0.5, label=f"{pol} 1.5x decode-only step")
            for a, b, bd in ref:
                ax[1].annotate(f"b={bd}", (a, b), textcoords="offset points", xytext=(4, -12),
                               fontsize=7, color=c)
        ax[2].plot(x, [r.get("decode_batch_mean", 0) for r in rows], "o-", color=c,
                   label=f"{pol} mean decode batch")
        ax2.plot(x, [r["tokens_per_s"] for r in rows], "^:", color=c, label=f"{pol} tokens/s")
        for rate, r, _ in v:
            ref_ms = r.get("ref_decode_step_ms")
            print(f"{pol:<10} {rate:7.2f} {r['ttft_p50_s']:9.3f} {r['ttft_p99_s']:9.3f} "
                  f"{(r.get('ref_prefill_s') or 0):8.3f} {1e3 * r['tpot_p50_s']:9.2f} "
                  f"{1e3 * r['tpot_p99_s']:9.2f} {(ref_ms or 0):8.2f} "
                  f"{(1e3 * r['tpot_p99_s'] / ref_ms if ref_ms else 0):8.2f} "
                  f"{r.get('decode_batch_mean', 0):6.1f} {r['tokens_per_s']:8.0f}")
    ax[0].set_yscale("log")
    ax[0].set_ylabel("TTFT s")
    ax[0].set_title("time to first token", fontsize=10)
    ax[1].set_ylabel("TPOT ms")
    ax[1].set_ylim(0, 1.08 * max(l.get_ydata().max() for l in ax[1].get_lines()))
    ax[1].set_title("time per output token (per request: mean gap)", fontsize=10)
    ax[2].set_ylabel("mean decode batch")
    ax[2].set_ylim(0, 1.15 * ax[2].get_ylim()[1])
    ax2.set_ylabel("output tokens / s")
    ax2.set_ylim(0, 1.15 * ax2.get_ylim()[1])
    ax[2].set_title("load", fontsize=10)
    for a in ax:
        a.set_xlabel("Poisson arrival rate (requests / s)")
        a.grid(alpha=0.3)
        a.legend(fontsize=7, loc="upper left")
    ax2.legend(fontsize=7, loc="lower right")
    first = next(iter(pts.values()))[0][2]
    fig.suptitle(f"lfbench serve: {first['model']} on {first['backend']} ({first.get('host', '')}),"
                 f" prompt {first['prompt']}, output {first['output']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

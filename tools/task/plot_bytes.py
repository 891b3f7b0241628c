#!/usr/bin/env python3
"""Accuracy against KV bytes: teacher-forced token error and greedy answers of `lfbench eval`
runs against the KV cache's bytes per output token, one line per (policy, scope, pool dtype);
runs with per-layer pools (`--layer-weights`) are their own line ("POLICY/layers"), as are runs
with key means (`--key-means`: "DTYPE+mu").

    python3 tools/task/plot_bytes.py OUT.png --tf A.json,B.json --free C.json,D.json \\
        [--full E.json,F.json] [--layers 30 --kv-heads 3 --head-dim 64] [--title TEXT]

A run's bytes are what its pools hold: budget slots x (K and V rows of its dtype) x layers x KV
heads, over the problem's output tokens; a point is the mean over a (series, fraction)'s
problems; a point a later file measures again is the later file's. Row bytes per dtype follow base/kvq.h: bf16 2 x head_dim; fp8 and int8 head_dim and an
fp32 scale; int4 head_dim / 2 and a bf16 step and floor per 32 dims; k8v4 an int8 K row and an int4 V row.
Token error is pooled as
lfbench eval pools it (wrong positions over all positions); answers are counted right of the
problems run. --full adds each dtype's full-KV figures as reference marks (a horizontal line for
bf16). The defaults are SmolLM2-135M's shape. Prints every point it plots.
"""
import argparse
import collections
import json
import sys


def row_bytes(dtype, d):
    if dtype in ("fp8", "int8"):
        return d + 4
    if dtype == "int4":
        return d // 2 + (d // 32) * 4
    return 2 * d


def slot_bytes(dtype, d):
    """A slot's K and V rows: k8v4 stores int8 keys beside int4 values."""
    if dtype == "k8v4":
        return row_bytes("int8", d) + row_bytes("int4", d)
    return 2 * row_bytes(dtype, d)


def load(paths):
    out = []
    for p in paths.split(",") if paths else []:
        with open(p) as f:
            out.append(json.load(f))
    return out


def series(docs, a):
    """(policy, scope, dtype) -> {fraction: dict(bytes, err, right, n)}; a point measured again
    in a later file (the same series and fraction) is replaced by the later file's runs."""
    acc = collections.defaultdict(lambda: collections.defaultdict(
        lambda: {"bytes": 0.0, "wrong": 0, "pos": 0, "right": 0, "n": 0}))
    owner = {}  # (key, fraction) -> the file whose runs it holds
    for i, d in enumerate(docs):
        dt = d["engine"].get("kv_dtype", "bf16")
        rb = slot_bytes(dt, a.head_dim) * a.layers * a.kv_heads  # K and V
        if d["engine"].get("key_means"):  # --key-means: the same bytes, its own line
            dt += "+mu"
        for r in d["runs"]:
            pol = r["policy"] + ("/layers" if d["engine"].get("layer_weights") else "")
            key = (pol, r.get("scope", "head") if r["policy"] != "full" else "-", dt)
            if owner.setdefault((key, r["fraction"]), i) != i:  # re-measured: the later file's
                owner[(key, r["fraction"])] = i
                del acc[key][r["fraction"]]
            s = acc[key][r["fraction"]]
            s["bytes"] += r["budget"] * rb / r["output_tokens"]
            s["n"] += 1
            s["right"] += bool(r.get("answer_ok"))
            if "tf_wrong" in r:
                s["wrong"] += r["tf_wrong"]
                s["pos"] += r["output_tokens"]
    return acc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tf", default="")
    ap.add_argument("--free", default="")
    ap.add_argument("--full", default="", help="full-KV runs (teacher-forced or greedy)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    tf, free, full = series(load(a.tf), a), series(load(a.free), a), series(load(a.full), a)
    # a file that ran full beside the evicting policies: its full runs are the reference marks
    # (give it to --full as well), not a line of one point
    for d in (tf, free):
        for key in [k for k in d if k[0] == "full"]:
            del d[key]
    for key in [k for k in full if k[0] != "full"]:
        del full[key]

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.6))
    # one colour per series in both panels
    keys = sorted(set(tf) | set(free))  # one colour a series: tab10, then tab20's light shades
    colours = {k: plt.cm.tab10(i) if i < 10 else plt.cm.tab20((2 * i + 1) % 20)
               for i, k in enumerate(keys)}
    for key in sorted(tf):
        pts = sorted((v["bytes"] / v["n"] / 1024, 100.0 * v["wrong"] / max(v["pos"], 1))
                     for v in tf[key].values())
        ax[0].plot(*zip(*pts), "o-", color=colours[key], label="%s %s %s" % key)
        for x, y in pts:
            print("tf   %-10s %-5s %-5s %8.1f KiB/token  token error %.3f%%" % (*key, x, y))
    for key in sorted(free):
        pts = sorted((v["bytes"] / v["n"] / 1024, v["right"], v["n"]) for v in free[key].values())
        ax[1].plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colours[key],
                   label="%s %s %s" % key)
        for x, r, n in pts:
            print("free %-10s %-5s %-5s %8.1f KiB/token  answers %d of %d" % (*key, x, r, n))
    for key, v in sorted(full.items()):
        v = next(iter(v.values()))
        if v["pos"]:
            err = 100.0 * v["wrong"] / v["pos"]
            print("full %-5s token error %.3f%%" % (key[2], err))
            ax[0].axhline(err, ls=":" if key[2] != "bf16" else "--", lw=1,
                          color="k" if key[2] == "bf16" else "0.6",
                          label="full KV %s" % key[2])
        else:
            print("full %-5s answers %d of %d" % (key[2], v["right"], v["n"]))
            ax[1].axhline(v["right"], ls="--", lw=1, color="k", label="full KV %s" % key[2])
    ax[0].set_yscale("log")
    ax[0].set_ylabel("teacher-forced token error (%)")
    ax[1].set_ylabel("greedy answers right")
    for x in ax:
        x.set_xlabel("KV bytes per output token (KiB)")
        x.grid(alpha=0.3)
        x.legend(fontsize=8)
    if a.title:
        fig.suptitle(a.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

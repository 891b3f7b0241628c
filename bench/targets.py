#!/usr/bin/env python3
"""The throughput targets (issue 37) against what `bench/run.sh targets` just measured.

Reads the JSON files run_targets wrote into OUT (named tg_*.json) and prints one line per
target: the measured figure, the target and MET / MISS, then one verdict line. A file that is
missing (its run failed or was left out) prints MISSING and counts as a miss.

    python3 bench/targets.py OUT [--json FILE]
"""
import json
import os
import sys


def load(out, name):
    path = os.path.join(out, name)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def rows_by(d, key):
    return {r[key]: r for r in d["rows"]} if d else {}


def main(argv):
    if len(argv) < 2:
        print(__doc__.strip())
        return 2
    out = argv[1]
    lines = []  # (name, measured text, target text, met: True / False / None = missing)

    def add(name, measured, target, met):
        lines.append((name, measured, target, met))

    # Prompt steps of a policy that scores the prompt, over LongFlow's (same engine, same run).
    lf = load(out, "tg_prefill_longflow.json")
    h2o = load(out, "tg_prefill_h2o.json")
    if lf and h2o:
        a = {(r["prompt"], r["batch"]): r for r in lf["rows"]}
        for r in h2o["rows"]:
            key = (r["prompt"], r["batch"])
            if key in a:
                x = r["time_ms"] / a[key]["time_ms"]
                add(f"h2o prefill / longflow's, {key[0]} tokens x {key[1]}",
                    f"{x:.3f}x ({r['time_ms']:.1f} / {a[key]['time_ms']:.1f} ms)", "<= 1.10x",
                    x <= 1.10)
    else:
        add("h2o prefill / longflow's", "MISSING", "<= 1.10x", None)

    # The 16k reasoning-shaped run: h2o against longflow, layer scope against head scope.
    layer = rows_by(load(out, "tg_serve16k_layer.json"), "policy")
    head = rows_by(load(out, "tg_serve16k_head.json"), "policy")
    if "longflow" in layer and "h2o" in layer:
        x = layer["h2o"]["tokens_per_s"] / layer["longflow"]["tokens_per_s"]
        add("llama3-8b 512 -> 16384, 20 GB: h2o tok/s / longflow's",
            f"{x:.3f}x ({layer['h2o']['tokens_per_s']:.0f} / "
            f"{layer['longflow']['tokens_per_s']:.0f}); h2o prompt step "
            f"{layer['h2o'].get('prompt_step_ms', 0):.1f} ms vs "
            f"{layer['longflow'].get('prompt_step_ms', 0):.1f}", ">= 0.95x", x >= 0.95)
    else:
        add("16k run: h2o / longflow", "MISSING", ">= 0.95x", None)
    if "longflow" in layer and "longflow" in head:
        x = layer["longflow"]["tokens_per_s"] / head["longflow"]["tokens_per_s"]
        add("the same, longflow: layer scope / head scope", f"{x:.3f}x", ">= 0.97x", x >= 0.97)
    else:
        add("16k run: layer / head scope", "MISSING", ">= 0.97x", None)

    # The decode kernel against torch SDPA at every shape.
    k = load(out, "tg_kernel.json")
    if k and all(r.get("sdpa_ratio") for r in k["rows"]):
        worst = max(k["rows"], key=lambda r: r["sdpa_ratio"])
        n_ok = sum(r["sdpa_ratio"] <= 1.10 for r in k["rows"])
        add("decode kernel time / SDPA's, every shape",
            f"worst {worst['sdpa_ratio']:.3f}x (batch {worst['batch']}, budget "
            f"{worst['budget']}); {n_ok} of {len(k['rows'])} shapes <= 1.10x", "<= 1.10x",
            n_ok == len(k["rows"]))
    else:
        add("decode kernel / SDPA", "MISSING (no peer?)", "<= 1.10x", None)

    # The decode step against its floors.
    st = load(out, "tg_step.json")
    if st:
        for r in st["rows"]:
            if r["batch"] == 1:
                add(f"decode step {r['model']} batch 1 / weight + KV floor",
                    f"{r['ratio']:.3f}x ({r['step_ms_median']:.3f} ms)", "<= 1.15x",
                    r["ratio"] <= 1.15)
            elif r["batch"] == 64:
                add(f"decode step {r['model']} batch 64, fraction of roofline",
                    f"{r['roofline_fraction']:.3f} ({r['step_ms_median']:.3f} ms)", ">= 0.80",
                    r["roofline_fraction"] >= 0.80)
    else:
        add("decode step", "MISSING", "", None)

    # End to end.
    for name, fname, target in (
            ("qwen3-8b 512 -> 1024, 64 pools", "tg_e2e_qwen3.json", 7000),
            ("llama3-8b 512 -> 16384", "tg_e2e_llama3.json", 7500)):
        d = load(out, fname)
        if d and d.get("kv_gb"):
            name += f", {d['kv_gb']:g} GB"
        if not d:
            add(name, "MISSING", f">= {target} tok/s", None)
            continue
        for r in d["rows"]:
            add(f"{name}, {r['policy']}",
                f"{r['tokens_per_s']:.0f} tok/s (decode batch mean "
                f"{r.get('decode_batch_mean', 0):.1f}, {r['pools']} pools)",
                f">= {target} tok/s", r["tokens_per_s"] >= target)

    w = max(len(n) for n, *_ in lines)
    for name, measured, target, met in lines:
        tag = "MISSING" if met is None else ("MET" if met else "MISS")
        print(f"{name:<{w}}  {measured}  [target {target}] {tag}")
    n_met = sum(m is True for *_, m in lines)
    if "--json" in argv:
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump([{"target": n, "measured": m, "want": t, "met": x} for n, m, t, x in lines],
                      f, indent=1)
    print(f"# targets: {n_met} of {len(lines)} met")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

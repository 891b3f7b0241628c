#!/usr/bin/env python3
"""Writes a key-means file for lfserve's --key-means (lf_engine_config.key_means): the mean of the
keys after RoPE per (layer, KV head), over sample sequences of a workload, in the model's own
frame (the engine rotates it as it rotates keys).

The engine subtracts the mean from every key before attention reads it or a pool stores it. No
attention weight changes (a query's logits all move by q.mu, which the softmax removes); the
range a quantized pool's keys span shrinks, which is what int4 keys need (docs/DESIGN.md §3).
The keys come from the simulator's float64 model (tools/evict/model.py, the GGUF's weights, an
adapter merged with --lora), over each sequence's prompt and completion, as the engine computes
them teacher-forced.

    python3 tools/evict/key_means.py --task CALIB.jsonl --tokenizer tok.json \\
        --lora models/smollm2-trace-lora --out means.txt
    python3 tools/evict/key_means.py --out means.txt   # SmolLM2's seven fidelity sequences

Calibrate on sequences the evaluation never uses (another split or seed): the figures of
docs/DESIGN.md §3 take the means from train-split problems and measure on test ones.
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import model as evm  # noqa: E402
from kv_center import Probe  # noqa: E402


def write_means(path, mu, source):
    """mu [layers][kv_heads][head_dim]; the format launch/cli.c's lf_cli_parse_key_means reads."""
    L, H, D = mu.shape
    with open(path, "w") as f:
        f.write("# lfserve key means: the mean key after RoPE per (layer, KV head), one row each\n")
        f.write("# from %s\n" % source)
        f.write("lfserve-key-means layers %d kv_heads %d head_dim %d\n" % (L, H, D))
        for l in range(L):
            for h in range(H):
                f.write(" ".join("%.9g" % float(np.float32(x)) for x in mu[l, h]) + "\n")


def read_means(path):
    """A key-means file as [layers][kv_heads][head_dim] float64 (what write_means writes, in the
    format lf_cli_parse_key_means reads; '#' comments, whitespace or commas)."""
    toks = []
    with open(path) as f:
        for line in f:
            toks += line.split("#", 1)[0].replace(",", " ").split()
    if len(toks) < 7 or toks[0] != "lfserve-key-means" or toks[1:7:2] != ["layers", "kv_heads", "head_dim"]:
        raise SystemExit("%s: no 'lfserve-key-means layers L kv_heads H head_dim D' header" % path)
    shape = (int(toks[2]), int(toks[4]), int(toks[6]))
    vals = np.array([float(x) for x in toks[7:]], np.float64)
    if vals.size != shape[0] * shape[1] * shape[2]:
        raise SystemExit("%s: %d values for %s" % (path, vals.size, shape))
    return vals.reshape(shape)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the key-means file to write")
    ap.add_argument("--model", help="the GGUF (default: tools/smollm2.sh)")
    ap.add_argument("--task", help="task records (tools/task/gen.py --format hf): prompt + "
                    "completion of each")
    ap.add_argument("--tokenizer", help="tokenizer.json for --task (gen.py --save-hf-tokenizer)")
    ap.add_argument("--lora", help="a PEFT LoRA adapter merged into the model")
    ap.add_argument("--golden", default=os.path.join(ROOT, "tests/data/fidelity/smollm2/golden.json"),
                    help="without --task: the prompts and greedy answers of this file")
    a = ap.parse_args()
    path = a.model or subprocess.run(["bash", os.path.join(ROOT, "tools", "smollm2.sh")],
                                     capture_output=True, text=True, check=True).stdout.strip()
    m = evm.Model(path, np.float64, lora=a.lora)
    pr = Probe(m)
    if a.task:
        import run as evr
        items = evr.task_items(argparse.Namespace(task=a.task, tokenizer=a.tokenizer,
                                                  task_skip=0, task_n=sys.maxsize))
        seqs = [(ids, n) for _, ids, n, _ in items]
        source = "%s (%d sequences)%s" % (a.task, len(seqs), ", adapter %s" % a.lora if a.lora else "")
    else:
        g = json.load(open(a.golden))["prompts"]
        seqs = [(p["prompt_ids"] + p["gen_ids"], len(p["prompt_ids"])) for p in g]
        source = "%s (%d sequences)" % (os.path.relpath(a.golden, ROOT), len(seqs))
    tot, cnt = 0.0, 0
    for i, (ids, n) in enumerate(seqs):
        _, ks, _ = pr.run(ids, n, rot=False, want_keys=True)
        tot, cnt = tot + ks, cnt + len(ids)
        print("sequence %d of %d: %d tokens" % (i + 1, len(seqs), len(ids)), flush=True)
    mu = tot / cnt
    write_means(a.out, mu, "%s, %s, %d tokens" % (os.path.basename(path), source, cnt))
    print("wrote %s: %d layers x %d KV heads x %d dims, |mu| per row %.3g..%.3g" % (
        a.out, *mu.shape, np.linalg.norm(mu, axis=-1).min(), np.linalg.norm(mu, axis=-1).max()))


if __name__ == "__main__":
    main()

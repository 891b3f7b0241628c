#!/usr/bin/env python3
"""How far back each layer reads: per (layer, KV head), the attention mass that the decode
queries (t >= prompt + B) put on keys older than B/2 (old_r) and older than B (old_b), the
first four positions (sinks) left out, averaged over the group's query heads; B = --budget of
the output. One full-KV pass of one task problem (tools/task/gen.py records, tokenized as
tools/evict/run.py does), float32. The JSON feeds run.py's h2o-half-adainv diagnostic
(per-layer budgets).

    python3 tools/evict/layer_reads.py --lora models/smollm2-trace-lora --task train.jsonl \\
        --tokenizer tok.json [--task-skip K] [--budget 0.2] --out reads.json
"""
import argparse
import json
import math
import os
import subprocess
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF dir or GGUF (default: SmolLM2 via tools/smollm2.sh)")
    ap.add_argument("--lora", default=None)
    ap.add_argument("--task", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--task-skip", type=int, default=0, help="the record after the K shortest")
    ap.add_argument("--budget", type=float, default=0.2, help="B as a fraction of the output")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    sys.path.insert(0, HERE)
    import numpy as np
    import model as evm
    import run as evr
    items = evr.task_items(types.SimpleNamespace(task=a.task, tokenizer=a.tokenizer,
                                                 task_skip=a.task_skip, task_n=1))
    name, ids, n_prompt, n_out = items[0]
    path = a.model or subprocess.run(["bash", os.path.join(ROOT, "tools", "smollm2.sh")],
                                     capture_output=True, text=True, check=True).stdout.strip()
    m = evm.Model(path, np.float32, lora=a.lora)
    c = m.cfg
    T, B = len(ids), int(a.budget * n_out)
    D, G, Hkv = c.head_dim, c.group, c.n_kv_heads
    x = m.embed[np.asarray(ids)]
    pos = np.arange(T)
    scale = np.float32(1.0 / math.sqrt(D))
    causal = np.tril(np.ones((T, T), dtype=bool))
    t0 = n_prompt + B
    age = pos[:, None] - pos[None, :]
    old_r = (age >= B // 2) & (pos[None, :] >= 4)
    old_b = (age > B) & (pos[None, :] >= 4)
    res = {"problem": name, "T": T, "B": B, "R": B // 2, "old_r": [], "old_b": []}
    for l in range(c.n_layers):
        h = m.rmsnorm(x, m.layers[l]["rms_att"])
        q, k, v = m.qkv(l, h, pos)
        att = np.empty((T, c.n_heads, D), dtype=m.dtype)
        row_r, row_b = [], []
        for g in range(Hkv):
            mr = mb = 0.0
            for j in range(G):
                hq = g * G + j
                lg = np.where(causal, (q[:, hq, :] @ k[:, g, :].T) * scale, -np.inf)
                lg -= lg.max(axis=1, keepdims=True)
                e = np.exp(lg)
                al = e / e.sum(axis=1, keepdims=True)
                att[:, hq, :] = al @ v[:, g, :]
                mr += float((al[t0:] * old_r[t0:]).sum(1).mean()) / G
                mb += float((al[t0:] * old_b[t0:]).sum(1).mean()) / G
            row_r.append(round(mr, 4))
            row_b.append(round(mb, 4))
        res["old_r"].append(row_r)
        res["old_b"].append(row_b)
        print(l, row_r, row_b, flush=True)
        x = m.attn_out_mlp(l, x, att.reshape(T, -1))
    with open(a.out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()

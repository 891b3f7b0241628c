#!/usr/bin/env python3
"""How far back each layer reads: per (layer, KV head), the attention mass that the decode
queries (t >= prompt + B) put on keys older than B/2 (old_r) and older than B (old_b), the
first four positions (sinks) left out, averaged over the group's query heads; B = --budget of
the output. One full-KV pass of one task problem (tools/task/gen.py records, tokenized as
tools/evict/run.py does), float32, through model.full_pass. The JSON feeds run.py's h2o-half-adainv diagnostic
(per-layer budgets).

    python3 tools/evict/layer_reads.py --lora models/smollm2-trace-lora --task train.jsonl \\
        --tokenizer tok.json [--task-skip K] [--budget 0.2] --out reads.json
"""
import argparse
import json
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
    B = int(a.budget * n_out)
    stats = {"reads_from": n_prompt + B, "reads_budget": B}
    evm.full_pass(m, ids, stats=stats)
    res = {"problem": name, "T": len(ids), "B": B, "R": B // 2,
           "old_r": stats["old_r"], "old_b": stats["old_b"]}
    with open(a.out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()

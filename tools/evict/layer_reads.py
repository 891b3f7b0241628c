#!/usr/bin/env python3
"""How far back each layer reads: per (layer, KV head), the attention mass that the decode
queries (t >= prompt + B) put on keys older than B/2 (old_r) and older than B (old_b), the
first four positions (sinks) left out, averaged over the group's query heads; B = --budget of
the output. One full-KV pass of one task problem (tools/task/gen.py records, tokenized as
tools/evict/run.py does), float32, through model.full_pass. The JSON feeds run.py's -adainv
policies (per-layer budgets, --ada-calib); --weights also writes the engine's per-layer weights
1 / (0.1 + the layer's mean mass beyond B) (run.py's ada_weights), one line per layer, for
lfgen / lfbench / lfserve --layer-weights (lf_engine_config.layer_weights). --from converts a
JSON written earlier without the pass.

    python3 tools/evict/layer_reads.py --lora models/smollm2-trace-lora --task train.jsonl \\
        --tokenizer tok.json [--task-skip K] [--budget 0.2] --out reads.json [--weights w.txt]
    python3 tools/evict/layer_reads.py --text A --out reads.json --weights w.txt  # natural text
    python3 tools/evict/layer_reads.py --from reads.json --weights w.txt
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
    ap.add_argument("--task")
    ap.add_argument("--text", help="instead of --task: a text of tools/evict/texts.py (A, B), "
                    "its first --tokens tokens read as output (no prompt)")
    ap.add_argument("--tokens", type=int, default=1600)
    ap.add_argument("--tokenizer")
    ap.add_argument("--task-skip", type=int, default=0, help="the record after the K shortest")
    ap.add_argument("--budget", type=float, default=0.2, help="B as a fraction of the output")
    ap.add_argument("--out", help="the JSON of old_r / old_b per (layer, KV head)")
    ap.add_argument("--weights", help="also write the per-layer weights (--layer-weights' file)")
    ap.add_argument("--from", dest="src", help="convert this JSON (no pass) to --weights")
    a = ap.parse_args()
    sys.path.insert(0, HERE)
    if a.src:
        if not a.weights:
            ap.error("--from needs --weights")
        write_weights(a.src, a.weights)
        return
    if not ((a.text or (a.task and a.tokenizer)) and a.out):
        ap.error("--task and --tokenizer (or --text), and --out, are required without --from")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    import numpy as np
    import model as evm
    import run as evr
    path = a.model or subprocess.run(["bash", os.path.join(ROOT, "tools", "smollm2.sh")],
                                     capture_output=True, text=True, check=True).stdout.strip()
    if a.text:
        import texts as evt
        if a.tokenizer:  # a tokenizer.json (tokenizers), as --task reads it
            sys.path.insert(0, os.path.join(ROOT, "tools", "task"))
            import gen
            ids = gen.load_hf_tokenizer(a.tokenizer).encode(
                evt.TEXTS[a.text], add_special_tokens=False).ids[:a.tokens]
        else:  # transformers, as run.py --texts does
            ids = [int(x) for x in evr.tokenizer_for(path)(evt.TEXTS[a.text])["input_ids"]][:a.tokens]
        name, n_prompt, n_out = "text " + a.text, 0, len(ids)
    else:
        items = evr.task_items(types.SimpleNamespace(task=a.task, tokenizer=a.tokenizer,
                                                     task_skip=a.task_skip, task_n=1))
        name, ids, n_prompt, n_out = items[0]
    m = evm.Model(path, np.float32, lora=a.lora)
    B = int(a.budget * n_out)
    stats = {"reads_from": n_prompt + B, "reads_budget": B}
    evm.full_pass(m, ids, stats=stats)
    res = {"problem": name, "T": len(ids), "B": B, "R": B // 2,
           "old_r": stats["old_r"], "old_b": stats["old_b"]}
    with open(a.out, "w") as f:
        json.dump(res, f)
    if a.weights:
        write_weights(a.out, a.weights)


def write_weights(src, dst):
    """One weight per layer, repr precision, so lf_layer_budgets_from_weights gives exactly the
    budgets run.py's ada_budgets does."""
    import run as evr
    cal = json.load(open(src))
    w = evr.ada_weights(src)
    with open(dst, "w") as f:
        f.write("# per-layer budget weights, 1 / (0.1 + mean attention mass beyond B), from %s\n"
                "# (problem %s, B %d; tools/evict/layer_reads.py)\n"
                % (os.path.basename(src), cal.get("problem"), cal.get("B", 0)))
        for x in w:
            f.write("%r\n" % x)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Does our engine generate what transformers generates? Greedy decoding of task problems with
the exported model in transformers (fp32, on the stored weights) and with `lfgen --policy full`,
token by token.

    /opt/hfref/bin/python tools/task/hfcheck.py --model DIR [--lfgen build/lfgen] [--n 1]
        [--max-tokens N] [task options, e.g. --min-len 300 --max-len 400]

Prints, per problem, whether the two token sequences are identical and, where they are not,
the first differing position with transformers' top-2 logit margin there (a near-tie is a
numerical coin toss, not a bug). Exit status 0 when every sequence matches. It also reports
whether transformers' output solves the problem, so on a trained model it checks the issue's
"same answers as the model run in torch".
"""
import argparse
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen  # noqa: E402


def _cache_kw():
    """transformers >= 5.2x calls the cache argument `cache`; earlier ones `past_key_values`
    (an unknown keyword would be swallowed by **kwargs and silently drop the cache)."""
    import inspect
    import transformers
    params = inspect.signature(transformers.LlamaForCausalLM.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


CACHE_KW = None


def hf_greedy(model, prompt, max_new):
    """Greedy with a KV cache; stops after <eos>. Returns tokens and per-step top-2 margins."""
    ids = torch.tensor([prompt])
    out, margins = [], []
    past = None
    with torch.no_grad():
        for _ in range(max_new):
            kw = {CACHE_KW: past} if past is not None else {}
            r = model(input_ids=ids, use_cache=True, **kw)
            past = r.past_key_values
            logits = r.logits[0, -1].float()
            top = torch.topk(logits, 2)
            margins.append(float(top.values[0] - top.values[1]))
            t = int(top.indices[0])
            out.append(t)
            if t == gen.EOS_ID:
                break
            ids = torch.tensor([[t]])
    return out, margins


def lfgen_run(lfgen, model_dir, prompt, max_new, extra=()):
    cmd = [lfgen, "--model", model_dir, "--prompt-ids", ",".join(map(str, prompt)),
           "--max-tokens", str(max_new), "--temperature", "0", "--print-ids", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"lfgen failed ({r.returncode}): {r.stderr.strip()}")
    return [int(x) for x in r.stdout.split()]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--lfgen", default=next((p for p in (os.path.join(root, "build", "lfgen"),
                                                         os.path.join(root, "build-lead", "lfgen"))
                                             if os.path.exists(p)), "lfgen"))
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--split", default="test")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=0,
                    help="tokens to generate (default: the expected output length + 16)")
    ap.add_argument("--attn", default="eager", help="transformers attention implementation")
    gen.add_task_args(ap, 300, 400)
    args = ap.parse_args()
    import transformers
    global CACHE_KW
    CACHE_KW = _cache_kw()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, attn_implementation=args.attn).eval()
    all_ok = True
    for p in gen.problems(args.n, args.split, args.seed, **gen.gen_kwargs(args)):
        prompt = gen.encode(p["prompt"])
        n = args.max_tokens or p["output_tokens"] + 16
        hf, margins = hf_greedy(model, prompt, n)
        ours = lfgen_run(args.lfgen, args.model, prompt, n, ["--policy", "full"])
        if len(ours) < n and (not ours or ours[-1] != gen.EOS_ID):
            # lfgen stops at <eos> without printing it; hf_greedy keeps it (as gen.check expects)
            ours = ours + [gen.EOS_ID]
        same = hf == ours
        first = next((i for i in range(min(len(hf), len(ours))) if hf[i] != ours[i]),
                     None if len(hf) == len(ours) else min(len(hf), len(ours)))
        rec = {"problem": p["id"], "prompt_tokens": len(prompt), "generated": len(hf),
               "identical": same, "first_difference": first,
               "hf_margin_there": margins[first] if first is not None and first < len(margins)
               else None,
               "hf_min_margin": min(margins), "distinct_tokens": len(set(hf)),
               "hf_answer_ok": gen.check(p, hf)["answer_ok"],
               "engine_answer_ok": gen.check(p, ours)["answer_ok"],
               "hf_text_head": gen.decode(hf)[:60]}
        print(json.dumps(rec))
        all_ok &= same
    print("all identical" if all_ok else "MISMATCH")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())

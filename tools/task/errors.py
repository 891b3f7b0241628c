#!/usr/bin/env python3
"""Where does a trained `trace` model go wrong? Teacher-forced error analysis of an exported
model on held-out problems: every output token is labelled with its role (round header, rule
copy, skip decision, operand name/digit by kind and look-back, result digit, answer line, <eos>)
and the wrong argmax predictions are counted per role and per look-back bucket.

    py tools/task/errors.py --model out/trace-model --n 48 --min-len 2000 [--dtype bf16]

CPU is fine for the default 4.6 M-parameter model (a few seconds per 8k-token problem).
"""
import argparse
import collections
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen  # noqa: E402


def label_output(p):
    """-> list of (role, lookback) for every output token (output chars, then <eos>).
    lookback: for value digits, distance to the most recent occurrence of that register's value
    (the digit the model must copy); None otherwise."""
    prompt, out = p["prompt"], p["output"]
    seq = "\x00" + prompt + out  # position 0 is <bos>
    off = 1 + len(prompt)
    prm = p["params"]
    kind = {v: "hot" for v in prm["hot"]}
    kind.update({v: "cold" for v in prm["cold"]})
    kind.update({v: "const" for v in prm["consts"]})
    kind.update({v: "memo" for v in prm["memo"]})
    last = {}  # register -> position of the digit of its latest value occurrence
    for i in range(1, off - 1):
        if seq[i].islower() and seq[i + 1].isdigit() and seq[i - 1] == " ":
            last[seq[i]] = i + 1
    roles = []
    i = off
    for line in out.split("\n")[:-1]:
        L = len(line) + 1
        r = [None] * L
        if line.startswith("#"):
            r[0] = ("hdr#", None)
            r[1] = ("hdr_tens", None)
            r[2] = ("hdr_units", None)
            r[3] = ("hdr_nl", None)
            start_role = "line_start:hdr"
        elif line.startswith("ans"):
            for j in range(L):
                r[j] = ("ans_text", None)
            start_role = "line_start:ans"
            for j in range(4, len(line), 3):
                v = line[j]
                r[j] = ("ans_name", None)
                d = i + j + 1
                r[j + 1] = (f"ans_digit_{kind[v]}", d - last[v])
                last[v] = d
        else:
            sp = line.index(" ")
            rule = line[:sp]
            period = int(rule.split("@")[1]) if "@" in rule else 1
            start_role = "line_start:rule"
            for j in range(sp):
                r[j] = ("rule_op" if line[j] in "+-" else "rule_copy", None)
            tag = "cold" if period > 1 else "hot"
            r[sp] = (f"rule_space_{tag}", None)
            if line[sp + 1] == ".":
                r[sp + 1] = ("skip_dot", None)
                r[sp + 2] = ("nl_after_skip", None)
            else:
                r[sp + 1] = (f"exec_first_{tag}", None)  # decision: run (name) vs skip ('.')
                toks = line[sp + 1:].split(" ")
                j = sp + 1
                for k, t in enumerate(toks):
                    v = t[0]
                    d = i + j + 1
                    if k < 2:
                        if k == 1:
                            r[j] = ("operand_name_y", None)
                        r[j + 1] = (f"operand_digit_{kind[v]}", d - last[v])
                    else:
                        r[j] = ("result_name", None)
                        r[j + 1] = (f"result_digit_{tag}", None)
                    last[v] = d
                    if k < 2:
                        r[j + 2] = ("space", None)
                    j += 3
            r[L - 1] = ("nl", None)
        r = [x if x is not None else ("other", None) for x in r]
        r[0] = (start_role, None) if r[0][0] in ("hdr#", "rule_copy", "ans_text") else r[0]
        roles.extend(r)
        i += L
    roles.append(("eos", None))
    assert len(roles) == len(out) + 1
    return roles


BUCKETS = [0, 128, 256, 512, 1024, 2048, 4096, 1 << 30]


def bucket(d):
    for lo, hi in zip(BUCKETS, BUCKETS[1:]):
        if lo <= d < hi:
            return f"[{lo},{hi if hi < 1 << 30 else 'inf'})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--seed", type=int, default=1001)
    ap.add_argument("--split", default="test")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--show", type=int, default=12, help="print this many error contexts")
    ap.add_argument("--json", help="write per-error records here")
    ap.add_argument("--prefix-rounds", type=int, default=0,
                    help="score only the first N output rounds (fast: many problems)")
    gen.add_task_args(ap, min_len=2000, max_len=8000)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = transformers.LlamaForCausalLM.from_pretrained(args.model, dtype=dt).eval()
    kw = gen.gen_kwargs(args)
    if not gen.knobs_default(kw):
        ap.error("the token roles are those of the original format: --reread, --named-rules, "
                 "--remind and --show-op are not supported here")
    probs = list(gen.problems(args.n, args.split, args.seed, args.start, **kw))
    tot = collections.Counter()
    err = collections.Counter()
    tot_lb = collections.Counter()
    err_lb = collections.Counter()
    errs = []
    near = collections.Counter()
    near_lo = collections.Counter()
    minp = {}
    exact = 0
    t0 = time.time()
    for p in probs:
        ids = gen.encode(p["prompt"]) + gen.encode(p["output"], bos=False) + [gen.EOS_ID]
        roles = label_output(p)
        if args.prefix_rounds:
            cut = p["output"].find("#", 0)
            for _ in range(args.prefix_rounds):
                cut = p["output"].find("#", cut + 1)
                if cut < 0:
                    cut = len(p["output"]) + 1
                    break
            ids, roles = ids[:p["prompt_tokens"] + cut], roles[:cut]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        n_p = p["prompt_tokens"]
        lg = logits[n_p - 1:len(ids) - 1]
        pred = lg.argmax(-1).tolist()
        want = ids[n_p:]
        nbad = 0
        pw = torch.softmax(lg, -1)[torch.arange(len(want)), torch.tensor(want)].tolist()
        rounds_at = []  # round index (1 = first round of the output) of every output token
        r_i = 0
        for ch in p["output"]:
            r_i += ch == "#"
            rounds_at.append(r_i)
        rounds_at.append(r_i)
        for j, ((role, lb), w, g) in enumerate(zip(roles, want, pred)):
            rr = rounds_at[j]
            rkey = "r1" if rr <= 1 else ("r2" if rr == 2 else "r3+")
            near[(role, rkey)] += 1
            if pw[j] < 0.9:
                near_lo[(role, rkey)] += 1
            minp[(role, rkey)] = min(minp.get((role, rkey), 1.0), pw[j])
            tot[role] += 1
            if lb is not None:
                tot_lb[(role, bucket(lb))] += 1
            if g != w:
                nbad += 1
                err[role] += 1
                if lb is not None:
                    err_lb[(role, bucket(lb))] += 1
                pr = torch.softmax(lg[j], -1)
                line_start = p["output"].rfind("\n", 0, j) + 1
                line_end = p["output"].find("\n", j)
                errs.append({"id": p["id"], "pos": j, "out_len": len(want), "role": role,
                             "lookback": lb, "want": gen.VOCAB[w], "got": gen.VOCAB[g],
                             "p_want": round(float(pr[w]), 4), "p_got": round(float(pr[g]), 4),
                             "round_header": p["output"][:j][p["output"][:j].rfind("#"):][:3],
                             "line": p["output"][line_start:line_end],
                             "col": j - line_start,
                             "periods": p["params"]["cold"], "rounds": p["params"]["rounds"]})
        exact += nbad == 0
        if not args.prefix_rounds:
            print(f"{p['id']}: {len(want)} output tokens, {nbad} wrong", flush=True)
    print(f"\n{len(probs)} problems{f' (first {args.prefix_rounds} rounds)' if args.prefix_rounds else ''}, {args.dtype}: tf_exact {exact / len(probs):.3f}, "
          f"{sum(err.values())} wrong of {sum(tot.values())} tokens "
          f"({sum(err.values()) / sum(tot.values()):.2e}); {time.time() - t0:.0f}s")
    print(f"\n{'role':24} {'tokens':>8} {'wrong':>6} {'rate':>9}")
    for role in sorted(tot, key=lambda r: -err[r]):
        print(f"{role:24} {tot[role]:8d} {err[role]:6d} {err[role] / tot[role]:9.2e}")
    print(f"\nvalue digits by look-back:\n{'role':24} {'bucket':>12} {'tokens':>8} {'wrong':>6} "
          f"{'rate':>9}")
    order = [bucket(b) for b in BUCKETS[:-1]]
    for key in sorted(tot_lb, key=lambda k: (k[0], order.index(k[1]))):
        print(f"{key[0]:24} {key[1]:>12} {tot_lb[key]:8d} {err_lb[key]:6d} "
              f"{err_lb[key] / tot_lb[key]:9.2e}")
    print(f"\nby round (r1 = first output round, copied from the prompt): tokens, p(target) < 0.9, "
          f"min p(target)")
    for key in sorted(near, key=lambda k: (-near_lo[k], k)):
        if near_lo[key] or minp[key] < 0.99:
            print(f"{key[0]:24} {key[1]:>4} {near[key]:8d} {near_lo[key]:6d} {minp[key]:9.4f}")
    for e in errs[:args.show]:
        print(json.dumps(e))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(errs, f, indent=0)


if __name__ == "__main__":
    main()

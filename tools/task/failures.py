#!/usr/bin/env python3
"""Where the eviction policies first go wrong: for every failed run of an `lfbench eval` JSON,
what the first wrong output token needed and how far back that was.

    python3 tools/task/failures.py EVAL.json [--problems FILE.jsonl | task options as given to
        eval.py, e.g. --n 32 --min-len 2000 --max-len 4000]

Per (series, fraction): how many first errors are a register read (the digit after a register
name in an operand or answer position) and, for those, the look-back: output positions back to
the last earlier mention of that register's value (prompt included); how many of those look-backs
are under half the run's budget (a token any recency window of that size would still hold); and
how many output tokens after evictions began (budget - prompt tokens) the first error came.
Standard library only.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen  # noqa: E402


def needed(problem, e):
    """('read', look-back) when output token e is a register value read, else (kind, 0)."""
    full = problem["prompt"] + problem["output"]
    i = len(problem["prompt"]) + e
    line_start = full.rfind("\n", 0, i) + 1
    line_end = full.find("\n", i)
    line = full[line_start:line_end if line_end >= 0 else len(full)]
    if line.startswith("#"):
        return ("round header", 0)
    bar = line.find(" |")  # the reread knob's check walk: local scratch after the result
    if bar >= 0 and i - line_start > bar:
        return ("check walk", 0)
    if full[i].isdigit() and full[i - 1].isalpha():
        field = len(full[line_start:i + 1].split(" ")) - 1
        if field == 0:
            return ("rule text", 0)  # a named rule: "R3"
        if line.startswith("ans") or line.startswith("recall") or field in (1, 2):
            v, j = full[i - 1], i - 2
            while j >= 0 and not (full[j] == v and full[j + 1].isdigit() and
                                  (j == 0 or full[j - 1] in " \n")):
                j -= 1
            return ("read", i - j)
        return ("result", 0)
    return ("rule text", 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("eval_json")
    ap.add_argument("--problems", help="the problems file eval.py/lfbench eval ran")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--split", default="test")
    ap.add_argument("--seed", type=int, default=0)
    gen.add_task_args(ap, 2000, 8000)
    args = ap.parse_args()
    d = json.load(open(args.eval_json))
    if args.problems:
        probs = [json.loads(line) for line in open(args.problems) if line.strip()]
    else:
        probs = list(gen.problems(args.n, args.split, args.seed, **gen.gen_kwargs(args)))
    by_id = {p["id"]: p for p in probs}
    rows = {}
    for r in d["runs"]:
        if r["policy"] == "full" or r.get("first_error") is None:
            continue
        p = by_id.get(r["problem"])
        if p is None:
            sys.exit(f"problem {r['problem']} not among the given problems (same options as eval.py?)")
        if p.get("format") == "hf-chatml":
            sys.exit("failures.py counts positions in task tokens (one per character); runs of "
                     "--format hf records are in the model's tokens")
        if p["prompt_tokens"] != r["prompt_tokens"]:
            sys.exit(f"problem {r['problem']}: prompt differs from the run's (other task options?)")
        e = r["first_error"]
        if e >= len(p["output"]):
            continue  # the answer was right, <eos> missing or late
        kind, back = needed(p, e)
        series = r["policy"] + ("-layer" if r.get("scope") == "layer" else "")
        rows.setdefault((series, r["fraction"]), []).append(
            (kind, back, e - (r["budget"] - p["prompt_tokens"]), r["budget"]))
    print(f"{'series':<15} {'budget':>6} {'fails':>5} {'reads':>6} {'look-back p50':>13} "
          f"{'budget p50':>10} {'look-back < budget/2':>20} {'tokens after 1st eviction p50':>29}")
    for (series, frac), v in sorted(rows.items()):
        reads = [x for x in v if x[0] == "read"]
        lb = statistics.median(x[1] for x in reads) if reads else 0
        short = sum(1 for x in reads if x[1] < x[3] / 2)
        print(f"{series:<15} {100 * frac:5g}% {len(v):5d} {len(reads):6d} {lb:13.0f} "
              f"{statistics.median(x[3] for x in v):10.0f} {short:>13d} of {len(reads):<4d} "
              f"{statistics.median(x[2] for x in v):29.0f}")


if __name__ == "__main__":
    main()

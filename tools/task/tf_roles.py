#!/usr/bin/env python3
"""Teacher-forced token error by token role and look-back distance, per policy and budget.

Reads the JSON of `lfbench eval --teacher-forced` (or of tools/task/eval.py run with
`--engine-args --teacher-forced`) and the problems file it ran; regenerates each problem from its
seed and `knobs` (gen.make_problem, which labels every output character with its role and, for
a copied value, the distance back to its source: `_roles`), maps every output token to the
characters it covers, and counts wrong greedy tokens (`tf_wrong_at`) per role and per look-back
bucket of the value digits.

    python3 tools/task/tf_roles.py --eval tf.json --problems problems.jsonl [--tokenizer FILE]
        [--json out.json]

Records in gen.py's hf format (`--format hf`, SmolLM2's chat prompt) are tokenized with
--tokenizer (a tokenizer.json with the model's added tokens: `gen.py --hf-tokenizer smollm2
--save-hf-tokenizer FILE`); the task's own format is one token per character. A token covering
several characters takes the role that matters most among them (value > result > op > header > rule >
name > result_name > skip > check > recall > ans > text > space > newline) and that character's
look-back.
Look-backs are in task characters (the generator's unit): the same for every tokenizer.
Standard library only, plus `tokenizers` for hf records.
"""
import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen  # noqa: E402

PRIORITY = ["value", "result", "op", "header", "rule", "name", "result_name", "skip", "check", "recall",
            "ans", "text",
            "space", "newline"]
BUCKETS = [(0, 64), (64, 256), (256, 1024), (1024, 4096), (4096, 1 << 40)]


def bucket(d):
    for lo, hi in BUCKETS:
        if lo <= d < hi:
            return f"{lo}-{hi}" if hi < 1 << 40 else f">={lo}"
    return "?"


def regenerate(rec):
    k = rec.get("knobs")
    if not k:
        raise SystemExit(f"tf_roles: problem {rec['id']} has no knobs: regenerate it with gen.py")
    p = gen.make_problem(rec["seed"], min_len=k["min_len"], max_len=k["max_len"],
                         hot=tuple(k["hot"]), cold=tuple(k["cold"]), consts=tuple(k["consts"]),
                         memo=tuple(k["memo"]), periods=tuple(k["periods"]), ops=k["ops"],
                         reread=k["reread"], named_rules=k["named_rules"], remind=k["remind"],
                         show_op=k.get("show_op", False))
    if p["output"] != rec["output"]:
        raise SystemExit(f"tf_roles: problem {rec['id']} does not regenerate from its seed and knobs")
    return p["_roles"]


def token_labels(rec, roles, tok):
    """-> [(role, look-back chars or None)] per output token, <eos> last."""
    out = rec["output"]
    if tok is None:  # the task's tokenizer: one token per character
        spans = [(i, i + 1) for i in range(len(out))]
    else:
        enc = tok.encode(out, add_special_tokens=False)
        spans = list(enc.offsets)
    if len(spans) + 1 != rec["output_tokens"]:
        raise SystemExit(f"tf_roles: {rec['id']}: {len(spans)} + 1 output tokens, the file says "
                         f"{rec['output_tokens']} (wrong --tokenizer?)")
    labels = []
    for s, e in spans:
        best = None
        for j in range(s, max(e, s + 1)):
            role, back = roles[j]
            r = role.split(":")[0]
            if best is None or PRIORITY.index(r) < PRIORITY.index(best[0].split(":")[0]):
                best = (role, back)
        labels.append(best)
    labels.append(("eos", None))
    return labels


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eval", required=True, help="lfbench eval --teacher-forced JSON")
    ap.add_argument("--problems", required=True, help="the problems file it ran")
    ap.add_argument("--tokenizer", help="tokenizer.json for hf-format records")
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args()
    with open(args.eval) as f:
        ev = json.load(f)
    if not ev.get("teacher_forced"):
        raise SystemExit("tf_roles: the eval JSON was not run with --teacher-forced")
    with open(args.problems) as f:
        recs = {r["id"]: r for r in (json.loads(x) for x in f if x.strip())}
    tok = None
    if any(r.get("format", "").startswith("hf") for r in recs.values()):
        if not args.tokenizer:
            raise SystemExit("tf_roles: hf-format problems need --tokenizer")
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(args.tokenizer)
    labels = {}
    table = collections.OrderedDict()  # series -> {"role": {r: [wrong, n]}, "back": {...}}
    for run in ev["runs"]:
        if run.get("rc") or "tf_wrong_at" not in run:
            continue
        pid = run["problem"]
        if pid not in labels:
            labels[pid] = token_labels(recs[pid], regenerate(recs[pid]), tok)
        lab = labels[pid]
        frac = run["fraction"]
        name = run["policy"] + ("" if run.get("scope", "head") == "head" else "-" + run["scope"])
        key = name if frac is None else f"{name}@{frac}"
        t = table.setdefault(key, {"role": collections.OrderedDict(), "back": {}, "runs": 0})
        t["runs"] += 1
        wrong = set(run["tf_wrong_at"])
        if len(wrong) != run["tf_wrong"]:
            raise SystemExit(f"tf_roles: {pid}: tf_wrong_at and tf_wrong disagree")
        for i, (role, back) in enumerate(lab):
            r = t["role"].setdefault(role, [0, 0])
            r[0] += i in wrong
            r[1] += 1
            if role.startswith("value:"):
                b = t["back"].setdefault(bucket(back), [0, 0])
                b[0] += i in wrong
                b[1] += 1
    roles = sorted({r for t in table.values() for r in t["role"]},
                   key=lambda r: (PRIORITY.index(r.split(":")[0]) if r != "eos" else 99, r))
    backs = [bucket(lo) for lo, _ in BUCKETS]

    def rows(field, keys):  # one line per key: error % (count) in every series
        for key in keys:
            cells = []
            for t in table.values():
                w, n = t[field].get(key, (0, 0))
                cells.append(f"{100 * w / n:8.2f} ({n:6d})" if n else f"{'-':>17}")
            print(f"{key:<14}" + "".join(f"{c:>17}" for c in cells))

    print("teacher-forced token error (%) by role; columns: series@fraction, runs")
    print(f"{'role':<14}" + "".join(f"{k[:16]:>17}" for k in table))
    rows("role", roles)
    print("value digits by look-back (task characters)")
    rows("back", backs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"eval": os.path.abspath(args.eval), "series": table,
                       "buckets_chars": backs}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""`lfbench eval --teacher-forced` and tools/task/tf_roles.py on the trace model (models/trace) and
two CI problems (CPU, ~10 s): full has no wrong token; the per-role counts of every series add up
to the runs' output tokens and their wrong tokens to the runs' tf_wrong; longflow at 10% gets some
value digits wrong; the first wrong position of a teacher-forced run is the free-running one's.

    python3 tests/test_tf_roles.py --lfbench build/lfbench
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lfbench", required=True)
    args = ap.parse_args()
    probs = os.path.join(ROOT, "tests/data/task/ci_problems.jsonl")
    model = os.path.join(ROOT, "models/trace")
    fails = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for mode in ("tf", "free"):
            out = os.path.join(tmp, f"{mode}.json")
            cmd = [args.lfbench, "eval", "--model", model, "--problems", probs, "--n", "2",
                   "--policies", "full,longflow", "--fractions", "0.1", "--jobs", "2", "--quiet",
                   "--json", out] + (["--teacher-forced"] if mode == "tf" else [])
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            runs[mode] = json.load(open(out))
        tfj = os.path.join(tmp, "roles.json")
        subprocess.run([sys.executable, os.path.join(ROOT, "tools/task/tf_roles.py"), "--eval",
                        os.path.join(tmp, "tf.json"), "--problems", probs, "--json", tfj],
                       check=True, stdout=subprocess.DEVNULL)
        roles = json.load(open(tfj))["series"]
    tf = runs["tf"]
    if not tf.get("teacher_forced"):
        fails.append("the JSON does not say teacher_forced")
    for key, rs in (("full", [r for r in tf["runs"] if r["policy"] == "full"]),
                    ("longflow@0.1", [r for r in tf["runs"] if r["policy"] == "longflow"])):
        t = roles.get(key)
        if t is None or not rs:
            fails.append(f"no series {key}")
            continue
        n = sum(v[1] for v in t["role"].values())
        w = sum(v[0] for v in t["role"].values())
        if n != sum(r["output_tokens"] for r in rs):
            fails.append(f"{key}: roles cover {n} tokens, the runs {sum(r['output_tokens'] for r in rs)}")
        if w != sum(r["tf_wrong"] for r in rs):
            fails.append(f"{key}: roles count {w} wrong, the runs {sum(r['tf_wrong'] for r in rs)}")
        if key == "full" and w:
            fails.append(f"full: {w} wrong tokens with the whole KV")
        if key != "full" and not sum(v[0] for k, v in t["role"].items() if k.startswith("value:")):
            fails.append(f"{key}: no wrong value digit at 10%: the check saw nothing")
    free = {(r["problem"], r["policy"]): r["first_error"] for r in runs["free"]["runs"]}
    for r in tf["runs"]:
        if free[(r["problem"], r["policy"])] != r["first_error"]:
            fails.append(f"{r['problem']} {r['policy']}: first error {r['first_error']} forced, "
                         f"{free[(r['problem'], r['policy'])]} free")
    for f in fails:
        print("FAIL: " + f)
    print("tf_roles: " + ("OK" if not fails else f"{len(fails)} FAILED"))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""A model of data-parallel against tensor-parallel scaling on one host (issue 40), from measured
figures only: the single-GPU decode step, the TP=2 step and the 2-rank all-reduce latency.

It is a model, not a measurement: 4- and 8-GPU machines have not been lent. For TP=T it assumes
each rank's compute is the single-GPU step over T at the compute efficiency measured at TP=2,
plus two all-reduces per layer at the 2-rank latency for the step's message (B x dim bf16). The
all-reduce latency does not fall with more ranks, so the TP rows are optimistic. Every replica
runs the same batch B (so the TP rows leave the KV memory that sharding frees unused).

    python3 bench/scaling_model.py [--tp1 F] [--tp2 F] [--comm F] [--gpus 1,2,4,8]
"""
import argparse
import json
import os

R = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def step_rows(path):
    with open(path) as f:
        return {r["batch"]: r["step_ms_median"] for r in json.load(f)["rows"]
                if r["model"] == "random:llama3-8b"}


def allreduce_us(path, nbytes):
    """2-rank in-place all-reduce time at nbytes, linear between the measured sizes."""
    with open(path) as f:
        rows = sorted((r["bytes"], r["time_us"]) for r in json.load(f)["runs"]["comm_ipc_bf16"]["rows"])
    if nbytes <= rows[0][0]:
        return rows[0][1]
    for (b0, t0), (b1, t1) in zip(rows, rows[1:]):
        if nbytes <= b1:
            return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
    return rows[-1][1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp1", default=os.path.join(R, "lfbench_step_h200_tp1_346059d.json"))
    ap.add_argument("--tp2", default=os.path.join(R, "lfbench_step_2xh200_tp2_346059d.json"))
    ap.add_argument("--comm", default=os.path.join(R, "lfbench_comm_2xh200_d027abd.json"))
    ap.add_argument("--gpus", default="1,2,4,8")
    ap.add_argument("--layers", type=int, default=32)  # llama3-8b
    ap.add_argument("--dim", type=int, default=4096)
    a = ap.parse_args()
    s1, s2 = step_rows(a.tp1), step_rows(a.tp2)
    gpus = [int(x) for x in a.gpus.split(",")]
    print("# MODEL (not measured beyond TP=2): llama3-8b decode, batch B per replica, one host")
    print(f"# {'B':>3} {'layout':<10} {'GPUs':>4} {'step ms':>8} {'tok/s':>8} {'tok/s/GPU':>9}  source")
    for B in sorted(set(s1) & set(s2)):
        ar_ms = 2 * a.layers * allreduce_us(a.comm, B * a.dim * 2) / 1000.0
        eff = (s1[B] / 2) / (s2[B] - ar_ms)  # TP=2 compute against half the TP=1 step
        for n in gpus:
            for t in (1, 2, 4, 8):
                if t > n or n % t:
                    continue
                if t == 1:
                    step, src = s1[B], "measured step, replicas independent"
                elif t == 2:
                    step, src = s2[B], "measured step"
                else:
                    step = s1[B] / (t * eff) + ar_ms
                    src = f"model: compute / {t} at TP=2's efficiency {eff:.2f} + {ar_ms:.2f} ms all-reduce"
                tps = (n // t) * B / (step / 1000.0)
                layout = f"{n // t}x TP{t}"
                print(f"  {B:>3} {layout:<10} {n:>4} {step:8.3f} {tps:8.0f} {tps / n:9.0f}  {src}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

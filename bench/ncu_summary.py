#!/usr/bin/env python3
"""Short tables from ncu CSV exports, for bench/run.sh's PROFILE and PROFILE_ATTN options.

  ncu_summary.py kernels FILE.csv   per kernel name: calls, time, share and DRAM throughput
                                    (ncu --csv with gpu__time_duration.sum and dram__bytes.sum)
  ncu_summary.py stalls FILE.csv    the largest warp-stall ratios of the first profiled launch
                                    (ncu --import REP --page raw --csv)
"""
import collections
import csv
import sys

TIME_US = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}
BYTES = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}


def kernels(path):
    t, n, b = collections.Counter(), collections.Counter(), collections.Counter()
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    if not rows:
        print(f"{path}: no profiled kernels")
        return
    head = rows[0]
    ki, mi = head.index("Kernel Name"), head.index("Metric Name")
    ui, vi = head.index("Metric Unit"), head.index("Metric Value")
    for r in rows[1:]:
        v = float(r[vi].replace(",", "") or 0)
        k = r[ki][:60]
        if r[mi] == "gpu__time_duration.sum":
            t[k] += v * TIME_US.get(r[ui], 1.0)
            n[k] += 1
        elif r[mi] == "dram__bytes.sum":
            b[k] += v * BYTES.get(r[ui], 1)
    tot = sum(t.values()) or 1.0
    print(f"{'kernel':60s} {'calls':>6s} {'us':>10s} {'share':>6s} {'GB/s':>8s}")
    for k, v in t.most_common(20):
        print(f"{k:60s} {n[k]:6d} {v:10.1f} {100 * v / tot:5.1f}% {b[k] / (v * 1e3) if v else 0:8.0f}")
    print(f"total {sum(t.values()):.1f} us over {sum(n.values())} kernels")


def stalls(path):
    rows = list(csv.reader(open(path)))
    if len(rows) <= 2:
        return
    head, first = rows[0], rows[2]
    st = [(h, float(first[i].replace(",", "") or 0)) for i, h in enumerate(head)
          if "warps_issue_stalled" in h and h.endswith("ratio")]
    for h, v in sorted(st, key=lambda x: -x[1])[:12]:
        print(f"{h:90s} {v:8.2f}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("kernels", "stalls"):
        sys.exit(__doc__)
    {"kernels": kernels, "stalls": stalls}[sys.argv[1]](sys.argv[2])

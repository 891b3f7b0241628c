#!/usr/bin/env python3
"""Peer for `lfbench kernel`: torch scaled_dot_product_attention decode on the same shapes.

q [b, 32, 1, 128], k/v [b, 8, B, 128] bf16, enable_gqa=True: plain attention, no scoring or
eviction. Timed with triton.testing.do_bench (CUDA events, L2 flushed before every call, median);
the KV tensors are rotated among enough copies that the working set exceeds 4x L2, as lfbench
does. Writes JSON with one row object per line (lfbench --peer reads it).

usage: sdpa_peer.py [--batches 1,8,32,128] [--budgets 1024,2048,3200] [--json FILE]
"""
import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F


def first_backend(call):
    """The first of SDPA's fused backends (flash, efficient, cudnn, math) that runs call(), for
    the record; "?" where torch cannot say."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return "?"
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                     ("cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("math", SDPBackend.MATH)):
        try:
            with sdpa_kernel([be]):
                call()
            return name
        except RuntimeError:
            continue
    return "?"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--budgets", default="1024,2048,3200")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from triton.testing import do_bench

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 60 << 20)
    H, HKV, D = args.heads, args.kv_heads, args.head_dim
    rows = []
    print(f"# sdpa_peer: torch {torch.__version__}, {props.name}, enable_gqa=True, bf16")
    print(f"#{'batch':>6} {'budget':>7} {'kv_bytes':>13} {'time_us':>10} {'GB/s':>9} {'backend':>10}")
    for budget in [int(x) for x in args.budgets.split(",")]:
        for b in [int(x) for x in args.batches.split(",")]:
            kv_bytes = 2 * b * HKV * budget * D * 2
            n_sets = max(1, math.ceil(4 * l2 / kv_bytes))
            gen = torch.Generator(device=dev).manual_seed(1234 + b * 7 + budget)
            q = (1.5 * torch.randn(b, H, 1, D, device=dev, generator=gen)).to(torch.bfloat16)
            ks = [torch.randn(b, HKV, budget, D, device=dev, generator=gen).to(torch.bfloat16)
                  for _ in range(n_sets)]
            vs = [torch.randn(b, HKV, budget, D, device=dev, generator=gen).to(torch.bfloat16)
                  for _ in range(n_sets)]
            it = [0]

            def fn():
                i = it[0] % n_sets
                it[0] += 1
                return F.scaled_dot_product_attention(q, ks[i], vs[i], enable_gqa=True)

            backend = first_backend(
                lambda: F.scaled_dot_product_attention(q, ks[0], vs[0], enable_gqa=True))
            ms = do_bench(fn, warmup=50, rep=300, return_mode="median")
            us = ms * 1e3
            row = {"batch": b, "budget": budget, "kv_bytes": kv_bytes, "time_us": round(us, 3),
                   "GBs": round(kv_bytes / (us * 1e-6) / 1e9, 1), "first_backend": backend}
            rows.append(row)
            print(f" {b:6d} {budget:7d} {kv_bytes:13d} {us:10.2f} {row['GBs']:9.1f} {backend:>10}")
            sys.stdout.flush()
            del ks, vs
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            f.write('{"bench": "sdpa_peer", "torch": "%s", "device": "%s",\n "rows": [\n'
                    % (torch.__version__, props.name))
            f.write(",\n".join("  " + json.dumps(r) for r in rows))
            f.write("\n]}\n")


if __name__ == "__main__":
    main()

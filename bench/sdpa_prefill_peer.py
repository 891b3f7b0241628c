#!/usr/bin/env python3
"""Peer for `lfbench attn`: torch scaled_dot_product_attention on the same prefill shapes.

A row is one chunk of T queries over n0 earlier keys and its own causal block: q [1, H, T, D],
k/v [1, Hkv, n0 + T, D], bf16. n0 = 0 uses is_causal=True; n0 > 0 the bottom-right causal bias
(torch.nn.attention.bias.causal_lower_right), which is the same mask lfserve's chunks use.
GQA through enable_gqa where the backend takes it, else K/V repeated to H heads (the FLOPs are
the same). Timed with triton.testing.do_bench (CUDA events, median). Writes JSON with one row
object per line (lfbench attn --peer reads it).

usage: sdpa_prefill_peer.py [--tokens 512,...] [--prefix 0,1536] [--json FILE]
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F

from sdpa_peer import first_backend  # bench/ is the script's directory, so on sys.path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--prefix", default="0,1536")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from triton.testing import do_bench

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    H, HKV, D = args.heads, args.kv_heads, args.head_dim
    rows = []
    print(f"# sdpa_prefill_peer: torch {torch.__version__}, {props.name}, bf16")
    print(f"#{'n0':>6} {'T':>6} {'time_us':>10} {'TFLOP/s':>8} {'backend':>10} {'gqa':>9}")
    for n0 in [int(x) for x in args.prefix.split(",")]:
        for T in [int(x) for x in args.tokens.split(",")]:
            gen = torch.Generator(device=dev).manual_seed(4321 + T + 7 * n0)
            q = (2.0 * torch.randn(1, H, T, D, device=dev, generator=gen)).to(torch.bfloat16)
            k = torch.randn(1, HKV, n0 + T, D, device=dev, generator=gen).to(torch.bfloat16)
            v = torch.randn(1, HKV, n0 + T, D, device=dev, generator=gen).to(torch.bfloat16)
            if n0 == 0:
                kw = {"is_causal": True}
            else:
                from torch.nn.attention.bias import causal_lower_right
                kw = {"attn_mask": causal_lower_right(T, n0 + T)}
            gqa = "enable"
            try:
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
                kw["enable_gqa"] = True
            except (RuntimeError, TypeError, ValueError):
                gqa = "repeated"
                k = k.repeat_interleave(H // HKV, dim=1)
                v = v.repeat_interleave(H // HKV, dim=1)

            def fn():
                return F.scaled_dot_product_attention(q, k, v, **kw)

            backend = first_backend(fn)
            ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
            us = ms * 1e3
            flops = 4.0 * H * D * (T * n0 + T * (T + 1) / 2.0)
            row = {"n0": n0, "T": T, "time_us": round(us, 3),
                   "tflops": round(flops / (us * 1e-6) / 1e12, 2), "first_backend": backend,
                   "gqa": gqa}
            rows.append(row)
            print(f" {n0:6d} {T:6d} {us:10.1f} {row['tflops']:8.1f} {backend:>10} {gqa:>9}")
            sys.stdout.flush()
            del q, k, v
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            f.write('{"bench": "sdpa_prefill_peer", "torch": "%s", "device": "%s",\n "rows": [\n'
                    % (torch.__version__, props.name))
            f.write(",\n".join("  " + json.dumps(r) for r in rows))
            f.write("\n]}\n")


if __name__ == "__main__":
    main()

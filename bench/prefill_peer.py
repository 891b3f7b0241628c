#!/usr/bin/env python3
"""Peer for `lfbench prefill`: one transformers forward over B prompts of P tokens.

The model is built from the shape of an lfserve `random:NAME` preset (engine/checkpoint.c,
copied into SHAPES below) with transformers' own random initialisation: nothing is downloaded.
bf16, attn_implementation="sdpa", on the GPU (or --device cpu for a smoke test). Each row is one
forward of input_ids [B, P] with logits_to_keep=1 (num_logits_to_keep=1 on older transformers),
so the LM head runs on the last position only, as in lfserve's prefill; the K/V cache is kept
(use_cache, as a serving prefill must; --no-cache turns it off). The tokens are on the device
before the clock starts. Time: CUDA events around the forward (perf_counter on the cpu), median
of --iters after --warmup. A row that runs out of memory is written as skipped.

FLOPs per row, the same formula as bench/bench_prefill.c:
    2 * N_lin * B * P + 2 * vocab * dim * B + 2 * 2 * H * D * L * P * (P + 1) / 2 * B
    N_lin = L * (dim*H*D + 2*dim*Hkv*D + H*D*dim + 3*dim*hidden)

usage: prefill_peer.py [--shape qwen3-8b] [--prompts 512,...,32768] [--batches 1,8]
                       [--warmup 1] [--iters 3] [--time-limit S] [--device cuda|cpu]
                       [--no-cache] [--json FILE]
Rows run smallest B * P first (as lfbench prefill does), so --time-limit drops the largest.
The JSON has the shape on its first line and one row object per line (lfbench --peer reads it).
"""
import argparse
import inspect
import json
import statistics
import sys
import time

import torch

# The random:NAME presets of engine/checkpoint.c (only what sets the cost of a forward; RoPE
# scaling is left out: it changes no FLOP and no kernel).
SHAPES = {
    "qwen3-8b": dict(model_type="qwen3", dim=4096, hidden_dim=12288, n_layers=36, n_heads=32,
                     n_kv_heads=8, head_dim=128, vocab_size=151936, max_seq_len=40960,
                     rope_theta=1e6, norm_eps=1e-6),
    "llama3-8b": dict(model_type="llama", dim=4096, hidden_dim=14336, n_layers=32, n_heads=32,
                      n_kv_heads=8, head_dim=128, vocab_size=128256, max_seq_len=131072,
                      rope_theta=5e5, norm_eps=1e-5),
    "tiny-llama": dict(model_type="llama", dim=256, hidden_dim=768, n_layers=4, n_heads=8,
                       n_kv_heads=2, head_dim=32, vocab_size=1024, max_seq_len=2048,
                       rope_theta=1e4, norm_eps=1e-5),
    "tiny-qwen3": dict(model_type="qwen3", dim=256, hidden_dim=768, n_layers=4, n_heads=8,
                       n_kv_heads=2, head_dim=64, vocab_size=1024, max_seq_len=2048,
                       rope_theta=1e6, norm_eps=1e-5),
}

SHAPE_KEYS = ("n_layers", "dim", "hidden_dim", "n_heads", "n_kv_heads", "head_dim", "vocab_size")


def linear_params(s):
    qd, kd = s["n_heads"] * s["head_dim"], s["n_kv_heads"] * s["head_dim"]
    return s["n_layers"] * (s["dim"] * qd + 2 * s["dim"] * kd + qd * s["dim"]
                            + 3 * s["dim"] * s["hidden_dim"])


def flops(s, P, B):
    return (2.0 * linear_params(s) * B * P + 2.0 * s["vocab_size"] * s["dim"] * B
            + 4.0 * s["n_heads"] * s["head_dim"] * s["n_layers"] * (P * (P + 1) / 2.0) * B)


def build_config(s):
    import transformers
    cls = transformers.Qwen3Config if s["model_type"] == "qwen3" else transformers.LlamaConfig
    cfg = cls(vocab_size=s["vocab_size"], hidden_size=s["dim"], intermediate_size=s["hidden_dim"],
              num_hidden_layers=s["n_layers"], num_attention_heads=s["n_heads"],
              num_key_value_heads=s["n_kv_heads"], head_dim=s["head_dim"],
              max_position_embeddings=s["max_seq_len"], rms_norm_eps=s["norm_eps"],
              tie_word_embeddings=False, attention_bias=False)
    # transformers 5 keeps the RoPE base in rope_parameters, 4 in rope_theta
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict):
        rp["rope_theta"] = s["rope_theta"]
    else:
        cfg.rope_theta = s["rope_theta"]
    if s["model_type"] == "qwen3":
        cfg.use_sliding_window = False
    return cfg


def build_model(cfg, dev):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device(dev):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16,
                                                     attn_implementation="sdpa")
        except TypeError:  # transformers 4: torch_dtype
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16,
                                                     attn_implementation="sdpa")
    model.to(dev).eval()
    impl = getattr(model.config, "_attn_implementation", "?")
    if impl != "sdpa":
        sys.exit(f"prefill_peer: the model runs attention as {impl!r}, not sdpa")
    return model


def keep_kwarg(model):
    params = inspect.signature(model.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return name
    sys.exit("prefill_peer: this transformers has neither logits_to_keep nor num_logits_to_keep")


def is_oom(e):
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    return isinstance(e, oom) or "out of memory" in str(e).lower()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--prompts", default="512,1024,2048,4096,8192,16384,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=0.0,
                    help="seconds for the grid (model build excluded); rows predicted not to fit "
                         "run fewer iters or are skipped")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-cache", action="store_true", help="use_cache=False")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.iters < 1 or args.warmup < 0:
        sys.exit("prefill_peer: --iters >= 1, --warmup >= 0")

    import transformers
    s = SHAPES[args.shape]
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    t0 = time.perf_counter()
    model = build_model(build_config(s), dev)
    if cuda:
        torch.cuda.synchronize(dev)
    build_s = time.perf_counter() - t0
    kw = keep_kwarg(model)
    use_cache = not args.no_cache

    grid = []
    for b in [int(x) for x in args.batches.split(",")]:
        for p in [int(x) for x in args.prompts.split(",")]:
            if (p, b) not in grid:
                grid.append((p, b))
    grid.sort(key=lambda pb: (pb[0] * pb[1], pb[1]))

    print(f"# prefill_peer: transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{name}; shape {args.shape} ({s['n_layers']} layers, dim {s['dim']}, MLP "
          f"{s['hidden_dim']}, {s['n_heads']}/{s['n_kv_heads']} heads of {s['head_dim']}, vocab "
          f"{s['vocab_size']}), bf16 random weights (built in {build_s:.1f} s), sdpa, {kw}=1, "
          f"use_cache={use_cache}")
    print(f"# time: {'CUDA events' if cuda else 'perf_counter'} around one forward, median of "
          f"{args.iters} after {args.warmup} warm-up; FLOPs as lfbench prefill")
    print(f"# {'P':>6} {'B':>3} {'time_ms':>11} {'tok/s':>11} {'TFLOP/s':>8} {'iters':>5}")
    sys.stdout.flush()

    gen = torch.Generator(device=dev).manual_seed(args.seed)
    rows, rate, t_start = [], 0.0, time.perf_counter()
    for P, B in grid:
        f = flops(s, P, B)
        row = {"prompt": P, "batch": B, "flops": f}
        warmup, iters = args.warmup, args.iters
        if P + 1 > s["max_seq_len"]:  # the first token must fit too, as in lfbench
            row.update(time_ms=None, skipped="longer than the context")
        elif args.time_limit > 0 and rate > 0:
            left, one = args.time_limit - (time.perf_counter() - t_start), f / rate
            fit = int(left // one)
            if fit < warmup + iters:
                warmup = min(warmup, 1)
                iters = min(iters, fit - warmup)
            if iters < 1:
                row.update(time_ms=None, skipped="time limit",
                           why=f"predicted {one:.1f} s a run, {left:.0f} s of --time-limit left")
        if "skipped" not in row:
            ids = None
            try:
                ids = torch.randint(0, s["vocab_size"], (B, P), device=dev, generator=gen)
                times = []
                with torch.inference_mode():
                    for i in range(warmup + iters):
                        if cuda:
                            e0 = torch.cuda.Event(enable_timing=True)
                            e1 = torch.cuda.Event(enable_timing=True)
                            e0.record()
                        else:
                            c0 = time.perf_counter()
                        out = model(input_ids=ids, use_cache=use_cache, **{kw: 1})
                        if cuda:
                            e1.record()
                            e1.synchronize()
                            ms = e0.elapsed_time(e1)
                        else:
                            ms = (time.perf_counter() - c0) * 1e3
                        if tuple(out.logits.shape) != (B, 1, s["vocab_size"]):
                            sys.exit(f"prefill_peer: logits {tuple(out.logits.shape)}: {kw} "
                                     f"was not honoured")
                        del out
                        if i >= warmup:
                            times.append(ms)
                ms = statistics.median(times)
                rate = f / (ms * 1e-3)
                row.update(time_ms=round(ms, 3), min_ms=round(min(times), 3),
                           tokens_per_s=round(B * P / (ms * 1e-3), 1),
                           tflops=round(f / (ms * 1e-3) / 1e12, 2), iters=iters)
            except Exception as e:  # noqa: BLE001 - only out-of-memory is a skip
                if not is_oom(e):
                    raise
                row.update(time_ms=None, skipped="out of memory", why=str(e).split("\n")[0][:200])
            finally:
                out = None
                del ids
                if cuda:
                    torch.cuda.empty_cache()
        if "skipped" in row:
            print(f"  {P:6d} {B:3d}  skipped: {row['skipped']}"
                  + (f" ({row['why']})" if "why" in row else ""))
        else:
            print(f"  {P:6d} {B:3d} {row['time_ms']:11.2f} {row['tokens_per_s']:11.0f} "
                  f"{row['tflops']:8.2f} {iters:5d}")
        sys.stdout.flush()
        rows.append(row)

    if args.json:
        head = {"bench": "prefill_peer", "transformers": transformers.__version__,
                "torch": torch.__version__, "device": name, "shape": args.shape,
                **{k: s[k] for k in SHAPE_KEYS}, "dtype": "bfloat16",
                "attn_implementation": "sdpa", "logits_arg": kw, "use_cache": use_cache,
                "warmup": args.warmup, "iters": args.iters, "time_limit_s": args.time_limit,
                "build_s": round(build_s, 2)}
        with open(args.json, "w") as fh:
            fh.write(json.dumps(head)[:-1] + ',\n "rows": [\n')
            fh.write(",\n".join("  " + json.dumps(r) for r in rows))
            fh.write("\n]}\n")
    measured = [r for r in rows if r.get("time_ms")]
    if measured:
        best = max(measured, key=lambda r: r["tflops"])
        print(f"# best {best['tflops']:.1f} TFLOP/s at P={best['prompt']} B={best['batch']}; "
              f"{len(rows) - len(measured)} of {len(rows)} rows skipped")
    else:
        print("# no row was measured")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Quantized KV pools with the keys' mean taken out first, in the simulator's model (a diagnostic
for docs/DESIGN.md §3; nothing here is served).

A constant vector mu subtracted from every key of a KV head leaves attention unchanged: each
query's logits all move by q.mu, which softmax removes. But the pool then stores k - mu, and
when the keys share a large common part (post-RoPE, in the rotated basis lfserve stores), the
quantization step, set by each row's or group's range, shrinks with it. This measures how much:
SmolLM2-135M-Instruct teacher-forced over tests/data/fidelity/smollm2/golden.json's seven prompts
(prompt + 256 greedy tokens each), top-1 agreement with the float64 pass and the mean KL against
it at the 1,792 decode positions, as tests/test_smollm2.cpp counts them. Reads follow the engine:
a decode step reads every key as stored; a prompt chunk (512 tokens) reads the keys of earlier
chunks as stored and its own exactly.

A variant is KQ[/VQ][:mode...], KQ and VQ one of none, bf16, fp8, int8, int4 (VQ defaults to
KQ); modes: c (mu = the mean key of the other six prompts' full passes, a calibration), p (mu =
the mean key of this prompt alone, what an engine could take from a sequence's first chunk),
norot (keys not Walsh-Hadamard-rotated). The formats follow base/kvq.h's definitions: fp8 e4m3
with a row scale amax/448, round to nearest even; int8 symmetric, amax/127; int4 per group of 32,
floor and step (kept in float64 here, where lfserve rounds them to bf16).

With --task (tools/task/gen.py --format hf records, the adapter of --lora merged) the sequences
are each record's prompt and completion instead, and the figures add the teacher-forced token
error: the share of completion tokens whose argmax is not the text's next token (the float64
pass's own error beside it); mode c then takes mu from the other records, or from those of --calib.

    python3 tools/evict/kv_center.py none,int4,int4:c,int4:p [--out F.json]
    python3 tools/evict/kv_center.py none,int4,int4:p --task P.jsonl --tokenizer tok.json \
        --lora models/smollm2-trace-lora
"""
import argparse
import json
import math
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import model as evm  # noqa: E402

CHUNK = 512


def hadamard(d):
    h = np.array([[1.0]])
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(d)


def e4m3(x):
    """x (already scaled into +-448) rounded to the nearest e4m3 value, ties to even."""
    ax = np.abs(x)
    e = np.maximum(np.floor(np.log2(np.maximum(ax, 1e-300))), -6)  # subnormals below 2^-6
    step = 2.0 ** (e - 3)
    return np.sign(x) * np.minimum(np.round(ax / step) * step, 448)


def q_fp8(rows):
    s = np.abs(rows).max(-1, keepdims=True) / 448
    s[s == 0] = 1
    return e4m3(rows / s) * s


def q_int8(rows):
    s = np.abs(rows).max(-1, keepdims=True) / 127
    s[s == 0] = 1
    return np.clip(np.round(rows / s), -127, 127) * s


def q_int4(rows):
    g = rows.reshape(rows.shape[:-1] + (rows.shape[-1] // 32, 32))
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    st = (hi - lo) / 15
    st[st == 0] = 1
    return (np.clip(np.round((g - lo) / st), 0, 15) * st + lo).reshape(rows.shape)


def q_bf16(x):
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


QUANT = {"bf16": q_bf16, "fp8": q_fp8, "int8": q_int8, "int4": q_int4, "none": None}


class Probe:
    def __init__(self, m):
        self.m = m
        self.c = m.cfg
        self.H = hadamard(self.c.head_dim)

    def _layer_attn(self, q, k, v, stored, kq, vq):
        """Attention of one layer; stored [T, T]: row t reads key j as stored."""
        c = self.m.cfg
        T = q.shape[0]
        ks = QUANT[kq](k) if kq and QUANT[kq] else k
        vs = QUANT[vq](v) if vq and QUANT[vq] else v
        causal = np.tril(np.ones((T, T), dtype=bool))
        att = np.empty((T, c.n_heads, c.head_dim))
        scale = 1.0 / math.sqrt(c.head_dim)
        for g in range(c.n_kv_heads):
            for j in range(c.group):
                hq = g * c.group + j
                lg = np.where(stored, q[:, hq] @ ks[:, g].T, q[:, hq] @ k[:, g].T) * scale
                lg = np.where(causal, lg, -np.inf)
                lg -= lg.max(1, keepdims=True)
                a = np.exp(lg)
                a /= a.sum(1, keepdims=True)
                att[:, hq] = (a * stored) @ vs[:, g] + (a * ~stored) @ v[:, g]
        return att.reshape(T, -1)

    def run(self, ids, n_prompt, kq=None, vq=None, rot=True, mu=None, want_keys=False):
        """Log-softmax logits [T, vocab]; with want_keys, also the sums of the (rotated) keys per
        (layer, KV head) of the unquantized pass, over all positions and over the prompt's (a
        causal pass computes the prompt's keys as a pass over the prompt alone would)."""
        m, T = self.m, len(ids)
        x = m.embed[np.asarray(ids)]
        pos = np.arange(T)
        stored = (pos[:, None] >= n_prompt) | ((pos[None, :] // CHUNK) < (pos[:, None] // CHUNK))
        ksum = np.zeros((2, self.c.n_layers, self.c.n_kv_heads, self.c.head_dim))
        for l in range(self.c.n_layers):
            q, k, v = m.qkv(l, m.rmsnorm(x, m.layers[l]["rms_att"]), pos)
            if rot:
                q, k = q @ self.H.T, k @ self.H.T
            if want_keys:
                ksum[:, l] = k.sum(0), k[:n_prompt].sum(0)
            if mu is not None:
                k = k - mu[l][None]  # every key, so one query's logits share one offset
            x = m.attn_out_mlp(l, x, self._layer_attn(q, k, v, stored, kq, vq))
        z = m.logits(x)
        z = z - z.max(-1, keepdims=True)
        z = z - np.log(np.exp(z).sum(-1, keepdims=True))
        return (z, ksum[0], ksum[1]) if want_keys else z


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", help="comma-separated, e.g. none,int4,int4:c,int4:p")
    ap.add_argument("--golden", default=os.path.join(ROOT, "tests/data/fidelity/smollm2/golden.json"))
    ap.add_argument("--model", help="the GGUF (default: tools/smollm2.sh)")
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("--task", help="task records (gen.py --format hf) instead of --golden")
    ap.add_argument("--tokenizer", help="tokenizer.json for --task (gen.py --save-hf-tokenizer)")
    ap.add_argument("--lora", help="a PEFT LoRA adapter merged into the model")
    ap.add_argument("--calib", help="with --task: mode c takes mu from these records (gen.py "
                    "--format hf) instead of the other records of --task")
    a = ap.parse_args()
    path = a.model or subprocess.run(["bash", os.path.join(ROOT, "tools", "smollm2.sh")],
                                     capture_output=True, text=True, check=True).stdout.strip()
    m = evm.Model(path, np.float64, lora=a.lora)
    pr = Probe(m)
    mu_cal = None
    if a.task:
        import run as evr

        def records(path):  # (ids, n_prompt, name), tokenized as run.py and lfbench eval do
            items = evr.task_items(argparse.Namespace(task=path, tokenizer=a.tokenizer,
                                                      task_skip=0, task_n=sys.maxsize))
            return [(ids, n, name) for name, ids, n, _ in items]
        recs = records(a.task)
        seqs, names = [(ids, n) for ids, n, _ in recs], [x for _, _, x in recs]
        if a.calib:
            tot, cnt = 0.0, 0
            for ids, n, _ in records(a.calib):
                _, ks, _ = pr.run(ids, n, want_keys=True)
                tot, cnt = tot + ks, cnt + len(ids)
            mu_cal = tot / cnt
        # every position that predicts a completion token
        rows = [list(range(n - 1, len(ids) - 1)) for ids, n in seqs]
        top_ref = None
    else:
        g = json.load(open(a.golden))["prompts"]
        names = [p["name"] for p in g]
        seqs = [(p["prompt_ids"] + p["gen_ids"], len(p["prompt_ids"])) for p in g]
        rows = [[q for q in p["positions"] if q >= n - 1] for p, (_, n) in zip(g, seqs)]
        top_ref = [[t for q, t in zip(p["positions"], p["fp64_top1"]) if q >= n - 1]
                   for p, (_, n) in zip(g, seqs)]
    # the float64 pass (the reference) and each sequence's key sums (all, prompt), rotated and not
    ref, sums = [], {True: [], False: []}
    rots = (True, False) if "norot" in a.variants else (True,)
    for ids, n in seqs:
        for rot in rots:
            z, ks, kp = pr.run(ids, n, rot=rot, want_keys=True)
            sums[rot].append((ks, len(ids), kp))
            if rot:
                ref.append(z)
    if top_ref is None:
        top_ref = [list(z[r].argmax(-1)) for z, r in zip(ref, rows)]
    src = {"task": a.task, "lora": a.lora, "calib": a.calib} if a.task else {"golden": os.path.relpath(a.golden, ROOT)}
    res = {"model": os.path.basename(path), **src, "sequences": names, "variants": {}}
    for name in a.variants.split(","):
        spec, *mode = name.split(":")
        kq, vq = (spec.split("/") + [None])[:2]
        vq = vq or kq
        rot = "norot" not in mode
        agree = n_pos = wrong = 0
        kl = 0.0
        for i, (ids, n) in enumerate(seqs):
            mu = None
            if "c" in mode and mu_cal is not None:
                if not rot:
                    raise SystemExit("--calib: mode c with norot is not measured")
                mu = mu_cal
            elif "c" in mode:
                others = [s for j, s in enumerate(sums[rot]) if j != i]
                mu = sum(s[0] for s in others) / sum(s[1] for s in others)
            elif "p" in mode:
                mu = sums[rot][i][2] / n
            if kq == vq == "none" and mu is None and rot:
                z = ref[i][rows[i]]  # the reference pass itself
            else:
                z = pr.run(ids, n, kq, vq, rot, mu)[rows[i]]
            zr = ref[i][rows[i]]
            agree += int((z.argmax(-1) == np.array(top_ref[i])).sum())
            wrong += int((z.argmax(-1) != np.array([ids[t + 1] for t in rows[i]])).sum())
            kl += float((np.exp(zr) * (zr - z)).sum())
            n_pos += len(rows[i])
        res["variants"][name] = {"top1": agree / n_pos, "agree": agree, "positions": n_pos,
                                 "kl": kl / n_pos}
        if a.task:
            res["variants"][name].update(tf_wrong=wrong, tf_error=wrong / n_pos)
        print("%-14s top-1 as float64 %d/%d (%.2f%%), mean KL %.3e%s" % (
            name, agree, n_pos, 100.0 * agree / n_pos, kl / n_pos,
            ", token error %d (%.3f%%)" % (wrong, 100.0 * wrong / n_pos) if a.task else ""),
            flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

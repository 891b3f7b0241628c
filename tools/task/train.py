#!/usr/bin/env python3
"""Train a small Llama (GQA, RoPE, SwiGLU: transformers' LlamaForCausalLM, so the export is the
exact model our engine loads) on the `trace` task, and export it as a Hugging Face directory:
config.json + model.safetensors + tokenizer.json (+ tokenizer_config.json, task.json).

    # GPU (H200), about ten minutes:
    python tools/task/train.py --out out/trace-model --minutes 9
    # CPU smoke test, seconds:
    python tools/task/train.py --out /tmp/tm --tiny --max-steps 5

Training data are generated on the fly by tools/task/gen.py in worker processes, packed into
rows of --seq-len tokens (several problems per row, each with its own positions 0.. and attending
only to itself: transformers builds the block-diagonal mask from the position ids), with the loss
on the output only (trace, answer and <eos>), never on the prompt. bf16 autocast on the GPU, fp32
on the CPU. Reproducible: the data are a pure function of --seed and the problem index, the
initialisation of --seed; with a time budget the schedule's length is fixed after the first
steps and logged (a rerun with --max-steps that number repeats the run up to GPU
non-determinism). Checkpoints (model + optimizer + data position) every --ckpt-minutes into
OUT/ckpt; --resume continues from there.

Held-out evaluation (test split, outputs >= --eval-min-len tokens) is teacher-forced: a problem
counts as solved when the argmax at every output position is the target token, which is exactly
the condition for greedy decoding to reproduce the whole trace, so `tf_exact` is greedy exact-match
accuracy under full KV (up to numerics) without running generation.
"""
import argparse
import copy
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
    import inspect as _inspect
    _VARLEN_ARGS = set(_inspect.signature(varlen_attn).parameters)
except ImportError:
    varlen_attn, _VARLEN_ARGS = None, set()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen  # noqa: E402

IGNORE = -100


# ---------------------------------------------------------------------------------------------
# Data

_TASK_KW = None


def _set_task(task_kw):
    global _TASK_KW
    _TASK_KW = task_kw


def _init_worker(task_kw):
    """Pool processes only: one thread each (the main process keeps its threads for training)."""
    _set_task(task_kw)
    torch.set_num_threads(1)


def _round_start(output, k):
    """Index in `output` where round k+1 starts (the (k+1)-th '#'), or len(output)."""
    i = -1
    for _ in range(k + 1):
        i = output.find("#", i + 1)
        if i < 0:
            return len(output)
    return i


def _make_doc(args):
    """(split, seed, index, short_max, prefix_rounds, head_rounds) -> (ids int16 array, number
    of prompt tokens, end of the head: ids index after the first `head_rounds` output rounds).
    prefix_rounds > 0 keeps only the prompt and the first prefix_rounds rounds (no <eos>): a
    truncated document whose every label is still the true next token."""
    split, seed, index, short_max, prefix_rounds, head_rounds = args
    kw = dict(_TASK_KW)
    if short_max:
        kw["max_len"] = min(kw["max_len"], short_max)
        kw["min_len"] = min(kw["min_len"], kw["max_len"])
    p = gen.make_problem(gen.problem_seed(split, seed, index), **kw)
    out = p["output"]
    cut = _round_start(out, prefix_rounds) if prefix_rounds else len(out)
    ids = gen.encode(p["prompt"]) + gen.encode(out[:cut], bos=False) + \
        ([gen.EOS_ID] if cut == len(out) else [])
    head_end = p["prompt_tokens"] + (_round_start(out, head_rounds) if head_rounds else 0)
    return np.asarray(ids, dtype=np.int16), p["prompt_tokens"], min(head_end, len(ids))


def is_prefix_doc(index, frac):
    """Deterministic, evenly spread choice of the problems that become prefix documents."""
    return frac > 0 and (index * 0.6180339887498949) % 1.0 < frac


class Packer:
    """Deterministic stream of packed batches: problems in index order, placed first-fit into
    `rows` rows of `seq_len`; a problem that fits in no row starts the next batch. Padding is a
    pseudo-document of <pad> with labels ignored."""

    def __init__(self, pool, seed, seq_len, rows, start_index=0, short_first=0, short_max=1500,
                 prefix_frac=0.0, prefix_rounds=3, head_rounds=0, head_weight=1.0):
        self.pool, self.seed, self.seq_len, self.rows = pool, seed, seq_len, rows
        self.index = start_index
        self.short_first, self.short_max = short_first, short_max
        self.prefix_frac, self.prefix_rounds = prefix_frac, prefix_rounds
        self.head_rounds, self.head_weight = head_rounds, head_weight
        self.pending = None
        self.skipped = 0
        self.it = None
        self._restart()

    def _restart(self):
        def jobs(i):
            while True:
                yield ("train", self.seed, i, self.short_max if i < self.short_first else 0,
                       self.prefix_rounds if is_prefix_doc(i, self.prefix_frac) else 0,
                       self.head_rounds)
                i += 1
        self.it = self.pool.imap(_make_doc, jobs(self.index), chunksize=8) if self.pool else \
            map(_make_doc, jobs(self.index))
        self.consumed = self.index

    def _next_doc(self):
        doc = next(self.it)
        self.consumed += 1
        return doc

    def next_batch(self):
        """-> input_ids, position_ids, labels (int64 [rows, seq_len]), loss weights (float32
        [rows, seq_len]: 0 where no label, --head-weight on the first rounds' labels, else 1),
        number of problems."""
        rows = [[] for _ in range(self.rows)]
        fill = [0] * self.rows
        n = 0
        while True:
            doc = self.pending if self.pending is not None else self._next_doc()
            self.pending = None
            ids = doc[0]
            if len(ids) > self.seq_len:
                self.skipped += 1
                continue
            r = next((r for r in range(self.rows) if fill[r] + len(ids) <= self.seq_len), None)
            if r is None:
                self.pending = doc
                break
            rows[r].append(doc)
            fill[r] += len(ids)
            n += 1
        inp = np.zeros((self.rows, self.seq_len), np.int64)
        pos = np.zeros((self.rows, self.seq_len), np.int64)
        lab = np.full((self.rows, self.seq_len), IGNORE, np.int64)
        wt = np.zeros((self.rows, self.seq_len), np.float32)
        for r, docs in enumerate(rows):
            o = 0
            for ids, n_prompt, head_end in docs:
                L = len(ids)
                inp[r, o:o + L] = ids
                pos[r, o:o + L] = np.arange(L)
                lab[r, o + n_prompt:o + L] = ids[n_prompt:]
                wt[r, o + n_prompt:o + L] = 1.0
                wt[r, o + n_prompt:o + head_end] = self.head_weight
                o += L
            pos[r, o:] = np.arange(self.seq_len - o)  # padding: its own pseudo-document
        # the data position to resume from: the first problem not yet in a batch
        self.index = self.consumed - (1 if self.pending is not None else 0)
        return (torch.from_numpy(inp), torch.from_numpy(pos), torch.from_numpy(lab),
                torch.from_numpy(wt), n)


def heldout(n, seed, task_kw, min_len):
    kw = dict(task_kw)
    kw["min_len"] = max(kw["min_len"], min_len)
    kw["max_len"] = max(kw["max_len"], kw["min_len"])
    return list(gen.problems(n, "test", seed, **kw))


# ---------------------------------------------------------------------------------------------
# Model

def build_config(args):
    import transformers
    return transformers.LlamaConfig(
        vocab_size=gen.VOCAB_SIZE, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_pos, rms_norm_eps=1e-5,
        tie_word_embeddings=args.tie, bos_token_id=gen.BOS_ID, eos_token_id=gen.EOS_ID,
        pad_token_id=gen.PAD_ID, attention_bias=False, mlp_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        use_cache=False)


def doc_bounds(position_ids):
    """Packed documents of a [rows, L] position-id tensor (a document starts where the positions
    do not continue; rows never share one) -> (cu_seqlens int32 [docs + 1] over the flattened
    rows, on the CPU; longest document). Compute it on the CPU copy of the batch and pass it to
    the model as `packed_docs=`: read from a GPU tensor it costs a synchronization per layer."""
    pos = position_ids.detach().cpu()
    B, L = pos.shape
    starts = torch.ones(B, L, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    first = torch.nonzero(starts.flatten()).flatten()
    cu = torch.cat([first, torch.tensor([B * L])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     position_ids=None, packed_docs=None, **kwargs):
    """transformers attention function (registered as "varlen"): causal attention within each
    packed document, the documents found where the position ids restart (or given as
    `packed_docs`, from doc_bounds()), instead of one masked attention over the whole row. Same
    result as "sdpa" with the packed mask (the packing check compares), but no work on the
    masked-out blocks. On CUDA one variable-length flash-attention call covers all the rows; on
    the CPU it is causal SDPA per document (~5x faster than the masked row at 1 x 8704). Without
    position ids (evaluation, generation) or with an explicit mask it is plain "sdpa"."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    B, H, L, D = query.shape
    cu, longest = packed_docs if packed_docs is not None else doc_bounds(position_ids)
    groups = H // key.shape[1]
    if query.is_cuda and varlen_attn is not None and (
            torch.is_autocast_enabled("cuda") or value.dtype in (torch.bfloat16, torch.float16)):
        # (B, H, L, D) -> (B*L, H, D); flash attention wants one 16-bit dtype (RoPE in float32
        # hidden states promotes q and k)
        dt = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else \
            value.dtype
        q, k, v = (x.transpose(1, 2).reshape(B * L, x.shape[1], D).to(dt)
                   for x in (query, key, value))
        cu_d = cu.to(query.device, non_blocking=True)
        kw = {"scale": scaling}
        if "window_size" in _VARLEN_ARGS:
            kw["window_size"] = (-1, 0)  # causal
        else:
            kw["is_causal"] = True
        if groups > 1:
            if "enable_gqa" in _VARLEN_ARGS:
                kw["enable_gqa"] = True
            else:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        with sdpa_kernel(VARLEN_BACKENDS):
            out = varlen_attn(q, k, v, cu_d, cu_d, longest, longest, **kw)
        return out.reshape(B, L, H, D), None
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    q, k, v = (x.transpose(0, 1).reshape(x.shape[1], B * L, D) for x in (query, key, value))
    cuts = cu.tolist()
    out = torch.cat([F.scaled_dot_product_attention(
        q[None, :, s:e], k[None, :, s:e], v[None, :, s:e], dropout_p=dropout, is_causal=True,
        scale=scaling)[0] for s, e in zip(cuts, cuts[1:])], dim=1)
    return out.reshape(H, B, L, D).permute(1, 2, 0, 3).contiguous(), None


# Measured on the H200 (torch 2.11, SmolLM2-135M-shaped LoRA training, rows of 4 x 8192, new
# packed batches every step): one flash varlen call 80-88k tokens/s, cuDNN varlen 87k, causal SDPA
# per document with the default backends 14.8k (and 7.5k when the bounds were read from the GPU in
# every layer). Flash has no per-shape plan to build.
VARLEN_BACKENDS = [SDPBackend.FLASH_ATTENTION]


def register_varlen():
    from transformers import AttentionInterface
    AttentionInterface.register("varlen", varlen_attention)


def lr_at(step, total, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def evaluate(model, probs, device, amp, batch=8, head_rounds=3):
    """Teacher-forced: per-token accuracy on outputs, and the share of problems whose every
    output token is the argmax (= greedy reproduces the trace). Also the wrong tokens, in all
    and within the first `head_rounds` output rounds (the rounds copied from the prompt, where
    the first model's errors were)."""
    model.eval()
    exact = ans_ok = tok_ok = tok_n = head_ok = wrong = wrong_head = 0
    firsts = []
    for b in range(0, len(probs), batch):
        chunk = probs[b:b + batch]
        seqs = [gen.encode(p["prompt"]) + gen.encode(p["output"], bos=False) + [gen.EOS_ID]
                for p in chunk]
        L = max(map(len, seqs))
        inp = torch.zeros((len(seqs), L), dtype=torch.long)
        for i, s in enumerate(seqs):
            inp[i, :len(s)] = torch.tensor(s)
        inp = inp.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(input_ids=inp).logits
        pred = logits.argmax(-1).cpu()
        for i, (p, s) in enumerate(zip(chunk, seqs)):
            n_p = p["prompt_tokens"]
            want = torch.tensor(s[n_p:])
            got = pred[i, n_p - 1:len(s) - 1]
            ok = got == want
            tok_ok += int(ok.sum())
            tok_n += len(want)
            bad = (~ok).nonzero()
            exact += int(len(bad) == 0)
            firsts.append(int(bad[0]) if len(bad) else len(want))
            a = p["output"].rindex("ans ")  # answer tokens: output index a .. end
            ans_ok += int(ok[a:].all())
            h = _round_start(p["output"], head_rounds)
            head_ok += int(ok[:h].all())
            wrong += len(bad)
            wrong_head += int((~ok[:h]).sum())
    model.train()
    n = len(probs)
    return {"tf_exact": exact / n, "tf_answer_tokens_ok": ans_ok / n,
            "tf_token_acc": tok_ok / max(1, tok_n),
            "median_first_error": sorted(firsts)[n // 2] if n else 0,
            f"tf_first{head_rounds}_rounds_ok": head_ok / n,
            "wrong_tokens": wrong, f"wrong_in_first{head_rounds}_rounds": wrong_head}


# Tolerance of the packing check, relative to the logit scale (the largest |logit| of the
# separate runs). Measured on CPU, 1500-token row of 2 problems + padding, sdpa and eager: the
# rounding noise is < 1e-6 in fp32, ~7e-4 on the GPU's fp32 with TF32 matmuls (the 0.0206 on
# logits of ~29 that failed the former absolute 1e-3 test) and 3.5e-3 to 5.3e-3 under bf16
# autocast, for fresh and for trained (.perf/trace-model-init) weights alike, never changing an
# argmax; attention that ignores the packing (each problem also sees the ones before it in the
# row) gives 0.7 to 1.4, with 550-620 of the 1500 argmaxes changed. 0.1 leaves ~20x headroom
# for noisier GPU kernels and is still ~7x below the smallest leak seen. Independently, at most
# 1% of the argmaxes may differ (rounding can only flip near-ties; a leak flipped over 35%).
PACK_REL_TOL = 0.1
PACK_MAX_FLIPS = 0.01


@torch.no_grad()
def check_packing(model, task_kw, device, amp=False):
    """The packed row's logits must equal each problem's own, up to rounding: proof that
    problems in a row do not see each other and restart their positions. Run in the training
    precision (bf16 autocast when `amp`); differences are judged relative to the logit scale,
    since a trained model's logits are large (rounding grows with them) and a leak across
    problems changes logits by about their own size. The argmax disagreements are reported
    too and may differ at no more than 1% of the positions (a leak changes many; rounding can
    only flip near-ties)."""
    model.eval()
    kw = dict(task_kw, min_len=200, max_len=400)
    _set_task(kw)
    inp, pos, _, _, n = Packer(None, 12345, 1500, 1).next_batch()
    inp, pos = inp.to(device), pos.to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
        packed = model(input_ids=inp, position_ids=pos, use_cache=False).logits[0].float()
        starts = [0] + [i + 1 for i in range(inp.shape[1] - 1) if pos[0, i + 1] != pos[0, i] + 1]
        worst = scale = 0.0
        flips = 0
        for a, b in zip(starts, starts[1:] + [inp.shape[1]]):
            own = model(input_ids=inp[:, a:b], use_cache=False).logits[0].float()
            worst = max(worst, float((own - packed[a:b]).abs().max()))
            scale = max(scale, float(own.abs().max()))
            flips += int((own.argmax(-1) != packed[a:b].argmax(-1)).sum())
    model.train()
    rel = worst / max(scale, 1e-6)
    what = (f"max |packed - separate| {worst:.3g} = {rel:.2e} of the logit scale {scale:.3g} "
            f"({'bf16 autocast' if amp else 'fp32'}), argmax differs at {flips} of "
            f"{inp.shape[1]} positions")
    if not rel <= PACK_REL_TOL or flips > PACK_MAX_FLIPS * inp.shape[1]:  # NaN fails too
        raise SystemExit(f"packing check failed: {what}; tolerance {PACK_REL_TOL} of the scale, "
                         f"{PACK_MAX_FLIPS:.0%} of the argmaxes (attention implementation "
                         f"ignores packed position ids?)")
    print(f"packing check ok: {n} problems + padding in one row, {what}", flush=True)


def export(model, args, out, log):
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.export_dtype]
    m = copy.deepcopy(model._orig_mod if hasattr(model, "_orig_mod") else model)
    m.config.use_cache = True
    m.to("cpu", dtype).save_pretrained(tmp, safe_serialization=True)
    del m
    gc = os.path.join(tmp, "generation_config.json")
    if os.path.exists(gc):
        os.remove(gc)
    gen.write_tokenizer(os.path.join(tmp, "tokenizer.json"))
    with open(os.path.join(tmp, "task.json"), "w") as f:
        json.dump({"task": "trace", "generator": "tools/task/gen.py", "task_args": log["task"],
                   "train": {k: v for k, v in log.items() if k != "task"}}, f, indent=1)
        f.write("\n")
    # swap in place (keep ckpt/ if it lives under out)
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(tmp):
        os.replace(os.path.join(tmp, name), os.path.join(out, name))
    shutil.rmtree(tmp)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="export directory")
    ap.add_argument("--ckpt", help="checkpoint directory (default OUT/ckpt)")
    ap.add_argument("--resume", action="store_true", help="continue from CKPT/last.pt")
    ap.add_argument("--init-from", help="start from an exported model directory's weights")
    ap.add_argument("--minutes", type=float, default=0, help="wall-clock budget for training")
    ap.add_argument("--max-steps", type=int, default=0, help="optimizer steps (fixes the schedule)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "varlen", "flex_attention", "eager"],
                    help="varlen: causal SDPA per packed problem, no masked blocks (best on the CPU)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU smoke-test sizes: 2 layers, hidden 64, rows of 2 x 2048, short tasks")
    m = ap.add_argument_group("model")
    m.add_argument("--hidden", type=int, default=256)
    m.add_argument("--layers", type=int, default=6)
    m.add_argument("--heads", type=int, default=8)
    m.add_argument("--kv-heads", type=int, default=2)
    m.add_argument("--intermediate", type=int, default=768)
    m.add_argument("--rope-theta", type=float, default=10000.0)
    m.add_argument("--max-pos", type=int, default=10240)
    m.add_argument("--tie", action="store_true", help="tie input and output embeddings")
    d = ap.add_argument_group("data")
    gen.add_task_args(ap)
    d.add_argument("--seq-len", type=int, default=8704, help="packed row length")
    d.add_argument("--rows", type=int, default=16, help="rows per optimizer step")
    d.add_argument("--workers", type=int, default=max(1, min(4, (os.cpu_count() or 2) - 1)),
                   help="data-generating processes (one makes ~8M tokens/s)")
    d.add_argument("--short-first", type=int, default=None,
                   help="the first N problems have outputs of at most --short-max tokens "
                   "(default 20000, 0 with --init-from)")
    d.add_argument("--short-max", type=int, default=1500)
    d.add_argument("--prefix-frac", type=float, default=0.0,
                   help="share of problems (by count) cut after their first --prefix-rounds "
                   "rounds: many more prompt-to-trace copies per step (the first model's errors "
                   "were the operators of round 1, copied from the prompt)")
    d.add_argument("--prefix-rounds", type=int, default=3)
    d.add_argument("--head-rounds", type=int, default=3,
                   help="the first N output rounds get loss weight --head-weight (and are "
                   "reported apart in the evals)")
    d.add_argument("--head-weight", type=float, default=1.0,
                   help="loss weight of the first --head-rounds rounds' tokens (others 1; the "
                   "loss is the weighted mean)")
    o = ap.add_argument_group("optimizer")
    o.add_argument("--lr", type=float, default=2e-3)
    o.add_argument("--min-lr-frac", type=float, default=0.05)
    o.add_argument("--warmup", type=int, default=50)
    o.add_argument("--wd", type=float, default=0.05)
    o.add_argument("--clip", type=float, default=1.0)
    e = ap.add_argument_group("logging and export")
    e.add_argument("--log-every", type=int, default=10)
    e.add_argument("--eval-every", type=int, default=200, help="steps between held-out evals")
    e.add_argument("--eval-n", type=int, default=32, help="held-out problems per eval")
    e.add_argument("--eval-min-len", type=int, default=2000)
    e.add_argument("--final-eval-n", type=int, default=128)
    e.add_argument("--ckpt-minutes", type=float, default=3.0)
    e.add_argument("--export-dtype", default="bf16", choices=["bf16", "fp32"])
    args = ap.parse_args()
    if args.tiny:
        args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate = 64, 2, 4, 2, 128
        args.seq_len, args.rows, args.min_len, args.max_len = 2048, 2, 300, 1500
        args.max_pos, args.short_first, args.eval_n, args.final_eval_n = 2048, 0, 4, 4
        args.eval_min_len, args.workers, args.warmup = 600, 1, 2
    if args.short_first is None:
        args.short_first = 0 if args.init_from else 20000
    if args.init_from:
        # the architecture is the exported model's, whatever the model options say
        with open(os.path.join(args.init_from, "config.json")) as f:
            c = json.load(f)
        args.hidden, args.layers = c["hidden_size"], c["num_hidden_layers"]
        args.heads, args.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        args.intermediate, args.max_pos = c["intermediate_size"], c["max_position_embeddings"]
        args.rope_theta = float((c.get("rope_parameters") or {}).get("rope_theta") or
                                c.get("rope_theta", args.rope_theta))
        args.tie = bool(c.get("tie_word_embeddings", False))
        if c.get("head_dim", args.hidden // args.heads) != args.hidden // args.heads:
            raise SystemExit(f"--init-from {args.init_from}: head_dim {c['head_dim']} is not "
                             f"hidden / heads")
    if not args.minutes and not args.max_steps:
        ap.error("give --minutes or --max-steps")
    task_kw = gen.gen_kwargs(args)
    ckpt_dir = args.ckpt or os.path.join(args.out, "ckpt")
    os.makedirs(ckpt_dir, exist_ok=True)

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    amp = device.type == "cuda"
    if amp:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    import transformers
    cfg = build_config(args)
    if args.attn == "varlen":
        register_varlen()
    cfg._attn_implementation = args.attn
    model = transformers.LlamaForCausalLM(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")
    step, data_index, total = 0, 0, args.max_steps
    history = []
    if args.init_from:
        # continue from an exported model (weights only: a fresh optimizer and schedule), e.g.
        # one trained in an earlier GPU session whose checkpoint directory is gone
        from safetensors.torch import load_file
        sd = load_file(os.path.join(args.init_from, "model.safetensors"))
        missing, unexpected = model.load_state_dict({k: v.float() for k, v in sd.items()},
                                                    strict=False)
        missing = [k for k in missing if k != "lm_head.weight" or not cfg.tie_word_embeddings]
        if missing or unexpected:
            raise SystemExit(f"--init-from {args.init_from}: missing {missing}, "
                             f"unexpected {unexpected}")
        print(f"initialised from {args.init_from}", flush=True)
    if args.resume and os.path.exists(os.path.join(ckpt_dir, "last.pt")):
        ck = torch.load(os.path.join(ckpt_dir, "last.pt"), map_location=device, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, data_index, history = ck["step"], ck["data_index"], ck["history"]
        total = args.max_steps or ck["total"]
        print(f"resumed at step {step}, problem {data_index}")
    fwd = torch.compile(model) if args.compile else model

    print(f"model: {n_params / 1e6:.2f} M parameters, {args.layers} layers, hidden {args.hidden}, "
          f"{args.heads}/{args.kv_heads} heads, vocab {gen.VOCAB_SIZE}; device {device}, "
          f"attention {args.attn}, rows {args.rows} x {args.seq_len}", flush=True)
    if not args.resume:
        check_packing(model, task_kw, device, amp)
    held = heldout(args.eval_n, args.seed, task_kw, args.eval_min_len)
    pool = mp.get_context("fork").Pool(args.workers, _init_worker, (task_kw,)) \
        if args.workers > 1 else None
    if pool is None:
        _set_task(task_kw)
    pk_kw = dict(short_first=args.short_first, short_max=args.short_max,
                 prefix_frac=args.prefix_frac, prefix_rounds=args.prefix_rounds,
                 head_rounds=args.head_rounds, head_weight=args.head_weight)
    packer = Packer(pool, args.seed, args.seq_len, args.rows, data_index, **pk_kw)
    log = {"task": {**task_kw, "periods": list(task_kw["periods"])}, "args": vars(args),
           "params": n_params, "device": str(device)}

    t_start = time.time()
    t_10 = t_start
    t_ckpt = t_start
    t_data = 0.0
    tokens = labeled = 0
    budget_s = args.minutes * 60 if args.minutes else float("inf")
    model.train()
    while True:
        if total and step >= total:
            break
        if time.time() - t_start > budget_s:
            print(f"time budget reached at step {step}")
            break
        t0 = time.time()
        inp, pos, lab, wt, n_docs = packer.next_batch()
        t_data += time.time() - t0
        extra = {"packed_docs": doc_bounds(pos)} if args.attn == "varlen" else {}
        inp, pos, lab, wt = (x.to(device, non_blocking=True) for x in (inp, pos, lab, wt))
        lr = lr_at(step, total or 10 ** 9, args)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        try:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                logits = fwd(input_ids=inp, position_ids=pos, use_cache=False, **extra).logits
            # labels[t] is predicted at t-1
            ce = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                 lab[:, 1:].reshape(-1), ignore_index=IGNORE, reduction="none")
            w = wt[:, 1:].reshape(-1)
            loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
            loss.backward()
        except torch.cuda.OutOfMemoryError:
            if step > 0 or args.rows == 1:
                raise
            # first step only: halve the rows and start the data over (logged)
            logits = loss = None
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            args.rows //= 2
            print(f"out of memory at the first step: --rows {args.rows}", flush=True)
            packer = Packer(pool, args.seed, args.seq_len, args.rows, data_index, **pk_kw)
            continue
        if step == 0 and amp:
            print(f"first step: peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} "
                  f"GiB", flush=True)
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        tokens += inp.numel()
        labeled += int((lab != IGNORE).sum())
        if not total and args.minutes and step == 10:
            t_10 = time.time()
        if not total and args.minutes and step == 30:
            # fix the schedule at the speed of steps 11..30: the first steps carry warm-up
            # (allocator, kernel selection) and made an earlier estimate ~1.5x too pessimistic
            now = time.time()
            per_step = (now - t_10) / 20
            total = max(step + 1, step + int((budget_s - (now - t_start)) / per_step * 0.97))
            print(f"schedule fixed: {total} steps ({per_step:.3f} s/step); rerun with "
                  f"--max-steps {total} to repeat", flush=True)
        if step % args.log_every == 0 or step == 1:
            el = time.time() - t_start
            with torch.no_grad():
                m = lab[:, 1:] != IGNORE
                acc = float((logits[:, :-1].argmax(-1) == lab[:, 1:])[m].float().mean())
            rec = {"step": step, "loss": round(float(loss.detach()), 5), "tok_acc": round(acc, 5),
                   "lr": lr, "gnorm": round(float(gnorm), 3), "elapsed_s": round(el, 1),
                   "tokens": tokens, "problems": packer.index, "docs_in_batch": n_docs}
            history.append(rec)
            print(f"step {step:6d}/{total or '?'} loss {float(loss.detach()):.4f} acc {acc:.4f} "
                  f"lr {lr:.2e} gnorm {float(gnorm):.2f} | {tokens / el / 1e3:.0f}k tok/s "
                  f"({labeled / max(1, tokens):.0%} labeled), data {t_data / el:.0%} of time, "
                  f"{el:.0f}s", flush=True)
        if args.eval_every and step % args.eval_every == 0:
            r = evaluate(model, held, device, amp, head_rounds=args.head_rounds)
            history.append({"step": step, "eval": r})
            print(f"eval @ {step}: {json.dumps(r)}", flush=True)
        if time.time() - t_ckpt > args.ckpt_minutes * 60:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                        "data_index": packer.index, "total": total, "history": history,
                        "args": vars(args)}, os.path.join(ckpt_dir, "last.pt.tmp"))
            os.replace(os.path.join(ckpt_dir, "last.pt.tmp"), os.path.join(ckpt_dir, "last.pt"))
            # a usable export too, in case the run is killed before the end
            export(model, args, args.out, {**{k: v for k, v in log.items()}, "steps": step,
                                           "partial": True})
            t_ckpt = time.time()
    train_s = time.time() - t_start
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                "data_index": packer.index, "total": total, "history": history,
                "args": vars(args)}, os.path.join(ckpt_dir, "last.pt"))
    if pool:
        pool.terminate()
    final = evaluate(model, heldout(args.final_eval_n, args.seed + 1000, task_kw,
                                    args.eval_min_len), device, amp,
                     head_rounds=args.head_rounds)
    print(f"final held-out eval ({args.final_eval_n} problems, outputs >= {args.eval_min_len} "
          f"tokens, teacher-forced): {json.dumps(final)}", flush=True)
    log.update({"steps": step, "schedule_steps": total, "train_seconds": round(train_s, 1),
                "tokens": tokens, "skipped_too_long": packer.skipped, "final_eval": final,
                "history": history})
    with open(os.path.join(ckpt_dir, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    export(model, args, args.out, {k: v for k, v in log.items() if k != "history"})
    print(f"exported {args.out}: " + ", ".join(
        f"{n} ({os.path.getsize(os.path.join(args.out, n))} B)" for n in sorted(os.listdir(args.out))
        if os.path.isfile(os.path.join(args.out, n))))


if __name__ == "__main__":
    main()

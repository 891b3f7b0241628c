#!/usr/bin/env python3
"""Makes the fidelity suite's models and golden logits (tests/data/fidelity).

Four tiny random-weight Hugging Face models whose attention is SHARP: after a random init the
q_proj / k_proj weights (and q/k biases; with qwen3's q/k RMSNorm, which would normalise that
away, the q_norm / k_norm gains) are scaled by Q_K_SCALE, so attention logits are large and
every head attends to a few content-chosen positions, as in trained models. Diffuse random
attention (near-uniform averages) hides RoPE, position and attention bugs; sharp attention does
not. The script checks and prints how sharp it is (mean over query positions of the largest
attention probability, per head) and fails if fewer than half the heads exceed SHARP_MIN.

For each model and prompt length (PROMPT_LENS) it writes one golden file: the prompt (random
tokens with copied segments), the float64 reference's own greedy continuation (N_DECODE tokens),
the float64 logits at every position the C++ tests can observe when they feed the prompt in
chunks of CHUNK tokens and then the continuation one token at a time (each chunk's last position,
then the last prompt position and every decode position), and the top-1 ids of transformers
run in bfloat16 on the same teacher-forced sequence at those positions.

Weights are stored in bf16; the float64 reference runs on exactly those values upcast (loaded
fresh with dtype=torch.float64, never cast with .to(): that would also cast the rotary inv_freq
buffer; the script asserts inv_freq equals the formula).

    python3 tools/fidelity/make_golden.py [--out tests/data/fidelity]

Needs torch, transformers (>= 5: rope_parameters, dtype=), safetensors, numpy. Deterministic.

Golden file format (little endian), <model>/golden_p<P>.bin:
    char     magic[8] = "LFFIDEL1"
    int32    version (1), n_tokens, prompt_len, n_checked, vocab
    int32    tokens[n_tokens]          prompt then continuation
    int32    checked_pos[n_checked]    ascending
    float32  logits[n_checked][vocab]  float64 reference rounded to float32
    int32    bf16_top1[n_checked]      transformers bfloat16 argmax at the same positions
The script also writes README.md there (how the data was made, versions, per-case numbers).
"""
import argparse
import json
import math
import os
import shutil
import struct
import sys

import numpy as np
import torch
import transformers

PROMPT_LENS = [1, 40, 600, 1500, 4200]
N_DECODE = 24
CHUNK = 512
Q_K_SCALE = 3.5
SHARP_MIN = 0.3
TIED_OUT_SCALE = 3.0
TIED_EMBED_STD = 0.5
BOS, EOS = 1, 2
MAGIC = b"LFFIDEL1"
VERSION = 1
VOCAB = 512
MAX_POS = 8192
SEED = 20250


def model_specs():
    """(name, config) of the four models."""
    common = dict(vocab_size=VOCAB, max_position_embeddings=MAX_POS, bos_token_id=BOS,
                  eos_token_id=EOS)
    return [
        # (a) Llama-3 rope scaling that matters at our lengths, GQA 4/2, head_dim 64
        ("llama3_gqa", transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 256}, **common)),
        # (b) plain rope, head_dim 128 (two query heads of 128 over hidden 64, MQA)
        ("llama_hd128", transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=128, rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)),
        # (c) qwen2: q/k/v biases, tied embeddings, head_dim 64 (= hidden / heads)
        ("qwen2_bias", transformers.Qwen2Config(
            hidden_size=128, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **common)),
        # (d) qwen3: q/k norm, head_dim 128 != hidden / heads (64 / 2)
        ("qwen3_qknorm", transformers.Qwen3Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=128, rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **common)),
    ]


def randomize(model, gen, cfg):
    """A realistic spread (logits far from uniform), then sharp attention: q/k weights and
    biases scaled by Q_K_SCALE. With q/k norm (qwen3) the projections' scale is normalised away,
    so there the q_norm / k_norm gains are scaled instead. With tied embeddings the logits of
    the last token's own embedding dominate (greedy repeats the input token) unless the blocks'
    outputs outweigh the embedding in the residual stream: o_proj / down_proj are scaled up and
    the embedding down."""
    qk_norm = getattr(cfg, "model_type", "") == "qwen3"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            elif "embed_tokens" in name or "lm_head" in name:
                sd = TIED_EMBED_STD if cfg.tie_word_embeddings else 1.0
                p.copy_(sd * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) / fan_in ** 0.5)
            if qk_norm:
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.mul_(Q_K_SCALE)
            elif ".q_proj." in name or ".k_proj." in name:
                p.mul_(Q_K_SCALE)
            if cfg.tie_word_embeddings and (".o_proj." in name or ".down_proj." in name):
                p.mul_(TIED_OUT_SCALE)


def expected_inv_freq(cfg):
    """The rotary inverse frequencies in float64 (the formula, llama3 scaling included)."""
    rp = cfg.rope_parameters
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    theta = float(rp["rope_theta"])
    out = []
    for i in range(0, hd, 2):
        f = 1.0 / theta ** (i / hd)
        if rp.get("rope_type", "default") == "llama3":
            old = float(rp["original_max_position_embeddings"])
            lo, hi, fac = float(rp["low_freq_factor"]), float(rp["high_freq_factor"]), \
                float(rp["factor"])
            wl = 2 * math.pi / f
            if wl > old / lo:
                f = f / fac
            elif wl >= old / hi:
                s = (old / wl - lo) / (hi - lo)
                f = (1 - s) * f / fac + s * f
        out.append(f)
    return np.array(out, dtype=np.float64)


def check_rotary(model, cfg, what):
    """Every rotary module's inv_freq must equal the formula to float32 rounding (a few ulp),
    held in float32: a bf16 round trip (the .to(dtype) pitfall) is off by ~1e-3 relative."""
    want = expected_inv_freq(cfg)
    found = 0
    for name, buf in model.named_buffers():
        if not name.endswith("inv_freq"):
            continue
        found += 1
        got = buf.detach().cpu().to(torch.float64).numpy()
        if got.shape != want.shape:
            sys.exit(f"{what}: {name} has shape {got.shape}, expected {want.shape}")
        rel = np.max(np.abs(got - want) / want)
        if rel > 1e-6 or buf.dtype not in (torch.float32, torch.float64):
            sys.exit(f"{what}: {name} ({buf.dtype}) differs from the rope formula by {rel:.3g} "
                     "relative: the reference would rotate wrongly at long positions")
    if not found:
        sys.exit(f"{what}: no rotary inv_freq buffer found")


def load(out, dtype):
    # transformers >= 5 spells it dtype=; older ones torch_dtype=.
    try:
        m = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=dtype,
                                                              attn_implementation="eager")
    except TypeError:
        m = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=dtype,
                                                              attn_implementation="eager")
    m.eval()
    for p in m.parameters():
        assert p.dtype == dtype, (p.dtype, dtype)
    return m


def make_prompt(n, rng):
    """Random ids in [3, VOCAB) (never BOS/EOS after the first) with structure: segments of 4-24
    tokens, about half of them copies of an earlier stretch, so content-based sharp attention
    has repeated material to find. Starts with BOS."""
    if n == 1:
        return [BOS]
    toks = [BOS]
    while len(toks) < n:
        seg = int(rng.integers(4, 25))
        if len(toks) > 30 and rng.random() < 0.5:
            start = int(rng.integers(1, len(toks) - seg)) if len(toks) - seg > 1 else 1
            toks.extend(toks[start:start + seg])
        else:
            toks.extend(int(x) for x in rng.integers(3, VOCAB, size=seg))
    return toks[:n]


def sharpness(model, ids):
    """Per (layer, head): mean over query positions >= 16 of the max attention probability."""
    with torch.no_grad():
        o = model(torch.tensor([ids]), output_attentions=True)
    rows = []
    for a in o.attentions:  # [1, H, T, T]
        rows.append(a[0, :, 16:, :].max(dim=-1).values.mean(dim=-1).tolist())
    return rows


def greedy(model, prompt, n):
    """float64 greedy continuation, with the KV cache."""
    with torch.no_grad():
        o = model(torch.tensor([prompt]), use_cache=True)
        past = o.past_key_values
        nxt = int(torch.argmax(o.logits[0, -1]))
        out = [nxt]
        for _ in range(n - 1):
            o = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past = o.past_key_values
            nxt = int(torch.argmax(o.logits[0, -1]))
            out.append(nxt)
    return out


def checked_positions(p, d):
    pos = [e for e in range(CHUNK - 1, p - 1, CHUNK)]
    pos += list(range(p - 1, p + d - 1))
    return pos


def write_golden(path, tokens, p, pos, logits, bf16_top1):
    n, v = logits.shape
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<5i", VERSION, len(tokens), p, n, v))
        f.write(np.asarray(tokens, dtype="<i4").tobytes())
        f.write(np.asarray(pos, dtype="<i4").tobytes())
        f.write(np.asarray(logits, dtype="<f4").tobytes())
        f.write(np.asarray(bf16_top1, dtype="<i4").tobytes())


def write_readme(out, summary, seed):
    sharp = "\n".join(f"- {x}" for k, x in summary if k == "sharp")
    cases = "\n".join(x for k, x in summary if k == "case")
    text = f"""# Fidelity suite data (generated: do not edit)

Made by

    python3 tools/fidelity/make_golden.py --out tests/data/fidelity --seed {seed}

with transformers {transformers.__version__}, torch {torch.__version__}, numpy {np.__version__}
(CPU, eager attention). The script is deterministic; its docstring describes the file format.

Four tiny random-weight models (vocab {VOCAB}, max_position_embeddings {MAX_POS}), weights
stored in bf16, attention made sharp by scaling q_proj / k_proj (and q/k biases; for qwen3 the
q_norm / k_norm gains) by {Q_K_SCALE} after the random init:

- `llama3_gqa`: llama, Llama-3 rope scaling (original_max_position_embeddings 256, factor 8),
  4 query / 2 KV heads, head_dim 64, hidden 64, 2 layers.
- `llama_hd128`: llama, plain rope (theta 1e4), 2 query / 1 KV heads, head_dim 128, hidden 64.
- `qwen2_bias`: qwen2, q/k/v biases, tied embeddings, 2 / 1 heads, head_dim 64, hidden 128.
- `qwen3_qknorm`: qwen3, q/k RMSNorm, 2 / 1 heads, head_dim 128 (hidden 64).

Sharpness (mean over query positions of the largest attention probability, per head, on the
600-token prompt):

{sharp}

Per model and prompt length P (prompt of random ids with copied segments, BOS first, then the
float64 model's own {N_DECODE} greedy tokens), `golden_p<P>.bin` holds the float64 logits at the
positions the tests observe (each {CHUNK}-token prefill chunk's last position, the last prompt
position, every decode position) and transformers-bf16's top-1 there (teacher forced):

| model | P | positions | mean logit std | min top-2 gap (std) | bf16 top-1 = fp64 |
|---|---|---|---|---|---|
{cases}

Used by tests/test_fidelity.cpp (cpu backend vs float64), tests/gpu_fidelity.cpp (cuda backend
top-1 vs float64 and vs transformers-bf16) and tests/mpi_tp.cpp (tensor parallel on CPU ranks).
"""
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "..", "..", "tests", "data", "fidelity"))
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    os.makedirs(args.out, exist_ok=True)
    summary = []
    for mi, (name, cfg) in enumerate(model_specs()):
        gen = torch.Generator().manual_seed(args.seed + 101 * mi)
        cfg._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float64)
        randomize(model, gen, cfg)
        out = os.path.join(args.out, name)
        shutil.rmtree(out, ignore_errors=True)
        # Saving in bf16: the parameters are rounded to bf16 here, and the reference below is
        # loaded fresh from these files (no .to(dtype) on a model whose buffers matter).
        sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
        model.save_pretrained(out, safe_serialization=True, state_dict=sd)
        for extra in ("generation_config.json",):
            if os.path.exists(os.path.join(out, extra)):
                os.remove(os.path.join(out, extra))
        with open(os.path.join(out, "config.json")) as f:
            saved_cfg = json.load(f)
        saved_cfg["dtype"] = "bfloat16"
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(saved_cfg, f, indent=2, sort_keys=True)
        del model

        ref = load(out, torch.float64)
        check_rotary(ref, ref.config, f"{name} float64")
        lo = load(out, torch.bfloat16)
        check_rotary(lo, lo.config, f"{name} bfloat16")

        rng = np.random.default_rng(args.seed + 7 * mi)
        prompts = {p: make_prompt(p, rng) for p in PROMPT_LENS}
        sh = sharpness(ref, prompts[600])
        heads = [x for row in sh for x in row]
        n_sharp = sum(x > SHARP_MIN for x in heads)
        line = (f"{name}: mean max attention prob per head (layers x heads): "
                + " | ".join(" ".join(f"{x:.2f}" for x in row) for row in sh)
                + f"; {n_sharp}/{len(heads)} heads > {SHARP_MIN}")
        print(line, flush=True)
        summary.append(("sharp", line))
        if 2 * n_sharp < len(heads):
            sys.exit(f"{name}: attention is not sharp enough")

        for p in PROMPT_LENS:
            prompt = prompts[p]
            cont = greedy(ref, prompt, N_DECODE)
            seq = prompt + cont
            pos = checked_positions(p, N_DECODE)
            with torch.no_grad():
                full = ref(torch.tensor([seq])).logits[0].numpy()  # float64 [T][V]
                lb = lo(torch.tensor([seq])).logits[0].float().numpy()
            lg = full[pos]
            # the continuation is the teacher-forced float64 argmax (a cache/no-cache mismatch
            # would mean a broken reference)
            am = lg[-N_DECODE:].argmax(axis=-1).tolist()
            if am != cont:
                sys.exit(f"{name} P={p}: cached greedy {cont} != teacher-forced argmax {am}")
            top2 = np.sort(lg, axis=-1)[:, -2:]
            gap = top2[:, 1] - top2[:, 0]
            std = lg.std(axis=-1)
            bf_top1 = lb[pos].argmax(axis=-1)
            agree = float(np.mean(bf_top1 == lg.argmax(axis=-1)))
            fname = f"golden_p{p}.bin"
            write_golden(os.path.join(out, fname), seq, p, pos, lg, bf_top1)
            print(f"  P={p:5d}: {len(pos):3d} positions, logit std {std.mean():.2f}, "
                  f"min top-2 gap {gap.min() / std[np.argmin(gap)]:.3f} std, "
                  f"bf16 top-1 agreement {agree:.3f}, continuation {cont[:8]}...", flush=True)
            summary.append(("case", f"| {name} | {p} | {len(pos)} | {std.mean():.2f} | "
                                    f"{gap.min() / std[np.argmin(gap)]:.3f} | "
                                    f"{int(np.sum(bf_top1 == lg.argmax(axis=-1)))}/{len(pos)} |"))
        del ref, lo

    write_readme(args.out, summary, args.seed)
    total = 0
    for root, _, files in os.walk(args.out):
        total += sum(os.path.getsize(os.path.join(root, x)) for x in files)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; "
          f"{args.out}: {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()

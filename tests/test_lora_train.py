#!/usr/bin/env python3
"""Smoke test of tools/task/train_lora.py (the LoRA fine-tune of the trace-task model): the
plumbing, on the tiny Hugging Face test models, on the CPU, in seconds.

    python3 tests/test_lora_train.py --lfgen build/lfgen

For each of hf_tiny/llama (untied embeddings) and hf_tiny/qwen2 (tied embeddings, q/k/v biases):
  1. train_lora.py trains a few steps on trace-task chat records (gen.hf_record) tokenized with
     the task's character-level tokenizer (ids < 104, inside the tiny models' vocab of 256),
     with a high learning rate so that the adapter moves the model, and saves the adapter (bf16,
     as the real run does);
  2. the saved adapter is applied in torch (fp32, train_lora.load_adapter_into): the logits
     must differ from the base model's (the adapter is not a no-op) and its greedy tokens are
     the reference;
  3. lfgen --lora DIR (full KV, greedy) must give the same tokens, up to the first step whose
     top-2 margin is too small to decide (reported; none expected);
  4. the eviction simulator's model with the adapter merged (tools/evict/model.py, float64)
     must give torch's log-probabilities over the prompt;
  5. with peft installed, PeftModel.from_pretrained on the same directory must give the same
     logits (skipped without peft).
Then, on hf_tiny/llama: --role-weights gives the weight exactly to the tokens of those roles
(checked against the generator's roles), and --init-adapter starts from the given adapter (one
step at a negligible learning rate leaves it as it was, while a fresh start is far from it).
Exit 77 (skipped) without torch, transformers or safetensors.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "task"))

try:
    import safetensors  # noqa: F401
    import torch
    import transformers  # noqa: F401
except ImportError as e:
    print(f"skipped: {e}")
    sys.exit(77)

import gen  # noqa: E402
import train_lora  # noqa: E402

MODELS = ["llama", "qwen2"]
N_PROMPT, N_GEN = 40, 24
MARGIN = 1e-3  # a greedy step decided by less than this may flip between fp32 implementations


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def greedy(model, prompt, n):
    ids, margins = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            top = torch.topk(logits, 2)
            margins.append(float(top.values[0] - top.values[1]))
            ids.append(int(top.indices[0]))
    return ids[len(prompt):], margins


def check_model(name, lfgen, tmp):
    base = os.path.join(ROOT, "tests", "data", "hf_tiny", name)
    out = os.path.join(tmp, name)
    cmd = [sys.executable, os.path.join(ROOT, "tools", "task", "train_lora.py"),
           "--base", base, "--tokenizer", "task", "--out", out, "--max-steps", "6",
           "--max-len", "3000", "--min-out", "100", "--max-out", "300", "--rows", "2",
           "--accum", "1", "--workers", "1", "--eval-n", "2", "--eval-min-out", "100",
           "--eval-max-out", "300", "--eval-every", "3", "--lr", "1e-2", "--warmup", "1",
           "--r", "4", "--alpha", "8", "--log-every", "3", "--threads", "2", "--device", "cpu"]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    if p.returncode != 0:
        fail(f"{name}: train_lora.py exited {p.returncode}\n{p.stdout}\n{p.stderr}")
    log = [ln for ln in p.stdout.splitlines() if ln.startswith(("packing", "step 6", "final"))]
    print(f"{name}: trained in {time.time() - t0:.1f} s: " + " | ".join(log))
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        if not os.path.exists(os.path.join(out, f)):
            fail(f"{name}: {f} missing")

    # the prompt: the start of a held-out record, in the task's tokenizer
    rec = gen.hf_record(next(gen.problems(1, "test", 7, min_len=100, max_len=300)))
    prompt = gen.encode(rec["prompt"], bos=False)[:N_PROMPT]

    load = lambda: train_lora.load_base(base, torch.float32, "eager").eval()  # noqa: E731
    ref = load()
    base_logits = ref(input_ids=torch.tensor([prompt]), use_cache=False).logits[0].detach()
    mods = train_lora.load_adapter_into(ref, out)
    ref.eval()
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor([prompt]), use_cache=False).logits[0]
    moved = float((logits - base_logits).abs().max())
    if not moved > 0.05:
        fail(f"{name}: the trained adapter moves the logits by only {moved:.3g}")
    nz = sum(int(m.lora_B.weight.abs().sum() > 0) for m in mods.values())
    if nz != len(mods):
        fail(f"{name}: {len(mods) - nz} of {len(mods)} lora_B factors are still zero")
    tokens, margins = greedy(ref, prompt, N_GEN)
    print(f"{name}: {len(mods)} LoRA modules, all trained; logits moved by up to {moved:.3f}; "
          f"torch greedy {tokens} (min top-2 margin {min(margins):.4f})")

    if lfgen:
        p = subprocess.run([lfgen, "--model", base, "--lora", out, "--policy", "full",
                            "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", str(N_GEN),
                            "--print-ids"], capture_output=True, text=True, timeout=200)
        if p.returncode != 0:
            fail(f"{name}: lfgen --lora exited {p.returncode}: {p.stderr.strip()}")
        got = [int(x) for x in p.stdout.split()]
        n_ok = next((i for i, m in enumerate(margins) if m < MARGIN), len(margins))
        if got[:n_ok] != tokens[:n_ok]:
            fail(f"{name}: lfgen --lora gave {got}, torch {tokens} (compared {n_ok} steps)")
        print(f"{name}: lfgen --lora: same greedy tokens ({n_ok} of {N_GEN} steps decided)")

    # the eviction simulator merges the adapter itself (tools/evict/model.py, float64)
    sys.path.insert(0, os.path.join(ROOT, "tools", "evict"))
    import numpy as np
    import model as evm
    lp, _ = evm.full_pass(evm.Model(base, np.float64, lora=out), prompt)
    d = float(np.abs(lp - torch.log_softmax(logits.double(), -1).numpy()).max())
    # torch runs in float32 (~1e-4 here); without the merge they differ by about `moved` (> 0.05)
    if not d <= 1e-3:
        fail(f"{name}: tools/evict/model.py --lora log-probabilities differ from torch's by {d:.3g}")
    print(f"{name}: tools/evict/model.py with the adapter: log-probabilities within {d:.2g}")

    try:
        import peft
    except ImportError:
        print(f"{name}: peft not installed: PEFT's loader not checked")
        return
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.PeftModel.from_pretrained(load(), out).eval()
    with torch.no_grad():
        pl = pm(input_ids=torch.tensor([prompt]), use_cache=False).logits[0]
    d = float((pl - logits).abs().max())
    if not d <= 1e-4 * max(1.0, float(logits.abs().max())):
        fail(f"{name}: PEFT's logits differ from train_lora's by {d:.3g}")
    print(f"{name}: peft {peft.__version__} PeftModel.from_pretrained: logits within {d:.2g}")


def check_init_and_weights(tmp):
    # token weights on the task tokenizer: one token per character
    train_lora.ROLE_W.update({"result": 8.0, "skip": 3.0})
    p = gen.make_problem(gen.problem_seed("weights", 0, 0), min_len=300, max_len=600,
                         named_rules=True, show_op=True)
    w = train_lora.token_weights("task", p, p["output"] + "<|im_end|>")
    train_lora.ROLE_W.clear()
    want = [{"result": 8.0, "skip": 3.0}.get(p["_roles"][j][0], 1.0) if j < len(p["output"])
            else 1.0 for j in range(len(p["output"]) + len("<|im_end|>"))]
    if w != want or 8.0 not in w or 3.0 not in w:
        fail("role weights do not follow the generator's roles")
    base = os.path.join(ROOT, "tests", "data", "hf_tiny", "llama")
    first = os.path.join(tmp, "llama")
    common = [sys.executable, os.path.join(ROOT, "tools", "task", "train_lora.py"),
              "--base", base, "--tokenizer", "task", "--max-steps", "1", "--max-len", "3000",
              "--min-out", "100", "--max-out", "300", "--rows", "2", "--accum", "1",
              "--workers", "1", "--eval-n", "1", "--eval-min-out", "100", "--eval-max-out",
              "300", "--warmup", "1", "--r", "4", "--alpha", "8", "--threads", "2",
              "--device", "cpu", "--no-pack-check", "--role-weights", "result=8,skip=8"]
    from safetensors.torch import load_file
    a = load_file(os.path.join(first, "adapter_model.safetensors"))
    for init, tag in ((["--init-adapter", first], "init"), ([], "fresh")):
        out = os.path.join(tmp, "llama-" + tag)
        r = subprocess.run(common + init + ["--out", out, "--lr", "1e-9"], capture_output=True,
                           text=True, timeout=400)
        if r.returncode != 0:
            fail(f"train_lora.py {tag} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
        b = load_file(os.path.join(out, "adapter_model.safetensors"))
        d = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
        scale = max(float(a[k].float().abs().max()) for k in a)
        if tag == "init" and not d <= 1e-2 * scale:
            fail(f"--init-adapter: one step at lr 1e-9 moved the adapter by {d:.3g} ({scale:.3g})")
        if tag == "fresh" and not d > 0.1 * scale:
            fail(f"a fresh start is within {d:.3g} of the trained adapter: the check is void")
        print(f"--role-weights run, {tag}: max |adapter - first run's| {d:.3g} (scale {scale:.3g})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lfgen", help="lfgen binary (without it the lfserve check is skipped)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            check_model(name, args.lfgen, tmp)
        check_init_and_weights(tmp)
    print("ok")


if __name__ == "__main__":
    main()

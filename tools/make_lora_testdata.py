#!/usr/bin/env python3
"""Makes the LoRA adapter test data (tests/data/lora): PEFT adapters with random, nonzero factors
for two of the tiny Hugging Face test models (tests/data/hf_tiny), and the logits of the
PEFT-merged model in float64, for tests/test_lora.cpp.

Cases (CASES below):
  llama  on hf_tiny/llama (bf16, untied embeddings, Llama-3 rope): every module lfserve merges
         (q/k/v/o, gate/up/down, lm_head, embed_tokens), r 4, lora_alpha 8, use_rslora (scale
         8 / sqrt(4) = 4), stored in bf16. PEFT also saves the embedding layers' base weights
         (`...embed_tokens.base_layer.weight`, `lm_head.base_layer.weight`) since embeddings are
         targeted. tests/data/gguf_models/llama.gguf holds the same base with llama.cpp's Q/K
         row permutation, so the same reference checks the merge on the GGUF path.
  qwen2  on hf_tiny/qwen2 (f16, tied embeddings, q/k/v biases): the seven projections of layers 0
         and 2 only (layers_to_transform), r 8, lora_alpha 16 (scale 2), stored in f32.

PEFT initialises lora_B to zero (the adapter would change nothing), so every factor is redrawn
here: A ~ N(0, 1/fan_in), B scaled so that scale * B @ A has DELTA_REL times the spread of the
base weight it is added to. The factors are rounded to the storage dtype before saving, and the
reference is computed from what was saved: a fresh float64 base (loaded with dtype=float64,
not cast, so rotary buffers stay exact), PeftModel.from_pretrained on the saved adapter,
merge_and_unload, then the logits at every position of a PROMPT_LEN-token prompt, and the float64
merged model's own greedy continuation (N_GREEDY tokens) with its smallest top-2 margin.

Each case directory gets adapter_config.json and adapter_model.safetensors (as PEFT saved them;
target_modules sorted and base_model_name_or_path made repository-relative so reruns give the same
bytes) and reference.json:
    {"base": "hf_tiny/<model>", "generator": "...", "prompt": [ids],
     "logits": [[float] * vocab] * len(prompt), "greedy": [ids], "greedy_min_margin": float}

    python3 tools/make_lora_testdata.py [--out tests/data/lora]

Needs torch, transformers (>= 5), peft and safetensors (pip install peft). Deterministic.
"""
import argparse
import json
import math
import os
import shutil
import warnings

import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT_LEN = 16
N_GREEDY = 16
DELTA_REL = 0.4
SEED = 4242

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

CASES = [
    # name, base model under tests/data/hf_tiny, storage dtype, LoraConfig arguments
    ("llama", "llama", torch.bfloat16,
     dict(r=4, lora_alpha=8, use_rslora=True,
          target_modules=ALL_LINEAR + ["lm_head", "embed_tokens"])),
    ("qwen2", "qwen2", torch.float32,
     dict(r=8, lora_alpha=16, target_modules=ALL_LINEAR, layers_to_transform=[0, 2])),
]


def load_base(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float64, attn_implementation="eager").eval()


def randomize(model, storage, gen):
    """Redraws every LoRA factor of the PEFT model (see the module docstring)."""
    from peft.tuners.lora import LoraLayer
    n = 0
    with torch.no_grad():
        for name, mod in model.named_modules():
            if not isinstance(mod, LoraLayer):
                continue
            base = mod.get_base_layer().weight
            scale = mod.scaling["default"]
            if "default" in mod.lora_A:
                # [r][in], [out][r]
                a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
                fan_in = a.shape[1]
            else:  # an embedding: lora_embedding_A [r][vocab], lora_embedding_B [dim][r]
                a, b = mod.lora_embedding_A["default"], mod.lora_embedding_B["default"]
                fan_in = a.shape[1]
            r = a.shape[0]
            a_sd = 1.0 / math.sqrt(fan_in)
            b_sd = DELTA_REL * float(base.std()) / (scale * math.sqrt(r) * a_sd)
            a.copy_((torch.randn(a.shape, generator=gen, dtype=torch.float64) * a_sd)
                    .to(storage).to(torch.float64))
            b.copy_((torch.randn(b.shape, generator=gen, dtype=torch.float64) * b_sd)
                    .to(storage).to(torch.float64))
            n += 1
    return n


def greedy(model, prompt, n):
    ids, margins = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            top = torch.topk(logits, 2)
            margins.append(float(top.values[0] - top.values[1]))
            ids.append(int(top.indices[0]))
    return ids[len(prompt):], min(margins)


def make_case(out_root, i, name, base_name, storage, lora_args):
    import peft
    base_dir = os.path.join(ROOT, "tests", "data", "hf_tiny", base_name)
    out = os.path.join(out_root, name)
    shutil.rmtree(out, ignore_errors=True)
    gen = torch.Generator().manual_seed(SEED + i)

    model = load_base(base_dir)
    cfg = peft.LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **lora_args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(model, cfg)
    n_mod = randomize(pm, storage, gen)
    # The base is stored in bf16 / f16 and the factors were rounded to `storage`: the cast is
    # exact for everything the adapter file holds (factors, embedding base layers).
    pm.to(storage).save_pretrained(out)
    os.remove(os.path.join(out, "README.md"))  # PEFT's model-card template
    os.chmod(os.path.join(out, "adapter_model.safetensors"), 0o644)  # safetensors writes 0600

    cfg_path = os.path.join(out, "adapter_config.json")
    with open(cfg_path) as f:
        acfg = json.load(f)
    acfg["base_model_name_or_path"] = f"tests/data/hf_tiny/{base_name}"
    if isinstance(acfg.get("target_modules"), list):
        acfg["target_modules"] = sorted(acfg["target_modules"])
    with open(cfg_path, "w") as f:
        json.dump(acfg, f, indent=2, sort_keys=True)
        f.write("\n")

    # The reference: exactly what was saved, through PEFT's own loader and merge, in float64.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = peft.PeftModel.from_pretrained(load_base(base_dir), out).merge_and_unload().eval()
        base = load_base(base_dir)
    for p in ref.parameters():
        assert p.dtype == torch.float64
    vocab = ref.config.vocab_size
    prompt = [1] + torch.randint(3, vocab, (PROMPT_LEN - 1,), generator=gen).tolist()
    with torch.no_grad():
        logits = ref(torch.tensor([prompt])).logits[0]
        base_logits = base(torch.tensor([prompt])).logits[0]
    tokens, margin = greedy(ref, prompt, N_GREEDY)
    moved = float((logits - base_logits).abs().max())
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({"base": f"hf_tiny/{base_name}",
                   "generator": f"tools/make_lora_testdata.py: peft {peft.__version__}, "
                                f"transformers {transformers.__version__}, torch "
                                f"{torch.__version__}, float64, eager attention, "
                                "merge_and_unload",
                   "prompt": prompt,
                   "logits": [[float(f"{float(x):.9g}") for x in row] for row in logits],
                   "greedy": tokens,
                   "greedy_min_margin": margin}, f)
        f.write("\n")
    files = sorted(os.listdir(out))
    size = sum(os.path.getsize(os.path.join(out, x)) for x in files)
    line = (f"- `{name}`: {n_mod} LoRA modules on hf_tiny/{base_name}, {', '.join(files)}: "
            f"{size} bytes; the adapter moves the logits by up to {moved:.3f} (max |logit| "
            f"{float(logits.abs().max()):.3f}); greedy min top-2 margin {margin:.4f}")
    print(line)
    return line


README = """# LoRA adapter test data (generated: do not edit)

Made by `python3 tools/make_lora_testdata.py` (its docstring describes the cases and files) with
{versions}. Used by tests/test_lora.cpp: each adapter is merged into its base
(tests/data/hf_tiny/<model>, and the GGUF copy in tests/data/gguf_models) and the cpu backend's
logits are compared with `reference.json`, the float64 logits of PEFT's merged model.

{lines}
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "data", "lora"))
    args = ap.parse_args()
    lines = []
    for i, (name, base_name, storage, lora_args) in enumerate(CASES):
        lines.append(make_case(args.out, i, name, base_name, storage, lora_args))
    import peft
    versions = (f"peft {peft.__version__}, transformers {transformers.__version__}, torch "
                f"{torch.__version__}")
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(README.format(versions=versions, lines="\n".join(lines)))


if __name__ == "__main__":
    main()

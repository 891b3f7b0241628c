#!/usr/bin/env python3
"""Makes the tiny random-weight Hugging Face models under tests/data/hf_tiny and their
reference outputs from transformers (an independent implementation of the same forward pass).

Each model is saved in a different storage dtype (bf16, f16, f32; one sharded) so the loader's
conversions are exercised; the reference runs in float32 on the *stored* (rounded) weights, so
our fp32 engine must match it to float32 rounding.

    python3 tools/make_hf_tiny.py [--out tests/data/hf_tiny]

Needs torch, transformers and safetensors (pip). Deterministic for a given seed.
"""
import argparse
import json
import os
import shutil

import torch
import transformers

N_GREEDY = 64
PROMPT_LEN = 12


def models():
    rope_llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}
    return [
        ("llama", transformers.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
            rope_parameters=rope_llama3), torch.bfloat16, None),
        ("qwen2", transformers.Qwen2Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
         torch.float16, None),
        ("qwen3", transformers.Qwen3Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=1, head_dim=32,
            max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=[2, 3],
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
         torch.float32, "60KB"),
    ]


def randomize(model, gen):
    """Weights with a realistic spread: logits far from uniform, so greedy has clear margins."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(1.0 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / fan_in ** 0.5))


def greedy(model, prompt, n):
    ids = list(prompt)
    margins = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            top = torch.topk(logits, 2)
            margins.append(float(top.values[0] - top.values[1]))
            ids.append(int(top.indices[0]))
    return ids[len(prompt):], min(margins)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests",
                                                  "data", "hf_tiny"))
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    for i, (name, cfg, dtype, shard) in enumerate(models()):
        gen = torch.Generator().manual_seed(args.seed + i)
        cfg._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
        randomize(model, gen)
        out = os.path.join(args.out, name)
        shutil.rmtree(out, ignore_errors=True)
        kw = {"max_shard_size": shard} if shard else {}
        model.to(dtype).save_pretrained(out, safe_serialization=True, **kw)
        for extra in ("generation_config.json",):
            if os.path.exists(os.path.join(out, extra)):
                os.remove(os.path.join(out, extra))
        # The reference runs in float32 on exactly the stored values.
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            out, torch_dtype=torch.float32, attn_implementation="eager").eval()
        prompt = [1] + torch.randint(3, cfg.vocab_size, (PROMPT_LEN - 1,), generator=gen).tolist()
        with torch.no_grad():
            logits = ref(torch.tensor([prompt])).logits[0]
        tokens, margin = greedy(ref, prompt, N_GREEDY)
        with open(os.path.join(out, "reference.json"), "w") as f:
            json.dump({"generator": f"transformers {transformers.__version__}, torch "
                                    f"{torch.__version__}, float32, eager attention",
                       "prompt": prompt,
                       "logits": [[round(float(x), 7) for x in row] for row in logits],
                       "greedy": tokens,
                       "greedy_min_margin": margin}, f)
        files = sorted(os.listdir(out))
        size = sum(os.path.getsize(os.path.join(out, x)) for x in files)
        print(f"{name}: {files} {size} bytes, greedy min top-2 margin {margin:.4f}")


if __name__ == "__main__":
    main()

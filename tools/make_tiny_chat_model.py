#!/usr/bin/env python3
"""Writes a tiny random-weight Llama model directory whose vocabulary matches a test tokenizer,
for the server tests (hf_tiny's models have vocab 256 and no tokenizer).

    python3 tools/make_tiny_chat_model.py OUT_DIR [--tokenizer tests/data/tokenizers/bytelevel_qwen2]

Pure standard library (no numpy/torch): f32 safetensors, deterministic for a given seed. The
tokenizer's tokenizer.json and tokenizer_config.json (with its chat template) are copied beside
the weights. About 1 MB; made at test time, not stored.
"""
import argparse
import json
import os
import random
import shutil
import struct


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokenizer", default=os.path.join(here, "..", "tests", "data", "tokenizers",
                                                        "bytelevel_qwen2"))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--context", type=int, default=1024)
    a = ap.parse_args()

    tok = json.load(open(os.path.join(a.tokenizer, "tokenizer.json"), encoding="utf-8"))
    ids = list(tok["model"]["vocab"].values()) + [t["id"] for t in tok.get("added_tokens", [])]
    vocab = max(ids) + 1
    tcfg = json.load(open(os.path.join(a.tokenizer, "tokenizer_config.json"), encoding="utf-8"))
    added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    eos = [added[t] for t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>") if t in added]
    eos_tok = tcfg.get("eos_token")
    if isinstance(eos_tok, str) and eos_tok in added and added[eos_tok] not in eos:
        eos.insert(0, added[eos_tok])
    bos = added.get("<|begin_of_text|>", None)

    dim, hidden, layers, heads, kv_heads, head_dim = 32, 64, 2, 4, 2, 8
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": dim, "intermediate_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": a.context, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "bos_token_id": bos, "eos_token_id": eos or [vocab - 1], "hidden_act": "silu",
        "rope_theta": 10000.0, "torch_dtype": "float32",
    }
    rng = random.Random(a.seed)
    tensors = []

    def mat(name, rows, cols, std):
        tensors.append((name, [rows, cols], [rng.gauss(0.0, std) for _ in range(rows * cols)]))

    def norm(name, n):
        tensors.append((name, [n], [1.0 + rng.uniform(-0.1, 0.1) for _ in range(n)]))

    mat("model.embed_tokens.weight", vocab, dim, 1.0)
    for l in range(layers):
        p = "model.layers.%d." % l
        norm(p + "input_layernorm.weight", dim)
        mat(p + "self_attn.q_proj.weight", heads * head_dim, dim, dim ** -0.5)
        mat(p + "self_attn.k_proj.weight", kv_heads * head_dim, dim, dim ** -0.5)
        mat(p + "self_attn.v_proj.weight", kv_heads * head_dim, dim, dim ** -0.5)
        mat(p + "self_attn.o_proj.weight", dim, heads * head_dim, (heads * head_dim) ** -0.5)
        norm(p + "post_attention_layernorm.weight", dim)
        mat(p + "mlp.gate_proj.weight", hidden, dim, dim ** -0.5)
        mat(p + "mlp.up_proj.weight", hidden, dim, dim ** -0.5)
        mat(p + "mlp.down_proj.weight", dim, hidden, hidden ** -0.5)
    norm("model.norm.weight", dim)
    # An untied head: with tied embeddings a random model repeats its input token forever.
    mat("lm_head.weight", vocab, dim, 2.0 * dim ** -0.5)

    header, off, blobs = {}, 0, []
    for name, shape, vals in tensors:
        blob = struct.pack("<%df" % len(vals), *vals)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + len(blob)]}
        off += len(blob)
        blobs.append(blob)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(a.tokenizer, fn), os.path.join(a.out, fn))
    print("%s: llama, vocab %d, eos %s" % (a.out, vocab, cfg["eos_token_id"]))


if __name__ == "__main__":
    main()

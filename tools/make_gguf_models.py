#!/usr/bin/env python3
"""Writes GGUF copies of the project's small Hugging Face test models and tokenizers, laid out as
llama.cpp's converter lays them out, for tests/test_gguf_model.cpp:

  tests/data/gguf_models/{llama,qwen2,qwen3}.gguf   from tests/data/hf_tiny/*: GGUF tensor names,
      llama's q/k rows permuted (interleaved-pair RoPE order), Llama-3 rope scaling as a
      rope_freqs tensor, tied embeddings without output.weight; each tensor in its stored dtype
      (BF16, F16, F32), so the GGUF model must equal the HF one exactly.
  tests/data/gguf_models/tok_{llama3,qwen2}.gguf     from tests/data/tokenizers/bytelevel_*:
      the tokenizer.ggml.* metadata only (no tensors), to compare with the tokenizer.json.

    python3 tools/make_gguf_models.py

Needs numpy, safetensors and gguf (pip). Deterministic.
"""
import json
import math
import os

import gguf
import numpy as np
from safetensors.numpy import load_file

from gguflib import rotary_permute, write_out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests/data/gguf_models")

LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}


def load_hf(d):
    """{name: (array as stored, dtype name)}; bf16 is kept as its uint16 bits."""
    out = {}
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    for f in files:
        path = os.path.join(d, f)
        header_len = int.from_bytes(open(path, "rb").read(8), "little")
        header = json.loads(open(path, "rb").read(8 + header_len)[8:])
        raw = open(path, "rb").read()[8 + header_len:]
        for name, info in header.items():
            if name == "__metadata__":
                continue
            b, e = info["data_offsets"]
            dt = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}[info["dtype"]]
            out[name] = (np.frombuffer(raw[b:e], dtype=dt).reshape(info["shape"]), info["dtype"])
    return out


def llama3_rope_freqs(cfg, head_dim):
    rp = cfg["rope_parameters"]
    theta, factor = rp["rope_theta"], rp["factor"]
    low, high, orig = rp["low_freq_factor"], rp["high_freq_factor"], rp["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_model(name):
    d = os.path.join(ROOT, "tests/data/hf_tiny", name)
    cfg = json.load(open(os.path.join(d, "config.json")))
    arch = cfg["model_type"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w = gguf.GGUFWriter(os.path.join(OUT, name + ".gguf"), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    eos = cfg["eos_token_id"]
    w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    if cfg["rope_parameters"].get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg, hd))
    for hf_name, (arr, dt) in sorted(load_hf(d).items()):
        if hf_name in GLOBAL:
            g = GLOBAL[hf_name]
        else:
            parts = hf_name.split(".")
            g = "blk.%s.%s" % (parts[2], LAYER[".".join(parts[3:])])
        if arch == "llama" and (".attn_q." in g or ".attn_k." in g):
            heads = cfg["num_attention_heads"] if ".attn_q." in g else cfg["num_key_value_heads"]
            arr = rotary_permute(arr, heads)
        if dt == "BF16":
            w.add_tensor(g, np.ascontiguousarray(arr), raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(g, np.ascontiguousarray(arr))
    write_out(w)


def write_tokenizer(name, pre):
    d = os.path.join(ROOT, "tests/data/tokenizers", "bytelevel_" + name)
    j = json.load(open(os.path.join(d, "tokenizer.json")))
    vocab = dict(j["model"]["vocab"])
    special = set()
    for a in j["added_tokens"]:
        vocab[a["content"]] = a["id"]
        if a["special"]:
            special.add(a["id"])
    n = max(vocab.values()) + 1
    tokens = [""] * n
    for t, i in vocab.items():
        tokens[i] = t
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(n)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]]
    w = gguf.GGUFWriter(os.path.join(OUT, "tok_%s.gguf" % name), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|begin_of_text|>"])
    w.add_add_bos_token(True)
    write_out(w)


def main():
    os.makedirs(OUT, exist_ok=True)
    for m in ("llama", "qwen2", "qwen3"):
        write_model(m)
    write_tokenizer("llama3", "llama-bpe")
    write_tokenizer("qwen2", "qwen2")
    for f in sorted(os.listdir(OUT)):
        print(f, os.path.getsize(os.path.join(OUT, f)))


if __name__ == "__main__":
    main()

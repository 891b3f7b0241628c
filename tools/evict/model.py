"""The Llama-family forward pass of the eviction simulator, in NumPy: weights from a Hugging Face
directory (safetensors: BF16, F16, F32; one file or an index of shards) or a GGUF file (through
the `gguf` package: quantized blocks dequantized, llama's Q/K rows un-permuted back to the HF
layout, as engine/model_gguf.c does). Models: llama (llama3 RoPE scaling included), qwen2 (q/k/v
biases), qwen3 (q/k RMSNorm); tied or untied embeddings.

Only what is independent of eviction lives here: the weights, RMSNorm, the projections, RoPE and
the MLP. The attention over a KV pool is tools/evict/sim.py's; a full-KV causal pass over a whole
text (the reference every policy is measured against) is full_pass() below.

Numerics follow the cpu backend (engine/forward.c) where it matters for agreement: RoPE
frequencies and angles are formed in float32 (position * inv_freq), then rotated in the compute
dtype (float64 for the lockstep check against lfserve, float32 for speed).
"""
import json
import math
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gguflib import rotary_unpermute  # noqa: E402


class Config:
    def __init__(self, **kw):
        self.model_type = kw["model_type"]
        self.dim = kw["dim"]
        self.hidden_dim = kw["hidden_dim"]
        self.n_layers = kw["n_layers"]
        self.n_heads = kw["n_heads"]
        self.n_kv_heads = kw["n_kv_heads"]
        self.head_dim = kw["head_dim"]
        self.vocab_size = kw["vocab_size"]
        self.norm_eps = kw["norm_eps"]
        self.rope_theta = kw["rope_theta"]
        self.rope_scaling = kw.get("rope_scaling")  # None or the llama3 parameters (dict)
        self.group = self.n_heads // self.n_kv_heads

    def as_dict(self):
        return dict(self.__dict__)


# ---------------------------------------------------------------------------- safetensors

def _bf16_to_f32(raw):
    return (raw.astype(np.uint32) << 16).view(np.float32)


def _read_safetensors(path, want=None):
    out = {}
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base = 8 + n
        buf = np.memmap(path, dtype=np.uint8, mode="r")
    for name, info in header.items():
        if name == "__metadata__" or (want is not None and name not in want):
            continue
        a, b = info["data_offsets"]
        raw = buf[base + a: base + b]
        dt = info["dtype"]
        if dt == "BF16":
            arr = _bf16_to_f32(raw.view(np.uint16))
        elif dt == "F16":
            arr = raw.view(np.float16).astype(np.float32)
        elif dt == "F32":
            arr = np.array(raw.view(np.float32))
        else:
            raise ValueError("%s: tensor %s has dtype %s (BF16, F16, F32 supported)" % (path, name, dt))
        out[name] = arr.reshape(info["shape"])
    return out


def _hf_config(cfg):
    mt = cfg["model_type"]
    if mt not in ("llama", "qwen2", "qwen3"):
        raise ValueError("model_type %s not supported (llama, qwen2, qwen3)" % mt)
    rp = cfg.get("rope_parameters") or {}
    rs = cfg.get("rope_scaling") or {}
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rtype = rp.get("rope_type", rs.get("rope_type", rs.get("type", "default")))
    scaling = None
    if rtype == "llama3":
        src = rp if rp.get("rope_type") == "llama3" else rs
        scaling = {k: float(src[k]) for k in ("factor", "low_freq_factor", "high_freq_factor")}
        scaling["original_max_position_embeddings"] = int(src["original_max_position_embeddings"])
    elif rtype not in ("default", None):
        raise ValueError("rope type %s not supported" % rtype)
    n_heads = cfg["num_attention_heads"]
    return Config(model_type=mt, dim=cfg["hidden_size"], hidden_dim=cfg["intermediate_size"],
                  n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
                  n_kv_heads=cfg.get("num_key_value_heads", n_heads),
                  head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
                  vocab_size=cfg["vocab_size"], norm_eps=float(cfg["rms_norm_eps"]),
                  rope_theta=float(theta), rope_scaling=scaling)


def _load_hf(d):
    with open(os.path.join(d, "config.json")) as f:
        cfg = _hf_config(json.load(f))
    idx = os.path.join(d, "model.safetensors.index.json")
    t = {}
    if os.path.isfile(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        for fn in files:
            t.update(_read_safetensors(os.path.join(d, fn)))
    else:
        t = _read_safetensors(os.path.join(d, "model.safetensors"))
    return cfg, t


# ---------------------------------------------------------------------------------- GGUF

_GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def _load_gguf(path):
    import gguf  # the `gguf` package (pip); only GGUF models need it

    r = gguf.GGUFReader(path)

    def field(key, default=None):
        f = r.fields.get(key)
        if f is None:
            return default
        return f.contents()

    arch = field("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError("%s: GGUF architecture %s not supported" % (path, arch))
    n_heads = int(field(arch + ".attention.head_count"))
    dim = int(field(arch + ".embedding_length"))
    cfg = Config(model_type=arch, dim=dim, hidden_dim=int(field(arch + ".feed_forward_length")),
                 n_layers=int(field(arch + ".block_count")), n_heads=n_heads,
                 n_kv_heads=int(field(arch + ".attention.head_count_kv", n_heads)),
                 head_dim=int(field(arch + ".attention.key_length", dim // n_heads)),
                 vocab_size=0, norm_eps=float(field(arch + ".attention.layer_norm_rms_epsilon")),
                 rope_theta=float(field(arch + ".rope.freq_base", 10000.0)), rope_scaling=None)
    if any(t.name == "rope_freqs.weight" for t in r.tensors):
        raise ValueError("%s: llama3 RoPE scaling in GGUF is not supported here" % path)
    t = {}
    for tt in r.tensors:
        name = tt.name
        if name.startswith("blk."):
            _, li, rest = name.split(".", 2)
            if rest not in _GGUF_LAYER:
                continue
            hf = "model.layers.%s.%s" % (li, _GGUF_LAYER[rest])
        elif name in _GGUF_GLOBAL:
            hf = _GGUF_GLOBAL[name]
        else:
            continue
        a = gguf.quants.dequantize(tt.data, tt.tensor_type).astype(np.float32)
        shape = [int(x) for x in reversed(tt.shape)]
        a = a.reshape(shape)
        if arch == "llama" and rest_is(name, "attn_q.weight"):
            a = rotary_unpermute(a, cfg.n_heads)
        elif arch == "llama" and rest_is(name, "attn_k.weight"):
            a = rotary_unpermute(a, cfg.n_kv_heads)
        t[hf] = a
    cfg.vocab_size = t["model.embed_tokens.weight"].shape[0]
    return cfg, t


def merge_lora(t, d):
    """Adds a PEFT LoRA adapter (directory: adapter_config.json + adapter_model.safetensors) into
    the HF-named float32 weights t: W += alpha / r * B @ A, as engine/lora.c merges it. Plain
    LoRA only (no rslora, DoRA, biases or per-module ranks)."""
    with open(os.path.join(d, "adapter_config.json")) as f:
        ac = json.load(f)
    if ac.get("use_rslora") or ac.get("use_dora") or ac.get("rank_pattern") or \
            ac.get("alpha_pattern") or ac.get("bias", "none") != "none":
        raise ValueError("%s: only plain LoRA adapters are supported" % d)
    scale = float(ac["lora_alpha"]) / float(ac["r"])
    ab = _read_safetensors(os.path.join(d, "adapter_model.safetensors"))
    n = 0
    for name, a in ab.items():
        if not name.endswith(".lora_A.weight"):
            continue
        base = name[:-len(".lora_A.weight")]
        target = base[len("base_model.model."):] + ".weight"
        if target not in t:
            raise ValueError("%s: %s has no base weight %s" % (d, name, target))
        b = ab[base + ".lora_B.weight"]
        t[target] = (t[target].astype(np.float32) +
                     np.float32(scale) * (b.astype(np.float32) @ a.astype(np.float32)))
        n += 1
    if n == 0:
        raise ValueError("%s: no lora_A tensors" % d)
    return n


def rest_is(name, suffix):
    return name.startswith("blk.") and name.split(".", 2)[2] == suffix


# --------------------------------------------------------------------------------- model

def rope_inv_freq(cfg):
    """[head_dim/2] float32, as lf_rope_freqs computes them (llama3 scaling included)."""
    f32 = np.float32
    hd = cfg.head_dim
    out = np.empty(hd // 2, np.float32)
    for i in range(hd // 2):
        f = f32(1.0) / np.power(f32(cfg.rope_theta), f32(2 * i) / f32(hd))
        s = cfg.rope_scaling
        if s:
            old = f32(s["original_max_position_embeddings"])
            low_wl = old / f32(s["low_freq_factor"])
            high_wl = old / f32(s["high_freq_factor"])
            wl = (f32(1.0) / f) * (f32(2.0) * f32(math.pi))
            if wl > low_wl:
                f = f / f32(s["factor"])
            elif wl >= high_wl:
                smooth = ((f32(1.0) / wl) * old - f32(s["low_freq_factor"])) / (
                    f32(s["high_freq_factor"]) - f32(s["low_freq_factor"]))
                f = (f32(1.0) - smooth) * f / f32(s["factor"]) + smooth * f
        out[i] = f
    return out


class Model:
    """Weights in the compute dtype, fused for few BLAS calls: wqkv [dim][q+k+v], wo [q][dim],
    wgu [dim][2*hidden], wdown [hidden][dim] (x @ w layouts), lm_head [vocab][dim]."""

    def __init__(self, path, dtype=np.float64, lora=None):
        cfg, t = _load_gguf(path) if os.path.isfile(path) else _load_hf(path)
        if lora:
            merge_lora(t, lora)
        self.cfg = cfg
        self.path = path
        self.dtype = dtype
        c = cfg
        hd = c.head_dim

        def g(name):
            return t[name].astype(dtype)

        self.embed = g("model.embed_tokens.weight")
        self.lm_head = g("lm_head.weight") if "lm_head.weight" in t else self.embed
        self.norm = g("model.norm.weight")
        self.layers = []
        for l in range(c.n_layers):
            p = "model.layers.%d." % l
            L = {}
            L["rms_att"] = g(p + "input_layernorm.weight")
            L["rms_ffn"] = g(p + "post_attention_layernorm.weight")
            wq, wk, wv = g(p + "self_attn.q_proj.weight"), g(p + "self_attn.k_proj.weight"), g(p + "self_attn.v_proj.weight")
            assert wq.shape == (c.n_heads * hd, c.dim) and wk.shape == (c.n_kv_heads * hd, c.dim)
            L["wqkv"] = np.ascontiguousarray(np.concatenate([wq, wk, wv], 0).T)
            if p + "self_attn.q_proj.bias" in t:
                L["bqkv"] = np.concatenate([g(p + "self_attn.q_proj.bias"), g(p + "self_attn.k_proj.bias"),
                                            g(p + "self_attn.v_proj.bias")])
            else:
                L["bqkv"] = None
            L["q_norm"] = g(p + "self_attn.q_norm.weight") if p + "self_attn.q_norm.weight" in t else None
            L["k_norm"] = g(p + "self_attn.k_norm.weight") if p + "self_attn.k_norm.weight" in t else None
            L["wo"] = np.ascontiguousarray(g(p + "self_attn.o_proj.weight").T)
            L["wgu"] = np.ascontiguousarray(np.concatenate(
                [g(p + "mlp.gate_proj.weight"), g(p + "mlp.up_proj.weight")], 0).T)
            L["wdown"] = np.ascontiguousarray(g(p + "mlp.down_proj.weight").T)
            self.layers.append(L)
        self.inv_freq = rope_inv_freq(c)

    # pieces of one layer, on rows x [..., dim]

    def rmsnorm(self, x, w):
        ss = np.mean(x * x, axis=-1, keepdims=True)
        return w * (x / np.sqrt(ss + self.dtype(self.cfg.norm_eps)))

    def qkv(self, l, x, positions=None, cs=None):
        """x [N, dim] (normed), positions [N] or a scalar (or their rope_cs) -> q [N, Hq, D],
        k, v [N, Hkv, D], q and k rotated."""
        c, L = self.cfg, self.layers[l]
        y = x @ L["wqkv"]
        if L["bqkv"] is not None:
            y = y + L["bqkv"]
        hd, nq, nk = c.head_dim, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        q = y[:, :nq].reshape(-1, c.n_heads, hd)
        k = y[:, nq:nq + nk].reshape(-1, c.n_kv_heads, hd)
        v = y[:, nq + nk:].reshape(-1, c.n_kv_heads, hd)
        if L["q_norm"] is not None:
            q = self.rmsnorm(q, L["q_norm"])
            k = self.rmsnorm(k, L["k_norm"])
        cos, sin = cs if cs is not None else self.rope_cs(positions)
        return self.rope(q, cos, sin), self.rope(k, cos, sin), v

    def rope_cs(self, positions):
        pos = np.atleast_1d(np.asarray(positions)).astype(np.float32)
        ang = pos[:, None] * self.inv_freq[None, :]  # float32, as the C code forms it
        ang = ang.astype(self.dtype)
        return np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]  # [N, 1, D/2]

    @staticmethod
    def rope(x, cos, sin):
        h = x.shape[-1] // 2
        a, b = x[..., :h], x[..., h:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def attn_out_mlp(self, l, x, att):
        """The residual stream after layer l: x [N, dim], att [N, Hq*D] the attention output."""
        L = self.layers[l]
        x = x + att @ L["wo"]
        h = self.rmsnorm(x, L["rms_ffn"])
        gu = h @ L["wgu"]
        hid = self.cfg.hidden_dim
        gate, up = gu[:, :hid], gu[:, hid:]
        return x + ((gate / (1.0 + np.exp(-gate))) * up) @ L["wdown"]

    def logits(self, x):
        return self.rmsnorm(x, self.norm) @ self.lm_head.T


def log_softmax(z):
    z = np.asarray(z, dtype=np.float64)
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))


def full_pass(model, tokens, tau=None, chunk=None, taus=None, stats=None):
    """Full-KV causal pass over all of `tokens`: log-softmax logits [T][vocab] (float32) and,
    when tau is given, the strong uses: for every layer and KV head, which query steps t attend
    to key position j with weight >= tau (the maximum over the KV head's query heads); returned
    as a list over layers of (steps int32 [E], offsets int64 [Hkv][T+1]) in CSR form, keyed by
    (head, key position) with steps ascending. taus (a list) instead of tau: one such list per
    threshold. stats (a dict), when given, receives "sink_mass" [layer]: the mean attention
    weight the first 4 positions get, over query heads and the queries at positions >= 64; and
    when it holds "reads_from" (a position t0) and "reads_budget" (B), "old_r" and "old_b"
    [layer][KV head]: the mass the queries t >= t0 put on keys at least B/2 (old_r) and more
    than B (old_b) positions back, the first 4 left out, the mean over the group's heads."""
    c = model.cfg
    T = len(tokens)
    D, G, Hkv = c.head_dim, c.group, c.n_kv_heads
    x = model.embed[np.asarray(tokens)]
    pos = np.arange(T)
    scale = model.dtype(1.0 / math.sqrt(D))
    causal = np.tril(np.ones((T, T), dtype=bool))
    tau_list = list(taus) if taus is not None else ([tau] if tau is not None else [])
    uses = [[] for _ in tau_list]
    reads = stats is not None and "reads_from" in stats
    if stats is not None:
        stats["sink_mass"] = []
    if reads:
        t0, B = stats["reads_from"], stats["reads_budget"]
        age = pos[:, None] - pos[None, :]
        far_r = ((age >= B // 2) & (pos[None, :] >= 4))[t0:]
        far_b = ((age > B) & (pos[None, :] >= 4))[t0:]
        stats["old_r"], stats["old_b"] = [], []
    for l in range(c.n_layers):
        h = model.rmsnorm(x, model.layers[l]["rms_att"])
        q, k, v = model.qkv(l, h, pos)
        att = np.empty((T, c.n_heads, D), dtype=model.dtype)
        strong = [np.zeros((Hkv, T, T), dtype=bool) for _ in tau_list]
        sink_mass = 0.0
        row_r, row_b = [0.0] * Hkv, [0.0] * Hkv
        for g in range(Hkv):
            kg, vg = k[:, g, :], v[:, g, :]
            for j in range(G):
                hq = g * G + j
                lg = (q[:, hq, :] @ kg.T) * scale
                lg = np.where(causal, lg, -np.inf)
                lg -= lg.max(axis=1, keepdims=True)
                e = np.exp(lg)
                a = e / e.sum(axis=1, keepdims=True)  # [query t][key i]
                att[:, hq, :] = a @ vg
                for ti, tv in enumerate(tau_list):
                    strong[ti][g] |= a >= tv
                if stats is not None and T > 64:
                    sink_mass += float(a[64:, :4].sum(1).mean()) / c.n_heads
                if reads:
                    row_r[g] += float((a[t0:] * far_r).sum(1).mean()) / G
                    row_b[g] += float((a[t0:] * far_b).sum(1).mean()) / G
        if stats is not None:
            stats["sink_mass"].append(sink_mass)
        if reads:
            stats["old_r"].append([round(x, 4) for x in row_r])
            stats["old_b"].append([round(x, 4) for x in row_b])
        for ti in range(len(tau_list)):
            # CSR by (head, key): transpose to [head][key][query] and list the queries
            st = strong[ti].transpose(0, 2, 1)
            gi, ki, qi = np.nonzero(st)
            counts = np.bincount(gi * T + ki, minlength=Hkv * T)
            offsets = np.zeros((Hkv, T + 1), dtype=np.int64)
            flat = np.concatenate([[0], np.cumsum(counts)])
            for g in range(Hkv):
                offsets[g] = flat[g * T: g * T + T + 1]
            uses[ti].append((qi.astype(np.int32), offsets))
        del strong
        x = model.attn_out_mlp(l, x, att.reshape(T, -1))
    logp = np.empty((T, c.vocab_size), dtype=np.float32)
    step = chunk or 256
    for a in range(0, T, step):
        logp[a:a + step] = log_softmax(model.logits(x[a:a + step]))
    if taus is not None:
        return logp, uses
    return logp, (uses[0] if tau is not None else None)

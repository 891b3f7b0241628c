#!/usr/bin/env python3
"""Makes the small tokenizers under tests/data/tokenizers and their reference outputs.

Everything comes from the Hugging Face `tokenizers` library (the implementation lfserve's
tokenizer must agree with) and from transformers' apply_chat_template (Jinja2) for the chat
templates. Nothing is downloaded: the training corpus is generated here, so the files are small
and the script is deterministic.

    /opt/hfref/bin/python tools/make_tokenizer_data.py [--out tests/data/tokenizers]

Writes, per tokenizer NAME:
  NAME/tokenizer.json         the trained tokenizer, configured like the real model family
  NAME/tokenizer_config.json  bos/eos and a chat_template (for the chat-template tests)
  NAME/reference.json         {"cases": [{"text", "ids", "ids_special", "decode",
                                          "decode_skip"}], "random_decode": [...]}
and chat/reference.json with the rendered chat templates for the three formats (chatml twice:
with Qwen2's default system prompt and without, as Qwen3), each format's tokenizer_config.json
under chat/FORMAT/.
"""
import argparse
import json
import os
import random
import unicodedata

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors, trainers

# The pre-tokenizer regexes of the real models (tokenizer.json of Llama-3 and of Qwen2).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# The chat templates of the model families, as their tokenizer_config.json ship them (only the
# parts that simple system/user/assistant messages exercise matter to our renderer).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}")
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Qwen3-style: no default system prompt.
CHATML_NOSYS_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
DEEPSEEK_R1_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}"
    "{{bos_token}}{{ns.system_prompt}}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}"
    "{{'<\uff5cUser\uff5c>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is not none %}"
    "{% set content = message['content'] %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<\uff5cAssistant\uff5c>' + content + '<\uff5cend\u2581of\u2581sentence\uff5c>'}}{%- endif %}"
    "{%- endfor -%}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<\uff5cAssistant\uff5c><think>\\n'}}{% endif %}")


def training_corpus(seed=1234):
    """A few hundred KB of varied text: English prose, code, numbers, some CJK and emoji."""
    rng = random.Random(seed)
    words = ("the of and to in is that for it as was with be by on not he this are or his from at "
             "which but have an they you were her she there been one all we their has would when "
             "model token serve memory attention cache kernel batch request stream decode encode "
             "pool slot layer head sequence prompt budget eviction score latency throughput GPU "
             "don't it's we're they've I'm you'll she'd Hello World Python Rust function return "
             "value error status result buffer length offset index string number integer float "
             "über café naïve résumé façade Straße mañana niño").split()
    # Pseudo-words from syllables widen the vocabulary so training reaches a few thousand merges.
    syl = ("ka ri to na me lo su pe di ga bu ne ro ti sa mo ku le fi ra ve zo ha ji ch st pr "
           "tr th ing ed er ly tion ous ent al").split()
    words += ["".join(rng.choice(syl) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    cjk = ["你好", "世界", "模型", "注意力", "缓存", "日本語", "テキスト", "한국어", "中文字符"]
    emoji = ["😀", "👍", "🚀", "❤️", "👨‍👩‍👧", "🎉"]
    code = ["def f(x):\n    return x * 2\n", "int main(void) {\n\treturn 0;\n}\n",
            "for (int i = 0; i < n; ++i) sum += a[i];\n", "if x != None and y >= 10:\n    pass\n",
            "const std::string &s = v[\"key\"];\n", "x = {\"a\": [1, 2, 3], 'b': None}\n"]
    lines = []
    for _ in range(20000):
        kind = rng.random()
        if kind < 0.6:
            n = rng.randint(4, 18)
            s = " ".join(rng.choice(words) for _ in range(n))
            s = s[0].upper() + s[1:] + rng.choice([".", "!", "?", ",", ";", ":"])
            if rng.random() < 0.3:
                s += " " + str(rng.randint(0, 10 ** rng.randint(1, 8)))
        elif kind < 0.8:
            s = rng.choice(code)
        elif kind < 0.9:
            s = "".join(rng.choice(cjk) for _ in range(rng.randint(1, 5))) + "。"
        else:
            s = " ".join(rng.choice(words + emoji) for _ in range(rng.randint(2, 8)))
        lines.append(s)
    return lines


# Strings chosen to hit the pre-tokenizer's corners and the byte/char edge cases.
TRICKY = [
    "",
    " ",
    "a",
    "Hello world",
    "Hello, world! How are you today?",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "multiple   spaces   between",
    "tabs\tand\t\ttabs",
    "new\nline",
    "windows\r\nline\r\nendings",
    "\n\n\nthree newlines",
    "mixed \t \n \r\n whitespace  \n\t  runs   ",
    "trailing newlines\n\n",
    "It's, you're, we've, I'm, they'll, she'd, don't, IT'S, YOU'RE",
    "'s 't 're 've 'm 'll 'd",
    "1234567890",
    "3.14159265358979 and 2,718,281,828 and 1e-10",
    "x = 12345678901234567890",
    "phone 555-0199, year 2024, 007",
    "def foo(bar, baz=None):\n    return {'a': [1, 2, 3]}\n",
    "int main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}",
    "if (a && b || !c) { x += y << 2; }",
    "<html><body class=\"x\">&amp;</body></html>",
    "café naïve résumé Straße über",
    "e\u0301 a\u0300 combining: o\u0308\u0304 Z\u0335\u0321a\u0338l\u0337g\u0336o",
    # NFC corners (the Qwen2-style tokenizer normalizes): singleton (Angstrom sign), reordering
    # of marks, a composition exclusion (U+0958), conjoining jamo, Vietnamese stacked marks.
    "A\u030a \u212b \u00c5 a\u0302\u0323 a\u0323\u0302 \u0958 \u0915\u093c",
    "\u1100\u1161\u11a8 \u1112\u1161\u11ab \uac00\u11a8 Vie\u0302\u0323t Nam Tie\u0301ng Vi\u1ec7t",
    "Ελληνικά Кириллица עברית العربية हिन्दी ไทย",
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ、ひらがな",
    "한국어 텍스트입니다",
    "emoji 😀😃😄 and 🚀 rocket",
    "family 👨‍👩‍👧‍👦 and 👩🏽‍💻 and 🏳️‍🌈",
    "skin tones 👍🏻👍🏼👍🏽👍🏾👍🏿",
    "flags 🇺🇸🇯🇵🇩🇪",
    "keycap 1️⃣ #️⃣ and ❤️ variation",
    "math ∑∫∂√∞ ≤ ≥ ≠ ± × ÷ → ⇒",
    "zero\u200bwidth\u200cjoiners\u200d and \ufeffBOM",
    "nbsp\u00a0here and\u3000ideographic space and \u2028 line sep",
    "control \x01\x07\x1b[0m chars",
    "NEL\u0085char",
    "special <|begin_of_text|> inside text",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "no space<|im_end|>after",
    "<s> and </s> look special",
    "<unk> token text",
    "almost special <|im_start and <|im_end| tokens",
    "<0x41> byte token text",
    "▁ metaspace char ▁▁ twice",
    "Mixed中文and English混合text",
    "UPPER lower MiXeD CamelCase snake_case kebab-case",
    "punctuation!!! ??? ... --- *** ### @@@ $$$ %%% ^^^",
    "quotes \"double\" 'single' `back` «guillemets» “curly” ‘single’",
    "url https://example.com/path?q=1&r=two#frag and email a.b@c.de",
    "long word supercalifragilisticexpialidocious antidisestablishmentarianism",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "      ",
    "\t",
    "\n",
    "🧑‍🤝‍🧑🫠🥹 newer emoji",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙 𝟙𝟚𝟛",
    "١٢٣ Arabic-Indic digits and ½ ¾ ² fractions",
]


def byte_level_tokenizer(lines, name, pattern, ignore_merges, nfc):
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|endoftext|>", "<|im_start|>",
                "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cUser\uff5c>",
                "<\uff5cAssistant\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"]
    trainer = trainers.BpeTrainer(vocab_size=3000, min_frequency=2, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(lines, trainer)
    # A non-special added token too, and think tags like the R1 distills (special=false there).
    tok.add_tokens(["<think>", "</think>"])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                      pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                      special_tokens=[("<|begin_of_text|>", bos)]),
    ])
    d = json.loads(tok.to_str())
    # Llama-3 sets ignore_merges (whole words in the vocab win over the merge order).
    d["model"]["ignore_merges"] = ignore_merges
    return Tokenizer.from_str(json.dumps(d, ensure_ascii=False))


def sentencepiece_tokenizer(lines):
    """A BPE with the Llama-2 tokenizer.json layout: ids 0..2 are <unk> <s> </s>, 3..258 the
    <0xXX> byte-fallback tokens, then the merged pieces; no pre-tokenizer at encode time."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    # Training splits on ▁ so merges stay inside words, as sentencepiece's do.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never",
                                                 split=True)
    trainer = trainers.BpeTrainer(vocab_size=2000, min_frequency=2,
                                  special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=120,
                                  show_progress=False)
    tok.train_from_iterator(lines, trainer)
    d = json.loads(tok.to_str())
    old = d["model"]["vocab"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab["<0x%02X>" % b] = len(vocab)
    for piece, _ in sorted(old.items(), key=lambda kv: kv[1]):
        if piece not in vocab:
            vocab[piece] = len(vocab)
    d["model"]["vocab"] = vocab
    # Merges as "a b" strings (the older format) to exercise both forms of the loader.
    d["model"]["merges"] = [m if isinstance(m, str) else " ".join(m) for m in d["model"]["merges"]]
    d["pre_tokenizer"] = None
    d["added_tokens"] = [
        {"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True} for i, c in enumerate(["<unk>", "<s>", "</s>"])]
    d["decoder"] = json.loads(decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(content=" ", left=1, right=0)]).__getstate__())
    d["post_processor"] = json.loads(processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]).__getstate__())
    return Tokenizer.from_str(json.dumps(d, ensure_ascii=False))


def metaspace_variant(sp):
    """The same model in the newer sentencepiece layout (Mistral, Llama-2 with legacy=False):
    no normalizer; a Metaspace pre-tokenizer and decoder that prepend ▁ only at the start."""
    d = json.loads(sp.to_str())
    d["normalizer"] = None
    d["pre_tokenizer"] = json.loads(pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first", split=False).__getstate__())
    d["decoder"] = json.loads(decoders.Sequence([
        decoders.Metaspace(replacement="\u2581", prepend_scheme="first", split=False),
        decoders.ByteFallback(), decoders.Fuse()]).__getstate__())
    return Tokenizer.from_str(json.dumps(d, ensure_ascii=False))


def gpt2_variant(bl):
    """The same byte-level model behind the older single ByteLevel pre-tokenizer (GPT-2 regex
    built in), with add_prefix_space so that path is pinned down too."""
    d = json.loads(bl.to_str())
    d["pre_tokenizer"] = json.loads(pre_tokenizers.ByteLevel(
        add_prefix_space=True, use_regex=True).__getstate__())
    return Tokenizer.from_str(json.dumps(d, ensure_ascii=False))


def references(tok):
    cases = []
    for s in TRICKY:
        ids = tok.encode(s, add_special_tokens=False).ids
        ids_sp = tok.encode(s, add_special_tokens=True).ids
        cases.append({"text": s, "ids": ids, "ids_special": ids_sp,
                      "decode": tok.decode(ids_sp, skip_special_tokens=False),
                      "decode_skip": tok.decode(ids_sp, skip_special_tokens=True)})
    # Decoding ids that are not a valid UTF-8 whole (a lone continuation byte, a cut character)
    # pins down the replacement-character rules.
    rng = random.Random(7)
    n = tok.get_vocab_size(with_added_tokens=True)
    rand = []
    for _ in range(40):
        ids = [rng.randrange(n) for _ in range(rng.randint(1, 12))]
        rand.append({"ids": ids, "decode": tok.decode(ids, skip_special_tokens=False),
                     "decode_skip": tok.decode(ids, skip_special_tokens=True)})
    return {"cases": cases, "random_decode": rand}


CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "system", "content": "  Be kind.\n"}, {"role": "user", "content": " hi \n"},
     {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about 日本語 😀"}],
    [{"role": "user", "content": "Solve x"},
     {"role": "assistant", "content": "<think>\nLet me think.\n</think>\n\nx = 1"},
     {"role": "user", "content": "Thanks"}],
    [{"role": "user", "content": ""}],
]


def chat_references(out):
    from transformers import PreTrainedTokenizerFast
    tok_file = os.path.join(out, "bytelevel_llama3", "tokenizer.json")
    fmts = {
        "llama3": (LLAMA3_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>"),
        "chatml": (CHATML_TEMPLATE, None, "<|im_end|>"),
        "chatml_nosys": (CHATML_NOSYS_TEMPLATE, None, "<|im_end|>"),
        "deepseek_r1": (DEEPSEEK_R1_TEMPLATE, "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
                        "<\uff5cend\u2581of\u2581sentence\uff5c>"),
    }
    ref = {"formats": {}}
    for name, (tmpl, bos, eos) in fmts.items():
        hf = PreTrainedTokenizerFast(tokenizer_file=tok_file, bos_token=bos, eos_token=eos)
        hf.chat_template = tmpl
        cfg = {"bos_token": bos, "eos_token": eos, "chat_template": tmpl,
               "tokenizer_class": "PreTrainedTokenizerFast"}
        renders = []
        for msgs in CHATS:
            for gen in (False, True):
                text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
                renders.append({"messages": msgs, "add_generation_prompt": gen, "text": text})
        ref["formats"][name] = {"renders": renders}
        os.makedirs(os.path.join(out, "chat", name), exist_ok=True)
        dump(os.path.join(out, "chat", name, "tokenizer_config.json"), cfg)
    os.makedirs(os.path.join(out, "chat"), exist_ok=True)
    dump(os.path.join(out, "chat", "reference.json"), ref)


def dump(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=None, separators=(",", ":"))
        f.write("\n")


def unicode_tables(path):
    """engine/tokenizer_unicode.h: the Unicode data the NFC normalizer (Qwen2/Qwen3) needs, from
    Python's unicodedata: canonical combining classes, full canonical decompositions, and the
    primary composites (pairs that NFC recomposes; exclusions and singletons left out)."""
    ccc, dec, comp = [], [], []
    for cp in range(0x110000):
        if 0xD800 <= cp < 0xE000:
            continue
        ch = chr(cp)
        c = unicodedata.combining(ch)
        if c:
            ccc.append((cp, c))
        if 0xAC00 <= cp <= 0xD7A3:
            continue  # Hangul syllables are algorithmic
        d = unicodedata.decomposition(ch)
        if d and not d.startswith("<"):
            dec.append((cp, [ord(x) for x in unicodedata.normalize("NFD", ch)]))
            parts = [int(x, 16) for x in d.split()]
            if len(parts) == 2 and unicodedata.normalize("NFC", ch) == ch:
                comp.append((parts[0], parts[1], cp))
    comp.sort()
    flat, rows = [], []
    for cp, seq in dec:
        rows.append((cp, len(flat), len(seq)))
        flat += seq
    out = ["/* Generated by tools/make_tokenizer_data.py --unicode-tables from Python %s's "
           "unicodedata\n * (Unicode %s). Do not edit. */" % (
               ".".join(map(str, __import__("sys").version_info[:3])), unicodedata.unidata_version),
           "#ifndef LF_TOKENIZER_UNICODE_H", "#define LF_TOKENIZER_UNICODE_H", "#include <stdint.h>",
           "/* (code point, canonical combining class), ccc != 0, sorted */",
           "static const uint32_t UNI_CCC[][2] = {"]
    out += ["  {0x%X, %d}," % r for r in ccc]
    out += ["};", "/* (code point, offset, length) into UNI_DECOMP_CPS: full canonical decomposition */",
            "static const uint32_t UNI_DECOMP[][3] = {"]
    out += ["  {0x%X, %d, %d}," % r for r in rows]
    out += ["};", "static const uint32_t UNI_DECOMP_CPS[] = {"]
    for i in range(0, len(flat), 12):
        out.append("  " + " ".join("0x%X," % x for x in flat[i:i + 12]))
    out += ["};", "/* (first, second, composite), sorted by (first, second) */",
            "static const uint32_t UNI_COMPOSE[][3] = {"]
    out += ["  {0x%X, 0x%X, 0x%X}," % r for r in comp]
    out += ["};", "#endif", ""]
    with open(path, "w") as f:
        f.write("\n".join(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--unicode-tables", metavar="PATH",
                    help="write the NFC tables header (engine/tokenizer_unicode.h) and exit")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests",
                                                   "data", "tokenizers"))
    args = ap.parse_args()
    if args.unicode_tables:
        unicode_tables(args.unicode_tables)
        return
    lines = training_corpus()
    toks = {
        "bytelevel_llama3": (byte_level_tokenizer(lines, "llama3", LLAMA3_PATTERN, True, False),
                             "<|begin_of_text|>", "<|eot_id|>", LLAMA3_TEMPLATE),
        "bytelevel_qwen2": (byte_level_tokenizer(lines, "qwen2", QWEN2_PATTERN, False, True),
                            None, "<|im_end|>", CHATML_TEMPLATE),
        "sentencepiece_llama2": (sentencepiece_tokenizer(lines), "<s>", "</s>", None),
    }
    toks["bytelevel_gpt2"] = (gpt2_variant(toks["bytelevel_llama3"][0]), "<|begin_of_text|>",
                              "<|end_of_text|>", None)
    toks["sentencepiece_metaspace"] = (metaspace_variant(toks["sentencepiece_llama2"][0]), "<s>",
                                       "</s>", None)
    for name, (tok, bos, eos, tmpl) in toks.items():
        d = os.path.join(args.out, name)
        os.makedirs(d, exist_ok=True)
        # Compact JSON keeps the data small; the loader must not care about layout.
        dump(os.path.join(d, "tokenizer.json"), json.loads(tok.to_str()))
        cfg = {"bos_token": bos, "eos_token": eos, "tokenizer_class": "PreTrainedTokenizerFast"}
        if tmpl:
            cfg["chat_template"] = tmpl
        dump(os.path.join(d, "tokenizer_config.json"), cfg)
        dump(os.path.join(d, "reference.json"), references(tok))
    chat_references(args.out)


if __name__ == "__main__":
    main()

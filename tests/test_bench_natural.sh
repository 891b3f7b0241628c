#!/usr/bin/env bash
# `lfbench natural` on SmolLM2-135M-Instruct (tools/smollm2.sh; exit 77 when it cannot be had),
# one prompt, a 32-token answer, CPU backend:
#  - a budget past prompt + answer never evicts, so its logits are the full-KV run's: KL exactly
#    0, top-1 1, no eviction, for every policy (the lockstep and the pools line up);
#  - a budget under the prompt evicts from the prefill on: evictions, KL > 0, for every policy;
#  - int8 policy runs against a bf16 full run (--ref-kv-dtype) differ a little with nothing
#    evicted, and not at all against an int8 one;
#  - bad input (no --model, an unknown or the full policy, a budget list that does not parse)
#    exits non-zero with a message.
set -eu -o pipefail
LFBENCH=${1:?usage: test_bench_natural.sh path/to/lfbench}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
command -v python3 >/dev/null || { echo "python3 not found: skipped"; exit 77; }
G=$(bash "$ROOT/tools/smollm2.sh" 2>/dev/null) || { echo "SmolLM2 GGUF not available: skipped"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

"$LFBENCH" natural --model "$G" --prompts "$ROOT/bench/natural_prompts.txt" --n 1 --max-tokens 32 \
  --policies longflow,h2o,rkv,streaming --budgets 200,40 --rkv-stage 8 --backend cpu \
  --json "$tmp/n.json" --quiet
python3 - "$tmp/n.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["prompts"] == 1 and d["answer_tokens"] == 32, d
runs = d["runs"]
assert len(runs) == 8, len(runs)
for r in runs:
    assert r["status"] == "ok", r
    if r["budget"] == 200:
        assert r["evictions"] == 0 and r["kl"] == 0.0 and r["top1"] == 1.0, r
    else:
        assert r["evictions"] > 0 and r["kl"] > 1e-6, r
        assert 0.0 <= r["top1"] <= 1.0, r
print("lfbench natural: no-eviction runs equal full KV; evicting runs differ:",
      ", ".join("%s %.4f" % (r["policy"], r["kl"]) for r in runs if r["budget"] == 40))
PY

# quantized policy runs against a bf16 full run (--ref-kv-dtype): with nothing evicted the only
# difference is int8's rounding, so KL is small but not 0; against an int8 full run it is 0
"$LFBENCH" natural --model "$G" --prompts "$ROOT/bench/natural_prompts.txt" --n 1 --max-tokens 32 \
  --policies longflow --budgets 200 --kv-dtype int8 --ref-kv-dtype bf16 --backend cpu \
  --json "$tmp/q.json" --quiet
"$LFBENCH" natural --model "$G" --prompts "$ROOT/bench/natural_prompts.txt" --n 1 --max-tokens 32 \
  --policies longflow --budgets 200 --kv-dtype int8 --backend cpu --json "$tmp/q0.json" --quiet
python3 - "$tmp/q.json" "$tmp/q0.json" <<'PY'
import json, sys
q, q0 = (json.load(open(f)) for f in sys.argv[1:3])
assert q["kv_dtype"] == "int8" and q["ref_kv_dtype"] == "bf16", q
assert q0["kv_dtype"] == "int8" and q0["ref_kv_dtype"] == "int8", q0
r, r0 = q["runs"][0], q0["runs"][0]
assert r["evictions"] == 0 and 0.0 < r["kl"] < 0.05 and r["top1"] >= 0.9, r
assert r0["evictions"] == 0 and r0["kl"] == 0.0 and r0["top1"] == 1.0, r0
print("lfbench natural: int8 pools against a bf16 full run, nothing evicted: KL %.2e, top-1 %.3f"
      % (r["kl"], r["top1"]))
PY

fails=0
expect_fail() { # what, then the arguments
  local what=$1
  shift
  if "$LFBENCH" natural "$@" >"$tmp/out" 2>&1; then
    echo "FAIL: $what was accepted"; fails=1
  elif ! grep -q "lfbench natural" "$tmp/out"; then
    echo "FAIL: $what: no message"; cat "$tmp/out"; fails=1
  fi
}
expect_fail "no --model" --max-tokens 8
expect_fail "an unknown policy" --model "$G" --policies lru
expect_fail "the full policy" --model "$G" --policies full
expect_fail "a bad budget list" --model "$G" --budgets 12,x
expect_fail "a missing prompt file" --model "$G" --prompts "$tmp/none.txt"
expect_fail "an unknown reference dtype" --model "$G" --ref-kv-dtype int3
[ $fails = 0 ] && echo "PASS"
exit $fails

#!/usr/bin/env bash
# Smoke test of `lfbench serve` (CPU, random:tiny-llama, about a second; ~35 s under ASan+UBSan
# on a loaded 2-core machine, where the earlier sizes, 2-5x these, took ~175 s): every policy runs every request to
# exactly O tokens (more requests than pools, so some queue), the JSON parses, and the eviction
# count is the exact one.
#   tests/test_bench_serve.sh path/to/lfbench
# Exit 77 (CTest SKIP_RETURN_CODE) when python3 is missing.
set -eu -o pipefail
LFBENCH=${1:?usage: test_bench_serve.sh path/to/lfbench}
command -v python3 >/dev/null || { echo "python3 not found: skipped"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# P < B, so nothing is compressed at prefill: per (sequence, layer, KV head) the pool takes
# P + O - 1 tokens (the last sampled token is never fed) and evicts P + O - 1 - B of them.
P=8 O=12 N=5 B=12
"$LFBENCH" serve --model random:tiny-llama --backend cpu --threads 1 --prompt $P --output $O \
  --requests $N --n-pools 4 --budget $B --policies full,longflow,streaming --arrival poisson \
  --rate 400 --seed 7 --quiet --json "$tmp/serve.json" | tee "$tmp/serve.txt"
python3 - "$tmp/serve.json" $P $O $N $B <<'PY'
import json, sys
path, P, O, N, B = sys.argv[1], *map(int, sys.argv[2:])
d = json.load(open(path))
assert d["bench"] == "serve" and d["backend"] == "cpu" and d["arrival"] == "poisson", d
L, H = d["n_layers"], d["n_kv_heads"]
rows = {r["policy"]: r for r in d["rows"]}
assert sorted(rows) == ["full", "longflow", "streaming"], rows.keys()
for pol, r in rows.items():
    assert r["requests"] == N and r["pools"] == 4, (pol, r)
    assert r["finished_length"] == N and r["finished_other"] == 0 and r["not_finished"] == 0, (pol, r)
    assert r["output_tokens"] == N * O, (pol, r["output_tokens"])
    assert r["tokens_per_s"] > 0 and r["wall_s"] > 0 and r["steps"] >= O, (pol, r)
    assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] and 0 < r["tpot_p50_s"] <= r["tpot_p99_s"], (pol, r)
    f = r["step_fraction"] + r["host_fraction"] + r["idle_fraction"]
    assert abs(f - 1) < 1e-3 and r["step_fraction"] > 0, (pol, f)
    assert r["gpu_busy"] is None and r["mem_peak"] >= r["mem_init"] > 0, (pol, r)
    want = 0 if pol == "full" else N * (P + O - 1 - B) * L * H
    assert r["evictions"] == want, (pol, r["evictions"], want)
assert rows["full"]["budget"] == P + O and rows["longflow"]["budget"] == B
print("bench serve smoke: OK")
PY
# --decode-only-ref: the isolated prefill, decode-only steps, and the mixed passes (the prompt's
# chunks with ref_batch sequences decoding in the same steps): one step per 8-token chunk.
P=16 C=8
"$LFBENCH" serve --model random:tiny-llama --backend cpu --threads 1 --prompt $P --output 8 \
  --requests 3 --n-pools 4 --budget 24 --policies longflow --arrival poisson --rate 400 --seed 7 \
  --max-batch-tokens $C --decode-only-ref --ref-batch 2 --quiet --json "$tmp/ref.json" \
  | tee "$tmp/ref.txt"
grep -q "prompt's passes: alone" "$tmp/ref.txt"
python3 - "$tmp/ref.json" $P $C <<'PY'
import json, sys
path, P, C = sys.argv[1], *map(int, sys.argv[2:])
r = json.load(open(path))["rows"][0]
assert r["ref_batch"] == 2 and r["ref_steps"] > 0 and r["ref_decode_step_ms"] > 0, r
assert r["ref_prefill_steps"] == P // C and r["ref_prefill_step_ms"] > 0, r
assert r["ref_mixed_batch"] == 2 and r["ref_mixed_steps"] == P // C, r
assert r["ref_mixed_step_ms"] > 0, r
print("bench serve --decode-only-ref: OK")
PY

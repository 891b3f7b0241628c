#!/usr/bin/env bash
# `lfbench serve` under mpirun (tensor parallelism on CPU ranks): 2 and 4 ranks generate exactly
# the tokens one rank does (FNV-1a hash of every request's tokens, per policy), report tp in
# the JSON, count the evictions one rank does (every KV head of the model once, whether split
# or replicated over the ranks), and --kv-gb counts per rank (a rank holds 1/T of the KV heads, so T times the pools).
#   tests/test_bench_serve_tp.sh MPIEXEC path/to/lfbench
# Exit 77 (CTest SKIP_RETURN_CODE) when python3 is missing.
set -eu -o pipefail
MPIEXEC=${1:?usage: test_bench_serve_tp.sh MPIEXEC path/to/lfbench}
LFBENCH=${2:?usage: test_bench_serve_tp.sh MPIEXEC path/to/lfbench}
command -v python3 >/dev/null || { echo "python3 not found: skipped"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# random:tiny-llama: 2 KV heads, split by 2 ranks and replicated at 4; a budget below prompt + output,
# so longflow and streaming evict; Poisson arrivals so requests join a running batch; head scope,
# whose evictions do not depend on the split (layer scope is rank-local)
args=(serve --model random:tiny-llama --backend cpu --evict-scope head --prompt 24 --output 80 --budget 40
  --policies full,longflow,streaming --threads 1 --quiet --arrival poisson --rate 400 --seed 7)
"$LFBENCH" "${args[@]}" --n-pools 3 --requests 7 --json "$tmp/np1.json" >"$tmp/np1.txt"
for np in 2 4; do
  "$MPIEXEC" -np $np --oversubscribe "$LFBENCH" "${args[@]}" --n-pools 3 --requests 7 \
    --json "$tmp/np$np.json" >"$tmp/np$np.txt"
done
# pools from --kv-gb: per rank, so 2 ranks hold twice the pools of one
kv=0.0002
"$LFBENCH" "${args[@]}" --kv-gb $kv --requests 4 --policies longflow --json "$tmp/kv1.json" >/dev/null
"$MPIEXEC" -np 2 --oversubscribe "$LFBENCH" "${args[@]}" --kv-gb $kv --requests 4 \
  --policies longflow --json "$tmp/kv2.json" >/dev/null
python3 - "$tmp" <<'PY'
import json, sys
d = sys.argv[1]
runs = {np: json.load(open(f"{d}/np{np}.json")) for np in (1, 2, 4)}
for np, r in runs.items():
    assert r["tp"] == np, (np, r["tp"])
    assert [x["policy"] for x in r["rows"]] == ["full", "longflow", "streaming"], r["rows"]
    for x in r["rows"]:
        assert x["output_tokens"] == 7 * 80 and x["finished_length"] == 7, (np, x)
for i, row in enumerate(runs[1]["rows"]):
    for np in (2, 4):
        other = runs[np]["rows"][i]
        assert other["tokens_fnv1a"] == row["tokens_fnv1a"], \
            f"{row['policy']}: {np} ranks generated other tokens than one rank"
        # evictions over the model's KV heads, each counted once: split (2) or replicated (4)
        assert other["evictions"] == row["evictions"], \
            f"{row['policy']}: {np} ranks count {other['evictions']} evictions, one rank {row['evictions']}"
    if row["policy"] != "full":
        assert row["evictions"] > 0, row  # the budget is below prompt + output
k1, k2 = (json.load(open(f"{d}/kv{n}.json"))["rows"][0] for n in (1, 2))
# half the KV heads (per-head metadata aside)
assert abs(2 * k2["pool_bytes"] - k1["pool_bytes"]) < 0.01 * k1["pool_bytes"], \
    (k1["pool_bytes"], k2["pool_bytes"])
assert k2["pools"] >= 2 * k1["pools"] and k1["pools"] >= 1, (k1["pools"], k2["pools"])
print("lfbench serve under mpirun: 2 and 4 ranks generate the tokens of one;",
      f"--kv-gb per rank: {k1['pools']} pools on 1 rank, {k2['pools']} on 2")
PY

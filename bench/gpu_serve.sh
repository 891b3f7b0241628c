#!/usr/bin/env bash
# Issue 5's GPU figures on one H200, from the repository root: build lfbench, then `lfbench serve`
# on random:llama3-8b, budget 3200, for each run named in RUNS (in order). JSON and text under
# $OUT (default ./out); everything is also packed into $OUT/serve.tgz (the device returns few files).
#   a16k  512 -> 16384, 20 GB KV (x 0.9: full 8 pools of 16896 slots, the others 42 of 3200),
#         all at once, policies POLICIES_A (default full,longflow)
#   b16k  the same for POLICIES_B (default streaming)
#   a4k   512 -> 4096, 40 GB KV, all at once, full,longflow,streaming
#   p4k   512 -> 4096, 20 GB KV, Poisson arrivals (RATE per s, default 1; N requests, default 24),
#         full,longflow,streaming
#   CUDA_VISIBLE_DEVICES=0 RUNS="a16k b16k" bash bench/gpu_serve.sh     (default RUNS: a16k b16k)
set -u -o pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
B=${B:-build-serve-gpu} # B=build-gpu reuses bench/gpu.sh's build
LOG=$OUT/gpu_serve_log.txt
say() { echo "== $*" | tee -a "$LOG"; }
if [ ! -x $B/lfbench ]; then
  say "build ($B, sm_90)"
  cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DLF_MPI=OFF \
    -DLF_TESTS=OFF >>"$LOG" 2>&1 && cmake --build $B -j16 --target lfbench >>"$LOG" 2>&1 ||
    { say "build FAILED"; tail -20 "$LOG"; exit 1; }
fi
rc=0
serve() { # tag, policies, prompt, output, kv-gb, extra options...
  local tag=$1 pol=$2 p=$3 o=$4 kv=$5
  shift 5
  say "lfbench serve $pol: random:llama3-8b, $p -> $o, budget 3200, --kv-gb $kv $*"
  $B/lfbench serve --model random:llama3-8b --backend cuda --prompt "$p" --output "$o" --budget 3200 \
    --kv-gb "$kv" --policies "$pol" "$@" --json "$OUT/serve_h200_llama3-8b_p${p}_o${o}_kv${kv}_$tag.json" \
    >"$OUT/serve_$tag.txt" 2>&1 || { rc=1; say "serve $tag FAILED"; }
  grep -v "^#" "$OUT/serve_$tag.txt" | tail -6 | tee -a "$LOG"
}
for r in ${RUNS:-a16k b16k}; do
  case $r in
    a16k) serve a16k "${POLICIES_A:-full,longflow}" 512 16384 20 ;;
    b16k) serve b16k "${POLICIES_B:-streaming}" 512 16384 20 ;;
    a4k) serve a4k full,longflow,streaming 512 4096 40 ;;
    p4k) serve p4k full,longflow,streaming 512 4096 20 --arrival poisson --rate "${RATE:-1}" \
      --requests "${N:-24}" ;;
    *) say "unknown run $r"; rc=1 ;;
  esac
done
(cd "$OUT" && tar czf serve.tgz serve_*.txt serve_*.json gpu_serve_log.txt 2>/dev/null)
say "done, status $rc"
exit $rc

#!/usr/bin/env bash
# Issue 5's GPU figures on one H200, from the repository root: build lfbench, then `lfbench serve`
# on random:llama3-8b, 512 -> 16384 at the same KV memory (20 GB x 0.9: full 8 pools of 16896
# slots, longflow and streaming 42 pools of 3200), all requests at once, each run to completion;
# then, if RUN1=1, 512 -> 4096 at 40 GB. JSON and text under $OUT (default ./out).
#   CUDA_VISIBLE_DEVICES=0 bash bench/gpu_serve.sh
#   POLICIES_A=full,longflow POLICIES_B=streaming   which policies run in the two commands
set -u -o pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
B=build-serve-gpu
LOG=$OUT/gpu_serve_log.txt
say() { echo "== $*" | tee -a "$LOG"; }
if [ ! -x $B/lfbench ]; then
  say "build ($B, sm_90)"
  cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DLF_MPI=OFF \
    -DLF_TESTS=OFF >>"$LOG" 2>&1 && cmake --build $B -j16 --target lfbench >>"$LOG" 2>&1 ||
    { say "build FAILED"; tail -20 "$LOG"; exit 1; }
fi
rc=0
serve() { # tag, policies, prompt, output, kv-gb
  say "lfbench serve $2: random:llama3-8b, $3 -> $4, budget 3200, --kv-gb $5"
  $B/lfbench serve --model random:llama3-8b --backend cuda --prompt "$3" --output "$4" --budget 3200 \
    --kv-gb "$5" --policies "$2" --json "$OUT/serve_h200_llama3-8b_p$3_o$4_kv$5_$1.json" \
    >"$OUT/serve_$1.txt" 2>&1 || { rc=1; say "serve $1 FAILED"; }
  grep -v "^#" "$OUT/serve_$1.txt" | tail -6 | tee -a "$LOG"
}
serve a "${POLICIES_A:-full,longflow}" 512 16384 20
[ -n "${POLICIES_B:-streaming}" ] && serve b "${POLICIES_B:-streaming}" 512 16384 20
[ "${RUN1:-0}" = 1 ] && serve c full,longflow,streaming 512 4096 40
say "done, status $rc"
exit $rc

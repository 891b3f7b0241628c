#!/usr/bin/env bash
# GPU builds, tests and benchmarks, from the repository root of any NVIDIA machine (one or more
# GPUs; nothing assumes a machine kind or a time limit). Logs and JSON go to $OUT (default ./out).
#
#   bench/run.sh test             build, then ctest -L gpu (kernels vs their CPU twins, the engine,
#                                 the fidelity suite; SmolLM2's when $LF_SMOLLM2_GGUF names its file;
#                                 GPU_TESTS: a ctest -R regex to run only some, BUILD_TARGETS
#                                 the targets to build, default all)
#                                 SANITIZE=1: also compute-sanitizer memcheck + racecheck on a
#                                 subset of gpu_decode_attn
#   bench/run.sh kernel           the torch SDPA peer and `lfbench kernel` (decode attention)
#                                 PROFILE_ATTN=1: also ncu --set full on the batch-1 decode
#                                 attention kernel (budget PROFILE_ATTN_BUDGET, default 1024)
#   bench/run.sh kvq              the quantized pools: `lfbench kernel` per KV dtype (KVQ_DTYPES,
#                                 default "bf16 fp8 int8 int4"; KVQ_KERNEL_ARGS adds options, e.g.
#                                 --batches 128 --budgets 3200) beside the torch SDPA peer, each
#                                 quantized row's time over bf16's;
#                                 then `lfbench serve` on random:llama3-8b, 512 -> 16384, budget
#                                 3200, --kv-gb 20, per dtype (KVQ_SERVE_ARGS replaces --duration 60;
#                                 KVQ_PARTS: "kernel", "serve" or both, the default)
#   bench/run.sh step             `lfbench step`: random 8B decode steps at batch 1 and 64 against
#                                 their weight + KV floor (STEP_ARGS adds options)
#                                 PROFILE=1: also ncu per kernel over one decode step of
#                                 random:llama3-8b at each batch of PROFILE_BATCHES (default "1 64")
#   bench/run.sh tp               NP ranks (default: every GPU; mpirun, else tests/tp_run.sh): the TP
#                                 tests, killed-rank tests, lfgen TP=NP against TP=1, `lfbench
#                                 comm`, `lfbench step --tp` on TP_MODELS (default llama3-8b and
#                                 llama3-70b, which does not fit one GPU) against TP=1, and
#                                 lfserve under mpirun when it was built
#   bench/run.sh serve            `lfbench serve` on random:llama3-8b, 512 -> 4096, full and
#                                 longflow (SERVE_ARGS replaces the options)
#   bench/run.sh ab DIR           DIR holds another source tree (e.g. `git archive REV`): lfgen and
#                                 lfbench of both are built, then lfgen greedy outputs (must be
#                                 bit-identical; short prompts, and 700/1900-token prompts
#                                 chunked over filled pools) and `lfbench step` of both,
#                                 interleaved twice (AB_PARTS: "step", "attn" (`lfbench attn`,
#                                 ATTN_ARGS adds options) or both; add `test` for this tree's gpu
#                                 tests)
#   bench/run.sh prefill          the transformers peer (bench/prefill_peer.py), then `lfbench
#                                 prefill --peer` on random:qwen3-8b: TTFT of B prompts of P tokens,
#                                 P 512..32768, B 1 and 8; each program stops starting rows after
#                                 PREFILL_TIME s (default 120); PREFILL_ARGS / PREFILL_PEER_ARGS
#                                 add options (e.g. --prompts 2048 --batches 1,8 to both)
#   bench/run.sh attn             the torch SDPA peer (bench/sdpa_prefill_peer.py), then `lfbench
#                                 attn --peer`: the prefill attention kernel alone, per tiling,
#                                 chunks of 512..16384 tokens over 0 and 1536 pool slots
#                                 (ATTN_ARGS adds options to both, e.g. --tokens 2048)
#   bench/run.sh serve-poisson    `lfbench serve --decode-only-ref` on random:qwen3-8b, 2048 ->
#                                 SERVE_OUTPUT (default 512) tokens, longflow, Poisson arrivals at
#                                 each rate of SERVE_RATES (default "2 4.5 7"), about SERVE_SPAN s
#                                 of arrivals each (default 40, cut at SERVE_DURATION, default 60),
#                                 the first SERVE_WARMUP s (default 0) left out as warm-up, then
#                                 bench/plot_serve.py (SERVE_POISSON_ARGS adds options)
#   bench/run.sh dp               lfserve's data-parallel replicas over HTTP (bench/http_load.py,
#                                 Poisson arrivals at each rate of DP_RATES, default "4 8 16",
#                                 DP_SPAN s of arrivals each, default 30; DP_PROMPT -> DP_OUTPUT
#                                 tokens, default 2048 -> 512) on DP_MODEL (default
#                                 random:llama3-8b, budget DP_BUDGET, default 3200): one engine
#                                 with DP_KV_GB of pools (default 40) against DP_REPLICAS (default
#                                 2) replicas of TP 1 under mpirun, DP_KV_GB / DP_REPLICAS each,
#                                 sharing the GPUs (one GPU: all on it); tokens/s, TTFT and TPOT
#                                 p50/p99 per rate, bench/results-style JSON per run (DP_BACKEND=cpu
#                                 with a small DP_MODEL and DP_VOCAB: the same on CPU ranks)
#   bench/run.sh smol             SmolLM2's GGUF from the parts of tools/device_deps.sh --smollm2,
#                                 carried one .smol/pN per call (with .smol/SHA256SUMS): copies
#                                 those present to $B/keep (kept while the machine is warm) and,
#                                 once all are there, joins them into $B/keep/smol.gguf, checked
#                                 against the sum
#   bench/run.sh task             SmolLM2 + the trace adapter on the task (docs/TASK.md §10): one
#                                 `lfbench eval --backend cuda --jobs 8 --budget-round 64` per
#                                 entry of TASK_RUNS, "TAG:PROBLEMS:POLICIES:FRACTIONS:DTYPE:MODE"
#                                 with MODE tf (teacher-forced) or free (greedy), optionally
#                                 +km (the adapter's key means) and +lw (its layer weights), e.g.
#                                 "tf20:test.jsonl:h2o,rkv:0.2:bf16:tf+km"; PROBLEMS and tok.json
#                                 from TASK_DATA (default task-data/, git-ignored: name it in a
#                                 call's carry; gen.py's commands are in bench/RESULTS.md) -> $OUT/task_TAG.{json,log} (TASK_ARGS adds
#                                 options; TASK_BACKEND=cpu with B=build tries it here)
#   bench/run.sh targets          the throughput targets of bench/RESULTS.md's table (issue 37),
#                                 each printed against its target by bench/targets.py: h2o's
#                                 prompt steps over LongFlow's (512, 2048, 8192), the 16k run's
#                                 h2o / longflow and layer / head scope, the decode kernel / SDPA,
#                                 the decode step's floors, and the two end-to-end runs
#                                 (TARGETS_DURATION: seconds of each serve run, default 30;
#                                 TARGETS_KV_GB: the last run's pools, default 100, 50 on cards
#                                 under 120 GB)
# Several may be given: `bench/run.sh test step`. Exit status 1 when anything failed.
#
# GoogleTest: the system's, else a source tree carried in build-deps/googletest. PCRE2 (the
# byte-level tokenizers): the system's, else build-deps/libpcre2-dev*.deb unpacked over / (the
# runtime library is part of every Ubuntu base image; only the development files are missing).
# lfserve's libmicrohttpd and cJSON: the system's, else their source tarballs in build-deps/.
set -u -o pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
B=${B:-build-gpu}
J=$(nproc)
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
NP=${NP:-$NGPU}
LOG=$OUT/run_log.txt
touch "$LOG"
say() { echo "== $*" | tee -a "$LOG"; }
rc=0

gtest_prefix() {
  for d in /usr/lib/x86_64-linux-gnu/cmake/GTest /usr/local/lib/cmake/GTest /usr/lib/cmake/GTest; do
    [ -d "$d" ] && return 0
  done
  [ -d build-deps/googletest ] || return 0
  if [ ! -d /tmp/gtest-install ]; then
    cmake -S build-deps/googletest -B /tmp/gtest-build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_INSTALL_PREFIX=/tmp/gtest-install -DBUILD_GMOCK=OFF >>"$LOG" 2>&1 &&
      cmake --build /tmp/gtest-build -j "$J" >>"$LOG" 2>&1 && cmake --install /tmp/gtest-build >>"$LOG" 2>&1
  fi
  echo "-DCMAKE_PREFIX_PATH=/tmp/gtest-install"
}

if [ ! -e /usr/include/pcre2.h ] && ls build-deps/libpcre2-dev*.deb >/dev/null 2>&1; then
  dpkg -x build-deps/libpcre2-dev*.deb / && ldconfig
fi

# dep PC GLOB PREFIX CMD: when pkg-config has no PC, unpack build-deps/GLOB and run CMD in it
# (installing into PREFIX); PREFIX's pkgconfig folder then goes on PKG_CONFIG_PATH.
dep() {
  local pc=$1 glob=$2 prefix=$3 d
  # shellcheck disable=SC2086 # GLOB is a pattern
  if ! pkg-config --exists "$pc" 2>/dev/null && ls build-deps/$glob >/dev/null 2>&1; then
    rm -rf "$prefix-src" && mkdir -p "$prefix-src" && tar xf build-deps/$glob -C "$prefix-src" &&
      (cd "$prefix-src"/*/ && sh -c "$4") >>"$LOG" 2>&1 || say "$pc build FAILED"
  fi
  for d in "$prefix/lib" "$prefix/lib64"; do
    [ -f "$d/pkgconfig/$pc.pc" ] && export PKG_CONFIG_PATH=$d/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  done
  return 0
}
dep libmicrohttpd 'libmicrohttpd_*.orig.tar.*' /tmp/mhd-install "./configure -q \
  --prefix=/tmp/mhd-install --disable-https --disable-doc --disable-examples --disable-curl \
  --disable-static && make -j$J -s && make -s install"
dep libcjson 'cjson_*.orig.tar.*' /tmp/cjson-install "cmake -S . -B build -G Ninja \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=/tmp/cjson-install -DENABLE_CJSON_TEST=OFF \
  -DENABLE_CUSTOM_COMPILER_FLAGS=OFF -DCMAKE_POLICY_VERSION_MINIMUM=3.5 -DBUILD_SHARED_LIBS=OFF \
  -DCMAKE_POSITION_INDEPENDENT_CODE=ON && cmake --build build && cmake --install build"

build() { # SRC BUILD_DIR [TARGET...]
  local src=$1 dir=$2 t0
  shift 2
  local tg=()
  [ $# -gt 0 ] && tg=(--target "$@")
  t0=$(date +%s)
  say "build $src -> $dir (sm_90) ${*:-all}"
  # shellcheck disable=SC2046
  cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    $(gtest_prefix) >>"$LOG.$(basename "$dir")" 2>&1 &&
    cmake --build "$dir" -j "$J" "${tg[@]}" >>"$LOG.$(basename "$dir")" 2>&1 ||
    { say "build of $src FAILED"; grep -E "error" "$LOG.$(basename "$dir")" | head -20; return 1; }
  say "built $dir in $(( $(date +%s) - t0 )) s"
}

run_test() {
  # shellcheck disable=SC2086 # BUILD_TARGETS: a list
  build . "$B" ${BUILD_TARGETS:-} || { rc=1; return; } # always: a warm machine keeps an older build in $B
  say "ctest -L gpu"
  (cd "$B" && ctest -L gpu ${GPU_TESTS:+-R "$GPU_TESTS"} -V --timeout 900) >"$OUT/ctest_gpu.txt" 2>&1 || rc=1
  grep -E "llama|qwen|smollm|decisive|tests passed|FAILED|Failure|Skipped" "$OUT/ctest_gpu.txt" |
    tail -80 | tee -a "$LOG"
  [ -n "${SANITIZE:-}" ] || return
  local filt='*B16_kv2_seq1*:*B1000_*:*B77_*:*B64_kv2_seq4*:*D128_G4_B3200_kv8_seq2*splits0*' tool
  for tool in memcheck racecheck; do
    say "compute-sanitizer --tool $tool"
    compute-sanitizer --tool $tool --error-exitcode 9 "$B/tests/gpu_decode_attn" \
      --gtest_filter="$filt" >"$OUT/sanitizer_$tool.txt" 2>&1 || { rc=1; say "$tool FAILED"; }
    tail -4 "$OUT/sanitizer_$tool.txt" | tee -a "$LOG"
  done
}

run_kernel() {
  [ -x "$B/lfbench" ] || build . "$B" || { rc=1; return; }
  python3 bench/sdpa_peer.py --json "$OUT/sdpa_peer.json" >"$OUT/sdpa_peer.txt" 2>&1 || rc=1
  local peer=()
  [ -s "$OUT/sdpa_peer.json" ] && peer=(--peer "$OUT/sdpa_peer.json")
  "$B/lfbench" kernel "${peer[@]}" --json "$OUT/lfbench_kernel.json" | tee -a "$LOG" || rc=1
  [ -n "${PROFILE_ATTN:-}" ] || return
  # the details page (warp states, memory chart) and the raw page's stall reasons
  say "ncu: decode attention, batch 1, budget ${PROFILE_ATTN_BUDGET:-1024}"
  ncu --clock-control none -k regex:decode_attn_kernel -c 3 --set full --import-source yes \
    -f -o "$OUT/attn_b1" "$B/lfbench" kernel --batches 1 --budgets "${PROFILE_ATTN_BUDGET:-1024}" \
    --iters 3 --warmup 1 >"$OUT/attn_b1_run.txt" 2>&1 || { rc=1; say "ncu FAILED"; return; }
  ncu --import "$OUT/attn_b1.ncu-rep" --page details >"$OUT/attn_b1_details.txt" 2>&1
  ncu --import "$OUT/attn_b1.ncu-rep" --page raw --csv >"$OUT/attn_b1_raw.csv" 2>&1
  python3 bench/ncu_summary.py stalls "$OUT/attn_b1_raw.csv" | tee -a "$LOG"
  grep -E "Duration|Registers|Achieved Occupancy|Warp Cycles Per Issued|DRAM Throughput" \
    "$OUT/attn_b1_details.txt" | head -20 | tee -a "$LOG"
}

run_step() { # BUILD_DIR TAG
  local dir=${1:-$B} tag=${2:-}
  [ -x "$dir/lfbench" ] || build . "$dir" || { rc=1; return; }
  say "lfbench step $tag"
  # shellcheck disable=SC2086
  "$dir/lfbench" step --batches 1,64 ${STEP_ARGS:-} --json "$OUT/lfbench_step$tag.json" 2>&1 |
    grep -v "^# device" | tee -a "$LOG" || rc=1
  [ -n "${PROFILE:-}" ] && [ -z "$tag" ] || return 0
  local pb
  for pb in ${PROFILE_BATCHES:-1 64}; do
    # graphs off so ncu sees the kernels; lfbench step opens the profiled range around its last
    # step only (LF_PROFILE_STEP)
    say "ncu: one decode step of random:llama3-8b, batch $pb"
    LF_CUDA_GRAPHS=0 LF_PROFILE_STEP=1 ncu --clock-control none --profile-from-start off --csv \
      --metrics gpu__time_duration.sum,dram__bytes.sum "$dir/lfbench" step \
      --models random:llama3-8b --batches "$pb" --steps 2 --warmup 1 >"$OUT/ncu_step_b$pb.csv" \
      2>"$OUT/ncu_step_b$pb.err" || { rc=1; say "ncu FAILED"; continue; }
    python3 bench/ncu_summary.py kernels "$OUT/ncu_step_b$pb.csv" | tee -a "$LOG"
  done
}

# launch N CMD...: N ranks through mpirun (every LF_* and NCCL_* setting reaches them) when the
# build has MPI and the machine has mpirun, else through tests/tp_run.sh (NCCL's id in a file)
launch() {
  local n=$1 x=() v
  shift
  if grep -q "LF_HAVE_MPI" "$B/build.ninja" 2>/dev/null && command -v mpirun >/dev/null; then
    for v in $(env | grep -oE '^(LF|NCCL)_[A-Z0-9_]*'); do x+=(-x "$v"); done
    timeout "${LT:-600}" mpirun -np "$n" --oversubscribe "${x[@]}" "$@"
  else
    timeout "${LT:-600}" bash tests/tp_run.sh "$n" "$@"
  fi
}

run_tp() {
  [ "$NP" -ge 2 ] || { say "tp: $NGPU GPU here, nothing to run"; return; }
  [ -x "$B/lfbench" ] || build . "$B" || { rc=1; return; }
  export LF_NCCL_TIMEOUT_S=${LF_NCCL_TIMEOUT_S:-60}
  local how m ids=128000,9906,11,1268,527,499,30 same
  how=$(grep -q "LF_HAVE_MPI" "$B/build.ninja" && command -v mpirun >/dev/null && echo mpirun || echo tp_run)
  say "mpi_gpu_tp at $NP ranks ($how)"
  launch "$NP" "$B/tests/mpi_gpu_tp" >"$OUT/mpi_gpu_tp.txt" 2>&1 || rc=1
  grep -E "PASSED|FAILED" "$OUT/mpi_gpu_tp.txt" | tail -5 | tee -a "$LOG"
  for m in "die 1" "die 0" "hang 1"; do
    say "killed rank: $m"
    # shellcheck disable=SC2086
    sh tests/mpi_gpu_tp_die.sh "$how" 2 "$B/tests/mpi_gpu_tp" $m >"$OUT/die_${m// /_}.txt" 2>&1 ||
      { rc=1; say "$m FAILED"; }
  done
  # greedy tokens of TP=NP against TP=1 on a random model: bf16 meets near-ties, so the count
  # of identical tokens before the first difference is what is judged (100 or more)
  "$B/lfgen" --model random:llama3-8b --backend cuda --prompt-ids $ids --max-tokens 128 \
    --budget 1024 --ignore-eos --print-ids >"$OUT/lfgen_tp1.txt" 2>/dev/null || rc=1
  launch "$NP" "$B/lfgen" --model random:llama3-8b --backend cuda --prompt-ids $ids --max-tokens 128 \
    --budget 1024 --ignore-eos --print-ids >"$OUT/lfgen_tp$NP.txt" 2>/dev/null || rc=1
  same=$(paste -d' ' <(tr -cs '0-9-' '\n' <"$OUT/lfgen_tp1.txt") <(tr -cs '0-9-' '\n' <"$OUT/lfgen_tp$NP.txt") |
    awk 'NF == 2 && $1 == $2 { n++; next } NF { exit } END { print n + 0 }')
  say "lfgen: TP=$NP equals TP=1 for the first $same tokens"
  [ "$same" -ge 100 ] || rc=1
  say "lfbench comm at $NP ranks"
  launch "$NP" "$B/lfbench" comm --json "$OUT/lfbench_comm.json" | tee -a "$LOG" || rc=1
  say "lfbench step: TP=1, then TP=$NP on ${TP_MODELS:=random:llama3-8b,random:llama3-70b}"
  # shellcheck disable=SC2086
  "$B/lfbench" step --models random:llama3-8b --batches 1,64 ${STEP_ARGS:-} \
    --json "$OUT/lfbench_step_tp1.json" | tee -a "$LOG" || rc=1
  # shellcheck disable=SC2086
  launch "$NP" "$B/lfbench" step --tp --models "$TP_MODELS" --batches 1,64 ${STEP_ARGS:-} \
    --json "$OUT/lfbench_step_tp$NP.json" | tee -a "$LOG" || rc=1
  if [ -x "$B/lfserve" ] && [ "$how" = mpirun ]; then
    say "lfserve under mpirun -np 2 --backend cuda"
    timeout 300 python3 tests/server/test_server_mpi.py --lfserve "$B/lfserve" \
      --mpiexec "$(command -v mpirun)" --backend cuda >"$OUT/server_mpi_cuda.txt" 2>&1 || rc=1
    tail -3 "$OUT/server_mpi_cuda.txt" | tee -a "$LOG"
  fi
}

run_serve() {
  [ -x "$B/lfbench" ] || build . "$B" || { rc=1; return; }
  say "lfbench serve"
  # shellcheck disable=SC2086
  "$B/lfbench" serve ${SERVE_ARGS:---model random:llama3-8b --backend cuda --prompt 512 --output 4096 \
    --budget 3200 --kv-gb 40 --policies full,longflow} --json "$OUT/lfbench_serve.json" |
    tee -a "$LOG" || rc=1
}

run_kvq() {
  [ -x "$B/lfbench" ] || build . "$B" || { rc=1; return; }
  local parts=${KVQ_PARTS:-kernel serve} dtypes=${KVQ_DTYPES:-bf16 fp8 int8 int4}
  if [[ $parts == *kernel* ]]; then
    [ -s "$OUT/sdpa_peer.json" ] ||
      python3 bench/sdpa_peer.py --json "$OUT/sdpa_peer.json" >"$OUT/sdpa_peer.txt" 2>&1 || rc=1
    local peer=() dt
    [ -s "$OUT/sdpa_peer.json" ] && peer=(--peer "$OUT/sdpa_peer.json")
    for dt in $dtypes; do
      say "lfbench kernel --kv-dtype $dt"
      # shellcheck disable=SC2086
      "$B/lfbench" kernel --kv-dtype $dt ${KVQ_KERNEL_ARGS:-} "${peer[@]}" \
        --json "$OUT/lfbench_kernel_$dt.json" | grep -v "^# device" | tee -a "$LOG" || rc=1
    done
    # shellcheck disable=SC2086 # dtypes: a list
    python3 - "$OUT" $dtypes <<'PY' | tee -a "$LOG"
import json, sys
dts = sys.argv[2:]
rows = {dt: {(r["batch"], r["budget"]): r for r in json.load(open(f"{sys.argv[1]}/lfbench_kernel_{dt}.json"))["rows"]}
        for dt in dts}
q = [dt for dt in dts if dt != "bf16"]
print("# kernel time of the quantized pools over bf16's (same rows, same run)")
for key, b in rows.get("bf16", {}).items():
    print(f"  batch {key[0]:4d} budget {key[1]:5d}: bf16 {b['time_us']:8.1f} us, "
          + ", ".join(f"{dt} {rows[dt][key]['time_us']:8.1f} us ({rows[dt][key]['time_us'] / b['time_us']:.3f}x, "
                      f"{rows[dt][key]['bw_fraction']:.2f} of copy bw)" for dt in q))
PY
  fi
  [[ $parts == *serve* ]] || return 0
  for dt in $dtypes; do
    say "lfbench serve --kv-dtype $dt"
    # shellcheck disable=SC2086
    "$B/lfbench" serve --model random:llama3-8b --backend cuda --prompt 512 --output 16384 \
      --budget 3200 --kv-gb 20 --policies longflow --kv-dtype $dt ${KVQ_SERVE_ARGS:---duration 60} \
      --json "$OUT/lfbench_serve_$dt.json" 2>&1 | tee -a "$LOG" || rc=1
  done
}

# Prefill against transformers: the peer first (alone on the GPU), then lfbench with its JSON.
run_prefill() {
  build . "$B" lfbench || { rc=1; return; }
  local lim=${PREFILL_TIME:-120}
  say "prefill: transformers peer (bench/prefill_peer.py), at most $lim s of rows"
  # shellcheck disable=SC2086
  python3 bench/prefill_peer.py --shape qwen3-8b --warmup 1 --iters 3 --time-limit "$lim" \
    ${PREFILL_PEER_ARGS:-} --json "$OUT/prefill_peer.json" 2>&1 | tee "$OUT/prefill_peer.txt" |
    tee -a "$LOG" || { rc=1; say "prefill peer FAILED"; }
  local peer=()
  [ -s "$OUT/prefill_peer.json" ] && peer=(--peer "$OUT/prefill_peer.json")
  say "lfbench prefill, at most $lim s of rows"
  # shellcheck disable=SC2086
  "$B/lfbench" prefill --model random:qwen3-8b --backend cuda --warmup 1 --iters 3 \
    --time-limit "$lim" ${PREFILL_ARGS:-} "${peer[@]}" --json "$OUT/lfbench_prefill.json" 2>&1 |
    tee "$OUT/lfbench_prefill.txt" | tee -a "$LOG" || rc=1
}

run_attn() {
  build . "$B" lfbench || { rc=1; return; }
  say "attn: torch SDPA peer (bench/sdpa_prefill_peer.py)"
  # shellcheck disable=SC2086
  python3 bench/sdpa_prefill_peer.py ${ATTN_ARGS:-} --json "$OUT/sdpa_prefill_peer.json" 2>&1 |
    tee "$OUT/sdpa_prefill_peer.txt" | tee -a "$LOG" || { rc=1; say "attn peer FAILED"; }
  local peer=()
  [ -s "$OUT/sdpa_prefill_peer.json" ] && peer=(--peer "$OUT/sdpa_prefill_peer.json")
  say "lfbench attn"
  # shellcheck disable=SC2086
  "$B/lfbench" attn ${ATTN_ARGS:-} "${peer[@]}" --json "$OUT/lfbench_attn.json" 2>&1 |
    tee "$OUT/lfbench_attn.txt" | tee -a "$LOG" || rc=1
}

# TTFT and TPOT against the Poisson arrival rate, with the isolated-prefill and decode-only
# references measured by each run on its own engine; one JSON per rate, then the plot.
# lfserve started under NP ranks (1: alone) with --tp TP, driven by bench/http_load.py at each
# rate of DP_RATES, then stopped through rank 0. dp_serve NAME NP TP KV_GB
dp_serve() {
  local name=$1 np=$2 tp=$3 kv=$4 port=$((18000 + RANDOM % 2000)) log rate n pid
  log="$OUT/dp_${name}_server.txt"
  local cmd=("$B/lfserve" --model "${DP_MODEL:-random:llama3-8b}" --backend "${DP_BACKEND:-cuda}" --port "$port"
    --budget "${DP_BUDGET:-3200}" --kv-memory-gb "$kv" --max-pools 512 --queue-timeout 0)
  say "dp $name: ${cmd[*]} (np $np, tp $tp)"
  if [ "$np" -gt 1 ]; then
    mpirun -np "$np" --oversubscribe -x NCCL_NVLS_ENABLE=0 "${cmd[@]}" --tp "$tp" >"$log" 2>&1 &
  else
    "${cmd[@]}" >"$log" 2>&1 &
  fi
  for _ in $(seq 600); do # up to 300 s for the server to answer /health
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" \
      >/dev/null 2>&1 && break
    sleep 0.5
  done
  grep -E "pools|replicas|serving" "$log" | tee -a "$LOG"
  for rate in ${DP_RATES:-4 8 16}; do
    n=$(awk -v r="$rate" -v s="${DP_SPAN:-30}" 'BEGIN { n = int(r * s + 0.5); print n < 1 ? 1 : n }')
    python3 bench/http_load.py --url "http://127.0.0.1:$port" --requests "$n" --rate "$rate" \
      --prompt "${DP_PROMPT:-2048}" --output "${DP_OUTPUT:-512}" --vocab "${DP_VOCAB:-32000}" \
      --label "$name r$rate" --json "$OUT/dp_${name}_r$rate.json" 2>&1 | tee -a "$LOG" || rc=1
  done
  pid=$(grep -o "pid [0-9]*" "$log" | head -1 | cut -d' ' -f2)
  [ -n "$pid" ] && kill -TERM "$pid"
  wait || true
  tail -2 "$log" | tee -a "$LOG"
}

run_dp() {
  [ -x "$B/lfserve" ] || build . "$B" lfserve_server || { rc=1; return; }
  command -v mpirun >/dev/null || { say "dp: no mpirun here"; return; }
  local n=${DP_REPLICAS:-2} kv=${DP_KV_GB:-40}
  dp_serve one 1 1 "$kv"
  dp_serve "dp${n}" "$n" 1 "$(awk -v k="$kv" -v n="$n" 'BEGIN { print k / n }')"
}

run_serve_poisson() {
  build . "$B" lfbench || { rc=1; return; }
  local rate n files=()
  for rate in ${SERVE_RATES:-2 4.5 7}; do
    n=$(awk -v r="$rate" -v s="${SERVE_SPAN:-40}" 'BEGIN { n = int(r * s + 0.5); print n < 1 ? 1 : n }')
    say "lfbench serve: Poisson $rate/s, $n requests of 2048 -> ${SERVE_OUTPUT:-512} on random:qwen3-8b"
    # shellcheck disable=SC2086
    "$B/lfbench" serve --model random:qwen3-8b --backend cuda --prompt 2048 \
      --output "${SERVE_OUTPUT:-512}" --warmup "${SERVE_WARMUP:-0}" \
      --policies longflow --budget 3200 --n-pools 96 --requests "$n" --arrival poisson \
      --rate "$rate" --duration "${SERVE_DURATION:-60}" --decode-only-ref ${SERVE_POISSON_ARGS:-} \
      --json "$OUT/serve_poisson_r$rate.json" 2>&1 | tee -a "$LOG" || rc=1
    [ -s "$OUT/serve_poisson_r$rate.json" ] && files+=("$OUT/serve_poisson_r$rate.json")
  done
  [ ${#files[@]} -gt 0 ] || return
  python3 bench/plot_serve.py "$OUT/serve_poisson.png" "${files[@]}" 2>&1 | tee -a "$LOG" || rc=1
}

# Greedy token ids of lfgen on a few models, one line per run, for a bit-for-bit comparison.
greedy_ids() { # BUILD_DIR FILE
  local dir=$1 f=$2
  : >"$f"
  for m in random:llama3-8b random:qwen3-8b tests/data/hf_tiny/llama tests/data/hf_tiny/qwen3; do
    for pol in longflow full; do
      echo "$m $pol $("$dir/lfgen" --model "$m" --backend cuda --prompt-ids 1,2,3,4,5,6,7,8 \
        --max-tokens 96 --temperature 0 --policy "$pol" --budget 48 --ignore-eos --print-ids \
        2>/dev/null | tr '\n' ' ')" >>"$f"
    done
  done
  # long prompts, chunked prefill over filled pools (the prefill attention kernel's masked and
  # pool tiles), per pool dtype and policy
  local ids n kv pol bud mn cfg
  for mn in "random:qwen3-8b 1900" "random:tiny-qwen3 700" "random:tiny-qwen3 1900"; do
    read -r m n <<<"$mn"
    ids=$(awk -v n="$n" 'BEGIN { for (i = 0; i < n; i++) printf "%s%d", (i ? "," : ""), (i * 37) % 200 + 1 }')
    for cfg in "bf16 full 2048" "bf16 h2o 256" "k8v4 h2o 256" "int4 rkv 256" "bf16 longflow 256"; do
      read -r kv pol bud <<<"$cfg"
      echo "$m P$n $kv $pol $("$dir/lfgen" --model "$m" --backend cuda --prompt-ids "$ids" \
        --max-tokens 64 --temperature 0 --policy "$pol" --budget "$bud" --kv-dtype "$kv" \
        --max-batch-tokens 256 --ignore-eos --print-ids 2>/dev/null | tr '\n' ' ')" >>"$f"
    done
  done
}

run_ab() { # OTHER_SRC
  local other=$1
  # both at once: the other tree needs only what is timed and compared
  build "$other" "$B-other" lfgen lfbench &
  local pid=$!
  build . "$B" lfgen lfbench || rc=1
  wait "$pid" || rc=1
  [ "$rc" = 0 ] || return
  say "lfgen greedy ids: $other against this tree"
  greedy_ids "$B-other" "$OUT/greedy_other.txt"
  greedy_ids "$B" "$OUT/greedy_this.txt"
  if cmp -s "$OUT/greedy_other.txt" "$OUT/greedy_this.txt"; then
    say "greedy ids bit-identical ($(wc -l <"$OUT/greedy_this.txt") runs)"
  else
    say "greedy ids DIFFER"; diff "$OUT/greedy_other.txt" "$OUT/greedy_this.txt" | head -20; rc=1
  fi
  local part tag dir
  for part in ${AB_PARTS:-step}; do
    for tag in _other _this _other2 _this2; do
      dir=$B
      [ "${tag#_other}" != "$tag" ] && dir=$B-other
      case $part in
      step) run_step "$dir" "$tag" ;;
      attn)
        say "lfbench attn $tag"
        # shellcheck disable=SC2086
        "$dir/lfbench" attn ${ATTN_ARGS:-} --json "$OUT/lfbench_attn$tag.json" 2>&1 |
          grep -v "^# device" | tee -a "$LOG" || rc=1 ;;
      *) say "ab: unknown AB_PARTS part '$part'"; rc=1 ;;
      esac
    done
  done
}

# The throughput targets, each run then printed against its target (bench/targets.py).
run_targets() {
  [ -x "$B/lfbench" ] || build . "$B" lfbench || { rc=1; return; }
  local d=${TARGETS_DURATION:-30} pol
  local serve=("$B/lfbench" serve --backend cuda --quiet)
  for pol in longflow h2o; do
    say "targets: lfbench prefill --policy $pol"
    "$B/lfbench" prefill --model random:qwen3-8b --backend cuda --prompts 512,2048,8192 \
      --batches 1,8 --iters 3 --policy $pol --json "$OUT/tg_prefill_$pol.json" >>"$LOG" 2>&1 || rc=1
  done
  say "targets: the 16k run, layer scope (longflow, h2o) and head scope (longflow)"
  "${serve[@]}" --model random:llama3-8b --prompt 512 --output 16384 --budget 3200 --kv-gb 20 \
    --duration "$d" --policies longflow,h2o --json "$OUT/tg_serve16k_layer.json" >>"$LOG" 2>&1 || rc=1
  "${serve[@]}" --model random:llama3-8b --prompt 512 --output 16384 --budget 3200 --kv-gb 20 \
    --duration "$d" --policies longflow --evict-scope head --json "$OUT/tg_serve16k_head.json" \
    >>"$LOG" 2>&1 || rc=1
  say "targets: decode kernel against torch SDPA"
  [ -s "$OUT/sdpa_peer.json" ] ||
    python3 bench/sdpa_peer.py --json "$OUT/sdpa_peer.json" >"$OUT/sdpa_peer.txt" 2>&1 || rc=1
  local peer=()
  [ -s "$OUT/sdpa_peer.json" ] && peer=(--peer "$OUT/sdpa_peer.json")
  "$B/lfbench" kernel "${peer[@]}" --json "$OUT/tg_kernel.json" >>"$LOG" 2>&1 || rc=1
  say "targets: decode step"
  "$B/lfbench" step --batches 1,64 --json "$OUT/tg_step.json" >>"$LOG" 2>&1 || rc=1
  say "targets: end to end"
  "${serve[@]}" --model random:qwen3-8b --prompt 512 --output 1024 --budget 1024 --n-pools 64 \
    --policies longflow,full --json "$OUT/tg_e2e_qwen3.json" >>"$LOG" 2>&1 || rc=1
  # 100 GB of pools where the card has the memory (H200), else what an 80 GB card holds
  local gb=${TARGETS_KV_GB:-100} mib
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  [ -n "${TARGETS_KV_GB:-}" ] || [ "${mib:-0}" -gt 120000 ] || gb=50
  "${serve[@]}" --model random:llama3-8b --prompt 512 --output 16384 --budget 3200 --kv-gb "$gb" \
    --duration "$d" --policies longflow,h2o,streaming --json "$OUT/tg_e2e_llama3.json" \
    >>"$LOG" 2>&1 || rc=1
  python3 bench/targets.py "$OUT" --json "$OUT/targets.json" | tee -a "$LOG"
}

run_smol() {
  local k=$B/keep f want got
  mkdir -p "$k"
  for f in .smol/p*/part-* .smol/SHA256SUMS; do [ -f "$f" ] && cp "$f" "$k/"; done
  if [ -s "$k/smol.gguf" ]; then say "smol: $k/smol.gguf is there"; return; fi
  want=$(awk 'NR == 1 { print $1 }' "$k/SHA256SUMS" 2>/dev/null)
  [ -n "$want" ] || { say "smol: no SHA256SUMS carried yet (.smol/SHA256SUMS)"; return; }
  if cat "$k"/part-* 2>/dev/null | xz -dc >"$k/smol.tmp" 2>/dev/null &&
    got=$(sha256sum "$k/smol.tmp" | cut -d' ' -f1) && [ "$got" = "$want" ]; then
    mv "$k/smol.tmp" "$k/smol.gguf"
    say "smol: joined $k/smol.gguf (sha256 $got)"
  else
    rm -f "$k/smol.tmp"
    say "smol: parts so far: $(cd "$k" && ls part-* 2>/dev/null | tr '\n' ' ')(not whole yet)"
  fi
}

run_task() {
  local k=$B/keep d=${TASK_DATA:-task-data} spec tag prob pol fr dt mode args t0
  [ -s "$k/smol.gguf" ] || { say "task: no $k/smol.gguf (bench/run.sh smol)"; rc=1; return; }
  [ -s "$d/tok.json" ] || { say "task: no $d/tok.json (TASK_DATA)"; rc=1; return; }
  [ -x "$B/lfbench" ] || build . "$B" lfbench || { rc=1; return; }
  for spec in ${TASK_RUNS:-}; do
    IFS=: read -r tag prob pol fr dt mode <<<"$spec"
    args=(--model "$k/smol.gguf" --lora models/smollm2-trace-lora --tokenizer "$d/tok.json"
      --backend "${TASK_BACKEND:-cuda}" --jobs 8 --max-concurrent 64 --budget-round 64 --quiet
      --problems "$d/$prob" --policies "$pol" --scopes head --fractions "$fr" --kv-dtype "$dt")
    # shellcheck disable=SC2206 # TASK_ARGS: a list
    args+=(${TASK_ARGS:-})
    case $mode in tf*) args+=(--teacher-forced) ;; free*) ;; *) say "task $tag: mode $mode?"; rc=1; continue ;; esac
    case $mode in *+km*) args+=(--key-means models/smollm2-trace-lora/key_means.txt) ;; esac
    case $mode in *+lw*) args+=(--layer-weights models/smollm2-trace-lora/layer_weights.txt) ;; esac
    t0=$(date +%s)
    "$B/lfbench" eval "${args[@]}" --json "$OUT/task_$tag.json" >"$OUT/task_$tag.log" 2>&1 || rc=1
    say "task $tag ($(($(date +%s) - t0)) s): $(grep -E '^(full|h2o|rkv|longflow|streaming) ' "$OUT/task_$tag.log" | tr -s ' ' | tr '\n' ';')"
  done
}

[ $# -ge 1 ] || { sed -n '2,/^# Several may be given/p' "$0"; exit 2; }
say "machine: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1) x $NGPU"
while [ $# -gt 0 ]; do
  case $1 in
  test) run_test ;;
  kernel) run_kernel ;;
  kvq) run_kvq ;;
  step) run_step ;;
  tp) run_tp ;;
  serve) run_serve ;;
  ab) shift; run_ab "$1" ;;
  prefill) run_prefill ;;
  serve-poisson) run_serve_poisson ;;
  dp) run_dp ;;
  attn) run_attn ;;
  targets) run_targets ;;
  smol) run_smol ;;
  task) run_task ;;
  *) echo "bench/run.sh: unknown part '$1'"; exit 2 ;;
  esac
  shift
done
say "exit $rc"
exit $rc

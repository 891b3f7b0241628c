#!/usr/bin/env bash
# GPU builds, tests and benchmarks, from the repository root of any NVIDIA machine (one or more
# GPUs; nothing assumes a machine kind or a time limit). Logs and JSON go to $OUT (default ./out).
#
#   bench/run.sh test             build, then ctest -L gpu (kernels vs their CPU twins, the engine,
#                                 the fidelity suite; SmolLM2's when $LF_SMOLLM2_GGUF names its file)
#   bench/run.sh kernel           the torch SDPA peer and `lfbench kernel` (decode attention)
#   bench/run.sh step             `lfbench step`: random 8B decode steps at batch 1 and 64 against
#                                 their weight + KV floor (STEP_ARGS adds options)
#   bench/run.sh tp               NP ranks (default: every GPU): the TP tests, `lfbench comm`,
#                                 `lfbench step --tp NP` against TP=1
#   bench/run.sh serve            `lfbench serve` on random:llama3-8b, 512 -> 4096, full and
#                                 longflow (SERVE_ARGS replaces the options)
#   bench/run.sh ab DIR           DIR holds another source tree (e.g. `git archive REV`): both are
#                                 built; the gpu tests of this tree, then lfgen greedy outputs
#                                 (must be bit-identical) and `lfbench step` of both, side by side
#   bench/run.sh prefill          `lfbench prefill` and its transformers peer, once they exist
# Several may be given: `bench/run.sh test step`. Exit status 1 when anything failed.
#
# GoogleTest: the system's, else a source tree carried in build-deps/googletest. PCRE2 (the
# byte-level tokenizers): the system's, else build-deps/libpcre2-dev*.deb unpacked over / (the
# runtime library is part of every Ubuntu base image; only the development files are missing).
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
  [ -x "$B/tests/gpu_engine" ] || build . "$B" || { rc=1; return; }
  say "ctest -L gpu"
  (cd "$B" && ctest -L gpu -V --timeout 900) >"$OUT/ctest_gpu.txt" 2>&1 || rc=1
  grep -E "llama|qwen|smollm|decisive|tests passed|FAILED|Failure|Skipped" "$OUT/ctest_gpu.txt" |
    tail -80 | tee -a "$LOG"
}

run_kernel() {
  [ -x "$B/lfbench" ] || build . "$B" || { rc=1; return; }
  python3 bench/sdpa_peer.py --json "$OUT/sdpa_peer.json" >"$OUT/sdpa_peer.txt" 2>&1 || rc=1
  local peer=()
  [ -s "$OUT/sdpa_peer.json" ] && peer=(--peer "$OUT/sdpa_peer.json")
  "$B/lfbench" kernel "${peer[@]}" --json "$OUT/lfbench_kernel.json" | tee -a "$LOG" || rc=1
}

run_step() { # BUILD_DIR TAG
  local dir=${1:-$B} tag=${2:-}
  [ -x "$dir/lfbench" ] || build . "$dir" || { rc=1; return; }
  say "lfbench step $tag"
  # shellcheck disable=SC2086
  "$dir/lfbench" step --batches 1,64 ${STEP_ARGS:-} --json "$OUT/lfbench_step$tag.json" 2>&1 |
    grep -v "^# device" | tee -a "$LOG" || rc=1
}

run_tp() {
  [ "$NP" -ge 2 ] || { say "tp: $NGPU GPU here, nothing to run"; return; }
  [ -x "$B/lfbench" ] || build . "$B" || { rc=1; return; }
  say "mpi_gpu_tp at $NP ranks"
  mpirun -np "$NP" --oversubscribe "$B/tests/mpi_gpu_tp" >"$OUT/mpi_gpu_tp.txt" 2>&1 || rc=1
  grep -E "PASSED|FAILED" "$OUT/mpi_gpu_tp.txt" | tail -5 | tee -a "$LOG"
  say "lfbench comm at $NP ranks"
  mpirun -np "$NP" "$B/lfbench" comm --json "$OUT/lfbench_comm.json" | tee -a "$LOG" || rc=1
  say "lfbench step: TP=1, then TP=$NP"
  # shellcheck disable=SC2086
  "$B/lfbench" step --models random:llama3-8b --batches 1,64 ${STEP_ARGS:-} \
    --json "$OUT/lfbench_step_tp1.json" | tee -a "$LOG" || rc=1
  # shellcheck disable=SC2086
  mpirun -np "$NP" "$B/lfbench" step --models random:llama3-8b --batches 1,64 ${STEP_ARGS:-} \
    --json "$OUT/lfbench_step_tp$NP.json" | tee -a "$LOG" || rc=1
}

run_serve() {
  [ -x "$B/lfbench" ] || build . "$B" || { rc=1; return; }
  say "lfbench serve"
  # shellcheck disable=SC2086
  "$B/lfbench" serve ${SERVE_ARGS:---model random:llama3-8b --backend cuda --prompt 512 --output 4096 \
    --budget 3200 --kv-gb 40 --policies full,longflow} --json "$OUT/lfbench_serve.json" |
    tee -a "$LOG" || rc=1
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
}

run_ab() { # OTHER_SRC
  local other=$1
  # both at once: the other tree needs only what is timed and compared
  build "$other" "$B-other" lfgen lfbench &
  local pid=$!
  build . "$B" || rc=1
  wait "$pid" || rc=1
  [ "$rc" = 0 ] || return
  run_test
  say "lfgen greedy ids: $other against this tree"
  greedy_ids "$B-other" "$OUT/greedy_other.txt"
  greedy_ids "$B" "$OUT/greedy_this.txt"
  if cmp -s "$OUT/greedy_other.txt" "$OUT/greedy_this.txt"; then
    say "greedy ids bit-identical ($(wc -l <"$OUT/greedy_this.txt") runs)"
  else
    say "greedy ids DIFFER"; diff "$OUT/greedy_other.txt" "$OUT/greedy_this.txt" | head -20; rc=1
  fi
  run_step "$B-other" _other
  run_step "$B" _this
  run_step "$B-other" _other2
  run_step "$B" _this2
}

[ $# -ge 1 ] || { sed -n 2,22p "$0"; exit 2; }
say "machine: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1) x $NGPU"
while [ $# -gt 0 ]; do
  case $1 in
  test) run_test ;;
  kernel) run_kernel ;;
  step) run_step ;;
  tp) run_tp ;;
  serve) run_serve ;;
  ab) shift; run_ab "$1" ;;
  prefill) say "prefill: lfbench prefill does not exist yet"; rc=1 ;;
  *) echo "bench/run.sh: unknown part '$1'"; exit 2 ;;
  esac
  shift
done
say "exit $rc"
exit $rc

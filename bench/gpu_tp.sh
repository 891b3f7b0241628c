#!/usr/bin/env bash
# Tensor parallelism on the 2-GPU machine (kind nvidia-h200-x2), from the repository root:
# build, the TP tests, `lfbench comm`, and `lfbench step` TP=1 vs TP=NP (default 2; random:llama3-8b at
# batch 1 and 64; random:llama3-70b, which does not fit one GPU). Logs and JSON under
# $OUT (default ./out); a short table last.
#
#   bench/gpu_tp.sh                 everything (PHASES="build test serve comm step")
#   PHASES="build test" bench/gpu_tp.sh     a part (each phase fits a 10-minute call)
#   STEPS=20 BUDGET=1024            lfbench step options
#   NP=4                            ranks for every TP run (default 2; 4 and 8 for the scaling issues)
#   TP_MODELS=random:llama3-8b      the TP step models (default: llama3-8b and llama3-70b)
#   PHASES="... tpserve"            also lfbench serve at TP=NP: random:llama3-8b, 512 -> 4096, budget
#                                   3200, full and longflow, --kv-gb ${SERVE_KV:-20} per GPU
#   STEP_VARIANTS="LF_CUSTOM_AR LF_CUSTOM_AR+LF_PDL=0"   also the TP step with each setting (graphs on;
#                                   a variant is NAME[=VALUE] joined by +, a bare NAME meaning NAME=1)
#   STEP_VARIANTS_ONLY=1            the step phase runs only the variants (no TP=1 / TP=2 baseline)
#   TEST_ENVS="- LF_CUSTOM_AR=1"    the test phase once per setting ("-": as found; the default)
#
# Ranks are launched by mpirun when the machine has it (and the build found MPI), else by
# tests/tp_run.sh (NCCL's id through a file: lf_comm_init_nccl_env). NVLink multicast stays off.
set -u -o pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
PHASES=${PHASES:-build test serve comm step}
NP=${NP:-2} # ranks (GPUs) for the TP runs: 4 or 8 on the larger kinds (issues 8 and 9)
STEPS=${STEPS:-30}
BUDGET=${BUDGET:-1024}
B=build-tp-gpu
LOG=$OUT/gpu_tp_log.txt
touch "$LOG"
say() { echo "== $*" | tee -a "$LOG"; }
has() { case " $PHASES " in *" $1 "*) return 0 ;; esac; return 1; }
rc=0

# dep PC GLOB PREFIX CMD...: when pkg-config has no PC, unpack build-deps/GLOB and run CMD in its
# source folder (installing into PREFIX); then PREFIX's pkgconfig folder (lib or lib64, by
# distribution) goes on PKG_CONFIG_PATH.
dep() {
  local pc=$1 glob=$2 prefix=$3 d
  shift 3
  if ! pkg-config --exists "$pc" 2>/dev/null && ls build-deps/$glob >/dev/null 2>&1; then
    say "building $pc from build-deps/"
    rm -rf "$prefix-src" && mkdir -p "$prefix-src" && tar xf build-deps/$glob -C "$prefix-src" &&
      (cd "$prefix-src"/*/ && "$@") >>"$LOG" 2>&1 || say "$pc build FAILED"
  fi
  for d in "$prefix/lib" "$prefix/lib64"; do
    [ -f "$d/pkgconfig/$pc.pc" ] && export PKG_CONFIG_PATH=$d/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  done
  return 0
}

if has build; then
  say "machine"
  { nvidia-smi -L; nvidia-smi topo -m; nvcc --version | tail -1; command -v mpirun || echo "no mpirun";
    ls /usr/include/nccl.h /usr/lib/x86_64-linux-gnu/libnccl* 2>&1; } >>"$LOG" 2>&1
  extra=()
  have_gtest=
  for d in /usr/lib/x86_64-linux-gnu/cmake/GTest /usr/local/lib/cmake/GTest /usr/lib/cmake/GTest; do
    [ -d "$d" ] && have_gtest=1
  done
  if [ -z "$have_gtest" ] && [ -d build-deps/googletest ]; then
    say "building googletest from build-deps/googletest"
    cmake -S build-deps/googletest -B /tmp/gtest-build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_INSTALL_PREFIX=/tmp/gtest-install -DBUILD_GMOCK=OFF >>"$LOG" 2>&1 &&
      cmake --build /tmp/gtest-build -j32 >>"$LOG" 2>&1 && cmake --install /tmp/gtest-build >>"$LOG" 2>&1
  fi
  [ -d /tmp/gtest-install ] && extra+=(-DCMAKE_PREFIX_PATH=/tmp/gtest-install)
  # lfserve needs libmicrohttpd and cJSON, the tokenizers PCRE2; a machine without them builds
  # the source tarballs carried in build-deps/ (bench/README.md), each in seconds.
  dep libmicrohttpd 'libmicrohttpd_*.orig.tar.*' /tmp/mhd-install sh -c \
    './configure -q --prefix=/tmp/mhd-install --disable-https --disable-doc --disable-examples \
      --disable-curl --disable-static && make -j32 -s && make -s install'
  dep libpcre2-8 'pcre2_*.orig.tar.*' /tmp/pcre2-install sh -c \
    './configure -q --prefix=/tmp/pcre2-install --disable-shared --with-pic && make -j32 -s && \
      make -s install'
  dep libcjson 'cjson_*.orig.tar.*' /tmp/cjson-install sh -c \
    'cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=/tmp/cjson-install \
      -DENABLE_CJSON_TEST=OFF -DENABLE_CUSTOM_COMPILER_FLAGS=OFF -DCMAKE_POLICY_VERSION_MINIMUM=3.5 -DBUILD_SHARED_LIBS=OFF \
      -DCMAKE_POSITION_INDEPENDENT_CODE=ON && cmake --build build -j32 && cmake --install build'
  say "configure + build ($B, sm_90)"
  t0=$(date +%s)
  cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 "${extra[@]}" \
    >>"$LOG" 2>&1 || { say "configure FAILED"; tail -30 "$LOG"; exit 1; }
  grep -E "NCCL|MPI|mpi_gpu_tp" "$LOG" | tail -5
  targets=(lfbench lfgen mpi_gpu_tp)
  grep -q "lfserve_server" $B/build.ninja && targets+=(lfserve_server)
  cmake --build $B -j32 --target "${targets[@]}" >>"$LOG" 2>&1 ||
    { say "build FAILED"; grep -E "error" "$LOG" | head -30; exit 1; }
  say "build took $(( $(date +%s) - t0 )) s"
fi

# the launcher: mpirun when the build has MPI and the machine has mpirun, else tests/tp_run.sh
if grep -q "LF_HAVE_MPI" $B/build.ninja 2>/dev/null && command -v mpirun >/dev/null; then
  launch() {
    local n=$1 x=()
    shift
    # every LF_* and NCCL_* setting of this shell reaches the ranks
    for v in TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS $(env | grep -oE '^(LF|NCCL)_[A-Z0-9_]*'); do
      [ -n "${!v:-}" ] && x+=(-x "$v")
    done
    timeout "${LT:-300}" mpirun -np "$n" "${x[@]}" "$@"
  }
  launcher=mpirun
else
  launch() { local n=$1; shift; timeout "${LT:-300}" bash tests/tp_run.sh "$n" "$@"; }
  launcher=tp_run
fi
export LF_NCCL_TIMEOUT_S=${LF_NCCL_TIMEOUT_S:-60}

# "A=1+B=0" -> exports A=1 and B=0 (a bare name means =1); "-" exports nothing
set_env() {
  local kv
  [ "$1" = - ] && return 0
  for kv in ${1//+/ }; do
    case $kv in *=*) export "$kv" ;; *) export "$kv=1" ;; esac
  done
}
tag_of() { [ "$1" = - ] && echo default || echo "$1" | tr '+=' '_-'; }

if has test; then
  # the tests once per setting: NCCL all-reduces ("-") and the IPC path with its fused residual
  # all-reduce + RMSNorm (LF_CUSTOM_AR=1); TEST_ENVS overrides
  for te in ${TEST_ENVS:-- LF_CUSTOM_AR=1}; do
  (set_env "$te"
  tg=$(tag_of "$te")
  say "mpi_gpu_tp ($NP ranks, $launcher, settings: $te)"
  launch "$NP" $B/tests/mpi_gpu_tp >"$OUT/mpi_gpu_tp_$tg.txt" 2>&1 || { echo 1 >"$OUT/.rc"; say "mpi_gpu_tp FAILED ($te)"; }
  grep -E "worst logit|vs the fp32|TP equals|OK \]|FAILED|Failure|PASSED|skipped" "$OUT/mpi_gpu_tp_$tg.txt" | tail -40 | tee -a "$LOG"
  for m in "die 1" "die 0" "hang 1"; do
    set -- $m
    say "killed rank: $1 rank $2 ($te)"
    sh tests/mpi_gpu_tp_die.sh $([ $launcher = mpirun ] && echo mpirun || echo tp_run) 2 \
      $B/tests/mpi_gpu_tp "$1" "$2" >"$OUT/die_$1_$2_$tg.txt" 2>&1 || { echo 1 >"$OUT/.rc"; say "die $1 $2 FAILED ($te)"; }
    grep -E "mpi_gpu_tp_die|FAIL|rank" "$OUT/die_$1_$2_$tg.txt" | tail -4 | tee -a "$LOG"
  done
  say "lfgen TP=$NP vs TP=1, random:llama3-8b, greedy 128 tokens ($te)"
  ids=128000,9906,11,1268,527,499,30
  # stdout (the ids) and stderr apart: under mpirun the two streams interleave in any order
  [ -f "$OUT/lfgen_tp1.txt" ] ||
    $B/lfgen --model random:llama3-8b --backend cuda --prompt-ids $ids --max-tokens 128 --budget 1024 --ignore-eos --print-ids \
    >"$OUT/lfgen_tp1.txt" 2>"$OUT/lfgen_tp1.err" || echo 1 >"$OUT/.rc"
  launch "$NP" $B/lfgen --model random:llama3-8b --backend cuda --prompt-ids $ids --max-tokens 128 --budget 1024 --ignore-eos \
    --print-ids >"$OUT/lfgen_tp${NP}_$tg.txt" 2>"$OUT/lfgen_tp${NP}_$tg.err" || echo 1 >"$OUT/.rc"
  # greedy tokens of the two runs: how many agree before the first difference (bf16 on a random
  # model meets near-ties; the issue asks for 100+ identical tokens)
  same=$(python3 - "$OUT/lfgen_tp1.txt" "$OUT/lfgen_tp${NP}_$tg.txt" <<'PY'
import re, sys
def ids(p):
    return [int(x) for x in re.findall(r"-?\d+", open(p).read())]
a, b = ids(sys.argv[1]), ids(sys.argv[2])
n = 0
while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
print("%d of %d" % (n, len(a)))
PY
)
  say "lfgen: TP=$NP tokens equal to TP=1 for the first $same generated tokens ($te)"
  case "$same" in [0-9]\ * | [0-9][0-9]\ *) echo 1 >"$OUT/.rc"; say "lfgen: fewer than 100 identical tokens" ;; esac
  )
  done
  [ -f "$OUT/.rc" ] && { rc=1; rm -f "$OUT/.rc"; }
fi

if has serve; then
  if [ -x $B/lfserve ] && [ $launcher = mpirun ]; then
    say "lfserve under mpirun -np 2 --backend cuda (tests/server/test_server_mpi.py)"
    timeout 300 python3 tests/server/test_server_mpi.py --lfserve $B/lfserve --mpiexec "$(command -v mpirun)" \
      --backend cuda >"$OUT/server_mpi_cuda.txt" 2>&1 || { rc=1; say "server mpi cuda FAILED"; }
    grep -E "^ok|up in|Error|assert" "$OUT/server_mpi_cuda.txt" | tail -12 | tee -a "$LOG"
  else
    say "serve: skipped (no lfserve binary or no mpirun)"
  fi
fi

if has comm; then
  for t in f32 bf16; do
    for ar in 1 0; do
      tag=$([ $ar = 1 ] && echo ipc || echo nccl)
      say "lfbench comm $t, $tag ($launcher; LF_CUSTOM_AR=$ar: small messages by the IPC kernel or NCCL)"
      (export LF_CUSTOM_AR=$ar
       launch "$NP" $B/lfbench comm --comm nccl --type $t --json "$OUT/comm_${tag}_$t.json" \
         >"$OUT/comm_${tag}_$t.txt" 2>&1) || { rc=1; say "comm FAILED"; }
      grep -v "^lfbench" "$OUT/comm_${tag}_$t.txt" | grep -E "^ |^#" | tee -a "$LOG"
    done
  done
fi

if has tpserve; then
  say "lfbench serve at TP=$NP: random:llama3-8b, 512 -> ${SERVE_OUT:-4096}, full and longflow"
  launch "$NP" $B/lfbench serve --model random:llama3-8b --backend cuda --prompt 512 \
    --output "${SERVE_OUT:-4096}" --budget 3200 --kv-gb "${SERVE_KV:-20}" --policies full,longflow \
    --json "$OUT/serve_tp$NP.json" >"$OUT/serve_tp$NP.txt" 2>&1 || { rc=1; say "serve tp$NP FAILED"; }
  grep -v "t=.*running" "$OUT/serve_tp$NP.txt" | tail -8 | tee -a "$LOG"
fi

if has step && [ -z "${STEP_VARIANTS_ONLY:-}" ]; then
  say "lfbench step TP=1, random:llama3-8b"
  $B/lfbench step --models random:llama3-8b --batches 1,64 --budget "$BUDGET" --steps "$STEPS" \
    --json "$OUT/step_tp1.json" >"$OUT/step_tp1.txt" 2>&1 || { rc=1; say "step tp1 FAILED"; }
  say "lfbench step --tp (2 ranks), ${TP_MODELS:-random:llama3-8b,random:llama3-70b}"
  launch "$NP" $B/lfbench step --tp --models "${TP_MODELS:-random:llama3-8b,random:llama3-70b}" --batches 1,64 \
    --budget "$BUDGET" --steps "$STEPS" --json "$OUT/step_tp$NP.json" >"$OUT/step_tp$NP.txt" 2>&1 ||
    { rc=1; say "step tp$NP FAILED"; }
  say "TP=$NP CUDA graphs on (LF_CUDA_GRAPHS_TP=1), random:llama3-8b"
  (export LF_CUDA_GRAPHS_TP=1
   launch "$NP" $B/lfbench step --tp --models random:llama3-8b --batches 1,64 --budget "$BUDGET" \
     --steps "$STEPS" --json "$OUT/step_tp${NP}_graphs.json" >"$OUT/step_tp${NP}_graphs.txt" 2>&1) ||
    { rc=1; say "step tp$NP graphs FAILED"; }
fi
if has step; then
  # opt-in paths, each with graphs on: the IPC all-reduce (LF_CUSTOM_AR=1), PDL (LF_PDL=1)
  # (a variant is "A+B=0": see set_env)
  for v in ${STEP_VARIANTS:-}; do
    vt=$(tag_of "$v")
    say "TP=$NP graphs on, $v, random:llama3-8b"
    (export LF_CUDA_GRAPHS_TP=1
     set_env "$v"
     launch "$NP" $B/lfbench step --tp --models random:llama3-8b --batches 1,64 --budget "$BUDGET" \
       --steps "$STEPS" --json "$OUT/step_tp${NP}_$vt.json" >"$OUT/step_tp${NP}_$vt.txt" 2>&1) ||
      { rc=1; say "step tp$NP $v FAILED"; }
    grep -E "^random|^LF_AR_TIMING" "$OUT/step_tp${NP}_$vt.txt" | tee -a "$LOG"
  done
fi
if has step && [ -z "${STEP_VARIANTS_ONLY:-}" ]; then
  {
    echo "step (ms, median)         batch  TP=1     TP=$NP    TP=$NP+graphs  ratio(TP$NP/TP1)"
    for b in 1 64; do
      t1=$(awk -v b=$b '$1=="random:llama3-8b" && $2==b {print $4}' "$OUT/step_tp1.txt")
      t2=$(awk -v b=$b '$1=="random:llama3-8b" && $2==b {print $4}' "$OUT/step_tp$NP.txt")
      tg=$(awk -v b=$b '$1=="random:llama3-8b" && $2==b {print $4}' "$OUT/step_tp${NP}_graphs.txt")
      r=$(awk -v a="${t1:-0}" -v c="${t2:-0}" 'BEGIN{ if (a > 0) printf "%.3f", c / a; else print "-" }')
      printf "random:llama3-8b          %5s  %-8s %-8s %-12s %s\n" $b "${t1:--}" "${t2:--}" "${tg:--}" "$r"
    done
    for b in 1 64; do
      t2=$(awk -v b=$b '$1=="random:llama3-70b" && $2==b {print $4}' "$OUT/step_tp$NP.txt")
      printf "random:llama3-70b         %5s  %-8s %-8s\n" $b "-" "${t2:--}"
    done
    case $NP in
      2) echo "targets: batch 1 TP2/TP1 <= 0.6; batch 64 throughput TP2 >= 1.8x (ratio <= 0.556)" ;;
      4) echo "targets: batch 1 TP4/TP1 <= 0.35; batch 64 throughput TP4 >= 3.4x (ratio <= 0.294)" ;;
      8) echo "targets: batch 64 throughput TP8 >= 6x TP1 (ratio <= 0.167); the 70B shape's batch-1 step at TP8 <= 0.3x its TP2 step (NP=2 run)" ;;
    esac
  } | tee "$OUT/gpu_tp_table.txt" | tee -a "$LOG"
fi
say "done, status $rc"
# the device tool brings back a limited number of files: pack the per-run logs into one
# (this script's own logs only: $OUT may hold another script's files, still being written)
(cd "$OUT" && ls mpi_gpu_tp*.txt die_*.txt lfgen_tp*.txt server_mpi_cuda.txt comm_*.txt step_tp*.txt \
   serve_tp*.txt gpu_tp_table.txt 2>/dev/null | tar czf tp_logs.tgz -T - --remove-files) 2>/dev/null
exit $rc

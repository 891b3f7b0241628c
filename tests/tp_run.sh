#!/usr/bin/env bash
# A launcher for GPU ranks without MPI (one node), what mpirun does for tests and benchmarks:
#   tests/tp_run.sh N PROGRAM [ARGS...]
# starts N copies with LF_TP_RANK / LF_TP_SIZE / LF_TP_LOCAL_RANK and a fresh LF_TP_ID_FILE
# (lf_comm_init_nccl_env), waits, and as soon as one exits non-zero ends the others (mpirun's
# behaviour, so a failed rank never leaves the rest waiting); exits with the first failure's
# status, 0 when all succeed, 77 when every rank exits 77 (skipped).
set -u
n=$1
shift
dir=$(mktemp -d)
export LF_TP_SIZE=$n LF_TP_ID_FILE=$dir/nccl_id
pids=()
for ((r = 0; r < n; r++)); do
  LF_TP_RANK=$r LF_TP_LOCAL_RANK=$r "$@" &
  pids+=($!)
done
rc=0 skipped=0
while [ "${#pids[@]}" -gt 0 ]; do
  done_pid=
  wait -n -p done_pid "${pids[@]}"
  st=$?
  [ -n "$done_pid" ] || break
  left=()
  for p in "${pids[@]}"; do [ "$p" != "$done_pid" ] && left+=("$p"); done
  pids=("${left[@]}")
  if [ "$st" -eq 77 ]; then skipped=$((skipped + 1)); continue; fi
  if [ "$st" -ne 0 ] && [ "$rc" -eq 0 ]; then
    rc=$st
    echo "tp_run: pid $done_pid exited with status $st: ending the other ranks" >&2
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  fi
done
rm -rf "$dir"
if [ "$rc" -eq 0 ] && [ "$skipped" -eq "$n" ]; then exit 77; fi
exit "$rc"

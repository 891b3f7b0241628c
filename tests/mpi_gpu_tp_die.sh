#!/bin/sh
# GPU ranks (NCCL): a rank that exits, or stops taking part without exiting, during
# tensor-parallel serving must end the whole job with an error within seconds.
#   mpi_gpu_tp_die.sh MPIEXEC NP BINARY die|hang RANK     (MPIEXEC "tp_run": tests/tp_run.sh)
# die: the launcher sees the exit and ends the job. hang: nothing exits; rank 0's next
# collective misses its NCCL deadline (LF_NCCL_TIMEOUT_S, 5 s here), rank 0 fails and exits
# non-zero, and the launcher ends the job. (A hung rank 0 is not covered: a follower waits for
# the next descriptor without a deadline, see parallel/comm_mpi.c and comm_nccl.c.)
mpiexec=$1 np=$2 bin=$3 mode=$4 rank=$5
export LF_NCCL_TIMEOUT_S=5 NCCL_NVLS_ENABLE=0
start=$(date +%s)
if [ "$mpiexec" = tp_run ]; then
  timeout 120 bash "$(dirname "$0")/tp_run.sh" "$np" "$bin" --$mode-rank "$rank" &
else
  timeout 120 "$mpiexec" -np "$np" -x LF_NCCL_TIMEOUT_S -x NCCL_NVLS_ENABLE "$bin" --$mode-rank "$rank" &
fi
job=$!
# a job still running after 60 s is hung: show where the ranks are before timeout ends it
waited=0
while kill -0 $job 2>/dev/null && [ $waited -lt 60 ]; do sleep 1; waited=$((waited + 1)); done
if kill -0 $job 2>/dev/null; then
  for pid in $(pgrep -x "$(basename "$bin" | cut -c1-15)"); do
    echo "---- stacks of pid $pid ($(tr '\0' ' ' </proc/$pid/cmdline 2>/dev/null | cut -c1-80))"
    if command -v gdb >/dev/null; then
      gdb -p "$pid" -batch -ex "thread apply all bt 12" 2>/dev/null | grep -E "^#|^Thread" | head -60
    else
      for t in /proc/$pid/task/*; do echo "$t: $(cat $t/wchan 2>/dev/null)"; done | head -20
    fi
  done
fi
wait $job
rc=$?
took=$(( $(date +%s) - start ))
echo "mpi_gpu_tp_die: rank $rank ($mode) of $np; job ended with status $rc after ${took}s"
if [ "$rc" -eq 77 ]; then echo "skipped: fewer than 2 GPUs"; exit 77; fi
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then echo "FAIL: the job hung"; exit 1; fi
if [ "$rc" -eq 0 ]; then echo "FAIL: the job reported success"; exit 1; fi
if [ "$took" -gt 60 ]; then echo "FAIL: took ${took}s"; exit 1; fi
exit 0

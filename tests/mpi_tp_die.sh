#!/bin/sh
# A rank that exits during tensor-parallel serving must end the whole job with an error within
# seconds, not leave the other ranks blocked in a collective.
#   mpi_tp_die.sh MPIEXEC NP BINARY DIE_RANK
mpiexec=$1 np=$2 bin=$3 die=$4
start=$(date +%s)
timeout 60 "$mpiexec" -np "$np" --oversubscribe "$bin" --die-rank "$die"
rc=$?
took=$(( $(date +%s) - start ))
echo "mpi_tp_die: rank $die of $np exited; job ended with status $rc after ${took}s"
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then echo "FAIL: the job hung"; exit 1; fi
if [ "$rc" -eq 0 ]; then echo "FAIL: the job reported success"; exit 1; fi
if [ "$took" -gt 30 ]; then echo "FAIL: took ${took}s"; exit 1; fi
exit 0

#!/usr/bin/env bash
# ctest shared_exports: the shared library's dynamic symbol table holds only lf_-prefixed
# definitions, among them every function include/lfserve.h declares, and its SONAME is
# versioned. Usage: check_exports.sh LIBLFSERVE.so include/lfserve.h
set -euo pipefail
so=$1 header=$2
fail=0
defined=$(nm -D --defined-only "$so" | awk '{print $NF}' | sed 's/@.*//' | sort -u)
[ -n "$defined" ] || { echo "FAIL: $so exports nothing"; exit 1; }
bad=$(grep -v '^lf_' <<<"$defined" || true)
if [ -n "$bad" ]; then
  echo "FAIL: exported symbols without the lf_ prefix:"; sed 's/^/  /' <<<"$bad" | head -40
  fail=1
fi
# every function the public header declares (a name followed by '(' at the start of a
# declaration whose return type is on the same line)
declared=$(grep -oE '^[a-z_ ]*[a-z_]+ \**(lf_[a-z0-9_]+)\(' "$header" | grep -oE 'lf_[a-z0-9_]+\($' | tr -d '(' | sort -u)
[ "$(wc -l <<<"$declared")" -ge 30 ] || { echo "FAIL: found too few declarations in $header"; exit 1; }
missing=$(comm -23 <(echo "$declared") <(echo "$defined"))
if [ -n "$missing" ]; then
  echo "FAIL: declared in $(basename "$header") but not exported:"; sed 's/^/  /' <<<"$missing"
  fail=1
fi
soname=$(objdump -p "$so" | awk '/SONAME/ {print $2}')
case "$soname" in
  liblfserve.so.[0-9]*) ;;
  *) echo "FAIL: SONAME '$soname' is not liblfserve.so.<version>"; fail=1 ;;
esac
if [ "$fail" -eq 0 ]; then
  echo "PASS: $(wc -l <<<"$defined") exported symbols, all lf_-prefixed; the $(wc -l <<<"$declared") functions of $(basename "$header") among them; SONAME $soname"
fi
exit "$fail"

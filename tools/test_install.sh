#!/usr/bin/env bash
# Installs a build into a temporary prefix and uses it as an outside project would
# (tools/test.sh's "install" stage):
#  1. cmake --install; the libraries, header, CMake package, lfserve.pc and programs are there;
#  2. examples/ built out of tree through find_package(lfserve) (shared, and static:
#     lfserve::lfserve_static) and again through pkg-config;
#  3. examples/generate run on the trace model (models/trace): two requests, streamed text;
#     the installed lfgen gives the same greedy text for the first;
#  4. examples/tp_generate under mpirun -np 2 (CPU ranks over MPI): the same text as one rank.
# Usage: tools/test_install.sh [BUILD_DIR]   (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
root=$(pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
step() { echo "test_install: $*"; }
die() { echo "test_install: FAIL: $*" >&2; exit 1; }

step "cmake --install $build --prefix <tmp>"
cmake --install "$build" --prefix "$prefix" >/dev/null
a=$(cd "$prefix" && find . -name liblfserve.a -print -quit)
[ -n "$a" ] || die "no liblfserve.a installed"
libdir=$(dirname "${a#./}") # lib, or lib/<multiarch> under some prefixes
for f in "$libdir/liblfserve.a" "$libdir/liblfserve.so" include/lfserve.h \
         "$libdir/cmake/lfserve/lfserveConfig.cmake" "$libdir/cmake/lfserve/lfserveConfigVersion.cmake" \
         "$libdir/pkgconfig/lfserve.pc" bin/lfgen; do
  [ -e "$prefix/$f" ] || die "$f not installed"
done
soname=$(objdump -p "$prefix/$libdir/liblfserve.so" | awk '/SONAME/ {print $2}')
[ -e "$prefix/$libdir/$soname" ] || die "the SONAME $soname is not installed"
bash tests/check_exports.sh "$prefix/$libdir/liblfserve.so" include/lfserve.h
step "installed: $(cd "$prefix" && find . -type f -o -type l | sort | tr '\n' ' ')"

# two held-out problems of the trace task as prompts (tools/task/gen.py, standard library)
python3 tools/task/gen.py --n 2 --split demo --seed 7 --min-len 300 --max-len 600 \
  --out "$tmp/problems.jsonl" >/dev/null
python3 - "$tmp" <<'PY'
import json, sys
d = sys.argv[1]
for i, line in enumerate(open(f"{d}/problems.jsonl")):
    open(f"{d}/prompt{i + 1}.txt", "w").write(json.loads(line)["prompt"])
PY
p1=$(cat "$tmp/prompt1.txt"; echo .); p1=${p1%.}
p2=$(cat "$tmp/prompt2.txt"; echo .); p2=${p2%.}
model=$root/models/trace
ntok=96

step "examples through find_package(lfserve)"
cmake -S examples -B "$tmp/cm" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_C_FLAGS="-Wall -Wextra -Werror" -DCMAKE_PREFIX_PATH="$prefix" >"$tmp/cm.log" 2>&1 ||
  { cat "$tmp/cm.log"; die "configuring examples/ failed"; }
cmake --build "$tmp/cm" >"$tmp/cm_build.log" 2>&1 || { cat "$tmp/cm_build.log"; die "building examples/ failed"; }
# ldd's output is captured first: under pipefail, grep -q closing the pipe early can kill ldd
# with SIGPIPE and fail (or, negated, pass) the check whatever it found.
deps=$(ldd "$tmp/cm/generate")
grep -qF "$prefix/$libdir/$soname" <<<"$deps" ||
  { echo "$deps"; die "generate does not load the installed $soname"; }

step "examples through find_package(lfserve), static library"
cmake -S examples -B "$tmp/cms" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLFSERVE_LINK_STATIC=ON \
  -DCMAKE_C_FLAGS="-Wall -Wextra -Werror" -DCMAKE_PREFIX_PATH="$prefix" >"$tmp/cms.log" 2>&1 ||
  { cat "$tmp/cms.log"; die "configuring examples/ (static) failed"; }
cmake --build "$tmp/cms" --target generate >"$tmp/cms_build.log" 2>&1 ||
  { cat "$tmp/cms_build.log"; die "building examples/ (static) failed"; }
deps=$(ldd "$tmp/cms/generate")
! grep -q liblfserve <<<"$deps" || die "the static generate loads liblfserve.so"

step "examples through pkg-config"
export PKG_CONFIG_PATH="$prefix/$libdir/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
mkdir -p "$tmp/pc"
# shellcheck disable=SC2046
cc -Wall -Wextra -Werror examples/generate.c $(pkg-config --cflags --libs lfserve) -o "$tmp/pc/generate"
have_mpi=0
if command -v mpicc >/dev/null 2>&1 && [ -x "$tmp/cm/tp_generate" ]; then
  have_mpi=1
  # shellcheck disable=SC2046
  mpicc -Wall -Wextra -Werror examples/tp_generate.c $(pkg-config --cflags --libs lfserve) \
    -o "$tmp/pc/tp_generate"
fi

step "generate: two requests on models/trace"
LD_LIBRARY_PATH="$prefix/$libdir" "$tmp/pc/generate" "$model" "$p1" "$p2" --max-tokens $ntok \
  >"$tmp/gen.out" 2>"$tmp/gen.err" || { cat "$tmp/gen.err"; die "generate failed"; }
"$tmp/cm/generate" "$model" "$p1" "$p2" --max-tokens $ntok >"$tmp/gen_cm.out" 2>/dev/null ||
  die "generate (find_package build) failed"
"$tmp/cms/generate" "$model" "$p1" "$p2" --max-tokens $ntok >"$tmp/gen_cms.out" 2>/dev/null ||
  die "generate (static build) failed"
cmp -s "$tmp/gen.out" "$tmp/gen_cm.out" && cmp -s "$tmp/gen.out" "$tmp/gen_cms.out" ||
  die "the three builds of generate print different text"
for k in 1 2; do
  grep -q "^\[$k\] finished: " "$tmp/gen.out" || { cat "$tmp/gen.out"; die "request $k did not finish"; }
done
head -8 "$tmp/gen.out" | sed 's/^/  | /'
# the first request's generated text, equal to the installed lfgen's for the same prompt
python3 - "$tmp" <<'PY'
import sys
d = sys.argv[1]
lines = [l[4:] for l in open(f"{d}/gen.out").read().split("\n") if l.startswith("[1] ")]
body = [l for l in lines if not l.startswith(("> ", "finished: "))]
open(f"{d}/gen1.txt", "w").write("\n".join(body))
PY
"$prefix/bin/lfgen" --model "$model" --prompt "$p1" --max-tokens $ntok --temperature 0 \
  >"$tmp/lfgen.out" 2>/dev/null || die "the installed lfgen failed"
python3 - "$tmp" <<'PY' || die "generate's text for request 1 differs from lfgen's"
import sys
d = sys.argv[1]
a = open(f"{d}/gen1.txt").read().strip("\n")
b = open(f"{d}/lfgen.out").read().strip("\n")
if a != b:
    print(f"generate:\n{a[:300]}\nlfgen:\n{b[:300]}")
    sys.exit(1)
print(f"test_install: generate's request 1 equals lfgen's output ({len(a)} characters)")
PY

if [ "$have_mpi" -eq 1 ]; then
  step "tp_generate under mpirun -np 2 (CPU ranks) against -np 1"
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
  export LD_LIBRARY_PATH="$prefix/$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export OMP_NUM_THREADS=1
  timeout 120 mpirun -np 2 "$tmp/pc/tp_generate" "$model" "$p1" --max-tokens $ntok \
    >"$tmp/tp2.out" 2>"$tmp/tp2.err" || { cat "$tmp/tp2.err"; die "mpirun -np 2 tp_generate failed"; }
  timeout 120 mpirun -np 1 "$tmp/cm/tp_generate" "$model" "$p1" --max-tokens $ntok \
    >"$tmp/tp1.out" 2>/dev/null || die "mpirun -np 1 tp_generate failed"
  grep -q "tensor parallel over 2 ranks" "$tmp/tp2.err" || { cat "$tmp/tp2.err"; die "not 2 ranks"; }
  grep -q "^\[finished: " "$tmp/tp2.out" || { cat "$tmp/tp2.out"; die "tp_generate did not finish"; }
  cmp -s "$tmp/tp1.out" "$tmp/tp2.out" || { diff "$tmp/tp1.out" "$tmp/tp2.out" | head; die "2 ranks differ from 1"; }
  step "tp_generate: 2 ranks print the same text as 1 ($(wc -c <"$tmp/tp2.out") bytes)"
else
  step "tp_generate not built (no MPI): skipped"
fi
echo "test_install: PASS"

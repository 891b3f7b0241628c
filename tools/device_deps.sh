#!/usr/bin/env bash
# Prepares, on a Debian/Ubuntu machine with network access, what a GPU machine without network
# needs from this checkout (both directories are git-ignored; carry them):
#
#   build-deps/   GoogleTest's source, the libpcre2-dev package and the upstream source tarballs
#                 of libmicrohttpd and cJSON: bench/run.sh builds from them what the GPU image
#                 lacks (bench/README.md).
#   .smol/pN/     with --smollm2: SmolLM2-135M-Instruct's GGUF (tools/smollm2.sh), xz-compressed
#                 and cut into parts of at most 30 MiB, one part per directory, since a device call
#                 carries at most 64 MiB, this tree included (tools/device_slim.sh leaves
#                 ~20 MB of it). Carry one directory per call, copy each part to a path
#                 the machine keeps between calls (an ignored build directory), then
#                 `cat PARTS... | xz -dc > SmolLM2-135M-Instruct.Q4_1.gguf` and check it with
#                 .smol/SHA256SUMS.
#
#   bash tools/device_deps.sh [--smollm2]
set -euo pipefail
cd "$(dirname "$0")/.."
smol=0
for a in "$@"; do
  case "$a" in
    --smollm2) smol=1 ;;
    *) echo "usage: $0 [--smollm2]" >&2; exit 2 ;;
  esac
done
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
for p in libgtest-dev xz-utils; do
  dpkg -s "$p" >/dev/null 2>&1 || { $SUDO apt-get update -qq; $SUDO apt-get install -y -qq "$p"; }
done
mkdir -p build-deps
cd build-deps
[ -d googletest ] || cp -r /usr/src/googletest googletest
ls libpcre2-dev_*.deb >/dev/null 2>&1 || apt-get download libpcre2-dev 2>/dev/null
if ! ls libmicrohttpd_*.orig.tar.* cjson_*.orig.tar.* >/dev/null 2>&1; then
  # the sources of the distribution this machine runs, through a private apt state (the
  # machine's own sources.list is left as it is)
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  . /etc/os-release
  case "$ID" in
    debian) echo "deb-src http://deb.debian.org/debian $VERSION_CODENAME main" > "$tmp/src.list" ;;
    ubuntu) echo "deb-src http://archive.ubuntu.com/ubuntu $VERSION_CODENAME main universe" > "$tmp/src.list" ;;
    *) echo "device_deps.sh: $ID: fetch libmicrohttpd and cjson source tarballs by hand" >&2; exit 1 ;;
  esac
  mkdir -p "$tmp/lists/partial"
  apt_src=(-o Dir::Etc::SourceList="$tmp/src.list" -o Dir::Etc::SourceParts=/dev/null
           -o Dir::State::Lists="$tmp/lists")
  apt-get "${apt_src[@]}" update -qq
  apt-get "${apt_src[@]}" source --download-only libmicrohttpd cjson 2>/dev/null
  rm -f ./*.dsc ./*.debian.tar.*
fi
ls -l
cd ..
if [ "$smol" = 1 ]; then
  gguf=$(bash tools/smollm2.sh)
  rm -rf .smol && mkdir -p .smol
  xz -T0 -6 -c "$gguf" | split -b 30M -d - .smol/part-
  i=1
  for f in .smol/part-*; do
    mkdir -p ".smol/p$i" && mv "$f" ".smol/p$i/"
    i=$((i + 1))
  done
  (cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > .smol/SHA256SUMS
  ls -l .smol/p*/*
fi
du -sh build-deps

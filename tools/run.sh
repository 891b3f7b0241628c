#!/usr/bin/env bash
# Builds lfserve and generates with the default backend (CUDA where a GPU is present, else CPU).
# Uses stories260K from $LF_TEST_DATA (default ../shared) when present, else the tiny llama model
# the project ships under tests/data. Extra arguments go to lfgen.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/deps.sh
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target lfgen
data="${LF_TEST_DATA:-../shared}"
model="$data/models/stories260K/stories260K.bin"
[ -f "$model" ] || model="tests/data/hf_tiny/llama"
set -x
./build/lfgen --model "$model" --prompt-ids 1 --max-tokens 200 --temperature 0 --policy longflow \
  --budget 64 --print-ids "$@"

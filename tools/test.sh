#!/usr/bin/env bash
# Builds lfserve and runs every test this machine can run:
#  1. release build (CUDA sources compiled and linked wherever nvcc exists), CPU + MPI tests,
#     plus the GPU tests when a GPU is present; then that build installed into a temporary
#     prefix and used from outside (tools/test_install.sh: examples/ through find_package and
#     pkg-config) and the Python package over it (tools/test_python.sh);
#  2. an AddressSanitizer + UndefinedBehaviorSanitizer build of the CPU tests (the server tests
#     among them: lfserve under ASan must exit leak-free), except those labelled `model`;
#  3. short libFuzzer runs (ASan) of the request parser and the tokenizer, where clang can.
# Test data: $LF_TEST_DATA (default ../shared) for stories260K; tests that need it skip without.
# The last line is one overall verdict, "ALL TESTS PASSED" or "TESTS FAILED: <stage> (exit N)",
# which CI greps.
set -euo pipefail
cd "$(dirname "$0")/.."
stage="dependencies"
trap 'rc=$?; if [ "$rc" -eq 0 ]; then echo "ALL TESTS PASSED"; else echo "TESTS FAILED: $stage (exit $rc)"; fi' EXIT
bash tools/deps.sh
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
jobs=$(nproc)

stage="release build"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$jobs"
labels="cpu|mpi"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then labels="cpu|mpi|gpu"; fi
# ctest runs one test per core; OpenMP inside each would oversubscribe the cores.
stage="release tests ($labels)"
OMP_NUM_THREADS=1 ctest --test-dir build -L "$labels" --output-on-failure -j "$jobs"
# The release build installed into a temporary prefix: examples/ built through find_package and
# pkg-config and run (tp_generate under mpirun -np 2), then the Python package over its shared
# library (each ~10 s).
stage="install + examples"
bash tools/test_install.sh build
stage="python package"
bash tools/test_python.sh build

# Short libFuzzer runs of the request parser, the tokenizer, the GGUF parser, the layer
# weights file and the key-means file (ASan), where clang has it.
if command -v clang >/dev/null 2>&1; then
  stage="fuzz build"
  CC=clang CXX=clang++ CFLAGS="-fsanitize=fuzzer-no-link,address -fno-omit-frame-pointer" \
    cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLF_CUDA=OFF -DLF_MPI=OFF \
    -DLF_OPENMP=OFF -DLF_TESTS=OFF
  if cmake --build build-fuzz -j "$jobs" --target fuzz_request fuzz_tokenizer fuzz_gguf fuzz_weights fuzz_key_means; then
    for f in request tokenizer gguf weights key_means; do
      stage="fuzz_$f"
      echo "fuzz_$f:"
      corpus=$(mktemp -d)
      cp fuzz/corpus/$f/* "$corpus"/
      # every line names its fuzzer
      ASAN_OPTIONS=detect_leaks=1 ./build-fuzz/fuzz_$f -max_total_time="${LF_FUZZ_SECONDS:-25}" \
        -max_len=4096 -print_final_stats=1 "$corpus" 2>&1 | tail -4 | sed "s/^/fuzz_$f: /"
      rm -rf "$corpus"
    done
  else
    echo "fuzz targets not built (this clang lacks libFuzzer): skipped"
  fi
fi

stage="sanitizer build"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DLF_SANITIZE=ON -DLF_CUDA=OFF -DLF_OPENMP=OFF
cmake --build build-asan -j "$jobs"
# Label `model` (the trained task model's 2k-token runs, tests/test_task_model.sh): ~30 s in the
# release build, ~35x that under the sanitizers, so left out here.
stage="sanitizer tests (cpu)"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-asan -L cpu -LE model --output-on-failure -j "$jobs"


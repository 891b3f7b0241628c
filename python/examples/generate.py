#!/usr/bin/env python3
"""Streams two prompts' generations through the lfserve Python package, then runs them again
together in one batch.

    python3 python/examples/generate.py MODEL [PROMPT ...] [--max-tokens N] [--backend cpu]

MODEL: a Hugging Face directory or GGUF file carrying a tokenizer (models/trace, or SmolLM2 from
`bash tools/smollm2.sh`). The library is found as python/README.md says (e.g. LFSERVE_LIB).
"""

from __future__ import annotations

import argparse
import sys

import lfserve


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("prompts", nargs="*", default=["Once upon a time", "The best way to learn"])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--budget", type=int, default=0, help="KV slots per pool (0: the context)")
    a = ap.parse_args()
    try:
        with lfserve.Engine(a.model, backend=a.backend, budget=a.budget,
                            n_pools=len(a.prompts)) as engine:
            print(f"lfserve {lfserve.library_version()} ({lfserve.library_path()}), "
                  f"{engine.model_info['model_type']} model", file=sys.stderr)
            streamed = []
            for p in a.prompts:
                print(f"--- {p!r} ---")
                pieces = []
                for piece in engine.stream(p, max_tokens=a.max_tokens):
                    print(piece, end="", flush=True)
                    pieces.append(piece)
                streamed.append("".join(pieces))
                print()
            together = engine.generate_many(a.prompts, max_tokens=a.max_tokens)
            same = "the same text" if together == streamed else "different text"
            print(f"--- the {len(a.prompts)} prompts run together: {same} as one at a time ---")
    except lfserve.LfserveError as e:
        print(f"generate.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

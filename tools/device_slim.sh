#!/usr/bin/env bash
# Shrinks what a device call copies of this checkout (the tracked tree, ~39 MB, against a 64 MiB
# limit per call) to ~20 MB, so a call can carry a part of a model file beside it:
#
#   bash tools/device_slim.sh on    untracks and ignores bench/results and models/trace
#                                   (the GPU builds, tests and benchmarks read neither;
#                                   `git status` shows them as deleted meanwhile)
#   bash tools/device_slim.sh off   tracks them again, exactly as before (nothing else touched)
#
# Never commit while it is on.
set -euo pipefail
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
paths=(bench/results models/trace)
ex=$(git rev-parse --git-path info/exclude)
mark="# device_slim.sh"
case "${1:-}" in
  on)
    grep -q "^$mark" "$ex" 2>/dev/null && { echo "device_slim.sh: already on" >&2; exit 0; }
    git rm -r -q --cached -- "${paths[@]}"
    for p in "${paths[@]}"; do printf '%s\n/%s/\n' "$mark" "$p"; done >> "$ex"
    ;;
  off)
    git reset -q -- "${paths[@]}"
    tmp=$(mktemp)
    awk -v m="$mark" '$0 == m { skip = 1; next } skip { skip = 0; next } { print }' "$ex" > "$tmp"
    cat "$tmp" > "$ex" && rm -f "$tmp"
    ;;
  *) echo "usage: $0 on|off" >&2; exit 2 ;;
esac
git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | awk '{printf "tracked tree: %.1f MB\n", $1 / 1e6}'

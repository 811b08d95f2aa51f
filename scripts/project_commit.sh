#!/usr/bin/env bash
# Prints the commit of this project's checkout (short hash, "-dirty" when tracked files differ
# from it), or "unknown" when the project is not a git checkout of its own: a copy unpacked
# inside some other repository must not report that repository's commit.
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
top="$(git -C "$REPO" rev-parse --show-toplevel 2>/dev/null)" || { echo unknown; exit 0; }
if [[ "$(cd "$top" && pwd -P)" != "$REPO" ]]; then
  echo unknown
  exit 0
fi
commit="$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null)" || { echo unknown; exit 0; }
if [[ -n "$(git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
  commit="$commit-dirty"
fi
echo "$commit"

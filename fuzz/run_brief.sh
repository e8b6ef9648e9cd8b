#!/bin/sh
# Usage: run_brief.sh TARGET SEED_DIR DICT [libFuzzer options...]
# A bounded fuzz run (meson test --suite fuzz): fuzzes TARGET from the seed corpus in a
# fresh scratch corpus (removed afterwards, so the seed folder is never written) with the
# grammar dictionary. Exit status: libFuzzer's (0 when nothing was found).
set -u
target="$1"
seeds="$2"
dict="$3"
shift 3
work=$(mktemp -d "${TMPDIR:-/tmp}/stagejit-fuzz.XXXXXX") || exit 1
mkdir -p "$work/corpus"
"$target" -dict="$dict" -print_final_stats=1 -artifact_prefix="$work/" "$@" "$work/corpus" "$seeds" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  for f in "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-*; do
    [ -e "$f" ] || continue
    keep="$(dirname "$target")/$(basename "$f")"
    cp "$f" "$keep" && echo "run_brief.sh: the input is kept in $keep"
  done
fi
rm -rf "$work"
exit $rc

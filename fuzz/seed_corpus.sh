#!/bin/sh
# Usage: seed_corpus.sh OUT_DIR SOURCE_ROOT FILE.ir...
# Copies every IR file of the repository into OUT_DIR, the seed corpus of the fuzz
# targets, each named after its path (test/ir/graphs/attrs.ir -> test_ir_graphs_attrs.ir).
set -eu
out="$1"
root="$2"
shift 2
rm -rf "$out"
mkdir -p "$out"
for f in "$@"; do
  rel=${f#"$root"/}
  while [ "${rel#../}" != "$rel" ]; do rel=${rel#../}; done  # meson passes build-relative paths
  name=$(printf '%s' "$rel" | sed 's,/,_,g')
  cp "$f" "$out/$name"
done

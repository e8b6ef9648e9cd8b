#!/usr/bin/env bash
# Consumer check: packs this source tree the way a release tarball would be, points a
# wrap file at it (subprojects/packagecache, so nothing is downloaded), then configures,
# builds and runs test/consumer/project, which includes <stagejit/stagejit.hpp>.
# Usage: run.sh SOURCE_ROOT SCRATCH_DIR
set -euo pipefail
src=$(cd "$1" && pwd)
work=$2
rm -rf "$work"
mkdir -p "$work/subprojects/packagecache"
cp -r "$src/test/consumer/project/." "$work/"
tarball="$work/subprojects/packagecache/stagejit-test.tar.gz"
tar -C "$src" --transform 's,^\.,stagejit,' \
  --exclude=./build --exclude='./build*' --exclude=./.git --exclude=./subprojects/packagecache \
  -czf "$tarball" ./meson.build ./meson_options.txt ./include ./src ./subprojects
hash=$(sha256sum "$tarball" | cut -d' ' -f1)
cat > "$work/subprojects/stagejit.wrap" <<WRAP
[wrap-file]
directory = stagejit
source_url = https://example.invalid/stagejit-test.tar.gz
source_filename = stagejit-test.tar.gz
source_hash = $hash

[provide]
stagejit = stagejit_dep
WRAP
cd "$work"
# Built without optimisation or debug info (the consumer's and stagejit's, per subproject):
# what is tested is that a user's project builds and links both ways through the wrap, not
# the speed of the library, and it compiles the library twice (the compiled and the
# header-only shim), so code generation is kept cheap.
meson setup build --wrap-mode=nodownload -Doptimization=0 -Ddebug=false \
  -Dstagejit:optimization=0 -Dstagejit:debug=false >setup.log 2>&1 || { cat setup.log; exit 1; }
meson compile -C build >compile.log 2>&1 || { cat compile.log; exit 1; }
./build/consumer

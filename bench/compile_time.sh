#!/usr/bin/env bash
# bench/compile_time.sh - what a user's translation unit (TU) costs to compile.
#
# Usage: bench/compile_time.sh [BUILD_DIR]     (default: build; run from anywhere)
#
# Compiles five small TUs, one at a time, against this checkout's headers, with the flags
# the build directory uses for examples/burgers_pinn.cpp (its entry in
# BUILD_DIR/compile_commands.json: include paths, defines, -std, warnings), but at -O2 and
# without the precompiled header:
#
#   a) #include <ATen/ATen.h> and one op                       (the reference: ratio 1.00)
#   b) #include <torch/torch.h> and one backward
#   c) #include <stagejit/stagejit.hpp>, nothing used
#   d) c plus compile() used three times and one grad
#   e) d with -DSTAGEJIT_HEADER_ONLY (every function body inline in the TU, as
#      stagejit_header_only_dep builds it)
#
# For each it prints wall seconds and peak memory (/usr/bin/time -f '%e %M') and the ratio
# of both to TU a. Each compile runs under the build lock (flock /tmp/sj-build.lock), so it
# never overlaps another build of this machine's users; time spent waiting for the lock is
# not counted. Still, the results are only meaningful on an IDLE machine: anything else
# running (a test suite, a benchmark, another user's editor) slows the compiler. Record
# results in bench/compile_time.md with the date, the commit and how idle the machine was.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-build}"
case "$build" in /*) ;; *) build="$root/$build" ;; esac
db="$build/compile_commands.json"
[ -f "$db" ] || { echo "compile_time.sh: no $db (run: meson setup build)" >&2; exit 1; }
command -v /usr/bin/time >/dev/null || { echo "compile_time.sh: /usr/bin/time is missing (apt-get install time)" >&2; exit 1; }
lock=/tmp/sj-build.lock

# The compiler and its flags, from the burgers_pinn entry: -O2, no PCH, no dependency
# files, no output or source (added per TU below). Printed one argument per line.
mapfile -t flags < <(python3 - "$db" <<'EOF'
import json, shlex, sys
entries = json.load(open(sys.argv[1]))
entry = next((e for e in entries if e["file"].endswith("examples/burgers_pinn.cpp")), None)
if entry is None:
    sys.exit("compile_time.sh: no entry for examples/burgers_pinn.cpp in " + sys.argv[1] +
             " (configure with -Dexamples=enabled)")
args = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
out, skip = [], 0
for a in args:
    if skip:
        skip -= 1
        continue
    if a in ("-MQ", "-MF", "-MT", "-o", "-include"):   # -include pch.hpp: the PCH
        skip = 1
        continue
    if a in ("-MD", "-MMD", "-c", "-fpch-preprocess", "-Winvalid-pch", "-fdiagnostics-color=always"):
        continue
    if a.startswith("-O") or a.endswith("burgers_pinn.cpp"):
        continue
    if a.startswith("-I") and a[2:].endswith(".p"):     # the target's private folder (PCH)
        continue
    out.append(a)
out.append("-O2")
print(entry["directory"])
print("\n".join(out))
EOF
)
dir="${flags[0]}"
cxx=("${flags[@]:1}")

# The header-only mode needs what the compiled library's bodies were built with
# (meson's bodies_args: -DSTAGEJIT_HAVE_LIBXSMM=1 when LIBXSMM was found).
header_only=(-DSTAGEJIT_HEADER_ONLY)
if python3 - "$db" <<'EOF'
import json, sys
e = [e for e in json.load(open(sys.argv[1])) if e["file"].endswith("compiled_bodies.cpp")]
sys.exit(0 if e and "-DSTAGEJIT_HAVE_LIBXSMM=1" in e[0].get("command", " ".join(e[0].get("arguments", []))) else 1)
EOF
then header_only+=(-DSTAGEJIT_HAVE_LIBXSMM=1); fi

work="$(mktemp -d /tmp/sj-compile-time.XXXXXX)"
trap 'rm -rf "$work"' EXIT

cat >"$work/a_aten.cpp" <<'EOF'
#include <ATen/ATen.h>
at::Tensor f(const at::Tensor& a, const at::Tensor& b) { return at::matmul(a, b); }
EOF
cat >"$work/b_torch.cpp" <<'EOF'
#include <torch/torch.h>
torch::Tensor f(const torch::Tensor& a) {
  auto x = a.detach().requires_grad_(true);
  (x * x).sum().backward();
  return x.grad();
}
EOF
cat >"$work/c_stagejit.cpp" <<'EOF'
#include <stagejit/stagejit.hpp>
EOF
cat >"$work/d_stagejit_compile.cpp" <<'EOF'
#include <stagejit/stagejit.hpp>
namespace sj = stagejit;
at::Tensor f(const at::Tensor& a, const at::Tensor& b) {
  auto f1 = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
    return {sj::sum(sj::tanh(in[0] * in[1]) * sj::sigmoid(in[0]))};
  }, {.derivatives = 2});
  auto f2 = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
    return {sj::mm(in[0], in[1])};
  }, {.derivatives = 1});
  auto f3 = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
    return {sj::mean(sj::relu(in[0]))};
  }, {.derivatives = 0, .fuse = false});
  sj::Variable x(a, true), w(b, true);
  auto y = f1({x, w})[0];
  auto g = sj::grad({y}, {x})[0];
  return g.data() + f2({x, w})[0].data().sum() + f3({x})[0].data();
}
EOF
cp "$work/d_stagejit_compile.cpp" "$work/e_stagejit_header_only.cpp"

names=(a_aten b_torch c_stagejit d_stagejit_compile e_stagejit_header_only)
labels=(
  "a) #include <ATen/ATen.h>, one op"
  "b) #include <torch/torch.h>, one backward"
  "c) #include <stagejit/stagejit.hpp>, nothing used"
  "d) c + compile() x3 + grad"
  "e) d with -DSTAGEJIT_HEADER_ONLY"
)

echo "bench/compile_time.sh: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$root" diff --quiet HEAD -- include 2>/dev/null || echo ' (include/ modified)')"
echo "compiler: $("${cxx[0]}" --version | head -1); $(nproc) cores; load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "flags (from $db, examples/burgers_pinn.cpp): ${cxx[*]:1}"
echo
printf '%-52s %9s %9s %9s %9s %6s\n' "translation unit" "seconds" "peak MB" "time/a" "mem/a" "load"
ref_s="" ref_k=""
for i in "${!names[@]}"; do
  n="${names[$i]}"
  extra=()
  [ "$n" = e_stagejit_header_only ] && extra=("${header_only[@]}")
  # Under the lock: note the 1-minute load average, then compile (timed).
  if ! (cd "$dir" && flock "$lock" bash -c 'cut -d" " -f1 /proc/loadavg >"$1"; shift; exec "$@"' _ "$work/$n.load" \
          /usr/bin/time -f '%e %M' -o "$work/$n.time" \
          "${cxx[@]}" "${extra[@]}" -c "$work/$n.cpp" -o "$work/$n.o" 2>"$work/$n.err"); then
    echo "compile_time.sh: TU ${labels[$i]} failed to compile:" >&2
    cat "$work/$n.err" >&2
    exit 1
  fi
  read -r s k < <(tail -1 "$work/$n.time")
  load="$(cat "$work/$n.load")"
  [ -z "$ref_s" ] && ref_s="$s" ref_k="$k"
  awk -v l="${labels[$i]}" -v s="$s" -v k="$k" -v rs="$ref_s" -v rk="$ref_k" -v ld="$load" \
    'BEGIN { printf "%-52s %9.1f %9.0f %8.2fx %8.2fx %6s\n", l, s, k / 1024, s / rs, k / rk, ld }'
done
echo
echo "seconds: wall time of the compile alone; peak MB: its maximum resident set size; time/a and"
echo "mem/a: ratios to TU a; load: the 1-minute load average when the compile started (an idle"
echo "machine reads near 0: on 2 cores, 1 or more means the compiler shared the CPU)."

#!/bin/sh
# Usage: check_errors.sh STAGEJIT_RUN DIR
# Runs stagejit-run on known-bad files and checks exit status 2 and the exact
# `FILE:line:col: message` line on stderr.
set -u
run="$1"
dir="$2"
fail=0

expect() {  # file expected-stderr-line
  err=$("$run" "$dir/$1" --print 2>&1 >/dev/null)
  rc=$?
  if [ "$rc" -ne 2 ]; then
    echo "FAIL $1: exit status $rc, expected 2"; fail=1
  fi
  case "$err" in
    "$2"*) echo "ok   $1: $err" ;;
    *) echo "FAIL $1: stderr was: $err"; echo "     expected prefix: $2"; fail=1 ;;
  esac
}

expect malformed.ir "$dir/malformed.ir:3:31: expected ',' or ')' after an input, found ';'"
expect lint_error.ir "$dir/lint_error.ir:4:3: lint: node %0 (mul) at stage 0: rule 'stage'"
expect lint_input.ir "$dir/lint_input.ir:2:7: lint: node %h (Param) at stage 0: rule 'handle': graph input %h is a Handle"
# --stage K runs the closures: deterministic for a seed, every stage's outputs printed,
# a stage past the last one rejected with exit status 2.
ex="$dir/../../examples/tanh_mlp.ir"
out1=$("$run" "$ex" --stage 1 --seed 3 --passes cse,dce,fuse 2>/dev/null); rc1=$?
out2=$("$run" "$ex" --stage 1 --seed 3 2>/dev/null); rc2=$?
if [ $rc1 -ne 0 ] || [ $rc2 -ne 0 ]; then
  echo "FAIL --stage 1: exit status $rc1 / $rc2: $out1"; fail=1
fi
for want in "---- stage 0 outputs" "%y : Float(4, 2) =" "---- stage 1 inputs (ones)" \
            "---- stage 1 outputs" "%gw1 : Float(3, 5) =" "%gb2 : Float(2) ="; do
  case "$out1" in *"$want"*) ;; *) echo "FAIL --stage 1: no '$want' in output"; fail=1 ;; esac
done
# Fused and unfused runs print the same numbers to ATen's printed precision.
[ "$out1" = "$out2" ] || { echo "FAIL --stage 1: fused and unfused outputs differ"; fail=1; }
[ $fail -eq 0 ] && echo "ok   --stage 1 runs both stages, fused = unfused"
err=$("$run" "$ex" --stage 2 2>&1 >/dev/null); rc=$?
case "$rc:$err" in
  "2:$ex: --stage 2: the graph has 2 stages (0..1)"*) echo "ok   --stage 2: $err" ;;
  *) echo "FAIL --stage 2: exit status $rc, stderr: $err"; fail=1 ;;
esac
# Issue 34: lint checks ops against the op table (unknown ops refused unless kept, arity,
# chunk's chunks, elementwise declared types), at the node's line:column.
expect unknown_op.ir "$dir/unknown_op.ir:2:3: lint: node %y (frobnicate) at stage 0: rule 'unknown-op': op 'frobnicate' is not in the op table"
expect op_arity.ir "$dir/op_arity.ir:2:3: lint: node %y (tanh) at stage 0: rule 'op-arity': tanh takes 1 input, found 2"
expect chunk_zero.ir "$dir/chunk_zero.ir:2:3: lint: node %a (chunk) at stage 0: rule 'op-attribute': chunk's attribute 'chunks' is 0; it must be >= 1"
expect declared_type_lint.ir "$dir/declared_type_lint.ir:2:3: lint: node %y (tanh) at stage 0: rule 'declared-type': output %y is declared Float(2, 3), but tanh of (%x : Float(4)) gives Float(4)"
out=$("$run" "$dir/unknown_op.ir" --allow-unknown-ops --print 2>&1); rc=$?
case "$rc:$out" in
  "0:graph(%x : Float(2))"*frobnicate*) echo "ok   --allow-unknown-ops keeps the unknown op" ;;
  *) echo "FAIL --allow-unknown-ops: exit status $rc, output: $out"; fail=1 ;;
esac
# A byte-order mark: skipped at the start of the file, an error elsewhere.
err=$("$run" "$dir/bom.ir" 2>&1); rc=$?
[ "$rc:$err" = "0:$dir/bom.ir: ok (1 stages, 1 nodes)" ] && echo "ok   bom.ir: $err" || { echo "FAIL bom.ir: exit status $rc, stderr: $err"; fail=1; }
expect bom_inside.ir "$dir/bom_inside.ir:3:3: unexpected UTF-8 byte-order mark (U+FEFF): one is only allowed at the start of the file"
# expect_run FILE ARGS... EXPECTED: exit status 2 and stderr starting with EXPECTED.
expect_run() {
  f="$1"; want="$2"; shift 2
  err=$("$run" "$dir/$f" "$@" 2>&1 >/dev/null); rc=$?
  case "$rc:$err" in
    "2:$want"*) echo "ok   $f $*: $err" ;;
    *) echo "FAIL $f $*: exit status $rc, stderr: $err"; echo "     expected: $want"; fail=1 ;;
  esac
}
# --stage checks each computed value against its declared type, naming value, node, types.
expect_run declared_type_run.ir "$dir/declared_type_run.ir: value %y (node %y = mm (line 3, column 3)) is computed as Float(2, 4) (a Float tensor of sizes [2, 4]) but is declared Float(2, 5)" --stage 0
# An input too large to allocate: its name, type and bytes.
expect_run huge_input.ir "$dir/huge_input.ir: stage 0 input %big : Float(1000000000, 1000000000) needs 4000000000000000000 bytes (3.47 EiB), more than this machine's memory" --stage 0
# --stage out of range or not a number: a usage error (status 1) saying so.
for bad in -1 99999999999999999999 1048576; do
  err=$("$run" "$ex" --stage "$bad" 2>&1 >/dev/null); rc=$?
  case "$rc:$err" in
    "1:--stage: stage $bad is out of range: a stage number is 0 to 1048575"*) echo "ok   --stage $bad: $err" ;;
    *) echo "FAIL --stage $bad: exit status $rc, stderr: $err"; fail=1 ;;
  esac
done
err=$("$run" "$ex" --stage two 2>&1 >/dev/null); rc=$?
case "$rc:$err" in
  "1:--stage: 'two' is not a stage number"*) echo "ok   --stage two: $err" ;;
  *) echo "FAIL --stage two: exit status $rc, stderr: $err"; fail=1 ;;
esac
# A chain of 100 000 nodes parses, lints, prints and goes through the passes.
chain="${TMPDIR:-/tmp}/stagejit_chain_$$.ir"
awk 'BEGIN { n = 100000; print "graph(%0 : Float(2)) {";
             for (i = 1; i <= n; i++) printf "  %%%d : Float(2) = neg(%%%d);\n", i, i - 1;
             printf "  return (%%%d);\n}\n", n }' > "$chain"
err=$("$run" "$chain" 2>&1); rc=$?
case "$rc:$err" in
  "0:$chain: ok (1 stages, 100000 nodes)") echo "ok   100000-node chain" ;;
  *) echo "FAIL 100000-node chain: exit status $rc, stderr: $err"; fail=1 ;;
esac
lines=$("$run" "$chain" --passes cse,dce --print 2>/dev/null | wc -l); rc=$?
[ "$lines" -eq 100003 ] && echo "ok   100000-node chain printed" || { echo "FAIL 100000-node chain --print: $lines lines"; fail=1; }
rm -f "$chain"
"$run" "$dir/does_not_exist.ir" >/dev/null 2>&1
[ $? -eq 1 ] || { echo "FAIL missing file: expected exit status 1"; fail=1; }
exit $fail

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
"$run" "$dir/does_not_exist.ir" >/dev/null 2>&1
[ $? -eq 1 ] || { echo "FAIL missing file: expected exit status 1"; fail=1; }
exit $fail

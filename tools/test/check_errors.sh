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
"$run" "$dir/does_not_exist.ir" >/dev/null 2>&1
[ $? -eq 1 ] || { echo "FAIL missing file: expected exit status 1"; fail=1; }
exit $fail

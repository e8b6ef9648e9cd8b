#!/bin/sh
# Usage: check_weights.sh BURGERS_PINN PINN_RESOLUTION
# A short training run writes its weights (--save-weights); bench/pinn_resolution reads
# them back. Early in training the descent along the gradient is far above the float
# loss's rounding, and the tool must say so; a file that is not a weights file, a
# missing file and an unwritable --save-weights path are refused with a message.
set -u
pinn="$1"
res="$2"
dir=$(mktemp -d) || { echo "FAIL: mktemp -d"; exit 1; }
trap 'rm -rf "$dir"' EXIT
trap 'exit 1' INT TERM
fail=0

out=$("$pinn" --adam 5 --lbfgs 5 --report-every 5 --collocation 500 --save-weights "$dir/w.pt" 2>&1); rc=$?
if [ $rc -ne 0 ] || [ ! -s "$dir/w.pt" ]; then
  echo "FAIL burgers_pinn --save-weights: exit status $rc, file: $(ls -l "$dir/w.pt" 2>&1)"; echo "$out"; fail=1
fi
case "$out" in *"weights (compiled run, double): $dir/w.pt"*) ;; *) echo "FAIL: no 'weights (...)' line"; fail=1 ;; esac

out=$("$res" --weights "$dir/w.pt" --collocation 500 2>&1); rc=$?
echo "$out"
[ $rc -eq 0 ] || { echo "FAIL pinn_resolution: exit status $rc"; fail=1; }
for want in "loss in double" "float, staged compiled" "float, libtorch" "largest decrease in double" \
            "above a float evaluation's rounding of the loss"; do
  case "$out" in *"$want"*) ;; *) echo "FAIL pinn_resolution: no '$want' in its output"; fail=1 ;; esac
done

# A file that is not a weights file, a missing file, an unwritable --save-weights path.
printf 'not a tensor archive' > "$dir/bad.pt"
err=$("$res" --weights "$dir/bad.pt" 2>&1 >/dev/null); rc=$?
[ $rc -eq 1 ] && case "$err" in "error: "*) true ;; *) false ;; esac ||
  { echo "FAIL pinn_resolution on a bad file: exit status $rc, stderr: $err"; fail=1; }
err=$("$res" --weights "$dir/missing.pt" 2>&1 >/dev/null); rc=$?
[ $rc -eq 2 ] && case "$err" in "error: "*) true ;; *) false ;; esac ||
  { echo "FAIL pinn_resolution on a missing file: exit status $rc, stderr: $err"; fail=1; }
# The early check of --save-weights neither truncates a file already there nor leaves a
# new empty one when the run stops before training (here on a bad --plot path).
printf 'keep' > "$dir/keep.pt"
"$pinn" --adam 1 --save-weights "$dir/keep.pt" --plot "$dir/no/such/dir/p.png" >/dev/null 2>&1; rc=$?
[ $rc -eq 2 ] && [ "$(cat "$dir/keep.pt")" = keep ] ||
  { echo "FAIL: --save-weights with a bad --plot: exit status $rc, file now: $(cat "$dir/keep.pt")"; fail=1; }
"$pinn" --adam 1 --save-weights "$dir/new.pt" --plot "$dir/no/such/dir/p.png" >/dev/null 2>&1
[ ! -e "$dir/new.pt" ] || { echo "FAIL: a run stopped before training left $dir/new.pt"; fail=1; }
err=$("$pinn" --adam 1 --lbfgs 0 --collocation 100 --save-weights "$dir/no/such/dir/w.pt" 2>&1 >/dev/null); rc=$?
[ $rc -eq 2 ] && case "$err" in "error: cannot write weights file"*) true ;; *) false ;; esac ||
  { echo "FAIL burgers_pinn --save-weights to a bad path: exit status $rc, stderr: $err"; fail=1; }

[ $fail -eq 0 ] && echo "ok   weights written, read back; bad files and paths refused"
exit $fail

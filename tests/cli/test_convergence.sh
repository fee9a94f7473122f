#!/usr/bin/env bash
# Smoke version of the packing model-quality experiment (docs/convergence.md): the
# convergence deck shrunk (hidden 32, window 256, 24 steps) on the licence corpus (always on
# Debian), every packing of bench/convergence.py once; each run's training and evaluation
# loss must fall and the report (imbalance, delay from the trace) must come out.
set -u
WLB="$1"; SRC="$2"
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
PY=/usr/bin/python3
$PY -c "import h5py, numpy" 2> /dev/null || { echo "SKIP: python3-h5py / python3-numpy missing"; exit 0; }
$PY "$SRC/bench/convergence.py" --wlb "$WLB" --work "$T/w" --smoke --nice 0 > "$T/out.txt" 2>&1 ||
  { cat "$T/out.txt"; fail "convergence.py --smoke"; }
cat "$T/out.txt" | tail -9
[ "$(grep -c '^| ' "$T/out.txt")" = 6 ] || fail "expected a header and 5 packing rows"
grep -q "every run's training and evaluation loss fell" "$T/out.txt" || fail "loss did not fall"
[ "$(ls "$T/w/runs" | wc -l)" = 5 ] || fail "expected 5 packings under runs/"
# finished runs are read back, not rerun
$PY "$SRC/bench/convergence.py" --wlb /nonexistent --work "$T/w" --smoke > "$T/again.txt" 2>&1 ||
  { cat "$T/again.txt"; fail "finished runs were not reused"; }
# ... only with the same settings: other overrides are other runs (a smoke run is never
# reported as a full one)
$PY "$SRC/bench/convergence.py" --wlb /nonexistent --work "$T/w" --smoke --report-only --set train.lr=0.02 \
  > "$T/other.txt" 2>&1 && fail "runs of other settings were reported: $(cat "$T/other.txt")"
grep -q "no finished runs" "$T/other.txt" || fail "other settings: $(cat "$T/other.txt")"
echo "PASS"

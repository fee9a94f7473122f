#!/usr/bin/env bash
# bench/gpu_parts.sh (the time-budgeted runner of bench/gpu_end_to_end.sh's parts) on the
# CPU build: a part that fits runs and is packed, one whose estimate exceeds what is left is
# skipped and says so, and bad arguments exit 2 before anything runs.
set -u
WLB=$1
SRC=$2
BIN=$(dirname "$WLB")
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# "none" is no part of gpu_end_to_end.sh: the script runs its preamble (--version) only.
bash "$SRC/bench/gpu_parts.sh" "$BIN" none "$TMP/out" 40 none:5 run8b:1000 > "$TMP/log" 2>&1 ||
  fail "gpu_parts.sh exited $?: $(cat "$TMP/log")"
grep -q "== part none rc=0 took" "$TMP/out/summary.txt" || fail "part none not run: $(cat "$TMP/out/summary.txt")"
grep -q "== skipped run8b: [0-9]* s left, about 1000 needed" "$TMP/out/summary.txt" || fail "run8b not skipped"
grep -q "wlb 0" "$TMP/out/summary.txt" || fail "the part's preamble (wlb --version) is not in the summary"
tar -tzf "$TMP/out.tar.gz" | grep -q "^out/summary.txt$" || fail "the pack lacks summary.txt"
# bad arguments
bash "$SRC/bench/gpu_parts.sh" "$BIN" none "$TMP/o2" soon x > "$TMP/e" 2>&1
[ $? -eq 2 ] || fail "a LIMIT_S that is no number must exit 2"
grep -q "LIMIT_S 'soon'" "$TMP/e" || fail "message: $(cat "$TMP/e")"
for bad in "rnu8b:5|unknown part 'rnu8b'" "none:1000s|the estimate '1000s' is not a whole number"; do
  bash "$SRC/bench/gpu_parts.sh" "$BIN" none "$TMP/o3" 40 "${bad%%|*}" > "$TMP/e" 2>&1
  [ $? -eq 2 ] && grep -q "${bad#*|}" "$TMP/e" && [ ! -e "$TMP/o3/summary.txt" ] ||
    fail "part ${bad%%|*} must exit 2 before any part runs: $(cat "$TMP/e")"
done
bash "$SRC/bench/gpu_parts.sh" "$BIN" > "$TMP/e" 2>&1
[ $? -eq 2 ] || fail "too few arguments must exit 2"
echo "gpu_parts.sh: OK"

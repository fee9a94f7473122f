#!/usr/bin/env bash
# Figures in docs/ against their committed raw results (bench/results/), within the
# tables' rounding: every table marked for bench/figures.py, the paper-scale SlimPack table
# and the Llama-3-8B-layer GPU tables of docs/performance.md.
set -u
SRC=$(cd "$2" && pwd)
/usr/bin/python3 "$SRC/bench/figures.py" --root "$SRC" || { echo "FAIL: docs tables against bench/results"; exit 1; }
/usr/bin/python3 "$SRC/bench/check_paper_table.py" --root "$SRC" || { echo "FAIL: docs/performance.md paper-scale table"; exit 1; }
/usr/bin/python3 "$SRC/bench/check_gpu_8b.py" --root "$SRC" || { echo "FAIL: docs/performance.md Llama-3-8B tables"; exit 1; }
# The check itself: a figure changed by more than its rounding, and a table of figures
# without a marker, each fail it.
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/docs" && cp "$SRC"/docs/*.md "$TMP/docs/" && ln -s "$SRC/bench" "$TMP/bench" && ln -s "$SRC/inputs" "$TMP/inputs"
/usr/bin/python3 "$SRC/bench/figures.py" --root "$TMP" > /dev/null || { echo "FAIL: the copied docs do not pass"; exit 1; }
sed -i 's/^| original | 2.076 | 2.407 |/| original | 2.078 | 2.407 |/' "$TMP/docs/performance.md"
out=$(/usr/bin/python3 "$SRC/bench/figures.py" --root "$TMP") && { echo "FAIL: a changed figure passed"; exit 1; }
echo "$out" | grep -q "MISMATCH plan-long-context row 1 (original) cell 2: 2.078 in the doc" ||
  { echo "FAIL: the changed figure is not named: $out"; exit 1; }
cp "$SRC/docs/performance.md" "$TMP/docs/performance.md"
printf '\n| case | figure |\n|---|---|\n| a | 1.5 |\n' >> "$TMP/docs/testing.md"
out=$(/usr/bin/python3 "$SRC/bench/figures.py" --root "$TMP") && { echo "FAIL: a table without a raw log passed"; exit 1; }
echo "$out" | grep -q "docs/testing.md:.*a table with figures and no" || { echo "FAIL: the unmarked table is not named: $out"; exit 1; }
echo PASS

#!/usr/bin/env bash
# Figures in docs/ against their committed raw results (bench/results/), within the
# tables' rounding: every table marked for bench/figures.py, the paper-scale SlimPack table
# and the Llama-3-8B-layer GPU tables of docs/performance.md.
set -u
SRC=$2
/usr/bin/python3 "$SRC/bench/figures.py" --root "$SRC" || { echo "FAIL: docs tables against bench/results"; exit 1; }
/usr/bin/python3 "$SRC/bench/check_paper_table.py" --root "$SRC" || { echo "FAIL: docs/performance.md paper-scale table"; exit 1; }
/usr/bin/python3 "$SRC/bench/check_gpu_8b.py" --root "$SRC" || { echo "FAIL: docs/performance.md Llama-3-8B tables"; exit 1; }

#!/usr/bin/env bash
# Figures in docs/ against their committed raw results (bench/results/): the paper-scale
# SlimPack table and the Llama-3-8B-layer GPU tables of docs/performance.md, within the
# tables' rounding.
set -u
SRC=$2
/usr/bin/python3 "$SRC/bench/check_paper_table.py" --root "$SRC" || { echo "FAIL: docs/performance.md paper-scale table"; exit 1; }
/usr/bin/python3 "$SRC/bench/check_gpu_8b.py" --root "$SRC" || { echo "FAIL: docs/performance.md Llama-3-8B tables"; exit 1; }

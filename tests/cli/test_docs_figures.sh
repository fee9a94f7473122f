#!/usr/bin/env bash
# Figures in docs/ against their committed raw results (bench/results/): the paper-scale
# SlimPack table of docs/performance.md, within the table's rounding.
set -u
SRC=$2
/usr/bin/python3 "$SRC/bench/check_paper_table.py" --root "$SRC" || { echo "FAIL: docs/performance.md paper-scale table"; exit 1; }

#!/usr/bin/env bash
# Parts of bench/gpu_end_to_end.sh within a time budget, for a GPU held for a fixed time (a
# lent machine, a Slurm job's --time): the parts run in the order given, most important
# first; a part whose estimated seconds no longer fit in what is left is skipped and says
# so; the part running at the deadline is stopped; after every part OUT is packed into
# PACK (default OUT.tar.gz), so what ran is kept even if the job is then killed.
#
#   bench/gpu_parts.sh BIN REF OUT LIMIT_S part[:seconds] ...
#
# BIN, REF, OUT and the environment (DATA, TORCH_PLANS, RUN_PRECISIONS, ...) as for
# bench/gpu_end_to_end.sh; seconds: the part's estimate (default 60; what each part took on
# the H100 is in its summary line). While it runs, `nvidia-smi dmon` writes power and clocks
# every 5 s to OUT/dmon.log (the clocks a result ran at). The shared libraries BIN carries
# (BIN/libs.tar.xz) are unpacked once, not per part. Example, the measurements the H100
# session of 2026-11-26 ran, in about eight minutes:
#
#   DATA=PREFIX bench/gpu_parts.sh BIN none OUT 570 run8b:120 gemm8b:45 torch8b:150 \
#     profile8b:40 train8b:60 trainsmall:30 attnws:150 attnanchors:120
set -uo pipefail
if [ $# -lt 5 ]; then
  sed -n '2,19p' "$0" >&2
  exit 2
fi
BIN=$1 REF=$2 OUT=$3 LIMIT=$4
shift 4
case $LIMIT in '' | *[!0-9]*) echo "gpu_parts.sh: LIMIT_S '$LIMIT' is not a whole number of seconds" >&2; exit 2 ;; esac
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
BIN=$(cd "$BIN" && pwd) || { echo "gpu_parts.sh: BIN '$1' is not a directory" >&2; exit 2; }
[ -e "$REF" ] && REF=$(cd "$(dirname "$REF")" && pwd)/$(basename "$REF")
PACK=${PACK:-$OUT.tar.gz}
case $PACK in /*) ;; *) PACK=$PWD/$PACK ;; esac
start=$SECONDS
cd "$(dirname "$0")/.." || exit 2

# The carried libraries once for every part (gpu_end_to_end.sh finds them unpacked).
source bench/gpu_libs.sh
# Every part and estimate checked before the first runs (a typo would read as a part that
# ran; an estimate that is no number would always "fit").
for p in "$@"; do
  require_gpu_parts gpu_parts.sh "${p%%:*}"
  if [[ $p == *:* ]]; then
    case ${p##*:} in '' | *[!0-9]*) echo "gpu_parts.sh: part '$p': the estimate '${p##*:}' is not a whole number of seconds" >&2; exit 2 ;; esac
  fi
done
use_carried_libs "$BIN"

dmon=
if command -v nvidia-smi > /dev/null; then
  nvidia-smi dmon -s pc -d 5 > "$OUT/dmon.log" 2>&1 &
  dmon=$!
fi
pack() {
  # logs speak of the project (bench/figures.py checks): OUT as $OUT, the repository relative
  # (not dmon.log: nvidia-smi still writes it, and sed -i makes a new file)
  find "$OUT" -type f ! -name dmon.log \( -name '*.log' -o -name '*.out' -o -name '*.txt' -o -name '*.json' -o -name '*.jsonl' \) \
    -exec sed -i -e "s#$OUT/#\$OUT/#g" -e "s#$PWD/##g" {} +
  tar -C "$(dirname "$OUT")" -czf "$PACK.tmp" "$(basename "$OUT")" && mv "$PACK.tmp" "$PACK"
}
for p in "$@"; do
  name=${p%%:*} cost=60
  [[ $p == *:* ]] && cost=${p##*:}
  left=$((LIMIT - (SECONDS - start)))
  if [ "$left" -lt "$cost" ]; then
    echo "== skipped $name: $left s left, about $cost needed" | tee -a "$OUT/summary.txt"
    continue
  fi
  t0=$SECONDS
  timeout -k 5 $((left > 15 ? left - 10 : 5)) bash bench/gpu_end_to_end.sh "$BIN" "$REF" "$OUT" "$name" \
    > "$OUT/part_$name.out" 2>&1
  echo "== part $name rc=$? took $((SECONDS - t0)) s (elapsed $((SECONDS - start)) s of $LIMIT)" | tee -a "$OUT/summary.txt"
  pack
done
[ -n "$dmon" ] && kill "$dmon" 2> /dev/null
pack
echo "packed $OUT into $PACK"

#!/bin/bash
# Recalibrates the lease-2 first runs with the rank-speed model of rank, step and task
# spread, then replays every run with the profiles (docs/performance.md, 16-rank campaign).
# TRACES: the directory holding calibration/<deck>/trace.h5 of the campaign (the traces are
# not committed); run from the repository root:
#   TRACES=DIR /usr/bin/python3 bench/record.py --log bench/results/cpu16/lease2/step_wander/replay_step_wander.log \
#       -- bash bench/results/cpu16/lease2/step_wander/replay.sh
set -euo pipefail
: "${TRACES:?set TRACES to the directory of the campaign outputs}"
WLB=${WLB:-build/bin/wlb}
D=bench/results/cpu16/lease2
R=$D/step_wander
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
DECKS="run16_cp4_dp4 run16_tp2_cp2_pp2_dp2 run16_pp4_dp4_packflow run16_cp8_dp2"
replay() {  # title, deck, plans, profile, seed: the table, then tokens/s at full precision
  echo "== $1"
  "$WLB" simulate "inputs/$2.toml" --as-run --plans "$3" --set "hardware.profile=\"$4\"" --set "data.seed=$5" \
    --out "$OUT" | grep -E "^(case|run16|# rank speed)"
  awk -F, 'NR > 1 {printf "# tokens/s %s %s %s\n", $1, $5, $11}' "$OUT/simulate.csv"
}
for d in $DECKS; do
  base=$D/profile.run16_cp4_dp4.json
  [ "$d" = run16_tp2_cp2_pp2_dp2 ] && base=$D/profile.run16_tp2_cp2_pp2_dp2.json
  echo "== calibrate: $d's first run"
  "$WLB" calibrate "$TRACES/calibration/$d/trace.h5" --profile "$base" --out "$R/profile.calibrated.$d.json" |
    grep -E "^(wlb calibrate|rank_speed|attn|mlp|qkv|out_proj|elementwise|links)"
done
for d in $DECKS; do
  replay "in-sample replay: $d's first run (data.seed 2026), its profile" "$d" "$D/calibration/$d" \
    "$R/profile.calibrated.$d.json" 2026
done
replay "out of sample: run16_cp4_dp4 round 1 (data.seed 2027), the profile of its first run" run16_cp4_dp4 \
  "$D/runs/run16_cp4_dp4-r1" "$R/profile.calibrated.run16_cp4_dp4.json" 2027
replay "out of sample: run16_cp4_dp4 round 1, the profile of run16_cp8_dp2's first run (undisturbed)" run16_cp4_dp4 \
  "$D/runs/run16_cp4_dp4-r1" "$R/profile.calibrated.run16_cp8_dp2.json" 2027
# round 1 calibrated on its own (undisturbed) trace: what the spreads cost each strategy
echo "== calibrate: run16_cp4_dp4 round 1"
"$WLB" calibrate "$TRACES/runs/run16_cp4_dp4-r1/trace.h5" --profile "$D/profile.run16_cp4_dp4.json" \
  --out "$R/profile.calibrated.run16_cp4_dp4-r1.json" | grep -E "^(wlb calibrate|rank_speed)"
replay "in-sample replay: run16_cp4_dp4 round 1, its own profile" run16_cp4_dp4 "$D/runs/run16_cp4_dp4-r1" \
  "$R/profile.calibrated.run16_cp4_dp4-r1.json" 2027
echo "== in-sample replay: run16_cp4_dp4 round 1, its own profile at the mean speed"
"$WLB" simulate inputs/run16_cp4_dp4.toml --as-run --mean-speed --plans "$D/runs/run16_cp4_dp4-r1" \
  --set "hardware.profile=\"$R/profile.calibrated.run16_cp4_dp4-r1.json\"" --set data.seed=2027 --out "$OUT" |
  grep -E "^(case|run16)"
awk -F, 'NR > 1 {printf "# tokens/s %s %s %s\n", $1, $5, $11}' "$OUT/simulate.csv"

#!/usr/bin/env bash
# wlb simulate end to end: comparison table, sweep/list expansion, CSV/JSON and trace
# outputs, exit 2 and no outputs on bad input. Usage: test_simulate.sh WLB_BINARY SOURCE_DIR
set -u
WLB="$1"
SRC="$2"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# 1. Default comparison: five strategies, speedup column relative to plain.
out="$("$WLB" simulate "$SRC/inputs/sim_small.toml" --steps 3 --out "$TMP/o" 2>&1)" || fail "simulate exited $?: $out"
for s in plain fixed wlb pp-only cp-only; do
  echo "$out" | grep -Eq "^sim_small +2x2x2x2 +$s " || fail "missing row $s: $out"
done
echo "$out" | grep -Eq "^sim_small +2x2x2x2 +plain +[0-9.]+ +[0-9.]+ +1.000x \[1.000-1.000\]" || fail "plain speedup not 1.00x: $out"
# the speedup is a throughput ratio with its interval; every strategy drains what it holds
echo "$out" | grep -q "speedup = throughput (trained tokens/s) over plain" || fail "speedup not explained: $out"
# (without warm-up every strategy starts empty and drains: exactly the same documents)
"$WLB" simulate "$SRC/inputs/sim_small.toml" --warmup 0 --out "$TMP/w0" > /dev/null 2>&1 || fail "simulate --warmup 0"
/usr/bin/python3 - "$TMP/o/simulate.json" "$TMP/w0/simulate.json" <<'PY' || fail "simulate.json throughput fields"
import json, sys
rows = json.load(open(sys.argv[1]))
toks = {r["strategy"]: r["tokens"] for r in json.load(open(sys.argv[2]))}
assert len(set(toks.values())) == 1, f"strategies trained different token totals: {toks}"
for r in rows:
    lo, hi = r["speedup_interval"]
    assert lo <= r["speedup"] <= hi, r
    assert r["tokens_per_second"] > 0 and r["useful_flops_per_second"] > 0, r
    assert r["baseline"] == "plain"
PY
# pp-only / cp-only, as --help lists them, are accepted
"$WLB" simulate "$SRC/inputs/sim_small.toml" --steps 2 --strategies plain,pp-only,cp-only > "$TMP/pc.txt" 2>&1 \
  || { cat "$TMP/pc.txt"; fail "--strategies pp-only,cp-only refused"; }
grep -Eq "^sim_small +2x2x2x2 +cp-only " "$TMP/pc.txt" || fail "no cp-only row"
[ -s "$TMP/o/simulate.csv" ] || fail "no simulate.csv"
[ "$(wc -l < "$TMP/o/simulate.csv")" -eq 6 ] || fail "simulate.csv should have header + 5 rows"
grep -q '"strategy": "wlb"' "$TMP/o/simulate.json" || fail "simulate.json lacks wlb"
ls "$TMP/o" | grep -q tmp && fail "temporary file left behind"

# 2. Schedules and recomputation through --set; trace written with the simulated source.
for sched in gpipe 1f1b; do
  "$WLB" simulate "$SRC/inputs/sim_small.toml" --steps 2 --strategies wlb \
      --set pipeline.schedule=$sched --set pipeline.recompute=full > "$TMP/$sched.txt" 2>&1 \
    || fail "schedule $sched failed: $(cat "$TMP/$sched.txt")"
done
"$WLB" simulate "$SRC/inputs/sim_small.toml" --steps 2 --strategies wlb --set pipeline.schedule=interleaved \
    --set mesh.virtual_stages=2 --trace "$TMP/tr/sim.h5" > "$TMP/int.txt" 2>&1 || fail "interleaved: $(cat "$TMP/int.txt")"
[ -s "$TMP/tr/sim.h5" ] || fail "no trace file"
if command -v h5dump >/dev/null 2>&1; then
  h5dump -a /meta/source "$TMP/tr/sim.h5" | grep -q simulated || fail "trace /meta/source is not simulated"
fi
# The simulated trace as the schema has it: the plan lines with their metrics, "{}" for no
# shard plans, step-level events in the bwd phase, KV events labelled by [cp] comm with the
# bytes received (sharding_aware: kv_exchange), FLOPs on compute events.
"$WLB" simulate "$SRC/inputs/sim_small.toml" --steps 2 --strategies wlb --set cp.comm=sharding_aware \
    --trace "$TMP/tr/sa.h5" > "$TMP/sa.txt" 2>&1 || fail "sharding_aware trace: $(cat "$TMP/sa.txt")"
/usr/bin/python3 - "$TMP/tr/sa.h5" <<'PYEOF' || fail "simulated trace fields"
import json, sys
import h5py
f = h5py.File(sys.argv[1], "r")
reg = [r.decode() if isinstance(r, bytes) else r for r in f["regions"][:]]
ev = f["events"][:]
p0 = json.loads(f["plan/packing_json"][0])
assert "metrics" in p0 and "incoming" in p0, sorted(p0)
sj = f["plan/shard_json"][0]
assert (sj.decode() if isinstance(sj, bytes) else sj) == "{}"
names = [reg[e["region"]] for e in ev]
assert "kv_exchange" in names and "kv_allgather" not in names, set(names)
for e, n in zip(ev, names):
    if n == "grad_allreduce":
        assert e["phase"] == 2, e
    if n in ("attn", "mlp"):
        assert e["flops"] > 0, e
    if n in ("kv_exchange", "tp_allreduce", "pp_send"):
        assert e["bytes"] >= 0, e
assert any(e["bytes"] > 0 for e, n in zip(ev, names) if n == "kv_exchange")
PYEOF

# 3. Sweep expansion and deck lists: one row per case and strategy.
cat > "$TMP/sweep.toml" <<TOML
[model]
hidden = 1024
heads = 8
kv_heads = 8
ffn = 2816
layers = 4
[mesh]
tp = 1
cp = 2
pp = 2
dp = 1
[data]
context_window = 16384
length_scale = 0.125
[run]
steps = 2
warmup = 0
strategies = ["plain", "wlb"]
[sweep]
"mesh.cp" = [1, 2]
TOML
printf '# two decks\nsweep.toml\n%s\n' "$SRC/inputs/sim_small.toml" > "$TMP/grid.list"
out="$("$WLB" simulate "$TMP/grid.list" --steps 2 --strategies plain,wlb 2>&1)" || fail "list failed: $out"
[ "$(echo "$out" | grep -Ec '^(sweep|sim_small)')" -eq 6 ] || fail "expected 6 rows (3 cases x 2): $out"

# 4. Bad input: exit 2, message naming the key, nothing written.
"$WLB" simulate "$SRC/inputs/sim_small.toml" --set pipeline.schedule=zigzag --out "$TMP/bad" > "$TMP/bad.txt" 2>&1
rc=$?
[ $rc -eq 2 ] || fail "bad schedule: exit $rc, expected 2"
grep -q "schedule" "$TMP/bad.txt" || fail "error does not name the schedule: $(cat "$TMP/bad.txt")"
[ -e "$TMP/bad" ] && fail "output written on error"
"$WLB" simulate "$SRC/inputs/sim_small.toml" --set packing.micro_batches=3 --set pipeline.schedule=interleaved \
    --set mesh.virtual_stages=2 --trace "$TMP/bad2/t.h5" > "$TMP/bad2.txt" 2>&1
rc=$?
[ $rc -eq 2 ] || fail "interleaved with M % pp != 0: exit $rc, expected 2"
[ -e "$TMP/bad2" ] && fail "trace directory created on error"
"$WLB" simulate "$TMP/missing.toml" > /dev/null 2>&1
[ $? -eq 2 ] || fail "missing deck should exit 2"

# 5. The 16-rank decks (inputs/run16_*.toml, docs/performance.md "16-rank campaign") validate,
#    plan and simulate as `wlb run` would execute them, every strategy they list.
n16=0
for d in "$SRC"/inputs/run16_*.toml; do
  name=$(basename "$d" .toml)
  "$WLB" validate "$d" > "$TMP/v16.txt" 2>&1 || fail "$name does not validate: $(cat "$TMP/v16.txt")"
  "$WLB" simulate "$d" --as-run --steps 1 --warmup 0 > "$TMP/s16.txt" 2>&1 || fail "$name: $(cat "$TMP/s16.txt")"
  want=$(/usr/bin/python3 -c 'import sys, tomllib; print(len(tomllib.load(open(sys.argv[1], "rb"))["run"]["strategies"]))' "$d")
  [ "$(grep -c "^$name " "$TMP/s16.txt")" = "$want" ] || fail "$name: expected $want rows: $(cat "$TMP/s16.txt")"
  n16=$((n16 + 1))
done
[ $n16 -eq 5 ] || fail "expected 5 run16 decks, found $n16"

# Selective recomputation is priced from the profile's recompute_ns_per_token: a profile
# with it (`wlb profile --deck`, quick) predicts a slower step than none and says nothing; one
# without (the deck's, written before it) prices it at 0 and says so under the table.
"$WLB" profile --deck "$SRC/inputs/run_cp2.toml" --quick --out "$TMP/prof.json" > /dev/null 2>&1 || fail "profile --deck"
sel=(--as-run --steps 2 --strategies plain --set 'pipeline.recompute="selective"')
measured=(--set "hardware.profile=\"$TMP/prof.json\"")
"$WLB" simulate "$SRC/inputs/run_cp2.toml" "${sel[@]}" > "$TMP/sel_old.txt" || fail "selective, old profile"
grep -q '^# pipeline.recompute = "selective" without its time: run_cp2: ' "$TMP/sel_old.txt" ||
  fail "no note for an unpriced recomputation: $(cat "$TMP/sel_old.txt")"
"$WLB" simulate "$SRC/inputs/run_cp2.toml" "${sel[@]}" "${measured[@]}" > "$TMP/sel.txt" || fail "selective"
"$WLB" simulate "$SRC/inputs/run_cp2.toml" --as-run --steps 2 --strategies plain "${measured[@]}" > "$TMP/none.txt" ||
  fail "none"
! grep -q "without its time" "$TMP/sel.txt" "$TMP/none.txt" || fail "a priced recomputation noted as unpriced"
step() { awk '$3 == "plain" {print $8}' "$1"; }
awk -v a="$(step "$TMP/sel.txt")" -v b="$(step "$TMP/none.txt")" 'BEGIN { exit !(a > b) }' ||
  fail "selective step $(step "$TMP/sel.txt") s not above none's $(step "$TMP/none.txt") s"

# Several decks: a case's own bad input names the case and its deck.
sed 's#^profile = .*#profile = "nonexist.json"#' "$SRC/inputs/sim_small.toml" > "$TMP/badprof.toml"
"$WLB" simulate "$SRC/inputs/sim_small.toml" "$TMP/badprof.toml" --steps 1 > "$TMP/bp.txt" 2>&1; rc=$?
[ $rc -eq 2 ] && grep -q "case badprof ($TMP/badprof.toml): \[hardware\] profile: file 'nonexist.json' not found" "$TMP/bp.txt" ||
  fail "a bad case among several: exit $rc: $(cat "$TMP/bp.txt")"
echo "PASS"

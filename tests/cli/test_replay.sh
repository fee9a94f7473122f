#!/usr/bin/env bash
# `wlb simulate --plans`: a replay of a 2-rank `wlb run` simulates exactly the run's plans
# (every segment of every step, warm-up and drain included, for every strategy), also with
# another profile than the run planned with; one plan file or a subset of strategies;
# bad plans exit 2 naming the file and line and write nothing.
#   usage: test_replay.sh WLB_BINARY SOURCE_DIR
set -u
WLB=$1
SRC=$2
fail() { echo "FAIL: $*"; exit 1; }
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
PY=/usr/bin/python3
small=(--set model.hidden=64 --set model.heads=4 --set model.kv_heads=2 --set model.ffn=96
       --set data.context_window=1024 --set data.length_scale=0.0078125)
deck="$SRC/inputs/run_cp2.toml"

mpiexec -n 2 "$WLB" run "$deck" "${small[@]}" --steps 3 --warmup 1 --quiet --set "output.dir=\"$T/run\"" \
  > "$T/run.txt" 2>&1 || fail "wlb run: $(cat "$T/run.txt")"

# 1. The run's directory, simulated with another profile: the run's plans, not new ones.
other=(--set "hardware.profile=\"$SRC/inputs/profiles/xeon-avx512-1core.json\"")
"$WLB" simulate "$deck" "${small[@]}" "${other[@]}" --as-run --plans "$T/run" --trace "$T/sim.h5" --out "$T/sim" \
  > "$T/sim.txt" 2>&1 || fail "replay: $(cat "$T/sim.txt")"
grep -q "^# replayed the plans of $T/run" "$T/sim.txt" || fail "no replay line: $(cat "$T/sim.txt")"
"$WLB" simulate "$deck" "${small[@]}" "${other[@]}" --as-run --steps 3 --warmup 1 --trace "$T/replan.h5" \
  > "$T/replan.txt" 2>&1 || fail "re-planned simulation: $(cat "$T/replan.txt")"
PYTHONPATH="$SRC/analysis" $PY - "$T/run/trace.h5" "$T/sim.h5" "$T/replan.h5" "$T/run/summary.json" \
  "$T/sim/simulate.json" <<'PY' || fail "the replay did not simulate the run's plans"
import json, sys
import wlb_trace
def plans(path):
    t = wlb_trace.load(path)
    s = t.segments
    return {(t.strategies[s["strategy"][i]], int(s["step"][i]), int(s["dp"][i]), int(s["micro_batch"][i]),
             int(s["index"][i])): (int(s["doc"][i]), int(s["offset"][i]), int(s["length"][i]))
            for i in range(len(s["doc"]))}
run, sim, replan = plans(sys.argv[1]), plans(sys.argv[2]), plans(sys.argv[3])
assert run and sim == run, f"{len(run)} run segments, {len(sim)} replayed, {len(set(run.items()) ^ set(sim.items()))} differ"
summary = {s["strategy"]: s for s in json.load(open(sys.argv[4]))["strategies"]}
rows = json.load(open(sys.argv[5]))
assert [r["strategy"] for r in rows] == list(summary), (rows, list(summary))
for r in rows:
    m = summary[r["strategy"]]
    assert r["tokens"] == m["tokens"] and r["drain_steps"] == m["drain_steps"] and r["steps"] == 3, (r, m)
differ = len(set(run.items()) ^ set(replan.items()))
print(f"replay: {len(run)} segments of {len(rows)} strategies as the run had them "
      f"(re-planning with the other profile: {differ} differ)")
PY

# 2. One plan file; a subset of the strategies; a missing one names what the run has.
"$WLB" simulate "$deck" "${small[@]}" --as-run --plans "$T/run/plan.wlb.jsonl" --steps 3 --warmup 1 \
  > "$T/one.txt" 2>&1 || fail "one plan file: $(cat "$T/one.txt")"
[ "$(grep -Ec '^run_cp2 +1x2x1x1 ' "$T/one.txt")" = 1 ] || fail "one plan file, rows: $(cat "$T/one.txt")"
grep -Eq '^run_cp2 +1x2x1x1 +wlb ' "$T/one.txt" || fail "one plan file: no wlb row: $(cat "$T/one.txt")"
"$WLB" simulate "$deck" "${small[@]}" --as-run --plans "$T/run" --strategies plain,wlb > "$T/two.txt" 2>&1 \
  || fail "--strategies with --plans: $(cat "$T/two.txt")"
[ "$(grep -Ec '^run_cp2 +1x2x1x1 +(plain|wlb) ' "$T/two.txt")" = 2 ] || fail "subset rows: $(cat "$T/two.txt")"

# 3. Bad input: exit 2, a message naming the file (and line), nothing written.
bad() {  # bad WHAT EXPECTED-TEXT ARGS...
  local what=$1 want=$2; shift 2
  rm -rf "$T/out"
  "$WLB" simulate "$deck" "${small[@]}" --as-run --out "$T/out" --trace "$T/out/t.h5" "$@" > "$T/bad.txt" 2>&1
  local rc=$?
  [ $rc = 2 ] || fail "$what: exit $rc, wanted 2: $(cat "$T/bad.txt")"
  grep -qF -- "$want" "$T/bad.txt" || fail "$what: message lacks '$want': $(cat "$T/bad.txt")"
  [ -z "$(ls -A "$T/out" 2>/dev/null)" ] || fail "$what: wrote $(ls "$T/out")"
}
mkdir "$T/b1" "$T/b2" "$T/b3" "$T/empty"
p="$T/run/plan.wlb.jsonl"
sed '3s/.*/{"type":"step","step":1,"replicas":[[[[1,0,5]]]]/' "$p" > "$T/b1/plan.wlb.jsonl"
bad "corrupt line" "$T/b1/plan.wlb.jsonl:3:" --plans "$T/b1"
awk 'NR==3{l=$0; next} NR==4{print; print l; next} {print}' "$p" > "$T/b2/plan.wlb.jsonl"
bad "steps out of order" "$T/b2/plan.wlb.jsonl:3: step 2 where step 1 was expected" --plans "$T/b2"
bad "another mesh" "plan.wlb.jsonl:1: the plans have dp = 1 replicas; the deck's mesh.dp = 2" --plans "$p" --set mesh.dp=2
bad "another window" "data.context_window" --plans "$p" --set data.context_window=2048
bad "too few steps" "holds" --plans "$p" --steps 50
bad "other step counts than the run's" "--steps 1: the run in $T/run measured 3 steps" --plans "$T/run" --steps 1
bad "other warm-up than the run's" "--warmup 0: the run in $T/run had 1 warm-up steps" --plans "$T/run" --warmup 0
bad "no plans" "no plan files" --plans "$T/empty"
bad "no such path" "no such plan file or run directory" --plans "$T/nosuch"
bad "missing strategy" "'slimpack' has no plans in" --plans "$T/run" --strategies plain,slimpack
cp "$p" "$T/b3/a.jsonl"; cp "$p" "$T/b3/b.jsonl"
bad "two files of one strategy" "a second plan file of strategy 'wlb'" --plans "$T/b3"
bad "two decks" "--plans replays one run" --plans "$T/run" "$SRC/inputs/run_dp2.toml"
cp -r "$T/run" "$T/b4"; rm "$T/b4/plan.fixed.jsonl"
bad "a plan the summary names is missing" "the plan file $T/b4/plan.fixed.jsonl that summary.json names is missing" \
  --plans "$T/b4"

# 4. A rerun into the same folder with fewer strategies (another seed) leaves the older plan
# files beside its own: the replay takes the ones its summary.json names.
mpiexec -n 2 "$WLB" run "$deck" "${small[@]}" --steps 3 --warmup 1 --quiet --set "output.dir=\"$T/run\"" \
  --set 'run.strategies=["wlb"]' --set data.seed=99 > "$T/rerun.txt" 2>&1 || fail "rerun: $(cat "$T/rerun.txt")"
[ -e "$T/run/plan.plain.jsonl" ] && [ -e "$T/run/plan.jsonl" ] || fail "rerun: expected old and new plan files: $(ls "$T/run")"
"$WLB" simulate "$deck" "${small[@]}" --as-run --plans "$T/run" --set data.seed=99 > "$T/re.txt" 2>&1 ||
  fail "replay of a rerun: $(cat "$T/re.txt")"
grep -q "^# replayed the plans of $T/run ($T/run/plan.jsonl)" "$T/re.txt" && [ "$(grep -Ec '^run_cp2 +1x2x1x1 ' "$T/re.txt")" = 1 ] ||
  fail "replay of a rerun mixed runs: $(cat "$T/re.txt")"
# ... also when output.plan is absolute and output.dir relative (the summary names the
# plans from their absolute paths)
(cd "$T" && mpiexec -n 2 "$WLB" run "$deck" "${small[@]}" --steps 3 --warmup 1 --quiet --set 'output.dir="run"' \
  --set 'run.strategies=["fixed"]' --set data.seed=98 --set "output.plan=\"$T/elsewhere/plan.jsonl\"" > rerun2.txt 2>&1) ||
  fail "rerun with an absolute output.plan: $(cat "$T/rerun2.txt")"
(cd "$T" && "$WLB" simulate "$deck" "${small[@]}" --as-run --plans run --set data.seed=98 > re2.txt 2>&1) ||
  fail "replay, absolute output.plan: $(cat "$T/re2.txt")"
grep -q "^# replayed the plans of run (/.*/elsewhere/plan.jsonl)" "$T/re2.txt" ||
  fail "replay with an absolute output.plan took other plans: $(cat "$T/re2.txt")"

echo "wlb simulate --plans tests passed"

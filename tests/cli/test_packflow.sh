#!/usr/bin/env bash
# PackFlow end to end (docs/simulator.md § PackFlow): `wlb plan --packer slimpack` writes
# slices and the backward grouping; `wlb simulate` runs SlimPack plans under
# pipeline.schedule = "packflow" beside other packers (which PackFlow runs in 1F1B's order);
# a slimpack strategy under another schedule exits 2 naming the key, before any output.
# Usage: test_packflow.sh WLB_BINARY SOURCE_DIR
set -u
WLB="$1"; SRC="$2"
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
DECK="$SRC/inputs/sim_small.toml"
PF=(--set pipeline.schedule=packflow)

# 1. The planner: every token once, slices (5th field) and the backward grouping in the file.
"$WLB" plan "$DECK" "${PF[@]}" --packer slimpack --steps 4 --check --out "$T/plan.jsonl" > "$T/plan.txt" 2>&1 \
  || { cat "$T/plan.txt"; fail "plan --packer slimpack"; }
grep -q "check slimpack: OK — lost 0 tokens, duplicated 0" "$T/plan.txt" || { cat "$T/plan.txt"; fail "check line"; }
/usr/bin/python3 - "$T/plan.jsonl" <<'PY' || fail "slimpack plan file"
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if '"type":"step"' in l]
assert len(steps) == 4, len(steps)
slices = sum(len(s) == 5 for st in steps for rep in st["replicas"] for mb in rep for s in mb)
assert slices > 0, "no slice in 4 steps of the long-context deck"
for st in steps:
    assert len(st["backward"]) == len(st["replicas"])
    for cuts, rep in zip(st["backward"], st["replicas"]):
        assert len(cuts) == len(rep) + 1 and cuts[0] == 0 and cuts[-1] == sum(len(mb) for mb in rep)
    # how the step fits the per-stage memory budget (docs/plan-format.md)
    mem = st["memory"]
    assert mem["partition"] in ("flops", "sample_ends", "whole_samples"), mem
    assert mem["budget_gb"] > 0 and all(0 < g <= mem["budget_gb"] for g in mem["peak_gb"]), mem
    assert set(mem["held"]) <= set(st["delayed"]), mem
PY

# 2. One table: plain and wlb (1F1B's order under packflow) and slimpack (PackFlow).
"$WLB" simulate "$DECK" "${PF[@]}" --strategies plain,wlb,slimpack+per_document --steps 3 --warmup 0 \
  --out "$T/o" --trace "$T/sim.h5" > "$T/sim.txt" 2>&1 || { cat "$T/sim.txt"; fail "simulate under packflow"; }
for s in plain wlb slimpack+per_document; do
  awk -v s="$s" '$1 == "sim_small" && $2 == "2x2x2x2" && $3 == s && $4 > 0 { ok = 1 } END { exit !ok }' "$T/sim.txt" \
    || { cat "$T/sim.txt"; fail "missing row $s"; }
done
# plain alone under 1f1b: the same step times as under packflow.
"$WLB" simulate "$DECK" --strategies plain --steps 3 --warmup 0 --out "$T/one" > "$T/one.txt" 2>&1 \
  || { cat "$T/one.txt"; fail "simulate plain under 1f1b"; }
/usr/bin/python3 - "$T/o/simulate.json" "$T/one/simulate.json" "$T/sim.h5" <<'PY' || fail "packflow results"
import json, sys
rows = {r["strategy"]: r for r in json.load(open(sys.argv[1]))}
one = json.load(open(sys.argv[2]))[0]
sp, plain = rows["slimpack+per_document"], rows["plain"]
# no warm-up, nothing held back after the drain: the same documents
assert abs(sp["tokens"] - plain["tokens"]) < 0.5, (sp["tokens"], plain["tokens"])
assert sp["tokens_per_second"] > 0 and sp["useful_flops_per_second"] > 0 and sp["step_seconds"] > 0, sp
# useful FLOPs count each slice against its key prefix: equal work, equal FLOPs per token
fpt = lambda r: r["useful_flops_per_second"] / r["tokens_per_second"]
assert abs(fpt(sp) / fpt(plain) - 1) < 1e-9, (fpt(sp), fpt(plain))
assert 0 <= sp["bubble_fraction"] < 1, sp
assert sum(sp["memory_partitions"].values()) == sp["steps"] + sp["drain_steps"], sp
assert "memory_partitions" not in plain, plain
assert abs(one["step_seconds"] / plain["step_seconds"] - 1) < 1e-12, (one["step_seconds"], plain["step_seconds"])
try:
    import h5py
except ImportError:
    sys.exit(0)
with h5py.File(sys.argv[3], "r") as f:
    strategies = [s.decode() if isinstance(s, bytes) else s for s in f["meta/strategies"][()]] if "meta/strategies" in f else None
    pj = [json.loads(s.decode() if isinstance(s, bytes) else s) for s in f["plan/packing_json"][()]]
slim = [p for p in pj if p["strategy"] == "slimpack+per_document"]
assert slim, "no slimpack plan in the trace"
assert all("backward" in p for p in slim), "trace plan lacks the backward grouping"
assert any(len(s) == 5 for p in slim for rep in p["replicas"] for mb in rep for s in mb), "trace plan lacks slices"
assert all(p["memory"]["partition"] for p in slim), "trace plan lacks the memory record"
PY
grep -q "^# sim_small slimpack+per_document memory partition, steps: " "$T/sim.txt" || { cat "$T/sim.txt"; fail "memory line"; }

# 3. slimpack under 1f1b: exit 2 naming pipeline.schedule, nothing written.
"$WLB" simulate "$DECK" --strategies plain,slimpack+per_document --steps 2 --out "$T/bad" > "$T/bad.txt" 2>&1
rc=$?
[ $rc -eq 2 ] || { cat "$T/bad.txt"; fail "slimpack under 1f1b: exit $rc, expected 2"; }
grep -q "pipeline.schedule" "$T/bad.txt" && grep -q "packflow" "$T/bad.txt" || { cat "$T/bad.txt"; fail "message names no key"; }
[ -e "$T/bad" ] && fail "output written on error"
"$WLB" simulate "$DECK" --set pipeline.schedule=packflw --steps 2 > "$T/bad2.txt" 2>&1
[ $? -eq 2 ] && grep -q "pipeline.schedule" "$T/bad2.txt" || { cat "$T/bad2.txt"; fail "unknown schedule should exit 2"; }

# 4. `wlb run` executes SlimPack plans on 2 stages (runtime/sliced.hpp) beside plain over the
# same documents; the simulator's executor memory model (--as-run) predicts the measured
# activation peak of every stage within 3%.
small=(--set model.hidden=64 --set model.heads=4 --set model.kv_heads=2 --set model.ffn=96 --set model.layers=3
       --set data.context_window=1024 --set data.length_scale=0.0078125 --set mesh.cp=1 --set mesh.pp=2
       --set packing.micro_batches=4 --set pipeline.schedule=packflow)
mpiexec -n 2 "$WLB" run "$SRC/inputs/run_cp2.toml" "${small[@]}" --set 'run.strategies=["plain","slimpack"]' \
  --set "output.dir=\"$T/run\"" --steps 3 --warmup 0 > "$T/run.txt" 2>&1 || { cat "$T/run.txt"; fail "wlb run slimpack"; }
grep -Eq "^slimpack +slimpack\+per_document +[0-9.]+" "$T/run.txt" || { cat "$T/run.txt"; fail "no slimpack row"; }
"$WLB" simulate "$SRC/inputs/run_cp2.toml" "${small[@]}" --strategies plain,slimpack --steps 3 --warmup 0 --as-run \
  --out "$T/runsim" > "$T/runsim.txt" 2>&1 || { cat "$T/runsim.txt"; fail "simulate --as-run slimpack"; }
/usr/bin/python3 - "$T/run/summary.json" "$T/runsim/simulate.json" "$T/run/plan.slimpack.jsonl" <<'PY' || fail "slimpack run"
import json, sys
run = {s["strategy"]: s for s in json.load(open(sys.argv[1]))["strategies"]}
sim = {r["strategy"]: r for r in json.load(open(sys.argv[2]))}
# the same documents: equal tokens over the run (nothing held back by either)
assert run["slimpack"]["tokens"] == run["plain"]["tokens"], (run["slimpack"]["tokens"], run["plain"]["tokens"])
steps = [json.loads(l) for l in open(sys.argv[3]) if '"type":"step"' in l]
assert any(len(s) == 5 for st in steps for rep in st["replicas"] for mb in rep for s in mb), "no slice was run"
for name in ("plain", "slimpack"):
    m, p = run[name]["stage_peak_activation_bytes"], sim[name]["peak_activation_bytes_per_stage"]
    assert len(m) == 2 and all(x > 0 for x in m), m
    for a, b in zip(m, p):
        assert abs(b - a) <= 0.03 * a, (name, m, p)
PY
# 5. DP-Merge on dp = 2: a 3000-token sample with most of each step's forward FLOPs runs on
# both replicas as a CP group; the same tokens as plain, memory predicted within 3%.
/usr/bin/python3 - "$T/lengths.txt" <<'PY'
import random, sys
random.seed(3)
with open(sys.argv[1], "w") as f:
    for step in range(40):
        f.write("3000\n" + "".join(f"{random.randint(20, 200)}\n" for _ in range(46)))
PY
merge=(--set model.hidden=64 --set model.heads=4 --set model.kv_heads=2 --set model.ffn=96 --set model.layers=2
       --set data.context_window=1024 --set data.s_max=2048 --set mesh.cp=1 --set mesh.pp=1 --set mesh.dp=2
       --set pipeline.schedule=packflow --set 'data.source="text"' --set "data.path=\"$T/lengths.txt\""
       --set 'run.strategies=["plain","slimpack"]' --steps 3 --warmup 0)
mpiexec -n 2 "$WLB" run "$SRC/inputs/run_cp2.toml" "${merge[@]}" --set "output.dir=\"$T/merge\"" > "$T/merge.txt" 2>&1 \
  || { cat "$T/merge.txt"; fail "wlb run slimpack with DP-Merge"; }
"$WLB" simulate "$SRC/inputs/run_cp2.toml" "${merge[@]}" --as-run --out "$T/mergesim" > "$T/mergesim.txt" 2>&1 \
  || { cat "$T/mergesim.txt"; fail "simulate DP-Merge"; }
/usr/bin/python3 - "$T/merge/summary.json" "$T/mergesim/simulate.json" "$T/merge/plan.slimpack.jsonl" <<'PY' || fail "DP-Merge run"
import json, sys
run = {s["strategy"]: s for s in json.load(open(sys.argv[1]))["strategies"]}
sim = {r["strategy"]: r for r in json.load(open(sys.argv[2]))}
assert run["slimpack"]["tokens"] == run["plain"]["tokens"], (run["slimpack"]["tokens"], run["plain"]["tokens"])
steps = [json.loads(l) for l in open(sys.argv[3]) if '"type":"step"' in l]
merged = [st["merged"] for st in steps if "merged" in st]
assert merged and all(m == [{"slot": 0, "group": [0, 1]}] for m in merged), [st.get("merged") for st in steps]
for name in ("plain", "slimpack"):
    m, p = run[name]["stage_peak_activation_bytes"], sim[name]["peak_activation_bytes_per_stage"]
    for a, b in zip(m, p):
        assert abs(b - a) <= 0.03 * a, (name, m, p)
PY
# DP-Merge under CP: dp = 2 x cp = 2 (4 ranks) shards a merged sample over both replicas'
# CP ranks; the same gradients as dp = 2 x cp = 1 within 1e-5.
mm=("${merge[@]}" --set 'run.strategies=["slimpack"]' --set run.comm_backend='"mpi"' --quiet --no-output)
mpiexec -n 2 "$WLB" run "$SRC/inputs/run_cp2.toml" "${mm[@]}" --gradients "$T/m2" > "$T/m2.txt" 2>&1 \
  || { cat "$T/m2.txt"; fail "DP-Merge dp=2"; }
mpiexec -n 4 "$WLB" run "$SRC/inputs/run_cp2.toml" "${mm[@]}" --set mesh.cp=2 --gradients "$T/m4" > "$T/m4.txt" 2>&1 \
  || { cat "$T/m4.txt"; fail "DP-Merge dp=2 cp=2"; }
/usr/bin/python3 "$SRC/bench/compare_runs.py" "$T/m2" "$T/m4" --tol 1e-5 > "$T/cmp.txt" || { cat "$T/cmp.txt"; fail "DP-Merge cp=2 vs cp=1"; }
# 6. Slices under CP (runtime/sliced.hpp): cp = 2 x pp = 2 (4 ranks) gives one rank's
# gradients and losses within 1e-5, and its measured peaks are the --as-run prediction.
cp2=("${small[@]}" --set mesh.cp=2 --set mesh.pp=2 --set 'run.strategies=["slimpack"]' --set run.comm_backend='"mpi"')
"$WLB" run "$SRC/inputs/run_cp2.toml" "${cp2[@]}" --set mesh.cp=1 --set mesh.pp=1 --steps 2 --warmup 0 --quiet \
  --no-output --gradients "$T/g1" > "$T/g1.txt" 2>&1 || { cat "$T/g1.txt"; fail "slimpack on one rank"; }
mpiexec -n 4 "$WLB" run "$SRC/inputs/run_cp2.toml" "${cp2[@]}" --steps 2 --warmup 0 --set "output.dir=\"$T/cp\"" \
  --gradients "$T/g4" > "$T/cp.txt" 2>&1 || { cat "$T/cp.txt"; fail "slimpack with cp=2 pp=2"; }
/usr/bin/python3 "$SRC/bench/compare_runs.py" "$T/g1" "$T/g4" --tol 1e-5 > "$T/cmp.txt" || { cat "$T/cmp.txt"; fail "cp=2 pp=2 vs one rank"; }
# bf16: K/V gathered as BF16 word pairs, gradients reduced in FP32: within 1e-3 of one rank's bf16
"$WLB" run "$SRC/inputs/run_cp2.toml" "${cp2[@]}" --set mesh.cp=1 --set mesh.pp=1 --set run.precision='"bf16"' --steps 2 \
  --warmup 0 --quiet --no-output --gradients "$T/b1" > "$T/b1.txt" 2>&1 || { cat "$T/b1.txt"; fail "bf16 slimpack one rank"; }
mpiexec -n 4 "$WLB" run "$SRC/inputs/run_cp2.toml" "${cp2[@]}" --set run.precision='"bf16"' --steps 2 --warmup 0 --quiet \
  --no-output --gradients "$T/b4" > "$T/b4.txt" 2>&1 || { cat "$T/b4.txt"; fail "bf16 slimpack cp=2 pp=2"; }
/usr/bin/python3 "$SRC/bench/compare_runs.py" "$T/b1" "$T/b4" --tol 1e-3 > "$T/cmp.txt" || { cat "$T/cmp.txt"; fail "bf16 cp=2 pp=2 vs one rank"; }
"$WLB" simulate "$SRC/inputs/run_cp2.toml" "${cp2[@]}" --steps 2 --warmup 0 --as-run --out "$T/cpsim" > "$T/cpsim.txt" 2>&1 \
  || { cat "$T/cpsim.txt"; fail "simulate slimpack cp=2"; }
/usr/bin/python3 - "$T/cp/summary.json" "$T/cpsim/simulate.json" "$T/cp/plan.jsonl" <<'PY' || fail "slimpack cp=2 run"
import json, sys
run = {s["strategy"]: s for s in json.load(open(sys.argv[1]))["strategies"]}
sim = {r["strategy"]: r for r in json.load(open(sys.argv[2]))}
steps = [json.loads(l) for l in open(sys.argv[3]) if '"type":"step"' in l]
assert any(len(s) == 5 for st in steps for rep in st["replicas"] for mb in rep for s in mb), "no slice was run"
m, p = run["slimpack"]["stage_peak_activation_bytes"], sim["slimpack"]["peak_activation_bytes_per_stage"]
assert len(m) == 2 and all(abs(b - a) <= 0.03 * a for a, b in zip(m, p)), (m, p)
PY
echo "test_packflow: OK"

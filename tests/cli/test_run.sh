#!/usr/bin/env bash
# `wlb run` end to end on 2 ranks with a tiny deck: progress lines, the final table with
# every strategy, the trace and plan files; a mesh/world-size mismatch exits 2 with one
# message; pp > 1 is rejected with a message naming mesh.pp.
set -u
WLB=$1
SRC=$2
fail() { echo "FAIL: $*"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
small=(--set model.hidden=64 --set model.heads=4 --set model.kv_heads=2 --set model.ffn=96
       --set data.context_window=1024 --set data.length_scale=0.0078125
       --set "output.dir=\"$tmp/out\"")

mpiexec -n 2 "$WLB" run "$SRC/inputs/run_cp2.toml" "${small[@]}" --steps 2 --warmup 1 > "$tmp/log" 2> "$tmp/err" \
  || fail "run_cp2 failed: $(cat "$tmp/err")"
for s in plain fixed wlb; do
  grep -q "^\[$s *\] step 2 (3 of 3) .* ETA [0-9]* s$" "$tmp/log" || fail "no progress line for $s: $(cat "$tmp/log")"
  grep -q "^$s " "$tmp/log" || fail "no table row for $s"
done
grep -q "speedup" "$tmp/log" || fail "no speedup column"
grep -q "r1 busy" "$tmp/log" || fail "no per-rank busy time"
[ -f "$tmp/out/trace.h5" ] || fail "no trace file"
for s in plain fixed wlb; do [ -s "$tmp/out/plan.$s.jsonl" ] || fail "no plan file for $s"; done
ls "$tmp/out"/*.partial > /dev/null 2>&1 && fail "temporary plan files left after a complete run"
# the comparison, machine-readable: throughput, speedup inside its interval, plain = 1
/usr/bin/python3 - "$tmp/out/summary.json" <<'PY' || fail "summary.json"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["format"] == "wlb-run-summary" and j["version"] == 1 and j["baseline"] == "plain", j
rows = {r["strategy"]: r for r in j["strategies"]}
assert set(rows) == {"plain", "fixed", "wlb"}, rows
assert rows["plain"]["speedup"] == 1.0
for r in rows.values():
    lo, hi = r["speedup_interval"]
    assert lo <= r["speedup"] <= hi and r["tokens_per_second"] > 0 and r["tokens"] > 0, r
PY
grep -q "^summary: $tmp/out/summary.json" "$tmp/log" || fail "summary path not printed"

# --gemm-timing: every product of every strategy's measured steps, summed over the ranks;
# each product once per layer pass, the forward, weight- and input-gradient products of one
# weight at the same FLOPs, and every product over the same rows.
mpiexec -n 2 "$WLB" run "$SRC/inputs/run_cp2.toml" "${small[@]}" --set "output.dir=\"$tmp/gt\"" --steps 2 --warmup 1 \
  --quiet --gemm-timing > "$tmp/log" 2> "$tmp/err" || fail "--gemm-timing: $(cat "$tmp/err")"
grep -q "^GEMMs timed one by one" "$tmp/log" || fail "no GEMM table: $(cat "$tmp/log")"
/usr/bin/python3 - "$tmp/gt/summary.json" <<'PY' || fail "gemm_timing in summary.json"
import json, sys
j = json.load(open(sys.argv[1]))
hidden, ffn, kv = 64, 96, 32  # small[]: hidden 64, ffn 96, 2 of 4 heads of 16 for K and V
by = {}
for r in j["gemm_timing"]:
    assert r["calls"] > 0 and r["seconds"] > 0 and r["flops_per_second"] > 0, r
    by.setdefault(r["strategy"], {})[r["gemm"]] = r
assert set(by) == {"plain", "fixed", "wlb"}, by.keys()
for s, g in by.items():
    layer = [n for n in g if not n.startswith("head.")]
    assert len(layer) == 21 and {"head.fwd", "head.wgrad", "head.dgrad"} <= set(g), (s, sorted(g))
    assert len({g[n]["calls"] for n in layer}) == 1, (s, {n: g[n]["calls"] for n in layer})
    for w, (k, n) in {"mlp.w1": (hidden, ffn), "mlp.w3": (hidden, ffn), "mlp.w2": (ffn, hidden),
                      "qkv_proj.q": (hidden, hidden), "qkv_proj.k": (hidden, kv), "qkv_proj.v": (hidden, kv),
                      "out_proj": (hidden, hidden)}.items():
        f = {g[w + p]["flops"] for p in (".fwd", ".wgrad", ".dgrad")}
        assert len(f) == 1, (s, w, f)
        rows = f.pop() / (2 * k * n)
        assert rows == int(rows) and rows > 0, (s, w, rows)
        if w == "mlp.w1":
            mlp_rows = rows
        assert rows == mlp_rows, (s, w, rows, mlp_rows)
PY
# pp = 2: the head's products run on the last stage only, yet each strategy is one table
# with one total (they were appended after every strategy's, a second table each).
mpiexec -n 2 "$WLB" run "$SRC/inputs/run_cp2.toml" "${small[@]}" --set mesh.cp=1 --set mesh.pp=2 --set model.layers=2 \
  --steps 1 --warmup 0 --no-output --quiet --gemm-timing > "$tmp/log" 2> "$tmp/err" || fail "--gemm-timing pp=2: $(cat "$tmp/err")"
for s in plain fixed wlb; do
  [ "$(grep -c "^  $s\$" "$tmp/log")" -eq 1 ] || fail "--gemm-timing pp=2: $s's table is not one: $(cat "$tmp/log")"
done
[ "$(grep -c "^    all " "$tmp/log")" -eq 3 ] || fail "--gemm-timing pp=2: not one total per strategy"

# --kernel-timing: the labelled Kokkos kernels of every strategy's measured steps, summed
# over the ranks; each layer kernel as often as its layer passes, alongside --gemm-timing
mpiexec -n 2 "$WLB" run "$SRC/inputs/run_cp2.toml" "${small[@]}" --set "output.dir=\"$tmp/kt\"" --steps 2 --warmup 1 \
  --quiet --kernel-timing --gemm-timing > "$tmp/log" 2> "$tmp/err" || fail "--kernel-timing: $(cat "$tmp/err")"
grep -q "^Kokkos kernels and deep copies timed one by one" "$tmp/log" || fail "no kernel table: $(cat "$tmp/log")"
/usr/bin/python3 - "$tmp/kt/summary.json" <<'PY' || fail "kernel_timing in summary.json"
import json, sys
j = json.load(open(sys.argv[1]))
by = {}
for r in j["kernel_timing"]:
    assert r["calls"] > 0 and r["seconds"] >= 0, r
    by.setdefault(r["strategy"], {})[r["kernel"]] = r
assert set(by) == {"plain", "fixed", "wlb"}, by.keys()
gemm = {}
for r in j["gemm_timing"]:
    gemm.setdefault(r["strategy"], {})[r["gemm"]] = r["calls"]
for s, k in by.items():
    need = {"wlb::runtime::swiglu", "wlb::runtime::swiglu_bwd", "wlb::runtime::rmsnorm_fwd", "wlb::runtime::rope",
            "wlb::runtime::cross_entropy", "wlb::attention::fwd", "wlb::attention::bwd"}
    assert need <= set(k), (s, sorted(k))
    assert any(n.startswith("deep_copy ") for n in k), (s, sorted(k))
    # one SwiGLU forward and backward per layer pass, as the MLP's W2 product
    assert k["wlb::runtime::swiglu"]["calls"] == k["wlb::runtime::swiglu_bwd"]["calls"] == gemm[s]["mlp.w2.fwd"], s
PY

# a run killed part-way leaves no plan under its final name (only *.partial temporaries,
# which the next run overwrites)
mpiexec -n 2 "$WLB" run "$SRC/inputs/run_cp2.toml" "${small[@]}" --set "output.dir=\"$tmp/killed\"" \
  --steps 200 --warmup 0 --quiet > "$tmp/klog" 2>&1 &
kpid=$!
for _ in $(seq 1 100); do ls "$tmp/killed"/*.partial > /dev/null 2>&1 && break; sleep 0.1; done
sleep 1
kill -TERM $kpid 2> /dev/null; wait $kpid 2> /dev/null
ls "$tmp/killed"/plan.*.jsonl > /dev/null 2>&1 && fail "killed run left plans under final names: $(ls "$tmp/killed")"

mpiexec -n 2 "$WLB" run "$SRC/inputs/run_dp2.toml" "${small[@]}" --steps 1 --warmup 0 --quiet > "$tmp/log" 2>&1 \
  || fail "run_dp2 failed: $(cat "$tmp/log")"
grep -q "tp=1 cp=1 pp=1 dp=2" "$tmp/log" || fail "dp2 table: $(cat "$tmp/log")"

mpiexec -n 3 "$WLB" run "$SRC/inputs/run_cp2.toml" "${small[@]}" > "$tmp/log" 2> "$tmp/err"; rc=$?
[ "$rc" = 2 ] || fail "mesh mismatch exit $rc, wanted 2"
n=$(grep -c "wlb: error" "$tmp/err")
[ "$n" = 1 ] || fail "mesh mismatch printed $n error lines: $(cat "$tmp/err")"

# Two outputs naming one file (the trace over a strategy's plan): exit 2 before any step.
mpiexec -n 2 "$WLB" run "$SRC/inputs/run_cp2.toml" "${small[@]}" --set output.dir="\"$tmp/clash\"" \
  --set output.trace='"plan.wlb.jsonl"' > "$tmp/log" 2> "$tmp/err"; rc=$?
[ "$rc" = 2 ] && grep -q "name the same file" "$tmp/err" || fail "trace over a plan: exit $rc $(cat "$tmp/err")"
[ ! -e "$tmp/clash" ] || fail "trace over a plan: wrote $(ls "$tmp/clash")"

# pipeline.recompute: "selective" gives the same gradients bit for bit with a smaller
# activation peak; "full" is simulated only, exit 2 naming the key before any step.
for r in none selective; do
  mpiexec -n 2 "$WLB" run "$SRC/inputs/run_cp2.toml" "${small[@]}" --steps 1 --warmup 0 --no-output \
    --set pipeline.recompute="\"$r\"" --gradients "$tmp/rc_$r" > "$tmp/rc_$r.log" 2>&1 ||
    fail "recompute $r: $(cat "$tmp/rc_$r.log")"
done
/usr/bin/python3 "$SRC/bench/compare_runs.py" "$tmp/rc_none" "$tmp/rc_selective" --tol 0 > "$tmp/log" ||
  fail "selective recompute changed the gradients: $(cat "$tmp/log")"
peak() { grep -Eo "^  plain +bubble [0-9.]+  peak \[MiB\]  stage 0 [0-9.]+" "$1" | awk '{print $NF}'; }
awk -v a="$(peak "$tmp/rc_none.log")" -v b="$(peak "$tmp/rc_selective.log")" 'BEGIN { exit !(b > 0 && b < 0.8 * a) }' ||
  fail "selective peak $(peak "$tmp/rc_selective.log") vs none $(peak "$tmp/rc_none.log") MiB"
mpiexec -n 2 "$WLB" run "$SRC/inputs/run_cp2.toml" "${small[@]}" --set pipeline.recompute='"full"' \
  --set output.dir="\"$tmp/full\"" > "$tmp/log" 2> "$tmp/err"; rc=$?
[ "$rc" = 2 ] && grep -q 'pipeline.recompute = "full"' "$tmp/err" || fail "recompute full: exit $rc $(cat "$tmp/err")"
[ ! -e "$tmp/full" ] || fail "recompute full wrote $(ls "$tmp/full")"

# pp = 2: the pipeline executor (1F1B, uneven 3-layer split), its summary section
mpiexec -n 2 "$WLB" run "$SRC/inputs/run_cp2.toml" "${small[@]}" --set mesh.cp=1 --set mesh.pp=2 --set model.layers=3 \
  --set packing.micro_batches=4 --set "output.dir=\"$tmp/pp\"" > "$tmp/log" 2> "$tmp/err"; rc=$?
[ "$rc" = 0 ] || fail "pp=2 exit $rc: $(cat "$tmp/err")"
grep -q "^Pipeline 1f1b, 2 stage(s), 1 chunk(s), 4 micro-batch(es)" "$tmp/log" || fail "pp=2: no pipeline section: $(cat "$tmp/log")"
grep -Eq "^  plain +bubble 0\.[0-9]+  peak \[MiB\]  stage 0 [0-9.]+  stage 1 [0-9.]+  pool / in use / asked \[MiB\]  stage 0 [0-9.]+ / [0-9.]+ / [0-9.]+  stage 1 [0-9.]+ / [0-9.]+ / [0-9.]+$" "$tmp/log" ||
  fail "pp=2: no bubble/peak line: $(cat "$tmp/log")"
/usr/bin/python3 - "$tmp/pp/summary.json" <<'EOF' || fail "pp=2 summary.json"
import json, sys
s = json.load(open(sys.argv[1]))
assert s["pipeline"].startswith("1f1b, 2 stage(s)"), s["pipeline"]
for st in s["strategies"]:
    assert len(st["stage_peak_activation_bytes"]) == 2 and min(st["stage_peak_activation_bytes"]) > 0, st
    assert 0 < st["bubble_fraction"] < 1, st
    # the pool holds at least what the step keeps from forward to backward
    assert all(h >= p > 0 for h, p in zip(st["stage_pool_bytes"], st["stage_peak_activation_bytes"])), st
    # what is in use at once is part of what the pool holds; the buffers ask for at most their blocks
    assert all(h >= u >= a > 0 for h, u, a in zip(st["stage_pool_bytes"], st["stage_pool_live_bytes"],
                                                  st["stage_pool_requested_bytes"])), st
    assert st["allocations_per_step"] >= 0, st
EOF
# the simulator's executor memory model predicts the measured activation peak per stage
"$WLB" simulate "$SRC/inputs/run_cp2.toml" "${small[@]}" --set mesh.cp=1 --set mesh.pp=2 --set model.layers=3 \
  --set packing.micro_batches=4 --as-run --out "$tmp/ppsim" > "$tmp/simlog" 2>&1 || fail "pp=2 simulate: $(cat "$tmp/simlog")"
/usr/bin/python3 - "$tmp/pp/summary.json" "$tmp/ppsim/simulate.json" <<'EOF' || fail "pp=2 predicted vs measured activation peak"
import json, sys
run = {s["strategy"]: s["stage_peak_activation_bytes"] for s in json.load(open(sys.argv[1]))["strategies"]}
sim = {r["strategy"]: r["peak_activation_bytes_per_stage"] for r in json.load(open(sys.argv[2]))}
for name, measured in run.items():
    for m, p in zip(measured, sim[name]):
        assert abs(p - m) <= 0.05 * m, (name, measured, sim[name])
EOF

# --gradients: the last step's weight gradients and every loss, identical (to FP32
# rounding) on one rank and on cp = 2 (the CP exchange and dK/dV return are exact moves);
# tf32 runs in FP32 on a host build; nccl on a host build is a deck error naming the key.
"$WLB" run "$SRC/inputs/run_cp2.toml" "${small[@]}" --set mesh.cp=1 --set run.precision='"tf32"' --steps 1 \
  --warmup 0 --quiet --no-output --gradients "$tmp/g1" > "$tmp/log" 2> "$tmp/err" || fail "gradients cp=1: $(cat "$tmp/err")"
mpiexec -n 2 "$WLB" run "$SRC/inputs/run_cp2.toml" "${small[@]}" --set run.comm_backend='"mpi"' --steps 1 --warmup 0 \
  --quiet --no-output --gradients "$tmp/g2" > "$tmp/log" 2> "$tmp/err" || fail "gradients cp=2: $(cat "$tmp/err")"
for s in plain fixed wlb; do [ -s "$tmp/g2/$s.npy" ] || fail "no gradients for $s"; done
/usr/bin/python3 "$SRC/bench/compare_runs.py" "$tmp/g1" "$tmp/g2" --tol 1e-4 > "$tmp/cmp" || fail "cp=1 vs cp=2: $(cat "$tmp/cmp")"
grep -q PASS "$tmp/cmp" || fail "compare_runs: $(cat "$tmp/cmp")"
# tp = 2: the gradients come back whole (a replicated tensor once, column blocks side by
# side), so they compare with one rank's element by element
mpiexec -n 2 "$WLB" run "$SRC/inputs/run_cp2.toml" "${small[@]}" --set mesh.cp=1 --set mesh.tp=2 --steps 1 --warmup 0 \
  --quiet --no-output --gradients "$tmp/g2tp" > "$tmp/log" 2> "$tmp/err" || fail "gradients tp=2: $(cat "$tmp/err")"
/usr/bin/python3 "$SRC/bench/compare_runs.py" "$tmp/g1" "$tmp/g2tp" --tol 1e-4 > "$tmp/cmp" || fail "cp=1 vs tp=2: $(cat "$tmp/cmp")"
# bf16 = BF16 storage of activations and working weights: within BF16's precision of FP32
# (and not equal to it), on one rank and on cp = 2 (BF16 K/V on the wire).
"$WLB" run "$SRC/inputs/run_cp2.toml" "${small[@]}" --set mesh.cp=1 --set run.precision='"bf16"' --steps 1 \
  --warmup 0 --quiet --no-output --gradients "$tmp/g3" > "$tmp/log" 2> "$tmp/err" || fail "bf16 cp=1: $(cat "$tmp/err")"
mpiexec -n 2 "$WLB" run "$SRC/inputs/run_cp2.toml" "${small[@]}" --set run.comm_backend='"mpi"' \
  --set run.precision='"bf16"' --steps 1 --warmup 0 --quiet --no-output --gradients "$tmp/g4" > "$tmp/log" 2> "$tmp/err" \
  || fail "bf16 cp=2: $(cat "$tmp/err")"
/usr/bin/python3 "$SRC/bench/compare_runs.py" "$tmp/g1" "$tmp/g3" --tol 3e-2 > "$tmp/cmp" || fail "bf16 vs fp32: $(cat "$tmp/cmp")"
grep -q "worst 0.000e+00" "$tmp/cmp" && fail "bf16 gradients equal fp32's: $(cat "$tmp/cmp")"
/usr/bin/python3 "$SRC/bench/compare_runs.py" "$tmp/g3" "$tmp/g4" --tol 3e-2 > "$tmp/cmp" || fail "bf16 cp=1 vs cp=2: $(cat "$tmp/cmp")"
"$WLB" run "$SRC/inputs/run_cp2.toml" "${small[@]}" --set mesh.cp=1 --set run.comm_backend='"nccl"' --steps 1 \
  --no-output > "$tmp/log" 2> "$tmp/err"; rc=$?
if "$WLB" --version 2>/dev/null | grep -q "NCCL *yes"; then :; else
  [ "$rc" = 2 ] || fail "comm_backend=nccl on a build without NCCL: exit $rc"
  grep -q "run.comm_backend" "$tmp/err" || fail "nccl error does not name the key: $(cat "$tmp/err")"
fi
# run.attention picks a Hopper kernel variant; a host build runs the same kernels with any
# of them (the same gradients, bit for bit), and an unknown variant is a deck error.
"$WLB" run "$SRC/inputs/run_cp2.toml" "${small[@]}" --set mesh.cp=1 --set run.precision='"tf32"' \
  --set run.attention='"ws-split"' --steps 1 --warmup 0 --quiet --no-output --gradients "$tmp/g5" > "$tmp/log" \
  2> "$tmp/err" || fail "run.attention=ws-split: $(cat "$tmp/err")"
/usr/bin/python3 "$SRC/bench/compare_runs.py" "$tmp/g1" "$tmp/g5" --tol 1e-4 > "$tmp/cmp" || fail "ws-split: $(cat "$tmp/cmp")"
grep -q "worst 0.000e+00" "$tmp/cmp" || fail "run.attention changed a host build's gradients: $(cat "$tmp/cmp")"
"$WLB" run "$SRC/inputs/run_cp2.toml" "${small[@]}" --set run.attention='"fa3"' --steps 1 --no-output \
  > "$tmp/log" 2> "$tmp/err"; rc=$?
[ "$rc" = 2 ] || fail "run.attention=fa3: exit $rc"
grep -q "run.attention" "$tmp/err" || fail "bad run.attention does not name the key: $(cat "$tmp/err")"

# A rank failing mid-step (its pipeline receives posted) ends every rank, with one message.
t0=$SECONDS
WLB_INJECT_FAILURE=1:1 timeout 60 mpiexec -n 2 "$WLB" run "$SRC/inputs/run_cp2.toml" "${small[@]}" --set mesh.cp=1 \
  --set mesh.pp=2 --set model.layers=2 --no-output > "$tmp/log" 2> "$tmp/err"; rc=$?
{ [ "$rc" != 0 ] && [ "$rc" != 124 ]; } || fail "injected failure: exit $rc (124 = hang)"
n=$(grep -c "injected failure on rank 1 at step 1" "$tmp/err")
[ "$n" = 1 ] || fail "injected failure printed $n messages: $(cat "$tmp/err")"
echo "injected failure: every rank ended in $((SECONDS - t0)) s"

echo "wlb run CLI tests passed"

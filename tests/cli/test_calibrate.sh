#!/usr/bin/env bash
# Validation that travels, end to end on a tiny deck: `wlb profile --deck` writes a version-2
# profile shaped by the deck; `wlb calibrate` fits it to a measured `wlb run` trace, prints
# every factor before/after and writes the new profile atomically; bad traces, profiles and
# outputs exit 2 and leave any existing output untouched and no temporary behind;
# `wlb validate-sim` runs profile -> runs -> calibrate -> simulate and prints a row per
# strategy (the 5% target is not asserted: timings on a shared machine).
#   usage: test_calibrate.sh WLB_BINARY SOURCE_DIR
set -u
WLB=$(realpath "$1")
SRC=$(realpath "$2")
fail() { echo "FAIL: $*"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp" || exit 1

cat > tiny.toml <<'TOML'
[model]
name = "tiny"
hidden = 64
heads = 4
kv_heads = 2
ffn = 96
layers = 1

vocab = 256
[mesh]
cp = 2

[data]
seed = 7
context_window = 1024
length_scale = 0.0078125

[packing]
micro_batches = 2

[cp]
comm = "sharding_aware"

[run]
steps = 2
warmup = 1
strategies = ["plain", "fixed", "wlb"]

[output]
dir = "out"
TOML

# 1. Deck-shaped profile: version 2, linear ops at the deck's shape, factors, provenance.
"$WLB" profile --deck tiny.toml --quick --reps 1 --min-seconds 0.001 --out p.json > log 2>&1 \
  || fail "profile --deck: $(cat log)"
grep -q "planned .* step(s) of 3 strategies over 1 deck(s)" log || fail "no planning line: $(cat log)"
/usr/bin/python3 - p.json <<'PY' || fail "deck-shaped profile content"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["version"] == 2 and j["head_dim"] == 16, j.get("version")
lo = j["linear_ops"]
assert lo["shape"] == {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 96, "tp": 1, "vocab": 256}, lo["shape"]
assert 512 in lo["tokens"], lo["tokens"]  # context_window / cp, where the cost model reads it
for op in ("qkv_proj", "out_proj", "mlp"):
    for ph in ("fwd", "bwd"):
        assert len(lo["gflops"][op][ph]) == len(lo["tokens"]) and min(lo["gflops"][op][ph]) > 0
assert set(j["factors"]) >= {"attn.fwd", "attn.bwd", "mlp.bwd", "elementwise"}, j["factors"]
assert j["deck_profile"]["decks"] == ["tiny.toml"] and j["deck_profile"]["rank_batches"] > 0
print("deck-shaped profile ok")
PY
# head options come from the deck
"$WLB" profile --deck tiny.toml --heads 8 --quick --out bad.json > log 2>&1; rc=$?
[ $rc -eq 2 ] || fail "--deck with --heads: exit $rc (want 2)"
[ -e bad.json ] && fail "--deck with --heads wrote output"
"$WLB" profile --deck tiny.toml --deck tiny.toml --set model.ffn=128 --quick --out bad.json > /dev/null 2>&1
"$WLB" profile --deck nosuch.toml --quick --out bad.json > log 2>&1; rc=$?
[ $rc -eq 2 ] || fail "--deck nosuch.toml: exit $rc (want 2)"

# 2. A measured run and its calibration.
mpiexec -n 2 "$WLB" run tiny.toml --set 'hardware.profile="p.json"' --quiet > log 2>&1 || fail "wlb run: $(cat log)"
[ -s out/trace.h5 ] || fail "no trace"
"$WLB" calibrate out/trace.h5 --profile p.json --out p2.json > cal.txt 2>&1 || fail "calibrate: $(cat cal.txt)"
for k in attn.fwd attn.bwd qkv_proj.fwd qkv_proj.bwd out_proj.fwd out_proj.bwd mlp.fwd mlp.bwd elementwise; do
  grep -Eq "^$k +[0-9.]+ +[0-9.]+ +[-+][0-9.]+% " cal.txt || fail "no fitted row for $k: $(cat cal.txt)"
done
grep -Eq "^links.cp_gbps +[0-9.]+ +[0-9.]+ " cal.txt || fail "no cp link row: $(cat cal.txt)"
grep -q "^residual after the fit" cal.txt || fail "no residual table"
grep -q "wrote p2.json" cal.txt || fail "no 'wrote' line"
/usr/bin/python3 - p.json p2.json <<'PY' || fail "calibrated profile content"
import json, sys
a, b = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
assert b["version"] == 2 and len(b["calibration"]) == 1, b.get("calibration")
assert b["calibration"][0]["traces"] == ["out/trace.h5"], b["calibration"][0]["traces"]
assert b["attention"] == a["attention"] and b["linear_ops"] == a["linear_ops"]  # only factors and links move
assert all(v > 0 for v in b["factors"].values())
rs = b["rank_speed"]  # two ranks: the rank-speed spreads are fitted
assert sorted(rs) == ["spread", "step_spread", "task_spread"] and all(0 <= v < 1 for v in rs.values()), rs
assert any(v > 0 for v in rs.values()), rs
print("calibrated profile ok")
PY
ls | grep -q '\.tmp\.' && fail "temporary left behind"
grep -Eq "^rank_speed +spread [0-9.]+ -> [0-9.]+, step_spread [0-9.]+ -> [0-9.]+, task_spread" cal.txt \
  || fail "no rank_speed row: $(cat cal.txt)"
# the calibrated profile drives the simulator, with its spreads or at the mean speed
"$WLB" simulate tiny.toml --as-run --set 'hardware.profile="p2.json"' > log 2>&1 || fail "simulate with p2: $(cat log)"
grep -q "^# rank speed (the profile's rank_speed): .*step_spread" log || fail "no rank-speed note: $(cat log)"
"$WLB" simulate tiny.toml --as-run --mean-speed --set 'hardware.profile="p2.json"' > mean.log 2>&1 \
  || fail "simulate --mean-speed: $(cat mean.log)"
grep -q "^# rank speed" mean.log && fail "--mean-speed kept the spreads: $(cat mean.log)"
# calibrating in place appends to the history
cp p2.json p3.json
"$WLB" calibrate out/trace.h5 --profile p3.json --out p3.json --quiet || fail "in-place calibrate"
/usr/bin/python3 -c "import json,sys; assert len(json.load(open('p3.json'))['calibration']) == 2" || fail "history"
# A fit past the loader's ranges (attention 1 ns long: a factor over 1000) names --out and the
# key, prints the report, and writes nothing.
/usr/bin/python3 - out/trace.h5 fast.h5 <<'PY' || fail "edit the trace"
import h5py, shutil, sys
shutil.copy(sys.argv[1], sys.argv[2])
with h5py.File(sys.argv[2], "r+") as f:
    attn = [r.decode() for r in f["regions"][:]].index("attn")
    ev = f["events"][:]
    m = ev["region"] == attn
    ev["end_ns"][m] = ev["start_ns"][m] + 1
    f["events"][...] = ev
PY
"$WLB" calibrate fast.h5 --profile p.json --out fast.json > fast.txt 2>&1; rc=$?
[ $rc -eq 2 ] && grep -q "wlb: error: --out fast.json: the fitted profile would not load (profile key 'factors.attn" \
  fast.txt && grep -q "^residual after the fit" fast.txt && [ ! -e fast.json ] ||
  fail "a fit past the ranges: rc $rc $(cat fast.txt)"

# 3. Bad input: exit 2, message names the file, the existing output stays as it was.
echo "sentinel" > keep.json
printf 'not hdf5\n' > text.h5
head -c 2000 out/trace.h5 > cut.h5
"$WLB" simulate tiny.toml --as-run --trace sim.h5 > /dev/null 2>&1 || fail "simulate --trace"
echo '{"format": "wlb-hardware-profile", "version": 3}' > v3.json
check_bad() {  # description, expected text, args...
  local what=$1 want=$2
  shift 2
  "$WLB" calibrate "$@" > log 2>&1
  local rc=$?
  [ $rc -eq 2 ] || fail "$what: exit $rc (want 2): $(cat log)"
  grep -q "$want" log || fail "$what: message lacks '$want': $(cat log)"
  [ "$(cat keep.json)" = "sentinel" ] || fail "$what: output overwritten"
  ls | grep -q '\.tmp\.' && fail "$what: temporary left behind"
  return 0
}
check_bad "missing trace" "nosuch.h5" nosuch.h5 --profile p.json --out keep.json
check_bad "not HDF5" "text.h5" text.h5 --profile p.json --out keep.json
check_bad "truncated trace" "cut.h5" cut.h5 --profile p.json --out keep.json
check_bad "simulated trace" "measured trace" sim.h5 --profile p.json --out keep.json
check_bad "missing profile" "nosuch.json" out/trace.h5 --profile nosuch.json --out keep.json
check_bad "bad profile" "version" out/trace.h5 --profile v3.json --out keep.json
echo x > afile
check_bad "output under a file" "afile" out/trace.h5 --profile p.json --out afile/p.json
check_bad "output is the trace" "also an input" out/trace.h5 --profile p.json --out out/trace.h5
# without --profile the trace's deck names the profile the run used (here p.json, found) ...
"$WLB" calibrate out/trace.h5 --out p4.json --quiet || fail "calibrate with the deck's profile"
mv p.json p.moved
check_bad "the deck's profile is gone" "pass --profile" out/trace.h5 --out keep.json
mv p.moved p.json

# 4. The loop on the tiny deck: a row per strategy, the ordering line, validation.json.
start=$(date +%s)
"$WLB" validate-sim tiny.toml --quick --rounds 1 --out vs > vs.txt 2>&1
rc=$?
[ $rc -eq 0 ] || [ $rc -eq 3 ] || fail "validate-sim exit $rc: $(cat vs.txt)"
for s in plain fixed wlb; do
  grep -Eq "^tiny +$s +[0-9.]+ +[0-9.]+ +[-+][0-9.]+% " vs.txt || fail "no row for $s: $(cat vs.txt)"
done
grep -q "ordering by throughput: measured" vs.txt || fail "no ordering line"
grep -Eq "max \|error\| [0-9.]+% vs tolerance 5.0%: (PASS|FAIL)" vs.txt || fail "no verdict line"
grep -q "^== calibrate" vs.txt || fail "calibrate stage not run"
[ -s vs/profile.calibrated.tiny.json ] || fail "no per-deck calibrated profile"
grep -q "core share of the measured run" vs.txt || fail "no core share"
/usr/bin/python3 - vs/validation.json <<'PY' || fail "validation.json"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["format"] == "wlb-validate-sim" and j["seed_offset"] == 1
d = j["decks"][0]
assert [r["strategy"] for r in d["strategies"]] == ["plain", "fixed", "wlb"], d
assert d["plan_segments_differing"] == 0, d  # the simulation predicted the plans that ran
assert d["data_seed"] == 8 and d["profile"] == "profile.calibrated.tiny.json", d
assert j["calibration"] == "per deck" and all("cpu_seconds" in st for st in j["stages"])
PY
echo "validate-sim took $(( $(date +%s) - start )) s"
# an impossible tolerance fails with exit 3, reusing the profile
"$WLB" validate-sim tiny.toml --profile vs/profile.calibrated.tiny.json --no-calibrate --rounds 1 --tolerance 1e-9 --out vs2 \
  > log 2>&1
rc=$?
[ $rc -eq 3 ] || fail "tolerance 1e-9: exit $rc (want 3): $(cat log)"
# bad input before anything runs
"$WLB" validate-sim nosuch.toml --out vs3 > log 2>&1; rc=$?
[ $rc -eq 2 ] || fail "validate-sim nosuch.toml: exit $rc"
"$WLB" validate-sim tiny.toml --calibrate-on other --out vs3 > log 2>&1; rc=$?
[ $rc -eq 2 ] || fail "--calibrate-on other: exit $rc"
grep -q "calibrate-on" log || fail "--calibrate-on message: $(cat log)"
for bad in "--tolerance nan" "--mpirun /nonexistent/mpirun" "--profile tiny.toml" "--no-calibrate --calibrate-on tiny"; do
  want=${bad%% *}
  # shellcheck disable=SC2086
  "$WLB" validate-sim tiny.toml $bad --out vs3 > log 2>&1; rc=$?
  [ $rc -eq 2 ] && grep -q -- "$want" log || fail "validate-sim $bad: exit $rc (want 2 naming $want): $(cat log)"
done
[ -e vs3 ] && fail "bad input created the output directory"
echo PASS

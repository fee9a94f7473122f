#!/usr/bin/env bash
# `wlb profile`: writes a profile JSON in the docs/profile-format.md format (tiles = the
# kernel's tiles, one positive value per grid cell); bad options exit 2 and write nothing.
#   usage: test_kernel_profile.sh WLB_BINARY SOURCE_DIR
set -u
WLB=$1
SRC=$2
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail=0

"$WLB" profile --quick --out "$TMP/p.json" --q-lens 16,100 --k-lens 16,64,300 --reps 1 --min-seconds 0.001 \
  --head-dim 32 --tile-q 32 --tile-k 16 || { echo "FAIL: profile run"; fail=1; }
/usr/bin/python3 - "$TMP/p.json" <<'PY' || fail=1
import json, sys
j = json.load(open(sys.argv[1]))
assert j["format"] == "wlb-hardware-profile" and j["version"] == 1, j
assert j["tile_q"] == 32 and j["tile_k"] == 16 and j["head_dim"] == 32, j
for k in ("peak_gflops", "linear_gflops"):
    assert j[k] > 0, k
for ph in ("fwd", "bwd"):
    t = j["attention"][ph]
    assert t["q_lens"] == [16, 100] and t["k_lens"] == [16, 64, 300], t
    assert len(t["gflops"]) == 2 and all(len(r) == 3 for r in t["gflops"]), t
    assert all(x > 0 for r in t["gflops"] for x in r), t
    # k < q cells carry the value measured at k = q (one measurement, written twice)
    assert t["gflops"][1][0] == t["gflops"][1][1], t
print("profile JSON ok")
PY

# shipped CPU profiles parse and match the kernel's default tiles
for prof in xeon-avx512-1core epyc-avx2-1core; do
/usr/bin/python3 - "$SRC/inputs/profiles/$prof.json" <<'PY' || fail=1
import json, sys
j = json.load(open(sys.argv[1]))
assert j["tile_q"] == 64 and j["tile_k"] == 64, "shipped profile tiles must be the kernel defaults"
for ph in ("fwd", "bwd"):
    t = j["attention"][ph]
    assert len(t["gflops"]) == len(t["q_lens"]) and all(len(r) == len(t["k_lens"]) for r in t["gflops"])
print("shipped profile ok:", sys.argv[1].rsplit("/", 1)[-1])
PY
done

echo '{"links": "x"}' > "$TMP/badbase.json"
for args in "--tile-q 24" "--head-dim 0" "--heads 3 --kv-heads 2" "--q-lens 0,16" "--q-lens 2000000" \
  "--min-seconds -1" "--base $TMP/badbase.json"; do
  # shellcheck disable=SC2086
  "$WLB" profile --quick --out "$TMP/bad.json" $args >"$TMP/log" 2>&1
  rc=$?
  if [ $rc -ne 2 ]; then echo "FAIL: '$args' exit $rc (want 2)"; cat "$TMP/log"; fail=1; fi
  if [ -e "$TMP/bad.json" ]; then echo "FAIL: '$args' wrote output"; fail=1; fi
done

# --base carries what profile does not measure (links, topology, memory, peak) and nothing
# of the base's calibration: its factors would scale the new tables.
/usr/bin/python3 - "$SRC/inputs/profiles/epyc-avx2-1core.json" "$TMP/calbase.json" <<'PY' || fail=1
import json, sys
j = json.load(open(sys.argv[1]))
j["factors"] = {"attn.fwd": 0.5}
j["calibration"] = [{"created": "then"}]
j["links"]["tp_gbps"] = 123.0
json.dump(j, open(sys.argv[2], "w"))
PY
if "$WLB" profile --quick --q-lens 16 --k-lens 16 --base "$TMP/calbase.json" --out "$TMP/nb.json" >"$TMP/log" 2>&1; then
  /usr/bin/python3 - "$TMP/nb.json" <<'PY' || fail=1
import json, sys
j = json.load(open(sys.argv[1]))
assert "factors" not in j and "calibration" not in j, sorted(j)
assert j["links"]["tp_gbps"] == 123.0, j["links"]
print("--base: links carried, calibration not")
PY
else
  echo "FAIL: profile --base"; cat "$TMP/log"; fail=1
fi

# A partial base's carried keys are checked before any timing, naming --base; an explicit
# --peak-gflops wins over the base's peak.
echo '{"links": {"cp_gbps": -1}}' > "$TMP/negbase.json"
"$WLB" profile --quick --q-lens 16 --k-lens 16 --base "$TMP/negbase.json" --out "$TMP/bad.json" >"$TMP/log" 2>&1
rc=$?
if [ $rc -ne 2 ] || ! grep -q "wlb profile: --base $TMP/negbase.json: profile key 'links.cp_gbps'" "$TMP/log" ||
  grep -q "q=" "$TMP/log" || [ -e "$TMP/bad.json" ]; then
  echo "FAIL: a bad partial --base: exit $rc"; cat "$TMP/log"; fail=1
fi
echo '{"peak_gflops": 999}' > "$TMP/peakbase.json"
"$WLB" profile --quick --q-lens 16 --k-lens 16 --peak-gflops 500 --base "$TMP/peakbase.json" --out "$TMP/pk.json" \
  >"$TMP/log" 2>&1 || { echo "FAIL: --peak-gflops with --base"; cat "$TMP/log"; fail=1; }
/usr/bin/python3 -c "
import json, sys
j = json.load(open(sys.argv[1]))
assert j['peak_gflops'] == 500 and 'measured_fma_gflops' not in j, j
" "$TMP/pk.json" || fail=1

[ $fail -eq 0 ] && echo "PASS"
exit $fail

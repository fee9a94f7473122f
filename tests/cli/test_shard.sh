#!/usr/bin/env bash
# wlb shard end to end: comparison table, JSONL (header, one line per micro-batch, summary),
# chosen plan fields, exit 2 and no output on bad input. Usage: test_shard.sh WLB SOURCE_DIR
set -u
WLB="$1"
SRC="$2"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
PY=/usr/bin/python3
[ -x "$PY" ] || PY=python3

cat > "$TMP/deck.toml" <<TOML
[model]
hidden = 512
heads = 8
kv_heads = 4
ffn = 1408
layers = 1
[mesh]
cp = 4
[data]
preset = "long_context_128k"
context_window = 16384
length_scale = 0.125
[packing]
strategy = "wlb"
micro_batches = 3
[cp]
strategy = "adaptive"
comm = "sharding_aware"
[run]
steps = 2
TOML

out="$("$WLB" shard "$TMP/deck.toml" --out "$TMP/s.jsonl" 2>&1)" || fail "shard exited $?: $out"
for s in per_sequence per_document adaptive whole_document hybrid; do
  for c in allgather sharding_aware; do
    echo "$out" | grep -Eq "^$s +$c +[0-9.]+" || fail "missing row $s/$c: $out"
  done
done
[ -s "$TMP/s.jsonl" ] || fail "no JSONL"
ls "$TMP" | grep -q tmp && fail "temporary file left behind"
"$PY" - "$TMP/s.jsonl" <<'PYEOF' || fail "JSONL content"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
assert lines[0]["type"] == "header" and lines[0]["format"] == "wlb-shard" and lines[0]["cp"] == 4
mbs = [l for l in lines if l["type"] == "micro_batch"]
assert len(mbs) == 6, len(mbs)          # 2 steps x 3 micro-batches
assert lines[-1]["type"] == "summary" and lines[-1]["micro_batches"] == 6
for mb in mbs:
    plan = mb["plan"]
    assert mb["requested"] == "adaptive" and mb["strategy"] in ("per_sequence", "per_document")
    assert sum(r["tokens"] for r in plan["ranks"]) == mb["tokens"]
    for r in plan["ranks"]:
        for p in r["pieces"]:
            assert p["kv_len"] == p["q_offset"] + p["q_len"]
    comp = {(c["strategy"], c["comm"]): c for c in mb["compare"]}
    assert len(comp) == 10
    for s in ("per_sequence", "per_document", "adaptive", "whole_document", "hybrid"):
        assert comp[(s, "sharding_aware")]["kv_bytes_total"] <= comp[(s, "allgather")]["kv_bytes_total"] + 1e-6
    assert comp[("per_document", "allgather")]["imbalance_attn"] <= 1.05
PYEOF
# Every summary row carries its planning time per micro-batch (plan_us_mean <= plan_us_max).
"$PY" - "$TMP/s.jsonl" <<'PYEOF' || fail "summary planning times"
import json, sys
summary = [json.loads(l) for l in open(sys.argv[1])][-1]
for row in [summary["chosen"]] + summary["compare"]:
    assert 0 < row["plan_us_mean"] <= row["plan_us_max"], row
PYEOF
# bench/shard_scaling.py: two binaries (here the same one) at two CP degrees, same plans.
scal="$("$PY" "$SRC/bench/shard_scaling.py" --old "$WLB" --new "$WLB" --deck "$TMP/deck.toml" --cp 2 5 \
  --rounds 1 2>&1)" || fail "shard_scaling.py: $scal"
echo "$scal" | grep -Eq "^ +5 +3 " || fail "shard_scaling.py: no cp 5 row: $scal"
echo "$scal" | grep -q "^same plans: yes" || fail "shard_scaling.py: $scal"

# Restricting the comparison; --metrics-only drops the plan.
out="$("$WLB" shard "$TMP/deck.toml" --steps 1 --strategy per_document --comm allgather --metrics-only --out "$TMP/m.jsonl" 2>&1)" \
  || fail "restricted run: $out"
echo "$out" | grep -Eq "^per_document +allgather" || fail "missing restricted row: $out"
echo "$out" | grep -Eq "^hybrid +allgather" && fail "unrequested row printed: $out"
echo "$out" | grep -q "(chosen)" || fail "chosen row not shown: $out"
grep -q '"plan"' "$TMP/m.jsonl" && fail "--metrics-only still wrote plans"

# SlimPack plans sharded as wlb run runs them: a DP-Merge slot is one sample over the
# group's g·cp ranks, listed once (at the group's first replica); the other units' slices
# gather K/V whatever cp.comm, and the chosen row says so.
dm="$SRC/inputs/run_slimpack_dpmerge.toml"
"$WLB" plan "$dm" --packer slimpack --set mesh.cp=2 --set cp.comm=sharding_aware --out "$TMP/dm.jsonl" > /dev/null 2>&1 ||
  fail "plan of the DP-Merge deck"
out="$("$WLB" shard "$dm" --packer slimpack --set mesh.cp=2 --set cp.comm=sharding_aware --out "$TMP/dms.jsonl" 2>&1)" ||
  fail "shard of the DP-Merge deck: $out"
echo "$out" | grep -q "(chosen; [0-9]* SlimPack units gather K/V whatever cp.comm" || fail "chosen row of a SlimPack plan: $out"
"$PY" - "$TMP/dm.jsonl" "$TMP/dms.jsonl" <<'PYEOF' || fail "DP-Merge slots in wlb shard"
import json, sys
steps = {}
for l in open(sys.argv[1]):
    j = json.loads(l)
    if j.get("type") == "step":
        steps[j["step"]] = j
rows = [json.loads(l) for l in open(sys.argv[2])]
rows = [r for r in rows if r["type"] == "micro_batch"]
seen = {(r["step"], r["replica"], r["index"]): r for r in rows}
merged = 0
for s, j in steps.items():
    for m in j.get("merged", []):
        merged += 1
        g = m["group"]
        r = seen.get((s, g[0], m["slot"]))
        assert r is not None, (s, m)
        assert r["ranks"] == 2 * len(g) and r["plan"]["cp"] == 2 * len(g), r["ranks"]
        assert r["comm"] == "sharding_aware", r["comm"]
        for other in g[1:]:
            assert (s, other, m["slot"]) not in seen, (s, other, m)
assert merged > 0, "the deck merged no sample"
plain = [r for r in rows if r["ranks"] == 2]
assert plain and all(r["comm"] == "allgather" for r in plain)
PYEOF

# Bad input: exit 2, nothing written.
"$WLB" shard "$TMP/deck.toml" --strategy ring --out "$TMP/bad.jsonl" > "$TMP/e1" 2>&1
[ $? -eq 2 ] || fail "unknown strategy should exit 2: $(cat "$TMP/e1")"
grep -q "per_sequence" "$TMP/e1" || fail "error should list allowed strategies"
"$WLB" shard "$TMP/deck.toml" --comm p2p --out "$TMP/bad.jsonl" > "$TMP/e2" 2>&1
[ $? -eq 2 ] || fail "unknown comm should exit 2"
"$WLB" shard "$TMP/deck.toml" --set cp.strategy=nope --out "$TMP/bad.jsonl" > "$TMP/e3" 2>&1
[ $? -eq 2 ] || fail "bad cp.strategy should exit 2: $(cat "$TMP/e3")"
# On two ranks a bad name is one message (rank 0's), not one per rank.
timeout 60 mpiexec -n 2 "$WLB" shard "$TMP/deck.toml" --steps 1 --strategy ring --out "$TMP/bad.jsonl" > "$TMP/e4" 2>&1
rc=$?
[ $rc -eq 2 ] && [ "$(grep -c "unknown CP sharding strategy 'ring'" "$TMP/e4")" -eq 1 ] ||
  fail "two ranks, unknown strategy: exit $rc, $(cat "$TMP/e4")"
[ -e "$TMP/bad.jsonl" ] && fail "output written on error"
ls "$TMP" | grep -q tmp && fail "temporary file left behind on error"
echo "test_shard OK"

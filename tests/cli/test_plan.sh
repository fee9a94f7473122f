#!/usr/bin/env bash
# wlb plan / tune / data stats end to end: outputs, --check, checkpoint resume, bad input.
set -u
WLB="$1"; SRC="$2"
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# Compare all packers on the smoke deck with conservation checking.
"$WLB" plan "$SRC/inputs/plan_smoke.toml" --packer all --steps 30 --check --out "$T/plan.jsonl" > "$T/out.txt" 2>&1 \
  || { cat "$T/out.txt"; fail "plan --check"; }
for p in original fixed_greedy fixed_optimal best_fit wlb; do
  grep -q "^$p " "$T/out.txt" || fail "table lacks $p"
  [ -s "$T/plan.$p.jsonl" ] || fail "no plan.$p.jsonl"
  [ "$(wc -l < "$T/plan.$p.jsonl")" -eq 32 ] || fail "plan.$p.jsonl: expected header + 30 steps + summary"
  grep -q "check $p: OK — lost 0 tokens, duplicated 0" "$T/out.txt" || fail "check line for $p"
done
head -1 "$T/plan.wlb.jsonl" | grep -q '"format":"wlb-plan"' || fail "header line"
ls "$T" | grep -q tmp && fail "temporary files left behind"

# User length file, all packers.
"$WLB" plan "$SRC/inputs/plan_lengths_file.toml" --packer all --steps 40 --check > "$T/f.txt" 2>&1 \
  || { cat "$T/f.txt"; fail "plan on length file"; }

# Checkpoint: 10 + 10 steps resumed == 20 steps straight (wlb).
"$WLB" plan "$SRC/inputs/plan_smoke.toml" --packer wlb --steps 20 --out "$T/full.jsonl" > /dev/null || fail "full run"
"$WLB" plan "$SRC/inputs/plan_smoke.toml" --packer wlb --steps 10 --save-state "$T/state.json" > /dev/null || fail "first half"
"$WLB" plan "$SRC/inputs/plan_smoke.toml" --packer wlb --steps 10 --resume "$T/state.json" --out "$T/second.jsonl" > /dev/null || fail "resume"
strip() { grep '"type":"step"' "$1" | sed 's/"metrics":{[^}]*}//'; }
diff <(strip "$T/full.jsonl" | tail -10) <(strip "$T/second.jsonl") > /dev/null || fail "resumed stream differs"
# --check on a resumed stream checks conservation across the checkpoint: no false
# "duplicated" for the documents the restored packers still held.
"$WLB" plan "$SRC/inputs/plan_lengths_file.toml" --packer all --steps 13 --save-state "$T/all.json" > /dev/null \
  || fail "save all"
"$WLB" plan "$SRC/inputs/plan_lengths_file.toml" --packer all --steps 17 --resume "$T/all.json" --check > "$T/rc.txt" 2>&1 \
  || { cat "$T/rc.txt"; fail "--check --resume reported a violation"; }
[ "$(grep -c ': OK — lost 0 tokens, duplicated 0' "$T/rc.txt")" -eq 6 ] || { cat "$T/rc.txt"; fail "--check --resume lines"; }
# A resume on another stream (seed, window, source) is refused, naming the state file and
# what differs; nothing is written.
for change in "data.seed=12345" "data.context_window=4096" "data.source=\"text\"" ; do
  "$WLB" plan "$SRC/inputs/plan_smoke.toml" --packer wlb --steps 5 --resume "$T/state.json" --set "$change" \
    --set "data.path=\"$SRC/inputs/lengths/example_lengths.txt\"" --out "$T/mixed.jsonl" > "$T/e.txt" 2>&1
  rc=$?
  [ $rc -eq 2 ] || { cat "$T/e.txt"; fail "resume with $change: exit $rc"; }
  grep -q "state.json" "$T/e.txt" && grep -q "another document stream" "$T/e.txt" \
    || { cat "$T/e.txt"; fail "resume with $change: message"; }
  [ ! -e "$T/mixed.jsonl" ] || fail "resume with $change wrote output"
done
# An edited state that would duplicate a held document, or a window step out of range, is
# refused naming the file.
/usr/bin/python3 - "$T/all.json" "$T/edited" <<'PY' || fail "editing the state"
import json, sys
s = json.load(open(sys.argv[1]))
a = json.loads(json.dumps(s))
a["packers"]["fixed_greedy"]["state"]["filled"] = -7
json.dump(a, open(sys.argv[2] + "_filled.json", "w"))
b = json.loads(json.dumps(s))
def lists(o):  # the segment lists of a state: [[doc, offset, length, arrival(, q_offset)], ...]
    if isinstance(o, dict):
        for v in o.values():
            yield from lists(v)
    elif isinstance(o, list):
        if o and all(isinstance(x, list) and x and all(isinstance(y, int) for y in x) for x in o):
            yield o
        else:
            for v in o:
                yield from lists(v)
held = next(l for l in lists(b["packers"]["wlb"]["state"]) if l)
held.append(list(held[0]))
json.dump(b, open(sys.argv[2] + "_twice.json", "w"))
PY
for edit in filled:"filled = -7" twice:"held twice"; do
  "$WLB" plan "$SRC/inputs/plan_lengths_file.toml" --packer all --steps 2 --resume "$T/edited_${edit%%:*}.json" \
    --out "$T/edited.jsonl" > "$T/e.txt" 2>&1
  [ $? -eq 2 ] && grep -q "edited_${edit%%:*}.json: packer state: .*${edit#*:}" "$T/e.txt" \
    || { cat "$T/e.txt"; fail "resume from an edited state (${edit%%:*})"; }
done

# fixed_optimal on steps of thousands of documents (wikipedia preset, 32 sequences of
# 128K): the MILP is reduced to its longest items and the step finishes in its time limit
# (it took minutes per step with every item x sequence binary); the plan says so.
"$WLB" plan "$SRC/inputs/paper/7b-128k.toml" --set 'data.preset="wikipedia"' --set mesh.dp=8 --packer all --steps 2 \
  --set packing.milp_time_limit=1 --out "$T/big.jsonl" > "$T/big.txt" 2>&1 || { cat "$T/big.txt"; fail "packer all, big steps"; }
grep -q '"note":"model reduced to the 128 longest of' "$T/big.fixed_optimal.jsonl" || fail "no reduced-model note"
grep -q '"status":"heuristic"' "$T/big.fixed_optimal.jsonl" || fail "reduced model not reported as heuristic"

# Progress lines on stderr (every 5 s by default; every step here), stdout unchanged.
WLB_PROGRESS_SECONDS=0 "$WLB" plan "$SRC/inputs/plan_smoke.toml" --packer wlb --steps 3 > "$T/p.out" 2> "$T/p.err" \
  || fail "progress run"
grep -q "wlb plan: 3/3 steps (wlb), .* steps/s, ETA" "$T/p.err" || { cat "$T/p.err"; fail "no progress line"; }
grep -q "steps/s" "$T/p.out" && fail "progress on stdout"
# ... and on the other long-running commands (rate and ETA), never on stdout.
WLB_PROGRESS_SECONDS=0 "$WLB" simulate "$SRC/inputs/sim_small.toml" --steps 2 > "$T/s.out" 2> "$T/s.err" || fail "simulate"
grep -q "wlb simulate: [0-9]*/[0-9]* steps (.*), .* steps/s, ETA [0-9]* s" "$T/s.err" || { cat "$T/s.err"; fail "simulate progress"; }
WLB_PROGRESS_SECONDS=0 "$WLB" tune "$SRC/inputs/plan_smoke.toml" --sample-steps 2 --max-levels 1 > "$T/t.out" 2> "$T/t.err" || fail "tune"
grep -q "wlb tune: 8/9 candidates (.*), .* candidates/s, ETA" "$T/t.err" || { cat "$T/t.err"; fail "tune progress"; }
WLB_PROGRESS_SECONDS=0 "$WLB" shard "$SRC/inputs/shard_long_context.toml" --steps 2 > "$T/h.out" 2> "$T/h.err" || fail "shard"
grep -q "wlb shard: 1/2 steps, .* steps/s, ETA" "$T/h.err" || { cat "$T/h.err"; fail "shard progress"; }
cat "$T/s.out" "$T/t.out" "$T/h.out" | grep -q "ETA" && fail "progress on stdout"

# Interrupted (SIGINT) while streaming a plan: neither the plan nor its temporary remains.
mkdir "$T/intr"
"$WLB" plan "$SRC/inputs/plan_long_context.toml" --packer wlb --steps 10000000 --out "$T/intr/p.jsonl" > /dev/null 2>&1 &
ipid=$!
for _ in $(seq 1 100); do ls "$T/intr"/p.jsonl.tmp.* > /dev/null 2>&1 && break; sleep 0.1; done
sleep 0.5
kill -INT $ipid; wait $ipid; rc=$?
[ $rc -ne 0 ] || fail "interrupted plan exited 0"
[ -z "$(ls -A "$T/intr")" ] || fail "interrupted plan left files: $(ls "$T/intr")"

# Bad input: exit 2, message names the file/line, no output written.
printf '100\n200\nxyz\n' > "$T/bad.txt"
"$WLB" plan "$SRC/inputs/plan_lengths_file.toml" --set "data.path=\"$T/bad.txt\"" --out "$T/never.jsonl" > "$T/e.txt" 2>&1
rc=$?
[ $rc -eq 2 ] || fail "bad length file: exit $rc"
grep -q "bad.txt:3" "$T/e.txt" || { cat "$T/e.txt"; fail "error lacks file:line"; }
[ ! -e "$T/never.jsonl" ] || fail "output written on error"
"$WLB" plan "$SRC/inputs/plan_smoke.toml" --packer nope > "$T/e2.txt" 2>&1
[ $? -eq 2 ] || fail "unknown packer should exit 2"
"$WLB" plan "$SRC/inputs/plan_smoke.toml" --packer slimpack --set packing.slimpack_candidates=0 > "$T/e3.txt" 2>&1
[ $? -eq 2 ] && grep -q "packing.slimpack_candidates" "$T/e3.txt" || { cat "$T/e3.txt"; fail "bad slimpack key should exit 2"; }
# slimpack plans hold slices, which only the packflow schedule runs: exit 2 naming the key
# under 1f1b, not a wrong figure (the PackFlow simulation itself: test_packflow.sh).
"$WLB" simulate "$SRC/inputs/sim_small.toml" --strategies slimpack+per_document --steps 2 > "$T/e4.txt" 2>&1
[ $? -eq 2 ] && grep -q "pipeline.schedule" "$T/e4.txt" || { cat "$T/e4.txt"; fail "simulate of a slimpack plan under 1f1b should exit 2"; }
# Options are named as the option, not the deck key they stand in for.
"$WLB" plan "$SRC/inputs/plan_smoke.toml" --packer bogus > "$T/e11.txt" 2>&1
[ $? -eq 2 ] && grep -q "^wlb: error: --packer: unknown packer 'bogus'" "$T/e11.txt" || { cat "$T/e11.txt"; fail "plan --packer bogus"; }
"$WLB" shard "$SRC/inputs/plan_smoke.toml" --packer bogus > "$T/e11.txt" 2>&1
[ $? -eq 2 ] && grep -q "^wlb: error: --packer: unknown packer 'bogus'" "$T/e11.txt" || { cat "$T/e11.txt"; fail "shard --packer bogus"; }
"$WLB" simulate "$SRC/inputs/sim_small.toml" --strategies pp-only,wlb+per_sequence > "$T/e11.txt" 2>&1
[ $? -eq 2 ] && grep -q '"pp-only" and "wlb+per_sequence" are the same strategy' "$T/e11.txt" || { cat "$T/e11.txt"; fail "simulate --strategies twice"; }
"$WLB" simulate "$SRC/inputs/sim_small.toml" --strategies bogus+per_sequence > "$T/e11.txt" 2>&1
[ $? -eq 2 ] && grep -q '^wlb: error: --strategies: unknown packer "bogus"' "$T/e11.txt" || { cat "$T/e11.txt"; fail "simulate --strategies bogus"; }
# An output may not be one of the command's inputs: the deck or its length file stay intact.
cp "$SRC/inputs/plan_smoke.toml" "$T/own.toml"
for args in "plan --packer wlb --out" "tune --json" "shard --out" "simulate --trace"; do
  set -- $args
  "$WLB" "$1" "$T/own.toml" "${@:2}" "$T/own.toml" > "$T/e5.txt" 2>&1
  [ $? -eq 2 ] && grep -q "also an input" "$T/e5.txt" || { cat "$T/e5.txt"; fail "$1 writing over its deck should exit 2"; }
  cmp -s "$T/own.toml" "$SRC/inputs/plan_smoke.toml" || fail "$1 changed its deck"
done
cp "$SRC/inputs/lengths/example_lengths.txt" "$T/len.txt"
cp "$T/len.txt" "$T/len.orig"
"$WLB" plan "$SRC/inputs/plan_lengths_file.toml" --set "data.path=\"$T/len.txt\"" --out "$T/len.txt" > "$T/e6.txt" 2>&1
[ $? -eq 2 ] && grep -q "also an input" "$T/e6.txt" || { cat "$T/e6.txt"; fail "plan over its length file should exit 2"; }
cmp -s "$T/len.txt" "$T/len.orig" || fail "plan changed its length file"
# edited_plan DIR LINE PYTHON: a fixed_greedy plan of 3 steps in DIR/plan.jsonl whose step
# line LINE (0-based) is edited as j (its micro-batches: mbs)
edited_plan() {
  "$WLB" plan "$SRC/inputs/plan_smoke.toml" --packer fixed_greedy --steps 3 --out "$1/plan.jsonl" > /dev/null 2>&1 \
    || fail "plan for the replay checks"
  /usr/bin/python3 - "$1/plan.jsonl" "$2" "$3" <<'PY' || fail "editing the plan"
import json, sys
p, k = sys.argv[1], int(sys.argv[2])
lines = open(p).read().splitlines()
j = json.loads(lines[k])
mbs = [mb for r in j["replicas"] for mb in r]
exec(sys.argv[3])
lines[k] = json.dumps(j)
open(p, "w").write("\n".join(lines) + "\n")
PY
}
# A replayed plan file holds what a packer writes: a segment past s_max is refused, file:line.
edited_plan "$T/rp" 1 'next(mb for mb in mbs if mb)[0][2] = 10**9'
"$WLB" simulate "$SRC/inputs/plan_smoke.toml" --plans "$T/rp/plan.jsonl" --steps 1 --warmup 0 > "$T/e7.txt" 2>&1
[ $? -eq 2 ] && grep -q "plan.jsonl:2: .*s_max" "$T/e7.txt" || { cat "$T/e7.txt"; fail "replay of an oversized segment should exit 2"; }
# A segment copied into another micro-batch of the step would be trained twice: refused
# with both lines (the replay trains what the file says).
edited_plan "$T/rp2" 2 '
short = min((seg for mb in mbs for seg in mb), key=lambda seg: seg[2])
min((mb for mb in mbs if short not in mb), key=lambda mb: sum(seg[2] for seg in mb)).append(list(short))'
"$WLB" simulate "$SRC/inputs/plan_smoke.toml" --plans "$T/rp2/plan.jsonl" --steps 2 --warmup 0 > "$T/e9.txt" 2>&1
[ $? -eq 2 ] && grep -q "plan.jsonl:3: document .* are planned again (line 3 plans" "$T/e9.txt" \
  || { cat "$T/e9.txt"; fail "replay of a duplicated segment should exit 2"; }
# Outputs' folders: a plan refused after the checks (a --resume without one packer's state)
# and a shard interrupted mid-run leave neither a temporary nor an empty folder.
"$WLB" plan "$SRC/inputs/plan_smoke.toml" --packer wlb --steps 2 --save-state "$T/st.json" > /dev/null 2>&1 || fail "state"
"$WLB" plan "$SRC/inputs/plan_smoke.toml" --packer wlb --packer best_fit --steps 2 --resume "$T/st.json" \
  --out "$T/nd/x/plan.jsonl" > "$T/e10.txt" 2>&1
[ $? -eq 2 ] && grep -q "no state for packer 'best_fit'" "$T/e10.txt" || { cat "$T/e10.txt"; fail "resume without a packer's state"; }
[ -e "$T/nd" ] && fail "a refused plan left $(find "$T/nd")"
"$WLB" shard "$SRC/inputs/plan_smoke.toml" --steps 100000 --out "$T/sd/y/s.jsonl" > /dev/null 2>&1 &
spid=$!
for _ in $(seq 100); do ls "$T"/sd/y/s.jsonl.tmp.* > /dev/null 2>&1 && break; sleep 0.1; done
ls "$T"/sd/y/s.jsonl.tmp.* > /dev/null 2>&1 || fail "shard made no temporary"
kill -TERM $spid; wait $spid
[ -e "$T/sd" ] && fail "an interrupted shard left $(find "$T/sd")"
# ... while a DP-Merge slot holds one sample of up to its group's g x s_max tokens: the
# replay of a plan whose merged sample (3000 tokens) is longer than s_max (2048) runs.
(for _ in 1 2 3; do echo 3000; for _ in $(seq 50); do echo 100; done; done) > "$T/merge.txt"
cat > "$T/merge.toml" <<TOML
[mesh]
dp = 4
[pipeline]
schedule = "packflow"
[data]
source = "text"
path = "$T/merge.txt"
context_window = 2048
[packing]
micro_batches = 1
[hardware]
profile = "$SRC/inputs/profiles/epyc-avx2-1core.json"
TOML
"$WLB" plan "$T/merge.toml" --packer slimpack --steps 2 --out "$T/merge/plan.jsonl" > /dev/null 2>&1 || fail "DP-Merge plan"
grep -q '"merged":\[{' "$T/merge/plan.jsonl" || fail "the DP-Merge plan merges nothing: $(head -2 "$T/merge/plan.jsonl")"
"$WLB" simulate "$T/merge.toml" --plans "$T/merge/plan.jsonl" --strategies slimpack --steps 2 --warmup 0 --as-run \
  > "$T/e8.txt" 2>&1 || { cat "$T/e8.txt"; fail "replay of a DP-Merge plan with a sample past s_max"; }

# tune and data stats.
"$WLB" tune "$SRC/inputs/plan_smoke.toml" --sample-steps 20 --max-levels 2 > "$T/tune.txt" 2>&1 || { cat "$T/tune.txt"; fail "tune"; }
grep -q "best under budget" "$T/tune.txt" || fail "tune picked nothing"
grep -q "^\[2048,4096,6144\] (deck) " "$T/tune.txt" || fail "tune lacks the deck's thresholds"
"$WLB" tune "$SRC/inputs/plan_smoke.toml" --sample-steps 3 --max-levels 1 --set 'packing.outlier_thresholds=[]' \
  2>/dev/null | grep -q "^\[1536,3072,6144\] (defaults) " || fail "tune lacks the default thresholds"
# "no queues" cannot be written in a deck ([] means the defaults): shown, never advised
grep -q "^no queues (reference) " "$T/tune.txt" || fail "tune lacks the no-queue reference row"
"$WLB" tune "$SRC/inputs/plan_smoke.toml" --sample-steps 3 --max-levels 1 --set packing.delay_budget=0 \
  --json "$T/tune0.json" > "$T/tune0.txt" 2>&1 || { cat "$T/tune0.txt"; fail "tune budget 0"; }
grep -q "^best: --set 'packing.outlier_thresholds=\[[0-9]" "$T/tune0.txt" || { cat "$T/tune0.txt"; fail "tune advised no levels"; }
/usr/bin/python3 - "$T/tune0.json" <<'PY' || fail "tune --json rows"
import json, sys
rows = json.load(open(sys.argv[1]))
nq = [r for r in rows if r["no_queues"]]
assert len(nq) == 1 and nq[0]["label"] == "no queues (reference)" and not nq[0]["best"], nq
assert nq[0]["summary"]["delay_mean"] == 0, nq
PY
"$WLB" data stats --all-presets --window 8192 --steps 5 > "$T/stats.txt" 2>&1 || fail "data stats"
for p in long_context_128k pile code wikipedia sft_chat; do grep -q "generator:$p" "$T/stats.txt" || fail "stats lacks $p"; done
"$WLB" data stats "$SRC/inputs/plan_lengths_file.toml" | grep -q "documents 400" || fail "file stats"
# A deck copied away from its profile finds it relative to itself or the working directory
# only, never in the source tree the binary was built from.
mkdir -p "$T/copied/profiles"
cp "$SRC/inputs/quickstart.toml" "$T/copied/"
(cd "$T" && "$WLB" plan copied/quickstart.toml --steps 1 > "$T/copied.txt" 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "profile: file 'profiles/epyc-avx2-1core.json' not found" "$T/copied.txt" ||
  { cat "$T/copied.txt"; fail "a deck without its profile beside it: exit $rc"; }
cp "$SRC/inputs/profiles/epyc-avx2-1core.json" "$T/copied/profiles/"
(cd "$T/copied" && "$WLB" plan quickstart.toml --steps 1 > /dev/null 2>&1) || fail "a copied deck with its profile"
# A --resume state with a NUL byte (or text) after it is damaged, not read up to the NUL.
"$WLB" plan "$SRC/inputs/plan_smoke.toml" --packer wlb --steps 2 --save-state "$T/st.json" > /dev/null || fail "save-state"
printf '\0{"junk":1}' >> "$T/st.json"
"$WLB" plan "$SRC/inputs/plan_smoke.toml" --packer wlb --steps 2 --resume "$T/st.json" > "$T/nul.txt" 2>&1; rc=$?
[ $rc -eq 2 ] && grep -q "NUL byte" "$T/nul.txt" || fail "--resume of a state with a NUL: exit $rc: $(cat "$T/nul.txt")"
echo "test_plan: OK"

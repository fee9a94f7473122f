#!/usr/bin/env bash
# wlb train end to end: a tiny dataset from /usr/share/common-licenses (always on Debian),
# a tiny model whose training loss falls; a run killed between checkpoints and resumed
# gives bit-identical losses to an uninterrupted one (one rank, dp = 2 and pp = 2); dp = 2,
# cp = 2, tp = 2 and pp = 2 give the one-rank losses; bad input exits 2.
set -u
WLB="$1"; SRC="$2"
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
PY=/usr/bin/python3
cd "$T"

mkdir corpus data
cp -L /usr/share/common-licenses/* corpus/ 2>/dev/null
"$WLB" data prepare corpus --out data/lic --valid-fraction 0.25 --max-bytes 4096 > prep.txt ||
  fail "data prepare"

cat > deck.toml <<'EOF'
[model]
hidden = 32
heads = 2
kv_heads = 1
ffn = 64
layers = 2
vocab = 256
[data]
context_window = 256
[packing]
strategy = "wlb"
micro_batches = 2
[train]
dataset = "data/lic"
steps = 40
lr = 0.01
warmup_steps = 4
eval_interval = 20
eval_tokens = 4096
log_interval = 10
[output]
dir = "out"
EOF

# 1. The loss falls.
"$WLB" train deck.toml > sum.txt 2> err.txt || { cat err.txt; fail "train"; }
grep -q "wlb train: step 40/40" err.txt || fail "no progress line: $(cat err.txt)"
grep -q "eval loss" sum.txt || fail "no eval loss in the summary: $(cat sum.txt)"
grep -Eq "^buffers +pool [0-9.]+ MiB, in use [0-9.]+, asked [0-9.]+ \(the largest rank's\); [0-9.]+ allocations per step after the first$" sum.txt ||
  fail "no buffers line in the summary: $(cat sum.txt)"
$PY - out/train_log.jsonl <<'PYEOF' || fail "loss did not fall"
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
assert [r["step"] for r in recs] == list(range(40)), "steps"
loss = [r["loss"] for r in recs]
first, last = sum(loss[:5]) / 5, sum(loss[-5:]) / 5
ev = [r["eval_loss"] for r in recs if "eval_loss" in r]
print(f"train loss {first:.3f} -> {last:.3f}, eval {ev}")
assert last < first - 1.0, (first, last)
assert len(ev) == 2 and ev[1] < ev[0], ev
PYEOF

# same_steps FULL CUT N WHAT: the two runs' logs agree bit for bit over N steps.
same_steps() {
  $PY - "$1/train_log.jsonl" "$2/train_log.jsonl" "$3" "$4" <<'PYEOF'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
n = int(sys.argv[3])
assert len(a) >= n, len(a)
assert [r["step"] for r in b] == list(range(n)), [r["step"] for r in b]
for x, y in zip(a, b):
    for k in ("loss", "grad_norm", "lr", "tokens", "eval_loss"):
        assert x.get(k) == y.get(k), (x["step"], k, x.get(k), y.get(k))
print(sys.argv[4])
PYEOF
}
same_30_steps() { same_steps "$1" "$2" 30 "$3"; }

# 1b. pipeline.recompute = "selective" trains the same model bit for bit (the backward
#     computes the norms' outputs and the SwiGLU product again from the same inputs).
"$WLB" train deck.toml --set pipeline.recompute='"selective"' --set output.dir='"out_sel"' > /dev/null 2> err.txt ||
  { cat err.txt; fail "train selective"; }
same_steps out out_sel 40 "selective recomputation: 40 steps bit-identical" ||
  fail "selective recompute changed the training"
# A run that ran out of memory resumes with recomputation: stopped after 20 steps without
# it, resumed with it, the log equals the uninterrupted run's.
"$WLB" train deck.toml --set train.checkpoint_interval=10 --set output.dir='"out_oom"' --exit-after 20 \
  > /dev/null 2> err.txt || { cat err.txt; fail "train to step 20"; }
"$WLB" train deck.toml --set train.checkpoint_interval=10 --set output.dir='"out_oom"' --resume \
  --set pipeline.recompute='"selective"' > /dev/null 2> err.txt || { cat err.txt; fail "resume with selective"; }
same_steps out out_oom 40 "resumed with selective recomputation: 40 steps bit-identical" ||
  fail "resume with selective differs"

# 2. Resume: 30 steps straight vs. killed after step 14 (checkpoint at 10) + resume.
ck="--set train.steps=30 --set train.checkpoint_interval=10"
"$WLB" train deck.toml $ck --set output.dir=full --quiet > /dev/null || fail "full run"
WLB_TRAIN_KILL_AFTER_STEP=14 "$WLB" train deck.toml $ck --set output.dir=cut --quiet > /dev/null 2>&1
rc=$?
[ "$rc" = 137 ] || fail "the killed run exited $rc, expected 137 (SIGKILL)"
[ -f cut/checkpoint/checkpoint.wlb ] || fail "no checkpoint"
ls cut/checkpoint | grep -q tmp && fail "a temporary checkpoint was left behind"
"$WLB" train deck.toml $ck --set output.dir=cut --resume > resumed.txt 2> resumed.err ||
  { cat resumed.err; fail "resume"; }
grep -q "steps            10 .. 30" resumed.txt || fail "resume did not start at step 10: $(cat resumed.txt)"
same_30_steps full cut "30 steps bit-identical after kill + resume" || fail "resumed losses differ"
# The same with BF16 storage (the resumed run rebuilds the working copy from the masters);
# its losses follow FP32's within BF16's precision.
bf="--set run.precision=\"bf16\""
"$WLB" train deck.toml $ck $bf --set output.dir=fullbf --quiet > /dev/null || fail "bf16 full run"
WLB_TRAIN_KILL_AFTER_STEP=14 "$WLB" train deck.toml $ck $bf --set output.dir=cutbf --quiet > /dev/null 2>&1
[ -f cutbf/checkpoint/checkpoint.wlb ] || fail "no bf16 checkpoint"
# A checkpoint written before run.precision, train.eval_tokens, the resolved outlier levels
# and the validation files were fingerprinted, and before the header had its checksum (the
# keys stripped from a copy), still resumes, and gives the same 30 steps.
cp -r cutbf cutbfold
$PY - cutbfold/checkpoint/checkpoint.wlb <<'PYEOF' || fail "strip the new fingerprint keys"
import json, struct, sys
b = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", b[8:16])[0]
h = json.loads(b[16:16 + n])
for k in ("run.precision", "train.eval_tokens", "packing.outlier_thresholds (resolved)",
          "train.dataset (validation files)"):
    del h["fingerprint"][k]
del h["header_checksum"]
t = json.dumps(h).encode()
open(sys.argv[1], "wb").write(b[:8] + struct.pack("<Q", len(t)) + t + b[16 + n:])
PYEOF
"$WLB" train deck.toml $ck $bf --set output.dir=cutbfold --resume > resumed.txt 2> resumed.err ||
  { cat resumed.err; fail "bf16 resume of an older checkpoint"; }
same_30_steps fullbf cutbfold "bf16: an older checkpoint resumes bit-identically" || fail "older checkpoint differs"
"$WLB" train deck.toml $ck $bf --set output.dir=cutbf --resume > resumed.txt 2> resumed.err ||
  { cat resumed.err; fail "bf16 resume"; }
same_30_steps fullbf cutbf "bf16: 30 steps bit-identical after kill + resume" || fail "bf16 resumed losses differ"
$PY - full/train_log.jsonl fullbf/train_log.jsonl <<'PYEOF' || fail "bf16 losses vs fp32"
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert any(x["loss"] != y["loss"] for x, y in zip(a, b)), "bf16 losses equal fp32's"
for x, y in zip(a, b):
    assert abs(x["loss"] - y["loss"]) <= 0.03 * x["loss"], (x["step"], x["loss"], y["loss"])
print("bf16 losses within 3% of fp32's at every step")
PYEOF

# 3. Two ranks (dp = 2, cp = 2, tp = 2): the one-rank losses within float reassociation, a
#    trace with the training metrics, and a dp = 2 run killed between checkpoints and
#    resumed on the same mesh gives bit-identical losses to an uninterrupted dp = 2 run.
dp2="--set mesh.dp=2 --set packing.micro_batches=1 --set packing.strategy=\"original\""
"$WLB" train deck.toml --set packing.strategy='"original"' --set output.dir=one1 --quiet > /dev/null ||
  fail "one-rank original run"
timeout 120 mpiexec -n 2 "$WLB" train deck.toml $dp2 --set output.dir=dp2 > dp2.txt 2> dp2.err ||
  { cat dp2.err; fail "dp=2 run"; }
grep -q "mesh             tp=1 cp=1 pp=1 dp=2" dp2.txt || fail "dp=2 summary: $(cat dp2.txt)"
grep -q "wlb train: step 40/40" dp2.err || fail "dp=2: no progress line: $(cat dp2.err)"
[ "$(grep -c 'step 40/40' dp2.err)" = 1 ] || fail "dp=2: progress printed by more than rank 0"
timeout 120 mpiexec -n 2 "$WLB" train deck.toml --set mesh.cp=2 --set output.dir=cp2 --quiet > /dev/null 2> cp2.err ||
  { cat cp2.err; fail "cp=2 run"; }
# the trace holds each step's CP shard plans, as wlb run's does (wlb calibrate reads them)
$PY - cp2/trace.h5 <<'PYEOF' || fail "cp=2 trace: no shard plans"
import json, sys, h5py
with h5py.File(sys.argv[1], "r") as f:
    plans = [json.loads(x) for x in f["plan/shard_json"][:]]
assert plans and all(isinstance(p, list) and p for p in plans), plans[:2]
assert all(len(m["shard"]["ranks"]) == 2 for p in plans for m in p), plans[0][0]
PYEOF
# tp = 2 splits the KV heads too: two of them
"$WLB" train deck.toml --set model.kv_heads=2 --set output.dir=kv2 --quiet > /dev/null || fail "one-rank kv_heads=2 run"
timeout 120 mpiexec -n 2 "$WLB" train deck.toml --set model.kv_heads=2 --set mesh.tp=2 --set output.dir=tp2 --quiet \
  > /dev/null 2> tp2.err || { cat tp2.err; fail "tp=2 run"; }
# pp = 2: a layer per stage, activations and their gradients between the two ranks
timeout 120 mpiexec -n 2 "$WLB" train deck.toml --set mesh.pp=2 --set output.dir=pp2 > pp2.txt 2> pp2.err ||
  { cat pp2.err; fail "pp=2 run"; }
grep -q "mesh             tp=1 cp=1 pp=2 dp=1" pp2.txt || fail "pp=2 summary: $(cat pp2.txt)"
grep -q "$(grep parameters sum.txt)" pp2.txt || fail "pp=2 counts other parameters: $(cat pp2.txt)"
$PY - out/train_log.jsonl cp2/train_log.jsonl one1/train_log.jsonl dp2/train_log.jsonl kv2/train_log.jsonl \
  tp2/train_log.jsonl pp2/train_log.jsonl <<'PYEOF' || fail "multi-rank losses differ"
import json, sys
def load(p): return [json.loads(l) for l in open(p)]
a = sys.argv
for ref, got, what in ((a[1], a[2], "cp=2"), (a[3], a[4], "dp=2"), (a[5], a[6], "tp=2"), (a[1], a[7], "pp=2")):
    a, b = load(ref), load(got)
    assert len(a) == len(b) == 40, (what, len(a), len(b))
    worst = 0.0
    for x, y in zip(a, b):
        assert x["tokens"] == y["tokens"], (what, x["step"])
        for k in ("loss", "eval_loss"):
            if k in x or k in y:
                d = abs(x[k] - y[k]) / max(abs(x[k]), 1e-12)
                worst = max(worst, d)
                assert d < 1e-5, (what, x["step"], k, x[k], y[k])
    print(f"{what}: 40 steps, largest relative loss difference to one rank {worst:.1e}")
PYEOF
if $PY -c "import h5py" 2> /dev/null; then
  PYTHONPATH="$SRC/analysis" $PY - dp2/trace.h5 dp2/train_log.jsonl <<'PYEOF' || fail "trace metrics"
import json, math, sys
import numpy as np
import wlb_trace
t = wlb_trace.load(sys.argv[1])
s, r = t.train_steps, t.train_ranks
log = [json.loads(l) for l in open(sys.argv[2])]
assert list(s["step"]) == list(range(40)), s["step"]
assert list(s["loss"]) == [x["loss"] for x in log]  # the same numbers as the log
assert list(s["tokens"]) == [x["tokens"] for x in log]
assert [x for x in s["eval_loss"] if not math.isnan(x)] == [x["eval_loss"] for x in log if "eval_loss" in x]
assert len(r["rank"]) == 80 and set(r["rank"]) == {0, 1}
assert (s["seconds"] > 0).all() and (r["compute_seconds"] > 0).all()
assert np.allclose(s["tokens_per_second"], s["tokens"] / s["seconds"])
# the activation pool: what is in use is part of what it holds, the buffers ask for at most
# their blocks, and a pool that holds a step's working set allocates little after it
assert (r["pool_bytes"] >= r["pool_live_bytes"]).all() and (r["pool_live_bytes"] >= r["pool_requested_bytes"]).all()
assert (r["pool_requested_bytes"] > 0).all() and (r["allocations"] >= 0).all()
assert r["allocations"][r["step"] == 0].sum() > 0
print("trace: /train/steps equal the log, /train/ranks has both ranks and their pools")
PYEOF
fi
ckdp="$ck $dp2"
timeout 120 mpiexec -n 2 "$WLB" train deck.toml $ckdp --set output.dir=fulldp --quiet > /dev/null 2>&1 || fail "dp=2 full run"
WLB_TRAIN_KILL_AFTER_STEP=14 timeout 120 mpiexec -n 2 "$WLB" train deck.toml $ckdp --set output.dir=cutdp --quiet \
  > /dev/null 2>&1 && fail "the killed dp=2 run exited 0"
[ -f cutdp/checkpoint/checkpoint.wlb ] || fail "no dp=2 checkpoint"
timeout 120 mpiexec -n 2 "$WLB" train deck.toml $ckdp --set output.dir=cutdp --resume > resumed.txt 2> resumed.err ||
  { cat resumed.err; fail "dp=2 resume"; }
grep -q "steps            10 .. 30" resumed.txt || fail "dp=2 resume did not start at step 10: $(cat resumed.txt)"
same_30_steps fulldp cutdp "dp=2: 30 steps bit-identical after kill + resume" || fail "dp=2 resumed losses differ"
# A clean stop: --exit-after 13 checkpoints step 13 (between the interval's) and exits 0;
# --resume continues bit-identically.
"$WLB" train deck.toml $ck --set output.dir=stop --exit-after 13 --quiet > o.txt 2>&1 || { cat o.txt; fail "--exit-after"; }
grep -q "stopped          after step 13 of 30 (--exit-after 13)" o.txt || fail "--exit-after summary: $(cat o.txt)"
"$WLB" train deck.toml $ck --set output.dir=stop --resume > resumed.txt 2> resumed.err ||
  { cat resumed.err; fail "resume after --exit-after"; }
grep -q "steps            13 .. 30" resumed.txt || fail "resume did not start at step 13: $(cat resumed.txt)"
same_30_steps full stop "--exit-after 13 + resume: 30 steps bit-identical" || fail "--exit-after resumed losses differ"
# With no periodic checkpoints (interval 0) the stop still writes one: its summary says
# --resume continues.
"$WLB" train deck.toml $ck --set train.checkpoint_interval=0 --set output.dir=stop0 --exit-after 13 --quiet > o.txt 2>&1 ||
  { cat o.txt; fail "--exit-after, interval 0"; }
[ -f stop0/checkpoint/checkpoint.wlb ] || fail "--exit-after with checkpoint_interval 0 wrote no checkpoint"
"$WLB" train deck.toml $ck --set train.checkpoint_interval=0 --set output.dir=stop0 --resume > resumed.txt 2>&1 ||
  { cat resumed.txt; fail "resume after --exit-after, interval 0"; }
same_30_steps full stop0 "interval 0: --exit-after 13 + resume: 30 steps bit-identical" ||
  fail "interval 0: --exit-after resumed losses differ"
# ... and a resume to the end checkpoints the last step: a second resume trains nothing
# (with interval 0 it found the stop's checkpoint and trained the tail again).
"$WLB" train deck.toml $ck --set train.checkpoint_interval=0 --set output.dir=stop0 --resume > o.txt 2>&1 ||
  { cat o.txt; fail "second resume, interval 0"; }
grep -q "nothing trained  the checkpoint had finished the run" o.txt || fail "second resume, interval 0: $(cat o.txt)"
# --exit-after at or before the checkpoint's step: nothing trained, said so, the log kept.
"$WLB" train deck.toml $ck --set output.dir=ea --exit-after 13 --quiet > /dev/null 2>&1 || fail "--exit-after 13 (ea)"
cp ea/train_log.jsonl log0.jsonl
"$WLB" train deck.toml $ck --set output.dir=ea --resume --exit-after 5 > o.txt 2>&1 || fail "--exit-after before the checkpoint"
grep -q "nothing trained  the checkpoint is at step 13, at or past --exit-after 5" o.txt && ! grep -q "^stopped" o.txt ||
  fail "--exit-after before the checkpoint: $(cat o.txt)"
cmp -s log0.jsonl ea/train_log.jsonl || fail "--exit-after before the checkpoint rewrote the log"
# A fresh run into the folder of a checkpointed one replaces the log and removes the other
# run's checkpoint at its first step: killed before its own first checkpoint, nothing is
# left to resume (a resume of the other's would lose steps, or train a finished run again).
WLB_TRAIN_KILL_AFTER_STEP=14 "$WLB" train deck.toml $ck --set output.dir=stale --quiet > /dev/null 2>&1
WLB_TRAIN_KILL_AFTER_STEP=3 "$WLB" train deck.toml $ck --set output.dir=stale --quiet > /dev/null 2>&1
"$WLB" train deck.toml $ck --set output.dir=stale --resume > o.txt 2>&1; rc=$?
[ $rc -eq 2 ] && grep -q "no checkpoint to resume from" o.txt || fail "resume after a fresh run's kill: exit $rc: $(cat o.txt)"
# A log that misses a step before the checkpoint (or stops short of it) is not the
# checkpoint's run's: refused naming the log's line.
WLB_TRAIN_KILL_AFTER_STEP=14 "$WLB" train deck.toml $ck --set output.dir=gap --quiet > /dev/null 2>&1
sed -i '4d' gap/train_log.jsonl
"$WLB" train deck.toml $ck --set output.dir=gap --resume > o.txt 2>&1; rc=$?
[ $rc -eq 2 ] && grep -q "gap/train_log.jsonl: line 4: step 4 where step 3 was expected" o.txt ||
  fail "resume with a step missing from the log: exit $rc: $(cat o.txt)"
WLB_TRAIN_KILL_AFTER_STEP=14 "$WLB" train deck.toml $ck --set output.dir=short --quiet > /dev/null 2>&1
head -n 5 short/train_log.jsonl > short.jsonl && mv short.jsonl short/train_log.jsonl
"$WLB" train deck.toml $ck --set output.dir=short --resume > o.txt 2>&1; rc=$?
[ $rc -eq 2 ] && grep -q "short/train_log.jsonl: holds steps 0 .. 4 but the checkpoint .* is at step 10" o.txt ||
  fail "resume with a short log: exit $rc: $(cat o.txt)"
# output.dir may change on resume: the new folder's log begins at the checkpoint's step, and a
# second resume into it continues from there.
"$WLB" train deck.toml $ck --set output.dir=moved --set 'train.checkpoint_dir="short/checkpoint"' --resume \
  --exit-after 15 --quiet > o.txt 2>&1 || fail "resume into another output.dir: $(cat o.txt)"
"$WLB" train deck.toml $ck --set output.dir=moved --set 'train.checkpoint_dir="short/checkpoint"' --resume \
  > o.txt 2>&1 || fail "second resume into the other output.dir: $(cat o.txt)"
$PY -c "import json,sys; s=[json.loads(l)['step'] for l in open('moved/train_log.jsonl')]; sys.exit(s != list(range(10, 30)))" ||
  fail "the moved run's log is not steps 10 .. 29: $(cut -c1-60 moved/train_log.jsonl | head -3)"
# ... also when the moved run was killed before its next checkpoint (its log then holds only
# steps at or after the checkpoint's)
WLB_TRAIN_KILL_AFTER_STEP=14 "$WLB" train deck.toml $ck --set output.dir=k2 --quiet > /dev/null 2>&1
WLB_TRAIN_KILL_AFTER_STEP=12 "$WLB" train deck.toml $ck --set output.dir=mv2 --set 'train.checkpoint_dir="k2/checkpoint"' \
  --resume --quiet > /dev/null 2>&1
"$WLB" train deck.toml $ck --set output.dir=mv2 --set 'train.checkpoint_dir="k2/checkpoint"' --resume > o.txt 2>&1 ||
  fail "resume of a moved run killed before its next checkpoint: $(cat o.txt)"
$PY -c "import json,sys; s=[json.loads(l)['step'] for l in open('mv2/train_log.jsonl')]; sys.exit(s != list(range(10, 30)))" ||
  fail "the moved, killed run's log is not steps 10 .. 29"
# A record that is JSON but not a log record names the log and its line, not the checkpoint.
cp stop/train_log.jsonl bad_log.jsonl
WLB_TRAIN_KILL_AFTER_STEP=14 "$WLB" train deck.toml $ck --set output.dir=badrec --quiet > /dev/null 2>&1
sed -i '2s/.*/[1,2]/' badrec/train_log.jsonl
"$WLB" train deck.toml $ck --set output.dir=badrec --resume > o.txt 2>&1; rc=$?
[ $rc -eq 2 ] && grep -q 'badrec/train_log.jsonl: line 2: not a log record' o.txt ||
  fail "a damaged log record: exit $rc: $(cat o.txt)"
"$WLB" train deck.toml $ck --set output.dir=stop --resume > o.txt 2>&1 || fail "resume of a finished run"
grep -q "nothing trained" o.txt || fail "resume of a finished run: $(cat o.txt)"
# SIGUSR1 to mpiexec (what Slurm's --signal sends before a time limit): every rank stops
# after the step in progress, with a checkpoint of it, exit 0.
mpiexec -n 2 "$WLB" train deck.toml $dp2 --set train.steps=100000 --set train.checkpoint_interval=100000 \
  --set output.dir=usr1 --quiet > usr1.txt 2>&1 &
mpid=$!
# the watchdog's sleep goes with it (a sleep left behind held ctest's output pipe open for
# its two minutes)
( trap 'kill $s 2> /dev/null; exit 0' TERM; sleep 120 & s=$!; wait $s; kill -KILL $mpid 2> /dev/null ) &
watchdog=$!
for _ in $(seq 240); do
  [ -f usr1/train_log.jsonl ] && [ "$(wc -l < usr1/train_log.jsonl)" -ge 2 ] && break
  sleep 0.5
done
kill -USR1 $mpid
wait $mpid; rc=$?
kill $watchdog 2> /dev/null
[ "$rc" = 0 ] || { cat usr1.txt; fail "SIGUSR1: exit $rc"; }
k=$(sed -n 's/^stopped          after step \([0-9]*\) of 100000 (SIGUSR1).*/\1/p' usr1.txt)
[ -n "$k" ] || fail "SIGUSR1 summary: $(cat usr1.txt)"
[ "$(wc -l < usr1/train_log.jsonl)" = "$k" ] || fail "SIGUSR1: log has $(wc -l < usr1/train_log.jsonl) steps, stopped after $k"
timeout 120 mpiexec -n 2 "$WLB" train deck.toml $dp2 --set train.steps=100000 --set train.checkpoint_interval=100000 \
  --set output.dir=usr1 --resume --exit-after $((k + 2)) > o.txt 2>&1 || { cat o.txt; fail "resume after SIGUSR1"; }
grep -q "steps            $k .. $((k + 2))" o.txt || fail "resume after SIGUSR1: $(cat o.txt)"
echo "SIGUSR1 stopped both ranks after step $k with a checkpoint; resumed from it"
# A SIGUSR1 sent as soon as the process catches it (main() does so before MPI and Kokkos
# start; the window before that is not something a test can hit on purpose) is kept: the
# run stops after its first step (or the one in progress when the poll was late) with a
# checkpoint instead of dying of the signal.
"$WLB" train deck.toml --set train.steps=100000 --set train.checkpoint_interval=100000 \
  --set output.dir=usr1early --quiet > usr1early.txt 2>&1 &
tpid=$!
for _ in $(seq 2000); do  # until the process catches SIGUSR1 (bit 10 of SigCgt)
  m=$(sed -n 's/^SigCgt:\t*//p' /proc/$tpid/status 2> /dev/null)
  [ -n "$m" ] && (((0x$m >> 9) & 1)) && break
  sleep 0.005
done
kill -USR1 $tpid
timeout 120 tail --pid=$tpid -f /dev/null
wait $tpid; rc=$?
[ "$rc" = 0 ] || { cat usr1early.txt; fail "SIGUSR1 while starting: exit $rc"; }
k=$(sed -n 's/^stopped          after step \([0-9]*\) of 100000 (SIGUSR1).*/\1/p' usr1early.txt)
[ -n "$k" ] && [ -f usr1early/checkpoint/checkpoint.wlb ] || fail "SIGUSR1 while starting: $(cat usr1early.txt)"
echo "SIGUSR1 while the rank started: stopped after step $k with a checkpoint"
# Every rank must read the same checkpoint: rank 1 pointed at an older one (a stale file on
# a node's own disk) stops both with exit 2, not a hang or replicas that drift apart.
timeout 120 mpiexec -n 2 "$WLB" train deck.toml $ckdp --set output.dir=ska --exit-after 4 --quiet > /dev/null 2>&1 ||
  fail "dp=2 --exit-after 4"
timeout 120 mpiexec -n 2 "$WLB" train deck.toml $ckdp --set output.dir=skb --exit-after 2 --quiet > /dev/null 2>&1 ||
  fail "dp=2 --exit-after 2"
# rank 1 runs in node1/, whose ska/ holds skb's checkpoint (the same deck: ranks read the
# same one, or stop before this check)
mkdir -p node1/ska/checkpoint && cp skb/checkpoint/checkpoint.wlb node1/ska/checkpoint/ || fail "node1"
timeout 60 mpiexec -n 1 "$WLB" train "$PWD/deck.toml" $ckdp --set output.dir=ska --resume : \
  -n 1 --wdir node1 "$WLB" train "$PWD/deck.toml" $ckdp --set output.dir=ska --resume \
  > o.txt 2>&1; rc=$?
[ "$rc" = 2 ] && grep -q "rank 1 read another checkpoint than rank 0" o.txt ||
  fail "ranks with different checkpoints: rc $rc $(cat o.txt)"
ckpp="$ck --set mesh.pp=2"
timeout 120 mpiexec -n 2 "$WLB" train deck.toml $ckpp --set output.dir=fullpp --quiet > /dev/null 2>&1 || fail "pp=2 full run"
WLB_TRAIN_KILL_AFTER_STEP=14 timeout 120 mpiexec -n 2 "$WLB" train deck.toml $ckpp --set output.dir=cutpp --quiet \
  > /dev/null 2>&1 && fail "the killed pp=2 run exited 0"
timeout 120 mpiexec -n 2 "$WLB" train deck.toml $ckpp --set output.dir=cutpp --resume > resumed.txt 2> resumed.err ||
  { cat resumed.err; fail "pp=2 resume"; }
same_30_steps fullpp cutpp "pp=2: 30 steps bit-identical after kill + resume" || fail "pp=2 resumed losses differ"
# A pp = 2 checkpoint does not resume on one rank (its layout is the stages').
"$WLB" train deck.toml $ck --set output.dir=cutpp --resume > o.txt 2>&1; rc=$?
[ "$rc" = 2 ] && grep -q "mesh.pp" o.txt || fail "pp=2 checkpoint on one rank: rc $rc $(cat o.txt)"

# 4. Bad input exits 2 naming the key.
"$WLB" train deck.toml --set mesh.tp=2 > o.txt 2>&1; rc=$?  # kv_heads = 1 cannot be split
[ "$rc" = 2 ] && grep -q "mesh.tp" o.txt && grep -q "model.kv_heads" o.txt || fail "mesh.tp=2: rc $rc $(cat o.txt)"
"$WLB" train deck.toml --set mesh.pp=3 > o.txt 2>&1; rc=$?  # 2 layers
[ "$rc" = 2 ] && grep -q "model.layers" o.txt || fail "mesh.pp=3: rc $rc $(cat o.txt)"
# Every schedule trains through the one stage walker: interleaved 1F1B (2 chunks of 2 layers
# per stage) and PackFlow with SlimPack's sliced plans, on pp = 2 against one rank.
il="--set model.layers=4 --set train.steps=12 --quiet"
"$WLB" train deck.toml $il --set output.dir=il1 > o.txt 2>&1 || fail "4-layer one-rank run: $(cat o.txt)"
timeout 120 mpiexec -n 2 "$WLB" train deck.toml $il --set mesh.pp=2 --set pipeline.schedule='"interleaved"' \
  --set mesh.virtual_stages=2 --set output.dir=il2 > o.txt 2>&1 || fail "pp=2 interleaved: $(cat o.txt)"
sp="--set packing.strategy=\"slimpack\" --set pipeline.schedule=\"packflow\" --set train.steps=12 --quiet"
"$WLB" train deck.toml $sp --set output.dir=sp1 > o.txt 2>&1 || fail "slimpack one-rank run: $(cat o.txt)"
timeout 120 mpiexec -n 2 "$WLB" train deck.toml $sp --set mesh.pp=2 --set output.dir=sp2 > o.txt 2>&1 ||
  fail "pp=2 packflow: $(cat o.txt)"
timeout 180 mpiexec -n 4 "$WLB" train deck.toml $sp --set mesh.pp=2 --set mesh.cp=2 --set output.dir=sp4 > o.txt 2>&1 ||
  fail "cp=2 pp=2 packflow: $(cat o.txt)"
$PY - il1/train_log.jsonl il2/train_log.jsonl sp1/train_log.jsonl sp2/train_log.jsonl sp4/train_log.jsonl <<'PYEOF' ||
import json, sys
def load(p): return [json.loads(l) for l in open(p)]
a = sys.argv
for ref, got, what in ((a[1], a[2], "pp=2 interleaved"), (a[3], a[4], "pp=2 packflow"),
                       (a[3], a[5], "cp=2 pp=2 packflow (slices under CP)")):
    x, y = load(ref), load(got)
    assert len(x) == len(y) == 12, (what, len(x), len(y))
    worst = max(abs(p["loss"] - q["loss"]) / abs(p["loss"]) for p, q in zip(x, y))
    assert worst < 1e-5, (what, worst)
    print(f"{what}: 12 steps, largest relative loss difference to one rank {worst:.1e}")
PYEOF
  fail "interleaved / packflow / sliced CP losses differ from one rank"
# wlb run measures the same model on a prepared dataset's real tokens (data.source =
# "megatron" with the .bin beside the .idx); ids outside model.vocab exit 2.
rd="--set data.source=\"megatron\" --set data.path=\"data/lic_train.idx\" --steps 2 --warmup 0"
"$WLB" run deck.toml $rd --set 'run.strategies=["plain"]' --set output.dir=runds > o.txt 2>&1 ||
  fail "wlb run on the dataset: $(cat o.txt)"
grep -q "loss [0-9]" o.txt || fail "wlb run prints no loss: $(cat o.txt)"
"$WLB" run deck.toml $rd --set 'run.strategies=["plain"]' --set model.vocab=100 --set output.dir=runds2 > o.txt 2>&1
rc=$?
[ "$rc" = 2 ] && grep -q "model.vocab" o.txt || fail "wlb run, dataset ids >= vocab: rc $rc $(cat o.txt)"
timeout 60 mpiexec -n 2 "$WLB" train deck.toml --set mesh.cp=2 --set cp.strategy='"nope"' > o.txt 2>&1; rc=$?
[ "$rc" = 2 ] && grep -q "cp.strategy" o.txt || fail "cp=2 with a bad cp.strategy: rc $rc $(cat o.txt)"
"$WLB" train deck.toml --set train.dataset=nope > o.txt 2>&1; rc=$?
[ "$rc" = 2 ] && grep -q "train.dataset" o.txt || fail "missing dataset: rc $rc $(cat o.txt)"
"$WLB" train deck.toml $ck --set output.dir=cut --set train.lr=0.02 --resume > o.txt 2>&1; rc=$?
[ "$rc" = 2 ] && grep -q "train.lr" o.txt || fail "resume with another lr: rc $rc $(cat o.txt)"
"$WLB" train deck.toml $ck --set output.dir=cut --set model.hidden=128 --resume > o.txt 2>&1; rc=$?
[ "$rc" = 2 ] && grep -q "model.hidden" o.txt || fail "resume with a larger model: rc $rc $(cat o.txt)"
"$WLB" train deck.toml $ck --set output.dir=cut --set run.precision=bf16 --resume > o.txt 2>&1; rc=$?
[ "$rc" = 2 ] && grep -q "run.precision" o.txt || fail "resume in another precision: rc $rc $(cat o.txt)"
# Edited or mismatched checkpoints, each refused with exit 2 naming what is wrong.
"$WLB" train deck.toml $ck --set output.dir=edit --exit-after 12 --quiet > /dev/null 2>&1 || fail "--exit-after 12"
# edited NAME PYTHON-EDIT: a copy of edit/ whose checkpoint header h (dict) and bytes b are
# edited; the header's checksum is made to match (as wlb computes it: FNV-1a over the JSON,
# keys sorted, without the key) unless the edit sets keep_header_checksum, so each edit
# reaches the check it is aimed at.
edited() {
  rm -rf "$1" && cp -r edit "$1"
  $PY - "$1/checkpoint/checkpoint.wlb" "$2" <<'PYEOF' || fail "edit $1"
import json, struct, sys
def fnv(data):
    x = 1469598103934665603
    for i in range(0, len(data) - len(data) % 8, 8):
        x = ((x ^ int.from_bytes(data[i:i + 8], "little")) * 1099511628211) % 2**64
    for c in data[len(data) - len(data) % 8:]:
        x = ((x ^ c) * 1099511628211) % 2**64
    return "%016x" % x
b = bytearray(open(sys.argv[1], "rb").read())
n = struct.unpack("<Q", b[8:16])[0]
h = json.loads(b[16:16 + n])
assert "header_checksum" in h, "a checkpoint without its header checksum"
tail = b[16 + n:]
keep_header_checksum = False
exec(sys.argv[2])
if not keep_header_checksum:
    body = {k: v for k, v in h.items() if k != "header_checksum"}
    h["header_checksum"] = fnv(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode())
t = json.dumps(h).encode()
open(sys.argv[1], "wb").write(b[:8] + struct.pack("<Q", len(t)) + t + tail)
PYEOF
}
refused() {  # DIR WANT [ARGS...]: a resume from DIR exits 2 with WANT in the message
  local dir=$1 want=$2
  shift 2
  "$WLB" train deck.toml $ck --set output.dir="$dir" --resume "$@" > o.txt 2>&1; local rc=$?
  [ "$rc" = 2 ] && grep -q -- "$want" o.txt || fail "resume of $dir: rc $rc, wanted 2 and '$want': $(cat o.txt)"
}
edited e_flip 'tail[100] ^= 1'
refused e_flip "does not match its checksum"
edited e_head 'h["packer"]["carry"] = []; keep_header_checksum = True'
refused e_head "the header does not match its checksum"
edited e_format 'h["format"] = "nope"'
refused e_format "not a wlb-train-checkpoint"
edited e_step 'h["step"] = 10**15'
refused e_step "is not a step of this run"
edited e_src 'h["step"] = 5'
refused e_src "its document source is at step 12"
edited e_cursor 'h["source"]["next_id"] += 1'
refused e_cursor "do not belong together"
edited e_tail 'tail += b"\0\0\0\0"'
refused e_tail "bytes after the tensors"
refused edit "hardware.profile" --set "hardware.profile=\"$SRC/inputs/profiles/epyc-avx2-1core.json\""
refused edit "hardware.memory_gb" --set hardware.memory_gb=16
# The default outlier levels written out are the same run as [] (the deck's window is 256:
# [3S/16, 3S/8, 3S/4]); other levels are not.
rm -rf dflt && cp -r edit dflt
"$WLB" train deck.toml $ck --set output.dir=dflt --set 'packing.outlier_thresholds=[48,96,192]' --resume --exit-after 13 --quiet \
  > o.txt 2>&1 || fail "resume with the default levels written out: $(cat o.txt)"
refused edit "packing.outlier_thresholds (resolved)" --set 'packing.outlier_thresholds=[48,96,200]'
# the evaluation losses average over the validation split: another one under the prefix is refused
cp -r data datav
"$WLB" train deck.toml $ck --set train.dataset='"datav/lic"' --set output.dir=dsv --exit-after 4 --quiet > /dev/null 2>&1 ||
  fail "train on datav"
$PY -c "import sys; p = 'datav/lic_valid.bin'; b = bytearray(open(p, 'rb').read()); b[6] ^= 1; open(p, 'wb').write(b)"
refused dsv "train.dataset (validation files)" --set train.dataset='"datav/lic"'
# another dataset prepared under the same prefix (its documents as long, their bytes upper-cased)
cp -r data datax
"$WLB" train deck.toml $ck --set train.dataset='"datax/lic"' --set output.dir=dsx --exit-after 4 --quiet > /dev/null 2>&1 ||
  fail "train on datax"
mkdir -p other && for f in corpus/*; do tr a-z A-Z < "$f" > "other/$(basename "$f")"; done  # same lengths
"$WLB" data prepare other --out datax/lic --valid-fraction 0.25 --max-bytes 4096 > /dev/null || fail "prepare other"
refused dsx "train.dataset (files)" --set train.dataset='"datax/lic"'
# A crash mid-write leaves a torn last line in the log: the resume drops it.
rm -rf torn && cp -r edit torn && printf '{"documents":2,"grad_norm":0.5' >> torn/train_log.jsonl
"$WLB" train deck.toml $ck --set output.dir=torn --resume --quiet > o.txt 2>&1 || fail "resume with a torn log line: $(cat o.txt)"
same_30_steps full torn "a torn last log line: dropped, 30 steps bit-identical" || fail "torn log resume differs"
# Weights that give a non-finite loss (NaN written with a matching checksum) stop the run at
# its first step with exit 2, before a checkpoint of that state.
edited e_nan '
import math
p = h["params"]
tail[0:4 * p] = struct.pack("<f", math.nan) * p
h["checksums"][0] = fnv(bytes(tail[0:4 * p]))
'
cp e_nan/checkpoint/checkpoint.wlb nan_before.wlb
refused e_nan "the run diverged"
cmp -s e_nan/checkpoint/checkpoint.wlb nan_before.wlb || fail "a diverged step overwrote the checkpoint"
"$WLB" train deck.toml --set output.dir=none --resume > o.txt 2>&1; rc=$?
[ "$rc" = 2 ] && grep -q "no checkpoint" o.txt || fail "resume without a checkpoint: rc $rc $(cat o.txt)"
[ ! -e none ] || fail "resume without a checkpoint left its output folder"
# ids outside the vocabulary show at the first step: the run leaves no folder, no empty log
"$WLB" train deck.toml --set model.vocab=100 --set output.dir=smallvocab/run > o.txt 2>&1; rc=$?
[ "$rc" = 2 ] && grep -q "model.vocab" o.txt || fail "vocab too small: rc $rc $(cat o.txt)"
[ ! -e smallvocab ] || fail "vocab too small left $(find smallvocab)"
# ... and an earlier run's log in output.dir is left whole (the ids are checked before step 0)
"$WLB" train deck.toml --set train.steps=2 --set output.dir=vk --quiet > /dev/null 2>&1 || fail "train into vk"
cp vk/train_log.jsonl vk_log.before
"$WLB" train deck.toml --set train.steps=2 --set output.dir=vk --set model.vocab=100 --quiet > o.txt 2>&1; rc=$?
[ "$rc" = 2 ] && grep -q "model.vocab" o.txt || fail "vocab too small over a run: rc $rc $(cat o.txt)"
cmp -s vk/train_log.jsonl vk_log.before || fail "a refused run replaced the earlier run's log"
# output.trace in a sub-folder of output.dir: made with it
"$WLB" train deck.toml --set train.steps=2 --set output.dir=tsub --set output.trace='"sub/t.h5"' --quiet > o.txt 2>&1 ||
  fail "trace in a sub-folder: $(cat o.txt)"
[ -f tsub/sub/t.h5 ] || fail "trace in a sub-folder: no tsub/sub/t.h5"
touch afile
"$WLB" train deck.toml --set train.checkpoint_interval=1 --set train.checkpoint_dir=afile/ck --set output.dir=ckbad \
  > o.txt 2>&1; rc=$?
[ "$rc" = 2 ] && grep -q "train.checkpoint_dir" o.txt || fail "checkpoint under a file: rc $rc $(cat o.txt)"
[ ! -e ckbad ] || fail "checkpoint under a file: a step ran before the error"
# Ranks that read other copies of the dataset (node-local disks; here each rank's working
# directory): one without the validation split is refused at the start (it skipped the
# evaluation's collective the other entered: a hang).
mkdir -p vA vB && cp -r deck.toml data vA/ && cp -r deck.toml data vB/ && rm vB/data/lic_valid.*
vset="$dp2 --set train.steps=4 --set train.log_interval=1 --set train.checkpoint_interval=3"
timeout 120 mpiexec -n 1 --wdir vA "$WLB" train deck.toml $vset --set output.dir=\"$PWD/vout\" --quiet : \
  -n 1 --wdir vB "$WLB" train deck.toml $vset --set output.dir=\"$PWD/vout\" --quiet > o.txt 2>&1; rc=$?
[ "$rc" = 2 ] && grep -q "every rank must read the same dataset" o.txt ||
  fail "a rank without the validation split: rc $rc $(cat o.txt)"
# A resume refused on one rank (its checkpoint_dir, relative to its deck, holds none) leaves
# the log as it was (rank 0 cut it back to the checkpoint's step before the others agreed).
cp -r data/lic_valid.* vB/data/
timeout 120 mpiexec -n 2 --wdir vA "$WLB" train deck.toml $vset --set train.checkpoint_dir='"ck"' \
  --set output.dir=\"$PWD/vout\" --quiet > o.txt 2>&1 || fail "4 steps with a checkpoint at 3: $(cat o.txt)"
before=$(md5sum < vout/train_log.jsonl)
timeout 120 mpiexec -n 1 --wdir vA "$WLB" train deck.toml $vset --set train.checkpoint_dir='"ck"' \
  --set output.dir=\"$PWD/vout\" --resume --quiet : -n 1 --wdir vB "$WLB" train deck.toml $vset \
  --set train.checkpoint_dir='"ck"' --set output.dir=\"$PWD/vout\" --resume --quiet > o.txt 2>&1; rc=$?
[ "$rc" = 2 ] && grep -q "rank 1" o.txt || fail "resume without rank 1's checkpoint: rc $rc $(cat o.txt)"
[ "$(md5sum < vout/train_log.jsonl)" = "$before" ] || fail "a refused resume changed the log"
echo "PASS"

#!/usr/bin/env bash
# No output of a command may overwrite one of its inputs (the deck, the dataset, the
# hardware profile) or another of its outputs: each such path exits 2 naming the key or
# option, before any work, and the inputs are left byte for byte as they were. Ranks that
# cannot all reach the trace's folder are refused the same way.
set -u
WLB=$1
SRC=$2
fail() { echo "FAIL: $*"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp" || exit 1

cat > run.toml <<TOML
[model]
hidden = 64
heads = 2
kv_heads = 1
ffn = 128
layers = 1
vocab = 256
[data]
context_window = 512
length_scale = 0.004
[packing]
micro_batches = 1
[hardware]
profile = "$SRC/inputs/profiles/epyc-avx2-1core.json"
[run]
steps = 1
warmup = 0
strategies = ["plain", "wlb"]
[output]
dir = "out"
TOML
mkdir corpus && cp /usr/share/common-licenses/GPL-3 /usr/share/common-licenses/Apache-2.0 corpus/
"$WLB" data prepare corpus --out ds/tok --valid-fraction 0.5 > /dev/null || fail "data prepare"
cat > train.toml <<TOML
[model]
hidden = 64
heads = 2
kv_heads = 1
ffn = 128
layers = 1
vocab = 256
[data]
context_window = 256
[packing]
strategy = "original"
micro_batches = 1
[train]
dataset = "ds/tok"
steps = 2
checkpoint_interval = 1
[output]
dir = "trout"
TOML
sums() { cat run.toml train.toml ds/* | md5sum; }
before=$(sums)

# refused CMD... : exit 2, a message with $WANT, the inputs unchanged
refused() {
  "$@" > out.txt 2>&1; local rc=$?
  [ "$rc" = 2 ] || fail "exit $rc, wanted 2: $* ($(tail -2 out.txt))"
  grep -q -- "$WANT" out.txt || fail "message lacks '$WANT': $* ($(cat out.txt))"
  [ "$(sums)" = "$before" ] || fail "an input changed: $*"
}
WANT="output.trace 'trout/../train.toml': is also an input" refused "$WLB" train train.toml --set output.trace=../train.toml --quiet
WANT="is also an input" refused "$WLB" train train.toml --set output.trace=../ds/tok_train.idx --quiet
WANT="output.trace and output.dir (train_log.jsonl) name the same file" \
  refused "$WLB" train train.toml --set output.trace=train_log.jsonl --quiet
WANT="name the same file 'trout/checkpoint.wlb'" \
  refused "$WLB" train train.toml --set 'train.checkpoint_dir="trout"' --set output.trace=checkpoint.wlb --quiet
[ ! -e trout ] || fail "a refused train left its output folder"
WANT="output.plan (wlb) 'out/../run.toml': is also an input" \
  refused "$WLB" run run.toml --set 'run.strategies=["wlb"]' --set output.plan=../run.toml --quiet
WANT="is also an input" refused "$WLB" run run.toml --set "output.trace=\"$SRC/inputs/profiles/epyc-avx2-1core.json\"" --quiet
WANT="--gradients (losses.json) and output.trace name the same file" \
  refused "$WLB" run run.toml --gradients g --set 'output.dir="g"' --set output.trace=losses.json --quiet
# Each strategy's gradients file too: refused before the run (it failed after the run's
# outputs were written, or overwrote a plan file of the same name).
mkdir -p gn/wlb.npy
WANT="--gradients (wlb.npy) 'gn/wlb.npy': is a directory" \
  refused "$WLB" run run.toml --gradients gn --set 'output.dir="gno"' --quiet
[ ! -e gno ] && [ "$(ls gn)" = "wlb.npy" ] || fail "a refused --gradients wrote $(find gno gn)"
WANT="--gradients (plain.npy) and output.plan (plain) name the same file" \
  refused "$WLB" run run.toml --gradients gc --set 'output.dir="gc"' --set output.plan=plain.npy --set 'run.strategies=["plain"]' --quiet
# (as root the folder cannot be made; as a user /proc cannot be written in)
WANT="output.dir.*/proc/wlbout" \
  refused "$WLB" run run.toml --set 'output.dir="/proc/wlbout"' --quiet
WANT="--steps: '99999999999999999999' is out of range (must be in " \
  refused "$WLB" run run.toml --steps 99999999999999999999 --no-output
WANT="--warmup: must be in " refused "$WLB" simulate run.toml --warmup -1
WANT="--out '/proc/wlbvs/x': cannot " refused "$WLB" validate-sim run.toml --quick --rounds 1 --out /proc/wlbvs/x
WANT="--out 'run.toml': is also an input" refused "$WLB" profile --quick --deck run.toml --out run.toml
# --gradients' folder is made before the run: where none can be made, exit 2 before any output
# (as root the folder cannot be made; as a user /proc cannot be written in)
WANT="--gradients '/proc/wlbgrad': cannot " \
  refused "$WLB" run run.toml --gradients /proc/wlbgrad --set 'output.dir="gp"' --quiet
[ ! -e gp ] || fail "a refused --gradients left the run's outputs: $(find gp)"
touch afile
WANT="--out 'afile': is a file" refused "$WLB" validate-sim run.toml --quick --rounds 1 --out afile
WANT="--summary-json and --out name the same file" refused "$WLB" plan run.toml --packer wlb --out x.jsonl --summary-json x.jsonl
WANT="--save-state and --out name the same file" refused "$WLB" plan run.toml --packer wlb --out x.jsonl --save-state x.jsonl
WANT="--trace and --out name the same file" refused "$WLB" simulate run.toml --out simo --trace simo/simulate.json
# A device is not an output: the rename into place would replace it (run as root over
# /dev/null, that broke the machine's /dev/null for everyone).
WANT="is not a regular file" refused "$WLB" plan run.toml --packer wlb --steps 1 --summary-json /dev/null
[ -c /dev/null ] || fail "/dev/null is no longer a character device"
[ ! -e x.jsonl ] && [ ! -e simo ] || fail "a refused command left an output"
# Ranks that do not share output.dir (a relative path on node-local disks) stop at once with
# exit 2 naming the rank, instead of hanging in the trace's parallel create.
mkdir nA nB && cp run.toml nA/ && cp run.toml nB/
timeout 120 mpiexec -n 1 --wdir nA "$WLB" run run.toml --set mesh.dp=2 --quiet : \
  -n 1 --wdir nB "$WLB" run run.toml --set mesh.dp=2 --quiet > out.txt 2>&1; rc=$?
[ "$rc" = 2 ] && grep -q "rank 1 cannot see the folder rank 0 writes it in" out.txt ||
  fail "ranks without a shared output.dir: rc $rc $(cat out.txt)"
# A rank that cannot read the deck (node-local, another working directory) or reads
# another one ends every rank with exit 2 naming it, instead of a hang in the first
# collective (the deck is agreed before any work).
mkdir nC
timeout 120 mpiexec -n 1 "$WLB" run run.toml --set mesh.dp=2 --quiet : \
  -n 1 --wdir nC "$WLB" run run.toml --set mesh.dp=2 --quiet > out.txt 2>&1; rc=$?
[ "$rc" = 2 ] && grep -q "wlb: error (rank 1): cannot open deck 'run.toml'" out.txt &&
  grep -q "the deck could not be read on 1 of 2 ranks" out.txt || fail "a rank without the deck: rc $rc $(cat out.txt)"
timeout 120 mpiexec -n 1 "$WLB" mesh run.toml --set mesh.dp=2 : -n 1 "$WLB" mesh run.toml --set mesh.cp=2 > out.txt 2>&1
rc=$?
[ "$rc" = 2 ] && grep -q "rank 1 read another deck than rank 0" out.txt || fail "ranks with other decks: rc $rc $(cat out.txt)"
# The options beside the deck shape the collectives too (--steps here): the same deck with
# other options is refused, not left to hang.
timeout 120 mpiexec -n 1 "$WLB" run run.toml --set mesh.dp=2 --quiet --steps 3 : \
  -n 1 "$WLB" run run.toml --set mesh.dp=2 --quiet --steps 2 > out.txt 2>&1; rc=$?
[ "$rc" = 2 ] && grep -q "rank 1 was started with other options than rank 0" out.txt ||
  fail "ranks with other options: rc $rc $(cat out.txt)"
# An input file that one rank reads differently (a node-local copy): that rank's message is
# printed, whichever command reads it (it went unprinted behind rank 0's normal output).
mkdir -p lA lB && cp run.toml lA/ && cp run.toml lB/ && printf '100\n300\n' > lA/l.txt && printf '100\nabc\n' > lB/l.txt
for c in validate plan simulate "data stats"; do
  timeout 120 mpiexec -n 1 --wdir lA "$WLB" $c run.toml --set data.source='"text"' --set data.path='"l.txt"' : \
    -n 1 --wdir lB "$WLB" $c run.toml --set data.source='"text"' --set data.path='"l.txt"' > out.txt 2>&1; rc=$?
  [ "$rc" = 2 ] && grep -q "wlb: error (rank 1): .*l.txt:2: expected a positive integer" out.txt &&
    grep -q "the inputs could not be read on 1 of 2 ranks" out.txt || fail "$c, a length file bad on rank 1: rc $rc $(cat out.txt)"
done
# No room for the trace (a file-size limit stands in for a full disk; the plans fit): exit 2
# on every rank with the trace's path and the system's reason, within the timeout, and
# nothing left behind: no temporary, no plan, no folder.
for n in 1 2; do
  timeout 120 mpiexec -n $n bash -c "trap '' XFSZ; ulimit -f 1024; exec '$WLB' run run.toml --steps 300 --quiet \
    --set mesh.dp=$n --set 'output.dir=\"full$n\"'" > out.txt 2>&1; rc=$?
  [ "$rc" = 2 ] && grep -q "full$n/trace.h5: cannot write it (.*File too large" out.txt ||
    fail "$n rank(s), trace past the file-size limit: rc $rc $(cat out.txt)"
  [ "$(grep -c "cannot write it" out.txt)" = 1 ] || fail "$n rank(s): not one message: $(cat out.txt)"
  [ ! -e full$n ] || fail "$n rank(s), trace past the file-size limit left $(ls -a full$n)"
done
# A simulated trace with no room (the file-size limit of the run above) leaves no folder made for it.
timeout 120 mpiexec -n 1 bash -c "trap '' XFSZ; ulimit -f 1024; exec '$WLB' simulate run.toml --steps 3000 --trace nr/a/t.h5" \
  > out.txt 2>&1; rc=$?
[ "$rc" = 2 ] && [ ! -e nr ] || fail "simulate --trace with no room: rc $rc, left $(find nr 2>/dev/null) $(tail -2 out.txt)"
# simulate --out writes its CSV and JSON both or neither: the JSON with no room leaves the
# old pair as it was (a new CSV beside an old JSON would disagree with it).
mkdir so && echo old > so/simulate.csv && echo old > so/simulate.json
timeout 120 mpiexec -n 1 bash -c "trap '' XFSZ; ulimit -f 1; exec '$WLB' simulate run.toml --steps 3 --out so" \
  > out.txt 2>&1; rc=$?
[ "$rc" = 2 ] && grep -q "so/simulate.json': write failed (File too large)" out.txt &&
  [ "$(cat so/simulate.csv so/simulate.json)" = "$(printf 'old\nold')" ] && [ "$(ls so)" = "$(printf 'simulate.csv\nsimulate.json')" ] ||
  fail "simulate --out with no room for the JSON: rc $rc, $(ls so) $(tail -2 out.txt)"
echo "outputs: every collision with an input or another output refused, inputs unchanged"

#!/usr/bin/env bash
# The wlb driver end to end: help, version, validate, bad decks exit 2 naming the key,
# and a mesh/world-size mismatch exits 2 on every rank with one message.
set -u
WLB=$1
SRC=$2
fail() { echo "FAIL: $*"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$WLB" --help | grep -q "validate" || fail "--help lists no subcommands"
"$WLB" validate --help | grep -q -- "--set" || fail "validate --help lacks --set"
"$WLB" --version | grep -q "Kokkos" || fail "--version lacks Kokkos"
"$WLB" --version | grep -q "HDF5" || fail "--version lacks HDF5"

"$WLB" validate "$SRC/inputs/quickstart.toml" > "$tmp/out" || fail "quickstart deck invalid"
grep -q "head_dim = 64" "$tmp/out" || fail "resolved deck lacks derived head_dim"
grep -q "^#   packing.outlier_thresholds = \[[0-9]" "$tmp/out" || fail "validate does not show the outlier levels used"
grep -q "^#   packing.max_queue_wait = [1-9]" "$tmp/out" || fail "validate does not show the queue wait used"

printf '[model]\nhidden = 256\n[mesh]\ncpp = 2\n' > "$tmp/typo.toml"
"$WLB" validate "$tmp/typo.toml" > "$tmp/out" 2> "$tmp/err"; rc=$?
[ "$rc" = 2 ] || fail "typo deck exit $rc, wanted 2"
grep -q "typo.toml:4: unknown key 'cpp' in table \[mesh\] (did you mean 'cp'?)" "$tmp/err" || fail "typo message: $(cat "$tmp/err")"
[ ! -s "$tmp/out" ] || fail "bad deck printed output"

"$WLB" validate "$SRC/inputs/quickstart.toml" --set mesh.cp=0 2> "$tmp/err" >/dev/null; rc=$?
[ "$rc" = 2 ] || fail "--set out of range exit $rc"
grep -q "mesh.cp" "$tmp/err" || fail "--set message lacks key"

# a mesh whose rank count would not fit an int (it wrapped to a negative count)
"$WLB" validate "$SRC/inputs/quickstart.toml" --set mesh.cp=65536 --set mesh.pp=32768 --set model.layers=100000 \
  2> "$tmp/err" >/dev/null; rc=$?
[ "$rc" = 2 ] && grep -q "key 'mesh': tp x cp x pp x dp = 1 x 65536 x 32768 x 1 = 2147483648 ranks" "$tmp/err" || fail "huge mesh: rc $rc $(cat "$tmp/err")"

"$WLB" validate "$tmp/missing.toml" 2> "$tmp/err"; rc=$?
[ "$rc" = 2 ] || fail "missing deck exit $rc"

# a slimpack strategy needs the packflow schedule in run and train: validate says so first
for set in 'packing.strategy="slimpack"' 'run.strategies=["plain","slimpack"]'; do
  "$WLB" validate "$SRC/inputs/quickstart.toml" --set "$set" --set pipeline.schedule=1f1b 2> "$tmp/err" >/dev/null; rc=$?
  [ "$rc" = 2 ] || fail "validate of slimpack under 1f1b ($set) exit $rc"
  grep -q "pipeline.schedule" "$tmp/err" || fail "slimpack/1f1b message lacks the key: $(cat "$tmp/err")"
  "$WLB" validate "$SRC/inputs/quickstart.toml" --set "$set" --set pipeline.schedule=packflow > /dev/null 2> "$tmp/err" \
    || fail "validate of slimpack under packflow ($set): $(cat "$tmp/err")"
done

# a directory as the deck: exit 2 naming it (it used to run on the built-in defaults)
for sub in validate plan shard simulate; do
  "$WLB" $sub "$tmp" > "$tmp/out" 2> "$tmp/err"; rc=$?
  [ "$rc" = 2 ] || fail "$sub DIR exit $rc, wanted 2"
  grep -q "is a directory" "$tmp/err" || fail "$sub DIR message: $(cat "$tmp/err")"
done

# negative or zero --steps: exit 2 with the bound (not silently run.steps, not a 300-digit bound)
for sub in plan shard simulate run; do
  "$WLB" $sub "$SRC/inputs/quickstart.toml" --steps -5 > "$tmp/out" 2> "$tmp/err"; rc=$?
  [ "$rc" = 2 ] || fail "$sub --steps -5 exit $rc, wanted 2"
  grep -q "must be in \[1, 1000000000000\] (got -5)" "$tmp/err" || fail "$sub --steps -5 message: $(cat "$tmp/err")"
  [ "$(wc -c < "$tmp/err")" -lt 300 ] || fail "$sub --steps -5 message too long: $(cat "$tmp/err")"
done
"$WLB" run "$SRC/inputs/quickstart.toml" --warmup -1 > "$tmp/out" 2> "$tmp/err"; rc=$?
[ "$rc" = 2 ] && grep -q "must be in \[0, 1000000000000\] (got -1)" "$tmp/err" || fail "run --warmup -1: exit $rc $(cat "$tmp/err")"

# validate reads every file the deck names (a batch job must not fail after queueing)
vbad() {  # name, deck text, expected words
  printf "$2" > "$tmp/$1.toml"
  "$WLB" validate "$tmp/$1.toml" > "$tmp/out" 2> "$tmp/err"; rc=$?
  [ "$rc" = 2 ] || fail "validate $1 exit $rc, wanted 2"
  grep -q "$3" "$tmp/err" || fail "validate $1 message: $(cat "$tmp/err")"
}
vbad nolen '[data]\nsource = "text"\npath = "missing-lengths.txt"\n' "length file 'missing-lengths.txt': cannot open"
vbad noprof '[hardware]\nprofile = "missing-profile.json"\n' "missing-profile.json"
echo 1000000000000 > "$tmp/huge.txt"   # a huge length is refused before any allocation
vbad huge "[data]\nsource = \"text\"\npath = \"$tmp/huge.txt\"\n" "exceeds the limit of 2147483647 tokens"
/usr/bin/python3 -c "import struct,sys; open(sys.argv[1],'wb').write(b'MMIDIDX\0\0'+struct.pack('<QBQQ',1,4,2**62,1)+bytes(64))" "$tmp/huge.idx"
vbad idx "[data]\nsource = \"megatron\"\npath = \"$tmp/huge.idx\"\n" "sizes\[\]: 4611686018427387904 entries"

# plan --out must be a file name: a directory (or a path under a file) exits 2, writes nothing;
# missing folders are made
"$WLB" plan "$SRC/inputs/quickstart.toml" --steps 1 --packer original --packer wlb --out "$tmp" > "$tmp/out" 2> "$tmp/err"; rc=$?
[ "$rc" = 2 ] && grep -q "is a directory" "$tmp/err" || fail "plan --out DIR: exit $rc $(cat "$tmp/err")"
ls "$tmp".* > /dev/null 2>&1 && fail "plan --out DIR wrote files beside it"
"$WLB" plan "$SRC/inputs/quickstart.toml" --steps 1 --packer wlb --out "$tmp/no/such/p.jsonl" > "$tmp/out" 2> "$tmp/err"; rc=$?
[ "$rc" = 0 ] && [ -s "$tmp/no/such/p.jsonl" ] || fail "plan --out in a missing folder: exit $rc $(cat "$tmp/err")"
touch "$tmp/regular"
"$WLB" plan "$SRC/inputs/quickstart.toml" --steps 1 --packer wlb --out "$tmp/p2.jsonl" --save-state "$tmp/regular/s.json" \
  > "$tmp/out" 2> "$tmp/err"; rc=$?
[ "$rc" = 2 ] && grep -q -- "--save-state" "$tmp/err" && [ ! -e "$tmp/p2.jsonl" ] ||
  fail "plan --save-state under a file: exit $rc, plan written: $(ls "$tmp/p2.jsonl" 2>&1) $(cat "$tmp/err")"

# an output path under a file: exit 2 naming the path, not an internal error
touch "$tmp/afile"
"$WLB" simulate "$SRC/inputs/sim_small.toml" --steps 1 --out "$tmp/afile/sub" > "$tmp/out" 2> "$tmp/err"; rc=$?
[ "$rc" = 2 ] && grep -q "afile/sub" "$tmp/err" && ! grep -q "internal error" "$tmp/err" \
  || fail "simulate --out under a file: exit $rc $(cat "$tmp/err")"

# bad input found before any output: exit 2 naming what is wrong, nothing left behind
bad2() {  # label, grep pattern, command...
  local label=$1 pat=$2; shift 2
  "$@" > "$tmp/out" 2> "$tmp/err"; local rc=$?
  [ "$rc" = 2 ] && grep -q -- "$pat" "$tmp/err" && ! grep -q "internal error" "$tmp/err" ||
    fail "$label: exit $rc $(cat "$tmp/err")"
}
sed 's/"tile_q": [0-9]*/"tile_q": 0.5/' "$SRC/inputs/profiles/epyc-avx2-1core.json" > "$tmp/tile.json"
grep -q '"tile_q": 0.5' "$tmp/tile.json" || fail "profile fixture: no tile_q to change"
bad2 "profile tile_q 0.5" "tile_q" "$WLB" simulate "$SRC/inputs/sim_small.toml" --steps 1 --set "hardware.profile=\"$tmp/tile.json\""
mkdir -p "$tmp/adir"
bad2 "profile is a directory" "is a directory" "$WLB" plan "$SRC/inputs/quickstart.toml" --steps 1 --set "hardware.profile=\"$tmp/adir\""
bad2 "plan --resume a directory" "is a directory" "$WLB" plan "$SRC/inputs/quickstart.toml" --steps 1 --resume "$tmp/adir"
bad2 "tune --json a directory" "--json" "$WLB" tune "$SRC/inputs/quickstart.toml" --sample-steps 1 --max-levels 1 --json "$tmp/adir"
ls "$tmp"/adir* | grep -q tmp && fail "tune --json DIR left a temporary"
: > "$tmp/empty.list"
bad2 "simulate an empty deck list" "no decks" "$WLB" simulate "$tmp/empty.list"
printf '# decks\n%s\n\nmissing.toml\n' "$SRC/inputs/sim_small.toml" > "$tmp/missing.list"
bad2 "simulate a list naming a missing deck" "missing.list:4: deck 'missing.toml' does not exist" \
  "$WLB" simulate "$tmp/missing.list"
bad2 "data stats --window -5" "--window" "$WLB" data stats --window -5
bad2 "a command of one case on a sweeping deck" "sweep" "$WLB" plan "$SRC/inputs/slurm_sweep.toml" --steps 1
"$WLB" plan "$SRC/inputs/slurm_sweep.toml" --steps 1 --set mesh.cp=2 > "$tmp/out" 2> "$tmp/err" ||
  fail "a --set of the swept key does not pick a case: $(cat "$tmp/err")"
bad2 "simulate --trace a directory" "--trace" "$WLB" simulate "$SRC/inputs/sim_small.toml" --steps 1 --trace "$tmp/adir"
bad2 "plan --out naming a folder" "names a folder" "$WLB" plan "$SRC/inputs/quickstart.toml" --steps 1 --out "$tmp/newdir/"
[ -e "$tmp/newdir" ] && fail "plan --out DIR/ made the folder"

# an empty value (an unset shell variable) and options that exclude each other: exit 2
bad2 "plan --out ''" "--out: an empty value" "$WLB" plan "$SRC/inputs/quickstart.toml" --steps 1 --out ''
bad2 "run --set ''" "--set: an empty value" "$WLB" run "$SRC/inputs/quickstart.toml" --set ''
bad2 "kernel --reference --portable" "excludes" "$WLB" kernel --in x.h5 --out y.h5 --reference --portable
bad2 "data stats --preset --all-presets" "excludes" "$WLB" data stats --preset pile --all-presets

# unknown subcommand: exit 2 with a suggestion
"$WLB" plann "$SRC/inputs/quickstart.toml" > "$tmp/out" 2> "$tmp/err"; rc=$?
[ "$rc" = 2 ] || fail "plann exit $rc, wanted 2"
grep -q "unknown subcommand 'plann' (did you mean 'plan'?)" "$tmp/err" || fail "plann message: $(cat "$tmp/err")"

# --help shows defaults
"$WLB" profile --help | grep -q -- "--tile-q INT=64" || fail "profile --help shows no defaults"

# Mesh needs 2 ranks; launch 3: exit 2, exactly one error line.
mpiexec -n 3 "$WLB" mesh "$SRC/inputs/quickstart.toml" > "$tmp/out" 2> "$tmp/err"; rc=$?
[ "$rc" = 2 ] || fail "mesh mismatch exit $rc, wanted 2"
n=$(grep -c "wlb: error: mesh" "$tmp/err")
[ "$n" = 1 ] || fail "mesh mismatch printed $n error lines: $(cat "$tmp/err")"

mpiexec -n 2 "$WLB" mesh "$SRC/inputs/quickstart.toml" > "$tmp/out" || fail "2-rank mesh failed"
grep -q "tp=1 cp=2 pp=1 dp=1" "$tmp/out" || fail "mesh output: $(cat "$tmp/out")"
# A deck larger than the rank's memory: exit 2 with "out of memory", the buffer that did not
# fit and what to change, and no output folder (a 3 GB address-space limit stands in for a
# small machine; one OpenBLAS thread, whose per-thread buffers are reserved at start-up). The weights (a 16M-token vocabulary) fail when the model is built; a 1M-token
# window fails in the activation pool, which says what it held.
printf '[model]\nhidden = 1024\nheads = 8\nlayers = 2\nvocab = 16000000\n[run]\nsteps = 1\n' > "$tmp/big_vocab.toml"
printf '[model]\nhidden = 1024\nheads = 8\nlayers = 2\nvocab = 256\n[data]\ncontext_window = 1048576\n[run]\nsteps = 1\nwarmup = 0\n' \
  > "$tmp/big_window.toml"
mkdir "$tmp/corpus"
cp -L /usr/share/common-licenses/GPL-3 "$tmp/corpus/"
"$WLB" data prepare "$tmp/corpus" --out "$tmp/data/lic" --max-bytes 4096 > /dev/null || fail "data prepare"
for deck in big_vocab big_window; do
  subs="run train"
  [ $deck = big_vocab ] || subs=run  # wlb train builds the same weights first
  for sub in $subs; do
    (ulimit -v 3000000; OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 "$WLB" $sub "$tmp/$deck.toml" \
      --set "output.dir=\"$tmp/oom_$sub\"" --set "train.dataset=\"$tmp/data/lic\"" > "$tmp/out" 2> "$tmp/err"); rc=$?
    [ "$rc" = 2 ] || fail "$sub $deck exit $rc, wanted 2: $(cat "$tmp/err")"
    grep -q "out of memory: .*wlb::runtime::" "$tmp/err" || fail "$sub $deck message: $(cat "$tmp/err")"
    grep -q 'pipeline.recompute = "selective"' "$tmp/err" || fail "$sub $deck gives no hint: $(cat "$tmp/err")"
    ! grep -q "Traceback" "$tmp/err" || fail "$sub $deck message has Kokkos' traceback note"
    [ ! -e "$tmp/oom_$sub" ] || fail "$sub $deck left $(ls -R "$tmp/oom_$sub")"
  done
  grep -q "held by the activation pool" "$tmp/err" || [ $deck = big_vocab ] || fail "$deck: $(cat "$tmp/err")"
done

echo "driver CLI tests passed"

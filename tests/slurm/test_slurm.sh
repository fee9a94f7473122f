#!/usr/bin/env bash
# End-to-end test of the Slurm batch path (docs/slurm.md) on a private one-node cluster.
#
#   bash tests/slurm/test_slurm.sh [WLB [SOURCE_DIR]]     (defaults: build/bin/wlb, .)
#
# Installs nothing: run `WLB_WITH_SLURM=1 run/deps` first. Starts its own cluster with
# run/slurm/local-cluster (state in a temp dir), then
#   1. sbatch --wait run/slurm/wlb.sbatch inputs/quickstart.toml mesh  -> 2-rank mesh printed
#   2. run/slurm/sweep inputs/slurm_sweep.toml --subcommand mesh --wait -> both cases COMPLETED
#   3. the same deck's 2 cases under `wlb run` (plain and wlb, small window) with --wait ->
#      sweep.csv has a row per case x strategy with the swept value and numeric metrics,
#      sweep.png is written, `run/slurm/sweep collect` afterwards gives the same table, a case
#      without results is listed (exit 1), bad collect input exits 2
#   4. a 2-rank `wlb train` job stopped by SIGUSR1 (scancel --signal) exits 0 with its
#      checkpoint, and a second job resumes from it
#   5. input errors of the launchers (exit 2, no job submitted)
# and stops the cluster on every exit path. Every Slurm call is under a timeout.
# WLB_TEST_KEEP=1 keeps the temp dir (cluster logs, job outputs) for debugging.
set -euo pipefail

WLB=${1:-${WLB:-build/bin/wlb}}
SRC=${2:-.}
cd "$SRC"
[[ -x $WLB ]] || { echo "test_slurm: wlb binary '$WLB' not found" >&2; exit 1; }
WLB=$(cd "$(dirname "$WLB")" && pwd)/$(basename "$WLB")
export WLB
for b in sbatch srun squeue scontrol slurmctld slurmd munged; do
  command -v "$b" >/dev/null 2>&1 || [[ -x /usr/sbin/$b ]] ||
    { echo "test_slurm: '$b' missing: run WLB_WITH_SLURM=1 run/deps" >&2; exit 1; }
done

# A job environment we might be running inside must not leak into our submissions.
while IFS='=' read -r name _; do
  case $name in SLURM_* | SBATCH_* | SALLOC_* | SRUN_*) unset "$name" ;; esac
done < <(env)

t_start=$SECONDS
work=$(mktemp -d "${TMPDIR:-/tmp}/wlb-test-slurm.XXXXXX")
state=$work/cluster
failures=0
cleanup() {
  local rc=$?
  set +e
  if [[ -f $state/slurm.conf ]]; then
    WLB_SLURM_KEEP_STATE=1 timeout 60 run/slurm/local-cluster stop "$state" 2>/dev/null
  fi
  if ((rc != 0)); then
    echo "test_slurm: FAILED (exit $rc); cluster logs:" >&2
    tail -n 15 "$state"/log/*.log >&2 2>/dev/null
  fi
  if [[ ${WLB_TEST_KEEP:-0} == 1 ]]; then echo "test_slurm: kept $work" >&2; else rm -rf "$work"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

fail() { echo "test_slurm: FAIL: $*" >&2; failures=$((failures + 1)); }
pass() { echo "test_slurm: ok: $*"; }

# --- the cluster ------------------------------------------------------------------------
env_lines=$(WLB_SLURM_UP_TIMEOUT=60 timeout 90 run/slurm/local-cluster start "$state")
eval "$env_lines"
[[ -n ${SLURM_CONF:-} && -f $SLURM_CONF ]] || { echo "test_slurm: no SLURM_CONF from local-cluster" >&2; exit 1; }
pass "local cluster up ($(timeout 10 sinfo -h -o '%D node(s) %c CPUs %t'))"

# --- 1. one job through the template ------------------------------------------------------
one=$work/one
mkdir -p "$one"
rc=0
timeout 120 sbatch --wait --ntasks=2 --time=00:05:00 --output="$one/slurm-%j.out" \
  run/slurm/wlb.sbatch inputs/quickstart.toml mesh --set "output.dir=\"$one\"" >"$work/sbatch1.txt" 2>&1 || rc=$?
out1=$(cat "$one"/slurm-*.out 2>/dev/null || true)
if ((rc != 0)); then
  fail "sbatch --wait wlb.sbatch quickstart mesh exited $rc"
  cat "$work/sbatch1.txt" >&2
  echo "$out1" >&2
elif ! grep -q '^mesh tp=1 cp=2 pp=1 dp=1 (2 ranks)' <<<"$out1" ||
  ! grep -Eq '^ +0 +0 +0 +0 +0 \|' <<<"$out1" || ! grep -Eq '^ +1 +0 +1 +0 +0 \|' <<<"$out1"; then
  fail "job output does not show the 2-rank mesh:"
  echo "$out1" >&2
else
  pass "sbatch wlb.sbatch: 2-rank mesh ($(grep -o 'slurm-[0-9]*' <<<"$(ls "$one")" | head -n1))"
fi

# submit with --sbatch-arg among wlb's arguments (as docs/slurm.md shows it): the option goes
# to sbatch, not to wlb, and the job keeps the limit it asked for.
sub=$work/submit
rc=0
timeout 120 run/slurm/submit --wait inputs/quickstart.toml mesh --set "output.dir=\"$sub\"" \
  --sbatch-arg=--time=00:04:00 >"$work/submit.txt" 2>&1 || rc=$?
subid=$(sed -n 's/^Submitted batch job \([0-9]*\).*/\1/p' "$work/submit.txt" | head -n1)
limit=$(timeout 20 scontrol show job -o "${subid:-0}" 2>/dev/null | sed -n 's/.* TimeLimit=\([0-9:]*\) .*/\1/p' || true)
if ((rc != 0)); then
  fail "submit --wait ... --sbatch-arg=--time=00:04:00 exited $rc"
  cat "$work/submit.txt" "$sub"/slurm-*.out >&2 2>/dev/null || true
elif [[ $limit != 00:04:00 ]]; then
  fail "submit: --sbatch-arg after the wlb arguments gave TimeLimit '$limit', not 00:04:00"
else
  pass "submit: --sbatch-arg among wlb's arguments reaches sbatch (TimeLimit $limit)"
fi

# --- 2. a 2-case sweep as job arrays ------------------------------------------------------
sw=$work/sweep
rc=0
# --export=NONE (some clusters' default): the tasks see none of the launcher's environment
# and must still run their own cases (the case table travels as an argument).
timeout 120 run/slurm/sweep inputs/slurm_sweep.toml --subcommand mesh --wait --timeout 100 \
  --set "output.dir=\"$sw\"" --sbatch-arg=--time=00:05:00 --sbatch-arg --export=NONE >"$work/sweep.txt" 2>&1 || rc=$?
cat "$work/sweep.txt"
if ((rc != 0)); then
  fail "run/slurm/sweep --wait exited $rc"
else
  ids=$(sed -n 's/^sweep: submitted array job \([0-9]*\):.*/\1/p' "$work/sweep.txt" | tr '\n' ' ' || true)
  # Independently of the launcher's report: ask the controller for every task's state.
  states=""
  for id in $ids; do
    states+=$(timeout 20 scontrol show job -o "$id" 2>/dev/null |
      sed -n 's/.*ArrayTaskId=\([0-9]*\) .*JobState=\([A-Z_]*\).*/\1 \2/p' || true)$'\n'
  done
  if [[ $(grep -c ' COMPLETED$' <<<"$states" || true) != 2 ]]; then
    fail "expected 2 COMPLETED array tasks (jobs $ids), got: $(tr '\n' ';' <<<"$states")"
  else
    pass "sweep: 2 array tasks COMPLETED (jobs $ids)"
  fi
  for c in 1 2; do
    o=$(cat "$sw/mesh.cp-$c"/slurm-*.out 2>/dev/null || true)
    if ! grep -q "^mesh tp=1 cp=$c pp=1 dp=1 ($c ranks)" <<<"$o"; then
      fail "case mesh.cp-$c: output does not show the cp=$c mesh:"
      echo "$o" >&2
    fi
  done
  ((failures == 0)) && pass "sweep: each case ran its own mesh with its own rank count"
fi

# --- 3. a 2-case `wlb run` sweep, collected into one table --------------------------------
# Same deck (cases mesh.cp = 1, 2), two strategies, a 2K window: each case runs in ~5 s
# (the sweep took 22 s, 60 s beside a CPU hog: the bound leaves a slower CI machine room).
rs=$work/runsweep
rc=0
timeout 330 run/slurm/sweep inputs/slurm_sweep.toml --subcommand run --wait --timeout 300 \
  --set "output.dir=\"$rs\"" --set data.context_window=2048 --set 'run.strategies=["plain","wlb"]' \
  --sbatch-arg=--time=00:05:00 >"$work/runsweep.txt" 2>&1 || rc=$?
cat "$work/runsweep.txt"
if ((rc != 0)); then
  fail "run/slurm/sweep --subcommand run --wait exited $rc"
  tail -n 20 "$rs"/slurm-*.out >&2 2>/dev/null || true
elif [[ ! -f $rs/sweep.csv ]]; then
  fail "sweep --wait wrote no $rs/sweep.csv"
else
  # Every row: case 0/1 with mesh.cp 1/2, COMPLETED, result ok, strategy plain|wlb, and numeric
  # throughput, speedup and its interval (lo <= hi; the baseline plain = 1), step time.
  check=$(/usr/bin/python3 - "$rs/sweep.csv" <<'PY'
import csv, math, sys
rows = list(csv.DictReader(open(sys.argv[1])))
errs = []
need = ["case", "mesh.cp", "state", "result", "strategy", "tokens_per_second", "useful_flops_per_second",
        "speedup", "speedup_lo", "speedup_hi", "step_seconds_mean", "mb_imbalance"]
missing = [c for c in need if rows and c not in rows[0]]
if missing:
    errs.append(f"columns missing: {missing}")
got = sorted((r.get("case"), r.get("mesh.cp"), r.get("strategy")) for r in rows)
want = sorted((str(c), str(c + 1), s) for c in (0, 1) for s in ("plain", "wlb"))
if got != want:
    errs.append(f"rows (case, mesh.cp, strategy) = {got}, want {want}")
for r in rows if not missing else []:
    tag = f"case {r['case']} {r['strategy']}"
    if r["state"] != "COMPLETED" or r["result"] != "ok":
        errs.append(f"{tag}: state {r['state']} result {r['result']}")
    try:
        v = {c: float(r[c]) for c in need[5:]}
    except ValueError:
        errs.append(f"{tag}: non-numeric metric in {[r[c] for c in need[5:]]}")
        continue
    if not all(math.isfinite(x) and x > 0 for x in v.values()):
        errs.append(f"{tag}: metrics not finite and positive: {v}")
    if v["speedup_lo"] > v["speedup_hi"]:
        errs.append(f"{tag}: interval [{v['speedup_lo']}, {v['speedup_hi']}] is empty")
    if r["strategy"] == "plain" and abs(v["speedup"] - 1) > 1e-9:
        errs.append(f"{tag}: the baseline's speedup is {v['speedup']}, not 1")
print("\n".join(errs) if errs else "ok")
PY
  ) || check="checker failed: $check"
  if [[ $check != ok ]]; then
    fail "collected table $rs/sweep.csv:"$'\n'"$check"
    cat "$rs/sweep.csv" >&2
  else
    pass "sweep --wait (wlb run): sweep.csv has 2 cases x 2 strategies with mesh.cp and numeric metrics"
  fi
  if /usr/bin/python3 -c 'import matplotlib' 2>/dev/null; then
    if [[ $(head -c 8 "$rs/sweep.png" 2>/dev/null | od -An -tx1 | tr -d ' \n') == 89504e470d0a1a0a ]]; then
      pass "sweep --wait (wlb run): sweep.png written"
    else
      fail "no PNG at $rs/sweep.png"
    fi
  fi
  # After the fact: the same table again.
  cp "$rs/sweep.csv" "$work/sweep-wait.csv"
  rc=0
  timeout 60 run/slurm/sweep collect "$rs" >"$work/collect.txt" 2>&1 || rc=$?
  if ((rc != 0)); then
    fail "sweep collect exited $rc:"$'\n'"$(cat "$work/collect.txt")"
  elif ! cmp -s "$work/sweep-wait.csv" "$rs/sweep.csv"; then
    fail "sweep collect gives a different table:"$'\n'"$(diff "$work/sweep-wait.csv" "$rs/sweep.csv")"
  else
    pass "sweep collect DIR afterwards: the same table"
  fi
  # A case without results (copy of the sweep, one summary removed): listed, empty metrics, exit 1.
  cp -a "$rs" "$work/broken"  # -a: the dates that tell this submission's results from older ones
  rm -f "$work/broken/mesh.cp-2/summary.json"
  rc=0
  timeout 60 run/slurm/sweep collect "$work/broken" >"$work/collect2.txt" 2>&1 || rc=$?
  row=$(grep '^1,2,' "$work/broken/sweep.csv" || true)
  if ((rc != 1)) || ! grep -q 'no results: case 1 (mesh.cp=2)' "$work/collect2.txt" ||
    [[ $(wc -l <<<"$row") != 1 || $row != *",missing,,,"* ]]; then
    fail "collect with a missing case: exit $rc (want 1), row '$row':"$'\n'"$(cat "$work/collect2.txt")"
  else
    pass "sweep collect: a case without results -> its row with empty metrics, named, exit 1"
  fi
  # Results older than the submission (an earlier sweep into the same folders) are not its.
  touch -d '2001-01-01' "$work/broken/mesh.cp-1/summary.json"
  rc=0
  timeout 60 run/slurm/sweep collect "$work/broken" >"$work/collect3.txt" 2>&1 || rc=$?
  if ((rc != 1)) || ! grep -q 'no results: case 0 (mesh.cp=1).*summary.json stale' "$work/collect3.txt"; then
    fail "collect with an older result file: exit $rc (want 1):"$'\n'"$(cat "$work/collect3.txt")"
  else
    pass "sweep collect: a result file from before the submission -> stale, exit 1"
  fi
fi
rc=0
timeout 30 run/slurm/sweep collect "$work/no_such_dir" >/dev/null 2>&1 || rc=$?
((rc == 2)) && pass "sweep collect: no such directory -> exit 2" || fail "sweep collect: no such dir exited $rc, not 2"
rc=0
timeout 30 run/slurm/sweep collect "$one" >/dev/null 2>&1 || rc=$?
((rc == 2)) && pass "sweep collect: not a sweep directory -> exit 2" || fail "sweep collect: not a sweep dir exited $rc, not 2"

# --- 4. a 2-rank `wlb train` job stopped by SIGUSR1 (what --signal=USR1@T sends before a --
#        time limit) ends with a checkpoint and exit 0; a second job resumes from it.
tr=$work/train
mkdir -p "$tr"
"$WLB" data prepare /usr/share/common-licenses --out "$tr/lic" --valid-fraction 0.25 --max-bytes 4096 >/dev/null
tsets=(--set "train.dataset=\"$tr/lic\"" --set "output.dir=\"$tr/out\"" --set mesh.dp=2
  --set packing.micro_batches=4 --set train.steps=100000 --set train.checkpoint_interval=100000 --quiet)
rc=0
timeout 60 run/slurm/submit inputs/train_mesh_bench.toml train "${tsets[@]}" --sbatch-arg=--time=00:05:00 \
  >"$work/train_submit.txt" 2>&1 || rc=$?
tid=$(sed -n 's/^Submitted batch job \([0-9]*\).*/\1/p' "$work/train_submit.txt" | head -n1)
for _ in $(seq 180); do
  [[ -f $tr/out/train_log.jsonl ]] && (($(wc -l <"$tr/out/train_log.jsonl") >= 2)) && break
  sleep 0.5
done
timeout 20 scancel --signal=USR1 "${tid:-0}" >/dev/null 2>&1 || true
for _ in $(seq 120); do
  [[ -z $(timeout 10 squeue -h -j "${tid:-0}" -o %i 2>/dev/null) ]] && break
  sleep 0.5
done
code=$(timeout 20 scontrol show job -o "${tid:-0}" 2>/dev/null | sed -n 's/.* ExitCode=\([0-9:]*\) .*/\1/p' || true)
tout=$(cat "$tr/out"/slurm-*.out 2>/dev/null || true)
k=$(sed -n 's/^stopped          after step \([0-9]*\) of 100000 (SIGUSR1).*/\1/p' <<<"$tout")
if ((rc != 0)) || [[ $code != 0:0 || -z $k || ! -f $tr/out/checkpoint/checkpoint.wlb ]]; then
  fail "train job stopped by SIGUSR1: submit rc $rc, ExitCode '$code', stopped after '$k'"
  cat "$work/train_submit.txt" >&2
  echo "$tout" >&2
else
  rc=0
  timeout 120 run/slurm/submit --wait inputs/train_mesh_bench.toml train "${tsets[@]}" --resume \
    --exit-after $((k + 1)) --sbatch-arg=--time=00:05:00 >"$work/train_resume.txt" 2>&1 || rc=$?
  if ((rc == 0)) && grep -q "^steps            $k .. $((k + 1))" "$tr/out"/slurm-*.out; then
    pass "train: SIGUSR1 stopped the 2-rank job after step $k (exit 0, checkpoint); the next job resumed"
  else
    fail "train resume job after SIGUSR1 exited $rc"
    cat "$work/train_resume.txt" "$tr/out"/slurm-*.out >&2 2>/dev/null || true
  fi
fi

# --- 5. input errors: exit 2 before anything is submitted ---------------------------------
rc=0
timeout 30 run/slurm/sweep inputs/slurm_sweep.toml --subcommand no_such_cmd --dry-run >/dev/null 2>&1 || rc=$?
((rc == 2)) && pass "sweep: unknown subcommand -> exit 2" || fail "sweep: unknown subcommand exited $rc, not 2"
rc=0
timeout 30 run/slurm/sweep inputs/slurm_sweep.toml --set mesh.no_such_key=1 --dry-run >/dev/null 2>&1 || rc=$?
((rc == 2)) && pass "sweep: bad --set -> exit 2" || fail "sweep: bad --set exited $rc, not 2"
rc=0
timeout 30 run/slurm/submit inputs/quickstart.toml mesh --set mesh.no_such_key=1 >/dev/null 2>&1 || rc=$?
((rc == 2)) && pass "submit: bad --set -> exit 2" || fail "submit: bad --set exited $rc, not 2"
rc=0
timeout 30 run/slurm/submit inputs/slurm_sweep.toml mesh >/dev/null 2>&1 || rc=$?
((rc == 2)) && pass "submit: a sweeping deck -> exit 2" || fail "submit: a sweeping deck exited $rc, not 2"
rc=0
timeout 30 run/slurm/submit inputs/quickstart.toml no_such_cmd >"$work/e.txt" 2>&1 || rc=$?
((rc == 2)) && grep -q "'no_such_cmd' is not a subcommand" "$work/e.txt" && pass "submit: unknown subcommand -> exit 2" ||
  fail "submit: unknown subcommand exited $rc: $(cat "$work/e.txt")"
rc=0
timeout 30 run/slurm/submit inputs/quickstart.toml mesh --set 'output.dir="/proc/wlb_no"' >"$work/e.txt" 2>&1 || rc=$?
((rc == 2)) && grep -q "output.dir '/proc/wlb_no'" "$work/e.txt" && pass "submit: output.dir not creatable -> exit 2" ||
  fail "submit: output.dir not creatable exited $rc: $(cat "$work/e.txt")"
rc=0
timeout 30 run/slurm/sweep inputs/slurm_sweep.toml --subcommand mesh --set 'output.dir="/proc/wlb_no"' >"$work/e.txt" 2>&1 || rc=$?
((rc == 2)) && grep -q "output.dir '/proc/wlb_no'" "$work/e.txt" && pass "sweep: output.dir not creatable -> exit 2" ||
  fail "sweep: output.dir not creatable exited $rc: $(cat "$work/e.txt")"
# sbatch refusing the array: nothing left of the submission (no manifest that collect would
# take for the newest sweep, no case folders)
rc=0
timeout 60 run/slurm/sweep inputs/slurm_sweep.toml --subcommand mesh --set "output.dir=\"$work/swrefused\"" \
  --sbatch-arg=--partition=no_such_partition >"$work/e.txt" 2>&1 || rc=$?
((rc == 1)) && [[ ! -e $work/swrefused ]] && pass "sweep: sbatch refused -> exit 1, nothing left" ||
  fail "sweep: sbatch refused: exit $rc, left $(find "$work/swrefused" 2>/dev/null | tr '\n' ' '): $(cat "$work/e.txt")"
# sbatch refusing the job (here: no such partition): its exit status, and the output
# folders submit made for the job's log are removed again.
rc=0
timeout 60 run/slurm/submit inputs/quickstart.toml mesh --sbatch-arg=--partition=no_such_partition \
  --set "output.dir=\"$work/refused/a/b\"" >"$work/r.txt" 2>&1 || rc=$?
((rc != 0)) && [[ ! -e $work/refused ]] && pass "submit: sbatch refused -> exit $rc, no folder left" ||
  fail "submit: sbatch refused: exit $rc, $(find "$work/refused" 2>/dev/null | tr '\n' ' ')"
# An array task without its case table would run the base deck into its siblings' folder.
rc=0
SLURM_ARRAY_TASK_ID=0 SLURM_ARRAY_JOB_ID=1 timeout 30 run/slurm/wlb.sbatch inputs/quickstart.toml mesh >"$work/e.txt" 2>&1 || rc=$?
((rc == 2)) && grep -q "no case file" "$work/e.txt" && pass "wlb.sbatch: array task without a case file -> exit 2" ||
  fail "wlb.sbatch: array task without a case file exited $rc: $(cat "$work/e.txt")"
# Values wlb spells its own way (1e-04, 100000.0) and the space form of --sbatch-arg.
printf '[output]\ndir = "%s"\n[sweep]\n"data.length_scale" = [0.5, 1e-4, 1e5]\n' "$work/floats" >"$work/floats.toml"
rc=0
timeout 30 run/slurm/sweep "$work/floats.toml" --subcommand plan --dry-run --sbatch-arg --time=00:05:00 >"$work/f.txt" 2>&1 || rc=$?
if ((rc == 0)) && [[ $(grep -c "^  case " "$work/f.txt") == 3 ]] && grep -q -- "--time=00:05:00" "$work/f.txt"; then
  pass "sweep: float cases named by wlb, --sbatch-arg ARG"
else
  fail "sweep of float values exited $rc: $(cat "$work/f.txt")"
fi
# A training sweep whose dataset is not there fails before queueing (each task would).
{ sed '/^\[output\]/,$d' inputs/train_convergence.toml; printf '[output]\ndir = "%s"\n[sweep]\n"train.seed" = [1, 2]\n' "$work/ts"; } >"$work/ts.toml"
rc=0
timeout 30 run/slurm/sweep "$work/ts.toml" --subcommand train --dry-run --set 'train.dataset="no/such/prefix"' >"$work/t.txt" 2>&1 || rc=$?
((rc == 2)) && grep -q "train.dataset" "$work/t.txt" && pass "sweep: train with a missing dataset -> exit 2" ||
  fail "sweep: train with a missing dataset exited $rc: $(cat "$work/t.txt")"
left=$(timeout 10 squeue -h -o %i | wc -l)
((left == 0)) || fail "$left job(s) left in the queue"

if ((failures > 0)); then
  echo "test_slurm: $failures failure(s) after $((SECONDS - t_start)) s" >&2
  exit 1
fi
echo "test_slurm: all passed in $((SECONDS - t_start)) s"

#!/usr/bin/env bash
# End-to-end test of the Slurm batch path (docs/slurm.md) on a private one-node cluster.
#
#   bash tests/slurm/test_slurm.sh [WLB [SOURCE_DIR]]     (defaults: build/bin/wlb, .)
#
# Installs nothing: run `WLB_WITH_SLURM=1 run/deps` first. Starts its own cluster with
# run/slurm/local-cluster (state in a temp dir), then
#   1. sbatch --wait run/slurm/wlb.sbatch inputs/quickstart.toml mesh  -> 2-rank mesh printed
#   2. run/slurm/sweep inputs/slurm_sweep.toml --subcommand mesh --wait -> both cases COMPLETED
#   3. input errors of the launchers (exit 2, no job submitted)
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

# --- 2. a 2-case sweep as job arrays ------------------------------------------------------
sw=$work/sweep
rc=0
timeout 120 run/slurm/sweep inputs/slurm_sweep.toml --subcommand mesh --wait --timeout 100 \
  --set "output.dir=\"$sw\"" --sbatch-arg=--time=00:05:00 >"$work/sweep.txt" 2>&1 || rc=$?
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

# --- 3. input errors: exit 2 before anything is submitted ---------------------------------
rc=0
timeout 30 run/slurm/sweep inputs/slurm_sweep.toml --subcommand no_such_cmd --dry-run >/dev/null 2>&1 || rc=$?
((rc == 2)) && pass "sweep: unknown subcommand -> exit 2" || fail "sweep: unknown subcommand exited $rc, not 2"
rc=0
timeout 30 run/slurm/sweep inputs/slurm_sweep.toml --set mesh.no_such_key=1 --dry-run >/dev/null 2>&1 || rc=$?
((rc == 2)) && pass "sweep: bad --set -> exit 2" || fail "sweep: bad --set exited $rc, not 2"
rc=0
timeout 30 run/slurm/submit inputs/quickstart.toml mesh --set mesh.no_such_key=1 >/dev/null 2>&1 || rc=$?
((rc == 2)) && pass "submit: bad --set -> exit 2" || fail "submit: bad --set exited $rc, not 2"
left=$(timeout 10 squeue -h -o %i | wc -l)
((left == 0)) || fail "$left job(s) left in the queue"

if ((failures > 0)); then
  echo "test_slurm: $failures failure(s) after $((SECONDS - t_start)) s" >&2
  exit 1
fi
echo "test_slurm: all passed in $((SECONDS - t_start)) s"

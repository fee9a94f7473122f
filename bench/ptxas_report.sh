#!/usr/bin/env bash
# The compiler's resource report of the sm_90a attention kernels, without a GPU: per kernel
# its registers at launch, stack frame and spills, and every ptxas performance warning
# (C75xx: a serialised wgmma pipeline, say). Spills and serialised wgmma are what halved the
# warp-specialised backward on the H100 (docs/attention.md), and nothing else shows them
# before a device does.
#
#   bench/ptxas_report.sh [--check] [NVCC]
#
# Prints the report (a raw log of bench/results/cuda_build/ when run through
# bench/record.py). With --check it exits 1 when a ptxas performance warning appears or a
# BF16 kernel spills (the TF32 forward at D = 128, 255 registers at a 256-thread launch,
# spills a few bytes and is reported, not refused), which the test `ptxas_hopper` asserts
# wherever nvcc is installed.
set -euo pipefail
check=0
if [[ "${1:-}" == "--check" ]]; then
  check=1
  shift
fi
nvcc=${1:-nvcc}
root=$(cd "$(dirname "$0")/.." && pwd)
command -v "$nvcc" > /dev/null || {
  echo "ptxas_report: no nvcc ($nvcc)" >&2
  exit 2
}

echo "# ptxas resource report of the Hopper attention kernels (no GPU needed)"
echo "# $("$nvcc" --version | grep -i release)"
echo "# command: $nvcc -I src -x cu -O3 -DNDEBUG -arch=sm_90a -std=c++17 -Xptxas -v -c src/attention/FILE"
bad=0
for f in cuda_hopper.cu cuda_hopper_ws.cu; do
  echo "## $f"
  log=$("$nvcc" -I "$root/src" -x cu -O3 -DNDEBUG -arch=sm_90a -std=c++17 -Xptxas -v \
    -c "$root/src/attention/$f" -o /dev/null 2>&1) || {
    echo "$log" >&2
    echo "ptxas_report: $f does not compile" >&2
    exit 2
  }
  # one line per kernel: name, registers, stack and spills; then the warnings
  report=$(awk '
    /Compiling entry function/ { match($0, /_Z[A-Za-z0-9_]+/); name = substr($0, RSTART, RLENGTH) }
    /bytes stack frame/ { frame = $0; sub(/^ +/, "", frame) }
    /Used [0-9]+ registers/ { match($0, /Used [0-9]+ registers/); regs = substr($0, RSTART + 5, RLENGTH - 15)
                              printf "%s: %s registers, %s\n", name, regs, frame }
    /\(C75[0-9][0-9]\)/ { w = $0; sub(/^ptxas info +: /, "", w); print "WARNING " w }
  ' <<< "$log")
  echo "$report"
  if grep -q "^WARNING" <<< "$report"; then bad=1; fi
  # the TF32 kernels are the instantiations with BF = false (ILb0)
  if grep -v "KernelILb0" <<< "$report" | grep -q " [1-9][0-9]* bytes spill"; then bad=1; fi
done
if ((check && bad)); then
  echo "ptxas_report: a BF16 kernel spills or ptxas warns of lost performance (above)" >&2
  exit 1
fi
echo "# BF16 spills or performance warnings: $([[ $bad == 1 ]] && echo yes || echo none)"

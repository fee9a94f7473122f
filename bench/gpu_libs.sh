# Sourced by bench/gpu_end_to_end.sh and bench/gpu_parts.sh: the parts of
# gpu_end_to_end.sh, and the shared libraries a CUDA build carries to a GPU machine that
# may lack them.

# The parts gpu_end_to_end.sh knows ("none": its preamble only, the CPU test of
# gpu_parts.sh). A name outside the list exits 2: a typo must not read as a part that ran.
GPU_PARTS="tests check run profile run8b run8bws gemm8b torch8b profile8b train8b trainsmall attnws attn attnanchors attngrid none"
# require_gpu_parts SCRIPT NAME...: exit 2 naming the first unknown part.
require_gpu_parts() {
  local who=$1 p
  shift
  for p in "$@"; do
    if [[ " $GPU_PARTS " != *" $p "* ]]; then
      echo "$who: unknown part '$p' (parts: $GPU_PARTS)" >&2
      exit 2
    fi
  done
}
# use_carried_libs BIN: unpacks BIN/libs.tar.xz into a temporary directory, drops the ones
# the system already has (ldconfig), and puts the rest first on LD_LIBRARY_PATH. Once per
# process tree: WLB_CARRIED_LIBS names the directory, and a call that finds it set (a part
# started by gpu_parts.sh) does nothing.
use_carried_libs() {
  [ -n "${WLB_CARRIED_LIBS:-}" ] && return 0
  [ -f "$1/libs.tar.xz" ] || return 0
  local lib f n
  lib=$(mktemp -d)
  tar -C "$lib" -xJf "$1/libs.tar.xz"
  for f in "$lib"/*; do
    n=$(basename "$f")
    if ldconfig -p | grep -q " $n "; then rm -f "$f"; fi
  done
  export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export WLB_CARRIED_LIBS=$lib
}

#!/usr/bin/env bash
# wlb on one GPU end to end (docs/performance.md § wlb run on the H100): the CUDA build's
# tests, CPU-vs-GPU and 1-vs-2-rank agreement of losses and gradients, NCCL on one rank,
# measured step times of inputs/run_gpu.toml, and the profiles of the project's own
# kernels. Run from the repository root on the GPU machine:
#   bench/gpu_end_to_end.sh BIN REF OUT [part...]
# BIN: the CUDA build's binaries (wlb, test_attention, test_runtime) and, optionally,
#      libs.tar.xz of shared libraries the machine may lack (only the missing ones are used);
# REF: `wlb run --gradients` output of the CPU build for the reference deck below;
# OUT: where logs, gradients, traces and profiles go.
# parts: tests check run profile (default), and the Llama-3-8B-layer measurements of
# docs/performance.md § Llama-3-8B layers on one GPU: run8b (wlb run inputs/run_gpu_8b.toml,
# bf16), torch8b (bench/torch_step.py on run8b's plans named by TORCH_PLANS,
# default "plain wlb"),
# profile8b (wlb profile --deck of that deck, for `wlb simulate --as-run --plans`), train8b
# (wlb train of that deck on DATA, a byte-level `wlb data prepare` prefix, with
# pipeline.recompute = TRAIN8B_RECOMPUTE, default "selective": without it the weights, AdamW
# state and activations outgrow an 80 GB H100) and trainsmall
# (a small wlb train in fp32 and bf16 whose losses are compared with the CPU build's),
# gemm8b (run8b's plain strategy with --gemm-timing and --kernel-timing: every GEMM's rate
# and every Kokkos kernel's time in place),
# run8bws (run8b's plain strategy with run.attention = "ws": the warp-specialised backward
# in the step, against run8b's plain row),
# attnws (the warp-specialised kernels' tests — on a failure or a hang, compute-sanitizer's
# synccheck and memcheck of them — and a quick timing of sync, ws and ws-r64 (ws with the
# backward's former 64-row step at D = 64), forward and backward, cases a-c), and
# attn: bench_attention_gpu (BIN must hold it) on cases a-d in BF16 on the Hopper variants
# sync, auto (warp-specialised forward), split (auto with split-KV) and ws (warp-specialised
# backward too), its precision checks included, then the PyTorch anchors of cases a-d
# (d: varlen_attn)
# (bench/attention_torch.py; docs/attention.md, "Split-KV");
# attnanchors: the PyTorch BF16 anchors of cases a-c alone (cuDNN SDPA, FlexAttention,
# varlen_attn), about two minutes: what attnws's timings are read against;
# attngrid: the CP-piece grid (case d) on the variants sync, auto, ws-split, then
# varlen_attn on the same pieces, about four minutes; none: the preamble only (a test).
# RUN_PRECISIONS: the extra precisions of `run` besides bf16 (default "fp32 tf32").
# The PyTorch peer (torch8b) runs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# unless the variable is set: with the default allocator its wlb plan ran out of memory on
# an 80 GB H100 (11 GiB reserved but unallocated).
set -uo pipefail
BIN=$1 REF=$2 OUT=$3 DATA=${DATA:-}
shift 3
parts=${*:-tests check run profile}
mkdir -p "$OUT"
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }

# Shared libraries: the system's where it has them, the carried ones otherwise.
source "$(dirname "$0")/gpu_libs.sh"
# shellcheck disable=SC2086
require_gpu_parts gpu_end_to_end.sh $parts
use_carried_libs "$BIN"
# PyTorch's parts run without the CUDA folders found below: one of them held an older cuDNN
# than PyTorch's own, and PyTorch refused it ("cuDNN version incompatibility", H100 lease of
# 2026-11-28).
TORCH_LD=${LD_LIBRARY_PATH-}
for n in libcublas.so.13 libcublasLt.so.13 libnccl.so.2 libcudart.so.13; do
  if ! ldconfig -p | grep -q " $n "; then
    # where CUDA and PyTorch's wheels put them; not all of /, which on a machine without
    # them (the CPU test of gpu_parts.sh) is a long walk over every build tree
    d=$(dirname "$(find /usr /opt -xdev -name "$n" 2>/dev/null | head -1)")
    [ -n "$d" ] && [ "$d" != . ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
done
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
ldd "$BIN/wlb" | grep "not found" && { log "missing libraries"; exit 1; }
"$BIN/wlb" --version | tee -a "$OUT/summary.txt"
MPIRUN=(mpirun --allow-run-as-root --oversubscribe -x LD_LIBRARY_PATH)

# Reference deck: tiny, every strategy, cp = 1 (one rank) and cp = 2 (two ranks).
small=(--set model.hidden=256 --set model.heads=4 --set model.kv_heads=2 --set model.ffn=704
       --set data.context_window=4096 --set data.length_scale=0.03125)

# The small training run of part trainsmall (the CPU build's reference: the same command).
train_small=(--set train.dataset="\"$DATA\"" --set train.steps=8 --set train.warmup_steps=2 --set train.log_interval=1
             --set train.eval_interval=0 --set train.eval_tokens=8192 --set model.hidden=256 --set model.heads=4
             --set model.kv_heads=2 --set model.ffn=704 --set model.vocab=256 --set model.layers=2
             --set data.context_window=4096)

if [[ " $parts " == *" tests "* ]]; then
  log "test_attention / test_runtime (CUDA build)"
  "$BIN/test_attention" > "$OUT/test_attention.log" 2>&1; echo "test_attention rc=$?" | tee -a "$OUT/summary.txt"
  tail -3 "$OUT/test_attention.log" | tee -a "$OUT/summary.txt"
  "$BIN/test_runtime" > "$OUT/test_runtime.log" 2>&1; echo "test_runtime rc=$?" | tee -a "$OUT/summary.txt"
  tail -3 "$OUT/test_runtime.log" | tee -a "$OUT/summary.txt"
  for t in mpi_test_cp_equivalence mpi_test_run; do
    [ -x "$BIN/$t" ] || continue
    for np in 1 2; do
      timeout 300 "${MPIRUN[@]}" -np $np "$BIN/$t" > "$OUT/$t.np$np.log" 2>&1
      echo "$t np$np rc=$? $(grep -E "PASSED|FAILED" "$OUT/$t.np$np.log" | head -2 | tr '\n' ' ')" | tee -a "$OUT/summary.txt"
    done
  done
fi

if [[ " $parts " == *" check "* ]]; then
  run1() {  # name, extra args...
    local name=$1
    shift
    "$BIN/wlb" run inputs/run_cp2.toml "${small[@]}" --set mesh.cp=1 --steps 2 --warmup 0 --quiet --no-output \
      --gradients "$OUT/g_$name" "$@" > "$OUT/run_$name.log" 2>&1
    echo "run $name rc=$?" | tee -a "$OUT/summary.txt"
  }
  log "GPU fp32, one rank vs the CPU build (tolerance 1e-4)"
  run1 fp32 --set run.precision='"fp32"' --set run.comm_backend='"mpi"'
  python3 bench/compare_runs.py "$REF" "$OUT/g_fp32" --tol 1e-4 | tee -a "$OUT/summary.txt"
  log "GPU fp32, two ranks cp = 2 sharing the GPU (host-staged MPI) vs one rank"
  "${MPIRUN[@]}" -np 2 "$BIN/wlb" run inputs/run_cp2.toml "${small[@]}" --steps 2 --warmup 0 --quiet --no-output \
    --set run.comm_backend='"mpi"' --gradients "$OUT/g_cp2" > "$OUT/run_cp2.log" 2>&1
  echo "run cp2 rc=$?" | tee -a "$OUT/summary.txt"
  python3 bench/compare_runs.py "$OUT/g_fp32" "$OUT/g_cp2" --tol 1e-4 | tee -a "$OUT/summary.txt"
  log "GPU fp32, NCCL communicators on one rank vs MPI"
  run1 nccl --set run.precision='"fp32"' --set run.comm_backend='"nccl"'
  python3 bench/compare_runs.py "$OUT/g_fp32" "$OUT/g_nccl" --tol 1e-6 | tee -a "$OUT/summary.txt"
  log "two ranks on one GPU with comm_backend = nccl must be refused (exit 2)"
  "${MPIRUN[@]}" -np 2 "$BIN/wlb" run inputs/run_cp2.toml "${small[@]}" --steps 1 --quiet --no-output \
    --set run.comm_backend='"nccl"' > "$OUT/run_nccl2.log" 2>&1
  echo "nccl on a shared GPU rc=$? $(grep -m1 -o "run.comm_backend.*" "$OUT/run_nccl2.log")" | tee -a "$OUT/summary.txt"
  for p in tf32 bf16; do
    log "GPU $p vs the CPU build (reported; reduced precision)"
    run1 "$p" --set run.precision="\"$p\""
    python3 bench/compare_runs.py "$REF" "$OUT/g_$p" --tol 2e-2 | tee -a "$OUT/summary.txt"
  done
fi

if [[ " $parts " == *" run "* ]]; then
  log "wlb run inputs/run_gpu.toml (bf16, every buffer on the device)"
  "$BIN/wlb" run inputs/run_gpu.toml --set output.dir="\"$OUT/run_gpu\"" > "$OUT/run_gpu.log" 2>&1
  echo "run_gpu rc=$?" | tee -a "$OUT/summary.txt"
  tail -12 "$OUT/run_gpu.log" | tee -a "$OUT/summary.txt"
  for p in ${RUN_PRECISIONS-fp32 tf32}; do
    "$BIN/wlb" run inputs/run_gpu.toml --set run.precision="\"$p\"" --steps 3 --no-output --quiet \
      > "$OUT/run_gpu_$p.log" 2>&1
    echo "run_gpu $p rc=$?" | tee -a "$OUT/summary.txt"
    tail -8 "$OUT/run_gpu_$p.log" | tee -a "$OUT/summary.txt"
  done
fi

if [[ " $parts " == *" profile "* ]]; then
  log "wlb profile (bf16, the 7b-128k per-rank shape: 4 / 4 heads, head_dim 128)"
  timeout 300 "$BIN/wlb" profile --precision bf16 --heads 4 --kv-heads 4 --head-dim 128 --tile-q 128 --tile-k 64 \
    --q-lens 16,64,256,1024,4096,16384,65536 --k-lens 16,64,256,1024,4096,16384,65536,131072 --reps 3 \
    --min-seconds 0.02 --base inputs/profiles/h100-sxm.json --name h100-wlb-7b-tp8 \
    --out "$OUT/h100-wlb-measured.json" > "$OUT/profile_grid.log" 2>&1
  echo "profile grid rc=$?" | tee -a "$OUT/summary.txt"
  tail -2 "$OUT/profile_grid.log" | tee -a "$OUT/summary.txt"
  log "wlb profile --deck inputs/run_gpu.toml (bf16; the profile of the run above)"
  timeout 240 "$BIN/wlb" profile --deck inputs/run_gpu.toml --precision bf16 --base inputs/profiles/h100-sxm.json \
    --name h100-wlb-run-gpu --out "$OUT/h100-wlb-run-gpu.json" > "$OUT/profile_deck.log" 2>&1
  echo "profile deck rc=$?" | tee -a "$OUT/summary.txt"
  tail -2 "$OUT/profile_deck.log" | tee -a "$OUT/summary.txt"
fi
deck8b=(inputs/run_gpu_8b.toml)
if [[ " $parts " == *" run8b "* ]]; then
  log "wlb run inputs/run_gpu_8b.toml (bf16; Llama-3-8B layers, 64K window)"
  timeout 300 "$BIN/wlb" run "${deck8b[@]}" --set output.dir="\"$OUT/run8b\"" > "$OUT/run8b.log" 2>&1
  echo "run8b rc=$?" | tee -a "$OUT/summary.txt"
  tail -22 "$OUT/run8b.log" | tee -a "$OUT/summary.txt"
fi
if [[ " $parts " == *" run8bws "* ]]; then
  log "wlb run inputs/run_gpu_8b.toml, plain, run.attention = ws (the warp-specialised backward too)"
  timeout 200 "$BIN/wlb" run "${deck8b[@]}" --set 'run.strategies=["plain"]' --set 'run.attention="ws"' \
    --set output.dir="\"$OUT/run8bws\"" > "$OUT/run8bws.log" 2>&1
  echo "run8bws rc=$?" | tee -a "$OUT/summary.txt"
  tail -12 "$OUT/run8bws.log" | tee -a "$OUT/summary.txt"
fi
if [[ " $parts " == *" gemm8b "* ]]; then
  log "wlb run inputs/run_gpu_8b.toml --gemm-timing --kernel-timing (bf16; each GEMM and kernel in place, plain only)"
  timeout 200 "$BIN/wlb" run "${deck8b[@]}" --set 'run.strategies=["plain"]' --steps 2 --warmup 1 --quiet \
    --gemm-timing --kernel-timing --set output.dir="\"$OUT/gemm8b\"" > "$OUT/gemm8b.log" 2>&1
  echo "gemm8b rc=$?" | tee -a "$OUT/summary.txt"
  grep -A 28 "^GEMMs timed" "$OUT/gemm8b.log" | tee -a "$OUT/summary.txt"
  grep -A 24 "^Kokkos kernels and deep copies timed" "$OUT/gemm8b.log" | tee -a "$OUT/summary.txt"
fi
if [[ " $parts " == *" torch8b "* ]]; then
  for s in ${TORCH_PLANS-plain wlb}; do
    [ -f "$OUT/run8b/plan.$s.jsonl" ] || continue
    log "PyTorch peer on run8b's $s plan (bf16, torch.compile, varlen attention, AdamW)"
    PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF-expandable_segments:True} PYTHONUNBUFFERED=1 \
      LD_LIBRARY_PATH=$TORCH_LD timeout 240 python3 bench/torch_step.py --plan "$OUT/run8b/plan.$s.jsonl" --deck inputs/run_gpu_8b.toml \
      --json "$OUT/torch8b_$s.json" > "$OUT/torch8b_$s.log" 2>&1
    echo "torch8b $s rc=$?" | tee -a "$OUT/summary.txt"
    tail -6 "$OUT/torch8b_$s.log" | tee -a "$OUT/summary.txt"
  done
fi
if [[ " $parts " == *" profile8b "* ]]; then
  log "wlb profile --deck inputs/run_gpu_8b.toml (bf16)"
  timeout 200 "$BIN/wlb" profile --deck inputs/run_gpu_8b.toml --precision bf16 \
    --reps 2 --min-seconds 0.01 --base inputs/profiles/h100-sxm.json --name gpu-wlb-run-gpu-8b \
    --out "$OUT/profile8b.json" > "$OUT/profile8b.log" 2>&1
  echo "profile8b rc=$?" | tee -a "$OUT/summary.txt"
  tail -3 "$OUT/profile8b.log" | tee -a "$OUT/summary.txt"
fi
if [[ " $parts " == *" train8b "* ]]; then
  log "wlb train inputs/run_gpu_8b.toml (bf16, AdamW, DATA, pipeline.recompute = ${TRAIN8B_RECOMPUTE-selective})"
  timeout 200 "$BIN/wlb" train inputs/run_gpu_8b.toml --set train.dataset="\"$DATA\"" --set train.steps=5 \
    --set pipeline.recompute="\"${TRAIN8B_RECOMPUTE-selective}\"" \
    --set train.warmup_steps=1 --set train.log_interval=1 --set train.eval_tokens=65536 \
    --set output.dir="\"$OUT/train8b\"" > "$OUT/train8b.log" 2>&1
  echo "train8b rc=$?" | tee -a "$OUT/summary.txt"
  tail -12 "$OUT/train8b.log" | tee -a "$OUT/summary.txt"
fi
if [[ " $parts " == *" trainsmall "* ]]; then
  for p in fp32 bf16; do
    log "wlb train, small model on DATA ($p; losses against the CPU build's)"
    timeout 120 "$BIN/wlb" train inputs/run_gpu_8b.toml "${train_small[@]}" --set run.precision="\"$p\"" \
      --set output.dir="\"$OUT/trainsmall_$p\"" > "$OUT/trainsmall_$p.log" 2>&1
    echo "trainsmall $p rc=$?" | tee -a "$OUT/summary.txt"
    tail -4 "$OUT/trainsmall_$p.log" | tee -a "$OUT/summary.txt"
  done
fi
# watched SECONDS LOG CMD...: CMD with its output in LOG, killed after SECONDS (rc 124); every
# 15 s the GPU's utilisation and the process's state go to LOG.watch, so a test that looks
# hung tells whether the GPU is busy (a kernel spinning) or idle (host work).
watched() {
  local limit=$1 logf=$2
  shift 2
  "$@" > "$logf" 2>&1 &
  local pid=$! t=0
  while kill -0 $pid 2>/dev/null; do
    sleep 1
    t=$((t + 1))
    if [ $((t % 15)) -eq 0 ]; then
      echo "t=${t}s gpu $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null);" \
        "process $(ps -o stat=,pcpu=,nlwp= -p $pid 2>/dev/null)" >> "$logf.watch"
    fi
    if [ $t -ge "$limit" ]; then
      kill -9 $pid 2>/dev/null
      wait $pid 2>/dev/null
      return 124
    fi
  done
  wait $pid
}
# The kernel tests of the warp-specialised kernels (parts attn and attnws).
ws_tests() {
  [ -x "$BIN/test_attention" ] || return 0
  log "test_attention (CUDA build): the warp-specialised kernels and the non-finite-rows contract"
  watched 300 "$OUT/test_attention_ws.log" "$BIN/test_attention" \
    --gtest_filter='Attention.WarpSpecialized*:Attention.NonFinite*:Attention.Bf16*'
  local rc=$?
  tail -3 "$OUT/test_attention_ws.log.watch" 2>/dev/null | tee -a "$OUT/summary.txt"
  echo "test_attention rc=$rc" | tee -a "$OUT/summary.txt"
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|Expected|Which is|actual|trace" "$OUT/test_attention_ws.log" | head -30 |
    tee -a "$OUT/summary.txt"
  # A failure or a hang (rc 124) of kernels never run before: in the same call, where the
  # toolkit has it, compute-sanitizer's barrier check and then its memory check of the
  # warp-specialised tests alone, their first reports in the summary.
  local cs
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [ "$rc" -ne 0 ] && [ -n "$cs" ]; then
    for tool in synccheck memcheck; do
      log "compute-sanitizer --tool $tool of Attention.WarpSpecialized* (after rc=$rc)"
      timeout 120 "$cs" --tool "$tool" --print-limit 20 "$BIN/test_attention" --gtest_filter='Attention.WarpSpecialized*' \
        > "$OUT/ws_$tool.log" 2>&1
      echo "$tool rc=$?" | tee -a "$OUT/summary.txt"
      grep -E "=========|FAILED|PASSED" "$OUT/ws_$tool.log" | head -25 | tee -a "$OUT/summary.txt"
    done
  fi
}
# attnws: the warp-specialised kernels in about three minutes — their tests, then the
# checks and BF16 timings (forward and backward) of sync and ws on cases a, b and c.
if [[ " $parts " == *" attnws "* ]]; then
  ws_tests
  log "bench_attention_gpu (bf16; paths sync, auto, ws; quick checks, then sync and ws on cases a, b, c with 3 repeats)"
  timeout 120 "$BIN/bench_attention_gpu" --check-only --quick --modes bf16 --paths sync,auto,ws,ws-split,ws-r64 \
    > "$OUT/attention_ws_check.log" 2>&1
  echo "bench_attention_gpu checks rc=$?" | tee -a "$OUT/summary.txt"
  grep -E "check" "$OUT/attention_ws_check.log" | tail -20 | tee -a "$OUT/summary.txt"
  timeout 240 "$BIN/bench_attention_gpu" --bench-only --modes bf16 --paths sync,ws,ws-r64 --cases a,b,c --repeats 3 \
    --json "$OUT/attention_ws.json" > "$OUT/attention_ws.log" 2>&1
  echo "bench_attention_gpu rc=$?" | tee -a "$OUT/summary.txt"
  grep -E "^[a-c] " "$OUT/attention_ws.log" | tail -12 | tee -a "$OUT/summary.txt"
fi
if [[ " $parts " == *" attn "* ]]; then
  ws_tests
  log "bench_attention_gpu (bf16; paths sync, auto, split, ws; cases a, b, c and the CP-piece grid d)"
  timeout 420 "$BIN/bench_attention_gpu" --modes bf16 --paths sync,auto,split,ws --cases a,b,c,d \
    --json "$OUT/attention_wlb.json" > "$OUT/attention_wlb.log" 2>&1
  echo "bench_attention_gpu rc=$?" | tee -a "$OUT/summary.txt"
  grep -E "check|^[a-d]" "$OUT/attention_wlb.log" | tail -40 | tee -a "$OUT/summary.txt"
  log "PyTorch anchors (bench/attention_torch.py, cases a, b, c; d with varlen_attn)"
  PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=$TORCH_LD timeout 300 python3 bench/attention_torch.py --cases a,b,c,d --json "$OUT/attention_torch.json" \
    > "$OUT/attention_torch.log" 2>&1
  echo "attention_torch rc=$?" | tee -a "$OUT/summary.txt"
  tail -20 "$OUT/attention_torch.log" | tee -a "$OUT/summary.txt"
fi
if [[ " $parts " == *" attnanchors "* ]]; then
  log "PyTorch BF16 anchors of cases a, b, c (bench/attention_torch.py: cuDNN SDPA, FlexAttention, varlen_attn)"
  PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=$TORCH_LD timeout 240 python3 bench/attention_torch.py --cases a,b,c \
    --kernels sdpa_bf16_cudnn,flex_bf16,varlen_bf16 --json "$OUT/attention_torch_abc.json" > "$OUT/attention_torch_abc.log" 2>&1
  echo "attention_torch a-c rc=$?" | tee -a "$OUT/summary.txt"
  tail -12 "$OUT/attention_torch_abc.log" | tee -a "$OUT/summary.txt"
fi
if [[ " $parts " == *" attngrid "* ]]; then
  log "CP-piece grid (case d): bench_attention_gpu on sync, auto, ws-split, then varlen_attn"
  timeout 300 "$BIN/bench_attention_gpu" --bench-only --modes bf16 --paths sync,auto,ws-split --cases d \
    --json "$OUT/attention_wlb_d.json" > "$OUT/attention_wlb_d.log" 2>&1
  echo "bench_attention_gpu d rc=$?" | tee -a "$OUT/summary.txt"
  grep -E "^d:" "$OUT/attention_wlb_d.log" | tee -a "$OUT/summary.txt"
  PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=$TORCH_LD timeout 120 python3 bench/attention_torch.py --cases d --kernels varlen_bf16 \
    --json "$OUT/attention_torch_d.json" > "$OUT/attention_torch_d.log" 2>&1
  echo "attention_torch d rc=$?" | tee -a "$OUT/summary.txt"
  tail -10 "$OUT/attention_torch_d.log" | tee -a "$OUT/summary.txt"
fi
log "done"

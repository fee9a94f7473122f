#!/usr/bin/env bash
# `wlb kernel` golden check: kernels (host and portable paths) and the built-in reference
# reproduce an independent numpy reference; bad inputs exit 2 naming the dataset and
# write nothing.   usage: test_kernel.sh WLB_BINARY SOURCE_DIR
set -u
WLB=$1
SRC=$2
PY=/usr/bin/python3
GOLD="$SRC/tests/data/attention_golden.py"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail=0
check() { if ! "$@"; then echo "FAIL: $*"; fail=1; fi; }

if ! $PY -c "import h5py, numpy" 2>/dev/null; then
  echo "SKIP: /usr/bin/python3 lacks h5py/numpy"
  exit 0
fi

for D in 64 128; do
  $PY "$GOLD" make "$TMP/case$D.h5" --head-dim $D --heads 4 --kv-heads 2 --seed $D || exit 1
  for mode in "" "--portable" "--reference" "--tile-q 16 --tile-k 32"; do
    rm -f "$TMP/out.h5"
    # shellcheck disable=SC2086
    check "$WLB" kernel --in "$TMP/case$D.h5" --out "$TMP/out.h5" $mode
    check $PY "$GOLD" check "$TMP/case$D.h5" "$TMP/out.h5"
  done
done

# precision modes: tf32 runs FP32 arithmetic off CUDA (same bounds); bf16 rounds the
# inputs to bf16 and stores O in bf16, so it is checked against the float reference with
# bf16-sized bounds; the attribute names the mode
for prec in tf32 bf16; do
  rm -f "$TMP/out.h5"
  check "$WLB" kernel --in "$TMP/case64.h5" --out "$TMP/out.h5" --precision $prec
  if [ $prec = bf16 ]; then tol="--tol-o 2e-2 --tol-grad 3e-2"; else tol=""; fi
  # shellcheck disable=SC2086
  check $PY "$GOLD" check "$TMP/case64.h5" "$TMP/out.h5" $tol
  check $PY -c "import h5py,sys; f=h5py.File('$TMP/out.h5'); sys.exit(0 if f.attrs['precision'] in ('$prec', b'$prec') else 1)"
done
"$WLB" kernel --in "$TMP/case64.h5" --out "$TMP/bad_prec.h5" --precision fp16 >"$TMP/bad_prec.log" 2>&1
rc=$?
if [ $rc -ne 2 ] || ! grep -q -- "--precision" "$TMP/bad_prec.log" || [ -e "$TMP/bad_prec.h5" ]; then
  echo "FAIL: --precision fp16 (exit $rc)"; cat "$TMP/bad_prec.log"; fail=1
fi
# the reference has no precision, tiles or variant: naming one with it is refused, not ignored
"$WLB" kernel --in "$TMP/case64.h5" --out "$TMP/bad_ref.h5" --reference --precision bf16 >"$TMP/bad_ref.log" 2>&1
rc=$?
if [ $rc -ne 2 ] || ! grep -q -- "--precision excludes --reference" "$TMP/bad_ref.log" || [ -e "$TMP/bad_ref.h5" ]; then
  echo "FAIL: --reference --precision bf16 (exit $rc)"; cat "$TMP/bad_ref.log"; fail=1
fi

# --attention: a Hopper kernel variant (the same kernels off an sm_90 GPU), recorded in the
# output; an unknown variant exits 2 and writes nothing
rm -f "$TMP/out.h5"
check "$WLB" kernel --in "$TMP/case64.h5" --out "$TMP/out.h5" --precision bf16 --attention ws-split
check $PY "$GOLD" check "$TMP/case64.h5" "$TMP/out.h5" --tol-o 2e-2 --tol-grad 3e-2
check $PY -c "import h5py,sys; f=h5py.File('$TMP/out.h5'); sys.exit(0 if f.attrs['attention'] in ('ws-split', b'ws-split') else 1)"
"$WLB" kernel --in "$TMP/case64.h5" --out "$TMP/bad_att.h5" --attention fa3 >"$TMP/bad_att.log" 2>&1
rc=$?
if [ $rc -ne 2 ] || ! grep -q -- "--attention" "$TMP/bad_att.log" || [ -e "$TMP/bad_att.h5" ]; then
  echo "FAIL: --attention fa3 (exit $rc)"; cat "$TMP/bad_att.log"; fail=1
fi

# forward only (no dO): only o and lse are written
$PY "$GOLD" make "$TMP/fwd.h5" --no-grad || exit 1
check "$WLB" kernel --in "$TMP/fwd.h5" --out "$TMP/fwd_out.h5"
check $PY -c "import h5py,sys; f=h5py.File('$TMP/fwd_out.h5'); sys.exit(0 if set(f.keys())=={'o','lse'} else 1)"

# bad inputs: exit 2, message names the dataset, no output file
bad() {  # name, python mutation, expected word in the message
  local name=$1 mut=$2 word=$3
  cp "$TMP/case64.h5" "$TMP/$name.h5"
  $PY -c "import h5py, numpy as np; f=h5py.File('$TMP/$name.h5','r+'); $mut" || exit 1
  rm -f "$TMP/$name.out.h5"
  "$WLB" kernel --in "$TMP/$name.h5" --out "$TMP/$name.out.h5" >"$TMP/$name.log" 2>&1
  local rc=$?
  if [ $rc -ne 2 ]; then echo "FAIL: $name exit $rc (want 2)"; cat "$TMP/$name.log"; fail=1; fi
  if ! grep -q "$word" "$TMP/$name.log"; then echo "FAIL: $name message lacks '$word'"; cat "$TMP/$name.log"; fail=1; fi
  if ls "$TMP/$name.out.h5"* >/dev/null 2>&1; then echo "FAIL: $name wrote output"; fail=1; fi
}
bad vshape "d=f['v'][:-1]; del f['v']; f['v']=d" "v"
bad cuq_end "c=f['cu_seqlens_q'][:]; c[-1]-=1; del f['cu_seqlens_q']; f['cu_seqlens_q']=c" "cu_seqlens_q"
bad cuk_dec "c=f['cu_seqlens_k'][:]; c[2]=c[1]-1; del f['cu_seqlens_k']; f['cu_seqlens_k']=c" "cu_seqlens_k"
bad nq_gt_nk "c=f['cu_seqlens_k'][:]; c[1:]+=0; q=f['cu_seqlens_q'][:]; c[2]=c[1]+ (q[2]-q[1]) - 1; c[2]=max(c[2],c[1]); del f['cu_seqlens_k']; f['cu_seqlens_k']=c" "cu_seqlens_k"
bad cu_len "c=f['cu_seqlens_k'][:-1]; del f['cu_seqlens_k']; f['cu_seqlens_k']=c" "cu_seqlens_k"
bad gqa "d=np.zeros((f['k'].shape[0],3,64),np.float32); del f['k']; f['k']=d; del f['v']; f['v']=d" "k"
bad dO_shape "d=f['dO'][:, :2]; del f['dO']; f['dO']=d" "dO"
bad missing_q "del f['q']" "q"
bad do_typo "f['do']=f['dO'][:]; del f['dO']" "did you mean 'dO'"
bad q_rank "d=f['q'][:, 0]; del f['q']; f['q']=d" "q"
bad q_nan "d=f['q'][:]; d[3,0,5]=np.nan; del f['q']; f['q']=d" "q: element"
bad v_overflow "d=f['v'][:].astype(np.float64); d[0,0,0]=1e300; del f['v']; f['v']=d" "v: element 0"
bad dO_inf "d=f['dO'][:]; d[1,1,1]=np.inf; del f['dO']; f['dO']=d" "dO: element"
bad cu_float "c=f['cu_seqlens_q'][:].astype(np.float64); c[1]+=0.5; del f['cu_seqlens_q']; f['cu_seqlens_q']=c" "floating-point"

[ $fail -eq 0 ] && echo "PASS"
exit $fail

#!/usr/bin/env python3
"""Compare two `wlb run --gradients DIR` outputs (e.g. the CPU and the GPU build, or two
meshes): per strategy the relative L2 error of the last step's weight gradients and the
relative error of every step's loss. Exit 1 when any exceeds --tol.

    python3 bench/compare_runs.py cpu-grads gpu-grads --tol 1e-4
"""
import argparse
import json
import pathlib
import sys

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reference", type=pathlib.Path, help="--gradients DIR taken as the reference")
    ap.add_argument("other", type=pathlib.Path, help="--gradients DIR compared with it")
    ap.add_argument("--tol", type=float, default=1e-4, help="largest relative error that passes (default 1e-4)")
    a = ap.parse_args()
    ref_losses = json.loads((a.reference / "losses.json").read_text())
    oth_losses = json.loads((a.other / "losses.json").read_text())
    # the same strategies on both sides: an extra one in `other` is a run the reference
    # cannot vouch for
    if set(ref_losses) != set(oth_losses):
        print(f"strategies differ: {sorted(ref_losses)} in {a.reference}, {sorted(oth_losses)} in {a.other}",
              file=sys.stderr)
        return 1
    worst = 0.0
    print(f"{'strategy':<24} {'grad rel err':>12} {'max loss rel err':>17} {'params':>10}")
    for name, steps in ref_losses.items():
        g0 = np.load(a.reference / f"{name}.npy").astype(np.float64)
        g1 = np.load(a.other / f"{name}.npy").astype(np.float64)
        if g0.shape != g1.shape:
            print(f"{name}: gradient shapes differ {g0.shape} vs {g1.shape}", file=sys.stderr)
            return 1
        for run, g in ((a.reference, g0), (a.other, g1)):
            if not np.all(np.isfinite(g)):
                print(f"{name}: non-finite gradients in {run}", file=sys.stderr)
                return 1
        # every step on both sides, matched by its number (a run that stopped early fails)
        l0 = {s["step"]: s["loss"] for s in steps}
        l1 = {s["step"]: s["loss"] for s in oth_losses[name]}
        if sorted(l0) != sorted(l1) or not l0:
            print(f"{name}: steps differ: {sorted(l0)} in {a.reference}, {sorted(l1)} in {a.other}", file=sys.stderr)
            return 1
        # a step without tokens (the drain's last) has no loss on either side: null
        both_none = {s for s in l0 if l0[s] is None and l1[s] is None}
        bad = [s for s in l0 if s not in both_none and not (
            isinstance(l0[s], (int, float)) and isinstance(l1[s], (int, float))
            and np.isfinite(l0[s]) and np.isfinite(l1[s]))]
        if bad:
            print(f"{name}: step {bad[0]}: a loss is not a finite number ({l0[bad[0]]!r}, {l1[bad[0]]!r})",
                  file=sys.stderr)
            return 1
        gerr = float(np.linalg.norm(g1 - g0) / max(np.linalg.norm(g0), 1e-300))
        lerr = max((abs(l1[s] - l0[s]) / max(abs(l0[s]), 1e-300) for s in l0 if s not in both_none), default=0.0)
        worst = max(worst, gerr, lerr)
        print(f"{name:<24} {gerr:12.3e} {lerr:17.3e} {g0.size:10d}")
    ok = worst <= a.tol
    print(f"worst {worst:.3e} (tolerance {a.tol:g}): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

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
    worst = 0.0
    print(f"{'strategy':<24} {'grad rel err':>12} {'max loss rel err':>17} {'params':>10}")
    for name, steps in ref_losses.items():
        if name not in oth_losses:
            print(f"{name}: missing in {a.other}", file=sys.stderr)
            return 1
        g0 = np.load(a.reference / f"{name}.npy").astype(np.float64)
        g1 = np.load(a.other / f"{name}.npy").astype(np.float64)
        if g0.shape != g1.shape:
            print(f"{name}: gradient shapes differ {g0.shape} vs {g1.shape}", file=sys.stderr)
            return 1
        if not np.all(np.isfinite(g1)):
            print(f"{name}: non-finite gradients in {a.other}", file=sys.stderr)
            return 1
        gerr = float(np.linalg.norm(g1 - g0) / max(np.linalg.norm(g0), 1e-300))
        lerr = 0.0
        for s0, s1 in zip(steps, oth_losses[name]):
            lerr = max(lerr, abs(s1["loss"] - s0["loss"]) / max(abs(s0["loss"]), 1e-300))
        worst = max(worst, gerr, lerr)
        print(f"{name:<24} {gerr:12.3e} {lerr:17.3e} {g0.size:10d}")
    ok = worst <= a.tol
    print(f"worst {worst:.3e} (tolerance {a.tol:g}): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

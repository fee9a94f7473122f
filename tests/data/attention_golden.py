#!/usr/bin/python3
"""Golden cases for `wlb kernel` and an independent numpy (float64) attention reference.

  attention_golden.py make CASE.h5 [--seed N] [--head-dim D] [--heads H] [--kv-heads K] [--no-grad]
  attention_golden.py check CASE.h5 RESULT.h5 [--tol-o 1e-5] [--tol-grad 1e-4]

The case holds q [Tq,H,D], k/v [Tk,Hkv,D], cu_seqlens_q/k [P+1] (int64) and dO; pieces mix
whole documents (incl. length 1, lengths not divisible by any tile) and context-parallel
pieces whose key prefix is longer than their queries (bottom-right causal mask).
"""
import argparse
import sys

import h5py
import numpy as np


def make(path, seed, D, H, Hkv, grad):
    rng = np.random.default_rng(seed)
    cu_q, cu_k = [0], [0]
    # whole documents
    for L in [1, 97, 3, 64, 130, 1, 17]:
        cu_q.append(cu_q[-1] + L)
        cu_k.append(cu_k[-1] + L)
    # CP pieces: document of 150 split in 3 query ranges, each with its key prefix
    for a, b in [(0, 40), (40, 101), (101, 150)]:
        cu_q.append(cu_q[-1] + (b - a))
        cu_k.append(cu_k[-1] + b)
    Tq, Tk = cu_q[-1], cu_k[-1]
    with h5py.File(path, "w") as f:
        f["q"] = rng.standard_normal((Tq, H, D), dtype=np.float32)
        f["k"] = rng.standard_normal((Tk, Hkv, D), dtype=np.float32)
        f["v"] = rng.standard_normal((Tk, Hkv, D), dtype=np.float32)
        f["cu_seqlens_q"] = np.array(cu_q, dtype=np.int64)
        f["cu_seqlens_k"] = np.array(cu_k, dtype=np.int64)
        if grad:
            f["dO"] = rng.standard_normal((Tq, H, D), dtype=np.float32)


def reference(f):
    q, k, v = (np.asarray(f[n], dtype=np.float64) for n in ("q", "k", "v"))
    dO = np.asarray(f["dO"], dtype=np.float64) if "dO" in f else None
    cq, ck = np.asarray(f["cu_seqlens_q"]), np.asarray(f["cu_seqlens_k"])
    H, D, Hkv = q.shape[1], q.shape[2], k.shape[1]
    scale = float(f.attrs["softmax_scale"]) if "softmax_scale" in f.attrs else 1.0 / np.sqrt(D)
    o, lse = np.zeros_like(q), np.zeros(q.shape[:2])
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for i in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[i], cq[i + 1], ck[i], ck[i + 1]
        nq, nk = q1 - q0, k1 - k0
        if nq == 0:
            continue
        mask = np.arange(nk)[None, :] <= (nk - nq + np.arange(nq))[:, None]
        for h in range(H):
            hk = h // (H // Hkv)
            Q, K, V = q[q0:q1, h], k[k0:k1, hk], v[k0:k1, hk]
            s = np.where(mask, Q @ K.T * scale, -np.inf)
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            l = p.sum(axis=1, keepdims=True)
            P = p / l
            o[q0:q1, h] = P @ V
            lse[q0:q1, h] = (m + np.log(l))[:, 0]
            if dO is not None:
                G = dO[q0:q1, h]
                dv[k0:k1, hk] += P.T @ G
                dP = G @ V.T
                dS = P * (dP - (G * o[q0:q1, h]).sum(axis=1, keepdims=True)) * scale
                dq[q0:q1, h] += dS @ K
                dk[k0:k1, hk] += dS.T @ Q
    out = {"o": o, "lse": lse}
    if dO is not None:
        out.update(dq=dq, dk=dk, dv=dv)
    return out


def check(case, result, tol_o, tol_grad):
    with h5py.File(case, "r") as f:
        ref = reference(f)
    ok = True
    with h5py.File(result, "r") as r:
        for name, want in ref.items():
            got = np.asarray(r[name], dtype=np.float64)
            if got.shape != want.shape:
                print(f"{name}: shape {got.shape} != {want.shape}")
                ok = False
                continue
            err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
            tol = tol_o if name in ("o", "lse") else tol_grad
            print(f"{name}: relative error {err:.2e} (tolerance {tol:g})")
            ok &= bool(err <= tol)
    return ok


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("path")
    m.add_argument("--seed", type=int, default=1)
    m.add_argument("--head-dim", type=int, default=64)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--kv-heads", type=int, default=2)
    m.add_argument("--no-grad", action="store_true")
    c = sub.add_parser("check")
    c.add_argument("case")
    c.add_argument("result")
    c.add_argument("--tol-o", type=float, default=1e-5)
    c.add_argument("--tol-grad", type=float, default=1e-4)
    a = ap.parse_args()
    if a.cmd == "make":
        make(a.path, a.seed, a.head_dim, a.heads, a.kv_heads, not a.no_grad)
        return 0
    return 0 if check(a.case, a.result, a.tol_o, a.tol_grad) else 1


if __name__ == "__main__":
    sys.exit(main())

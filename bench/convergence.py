#!/usr/bin/python3
"""Packing model-quality experiment (issue 15, item 4; docs/convergence.md).

Runs `wlb train inputs/train_convergence.toml` once per (packing, seed) and reports, per
packing: the final evaluation loss (mean, spread over seeds), the training loss relative to
fixed_greedy k=1, the packing imbalance and the mean per-token delay (the packer metrics of
every step, read from the HDF5 trace's /plan/packing_json), and one plot.

  /usr/bin/python3 bench/convergence.py --wlb build/bin/wlb --work DIR     # prepare + run + report
  /usr/bin/python3 bench/convergence.py --work DIR --report-only           # finished runs only
  /usr/bin/python3 bench/convergence.py --wlb build/bin/wlb --work DIR --smoke   # CI: tiny, seconds

Finished runs (a train_log.jsonl whose last step has an evaluation loss, and a trace) are
read back, not rerun. The dataset goes to DIR (never into the repository). The plot needs
matplotlib (python3-matplotlib); without it the table is still printed.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "analysis"))

# (name, label, --set overrides)
CURVES = [
    ("original", "original (sequential)", ['packing.strategy="original"']),
    ("fixed_k1", "fixed-length greedy, 1 global batch", ['packing.strategy="fixed_greedy"', "packing.window=1"]),
    ("fixed_k8", "fixed-length greedy, 8 global batches", ['packing.strategy="fixed_greedy"', "packing.window=8"]),
    ("wlb", "wlb, delay budget 1 (default)", ['packing.strategy="wlb"']),
    ("wlb_d8", "wlb, delay budget 8", ['packing.strategy="wlb"', "packing.delay_budget=8"]),
    # precision, not packing: fixed k=1 with BF16 storage (docs/training.md, "Precision")
    ("fixed_k1_bf16", "fixed-length greedy, 1 global batch, run.precision bf16",
     ['packing.strategy="fixed_greedy"', "packing.window=1", 'run.precision="bf16"']),
]
TARBALL = "/usr/src/linux-source-6.1.tar.xz"  # installed by Debian's linux-source-6.1
PREPARE = ["--valid-fraction", "0.02", "--max-file-bytes", "2048", "--shuffle", "1"]
SMOKE_SETS = ["model.hidden=32", "model.heads=2", "model.kv_heads=1", "model.ffn=64", "data.context_window=256",
              "train.steps=24", "train.lr=0.01", "train.warmup_steps=2", "train.eval_interval=12",
              "train.eval_tokens=4096", "train.log_interval=12"]


def run_sets(sets, extra, prefix, seed, d):
    """The --set overrides of one run (kept beside it: a finished run is reused only when they
    are the same, so a --smoke run is never reported as a full one)."""
    return sets + extra + [f'train.dataset="{prefix}"', f"train.seed={seed}", f'output.dir="{d}"']


def finished(d, want):
    log = os.path.join(d, "train_log.jsonl")
    if not (os.path.exists(log) and os.path.exists(os.path.join(d, "trace.h5"))):
        return False
    try:
        with open(os.path.join(d, "convergence_sets.json")) as f:
            if json.load(f) != want:
                return False
    except (OSError, ValueError):
        return False
    lines = open(log).read().split("\n")
    lines = [l for l in lines if l.strip()]
    return bool(lines) and "eval_loss" in json.loads(lines[-1])


def prepare(wlb, work, smoke):
    prefix = os.path.join(work, "lic" if smoke else "linux2k")
    if os.path.exists(prefix + "_train.idx"):
        return prefix
    if smoke:  # a small corpus that is on every Debian machine
        corpus = os.path.join(work, "corpus")
        os.makedirs(corpus, exist_ok=True)
        lic = "/usr/share/common-licenses"
        for f in sorted(os.listdir(lic)):
            if os.path.isfile(os.path.join(lic, f)):
                shutil.copy(os.path.join(lic, f), corpus)
        cmd = [wlb, "data", "prepare", corpus, "--out", prefix, "--valid-fraction", "0.25", "--max-bytes", "4096",
               "--shuffle", "1"]
    else:
        if not os.path.exists(TARBALL):
            sys.exit(f"{TARBALL} missing: apt-get install linux-source-6.1 (or pass --data PREFIX)")
        cmd = [wlb, "data", "prepare", TARBALL, "--out", prefix] + PREPARE
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return prefix


def run_all(args, prefix, seeds, extra):
    deck = os.path.join(ROOT, "inputs", "train_convergence.toml")
    for name, _, sets in CURVES:
        for seed in seeds:
            d = os.path.join(args.work, "runs", name, f"seed{seed}")
            want = run_sets(sets, extra, prefix, seed, d)
            if finished(d, want):
                continue
            if os.path.exists(os.path.join(d, "train_log.jsonl")):
                # a run of other (or unrecorded) settings: hours of work, never removed here
                sys.exit(f"{d} holds a run of other settings than these (or of an older convergence.py): "
                         "move it away or give another --work")
            cmd = ["nice", "-n", str(args.nice), args.wlb, "train", deck, "--quiet"]
            for s in want:
                cmd += ["--set", s]
            print("+", name, "seed", seed, flush=True)
            with open(os.path.join(args.work, "runs.log"), "a") as log:
                subprocess.run(cmd, check=True, stdout=log, stderr=log)
            with open(os.path.join(d, "convergence_sets.json"), "w") as f:
                json.dump(want, f)


def load_run(d):
    import wlb_trace
    log = [json.loads(l) for l in open(os.path.join(d, "train_log.jsonl")) if l.strip()]
    t = wlb_trace.load(os.path.join(d, "trace.h5"))
    imb, dsum, tsum = [], 0.0, 0.0
    for text in t.plan_steps["packing_json"]:
        m = json.loads(text).get("metrics", {})
        tok = m.get("tokens", 0)
        if tok > 0:  # steps with no tokens (a packer's warm-up) have no balance to speak of
            imb.append(m["imbalance"])
            dsum += m["delay_mean"] * tok
            tsum += tok
    steps = np.array([r["step"] for r in log])
    loss = np.array([r["loss"] if r["tokens"] > 0 else np.nan for r in log])
    ev = [(r["step"] + 1, r["eval_loss"]) for r in log if "eval_loss" in r]
    return {"steps": steps, "loss": loss, "eval": ev, "tokens": sum(r["tokens"] for r in log),
            "imbalance": float(np.mean(imb)) if imb else 1.0, "delay": dsum / tsum if tsum else 0.0}


def smooth(x, w):
    """Moving mean over the last w steps with tokens (NaN steps skipped)."""
    out = np.full_like(x, np.nan)
    for i in range(len(x)):
        v = x[max(0, i - w + 1): i + 1]
        v = v[~np.isnan(v)]
        if len(v):
            out[i] = v.mean()
    return out


def unigram_entropy(prefix):
    tok = np.fromfile(prefix + "_train.bin", np.uint16)
    p = np.bincount(tok, minlength=256).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum()), int(tok.size)


def report(args, prefix, seeds, extra):
    runs = {}
    for name, _, sets in CURVES:
        for seed in seeds:
            d = os.path.join(args.work, "runs", name, f"seed{seed}")
            if finished(d, run_sets(sets, extra, prefix, seed, d)):
                runs.setdefault(name, {})[seed] = load_run(d)
    if not runs:
        sys.exit("no finished runs under " + os.path.join(args.work, "runs"))
    ref = "fixed_k1" if "fixed_k1" in runs else next(iter(runs))
    w = args.smooth
    # the paper's measure: training loss relative to the single-batch curve, averaged over
    # steps (moving means, past the first 10% of the run), per seed (same initialisation)
    rows, out = [], {}
    for name, label, _ in CURVES:
        if name not in runs:
            continue
        rs = runs[name]
        fin = np.array([r["eval"][-1][1] for r in rs.values()])
        rel = []
        for seed, r in rs.items():
            if seed not in runs[ref]:
                continue
            a, b = smooth(r["loss"], w), smooth(runs[ref][seed]["loss"], w)
            k = max(len(a) // 10, w)
            v = (a[k:] - b[k:]) / b[k:]
            rel.append(100 * np.nanmean(v))
        tail = np.array([np.nanmean(r["loss"][-w:]) for r in rs.values()])
        row = {"curve": name, "label": label, "seeds": len(rs), "eval_mean": float(fin.mean()),
               "eval_std": float(fin.std(ddof=1)) if len(fin) > 1 else 0.0,
               "eval_min": float(fin.min()), "eval_max": float(fin.max()),
               "train_tail_mean": float(tail.mean()),
               "train_rel_pct": float(np.mean(rel)) if rel else 0.0,
               "train_rel_pct_std": float(np.std(rel, ddof=1)) if len(rel) > 1 else 0.0,
               "imbalance": float(np.mean([r["imbalance"] for r in rs.values()])),
               "delay": float(np.mean([r["delay"] for r in rs.values()])),
               "tokens": int(np.mean([r["tokens"] for r in rs.values()]))}
        rows.append(row)
        out[name] = row
    h, ntok = unigram_entropy(prefix)
    base_row = out.get("original", rows[0])
    base = base_row["eval_mean"]
    # the headings name the references the figures are relative to (others when --curves left
    # out original or fixed k=1)
    base_name = "original" if base_row["curve"] == "original" else base_row["label"]
    ref_name = "fixed k=1" if ref == "fixed_k1" else out[ref]["label"]
    print(f"\nunigram entropy of the training split: {h:.4f} nats/byte ({ntok} tokens)")
    print(f"final evaluation loss after the last step, {len(seeds)} seeds (train.seed); training loss: "
          f"moving mean over {w} steps relative to {ref}, averaged over steps past 10%\n")
    print(f"| packing | final eval loss (mean ± std) | min .. max | vs {base_name} | train loss vs {ref_name} | "
          "imbalance | mean delay (steps) | tokens trained |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['eval_mean']:.4f} ± {r['eval_std']:.4f} | {r['eval_min']:.4f} .. "
              f"{r['eval_max']:.4f} | {100 * (r['eval_mean'] / base - 1):+.2f}% | {r['train_rel_pct']:+.2f}% ± "
              f"{r['train_rel_pct_std']:.2f} | {r['imbalance']:.3f} | {r['delay']:.2f} | {r['tokens']} |")
    with open(os.path.join(args.work, "convergence.json"), "w") as f:
        json.dump({"unigram_entropy": h, "rows": rows}, f, indent=1)
    if args.check_falls:  # the smoke test: every run's loss falls
        for name, rs in runs.items():
            for seed, r in rs.items():
                l = r["loss"][~np.isnan(r["loss"])]
                assert r["eval"][-1][1] < r["eval"][0][1], (name, seed, r["eval"])
                assert l[-3:].mean() < l[:3].mean() - 0.5, (name, seed, l[:3], l[-3:])
        print("every run's training and evaluation loss fell")
    if args.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib missing (python3-matplotlib): no plot")
            return
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
        for name, label, _ in CURVES:
            if name not in runs:
                continue
            rs = list(runs[name].values())
            x = [s for s, _ in rs[0]["eval"]]
            e = np.array([[v for _, v in r["eval"]] for r in rs])
            ln, = ax[0].plot(x, e.mean(0), label=label, lw=1.2)
            ax[0].fill_between(x, e.min(0), e.max(0), color=ln.get_color(), alpha=0.2, lw=0)
            if name != ref:
                rel = np.array([100 * (smooth(r["loss"], w) / smooth(runs[ref][s]["loss"], w) - 1)
                                for s, r in runs[name].items() if s in runs[ref]])
                st = rs[0]["steps"] + 1
                ax[1].plot(st, rel.mean(0), color=ln.get_color(), lw=1.2)
                ax[1].fill_between(st, rel.min(0), rel.max(0), color=ln.get_color(), alpha=0.2, lw=0)
        ax[0].axhline(h, color="gray", ls=":", lw=1, label=f"unigram entropy {h:.2f}")
        ax[0].set_xlabel("step")
        ax[0].set_ylabel("evaluation loss (nats/byte)")
        ax[0].legend(fontsize=7)
        ax[1].axhline(0, color="gray", lw=0.8)
        ax[1].set_xlabel("step")
        ax[1].set_ylabel(f"train loss vs fixed k=1 (%, {w}-step mean)")
        lo = max(10, w)
        ax[1].set_xlim(lo, None)
        ax[1].set_ylim(-6, 10)
        fig.suptitle(f"band: min..max over seeds {','.join(map(str, seeds))}", fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=72)
        print("plot:", args.plot)


def main():
    global CURVES
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wlb", default=os.path.join(ROOT, "build", "bin", "wlb"))
    ap.add_argument("--work", required=True, help="dataset, runs and summary (outside the repository)")
    ap.add_argument("--data", help="dataset PREFIX already prepared (default: prepare into --work)")
    ap.add_argument("--seeds", default=None, help="comma-separated train.seed values (default 1,2,3; 1 with --smoke)")
    ap.add_argument("--curves", default="packings", help="'packings' (the five packings, default), 'all', or a "
                    "comma-separated subset of " + ",".join(c[0] for c in CURVES))
    ap.add_argument("--set", action="append", default=[], help="extra deck override for every run")
    ap.add_argument("--nice", type=int, default=10)
    ap.add_argument("--smooth", type=int, default=16, help="moving-mean window of the training loss (steps)")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny model, licence corpus, 1 seed: seconds")
    ap.add_argument("--plot", help="PNG to write")
    args = ap.parse_args()
    if args.curves != "all":
        keep = [c[0] for c in CURVES[:5]] if args.curves == "packings" else args.curves.split(",")
        CURVES = [c for c in CURVES if c[0] in keep]
    os.makedirs(args.work, exist_ok=True)
    args.work = os.path.abspath(args.work)
    seeds = [int(s) for s in (args.seeds or ("1" if args.smoke else "1,2,3")).split(",")]
    extra = list(args.set)
    args.check_falls = args.smoke
    if args.smoke:
        extra = SMOKE_SETS + extra
        args.smooth = min(args.smooth, 4)
    prefix = os.path.abspath(args.data) if args.data else (
        os.path.join(args.work, "lic" if args.smoke else "linux2k") if args.report_only
        else prepare(args.wlb, args.work, args.smoke))
    if not args.report_only:
        run_all(args, prefix, seeds, extra)
    report(args, prefix, seeds, extra)


if __name__ == "__main__":
    main()

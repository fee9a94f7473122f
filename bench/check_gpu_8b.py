#!/usr/bin/env python3
"""The Llama-3-8B-layer tables of docs/performance.md against their raw results: the
section "Llama-3-8B layers on one GPU" against bench/results/h200/one_model/ and "Llama-3-8B
layers on one H100" against bench/results/h100/one_model_2026-11-28/. Each: `wlb run`'s summary.json
and trace, the simulator's replay of the same plans (replay/simulate.csv), the PyTorch
peer's JSON, `wlb train`'s trace (where it ran), the in-place GEMM rate (gemm8b.log, where
measured) and the small training runs of the GPU and CPU builds. Every figure of the
tables is recomputed and compared within the table's rounding. Prints the tolerance and
each mismatch; exit 1 on any. `--print` prints the rows it expects.

    /usr/bin/python3 bench/check_gpu_8b.py [--root .] [--print]
"""
import argparse
import csv
import json
import pathlib
import re
import sys

PEAK = 989.0  # TFLOP/s, dense BF16 of the H100 / H200 SXM datasheets (the same chip)
REGIONS = ("qkv_proj", "attn", "out_proj", "mlp", "loss")
# (section heading in docs/performance.md, raw results)
SECTIONS = (("### Llama-3-8B layers on one GPU", "bench/results/h200/one_model"),
            ("### Llama-3-8B layers on one H100", "bench/results/h100/one_model_2026-11-28"))


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "analysis"))
import wlb_trace  # noqa: E402 (analysis/ is not a package)


def region_rates(trace_path, strategy):
    """Seconds per measured step and useful TFLOP/s of each region of one strategy."""
    t = wlb_trace.load(str(trace_path))
    ev = t.events
    si = t.strategies.index(strategy)
    m = (ev["strategy"] == si) & (ev["step"] >= t.warmup)
    steps = len(set(ev["step"][m].tolist()))
    out = {}
    for name in REGIONS:
        mm = m & (ev["region"] == t.regions.index(name))
        sec = float(((ev["end_ns"][mm] - ev["start_ns"][mm]) / 1e9).sum())
        out[name] = (sec / steps, float(ev["flops"][mm].sum()) / sec / 1e12)
    return out


def expected(d):
    run = {s["strategy"]: s for s in json.load(open(d / "run8b/summary.json"))["strategies"]}
    sim = {r["strategy"]: r for r in csv.DictReader(open(d / "replay/simulate.csv"))}
    rows = {}
    for s, r in run.items():
        tok = r["tokens_per_second"] / 1e3
        stok = float(sim[s]["tokens_per_second"]) / 1e3
        row = {"ktok/s": (tok, 0.005), "TFLOP/s": (r["useful_flops_per_second"] / 1e12, 0.05),
               "MFU %": (r["useful_flops_per_second"] / 1e12 / PEAK * 100, 0.05),
               "unrecorded %": (r["unrecorded_fraction"] * 100, 0.05),
               "simulated ktok/s": (stok, 0.005), "error %": ((stok / tok - 1) * 100, 0.05)}
        tj = d / f"torch8b_{s}.json"
        if tj.exists():
            ts = json.load(open(tj))["summary"]
            if ts["tokens"] != r["tokens"]:
                raise SystemExit(f"{tj}: {ts['tokens']} tokens, wlb run {r['tokens']}: not the same batches")
            row["torch ktok/s"] = (ts["tokens_per_s"]["overall"] / 1e3, 0.005)
            row["torch median ktok/s"] = (ts["tokens_per_s"]["median"] / 1e3, 0.005)
            row["ratio"] = (r["tokens_per_second"] / ts["tokens_per_s"]["overall"], 0.005)
        rows[s] = row
    reg = region_rates(d / "run8b/trace.h5", "plain")
    regions = {k: {"s/step": (v[0], 0.0005), "TFLOP/s": (v[1], 0.5)} for k, v in reg.items()}
    # wlb train: useful FLOPs of its trace over the steps' seconds (the optimizer included)
    train = {}
    if (d / "train8b/trace.h5").exists():
        tt = wlb_trace.load(str(d / "train8b/trace.h5"))
        secs = float(tt.train_steps["seconds"].sum())
        toks = float(tt.train_steps["tokens"].sum())
        flops = float(tt.events["flops"].sum())
        train = {"ktok/s": (toks / secs / 1e3, 0.05), "TFLOP/s": (flops / secs / 1e12, 0.5),
                 "MFU %": (flops / secs / 1e12 / PEAK * 100, 0.05)}
    # every GEMM of the plain steps timed in place: the "all" row of --gemm-timing
    if (d / "gemm8b.log").exists():
        m = re.search(r"^\s+all\s+([0-9.]+)\s+([0-9.]+)$", (d / "gemm8b.log").read_text(), re.M)
        train["gemm TFLOP/s"] = (float(m.group(2)), 0.05)
    # run8bws: plain with the warp-specialised backward too
    if (d / "run8bws/summary.json").exists():
        w = json.load(open(d / "run8bws/summary.json"))["strategies"][0]
        tf = w["useful_flops_per_second"] / 1e12
        train["ws ktok/s"] = (w["tokens_per_second"] / 1e3, 0.005)
        train["ws TFLOP/s"] = (tf, 0.05)
        train["ws MFU %"] = (tf / PEAK * 100, 0.05)
    for p in ("fp32", "bf16"):
        g = [json.loads(x) for x in open(d / f"trainsmall_{p}/train_log.jsonl")]
        c = [json.loads(x) for x in open(d / f"trainsmall_{p}/cpu_train_log.jsonl")]
        worst = max(abs(a["loss"] / b["loss"] - 1) for a, b in zip(g, c) if b["loss"])
        train[f"loss {p}"] = (worst, worst * 0.05)
    return rows, regions, train


def section(doc, heading):
    a = doc.index(heading + "\n")
    b = doc.find("\n### ", a + 10)
    return doc[a:b]


def num(text):
    return float(text.replace("−", "-").replace("%", "").replace("×", "").replace(",", ""))


def check_section(text, rows, regions, train, bad):
    """Compares one section's tables with the expected figures; returns how many it compared."""
    n = 0

    def check(where, got_text, want):
        nonlocal n
        n += 1
        got, tol = num(got_text), want[1]
        if abs(got - want[0]) > tol + 1e-12:
            bad.append(f"{where}: docs {got_text}, raw {want[0]:.6g} (tolerance {tol:g})")

    # | plain | 38.32 | 447.8 | 45.3% | 1.3% | 38.23 (−0.2%) | 28.20 / 36.40 | 1.36× |
    main_row = re.compile(r"^\| (plain|fixed|wlb) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+)% \| ([0-9.]+)% \| "
                          r"([0-9.]+) \(([−+0-9.]+)%\) \| (?:([0-9.]+) / ([0-9.]+)|–) \| (?:([0-9.]+)×|–) \|$", re.M)
    seen = set()
    for m in main_row.finditer(text):
        s = m.group(1)
        seen.add(s)
        r = rows[s]
        for i, k in ((2, "ktok/s"), (3, "TFLOP/s"), (4, "MFU %"), (5, "unrecorded %"), (6, "simulated ktok/s"),
                     (7, "error %")):
            check(f"{s} {k}", m.group(i), r[k])
        if m.group(8):
            check(f"{s} torch ktok/s", m.group(8), r["torch ktok/s"])
            check(f"{s} torch median", m.group(9), r["torch median ktok/s"])
            check(f"{s} wlb/torch", m.group(10), r["ratio"])
        elif "torch ktok/s" in r:
            bad.append(f"{s}: the PyTorch figures are missing from the docs")
    for s in rows:
        if s not in seen:
            bad.append(f"{s}: no row in the throughput table")
    # | `mlp` (SwiGLU: three GEMMs) | 1.423 | 640.6 |
    reg_row = re.compile(r"^\| `(\w+)`[^|]*\| ([0-9.]+) \| ([0-9.]+) \|$", re.M)
    for m in reg_row.finditer(text):
        if m.group(1) in regions:
            check(f"region {m.group(1)} s/step", m.group(2), regions[m.group(1)]["s/step"])
            check(f"region {m.group(1)} TFLOP/s", m.group(3), regions[m.group(1)]["TFLOP/s"])
            seen.add(m.group(1))
    for k in regions:
        if k not in seen:
            bad.append(f"region {k}: no row")
    # wlb train: "**wlb train** ... 35.0 ktok/s, 449.9 useful TFLOP/s (45.5% MFU)"
    m = re.search(r"([0-9.]+) ktok/s,\s+([0-9.]+)\s+useful\s+TFLOP/s\s+\(([0-9.]+)% MFU\)\s+with\s+the\s+optimizer", text)
    if "ktok/s" in train:
        if not m:
            bad.append("wlb train: figures sentence not found")
        else:
            for i, k in ((1, "ktok/s"), (2, "TFLOP/s"), (3, "MFU %")):
                check(f"train {k}", m.group(i), train[k])
    elif m:
        bad.append("wlb train: figures in the docs, no train8b trace in the raw results")
    # "every GEMM of the plain steps timed in place (...) ran at 687.8 TFLOP/s"
    if "gemm TFLOP/s" in train:
        m = re.search(r"timed\s+in\s+place.*?ran\s+at\s+([0-9.]+)\s+TFLOP/s", text, re.S)
        if not m:
            bad.append("GEMMs in place: sentence not found")
        else:
            check("GEMMs in place", m.group(1), train["gemm TFLOP/s"])
    # "(part `run8bws`: ...): 41.37 ktok/s, 483.5 useful TFLOP/s (48.9% MFU)"
    if "ws ktok/s" in train:
        m = re.search(r"part\s+`run8bws`.*?:\s+([0-9.]+)\s+ktok/s,\s+([0-9.]+)\s+useful\s+TFLOP/s\s+\(([0-9.]+)%\s+MFU\)",
                      text, re.S)
        if not m:
            bad.append("run8bws: figures sentence not found")
        else:
            for i, k in ((1, "ktok/s"), (2, "TFLOP/s"), (3, "MFU %")):
                check(f"run8bws {k}", m.group(i), train[f"ws {k}"])
    m = re.search(r"losses\s+within\s+([0-9.e−-]+)\s+\(FP32\)\s+and\s+([0-9.e−-]+)\s+\(BF16\)", text)
    if not m:
        bad.append("small training: loss sentence not found")
    else:
        for i, k in ((1, "loss fp32"), (2, "loss bf16")):
            check(f"small train {k}", m.group(i).replace("−", "-"), train[k])
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=".", help="the repository")
    ap.add_argument("--print", action="store_true", help="print the expected figures")
    a = ap.parse_args()
    root = pathlib.Path(a.root)
    doc = (root / "docs/performance.md").read_text()
    failed = False
    for heading, raw in SECTIONS:
        rows, regions, train = expected(root / raw)
        if a.print:
            print(heading)
            for s, r in rows.items():
                print(s, {k: round(v[0], 4) for k, v in r.items()})
            for k, r in regions.items():
                print(k, {n: round(v[0], 4) for n, v in r.items()})
            print("train", {k: v[0] for k, v in train.items()})
            continue
        bad = []
        n = check_section(section(doc, heading), rows, regions, train, bad)
        print(f"docs/performance.md {heading[4:]!r}: {n} figures against {raw} (tolerance: the table's last digit)")
        for b in bad:
            print("  MISMATCH", b)
        failed = failed or bool(bad)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

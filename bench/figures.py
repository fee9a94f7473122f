#!/usr/bin/env python3
"""The tables of docs/ against their committed raw logs (bench/results/).

A table in a doc is tied to its raw log by a marker on a line of its own above it:

    <!-- figures: NAME -->            NAME is a table below; its rows are rebuilt from the log
    <!-- figures: bench/check_X.py --> a table with a checker of its own (run beside this one)
    <!-- figures: none, REASON -->    a table with no measured or predicted figure in it

For every NAME table the doc's rows must equal the rows rebuilt from the raw log: the same
labels, and every number within half a unit of its last digit shown (the table's
rounding). Every raw log must name the commit and the clocks it ran at (bench/record.py
writes both). Every table of docs/ holding a digit must carry a marker (but docs/decks.md,
generated from the deck schema).

    /usr/bin/python3 bench/figures.py [--root .]          check; exit 1 on any mismatch
    /usr/bin/python3 bench/figures.py --render NAME       print NAME's table from its log
"""
import argparse
import csv
import functools
import math
import pathlib
import re
import statistics
import sys

MARK = re.compile(r"^<!-- figures: (.+?) -->\s*$")
NUM = r"([+−-]?[0-9]+(?:\.[0-9]+)?)"
COVERED = "docs/*.md"     # every doc but decks.md, which `wlb validate --reference` generates from the schema
NOT_COVERED = {"docs/decks.md"}
TABLES = {}


def table(name, doc, *logs):
    """Registers a renderer: f(root) -> rows, each a list of cells (fmt, values...)."""
    def wrap(f):
        TABLES[name] = (doc, logs, f)
        return f
    return wrap


def from_log(name, doc, log, rows):
    """Registers table NAME whose rows are rows(path of its one raw log)."""
    TABLES[name] = (doc, (log,), lambda root: rows(root / log))


def log_body(path):
    """The command's output: the log without record.py's header and trailer lines."""
    return [line for line in path.read_text().splitlines() if not line.startswith("# ")]


def provenance(path):
    """(commit, clocks) from the log's header, or for logs older than bench/record.py from
    the line naming the file in the README.md beside it."""
    text = path.read_text()
    commit = re.search(r"^# commit (\S+)", text, re.M)
    clock = re.search(r"^# clocks[^:]*: (.+)$", text, re.M)
    if (commit is None or clock is None) and (path.parent / "README.md").exists():
        line = re.search(rf"^- `{re.escape(path.name)}`: commit (\w+)[^;]*; clocks: (.+)$",
                         (path.parent / "README.md").read_text(), re.M)
        if line:
            return line.group(1), line.group(2)
    return (commit.group(1) if commit else None), (clock.group(1) if clock else None)


def columns(lines, first, n):
    """Whitespace-split rows of a printed table of n fields, from its header line starting with
    `first` to the first line of another shape."""
    out, on = [], False
    for line in lines:
        if line.split()[:1] == [first]:
            on = True
            continue
        if on:
            if len(line.split()) != n:
                break
            out.append(line.split())
    return out


# --- the tables ---------------------------------------------------------------------------

def simulate_log(path):
    """{case: {"mesh": ..., strategy: fields}} from the printed table of `wlb simulate`."""
    out = {}
    for r in columns(log_body(path), "case", 14):
        # case mesh strategy Mtok/s PFLOP/s speedup [lo-hi] step_s step-x bubble idle grad_s drain peak
        lo, hi = r[6].strip("[]").split("-")
        out.setdefault(r[0], {"mesh": r[1]})[r[2]] = dict(
            tput=float(r[3]), x=float(r[5].rstrip("x")), lo=float(lo), hi=float(hi), step=float(r[7]),
            stepx=float(r[8].rstrip("x")), bubble=float(r[9]), drain=int(r[12]))
    return out


@table("sim-grid", "docs/performance.md", "bench/results/cpu/sim_grid.log")
def sim_grid(root):
    out = []
    for case, s in simulate_log(root / "bench/results/cpu/sim_grid.log").items():
        sp = [("{:.3f} [{:.2f}–{:.2f}]", s[k]["x"], s[k]["lo"], s[k]["hi"]) for k in ("fixed", "wlb", "pp-only", "cp-only")]
        out.append([(case,), (s["mesh"],), ("{:.4f}", s["plain"]["tput"]), *sp, ("{:.2f}", s["wlb"]["stepx"]),
                    ("{} / {}", s["fixed"]["drain"], s["wlb"]["drain"])])
    return out


PROFILES = ["h100-sxm", "h100-torch-measured", "h100-wlb-measured-sm80", "h100-wlb-measured"]
PROFILE_LOGS = [f"bench/results/cpu/sim_grid_profiles/{p}.log" for p in PROFILES]


@table("sim-grid-described-vs-torch", "docs/performance.md", *PROFILE_LOGS[:2])
def sim_grid_described_vs_torch(root):
    d, t = (simulate_log(root / lg) for lg in PROFILE_LOGS[:2])
    return [[(case,), ("{:.3f} → {:.3f} s", d[case]["plain"]["step"], t[case]["plain"]["step"]),
             ("{:.3f} → {:.3f} s", d[case]["wlb"]["step"], t[case]["wlb"]["step"]),
             ("{:.2f}× → {:.2f}×", d[case]["wlb"]["stepx"], t[case]["wlb"]["stepx"]),
             ("{:.2f}× → {:.2f}×", d[case]["fixed"]["stepx"], t[case]["fixed"]["stepx"])] for case in d]


@table("sim-grid-four-profiles", "docs/performance.md", *PROFILE_LOGS)
def sim_grid_four_profiles(root):
    runs = [simulate_log(root / lg) for lg in PROFILE_LOGS]
    out = []
    for case in runs[0]:
        out.append([(case,), (" / ".join(["{:.2f}"] * 4), *(r[case]["plain"]["step"] for r in runs)),
                    (" / ".join(["{:.2f}×"] * 4), *(r[case]["wlb"]["x"] for r in runs)),
                    (" / ".join(["{:.2f}×"] * 4), *(r[case]["fixed"]["x"] for r in runs))])
    return out


def shard_rows(path):
    out = []
    # 12 fields since `wlb shard` prints its planning time (plan.us, plan.us.mx), 10 before.
    for r in columns(log_body(path), "strategy", 12) or columns(log_body(path), "strategy", 10):
        strat, comm = r[0], r[1]
        label = "allgather (baseline)" if (strat, comm) == ("per_document", "allgather") else comm
        out.append([(strat,), (label,), ("{:.4f} / {:.4f}", float(r[2]), float(r[3])), ("{:.3f}", float(r[4])),
                    ("{:.2f}", float(r[5])), ("{:.3f}", float(r[6])), ("{:.4f}", float(r[7])), ("{:.3f}", float(r[8]))])
    return out


from_log("shard-long-context", "docs/performance.md", "bench/results/cpu/shard_long_context.log", shard_rows)
from_log("shard-long-context-2gbps", "docs/performance.md", "bench/results/cpu/shard_long_context_2gbps.log", shard_rows)


def shard_scaling_rows(path):
    """bench/shard_scaling.py: per CP degree, wall per run old and new (median [range]), their
    ratio, the new binary's planning time per micro-batch, and peak memory."""
    out = []
    for r in columns(log_body(path), "cp", 14):
        out.append([(r[0],), ("{:.2f} [{:.2f}–{:.2f}]", float(r[2]), float(r[3]), float(r[4])),
                    ("{:.2f} [{:.2f}–{:.2f}]", float(r[5]), float(r[6]), float(r[7])), ("{:.1f}×", float(r[8])),
                    ("{:.1f} / {:.1f}", float(r[10]) / 1e3, float(r[11]) / 1e3),
                    ("{:.0f} / {:.0f}", float(r[12]), float(r[13]))])
    return out


from_log("shard-scaling-hybrid", "docs/performance.md", "bench/results/cpu/shard_scaling_hybrid.log",
         shard_scaling_rows)
from_log("shard-scaling-hybrid-memo", "docs/performance.md", "bench/results/cpu/shard_scaling_hybrid_memo.log",
         shard_scaling_rows)


@functools.lru_cache(maxsize=None)  # two tables read the same 1.5 MB of plans
def shard_hybrid_plans(root):
    """The chosen hybrid + sharding_aware plans: over how many CP ranks each segment is split,
    and each micro-batch's bytes and latency against per_document + allgather."""
    import collections
    import json
    import lzma
    ranks, kv, lat = collections.Counter(), [], []
    with lzma.open(root / "bench/results/cpu/shard_long_context.jsonl.xz", "rt") as f:
        for mb in (json.loads(line) for line in f):
            if mb["type"] != "micro_batch":
                continue
            on = collections.defaultdict(set)
            for r, rank in enumerate(mb["plan"]["ranks"]):
                for piece in rank["pieces"]:
                    on[piece["segment"]].add(r)
            ranks.update(len(v) for v in on.values())
            c = {(x["strategy"], x["comm"]): x for x in mb["compare"]}
            h, b = c[("hybrid", "sharding_aware")], c[("per_document", "allgather")]
            kv.append(h["kv_bytes_total"] / b["kv_bytes_total"])
            lat.append(h["max_latency"] / b["max_latency"])
    return ranks, kv, lat


SHARD_PLANS = ("bench/results/cpu/shard_long_context.log", "bench/results/cpu/shard_long_context.jsonl.xz")


@table("shard-hybrid-splits", "docs/performance.md", *SHARD_PLANS)
def shard_hybrid_splits(root):
    ranks = shard_hybrid_plans(root)[0]
    return [[("segments",), *(("{}", ranks[g]) for g in range(1, 9)), ("{}", sum(ranks.values()))]]


@table("shard-hybrid-per-micro-batch", "docs/performance.md", *SHARD_PLANS)
def shard_hybrid_per_micro_batch(root):
    _, kv, lat = shard_hybrid_plans(root)
    return [[("KV bytes vs all-gather",), ("{:.3f}", min(kv)), ("{:.3f}", max(kv))],
            [("latency vs per_document + allgather",), ("{:.4f}", min(lat)), ("{:.4f}", max(lat))]]


@table("plan-long-context", "docs/performance.md", "bench/results/cpu/plan_long_context.log")
def plan_long_context(root):
    names = {"fixed_greedy": "fixed_greedy (k=2)"}
    out = []
    for r in columns(log_body(root / "bench/results/cpu/plan_long_context.log"), "packer", 11):
        out.append([(names.get(r[0], r[0]),), ("{:.3f}", float(r[1])), ("{:.3f}", float(r[2])), ("{:.3f}", float(r[3])),
                    ("{:.2f}", float(r[5])), ("{}", int(r[6]))])
    return out


VARIANTS = [("default deck, 100 steps", "plan_long_context.log"), ("200 steps", "plan_variants/steps200.log"),
            ("1000 steps", "plan_variants/steps1000.log"), ("600 steps, seed 1234", "plan_variants/seed1234.log"),
            ("600 steps, seed 7", "plan_variants/seed7.log"), ("600 steps, seed 99", "plan_variants/seed99.log"),
            ("70B-like layer, 200 steps", "plan_variants/llama70b.log"),
            ("8K window (`plan_smoke.toml`, N = 4), 2000 steps", "plan_variants/smoke.log"),
            ("max_queue_wait 4, 200 steps", "plan_variants/wait4.log"),
            ("max_queue_wait 6, 200 steps", "plan_variants/wait6.log")]


@table("plan-variants", "docs/performance.md", *(f"bench/results/cpu/{f}" for _, f in VARIANTS),
       "bench/results/cpu/plan_variants/tune.log")
def plan_variants(root):
    out = []
    for label, f in VARIANTS:
        rows = {r[0]: r for r in columns(log_body(root / "bench/results/cpu" / f), "packer", 11)}
        w = rows["wlb"]
        orig = ("{:.3f}", float(rows["original"][1])) if "original" in rows else ("—",)
        out.append([(label,), ("{:.3f}", float(w[1])), ("{:.3f}", float(w[5])), ("{}", int(w[6])), orig])
    tune = (root / "bench/results/cpu/plan_variants/tune.log").read_text()
    m = re.search(r"^best: --set 'packing.outlier_thresholds=(\[[0-9,]+\])'  \(imbalance ([0-9.]+), mean delay ([0-9.]+)\)",
                  tune, re.M)
    out.append([(f"`wlb tune --sample-steps 200`: best thresholds {m.group(1)}",), ("{:.3f}", float(m.group(2))),
                ("{:.3f}", float(m.group(3))), ("—",), ("—",)])
    return out


ATTN_RUNS = [f"bench/results/cpu/attention_cpu/run{i}.log" for i in (1, 2, 3)]
ATTN_RUNS_ZEN5 = [f"bench/results/cpu/attention_cpu_zen5/run{i}.log" for i in (1, 2, 3)]


def bench_attention(root, runs):
    """{(seq, D, bwd): [useful GFLOP/s per run]} and the FMA peaks of the runs."""
    cells, peaks = {}, []
    for lg in runs:
        text = (root / lg).read_text()
        peaks.append(float(re.search(r"^BM_FmaPeak .* GFLOPs=([0-9.]+)/s", text, re.M).group(1)))
        for m in re.finditer(r"^BM_Attention/seq:(\d)/D:(\d+)/bwd:(\d)\S* .* useful_GFLOPs=([0-9.]+)/s", text, re.M):
            cells.setdefault((int(m.group(1)), int(m.group(2)), int(m.group(3))), []).append(float(m.group(4)))
    return cells, peaks


def attention_cpu_rows(root, runs):
    cells, _ = bench_attention(root, runs)
    names = {(0, 64): "one 8K document", (0, 128): "one 8K document",
             (1, 64): "skewed packed 8K (4096, 1536, 1024, 512, 384, 256, 128, 96, 64, 48, 32, 10, 5, 1)",
             (1, 128): "skewed packed 8K"}
    out = []
    for seq, d in ((0, 64), (0, 128), (1, 64), (1, 128)):
        row = [(names[(seq, d)],), ("{}", d)]
        for bwd in (0, 1):
            v = cells[(seq, d, bwd)]
            row.append(("{:.1f} ({:.1f}–{:.1f})", max(v), min(v), max(v)))
        out.append(row)
    return out


def attention_cpu_peak_rows(root, runs):
    cells, peaks = bench_attention(root, runs)
    best = max(peaks)
    rows = [[("`BM_FmaPeak`",), ("{:.1f} ({:.1f}–{:.1f})", best, min(peaks), max(peaks)), ("100 %",)]]
    for label, keys in (("forward, one document", [(0, 64, 0), (0, 128, 0)]),
                        ("forward, skewed packs", [(1, 64, 0), (1, 128, 0)]),
                        ("forward + backward", [(s, d, 1) for s in (0, 1) for d in (64, 128)])):
        v = [max(cells[k]) for k in keys]
        rows.append([(label,), ("{:.1f}–{:.1f}", min(v), max(v)), ("{:.0f}–{:.0f} %", 100 * min(v) / best, 100 * max(v) / best)])
    return rows


table("attention-cpu", "docs/performance.md", *ATTN_RUNS)(lambda root: attention_cpu_rows(root, ATTN_RUNS))
table("attention-cpu-peak", "docs/performance.md", *ATTN_RUNS)(lambda root: attention_cpu_peak_rows(root, ATTN_RUNS))
table("attention-cpu-zen5", "docs/performance.md", *ATTN_RUNS_ZEN5)(
    lambda root: attention_cpu_rows(root, ATTN_RUNS_ZEN5))
table("attention-cpu-zen5-peak", "docs/performance.md", *ATTN_RUNS_ZEN5)(
    lambda root: attention_cpu_peak_rows(root, ATTN_RUNS_ZEN5))


TILES = ["64x64", "128x64", "64x128", "128x128", "32x64"]


@table("attention-cpu-tiles", "docs/performance.md", *(f"bench/results/cpu/attention_cpu/tiles_{t}.log" for t in TILES))
def attention_cpu_tiles(root):
    row = [("forward, one 8K document, D = 128",)]
    for t in TILES:
        text = (root / f"bench/results/cpu/attention_cpu/tiles_{t}.log").read_text()
        m = re.search(r"useful_GFLOPs=([0-9.]+)/s one-8K-doc D=128 fwd tiles " + t, text)
        row.append(("{:.1f}", float(m.group(1))))
    return [row]


H100 = "bench/results/h100"


@table("attention-h100", "docs/performance.md", f"{H100}/attention_wlb.json", f"{H100}/attention_wlb_sm80.log",
       f"{H100}/attention_torch.json")
def attention_h100(root):
    import json
    wlb = {(r["case"], r["mode"]): r for r in json.loads((root / H100 / "attention_wlb.json").read_text())["rows"]}
    sm80 = {}
    for m in re.finditer(r"case (\w) (tf32|bf16) \S+ +fwd +([0-9.]+) TFLOP/s.*bwd +([0-9.]+) .*fwd\+bwd +([0-9.]+)",
                         (root / H100 / "attention_wlb_sm80.log").read_text()):
        sm80[(m.group(1), m.group(2))] = [float(x) for x in m.group(3, 4, 5)]
    torch = _torch_rows(root / H100 / "attention_torch.json")
    labels = {"a": ["wlb FP32 (`cuda-simt-fp32`, exact FP32)", "wlb TF32 (`cuda-wgmma-tf32`; backward exact FP32)",
                    "wlb BF16 (`cuda-wgmma-bf16`)", "wlb sm_80 kernels TF32 / BF16 (`cuda-mma-*`)",
                    "PyTorch SDPA FP32 (mem-efficient, KV expanded)", "PyTorch SDPA BF16 (cuDNN, GQA)",
                    "FlexAttention BF16 (document-causal block mask)", "`varlen_attn` BF16"],
              "b": ["wlb FP32", "wlb TF32", "wlb BF16", "wlb sm_80 kernels TF32 / BF16",
                    "PyTorch SDPA FP32 (per-document calls)", "PyTorch SDPA BF16 cuDNN (per-document calls)",
                    "FlexAttention BF16", "`varlen_attn` BF16"],
              "c": ["wlb FP32", "wlb TF32", "wlb BF16", "wlb sm_80 kernels TF32 / BF16", "PyTorch SDPA FP32",
                    "PyTorch SDPA BF16 (cuDNN)", "FlexAttention BF16", "`varlen_attn` BF16"]}
    out = []
    for case in "abc":
        lab = labels[case]
        f, t, b = wlb[(case, "fp32")], wlb[(case, "tf32")], wlb[(case, "bf16")]
        rng = "{:.1f} [{:.1f}, {:.1f}]"
        out.append([(case,), (lab[0],), (rng, f["fwd_tflops"], *f["fwd_range"]), (rng, f["bwd_tflops"], *f["bwd_range"]),
                    ("{:.1f}", f["fwd_bwd_tflops"])])
        out.append([(case,), (lab[1],), (rng, t["fwd_tflops"], *t["fwd_range"]), ("{:.1f}", t["bwd_tflops"]),
                    ("{:.1f}", t["fwd_bwd_tflops"])])
        out.append([(case,), (lab[2],), (rng, b["fwd_tflops"], *b["fwd_range"]), (rng, b["bwd_tflops"], *b["bwd_range"]),
                    ("{:.1f}", b["fwd_bwd_tflops"])])
        s80t, s80b = sm80[(case, "tf32")], sm80[(case, "bf16")]
        out.append([(case,), (lab[3],), *(("{:.1f} / {:.1f}", s80t[i], s80b[i]) for i in range(3))])
        for k, name in enumerate(("sdpa_fp32", "sdpa_bf16_cudnn", "flex_bf16", "varlen_bf16")):
            r = torch[(case, name)]
            out.append([(case,), (lab[4 + k],), ("{:.1f}", r["fwd"]["tflops"]["median"]),
                        ("{:.1f}", r["bwd"]["tflops"]["median"]), ("",)])
    return out


H100_WS = f"{H100}/attention_ws"


def _ws_rows(root, name, folder=H100_WS):
    """{(case, path): row} of a bench_attention_gpu JSON (default: the warp-specialised session's)."""
    import json
    return {(r["case"], r["path"]): r for r in json.loads((root / folder / name).read_text())["rows"]}


def _torch_rows(path):
    """{(case, kernel): result} of a bench/attention_torch.py JSON."""
    import json
    return {(r["case"], r["kernel"]): r for r in json.loads(path.read_text())["results"]}


@table("attention-h100-ws", "docs/performance.md", f"{H100_WS}/attention_ws.json",
       f"{H100_WS}/attention_torch_abc.json")
def attention_h100_ws(root):
    wlb, torch = _ws_rows(root, "attention_ws.json"), _torch_rows(root / H100_WS / "attention_torch_abc.json")
    out = []
    for case in "abc":
        s, w = wlb[(case, "auto")], wlb[(case, "ws")]
        t = {k: (torch[(case, k)]["fwd"]["tflops"]["median"], torch[(case, k)]["bwd"]["tflops"]["median"])
             for k in ("sdpa_bf16_cudnn", "flex_bf16", "varlen_bf16")}
        pair = "{:.1f} / {:.1f}"
        cud = t["sdpa_bf16_cudnn"]
        out.append([(case,), (pair, s["fwd_tflops"], s["bwd_tflops"]), (pair, w["fwd_tflops"], w["bwd_tflops"]),
                    (pair, *cud), (pair, *t["flex_bf16"]), (pair, *t["varlen_bf16"]),
                    ("{:.2f} / {:.2f}", w["fwd_tflops"] / cud[0], s["bwd_tflops"] / cud[1])])
    return out


H100_828 = f"{H100}/one_model_2026-11-28"


@table("attention-h100-ws-1128", "docs/performance.md", f"{H100_828}/attention_ws.json",
       f"{H100_828}/attention_torch_abc.json")
def attention_h100_ws_1128(root):
    """The lease of 2026-11-28: sync, ws and ws-r64 against cuDNN; best = the faster of
    each direction's wlb kernels over cuDNN's."""
    wlb = _ws_rows(root, "attention_ws.json", H100_828)
    torch = _torch_rows(root / H100_828 / "attention_torch_abc.json")
    out = []
    for case in "abc":
        s, w, r64 = wlb[(case, "sync")], wlb[(case, "ws")], wlb[(case, "ws-r64")]
        cud = (torch[(case, "sdpa_bf16_cudnn")]["fwd"]["tflops"]["median"],
               torch[(case, "sdpa_bf16_cudnn")]["bwd"]["tflops"]["median"])
        pair = "{:.1f} / {:.1f}"
        best_f = max(s["fwd_tflops"], w["fwd_tflops"]) / cud[0]
        best_b = max(s["bwd_tflops"], w["bwd_tflops"]) / cud[1]
        out.append([(case,), (pair, s["fwd_tflops"], s["bwd_tflops"]), (pair, w["fwd_tflops"], w["bwd_tflops"]),
                    ("{:.1f}", r64["bwd_tflops"]), (pair, *cud), ("{:.2f} / {:.2f}", best_f, best_b)])
    return out


@table("attention-h100-cp-pieces", "docs/performance.md", f"{H100_WS}/attention_wlb_d.json",
       f"{H100_WS}/attention_torch_d.json")
def attention_h100_cp_pieces(root):
    wlb, torch = _ws_rows(root, "attention_wlb_d.json"), _torch_rows(root / H100_WS / "attention_torch_d.json")
    out = []
    for q in (64, 256, 1024):
        for k in ("16K", "64K", "128K"):
            cell = f"d:q{q}k{k}"
            s, w, ws = wlb[(cell, "auto")], wlb[(cell, "ws")], wlb[(cell, "ws-split")]
            v = torch[(cell, "varlen_bf16")]
            vf, vb = v["fwd"]["tflops"]["median"], v["bwd"]["tflops"]["median"]
            pair = "{:.1f} / {:.1f}"
            out.append([(f"{q} × {k}",), (pair, s["fwd_tflops"], s["bwd_tflops"]),
                        (pair, w["fwd_tflops"], w["bwd_tflops"]), ("{:.1f}", ws["fwd_tflops"]), (pair, vf, vb),
                        ("{:.2f} / {:.2f}", w["fwd_tflops"] / vf, s["bwd_tflops"] / vb)])
    return out


def run_summary(path):
    """{strategy: fields} from the summary table and per-rank busy lines `wlb run` prints."""
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    out = {}
    for r in columns(lines, "strategy", 13):
        lo, hi = r[5].strip("[]").split("-")
        out[r[0]] = dict(ktok=float(r[2]), tflops=float(r[3]) / 1e3, x=float(r[4].rstrip("x")), lo=float(lo),
                         hi=float(hi), step=float(r[6]))
    for m in re.finditer(r"^  (\w+)(?: \([^)]*\))?:  r0 busy ([0-9.]+) \(attn ([0-9.]+)\)", "\n".join(lines), re.M):
        out[m.group(1)].update(busy=float(m.group(2)), attn=float(m.group(3)))
    return out


@table("run-gpu-h100", "docs/performance.md", *(f"{H100}/run_gpu{v}.log" for v in
                                                ("", "_sm80_kernels", "_tf32", "_tf32_sm80_kernels", "_fp32")))
def run_gpu_h100(root):
    run = {v: run_summary(root / H100 / f"run_gpu{v}.log")
           for v in ("", "_sm80_kernels", "_tf32", "_tf32_sm80_kernels", "_fp32")}
    b, old = run[""], run["_sm80_kernels"]
    out = []
    for st in ("plain", "fixed", "wlb"):
        tok = ("{:.1f}", b[st]["ktok"]) if st != "wlb" else \
            ("{:.1f} ({:.3f}x [{:.3f}–{:.3f}])", b[st]["ktok"], b[st]["x"], b[st]["lo"], b[st]["hi"])
        out.append([("bf16",), (st,), tok, ("{:.1f}", b[st]["tflops"]), ("{:.3f}", b[st]["step"]),
                    ("{:.3f} ({:.3f})", b[st]["busy"], b[st]["attn"]), ("{:.1f}, {:.3f}", old[st]["ktok"], old[st]["attn"])])
    t, t80, f = run["_tf32"], run["_tf32_sm80_kernels"], run["_fp32"]
    pair = "{:.1f} / {:.1f}"
    out.append([("tf32 (3 steps)",), ("plain / wlb",), (pair, t["plain"]["ktok"], t["wlb"]["ktok"]),
                (pair, t["plain"]["tflops"], t["wlb"]["tflops"]), ("{:.3f} / {:.3f}", t["plain"]["step"], t["wlb"]["step"]),
                ("",), (pair, t80["plain"]["ktok"], t80["wlb"]["ktok"])])
    out.append([("fp32 (3 steps, sm_80 kernels only)",), ("plain / wlb",), (pair, f["plain"]["ktok"], f["wlb"]["ktok"]),
                (pair, f["plain"]["tflops"], f["wlb"]["tflops"]), ("{:.3f} / {:.3f}", f["plain"]["step"], f["wlb"]["step"]),
                ("",), ("",)])
    return out


@table("gpu-agreement-h100", "docs/performance.md", f"{H100}/gpu_check.log")
def gpu_agreement_h100(root):
    blocks, cur = [], None
    for line in (root / H100 / "gpu_check.log").read_text().splitlines():
        if line.startswith("== "):
            cur = []
            blocks.append((line[3:], cur))
        elif cur is not None and re.match(r"^(plain|fixed|wlb) +[0-9.e+-]+ +[0-9.e+-]+ +[0-9]+$", line):
            cur.append([float(x) for x in line.split()[1:3]])
    want = [("GPU fp32, one rank", "GPU FP32, one rank vs the CPU build (OpenBLAS, host kernels)"),
            ("GPU fp32, two ranks", "GPU FP32, two ranks with cp = 2 sharing the GPU (host-staged MPI) vs one rank"),
            ("GPU fp32, NCCL", "GPU FP32, NCCL communicators (one rank) vs MPI"),
            ("GPU tf32", "GPU TF32 vs the CPU build"), ("GPU bf16", "GPU BF16 vs the CPU build")]
    out = []
    for key, label in want:
        rows = next(r for h, r in blocks if h.startswith(key))
        g = [r[0] for r in rows]
        loss = max(r[1] for r in rows)
        e = math.floor(math.log10(max(g)))
        grad = ("≤ {:.1f}e" + str(e), max(g) / 10 ** e) if key.endswith("NCCL") else \
            ("{:.1f}–{:.1f}e" + str(e), min(g) / 10 ** e, max(g) / 10 ** e)
        if loss == 0:
            lcell = ("0",)
        else:
            el = math.floor(math.log10(loss))
            lcell = ("≤ {:.1f}e" + str(el), loss / 10 ** el)
        out.append([(label,), grad, lcell])
    return out


PACK = re.compile(r"^BM_Pack/(\w+)/(\d+)/(\d+)/(\d)\S*\s+[0-9.]+ (?:us|ms)\s+([0-9.]+) (us|ms)\s+\d+ (.*)$", re.M)


def bench_packing(text):
    """[(packer, window, N, preset flag, CPU µs per pack(), counters)] of bench_packing output."""
    return [(m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)),
             float(m.group(5)) * (1000 if m.group(6) == "ms" else 1),
             dict(kv.split("=") for kv in m.group(7).split())) for m in PACK.finditer(text)]


def micros(us):
    return ("{:.2f} ms", us / 1000) if us >= 1000 else ("{:.0f} µs", us) if us >= 100 else ("{:.1f} µs", us)


SIZES = [(65536, 16), (65536, 64), (131072, 16), (131072, 64)]


@table("bench-packing", "docs/performance.md", "bench/results/cpu/bench_packing.log")
def bench_packing_table(root):
    rows = {(p, w, n): us for p, w, n, f, us, _ in bench_packing((root / "bench/results/cpu/bench_packing.log").read_text())
            if f == 0}
    names = [("original", "original"), ("best_fit", "best_fit"), ("fixed_greedy", "fixed_greedy (k=2)"), ("wlb", "wlb"),
             ("slimpack", "slimpack (pp = 4)"), ("fixed_optimal", "fixed_optimal (CBC; the trivial bound closes)")]
    return [[(label,), *(micros(rows[(p, w, n)]) for w, n in SIZES)] for p, label in names]


@table("milp-growth", "docs/performance.md", "bench/results/cpu/bench_packing.log")
def milp_growth(root):
    out = []
    for p, w, n, f, us, c in bench_packing((root / "bench/results/cpu/bench_packing.log").read_text()):
        if p != "fixed_optimal" or f != 1:
            continue
        gap = float(c["max_gap"])
        out.append([("{}K / {}", w // 1024, n), ("{:.1f}", float(c["docs_per_step"])),
                    ("{:.3f}", us / 1000) if us < 1000 else ("{:.1f}", us / 1000),
                    ("{:.1f}%", 100 * gap) if gap > 0 else ("0",)])
    return out


@table("bench-packing-slimpack-speedup", "docs/performance.md", "bench/results/cpu/bench_packing_slimpack_speedup.log")
def bench_packing_slimpack_speedup(root):
    text = (root / "bench/results/cpu/bench_packing_slimpack_speedup.log").read_text()
    got = {}
    for m in re.finditer(r"^## round \d+ (base|final)\n((?:BM_.*\n)+)", text, re.M):
        for p, w, n, _, us, _ in bench_packing(m.group(2)):
            if p == "slimpack" or m.group(1) == "final":
                got.setdefault((m.group(1) if p == "slimpack" else "wlb", p, w, n), []).append(us)

    def rng(v):
        lo, hi = min(v), max(v)
        if lo >= 1000:
            return ("{:.2f}–{:.2f} ms", lo / 1000, hi / 1000)
        return ("{:.1f}–{:.1f} µs", lo, hi) if lo < 100 else ("{:.0f}–{:.0f} µs", lo, hi)
    return [[("wlb (same runs)",), *(rng(got[("wlb", "wlb", w, n)]) for w, n in SIZES)],
            [("slimpack, before",), *(rng(got[("base", "slimpack", w, n)]) for w, n in SIZES)],
            [("slimpack, after",), *(rng(got[("final", "slimpack", w, n)]) for w, n in SIZES)]]


PRESETS = ["long_context_128k", "pile", "code", "wikipedia", "sft_chat"]


@table("milp-large-steps", "docs/performance.md", *(f"bench/results/cpu/milp_large_steps/{p}.log" for p in PRESETS))
def milp_large_steps(root):
    out = []
    for p in PRESETS:
        text = (root / f"bench/results/cpu/milp_large_steps/{p}.log").read_text()
        r = {x[0]: x for x in columns(log_body(root / f"bench/results/cpu/milp_large_steps/{p}.log"), "packer", 11)}
        wall = float(re.search(r"^# wall ([0-9.]+) s", text, re.M).group(1))
        gap = float(r["fixed_optimal"][10])
        ms = float(r["fixed_optimal"][8]) / 1000
        out.append([(p,), ("{:.1f} s", wall), ("{:.2f}", ms) if ms < 1 else ("{:.0f}", ms),
                    ("{:.1f}%", 100 * gap) if gap > 0 else ("0",)])
    return out


@table("conservation", "docs/performance.md", "bench/results/cpu/conservation_1e6.log")
def conservation(root):
    text = (root / "bench/results/cpu/conservation_1e6.log").read_text()
    c = re.search(r"^check wlb: OK .* documents completed (\d+), in flight (\d+) \((\d+) tokens, packer holds (\d+)\), "
                  r"lost tokens (\d+), duplicated segments (\d+)", text, re.M)
    w = {x[0]: x for x in columns(log_body(root / "bench/results/cpu/conservation_1e6.log"), "packer", 11)}["wlb"]
    wall = float(re.search(r"^# wall ([0-9.]+) s", text, re.M).group(1))
    return [[("{}", int(c.group(1))), ("{} ({} tokens)", int(c.group(2)), int(c.group(3))), ("{}", int(c.group(5))),
             ("{}", int(c.group(6))), ("{:.3f}", float(w[1])), ("{:.3f}", float(w[5])), ("{}", int(w[6])),
             ("{:.1f}", float(w[8])), ("{:.0f} s", wall)]]


def run_peaks(text):
    """{strategy: MiB} of the measured activation peak (stage 0) `wlb run` prints."""
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r"^  (\w+) +bubble [0-9.]+  peak \[MiB\]  stage 0 ([0-9.]+)", text, re.M)}


def alloc_figures(text):
    """{strategy: (allocations per step, unrecorded %)} from `wlb run`'s report."""
    return {m.group(1): (float(m.group(3)), float(m.group(2))) for m in
            re.finditer(r"^  (\w+) \(unrecorded ([0-9.]+)%, ([0-9.]+) buffer allocations per step\)", text, re.M)}


def pool_figures(text):
    """{strategy: (allocations per step, unrecorded %, pool MiB stage 0, peak MiB stage 0)} from `wlb run`'s report."""
    alloc = alloc_figures(text)
    pool = {m.group(1): float(m.group(2)) for m in
            re.finditer(r"^  (\w+) +bubble .*  pool (?:/ in use / asked )?\[MiB\]  stage 0 ([0-9.]+)", text, re.M)}
    peak = run_peaks(text)
    return {k: (alloc[k][0], alloc[k][1], pool[k], peak[k]) for k in alloc}


POOL_LOGS = [f"bench/results/cpu/{d}_pool{w}.log" for d in ("run_cp2", "run_slimpack_pp2") for w in ("_window", "")]


@table("pool-policy", "docs/runtime.md", *POOL_LOGS)
def pool_policy(root):
    out = []
    for deck, strategies in (("run_cp2", ("plain", "fixed", "wlb")), ("run_slimpack_pp2", ("slimpack",))):
        before = pool_figures((root / f"bench/results/cpu/{deck}_pool_window.log").read_text())
        now = pool_figures((root / f"bench/results/cpu/{deck}_pool.log").read_text())
        for st in strategies:
            b, n = before[st], now[st]
            out.append([(f"{deck}, {st}",), ("{:.1f}", b[0]), ("{:.1f}", n[0]), ("{:.2f}", b[2]), ("{:.2f}", n[2]),
                        ("{:.2f}", n[3]), ("{:.1f}%", n[1])])
    return out


def pool_use_figures(text):
    """{strategy: [(pool, in use, asked, peak) MiB per stage]} and alloc_figures(text)."""
    stages = {}
    for m in re.finditer(r"^  (\w+) +bubble [0-9.]+  peak \[MiB\]((?:  stage \d+ [0-9.]+)+)  pool / in use / asked "
                         r"\[MiB\]((?:  stage \d+ [0-9.]+ / [0-9.]+ / [0-9.]+)+)$", text, re.M):
        peaks = [float(x) for x in re.findall(r"stage \d+ ([0-9.]+)", m.group(2))]
        pools = re.findall(r"stage \d+ ([0-9.]+) / ([0-9.]+) / ([0-9.]+)", m.group(3))
        stages[m.group(1)] = [tuple(float(x) for x in p) + (k,) for p, k in zip(pools, peaks)]
    return stages, alloc_figures(text)


POOL_USE_LOGS = [f"bench/results/cpu/{n}.log" for n in
                 ("run_cp2_pool_use", "run_slimpack_pp2_pool_use", "run_slimpack_pp2_pool_fit2")]


@table("pool-use", "docs/runtime.md", *POOL_USE_LOGS)
def pool_use(root):
    out = []
    for log, label, strategies in (("run_cp2_pool_use", "run_cp2", ("plain", "wlb")),
                                   ("run_slimpack_pp2_pool_use", "run_slimpack_pp2", ("wlb", "slimpack")),
                                   ("run_slimpack_pp2_pool_fit2", "run_slimpack_pp2, fit ≤ 2 buckets", ("slimpack",))):
        stages, alloc = pool_use_figures((root / f"bench/results/cpu/{log}.log").read_text())
        for st in strategies:
            for i, (pool, live, asked, peak) in enumerate(stages[st]):
                out.append([(f"{label}, {st}",), ("{}", i), ("{:.2f}", pool), ("{:.2f}", live), ("{:.2f}", asked),
                            ("{:.2f}", peak), ("{:.1f}", alloc[st][0])])
    return out


@table("pool-untyped", "docs/runtime.md", *[f"bench/results/cpu/{d}_pool_{w}.log" for d in ("run_cp2", "run_slimpack_pp2")
                                             for w in ("use", "bytes")])
def pool_untyped(root):
    out = []
    for deck, strategies in (("run_cp2", ("plain", "fixed", "wlb")), ("run_slimpack_pp2", ("slimpack",))):
        before, b_alloc = pool_use_figures((root / f"bench/results/cpu/{deck}_pool_use.log").read_text())
        now, n_alloc = pool_use_figures((root / f"bench/results/cpu/{deck}_pool_bytes.log").read_text())
        for st in strategies:
            for i, (b, n) in enumerate(zip(before[st], now[st])):
                out.append([(f"{deck}, {st}",), ("{}", i), ("{:.2f}", b[0]), ("{:.2f}", n[0]), ("{:.2f}", n[1]),
                            ("{:.2f}", n[2]), ("{:.1f}", b_alloc[st][0]), ("{:.1f}", n_alloc[st][0])])
    return out


@table("pool-split", "docs/runtime.md", *[f"bench/results/cpu/{d}_pool_{w}.log" for d in ("run_cp2", "run_slimpack_pp2")
                                           for w in ("bytes", "split")])
def pool_split(root):
    out = []
    for deck, strategies in (("run_cp2", ("plain", "fixed", "wlb")),
                             ("run_slimpack_pp2", ("plain", "wlb", "slimpack"))):
        before, b_alloc = pool_use_figures((root / f"bench/results/cpu/{deck}_pool_bytes.log").read_text())
        now, n_alloc = pool_use_figures((root / f"bench/results/cpu/{deck}_pool_split.log").read_text())
        for st in strategies:
            for i, (b, n) in enumerate(zip(before[st], now[st])):
                out.append([(f"{deck}, {st}",), ("{}", i), ("{:.2f}", b[0]), ("{:.2f}", n[0]), ("{:.2f}", b[1]),
                            ("{:.2f}", n[1]), ("{:.2f}", n[2]), ("{:.1f}", b_alloc[st][0]), ("{:.1f}", n_alloc[st][0])])
    return out


@table("slices-cp2", "docs/performance.md", "bench/results/cpu/run_cp2_slimpack.log")
def slices_cp2(root):
    path = root / "bench/results/cpu/run_cp2_slimpack.log"
    text = path.read_text()
    run, sim = run_summary(path), simulate_log(path)["run_cp2"]
    peak = run_peaks(text)
    pred = dict(re.findall(r"(\w+) ([0-9.]+)", text.split("executor's memory model:")[1].splitlines()[0]))
    out = []
    for st in ("plain", "wlb", "slimpack"):
        m, p = run[st], sim[st]
        over = ("{:.2f}×", 1.0) if st == "plain" else ("{:.2f}× [{:.2f}–{:.2f}]", m["x"], m["lo"], m["hi"])
        pover = ("{:.2f}×", 1.0) if st == "plain" else ("{:.2f}× [{:.2f}–{:.2f}]", p["x"], p["lo"], p["hi"])
        out.append([(st,), ("{:.2f}", m["ktok"]), over, ("{:.1f}", p["tput"] * 1000), pover,
                    ("{:+.1f}%", 100 * (p["tput"] * 1000 / m["ktok"] - 1)), ("{:.2f} / {:.2f}", peak[st], float(pred[st]))])
    return out


def ab_rows(root, log):
    """binary_ab.py without --region: per strategy old and new ktok/s, tokens/s and FLOP/s new / old [range]."""
    out = []
    for r in columns(log_body(root / log), "strategy", 7):
        tlo, thi = r[4].strip("[]").split("-")
        flo, fhi = r[6].strip("[]").split("-")
        out.append([(r[0],), ("{:.2f}", float(r[1])), ("{:.2f}", float(r[2])),
                    ("{:.3f} [{:.3f}–{:.3f}]", float(r[3].rstrip("x")), float(tlo), float(thi)),
                    ("{:.3f} [{:.3f}–{:.3f}]", float(r[5].rstrip("x")), float(flo), float(fhi))])
    return out


@table("run-cp2-ab", "docs/performance.md", "bench/results/cpu/run_cp2_ab.log")
def run_cp2_ab(root):
    return ab_rows(root, "bench/results/cpu/run_cp2_ab.log")


@table("pool-split-ab", "docs/runtime.md", "bench/results/cpu/run_cp2_pool_split_ab.log")
def pool_split_ab(root):
    return ab_rows(root, "bench/results/cpu/run_cp2_pool_split_ab.log")


def ab_region_cells(body, region):
    """binary_ab.py --region REGION's output: per strategy, the region's old and new seconds
    per step, its new / old [range] and the step's tokens/s new / old [range], as cells."""
    tok = {r[0]: r for r in columns(body, "strategy", 7)}
    rows = {}
    for line in body:
        f = line.split()
        if f[1:2] != [region]:
            continue
        t = tok[f[0]]
        rlo, rhi = f[5].strip("[]").split("-")
        tlo, thi = t[4].strip("[]").split("-")
        rows[f[0]] = [("{:.3f}", float(f[2])), ("{:.3f}", float(f[3])),
                      ("{:.3f} [{:.3f}–{:.3f}]", float(f[4].rstrip("x")), float(rlo), float(rhi)),
                      ("{:.3f} [{:.3f}–{:.3f}]", float(t[3].rstrip("x")), float(tlo), float(thi))]
    return rows


@table("loss-ce-ab", "docs/performance.md", "bench/results/cpu/loss_ce_ab_fp32.log",
       "bench/results/cpu/loss_ce_ab_bf16.log")
def loss_ce_ab(root):
    """binary_ab.py --region loss: the loss region per step and the step's tokens/s, old and
    new binary, one row per precision (plain only)."""
    return [[(prec,)] + ab_region_cells(log_body(root / f"bench/results/cpu/loss_ce_ab_{prec}.log"), "loss")["plain"]
            for prec in ("fp32", "bf16")]


@table("rope-kernel", "docs/performance.md", "bench/results/cpu/run_cp2_kernels_old.log",
       "bench/results/cpu/run_cp2_kernels.log")
def rope_kernel(root):
    """--kernel-timing: the RoPE kernel's calls and milliseconds per call, and its share of the
    timed kernels, before and after the 3-D range."""
    row = []
    for name in ("run_cp2_kernels_old", "run_cp2_kernels"):
        body = log_body(root / f"bench/results/cpu/{name}.log")
        f = next(line.split() for line in body if line.split()[:1] == ["wlb::runtime::rope"])
        row.append((int(f[1]), float(f[3]), float(f[4].rstrip("%"))))
    (c0, old, sh0), (_, new, sh1) = row
    return [[("{:d}", c0), ("{:.3f} ({:.1f}%)", old, sh0), ("{:.3f} ({:.1f}%)", new, sh1), ("{:.3f}", new / old)]]


@table("rope-ab", "docs/performance.md", "bench/results/cpu/rope_ab.log")
def rope_ab(root):
    """binary_ab.py --region qkv_proj: the region per step and the step's tokens/s, old and new
    binary, per strategy."""
    return [[(st,)] + cells for st, cells in ab_region_cells(log_body(root / "bench/results/cpu/rope_ab.log"),
                                                             "qkv_proj").items()]


def kernel_rows(root, old_log, new_log, kernels):
    """--kernel-timing tables of two runs: per kernel its calls, milliseconds per call and
    share of the timed kernels, old and new, and new / old."""
    bodies = [log_body(root / f"bench/results/cpu/{n}.log") for n in (old_log, new_log)]
    rows = []
    for k in kernels:
        label = k if "::" in k else f"wlb::runtime::{k}"  # the executor's kernels by their short name
        (c0, old, sh0), (_, new, sh1) = [
            (int(f[1]), float(f[3]), float(f[4].rstrip("%")))
            for f in (next(line.split() for line in b if line.split()[:1] == [label]) for b in bodies)]
        rows.append([(f"`{k}`",), ("{:d}", c0), ("{:.3f} ({:.1f}%)", old, sh0), ("{:.3f} ({:.1f}%)", new, sh1),
                     ("{:.3f}", new / old)])
    return rows


@table("host-simd-kernels", "docs/performance.md", "bench/results/cpu/run_cp2_kernels_simd_old.log",
       "bench/results/cpu/run_cp2_kernels_simd.log")
def host_simd_kernels(root):
    """--kernel-timing: the SwiGLU and cross-entropy kernels, scalar (old) and vectorised
    (new) host bodies."""
    return kernel_rows(root, "run_cp2_kernels_simd_old", "run_cp2_kernels_simd", ("swiglu", "swiglu_bwd", "cross_entropy"))


@table("host-rmsnorm-kernels", "docs/performance.md", "bench/results/cpu/run_cp2_kernels_rmsnorm_old.log",
       "bench/results/cpu/run_cp2_kernels_rmsnorm.log")
def host_rmsnorm_kernels(root):
    """--kernel-timing: the RMSNorm kernels, team (old) and vectorised (new) host bodies."""
    return kernel_rows(root, "run_cp2_kernels_rmsnorm_old", "run_cp2_kernels_rmsnorm",
                       ("rmsnorm_fwd", "rmsnorm_bwd_x", "rmsnorm_gain_part"))


@table("host-rows-kernels", "docs/performance.md", "bench/results/cpu/run_cp2_kernels_rows_old.log",
       "bench/results/cpu/run_cp2_kernels_rows.log")
def host_rows_kernels(root):
    """--kernel-timing: the row moves, the embedding and the attention's tile packers, before
    and after they walk rows and transpose in registers."""
    return kernel_rows(root, "run_cp2_kernels_rows_old", "run_cp2_kernels_rows",
                       ("move_rows", "embed", "embed_bwd", "wlb::attention::pack_k", "wlb::attention::bwd::pack_q",
                        "wlb::attention::bwd::unpack_dq"))


@table("host-simd-ab", "docs/performance.md", "bench/results/cpu/host_simd_ab.log")
def host_simd_ab(root):
    """binary_ab.py --region mlp --region loss: both regions per step (old, new, new / old) and
    the step's tokens/s new / old, per strategy."""
    body = log_body(root / "bench/results/cpu/host_simd_ab.log")
    mlp, loss = ab_region_cells(body, "mlp"), ab_region_cells(body, "loss")
    return [[(st,)] + mlp[st][:3] + loss[st][:3] + mlp[st][3:] for st in mlp]


def qkv_mlp_ab_rows(root, log):
    """binary_ab.py --region qkv_proj --region mlp: both regions per step (old, new, new / old)
    and the step's tokens/s new / old, per strategy."""
    body = log_body(root / log)
    qkv, mlp = ab_region_cells(body, "qkv_proj"), ab_region_cells(body, "mlp")
    return [[(st,)] + qkv[st][:3] + mlp[st][:3] + qkv[st][3:] for st in qkv]


# the RMSNorm vectorised (old and new binary)
table("host-rmsnorm-ab", "docs/performance.md", "bench/results/cpu/host_rmsnorm_ab.log")(
    lambda root: qkv_mlp_ab_rows(root, "bench/results/cpu/host_rmsnorm_ab.log"))


@table("recompute-selective-ab", "docs/performance.md", "bench/results/cpu/recompute_selective_ab.log")
def recompute_selective_ab(root):
    """binary_ab.py --region qkv_proj --region mlp --region recompute, none (old) against
    selective (new): qkv_proj and mlp as qkv_mlp_ab_rows, then selective's recompute seconds
    per step (none records none) before the tokens/s ratio."""
    log = "bench/results/cpu/recompute_selective_ab.log"
    rows = qkv_mlp_ab_rows(root, log)
    rc = {f[0]: float(f[3]) for f in (line.split() for line in log_body(root / log)) if f[1:2] == ["recompute"]}
    return [r[:-1] + [("{:.4f}", rc[r[0][0]])] + r[-1:] for r in rows]


@table("host-rows-ab", "docs/performance.md", "bench/results/cpu/host_rows_ab.log")
def host_rows_ab(root):
    """binary_ab.py --region embed --region attn --region kv_exchange: the three regions per
    step (old, new, new / old) and the step's tokens/s new / old, per strategy."""
    body = log_body(root / "bench/results/cpu/host_rows_ab.log")
    cells = [ab_region_cells(body, r) for r in ("embed", "attn", "kv_exchange")]
    return [[(st,)] + [c for r in cells for c in r[st][:3]] + cells[0][st][3:] for st in cells[0]]


@table("profile-fields-h100", "docs/performance.md", "inputs/profiles/h100-sxm.json",
       "inputs/profiles/h100-torch-measured.json")
def profile_fields_h100(root):
    """The described and the measured H100 profile's attention and GEMM fields (the
    measured profile is the raw output of bench/profile_torch.py, with its sources)."""
    import json
    prof = [json.loads((root / f"inputs/profiles/{n}.json").read_text()) for n in ("h100-sxm", "h100-torch-measured")]

    def attn(p, d):
        t = p["attention"][d]
        cells = [v / 1e3 for row in t["gflops"] for v in row]
        row = t["gflops"][t["q_lens"].index(1024)]
        return ("{:.0f}–{:.0f} (q = 1024: {:.0f} → {:.0f})", min(cells), max(cells),
                row[t["k_lens"].index(1024)] / 1e3, row[-1] / 1e3)
    g = {x["name"]: x["fwd_gflops"] / 1e3 for x in prof[1]["measured"]["gemm"]}
    return [[("attention fwd, padded TFLOP/s",), attn(prof[0], "fwd"), attn(prof[1], "fwd")],
            [("attention bwd, padded TFLOP/s",), attn(prof[0], "bwd"), attn(prof[1], "bwd")],
            [("linear (GEMM) TFLOP/s",), ("{:.0f}", prof[0]["linear_gflops"] / 1e3),
             ("{:.0f} (qkv {:.0f}, o {:.0f}, fc1 {:.0f}, fc2 {:.0f} forward)", prof[1]["linear_gflops"] / 1e3,
              g["qkv"], g["o"], g["fc1"], g["fc2"])]]


def validate_sim_rows(path):
    """Rows of the table `wlb validate-sim` prints (three rounds per purpose)."""
    out = []
    for m in re.finditer(r"^(\S+) +(plain|fixed|wlb|slimpack) +([0-9.]+) +([0-9.]+) +([+-][0-9.]+)% +([0-9.]+)x +"
                         r"([0-9.]+)x +\d+/\d+ +rounds ([0-9.]+)-([0-9.]+)$", path.read_text(), re.M):
        v = [float(x) for x in m.group(3, 4, 5, 6, 7, 8, 9)]
        out.append([(m.group(1),), (m.group(2),), ("{:.2f} ({:.2f}–{:.2f})", v[0], v[5], v[6]), ("{:.2f}", v[1]),
                    ("{:+.1f}%", v[2]), ("{:.3f}x / {:.3f}x", v[3], v[4])])
    return out


from_log("validate-sim", "docs/performance.md", "bench/results/cpu/validate_sim/validate_sim.log", validate_sim_rows)
from_log("validate-sim-selective", "docs/performance.md", "bench/results/cpu/validate_sim_selective/validate_sim.log",
         validate_sim_rows)
from_log("validate-sim-pp2", "docs/performance.md", "bench/results/cpu/validate_sim_pp2/validate_sim.log",
         validate_sim_rows)


def md_table(path, header_start, first_cells=1):
    """The rows of the markdown table starting with `header_start` in a raw log that prints
    one, every number a figure at the decimals printed and the first cells as labels."""
    lines = path.read_text().splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(header_start))
    out = []
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        row = []
        for j, cell in enumerate(c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])):
            if j < first_cells:
                row.append((cell.replace("{", "{{").replace("}", "}}"),))
                continue
            nums = re.findall(NUM, cell)
            fmt = re.sub(NUM, lambda m: "{:.%df}" % (len(m.group(1).split(".")[1]) if "." in m.group(1) else 0),
                         cell.replace("{", "{{").replace("}", "}}"))
            row.append((fmt, *(float(x.replace("−", "-")) for x in nums)))
        out.append(row)
    return out


from_log("cp-balancers", "docs/cp.md", "bench/results/cp_balancers/cp_balancers.txt",
         lambda path: md_table(path, "| data | balancer", first_cells=3))


@table("training-bf16", "docs/training.md", "bench/results/cpu/convergence_bf16.log")
def training_bf16(root):
    text = (root / "bench/results/cpu/convergence_bf16.log").read_text()
    rows = md_table(root / "bench/results/cpu/convergence_bf16.log", "| packing |")
    fp32, bf16 = rows[0][1][1:3], rows[1][1][1:3]
    seeds = [[float(x) for x in m] for m in re.findall(
        r"^seed \d+: eval [0-9.]+ / [0-9.]+ \(([+-][0-9.]+)%\), train step-loss difference mean ([+-][0-9.]+)% "
        r"max\|\.\| ([0-9.]+)%", text, re.M)]
    ev = [x[0] for x in seeds]
    tr = [x[1] for x in seeds]
    return [[("fp32",), ("{:.4f} ± {:.4f}", *fp32), ("",)],
            [("bf16",), ("{:.4f} ± {:.4f} (+{:.3f}%; per seed +{:.3f}%, +{:.3f}%, +{:.3f}%)", *bf16, statistics.fmean(ev), *ev),
             ("mean +{:.3f}% (std over seeds {:.3f}%), largest \\|·\\| {:.3f}%", statistics.fmean(tr),
              statistics.stdev(tr), max(x[2] for x in seeds))]]


def run_pipeline(text):
    """{strategy: (bubble, [MiB per stage])} of the pipeline lines `wlb run` prints."""
    out = {}
    for m in re.finditer(r"^  (\w+) +bubble ([0-9.]+)  peak \[MiB\]((?:  stage \d+ [0-9.]+)+)", text, re.M):
        out[m.group(1)] = (float(m.group(2)), [float(x) for x in re.findall(r"stage \d+ ([0-9.]+)", m.group(3))])
    return out


def run_vs_sim(root, run_log, sim_dir, case=None):
    """Rows of a measured run beside the simulator's prediction of it (simulate.csv)."""
    path = root / run_log
    run, pipe = run_summary(path), run_pipeline(path.read_text())
    sim = {}
    for r in csv.DictReader(open(root / sim_dir / "simulate.csv")):
        if case is None or r["case"] == case:
            sim[r["strategy"]] = r
    out = []
    for st, m in run.items():
        p = sim[st]
        pred = float(p["tokens_per_second"]) / 1e3
        peaks_p = [float(x) / 2 ** 20 for x in p["peak_activation_bytes_per_stage"].split(";")]
        bub, peaks_m = pipe[st]
        sp = ("{:.3f}", 1.0) if st == "plain" else ("{:.3f} [{:.3f}–{:.3f}]", m["x"], m["lo"], m["hi"])
        out.append([(st,), ("{:.2f}", m["ktok"]), ("{:.2f}", pred), ("{:+.1f}%", 100 * (pred / m["ktok"] - 1)), sp,
                    ("{:.3f}", float(p["speedup"])), ("{:.3f} / {:.3f}", m["step"], float(p["step_seconds"])),
                    ("{:.3f} / {:.3f}", bub, float(p["bubble_fraction"])),
                    (" / ".join(["{:.2f}"] * len(peaks_m)) + " (predicted " + " / ".join(["{:.2f}"] * len(peaks_p)) + ")",
                     *peaks_m, *peaks_p)])
    return out


RUNS = "bench/results/cpu/one_model_runs"


@table("pp2-run", "docs/performance.md", f"{RUNS}/pp2b_run.log", f"{RUNS}/pp2b_simulate.log")
def pp2_run(root):
    return run_vs_sim(root, f"{RUNS}/pp2b_run.log", f"{RUNS}/pp2b_simulate")


@table("pp2-run-shipped-profile", "docs/performance.md", f"{RUNS}/pp2_run.log", f"{RUNS}/pp2_simulate.log")
def pp2_run_shipped_profile(root):
    return run_vs_sim(root, f"{RUNS}/pp2_run.log", f"{RUNS}/pp2_simulate")


@table("slimpack-pp2", "docs/performance.md", f"{RUNS}/slimpack_pp2_run.log", f"{RUNS}/slimpack_pp2_simulate.log")
def slimpack_pp2(root):
    return run_vs_sim(root, f"{RUNS}/slimpack_pp2_run.log", f"{RUNS}/slimpack_pp2_simulate")


@table("slimpack-pp2-dp2", "docs/performance.md", f"{RUNS}/slimpack_pp2_dp2_run.log",
       f"{RUNS}/slimpack_pp2_dp2_simulate.log")
def slimpack_pp2_dp2(root):
    return run_vs_sim(root, f"{RUNS}/slimpack_pp2_dp2_run.log", f"{RUNS}/slimpack_pp2_dp2_simulate")


def run_busy(text):
    """{strategy: [busy seconds per step of each rank]} from `wlb run`'s per-rank lines."""
    return {m.group(1): [float(x) for x in re.findall(r"r\d+ busy ([0-9.]+)", m.group(2))]
            for m in re.finditer(r"^  (\w+)(?: \([^)]*\))?:(  r0 busy .*)$", text, re.M)}


@table("dpmerge", "docs/performance.md", f"{RUNS}/dpmerge_run_on.log", f"{RUNS}/dpmerge_run_off.log",
       f"{RUNS}/dpmerge_simulate_on.log", f"{RUNS}/dpmerge_simulate_off.log")
def dpmerge(root):
    out = []
    for on in ("on", "off"):
        path = root / f"{RUNS}/dpmerge_run_{on}.log"
        m = run_summary(path)["slimpack"]
        busy = run_busy(path.read_text())
        p = next(r for r in csv.DictReader(open(root / f"{RUNS}/dpmerge_simulate_{on}/simulate.csv"))
                 if r["strategy"] == "slimpack")
        sb, pb = busy["slimpack"], busy["plain"]
        out.append([(f"DP-Merge {on}",),
                    ("{:.2f}× [{:.2f}–{:.2f}]", float(p["speedup"]), float(p["speedup_lo"]), float(p["speedup_hi"])),
                    ("{:.3f}", float(p["idle_fraction"])), ("{:.2f}× [{:.2f}–{:.2f}]", m["x"], m["lo"], m["hi"]),
                    ("{:.2f}–{:.2f} s per step (plain {:.2f}–{:.2f} s)", min(sb), max(sb), min(pb), max(pb))])
    return out


MESHES = [("one_rank", "one rank"), ("dp2", "dp = 2"), ("pp2_1f1b", "pp = 2, 1F1B"), ("pp2_gpipe", "pp = 2, GPipe"),
          ("pp2_interleaved", "pp = 2, interleaved 1F1B (2 chunks per stage)")]


def train_rates(root, mesh):
    return [float(re.search(r"^throughput +([0-9.]+) tokens/s", (root / f"{RUNS}/train_mesh/{mesh}_{r}.log").read_text(),
                            re.M).group(1)) for r in (1, 2, 3)]


@table("train-mesh", "docs/performance.md", *(f"{RUNS}/train_mesh/{m}_{r}.log" for m, _ in MESHES for r in (1, 2, 3)))
def train_mesh(root):
    one = statistics.fmean(train_rates(root, "one_rank"))
    out = []
    for mesh, label in MESHES:
        v = train_rates(root, mesh)
        out.append([(label,), ("{:.0f} / {:.0f} / {:.0f}", *v), ("{:.2f}×", statistics.fmean(v) / one)])
    return out


PLANNER = re.compile(r"^wlb +(\d+)K/(\d+) +(pack_documents|pack\+arrays|pack|sampler step) +([0-9.]+) +([0-9.]+) +"
                     r"([0-9.]+) +([0-9.]+) +(\S+)$", re.M)


@table("python-planner", "docs/performance.md", f"{RUNS}/python_planner.log")
def python_planner(root):
    got = {}
    for m in PLANNER.finditer((root / f"{RUNS}/python_planner.log").read_text()):
        got[(int(m.group(1)), int(m.group(2)), m.group(3))] = [float(x) for x in m.group(4, 5, 6, 7)] + [m.group(8)]
    sizes = [(64, 16), (64, 64), (128, 16), (128, 64)]
    labels = [("pack_documents", "`pack_documents(docs, step)`: packer + Python call"),
              ("pack", "`pack()`: + drawing the step from the generator"),
              ("pack+arrays", "`pack()` + reading `segments` and `offsets`")]
    out = [[(label,), *(("{:.1f} / {:.1f}", got[(w, n, call)][1], got[(w, n, call)][0]) for w, n in sizes)]
           for call, label in labels]
    out.append([("C++ `plan_us` (mean)",), *(("{:.1f}", float(got[(w, n, "pack_documents")][4])) for w, n in sizes)])
    if (64, 16, "sampler step") in got:
        out.append([("`PackedBatchSampler` step: pack, checkpoint, M micro-batches of Segments",),
                    *(("{:.1f} / {:.1f}", got[(w, n, "sampler step")][1], got[(w, n, "sampler step")][0]) for w, n in sizes)])
    return out


@table("drain-window", "docs/algorithms.md", *(f"bench/results/cpu/drain_window/steps{n}.log" for n in (10, 50, 200)))
def drain_window(root):
    out = []
    for n in (10, 50, 200):
        w = simulate_log(root / f"bench/results/cpu/drain_window/steps{n}.log")["7b-128k"]["wlb"]
        out.append([("{}", n), ("{:.3f} [{:.3f}–{:.3f}]", w["x"], w["lo"], w["hi"]), ("{:.2f}", w["stepx"])])
    return out


CPU16 = "bench/results/cpu16/lease2"
CPU16_DECKS = ("run16_cp4_dp4", "run16_tp2_cp2_pp2_dp2", "run16_pp4_dp4_packflow", "run16_cp8_dp2")


def log_sections(path):
    """(title, body) of each section of a log of several `wlb simulate` tables, each after a
    line "== TITLE"."""
    for sec in path.read_text().split("\n== ")[1:]:
        title, body = sec.split("\n", 1)
        yield title.strip(), body


def section(logs, start):
    """The section of `logs` (sim_sections / sim_tokens) whose title starts with `start`."""
    return next(v for k, v in logs.items() if k.startswith(start))


def sim_sections(path):
    """{section title: {case: {strategy: {"tput": Mtok/s, "x": speedup}}}} of a log of several
    `wlb simulate` tables (log_sections)."""
    out = {}
    for title, body in log_sections(path):
        rows = {}
        for r in columns([x for x in body.splitlines() if not x.startswith("#")], "case", 14):
            rows.setdefault(r[0], {})[r[2]] = dict(tput=float(r[3]), x=float(r[5].rstrip("x")))
        out[title] = rows
    return out


@table("cpu16-first-runs", "docs/performance.md", *(f"{CPU16}/logs/calibration-{d}.log" for d in CPU16_DECKS),
       f"{CPU16}/replay_calibration.log")
def cpu16_first_runs(root):
    sim = {}  # one simulate table per deck
    for rows in sim_sections(root / f"{CPU16}/replay_calibration.log").values():
        sim.update(rows)
    out = []
    for d in CPU16_DECKS:
        run = run_summary(root / f"{CPU16}/logs/calibration-{d}.log")
        for st, m in run.items():
            p = sim[d][st]
            pred = p["tput"] * 1e3  # Mtok/s -> ktok/s
            sp = ("{:.3f}", 1.0) if st == "plain" else ("{:.3f} [{:.3f}–{:.3f}]", m["x"], m["lo"], m["hi"])
            out.append([(f"`{d}`",), (st,), ("{:.2f}", m["ktok"]), sp, ("{:.1f}", pred),
                        ("{:+.0f}%", 100 * (pred / m["ktok"] - 1)), ("{:.3f}", p["x"])])
    return out


def sim_tokens(path):
    """{section title: {case: {strategy: tokens/s}}} from the "# tokens/s CASE STRATEGY V"
    lines a replay log prints after each `wlb simulate` table (full precision)."""
    out = {}
    for title, body in log_sections(path):
        rows = {}
        for m in re.finditer(r"^# tokens/s (\S+) (\S+) ([0-9.e+]+)$", body, re.M):
            rows.setdefault(m.group(1), {})[m.group(2)] = float(m.group(3))
        out[title] = rows
    return out


WANDER = f"{CPU16}/step_wander/replay_step_wander.log"


@table("cpu16-rank-speed", "docs/performance.md", *(f"{CPU16}/logs/calibration-{d}.log" for d in CPU16_DECKS),
       f"{CPU16}/logs/run-run16_cp4_dp4-r1.log", f"{CPU16}/replay_calibration.log",
       f"{CPU16}/rank_speed/replay_rank_speed.log", WANDER)
def cpu16_rank_speed(root):
    before = sim_sections(root / f"{CPU16}/replay_calibration.log")
    spread = sim_sections(root / f"{CPU16}/rank_speed/replay_rank_speed.log")
    wander = sim_tokens(root / WANDER)
    out = []

    def row(label, st, meas, *pred):
        out.append([(label,), (st,), ("{:.2f}", meas)] +
                   [("{:.1f} ({:+.0f}%)", p, 100 * (p / meas - 1)) for p in pred])

    for d in CPU16_DECKS:
        b = section(before, d + ":")[d]
        a = section(spread, f"in-sample replay: {d}'s")[d]
        w = section(wander, f"in-sample replay: {d}'s")[d]
        for st, m in run_summary(root / f"{CPU16}/logs/calibration-{d}.log").items():
            row(f"`{d}` first run, in-sample", st, m["ktok"], b[st]["tput"] * 1e3, a[st]["tput"] * 1e3, w[st] / 1e3)
    r1 = run_summary(root / f"{CPU16}/logs/run-run16_cp4_dp4-r1.log")
    own = section(spread, "out of sample: run16_cp4_dp4 round 1 (data")["run16_cp4_dp4"]
    cp8 = section(spread, "out of sample: run16_cp4_dp4 round 1, the profile of run16_cp8")["run16_cp4_dp4"]
    cp8_0 = section(spread, "out of sample: the same without")["run16_cp4_dp4"]
    own_w = section(wander, "out of sample: run16_cp4_dp4 round 1 (data")["run16_cp4_dp4"]
    cp8_w = section(wander, "out of sample: run16_cp4_dp4 round 1, the profile of run16_cp8")["run16_cp4_dp4"]
    camp = {r[1][0]: r[4][1] for r in md_table(root / f"{CPU16}/campaign.md", "| deck | strategy", first_cells=2)}
    for st, m in r1.items():
        row("`run16_cp4_dp4` round 1, its first run's profile", st, m["ktok"], camp[st] / 1e3,
            own[st]["tput"] * 1e3, own_w[st] / 1e3)
    for st, m in r1.items():
        row("`run16_cp4_dp4` round 1, `run16_cp8_dp2`'s profile", st, m["ktok"], cp8_0[st]["tput"] * 1e3,
            cp8[st]["tput"] * 1e3, cp8_w[st] / 1e3)
    return out


@table("cpu16-speedups", "docs/performance.md", *(f"{CPU16}/logs/calibration-{d}.log" for d in CPU16_DECKS),
       f"{CPU16}/campaign.md", f"{CPU16}/replay_calibration.log", f"{CPU16}/rank_speed/replay_rank_speed.log", WANDER)
def cpu16_speedups(root):
    before = sim_sections(root / f"{CPU16}/replay_calibration.log")
    spread = sim_sections(root / f"{CPU16}/rank_speed/replay_rank_speed.log")
    wander = sim_tokens(root / WANDER)

    out = []
    for d in CPU16_DECKS:
        b = section(before, d + ":")[d]
        a = section(spread, f"in-sample replay: {d}'s")[d]
        w = section(wander, f"in-sample replay: {d}'s")[d]
        for st, m in run_summary(root / f"{CPU16}/logs/calibration-{d}.log").items():
            if st != "plain":
                out.append([(f"`{d}` first run, in-sample",), (st,), ("{:.3f}", m["x"]), ("{:.3f}", b[st]["x"]),
                            ("{:.3f}", a[st]["x"]), ("{:.3f}", w[st] / w["plain"])])
    camp = {r[1][0]: r for r in md_table(root / f"{CPU16}/campaign.md", "| deck | strategy", first_cells=2)}
    cp8_0 = section(spread, "out of sample: the same without")["run16_cp4_dp4"]
    cp8 = section(spread, "out of sample: run16_cp4_dp4 round 1, the profile of run16_cp8")["run16_cp4_dp4"]
    cp8_w = section(wander, "out of sample: run16_cp4_dp4 round 1, the profile of run16_cp8")["run16_cp4_dp4"]
    for st in ("fixed", "wlb"):
        out.append([("`run16_cp4_dp4` round 1, `run16_cp8_dp2`'s profile",), (st,), ("{:.3f}", camp[st][3][1]),
                    ("{:.3f}", cp8_0[st]["x"]), ("{:.3f}", cp8[st]["x"]), ("{:.3f}", cp8_w[st] / cp8_w["plain"])])
    return out


@table("cpu16-noise-cost", "docs/performance.md", f"{CPU16}/logs/run-run16_cp4_dp4-r1.log", WANDER)
def cpu16_noise_cost(root):
    wander = sim_tokens(root / WANDER)
    spread = wander["in-sample replay: run16_cp4_dp4 round 1, its own profile"]["run16_cp4_dp4"]
    mean = wander["in-sample replay: run16_cp4_dp4 round 1, its own profile at the mean speed"]["run16_cp4_dp4"]
    out = []
    for st, m in run_summary(root / f"{CPU16}/logs/run-run16_cp4_dp4-r1.log").items():
        out.append([(st,), ("{:.2f}", m["ktok"]), ("{:.2f}", mean[st] / 1e3), ("{:.2f}", spread[st] / 1e3),
                    ("{:.3f}", m["ktok"] * 1e3 / mean[st]), ("{:.3f}", spread[st] / mean[st])])
    return out


@table("cpu16-round1", "docs/performance.md", f"{CPU16}/campaign.md")
def cpu16_round1(root):
    return md_table(root / f"{CPU16}/campaign.md", "| deck | strategy", first_cells=2)


@table("cpu16-waits", "docs/performance.md", f"{CPU16}/sync_waits.log")
def cpu16_waits(root):
    text = (root / f"{CPU16}/sync_waits.log").read_text()
    out = []
    for sec in re.split(r"^== ", text, flags=re.M)[1:]:
        run = sec.split()[0].split("/")[-1]
        for m in re.finditer(r"^(\S+): \d+ steps measured, \d+ replayed; step span measured ([0-9.]+) s, replayed ([0-9.]+) s"
                             r"(?:(?!^\S).)*?CP-group skew \(slowest rank's compute / group mean, per micro-batch\): "
                             r"measured ([0-9.]+), replayed ([0-9.]+); ranks waiting for the slowest: ([0-9.]+) vs "
                             r"([0-9.]+) s", sec, re.M | re.S):
            st = m.group(1)
            if st not in ("plain", "wlb", "slimpack", "wlb+hybrid"):
                continue
            v = [float(x) for x in m.groups()[1:]]
            out.append([(f"`{run}`",), (st,), ("{:.3f} / {:.3f}", v[0], v[1]), ("{:.3f} / {:.3f}", v[2], v[3]),
                        ("{:.3f} / {:.3f}", v[4], v[5])])
    return out


def sci(values):
    """One cell of values in the docs' short scientific notation ("4.7e-9", "0"), joined by " / "."""
    fmts, vals = [], []
    for v in values:
        if v == 0:
            fmts.append("0")
            continue
        e = math.floor(math.log10(v))
        if round(v / 10 ** e, 1) >= 10:
            e += 1
        fmts.append("{:.1f}e" + str(e))
        vals.append(v / 10 ** e)
    return (" / ".join(fmts), *vals)


@table("train-equal-losses", "docs/training.md", "bench/results/cpu/train_equal_losses.log")
def train_equal_losses(root):
    text = (root / "bench/results/cpu/train_equal_losses.log").read_text()
    mpi = {m.group(1): float(m.group(2)) for m in
           re.finditer(r"(?:^|: )([a-z0-9= ]+): largest relative difference of a step's loss to one rank's: (\S+) ",
                       text, re.M)}
    cli = {m.group(1): float(m.group(2)) for m in
           re.finditer(r"(?:^|: )([A-Za-z0-9=() ]+?): \d+ steps, largest relative loss difference to one rank (\S+)$",
                       text, re.M)}
    flat = ["dp=2", "dp=1 cp=2", "tp=2", "dp=4", "dp=1 cp=4", "dp=2 cp=2", "tp=2 cp=2", "tp=2 dp=2"]
    pp = ["pp=2", "pp=4", "pp=2 tp=2", "pp=2 cp=2 gpipe"]
    deck = "`tests/cli/test_train.sh` deck (hidden 32, window 256)"
    return [[("`mpi_test_train` (hidden 16, 4 heads, 2 KV heads, 2 layers, window 128, 4 micro-batches per step): "
              "dp = 2, cp = 2, tp = 2, dp = 4, cp = 4, dp = 2 x cp = 2, tp = 2 x cp = 2, tp = 2 x dp = 2",), ("8",),
             (("≤ " + sci([max(mpi[k] for k in flat)])[0]), *sci([max(mpi[k] for k in flat)])[1:])],
            [("the same: pp = 2 / pp = 4 (4 layers) / pp = 2 x tp = 2 / pp = 2 x cp = 2 (GPipe)",), ("8",),
             sci([mpi[k] for k in pp])],
            [(deck + ": cp = 2 (`wlb` packer) / dp = 2 (`original`) / tp = 2 (2 KV heads) / pp = 2",), ("40",),
             sci([cli[k] for k in ("cp=2", "dp=2", "tp=2", "pp=2")])],
            [("the same deck: pp = 2 interleaved (2 chunks per stage) / pp = 2 PackFlow with slimpack plans / "
              "cp = 2 x pp = 2 PackFlow (slices under CP)",), ("12",),
             sci([cli[k] for k in ("pp=2 interleaved", "pp=2 packflow", "cp=2 pp=2 packflow (slices under CP)")])]]


from_log("convergence", "docs/convergence.md", "bench/results/cpu/convergence.log",
         lambda path: md_table(path, "| packing |"))


# --- checking -----------------------------------------------------------------------------

def cell_regex(fmt):
    parts = re.split(r"\{[^}]*\}", fmt)
    return re.compile("^" + NUM.join(re.escape(p) for p in parts) + "$")


def render_cell(cell):
    return cell[0].format(*cell[1:])


def doc_tables(text):
    """(line number, marker or None, rows) for every table of a markdown text."""
    lines, out, i, marker = text.splitlines(), [], 0, None
    while i < len(lines):
        m = MARK.match(lines[i])
        if m:
            marker = (i + 1, m.group(1))
        elif lines[i].startswith("|"):
            start = i
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            rows = [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])] for line in lines[start:i]]
            out.append((start + 1, marker, rows))
            marker = None
            continue
        elif lines[i].strip() and not lines[i].startswith("<!--"):
            marker = None
        i += 1
    return out


def compare(name, doc_rows, want):
    bad, n = [], 0
    body = doc_rows[2:]
    if len(body) != len(want):
        return [f"{name}: {len(body)} rows in the doc, {len(want)} from the raw log"], 0
    for k, (drow, wrow) in enumerate(zip(body, want)):
        if len(drow) != len(wrow):
            bad.append(f"{name} row {k + 1}: {len(drow)} cells in the doc, {len(wrow)} rebuilt")
            continue
        for j, (dcell, wcell) in enumerate(zip(drow, wrow)):
            shown = dcell.replace("**", "")
            m = cell_regex(wcell[0]).match(shown)
            if not m:
                bad.append(f"{name} row {k + 1} ({wrow[0][0]}) cell {j + 1}: '{dcell}' in the doc, "
                           f"'{render_cell(wcell)}' from the raw log")
                continue
            # the doc shows each figure to the places the table's format renders: a figure
            # cut shorter would pass a wider tolerance
            rendered = cell_regex(wcell[0]).match(render_cell(wcell))
            for s, v, r in zip(m.groups(), wcell[1:], rendered.groups() if rendered else m.groups()):
                d = float(s.replace("−", "-"))
                places = len(s.split(".")[1]) if "." in s else 0
                if places < (len(r.split(".")[1]) if "." in r else 0):
                    bad.append(f"{name} row {k + 1} ({wrow[0][0]}) cell {j + 1}: {s} in the doc, rendered {r} "
                               f"(fewer places than the table's format)")
                tol = 0.5 * 10 ** -places + 1e-9 * max(1.0, abs(v))
                n += 1
                if abs(d - v) > tol:
                    bad.append(f"{name} row {k + 1} ({wrow[0][0]}) cell {j + 1}: {s} in the doc, {v} in the raw log "
                               f"(tolerance {tol:.2g})")
    return bad, n


def check(root, allow_unmarked=False):
    bad, seen, unmarked = [], set(), 0
    covered = {str(p.relative_to(root)) for p in root.glob(COVERED)} - NOT_COVERED
    for docname in sorted({t[0] for t in TABLES.values()} | covered):
        text = (root / docname).read_text()
        for line, marker, rows in doc_tables(text):
            has_digit = any(re.search(r"[0-9]", c) for r in rows[2:] for c in r)
            if marker is None:
                if has_digit and docname in covered:
                    unmarked += 1
                    msg = f"{docname}:{line}: a table with figures and no '<!-- figures: ... -->' marker"
                    (print if allow_unmarked else bad.append)(("UNMARKED " if allow_unmarked else "") + msg)
                continue
            what = marker[1]
            if what.startswith("none") or what.startswith("bench/"):
                if what.startswith("bench/") and not (root / what.split()[0]).exists():
                    bad.append(f"{docname}:{marker[0]}: checker {what} does not exist")
                continue
            if what not in TABLES:
                bad.append(f"{docname}:{marker[0]}: no table named '{what}' in bench/figures.py")
                continue
            seen.add(what)
            tdoc, logs, render = TABLES[what]
            missing = [lg for lg in logs if not (root / lg).exists()]
            if missing:
                bad.append(f"{what}: raw log {', '.join(missing)} missing")
                continue
            raw = [lg for lg in logs if not lg.endswith(".xz") and not lg.startswith("inputs/")]
            prov = [provenance(root / lg) for lg in raw]
            for lg, (commit, clock) in zip(raw, prov):
                if commit is None or clock is None:
                    bad.append(f"{what}: {lg} does not name the {'commit' if commit is None else 'clocks'} it ran at")
            errs, n = compare(what, rows, render(root))
            bad += errs
            print(f"{what} ({docname}:{line}): {len(rows) - 2} rows, {n} figures against {', '.join(logs)} "
                  f"(commit {', '.join(sorted({c or '?' for c, _ in prov}))}): {'PASS' if not errs else 'FAIL'}")
    for name in sorted(set(TABLES) - seen):
        bad.append(f"{name}: registered but no doc table carries its marker")
    bad += machine_paths(root)
    for b in bad:
        print("MISMATCH", b)
    print(f"tolerance: half a unit in the last digit each figure shows (the table's rounding); "
          f"{len(seen)} tables checked: {'PASS' if not bad else 'FAIL'}")
    return 1 if bad else 0


MACHINE_PATH = re.compile(r"(^|[^\w$.])/(tmp|home|root|work)/")


def h5_strings(path):
    """(where, text) of every string attribute of an HDF5 file (a trace's /meta holds the
    command line and the deck it ran)."""
    import h5py  # only here: the tables need no HDF5
    out = []

    def visit(name, obj):
        for k, v in obj.attrs.items():
            if isinstance(v, bytes):
                v = v.decode("utf-8", "replace")
            if isinstance(v, str):
                out.append((f"{name}@{k}", v))

    with h5py.File(path, "r") as f:
        visit("/", f)
        f.visititems(visit)
    return out


def machine_paths(root):
    """Raw logs speak of the project: paths under the repository relative to it, scratch
    files as $TMPDIR/... (bench/record.py writes them so), no home or work folder of the
    machine a figure was measured on. Compressed logs are read decompressed, HDF5 traces by
    their string attributes."""
    import gzip
    import lzma
    bad = []
    for p in sorted((root / "bench" / "results").rglob("*")):
        if not p.is_file() or p.suffix == ".png":
            continue
        if p.suffix == ".h5":
            for where, text in h5_strings(p):
                line = next((x for x in text.splitlines() if MACHINE_PATH.search(x)), None)
                if line is not None:
                    bad.append(f"{p.relative_to(root)}: {where}: a path of the machine it ran on: {line.strip()[:80]}")
                    break
            continue
        try:
            opener = {".xz": lzma.open, ".gz": gzip.open}.get(p.suffix)
            text = opener(p, "rt").read() if opener else p.read_text()
        except (UnicodeDecodeError, OSError, EOFError, lzma.LZMAError):
            continue
        for k, line in enumerate(text.splitlines(), 1):
            if MACHINE_PATH.search(line):
                bad.append(f"{p.relative_to(root)}:{k}: a path of the machine it ran on: {line.strip()[:80]}")
                break
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=".", type=pathlib.Path, help="the repository")
    ap.add_argument("--render", metavar="NAME", help="print the table NAME rebuilt from its raw log")
    ap.add_argument("--allow-unmarked", action="store_true", help="list tables without a marker, do not fail")
    a = ap.parse_args()
    if a.render:
        if a.render not in TABLES:
            sys.exit(f"figures.py: no table named '{a.render}' (have: {', '.join(sorted(TABLES))})")
        for row in TABLES[a.render][2](a.root):
            print("| " + " | ".join(render_cell(c) for c in row) + " |")
        return 0
    return check(a.root, a.allow_unmarked)


if __name__ == "__main__":
    sys.exit(main())

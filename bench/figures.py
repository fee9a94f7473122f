#!/usr/bin/env python3
"""The tables of docs/ against their committed raw logs (bench/results/).

A table in a doc is tied to its raw log by a marker on a line of its own above it:

    <!-- figures: NAME -->            NAME is a table below; its rows are rebuilt from the log
    <!-- figures: bench/check_X.py --> a table with a checker of its own (run beside this one)
    <!-- figures: none, REASON -->    a table with no measured or predicted figure in it

For every NAME table the doc's rows must equal the rows rebuilt from the raw log: the same
labels, and every number within half a unit of its last digit shown (the table's
rounding). Every raw log must name the commit and the clocks it ran at (bench/record.py
writes both). Every table in the docs listed in COVERED holding a digit must carry a
marker.

    /usr/bin/python3 bench/figures.py [--root .]          check; exit 1 on any mismatch
    /usr/bin/python3 bench/figures.py --render NAME       print NAME's table from its log
"""
import argparse
import csv
import io
import pathlib
import re
import statistics
import sys

MARK = re.compile(r"^<!-- figures: (.+?) -->\s*$")
NUM = r"([+−-]?[0-9]+(?:\.[0-9]+)?)"
COVERED = ["docs/performance.md"]
TABLES = {}


def table(name, doc, *logs):
    """Registers a renderer: f(root) -> rows, each a list of cells (fmt, values...)."""
    def wrap(f):
        TABLES[name] = (doc, logs, f)
        return f
    return wrap


def log_body(path):
    """The command's output: the log without record.py's header and trailer lines."""
    return [line for line in path.read_text().splitlines() if not line.startswith("# ")]


def provenance(path):
    """(commit, clocks) from the log's header, or for logs older than bench/record.py from
    the line naming the file in the README.md beside it."""
    text = path.read_text()
    commit = re.search(r"^# commit (\S+)", text, re.M)
    clock = re.search(r"^# clocks[^:]*: (.+)$", text, re.M)
    if commit is None and (path.parent / "README.md").exists():
        line = re.search(rf"^- `{re.escape(path.name)}`: commit (\w+); clocks: (.+)$",
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
    for r in columns(log_body(path), "strategy", 10):
        strat, comm = r[0], r[1]
        label = "allgather (baseline)" if (strat, comm) == ("per_document", "allgather") else comm
        out.append([(strat,), (label,), ("{:.4f} / {:.4f}", float(r[2]), float(r[3])), ("{:.3f}", float(r[4])),
                    ("{:.2f}", float(r[5])), ("{:.3f}", float(r[6])), ("{:.4f}", float(r[7])), ("{:.3f}", float(r[8]))])
    return out


@table("shard-long-context", "docs/performance.md", "bench/results/cpu/shard_long_context.log")
def shard_long_context(root):
    return shard_rows(root / "bench/results/cpu/shard_long_context.log")


@table("shard-long-context-2gbps", "docs/performance.md", "bench/results/cpu/shard_long_context_2gbps.log")
def shard_long_context_2gbps(root):
    return shard_rows(root / "bench/results/cpu/shard_long_context_2gbps.log")


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


def bench_attention(root):
    """{(seq, D, bwd): [useful GFLOP/s per run]} and the FMA peaks of the runs."""
    cells, peaks = {}, []
    for lg in ATTN_RUNS:
        text = (root / lg).read_text()
        peaks.append(float(re.search(r"^BM_FmaPeak .* GFLOPs=([0-9.]+)/s", text, re.M).group(1)))
        for m in re.finditer(r"^BM_Attention/seq:(\d)/D:(\d+)/bwd:(\d)\S* .* useful_GFLOPs=([0-9.]+)/s", text, re.M):
            cells.setdefault((int(m.group(1)), int(m.group(2)), int(m.group(3))), []).append(float(m.group(4)))
    return cells, peaks


@table("attention-cpu", "docs/performance.md", *ATTN_RUNS)
def attention_cpu(root):
    cells, _ = bench_attention(root)
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


@table("attention-cpu-peak", "docs/performance.md", *ATTN_RUNS)
def attention_cpu_peak(root):
    cells, peaks = bench_attention(root)
    best = max(peaks)
    rows = [[("`BM_FmaPeak`",), ("{:.1f} ({:.1f}–{:.1f})", best, min(peaks), max(peaks)), ("100 %",)]]
    for label, keys in (("forward, one document", [(0, 64, 0), (0, 128, 0)]),
                        ("forward, skewed packs", [(1, 64, 0), (1, 128, 0)]),
                        ("forward + backward", [(s, d, 1) for s in (0, 1) for d in (64, 128)])):
        v = [max(cells[k]) for k in keys]
        rows.append([(label,), ("{:.1f}–{:.1f}", min(v), max(v)), ("{:.0f}–{:.0f} %", 100 * min(v) / best, 100 * max(v) / best)])
    return rows


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
    torch = {(r["case"], r["kernel"]): r for r in json.loads((root / H100 / "attention_torch.json").read_text())["results"]}
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
            rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[start:i]]
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
            for s, v in zip(m.groups(), wcell[1:]):
                d = float(s.replace("−", "-"))
                places = len(s.split(".")[1]) if "." in s else 0
                tol = 0.5 * 10 ** -places + 1e-9 * max(1.0, abs(v))
                n += 1
                if abs(d - v) > tol:
                    bad.append(f"{name} row {k + 1} ({wrow[0][0]}) cell {j + 1}: {s} in the doc, {v} in the raw log "
                               f"(tolerance {tol:.2g})")
    return bad, n


def check(root, allow_unmarked=False):
    bad, seen, unmarked = [], set(), 0
    for docname in sorted({t[0] for t in TABLES.values()} | set(COVERED)):
        text = (root / docname).read_text()
        for line, marker, rows in doc_tables(text):
            has_digit = any(re.search(r"[0-9]", c) for r in rows[2:] for c in r)
            if marker is None:
                if has_digit and docname in COVERED:
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
            prov = [provenance(root / lg) for lg in logs if not lg.endswith(".xz")]
            for lg, (commit, clock) in zip([lg for lg in logs if not lg.endswith(".xz")], prov):
                if commit is None or clock is None:
                    bad.append(f"{what}: {lg} does not name the {'commit' if commit is None else 'clocks'} it ran at")
            errs, n = compare(what, rows, render(root))
            bad += errs
            print(f"{what} ({docname}:{line}): {len(rows) - 2} rows, {n} figures against {', '.join(logs)} "
                  f"(commit {', '.join(sorted({c or '?' for c, _ in prov}))}): {'PASS' if not errs else 'FAIL'}")
    for name in sorted(set(TABLES) - seen):
        bad.append(f"{name}: registered but no doc table carries its marker")
    for b in bad:
        print("MISMATCH", b)
    print(f"tolerance: half a unit in the last digit each figure shows (the table's rounding); "
          f"{len(seen)} tables checked: {'PASS' if not bad else 'FAIL'}")
    return 1 if bad else 0


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

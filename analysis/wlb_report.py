#!/usr/bin/python3
"""wlb_report — imbalance report and plots of wlb trace files.

Usage:
  /usr/bin/python3 analysis/wlb_report.py RUN.h5 [--compare RUN2.h5 ...] --out DIR
        [--baseline STRATEGY] [--gantt-steps N] [--quiet]

Writes DIR/summary.txt, DIR/steps.csv and PNGs (latency_scatter.png, gantt_*_step*.png,
mb_workload_latency.png, doc_lengths.png, speedup.png) and prints the summary.
Exit codes: 0 ok, 2 bad input (missing/incomplete/damaged trace, bad arguments).
Definitions of every number: docs/analysis.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from wlb_trace import TraceError, load  # noqa: E402

EXIT_BAD_INPUT = 2


def _fmt_ms(ns):
    return "-" if ns is None or (isinstance(ns, float) and math.isnan(ns)) else f"{ns / 1e6:.3f}"


def _fmt_x(v):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"


def _table(headers, rows):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]
    line = "  ".join(str(h).rjust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    for r in rows:
        out.append("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))
    return "\n".join(out)


def analyse(trace):
    """strategy name -> list of per-step metrics."""
    from wlb_metrics import step_metrics

    return {s: step_metrics(trace, i) for i, s in enumerate(trace.strategies)}


def report(paths, out_dir, baseline=None, gantt_steps=2, quiet=False):
    from wlb_metrics import fold_to, step_work, summarize, throughput_speedup
    import wlb_plots

    traces = [load(p) for p in paths]  # TraceError before any output is written
    os.makedirs(out_dir, exist_ok=True)
    lines = []
    csv = ["file,source,strategy,step,step_time_ms,imbalance,imbalance_fwd,imbalance_bwd,"
           "cp_imbalance_mean,cp_imbalance_max,busy_mean_ms,idle_max_ms,micro_batches"]
    speed_rows = []  # (label, mean step time, None)
    all_metrics = []
    for ti, tr in enumerate(traces):
        metrics = analyse(tr)
        all_metrics.append(metrics)
        mesh = tr.mesh
        lines.append("=" * 78)
        lines.append(f"{tr.path}  [{tr.source}]")
        lines.append(f"  mesh tp={mesh['tp']} cp={mesh['cp']} pp={mesh['pp']} dp={mesh['dp']}"
                     f"  ranks={len(tr.ranks['rank'])}  mpi_size={tr.meta.get('mpi_size', '?')}"
                     f"  events={len(tr.events['rank'])}")
        lines.append(f"  git {tr.meta.get('git_hash', '?')}  kokkos {tr.meta.get('kokkos_version', '?')}"
                     f" ({tr.meta.get('kokkos_backend', '?')})  started {tr.meta.get('start_time', '?')}"
                     f"  warmup steps={tr.warmup}")
        for sname, steps in metrics.items():
            lines.append("")
            lines.append(f"  strategy {sname}")
            if not steps:
                lines.append("    (no events with step >= 0)")
                continue
            rows = []
            for s in steps:
                pres = s["present"]
                busy = s["busy_ns"][pres]
                idle = s["idle_ns"][pres]
                busy_mean = float(busy.mean()) if busy.size else float("nan")
                idle_max = float(idle.max()) if idle.size else float("nan")
                busy_pct = 100.0 * busy_mean / s["step_time_ns"] if s["step_time_ns"] > 0 else float("nan")
                rows.append([s["step"] if s["step"] >= tr.warmup else f"{s['step']}w",
                             _fmt_ms(s["step_time_ns"]), _fmt_x(s["imbalance"]), _fmt_x(s["imbalance_fwd"]),
                             _fmt_x(s["imbalance_bwd"]), _fmt_x(s["cp_imbalance_mean"]),
                             _fmt_x(s["cp_imbalance_max"]), f"{busy_pct:.1f}", _fmt_ms(idle_max),
                             s["micro_batches"]])
                csv.append(",".join(str(x) for x in [
                    os.path.basename(tr.path), tr.source, sname, s["step"], s["step_time_ns"] / 1e6,
                    s["imbalance"], s["imbalance_fwd"], s["imbalance_bwd"], s["cp_imbalance_mean"],
                    s["cp_imbalance_max"], busy_mean / 1e6, idle_max / 1e6, s["micro_batches"]]))
            table = _table(["step", "time_ms", "imb", "imb_fwd", "imb_bwd", "cp_imb", "cp_max",
                            "busy%", "idle_max_ms", "mbs"], rows)
            lines.extend("    " + l for l in table.splitlines())
            summ = summarize(tr, tr.strategy_id(sname), steps)
            lines.append(f"    mean over {summ['steps']} step(s): time {_fmt_ms(summ['step_time_ns'])} ms, "
                         f"imbalance {_fmt_x(summ['imbalance'])}, CP imbalance {_fmt_x(summ['cp_imbalance'])}, "
                         f"busy {100 * summ['busy_frac']:.1f}%")
            # Per-rank busy/idle over the counted steps.
            use = [s for s in steps if s["step"] >= tr.warmup] or steps
            coords = tr.coords()
            rank_rows = []
            for r in range(len(coords["dp"])):
                b = [s["busy_ns"][r] for s in use if s["present"][r]]
                i_ = [s["idle_ns"][r] for s in use if s["present"][r]]
                if b:
                    rank_rows.append([r, f"tp{coords['tp'][r]} cp{coords['cp'][r]} pp{coords['pp'][r]} dp{coords['dp'][r]}",
                                      _fmt_ms(sum(b) / len(b)), _fmt_ms(sum(i_) / len(i_))])
            if rank_rows and len(rank_rows) <= 16:
                lines.append("    per rank (mean over counted steps):")
                lines.extend("      " + l for l in _table(["rank", "coords", "busy_ms", "idle_ms"], rank_rows).splitlines())
            elif rank_rows:
                lines.append(f"    per rank: {len(rank_rows)} ranks (see steps.csv for step totals)")
            label = f"{sname}" if len(traces) == 1 else f"{sname} [{tr.source}:{os.path.basename(tr.path)}]"
            speed_rows.append((label, summ["step_time_ns"], sname, ti, step_work(tr, tr.strategy_id(sname), steps)))

    # Speedup relative to the baseline: --baseline, else "plain", else the first strategy.
    base = None
    for row in speed_rows:
        if baseline is not None and row[2] == baseline and row[3] == 0:
            base = row
            break
    if base is None and baseline is not None:
        raise TraceError(f"--baseline {baseline}: no such strategy in {traces[0].path} "
                         f"(have: {', '.join(traces[0].strategies)})")
    if base is None:
        base = next((r for r in speed_rows if r[2] == "plain" and r[3] == 0), speed_rows[0] if speed_rows else None)
    bars = []
    lines.append("")
    lines.append("=" * 78)
    if base is not None and base[1] and not math.isnan(base[1]):
        # Throughput over the same documents: trained tokens / time after warm-up, drain
        # steps included (each strategy ends having trained what it deferred); records
        # beyond the shortest strategy's are folded into its last, so steps pair.
        n = min(len(r[4]) for r in speed_rows)
        have_tokens = all(not math.isnan(w[2]) for r in speed_rows for w in r[4])
        if have_tokens:
            lines.append(f"Speedup vs {base[0]}: throughput (trained tokens/s after warm-up, drain steps included), "
                         "95% paired bootstrap interval over steps; step-x = mean step-time ratio (flatters deferral):")
        else:
            lines.append(f"Speedup vs {base[0]} (mean step time after warm-up; the trace has no /plan/segments, "
                         "so no token throughput):")
        ordered = [base] + [r for r in speed_rows if r is not base]
        for label, t, _s, _ti, work in ordered:
            step_x = base[1] / t if t and not math.isnan(t) else float("nan")
            if have_tokens:
                sp, lo, hi = throughput_speedup(fold_to(base[4], n), fold_to(work, n))
                tot_t = sum(w[1] for w in work) / 1e9
                tok_s = sum(w[2] for w in work) / tot_t if tot_t > 0 else float("nan")
                bars.append((label, t, sp, lo, hi))
                lines.append(f"  {label:<40s} {tok_s / 1e3:10.2f} ktok/s   {sp:6.3f}x [{lo:.3f}-{hi:.3f}]   "
                             f"step-x {step_x:5.2f}x   {_fmt_ms(t):>10s} ms/step")
            else:
                bars.append((label, t, step_x, step_x, step_x))
                lines.append(f"  {label:<40s} {_fmt_ms(t):>12s} ms   {step_x:6.3f}x")

    pngs = []
    notes = []
    main, mmetrics = traces[0], all_metrics[0]
    p = wlb_plots.latency_scatter(main, mmetrics, out_dir)
    pngs.append(p) if p else notes.append("latency scatter: no per-rank work events")
    for sname, steps in mmetrics.items():
        counted = [s["step"] for s in steps if s["step"] >= main.warmup] or [s["step"] for s in steps]
        for st in counted[:gantt_steps]:
            p = wlb_plots.gantt(main, main.strategy_id(sname), st, out_dir)
            if p:
                pngs.append(p)
    p = wlb_plots.workload_vs_latency(main, mmetrics, out_dir)
    pngs.append(p) if p else notes.append("workload vs latency: no micro-batch events")
    p = wlb_plots.doc_length_cdf(main, out_dir)
    pngs.append(p) if p else notes.append("document lengths: the trace has no /plan/segments")
    p = wlb_plots.speedup_bars(bars, out_dir)
    pngs.append(p) if p else notes.append("speedup: no step times")

    lines.append("")
    lines.append("Plots:")
    lines.extend(f"  {p}" for p in pngs)
    lines.extend(f"  (skipped {n})" for n in notes)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "summary.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "steps.csv"), "w") as f:
        f.write("\n".join(csv) + "\n")
    if not quiet:
        sys.stdout.write(text)
        sys.stdout.write(f"Summary: {os.path.join(out_dir, 'summary.txt')}\n"
                         f"Table:   {os.path.join(out_dir, 'steps.csv')}\n")
    return text, pngs


def main(argv=None):
    ap = argparse.ArgumentParser(prog="wlb_report.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="trace file (HDF5) written by wlb")
    ap.add_argument("--compare", nargs="+", default=[], metavar="RUN2.h5",
                    help="more trace files (other runs, or simulated vs measured)")
    ap.add_argument("--out", required=True, help="output directory for PNGs, summary.txt, steps.csv")
    ap.add_argument("--baseline", default=None, help="strategy of RUN.h5 used as speedup baseline "
                    "(default: 'plain' if present, else the first)")
    ap.add_argument("--gantt-steps", type=int, default=2, help="timelines per strategy (default 2)")
    ap.add_argument("--quiet", action="store_true", help="do not print the summary")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return EXIT_BAD_INPUT if e.code not in (0, None) else 0
    try:
        report([args.run] + args.compare, args.out, args.baseline, args.gantt_steps, args.quiet)
    except TraceError as e:
        sys.stderr.write(f"wlb_report: error: {e}\n")
        return EXIT_BAD_INPUT
    except OSError as e:  # --out under a file, unwritable, disk full: the user's paths
        where = f" '{e.filename}'" if getattr(e, "filename", None) else ""
        sys.stderr.write(f"wlb_report: error: cannot write{where}: {e.strerror or e}\n")
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())

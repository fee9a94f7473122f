#!/usr/bin/python3
"""wlb_report — imbalance report and plots of wlb trace files.

Usage:
  /usr/bin/python3 analysis/wlb_report.py RUN.h5 [--compare RUN2.h5 ...] --out DIR
        [--baseline STRATEGY] [--gantt-steps N] [--quiet]

Writes DIR/summary.txt, DIR/steps.csv and PNGs (imbalance.png, gantt_*_step*.png,
mb_workload_latency.png, doc_lengths.png, speedup.png; with --compare the per-run plots
are prefixed run<i>_<source>_) and prints the summary. Steps are the trace's 0-based
indices; warm-up steps are skipped everywhere. Speedups are within each run.
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


def resolve_baseline(trace, baseline):
    """The strategy of this run its speedups are over: --baseline, else plain, else the first."""
    if baseline is not None:
        if baseline not in trace.strategies:
            raise TraceError(f"--baseline {baseline}: no such strategy in {trace.path} "
                             f"(have: {', '.join(trace.strategies)})")
        return baseline
    return "plain" if "plain" in trace.strategies else (trace.strategies[0] if trace.strategies else None)


def run_speedups(trace, metrics, baseline):
    """Speedups of every strategy of one run over its own baseline strategy.

    Returns (metric name, [dict strategy, speedup, lo, hi, tok_s, step_x, step_time_ns]).
    Throughput over the same documents: trained tokens / time after warm-up, drain steps
    included (each strategy ends having trained what it deferred) and folded into its last
    measured step, so steps pair (model::foldDrain). A trace without
    /plan/segments falls back to the mean step-time ratio."""
    from wlb_metrics import fold_drain, fold_to, step_work, summarize, throughput_speedup

    work = {s: step_work(trace, trace.strategy_id(s), steps) for s, steps in metrics.items() if steps}
    # each strategy's drain folded into its last measured step, so the steps pair
    paired = {s: fold_drain(trace, w) for s, w in work.items()}
    n = min((len(w) for w in paired.values()), default=0)
    paired = {s: fold_to(w, n) for s, w in paired.items()}
    summ = {s: summarize(trace, trace.strategy_id(s), steps) for s, steps in metrics.items() if steps}
    if baseline not in work or not work:
        return None, []
    base_t = summ[baseline]["step_time_ns"]
    have_tokens = all(not math.isnan(w[2]) for ws in work.values() for w in ws)
    out = []
    for s in [baseline] + [x for x in work if x != baseline]:
        t = summ[s]["step_time_ns"]
        step_x = base_t / t if t and not math.isnan(t) else float("nan")
        row = {"strategy": s, "step_x": step_x, "step_time_ns": t, "tok_s": float("nan")}
        if have_tokens:
            row["speedup"], row["lo"], row["hi"] = throughput_speedup(paired[baseline], paired[s])
            tot_t = sum(w[1] for w in work[s]) / 1e9
            row["tok_s"] = sum(w[2] for w in work[s]) / tot_t if tot_t > 0 else float("nan")
        else:
            row["speedup"] = row["lo"] = row["hi"] = step_x
        out.append(row)
    return ("throughput" if have_tokens else "step-time"), out


def run_label(ti, traces):
    """'run1: dp2/trace.h5 (dp=2)': the parent folder where file names repeat, and the mesh."""
    tr = traces[ti]
    name = tr.name
    if sum(t.name == name for t in traces) > 1:
        name = os.path.join(os.path.basename(os.path.dirname(os.path.abspath(tr.path))), name)
    dims = " ".join(f"{k}={v}" for k, v in tr.mesh.items() if v > 1)
    return (f"run{ti}: " if len(traces) > 1 else "") + name + (f" ({dims})" if dims else "")


def report(paths, out_dir, baseline=None, gantt_steps=2, quiet=False):
    import numpy as np
    from wlb_metrics import counted_steps, micropack_latencies, step_kind, summarize
    import wlb_plots

    traces = [load(p) for p in paths]  # TraceError before any output is written
    baselines = [resolve_baseline(tr, baseline) for tr in traces]
    os.makedirs(out_dir, exist_ok=True)
    multi = len(traces) > 1
    lines = []
    csv = ["run,file,source,strategy,step,kind,step_time_ms,imbalance,imbalance_fwd,imbalance_bwd,"
           "cp_imbalance_mean,cp_imbalance_max,busy_mean_ms,idle_max_ms,micro_batches"]
    all_metrics, speed = [], []  # speed: (run index, metric, rows)
    colours = wlb_plots.strategy_colours(s for tr in traces for s in tr.strategies)
    for ti, tr in enumerate(traces):
        metrics = analyse(tr)
        all_metrics.append(metrics)
        mesh = tr.mesh
        lines.append("=" * 78)
        lines.append(f"run {ti}: {tr.path}  [{tr.source}]")
        lines.append(f"  mesh tp={mesh['tp']} cp={mesh['cp']} pp={mesh['pp']} dp={mesh['dp']}"
                     f"  ranks={len(tr.ranks['rank'])}  mpi_size={tr.meta.get('mpi_size', '?')}"
                     f"  events={len(tr.events['rank'])}")
        lines.append(f"  git {tr.meta.get('git_hash', '?')}  kokkos {tr.meta.get('kokkos_version', '?')}"
                     f" ({tr.meta.get('kokkos_backend', '?')})  started {tr.meta.get('start_time', '?')}")
        ms = tr.meta.get("measured_steps")
        lines.append(f"  steps: the trace's 0-based index; warm-up steps 0-{tr.warmup - 1} skipped"
                     if tr.warmup > 0 else "  steps: the trace's 0-based index; no warm-up")
        if ms is not None:
            lines.append(f"  measured: steps {tr.warmup}-{tr.warmup + int(ms) - 1}; later steps are drain "
                         "(no new documents; counted in throughput, not in the means)")
        for sname, steps in metrics.items():
            lines.append("")
            lines.append(f"  strategy {sname}")
            if not steps:
                lines.append("    (no events with step >= 0)")
                continue
            rows = []
            for s in counted_steps(tr, steps):
                pres = s["present"]
                busy = s["busy_ns"][pres]
                idle = s["idle_ns"][pres]
                busy_mean = float(busy.mean()) if busy.size else float("nan")
                idle_max = float(idle.max()) if idle.size else float("nan")
                busy_pct = 100.0 * busy_mean / s["step_time_ns"] if s["step_time_ns"] > 0 else float("nan")
                kind = step_kind(tr, s["step"])
                rows.append([s["step"], kind,
                             _fmt_ms(s["step_time_ns"]), _fmt_x(s["imbalance"]), _fmt_x(s["imbalance_fwd"]),
                             _fmt_x(s["imbalance_bwd"]), _fmt_x(s["cp_imbalance_mean"]),
                             _fmt_x(s["cp_imbalance_max"]), f"{busy_pct:.1f}", _fmt_ms(idle_max),
                             s["micro_batches"]])
                csv.append(",".join(str(x) for x in [
                    ti, os.path.basename(tr.path), tr.source, sname, s["step"], kind, s["step_time_ns"] / 1e6,
                    s["imbalance"], s["imbalance_fwd"], s["imbalance_bwd"], s["cp_imbalance_mean"],
                    s["cp_imbalance_max"], busy_mean / 1e6, idle_max / 1e6, s["micro_batches"]]))
            table = _table(["step", "kind", "time_ms", "imb", "imb_fwd", "imb_bwd", "cp_imb", "cp_max",
                            "busy%", "idle_max_ms", "mbs"], rows)
            lines.extend("    " + l for l in table.splitlines())
            summ = summarize(tr, tr.strategy_id(sname), steps)
            lines.append(f"    mean over {summ['steps']} measured step(s): time {_fmt_ms(summ['step_time_ns'])} ms, "
                         f"imbalance {_fmt_x(summ['imbalance'])}, CP imbalance {_fmt_x(summ['cp_imbalance'])}, "
                         f"busy {100 * summ['busy_frac']:.1f}%")
            mp = micropack_latencies(tr, steps, tr.strategy_id(sname))
            for ph, word in (("fwd", "forward"), ("bwd", "backward")):
                d = mp[ph]
                if d["ms"]:
                    lines.append(f"    {word} unit latency: {len(d['ms'])} unit(s), mean {np.mean(d['ms']):.2f} ms, "
                                 f"min {np.min(d['ms']):.2f}, max {np.max(d['ms']):.2f}; over the step mean: "
                                 f"max {d['max_over_mean']:.2f}, CV {d['cv']:.2f}")
            # Per-rank busy/idle over the measured steps.
            use = counted_steps(tr, steps, drain=False)
            coords = tr.coords()
            rank_rows = []
            for r in range(len(coords["dp"])):
                b = [s["busy_ns"][r] for s in use if s["present"][r]]
                i_ = [s["idle_ns"][r] for s in use if s["present"][r]]
                if b:
                    rank_rows.append([r, f"tp{coords['tp'][r]} cp{coords['cp'][r]} pp{coords['pp'][r]} dp{coords['dp'][r]}",
                                      _fmt_ms(sum(b) / len(b)), _fmt_ms(sum(i_) / len(i_))])
            if rank_rows and len(rank_rows) <= 16:
                lines.append("    per rank (mean over measured steps):")
                lines.extend("      " + l for l in _table(["rank", "coords", "busy_ms", "idle_ms"], rank_rows).splitlines())
            elif rank_rows:
                lines.append(f"    per rank: {len(rank_rows)} ranks (see steps.csv for step totals)")

        # Speedups within this run, over its own baseline.
        metric, rows = run_speedups(tr, metrics, baselines[ti])
        speed.append((ti, metric, rows))
        lines.append("")
        if not rows:
            lines.append("  speedup: no step times")
            continue
        if metric == "throughput":
            lines.append(f"  Speedup vs {baselines[ti]} of this run: throughput (trained tokens/s after warm-up, "
                         "drain steps included), 95% paired bootstrap interval over steps; "
                         "step-x = mean step-time ratio (flatters deferral):")
        else:
            lines.append(f"  Speedup vs {baselines[ti]} of this run (mean step time after warm-up; the trace has "
                         "no /plan/segments, so no token throughput):")
        for r in rows:
            if metric == "throughput":
                lines.append(f"    {r['strategy']:<16s} {r['tok_s'] / 1e3:10.2f} ktok/s   {r['speedup']:6.3f}x "
                             f"[{r['lo']:.3f}-{r['hi']:.3f}]   step-x {r['step_x']:5.2f}x   "
                             f"{_fmt_ms(r['step_time_ns']):>10s} ms/step")
            else:
                lines.append(f"    {r['strategy']:<16s} {_fmt_ms(r['step_time_ns']):>12s} ms   {r['speedup']:6.3f}x")

    # Measured next to simulated: each speedup stays within its own run; no cross-run ratio.
    sources = {tr.source for tr in traces}
    if multi and len(sources) > 1:
        lines.append("")
        lines.append("=" * 78)
        lines.append("Speedups side by side (each over its own run's baseline; runs are never divided by each other):")
        strats = list(dict.fromkeys(r["strategy"] for _ti, _m, rows in speed for r in rows))
        hdr = ["strategy"] + [f"run{ti} {traces[ti].source}" for ti, _m, _r in speed]
        trows = []
        for st in strats:
            cells = [st]
            for _ti, _m, rows in speed:
                r = next((x for x in rows if x["strategy"] == st), None)
                cells.append(f"{r['speedup']:.3f}x [{r['lo']:.2f}-{r['hi']:.2f}]" if r else "-")
            trows.append(cells)
        lines.extend("  " + l for l in _table(hdr, trows).splitlines())

    pngs = []
    notes = []
    for ti, (tr, metrics) in enumerate(zip(traces, all_metrics)):
        prefix = f"run{ti}_{tr.source}_" if multi else ""
        who = f"run {ti} ({tr.source}): " if multi else ""
        p, why = wlb_plots.imbalance_plot(tr, metrics, out_dir, prefix, colours)
        pngs.append(p) if p else None
        notes.extend(f"{who}imbalance: {w}" for w in why)
        for sname, steps in metrics.items():
            for s in counted_steps(tr, steps)[:gantt_steps]:
                p = wlb_plots.gantt(tr, tr.strategy_id(sname), s["step"], out_dir, prefix)
                if p:
                    pngs.append(p)
        p = wlb_plots.micropack_violins(tr, metrics, out_dir, prefix, colours)
        pngs.append(p) if p else notes.append(f"{who}unit latency violins: fewer than two units per strategy")
        p = wlb_plots.workload_vs_latency(tr, metrics, out_dir, prefix, colours)
        pngs.append(p) if p else notes.append(f"{who}workload vs latency: no micro-batch events")
    p = wlb_plots.doc_length_cdf(traces[0], out_dir)
    pngs.append(p) if p else notes.append("document lengths: the trace has no /plan/segments")
    bars = [{"run": run_label(ti, traces), "source": traces[ti].source, "baseline": baselines[ti],
             "metric": m, **{k: r[k] for k in ("strategy", "speedup", "lo", "hi")}}
            for ti, m, rows in speed for r in rows]
    p = wlb_plots.speedup_bars(bars, out_dir, colours)
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
    ap.add_argument("--baseline", default=None, help="strategy each run's speedups are over; every run "
                    "must have it (default: 'plain' if the run has it, else its first)")
    ap.add_argument("--gantt-steps", type=int, default=2,
                    help="timelines per strategy and run: the first N steps after the warm-up (default 2)")
    ap.add_argument("--quiet", action="store_true", help="do not print the summary")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return EXIT_BAD_INPUT if e.code not in (0, None) else 0
    if args.gantt_steps < 0:
        sys.stderr.write(f"wlb_report: error: --gantt-steps must be >= 0, got {args.gantt_steps}\n")
        return EXIT_BAD_INPUT
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

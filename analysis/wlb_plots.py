"""PNG plots of wlb traces (matplotlib, Agg backend). Each function writes one file and
returns its path, or None when the trace lacks the data (reason printed by the caller)."""

from __future__ import annotations

import os
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402,F401
import numpy as np  # noqa: E402

from wlb_metrics import (OP_KIND_NAMES, OP_KINDS, counted_steps, doc_lengths, mb_workload,  # noqa: E402
                         micro_batch_runs, micropack_latencies, normalised_latencies, rank_timeline,
                         step_kind)
from wlb_trace import PHASE_BWD, Trace  # noqa: E402

DPI = 110


def _save(fig, path, tight=True):
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def strategy_colours(names):
    """One colour per strategy name, stable across the plots of a report."""
    cmap = plt.get_cmap("tab10")
    return {n: cmap(i % 10) for i, n in enumerate(dict.fromkeys(names))}


def _step_range(steps):
    if not steps:
        return "no steps"
    a, b = min(steps), max(steps)
    return f"step {a}" if a == b else f"steps {a}–{b}"


def imbalance_plot(trace: Trace, metrics: dict, out_dir: str, prefix: str = "",
                   colours: dict | None = None):
    """WLB-LLM Fig. 4 style: per strategy (rows), micro-batch latency over the step's mean
    and CP-rank attention time over its group's mean (columns), imbalance degree in each
    panel's title. A column whose mesh dimension gives one point per step is left out and
    said so. Returns (path or None, [notes])."""
    colours = colours or strategy_colours(metrics)
    data = {s: normalised_latencies(trace, steps) for s, steps in metrics.items()}
    notes = []
    cols = []
    if any(d["mb"]["points"] for d in data.values()):
        cols.append("mb")
    else:
        notes.append(f"dp = {trace.mesh.get('dp', 1)} with one micro-batch per step: no micro-batch comparison")
    if any(d["cp"]["points"] for d in data.values()):
        cols.append("cp")
    elif trace.mesh.get("cp", 1) <= 1:
        notes.append("cp = 1: no CP ranks to compare")
    else:
        notes.append("no attention events: no CP comparison")
    rows = [s for s in metrics if any(data[s][c]["points"] for c in cols)]
    if not cols or not rows:
        return None, notes
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(5.6 * len(cols) + 0.8, 2.2 * len(rows) + 1.4),
                             squeeze=False, sharex="col")
    counted = sorted({st for d in data.values() for c in cols for _x, st, _v in d[c]["points"]})
    step_pos = {st: i for i, st in enumerate(counted)}
    for ci, c in enumerate(cols):
        vals = [v for s in rows for _x, _st, v in data[s][c]["points"]]
        lo, hi = min(min(vals), 1.0), max(max(vals), 1.0)
        pad = max(0.08 * (hi - lo), 0.02)
        for ri, sname in enumerate(rows):
            ax = axes[ri][ci]
            d = data[sname][c]
            pts = d["points"]
            if not pts:
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
                continue
            x = np.array([p[0] for p in pts], dtype=float)
            # Spread a slot's dots by step so that steps do not hide one another.
            jit = np.array([step_pos[p[1]] for p in pts], dtype=float)
            jit = (jit / max(len(counted) - 1, 1) - 0.5) * 0.5
            y = np.array([p[2] for p in pts])
            ax.scatter(x + jit, y, s=14, color=colours[sname], alpha=0.75, zorder=3)
            for xi in np.unique(x):  # mean over steps per slot
                ax.hlines(y[x == xi].mean(), xi - 0.32, xi + 0.32, color="black", lw=1.6, zorder=4)
            ax.axhline(1.0, color="gray", lw=0.8, ls="--", zorder=1)
            if not np.isnan(d["degree"]):
                ax.axhline(d["degree"], color=colours[sname], lw=1.0, ls=":", zorder=2)
            what = ("micro-batches" if trace.mesh.get("dp", 1) <= 1 else "micro-batches of all DP replicas") \
                if c == "mb" else "CP ranks"
            ax.set_title(f"{sname} — {what}: imbalance (max/mean) {d['degree']:.2f}, worst {d['worst']:.2f}",
                         fontsize=9, loc="left")
            ax.set_ylim(lo - pad, hi + pad)
            ax.grid(axis="y", alpha=0.3)
            ax.set_ylabel("latency / mean" if c == "mb" else "attn time / mean", fontsize=8)
        ax = axes[-1][ci]
        if c == "mb":
            slots = sorted({k for s in rows for k in data[s]["mb"]["slots"]})
            slots = data[rows[0]]["mb"]["slots"] if not slots else slots
            one_dp = trace.mesh.get("dp", 1) <= 1
            labels = [f"{mb}" if one_dp else f"dp{dp}\nmb{mb}" for dp, mb in slots]
            ax.set_xlabel("micro-batch" if one_dp else "DP replica / micro-batch")
        else:
            labels = [str(k) for k in range(int(trace.mesh.get("cp", 1)))]
            ax.set_xlabel("CP rank (attention time of the micro-batch's CP group)")
        step_ = max(1, len(labels) // 16)
        ax.set_xticks(range(0, len(labels), step_))
        ax.set_xticklabels(labels[::step_], fontsize=8)
        ax.set_xlim(-0.6, len(labels) - 0.4)
    fig.suptitle(f"Load imbalance, normalised to the mean — {trace.name} ({trace.source}), "
                 f"{_step_range(counted)}", fontsize=11)
    foot = ("dots: one per step (after warm-up, before drain); black bar: mean over steps; "
            "dotted: imbalance degree = mean over steps of max/mean. " + "; ".join(notes))
    wrap = textwrap.wrap(foot, width=int(fig.get_figwidth() * 14))
    fig.text(0.01, 0.005, "\n".join(wrap), fontsize=7.5, ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.16 * len(wrap) / fig.get_figheight(), 1, 1))
    return _save(fig, os.path.join(out_dir, f"{prefix}imbalance.png"), tight=False), notes


KIND_COLOURS = {"attention": "#D55E00", "gemm": "#0072B2", "comm": "#009E73", "idle": "#DDDDDD"}


def gantt_ranks(trace: Trace, ranks, max_rows: int = 32):
    """Rows of a Gantt: ranks sorted by (dp, pp, cp, tp); past max_rows, tp = 0 only, then
    dp = 0 only, then the first max_rows. Returns (ranks, note)."""
    c = trace.coords()
    ranks = sorted((int(r) for r in ranks), key=lambda r: (c["dp"][r], c["pp"][r], c["cp"][r], c["tp"][r]))
    note = ""
    if len(ranks) > max_rows and trace.mesh.get("tp", 1) > 1:
        ranks, note = [r for r in ranks if c["tp"][r] == 0], "tp = 0 ranks"
    if len(ranks) > max_rows and trace.mesh.get("dp", 1) > 1:
        ranks, note = [r for r in ranks if c["dp"][r] == 0], "tp = 0, dp = 0 ranks" if note else "dp = 0 ranks"
    if len(ranks) > max_rows:
        ranks, note = ranks[:max_rows], f"first {max_rows} ranks"
    return ranks, note


def _rank_label(trace, coords, r):
    dims = [f"{k}{coords[k][r]}" for k in ("dp", "pp", "cp", "tp") if trace.mesh.get(k, 1) > 1]
    return f"rank {r}" + (f" ({' '.join(dims)})" if dims else "")


def gantt(trace: Trace, strategy: int, step: int, out_dir: str, prefix: str = "",
          max_rows: int = 32) -> str | None:
    """Timeline of one step: a row per rank, bars coloured by op kind (attention, GEMM,
    communication, idle incl. gaps), backward hatched, each micro-batch's run outlined and
    labelled F<mb>/B<mb> where wide enough."""
    from matplotlib.patches import Patch, Rectangle

    coords = trace.coords()
    ev = trace.events
    m = (ev["strategy"] == strategy) & (ev["step"] == step)
    if not m.any():
        return None
    ranks, note = gantt_ranks(trace, np.unique(ev["rank"][m]), max_rows)
    timelines = {r: rank_timeline(trace, strategy, step, r) for r in ranks}
    if not any(timelines.values()):
        return None
    t0 = min(b[0] for tl in timelines.values() for b in tl)
    t1 = max(b[1] for tl in timelines.values() for b in tl)
    span = max(t1 - t0, 1)
    unit, div = ("s", 1e9) if span >= 2e9 else ("ms", 1e6) if span >= 2e6 else ("µs", 1e3)
    width_in = 13.0
    fig, ax = plt.subplots(figsize=(width_in, 0.42 * len(ranks) + 1.9))
    h = 0.78
    for row, r in enumerate(ranks):
        bars = timelines[r]
        # Idle first, then compute, communication on top (asynchronous sends may overlap).
        for kind in ("idle", "gemm", "attention", "comm"):
            for hatch in (None, "////"):
                segs = [((b[0] - t0) / div, (b[1] - b[0]) / div) for b in bars
                        if b[2] == kind and ((b[5] == PHASE_BWD) == (hatch is not None))]
                if segs:
                    ax.broken_barh(segs, (row - h / 2, h), facecolors=KIND_COLOURS[kind],
                                   edgecolor="white" if hatch else "none", linewidth=0, hatch=hatch)
        for s0, s1, mb, ph in micro_batch_runs(bars):
            x0, w = (s0 - t0) / div, (s1 - s0) / div
            ax.add_patch(Rectangle((x0, row - h / 2), w, h, fill=False, edgecolor="black", lw=0.7, zorder=5))
            text = f"{'B' if ph == PHASE_BWD else 'F'}{mb}"
            # Label where the run is wider than the text (about 7 px per character at 8 pt).
            if w / (span / div) * width_in * 0.85 * DPI > 7 * len(text) + 4:
                ax.text(x0 + w / 2, row, text, ha="center", va="center", fontsize=8, zorder=6,
                        color="black", bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.75))
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([_rank_label(trace, coords, r) for r in ranks], fontsize=8)
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, span / div)
    ax.set_xlabel(f"time since the step's first event ({unit})")
    ax.grid(axis="x", alpha=0.3)
    sname = trace.strategies[strategy]
    shown = f"; {len(ranks)} of {len(np.unique(ev['rank'][m]))} ranks: {note}" if note else ""
    kind = step_kind(trace, step)
    ax.set_title(f"{sname} — step {step}{'' if kind == 'measured' else f' ({kind})'} — {trace.name} "
                 f"[{trace.source} run]{shown}", fontsize=10)
    handles = [Patch(facecolor=KIND_COLOURS[k], label=OP_KIND_NAMES[k]) for k in OP_KINDS]
    handles.append(Patch(facecolor="white", edgecolor="gray", hatch="////", label="backward"))
    handles.append(Patch(facecolor="none", edgecolor="black", label="one micro-batch: F3 / B3 = fwd / bwd of mb 3"))
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.45 / (0.42 * len(ranks) + 1.9), 1, 1))  # room for the legend
    safe = "".join(ch if ch.isalnum() or ch in "-_+" else "_" for ch in sname)
    return _save(fig, os.path.join(out_dir, f"{prefix}gantt_{safe}_step{step}.png"), tight=False)


def workload_vs_latency(trace: Trace, metrics: dict, out_dir: str, prefix: str = "",
                        colours: dict | None = None) -> str | None:
    """Micro-batch workload against its latency, steps after warm-up (drain included)."""
    colours = colours or strategy_colours(metrics)
    fig, ax = plt.subplots(figsize=(6.8, 4.6))
    unit = None
    any_pts = False
    for sname, steps in metrics.items():
        sid = trace.strategy_id(sname)
        wl, unit = mb_workload(trace, sid)
        xs, ys = [], []
        for s in counted_steps(trace, steps):
            for (dp, mb), lat in s["mb_latency_ns"].items():
                w = wl.get((s["step"], dp, mb))
                if w is not None:
                    xs.append(w)
                    ys.append(lat / 1e6)
        if xs:
            any_pts = True
            ax.scatter(xs, ys, s=16, alpha=0.75, label=sname, color=colours[sname])
    if not any_pts:
        plt.close(fig)
        return None
    # Scale the axis in the label, not in an offset text matplotlib puts in a corner.
    xmax = max(max(c.get_offsets()[:, 0].max() for c in ax.collections), 1.0)
    exp = int(3 * np.floor(np.log10(xmax) / 3)) if xmax >= 1e3 else 0
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _p: f"{v / 10 ** exp:g}"))
    if unit == "recorded FLOPs":
        scale = {0: "", 3: "k", 6: "M", 9: "G", 12: "T", 15: "P"}.get(exp, f"10^{exp} ")
        ax.set_xlabel(f"micro-batch workload: recorded {scale}FLOP")
    else:
        ax.set_xlabel(f"micro-batch workload: {unit}" + (f", ×10^{exp}" if exp else ""))
    ax.set_ylabel("micro-batch latency (ms)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.set_title(f"Micro-batch workload vs latency — {trace.name} [{trace.source}]", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, os.path.join(out_dir, f"{prefix}mb_workload_latency.png"))


def micropack_violins(trace: Trace, metrics: dict, out_dir: str, prefix: str = "",
                      colours: dict | None = None) -> str | None:
    """SlimPack Figs. 14-16 style: per strategy, violins of the forward and the backward
    latency of every unit (micro-batch / MicroPack) over the measured steps, each over its
    step's mean (absolute ms in the summary); CV in the x labels."""
    colours = colours or strategy_colours(metrics)
    data = {s: micropack_latencies(trace, steps, trace.strategy_id(s)) for s, steps in metrics.items()}
    names = [s for s, d in data.items() if len(d["fwd"]["rel"]) > 1 or len(d["bwd"]["rel"]) > 1]
    if not names:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(max(6.0, 2.2 * len(names) + 2), 4.2), sharey=True)
    for ax, phase in zip(axes, ("fwd", "bwd")):
        pos, vals, labels = [], [], []
        for i, n in enumerate(names):
            v = data[n][phase]["rel"]
            if len(v) > 1:
                pos.append(i)
                vals.append(v)
            labels.append(f"{n}\nCV {data[n][phase]['cv']:.2f}")
        if vals:
            parts = ax.violinplot(vals, positions=pos, showmedians=True, showextrema=True)
            for body, i in zip(parts["bodies"], pos):
                body.set_facecolor(colours[names[i]])
                body.set_alpha(0.6)
        ax.axhline(1.0, color="0.5", lw=0.8, ls="--")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title("forward" if phase == "fwd" else "backward", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("unit latency / step mean")
    fig.suptitle(f"Per-micro-batch (MicroPack) latency spread — {trace.name} [{trace.source}]", fontsize=10)
    return _save(fig, os.path.join(out_dir, f"{prefix}micropack_violins.png"))


def doc_length_cdf(trace: Trace, out_dir: str) -> str | None:
    lengths = doc_lengths(trace)
    if lengths.size == 0:
        return None
    x = np.sort(lengths)
    cdf = np.arange(1, x.size + 1) / x.size
    share = np.cumsum(x) / x.sum()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.step(x, cdf, where="post", label="documents (CDF)")
    ax.step(x, share, where="post", label="token share (docs ≤ length)")
    if x.min() > 0 and x.max() / max(x.min(), 1) > 20:
        ax.set_xscale("log")
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("fraction")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Document lengths ({x.size} docs) — {trace.name}")
    return _save(fig, os.path.join(out_dir, "doc_lengths.png"))


def speedup_bars(rows, out_dir: str, colours: dict | None = None) -> str | None:
    """rows: dicts with run, source, strategy, baseline, speedup, lo, hi, metric. Each
    speedup is against the baseline strategy of its own run; one panel per source
    (measured, simulated) so that measured and predicted bars never share an axis. Error
    bars: the 95% interval."""
    if not rows:
        return None
    sources = list(dict.fromkeys(r["source"] for r in rows))
    colours = colours or strategy_colours(r["strategy"] for r in rows)
    run_cmap = plt.get_cmap("Set2")
    widths = [len(set(r["strategy"] for r in rows if r["source"] == src)) for src in sources]
    fig, axes = plt.subplots(1, len(sources), figsize=(sum(max(4.2, 1.2 * w + 2.2) for w in widths), 4.6),
                             squeeze=False, gridspec_kw={"width_ratios": [max(4.2, 1.2 * w + 2.2) for w in widths]})
    for ax, src in zip(axes[0], sources):
        sub = [r for r in rows if r["source"] == src]
        runs = list(dict.fromkeys(r["run"] for r in sub))
        strats = list(dict.fromkeys(r["strategy"] for r in sub))
        w = 0.8 / len(runs)
        top = 1.0
        for ri, run in enumerate(runs):
            rr = {r["strategy"]: r for r in sub if r["run"] == run}
            xs = [i + (ri - (len(runs) - 1) / 2) * w for i, st in enumerate(strats) if st in rr]
            sp = np.array([rr[st]["speedup"] for st in strats if st in rr], dtype=np.float64)
            lo = np.array([rr[st]["lo"] for st in strats if st in rr], dtype=np.float64)
            hi = np.array([rr[st]["hi"] for st in strats if st in rr], dtype=np.float64)
            yerr = np.vstack([np.clip(sp - lo, 0, None), np.clip(hi - sp, 0, None)])
            col = ([colours[st] for st in strats if st in rr] if len(runs) == 1 else run_cmap(ri % 8))
            ax.bar(xs, sp, width=w * 0.92, color=col, yerr=yerr, capsize=4, ecolor="black",
                   label=run if len(runs) > 1 else None)
            for x, v, h_ in zip(xs, sp, hi):
                ax.text(x, np.nanmax([h_, v]) + 0.01, f"{v:.2f}×", ha="center", va="bottom", fontsize=8)
            top = np.nanmax([top, *hi, *sp])
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xticks(range(len(strats)))
        ax.set_xticklabels(strats, fontsize=9)
        ax.set_ylim(0, top * 1.15)
        base = ", ".join(sorted(set(r["baseline"] for r in sub)))
        metric = sub[0]["metric"]
        ax.set_ylabel(f"{metric} speedup over {base} of the same run\n(error bars: 95% bootstrap interval)",
                      fontsize=9)
        ax.set_title(f"{src} run: {runs[0]}" if len(runs) == 1 else f"{src} runs", fontsize=10)
        if len(runs) > 1:  # below the axis: never over a bar
            ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=min(len(runs), 2),
                      frameon=False)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Strategy speedup within each run" + (" — measured and simulated kept apart"
                                                      if len(sources) > 1 else ""), fontsize=11)
    return _save(fig, os.path.join(out_dir, "speedup.png"))

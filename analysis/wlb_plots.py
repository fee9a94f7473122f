"""PNG plots of wlb traces (matplotlib, Agg backend). Each function writes one file and
returns its path, or None when the trace lacks the data (reason printed by the caller)."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from wlb_metrics import CONTAINER_LABELS, IDLE_LABELS, doc_lengths, mb_workload  # noqa: E402
from wlb_trace import PHASE_BWD, Trace  # noqa: E402

DPI = 110


def _save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def latency_scatter(trace: Trace, metrics: dict, out_dir: str) -> str | None:
    """Per-rank normalised latency (busy / mean busy of the step) grouped by DP, PP, CP."""
    coords = trace.coords()
    if len(coords["dp"]) == 0:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), sharey=True)
    rng = np.random.default_rng(0)
    for si, (sname, steps) in enumerate(metrics.items()):
        xs = {k: [] for k in ("dp", "pp", "cp")}
        ys = []
        for s in steps:
            pres = s["present"]
            b = s["busy_ns"][pres]
            if b.size == 0 or b.mean() <= 0:
                continue
            ranks = np.nonzero(pres)[0]
            ys.extend(b / b.mean())
            for k in xs:
                xs[k].extend(coords[k][ranks])
        if not ys:
            continue
        off = (si - (len(metrics) - 1) / 2) * 0.8 / max(len(metrics), 1)
        for ax, k in zip(axes, ("dp", "pp", "cp")):
            x = np.asarray(xs[k], dtype=float) + off + rng.uniform(-0.05, 0.05, len(xs[k]))
            ax.scatter(x, ys, s=12, alpha=0.6, label=sname)
    for ax, k in zip(axes, ("dp", "pp", "cp")):
        n = int(trace.mesh.get(k, 1))
        ax.set_xticks(range(n))
        ax.set_xlabel(f"{k.upper()} coordinate")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_title(f"grouped by {k.upper()}")
    axes[0].set_ylabel("rank busy time / step mean")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Per-rank normalised latency — {trace.name} ({trace.source})")
    return _save(fig, os.path.join(out_dir, "latency_scatter.png"))


def gantt(trace: Trace, strategy: int, step: int, out_dir: str, max_rows: int = 32) -> str | None:
    """Pipeline timeline of one step: a row per rank (sorted by dp, pp, cp, tp), bars
    coloured by micro-batch, backward hatched."""
    coords = trace.coords()
    ev = trace.events
    excl = [trace.region_id(l) for l in CONTAINER_LABELS + IDLE_LABELS]
    m = (ev["strategy"] == strategy) & (ev["step"] == step) & ~np.isin(ev["region"], excl)
    if not m.any():
        return None
    ranks = sorted(np.unique(ev["rank"][m]),
                   key=lambda r: (coords["dp"][r], coords["pp"][r], coords["cp"][r], coords["tp"][r]))
    if len(ranks) > max_rows:  # representative ranks: tp = cp = 0
        ranks = [r for r in ranks if coords["tp"][r] == 0 and coords["cp"][r] == 0][:max_rows]
    row = {int(r): i for i, r in enumerate(ranks)}
    t0 = ev["start_ns"][m].min()
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(ranks) + 1.6))
    for r, mb, ph, s0, s1 in zip(ev["rank"][m], ev["micro_batch"][m], ev["phase"][m],
                                 ev["start_ns"][m], ev["end_ns"][m]):
        if int(r) not in row:
            continue
        color = cmap(int(mb) % 10) if mb >= 0 else (0.6, 0.6, 0.6, 1.0)
        ax.barh(row[int(r)], (s1 - s0) / 1e6, left=(s0 - t0) / 1e6, height=0.8, color=color,
                hatch="//" if ph == PHASE_BWD else None, edgecolor="black", linewidth=0.2)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"r{r} dp{coords['dp'][r]} pp{coords['pp'][r]} cp{coords['cp'][r]} tp{coords['tp'][r]}"
                        for r in ranks], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time since step start (ms)")
    mbs = sorted(int(x) for x in np.unique(ev["micro_batch"][m]) if x >= 0)
    handles = [plt.Rectangle((0, 0), 1, 1, color=cmap(b % 10)) for b in mbs[:10]]
    if handles:
        ax.legend(handles, [f"mb {b}" for b in mbs[:10]], fontsize=7, loc="upper right", ncol=5)
    sname = trace.strategies[strategy]
    ax.set_title(f"Step {step} timeline — {sname} ({trace.source}); hatched = backward")
    safe = "".join(c if c.isalnum() or c in "-_+" else "_" for c in sname)
    return _save(fig, os.path.join(out_dir, f"gantt_{safe}_step{step}.png"))


def workload_vs_latency(trace: Trace, metrics: dict, out_dir: str) -> str | None:
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    unit = None
    any_pts = False
    for sname, steps in metrics.items():
        sid = trace.strategy_id(sname)
        wl, unit = mb_workload(trace, sid)
        xs, ys = [], []
        for s in steps:
            for (dp, mb), lat in s["mb_latency_ns"].items():
                w = wl.get((s["step"], dp, mb))
                if w is not None:
                    xs.append(w)
                    ys.append(lat / 1e6)
        if xs:
            any_pts = True
            ax.scatter(xs, ys, s=14, alpha=0.7, label=sname)
    if not any_pts:
        plt.close(fig)
        return None
    ax.set_xlabel(f"micro-batch workload ({unit})")
    ax.set_ylabel("micro-batch latency (ms)")
    ax.set_title(f"Micro-batch workload vs latency — {trace.name}")
    ax.legend(fontsize=8)
    return _save(fig, os.path.join(out_dir, "mb_workload_latency.png"))


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


def speedup_bars(rows, out_dir: str) -> str | None:
    """rows: list of (label, mean step time ns, speedup, lo, hi); error bars = the 95% interval."""
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(rows) + 2), 4.2))
    labels = [r[0] for r in rows]
    sp = np.array([r[2] for r in rows], dtype=np.float64)
    lo = np.array([r[3] for r in rows], dtype=np.float64)
    hi = np.array([r[4] for r in rows], dtype=np.float64)
    yerr = np.vstack([np.clip(sp - lo, 0, None), np.clip(hi - sp, 0, None)])
    bars = ax.bar(range(len(rows)), sp, color=plt.get_cmap("tab10")(np.arange(len(rows)) % 10),
                  yerr=yerr, capsize=4, ecolor="black")
    for b, v, h in zip(bars, sp, hi):
        ax.text(b.get_x() + b.get_width() / 2, max(h, v), f"{v:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("throughput speedup (tokens/s)\nerror bars: 95% bootstrap over steps")
    ax.set_title(f"Strategy speedup (baseline: {rows[0][0]})" if rows else "Strategy speedup")
    return _save(fig, os.path.join(out_dir, "speedup.png"))

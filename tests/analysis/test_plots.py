"""The report's plots as data: op-kind classification and idle gaps of the Gantt charts,
the Fig. 4 style imbalance panels (annotation = the computed max/mean, y range from the
data, trivial mesh dimensions left out), --compare (one set of plots per run, speedups
within each run, measured and simulated panels apart) and the step numbering of
steps.csv and the plots (the trace's 0-based index, warm-up skipped)."""

import csv
import os

import numpy as np
import pytest

from test_metrics_pp import HAND_RANKS, HAND_SEGMENTS, STANDARD_LABELS, hand_events, run_report, write_trace

import wlb_metrics
import wlb_plots
import wlb_report
import wlb_trace


@pytest.fixture
def figures(monkeypatch):
    """Every figure the plots save, as {file name: figure}, inspected before it is closed."""
    saved = {}
    real = wlb_plots._save

    def capture(fig, path, tight=True):
        saved[os.path.basename(path)] = {
            "axes": [{"title": ax.get_title(loc="left") + ax.get_title(), "ylim": ax.get_ylim(),
                      "texts": [t.get_text() for t in ax.texts],
                      "bars": [(p.get_x() + p.get_width() / 2, p.get_height()) for p in ax.patches
                               if type(p).__name__ == "Rectangle" and p.get_fill()],
                      "colours": [tuple(np.round(c, 3)) for coll in ax.collections
                                  for c in coll.get_facecolor()]}
                     for ax in fig.axes],
            "suptitle": fig._suptitle.get_text() if fig._suptitle else "",
        }
        return real(fig, path, tight)

    monkeypatch.setattr(wlb_plots, "_save", capture)
    return saved


# ---- op kinds and the Gantt timeline ------------------------------------------------------

def test_op_kind_of_every_label():
    expected = {"step": "container", "idle": "idle", "attn": "attention",
                "embed": "gemm", "norm": "gemm", "qkv_proj": "gemm", "out_proj": "gemm", "mlp": "gemm",
                "loss": "gemm", "optimizer": "gemm", "recompute": "gemm",
                "tp_allreduce": "comm", "kv_allgather": "comm", "kv_exchange": "comm", "pp_send": "comm",
                "pp_recv": "comm", "grad_allreduce": "comm"}
    assert set(expected) == set(STANDARD_LABELS)  # every label of docs/trace-schema.md
    for label, kind in expected.items():
        assert wlb_metrics.op_kind(label) == kind, label
    # Labels a later writer may add are classified by name.
    assert wlb_metrics.op_kind("attn_varlen") == "attention"
    assert wlb_metrics.op_kind("cp_reduce_scatter") == "comm"
    assert wlb_metrics.op_kind("rmsnorm") == "gemm"


def _timeline_trace(path):
    def ev(label, mb, phase, s, e):
        return {"rank": 0, "step": 0, "micro_batch": mb, "phase": phase, "label": label, "start_ns": s, "end_ns": e}

    events = [
        ev("step", -1, "none", 0, 1000),
        ev("embed", 0, "fwd", 0, 50), ev("attn", 0, "fwd", 60, 200), ev("kv_exchange", 0, "fwd", 200, 260),
        ev("idle", -1, "none", 260, 300),
        ev("attn", 0, "bwd", 300, 500), ev("mlp", 0, "bwd", 500, 600),
        ev("attn", 1, "fwd", 650, 700),
        ev("grad_allreduce", -1, "none", 900, 950),
    ]
    return write_trace(path, ranks=[(0, 0, 0, 0)], events=events, strategies=["plain"])


def test_rank_timeline_kinds_and_idle_gaps(tmp_path):
    t = wlb_trace.load(_timeline_trace(str(tmp_path / "tl.h5")))
    bars = wlb_metrics.rank_timeline(t, 0, 0, 0)
    got = [(b[0], b[1], b[2], b[3]) for b in bars]
    assert got == [
        (0, 50, "gemm", "embed"), (50, 60, "idle", "(gap)"), (60, 200, "attention", "attn"),
        (200, 260, "comm", "kv_exchange"), (260, 300, "idle", "idle"), (300, 500, "attention", "attn"),
        (500, 600, "gemm", "mlp"), (600, 650, "idle", "(gap)"), (650, 700, "attention", "attn"),
        (700, 900, "idle", "(gap)"), (900, 950, "comm", "grad_allreduce"),
        (950, 1000, "idle", "(gap)"),  # to the end of the rank's `step` event
    ]
    # Micro-batch runs: waiting inside a run does not split it; a new phase or mb does.
    assert wlb_metrics.micro_batch_runs(bars) == [
        (0, 260, 0, wlb_trace.PHASE_FWD), (300, 600, 0, wlb_trace.PHASE_BWD), (650, 700, 1, wlb_trace.PHASE_FWD)]


def test_gantt_colours_by_op_kind_and_labels_micro_batches(tmp_path, figures):
    t = wlb_trace.load(_timeline_trace(str(tmp_path / "tl.h5")))
    p = wlb_plots.gantt(t, 0, 0, str(tmp_path))
    assert os.path.basename(p) == "gantt_plain_step0.png"
    [ax] = figures["gantt_plain_step0.png"]["axes"]
    import matplotlib.colors as mc

    kind_rgba = {k: tuple(np.round(mc.to_rgba(c), 3)) for k, c in wlb_plots.KIND_COLOURS.items()}
    assert set(ax["colours"]) == set(kind_rgba.values())  # all four kinds, nothing coloured by mb
    assert {"F0", "B0", "F1"} <= set(ax["texts"])


def test_gantt_rows_of_a_large_mesh_keep_tp0(tmp_path):
    ranks = [(tp, cp, pp, 0) for pp in range(4) for cp in range(2) for tp in range(8)]
    events = [{"rank": r, "step": 0, "micro_batch": 0, "phase": "fwd", "label": "attn", "start_ns": 0,
               "end_ns": 10} for r in range(len(ranks))]
    t = wlb_trace.load(write_trace(str(tmp_path / "big.h5"), ranks=ranks, events=events, strategies=["plain"]))
    rows, note = wlb_plots.gantt_ranks(t, range(len(ranks)), max_rows=32)
    c = t.coords()
    assert len(rows) == 8 and all(c["tp"][r] == 0 for r in rows)
    assert [(c["pp"][r], c["cp"][r]) for r in rows] == [(p, q) for p in range(4) for q in range(2)]
    assert note == "tp = 0 ranks"


# ---- Fig. 4 style imbalance panels --------------------------------------------------------

def test_normalised_latencies_hand_computed(tmp_path):
    t = wlb_trace.load(write_trace(str(tmp_path / "h.h5"), ranks=HAND_RANKS, events=hand_events(),
                                   strategies=["plain"], segments=HAND_SEGMENTS))
    steps = wlb_metrics.step_metrics(t, 0)
    d = wlb_metrics.normalised_latencies(t, steps)
    # Micro-batch latencies 500 and 200 (step 0), 300 and 300 (step 1), over each step's mean.
    assert d["mb"]["slots"] == [(0, 0), (0, 1)]
    assert sorted(d["mb"]["points"]) == sorted([(0, 0, 500 / 350), (1, 0, 200 / 350), (0, 1, 1.0), (1, 1, 1.0)])
    # CP: mb0 of step 0 is set by stage 0 (attention 100 vs 300 ns -> 0.5, 1.5).
    assert (0, 0, pytest.approx(0.5)) in d["cp"]["points"] and (1, 0, pytest.approx(1.5)) in d["cp"]["points"]
    summ = wlb_metrics.summarize(t, 0, steps)
    assert d["mb"]["degree"] == pytest.approx(summ["imbalance"]) == pytest.approx((500 / 350 + 1) / 2)
    assert d["cp"]["degree"] == pytest.approx(summ["cp_imbalance"]) == pytest.approx((1.25 + 1) / 2)
    assert d["mb"]["worst"] == pytest.approx(500 / 350)
    assert d["cp"]["worst"] == pytest.approx(1.5)


def test_imbalance_plot_annotates_the_computed_degree(tmp_path, figures):
    # Two strategies, the second unbalanced on CP rank 1 by 1.29 (attention 100 vs 158).
    def ev(s, r, step, mb, a, b):
        return {"rank": r, "strategy": s, "step": step, "micro_batch": mb, "phase": "fwd", "label": "attn",
                "start_ns": a, "end_ns": b}

    events = []
    for step in range(3):
        o = 1000 * step
        events += [ev(0, r, step, mb, o + 200 * mb, o + 200 * mb + 100) for r in (0, 1) for mb in (0, 1)]
        events += [ev(1, 0, step, mb, o + 200 * mb, o + 200 * mb + 100) for mb in (0, 1)]
        events += [ev(1, 1, step, mb, o + 200 * mb, o + 200 * mb + 158) for mb in (0, 1)]
    t = wlb_trace.load(write_trace(str(tmp_path / "cp.h5"), ranks=[(0, 0, 0, 0), (0, 1, 0, 0)], events=events,
                                   strategies=["plain", "skewed"]))
    metrics = wlb_report.analyse(t)
    path, notes = wlb_plots.imbalance_plot(t, metrics, str(tmp_path))
    assert os.path.basename(path) == "imbalance.png"
    fig = figures["imbalance.png"]
    degree = wlb_metrics.normalised_latencies(t, metrics["skewed"])["cp"]["degree"]
    assert degree == pytest.approx(158 / 129)
    assert degree == pytest.approx(wlb_metrics.summarize(t, 1)["cp_imbalance"])
    titles = [a["title"] for a in fig["axes"]]
    cp_title = next(x for x in titles if x.startswith("skewed") and "CP ranks" in x)
    assert f"{degree:.2f}" in cp_title
    # The y range comes from the data: it shows 158/129 and 100/129, and is not mostly empty.
    lo, hi = next(a["ylim"] for a in fig["axes"] if a["title"] == cp_title)
    assert lo <= 100 / 129 and hi >= 158 / 129
    assert hi - lo < 2 * (158 - 100) / 129
    # One micro-batch slot per step would be meaningless; here there are two per step.
    assert any("micro-batches" in x for x in titles)


def test_imbalance_plot_leaves_out_trivial_dimensions(tmp_path, figures):
    def ev(r, step, a, b):
        return {"rank": r, "step": step, "micro_batch": 0, "phase": "fwd", "label": "attn", "start_ns": a,
                "end_ns": b}

    # dp = 1, cp = 1, one micro-batch per step: nothing to compare, no plot, the reason said.
    one = wlb_trace.load(write_trace(str(tmp_path / "one.h5"), ranks=[(0, 0, 0, 0)],
                                     events=[ev(0, s, 100 * s, 100 * s + 50) for s in range(2)],
                                     strategies=["plain"]))
    path, notes = wlb_plots.imbalance_plot(one, wlb_report.analyse(one), str(tmp_path))
    assert path is None
    assert any("dp = 1" in n for n in notes) and any("cp = 1" in n for n in notes)
    # cp = 2 with one micro-batch: the CP column only.
    two = wlb_trace.load(write_trace(str(tmp_path / "two.h5"), ranks=[(0, 0, 0, 0), (0, 1, 0, 0)],
                                     events=[ev(r, s, 100 * s, 100 * s + 30 + 20 * r) for s in range(2)
                                             for r in range(2)], strategies=["plain"]))
    path, notes = wlb_plots.imbalance_plot(two, wlb_report.analyse(two), str(tmp_path))
    axes = figures["imbalance.png"]["axes"]
    assert len(axes) == 1 and "CP ranks" in axes[0]["title"]
    assert any("dp = 1" in n for n in notes)


# ---- --compare: one set of plots per run, baselines within each run ------------------------

def _two_runs(tmp_path):
    segs = HAND_SEGMENTS + [(1,) + s[1:] for s in HAND_SEGMENTS]
    measured = write_trace(str(tmp_path / "meas.h5"), ranks=HAND_RANKS, strategies=["plain", "wlb"],
                           events=hand_events(1.0, 0) + hand_events(0.5, 1), segments=segs)
    simulated = write_trace(str(tmp_path / "sim.h5"), ranks=HAND_RANKS, strategies=["plain", "wlb"],
                            events=hand_events(0.1, 0) + hand_events(0.08, 1), segments=segs,
                            meta={"source": "simulated"})
    return measured, simulated


def test_compare_draws_each_runs_gantt_and_keeps_sources_apart(tmp_path, figures):
    measured, simulated = _two_runs(tmp_path)
    out = tmp_path / "cmp"
    _text, pngs = wlb_report.report([measured, simulated], str(out), quiet=True)
    names = {os.path.basename(p) for p in pngs}
    for run in ("run0_measured_", "run1_simulated_"):
        for s in ("plain", "wlb"):
            assert f"{run}gantt_{s}_step0.png" in names
        assert f"{run}imbalance.png" in names
    assert "[measured run]" in figures["run0_measured_gantt_wlb_step0.png"]["axes"][0]["title"]
    assert "[simulated run]" in figures["run1_simulated_gantt_wlb_step0.png"]["axes"][0]["title"]
    # speedup.png: one panel per source, each bar over its own run's plain.
    axes = figures["speedup.png"]["axes"]
    assert [a["title"].split()[0] for a in axes] == ["measured", "simulated"]
    heights = [sorted(round(h, 3) for _x, h in a["bars"]) for a in axes]
    assert heights == [[1.0, 2.0], [1.0, 1.25]]


def test_compare_rejects_a_baseline_missing_from_a_run(tmp_path):
    measured, _sim = _two_runs(tmp_path)
    other = write_trace(str(tmp_path / "other.h5"), ranks=HAND_RANKS, strategies=["fixed"],
                        events=hand_events(1.0, 0), segments=HAND_SEGMENTS)
    r = run_report(measured, "--compare", other, "--out", str(tmp_path / "o"), "--baseline", "plain")
    assert r.returncode == 2
    assert "other.h5" in r.stderr and "plain" in r.stderr


# ---- step numbering: the trace's index, warm-up skipped everywhere -------------------------

def test_steps_csv_and_plots_use_the_trace_step_index(tmp_path):
    events = hand_events()
    # Step 2 = step 1 again, 1000 ns later: the drain step after measured step 1.
    events += [dict(e, step=2, start_ns=e["start_ns"] + 1000, end_ns=e["end_ns"] + 1000)
               for e in events if e["step"] == 1]
    p = write_trace(str(tmp_path / "w.h5"), ranks=HAND_RANKS, events=events, strategies=["plain"],
                    segments=HAND_SEGMENTS, meta={"warmup": 1, "measured_steps": 1})
    out = tmp_path / "rep"
    r = run_report(p, "--out", str(out), "--gantt-steps", "5")
    assert r.returncode == 0, r.stderr
    t = wlb_trace.load(p)
    trace_steps = sorted(int(s) for s in np.unique(t.events["step"]) if s >= t.warmup)
    with open(out / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(x["step"]) for x in rows] == trace_steps == [1, 2]
    assert [x["kind"] for x in rows] == ["measured", "drain"]
    gantts = sorted(x.name for x in out.glob("gantt_*.png"))
    assert gantts == ["gantt_plain_step1.png", "gantt_plain_step2.png"]
    # The text table has the same rows: no warm-up step 0.
    table = r.stdout.split("strategy plain")[1].split("mean over")[0]
    first_cells = [ln.split()[0] for ln in table.strip().splitlines()[2:]]
    assert first_cells == ["1", "2"]
    assert "warm-up steps 0-0 skipped" in r.stdout
    assert "mean over 1 measured step(s)" in r.stdout

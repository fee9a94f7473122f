"""More analysis tests: a pipeline (PP=2, CP=2) trace with hand-computed step time,
busy/idle, micro-batch latency summed over stages and CP imbalance; warmup exclusion;
document lengths and plan workload; --compare / --baseline speedups; more bad inputs; the
metrics of the simulated trace written by tests/mpi/test_trace_write.cpp."""

import glob
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPORT, cxx_trace_dir

import wlb_metrics
import wlb_trace

STANDARD_LABELS = ["step", "embed", "norm", "qkv_proj", "attn", "out_proj", "mlp", "loss",
                   "tp_allreduce", "kv_allgather", "kv_exchange", "pp_send", "pp_recv",
                   "grad_allreduce", "optimizer", "idle", "recompute"]


def _phase_dtype():
    import h5py

    return h5py.enum_dtype({"none": 0, "fwd": 1, "bwd": 2}, basetype="i1")


def write_trace(path, *, ranks, events, strategies, segments=(), meta=None, complete=True,
                regions=STANDARD_LABELS):
    """Write a synthetic trace.

    ranks:  list of (tp, cp, pp, dp), index = rank
    events: list of dicts with rank, strategy, step, micro_batch, phase ("fwd"/"bwd"/"none"),
            label, start_ns, end_ns and optional flops, bytes, layer, chunk
    segments: list of (strategy, step, dp, micro_batch, index, doc, offset, length, arrival)
    """
    import h5py

    phase_code = {"none": 0, "fwd": 1, "bwd": 2}
    events = sorted(events, key=lambda e: e["rank"])
    ev_dt = np.dtype([("rank", "<i4"), ("strategy", "<i4"), ("step", "<i4"), ("micro_batch", "<i4"),
                      ("region", "<i4"), ("layer", "<i4"), ("chunk", "<i4"), ("phase", _phase_dtype()),
                      ("start_ns", "<i8"), ("end_ns", "<i8"), ("flops", "<f8"), ("bytes", "<f8")])
    ev = np.zeros(len(events), dtype=ev_dt)
    for i, e in enumerate(events):
        ev[i] = (e["rank"], e.get("strategy", 0), e.get("step", -1), e.get("micro_batch", -1),
                 regions.index(e["label"]), e.get("layer", -1), e.get("chunk", 0),
                 phase_code[e.get("phase", "none")], e["start_ns"], e["end_ns"],
                 e.get("flops", 0.0), e.get("bytes", 0.0))
    rk_dt = np.dtype([("rank", "<i4"), ("tp", "<i4"), ("cp", "<i4"), ("pp", "<i4"), ("dp", "<i4"),
                      ("clock_offset_ns", "<i8"), ("event_offset", "<i8"), ("event_count", "<i8")])
    rk = np.zeros(len(ranks), dtype=rk_dt)
    for r, (tp, cp, pp, dp) in enumerate(ranks):
        idx = [i for i, e in enumerate(events) if e["rank"] == r]
        rk[r] = (r, tp, cp, pp, dp, 0, idx[0] if idx else 0, len(idx))
    seg_dt = np.dtype([("strategy", "<i4"), ("dp", "<i4"), ("micro_batch", "<i4"), ("index", "<i4"),
                       ("step", "<i8"), ("doc", "<i8"), ("offset", "<i8"), ("length", "<i8"),
                       ("arrival_step", "<i8")])
    sg = np.zeros(len(segments), dtype=seg_dt)
    for i, (s, step, dp, mb, ix, doc, off, ln, arr) in enumerate(segments):
        sg[i] = (s, dp, mb, ix, step, doc, off, ln, arr)
    steps = sorted({(s[0], s[1]) for s in segments})
    st = np.array(steps, dtype=[("strategy", "<i4"), ("step", "<i8")]) if steps else \
        np.zeros(0, dtype=[("strategy", "<i4"), ("step", "<i8")])
    vstr = h5py.string_dtype("utf-8")
    mesh = [max(c[i] for c in ranks) + 1 for i in range(4)]
    m = {"schema_version": 1, "source": "measured", "git_hash": "synthetic", "wlb_version": "0",
         "kokkos_version": "3.4.1", "kokkos_backend": "Serial", "hdf5_version": "1.10.8",
         "mpi_size": len(ranks), "world_size": len(ranks), "mesh_tp": mesh[0], "mesh_cp": mesh[1],
         "mesh_pp": mesh[2], "mesh_dp": mesh[3], "warmup": 0, "start_time": "2025-01-01T00:00:00.000Z",
         "clock": "synthetic", "strategy": ",".join(strategies), "command": "", "deck": ""}
    m.update(meta or {})
    with h5py.File(path, "w") as f:
        f.create_dataset("events", data=ev)
        f.create_dataset("ranks", data=rk)
        f.create_dataset("regions", data=np.array(regions, dtype=object), dtype=vstr)
        g = f.create_group("meta")
        for k, v in m.items():
            g.attrs[k] = v
        g.create_dataset("strategies", data=np.array(strategies, dtype=object), dtype=vstr)
        p = f.create_group("plan")
        p.create_dataset("steps", data=st)
        p.create_dataset("packing_json", data=np.array(["{}"] * len(steps), dtype=object), dtype=vstr)
        p.create_dataset("shard_json", data=np.array([""] * len(steps), dtype=object), dtype=vstr)
        p.create_dataset("segments", data=sg)
        f.attrs["schema_version"] = m["schema_version"]  # the root's, repeated in /meta
        if complete:
            f.attrs["complete"] = 1
    return path


# Hand-computed scenario (docs/analysis.md, "Worked example"): tp=1 cp=2 pp=2 dp=1,
# rank = 2*pp + cp; one strategy; step 0 unbalanced, step 1 balanced.
HAND_RANKS = [(0, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 1, 1, 0)]


def hand_events(scale=1.0, strategy=0):
    def ev(rank, step, mb, label, s, e, phase="fwd"):
        return {"rank": rank, "strategy": strategy, "step": step, "micro_batch": mb, "phase": phase,
                "label": label, "start_ns": int(s * scale), "end_ns": int(e * scale)}

    out = [
        # step 0
        ev(0, 0, -1, "step", 0, 700, "none"),
        ev(0, 0, 0, "attn", 0, 100), ev(1, 0, 0, "attn", 0, 300),
        ev(0, 0, 1, "attn", 300, 400), ev(1, 0, 1, "attn", 300, 400),
        ev(2, 0, 0, "attn", 300, 500), ev(3, 0, 0, "attn", 300, 400),
        ev(2, 0, 1, "attn", 500, 600), ev(3, 0, 1, "attn", 500, 600),
    ]
    out += [ev(r, 0, -1, "grad_allreduce", 600, 700, "none") for r in range(4)]
    # step 1: every attention call takes 100 ns
    out += [
        ev(0, 1, 0, "attn", 1000, 1100), ev(1, 1, 0, "attn", 1000, 1100),
        ev(0, 1, 1, "attn", 1300, 1400), ev(1, 1, 1, "attn", 1300, 1400),
        ev(2, 1, 0, "attn", 1300, 1400), ev(3, 1, 0, "attn", 1300, 1400),
        ev(2, 1, 1, "attn", 1500, 1600), ev(3, 1, 1, "attn", 1500, 1600),
    ]
    out += [ev(r, 1, -1, "grad_allreduce", 1600, 1700, "none") for r in range(4)]
    return out


# Documents 0..3 of lengths 10, 20, 30, 40 (doc 3 cut into 25 + 15).
HAND_SEGMENTS = [
    (0, 0, 0, 0, 0, 0, 0, 10, 0), (0, 0, 0, 0, 1, 1, 0, 20, 0),
    (0, 0, 0, 1, 0, 2, 0, 30, 0), (0, 0, 0, 1, 1, 3, 0, 25, 0),
    (0, 1, 0, 0, 0, 3, 25, 15, 0),
]


@pytest.fixture
def hand_trace(tmp_path):
    return write_trace(str(tmp_path / "hand.h5"), ranks=HAND_RANKS, events=hand_events(),
                       strategies=["plain"], segments=HAND_SEGMENTS)


@pytest.fixture
def cxx_sim_trace():
    d = cxx_trace_dir()
    files = sorted(glob.glob(os.path.join(d, "trace_sim_np*.h5"))) if d else []
    if not files:
        pytest.skip("no C++-written simulated trace (run ctest with WLB_TRACE_TEST_DIR set, as ./run/tests does)")
    return files[0]


def cxx_measured_traces():
    d = cxx_trace_dir()
    return sorted(glob.glob(os.path.join(d, "trace_np*.h5"))) if d else []


def run_report(*args):
    return subprocess.run([sys.executable, REPORT, *args], capture_output=True, text=True, timeout=300)


# ---- metrics on the hand-computed trace ---------------------------------------------------

def test_union_length():
    assert wlb_metrics.union_length(np.array([0, 50, 200]), np.array([100, 120, 300])) == 220
    assert wlb_metrics.union_length(np.array([0, 10]), np.array([100, 20])) == 100  # nested
    assert wlb_metrics.union_length(np.array([]), np.array([])) == 0


def test_load_hand_trace(hand_trace):
    t = wlb_trace.load(hand_trace)
    assert t.strategies == ["plain"]
    assert t.mesh == {"tp": 1, "cp": 2, "pp": 2, "dp": 1}
    assert len(t.events["rank"]) == len(hand_events())
    assert t.source == "measured"


def test_step_metrics_hand_computed(hand_trace):
    t = wlb_trace.load(hand_trace)
    steps = wlb_metrics.step_metrics(t, 0)
    assert [s["step"] for s in steps] == [0, 1]
    s0, s1 = steps
    # Step time: rank spans 700, 700, 400, 400 -> 700.
    assert s0["step_time_ns"] == 700
    assert s1["step_time_ns"] == 700
    # Busy = union of work intervals (the "step" container does not count).
    assert list(s0["busy_ns"]) == [300, 500, 400, 300]
    assert list(s0["idle_ns"]) == [400, 200, 300, 400]
    # Micro-batch latency: sum over stages of the max over the stage's CP ranks.
    assert s0["mb_latency_ns"] == {(0, 0): 500, (0, 1): 200}
    assert s0["imbalance"] == pytest.approx(500 / 350)
    assert s0["imbalance_fwd"] == pytest.approx(500 / 350)
    assert math.isnan(s0["imbalance_bwd"])
    # CP imbalance: mb0 = max(300/200, 200/150) = 1.5, mb1 = 1.0.
    assert s0["cp_imbalance_by_mb"] == {(0, 0): pytest.approx(1.5), (0, 1): pytest.approx(1.0)}
    assert s0["cp_imbalance_mean"] == pytest.approx(1.25)
    assert s0["cp_imbalance_max"] == pytest.approx(1.5)
    assert s0["micro_batches"] == 2
    # Balanced step.
    assert s1["imbalance"] == pytest.approx(1.0)
    assert s1["cp_imbalance_mean"] == pytest.approx(1.0)
    summ = wlb_metrics.summarize(t, 0, steps)
    assert summ["steps"] == 2
    assert summ["step_time_ns"] == pytest.approx(700)
    assert summ["imbalance"] == pytest.approx((500 / 350 + 1.0) / 2)


def test_warmup_steps_excluded_from_summary(tmp_path):
    p = write_trace(str(tmp_path / "w.h5"), ranks=HAND_RANKS, events=hand_events(),
                    strategies=["plain"], meta={"warmup": 1})
    t = wlb_trace.load(p)
    summ = wlb_metrics.summarize(t, 0)
    assert summ["steps"] == 1
    assert summ["imbalance"] == pytest.approx(1.0)


def test_doc_lengths_and_workload(hand_trace):
    t = wlb_trace.load(hand_trace)
    assert list(wlb_metrics.doc_lengths(t)) == [10, 20, 30, 40]
    wl, unit = wlb_metrics.mb_workload(t, 0)
    assert unit == "attention pairs (plan)"
    assert wl[(0, 0, 0)] == pytest.approx(10 * 11 / 2 + 20 * 21 / 2)
    assert wl[(0, 0, 1)] == pytest.approx(30 * 31 / 2 + 25 * 26 / 2)


# ---- the report: text, CSV, plots ---------------------------------------------------------

def test_report_writes_summary_csv_and_plots(hand_trace, tmp_path):
    out = tmp_path / "rep"
    r = run_report(hand_trace, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "strategy plain" in r.stdout
    assert "imbalance 1.214" in r.stdout  # mean of 1.4286 and 1.0
    for name in ("imbalance.png", "gantt_plain_step0.png", "gantt_plain_step1.png",
                 "mb_workload_latency.png", "doc_lengths.png", "speedup.png"):
        p = out / name
        assert p.exists(), name
        assert p.stat().st_size > 1000, name
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert str(p) in r.stdout
    assert (out / "summary.txt").read_text() in r.stdout
    rows = (out / "steps.csv").read_text().strip().splitlines()
    header = rows[0].split(",")
    first = dict(zip(header, rows[1].split(",")))
    assert first["strategy"] == "plain" and first["step"] == "0"
    assert float(first["step_time_ms"]) == pytest.approx(700e-6)
    assert float(first["imbalance"]) == pytest.approx(500 / 350)
    assert float(first["cp_imbalance_mean"]) == pytest.approx(1.25)


def test_compare_speedup(hand_trace, tmp_path):
    """Each run's speedups are over its own baseline: a simulated run ten times faster than
    the measured one still shows plain = 1.000x, and no number divides one run by another."""
    segs = HAND_SEGMENTS + [(1,) + s[1:] for s in HAND_SEGMENTS]
    measured = write_trace(str(tmp_path / "meas.h5"), ranks=HAND_RANKS, strategies=["plain", "wlb"],
                           events=hand_events(1.0, 0) + hand_events(0.5, 1), segments=segs)
    simulated = write_trace(str(tmp_path / "sim.h5"), ranks=HAND_RANKS, strategies=["plain", "wlb"],
                            events=hand_events(0.1, 0) + hand_events(0.08, 1), segments=segs,
                            meta={"source": "simulated"})
    out = tmp_path / "cmp"
    r = run_report(measured, "--compare", simulated, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "[measured]" in r.stdout and "[simulated]" in r.stdout
    assert "2.000x" in r.stdout      # measured wlb over measured plain
    assert "1.250x" in r.stdout      # simulated wlb over simulated plain
    for cross in ("10.000x", "0.100x", "20.000x", "12.500x", "0.050x"):
        assert cross not in r.stdout, cross
    assert (out / "speedup.png").stat().st_size > 1000


def test_baseline_option(tmp_path):
    ev = hand_events(strategy=0) + hand_events(scale=2.0, strategy=1)
    p = write_trace(str(tmp_path / "two.h5"), ranks=HAND_RANKS, events=ev, strategies=["wlb", "slow"])
    r = run_report(p, "--out", str(tmp_path / "o"), "--baseline", "slow")
    assert r.returncode == 0, r.stderr
    assert "Speedup vs slow" in r.stdout
    assert "2.000x" in r.stdout
    r = run_report(p, "--out", str(tmp_path / "o2"), "--baseline", "nope")
    assert r.returncode == 2
    assert "nope" in r.stderr


# ---- bad input -> exit 2 with a clear message ----------------------------------------------

def test_missing_file_exit_2(tmp_path):
    r = run_report(str(tmp_path / "none.h5"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2
    assert "none.h5" in r.stderr and "no such file" in r.stderr


def test_not_hdf5_exit_2(tmp_path):
    p = tmp_path / "junk.h5"
    p.write_bytes(b"this is not hdf5" * 100)
    r = run_report(str(p), "--out", str(tmp_path / "o"))
    assert r.returncode == 2
    assert "junk.h5" in r.stderr
    assert "Traceback" not in r.stderr


def test_incomplete_exit_2(tmp_path):
    p = write_trace(str(tmp_path / "inc.h5"), ranks=HAND_RANKS, events=hand_events(),
                    strategies=["plain"], complete=False)
    r = run_report(p, "--out", str(tmp_path / "o"))
    assert r.returncode == 2
    assert "inc.h5" in r.stderr and "incomplete" in r.stderr
    assert not (tmp_path / "o").exists()


def test_truncated_exit_2(hand_trace, tmp_path):
    data = open(hand_trace, "rb").read()
    p = tmp_path / "trunc.h5"
    p.write_bytes(data[: len(data) // 2])
    r = run_report(str(p), "--out", str(tmp_path / "o"))
    assert r.returncode == 2
    assert "trunc.h5" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_compare_file_exit_2(hand_trace, tmp_path):
    r = run_report(hand_trace, "--compare", str(tmp_path / "gone.h5"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2
    assert "gone.h5" in r.stderr


def test_negative_gantt_steps_exit_2(hand_trace, tmp_path):
    r = run_report(hand_trace, "--gantt-steps", "-1", "--out", str(tmp_path / "o"))
    assert r.returncode == 2
    assert "--gantt-steps" in r.stderr
    assert not (tmp_path / "o").exists()


def test_missing_out_argument_exit_2(hand_trace):
    r = run_report(hand_trace)
    assert r.returncode == 2


def _set_meta(f, key, value):
    f["meta"].attrs[key] = value


def _del_meta(f, key, _):
    del f["meta"].attrs[key]


# An attribute edited in a real trace: exit 2 naming what is wrong, nothing written.
@pytest.mark.parametrize("edit,key,value,says", [
    (lambda f, k, v: f.attrs.__setitem__(k, v), "schema_version", 2, "schema_version 2 (/) differs from 1 (/meta)"),
    (lambda f, k, v: f.attrs.__setitem__(k, v), "complete", 0, "'complete' = 0"),
    (_del_meta, "mesh_cp", None, "mesh_cp"),
    (_del_meta, "mesh_dp", None, "mesh_dp"),
    (_set_meta, "mesh_cp", 1, "outside /meta mesh_cp = 1"),
])
def test_edited_attributes_exit_2(hand_trace, tmp_path, edit, key, value, says):
    _refused_after(hand_trace, tmp_path, lambda f: edit(f, key, value), says)


def _refused_after(hand_trace, tmp_path, edit, says):
    """A copy of the trace edited by edit(h5py file): the report exits 2 saying `says`,
    writes nothing."""
    import h5py
    p = tmp_path / "edited.h5"
    p.write_bytes(open(hand_trace, "rb").read())
    with h5py.File(p, "r+") as f:
        edit(f)
    r = run_report(str(p), "--out", str(tmp_path / "o"))
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()


def _edit_events(f, field, value):
    ev = f["events"][()]
    ev[0][field] = value(ev[0])
    f["events"][0] = ev[0]


def _edit_ranks(f, field, value):
    rk = f["ranks"][()]
    rk[0][field] = value(rk)
    f["ranks"][0] = rk[0]


# A damaged table in a real trace: refused as the C++ reader refuses it, not averaged.
@pytest.mark.parametrize("edit,field,value,says", [
    (_edit_events, "end_ns", lambda e: e["start_ns"] - 1, "row 0 is damaged"),
    (_edit_events, "flops", lambda e: -1.0, "row 0 is damaged"),
    (_edit_ranks, "event_count", lambda rk: rk[0]["event_count"] + 1000, "is out of range"),
    (_edit_ranks, "cp", lambda rk: rk[1]["cp"], "two ranks the coordinates"),
    (_edit_ranks, "event_offset", lambda rk: rk[1]["event_offset"], "another rank's events"),
    (_edit_events, "phase", lambda e: 7, "has phase 7 (none, fwd or bwd)"),
])
def test_damaged_tables_exit_2(hand_trace, tmp_path, edit, field, value, says):
    _refused_after(hand_trace, tmp_path, lambda f: edit(f, field, value), says)


def test_mesh_that_is_not_the_world_exit_2(hand_trace, tmp_path):
    def edit(f):
        f["meta"].attrs["mesh_dp"] = int(f["meta"].attrs["mesh_dp"]) + 1
    _refused_after(hand_trace, tmp_path, edit, "is not world_size")


def test_wrong_schema_exit_2(tmp_path):
    p = write_trace(str(tmp_path / "v9.h5"), ranks=HAND_RANKS, events=hand_events(),
                    strategies=["plain"], meta={"schema_version": 9})
    r = run_report(p, "--out", str(tmp_path / "o"))
    assert r.returncode == 2
    assert "schema version 9" in r.stderr


# ---- traces written by the C++ suite ---------------------------------------------------------

def test_cpp_simulated_trace_metrics(cxx_sim_trace):
    t = wlb_trace.load(cxx_sim_trace)
    assert t.source == "simulated"
    assert t.strategies == ["plain", "wlb"]
    assert t.mesh == {"tp": 1, "cp": 2, "pp": 2, "dp": 2}
    plain = wlb_metrics.step_metrics(t, 0)
    wlb = wlb_metrics.step_metrics(t, 1)
    assert len(plain) == 3 and len(wlb) == 3
    for s in plain:
        # per replica: mb latencies 24000 and 36000 ns -> max/mean = 1.2
        assert s["imbalance"] == pytest.approx(1.2)
        # CP: mb0 9000/7500 = 1.2, mb1 15000/13500 -> mean
        assert s["cp_imbalance_mean"] == pytest.approx((1.2 + 15000 / 13500) / 2)
    for s in wlb:
        assert s["imbalance"] == pytest.approx(1.0)
        assert s["cp_imbalance_mean"] == pytest.approx(1.0)
    assert len(wlb_metrics.doc_lengths(t)) > 0


def test_cpp_traces_overlay_report(cxx_sim_trace, tmp_path):
    measured = cxx_measured_traces()
    out = tmp_path / "cpp"
    r = run_report(cxx_sim_trace, "--compare", *measured, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "[simulated]" in r.stdout
    if measured:
        assert "[measured]" in r.stdout
    pngs = list(out.glob("*.png"))
    assert len(pngs) >= 5
    assert all(p.stat().st_size > 1000 for p in pngs)


def test_micropack_latencies_exclude_pipeline_waits(tmp_path):
    """Unit latency (SlimPack's violins): per phase, the sum over stages of the stage's
    compute span of the unit, without pp_recv waits; each over its step's mean."""
    ranks = [(0, 0, 0, 0), (0, 0, 1, 0)]
    ev = []
    # unit 0: stage 0 fwd 10..30 (qkv), stage 1 waits 30..100 (pp_recv) then mlp 100..140
    ev.append(dict(rank=0, step=0, micro_batch=0, phase="fwd", label="qkv_proj", start_ns=10, end_ns=30))
    ev.append(dict(rank=1, step=0, micro_batch=0, phase="fwd", label="pp_recv", start_ns=30, end_ns=100))
    ev.append(dict(rank=1, step=0, micro_batch=0, phase="fwd", label="mlp", start_ns=100, end_ns=140))
    # unit 1: 20 ns on each stage; backward of unit 0 only (the backward grouping differs)
    ev.append(dict(rank=0, step=0, micro_batch=1, phase="fwd", label="mlp", start_ns=30, end_ns=50))
    ev.append(dict(rank=1, step=0, micro_batch=1, phase="fwd", label="mlp", start_ns=140, end_ns=160))
    ev.append(dict(rank=1, step=0, micro_batch=0, phase="bwd", label="mlp", start_ns=160, end_ns=250))
    ev.append(dict(rank=0, step=0, micro_batch=0, phase="bwd", label="mlp", start_ns=250, end_ns=340))
    p = write_trace(str(tmp_path / "mp.h5"), ranks=ranks, events=ev, strategies=["slimpack"])
    t = wlb_trace.load(p)
    steps = wlb_metrics.step_metrics(t, 0)
    mp = wlb_metrics.micropack_latencies(t, steps, 0)
    assert sorted(mp["fwd"]["ms"]) == pytest.approx([40e-6, 60e-6])
    assert sorted(mp["fwd"]["rel"]) == pytest.approx([0.8, 1.2])
    assert mp["fwd"]["cv"] == pytest.approx(0.2)
    assert mp["bwd"]["ms"] == pytest.approx([180e-6])
    assert math.isnan(mp["bwd"]["cv"])


def test_micro_batch_imbalance_excludes_pipeline_waits(tmp_path):
    """The step's imbalance is wlb run's mb-imb: a unit that waited for its pipeline message
    is not slower for it."""
    ranks = [(0, 0, 0, 0), (0, 0, 1, 0)]
    ev = []
    for mb, t0 in ((0, 0), (1, 100)):  # both units: 50 ns on each stage
        ev.append(dict(rank=0, step=0, micro_batch=mb, phase="fwd", label="mlp", start_ns=t0, end_ns=t0 + 50))
        ev.append(dict(rank=1, step=0, micro_batch=mb, phase="fwd", label="mlp", start_ns=t0 + 60, end_ns=t0 + 110))
    # unit 1 waited 300 ns on stage 1 for its message
    ev.append(dict(rank=1, step=0, micro_batch=1, phase="fwd", label="pp_recv", start_ns=200, end_ns=500))
    p = write_trace(str(tmp_path / "w.h5"), ranks=ranks, events=ev, strategies=["wlb"])
    s = wlb_metrics.step_metrics(wlb_trace.load(p), 0)[0]
    assert s["imbalance"] == pytest.approx(1.0)


def test_speedup_pairs_measured_steps_and_skips_empty_baseline_resamples():
    """Each strategy's drain folds into its own last measured step (model::foldDrain); a
    resample of only empty baseline steps has no ratio and is left out, not NaN."""

    class T:  # what fold_drain reads: warm-up 1, 3 measured steps, then drain
        warmup = 1
        meta = {"measured_steps": 3}

    base = [(1, 10.0, 100.0), (2, 10.0, 100.0), (3, 10.0, 100.0), (4, 10.0, 50.0)]
    other = [(1, 10.0, 100.0), (2, 10.0, 100.0), (3, 10.0, 100.0), (4, 5.0, 20.0), (5, 5.0, 30.0)]
    fb, fo = wlb_metrics.fold_drain(T, base), wlb_metrics.fold_drain(T, other)
    assert [w[0] for w in fb] == [1, 2, 3] and [w[0] for w in fo] == [1, 2, 3]
    assert fb[-1][1:] == (20.0, 150.0) and fo[-1][1:] == (20.0, 150.0)
    r, lo, hi = wlb_metrics.throughput_speedup(fb, fo)
    assert r == pytest.approx(1.0) and lo == pytest.approx(1.0) and hi == pytest.approx(1.0)
    # a baseline that trained nothing in two of three steps: some resamples are all-empty
    r, lo, hi = wlb_metrics.throughput_speedup([(0, 1.0, 0.0), (1, 1.0, 0.0), (2, 1.0, 10.0)],
                                               [(0, 1.0, 5.0), (1, 1.0, 5.0), (2, 1.0, 10.0)])
    assert not any(math.isnan(x) for x in (r, lo, hi))

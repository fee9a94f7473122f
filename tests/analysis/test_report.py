"""Analysis of wlb traces: metrics against hand-computed values, plots, exit codes."""

import glob
import os
import subprocess
import sys

import pytest

from conftest import REPORT, cxx_trace_dir, write_synthetic
from wlb_metrics import step_metrics
from wlb_trace import TraceError, load


def run_report(*args):
    return subprocess.run([sys.executable, REPORT, *args], capture_output=True, text=True, timeout=300)


def test_metrics_match_hand_computed(synthetic_trace):
    t = load(synthetic_trace)
    [m] = step_metrics(t, 0)
    assert m["step_time_ns"] == 450  # rank 0 spans [0, 450)
    assert m["micro_batches"] == 2
    # Micro-batch latency = slowest CP rank: mb0 max(300, 150) = 300, mb1 max(150, 250) = 250.
    assert m["mb_latency_ns"] == {(0, 0): 300, (0, 1): 250}
    assert m["imbalance"] == pytest.approx(300 / 275)
    # Forward: mb0 max(100, 50) = 100, mb1 max(50, 100) = 100 -> balanced.
    assert m["imbalance_fwd"] == pytest.approx(1.0)
    # Backward: mb0 max(200, 100) = 200, mb1 max(100, 150) = 150.
    assert m["imbalance_bwd"] == pytest.approx(200 / 175)
    # CP imbalance: mb0 300 vs 150 -> 300/225, mb1 150 vs 250 -> 250/200.
    assert m["cp_imbalance_by_mb"][(0, 0)] == pytest.approx(300 / 225)
    assert m["cp_imbalance_by_mb"][(0, 1)] == pytest.approx(250 / 200)
    assert m["cp_imbalance_max"] == pytest.approx(300 / 225)
    assert m["cp_imbalance_mean"] == pytest.approx((300 / 225 + 250 / 200) / 2)
    assert list(m["busy_ns"]) == [450, 400]
    assert list(m["idle_ns"]) == [0, 50]


def test_report_writes_summary_csv_and_nonempty_pngs(synthetic_trace, tmp_path):
    out = tmp_path / "report"
    r = run_report(synthetic_trace, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "plain" in r.stdout
    assert "1.091" in r.stdout  # the imbalance degree 300/275
    assert (out / "summary.txt").stat().st_size > 0
    assert (out / "steps.csv").stat().st_size > 0
    pngs = glob.glob(str(out / "*.png"))
    assert pngs, "no plots written"
    for p in pngs:
        with open(p, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n", p
        assert os.path.getsize(p) > 1000, p


def test_compare_two_runs_makes_speedup_plot(synthetic_trace, tmp_path):
    other = tmp_path / "other.h5"
    write_synthetic(str(other))
    out = tmp_path / "cmp"
    r = run_report(synthetic_trace, "--compare", str(other), "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    assert os.path.getsize(out / "speedup.png") > 1000


@pytest.mark.parametrize("kind", ["missing", "not_hdf5", "truncated", "incomplete"])
def test_bad_files_exit_2_with_message(tmp_path, kind):
    p = tmp_path / f"{kind}.h5"
    if kind == "not_hdf5":
        p.write_text("this is not a trace\n")
    elif kind == "truncated":
        write_synthetic(str(p))
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 3])
    elif kind == "incomplete":
        write_synthetic(str(p), complete=False)
    out = tmp_path / "out"
    r = run_report(str(p), "--out", str(out))
    assert r.returncode == 2
    assert str(p) in r.stderr
    assert not out.exists() or not any(out.iterdir()), "nothing may be written for a bad file"
    with pytest.raises(TraceError):
        load(str(p))


def test_unwritable_out_exits_2_naming_it(synthetic_trace, tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    r = run_report(synthetic_trace, "--out", str(blocker / "report"), "--quiet")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "afile" in r.stderr


CXX_DIR = cxx_trace_dir()


@pytest.mark.skipif(not CXX_DIR or not glob.glob(os.path.join(CXX_DIR or ".", "trace*_np*.h5")),
                    reason="no C++-written traces (run ctest with WLB_TRACE_TEST_DIR set, as ./run/tests does)")
def test_reports_on_traces_written_by_the_cxx_writer(tmp_path):
    files = sorted(glob.glob(os.path.join(CXX_DIR, "trace*_np*.h5")))
    for f in files:
        t = load(f)
        assert t.source in ("measured", "simulated")
        assert len(t.ranks["rank"]) >= 1
        r = run_report(f, "--out", str(tmp_path / os.path.basename(f)), "--quiet")
        assert r.returncode == 0, f + ": " + r.stderr
    measured = [f for f in files if "_sim_" not in os.path.basename(f)]
    simulated = [f for f in files if "_sim_" in os.path.basename(f)]
    if measured and simulated:  # overlay measured and simulated in one report
        r = run_report(measured[0], "--compare", simulated[0], "--out", str(tmp_path / "overlay"), "--quiet")
        assert r.returncode == 0, r.stderr

"""Shared fixtures: a hand-built synthetic trace and the traces the C++ tests wrote."""

import os
import sys

import numpy as np
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "analysis"))

REPORT = os.path.join(ROOT, "analysis", "wlb_report.py")

# Two CP ranks, one step, two micro-batches, all events are attention (ns):
#   rank 0: mb0 fwd [0,100) bwd [100,300)   mb1 fwd [300,350) bwd [350,450)
#   rank 1: mb0 fwd [0, 50) bwd [ 50,150)   mb1 fwd [150,250) bwd [250,400)
SYNTH_EVENTS = [
    # rank, mb, phase(1 fwd, 2 bwd), start, end, flops
    (0, 0, 1, 0, 100, 10.0), (0, 0, 2, 100, 300, 20.0), (0, 1, 1, 300, 350, 5.0), (0, 1, 2, 350, 450, 10.0),
    (1, 0, 1, 0, 50, 5.0), (1, 0, 2, 50, 150, 10.0), (1, 1, 1, 150, 250, 10.0), (1, 1, 2, 250, 400, 15.0),
]


def write_synthetic(path, complete=True):
    import h5py

    str_dt = h5py.string_dtype("utf-8")
    with h5py.File(path, "w") as f:
        meta = f.create_group("meta")
        for k, v in {"schema_version": 1, "source": "measured", "mesh_tp": 1, "mesh_cp": 2, "mesh_pp": 1,
                     "mesh_dp": 1, "mpi_size": 2, "warmup": 0, "deck": "[mesh]\ncp = 2\n",
                     "git_hash": "synthetic", "kokkos_version": "3.4.1", "kokkos_backend": "Serial",
                     "start_time": "2026-01-01T00:00:00Z"}.items():
            meta.attrs[k] = v
        meta.create_dataset("strategies", data=np.array(["plain"], dtype=object), dtype=str_dt)
        f.create_dataset("regions", data=np.array(["step", "attn"], dtype=object), dtype=str_dt)
        rank_dt = np.dtype([(k, "<i8") for k in ("rank", "tp", "cp", "pp", "dp", "event_offset", "event_count")])
        f.create_dataset("ranks", data=np.array([(0, 0, 0, 0, 0, 0, 4), (1, 0, 1, 0, 0, 4, 4)], dtype=rank_dt))
        ev_dt = np.dtype([("rank", "<i4"), ("strategy", "<i4"), ("step", "<i8"), ("micro_batch", "<i4"),
                          ("region", "<i4"), ("layer", "<i4"), ("chunk", "<i4"), ("phase", "<i4"),
                          ("start_ns", "<i8"), ("end_ns", "<i8"), ("flops", "<f8"), ("bytes", "<f8")])
        rows = [(r, 0, 0, mb, 1, 0, 0, ph, s, e, fl, 0.0) for (r, mb, ph, s, e, fl) in SYNTH_EVENTS]
        f.create_dataset("events", data=np.array(rows, dtype=ev_dt))
        plan = f.create_group("plan")
        seg_dt = np.dtype([(k, "<i8") for k in ("strategy", "step", "dp", "micro_batch", "index", "doc", "offset",
                                                  "length", "arrival_step")])
        segs = [(0, 0, 0, 0, 0, 1, 0, 300, 0), (0, 0, 0, 1, 0, 2, 0, 100, 0), (0, 0, 0, 1, 1, 3, 0, 100, 0)]
        plan.create_dataset("segments", data=np.array(segs, dtype=seg_dt))
        plan.create_dataset("steps", data=np.array([(0, 0)], dtype=np.dtype([("strategy", "<i8"), ("step", "<i8")])))
        plan.create_dataset("packing_json", data=np.array(["{}"], dtype=object), dtype=str_dt)
        plan.create_dataset("shard_json", data=np.array(["{}"], dtype=object), dtype=str_dt)
        if complete:
            f.attrs["complete"] = np.int32(1)


@pytest.fixture
def synthetic_trace(tmp_path):
    p = tmp_path / "synthetic.h5"
    write_synthetic(str(p))
    return str(p)


def cxx_trace_dir():
    d = os.environ.get("WLB_TRACE_TEST_DIR")
    if not d:
        b = os.environ.get("WLB_BUILD_DIR")
        d = os.path.join(b, "test-traces") if b else None
    return d

"""Load a wlb trace file (docs/trace-schema.md) into numpy arrays.

Only h5py and numpy are needed. Every problem with the file (missing, not HDF5,
truncated, incomplete, schema mismatch) raises TraceError with a message naming the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

SUPPORTED_SCHEMA = 1

PHASE_NONE, PHASE_FWD, PHASE_BWD = 0, 1, 2
PHASE_NAMES = {PHASE_NONE: "none", PHASE_FWD: "fwd", PHASE_BWD: "bwd"}

EVENT_FIELDS = ("rank", "strategy", "step", "micro_batch", "region", "layer", "chunk",
                "phase", "start_ns", "end_ns", "flops", "bytes")
RANK_FIELDS = ("rank", "tp", "cp", "pp", "dp")
SEGMENT_FIELDS = ("strategy", "step", "dp", "micro_batch", "index", "doc", "offset", "length",
                  "arrival_step")
# `wlb train` metrics (/train/steps, /train/ranks); integers stay int64, the rest float64.
TRAIN_STEP_FIELDS = ("step", "tokens", "predicted", "documents", "loss", "eval_loss", "lr", "grad_norm",
                     "seconds", "tokens_per_second")
TRAIN_RANK_FIELDS = ("step", "rank", "tokens", "step_seconds", "data_seconds", "compute_seconds",
                     "attn_seconds", "cp_comm_seconds", "tp_comm_seconds", "allreduce_seconds", "optimizer_seconds",
                     "eval_seconds")
# the rank's activation pool in the step; traces written before these fields lack them
TRAIN_RANK_POOL_FIELDS = ("allocations", "pool_bytes", "pool_live_bytes", "pool_requested_bytes")
_TRAIN_INTS = ("step", "rank", "tokens", "predicted", "documents") + TRAIN_RANK_POOL_FIELDS


class TraceError(Exception):
    """A trace file cannot be used (message names the file)."""


@dataclass
class Trace:
    path: str
    meta: dict
    strategies: list
    regions: list
    ranks: dict            # field -> np.ndarray, one entry per world rank
    events: dict           # field -> np.ndarray, one entry per event
    segments: dict         # field -> np.ndarray, one entry per plan segment
    plan_steps: dict       # "strategy", "step" arrays + "packing_json", "shard_json" lists
    mesh: dict = field(default_factory=dict)  # tp, cp, pp, dp sizes
    train_steps: dict = field(default_factory=dict)  # wlb train: field -> np.ndarray per step ({} otherwise)
    train_ranks: dict = field(default_factory=dict)  # wlb train: field -> np.ndarray per (step, rank)

    @property
    def source(self) -> str:
        return str(self.meta.get("source", "measured"))

    @property
    def warmup(self) -> int:
        return int(self.meta.get("warmup", 0))

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def region_id(self, label: str) -> int:
        """Id of an op label, or -1 if the file has none."""
        try:
            return self.regions.index(label)
        except ValueError:
            return -1

    def strategy_id(self, name: str) -> int:
        return self.strategies.index(name)

    def coords(self):
        """(tp, cp, pp, dp) arrays indexed by rank."""
        n = int(self.ranks["rank"].max()) + 1 if len(self.ranks["rank"]) else 0
        out = {}
        for k in ("tp", "cp", "pp", "dp"):
            a = np.zeros(n, dtype=np.int64)
            a[self.ranks["rank"]] = self.ranks[k]
            out[k] = a
        return out


def _decode(v):
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, np.ndarray) and v.shape == ():
        return v.item()
    if isinstance(v, np.generic):
        return v.item()
    return v


def _strings(ds):
    out = []
    for v in ds[()]:
        out.append(v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v))
    return out


def _table(f, path, fields, fname):
    if path not in f:
        raise TraceError(f"{fname}: missing dataset /{path} (not a wlb trace?)")
    ds = f[path]
    if ds.dtype.names is None:
        raise TraceError(f"{fname}: /{path} is not a compound table")
    data = ds[()]
    out = {}
    for k in fields:
        if k not in ds.dtype.names:
            raise TraceError(f"{fname}: /{path} lacks the field '{k}'")
        col = data[k]
        out[k] = np.asarray(col).astype(np.float64 if k in ("flops", "bytes") else np.int64)
    return out


def _train_table(f, path, fields, fname, optional=()):
    """A /train table (absent -> {}), integer fields int64, the others float64; `optional`
    fields are read where the file has them."""
    if path not in f:
        return {}
    out = _table(f, path, (), fname)
    data = f[path][()]
    for k in fields:
        if k not in data.dtype.names:
            raise TraceError(f"{fname}: /{path} lacks the field '{k}'")
        out[k] = np.asarray(data[k]).astype(np.int64 if k in _TRAIN_INTS else np.float64)
    for k in optional:
        if k in data.dtype.names:
            out[k] = np.asarray(data[k]).astype(np.int64)
    return out


def load(path: str) -> Trace:
    """Read a complete trace file. Raises TraceError on any problem."""
    try:
        import h5py
    except ImportError as e:  # pragma: no cover
        raise TraceError(f"h5py is not available ({e}); run with /usr/bin/python3") from e
    if not os.path.exists(path):
        raise TraceError(f"{path}: no such file")
    if not os.path.isfile(path):
        raise TraceError(f"{path}: not a regular file")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise TraceError(f"{path}: not a readable HDF5 file (truncated or damaged): {e}") from e
    try:
        with f:
            complete = f.attrs.get("complete", None)
            if complete is None:
                raise TraceError(f"{path}: incomplete trace (no 'complete' attribute: the writer did not finish)")
            if int(np.asarray(complete).ravel()[0]) != 1:
                raise TraceError(f"{path}: incomplete trace ('complete' = {int(np.asarray(complete).ravel()[0])}, "
                                 "not 1: the writer did not finish)")
            if "meta" not in f:
                raise TraceError(f"{path}: missing group /meta (not a wlb trace?)")
            meta = {k: _decode(v) for k, v in f["meta"].attrs.items()}
            if "deck" not in meta and "meta/deck" in f:
                meta["deck"] = _strings(f["meta/deck"])[0]
            # the version is the root's attribute; /meta repeats it
            version = int(meta.get("schema_version", 0))
            if "schema_version" in f.attrs:
                root = int(np.asarray(f.attrs["schema_version"]).ravel()[0])
                if "schema_version" in meta and root != version:
                    raise TraceError(f"{path}: schema_version {root} (/) differs from {version} (/meta)")
                version = root
            if version < 1 or version > SUPPORTED_SCHEMA:
                raise TraceError(f"{path}: unsupported trace schema version {version} "
                                 f"(this analysis reads version {SUPPORTED_SCHEMA})")
            for d in ("meta/strategies", "regions", "plan/packing_json", "plan/shard_json"):
                if d not in f:
                    raise TraceError(f"{path}: missing dataset /{d}")
            strategies = _strings(f["meta/strategies"])
            regions = _strings(f["regions"])
            ranks = _table(f, "ranks", RANK_FIELDS + ("event_offset", "event_count"), path)
            events = _table(f, "events", EVENT_FIELDS, path)
            segments = _table(f, "plan/segments", SEGMENT_FIELDS, path)
            steps = _table(f, "plan/steps", ("strategy", "step"), path)
            steps["packing_json"] = _strings(f["plan/packing_json"])
            steps["shard_json"] = _strings(f["plan/shard_json"])
            train_steps = _train_table(f, "train/steps", TRAIN_STEP_FIELDS, path)
            train_ranks = _train_table(f, "train/ranks", TRAIN_RANK_FIELDS, path, TRAIN_RANK_POOL_FIELDS)
    except TraceError:
        raise
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise TraceError(f"{path}: damaged trace ({e})") from e

    n_events = len(events["rank"])
    if n_events:
        if events["region"].min() < 0 or events["region"].max() >= len(regions):
            raise TraceError(f"{path}: /events refers to labels outside /regions")
        if events["strategy"].min() < 0 or events["strategy"].max() >= len(strategies):
            raise TraceError(f"{path}: /events refers to strategies outside /meta/strategies")
        if events["rank"].min() < 0 or events["rank"].max() >= max(len(ranks["rank"]), 1):
            raise TraceError(f"{path}: /events refers to ranks outside /ranks")
    # An edited or damaged file is refused, as the C++ reader (src/trace/reader.cpp) refuses
    # it, not averaged into the report.
    if n_events:
        bad = np.flatnonzero((events["end_ns"] < events["start_ns"]) | ~np.isfinite(events["flops"]) |
                             (events["flops"] < 0) | ~np.isfinite(events["bytes"]) | (events["bytes"] < 0))
        if len(bad):
            raise TraceError(f"{path}: /events row {int(bad[0])} is damaged (an end before its start, or a FLOP or "
                             "byte count that is negative or not a number)")
        phase = events["phase"].astype(np.int64)
        bad = np.flatnonzero((phase < 0) | (phase > 2))
        if len(bad):
            raise TraceError(f"{path}: /events row {int(bad[0])} has phase {int(phase[bad[0]])} (none, fwd or bwd)")
    coords = set()
    for i in range(len(ranks["rank"])):
        off, cnt = int(ranks["event_offset"][i]), int(ranks["event_count"][i])
        if off < 0 or cnt < 0 or off + cnt > n_events:
            raise TraceError(f"{path}: /ranks event slice of rank {int(ranks['rank'][i])} is out of range")
        if cnt and np.any(events["rank"][off:off + cnt] != ranks["rank"][i]):
            raise TraceError(f"{path}: /ranks event slice of rank {int(ranks['rank'][i])} holds another rank's events")
        c = tuple(int(ranks[k][i]) for k in ("tp", "cp", "pp", "dp"))
        if c in coords:
            raise TraceError(f"{path}: /ranks gives two ranks the coordinates (tp, cp, pp, dp) = {c}")
        coords.add(c)
    missing = [f"mesh_{k}" for k in ("tp", "cp", "pp", "dp") if f"mesh_{k}" not in meta]
    if missing:
        raise TraceError(f"{path}: /meta lacks {', '.join(missing)} (not a complete wlb trace)")
    mesh = {k: int(meta[f"mesh_{k}"]) for k in ("tp", "cp", "pp", "dp")}
    if min(mesh.values()) < 1:
        raise TraceError(f"{path}: /meta mesh {mesh} has a size below 1")
    for k in ("tp", "cp", "pp", "dp"):
        if len(ranks[k]) and (ranks[k].min() < 0 or ranks[k].max() >= mesh[k]):
            raise TraceError(f"{path}: /ranks {k} coordinates lie outside /meta mesh_{k} = {mesh[k]}")
    if "world_size" in meta and mesh["tp"] * mesh["cp"] * mesh["pp"] * mesh["dp"] != int(meta["world_size"]):
        raise TraceError(f"{path}: /meta mesh {mesh} is not world_size {int(meta['world_size'])}")
    return Trace(path=path, meta=meta, strategies=strategies, regions=regions, ranks=ranks,
                 events=events, segments=segments, plan_steps=steps, mesh=mesh, train_steps=train_steps,
                 train_ranks=train_ranks)

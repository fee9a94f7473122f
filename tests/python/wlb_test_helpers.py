"""Helpers of the Python-module tests (a module of its own: `conftest` is a name every
test directory uses)."""

import json
import os

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def deck_path(name):
    return os.path.join(ROOT, "inputs", name)


def cli_env():
    env = dict(os.environ)
    # the driver initialises MPI; a singleton run as root needs OpenMPI's consent (run/mpienv)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_plm", "isolated")
    return env


def cli_error(proc):
    """The message of a failed `wlb` call (after 'wlb: error: '), exit code 2."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [x for x in proc.stderr.splitlines() if x.startswith("wlb: error: ")]
    assert lines, proc.stderr
    # a message may continue on further lines (TOML syntax errors)
    first = proc.stderr.index(lines[0]) + len("wlb: error: ")
    return proc.stderr[first:].rstrip("\n")


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(x) for x in f]


def normalise_step(line):
    """A step line without what differs between two runs of the same plan: the wall time
    of pack() and the MILP solver's seconds."""
    line = json.loads(json.dumps(line))
    m = line.get("metrics", {})
    m.pop("plan_us", None)
    if "solver" in m:
        m["solver"].pop("seconds", None)
    return line


def tiles_documents(segments, lengths):
    """Every document's segments tile [0, length) exactly once. segments: (n, 4) array
    [doc, offset, length, arrival]; lengths: {doc: length}. Returns a list of problems."""
    problems = []
    segs = np.asarray(segments, dtype=np.int64).reshape(-1, 4)
    order = np.lexsort((segs[:, 1], segs[:, 0]))
    segs = segs[order]
    docs, first = np.unique(segs[:, 0], return_index=True)
    ends = np.append(first[1:], len(segs))
    for d, b, e in zip(docs.tolist(), first.tolist(), ends.tolist()):
        off, ln = segs[b:e, 1], segs[b:e, 2]
        expect = np.concatenate(([0], np.cumsum(ln)[:-1]))
        if not np.array_equal(off, expect):
            problems.append(f"doc {d}: offsets {off.tolist()} lengths {ln.tolist()} do not tile")
        if d not in lengths:
            problems.append(f"doc {d}: never arrived")
        elif int(ln.sum()) != lengths[d]:
            problems.append(f"doc {d}: {int(ln.sum())} of {lengths[d]} tokens")
    missing = set(lengths) - set(docs.tolist())
    if missing:
        problems.append(f"{len(missing)} documents never trained nor held, e.g. {sorted(missing)[:5]}")
    return problems

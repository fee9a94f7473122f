"""examples/torch_train.py runs as the README shows it: trains, checkpoints, resumes."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def run(*args):
    env = dict(os.environ)
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", "torch_train.py"), *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_example_trains_and_resumes(tmp_path):
    work = tmp_path / "work"
    first = run("--steps", 3, "--window", 256, "--workdir", work)
    assert first.returncode == 0, first.stderr
    assert re.findall(r"^step +(\d+) ", first.stdout, re.M) == ["0", "1", "2"]
    assert (work / "corpus.idx").exists() and (work / "checkpoint.pt").exists()
    # continue as a CP group of 2 processes with worker processes: the steps pick up where they stopped
    second = run("--steps", 5, "--window", 256, "--workdir", work, "--resume", "--cp", 2, "--workers", 1,
                 "--sharding", "hybrid", "--comm", "allgather")
    assert second.returncode == 0, second.stderr
    assert "at step 3" in second.stdout
    assert re.findall(r"^step +(\d+) ", second.stdout, re.M) == ["3", "4"]
    for line in re.findall(r"^step .*$", first.stdout + second.stdout, re.M):
        assert float(re.search(r"loss (\S+)", line).group(1)) > 0


def losses(out):
    return [float(x) for x in re.findall(r"^step +\d+ +loss (\S+)", out, re.M)]


def test_cp2_trains_like_one_process(tmp_path):
    """Two processes sharing each micro-batch through wlb.torch.cp_attention reach the losses
    of one process over 20 steps (FP32: only the order of sums differs)."""
    one = run("--steps", 20, "--window", 256, "--workdir", tmp_path / "one")
    assert one.returncode == 0, one.stderr
    (tmp_path / "two").mkdir()
    for ext in ("idx", "bin"):  # the same corpus (written once by the first run)
        (tmp_path / "two" / f"corpus.{ext}").write_bytes((tmp_path / "one" / f"corpus.{ext}").read_bytes())
    two = run("--steps", 20, "--window", 256, "--workdir", tmp_path / "two", "--cp", 2)
    assert two.returncode == 0, two.stderr
    a, b = losses(one.stdout), losses(two.stdout)
    assert len(a) == len(b) == 20
    assert "KV" in two.stdout  # the CP run moved K/V
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= 1e-5 * max(1.0, abs(x)), (i, x, y)
    assert a[-1] < a[0]

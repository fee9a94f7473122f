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
    # continue with CP views and worker processes: the steps pick up where they stopped
    second = run("--steps", 5, "--window", 256, "--workdir", work, "--resume", "--cp", 2, "--workers", 1)
    assert second.returncode == 0, second.stderr
    assert "at step 3" in second.stdout
    assert re.findall(r"^step +(\d+) ", second.stdout, re.M) == ["3", "4"]
    for line in re.findall(r"^step .*$", first.stdout + second.stdout, re.M):
        assert float(re.search(r"loss (\S+)", line).group(1)) > 0

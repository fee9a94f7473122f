"""Fixtures of the Python-module tests: the built `wlb` command and module.

run/tests puts $WLB_BUILD_DIR/python on PYTHONPATH and exports WLB_BUILD_DIR; by hand:
    PYTHONPATH=build/python WLB_BUILD_DIR=build /usr/bin/python3 -m pytest -q tests/python
"""

import os
import subprocess

import pytest

from wlb_test_helpers import ROOT, cli_env

try:
    import wlb  # noqa: F401
except ImportError as e:  # a clear message instead of a collection error per file
    raise ImportError(f"cannot import the wlb module ({e}): build it (cmake --build BUILD --target wlb_python) "
                      "and put BUILD/python on PYTHONPATH (run/tests does)") from e


@pytest.fixture(scope="session")
def wlb_bin():
    b = os.environ.get("WLB_BUILD_DIR", os.path.join(ROOT, "build"))
    path = os.path.join(b, "bin", "wlb")
    if not os.path.exists(path):
        pytest.skip("the wlb command is not built (set WLB_BUILD_DIR)")
    return path


@pytest.fixture(scope="session")
def cli(wlb_bin):
    """cli(*args) runs `wlb ARGS` and returns the CompletedProcess (check=False)."""

    def run(*args):
        return subprocess.run([wlb_bin, *map(str, args)], capture_output=True, text=True, cwd=ROOT, env=cli_env())

    return run

"""The loud summary of tests skipped for want of torch (tests/conftest.py), run for real:
a pytest subprocess with that conftest as a plugin on a suite that skips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_torch_skips_are_listed_loudly(tmp_path) -> None:
    (tmp_path / "test_suite.py").write_text(
        "import pytest\n"
        "def test_group():\n"
        "    pytest.importorskip('torch_that_is_not_installed_kvwire')\n"
        "def test_other():\n"
        "    pytest.skip('needs a GPU')\n"
        "def test_ok():\n"
        "    pass\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]))
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
         str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 test(s) SKIPPED because torch is missing" in r.stdout, r.stdout
    assert "SKIPPED test_suite.py::test_group: could not import" in r.stdout, r.stdout
    assert "test_other" not in r.stdout.split("because torch is missing")[1]  # not torch

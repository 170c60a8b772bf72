"""For the tests of conftest's loud skip summary (tests/test_*_skips.py): a pytest run, for
real, in a subprocess with tests/conftest.py as a plugin, on a small suite of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def run_suite(tmp_path: Path, suite: str) -> str:
    """pytest's output for ``suite`` (the text of ``test_suite.py``), which must pass."""
    (tmp_path / "test_suite.py").write_text(suite)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]),
        # only the plugin under test: the installed ones (hypothesis, anyio, timeout) add
        # ~1.5 s to each run and nothing the suite uses
        PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
         str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout

"""Without the engines' wheels the engines tier skips, and says so loudly (conftest's summary
names vLLM and SGLang): run for real, a pytest subprocess on a suite missing both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_missing_engine_wheels_are_listed_loudly(tmp_path) -> None:
    (tmp_path / "test_suite.py").write_text(
        "from engine_helpers import import_or_skip\n"
        "def test_v():\n"
        "    import_or_skip('vllm_not_installed_kvwire.kv_events', 'vllm (vllm==0.33.0)')\n"
        "def test_s():\n"
        "    import_or_skip('sglang_not_installed_kvwire.kv', 'sglang (sglang==0.5.23)')\n"
        "def test_ok():\n"
        "    pass\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]))
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
         str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    for what, test in (("vllm", "test_v"), ("sglang", "test_s")):
        assert f"1 test(s) SKIPPED because {what} is missing" in r.stdout, r.stdout
        assert f"SKIPPED test_suite.py::{test}: {what} ({what}==" in r.stdout, r.stdout
    assert "ENGINES stamp" in r.stdout

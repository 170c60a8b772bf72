"""The loud summary of tests skipped for want of torch (tests/conftest.py), run for real:
a pytest subprocess with that conftest as a plugin on a suite that skips."""

from __future__ import annotations

from skip_helpers import run_suite


def test_torch_skips_are_listed_loudly(tmp_path) -> None:
    out = run_suite(tmp_path, (
        "import pytest\n"
        "def test_group():\n"
        "    pytest.importorskip('torch_that_is_not_installed_kvwire')\n"
        "def test_other():\n"
        "    pytest.skip('needs a GPU')\n"
        "def test_ok():\n"
        "    pass\n"
    ))
    assert "1 test(s) SKIPPED because torch is missing" in out, out
    assert "SKIPPED test_suite.py::test_group: could not import" in out, out
    assert "test_other" not in out.split("because torch is missing")[1]  # not torch

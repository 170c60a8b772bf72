"""Without the engines' wheels the engines tier skips, and says so loudly (conftest's summary
names vLLM and SGLang; SGLang's router tier apart, with its own package and stamp): run for
real, a pytest subprocess on a suite missing them."""

from __future__ import annotations

import subprocess
import sys

from engine_helpers import engine_env
from skip_helpers import run_suite


def test_missing_engine_wheels_are_listed_loudly(tmp_path) -> None:
    out = run_suite(tmp_path, (
        "from engine_helpers import import_or_skip\n"
        "def test_v():\n"
        "    import_or_skip('vllm_not_installed_kvwire.kv_events', 'vllm (vllm==0.33.0)')\n"
        "def test_s():\n"
        "    import_or_skip('sglang_not_installed_kvwire.kv', 'sglang (sglang==0.5.23)')\n"
        "def test_d():\n"
        "    import_or_skip('dynamo_not_installed_kvwire._core', "
        "'ai-dynamo-runtime (ai-dynamo-runtime==1.6.1)')\n"
        "def test_ok():\n"
        "    pass\n"
    ))
    for what, test in (("vllm", "test_v"), ("sglang", "test_s")):
        assert f"1 test(s) SKIPPED because {what} is missing" in out, out
        assert f"SKIPPED test_suite.py::{test}: {what} ({what}==" in out, out
    assert "ENGINES stamp" in out
    assert "1 test(s) SKIPPED because dynamo is missing" in out, out
    assert "SKIPPED test_suite.py::test_d: ai-dynamo-runtime (" in out, out
    assert "(the DYNAMO stamp)" in out, out
    assert "DYNAMO stamp" in out


def test_switch_on_without_the_engine_logs_and_returns() -> None:
    """A switch on where the engine's modules cannot be imported: an error naming the
    switch, and register() returns (a plugin must never stop the engine from starting).
    The modules are made unimportable for real (None in sys.modules), no vLLM needed."""
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s')\n"
        "for m in ('vllm', 'sglang'):\n"
        "    sys.modules[m] = None\n"
        "from kvwire.plugins import sglang, vllm\n"
        "vllm.register(); sglang.register()\n"
        "print('returned')\n"
    )
    env = engine_env(KVWIRE_VLLM_EVENTS="1", KVWIRE_SGLANG_EVENTS="yes",
                     KVWIRE_VLLM_SHM="maybe")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0 and "returned" in r.stdout, r.stderr
    err = r.stderr
    assert "ERROR kvwire: KVWIRE_VLLM_EVENTS=1 but kvwire's KV event publisher could not be " \
           "installed (ModuleNotFoundError" in err, err
    assert "vLLM keeps its own publisher" in err and "SGLang keeps its own publisher" in err
    assert "KVWIRE_VLLM_SHM='maybe' is not one of" in err  # a typo is off, and said so
    assert "active in" not in err


def test_sglang_routers_tier_names_its_own_package_and_stamp(tmp_path) -> None:
    """SGLang's router tier (tests/test_sglang_router_pd.py, its own skip, sglang_router made
    unimportable for real) is listed under sglang-router with the ROUTERS stamp, and SGLang's
    engine tier apart under sglang with the ENGINES stamp: neither is the other's."""
    out = run_suite(tmp_path, (
        "import sys\n"
        "sys.modules['sglang_router'] = None\n"
        "from engine_helpers import import_or_skip\n"
        "from test_sglang_router_pd import routed, "
        "test_sglang_router_pd_in_front_of_kvwire_engines  # noqa: F401\n"
        "def test_s():\n"
        "    import_or_skip('sglang_not_installed_kvwire.kv', 'sglang (sglang==0.5.23)')\n"
    ))
    router = "test_suite.py::test_sglang_router_pd_in_front_of_kvwire_engines"
    blocks = out.split("!!!!!!!! ")
    (mine,) = [b for b in blocks if "because sglang-router is missing" in b]
    (engine,) = [b for b in blocks if "because sglang is missing" in b]
    assert "1 test(s) SKIPPED because sglang-router is missing" in mine, out
    assert f"SKIPPED {router}: sglang-router is missing" in mine, out
    assert "install sglang-router==0.3.2" in mine and "the ROUTERS stamp" in mine, out
    assert "1 test(s) SKIPPED because sglang is missing" in engine, out
    assert router not in engine and "test_suite.py::test_s:" in engine, out
    assert "install sglang==0.5.23" in engine and "the ENGINES stamp" in engine, out

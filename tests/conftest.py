"""Shared fixtures: the golden vectors, vendored into ``tests/data`` (see its README), and a
ZeroMQ context with the publishers made on it (shut down before the context goes)."""

from __future__ import annotations

import atexit
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import settings

from kvwire.publish.publisher import ZmqEventPublisher

DATA = Path(__file__).resolve().parent / "data"
VECTORS = DATA / "kv_events.json"

# Hypothesis' default 200 ms per-example deadline measures the machine, not the property: on a
# loaded 2-core CI box one slow example fails a correct test. Every property test runs without it.
# `make test` is reproducible: each property test draws the same examples every run (derived
# from the test itself), so a clean-clone CI run fails for a change, never for a new draw.
# New examples are drawn by `make fuzz` (KVWIRE_FUZZ=1: a fresh seed a round); what it finds
# becomes a fixed test (docs/testing.md, "Property tests").
settings.register_profile("kvwire", deadline=None, derandomize=True, database=None)
settings.register_profile("fuzz", deadline=None, database=None, print_blob=True)
settings.load_profile("fuzz" if os.environ.get("KVWIRE_FUZZ") else "kvwire")


def _vectors() -> list[dict[str, Any]]:
    with open(VECTORS) as f:
        return json.load(f)["vectors"]


@pytest.fixture(scope="session")
def kv_vectors() -> list[dict[str, Any]]:
    """The golden payloads of ``tests/data/kv_events.json``."""
    return _vectors()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test taking ``kv_vector`` runs once per golden vector, with the vector's name as id."""
    if "kv_vector" in metafunc.fixturenames:
        vectors = _vectors()
        metafunc.parametrize("kv_vector", vectors, ids=[v["name"] for v in vectors])


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(
        longrepr)
    return reason.removeprefix("Skipped: ")


#: what a skip's reason names -> how to get it (each tier's own package and Makefile stamp)
_MISSING = {"torch": "install torch (`make test` retries it) to run them",
            "chromium": "install chromium (`make test` retries it, as root) to run it",
            "vllm": "install vllm==0.33.0 (`make test` retries it: the ENGINES stamp) to run them",
            "sglang": "install sglang==0.5.23 (`make test` retries it: the ENGINES stamp) to "
                      "run them",
            "sglang-router": "install sglang-router==0.3.2 (`make test` retries it: the "
                             "ROUTERS stamp) to run them",
            "dynamo": "install ai-dynamo-runtime==1.6.1 (`make test` retries it: the DYNAMO "
                      "stamp) to run them"}


def _names(reason: str, what: str) -> bool:
    """Whether a skip's ``reason`` is for ``what``: it names it, and no longer key holding
    it (SGLang's router, sglang-router or sglang_router, is not SGLang's engine)."""
    reason = reason.lower().replace("_", "-")
    return what in reason and not any(k != what and what in k and k in reason
                                      for k in _MISSING)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    """Say loudly which tests did not run for want of torch, chromium, vLLM, SGLang, its
    router or Dynamo (a failed `make` install skips them, and a one-letter 's' among hundreds
    of dots is easy to miss)."""
    skipped = [(r.nodeid, _skip_reason(r)) for r in terminalreporter.stats.get("skipped", [])]
    for what, hint in _MISSING.items():
        hit = [(nodeid, reason) for nodeid, reason in skipped if _names(reason, what)]
        if not hit:
            continue
        terminalreporter.write_sep(
            "!", f"{len(hit)} test(s) SKIPPED because {what} is missing", red=True, bold=True)
        for nodeid, reason in hit:
            terminalreporter.write_line(f"SKIPPED {nodeid}: {reason}", red=True)
        terminalreporter.write_line(hint, red=True, bold=True)


@pytest.fixture(autouse=True)
def _root_logging() -> Iterator[None]:
    """Put the root logger back after each test. A CLI run in-process (``main([...])``)
    points it at the ``sys.stderr`` of that moment, pytest's capture, which is closed once
    the test ends: a warning logged later by another test's thread then printed a
    "Logging error" traceback in the middle of the run."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for h in root.handlers:
        if h not in handlers:
            root.removeHandler(h)
    for h in handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def pubs(ctx: zmq.Context) -> Iterator[list[ZmqEventPublisher]]:
    made: list[ZmqEventPublisher] = []
    yield made
    for p in made:
        p.shutdown(timeout=1.0)


@pytest.fixture
def made() -> Iterator[list[Any]]:
    """Publishers of an engine's own classes (tests/test_engines_*.py), shut down after the
    test (the engines' shutdown() takes no timeout). SGLang's own publisher also registers
    its shutdown with atexit, and a second shutdown of a stopped one waits 1 s and logs to
    pytest's closed stream at exit ("--- Logging error ---"): unregistered once done."""
    pubs: list[Any] = []
    yield pubs
    for p in pubs:
        p.shutdown()
        atexit.unregister(p.shutdown)


@pytest.fixture
def nats_server(tmp_path: Any) -> Iterator[Any]:
    """A real nats-server with JetStream file storage in a temp dir (tests/nats_helpers.py)."""
    from nats_helpers import NatsServer

    srv = NatsServer(tmp_path / "nats").start()
    yield srv
    srv.stop()


@pytest.fixture
def refused_url() -> Any:
    """A loopback port bound but not listening: every connect to it is refused, for real."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"nats://127.0.0.1:{s.getsockname()[1]}"

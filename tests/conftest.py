"""Shared fixtures: where the cross-project ``shared/`` directory (spec, golden vectors) lives."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest


def _shared_dir() -> Path:
    # CI clones the repo fresh with ``shared/`` beside it: <root>/../shared.
    candidate = Path(__file__).resolve().parents[2] / "shared"
    if candidate.is_dir():
        return candidate
    env = os.environ.get("KVWIRE_SHARED")
    if env and Path(env).is_dir():
        return Path(env)
    pytest.fail(
        f"shared/ directory not found at {candidate} and KVWIRE_SHARED is "
        f"{env!r}: clone the shared material beside the repo or set KVWIRE_SHARED"
    )


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """Path of ``shared/`` (spec and vectors): ``<repo>/../shared``, else ``$KVWIRE_SHARED``."""
    return _shared_dir()


@pytest.fixture(scope="session")
def kv_vectors(shared_dir: Path) -> list[dict[str, Any]]:
    """The golden payloads of ``shared/vectors/kv_events.json``."""
    with open(shared_dir / "vectors" / "kv_events.json") as f:
        return json.load(f)["vectors"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test taking ``kv_vector`` runs once per golden vector, with the vector's name as id."""
    if "kv_vector" in metafunc.fixturenames:
        with open(_shared_dir() / "vectors" / "kv_events.json") as f:
            vectors = json.load(f)["vectors"]
        metafunc.parametrize("kv_vector", vectors, ids=[v["name"] for v in vectors])

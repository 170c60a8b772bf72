"""Shared fixtures: the golden vectors, vendored into ``tests/data`` (see its README)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

DATA = Path(__file__).resolve().parent / "data"
VECTORS = DATA / "kv_events.json"


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

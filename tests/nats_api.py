"""The ``nats_api`` fixture: a test run with nats-py's internals and again with its public
API only (kvwire.nats.client_internals). A test module that takes ``nats_api`` imports
``nats_api_fixture`` (pytest finds it there by its name)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvwire.nats.client_internals import FORCE_PUBLIC


@pytest.fixture(name="nats_api", params=["internals", "public"])
def nats_api_fixture(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``internals``, or ``public``: ``KVWIRE_NATS_PUBLIC_API=1`` (child processes inherit
    it), the path a nats-py outside the tested versions takes."""
    if request.param == "public":
        monkeypatch.setenv(FORCE_PUBLIC, "1")
    else:
        monkeypatch.delenv(FORCE_PUBLIC, raising=False)
    yield request.param

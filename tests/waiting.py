"""The one way the tests wait: poll a condition until it holds or a deadline passes, never a
bare sleep. Generous defaults, because the suite must hold on a loaded 2-core box; a
shorter ``interval`` only costs CPU, never correctness."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

DEFAULT_TIMEOUT = 30.0


def wait_for(cond: Callable[[], Any], what: str = "a condition", timeout: float = DEFAULT_TIMEOUT,
             interval: float = 0.005) -> Any:
    """Return ``cond()``'s first truthy value; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


async def until(cond: Callable[[], Any], what: Any = "a condition", timeout: float = 20.0,
                interval: float = 0.01) -> None:
    """:func:`wait_for` for a coroutine: polls without blocking the event loop, so the
    work it waits on runs meanwhile. ``what`` may be a callable (named when it fails)."""
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for "
                                 f"{what() if callable(what) else what}")
        await asyncio.sleep(interval)

"""How late the serving loop runs what is due: a timer every :data:`INTERVAL` s measures
how long after its due time it ran (``kvwire_serve_loop_lag_seconds``). Everything the
router serves waits on that loop, so its lag is what a long prompt tokenized in the wrong
place, or any other stall, adds to every request and every streamed chunk."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ..proxy.metrics import CheapHistogram

__all__ = ["INTERVAL", "LoopLag"]

#: seconds between two samples (20 a second: nothing to speak of on an idle router)
INTERVAL = 0.05
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LoopLag:
    """A Prometheus collector; :meth:`start` and :meth:`stop` on the loop it measures."""

    def __init__(self, interval: float = INTERVAL) -> None:
        self.interval = interval
        self.hist = CheapHistogram(
            "kvwire_serve_loop_lag_seconds",
            f"How late the serving event loop ran a timer, sampled every {interval:g} s",
            _BUCKETS)
        self.max = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        """Start sampling the running loop (idempotent)."""
        if self._handle is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._arm()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self) -> None:
        # time.monotonic(), not loop.time(): uvloop's clock is cached per loop iteration
        self._due = time.monotonic() + self.interval
        self._handle = self._loop.call_later(self.interval, self._tick)  # type: ignore[union-attr]

    def _tick(self) -> None:
        lag = max(0.0, time.monotonic() - self._due)
        self.hist.observe(lag)
        if lag > self.max:
            self.max = lag
        self._arm()

    def describe(self) -> list:
        return []

    def collect(self) -> Any:
        yield from self.hist.collect()

"""The clock: steps an :class:`~kvwire.engine.core.EngineCore` in real time (asyncio).

Model time runs ``speed`` times faster than wall time from the runner's start. Each turn
computes the next step, sleeps until its end in wall time, then hands out its tokens and
publishes its KV events (one ``KVEventBatch`` per step that changed the cache, as vLLM
does). When the CPU cannot keep up, steps run back to back and quiet decode stretches that
are already due fold into one call; the loop yields to the event loop between turns so
HTTP keeps being served.

:meth:`at_quiet` runs a callback between steps: after the last computed step's batch was
published and before the next is computed, the one moment the model's cache is exactly
what the published batches say (``GET /kvwire/cache`` dumps it there).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ...wire.events import KVEventBatch
from ..core import EngineCore

__all__ = ["Runner"]

log = logging.getLogger("kvwire.engine")


class Runner:
    """Drives one core; ``publisher`` (or None) gets its KV event batches."""

    def __init__(self, core: EngineCore, speed: float = 1.0, publisher=None,
                 t0: float | None = None, pd=None) -> None:
        if not speed > 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        self.core = core
        self.speed = speed
        self.publisher = publisher
        #: the engine's P/D side (:class:`~kvwire.engine.server.pd.PD`) or None: told of
        #: each step handed out (pulls to start, leases expired, requests failed)
        self.pd = pd
        self.t0 = time.monotonic() if t0 is None else t0
        self.published = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.lag_s = 0.0  # how late step ends were handed out, summed (wall seconds)
        self._inflight = False  # a step computed, its outputs and batch not yet out
        self._quiet: list[Callable[[], None]] = []

    def now(self) -> float:
        """The model's time now."""
        return (time.monotonic() - self.t0) * self.speed

    def wake(self) -> None:
        self._wake.set()

    def at_quiet(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` now if no step is in flight, else right after the in-flight step's
        batch is published (before the next step is computed)."""
        if self._inflight:
            self._quiet.append(fn)
        else:
            fn()

    def _run_quiet(self) -> None:
        self._inflight = False
        waiters, self._quiet = self._quiet, []
        for fn in waiters:
            try:
                fn()
            except Exception:
                log.exception("a between-steps callback failed")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-runner")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._quiet.clear()  # not exact any more: the in-flight step was never published

    async def _run(self) -> None:
        core = self.core
        t0, speed = self.t0, self.speed
        mono = time.monotonic
        pub = self.publisher
        rank = core.rank
        while True:
            now = (mono() - t0) * speed
            step = core.advance(now)
            if step is None:
                self._wake.clear()
                if self.pd is not None:
                    self._idle_side()
                # nothing runnable: wait for an arrival, a pull's end or the next lease due
                nxt = core.next_due() if self.pd is not None else None
                if nxt is None:
                    await self._wake.wait()
                elif nxt > now:
                    try:
                        await asyncio.wait_for(self._wake.wait(), (nxt - now) / speed)
                    except asyncio.TimeoutError:
                        pass
                else:
                    await asyncio.sleep(0)
                continue
            self._inflight = True
            delay = t0 + step.end / speed - mono()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                self.lag_s -= delay
                await asyncio.sleep(0)
            try:
                core.deliver(step)
            except Exception:  # a sink's bug must not stop the engine
                log.exception("delivering a step's outputs failed")
            if step.events and pub is not None:
                pub.publish(KVEventBatch(time.time(), step.events, data_parallel_rank=rank))
                self.published += 1
            if self.pd is not None:
                try:
                    self.pd.after_step(step)
                except Exception:
                    log.exception("the P/D side of a step failed")
            self._run_quiet()

    def _idle_side(self) -> None:
        """Leases expired and pulls failed while nothing ran (no step reports them)."""
        core = self.core
        try:
            self.pd.after_idle(core.take_expired(), core.take_failed())
        except Exception:
            log.exception("the P/D side of an idle turn failed")

"""The proxy's engine health probes, on kvwire's one HTTP client (:mod:`kvwire.http1.client`)
and asyncio: no thread per probe.

Every ``interval`` each engine whose last probe has ended is probed again: ``GET /health``
and, when asked, ``GET /v1/models``, each given ``timeout`` s to connect, to answer and to
send its body. Probes run side by side, at most :data:`PROBES_AT_ONCE` at a time (the rest
wait their turn, as they do while that many hang), so an engine slow to answer delays no
other engine's probe and is never probed twice at once.

:meth:`Prober.start` called on a running event loop (the serving loop) probes there;
called outside one, on an event loop of its own in one thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import msgspec

from ..http1.client import Pool, UpstreamError

if TYPE_CHECKING:
    from .fleet import Fleet, Link

__all__ = ["PROBES_AT_ONCE", "Prober", "checker", "probe"]

log = logging.getLogger("kvwire.proxy.health")
#: Engines probed at once (more wait their turn, as do the rest while that many hang).
PROBES_AT_ONCE = 16


async def probe(host: str, port: int, timeout: float,
                models: bool) -> tuple[bool, list[dict[str, Any]] | None]:
    """One engine's health: (``/health`` answered 200, and with ``models`` the entries of
    its ``/v1/models`` that have an ``id``). Any failure (no connection, a timeout, bad
    JSON) is (False, None). Each request on a connection of its own, closed after it."""
    pool = Pool(host, port, connect_timeout=timeout, max_idle=0)
    try:
        status, _ = await pool.fetch(b"GET", b"/health", timeout)
        if status != 200:
            return False, None
        if not models:
            return True, None
        _, body = await pool.fetch(b"GET", b"/v1/models", timeout)
        data = msgspec.json.decode(body)["data"]  # (an error page: no list, a failure)
        return True, [m for m in data if isinstance(m, dict) and "id" in m]
    except (UpstreamError, asyncio.TimeoutError, ValueError, KeyError, TypeError):
        return False, None
    finally:
        pool.close()


def checker(fleet: Fleet, timeout: float) -> Callable[[Link, bool], Awaitable[None]]:
    """A :class:`Prober`'s ``check`` for the fleet's engines: probe one (its models too
    when ``refresh`` or not known yet) and give the fleet the result."""

    async def check(link: Link, refresh: bool) -> None:
        ok, models = await probe(link.host, link.port, timeout, refresh or not link.models)
        fleet.probed(link, ok, models)

    return check


class Prober:
    """Calls ``check(target, refresh)`` for each of ``targets()`` every ``interval`` s,
    side by side (at most ``at_once``), each target (by its ``name``) once at a time;
    ``refresh`` is true every tenth round (and in the first)."""

    def __init__(self, targets: Callable[[], Iterable[Any]],
                 check: Callable[[Any, bool], Awaitable[None]], interval: float,
                 at_once: int = PROBES_AT_ONCE) -> None:
        self.targets = targets
        self.check = check
        self.interval = interval
        self.at_once = at_once
        self.busy: set[str] = set()  # targets whose probe has not ended
        self.probed = threading.Event()  # every target probed once
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._thread: threading.Thread | None = None
        self._wake: asyncio.Event | None = None
        self._kicked = False  # kicked before the loop ran
        self._stopped = False

    def start(self) -> None:
        """Start probing (once: a second call changes nothing)."""
        if self._task is not None or self._thread is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            self._loop = loop
            self._task = loop.create_task(self._run())
            return
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._task = loop.create_task(self._run())
            ready.set()
            try:
                loop.run_until_complete(self._task)
            except asyncio.CancelledError:
                pass
            finally:
                loop.run_until_complete(asyncio.sleep(0))  # (closed connections let go)
                loop.close()

        self._thread = threading.Thread(target=run, name="kvwire-router-probe", daemon=True)
        self._thread.start()
        ready.wait()

    def kick(self) -> None:
        """Probe now, not at the next interval (an engine was added); any thread."""
        self._kicked = True
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def close(self, timeout: float) -> None:
        """Stop probing; probes under way are abandoned (their connections close). From
        any thread; waits up to ``timeout`` s for a thread of its own to end."""
        self._stopped = True
        loop, task = self._loop, self._task
        if loop is not None and task is not None and not loop.is_closed():
            try:
                here = asyncio.get_running_loop() is loop
            except RuntimeError:
                here = False
            if here:
                task.cancel()
            else:
                try:
                    loop.call_soon_threadsafe(task.cancel)
                except RuntimeError:  # the loop closed meanwhile
                    pass
        if self._thread is not None:
            self._thread.join(timeout)

    async def _one(self, sem: asyncio.Semaphore, target: Any, refresh: bool) -> None:
        try:
            async with sem:
                await self.check(target, refresh)
        except Exception:
            log.exception("probing %s failed", target.name)
        finally:
            self.busy.discard(target.name)

    async def _run(self) -> None:
        self._wake = wake = asyncio.Event()
        if self._kicked:
            wake.set()
        sem = asyncio.Semaphore(self.at_once)
        running: set[asyncio.Task] = set()
        try:
            n = 0
            while not self._stopped:
                started = []
                for t in list(self.targets()):
                    if t.name in self.busy:
                        continue  # its last probe still waits for an answer
                    self.busy.add(t.name)
                    task = asyncio.ensure_future(self._one(sem, t, n % 10 == 0))
                    running.add(task)
                    task.add_done_callback(running.discard)
                    started.append(task)
                if n == 0 and started:
                    await asyncio.wait(started)  # (wait_probed: every engine probed once)
                self.probed.set()
                n += 1
                try:
                    await asyncio.wait_for(wake.wait(), self.interval)
                except asyncio.TimeoutError:
                    pass
                wake.clear()
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)

"""A first connection to NATS that gives up, and says why.

nats-py retries a first connect forever when reconnects are unlimited (``-1``, and ``0`` too:
its server pool never drops a server then), and its default error callback logs a traceback
per try. :func:`connect` bounds the first connection by ``timeout``, logs one line when a try
fails for a new reason, and raises :class:`NatsConnectError` naming the server(s) and the last
reason. Once connected, the options' reconnect policy (default: forever) holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

__all__ = ["SCHEMES", "NatsConnectError", "bounded", "check_url", "connect", "reach", "reason"]

log = logging.getLogger("kvwire.nats")

T = TypeVar("T")

#: The URL schemes nats-py connects with.
SCHEMES = ("nats", "tls", "ws", "wss")


class NatsConnectError(ConnectionError):
    """No connection within the time limit (or a server nats-py refuses to try)."""


def check_url(url: str, what: str = "NATS URL") -> str:
    """``url`` if nats-py can connect to it, else ValueError naming ``what`` and the part."""
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"{what} {url!r}: expected nats://HOST:PORT")
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError as e:  # e.g. a port out of 0..65535
        raise ValueError(f"{what} {url!r}: {e}") from None
    if u.scheme not in SCHEMES:
        raise ValueError(f"{what} {url!r}: scheme {u.scheme!r} is not one of "
                         f"{', '.join(s + '://' for s in SCHEMES)}")
    if not u.hostname:
        raise ValueError(f"{what} {url!r}: no host")
    if port == 0:
        raise ValueError(f"{what} {url!r}: port 0")
    return url


def reason(e: BaseException) -> str:
    """A failed try in a few words (no traceback): what a reader needs to fix it."""
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, socket.gaierror):
        return f"cannot resolve the host ({e.strerror})"
    if isinstance(e, asyncio.TimeoutError | TimeoutError):
        return "no answer (timed out)"
    text = str(e).strip()
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


async def connect(servers: str | Sequence[str], *, timeout: float, warn: bool = True,
                  error_cb: Callable[[Exception], Awaitable[None]] | None = None,
                  **options: Any) -> Any:
    """``nats.connect`` whose first connection gives up after ``timeout`` seconds.

    NatsConnectError names the server(s) and the last failed try's reason. With ``warn``,
    a failed try is logged (one line, no traceback) when its reason differs from the last
    one. ``error_cb`` still sees every error, before and after connecting."""
    import nats

    urls = [servers] if isinstance(servers, str) else list(servers)
    for u in urls:
        check_url(u)
    where = ", ".join(urls)
    last: list[str] = []
    state = {"connected": False}

    async def on_error(e: Exception) -> None:
        if not state["connected"]:
            why = reason(e)
            if warn and (not last or last[-1] != why):
                log.warning("cannot connect to NATS at %s: %s; retrying for up to %gs",
                            where, why, timeout)
            last[:] = [why]
        if error_cb is not None:
            await error_cb(e)

    options.setdefault("max_reconnect_attempts", -1)
    options.setdefault("reconnect_time_wait", 0.25)
    options.setdefault("connect_timeout", min(2.0, timeout))
    try:
        nc = await bounded(nats.connect(servers=urls, error_cb=on_error, **options), timeout,
                           late=_close_late)
    except asyncio.TimeoutError:
        why = last[0] if last else "no answer"
        raise NatsConnectError(f"cannot connect to NATS at {where}: {why} (gave up after "
                               f"{timeout:g}s)") from None
    except Exception as e:  # nats-py refused the options (e.g. ws:// without aiohttp)
        raise NatsConnectError(f"cannot connect to NATS at {where}: {reason(e)}") from None
    state["connected"] = True
    return nc


#: Late results being handed over (a reference keeps each task alive).
_REAPERS: set[asyncio.Task[None]] = set()


async def bounded(aw: Awaitable[T], timeout: float, *,
                  late: Callable[[T], Awaitable[object]] | None = None,
                  reap_for: float = 30.0) -> T:
    """``aw``'s result within ``timeout`` seconds, else asyncio.TimeoutError, returned on time.

    Unlike ``asyncio.wait_for``, this never waits for the abandoned work to finish. On
    Python 3.11 ``wait_for`` can lose a cancellation that lands as an inner ``wait_for``
    completes, and nats-py's first connect treats what follows as one more failed try and
    retries for ever: a caller that awaits the cancelled task then hangs (seen once in CI).
    So on time-out (or when the caller is cancelled) the task is cancelled again every
    50 ms for up to ``reap_for`` seconds, and ``late`` is handed anything it still returns
    (a connection made after all: close it). The re-cancelling runs from loop callbacks,
    not a task: ``asyncio.run`` cancels every task once at its end and then waits for
    them, so a task-based reaper died there and a connect that swallowed that one cancel
    held the program's exit for ever."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except BaseException:  # the caller was cancelled: the work must not outlive it
        _abandon(task, late, reap_for)
        raise
    if task in done:
        return task.result()
    _abandon(task, late, reap_for)
    raise asyncio.TimeoutError(f"not done within {timeout:g}s")


def _abandon(task: asyncio.Future[T], late: Callable[[T], Awaitable[object]] | None,
             reap_for: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + reap_for

    def poke() -> None:
        if task.done():
            return
        if loop.time() > deadline:
            log.warning("an abandoned NATS connect ignored cancellation for %gs; left running",
                        reap_for)
            return
        task.cancel()
        loop.call_later(0.05, poke)

    def ended(t: asyncio.Future[T]) -> None:
        if t.cancelled():
            return
        if t.exception() is None and late is not None:  # (retrieved either way: no noise)
            handover = asyncio.ensure_future(_hand_over(late, t.result()))
            _REAPERS.add(handover)
            handover.add_done_callback(_REAPERS.discard)

    task.add_done_callback(ended)
    poke()


async def _hand_over(late: Callable[[T], Awaitable[object]], result: T) -> None:
    with contextlib.suppress(Exception):
        await late(result)


async def _close_late(nc: Any) -> None:
    await asyncio.wait_for(nc.close(), 5)


def reach(servers: str | Sequence[str], timeout: float, name: str = "kvwire") -> None:
    """Connect once and close: a command learns now (NatsConnectError) that the server is not
    there, instead of its consumer retrying in the background for ever."""

    async def probe() -> None:
        nc = await connect(servers, timeout=timeout, name=name)
        try:
            await asyncio.wait_for(nc.close(), 5)
        except Exception:  # noqa: BLE001 - reached it: that is all this asks
            pass

    asyncio.run(probe())

"""Inbox subscriptions whose messages are handled inside nats-py's read loop.

nats-py hands every message of a callback subscription to a queue, and a task of the
subscription's own takes it from there: one more event-loop wakeup per message. For the
bridge's PubAcks and the consumer's pull inbox that wakeup was a large share of the CPU
spent per batch at low rates (where each message comes alone), and every wakeup is one
more chance to wait for a core. :func:`subscribe_inline` calls a *synchronous* callback
from the read loop instead, with the same :class:`nats.aio.msg.Msg` nats-py would build.

The callback must not block or raise: it runs while nats-py reads the socket. It should
only record the message and wake whoever acts on it.

This uses nats-py internals (``Client._process_msg``, ``_process_headers``,
``_build_message``), checked when installed: without them (another nats-py) the
subscription falls back to nats-py's own task, with the same callback, and nothing else
changes. Subscriptions keep their sid across reconnects (nats-py resubscribes them), so the
routing by sid holds; a sid no longer in the client's table is left to nats-py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_HOOKS = ("_process_msg", "_process_headers", "_build_message", "_subs", "stats")


class _Tap:
    """Wraps one client's ``_process_msg``: messages for registered sids go to their
    callback directly; all others to nats-py as before."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.orig = nc._process_msg
        self.cbs: dict[int, tuple[Any, Callable[[Any], None]]] = {}
        nc._process_msg = self.process

    async def process(self, sid: int, subject: bytes, reply: bytes, data: bytes,
                      headers: bytes | None) -> None:
        got = self.cbs.get(sid)
        nc = self.nc
        if got is None or nc._subs.get(sid) is not got[0]:
            if got is not None:
                del self.cbs[sid]  # unsubscribed: nats-py's own rules apply
            await self.orig(sid, subject, reply, data, headers)
            return
        st = nc.stats
        st["in_msgs"] += 1
        st["in_bytes"] += len(data)
        hdr = await nc._process_headers(headers) if headers else None
        got[1](nc._build_message(sid, subject, reply, data, hdr))


def inline_supported(nc: Any) -> bool:
    """Whether this client has the internals :func:`subscribe_inline` relies on."""
    return all(hasattr(nc, a) for a in _HOOKS)


async def subscribe_inline(nc: Any, subject: str, cb: Callable[[Any], None],
                           inline: bool = True, **kwargs: Any) -> Any:
    """Subscribe ``subject`` with a synchronous ``cb(msg)`` run in the read loop; returns
    nats-py's ``Subscription`` (unsubscribe it as usual). Falls back to nats-py's own
    dispatch (a task per subscription) when the client lacks the internals (see the module
    docstring) or ``inline`` is false."""

    async def fallback(msg: Any) -> None:
        cb(msg)

    sub = await nc.subscribe(subject, cb=fallback, **kwargs)
    if inline and inline_supported(nc):
        tap = getattr(nc, "_kvwire_tap", None)
        if tap is None:
            tap = _Tap(nc)
            nc._kvwire_tap = tap
        tap.cbs[sub._id] = (sub, cb)
    return sub

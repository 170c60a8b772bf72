"""Inbox subscriptions whose messages are handled inside nats-py's read loop.

nats-py hands every message of a callback subscription to a queue, and a task of the
subscription's own takes it from there: one more event-loop wakeup per message. For the
bridge's PubAcks and the consumer's pull inbox that wakeup was a large share of the CPU
spent per batch at low rates (where each message comes alone), and every wakeup is one
more chance to wait for a core. :func:`subscribe_inline` calls a *synchronous* callback
from the read loop instead, with the same :class:`nats.aio.msg.Msg` nats-py would build.

The callback must not block or raise: it runs while nats-py reads the socket. It should
only record the message and wake whoever acts on it.

This needs nats-py internals (:mod:`kvwire.nats.client_internals`, which gates them by
version): without them the subscription falls back to nats-py's own task, with the same
callback, and nothing else changes. Subscriptions keep their sid across reconnects (nats-py
resubscribes them), so the routing by sid holds; a sid no longer in the client's table is
left to nats-py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .client_internals import internals

__all__ = ["inline_supported", "subscribe_inline"]


def inline_supported(nc: Any) -> bool:
    """Whether :func:`subscribe_inline` runs callbacks in ``nc``'s read loop."""
    return internals(nc) is not None


async def subscribe_inline(nc: Any, subject: str, cb: Callable[[Any], None],
                           **kwargs: Any) -> Any:
    """Subscribe ``subject`` with a synchronous ``cb(msg)`` run in the read loop; returns
    nats-py's ``Subscription`` (unsubscribe it as usual). Falls back to nats-py's own
    dispatch (a task per subscription) when the client's internals may not be used."""

    async def fallback(msg: Any) -> None:
        cb(msg)

    sub = await nc.subscribe(subject, cb=fallback, **kwargs)
    got = internals(nc)
    if got is not None:
        got.tap().add(sub, cb)
    return sub

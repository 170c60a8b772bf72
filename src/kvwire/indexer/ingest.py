"""``kvwire index``'s ingest on its HTTP event loop: a :class:`~kvwire.routing.feed.Feed`
started without its thread (``start(thread=False)``), whose :meth:`~Feed.pump` the loop that
answers the queries calls.

Why: with a subscriber thread, each wake-up of the ingest takes the GIL from the HTTP loop
and hands it back (at 10,000 batches/s and 16 busy connections, a query then waited up to
Python's 5 ms switch interval behind the ingest, and the hand-offs cost CPU on both sides).
On the loop, ingest and queries simply take turns: every ``INGEST_NAP`` the loop takes what
the subscriber has ready (at most ``PUMP_ITEMS`` deliveries) and applies one piece of it per
turn, a piece as the feed's thread holds its lock for (at most ``APPLY_SLICE`` deliveries,
or about ``SNAPSHOT_SLICE`` blocks of a snapshot); more waiting: the next turn comes right
after the requests already read. So a query waits for at most one bounded piece, and a
burst (an engine's snapshot, a replay) is applied in turns between queries, never in one
long stall. The subscriber is polled again only when every piece handed out is applied, so
a stream's removal still comes after all its items (``Subscriber.remove``'s promise). The subscriber's own state machine (order, gaps, replay,
snapshots, liveness deadlines) is the same code the thread runs (``Subscriber.poll_many``
with no wait); only who calls it changes.
"""

from __future__ import annotations

import asyncio
import logging

from ..routing.feed import Feed
from ..routing.ingest import INGEST_NAP

__all__ = ["PUMP_ITEMS", "LoopIngest"]

log = logging.getLogger("kvwire.indexer.ingest")

#: Deliveries taken from the subscriber at a time (then applied in pieces, one per turn).
PUMP_ITEMS = 64


class LoopIngest:
    """Drives ``feed``'s ingest (a Feed started with ``thread=False``) from an asyncio loop:
    one :meth:`Feed.pump` per turn while there is more, else one per ``INGEST_NAP``. Until
    :meth:`attach` nothing is polled (publishers' batches wait in the sockets); :meth:`stop`
    ends it (the feed's ``close`` closes the sockets)."""

    def __init__(self, feed: Feed) -> None:
        self.feed = feed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.Handle | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Ingest on ``loop`` from now on (call from the loop's thread)."""
        self._loop = loop
        self._handle = loop.call_soon(self._turn)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _turn(self) -> None:
        feed, loop = self.feed, self._loop
        if loop is None:
            return
        try:
            more = feed.pump(PUMP_ITEMS)
        except Exception:  # as the thread: logged, the streams reported dead, no more ingest
            log.exception("indexer ingest failed")
            feed.all_down()
            return
        if feed.closed:
            return
        if more:  # more to do: right after the requests already read
            self._handle = loop.call_soon(self._turn)
        else:  # let deliveries gather: one turn per INGEST_NAP, not one per batch
            self._handle = loop.call_later(INGEST_NAP, self._turn)

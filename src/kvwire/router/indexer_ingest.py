"""``kvwire index``'s ingest on its HTTP event loop: a :class:`~kvwire.router.service.RouterCore`
whose subscriber is polled by the loop that answers the queries, not by a thread of its own.

Why: with a subscriber thread, each wake-up of the ingest takes the GIL from the HTTP loop
and hands it back (at 10,000 batches/s and 16 busy connections, a query then waited up to
Python's 5 ms switch interval behind the ingest, and the hand-offs cost CPU on both sides).
On the loop, ingest and queries simply take turns: every ``INGEST_NAP`` the loop takes what
the subscriber has ready (at most ``PUMP_ITEMS`` deliveries) and applies one piece of it per
turn, a piece as RouterCore's thread holds its lock for (at most ``APPLY_SLICE`` deliveries,
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
import time
from collections import deque

from ..consume.subscriber import Subscriber
from .service import INGEST_NAP, RouterCore, _pieces

__all__ = ["PUMP_ITEMS", "LoopCore"]

log = logging.getLogger("kvwire.router.indexer_ingest")

#: Deliveries taken from the subscriber at a time (then applied in pieces, one per turn).
PUMP_ITEMS = 64
#: How often the subscriber's per-stream counters are refreshed (as RouterCore's thread does).
_STATS_EVERY = 0.25


class LoopCore(RouterCore):
    """A RouterCore whose subscriber runs on an asyncio loop (``attach``) instead of a thread.
    Until attached nothing is polled (publishers' batches wait in the sockets); ``close``
    stops it. Everything else, including ``add_stream`` / ``remove_stream`` from the loop's
    own requests, is RouterCore's."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pump_handle: asyncio.Handle | None = None
        self._next_stats = 0.0
        self._pending: deque[list] = deque()  # pieces taken, not applied yet
        #: turns of the loop that applied a piece
        self.pumps = 0

    def start(self, timeout: float = 10.0) -> None:
        """Open the subscriber (no thread: see :meth:`attach`)."""
        with self._sub_lock:
            self._sub = Subscriber([self.nats] if self.nats is not None else self.specs,
                                   config=self.stream_config)
        self._started.set()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Poll the subscriber on ``loop`` from now on (call from the loop's thread)."""
        self._loop = loop
        self._pump_handle = loop.call_soon(self._pump)

    def _pump(self) -> None:
        sub, loop = self._sub, self._loop
        if sub is None or loop is None or self._stop.is_set():
            return
        more = False
        try:
            if not self._pending:
                items = sub.poll_many(0, max_items=PUMP_ITEMS)
                more = len(items) >= PUMP_ITEMS
                self._pending.extend(_pieces(items))
            if self._pending:
                self._apply(self._pending.popleft())
                self.pumps += 1
            now = time.monotonic()
            if now >= self._next_stats:
                self.sub_stats = sub.stats()
                self._next_stats = now + _STATS_EVERY
        except Exception:  # as the thread: logged, the streams reported dead, no more ingest
            log.exception("indexer ingest failed")
            self.alive = dict.fromkeys(self.alive, False)
            return
        if self._pending or more:  # more to do: right after the requests already read
            self._pump_handle = loop.call_soon(self._pump)
        else:  # let deliveries gather: one turn per INGEST_NAP, not one per batch
            self._pump_handle = loop.call_later(INGEST_NAP, self._pump)

    def close(self, timeout: float = 5.0) -> None:
        """Stop polling and close the subscriber's sockets."""
        self._stop.set()
        if self._pump_handle is not None:
            self._pump_handle.cancel()
        with self._sub_lock:
            sub, self._sub = self._sub, None
        if sub is not None:
            sub.close()

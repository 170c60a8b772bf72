"""``kvwire index``'s ingest on its HTTP event loop: a :class:`~kvwire.routing.feed.Feed`
started without its thread (``start(thread=False)``), whose :meth:`~Feed.pump` the loop that
answers the queries calls.

Why: with a subscriber thread, each wake-up of the ingest takes the GIL from the HTTP loop
and hands it back (at 10,000 batches/s and 16 busy connections, a query then waited up to
Python's 5 ms switch interval behind the ingest, and the hand-offs cost CPU on both sides).
On the loop, ingest and queries simply take turns: when a socket says something came, the
loop takes what the subscriber has ready (at most ``PUMP_ITEMS`` deliveries) and
applies one piece of it per turn, a piece as the feed's thread holds its lock for (at most
``APPLY_SLICE`` deliveries, or about ``SNAPSHOT_SLICE`` blocks of a snapshot); more waiting:
the next turn comes right after the requests already read. So a query waits for at most one
bounded piece, and a burst (an engine's snapshot, a replay) is applied in turns between
queries, never in one long stall. The subscriber is polled again only when every piece handed
out is applied, so a stream's removal still comes after all its items
(``Subscriber.remove``'s promise). The subscriber's own state machine (order, gaps, replay,
snapshots, liveness deadlines) is the same code the thread runs (``Subscriber.poll_many`` with
no wait); only who calls it changes.

Between turns: after one that applied something, the next comes ``INGEST_NAP`` later, so
that deliveries gather (at 10,000 batches/s a turn per batch cost twice the CPU); after one
that found nothing, the loop watches the subscriber's sockets (and its pipe for run-time
stream changes) and wakes when one is readable, or at the subscriber's next deadline (a
request's timeout, a tail check) or the stats' refresh. So an idle indexer wakes a few times
a second, not every 5 ms as when it polled (which cost it 5% of a core doing nothing).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time

from ..routing.feed import Feed
from ..routing.ingest import INGEST_NAP

__all__ = ["PUMP_ITEMS", "LoopIngest"]

log = logging.getLogger("kvwire.indexer.ingest")

#: Deliveries taken from the subscriber at a time (then applied in pieces, one per turn).
PUMP_ITEMS = 64
#: The shortest sleep between turns when the subscriber's next deadline has passed (a
#: deadline in the past for a while must not make the loop spin).
MIN_WAIT = 0.001


class LoopIngest:
    """Drives ``feed``'s ingest (a Feed started with ``thread=False``) from an asyncio loop:
    one :meth:`Feed.pump` per turn while there is more; after a turn that applied something,
    the next one ``INGEST_NAP`` later (deliveries gather meanwhile); after one that found
    nothing, none until a watched socket is readable or the ingest's next deadline comes.
    Until :meth:`attach` nothing is polled (publishers' batches wait in the sockets);
    :meth:`stop` ends it (the feed's ``close`` closes the sockets)."""

    def __init__(self, feed: Feed) -> None:
        self.feed = feed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._soon: asyncio.Handle | None = None  # the next turn, queued on the loop
        self._timer: asyncio.TimerHandle | None = None  # a turn at the next deadline
        self._gen = -2  # the generation of the descriptors copied
        self._copies: list[int] = []  # copies of the subscriber's descriptors
        self._reading = False  # the copies are watched
        #: turns run (each one pump)
        self.turns = 0

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Ingest on ``loop`` from now on (call from the loop's thread)."""
        self._loop = loop
        self._schedule()

    def stop(self) -> None:
        """No more turns (from any thread: on the loop's own if it still runs)."""
        loop = self._loop
        if loop is not None and loop.is_running() and not _on(loop):
            loop.call_soon_threadsafe(self.stop)
            return
        self._loop = None
        for h in (self._soon, self._timer):
            if h is not None:
                h.cancel()
        self._soon = self._timer = None
        self._unwatch(loop)

    def _schedule(self) -> None:
        """A turn soon, after the callbacks already queued (once, however many wake-ups)."""
        if self._soon is None and self._loop is not None:
            self._soon = self._loop.call_soon(self._turn)

    def _timed(self) -> None:
        self._timer = None
        self._schedule()

    def _turn(self) -> None:
        self._soon = None
        feed, loop = self.feed, self._loop
        if loop is None:
            return
        self.turns += 1
        pumps = feed.pumps
        try:
            more = feed.pump(PUMP_ITEMS)
        except Exception:  # as the thread: logged, the streams reported dead, no more ingest
            log.exception("ingest of the streams failed")
            feed.all_down()
            self.stop()
            return
        if feed.closed:
            self.stop()
            return
        if more:  # more to do: right after the requests already read
            self._schedule()
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if feed.pumps != pumps:
            # Something came: let more gather for INGEST_NAP before the next turn (one turn
            # per nap, not one per batch, at 10,000 batches/s), the sockets not watched.
            self._pause(loop)
            self._timer = loop.call_later(INGEST_NAP, self._timed)
            return
        self._watch(loop)  # nothing came: sleep until a socket says something did
        due = feed.ingest.due()
        if due == 0.0:  # something came meanwhile
            self._schedule()
        elif due != math.inf:
            self._timer = loop.call_later(max(due - time.monotonic(), MIN_WAIT), self._timed)

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch the subscriber's descriptors (copies: a socket closed with its stream frees
        its number, which a new socket may take while the old one is still watched)."""
        gen, fds = self.feed.ingest.wake_fds(self._gen)
        if fds is not None:
            self._unwatch(loop)
            self._gen = gen
            self._copies = [os.dup(fd) for fd in fds]
        if not self._reading:
            self._reading = True
            for fd in self._copies:
                loop.add_reader(fd, self._schedule)

    def _pause(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Stop watching (a readable descriptor would wake the loop on every pass)."""
        if self._reading:
            self._reading = False
            if loop is not None and not loop.is_closed():
                for fd in self._copies:
                    try:
                        loop.remove_reader(fd)
                    except (RuntimeError, ValueError, OSError):
                        pass

    def _unwatch(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._pause(loop)
        copies, self._copies = self._copies, []
        self._gen = -2
        for fd in copies:
            os.close(fd)


def _on(loop: asyncio.AbstractEventLoop) -> bool:
    """Called on ``loop``'s own thread, while it runs."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False

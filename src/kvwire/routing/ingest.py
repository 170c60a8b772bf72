"""The subscriber side of :class:`~kvwire.routing.core.RouterCore`: who takes the
deliveries off the engines' streams and when.

Either a thread of its own owns the subscriber (``kvwire serve``), or the caller drives the
ingest turn by turn with :meth:`Ingest.pump` from its own event loop (``kvwire index``:
indexer/ingest.py), waking when :meth:`Ingest.wake_fds` say something came or at
:meth:`Ingest.due`. Both hand what they take to ``apply`` (the core's: the index,
liveness, discovery), cut in pieces as :func:`.slices.pieces` cuts them, so the core's lock
is held one short piece at a time. What the deliveries *mean* stays in the core; this part
only moves them and keeps the subscriber's own stats fresh.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..consume.subscriber import Subscriber
from .slices import pieces

__all__ = ["BATCH_ITEMS", "INGEST_NAP", "STREAM_COUNTERS", "Ingest", "stream_counts",
           "stream_metrics"]

log = logging.getLogger("kvwire.router")

#: Deliveries taken from the subscriber per wake-up.
BATCH_ITEMS = 2048
#: Nap after a partial take, so deliveries gather: fewer wake-ups mean fewer GIL hand-offs
#: with the HTTP thread (each one costs a request far more than the ingest work it does).
INGEST_NAP = 0.005
#: How often the per-stream subscriber stats are refreshed (``stats``), in seconds: also
#: the thread's longest wait for a delivery (it was a poll every 50 ms: 20 wake-ups a second
#: of an idle router, ~0.2 ms of CPU each here).
STATS_EVERY = 0.25


#: What each stream's consumer counted, exported per stream by ``kvwire serve`` (``/engines``,
#: ``/metrics``) under the names ``kvwire listen`` gives them, so an operator can tell a
#: router that fell behind (gaps, replays, losses, restarts) from one that is exact.
STREAM_COUNTERS = ("batches", "gaps", "replays", "replayed", "lost", "snapshots", "resyncs",
                   "restarts", "tail_checks")


def stream_counts(stats: Any) -> dict[str, Any]:
    """One stream's :data:`STREAM_COUNTERS`, its ``state`` (``syncing``, ``inexact``,
    ``unconfirmed``, ``exact``: :class:`~kvwire.consume.config.StreamStats`) and
    ``unconfirmed``, from its :class:`~kvwire.consume.subscriber.SubscriberStats` (None: not
    started yet). A counter that does not apply (NATS streams replay nothing) is None."""
    proto = getattr(stats, "stream", None)
    if proto is None:
        return {**dict.fromkeys(STREAM_COUNTERS, 0), "state": "syncing", "unconfirmed": False}
    out = {k: getattr(proto, k) for k in STREAM_COUNTERS}
    out["state"] = proto.state
    out["unconfirmed"] = proto.unconfirmed
    return out


def stream_metrics(status: dict[str, Any]) -> list[tuple[str, str, str, list[tuple[str, float]]]]:
    """The per-stream counts of an ``engines_status()`` answer as metric families:
    ``(name, "counter" | "gauge", help, [(stream, value), ...])``; a counter's name has no
    ``_total`` (the exposition adds it). Counters that do not apply are left out."""
    rows = [row for e in status.values() for row in e["ranks"]]
    fams = [(f"kvwire_router_stream_{k}", "counter", f"Per stream, as kvwire listen counts "
             f"them: {k.replace('_', ' ')}",
             [(r["stream"], float(r[k])) for r in rows if r.get(k) is not None])
            for k in STREAM_COUNTERS]
    fams.append(("kvwire_router_stream_unconfirmed", "gauge", "1 while a reference stream's "
                 "tail is not confirmed since it went quiet (or its consumer stalled)",
                 [(r["stream"], 1.0 if r["unconfirmed"] else 0.0) for r in rows]))
    fams.append(("kvwire_router_stream_exact", "gauge", "1 if the stream's state is exact",
                 [(r["stream"], 1.0 if r["state"] == "exact" else 0.0) for r in rows]))
    return fams


class Ingest:
    """Takes deliveries from a subscriber ``open_subscriber()`` makes and hands them to
    ``apply(items, cut)`` (``cut``: the items already cut into pieces, or None). ``on_fail``
    runs if the thread dies of an unexpected error (the core then marks every stream down).

    ``lock`` orders run-time stream changes (the core's ``add_stream``/``remove_stream``,
    engines added and removed) against the subscriber's opening: before it, a change goes
    into the specs the subscriber opens with; after it, to ``sub`` itself."""

    def __init__(self, open_subscriber: Callable[[], Subscriber],
                 apply: Callable[[list, list[list] | None], None],
                 on_fail: Callable[[], None] | None = None) -> None:
        self._open, self._apply, self._on_fail = open_subscriber, apply, on_fail
        self.sub: Subscriber | None = None
        self.lock = threading.Lock()
        #: the subscriber's per-stream stats, at most ``STATS_EVERY`` old
        self.stats: dict[str, Any] = {}
        self.pumps = 0  # caller-driven turns that applied a piece
        self.polls = 0  # the thread's waits for deliveries that ended
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # caller-driven: pieces taken from the subscriber and not applied yet
        self._pending: deque[list] = deque()
        self._next_stats = 0.0
        self._failed = False  # caller-driven: a pump raised (the caller stopped pumping)

    def start(self, timeout: float = 10.0, *, thread: bool = True) -> None:
        """Open the subscriber: in a thread of its own that then takes every delivery
        (raises what kept it from starting), or, with ``thread=False``, here, for the
        caller to drive with :meth:`pump`."""
        if not thread:
            with self.lock:
                self.sub = self._open()
            self._started.set()
            return
        self._thread = threading.Thread(target=self._run, name="kvwire-router-sub",
                                        daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError("router subscriber thread did not start")
        if self._error is not None:
            raise self._error

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking deliveries and close the subscriber (the thread closes its own, woken
        from its wait)."""
        self._stop.set()
        if self._thread is not None:
            with self.lock:  # (the thread closes the subscriber under it)
                if self.sub is not None:
                    self.sub.wake()
            self._thread.join(timeout)
            return
        with self.lock:
            sub, self.sub = self.sub, None
        if sub is not None:
            sub.close()

    @property
    def closed(self) -> bool:
        """``close()`` was called."""
        return self._stop.is_set()

    @property
    def running(self) -> bool:
        """The subscriber thread runs; caller-driven: the subscriber is open, not closed,
        and no pump has failed."""
        if self._thread is not None:
            return self._thread.is_alive()
        return self.sub is not None and not self._stop.is_set() and not self._failed

    @property
    def backlog(self) -> int:
        """Caller-driven: pieces taken and not applied yet."""
        return len(self._pending)

    def problems(self) -> tuple[int, str]:
        """Run-time stream changes the subscriber could not apply, and the last reason."""
        sub = self.sub
        return (0, "") if sub is None else (sub.change_errors, sub.last_change_error)

    def pump(self, max_items: int) -> bool:
        """One bounded turn of a caller-driven ingest: when nothing taken is left, take up
        to ``max_items`` ready deliveries (no wait); apply one piece of what was taken;
        refresh the stats when due. True when more is ready now (call again soon), False
        when the caller may let deliveries gather. The subscriber is polled again only when
        every piece taken is applied, so a stream's removal comes after all its items."""
        sub = self.sub
        if sub is None or self._stop.is_set():
            return False
        try:
            more = False
            if not self._pending:
                items = sub.poll_many(0, max_items=max_items)
                more = len(items) >= max_items
                self._pending.extend(pieces(items))
            if self._pending:
                piece = self._pending.popleft()
                self._apply(piece, [piece])
                self.pumps += 1
            now = time.monotonic()
            if now >= self._next_stats:
                self.stats = sub.stats()
                self._next_stats = now + STATS_EVERY
        except BaseException:
            self._failed = True
            raise
        return more or bool(self._pending)

    def wake_fds(self, known: int) -> tuple[int, list[int] | None]:
        """Caller-driven: what to watch between pumps (``Subscriber.wake_fds``), with its
        generation; None when it is still ``known``'s; nothing once closed."""
        sub = self.sub
        if sub is None or self._stop.is_set():
            return -1, []
        if sub.generation == known:
            return known, None
        return sub.wake_fds()

    def due(self) -> float:
        """Caller-driven, after a pump that left nothing in hand: when the next one is due
        (``time.monotonic()``; now if something waits to be read) without a wake-up, for
        the subscriber's deadlines and the stats' refresh."""
        sub = self.sub
        if sub is None or self._stop.is_set():
            return math.inf
        if sub.ready_now():
            return 0.0
        return min(sub.next_deadline(), self._next_stats)

    def _run(self) -> None:
        try:
            with self.lock:
                sub = self.sub = self._open()
        except BaseException as e:  # bad endpoint etc.: reported by start()
            self._error = e
            self._started.set()
            return
        self._started.set()
        next_stats = 0.0
        try:
            while not self._stop.is_set():
                # Asleep until something arrives, the subscriber's next deadline (it wakes
                # for those itself) or the stats' refresh; close() wakes it at once.
                items = sub.poll_many(max(0.0, next_stats - time.monotonic()),
                                      max_items=BATCH_ITEMS)
                self.polls += 1
                if items:
                    self._apply(items, None)
                    if len(items) < BATCH_ITEMS:
                        # Let deliveries gather for a moment: a wake-up per INGEST_NAP instead
                        # of one per batch at 10k batches/s is far less GIL ping-pong with the
                        # HTTP thread; the index is at most that much later for it.
                        time.sleep(INGEST_NAP)
                now = time.monotonic()
                if now >= next_stats:
                    self.stats = sub.stats()
                    next_stats = now + STATS_EVERY
        except BaseException:  # pragma: no cover - logged, the service reports unhealthy
            log.exception("router subscriber thread failed")
            if self._on_fail is not None:
                self._on_fail()
        finally:
            with self.lock:  # (close() wakes it under the lock: never once closed)
                sub.close()

"""A subscriber feeding a prefix index: :class:`Feed` follows streams (ZeroMQ, or one
JetStream stream with ``nats``), applies what they deliver to a
:class:`~kvwire.index.PrefixIndex` under one lock, and notes each stream's liveness, resets
and last item. Streams are added and removed at run time; streams that nobody named yet are
handed to ``on_new`` (a router's discovery of engines on a JetStream stream).

Both the router (:class:`~kvwire.routing.core.RouterCore`, whose routing targets are
``owned`` streams) and the RFC #1403 indexer (registrations only) hold one.

Concurrency: whoever takes the deliveries (:class:`~.ingest.Ingest`: a thread of its own,
or the caller's :meth:`Feed.pump`) is the index's only writer; it applies them in small
pieces (:func:`.slices.pieces`) under ``lock``, so a reader waits at most one piece (plus,
after a restart, one snapshot piece).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..consume.stream import Batch, Liveness, Reset, Snapshot, StreamConfig
from ..consume.subscriber import StreamSpec, Subscriber
from .ingest import Ingest
from .slices import pieces

__all__ = ["Feed"]

log = logging.getLogger("kvwire.router")


class Feed:
    """Streams -> subscriber -> ``index``, with each stream's liveness.

    ``index``: a :class:`~kvwire.index.PrefixIndex` (or one with its API; made with
    ``predict_ttl`` and ``clock`` if not given). ``lock`` guards the index and the maps below;
    ``lock_timeout`` is how long a reader should wait for it. ``owned``: the streams an owner
    (the router) follows as its own, set by it; every other stream followed is ``extra``
    (added by :meth:`add_stream`). ``on_new(streams)``: called from the ingest with streams
    that delivered and are neither owned nor extra."""

    def __init__(self, specs: Sequence[StreamSpec] = (), *, index: Any = None,
                 predict_ttl: float = 3.0, stream_config: StreamConfig | None = None,
                 nats: Any = None, lock_timeout: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if index is None:
            from ..index import PrefixIndex

            index = PrefixIndex(predict_ttl=predict_ttl, clock=clock)
        self.index = index
        self.clock = clock
        self.lock_timeout = lock_timeout
        self.lock = threading.Lock()
        self.specs: list[StreamSpec] = list(specs)
        self.stream_config = stream_config
        self.nats = nats  # a kvwire.nats.NatsStreams: the streams come from JetStream
        self.alive: dict[str, bool] = {}
        self.resets: dict[str, int] = {}
        self.last_item: dict[str, float] = {}
        self.deliveries = 0
        self.apply_errors = 0
        self.owned: set[str] | frozenset[str] = frozenset()
        # run-time streams (the indexer API's registrations): not an owner's
        self.extra: set[str] = set()
        self.on_new: Callable[[set[str]], None] | None = None
        self.ingest = Ingest(self._open_subscriber, self._apply, on_fail=self.all_down)

    # ------------------------------------------------------------------ the ingest

    def start(self, timeout: float = 10.0, *, thread: bool = True) -> None:
        """Start following the streams: by default a subscriber thread owns the sockets
        (raises if it could not start); with ``thread=False`` the subscriber is opened here
        and the caller drives the ingest with :meth:`pump` (``kvwire index`` does, from its
        HTTP loop: indexer/ingest.py)."""
        self.ingest.start(timeout, thread=thread)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the ingest and close its sockets."""
        self.ingest.close(timeout)

    @property
    def closed(self) -> bool:
        """``close()`` was called."""
        return self.ingest.closed

    @property
    def sub_stats(self) -> dict[str, Any]:
        """The subscriber's per-stream stats (refreshed every 0.25 s)."""
        return self.ingest.stats

    @property
    def pumps(self) -> int:
        """Caller-driven ingest turns that applied a piece."""
        return self.ingest.pumps

    def pump(self, max_items: int) -> bool:
        """One bounded turn of a caller-driven ingest (``start(thread=False)``):
        :meth:`.ingest.Ingest.pump`."""
        return self.ingest.pump(max_items)

    def stream_problems(self) -> tuple[int, str]:
        """Run-time stream changes the subscriber could not apply (e.g. a collector
        endpoint it could not bind), and the last reason."""
        return self.ingest.problems()

    def all_down(self) -> None:
        """Mark every stream down (the ingest failed: nothing is followed any more)."""
        self.alive = dict.fromkeys(self.alive, False)

    def _open_subscriber(self) -> Subscriber:
        return Subscriber([self.nats] if self.nats is not None else self.specs,
                          config=self.stream_config)

    # ------------------------------------------------------------------ run-time streams

    def add_stream(self, spec: StreamSpec) -> None:
        """Follow one more ZeroMQ stream (any thread; not an owner's: its blocks are
        answered by the indexer API). Raises ValueError for a name already followed or a
        bad endpoint."""
        with self.ingest.lock:
            if spec.name in self.extra or spec.name in self.owned:
                raise ValueError(f"stream {spec.name!r} is already followed")
            if self.ingest.sub is None:
                self.specs.append(spec)  # not started yet: it starts with the rest
            else:
                self.ingest.sub.add(spec)
            self.extra.add(spec.name)

    def remove_stream(self, name: str) -> bool:
        """Stop following a stream added by :meth:`add_stream` and drop its blocks from the
        index (done in the subscriber thread as the subscriber lets go of it: every item of
        it handed out before is applied, none comes after); False if it was not followed."""
        with self.ingest.lock:
            if name not in self.extra:
                return False
            self.extra.discard(name)
            if self.ingest.sub is None:
                self.specs = [s for s in self.specs if s.name != name]
                self.forget(name)
            else:
                self.ingest.sub.remove(name, then=self.forget)
        return True

    def forget(self, name: str) -> None:
        """Drop a stream let go of: its blocks, its liveness and counts (an owned stream,
        removed and added again meanwhile, starts unknown again)."""
        with self.lock:
            self.index.remove_stream(name)
            self.last_item.pop(name, None)
            self.resets.pop(name, None)
            if name in self.owned:
                # Removed and added again meanwhile: the items just applied were the old
                # stream's, so the new one starts unknown, as any added stream does.
                self.alive[name] = False
                self.resets[name] = 0
            else:
                self.alive.pop(name, None)

    # ------------------------------------------------------------------ applying

    def _apply(self, items: list, cut: list[list] | None = None) -> None:
        """Apply deliveries to the index, one lock hold per piece (``cut``: ``items``
        already cut into pieces, as :meth:`pump` takes them), then note liveness."""
        now = self.clock()
        apply = self.index.apply
        for piece in pieces(items) if cut is None else cut:
            with self.lock:  # one short hold per piece: routes interleave with a rebuild
                for it in piece:
                    try:
                        apply(it)
                    except Exception as e:  # one bad delivery must not stop the feed
                        self.apply_errors += 1
                        log.warning("index could not apply %s of %s: %s",
                                    type(it).__name__, getattr(it, "stream", "?"), e)
        self.deliveries += len(items)
        alive, last = self.alive, self.last_item
        for it in items:
            s = it.stream
            if isinstance(it, Batch | Snapshot):
                alive[s] = True
                last[s] = now
            elif isinstance(it, Liveness):
                alive[s] = it.alive
            elif isinstance(it, Reset):
                self.resets[s] = self.resets.get(s, 0) + 1
        on_new = self.on_new
        if on_new is not None:
            known, extra = self.owned, self.extra
            new = {it.stream for it in items if it.stream not in known} - extra
            if new:
                on_new(new)

"""A :class:`~kvwire.nats.consumer.NatsSource` on a background thread, feeding a
:class:`~kvwire.consume.Subscriber`: the asyncio NATS client keeps its own loop, the
Subscriber keeps its zmq poller, and an inproc PAIR socket is how one wakes the other.

Acks follow the application: an item counts as done when the application comes back for
more (``poll`` again) or calls ``Subscriber.commit()``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from ..consume.items import Delivery
from .consumer import Handout, NatsSource
from .stats import NatsStats

if TYPE_CHECKING:
    from .streams import NatsStreams

__all__ = ["NatsLink"]

log = logging.getLogger("kvwire.nats.consumer")


class NatsLink:
    """A :class:`NatsSource` on a background thread, feeding a Subscriber: a bounded deque
    of entries plus an inproc PAIR socket whose readability wakes the Subscriber's poller."""

    def __init__(self, spec: NatsStreams, ctx: Any) -> None:
        import zmq

        self.spec = spec
        self.source = NatsSource(spec)
        self.entries: deque[Handout] = deque()
        self.lock = threading.Lock()
        addr = f"inproc://kvwire-nats-{id(self):x}-{time.monotonic_ns()}"
        self.socket = ctx.socket(zmq.PAIR)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(addr)
        self._tx = ctx.socket(zmq.PAIR)
        self._tx.setsockopt(zmq.LINGER, 0)
        self._tx.setsockopt(zmq.SNDHWM, 1)
        self._tx.connect(addr)
        self._zmq = zmq
        self._handed: deque[tuple[int, int]] = deque()  # (ready index, ack js seq)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._room: asyncio.Event | None = None
        self._waiting = False  # the source waits for room in the Subscriber's queue
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name="kvwire-nats", daemon=True)
        self._thread.start()
        self._started.wait(5)

    # ---------------------------------------------------------------- background thread

    def _main(self) -> None:
        asyncio.run(self._amain())

    async def _amain(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._room = asyncio.Event()
        self._started.set()
        src = self.source
        limit = self.spec.max_pending

        async def put(entries: list[Handout]) -> None:
            if not entries:
                return
            with self.lock:
                self.entries.extend(entries)
            with contextlib.suppress(self._zmq.Again):
                self._tx.send(b"", self._zmq.NOBLOCK)

        def room() -> bool:
            return len(self.entries) < limit

        async def wait_room() -> None:
            self._room.clear()
            self._waiting = True  # before the check: drain() empties, then looks at this
            try:
                if not room():
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._room.wait(), 0.25)
            finally:
                self._waiting = False

        try:
            await src.run(put, room, wait_room)
        except Exception as e:  # pragma: no cover - logged; stats show it
            src.last_error = f"consumer thread failed: {e}"
            log.exception("nats consumer thread failed")
        finally:
            with contextlib.suppress(Exception):
                await src._ack()
            await src.close()

    # ---------------------------------------------------------------- subscriber side

    def drain(self, ready: deque[Delivery], popped: int) -> None:
        """Move waiting items into the Subscriber's ready queue (the wake bytes go too)."""
        zmq = self._zmq
        while True:
            try:
                self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        with self.lock:  # all of them: the source holds at most max_pending + fetch
            entries, self.entries = self.entries, deque()
        if not entries:
            return
        handed = self._handed
        append = ready.append
        for item, ack in entries:
            if item is not None:
                append(item)
            handed.append((popped + len(ready), ack))
        if self._waiting and self._room is not None:
            # Only while the source waits for room: waking its loop on every drain cost that
            # thread a wakeup (and the GIL) per delivery, for nothing.
            self._in_loop(self._room.set)

    def _in_loop(self, fn: Any) -> None:
        """Run ``fn`` on the source's loop soon. The loop closes when its thread ends (after a
        stop, or a failure) at any moment, checks included: then nothing is left to wake."""
        if self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # "Event loop is closed"
            self._loop.call_soon_threadsafe(fn)

    def _stop_in_loop(self) -> None:
        self.source.stop()
        if self._room is not None:
            self._room.set()

    def done(self, popped: int) -> None:
        """The application came back after ``popped`` items in total: those are done."""
        h = self._handed
        last = None
        while h and h[0][0] <= popped:
            last = h.popleft()[1]
        if last is not None and last > self.source.done_js:
            self.source.done_js = last

    def commit(self, timeout: float = 5.0) -> bool:
        """Ack (and wait for the server to confirm) all the application is done with."""
        if self._loop is None or self.spec.durable is None:
            return False
        fut = asyncio.run_coroutine_threadsafe(self.source.commit(), self._loop)
        try:
            fut.result(timeout)
            return True
        except Exception:
            return False

    def stats(self) -> NatsStats:
        return self.source.stats()

    def subscriber_stats(self) -> dict[str, Any]:
        """Per engine stream, in the Subscriber's shape (phase ``live`` once started).
        ``lost``, ``replays``, ``replayed`` and ``restarts`` are None (not applicable, shown
        as ``n/a``): nothing is replayed from NATS, and what a gap lost or a reset marker
        meant was counted by the bridge, not here (``gaps``, ``resyncs``, ``resets`` are)."""
        from ..consume.stream import StreamStats
        from ..consume.subscriber import SubscriberStats

        out = {}
        for st in list(self.source.tracker.subjects.values()):
            c = st.c
            ss = StreamStats(
                stream=st.stream, phase="live" if st.seq is not None else "bootstrap",
                mode="nats", epoch=st.epoch, last_seq=st.seq, exact=st.exact,
                alive=self.source.connected, live_messages=c["batches"], batches=c["batches"],
                events=c["events"], duplicates=c["duplicates"], gaps=c["gaps"], lost=None,
                replays=None, replayed=None, snapshots=c["snapshots"], resyncs=c["resyncs"],
                resets=c["resets"], restarts=None, buffer_overflows=0, buffered=0, timeouts=0,
                error_replies=0, bad_frames=0, bad_payloads=c["bad_messages"], bad_events=0,
                stray_replies=0, deaths=0, last_error=None,
                state="syncing" if st.seq is None else "exact" if st.exact else "inexact")
            out[st.stream] = SubscriberStats(ss, 0, 0, 0)
        return out

    def close(self, timeout: float = 5.0) -> None:
        if self._thread.is_alive():
            self._in_loop(self._stop_in_loop)
            self._thread.join(timeout)
        for s in (self.socket, self._tx):
            if not s.closed:
                s.close(linger=0)

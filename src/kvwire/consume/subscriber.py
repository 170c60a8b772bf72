"""One subscriber for many publishers (engines x DP ranks), reliable per stream.

All protocol decisions live in :class:`kvwire.consume.stream.StreamMachine` (one per stream);
this module only moves bytes. A shared :class:`_Core` owns the sockets (a SUB for the live
stream and a DEALER for replay/INFO/SNAPSHOT per stream, never REQ) and turns readable
sockets and the passing of time into machine inputs. Two thin fronts drive the same core:

* sync: ``for item in sub:``, ``sub.poll(timeout)``, ``sub.run(callback)`` (``zmq.Poller``);
* asyncio: ``async for item in sub:``, ``await sub.apoll(timeout)`` (``zmq.asyncio.Poller``).

Every wait is bounded (by the caller's timeout and by the machines' own deadlines), so a
dead publisher is reported through :class:`~kvwire.consume.stream.Liveness`, never by hanging.
A Subscriber is not thread-safe: use it from one thread (or one event loop). The one
exception is :meth:`Subscriber.add` / :meth:`Subscriber.remove` (streams that come and go at
run time): any thread may call them; they queue the change and wake the polling thread, which
applies it (the sockets stay that thread's alone).
"""

from __future__ import annotations

import math
import os
import queue
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

import msgspec
import zmq
import zmq.asyncio

from ..wire.curve import CurveClient
from ..wire.endpoint import check_endpoint, offset_for_rank, subscriber_binds
from ..wire.frames import FrameReceiver, poll_ms
from .stream import (
    Batch,
    Delivery,
    Output,
    RecycleRequests,
    SendInfo,
    SendReplay,
    SendSnapshot,
    StreamConfig,
    StreamMachine,
    StreamStats,
)

__all__ = ["StreamSpec", "Subscriber", "SubscriberStats"]

#: Messages read from one socket per step, so one busy stream cannot starve the others.
_READ_SLICE = 1000
#: Longest single wait, so even a missed wake-up only costs this much latency.
_MAX_WAIT = 0.25


class StreamSpec(msgspec.Struct, frozen=True):
    """Where one publisher (one engine's DP rank) is; snapshots/INFO go to the replay endpoint."""

    name: str
    endpoint: str
    topic: str = ""
    replay_endpoint: str | None = None
    #: CurveZMQ keys for this publisher's live and replay sockets (see docs/operations.md).
    curve: CurveClient | None = None
    #: ``(epoch, seq)`` already held: resume after it if the publisher can (StreamMachine).
    resume: tuple[int, int] | None = None
    #: The seq a publisher run begins at: 0 (vLLM, SGLang, kvwire), 1 (Mooncake Store's
    #: RFC #1527 publisher). Following a run from it is an exact start.
    first_seq: int = 0

    @classmethod
    def for_ranks(
        cls, name: str, endpoint: str, ranks: int, topic: str = "",
        replay_endpoint: str | None = None, curve: CurveClient | None = None,
        first_seq: int = 0,
    ) -> list[StreamSpec]:
        """Specs for DP ranks ``0..ranks-1`` of one engine (spec: port + rank), named ``name/dpR``."""
        return [
            cls(
                f"{name}/dp{r}", offset_for_rank(endpoint, r), topic,
                None if replay_endpoint is None else offset_for_rank(replay_endpoint, r),
                curve, first_seq=first_seq,
            )
            for r in range(ranks)
        ]


class SubscriberStats(msgspec.Struct, frozen=True):
    """I/O-level counters of one stream (protocol counters are in ``stream``)."""

    stream: StreamStats
    requests_sent: int
    request_send_failures: int
    request_sockets_recycled: int


class _Stream:
    __slots__ = ("spec", "machine", "sub", "dealer", "sent", "send_failures", "recycled")

    def __init__(self, spec: StreamSpec, machine: StreamMachine) -> None:
        self.spec = spec
        self.machine = machine
        self.sub: zmq.Socket | None = None
        self.dealer: zmq.Socket | None = None
        self.sent = 0
        self.send_failures = 0
        self.recycled = 0


def _attach(sock: zmq.Socket, endpoint: str, curve: CurveClient | None) -> None:
    if endpoint.startswith("tcp://") and ("[" in endpoint or "::" in endpoint):
        sock.setsockopt(zmq.IPV6, 1)
    if curve is not None:
        curve.apply(sock)
    # A consumer binds only a wildcard tcp address (collector mode); ipc/inproc and
    # concrete hosts belong to the publisher.
    if subscriber_binds(endpoint):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


class _Core:
    """Sockets + machines; non-blocking steps shared by the sync and async fronts."""

    def __init__(
        self, specs: Sequence[StreamSpec], config: StreamConfig | None, ctx: zmq.Context,
        rcvhwm: int,
    ) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"stream names must be unique, got {names}")
        self.ctx = ctx
        self.rcvhwm = rcvhwm
        self.ready: deque[Delivery] = deque()
        self.streams: list[_Stream] = []
        self.by_socket: dict[zmq.Socket, tuple[_Stream, bool, FrameReceiver]] = {}
        self.generation = 0  # bumped whenever the socket set changes
        self.started = False
        self.links: list = []  # NATS sources (kvwire.nats.consumer.NatsLink)
        self.popped = 0  # items handed to the application so far (NATS acks follow it)
        self.config = config
        try:
            for spec in specs:
                self._open(spec)
        except BaseException:
            self.close()
            raise

    def _open(self, spec: StreamSpec) -> _Stream:
        """The stream's machine and sockets (its live SUB, and a DEALER with replay)."""
        check_endpoint(spec.endpoint, f"{spec.name}.endpoint")
        if spec.replay_endpoint is not None:
            check_endpoint(spec.replay_endpoint, f"{spec.name}.replay_endpoint")
        st = _Stream(spec, StreamMachine(
            spec.name, has_replay=spec.replay_endpoint is not None, config=self.config,
            resume_after=spec.resume, first_seq=spec.first_seq))
        self.streams.append(st)
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
        sub.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
        st.sub = sub
        self.by_socket[sub] = (st, True, FrameReceiver(sub))
        self.generation += 1
        _attach(sub, spec.endpoint, spec.curve)
        if spec.replay_endpoint is not None:
            self._open_dealer(st)
        return st

    def add(self, spec: StreamSpec, now: float) -> None:
        """Follow one more stream from now on (started at once if the core is)."""
        if any(st.spec.name == spec.name for st in self.streams):
            raise ValueError(f"stream name {spec.name!r} is already followed")
        try:
            st = self._open(spec)
        except BaseException:
            self._drop(spec.name)
            raise
        if self.started:
            self._apply(st, st.machine.start(now))

    def remove(self, name: str) -> bool:
        """Stop following a stream: its sockets closed, its undelivered items dropped (so
        nothing of it is handed out after this); False if no such stream."""
        if not self._drop(name):
            return False
        # (a NATS link counts its items' positions in this queue: dropping earlier items
        # only makes it ack them later than it could, never before they are taken)
        if any(getattr(d, "stream", None) == name for d in self.ready):
            self.ready = deque(d for d in self.ready if getattr(d, "stream", None) != name)
        return True

    def _drop(self, name: str) -> bool:
        for st in self.streams:
            if st.spec.name == name:
                break
        else:
            return False
        self.streams.remove(st)
        for sock in (st.sub, st.dealer):
            if sock is not None:
                self.by_socket.pop(sock, None)
                if not sock.closed:
                    sock.close(linger=0)
        st.sub = st.dealer = None
        self.generation += 1
        return True

    def _open_dealer(self, st: _Stream) -> None:
        d = self.ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RCVHWM, 0)  # a replay answer must never be dropped half-way
        st.dealer = d
        self.by_socket[d] = (st, False, FrameReceiver(d))
        self.generation += 1
        _attach(d, st.spec.replay_endpoint, st.spec.curve)  # type: ignore[arg-type]

    def sockets(self) -> list[zmq.Socket]:
        """Live sockets first: a stream's live backlog is read before its replies."""
        subs = [s.sub for s in self.streams if s.sub is not None]
        return subs + [s.dealer for s in self.streams if s.dealer is not None] + [
            link.socket for link in self.links]

    def start(self, now: float) -> None:
        if not self.started:
            self.started = True
            for st in self.streams:
                self._apply(st, st.machine.start(now))

    def handle(self, events: list[tuple[zmq.Socket, int]]) -> None:
        """Read what the poller reported readable (live sockets before request sockets)."""
        ready = {s for s, ev in events if ev & zmq.POLLIN}
        for link in self.links:
            if link.socket in ready:
                link.drain(self.ready, self.popped)
        for sock in self.sockets():
            if sock in ready:
                self._read(sock)

    def _read(self, sock: zmq.Socket) -> None:
        entry = self.by_socket.get(sock)
        if entry is None or sock.closed:
            return
        st, is_live, rx = entry
        m = st.machine
        if is_live:
            # One slice: what waits now, up to _READ_SLICE messages, through the machine's
            # bulk path (one call each way instead of one per message).
            msgs = rx.recv_many(_READ_SLICE)
            if msgs:
                out = m.live_messages(msgs, time.monotonic())
                if out:
                    self._apply(st, out)
            return
        recv = rx.recv
        for _ in range(_READ_SLICE):
            frames = recv()
            if frames is None:
                return
            out = m.reply_frames(frames, time.monotonic())
            if out:
                self._apply(st, out)
                if sock.closed:  # recycled while applying: its receiver is gone too
                    return

    def tick(self, now: float) -> None:
        for st in self.streams:
            out = st.machine.tick(now)
            if out:
                self._apply(st, out)

    def next_deadline(self) -> float:
        return min((st.machine.next_deadline for st in self.streams), default=math.inf)

    def _apply(self, st: _Stream, outs: list[Output]) -> None:
        ready = self.ready
        for o in outs:
            t = type(o)
            if t is Batch:
                ready.append(o)
            elif t is SendInfo or t is SendReplay or t is SendSnapshot:
                if st.dealer is None:
                    continue
                try:
                    st.dealer.send_multipart(o.frames(), zmq.NOBLOCK)  # type: ignore[union-attr]
                    st.sent += 1
                except zmq.Again:
                    st.send_failures += 1  # the machine's timeout retries it
            elif t is RecycleRequests:
                if st.dealer is not None:
                    del self.by_socket[st.dealer]
                    st.dealer.close(linger=0)
                    st.recycled += 1
                    self._open_dealer(st)
            else:
                ready.append(o)  # type: ignore[arg-type]

    def stats(self) -> dict[str, SubscriberStats]:
        out = {
            st.spec.name: SubscriberStats(
                st.machine.stats(), st.sent, st.send_failures, st.recycled
            )
            for st in self.streams
        }
        for link in self.links:
            out.update(link.subscriber_stats())
        return out

    def close(self) -> None:
        for link in self.links:
            link.done(self.popped)  # closing: the application is done with what it took
            link.close()
        for st in self.streams:
            for sock in (st.sub, st.dealer):
                if sock is not None and not sock.closed:
                    sock.close(linger=0)
            st.sub = st.dealer = None
        self.by_socket.clear()
        self.generation += 1


class Subscriber:
    """Reliable consumer of many publishers' KV event streams.

    Yields :class:`~kvwire.consume.stream.Batch`, :class:`~kvwire.consume.stream.Reset`,
    :class:`~kvwire.consume.stream.Snapshot` and :class:`~kvwire.consume.stream.Liveness`
    items, each naming its stream. Per stream the order is always ``Reset, Snapshot(N),
    Batch(N+1), Batch(N+2), ...`` (repeated after a publisher restart or unrecoverable
    loss), so an application that clears on Reset, loads on Snapshot and applies Batches
    holds the engine's cache. ``rcvhwm`` bounds each live socket's queue (overflow shows up
    as gaps that are then replayed).
    """

    def __init__(
        self,
        streams: Sequence[StreamSpec],  # or kvwire.nats.NatsStreams (JetStream)
        *,
        config: StreamConfig | None = None,
        ctx: zmq.Context | None = None,
        rcvhwm: int = 100_000,
    ) -> None:
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.Context()
        try:
            nats = [s for s in streams if hasattr(s, "open_link")]
            self._core = _Core([s for s in streams if s not in nats], config, self._ctx, rcvhwm)
            self._core.links = [s.open_link(self._ctx) for s in nats]
        except BaseException:
            if self._own_ctx:
                self._ctx.term()
            raise
        self._poller: zmq.Poller | None = None
        self._apoller: zmq.asyncio.Poller | None = None
        self._gen = -1
        self._agen = -1
        self._closed = False
        self._woken = False  # wake() was called: the poll waiting now returns
        # run-time stream changes from any thread: queued, then a byte on the pipe wakes
        # the sync poller (the asyncio front picks them up within _MAX_WAIT)
        self._changes: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        #: run-time changes that failed (duplicate name, bad endpoint), and the last reason
        self.change_errors = 0
        self.last_change_error = ""

    # ------------------------------------------------------------------ run-time streams

    def add(self, spec: StreamSpec) -> None:
        """Follow ``spec`` too, from the next poll on (thread-safe). Its endpoints are
        checked here (``EndpointError``); a name already followed is refused when applied
        (counted in ``change_errors``)."""
        check_endpoint(spec.endpoint, f"{spec.name}.endpoint")
        if spec.replay_endpoint is not None:
            check_endpoint(spec.replay_endpoint, f"{spec.name}.replay_endpoint")
        self._change(("add", spec))

    def remove(self, name: str, then: Callable[[str], None] | None = None) -> None:
        """Stop following stream ``name`` (thread-safe): from the next poll on, nothing of
        it is handed out (items already queued for it are dropped). ``then(name)`` is called
        by the polling thread just after (e.g. to drop the stream's state: every item of it
        handed out before was taken, none comes after)."""
        self._change(("remove", (name, then)))

    def _change(self, op: tuple) -> None:
        if self._closed:
            raise RuntimeError("Subscriber is closed")
        self._changes.put(op)
        self._poke()

    def wake(self) -> None:
        """End a :meth:`poll` waiting in another thread now (it returns what is ready, maybe
        nothing): a thread that polls with long waits, to sleep between deadlines, can still
        be stopped at once. Thread-safe, but not against a :meth:`close` running meanwhile
        (the pipe's descriptor could be another file's by then): the caller orders the two."""
        self._woken = True
        if not self._closed:
            self._poke()

    def _poke(self) -> None:
        """A byte on the pipe: the sync poller's wait ends."""
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):  # pipe full (already woken) or closing
            pass

    def _apply_changes(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        core = self._core
        while True:
            try:
                op, arg = self._changes.get_nowait()
            except queue.Empty:
                return
            try:
                if op == "add":
                    core.add(arg, time.monotonic())
                else:
                    name, then = arg
                    core.remove(name)
                    if then is not None:
                        then(name)
            except Exception as e:  # reported, never raised into the polling loop
                self.change_errors += 1
                self.last_change_error = f"{op} {getattr(arg, 'name', arg)!r}: {e}"

    def names(self) -> list[str]:
        """Names of the ZeroMQ streams followed now."""
        return [st.spec.name for st in self._core.streams]

    # ------------------------------------------------------------------ shared

    def stats(self) -> dict[str, SubscriberStats]:
        """Per-stream counters (protocol and I/O), keyed by stream name."""
        return self._core.stats()

    def _pop(self) -> Delivery | None:
        core = self._core
        if self._closed:
            raise RuntimeError("Subscriber is closed")
        if not self._changes.empty():
            self._apply_changes()
        core.start(time.monotonic())
        for link in core.links:  # what was handed out before this call is done: ack it
            link.done(core.popped)
        if core.ready:
            core.popped += 1
            return core.ready.popleft()
        return None

    def _wait_for(self, deadline: float) -> float:
        now = time.monotonic()
        return max(0.0, min(deadline, self._core.next_deadline(), now + _MAX_WAIT) - now)

    # ------------------------------------------------------------------ sync front

    def _sync_poller(self) -> zmq.Poller:
        if self._poller is None or self._gen != self._core.generation:
            p = zmq.Poller()
            for s in self._core.sockets():
                p.register(s, zmq.POLLIN)
            p.register(self._wake_r, zmq.POLLIN)  # add()/remove() from another thread
            self._poller, self._gen = p, self._core.generation
        return self._poller

    def poll(self, timeout: float | None = None) -> Delivery | None:
        """Next item, waiting at most ``timeout`` seconds (None: until one arrives)."""
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        polled = False
        while True:
            item = self._pop()
            if item is not None:
                return item
            if polled and time.monotonic() >= deadline:
                return None
            events = self._sync_poller().poll(poll_ms(self._wait_for(deadline)))
            if events and events[-1][0] == self._wake_r:  # registered last: reported last
                self._apply_changes()  # (also drains the pipe, so the next poll waits)
            self._core.handle(events)
            # Time-outs are judged after reading what arrived: after a stall of this
            # process, replies already waiting must count, not time out unread.
            self._core.tick(time.monotonic())
            polled = True
            if self._woken:
                self._woken = False
                return self._pop()

    def poll_many(self, timeout: float | None = None, max_items: int = 1000) -> list[Delivery]:
        """Every item ready now, up to ``max_items``, waiting at most ``timeout`` for the
        first (``[]`` if none came). The same items in the same order as calling
        :meth:`poll` repeatedly, at less cost per item: the call for high event rates."""
        first = self.poll(timeout)
        return [] if first is None else self._more(first, max_items)

    def _more(self, first: Delivery, max_items: int) -> list[Delivery]:
        out = [first]
        ready = self._core.ready
        n = min(len(ready), max_items - 1)
        if n > 0:
            popleft = ready.popleft
            out += [popleft() for _ in range(n)]
            self._core.popped += n
        return out

    def commit(self, timeout: float = 5.0) -> bool:
        """NATS durable consumers: acknowledge every item handed out so far and wait for the
        server's confirmation (else items are acked when the application polls again)."""
        core = self._core
        for link in core.links:
            link.done(core.popped)
        return all([link.commit(timeout) for link in core.links])

    def nats_stats(self) -> list:
        """Counters of each NATS source (:class:`kvwire.nats.consumer.NatsStats`)."""
        return [link.stats() for link in self._core.links]

    def __iter__(self) -> Iterator[Delivery]:
        while True:
            item = self.poll(None)
            if item is not None:
                yield item

    def run(
        self, callback: Callable[[Delivery], None], *, timeout: float | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        """Call ``callback`` for every item until ``stop()`` is true or ``timeout`` passes."""
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        while stop is None or not stop():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            item = self.poll(min(left, _MAX_WAIT))
            if item is not None:
                callback(item)

    # ------------------------------------------- driven from someone else's event loop

    @property
    def generation(self) -> int:
        """Changes whenever the sockets do (a stream added or removed, a DEALER renewed)."""
        return self._core.generation

    def wake_fds(self) -> tuple[int, list[int]]:
        """For a loop that calls :meth:`poll_many` with no wait when something may be ready,
        and sleeps otherwise: the file descriptors to watch (each socket's ``zmq.FD``, and
        the pipe that run-time changes write to), and a generation that changes when they
        do. They signal edges, as ZeroMQ's do: before sleeping on them, ask
        :meth:`ready_now`; and wake at :meth:`next_deadline` too. A socket closes with its
        stream: watch a copy (``os.dup``), so that its number is not taken by a new socket
        while still watched."""
        core = self._core
        return core.generation, [s.getsockopt(zmq.FD) for s in core.sockets()] + [self._wake_r]

    def ready_now(self) -> bool:
        """Something waits to be read (a message, a reply, a run-time change). The check a
        loop makes after a poll, before it sleeps on :meth:`wake_fds`: a request this poll
        sent may have taken the wake-up of a message that came meanwhile."""
        return bool(self._sync_poller().poll(0))

    def next_deadline(self) -> float:
        """When (``time.monotonic()``) a poll is due even if nothing arrives: a request's
        timeout, a retry, a liveness or tail check."""
        return self._core.next_deadline()

    # ------------------------------------------------------------------ asyncio front

    def _async_poller(self) -> zmq.asyncio.Poller:
        if self._apoller is None or self._agen != self._core.generation:
            p = zmq.asyncio.Poller()
            for s in self._core.sockets():
                p.register(s, zmq.POLLIN)
            self._apoller, self._agen = p, self._core.generation
        return self._apoller

    async def apoll(self, timeout: float | None = None) -> Delivery | None:
        """Like :meth:`poll`, without blocking the event loop."""
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        polled = False
        while True:
            item = self._pop()
            if item is not None:
                return item
            if polled and time.monotonic() >= deadline:
                return None
            wait_ms = poll_ms(self._wait_for(deadline))
            events = await self._async_poller().poll(wait_ms)
            self._core.handle(events)
            self._core.tick(time.monotonic())  # after reading, as in poll()
            polled = True

    async def apoll_many(self, timeout: float | None = None,
                         max_items: int = 1000) -> list[Delivery]:
        """Like :meth:`poll_many`, without blocking the event loop."""
        first = await self.apoll(timeout)
        return [] if first is None else self._more(first, max_items)

    def __aiter__(self) -> AsyncIterator[Delivery]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[Delivery]:
        while True:
            item = await self.apoll(None)
            if item is not None:
                yield item

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close every socket at once (linger 0). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._core.close()
        self._poller = self._apoller = None
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Subscriber:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
